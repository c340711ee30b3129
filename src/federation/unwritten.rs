//! Where this bridge's deliveries not yet written begin, for a bridge killed after it
//! acknowledged them. A batch of the stream is acknowledged once its deliveries here were
//! written, but no later than `WRITTEN_WITHIN` (`acks`), so that one slow reader does not
//! hold back applying; a batch acknowledged unwritten is *late*, and the first stream
//! sequence of the oldest late batch not yet done (its *floor*) rides in every heartbeat
//! (`Heartbeat::unwritten_from`). A bridge taken for gone is read again from there by the
//! others (`missed_mail`), and by itself when it starts again while the bridges bucket
//! still holds its heartbeat (`Applier::apply_unacknowledged`), rather than from its
//! consumer's acknowledgement floor: what waited for a slow reader is kept or sent again,
//! not lost. A late batch waits, before its acknowledgement, for a heartbeat and a floors
//! record (below) carrying a floor at or before it to land with no put of either under way
//! carrying a later one — and, where the bridge's store keeps the floor too
//! (`StoreFloor`), for the store to keep one at or before it — or for its deliveries to be
//! written meanwhile; up to `CARRIED_WITHIN` more, after which it is acknowledged all the
//! same (and that is logged).
//!
//! A heartbeat also carries each agent's own floor: the oldest batch routed here, late or
//! not yet acknowledged, whose deliveries to that agent are not yet written
//! (`Written::holders`), and the sequence it routed through as it put it. What the killed
//! bridge's consumer had acknowledged, or routed through then, is kept again only for
//! those agents, from there: one slow reader does not have every other agent of the bridge
//! sent again what it had since, nor does a bridge whose acknowledgements lag behind what
//! it wrote. A batch some of whose deliveries are held for no named agent (a
//! hub's, keeping a broadcast for programs away) or not yet all taken up (an own message
//! its consumer read back before it was routed here), or more than `MOST_NAMED` agents
//! with a floor, have the heartbeat carry the oldest floor for every agent.
//!
//! The floors ride in two places (`Carrier`): the heartbeat, which every bridge watches,
//! and the bridge's floors record, put whenever they changed and at most every
//! `RECORD_EVERY`, which nobody watches: a bridge taking this one for gone reads it, and
//! goes by it when it is later than the heartbeat. What was routed after the floors the
//! others go by is kept again for every agent, so the oftener they are put, the less a
//! kill has sent twice; putting the heartbeat as often would have every bridge read every
//! other's. A late batch waits for both to carry it: either may be the one read.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::wire::Unwritten;
use super::written::{WRITTEN_WITHIN, Written};

/// How long past `WRITTEN_WITHIN` a late batch waits for a heartbeat, the floors record and
/// the store to carry it: after that (NATS away, puts or the store failing) it is
/// acknowledged all the same, so that applying goes on. Counted from when the batch was
/// queued, so that batches late at once wait out one such stretch between them, not one
/// each.
pub(super) const CARRIED_WITHIN: Duration = Duration::from_secs(2);

/// How long a wait for a put lets a carrier whose last put failed rest before it asks
/// that carrier for another.
const AFTER_A_FAILED_PUT: Duration = Duration::from_millis(200);

/// How often, at most, the floors record is put while the floors change (less often when
/// working them out takes long: `floors_record`).
pub(super) const RECORD_EVERY: Duration = Duration::from_millis(50);

/// Most agents a heartbeat names a floor of (some 10 KiB of names): past this, it carries
/// the oldest for all.
const MOST_NAMED: usize = 256;

/// A floor as the last run's heartbeat carried it: `None` for none.
type Floor = Option<u64>;

/// Where the floors are put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Carrier {
    /// The heartbeat, in the bridges bucket every bridge watches.
    Heartbeat,
    /// The floors record, in a bucket nobody watches, put more often.
    Record,
}

impl Carrier {
    const ALL: [Carrier; 2] = [Carrier::Heartbeat, Carrier::Record];

    fn index(self) -> usize {
        self as usize
    }
}

/// The late batches of this run, what the last run left, and the puts of the heartbeat
/// and of the floors record that carry their floor.
pub(super) struct UnwrittenFloor {
    state: Mutex<State>,
    /// Cancelled as the bridge stops: what its stopping drops (a mailbox's contents) is
    /// not written, so the puts from then on name no agent and let go of no batch.
    stopping: CancellationToken,
    /// Numbers each put of either carrier, under `state`'s lock as its floors are taken,
    /// so that of two puts of one run the greater number carries the later floors. Shared
    /// by every floor this run makes (`NatsLink::puts`: a setting up tried again makes
    /// another).
    puts: Arc<AtomicU64>,
    /// Asks each carrier for a put now: a late batch waits for one that carries it.
    wanted: [Notify; 2],
    /// Asks the store to keep the floor now: a late batch waits for it.
    store_wanted: Notify,
    /// Changed as each put ends, and as the store keeps the floor.
    ended: watch::Sender<()>,
}

/// The floor the bridge's store keeps too (`core::UnwrittenFrom`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StoreFloor {
    /// Its store is in memory: nothing is waited for.
    NotKept,
    /// The floor it last kept (`None`: no floor).
    Kept(Floor),
}

struct State {
    /// The floor the last run's heartbeat carried, until this run has read again from it.
    left_by_last_run: Floor,
    /// Late batches not yet found done: the first sequence of each, and what says it is
    /// done. Pushed by the acknowledgements and by a reading of the stream's unacknowledged
    /// stretch, so not in stream order.
    late: Vec<(u64, Written)>,
    /// Batches routed and not yet found done, in the order routed: the first sequence of each,
    /// and what says it is done (`routed`).
    routed: Vec<(u64, Written)>,
    /// The last sequence of the last of them.
    routed_through: u64,
    /// What each carrier holds, by `Carrier::index`.
    carriers: [Carried; 2],
    /// What the bridge's store keeps of the floor: a batch acknowledged unwritten waits
    /// for it too, as a clean stop deletes the heartbeat and the fleet forgets one two
    /// TTLs old.
    store: StoreFloor,
    /// Which numbering of the stream's sequences the batches routed now are in.
    numbering: Numbering,
}

/// Which numbering of the stream's sequences a batch is in: one more each time this run
/// finds the stream made again (`UnwrittenFloor::sequences_begun_anew`). A late batch of
/// a stream gone is not carried: its sequences would name messages of the new one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Numbering(u64);

/// What one carrier holds of the floors.
#[derive(Default)]
struct Carried {
    /// The floors of its put under way, if one is.
    in_flight: Option<Unwritten>,
    /// The floors it holds for this bridge, as far as it knows: none when a put failed and
    /// may or may not have landed.
    landed: Unwritten,
    /// Whether its last put failed.
    failed: bool,
}

impl State {
    /// The oldest floor: of the late batches not yet done (all of them once the bridge is
    /// `stopping`: what its stop drops is not written), and of what the last run left.
    fn oldest(&self, stopping: bool) -> Floor {
        let late = (self.late.iter()).filter(|(_, written)| stopping || !written.is_done());
        late.map(|(first, _)| *first)
            .chain(self.left_by_last_run)
            .min()
    }
}

/// Whether a heartbeat carrying `floors` covers a batch starting at `first` whose
/// deliveries not yet written are `holders`' (`Written::holders`).
fn covers(floors: &Unwritten, first: u64, holders: Option<&[String]>) -> bool {
    let covered = |floor: Option<u64>| floor.is_some_and(|floor| floor <= first);
    covered(floors.from)
        && match (&floors.by_agent, holders) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(_), Some(holders)) => holders.iter().all(|agent| covered(floors.of(agent))),
        }
}

impl UnwrittenFloor {
    /// With the floor the last run's heartbeat carried, which the bridges bucket holds; for
    /// a bridge that stops once `stopping` is cancelled, and whose store keeps the floor as
    /// `store` says (what it holds as this run starts: `store_kept` follows); its puts
    /// numbered by `puts`.
    pub(super) fn new(
        left_by_last_run: Floor,
        stopping: CancellationToken,
        store: StoreFloor,
        puts: Arc<AtomicU64>,
    ) -> UnwrittenFloor {
        UnwrittenFloor {
            stopping,
            puts,
            state: Mutex::new(State {
                left_by_last_run,
                late: Vec::new(),
                routed: Vec::new(),
                routed_through: 0,
                // The bucket holds the last run's heartbeat; what the record holds is not
                // known until this run puts it.
                carriers: [
                    Carried {
                        landed: Unwritten {
                            from: left_by_last_run,
                            ..Unwritten::default()
                        },
                        ..Carried::default()
                    },
                    Carried::default(),
                ],
                store,
                numbering: Numbering::default(),
            }),
            wanted: [Notify::new(), Notify::new()],
            store_wanted: Notify::new(),
            ended: watch::Sender::new(()),
        }
    }

    /// The floor the last run left, if this run has not read again from it yet.
    pub(super) fn left_by_last_run(&self) -> Floor {
        self.state.lock().left_by_last_run
    }

    /// This run has read again from the floor the last one left (and carries what of that
    /// was not written in time as late).
    pub(super) fn read_again(&self) {
        self.state.lock().left_by_last_run = None;
    }

    /// Which numbering of the stream's sequences the batches routed now are in.
    pub(super) fn numbering(&self) -> Numbering {
        self.state.lock().numbering
    }

    /// Waits, before the batch starting at `first` is acknowledged, until `written` says it
    /// is done, at most `WRITTEN_WITHIN` from `since`; past that the batch is late, and
    /// waits to be carried in the heartbeats (`carry`), at most `CARRIED_WITHIN` more.
    pub(super) async fn written_or_carried(
        &self,
        (numbering, first): (Numbering, u64),
        written: Written,
        since: Instant,
    ) {
        if !written.done_by(since + WRITTEN_WITHIN).await {
            let by = since + WRITTEN_WITHIN + CARRIED_WITHIN;
            self.carry((numbering, first), written, by).await;
        }
    }

    /// Carries the batch starting at `first` of `numbering`, about to be acknowledged
    /// before `written` says it is done, in the heartbeats, the floors record and the
    /// store: waits until a put of each carrier carrying it has landed and the store kept
    /// it (asking for each), or it is done, or its stream is gone (made again), at most
    /// until `by`; whether it was carried, done or gone.
    pub(super) async fn carry(
        &self,
        (numbering, first): (Numbering, u64),
        written: Written,
        by: Instant,
    ) -> bool {
        let mut ended = self.ended.subscribe();
        let gone = || self.state.lock().numbering != numbering;
        {
            let mut state = self.state.lock();
            if state.numbering != numbering {
                return true;
            }
            state.late.push((first, written.clone()));
        }
        let carried = async {
            while !written.is_done() && !gone() {
                let uncarried: Vec<Carrier> = (Carrier::ALL.into_iter())
                    .filter(|carrier| !self.is_carried_by(*carrier, first, &written))
                    .collect();
                let in_store = self.is_kept(first);
                if uncarried.is_empty() && in_store {
                    break;
                }
                if !in_store {
                    self.store_wanted.notify_one();
                }
                // A carrier whose last put failed is asked again after a rest; the other at
                // once.
                let (failed, ready): (Vec<Carrier>, Vec<Carrier>) = {
                    let state = self.state.lock();
                    (uncarried.into_iter()).partition(|c| state.carriers[c.index()].failed)
                };
                for carrier in ready {
                    self.wanted[carrier.index()].notify_one();
                }
                if !failed.is_empty() {
                    tokio::time::sleep(AFTER_A_FAILED_PUT).await;
                }
                for carrier in failed {
                    self.wanted[carrier.index()].notify_one();
                }
                // The sender is this floor's own: it outlives the wait.
                let _ = ended.changed().await;
            }
        };
        let carried = tokio::time::timeout_at(by, carried).await.is_ok();
        if !carried {
            tracing::warn!(
                first,
                in_heartbeat = self.is_carried_by(Carrier::Heartbeat, first, &written),
                in_record = self.is_carried_by(Carrier::Record, first, &written),
                in_store = self.is_kept(first),
                "federation: a batch was acknowledged unwritten before the heartbeat, the floors record and the store carried it"
            );
        }
        carried
    }

    /// Whether `carrier` holds floors covering the batch starting at `first`, and its put
    /// under way does too.
    fn is_carried_by(&self, carrier: Carrier, first: u64, written: &Written) -> bool {
        let holders = written.holders();
        let holders = holders.as_deref();
        let state = self.state.lock();
        let carried = &state.carriers[carrier.index()];
        covers(&carried.landed, first, holders)
            && (carried.in_flight.as_ref()).is_none_or(|floors| covers(floors, first, holders))
    }

    /// Whether the floor the store kept covers the batch starting at `first`, if it keeps
    /// one.
    fn is_kept(&self, first: u64) -> bool {
        match self.state.lock().store {
            StoreFloor::NotKept => true,
            StoreFloor::Kept(kept) => kept.is_some_and(|kept| kept <= first),
        }
    }

    /// The bridge's store kept `floor` (`UnwrittenFrom::kept`): wakes the late batches
    /// that wait for it.
    pub(super) fn store_kept(&self, floor: Floor) {
        let mut state = self.state.lock();
        if let StoreFloor::Kept(kept) = &mut state.store {
            *kept = floor;
        }
        drop(state);
        self.ended.send_replace(());
    }

    /// Resolves once a late batch waits for the store to keep the floor.
    pub(super) async fn store_wanted(&self) {
        self.store_wanted.notified().await;
    }

    /// The batch from `first` to `last` was routed, its holds let go by their sources: the
    /// heartbeats name, from now, the agents `written` says it is not yet written to, and
    /// tell of the stream up to the last sequence routed. Each batch is given once routed,
    /// everything before it in the stream routed already (a batch routed again, after a
    /// redelivery or read again, only adds its agents), so that up to there the agents a
    /// heartbeat names are all that were not written.
    pub(super) fn routed(&self, first: u64, last: u64, written: Written) {
        let mut state = self.state.lock();
        if !written.is_done() {
            state.routed.push((first, written));
        }
        state.routed_through = state.routed_through.max(last);
    }

    /// The stream was made again, its sequences begun anew: what this run routed and the
    /// floors it carried are numbered in the stream gone.
    pub(super) fn sequences_begun_anew(&self) {
        let mut state = self.state.lock();
        state.routed.clear();
        state.late.clear();
        state.routed_through = 0;
        state.left_by_last_run = None;
        state.numbering.0 += 1;
        drop(state);
        // A late batch of the stream gone waits no more.
        self.ended.send_replace(());
    }

    /// The oldest floor a put now would carry (of the late batches not yet done,
    /// or all of them once the bridge is stopping, and what the last run left), for the
    /// bridge's store to keep.
    pub(super) fn floor_now(&self) -> Floor {
        self.state.lock().oldest(self.stopping.is_cancelled())
    }

    /// Resolves once a late batch waits for a put of `carrier`.
    pub(super) async fn wanted(&self, carrier: Carrier) {
        self.wanted[carrier.index()].notified().await;
    }

    /// Starts a put of `carrier`, carrying the oldest of the late batches not yet done and
    /// of what the last run left, and each agent's oldest of the batches routed or late, if
    /// it can tell them all.
    pub(super) fn start_put(&self, carrier: Carrier) -> PutUnderWay<'_> {
        (self.start(carrier, false)).expect("a put not asked to be changed always starts")
    }

    /// Starts a put of `carrier` as `start_put` does, unless it would put what it holds
    /// already (its last put landed with these floors).
    pub(super) fn start_put_if_changed(&self, carrier: Carrier) -> Option<PutUnderWay<'_>> {
        self.start(carrier, true)
    }

    fn start(&self, carrier: Carrier, if_changed: bool) -> Option<PutUnderWay<'_>> {
        let mut state = self.state.lock();
        let stopping = self.stopping.is_cancelled();
        if !stopping {
            state.late.retain(|(_, written)| !written.is_done());
            state.routed.retain(|(_, written)| !written.is_done());
        }
        let from = state.oldest(stopping);
        // What the last run left is the whole bridge's: its heartbeat may have named no
        // agent (and this run does not read it again for some only).
        let by_agent = (state.left_by_last_run.is_none() && !stopping)
            .then(|| floors_by_agent(state.late.iter().chain(&state.routed)))
            .flatten();
        let through = state.routed_through;
        let floors = Unwritten {
            from,
            by_agent,
            through,
        };
        let carried = &state.carriers[carrier.index()];
        if if_changed && !carried.failed && carried.landed == floors {
            drop(state);
            // A late batch that asked for this put may be done with now: it looks again.
            self.ended.send_replace(());
            return None;
        }
        state.carriers[carrier.index()].in_flight = Some(floors.clone());
        let number = self.puts.fetch_add(1, Ordering::Relaxed) + 1;
        Some(PutUnderWay {
            unwritten: self,
            carrier,
            number,
            carries: floors,
            landed: false,
        })
    }

    /// The put of `carrier` under way ended: it `landed`, or may not have.
    fn put_ended(&self, carrier: Carrier, landed: bool) {
        let mut state = self.state.lock();
        let carried = &mut state.carriers[carrier.index()];
        if let Some(floors) = carried.in_flight.take() {
            // A put that failed may have landed all the same: the carrier holds one's
            // floors or the other's, and a later batch is covered only by both.
            carried.landed = match landed {
                true => floors,
                false if floors == carried.landed => floors,
                false => Unwritten::default(),
            };
            carried.failed = !landed;
        }
        drop(state);
        self.ended.send_replace(());
    }
}

/// Each agent's floor: the first sequence of the oldest of `batches` whose deliveries to it
/// are not yet done; `None` if one of them cannot tell whose its are, or more than
/// `MOST_NAMED` agents have one.
fn floors_by_agent<'a>(
    batches: impl Iterator<Item = &'a (u64, Written)>,
) -> Option<BTreeMap<String, u64>> {
    let mut floors = BTreeMap::new();
    for (first, written) in batches {
        for agent in written.holders()? {
            let floor = floors.entry(agent).or_insert(*first);
            *floor = (*floor).min(*first);
        }
        if floors.len() > MOST_NAMED {
            return None;
        }
    }
    Some(floors)
}

/// A put of the floors under way (`UnwrittenFloor::start_put`). Dropped before it is said
/// to have `landed` (failed, or given up half-way), it may or may not have.
pub(super) struct PutUnderWay<'a> {
    unwritten: &'a UnwrittenFloor,
    carrier: Carrier,
    number: u64,
    carries: Unwritten,
    landed: bool,
}

impl PutUnderWay<'_> {
    /// The floors the put carries.
    pub(super) fn carries(&self) -> &Unwritten {
        &self.carries
    }

    /// Which of this run's puts it is: a later one has a greater number.
    pub(super) fn number(&self) -> u64 {
        self.number
    }

    /// The put landed.
    pub(super) fn landed(mut self) {
        self.landed = true;
    }
}

impl Drop for PutUnderWay<'_> {
    fn drop(&mut self) {
        self.unwritten.put_ended(self.carrier, self.landed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{Delivery, Envelope, Kind, Outstanding};

    /// The numbering of the stream's sequences a run starts with.
    const FIRST_STREAM: Numbering = Numbering(0);

    /// A copy of a delivery offered `hold`, as a recipient takes it up for `agent`
    /// (`None`: a hub's, for others).
    fn taken_up(hold: &Outstanding, agent: Option<&str>) -> Arc<Delivery> {
        let mut delivery = Delivery::new(Envelope::new("test", "sender", Kind::Chat));
        delivery.offer(hold);
        let delivery = Arc::new(delivery);
        match agent {
            Some(agent) => delivery.held_copy_for(agent),
            None => delivery.held_copy(),
        }
    }

    /// A batch routed to `agents`: what says it is done, and the copies they hold it by
    /// until they drop them.
    fn batch_for(agents: &[&str]) -> (Written, Vec<Arc<Delivery>>) {
        let (hold, routed) = Outstanding::naming();
        let copies = (agents.iter())
            .map(|agent| taken_up(&hold, Some(agent)))
            .collect();
        let own = Vec::new();
        (Written { routed, own }, copies)
    }

    fn batch() -> (Written, Vec<Arc<Delivery>>) {
        batch_for(&["ann"])
    }

    fn floors(from: u64, by_agent: &[(&str, u64)]) -> Unwritten {
        Unwritten {
            from: Some(from),
            ..named(by_agent, 0)
        }
    }

    /// Floors of no late batch, naming `by_agent` up to `through`.
    fn named(by_agent: &[(&str, u64)], through: u64) -> Unwritten {
        let by_agent = by_agent.iter().map(|(a, f)| (a.to_string(), *f));
        Unwritten {
            from: None,
            by_agent: Some(by_agent.collect()),
            through,
        }
    }

    /// Floors naming agents no late batch, nor any, routed.
    fn for_all(from: u64) -> Unwritten {
        Unwritten {
            from: Some(from),
            ..Unwritten::default()
        }
    }

    fn in_ms(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    /// The floor of a running bridge whose store is in memory, with what the last run left.
    fn floor_from(left_by_last_run: Floor) -> UnwrittenFloor {
        UnwrittenFloor::new(
            left_by_last_run,
            CancellationToken::new(),
            StoreFloor::NotKept,
            Arc::default(),
        )
    }

    /// Puts heartbeats and the floors record whenever asked, each landing.
    fn heartbeat(floor: Arc<UnwrittenFloor>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                let carrier = tokio::select! {
                    () = floor.wanted(Carrier::Heartbeat) => Carrier::Heartbeat,
                    () = floor.wanted(Carrier::Record) => Carrier::Record,
                };
                let put = floor.start_put(carrier);
                tokio::task::yield_now().await;
                put.landed();
            }
        })
    }

    /// Puts the floors in both carriers, each landing; what they carry.
    fn put_both(floor: &UnwrittenFloor) -> Unwritten {
        let record = floor.start_put(Carrier::Record);
        let carries = record.carries().clone();
        record.landed();
        floor.start_put(Carrier::Heartbeat).landed();
        carries
    }

    /// Whether both carriers carry the batch starting at `first`.
    fn carried(floor: &UnwrittenFloor, first: u64, written: &Written) -> bool {
        (Carrier::ALL.into_iter()).all(|carrier| floor.is_carried_by(carrier, first, written))
    }

    #[tokio::test]
    async fn a_late_batch_waits_for_a_heartbeat_that_carries_it() {
        let floor = Arc::new(floor_from(None));
        let beating = heartbeat(floor.clone());
        let (written, copies) = batch();
        assert!(floor.carry((FIRST_STREAM, 100), written, in_ms(5000)).await);
        assert_eq!(
            floor.start_put(Carrier::Heartbeat).carries(),
            &floors(100, &[("ann", 100)])
        );
        // Once done, the floor moves on.
        drop(copies);
        assert_eq!(
            floor.start_put(Carrier::Heartbeat).carries(),
            &named(&[], 0)
        );
        beating.abort();
    }

    /// Where the bridge's store keeps the floor, a late batch waits until it kept one
    /// covering it, as well as for a heartbeat.
    #[tokio::test(start_paused = true)]
    async fn a_late_batch_waits_for_the_store_to_keep_its_floor_too() {
        let floor = Arc::new(UnwrittenFloor::new(
            None,
            CancellationToken::new(),
            StoreFloor::Kept(None),
            Arc::default(),
        ));
        let beating = heartbeat(floor.clone());
        let (written, _copies) = batch();
        let carrying = tokio::spawn({
            let floor = floor.clone();
            async move { floor.carry((FIRST_STREAM, 100), written, in_ms(5000)).await }
        });
        let asked = tokio::time::timeout(Duration::from_secs(1), floor.store_wanted());
        asked.await.expect("the store is asked to keep the floor");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!carrying.is_finished(), "carried by a heartbeat alone");
        floor.store_kept(Some(120));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!carrying.is_finished(), "the store kept a later floor");
        assert_eq!(
            floor.floor_now(),
            Some(100),
            "the floor the store is to keep"
        );
        floor.store_kept(Some(100));
        assert!(carrying.await.unwrap(), "carried");
        beating.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_batch_is_not_taken_for_carried_by_a_put_made_before_it() {
        let floor = floor_from(None);
        let (older, older_copies) = batch();
        // No one puts heartbeats: the first late batch waits in vain.
        assert!(!floor.carry((FIRST_STREAM, 100), older, in_ms(10)).await);
        let put = floor.start_put(Carrier::Heartbeat);
        assert_eq!(put.carries().from, Some(100));
        put.landed();
        // The older batch is done, and a put of no floor is under way as a newer batch
        // goes late: the bucket's floor covers it, the put under way does not.
        drop(older_copies);
        let put = floor.start_put(Carrier::Heartbeat);
        assert_eq!(put.carries().from, None);
        let (newer, _newer_copies) = batch();
        assert!(
            !floor
                .carry((FIRST_STREAM, 200), newer.clone(), in_ms(10))
                .await
        );
        put.landed();
        let put = floor.start_put(Carrier::Heartbeat);
        assert_eq!(put.carries().from, Some(200));
        put.landed();
        assert!(floor.is_carried_by(Carrier::Heartbeat, 200, &newer));
    }

    /// Has a late batch wait to be carried, then written, and `wake` the floor: the batch is
    /// acknowledged then, well before its bound.
    async fn carried_once_written(floor: &UnwrittenFloor, wake: impl FnOnce(&UnwrittenFloor)) {
        let (written, copies) = batch();
        let by = in_ms(60_000);
        let carrying = floor.carry((FIRST_STREAM, 100), written, by);
        tokio::pin!(carrying);
        assert!(futures_util::poll!(&mut carrying).is_pending());
        drop(copies);
        wake(floor);
        assert!(carrying.await);
        assert!(Instant::now() < by);
    }

    /// Woken by the next put's end, whatever it carries.
    #[tokio::test(start_paused = true)]
    async fn a_late_batch_written_meanwhile_waits_for_no_heartbeat() {
        let floor = floor_from(None);
        carried_once_written(&floor, |floor| {
            floor.start_put(Carrier::Heartbeat).landed();
        })
        .await;
    }

    /// A put of the record found not needed wakes a late batch that waits for it, as a
    /// put's end does: it may have been written meanwhile.
    #[tokio::test(start_paused = true)]
    async fn a_record_put_not_needed_wakes_a_late_batch_written_meanwhile() {
        let floor = floor_from(None);
        put_both(&floor);
        carried_once_written(&floor, |floor| {
            assert!(floor.start_put_if_changed(Carrier::Record).is_none());
        })
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_put_that_failed_may_have_landed() {
        let floor = floor_from(Some(50));
        let (written, copies) = batch();
        assert!(floor.is_carried_by(Carrier::Heartbeat, 60, &written));
        // The record holds nothing this run put until it puts it.
        assert!(!floor.is_carried_by(Carrier::Record, 60, &written));
        floor.start_put(Carrier::Record).landed();
        assert!(
            floor
                .carry((FIRST_STREAM, 60), written.clone(), Instant::now())
                .await
        );
        floor.read_again();
        drop(copies);
        // A put of no floor fails: the bucket may hold either.
        let put = floor.start_put(Carrier::Heartbeat);
        assert_eq!(put.carries().from, None);
        drop(put);
        assert!(!floor.is_carried_by(Carrier::Heartbeat, 70, &written));
    }

    #[test]
    fn the_floor_is_the_oldest_of_what_the_last_run_left_and_what_is_late() {
        let floor = floor_from(Some(300));
        let (newer, _newer_copies) = batch();
        let (older, _older_copies) = batch();
        // Late batches need not come in stream order.
        floor
            .state
            .lock()
            .late
            .extend([(250, newer), (200, older.clone())]);
        // What the last run left names no agent.
        assert_eq!(put_both(&floor).by_agent, None);
        assert!(carried(&floor, 200, &older) && !carried(&floor, 199, &older));
        assert_eq!(floor.left_by_last_run(), Some(300));
        floor.read_again();
        assert_eq!(
            floor.start_put(Carrier::Heartbeat).carries(),
            &floors(200, &[("ann", 200)])
        );
    }

    /// The floors record is put only when the floors changed since its last put landed, or
    /// that put failed; every put of either carrier is numbered after the last.
    #[test]
    fn the_record_is_put_again_only_when_the_floors_changed() {
        let floor = floor_from(None);
        let put = floor
            .start_put_if_changed(Carrier::Record)
            .expect("nothing put yet");
        let first = put.number();
        put.landed();
        assert!(floor.start_put_if_changed(Carrier::Record).is_none());
        let heartbeat = floor.start_put(Carrier::Heartbeat);
        assert!(heartbeat.number() > first);
        let (routed, _copies) = batch_for(&["ann"]);
        floor.routed(100, 199, routed);
        let put = floor
            .start_put_if_changed(Carrier::Record)
            .expect("changed");
        assert!(put.number() > heartbeat.number());
        assert_eq!(put.carries(), &named(&[("ann", 100)], 199));
        drop(put);
        let put = floor.start_put_if_changed(Carrier::Record);
        assert!(put.is_some(), "the last put failed: it may not have landed");
    }

    /// Each agent's floor is the oldest late batch it was not yet written; an agent that
    /// was written everything has none, however far behind another is.
    #[test]
    fn each_agent_has_the_floor_of_the_oldest_batch_it_was_not_written() {
        let floor = floor_from(None);
        let (older, older_copies) = batch_for(&["slow", "prompt"]);
        let (newer, _newer_copies) = batch_for(&["slow", "late"]);
        floor.state.lock().late.extend([(300, newer), (100, older)]);
        let expected = floors(100, &[("late", 300), ("prompt", 100), ("slow", 100)]);
        assert_eq!(floor.start_put(Carrier::Heartbeat).carries(), &expected);
        // The prompt one was written its copy; the slow one is still behind.
        let [slow, prompt] = <[_; 2]>::try_from(older_copies).unwrap();
        drop(prompt);
        let expected = floors(100, &[("late", 300), ("slow", 100)]);
        assert_eq!(floor.start_put(Carrier::Heartbeat).carries(), &expected);
        drop(slow);
        let expected = floors(300, &[("late", 300), ("slow", 300)]);
        assert_eq!(floor.start_put(Carrier::Heartbeat).carries(), &expected);
    }

    /// A batch held for no named agent (a hub keeping it for programs away) has the
    /// heartbeat carry the oldest floor for every agent; and a put that named the agents
    /// of the batches before does not carry a batch of another agent that went late after.
    #[test]
    fn a_batch_held_for_nobody_named_is_carried_for_all() {
        let floor = floor_from(None);
        let (named, _named_copies) = batch_for(&["ann"]);
        floor.state.lock().late.push((100, named));
        assert_eq!(put_both(&floor), floors(100, &[("ann", 100)]));
        let (bobs, _bobs_copies) = batch_for(&["bob"]);
        assert!(
            !carried(&floor, 200, &bobs),
            "the heartbeat named no floor of bob's"
        );
        let (hold, routed) = Outstanding::naming();
        let for_others = taken_up(&hold, None);
        drop(hold);
        let hubs = Written {
            routed,
            own: Vec::new(),
        };
        assert!(!carried(&floor, 200, &hubs));
        floor
            .state
            .lock()
            .late
            .extend([(200, hubs.clone()), (300, bobs.clone())]);
        assert_eq!(put_both(&floor), for_all(100));
        assert!(carried(&floor, 200, &hubs) && carried(&floor, 300, &bobs));
        drop(for_others);
        let put = floor.start_put(Carrier::Heartbeat);
        assert_eq!(put.carries(), &floors(100, &[("ann", 100), ("bob", 300)]));
    }

    /// An own message its consumer read back before it was routed here may yet be taken
    /// up for any agent: until it is routed, the heartbeat carries the oldest floor for all.
    #[test]
    fn a_batch_with_an_own_message_not_yet_routed_is_carried_for_all() {
        let floor = floor_from(None);
        let (hold, own) = Outstanding::naming();
        let (mut written, _copies) = batch_for(&["ann"]);
        written.own.push(own);
        floor.state.lock().late.push((100, written));
        assert_eq!(floor.start_put(Carrier::Heartbeat).carries(), &for_all(100));
        let _bobs = taken_up(&hold, Some("bob"));
        drop(hold);
        let named = floors(100, &[("ann", 100), ("bob", 100)]);
        assert_eq!(floor.start_put(Carrier::Heartbeat).carries(), &named);
    }

    /// The agents a batch routed and not yet acknowledged is not written to are named as
    /// well, up to the last sequence routed: past the acknowledgement floor too, the
    /// others keep again only for them.
    #[test]
    fn the_batches_routed_name_their_agents_behind_up_to_the_last_routed() {
        let floor = floor_from(None);
        let (first, first_copies) = batch_for(&["prompt", "slow"]);
        let (second, _second_copies) = batch_for(&["slow"]);
        floor.routed(100, 199, first);
        floor.routed(200, 299, second);
        let (done, done_copies) = batch_for(&["prompt"]);
        drop(done_copies);
        floor.routed(300, 399, done);
        let expected = named(&[("prompt", 100), ("slow", 100)], 399);
        assert_eq!(floor.start_put(Carrier::Heartbeat).carries(), &expected);
        let [prompt, slow] = <[_; 2]>::try_from(first_copies).unwrap();
        drop(prompt);
        assert_eq!(
            floor.start_put(Carrier::Heartbeat).carries(),
            &named(&[("slow", 100)], 399)
        );
        drop(slow);
        assert_eq!(
            floor.start_put(Carrier::Heartbeat).carries(),
            &named(&[("slow", 200)], 399)
        );
    }

    /// As the bridge stops, what it drops unwritten is done with as far as the holds can
    /// tell: the heartbeats from then on name no agent, and keep every floor they had.
    #[test]
    fn a_stopping_bridge_names_no_agent_and_lets_no_floor_go() {
        let stopping = CancellationToken::new();
        let floor =
            UnwrittenFloor::new(None, stopping.clone(), StoreFloor::NotKept, Arc::default());
        let (late, late_copies) = batch_for(&["slow"]);
        floor.state.lock().late.push((100, late));
        let (routed, routed_copies) = batch_for(&["prompt"]);
        floor.routed(200, 299, routed);
        stopping.cancel();
        drop((late_copies, routed_copies));
        let stopped = Unwritten {
            through: 299,
            ..for_all(100)
        };
        assert_eq!(floor.start_put(Carrier::Heartbeat).carries(), &stopped);
    }

    /// A stream made again begins its sequences anew: what was routed of the old one, and
    /// the floors of its late batches, are let go.
    #[test]
    fn a_stream_made_again_lets_the_old_sequences_go() {
        let floor = floor_from(None);
        let (late, _late_copies) = batch_for(&["slow"]);
        floor.state.lock().late.push((100, late));
        let (routed, _routed_copies) = batch_for(&["slow"]);
        floor.routed(200, 299, routed);
        floor.sequences_begun_anew();
        assert_eq!(
            floor.start_put(Carrier::Heartbeat).carries(),
            &named(&[], 0)
        );
    }

    /// A late batch of a stream made again meanwhile waits to be carried no more, and one
    /// that goes late after is not carried: its floor, numbered in the stream gone, would
    /// name messages of the new one.
    #[tokio::test(start_paused = true)]
    async fn a_late_batch_of_a_stream_gone_is_not_carried() {
        let floor = floor_from(None);
        let (waiting, _waiting_copies) = batch_for(&["slow"]);
        let by = in_ms(60_000);
        let carrying = floor.carry((FIRST_STREAM, 100), waiting, by);
        tokio::pin!(carrying);
        assert!(futures_util::poll!(&mut carrying).is_pending());
        floor.sequences_begun_anew();
        assert!(carrying.await, "no longer waited for");
        assert!(Instant::now() < by);

        let (later, _later_copies) = batch_for(&["slow"]);
        assert!(floor.carry((FIRST_STREAM, 200), later, by).await);
        assert_eq!(
            floor.start_put(Carrier::Heartbeat).carries(),
            &named(&[], 0),
            "no floor of the stream gone"
        );
        assert_ne!(floor.numbering(), FIRST_STREAM);
    }
}
