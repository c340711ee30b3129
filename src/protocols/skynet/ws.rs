//! One Skynet WebSocket connection: client actions in, routed messages out.
//!
//! A single task owns the socket and serves, in order, shutdown, the client's frames and
//! the member's mailbox. Handling a frame to the end before taking the next mailbox item is
//! what puts `workspace.state` on the wire before anything routed to a new member.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::translate;
use super::wire::{self, ClientFrame, FrameError, JoinRequest, SentMessage};
use super::workspace::Joined;
use super::{PROTOCOL, Skynet};
use crate::core::{Closed, Delivery, Envelope, InFlight, Mailbox, now_ms};
use crate::core::{LogError, MessageQuery};
use crate::protocols::endpoint::{Decoded, Translation};
use crate::shared::websocket::{self, Message, Socket, Utf8Bytes};
use crate::telemetry::{self, ConnectionGuard};

/// Routed messages written per flush, so a backlog drains in few syscalls.
const WRITE_BATCH: usize = 64;
/// Humans replay up to this many recent messages on join.
const HUMAN_REPLAY: usize = 100;

enum Flow {
    Continue,
    Close,
}

struct Connection {
    id: u64,
    socket: Socket,
    skynet: Arc<Skynet>,
    joined: Option<Joined>,
    /// Ids shown in the join's replay. The session is attached before the replay is read,
    /// so a message stored in between arrives live too; it is shown once.
    replayed: HashSet<String>,
    /// Sent messages being stored, routed in the order they were sent once durable.
    /// With each, the mentions it could not resolve.
    pending: InFlight<Vec<String>>,
}

pub async fn serve(socket: Socket, skynet: Arc<Skynet>) {
    let _counted = ConnectionGuard::new(PROTOCOL);
    let mut conn = Connection {
        id: skynet.workspace.next_conn_id(),
        socket,
        skynet: skynet.clone(),
        joined: None,
        replayed: HashSet::new(),
        pending: InFlight::new(),
    };
    let shutdown = skynet.shutdown.clone();
    // Made once: a `cancelled()` made afresh each turn of the loop registered with the
    // token and left it again, under its lock, for every frame and delivery.
    let mut shutting_down = std::pin::pin!(shutdown.cancelled());
    let join_timeout = Duration::from_millis(skynet.config.join_timeout_ms);
    let mut join_deadline = std::pin::pin!(tokio::time::sleep(join_timeout));
    let mut ever_joined = false;
    loop {
        ever_joined |= conn.joined.is_some();
        let mailbox = conn.joined.as_ref().map(|j| j.session.mailbox.clone());
        tokio::select! {
            biased;
            _ = &mut shutting_down => {
                conn.close(1001, "server shutting down").await;
                break;
            }
            Some((stored, unknown)) = conn.pending.next(), if !conn.pending.is_empty() => {
                // Not boxed, unlike the other handlers: routing is synchronous, and only
                // the rare error is written back.
                if let Some(event) = conn.on_stored(stored, unknown)
                    && let Flow::Close = conn.send_event(event).await
                {
                    break;
                }
            }
            _ = &mut join_deadline, if !ever_joined => {
                let text = format!(
                    "Join timeout: send {{\"action\":\"join\"}} within {} s",
                    join_timeout.as_secs_f64()
                );
                let _ = conn.send_event(wire::error_event(&text, None)).await;
                conn.close(1008, "join timeout").await;
                break;
            }
            frame = conn.socket.recv(), if conn.pending.has_room() => {
                let flow = match frame {
                    Some(Ok(message)) => Box::pin(conn.on_frame(message)).await,
                    Some(Err(refused)) => Box::pin(conn.on_refused(refused)).await,
                    None => Flow::Close,
                };
                if let Flow::Close = flow {
                    break;
                }
            }
            next = next_delivery(mailbox.as_deref()) => {
                match next {
                    Ok(first) => {
                        if Box::pin(conn.write_deliveries(first, mailbox.as_deref())).await.is_err() {
                            break;
                        }
                    }
                    Err(Closed::Replaced) => {
                        // The membership moved to a newer socket: no leave for this one.
                        conn.joined = None;
                        conn.close(wire::WS_CLOSE_REPLACED, "replaced").await;
                        break;
                    }
                    Err(Closed::Overflow) => {
                        conn.close(1008, crate::shared::websocket::BEHIND_REASON).await;
                        break;
                    }
                    Err(Closed::Gone) => conn.joined = None,
                    Err(Closed::Shutdown) => break,
                }
            }
        }
    }
    // What was sent before the socket went is delivered all the same.
    while let Some((stored, _)) = conn.pending.next().await {
        if let Ok(env) = stored {
            skynet.core.route(env);
        }
    }
    if let Some(joined) = conn.joined.take() {
        skynet.disconnected(&joined.agent_id, conn.id);
    }
}

async fn next_delivery(mailbox: Option<&Mailbox>) -> Result<Arc<Delivery>, Closed> {
    match mailbox {
        Some(mailbox) => mailbox.recv().await,
        None => std::future::pending().await,
    }
}

impl Connection {
    async fn on_frame(&mut self, message: Message) -> Flow {
        let text = match &message {
            Message::Text(text) => text.as_str(),
            // Skynet's server reads binary frames as text too.
            Message::Binary(bytes) => match std::str::from_utf8(bytes) {
                Ok(text) => text,
                Err(_) => {
                    return self
                        .refuse(FrameError::Invalid("frame is not UTF-8 text".into()))
                        .await;
                }
            },
            Message::Close(_) => return Flow::Close,
            Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => return Flow::Continue,
        };
        match wire::parse_client_frame(text) {
            Ok(ClientFrame::Send(msg)) => self.on_send(msg).await,
            // The rest boxed: inline, a join's future (3.7 KB), a leave's (2.6 KB) or a
            // heartbeat's (1.4 KB) sized every frame's, which the connection boxes and so
            // copies whole, once a frame.
            Ok(ClientFrame::Join(request)) => Box::pin(self.on_join(request)).await,
            Ok(ClientFrame::Leave) => {
                if let Some(joined) = self.joined.take() {
                    Box::pin(self.skynet.leave(&joined.agent_id)).await;
                }
                Flow::Continue
            }
            Ok(ClientFrame::Heartbeat { status }) => Box::pin(self.on_heartbeat(status)).await,
            // As Skynet's server does: a send before join is refused for that, whatever its shape.
            Err(FrameError::Invalid(_))
                if self.joined.is_none() && wire::action_of(text).as_deref() == Some("send") =>
            {
                self.send_event(wire::error_event(wire::ERR_NOT_CONNECTED, None))
                    .await
            }
            Err(e) => self.refuse(e).await,
        }
    }

    /// A message the socket would not take (too large, over the bridge's read budget, not
    /// UTF-8): an `error` event, and the RFC 6455 close when the socket cannot go on.
    async fn on_refused(&mut self, refused: websocket::Refused) -> Flow {
        telemetry::decode_error(PROTOCOL);
        let event = match refused.refusal {
            websocket::Refusal::NotUtf8 => {
                wire::error_event(wire::ERR_INVALID_FORMAT, Some(&refused.refusal.to_string()))
            }
            _ => wire::error_event(&refused.refusal.to_string(), None),
        };
        if let Flow::Close = self.send_event(event).await {
            return Flow::Close;
        }
        if refused.fatal {
            let refusal = &refused.refusal;
            self.close(refusal.close_code(), refusal.close_reason())
                .await;
            return Flow::Close;
        }
        Flow::Continue
    }

    async fn refuse(&mut self, error: FrameError) -> Flow {
        telemetry::decode_error(PROTOCOL);
        let event = match &error {
            FrameError::Invalid(detail) => {
                wire::error_event(wire::ERR_INVALID_FORMAT, Some(detail))
            }
            FrameError::UnknownAction(action) => {
                wire::error_event(&format!("Unknown action: {action}"), None)
            }
        };
        self.send_event(event).await
    }

    async fn on_join(&mut self, request: JoinRequest) -> Flow {
        let skynet = self.skynet.clone();
        let profile = skynet
            .registry
            .by_id(&request.id)
            .filter(|p| p.is_human() == request.human);
        let Some(profile) = profile else {
            tracing::info!(id = %request.id, "skynet: refused an unregistered join");
            let text = if request.human {
                wire::ERR_UNKNOWN_HUMAN
            } else {
                wire::ERR_UNKNOWN_AGENT
            };
            let _ = self.send_event(wire::error_event(text, None)).await;
            self.close(1000, "").await;
            return Flow::Close;
        };
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
        if let Flow::Close = self.send_event(frame).await {
            return Flow::Close;
        }
        Flow::Continue
    }

    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps its argument twice in its state"
    )]
    fn on_send(&mut self, mut msg: SentMessage<'_>) -> impl Future<Output = Flow> {
        // A block, not an `async fn`, which would hold the message twice (its argument
        // and the local it moves it into) in every frame's future.
        async move {
            let Some(joined) = &self.joined else {
                return self
                    .send_event(wire::error_event(wire::ERR_NOT_CONNECTED, None))
                    .await;
            };
            if let Some(error) = msg.oversized_attachment() {
                telemetry::decode_error(PROTOCOL);
                return self.send_event(wire::error_event(&error, None)).await;
            }
            // Bounded before any mention is looked up, and again once the text's are in.
            let max = self.skynet.config.max_mentions;
            if msg.mentions.len() > max {
                return self.too_many_mentions(msg.mentions.len()).await;
            }
            msg.stamp(&joined.agent_id);
            let skynet = self.skynet.clone();
            msg.enrich_mentions(&joined.agent_id, || skynet.mention_candidates());
            if msg.mentions.len() > max {
                return self.too_many_mentions(msg.mentions.len()).await;
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
            self.pending.push(staged, unknown);
            Flow::Continue
        }
    }

    async fn too_many_mentions(&mut self, count: usize) -> Flow {
        telemetry::decode_error(PROTOCOL);
        let limit = self.skynet.config.max_mentions;
        let text = format!("Too many mentions: {count}; the limit is {limit}");
        self.send_event(wire::error_event(&text, None)).await
    }

    /// A sent message is durable (or could not be stored): it is routed, the sender's echo
    /// first. The error event the sender is to hear, if any: that it was not stored, or
    /// which mentions it could not resolve.
    fn on_stored(
        &self,
        stored: Result<Envelope, LogError>,
        unknown: Vec<String>,
    ) -> Option<String> {
        if let Err(e) = stored.map(|env| self.skynet.core.route(env)) {
            tracing::error!(error = %e, "skynet: cannot store a message");
            return Some(wire::error_event(
                "Message could not be stored; it was not delivered",
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

    async fn on_heartbeat(&mut self, status: Option<String>) -> Flow {
        // Skynet's server ignores a heartbeat before join: no ack, no error.
        let Some(joined) = &self.joined else {
            return Flow::Continue;
        };
        let (id, name) = (joined.agent_id.clone(), joined.name.clone());
        self.skynet.heartbeat(&id, &name, status).await;
        self.send_event(wire::event(
            wire::EVENT_HEARTBEAT_ACK,
            json!({ "timestamp": now_ms() }),
        ))
        .await
    }

    /// Writes `first` and whatever else is already queued, then flushes once.
    async fn write_deliveries(
        &mut self,
        first: Arc<Delivery>,
        mailbox: Option<&Mailbox>,
    ) -> Result<(), websocket::Error> {
        let mut next = Some(first);
        let mut written = 0;
        while let Some(delivery) = next.take() {
            if !self.replayed.is_empty() && self.replayed.remove(&delivery.envelope.id) {
                delivery.written_to(PROTOCOL);
                next = mailbox.and_then(|m| m.try_recv().ok().flatten());
                continue;
            }
            let skynet = &self.skynet;
            let frame: Option<Utf8Bytes> =
                delivery.encoded(PROTOCOL, |env| skynet.encode_text(env).map(Utf8Bytes::from));
            if let Some(frame) = frame {
                self.socket.feed(Message::Text(frame)).await?;
                delivery.written_to(PROTOCOL);
            }
            written += 1;
            if written < WRITE_BATCH {
                next = mailbox.and_then(|m| m.try_recv().ok().flatten());
            }
        }
        // Told after the batch: a drop while it was written has a batch after it, or is
        // told here.
        if let Some(dropped) = mailbox.map(Mailbox::take_untold_drops).filter(|&n| n > 0) {
            let event = wire::error_event(&websocket::dropped_text(dropped), None);
            self.socket.feed(Message::Text(event.into())).await?;
        }
        self.socket.flush().await
    }

    async fn send_event(&mut self, frame: String) -> Flow {
        match self.socket.send(Message::Text(frame.into())).await {
            Ok(()) => Flow::Continue,
            Err(_) => Flow::Close,
        }
    }

    async fn close(&mut self, code: u16, reason: &'static str) {
        self.socket.close(code, reason).await;
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
