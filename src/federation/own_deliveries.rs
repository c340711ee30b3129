//! This bridge's own messages, from their append until its consumer reads them back from
//! the stream: what lets the consumer's acknowledgement floor say that they were written
//! here too, not only the other bridges' messages it applied.
//!
//! A message a bridge accepts is routed here as it is accepted, not applied from the
//! stream. So that a bridge killed before its own Grid programs and Synapse agents were
//! written their copies leaves those messages in the stretch the others read again
//! (`missed_mail`), each message is given a hold as it is appended (`Outstanding`), which
//! its routing offers to its deliveries (`MessageLog::delivery_hold`), and the token the
//! hold cancels goes with its publish. When the consumer reads the publish back, the
//! applier waits for those tokens before acknowledging it, as it waits for a batch it
//! routed itself.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::core::Outstanding;

/// Most entries of each kind kept at once: past this, a message (or publish) is not waited
/// for, and its acknowledgement follows its routing as it would without this.
const MOST: usize = 65_536;

/// An entry older than this is taken for one nobody will ask for (a publish JetStream never
/// held, a message whose sender stopped waiting for its write), and let go when room is
/// needed.
const STALE_AFTER: Duration = Duration::from_secs(60);

#[derive(Default)]
pub struct OwnDeliveries {
    /// The hold of each message appended and not yet routed, by message id.
    holds: Entries<Outstanding>,
    /// For each publish sent and not yet read back, by its NATS message id: cancelled once
    /// each of its messages' deliveries here is written, kept or dropped.
    published: Entries<Vec<CancellationToken>>,
}

impl OwnDeliveries {
    /// Message `id` is being appended: the token cancelled once its routing let its hold go
    /// and each delivery that took the hold up is done; `None` when there is no room.
    pub fn appended(&self, id: &str) -> Option<CancellationToken> {
        let (hold, done) = Outstanding::new();
        self.holds.insert(id, hold).then_some(done)
    }

    /// The hold of message `id`, for its routing to offer its deliveries (once).
    pub fn hold_of(&self, id: &str) -> Option<Outstanding> {
        self.holds.take(id)
    }

    /// Message `id` was not appended: it will not be routed.
    pub fn not_appended(&self, id: &str) {
        self.holds.take(id);
    }

    /// A publish is being sent under NATS message id `id`, carrying messages with these
    /// tokens.
    pub fn sending(&self, id: &str, written: Vec<CancellationToken>) {
        if !written.is_empty() {
            self.published.insert(id, written);
        }
    }

    /// The publish under `id` was refused: the consumer will not read it back.
    pub fn not_published(&self, id: &str) {
        self.published.take(id);
    }

    /// The consumer read back the publish under `id`: the tokens to wait for before its
    /// acknowledgement.
    pub fn read_back(&self, id: &str) -> Vec<CancellationToken> {
        self.published.take(id).unwrap_or_default()
    }
}

/// Values by id, at most `MOST`.
struct Entries<T> {
    map: Mutex<Map<T>>,
}

struct Map<T> {
    by_id: HashMap<String, (Instant, T)>,
    /// When stale entries were last let go: at most once a second, so a full map of fresh
    /// entries is not scanned on every insert.
    swept: Instant,
}

impl<T> Default for Entries<T> {
    fn default() -> Self {
        Entries {
            map: Mutex::new(Map {
                by_id: HashMap::new(),
                swept: Instant::now(),
            }),
        }
    }
}

impl<T> Entries<T> {
    /// Keeps `value` under `id`, unless there is no room; whether it was kept.
    fn insert(&self, id: &str, value: T) -> bool {
        let mut map = self.lock();
        let now = Instant::now();
        if map.by_id.len() >= MOST && now.duration_since(map.swept) >= Duration::from_secs(1) {
            map.swept = now;
            map.by_id
                .retain(|_, (at, _)| now.duration_since(*at) < STALE_AFTER);
        }
        if map.by_id.len() >= MOST {
            return false;
        }
        map.by_id.insert(id.to_owned(), (now, value));
        true
    }

    fn take(&self, id: &str) -> Option<T> {
        self.lock().by_id.remove(id).map(|(_, value)| value)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Map<T>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_done_once_routed_and_let_go_by_what_held_it() {
        let own = OwnDeliveries::default();
        let done = own.appended("m1").expect("room");
        own.sending("batch:1", vec![done]);
        let [done] = <[_; 1]>::try_from(own.read_back("batch:1")).expect("one token");
        // Not routed yet: its hold is kept for its routing.
        assert!(!done.is_cancelled());
        let hold = own.hold_of("m1").expect("the hold");
        assert!(own.hold_of("m1").is_none(), "given once");
        let taken_up = hold.clone();
        drop(hold);
        assert!(!done.is_cancelled(), "a delivery still holds it");
        drop(taken_up);
        assert!(done.is_cancelled());
        assert!(own.read_back("batch:1").is_empty(), "read back once");
    }

    #[test]
    fn a_message_not_appended_is_not_waited_for() {
        let own = OwnDeliveries::default();
        let done = own.appended("m1").expect("room");
        own.not_appended("m1");
        assert!(done.is_cancelled());
        own.sending("batch:1", vec![done]);
        own.not_published("batch:1");
        assert!(own.read_back("batch:1").is_empty());
    }

    #[test]
    fn past_its_room_a_message_is_not_waited_for() {
        let own = OwnDeliveries::default();
        let kept: Vec<_> = (0..MOST).map(|i| own.appended(&format!("m{i}"))).collect();
        assert!(kept.iter().all(Option::is_some));
        // Every entry is fresh: none is let go to make room.
        assert!(own.appended("one more").is_none());
        own.hold_of("m0");
        assert!(own.appended("one more").is_some());
    }
}
