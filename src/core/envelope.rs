//! The canonical message every protocol maps onto.
//!
//! An `Envelope` is what crosses between endpoints. It carries the union of what the
//! protocols need to keep a conversation intact (ids, reply chains, task state) and, in
//! `origin.native`, the frame exactly as its sender's protocol gave it, so that peers of the
//! same protocol get a lossless copy.

use std::sync::OnceLock;
use std::time::Instant;

use serde::ser::SerializeStruct;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;
use serde_json::value::RawValue;

/// A protocol's name as the core sees it: an opaque label (the registry's names).
pub type Protocol = &'static str;

/// What a message is about. `as_str` is its stored and logged name; `family` its metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Chat,
    TaskAssign,
    TaskUpdate,
    TaskResult,
    PresenceJoin,
    PresenceLeave,
    PresenceStatus,
    ControlInterrupt,
    ControlForget,
    ControlWatch,
    ControlUnwatch,
    ControlAbort,
    Log,
    Context,
    DecisionRequest,
    DecisionResponse,
    VoteInitiate,
    VoteSubmit,
    VoteResult,
    Error,
    /// A message type the origin protocol has and no other does; relayed to peers of the
    /// same protocol through `origin.native`, shown to others as a chat when it has text.
    Custom,
}

/// `Kind::as_str` and `Kind::ALL` from one list: `as_str`'s match must name every kind, so
/// a kind left out of the list does not compile, and `from_name` finds every one.
macro_rules! kind_names {
    ($($kind:ident => $name:literal,)*) => {
        impl Kind {
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Kind::$kind => $name,)*
                }
            }

            const ALL: &[Kind] = &[$(Kind::$kind,)*];
        }
    };
}

kind_names! {
    Chat => "chat",
    TaskAssign => "task.assign",
    TaskUpdate => "task.update",
    TaskResult => "task.result",
    PresenceJoin => "presence.join",
    PresenceLeave => "presence.leave",
    PresenceStatus => "presence.status",
    ControlInterrupt => "control.interrupt",
    ControlForget => "control.forget",
    ControlWatch => "control.watch",
    ControlUnwatch => "control.unwatch",
    ControlAbort => "control.abort",
    Log => "log",
    Context => "context",
    DecisionRequest => "decision.request",
    DecisionResponse => "decision.response",
    VoteInitiate => "vote.initiate",
    VoteSubmit => "vote.submit",
    VoteResult => "vote.result",
    Error => "error",
    Custom => "custom",
}

impl Kind {
    /// The low-cardinality label used in metrics.
    pub fn family(self) -> &'static str {
        match self {
            Kind::Chat => "chat",
            Kind::TaskAssign | Kind::TaskUpdate | Kind::TaskResult => "task",
            Kind::PresenceJoin | Kind::PresenceLeave | Kind::PresenceStatus => "presence",
            Kind::ControlInterrupt
            | Kind::ControlForget
            | Kind::ControlWatch
            | Kind::ControlUnwatch
            | Kind::ControlAbort => "control",
            Kind::Log => "log",
            Kind::Context => "context",
            Kind::DecisionRequest | Kind::DecisionResponse => "decision",
            Kind::VoteInitiate | Kind::VoteSubmit | Kind::VoteResult => "vote",
            Kind::Error => "error",
            Kind::Custom => "custom",
        }
    }

    /// The kind whose `as_str` is `name`.
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.iter().copied().find(|k| k.as_str() == name)
    }

    pub fn is_presence(self) -> bool {
        self.family() == "presence"
    }
}

/// Who a message is for, beyond the names in `to` and `mentions`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type", content = "id")]
pub enum Audience {
    /// The agents named in `to` and `mentions`, plus every observer whose filter wants it.
    #[default]
    Addressed,
    /// Only the agents named in `to` and `mentions`; observers do not see it.
    Private,
    /// Every agent that is online.
    Everyone,
    /// Every member of a group (and the named agents).
    Group(String),
}

impl Audience {
    pub(crate) fn is_addressed(&self) -> bool {
        *self == Audience::Addressed
    }
}

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

impl Priority {
    pub(crate) fn is_normal(&self) -> bool {
        *self == Priority::Normal
    }

    /// Lane index in a mailbox: lower is served first.
    pub fn lane(self) -> usize {
        match self {
            Priority::High => 0,
            Priority::Normal => 1,
            Priority::Low => 2,
        }
    }
}

/// Canonical task states; each protocol maps them in its own table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    Submitted,
    Assigned,
    Working,
    Waiting,
    InReview,
    Completed,
    Failed,
    Cancelled,
    Rejected,
}

/// Task details carried by task-kind messages.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TaskInfo {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<TaskState>,
    /// Agent name of the assignee.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignee: Option<String>,
    /// Progress in percent, when the origin reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<String>,
    /// The id the task's submitter knows it by in its own system (Synapse
    /// `external_task_id`), when it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_id: Option<String>,
}

/// A file carried inside a message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub name: String,
    pub mime_type: String,
    /// Size in bytes of the decoded data.
    pub size: u64,
    /// Base64 of the file's bytes.
    pub data: String,
}

/// Where a message came from: its protocol and the frame as that protocol gave it, and
/// when the bridge decoded it.
///
/// The frame is kept as a `Value`, as JSON text, or both: each is made from the other the
/// first time it is asked for (one of the two is always initialised, if only to "no
/// frame"). Text handed over must parse: the endpoints write it themselves, or check it.
/// Endpoints that read a frame into a `Value` hand over the value; those that can write
/// the frame's text in one pass (a send frame read field by field) hand over the text, and a message
/// relayed to a peer of the same protocol and stored is then never parsed into a `Value`
/// at all.
#[derive(Clone)]
pub struct Origin {
    pub protocol: String,
    native: OnceLock<Option<Value>>,
    /// The store keeps the text in the message's body and a peer of the same protocol may
    /// be sent it as it is. `set_native` forgets it, so it always matches `native`. Kept
    /// as a `String`, not a `RawValue`: a `RawValue` is made without reading the text
    /// through again only by `to_raw_value`, whose buffer starts at 128 bytes and is
    /// copied as it grows (2–3 times for a chat) and once more to fit.
    native_json: OnceLock<Option<String>>,
    /// When the frame was decoded: `route_duration_seconds` is measured from here, so it
    /// includes the wait for the store. A message read back from the store was "decoded"
    /// when it was read.
    decoded_at: Instant,
}

impl Origin {
    pub fn new(protocol: impl Into<String>, native: Option<Value>) -> Origin {
        Origin {
            protocol: protocol.into(),
            native: OnceLock::from(native),
            native_json: OnceLock::new(),
            decoded_at: Instant::now(),
        }
    }

    /// `new`, from the frame's JSON text alone: the `Value` is parsed only if someone asks
    /// for it. `json` must be one JSON value: the endpoint wrote it, or read it as one.
    pub fn from_native_json(protocol: impl Into<String>, json: String) -> Origin {
        debug_assert!(is_json(&json), "not JSON: {json}");
        Origin {
            protocol: protocol.into(),
            native: OnceLock::new(),
            native_json: OnceLock::from(Some(json)),
            decoded_at: Instant::now(),
        }
    }

    pub fn decoded_at(&self) -> Instant {
        self.decoded_at
    }

    /// The frame as the origin protocol gave it.
    pub fn native(&self) -> Option<&Value> {
        self.native
            .get_or_init(|| {
                let json = self.native_json.get()?.as_deref()?;
                crate::shared::deep_json::from_own_str(json).ok()
            })
            .as_ref()
    }

    pub fn set_native(&mut self, native: Option<Value>) {
        self.native = OnceLock::from(native);
        self.native_json = OnceLock::new();
    }

    /// `native` as JSON text, serialized on the first call only.
    pub fn native_json(&self) -> Option<&str> {
        self.native_json
            .get_or_init(|| serde_json::to_string(self.native.get()?.as_ref()?).ok())
            .as_deref()
    }
}

/// The frame as a `Value` (parsed from the text if need be), without the time.
impl std::fmt::Debug for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Origin")
            .field("protocol", &self.protocol)
            .field("native", &self.native())
            .finish()
    }
}

impl PartialEq for Origin {
    fn eq(&self, other: &Origin) -> bool {
        self.protocol == other.protocol && self.native() == other.native()
    }
}

/// As written by `Serialize`: the protocol and the frame, if any. The frame is kept as the
/// text it was written as, never parsed into a `Value` here: a bridge applying another's
/// messages stores that text and sends it on to peers of the same protocol as it is, and a
/// `Value` built and written out again was a tenth of what applying a message cost.
impl<'de> Deserialize<'de> for Origin {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Fields {
            protocol: String,
            #[serde(default)]
            native: Option<Box<RawValue>>,
        }
        let Fields { protocol, native } = Fields::deserialize(deserializer)?;
        Ok(match native {
            Some(text) => Origin::from_native_json(protocol, Box::<str>::from(text).into()),
            None => Origin::new(protocol, None),
        })
    }
}

/// Whether `text` is one JSON value, as `Origin`'s frame text must be: the store writes it
/// into a message's body as it is.
fn is_json(text: &str) -> bool {
    serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok()
}

/// Written with `native` spliced in from its JSON text (read through again: the store
/// writes its bodies itself, `message_body`, and this serves tests and diagnostics).
/// Envelopes are only ever written as JSON, which is what `RawValue` requires.
impl Serialize for Origin {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let native = self
            .native_json()
            .map(|json| RawValue::from_string(json.to_owned()))
            .transpose()
            .map_err(serde::ser::Error::custom)?;
        let mut origin =
            serializer.serialize_struct("Origin", 1 + usize::from(native.is_some()))?;
        origin.serialize_field("protocol", &self.protocol)?;
        match native {
            Some(native) => origin.serialize_field("native", &native)?,
            None => origin.skip_field("native")?,
        }
        origin.end()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// The origin's message id, kept verbatim.
    pub id: String,
    /// The sender's agent name.
    pub from: String,
    /// Explicit recipients (agent names).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub to: Vec<String>,
    /// Agents mentioned (names), as the origin gave them after its own enrichment.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mentions: Vec<String>,
    // Fields at their default are left out of the stored form: most messages have them.
    #[serde(default, skip_serializing_if = "Audience::is_addressed")]
    pub audience: Audience,
    /// The sender gets a copy of its own message, before anyone else.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub echo: bool,
    pub kind: Kind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// The conversation the message belongs to (a chat room, a task's comment thread);
    /// `None` is the shared lobby every protocol has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<Box<TaskInfo>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Structured payload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<Attachment>,
    /// Milliseconds since the Unix epoch.
    pub timestamp: i64,
    #[serde(default, skip_serializing_if = "Priority::is_normal")]
    pub priority: Priority,
    /// Seconds the message may wait for delivery before it is dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_secs: Option<u64>,
    pub origin: Origin,
}

impl Envelope {
    /// A new message of `kind` from `from`, with a fresh id and the current time.
    pub fn new(protocol: Protocol, from: impl Into<String>, kind: Kind) -> Self {
        Self::with_id(new_message_id(), protocol, from, kind)
    }

    /// A message with the id its origin gave it (`new` would make one, to be thrown away).
    pub fn with_id(id: String, protocol: Protocol, from: impl Into<String>, kind: Kind) -> Self {
        Self::received(id, from, kind, now_ms(), Origin::new(protocol, None))
    }

    /// A message with the id, time and origin (its protocol, and its frame) the endpoint
    /// that received it gives it (`with_id` would read the clock twice and allocate an
    /// origin, all to be replaced).
    pub fn received(
        id: String,
        from: impl Into<String>,
        kind: Kind,
        timestamp: i64,
        origin: Origin,
    ) -> Self {
        Envelope {
            id,
            from: from.into(),
            to: Vec::new(),
            mentions: Vec::new(),
            audience: Audience::Addressed,
            echo: false,
            kind,
            reply_to: None,
            correlation_id: None,
            thread: None,
            task: None,
            text: None,
            data: None,
            attachments: Vec::new(),
            timestamp,
            priority: Priority::Normal,
            ttl_secs: None,
            origin,
        }
    }

    /// The bytes of its text and origin frame: most of any written form of it, which a
    /// writer sizes its buffer by.
    pub fn bulk_len(&self) -> usize {
        self.text.as_ref().map_or(0, String::len) + self.origin.native_json().map_or(0, str::len)
    }

    /// Every agent name the message is addressed to, `to` first, without repeats.
    pub fn addressees(&self) -> impl Iterator<Item = &str> {
        // Most messages name a handful of agents: looking back over the earlier names costs
        // less than allocating a set, until the list grows.
        const SCAN_LIMIT: usize = 16;
        let total = self.to.len() + self.mentions.len();
        let mut hashed: Option<std::collections::HashSet<&str>> =
            (total > SCAN_LIMIT).then(|| std::collections::HashSet::with_capacity(total));
        let all = move || {
            self.to
                .iter()
                .chain(self.mentions.iter())
                .map(String::as_str)
        };
        all()
            .enumerate()
            .filter(move |(i, name)| match &mut hashed {
                Some(set) => set.insert(name),
                None => !all().take(*i).any(|earlier| earlier == *name),
            })
            .map(|(_, name)| name)
    }

    /// Whether `name` is named in `to` or `mentions`.
    pub fn names(&self, name: &str) -> bool {
        self.to
            .iter()
            .chain(self.mentions.iter())
            .any(|n| n == name)
    }

    pub fn origin_is(&self, protocol: Protocol) -> bool {
        self.origin.protocol == protocol
    }
}

thread_local! {
    /// Each thread's own UUIDv7 counter. `Uuid::now_v7` takes the crate's one shared
    /// counter, a mutex every runtime thread would lock for every message it stamps.
    static ID_COUNTER: uuid::ContextV7 = const { uuid::ContextV7::new() };
}

/// A fresh message id: UUIDv7, so ids sort by creation time: to the millisecond, and within
/// one by creation on the same thread.
pub fn new_message_id() -> String {
    use uuid::timestamp::context::ThreadLocalContext;
    let now = uuid::Timestamp::now(ThreadLocalContext::new(&ID_COUNTER));
    uuid_text(uuid::Uuid::new_v7(now))
}

/// `uuid` hyphenated in lower case, encoded into a buffer and copied once: `to_string`
/// goes through the formatter and grows its string twice (250 instructions of every
/// message the bridge stamps).
pub(crate) fn uuid_text(uuid: uuid::Uuid) -> String {
    let mut text = uuid::Uuid::encode_buffer();
    uuid.hyphenated().encode_lower(&mut text).to_owned()
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_origin_read_back_keeps_its_frame_as_the_text_it_was_written_as() {
        let frame = r#"{"id":"m1", "payload" : {"text":"hi"},"n":[1,2]}"#;
        let json = format!(r#"{{"protocol":"skynet","native":{frame}}}"#);
        let origin: Origin = serde_json::from_str(&json).unwrap();
        assert_eq!(origin.native_json(), Some(frame), "not rewritten");
        assert_eq!(origin.native().unwrap()["payload"]["text"], "hi");
        let none: Origin = serde_json::from_str(r#"{"protocol":"grid","native":null}"#).unwrap();
        assert_eq!((none.native_json(), none.native()), (None, None));
        let absent: Origin = serde_json::from_str(r#"{"protocol":"grid"}"#).unwrap();
        assert_eq!(absent.native_json(), None);
    }

    #[test]
    fn message_ids_are_lower_case_uuid_v7s_in_creation_order() {
        let ids: Vec<String> = (0..1000).map(|_| new_message_id()).collect();
        for id in &ids {
            let uuid = uuid::Uuid::parse_str(id).unwrap();
            assert_eq!(uuid.get_version_num(), 7);
            assert_eq!(*id, uuid.hyphenated().to_string());
        }
        assert!(ids.is_sorted_by(|a, b| a < b), "one thread's ids count up");
        // Another thread's, made later, sort after this thread's to the millisecond.
        std::thread::sleep(std::time::Duration::from_millis(2));
        let later = std::thread::spawn(new_message_id).join().unwrap();
        assert!(ids.last().unwrap() < &later);
    }

    #[test]
    fn every_kind_is_found_by_its_name() {
        for &kind in Kind::ALL {
            assert_eq!(Kind::from_name(kind.as_str()), Some(kind));
        }
        assert_eq!(Kind::from_name("chat.message"), None);
    }

    #[test]
    fn addressees_are_unique_and_ordered() {
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.to = vec!["b".into(), "c".into()];
        env.mentions = vec!["c".into(), "d".into(), "b".into()];
        let names: Vec<_> = env.addressees().collect();
        assert_eq!(names, ["b", "c", "d"]);

        let many: Vec<String> = (0..40).map(|i| format!("n{}", i % 20)).collect();
        env.to = many.clone();
        env.mentions = many;
        assert_eq!(env.addressees().count(), 20);
    }

    #[test]
    fn envelope_round_trips_through_json() {
        let mut env = Envelope::new("test", "a", Kind::TaskAssign);
        env.task = Some(Box::new(TaskInfo {
            id: "t1".into(),
            state: Some(TaskState::Assigned),
            ..Default::default()
        }));
        env.audience = Audience::Group("g".into());
        let json = serde_json::to_string(&env).unwrap();
        let back: Envelope = serde_json::from_str(&json).unwrap();
        assert_eq!(env, back);
    }

    #[test]
    fn the_native_frame_is_written_once_and_follows_set_native() {
        let mut env = Envelope::new("test", "a", Kind::Chat);
        let native = serde_json::json!({ "type": "chat", "text": "say \"hi\"" });
        env.origin.set_native(Some(native.clone()));
        let first = &*serde_json::to_string(&native).unwrap();
        assert_eq!(env.origin.native_json(), Some(first));
        let body = serde_json::to_string(&env).unwrap();
        assert!(body.contains(&format!(r#""native":{first}"#)), "{body}");
        let back: Envelope = serde_json::from_str(&body).unwrap();
        assert_eq!(back, env);
        assert_eq!(back.origin.native_json(), Some(first));

        env.origin
            .set_native(Some(serde_json::json!({ "type": "other" })));
        assert_eq!(env.origin.native_json(), Some(r#"{"type":"other"}"#));
        assert_eq!(
            env.clone().origin.native_json(),
            Some(r#"{"type":"other"}"#)
        );
        env.origin.set_native(None);
        assert_eq!(env.origin.native_json(), None);
        assert!(!serde_json::to_string(&env).unwrap().contains("native"));
    }

    #[test]
    fn a_native_frame_written_in_its_own_order_keeps_it_until_replaced() {
        let native = serde_json::json!({ "type": "t", "data": 1 });
        let json = r#"{"type":"t","data":1}"#.to_owned();
        let mut origin = Origin::from_native_json("test", json);
        assert_eq!(origin.native(), Some(&native));
        assert_eq!(origin.native_json(), Some(r#"{"type":"t","data":1}"#));
        origin.set_native(Some(native));
        assert_eq!(origin.native_json(), Some(r#"{"data":1,"type":"t"}"#));
    }

    #[test]
    fn fields_at_their_default_are_left_out_and_read_back() {
        let env = Envelope::new("test", "a", Kind::Chat);
        let json = serde_json::to_value(&env).unwrap();
        for field in ["audience", "echo", "priority"] {
            assert!(json.get(field).is_none(), "{field} in {json}");
        }
        assert_eq!(serde_json::from_value::<Envelope>(json).unwrap(), env);

        let mut env = env;
        env.echo = true;
        env.priority = Priority::High;
        env.audience = Audience::Everyone;
        let back: Envelope = serde_json::from_str(&serde_json::to_string(&env).unwrap()).unwrap();
        assert_eq!(back, env);
    }
}
