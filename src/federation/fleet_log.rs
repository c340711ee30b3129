//! The fleet's message log: the bridge's own store, and the JetStream stream every bridge
//! of the fleet reads. A message is accepted once both hold it — the local store (the
//! bridge's reads and replays) and the stream (what the other bridges apply) — so a
//! bridge killed after acknowledging a message cannot take it with it.
//!
//! While the client is disconnected, a message that only this bridge's agents take is kept
//! here alone and delivered. One that must reach another bridge (`must_cross`: it names an
//! agent another bridge holds, goes to everyone or a group, or names no one while another
//! bridge holds agents, execution logs aside) waits for the client to reconnect to another
//! server, up to the publish timeout; once NATS has been away for longer than that, it is
//! refused at once, in the sender's protocol — never acknowledged and then lost. Nothing is
//! sent while disconnected, and a publish that fails while connected (a stream leader being
//! elected) is sent again under the same id, until the publish timeout.
//!
//! A message kept here alone while NATS was away is published once it is back (within
//! `SHARE_CHECK`; it waits in a file of the data directory meanwhile, `unshared`, so also
//! after a restart), so the other bridges' history and replays have it too; they keep it
//! without routing it (`Replica::history`), so when it is published beside later messages
//! changes no one's order of delivery.
//!
//! Messages appended while the previous publish was being sent go to the stream together,
//! as one NATS message holding their list (`BATCH`): under load, JetStream stores,
//! replicates, acknowledges and delivers a batch at the cost of one message, which is most
//! of what a message that crosses costs the fleet. Alone, a message goes as itself, under
//! its own id; a batch goes under an id of its own (`batch:<uuid>`, which no message's can
//! collide with), the same when it is sent again.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::cards::CardKeeper;
use super::link::NatsLink;
use super::own_deliveries::OwnDeliveries;
use super::publisher::{ANSWER_WITHIN, Publisher, refused_unreachable};
use super::unshared::{Outgoing, Unshared};
use super::unsure::Unsure;
use super::wire::{Card, OutgoingReplica};
use crate::core::{
    Audience, Directory, Envelope, Kind, Link, LogError, LogFuture, MessageLog, MessageQuery,
    Outstanding, StoredMessage, TaskRequest,
};

/// The hold of a message being appended, kept for its routing once the append completes.
/// Otherwise the message is not routed here: its hold goes, and if its publish may be in
/// the stream (JetStream took it, or did not answer, or the append was given up before it
/// was known) it is applied as another bridge's when read back (`OwnDeliveries`).
struct HoldUntilAppended {
    own: Arc<OwnDeliveries>,
    unsure: Arc<Unsure>,
    id: String,
    /// Whether the message has a hold of its own (not so past `OwnDeliveries`' room, or
    /// while another message with its id is being appended, whose hold is not this one's).
    held: bool,
    settled: bool,
}

impl HoldUntilAppended {
    /// The append completed: the message's routing takes its hold.
    fn completed(mut self) {
        self.settled = true;
        self.own.appended(&self.id);
    }

    /// The append failed, after the stream took the message if `published`.
    fn failed(mut self, published: bool) {
        self.settled = true;
        if self.held {
            match published || self.unsure.contains(&self.id) {
                true => self.own.not_routed(&self.id),
                false => self.own.not_appended(&self.id),
            }
        }
    }
}

impl Drop for HoldUntilAppended {
    /// Given up before it was known how the append went.
    fn drop(&mut self) {
        if !self.settled && self.held {
            self.own.not_routed(&self.id);
        }
    }
}

/// How often a bridge looks whether NATS is back to share what it kept meanwhile.
const SHARE_CHECK: Duration = Duration::from_millis(500);

pub struct FleetLog {
    local: Arc<dyn MessageLog>,
    link: Arc<NatsLink>,
    /// Publishes in the order messages were appended: one sender's messages reach the
    /// stream, and so every bridge, in the order it sent them.
    outbox: mpsc::UnboundedSender<Outgoing>,
    /// Messages kept here alone while NATS was away, to publish once it is back
    /// (`share_unshared`).
    unshared: Arc<Unshared>,
    unsure: Arc<Unsure>,
    /// Its own messages on their way to its own agents, for the applier to acknowledge
    /// their publishes once they were written.
    own: Arc<OwnDeliveries>,
    directory: OnceLock<Arc<Directory>>,
    /// Puts the cards of this bridge's agents in the agents bucket.
    cards: Arc<CardKeeper>,
}

impl FleetLog {
    /// The log over `local`, and the task that publishes to the stream (of `replicas`
    /// copies; a message waits `timeout` for it); what waits to be shared with it is kept
    /// in `unshared`, `cards` puts the cards of its agents, and `own` follows its own
    /// messages to its own agents.
    pub fn new(
        local: Arc<dyn MessageLog>,
        link: Arc<NatsLink>,
        unshared: Arc<Unshared>,
        cards: Arc<CardKeeper>,
        own: Arc<OwnDeliveries>,
        timeout: Duration,
        replicas: usize,
    ) -> (Arc<FleetLog>, Publisher) {
        let (outbox, queued) = mpsc::unbounded_channel();
        let unsure = Arc::<Unsure>::default();
        let log = Arc::new(FleetLog {
            local,
            link: link.clone(),
            outbox,
            unshared: unshared.clone(),
            unsure: unsure.clone(),
            own: own.clone(),
            directory: OnceLock::new(),
            cards,
        });
        (
            log,
            Publisher {
                link,
                queued,
                unshared,
                unsure,
                own,
                timeout,
                answer_within: if replicas > 1 { ANSWER_WITHIN } else { timeout },
            },
        )
    }

    /// The directory whose cards go with presence changes.
    pub fn set_directory(&self, directory: Arc<Directory>) {
        let _ = self.directory.set(directory);
    }

    /// Whether `env` must reach an agent another bridge holds. A message that names no
    /// one is for whoever observes it (a Grid broadcast is every Grid program's, a chat
    /// without mentions a Skynet human's or a Tracker project's): it must, when another
    /// bridge holds agents. Execution logs are the exception: only humans watching their
    /// agent observe them, and, like an observer of a message that names agents here,
    /// those elsewhere find it in the fleet's history once NATS is back.
    fn must_cross(&self, env: &Envelope) -> bool {
        let Some(directory) = self.directory.get() else {
            return true;
        };
        let mut named = env.to.iter().chain(&env.mentions).peekable();
        match &env.audience {
            Audience::Everyone | Audience::Group(_) => true,
            Audience::Addressed if named.peek().is_none() => {
                env.kind != Kind::Log && directory.any_held_elsewhere()
            }
            Audience::Addressed | Audience::Private => {
                named.any(|name| directory.held_elsewhere(name))
            }
        }
    }

    /// The card that goes with a presence change, so that every bridge knows the agent
    /// before it routes the change.
    fn card(&self, env: &Envelope) -> Option<Card> {
        if !matches!(
            env.kind,
            Kind::PresenceJoin | Kind::PresenceLeave | Kind::PresenceStatus
        ) {
            return None;
        }
        let info = self.directory.get()?.get(&env.from)?;
        info.bridge
            .is_none()
            .then(|| Card::of(&info, &self.link.bridge_id))
    }

    /// Queues `env` for the stream, with what says when its deliveries here are done, if it
    /// is to wait for them; the receiver says when JetStream holds it.
    fn publish(
        &self,
        env: &Envelope,
        transient: bool,
        written: Option<crate::core::HeldBy>,
    ) -> oneshot::Receiver<Result<(), LogError>> {
        let (accepted, told) = oneshot::channel();
        let card = self.card(env);
        if let Some(card) = &card {
            self.cards.keep(&card.name);
        }
        let replica = OutgoingReplica {
            envelope: env,
            agent: card,
            transient,
            history: false,
            resent: self.unsure.contains(&env.id),
        };
        let outgoing = match replica.to_json() {
            Ok(payload) => Outgoing {
                id: env.id.clone(),
                payload: payload.into(),
                accepted: Some(accepted),
                written,
            },
            Err(e) => {
                let _ = accepted.send(Err(LogError::Failed(e.into())));
                return told;
            }
        };
        if let Err(mpsc::error::SendError(mut outgoing)) = self.outbox.send(outgoing)
            && let Some(accepted) = outgoing.accepted.take()
        {
            let _ = accepted.send(Err(LogError::Closed));
        }
        told
    }

    /// `env`, which this bridge's agents alone take and have been given, as history to
    /// publish once NATS is back: the other bridges keep it and do not route it (its
    /// recipients were here, and a bridge that took this one for gone meanwhile would
    /// otherwise keep it for them again).
    fn history_of(env: &Envelope) -> Option<Outgoing> {
        let replica = OutgoingReplica {
            envelope: env,
            agent: None,
            transient: false,
            history: true,
            resent: false,
        };
        let payload = replica.to_json().ok()?;
        Some(Outgoing::history(env.id.clone(), payload.into()))
    }

    /// Shares what was kept while NATS was away as soon as it is back, also when nothing
    /// new is appended then; until `shutdown`.
    pub async fn share_when_back(self: Arc<Self>, shutdown: CancellationToken) {
        let mut every = tokio::time::interval(SHARE_CHECK);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = every.tick() => self.share_unshared(),
            }
        }
    }

    /// Queues for the stream the messages kept here alone while NATS was away, once it is
    /// back (while it fails over they wait: a publish refused then would only put them
    /// back).
    fn share_unshared(&self) {
        if self.link.ready().is_none() {
            return;
        }
        let waiting = self.unshared.take_all();
        if waiting.is_empty() {
            return;
        }
        tracing::info!(
            count = waiting.len(),
            "federation: sharing the messages kept while NATS was away"
        );
        for outgoing in waiting {
            if self.outbox.send(outgoing).is_err() {
                return; // shutting down; the file keeps them for the next run
            }
        }
    }
}

impl MessageLog for FleetLog {
    fn append(&self, env: &Envelope) -> LogFuture<'static, ()> {
        if self.link.ready().is_none() {
            if !self.must_cross(env) {
                // Only this bridge's agents take it: kept here, not held up by NATS, and,
                // once kept, shared with the fleet's history when NATS is back.
                let (local, history, unshared) = (
                    self.local.append(env),
                    Self::history_of(env),
                    self.unshared.clone(),
                );
                return Box::pin(async move {
                    local.await?;
                    if let Some(history) = history {
                        unshared.keep(history).await;
                    }
                    Ok(())
                });
            }
            if self.link.unreachable() {
                return Box::pin(std::future::ready(Err(refused_unreachable())));
            }
            // A server is failing over: the publisher waits for the client to reconnect.
        }
        let local = self.local.append(env);
        let written = self.own.appending(&env.id);
        let appending = HoldUntilAppended {
            own: self.own.clone(),
            unsure: self.unsure.clone(),
            id: env.id.clone(),
            held: written.is_some(),
            settled: false,
        };
        let published = self.publish(env, false, written);
        let (log, id) = (self.local.clone(), env.id.clone());
        Box::pin(async move {
            let (local, published) = tokio::join!(local, published);
            let published = published.unwrap_or(Err(LogError::Closed));
            match (local, published) {
                (Ok(()), Ok(())) => {
                    appending.completed();
                    Ok(())
                }
                (local, published) => {
                    appending.failed(published.is_ok());
                    // Refused, so never routed: the store's log has it done with, rather
                    // than pending for good (`store::redelivery`).
                    if local.is_ok() {
                        drop(log.delivery_hold(&id));
                    }
                    local.and(published)
                }
            }
        })
    }

    fn pass_on(&self, env: &Envelope) {
        if self.link.ready().is_some() {
            drop(self.publish(env, true, None));
        }
    }

    /// What its acknowledgement waits for (`OwnDeliveries`), and what keeps it pending in
    /// the store's log until then (`store::redelivery`).
    fn delivery_hold(&self, id: &str) -> Option<Outstanding> {
        Outstanding::both(self.own.hold_of(id), self.local.delivery_hold(id))
    }

    fn read(&self, query: MessageQuery) -> LogFuture<'_, Vec<StoredMessage>> {
        self.local.read(query)
    }

    fn read_ids(&self, ids: Vec<String>) -> LogFuture<'_, Vec<StoredMessage>> {
        self.local.read_ids(ids)
    }

    fn get(&self, id: &str) -> LogFuture<'_, Option<StoredMessage>> {
        self.local.get(id)
    }

    fn replies(&self, id: &str) -> LogFuture<'_, Vec<StoredMessage>> {
        self.local.replies(id)
    }

    fn contains(&self, id: &str) -> LogFuture<'_, bool> {
        self.local.contains(id)
    }

    fn link(&self, id: &str) -> LogFuture<'_, Option<Link>> {
        self.local.link(id)
    }

    fn task_request(&self, task_id: &str) -> LogFuture<'_, Option<TaskRequest>> {
        self.local.task_request(task_id)
    }

    fn id_by_uuid(&self, uuid: &str) -> LogFuture<'_, Option<String>> {
        self.local.id_by_uuid(uuid)
    }
}
