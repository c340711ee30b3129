//! The messages whose publish got no answer from JetStream, which the stream may hold all
//! the same.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::wire::Replica;

/// Ids of messages whose publish ended without JetStream's answer, so the stream may hold
/// them: published again (a client's retry, likely in a batch under another NATS id, which
/// JetStream cannot deduplicate), each is marked `resent` for the applying bridges to ask
/// their stores first. The newest `UNSURE_REMEMBERED` are kept.
#[derive(Default)]
pub(super) struct Unsure {
    /// Whether any is kept: the common case is answered without the lock.
    any: AtomicBool,
    ids: Mutex<UnsureIds>,
}

#[derive(Default)]
struct UnsureIds {
    /// Oldest first, with when each was added.
    order: VecDeque<(Instant, String)>,
    set: HashSet<String>,
}

/// Far more than clients retry within: a retry follows its refusal by seconds. Kept at
/// most this many, for at most this long (after which publishing takes no lock again).
const UNSURE_REMEMBERED: usize = 65_536;
const UNSURE_FOR: Duration = Duration::from_secs(600);

impl Unsure {
    /// The messages `payload` (one publish) carried.
    pub(super) fn add(&self, payload: &[u8]) {
        let Ok(replicas) = Replica::all_in(payload) else {
            return;
        };
        let now = Instant::now();
        let mut ids = self.ids.lock();
        for replica in replicas.into_iter().filter(|r| !r.transient) {
            if ids.set.insert(replica.envelope.id.clone()) {
                ids.order.push_back((now, replica.envelope.id));
            }
        }
        while ids.order.len() > UNSURE_REMEMBERED {
            ids.forget_oldest();
        }
        self.any.store(!ids.order.is_empty(), Ordering::Release);
    }

    pub(super) fn contains(&self, id: &str) -> bool {
        if !self.any.load(Ordering::Acquire) {
            return false;
        }
        let mut ids = self.ids.lock();
        while (ids.order.front()).is_some_and(|(added, _)| added.elapsed() > UNSURE_FOR) {
            ids.forget_oldest();
        }
        self.any.store(!ids.order.is_empty(), Ordering::Release);
        ids.set.contains(id)
    }
}

impl UnsureIds {
    fn forget_oldest(&mut self) {
        if let Some((_, oldest)) = self.order.pop_front() {
            self.set.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{Envelope, Kind};

    fn chat(id: &str) -> serde_json::Value {
        let env = Envelope::with_id(id.into(), "skynet", "a", Kind::Chat);
        serde_json::json!({ "envelope": env })
    }

    #[test]
    fn the_messages_of_a_publish_without_an_answer_are_remembered_newest_first() {
        let unsure = Unsure::default();
        assert!(!unsure.contains("m1"));
        let batch = serde_json::json!([chat("m1"), chat("m2")]);
        unsure.add(batch.to_string().as_bytes());
        assert!(unsure.contains("m1") && unsure.contains("m2"));
        for i in 0..UNSURE_REMEMBERED {
            unsure.add(chat(&format!("later-{i}")).to_string().as_bytes());
        }
        assert!(!unsure.contains("m1") && !unsure.contains("m2"));
        assert!(unsure.contains(&format!("later-{}", UNSURE_REMEMBERED - 1)));
    }
}
