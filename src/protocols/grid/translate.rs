//! Grid message ⇄ Envelope. The Grid's `correlation_id` names the message a message
//! answers: it is the envelope's `reply_to`.
//!
//! | Grid `type` / `content.action` | Envelope kind |
//! |---|---|
//! | `mission_assigned` | task assign |
//! | `task_started`, `progress_update` | task update (working, `payload.percent` as progress) |
//! | `verification_started` | task update (in review) |
//! | `task_complete` | task result (completed) |
//! | `checkpoint_request` | decision request (a human is asked) |
//! | `checkpoint_response` | decision response |
//! | `abort` | control abort |
//! | `type: error` (`error_report`) | error; a task failure when it answers an assignment |
//! | anything else | chat, its text from `payload.text` / `payload.message` or the payload |
//!
//! Going out, another protocol's structured data (`data`) stays in the payload: an object's
//! keys join those of a task assignment, update or chat; a task result's is `result`.

use serde_json::{Map, Value, json};

use super::PROTOCOL;
use super::wire::{BROADCAST, Message, Party};
use crate::core::{Audience, Envelope, Kind, Origin, Priority, TaskInfo, TaskState};
use crate::protocols::endpoint::{Decoded, PreviewFrame as Frame, Translation};
use crate::shared::clock::iso8601;

/// A Grid message → Envelope; the message's document becomes `origin.native`.
/// The Grid's side of the translation contract.
pub struct Translator;

impl Translation for Translator {
    type Inbound<'a> = Message;
    type Outbound = Value;
    /// A message that passed `wire::validate` always translates.
    type Refusal = std::convert::Infallible;
    /// The Grid shows another protocol's agent by its name alone.
    type Context = ();

    fn decode(_: &(), msg: Message) -> Result<Decoded, Self::Refusal> {
        Ok(decode(msg).into())
    }

    fn encode(_: &(), env: &Envelope) -> Option<Value> {
        encode(env)
    }

    /// A state as the Grid action it is sent as, read back through the wire's checks.
    fn task_state(state: TaskState) -> (String, Option<TaskState>) {
        let kind = if matches!(state, TaskState::Completed | TaskState::Failed) {
            Kind::TaskResult
        } else {
            Kind::TaskUpdate
        };
        // Progress and results answer the assignment, as they do in the contract's sample.
        let mut env = Envelope::new("contract", "alice", kind);
        env.to = vec!["bob".into()];
        env.reply_to = Some("msg-6".into());
        env.task = Some(Box::new(TaskInfo {
            id: "task-3".into(),
            state: Some(state),
            ..Default::default()
        }));
        let back = encode(&env)
            .and_then(|msg| super::wire::validate(json!({ "message": msg })).ok())
            .and_then(|msg| decode(msg).task?.state);
        let shown = (preview(&env).into_iter())
            .map(|f| f.label)
            .next()
            .unwrap_or_else(|| "—".into());
        (shown, back)
    }

    fn preview(env: &Envelope) -> Vec<Frame> {
        preview(env)
    }
}

pub fn decode(mut msg: Message) -> Envelope {
    let action = msg.action.as_deref().unwrap_or("");
    let kind = match (msg.msg_type.as_str(), action) {
        ("error", _) => Kind::Error,
        (_, "mission_assigned") => Kind::TaskAssign,
        (_, "task_started" | "progress_update" | "verification_started") => Kind::TaskUpdate,
        (_, "task_complete") => Kind::TaskResult,
        (_, "checkpoint_request") => Kind::DecisionRequest,
        (_, "checkpoint_response") => Kind::DecisionResponse,
        (_, "abort") => Kind::ControlAbort,
        _ => Kind::Chat,
    };
    let mut env = Envelope::with_id(msg.id.clone(), PROTOCOL, &msg.sender.agent, kind);
    env.timestamp = msg.timestamp;
    env.priority = msg.priority;
    env.ttl_secs = msg.ttl;
    env.reply_to = msg.correlation_id.clone();
    if !msg.receiver.is_broadcast() {
        env.to = vec![msg.receiver.agent.clone()];
    }
    let payload = msg.payload();
    let text_field = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| payload.get(k).and_then(Value::as_str))
            .map(str::to_owned)
    };
    let task_id = text_field(&["task_id"]).unwrap_or_default();
    env.data = Some(payload.clone()).filter(|p| !p.is_null());
    match kind {
        Kind::TaskAssign => {
            env.task = Some(Box::new(TaskInfo {
                id: text_field(&["task_id", "block", "mission_id"])
                    .unwrap_or_else(|| msg.id.clone()),
                title: text_field(&["title", "block", "mission"]).or(Some("mission".into())),
                description: text_field(&["description", "objective", "text"])
                    .or_else(|| Some(render(action, payload))),
                assignee: (!msg.receiver.is_broadcast()).then(|| msg.receiver.agent.clone()),
                state: Some(TaskState::Assigned),
                ..Default::default()
            }));
            env.text = env.task.as_ref().and_then(|t| t.description.clone());
        }
        Kind::TaskUpdate => {
            env.task = Some(Box::new(TaskInfo {
                id: task_id,
                state: Some(if action == "verification_started" {
                    TaskState::InReview
                } else {
                    TaskState::Working
                }),
                progress: payload
                    .get("percent")
                    .or(payload.get("progress"))
                    .and_then(Value::as_u64)
                    .map(|p| p.min(100) as u8),
                ..Default::default()
            }));
            env.text = text_field(&["status", "message", "text"])
                .or_else(|| Some(render(action, payload)));
        }
        Kind::TaskResult => {
            let summary = text_field(&["summary", "message", "text"])
                .unwrap_or_else(|| render(action, payload));
            env.task = Some(Box::new(TaskInfo {
                id: task_id,
                state: Some(TaskState::Completed),
                summary: Some(summary.clone()),
                files: payload
                    .get("commits")
                    .and_then(Value::as_array)
                    .map(|c| {
                        c.iter()
                            .filter_map(Value::as_str)
                            .map(str::to_owned)
                            .collect()
                    })
                    .unwrap_or_default(),
                ..Default::default()
            }));
            env.text = Some(summary);
        }
        Kind::Error => {
            let message = text_field(&["error_message", "message", "text"])
                .unwrap_or_else(|| render(action, payload));
            let code = text_field(&["error_code"]).unwrap_or_else(|| "ERROR".into());
            env.text = Some(format!("{code}: {message}"));
            env.task = Some(Box::new(TaskInfo {
                id: task_id,
                state: Some(TaskState::Failed),
                error: Some(format!("{code}: {message}")),
                ..Default::default()
            }));
        }
        Kind::ControlAbort => {
            env.text = text_field(&["reason", "message", "text"]);
            if !task_id.is_empty() {
                env.task = Some(Box::new(TaskInfo {
                    id: task_id,
                    state: Some(TaskState::Cancelled),
                    ..Default::default()
                }));
            }
        }
        _ => {
            env.text = Some(
                text_field(&["text", "message", "question", "decision", "summary"])
                    .unwrap_or_else(|| render(action, payload)),
            );
        }
    }
    env.origin = Origin::new(PROTOCOL, Some(std::mem::take(&mut msg.raw)));
    env
}

/// A payload as one readable line for protocols that only show text.
fn render(action: &str, payload: &Value) -> String {
    match payload {
        Value::Null => action.to_owned(),
        Value::String(s) => s.clone(),
        other if action.is_empty() => other.to_string(),
        other => format!("{action}: {other}"),
    }
}

/// Envelope → the `message:` object a Grid program receives; `None` when the Grid has
/// nothing to show (logs, status changes).
pub fn encode(env: &Envelope) -> Option<Value> {
    if env.origin_is(PROTOCOL)
        && let Some(Value::Object(native)) = env.origin.native()
    {
        let mut native = native.clone();
        if !native.contains_key("correlation_id")
            && let Some(reply_to) = &env.reply_to
        {
            native.insert("correlation_id".into(), json!(reply_to));
        }
        return Some(Value::Object(native));
    }
    let task = env.task.clone().unwrap_or_default();
    let state = task.state;
    let answer = if env.reply_to.is_some() {
        "response"
    } else {
        "notification"
    };
    let mut payload = Map::new();
    let mut put = |k: &str, v: Value| {
        if !v.is_null() {
            payload.insert(k.to_owned(), v);
        }
    };
    let (msg_type, action) = match env.kind {
        Kind::TaskAssign => {
            put("task_id", json!(task.id));
            put("title", json!(task.title));
            put(
                "description",
                json!(task.description.clone().or(env.text.clone())),
            );
            if !task.files.is_empty() {
                put("files", json!(task.files));
            }
            keep_data(&mut payload, env.data.as_ref());
            ("request", "mission_assigned")
        }
        Kind::TaskUpdate => {
            put("task_id", json!(task.id));
            let kind = match state {
                Some(TaskState::Waiting) => {
                    put("question", json!(env.text));
                    ("request", "checkpoint_request")
                }
                Some(TaskState::InReview) => {
                    put("status", json!(env.text));
                    ("notification", "verification_started")
                }
                Some(TaskState::Cancelled) | Some(TaskState::Rejected) => {
                    put("reason", json!(env.text));
                    ("request", "abort")
                }
                _ => {
                    put("percent", json!(task.progress));
                    put(
                        "status",
                        json!(
                            env.text
                                .clone()
                                .or(state.map(|s| format!("{s:?}").to_lowercase()))
                        ),
                    );
                    ("notification", "progress_update")
                }
            };
            keep_data(&mut payload, env.data.as_ref());
            kind
        }
        Kind::TaskResult if state.is_none_or(|s| s == TaskState::Completed) => {
            put("task_id", json!(task.id));
            put("summary", json!(task.summary.clone().or(env.text.clone())));
            if !task.files.is_empty() {
                put("commits", json!(task.files));
            }
            // A result's structured output is the result, not more fields beside the summary.
            if let Some(data) = env.data.clone().filter(|d| !d.is_null()) {
                payload.entry("result").or_insert(data);
            }
            (answer, "task_complete")
        }
        Kind::TaskResult | Kind::Error => {
            let code = env
                .data
                .as_ref()
                .and_then(|d| d.get("error_code"))
                .and_then(Value::as_str)
                .map(str::to_owned)
                .unwrap_or_else(|| match state {
                    Some(TaskState::Rejected) => "TASK_REJECTED".into(),
                    Some(TaskState::Cancelled) => "TASK_CANCELLED".into(),
                    _ if env.kind == Kind::TaskResult => "TASK_FAILED".into(),
                    _ => "ERROR".into(),
                });
            put("error_code", json!(code));
            put(
                "error_message",
                json!(task.error.clone().or(env.text.clone()).unwrap_or_default()),
            );
            if !task.id.is_empty() {
                put("task_id", json!(task.id));
            }
            put(
                "recoverable",
                json!(
                    env.data
                        .as_ref()
                        .and_then(|d| d.get("recoverable"))
                        .cloned()
                        .unwrap_or(json!(false))
                ),
            );
            ("error", "error_report")
        }
        Kind::DecisionRequest => {
            put("question", json!(env.text));
            ("request", "checkpoint_request")
        }
        Kind::DecisionResponse => {
            put("decision", json!(env.text));
            ("response", "checkpoint_response")
        }
        Kind::ControlAbort | Kind::ControlInterrupt => {
            put("reason", json!(env.text));
            if !task.id.is_empty() {
                put("task_id", json!(task.id));
            }
            ("request", "abort")
        }
        Kind::PresenceJoin | Kind::PresenceLeave => {
            put("agent", json!(env.from));
            put(
                "status",
                json!(if env.kind == Kind::PresenceJoin {
                    "online"
                } else {
                    "offline"
                }),
            );
            (
                "notification",
                if env.kind == Kind::PresenceJoin {
                    "agent_online"
                } else {
                    "agent_offline"
                },
            )
        }
        Kind::VoteInitiate | Kind::VoteSubmit | Kind::VoteResult => {
            put("text", json!(env.text));
            (
                "notification",
                match env.kind {
                    Kind::VoteInitiate => "vote_initiate",
                    Kind::VoteSubmit => "vote_submit",
                    _ => "vote_result",
                },
            )
        }
        Kind::Chat | Kind::Custom | Kind::Context => {
            put("text", json!(env.text.clone()?));
            if let Some(Value::Object(data)) = &env.data {
                for (k, v) in data {
                    payload.entry(k.clone()).or_insert(v.clone());
                }
            }
            (
                answer,
                if answer == "response" {
                    "reply"
                } else {
                    "message"
                },
            )
        }
        _ => return None,
    };
    let receiver = match (&env.audience, env.addressees().next()) {
        (Audience::Everyone, _) | (_, None) => Party::broadcast(),
        (_, Some(name)) => Party {
            agent: name.to_owned(),
            instance_id: None,
        },
    };
    let mut msg = Map::new();
    msg.insert("id".into(), json!(env.id));
    msg.insert("timestamp".into(), json!(iso8601(env.timestamp)));
    msg.insert("type".into(), json!(msg_type));
    msg.insert("sender".into(), json!({ "agent": env.from }));
    msg.insert("receiver".into(), receiver.to_json());
    if let Some(parent) = env.reply_to.as_ref().or(env.correlation_id.as_ref()) {
        msg.insert("correlation_id".into(), json!(parent));
    }
    msg.insert(
        "content".into(),
        json!({ "action": action, "payload": Value::Object(payload) }),
    );
    let mut metadata = Map::new();
    metadata.insert(
        "priority".into(),
        json!(match env.priority {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }),
    );
    if let Some(ttl) = env.ttl_secs {
        metadata.insert("ttl".into(), json!(ttl));
    }
    msg.insert("metadata".into(), Value::Object(metadata));
    Some(Value::Object(msg))
}

/// Structured data from another protocol, kept in the payload, as the document asks
/// ("structured data in payload"): an object's keys join it (the keys set from the
/// envelope win), anything else goes under `data`.
fn keep_data(payload: &mut Map<String, Value>, data: Option<&Value>) {
    match data {
        None | Some(Value::Null) => {}
        Some(Value::Object(fields)) => {
            for (key, value) in fields {
                payload.entry(key.clone()).or_insert(value.clone());
            }
        }
        Some(other) => {
            payload.entry("data").or_insert(other.clone());
        }
    }
}

/// What a Grid program is shown for `env`, for the translation contract.
pub fn preview(env: &Envelope) -> Vec<Frame> {
    let Some(msg) = encode(env) else {
        return Vec::new();
    };
    let label = format!(
        "`{}` / `{}`",
        msg["type"].as_str().unwrap_or_default(),
        msg["content"]["action"].as_str().unwrap_or_default()
    );
    vec![Frame { label, body: msg }]
}

/// Whether every Grid program is shown `env`: a broadcast that is neither presence nor an
/// execution log.
pub fn for_every_program(env: &Envelope) -> bool {
    !env.kind.is_presence() && env.kind != Kind::Log && is_broadcast(env)
}

/// Whether a Grid message is for every Grid program.
pub fn is_broadcast(env: &Envelope) -> bool {
    env.audience == Audience::Everyone
        || (env.origin_is(PROTOCOL)
            && env
                .origin
                .native()
                .and_then(|n| n.get("receiver"))
                .and_then(|r| r.get("agent"))
                .and_then(Value::as_str)
                .is_none_or(|r| r == BROADCAST))
}

/// The instance a Grid message is for, when it names one.
pub fn target_instance(env: &Envelope) -> Option<&str> {
    if !env.origin_is(PROTOCOL) {
        return None;
    }
    env.origin
        .native()?
        .get("receiver")?
        .get("instance_id")?
        .as_str()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::grid::wire::validate;

    /// A message from YAML, stamped with a timestamp (required) when it has none.
    fn message(yaml: &str) -> Message {
        let mut doc: Value = serde_saphyr::from_str(yaml).unwrap();
        if let Some(Value::Object(msg)) = doc.get_mut("message") {
            msg.entry("timestamp")
                .or_insert(json!("2026-01-24T10:00:00Z"));
        }
        validate(doc).unwrap()
    }

    #[test]
    fn a_mission_is_a_task_and_progress_and_completion_follow() {
        let env = decode(message(
            "message: { id: msg-m1, type: request, sender: { agent: mc }, receiver: { agent: alice }, content: { action: mission_assigned, payload: { block: block-01, description: build the API } } }",
        ));
        assert_eq!(env.kind, Kind::TaskAssign);
        let task = env.task.clone().unwrap();
        assert_eq!(
            (
                task.id.as_str(),
                task.title.as_deref(),
                task.description.as_deref()
            ),
            ("block-01", Some("block-01"), Some("build the API"))
        );
        assert_eq!(task.assignee.as_deref(), Some("alice"));

        let progress = decode(message(
            "message: { type: notification, correlation_id: msg-m1, sender: { agent: executor }, receiver: { agent: mc }, content: { action: progress_update, payload: { thread: 2, percent: 60, status: Writing POST handler } } }",
        ));
        let task = progress.task.unwrap();
        assert_eq!(
            (progress.kind, task.progress, task.state),
            (Kind::TaskUpdate, Some(60), Some(TaskState::Working))
        );
        assert_eq!(progress.text.as_deref(), Some("Writing POST handler"));
        assert_eq!(progress.reply_to.as_deref(), Some("msg-m1"));

        let done = decode(message(
            "message: { type: notification, sender: { agent: executor }, receiver: { agent: mc }, content: { action: task_complete, payload: { block: block-01, commits: [abc1234] } } }",
        ));
        assert_eq!(
            (done.kind, done.task.unwrap().files),
            (Kind::TaskResult, vec!["abc1234".to_string()])
        );
    }

    #[test]
    fn foreign_results_answer_as_grid_responses_and_errors() {
        let mut env = Envelope::new("skynet", "alice", Kind::TaskResult);
        env.reply_to = Some("msg-m1".into());
        env.to = vec!["mc".into()];
        env.task = Some(Box::new(TaskInfo {
            id: "block-01".into(),
            state: Some(TaskState::Completed),
            summary: Some("done".into()),
            ..Default::default()
        }));
        let msg = encode(&env).unwrap();
        assert_eq!(msg["type"], "response");
        assert_eq!(msg["correlation_id"], "msg-m1");
        assert_eq!(msg["content"]["action"], "task_complete");
        assert_eq!(msg["content"]["payload"]["summary"], "done");
        assert_eq!(msg["receiver"]["agent"], "mc");

        env.task.as_mut().unwrap().state = Some(TaskState::Failed);
        env.task.as_mut().unwrap().error = Some("tests fail".into());
        let msg = encode(&env).unwrap();
        assert_eq!(
            (msg["type"].as_str(), msg["content"]["action"].as_str()),
            (Some("error"), Some("error_report"))
        );
        assert_eq!(msg["content"]["payload"]["error_code"], "TASK_FAILED");
        assert_eq!(msg["content"]["payload"]["error_message"], "tests fail");
    }

    #[test]
    fn chat_checkpoints_and_broadcasts() {
        let chat = decode(message(
            "message: { type: request, sender: { agent: executor }, receiver: { agent: mc }, content: { action: request_context, payload: { context_type: warmth } } }",
        ));
        assert_eq!(chat.kind, Kind::Chat);
        assert_eq!(
            chat.text.as_deref(),
            Some(r#"request_context: {"context_type":"warmth"}"#)
        );
        let checkpoint = decode(message(
            "message: { type: request, sender: { agent: executor }, content: { action: checkpoint_request, payload: { question: Ship it? } } }",
        ));
        assert_eq!(
            (checkpoint.kind, checkpoint.text.as_deref()),
            (Kind::DecisionRequest, Some("Ship it?"))
        );
        assert!(checkpoint.to.is_empty() && is_broadcast(&checkpoint));

        let mut all = Envelope::new("skynet", "alice", Kind::Chat);
        all.audience = Audience::Everyone;
        all.text = Some("standup".into());
        let msg = encode(&all).unwrap();
        assert_eq!(
            (msg["type"].as_str(), msg["receiver"]["agent"].as_str()),
            (Some("notification"), Some("broadcast"))
        );
        assert_eq!(msg["content"]["payload"]["text"], "standup");
    }

    #[test]
    fn structured_data_is_kept_in_the_payload() {
        let mut assign = Envelope::new("synapse", "planner", Kind::TaskAssign);
        assign.task = Some(Box::new(TaskInfo {
            id: "t-1".into(),
            ..Default::default()
        }));
        assign.data = Some(json!({ "repo": "agentbridge", "task_id": "other" }));
        let payload = &encode(&assign).unwrap()["content"]["payload"];
        assert_eq!(
            (payload["repo"].as_str(), payload["task_id"].as_str()),
            (Some("agentbridge"), Some("t-1"))
        );

        let mut update = Envelope::new("synapse", "worker", Kind::TaskUpdate);
        update.task = Some(Box::new(TaskInfo {
            id: "t-1".into(),
            state: Some(TaskState::Working),
            ..Default::default()
        }));
        update.data = Some(json!([1, 2]));
        assert_eq!(
            encode(&update).unwrap()["content"]["payload"]["data"],
            json!([1, 2])
        );

        let mut result = Envelope::new("synapse", "worker", Kind::TaskResult);
        result.task = Some(Box::new(TaskInfo {
            id: "t-1".into(),
            state: Some(TaskState::Completed),
            summary: Some("indexed".into()),
            ..Default::default()
        }));
        result.data = Some(json!({ "files": 120 }));
        let payload = &encode(&result).unwrap()["content"]["payload"];
        assert_eq!(payload["result"], json!({ "files": 120 }));
        assert_eq!(payload["summary"], "indexed");
    }

    #[test]
    fn ttl_notices_are_grid_errors_answering_the_message() {
        let mut notice = Envelope::new("bridge", "agentbridge", Kind::Error);
        notice.reply_to = Some("msg-1".into());
        notice.to = vec!["executor".into()];
        notice.text = Some("not delivered".into());
        notice.data = Some(json!({ "error_code": "TTL_EXPIRED", "recoverable": true }));
        let msg = encode(&notice).unwrap();
        assert_eq!(msg["type"], "error");
        assert_eq!(msg["correlation_id"], "msg-1");
        assert_eq!(msg["content"]["payload"]["error_code"], "TTL_EXPIRED");
    }
}
