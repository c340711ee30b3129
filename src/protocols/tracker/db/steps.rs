//! A task's steps (its checklist), read and changed as one list: a change edits the list
//! and writes it back whole, in one transaction here, or at a revision of the fleet's
//! record (`apply_steps`, idempotent by revision).

use rusqlite::{Connection, OptionalExtension, Row, params};

use super::{Db, StepRow};
use crate::store::StoreError;

/// What applying a revision of a task's steps did.
#[derive(Debug, PartialEq, Eq)]
pub enum StepsApplied {
    Applied,
    /// That revision or a later one was applied already.
    Stale,
    /// The task is not here (yet): its record comes by another watch.
    NoTask,
}

impl Db {
    pub async fn steps(&self, task_id: &str) -> Result<Vec<StepRow>, StoreError> {
        let task_id = task_id.to_owned();
        self.store
            .read(move |conn| read_steps(conn, &task_id))
            .await
    }

    /// Edits task `task_id`'s steps with `edit` and keeps what it leaves, in one
    /// transaction; what `edit` returned.
    pub async fn change_steps<R: Send + 'static>(
        &self,
        task_id: &str,
        edit: impl FnOnce(&mut Vec<StepRow>) -> R + Send + 'static,
    ) -> Result<R, StoreError> {
        let task_id = task_id.to_owned();
        self.store
            .write(move |conn| {
                let mut steps = read_steps(conn, &task_id)?;
                let before = steps.clone();
                let out = edit(&mut steps);
                if steps != before {
                    write_steps(conn, &task_id, &steps)?;
                }
                Ok(out)
            })
            .await
    }

    /// Makes task `task_id`'s steps what revision `revision` of the fleet's record says,
    /// unless it or a later one was applied.
    pub async fn apply_steps(
        &self,
        task_id: &str,
        steps: Vec<StepRow>,
        revision: u64,
    ) -> Result<StepsApplied, StoreError> {
        let task_id = task_id.to_owned();
        self.store
            .write(move |conn| {
                let task: Option<i64> = conn
                    .query_row("SELECT 1 FROM tracker_tasks WHERE id = ?1", [&task_id], |r| {
                        r.get(0)
                    })
                    .optional()?;
                if task.is_none() {
                    return Ok(StepsApplied::NoTask);
                }
                let applied: Option<i64> = conn
                    .query_row(
                        "SELECT revision FROM tracker_steps_revisions WHERE task_id = ?1",
                        [&task_id],
                        |r| r.get(0),
                    )
                    .optional()?;
                if applied.is_some_and(|applied| applied as u64 >= revision) {
                    return Ok(StepsApplied::Stale);
                }
                write_steps(conn, &task_id, &steps)?;
                conn.execute(
                    "INSERT OR REPLACE INTO tracker_steps_revisions (task_id, revision) VALUES (?1, ?2)",
                    params![task_id, revision as i64],
                )?;
                Ok(StepsApplied::Applied)
            })
            .await
    }
}

fn read_steps(conn: &Connection, task_id: &str) -> Result<Vec<StepRow>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, task_id, title, done, position, created_at FROM tracker_steps
         WHERE task_id = ?1 ORDER BY position, created_at",
    )?;
    let rows = stmt.query_map([task_id], step_from)?;
    Ok(rows.collect::<Result<_, _>>()?)
}

fn write_steps(conn: &Connection, task_id: &str, steps: &[StepRow]) -> Result<(), StoreError> {
    conn.execute("DELETE FROM tracker_steps WHERE task_id = ?1", [task_id])?;
    let mut insert = conn.prepare_cached(
        "INSERT INTO tracker_steps (id, task_id, title, done, position, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?;
    for step in steps {
        insert.execute(params![
            step.id,
            task_id,
            step.title,
            step.done,
            step.position,
            step.created_at
        ])?;
    }
    Ok(())
}

fn step_from(row: &Row) -> rusqlite::Result<StepRow> {
    Ok(StepRow {
        id: row.get(0)?,
        task_id: row.get(1)?,
        title: row.get(2)?,
        done: row.get(3)?,
        position: row.get(4)?,
        created_at: row.get(5)?,
    })
}
