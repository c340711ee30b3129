//! What the core needs of persistence: a log of record for messages. A message is appended
//! to it before it is routed or acknowledged; replay, the conversation links of older
//! messages and a slow reader's backlog are read back from it. The store (`store::Store`,
//! embedded SQLite) implements it; `federation` wraps it in one the fleet's bridges share.

use std::pin::Pin;
use std::sync::Arc;

use super::correlation::{Link, TaskRequest};
use super::delivery::Recipients;
use super::envelope::Envelope;
use super::hold::Outstanding;

/// A message read back from the log.
#[derive(Clone, Debug)]
pub struct StoredMessage {
    pub seq: i64,
    pub envelope: Envelope,
}

/// What the last run of a log kept of the messages it had not yet done with as it went
/// (`store::redelivery`): the ids it kept pending, and the newest message stored when it
/// kept them. Every message stored up to that one and not among them had been written to
/// its recipients that hold, or kept as their mail; those stored after it may not have.
/// Until what it covers was read again (`read_again`), this run's keeping carries it on,
/// so that a run stopped or killed before that leaves it to the next.
#[derive(Debug, Default)]
pub struct LeftUndelivered {
    /// Each with the agents whose recipients had not been written it or kept it as mail,
    /// where the last run could tell (`HoldersOf::holders`).
    pub pending: std::collections::HashMap<String, Option<Arc<[String]>>>,
    /// `None` when nothing was kept: then no message is known done with.
    pub kept_through: Option<i64>,
    /// In a fleet, where the fleet's stream was to be read again from for what the last
    /// run acknowledged to it before it was written (its heartbeat's floor, which a clean
    /// stop deletes from the fleet).
    pub unwritten_from: Option<u64>,
    read_again: std::sync::atomic::AtomicBool,
}

impl LeftUndelivered {
    pub fn new(
        pending: std::collections::HashMap<String, Option<Arc<[String]>>>,
        kept_through: Option<i64>,
    ) -> Self {
        LeftUndelivered {
            pending,
            kept_through,
            unwritten_from: None,
            read_again: Default::default(),
        }
    }

    /// With where the fleet's stream was to be read again from (`unwritten_from`).
    pub fn with_unwritten_from(mut self, unwritten_from: Option<u64>) -> Self {
        self.unwritten_from = unwritten_from;
        self
    }

    /// Whether the last run had done with `message`, a stored one.
    pub fn done_with(&self, message: &StoredMessage) -> bool {
        self.kept_through
            .is_some_and(|through| message.seq <= through)
            && !self.pending.contains_key(&message.envelope.id)
    }

    /// The recipients that hold a stored message not done with (`done_with`) to route it
    /// again to, where the last run named them: those it had not been written or kept for.
    pub fn holders_named(&self, id: &str) -> Option<Recipients> {
        let agents = self.pending.get(id)?.as_ref()?;
        Some(Recipients::HoldersFor(agents.clone()))
    }

    /// What it covers was read again, and what of that was not done with routed again
    /// (and so pending in this run's own keeping): it need not be carried on.
    pub fn read_again(&self) {
        (self.read_again).store(true, std::sync::atomic::Ordering::Release);
    }

    pub fn is_read_again(&self) -> bool {
        self.read_again.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// In a fleet, where the bridge's stream is to be read again from after it stops or is
/// killed, for what it acknowledged before it was written (the floor its heartbeats carry):
/// its store keeps it too (`LeftUndelivered::unwritten_from`), as a clean stop deletes the
/// heartbeat and the fleet forgets one two TTLs old.
pub trait UnwrittenFrom: Send + Sync {
    /// Where the stream is to be read again from now (`None`: nowhere before the
    /// acknowledgement floor).
    fn now(&self) -> Option<u64>;

    /// The store kept `floor`, which `now` said (or an older one): a batch acknowledged
    /// unwritten from there on is covered by the store too.
    fn kept(&self, floor: Option<u64>);

    /// Resolves once the fleet asks for the floor to be kept now: a batch acknowledged
    /// unwritten waits for it.
    fn wanted(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// Which stored messages to read back. Results are always chronological.
#[derive(Clone, Debug, Default)]
pub struct MessageQuery {
    /// Only messages strictly older than this timestamp (ms).
    pub before: Option<i64>,
    /// Only messages strictly newer than this timestamp (ms).
    pub after: Option<i64>,
    /// Only messages that name one of these agents (or go to everyone, with `or_everyone`).
    pub recipients: Option<Vec<String>>,
    pub or_everyone: bool,
    /// Only these kinds (by `Kind::as_str`).
    pub kinds: Option<Vec<&'static str>>,
    /// Only messages in this thread: `Some(None)` is the lobby (no thread).
    pub thread: Option<Option<String>>,
    /// Leave out private messages (for a history anyone may read).
    pub public_only: bool,
    /// Only the conversation this message began: it, and the messages whose correlation
    /// id it is.
    pub conversation: Option<String>,
    /// The newest `limit` of the matches.
    pub limit: usize,
}

/// Why the log could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("the message log is closed")]
    Closed,
    #[error(transparent)]
    Failed(Box<dyn std::error::Error + Send + Sync>),
    /// The log will not take the message now, for a reason the sender can act on (a log
    /// shared with other bridges that cannot reach them).
    #[error("{0}")]
    Refused(String),
}

impl LogError {
    /// What the message's sender is told: the reason the log refused it, or `otherwise`
    /// (a failure of the log's own is for the bridge's logs, not the sender).
    pub fn tell_sender(&self, otherwise: &str) -> String {
        match self {
            LogError::Refused(reason) => reason.clone(),
            _ => otherwise.to_owned(),
        }
    }
}

/// A log operation under way.
pub type LogFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, LogError>> + Send + 'a>>;

pub trait MessageLog: Send + Sync {
    /// Appends `env`, replacing a message with its id. The append is queued at the call, in
    /// call order; the future resolves once it is durable.
    fn append(&self, env: &Envelope) -> LogFuture<'static, ()>;

    /// The messages `query` selects.
    fn read(&self, query: MessageQuery) -> LogFuture<'_, Vec<StoredMessage>>;

    /// The messages with these ids, in the order asked; ids not in the log are left out.
    fn read_ids(&self, ids: Vec<String>) -> LogFuture<'_, Vec<StoredMessage>>;

    fn get(&self, id: &str) -> LogFuture<'_, Option<StoredMessage>>;

    /// The messages whose `reply_to` is `id`, oldest first.
    fn replies(&self, id: &str) -> LogFuture<'_, Vec<StoredMessage>>;

    /// Whether a message with this id is in the log (without reading it back).
    fn contains(&self, id: &str) -> LogFuture<'_, bool>;

    /// A stored message's place in its conversation.
    fn link(&self, id: &str) -> LogFuture<'_, Option<Link>>;

    /// The latest message that assigned task `task_id`.
    fn task_request(&self, task_id: &str) -> LogFuture<'_, Option<TaskRequest>>;

    /// A message that is not kept (a status change) was routed. A log shared with other
    /// bridges passes it on to them; the embedded one has nothing to do.
    fn pass_on(&self, _env: &Envelope) {}

    /// What the deliveries of appended message `id` are to hold as they are written or kept
    /// for an agent away (`Outstanding`), if the log would learn when they are: a log shared
    /// with other bridges has its own messages acknowledged only then, so a bridge killed
    /// before leaves them to the others to keep; a bridge alone's keeps the message pending
    /// until then, to route it again after a restart (`store::redelivery`). Asked once, as
    /// the message is routed.
    fn delivery_hold(&self, _id: &str) -> Option<Outstanding> {
        None
    }

    /// The id of the message whose UUID form (a derived id shown to a protocol whose ids
    /// must be UUIDs) is `uuid`.
    fn id_by_uuid(&self, uuid: &str) -> LogFuture<'_, Option<String>>;
}
