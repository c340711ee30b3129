//! Message id → conversation links, and derived ids ↔ original ids.
//!
//! The index is a bounded in-memory cache of recent messages; `Core` falls back to the
//! store for older ones, so it never needs to hold the whole history.

use std::collections::VecDeque;
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
    state: Mutex<State>,
}

/// Each map's keys in insertion order, oldest first, share their text with the map.
#[derive(Default)]
struct State {
    links: HashMap<Arc<str>, Link>,
    order: VecDeque<Arc<str>>,
    /// task id → its assignment.
    tasks: HashMap<Arc<str>, TaskRequest>,
    task_order: VecDeque<Arc<str>>,
    /// derived id → original id.
    originals: HashMap<Arc<str>, String>,
    derived_order: VecDeque<Arc<str>>,
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
        let link = Link {
            reply_to: reply_to.map(str::to_owned),
            root: correlation_id.unwrap_or(id).to_owned(),
            from: from.to_owned(),
            task_id: assigned_task.map(str::to_owned),
            asks_decision,
        };
        let state = &mut *self.lock();
        insert_bounded(&mut state.links, &mut state.order, self.capacity, id, link);
    }

    pub fn link(&self, id: &str) -> Option<Link> {
        self.lock().links.get(id).cloned()
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
    fn derived_uuids_are_stable_and_spaced() {
        let a = derived_uuid("message", "msg-1");
        assert_eq!(a, derived_uuid("message", "msg-1"));
        assert_ne!(a, derived_uuid("agent", "msg-1"));
        assert_eq!(a.get_version_num(), 5);
    }
}
