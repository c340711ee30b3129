//! Task events in the order their changes were written.
//!
//! The store commits many writes together and then wakes their callers, which run in any
//! order: a caller announcing its change once woken could tell members of an older state
//! of a task after a newer one. So each change takes its place in line as it is written
//! (on the store's thread, in commit order), and is announced once it and every change
//! before it are settled — by whichever of their callers wakes last.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::db::{TaskRow, TaskWritten};

/// A change of a task as written: the row before (none for a new task) and after.
pub type Change = (Option<TaskRow>, TaskRow);

/// What was written and not yet announced, in the order written.
pub struct Line<T = Change> {
    waiting: Mutex<VecDeque<Waiting<T>>>,
    next_ticket: AtomicU64,
}

impl<T> Default for Line<T> {
    fn default() -> Self {
        Line {
            waiting: Mutex::default(),
            next_ticket: AtomicU64::default(),
        }
    }
}

struct Waiting<T> {
    ticket: u64,
    written: T,
    settled: bool,
}

impl<T: Send + 'static> Line<T> {
    /// A ticket for one write, taken before it is queued.
    pub fn ticket(self: &Arc<Self>) -> Ticket<T> {
        Ticket {
            line: self.clone(),
            number: self.next_ticket.fetch_add(1, Ordering::Relaxed),
            settled: false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Waiting<T>>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Settles `ticket`'s change: dropped if it was not written.
    fn mark(waiting: &mut VecDeque<Waiting<T>>, ticket: u64, written: bool) {
        if let Some(at) = waiting.iter().position(|w| w.ticket == ticket) {
            if written {
                waiting[at].settled = true;
            } else {
                waiting.remove(at);
            }
        }
    }

    /// Settles `ticket`'s change; what can be announced now, in order.
    fn settle(&self, ticket: u64, written: bool) -> Vec<T> {
        let mut waiting = self.lock();
        Self::mark(&mut waiting, ticket, written);
        let mut ready = Vec::new();
        while waiting.front().is_some_and(|w| w.settled) {
            ready.extend(waiting.pop_front().map(|w| w.written));
        }
        ready
    }
}

/// One write's place in line.
pub struct Ticket<T: Send + 'static = Change> {
    line: Arc<Line<T>>,
    number: u64,
    settled: bool,
}

impl<T: Send + 'static> Ticket<T> {
    /// What the write calls with what it wrote, inside its store transaction.
    fn recorder(&self) -> impl FnOnce(T) + Send + 'static {
        let (line, ticket) = (self.line.clone(), self.number);
        move |written| {
            line.lock().push_back(Waiting {
                ticket,
                written,
                settled: false,
            })
        }
    }

    /// The write was answered: committed (`written`) or not. What can be announced now,
    /// this write's change among it if it is its turn, in the order written.
    pub fn settle(mut self, written: bool) -> Vec<T> {
        self.settled = true;
        self.line.settle(self.number, written)
    }
}

impl Ticket<Change> {
    /// For a task write (`db::TaskWritten`).
    pub fn on_written(&self) -> impl TaskWritten {
        let record = self.recorder();
        move |before: Option<&TaskRow>, after: &TaskRow| record((before.cloned(), after.clone()))
    }
}

impl<T: Send + 'static> Drop for Ticket<T> {
    /// A write whose caller stopped waiting is taken as written (it almost always is): its
    /// change is announced by the next write settled after it, rather than holding the
    /// line for good.
    fn drop(&mut self) {
        if !self.settled {
            Line::mark(&mut self.line.lock(), self.number, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_waits_for_those_written_before_it() {
        let line = Arc::new(Line::default());
        let (first, second, third) = (line.ticket(), line.ticket(), line.ticket());
        // Written in the order first, third, second; answered third, second, first.
        first.recorder()("a");
        third.recorder()("c");
        second.recorder()("b");
        assert!(third.settle(true).is_empty());
        assert!(second.settle(true).is_empty());
        assert_eq!(first.settle(true), ["a", "c", "b"]);
    }

    #[test]
    fn a_change_not_written_or_not_waited_for_does_not_hold_the_line() {
        let line = Arc::new(Line::default());
        let (failed, dropped, last) = (line.ticket(), line.ticket(), line.ticket());
        failed.recorder()("failed");
        dropped.recorder()("dropped");
        last.recorder()("last");
        drop(dropped);
        assert_eq!(failed.settle(false), ["dropped"]);
        assert_eq!(last.settle(true), ["last"]);
    }

    #[test]
    fn a_write_that_changed_nothing_settles_without_a_place() {
        let line = Arc::new(Line::<&str>::default());
        let (unchanged, changed) = (line.ticket(), line.ticket());
        changed.recorder()("changed");
        assert!(unchanged.settle(true).is_empty());
        assert_eq!(changed.settle(true), ["changed"]);
    }
}
