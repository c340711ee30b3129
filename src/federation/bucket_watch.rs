//! A watch of a KV bucket that is made again, from where it was, when it stalls.
//!
//! async-nats watches a bucket through an ordered consumer whose idle heartbeat it fixes at
//! five seconds. When the NATS server holding that consumer fails while the client, on
//! another server, stays connected, the watch learns of it only after two missed
//! heartbeats: ten seconds in which nothing reaches it — longer than the presence TTL. So
//! while a watch is idle, its bridge asks the bucket's stream, every `check_every` (a second,
//! or a heartbeat for the heartbeats), for the first message past what the watch delivered
//! (a direct get, which any of the stream's servers answers); one still not delivered at
//! the next check means the watch stalled, and it is made again from there.

use std::time::Duration;

use async_nats::jetstream::kv::{Entry, Store, Watch, WatchError, WatcherError};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use tokio::time::{Interval, MissedTickBehavior};

use crate::core::Revision;

pub struct BucketWatch {
    bucket: Store,
    /// The keys watched (`>` for all).
    keys: String,
    watch: Watch,
    /// The last revision the watch delivered (or, for a watch of what comes next, the
    /// stream's last when it was made).
    delivered: Revision,
    /// Whether the watch delivered anything since the last check.
    news: bool,
    /// A revision past `delivered` that the stream held at the last check.
    awaited: Option<Revision>,
    /// How long a watch is idle before its stream is asked whether it missed something,
    /// and how long what it missed may then take to arrive before it is taken for stalled.
    check: Interval,
    /// The question to the stream under way, kept here so that a caller's `select!`
    /// dropping `next` does not drop it; likewise the watch being made again.
    asking: Option<BoxFuture<'static, Option<Revision>>>,
    making_again: Option<BoxFuture<'static, Result<Watch, WatchError>>>,
    /// The watch's name in `agentbridge_federation_watch_stalls_total`.
    label: &'static str,
}

impl BucketWatch {
    /// Watches `keys` of `bucket` from their last values on.
    pub async fn from_last_values(
        bucket: &Store,
        keys: &str,
        check_every: Duration,
        label: &'static str,
    ) -> Result<BucketWatch, WatchError> {
        let watch = bucket.watch_with_history(keys).await?;
        Ok(BucketWatch::new(bucket, keys, watch, 0, check_every, label))
    }

    /// Watches the changes to `keys` of `bucket` that come next.
    pub async fn from_next(
        bucket: &Store,
        keys: &str,
        check_every: Duration,
        label: &'static str,
    ) -> Result<BucketWatch, async_nats::Error> {
        let last = bucket.stream.clone().info().await?.state.last_sequence;
        let watch = bucket.watch_from_revision(keys, last + 1).await?;
        Ok(BucketWatch::new(
            bucket,
            keys,
            watch,
            last,
            check_every,
            label,
        ))
    }

    fn new(
        bucket: &Store,
        keys: &str,
        watch: Watch,
        delivered: Revision,
        check_every: Duration,
        label: &'static str,
    ) -> BucketWatch {
        let mut check = tokio::time::interval(check_every);
        check.set_missed_tick_behavior(MissedTickBehavior::Delay);
        BucketWatch {
            bucket: bucket.clone(),
            keys: keys.to_owned(),
            watch,
            delivered,
            news: false,
            awaited: None,
            check,
            asking: None,
            making_again: None,
            label,
        }
    }

    /// The next change; `None` when the watch ended, or could not be made again after it
    /// stalled. Cancel-safe.
    pub async fn next(&mut self) -> Option<Result<Entry, WatcherError>> {
        loop {
            let idle = self.asking.is_none() && self.making_again.is_none();
            tokio::select! {
                entry = self.watch.next(), if self.making_again.is_none() => {
                    if let Some(Ok(entry)) = &entry {
                        self.delivered = self.delivered.max(entry.revision);
                        self.news = true;
                    }
                    return entry;
                }
                _ = self.check.tick(), if idle => self.check_for_stall(),
                awaited = finished(&mut self.asking) => self.awaited = awaited,
                made = finished(&mut self.making_again) => match made {
                    Ok(watch) => self.watch = watch,
                    Err(e) => {
                        tracing::debug!(error = %e, watch = self.label, "federation: cannot watch again yet");
                        return None;
                    }
                },
            }
        }
    }

    /// At a check: a watch idle since the last, and still without a revision the stream
    /// held then, stalled, and is made again from past what it delivered. Otherwise, if
    /// it is idle, the stream is asked for the first revision it holds past that; one that
    /// cannot say is taken for one with nothing more.
    fn check_for_stall(&mut self) {
        if std::mem::take(&mut self.news) {
            self.awaited = None;
            return;
        }
        let after = self.delivered;
        if self.awaited.take().is_some_and(|at| at > after) {
            crate::telemetry::federation_watch_stalled(self.label);
            tracing::info!(watch = self.label, keys = %self.keys, after, "federation: a watch stalled; it is made again");
            let (bucket, keys) = (self.bucket.clone(), self.keys.clone());
            self.making_again = Some(Box::pin(async move {
                bucket.watch_from_revision(keys, after + 1).await
            }));
            return;
        }
        let (stream, timeout) = (self.bucket.stream.clone(), self.check.period());
        let subject = format!("{}{}", self.bucket.prefix, self.keys);
        self.asking = Some(Box::pin(async move {
            let next = stream.direct_get_next_for_subject(subject, Some(after + 1));
            match tokio::time::timeout(timeout, next).await {
                Ok(Ok(message)) => Some(message.sequence),
                _ => None,
            }
        }));
    }
}

/// The output of `future`, which is then gone; never, while there is none.
async fn finished<T>(future: &mut Option<BoxFuture<'static, T>>) -> T {
    let Some(running) = future else {
        return std::future::pending().await;
    };
    let output = running.await;
    *future = None;
    output
}
