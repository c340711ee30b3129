//! One Grid WebSocket connection. A program identifies itself with `?agent=` (and
//! `instance_id=`) or by its first message; it sends YAML messages as text frames and
//! receives, one per frame, the messages for its agent name, its instance, or everyone.
//!
//! Only the protocol's messages are sent unless the socket asks for presence with
//! `?presence=1`: then it is sent who is there on identifying (`action: agents_present`)
//! and told of every `agent_online` / `agent_offline`. These frames are the bridge's own,
//! not the document's, so a program that did not ask never has to skip them; it can learn
//! who is there from `GET /grid/v1/agents`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde_json::{Value, json};

use super::db::Instances;
use super::wire::{self, Invalid, Party};
use super::{Grid, PROTOCOL, Source, translate};
use crate::core::LogError;
use crate::core::{Delivery, Envelope, InFlight, Interest, Kind, Mailbox, Session, Status};
use crate::shared::clock::iso8601;
use crate::shared::websocket::{self, Message as Frame, Refusal, Refused, Socket, Utf8Bytes};
use crate::telemetry::ConnectionGuard;

/// What a program's connection takes: what is for its agent (and its instance, when the
/// message names one), what is for every Grid program, and presence when it asked. A
/// message for an instance with no socket is taken by one socket of the agent, which
/// queues it rather than let it be lost.
struct ProgramInterest {
    grid: Weak<Grid>,
    agent: String,
    socket: u64,
    instance: Option<String>,
    presence: bool,
}

impl Interest for ProgramInterest {
    fn observes(&self, env: &Envelope) -> bool {
        translate::for_every_program(env)
    }

    fn accepts(&self, env: &Envelope) -> bool {
        if env.kind.is_presence() {
            return self.presence && env.kind != Kind::PresenceStatus;
        }
        match translate::target_instance(env) {
            None => true,
            Some(target) if self.instance.as_deref() == Some(target) => true,
            Some(target) => self
                .grid
                .upgrade()
                .is_some_and(|grid| grid.sockets.keeps_for(&self.agent, target, self.socket)),
        }
    }
}

struct Connection {
    socket: Socket,
    grid: Arc<Grid>,
    identity: Option<(Party, Arc<Session>)>,
    /// This socket's id among the program's sockets, once identified.
    socket_id: u64,
    /// Ids of the queued messages sent on connecting: a copy that also reached the
    /// mailbox (routed while the socket attached) is not sent twice.
    from_backlog: HashSet<String>,
    /// A delivery the socket failed to send: queued again when the connection ends.
    unsent: Vec<Arc<Delivery>>,
    /// Whether the program asked for presence (`?presence=1`).
    presence: bool,
    /// Sent messages being stored, routed in the order they were sent once durable; with
    /// each, its id and sender (to refuse it if it cannot be stored).
    pending: InFlight<(String, Party)>,
    /// Ids in `pending`: one sent again before it is stored is a repeat all the same.
    pending_ids: HashSet<String>,
}

pub async fn serve(socket: Socket, grid: Arc<Grid>, query: HashMap<String, String>) {
    let _counted = ConnectionGuard::new(PROTOCOL);
    let mut conn = Connection {
        socket,
        grid: grid.clone(),
        identity: None,
        socket_id: 0,
        from_backlog: HashSet::new(),
        unsent: Vec::new(),
        presence: query
            .get("presence")
            .is_some_and(|p| matches!(p.as_str(), "1" | "true" | "yes")),
        pending: InFlight::new(),
        pending_ids: HashSet::new(),
    };
    if let Some(agent) = query.get("agent").filter(|a| !a.is_empty()) {
        let party = Party {
            agent: agent.clone(),
            instance_id: query.get("instance_id").cloned().filter(|i| !i.is_empty()),
        };
        if !Box::pin(conn.identify(party)).await {
            // Attached perhaps (the client left during the backlog): detached, and what
            // its mailbox took kept, as at any end.
            Box::pin(conn.finish()).await;
            return;
        }
    }
    let shutdown = grid.shutdown.clone();
    let mut shutting_down = std::pin::pin!(shutdown.cancelled());
    let identify_timeout = Duration::from_millis(grid.config.identify_timeout_ms);
    let mut identify_deadline = std::pin::pin!(tokio::time::sleep(identify_timeout));
    loop {
        let mailbox = conn.identity.as_ref().map(|(_, s)| s.mailbox.clone());
        tokio::select! {
            biased;
            _ = &mut shutting_down => {
                conn.close(1001, "server shutting down").await;
                break;
            }
            _ = &mut identify_deadline, if conn.identity.is_none() => {
                let message = format!(
                    "no agent named: open the socket with ?agent=… or send a message within {} s",
                    identify_timeout.as_secs_f64()
                );
                let _ = conn.refuse(wire::Invalid { code: "IDENTIFY_TIMEOUT", ..wire::Invalid::new("sender.agent", message) }).await;
                conn.close(1008, "identify timeout").await;
                break;
            }
            Some((stored, sent)) = conn.pending.next(), if !conn.pending.is_empty() => {
                if !Box::pin(conn.on_stored(stored, sent)).await {
                    break;
                }
            }
            frame = conn.socket.recv(), if conn.pending.has_room() => {
                let text = match frame {
                    Some(Ok(Frame::Text(text))) => text.to_string(),
                    Some(Ok(Frame::Binary(bytes))) => String::from_utf8_lossy(&bytes).into_owned(),
                    Some(Ok(Frame::Ping(_) | Frame::Pong(_))) => continue,
                    Some(Err(refused)) => {
                        if !Box::pin(conn.on_refused(refused)).await {
                            break;
                        }
                        continue;
                    }
                    _ => break,
                };
                if !Box::pin(conn.on_text(&text)).await {
                    break;
                }
            }
            next = next_delivery(mailbox.as_deref()) => match next {
                Ok(delivery) => {
                    if !Box::pin(conn.write(&delivery)).await {
                        break;
                    }
                }
                Err(_) => {
                    conn.close(1008, crate::shared::websocket::BEHIND_REASON).await;
                    break;
                }
            },
        }
    }
    Box::pin(conn.finish()).await;
}

async fn next_delivery(mailbox: Option<&Mailbox>) -> Result<Arc<Delivery>, crate::core::Closed> {
    match mailbox {
        Some(mailbox) => mailbox.recv().await,
        None => std::future::pending().await,
    }
}

impl Connection {
    /// Connects the program; false when it cannot be (its name is another protocol's).
    async fn identify(&mut self, party: Party) -> bool {
        if let Err(mut refusal) = self.grid.register(&party.agent).await {
            refusal.sender = Some(Box::new(party));
            let _ = self.send(&wire::error_message(&refusal)).await;
            self.close(1008, "name taken").await;
            return false;
        }
        // Recorded before attaching, so the socket's interest finds itself among them.
        let (socket_id, first) = self
            .grid
            .sockets
            .open(&party.agent, party.instance_id.as_deref());
        self.socket_id = socket_id;
        let session = self.grid.core.router.attach(
            &party.agent,
            self.grid.core.router.mailbox(PROTOCOL),
            Arc::new(ProgramInterest {
                grid: Arc::downgrade(&self.grid),
                agent: party.agent.clone(),
                socket: socket_id,
                instance: party.instance_id.clone(),
                presence: self.presence,
            }),
        );
        self.grid.sockets.attached(&party.agent);
        if first {
            self.grid
                .core
                .announce_presence(PROTOCOL, &party.agent, true, Status::Online, None)
                .await;
        }
        self.identity = Some((party.clone(), session));
        if self.presence && !self.welcome(&party).await {
            return false;
        }
        self.send_backlog(&party).await
    }

    /// Tells a socket that asked for presence who is there.
    async fn welcome(&mut self, party: &Party) -> bool {
        let welcome = json!({
            "id": wire::new_message_id_grid(),
            "timestamp": iso8601(crate::core::now_ms()),
            "type": "notification",
            "sender": { "agent": crate::core::BRIDGE_AGENT },
            "receiver": party.to_json(),
            "content": { "action": "agents_present", "payload": { "agents": self.grid.roster() } },
        });
        self.send(&welcome).await
    }

    /// Sends what was queued for the program while it had no socket, in queue order (high
    /// priority first). It is taken from the queue before it is sent, so that two sockets
    /// of the program opening at once do not both send it; what could not be sent is put
    /// back.
    async fn send_backlog(&mut self, party: &Party) -> bool {
        // What was accepted before the socket attached may still be on its way to the queue.
        self.grid.flush().await;
        let taken = self
            .grid
            .db
            .take(
                &party.agent,
                None,
                Instances::Of(party.instance_id.as_deref()),
            )
            .await;
        let backlog = match taken {
            Ok(backlog) => backlog,
            Err(e) => {
                tracing::error!(error = %e, agent = %party.agent, "grid: cannot read the queue");
                return true;
            }
        };
        let mut rest = backlog.into_iter();
        while let Some(queued) = rest.next() {
            let Ok(message) = serde_json::from_str::<Value>(&queued.body) else {
                continue;
            };
            self.from_backlog.insert(queued.message_id.clone());
            if !self.send(&message).await {
                let unsent = std::iter::once(queued).chain(rest).collect();
                if let Err(e) = self.grid.db.restore(unsent).await {
                    tracing::error!(error = %e, agent = %party.agent, "grid: cannot queue again");
                }
                return false;
            }
        }
        true
    }

    /// Handles a text frame; false when the socket is gone.
    async fn on_text(&mut self, text: &str) -> bool {
        let docs = match wire::parse_frame(text) {
            Ok(docs) => docs,
            Err(e) => return self.refuse(e).await,
        };
        for doc in docs {
            let msg = match wire::validate(doc) {
                Ok(msg) => msg,
                Err(e) => {
                    if !self.refuse(e).await {
                        return false;
                    }
                    continue;
                }
            };
            // Boxed: the first message's alone, it would size every frame's future.
            if self.identity.is_none() && !Box::pin(self.identify(msg.sender.clone())).await {
                return false;
            }
            if self.pending_ids.contains(&msg.id) {
                continue;
            }
            // One frame may hold many documents: the bound holds within a frame too.
            while !self.pending.has_room() {
                if let Some((stored, sent)) = self.pending.next().await
                    && !self.on_stored(stored, sent).await
                {
                    return false;
                }
            }
            let sent = (msg.id.clone(), msg.sender.clone());
            match self.grid.stage(msg, Source::Socket).await {
                Ok(Some(staged)) => {
                    self.pending_ids.insert(sent.0.clone());
                    self.pending.push(staged, sent);
                }
                Ok(None) => {}
                Err(e) => {
                    if !self.refuse(e).await {
                        return false;
                    }
                }
            }
        }
        true
    }

    /// A sent message is durable (and routed now) or could not be stored (and is refused).
    async fn on_stored(
        &mut self,
        stored: Result<Envelope, LogError>,
        (id, sender): (String, Party),
    ) -> bool {
        self.pending_ids.remove(&id);
        match stored {
            Ok(env) => {
                self.grid.core.route(env);
                true
            }
            Err(e) => self.refuse(super::store_failed(&id, &sender, &e)).await,
        }
    }

    /// A message the socket would not take (too large, over the bridge's read budget, not
    /// UTF-8): a Grid error message, and the RFC 6455 close when the socket cannot go on.
    /// False when the socket is gone.
    async fn on_refused(&mut self, refused: Refused) -> bool {
        let refusal = &refused.refusal;
        let code = match refusal {
            Refusal::TooLarge { .. } => "PAYLOAD_TOO_LARGE",
            Refusal::OverBudget { .. } => "BUSY",
            Refusal::NotUtf8 => "VALIDATION_FAILED",
        };
        let invalid = wire::Invalid {
            code,
            ..wire::Invalid::new("frame", refusal.to_string())
        };
        if !self.refuse(invalid).await {
            return false;
        }
        if refused.fatal {
            self.close(refusal.close_code(), refusal.close_reason())
                .await;
            return false;
        }
        true
    }

    /// Answers a refused frame with a Grid error message; the connection stays open.
    async fn refuse(&mut self, mut invalid: Invalid) -> bool {
        crate::telemetry::decode_error(PROTOCOL);
        if invalid.sender.is_none() {
            invalid.sender = self.identity.as_ref().map(|(p, _)| Box::new(p.clone()));
        }
        self.send(&wire::error_message(&invalid)).await
    }

    /// Writes `delivery`, then tells the program of any message its mailbox dropped (a drop
    /// while this was written has a write after it, or is told here).
    async fn write(&mut self, delivery: &Arc<Delivery>) -> bool {
        if !self.write_one(delivery).await {
            return false;
        }
        let dropped = (self.identity.as_ref()).map_or(0, |(_, s)| s.mailbox.take_untold_drops());
        if dropped == 0 {
            return true;
        }
        let notice = wire::Invalid {
            code: "MESSAGES_DROPPED",
            sender: self.identity.as_ref().map(|(p, _)| Box::new(p.clone())),
            ..wire::Invalid::new("receiver", websocket::dropped_text(dropped))
        };
        self.send(&wire::error_message(&notice)).await
    }

    async fn write_one(&mut self, delivery: &Arc<Delivery>) -> bool {
        if self.from_backlog.remove(&delivery.envelope.id) {
            return true;
        }
        if self.keeps_for_another(delivery)
            && let Some((party, _)) = &self.identity
        {
            // For an instance with no socket: queued for it to poll or connect.
            self.grid.hold(&party.agent, delivery);
            delivery.written_to(PROTOCOL);
            return true;
        }
        // The YAML text from the message the hub may already have encoded.
        let grid = &self.grid;
        let frame: Option<Utf8Bytes> = delivery.encoded(PROTOCOL, |_| {
            grid.encode(delivery)
                .map(|m| Utf8Bytes::from(wire::to_yaml(&m)))
        });
        let Some(frame) = frame else { return true };
        if self.socket.send(Frame::Text(frame)).await.is_err() {
            self.unsent.push(delivery.clone());
            return false;
        }
        delivery.written_to(PROTOCOL);
        true
    }

    /// Whether `delivery` names another instance than this socket's (this socket took it
    /// because that instance has none).
    fn keeps_for_another(&self, delivery: &Delivery) -> bool {
        let mine = self
            .identity
            .as_ref()
            .and_then(|(p, _)| p.instance_id.as_deref());
        translate::target_instance(&delivery.envelope).is_some_and(|t| Some(t) != mine)
    }

    /// Sends `message` as a `{message: …}` document.
    async fn send(&mut self, message: &Value) -> bool {
        let yaml = wire::to_yaml(message);
        self.socket.send(Frame::Text(yaml.into())).await.is_ok()
    }

    async fn close(&mut self, code: u16, reason: &'static str) {
        self.socket.close(code, reason).await;
    }

    async fn finish(mut self) {
        // What was sent before the socket went is delivered all the same; a refusal goes
        // where the program's other messages go.
        while let Some((stored, (id, sender))) = self.pending.next().await {
            match stored {
                Ok(env) => {
                    self.grid.core.route(env);
                }
                Err(e) => {
                    self.grid
                        .report(&super::store_failed(&id, &sender, &e))
                        .await
                }
            }
        }
        let Some((party, session)) = self.identity.take() else {
            return;
        };
        let last = self.grid.sockets.close(&party.agent, self.socket_id);
        self.grid.core.router.detach(&session);
        // Nothing accepted is lost with the socket: what it had not sent is queued again.
        let mut left = std::mem::take(&mut self.unsent);
        // Even from a mailbox an overflow closed.
        left.extend(session.mailbox.take_left());
        for delivery in left {
            if self.from_backlog.contains(&delivery.envelope.id) {
                continue; // sent with the backlog
            }
            // What names no instance reached the program's other sockets too, if it has any.
            if last || translate::target_instance(&delivery.envelope).is_some() {
                self.grid.requeue(&party.agent, &delivery);
            }
        }
        if last && !self.grid.shutdown.is_cancelled() {
            self.grid
                .core
                .announce_presence(PROTOCOL, &party.agent, false, Status::Offline, None)
                .await;
        }
    }
}
