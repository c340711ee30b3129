//! Records an endpoint keeps that every bridge of a fleet shares: a protocol's server state
//! (a Tracker task, say) that a client must find the same whichever bridge it asks. A bridge
//! alone keeps them in its own tables; in a fleet, each write goes first to a record the
//! whole fleet shares (`federation`), conditional on the revision the writer read, so that
//! of two bridges changing one record at once exactly one wins; every bridge then applies
//! the record to its own tables, in revision order, and serves reads from them.

use std::pin::Pin;
use std::sync::Arc;

/// A record's version in the fleet: it grows with every write to the record.
pub type Revision = u64;

/// Tries of a change that lost to another write each time, before it is given up as too
/// contended (each lost try means another writer won, so the record moved on), and the
/// wait before the next, growing: a replica may answer the next read before it has the
/// write that won.
const CHANGE_ATTEMPTS: usize = 32;
const CHANGE_RETRY_AFTER: std::time::Duration = std::time::Duration::from_millis(2);

/// What one try of a change to a shared record came to.
pub enum Tried<T> {
    /// Decided: written, or nothing to write.
    Done(T),
    /// Another write came first: the change is made again on what that one left.
    Lost,
}

/// Runs `once` — read the record, make the change, write it at the revision read — until a
/// try is not lost to another write; `None` when every try was.
pub async fn until_not_lost<T, E, F, Fut>(mut once: F) -> Result<Option<T>, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Tried<T>, E>>,
{
    for attempt in 0..CHANGE_ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(CHANGE_RETRY_AFTER * attempt as u32).await;
        }
        if let Tried::Done(out) = once().await? {
            return Ok(Some(out));
        }
    }
    Ok(None)
}

/// A conditional write's revision, or `None` when another write came first.
pub fn unless_lost(
    written: Result<Revision, RecordError>,
) -> Result<Option<Revision>, RecordError> {
    match written {
        Ok(revision) => Ok(Some(revision)),
        Err(RecordError::Conflict) => Ok(None),
        Err(e) => Err(e),
    }
}

/// How long a socket or stream whose mail could not all be taken (the fleet's records out
/// of reach) waits before taking it again, so that the mail is sent on the open connection
/// once NATS is back rather than when the agent next connects; and how often a bridge
/// settles mail whose take it cannot be sure of (`UnsettledMail`).
pub const TAKE_AGAIN_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a bridge remembers the revisions of mail it took, against a late copy of a
/// record it took (its watch behind the take, a local apply held up by a slow write): far
/// longer than any request to NATS takes.
pub const LATE_COPY_WINDOW: std::time::Duration = std::time::Duration::from_secs(600);

/// Mail taken for an agent, with what `take_each` could not take put back.
pub struct TakenMail<T> {
    pub taken: Vec<T>,
    /// Some was put back, not known to be taken: to be taken again (`TAKE_AGAIN_AFTER`).
    pub retake: bool,
}

impl<T> TakenMail<T> {
    /// All of `taken`: mail a bridge alone keeps, nothing left.
    pub fn all(taken: Vec<T>) -> Self {
        TakenMail {
            taken,
            retake: false,
        }
    }
}

/// Mail taken from a table of a fleet's records (`take_each`).
pub struct TakenEach<T> {
    /// Taken by this bridge, or kept by it alone (no record to take).
    pub taken: Vec<T>,
    /// Not known to be taken, the records being out of reach: to be put back as they were
    /// and taken again later, which finds out whether a take without an answer landed.
    pub unreachable: Vec<T>,
}

impl<T> TakenEach<T> {
    /// What was taken, as the agent's mail, and the unreachable ones, to be put back: each
    /// noted in `unsettled` by `mail_of` (its agent and message id), to be settled.
    pub fn noting_unsettled(
        self,
        unsettled: &super::UnsettledMail,
        mail_of: impl Fn(&T) -> (&str, &str),
    ) -> (TakenMail<T>, Vec<T>) {
        for item in &self.unreachable {
            let (agent, id) = mail_of(item);
            unsettled.note(agent, id);
        }
        let mail = TakenMail {
            retake: !self.unreachable.is_empty(),
            taken: self.taken,
        };
        (mail, self.unreachable)
    }
}

/// Takes the record of each of `items` (`record_of`: its key and the revision applied here,
/// or `None` for one this bridge kept alone) from `table`, all at once. One another bridge
/// took first is in neither list.
pub async fn take_each<T>(
    records: &dyn SharedRecords,
    table: &str,
    items: Vec<T>,
    record_of: impl Fn(&T) -> Option<(String, Revision)>,
) -> TakenEach<T> {
    let takes = items.into_iter().map(|item| {
        let record = record_of(&item);
        async move {
            let outcome = match record {
                Some((key, revision)) => records.take(table, &key, revision).await,
                None => Ok(()),
            };
            (outcome, item)
        }
    });
    let mut each = TakenEach {
        taken: Vec::new(),
        unreachable: Vec::new(),
    };
    for (outcome, item) in futures_util::future::join_all(takes).await {
        match outcome {
            Ok(()) => each.taken.push(item),
            Err(RecordError::Conflict) => {}
            Err(RecordError::Unavailable(_)) => each.unreachable.push(item),
        }
    }
    each
}

pub type RecordFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, RecordError>> + Send + 'a>>;

/// What a conditional write expects of the record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// It does not exist: never written, removed, or taken.
    Absent,
    /// It is still at this revision.
    At(Revision),
    /// It was never written, or was last taken (`SharedRecords::take`) so long ago that no
    /// late copy of it is still on its way: mail a bridge keeps for an absent agent, which
    /// several bridges may try to keep and only one may, once.
    Unused,
}

#[derive(Debug)]
pub enum RecordError {
    /// Another write came first: read it again and retry.
    Conflict,
    /// The fleet's record could not be reached in time.
    Unavailable(String),
}

impl std::fmt::Display for RecordError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordError::Conflict => f.write_str("the record was changed by another write"),
            RecordError::Unavailable(why) => {
                write!(f, "the fleet's records are unavailable: {why}")
            }
        }
    }
}

impl std::error::Error for RecordError {}

/// A record as the fleet holds it.
#[derive(Clone, Debug)]
pub struct Record {
    /// `None` once the record was removed (a removed record is not made again by a bridge
    /// that has not applied the removal yet).
    pub value: Option<bytes::Bytes>,
    pub revision: Revision,
}

/// A change to a table, as it reaches every bridge (the writer's too).
#[derive(Clone, Debug)]
pub struct RecordChange {
    pub key: String,
    /// `None` when the record was removed.
    pub value: Option<bytes::Bytes>,
    pub revision: Revision,
    /// A removal that is this bridge's own take (`SharedRecords::take`). A row from before
    /// it that this bridge still holds is its own to deliver: the take landed, its answer
    /// did not, and taking the row again, or settling it (`UnsettledMail`), finds that out.
    pub taken_here: bool,
}

/// Applies the changes of one table to the endpoint's own tables. Called in revision order
/// for each record, and again for records already applied (on reconnection, at start):
/// applying must be idempotent by revision.
pub trait RecordSink: Send + Sync {
    fn apply(&self, change: RecordChange) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;

    /// Applies again, once each, the records whose last change's apply kept failing for a
    /// moment, as `current` reads them from the fleet now (a removal if it holds nothing of
    /// one any more): from the fleet's current record rather than the change that failed,
    /// since this bridge may have applied a later one itself, as its writer. Whoever calls
    /// `apply` calls this every `FAILED_APPLIED_AGAIN_EVERY`, never at the same time.
    fn apply_failed_again<'a>(
        &'a self,
        _current: CurrentRecord<'a>,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
        Box::pin(std::future::ready(()))
    }
}

/// Reads a record of the table a sink applies as the fleet holds it now, as a change to
/// apply (`RecordSink::apply_failed_again`): `None` when the fleet holds nothing of it.
/// Never older than what this bridge applied: read where writes are decided (a stream's
/// leader), not from a replica that may be behind.
pub type CurrentRecord<'a> =
    &'a (dyn Fn(String) -> RecordFuture<'static, Option<RecordChange>> + Send + Sync);

/// How often records whose last change's apply kept failing for a moment are applied again
/// (`RecordSink::apply_failed_again`): a store that failed for longer than `apply`'s own
/// tries (a disk full until space is freed) takes them once it is back, rather than at the
/// record's next change or the bridge's next start.
pub const FAILED_APPLIED_AGAIN_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Why a change could not be applied, and whether trying it again may do: a store that
/// failed for a moment (I/O, a disk full until space was freed) may take it on a later
/// try; a record this bridge cannot read or place never will.
pub trait ApplyError: std::fmt::Display {
    fn worth_trying_again(&self) -> bool;
}

/// How many times a change is tried while its failures are worth trying again
/// (`ApplyError`), and how long after a failure it is tried again, doubled each time:
/// within a second, so that the table's watch, which applies one change at a time, is not
/// held up for longer than that.
const APPLY_TRIES: u32 = 4;
const APPLY_AGAIN_AFTER: std::time::Duration = std::time::Duration::from_millis(100);

/// The sink that applies each change with `apply` on `owner` (an endpoint) while it lives,
/// tries a change that failed for a moment again (`APPLY_TRIES`, then its record every
/// `FAILED_APPLIED_AGAIN_EVERY` until it applies), and logs one it could not apply as one
/// of `what`.
pub fn sink<T, F, Fut, E>(owner: &Arc<T>, what: &'static str, apply: F) -> Arc<dyn RecordSink>
where
    T: Send + Sync + 'static,
    F: Fn(Arc<T>, RecordChange) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: ApplyError,
{
    Arc::new(ApplyWith {
        owner: Arc::downgrade(owner),
        what,
        apply,
        failed: parking_lot::Mutex::default(),
    })
}

struct ApplyWith<T, F> {
    owner: std::sync::Weak<T>,
    what: &'static str,
    apply: F,
    /// The records whose last change's apply kept failing for a moment, by key, with that
    /// change's revision: applied again by `apply_failed_again`, or by their next change.
    failed: parking_lot::Mutex<std::collections::BTreeMap<String, Revision>>,
}

impl<T, F, Fut, E> ApplyWith<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(Arc<T>, RecordChange) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: ApplyError,
{
    /// Applies `change` once: `Ok`, or the failure and whether it is worth trying again.
    /// `None` once the owner is gone.
    async fn apply_once(&self, change: &RecordChange) -> Option<Result<(), (String, bool)>> {
        let owner = self.owner.upgrade()?;
        Some(match (self.apply)(owner, change.clone()).await {
            Ok(()) => Ok(()),
            Err(e) => Err((e.to_string(), e.worth_trying_again())),
        })
    }
}

impl<T, F, Fut, E> RecordSink for ApplyWith<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(Arc<T>, RecordChange) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: ApplyError,
{
    fn apply(&self, change: RecordChange) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            let key = &change.key;
            // Put aside before: tried once, the store most likely not back yet.
            let put_aside = self.failed.lock().remove(key).is_some();
            let tries = if put_aside { 1 } else { APPLY_TRIES };
            let mut pause = APPLY_AGAIN_AFTER;
            for tried in 1..=tries {
                let (failed, again) = match self.apply_once(&change).await {
                    None => return,
                    Some(Ok(())) if put_aside => {
                        return tracing::info!(%key, "applied a shared {} at last", self.what);
                    }
                    Some(Ok(())) => return,
                    Some(Err(failed)) => failed,
                };
                if !again {
                    tracing::error!(error = failed, %key, "cannot apply a shared {}", self.what);
                    return;
                }
                if tried == tries {
                    if !put_aside {
                        tracing::error!(error = failed, %key, "cannot apply a shared {} yet; it is tried again every {:?}", self.what, FAILED_APPLIED_AGAIN_EVERY);
                    }
                    self.failed.lock().insert(key.clone(), change.revision);
                    return;
                }
                tracing::warn!(error = failed, %key, "applying a shared {} again", self.what);
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
        })
    }

    fn apply_failed_again<'a>(
        &'a self,
        current: CurrentRecord<'a>,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
        Box::pin(async move {
            let put_aside: Vec<(String, Revision)> = (self.failed.lock().iter())
                .map(|(k, r)| (k.clone(), *r))
                .collect();
            for (key, revision) in put_aside {
                match current(key.clone()).await {
                    // Behind what failed here: left for the next time.
                    Ok(Some(change)) if change.revision < revision => {}
                    Ok(Some(change)) => self.apply(change).await,
                    // Nothing of it left in the fleet (a take's mark expired): removed.
                    Ok(None) => {
                        let (value, taken_here) = (None, false);
                        let removal = RecordChange {
                            key,
                            value,
                            revision,
                            taken_here,
                        };
                        self.apply(removal).await;
                    }
                    // The fleet did not answer: the next time.
                    Err(_) => return,
                }
            }
        })
    }
}

pub trait SharedRecords: Send + Sync {
    /// `table`'s record `key` as the fleet holds it now, or `Ok(None)` when there never was
    /// one.
    fn read<'a>(&'a self, table: &'a str, key: &'a str) -> RecordFuture<'a, Option<Record>>;

    /// Writes `value` as `table`'s record `key` if it is still as `expected`; its new
    /// revision. A write whose answer was lost is made again, and is `Ok` when either try
    /// is found to have landed. So `Unavailable` means it was not found to: it may still
    /// land. `Conflict` means another write came first — or, rarely, after a try that
    /// landed without its answer, which can then no longer be told.
    fn write<'a>(
        &'a self,
        table: &'a str,
        key: &'a str,
        value: bytes::Bytes,
        expected: Expect,
    ) -> RecordFuture<'a, Revision>;

    /// Writes each of `writes`, a key and its value, as `table`'s record `Expect::Unused`,
    /// sent one after another so that their revisions follow the order given (but for a
    /// write whose answer was lost, or that no stream leader answered, and that was made
    /// again) and answered together: many
    /// writes cost about one round trip, not one each. Each write's revision or error, in
    /// the same order; the whole is `Unavailable` when none could be sent.
    fn write_unused_in_order<'a>(
        &'a self,
        table: &'a str,
        writes: Vec<(String, bytes::Bytes)>,
    ) -> RecordFuture<'a, Vec<Result<Revision, RecordError>>>;

    /// Removes `table`'s record `key`.
    fn remove<'a>(&'a self, table: &'a str, key: &'a str) -> RecordFuture<'a, ()>;

    /// Takes `table`'s record `key` as written at `revision`, for this bridge alone: of
    /// bridges taking it at once, one does and the others get `Conflict`. The record is
    /// removed, and its key refuses `Expect::Unused` writes for a long while after (a
    /// message taken from an agent's mail is not kept for it again). Taking again what
    /// this bridge took already is `Ok` while its take's mark lives: a take whose answer
    /// never came is tried again.
    fn take<'a>(&'a self, table: &'a str, key: &'a str, revision: Revision)
    -> RecordFuture<'a, ()>;

    /// Writes `value` as `table`'s record `key` again over this bridge's take of it at
    /// `taken_at` (mail it took and could not deliver); `Conflict` unless the record's
    /// last change is that take.
    fn put_back<'a>(
        &'a self,
        table: &'a str,
        key: &'a str,
        value: bytes::Bytes,
        taken_at: Revision,
    ) -> RecordFuture<'a, Revision>;

    /// Keeps `bytes` as the fleet's file `name`: what is too large for a record (an
    /// attachment), written once and read by the bridges that need it.
    fn put_file<'a>(&'a self, name: &'a str, bytes: bytes::Bytes) -> RecordFuture<'a, ()>;

    /// The fleet's file `name`, or `Ok(None)` when it has none.
    fn file<'a>(&'a self, name: &'a str) -> RecordFuture<'a, Option<bytes::Bytes>>;

    /// Feeds `sink` every record of `table` as it is now, then every change, until the
    /// bridge stops. `table` is letters, digits and '-'.
    fn follow(&self, table: &'static str, sink: Arc<dyn RecordSink>);

    /// Whether the records can be reached now (connected, the buckets set up; a server
    /// that answers may still refuse a write). Work that could only try and put back
    /// what it took (a sweep of expired mail) waits while they cannot.
    fn reachable(&self) -> bool;

    /// Ends once the mail `bridge` kept for `agent` in `table` — an agent it held that now
    /// connected here (`Core::claim_move`) — is among the records this bridge follows:
    /// everything that bridge kept for it before it learned the agent moved. Taken after
    /// this, the agent's mail comes before anything sent to it live here since it
    /// connected, in the order sent. Bounded: a bridge that does not answer in time is
    /// not waited for past `by`.
    fn mail_handed_over<'a>(
        &'a self,
        agent: &'a str,
        bridge: &'a str,
        table: &'a str,
        by: tokio::time::Instant,
    ) -> Pin<Box<dyn Future<Output = HandOver> + Send + 'a>> {
        let _ = (agent, bridge, table, by);
        Box::pin(std::future::ready(HandOver::LetGo))
    }
}

/// How asking a bridge for the mail of an agent that left it ended
/// (`SharedRecords::mail_handed_over`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandOver {
    /// It let the agent go: it keeps no more of its mail, and what it kept is here.
    LetGo,
    /// It answered, or may be about to, still keeping the agent's mail.
    Kept,
    /// Nobody takes the question there: the bridge is not connected to the fleet (killed,
    /// or cut off), and will be taken for gone — or it is not taking questions yet
    /// (starting, or subscribing again after a reconnect), and is worth asking again.
    NoOneThere,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// An endpoint whose store fails its first `failing` applies.
    struct Flaky {
        failing: u32,
        tried: AtomicU32,
        applied: parking_lot::Mutex<Vec<Revision>>,
        /// Whether each change applied was a removal.
        removed: parking_lot::Mutex<Vec<bool>>,
    }

    fn change() -> RecordChange {
        RecordChange {
            key: "k".into(),
            value: None,
            revision: 1,
            taken_here: false,
        }
    }

    /// A failure, and whether it is worth trying again.
    struct Failed(&'static str, bool);

    impl std::fmt::Display for Failed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl ApplyError for Failed {
        fn worth_trying_again(&self) -> bool {
            self.1
        }
    }

    /// A sink whose store fails its first `failing` applies, and the revisions it applied.
    fn flaky_sink(failing: u32) -> (Arc<Flaky>, Arc<dyn RecordSink>) {
        let owner = Arc::new(Flaky {
            failing,
            tried: AtomicU32::new(0),
            applied: parking_lot::Mutex::default(),
            removed: parking_lot::Mutex::default(),
        });
        let sink = sink(
            &owner,
            "thing",
            |flaky: Arc<Flaky>, change: RecordChange| async move {
                let tried = flaky.tried.fetch_add(1, Ordering::Relaxed) + 1;
                if tried <= flaky.failing {
                    return Err(Failed("the disk is full", true));
                }
                flaky.applied.lock().push(change.revision);
                flaky.removed.lock().push(change.value.is_none());
                Ok(())
            },
        );
        (owner, sink)
    }

    async fn tries_of(failing: u32) -> u32 {
        let (owner, sink) = flaky_sink(failing);
        sink.apply(change()).await;
        owner.tried.load(Ordering::Relaxed)
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_the_store_failed_for_a_moment_is_applied_again() {
        assert_eq!(tries_of(0).await, 1);
        assert_eq!(tries_of(2).await, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_that_keeps_failing_is_put_aside_after_its_tries() {
        assert_eq!(tries_of(u32::MAX).await, APPLY_TRIES);
    }

    /// The fleet's records: each key's current change is at `revision`.
    fn fleet_at(
        revision: Revision,
    ) -> impl Fn(String) -> RecordFuture<'static, Option<RecordChange>> {
        move |key: String| {
            let change = RecordChange {
                key,
                revision,
                ..change()
            };
            Box::pin(std::future::ready(Ok(Some(change))))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_put_aside_is_applied_as_the_fleet_holds_it_once_the_store_takes_it() {
        let (owner, sink) = flaky_sink(APPLY_TRIES + 1);
        sink.apply(change()).await;
        // Once each time: the store is not back yet.
        sink.apply_failed_again(&fleet_at(2)).await;
        assert_eq!(owner.tried.load(Ordering::Relaxed), APPLY_TRIES + 1);
        assert!(owner.applied.lock().is_empty());
        sink.apply_failed_again(&fleet_at(3)).await;
        assert_eq!(*owner.applied.lock(), [3]);
        // Applied: not tried again.
        sink.apply_failed_again(&fleet_at(4)).await;
        assert_eq!(owner.tried.load(Ordering::Relaxed), APPLY_TRIES + 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_put_aside_and_changed_since_is_not_applied_again() {
        let (owner, sink) = flaky_sink(APPLY_TRIES);
        sink.apply(change()).await;
        let later = RecordChange {
            revision: 2,
            ..change()
        };
        sink.apply(later).await;
        sink.apply_failed_again(&fleet_at(2)).await;
        assert_eq!(*owner.applied.lock(), [2]);
        assert_eq!(owner.tried.load(Ordering::Relaxed), APPLY_TRIES + 1);
    }

    #[tokio::test(start_paused = true)]
    async fn records_put_aside_are_each_tried_once_a_time() {
        let (owner, sink) = flaky_sink(u32::MAX);
        for key in ["a", "b", "c"] {
            let change = RecordChange {
                key: key.into(),
                ..change()
            };
            sink.apply(change).await;
        }
        sink.apply_failed_again(&fleet_at(2)).await;
        assert_eq!(owner.tried.load(Ordering::Relaxed), 3 * APPLY_TRIES + 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_put_aside_is_not_applied_older_than_it_failed() {
        let (owner, sink) = flaky_sink(APPLY_TRIES);
        let failed = RecordChange {
            revision: 5,
            ..change()
        };
        sink.apply(failed).await;
        sink.apply_failed_again(&fleet_at(4)).await;
        assert_eq!(owner.tried.load(Ordering::Relaxed), APPLY_TRIES);
        sink.apply_failed_again(&fleet_at(5)).await;
        assert_eq!(*owner.applied.lock(), [5]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_put_aside_that_the_fleet_holds_nothing_of_is_removed() {
        let (owner, sink) = flaky_sink(APPLY_TRIES);
        sink.apply(RecordChange {
            value: Some(bytes::Bytes::from_static(b"{}")),
            ..change()
        })
        .await;
        let nothing = |_: String| -> RecordFuture<'static, Option<RecordChange>> {
            Box::pin(std::future::ready(Ok(None)))
        };
        sink.apply_failed_again(&nothing).await;
        assert_eq!(*owner.applied.lock(), [1]);
        assert_eq!(*owner.removed.lock(), [true]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_that_cannot_be_applied_is_not_tried_again() {
        let owner = Arc::new(Flaky {
            failing: u32::MAX,
            tried: AtomicU32::new(0),
            applied: parking_lot::Mutex::default(),
            removed: parking_lot::Mutex::default(),
        });
        let sink = sink(&owner, "thing", |flaky: Arc<Flaky>, _| async move {
            flaky.tried.fetch_add(1, Ordering::Relaxed);
            Err::<(), _>(Failed("not a record this bridge can read", false))
        });
        sink.apply(change()).await;
        sink.apply_failed_again(&fleet_at(2)).await;
        assert_eq!(owner.tried.load(Ordering::Relaxed), 1);
    }
}
