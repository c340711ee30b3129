//! One Tracker WebSocket connection: `auth` first (within the auth timeout), then
//! heartbeats, subscriptions, `chat.send` and `ack` in; `message.new`, `agent.status` and
//! task events out. A connection that stops heartbeating is shown offline until it
//! heartbeats again; the socket stays open.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::time::{Instant, sleep_until};

use super::chat::{NewMessage, PostError, Posted};
use super::db::MemberRow;
use super::wire::{self, AuthorType, ClientFrame, MemberKind};
use super::{Conn, ConnInterest, PROTOCOL, Tracker, translate};
use crate::core::{Delivery, Envelope, InFlight, Session};
use crate::shared::websocket::{self, Message, Refused, Socket, Utf8Bytes};
use crate::telemetry::{self, ConnectionGuard};

const WRITE_BATCH: usize = 64;
/// Why a sent message reached nobody.
const NOT_STORED: &str = "message could not be stored; it was not delivered";
/// Far enough away to mean "not until the next heartbeat".
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

pub async fn serve(mut socket: Socket, tracker: Arc<Tracker>) {
    let _counted = ConnectionGuard::new(PROTOCOL);
    let Some(member) = Box::pin(authenticate(&mut socket, &tracker)).await else {
        return;
    };
    let conn = Arc::new(Conn {
        id: tracker.next_conn_id(),
        slug: member.slug.clone(),
        mailbox: tracker.core.router.mailbox(PROTOCOL),
        chat_listen: member.chat_listen,
        task_listen: member.task_listen,
        subscriptions: RwLock::new(HashSet::new()),
        chats: tracker.chats.clone(),
    });
    let session = tracker.core.router.attach(
        &member.slug,
        conn.mailbox.clone(),
        Arc::new(ConnInterest(conn.clone())),
    );
    tracker.conns.insert(conn.id, conn.clone());
    let came_online = tracker.members.connected(&member.slug, conn.id);
    Box::pin(tracker.announce(&member.slug, came_online)).await;

    // Built as text, not kept as a `Value` for the life of the connection (`online` may
    // be long).
    let projects = tracker.chats.projects.load();
    // `online` lists the others, as in the document's example (`coder` is not in its own).
    let mut online = tracker.online_names();
    online.retain(|name| *name != member.slug);
    let ok = wire::event_text(
        "auth.ok",
        &wire::AuthOk {
            slug: &member.slug,
            lobby_chat_id: &tracker.chats.lobby_chat_id,
            projects: projects
                .iter()
                .map(|p| wire::ProjectRef {
                    id: &p.id,
                    slug: &p.slug,
                    name: &p.name,
                })
                .collect(),
            online,
        },
    );
    tracing::info!(member = %member.slug, "tracker: authenticated");
    let mut live = Live {
        socket,
        tracker: tracker.clone(),
        conn: conn.clone(),
        member,
        session,
        pending: InFlight::new(),
    };
    if live.send(ok).await {
        live.run().await;
    }
    Box::pin(live.finish()).await;
}

/// Reads the first frame; answers `auth.ok` later, or `auth.error` and closes now.
async fn authenticate(socket: &mut Socket, tracker: &Tracker) -> Option<MemberRow> {
    let timeout = Duration::from_millis(tracker.config.auth_timeout_ms);
    let refusal = match tokio::time::timeout(timeout, first_text(socket)).await {
        Err(_) => format!(
            "Authentication timeout: send {{\"type\":\"auth\",\"token\":…}} within {} s",
            timeout.as_secs_f64()
        ),
        Ok(None) => return None,
        Ok(Some(Err(refused))) => format!("First message must be auth: {}", refused.refusal),
        Ok(Some(Ok(text))) => match wire::parse_client_frame(&text) {
            Ok(ClientFrame::Auth { token }) => match tracker.members.by_token(&token) {
                Some(member) => return Some(member),
                None => "Invalid token".to_owned(),
            },
            Ok(_) => "First message must be auth".to_owned(),
            Err(e) => format!("First message must be auth: {e}"),
        },
    };
    telemetry::decode_error(PROTOCOL);
    let _ = socket
        .send(Message::Text(wire::auth_error_frame(&refusal).into()))
        .await;
    socket.close(1008, "authentication failed").await;
    None
}

/// The first text frame (binary frames are read as UTF-8 text), or why it was refused.
async fn first_text(socket: &mut Socket) -> Option<Result<String, Refused>> {
    loop {
        match socket.recv().await? {
            Ok(Message::Text(text)) => return Some(Ok(text.to_string())),
            Ok(Message::Binary(bytes)) => {
                return Some(Ok(String::from_utf8_lossy(&bytes).into_owned()));
            }
            Ok(Message::Close(_)) => return None,
            Err(refused) => return Some(Err(refused)),
            Ok(_) => continue,
        }
    }
}

struct Live {
    socket: Socket,
    tracker: Arc<Tracker>,
    conn: Arc<Conn>,
    member: MemberRow,
    session: Arc<Session>,
    /// Sent messages being stored, delivered in the order they were sent once durable.
    pending: InFlight<Posted>,
}

impl Live {
    async fn run(&mut self) {
        let timeout = Duration::from_millis(self.tracker.config.heartbeat_timeout_ms);
        let shutdown = self.tracker.shutdown.clone();
        let mailbox = self.conn.mailbox.clone();
        // The shutdown and the heartbeat's timer are made once, the timer moved as
        // heartbeats come. Made afresh each turn of the loop, each was registered (the
        // timer in the runtime's wheel) and removed again for every frame and delivery.
        let mut shutting_down = std::pin::pin!(shutdown.cancelled());
        let mut timed_out = std::pin::pin!(sleep_until(Instant::now() + timeout));
        loop {
            tokio::select! {
                biased;
                _ = &mut shutting_down => {
                    self.socket.close(1001, "server shutting down").await;
                    return;
                }
                Some((stored, post)) = self.pending.next(), if !self.pending.is_empty() => {
                    if !Box::pin(self.on_stored(stored, post)).await {
                        return;
                    }
                }
                frame = self.socket.recv(), if self.pending.has_room() => {
                    let text = match frame {
                        Some(Ok(Message::Text(text))) => text.to_string(),
                        Some(Ok(Message::Binary(bytes))) => String::from_utf8_lossy(&bytes).into_owned(),
                        Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                        Some(Err(refused)) => {
                            // Refused unread: an `error` frame, and the RFC 6455 close
                            // when the socket cannot go on.
                            telemetry::decode_error(PROTOCOL);
                            let refusal = &refused.refusal;
                            if !self.send(wire::error_frame(&refusal.to_string())).await {
                                return;
                            }
                            if refused.fatal {
                                self.socket.close(refusal.close_code(), refusal.close_reason()).await;
                                return;
                            }
                            continue;
                        }
                        _ => return,
                    };
                    match wire::parse_client_frame(&text) {
                        Ok(ClientFrame::Heartbeat { status }) => {
                            timed_out.as_mut().reset(Instant::now() + timeout);
                            let change = self.tracker.members.heartbeat(&self.member.slug, self.conn.id, status);
                            Box::pin(self.tracker.announce(&self.member.slug, change)).await;
                        }
                        Ok(frame) => {
                            if let Err(error) = Box::pin(self.on_frame(frame)).await
                                && !self.send(wire::error_frame(&error)).await
                            {
                                return;
                            }
                        }
                        Err(error) => {
                            telemetry::decode_error(PROTOCOL);
                            if !self.send(wire::error_frame(&error)).await {
                                return;
                            }
                        }
                    }
                }
                next = mailbox.recv() => match next {
                    Ok(delivery) => if !Box::pin(self.write(delivery)).await { return },
                    Err(_) => {
                        self.socket.close(1008, crate::shared::websocket::BEHIND_REASON).await;
                        return;
                    }
                },
                _ = &mut timed_out => {
                    timed_out.as_mut().reset(Instant::now() + NEVER);
                    let change = self.tracker.members.timed_out(&self.member.slug, self.conn.id);
                    Box::pin(self.tracker.announce(&self.member.slug, change)).await;
                }
            }
        }
    }

    /// Handles a frame other than a heartbeat; `Err` is the error to send back.
    async fn on_frame(&mut self, frame: ClientFrame) -> Result<(), String> {
        match frame {
            ClientFrame::Auth { .. } => Err("already authenticated".into()),
            ClientFrame::Heartbeat { .. } | ClientFrame::Ack => Ok(()),
            ClientFrame::Subscribe { project_id } => {
                if !self
                    .tracker
                    .chats
                    .projects
                    .load()
                    .iter()
                    .any(|p| p.id == project_id)
                {
                    return Err(format!("unknown project_id \"{project_id}\""));
                }
                self.conn
                    .subscriptions
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(project_id);
                Ok(())
            }
            ClientFrame::Unsubscribe { project_id } => {
                self.conn
                    .subscriptions
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&project_id);
                Ok(())
            }
            ClientFrame::ChatSend {
                chat_id,
                task_id,
                content,
                mentions,
                reply_to,
            } => {
                let message = NewMessage {
                    author_slug: self.member.slug.clone(),
                    author_type: match self.member.kind {
                        MemberKind::Agent => AuthorType::Agent,
                        MemberKind::Human => AuthorType::Human,
                    },
                    chat_id,
                    task_id,
                    content,
                    mentions,
                    reply_to,
                };
                match self.tracker.stage_post(message, true).await {
                    Ok((staged, post)) => {
                        self.pending.push(staged, post);
                        Ok(())
                    }
                    Err(PostError::NotFound(what)) => Err(what),
                    Err(PostError::TooManyMentions(count, limit)) => {
                        Err(format!("too many mentions: {count}; the limit is {limit}"))
                    }
                    Err(PostError::UnknownMention(name)) => Err(format!(
                        "unknown mention '{}': no agent of any protocol has that name",
                        crate::shared::text::a_few(&[name])
                    )),
                    Err(PostError::Store(e)) => {
                        tracing::error!(error = %e, "tracker: cannot store a message");
                        Err(NOT_STORED.into())
                    }
                }
            }
        }
    }

    /// Writes `first` and whatever else is queued, then flushes; false when the socket is gone.
    async fn write(&mut self, first: Arc<Delivery>) -> bool {
        let mut next = Some(first);
        let mut written = 0;
        while let Some(delivery) = next.take() {
            let tracker = &self.tracker;
            let frame: Option<Utf8Bytes> = delivery.encoded(PROTOCOL, |env| {
                translate::encode_text(env, tracker.as_ref()).map(Utf8Bytes::from)
            });
            if let Some(frame) = frame {
                if self.socket.feed(Message::Text(frame)).await.is_err() {
                    return false;
                }
                delivery.written_to(PROTOCOL);
            }
            written += 1;
            if written < WRITE_BATCH {
                next = self.conn.mailbox.try_recv().ok().flatten();
            }
        }
        // Told after the batch: a drop while it was written has a batch after it, or is
        // told here.
        let dropped = self.conn.mailbox.take_untold_drops();
        if dropped > 0 {
            let frame = wire::error_frame(&websocket::dropped_text(dropped));
            if self.socket.feed(Message::Text(frame.into())).await.is_err() {
                return false;
            }
        }
        self.socket.flush().await.is_ok()
    }

    /// Delivers a sent message once stored, or tells the sender it was not; false when
    /// the socket is gone.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps its argument twice in its state"
    )]
    fn on_stored(
        &mut self,
        stored: Result<Envelope, crate::core::LogError>,
        post: Posted,
    ) -> impl Future<Output = bool> {
        // A block, not an `async fn`, which would hold the message twice (its argument
        // and the local it moves it into) in a future boxed and copied once a message.
        async move {
            match stored {
                Ok(env) => {
                    self.tracker.posted(env, post).await;
                    true
                }
                Err(e) => {
                    tracing::error!(error = %e, "tracker: cannot store a message");
                    self.send(wire::error_frame(NOT_STORED)).await
                }
            }
        }
    }

    async fn send(&mut self, frame: String) -> bool {
        self.socket.send(Message::Text(frame.into())).await.is_ok()
    }

    async fn finish(mut self) {
        // What was sent before the socket went is delivered all the same.
        while let Some((stored, post)) = self.pending.next().await {
            if let Ok(env) = stored {
                self.tracker.posted(env, post).await;
            }
        }
        self.tracker.core.router.detach(&self.session);
        self.tracker.conns.remove(&self.conn.id);
        let change = self
            .tracker
            .members
            .disconnected(&self.member.slug, self.conn.id);
        if !self.tracker.shutdown.is_cancelled() {
            self.tracker.announce(&self.member.slug, change).await;
        }
    }
}
