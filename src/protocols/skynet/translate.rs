//! SkynetMessage ⇄ Envelope. Pure functions: the only state they consult is how card ids
//! and agent names correspond, through `Peers`.

use serde_json::{Map, Value, json};

use super::PROTOCOL;
use super::sent::SentMessage;
use super::wire;
use crate::core::{
    Attachment, Audience, Envelope, Kind, Origin, Status, TaskInfo, TaskState, new_message_id,
    now_ms,
};
use crate::protocols::endpoint::{Decoded, PreviewFrame as Frame, Translation};
use crate::shared::each_once::push_once;

/// How Skynet card ids and bridge agent names correspond.
pub trait Peers {
    /// The card id Skynet shows for agent `name`.
    fn card_id(&self, name: &str) -> String;
    /// The agent name behind a card id.
    fn name_of(&self, card_id: &str) -> Option<String>;
    /// The AgentCard Skynet shows for agent `name`.
    fn card(&self, name: &str) -> Option<Value>;
}

/// Skynet's side of the translation contract.
pub struct Translator;

/// A `send` as the server has normalised it (`stamp`, mentions enriched), with its
/// sender's agent name.
pub struct Sent<'a> {
    pub message: SentMessage<'a>,
    pub sender: &'a str,
}

impl Translation for Translator {
    type Inbound<'a> = Sent<'a>;
    type Outbound = Value;
    /// A `send` that reached decoding is always a message (its shape was checked when it
    /// was read); the ids it names that no agent holds are told back as `unresolved`.
    type Refusal = std::convert::Infallible;
    type Context = dyn Peers + Send + Sync;

    fn decode(peers: &Self::Context, sent: Sent<'_>) -> Result<Decoded, Self::Refusal> {
        let (envelope, unresolved) = decode(sent.message, sent.sender, peers);
        Ok(Decoded {
            envelope,
            unresolved,
        })
    }

    fn encode(peers: &Self::Context, env: &Envelope) -> Option<Value> {
        encode(env, peers)
    }

    fn task_state(state: TaskState) -> (String, Option<TaskState>) {
        let status = task_state_to_skynet(state);
        (format!("`{status}`"), task_state_from_skynet(status))
    }

    fn preview(env: &Envelope) -> Vec<Frame> {
        preview(env)
    }
}

/// Canonical task state → Skynet `TaskStatus`, and back. One table, both directions.
const TASK_STATES: &[(TaskState, &str)] = &[
    (TaskState::Submitted, "pending"),
    (TaskState::Assigned, "assigned"),
    (TaskState::Working, "in-progress"),
    (TaskState::Completed, "completed"),
    (TaskState::Failed, "failed"),
    // Skynet has no words for these; the nearest is shown, and read back as the above.
    (TaskState::Waiting, "in-progress"),
    (TaskState::InReview, "in-progress"),
    (TaskState::Cancelled, "failed"),
    (TaskState::Rejected, "failed"),
];

pub fn task_state_to_skynet(state: TaskState) -> &'static str {
    TASK_STATES
        .iter()
        .find(|(s, _)| *s == state)
        .map(|(_, n)| *n)
        .unwrap_or("pending")
}

pub fn task_state_from_skynet(status: &str) -> Option<TaskState> {
    TASK_STATES
        .iter()
        .find(|(_, n)| *n == status)
        .map(|(s, _)| *s)
}

/// A sent SkynetMessage the server has normalised (`stamp`, mentions enriched) →
/// Envelope, and the mentioned card ids no agent holds (`@all` aside), which the sender is
/// told of — but for those no Skynet client should be told of (below). `sender` is the sender's agent name; the message, as text, becomes
/// `origin.native`.
pub fn decode(
    msg: SentMessage<'_>,
    sender: &str,
    peers: &(impl Peers + ?Sized),
) -> (Envelope, Vec<String>) {
    let native = msg.to_json();
    let SentMessage {
        msg_type,
        id,
        timestamp,
        reply_to,
        mentions,
        mut payload,
        ..
    } = msg;
    // `stamp` gave the message its id; one not stamped gets one here.
    let id = id.unwrap_or_else(new_message_id);
    let mut env = Envelope::received(
        id,
        sender,
        kind_of(&msg_type),
        timestamp.unwrap_or_else(now_ms),
        Origin::from_native_json(PROTOCOL, native),
    );
    env.reply_to = reply_to;
    env.echo = true;
    // Each id looked up once: the directory's lookup takes a shard's lock.
    let mut unknown = Vec::new();
    let mut named = foldhash::HashSet::default();
    // Skynet's agent runner has no listener for the `error` event its SDK raises, and
    // falls over on one; it mentions, without fault, the humans it was told watch it in its
    // execution logs (one may be gone), and the scheduler when it answers a scheduled task.
    let told_of_unknown = env.kind != Kind::Log;
    for id in mentions {
        if id == wire::MENTION_ALL {
            env.audience = Audience::Everyone;
        } else if let Some(name) = peers.name_of(&id) {
            push_once(&mut env.mentions, &mut named, name);
        } else if told_of_unknown && id != wire::SCHEDULER {
            unknown.push(id);
        }
    }

    match env.kind {
        Kind::Chat => {
            // Taken out of the payload, which goes no further: not copied.
            env.text = match payload.get_mut("text").map(Value::take) {
                Some(Value::String(text)) => Some(text),
                _ => None,
            };
            env.attachments = payload
                .get("attachments")
                .and_then(Value::as_array)
                .map(|list| list.iter().filter_map(attachment_from).collect())
                .unwrap_or_default();
        }
        Kind::TaskAssign | Kind::TaskUpdate => {
            env.task = Some(Box::new(TaskInfo {
                id: str_of(&payload, "taskId"),
                title: opt_str(&payload, "title"),
                description: opt_str(&payload, "description"),
                state: payload
                    .get("status")
                    .and_then(Value::as_str)
                    .and_then(task_state_from_skynet),
                assignee: payload
                    .get("assignee")
                    .and_then(Value::as_str)
                    .map(|id| peers.name_of(id).unwrap_or_else(|| id.to_owned())),
                files: str_list(&payload, "files"),
                ..Default::default()
            }));
            env.data = payload.get("metadata").cloned();
        }
        Kind::TaskResult => {
            let success = payload
                .get("success")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            env.task = Some(Box::new(TaskInfo {
                id: str_of(&payload, "taskId"),
                state: Some(if success {
                    TaskState::Completed
                } else {
                    TaskState::Failed
                }),
                summary: opt_str(&payload, "summary"),
                error: opt_str(&payload, "error"),
                files: str_list(&payload, "filesChanged"),
                ..Default::default()
            }));
            env.text = opt_str(&payload, "summary");
        }
        Kind::Log => {
            env.text = opt_str(&payload, "summary");
            env.data = Some(payload);
        }
        _ => {
            env.text = payload
                .get("text")
                .and_then(Value::as_str)
                .map(str::to_owned);
            if !payload.is_null() {
                env.data = Some(payload);
            }
        }
    }
    (env, unknown)
}

/// Envelope → the frame a Skynet client receives: a bare SkynetMessage, or for a status
/// change a `status-change` event. `None` when Skynet has nothing to show for it.
pub fn encode(env: &Envelope, peers: &(impl Peers + ?Sized)) -> Option<Value> {
    if env.origin_is(PROTOCOL)
        && let Some(native) = env.origin.native()
    {
        return Some(native.clone());
    }
    let from = peers.card_id(&env.from);
    if env.kind == Kind::PresenceStatus {
        let status = env
            .data
            .as_ref()
            .and_then(|d| d.get("status"))
            .and_then(Value::as_str)
            .and_then(Status::parse)
            .map_or("idle", super::registry::status_to_skynet);
        return Some(wire::event_value(
            wire::EVENT_STATUS_CHANGE,
            json!({ "agentId": from, "status": status }),
        ));
    }
    let (msg_type, payload) = match env.kind {
        Kind::TaskAssign | Kind::TaskUpdate => {
            let task = env.task.clone().unwrap_or_default();
            let mut p = Map::new();
            p.insert("taskId".into(), json!(task.id));
            p.insert("title".into(), json!(task.title.unwrap_or_default()));
            p.insert(
                "description".into(),
                json!(task.description.or(env.text.clone()).unwrap_or_default()),
            );
            if let Some(assignee) = &task.assignee {
                p.insert("assignee".into(), json!(peers.card_id(assignee)));
            }
            p.insert(
                "status".into(),
                json!(task_state_to_skynet(task.state.unwrap_or(
                    if env.kind == Kind::TaskAssign {
                        TaskState::Assigned
                    } else {
                        TaskState::Working
                    }
                ))),
            );
            if !task.files.is_empty() {
                p.insert("files".into(), json!(task.files));
            }
            let mut metadata = match &env.data {
                Some(Value::Object(m)) => m.clone(),
                Some(other) => Map::from_iter([("data".to_owned(), other.clone())]),
                None => Map::new(),
            };
            if let Some(progress) = task.progress {
                metadata.insert("progress".into(), json!(progress));
            }
            if env.kind == Kind::TaskUpdate
                && let Some(text) = &env.text
            {
                metadata.entry("message").or_insert(json!(text));
            }
            if !metadata.is_empty() {
                p.insert("metadata".into(), Value::Object(metadata));
            }
            let t = if env.kind == Kind::TaskAssign {
                "task.assign"
            } else {
                "task.update"
            };
            (t, Value::Object(p))
        }
        Kind::TaskResult => {
            let task = env.task.clone().unwrap_or_default();
            let success = task.state == Some(TaskState::Completed);
            let mut p = Map::new();
            p.insert("taskId".into(), json!(task.id));
            p.insert("success".into(), json!(success));
            p.insert(
                "summary".into(),
                json!(task.summary.or(env.text.clone()).unwrap_or_default()),
            );
            if !task.files.is_empty() {
                p.insert("filesChanged".into(), json!(task.files));
            }
            if let Some(error) = task.error.or((!success).then(|| "failed".to_owned())) {
                p.insert("error".into(), json!(error));
            }
            ("task.result", Value::Object(p))
        }
        Kind::PresenceJoin => (
            "agent.join",
            json!({ "agent": peers.card(&env.from).unwrap_or_else(|| json!({ "id": from, "name": env.from })) }),
        ),
        Kind::PresenceLeave => ("agent.leave", json!({ "agentId": from })),
        Kind::Log => {
            let mut p = match &env.data {
                Some(Value::Object(m)) => m.clone(),
                _ => Map::new(),
            };
            p.entry("event").or_insert(json!("custom"));
            p.entry("summary")
                .or_insert(json!(env.text.clone().unwrap_or_default()));
            p.entry("level").or_insert(json!("info"));
            ("execution.log", Value::Object(p))
        }
        Kind::Context => {
            let payload = match &env.data {
                Some(Value::Object(m)) => Value::Object(m.clone()),
                Some(other) => json!({ "metadata": { "data": other } }),
                None => json!({ "metadata": { "text": env.text } }),
            };
            ("context.share", payload)
        }
        Kind::ControlInterrupt
        | Kind::ControlForget
        | Kind::ControlWatch
        | Kind::ControlUnwatch
        | Kind::ControlAbort => {
            let target = env
                .addressees()
                .next()
                .map(|n| peers.card_id(n))
                .unwrap_or_default();
            let mut p = Map::new();
            p.insert("agentId".into(), json!(target));
            if let Some(reason) = &env.text {
                p.insert("reason".into(), json!(reason));
            }
            let t = match env.kind {
                Kind::ControlForget => "agent.forget",
                Kind::ControlWatch => "agent.watch",
                Kind::ControlUnwatch => "agent.unwatch",
                _ => "agent.interrupt",
            };
            (t, Value::Object(p))
        }
        _ => {
            let text = env
                .text
                .clone()
                .or_else(|| env.data.as_ref().map(Value::to_string))?;
            let mut p = Map::new();
            p.insert("text".into(), json!(text));
            if !env.attachments.is_empty() {
                p.insert(
                    "attachments".into(),
                    Value::Array(env.attachments.iter().map(attachment_to).collect()),
                );
            }
            ("chat", Value::Object(p))
        }
    };

    let mut msg = Map::new();
    msg.insert("id".into(), json!(env.id));
    msg.insert("type".into(), json!(msg_type));
    msg.insert("from".into(), json!(from));
    msg.insert("timestamp".into(), json!(env.timestamp));
    msg.insert("payload".into(), payload);
    if let Some(reply_to) = &env.reply_to {
        msg.insert("replyTo".into(), json!(reply_to));
    }
    let mut mentions: Vec<String> = env.addressees().map(|n| peers.card_id(n)).collect();
    if env.audience == Audience::Everyone && !env.kind.is_presence() {
        mentions.push(wire::MENTION_ALL.to_owned());
    }
    if !mentions.is_empty() {
        msg.insert("mentions".into(), json!(mentions));
    }
    Some(Value::Object(msg))
}

/// What a Skynet client is shown for `env`, for the translation contract.
pub fn preview(env: &Envelope) -> Vec<Frame> {
    struct Names;
    impl Peers for Names {
        fn card_id(&self, name: &str) -> String {
            name.to_owned()
        }
        fn name_of(&self, _: &str) -> Option<String> {
            None
        }
        fn card(&self, _: &str) -> Option<Value> {
            None
        }
    }
    let Some(frame) = encode(env, &Names) else {
        return Vec::new();
    };
    let label = match (frame.get("event"), frame.get("type")) {
        (Some(event), _) => format!("`{}` event", event.as_str().unwrap_or_default()),
        (_, Some(t)) => format!("`{}`", t.as_str().unwrap_or_default()),
        _ => String::new(),
    };
    vec![Frame { label, body: frame }]
}

fn kind_of(msg_type: &str) -> Kind {
    match msg_type {
        "chat" => Kind::Chat,
        "task.assign" => Kind::TaskAssign,
        "task.update" => Kind::TaskUpdate,
        "task.result" => Kind::TaskResult,
        "context.share" | "file.change" => Kind::Context,
        "agent.interrupt" => Kind::ControlInterrupt,
        "agent.forget" => Kind::ControlForget,
        "agent.watch" => Kind::ControlWatch,
        "agent.unwatch" => Kind::ControlUnwatch,
        "execution.log" => Kind::Log,
        "agent.join" => Kind::PresenceJoin,
        "agent.leave" => Kind::PresenceLeave,
        _ => Kind::Custom,
    }
}

fn attachment_from(v: &Value) -> Option<Attachment> {
    Some(Attachment {
        name: v.get("name")?.as_str()?.to_owned(),
        mime_type: v
            .get("mimeType")
            .and_then(Value::as_str)
            .unwrap_or("application/octet-stream")
            .to_owned(),
        size: v.get("size").and_then(Value::as_u64).unwrap_or(0),
        data: v.get("data")?.as_str()?.to_owned(),
    })
}

fn attachment_to(a: &Attachment) -> Value {
    let kind = if a.mime_type.starts_with("image/") {
        "image"
    } else {
        "file"
    };
    json!({ "type": kind, "mimeType": a.mime_type, "name": a.name, "data": a.data, "size": a.size })
}

fn opt_str(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_owned)
}

fn str_of(v: &Value, key: &str) -> String {
    opt_str(v, key).unwrap_or_default()
}

fn str_list(v: &Value, key: &str) -> Vec<String> {
    v.get(key)
        .and_then(Value::as_array)
        .map(|l| {
            l.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Table(HashMap<&'static str, &'static str>);
    impl Peers for Table {
        fn card_id(&self, name: &str) -> String {
            self.0
                .iter()
                .find(|(_, n)| **n == name)
                .map(|(id, _)| id.to_string())
                .unwrap_or_else(|| format!("derived-{name}"))
        }
        fn name_of(&self, card_id: &str) -> Option<String> {
            self.0.get(card_id).map(|n| n.to_string())
        }
        fn card(&self, name: &str) -> Option<Value> {
            Some(json!({ "id": self.card_id(name), "name": name, "type": "generic" }))
        }
    }

    fn peers() -> Table {
        Table(HashMap::from([("id-a", "alice"), ("id-b", "bob")]))
    }

    #[test]
    fn chat_maps_mentions_to_names_and_all_to_everyone() {
        let frame = r#"{"action":"send","data":{"id":"m1","type":"chat","from":"id-a","timestamp":1000,"payload":{"text":"hi @bob"},"mentions":["id-b","unknown","__all__"],"replyTo":"m0"}}"#;
        let Ok(wire::ClientFrame::Send(mut msg)) = wire::parse_client_frame(frame) else {
            panic!("a send");
        };
        msg.stamp("id-a");
        let (env, unknown) = decode(msg, "alice", &peers());
        assert_eq!(unknown, ["unknown"]);
        assert_eq!(env.id, "m1");
        assert_eq!(env.kind, Kind::Chat);
        assert_eq!(env.mentions, ["bob"]);
        assert_eq!(env.audience, Audience::Everyone);
        assert_eq!(env.reply_to.as_deref(), Some("m0"));
        assert_eq!(env.text.as_deref(), Some("hi @bob"));
        assert_eq!(env.timestamp, 1000);
        // Skynet peers get the message back as it was sent.
        let data = &frame[frame.find(r#"{"id""#).unwrap()..frame.len() - 1];
        assert_eq!(env.origin.native_json(), Some(data));
        let value: Value = serde_json::from_str(data).unwrap();
        assert_eq!(encode(&env, &peers()), Some(value));
    }

    #[test]
    fn task_states_map_both_ways() {
        for (state, name) in TASK_STATES.iter().take(5) {
            assert_eq!(task_state_from_skynet(name), Some(*state));
            assert_eq!(task_state_to_skynet(*state), *name);
        }
        assert_eq!(task_state_to_skynet(TaskState::Cancelled), "failed");
    }

    #[test]
    fn foreign_task_result_becomes_task_result() {
        let mut env = Envelope::new("tracker", "coder", Kind::TaskResult);
        env.task = Some(Box::new(TaskInfo {
            id: "t1".into(),
            state: Some(TaskState::Completed),
            summary: Some("done".into()),
            ..Default::default()
        }));
        env.to = vec!["alice".into()];
        env.reply_to = Some("m1".into());
        let frame = encode(&env, &peers()).unwrap();
        assert_eq!(frame["type"], "task.result");
        assert_eq!(frame["from"], "derived-coder");
        assert_eq!(frame["payload"]["taskId"], "t1");
        assert_eq!(frame["payload"]["success"], true);
        assert_eq!(frame["payload"]["summary"], "done");
        assert_eq!(frame["mentions"], json!(["id-a"]));
        assert_eq!(frame["replyTo"], "m1");
    }

    #[test]
    fn foreign_status_becomes_a_status_change_event() {
        let mut env = Envelope::new("tracker", "coder", Kind::PresenceStatus);
        env.data = Some(json!({ "status": "busy" }));
        let frame = encode(&env, &peers()).unwrap();
        assert_eq!(
            frame,
            json!({ "event": "status-change", "data": { "agentId": "derived-coder", "status": "busy" } })
        );
    }

    #[test]
    fn control_messages_name_their_target() {
        let mut env = Envelope::new("grid", "mc", Kind::ControlAbort);
        env.to = vec!["bob".into()];
        env.text = Some("stop".into());
        let frame = encode(&env, &peers()).unwrap();
        assert_eq!(frame["type"], "agent.interrupt");
        assert_eq!(
            frame["payload"],
            json!({ "agentId": "id-b", "reason": "stop" })
        );
    }
}
