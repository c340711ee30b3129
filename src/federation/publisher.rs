//! The fleet log's publisher: what the bridge appends, published to the stream in order,
//! many publishes in flight at once, each sender told once JetStream holds its message.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::link::{NatsLink, lost_race};
use super::own_deliveries::OwnDeliveries;
use super::routed::{Place, Routed};
use super::unshared::{Outgoing, Unshared};
use super::unsure::Unsure;
use super::wire::{BRIDGE_HEADER, RUN_HEADER};
use crate::core::LogError;
use crate::telemetry;

/// Why a message that must cross bridges was refused.
const UNREACHABLE: &str = "the fleet's message log (NATS) is unreachable: the message was not accepted; send it again later";

/// The refusal of a message that must cross bridges while NATS is unreachable, counted.
pub(super) fn refused_unreachable() -> LogError {
    telemetry::federation_refused("unreachable");
    LogError::Refused(UNREACHABLE.into())
}

/// Publishes queued messages in order, many in flight at once, and tells each sender
/// when JetStream holds its message.
pub struct Publisher {
    pub(super) link: Arc<NatsLink>,
    pub(super) queued: mpsc::UnboundedReceiver<Outgoing>,
    /// Where history a refused publish carried goes back to.
    pub(super) unshared: Arc<Unshared>,
    /// Where the messages of a publish that got no answer are remembered.
    pub(super) unsure: Arc<Unsure>,
    /// Where a publish's tokens wait for the consumer to read it back.
    pub(super) own: Arc<OwnDeliveries>,
    /// How long a message may take to be acknowledged, retries included.
    pub(super) timeout: Duration,
    /// How long one send waits for JetStream's answer (`ANSWER_WITHIN` when the stream is
    /// replicated; the whole `timeout` when it is not).
    pub(super) answer_within: Duration,
}

/// One message being published.
struct Message {
    js: async_nats::jetstream::Context,
    subject: String,
    bridge: String,
    run: String,
    id: String,
    payload: Bytes,
}

type Sent = Result<PublishAckFuture, PublishError>;

impl Message {
    /// Sends it once; `after`, for a message sent again: only onto the stream message of
    /// its subject at that sequence (0: none), so that it never lands behind a later one.
    async fn send(&self, after: Option<u64>, deadline: Instant) -> Sent {
        let mut publish = PublishMessage::build()
            .payload(self.payload.clone())
            .message_id(self.id.as_str())
            .header(BRIDGE_HEADER, self.bridge.as_str())
            .header(RUN_HEADER, self.run.as_str());
        if let Some(last) = after {
            publish = publish.expected_last_subject_sequence(last);
        }
        let send = self.js.send_publish(self.subject.clone(), publish);
        (tokio::time::timeout_at(deadline.into(), send).await)
            .unwrap_or_else(|_| Err(PublishError::new(PublishErrorKind::TimedOut)))
    }

    /// Waits, until `deadline` but at most `within`, for JetStream's answer to the send on
    /// the client's `connection`: none comes once the client has connected again since, as
    /// the connection lost may have taken the message or its answer with it.
    async fn answered(
        sent: Sent,
        link: &NatsLink,
        connection: u64,
        deadline: Instant,
        within: Duration,
    ) -> Answer {
        let ack = match sent {
            Ok(ack) => ack,
            // Larger than NATS takes: no try would pass.
            Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                return Answer::Unsendable(e.to_string());
            }
            Err(e) => return Answer::Failed(e.to_string()),
        };
        let answer = async {
            tokio::select! {
                // An answer that came is taken, even when the client has reconnected since.
                biased;
                answer = ack => match answer {
                    Ok(ack) => Answer::Acknowledged {
                        sequence: ack.sequence,
                        duplicate: ack.duplicate,
                    },
                    Err(e) if lost_race(&e) => Answer::Overtaken,
                    Err(e) => Answer::Failed(e.to_string()),
                },
                () = link.connected_after(connection) => Answer::Lost,
            }
        };
        let by = deadline.min(Instant::now() + within);
        (tokio::time::timeout_at(by.into(), answer).await)
            .unwrap_or_else(|_| Answer::Failed("no answer in time".into()))
    }
}

/// What became of one send of a publish.
enum Answer {
    /// At this stream sequence: the first publish's, for an id JetStream held already
    /// (`duplicate`).
    Acknowledged { sequence: u64, duplicate: bool },
    /// A later publish of this bridge is on the stream past where it was to go
    /// (`Message::send`'s `after`).
    Overtaken,
    /// The client connected again before the answer came: the connection lost may have
    /// taken the message or its answer with it.
    Lost,
    /// No answer in time, or an error (a stream leader being elected).
    Failed(String),
    /// Never sent: larger than NATS takes.
    Unsendable(String),
}

/// A publish in flight, with whom to tell what became of it.
struct Flight {
    message: Message,
    accepted: Vec<Option<oneshot::Sender<Result<(), LogError>>>>,
    history: Vec<Outgoing>,
    started: Instant,
    deadline: Instant,
    /// The client's connection it was sent on (`NatsLink::connection`).
    connection: u64,
    /// The publish acknowledged last when it was sent: JetStream holding it already at or
    /// before that, from an earlier publish of the same id (a client's retry), is no
    /// overtaking.
    acked_before: LastAcked,
}

type Flying = Pin<Box<dyn Future<Output = (Flight, Answer)> + Send>>;

/// Publishes in flight, in the order they were sent, and how many were sent on each of
/// the client's connections.
#[derive(Default)]
struct InFlight {
    flights: FuturesOrdered<Flying>,
    by_connection: BTreeMap<u64, usize>,
}

impl InFlight {
    /// Follows `flight`'s first send, whose answer is waited for `within` at most.
    fn send(&mut self, flight: Flight, sent: Sent, link: Arc<NatsLink>, within: Duration) {
        *self.by_connection.entry(flight.connection).or_default() += 1;
        self.flights.push_back(Box::pin(async move {
            let answer = Message::answered(sent, &link, flight.connection, flight.deadline, within);
            let answer = answer.await;
            (flight, answer)
        }));
    }

    async fn next(&mut self) -> Option<(Flight, Answer)> {
        let (flight, answer) = self.flights.next().await?;
        if let std::collections::btree_map::Entry::Occupied(mut sent) =
            self.by_connection.entry(flight.connection)
        {
            *sent.get_mut() -= 1;
            if *sent.get() == 0 {
                sent.remove();
            }
        }
        Some((flight, answer))
    }

    fn is_empty(&self) -> bool {
        self.flights.is_empty()
    }

    fn len(&self) -> usize {
        self.flights.len()
    }

    /// Whether a publish sent on a connection before `connection` is still in flight.
    fn sent_before(&self, connection: u64) -> bool {
        self.by_connection.range(..connection).next().is_some()
    }
}

/// Most publishes in flight at once: well under the JetStream context's answers awaited
/// at once (5,000), past which a send would wait for a flight the loop does not settle
/// meanwhile.
const MOST_IN_FLIGHT: usize = 1_024;

/// How long a publish that failed waits before it is sent again.
const RETRY_AFTER: Duration = Duration::from_millis(100);

/// How long one send of a publish to a replicated stream waits for JetStream's answer
/// before it is sent again (under its id, onto the last publish acknowledged). A stream
/// leader that failed with the publish in flight never answers, though the client stays
/// connected (to another server): waiting for that answer until the publish timeout left
/// no time to send it again, and its senders were refused. Far longer than JetStream
/// takes to answer under load. A clustered stream answers a copy it holds by its id before
/// it checks the expected sequence (one still being replicated: "in process", asked
/// again); a stream of one replica, which has no leader to lose, checks the sequence first
/// (nats-server 2.12 and newer), and would refuse the copy: its sends wait the whole
/// timeout.
pub(super) const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// Most messages, and bytes, one publish carries (NATS's default largest message is 1 MiB).
const BATCH: usize = 256;
const BATCH_BYTES: usize = 256 * 1024;

/// Messages published in one NATS message, with whom to tell once JetStream holds them.
struct Batch {
    id: String,
    payload: Bytes,
    accepted: Vec<Option<oneshot::Sender<Result<(), LogError>>>>,
    /// What says when its messages' deliveries here are done (`Outgoing::written`).
    written: Vec<crate::core::HeldBy>,
    /// The history it carries (no one waits for it): put back to wait for NATS again if
    /// the publish is refused.
    history: Vec<Outgoing>,
}

impl Batch {
    /// `first` and what else is queued behind it, up to `BATCH` messages and `BATCH_BYTES`
    /// (a message alone may be larger); one that would not fit is left in `held`, to start
    /// the next batch.
    fn gather(
        first: Outgoing,
        queued: &mut mpsc::UnboundedReceiver<Outgoing>,
        held: &mut Option<Outgoing>,
    ) -> Batch {
        let mut bytes = first.payload.len();
        let mut batch = vec![first];
        while batch.len() < BATCH {
            let Ok(next) = queued.try_recv() else { break };
            if bytes + 1 + next.payload.len() > BATCH_BYTES {
                *held = Some(next);
                break;
            }
            bytes += next.payload.len() + 1;
            batch.push(next);
        }
        let history = (batch.iter())
            .filter(|o| o.accepted.is_none())
            .map(|o| Outgoing::history(o.id.clone(), o.payload.clone()))
            .collect();
        let written = (batch.iter_mut())
            .filter_map(|o| o.written.take())
            .collect();
        if batch.len() == 1 {
            let Outgoing {
                id,
                payload,
                accepted,
                ..
            } = batch.pop().expect("one message");
            return Batch {
                id,
                payload,
                accepted: vec![accepted],
                written,
                history,
            };
        }
        // Its own id, which no message's can be: sent again, the batch is the same.
        let id = format!("batch:{}", uuid::Uuid::new_v4());
        let mut payload = Vec::with_capacity(bytes + 2);
        payload.push(b'[');
        for (i, outgoing) in batch.iter().enumerate() {
            if i > 0 {
                payload.push(b',');
            }
            payload.extend_from_slice(&outgoing.payload);
        }
        payload.push(b']');
        Batch {
            id,
            payload: payload.into(),
            accepted: batch.into_iter().map(|o| o.accepted).collect(),
            written,
            history,
        }
    }
}

impl Publisher {
    /// History a refused publish carried waits for NATS again, ahead of what came since.
    fn put_back(&self, history: Vec<Outgoing>) {
        if !history.is_empty() {
            self.unshared.put_back(history);
        }
    }

    /// Runs until the bridge shuts down, then publishes what was queued before it did.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let subject = self.link.names.messages_of(&self.link.bridge_id);
        let mut in_flight = InFlight::default();
        let mut shutting_down = std::pin::pin!(shutdown.cancelled());
        let (mut open, mut closing) = (true, false);
        // A message that did not fit in the last batch: it starts the next.
        let mut held: Option<Outgoing> = None;
        let mut last_acked = LastAcked::default();
        while open || held.is_some() || !in_flight.is_empty() {
            tokio::select! {
                _ = &mut shutting_down, if !closing => {
                    closing = true;
                    // What was appended before the bridge stopped is still published; what
                    // comes later is told the bridge is shutting down.
                    self.queued.close();
                }
                next = next_outgoing(&mut held, &mut self.queued),
                    if (open || held.is_some()) && in_flight.len() < MOST_IN_FLIGHT =>
                {
                    let Some(first) = next else {
                        open = false;
                        continue;
                    };
                    let batch = Batch::gather(first, &mut self.queued, &mut held);
                    let (accepted, history) = (batch.accepted, batch.history);
                    let Some(ready) = self.link.set_up() else {
                        self.put_back(history);
                        tell(accepted, Err(refused_unreachable()));
                        continue;
                    };
                    let started = Instant::now();
                    let message = Message {
                        js: ready.js.clone(),
                        subject: subject.clone(),
                        bridge: self.link.bridge_id.clone(),
                        run: self.link.run_id.clone(),
                        id: batch.id,
                        payload: batch.payload,
                    };
                    let deadline = started + self.timeout;
                    // Nothing is sent while disconnected: a publish the client buffered could
                    // reach the others after its sender was told it was refused.
                    let settled = self.connected_and_settled(&mut in_flight, &mut last_acked, deadline);
                    if !settled.await || Instant::now() >= deadline {
                        self.put_back(history);
                        tell(accepted, Err(refused_unreachable()));
                        continue;
                    }
                    telemetry::federation_outbox(accepted.len() as i64);
                    // Before it can be read back.
                    self.own.sending(&message.id, batch.written);
                    let connection = self.link.connection();
                    let sent = message.send(None, deadline).await;
                    let acked_before = last_acked;
                    let flight = Flight { message, accepted, history, started, deadline, connection, acked_before };
                    in_flight.send(flight, sent, self.link.clone(), self.answer_within);
                }
                Some((flight, answer)) = in_flight.next(), if !in_flight.is_empty() => {
                    self.landed(flight, answer, &mut last_acked).await;
                }
            }
        }
    }

    /// Waits until the client is connected, and settles first, in the order sent, what
    /// was sent on an earlier connection: sent again, it is then not overtaken by what is
    /// sent next. Whether the client is connected by `deadline`.
    async fn connected_and_settled(
        &self,
        in_flight: &mut InFlight,
        last_acked: &mut LastAcked,
        deadline: Instant,
    ) -> bool {
        loop {
            if !self.link.reconnected(deadline).await {
                return false;
            }
            let connection = self.link.connection();
            while in_flight.sent_before(connection)
                && let Some((flight, answer)) = in_flight.next().await
            {
                self.landed(flight, answer, last_acked).await;
            }
            if self.link.connection() == connection {
                return true;
            }
        }
    }

    /// Tells the senders of `flight` what became of it, once sent again if its send got
    /// no answer (`send_again`). Flights land here in the order sent, so each one
    /// acknowledged is past the last (`last_acked`): one JetStream holds behind it (lost
    /// with its connection and then carried late, or overtaken while it was sent again)
    /// is out of its senders' order, and refused to them — unless JetStream held its id
    /// from before it was sent (a client's retry, history shared again).
    async fn landed(&self, flight: Flight, answer: Answer, last_acked: &mut LastAcked) {
        // Refused before it was sent (too large for NATS): JetStream cannot hold it.
        let never_sent = matches!(answer, Answer::Unsendable(_));
        let last = last_acked.sequence(&self.link.routed);
        let acked_before = flight.acked_before.sequence_now(&self.link.routed);
        let result = match answer {
            // Its first send, and JetStream held the id already: from before it was sent.
            Answer::Acknowledged {
                duplicate: true, ..
            } => Ok(None),
            Answer::Acknowledged { sequence, .. } => Ok(Some(sequence)),
            Answer::Overtaken => Err(OVERTAKEN.to_owned()),
            Answer::Unsendable(e) => Err(e),
            Answer::Lost => self.send_again(&flight, None, last).await,
            Answer::Failed(e) => self.send_again(&flight, Some(e), last).await,
        };
        let result = match result {
            Ok(None) => Ok(()),
            Ok(Some(sequence)) if last.is_none_or(|last| sequence > last) => {
                last_acked.set(sequence, &self.link.routed);
                Ok(())
            }
            Ok(Some(sequence)) if acked_before.is_some_and(|b| sequence <= b) => Ok(()),
            Ok(Some(_)) => Err(OVERTAKEN.to_owned()),
            Err(e) => Err(e),
        };
        let Flight {
            message,
            accepted,
            history,
            started,
            ..
        } = flight;
        telemetry::federation_outbox(-(accepted.len() as i64));
        telemetry::federation_published(started.elapsed(), accepted.len(), result.is_ok());
        if result.is_err() {
            // Sent, then no answer: JetStream may hold it all the same.
            if !never_sent {
                self.unsure.add(&message.payload);
            }
            self.own.not_published(&message.id);
            self.put_back(history);
        } else if !history.is_empty() {
            self.unshared.shared(history.len());
        }
        let result = result.map_err(|e| {
            LogError::Refused(format!(
                "the fleet's message log (NATS) did not take the message ({e}); send it again later"
            ))
        });
        tell(accepted, result);
    }

    /// Sends `flight` again, under its id, until its deadline, but only onto the publish
    /// acknowledged last (`Nats-Expected-Last-Subject-Sequence` at `last_acked`; before
    /// any in this run, or in a stream made again, onto none, so that only a copy
    /// JetStream holds already is answered): publishes are pipelined, and a later one may
    /// be on the stream already (the client sent what it still held on its new
    /// connection), behind which it would land out of order. A copy JetStream holds is
    /// answered with its sequence, which `landed` checks. `failed`: why the last send
    /// failed; none when its connection was lost, which is sent again at once.
    async fn send_again(
        &self,
        flight: &Flight,
        failed: Option<String>,
        last_acked: Option<u64>,
    ) -> Result<Option<u64>, String> {
        let lost = || "the connection to NATS was lost before the answer came".to_owned();
        let mut failed = failed;
        loop {
            if let Some(e) = &failed {
                tracing::debug!(error = %e, message_id = %flight.message.id, "federation: publish again");
                if Instant::now() + RETRY_AFTER >= flight.deadline {
                    return Err(e.clone());
                }
                tokio::time::sleep(RETRY_AFTER).await;
            }
            if !self.link.reconnected(flight.deadline).await {
                return Err(failed.unwrap_or_else(lost));
            }
            let connection = self.link.connection();
            // A sequence the stream never reaches, within what a server reads as a number.
            let after = last_acked.unwrap_or(i64::MAX as u64);
            let sent = flight.message.send(Some(after), flight.deadline).await;
            let within = self.answer_within;
            match Message::answered(sent, &self.link, connection, flight.deadline, within).await {
                Answer::Acknowledged { sequence, .. } => return Ok(Some(sequence)),
                Answer::Overtaken => return Err(OVERTAKEN.to_owned()),
                Answer::Unsendable(e) => return Err(e),
                Answer::Lost => failed = None,
                Answer::Failed(e) => failed = Some(e),
            }
        }
    }
}

/// The place in the stream of the last publish acknowledged: each acknowledged after is
/// past it, in the order sent (`Publisher::landed`). A stream made again begins its
/// sequences anew, and where the old one was acknowledged says nothing of the order in the
/// new: it is forgotten once the applier reads another stream (`NatsLink::routed`).
#[derive(Clone, Copy, Default)]
struct LastAcked(Option<Place>);

impl LastAcked {
    /// The sequence acknowledged last, in the stream the applier reads now, as `sequence`
    /// says, for a copy taken before.
    fn sequence_now(mut self, routed: &Routed) -> Option<u64> {
        self.sequence(routed)
    }

    /// The sequence acknowledged last, in the stream the applier reads now.
    fn sequence(&mut self, routed: &Routed) -> Option<u64> {
        let now = routed.now().stream;
        match self.0 {
            Some(Place {
                stream: Some(then), ..
            }) if now.is_some_and(|now| now != then) => self.0 = None,
            // Acknowledged before the applier read any stream: in the one it reads first.
            Some(ref mut last) if last.stream.is_none() => last.stream = now,
            _ => {}
        }
        self.0.map(|last| last.sequence)
    }

    fn set(&mut self, sequence: u64, routed: &Routed) {
        let stream = routed.now().stream;
        self.0 = Some(Place { stream, sequence });
    }
}

/// Why a publish that landed out of its senders' order, or would have, was refused.
const OVERTAKEN: &str = "a later message of this bridge reached the stream first";

/// The message `held` back from the last batch, else the next one queued; `None` once the
/// queue is closed and empty.
async fn next_outgoing(
    held: &mut Option<Outgoing>,
    queued: &mut mpsc::UnboundedReceiver<Outgoing>,
) -> Option<Outgoing> {
    match held.take() {
        Some(held) => Some(held),
        None => queued.recv().await,
    }
}

/// Tells each sender of a batch what became of it.
fn tell(
    accepted: Vec<Option<oneshot::Sender<Result<(), LogError>>>>,
    result: Result<(), LogError>,
) {
    // What the publisher tells is a refusal (or nothing), which each sender is told again.
    let reason = result.err().map(|e| match e {
        LogError::Refused(reason) => reason,
        other => other.to_string(),
    });
    for accepted in accepted.into_iter().flatten() {
        let _ = accepted.send(match &reason {
            None => Ok(()),
            Some(reason) => Err(LogError::Refused(reason.clone())),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn made(seconds: i64) -> time::OffsetDateTime {
        time::OffsetDateTime::from_unix_timestamp(1_800_000_000 + seconds).unwrap()
    }

    /// A stream made again begins its sequences anew: the publish acknowledged last in the
    /// one before is forgotten once the applier reads the new one, so that a publish sent
    /// again is not sent onto a sequence the new stream may never reach.
    #[test]
    fn the_last_publish_acknowledged_is_forgotten_once_another_stream_is_read() {
        let routed = Routed::default();
        let mut last = LastAcked::default();
        last.set(40, &routed);
        routed.reading(made(0), false);
        assert_eq!(
            last.sequence(&routed),
            Some(40),
            "acknowledged before the applier read: in the stream it reads first"
        );
        last.set(50, &routed);
        routed.reading(made(0), false);
        assert_eq!(last.sequence(&routed), Some(50), "the same stream");
        routed.reading(made(5), false);
        assert_eq!(last.sequence(&routed), None, "a stream made again");
        last.set(3, &routed);
        assert_eq!(last.sequence(&routed), Some(3));
    }
}
