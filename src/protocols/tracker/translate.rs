//! Tracker frames ⇄ Envelope. Pure functions over what `Context` tells them about chats
//! and authors.

use serde_json::{Value, json};

use super::PROTOCOL;
use super::db::{ProjectRow, TaskRow};
use super::wire::{self, AuthorType, MessageOut, Priority, TaskOut, TaskStatus, TaskType};
use crate::core::{Envelope, Kind, TaskInfo, TaskState, uuid_form};
use crate::protocols::endpoint::{Decoded, PreviewFrame as Frame, Translation};
use crate::shared::clock::iso8601;

/// What translation needs to know about the Tracker's chats and the directory.
pub trait Context {
    fn lobby_chat_id(&self) -> &str;
    /// Whether `thread` is a project's chat id.
    fn is_project_chat(&self, thread: &str) -> bool;
    fn author_type(&self, name: &str) -> AuthorType;
}

/// The Tracker's side of the translation contract.
pub struct Translator;

/// A message a member posted, as the Tracker shows it, with where it was posted.
pub struct Authored<'a> {
    pub message: &'a MessageOut,
    /// The chat (or, for a task comment, the task); `None` is the lobby.
    pub thread: Option<String>,
    /// The message it answers, mapped back to the original id.
    pub reply_to: Option<String>,
    pub timestamp: i64,
}

impl Translation for Translator {
    type Inbound<'a> = Authored<'a>;
    type Outbound = Value;
    /// Posting checked the message (its chat, its mentions) before it reached decoding.
    type Refusal = std::convert::Infallible;
    type Context = dyn Context + Send + Sync;

    fn decode(_: &Self::Context, posted: Authored<'_>) -> Result<Decoded, Self::Refusal> {
        Ok(decode_message(
            posted.message,
            posted.thread,
            posted.reply_to,
            posted.timestamp,
        )
        .into())
    }

    fn encode(ctx: &Self::Context, env: &Envelope) -> Option<Value> {
        encode(env, ctx)
    }

    fn task_state(state: TaskState) -> (String, Option<TaskState>) {
        match status_for(state) {
            Some(status) => (
                format!("`{}`", status.as_str()),
                Some(state_of(status, true)),
            ),
            None => ("status kept, comment added".into(), None),
        }
    }

    fn preview(env: &Envelope) -> Vec<Frame> {
        preview(env)
    }
}

/// Canonical task state → Tracker status (`None`: the status stays as it is).
pub fn status_for(state: TaskState) -> Option<TaskStatus> {
    Some(match state {
        TaskState::Submitted | TaskState::Assigned => TaskStatus::Todo,
        TaskState::Working | TaskState::Waiting => TaskStatus::InProgress,
        TaskState::InReview => TaskStatus::InReview,
        TaskState::Completed => TaskStatus::Done,
        TaskState::Cancelled | TaskState::Rejected => TaskStatus::Backlog,
        // The Tracker has no failed status: the task stays put and gets a comment.
        TaskState::Failed => return None,
    })
}

/// Tracker status → canonical task state.
pub fn state_of(status: TaskStatus, assigned: bool) -> TaskState {
    match status {
        TaskStatus::Backlog | TaskStatus::Todo if assigned => TaskState::Assigned,
        TaskStatus::Backlog | TaskStatus::Todo => TaskState::Submitted,
        TaskStatus::InProgress => TaskState::Working,
        TaskStatus::InReview => TaskState::InReview,
        TaskStatus::Done => TaskState::Completed,
    }
}

/// Kinds the Tracker shows as chat messages (`message.new`).
pub fn is_chat_like(env: &Envelope) -> bool {
    match env.kind {
        Kind::Chat
        | Kind::DecisionRequest
        | Kind::DecisionResponse
        | Kind::VoteInitiate
        | Kind::VoteSubmit
        | Kind::VoteResult
        | Kind::Error => true,
        Kind::Custom | Kind::Context => env.text.is_some(),
        _ => false,
    }
}

pub fn task_out(task: &TaskRow) -> TaskOut {
    TaskOut {
        id: task.id.clone(),
        project_id: task.project_id.clone(),
        project_slug: task.project_slug.clone(),
        title: task.title.clone(),
        description: task.description.clone(),
        status: task.status,
        task_type: task.task_type,
        priority: task.priority,
        assignee_slug: task.assignee_slug.clone(),
        reviewer_slug: task.reviewer_slug.clone(),
        author_slug: task.author_slug.clone(),
        watchers: task.watchers.clone(),
        external_id: task.external_id.clone(),
        created_at: iso8601(task.created_at),
        updated_at: iso8601(task.updated_at),
    }
}

/// A message of any origin as the Tracker shows it.
pub fn message_out(env: &Envelope, ctx: &(impl Context + ?Sized)) -> MessageOut {
    if env.origin_is(PROTOCOL)
        && let Some(out) = env
            .origin
            .native()
            .and_then(|n| n.get("data"))
            .and_then(|d| serde_json::from_value::<MessageOut>(d.clone()).ok())
    {
        return out;
    }
    let (chat_id, task_id) = locate(env, ctx);
    MessageOut {
        id: uuid_form(&env.id),
        chat_id,
        task_id,
        author_type: ctx.author_type(&env.from),
        author_slug: env.from.clone(),
        content: content_of(env),
        mentions: env.addressees().map(str::to_owned).collect(),
        created_at: iso8601(env.timestamp),
        reply_to: env.reply_to.as_deref().map(uuid_form),
        attachments: Vec::new(),
    }
}

/// Where a message lives: `(chat_id, task_id)`.
fn locate(env: &Envelope, ctx: &(impl Context + ?Sized)) -> (Option<String>, Option<String>) {
    match (&env.thread, &env.task) {
        (Some(thread), Some(task)) if *thread == task.id => (None, Some(thread.clone())),
        (Some(thread), _) if ctx.is_project_chat(thread) => (Some(thread.clone()), None),
        // Threads the Tracker has no chat for (another protocol's rooms) land in the lobby.
        _ => (Some(ctx.lobby_chat_id().to_owned()), None),
    }
}

fn content_of(env: &Envelope) -> String {
    if let Some(text) = &env.text {
        return text.clone();
    }
    match &env.data {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    }
}

/// Envelope → the frame a Tracker connection receives, `None` when the Tracker has nothing
/// to show for it. Task events are not encoded here: the endpoint renders them from its
/// own task table.
pub fn encode(env: &Envelope, ctx: &(impl Context + ?Sized)) -> Option<Value> {
    Some(match shown(env, ctx)? {
        Shown::Native(frame) => frame.clone(),
        Shown::Event(frame) => frame,
        Shown::Message(out) => wire::event(wire::MESSAGE_NEW, out),
    })
}

/// `encode`, as the text a connection sends: a message is written straight to text,
/// without a `Value` in between.
pub fn encode_text(env: &Envelope, ctx: &(impl Context + ?Sized)) -> Option<String> {
    Some(match shown(env, ctx)? {
        // Serialized once already, for the store.
        Shown::Native(_) => env.origin.native_json()?.to_owned(),
        Shown::Event(frame) => serde_json::to_string(&frame).ok()?,
        Shown::Message(out) => wire::message_new_text(&out),
    })
}

/// What a Tracker connection is shown for a message.
enum Shown<'a> {
    /// The frame a Tracker member sent, as it was.
    Native(&'a Value),
    Event(Value),
    /// A `message.new` event.
    Message(MessageOut),
}

fn shown<'a>(env: &'a Envelope, ctx: &(impl Context + ?Sized)) -> Option<Shown<'a>> {
    if env.origin_is(PROTOCOL)
        && let Some(native) = env.origin.native()
        && native.get("type").is_some()
    {
        return Some(Shown::Native(native));
    }
    match env.kind {
        Kind::PresenceJoin => Some(Shown::Event(agent_status(&env.from, "online"))),
        Kind::PresenceLeave => Some(Shown::Event(agent_status(&env.from, "offline"))),
        // The Tracker announces only online / offline; busy and idle show in /members.
        Kind::PresenceStatus => None,
        _ if is_chat_like(env) => Some(Shown::Message(message_out(env, ctx))),
        _ => None,
    }
}

/// What a Tracker member is shown for `env`, for the translation contract: task messages
/// go through the task table (`task_from`, `task_change`, applied by hub.rs), the rest
/// through `encode`.
pub fn preview(env: &Envelope) -> Vec<Frame> {
    struct Names;
    impl Context for Names {
        fn lobby_chat_id(&self) -> &str {
            "lobby"
        }
        fn is_project_chat(&self, _: &str) -> bool {
            false
        }
        fn author_type(&self, _: &str) -> AuthorType {
            AuthorType::Agent
        }
    }
    let frame = |label: &str, body: Value| Frame {
        label: format!("`{label}`"),
        body,
    };
    match env.kind {
        Kind::TaskAssign => {
            let project = ProjectRow {
                id: "project".into(),
                slug: "project".into(),
                name: String::new(),
                description: String::new(),
                chat_id: "project-chat".into(),
                created_at: 0,
            };
            let assignee = env.task.as_ref().and_then(|t| t.assignee.clone());
            let task = task_from(env, assignee.unwrap_or_default(), &project, 0);
            vec![frame(
                "task.created",
                wire::event("task.created", task_out(&task)),
            )]
        }
        Kind::TaskUpdate | Kind::TaskResult => {
            let change = task_change(env);
            let mut frames = Vec::new();
            if let Some(status) = change.status {
                frames.push(frame(
                    "task.updated",
                    wire::event("task.updated", json!({ "status": status })),
                ));
            }
            if let Some(note) = change.note {
                let mut comment = env.clone();
                comment.kind = Kind::Chat;
                comment.text = Some(note);
                comment.thread = env.task.as_ref().map(|t| t.id.clone());
                frames.push(frame(
                    wire::MESSAGE_NEW,
                    wire::event(wire::MESSAGE_NEW, message_out(&comment, &Names)),
                ));
            }
            frames
        }
        _ => encode(env, &Names)
            .map(|body| {
                let label = body["type"].as_str().unwrap_or_default().to_owned();
                vec![frame(&label, body)]
            })
            .unwrap_or_default(),
    }
}

/// The Tracker task that a task assigned from another protocol becomes: the sender's task
/// id is kept as `external_id` (and, in UUID form, as the task's id), so the Tracker's task
/// events name the task the sender knows.
pub fn task_from(env: &Envelope, assignee: String, project: &ProjectRow, now: i64) -> TaskRow {
    let info = env.task.clone().unwrap_or_default();
    let external_id = if info.id.is_empty() {
        env.id.clone()
    } else {
        info.id.clone()
    };
    let text = env.text.clone().unwrap_or_default();
    let title = info
        .title
        .clone()
        .filter(|t| !t.is_empty())
        .or_else(|| {
            text.lines()
                .next()
                .map(str::to_owned)
                .filter(|t| !t.is_empty())
        })
        .unwrap_or_else(|| format!("Task from {}", env.from));
    TaskRow {
        id: uuid_form(&external_id),
        project_id: project.id.clone(),
        project_slug: project.slug.clone(),
        title,
        description: info.description.clone().unwrap_or(text),
        status: TaskStatus::Todo,
        task_type: TaskType::Task,
        priority: match env.priority {
            crate::core::Priority::High => Priority::High,
            crate::core::Priority::Normal => Priority::Medium,
            crate::core::Priority::Low => Priority::Low,
        },
        assignee_slug: Some(assignee),
        reviewer_slug: None,
        author_slug: env.from.clone(),
        watchers: Vec::new(),
        external_id: Some(external_id),
        requester: Some(env.from.clone()),
        request_message_id: Some(env.id.clone()),
        delegation_message_id: None,
        created_at: now,
        updated_at: now,
    }
}

/// What a task message from another protocol does to a Tracker task it names.
#[derive(Debug, Default, PartialEq)]
pub struct TaskChange {
    /// The new status; `None` leaves it (the Tracker has no `failed`).
    pub status: Option<TaskStatus>,
    /// Said on the task's thread as a comment by the sender.
    pub note: Option<String>,
    pub reassign: Option<String>,
}

pub fn task_change(env: &Envelope) -> TaskChange {
    let info = env.task.clone().unwrap_or_default();
    let state = info.state.or(match env.kind {
        Kind::TaskAssign => Some(TaskState::Assigned),
        _ => None,
    });
    let note = match (state, &info.error) {
        (Some(TaskState::Failed), Some(error)) => Some(format!("failed: {error}")),
        (Some(TaskState::Failed), None) => Some("failed".to_owned()),
        _ => env.text.clone().or(info.summary.clone()),
    };
    TaskChange {
        status: state.and_then(status_for),
        note,
        reassign: (env.kind == Kind::TaskAssign)
            .then(|| info.assignee.clone())
            .flatten(),
    }
}

pub fn agent_status(slug: &str, status: &str) -> Value {
    wire::event("agent.status", json!({ "slug": slug, "status": status }))
}

/// A Tracker message → Envelope. `reply_to` is already mapped back to the original id.
pub fn decode_message(
    out: &MessageOut,
    thread: Option<String>,
    reply_to: Option<String>,
    timestamp: i64,
) -> Envelope {
    let mut env = Envelope::received(
        out.id.clone(),
        &out.author_slug,
        Kind::Chat,
        timestamp,
        wire::message_new_origin(out),
    );
    env.text = Some(out.content.clone());
    env.mentions = out.mentions.clone();
    env.reply_to = reply_to;
    env.task = out.task_id.as_ref().map(|id| {
        Box::new(TaskInfo {
            id: id.clone(),
            ..Default::default()
        })
    });
    env.thread = thread;
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Ctx;
    impl Context for Ctx {
        fn lobby_chat_id(&self) -> &str {
            "lobby"
        }
        fn is_project_chat(&self, thread: &str) -> bool {
            thread == "project-chat"
        }
        fn author_type(&self, name: &str) -> AuthorType {
            if name == "boss" {
                AuthorType::Human
            } else {
                AuthorType::Agent
            }
        }
    }

    #[test]
    fn statuses_map_both_ways() {
        for status in [
            TaskStatus::Todo,
            TaskStatus::InProgress,
            TaskStatus::InReview,
            TaskStatus::Done,
        ] {
            assert_eq!(status_for(state_of(status, true)), Some(status));
        }
        assert_eq!(status_for(TaskState::Failed), None);
        assert_eq!(status_for(TaskState::Cancelled), Some(TaskStatus::Backlog));
        assert_eq!(state_of(TaskStatus::Todo, false), TaskState::Submitted);
    }

    #[test]
    fn the_text_a_connection_sends_is_the_encoded_frame() {
        let mut chat = Envelope::new("skynet", "alice", Kind::Chat);
        chat.text = Some("hi \"coder\"".into());
        chat.mentions = vec!["coder".into()];
        chat.reply_to = Some("msg-0".into());
        let join = Envelope::new("grid", "scout", Kind::PresenceJoin);
        let mut native = Envelope::new(PROTOCOL, "coder", Kind::Chat);
        native.origin.set_native(Some(
            serde_json::json!({ "type": "message.new", "data": { "x": 1 } }),
        ));
        for env in [chat, join, native] {
            let text = encode_text(&env, &Ctx).unwrap();
            let sent: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(sent, encode(&env, &Ctx).unwrap());
        }
        let status = Envelope::new("skynet", "alice", Kind::PresenceStatus);
        assert_eq!(encode_text(&status, &Ctx), None);
    }

    #[test]
    fn foreign_chat_renders_as_message_new_in_the_lobby() {
        let mut env = Envelope::new("skynet", "alice", Kind::Chat);
        env.id = "msg-1".into();
        env.text = Some("hi @coder".into());
        env.mentions = vec!["coder".into()];
        env.reply_to = Some("msg-0".into());
        let frame = encode(&env, &Ctx).unwrap();
        assert_eq!(frame["type"], "message.new");
        let data = &frame["data"];
        assert_eq!(data["id"], uuid_form("msg-1"));
        assert_eq!(data["chat_id"], "lobby");
        assert_eq!(data["task_id"], Value::Null);
        assert_eq!(data["author_slug"], "alice");
        assert_eq!(data["author_type"], "agent");
        assert_eq!(data["mentions"], json!(["coder"]));
        assert_eq!(data["reply_to"], uuid_form("msg-0"));
        assert!(data["created_at"].as_str().unwrap().ends_with('Z'));
    }

    #[test]
    fn project_chats_and_task_comments_keep_their_place() {
        let mut env = Envelope::new("skynet", "boss", Kind::Chat);
        env.text = Some("x".into());
        env.thread = Some("project-chat".into());
        let out = message_out(&env, &Ctx);
        assert_eq!(
            (out.chat_id.as_deref(), out.author_type),
            (Some("project-chat"), AuthorType::Human)
        );
        env.thread = Some("task-1".into());
        env.task = Some(Box::new(TaskInfo {
            id: "task-1".into(),
            ..Default::default()
        }));
        let out = message_out(&env, &Ctx);
        assert_eq!(
            (out.chat_id, out.task_id.as_deref()),
            (None, Some("task-1"))
        );
    }

    #[test]
    fn presence_becomes_agent_status_and_tracker_frames_pass_through() {
        let env = Envelope::new("skynet", "alice", Kind::PresenceJoin);
        assert_eq!(
            encode(&env, &Ctx).unwrap(),
            json!({ "type": "agent.status", "data": { "slug": "alice", "status": "online" } })
        );
        let out = MessageOut {
            id: uuid::Uuid::new_v4().to_string(),
            chat_id: Some("lobby".into()),
            task_id: None,
            author_type: AuthorType::Agent,
            author_slug: "coder".into(),
            content: "hello".into(),
            mentions: vec![],
            created_at: iso8601(0),
            reply_to: None,
            attachments: vec![],
        };
        let env = decode_message(&out, None, None, 0);
        assert_eq!(
            encode(&env, &Ctx).unwrap()["data"],
            serde_json::to_value(&out).unwrap()
        );
        assert_eq!(message_out(&env, &Ctx), out);
    }
}
