//! A flag that, once open, stays open, and that can be waited for. A bridge has two: its
//! endpoints listening (`admin::Readiness`), and its doors, which let clients in. A bridge
//! started again first routes what its earlier run accepted and had not delivered (a
//! bridge alone from its store, one of a fleet as it reads its stream again); a client let
//! in before could be sent, or send, something that overtakes it. Until the doors open,
//! the endpoints' listeners are bound but accept nothing: a client's connection waits in
//! the listen backlog, and `/readyz` says the bridge is starting.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

/// Closed until `open`; clones share it.
#[derive(Clone, Default)]
pub struct Latch(Arc<State>);

#[derive(Default)]
struct State {
    open: AtomicBool,
    opened: Notify,
}

impl Latch {
    /// Open from the start (the operations listener's doors).
    pub fn always_open() -> Latch {
        let latch = Latch::default();
        latch.open();
        latch
    }

    /// Opens it, for good.
    pub fn open(&self) {
        self.0.open.store(true, Ordering::Release);
        self.0.opened.notify_waiters();
    }

    pub fn is_open(&self) -> bool {
        self.0.open.load(Ordering::Acquire)
    }

    /// Ends once it is open.
    pub async fn opened(&self) {
        loop {
            // Registered before the look: an `open` in between still wakes it.
            let woken = self.0.opened.notified();
            if self.is_open() {
                return;
            }
            woken.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wait_ends_once_it_opens() {
        let doors = Latch::default();
        let waiting = tokio::spawn({
            let doors = doors.clone();
            async move { doors.opened().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished() && !doors.is_open());
        doors.open();
        let waited = tokio::time::timeout(std::time::Duration::from_secs(10), waiting).await;
        assert!(waited.is_ok_and(|w| w.is_ok()));
        doors.opened().await;
    }
}
