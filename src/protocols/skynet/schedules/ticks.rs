//! Firing schedules: on each tick of a schedule, a `task.assign` to its agent, stored and
//! routed as a sent message is ("reuses existing message routing"), so an agent away
//! finds it in its join's replay, and an agent of another protocol gets it as a task.
//!
//! In a fleet every bridge runs every schedule, and the one whose claim on the tick lands
//! first fires it: the claim is a write of the tick's time to the schedule's record in
//! `TICKS` at the revision read, made only while that record holds an earlier tick, so
//! one record a schedule says which tick was fired last. A bridge that cannot reach the
//! records fires the tick all the same. The message's id, and its task's, are derived from
//! the schedule and the tick, so that a tick fired twice is still one message to the
//! fleet's log, which takes an id once.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::Schedule;
use crate::core::{
    Expect, RecordError, SharedRecords, Tried, derived_uuid, now_ms, unless_lost, until_not_lost,
};
use crate::protocols::skynet::sent::SentMessage;
use crate::protocols::skynet::wire::{Data, SCHEDULER};
use crate::protocols::skynet::{PROTOCOL, Skynet, translate};

/// The last tick fired of each schedule (Unix ms, as text), keyed by schedule id.
pub const TICKS: &str = "skynet-schedule-ticks";

/// The longest sleep between looks at the schedules, so that a jump of the wall clock is
/// noticed within it.
const LOOK_AT_LEAST_EVERY: Duration = Duration::from_secs(60);

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

/// The SkynetMessage a schedule's tick at `at` (Unix ms) sends to the agent whose card id
/// is `agent`, as Skynet's scheduler builds it: a TaskPayload of the task template,
/// pending, its schedule named in `metadata`.
pub fn tick_message(schedule: &Schedule, at: i64, agent: &str) -> Value {
    let tick = format!("{}@{at}", schedule.id);
    let template = |key: &str| schedule.task_template.get(key).cloned();
    let mut metadata = match template("metadata") {
        Some(Value::Object(metadata)) => metadata,
        _ => serde_json::Map::new(),
    };
    metadata.insert("scheduledBy".into(), json!(schedule.id));
    metadata.insert("scheduleName".into(), json!(schedule.name));
    let mut payload = serde_json::Map::new();
    payload.insert(
        "taskId".into(),
        json!(derived_uuid("schedule-task", &tick).to_string()),
    );
    for key in ["title", "description"] {
        if let Some(value) = template(key).filter(|v| !v.is_null()) {
            payload.insert(key.into(), value);
        }
    }
    payload.insert("assignee".into(), json!(schedule.agent_id));
    payload.insert("status".into(), json!("pending"));
    if let Some(files) = template("files").filter(|f| !f.is_null()) {
        payload.insert("files".into(), files);
    }
    payload.insert("metadata".into(), Value::Object(metadata));
    json!({
        "id": derived_uuid("schedule-tick", &tick).to_string(),
        "type": "task.assign",
        "from": SCHEDULER,
        "timestamp": at,
        "payload": payload,
        "mentions": [agent],
    })
}

/// Fires a schedule's tick, if this bridge is the one to; notes that it ran.
async fn fire(skynet: &Arc<Skynet>, schedule: &Schedule, at: i64) {
    let ours = match skynet.core.records() {
        None => true,
        Some(fleet) => claim(fleet.as_ref(), &schedule.id, at).await.unwrap_or_else(|e| {
            tracing::warn!(schedule = %schedule.id, error = %e, "skynet: a tick could not be claimed in the fleet; fired here all the same");
            true
        }),
    };
    if ours {
        send(skynet, schedule, at).await;
    }
    if let Err(e) = skynet.schedules.ran(&schedule.id, at).await {
        tracing::warn!(schedule = %schedule.id, error = %e, "skynet: when a schedule ran is not stored");
    }
}

/// Claims tick `at` of schedule `id` in the fleet's records: whether this bridge is the
/// one to fire it (no other bridge claimed it, nor a later tick).
async fn claim(fleet: &dyn SharedRecords, id: &str, at: i64) -> Result<bool, RecordError> {
    let claimed = until_not_lost::<_, RecordError, _, _>(|| async {
        let record = fleet.read(TICKS, id).await?;
        let (last, expected) = match record.and_then(|r| Some((r.value?, r.revision))) {
            Some((value, revision)) => {
                let last = std::str::from_utf8(&value)
                    .ok()
                    .and_then(|v| v.parse::<i64>().ok());
                (last, Expect::At(revision))
            }
            None => (None, Expect::Absent),
        };
        if last.is_some_and(|last| last >= at) {
            return Ok(Tried::Done(false));
        }
        let written = fleet
            .write(TICKS, id, at.to_string().into(), expected)
            .await;
        Ok(match unless_lost(written)? {
            Some(_) => Tried::Done(true),
            None => Tried::Lost,
        })
    })
    .await?;
    Ok(claimed.unwrap_or(false))
}

async fn send(skynet: &Arc<Skynet>, schedule: &Schedule, at: i64) {
    // The agent as a card id: a registered Skynet agent may be named by its name.
    let agent = (skynet.registry.by_id_or_name(&schedule.agent_id, false))
        .map_or_else(|| schedule.agent_id.clone(), |profile| profile.id);
    let message = tick_message(schedule, at, &agent);
    // A firing of this tick already applied here (by a bridge that could not claim it).
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
    sent.stamp(SCHEDULER);
    let (mut env, unknown) = translate::decode(sent, SCHEDULER, skynet.as_ref());
    env.echo = false;
    if !unknown.is_empty() {
        tracing::info!(schedule = %schedule.id, agent = %schedule.agent_id, "skynet: a schedule's agent is not known here; its task is stored for it");
    }
    if let Err(e) = skynet.core.publish(env).await {
        tracing::warn!(schedule = %schedule.id, protocol = PROTOCOL, error = %e, "skynet: a schedule's task could not be stored; this tick is missed");
    }
}
