//! Applies the other bridges' messages, in the stream's order: each is kept in this
//! bridge's store (a materialised view of the fleet's log, so history and replays read
//! locally) and routed to the agents and hubs here once kept, as a bridge routes its own.
//! Batches are pipelined: while one is being written, the next is read and its writes
//! queued. A message is applied once: the consumer is durable (a restarted bridge resumes
//! where it acknowledged, first applying again what its last run was given and did not
//! acknowledge: `Applier::apply_unacknowledged`), and a redelivered or resent message
//! (`Replica::resent`) whose id is kept here already is passed over.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::FuturesOrdered;
use futures_util::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;

use super::link::{NatsLink, Ready};
use super::stretch::Stretch;
use super::wire::{BRIDGE_HEADER, Names, Replica};
use crate::core::{Core, Envelope, Kind, MessageLog, Outstanding, Status, now_ms};
use crate::telemetry;

/// Messages taken from the stream and applied together.
const BATCH: usize = 256;

/// Batches whose store writes may be under way at once before the next is read.
const WRITING: usize = 16;

/// The messages of a batch to apply (`Applier::replicas_of`).
#[derive(Default)]
struct Replicas {
    all: Vec<Replica>,
    /// The ids of those the store may hold already.
    maybe_kept: Vec<String>,
    /// Read again for want of routing (`Applier::apply_unacknowledged`): those the store
    /// holds are routed all the same, unless routed by this run.
    replayed: bool,
}

/// How long an acknowledgement waits for the batch's deliveries to be written: past this,
/// a recipient that slow (or a callback retried that long) may lose, if the bridge is
/// killed, what it had not yet been written. Well within the consumer's `ack_wait`, and
/// short enough that a slow reader does not hold back applying once `max_ack_pending`
/// messages of the stream wait.
const WRITTEN_WITHIN: Duration = Duration::from_secs(5);

/// A routed batch waiting for its acknowledgement.
struct Routed {
    /// The batch's last message: acknowledging it acknowledges the batch and every batch
    /// before (`AckPolicy::All`).
    last: async_nats::jetstream::Message,
    /// Cancelled once every delivery the batch made that took up its hold was written,
    /// kept or dropped.
    done: CancellationToken,
    at: tokio::time::Instant,
}

/// Acknowledges routed batches, one after another in stream order, each once what it
/// routed here for agents whose mail the fleet keeps (Grid programs, Synapse agents) was
/// written to their connections or kept (`Outstanding`): a bridge killed before has the
/// batch in the stretch the others read again (`missed_mail`) and keep for its agents,
/// rather than lose what waited in a mailbox. Meanwhile the applier routes on; a slow
/// client holds back acknowledgements, not routing.
struct Acks {
    queued: tokio::sync::mpsc::UnboundedSender<Routed>,
}

impl Acks {
    /// The task that acknowledges what is queued, until the queue is dropped or the bridge
    /// shuts down. Nothing is acknowledged once it does: what a shutdown dropped (a
    /// mailbox's contents, a callback) stays in the stretch the others read again.
    fn start(shutdown: CancellationToken) -> Acks {
        let (queued, mut to_ack) = tokio::sync::mpsc::unbounded_channel::<Routed>();
        tokio::spawn(async move {
            while let Some(Routed { last, done, at }) = to_ack.recv().await {
                let written = tokio::time::timeout_at(at + WRITTEN_WITHIN, done.cancelled());
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return,
                    in_time = written => if in_time.is_err() {
                        telemetry::federation_acknowledged_unwritten();
                    },
                }
                if shutdown.is_cancelled() {
                    return;
                }
                if let Err(e) = last.ack().await {
                    // Redelivered after `ack_wait`, and passed over as applied already.
                    tracing::debug!(error = %e, "federation: a batch was not acknowledged");
                }
            }
        });
        Acks { queued }
    }

    /// Acknowledges the batch `last` ends, once `done`.
    fn ack(&self, last: async_nats::jetstream::Message, done: CancellationToken) {
        let at = tokio::time::Instant::now();
        let _ = self.queued.send(Routed { last, done, at });
    }
}

pub struct Applier {
    pub link: Arc<NatsLink>,
    pub core: Arc<Core>,
    /// The bridge's own store (not the fleet log: nothing applied is published again).
    pub local: Arc<dyn MessageLog>,
    /// The stream sequence this bridge has routed everything up to.
    pub routed: tokio::sync::watch::Sender<u64>,
}

impl Applier {
    pub async fn run(self, ready: Arc<Ready>, shutdown: CancellationToken) {
        // Nothing is routed before every endpoint is listening: the mail of its absent
        // agents would have nowhere to go.
        tokio::select! {
            _ = shutdown.cancelled() => return,
            () = self.link.endpoints_listening() => {}
        }
        let mut delay = Duration::from_millis(100);
        // One for every reading of the stream: a new reading's batches are acknowledged
        // after those of the one before, never ahead of them.
        let acks = Acks::start(shutdown.clone());
        while !shutdown.is_cancelled() {
            match self.consume(&ready, &acks, &shutdown).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "federation: reading the stream failed; again shortly")
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    async fn consume(
        &self,
        ready: &Ready,
        acks: &Acks,
        shutdown: &CancellationToken,
    ) -> Result<(), async_nats::Error> {
        // What the consumer acknowledged was routed before (also before a restart).
        self.routed_up_to(ready.consumer.cached_info().ack_floor.stream_sequence);
        self.apply_unacknowledged(ready).await?;
        let mut messages = ready.consumer.messages().await?;
        // Batches whose store writes are under way, in stream order: the next batch is
        // read and its writes queued meanwhile, and each is routed once its writes and
        // those of every batch before it are done, then acknowledged once what it routed
        // was written (`Acks`).
        let mut writing = FuturesOrdered::new();
        let ended = loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break Ok(()),
                Some((written, last)) = writing.next(), if !writing.is_empty() => {
                    self.route_and_ack(written, last, acks);
                }
                next = messages.next(), if writing.len() < WRITING => {
                    let first = match next {
                        Some(Ok(message)) => message,
                        Some(Err(e)) => break Err(e.into()),
                        None => break Err("the stream's consumer ended".into()),
                    };
                    let mut batch = vec![first];
                    while batch.len() < BATCH
                        && let Some(Some(Ok(message))) = messages.next().now_or_never()
                    {
                        batch.push(message);
                    }
                    let replicas = self.replicas_of(&batch, false);
                    // Whether one of these was applied is known once the batches before
                    // are written and routed: its first copy may be in one.
                    if !replicas.maybe_kept.is_empty() {
                        self.route_and_ack_all(&mut writing, acks).await;
                    }
                    let written = self.apply(replicas).await;
                    let last = batch.pop().expect("a batch holds a message");
                    writing.push_back(async move { (written.await, last) });
                }
            }
        };
        // Whatever ends the loop, the batches already in the store are routed: redelivered,
        // a message the store holds is passed over, so one left unrouted now never would be.
        self.route_and_ack_all(&mut writing, acks).await;
        ended
    }

    /// Applies what the consumer was given and neither acknowledged nor routed here: what a
    /// run killed had taken in, or a reading that failed had fetched ahead. JetStream gives
    /// it again only after `ack_wait`, and acknowledging what follows first would
    /// acknowledge it too (`AckPolicy::All`), so it would never be applied. Read again in
    /// order, each message passed over where this bridge holds it already, and routed once
    /// kept, as the consumer's are: mail for the agents away (all of them, after a
    /// restart), history for replays; what the last run had written to a connection is
    /// sent again. Waited for until written, as a batch is before its acknowledgement.
    async fn apply_unacknowledged(&self, ready: &Ready) -> Result<(), async_nats::Error> {
        let stream = ready.js.get_stream(&self.link.names.stream).await?;
        let consumer = Names::consumer_of(&self.link.bridge_id);
        let info = stream.consumer_info(consumer).await?;
        let routed = *self.routed.borrow();
        // Not before the stream's first message (what its limits dropped is not there).
        let state = &stream.cached_info().state;
        let first = (info.ack_floor.stream_sequence.max(routed) + 1).max(state.first_sequence);
        let last = info.delivered.stream_sequence.min(state.last_sequence);
        if first > last {
            return Ok(());
        }
        let (outstanding, done) = Outstanding::new();
        let read = self.apply_between(&stream, first, last, &outstanding).await;
        // Waited for also when the reading failed: what was routed is not acknowledged
        // (by the next reading's first acknowledgement) before it is written.
        drop(outstanding);
        if tokio::time::timeout(WRITTEN_WITHIN, done.cancelled())
            .await
            .is_err()
        {
            telemetry::federation_acknowledged_unwritten();
        }
        read?;
        tracing::info!(
            first,
            last,
            "federation: applied what the stream's consumer was given and not acknowledged"
        );
        Ok(())
    }

    /// Reads the stream from `first` to `last` and applies it, offering `outstanding`.
    async fn apply_between(
        &self,
        stream: &async_nats::jetstream::stream::Stream,
        first: u64,
        last: u64,
        outstanding: &Outstanding,
    ) -> Result<(), async_nats::Error> {
        let mut stretch = Stretch::from(stream, first).await?;
        let mut read_to = first - 1;
        while read_to < last {
            let mut batch = Vec::new();
            while batch.len() < BATCH && read_to < last {
                let message;
                (read_to, message) = stretch.next().await?;
                // Past a gap (messages removed): the consumer gives the rest.
                if read_to > last {
                    break;
                }
                batch.push(message);
            }
            let written = self.apply(self.replicas_of(&batch, true)).await.await;
            self.route(written, outstanding);
            self.routed_up_to(read_to.min(last));
        }
        Ok(())
    }

    /// Routes a written batch, then has it acknowledged (`Acks`).
    fn route_and_ack(
        &self,
        written: Vec<(Replica, bool)>,
        last: async_nats::jetstream::Message,
        acks: &Acks,
    ) {
        let (outstanding, done) = Outstanding::new();
        self.route(written, &outstanding);
        self.routed_through(&last);
        drop(outstanding);
        acks.ack(last, done);
    }

    fn routed_up_to(&self, sequence: u64) {
        self.routed.send_if_modified(|routed| {
            let further = sequence > *routed;
            *routed = (*routed).max(sequence);
            further
        });
    }

    /// Everything up to `last` in the stream is routed here.
    fn routed_through(&self, last: &async_nats::jetstream::Message) {
        if let Ok(info) = last.info() {
            let sequence = info.stream_sequence;
            self.routed_up_to(sequence);
        }
    }

    /// Routes and acknowledges, in order, every batch being written.
    async fn route_and_ack_all<F>(&self, writing: &mut FuturesOrdered<F>, acks: &Acks)
    where
        F: Future<Output = (Vec<(Replica, bool)>, async_nats::jetstream::Message)>,
    {
        while let Some((written, last)) = writing.next().await {
            self.route_and_ack(written, last, acks);
        }
    }

    /// The other bridges' messages `batch` holds, in order, and the ids of those the store
    /// may hold already: delivered before (a redelivery after a restart, or after an
    /// acknowledgement was lost; every message `replayed` by `apply_unacknowledged`), or
    /// published again by their bridge after a publish whose outcome it does not know. A
    /// message repeated within the batch is kept once.
    fn replicas_of(&self, batch: &[async_nats::jetstream::Message], replayed: bool) -> Replicas {
        let own = self.link.bridge_id.as_str();
        let mut replicas = Replicas {
            replayed,
            ..Replicas::default()
        };
        for message in batch {
            let from_here = (message.headers.as_ref())
                .and_then(|h| h.get(BRIDGE_HEADER))
                .is_some_and(|b| b.as_str() == own);
            if from_here {
                continue;
            }
            let again = replayed || message.info().is_ok_and(|info| info.delivered > 1);
            match Replica::all_in(&message.payload) {
                Ok(all) => {
                    for replica in all {
                        // Read again: presence and status were news then, and the
                        // directory has moved on (the agents' cards say where they are).
                        if replayed && (replica.transient || replica.envelope.kind.is_presence()) {
                            continue;
                        }
                        // Passed through here already (a redelivery this bridge remembers).
                        if !replica.transient && self.core.recently_seen(&replica.envelope.id) {
                            continue;
                        }
                        if (again || replica.resent) && !replica.transient {
                            replicas.maybe_kept.push(replica.envelope.id.clone());
                        }
                        replicas.all.push(replica);
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, subject = %message.subject, "federation: a message on the stream is not one of ours")
                }
            }
        }
        if !replicas.maybe_kept.is_empty() {
            let mut seen = HashSet::new();
            (replicas.all).retain(|r| r.transient || seen.insert(r.envelope.id.clone()));
        }
        replicas
    }

    /// Queues the writes of `replicas` to this bridge's store, leaving out those it holds
    /// already (and, unless they were read again for want of routing, not routing them);
    /// the future that ends when the store holds them, with the messages to route then,
    /// each with whether it is kept.
    async fn apply(
        &self,
        replicas: Replicas,
    ) -> impl Future<Output = Vec<(Replica, bool)>> + Send + 'static {
        let Replicas {
            all: mut replicas,
            maybe_kept,
            replayed,
        } = replicas;
        // Routed here since `replicas_of` looked (in a batch written meanwhile), or in the
        // store.
        let (unknown, seen): (Vec<String>, Vec<String>) =
            (maybe_kept.into_iter()).partition(|id| !self.core.recently_seen(id));
        let seen: HashSet<String> = seen.into_iter().collect();
        let mut stored = HashSet::new();
        if !unknown.is_empty() {
            match self.local.read_ids(unknown).await {
                Ok(found) => stored.extend(found.into_iter().map(|m| m.envelope.id)),
                Err(e) => tracing::error!(error = %e, "federation: cannot read the store"),
            }
        }
        replicas.retain(|r| {
            let id = &r.envelope.id;
            r.transient || !(seen.contains(id) || (!replayed && stored.contains(id)))
        });
        let writes: Vec<_> = (replicas.iter())
            .filter(|r| !r.transient && !stored.contains(&r.envelope.id))
            .map(|r| self.local.append(&r.envelope))
            .collect();
        async move {
            // In the order they were queued: one result for each message to keep.
            let mut written = futures_util::future::join_all(writes).await.into_iter();
            (replicas.into_iter())
                .map(|replica| {
                    let kept = !replica.transient
                        && (stored.contains(&replica.envelope.id)
                            || match written.next() {
                            Some(Ok(())) => true,
                            Some(Err(e)) => {
                                tracing::error!(
                                    error = %e,
                                    message_id = %replica.envelope.id,
                                    correlation_id = replica.envelope.correlation_id.as_deref().unwrap_or(""),
                                    "federation: cannot keep a message from another bridge"
                                );
                                false
                            }
                            None => false,
                        });
                    (replica, kept)
                })
                .collect()
        }
    }

    /// Routes a written batch here, in order: the agents its presence changes carry are
    /// registered first, as they would be on the bridge that holds them.
    fn route(&self, written: Vec<(Replica, bool)>, outstanding: &Outstanding) {
        for (replica, kept) in written {
            let Replica {
                envelope,
                agent,
                history,
                transient,
                ..
            } = replica;
            if history {
                // Its own bridge delivered it while NATS was away; the others keep it.
                continue;
            }
            if let Some(info) = agent.and_then(|card| card.into_info()) {
                self.core.directory.register_replica(info);
            }
            self.presence(&envelope);
            telemetry::federation_applied((now_ms() - envelope.timestamp).max(0));
            // Presence and status are news only while new: nobody keeps them again.
            let news = transient || envelope.kind.is_presence();
            let offered = (!news).then_some(outstanding);
            self.core.accept_replica(envelope, kept, offered);
        }
    }

    /// A presence change of an agent another bridge holds, as the directory here shows it.
    fn presence(&self, env: &Envelope) {
        let status = || {
            (env.data.as_ref())
                .and_then(|d| d.get("status"))
                .and_then(|s| s.as_str())
                .and_then(Status::parse)
        };
        let directory = &self.core.directory;
        if !directory.held_elsewhere(&env.from) {
            return;
        }
        match env.kind {
            Kind::PresenceJoin | Kind::PresenceStatus => {
                directory.set_presence(&env.from, true, status().unwrap_or(Status::Online));
            }
            Kind::PresenceLeave => {
                directory.set_presence(&env.from, false, Status::Offline);
            }
            _ => {}
        }
    }
}
