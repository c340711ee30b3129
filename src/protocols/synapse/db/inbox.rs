//! The polling inbox: messages kept for Synapse agents that poll (or whose callbacks
//! failed), until fetched; in a fleet, each row applied from the fleet's record of it.

use rusqlite::params;

use super::Db;
use crate::store::{MailTable, StoreError};

impl Db {
    /// Keeps `message` (its id `message_id`) in `agent_id`'s inbox, once: this bridge's
    /// own, or (`fleet_revision`) the fleet's record this bridge took at that revision,
    /// put back.
    pub async fn push_inbox(
        &self,
        agent_id: &str,
        message_id: &str,
        message: Vec<u8>,
        fleet_revision: Option<u64>,
    ) -> Result<(), StoreError> {
        let (agent_id, message_id) = (agent_id.to_owned(), message_id.to_owned());
        let fleet_revision = fleet_revision.map(|r| r as i64);
        self.store
            .write(move |conn| {
                conn.execute(
                    "INSERT OR IGNORE INTO synapse_inbox
                        (agent_id, message_id, message, created_at, fleet_revision)
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                    params![
                        agent_id,
                        message_id,
                        message,
                        crate::core::now_ms(),
                        fleet_revision
                    ],
                )?;
                Ok(())
            })
            .await
    }

    /// Keeps `message` in `agent_id`'s inbox as the fleet's record holds it at `revision`:
    /// kept if it is not, its revision moved on if it is at an older one; not if this
    /// bridge took it at that revision or a later one. Whether it was kept or moved on.
    pub async fn apply_inbox(
        &self,
        agent_id: String,
        message_id: String,
        message: Vec<u8>,
        revision: u64,
    ) -> Result<bool, StoreError> {
        self.store
            .write(move |conn| {
                let changed = conn.prepare_cached(
                    "INSERT INTO synapse_inbox (agent_id, message_id, message, created_at, fleet_revision)
                     SELECT ?1, ?2, ?3, ?4, ?5
                     WHERE NOT EXISTS (SELECT 1 FROM synapse_inbox_taken
                        WHERE agent_id = ?1 AND message_id = ?2 AND fleet_revision >= ?5)
                     ON CONFLICT (agent_id, message_id) DO UPDATE SET
                        fleet_revision = excluded.fleet_revision
                     WHERE fleet_revision IS NULL OR fleet_revision < excluded.fleet_revision",
                )?
                .execute(params![
                    agent_id,
                    message_id,
                    message,
                    crate::core::now_ms(),
                    revision as i64
                ])?;
                Ok(changed > 0)
            })
            .await
    }

    /// Drops `message_id` from `agent_id`'s inbox once the fleet took it at `revision`,
    /// unless it was kept again since (a later revision). A row this bridge keeps alone
    /// (no revision) stays: a message may then come twice, but is not lost.
    pub async fn forget_inbox(
        &self,
        agent_id: String,
        message_id: String,
        revision: u64,
    ) -> Result<(), StoreError> {
        self.store
            .write(move |conn| {
                conn.prepare_cached(
                    "DELETE FROM synapse_inbox WHERE agent_id = ?1 AND message_id = ?2
                        AND fleet_revision < ?3",
                )?
                .execute(params![agent_id, message_id, revision as i64])?;
                Ok(())
            })
            .await
    }

    /// Takes every message waiting for `agent_id`, in inbox order.
    pub async fn take_inbox(&self, agent_id: &str) -> Result<Vec<InboxRow>, StoreError> {
        let agent_id = agent_id.to_owned();
        self.store
            .write(move |conn| {
                let mut stmt = conn.prepare_cached(&format!(
                    "DELETE FROM synapse_inbox WHERE agent_id = ?1 RETURNING {INBOX_COLUMNS}"
                ))?;
                let mut rows: Vec<InboxRow> = stmt
                    .query_map([agent_id], inbox_row)?
                    .collect::<Result<_, _>>()?;
                remember_taken(conn, &rows)?;
                rows.sort_by_key(InboxRow::order);
                Ok(rows)
            })
            .await
    }

    /// Messages `ids` of `agent_id`'s inbox that are still here, in inbox order.
    pub async fn inbox_ids(
        &self,
        agent_id: &str,
        ids: Vec<String>,
    ) -> Result<Vec<InboxRow>, StoreError> {
        let agent_id = agent_id.to_owned();
        self.store
            .read(move |conn| {
                let mut rows = INBOXES.rows_of(conn, INBOX_COLUMNS, &agent_id, &ids, inbox_row)?;
                rows.sort_by_key(InboxRow::order);
                Ok(rows)
            })
            .await
    }

    /// `MailTable::holds_from_before`, for the inboxes.
    pub async fn holds_from_before(
        &self,
        agent_id: String,
        message_id: String,
        revision: u64,
    ) -> Result<bool, StoreError> {
        self.store
            .read(move |conn| {
                Ok(INBOXES.holds_from_before(conn, &agent_id, &message_id, revision)?)
            })
            .await
    }

    /// Puts taken messages back where they were (same sequence numbers, so the same
    /// order); one kept again meanwhile is kept once.
    pub async fn restore_inbox(&self, rows: Vec<InboxRow>) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        self.store
            .write(move |conn| {
                let mut stmt = conn.prepare_cached(&format!(
                    "INSERT OR IGNORE INTO synapse_inbox ({INBOX_COLUMNS})
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)"
                ))?;
                for row in rows {
                    stmt.execute(params![
                        row.seq,
                        row.agent_id,
                        row.message_id,
                        row.message,
                        row.created_at,
                        row.fleet_revision.map(|r| r as i64)
                    ])?;
                }
                Ok(())
            })
            .await
    }
}

/// The inboxes, as a table of fleet mail.
const INBOXES: MailTable = MailTable {
    name: "synapse_inbox",
    agent: "agent_id",
    taken: "synapse_inbox_taken",
};

/// Remembers, in the taking transaction, the fleet's records among `rows` as taken here.
fn remember_taken(conn: &rusqlite::Connection, rows: &[InboxRow]) -> rusqlite::Result<()> {
    let taken = rows.iter().filter_map(|row| {
        let (id, revision) = (row.message_id.as_deref()?, row.fleet_revision?);
        Some((row.agent_id.as_str(), id, revision))
    });
    INBOXES.remember_taken(conn, taken)
}

/// The columns of an `InboxRow`, in `inbox_row`'s order.
const INBOX_COLUMNS: &str = "seq, agent_id, message_id, message, created_at, fleet_revision";

fn inbox_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<InboxRow> {
    Ok(InboxRow {
        seq: r.get(0)?,
        agent_id: r.get(1)?,
        message_id: r.get(2)?,
        message: r.get(3)?,
        created_at: r.get(4)?,
        fleet_revision: r.get::<_, Option<i64>>(5)?.map(|r| r as u64),
    })
}

/// A message in an inbox: a row of `synapse_inbox`, whole, so that one taken can be put back.
#[derive(Clone, Debug, PartialEq)]
pub struct InboxRow {
    pub seq: i64,
    pub agent_id: String,
    /// `None` for a message kept before ids were (it is taken like any other).
    pub message_id: Option<String>,
    /// The `SynapseMessage`, encoded.
    pub message: Vec<u8>,
    pub created_at: i64,
    /// The revision of the fleet's record it was applied from, in a fleet.
    pub fleet_revision: Option<u64>,
}

impl InboxRow {
    /// Inbox order: the fleet's order of its records, then this bridge's (what this bridge
    /// alone keeps, while NATS is away, after the fleet's).
    fn order(&self) -> (bool, Option<u64>, i64) {
        (self.fleet_revision.is_none(), self.fleet_revision, self.seq)
    }
}
