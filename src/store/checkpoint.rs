//! WAL checkpoints on a thread of their own, so commits do not wait for them.
//!
//! Left to itself SQLite checkpoints inside a commit once the log passes 1,000 pages: the
//! copy into the database file and its fsyncs then hold up every write queued behind it.
//! This thread runs a PASSIVE checkpoint, which never blocks the writer, once every
//! `WRITES_PER_CHECKPOINT` committed writes (and at most every `INTERVAL`). When one
//! reaches the end of the log, the writer's next transaction starts the log over. Under a
//! steady stream of commits a passive checkpoint may never reach the end; the writer's own
//! automatic checkpoint, set to a much longer log (`BACKSTOP_BYTES`), then copies what the
//! thread left, syncs, and lets the log start over, so the log stays bounded. That stall
//! is what shows in the p99; the more often the thread runs, the less it leaves. Counting
//! writes rather than time keeps a quiet bridge from syncing twice per commit (each
//! checkpoint syncs the log and the database file).
//!
//! With `synchronous = NORMAL` a commit is synced only by the next checkpoint that copies
//! frames (SQLite syncs the log before it copies). So this thread also says which journal
//! records the database holds durably (`Synced::durable`): only the journal's segments up
//! to there are removed, and a power loss never takes a message out of both.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rusqlite::Connection;

use super::StoreError;

/// Committed writes (messages, mostly) that make a checkpoint due, and the least time
/// between two. The journal acknowledges messages, so no delivery waits for a backstop
/// stall; fewer checkpoints mean fewer fsyncs competing with the relay for the cores, and
/// these values gave the lowest p99 among those tried.
const WRITES_PER_CHECKPOINT: usize = 1024;
const INTERVAL: Duration = Duration::from_millis(25);
/// The writer's own automatic checkpoint: at 64 MiB of log. Under steady load every
/// backstop stalls the writer for three fsyncs (the log, the database, the restarted log's
/// header); at 16 MiB they came often enough to set the p99, at 64 MiB they do not.
pub(super) const BACKSTOP_BYTES: i64 = 64 << 20;

pub(super) struct Checkpointer {
    thread: JoinHandle<()>,
}

/// The journal records the database holds (`applied`, moved on by the writer after each
/// commit) and of those, the ones a checkpoint has synced (`durable`, moved on here).
#[derive(Clone, Default)]
pub(super) struct Synced {
    pub(super) applied: Arc<AtomicU64>,
    pub(super) durable: Arc<AtomicU64>,
}

/// The writer's side: counts committed writes and says when a checkpoint is due.
pub(super) struct Committed {
    due: mpsc::SyncSender<()>,
    writes: usize,
}

impl Committed {
    /// `writes` more writes are committed.
    pub(super) fn notify(&mut self, writes: usize) {
        self.writes += writes;
        if self.writes >= WRITES_PER_CHECKPOINT {
            self.writes = 0;
            // Full means a checkpoint is already due.
            let _ = self.due.try_send(());
        }
    }
}

impl Checkpointer {
    /// Starts checkpointing the database at `path` after the commits the writer reports.
    /// The thread ends once the writer's `Committed` is dropped.
    pub(super) fn start(
        path: &Path,
        synced: Synced,
    ) -> Result<(Checkpointer, Committed), StoreError> {
        let open_error = |source| StoreError::Open {
            path: path.to_owned(),
            source,
        };
        let conn = Connection::open(path).map_err(open_error)?;
        conn.execute_batch("PRAGMA busy_timeout = 5000;")
            .map_err(open_error)?;
        let (committed, commits) = mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            // At most 15 bytes: the kernel cuts a thread's name there.
            .name("checkpointer".into())
            .spawn(move || run(&conn, &commits, &synced))
            .map_err(|source| StoreError::DataDir {
                path: path.to_owned(),
                source,
            })?;
        let committed = Committed {
            due: committed,
            writes: 0,
        };
        Ok((Checkpointer { thread }, committed))
    }

    /// Waits for the thread to end (after the writer is gone).
    pub(super) fn join(self) {
        let _ = self.thread.join();
    }
}

fn run(conn: &Connection, commits: &mpsc::Receiver<()>, synced: &Synced) {
    super::priority::lower_priority();
    let mut last = Instant::now();
    let mut copied_before = 0;
    while commits.recv().is_ok() {
        if let Some(wait) = (last + INTERVAL).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        // This checkpoint covers the commits reported meanwhile.
        let closing = commits.try_recv() == Err(TryRecvError::Disconnected);
        last = Instant::now();
        // Committed, so in the log, before the checkpoint starts.
        let applied = synced.applied.load(Ordering::Acquire);
        match checkpoint(conn) {
            Ok((log, copied)) => {
                // A checkpoint that copied frames synced the whole log first; one that
                // finds it all copied finds it synced by an earlier one.
                if copied > copied_before || (log >= 0 && log == copied) {
                    synced.durable.fetch_max(applied, Ordering::Release);
                }
                copied_before = copied;
            }
            Err(e) => tracing::warn!(error = %e, "store: checkpoint failed; the next one retries"),
        }
        if closing {
            return;
        }
    }
}

/// Runs a passive checkpoint; the frames in the log and how many of them are copied.
fn checkpoint(conn: &Connection) -> rusqlite::Result<(i64, i64)> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
        Ok((row.get(1)?, row.get(2)?))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_starts_over_once_the_thread_has_caught_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let wal = dir.path().join("t.db-wal");
        let writer = Connection::open(&path).unwrap();
        // No checkpoints of the writer's own; a log that starts over is cut back to empty.
        writer
            .execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA wal_autocheckpoint = 0;
                 PRAGMA journal_size_limit = 0; CREATE TABLE t (v BLOB);",
            )
            .unwrap();
        for _ in 0..64 {
            writer
                .execute("INSERT INTO t VALUES (zeroblob(8192))", [])
                .unwrap();
        }
        let grown = std::fs::metadata(&wal).unwrap().len();
        assert!(
            grown > 512 * 1024,
            "the log holds every write: {grown} bytes"
        );
        let synced = Synced::default();
        synced.applied.store(7, Ordering::Release);
        let (thread, mut committed) = Checkpointer::start(&path, synced.clone()).unwrap();
        // Once a checkpoint has copied the whole log, the next commit starts it over.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            writer.execute("INSERT INTO t VALUES (1)", []).unwrap();
            committed.notify(WRITES_PER_CHECKPOINT);
            let size = std::fs::metadata(&wal).unwrap().len();
            if size < 64 * 1024 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the log never started over: {size} bytes"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(committed);
        thread.join();
        assert_eq!(
            synced.durable.load(Ordering::Acquire),
            7,
            "what was applied before a checkpoint that synced is durable"
        );
    }
}
