//! The order in which keys first came: listings sorted by a creation time in milliseconds
//! break ties with it, so that entries made in one millisecond are listed in the order
//! made rather than by their random ids.

use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;

#[derive(Default)]
pub struct ArrivalOrder {
    next: AtomicU64,
    places: DashMap<String, u64>,
}

impl ArrivalOrder {
    /// `key` came: it takes the next place, unless it has one already.
    pub fn arrived(&self, key: &str) {
        if !self.places.contains_key(key) {
            (self.places.entry(key.to_owned()))
                .or_insert_with(|| self.next.fetch_add(1, Ordering::Relaxed));
        }
    }

    /// `key` went: it takes a new place if it comes again.
    pub fn forget(&self, key: &str) {
        self.places.remove(key);
    }

    /// `key`'s place; after every other when it has none.
    pub fn place(&self, key: &str) -> u64 {
        self.places.get(key).map_or(u64::MAX, |place| *place)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_keeps_its_place_until_forgotten() {
        let order = ArrivalOrder::default();
        for key in ["c", "a", "b", "c"] {
            order.arrived(key);
        }
        let places: Vec<u64> = ["c", "a", "b"].iter().map(|k| order.place(k)).collect();
        assert!(places.is_sorted(), "{places:?}");
        order.forget("c");
        order.arrived("c");
        assert!(order.place("c") > order.place("b"));
        assert_eq!(order.place("unknown"), u64::MAX);
    }
}
