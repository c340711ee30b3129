//! The Grid endpoint's tables: known programs, the queue of messages waiting for programs
//! that poll, and what has been read of each scratchpad file.

use rusqlite::{OptionalExtension, params};
use serde::{Deserialize, Serialize};

use crate::store::{MailTable, Migration, Store, StoreError};

pub static MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sql: "
        CREATE TABLE grid_agents (
            agent      TEXT PRIMARY KEY,
            created_at INTEGER NOT NULL
        );
        -- Messages waiting for a program that has no open socket, until it polls.
        CREATE TABLE grid_queue (
            seq        INTEGER PRIMARY KEY AUTOINCREMENT,
            agent      TEXT NOT NULL,
            message_id TEXT NOT NULL,
            priority   INTEGER NOT NULL,
            ts         INTEGER NOT NULL,
            expires_at INTEGER,
            body       TEXT NOT NULL,
            UNIQUE (agent, message_id)
        );
        CREATE INDEX grid_queue_by_agent ON grid_queue (agent, priority, seq);
        CREATE INDEX grid_queue_by_expiry ON grid_queue (expires_at);
        -- How far each scratchpad file has been read, and which file that was.
        CREATE TABLE grid_scratchpads (
            path   TEXT PRIMARY KEY,
            dev    INTEGER NOT NULL,
            ino    INTEGER NOT NULL,
            offset INTEGER NOT NULL
        );
        -- Entries already routed (or refused), by the hash of their text: no entry twice.
        CREATE TABLE grid_scratchpad_seen (
            hash TEXT PRIMARY KEY,
            seen_at INTEGER NOT NULL
        ) WITHOUT ROWID;
    ",
    },
    Migration {
        version: 2,
        sql: "
        -- The instance a queued message is for, when it names one: a poll or a socket of
        -- another instance leaves it.
        ALTER TABLE grid_queue ADD COLUMN instance TEXT;
        UPDATE grid_queue SET instance = json_extract(body, '$.receiver.instance_id');
    ",
    },
    Migration {
        version: 3,
        sql: "
        -- A rewrite in place (truncated, or changed before where reading stopped) is told
        -- by the fingerprint; each one starts a new generation of entry ids.
        ALTER TABLE grid_scratchpads ADD COLUMN fingerprint TEXT NOT NULL DEFAULT '';
        ALTER TABLE grid_scratchpads ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;
        -- Entries seen, per file: a file rewritten in place forgets its own.
        CREATE TABLE grid_scratchpad_seen_by_path (
            path    TEXT NOT NULL,
            hash    TEXT NOT NULL,
            seen_at INTEGER NOT NULL,
            PRIMARY KEY (path, hash)
        ) WITHOUT ROWID;
        INSERT INTO grid_scratchpad_seen_by_path (path, hash, seen_at)
            SELECT p.path, s.hash, s.seen_at FROM grid_scratchpad_seen s CROSS JOIN grid_scratchpads p;
        DROP TABLE grid_scratchpad_seen;
        ALTER TABLE grid_scratchpad_seen_by_path RENAME TO grid_scratchpad_seen;
    ",
    },
    Migration {
        version: 4,
        // The revision of the fleet's record a queued message was applied from (in a fleet,
        // a queue is the fleet's: `shared_queue.rs`); none for one this bridge alone keeps.
        sql: "ALTER TABLE grid_queue ADD COLUMN fleet_revision INTEGER;",
    },
    Migration {
        version: 5,
        // The fleet's records this bridge took lately, at the revision taken: a late copy
        // of a record taken here (the watch behind the take, a local apply held up) is not
        // queued again (`core::LATE_COPY_WINDOW`).
        sql: "CREATE TABLE grid_queue_taken (
                agent          TEXT NOT NULL,
                message_id     TEXT NOT NULL,
                fleet_revision INTEGER NOT NULL,
                taken_ms       INTEGER NOT NULL,
                PRIMARY KEY (agent, message_id)
              ) WITHOUT ROWID;
              CREATE INDEX grid_queue_taken_by_age ON grid_queue_taken (taken_ms);",
    },
    Migration {
        version: 6,
        // Entries marked seen for an append not yet known to have reached the file: a
        // bridge killed in between finds, as it starts, which did (`settle_appending`).
        sql: "CREATE TABLE grid_scratchpad_appending (
                path TEXT NOT NULL,
                hash TEXT NOT NULL,
                PRIMARY KEY (path, hash)
              ) WITHOUT ROWID;",
    },
];

/// The queue, as a table of fleet mail.
const QUEUE: MailTable = MailTable {
    name: "grid_queue",
    agent: "agent",
    taken: "grid_queue_taken",
};

/// Remembers, in the taking transaction, the fleet's records among `rows` as taken here.
fn remember_taken(conn: &rusqlite::Connection, rows: &[Queued]) -> rusqlite::Result<()> {
    let taken = rows.iter().filter_map(|row| {
        let revision = row.fleet_revision?;
        Some((
            row.agent.as_str(),
            row.message.message_id.as_str(),
            revision,
        ))
    });
    QUEUE.remember_taken(conn, taken)
}

/// A message to queue, for one program or several.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToQueue {
    pub message_id: String,
    /// The instance the message names, if any.
    pub instance: Option<String>,
    /// The priority lane (0 is the highest).
    pub priority: i64,
    /// When it was sent (ms).
    pub ts: i64,
    /// When its ttl runs out (ms).
    pub expires_at: Option<i64>,
    /// The `message:` object, as JSON text.
    pub body: String,
}

/// A queued message: a row of `grid_queue`, whole, so that one taken can be put back.
#[derive(Clone, Debug, PartialEq)]
pub struct Queued {
    pub seq: i64,
    pub agent: String,
    pub message: ToQueue,
    /// The revision of the fleet's record it was applied from, in a fleet.
    pub fleet_revision: Option<u64>,
}

impl Queued {
    /// Queue order: higher priority first, then the fleet's order of its records, then
    /// this bridge's (what this bridge alone keeps, while NATS is away, after the fleet's).
    fn order(&self) -> (i64, bool, Option<u64>, i64) {
        (
            self.message.priority,
            self.fleet_revision.is_none(),
            self.fleet_revision,
            self.seq,
        )
    }
}

const QUEUED_COLUMNS: &str =
    "seq, agent, message_id, instance, priority, ts, expires_at, body, fleet_revision";

fn queued(r: &rusqlite::Row<'_>) -> rusqlite::Result<Queued> {
    Ok(Queued {
        seq: r.get(0)?,
        agent: r.get(1)?,
        message: ToQueue {
            message_id: r.get(2)?,
            instance: r.get(3)?,
            priority: r.get(4)?,
            ts: r.get(5)?,
            expires_at: r.get(6)?,
            body: r.get(7)?,
        },
        fleet_revision: r.get::<_, Option<i64>>(8)?.map(|r| r as u64),
    })
}

/// Which of an agent's queued messages a reader takes.
#[derive(Clone, Copy, Debug)]
pub enum Instances<'a> {
    /// Everything for the agent (a poll that names no instance).
    All,
    /// What names no instance, and what names this one.
    Of(Option<&'a str>),
}

/// Where reading a scratchpad file stopped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Position {
    pub dev: u64,
    pub ino: u64,
    pub offset: u64,
    /// A hash of the file's first bytes and of those just before `offset`: when they
    /// change, the file was rewritten in place (empty for a position stored without one).
    pub fingerprint: String,
    /// How many times the file was rewritten in place: part of the id of an entry that
    /// has none, so the same words written again are a new message.
    pub generation: u64,
}

#[derive(Clone)]
pub struct Db {
    store: Store,
}

impl Db {
    pub async fn open(store: Store) -> Result<Db, StoreError> {
        store.migrate("grid", MIGRATIONS).await?;
        Ok(Db { store })
    }

    pub async fn agents(&self) -> Result<Vec<(String, i64)>, StoreError> {
        self.store
            .read(|conn| {
                let mut stmt = conn.prepare(
                    "SELECT agent, created_at FROM grid_agents ORDER BY created_at, agent",
                )?;
                let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
                Ok(rows.collect::<Result<_, _>>()?)
            })
            .await
    }

    pub async fn add_agent(&self, agent: &str, created_at: i64) -> Result<(), StoreError> {
        let agent = agent.to_owned();
        self.store
            .write(move |conn| {
                conn.execute(
                    "INSERT OR IGNORE INTO grid_agents (agent, created_at) VALUES (?1, ?2)",
                    params![agent, created_at],
                )?;
                Ok(())
            })
            .await
    }

    /// Queues `message` for each of `agents` (a message already queued for an agent is not
    /// queued twice). Queued for the store at the call, so writes made one after another
    /// commit in that order.
    pub fn enqueue(
        &self,
        agents: Vec<String>,
        message: ToQueue,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'static {
        self.store
            .write(move |conn| {
                let mut stmt = conn.prepare_cached(
                    "INSERT OR IGNORE INTO grid_queue (agent, message_id, instance, priority, ts, expires_at, body)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                )?;
                for agent in agents {
                    stmt.execute(params![
                        agent,
                        message.message_id,
                        message.instance,
                        message.priority,
                        message.ts,
                        message.expires_at,
                        message.body
                    ])?;
                }
                Ok(())
            })
    }

    /// Takes the messages waiting for `agent` that `instances` covers: higher priority
    /// first, then oldest first; only those stamped after `since` (ms) when given. Only what
    /// is returned leaves the queue.
    pub async fn take(
        &self,
        agent: &str,
        since: Option<i64>,
        instances: Instances<'_>,
    ) -> Result<Vec<Queued>, StoreError> {
        let agent = agent.to_owned();
        let (all, instance) = match instances {
            Instances::All => (true, None),
            Instances::Of(instance) => (false, instance.map(str::to_owned)),
        };
        self.store
            .write(move |conn| {
                let mut stmt = conn.prepare_cached(&format!(
                    "DELETE FROM grid_queue
                     WHERE agent = ?1 AND ts > ?2 AND (?3 OR instance IS NULL OR instance = ?4)
                     RETURNING {QUEUED_COLUMNS}"
                ))?;
                let mut rows: Vec<Queued> = stmt
                    .query_map(
                        params![agent, since.unwrap_or(i64::MIN), all, instance],
                        queued,
                    )?
                    .collect::<Result<_, _>>()?;
                remember_taken(conn, &rows)?;
                rows.sort_by_key(Queued::order);
                Ok(rows)
            })
            .await
    }

    /// The messages `ids` queued for `agent` that are still here, in queue order.
    pub async fn queued_ids(
        &self,
        agent: &str,
        ids: Vec<String>,
    ) -> Result<Vec<Queued>, StoreError> {
        let agent = agent.to_owned();
        self.store
            .read(move |conn| {
                let mut rows = QUEUE.rows_of(conn, QUEUED_COLUMNS, &agent, &ids, queued)?;
                rows.sort_by_key(Queued::order);
                Ok(rows)
            })
            .await
    }

    /// `MailTable::holds_from_before`, for the queue.
    pub async fn holds_from_before(
        &self,
        agent: String,
        message_id: String,
        revision: u64,
    ) -> Result<bool, StoreError> {
        self.store
            .read(move |conn| Ok(QUEUE.holds_from_before(conn, &agent, &message_id, revision)?))
            .await
    }

    /// Removes and returns the queued messages whose ttl ran out by `now` (ms); with
    /// `here_only`, only those this bridge keeps alone (not the fleet's records).
    pub async fn take_expired(&self, now: i64, here_only: bool) -> Result<Vec<Queued>, StoreError> {
        self.store
            .write(move |conn| {
                let mut stmt = conn.prepare_cached(&format!(
                    "DELETE FROM grid_queue WHERE expires_at IS NOT NULL AND expires_at <= ?1
                        AND (NOT ?2 OR fleet_revision IS NULL)
                     RETURNING {QUEUED_COLUMNS}"
                ))?;
                let rows: Vec<Queued> =
                    (stmt.query_map(params![now, here_only], queued)?).collect::<Result<_, _>>()?;
                remember_taken(conn, &rows)?;
                Ok(rows)
            })
            .await
    }

    /// Puts taken messages back where they were (same sequence numbers, so the same
    /// order); one queued again meanwhile is kept once.
    pub async fn restore(&self, rows: Vec<Queued>) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        self.store
            .write(move |conn| {
                let mut stmt = conn.prepare_cached(&format!(
                    "INSERT OR IGNORE INTO grid_queue ({QUEUED_COLUMNS})
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
                ))?;
                for q in rows {
                    stmt.execute(params![
                        q.seq,
                        q.agent,
                        q.message.message_id,
                        q.message.instance,
                        q.message.priority,
                        q.message.ts,
                        q.message.expires_at,
                        q.message.body,
                        q.fleet_revision.map(|r| r as i64)
                    ])?;
                }
                Ok(())
            })
            .await
    }

    /// Keeps `q` for `agent` as the fleet's record holds it at `revision`: queued if it is
    /// not, its revision moved on if it is at an older one; not if this bridge took it at
    /// that revision or a later one. Whether it was queued or moved on.
    pub async fn apply_queued(
        &self,
        agent: String,
        q: ToQueue,
        revision: u64,
    ) -> Result<bool, StoreError> {
        self.store
            .write(move |conn| {
                let mut stmt = conn.prepare_cached(
                    "INSERT INTO grid_queue
                        (agent, message_id, instance, priority, ts, expires_at, body, fleet_revision)
                     SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8
                     WHERE NOT EXISTS (SELECT 1 FROM grid_queue_taken
                        WHERE agent = ?1 AND message_id = ?2 AND fleet_revision >= ?8)
                     ON CONFLICT (agent, message_id) DO UPDATE SET
                        fleet_revision = excluded.fleet_revision
                     WHERE fleet_revision IS NULL OR fleet_revision < excluded.fleet_revision",
                )?;
                let changed = stmt.execute(params![
                    agent,
                    q.message_id,
                    q.instance,
                    q.priority,
                    q.ts,
                    q.expires_at,
                    q.body,
                    revision as i64
                ])?;
                Ok(changed > 0)
            })
            .await
    }

    /// Drops what is queued for `agent` as `message_id` once the fleet took it at
    /// `revision`, unless it was queued again since (a later revision). A row this bridge
    /// keeps alone (no revision: queued, or put back, while NATS was away) stays: a
    /// message may then come twice, but is not lost.
    pub async fn forget_queued(
        &self,
        agent: String,
        message_id: String,
        revision: u64,
    ) -> Result<(), StoreError> {
        self.store
            .write(move |conn| {
                conn.prepare_cached(
                    "DELETE FROM grid_queue WHERE agent = ?1 AND message_id = ?2
                        AND fleet_revision < ?3",
                )?
                .execute(params![agent, message_id, revision as i64])?;
                Ok(())
            })
            .await
    }

    pub async fn position(&self, path: &str) -> Result<Option<Position>, StoreError> {
        let path = path.to_owned();
        self.store
            .read(move |conn| {
                Ok(conn
                    .query_row(
                        "SELECT dev, ino, offset, fingerprint, generation FROM grid_scratchpads
                         WHERE path = ?1",
                        [path],
                        |r| {
                            Ok(Position {
                                dev: r.get::<_, i64>(0)? as u64,
                                ino: r.get::<_, i64>(1)? as u64,
                                offset: r.get::<_, i64>(2)? as u64,
                                fingerprint: r.get(3)?,
                                generation: r.get::<_, i64>(4)? as u64,
                            })
                        },
                    )
                    .optional()?)
            })
            .await
    }

    /// Records what was read, and the entries routed from it, in one commit.
    pub async fn advance(
        &self,
        path: &str,
        position: Position,
        seen: Vec<String>,
    ) -> Result<(), StoreError> {
        let path = path.to_owned();
        self.store
            .write(move |conn| {
                conn.execute(
                    "INSERT INTO grid_scratchpads (path, dev, ino, offset, fingerprint, generation)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                     ON CONFLICT (path) DO UPDATE SET dev = excluded.dev, ino = excluded.ino,
                        offset = excluded.offset, fingerprint = excluded.fingerprint,
                        generation = excluded.generation",
                    params![
                        path,
                        position.dev as i64,
                        position.ino as i64,
                        position.offset as i64,
                        position.fingerprint,
                        position.generation as i64
                    ],
                )?;
                insert_seen(conn, &path, &seen).map(drop)
            })
            .await
    }

    /// Marks entries of `path` as seen, about to be appended; for each, whether it was not
    /// seen before. Those that were not are appending until `appended` or
    /// `forget_seen_entries` says how the append ended.
    pub async fn mark_appending(
        &self,
        path: &str,
        hashes: Vec<String>,
    ) -> Result<Vec<bool>, StoreError> {
        let path = path.to_owned();
        self.store
            .write(move |conn| {
                let new = insert_seen(conn, &path, &hashes)?;
                let mut appending = conn.prepare_cached(
                    "INSERT OR IGNORE INTO grid_scratchpad_appending (path, hash) VALUES (?1, ?2)",
                )?;
                for (hash, _) in hashes.iter().zip(&new).filter(|(_, new)| **new) {
                    appending.execute(params![path, hash])?;
                }
                Ok(new)
            })
            .await
    }

    /// The entries `hashes` of `path` are in the file.
    pub async fn appended(&self, path: &str, hashes: Vec<String>) -> Result<(), StoreError> {
        let path = path.to_owned();
        self.store
            .write(move |conn| delete_entries(conn, "grid_scratchpad_appending", &path, &hashes))
            .await
    }

    /// Forgets that entries `hashes` of `path` were seen (they were not appended after all).
    pub async fn forget_seen_entries(
        &self,
        path: &str,
        hashes: Vec<String>,
    ) -> Result<(), StoreError> {
        let path = path.to_owned();
        self.store
            .write(move |conn| {
                delete_entries(conn, "grid_scratchpad_seen", &path, &hashes)?;
                delete_entries(conn, "grid_scratchpad_appending", &path, &hashes)
            })
            .await
    }

    /// The entries still appending, by file: what a bridge killed mid-append left.
    pub async fn appending(&self) -> Result<Vec<(String, Vec<String>)>, StoreError> {
        self.store
            .read(|conn| {
                let mut stmt =
                    conn.prepare("SELECT path, hash FROM grid_scratchpad_appending ORDER BY path")?;
                let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get(1)?)))?;
                let mut by_path: Vec<(String, Vec<String>)> = Vec::new();
                for row in rows {
                    let (path, hash) = row?;
                    match by_path.last_mut() {
                        Some((last, hashes)) if *last == path => hashes.push(hash),
                        _ => by_path.push((path, vec![hash])),
                    }
                }
                Ok(by_path)
            })
            .await
    }

    /// Forgets the entries seen in `path`: it was rewritten, and what is in it now is new.
    pub async fn forget_seen(&self, path: &str) -> Result<(), StoreError> {
        let path = path.to_owned();
        self.store
            .write(move |conn| {
                conn.execute("DELETE FROM grid_scratchpad_seen WHERE path = ?1", [path])?;
                Ok(())
            })
            .await
    }

    pub async fn seen(&self, path: &str, hash: &str) -> Result<bool, StoreError> {
        let (path, hash) = (path.to_owned(), hash.to_owned());
        self.store
            .read(move |conn| {
                Ok(conn
                    .query_row(
                        "SELECT 1 FROM grid_scratchpad_seen WHERE path = ?1 AND hash = ?2",
                        [path, hash],
                        |_| Ok(()),
                    )
                    .optional()?
                    .is_some())
            })
            .await
    }
}

/// Deletes the rows of `table` (one of the scratchpad's, keyed by path and hash) for
/// `hashes` of `path`.
fn delete_entries(
    conn: &rusqlite::Connection,
    table: &str,
    path: &str,
    hashes: &[String],
) -> Result<(), StoreError> {
    let mut delete = conn.prepare_cached(&format!(
        "DELETE FROM {table} WHERE path = ?1 AND hash = ?2"
    ))?;
    for hash in hashes {
        delete.execute(params![path, hash])?;
    }
    Ok(())
}

/// Marks `hashes` seen in `path`; for each, whether it was not seen before.
fn insert_seen(
    conn: &rusqlite::Connection,
    path: &str,
    hashes: &[String],
) -> Result<Vec<bool>, StoreError> {
    let now = crate::core::now_ms();
    let mut stmt = conn.prepare_cached(
        "INSERT OR IGNORE INTO grid_scratchpad_seen (path, hash, seen_at) VALUES (?1, ?2, ?3)",
    )?;
    let mut new = Vec::with_capacity(hashes.len());
    for hash in hashes {
        new.push(stmt.execute(params![path, hash, now])? > 0);
    }
    Ok(new)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expiring(message_id: &str) -> ToQueue {
        ToQueue {
            message_id: message_id.to_owned(),
            instance: None,
            priority: 1,
            ts: 1_000,
            expires_at: Some(2_000),
            body: "{}".to_owned(),
        }
    }

    #[tokio::test]
    async fn a_sweep_here_only_leaves_the_fleets_expired_mail() {
        let db = Db::open(Store::open(":memory:").await.unwrap())
            .await
            .unwrap();
        let program = || vec!["program".to_owned()];
        db.enqueue(program(), expiring("kept-here")).await.unwrap();
        (db.apply_queued("program".to_owned(), expiring("fleets"), 7))
            .await
            .unwrap();

        let ids = |taken: Vec<Queued>| -> Vec<String> {
            taken.into_iter().map(|q| q.message.message_id).collect()
        };
        assert_eq!(
            ids(db.take_expired(3_000, true).await.unwrap()),
            ["kept-here"]
        );
        assert_eq!(
            ids(db.take_expired(3_000, false).await.unwrap()),
            ["fleets"]
        );
    }

    /// A late copy of a record this bridge took (the watch behind the take, a local apply
    /// held up) is not queued again, and the fleet's removal of the take finds no row; a row put back
    /// after a take whose answer was lost is found, and a later revision is queued again.
    #[tokio::test]
    async fn a_record_taken_here_is_not_queued_again_by_a_late_copy() {
        let db = Db::open(Store::open(":memory:").await.unwrap())
            .await
            .unwrap();
        let (agent, id) = (|| "program".to_owned(), || "m0".to_owned());
        let take = async || db.take("program", None, Instances::All).await.unwrap();
        db.apply_queued(agent(), expiring("m0"), 7).await.unwrap();
        assert_eq!(take().await.len(), 1);
        db.apply_queued(agent(), expiring("m0"), 7).await.unwrap();
        assert!(take().await.is_empty(), "the late copy is not queued");
        assert!(!db.holds_from_before(agent(), id(), 8).await.unwrap());
        // Also once the fleet's removal of the take was applied (a local apply held up).
        db.forget_queued(agent(), id(), 8).await.unwrap();
        db.apply_queued(agent(), expiring("m0"), 7).await.unwrap();
        assert!(take().await.is_empty(), "the late copy is not queued");

        // Taken without an answer, and put back: the removal of the take finds it.
        db.apply_queued(agent(), expiring("m0"), 9).await.unwrap();
        let unanswered = take().await;
        db.restore(unanswered).await.unwrap();
        assert!(db.holds_from_before(agent(), id(), 10).await.unwrap());
    }
}
