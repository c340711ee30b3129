//! Opening SQLite: the database file in WAL mode with its page size and checkpoint
//! backstop, the pragmas every connection runs with, and the pool of read-only
//! connections reads use beside the writer.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use rusqlite::Connection;

use super::{StoreError, checkpoint};

/// Most read-only connections kept open.
pub(super) const MAX_READERS: usize = 4;

/// A new database's page size. A message's row and index entries take about 700 bytes;
/// with 16 KiB pages rather than SQLite's 4 KiB, a batch writes a quarter as many log
/// frames (each two `pwrite`s and a checksum) and splits pages a quarter as often, and
/// the checkpoints copy fewer, which saves CPU a message, most of it in the kernel. An
/// in-memory store keeps SQLite's default.
pub(super) const PAGE_BYTES: u32 = 16384;

pub(super) type Checkpoints = (checkpoint::Checkpointer, checkpoint::Committed);

pub(super) fn open_file(
    dir: &Path,
    path: &Path,
    synced: checkpoint::Synced,
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
    let checkpoints = checkpoint::Checkpointer::start(path, synced)?;
    Ok((
        conn,
        Some(ReaderPool::new(path.to_owned())),
        Some(checkpoints),
    ))
}

pub(super) fn configure(conn: &Connection) -> Result<(), StoreError> {
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

/// Read-only connections to the database file, opened on demand and reused.
#[derive(Clone)]
pub(super) struct ReaderPool {
    path: Arc<PathBuf>,
    idle: Arc<Mutex<Vec<Connection>>>,
}

impl ReaderPool {
    pub(super) fn new(path: PathBuf) -> Self {
        ReaderPool {
            path: Arc::new(path),
            idle: Arc::new(Mutex::new(Vec::new())),
        }
    }

    pub(super) fn with<R>(
        &self,
        f: impl FnOnce(&Connection) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        let pooled = self.idle.lock().pop();
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
        let mut idle = self.idle.lock();
        if idle.len() < MAX_READERS {
            idle.push(conn);
        }
        result
    }
}
