//! A bounded, priority-laned queue of deliveries for one connected recipient.
//!
//! The router pushes without ever waiting: when the mailbox is full its `WhenFull` policy
//! decides what happens, and the caller counts it. The recipient's session task is the
//! only consumer. A std `Mutex` guards the lanes; it is held for a few pointer moves and
//! never across an `.await`.
//!
//! Under the default policy, `replay`, a full mailbox loses nothing: what arrives past it
//! waits in a backlog as the id of the stored message (a few dozen bytes, not the
//! message), in arrival order, and is read back from the store in batches as the recipient
//! catches up — NATS JetStream's answer to a slow consumer, not NATS core's. Only a
//! recipient further behind than the backlog holds is closed, so that its client
//! reconnects and replays what the store keeps for it.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::Notify;

use super::delivery::{Delivery, Recipients};
use super::envelope::{Envelope, Priority, Protocol};
use super::hold::Outstanding;

/// Whom a holding mailbox holds what it is given for (`Mailbox::holding`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holding {
    /// Its session's agent.
    ForItsAgent,
    /// Other agents: a hub's, keeping mail for agents away. Its copies name no recipient
    /// (`Delivery::held_copy`).
    ForOthers,
}

/// What happens to a message that arrives at a full mailbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenFull {
    /// Nothing is lost: the message waits in the backlog as a reference to the store and
    /// is replayed in order; past `backlog_limit` the recipient is closed (or, where its
    /// protocol keeps mail for the absent, its mail goes there: `Disconnect`).
    #[default]
    Replay,
    /// The oldest queued message of the lowest priority is dropped to make room.
    DropOldest,
    /// The arriving message is dropped.
    DropNewest,
    /// The recipient is disconnected; it can reconnect and replay from the store.
    Disconnect,
}

/// Why a mailbox stopped delivering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// Another connection of the same agent took over.
    Replaced,
    /// The mailbox overflowed (`disconnect`), or its backlog did (`replay`).
    Overflow,
    /// The agent left or was removed.
    Gone,
    /// The bridge is shutting down.
    Shutdown,
    /// The fleet settled the agent's name on an agent another bridge holds: two bridges
    /// cut off from the fleet at once had each let an agent take it (`Core::yield_name`).
    NameTaken,
}

/// The outcome of a push, for the router's accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pushed {
    Queued,
    /// Queued in the backlog, to be read back from the store.
    Behind,
    /// Queued after dropping the oldest queued message.
    DroppedOldest,
    /// Not queued: the mailbox was full.
    DroppedNewest,
    /// Not queued: the mailbox was full and is now closed.
    Disconnected,
    /// Not queued: the mailbox was already closed.
    Closed,
}

type ExpiryHook = Arc<dyn Fn(Arc<Delivery>) + Send + Sync>;

/// Reads stored messages back by id, in the order asked, for a mailbox's backlog; `None`
/// when the store could not be read (the backlog is kept, and asked again).
pub type BacklogReader = Arc<
    dyn Fn(Vec<String>) -> Pin<Box<dyn Future<Output = Option<Vec<Envelope>>> + Send>>
        + Send
        + Sync,
>;

/// Ids read back from the store at once.
const FETCH: usize = 64;
/// How long a backlog whose read failed waits before it is read again.
const FETCH_RETRY: Duration = Duration::from_millis(100);

pub struct Mailbox {
    protocol: Protocol,
    capacity: usize,
    policy: WhenFull,
    /// Messages the backlog may hold; 0 when there is none (`replay` then closes the
    /// mailbox at an overflow, as `disconnect` does).
    backlog_limit: usize,
    reader: Option<BacklogReader>,
    /// Whom what it is given holds what its source offered for, if it does (`holding`).
    holding: Option<Holding>,
    /// Shared with a read of the backlog under way, which puts what it read in the lanes.
    shared: Arc<Shared>,
    on_expired: Option<ExpiryHook>,
    /// Where the depth is recorded each time the recipient wakes to read (a no-op handle by
    /// default). Once per wake-up, not per message: under load a wake-up drains a batch.
    depth: metrics::Histogram,
}

struct Shared {
    state: Mutex<Lanes>,
    notify: Notify,
}

/// A message waiting past the mailbox's capacity.
enum Behind {
    /// Its id, with what its delivery is made again with: the store holds the rest.
    Stored(StoredId),
    /// Not stored (a control signal, a status change), or routed again for its holders
    /// only (`Recipients`): held as it is, which keeps whom it is for.
    Held(Arc<Delivery>),
}

struct Lanes {
    lanes: [VecDeque<Arc<Delivery>>; 3],
    len: usize,
    /// Newer than everything in the lanes; while it holds anything, arrivals join it.
    backlog: VecDeque<Behind>,
    closed: Option<Closed>,
    /// Messages dropped (`drop_oldest`, `drop_newest`) that the recipient was not told of.
    untold_drops: u64,
    /// A read of the backlog's front is under way.
    fetching: bool,
}

/// A stored message waiting in the backlog: its id, when its delivery was routed (its ttl
/// runs from then) and its hold (its source learns it was written only once it is).
#[derive(Clone)]
struct StoredId {
    id: String,
    routed_at: Instant,
    outstanding: Option<Outstanding>,
}

/// What the consumer does next.
enum Next {
    Ready(Arc<Delivery>),
    /// Nothing yet: a push, or the read of the backlog's front under way, wakes the
    /// consumer.
    Empty,
}

impl Mailbox {
    pub fn new(protocol: Protocol, capacity: usize, policy: WhenFull) -> Self {
        Mailbox {
            protocol,
            capacity: capacity.max(1),
            policy,
            backlog_limit: 0,
            reader: None,
            holding: None,
            shared: Arc::new(Shared {
                state: Mutex::new(Lanes {
                    lanes: Default::default(),
                    len: 0,
                    backlog: VecDeque::new(),
                    closed: None,
                    untold_drops: 0,
                    fetching: false,
                }),
                notify: Notify::new(),
            }),
            on_expired: None,
            depth: metrics::Histogram::noop(),
        }
    }

    /// Gives a `replay` mailbox a backlog of up to `limit` messages, read back by `reader`.
    pub fn with_backlog(mut self, limit: usize, reader: BacklogReader) -> Self {
        self.backlog_limit = limit;
        self.reader = Some(reader);
        self
    }

    /// Has what it is given hold what its source offered (`Outstanding`), also while it
    /// waits in the backlog as an id: for a reader that writes or keeps mail for agents
    /// whose mail is kept for them when they are away, so that the source learns a
    /// message was done with only once it was. (Readers that replay from history hold
    /// nothing: a recipient far behind holds nothing back.) Held for its session's agent
    /// (`whom`), the router gives it copies naming that agent (`holds_for_its_agent`).
    pub fn holding(mut self, whom: Holding) -> Self {
        self.holding = Some(whom);
        self
    }

    pub fn is_holding(&self) -> bool {
        self.holding.is_some()
    }

    /// Whether what it is given is held for its session's agent: the router hands it a
    /// copy naming that agent (`Delivery::held_copy_for`).
    pub fn holds_for_its_agent(&self) -> bool {
        self.holding == Some(Holding::ForItsAgent)
    }

    /// `delivery` as this mailbox keeps it: a copy holding what its source offered, if it
    /// is a holding mailbox (`Mailbox::holding`).
    fn taken(&self, delivery: Arc<Delivery>) -> Arc<Delivery> {
        match self.is_holding() {
            true => delivery.held_copy(),
            false => delivery,
        }
    }

    /// Records the mailbox's depth in `histogram` whenever `recv` returns a message.
    pub fn with_depth_histogram(mut self, histogram: metrics::Histogram) -> Self {
        self.depth = histogram;
        self
    }

    /// Calls `hook` with every message that expires (its ttl ran out) before it is received.
    pub fn with_expiry_hook(mut self, hook: ExpiryHook) -> Self {
        self.on_expired = Some(hook);
        self
    }

    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// Whether, while open, it loses nothing it is pushed: under `drop_oldest` and
    /// `drop_newest` a full mailbox stays open and drops.
    pub fn is_lossless(&self) -> bool {
        matches!(self.policy, WhenFull::Replay | WhenFull::Disconnect)
    }

    /// Messages waiting, the backlog's included.
    pub fn len(&self) -> usize {
        let state = self.shared.state.lock();
        state.len + state.backlog.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn push(&self, delivery: Arc<Delivery>) -> Pushed {
        let delivery = self.taken(delivery);
        let lane = delivery.envelope.priority.lane();
        let outcome = {
            let mut state = self.shared.state.lock();
            if state.closed.is_some() {
                return Pushed::Closed;
            }
            // A high-priority message does not wait behind a backlog.
            let ahead = state.backlog.is_empty() || lane == Priority::High.lane();
            if ahead && state.len < self.capacity {
                state.lanes[lane].push_back(delivery);
                state.len += 1;
                Pushed::Queued
            } else {
                match self.policy {
                    WhenFull::Replay if state.backlog.len() < self.backlog_limit => {
                        // One routed to some recipients only keeps that as it waits.
                        let to_all = *delivery.recipients() == Recipients::All;
                        let behind = if delivery.stored && to_all {
                            Behind::Stored(StoredId {
                                id: delivery.envelope.id.clone(),
                                routed_at: delivery.routed_at,
                                outstanding: delivery.held().filter(|_| self.is_holding()),
                            })
                        } else {
                            Behind::Held(delivery)
                        };
                        state.backlog.push_back(behind);
                        Pushed::Behind
                    }
                    WhenFull::Replay | WhenFull::Disconnect => {
                        state.closed = Some(Closed::Overflow);
                        Pushed::Disconnected
                    }
                    WhenFull::DropNewest => {
                        state.untold_drops += 1;
                        return Pushed::DroppedNewest;
                    }
                    WhenFull::DropOldest => {
                        // Make room at the least important end: the oldest message of the
                        // lowest non-empty lane, unless that lane is less important than the
                        // arrival, in which case the arrival is the one that goes.
                        state.untold_drops += 1;
                        let victim_lane = (0..3).rev().find(|&l| !state.lanes[l].is_empty());
                        match victim_lane {
                            Some(v) if v >= lane => {
                                state.lanes[v].pop_front();
                                state.lanes[lane].push_back(delivery);
                                Pushed::DroppedOldest
                            }
                            _ => return Pushed::DroppedNewest,
                        }
                    }
                }
            }
        };
        self.shared.notify.notify_one();
        outcome
    }

    /// The next message, highest priority first, then the backlog's in arrival order; an
    /// error once the mailbox is closed.
    ///
    /// Cancel-safe: a message is only taken from the lanes by the call that returns it;
    /// the backlog is read back by a task of its own, which a cancelled `recv` does not
    /// stop, into the lanes.
    pub async fn recv(&self) -> Result<Arc<Delivery>, Closed> {
        loop {
            let depth = self.len();
            match self.next()? {
                Next::Ready(next) => {
                    self.depth.record(depth as f64);
                    return Ok(next);
                }
                // One consumer: a `notify_one` that finds no waiter leaves a permit, so a
                // push (or a read of the backlog) between `next` and here is not missed.
                Next::Empty => self.shared.notify.notified().await,
            }
        }
    }

    /// The next message in the lanes if one is queued (the backlog waits for `recv`);
    /// `Err` once the mailbox is closed.
    pub fn try_recv(&self) -> Result<Option<Arc<Delivery>>, Closed> {
        loop {
            let next = {
                let mut state = self.shared.state.lock();
                if let Some(reason) = state.closed {
                    return Err(reason);
                }
                let Some(lane) = (0..3).find(|&l| !state.lanes[l].is_empty()) else {
                    return Ok(None);
                };
                state.len -= 1;
                state.lanes[lane].pop_front()
            };
            let Some(next) = next else { return Ok(None) };
            if let Some(next) = self.unexpired(next, Instant::now()) {
                return Ok(Some(next));
            }
        }
    }

    fn next(&self) -> Result<Next, Closed> {
        if let Some(next) = self.try_recv()? {
            return Ok(Next::Ready(next));
        }
        loop {
            let held = {
                let mut state = self.shared.state.lock();
                if let Some(reason) = state.closed {
                    return Err(reason);
                }
                if state.fetching {
                    return Ok(Next::Empty);
                }
                match state.backlog.front() {
                    None => return Ok(Next::Empty),
                    Some(Behind::Held(_)) => match state.backlog.pop_front() {
                        Some(Behind::Held(delivery)) => delivery,
                        _ => unreachable!("the front was held"),
                    },
                    Some(Behind::Stored(_)) => {
                        let batch: Vec<StoredId> = (state.backlog.iter())
                            .take(FETCH)
                            .map_while(|behind| match behind {
                                Behind::Stored(stored) => Some(stored.clone()),
                                Behind::Held(_) => None,
                            })
                            .collect();
                        state.fetching = true;
                        drop(state);
                        self.fetch(batch);
                        return Ok(Next::Empty);
                    }
                }
            };
            if let Some(delivery) = self.unexpired(held, Instant::now()) {
                return Ok(Next::Ready(delivery));
            }
        }
    }

    /// Reads the backlog's front, `batch`, back from the store into the lanes, on a task
    /// of its own.
    fn fetch(&self, batch: Vec<StoredId>) {
        let Some(reader) = self.reader.clone() else {
            return;
        };
        let shared = self.shared.clone();
        let protocol = self.protocol;
        tokio::spawn(async move {
            let ids = batch.iter().map(|fetched| fetched.id.clone()).collect();
            let read = reader(ids).await;
            if read.is_none() {
                tokio::time::sleep(FETCH_RETRY).await;
            }
            let mut state = shared.state.lock();
            state.fetching = false;
            if let (None, Some(read)) = (state.closed, read) {
                let mut read: HashMap<String, Envelope> =
                    read.into_iter().map(|e| (e.id.clone(), e)).collect();
                // Only the fetch takes from the backlog's front: it is still `batch`.
                state.backlog.drain(..batch.len());
                let mut found = 0;
                for fetched in &batch {
                    let Some(envelope) = read.remove(&fetched.id) else {
                        continue;
                    };
                    found += 1;
                    let held = fetched.outstanding.clone();
                    let delivery = Delivery::stored_again(envelope, fetched.routed_at, held);
                    let lane = delivery.envelope.priority.lane();
                    state.lanes[lane].push_back(Arc::new(delivery));
                    state.len += 1;
                }
                if found < batch.len() {
                    // Acknowledged messages the store no longer has: none should be, but the
                    // recipient hears of any.
                    state.untold_drops += (batch.len() - found) as u64;
                    crate::telemetry::message_dropped(
                        protocol,
                        crate::telemetry::DropReason::BacklogNotStored,
                    );
                }
            }
            drop(state);
            shared.notify.notify_one();
        });
    }

    /// Messages dropped by the `drop_oldest` / `drop_newest` policy since last asked: the
    /// recipient's endpoint tells it in its protocol.
    pub fn take_untold_drops(&self) -> u64 {
        std::mem::take(&mut self.shared.state.lock().untold_drops)
    }

    /// `delivery`, unless it expired by `now`: then it goes to the expiry hook.
    fn unexpired(&self, delivery: Arc<Delivery>, now: Instant) -> Option<Arc<Delivery>> {
        if delivery.expires_at.is_some() && delivery.is_expired(now) {
            if let Some(hook) = &self.on_expired {
                hook(delivery);
            }
            return None;
        }
        Some(delivery)
    }

    /// Queues `delivery` in a mailbox an overflow closed, for its endpoint to keep with
    /// the rest as its connection ends (`take_left`), in order; up to twice the capacity,
    /// so a connection stuck on a slow client holds no more than that. False when the
    /// mailbox is open, closed otherwise, or that full.
    pub fn keep_after_overflow(&self, delivery: Arc<Delivery>) -> bool {
        let mut state = self.shared.state.lock();
        if state.closed != Some(Closed::Overflow) || state.len >= 2 * self.capacity {
            return false;
        }
        let delivery = self.taken(delivery);
        state.lanes[delivery.envelope.priority.lane()].push_back(delivery);
        state.len += 1;
        true
    }

    /// Takes what is still queued, closed or not, highest priority first: an overflow
    /// (`WhenFull::Disconnect`) closes the mailbox but leaves its messages for the
    /// endpoint to keep by other means (an inbox, a queue) as its connection
    /// ends. Expired ones go to the expiry hook instead. (Mailboxes of those protocols
    /// have no backlog: the router gives them none.)
    pub fn take_left(&self) -> Vec<Arc<Delivery>> {
        let left: Vec<Arc<Delivery>> = {
            let mut state = self.shared.state.lock();
            state.len = 0;
            state
                .lanes
                .iter_mut()
                .flat_map(|lane| lane.drain(..))
                .collect()
        };
        let now = Instant::now();
        (left.into_iter())
            .filter_map(|delivery| self.unexpired(delivery, now))
            .collect()
    }

    /// Stops delivery: queued messages are discarded and `recv` returns `reason`.
    pub fn close(&self, reason: Closed) {
        {
            let mut state = self.shared.state.lock();
            if state.closed.is_none() {
                state.closed = Some(reason);
            }
            for lane in &mut state.lanes {
                lane.clear();
            }
            state.len = 0;
            state.backlog.clear();
        }
        self.shared.notify.notify_one();
    }

    pub fn closed(&self) -> Option<Closed> {
        self.shared.state.lock().closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::envelope::{Envelope, Kind, Priority};

    fn msg(text: &str, priority: Priority) -> Arc<Delivery> {
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.text = Some(text.into());
        env.priority = priority;
        Arc::new(Delivery::new(env))
    }

    fn drain(mb: &Mailbox) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(Some(d)) = mb.try_recv() {
            out.push(d.envelope.text.clone().unwrap());
        }
        out
    }

    /// A backlog reader over `stored`: what a store would give back by id.
    fn reader(stored: Vec<Arc<Delivery>>) -> BacklogReader {
        let stored = Arc::new(stored);
        Arc::new(move |ids: Vec<String>| {
            let stored = stored.clone();
            Box::pin(async move {
                let found = ids
                    .iter()
                    .filter_map(|id| stored.iter().find(|d| &d.envelope.id == id))
                    .map(|d| d.envelope.clone())
                    .collect();
                Some(found)
            })
        })
    }

    fn stored(text: &str) -> Arc<Delivery> {
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.text = Some(text.into());
        Arc::new(Delivery::stored(env))
    }

    #[tokio::test]
    async fn replay_keeps_what_overflows_as_ids_and_reads_it_back_in_order() {
        let all: Vec<_> = (0..10).map(|i| stored(&i.to_string())).collect();
        let mb = Mailbox::new("t", 2, WhenFull::Replay).with_backlog(100, reader(all.clone()));
        let transient = msg("transient", Priority::Normal);
        for (i, d) in all.iter().enumerate() {
            let expected = if i < 2 {
                Pushed::Queued
            } else {
                Pushed::Behind
            };
            assert_eq!(mb.push(d.clone()), expected);
            if i == 5 {
                // Not stored: held in the backlog as it is, in its place.
                assert_eq!(mb.push(transient.clone()), Pushed::Behind);
            }
        }
        assert_eq!(mb.len(), 11);
        let mut got = Vec::new();
        for _ in 0..11 {
            got.push(mb.recv().await.unwrap().envelope.text.clone().unwrap());
        }
        let expected: Vec<String> = (0..6)
            .map(|i| i.to_string())
            .chain(["transient".to_owned()])
            .chain((6..10).map(|i| i.to_string()))
            .collect();
        assert_eq!(got, expected);
        assert!(mb.is_empty());
        assert_eq!(mb.take_untold_drops(), 0, "nothing was lost");
        // Caught up: arrivals go to the lanes again.
        assert_eq!(mb.push(stored("x")), Pushed::Queued);
    }

    /// A holding mailbox has what it is given hold its source's hold, also while it waits
    /// in the backlog as an id: the source learns it was done with only once the recipient
    /// took it.
    #[tokio::test]
    async fn the_backlog_keeps_a_held_message_held_until_it_is_taken() {
        let (outstanding, done) = Outstanding::new();
        let unheld = vec![stored("first"), stored("behind")];
        let all: Vec<_> = (unheld.iter())
            .map(|d| {
                let mut delivery = Delivery::stored(d.envelope.clone());
                delivery.offer(&outstanding);
                Arc::new(delivery)
            })
            .collect();
        let mb = Mailbox::new("t", 1, WhenFull::Replay)
            .with_backlog(10, reader(unheld))
            .holding(Holding::ForItsAgent);
        assert_eq!(mb.push(all[0].clone()), Pushed::Queued);
        assert_eq!(mb.push(all[1].clone()), Pushed::Behind);
        drop((all, outstanding));
        assert!(!done.is_cancelled());
        let first = mb.recv().await.unwrap();
        drop(first);
        assert!(!done.is_cancelled(), "the one behind is held");
        let behind = mb.recv().await.unwrap();
        assert_eq!(behind.envelope.text.as_deref(), Some("behind"));
        assert!(!done.is_cancelled());
        drop(behind);
        assert!(done.is_cancelled());
    }

    /// A mailbox that does not hold takes nothing up: its source is done once it lets go.
    #[test]
    fn a_mailbox_that_does_not_hold_holds_nothing_back() {
        let (outstanding, done) = Outstanding::new();
        let mut delivery = Delivery::new(Envelope::new("test", "a", Kind::Chat));
        delivery.offer(&outstanding);
        let mb = Mailbox::new("t", 4, WhenFull::Replay);
        assert_eq!(mb.push(Arc::new(delivery)), Pushed::Queued);
        drop(outstanding);
        assert!(done.is_cancelled());
        assert_eq!(mb.len(), 1);
    }

    #[test]
    fn a_full_backlog_closes_the_mailbox() {
        let mb = Mailbox::new("t", 1, WhenFull::Replay).with_backlog(2, reader(Vec::new()));
        assert_eq!(mb.push(stored("1")), Pushed::Queued);
        assert_eq!(mb.push(stored("2")), Pushed::Behind);
        assert_eq!(mb.push(stored("3")), Pushed::Behind);
        assert_eq!(mb.push(stored("4")), Pushed::Disconnected);
        assert_eq!(mb.try_recv().unwrap_err(), Closed::Overflow);
    }

    #[test]
    fn drops_are_kept_count_of_for_the_recipient_to_be_told() {
        let mb = Mailbox::new("t", 1, WhenFull::DropNewest);
        mb.push(msg("1", Priority::Normal));
        mb.push(msg("2", Priority::Normal));
        mb.push(msg("3", Priority::Normal));
        assert_eq!(mb.take_untold_drops(), 2);
        assert_eq!(mb.take_untold_drops(), 0, "told once");
    }

    #[test]
    fn drop_oldest_keeps_the_newest() {
        let mb = Mailbox::new("t", 2, WhenFull::DropOldest);
        assert_eq!(mb.push(msg("1", Priority::Normal)), Pushed::Queued);
        assert_eq!(mb.push(msg("2", Priority::Normal)), Pushed::Queued);
        assert_eq!(mb.push(msg("3", Priority::Normal)), Pushed::DroppedOldest);
        assert_eq!(drain(&mb), ["2", "3"]);
    }

    #[test]
    fn drop_oldest_sacrifices_lower_priority_first() {
        let mb = Mailbox::new("t", 2, WhenFull::DropOldest);
        mb.push(msg("high", Priority::High));
        mb.push(msg("low", Priority::Low));
        assert_eq!(
            mb.push(msg("normal", Priority::Normal)),
            Pushed::DroppedOldest
        );
        assert_eq!(drain(&mb), ["high", "normal"]);
        // A low-priority arrival never pushes out a more important message.
        mb.push(msg("h1", Priority::High));
        mb.push(msg("h2", Priority::High));
        assert_eq!(mb.push(msg("low", Priority::Low)), Pushed::DroppedNewest);
        assert_eq!(drain(&mb), ["h1", "h2"]);
    }

    #[test]
    fn drop_newest_refuses_the_arrival() {
        let mb = Mailbox::new("t", 2, WhenFull::DropNewest);
        mb.push(msg("1", Priority::Normal));
        mb.push(msg("2", Priority::Normal));
        assert_eq!(mb.push(msg("3", Priority::Normal)), Pushed::DroppedNewest);
        assert_eq!(drain(&mb), ["1", "2"]);
    }

    #[test]
    fn disconnect_closes_the_mailbox() {
        let mb = Mailbox::new("t", 1, WhenFull::Disconnect);
        mb.push(msg("1", Priority::Normal));
        assert_eq!(mb.push(msg("2", Priority::Normal)), Pushed::Disconnected);
        assert_eq!(mb.try_recv().unwrap_err(), Closed::Overflow);
        assert_eq!(mb.push(msg("3", Priority::Normal)), Pushed::Closed);
        // What was queued before the overflow is kept for the endpoint to take, and so is
        // what it is given to keep after it, up to twice the capacity.
        assert!(mb.keep_after_overflow(msg("2", Priority::Normal)));
        assert!(!mb.keep_after_overflow(msg("3", Priority::Normal)));
        let left: Vec<_> = (mb.take_left().iter())
            .map(|d| d.envelope.text.clone().unwrap())
            .collect();
        assert_eq!(left, ["1", "2"]);
        assert!(mb.take_left().is_empty());
        // Only an overflow keeps: a mailbox closed otherwise, or open, takes nothing so.
        let open = Mailbox::new("t", 1, WhenFull::Disconnect);
        assert!(!open.keep_after_overflow(msg("1", Priority::Normal)));
        open.close(Closed::Replaced);
        assert!(!open.keep_after_overflow(msg("1", Priority::Normal)));
    }

    #[test]
    fn higher_priority_is_served_first() {
        let mb = Mailbox::new("t", 10, WhenFull::DropOldest);
        mb.push(msg("low", Priority::Low));
        mb.push(msg("n1", Priority::Normal));
        mb.push(msg("high", Priority::High));
        mb.push(msg("n2", Priority::Normal));
        assert_eq!(drain(&mb), ["high", "n1", "n2", "low"]);
    }

    #[test]
    fn expired_messages_go_to_the_hook() {
        let expired = Arc::new(Mutex::new(Vec::new()));
        let sink = expired.clone();
        let mb = Mailbox::new("t", 10, WhenFull::DropOldest).with_expiry_hook(Arc::new(
            move |d: Arc<Delivery>| sink.lock().push(d.envelope.id.clone()),
        ));
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.ttl_secs = Some(0);
        let id = env.id.clone();
        mb.push(Arc::new(Delivery::new(env)));
        mb.push(msg("fresh", Priority::Normal));
        assert_eq!(drain(&mb), ["fresh"]);
        assert_eq!(*expired.lock(), [id]);
    }

    #[tokio::test]
    async fn recv_wakes_on_push_and_on_close() {
        let mb = Arc::new(Mailbox::new("t", 10, WhenFull::DropOldest));
        let rx = mb.clone();
        let waiter = tokio::spawn(async move { rx.recv().await.map(|d| d.envelope.id.clone()) });
        tokio::task::yield_now().await;
        let d = msg("x", Priority::Normal);
        let id = d.envelope.id.clone();
        mb.push(d);
        assert_eq!(waiter.await.unwrap(), Ok(id));

        let rx = mb.clone();
        let waiter = tokio::spawn(async move { rx.recv().await.map(|_| ()) });
        tokio::task::yield_now().await;
        mb.close(Closed::Replaced);
        assert_eq!(waiter.await.unwrap(), Err(Closed::Replaced));
    }
}
