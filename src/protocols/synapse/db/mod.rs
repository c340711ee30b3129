//! The Synapse endpoint's tables: its agents (with how to reach them), the tasks submitted
//! through `TaskService` (with their files), groups, and the polling inbox.

use rusqlite::{OptionalExtension, params};

mod inbox;
mod tasks;

use crate::store::{Migration, Store, StoreError};
pub use inbox::InboxRow;
pub use tasks::{FileRow, TaskRow, Update};

pub static MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sql: "
        CREATE TABLE synapse_agents (
            agent_id       TEXT PRIMARY KEY,
            name           TEXT NOT NULL,
            system_id      TEXT NOT NULL,
            endpoint       TEXT NOT NULL,
            version        TEXT NOT NULL,
            transport      INTEGER NOT NULL,
            callback_url   TEXT,
            callback_token TEXT,
            capabilities   TEXT NOT NULL,
            created_at     INTEGER NOT NULL
        );
        CREATE TABLE synapse_tasks (
            id                 TEXT PRIMARY KEY,
            task_type          TEXT NOT NULL,
            status             INTEGER NOT NULL,
            progress           INTEGER NOT NULL,
            message            TEXT NOT NULL,
            payload            BLOB,
            external_task_id   TEXT UNIQUE,
            priority           TEXT NOT NULL,
            callback_url       TEXT,
            callback_token     TEXT,
            transport          INTEGER NOT NULL,
            submitter          TEXT NOT NULL,
            assignee           TEXT NOT NULL,
            request_message_id TEXT NOT NULL,
            result             BLOB,
            error_code         TEXT NOT NULL,
            error_message      TEXT NOT NULL,
            created_at         INTEGER NOT NULL,
            updated_at         INTEGER NOT NULL,
            completed_at       INTEGER
        );
        CREATE INDEX synapse_tasks_by_status ON synapse_tasks (status, created_at);
        CREATE TABLE synapse_task_files (
            task_id    TEXT NOT NULL REFERENCES synapse_tasks (id) ON DELETE CASCADE,
            position   INTEGER NOT NULL,
            field_name TEXT NOT NULL,
            filename   TEXT NOT NULL,
            mime_type  TEXT NOT NULL,
            data       BLOB NOT NULL,
            PRIMARY KEY (task_id, position)
        );
        CREATE TABLE synapse_groups (
            id             TEXT PRIMARY KEY,
            name           TEXT NOT NULL,
            description    TEXT NOT NULL,
            coordinator_id TEXT NOT NULL,
            status         TEXT NOT NULL,
            created_at     INTEGER NOT NULL
        );
        CREATE TABLE synapse_group_members (
            group_id  TEXT NOT NULL REFERENCES synapse_groups (id) ON DELETE CASCADE,
            agent_id  TEXT NOT NULL,
            role      TEXT NOT NULL,
            joined_at INTEGER NOT NULL,
            PRIMARY KEY (group_id, agent_id)
        );
        -- Messages kept for agents that poll (or whose callbacks failed), until fetched.
        CREATE TABLE synapse_inbox (
            seq        INTEGER PRIMARY KEY AUTOINCREMENT,
            agent_id   TEXT NOT NULL,
            message    BLOB NOT NULL,
            created_at INTEGER NOT NULL
        );
        CREATE INDEX synapse_inbox_by_agent ON synapse_inbox (agent_id, seq);
    ",
    },
    Migration {
        version: 2,
        // The revision of the fleet's record each group was last applied from; kept after the
        // group is removed, so that an older write of it does not bring it back.
        sql: "CREATE TABLE synapse_groups_revisions (
              group_id TEXT PRIMARY KEY,
              revision INTEGER NOT NULL
          ) WITHOUT ROWID;",
    },
    Migration {
        version: 3,
        // In a fleet, an inbox is the fleet's (`shared_inbox.rs`): each message kept once per
        // agent, with the revision of the fleet's record it was applied from (none for one
        // this bridge alone keeps).
        sql:
            "ALTER TABLE synapse_inbox ADD COLUMN message_id TEXT;
              ALTER TABLE synapse_inbox ADD COLUMN fleet_revision INTEGER;
              CREATE UNIQUE INDEX synapse_inbox_by_message ON synapse_inbox (agent_id, message_id);",
    },
    Migration {
        version: 4,
        // The revision of the fleet's record each task was last applied from (in a fleet, a
        // task is the fleet's: `shared_tasks.rs`); none for one this bridge alone keeps.
        sql: "ALTER TABLE synapse_tasks ADD COLUMN fleet_revision INTEGER;",
    },
    Migration {
        version: 5,
        // The fleet's records this bridge took lately, at the revision taken: a late copy
        // of a record taken here (the watch behind the take, a local apply held up) is not
        // kept again (`core::LATE_COPY_WINDOW`).
        sql: "CREATE TABLE synapse_inbox_taken (
                agent_id       TEXT NOT NULL,
                message_id     TEXT NOT NULL,
                fleet_revision INTEGER NOT NULL,
                taken_ms       INTEGER NOT NULL,
                PRIMARY KEY (agent_id, message_id)
              ) WITHOUT ROWID;
              CREATE INDEX synapse_inbox_taken_by_age ON synapse_inbox_taken (taken_ms);",
    },
];

#[derive(Clone, Debug, PartialEq)]
pub struct AgentRow {
    pub agent_id: String,
    pub name: String,
    pub system_id: String,
    pub endpoint: String,
    pub version: String,
    /// A `TransportMode` number.
    pub transport: i32,
    pub callback_url: Option<String>,
    pub callback_token: Option<String>,
    pub capabilities: Vec<String>,
    pub created_at: i64,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GroupRow {
    pub id: String,
    pub name: String,
    pub description: String,
    pub coordinator_id: String,
    pub status: String,
    pub created_at: i64,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MemberRow {
    pub agent_id: String,
    pub role: String,
    pub joined_at: i64,
}

#[derive(Clone)]
pub struct Db {
    store: Store,
}

impl Db {
    pub async fn open(store: Store) -> Result<Db, StoreError> {
        store.migrate("synapse", MIGRATIONS).await?;
        Ok(Db { store })
    }

    pub async fn agents(&self) -> Result<Vec<AgentRow>, StoreError> {
        self.store
            .read(|conn| {
                let mut stmt = conn.prepare(
                    "SELECT agent_id, name, system_id, endpoint, version, transport, callback_url,
                            callback_token, capabilities, created_at
                     FROM synapse_agents ORDER BY created_at, agent_id",
                )?;
                let rows = stmt.query_map([], |r| {
                    let caps: String = r.get(8)?;
                    Ok(AgentRow {
                        agent_id: r.get(0)?,
                        name: r.get(1)?,
                        system_id: r.get(2)?,
                        endpoint: r.get(3)?,
                        version: r.get(4)?,
                        transport: r.get(5)?,
                        callback_url: r.get(6)?,
                        callback_token: r.get(7)?,
                        capabilities: serde_json::from_str(&caps).unwrap_or_default(),
                        created_at: r.get(9)?,
                    })
                })?;
                Ok(rows.collect::<Result<_, _>>()?)
            })
            .await
    }

    pub async fn put_agent(&self, agent: AgentRow) -> Result<(), StoreError> {
        self.store
            .write(move |conn| {
                conn.execute(
                    "INSERT INTO synapse_agents (agent_id, name, system_id, endpoint, version, transport,
                        callback_url, callback_token, capabilities, created_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
                     ON CONFLICT (agent_id) DO UPDATE SET name = excluded.name,
                        system_id = excluded.system_id, endpoint = excluded.endpoint,
                        version = excluded.version, transport = excluded.transport,
                        callback_url = excluded.callback_url, callback_token = excluded.callback_token,
                        capabilities = excluded.capabilities",
                    params![
                        agent.agent_id,
                        agent.name,
                        agent.system_id,
                        agent.endpoint,
                        agent.version,
                        agent.transport,
                        agent.callback_url,
                        agent.callback_token,
                        serde_json::to_string(&agent.capabilities).unwrap_or_else(|_| "[]".into()),
                        agent.created_at
                    ],
                )?;
                Ok(())
            })
            .await
    }

    pub async fn groups(&self) -> Result<Vec<(GroupRow, Vec<MemberRow>)>, StoreError> {
        self.store
            .read(|conn| {
                let mut groups = conn.prepare(
                    "SELECT id, name, description, coordinator_id, status, created_at FROM synapse_groups ORDER BY created_at",
                )?;
                let list: Vec<GroupRow> = groups
                    .query_map([], |r| {
                        Ok(GroupRow {
                            id: r.get(0)?,
                            name: r.get(1)?,
                            description: r.get(2)?,
                            coordinator_id: r.get(3)?,
                            status: r.get(4)?,
                            created_at: r.get(5)?,
                        })
                    })?
                    .collect::<Result<_, _>>()?;
                let mut members = conn.prepare(
                    "SELECT agent_id, role, joined_at FROM synapse_group_members WHERE group_id = ?1 ORDER BY joined_at, agent_id",
                )?;
                let mut out = Vec::new();
                for group in list {
                    let rows: Vec<MemberRow> = members
                        .query_map([&group.id], |r| {
                            Ok(MemberRow {
                                agent_id: r.get(0)?,
                                role: r.get(1)?,
                                joined_at: r.get(2)?,
                            })
                        })?
                        .collect::<Result<_, _>>()?;
                    out.push((group, rows));
                }
                Ok(out)
            })
            .await
    }

    pub async fn insert_group(
        &self,
        group: GroupRow,
        members: Vec<MemberRow>,
    ) -> Result<(), StoreError> {
        self.store
            .write(move |conn| {
                conn.execute(
                    "INSERT INTO synapse_groups (id, name, description, coordinator_id, status, created_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                    params![group.id, group.name, group.description, group.coordinator_id, group.status, group.created_at],
                )?;
                for m in members {
                    conn.execute(
                        "INSERT OR IGNORE INTO synapse_group_members (group_id, agent_id, role, joined_at) VALUES (?1, ?2, ?3, ?4)",
                        params![group.id, m.agent_id, m.role, m.joined_at],
                    )?;
                }
                Ok(())
            })
            .await
    }

    pub async fn set_membership(
        &self,
        group_id: &str,
        member: MemberRow,
        present: bool,
    ) -> Result<(), StoreError> {
        let group_id = group_id.to_owned();
        self.store
            .write(move |conn| {
                if present {
                    conn.execute(
                        "INSERT OR IGNORE INTO synapse_group_members (group_id, agent_id, role, joined_at) VALUES (?1, ?2, ?3, ?4)",
                        params![group_id, member.agent_id, member.role, member.joined_at],
                    )?;
                } else {
                    conn.execute(
                        "DELETE FROM synapse_group_members WHERE group_id = ?1 AND agent_id = ?2",
                        params![group_id, member.agent_id],
                    )?;
                }
                Ok(())
            })
            .await
    }

    pub async fn delete_group(&self, group_id: &str) -> Result<(), StoreError> {
        let group_id = group_id.to_owned();
        self.store
            .write(move |conn| {
                conn.execute("DELETE FROM synapse_groups WHERE id = ?1", [group_id])?;
                Ok(())
            })
            .await
    }

    /// Makes group `id` what revision `revision` of the fleet's record says (`None`:
    /// removed), unless it or a later one was applied; whether it did.
    pub async fn apply_group(
        &self,
        id: &str,
        group: Option<(GroupRow, Vec<MemberRow>)>,
        revision: u64,
    ) -> Result<bool, StoreError> {
        let id = id.to_owned();
        self.store
            .write(move |conn| {
                let applied: Option<i64> = conn
                    .query_row(
                        "SELECT revision FROM synapse_groups_revisions WHERE group_id = ?1",
                        [&id],
                        |r| r.get(0),
                    )
                    .optional()?;
                if applied.is_some_and(|applied| applied as u64 >= revision) {
                    return Ok(false);
                }
                conn.execute("DELETE FROM synapse_groups WHERE id = ?1", [&id])?;
                if let Some((group, members)) = group {
                    conn.execute(
                        "INSERT INTO synapse_groups (id, name, description, coordinator_id, status, created_at)
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                        params![id, group.name, group.description, group.coordinator_id, group.status, group.created_at],
                    )?;
                    for m in members {
                        conn.execute(
                            "INSERT OR IGNORE INTO synapse_group_members (group_id, agent_id, role, joined_at) VALUES (?1, ?2, ?3, ?4)",
                            params![id, m.agent_id, m.role, m.joined_at],
                        )?;
                    }
                }
                conn.execute(
                    "INSERT OR REPLACE INTO synapse_groups_revisions (group_id, revision) VALUES (?1, ?2)",
                    params![id, revision as i64],
                )?;
                Ok(true)
            })
            .await
    }
}
