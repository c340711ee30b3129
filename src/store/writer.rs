//! The writer thread: the only writing connection, at a lower priority than the runtime's
//! threads. It gathers queued work (journal rounds for up to `GATHER`, other writes as
//! they come) into one transaction, each write in its own savepoint unless it cannot fail
//! half-way, and answers every caller once the shared `COMMIT` returned (group commit).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use rusqlite::Connection;
use tokio::sync::{Notify, oneshot};

use super::batch::Batch;
use super::priority::lower_priority;
use super::{StoreError, checkpoint, journal, messages};
use crate::telemetry;

/// Rows written together in one transaction, at most: the writer stops gathering at this
/// many. (A journal round is one job, never split: a batch can go over by one round.)
pub(super) const MAX_BATCH: usize = 512;

/// Longest the writer waits for more acknowledged messages before it commits (`gather`).
pub(super) const GATHER: std::time::Duration = std::time::Duration::from_millis(10);

/// Acknowledged messages put in the database in one transaction: the writer stops
/// gathering at this many (and goes over by at most one round, as `MAX_BATCH`).
pub(super) const MAX_GATHERED: usize = 4096;

/// Rows the writer writes between two `sched_yield`s while it keeps up. A waking thread
/// does not preempt one that has not run its slice (1.5 ms on two cores), nice 10 or not:
/// a batch of hundreds of messages would hold a core that deliveries wait for.
pub(super) const YIELD_EVERY: usize = 16;

/// Journaled messages the database may lack while the writer still counts as keeping up.
pub(super) const KEEPING_UP: usize = 2048;

pub(super) trait Job: Send {
    /// Whether the work runs in a savepoint of its own.
    fn savepoint(&self) -> bool;
    /// Runs the work; false when it failed (and its savepoint must be rolled back).
    fn run(&mut self, batch: &mut Batch<'_>) -> bool;
    /// Whether the work failed with a constraint violation (which SQLite undoes by
    /// itself, statement by statement).
    fn failed_on_constraint(&self) -> bool;
    /// Answers the caller once the batch's commit is known.
    fn finish(self: Box<Self>, committed: Result<(), &rusqlite::Error>);
    /// For messages the journal acknowledged: the number of the last one's record. Such
    /// work must reach the database; a batch it fails in is retried until it does.
    fn journaled_up_to(&self) -> Option<u64> {
        None
    }
    /// Whether the writer may wait for more work before committing this (`gather`).
    fn gathers(&self) -> bool {
        false
    }
    /// A journal round, which the writer may join to the one before it (`join_round`).
    fn as_round(&mut self) -> Option<&mut JournaledRound> {
        None
    }
    /// The rows it writes, as the writer counts them (`gather`, checkpoints).
    fn rows(&self) -> usize {
        1
    }
}

/// Called on the writer's thread with a write's result once its batch committed, before
/// its caller hears: in the order the writes committed (`Store::write_then`).
pub(super) type Committed<R> = Box<dyn FnOnce(&R) + Send>;

pub(super) struct WriteJob<F, R> {
    work: Option<F>,
    savepoint: bool,
    outcome: Option<Result<R, StoreError>>,
    reply: Option<oneshot::Sender<Result<R, StoreError>>>,
    committed: Option<Committed<R>>,
}

impl<F, R> WriteJob<F, R> {
    pub(super) fn new(
        work: F,
        savepoint: bool,
        reply: oneshot::Sender<Result<R, StoreError>>,
        committed: Option<Committed<R>>,
    ) -> Self {
        WriteJob {
            work: Some(work),
            savepoint,
            outcome: None,
            reply: Some(reply),
            committed,
        }
    }
}

impl<F, R> Job for WriteJob<F, R>
where
    R: Send + 'static,
    F: FnOnce(&mut Batch<'_>) -> Result<R, StoreError> + Send + 'static,
{
    fn savepoint(&self) -> bool {
        self.savepoint
    }

    fn run(&mut self, batch: &mut Batch<'_>) -> bool {
        let Some(work) = self.work.take() else {
            return false;
        };
        batch.pace(1);
        let outcome = work(batch);
        let ok = outcome.is_ok();
        self.outcome = Some(outcome);
        ok
    }

    fn failed_on_constraint(&self) -> bool {
        matches!(&self.outcome, Some(Err(e)) if e.broke_a_constraint())
    }

    fn finish(mut self: Box<Self>, committed: Result<(), &rusqlite::Error>) {
        let outcome = match (self.outcome.take(), committed) {
            (Some(Ok(value)), Ok(())) => {
                if let Some(committed) = self.committed.take() {
                    committed(&value);
                }
                Ok(value)
            }
            (Some(Err(e)), _) => Err(e),
            // Ran and succeeded, or never ran, in a batch that was not committed.
            (_, Err(e)) => Err(StoreError::Corrupt(format!("commit failed: {e}"))),
            (None, Ok(())) => Err(StoreError::Closed),
        };
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(outcome);
        }
    }
}

/// How far the writer is behind the journal: the numbers of the last journal record the
/// database holds (`applied`, moved on by the writer) and of the last one written
/// (`journaled`, by `Store::write_round`). Without a journal both stay 0.
#[derive(Clone, Default)]
pub(super) struct Backlog {
    pub(super) applied: Arc<AtomicU64>,
    /// Of `applied`, what a checkpoint has synced (`checkpoint::Synced`).
    pub(super) durable: Arc<AtomicU64>,
    pub(super) journaled: Arc<AtomicU64>,
    /// Told each time `applied` moves on, and when the writer stops.
    moved: Arc<Notify>,
    stopped: Arc<AtomicBool>,
}

impl Backlog {
    /// The database holds every record up to `last`, the last one written.
    pub(super) fn start_after(&self, last: u64) {
        self.applied.store(last, Ordering::Release);
        self.durable.store(last, Ordering::Release);
        self.journaled.store(last, Ordering::Release);
    }

    /// Journaled messages the database lacks.
    pub(super) fn behind(&self) -> u64 {
        let journaled = self.journaled.load(Ordering::Acquire);
        journaled.saturating_sub(self.applied.load(Ordering::Acquire))
    }

    /// Moves `applied` on to `last` (the writer, after a commit).
    pub(super) fn applied_through(&self, last: u64) {
        self.applied.fetch_max(last, Ordering::Release);
        self.moved.notify_waiters();
    }

    /// The writer has stopped: no one waits for it any longer.
    pub(super) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        self.moved.notify_waiters();
    }

    /// Once the database holds record `target`; `Closed` if the writer stops first.
    pub(super) async fn reached(&self, target: u64) -> Result<(), StoreError> {
        loop {
            // Listening before looking, so that a move in between is not missed.
            let moved = self.moved.notified();
            let mut moved = std::pin::pin!(moved);
            moved.as_mut().enable();
            if self.applied.load(Ordering::Acquire) >= target {
                return Ok(());
            }
            if self.stopped.load(Ordering::Acquire) {
                return Err(StoreError::Closed);
            }
            moved.await;
        }
    }

    /// Whether the writer keeps up: then it gives way to other threads as it goes
    /// (`YIELD_EVERY`); behind, it does not, or it would fall further behind until senders
    /// wait for it (yielding always, flat out, set the p99.9).
    pub(super) fn keeping_up(&self) -> bool {
        self.behind() < KEEPING_UP as u64
    }
}

pub(super) fn write_loop(
    conn: Connection,
    jobs: mpsc::Receiver<Box<dyn Job>>,
    mut committed: Option<checkpoint::Committed>,
    backlog: &Backlog,
) {
    lower_priority();
    // However the loop ends, those waiting for the database hear that it will not move.
    struct StopOnExit<'a>(&'a Backlog);
    impl Drop for StopOnExit<'_> {
        fn drop(&mut self) {
            self.0.stop();
        }
    }
    let _stop = StopOnExit(backlog);
    let mut batch: Vec<Box<dyn Job>> = Vec::with_capacity(MAX_BATCH);
    let mut last_commit = Instant::now();
    while let Ok(first) = jobs.recv() {
        batch.push(first);
        gather(&jobs, &mut batch, last_commit + GATHER);
        let started = Instant::now();
        last_commit = started;
        let yield_every = backlog.keeping_up().then_some(YIELD_EVERY);
        let mut outcome = run_batch(&conn, &mut batch, yield_every);
        telemetry::store_write(started.elapsed(), rows_in(&batch));
        if let Err(e) = &outcome {
            tracing::error!(error = %e, "store commit failed");
            if batch.iter().any(|job| job.journaled_up_to().is_some()) {
                // Their callers hear of the failure; messages the journal acknowledged
                // must still reach the database, and go in again on their own.
                let (journaled, others): (Vec<_>, Vec<_>) = batch
                    .drain(..)
                    .partition(|job| job.journaled_up_to().is_some());
                for job in others {
                    job.finish(Err(e));
                }
                batch = journaled;
                outcome = Ok(retry(&conn, &mut batch));
            }
        }
        if let Ok(applied) = &outcome {
            // Moved on before anyone hears of the commit, so that their reads wait for
            // nothing it holds.
            if let Some(last) = applied {
                backlog.applied_through(*last);
            }
            if let Some(committed) = &mut committed {
                // After a failed commit, only what `retry` put in.
                committed.notify(rows_in(&batch));
            }
        }
        for job in batch.drain(..) {
            job.finish(outcome.as_ref().map(|_| ()));
        }
    }
}

pub(super) fn rows_in(batch: &[Box<dyn Job>]) -> usize {
    batch.iter().map(|job| job.rows()).sum()
}

/// Fills `batch` with what is queued. While it holds only messages the journal
/// acknowledged, it waits for more until `deadline`, to put them in together: each commit
/// writes every page it changed to the log again, and small commits wrote the same
/// half-filled pages over and over. The wait is a `park`, which a message queued does not
/// end (no wake-up per message); anyone else's write, or a read's wait, ends it.
pub(super) fn gather(
    jobs: &mpsc::Receiver<Box<dyn Job>>,
    batch: &mut Vec<Box<dyn Job>>,
    deadline: Instant,
) {
    let mut waits = batch.iter().all(|job| job.gathers());
    let mut rows = rows_in(batch);
    loop {
        let limit = if waits { MAX_GATHERED } else { MAX_BATCH };
        while rows < limit {
            match jobs.try_recv() {
                Ok(mut job) => {
                    waits &= job.gathers();
                    rows += job.rows();
                    if !join_round(batch, &mut *job) {
                        batch.push(job);
                    }
                }
                Err(mpsc::TryRecvError::Empty) => break,
                // The store is closing: commit what there is.
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        if !waits || rows >= MAX_GATHERED {
            return;
        }
        match deadline.checked_duration_since(Instant::now()) {
            Some(left) => std::thread::park_timeout(left),
            None => return,
        }
    }
}

/// Joins `job`, when it is a journal round, to the round last in `batch` while both fill
/// less than one statement (`messages::ROWS_PER_STATEMENT`): rounds of a message or two (a
/// few thousand a second) go in many to a statement too, and a large round is not copied.
/// Whether it did.
pub(super) fn join_round(batch: &mut [Box<dyn Job>], job: &mut dyn Job) -> bool {
    let Some(last) = batch.last_mut().and_then(|last| last.as_round()) else {
        return false;
    };
    match job.as_round() {
        Some(next)
            if last.rows < messages::ROWS_PER_STATEMENT
                && next.rows < messages::ROWS_PER_STATEMENT =>
        {
            last.records.extend_from_slice(&next.records);
            last.rows += next.rows;
            last.last = next.last;
            true
        }
        _ => false,
    }
}

/// Runs a batch of acknowledged messages until it commits: a failure here is the disk's
/// or the database's (full, unwritable), and waiting is all the writer can do. Meanwhile
/// the journal keeps them, and later writes and reads wait behind them.
pub(super) fn retry(conn: &Connection, batch: &mut [Box<dyn Job>]) -> Option<u64> {
    let mut wait = std::time::Duration::from_millis(100);
    loop {
        std::thread::sleep(wait);
        match run_batch(conn, batch, None) {
            Ok(applied) => return applied,
            Err(e) => {
                tracing::error!(error = %e, "store: acknowledged messages still cannot be put in the database; retrying")
            }
        }
        wait = (wait * 2).min(std::time::Duration::from_secs(5));
    }
}

/// Runs a batch in one transaction; on any error nothing of it is committed. Returns the
/// number of the last journal record it put in, if it held any.
pub(super) fn run_batch(
    conn: &Connection,
    jobs: &mut [Box<dyn Job>],
    yield_every: Option<usize>,
) -> Result<Option<u64>, rusqlite::Error> {
    // The batch's statements (its own and its writes') are let go before a rollback.
    let applied = jobs.iter().filter_map(|job| job.journaled_up_to()).max();
    let outcome = {
        let mut batch = Batch::new(conn, yield_every);
        batch
            .exec("BEGIN IMMEDIATE")
            .and_then(|()| run_jobs(&mut batch, jobs))
            .and_then(|()| match applied {
                Some(last) => batch
                    .statement(messages::SET_APPLIED)?
                    .execute([last as i64])
                    .map(|_| ()),
                None => Ok(()),
            })
            .and_then(|()| batch.exec("COMMIT"))
    };
    if outcome.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    outcome.map(|()| applied)
}

pub(super) fn run_jobs(
    batch: &mut Batch<'_>,
    jobs: &mut [Box<dyn Job>],
) -> Result<(), rusqlite::Error> {
    let conn = batch.conn();
    for job in jobs.iter_mut() {
        if !job.savepoint() {
            // A failed constraint undid its own statement; any other failure may have left
            // part of the work behind, or ended the transaction (later work must then not
            // run in autocommit): the batch fails whole.
            if !job.run(batch) && (conn.is_autocommit() || !job.failed_on_constraint()) {
                return Err(rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ABORT),
                    Some("a write without a savepoint failed; the batch is rolled back".into()),
                ));
            }
            continue;
        }
        batch.exec("SAVEPOINT job")?;
        if job.run(batch) {
            batch.exec("RELEASE job")?;
        } else {
            batch.exec("ROLLBACK TO job")?;
            batch.exec("RELEASE job")?;
        }
    }
    Ok(())
}

/// A round of messages the journal acknowledged, for the writer to put in the database:
/// the round's own buffer, as written (one job and one free a round, not a row of owned
/// texts per message), or a few small rounds' joined (`join_round`).
pub(super) struct JournaledRound {
    pub(super) records: Vec<u8>,
    pub(super) rows: usize,
    /// The number of its last record.
    pub(super) last: u64,
}

impl Job for JournaledRound {
    fn savepoint(&self) -> bool {
        false
    }

    fn run(&mut self, batch: &mut Batch<'_>) -> bool {
        let rows = journal::written_records(&self.records).filter_map(|(number, payload)| {
            let row = messages::Row::decode(payload);
            debug_assert!(row.is_some(), "record {number} does not read");
            if row.is_none() {
                // Never: `messages::record` wrote it in this process.
                tracing::error!(
                    number,
                    "store: a journal record does not read; it is left out"
                );
            }
            row
        });
        // A failure of the disk's fails the batch, to be retried (`write_loop`); one of a
        // message's own leaves it out, so that it does not hold up all the others.
        messages::put_journaled_in(&rows.collect::<Vec<_>>(), batch).is_ok()
    }

    fn rows(&self) -> usize {
        self.rows
    }

    fn failed_on_constraint(&self) -> bool {
        false
    }

    fn gathers(&self) -> bool {
        // Even when one of its callers waits: it waits for an older record, far ahead of
        // this round in the writer's queue, and a writer that far behind catches up sooner
        // in large commits.
        true
    }

    fn journaled_up_to(&self) -> Option<u64> {
        Some(self.last)
    }

    fn as_round(&mut self) -> Option<&mut JournaledRound> {
        Some(self)
    }

    fn finish(self: Box<Self>, _committed: Result<(), &rusqlite::Error>) {
        // Its callers heard once it was journaled; those waiting for the database, from
        // `write_loop` moving `Backlog::applied` on.
    }
}
