//! Skynet's scheduler (`skynet-scheduler.md`): recurring tasks for agents, kept in the
//! store and, in a fleet, as the fleet's shared records, so that every bridge lists the
//! same schedules. Each tick is fired by one bridge of the fleet (`ticks`).
//!
//! A schedule's definition is shared; when it last ran is each bridge's own record of the
//! ticks it saw, and when it runs next is worked out from its cron expression, in UTC.

pub mod routes;
mod store;
pub mod ticks;

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use croner::Cron;
use dashmap::DashMap;
use serde_json::{Value, json};

use crate::core::{
    Core, Expect, RecordChange, RecordError, Revision, Tried, sink, unless_lost, until_not_lost,
};
use crate::protocols::record_json::{decode, encode};
use crate::shared::arrival_order::ArrivalOrder;
use crate::store::{Store, StoreError};
use store::Table;

/// The table of schedules in the fleet's records, keyed by schedule id.
pub const SCHEDULES: &str = "skynet-schedules";

/// A schedule's definition: what the fleet shares.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Schedule {
    pub id: String,
    pub name: String,
    pub cron_expr: String,
    /// The target agent's id as Skynet clients know it (a card id).
    pub agent_id: String,
    /// `{title, description, files?, metadata?}`.
    pub task_template: Value,
    pub enabled: bool,
    pub created_by: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// A cron expression as Skynet's scheduler (croner) reads it: five fields, or six with
/// seconds (or seven with a year). One that never fires is taken, as croner takes it,
/// with no next run.
pub fn parse_cron(expr: &str) -> Result<Cron, String> {
    Cron::from_str(expr.trim()).map_err(|e| e.to_string())
}

/// The first time after `after_ms` (Unix ms, UTC) that `cron` fires, if it ever does.
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
    /// When it fires next; `None` while disabled, or when it never will.
    next_at: Option<i64>,
}

impl Running {
    /// `schedule`, to run from now on; `before` is what this bridge ran of it until now.
    fn new(schedule: Schedule, before: Option<&Running>) -> Option<Running> {
        let cron = match parse_cron(&schedule.cron_expr) {
            Ok(cron) => cron,
            Err(e) => {
                tracing::warn!(schedule = %schedule.id, error = %e, "skynet: a schedule's cron expression is not read; it does not run");
                return None;
            }
        };
        // A change that leaves when it runs as it was keeps its next tick, even one due
        // this instant.
        let same_times = before.filter(|b| {
            b.schedule.cron_expr == schedule.cron_expr && b.schedule.enabled == schedule.enabled
        });
        let next_at = match same_times {
            Some(before) => before.next_at,
            None if schedule.enabled => next_after(&cron, crate::core::now_ms()),
            None => None,
        };
        Some(Running {
            schedule,
            cron,
            last_run_at: before.and_then(|b| b.last_run_at),
            next_at,
        })
    }

    /// ScheduleInfo, as the HTTP API answers: `createdBy`, `lastRunAt` and `nextRunAt`
    /// left out when there are none, as Skynet's server leaves them out.
    fn info(&self) -> Value {
        let s = &self.schedule;
        let mut info = json!({
            "id": s.id,
            "name": s.name,
            "cronExpr": s.cron_expr,
            "agentId": s.agent_id,
            "taskTemplate": s.task_template,
            "enabled": s.enabled,
            "createdAt": s.created_at,
            "updatedAt": s.updated_at,
        });
        let optional = [
            ("createdBy", s.created_by.as_ref().map(|c| json!(c))),
            ("lastRunAt", self.last_run_at.map(|at| json!(at))),
            ("nextRunAt", self.next_at.map(|at| json!(at))),
        ];
        for (key, value) in optional {
            if let (Some(value), Some(info)) = (value, info.as_object_mut()) {
                info.insert(key.into(), value);
            }
        }
        info
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

/// How long a schedule's removal is remembered against a late write of it.
const REMOVAL_REMEMBERED: Duration = Duration::from_secs(600);

pub struct Schedules {
    core: Arc<Core>,
    table: Table,
    by_id: DashMap<String, Running>,
    /// Changes to the table and to `by_id` are made one at a time, so that the two agree.
    writing: tokio::sync::Mutex<()>,
    /// In a fleet: the revisions at which schedules were removed, recently, so that a
    /// write of an earlier revision landing after (a change's own keep, behind the watch)
    /// does not bring one back.
    removed: DashMap<String, (Revision, Instant)>,
    /// Wakes the ticks when a schedule changes.
    changed: tokio::sync::Notify,
    /// The order schedules came to this bridge, for `list`.
    order: ArrivalOrder,
}

impl Schedules {
    /// Loads every stored schedule.
    pub async fn load(core: Arc<Core>, store: Store) -> Result<Schedules, StoreError> {
        let table = Table::open(store).await?;
        let by_id = DashMap::new();
        let order = ArrivalOrder::default();
        for row in table.all().await? {
            let id = row.schedule.id.clone();
            let ran = Running::new(row.schedule, None).map(|mut running| {
                running.last_run_at = row.last_run_at;
                running
            });
            if let Some(running) = ran {
                order.arrived(&id);
                by_id.insert(id, running);
            }
        }
        Ok(Schedules {
            core,
            table,
            by_id,
            writing: tokio::sync::Mutex::new(()),
            removed: DashMap::new(),
            changed: tokio::sync::Notify::new(),
            order,
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
        let mut all: Vec<((i64, u64), Value)> = (self.by_id.iter())
            .filter(|r| agent_id.is_none_or(|a| r.schedule.agent_id == a))
            .map(|r| {
                (
                    (r.schedule.created_at, self.order.place(&r.schedule.id)),
                    r.info(),
                )
            })
            .collect();
        all.sort_by_key(|(created, _)| *created);
        all.into_iter().map(|(_, info)| info).collect()
    }

    /// How many schedules there are.
    pub fn count(&self) -> usize {
        self.by_id.len()
    }

    pub fn info(&self, id: &str) -> Option<Value> {
        self.by_id.get(id).map(|r| r.info())
    }

    /// Creates a schedule whose fields the caller checked; its ScheduleInfo.
    pub async fn create(&self, schedule: Schedule) -> Result<Value, ScheduleError> {
        let id = schedule.id.clone();
        let Some(fleet) = self.core.records() else {
            self.keep(schedule, None).await?;
            return self.info(&id).ok_or(ScheduleError::NotFound);
        };
        let written = fleet.write(SCHEDULES, &id, encode(&schedule), Expect::Absent);
        let revision = written.await?;
        if let Err(e) = self.keep(schedule, Some(revision)).await {
            // Not kept here: not the fleet's either, so that a retry makes no twin.
            if let Err(e) = fleet.remove(SCHEDULES, &id).await {
                tracing::warn!(error = %e, "skynet: a schedule not kept here stays in the fleet's records");
            }
            return Err(e.into());
        }
        self.info(&id).ok_or(ScheduleError::NotFound)
    }

    /// Changes a schedule; its ScheduleInfo.
    pub async fn update(&self, id: &str, changes: &Changes) -> Result<Value, ScheduleError> {
        let Some(fleet) = self.core.records() else {
            // Read and written under one lock: a schedule deleted meanwhile stays deleted.
            let writing = self.writing.lock().await;
            let mut schedule = (self.by_id.get(id))
                .map(|r| r.schedule.clone())
                .ok_or(ScheduleError::NotFound)?;
            changes.apply_to(&mut schedule);
            self.keep_writing(schedule, None, &writing).await?;
            return self.info(id).ok_or(ScheduleError::NotFound);
        };
        let changed = until_not_lost::<_, ScheduleError, _, _>(|| async {
            let record = fleet.read(SCHEDULES, id).await?;
            let Some((value, revision)) = record.and_then(|r| Some((r.value?, r.revision))) else {
                return Err(ScheduleError::NotFound);
            };
            let mut schedule: Schedule = decode(&value)?;
            changes.apply_to(&mut schedule);
            let written = fleet.write(SCHEDULES, id, encode(&schedule), Expect::At(revision));
            let Some(revision) = unless_lost(written.await)? else {
                return Ok(Tried::Lost);
            };
            self.keep(schedule, Some(revision)).await?;
            Ok(Tried::Done(()))
        })
        .await?;
        changed.ok_or(RecordError::Conflict)?;
        self.info(id).ok_or(ScheduleError::NotFound)
    }

    /// Deletes a schedule: from the fleet's records first, when there is a fleet.
    pub async fn delete(&self, id: &str) -> Result<(), ScheduleError> {
        if !self.by_id.contains_key(id) {
            return Err(ScheduleError::NotFound);
        }
        if let Some(fleet) = self.core.records() {
            fleet.remove(SCHEDULES, id).await?;
            // Which tick it last fired goes with it.
            if let Err(e) = fleet.remove(ticks::TICKS, id).await {
                tracing::debug!(error = %e, "skynet: a deleted schedule's last tick stays in the fleet's records");
            }
        }
        self.forget(id, None).await?;
        Ok(())
    }

    /// Deletes the schedules of the agent with `id` and `name` (named by either, as a
    /// schedule may name its agent); how many there were.
    pub async fn delete_for_agent(&self, id: &str, name: &str) -> Result<usize, ScheduleError> {
        let theirs: Vec<String> = (self.by_id.iter())
            .filter(|r| r.schedule.agent_id == id || r.schedule.agent_id == name)
            .map(|r| r.schedule.id.clone())
            .collect();
        for id in &theirs {
            match self.delete(id).await {
                Ok(()) | Err(ScheduleError::NotFound) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(theirs.len())
    }

    /// A change the fleet made to its schedules (through this bridge or another).
    async fn apply(self: Arc<Self>, change: RecordChange) -> Result<(), StoreError> {
        match change.value {
            Some(value) => self.keep(decode(&value)?, Some(change.revision)).await,
            None => self.forget(&change.key, Some(change.revision)).await,
        }
    }

    /// Stores `schedule` (at the fleet's `revision`, in a fleet) and runs it, unless a
    /// later revision of it is here already: its own write comes back through the watch,
    /// and the watch's copy of a later change may come before a write's own keep.
    async fn keep(&self, schedule: Schedule, revision: Option<Revision>) -> Result<(), StoreError> {
        let writing = self.writing.lock().await;
        self.keep_writing(schedule, revision, &writing).await
    }

    /// `keep`, under the `writing` lock its caller holds. The table's row and `by_id` move
    /// together under it, so the row's revision (`Table::upsert`) says for both whether
    /// `revision` is later than what is here.
    async fn keep_writing(
        &self,
        schedule: Schedule,
        revision: Option<Revision>,
        _writing: &tokio::sync::MutexGuard<'_, ()>,
    ) -> Result<(), StoreError> {
        let removed_since = (self.removed.get(&schedule.id))
            .zip(revision)
            .is_some_and(|(removed, revision)| removed.0 >= revision);
        if removed_since || !self.table.upsert(&schedule, revision).await? {
            return Ok(());
        }
        let id = schedule.id.clone();
        let running = Running::new(schedule, self.by_id.get(&id).as_deref());
        if let Some(running) = running {
            self.order.arrived(&id);
            self.by_id.insert(id, running);
        }
        self.changed.notify_one();
        Ok(())
    }

    /// Removes schedule `id` (removed from the fleet's records at `revision`, in a fleet).
    async fn forget(&self, id: &str, revision: Option<Revision>) -> Result<(), StoreError> {
        let _writing = self.writing.lock().await;
        self.table.delete(id).await?;
        self.by_id.remove(id);
        self.order.forget(id);
        if let Some(revision) = revision {
            (self.removed).retain(|_, (_, at)| at.elapsed() < REMOVAL_REMEMBERED);
            self.removed
                .insert(id.to_owned(), (revision, Instant::now()));
        }
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

    /// Schedule `id` as it is now, while it is enabled.
    fn enabled(&self, id: &str) -> Option<Schedule> {
        let running = self.by_id.get(id)?;
        running.schedule.enabled.then(|| running.schedule.clone())
    }

    /// When the next schedule is due, if any is.
    fn next_due(&self) -> Option<i64> {
        self.by_id.iter().filter_map(|r| r.next_at).min()
    }

    /// Notes when `id` last ran here, for `lastRunAt` after a restart.
    async fn ran(&self, id: &str, at: i64) -> Result<(), StoreError> {
        self.table.ran(id, at).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn croners_expressions_are_taken_and_nonsense_is_not() {
        let taken = [
            "0 9 * * *",
            "*/30 * * * *",
            "0 17 * * 1-5",
            "0 9,17 * * *",
            "* * * * * *",
            "0 0 30 2 *",
        ];
        for expr in taken {
            assert!(parse_cron(expr).is_ok(), "{expr}");
        }
        for expr in ["", "60 * * * *", "* * *", "every day"] {
            assert!(parse_cron(expr).is_err(), "{expr}");
        }
        let never = parse_cron("0 0 30 2 *").unwrap();
        assert_eq!(next_after(&never, crate::core::now_ms()), None);
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

    #[tokio::test]
    async fn schedules_created_in_one_millisecond_are_listed_in_the_order_made() {
        use crate::core::RoutingConfig;
        use crate::store::IN_MEMORY;

        let store = Store::open(IN_MEMORY).await.unwrap();
        let log = Arc::new(store.clone());
        let core = Core::new(log.clone(), log, &RoutingConfig::default());
        let schedule = |id: &str| Schedule {
            id: id.into(),
            name: id.into(),
            cron_expr: "0 9 * * *".into(),
            agent_id: "agent".into(),
            task_template: json!({ "title": "t", "description": "d" }),
            enabled: true,
            created_by: None,
            created_at: 1,
            updated_at: 1,
        };
        let names = |schedules: &Schedules| -> Vec<String> {
            let listed = schedules.list(None);
            listed
                .iter()
                .map(|s| s["name"].as_str().unwrap().to_owned())
                .collect()
        };
        let schedules = Schedules::load(core.clone(), store.clone()).await.unwrap();
        for id in ["c", "a", "b"] {
            schedules.create(schedule(id)).await.unwrap();
        }
        assert_eq!(names(&schedules), ["c", "a", "b"]);
        // A change keeps a schedule's place, and a restart keeps the order.
        let disabled = Changes {
            enabled: Some(false),
            ..Changes::default()
        };
        schedules.update("c", &disabled).await.unwrap();
        assert_eq!(names(&schedules), ["c", "a", "b"]);
        let reloaded = Schedules::load(core, store).await.unwrap();
        assert_eq!(names(&reloaded), ["c", "a", "b"]);
    }
}
