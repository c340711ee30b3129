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
//! fleet's log, which takes an id once. So the other bridges look, a while after the tick,
//! whether its message reached them, and if not the first of them to claim sending it in
//! `RESENT_TICKS` sends it: the claimer may have been killed between its claim and its
//! send, or had its publish refused.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

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

/// The ticks claimed by a bridge that did not send them, each sent by the bridge that
/// created its record here (keyed `<schedule id>@<tick>`, the tick as text).
pub const RESENT_TICKS: &str = "skynet-schedule-resent-ticks";

/// The longest sleep between looks at the schedules, so that a jump of the wall clock is
/// noticed within it.
const LOOK_AT_LEAST_EVERY: Duration = Duration::from_secs(60);

/// How long after another bridge claimed a tick its message must have reached this
/// bridge's store; past that, this bridge sends it. Longer than a publish waits for
/// JetStream by default (`publish_timeout_ms`, twice over for a retried record write) and
/// than a message takes to be applied here.
const CLAIMED_TICK_SENT_WITHIN: Duration = Duration::from_secs(30);

/// The most ticks claimed by other bridges that are followed at once (a thousand schedules
/// firing every second); past it the newest are not.
const MOST_FOLLOWED: usize = 30_000;

/// Fires the schedules as they come due, until shutdown.
pub async fn run(skynet: Arc<Skynet>) {
    let schedules = skynet.schedules.clone();
    // Ticks other bridges claimed: when to look for their messages, the schedule, the tick.
    let mut claimed_elsewhere: VecDeque<(Instant, String, i64)> = VecDeque::new();
    loop {
        let changed = schedules.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        for (schedule, at) in schedules.take_due(now_ms()) {
            let theirs = fire(&skynet, &schedule, at).await == Claim::Theirs;
            if theirs && claimed_elsewhere.len() < MOST_FOLLOWED {
                let look_at = Instant::now() + CLAIMED_TICK_SENT_WITHIN;
                claimed_elsewhere.push_back((look_at, schedule.id, at));
            } else if theirs {
                tracing::warn!(schedule = %schedule.id, at, "skynet: too many ticks claimed by other bridges are followed; this one is not");
            }
        }
        while let Some((look_at, ..)) = claimed_elsewhere.front()
            && *look_at <= Instant::now()
        {
            if let Some((_, id, at)) = claimed_elsewhere.pop_front()
                && !send_if_not_sent(&skynet, &id, at).await
            {
                // The fleet's records did not answer: looked at again later.
                let look_at = Instant::now() + CLAIMED_TICK_SENT_WITHIN;
                claimed_elsewhere.push_back((look_at, id, at));
            }
        }
        let wait = match schedules.next_due() {
            Some(at) => Duration::from_millis(at.saturating_sub(now_ms()).max(0) as u64),
            None => LOOK_AT_LEAST_EVERY,
        };
        let look_in = claimed_elsewhere
            .front()
            .map(|(at, ..)| *at - Instant::now());
        let wait = look_in.map_or(wait, |look_in| wait.min(look_in));
        tokio::select! {
            () = tokio::time::sleep(wait.min(LOOK_AT_LEAST_EVERY)) => {}
            () = changed => {}
            () = skynet.shutdown.cancelled() => return,
        }
    }
}

/// Tick `at` of schedule `id`, as the ids derived from it and its `RESENT_TICKS` key name it.
fn tick_key(id: &str, at: i64) -> String {
    format!("{id}@{at}")
}

/// The id of the message tick `at` of schedule `id` sends, the same on every bridge.
fn tick_id(id: &str, at: i64) -> String {
    derived_uuid("schedule-tick", &tick_key(id, at)).to_string()
}

/// The SkynetMessage a schedule's tick at `at` (Unix ms) sends to the agent whose card id
/// is `agent`, as Skynet's scheduler builds it: a TaskPayload of the task template,
/// pending, its schedule named in `metadata`.
pub fn tick_message(schedule: &Schedule, at: i64, agent: &str) -> Value {
    let tick = tick_key(&schedule.id, at);
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
        "id": tick_id(&schedule.id, at),
        "type": "task.assign",
        "from": SCHEDULER,
        "timestamp": at,
        "payload": payload,
        "mentions": [agent],
    })
}

/// Whose a schedule's tick is to fire.
#[derive(Debug, PartialEq)]
enum Claim {
    /// This bridge's: no other bridge claimed it, nor a later tick.
    Ours,
    /// Another bridge's, which claimed this very tick.
    Theirs,
    /// Nobody's: another bridge claimed a later tick (this bridge's clock is behind).
    Passed,
}

/// Fires a schedule's tick, if this bridge is the one to; notes that it ran.
async fn fire(skynet: &Arc<Skynet>, schedule: &Schedule, at: i64) -> Claim {
    let claim = match skynet.core.records() {
        None => Claim::Ours,
        Some(fleet) => claim(fleet.as_ref(), &schedule.id, at).await.unwrap_or_else(|e| {
            tracing::warn!(schedule = %schedule.id, error = %e, "skynet: a tick could not be claimed in the fleet; fired here all the same");
            Claim::Ours
        }),
    };
    if claim == Claim::Ours {
        send(skynet, schedule, at).await;
    }
    if let Err(e) = skynet.schedules.ran(&schedule.id, at).await {
        tracing::warn!(schedule = %schedule.id, error = %e, "skynet: when a schedule ran is not stored");
    }
    claim
}

/// Sends tick `at` of schedule `id`, which another bridge claimed, if its message has not
/// reached this bridge's store (and the schedule is still enabled), and no other bridge
/// claimed sending it first; false when that is not known (the store or the fleet's
/// records did not answer).
async fn send_if_not_sent(skynet: &Arc<Skynet>, id: &str, at: i64) -> bool {
    let Some(schedule) = skynet.schedules.enabled(id) else {
        return true;
    };
    match skynet.core.log.contains(&tick_id(id, at)).await {
        Ok(true) => return true,
        Ok(false) => {}
        Err(e) => {
            tracing::warn!(schedule = %id, error = %e, "skynet: whether a tick another bridge claimed was sent is not known");
            return false;
        }
    }
    if let Some(fleet) = skynet.core.records() {
        let key = tick_key(id, at);
        let claimed = fleet.write(RESENT_TICKS, &key, at.to_string().into(), Expect::Absent);
        match claimed.await {
            Ok(_) => {}
            Err(RecordError::Conflict) => return true,
            Err(e) => {
                tracing::warn!(schedule = %id, error = %e, "skynet: sending a tick another bridge claimed is not claimed yet");
                return false;
            }
        }
    }
    tracing::warn!(schedule = %id, at, "skynet: a tick another bridge claimed did not reach this one; it is sent from here");
    send(skynet, &schedule, at).await;
    true
}

/// Claims tick `at` of schedule `id` in the fleet's records.
async fn claim(fleet: &dyn SharedRecords, id: &str, at: i64) -> Result<Claim, RecordError> {
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
        match last {
            Some(last) if last == at => return Ok(Tried::Done(Claim::Theirs)),
            Some(last) if last > at => return Ok(Tried::Done(Claim::Passed)),
            _ => {}
        }
        let written = fleet
            .write(TICKS, id, at.to_string().into(), expected)
            .await;
        Ok(match unless_lost(written)? {
            Some(_) => Tried::Done(Claim::Ours),
            None => Tried::Lost,
        })
    })
    .await?;
    // A claim that lost to another bridge's write every time is taken for theirs: if its
    // message is not sent, the look after the tick sends it.
    Ok(claimed.unwrap_or(Claim::Theirs))
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
