//! Task events in the order their changes committed.
//!
//! The store commits many writes together and then wakes their callers, which run in any
//! order: a caller announcing its change once woken could tell members of an older state
//! of a task after a newer one. So each task write is told of its change as it commits
//! (`Store::write_then`: on the store's thread, in commit order) and sends it here, and one
//! task announces the changes in that order.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::Tracker;
use super::db::{TaskChanged, TaskRow};

/// A change of a task: the row before (none for a new task) and after.
type Change = (Option<TaskRow>, TaskRow);

/// Where task writes send their changes as they commit.
pub struct TaskEvents(mpsc::UnboundedSender<Change>);

/// The changes sent, for `announce`.
pub struct Committed(mpsc::UnboundedReceiver<Change>);

pub fn channel() -> (TaskEvents, Committed) {
    let (tx, rx) = mpsc::unbounded_channel();
    (TaskEvents(tx), Committed(rx))
}

impl TaskEvents {
    /// What a task write calls as its change commits.
    pub fn on_commit(&self) -> impl TaskChanged {
        let tx = self.0.clone();
        move |before: Option<&TaskRow>, after: &TaskRow| {
            let _ = tx.send((before.cloned(), after.clone()));
        }
    }
}

/// Announces each committed change to this bridge's connections, in commit order, until
/// the bridge stops.
pub fn announce(tracker: Arc<Tracker>, mut committed: Committed) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let change = tokio::select! {
                _ = tracker.shutdown.cancelled() => return,
                change = committed.0.recv() => change,
            };
            let Some((before, after)) = change else {
                return;
            };
            tracker.announce_task(before.as_ref(), &after);
        }
    })
}
