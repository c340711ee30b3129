//! This bridge's own messages, from their append until its consumer reads them back from
//! the stream: what lets the consumer's acknowledgement floor say that they were written
//! here too, not only the other bridges' messages it applied.
//!
//! A message a bridge accepts is routed here as it is accepted, not applied from the
//! stream. A bridge killed before it wrote such a message to its own Grid program or
//! Synapse agent must leave it in the stretch the others read again (`missed_mail`). So
//! each message is given a hold as it is appended (`Outstanding`), which its routing
//! offers to its deliveries (`MessageLog::delivery_hold`), and what says when the hold is
//! done (`HeldBy`) goes with its publish. When the consumer reads the publish back, the
//! applier waits for those before acknowledging it, as it waits for a batch it routed
//! itself.
//!
//! A message whose append did not complete here (the local write failed, or the sender
//! stopped waiting) was not routed here, and its publish may have reached the stream all
//! the same: it is marked, and applied like another bridge's when it is read back (within
//! `UNROUTED_FOR`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::core::{HeldBy, Outstanding};

/// Most entries of each kind kept at once: past this, a message (or publish) is not waited
/// for, and its acknowledgement follows its routing as it would without this.
const MOST: usize = 65_536;

/// An entry older than this is taken for one nobody will ask for (a publish JetStream never
/// held, a message whose sender stopped waiting for its write), and let go when room is
/// needed.
const STALE_AFTER: Duration = Duration::from_secs(60);

/// How long a message whose append did not complete is looked for among the publishes read
/// back: a publish JetStream never held is not, and while any is marked, every publish of
/// this bridge read back is decoded to look for it.
const UNROUTED_FOR: Duration = Duration::from_secs(600);

#[derive(Default)]
pub struct OwnDeliveries {
    /// The hold of each message appended and not yet routed, by message id.
    holds: Entries<Outstanding>,
    /// For each publish sent and not yet read back, by its NATS message id: done once each
    /// of its messages' deliveries here is written, kept or dropped.
    published: Entries<Vec<HeldBy>>,
    /// Messages whose append did not complete, by id: not routed here.
    unrouted: Entries<()>,
}

impl OwnDeliveries {
    /// Message `id` is being appended: what says when its routing let its hold go and each
    /// delivery that took the hold up is done; `None` when there is no room (or a message
    /// with its id is being appended already).
    pub fn appending(&self, id: &str) -> Option<HeldBy> {
        let (hold, held_by) = Outstanding::naming();
        self.holds.insert(id, hold).then_some(held_by)
    }

    /// The hold of message `id`, for its routing to offer its deliveries (once).
    pub fn hold_of(&self, id: &str) -> Option<Outstanding> {
        self.holds.take(id)
    }

    /// Message `id` was refused: it is not routed, nor in the stream.
    pub fn not_appended(&self, id: &str) {
        self.holds.take(id);
    }

    /// Message `id`'s append did not complete: it is not routed here, and its publish, if
    /// the stream holds it, is to be applied here as another bridge's (`take_unrouted`).
    pub fn not_routed(&self, id: &str) {
        self.holds.take(id);
        self.unrouted.insert(id, ());
    }

    /// Message `id` was appended (and is routed): a message with its id whose append did
    /// not complete before (a publish without an answer, sent again) is routed by this one.
    pub fn appended(&self, id: &str) {
        if !self.unrouted.is_empty() {
            self.unrouted.take(id);
        }
    }

    /// Whether message `id`, read back, was not routed here (once).
    pub fn take_unrouted(&self, id: &str) -> bool {
        self.unrouted.take(id).is_some()
    }

    /// Whether a message read back now may not have been routed here.
    pub fn any_unrouted(&self) -> bool {
        if self.unrouted.is_empty() {
            return false;
        }
        self.unrouted.sweep(UNROUTED_FOR);
        !self.unrouted.is_empty()
    }

    /// A publish is being sent under NATS message id `id`, carrying messages whose holds
    /// these watch.
    pub fn sending(&self, id: &str, written: Vec<HeldBy>) {
        if !written.is_empty() {
            self.published.insert(id, written);
        }
    }

    /// The publish under `id` was refused: the consumer will not read it back.
    pub fn not_published(&self, id: &str) {
        self.published.take(id);
    }

    /// The consumer read back the publish under `id`: the holds to wait for before its
    /// acknowledgement.
    pub fn read_back(&self, id: &str) -> Vec<HeldBy> {
        self.published.take(id).unwrap_or_default()
    }
}

/// Values by id, at most `MOST`.
struct Entries<T> {
    map: Mutex<Map<T>>,
    /// How many: whether there are any is asked without the lock.
    len: AtomicUsize,
}

struct Map<T> {
    by_id: HashMap<String, (Instant, T)>,
    /// When stale entries were last let go (`Entries::sweep_locked`).
    swept: Instant,
}

impl<T> Default for Entries<T> {
    fn default() -> Self {
        Entries {
            map: Mutex::new(Map {
                by_id: HashMap::new(),
                swept: Instant::now(),
            }),
            len: AtomicUsize::new(0),
        }
    }
}

impl<T> Entries<T> {
    /// Keeps `value` under `id`, unless there is no room or `id` is kept already; whether
    /// it was kept.
    fn insert(&self, id: &str, value: T) -> bool {
        let mut map = self.map.lock();
        if map.by_id.len() >= MOST {
            self.sweep_locked(&mut map, STALE_AFTER);
        }
        if map.by_id.len() >= MOST || map.by_id.contains_key(id) {
            return false;
        }
        map.by_id.insert(id.to_owned(), (Instant::now(), value));
        self.len.store(map.by_id.len(), Ordering::Release);
        true
    }

    fn take(&self, id: &str) -> Option<T> {
        let mut map = self.map.lock();
        let taken = map.by_id.remove(id).map(|(_, value)| value);
        self.len.store(map.by_id.len(), Ordering::Release);
        taken
    }

    fn is_empty(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0
    }

    /// Lets go the entries older than `older_than`.
    fn sweep(&self, older_than: Duration) {
        self.sweep_locked(&mut self.map.lock(), older_than);
    }

    /// At most once a second, so that a map of fresh entries is not scanned every time.
    fn sweep_locked(&self, map: &mut Map<T>, older_than: Duration) {
        let now = Instant::now();
        if now.duration_since(map.swept) < Duration::from_secs(1) {
            return;
        }
        map.swept = now;
        (map.by_id).retain(|_, (at, _)| now.duration_since(*at) < older_than);
        self.len.store(map.by_id.len(), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_done_once_routed_and_let_go_by_what_held_it() {
        let own = OwnDeliveries::default();
        let done = own.appending("m1").expect("room");
        own.sending("batch:1", vec![done]);
        let [done] =
            <[_; 1]>::try_from(own.read_back("batch:1")).unwrap_or_else(|_| panic!("one hold"));
        // Not routed yet: its hold is kept for its routing.
        assert!(!done.is_done());
        let hold = own.hold_of("m1").expect("the hold");
        assert!(own.hold_of("m1").is_none(), "given once");
        let taken_up = hold.clone();
        drop(hold);
        assert!(!done.is_done(), "a delivery still holds it");
        drop(taken_up);
        assert!(done.is_done());
        assert!(own.read_back("batch:1").is_empty(), "read back once");
    }

    #[test]
    fn a_message_not_appended_is_not_waited_for_and_is_applied_when_read_back() {
        let own = OwnDeliveries::default();
        assert!(!own.any_unrouted());
        let done = own.appending("m1").expect("room");
        own.not_routed("m1");
        assert!(done.is_done());
        assert!(own.hold_of("m1").is_none(), "not routed");
        own.sending("batch:1", vec![done]);
        own.not_published("batch:1");
        assert!(own.read_back("batch:1").is_empty());
        assert!(own.any_unrouted());
        assert!(own.take_unrouted("m1"));
        assert!(!own.take_unrouted("m1"), "once");
        assert!(!own.any_unrouted());
        // Sent again, and appended: routed by that append.
        own.not_routed("m3");
        own.appended("m3");
        assert!(!own.any_unrouted());
        // Refused: nothing to apply.
        let done = own.appending("m2").expect("room");
        own.not_appended("m2");
        assert!(done.is_done() && !own.take_unrouted("m2"));
    }

    #[test]
    fn a_second_message_with_the_same_id_takes_no_hold_of_its_own() {
        let own = OwnDeliveries::default();
        let first = own.appending("m1").expect("room");
        assert!(own.appending("m1").is_none());
        drop(own.hold_of("m1"));
        assert!(first.is_done());
    }

    #[test]
    fn past_its_room_a_message_is_not_waited_for() {
        let own = OwnDeliveries::default();
        let kept: Vec<_> = (0..MOST).map(|i| own.appending(&format!("m{i}"))).collect();
        assert!(kept.iter().all(Option::is_some));
        // Every entry is fresh: none is let go to make room.
        assert!(own.appending("one more").is_none());
        own.hold_of("m0");
        assert!(own.appending("one more").is_some());
    }
}
