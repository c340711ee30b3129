//! A watch of a KV bucket that is made again, from where it was, when it stalls.
//!
//! async-nats watches a bucket through an ordered consumer whose idle heartbeat it fixes at
//! five seconds. When the NATS server holding that consumer fails while the client, on
//! another server, stays connected, the watch learns of it only after two missed
//! heartbeats: ten seconds in which nothing reaches it — longer than the presence TTL. So
//! every `check_every` (a second, or a heartbeat for the heartbeats) a bridge asks the
//! bucket's stream for the first message past what the watch delivered (a direct get, which
//! any of the stream's servers answers); when one found at a check is still not delivered
//! at the next, and the watch delivered nothing in between, the watch stalled, and it is
//! made again from there.

use std::time::Duration;

use async_nats::jetstream::kv::{Entry, Store, Watch, WatcherError};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use tokio::time::{Instant, Interval, MissedTickBehavior};

use crate::core::Revision;

/// The pause before making a watch again after a failed try, doubled after each failure
/// in a row up to `MOST_BETWEEN_TRIES`.
const TRY_AGAIN_AFTER: Duration = Duration::from_millis(250);
const MOST_BETWEEN_TRIES: Duration = Duration::from_secs(1);

/// How often a watch of a bucket without heartbeats of its own (the cards, the records)
/// is checked for a stall.
pub const CHECKED_EVERY: Duration = Duration::from_secs(1);

/// How long an answer from the stream is waited for, at least: a heartbeat may be shorter
/// than a busy server takes to answer.
const ANSWERED_WITHIN: Duration = Duration::from_secs(1);

/// Where a watch starts.
#[derive(Clone, Copy)]
enum From {
    /// The keys' last values.
    LastValues,
    /// What comes after the stream's last message now.
    Next,
    /// What comes after this revision.
    After(Revision),
}

type Making = BoxFuture<'static, Result<(Watch, Revision), async_nats::Error>>;

pub struct BucketWatch {
    bucket: Store,
    /// The keys watched (`>` for all).
    keys: String,
    /// None until it is made, and while it is made again.
    watch: Option<Watch>,
    from: From,
    /// The last revision the watch delivered (or, for a watch of what comes next, the
    /// stream's last when it was made).
    delivered: Revision,
    /// Whether the watch delivered anything since the last check.
    news: bool,
    /// A revision past `delivered` that the stream held at the last check.
    awaited: Option<Revision>,
    /// How long what the stream holds may take to be delivered before the watch is taken
    /// for stalled; the stream is asked that often.
    check: Interval,
    /// The question to the stream under way, and the watch being made, kept here so that a
    /// caller's `select!` dropping `next` drops neither.
    asking: Option<BoxFuture<'static, Option<Revision>>>,
    making: Option<Making>,
    /// Failed tries at making the watch, in a row.
    failed: u32,
    /// The watch's name in `agentbridge_federation_watch_stalls_total`.
    label: &'static str,
}

impl BucketWatch {
    /// A watch of `keys` of `bucket` from their last values on, made as `next` is first
    /// awaited.
    pub fn from_last_values(
        bucket: &Store,
        keys: &str,
        check_every: Duration,
        label: &'static str,
    ) -> BucketWatch {
        BucketWatch::new(bucket, keys, From::LastValues, check_every, label)
    }

    /// A watch of the changes to `keys` of `bucket` that come next, made as `next` is
    /// first awaited.
    pub fn from_next(
        bucket: &Store,
        keys: &str,
        check_every: Duration,
        label: &'static str,
    ) -> BucketWatch {
        BucketWatch::new(bucket, keys, From::Next, check_every, label)
    }

    fn new(
        bucket: &Store,
        keys: &str,
        from: From,
        check_every: Duration,
        label: &'static str,
    ) -> BucketWatch {
        let mut check = tokio::time::interval_at(Instant::now() + check_every, check_every);
        check.set_missed_tick_behavior(MissedTickBehavior::Delay);
        BucketWatch {
            bucket: bucket.clone(),
            keys: keys.to_owned(),
            watch: None,
            from,
            delivered: 0,
            news: false,
            awaited: None,
            check,
            asking: None,
            making: None,
            failed: 0,
            label,
        }
    }

    /// The next change; `None` once the client is closed. A watch that cannot be made is
    /// tried again, and one that fails is made again from what it delivered. Cancel-safe.
    pub async fn next(&mut self) -> Option<Entry> {
        loop {
            if self.watch.is_none() && self.making.is_none() {
                let pause = match self.failed {
                    0 => Duration::ZERO,
                    failed => {
                        (TRY_AGAIN_AFTER * 2u32.pow((failed - 1).min(8))).min(MOST_BETWEEN_TRIES)
                    }
                };
                self.making = Some(self.make(pause));
            }
            let watching = self.watch.is_some();
            // Biased, entries first: a check taking its turn ahead of an entry already here
            // would find the watch behind.
            tokio::select! {
                biased;
                entry = next_entry(&mut self.watch), if watching => match entry {
                    Some(Ok(entry)) => {
                        self.delivered = self.delivered.max(entry.revision);
                        self.news = true;
                        return Some(entry);
                    }
                    // async-nats's watch fails as it makes its consumer again (after missed
                    // heartbeats): made again here, from what it delivered.
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, watch = self.label, keys = %self.keys, "federation: a watch failed; it is made again");
                        self.make_again();
                    }
                    None => return None,
                },
                made = finished(&mut self.making) => match made {
                    Ok((watch, delivered)) => {
                        (self.watch, self.delivered, self.failed) = (Some(watch), delivered, 0);
                        self.check.reset();
                    }
                    Err(e) => {
                        self.failed = self.failed.saturating_add(1);
                        tracing::debug!(error = %e, watch = self.label, keys = %self.keys, "federation: cannot watch yet");
                    }
                },
                _ = self.check.tick(), if watching && self.asking.is_none() => self.check_for_stall(),
                awaited = finished(&mut self.asking) => {
                    self.awaited = awaited;
                    // What was found gets a whole period to be delivered.
                    self.check.reset();
                }
            }
        }
    }

    /// Drops the watch, unpolled, to be made again from past what it delivered: what it
    /// still held comes again from the new one.
    fn make_again(&mut self) {
        self.watch = None;
        self.from = From::After(self.delivered);
    }

    /// The watch, made from `self.from` after `pause`, with what it delivered up to then.
    fn make(&self, pause: Duration) -> Making {
        let (bucket, keys, from) = (self.bucket.clone(), self.keys.clone(), self.from);
        Box::pin(async move {
            tokio::time::sleep(pause).await;
            let last = match from {
                From::LastValues => None,
                _ => Some(bucket.stream.clone().info().await?.state.last_sequence),
            };
            let after = match (from, last) {
                (From::Next, Some(last)) => last,
                // A stream behind what the watch delivered was made again (the bucket
                // deleted and created anew): its revisions start over, so it is read whole.
                (From::After(revision), Some(last)) if last >= revision => revision,
                _ => return Ok((bucket.watch_with_history(keys).await?, 0)),
            };
            Ok((bucket.watch_from_revision(keys, after + 1).await?, after))
        })
    }

    /// At a check: a watch that delivered nothing since the last, and not the revision
    /// the stream held then, stalled, and is made again from past what it delivered.
    /// Otherwise the stream is asked for the first revision it holds past that; one that
    /// cannot say is taken for one with nothing more.
    fn check_for_stall(&mut self) {
        let news = std::mem::take(&mut self.news);
        let after = self.delivered;
        if !news && self.awaited.take().is_some_and(|at| at > after) {
            crate::telemetry::federation_watch_stalled(self.label);
            tracing::info!(watch = self.label, keys = %self.keys, after, "federation: a watch stalled; it is made again");
            self.make_again();
            return;
        }
        let stream = self.bucket.stream.clone();
        let timeout = self.check.period().max(ANSWERED_WITHIN);
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

async fn next_entry(watch: &mut Option<Watch>) -> Option<Result<Entry, WatcherError>> {
    match watch {
        Some(watch) => watch.next().await,
        None => std::future::pending().await,
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
