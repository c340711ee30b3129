//! What an endpoint's hub applied, kept so that after a restart it applies what it had
//! been routed and had not (`protocols::hub::Hub::catch_up`). A message is acknowledged
//! once the log holds it, and a hub applies it later: without this, a bridge killed while
//! its hub was behind would never apply the rest. The store implements it.

use super::log::{LogFuture, StoredMessage};

/// The stored messages a hub catches up on (`AppliedMarks::catch_up_window`): those after
/// `after`, through `through`, in the order stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CatchUp {
    pub after: i64,
    pub through: i64,
}

pub trait AppliedMarks: Send + Sync {
    /// Marks message `id` applied by `consumer` (a hub), queued at the call: what it
    /// applied before a restart is not given it again (`unapplied_tasks`). With `prune`,
    /// only its newest that many marks are kept.
    fn mark_applied(
        &self,
        consumer: &'static str,
        id: &str,
        prune: Option<usize>,
    ) -> LogFuture<'static, ()>;

    /// Where `consumer` catches up: after the message it last caught up to (or, if that
    /// is earlier, the `at_most`th newest task message), through the newest message. A
    /// consumer that never caught up has nothing to catch up on: it cannot tell what it
    /// applied before it kept marks.
    fn catch_up_window(&self, consumer: &'static str, at_most: usize) -> LogFuture<'_, CatchUp>;

    /// The first `page` task messages of `window` that `consumer` has not marked applied,
    /// in the order stored.
    fn unapplied_tasks(
        &self,
        consumer: &'static str,
        window: CatchUp,
        page: usize,
    ) -> LogFuture<'_, Vec<StoredMessage>>;

    /// `consumer` applied, or passed over, every message up to `through`: the ids it had
    /// marked applied, whose marks go.
    fn caught_up(&self, consumer: &'static str, through: i64) -> LogFuture<'static, Vec<String>>;
}
