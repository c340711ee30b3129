//! Message id → conversation links, and derived ids ↔ original ids.
//!
//! The index is a bounded in-memory cache of recent messages; `Core` falls back to the
//! store for older ones, so it never needs to hold the whole history.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};

use foldhash::HashMap;

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
/// in the ring. The index's slots are 16 bytes (about 512 KiB for 16,384 links), so far
/// more of it stays in the processor's caches than of a map holding the links themselves
/// (two cache lines a slot, and the key's text behind a pointer), which missed them on
/// every insert and eviction: 4 % of the relay's cycles, the most of any function of the
/// bridge's own; 2 % now.
#[derive(Default)]
struct Links {
    ring: Vec<LinkEntry>,
    /// How many links have been recorded: the next one goes to `recorded % capacity`.
    recorded: u64,
    /// Id hash → the number of the record holding it. Two ids of the same hash cannot
    /// both be found: the older one is then looked up in the store, like an evicted one.
    index: HashMap<u64, u64>,
}

struct LinkEntry {
    hash: u64,
    id: Box<str>,
    from: Box<str>,
    /// Only when it is not the message itself: most messages start their conversation.
    root: Option<Box<str>>,
    reply_to: Option<Box<str>>,
    task_id: Option<Box<str>>,
    asks_decision: bool,
}

impl Links {
    fn find(&self, id: &str, hash: u64, capacity: usize) -> Option<usize> {
        let number = *self.index.get(&hash)?;
        let at = (number % capacity as u64) as usize;
        (*self.ring[at].id == *id).then_some(at)
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

    /// Records `entry`, in place of an earlier record of its id, else of the oldest.
    fn insert(&mut self, entry: LinkEntry, capacity: usize) {
        if let Some(at) = self.find(&entry.id, entry.hash, capacity) {
            self.ring[at] = entry;
            return;
        }
        let number = self.recorded;
        self.recorded += 1;
        let hash = entry.hash;
        let at = (number % capacity as u64) as usize;
        if at < self.ring.len() {
            let oldest = std::mem::replace(&mut self.ring[at], entry);
            // Unless a newer id of the same hash has taken its place in the index.
            if self.index.get(&oldest.hash) == Some(&(number - capacity as u64)) {
                self.index.remove(&oldest.hash);
            }
        } else {
            self.ring.push(entry);
        }
        self.index.insert(hash, number);
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

    /// Records a message's place in its conversation.
    pub fn record(
        &self,
        id: &str,
        from: &str,
        reply_to: Option<&str>,
        correlation_id: Option<&str>,
        assigned_task: Option<&str>,
        asks_decision: bool,
    ) {
        let boxed = |s: &str| Box::<str>::from(s);
        let entry = LinkEntry {
            hash: self.hasher.hash_one(id),
            id: boxed(id),
            from: boxed(from),
            root: correlation_id.filter(|root| *root != id).map(boxed),
            reply_to: reply_to.map(boxed),
            task_id: assigned_task.map(boxed),
            asks_decision,
        };
        self.lock().links.insert(entry, self.capacity);
    }

    pub fn link(&self, id: &str) -> Option<Link> {
        let hash = self.hasher.hash_one(id);
        self.lock().links.get(id, hash, self.capacity)
    }

    /// Records that `request` assigned task `task_id`.
    pub fn record_task(&self, task_id: &str, request: TaskRequest) {
        let state = &mut *self.lock();
        insert_bounded(
            &mut state.tasks,
            &mut state.task_order,
            self.capacity,
            task_id,
            request,
        );
    }

    pub fn task(&self, task_id: &str) -> Option<TaskRequest> {
        self.lock().tasks.get(task_id).cloned()
    }

    /// Records that `derived` stands for `original` in a protocol that needs another id form.
    pub fn record_derived(&self, derived: &str, original: &str) {
        let state = &mut *self.lock();
        insert_bounded(
            &mut state.originals,
            &mut state.derived_order,
            self.capacity,
            derived,
            original.to_owned(),
        );
    }

    pub fn original_of(&self, derived: &str) -> Option<String> {
        self.lock().originals.get(derived).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
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
    fn ids_of_one_hash_are_never_taken_for_each_other() {
        let entry = |id: &str| LinkEntry {
            hash: 7,
            id: id.into(),
            from: "x".into(),
            root: None,
            reply_to: None,
            task_id: None,
            asks_decision: false,
        };
        let mut links = Links::default();
        links.insert(entry("a"), 2);
        links.insert(entry("b"), 2);
        // "a" can no longer be found (the store answers for it); "b" can.
        assert!(links.get("a", 7, 2).is_none());
        assert_eq!(links.get("b", 7, 2).unwrap().root, "b");
        // Evicting "a" leaves "b"'s place in the index alone.
        links.insert(entry("c"), 2);
        assert!(links.get("b", 7, 2).is_none(), "c took the hash's place");
        assert!(links.get("c", 7, 2).is_some());
        links.insert(entry("d"), 2);
        assert!(links.get("d", 7, 2).is_some());
        assert_eq!(links.index.len(), 1);
    }

    #[test]
    fn derived_uuids_are_stable_and_spaced() {
        let a = derived_uuid("message", "msg-1");
        assert_eq!(a, derived_uuid("message", "msg-1"));
        assert_ne!(a, derived_uuid("agent", "msg-1"));
        assert_eq!(a.get_version_num(), 5);
    }
}
