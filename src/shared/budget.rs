//! A bridge-wide budget of bytes, taken by large inbound WebSocket messages and HTTP
//! request bodies while they are read and held, so that many connections cannot each pin
//! a message of the largest allowed size.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Inbound messages and request bodies of at least this many bytes take from the budget;
/// smaller ones are the common case and are not counted.
pub const BUDGETED_BYTES: u64 = 64 * 1024;

/// Bytes that may be reserved at once across the bridge. Cheap to clone: clones share one
/// budget.
#[derive(Clone, Debug)]
pub struct ByteBudget {
    bytes: usize,
    permits: Arc<Semaphore>,
}

/// Bytes taken from a [`ByteBudget`], given back when dropped.
#[derive(Debug)]
pub struct Reserved(OwnedSemaphorePermit);

impl Reserved {
    pub fn bytes(&self) -> u64 {
        self.0.num_permits() as u64
    }

    /// Holds `other`'s bytes too, until this is dropped.
    pub fn merge(&mut self, other: Reserved) {
        self.0.merge(other.0);
    }
}

impl ByteBudget {
    pub fn new(bytes: usize) -> Self {
        let bytes = bytes.min(Semaphore::MAX_PERMITS);
        ByteBudget {
            bytes,
            permits: Arc::new(Semaphore::new(bytes)),
        }
    }

    /// The budget's size.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes not reserved now.
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }

    /// Reserves `bytes` now, or `None` when that many are not free (never waits).
    pub fn try_reserve(&self, bytes: u64) -> Option<Reserved> {
        let bytes = u32::try_from(bytes).ok()?;
        self.permits
            .clone()
            .try_acquire_many_owned(bytes)
            .ok()
            .map(Reserved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_given_back_when_dropped() {
        let budget = ByteBudget::new(100);
        let a = budget.try_reserve(60).expect("free");
        assert!(budget.try_reserve(60).is_none(), "only 40 are left");
        let b = budget.try_reserve(40).expect("exactly what is left");
        assert_eq!(budget.available(), 0);
        drop(a);
        drop(b);
        assert_eq!(budget.available(), 100);
        assert!(
            budget.try_reserve(101).is_none(),
            "more than the whole budget"
        );
        assert!(budget.try_reserve(u64::MAX).is_none());
    }
}
