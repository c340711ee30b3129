//! What the endpoints' tables of fleet mail (Grid's queue, Synapse's inboxes) ask of
//! SQLite alike: beside each, a table of the fleet's records the bridge took lately, at the
//! revision taken (`core::LATE_COPY_WINDOW`: a late copy of a taken record is not kept
//! again), and the rows a settling of unsure mail reads (`core::UnsettledMail`). Each
//! endpoint's migrations make its tables; this names them and their agent column.

use rusqlite::{Connection, Row, params};

/// A table of fleet mail: one row per agent and message id, with `fleet_revision`.
pub struct MailTable {
    /// The mail table.
    pub name: &'static str,
    /// Its column naming the agent.
    pub agent: &'static str,
    /// The table of revisions taken lately (`agent`, `message_id`, `fleet_revision`,
    /// `taken_ms`).
    pub taken: &'static str,
}

impl MailTable {
    /// Remembers, in the taking transaction, the fleet's records `taken` (agent, message
    /// id, revision taken) as taken here, and forgets what was taken longer ago.
    pub fn remember_taken<'a>(
        &self,
        conn: &Connection,
        taken: impl IntoIterator<Item = (&'a str, &'a str, u64)>,
    ) -> rusqlite::Result<()> {
        let mut taken = taken.into_iter().peekable();
        if taken.peek().is_none() {
            return Ok(());
        }
        let now = crate::core::now_ms();
        let window = crate::core::LATE_COPY_WINDOW.as_millis() as i64;
        let forget = format!("DELETE FROM {} WHERE taken_ms < ?1", self.taken);
        conn.prepare_cached(&forget)?.execute([now - window])?;
        let mut stmt = conn.prepare_cached(&format!(
            "INSERT INTO {taken} ({agent}, message_id, fleet_revision, taken_ms)
             VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT ({agent}, message_id) DO UPDATE SET
                fleet_revision = max(fleet_revision, excluded.fleet_revision),
                taken_ms = excluded.taken_ms",
            taken = self.taken,
            agent = self.agent,
        ))?;
        for (agent, message_id, revision) in taken {
            stmt.execute(params![agent, message_id, revision as i64, now])?;
        }
        Ok(())
    }

    /// Whether a row of `message_id` for `agent` from before `revision` is still here:
    /// asked as the fleet's removal, at `revision`, of this bridge's own take is applied,
    /// it is one put back after a take whose answer was lost.
    pub fn holds_from_before(
        &self,
        conn: &Connection,
        agent: &str,
        message_id: &str,
        revision: u64,
    ) -> rusqlite::Result<bool> {
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT 1 FROM {} WHERE {} = ?1 AND message_id = ?2 AND fleet_revision < ?3",
            self.name, self.agent
        ))?;
        stmt.exists(params![agent, message_id, revision as i64])
    }

    /// The rows of messages `ids` for `agent` still here (`columns`, read by `row`), in no
    /// particular order.
    pub fn rows_of<T>(
        &self,
        conn: &Connection,
        columns: &str,
        agent: &str,
        ids: &[String],
        row: impl Fn(&Row<'_>) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<Vec<T>> {
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {columns} FROM {} WHERE {} = ?1 AND message_id = ?2",
            self.name, self.agent
        ))?;
        let mut rows = Vec::new();
        for id in ids {
            for found in stmt.query_map(params![agent, id], &row)? {
                rows.push(found?);
            }
        }
        Ok(rows)
    }
}
