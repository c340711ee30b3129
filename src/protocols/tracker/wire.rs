//! The Tracker's wire vocabulary: WebSocket frames, the REST resources (`…Out`), and the
//! closed sets of values the protocol document fixes (task statuses, types, priorities,
//! listen filters). Anything outside those sets is refused, naming the field.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::PROTOCOL;
use crate::core::Origin;
use crate::shared::json_writer::ObjectWriter;

/// The event a chat message is shown to a member in.
pub const MESSAGE_NEW: &str = "message.new";

/// Declares a closed string enum with its wire names, parsing and printing.
macro_rules! wire_enum {
    ($(#[$m:meta])* $name:ident { $($variant:ident = $text:literal),+ $(,)? } default $default:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name {
            $(#[serde(rename = $text)] $variant),+
        }

        impl $name {
            pub const ALL: &'static [&'static str] = &[$($text),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

            pub fn parse(s: &str) -> Option<Self> {
                match s { $($text => Some($name::$variant),)+ _ => None }
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $name::$default
            }
        }
    };
}

wire_enum!(
    /// `backlog | todo | in_progress | in_review | done`
    TaskStatus { Backlog = "backlog", Todo = "todo", InProgress = "in_progress", InReview = "in_review", Done = "done" }
    default Todo
);
wire_enum!(
    /// `task | bug | epic | story`
    TaskType { Task = "task", Bug = "bug", Epic = "epic", Story = "story" }
    default Task
);
wire_enum!(
    /// `low | medium | high | critical`
    Priority { Low = "low", Medium = "medium", High = "high", Critical = "critical" }
    default Medium
);
wire_enum!(
    /// Which chat messages a member's connection receives.
    ChatListen { All = "all", Mentions = "mentions", None = "none" }
    default Mentions
);
wire_enum!(
    /// Which task events a member's connection receives (`assigned`: as assignee, reviewer
    /// or watcher).
    TaskListen { All = "all", Assigned = "assigned", None = "none" }
    default Assigned
);
wire_enum!(
    MemberKind { Agent = "agent", Human = "human" }
    default Agent
);
wire_enum!(
    AuthorType { Human = "human", Agent = "agent", System = "system" }
    default Agent
);
wire_enum!(
    /// Heartbeat statuses a connection may report.
    HeartbeatStatus { Online = "online", Busy = "busy", Idle = "idle" }
    default Online
);

#[derive(Clone, Debug, Serialize)]
pub struct ProjectOut {
    pub id: String,
    pub slug: String,
    pub name: String,
    pub description: String,
    /// The project's chat (for `chat.send` and `GET /messages?chat_id=`).
    pub chat_id: String,
    pub created_at: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TaskOut {
    pub id: String,
    pub project_id: String,
    pub project_slug: String,
    pub title: String,
    pub description: String,
    pub status: TaskStatus,
    #[serde(rename = "type")]
    pub task_type: TaskType,
    pub priority: Priority,
    pub assignee_slug: Option<String>,
    pub reviewer_slug: Option<String>,
    pub author_slug: String,
    pub watchers: Vec<String>,
    /// The id the task has in the protocol it came from, when it came from elsewhere.
    pub external_id: Option<String>,
    pub created_at: String,
    pub updated_at: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct StepOut {
    pub id: String,
    pub task_id: String,
    pub title: String,
    pub done: bool,
    pub position: i64,
    pub created_at: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MessageOut {
    pub id: String,
    pub chat_id: Option<String>,
    pub task_id: Option<String>,
    pub author_type: AuthorType,
    pub author_slug: String,
    pub content: String,
    pub mentions: Vec<String>,
    pub created_at: String,
    /// The message this one answers, when it answers one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<AttachmentOut>,
}

impl MessageOut {
    /// Appends the message as serde writes it (the test holds the two to the same text),
    /// field by field (`json_writer`): every message relayed to a Tracker member is one,
    /// and its strings are 2.5k of the 4.1k instructions serde takes to write one.
    pub fn write_json(&self, out: &mut Vec<u8>) -> serde_json::Result<()> {
        let mut message = ObjectWriter::start(out);
        message.string("id", &self.id);
        message.string_or_null("chat_id", self.chat_id.as_deref());
        message.string_or_null("task_id", self.task_id.as_deref());
        message.string("author_type", self.author_type.as_str());
        message.string("author_slug", &self.author_slug);
        message.string("content", &self.content);
        message.strings("mentions", &self.mentions);
        message.string("created_at", &self.created_at);
        if let Some(reply_to) = &self.reply_to {
            message.string("reply_to", reply_to);
        }
        if !self.attachments.is_empty() {
            message.serialized("attachments", &self.attachments)?;
        }
        message.end();
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttachmentOut {
    pub id: String,
    pub message_id: String,
    pub task_id: Option<String>,
    pub filename: String,
    pub mime_type: String,
    pub size: i64,
    pub url: String,
    pub created_at: String,
}

/// `auth.ok`'s data, its fields in the document's order.
#[derive(Debug, Serialize)]
pub struct AuthOk<'a> {
    pub slug: &'a str,
    pub lobby_chat_id: &'a str,
    pub projects: Vec<ProjectRef<'a>>,
    /// The other members online.
    pub online: Vec<String>,
}

/// A project as `auth.ok` lists it.
#[derive(Debug, Serialize)]
pub struct ProjectRef<'a> {
    pub id: &'a str,
    pub slug: &'a str,
    pub name: &'a str,
}

#[derive(Clone, Debug, Serialize)]
pub struct MemberOut {
    pub id: String,
    pub slug: String,
    pub name: String,
    #[serde(rename = "type")]
    pub kind: MemberKind,
    pub capabilities: Vec<String>,
    pub chat_listen: ChatListen,
    pub task_listen: TaskListen,
    pub prompt: Option<String>,
    pub model: Option<String>,
    /// `online | busy | idle | offline`.
    pub status: String,
    pub is_online: bool,
    /// The protocol the member speaks (`tracker` for the Tracker's own members).
    pub protocol: String,
    /// The bridge of the fleet that holds it; absent for a bridge alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    pub created_at: String,
}

/// A client frame, checked for shape.
#[derive(Debug, PartialEq)]
pub enum ClientFrame {
    Auth {
        token: String,
    },
    Heartbeat {
        status: HeartbeatStatus,
    },
    Subscribe {
        project_id: String,
    },
    Unsubscribe {
        project_id: String,
    },
    ChatSend {
        chat_id: Option<String>,
        task_id: Option<String>,
        content: String,
        mentions: Vec<String>,
        reply_to: Option<String>,
    },
    Ack,
}

pub fn parse_client_frame(text: &str) -> Result<ClientFrame, String> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| format!("frame is not valid JSON: {e}"))?;
    let Value::Object(frame) = value else {
        return Err("frame must be a JSON object with a \"type\"".into());
    };
    let kind = match frame.get("type") {
        Some(Value::String(t)) => t.as_str(),
        _ => return Err("\"type\" must be a string".into()),
    };
    let string = |key: &str| -> Result<Option<String>, String> {
        match frame.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(format!("\"{key}\" must be a string")),
        }
    };
    let required = |key: &str| -> Result<String, String> {
        string(key)?
            .filter(|s| !s.is_empty())
            .ok_or_else(|| format!("\"{key}\" is required for {kind}"))
    };
    Ok(match kind {
        // A missing, empty or non-string token is an invalid one: the document has one
        // refusal for them all, "Invalid token".
        "auth" => ClientFrame::Auth {
            token: string("token").ok().flatten().unwrap_or_default(),
        },
        "heartbeat" => {
            let status = match string("status")? {
                None => HeartbeatStatus::Online,
                Some(s) => HeartbeatStatus::parse(&s).ok_or_else(|| {
                    format!(
                        "\"status\" must be one of {}, not \"{s}\"",
                        HeartbeatStatus::ALL.join(", ")
                    )
                })?,
            };
            ClientFrame::Heartbeat { status }
        }
        "project.subscribe" => ClientFrame::Subscribe {
            project_id: required("project_id")?,
        },
        "project.unsubscribe" => ClientFrame::Unsubscribe {
            project_id: required("project_id")?,
        },
        "chat.send" => {
            let chat_id = string("chat_id")?;
            let task_id = string("task_id")?;
            if chat_id.is_none() && task_id.is_none() {
                return Err("chat.send needs \"chat_id\" or \"task_id\"".into());
            }
            let content = match frame.get("content") {
                Some(Value::String(s)) => s.clone(),
                _ => return Err("\"content\" must be a string".into()),
            };
            let mentions = match frame.get("mentions") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(list)) if list.iter().all(Value::is_string) => list
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect(),
                Some(_) => return Err("\"mentions\" must be an array of slugs".into()),
            };
            ClientFrame::ChatSend {
                chat_id,
                task_id,
                content,
                mentions,
                reply_to: string("reply_to")?,
            }
        }
        "ack" => ClientFrame::Ack,
        other => return Err(format!("unknown message type \"{other}\"")),
    })
}

/// `{"type": kind, "data": data}`
pub fn event(kind: &str, data: impl Serialize) -> Value {
    json!({ "type": kind, "data": data })
}

/// `{"type", "data"}` in that order, as the document writes frames.
#[derive(Serialize)]
struct Event<'a, T> {
    r#type: &'a str,
    data: &'a T,
}

/// `event(kind, data)` as text, written without a `Value` in between.
pub fn event_text(kind: &str, data: &impl Serialize) -> String {
    // Sized for a typical `message.new`: `to_string` starts at 128 bytes and copies the
    // text each time it doubles.
    let mut text = Vec::with_capacity(512);
    // What the bridge serializes has string keys only, so this cannot fail; if it did,
    // the Value path says the same thing more slowly.
    serde_json::to_writer(&mut text, &Event { r#type: kind, data })
        .ok()
        .and_then(|()| String::from_utf8(text).ok())
        .unwrap_or_else(|| event(kind, data).to_string())
}

/// A `message.new` event for `message`, as text, `type` first.
pub fn message_new_text(message: &MessageOut) -> String {
    let mut text = Vec::with_capacity(512);
    let mut event = ObjectWriter::start(&mut text);
    event.string("type", MESSAGE_NEW);
    // A `MessageOut` has string keys only, so this cannot fail; if it did, serde says the
    // same thing more slowly.
    if message.write_json(event.key("data")).is_err() {
        return event_text(MESSAGE_NEW, message);
    }
    event.end();
    String::from_utf8(text).expect("written from strings")
}

/// The origin of a message a Tracker member sent: its `message.new` event as the text its
/// peers are sent as it is. Its `Value` is parsed only when a Tracker peer's frame needs
/// it: built here for every message, it and its drop were a tenth of the instructions a
/// message posted over REST to another protocol cost.
pub fn message_new_origin(message: &MessageOut) -> Origin {
    Origin::from_native_json(PROTOCOL, message_new_text(message))
}

/// `{"type": "error", "message": …}` — the shape of every error on the WebSocket.
pub fn error_frame(message: &str) -> String {
    #[derive(Serialize)]
    struct Error<'a> {
        r#type: &'a str,
        message: &'a str,
    }
    serde_json::to_string(&Error {
        r#type: "error",
        message,
    })
    .unwrap_or_else(|_| json!({ "type": "error", "message": message }).to_string())
}

pub fn auth_error_frame(message: &str) -> String {
    json!({ "type": "auth.error", "message": message }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_new_is_written_as_serde_writes_it() {
        let full = MessageOut {
            id: "m-1".into(),
            chat_id: Some("chat \"lobby\"".into()),
            task_id: Some("t-1".into()),
            author_type: AuthorType::Human,
            author_slug: "ann".into(),
            content: "hi\n@bob ✓".into(),
            mentions: vec!["bob".into(), "carol".into()],
            created_at: "2026-12-01T00:00:00.000Z".into(),
            reply_to: Some("m-0".into()),
            attachments: vec![AttachmentOut {
                id: "a-1".into(),
                message_id: "m-1".into(),
                task_id: None,
                filename: "a.txt".into(),
                mime_type: "text/plain".into(),
                size: 2,
                url: "/files/a-1".into(),
                created_at: "2026-12-01T00:00:00.000Z".into(),
            }],
        };
        let bare = MessageOut {
            chat_id: None,
            task_id: None,
            mentions: Vec::new(),
            reply_to: None,
            attachments: Vec::new(),
            ..full.clone()
        };
        for message in [full, bare] {
            // Written without falling back to serde, and as serde writes it.
            assert!(message.write_json(&mut Vec::new()).is_ok());
            assert_eq!(
                message_new_text(&message),
                event_text(MESSAGE_NEW, &message)
            );
            let origin = message_new_origin(&message);
            let text: Value = serde_json::from_str(origin.native_json().unwrap()).unwrap();
            assert_eq!(Some(&text), origin.native());
        }
    }

    #[test]
    fn enums_parse_exactly_the_documented_values() {
        assert_eq!(
            TaskStatus::parse("in_progress"),
            Some(TaskStatus::InProgress)
        );
        assert_eq!(TaskStatus::parse("in-progress"), None);
        assert_eq!(
            TaskStatus::ALL,
            ["backlog", "todo", "in_progress", "in_review", "done"]
        );
        assert_eq!(TaskType::ALL, ["task", "bug", "epic", "story"]);
        assert_eq!(Priority::ALL, ["low", "medium", "high", "critical"]);
        assert_eq!(
            serde_json::to_value(Priority::Critical).unwrap(),
            "critical"
        );
    }

    #[test]
    fn frames_parse_and_bad_ones_say_why() {
        assert_eq!(
            parse_client_frame(r#"{"type":"auth","token":"tb-1"}"#).unwrap(),
            ClientFrame::Auth {
                token: "tb-1".into()
            }
        );
        // Without a usable token, an auth frame still is one: refused as "Invalid token".
        for frame in [r#"{"type":"auth"}"#, r#"{"type":"auth","token":7}"#] {
            assert_eq!(
                parse_client_frame(frame).unwrap(),
                ClientFrame::Auth {
                    token: String::new()
                }
            );
        }
        assert_eq!(
            parse_client_frame(r#"{"type":"heartbeat","status":"busy"}"#).unwrap(),
            ClientFrame::Heartbeat {
                status: HeartbeatStatus::Busy
            }
        );
        for (frame, says) in [
            ("nope", "not valid JSON"),
            ("[]", "JSON object"),
            (r#"{"token":"x"}"#, "\"type\""),
            (
                r#"{"type":"heartbeat","status":"sleepy"}"#,
                "online, busy, idle",
            ),
            (r#"{"type":"chat.send","content":"x"}"#, "chat_id"),
            (
                r#"{"type":"chat.send","chat_id":"c","content":1}"#,
                "content",
            ),
            (
                r#"{"type":"chat.send","chat_id":"c","content":"x","mentions":"a"}"#,
                "mentions",
            ),
            (r#"{"type":"project.subscribe"}"#, "project_id"),
            (r#"{"type":"dance"}"#, "unknown message type \"dance\""),
        ] {
            let err = parse_client_frame(frame).unwrap_err();
            assert!(err.contains(says), "{frame}: {err}");
        }
    }
}
