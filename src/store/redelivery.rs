//! The message log of a bridge alone, which routes again as it starts what its last run
//! had not finished delivering. A message is acknowledged once it is durable, and its
//! recipients that hold (a holding mailbox, an offline sink: `core::Outstanding`) are done
//! with it only later, once it is written to their connections or kept as their mail: a
//! bridge killed or stopped meanwhile would lose it. So each message is pending from its
//! append until its route's hold is done, and every `KEPT_EVERY` the pending ids, and the
//! newest message the database then holds, are kept (`Store::keep_undelivered`, in
//! `undelivered.rs`), each with the agents whose copies still hold it, as its hold names
//! them (`Outstanding::naming_dropping`). As it starts, the bridge routes again, for the
//! recipients that hold only, the messages kept pending and every message stored after
//! (`route_undelivered`); one kept with agents named, to those agents' only. What was done
//! with between the last keeping and a kill is routed again too: a program or agent away
//! may be given it twice.
//!
//! A bridge in a fleet keeps them alike (`open_in_fleet`), with where its stream is to be
//! read again from (`keep_unwritten_from`), and reads its stream again as it starts rather
//! than its store: what it reads there that its last run had done with
//! (`LeftUndelivered`) it does not route again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use smallvec::SmallVec;
use tokio_util::sync::CancellationToken;

use super::undelivered::PendingRows;
use super::{Store, UndeliveredRows};
use crate::core::{
    Core, Envelope, HoldersOf, LeftUndelivered, Link, LogFuture, MessageLog, MessageQuery,
    Outstanding, Recipients, Replicated, StoredMessage, TaskRequest, UnwrittenFrom, WatchesHolders,
};
use crate::shared::pace::Pace;

/// How often, at most, the pending ids are kept, when they changed.
const KEPT_EVERY: Duration = Duration::from_millis(50);
/// A keeping writes on the store's writer thread, which every append waits for: the next
/// waits ten times as long as the last took, if that is longer than `KEPT_EVERY` (a long
/// list of pending ids, a busy writer), so that keeping takes a small share of it.
const KEEPING: Pace = Pace {
    every: KEPT_EVERY,
    times: 10,
};
/// Messages read at once as they are routed again.
const ROUTED_AGAIN_AT_ONCE: usize = 256;

/// The ids of messages appended and not yet done with.
#[derive(Default)]
struct Pending {
    ids: DashMap<String, Holds>,
    changed: AtomicBool,
    /// Set as the bridge stops: what its stopping drops (a mailbox's contents) is not done
    /// with, and stays pending.
    stopping: AtomicBool,
}

/// The holds on a pending message.
#[derive(Default)]
struct Holds {
    /// Those not yet done (`Held`): none from its append until its routing takes one; one
    /// message may be routed, and held, more than once.
    count: u32,
    pending_for: PendingFor,
}

/// Whose copies hold a pending message.
enum PendingFor {
    /// Each hold's, as it tells them (`HoldersOf::holders`): most messages are held once.
    Told(SmallVec<[HoldersOf; 1]>),
    /// What they told as the bridge began to stop, before its stopping dropped copies
    /// (`None`: they could not tell).
    AtStop(Option<Arc<[String]>>),
}

impl Default for PendingFor {
    fn default() -> Self {
        PendingFor::Told(SmallVec::new())
    }
}

impl PendingFor {
    /// The agents whose copies hold it; `None` if it was never routed, or one of its holds
    /// cannot tell (`HoldersOf::holders`).
    fn named(&self) -> Option<Arc<[String]>> {
        let told = match self {
            PendingFor::AtStop(named) => return named.clone(),
            PendingFor::Told(told) if told.is_empty() => return None,
            PendingFor::Told(told) => told,
        };
        let mut named = Vec::new();
        for holders in told {
            named.extend(holders.holders()?);
        }
        Some(agents(named))
    }
}

impl Pending {
    /// Message `id` is being appended: pending until the hold its routing takes is done.
    fn appending(&self, id: &str) {
        self.ids.entry(id.to_owned()).or_default();
        self.changed();
    }

    /// Message `id` was not appended: no hold will come.
    fn not_appended(&self, id: &str) {
        self.ids.remove_if(id, |_, holds| holds.count == 0);
        self.changed();
    }

    /// A hold on message `id` (`Held`), whose holders `holders` tells.
    fn hold(&self, id: &str, holders: HoldersOf) {
        let mut holds = match self.ids.get_mut(id) {
            Some(holds) => holds,
            None => self.ids.entry(id.to_owned()).or_default(),
        };
        holds.count += 1;
        match &mut holds.pending_for {
            PendingFor::Told(told) => told.push(holders),
            // Held again while the bridge stops: its holders are not known as it stopped.
            PendingFor::AtStop(named) => *named = None,
        }
        drop(holds);
        self.changed();
    }

    /// A hold on message `id` is done: once the last is, the message is done with.
    fn done(&self, id: &str) {
        if self.stopping.load(Ordering::Acquire) {
            return;
        }
        if let Some(mut holds) = self.ids.get_mut(id) {
            holds.count = holds.count.saturating_sub(1);
        }
        self.ids.remove_if(id, |_, holds| holds.count == 0);
        self.changed();
    }

    /// The bridge begins to stop: each message's holders are taken as they are now, since
    /// the copies its stopping drops are not done with.
    fn stopping(&self) {
        self.stopping.store(true, Ordering::Release);
        for mut holds in self.ids.iter_mut() {
            holds.pending_for = PendingFor::AtStop(holds.pending_for.named());
        }
    }

    /// Each pending id, with the agents whose copies hold it (`PendingFor::named`). While the
    /// bridge stops, a message first held since it began to stop is taken for held by all.
    fn named(&self) -> PendingRows {
        let stopping = self.stopping.load(Ordering::Acquire);
        (self.ids.iter())
            .map(|holds| {
                let named = match &holds.pending_for {
                    PendingFor::Told(_) if stopping => None,
                    holders => holders.named(),
                };
                (holds.key().clone(), named)
            })
            .collect()
    }

    /// Marks the ids changed; read first, so that the cores do not write the flag's cache
    /// line at every message.
    fn changed(&self) {
        if !self.changed.load(Ordering::Relaxed) {
            self.changed.store(true, Ordering::Release);
        }
    }
}

/// The agents of `a` and of `b`; `None` (every recipient that holds) if either is.
fn either(a: Option<Arc<[String]>>, b: &Option<Arc<[String]>>) -> Option<Arc<[String]>> {
    let (a, b) = (a?, b.as_ref()?);
    Some(agents(a.iter().chain(b.iter()).cloned().collect()))
}

/// `named`, each once, in order: as a pending message's agents are kept.
fn agents(mut named: Vec<String>) -> Arc<[String]> {
    named.sort_unstable();
    named.dedup();
    named.into()
}

/// A pending message's hold: done with once dropped.
struct Held {
    pending: Arc<Pending>,
    id: String,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.pending.done(&self.id);
    }
}

/// Whom it is pending for is kept again once that changes, though it is not done with: a
/// message routed to several holders, of which one reads slowly, stays pending for it
/// alone.
impl WatchesHolders for Held {
    fn holders_changed(&self) {
        self.pending.changed();
    }
}

/// The store as the message log of a bridge alone.
pub struct RedeliveringLog {
    store: Store,
    pending: Arc<Pending>,
    /// The newest message stored before this run accepted any: what `route_undelivered`
    /// routes again ends there.
    stored_before: i64,
    /// In a fleet, what the last run left, kept on beside this run's pending messages until
    /// it was read again.
    left: Option<Arc<LeftUndelivered>>,
    /// In a fleet, where its stream is to be read again from now (`unwritten_from`).
    unwritten_from: std::sync::OnceLock<Arc<dyn UnwrittenFrom>>,
    /// The floor last kept (0 for none): kept again as soon as it moves, whether or not
    /// the pending ids changed.
    floor_kept: AtomicU64,
    /// What the table of pending ids holds, so that a keeping writes what changed.
    kept: UndeliveredRows,
}

impl RedeliveringLog {
    /// The log over `store`, opened before the bridge accepts anything.
    pub async fn open(store: Store) -> Result<Arc<RedeliveringLog>, super::StoreError> {
        let stored_before = store.start_redelivery().await?;
        Ok(Arc::new(RedeliveringLog {
            store,
            pending: Arc::default(),
            stored_before,
            left: None,
            unwritten_from: Default::default(),
            floor_kept: AtomicU64::new(0),
            kept: UndeliveredRows::default(),
        }))
    }

    /// The log over `store` of a bridge in a fleet, opened before the bridge accepts
    /// anything, and what its last run left undelivered (read before this run keeps its
    /// own, and kept on with them until the fleet says it was read again). Nothing is
    /// routed again from the store: the fleet's stream is read again.
    pub async fn open_in_fleet(
        store: Store,
    ) -> Result<(Arc<RedeliveringLog>, Arc<LeftUndelivered>), super::StoreError> {
        let left = Arc::new(store.left_undelivered().await?);
        let log = Arc::new(RedeliveringLog {
            store,
            pending: Arc::default(),
            stored_before: 0,
            left: Some(left.clone()),
            unwritten_from: Default::default(),
            floor_kept: AtomicU64::new(0),
            kept: UndeliveredRows::default(),
        });
        Ok((log, left))
    }

    /// Keeps the pending ids every `KEPT_EVERY` (or as `KEEPING` says) while they, or
    /// the floor of its stream, change, until the bridge shuts down (`stopped` keeps them a
    /// last time).
    pub fn keep_pending(
        self: &Arc<Self>,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let log = self.clone();
        tokio::spawn(async move {
            let mut next = tokio::time::Instant::now() + KEPT_EVERY;
            loop {
                let wanted = async {
                    match log.unwritten_from.get() {
                        Some(unwritten_from) => unwritten_from.wanted().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep_until(next) => {}
                    // A batch of its fleet's stream waits for the floor.
                    _ = wanted => {}
                }
                let began = tokio::time::Instant::now();
                let changed = log.pending.changed.swap(false, Ordering::AcqRel);
                let floor = log.floor_to_keep().unwrap_or(0);
                if changed || floor != log.floor_kept.load(Ordering::Relaxed) {
                    log.keep().await;
                }
                next = KEEPING.next_after(began);
            }
        })
    }

    /// In a fleet, keeps with the pending ids where its stream is to be read again from, as
    /// `unwritten_from` says, and tells it once kept (`UnwrittenFrom`): the heartbeat that
    /// carries it is deleted as the bridge stops, and forgotten two TTLs after it was
    /// killed.
    pub fn keep_unwritten_from(&self, unwritten_from: Arc<dyn UnwrittenFrom>) {
        let _ = self.unwritten_from.set(unwritten_from);
    }

    /// The bridge is stopping: what is pending now stays so, for the agents it is pending
    /// for now, whatever its stopping drops.
    pub fn stopping(&self) {
        self.pending.stopping();
    }

    /// The bridge stopped: keeps what is pending, to route it again at the next start.
    pub async fn stopped(&self) {
        self.keep().await;
    }

    async fn keep(&self) {
        let pending = self.pending.clone();
        // What the last run left and this one has not read again yet: its pending ids, and
        // no later mark than its.
        let left = (self.left.clone()).filter(|left| !left.is_read_again());
        let through = (left.as_ref()).map_or(i64::MAX, |left| left.kept_through.unwrap_or(0));
        let unwritten_from = self.floor_to_keep();
        let ids = move || {
            let mut ids = pending.named();
            // One pending in both runs is pending for the agents of either.
            for (id, left_for) in left.iter().flat_map(|left| &left.pending) {
                ids.entry(id.clone())
                    .and_modify(|named| *named = either(named.take(), left_for))
                    .or_insert_with(|| left_for.clone());
            }
            ids
        };
        match (self.store)
            .keep_undelivered(&self.kept, ids, through, unwritten_from)
            .await
        {
            Ok(()) => {
                (self.floor_kept).store(unwritten_from.unwrap_or(0), Ordering::Relaxed);
                if let Some(fleet) = self.unwritten_from.get() {
                    fleet.kept(unwritten_from);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "store: cannot keep the messages not yet delivered")
            }
        }
    }

    /// Where the stream is to be read again from: the older of what the last run left,
    /// until it was read again, and what this run says now.
    fn floor_to_keep(&self) -> Option<u64> {
        let left = (self.left.as_ref()).filter(|left| !left.is_read_again());
        let now = (self.unwritten_from.get()).and_then(|fleet| fleet.now());
        left.and_then(|left| left.unwritten_from)
            .into_iter()
            .chain(now)
            .min()
    }

    /// Routes again, to the recipients that hold only, what the last run had not finished
    /// delivering (the module's doc), up to the newest message stored before this run
    /// accepted any; how many messages. A message the last run kept pending for some
    /// agents (`HoldersOf::holders`) goes to those agents' only. Called before the pending ids
    /// are first kept (`keep_pending`). Presence is news only while new, and is not routed
    /// again.
    pub async fn route_undelivered(&self, core: &Core) -> usize {
        // Read before this run keeps its own pending ids over them.
        let left = self.store.left_undelivered().await.unwrap_or_else(|e| {
            tracing::error!(error = %e, "store: cannot read which agents the messages not yet delivered were for");
            LeftUndelivered::default()
        });
        let mut after = 0;
        let mut routed = 0;
        loop {
            let page = self
                .store
                .undelivered(after, self.stored_before, ROUTED_AGAIN_AT_ONCE)
                .await;
            let page = match page {
                Ok(page) => page,
                Err(e) => {
                    tracing::error!(error = %e, "store: cannot read the messages not yet delivered");
                    return routed;
                }
            };
            let Some(last) = page.last() else {
                return routed;
            };
            after = last.seq;
            for message in page {
                let envelope = message.envelope;
                if envelope.kind.is_presence() {
                    continue;
                }
                let hold = self.hold(&envelope.id);
                let holders = left.holders_named(&envelope.id);
                let how = Replicated {
                    kept: true,
                    offered: Some(&hold),
                    recipients: holders.unwrap_or(Recipients::Holders),
                };
                core.accept_replica(envelope, how);
                routed += 1;
            }
        }
    }

    /// Message `id` is pending (it is already if appended in this run, but not if it is
    /// routed again) until the hold this gives is done.
    fn hold(&self, id: &str) -> Outstanding {
        let (hold, holders) = Outstanding::naming_dropping(Held {
            pending: self.pending.clone(),
            id: id.to_owned(),
        });
        self.pending.hold(id, holders);
        hold
    }
}

impl MessageLog for RedeliveringLog {
    fn append(&self, env: &Envelope) -> LogFuture<'static, ()> {
        self.pending.appending(&env.id);
        let (appended, pending, id) = (
            MessageLog::append(&self.store, env),
            self.pending.clone(),
            env.id.clone(),
        );
        Box::pin(async move {
            let appended = appended.await;
            if appended.is_err() {
                pending.not_appended(&id);
            }
            appended
        })
    }

    fn delivery_hold(&self, id: &str) -> Option<Outstanding> {
        Some(self.hold(id))
    }

    fn read(&self, query: MessageQuery) -> LogFuture<'_, Vec<StoredMessage>> {
        MessageLog::read(&self.store, query)
    }

    fn read_ids(&self, ids: Vec<String>) -> LogFuture<'_, Vec<StoredMessage>> {
        MessageLog::read_ids(&self.store, ids)
    }

    fn get(&self, id: &str) -> LogFuture<'_, Option<StoredMessage>> {
        MessageLog::get(&self.store, id)
    }

    fn replies(&self, id: &str) -> LogFuture<'_, Vec<StoredMessage>> {
        MessageLog::replies(&self.store, id)
    }

    fn contains(&self, id: &str) -> LogFuture<'_, bool> {
        MessageLog::contains(&self.store, id)
    }

    fn link(&self, id: &str) -> LogFuture<'_, Option<Link>> {
        MessageLog::link(&self.store, id)
    }

    fn task_request(&self, task_id: &str) -> LogFuture<'_, Option<TaskRequest>> {
        MessageLog::task_request(&self.store, task_id)
    }

    fn id_by_uuid(&self, uuid: &str) -> LogFuture<'_, Option<String>> {
        MessageLog::id_by_uuid(&self.store, uuid)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    use crate::core::{Envelope, Kind};
    use crate::store::undelivered::PendingRows;
    use crate::store::{IN_MEMORY, Store, UndeliveredRows};

    fn message(id: &str) -> Envelope {
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.id = id.to_owned();
        env
    }

    /// A fleet's floor of its stream as the tests set it (0 for none), and what the store
    /// said it kept of it.
    #[derive(Default)]
    struct Floor {
        now: std::sync::atomic::AtomicU64,
        kept: parking_lot::Mutex<Vec<Option<u64>>>,
    }

    impl Floor {
        fn at(floor: u64) -> Arc<Floor> {
            let at = Arc::new(Floor::default());
            at.now.store(floor, Ordering::Relaxed);
            at
        }
    }

    impl crate::core::UnwrittenFrom for Floor {
        fn now(&self) -> Option<u64> {
            Some(self.now.load(Ordering::Relaxed)).filter(|floor| *floor > 0)
        }

        fn kept(&self, floor: Option<u64>) {
            self.kept.lock().push(floor);
        }

        fn wanted(&self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
            Box::pin(std::future::pending())
        }
    }

    /// Pending ids as kept, with no agents named.
    fn unnamed(ids: &[&str]) -> PendingRows {
        ids.iter().map(|id| (id.to_string(), None)).collect()
    }

    async fn undelivered(store: &Store) -> Vec<String> {
        let (mut after, mut ids) = (0, Vec::new());
        loop {
            let page = store.undelivered(after, i64::MAX, 2).await.unwrap();
            let Some(last) = page.last() else { break };
            after = last.seq;
            ids.extend(page.into_iter().map(|m| m.envelope.id));
        }
        ids
    }

    /// A new store routes again all it holds until it keeps what is pending; then the
    /// messages kept pending and those stored after the keeping are, in the order stored,
    /// page by page.
    #[tokio::test]
    async fn what_was_pending_or_came_after_is_routed_again() {
        let (store, rows) = (
            Store::open(IN_MEMORY).await.unwrap(),
            UndeliveredRows::default(),
        );
        store.insert_message(&message("m0")).await.unwrap();
        assert_eq!(undelivered(&store).await, ["m0"]);
        for id in ["m1", "m2", "m3", "m4"] {
            store.insert_message(&message(id)).await.unwrap();
        }
        let pending = || unnamed(&["m2", "m3", "gone"]);
        store
            .keep_undelivered(&rows, pending, i64::MAX, None)
            .await
            .unwrap();
        store.insert_message(&message("m5")).await.unwrap();
        assert_eq!(undelivered(&store).await, ["m2", "m3", "m5"]);
        store
            .keep_undelivered(&rows, PendingRows::default, i64::MAX, None)
            .await
            .unwrap();
        assert!(undelivered(&store).await.is_empty());
    }

    /// What the last run left undelivered, as a bridge in a fleet reads it: nothing a new
    /// store holds is known done with until something was kept; then what was stored up to
    /// the keeping and not kept pending is.
    #[tokio::test]
    async fn a_fleet_learns_which_stored_messages_its_last_run_had_done_with() {
        use crate::core::MessageLog;
        let (store, rows) = (
            Store::open(IN_MEMORY).await.unwrap(),
            UndeliveredRows::default(),
        );
        for id in ["m0", "m1", "m2"] {
            store.insert_message(&message(id)).await.unwrap();
        }
        let stored = |ids: &[&str]| {
            let ids = ids.iter().map(|id| id.to_string()).collect();
            store.read_ids(ids)
        };
        let done = async |ids: &[&str]| {
            let left = store.left_undelivered().await.unwrap();
            let stored = stored(ids).await.unwrap();
            stored.iter().map(|m| left.done_with(m)).collect::<Vec<_>>()
        };
        assert_eq!(done(&["m0", "m1", "m2"]).await, [false; 3]);
        store
            .keep_undelivered(&rows, || unnamed(&["m1"]), i64::MAX, None)
            .await
            .unwrap();
        store.insert_message(&message("m3")).await.unwrap();
        assert_eq!(
            done(&["m0", "m1", "m2", "m3"]).await,
            [true, false, true, false]
        );
    }

    /// A run in a fleet keeps what its last run left beside its own pending messages, and
    /// no later mark, until it has read that again: killed or stopped before, it leaves it
    /// to the next run as it found it.
    #[tokio::test]
    async fn a_fleet_keeps_what_its_last_run_left_until_it_was_read_again() {
        use super::RedeliveringLog;
        use crate::core::MessageLog;
        let (store, rows) = (
            Store::open(IN_MEMORY).await.unwrap(),
            UndeliveredRows::default(),
        );
        for id in ["m0", "m1", "m2"] {
            store.insert_message(&message(id)).await.unwrap();
        }
        store
            .keep_undelivered(&rows, || unnamed(&["m0"]), i64::MAX, Some(7))
            .await
            .unwrap();
        store.insert_message(&message("m3")).await.unwrap();
        let (log, left) = RedeliveringLog::open_in_fleet(store.clone()).await.unwrap();
        assert_eq!(left.unwritten_from, Some(7));
        log.keep_unwritten_from(Floor::at(9));
        let hold = log.delivery_hold("m3");
        log.stopped().await;
        let kept = store.left_undelivered().await.unwrap();
        assert_eq!(kept.kept_through, left.kept_through);
        assert_eq!(kept.unwritten_from, Some(7), "the older of the two");
        let mut pending: Vec<&String> = kept.pending.keys().collect();
        pending.sort();
        assert_eq!(pending, ["m0", "m3"]);
        left.read_again();
        drop(hold);
        log.stopped().await;
        let kept = store.left_undelivered().await.unwrap();
        assert!(kept.pending.is_empty());
        assert!(kept.kept_through > left.kept_through);
        assert_eq!(
            kept.unwritten_from,
            Some(9),
            "this run's alone once read again"
        );
    }

    /// A message is pending from its append until every hold on it is done: its routing's,
    /// and another's (routed again) as well.
    #[tokio::test]
    async fn a_message_held_twice_is_pending_until_both_holds_are_done() {
        use super::RedeliveringLog;
        use crate::core::MessageLog;
        let store = Store::open(IN_MEMORY).await.unwrap();
        let (log, left) = RedeliveringLog::open_in_fleet(store.clone()).await.unwrap();
        left.read_again();
        let pending = async || {
            log.stopped().await;
            store.left_undelivered().await.unwrap().pending
        };
        log.append(&message("m0")).await.unwrap();
        assert!(
            pending().await.contains_key("m0"),
            "appended, not yet routed"
        );
        let (first, second) = (log.delivery_hold("m0"), log.delivery_hold("m0"));
        drop(first);
        assert!(
            pending().await.contains_key("m0"),
            "the second hold is not done"
        );
        drop(second);
        assert!(pending().await.is_empty());
        // One whose append failed is not pending.
        log.pending.appending("m1");
        log.pending.not_appended("m1");
        assert!(pending().await.is_empty());
    }

    /// A message is kept pending for the agents whose copies hold it, once its routing is
    /// over; those its routing took for nobody named (a hub's) leave it pending for all. As
    /// the bridge stops, it stays pending for the agents it was pending for then, whatever
    /// copies its stopping drops.
    #[tokio::test]
    async fn a_message_is_kept_pending_for_the_agents_whose_copies_hold_it() {
        use super::RedeliveringLog;
        use crate::core::{Delivery, MessageLog};
        let store = Store::open(IN_MEMORY).await.unwrap();
        let (log, left) = RedeliveringLog::open_in_fleet(store.clone()).await.unwrap();
        left.read_again();
        let pending_for = async |id: &str| {
            log.stopped().await;
            let left = store.left_undelivered().await.unwrap();
            left.pending
                .get(id)
                .cloned()
                .map(|named| named.map(|n| n.to_vec()))
        };
        let routed = |id: &str| {
            let mut delivery = Delivery::new(message(id));
            let hold = log.delivery_hold(id).unwrap();
            delivery.offer(&hold);
            (Arc::new(delivery), hold)
        };
        let (m0, hold) = routed("m0");
        let copies = [m0.held_copy_for("bob"), m0.held_copy_for("ann")];
        assert_eq!(pending_for("m0").await, Some(None), "while it is routed");
        drop(hold);
        assert_eq!(
            pending_for("m0").await,
            Some(Some(vec!["ann".into(), "bob".into()]))
        );
        let [bob, ann] = copies;
        // Kept again once bob's copy was written, though it is still pending for ann.
        log.pending.changed.store(false, Ordering::Relaxed);
        drop(bob);
        assert!(log.pending.changed.load(Ordering::Relaxed), "kept again");
        assert_eq!(pending_for("m0").await, Some(Some(vec!["ann".into()])));
        let (m1, hold) = routed("m1");
        let hubs = m1.held_copy();
        drop(hold);
        assert_eq!(
            pending_for("m1").await,
            Some(None),
            "a hub's copy names nobody"
        );
        log.stopping();
        drop((ann, hubs));
        assert_eq!(pending_for("m0").await, Some(Some(vec!["ann".into()])));
        assert_eq!(pending_for("m1").await, Some(None));
    }

    /// A message pending in the last run and in this one is kept pending for the agents of
    /// either, or for all if either could not tell.
    #[test]
    fn a_message_pending_in_two_runs_is_pending_for_the_agents_of_either() {
        let named = |names: &[&str]| {
            Some(Arc::from(
                names.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
            ))
        };
        let both = super::either(named(&["bob", "ann"]), &named(&["cy", "ann"]));
        assert_eq!(both, named(&["ann", "bob", "cy"]));
        assert_eq!(super::either(None, &named(&["ann"])), None);
        assert_eq!(super::either(named(&["ann"]), &None), None);
    }

    /// In a fleet, the floor of its stream is kept as soon as it moves, though nothing
    /// pending changed (a batch going late behind a reader that stopped reading).
    #[tokio::test]
    async fn a_floor_that_moves_is_kept_though_nothing_pending_changed() {
        use super::RedeliveringLog;
        use tokio_util::sync::CancellationToken;
        let store = Store::open(IN_MEMORY).await.unwrap();
        let (log, left) = RedeliveringLog::open_in_fleet(store.clone()).await.unwrap();
        left.read_again();
        let floor = Floor::at(0);
        log.keep_unwritten_from(floor.clone());
        let shutdown = CancellationToken::new();
        let keeping = log.keep_pending(shutdown.clone());
        floor.now.store(5, Ordering::Relaxed);
        let kept = async {
            while store.left_undelivered().await.unwrap().unwritten_from != Some(5) {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        };
        // A bound, not a speed: it is kept within a tick or two of `KEPT_EVERY`.
        tokio::time::timeout(std::time::Duration::from_secs(10), kept)
            .await
            .expect("the floor kept");
        shutdown.cancel();
        keeping.await.unwrap();
        let told = floor.kept.lock().clone();
        assert_eq!(told.last(), Some(&Some(5)), "the fleet is told it was kept");
    }
}
