//! Tasks submitted through `TaskService`, with their files; in a fleet, each row applied
//! from the fleet's record of it (`shared_tasks.rs`).

use rusqlite::{OptionalExtension, Row, ToSql, params};

use super::Db;
use crate::protocols::synapse::proto::TaskStatus;
use crate::store::StoreError;

/// A task as it is kept here, and as a fleet's record of it (`shared_tasks.rs`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TaskRow {
    pub id: String,
    pub task_type: String,
    /// A `TaskStatus` number.
    pub status: i32,
    pub progress: i32,
    pub message: String,
    /// The submitted payload, an encoded `google.protobuf.Any`.
    #[serde(with = "crate::shared::text::base64_bytes")]
    pub payload: Option<Vec<u8>>,
    pub external_task_id: Option<String>,
    pub priority: String,
    pub callback_url: Option<String>,
    pub callback_token: Option<String>,
    pub transport: i32,
    /// Who submitted it (an agent name, or the gateway).
    pub submitter: String,
    /// Who it was given to.
    pub assignee: String,
    pub request_message_id: String,
    /// The result, an encoded `google.protobuf.Any`.
    #[serde(with = "crate::shared::text::base64_bytes")]
    pub result: Option<Vec<u8>>,
    pub error_code: String,
    pub error_message: String,
    pub created_at: i64,
    pub updated_at: i64,
    pub completed_at: Option<i64>,
}

/// What `update_task` did.
#[derive(Debug)]
pub enum Update {
    /// There is no such task.
    Missing,
    /// The change left the task as it was; nothing was written.
    Unchanged(TaskRow),
    Changed(TaskRow),
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FileRow {
    pub field_name: String,
    pub filename: String,
    pub mime_type: String,
    #[serde(skip)]
    pub data: Vec<u8>,
}

const TASK_COLUMNS: &str =
    "id, task_type, status, progress, message, payload, external_task_id, priority,
    callback_url, callback_token, transport, submitter, assignee, request_message_id, result,
    error_code, error_message, created_at, updated_at, completed_at";

fn task_from(r: &Row) -> rusqlite::Result<TaskRow> {
    Ok(TaskRow {
        id: r.get(0)?,
        task_type: r.get(1)?,
        status: r.get(2)?,
        progress: r.get(3)?,
        message: r.get(4)?,
        payload: r.get(5)?,
        external_task_id: r.get(6)?,
        priority: r.get(7)?,
        callback_url: r.get(8)?,
        callback_token: r.get(9)?,
        transport: r.get(10)?,
        submitter: r.get(11)?,
        assignee: r.get(12)?,
        request_message_id: r.get(13)?,
        result: r.get(14)?,
        error_code: r.get(15)?,
        error_message: r.get(16)?,
        created_at: r.get(17)?,
        updated_at: r.get(18)?,
        completed_at: r.get(19)?,
    })
}

/// A task's values, in `TASK_COLUMNS` order.
fn task_values(t: &TaskRow) -> [&dyn ToSql; 20] {
    [
        &t.id,
        &t.task_type,
        &t.status,
        &t.progress,
        &t.message,
        &t.payload,
        &t.external_task_id,
        &t.priority,
        &t.callback_url,
        &t.callback_token,
        &t.transport,
        &t.submitter,
        &t.assignee,
        &t.request_message_id,
        &t.result,
        &t.error_code,
        &t.error_message,
        &t.created_at,
        &t.updated_at,
        &t.completed_at,
    ]
}

fn get_task(conn: &rusqlite::Connection, id: &str) -> Result<Option<TaskRow>, StoreError> {
    Ok(conn
        .prepare_cached(&format!(
            "SELECT {TASK_COLUMNS} FROM synapse_tasks WHERE id = ?1"
        ))?
        .query_row([id], task_from)
        .optional()?)
}

impl Db {
    /// Inserts a task and its files; `None` when its external id is taken.
    pub async fn insert_task(
        &self,
        task: TaskRow,
        files: Vec<FileRow>,
    ) -> Result<Option<TaskRow>, StoreError> {
        self.store
            .write(move |conn| {
                if let Some(external) = &task.external_task_id {
                    let taken: Option<String> = conn
                        .query_row(
                            "SELECT id FROM synapse_tasks WHERE external_task_id = ?1",
                            [external],
                            |r| r.get(0),
                        )
                        .optional()?;
                    if taken.is_some() {
                        return Ok(None);
                    }
                }
                conn.execute(
                    &format!(
                        "INSERT INTO synapse_tasks ({TASK_COLUMNS}) VALUES
                         (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20)"
                    ),
                    task_values(&task).as_slice(),
                )?;
                insert_files(conn, &task.id, &files)?;
                Ok(Some(task))
            })
            .await
    }

    pub async fn task(&self, id: &str) -> Result<Option<TaskRow>, StoreError> {
        let id = id.to_owned();
        self.store.read(move |conn| get_task(conn, &id)).await
    }

    pub async fn task_ids(&self) -> Result<Vec<String>, StoreError> {
        self.store
            .read(|conn| {
                let mut stmt = conn.prepare("SELECT id FROM synapse_tasks")?;
                let rows = stmt.query_map([], |r| r.get(0))?;
                Ok(rows.collect::<Result<_, _>>()?)
            })
            .await
    }

    /// Tasks no agent took yet (no assignee, still RECEIVED), oldest first.
    pub async fn waiting_tasks(&self) -> Result<Vec<TaskRow>, StoreError> {
        self.store
            .read(|conn| {
                let mut stmt = conn.prepare(&format!(
                    "SELECT {TASK_COLUMNS} FROM synapse_tasks WHERE assignee = '' AND status = ?1
                     ORDER BY created_at, rowid"
                ))?;
                let rows = stmt.query_map([TaskStatus::Received as i32], task_from)?;
                Ok(rows.collect::<Result<_, _>>()?)
            })
            .await
    }

    /// A task's files, in the order they were given.
    pub async fn task_files(&self, id: &str) -> Result<Vec<FileRow>, StoreError> {
        let id = id.to_owned();
        self.store
            .read(move |conn| {
                let mut stmt = conn.prepare(
                    "SELECT field_name, filename, mime_type, data FROM synapse_task_files
                     WHERE task_id = ?1 ORDER BY position",
                )?;
                let rows = stmt.query_map([id], |r| {
                    Ok(FileRow {
                        field_name: r.get(0)?,
                        filename: r.get(1)?,
                        mime_type: r.get(2)?,
                        data: r.get(3)?,
                    })
                })?;
                Ok(rows.collect::<Result<_, _>>()?)
            })
            .await
    }

    /// How many tasks have one of `statuses`.
    pub async fn count_tasks(&self, statuses: &[i32]) -> Result<i64, StoreError> {
        let statuses: Vec<i64> = statuses.iter().map(|&s| s.into()).collect();
        self.store
            .read(move |conn| {
                let placeholders = vec!["?"; statuses.len()].join(", ");
                Ok(conn.query_row(
                    &format!("SELECT COUNT(*) FROM synapse_tasks WHERE status IN ({placeholders})"),
                    rusqlite::params_from_iter(statuses.iter()),
                    |r| r.get(0),
                )?)
            })
            .await
    }

    /// A page of tasks (newest first) and how many match in all.
    pub async fn tasks(
        &self,
        status: Option<i32>,
        limit: i64,
        offset: i64,
    ) -> Result<(Vec<TaskRow>, i64), StoreError> {
        self.store
            .read(move |conn| {
                let (filter, args): (&str, Vec<i64>) = match status {
                    Some(s) => ("WHERE status = ?1", vec![s as i64]),
                    None => ("", vec![]),
                };
                let total: i64 = conn.query_row(
                    &format!("SELECT COUNT(*) FROM synapse_tasks {filter}"),
                    rusqlite::params_from_iter(args.iter()),
                    |r| r.get(0),
                )?;
                let mut page_args = args.clone();
                page_args.push(limit);
                page_args.push(offset);
                let n = page_args.len();
                let mut stmt = conn.prepare(&format!(
                    "SELECT {TASK_COLUMNS} FROM synapse_tasks {filter} ORDER BY created_at DESC, rowid DESC LIMIT ?{} OFFSET ?{}",
                    n - 1,
                    n
                ))?;
                let rows = stmt.query_map(rusqlite::params_from_iter(page_args.iter()), task_from)?;
                Ok((rows.collect::<Result<_, _>>()?, total))
            })
            .await
    }

    /// Applies `change` to the task atomically. Only a real change is written (and gets a
    /// new `updated_at`), and `changed` is told of it as it commits (`Store::write_then`):
    /// watchers are told of changes, not of every attempt.
    pub async fn update_task<F>(
        &self,
        id: &str,
        change: F,
        changed: impl FnOnce(&TaskRow) + Send + 'static,
    ) -> Result<Update, StoreError>
    where
        F: FnOnce(&mut TaskRow) + Send + 'static,
    {
        let id = id.to_owned();
        let committed = move |update: &Update| {
            if let Update::Changed(task) = update {
                changed(task);
            }
        };
        self.store
            .write_then(
                move |conn| {
                    let Some(mut task) = get_task(conn, &id)? else {
                        return Ok(Update::Missing);
                    };
                    let before = task.clone();
                    change(&mut task);
                    if task == before {
                        return Ok(Update::Unchanged(task));
                    }
                    task.updated_at = crate::core::now_ms();
                    conn.execute(
                        "UPDATE synapse_tasks SET status = ?2, progress = ?3, message = ?4, result = ?5,
                            error_code = ?6, error_message = ?7, updated_at = ?8, completed_at = ?9,
                            assignee = ?10
                         WHERE id = ?1",
                        params![
                            id,
                            task.status,
                            task.progress,
                            task.message,
                            task.result,
                            task.error_code,
                            task.error_message,
                            task.updated_at,
                            task.completed_at,
                            task.assignee
                        ],
                    )?;
                    Ok(Update::Changed(task))
                },
                committed,
            )
            .await
    }

    /// Keeps `task` as the fleet's record holds it at `revision`: inserted if it is not
    /// here, changed if it is here at an older revision. Whether it was news here;
    /// `changed` is told of news as it commits (`Store::write_then`).
    pub async fn apply_task(
        &self,
        task: TaskRow,
        revision: u64,
        changed: impl FnOnce(&TaskRow) + Send + 'static,
    ) -> Result<bool, StoreError> {
        let applied = task.clone();
        let committed = move |news: &bool| {
            if *news {
                changed(&applied);
            }
        };
        self.store
            .write_then(move |conn| {
                let revision = revision as i64;
                let mut values = task_values(&task).to_vec();
                values.push(&revision);
                let changed = conn
                    .prepare_cached(&format!(
                        "INSERT INTO synapse_tasks ({TASK_COLUMNS}, fleet_revision) VALUES
                         (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21)
                         ON CONFLICT (id) DO UPDATE SET status = excluded.status,
                            progress = excluded.progress, message = excluded.message,
                            assignee = excluded.assignee, result = excluded.result,
                            error_code = excluded.error_code, error_message = excluded.error_message,
                            updated_at = excluded.updated_at, completed_at = excluded.completed_at,
                            fleet_revision = excluded.fleet_revision
                         WHERE fleet_revision IS NULL OR fleet_revision < excluded.fleet_revision"
                    ))?
                    .execute(values.as_slice())?;
                Ok(changed > 0)
            }, committed)
            .await
    }

    /// Keeps a task's files (taken from the fleet, for a task another bridge was given).
    pub async fn put_task_files(&self, id: &str, files: Vec<FileRow>) -> Result<(), StoreError> {
        let id = id.to_owned();
        self.store
            .write(move |conn| insert_files(conn, &id, &files))
            .await
    }
}

fn insert_files(
    conn: &rusqlite::Connection,
    task_id: &str,
    files: &[FileRow],
) -> Result<(), StoreError> {
    let mut stmt = conn.prepare_cached(
        "INSERT OR IGNORE INTO synapse_task_files (task_id, position, field_name, filename, mime_type, data)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?;
    for (position, file) in files.iter().enumerate() {
        stmt.execute(params![
            task_id,
            position as i64,
            file.field_name,
            file.filename,
            file.mime_type,
            file.data
        ])?;
    }
    Ok(())
}
