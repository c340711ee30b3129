//! Journal rounds: a stored message's record is appended to the journal under its lock,
//! and written with the others that came meanwhile by one task (a "round", one `write`
//! for all of them), outside the lock; the written round goes to the writer thread whole,
//! after those before it. `Unapplied` answers "is this id stored?" for what the journal
//! acknowledged and the database does not hold yet.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::oneshot;

use super::writer::JournaledRound;
use super::{Store, StoreError, journal, messages};

/// Most acknowledged messages the database may lack before new ones wait for it
/// (`Store::journal`). Flat out the writer falls behind for a moment now and then (a
/// checkpoint's fsync, its own backstop); a quarter of this, about 0.15 s of relaying, made
/// senders wait for it often enough to set the p99.9. This costs about 30 MiB at the peak.
/// Senders over it wait only until the backlog is back within it.
pub(super) const MAX_UNAPPLIED: usize = 65_536;

/// The journal's appending end, and the records waiting for its next round.
pub(super) struct JournalTail {
    pub(super) journal: journal::Journal,
    /// Whether rounds are being written (`Store::write_round`).
    pub(super) writing: bool,
    /// Whether a round's `write` is under way, the lock let go.
    pub(super) in_flight: bool,
    /// Messages whose records wait for the next round, in record order.
    pub(super) waiting: Vec<Waiting>,
}

/// The task writing the journal's rounds (`Store::journal`). Dropped before it is done
/// (its runtime shutting down, or a panic), it writes what waits itself: the rows' callers
/// would otherwise wait, and every later one queue behind them, for good.
pub(super) struct RoundTask {
    store: Store,
    finished: bool,
}

impl JournalTail {
    pub(super) fn new(journal: journal::Journal) -> Self {
        JournalTail {
            journal,
            writing: false,
            in_flight: false,
            waiting: Vec::new(),
        }
    }
}

impl RoundTask {
    /// No round waits: dropped now, the task writes none.
    fn finish(mut self) {
        self.finished = true;
    }

    /// Writes a round; whether another waits.
    fn write_one(&self) -> bool {
        // Every row has a caller waiting: no outcome is the task's own.
        let mut none = Ok(());
        self.store.write_round(self.store.lock_journal(), &mut none)
    }
}

impl Drop for RoundTask {
    fn drop(&mut self) {
        if !self.finished {
            while self.write_one() {}
        }
    }
}

/// A message whose record waits to be written.
pub(super) struct Waiting {
    id: Arc<str>,
    number: u64,
    /// Answered once the record is written; `None` for the caller writing.
    done: Option<oneshot::Sender<Result<(), StoreError>>>,
    /// Whether its caller also waits for the database: the writer is then woken for its
    /// round.
    hurry: bool,
}

impl Waiting {
    /// Tells the caller waiting for this row's write how it went; the writing caller's
    /// own outcome goes to `own`.
    fn answer(
        done: Option<oneshot::Sender<Result<(), StoreError>>>,
        outcome: Result<(), StoreError>,
        own: &mut Result<(), StoreError>,
    ) {
        match done {
            Some(done) => {
                let _ = done.send(outcome);
            }
            None => *own = outcome,
        }
    }
}

/// A journaled row's acknowledgements.
pub(super) struct Journaling {
    written: Written,
    /// When the writer is far behind: the record the database must hold before the caller
    /// goes on (`Backlog::reached`).
    wait_for: Option<u64>,
}

pub(super) enum Written {
    Now(Result<(), StoreError>),
    Later(oneshot::Receiver<Result<(), StoreError>>),
}

/// Messages the journal acknowledged that the database may not hold yet: each id with the
/// highest number of its records. The database holds every record through the writer's
/// `applied`, so an id is unapplied while that number is after it. (The highest, not the
/// last added: rounds can be added out of order, `add_unapplied` running after the
/// journal's lock is let go.)
///
/// Ids are not forgotten one by one as the writer passes them: that read each one's slot
/// again once it had gone cold, a cache miss a message. The map is swept of applied ids once it has
/// grown to twice what the last sweep left, at least [`Unapplied::SWEPT_AT_LEAST`].
#[derive(Default)]
pub(super) struct Unapplied {
    pub(super) by_id: foldhash::HashMap<Arc<str>, u64>,
    /// How many ids the last sweep left.
    swept_to: usize,
}

impl Unapplied {
    pub(super) const SWEPT_AT_LEAST: usize = 4096;

    pub(super) fn add(&mut self, id: Arc<str>, number: u64) {
        let highest = self.by_id.entry(id).or_insert(number);
        *highest = (*highest).max(number);
    }

    pub(super) fn contains(&self, id: &str, applied: u64) -> bool {
        self.by_id.get(id).is_some_and(|&highest| highest > applied)
    }

    /// Forgets the ids the database holds, all up to `applied`, once there may be as many
    /// of them as of the others.
    pub(super) fn sweep_if_grown(&mut self, applied: u64) {
        if self.by_id.len() > 2 * self.swept_to.max(Self::SWEPT_AT_LEAST) {
            self.by_id.retain(|_, highest| *highest > applied);
            self.swept_to = self.by_id.len();
        }
    }
}

impl Store {
    /// Writes the records waiting for a round whose task has not run yet, one round, as
    /// the store closes: the task's next finds the journal closed. (Those that came while
    /// a round was being written are not: their senders hear `Closed`.)
    pub(super) fn write_waiting_round(&self) {
        let tail = self.lock_journal();
        if tail
            .as_ref()
            .is_some_and(|state| !state.in_flight && !state.waiting.is_empty())
        {
            let mut none = Ok(());
            self.write_round(tail, &mut none);
        }
    }

    /// Stores the message `id` (its journal record, `messages::record`); the future
    /// resolves once it is durable: with a journal once its record is written, else once
    /// its batch commits.
    pub(super) fn queue_message(
        &self,
        id: &str,
        record: Vec<u8>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'static {
        use futures_util::future::Either;
        // Made before the lock is taken, as everything a record needs.
        let id: Arc<str> = id.into();
        let tail = self.lock_journal();
        if tail.is_none() {
            drop(tail);
            return Either::Left(self.write_unguarded_in_batch(move |batch| {
                messages::Row::decode(&record)
                    .ok_or_else(|| StoreError::Corrupt("a message's record does not read".into()))?
                    .insert(batch)
            }));
        }
        let Journaling { written, wait_for } = self.journal(tail, id, record);
        let backlog = self.inner.backlog.clone();
        Either::Right(async move {
            match written {
                Written::Now(outcome) => outcome?,
                Written::Later(written) => written.await.map_err(|_| StoreError::Closed)??,
            }
            match wait_for {
                Some(target) => backlog.reached(target).await,
                None => Ok(()),
            }
        })
    }

    /// Adds the message `id`'s record to the journal. When no one is writing the journal, a task of
    /// its own (outside a runtime, this caller) writes it with whatever others add
    /// meanwhile, outside the lock (`write_round`); otherwise the one writing takes it in
    /// its next round. The task runs once the calling task yields: blocking on the
    /// returned future on a runtime's thread (rather than awaiting it) would wait for good.
    /// A caller waiting for a write blocks no thread: with the lock held over each `write`,
    /// runtime threads queued on it behind one the scheduler or the filesystem held up
    /// (the p99.9 flat out).
    /// While the writer is `MAX_UNAPPLIED` messages behind, the caller also waits until it
    /// is back within that (not until the database holds this very message: under a load
    /// the writer cannot keep up with, every message then waited for the whole backlog),
    /// so that the backlog stays bounded.
    pub(super) fn journal<'s>(
        &'s self,
        mut tail: parking_lot::MutexGuard<'s, Option<JournalTail>>,
        id: Arc<str>,
        record: Vec<u8>,
    ) -> Journaling {
        let Some(state) = tail.as_mut() else {
            return Journaling {
                written: Written::Now(Err(StoreError::Closed)),
                wait_for: None,
            };
        };
        let applied = self.inner.backlog.applied.load(Ordering::Acquire);
        // Only segments whose records a checkpoint has synced into the database go.
        let durable = self.inner.backlog.durable.load(Ordering::Acquire);
        journal::remove_segments(state.journal.take_applied(durable));
        let number = state.journal.record(|buf| buf.extend_from_slice(&record));
        // Over the limit, the record whose being applied brings the backlog back within it.
        let wait_for = number
            .checked_sub(MAX_UNAPPLIED as u64)
            .filter(|&target| target > applied);
        let hurry = wait_for.is_some();
        // The caller that finds no round in flight has one written: on a runtime by a task
        // of its own, which the runtime runs on this thread right after the current task
        // (its LIFO slot). By then this connection has read the other frames its socket
        // had ready, and others on this thread theirs, and one `write` takes all of their
        // records (flat out, 0.9 `write`s a message when the caller wrote at once).
        let leads = !state.writing;
        state.writing = true;
        let runtime = match leads.then(tokio::runtime::Handle::try_current) {
            None => None,
            Some(Ok(runtime)) => Some(runtime),
            Some(Err(_)) => {
                // Outside a runtime, this caller writes it.
                state.waiting.push(Waiting {
                    id,
                    number,
                    done: None,
                    hurry,
                });
                return Journaling {
                    written: Written::Now(self.write_rounds(tail)),
                    wait_for,
                };
            }
        };
        let (done, written) = oneshot::channel();
        state.waiting.push(Waiting {
            id,
            number,
            done: Some(done),
            hurry,
        });
        drop(tail);
        if let Some(runtime) = runtime {
            let rounds = RoundTask {
                store: self.clone(),
                finished: false,
            };
            runtime.spawn(async move {
                while rounds.write_one() {
                    // Others run before the next round, adding to it; nor is this thread
                    // held for as long as records keep coming.
                    tokio::task::yield_now().await;
                }
                rounds.finish();
            });
        }
        Journaling {
            written: Written::Later(written),
            wait_for,
        }
    }

    /// Writes the journal's records in rounds until none is left, the lock let go during
    /// each write. Returns this caller's own outcome (its record is in the first round).
    pub(super) fn write_rounds<'s>(
        &'s self,
        mut tail: parking_lot::MutexGuard<'s, Option<JournalTail>>,
    ) -> Result<(), StoreError> {
        let mut own = Err(StoreError::Closed);
        while self.write_round(tail, &mut own) {
            tail = self.lock_journal();
        }
        own
    }

    /// Writes the records waiting for a round, the lock let go during the `write`; hands
    /// the written round to the writer, after those before it, and answers the callers
    /// waiting for it (the writing caller's own outcome goes to `own`). Returns whether more
    /// records came meanwhile: the caller then writes the next round, still `writing`.
    pub(super) fn write_round(
        &self,
        tail: parking_lot::MutexGuard<'_, Option<JournalTail>>,
        own: &mut Result<(), StoreError>,
    ) -> bool {
        let mut tail = tail;
        let Some(state) = tail.as_mut() else {
            return false;
        };
        if state.in_flight {
            // `close` is writing a round beside the task: a second round at once would
            // append concurrently and could hand its rows to the writer first. What came
            // meanwhile is refused when the journal closes, as `close` says.
            return false;
        }
        if state.waiting.is_empty() {
            state.writing = false;
            return false;
        }
        let taken = std::mem::take(&mut state.waiting);
        let round = state.journal.take_round();
        state.in_flight = true;
        drop(tail);
        let written = round.write();
        // The callers are answered after the lock is let go (waking a task on another
        // thread can take a syscall): it is held only to hand the round on in record
        // order. Contended, it put runtime threads to sleep on its futex.
        let hurry = taken.iter().any(|waiting| waiting.hurry);
        let mut answers = Vec::with_capacity(taken.len());
        let mut ids = Vec::with_capacity(taken.len());
        for waiting in taken {
            answers.push(waiting.done);
            ids.push((waiting.id, waiting.number));
        }
        let mut tail = self.lock_journal();
        let Some(state) = tail.as_mut() else {
            drop(tail);
            // Closed meanwhile. Written, the records are durable and go into the
            // database at the next start; else they are cut off, and their senders told.
            let written = written.is_ok();
            if !written {
                round.cut();
            }
            for done in answers {
                let outcome = if written {
                    Ok(())
                } else {
                    Err(StoreError::Closed)
                };
                Waiting::answer(done, outcome, own);
            }
            return false;
        };
        state.in_flight = false;
        let (submitted, failed) = match state.journal.end_round(round, written) {
            Ok(records) => {
                let (_, last) = *ids.last().expect("a round written has records");
                self.inner.backlog.journaled.store(last, Ordering::Release);
                let rows = ids.len();
                let round = Box::new(JournaledRound {
                    records,
                    rows,
                    last,
                });
                // The writer is woken only when a caller waits for the database
                // (`Store::journal`): otherwise it gathers until `GATHER` is up.
                (self.submit(round, hurry), None)
            }
            Err(e) => (Ok(()), Some((state.journal.path().to_owned(), e))),
        };
        let more = !state.waiting.is_empty();
        if !more {
            state.writing = false;
        }
        drop(tail);
        match &failed {
            // Before their callers hear of it.
            None => self.add_unapplied(ids),
            Some((_, e)) => tracing::error!(error = %e, "store: cannot write the journal"),
        }
        for done in answers {
            let outcome = match (&failed, &submitted) {
                (Some((path, e)), _) => Err(StoreError::Journal {
                    path: path.clone(),
                    source: std::io::Error::new(e.kind(), e.to_string()),
                }),
                (None, Err(_)) => Err(StoreError::Closed),
                (None, Ok(())) => Ok(()),
            };
            Waiting::answer(done, outcome, own);
        }
        more
    }

    pub(super) fn lock_journal(&self) -> parking_lot::MutexGuard<'_, Option<JournalTail>> {
        self.inner.journal.lock()
    }

    /// Whether `id` is a message the journal acknowledged and the database does not hold yet.
    pub(super) fn is_unapplied(&self, id: &str) -> bool {
        let applied = self.inner.backlog.applied.load(Ordering::Acquire);
        self.lock_unapplied().contains(id, applied)
    }

    /// Adds a written round's messages (ids and record numbers) to those not yet applied.
    pub(super) fn add_unapplied(&self, ids: Vec<(Arc<str>, u64)>) {
        let applied = self.inner.backlog.applied.load(Ordering::Acquire);
        let mut unapplied = self.lock_unapplied();
        for (id, number) in ids {
            unapplied.add(id, number);
        }
        unapplied.sweep_if_grown(applied);
    }

    pub(super) fn lock_unapplied(&self) -> parking_lot::MutexGuard<'_, Unapplied> {
        self.inner.unapplied.lock()
    }
}
