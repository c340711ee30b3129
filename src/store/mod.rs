//! Embedded SQLite, kept off the async worker threads.
//!
//! One dedicated thread owns the only writing connection. Writes queue up while a
//! transaction commits and then go in together (group commit): each write runs inside its
//! own savepoint, so one failing write does not undo its neighbours (writes that cannot
//! fail half-way skip it: `write_unguarded`), and every caller is answered only after the
//! shared `COMMIT` returned. WAL checkpoints run on a thread of their own (checkpoint.rs).
//! Reads use a small pool of read-only connections on `spawn_blocking` threads (WAL lets
//! them run beside the writer); an in-memory database has one connection, so there reads
//! queue with the writes.
//!
//! With a database file, a stored message is written to the journal (journal.rs) on a
//! runtime thread, with the others queued meanwhile, and is durable once that `write`
//! returns: no other thread is waited for.
//! The writer puts it in the database afterwards, with the messages of the next few
//! milliseconds in one transaction, in the order they were journaled and in their place
//! among the other writes. Reads wait for the writer to put in what was acknowledged
//! before them, so they see what they saw before the journal.
//!
//! Each component owns its tables and brings its own migrations (`Store::migrate`); the
//! store itself only knows how to run them once, in order.

mod checkpoint;
mod journal;
mod log;
mod message_body;
mod messages;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rusqlite::Connection;
use tokio::sync::{Notify, oneshot};

use crate::telemetry;

/// Name of the database file inside `data_dir`.
pub const DB_FILE: &str = "agentbridge.db";
/// The `data_dir` value that keeps everything in memory (tests).
pub const IN_MEMORY: &str = ":memory:";

/// Rows written together in one transaction, at most: the writer stops gathering at this
/// many. (A journal round is one job, never split: a batch can go over by one round.)
const MAX_BATCH: usize = 512;
/// Longest the writer waits for more acknowledged messages before it commits (`gather`).
const GATHER: std::time::Duration = std::time::Duration::from_millis(10);
/// Acknowledged messages put in the database in one transaction: the writer stops
/// gathering at this many (and goes over by at most one round, as `MAX_BATCH`).
const MAX_GATHERED: usize = 4096;
/// Most acknowledged messages the database may lack before new ones wait for it
/// (`Store::journal`). Flat out the writer falls behind for a moment now and then (a
/// checkpoint's fsync, its own backstop): at 16,384, about 0.15 s of relaying, senders
/// waited for it often enough to make the p99.9 60–75 ms; at 65,536 (and waiting only
/// until the backlog is back within it), 11–13 ms, for about 30 MiB more at the peak
/// (BENCHMARKS.md, *Ninth pass*).
const MAX_UNAPPLIED: usize = 65_536;
/// Rows the writer writes between two `sched_yield`s while it keeps up. A waking thread
/// does not preempt one that has not run its slice (1.5 ms on two cores), nice 10 or not:
/// a batch of hundreds of messages would hold a core that deliveries wait for.
const YIELD_EVERY: usize = 16;
/// Journaled messages the database may lack while the writer still counts as keeping up.
const KEEPING_UP: usize = 2048;
/// Most read-only connections kept open.
const MAX_READERS: usize = 4;
/// A new database's page size. A message's row and index entries take about 700 bytes;
/// with 16 KiB pages rather than SQLite's 4 KiB, a batch writes a quarter as many log
/// frames (each two `pwrite`s and a checksum) and splits pages a quarter as often, and
/// the checkpoints copy fewer: flat out, 0.5–1.2 µs less CPU a message, most of it in
/// the kernel (BENCHMARKS.md, *Eighth pass*). An in-memory store keeps SQLite's default.
const PAGE_BYTES: u32 = 16384;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot use data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open database {path}: {source}")]
    Open {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("the store is closed")]
    Closed,
    #[error("cannot write the journal {path}: {source}")]
    Journal {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the database was written by a newer agentbridge: {component} schema version {found}, this build knows up to {known}"
    )]
    TooNew {
        component: &'static str,
        found: u32,
        known: u32,
    },
    #[error(transparent)]
    Log(Box<dyn std::error::Error + Send + Sync>),
}

/// One migration step of one component. Versions start at 1 and only ever grow.
pub struct Migration {
    pub version: u32,
    pub sql: &'static str,
}

#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    writer: Mutex<Option<mpsc::Sender<Box<dyn Job>>>>,
    /// The writer thread, woken by work that must not wait for `GATHER`.
    writer_wake: std::thread::Thread,
    /// A file's journal, once it runs (`start_journal`). Writes go to it under this lock:
    /// a `write` of a few hundred bytes to the page cache, never across an `.await`. Only
    /// callers take it, never the writer: a writer thread at low priority holding a lock
    /// that deliveries wait for stalled them for 5–10 ms at a time.
    journal: Mutex<Option<JournalTail>>,
    /// The messages the journal acknowledged that the database may not hold yet, for
    /// `has_message`: under a lock of their own, which the task writing rounds takes once
    /// a round (and `has_message` once a call), rather than under the journal's, which
    /// every message takes (forgetting the applied ones misses the caches).
    unapplied: Mutex<Unapplied>,
    /// How far the database is behind the journal.
    backlog: Backlog,
    writer_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// For a database file; an in-memory one has no log to checkpoint.
    checkpointer: Mutex<Option<checkpoint::Checkpointer>>,
    readers: Option<ReaderPool>,
}

impl Store {
    /// Opens (creating when needed) the database in `data_dir`, or an in-memory one for
    /// `":memory:"`, and applies the core's migrations.
    pub async fn open(data_dir: &str) -> Result<Store, StoreError> {
        let in_memory = data_dir == IN_MEMORY;
        let (conn, readers, checkpoints) = if in_memory {
            let conn = Connection::open_in_memory().map_err(|source| StoreError::Open {
                path: IN_MEMORY.into(),
                source,
            })?;
            (conn, None, None)
        } else {
            let dir = PathBuf::from(data_dir);
            let path = dir.join(DB_FILE);
            tokio::task::spawn_blocking(move || open_file(&dir, &path))
                .await
                .map_err(|_| StoreError::Closed)??
        };
        configure(&conn)?;
        let (checkpointer, committed) = checkpoints.unzip();
        let (tx, rx) = mpsc::channel::<Box<dyn Job>>();
        let backlog = Backlog::default();
        let writers_backlog = backlog.clone();
        let thread = std::thread::Builder::new()
            // The kernel keeps 15 bytes of a thread's name (what top, perf and /proc show).
            .name("store-writer".into())
            .spawn(move || write_loop(conn, rx, committed, &writers_backlog))
            .map_err(|e| StoreError::DataDir {
                path: data_dir.into(),
                source: e,
            })?;
        let store = Store {
            inner: Arc::new(Inner {
                writer: Mutex::new(Some(tx)),
                writer_wake: thread.thread().clone(),
                journal: Mutex::new(None),
                unapplied: Mutex::default(),
                backlog,
                writer_thread: Mutex::new(Some(thread)),
                checkpointer: Mutex::new(checkpointer),
                readers,
            }),
        };
        store.migrate("core", messages::MIGRATIONS).await?;
        if !in_memory {
            store
                .start_journal(Path::new(data_dir).join(journal::DIR))
                .await?;
        }
        Ok(store)
    }

    /// Puts in the messages the journal in `dir` holds and the database does not (those a
    /// killed bridge acknowledged), and starts the journal anew for the messages to come.
    async fn start_journal(&self, dir: PathBuf) -> Result<(), StoreError> {
        let recovering = dir.clone();
        let (next, segments) = self
            .write_unguarded_in_batch(move |batch| messages::recover(batch, &recovering))
            .await?;
        // The database holds every record now; the old segments can go.
        let journal = tokio::task::spawn_blocking(move || {
            for segment in &segments {
                match std::fs::remove_file(segment) {
                    // Applied before a close in this process, and removed since.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    removed => removed.map_err(|source| StoreError::Journal {
                        path: segment.clone(),
                        source,
                    })?,
                }
            }
            journal::Journal::create(&dir, next)
                .map_err(|source| StoreError::Journal { path: dir, source })
        })
        .await
        .map_err(|_| StoreError::Closed)??;
        self.inner.backlog.start_after(next - 1);
        *self.lock_journal() = Some(JournalTail {
            journal,
            writing: false,
            in_flight: false,
            waiting: Vec::new(),
        });
        Ok(())
    }

    /// Applies `component`'s migrations that have not run yet, each in its own transaction.
    /// A database a newer build has migrated further is refused: this build may not read
    /// what that one wrote.
    pub async fn migrate(
        &self,
        component: &'static str,
        steps: &'static [Migration],
    ) -> Result<(), StoreError> {
        self.write(move |conn| {
            conn.execute_batch(
                "CREATE TABLE IF NOT EXISTS schema_migrations (
                    component TEXT NOT NULL,
                    version INTEGER NOT NULL,
                    applied_at INTEGER NOT NULL,
                    PRIMARY KEY (component, version)
                ) WITHOUT ROWID;",
            )?;
            let applied: u32 = conn.query_row(
                "SELECT COALESCE(MAX(version), 0) FROM schema_migrations WHERE component = ?1",
                [component],
                |row| row.get(0),
            )?;
            let known = steps.iter().map(|s| s.version).max().unwrap_or(0);
            if applied > known {
                return Err(StoreError::TooNew {
                    component,
                    found: applied,
                    known,
                });
            }
            for step in steps.iter().filter(|s| s.version > applied) {
                conn.execute_batch(step.sql)?;
                conn.execute(
                    "INSERT INTO schema_migrations (component, version, applied_at) VALUES (?1, ?2, ?3)",
                    rusqlite::params![component, step.version, crate::core::now_ms()],
                )?;
            }
            Ok(())
        })
        .await
    }

    /// Queues `f` for the writing connection now, in call order, batched with other writes
    /// into one commit; the returned future resolves once that commit is durable. Queuing
    /// at the call (not at the first poll) lets a caller keep several writes in flight and
    /// know they commit in the order it made them.
    pub fn write<R, F>(&self, f: F) -> impl Future<Output = Result<R, StoreError>> + Send + 'static
    where
        R: Send + 'static,
        F: FnOnce(&Connection) -> Result<R, StoreError> + Send + 'static,
    {
        self.queue(move |batch: &mut Batch<'_>| f(batch.conn), true)
    }

    /// Like `write`, without the savepoint that keeps a failed write from undoing part of
    /// its batch: for work that can fail on its data only in its first statement, with a
    /// constraint violation, which SQLite undoes by itself. Any other failure (out of
    /// memory or disk, I/O) may have left part of the work behind, so it fails the whole
    /// batch: nothing in it is committed and every caller hears the error. A savepoint
    /// copies every page the write touches that the batch already changed; for a stored
    /// message that was a sixth of the bridge's cost.
    pub fn write_unguarded<R, F>(
        &self,
        f: F,
    ) -> impl Future<Output = Result<R, StoreError>> + Send + 'static
    where
        R: Send + 'static,
        F: FnOnce(&Connection) -> Result<R, StoreError> + Send + 'static,
    {
        self.queue(move |batch: &mut Batch<'_>| f(batch.conn), false)
    }

    /// Like `write_unguarded`, for work that runs the same statements every time (a stored
    /// message): they stay prepared, taken from rusqlite's cache once per batch.
    fn write_unguarded_in_batch<R, F>(
        &self,
        f: F,
    ) -> impl Future<Output = Result<R, StoreError>> + Send + 'static
    where
        R: Send + 'static,
        F: FnOnce(&mut Batch<'_>) -> Result<R, StoreError> + Send + 'static,
    {
        self.queue(f, false)
    }

    fn queue<R, F>(
        &self,
        f: F,
        savepoint: bool,
    ) -> impl Future<Output = Result<R, StoreError>> + Send + 'static
    where
        R: Send + 'static,
        F: FnOnce(&mut Batch<'_>) -> Result<R, StoreError> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let queued = self.submit(
            Box::new(WriteJob {
                work: Some(f),
                savepoint,
                outcome: None,
                reply: Some(reply),
            }),
            true,
        );
        async move {
            queued?;
            answer.await.map_err(|_| StoreError::Closed)?
        }
    }

    /// Stores the message `id` (its journal record, `messages::record`); the future
    /// resolves once it is durable: with a journal once its record is written, else once
    /// its batch commits.
    fn queue_message(
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
    /// (p99.9 flat out 70–99 ms).
    /// While the writer is `MAX_UNAPPLIED` messages behind, the caller also waits until it
    /// is back within that (not until the database holds this very message: under a load
    /// the writer cannot keep up with, every message then waited for the whole backlog),
    /// so that the backlog stays bounded.
    fn journal<'s>(
        &'s self,
        mut tail: std::sync::MutexGuard<'s, Option<JournalTail>>,
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
        journal::remove_segments(state.journal.take_applied(applied));
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
    fn write_rounds<'s>(
        &'s self,
        mut tail: std::sync::MutexGuard<'s, Option<JournalTail>>,
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
    fn write_round(
        &self,
        tail: std::sync::MutexGuard<'_, Option<JournalTail>>,
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

    fn lock_journal(&self) -> std::sync::MutexGuard<'_, Option<JournalTail>> {
        self.inner.journal.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the messages, on a read-only connection, once the database holds every
    /// message acknowledged before this call. (Other writes are in the database when their
    /// callers hear of them: reading their tables needs only `read`.)
    async fn read_messages<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&Connection) -> Result<R, StoreError> + Send + 'static,
    {
        if self.inner.backlog.behind() > 0 {
            // Queued behind them, this empty write commits after they do.
            self.write_unguarded(|_| Ok(())).await?;
        }
        self.read(f).await
    }

    /// Whether `id` is a message the journal acknowledged and the database does not hold yet.
    fn is_unapplied(&self, id: &str) -> bool {
        let applied = self.inner.backlog.applied.load(Ordering::Acquire);
        self.lock_unapplied().contains(id, applied)
    }

    /// Adds a written round's messages (ids and record numbers) to those not yet applied.
    fn add_unapplied(&self, ids: Vec<(Arc<str>, u64)>) {
        let applied = self.inner.backlog.applied.load(Ordering::Acquire);
        let mut unapplied = self.lock_unapplied();
        for (id, number) in ids {
            unapplied.add(id, number);
        }
        unapplied.sweep_if_grown(applied);
    }

    fn lock_unapplied(&self) -> std::sync::MutexGuard<'_, Unapplied> {
        self.inner
            .unapplied
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on a read-only connection. Stored messages are read with `read_messages`.
    pub async fn read<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&Connection) -> Result<R, StoreError> + Send + 'static,
    {
        match &self.inner.readers {
            Some(pool) => {
                let pool = pool.clone();
                tokio::task::spawn_blocking(move || pool.with(f))
                    .await
                    .map_err(|_| StoreError::Closed)?
            }
            // In memory there is a single connection: the read waits its turn with writes.
            None => self.write(f).await,
        }
    }

    /// Queues `job` for the writer; `wake` ends the writer's wait for more messages.
    fn submit(&self, job: Box<dyn Job>, wake: bool) -> Result<(), StoreError> {
        let writer = self.inner.writer.lock().unwrap_or_else(|e| e.into_inner());
        let writer = writer.as_ref().ok_or(StoreError::Closed)?;
        writer.send(job).map_err(|_| StoreError::Closed)?;
        if wake {
            self.inner.writer_wake.unpark();
        }
        Ok(())
    }

    /// Finishes queued writes and closes the database. Later calls fail with `Closed`.
    pub async fn close(&self) {
        // Records waiting for a round whose task has not run yet are written here, one
        // round, the task's next finding the journal closed. (Those that came while a
        // round was being written are not: their senders hear `Closed`.)
        {
            let tail = self.lock_journal();
            if tail
                .as_ref()
                .is_some_and(|state| !state.in_flight && !state.waiting.is_empty())
            {
                let mut none = Ok(());
                self.write_round(tail, &mut none);
            }
        }
        drop(take(&self.inner.journal));
        drop(take(&self.inner.writer));
        self.inner.writer_wake.unpark();
        if let Some(thread) = take(&self.inner.writer_thread) {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        // The writer is gone, and with it what wakes the checkpointer: it ends.
        if let Some(checkpointer) = take(&self.inner.checkpointer) {
            let _ = tokio::task::spawn_blocking(move || checkpointer.join()).await;
        }
    }
}

/// Gives the calling thread (the writer's, the checkpointer's) a lower scheduling priority
/// than the runtime's: a delivery never waits for them (reads and other writes do, and
/// get a core as soon as the runtime's threads leave one), and on a busy machine their
/// bursts (a transaction of many messages, a checkpoint) should not hold a core that a
/// delivery is waiting for. Best effort: a failure changes nothing else.
#[cfg(target_os = "linux")]
fn lower_priority() {
    /// Nice 10: about a tenth of a default thread's share of a contended core.
    const NICE: libc::c_int = 10;
    // SAFETY: gettid and setpriority take no pointers and act on the calling thread only.
    let set = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, NICE)
    };
    if set != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "store: cannot lower a thread's priority");
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_priority() {}

fn take<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    slot.lock().unwrap_or_else(|e| e.into_inner()).take()
}

type Checkpoints = (checkpoint::Checkpointer, checkpoint::Committed);

fn open_file(
    dir: &Path,
    path: &Path,
) -> Result<(Connection, Option<ReaderPool>, Option<Checkpoints>), StoreError> {
    std::fs::create_dir_all(dir).map_err(|source| StoreError::DataDir {
        path: dir.to_owned(),
        source,
    })?;
    let conn = Connection::open(path).map_err(|source| StoreError::Open {
        path: path.to_owned(),
        source,
    })?;
    // Before the database has a table; one that has keeps the size it was made with.
    conn.pragma_update(None, "page_size", PAGE_BYTES)
        .map_err(|source| StoreError::Open {
            path: path.to_owned(),
            source,
        })?;
    // Fail now, with the path named, rather than on the first write.
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(|source| StoreError::Open {
            path: path.to_owned(),
            source,
        })?;
    // Checkpoints run on their own thread (checkpoint.rs); the writer's own only bounds
    // the log when that thread cannot reach its end, and a log that grew is cut back.
    let page_bytes: i64 = conn.pragma_query_value(None, "page_size", |row| row.get(0))?;
    let backstop = checkpoint::BACKSTOP_BYTES;
    conn.execute_batch(&format!(
        "PRAGMA wal_autocheckpoint = {}; PRAGMA journal_size_limit = {backstop};",
        backstop / page_bytes.max(512)
    ))?;
    let checkpoints = checkpoint::Checkpointer::start(path)?;
    Ok((
        conn,
        Some(ReaderPool::new(path.to_owned())),
        Some(checkpoints),
    ))
}

fn configure(conn: &Connection) -> Result<(), StoreError> {
    // WAL with synchronous=NORMAL survives a killed process (kill -9) without losing a
    // committed transaction; only a power loss can take back the last commits.
    // A write in its own savepoint (`Store::write`) puts its undo pages in a sub-journal;
    // in memory that costs no file writes (it was half the writer's time).
    conn.execute_batch(
        "PRAGMA synchronous = NORMAL;
         PRAGMA temp_store = MEMORY;
         PRAGMA cache_size = -8192;
         PRAGMA foreign_keys = ON;
         PRAGMA busy_timeout = 5000;",
    )?;
    Ok(())
}

/// The writing connection as a batch's writes see it, with the statements they (and the
/// batch's own `BEGIN`, savepoints and `COMMIT`) asked for held prepared until the batch
/// ends. Taking a statement from rusqlite's cache and putting it back copies and hashes its
/// SQL text both ways and clears its bindings: for a stored message that was about 3k
/// instructions, against once per batch here.
pub(crate) struct Batch<'c> {
    conn: &'c Connection,
    held: Vec<(&'static str, rusqlite::CachedStatement<'c>)>,
    /// While the writer keeps up: the rows between its turns given to other threads
    /// (`pace`).
    yield_every: Option<usize>,
    paced: usize,
}

impl<'c> Batch<'c> {
    pub(super) fn new(conn: &'c Connection) -> Self {
        Batch {
            conn,
            held: Vec::new(),
            yield_every: None,
            paced: 0,
        }
    }

    /// Called before a job writes `rows` rows: gives way to other threads once every
    /// `yield_every` rows or so (`Backlog::keeping_up`).
    fn pace(&mut self, rows: usize) {
        if let Some(every) = self.yield_every {
            let before = self.paced / every;
            self.paced += rows;
            if self.paced / every != before {
                std::thread::yield_now();
            }
        }
    }

    pub(crate) fn conn(&self) -> &'c Connection {
        self.conn
    }

    /// `sql` prepared, from the second use in a batch on without going to the cache. Its
    /// parameters keep the values the last write bound (the cache would have cleared
    /// them): bind every one, as positional `params!` does.
    pub(crate) fn statement(
        &mut self,
        sql: &'static str,
    ) -> rusqlite::Result<&mut rusqlite::CachedStatement<'c>> {
        // The same literal is the same pointer; equal text from elsewhere still matches.
        let same = |held: &&str| std::ptr::eq(*held, sql) || *held == sql;
        let at = match self.held.iter().position(|(held, _)| same(held)) {
            Some(at) => at,
            None => {
                self.held.push((sql, self.conn.prepare_cached(sql)?));
                self.held.len() - 1
            }
        };
        Ok(&mut self.held[at].1)
    }

    /// Runs `sql`, a statement without parameters or rows (`SAVEPOINT job`, `COMMIT`).
    fn exec(&mut self, sql: &'static str) -> rusqlite::Result<()> {
        self.statement(sql)?.execute([]).map(|_| ())
    }
}

/// The journal's appending end, and the records waiting for its next round.
struct JournalTail {
    journal: journal::Journal,
    /// Whether rounds are being written (`Store::write_round`).
    writing: bool,
    /// Whether a round's `write` is under way, the lock let go.
    in_flight: bool,
    /// Messages whose records wait for the next round, in record order.
    waiting: Vec<Waiting>,
}

/// The task writing the journal's rounds (`Store::journal`). Dropped before it is done
/// (its runtime shutting down, or a panic), it writes what waits itself: the rows' callers
/// would otherwise wait, and every later one queue behind them, for good.
struct RoundTask {
    store: Store,
    finished: bool,
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
struct Waiting {
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
struct Journaling {
    written: Written,
    /// When the writer is far behind: the record the database must hold before the caller
    /// goes on (`Backlog::reached`).
    wait_for: Option<u64>,
}

enum Written {
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
/// again once it had gone cold, a cache miss a message (2.2 % of the runtime threads'
/// cycles flat out, most of it that miss). The map is swept of applied ids once it has
/// grown to twice what the last sweep left, at least [`Unapplied::SWEPT_AT_LEAST`].
#[derive(Default)]
struct Unapplied {
    by_id: foldhash::HashMap<Arc<str>, u64>,
    /// How many ids the last sweep left.
    swept_to: usize,
}

impl Unapplied {
    const SWEPT_AT_LEAST: usize = 4096;

    fn add(&mut self, id: Arc<str>, number: u64) {
        let highest = self.by_id.entry(id).or_insert(number);
        *highest = (*highest).max(number);
    }

    fn contains(&self, id: &str, applied: u64) -> bool {
        self.by_id.get(id).is_some_and(|&highest| highest > applied)
    }

    /// Forgets the ids the database holds, all up to `applied`, once there may be as many
    /// of them as of the others.
    fn sweep_if_grown(&mut self, applied: u64) {
        if self.by_id.len() > 2 * self.swept_to.max(Self::SWEPT_AT_LEAST) {
            self.by_id.retain(|_, highest| *highest > applied);
            self.swept_to = self.by_id.len();
        }
    }
}

/// A round of messages the journal acknowledged, for the writer to put in the database:
/// the round's own buffer, as written (one job and one free a round, not a row of owned
/// texts per message), or a few small rounds' joined (`join_round`).
struct JournaledRound {
    records: Vec<u8>,
    rows: usize,
    /// The number of its last record.
    last: u64,
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

trait Job: Send {
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

struct WriteJob<F, R> {
    work: Option<F>,
    savepoint: bool,
    outcome: Option<Result<R, StoreError>>,
    reply: Option<oneshot::Sender<Result<R, StoreError>>>,
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
        matches!(
            &self.outcome,
            Some(Err(StoreError::Sqlite(e)))
                if e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation)
        )
    }

    fn finish(mut self: Box<Self>, committed: Result<(), &rusqlite::Error>) {
        let outcome = match (self.outcome.take(), committed) {
            (Some(Ok(value)), Ok(())) => Ok(value),
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
struct Backlog {
    applied: Arc<AtomicU64>,
    journaled: Arc<AtomicU64>,
    /// Told each time `applied` moves on, and when the writer stops.
    moved: Arc<Notify>,
    stopped: Arc<AtomicBool>,
}

impl Backlog {
    /// The database holds every record up to `last`, the last one written.
    fn start_after(&self, last: u64) {
        self.applied.store(last, Ordering::Release);
        self.journaled.store(last, Ordering::Release);
    }

    /// Journaled messages the database lacks.
    fn behind(&self) -> u64 {
        let journaled = self.journaled.load(Ordering::Acquire);
        journaled.saturating_sub(self.applied.load(Ordering::Acquire))
    }

    /// Moves `applied` on to `last` (the writer, after a commit).
    fn applied_through(&self, last: u64) {
        self.applied.fetch_max(last, Ordering::Release);
        self.moved.notify_waiters();
    }

    /// The writer has stopped: no one waits for it any longer.
    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        self.moved.notify_waiters();
    }

    /// Once the database holds record `target`; `Closed` if the writer stops first.
    async fn reached(&self, target: u64) -> Result<(), StoreError> {
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
    /// wait for it (flat out, yielding always made the p99.9 70 ms).
    fn keeping_up(&self) -> bool {
        self.behind() < KEEPING_UP as u64
    }
}

fn write_loop(
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

fn rows_in(batch: &[Box<dyn Job>]) -> usize {
    batch.iter().map(|job| job.rows()).sum()
}

/// Fills `batch` with what is queued. While it holds only messages the journal
/// acknowledged, it waits for more until `deadline`, to put them in together: each commit
/// writes every page it changed to the log again, and small commits wrote the same
/// half-filled pages over and over. The wait is a `park`, which a message queued does not
/// end (no wake-up per message); anyone else's write, or a read's wait, ends it.
fn gather(jobs: &mpsc::Receiver<Box<dyn Job>>, batch: &mut Vec<Box<dyn Job>>, deadline: Instant) {
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
fn join_round(batch: &mut [Box<dyn Job>], job: &mut dyn Job) -> bool {
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
fn retry(conn: &Connection, batch: &mut [Box<dyn Job>]) -> Option<u64> {
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
fn run_batch(
    conn: &Connection,
    jobs: &mut [Box<dyn Job>],
    yield_every: Option<usize>,
) -> Result<Option<u64>, rusqlite::Error> {
    // The batch's statements (its own and its writes') are let go before a rollback.
    let applied = jobs.iter().filter_map(|job| job.journaled_up_to()).max();
    let outcome = {
        let mut batch = Batch::new(conn);
        batch.yield_every = yield_every;
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

fn run_jobs(batch: &mut Batch<'_>, jobs: &mut [Box<dyn Job>]) -> Result<(), rusqlite::Error> {
    let conn = batch.conn;
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

/// Read-only connections to the database file, opened on demand and reused.
#[derive(Clone)]
struct ReaderPool {
    path: Arc<PathBuf>,
    idle: Arc<Mutex<Vec<Connection>>>,
}

impl ReaderPool {
    fn new(path: PathBuf) -> Self {
        ReaderPool {
            path: Arc::new(path),
            idle: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn with<R>(
        &self,
        f: impl FnOnce(&Connection) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        let pooled = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let conn = match pooled {
            Some(conn) => conn,
            None => {
                let conn = Connection::open_with_flags(
                    &*self.path,
                    rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY
                        | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
                )?;
                // Readers answer history and lookups; the OS already caches the file, so
                // each keeps a small page cache of its own (the default is 8 MiB).
                conn.execute_batch("PRAGMA busy_timeout = 5000; PRAGMA cache_size = -1024;")?;
                conn
            }
        };
        let result = f(&conn);
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_READERS {
            idle.push(conn);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::MessageQuery;

    /// An in-memory store with a table `t` of unique integers.
    async fn store_with_table() -> Store {
        let store = Store::open(IN_MEMORY).await.unwrap();
        store
            .write(|c| Ok(c.execute_batch("CREATE TABLE t (v INTEGER PRIMARY KEY)")?))
            .await
            .unwrap();
        store
    }

    /// Keeps the writer busy until `release` is sent on, so that the writes queued
    /// meanwhile go into one batch; the future finishes with the holding write.
    async fn hold_writer(
        store: &Store,
    ) -> (
        std::sync::mpsc::Sender<()>,
        impl Future<Output = Result<(), StoreError>>,
    ) {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (started, running) = oneshot::channel();
        let holding = store.write(move |_| {
            let _ = started.send(());
            let _ = held.recv();
            Ok(())
        });
        running.await.unwrap();
        (release, holding)
    }

    async fn rows_in_t(store: &Store) -> i64 {
        store
            .read(|c| Ok(c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0))?))
            .await
            .unwrap()
    }

    /// The writes of one batch share a statement, prepared once, across savepoints and a
    /// write that failed on a constraint; the batch commits whole.
    #[tokio::test]
    async fn a_batch_holds_each_statement_prepared_across_its_writes() {
        const INSERT: &str = "INSERT INTO t (v) VALUES (?1)";
        let store = store_with_table().await;
        let (release, holding) = hold_writer(&store).await;
        // Each write answers how many statements it had the batch prepare.
        let insert = |v: i64| {
            store.write_unguarded_in_batch(move |batch| {
                let held_before = batch.held.len();
                batch.statement(INSERT)?.execute([v])?;
                Ok(batch.held.len() - held_before)
            })
        };
        let first = insert(1);
        // A write in a savepoint of its own, between two that use the held statement.
        let guarded = store.write(|c| Ok(c.execute("INSERT INTO t (v) VALUES (10)", [])?));
        let writes = [insert(2), insert(1), insert(3)];
        release.send(()).unwrap();
        holding.await.unwrap();
        assert_eq!(first.await.unwrap(), 1);
        guarded.await.unwrap();
        let prepared: Vec<Option<usize>> = futures_util::future::join_all(writes)
            .await
            .into_iter()
            .map(Result::ok)
            .collect();
        assert_eq!(
            prepared,
            [Some(0), None, Some(0)],
            "the second 1 is a duplicate"
        );
        assert_eq!(rows_in_t(&store).await, 4);
    }

    /// A round can be added after the one written after it (`Store::add_unapplied`): a
    /// resent id is still unapplied until the database holds both of its records.
    #[test]
    fn a_resent_id_is_unapplied_until_its_latest_record_is_applied() {
        let mut unapplied = Unapplied::default();
        unapplied.add("m".into(), 5);
        unapplied.add("m".into(), 3);
        unapplied.add("n".into(), 4);
        for applied in [3, 4] {
            assert!(
                unapplied.contains("m", applied),
                "applied through {applied}"
            );
        }
        assert!(unapplied.contains("n", 3) && !unapplied.contains("n", 4));
        assert!(!unapplied.contains("m", 5) && !unapplied.contains("x", 0));
    }

    /// Applied ids are swept out once the map has doubled since the last sweep, and never
    /// an unapplied one.
    #[test]
    fn applied_ids_are_swept_once_the_map_has_doubled() {
        let mut unapplied = Unapplied::default();
        let floor = Unapplied::SWEPT_AT_LEAST as u64;
        let mut applied = 0;
        for number in 1..=10 * floor {
            unapplied.add(format!("m{number}").into(), number);
            // The writer keeps 100 records behind.
            applied = number.saturating_sub(100);
            unapplied.sweep_if_grown(applied);
            assert!(unapplied.by_id.len() <= 2 * Unapplied::SWEPT_AT_LEAST + 1);
        }
        for number in applied + 1..=10 * floor {
            assert!(unapplied.contains(&format!("m{number}"), applied));
        }
        assert!(!unapplied.by_id.contains_key("m1"), "swept");
    }

    /// With a journal a message is durable before the database has it, but no further
    /// than `MAX_UNAPPLIED` messages ahead: then its sender waits for the database.
    #[tokio::test]
    async fn journaled_messages_wait_once_the_database_is_far_behind() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let (release, holding) = hold_writer(&store).await;
        let message = |i: usize| {
            let mut env = crate::core::Envelope::new("test", "a", crate::core::Kind::Chat);
            env.id = format!("m{i}");
            env
        };
        for i in 0..MAX_UNAPPLIED {
            store.insert_message(&message(i)).await.unwrap();
        }
        assert!(
            store.has_message("m0").await.unwrap(),
            "acknowledged, so found"
        );
        let mut over = std::pin::pin!(store.insert_message(&message(MAX_UNAPPLIED)));
        let waited =
            tokio::time::timeout(std::time::Duration::from_millis(50), over.as_mut()).await;
        assert!(
            waited.is_err(),
            "the writer is held: the message waits for it"
        );
        release.send(()).unwrap();
        holding.await.unwrap();
        over.await.unwrap();
        let all = store
            .messages(MessageQuery {
                limit: MAX_UNAPPLIED + 10,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(all.len(), MAX_UNAPPLIED + 1);
        store.close().await;
    }

    /// A sender over the limit waits only until the database is back within it, not for
    /// its own message; and hears `Closed` if the writer stops first.
    #[tokio::test]
    async fn a_sender_over_the_limit_waits_for_the_backlog_to_shrink() {
        let backlog = Backlog::default();
        backlog.start_after(10);
        use futures_util::FutureExt;
        let mut reached = Box::pin(backlog.reached(12));
        assert!((&mut reached).now_or_never().is_none());
        backlog.applied_through(11);
        assert!((&mut reached).now_or_never().is_none(), "11 is not yet 12");
        backlog.applied_through(12);
        assert!(reached.await.is_ok());

        let mut stranded = Box::pin(backlog.reached(20));
        assert!((&mut stranded).now_or_never().is_none());
        backlog.stop();
        assert!(matches!(stranded.await, Err(StoreError::Closed)));
    }

    #[tokio::test]
    async fn a_failing_write_does_not_undo_its_batch_neighbours() {
        let store = store_with_table().await;
        let mut writes = Vec::new();
        for v in [1, 2, 1, 3] {
            let s = store.clone();
            writes.push(tokio::spawn(async move {
                s.write(move |c| Ok(c.execute("INSERT INTO t (v) VALUES (?1)", [v])?))
                    .await
            }));
        }
        let results: Vec<bool> = futures_util::future::join_all(writes)
            .await
            .into_iter()
            .map(|r| r.unwrap().is_ok())
            .collect();
        assert_eq!(results.iter().filter(|ok| !**ok).count(), 1);
        assert_eq!(rows_in_t(&store).await, 3);
    }

    #[tokio::test]
    async fn a_failing_unguarded_write_leaves_its_batch_whole() {
        let store = store_with_table().await;
        let (release, holding) = hold_writer(&store).await;
        let writes: Vec<_> = [1, 2, 1, 3]
            .into_iter()
            .map(|v| {
                store.write_unguarded(move |c| Ok(c.execute("INSERT INTO t (v) VALUES (?1)", [v])?))
            })
            .collect();
        release.send(()).unwrap();
        holding.await.unwrap();
        let results: Vec<bool> = futures_util::future::join_all(writes)
            .await
            .into_iter()
            .map(|r| r.is_ok())
            .collect();
        assert_eq!(results, [true, true, false, true]);
        assert_eq!(rows_in_t(&store).await, 3);
    }

    #[tokio::test]
    async fn an_unguarded_write_failing_otherwise_fails_its_whole_batch() {
        let store = store_with_table().await;
        let (release, holding) = hold_writer(&store).await;
        let before = store.write(|c| Ok(c.execute("INSERT INTO t (v) VALUES (1)", [])?));
        let failing = store.write_unguarded(|c| {
            c.execute("INSERT INTO t (v) VALUES (2)", [])?;
            Err::<(), _>(StoreError::Corrupt("half done".into()))
        });
        let after = store.write(|c| Ok(c.execute("INSERT INTO t (v) VALUES (3)", [])?));
        release.send(()).unwrap();
        holding.await.unwrap();
        assert!(failing.await.is_err());
        assert!(
            before.await.is_err() && after.await.is_err(),
            "the batch failed whole"
        );
        assert_eq!(rows_in_t(&store).await, 0);
        // The store goes on.
        store
            .write(|c| Ok(c.execute("INSERT INTO t (v) VALUES (4)", [])?))
            .await
            .unwrap();
        assert_eq!(rows_in_t(&store).await, 1);
    }

    /// Small journal rounds are joined while both fill less than a statement's rows;
    /// other jobs, full rounds and rounds after a full one stay apart.
    #[test]
    fn the_writer_joins_small_rounds() {
        let round = |rows: usize, last: u64| -> Box<dyn Job> {
            Box::new(JournaledRound {
                records: vec![rows as u8; rows],
                rows,
                last,
            })
        };
        let mut batch = vec![round(1, 1)];
        assert!(join_round(&mut batch, &mut *round(2, 3)));
        let joined = batch[0].as_round().unwrap();
        assert_eq!(
            (joined.records.as_slice(), joined.rows, joined.last),
            (&[1, 2, 2][..], 3, 3)
        );
        assert!(
            !join_round(&mut batch, &mut *round(messages::ROWS_PER_STATEMENT, 19)),
            "a full round is not copied"
        );
        assert!(join_round(&mut batch, &mut *round(14, 17)));
        assert_eq!(batch[0].journaled_up_to(), Some(17));
        assert!(
            !join_round(&mut batch, &mut *round(1, 18)),
            "the first is full"
        );
        let mut other: Box<dyn Job> = Box::new(WriteJob::<_, ()> {
            work: Some(|_: &mut Batch<'_>| Ok(())),
            savepoint: false,
            outcome: None,
            reply: None,
        });
        let mut batch = vec![round(1, 1)];
        assert!(!join_round(&mut batch, &mut *other));
        let mut batch = vec![other];
        assert!(!join_round(&mut batch, &mut *round(1, 1)));
    }

    #[test]
    fn the_writer_keeps_up_while_its_backlog_is_short() {
        let backlog = Backlog::default();
        backlog.start_after(100);
        assert!(backlog.keeping_up());
        backlog
            .journaled
            .store(100 + KEEPING_UP as u64, Ordering::Release);
        assert!(!backlog.keeping_up());
        backlog.applied.store(101, Ordering::Release);
        assert!(backlog.keeping_up());
    }

    /// A new database is made with `PAGE_BYTES` pages; one made before keeps its own.
    #[tokio::test]
    async fn new_databases_get_large_pages_and_old_ones_keep_theirs() {
        let page_size = |store: Store| async move {
            let bytes: i64 = store
                .read(|c| Ok(c.pragma_query_value(None, "page_size", |r| r.get(0))?))
                .await
                .unwrap();
            store.close().await;
            bytes
        };
        let new = tempfile::tempdir().unwrap();
        let store = Store::open(new.path().to_str().unwrap()).await.unwrap();
        assert_eq!(page_size(store).await, i64::from(PAGE_BYTES));

        let old = tempfile::tempdir().unwrap();
        Connection::open(old.path().join(DB_FILE))
            .unwrap()
            .execute_batch("PRAGMA page_size = 4096; CREATE TABLE t (v INTEGER);")
            .unwrap();
        let store = Store::open(old.path().to_str().unwrap()).await.unwrap();
        assert_eq!(page_size(store).await, 4096);
    }

    #[tokio::test]
    async fn migrations_run_once_and_survive_reopen() {
        static STEPS: &[Migration] = &[
            Migration {
                version: 1,
                sql: "CREATE TABLE m (v INTEGER)",
            },
            Migration {
                version: 2,
                sql: "INSERT INTO m VALUES (42)",
            },
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_str().unwrap().to_owned();
        for _ in 0..2 {
            let store = Store::open(&path).await.unwrap();
            store.migrate("test", STEPS).await.unwrap();
            let rows: i64 = store
                .read(|c| Ok(c.query_row("SELECT COUNT(*) FROM m", [], |r| r.get(0))?))
                .await
                .unwrap();
            assert_eq!(rows, 1);
            store.close().await;
        }
    }

    /// A build that knows fewer steps than were applied (an older build on a newer
    /// database) is refused rather than left to misread what it finds.
    #[tokio::test]
    async fn a_database_migrated_further_than_this_build_knows_is_refused() {
        static ALL: &[Migration] = &[
            Migration {
                version: 1,
                sql: "CREATE TABLE m (v INTEGER)",
            },
            Migration {
                version: 2,
                sql: "",
            },
        ];
        let store = Store::open(IN_MEMORY).await.unwrap();
        store.migrate("test", ALL).await.unwrap();
        let err = store.migrate("test", &ALL[..1]).await.unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::TooNew {
                    found: 2,
                    known: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("newer agentbridge"), "{err}");
    }

    #[tokio::test]
    async fn an_unusable_data_dir_is_named_in_the_error() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let bad = file.path().join("sub");
        let err = match Store::open(bad.to_str().unwrap()).await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("opened a data dir under a file"),
        };
        assert!(err.contains(bad.to_str().unwrap()), "{err}");
    }

    #[tokio::test]
    async fn closed_store_refuses_work() {
        let store = Store::open(IN_MEMORY).await.unwrap();
        store.close().await;
        assert!(matches!(
            store.write(|_| Ok(())).await,
            Err(StoreError::Closed)
        ));
    }
}
