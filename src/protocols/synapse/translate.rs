//! SynapseMessage ⇄ Envelope. Pure functions over what `Context` says about agents.
//!
//! | Synapse `MessageType` | Envelope kind |
//! |---|---|
//! | `UNSPECIFIED` (text or JSON payload) | chat |
//! | `P2P_TASK_REQUEST`, `GROUP_TASK_SPLIT` | task assign |
//! | `P2P_STATUS_UPDATE`, `P2P_INFO_MISSING` (waiting) | task update |
//! | `P2P_TASK_COMPLETE`, `P2P_TASK_FAILED`, `GROUP_SUBTASK_RESULT`, `GROUP_RESULT_MERGE` | task result |
//! | `P2P_ACK` | custom (not shown to other protocols) |
//! | `P2P_NACK` | error |
//! | `GROUP_INVITE`, `GROUP_JOIN`, `GROUP_LEAVE` | custom, with a text describing it |
//! | `GROUP_VOTE_INITIATE` / `SUBMIT` / `RESULT` | vote initiate / submit / result |
//! | `HIL_DECISION_REQUEST` / `RESPONSE` | decision request / response |
//! | `HEARTBEAT` | presence status |

use serde_json::Value;

use super::PROTOCOL;
use super::proto::{
    AgentEndpoint, MessageType, SynapseMessage, TaskPayload, TaskResult, TaskStatusUpdate,
};
use super::wire::{self, Payload};
use crate::core::{Audience, Envelope, Kind, Origin, TaskInfo, TaskState, new_message_id, now_ms};
use crate::protocols::endpoint::{Decoded, PreviewFrame as Frame, Translation};

/// What translation needs to know about agents.
pub trait Context {
    /// How Synapse shows agent `name` (of any protocol).
    fn endpoint_of(&self, name: &str) -> AgentEndpoint;
}

pub const PROTOCOL_VERSION: &str = "1.0";

/// Synapse's side of the translation contract.
pub struct Translator;

impl Translation for Translator {
    type Inbound<'a> = &'a SynapseMessage;
    type Outbound = SynapseMessage;
    /// Why a message cannot be relayed as it came (its sender hears it as
    /// INVALID_ARGUMENT, or a `P2P_NACK` on a stream).
    type Refusal = String;
    type Context = dyn Context + Send + Sync;

    fn decode(_: &Self::Context, msg: &SynapseMessage) -> Result<Decoded, String> {
        decode(msg).map(Decoded::from)
    }

    fn encode(ctx: &Self::Context, env: &Envelope) -> Option<SynapseMessage> {
        encode(env, ctx)
    }

    fn task_state(state: TaskState) -> (String, Option<TaskState>) {
        let status = wire::status_for(state);
        (
            format!("`{}`", status.as_str_name()),
            wire::state_of(status as i32),
        )
    }

    fn preview(env: &Envelope) -> Vec<Frame> {
        preview(env)
    }
}

/// The key of a Synapse frame kept in an envelope (`Origin`): the message's protobuf
/// encoding, in base64. A peer of the sender's own protocol is sent the message as it
/// came, decoded from it; its proto3 JSON is written only where a client reads JSON (a
/// callback, the gateway). Why not the JSON itself: writing it through the descriptor
/// pool was 54,000 of a relayed message's 127,000 instructions in the bridge (callgrind,
/// synapse→skynet), and reading it back for a Synapse peer as much again.
const PROTOBUF: &str = "protobuf";

/// The frame `msg` as an envelope keeps it.
fn native_of(msg: &SynapseMessage) -> String {
    use base64::Engine;
    let bytes = prost::Message::encode_to_vec(msg);
    let encoded = base64::engine::general_purpose::STANDARD.encode(bytes);
    format!(r#"{{"{PROTOBUF}":"{encoded}"}}"#)
}

/// The message an envelope keeps as `native_of` wrote it, or (kept before) as its proto3
/// JSON.
fn from_native(native: &Value) -> Option<SynapseMessage> {
    use base64::Engine;
    match native.get(PROTOBUF).and_then(Value::as_str) {
        Some(encoded) => {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .ok()?;
            prost::Message::decode(bytes.as_slice()).ok()
        }
        None => wire::from_json::<SynapseMessage>(native, "synapse.SynapseMessage").ok(),
    }
}

/// A SynapseMessage as it arrived → Envelope; an error when the message cannot be relayed
/// as it came (its payload's proto3 JSON, which callbacks and the gateway write, cannot
/// be written).
pub fn decode(msg: &SynapseMessage) -> Result<Envelope, String> {
    let payload = wire::unpack(msg.payload.as_ref());
    // Text `unpack` decoded is written as it is; any other payload is checked.
    if let Some(any) = msg
        .payload
        .as_ref()
        .filter(|_| !matches!(payload, Payload::Text(_)))
    {
        crate::protocols::synapse::json::check_any(any).map_err(|e| format!("payload: {e}"))?;
    }
    let native = native_of(msg);
    let msg_type = wire::message_type(msg);
    let sender = msg
        .sender
        .as_ref()
        .map(|s| s.agent_id.clone())
        .unwrap_or_default();
    let id = non_empty(&msg.id).unwrap_or_else(new_message_id);
    let mut env = Envelope::with_id(id, PROTOCOL, sender, kind_of(msg_type));
    if let Some(ts) = &msg.timestamp {
        env.timestamp = wire::millis(ts);
    }
    env.reply_to = non_empty(&msg.reply_to);
    env.correlation_id = non_empty(&msg.correlation_id);
    let receiver = msg
        .receiver
        .as_ref()
        .map(|r| r.agent_id.clone())
        .filter(|r| !r.is_empty());
    if !msg.group_id.is_empty() {
        env.audience = Audience::Group(msg.group_id.clone());
    }
    if let Some(receiver) = &receiver {
        env.to = vec![receiver.clone()];
    }
    env.text = payload.text();
    env.data = match &payload {
        Payload::Json(_) | Payload::Opaque { .. } => payload.json(),
        _ => None,
    };

    match (&payload, env.kind) {
        (Payload::Task(task), _) => {
            env.task = Some(Box::new(TaskInfo {
                id: first_non_empty(&task.task_id, &env.id),
                title: non_empty(&task.task_type),
                description: wire::unpack(task.payload.as_ref()).text(),
                assignee: receiver.clone(),
                state: Some(TaskState::Assigned),
                external_id: non_empty(&task.external_task_id),
                ..Default::default()
            }));
            env.data = wire::unpack(task.payload.as_ref())
                .json()
                .filter(|v| v.is_object());
        }
        (Payload::Result(result), _) => {
            let failed = msg_type == MessageType::P2pTaskFailed;
            env.task = Some(Box::new(TaskInfo {
                id: result.task_id.clone(),
                title: non_empty(&result.task_type),
                state: Some(if failed {
                    TaskState::Failed
                } else {
                    TaskState::Completed
                }),
                summary: non_empty(&result.summary),
                error: failed
                    .then(|| result.summary.clone())
                    .filter(|s| !s.is_empty()),
                ..Default::default()
            }));
            env.text = non_empty(&result.summary);
            env.data = wire::unpack(result.result.as_ref()).json();
        }
        (Payload::Status(status), _) => {
            let state = if msg_type == MessageType::P2pInfoMissing {
                Some(TaskState::Waiting)
            } else {
                wire::state_of(status.status).or(Some(TaskState::Working))
            };
            let failed = state == Some(TaskState::Failed);
            env.task = Some(Box::new(TaskInfo {
                id: status.task_id.clone(),
                state,
                progress: (status.progress > 0).then(|| status.progress.clamp(0, 100) as u8),
                error: failed
                    .then(|| status.message.clone())
                    .filter(|s| !s.is_empty()),
                ..Default::default()
            }));
            env.text = non_empty(&status.message);
        }
        (_, Kind::TaskAssign) => {
            env.task = Some(Box::new(TaskInfo {
                id: env.id.clone(),
                description: env.text.clone(),
                assignee: receiver.clone(),
                state: Some(TaskState::Assigned),
                ..Default::default()
            }));
        }
        (_, Kind::TaskResult) => {
            let failed = msg_type == MessageType::P2pTaskFailed;
            env.task = Some(Box::new(TaskInfo {
                state: Some(if failed {
                    TaskState::Failed
                } else {
                    TaskState::Completed
                }),
                summary: env.text.clone(),
                error: failed.then(|| env.text.clone().unwrap_or_else(|| "failed".into())),
                ..Default::default()
            }));
        }
        (_, Kind::TaskUpdate) => {
            env.task = Some(Box::new(TaskInfo {
                state: Some(if msg_type == MessageType::P2pInfoMissing {
                    TaskState::Waiting
                } else {
                    TaskState::Working
                }),
                ..Default::default()
            }));
        }
        _ => {}
    }
    if env.text.is_none() {
        env.text = housekeeping_text(msg_type, msg);
    }
    env.origin = Origin::from_native_json(PROTOCOL, native);
    Ok(env)
}

/// Envelope → the SynapseMessage a Synapse agent receives; `None` when Synapse has nothing
/// to show for it (presence, logs).
pub fn encode(env: &Envelope, ctx: &(impl Context + ?Sized)) -> Option<SynapseMessage> {
    if env.origin_is(PROTOCOL)
        && let Some(native) = env.origin.native()
        && let Some(mut msg) = from_native(native)
    {
        // The sender's own message, with the conversation links the bridge filled in.
        if msg.correlation_id.is_empty() {
            msg.correlation_id = env.correlation_id.clone().unwrap_or_default();
        }
        if msg.reply_to.is_empty() {
            msg.reply_to = env.reply_to.clone().unwrap_or_default();
        }
        return Some(msg);
    }
    let task = env.task.clone().unwrap_or_default();
    let state = task.state;
    let (msg_type, payload) = match env.kind {
        Kind::TaskAssign => (
            if matches!(env.audience, Audience::Group(_)) {
                MessageType::GroupTaskSplit
            } else {
                MessageType::P2pTaskRequest
            },
            wire::pack(
                wire::TASK_PAYLOAD,
                &TaskPayload {
                    task_id: task.id.clone(),
                    task_type: task.title.clone().unwrap_or_default(),
                    payload: Some(match &env.data {
                        Some(data) if data.is_object() => wire::json(data),
                        _ => wire::text(
                            &task
                                .description
                                .clone()
                                .or(env.text.clone())
                                .unwrap_or_default(),
                        ),
                    }),
                    external_task_id: task.external_id.clone().unwrap_or_default(),
                },
            ),
        ),
        Kind::TaskUpdate => (
            if state == Some(TaskState::Waiting) {
                MessageType::P2pInfoMissing
            } else {
                MessageType::P2pStatusUpdate
            },
            wire::pack(
                wire::TASK_STATUS_UPDATE,
                &TaskStatusUpdate {
                    task_id: task.id.clone(),
                    status: wire::status_for(state.unwrap_or(TaskState::Working)) as i32,
                    progress: task.progress.map(i32::from).unwrap_or(0),
                    message: env.text.clone().unwrap_or_default(),
                    details: env.data.as_ref().map(wire::json),
                },
            ),
        ),
        Kind::TaskResult => {
            let completed = state.is_none_or(|s| s == TaskState::Completed);
            let summary = if completed {
                task.summary.clone().or(env.text.clone())
            } else {
                task.error.clone().or(env.text.clone())
            };
            (
                if completed {
                    MessageType::P2pTaskComplete
                } else {
                    MessageType::P2pTaskFailed
                },
                wire::pack(
                    wire::TASK_RESULT,
                    &TaskResult {
                        task_id: task.id.clone(),
                        task_type: task.title.clone().unwrap_or_default(),
                        result: env.data.as_ref().map(wire::json),
                        summary: summary.unwrap_or_default(),
                    },
                ),
            )
        }
        Kind::ControlAbort | Kind::ControlInterrupt if !task.id.is_empty() => (
            MessageType::P2pStatusUpdate,
            wire::pack(
                wire::TASK_STATUS_UPDATE,
                &TaskStatusUpdate {
                    task_id: task.id.clone(),
                    status: wire::status_for(TaskState::Cancelled) as i32,
                    progress: 0,
                    message: env.text.clone().unwrap_or_default(),
                    details: None,
                },
            ),
        ),
        Kind::DecisionRequest => (MessageType::HilDecisionRequest, payload_of(env)?),
        Kind::DecisionResponse => (MessageType::HilDecisionResponse, payload_of(env)?),
        Kind::VoteInitiate => (MessageType::GroupVoteInitiate, payload_of(env)?),
        Kind::VoteSubmit => (MessageType::GroupVoteSubmit, payload_of(env)?),
        Kind::VoteResult => (MessageType::GroupVoteResult, payload_of(env)?),
        Kind::Error => (MessageType::P2pNack, payload_of(env)?),
        Kind::Chat | Kind::Context | Kind::Custom => {
            env.text.as_ref()?;
            (MessageType::Unspecified, payload_of(env)?)
        }
        _ => return None,
    };
    Some(SynapseMessage {
        id: env.id.clone(),
        version: PROTOCOL_VERSION.to_owned(),
        r#type: msg_type as i32,
        sender: Some(ctx.endpoint_of(&env.from)),
        receiver: env.addressees().next().map(|name| ctx.endpoint_of(name)),
        correlation_id: env.correlation_id.clone().unwrap_or_default(),
        reply_to: env.reply_to.clone().unwrap_or_default(),
        group_id: match &env.audience {
            Audience::Group(group) => group.clone(),
            _ => String::new(),
        },
        timestamp: Some(wire::timestamp(env.timestamp)),
        payload: Some(payload),
        signature: String::new(),
    })
}

/// What a Synapse agent is shown for `env`, for the translation contract.
pub fn preview(env: &Envelope) -> Vec<Frame> {
    struct Names;
    impl Context for Names {
        fn endpoint_of(&self, name: &str) -> AgentEndpoint {
            AgentEndpoint {
                agent_id: name.to_owned(),
                ..Default::default()
            }
        }
    }
    let Some(msg) = encode(env, &Names) else {
        return Vec::new();
    };
    let Ok(body) = wire::to_json(&msg, "synapse.SynapseMessage") else {
        return Vec::new();
    };
    vec![Frame {
        label: format!("`{}`", wire::message_type(&msg).as_str_name()),
        body,
    }]
}

/// Text as a `StringValue`, else structured data as a `Struct`.
fn payload_of(env: &Envelope) -> Option<prost_types::Any> {
    match (&env.text, &env.data) {
        (Some(text), _) => Some(wire::text(text)),
        (None, Some(data)) => Some(wire::json(data)),
        (None, None) => None,
    }
}

fn kind_of(msg_type: MessageType) -> Kind {
    match msg_type {
        MessageType::Unspecified => Kind::Chat,
        MessageType::P2pTaskRequest | MessageType::GroupTaskSplit => Kind::TaskAssign,
        MessageType::P2pStatusUpdate | MessageType::P2pInfoMissing => Kind::TaskUpdate,
        MessageType::P2pTaskComplete
        | MessageType::P2pTaskFailed
        | MessageType::GroupSubtaskResult
        | MessageType::GroupResultMerge => Kind::TaskResult,
        MessageType::P2pAck
        | MessageType::GroupInvite
        | MessageType::GroupJoin
        | MessageType::GroupLeave => Kind::Custom,
        MessageType::P2pNack => Kind::Error,
        MessageType::GroupVoteInitiate => Kind::VoteInitiate,
        MessageType::GroupVoteSubmit => Kind::VoteSubmit,
        MessageType::GroupVoteResult => Kind::VoteResult,
        MessageType::HilDecisionRequest => Kind::DecisionRequest,
        MessageType::HilDecisionResponse => Kind::DecisionResponse,
        MessageType::Heartbeat => Kind::PresenceStatus,
    }
}

/// Words for group housekeeping messages that carry no text of their own.
fn housekeeping_text(msg_type: MessageType, msg: &SynapseMessage) -> Option<String> {
    let who = msg
        .sender
        .as_ref()
        .map(|s| s.agent_id.as_str())
        .unwrap_or("someone");
    let group = &msg.group_id;
    match msg_type {
        MessageType::GroupInvite => Some(format!("{who} invites you to group {group}")),
        MessageType::GroupJoin => Some(format!("{who} joined group {group}")),
        MessageType::GroupLeave => Some(format!("{who} left group {group}")),
        _ => None,
    }
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

fn first_non_empty(a: &str, b: &str) -> String {
    if a.is_empty() {
        b.to_owned()
    } else {
        a.to_owned()
    }
}

/// The JSON a Synapse agent's callback receives: the message in proto3 JSON.
pub fn callback_body(msg: &SynapseMessage) -> Result<Value, String> {
    wire::to_json(msg, "synapse.SynapseMessage")
}

/// The parts of `msg` that `ack` (and so a nack) reads, without its payload: kept for a
/// message whose answer may come later.
pub fn answerable(msg: &SynapseMessage) -> SynapseMessage {
    SynapseMessage {
        id: msg.id.clone(),
        sender: msg.sender.clone(),
        correlation_id: msg.correlation_id.clone(),
        group_id: msg.group_id.clone(),
        ..Default::default()
    }
}

/// A message saying `ack` to `msg` from the bridge.
pub fn ack(msg: &SynapseMessage, bridge: AgentEndpoint) -> SynapseMessage {
    SynapseMessage {
        id: new_message_id(),
        version: PROTOCOL_VERSION.to_owned(),
        r#type: MessageType::P2pAck as i32,
        sender: Some(bridge),
        receiver: msg.sender.clone(),
        correlation_id: first_non_empty(&msg.correlation_id, &msg.id),
        reply_to: msg.id.clone(),
        group_id: msg.group_id.clone(),
        timestamp: Some(wire::timestamp(now_ms())),
        payload: Some(wire::text("accepted")),
        signature: String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_payload_that_is_not_text_is_refused() {
        let msg = SynapseMessage {
            sender: endpoint("planner"),
            receiver: endpoint("alice"),
            payload: Some(prost_types::Any {
                type_url: wire::STRING_VALUE.into(),
                value: vec![0x0a, 0x02, 0xff, 0xfe],
            }),
            ..Default::default()
        };
        let error = decode(&msg).unwrap_err();
        assert!(error.starts_with("payload: "), "{error}");
        assert!(
            error.contains("holds bytes that are not a string"),
            "{error}"
        );
    }

    struct Ctx;
    impl Context for Ctx {
        fn endpoint_of(&self, name: &str) -> AgentEndpoint {
            AgentEndpoint {
                agent_id: name.into(),
                agent_name: name.into(),
                system_id: "test".into(),
                ..Default::default()
            }
        }
    }

    fn endpoint(id: &str) -> Option<AgentEndpoint> {
        Some(AgentEndpoint {
            agent_id: id.into(),
            ..Default::default()
        })
    }

    #[test]
    fn a_task_request_becomes_an_assignment_and_back() {
        let msg = SynapseMessage {
            id: "req-1".into(),
            r#type: MessageType::P2pTaskRequest as i32,
            sender: endpoint("planner"),
            receiver: endpoint("alice"),
            payload: Some(wire::pack(
                wire::TASK_PAYLOAD,
                &TaskPayload {
                    task_id: "t-1".into(),
                    task_type: "code-review".into(),
                    payload: Some(wire::text("review PR 7")),
                    external_task_id: "ext-9".into(),
                },
            )),
            ..Default::default()
        };
        let env = decode(&msg).unwrap();
        assert_eq!(
            (env.kind, env.from.as_str(), env.to.clone()),
            (Kind::TaskAssign, "planner", vec!["alice".to_string()])
        );
        let task = env.task.clone().unwrap();
        assert_eq!(
            (
                task.id.as_str(),
                task.title.as_deref(),
                task.description.as_deref()
            ),
            ("t-1", Some("code-review"), Some("review PR 7"))
        );
        assert_eq!(task.assignee.as_deref(), Some("alice"));
        assert_eq!(task.external_id.as_deref(), Some("ext-9"));
        // Synapse peers get the message itself back.
        assert_eq!(encode(&env, &Ctx).unwrap(), msg);
    }

    #[test]
    fn foreign_results_become_complete_or_failed() {
        let mut env = Envelope::new("skynet", "alice", Kind::TaskResult);
        env.to = vec!["planner".into()];
        env.reply_to = Some("req-1".into());
        env.correlation_id = Some("req-1".into());
        env.task = Some(Box::new(TaskInfo {
            id: "t-1".into(),
            state: Some(TaskState::Completed),
            summary: Some("LGTM".into()),
            ..Default::default()
        }));
        let msg = encode(&env, &Ctx).unwrap();
        assert_eq!(wire::message_type(&msg), MessageType::P2pTaskComplete);
        assert_eq!(
            (msg.reply_to.as_str(), msg.correlation_id.as_str()),
            ("req-1", "req-1")
        );
        assert_eq!(msg.receiver.unwrap().agent_id, "planner");
        let Payload::Result(result) = wire::unpack(msg.payload.as_ref()) else {
            panic!("a TaskResult payload");
        };
        assert_eq!(
            (result.task_id.as_str(), result.summary.as_str()),
            ("t-1", "LGTM")
        );

        env.task.as_mut().unwrap().state = Some(TaskState::Failed);
        env.task.as_mut().unwrap().error = Some("tests fail".into());
        let msg = encode(&env, &Ctx).unwrap();
        assert_eq!(wire::message_type(&msg), MessageType::P2pTaskFailed);
        let Payload::Result(result) = wire::unpack(msg.payload.as_ref()) else {
            panic!("a TaskResult payload");
        };
        assert_eq!(result.summary, "tests fail");
    }

    #[test]
    fn chat_is_an_unspecified_text_message() {
        let mut env = Envelope::new("tracker", "boss", Kind::Chat);
        env.text = Some("approve".into());
        env.to = vec!["planner".into()];
        let msg = encode(&env, &Ctx).unwrap();
        assert_eq!(wire::message_type(&msg), MessageType::Unspecified);
        assert_eq!(
            wire::unpack(msg.payload.as_ref()),
            Payload::Text("approve".into())
        );
        let back = decode(&SynapseMessage {
            sender: endpoint("planner"),
            payload: Some(wire::text("hello")),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            (back.kind, back.text.as_deref()),
            (Kind::Chat, Some("hello"))
        );
        assert!(!back.id.is_empty());
    }

    #[test]
    fn every_message_type_has_a_kind_and_back() {
        use MessageType as M;
        for (msg_type, kind) in [
            (M::Unspecified, Kind::Chat),
            (M::P2pTaskRequest, Kind::TaskAssign),
            (M::P2pTaskComplete, Kind::TaskResult),
            (M::P2pTaskFailed, Kind::TaskResult),
            (M::P2pStatusUpdate, Kind::TaskUpdate),
            (M::P2pInfoMissing, Kind::TaskUpdate),
            (M::P2pAck, Kind::Custom),
            (M::P2pNack, Kind::Error),
            (M::GroupInvite, Kind::Custom),
            (M::GroupJoin, Kind::Custom),
            (M::GroupLeave, Kind::Custom),
            (M::GroupTaskSplit, Kind::TaskAssign),
            (M::GroupSubtaskResult, Kind::TaskResult),
            (M::GroupResultMerge, Kind::TaskResult),
            (M::GroupVoteInitiate, Kind::VoteInitiate),
            (M::GroupVoteSubmit, Kind::VoteSubmit),
            (M::GroupVoteResult, Kind::VoteResult),
            (M::HilDecisionRequest, Kind::DecisionRequest),
            (M::HilDecisionResponse, Kind::DecisionResponse),
            (M::Heartbeat, Kind::PresenceStatus),
        ] {
            assert_eq!(kind_of(msg_type), kind, "{msg_type:?}");
        }
        // Foreign votes and decisions come back as their Synapse types.
        for (kind, msg_type) in [
            (Kind::VoteInitiate, M::GroupVoteInitiate),
            (Kind::VoteSubmit, M::GroupVoteSubmit),
            (Kind::VoteResult, M::GroupVoteResult),
            (Kind::DecisionRequest, M::HilDecisionRequest),
            (Kind::DecisionResponse, M::HilDecisionResponse),
            (Kind::Error, M::P2pNack),
        ] {
            let mut env = Envelope::new("grid", "mc", kind);
            env.text = Some("x".into());
            assert_eq!(wire::message_type(&encode(&env, &Ctx).unwrap()), msg_type);
        }
        let join = decode(&SynapseMessage {
            r#type: M::GroupJoin as i32,
            sender: endpoint("a"),
            group_id: "g".into(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(join.text.as_deref(), Some("a joined group g"));
        assert_eq!(join.audience, Audience::Group("g".into()));
    }

    #[test]
    fn status_updates_carry_state_and_progress() {
        let msg = SynapseMessage {
            id: "s".into(),
            r#type: MessageType::P2pStatusUpdate as i32,
            sender: endpoint("worker"),
            payload: Some(wire::pack(
                wire::TASK_STATUS_UPDATE,
                &TaskStatusUpdate {
                    task_id: "t".into(),
                    status: super::super::proto::TaskStatus::Processing as i32,
                    progress: 40,
                    message: "halfway".into(),
                    details: None,
                },
            )),
            ..Default::default()
        };
        let env = decode(&msg).unwrap();
        let task = env.task.unwrap();
        assert_eq!(
            (task.state, task.progress),
            (Some(TaskState::Working), Some(40))
        );
        assert_eq!(env.text.as_deref(), Some("halfway"));
        assert!(encode(&Envelope::new("skynet", "a", Kind::PresenceJoin), &Ctx).is_none());
    }
}
