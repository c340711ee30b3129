//! A connection's sent messages on their way to the store.

use std::collections::VecDeque;

use super::log::LogError;
use super::{Envelope, Staged};

/// Messages one connection has staged, each with what the connection must do once it is
/// stored (`T`), yielded in the order they were staged. The connection keeps reading while
/// they are written; once `LIMIT` are in flight it waits, so a fast sender cannot queue
/// without bound. Routing them as they come out keeps a sender's messages in order.
///
/// Only the oldest write is waited on: the store commits writes in the order they were
/// queued, so when it is done the ones after it are done or next. (A set of futures
/// polled together would cost an allocation and a task node per message, for order that
/// would have to be restored anyway.)
pub struct InFlight<T> {
    queue: VecDeque<(Staged, T)>,
}

impl<T: Send + 'static> InFlight<T> {
    pub const LIMIT: usize = 256;

    pub fn new() -> Self {
        InFlight {
            queue: VecDeque::new(),
        }
    }

    pub fn push(&mut self, staged: Staged, then: T) {
        self.queue.push_back((staged, then));
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Whether the connection may read another message.
    pub fn has_room(&self) -> bool {
        self.queue.len() < Self::LIMIT
    }

    /// The oldest message, once stored (or not); `None` when none is in flight.
    /// Cancel-safe: a write finished is taken out in the same poll that sees it finish.
    pub async fn next(&mut self) -> Option<(Result<Envelope, LogError>, T)> {
        let (oldest, _) = self.queue.front_mut()?;
        let written = oldest.written().await;
        let (staged, then) = self.queue.pop_front()?;
        Some((written.map(|()| staged.env), then))
    }
}

impl<T: Send + 'static> Default for InFlight<T> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::oneshot;

    use super::*;
    use crate::core::Kind;

    /// A message whose write finishes when the returned sender says how.
    fn staged(id: &str) -> (Staged, oneshot::Sender<Result<(), LogError>>) {
        let (done, finished) = oneshot::channel();
        let env = Envelope::with_id(id.into(), "test", "a", Kind::Chat);
        let write = Box::pin(async move { finished.await.unwrap_or(Err(LogError::Closed)) });
        let remembered_by = None;
        (
            Staged {
                env,
                write,
                remembered_by,
            },
            done,
        )
    }

    #[tokio::test]
    async fn messages_come_out_in_the_order_they_were_staged_whatever_finishes_first() {
        let mut in_flight = InFlight::new();
        let mut writes = Vec::new();
        for (i, id) in ["m1", "m2", "m3"].into_iter().enumerate() {
            let (staged, done) = staged(id);
            in_flight.push(staged, i);
            writes.push(done);
        }
        // The last write finishes first, the second fails.
        let mut writes = writes.into_iter().rev();
        writes.next().unwrap().send(Ok(())).unwrap();
        writes.next().unwrap().send(Err(LogError::Closed)).unwrap();
        writes.next().unwrap().send(Ok(())).unwrap();
        let mut out = Vec::new();
        while let Some((stored, i)) = in_flight.next().await {
            out.push((stored.map(|env| env.id).ok(), i));
        }
        assert_eq!(
            out,
            [(Some("m1".into()), 0), (None, 1), (Some("m3".into()), 2)]
        );
    }

    /// `next` given up on (a `select!` taking another branch) loses nothing.
    #[tokio::test]
    async fn a_wait_given_up_loses_nothing() {
        let mut in_flight = InFlight::new();
        let (first, done) = staged("m1");
        in_flight.push(first, ());
        let waited = tokio::time::timeout(Duration::from_millis(10), in_flight.next()).await;
        assert!(waited.is_err(), "not written yet");
        done.send(Ok(())).unwrap();
        let (stored, ()) = in_flight.next().await.unwrap();
        assert_eq!(stored.unwrap().id, "m1");
        assert!(in_flight.is_empty() && in_flight.next().await.is_none());
    }
}
