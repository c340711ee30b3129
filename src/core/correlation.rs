//! Message id → conversation links, and derived ids ↔ original ids.
//!
//! The index is a bounded in-memory cache of recent messages; `Core` falls back to the
//! store for older ones, so it never needs to hold the whole history.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::Arc;

use foldhash::HashMap;
use parking_lot::Mutex;

use uuid::Uuid;

/// Namespace of every UUIDv5 the bridge derives. Fixed forever: derived ids must be stable
/// across restarts and versions.
pub const DERIVED_ID_NAMESPACE: Uuid = Uuid::from_u128(0x6a1f_5c0e_9d2b_4e71_a3c8_52f0_0b7e_d41c);

/// A stable UUID for `original` in the given id space (`"message"`, `"agent"`, …).
pub fn derived_uuid(space: &str, original: &str) -> Uuid {
    let mut name = Vec::with_capacity(space.len() + 1 + original.len());
    name.extend_from_slice(space.as_bytes());
    name.push(b':');
    name.extend_from_slice(original.as_bytes());
    Uuid::new_v5(&DERIVED_ID_NAMESPACE, &name)
}

/// What the index knows about one message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub reply_to: Option<String>,
    /// The id of the conversation's first message.
    pub root: String,
    /// Its sender.
    pub from: String,
    /// The task it assigned, when it is an assignment.
    pub task_id: Option<String>,
    /// Whether it asked a human for a decision.
    pub asks_decision: bool,
}

/// A task assignment: the message that asked and who asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskRequest {
    pub message_id: String,
    pub requester: String,
}

pub struct CorrelationIndex {
    capacity: usize,
    /// Hashes ids for `Links`, outside the lock.
    hasher: foldhash::fast::RandomState,
    state: Mutex<State>,
}

/// The task and derived-id maps keep their keys in insertion order, oldest first, sharing
/// their text with the map.
#[derive(Default)]
struct State {
    links: Links,
    /// task id → its assignment.
    tasks: HashMap<Arc<str>, TaskRequest>,
    task_order: VecDeque<Arc<str>>,
    /// derived id → original id.
    originals: HashMap<Arc<str>, String>,
    derived_order: VecDeque<Arc<str>>,
}

/// The links of the most recent messages, one recorded per message the bridge accepts: a
/// ring in the order they were recorded, and an index from a hash of each id to its place
/// in the ring.
///
/// The index is set-associative, as a processor's cache is: an id's hash picks one bucket
/// of [`WAYS`] slots, half a cache line (`Bucket`), and each slot holds a record's number and
/// a tag from the hash's top bits, so a lookup reads one bucket and only the ring entries
/// whose tag matches. A slot whose record has left the ring is free, found so by its
/// number alone; nothing is removed on eviction. A `HashMap` of hash → number would read
/// two cache lines to find, two to remove the evicted id and two to insert, all cold in a
/// table of 512 KiB, for every message the bridge accepts (BENCHMARKS.md).
#[derive(Default)]
struct Links {
    ring: Vec<LinkEntry>,
    /// How many links have been recorded: the next one goes to `recorded % capacity`.
    recorded: u64,
    /// How many times a link was recorded, a new one or one updated in place: each
    /// record's `LinkEntry::stamp`.
    stamped: u64,
    /// Made at the first record, with at least [`SLOTS_PER_LINK`] slots for each place in
    /// the ring (512 KiB for the 16,384 links `Core` keeps; a lookup reads 32 bytes of it).
    /// When all of a bucket's slots hold live records, a new one takes the oldest's slot:
    /// that link is then looked up in the store, like an evicted one.
    index: Vec<Bucket>,
}

/// Slots per bucket of `Links::index`.
const WAYS: usize = 4;
/// Slots in `Links::index` for each place in the ring (rounded up to a power of two
/// buckets): with four, about 4 in 1,000 live links are forgotten early.
const SLOTS_PER_LINK: usize = 4;
/// A slot is `(number + 1) << TAG_BITS | tag`; 0 is empty. (Numbers wrap after 2^48
/// records: nine years at a million messages a second.)
const TAG_BITS: u32 = 16;
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;

/// One bucket of `Links::index`, aligned so that it never straddles two cache lines.
#[derive(Clone, Copy, Default)]
#[repr(align(32))]
struct Bucket([u64; WAYS]);

struct LinkEntry {
    hash: u64,
    /// Which record of its id this is (`Links::forget` forgets only that one).
    stamp: u64,
    id: Box<str>,
    from: Box<str>,
    /// Only when it is not the message itself: most messages start their conversation.
    root: Option<Box<str>>,
    reply_to: Option<Box<str>>,
    task_id: Option<Box<str>>,
    asks_decision: bool,
}

impl Links {
    /// The bucket of `hash` (its low bits) and the tag its slots carry (its top bits).
    fn bucket_and_tag(&self, hash: u64) -> (usize, u64) {
        let bucket = hash as usize & (self.index.len() - 1);
        (bucket, hash >> (u64::BITS - TAG_BITS))
    }

    /// The number of the oldest record still in the ring.
    fn oldest_live(&self, capacity: usize) -> u64 {
        self.recorded.saturating_sub(capacity as u64)
    }

    fn find(&self, id: &str, hash: u64, capacity: usize) -> Option<usize> {
        self.find_slot(id, hash, capacity).map(|(_, at)| at)
    }

    /// The bucket and slot of `id`'s live record, and its place in the ring.
    fn find_slot(&self, id: &str, hash: u64, capacity: usize) -> Option<((usize, usize), usize)> {
        if self.index.is_empty() {
            return None;
        }
        let (bucket, tag) = self.bucket_and_tag(hash);
        let oldest_live = self.oldest_live(capacity);
        (self.index[bucket].0.iter().enumerate()).find_map(|(way, &slot)| {
            if slot == 0 || slot & TAG_MASK != tag {
                return None;
            }
            let number = (slot >> TAG_BITS) - 1;
            if number < oldest_live {
                return None;
            }
            let at = (number % capacity as u64) as usize;
            let entry = &self.ring[at];
            (entry.hash == hash && *entry.id == *id).then_some(((bucket, way), at))
        })
    }

    /// Forgets `id`'s record `stamp`, unless its id was recorded again since: its slot is
    /// freed, and its ring entry is left to be overwritten in turn.
    fn forget(&mut self, id: &str, hash: u64, capacity: usize, stamp: u64) {
        if let Some(((bucket, way), at)) = self.find_slot(id, hash, capacity)
            && self.ring[at].stamp == stamp
        {
            self.index[bucket].0[way] = 0;
        }
    }

    fn get(&self, id: &str, hash: u64, capacity: usize) -> Option<Link> {
        let entry = &self.ring[self.find(id, hash, capacity)?];
        Some(Link {
            reply_to: entry.reply_to.as_deref().map(str::to_owned),
            root: entry.root.as_deref().unwrap_or(id).to_owned(),
            from: entry.from.to_string(),
            task_id: entry.task_id.as_deref().map(str::to_owned),
            asks_decision: entry.asks_decision,
        })
    }

    /// Records `entry`, in place of an earlier record of its id, else of the oldest; its
    /// stamp when there was none.
    fn insert(&mut self, mut entry: LinkEntry, capacity: usize) -> Option<u64> {
        entry.stamp = self.stamped;
        self.stamped += 1;
        if let Some(at) = self.find(&entry.id, entry.hash, capacity) {
            self.ring[at] = entry;
            return None;
        }
        let stamp = entry.stamp;
        if self.index.is_empty() {
            let buckets = (SLOTS_PER_LINK * capacity)
                .div_ceil(WAYS)
                .next_power_of_two();
            self.index = vec![Bucket::default(); buckets];
        }
        let number = self.recorded;
        self.recorded += 1;
        let (bucket, tag) = self.bucket_and_tag(entry.hash);
        let at = (number % capacity as u64) as usize;
        if at < self.ring.len() {
            self.ring[at] = entry;
        } else {
            self.ring.push(entry);
        }
        let oldest_live = self.oldest_live(capacity);
        let slots = &mut self.index[bucket].0;
        let free = slots
            .iter()
            .position(|&slot| slot == 0 || (slot >> TAG_BITS) - 1 < oldest_live);
        let taken = free.unwrap_or_else(|| {
            // Every slot's record is live: the oldest gives way (slots order by number).
            (1..WAYS).fold(
                0,
                |oldest, i| if slots[i] < slots[oldest] { i } else { oldest },
            )
        });
        slots[taken] = ((number + 1) << TAG_BITS) | tag;
        Some(stamp)
    }
}

/// Inserts into a map bounded to `capacity` entries, forgetting the oldest first.
fn insert_bounded<V>(
    map: &mut HashMap<Arc<str>, V>,
    order: &mut VecDeque<Arc<str>>,
    capacity: usize,
    key: &str,
    value: V,
) {
    if let Some(slot) = map.get_mut(key) {
        *slot = value;
        return;
    }
    let key: Arc<str> = Arc::from(key);
    map.insert(key.clone(), value);
    order.push_back(key);
    while order.len() > capacity {
        if let Some(old) = order.pop_front() {
            map.remove(&old);
        }
    }
}

impl CorrelationIndex {
    pub fn new(capacity: usize) -> Self {
        CorrelationIndex {
            capacity: capacity.max(1),
            hasher: foldhash::fast::RandomState::default(),
            state: Mutex::new(State::default()),
        }
    }

    /// Records a message's place in its conversation; when its id was not recorded
    /// already, the record's stamp, which `forget` takes.
    pub fn record(
        &self,
        id: &str,
        from: &str,
        reply_to: Option<&str>,
        correlation_id: Option<&str>,
        assigned_task: Option<&str>,
        asks_decision: bool,
    ) -> Option<u64> {
        let boxed = |s: &str| Box::<str>::from(s);
        let entry = LinkEntry {
            hash: self.hasher.hash_one(id),
            stamp: 0,
            id: boxed(id),
            from: boxed(from),
            root: correlation_id.filter(|root| *root != id).map(boxed),
            reply_to: reply_to.map(boxed),
            task_id: assigned_task.map(boxed),
            asks_decision,
        };
        self.state.lock().links.insert(entry, self.capacity)
    }

    pub fn link(&self, id: &str) -> Option<Link> {
        let hash = self.hasher.hash_one(id);
        self.state.lock().links.get(id, hash, self.capacity)
    }

    /// Forgets a message's place in its conversation (it was not accepted after all):
    /// record `stamp`, unless its id was recorded again since (another message with its
    /// id was accepted, or applied from another bridge).
    pub fn forget(&self, id: &str, stamp: u64) {
        let hash = self.hasher.hash_one(id);
        self.state
            .lock()
            .links
            .forget(id, hash, self.capacity, stamp);
    }

    /// Records that `request` assigned task `task_id`.
    pub fn record_task(&self, task_id: &str, request: TaskRequest) {
        let state = &mut *self.state.lock();
        insert_bounded(
            &mut state.tasks,
            &mut state.task_order,
            self.capacity,
            task_id,
            request,
        );
    }

    pub fn task(&self, task_id: &str) -> Option<TaskRequest> {
        self.state.lock().tasks.get(task_id).cloned()
    }

    /// Records that `derived` stands for `original` in a protocol that needs another id form.
    pub fn record_derived(&self, derived: &str, original: &str) {
        let state = &mut *self.state.lock();
        insert_bounded(
            &mut state.originals,
            &mut state.derived_order,
            self.capacity,
            derived,
            original.to_owned(),
        );
    }

    pub fn original_of(&self, derived: &str) -> Option<String> {
        self.state.lock().originals.get(derived).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roots_follow_the_first_message() {
        let index = CorrelationIndex::new(10);
        index.record("a", "x", None, None, Some("t"), false);
        index.record("b", "y", Some("a"), Some("a"), None, false);
        assert_eq!(index.link("a").unwrap().root, "a");
        assert_eq!(
            index.link("b").unwrap(),
            Link {
                reply_to: Some("a".into()),
                root: "a".into(),
                from: "y".into(),
                task_id: None,
                asks_decision: false,
            }
        );
        assert_eq!(index.link("a").unwrap().task_id.as_deref(), Some("t"));
    }

    #[test]
    fn the_cache_is_bounded() {
        let index = CorrelationIndex::new(2);
        for id in ["a", "b", "c"] {
            index.record(id, "x", None, None, None, false);
            index.record_derived(&format!("d-{id}"), id);
        }
        assert!(index.link("a").is_none());
        assert!(index.link("c").is_some());
        assert!(index.original_of("d-a").is_none());
        assert_eq!(index.original_of("d-c").as_deref(), Some("c"));
    }

    #[test]
    fn a_message_recorded_again_is_updated_in_place() {
        let index = CorrelationIndex::new(2);
        index.record("a", "x", None, None, None, false);
        index.record("b", "x", None, None, None, false);
        index.record("a", "y", Some("b"), Some("b"), None, true);
        let a = index.link("a").unwrap();
        assert_eq!((a.from.as_str(), a.root.as_str()), ("y", "b"));
        assert!(a.asks_decision);
        // Still two records: the third id evicts the oldest, "a".
        index.record("c", "x", None, None, None, false);
        assert!(index.link("a").is_none());
        assert!(index.link("b").is_some() && index.link("c").is_some());
    }

    #[test]
    fn a_forgotten_message_is_not_found_and_may_be_recorded_again() {
        let index = CorrelationIndex::new(4);
        let a = index
            .record("a", "x", None, None, None, false)
            .expect("new");
        let b = index
            .record("b", "x", None, None, None, false)
            .expect("new");
        index.forget("a", a);
        index.forget("never", b);
        assert!(index.link("a").is_none());
        assert!(index.link("b").is_some(), "only its own record goes");
        let again = index
            .record("a", "z", None, None, None, false)
            .expect("new again");
        assert_eq!(index.link("a").unwrap().from, "z");
        // Recorded again in place since: a forget of the earlier record is too late.
        assert!(index.record("a", "y", None, None, None, false).is_none());
        index.forget("a", again);
        assert_eq!(index.link("a").unwrap().from, "y");
    }

    fn entry_of_hash(id: &str, hash: u64) -> LinkEntry {
        LinkEntry {
            hash,
            stamp: 0,
            id: id.into(),
            from: "x".into(),
            root: None,
            reply_to: None,
            task_id: None,
            asks_decision: false,
        }
    }

    #[test]
    fn ids_of_one_hash_are_told_apart_by_their_text() {
        let mut links = Links::default();
        links.insert(entry_of_hash("a", 7), 2);
        links.insert(entry_of_hash("b", 7), 2);
        assert_eq!(links.get("a", 7, 2).unwrap().root, "a");
        assert_eq!(links.get("b", 7, 2).unwrap().root, "b");
        assert!(links.get("z", 7, 2).is_none(), "a hash is not an id");
        // "c" evicts "a" from the ring, and takes its slot.
        links.insert(entry_of_hash("c", 7), 2);
        assert!(links.get("a", 7, 2).is_none());
        assert!(links.get("b", 7, 2).is_some() && links.get("c", 7, 2).is_some());
        // A record made again keeps its place: "d" then evicts "b", not "c".
        links.insert(entry_of_hash("c", 7), 2);
        links.insert(entry_of_hash("d", 7), 2);
        assert!(links.get("b", 7, 2).is_none());
        assert!(links.get("c", 7, 2).is_some() && links.get("d", 7, 2).is_some());
    }

    #[test]
    fn a_full_bucket_forgets_its_oldest_live_record() {
        // One hash for all: every record falls in one bucket of `WAYS` slots, while the
        // ring has room for all of them.
        let capacity = 64;
        let mut links = Links::default();
        let ids: Vec<String> = (0..=WAYS).map(|i| format!("m{i}")).collect();
        for id in &ids {
            links.insert(entry_of_hash(id, 7), capacity);
        }
        assert!(
            links.get(&ids[0], 7, capacity).is_none(),
            "the oldest gave way"
        );
        for id in &ids[1..] {
            assert!(links.get(id, 7, capacity).is_some(), "{id}");
        }
        // Ids of other hashes, in other buckets, are not disturbed.
        links.insert(entry_of_hash("other", 8), capacity);
        assert!(links.get(&ids[1], 7, capacity).is_some());
        assert!(links.get("other", 8, capacity).is_some());
    }

    #[test]
    fn recent_links_are_found_long_after_the_index_filled() {
        let index = CorrelationIndex::new(1_000);
        let ids: Vec<String> = (0..50_000).map(|i| format!("msg-{i}")).collect();
        for (i, id) in ids.iter().enumerate() {
            index.record(id, "x", None, None, None, false);
            if i >= 1_000 {
                assert!(
                    index.link(&ids[i - 1_000]).is_none(),
                    "evicted with its place"
                );
            }
        }
        let found = ids[49_000..]
            .iter()
            .filter(|id| index.link(id).is_some())
            .count();
        // Four slots for each place in the ring, four to a bucket: a live link is
        // forgotten only when five live ids share a bucket, about 4 in 1,000 (the hash's
        // seed differs from run to run). A direct-mapped index would lose about 100.
        assert!(found >= 970, "{found} of the last 1,000 found");
        assert!(index.link("msg-49999").is_some());
    }

    #[test]
    fn derived_uuids_are_stable_and_spaced() {
        let a = derived_uuid("message", "msg-1");
        assert_eq!(a, derived_uuid("message", "msg-1"));
        assert_ne!(a, derived_uuid("agent", "msg-1"));
        assert_eq!(a.get_version_num(), 5);
    }
}
