//! Applies the other bridges' messages, in the stream's order: each is kept in this
//! bridge's store (a materialised view of the fleet's log, so history and replays read
//! locally) and routed to the agents and hubs here once kept, as a bridge routes its own.
//! Batches are pipelined: while one is being written, the next is read and its writes
//! queued. A message is applied once: the consumer is durable (a restarted bridge resumes
//! where it acknowledged, first applying again what its last run was given and did not
//! acknowledge: `Applier::apply_unacknowledged`), and a redelivered or resent message
//! (`Replica::resent`) whose id is kept here already is passed over. Of this bridge's own
//! messages, those this run accepted (and routed then) are passed over, their publishes
//! acknowledged once what they were routed to here was written (`own_deliveries`); those
//! an earlier run accepted are routed again, as it may have been killed before it wrote
//! them.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::{ConsumerInfoError, ConsumerInfoErrorKind};
use futures_util::stream::FuturesOrdered;
use futures_util::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;

use super::acks::{Acks, Last};
use super::link::{NatsLink, Ready, durable_consumer};
use super::own_deliveries::OwnDeliveries;
use super::wire::{BRIDGE_HEADER, Names, RUN_HEADER, Replica};
use super::written::Written;
use crate::core::{
    Core, Envelope, HeldBy, Kind, LeftUndelivered, MessageLog, Outstanding, Recipients, Replicated,
    Status, now_ms,
};
use crate::telemetry;

mod read_again;

use read_again::read_again_after;

/// Messages taken from the stream and applied together.
const BATCH: usize = 256;

/// Batches whose store writes may be under way at once before the next is read.
const WRITING: usize = 16;

/// The messages of a batch to apply (`Applier::replicas_of`).
#[derive(Default)]
struct Replicas {
    all: Vec<ToApply>,
    /// What this run's own messages in the batch wait for (`own_deliveries`).
    own: Vec<HeldBy>,
}

impl Replicas {
    fn any_maybe_kept(&self) -> bool {
        self.all.iter().any(|m| m.maybe_kept)
    }
}

/// A message of a batch to apply.
struct ToApply {
    replica: Replica,
    /// Whether the store may hold it already.
    maybe_kept: bool,
    routing: Routing,
}

/// How a message of the stream was routed here before, which says whether it is routed
/// now where the store holds it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Routing {
    /// As it was kept: one the store holds was routed then, and is passed over.
    WhenKept,
    /// Delivered to an earlier run, and perhaps not written: read again by
    /// `Applier::apply_unacknowledged`. Routed where the store holds it, unless this run
    /// routed it; one the earlier run kept pending for some agents, only to the recipients
    /// that hold for those (`LeftUndelivered::holders_named`; the hubs that hold nothing
    /// catch up from the store).
    Again,
    /// Accepted by an earlier run of this bridge, which routed it as it accepted it and
    /// may have been killed before it wrote it: routed again where the store holds it (the
    /// earlier run stored, and so routed, it), only to the recipients that hold
    /// (`Recipients::Holders`), and of those, where the earlier run kept it pending
    /// for some agents, to theirs; where it does not, to all.
    EarlierRun,
    /// Accepted by this run and never routed here (its append did not complete:
    /// `OwnDeliveries::take_unrouted`): routed, although this run passed it
    /// (`Core::recently_seen`) and the store may hold it.
    Never,
}

/// A message of the stream, applied to the store.
struct Applied {
    replica: Replica,
    /// Whether the store holds it.
    kept: bool,
    /// Which of its recipients it is routed to here.
    recipients: Recipients,
}

/// Why a reading of the stream's consumer ended without an error.
enum ReadingEnded {
    Shutdown,
    /// Delivery `expected` (and perhaps more) went elsewhere, and this reading was given
    /// `given`: the consumer served a pull request left from a reading before, or the NATS
    /// server passing deliveries on failed. Acknowledging what follows would acknowledge
    /// them unapplied (`AckPolicy::All`), so the reading ends before `given`, and the next
    /// one reads the stream from where this bridge routed up to (`apply_unacknowledged`).
    Gap {
        expected: u64,
        given: u64,
    },
}

/// The consumer sequence of the last delivery a reading was given: the consumer numbers
/// every delivery, redeliveries too, so a reading given them all sees them one by one.
struct Delivered(u64);

impl Delivered {
    /// Takes `message` as the next delivery, or says where the reading ends.
    fn follow(
        &mut self,
        message: &async_nats::jetstream::Message,
    ) -> Result<Option<ReadingEnded>, async_nats::Error> {
        let expected = self.0 + 1;
        let given = message.info()?.consumer_sequence;
        if given != expected {
            return Ok(Some(ReadingEnded::Gap { expected, given }));
        }
        self.0 = given;
        Ok(None)
    }
}

pub struct Applier {
    pub link: Arc<NatsLink>,
    pub core: Arc<Core>,
    /// The bridge's own store (not the fleet log: nothing applied is published again).
    pub local: Arc<dyn MessageLog>,
    /// What the last run had not done with: what it had is not routed again.
    pub left_undelivered: Arc<LeftUndelivered>,
    /// What this run's own publishes wait for before their acknowledgement.
    pub own: Arc<OwnDeliveries>,
    /// The last stream sequence the consumer had delivered as this run started: what an
    /// earlier run may have routed (`Routing::Again`), set by the first reading (none
    /// before it), and nothing of a stream made again.
    pub delivered_before: parking_lot::Mutex<Option<u64>>,
    /// Where an earlier consumer's deliveries end (as far as this run routed, or the earlier
    /// run's consumer had delivered), once the consumer was made again, which gives them
    /// anew: to be read as `delivered_before`'s are (`Routing::Again`).
    pub redelivered_through: AtomicU64,
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
        let acks = Acks::start(ready.unwritten.clone(), shutdown.clone());
        // Where routing stood at the last gap: a gap with nothing routed since (another
        // reader takes from the consumer each time) waits as an error does.
        let mut routed_at_gap = None;
        while !shutdown.is_cancelled() {
            match self.consume(&ready, &acks, &shutdown).await {
                Ok(ReadingEnded::Shutdown) => return,
                Ok(ReadingEnded::Gap { expected, given }) => {
                    telemetry::federation_delivery_gap();
                    tracing::info!(
                        expected,
                        given,
                        "federation: deliveries of the stream's consumer went elsewhere; reading them from the stream"
                    );
                    let routed = Some(self.link.routed.now());
                    if routed != std::mem::replace(&mut routed_at_gap, routed) {
                        delay = Duration::from_millis(100);
                        continue;
                    }
                }
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
    ) -> Result<ReadingEnded, async_nats::Error> {
        let consumer = self.consumer(ready, acks).await?;
        // What the consumer acknowledged was routed before (also before a restart), up to
        // where the last run's heartbeat says its deliveries were not all written.
        let ack_floor = consumer.cached_info().ack_floor.stream_sequence;
        acks.acknowledged_at_least(ack_floor);
        self.link.routed.up_to(read_again_after(
            ack_floor,
            ready.unwritten.left_by_last_run(),
        ));
        // While the bridge's doors wait for it (`doors`): a stop does not wait for it.
        let mut delivered = tokio::select! {
            _ = shutdown.cancelled() => return Ok(ReadingEnded::Shutdown),
            applied = self.apply_unacknowledged(ready, acks) => applied?,
        };
        let mut messages = consumer.messages().await?;
        // Batches whose store writes are under way, in stream order: the next batch is
        // read and its writes queued meanwhile, and each is routed once its writes and
        // those of every batch before it are done, then acknowledged once what it routed
        // was written (`Acks`).
        let mut writing = FuturesOrdered::new();
        let ended = loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break Ok(ReadingEnded::Shutdown),
                Some((written, first, last, own)) = writing.next(), if !writing.is_empty() => {
                    self.route_and_ack(written, first, last, own, acks);
                }
                next = messages.next(), if writing.len() < WRITING => {
                    let first = match next {
                        Some(Ok(message)) => message,
                        Some(Err(e)) => break Err(e.into()),
                        None => break Err("the stream's consumer ended".into()),
                    };
                    match delivered.follow(&first) {
                        Ok(None) => {}
                        Ok(Some(gap)) => break Ok(gap),
                        Err(e) => break Err(e),
                    }
                    let mut batch = vec![first];
                    let mut ended = None;
                    while batch.len() < BATCH
                        && let Some(Some(Ok(message))) = messages.next().now_or_never()
                    {
                        match delivered.follow(&message) {
                            Ok(None) => batch.push(message),
                            Ok(Some(gap)) => ended = Some(Ok(gap)),
                            Err(e) => ended = Some(Err(e)),
                        }
                        if ended.is_some() {
                            break;
                        }
                    }
                    let replayed_through = self.redelivered_through.load(Ordering::Relaxed);
                    let mut replicas = self.replicas_of(&batch, replayed_through);
                    // Whether one of these was applied is known once the batches before
                    // are written and routed: its first copy may be in one.
                    if replicas.any_maybe_kept() {
                        self.route_and_ack_all(&mut writing, acks).await;
                    }
                    let own = std::mem::take(&mut replicas.own);
                    let written = self.apply(replicas).await;
                    let first = stream_sequence(&batch[0]);
                    let last = batch.pop().expect("a batch holds a message");
                    writing.push_back(async move { (written.await, first, last, own) });
                    if let Some(ended) = ended {
                        break ended;
                    }
                }
            }
        };
        // Whatever ends the loop, the batches already in the store are routed: redelivered,
        // a message the store holds is passed over, so one left unrouted now never would be.
        self.route_and_ack_all(&mut writing, acks).await;
        ended
    }

    /// This bridge's consumer of the stream. One gone (deleted by hand, or lost by the
    /// cluster) is made again from the message after the last acknowledged (`acks`): what
    /// came meanwhile is not passed by, what waits to be written is read again (routed
    /// here already, it is passed over), and what an earlier run's consumer had delivered
    /// is taken for delivered again (`redelivered_through`). Before the first reading, it is
    /// made from now, as the set-up made it a moment before; from the stream's first message
    /// if the stream was made again (another creation time, or not yet as far on): its
    /// sequences begun anew. The stream is taken for read (`Routed::reading`) only once
    /// its consumer is had: a failure before is looked at again as the first time.
    async fn consumer(
        &self,
        ready: &Ready,
        acks: &Acks,
    ) -> Result<PullConsumer, async_nats::Error> {
        let stream = ready.js.get_stream(&self.link.names.stream).await?;
        let made = stream.cached_info().created;
        let name = Names::consumer_of(&self.link.bridge_id);
        let gone = match stream.get_consumer(&name).await {
            // Deleting a stream deletes its consumers: this is the stream read before, even
            // if its creation time now reads otherwise (NATS has been known to change it).
            Ok(consumer) => {
                self.link.routed.reading(made, false);
                return Ok(consumer);
            }
            Err(e) => e,
        };
        let not_found = (gone.downcast_ref::<ConsumerInfoError>())
            .is_some_and(|e| e.kind() == ConsumerInfoErrorKind::NotFound);
        if !not_found {
            return Err(gone);
        }
        let (last, acknowledged) = (
            stream.cached_info().state.last_sequence,
            acks.acknowledged(),
        );
        // Made again: by another creation time (it may be past where the old one was
        // acknowledged by now), or not yet as far on.
        let made_again =
            (self.link.routed.now().stream).is_some_and(|read| read != made) || acknowledged > last;
        let delivered_before = *self.delivered_before.lock();
        let (start, acknowledged) = match delivered_before {
            _ if made_again => {
                self.sequences_begun_anew(ready);
                (DeliverPolicy::All, 0)
            }
            None => (DeliverPolicy::New, last),
            Some(delivered_before) => {
                // What the old consumer delivered: up to where this run routed, or further
                // for what an earlier run's consumer delivered.
                let delivered = delivered_before.max(self.link.routed.now().sequence);
                (self.redelivered_through).fetch_max(delivered, Ordering::Relaxed);
                let start_sequence = acknowledged + 1;
                (
                    DeliverPolicy::ByStartSequence { start_sequence },
                    acknowledged,
                )
            }
        };
        acks.consumer_made_again(acknowledged).await;
        let (consumer, _) = durable_consumer(&stream, &self.link.bridge_id, start).await?;
        self.link.routed.reading(made, made_again);
        tracing::warn!(
            ?start,
            "federation: this bridge's consumer of the stream was gone; made again"
        );
        Ok(consumer)
    }

    /// The stream was made again: what was numbered in the one gone says nothing of it.
    fn sequences_begun_anew(&self, ready: &Ready) {
        self.redelivered_through.store(0, Ordering::Relaxed);
        *self.delivered_before.lock() = Some(0);
        ready.unwritten.sequences_begun_anew();
    }

    /// Routes a written batch, then has it acknowledged (`Acks`) once its deliveries, and
    /// those of this run's own messages it carries (`own`), are done.
    fn route_and_ack(
        &self,
        written: Vec<Applied>,
        first: u64,
        last: async_nats::jetstream::Message,
        own: Vec<HeldBy>,
        acks: &Acks,
    ) {
        let (outstanding, routed) = Outstanding::naming();
        self.route(written, &outstanding);
        self.routed_through(&last);
        drop(outstanding);
        let sequences = first..=stream_sequence(&last);
        acks.ack(
            sequences,
            Last::Message(Box::new(last)),
            Written { routed, own },
        );
    }

    /// Everything up to `last` in the stream is routed here.
    fn routed_through(&self, last: &async_nats::jetstream::Message) {
        self.link.routed.up_to(stream_sequence(last));
    }

    /// Routes and acknowledges, in order, every batch being written.
    async fn route_and_ack_all<F>(&self, writing: &mut FuturesOrdered<F>, acks: &Acks)
    where
        F: Future<
            Output = (
                Vec<Applied>,
                u64,
                async_nats::jetstream::Message,
                Vec<HeldBy>,
            ),
        >,
    {
        while let Some((written, first, last, own)) = writing.next().await {
            self.route_and_ack(written, first, last, own, acks);
        }
    }

    /// The messages `batch` holds that this run did not accept, in order, and the ids of
    /// those the store may hold already: delivered before (a redelivery after a restart, or
    /// after an acknowledgement was lost; every message up to `replayed_through`, which
    /// `apply_unacknowledged` reads again for an earlier run), accepted by an earlier run
    /// of this bridge, or published
    /// again by their bridge after a publish whose outcome it does not know. A message
    /// repeated within the batch is kept once. For the messages this run accepted, what
    /// their deliveries here are waited for by.
    fn replicas_of(
        &self,
        batch: &[async_nats::jetstream::Message],
        replayed_through: u64,
    ) -> Replicas {
        let mut replicas = Replicas::default();
        for message in batch {
            let replayed = replayed_through > 0
                && (message.info()).is_ok_and(|info| info.stream_sequence <= replayed_through);
            let header = |name: &str| {
                (message.headers.as_ref())
                    .and_then(|h| h.get(name))
                    .map(|value| value.as_str())
            };
            let from_here = header(BRIDGE_HEADER) == Some(self.link.bridge_id.as_str());
            let this_run = from_here && header(RUN_HEADER) == Some(self.link.run_id.as_str());
            if this_run {
                if let Some(id) = header(async_nats::header::NATS_MESSAGE_ID.as_ref()) {
                    replicas.own.extend(self.own.read_back(id));
                }
                // Routed as it was accepted, unless its append did not complete.
                if !self.own.any_unrouted() {
                    continue;
                }
            }
            let routing = match (from_here, this_run, replayed) {
                (_, true, _) => Routing::Never,
                (true, false, _) => Routing::EarlierRun,
                (false, _, true) => Routing::Again,
                (false, _, false) => Routing::WhenKept,
            };
            let again =
                routing != Routing::WhenKept || message.info().is_ok_and(|info| info.delivered > 1);
            match Replica::all_in(&message.payload) {
                Ok(all) => {
                    for replica in all {
                        let id = &replica.envelope.id;
                        // Read again: presence and status were news then, and the
                        // directory has moved on (the agents' cards say where they are).
                        let news = replica.transient || replica.envelope.kind.is_presence();
                        if routing != Routing::WhenKept && news {
                            continue;
                        }
                        if routing == Routing::Never {
                            if !self.own.take_unrouted(id) {
                                continue;
                            }
                        // Passed through here already (a redelivery this bridge remembers).
                        } else if !replica.transient && self.core.recently_seen(id) {
                            continue;
                        }
                        let maybe_kept = (again || replica.resent) && !replica.transient;
                        replicas.all.push(ToApply {
                            replica,
                            maybe_kept,
                            routing,
                        });
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, subject = %message.subject, "federation: a message on the stream is not one of ours")
                }
            }
        }
        if replicas.any_maybe_kept() {
            let mut seen = HashSet::new();
            (replicas.all).retain(|ToApply { replica: r, .. }| {
                r.transient || seen.insert(r.envelope.id.clone())
            });
        }
        replicas
    }

    /// Queues the writes of `replicas` to this bridge's store, leaving out those it holds
    /// already (and, unless they are to be routed all the same, not routing them); the
    /// future that ends when the store holds them, with the messages to route then.
    async fn apply(
        &self,
        replicas: Replicas,
    ) -> impl Future<Output = Vec<Applied>> + Send + 'static {
        let mut replicas = replicas.all;
        // Routed here since `replicas_of` looked (in a batch written meanwhile), or in the
        // store.
        let (mut unknown, mut seen) = (Vec::new(), HashSet::new());
        for m in replicas.iter().filter(|m| m.maybe_kept) {
            let id = m.replica.envelope.id.clone();
            if m.routing == Routing::Never || !self.core.recently_seen(&id) {
                unknown.push(id);
            } else {
                seen.insert(id);
            }
        }
        // Held, and done with by the last run of this bridge (`LeftUndelivered`): one read
        // again is not routed again.
        let (mut stored, mut done) = (HashSet::new(), HashSet::new());
        if !unknown.is_empty() {
            match self.local.read_ids(unknown).await {
                Ok(found) => {
                    for message in found {
                        if self.left_undelivered.done_with(&message) {
                            done.insert(message.envelope.id.clone());
                        }
                        stored.insert(message.envelope.id);
                    }
                }
                Err(e) => tracing::error!(error = %e, "federation: cannot read the store"),
            }
        }
        replicas.retain(|m| {
            let id = &m.replica.envelope.id;
            let routed = match m.routing {
                Routing::WhenKept => stored.contains(id),
                Routing::Again | Routing::EarlierRun => done.contains(id),
                Routing::Never => false,
            };
            m.replica.transient || !(seen.contains(id) || routed)
        });
        let writes: Vec<_> = (replicas.iter().map(|m| &m.replica))
            .filter(|r| !r.transient && !stored.contains(&r.envelope.id))
            .map(|r| self.local.append(&r.envelope))
            .collect();
        let left = self.left_undelivered.clone();
        async move {
            // In the order they were queued: one result for each message to keep.
            let mut written = futures_util::future::join_all(writes).await.into_iter();
            (replicas.into_iter())
                .map(|ToApply { replica, routing, .. }| {
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
                    // What the earlier run had not stored it had not routed either. One it
                    // kept pending for some agents goes to those agents' recipients only.
                    let id = &replica.envelope.id;
                    let named = || left.holders_named(id);
                    let recipients = match routing {
                        _ if !stored.contains(id) => Recipients::All,
                        Routing::EarlierRun => named().unwrap_or(Recipients::Holders),
                        Routing::Again => named().unwrap_or(Recipients::All),
                        Routing::WhenKept | Routing::Never => Recipients::All,
                    };
                    Applied {
                        replica,
                        kept,
                        recipients,
                    }
                })
                .collect()
        }
    }

    /// Routes a written batch here, in order: the agents its presence changes carry are
    /// registered first, as they would be on the bridge that holds them.
    fn route(&self, written: Vec<Applied>, outstanding: &Outstanding) {
        for applied in written {
            let Applied {
                replica,
                kept,
                recipients,
            } = applied;
            let Replica {
                envelope,
                agent,
                history,
                transient,
                ..
            } = replica;
            // A stored message is pending in the store's log until done with
            // (`store::redelivery`): its deliveries hold that as they hold the batch.
            let pending = (!transient)
                .then(|| self.local.delivery_hold(&envelope.id))
                .flatten();
            if history {
                // Its own bridge delivered it while NATS was away; the others keep it.
                continue;
            }
            if let Some(mut info) = agent.and_then(|card| card.into_info()) {
                // Made with its presence message, not as the agent's connections changed:
                // while it is online there, whether one is open is for the agents
                // bucket's cards to say, and the stream is not ordered with them.
                let known = (self.core.directory.get(&info.name))
                    .filter(|k| k.online && k.is_same_agent(&info) && k.bridge == info.bridge);
                if let Some(known) = known {
                    info.connected = known.connected;
                }
                self.core.directory.register_replica(info);
            }
            self.presence(&envelope);
            telemetry::federation_applied((now_ms() - envelope.timestamp).max(0));
            // Presence and status are news only while new: nobody keeps them again.
            let news = transient || envelope.kind.is_presence();
            let held = Outstanding::both(Some(outstanding.clone()), pending);
            let how = Replicated {
                kept,
                offered: held.as_ref().filter(|_| !news),
                recipients,
            };
            self.core.accept_replica(envelope, how);
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

/// The stream sequence of `message` (0 if its reply subject does not say: nothing is then
/// taken for routed, and a batch it starts is read again from the furthest back).
fn stream_sequence(message: &async_nats::jetstream::Message) -> u64 {
    message.info().map_or(0, |info| info.stream_sequence)
}
