//! One Tracker WebSocket connection: `auth` first (within the auth timeout), then
//! heartbeats, subscriptions, `chat.send` and `ack` in; `message.new`, `agent.status` and
//! task events out. A connection that stops heartbeating is shown offline until it
//! heartbeats again; the socket stays open.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use tokio::time::Instant;

use super::chat::{NewMessage, PostError, Posted};
use super::db::MemberRow;
use super::wire::{self, AuthorType, ClientFrame, MemberKind};
use super::{Conn, ConnInterest, PROTOCOL, Tracker, translate};
use crate::core::{Closed, Delivery, Envelope, LogError, Mailbox, Session};
use crate::protocols::session::{self, Flow, Io, WsSession};
use crate::shared::websocket::{Message, Refused, Socket, Utf8Bytes};
use crate::telemetry;

/// Why a sent message reached nobody.
const NOT_STORED: &str = "message could not be stored; it was not delivered";

/// Not an `async fn`, for the reason `session::run` is not.
#[allow(clippy::manual_async_fn)]
pub fn serve(mut socket: Socket, tracker: Arc<Tracker>) -> impl Future<Output = ()> + Send {
    async move {
        let Some(member) = Box::pin(authenticate(&mut socket, &tracker)).await else {
            return;
        };
        let live = Box::pin(Live::attach(tracker.clone(), member)).await;
        session::run(live, socket, tracker.shutdown.clone()).await;
    }
}

impl Live {
    /// The authenticated member's connection, attached to the router and announced
    /// online; `auth.ok` is its first frame (`on_open`).
    async fn attach(tracker: Arc<Tracker>, member: Arc<MemberRow>) -> Live {
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
        tracker.announce(&member.slug, came_online).await;
        tracing::info!(member = %member.slug, "tracker: authenticated");
        let heartbeat = Duration::from_millis(tracker.config.heartbeat_timeout_ms);
        Live {
            tracker,
            conn,
            member,
            session,
            heartbeat_by: Some(Instant::now() + heartbeat),
        }
    }

    /// `auth.ok`, built as text rather than kept as a `Value` for the life of the
    /// connection (`online` may be long).
    fn auth_ok(&self) -> String {
        let (tracker, slug) = (&self.tracker, &self.member.slug);
        let projects = tracker.chats.projects.load();
        // `online` lists the others, as in the document's example (`coder` is not in its own).
        let mut online = tracker.online_names();
        online.retain(|name| name != slug);
        wire::event_text(
            "auth.ok",
            &wire::AuthOk {
                slug,
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
        )
    }
}

/// Reads the first frame; answers `auth.ok` later, or `auth.error` and closes now.
async fn authenticate(socket: &mut Socket, tracker: &Tracker) -> Option<Arc<MemberRow>> {
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
    tracker: Arc<Tracker>,
    conn: Arc<Conn>,
    member: Arc<MemberRow>,
    session: Arc<Session>,
    /// When the connection is shown offline unless it heartbeats first; `None` once it is.
    heartbeat_by: Option<Instant>,
}

impl WsSession for Live {
    const PROTOCOL: crate::core::Protocol = PROTOCOL;
    /// With each sent message being stored, what is left to do once it is.
    type Pending = Posted;

    fn mailbox(&self) -> Option<&Arc<Mailbox>> {
        Some(&self.conn.mailbox)
    }

    fn error_frame(&self, text: &str) -> String {
        wire::error_frame(text)
    }

    async fn on_open(&mut self, io: &mut Io<Posted>) -> Flow {
        io.send(self.auth_ok()).await
    }

    async fn on_closed(&mut self, io: &mut Io<Posted>, reason: Closed) -> Flow {
        // The fleet gave the member's name to another agent (`Core::yield_name`).
        if reason == Closed::NameTaken
            && let Some(taken) = self.tracker.core.directory.holder(&self.member.slug)
        {
            let _ = io.send(wire::error_frame(&taken.to_string())).await;
        }
        Flow::Close
    }

    async fn on_frame(&mut self, io: &mut Io<Posted>, message: Message) -> Flow {
        let text = match message {
            Message::Text(text) => text.to_string(),
            Message::Binary(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            _ => return Flow::Continue,
        };
        match wire::parse_client_frame(&text) {
            Ok(ClientFrame::Heartbeat { status }) => {
                let timeout = Duration::from_millis(self.tracker.config.heartbeat_timeout_ms);
                self.heartbeat_by = Some(Instant::now() + timeout);
                let (tracker, slug) = (&self.tracker, &self.member.slug);
                let change = tracker.members.heartbeat(slug, self.conn.id, status);
                Box::pin(tracker.announce(slug, change)).await;
                Flow::Continue
            }
            Ok(frame) => match Box::pin(self.handle(io, frame)).await {
                Ok(()) => Flow::Continue,
                Err(error) => io.send(wire::error_frame(&error)).await,
            },
            Err(error) => {
                telemetry::decode_error(PROTOCOL);
                io.send(wire::error_frame(&error)).await
            }
        }
    }

    async fn on_stored(
        &mut self,
        io: &mut Io<Posted>,
        stored: Result<Envelope, LogError>,
        post: Posted,
    ) -> Flow {
        match stored {
            Ok(env) => {
                self.tracker.posted(env, post).await;
                Flow::Continue
            }
            Err(e) => {
                tracing::error!(error = %e, "tracker: cannot store a message");
                io.send(wire::error_frame(&e.tell_sender(NOT_STORED))).await
            }
        }
    }

    async fn settle(&mut self, stored: Result<Envelope, LogError>, post: Posted) {
        if let Ok(env) = stored {
            self.tracker.posted(env, post).await;
        }
    }

    fn frame(&mut self, delivery: &Arc<Delivery>) -> Option<Utf8Bytes> {
        let tracker = &self.tracker;
        delivery.encoded(PROTOCOL, |env| {
            translate::encode_text(env, tracker.as_ref()).map(Utf8Bytes::from)
        })
    }

    fn deadline(&self) -> Option<Instant> {
        self.heartbeat_by
    }

    /// No heartbeat in time: shown offline until the next, the socket kept open.
    async fn on_deadline(&mut self, _: &mut Io<Posted>) -> Flow {
        self.heartbeat_by = None;
        let change = (self.tracker.members).timed_out(&self.member.slug, self.conn.id);
        Box::pin(self.tracker.announce(&self.member.slug, change)).await;
        Flow::Continue
    }

    async fn finish(self) {
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

impl Live {
    /// Handles a frame other than a heartbeat; `Err` is the error to send back.
    async fn handle(&mut self, io: &mut Io<Posted>, frame: ClientFrame) -> Result<(), String> {
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
                self.conn.subscriptions.write().insert(project_id);
                Ok(())
            }
            ClientFrame::Unsubscribe { project_id } => {
                self.conn.subscriptions.write().remove(&project_id);
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
                        io.pending.push(staged, post);
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
                    Err(PostError::Refused(reason)) => Err(reason),
                }
            }
        }
    }
}
