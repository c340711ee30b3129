//! Skynet's scheduler (`skynet-scheduler.md`): recurring tasks for agents, kept in the
//! store and, in a fleet, as the fleet's shared records, so that every bridge lists the
//! same schedules and fires them. Each firing is a `task.assign` whose id is derived from
//! the schedule and the tick (`ticks`), so the bridges that fire one tick publish one
//! message: the fleet's log takes an id once, and each bridge applies it once.
//!
//! A schedule's definition is shared; when it last ran is each bridge's own (every bridge
//! fires every tick it is up for), and when it runs next is worked out from its cron
//! expression, in UTC, when asked.

pub mod routes;
pub mod ticks;

use std::str::FromStr;
use std::sync::Arc;

use croner::Cron;
use dashmap::DashMap;
use rusqlite::params;
use serde_json::{Value, json};

use crate::core::{Core, Expect, RecordChange, RecordError, Revision, sink};
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
            updated_at    INTEGER NOT NULL
        );
    ",
}];

/// The table of schedules in the fleet's records, keyed by schedule id.
pub const SCHEDULES: &str = "skynet-schedules";

/// How many times an update is tried against the fleet's record when other writes keep
/// coming first.
const UPDATE_TRIES: usize = 4;

/// A schedule's definition: what the fleet shares.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Schedule {
    pub id: String,
    pub name: String,
    pub cron_expr: String,
    /// The target agent's id as the schedule's creator gave it (a card id).
    pub agent_id: String,
    /// `{title, description, files?, metadata?}`.
    pub task_template: Value,
    pub enabled: bool,
    pub created_by: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// A cron expression Skynet's scheduler (croner) takes: five fields, or six with seconds.
pub fn parse_cron(expr: &str) -> Result<Cron, String> {
    let cron = Cron::from_str(expr.trim()).map_err(|e| e.to_string())?;
    // One that never comes (February 30th) is refused as croner's `nextRun` would give none.
    next_after(&cron, crate::core::now_ms())
        .map(|_| cron)
        .ok_or_else(|| "it never fires".to_owned())
}

/// The first time after `after_ms` (Unix ms, UTC) that `cron` fires.
pub fn next_after(cron: &Cron, after_ms: i64) -> Option<i64> {
    let after = chrono::DateTime::<chrono::Utc>::from_timestamp_millis(after_ms)?;
    let next = cron.find_next_occurrence(&after, false).ok()?;
    Some(next.timestamp_millis())
}

/// A schedule as this bridge runs it.
struct Running {
    schedule: Schedule,
    cron: Cron,
    last_run_at: Option<i64>,
    /// When it fires next; `None` while disabled.
    next_at: Option<i64>,
    /// The fleet's revision of it, in a fleet.
    revision: Option<Revision>,
}

impl Running {
    fn new(
        schedule: Schedule,
        last_run_at: Option<i64>,
        revision: Option<Revision>,
    ) -> Option<Running> {
        let cron = match parse_cron(&schedule.cron_expr) {
            Ok(cron) => cron,
            Err(e) => {
                tracing::warn!(schedule = %schedule.id, error = %e, "skynet: a stored schedule's cron expression is not read; it does not run");
                return None;
            }
        };
        let next_at = (schedule.enabled)
            .then(|| next_after(&cron, crate::core::now_ms()))
            .flatten();
        Some(Running {
            schedule,
            cron,
            last_run_at,
            next_at,
            revision,
        })
    }

    /// ScheduleInfo, as the HTTP API answers.
    fn info(&self) -> Value {
        let s = &self.schedule;
        json!({
            "id": s.id,
            "name": s.name,
            "cronExpr": s.cron_expr,
            "agentId": s.agent_id,
            "taskTemplate": s.task_template,
            "enabled": s.enabled,
            "createdBy": s.created_by,
            "lastRunAt": self.last_run_at,
            "nextRunAt": self.next_at,
            "createdAt": s.created_at,
            "updatedAt": s.updated_at,
        })
    }
}

/// Why a schedule change was not made.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("Schedule not found")]
    NotFound,
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The fleet's records did not take the change.
    #[error(transparent)]
    Fleet(#[from] RecordError),
}

/// What a `PATCH` changes; `None` leaves a field as it is.
#[derive(Default)]
pub struct Changes {
    pub name: Option<String>,
    pub cron_expr: Option<String>,
    pub agent_id: Option<String>,
    pub task_template: Option<Value>,
    pub enabled: Option<bool>,
}

impl Changes {
    fn apply_to(&self, schedule: &mut Schedule) {
        let Changes {
            name,
            cron_expr,
            agent_id,
            task_template,
            enabled,
        } = self;
        if let Some(name) = name {
            name.clone_into(&mut schedule.name);
        }
        if let Some(cron_expr) = cron_expr {
            cron_expr.clone_into(&mut schedule.cron_expr);
        }
        if let Some(agent_id) = agent_id {
            agent_id.clone_into(&mut schedule.agent_id);
        }
        if let Some(task_template) = task_template {
            schedule.task_template = task_template.clone();
        }
        if let Some(enabled) = enabled {
            schedule.enabled = *enabled;
        }
        schedule.updated_at = crate::core::now_ms();
    }
}

pub struct Schedules {
    core: Arc<Core>,
    store: Store,
    by_id: DashMap<String, Running>,
    /// Wakes the ticks when a schedule changes.
    changed: tokio::sync::Notify,
}

impl Schedules {
    /// Loads every stored schedule.
    pub async fn load(core: Arc<Core>, store: Store) -> Result<Schedules, StoreError> {
        store.migrate("skynet-schedules", MIGRATIONS).await?;
        let stored = store
            .read(|conn| {
                let mut select = conn.prepare(
                    "SELECT id, name, cron_expr, agent_id, task_template, enabled, created_by,
                            last_run_at, created_at, updated_at
                     FROM skynet_schedules",
                )?;
                let rows = select.query_map([], |r| {
                    let template: String = r.get(4)?;
                    let schedule = Schedule {
                        id: r.get(0)?,
                        name: r.get(1)?,
                        cron_expr: r.get(2)?,
                        agent_id: r.get(3)?,
                        task_template: serde_json::from_str(&template).unwrap_or(Value::Null),
                        enabled: r.get(5)?,
                        created_by: r.get(6)?,
                        created_at: r.get(8)?,
                        updated_at: r.get(9)?,
                    };
                    Ok((schedule, r.get::<_, Option<i64>>(7)?))
                })?;
                Ok(rows.collect::<Result<Vec<_>, _>>()?)
            })
            .await?;
        let by_id = DashMap::new();
        for (schedule, last_run_at) in stored {
            if let Some(running) = Running::new(schedule, last_run_at, None) {
                by_id.insert(running.schedule.id.clone(), running);
            }
        }
        Ok(Schedules {
            core,
            store,
            by_id,
            changed: tokio::sync::Notify::new(),
        })
    }

    /// Follows the fleet's schedules, when there is a fleet.
    pub fn follow(self: &Arc<Self>) {
        if let Some(records) = self.core.records() {
            records.follow(SCHEDULES, sink(self, "skynet schedule", Self::apply));
        }
    }

    /// Every schedule (for `agent_id` only, when given), oldest first, as ScheduleInfo.
    pub fn list(&self, agent_id: Option<&str>) -> Vec<Value> {
        let mut all: Vec<(i64, String, Value)> = (self.by_id.iter())
            .filter(|r| agent_id.is_none_or(|a| r.schedule.agent_id == a))
            .map(|r| (r.schedule.created_at, r.schedule.id.clone(), r.info()))
            .collect();
        all.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        all.into_iter().map(|(_, _, info)| info).collect()
    }

    pub fn info(&self, id: &str) -> Option<Value> {
        self.by_id.get(id).map(|r| r.info())
    }

    /// Creates a schedule whose fields the caller checked; its ScheduleInfo.
    pub async fn create(&self, schedule: Schedule) -> Result<Value, ScheduleError> {
        let mut revision = None;
        if let Some(fleet) = self.core.records() {
            let value = encode(&schedule);
            let written = fleet.write(SCHEDULES, &schedule.id, value, Expect::Absent);
            revision = Some(written.await?);
        }
        let id = schedule.id.clone();
        self.keep(schedule, revision).await?;
        self.info(&id).ok_or(ScheduleError::NotFound)
    }

    /// Changes a schedule; its ScheduleInfo.
    pub async fn update(&self, id: &str, changes: &Changes) -> Result<Value, ScheduleError> {
        let Some(fleet) = self.core.records() else {
            let mut schedule = (self.by_id.get(id))
                .map(|r| r.schedule.clone())
                .ok_or(ScheduleError::NotFound)?;
            changes.apply_to(&mut schedule);
            self.keep(schedule, None).await?;
            return self.info(id).ok_or(ScheduleError::NotFound);
        };
        let mut tries = 0;
        loop {
            tries += 1;
            let record = fleet.read(SCHEDULES, id).await?;
            let Some((value, revision)) = record.and_then(|r| Some((r.value?, r.revision))) else {
                return Err(ScheduleError::NotFound);
            };
            let mut schedule = decode(&value)?;
            changes.apply_to(&mut schedule);
            let written =
                (fleet.write(SCHEDULES, id, encode(&schedule), Expect::At(revision))).await;
            match written {
                Ok(revision) => {
                    self.keep(schedule, Some(revision)).await?;
                    return self.info(id).ok_or(ScheduleError::NotFound);
                }
                Err(RecordError::Conflict) if tries < UPDATE_TRIES => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Deletes a schedule: from the fleet's records first, when there is a fleet.
    pub async fn delete(&self, id: &str) -> Result<(), ScheduleError> {
        if !self.by_id.contains_key(id) {
            return Err(ScheduleError::NotFound);
        }
        if let Some(fleet) = self.core.records() {
            fleet.remove(SCHEDULES, id).await?;
        }
        self.forget(id).await?;
        Ok(())
    }

    /// A change the fleet made to its schedules (through this bridge or another).
    async fn apply(self: Arc<Self>, change: RecordChange) -> Result<(), StoreError> {
        match change.value {
            Some(value) => {
                let schedule = decode(&value)?;
                // Its own write, kept already, comes back through the watch too.
                let known = (self.by_id.get(&schedule.id)).and_then(|r| r.revision);
                if known.is_some_and(|known| known >= change.revision) {
                    return Ok(());
                }
                self.keep(schedule, Some(change.revision)).await
            }
            None => self.forget(&change.key).await,
        }
    }

    /// Stores `schedule` (at the fleet's `revision`) and runs it (again), keeping when it
    /// last ran here.
    async fn keep(&self, schedule: Schedule, revision: Option<Revision>) -> Result<(), StoreError> {
        let row = schedule.clone();
        let template = row.task_template.to_string();
        self.store
            .write(move |conn| {
                conn.execute(
                    "INSERT INTO skynet_schedules
                        (id, name, cron_expr, agent_id, task_template, enabled, created_by, created_at, updated_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
                     ON CONFLICT (id) DO UPDATE SET name = ?2, cron_expr = ?3, agent_id = ?4,
                        task_template = ?5, enabled = ?6, created_by = ?7, created_at = ?8, updated_at = ?9",
                    params![
                        row.id, row.name, row.cron_expr, row.agent_id, template, row.enabled,
                        row.created_by, row.created_at, row.updated_at
                    ],
                )?;
                Ok(())
            })
            .await?;
        let known = self
            .by_id
            .get(&schedule.id)
            .map(|r| (r.last_run_at, r.revision));
        let (last_run_at, known_revision) = known.unwrap_or_default();
        // A newer revision kept meanwhile (by the watch, or a write here) stays.
        if known_revision.is_some_and(|known| revision.is_none_or(|r| r < known)) {
            return Ok(());
        }
        let id = schedule.id.clone();
        match Running::new(schedule, last_run_at, revision) {
            Some(running) => drop(self.by_id.insert(id, running)),
            None => drop(self.by_id.remove(&id)),
        }
        self.changed.notify_one();
        Ok(())
    }

    async fn forget(&self, id: &str) -> Result<(), StoreError> {
        let row_id = id.to_owned();
        self.store
            .write(move |conn| {
                conn.execute("DELETE FROM skynet_schedules WHERE id = ?1", [row_id])?;
                Ok(())
            })
            .await?;
        self.by_id.remove(id);
        self.changed.notify_one();
        Ok(())
    }

    /// The schedules due at `now` (Unix ms), each with the tick it is due for, counted as
    /// run; each is set to its next tick after `now` (ticks missed meanwhile, while the
    /// bridge was stopped or busy, are not made up).
    fn take_due(&self, now: i64) -> Vec<(Schedule, i64)> {
        let mut due = Vec::new();
        for mut running in self.by_id.iter_mut() {
            let Some(at) = running.next_at.filter(|at| *at <= now) else {
                continue;
            };
            running.last_run_at = Some(at);
            running.next_at = next_after(&running.cron, now.max(at));
            due.push((running.schedule.clone(), at));
        }
        due
    }

    /// When the next schedule is due, if any is.
    fn next_due(&self) -> Option<i64> {
        self.by_id.iter().filter_map(|r| r.next_at).min()
    }

    /// Notes when `id` last ran, for `lastRunAt` after a restart.
    async fn ran(&self, id: &str, at: i64) -> Result<(), StoreError> {
        let row_id = id.to_owned();
        self.store
            .write(move |conn| {
                conn.execute(
                    "UPDATE skynet_schedules SET last_run_at = ?2 WHERE id = ?1",
                    params![row_id, at],
                )?;
                Ok(())
            })
            .await
    }
}

fn encode(schedule: &Schedule) -> bytes::Bytes {
    serde_json::to_vec(schedule)
        .expect("a schedule is plain data")
        .into()
}

fn decode(value: &[u8]) -> Result<Schedule, StoreError> {
    serde_json::from_slice(value).map_err(|e| StoreError::Corrupt(format!("a fleet schedule: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn five_and_six_field_expressions_are_taken_and_nonsense_is_not() {
        for expr in [
            "0 9 * * *",
            "*/30 * * * *",
            "0 17 * * 1-5",
            "0 9,17 * * *",
            "* * * * * *",
        ] {
            assert!(parse_cron(expr).is_ok(), "{expr}");
        }
        for expr in ["", "60 * * * *", "* * *", "every day", "0 0 30 2 *"] {
            assert!(parse_cron(expr).is_err(), "{expr}");
        }
    }

    #[test]
    fn the_next_tick_is_in_utc_and_after_the_time_given() {
        let cron = parse_cron("0 9 * * *").unwrap();
        // 2026-12-06T08:59:59.500Z → 09:00:00Z the same day.
        let at = chrono::DateTime::parse_from_rfc3339("2026-12-06T08:59:59.500Z").unwrap();
        let next = next_after(&cron, at.timestamp_millis()).unwrap();
        let nine = chrono::DateTime::parse_from_rfc3339("2026-12-06T09:00:00Z").unwrap();
        assert_eq!(next, nine.timestamp_millis());
        // Exactly on a tick: the one after.
        let after = next_after(&cron, next).unwrap();
        assert_eq!(after - next, 24 * 3600 * 1000);
    }
}
