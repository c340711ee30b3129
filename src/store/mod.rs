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
//!
//! What an acknowledged message survives: with a database file, its journal record was
//! written to the page cache (not fsynced) before its sender heard, so it survives the
//! process being killed (kill -9, a panic, OOM) and is put in at the next start; an OS
//! crash or power loss can take back the last records and the last commits (SQLite in WAL
//! with `synchronous = NORMAL`), never corrupt what is older.
//!
//! The files: this one is the API (open, migrate, write, read, close); `rounds.rs` the
//! journal rounds; `writer.rs` the writer thread and its batches (`batch.rs` the
//! connection as a batch sees it); `sqlite.rs` opening the database and the reader pool;
//! `checkpoint.rs`, `journal.rs`, `priority.rs` the threads and file they name;
//! `messages.rs` (with `messages/`) the message log's tables and queries; `log.rs` the
//! core's `MessageLog` on top of them; `redelivery.rs` a bridge alone's, which routes again
//! after a restart what was not delivered (`undelivered.rs` its tables); `applied_marks.rs`
//! what the hubs applied; `mail_table.rs` what the endpoints' tables of fleet mail share.

mod applied_marks;
mod batch;
mod checkpoint;
mod journal;
mod log;
mod mail_table;
mod message_body;
mod messages;
mod priority;
mod redelivery;
mod rounds;
mod sqlite;
#[cfg(test)]
mod tests;
mod undelivered;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;

use parking_lot::Mutex;
use rusqlite::Connection;
use tokio::sync::oneshot;

pub use mail_table::MailTable;
pub use redelivery::RedeliveringLog;
pub(crate) use undelivered::UndeliveredRows;

use batch::Batch;
use rounds::{JournalTail, Unapplied};
use sqlite::{ReaderPool, configure, open_file};
use writer::{Backlog, Committed, Job, WriteJob, write_loop};

/// Name of the database file inside `data_dir`.
pub const DB_FILE: &str = "agentbridge.db";
/// The `data_dir` value that keeps everything in memory (tests).
pub const IN_MEMORY: &str = ":memory:";

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

impl StoreError {
    /// Whether the work failed on a constraint its data breaks, which SQLite undoes by
    /// itself, statement by statement.
    fn broke_a_constraint(&self) -> bool {
        matches!(self, StoreError::Sqlite(e)
            if e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation))
    }
}

impl crate::core::ApplyError for StoreError {
    /// A database or journal error may be the moment's (I/O, a full disk); a constraint
    /// the data breaks, data this bridge cannot read, or a store closing stays so.
    fn worth_trying_again(&self) -> bool {
        match self {
            StoreError::Sqlite(_) => !self.broke_a_constraint(),
            StoreError::Journal { .. } => true,
            _ => false,
        }
    }
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
    /// that deliveries wait for would stall them for milliseconds at a time.
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
        let backlog = Backlog::default();
        let (conn, readers, checkpoints) = if in_memory {
            let conn = Connection::open_in_memory().map_err(|source| StoreError::Open {
                path: IN_MEMORY.into(),
                source,
            })?;
            (conn, None, None)
        } else {
            let dir = PathBuf::from(data_dir);
            let path = dir.join(DB_FILE);
            let synced = checkpoint::Synced {
                applied: backlog.applied.clone(),
                durable: backlog.durable.clone(),
            };
            tokio::task::spawn_blocking(move || open_file(&dir, &path, synced))
                .await
                .map_err(|_| StoreError::Closed)??
        };
        configure(&conn)?;
        let (checkpointer, committed) = checkpoints.unzip();
        let (tx, rx) = mpsc::channel::<Box<dyn Job>>();
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
        // The database holds every record now; synced (a commit alone is not, with
        // `synchronous = NORMAL`), the old segments can go.
        let database = Path::new(&dir).parent().map(|d| d.join(DB_FILE));
        let journal = tokio::task::spawn_blocking(move || {
            if let Some(database) = database.filter(|_| !segments.is_empty()) {
                let conn = Connection::open(&database)?;
                conn.execute_batch("PRAGMA busy_timeout = 5000;")?;
                conn.query_row("PRAGMA wal_checkpoint(FULL)", [], |_| Ok(()))?;
            }
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
        *self.lock_journal() = Some(JournalTail::new(journal));
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
        self.queue(move |batch: &mut Batch<'_>| f(batch.conn()), true)
    }

    /// Like `write`; `committed` is called with the result once the write's batch has
    /// committed, before the caller hears, on the writer's thread: so in the order the
    /// writes committed, which the callers, woken together, do not keep. For what must
    /// follow that order (events telling of each change); it must be quick and not block.
    pub fn write_then<R, F, C>(
        &self,
        f: F,
        committed: C,
    ) -> impl Future<Output = Result<R, StoreError>> + Send + 'static
    where
        R: Send + 'static,
        F: FnOnce(&Connection) -> Result<R, StoreError> + Send + 'static,
        C: FnOnce(&R) + Send + 'static,
    {
        let job = move |batch: &mut Batch<'_>| f(batch.conn());
        self.queue_then(job, true, Some(Box::new(committed)))
    }

    /// Like `write`, without the savepoint that keeps a failed write from undoing part of
    /// its batch: for work that can fail on its data only in its first statement, with a
    /// constraint violation, which SQLite undoes by itself. Any other failure (out of
    /// memory or disk, I/O) may have left part of the work behind, so it fails the whole
    /// batch: nothing in it is committed and every caller hears the error. A savepoint
    /// copies every page the write touches that the batch already changed; for a stored
    /// message, a large share of the bridge's cost.
    pub fn write_unguarded<R, F>(
        &self,
        f: F,
    ) -> impl Future<Output = Result<R, StoreError>> + Send + 'static
    where
        R: Send + 'static,
        F: FnOnce(&Connection) -> Result<R, StoreError> + Send + 'static,
    {
        self.queue(move |batch: &mut Batch<'_>| f(batch.conn()), false)
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
        self.queue_then(f, savepoint, None)
    }

    /// `queue`, with what the writer calls once the write committed (`write_then`).
    fn queue_then<R, F>(
        &self,
        f: F,
        savepoint: bool,
        committed: Option<Committed<R>>,
    ) -> impl Future<Output = Result<R, StoreError>> + Send + 'static
    where
        R: Send + 'static,
        F: FnOnce(&mut Batch<'_>) -> Result<R, StoreError> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job = WriteJob::new(f, savepoint, reply, committed);
        let queued = self.submit(Box::new(job), true);
        async move {
            queued?;
            answer.await.map_err(|_| StoreError::Closed)?
        }
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
        let writer = self.inner.writer.lock();
        let writer = writer.as_ref().ok_or(StoreError::Closed)?;
        writer.send(job).map_err(|_| StoreError::Closed)?;
        if wake {
            self.inner.writer_wake.unpark();
        }
        Ok(())
    }

    /// Finishes queued writes and closes the database. Later calls fail with `Closed`.
    pub async fn close(&self) {
        self.write_waiting_round();
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

fn take<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    slot.lock().take()
}
