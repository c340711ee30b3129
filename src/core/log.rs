//! What the core needs of persistence: a log of record for messages. A message is appended
//! to it before it is routed or acknowledged; replay, the conversation links of older
//! messages and a slow reader's backlog are read back from it. The store (`store::Store`,
//! embedded SQLite) implements it; a log outside the process can.

use std::pin::Pin;

use super::correlation::{Link, TaskRequest};
use super::envelope::Envelope;

/// A message read back from the log.
#[derive(Clone, Debug)]
pub struct StoredMessage {
    pub seq: i64,
    pub envelope: Envelope,
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

    /// The id of the message whose UUID form (a derived id shown to a protocol whose ids
    /// must be UUIDs) is `uuid`.
    fn id_by_uuid(&self, uuid: &str) -> LogFuture<'_, Option<String>>;
}
