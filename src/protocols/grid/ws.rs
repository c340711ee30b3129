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

use tokio::sync::Notify;

use serde_json::{Value, json};

use super::db::Instances;
use super::wire::{self, Invalid, Party};
use super::{Grid, PROTOCOL, Source, translate};
use tokio::time::Instant;

use crate::core::{
    Closed, Delivery, Envelope, Interest, Kind, LogError, Mailbox, SentOnArrival, Session, Status,
    TAKE_AGAIN_AFTER,
};
use crate::protocols::session::{self, Flow, Io, WsSession};
use crate::shared::clock::iso8601;
use crate::shared::deep_json::from_own_str;
use crate::shared::websocket::{self, Message as Frame, Refusal, Socket, Utf8Bytes};

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
    grid: Arc<Grid>,
    /// The program named in the socket's URL, identified as the session opens.
    named: Option<Party>,
    /// Until the program has identified itself, when it must have.
    identify_by: Option<Instant>,
    identity: Option<(Party, Arc<Session>)>,
    /// This socket's id among the program's sockets, once identified.
    socket_id: u64,
    /// Ids of the queued messages sent on connecting: a copy that also reached the
    /// mailbox (routed while the socket attached) is not sent twice.
    from_backlog: HashSet<String>,
    /// What the socket sent live as it opened: a bridge not yet seeing the program here may
    /// have queued it too, and that copy, taken, is not sent again.
    sent_on_arrival: SentOnArrival,
    /// When to take again queued mail whose take NATS did not answer.
    take_again_at: Option<Instant>,
    /// Wakes the socket to take what was queued for its program while it is open (by
    /// another bridge that took it for away, or kept again).
    wake: Arc<Notify>,
    /// A delivery the socket failed to send: queued again when the connection ends.
    unsent: Vec<Arc<Delivery>>,
    /// Whether the program asked for presence (`?presence=1`).
    presence: bool,
    /// Ids of the sent messages being stored: one sent again before it is stored is a
    /// repeat all the same.
    pending_ids: HashSet<String>,
    /// The fleet gave the program's name to the program another bridge holds under it
    /// (`Closed::NameTaken`), which was routed everything this socket was.
    lost_name: bool,
}

/// With each sent message being stored, its id and sender (to refuse it if it cannot be
/// stored).
type Sent = (String, Party);

pub fn serve(
    socket: Socket,
    grid: Arc<Grid>,
    query: HashMap<String, String>,
) -> impl Future<Output = ()> + Send {
    let named = query
        .get("agent")
        .filter(|a| !a.is_empty())
        .map(|agent| Party {
            agent: agent.clone(),
            instance_id: query.get("instance_id").cloned().filter(|i| !i.is_empty()),
        });
    let identify_within = Duration::from_millis(grid.config.identify_timeout_ms);
    let conn = Connection {
        grid: grid.clone(),
        identify_by: named.is_none().then(|| Instant::now() + identify_within),
        named,
        identity: None,
        socket_id: 0,
        from_backlog: HashSet::new(),
        sent_on_arrival: SentOnArrival::default(),
        take_again_at: None,
        wake: Arc::default(),
        unsent: Vec::new(),
        presence: query
            .get("presence")
            .is_some_and(|p| matches!(p.as_str(), "1" | "true" | "yes")),
        pending_ids: HashSet::new(),
        lost_name: false,
    };
    session::run(conn, socket, grid.shutdown.clone())
}

impl WsSession for Connection {
    const PROTOCOL: crate::core::Protocol = PROTOCOL;
    type Pending = Sent;

    fn mailbox(&self) -> Option<&Arc<Mailbox>> {
        self.identity.as_ref().map(|(_, s)| &s.mailbox)
    }

    fn error_frame(&self, text: &str) -> String {
        self.error_text(wire::Invalid::new("frame", text))
    }

    fn refusal_frame(&self, refusal: &Refusal) -> String {
        let code = match refusal {
            Refusal::TooLarge { .. } => "PAYLOAD_TOO_LARGE",
            Refusal::OverBudget { .. } => "BUSY",
            Refusal::NotUtf8 | Refusal::Protocol(_) => "VALIDATION_FAILED",
        };
        self.error_text(wire::Invalid {
            code,
            ..wire::Invalid::new("frame", refusal.to_string())
        })
    }

    fn drop_notice(&self, count: u64) -> String {
        self.error_text(wire::Invalid {
            code: "MESSAGES_DROPPED",
            ..wire::Invalid::new("receiver", websocket::dropped_text(count))
        })
    }

    /// A program named in the URL is identified before anything else.
    async fn on_open(&mut self, io: &mut Io<Sent>) -> Flow {
        match self.named.take() {
            Some(party) => Box::pin(self.identify(io, party)).await,
            None => Flow::Continue,
        }
    }

    async fn on_frame(&mut self, io: &mut Io<Sent>, message: Frame) -> Flow {
        let text = match message {
            Frame::Text(text) => text.to_string(),
            Frame::Binary(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            _ => return Flow::Continue,
        };
        self.on_text(io, &text).await
    }

    async fn on_stored(
        &mut self,
        io: &mut Io<Sent>,
        stored: Result<Envelope, LogError>,
        sent: Sent,
    ) -> Flow {
        Connection::stored(self, io, stored, sent).await
    }

    /// A refusal goes where the program's other messages go.
    async fn settle(&mut self, stored: Result<Envelope, LogError>, (id, sender): Sent) {
        match stored {
            Ok(env) => {
                self.grid.core.route(env);
            }
            Err(e) => (self.grid.report(&super::store_failed(&id, &sender, &e))).await,
        }
    }

    fn frame(&mut self, delivery: &Arc<Delivery>) -> Option<Utf8Bytes> {
        if self.from_backlog.remove(&delivery.envelope.id) {
            return None;
        }
        if self.keeps_for_another(delivery)
            && let Some((party, _)) = &self.identity
        {
            // For an instance with no socket: queued for it to poll or connect.
            self.grid.hold(&party.agent, delivery);
            delivery.written_to(PROTOCOL);
            return None;
        }
        // The YAML text from the message the hub may already have encoded.
        let grid = &self.grid;
        let frame = delivery.encoded(PROTOCOL, |_| {
            grid.encode(delivery)
                .map(|m| Utf8Bytes::from(wire::to_yaml(&m)))
        });
        if frame.is_some() {
            let env = &delivery.envelope;
            self.sent_on_arrival.sent(env.kind, &env.id);
        }
        frame
    }

    /// Not lost with the socket: queued again when the connection ends (and not taken for
    /// sent live when the program's next socket takes it from the queue).
    fn unsent(&mut self, batch: Vec<Arc<Delivery>>) {
        for delivery in &batch {
            self.sent_on_arrival.unsent(&delivery.envelope.id);
        }
        self.unsent.extend(batch);
    }

    fn deadline(&self) -> Option<Instant> {
        match self.identity {
            None => self.identify_by,
            Some(_) => self.take_again_at,
        }
    }

    async fn on_deadline(&mut self, io: &mut Io<Sent>) -> Flow {
        match self.identity.as_ref() {
            Some((party, _)) => {
                let party = party.clone();
                self.take_again(io, &party).await
            }
            None => self.identify_timeout(io).await,
        }
    }

    fn waker(&self) -> Option<Arc<Notify>> {
        Some(self.wake.clone())
    }

    async fn on_wake(&mut self, io: &mut Io<Sent>) -> Flow {
        match self.identity.as_ref() {
            Some((party, _)) => {
                let party = party.clone();
                self.take_again(io, &party).await
            }
            None => Flow::Continue,
        }
    }

    async fn on_closed(&mut self, io: &mut Io<Sent>, reason: Closed) -> Flow {
        let (Closed::NameTaken, Some((party, _))) = (reason, &self.identity) else {
            return Flow::Close;
        };
        self.lost_name = true;
        let party = party.clone();
        let holder = self.grid.core.directory.holder(&party.agent);
        // Given to another protocol's agent: no longer a program this bridge knows, so
        // what is sent under the name here is refused as taken.
        if holder
            .as_ref()
            .is_some_and(|h| h.holder_protocol != PROTOCOL)
        {
            self.grid.programs.remove(&party.agent);
        }
        match holder {
            Some(taken) => self.name_taken(io, party, super::name_taken(taken)).await,
            None => io.close(1008, "name taken").await,
        }
    }

    async fn finish(mut self) {
        let Some((party, session)) = self.identity.take() else {
            return;
        };
        let last = self.grid.sockets.close(&party.agent, self.socket_id);
        let router = &self.grid.core.router;
        router.detach(&session);
        // What names no instance an older socket of the program that still takes
        // everything was sent too (a newer one may have opened after it was routed here);
        // not at shutdown, when that one may close after the queue's writer has stopped.
        // So does the program that took the name from this one (`lost_name`).
        let covered = self.lost_name
            || (!self.grid.shutdown.is_cancelled()
                && router.older_session_receiving(&session, |_| true));
        // Nothing accepted is lost with the socket: what it had not sent is queued again.
        let mut left = std::mem::take(&mut self.unsent);
        // Even from a mailbox an overflow closed.
        left.extend(session.mailbox.take_left());
        let mut requeued = false;
        for delivery in left {
            if self.from_backlog.contains(&delivery.envelope.id) {
                continue; // sent with the backlog
            }
            if !covered || translate::target_instance(&delivery.envelope).is_some() {
                self.grid.requeue(&party.agent, &delivery);
                requeued = true;
            }
        }
        // What it had unsent was given back as the writes failed (`unsent`).
        std::mem::take(&mut self.sent_on_arrival).closed();
        if last && !self.grid.shutdown.is_cancelled() {
            // Queued before the fleet hears the program left: a bridge killed then has
            // kept what the socket had not sent.
            if requeued {
                self.grid.flush().await;
            }
            // Unless the name is another bridge's now: its presence is that one's to tell.
            if self.grid.core.directory.held_elsewhere(&party.agent) {
                return;
            }
            self.grid
                .core
                .announce_presence(PROTOCOL, &party.agent, false, Status::Offline, None)
                .await;
        }
    }
}

impl Connection {
    /// Connects the program; it ends when it cannot be (its name is another protocol's).
    async fn identify(&mut self, io: &mut Io<Sent>, party: Party) -> Flow {
        let mut moving = match self.grid.hold_program(&party.agent).await {
            Ok(moving) => moving,
            Err(refusal) => return self.name_taken(io, party, refusal).await,
        };
        // Recorded before attaching, so the socket's interest finds itself among them.
        let (socket_id, first) = self.grid.sockets.open(
            &party.agent,
            party.instance_id.as_deref(),
            self.wake.clone(),
        );
        self.socket_id = socket_id;
        self.sent_on_arrival = self.grid.core.sent_on_arrival(&party.agent);
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
        if let Some(claim) = &mut moving
            && let Err(taken) = self.grid.core.complete_move(claim)
        {
            // Online through another bridge since its claim came here: what was routed
            // to this connection meanwhile, that bridge was routed too.
            self.grid.core.router.detach(&session);
            self.grid.sockets.close(&party.agent, socket_id);
            // The claim goes back now, not once a client slow to read is told.
            drop(moving);
            return self.name_taken(io, party, super::name_taken(taken)).await;
        }
        if let Some(claim) = &moving {
            let created_at = claim.agent().created_at;
            self.grid.store_program(&party.agent, created_at).await;
        }
        self.grid.sockets.attached(&party.agent);
        if first {
            self.grid
                .core
                .announce_presence(PROTOCOL, &party.agent, true, Status::Online, None)
                .await;
        }
        self.identity = Some((party.clone(), session));
        if self.presence && self.welcome(io, &party).await == Flow::Close {
            return Flow::Close;
        }
        // What was accepted before the socket attached may still be on its way to the queue;
        // in a fleet, also on the bridge the program left.
        self.grid.flush().await;
        if let Some(claim) = &moving {
            self.grid.queue_handed_over(&party.agent, &claim.from).await;
        }
        self.send_backlog(io, &party).await
    }

    /// Refuses the program its name, and closes the socket.
    async fn name_taken(&mut self, io: &mut Io<Sent>, party: Party, mut refusal: Invalid) -> Flow {
        refusal.sender = Some(Box::new(party));
        let _ = send(io, &wire::error_message(&refusal)).await;
        io.close(1008, "name taken").await
    }

    /// Tells a socket that asked for presence who is there.
    async fn welcome(&mut self, io: &mut Io<Sent>, party: &Party) -> Flow {
        let welcome = json!({
            "id": wire::new_message_id_grid(),
            "timestamp": iso8601(crate::core::now_ms()),
            "type": "notification",
            "sender": { "agent": crate::core::BRIDGE_AGENT },
            "receiver": party.to_json(),
            "content": { "action": "agents_present", "payload": { "agents": self.grid.roster() } },
        });
        send(io, &welcome).await
    }

    /// Refuses a socket that named no program in time, and closes it.
    async fn identify_timeout(&mut self, io: &mut Io<Sent>) -> Flow {
        let within = Duration::from_millis(self.grid.config.identify_timeout_ms);
        let message = format!(
            "no agent named: open the socket with ?agent=… or send a message within {} s",
            within.as_secs_f64()
        );
        let timeout = wire::Invalid {
            code: "IDENTIFY_TIMEOUT",
            ..wire::Invalid::new("sender.agent", message)
        };
        let _ = self.refuse(io, timeout).await;
        io.close(1008, "identify timeout").await
    }

    /// Takes again the program's queued mail: what a take NATS did not answer left here,
    /// once NATS is back, and what was queued for it while the socket is open. It goes on
    /// this socket, rather than when the program next connects.
    async fn take_again(&mut self, io: &mut Io<Sent>, party: &Party) -> Flow {
        let away = (self.grid.core.records()).is_some_and(|records| !records.reachable());
        // Rather than wait, with the socket's loop, for a settling of the program's mail.
        if away || self.grid.unsettled.is_settling(&party.agent) {
            self.take_again_at = Some(Instant::now() + TAKE_AGAIN_AFTER);
            return Flow::Continue;
        }
        self.take_again_at = None;
        self.send_backlog(io, party).await
    }

    /// Sends what was queued for the program while it had no socket, in queue order (high
    /// priority first). It is taken from the queue before it is sent, so that two sockets
    /// of the program opening at once do not both send it; what could not be sent is put
    /// back.
    async fn send_backlog(&mut self, io: &mut Io<Sent>, party: &Party) -> Flow {
        let instances = Instances::Of(party.instance_id.as_deref());
        let taken = (self.grid).take_queued(&party.agent, None, instances).await;
        let backlog = match taken {
            Ok(mail) => {
                self.take_again_at = mail.retake.then(|| Instant::now() + TAKE_AGAIN_AFTER);
                mail.taken
            }
            Err(e) => {
                tracing::error!(error = %e, agent = %party.agent, "grid: cannot read the queue");
                return Flow::Continue;
            }
        };
        let mut rest = backlog.into_iter();
        while let Some(queued) = rest.next() {
            let id = &queued.message.message_id;
            if self.sent_on_arrival.was_sent(id) {
                continue; // taken, so that it is kept nowhere, and sent once, live
            }
            let Ok(message) = from_own_str::<Value>(&queued.message.body) else {
                continue;
            };
            self.from_backlog.insert(queued.message.message_id.clone());
            if send(io, &message).await == Flow::Close {
                // Not what it sent live: that is taken for good.
                let sent = &mut self.sent_on_arrival;
                let rest = rest.filter(|q| !sent.was_sent(&q.message.message_id));
                let unsent = std::iter::once(queued).chain(rest).collect();
                if let Err(e) = self.grid.put_back(unsent).await {
                    tracing::error!(error = %e, agent = %party.agent, "grid: cannot queue again");
                }
                return Flow::Close;
            }
        }
        Flow::Continue
    }

    /// Handles a text frame.
    async fn on_text(&mut self, io: &mut Io<Sent>, text: &str) -> Flow {
        let docs = match wire::parse_frame(text) {
            Ok(docs) => docs,
            Err(e) => return self.refuse(io, e).await,
        };
        for doc in docs {
            let msg = match wire::validate(doc) {
                Ok(msg) => msg,
                Err(e) => {
                    if self.refuse(io, e).await == Flow::Close {
                        return Flow::Close;
                    }
                    continue;
                }
            };
            // Boxed: the first message's alone, it would size every frame's future.
            if self.identity.is_none()
                && Box::pin(self.identify(io, msg.sender.clone())).await == Flow::Close
            {
                return Flow::Close;
            }
            if self.pending_ids.contains(&msg.id) {
                continue;
            }
            // One frame may hold many documents: the bound holds within a frame too.
            while !io.pending.has_room() {
                if let Some((stored, sent)) = io.pending.next().await
                    && self.stored(io, stored, sent).await == Flow::Close
                {
                    return Flow::Close;
                }
            }
            let sent = (msg.id.clone(), msg.sender.clone());
            match self.grid.stage(msg, Source::Socket).await {
                Ok(Some(staged)) => {
                    self.pending_ids.insert(sent.0.clone());
                    io.pending.push(staged, sent);
                }
                Ok(None) => {}
                Err(e) => {
                    if self.refuse(io, e).await == Flow::Close {
                        return Flow::Close;
                    }
                }
            }
        }
        Flow::Continue
    }

    /// A sent message is durable (and routed now) or could not be stored (and is refused).
    async fn stored(
        &mut self,
        io: &mut Io<Sent>,
        stored: Result<Envelope, LogError>,
        (id, sender): Sent,
    ) -> Flow {
        self.pending_ids.remove(&id);
        match stored {
            Ok(env) => {
                self.grid.core.route(env);
                Flow::Continue
            }
            Err(e) => self.refuse(io, super::store_failed(&id, &sender, &e)).await,
        }
    }

    /// Answers a refused frame with a Grid error message; the connection stays open.
    async fn refuse(&mut self, io: &mut Io<Sent>, invalid: Invalid) -> Flow {
        crate::telemetry::decode_error(PROTOCOL);
        io.send(self.error_text(invalid)).await
    }

    /// `invalid` as the Grid error message sent on this socket, to its program.
    fn error_text(&self, mut invalid: Invalid) -> String {
        if invalid.sender.is_none() {
            invalid.sender = self.identity.as_ref().map(|(p, _)| Box::new(p.clone()));
        }
        wire::to_yaml(&wire::error_message(&invalid))
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
}

/// Sends `message` as a `{message: …}` document.
async fn send(io: &mut Io<Sent>, message: &Value) -> Flow {
    io.send(wire::to_yaml(message)).await
}
