//! The Tracker's task rows: the select every read shares, inserts, atomic changes, the
//! rows a fleet's records are applied to (idempotent by revision, removals kept), and
//! watchers.

use rusqlite::{Connection, OptionalExtension, Row, params};

use super::{Db, TaskFilter, TaskRow, corrupt};
use crate::protocols::tracker::wire::{Priority, TaskStatus, TaskType};
use crate::store::StoreError;

/// Told of a task's change (the row before, if any, and after) once the write that makes
/// it commits, in the order changes commit (`Store::write_then`); the writes' callers,
/// woken together, do not keep that order.
pub trait TaskChanged: FnOnce(Option<&TaskRow>, &TaskRow) + Send + 'static {}
impl<F: FnOnce(Option<&TaskRow>, &TaskRow) + Send + 'static> TaskChanged for F {}

impl Db {
    pub async fn task(&self, id: &str) -> Result<Option<TaskRow>, StoreError> {
        let id = id.to_owned();
        self.store.read(move |conn| get_task(conn, &id)).await
    }

    pub async fn tasks(&self, filter: TaskFilter) -> Result<Vec<TaskRow>, StoreError> {
        self.store
            .read(move |conn| {
                let mut sql = format!("{TASK_SELECT} WHERE 1 = 1");
                let mut args: Vec<String> = Vec::new();
                if let Some(project) = &filter.project_id {
                    args.push(project.clone());
                    sql.push_str(&format!(" AND t.project_id = ?{}", args.len()));
                }
                if let Some(status) = filter.status {
                    args.push(status.as_str().to_owned());
                    sql.push_str(&format!(" AND t.status = ?{}", args.len()));
                }
                if let Some(assignee) = &filter.assignee {
                    args.push(assignee.clone());
                    sql.push_str(&format!(" AND t.assignee_slug = ?{}", args.len()));
                }
                sql.push_str(" ORDER BY t.created_at, t.rowid");
                let mut stmt = conn.prepare(&sql)?;
                let mut rows = stmt.query(rusqlite::params_from_iter(args))?;
                let mut out = Vec::new();
                while let Some(row) = rows.next()? {
                    out.push(task_from(row)?);
                }
                Ok(out)
            })
            .await
    }

    /// Inserts `task`; `changed` is told of it as it commits (`TaskChanged`).
    pub async fn insert_task(
        &self,
        task: TaskRow,
        changed: impl TaskChanged,
    ) -> Result<TaskRow, StoreError> {
        self.store
            .write_then(
                move |conn| {
                    write_task(conn, &task, 0, "")?;
                    get_task(conn, &task.id)?
                        .ok_or_else(|| StoreError::Corrupt("task vanished".into()))
                },
                move |task| changed(None, task),
            )
            .await
    }

    /// Applies `change` to the stored task atomically; returns (before, after), or `None`
    /// when there is no such task. `change` may refuse by returning `Err(reason)`.
    /// `changed` is told of a change as it commits (`TaskChanged`).
    pub async fn update_task<F>(
        &self,
        id: &str,
        change: F,
        changed: impl TaskChanged,
    ) -> Result<Option<Result<(TaskRow, TaskRow), String>>, StoreError>
    where
        F: FnOnce(&mut TaskRow) -> Result<(), String> + Send + 'static,
    {
        let id = id.to_owned();
        let committed = move |updated: &Option<Result<(TaskRow, TaskRow), String>>| {
            if let Some(Ok((before, after))) = updated
                && before != after
            {
                changed(Some(before), after);
            }
        };
        self.store
            .write_then(
                move |conn| {
                    let Some(before) = get_task(conn, &id)? else {
                        return Ok(None);
                    };
                    let mut after = before.clone();
                    if let Err(reason) = change(&mut after) {
                        return Ok(Some(Err(reason)));
                    }
                    if after == before {
                        // Nothing changed: no write, and `updated_at` stays, so no event follows.
                        return Ok(Some(Ok((before, after))));
                    }
                    after.updated_at = crate::core::now_ms();
                    conn.execute(
                        "UPDATE tracker_tasks SET title = ?2, description = ?3, status = ?4, type = ?5,
                            priority = ?6, assignee_slug = ?7, reviewer_slug = ?8,
                            delegation_message_id = ?9, updated_at = ?10
                         WHERE id = ?1",
                        params![
                            id,
                            after.title,
                            after.description,
                            after.status.as_str(),
                            after.task_type.as_str(),
                            after.priority.as_str(),
                            after.assignee_slug,
                            after.reviewer_slug,
                            after.delegation_message_id,
                            after.updated_at
                        ],
                    )?;
                    set_watchers(conn, &id, &before.watchers, &after.watchers)?;
                    let after = get_task(conn, &id)?
                        .ok_or_else(|| StoreError::Corrupt("task vanished".into()))?;
                    Ok(Some(Ok((before, after))))
                },
                committed,
            )
            .await
    }

    /// Makes the task's row what the fleet's record at `revision` says, unless a record
    /// as new or newer was applied: (the row before, if any; the row after), or `None`.
    /// `changed` is told of a change as it commits (`TaskChanged`).
    pub async fn apply_task(
        &self,
        task: TaskRow,
        revision: u64,
        changed: impl TaskChanged,
    ) -> Result<Option<(Option<TaskRow>, TaskRow)>, StoreError> {
        let committed = move |applied: &Option<(Option<TaskRow>, TaskRow)>| {
            if let Some((before, after)) = applied {
                changed(before.as_ref(), after);
            }
        };
        self.store
            .write_then(move |conn| {
                let applied: Option<i64> = conn
                    .query_row(
                        "SELECT fleet_revision FROM tracker_tasks WHERE id = ?1",
                        [&task.id],
                        |r| r.get(0),
                    )
                    .optional()?;
                if is_removed(conn, &task.id)? || applied.is_some_and(|applied| applied >= revision as i64) {
                    return Ok(None);
                }
                let before = get_task(conn, &task.id)?;
                write_task(
                    conn,
                    &task,
                    revision as i64,
                    "ON CONFLICT (id) DO UPDATE SET title = excluded.title,
                        description = excluded.description, status = excluded.status,
                        type = excluded.type, priority = excluded.priority,
                        assignee_slug = excluded.assignee_slug, reviewer_slug = excluded.reviewer_slug,
                        delegation_message_id = excluded.delegation_message_id,
                        updated_at = excluded.updated_at, fleet_revision = excluded.fleet_revision",
                )?;
                let watched = before.as_ref().map_or(&[][..], |b| &b.watchers[..]);
                set_watchers(conn, &task.id, watched, &task.watchers)?;
                let after = get_task(conn, &task.id)?
                    .ok_or_else(|| StoreError::Corrupt("task vanished".into()))?;
                Ok(Some((before, after)))
            }, committed)
            .await
    }

    /// Deletes the task the fleet removed, for good: no later write of it is applied.
    pub async fn remove_task(&self, id: &str) -> Result<Option<TaskRow>, StoreError> {
        let id = id.to_owned();
        self.store
            .write(move |conn| {
                let task = delete_row(conn, &id)?;
                conn.execute(
                    "INSERT OR IGNORE INTO tracker_removed_tasks (id) VALUES (?1)",
                    [&id],
                )?;
                Ok(task)
            })
            .await
    }

    /// Whether the fleet removed task `id`.
    pub async fn is_removed(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_owned();
        self.store.read(move |conn| is_removed(conn, &id)).await
    }

    pub async fn delete_task(&self, id: &str) -> Result<Option<TaskRow>, StoreError> {
        let id = id.to_owned();
        self.store.write(move |conn| delete_row(conn, &id)).await
    }
}

const TASK_SELECT: &str = "
    SELECT t.id, t.project_id, p.slug, t.title, t.description, t.status, t.type, t.priority,
           t.assignee_slug, t.reviewer_slug, t.author_slug, t.external_id, t.requester,
           t.request_message_id, t.delegation_message_id, t.created_at, t.updated_at,
           (SELECT group_concat(slug, char(31)) FROM tracker_task_watchers w WHERE w.task_id = t.id)
    FROM tracker_tasks t JOIN tracker_projects p ON p.id = t.project_id";

fn task_from(row: &Row) -> Result<TaskRow, StoreError> {
    let status: String = row.get(5)?;
    let task_type: String = row.get(6)?;
    let priority: String = row.get(7)?;
    let watchers: Option<String> = row.get(17)?;
    Ok(TaskRow {
        id: row.get(0)?,
        project_id: row.get(1)?,
        project_slug: row.get(2)?,
        title: row.get(3)?,
        description: row.get(4)?,
        status: TaskStatus::parse(&status).ok_or_else(|| corrupt("status", &status))?,
        task_type: TaskType::parse(&task_type).ok_or_else(|| corrupt("type", &task_type))?,
        priority: Priority::parse(&priority).ok_or_else(|| corrupt("priority", &priority))?,
        assignee_slug: row.get(8)?,
        reviewer_slug: row.get(9)?,
        author_slug: row.get(10)?,
        external_id: row.get(11)?,
        requester: row.get(12)?,
        request_message_id: row.get(13)?,
        delegation_message_id: row.get(14)?,
        created_at: row.get(15)?,
        updated_at: row.get(16)?,
        watchers: watchers
            .map(|w| {
                let mut list: Vec<String> = w.split('\u{1f}').map(str::to_owned).collect();
                list.sort();
                list
            })
            .unwrap_or_default(),
    })
}

/// Inserts `task`'s row, written from the fleet's record at `revision` (0 for none), with
/// `on_conflict` after the values.
fn write_task(
    conn: &Connection,
    task: &TaskRow,
    revision: i64,
    on_conflict: &str,
) -> Result<(), StoreError> {
    conn.execute(
        &format!(
            "INSERT INTO tracker_tasks (id, project_id, title, description, status, type, priority,
                assignee_slug, reviewer_slug, author_slug, external_id, requester, request_message_id,
                delegation_message_id, created_at, updated_at, fleet_revision)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)
             {on_conflict}"
        ),
        params![
            task.id,
            task.project_id,
            task.title,
            task.description,
            task.status.as_str(),
            task.task_type.as_str(),
            task.priority.as_str(),
            task.assignee_slug,
            task.reviewer_slug,
            task.author_slug,
            task.external_id,
            task.requester,
            task.request_message_id,
            task.delegation_message_id,
            task.created_at,
            task.updated_at,
            revision
        ],
    )?;
    Ok(())
}

/// Deletes task `id`'s row: the row it was, if any.
fn delete_row(conn: &Connection, id: &str) -> Result<Option<TaskRow>, StoreError> {
    let task = get_task(conn, id)?;
    if task.is_some() {
        conn.execute("DELETE FROM tracker_tasks WHERE id = ?1", [id])?;
    }
    Ok(task)
}

/// Whether the fleet removed task `id`.
fn is_removed(conn: &Connection, id: &str) -> Result<bool, StoreError> {
    let found = conn
        .query_row(
            "SELECT 1 FROM tracker_removed_tasks WHERE id = ?1",
            [id],
            |_| Ok(()),
        )
        .optional()?;
    Ok(found.is_some())
}

/// Makes task `id`'s watchers `after`, from `before`.
fn set_watchers(
    conn: &Connection,
    id: &str,
    before: &[String],
    after: &[String],
) -> Result<(), StoreError> {
    for slug in after.iter().filter(|s| !before.contains(s)) {
        conn.execute(
            "INSERT OR IGNORE INTO tracker_task_watchers (task_id, slug) VALUES (?1, ?2)",
            params![id, slug],
        )?;
    }
    for slug in before.iter().filter(|s| !after.contains(s)) {
        conn.execute(
            "DELETE FROM tracker_task_watchers WHERE task_id = ?1 AND slug = ?2",
            params![id, slug],
        )?;
    }
    Ok(())
}

fn get_task(conn: &Connection, id: &str) -> Result<Option<TaskRow>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!("{TASK_SELECT} WHERE t.id = ?1"))?;
    let mut rows = stmt.query([id])?;
    match rows.next()? {
        Some(row) => Ok(Some(task_from(row)?)),
        None => Ok(None),
    }
}
