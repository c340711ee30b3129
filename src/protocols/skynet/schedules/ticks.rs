//! Firing schedules: on each tick of a schedule, a `task.assign` to its agent, stored and
//! routed as a sent message is ("reuses existing message routing"), so an agent away
//! finds it in its join's replay, and an agent of another protocol gets it as a task.
//!
//! The message's id, and its task's, are derived from the schedule's id and the tick's
//! time: every bridge of a fleet fires the same tick as the same message, which the
//! fleet's log takes once (its deduplication by id) and each bridge applies once. Clocks
//! further apart than the log's deduplication window would fire a tick twice.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::Schedule;
use crate::core::{derived_uuid, now_ms};
use crate::protocols::skynet::sent::SentMessage;
use crate::protocols::skynet::wire::Data;
use crate::protocols::skynet::{PROTOCOL, Skynet, translate};

/// The longest sleep between looks at the schedules, so that a jump of the wall clock is
/// noticed within it.
const LOOK_AT_LEAST_EVERY: Duration = Duration::from_secs(60);

/// Who a tick's message is from when its schedule names no creator this bridge knows.
pub const SCHEDULER: &str = "scheduler";

/// Fires the schedules as they come due, until shutdown.
pub async fn run(skynet: Arc<Skynet>) {
    let schedules = skynet.schedules.clone();
    loop {
        let changed = schedules.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        for (schedule, at) in schedules.take_due(now_ms()) {
            fire(&skynet, &schedule, at).await;
        }
        let wait = match schedules.next_due() {
            Some(at) => Duration::from_millis(at.saturating_sub(now_ms()).max(0) as u64),
            None => LOOK_AT_LEAST_EVERY,
        };
        tokio::select! {
            () = tokio::time::sleep(wait.min(LOOK_AT_LEAST_EVERY)) => {}
            () = changed => {}
            () = skynet.shutdown.cancelled() => return,
        }
    }
}

/// The SkynetMessage a schedule's tick at `at` (Unix ms) sends, from `from` (a card id).
pub fn tick_message(schedule: &Schedule, at: i64, from: &str) -> Value {
    let tick = format!("{}@{at}", schedule.id);
    let mut payload = match &schedule.task_template {
        Value::Object(template) => template.clone(),
        _ => serde_json::Map::new(),
    };
    payload.insert(
        "taskId".into(),
        json!(derived_uuid("schedule-task", &tick).to_string()),
    );
    payload.insert("scheduleId".into(), json!(schedule.id));
    payload.insert("scheduleName".into(), json!(schedule.name));
    json!({
        "id": derived_uuid("schedule-tick", &tick).to_string(),
        "type": "task.assign",
        "from": from,
        "timestamp": at,
        "payload": payload,
        "mentions": [schedule.agent_id],
    })
}

/// Sends a schedule's tick to its agent, and notes that it ran.
async fn fire(skynet: &Arc<Skynet>, schedule: &Schedule, at: i64) {
    send(skynet, schedule, at).await;
    if let Err(e) = skynet.schedules.ran(&schedule.id, at).await {
        tracing::warn!(schedule = %schedule.id, error = %e, "skynet: when a schedule ran is not stored");
    }
}

async fn send(skynet: &Arc<Skynet>, schedule: &Schedule, at: i64) {
    // From the schedule's creator when it is a registered agent or human, else from the
    // scheduler itself.
    let creator = (schedule.created_by.as_deref())
        .and_then(|id| (skynet.registry.by_id(id)).map(|p| (p.id, p.name)));
    let (from, sender) = creator.unwrap_or_else(|| (SCHEDULER.into(), SCHEDULER.into()));
    let message = tick_message(schedule, at, &from);
    // Another bridge's firing of this tick, applied here first, is this one.
    if (message["id"].as_str()).is_some_and(|id| skynet.core.recently_seen(id)) {
        return;
    }
    let text = message.to_string();
    let parsed = serde_json::from_str::<Data<'_>>(&text)
        .map_err(|e| e.to_string())
        .and_then(|data| SentMessage::parse(Some(data)).map_err(|e| format!("{e:?}")));
    let mut sent = match parsed {
        Ok(sent) => sent,
        Err(e) => {
            tracing::error!(schedule = %schedule.id, error = %e, "skynet: a schedule's task is not a SkynetMessage");
            return;
        }
    };
    sent.stamp(&from);
    let (env, unknown) = translate::decode(sent, &sender, skynet.as_ref());
    if !unknown.is_empty() {
        tracing::info!(schedule = %schedule.id, agent = %schedule.agent_id, "skynet: a schedule's agent is not known here; its task is stored for it");
    }
    if let Err(e) = skynet.core.publish(env).await {
        tracing::warn!(schedule = %schedule.id, protocol = PROTOCOL, error = %e, "skynet: a schedule's task could not be stored; this tick is missed");
    }
}
