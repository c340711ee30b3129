//! The schedules' table. A row carries the fleet's revision it was written from, so that
//! of two writes racing to the table (a change made here, the watch's copy of a later one)
//! the later revision stays.

use rusqlite::params;
use serde_json::Value;

use super::Schedule;
use crate::core::Revision;
use crate::store::{Migration, Store, StoreError};

static MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    sql: "
        CREATE TABLE skynet_schedules (
            id            TEXT PRIMARY KEY,
            name          TEXT NOT NULL,
            cron_expr     TEXT NOT NULL,
            agent_id      TEXT NOT NULL,
            task_template TEXT NOT NULL,
            enabled       INTEGER NOT NULL,
            created_by    TEXT,
            last_run_at   INTEGER,
            created_at    INTEGER NOT NULL,
            updated_at    INTEGER NOT NULL,
            revision      INTEGER
        );
    ",
}];

/// A stored schedule, with when it last ran here.
pub struct Row {
    pub schedule: Schedule,
    pub last_run_at: Option<i64>,
}

#[derive(Clone)]
pub struct Table(Store);

impl Table {
    pub async fn open(store: Store) -> Result<Table, StoreError> {
        store.migrate("skynet-schedules", MIGRATIONS).await?;
        Ok(Table(store))
    }

    pub async fn all(&self) -> Result<Vec<Row>, StoreError> {
        self.0
            .read(|conn| {
                let mut select = conn.prepare(
                    "SELECT id, name, cron_expr, agent_id, task_template, enabled, created_by,
                            last_run_at, created_at, updated_at
                     FROM skynet_schedules ORDER BY rowid",
                )?;
                let rows = select.query_map([], |r| {
                    let template: String = r.get(4)?;
                    Ok(Row {
                        schedule: Schedule {
                            id: r.get(0)?,
                            name: r.get(1)?,
                            cron_expr: r.get(2)?,
                            agent_id: r.get(3)?,
                            task_template: serde_json::from_str(&template).unwrap_or(Value::Null),
                            enabled: r.get(5)?,
                            created_by: r.get(6)?,
                            created_at: r.get(8)?,
                            updated_at: r.get(9)?,
                        },
                        last_run_at: r.get(7)?,
                    })
                })?;
                Ok(rows.collect::<Result<Vec<_>, _>>()?)
            })
            .await
    }

    /// Writes `schedule` at `revision`, unless the row holds a later one; whether it did.
    pub async fn upsert(
        &self,
        schedule: &Schedule,
        revision: Option<Revision>,
    ) -> Result<bool, StoreError> {
        let row = schedule.clone();
        let template = row.task_template.to_string();
        let revision = revision.map(|r| r as i64);
        self.0
            .write(move |conn| {
                let written = conn.execute(
                    "INSERT INTO skynet_schedules
                        (id, name, cron_expr, agent_id, task_template, enabled, created_by,
                         created_at, updated_at, revision)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
                     ON CONFLICT (id) DO UPDATE SET name = ?2, cron_expr = ?3, agent_id = ?4,
                        task_template = ?5, enabled = ?6, created_by = ?7, created_at = ?8,
                        updated_at = ?9, revision = ?10
                     WHERE ?10 IS NULL OR revision IS NULL OR revision <= ?10",
                    params![
                        row.id,
                        row.name,
                        row.cron_expr,
                        row.agent_id,
                        template,
                        row.enabled,
                        row.created_by,
                        row.created_at,
                        row.updated_at,
                        revision
                    ],
                )?;
                Ok(written > 0)
            })
            .await
    }

    pub async fn delete(&self, id: &str) -> Result<(), StoreError> {
        let id = id.to_owned();
        self.0
            .write(move |conn| {
                conn.execute("DELETE FROM skynet_schedules WHERE id = ?1", [id])?;
                Ok(())
            })
            .await
    }

    /// Notes when schedule `id` last ran here, for `lastRunAt` after a restart.
    pub async fn ran(&self, id: &str, at: i64) -> Result<(), StoreError> {
        let id = id.to_owned();
        self.0
            .write(move |conn| {
                conn.execute(
                    "UPDATE skynet_schedules SET last_run_at = ?2 WHERE id = ?1",
                    params![id, at],
                )?;
                Ok(())
            })
            .await
    }
}
