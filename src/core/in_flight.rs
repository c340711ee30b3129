//! A connection's sent messages on their way to the store.

use std::pin::Pin;

use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;

use super::{Envelope, Staged};
use crate::store::StoreError;

type Durable<T> = Pin<Box<dyn Future<Output = (Result<Envelope, StoreError>, T)> + Send>>;

/// Messages one connection has staged, each with what the connection must do once it is
/// stored (`T`), yielded in the order they were staged. The connection keeps reading while
/// they are written; once `LIMIT` are in flight it waits, so a fast sender cannot queue
/// without bound. Routing them as they come out keeps a sender's messages in order.
pub struct InFlight<T> {
    queue: FuturesOrdered<Durable<T>>,
}

impl<T: Send + 'static> InFlight<T> {
    pub const LIMIT: usize = 256;

    pub fn new() -> Self {
        InFlight {
            queue: FuturesOrdered::new(),
        }
    }

    pub fn push(&mut self, staged: Staged, then: T) {
        self.queue
            .push_back(Box::pin(async move { (staged.durable().await, then) }));
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Whether the connection may read another message.
    pub fn has_room(&self) -> bool {
        self.queue.len() < Self::LIMIT
    }

    /// The oldest message, once stored (or not); `None` when none is in flight.
    pub async fn next(&mut self) -> Option<(Result<Envelope, StoreError>, T)> {
        self.queue.next().await
    }
}

impl<T: Send + 'static> Default for InFlight<T> {
    fn default() -> Self {
        Self::new()
    }
}
