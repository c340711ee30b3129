//! The Tracker's own tables: members (tokens hashed), projects, tasks with their steps and
//! watchers, attachments. Chat messages are not here: they are envelopes in the core's
//! message log, found by `thread` (a chat id, or a task id for task comments).

mod steps;
mod tasks;

pub use steps::StepsApplied;
pub use tasks::TaskChanged;

use rusqlite::{OptionalExtension, Row, params};

use super::wire::{ChatListen, MemberKind, Priority, TaskListen, TaskStatus, TaskType};
use crate::core::derived_uuid;
use crate::store::{Migration, Store, StoreError};

pub static MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sql: "
        CREATE TABLE tracker_meta (
            key   TEXT PRIMARY KEY,
            value TEXT NOT NULL
        ) WITHOUT ROWID;
        CREATE TABLE tracker_members (
            id           TEXT PRIMARY KEY,
            slug         TEXT NOT NULL UNIQUE,
            name         TEXT NOT NULL,
            kind         TEXT NOT NULL,
            token_hash   TEXT NOT NULL UNIQUE,
            chat_listen  TEXT NOT NULL,
            task_listen  TEXT NOT NULL,
            capabilities TEXT NOT NULL,
            prompt       TEXT,
            model        TEXT,
            created_at   INTEGER NOT NULL
        );
        CREATE TABLE tracker_projects (
            id          TEXT PRIMARY KEY,
            slug        TEXT NOT NULL UNIQUE,
            name        TEXT NOT NULL,
            description TEXT NOT NULL,
            chat_id     TEXT NOT NULL UNIQUE,
            created_at  INTEGER NOT NULL
        );
        CREATE TABLE tracker_tasks (
            id                 TEXT PRIMARY KEY,
            project_id         TEXT NOT NULL REFERENCES tracker_projects (id),
            title              TEXT NOT NULL,
            description        TEXT NOT NULL,
            status             TEXT NOT NULL,
            type               TEXT NOT NULL,
            priority           TEXT NOT NULL,
            assignee_slug      TEXT,
            reviewer_slug      TEXT,
            author_slug        TEXT NOT NULL,
            -- Set when the task came from another protocol: its id there, who asked for it,
            -- and the message that asked (for reply_to / correlation on the way back).
            external_id        TEXT UNIQUE,
            requester          TEXT,
            request_message_id TEXT,
            -- Set when the task was handed to an agent of another protocol.
            delegation_message_id TEXT,
            created_at         INTEGER NOT NULL,
            updated_at         INTEGER NOT NULL
        );
        CREATE INDEX tracker_tasks_by_project ON tracker_tasks (project_id, created_at);
        CREATE TABLE tracker_task_watchers (
            task_id TEXT NOT NULL REFERENCES tracker_tasks (id) ON DELETE CASCADE,
            slug    TEXT NOT NULL,
            PRIMARY KEY (task_id, slug)
        ) WITHOUT ROWID;
        CREATE TABLE tracker_steps (
            id         TEXT PRIMARY KEY,
            task_id    TEXT NOT NULL REFERENCES tracker_tasks (id) ON DELETE CASCADE,
            title      TEXT NOT NULL,
            done       INTEGER NOT NULL DEFAULT 0,
            position   INTEGER NOT NULL,
            created_at INTEGER NOT NULL
        );
        CREATE INDEX tracker_steps_by_task ON tracker_steps (task_id, position);
        CREATE TABLE tracker_attachments (
            id         TEXT PRIMARY KEY,
            message_id TEXT NOT NULL,
            task_id    TEXT,
            filename   TEXT NOT NULL,
            mime_type  TEXT NOT NULL,
            size       INTEGER NOT NULL,
            data       BLOB NOT NULL,
            created_at INTEGER NOT NULL
        );
        CREATE INDEX tracker_attachments_by_message ON tracker_attachments (message_id);
        CREATE INDEX tracker_attachments_by_task ON tracker_attachments (task_id);
    ",
    },
    // The revision of the fleet's record a task was last written from (`records`); 0 for
    // a bridge alone.
    Migration {
        version: 2,
        sql: "ALTER TABLE tracker_tasks ADD COLUMN fleet_revision INTEGER NOT NULL DEFAULT 0;",
    },
    // Tasks the fleet removed: a write of one that arrives after its removal (a bridge's
    // own, answered late) does not bring it back.
    Migration {
        version: 3,
        sql: "CREATE TABLE tracker_removed_tasks (id TEXT PRIMARY KEY) WITHOUT ROWID;",
    },
    Migration {
        version: 4,
        // The revision of the fleet's record each task's steps were last applied from.
        sql: "CREATE TABLE tracker_steps_revisions (
                  task_id  TEXT PRIMARY KEY REFERENCES tracker_tasks (id) ON DELETE CASCADE,
                  revision INTEGER NOT NULL
              ) WITHOUT ROWID;",
    },
];

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MemberRow {
    pub id: String,
    pub slug: String,
    pub name: String,
    pub kind: MemberKind,
    pub token_hash: String,
    pub chat_listen: ChatListen,
    pub task_listen: TaskListen,
    pub capabilities: Vec<String>,
    pub prompt: Option<String>,
    pub model: Option<String>,
    pub created_at: i64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ProjectRow {
    pub id: String,
    pub slug: String,
    pub name: String,
    pub description: String,
    pub chat_id: String,
    pub created_at: i64,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TaskRow {
    pub id: String,
    pub project_id: String,
    pub project_slug: String,
    pub title: String,
    pub description: String,
    pub status: TaskStatus,
    pub task_type: TaskType,
    pub priority: Priority,
    pub assignee_slug: Option<String>,
    pub reviewer_slug: Option<String>,
    pub author_slug: String,
    pub watchers: Vec<String>,
    pub external_id: Option<String>,
    pub requester: Option<String>,
    pub request_message_id: Option<String>,
    pub delegation_message_id: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepRow {
    pub id: String,
    pub task_id: String,
    pub title: String,
    pub done: bool,
    pub position: i64,
    pub created_at: i64,
}

/// An attachment's description, as kept here and as a fleet's record of it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AttachmentRow {
    pub id: String,
    pub message_id: String,
    pub task_id: Option<String>,
    pub filename: String,
    pub mime_type: String,
    pub size: i64,
    pub created_at: i64,
}

/// Filters of `GET /tasks`.
#[derive(Clone, Debug, Default)]
pub struct TaskFilter {
    pub project_id: Option<String>,
    pub status: Option<TaskStatus>,
    pub assignee: Option<String>,
}

fn corrupt(what: &str, value: &str) -> StoreError {
    StoreError::Corrupt(format!("tracker: unknown {what} '{value}'"))
}

fn member_from(row: &Row) -> rusqlite::Result<(MemberRow, String, String, String, String)> {
    Ok((
        MemberRow {
            id: row.get(0)?,
            slug: row.get(1)?,
            name: row.get(2)?,
            kind: MemberKind::Agent,
            token_hash: row.get(4)?,
            chat_listen: ChatListen::Mentions,
            task_listen: TaskListen::Assigned,
            capabilities: Vec::new(),
            prompt: row.get(8)?,
            model: row.get(9)?,
            created_at: row.get(10)?,
        },
        row.get(3)?,
        row.get(5)?,
        row.get(6)?,
        row.get(7)?,
    ))
}

const MEMBER_COLUMNS: &str = "id, slug, name, kind, token_hash, chat_listen, task_listen, capabilities, prompt, model, created_at";

fn attachment_from(row: &Row) -> rusqlite::Result<AttachmentRow> {
    Ok(AttachmentRow {
        id: row.get(0)?,
        message_id: row.get(1)?,
        task_id: row.get(2)?,
        filename: row.get(3)?,
        mime_type: row.get(4)?,
        size: row.get(5)?,
        created_at: row.get(6)?,
    })
}

/// Typed access to the Tracker's tables through the bridge's store.
#[derive(Clone)]
pub struct Db {
    store: Store,
}

impl Db {
    pub async fn open(store: Store) -> Result<Db, StoreError> {
        store.migrate("tracker", MIGRATIONS).await?;
        Ok(Db { store })
    }

    /// The lobby's chat id, created once and kept.
    pub async fn lobby_chat_id(&self) -> Result<String, StoreError> {
        self.store
            .write(|conn| {
                // Derived, as projects' ids are: the same on every bridge of a fleet.
                let fresh = derived_uuid("tracker-lobby", "lobby").to_string();
                conn.execute(
                    "INSERT OR IGNORE INTO tracker_meta (key, value) VALUES ('lobby_chat_id', ?1)",
                    [fresh],
                )?;
                Ok(conn.query_row(
                    "SELECT value FROM tracker_meta WHERE key = 'lobby_chat_id'",
                    [],
                    |r| r.get(0),
                )?)
            })
            .await
    }

    pub async fn members(&self) -> Result<Vec<MemberRow>, StoreError> {
        self.store
            .read(|conn| {
                let mut stmt = conn.prepare(&format!(
                    "SELECT {MEMBER_COLUMNS} FROM tracker_members ORDER BY created_at, slug"
                ))?;
                let rows = stmt.query_map([], member_from)?;
                let mut out = Vec::new();
                for row in rows {
                    let (mut member, kind, chat, task, caps) = row?;
                    member.kind = MemberKind::parse(&kind).ok_or_else(|| corrupt("kind", &kind))?;
                    member.chat_listen =
                        ChatListen::parse(&chat).ok_or_else(|| corrupt("chat_listen", &chat))?;
                    member.task_listen =
                        TaskListen::parse(&task).ok_or_else(|| corrupt("task_listen", &task))?;
                    member.capabilities =
                        serde_json::from_str(&caps).map_err(|_| corrupt("capabilities", &caps))?;
                    out.push(member);
                }
                Ok(out)
            })
            .await
    }

    /// Inserts a member, or (`replace`) updates the one with the same slug, keeping its id.
    pub async fn put_member(
        &self,
        member: MemberRow,
        replace: bool,
    ) -> Result<MemberRow, StoreError> {
        self.store
            .write(move |conn| {
                let existing: Option<(String, i64)> = conn
                    .query_row(
                        "SELECT id, created_at FROM tracker_members WHERE slug = ?1",
                        [&member.slug],
                        |r| Ok((r.get(0)?, r.get(1)?)),
                    )
                    .optional()?;
                let member = match existing {
                    Some((id, created_at)) if replace => MemberRow {
                        id,
                        created_at,
                        ..member
                    },
                    Some(_) => {
                        return Err(StoreError::Corrupt(format!(
                            "member '{}' exists",
                            member.slug
                        )));
                    }
                    None => member,
                };
                conn.execute(
                    &format!(
                        "INSERT INTO tracker_members ({MEMBER_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
                         ON CONFLICT (slug) DO UPDATE SET name = excluded.name, kind = excluded.kind,
                           token_hash = excluded.token_hash, chat_listen = excluded.chat_listen,
                           task_listen = excluded.task_listen, capabilities = excluded.capabilities,
                           prompt = excluded.prompt, model = excluded.model"
                    ),
                    params![
                        member.id,
                        member.slug,
                        member.name,
                        member.kind.as_str(),
                        member.token_hash,
                        member.chat_listen.as_str(),
                        member.task_listen.as_str(),
                        serde_json::to_string(&member.capabilities).unwrap_or_else(|_| "[]".into()),
                        member.prompt,
                        member.model,
                        member.created_at
                    ],
                )?;
                Ok(member)
            })
            .await
    }

    pub async fn projects(&self) -> Result<Vec<ProjectRow>, StoreError> {
        self.store
            .read(|conn| {
                let mut stmt = conn.prepare(
                    "SELECT id, slug, name, description, chat_id, created_at FROM tracker_projects ORDER BY created_at, rowid",
                )?;
                let rows = stmt.query_map([], |r| {
                    Ok(ProjectRow {
                        id: r.get(0)?,
                        slug: r.get(1)?,
                        name: r.get(2)?,
                        description: r.get(3)?,
                        chat_id: r.get(4)?,
                        created_at: r.get(5)?,
                    })
                })?;
                Ok(rows.collect::<Result<_, _>>()?)
            })
            .await
    }

    /// Creates a project, or updates the name and description of the one with that slug.
    /// Its ids are derived from its slug, so that every bridge of a fleet, declaring the
    /// same projects, knows them by the same ids.
    pub async fn put_project(
        &self,
        slug: &str,
        name: &str,
        description: &str,
    ) -> Result<(), StoreError> {
        let (slug, name, description) = (slug.to_owned(), name.to_owned(), description.to_owned());
        self.store
            .write(move |conn| {
                conn.execute(
                    "INSERT INTO tracker_projects (id, slug, name, description, chat_id, created_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                     ON CONFLICT (slug) DO UPDATE SET name = excluded.name, description = excluded.description",
                    params![
                        derived_uuid("tracker-project", &slug).to_string(),
                        slug,
                        name,
                        description,
                        derived_uuid("tracker-chat", &slug).to_string(),
                        crate::core::now_ms()
                    ],
                )?;
                Ok(())
            })
            .await
    }

    pub async fn insert_attachment(
        &self,
        row: AttachmentRow,
        data: Vec<u8>,
    ) -> Result<AttachmentRow, StoreError> {
        self.store
            .write(move |conn| {
                conn.execute(
                    "INSERT INTO tracker_attachments (id, message_id, task_id, filename, mime_type, size, data, created_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                     ON CONFLICT (id) DO UPDATE SET data = excluded.data",
                    params![
                        row.id,
                        row.message_id,
                        row.task_id,
                        row.filename,
                        row.mime_type,
                        row.size,
                        data,
                        row.created_at
                    ],
                )?;
                Ok(row)
            })
            .await
    }

    /// Keeps the description of an attachment uploaded through another bridge of the
    /// fleet; its bytes are fetched from the fleet when it is first downloaded here.
    pub async fn apply_attachment(&self, row: AttachmentRow) -> Result<(), StoreError> {
        self.store
            .write(move |conn| {
                conn.execute(
                    "INSERT OR IGNORE INTO tracker_attachments
                        (id, message_id, task_id, filename, mime_type, size, data, created_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, x'', ?7)",
                    params![
                        row.id,
                        row.message_id,
                        row.task_id,
                        row.filename,
                        row.mime_type,
                        row.size,
                        row.created_at
                    ],
                )?;
                Ok(())
            })
            .await
    }

    /// Keeps the bytes of attachment `id`, fetched from the fleet.
    pub async fn keep_attachment_data(&self, id: &str, data: Vec<u8>) -> Result<(), StoreError> {
        let id = id.to_owned();
        self.store
            .write(move |conn| {
                conn.execute(
                    "UPDATE tracker_attachments SET data = ?2 WHERE id = ?1",
                    params![id, data],
                )?;
                Ok(())
            })
            .await
    }

    /// An attachment's record and bytes.
    pub async fn attachment(
        &self,
        id: &str,
    ) -> Result<Option<(AttachmentRow, Vec<u8>)>, StoreError> {
        let id = id.to_owned();
        self.store
            .read(move |conn| {
                Ok(conn
                    .query_row(
                        "SELECT id, message_id, task_id, filename, mime_type, size, created_at, data
                         FROM tracker_attachments WHERE id = ?1",
                        [id],
                        |r| Ok((attachment_from(r)?, r.get::<_, Vec<u8>>(7)?)),
                    )
                    .optional()?)
            })
            .await
    }

    /// Attachments of one message (`by_task` false) or of every message of a task.
    pub async fn attachments(
        &self,
        key: &str,
        by_task: bool,
    ) -> Result<Vec<AttachmentRow>, StoreError> {
        let key = key.to_owned();
        self.store
            .read(move |conn| {
                let column = if by_task { "task_id" } else { "message_id" };
                let mut stmt = conn.prepare_cached(&format!(
                    "SELECT id, message_id, task_id, filename, mime_type, size, created_at
                     FROM tracker_attachments WHERE {column} = ?1 ORDER BY created_at, rowid"
                ))?;
                let rows = stmt.query_map([key], attachment_from)?;
                Ok(rows.collect::<Result<_, _>>()?)
            })
            .await
    }
}
