//! The records endpoints share, in one KV bucket of the fleet (`<prefix>_records`), keyed
//! `<table>.<key>` (the key in URL-safe base64, which KV keys allow). A conditional write is
//! published as KV's create and update are, expecting the key's last message at the
//! revision the writer read (none, for a new record), which JetStream checks: of two
//! bridges writing one record at once, one is refused and reads again. Each table is
//! followed with a watch from its last values on, so a bridge that starts late or
//! reconnects applies what it missed.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::kv::{self, Operation};
use async_nats::jetstream::message::StreamMessage;

use super::bucket_watch::{self, BucketWatch};
use super::link::{NatsLink, lost_race, still_in_process};
use super::record_positions::RecordPositions;
use crate::core::{
    Expect, FAILED_APPLIED_AGAIN_EVERY, Record, RecordChange, RecordError, RecordFuture,
    RecordSink, Revision, SharedRecords,
};

/// How long a watch that failed waits before it starts again.
const REWATCH_AFTER: Duration = Duration::from_millis(500);

/// How long a taken record's key refuses `Expect::Unused` writes: the mark a take leaves
/// lives this long (a per-message TTL, so the records bucket allows them), longer than a
/// late copy of a message takes to reach the fleet from a bridge that was away.
pub const TAKEN_REMEMBERED: Duration = Duration::from_secs(7 * 24 * 3600);

/// Record writes `write_unused_in_order` has unanswered at once. Each holds one of the
/// JetStream context's ack permits (async-nats allows 5,000, shared with every other
/// publish) until its answer is awaited, so a batch larger than the permits left would
/// wait for one only its own answers could free.
const SENT_AT_ONCE: usize = 256;

pub struct FleetRecords {
    pub link: Arc<NatsLink>,
    pub shutdown: tokio_util::sync::CancellationToken,
    /// What this bridge wrote and applied of each table, for a moved agent's mail.
    pub positions: Arc<RecordPositions>,
    /// Since when writes have found no stream leader to answer them (`no_leader`).
    pub leaderless_since: parking_lot::Mutex<Option<std::time::Instant>>,
}

fn bucket_key(table: &str, key: &str) -> String {
    format!("{table}.{}", super::wire::agent_key(key))
}

fn record_key(table: &str, bucket_key: &str) -> Option<String> {
    use base64::Engine;
    let encoded = bucket_key.strip_prefix(table)?.strip_prefix('.')?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(encoded)
        .ok()?;
    String::from_utf8(bytes).ok()
}

impl FleetRecords {
    /// The fleet's buckets, while NATS is reachable, a server's failover waited out
    /// (`NatsLink::ready_after_failover`), as a message's publish waits.
    async fn ready(&self) -> Result<Arc<super::link::Ready>, RecordError> {
        (self.link.ready_after_failover().await)
            .ok_or_else(|| RecordError::Unavailable("NATS is unreachable".into()))
    }

    /// The records bucket, while NATS is reachable (`ready`).
    async fn bucket(&self) -> Result<kv::Store, RecordError> {
        Ok(self.ready().await?.records.clone())
    }

    /// The last message under `table`'s record `key`, from the stream's leader rather than
    /// the direct get any replica answers: a change reads the record, then writes it at
    /// that revision, and a replica behind answers a revision the write is then refused
    /// at, again and again while it lags.
    async fn last_message(
        &self,
        table: &str,
        key: &str,
    ) -> Result<Option<StreamMessage>, RecordError> {
        last_message_in(&self.bucket().await?, table, key).await
    }

    /// Publishes `write` as its record's new value if the key's last message is at
    /// `expect_last` (0: there is none); its revision. A publish whose answer timed out
    /// may have reached the stream all the same, and its writer would otherwise refuse its
    /// client what the fleet then holds, and leave undone what the write was to set off:
    /// it is made again under its id (`publish_again`).
    async fn publish_record(
        &self,
        write: &RecordWrite<'_>,
        expect_last: Revision,
    ) -> Result<Revision, RecordError> {
        let ready = self.ready().await?;
        let answer = publish_once(&ready, write, expect_last).await;
        self.settle(&ready, write, expect_last, answer).await
    }

    /// Whether writes have found no stream leader to answer them for longer than a
    /// publish waits (quorum lost, say): then one is refused at once rather than made
    /// again, as a leader's election is waited out.
    fn no_leader(&self) -> bool {
        let mut since = self.leaderless_since.lock();
        let since = since.get_or_insert_with(std::time::Instant::now);
        since.elapsed() > self.link.publish_timeout()
    }

    fn leader_answered(&self) {
        *self.leaderless_since.lock() = None;
    }

    /// What became of `write`, given its publish's `answer`.
    async fn settle(
        &self,
        ready: &super::link::Ready,
        write: &RecordWrite<'_>,
        expect_last: Revision,
        answer: Result<Revision, async_nats::jetstream::context::PublishError>,
    ) -> Result<Revision, RecordError> {
        use async_nats::jetstream::context::PublishErrorKind;
        match answer {
            Ok(revision) => {
                self.leader_answered();
                Ok(revision)
            }
            Err(e) if lost_race(&e) => Err(RecordError::Conflict),
            Err(e) if e.kind() == PublishErrorKind::StreamNotFound && self.no_leader() => {
                Err(unavailable(e))
            }
            // No answer, or no stream leader to answer (one being elected as a server
            // fails over): made again under its id.
            Err(e)
                if matches!(
                    e.kind(),
                    PublishErrorKind::TimedOut | PublishErrorKind::StreamNotFound
                ) =>
            {
                tracing::debug!(
                    table = write.table,
                    "federation: a record write got no answer; made again"
                );
                self.publish_again(ready, write, expect_last).await
            }
            Err(e) => Err(unavailable(e)),
        }
    }

    /// Publishes again `write`, whose first publish got no answer, under the same
    /// `Nats-Msg-Id`: JetStream answers with the first's revision if it landed, and this
    /// one lands if it did not. While a clustered stream is still replicating the first,
    /// it refuses the id for now, and it is tried again, for up to one more publish
    /// timeout. Refused at `expect_last` (a server that checks the revision before the
    /// id), or still refused by id when the time is up, the key's last message says: the
    /// first, by its id, landed; another write past `expect_last` makes it a `Conflict`
    /// (the first may have landed before it, which cannot be told any more).
    async fn publish_again(
        &self,
        ready: &super::link::Ready,
        write: &RecordWrite<'_>,
        expect_last: Revision,
    ) -> Result<Revision, RecordError> {
        use async_nats::jetstream::context::PublishErrorKind::{StreamNotFound, TimedOut};
        let until = tokio::time::Instant::now() + self.link.publish_timeout();
        let mut wait = Duration::from_millis(50);
        loop {
            match publish_once(ready, write, expect_last).await {
                Ok(revision) => {
                    self.leader_answered();
                    return Ok(revision);
                }
                Err(e) if lost_race(&e) || e.kind() == TimedOut => {
                    return self.which_landed(write, expect_last, e).await;
                }
                Err(e) if still_in_process(&e) || e.kind() == StreamNotFound => {
                    if tokio::time::Instant::now() + wait >= until {
                        return self.which_landed(write, expect_last, e).await;
                    }
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                }
                Err(e) => return Err(unavailable(e)),
            }
        }
    }

    /// What became of `write`, whose tries at `expect_last` got no answer and then `last_try`:
    /// its revision if the key's last message is it, a `Conflict` if another write is past
    /// `expect_last` (the write expected that, so it cannot land now), else unknown.
    async fn which_landed(
        &self,
        write: &RecordWrite<'_>,
        expect_last: Revision,
        last_try: impl std::fmt::Display,
    ) -> Result<Revision, RecordError> {
        let last = self.last_message(write.table, write.key).await?;
        match last {
            Some(last) if has_write_id(&last, &write.id) => Ok(last.sequence),
            Some(last) if last.sequence != expect_last => Err(RecordError::Conflict),
            None if expect_last != 0 => Err(RecordError::Conflict),
            _ => Err(unavailable(last_try)),
        }
    }

    /// Whether `message` is the mark of this bridge's take of the record at `revision`.
    /// (A mark written before marks carried the revision they took is taken to be.)
    fn taken_here_at(&self, message: &StreamMessage, revision: Revision) -> bool {
        let purge = kv_operation(message) == Some("PURGE");
        let at = message.headers.get(TAKEN_AT).map(|at| at.as_str());
        is_take_by(&self.link.bridge_id, purge, &message.payload)
            && at.is_none_or(|at| at == revision.to_string())
    }
}

/// One publish of `write` at `expect_last`: its sequence (the first's, for a copy
/// JetStream deduplicated).
async fn publish_once(
    ready: &super::link::Ready,
    write: &RecordWrite<'_>,
    expect_last: Revision,
) -> Result<Revision, async_nats::jetstream::context::PublishError> {
    Ok(send_once(ready, write, expect_last).await?.await?.sequence)
}

/// Sends `write` once; its answer is the future returned.
async fn send_once(
    ready: &super::link::Ready,
    write: &RecordWrite<'_>,
    expect_last: Revision,
) -> Result<PublishAckFuture, async_nats::jetstream::context::PublishError> {
    use async_nats::header::{NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_ID};
    let subject = put_subject(&ready.records, write.table, write.key);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, write.id.as_str());
    headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, expect_last.to_string());
    (ready.js)
        .publish_with_headers(subject, headers, write.value.clone())
        .await
}

/// The subject a message of `table`'s record `key` is published on, as async-nats's own
/// puts and purges name it: the bucket's context has no JetStream domain, so no API
/// prefix goes before it.
fn put_subject(bucket: &kv::Store, table: &str, key: &str) -> String {
    let prefix = bucket.put_prefix.as_ref().unwrap_or(&bucket.prefix);
    format!("{prefix}{}", bucket_key(table, key))
}

/// A write of a record, under an id of its own.
struct RecordWrite<'a> {
    table: &'a str,
    key: &'a str,
    value: bytes::Bytes,
    id: String,
}

/// Whether `message` is the write with `id`.
fn has_write_id(message: &StreamMessage, id: &str) -> bool {
    let header = message.headers.get(async_nats::header::NATS_MESSAGE_ID);
    header.is_some_and(|written| written.as_str() == id)
}

/// The header a take's mark gives the revision it took at: a bridge that took a record,
/// kept it again, and took it again has two marks, and only the one of the revision it
/// asks about answers for that take.
const TAKEN_AT: &str = "Agentbridge-Taken-At";

/// Whether a key's message — a purge or not, with `payload` — is the mark a take by bridge
/// `bridge_id` left (`SharedRecords::take`: the taker's id is the purge's payload).
fn is_take_by(bridge_id: &str, purge: bool, payload: &[u8]) -> bool {
    purge && payload == bridge_id.as_bytes()
}

/// The header KV gives the kind of a key's message in.
const KV_OPERATION: &str = "KV-Operation";

/// The kind KV gave a key's message (`DEL`, `PURGE`); none for a plain put.
fn kv_operation(message: &StreamMessage) -> Option<&str> {
    message.headers.get(KV_OPERATION).map(|op| op.as_str())
}

/// Whether `message` is a removal's marker: a delete, a take's purge, or the marker the
/// server leaves where a message's TTL ran out (`limit_markers`).
fn is_removal(message: &StreamMessage) -> bool {
    matches!(kv_operation(message), Some("DEL" | "PURGE"))
        || message.headers.get("Nats-Marker-Reason").is_some()
}

/// An entry's value, or `None` for the marker a removal leaves.
fn value_of(entry: kv::Entry) -> Option<bytes::Bytes> {
    (entry.operation == Operation::Put).then_some(entry.value)
}

fn unavailable(e: impl std::fmt::Display) -> RecordError {
    RecordError::Unavailable(e.to_string())
}

impl SharedRecords for FleetRecords {
    fn read<'a>(&'a self, table: &'a str, key: &'a str) -> RecordFuture<'a, Option<Record>> {
        Box::pin(async move {
            let Some(message) = self.last_message(table, key).await? else {
                return Ok(None);
            };
            Ok(Some(Record {
                revision: message.sequence,
                value: (!is_removal(&message)).then_some(message.payload),
            }))
        })
    }

    /// A publish of its own rather than KV's `create` and `update`: it carries an id, so
    /// that a write whose answer did not come can be made again (`publish_record`), and
    /// a create reads the key from the stream's leader, not from whichever replica answers.
    fn write<'a>(
        &'a self,
        table: &'a str,
        key: &'a str,
        value: bytes::Bytes,
        expected: Expect,
    ) -> RecordFuture<'a, Revision> {
        Box::pin(async move {
            let write = RecordWrite {
                table,
                key,
                value,
                id: uuid::Uuid::new_v4().to_string(),
            };
            let written = match expected {
                Expect::At(revision) => self.publish_record(&write, revision).await,
                // Revision 0: no message at all under the key, not even a take's mark.
                Expect::Unused => self.publish_record(&write, 0).await,
                Expect::Absent => match self.publish_record(&write, 0).await {
                    // Over a removal's marker, as KV's create goes: a write of its own (a
                    // clustered stream keeps the refused one's id a while).
                    Err(RecordError::Conflict) => match self.last_message(table, key).await? {
                        Some(last) if is_removal(&last) => {
                            let write = RecordWrite {
                                id: uuid::Uuid::new_v4().to_string(),
                                ..write
                            };
                            self.publish_record(&write, last.sequence).await
                        }
                        _ => Err(RecordError::Conflict),
                    },
                    written => written,
                },
            };
            if let Ok(revision) = written {
                self.positions.wrote(table, revision);
            }
            written
        })
    }

    /// The take's mark names this bridge (its payload), so that a bridge whose take got no
    /// answer finds out, when it takes the record again and is refused, whether the take
    /// that landed was its own.
    fn take<'a>(
        &'a self,
        table: &'a str,
        key: &'a str,
        revision: Revision,
    ) -> RecordFuture<'a, ()> {
        Box::pin(async move {
            use async_nats::header::{
                NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_TTL, NATS_ROLLUP,
            };
            let ready = self.ready().await?;
            let subject = put_subject(&ready.records, table, key);
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(KV_OPERATION, "PURGE");
            headers.insert(NATS_ROLLUP, "sub");
            headers.insert(NATS_MESSAGE_TTL, TAKEN_REMEMBERED.as_secs().to_string());
            headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, revision.to_string());
            headers.insert(TAKEN_AT, revision.to_string());
            let taker = bytes::Bytes::from(self.link.bridge_id.clone());
            let marked = async {
                (ready.js.publish_with_headers(subject, headers, taker))
                    .await?
                    .await
            };
            match marked.await {
                Ok(mark) => {
                    self.positions.wrote(table, mark.sequence);
                    Ok(())
                }
                Err(e) if lost_race(&e) => match self.last_message(table, key).await? {
                    Some(mark) if self.taken_here_at(&mark, revision) => {
                        self.positions.wrote(table, mark.sequence);
                        Ok(())
                    }
                    _ => Err(RecordError::Conflict),
                },
                Err(e) => Err(unavailable(e)),
            }
        })
    }

    /// Read from the stream's leader: `create` would ask whichever replica answers a direct
    /// get whether the key was removed, and one that has not applied the take yet says no.
    fn put_back<'a>(
        &'a self,
        table: &'a str,
        key: &'a str,
        value: bytes::Bytes,
        taken_at: Revision,
    ) -> RecordFuture<'a, Revision> {
        Box::pin(async move {
            let mark = match self.last_message(table, key).await? {
                Some(mark) if self.taken_here_at(&mark, taken_at) => mark.sequence,
                _ => return Err(RecordError::Conflict),
            };
            // As a write: one whose answer was lost is made again under its id.
            let write = RecordWrite {
                table,
                key,
                value,
                id: uuid::Uuid::new_v4().to_string(),
            };
            let revision = self.publish_record(&write, mark).await?;
            self.positions.wrote(table, revision);
            Ok(revision)
        })
    }

    fn write_unused_in_order<'a>(
        &'a self,
        table: &'a str,
        writes: Vec<(String, bytes::Bytes)>,
    ) -> RecordFuture<'a, Vec<Result<Revision, RecordError>>> {
        Box::pin(async move {
            let ready = self.ready().await?;
            let writes: Vec<RecordWrite> = (writes.iter())
                .map(|(key, value)| RecordWrite {
                    table,
                    key,
                    value: value.clone(),
                    id: uuid::Uuid::new_v4().to_string(),
                })
                .collect();
            let mut written = Vec::with_capacity(writes.len());
            for chunk in writes.chunks(SENT_AT_ONCE) {
                // Sent in order, each as soon as the connection takes it; answered together.
                let mut sent = Vec::with_capacity(chunk.len());
                for write in chunk {
                    sent.push(send_once(&ready, write, 0).await);
                }
                let answers = (sent.into_iter().zip(chunk)).map(|(sent, write)| {
                    let ready = &ready;
                    async move {
                        let answer = match sent {
                            Ok(ack) => ack.await.map(|ack| ack.sequence),
                            Err(e) => Err(e),
                        };
                        let written = self.settle(ready, write, 0, answer).await;
                        if let Ok(revision) = written {
                            self.positions.wrote(table, revision);
                        }
                        written
                    }
                });
                written.extend(futures_util::future::join_all(answers).await);
            }
            Ok(written)
        })
    }

    fn remove<'a>(&'a self, table: &'a str, key: &'a str) -> RecordFuture<'a, ()> {
        Box::pin(async move {
            (self.bucket().await?.delete(bucket_key(table, key)).await).map_err(unavailable)
        })
    }

    fn put_file<'a>(&'a self, name: &'a str, bytes: bytes::Bytes) -> RecordFuture<'a, ()> {
        Box::pin(async move {
            let files = self.ready().await?.files.clone();
            let mut reader: &[u8] = &bytes;
            files.put(name, &mut reader).await.map_err(unavailable)?;
            Ok(())
        })
    }

    fn file<'a>(&'a self, name: &'a str) -> RecordFuture<'a, Option<bytes::Bytes>> {
        Box::pin(async move {
            use async_nats::jetstream::object_store::GetErrorKind;
            use tokio::io::AsyncReadExt;
            let files = self.ready().await?.files.clone();
            let mut object = match files.get(name).await {
                Ok(object) => object,
                Err(e) if e.kind() == GetErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(unavailable(e)),
            };
            let mut bytes = Vec::new();
            object.read_to_end(&mut bytes).await.map_err(unavailable)?;
            Ok(Some(bytes.into()))
        })
    }

    fn reachable(&self) -> bool {
        self.link.ready().is_some()
    }

    fn mail_handed_over<'a>(
        &'a self,
        agent: &'a str,
        bridge: &'a str,
        table: &'a str,
        by: tokio::time::Instant,
    ) -> std::pin::Pin<Box<dyn Future<Output = crate::core::HandOver> + Send + 'a>> {
        let (link, positions) = (&self.link, &self.positions);
        Box::pin(super::handover::ask(
            link, positions, agent, bridge, table, by,
        ))
    }

    fn follow(&self, table: &'static str, sink: Arc<dyn RecordSink>) {
        let (link, shutdown) = (self.link.clone(), self.shutdown.clone());
        let positions = self.positions.clone();
        positions.follows(table);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = follow_once(&link, table, sink.as_ref(), &positions) => {}
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(REWATCH_AFTER) => {}
                }
            }
        });
    }
}

/// Watches `table` from its last values on, feeding `sink`, until the watch ends.
async fn follow_once(
    link: &NatsLink,
    table: &str,
    sink: &dyn RecordSink,
    positions: &RecordPositions,
) {
    let Some(ready) = link.set_up() else {
        return;
    };
    let keys = format!("{table}.>");
    let mut watch = BucketWatch::from_last_values(
        &ready.records,
        &keys,
        bucket_watch::CHECKED_EVERY,
        "records",
    );
    // Records whose apply kept failing are applied again between the watch's entries
    // (`BucketWatch::next` is cancel-safe), never beside an apply, as the bucket holds them.
    let mut apply_failed = tokio::time::interval(FAILED_APPLIED_AGAIN_EVERY);
    apply_failed.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    apply_failed.reset();
    let current = |key: String| -> RecordFuture<'static, Option<RecordChange>> {
        let (records, bridge_id) = (ready.records.clone(), link.bridge_id.clone());
        let table = table.to_owned();
        Box::pin(async move {
            let message = last_message_in(&records, &table, &key).await?;
            Ok(message.map(|message| message_change(&bridge_id, key, &message)))
        })
    };
    loop {
        let entry = tokio::select! {
            entry = watch.next() => entry,
            _ = apply_failed.tick() => {
                sink.apply_failed_again(&current).await;
                continue;
            }
        };
        let Some(entry) = entry else {
            return;
        };
        let Some(key) = record_key(table, &entry.key) else {
            continue;
        };
        let revision = entry.revision;
        sink.apply(change_of(&link.bridge_id, key, entry)).await;
        positions.applied(table, revision);
    }
}

/// The last message under `table`'s record `key` in `records`, from the stream's leader
/// rather than the direct get any replica answers (`FleetRecords::last_message`).
async fn last_message_in(
    records: &kv::Store,
    table: &str,
    key: &str,
) -> Result<Option<StreamMessage>, RecordError> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let subject = format!("{}{}", records.prefix, bucket_key(table, key));
    match records
        .stream
        .get_last_raw_message_by_subject(&subject)
        .await
    {
        Ok(message) => Ok(Some(message)),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(unavailable(e)),
    }
}

/// The change `message`, the record `key`'s last in the bucket, makes.
fn message_change(bridge_id: &str, key: String, message: &StreamMessage) -> RecordChange {
    let purge = kv_operation(message) == Some("PURGE");
    RecordChange {
        key,
        revision: message.sequence,
        taken_here: is_take_by(bridge_id, purge, &message.payload),
        value: (!is_removal(message)).then(|| message.payload.clone()),
    }
}

/// The change `entry`, the bucket's message of the record `key`, makes.
fn change_of(bridge_id: &str, key: String, entry: kv::Entry) -> RecordChange {
    let purge = entry.operation == Operation::Purge;
    RecordChange {
        key,
        revision: entry.revision,
        taken_here: is_take_by(bridge_id, purge, &entry.value),
        value: value_of(entry),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_go_into_the_bucket_and_back() {
        let key = bucket_key("tracker-tasks", "a task/with: anything");
        assert!(key.starts_with("tracker-tasks."));
        assert!(
            key.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        );
        assert_eq!(
            record_key("tracker-tasks", &key).as_deref(),
            Some("a task/with: anything")
        );
        assert_eq!(record_key("other", &key), None);
    }
}
