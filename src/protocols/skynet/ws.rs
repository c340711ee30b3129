//! One Skynet WebSocket connection, on the shared session loop (`protocols::session`):
//! client actions in, routed messages out.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::translate;
use super::wire::{self, ClientFrame, FrameError, JoinRequest, SentMessage};
use super::workspace::Joined;
use super::{PROTOCOL, Skynet};
use crate::core::{Closed, Delivery, Envelope, Mailbox, NameTaken, now_ms};
use crate::core::{LogError, MessageQuery};
use crate::protocols::endpoint::{Decoded, Translation};
use crate::protocols::session::{self, Flow, Io, WsSession};
use crate::shared::websocket::{Message, Refusal, Socket, Utf8Bytes};
use crate::telemetry;

/// Humans replay up to this many recent messages on join.
const HUMAN_REPLAY: usize = 100;

/// With each sent message being stored, the mentions it could not resolve.
type Unresolved = Vec<String>;

struct Connection {
    id: u64,
    skynet: Arc<Skynet>,
    joined: Option<Joined>,
    /// Until the socket first joins, when it must have.
    join_by: Option<Instant>,
    /// Ids shown in the join's replay. The session is attached before the replay is read,
    /// so a message stored in between arrives live too; it is shown once.
    replayed: HashSet<String>,
}

pub fn serve(socket: Socket, skynet: Arc<Skynet>) -> impl Future<Output = ()> + Send {
    let conn = Connection {
        id: skynet.workspace.next_conn_id(),
        skynet: skynet.clone(),
        joined: None,
        join_by: Some(Instant::now() + Duration::from_millis(skynet.config.join_timeout_ms)),
        replayed: HashSet::new(),
    };
    session::run(conn, socket, skynet.shutdown.clone())
}

impl WsSession for Connection {
    const PROTOCOL: crate::core::Protocol = PROTOCOL;
    type Pending = Unresolved;

    fn mailbox(&self) -> Option<&Arc<Mailbox>> {
        self.joined.as_ref().map(|j| &j.session.mailbox)
    }

    fn error_frame(&self, text: &str) -> String {
        wire::error_event(text, None)
    }

    /// Skynet's clients match `Invalid message format` for a frame they cannot read.
    fn refusal_frame(&self, refusal: &Refusal) -> String {
        match refusal {
            Refusal::NotUtf8 => {
                wire::error_event(wire::ERR_INVALID_FORMAT, Some(&refusal.to_string()))
            }
            _ => self.error_frame(&refusal.to_string()),
        }
    }

    async fn on_frame(&mut self, io: &mut Io<Unresolved>, message: Message) -> Flow {
        self.handle_frame(io, message).await
    }

    async fn on_stored(
        &mut self,
        io: &mut Io<Unresolved>,
        stored: Result<Envelope, LogError>,
        unknown: Unresolved,
    ) -> Flow {
        match self.routed(stored, unknown) {
            Some(event) => io.send(event).await,
            None => Flow::Continue,
        }
    }

    async fn settle(&mut self, stored: Result<Envelope, LogError>, _: Unresolved) {
        if let Ok(env) = stored {
            self.skynet.core.route(env);
        }
    }

    fn frame(&mut self, delivery: &Arc<Delivery>) -> Option<Utf8Bytes> {
        if !self.replayed.is_empty() && self.replayed.remove(&delivery.envelope.id) {
            // Shown in the join's replay already.
            delivery.written_to(PROTOCOL);
            return None;
        }
        let skynet = &self.skynet;
        delivery.encoded(PROTOCOL, |env| skynet.encode_text(env).map(Utf8Bytes::from))
    }

    async fn on_closed(&mut self, io: &mut Io<Unresolved>, reason: Closed) -> Flow {
        match reason {
            Closed::Replaced => {
                // The membership moved to a newer socket: no leave for this one.
                self.joined = None;
                io.close(wire::WS_CLOSE_REPLACED, "replaced").await
            }
            Closed::Gone => {
                self.joined = None;
                Flow::Continue
            }
            Closed::NameTaken => {
                // The fleet gave the name to the agent another bridge holds under it.
                let Some(joined) = self.joined.take() else {
                    return Flow::Close;
                };
                self.skynet.lost_name(&joined.agent_id, self.id);
                if let Some(taken) = self.skynet.core.directory.holder(&joined.name) {
                    let text = refusal_text(&joined.name, &taken);
                    let _ = io.send(wire::error_event(&text, None)).await;
                }
                io.close(1000, "").await
            }
            Closed::Overflow | Closed::Shutdown => Flow::Close,
        }
    }

    fn deadline(&self) -> Option<Instant> {
        self.join_by
    }

    async fn on_deadline(&mut self, io: &mut Io<Unresolved>) -> Flow {
        let timeout = Duration::from_millis(self.skynet.config.join_timeout_ms);
        let text = format!(
            "Join timeout: send {{\"action\":\"join\"}} within {} s",
            timeout.as_secs_f64()
        );
        let _ = io.send(wire::error_event(&text, None)).await;
        io.close(1008, "join timeout").await
    }

    async fn finish(mut self) {
        if let Some(joined) = self.joined.take() {
            self.skynet.disconnected(&joined.agent_id, self.id);
        }
    }
}

impl Connection {
    async fn handle_frame(&mut self, io: &mut Io<Unresolved>, message: Message) -> Flow {
        let text = match &message {
            Message::Text(text) => text.as_str(),
            // Skynet's server reads binary frames as text too.
            Message::Binary(bytes) => match std::str::from_utf8(bytes) {
                Ok(text) => text,
                Err(_) => {
                    return (self
                        .refuse(io, FrameError::Invalid("frame is not UTF-8 text".into())))
                    .await;
                }
            },
            Message::Close(_) => return Flow::Close,
            Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => return Flow::Continue,
        };
        match wire::parse_client_frame(text) {
            Ok(ClientFrame::Send(msg)) => self.on_send(io, msg).await,
            // The rest boxed: inline, a join's, a leave's or a heartbeat's future (each
            // kilobytes) would size every frame's, which the connection boxes and so
            // copies whole, once a frame.
            Ok(ClientFrame::Join(request)) => Box::pin(self.on_join(io, request)).await,
            Ok(ClientFrame::Leave) => {
                if let Some(joined) = self.joined.take() {
                    Box::pin(self.skynet.leave(&joined.agent_id)).await;
                }
                Flow::Continue
            }
            Ok(ClientFrame::Heartbeat { status }) => Box::pin(self.on_heartbeat(io, status)).await,
            // As Skynet's server does: a send before join is refused for that, whatever its shape.
            Err(FrameError::Invalid(_))
                if self.joined.is_none() && wire::action_of(text).as_deref() == Some("send") =>
            {
                io.send(wire::error_event(wire::ERR_NOT_CONNECTED, None))
                    .await
            }
            Err(e) => self.refuse(io, e).await,
        }
    }

    async fn refuse(&mut self, io: &mut Io<Unresolved>, error: FrameError) -> Flow {
        telemetry::decode_error(PROTOCOL);
        let event = match &error {
            FrameError::Invalid(detail) => {
                wire::error_event(wire::ERR_INVALID_FORMAT, Some(detail))
            }
            FrameError::UnknownAction(action) => {
                wire::error_event(&format!("Unknown action: {action}"), None)
            }
        };
        io.send(event).await
    }

    async fn on_join(&mut self, io: &mut Io<Unresolved>, request: JoinRequest) -> Flow {
        let skynet = self.skynet.clone();
        let unknown = match request.human {
            true => wire::ERR_UNKNOWN_HUMAN,
            false => wire::ERR_UNKNOWN_AGENT,
        };
        let profile = skynet
            .registry
            .by_id(&request.id)
            .filter(|p| p.is_human() == request.human);
        let Some(profile) = profile else {
            tracing::info!(id = %request.id, "skynet: refused an unregistered join");
            let _ = io.send(wire::error_event(unknown, None)).await;
            return io.close(1000, "").await;
        };
        // In a fleet, the agent may have been held by another bridge last: its name comes
        // here with it, unless it is online there.
        if skynet.core.in_fleet() {
            skynet.forget_member_held_elsewhere(&profile);
        }
        if skynet.core.in_fleet()
            && let Err(taken) = skynet.core.move_here(profile.directory_entry()).await
        {
            tracing::info!(id = %request.id, reason = %taken, "skynet: refused a join held elsewhere");
            let text = refusal_text(&profile.name, &taken);
            let _ = io.send(wire::error_event(&text, None)).await;
            return io.close(1000, "").await;
        }
        // Deleted while its name came here: the move registered it again, and it goes.
        if skynet.core.in_fleet() && skynet.registry.by_id(&profile.id).is_none() {
            let moved_here = (skynet.core.directory.get(&profile.name))
                .is_some_and(|a| a.native_id == profile.id && a.bridge.is_none());
            if moved_here {
                skynet.core.unregister(&profile.name, PROTOCOL);
            }
            let _ = io.send(wire::error_event(unknown, None)).await;
            return io.close(1000, "").await;
        }
        // The same socket joining as someone else leaves its old membership behind.
        if let Some(previous) = self.joined.take()
            && previous.agent_id != profile.id
        {
            skynet.disconnected(&previous.agent_id, self.id);
        }
        let joined = skynet.join(self.id, &profile, request.card);
        // The replay is read before the join is stored (it is not part of its own history),
        // and the join is announced before the joiner hears back, as Skynet's server does:
        // whoever joins after this one never sees its `agent.join` live.
        let (recent, replayed) = replay(&skynet, &joined, request.last_seen).await;
        self.replayed = replayed;
        if joined.is_new {
            skynet.announce_join(&joined).await;
        }
        #[derive(serde::Serialize)]
        struct WorkspaceState {
            members: Vec<Value>,
            #[serde(rename = "recentMessages")]
            recent_messages: Vec<Box<RawValue>>,
        }
        let frame = wire::event(
            wire::EVENT_WORKSPACE_STATE,
            WorkspaceState {
                members: skynet.member_cards(),
                recent_messages: recent,
            },
        );
        tracing::info!(agent = %joined.name, reconnect = !joined.is_new, "skynet: joined");
        self.joined = Some(joined);
        self.join_by = None;
        io.send(frame).await
    }

    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps its argument twice in its state"
    )]
    fn on_send(
        &mut self,
        io: &mut Io<Unresolved>,
        mut msg: SentMessage<'_>,
    ) -> impl Future<Output = Flow> {
        // A block, not an `async fn`, which would hold the message twice (its argument
        // and the local it moves it into) in every frame's future.
        async move {
            let Some(joined) = &self.joined else {
                return io
                    .send(wire::error_event(wire::ERR_NOT_CONNECTED, None))
                    .await;
            };
            if let Some(error) = msg.oversized_attachment() {
                telemetry::decode_error(PROTOCOL);
                return io.send(wire::error_event(&error, None)).await;
            }
            // Bounded before any mention is looked up, and again once the text's are in.
            let max = self.skynet.config.max_mentions;
            if msg.mentions.len() > max {
                return self.too_many_mentions(io, msg.mentions.len()).await;
            }
            msg.stamp(&joined.agent_id);
            let skynet = self.skynet.clone();
            msg.enrich_mentions(&joined.agent_id, || skynet.mention_candidates());
            if msg.mentions.len() > max {
                return self.too_many_mentions(io, msg.mentions.len()).await;
            }
            let sent = translate::Sent {
                message: msg,
                sender: &joined.name,
            };
            let Ok(Decoded {
                envelope: env,
                unresolved: unknown,
            }) = translate::Translator::decode(skynet.as_ref(), sent);
            let staged = skynet.core.stage(env).await;
            io.pending.push(staged, unknown);
            Flow::Continue
        }
    }

    async fn too_many_mentions(&self, io: &mut Io<Unresolved>, count: usize) -> Flow {
        telemetry::decode_error(PROTOCOL);
        let limit = self.skynet.config.max_mentions;
        let text = format!("Too many mentions: {count}; the limit is {limit}");
        io.send(wire::error_event(&text, None)).await
    }

    /// A sent message is durable (or could not be stored): it is routed, the sender's echo
    /// first. The error event the sender is to hear, if any: that it was not stored, or
    /// which mentions it could not resolve.
    fn routed(&self, stored: Result<Envelope, LogError>, unknown: Unresolved) -> Option<String> {
        if let Err(e) = stored.map(|env| self.skynet.core.route(env)) {
            tracing::error!(error = %e, "skynet: cannot store a message");
            return Some(wire::error_event(
                &e.tell_sender("Message could not be stored; it was not delivered"),
                None,
            ));
        }
        // Delivered to whom it could be; the sender hears who it could not reach.
        (!unknown.is_empty()).then(|| {
            let text = format!("Unknown recipient: {}", crate::shared::text::a_few(&unknown));
            let detail = "no member of this workspace, and no agent of another protocol, has that id; the message reached its other recipients";
            wire::error_event(&text, Some(detail))
        })
    }

    async fn on_heartbeat(&mut self, io: &mut Io<Unresolved>, status: Option<String>) -> Flow {
        // Skynet's server ignores a heartbeat before join: no ack, no error.
        let Some(joined) = &self.joined else {
            return Flow::Continue;
        };
        let (id, name) = (joined.agent_id.clone(), joined.name.clone());
        self.skynet.heartbeat(&id, &name, status).await;
        io.send(wire::event(
            wire::EVENT_HEARTBEAT_ACK,
            json!({ "timestamp": now_ms() }),
        ))
        .await
    }
}

/// The messages a (re)joining member is shown, as Skynet messages, and their ids.
async fn replay(
    skynet: &Skynet,
    joined: &Joined,
    since: Option<i64>,
) -> (Vec<Box<RawValue>>, HashSet<String>) {
    let query = if joined.human {
        MessageQuery {
            after: since,
            limit: HUMAN_REPLAY,
            public_only: true,
            ..Default::default()
        }
    } else {
        MessageQuery {
            after: since,
            recipients: Some(vec![joined.name.clone()]),
            or_everyone: true,
            limit: skynet.config.recent_mentions_limit,
            ..Default::default()
        }
    };
    match skynet.core.log.read(query).await {
        Ok(stored) => stored
            .iter()
            .filter_map(|m| Some((skynet.encode_raw(&m.envelope)?, m.envelope.id.clone())))
            .unzip(),
        Err(e) => {
            tracing::error!(error = %e, "skynet: cannot read replay");
            (Vec::new(), HashSet::new())
        }
    }
}

/// Why agent `name` cannot be held here: the same agent online through another bridge, or
/// another agent's name.
fn refusal_text(name: &str, taken: &NameTaken) -> String {
    match taken.holder_protocol == PROTOCOL {
        true => format!(
            "{name} is connected{}; disconnect it there first",
            taken.on_bridge()
        ),
        false => taken.to_string(),
    }
}
