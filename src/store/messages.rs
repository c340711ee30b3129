//! The message log: every accepted envelope, written before it is delivered.
//!
//! Each message is a row: the columns the replay queries filter on (time, recipients,
//! reply links), and its body, the rest of the envelope as JSON (message_body.rs).

use rusqlite::{Connection, OptionalExtension};

use super::message_body::{self, Columns};
use super::{Batch, Store, StoreError};
use crate::core::{Envelope, Link, MessageQuery, StoredMessage, TaskRequest};

mod chunks;
mod migrations;
mod row;
#[cfg(test)]
mod tests;

pub(super) use chunks::{ROWS_PER_STATEMENT, put_journaled_in};
pub(super) use migrations::MIGRATIONS;
pub(super) use row::{Row, record};

/// The message whose id is `?1`: one whose id is its own UUID form is found by it.
const BY_OWN_UUID: &str = "SELECT id FROM messages WHERE id = ?1";

/// The bits of a message's number above which `messages_by_uuid` groups derived UUIDs
/// (migration 11, whose expression `BY_DERIVED_UUID` repeats; a test holds the three
/// equal): a stretch holds 16,384 messages.
const UUID_STRETCH_BITS: u32 = 14;

/// The message whose derived UUID is `?2`, searched for by `messages_by_uuid` in each
/// stretch through `?1`, all in one statement (the terms of the index repeated, so that
/// the planner uses it). One index search a stretch: about a millisecond for a
/// store of ten million messages, and the core asks only for messages older than those it
/// remembers.
const BY_DERIVED_UUID: &str = "WITH RECURSIVE stretch(k) AS (
                                   SELECT ?1 UNION ALL SELECT k - 1 FROM stretch WHERE k > 0)
                               SELECT id FROM messages
                               WHERE seq >> 14 IN (SELECT k FROM stretch)
                                 AND uuid = ?2 AND uuid <> id AND uuid <> ''
                               LIMIT 1";

/// Records the last journal record a batch put in, in that batch.
pub(super) const SET_APPLIED: &str = "UPDATE journal SET applied = ?1";
/// The last journal record the database holds.
pub(super) const APPLIED: &str = "SELECT applied FROM journal";

impl Store {
    /// Writes `env` to the log, replacing a stored message with the same id. The write is
    /// queued at the call (see `Store::write`); the future resolves once it is durable.
    pub fn insert_message(
        &self,
        env: &Envelope,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'static {
        let queued = record(env).map(|record| self.queue_message(&env.id, record));
        async move { queued?.await }
    }

    pub async fn message(&self, id: &str) -> Result<Option<StoredMessage>, StoreError> {
        let id = id.to_owned();
        self.read_messages(move |conn| {
            conn.query_row(
                &format!("SELECT {STORED} FROM messages WHERE id = ?1"),
                [id],
                stored,
            )
            .optional()?
            .map(decode)
            .transpose()
        })
        .await
    }

    /// The stored messages with these ids, in the order asked; ids not stored are left out.
    pub async fn messages_by_id(&self, ids: Vec<String>) -> Result<Vec<StoredMessage>, StoreError> {
        self.read_messages(move |conn| {
            let mut statement =
                conn.prepare_cached(&format!("SELECT {STORED} FROM messages WHERE id = ?1"))?;
            let mut out = Vec::with_capacity(ids.len());
            for id in &ids {
                let Some(row) = statement.query_row([id], stored).optional()? else {
                    continue;
                };
                // One row that cannot be read back does not keep the others from their
                // recipient: it is left out (the recipient hears of it as a drop) and logged.
                match decode(row) {
                    Ok(message) => out.push(message),
                    Err(e) => tracing::error!(id, error = %e, "a stored message cannot be decoded"),
                }
            }
            Ok(out)
        })
        .await
    }

    /// Whether a message with this id is stored (without reading it back).
    pub async fn has_message(&self, id: &str) -> Result<bool, StoreError> {
        // Acknowledged but not yet in the database: asked first, for a message moves from
        // there to the database, never back.
        if self.is_unapplied(id) {
            return Ok(true);
        }
        let id = id.to_owned();
        self.read(move |conn| {
            Ok(conn
                .prepare_cached("SELECT 1 FROM messages WHERE id = ?1")?
                .exists([id])?)
        })
        .await
    }

    /// A stored message's place in its conversation.
    pub async fn link(&self, id: &str) -> Result<Option<Link>, StoreError> {
        let id = id.to_owned();
        self.read_messages(move |conn| {
            Ok(conn
                .prepare_cached(
                    "SELECT reply_to, COALESCE(correlation_id, id), sender,
                            CASE WHEN kind = 'task.assign' THEN task_id END,
                            kind = 'decision.request'
                     FROM messages WHERE id = ?1",
                )?
                .query_row([id], |r| {
                    Ok(Link {
                        reply_to: r.get(0)?,
                        root: r.get(1)?,
                        from: r.get(2)?,
                        task_id: r.get(3)?,
                        asks_decision: r.get(4)?,
                    })
                })
                .optional()?)
        })
        .await
    }

    /// The latest message that assigned task `task_id`.
    pub async fn task_request(&self, task_id: &str) -> Result<Option<TaskRequest>, StoreError> {
        let task_id = task_id.to_owned();
        self.read_messages(move |conn| {
            Ok(conn
                .prepare_cached(
                    "SELECT id, sender FROM messages WHERE task_id = ?1 AND kind = 'task.assign'
                     ORDER BY seq DESC LIMIT 1",
                )?
                .query_row([task_id], |r| {
                    Ok(TaskRequest {
                        message_id: r.get(0)?,
                        requester: r.get(1)?,
                    })
                })
                .optional()?)
        })
        .await
    }

    /// Messages that answer `id` (whose `reply_to` is `id`), oldest first.
    pub async fn replies(&self, id: &str) -> Result<Vec<StoredMessage>, StoreError> {
        let id = id.to_owned();
        self.read_messages(move |conn| {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {STORED} FROM messages WHERE reply_to = ?1 ORDER BY ts, seq"
            ))?;
            let rows = stmt.query_map([id], stored)?;
            rows.map(|r| decode(r?)).collect()
        })
        .await
    }

    /// The id of the stored message whose UUID form is `uuid`; none for text that is not a
    /// UUID, without a search.
    pub async fn message_id_by_uuid(&self, uuid: &str) -> Result<Option<String>, StoreError> {
        if uuid::Uuid::try_parse(uuid).is_err() {
            return Ok(None);
        }
        let uuid = uuid.to_owned();
        self.read_messages(move |conn| {
            let own = conn
                .prepare_cached(BY_OWN_UUID)?
                .query_row([&uuid], |r| r.get(0));
            if let Some(id) = own.optional()? {
                return Ok(Some(id));
            }
            let last: Option<i64> = conn
                .prepare_cached("SELECT max(seq) FROM messages")?
                .query_row([], |r| r.get(0))?;
            let Some(last) = last else {
                return Ok(None);
            };
            Ok(conn
                .prepare_cached(BY_DERIVED_UUID)?
                .query_row(rusqlite::params![last >> UUID_STRETCH_BITS, uuid], |r| {
                    r.get(0)
                })
                .optional()?)
        })
        .await
    }

    pub async fn messages(&self, query: MessageQuery) -> Result<Vec<StoredMessage>, StoreError> {
        self.read_messages(move |conn| select(conn, &query)).await
    }
}

/// Puts in the messages the journal in `dir` holds after the last one the database has
/// (a bridge killed before its writer caught up); the number for the next record, and the
/// segments read, which may go once this commits.
pub(super) fn recover(
    batch: &mut Batch<'_>,
    dir: &std::path::Path,
) -> Result<(u64, Vec<std::path::PathBuf>), StoreError> {
    let unreadable = |source| StoreError::DataDir {
        path: dir.to_owned(),
        source,
    };
    let applied: i64 = batch.conn().query_row(APPLIED, [], |r| r.get(0))?;
    let applied = u64::try_from(applied)
        .map_err(|_| StoreError::Corrupt(format!("journal.applied is {applied}")))?;
    let mut last = applied;
    let segments = super::journal::segments(dir).map_err(unreadable)?;
    let mut recovered = 0;
    for segment in &segments {
        let bytes = std::fs::read(segment).map_err(unreadable)?;
        let mut rows = Vec::new();
        for (number, payload) in super::journal::records(&bytes) {
            if number <= applied {
                continue;
            }
            let row = Row::decode(payload).ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "journal record {number} in {} is not a message",
                    segment.display()
                ))
            })?;
            rows.push(row);
            last = last.max(number);
        }
        put_journaled_in(&rows, batch)?;
        recovered += rows.len();
    }
    if recovered > 0 {
        batch.statement(SET_APPLIED)?.execute([last as i64])?;
        tracing::info!(
            messages = recovered,
            "store: put in the messages the journal held"
        );
    }
    Ok((last + 1, segments))
}

fn select(conn: &Connection, q: &MessageQuery) -> Result<Vec<StoredMessage>, StoreError> {
    let mut sql = format!("SELECT {STORED} FROM messages m WHERE 1 = 1");
    let mut args: Vec<rusqlite::types::Value> = Vec::new();
    if let Some(before) = q.before {
        sql.push_str(" AND m.ts < ?");
        args.push(before.into());
    }
    if let Some(after) = q.after {
        sql.push_str(" AND m.ts > ?");
        args.push(after.into());
    }
    if let Some(root) = &q.conversation {
        sql.push_str(" AND (m.correlation_id = ? OR m.id = ?)");
        args.push(root.clone().into());
        args.push(root.clone().into());
    }
    match &q.thread {
        None => {}
        Some(None) => sql.push_str(" AND m.thread IS NULL"),
        Some(Some(thread)) => {
            sql.push_str(" AND m.thread = ?");
            args.push(thread.clone().into());
        }
    }
    if q.public_only {
        sql.push_str(" AND m.private = 0");
    }
    if let Some(kinds) = &q.kinds {
        sql.push_str(" AND m.kind IN (");
        push_placeholders(&mut sql, kinds.len());
        sql.push(')');
        args.extend(
            kinds
                .iter()
                .map(|k| rusqlite::types::Value::from(k.to_string())),
        );
    }
    if let Some(names) = &q.recipients {
        sql.push_str(" AND (");
        if q.or_everyone {
            sql.push_str("m.everyone = 1 OR ");
        }
        sql.push_str("m.seq IN (SELECT seq FROM message_recipients WHERE name IN (");
        push_placeholders(&mut sql, names.len());
        sql.push_str(")))");
        args.extend(
            names
                .iter()
                .map(|n| rusqlite::types::Value::from(n.clone())),
        );
    }
    sql.push_str(" ORDER BY m.ts DESC, m.seq DESC LIMIT ?");
    args.push((q.limit as i64).into());

    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(rusqlite::params_from_iter(args), stored)?;
    let mut out: Vec<StoredMessage> = rows.map(|r| decode(r?)).collect::<Result<_, _>>()?;
    out.reverse();
    Ok(out)
}

fn push_placeholders(sql: &mut String, n: usize) {
    for i in 0..n.max(1) {
        sql.push_str(if i == 0 { "?" } else { ", ?" });
    }
}

/// What a message is read back from: `seq`, the columns its envelope takes back, `body`.
pub(super) const STORED: &str =
    "seq, id, ts, sender, reply_to, correlation_id, thread, origin, body";

/// One row selected as `STORED`.
fn stored(row: &rusqlite::Row<'_>) -> rusqlite::Result<(i64, Columns, String)> {
    Ok((row.get(0)?, Columns::read(row, 1)?, row.get(8)?))
}

/// The messages `statement` (selecting `STORED`) gives for `params`, in its order: a row
/// that cannot be read back is left out and logged, rather than keeping the others back.
pub(super) fn decodable(
    statement: &mut rusqlite::CachedStatement<'_>,
    params: impl rusqlite::Params,
) -> Result<Vec<StoredMessage>, StoreError> {
    let mut messages = Vec::new();
    for row in statement.query_map(params, stored)? {
        match decode(row?) {
            Ok(message) => messages.push(message),
            Err(e) => tracing::error!(error = %e, "a stored message cannot be decoded"),
        }
    }
    Ok(messages)
}

fn decode((seq, columns, body): (i64, Columns, String)) -> Result<StoredMessage, StoreError> {
    let envelope = message_body::decode(columns, &body)
        .map_err(|e| StoreError::Corrupt(format!("message {seq}: {e}")))?;
    Ok(StoredMessage { seq, envelope })
}
