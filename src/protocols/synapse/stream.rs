//! How an agent's open stream (`StreamMessages`, `StreamGroupMessages`) is served: what
//! waited in its inbox first, then its traffic both ways; and, as it closes, what it held
//! and the client never read goes where the agent's messages go while it is away.

use std::collections::HashMap;
use std::sync::Arc;

use tokio_stream::StreamExt;
use tonic::{Status, Streaming};

use super::agents::{AGENT_HEADER, Hints, not_stored};
use super::outbound::{FromInbox, Route};
use super::outlet::{Outlet, StreamSender};
use super::proto::SynapseMessage;
use super::shared_inbox::Keeping;
use super::{PROTOCOL, Synapse, translate};
use crate::core::{
    Audience, BRIDGE_AGENT, Closed, Envelope, InFlight, Interest, Kind, Outstanding, Revision,
    SentOnArrival, TAKE_AGAIN_AFTER, TakenMail,
};
use crate::telemetry;

/// Which traffic a stream carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// `StreamMessages`: everything addressed to the agent (group traffic too, unless the
    /// agent also holds a group stream).
    Messages,
    /// `StreamGroupMessages`: the traffic of the agent's groups.
    Groups,
}

impl Synapse {
    /// Connects an open stream of `agent` to the router (before the call is answered, so
    /// anything sent to the agent after it sees the stream open reaches the stream). A
    /// `StreamMessages` stream of an agent another bridge of the fleet held moves it here
    /// (`Core::claim_move`), refused with `ALREADY_EXISTS` while the agent is online
    /// through that bridge.
    pub async fn attach_stream(
        self: &Arc<Self>,
        agent: &str,
        kind: StreamKind,
    ) -> Result<OpenStream, Status> {
        let taken = |taken: crate::core::NameTaken| Status::already_exists(taken.to_string());
        let mut moving = match kind {
            StreamKind::Messages => self.core.claim_move(agent, PROTOCOL).await.map_err(taken)?,
            StreamKind::Groups => None,
        };
        let mailbox = self.core.router.mailbox(PROTOCOL);
        let session = self.core.router.attach(
            agent,
            mailbox.clone(),
            Arc::new(StreamInterest {
                agent: agent.to_owned(),
                kind,
                synapse: Arc::downgrade(self),
            }),
        );
        if let Some(claim) = &mut moving
            && let Err(refused) = self.core.complete_move(claim)
        {
            // Online through another bridge since its claim came here: what was routed
            // to this connection meanwhile, that bridge was routed too.
            self.core.router.detach(&session);
            return Err(taken(refused));
        }
        let wake = match kind {
            StreamKind::Messages => self.stream_opened(agent, session.id).await,
            // Counted once attached: group traffic routed in between reaches the agent's
            // messages stream too, rather than neither.
            StreamKind::Groups => {
                *self.group_streams.entry(agent.to_owned()).or_insert(0) += 1;
                Arc::default()
            }
        };
        Ok(OpenStream {
            agent: agent.to_owned(),
            kind,
            mailbox,
            session,
            wake,
            moved_from: moving.map(|claim| claim.from),
        })
    }

    /// Serves a stream that names its agent in its first message: waits for that message,
    /// registers its sender, connects the stream, then serves it. A stream that ends first,
    /// or whose first message names no sender, ends with the error.
    pub async fn identify_and_serve(
        self: Arc<Self>,
        kind: StreamKind,
        mut inbound: Streaming<SynapseMessage>,
        hints: Hints,
        out: Outlet,
    ) {
        let first = tokio::select! {
            _ = self.shutdown.cancelled() => return,
            _ = out.tx.closed() => return,
            first = Box::pin(self.identify(&mut inbound, &hints, kind)) => first,
        };
        match first {
            Ok((agent, first)) => match Box::pin(self.attach_stream(&agent, kind)).await {
                Ok(attached) => {
                    self.serve_stream(attached, Some(Box::new(first)), inbound, hints, out)
                        .await
                }
                Err(status) => out.tx.fail(status).await,
            },
            Err(status) => {
                out.tx.fail(status).await;
            }
        }
    }

    /// The first message of a stream and the agent it names (registered).
    async fn identify(
        &self,
        inbound: &mut Streaming<SynapseMessage>,
        hints: &Hints,
        kind: StreamKind,
    ) -> Result<(String, SynapseMessage), Status> {
        let first = inbound.next().await.ok_or_else(|| {
            Status::invalid_argument(format!(
                "the stream ended before identifying its agent (send {AGENT_HEADER} metadata or a first message)"
            ))
        })??;
        let sender = first
            .sender
            .clone()
            .filter(|s| !s.agent_id.is_empty())
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "the first message must name message.sender.agent_id (or send {AGENT_HEADER} metadata)"
                ))
            })?;
        // One reconnecting here from another bridge is let in once its leave came.
        if kind == StreamKind::Messages {
            self.core.leave_arrived(&sender.agent_id).await;
        }
        self.ensure_agent(&sender, hints, "message.sender").await?;
        Ok((sender.agent_id, first))
    }

    /// Serves an attached stream: first the agent's backlog, then its messages in and what
    /// is addressed to it out, until either side closes; then closes it without losing
    /// what it still held.
    pub async fn serve_stream(
        self: Arc<Self>,
        stream: OpenStream,
        first: Option<Box<SynapseMessage>>,
        inbound: Streaming<SynapseMessage>,
        hints: Hints,
        out: Outlet,
    ) {
        let _counted = telemetry::ConnectionGuard::new(PROTOCOL);
        // The steps run once a stream (reading the inbox, closing) are boxed: inline, their
        // futures sized the task of every idle stream.
        let mut backlog = Backlog {
            // Only a stream that takes the inbox can be sent a copy of what it was sent.
            sent_on_arrival: match stream.kind {
                StreamKind::Messages => self.core.sent_on_arrival(&stream.agent),
                StreamKind::Groups => SentOnArrival::default(),
            },
            ..Backlog::default()
        };
        if let Some(bridge) = &stream.moved_from {
            // Its mail on the bridge the agent left is taken first.
            Box::pin(self.inbox_handed_over(&stream.agent, bridge)).await;
        }
        let mut unsent = match Box::pin(self.send_backlog(&stream, &out.tx, &mut backlog)).await {
            Ok(()) => Vec::new(),
            Err(unsent) => unsent,
        };
        // Relayed even when the client left during the backlog: the message it opened the
        // stream with is stored and routed, and the relay ends at once on a closed output.
        let relayed = self.relay(&stream, first, inbound, &hints, &out.tx, &mut backlog);
        unsent.extend(relayed.await);
        let closing = self.close_stream(stream, out, unsent, backlog);
        Box::pin(closing).await;
    }

    /// Takes the agent's backlog and sends it; `Err` with what the client did not take (it
    /// left).
    async fn send_backlog(
        &self,
        stream: &OpenStream,
        out: &StreamSender,
        backlog: &mut Backlog,
    ) -> Result<(), Vec<SynapseMessage>> {
        let mail = self.backlog(&stream.agent, stream.kind).await;
        backlog.retake_at = mail.retake.then(take_again_timer);
        for taken in &mail.taken {
            (backlog.taken).insert(taken.message.id.clone(), taken.taken_at);
        }
        // One it sent live is taken, so that it is kept nowhere, and not sent again.
        let sent = &mut backlog.sent_on_arrival;
        let mut taken = (mail.taken.into_iter())
            .map(|taken| taken.message)
            .filter(|message| !sent.was_sent(&message.id));
        while let Some(message) = taken.next() {
            if let Err(refused) = out.send(message).await {
                return Err(refused.into_iter().chain(taken).collect());
            }
        }
        Ok(())
    }

    /// Takes again, for a stream still open, the agent's inbox (as `send_backlog`): what a
    /// take NATS did not answer left in it, once NATS is back, and what was kept in it
    /// while the stream is open.
    async fn take_again(
        &self,
        stream: &OpenStream,
        out: &StreamSender,
        backlog: &mut Backlog,
    ) -> Result<(), Vec<SynapseMessage>> {
        let away = (self.core.records()).is_some_and(|records| !records.reachable());
        // Rather than wait, with the stream's relay, for a settling of the agent's mail.
        if away || self.unsettled.is_settling(&stream.agent) {
            backlog.retake_at = Some(take_again_timer());
            return Ok(());
        }
        self.send_backlog(stream, out, backlog).await
    }

    /// The stream's traffic both ways until either side closes, and the backlog taken again
    /// when its timer runs out. Returns the messages a departed client could not take.
    /// Messages the client sent are stored while it sends more and routed in order once
    /// durable; those still being stored when the stream ends are delivered all the same.
    async fn relay(
        &self,
        stream: &OpenStream,
        first: Option<Box<SynapseMessage>>,
        mut inbound: Streaming<SynapseMessage>,
        hints: &Hints,
        out: &StreamSender,
        backlog: &mut Backlog,
    ) -> Vec<SynapseMessage> {
        // With each message being stored, what a refusal needs to answer it.
        let mut storing: InFlight<SynapseMessage> = InFlight::new();
        // Steps with a message in hand (storing one, settling at the end) are boxed, and
        // the first message too: inline, each sized the task of every idle stream.
        if let Some(msg) = first {
            Box::pin(self.accept_from_stream(*msg, stream.kind, hints, out, &mut storing)).await;
        }
        // Made once, as the WebSocket session loop makes its own (`protocols/session.rs`).
        let shutdown = self.shutdown.cancelled();
        let mut shutdown = std::pin::pin!(shutdown);
        let closed = out.closed();
        let mut closed = std::pin::pin!(closed);
        // Armed once and again after each wake-up, not every turn (`protocols/session.rs`
        // says why).
        let woken = stream.wake.notified();
        let mut woken = std::pin::pin!(woken);
        let left = loop {
            tokio::select! {
                _ = &mut shutdown => break Vec::new(),
                _ = &mut closed => break Vec::new(),
                () = run_out(&mut backlog.retake_at) => {
                    if let Err(unsent) = Box::pin(self.take_again(stream, out, backlog)).await {
                        break unsent;
                    }
                }
                () = &mut woken => {
                    woken.set(stream.wake.notified());
                    if let Err(unsent) = Box::pin(self.take_again(stream, out, backlog)).await {
                        break unsent;
                    }
                }
                Some((stored, sent)) = storing.next(), if !storing.is_empty() => {
                    if let Some(refusal) = self.on_stored(stored, out) {
                        Box::pin(self.refuse_on_stream(&sent, &refusal, out)).await;
                    }
                }
                next = inbound.next(), if storing.has_room() => match next {
                    Some(Ok(msg)) => {
                        Box::pin(self.accept_from_stream(msg, stream.kind, hints, out, &mut storing)).await;
                    }
                    // A message the stream could not read (past the read budget, not
                    // protobuf): the client hears why, and the stream ends.
                    Some(Err(status)) => {
                        out.fail(status).await;
                        break Vec::new();
                    }
                    None => break Vec::new(),
                },
                next = stream.mailbox.recv() => {
                    let delivery = match next {
                        Ok(delivery) => delivery,
                        Err(Closed::NameTaken) => {
                            Box::pin(self.lost_name(&stream.agent, out)).await;
                            break Vec::new();
                        }
                        Err(_) => break Vec::new(),
                    };
                    let Some(message) = self.encode(&delivery) else { continue };
                    match self.route_for(&stream.agent, true) {
                        // Sent from the inbox already: kept by a bridge that did not yet
                        // see the agent here, and taken before this copy came.
                        Route::Stream if backlog.taken.contains_key(&message.id) => {
                            delivery.mark_written();
                        }
                        Route::Stream => {
                            (backlog.sent_on_arrival).sent(delivery.envelope.kind, &message.id);
                            let outstanding = delivery.held();
                            if let Err(refused) = out.send_holding(message, outstanding).await {
                                backlog.holds.extend(delivery.held());
                                break refused.into_iter().collect();
                            }
                            delivery.written_to(PROTOCOL);
                        }
                        other => {
                            let outstanding = delivery.held();
                            self.send_by(&stream.agent, other, message, outstanding);
                        }
                    }
                },
            }
        };
        Box::pin(self.settle(&mut storing, out)).await;
        left
    }

    /// Ends the stream of an agent whose name the fleet gave to the agent another bridge
    /// holds under it (`Core::yield_name`), with the refusal a stream opened now would get.
    async fn lost_name(&self, agent: &str, out: &StreamSender) {
        let text = match self.core.directory.holder(agent) {
            Some(taken) => taken.to_string(),
            None => format!("agent_id '{agent}' is held through another bridge"),
        };
        out.fail(Status::already_exists(text)).await;
    }

    /// Waits for every message the stream has being stored, and settles each in order.
    async fn settle(&self, storing: &mut InFlight<SynapseMessage>, out: &StreamSender) {
        while let Some((stored, sent)) = storing.next().await {
            if let Some(refusal) = self.on_stored(stored, out) {
                self.refuse_on_stream(&sent, &refusal, out).await;
            }
        }
    }

    /// A message the stream sent is durable, and routed now; or it could not be stored,
    /// and the refusal to nack it with is returned, if the client still reads. Not async:
    /// the stream's loop boxes the rare refusal, which inline sized the task of every idle
    /// stream.
    fn on_stored(
        &self,
        stored: Result<Envelope, crate::core::LogError>,
        out: &StreamSender,
    ) -> Option<Status> {
        match stored {
            Ok(env) => {
                self.core.route(env);
                None
            }
            Err(e) => (!out.is_closed()).then(|| not_stored(e)),
        }
    }

    /// Disconnects a stream. What it held and the client never read — its unread output,
    /// `unsent`, its mailbox — goes where the agent's messages go while it is offline, in
    /// that order (oldest first), before the client sees the stream end; unless an older
    /// stream of the agent is open, which was sent all of that too. (What it took from the
    /// inbox goes back there either way: that it alone was sent.)
    async fn close_stream(
        self: &Arc<Self>,
        stream: OpenStream,
        out: Outlet,
        unsent: Vec<SynapseMessage>,
        backlog: Backlog,
    ) {
        let Backlog {
            taken: from_backlog,
            mut sent_on_arrival,
            mut holds,
            ..
        } = backlog;
        let OpenStream {
            agent,
            kind,
            mailbox,
            session,
            ..
        } = stream;
        let Outlet { tx, unread } = out;
        let mut held = Vec::new();
        let later = match tx.is_closed() {
            // The client is gone: its output came back when tonic dropped it.
            true => {
                let unread = unread.await.unwrap_or_default();
                held.extend(unread.messages);
                holds.extend(unread.holds);
                None
            }
            false => Some(unread),
        };
        held.extend(unsent);
        self.drain(&mailbox, &mut held, &mut holds);
        if kind == StreamKind::Groups
            && let Some(mut count) = self.group_streams.get_mut(&agent)
        {
            // Before detaching: group traffic routed in between reaches the agent's
            // messages stream too, rather than neither.
            *count = count.saturating_sub(1);
        }
        self.core.router.detach(&session);
        // A message routed while detaching may have landed after the first drain.
        self.drain(&mailbox, &mut held, &mut holds);
        // Asked once nothing more reaches this stream; not at shutdown, when the older
        // stream may close after the inbox writer has stopped.
        let (sending, sent) = Outstanding::new();
        // So was the agent another bridge holds, once the name is its (`lost_name`).
        let lost_name = mailbox.closed() == Some(Closed::NameTaken);
        let left = Leftovers {
            covered: lost_name
                || (kind == StreamKind::Messages
                    && !self.shutdown.is_cancelled()
                    && self.older_stream_receiving(&session)),
            from_backlog,
            sending,
        };
        // Noted as sent live and not delivered after all: sent from the mail, where they go.
        for message in &held {
            sent_on_arrival.unsent(&message.id);
        }
        if let Some(unread) = later {
            // The bridge ends the stream: the client still reads what is queued, and only
            // what it leaves unread when it goes comes back, later.
            let synapse = self.clone();
            let agent = agent.clone();
            let left = left.clone();
            let sent = sent.clone();
            let mut sent_on_arrival = std::mem::take(&mut sent_on_arrival);
            tokio::spawn(async move {
                let unread = unread.await.unwrap_or_default();
                for message in unread.messages {
                    sent_on_arrival.unsent(&message.id);
                    synapse.send_back(&agent, message, &left);
                }
                sent_on_arrival.closed();
                if !unread.holds.is_empty() && !synapse.shutdown.is_cancelled() {
                    synapse.outbound.flush().await;
                }
                drop(left);
                holds_until_sent(unread.holds, sent);
            });
        } else {
            sent_on_arrival.closed();
        }
        let kept = !held.is_empty();
        for message in held {
            self.send_back(&agent, message, &left);
        }
        drop(tx);
        // Kept before the fleet hears the agent left, and before the batches that routed
        // them here are acknowledged (`holds`): a bridge killed then has kept what the
        // stream had not sent.
        let told = kind == StreamKind::Messages || !holds.is_empty();
        if kept && told && !self.shutdown.is_cancelled() {
            self.outbound.flush().await;
        }
        drop(left);
        holds_until_sent(holds, sent);
        if kind == StreamKind::Messages {
            self.stream_closed(&agent, session.id).await;
        }
    }

    /// Moves what waits in a closing stream's mailbox into `held`, encoded, and the holds
    /// of their deliveries into `holds`.
    fn drain(
        &self,
        mailbox: &crate::core::Mailbox,
        held: &mut Vec<SynapseMessage>,
        holds: &mut Vec<Outstanding>,
    ) {
        // `take_left`, not `try_recv`: a mailbox closed by an overflow still holds them.
        for delivery in mailbox.take_left() {
            if let Some(message) = self.encode(&delivery) {
                held.push(message);
                holds.extend(delivery.held());
                delivery.written_to(PROTOCOL);
            }
        }
    }

    /// Sends on what a closed stream did not deliver: what it took from the inbox goes
    /// back there, the rest the way `agent` is reached with no stream open — unless the
    /// agent's older stream has it: what was routed to it, not the stream's own answers
    /// (a nack, from the bridge), which only it was sent.
    fn send_back(&self, agent: &str, message: SynapseMessage, left: &Leftovers) {
        let answer = || (message.sender.as_ref()).is_some_and(|s| s.agent_id == BRIDGE_AGENT);
        let sending = Some(left.sending.clone());
        match left.from_backlog.get(&message.id) {
            Some(&taken_at) => {
                (self.outbound).keep(agent, message, Keeping::Again(taken_at), sending)
            }
            None if left.covered && !answer() => {}
            None => {
                let route = self.route_for(agent, false);
                self.send_by(agent, route, message, sending);
            }
        }
    }

    /// What waited in the agent's inbox while it was away, oldest first, for a stream that
    /// is now its way in. The messages leave the inbox as they are taken.
    async fn backlog(&self, agent: &str, kind: StreamKind) -> TakenMail<FromInbox> {
        // A group stream carries group traffic only; an agent that polls or takes callbacks
        // keeps its inbox for those.
        if kind != StreamKind::Messages || self.route_for(agent, true) != Route::Stream {
            return TakenMail::all(Vec::new());
        }
        self.take_inbox(agent).await.unwrap_or_else(|status| {
            tracing::error!(agent, error = %status.message(), "synapse: cannot read the inbox");
            TakenMail::all(Vec::new())
        })
    }

    async fn accept_from_stream(
        &self,
        msg: SynapseMessage,
        kind: StreamKind,
        hints: &Hints,
        out: &StreamSender,
        storing: &mut InFlight<SynapseMessage>,
    ) {
        if kind == StreamKind::Groups && msg.group_id.is_empty() {
            let status =
                Status::invalid_argument("message.group_id is required on StreamGroupMessages");
            return self.refuse_on_stream(&msg, &status, out).await;
        }
        let sent = translate::answerable(&msg);
        // A synchronous send is routed at once: what the stream sent before it goes first.
        let receiver = msg.receiver.as_ref().map(|r| r.agent_id.as_str());
        if !storing.is_empty()
            && self.sends_synchronously(receiver.filter(|r| !r.is_empty()), hints)
        {
            self.settle(storing, out).await;
        }
        match self.stage(msg, hints).await {
            Ok((_, None)) => {}
            Ok((_, Some(staged))) => storing.push(staged, sent),
            Err(status) => self.refuse_on_stream(&sent, &status, out).await,
        }
    }

    /// Answers a refused message in the stream's own terms: the stream itself stays open.
    async fn refuse_on_stream(&self, msg: &SynapseMessage, why: &Status, out: &StreamSender) {
        telemetry::decode_error(PROTOCOL);
        let _ = out.send(self.nack(msg, why)).await;
    }
}

/// The agent's inbox as one stream takes it.
#[derive(Default)]
struct Backlog {
    /// The messages the stream took, by id, each with the revision of the fleet's record
    /// it was taken at: one its client leaves unread goes back into the inbox over its
    /// take rather than being kept anew (which a message already taken is not).
    taken: HashMap<String, Option<Revision>>,
    /// When to take again what a take NATS did not answer left in the inbox.
    retake_at: Option<Timer>,
    /// What the stream sent live as it opened: a bridge not yet seeing the agent here may
    /// have kept it in the inbox too, and that copy, taken, is not sent again.
    sent_on_arrival: SentOnArrival,
    /// The holds of messages routed here that the stream gave back unsent: kept until
    /// they are kept elsewhere (`Outstanding`).
    holds: Vec<Outstanding>,
}

/// What becomes of what a closing stream did not deliver (`send_back`).
#[derive(Clone)]
struct Leftovers {
    /// An older stream of the agent is open: it was sent every message this one was.
    covered: bool,
    /// What the stream took from the inbox, each with the revision of the fleet's record
    /// it was taken at: it goes back there.
    from_backlog: HashMap<String, Option<Revision>>,
    /// Kept by every inbox keep and callback that sends a leftover on: the holds of the
    /// batches that routed the leftovers here are let go once it is done with
    /// (`holds_until_sent`).
    sending: Outstanding,
}

/// Keeps `holds` until `sent` is cancelled: until every leftover sent on with
/// `Leftovers::sending` was kept or posted (a callback is posted after the inbox writer's
/// flush), so that a bridge killed before has the batches that routed them here read again.
fn holds_until_sent(holds: Vec<Outstanding>, sent: tokio_util::sync::CancellationToken) {
    if holds.is_empty() || sent.is_cancelled() {
        return;
    }
    tokio::spawn(async move {
        sent.cancelled().await;
        drop(holds);
    });
}

/// A stream's wait before it takes its backlog again: boxed, as it is rare and every idle
/// stream's task would hold it inline.
type Timer = std::pin::Pin<Box<tokio::time::Sleep>>;

fn take_again_timer() -> Timer {
    Box::pin(tokio::time::sleep(TAKE_AGAIN_AFTER))
}

/// Resolves when `timer` runs out; never without one.
async fn run_out(timer: &mut Option<Timer>) {
    match timer {
        Some(timer) => timer.await,
        None => std::future::pending().await,
    }
}

/// A stream connected to the router, waiting to be served.
pub struct OpenStream {
    agent: String,
    kind: StreamKind,
    mailbox: Arc<crate::core::Mailbox>,
    session: Arc<crate::core::Session>,
    /// Wakes the stream to take what was kept in the agent's inbox while it is open.
    wake: Arc<tokio::sync::Notify>,
    /// The bridge of the fleet that held the agent before this stream, if another did.
    moved_from: Option<String>,
}

/// What an open stream of `agent` takes.
struct StreamInterest {
    agent: String,
    kind: StreamKind,
    synapse: std::sync::Weak<Synapse>,
}

impl Interest for StreamInterest {
    fn accepts(&self, env: &Envelope) -> bool {
        let group = matches!(env.audience, Audience::Group(_));
        match self.kind {
            StreamKind::Groups => group,
            StreamKind::Messages => {
                if env.kind == Kind::PresenceStatus {
                    return false;
                }
                // Group traffic goes to the group stream when the agent holds one.
                !group
                    || self
                        .synapse
                        .upgrade()
                        .is_none_or(|s| s.group_streams.get(&self.agent).is_none_or(|c| *c == 0))
            }
        }
    }

    fn can_observe(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batches' holds a closing stream kept are let go only once what sent its
    /// leftovers on (a callback not yet posted) let go of its own.
    #[tokio::test]
    async fn a_closing_streams_holds_wait_for_what_sends_its_leftovers_on() {
        let (batch, acknowledged) = Outstanding::new();
        let (sending, sent) = Outstanding::new();
        let callback = sending.clone();
        holds_until_sent(vec![batch], sent);
        drop(sending);
        tokio::task::yield_now().await;
        assert!(
            !acknowledged.is_cancelled(),
            "the callback is not posted yet"
        );
        drop(callback);
        tokio::time::timeout(std::time::Duration::from_secs(5), acknowledged.cancelled())
            .await
            .expect("let go once it is");
    }
}
