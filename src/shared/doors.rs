//! Whether a bridge's endpoints let clients in yet. A bridge started again first routes
//! what its earlier run accepted and had not delivered (a bridge alone from its store, one
//! of a fleet as it reads its stream again); a client let in before could be sent, or send,
//! something that overtakes it. Until the doors open, the endpoints' listeners are bound
//! but accept nothing: a client's connection waits in the listen backlog, and `/readyz`
//! says the bridge is starting.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

/// Shared by every listener of the bridge's endpoints; closed until `open`.
#[derive(Clone, Default)]
pub struct Doors(Arc<State>);

#[derive(Default)]
struct State {
    open: AtomicBool,
    opened: Notify,
}

impl Doors {
    /// Doors open from the start (the operations listener's).
    pub fn always_open() -> Doors {
        let doors = Doors::default();
        doors.open();
        doors
    }

    /// Lets clients in, from now on.
    pub fn open(&self) {
        self.0.open.store(true, Ordering::Release);
        self.0.opened.notify_waiters();
    }

    pub fn is_open(&self) -> bool {
        self.0.open.load(Ordering::Acquire)
    }

    /// Ends once the doors are open.
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
    async fn a_wait_ends_once_the_doors_open() {
        let doors = Doors::default();
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
