//! One agent of any protocol behind one interface, for tests that run the same scenario
//! over every pair of protocols. Each `Peer` speaks only its own protocol, with the same
//! clients the per-protocol tests use, and reports what it sees in common terms (`Seen`).

use std::net::SocketAddr;

use agentbridge::Bridge;
use agentbridge::protocols::synapse::proto::{
    MessageType, SynapseMessage, TaskPayload, TaskResult, TaskStatus, TaskStatusUpdate,
};
use serde_json::{Value, json};

use super::grid::GridWs;
use super::skynet::{SkynetHttp, SkynetWs};
use super::synapse::{Clients, Stream, chat, clients, endpoint, task_request};
use super::tracker::{TrackerHttp, TrackerWs};
use super::{start_bridge, synapse};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Skynet,
    Tracker,
    Synapse,
    Grid,
}

impl Proto {
    /// The test side's peer of each protocol: the registry's list, in its order (a test
    /// checks that the two agree).
    pub const ALL: [Proto; 4] = [Proto::Skynet, Proto::Tracker, Proto::Synapse, Proto::Grid];

    /// The protocol's name in the registry and in `bridge.toml`.
    pub fn name(self) -> &'static str {
        match self {
            Proto::Skynet => "skynet",
            Proto::Tracker => "tracker",
            Proto::Synapse => "synapse",
            Proto::Grid => "grid",
        }
    }

    /// The registered protocol `name`'s test peer.
    pub fn named(name: &str) -> Proto {
        (Proto::ALL.into_iter().find(|p| p.name() == name)).unwrap_or_else(|| {
            panic!("protocol {name:?} is registered but has no test peer in tests/common/peers.rs")
        })
    }

    /// The section the tests' bridge runs this protocol with, on a free loopback port.
    pub fn section(self) -> &'static str {
        match self {
            Proto::Skynet => "listen = \"127.0.0.1:0\"",
            Proto::Tracker => super::TRACKER_SECTION,
            Proto::Synapse => {
                "listen = \"127.0.0.1:0\"\ncallback_backoff_ms = 20\nsync_timeout_ms = 5000"
            }
            Proto::Grid => {
                "listen = \"127.0.0.1:0\"\nexpiry_check_ms = 50\nscratchpad_poll_ms = 20"
            }
        }
    }

    /// The agent name a peer of this protocol goes by.
    pub fn agent(self) -> &'static str {
        match self {
            Proto::Skynet => "sky",
            // A member of the test Tracker config (chat_listen = mentions, task_listen = assigned).
            Proto::Tracker => "coder",
            Proto::Synapse => "syn",
            Proto::Grid => "executor",
        }
    }
}

/// A bridge with every endpoint on loopback.
pub struct Net {
    pub bridge: Bridge,
    pub skynet: SocketAddr,
    pub tracker: SocketAddr,
    pub synapse: SocketAddr,
    pub grid: SocketAddr,
}

impl Net {
    pub async fn start() -> Net {
        Net::on(start_bridge("").await)
    }

    /// The endpoints of a running bridge.
    pub fn on(bridge: Bridge) -> Net {
        Net {
            skynet: bridge.addr("skynet").unwrap(),
            tracker: bridge.addr("tracker").unwrap(),
            synapse: bridge.addr("synapse").unwrap(),
            grid: bridge.addr("grid").unwrap(),
            bridge,
        }
    }

    /// Connects the agent of `proto` (registering it where its protocol requires).
    pub async fn peer(&self, proto: Proto) -> Peer {
        self.named_peer(proto, proto.agent()).await
    }

    pub async fn named_peer(&self, proto: Proto, name: &str) -> Peer {
        let conn = match proto {
            Proto::Skynet => {
                let http = SkynetHttp::new(self.skynet);
                let card = http.agent(name).await;
                let (ws, _) = SkynetWs::join(self.skynet, &card).await;
                Conn::Skynet { ws, http }
            }
            Proto::Tracker => {
                let token = format!("tb-{name}");
                let (ws, ok) = TrackerWs::auth_subscribed(self.tracker, &token).await;
                Conn::Tracker {
                    ws,
                    http: TrackerHttp::new(self.tracker, &token),
                    lobby: ok["lobby_chat_id"].as_str().unwrap().to_owned(),
                }
            }
            Proto::Synapse => Conn::Synapse {
                stream: Stream::open(self.synapse, name).await,
                clients: Box::new(clients(self.synapse).await),
            },
            Proto::Grid => Conn::Grid {
                ws: GridWs::connect(self.grid, name, None).await.0,
            },
        };
        Peer {
            proto,
            name: name.to_owned(),
            conn,
        }
    }
}

/// What a message is, as its receiver's protocol shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum What {
    Chat,
    TaskAssigned,
    TaskProgress,
    TaskDone,
    Error,
}

/// A message as a peer received it, in common terms.
#[derive(Clone, Debug)]
pub struct Seen {
    pub what: What,
    /// The id the receiver's protocol shows (the id to reply to).
    pub id: String,
    /// The sender's agent name.
    pub from: String,
    pub text: String,
    /// The id this message answers, as the receiver's protocol shows it.
    pub reply_to: Option<String>,
    pub task_id: Option<String>,
    /// Milliseconds since the epoch, when the protocol shows one.
    pub timestamp: Option<i64>,
    /// The frame as it arrived, for messages on failure.
    pub raw: String,
}

/// A task as its assignee received it: what progress and the result must name.
#[derive(Clone, Debug)]
pub struct Assignment {
    pub task_id: String,
    /// The assignment's id as the assignee saw it.
    pub message_id: String,
    pub from: String,
}

pub struct Peer {
    pub proto: Proto,
    pub name: String,
    conn: Conn,
}

enum Conn {
    Skynet {
        ws: SkynetWs,
        http: SkynetHttp,
    },
    Tracker {
        ws: TrackerWs,
        http: TrackerHttp,
        lobby: String,
    },
    Synapse {
        stream: Stream,
        clients: Box<Clients>,
    },
    Grid {
        ws: GridWs,
    },
}

fn fresh_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A Grid message as its wire form (`{"message": …}`), stamped now.
pub fn grid_message(
    id: &str,
    msg_type: &str,
    from: &str,
    to: &str,
    action: &str,
    payload: Value,
    correlation_id: Option<&str>,
) -> String {
    let mut msg = json!({
        "id": id,
        "timestamp": agentbridge::shared::clock::iso8601(now_ms()),
        "type": msg_type,
        "sender": { "agent": from },
        "receiver": { "agent": to },
        "content": { "action": action, "payload": payload },
    });
    if let Some(c) = correlation_id {
        msg["correlation_id"] = json!(c);
    }
    json!({ "message": msg }).to_string()
}

pub fn now_ms() -> i64 {
    agentbridge::core::now_ms()
}

fn synapse_any(type_name: &str, message: &impl prost::Message) -> prost_types::Any {
    prost_types::Any {
        type_url: format!("type.googleapis.com/{type_name}"),
        value: message.encode_to_vec(),
    }
}

fn synapse_ms(msg: &SynapseMessage) -> Option<i64> {
    msg.timestamp
        .as_ref()
        .map(|t| t.seconds * 1000 + i64::from(t.nanos) / 1_000_000)
}

/// An RFC 3339 time → milliseconds since the epoch.
fn parse_iso(text: &str) -> Option<i64> {
    let at = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339);
    Some((at.ok()?.unix_timestamp_nanos() / 1_000_000) as i64)
}

impl Peer {
    /// Lets each read of this WebSocket peer wait up to `wait` (a test that rides out a
    /// NATS failover, which may take longer than `WAIT`).
    pub fn wait_up_to(&mut self, wait: std::time::Duration) {
        match &mut self.conn {
            Conn::Skynet { ws, .. } => ws.wait_up_to(wait),
            Conn::Grid { ws } => ws.wait_up_to(wait),
            Conn::Tracker { .. } | Conn::Synapse { .. } => {
                panic!("wait_up_to is for the Skynet and Grid peers")
            }
        }
    }

    /// Sends a chat to `to`, answering `reply_to` (an id as this peer saw it); returns the
    /// sent message's id as this peer knows it.
    pub async fn chat(&mut self, to: &str, text: &str, reply_to: Option<&str>) -> String {
        let name = self.name.clone();
        match &mut self.conn {
            Conn::Skynet { ws, http, .. } => {
                let id = fresh_id();
                let mut msg = json!({
                    "id": id, "type": "chat", "payload": { "text": text },
                    "mentions": [card_id(http, to).await],
                });
                if let Some(r) = reply_to {
                    msg["replyTo"] = json!(r);
                }
                ws.action("send", msg).await;
                // Skynet echoes a message to its sender first.
                let echo = ws.next_message().await;
                assert_eq!(echo["id"], json!(id), "the echo comes first: {echo}");
                id
            }
            Conn::Tracker { http, lobby, .. } => {
                let mut body = json!({ "chat_id": lobby, "content": text, "mentions": [to] });
                if let Some(r) = reply_to {
                    body["reply_to"] = json!(r);
                }
                let (status, msg) = http.post("/messages", body).await;
                assert_eq!(status, 201, "{msg}");
                msg["id"].as_str().unwrap().to_owned()
            }
            Conn::Synapse { clients, .. } => {
                let mut msg = chat(&name, to, text);
                msg.id = fresh_id();
                msg.reply_to = reply_to.unwrap_or_default().to_owned();
                synapse::send(clients, msg).await.expect("SendMessage")
            }
            Conn::Grid { ws } => {
                let id = fresh_id();
                let msg_type = if reply_to.is_some() {
                    "response"
                } else {
                    "notification"
                };
                ws.send(&grid_message(
                    &id,
                    msg_type,
                    &name,
                    to,
                    "message",
                    json!({ "text": text }),
                    reply_to,
                ))
                .await;
                id
            }
        }
    }

    /// Sends a chat to an agent no protocol knows and returns the error this peer's
    /// protocol answers with, as text.
    pub async fn chat_to_unknown(&mut self, to: &str) -> String {
        let name = self.name.clone();
        match &mut self.conn {
            Conn::Skynet { ws, .. } => {
                let msg =
                    json!({ "type": "chat", "payload": { "text": "anyone?" }, "mentions": [to] });
                ws.action("send", msg).await;
                // The error comes first, then the echo of what reached the known recipients.
                let error = ws.next_event("error").await;
                ws.next_message().await;
                error.to_string()
            }
            Conn::Tracker { http, lobby, .. } => {
                let body = json!({ "chat_id": lobby, "content": "anyone?", "mentions": [to] });
                let (status, answer) = http.post("/messages", body).await;
                assert_eq!(status, 422, "{answer}");
                answer.to_string()
            }
            Conn::Synapse { clients, .. } => {
                let status = synapse::send(clients, chat(&name, to, "anyone?"))
                    .await
                    .expect_err("an unknown receiver is refused");
                assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
                status.message().to_owned()
            }
            Conn::Grid { ws } => {
                let id = fresh_id();
                ws.send(&grid_message(
                    &id,
                    "notification",
                    &name,
                    to,
                    "message",
                    json!({ "text": "anyone?" }),
                    None,
                ))
                .await;
                loop {
                    let msg = ws.next().await;
                    if msg["type"] == "error" {
                        return msg.to_string();
                    }
                }
            }
        }
    }

    /// Assigns a new task to `to`; returns its id as this peer knows it, and the id of the
    /// message that assigned it (the Tracker assigns by creating the task: no message).
    pub async fn assign(&mut self, to: &str, title: &str) -> (String, Option<String>) {
        let name = self.name.clone();
        let task_id = fresh_id();
        let message_id = fresh_id();
        match &mut self.conn {
            Conn::Skynet { ws, http, .. } => {
                let card = card_id(http, to).await;
                ws.action(
                    "send",
                    json!({
                        "id": message_id, "type": "task.assign",
                        "payload": { "taskId": task_id, "title": title, "description": title, "assignee": card, "status": "assigned" },
                        "mentions": [card],
                    }),
                )
                .await;
                ws.next_message().await;
                (task_id, Some(message_id))
            }
            Conn::Tracker { http, .. } => {
                let (status, task) = http
                    .post(
                        "/tasks?project_slug=team-board",
                        json!({ "title": title, "assignee_slug": to }),
                    )
                    .await;
                assert_eq!(status, 201, "{task}");
                let id = task["id"].as_str().unwrap().to_owned();
                // The author follows its task by watching it (its task_listen is `assigned`).
                let (status, _) = http
                    .post(&format!("/tasks/{id}/watch?slug={name}"), json!({}))
                    .await;
                assert_eq!(status, 200);
                (id, None)
            }
            Conn::Synapse { clients, .. } => {
                let mut msg = task_request(&name, to, &task_id, title, title);
                msg.id = message_id.clone();
                synapse::send(clients, msg).await.expect("SendMessage");
                (task_id, Some(message_id))
            }
            Conn::Grid { ws } => {
                ws.send(&grid_message(
                    &message_id,
                    "request",
                    &name,
                    to,
                    "mission_assigned",
                    json!({ "task_id": task_id, "title": title }),
                    None,
                ))
                .await;
                (task_id, Some(message_id))
            }
        }
    }

    /// Reports progress on `task` to its assigner.
    pub async fn progress(&mut self, task: &Assignment, text: &str) {
        let name = self.name.clone();
        match &mut self.conn {
            Conn::Skynet { ws, http, .. } => {
                let card = card_id(http, &task.from).await;
                ws.action(
                    "send",
                    json!({
                        "type": "task.update", "replyTo": task.message_id,
                        "payload": { "taskId": task.task_id, "status": "in-progress", "metadata": { "message": text } },
                        "mentions": [card],
                    }),
                )
                .await;
                ws.next_message().await;
            }
            Conn::Tracker { http, .. } => {
                let (status, body) = http
                    .patch(
                        &format!("/tasks/{}", task.task_id),
                        json!({ "status": "in_progress" }),
                    )
                    .await;
                assert_eq!(status, 200, "{body}");
            }
            Conn::Synapse { clients, .. } => {
                let msg = SynapseMessage {
                    id: fresh_id(),
                    r#type: MessageType::P2pStatusUpdate as i32,
                    sender: endpoint(&name),
                    receiver: endpoint(&task.from),
                    reply_to: task.message_id.clone(),
                    payload: Some(synapse_any(
                        "synapse.TaskStatusUpdate",
                        &TaskStatusUpdate {
                            task_id: task.task_id.clone(),
                            status: TaskStatus::Processing as i32,
                            progress: 50,
                            message: text.into(),
                            details: None,
                        },
                    )),
                    ..Default::default()
                };
                synapse::send(clients, msg).await.expect("SendMessage");
            }
            Conn::Grid { ws } => {
                ws.send(&grid_message(
                    &fresh_id(),
                    "notification",
                    &name,
                    &task.from,
                    "progress_update",
                    json!({ "task_id": task.task_id, "percent": 50, "status": text }),
                    Some(&task.message_id),
                ))
                .await;
            }
        }
    }

    /// Reports `task` done, summarised by `summary`.
    pub async fn complete(&mut self, task: &Assignment, summary: &str) {
        let name = self.name.clone();
        match &mut self.conn {
            Conn::Skynet { ws, http, .. } => {
                let card = card_id(http, &task.from).await;
                ws.action(
                    "send",
                    json!({
                        "type": "task.result", "replyTo": task.message_id,
                        "payload": { "taskId": task.task_id, "success": true, "summary": summary },
                        "mentions": [card],
                    }),
                )
                .await;
                ws.next_message().await;
            }
            Conn::Tracker { http, .. } => {
                let (status, body) = http
                    .post(
                        "/messages",
                        json!({ "task_id": task.task_id, "content": summary }),
                    )
                    .await;
                assert_eq!(status, 201, "{body}");
                let (status, body) = http
                    .patch(
                        &format!("/tasks/{}", task.task_id),
                        json!({ "status": "done" }),
                    )
                    .await;
                assert_eq!(status, 200, "{body}");
            }
            Conn::Synapse { clients, .. } => {
                let msg = SynapseMessage {
                    id: fresh_id(),
                    r#type: MessageType::P2pTaskComplete as i32,
                    sender: endpoint(&name),
                    receiver: endpoint(&task.from),
                    reply_to: task.message_id.clone(),
                    payload: Some(synapse_any(
                        "synapse.TaskResult",
                        &TaskResult {
                            task_id: task.task_id.clone(),
                            task_type: String::new(),
                            result: None,
                            summary: summary.into(),
                        },
                    )),
                    ..Default::default()
                };
                synapse::send(clients, msg).await.expect("SendMessage");
            }
            Conn::Grid { ws } => {
                ws.send(&grid_message(
                    &fresh_id(),
                    "response",
                    &name,
                    &task.from,
                    "task_complete",
                    json!({ "task_id": task.task_id, "summary": summary }),
                    Some(&task.message_id),
                ))
                .await;
            }
        }
    }

    /// The next message of kind `what`, skipping presence and the frames a protocol sends
    /// around it (a Tracker comment next to a status change, a Synapse ack).
    pub async fn next(&mut self, what: What) -> Seen {
        loop {
            if let Some(seen) = self.next_any().await
                && seen.what == what
            {
                return seen;
            }
        }
    }

    /// The next message of any kind this module understands; `None` for frames it skips.
    pub async fn next_any(&mut self) -> Option<Seen> {
        match &mut self.conn {
            Conn::Skynet { ws, http, .. } => {
                let frame = ws.next().await;
                if frame["event"] == "error" {
                    return Some(Seen {
                        what: What::Error,
                        id: String::new(),
                        from: String::new(),
                        text: frame["data"]["message"].as_str().unwrap_or("").to_owned(),
                        reply_to: None,
                        task_id: None,
                        timestamp: None,
                        raw: frame.to_string(),
                    });
                }
                if frame.get("event").is_some() {
                    return None;
                }
                let what = match frame["type"].as_str()? {
                    "chat" => What::Chat,
                    "task.assign" => What::TaskAssigned,
                    "task.update" => What::TaskProgress,
                    "task.result" => What::TaskDone,
                    _ => return None,
                };
                let payload = &frame["payload"];
                let text = match what {
                    What::Chat => payload["text"].as_str(),
                    What::TaskAssigned => payload["title"].as_str(),
                    What::TaskProgress => payload["metadata"]["message"].as_str(),
                    _ => payload["summary"].as_str(),
                };
                Some(Seen {
                    what,
                    id: frame["id"].as_str().unwrap_or_default().to_owned(),
                    from: name_of_card(http, frame["from"].as_str().unwrap_or_default()).await,
                    text: text.unwrap_or_default().to_owned(),
                    reply_to: frame["replyTo"].as_str().map(str::to_owned),
                    task_id: payload["taskId"].as_str().map(str::to_owned),
                    timestamp: frame["timestamp"].as_i64(),
                    raw: frame.to_string(),
                })
            }
            Conn::Tracker { ws, .. } => {
                let frame = ws.next().await;
                let data = &frame["data"];
                let (what, id, from, text, task_id, created) = match frame["type"].as_str()? {
                    "message.new" => (
                        What::Chat,
                        &data["id"],
                        &data["author_slug"],
                        &data["content"],
                        &data["task_id"],
                        &data["created_at"],
                    ),
                    "task.assigned" => (
                        What::TaskAssigned,
                        &data["id"],
                        &data["author_slug"],
                        &data["title"],
                        &data["id"],
                        &data["updated_at"],
                    ),
                    "task.updated" => {
                        let what = match data["status"].as_str() {
                            Some("in_progress") => What::TaskProgress,
                            Some("done") => What::TaskDone,
                            _ => return None,
                        };
                        (
                            what,
                            &data["id"],
                            &data["author_slug"],
                            &data["status"],
                            &data["id"],
                            &data["updated_at"],
                        )
                    }
                    "error" => {
                        return Some(Seen {
                            what: What::Error,
                            id: String::new(),
                            from: String::new(),
                            text: frame["message"].as_str().unwrap_or("").to_owned(),
                            reply_to: None,
                            task_id: None,
                            timestamp: None,
                            raw: frame.to_string(),
                        });
                    }
                    _ => return None,
                };
                Some(Seen {
                    what,
                    id: id.as_str().unwrap_or_default().to_owned(),
                    from: from.as_str().unwrap_or_default().to_owned(),
                    text: text.as_str().unwrap_or_default().to_owned(),
                    reply_to: data["reply_to"].as_str().map(str::to_owned),
                    task_id: task_id.as_str().map(str::to_owned),
                    timestamp: created.as_str().and_then(parse_iso),
                    raw: frame.to_string(),
                })
            }
            Conn::Synapse { stream, .. } => {
                let msg = stream.next().await;
                let kind = MessageType::try_from(msg.r#type).unwrap_or(MessageType::Unspecified);
                let (what, text, task_id) = match kind {
                    MessageType::Unspecified => (What::Chat, synapse::text_of(&msg), None),
                    MessageType::P2pTaskRequest => {
                        let p: TaskPayload = synapse::unpack(&msg);
                        (What::TaskAssigned, p.task_type, Some(p.task_id))
                    }
                    MessageType::P2pStatusUpdate => {
                        let u: TaskStatusUpdate = synapse::unpack(&msg);
                        (What::TaskProgress, u.message, Some(u.task_id))
                    }
                    MessageType::P2pTaskComplete => {
                        let r: TaskResult = synapse::unpack(&msg);
                        (What::TaskDone, r.summary, Some(r.task_id))
                    }
                    MessageType::P2pNack => (What::Error, format!("{msg:?}"), None),
                    _ => return None,
                };
                Some(Seen {
                    what,
                    id: msg.id.clone(),
                    from: msg
                        .sender
                        .as_ref()
                        .map(|s| s.agent_id.clone())
                        .unwrap_or_default(),
                    text,
                    reply_to: Some(msg.reply_to.clone()).filter(|r| !r.is_empty()),
                    task_id,
                    timestamp: synapse_ms(&msg),
                    raw: format!("{msg:?}"),
                })
            }
            Conn::Grid { ws } => {
                let msg = ws.next().await;
                let payload = &msg["content"]["payload"];
                let (what, text) = match (
                    msg["type"].as_str()?,
                    msg["content"]["action"].as_str().unwrap_or(""),
                ) {
                    ("error", _) => (What::Error, &payload["error_message"]),
                    (_, "agent_online" | "agent_offline" | "agents_present") => return None,
                    (_, "mission_assigned") => (What::TaskAssigned, &payload["title"]),
                    (_, "progress_update") => (What::TaskProgress, &payload["status"]),
                    (_, "task_complete") => (What::TaskDone, &payload["summary"]),
                    _ => (What::Chat, &payload["text"]),
                };
                Some(Seen {
                    what,
                    id: msg["id"].as_str().unwrap_or_default().to_owned(),
                    from: msg["sender"]["agent"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    text: text.as_str().unwrap_or_default().to_owned(),
                    reply_to: msg["correlation_id"].as_str().map(str::to_owned),
                    task_id: payload["task_id"].as_str().map(str::to_owned),
                    timestamp: msg["timestamp"].as_str().and_then(parse_iso),
                    raw: msg.to_string(),
                })
            }
        }
    }

    /// The Tracker's lobby chat id, for a Tracker peer.
    pub fn lobby(&self) -> Option<&str> {
        match &self.conn {
            Conn::Tracker { lobby, .. } => Some(lobby),
            _ => None,
        }
    }

    /// The task this peer was just assigned, and who assigned it.
    pub async fn next_assignment(&mut self) -> Assignment {
        let seen = self.next(What::TaskAssigned).await;
        Assignment {
            task_id: seen.task_id.clone().expect("an assignment names its task"),
            message_id: seen.id.clone(),
            from: seen.from.clone(),
        }
    }
}

/// The card id a Skynet client uses for `name` (a Skynet agent or a peer of another protocol).
async fn card_id(http: &SkynetHttp, name: &str) -> String {
    let (_, members) = http.get("/api/members").await;
    members
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .and_then(|m| m["id"].as_str())
        .unwrap_or_else(|| panic!("no Skynet member {name} in {members}"))
        .to_owned()
}

async fn name_of_card(http: &SkynetHttp, id: &str) -> String {
    let (_, members) = http.get("/api/members").await;
    members
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == id)
        .and_then(|m| m["name"].as_str())
        .unwrap_or(id)
        .to_owned()
}
