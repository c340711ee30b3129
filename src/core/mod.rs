//! The protocol-agnostic heart of the bridge: the envelope, the directory of agents, the
//! router with its mailboxes, and the correlation index. Nothing here knows a wire format.

mod applied;
mod claims;
mod correlation;
mod delivery;
mod directory;
mod envelope;
mod hold;
mod in_flight;
mod log;
mod mailbox;
mod moves;
mod records;
mod router;
mod sent_on_arrival;
mod unsettled;

use std::sync::Arc;

use serde::Deserialize;

pub use applied::{AppliedMarks, CatchUp};
pub use claims::{ClaimFuture, Claiming, NameClaims};
pub use correlation::{CorrelationIndex, DERIVED_ID_NAMESPACE, Link, TaskRequest, derived_uuid};
pub use delivery::{Delivery, Recipients, Routed};
pub use directory::{AgentInfo, Directory, NameTaken, PerGeneration, Role, Status};
pub use envelope::{
    Attachment, Audience, Envelope, Kind, Origin, Priority, Protocol, TaskInfo, TaskState,
    new_message_id, now_ms,
};
pub use hold::{HeldBy, HoldersOf, Outstanding, WatchesHolders};
pub use in_flight::InFlight;
pub use log::{
    LeftUndelivered, LogError, LogFuture, MessageLog, MessageQuery, StoredMessage, UnwrittenFrom,
};
pub use mailbox::{BacklogReader, Closed, Holding, Mailbox, Pushed, WhenFull};
pub use moves::{MoveClaim, MovedHere, Moves, wait_while};
pub use records::{
    ApplyError, Expect, FAILED_APPLIED_AGAIN_EVERY, HandOver, LATE_COPY_WINDOW, Record,
    RecordChange, RecordError, RecordFuture, RecordSink, Revision, SharedRecords, TAKE_AGAIN_AFTER,
    TakenEach, TakenMail, Tried, sink, take_each, unless_lost, until_not_lost,
};
pub use router::{AddressedOnly, Interest, OfflineSink, RouteReport, Router, Session};
use sent_on_arrival::Arrivals;
pub use sent_on_arrival::SentOnArrival;
pub use unsettled::{Settled, UnsettledMail, settle_record};

use crate::shared::to_the_end::ToTheEnd;
use crate::telemetry;

/// `[routing]`: how recipients' mailboxes behave.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// Messages a connected recipient may have waiting before `when_full` applies.
    pub mailbox_capacity: std::num::NonZeroUsize,
    pub when_full: WhenFull,
    /// Under `replay`: messages a recipient may be behind past its mailbox, each kept as
    /// its id until read back; past this it is closed, to reconnect and replay.
    pub backlog_limit: usize,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            mailbox_capacity: std::num::NonZeroUsize::new(1024).expect("non-zero"),
            when_full: WhenFull::Replay,
            backlog_limit: 65_536,
        }
    }
}

/// Recent messages whose conversation links are kept in memory; a reply to an older one
/// looks its parent up in the store. Kept this small so the index stays in the
/// processor's cache; a larger one costs memory and cache misses (BENCHMARKS.md).
const CORRELATION_CACHE: usize = 16_384;

/// The bridge's own name in the directory: the sender of what the bridge says itself
/// (expiry notices, refusals) and the submitter of tasks from anonymous callers.
pub const BRIDGE_AGENT: &str = "agentbridge";
/// The directory "protocol" of the bridge's own agent.
pub const BRIDGE_PROTOCOL: Protocol = "bridge";

/// How a message another bridge of the fleet accepted, or one this bridge routes again
/// after a restart, is delivered here (`Core::accept_replica`).
#[derive(Clone, Default)]
pub struct Replicated<'a> {
    /// It is in this bridge's log too.
    pub kept: bool,
    /// What the recipients that write or keep it for an agent away hold until they did
    /// (`Delivery::held_copy`).
    pub offered: Option<&'a Outstanding>,
    /// Which of its recipients it is routed to (`Recipients`).
    pub recipients: Recipients,
}

/// A message whose store write is queued (see `Core::stage`).
pub struct Staged {
    env: Envelope,
    /// Its store write, queued.
    write: LogFuture<'static, ()>,
    /// The core that first remembered its id as it was staged (`Core::recently_seen`),
    /// with that record's stamp, which forgets it again if the write fails: a refused
    /// message was not seen, and its sender's retry — here, or through another bridge of
    /// the fleet — is not a repeat.
    remembered_by: Option<(std::sync::Weak<Core>, u64)>,
}

/// A staged message `publish_staged` has not routed yet: dropped so, it is routed once
/// durable, by a task of its own.
struct Unrouted<'a> {
    core: &'a Core,
    staged: Option<Staged>,
}

impl Drop for Unrouted<'_> {
    fn drop(&mut self) {
        let Some(staged) = self.staged.take() else {
            return;
        };
        let Some(core) = self.core.me.upgrade() else {
            return;
        };
        tokio::spawn(async move {
            if let Ok(env) = staged.durable().await {
                core.route(env);
            }
        });
    }
}

impl Staged {
    /// The message, once its write is durable.
    pub async fn durable(mut self) -> Result<Envelope, LogError> {
        self.written().await?;
        Ok(self.env)
    }

    /// Ends with its write. Cancel-safe: a failure is handled in the poll that sees it.
    async fn written(&mut self) -> Result<(), LogError> {
        let written = (&mut self.write).await;
        if written.is_err()
            && let Some((core, stamp)) = self.remembered_by.take()
            && let Some(core) = core.upgrade()
        {
            core.correlation.forget(&self.env.id, stamp);
        }
        written
    }
}

pub struct Core {
    pub directory: Arc<Directory>,
    pub router: Router,
    pub correlation: CorrelationIndex,
    /// The log of record every accepted message is appended to.
    pub log: Arc<dyn MessageLog>,
    /// What the endpoints' hubs applied of it.
    pub applied: Arc<dyn AppliedMarks>,
    /// Where names are claimed fleet-wide, when the bridge is one of a fleet.
    claims: std::sync::OnceLock<Arc<dyn NameClaims>>,
    /// Claims of one name, one at a time.
    claim_locks: Arc<claims::ClaimLocks>,
    /// Where endpoints keep the records a fleet shares, when the bridge is one of a fleet.
    records: std::sync::OnceLock<Arc<dyn SharedRecords>>,
    /// Agents that moved here from other bridges of the fleet lately.
    pub moves: Moves,
    /// Agents that connected here lately, with what their connections sent live since.
    arrivals: Arrivals,
    /// Itself, for what must finish after its caller is gone (`publish_staged`).
    me: std::sync::Weak<Core>,
    /// The endpoints' work that must not stop half-way when its client goes, waited for as
    /// the bridge stops.
    pub to_the_end: ToTheEnd,
}

impl Core {
    pub fn new(
        log: Arc<dyn MessageLog>,
        applied: Arc<dyn AppliedMarks>,
        routing: &RoutingConfig,
    ) -> Arc<Core> {
        let directory = Arc::new(Directory::new());
        let mut bridge = AgentInfo::new(BRIDGE_AGENT, BRIDGE_PROTOCOL, BRIDGE_AGENT);
        bridge.description = Some("agentbridge".into());
        bridge.agent_type = Some("bridge".into());
        bridge.listed = false;
        directory
            .register(bridge)
            .expect("an empty directory has room for the bridge");
        let core = Arc::new_cyclic(|me| Core {
            me: me.clone(),
            router: Router::new(
                directory.clone(),
                routing.mailbox_capacity.get(),
                routing.when_full,
                routing.backlog_limit,
            ),
            directory,
            correlation: CorrelationIndex::new(CORRELATION_CACHE),
            log,
            applied,
            claims: std::sync::OnceLock::new(),
            claim_locks: Arc::default(),
            records: std::sync::OnceLock::new(),
            moves: Moves::default(),
            arrivals: Arrivals::default(),
            to_the_end: ToTheEnd::default(),
        });
        let log = core.log.clone();
        core.router
            .set_backlog_reader(Arc::new(move |ids: Vec<String>| {
                let log = log.clone();
                Box::pin(async move {
                    match log.read_ids(ids).await {
                        Ok(stored) => Some(stored.into_iter().map(|m| m.envelope).collect()),
                        Err(e) => {
                            tracing::error!(error = %e, "cannot read a mailbox's backlog back");
                            None
                        }
                    }
                })
            }));
        let weak = Arc::downgrade(&core);
        core.router
            .set_expiry_handler(Arc::new(move |delivery, protocol| {
                if let Some(core) = weak.upgrade() {
                    core.expired(&delivery, protocol);
                }
            }));
        core
    }

    /// Names registered from now on are claimed through `claims` first.
    pub fn set_claims(&self, claims: Arc<dyn NameClaims>) {
        let _ = self.claims.set(claims);
    }

    /// Takes `[routing]` read again: the connections that open from now on get mailboxes
    /// as it says.
    pub fn reconfigure_routing(&self, routing: &RoutingConfig) {
        self.router.reconfigure(
            routing.mailbox_capacity.get(),
            routing.when_full,
            routing.backlog_limit,
        );
    }

    /// Endpoints keep their shared records through `records` from now on.
    pub fn set_records(&self, records: Arc<dyn SharedRecords>) {
        let _ = self.records.set(records);
    }

    /// The records a fleet shares; `None` for a bridge alone, whose endpoints keep their
    /// state in their own tables only.
    pub fn records(&self) -> Option<&Arc<dyn SharedRecords>> {
        self.records.get()
    }

    /// Registers an agent a client asked for (not one the config declares, which every
    /// bridge of a fleet declares alike): claimed fleet-wide first when there is a fleet,
    /// so that of two bridges registering one name at once, one is refused. An agent
    /// another bridge holds stays held there (it moves as it connects: `claim_move`).
    pub async fn register(&self, info: AgentInfo) -> Result<(), NameTaken> {
        self.claim(info, Claiming::Held).await
    }

    /// Registers a registration the whole fleet keeps (a shared record): in a fleet, its
    /// name stays claimed for it after this bridge is gone (`Claiming::Registration`).
    pub async fn register_for_fleet(&self, info: AgentInfo) -> Result<(), NameTaken> {
        self.claim(info, Claiming::Registration).await
    }

    /// Registers an agent the fleet registered as held by this bridge, moving its name's
    /// claim here from the bridge that last held it (`Claiming::Move`). Refused while it
    /// is online through another bridge, or when another agent holds the name.
    pub async fn move_here(&self, info: AgentInfo) -> Result<(), NameTaken> {
        self.claim(info, Claiming::Move).await
    }

    async fn claim(&self, info: AgentInfo, how: Claiming) -> Result<(), NameTaken> {
        let moving = how == Claiming::Move;
        self.directory.check_claim(&info, moving)?;
        // The same agent, held by another bridge: it stays there until it connects here
        // (`claim_move`).
        let held_elsewhere = (self.directory.get(&info.name))
            .is_some_and(|held| held.bridge.is_some() && held.is_same_agent(&info));
        if how == Claiming::Held && held_elsewhere {
            return Ok(());
        }
        let register = |info| match moving {
            true => self.directory.register_moved(info),
            false => self.directory.register(info),
        };
        let Some(claims) = self.claims.get() else {
            return register(info);
        };
        let locks = &self.claim_locks;
        let claimed =
            claims::claim_to_the_end(locks, claims, &self.directory, &info, how, None).await?;
        let registered = register(info);
        // Given up unless the directory holds the name here now.
        drop(claimed);
        registered
    }

    /// What a connection of `agent` opening now remembers of what it, and the agent's
    /// connections here that closed lately, were sent live, in a fleet (`sent_on_arrival`).
    pub fn sent_on_arrival(&self, agent: &str) -> SentOnArrival {
        self.arrivals.opening(self.records().is_some(), agent)
    }

    /// Whether this bridge is one of a fleet (its names are claimed fleet-wide).
    pub fn in_fleet(&self) -> bool {
        self.claims.get().is_some()
    }

    /// Frees a name `register` claimed, if `protocol` holds it.
    pub fn unregister(&self, name: &str, protocol: Protocol) -> Option<AgentInfo> {
        let removed = self.directory.unregister(name, protocol)?;
        if let Some(claims) = self.claims.get() {
            claims.release(&removed);
        }
        Some(removed)
    }

    /// A message that waited longer than its ttl for a recipient of `protocol`: dropped,
    /// counted, and its sender told with an error message (`TTL_EXPIRED`) answering it.
    pub fn expired(self: &Arc<Self>, delivery: &Delivery, protocol: Protocol) {
        telemetry::message_dropped(protocol, telemetry::DropReason::TtlExpired);
        let env = &delivery.envelope;
        if env.from == BRIDGE_AGENT || env.kind == Kind::Error {
            return;
        }
        let mut notice = Envelope::new(BRIDGE_PROTOCOL, BRIDGE_AGENT, Kind::Error);
        notice.to = vec![env.from.clone()];
        notice.audience = Audience::Private;
        notice.reply_to = Some(env.id.clone());
        notice.correlation_id = Some(env.id.clone());
        notice.priority = Priority::High;
        notice.text = Some(format!(
            "message {} was not delivered within its ttl of {} s",
            env.id,
            env.ttl_secs.unwrap_or(0)
        ));
        notice.data = Some(serde_json::json!({
            "error_code": "TTL_EXPIRED",
            "error_message": notice.text,
            "recoverable": true,
        }));
        let core = self.clone();
        tokio::spawn(async move {
            if let Err(e) = core.publish(notice).await {
                tracing::error!(error = %e, "cannot store a ttl notice");
            }
        });
    }

    /// Accepts a message: writes it to the store, then routes it. When this returns the
    /// message is durable and queued for every recipient.
    pub async fn publish(&self, env: Envelope) -> Result<Arc<Delivery>, LogError> {
        self.publish_staged(self.stage(env).await).await
    }

    /// The second half of `publish`: routes a staged message once it is durable. A caller
    /// dropped meanwhile (an HTTP client that went away) does not leave it stored and never
    /// routed: it is routed once durable all the same, and a client sending it again is
    /// told it was accepted, as a repeat.
    pub async fn publish_staged(&self, staged: Staged) -> Result<Arc<Delivery>, LogError> {
        let mut unrouted = Unrouted {
            core: self,
            staged: Some(staged),
        };
        let staged = unrouted.staged.as_mut().expect("staged until written");
        let written = staged.written().await;
        let staged = unrouted.staged.take().expect("staged until written");
        written?;
        Ok(self.route(staged.env))
    }

    /// The first half of `publish`, for a connection that keeps reading while its earlier
    /// messages are written: places the message in its conversation and queues its store
    /// write, in call order. Once `Staged::durable` resolves, `route` delivers it; routing
    /// staged messages in the order they were staged keeps a sender's messages in order.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps its argument twice in its state"
    )]
    pub fn stage(&self, mut env: Envelope) -> impl Future<Output = Staged> + Send + '_ {
        // A block, not an `async fn`: that keeps its argument and the local it moves it
        // into both in its state, two envelopes in every message's future.
        async move {
            self.link_conversation(&mut env).await;
            let remembered_by = self.remember(&env).map(|stamp| (self.me.clone(), stamp));
            let write = self.log.append(&env);
            Staged {
                env,
                write,
                remembered_by,
            }
        }
    }

    /// Routes a message that is not kept (control signals, status changes).
    pub async fn publish_transient(&self, mut env: Envelope) -> Arc<Delivery> {
        self.link_conversation(&mut env).await;
        self.remember(&env);
        self.log.pass_on(&env);
        self.route_delivery(Delivery::new(env))
    }

    /// Delivers a message another bridge of the fleet accepted (and placed in its
    /// conversation), or one this bridge routes again after a restart, as `how` says.
    pub fn accept_replica(&self, env: Envelope, how: Replicated<'_>) -> Arc<Delivery> {
        self.remember(&env);
        let mut delivery = if how.kept {
            Delivery::stored(env)
        } else {
            Delivery::new(env)
        };
        if let Some(outstanding) = how.offered {
            delivery.offer(outstanding);
        }
        delivery.route_to(how.recipients);
        self.route_delivery(delivery)
    }

    /// Whether a message with this id passed through this bridge recently (its place in
    /// its conversation is remembered).
    pub fn recently_seen(&self, id: &str) -> bool {
        self.correlation.link(id).is_some()
    }

    /// Delivers an accepted message, durable in the store, to its recipients' mailboxes.
    pub fn route(&self, env: Envelope) -> Arc<Delivery> {
        let mut delivery = Delivery::stored(env);
        // Offered while routing; after it, only the deliveries that took it up hold it.
        let hold = self.log.delivery_hold(&delivery.envelope.id);
        if let Some(hold) = &hold {
            delivery.offer(hold);
        }
        self.route_delivery(delivery)
    }

    fn route_delivery(&self, delivery: Delivery) -> Arc<Delivery> {
        let env = &delivery.envelope;
        telemetry::message_received(&env.origin.protocol, env.kind.family());
        // With `debug` logs, a log search follows a message by its ids.
        tracing::debug!(
            message_id = %env.id,
            correlation_id = env.correlation_id.as_deref().unwrap_or(""),
            protocol = %env.origin.protocol,
            from = %env.from,
            kind = env.kind.as_str(),
            "routed"
        );
        let delivery = Arc::new(delivery);
        self.router.route(&delivery);
        delivery
    }

    /// Records the message's place in its conversation, for the replies that follow;
    /// the record's stamp when its id was new.
    fn remember(&self, env: &Envelope) -> Option<u64> {
        let assigned = (env.kind == Kind::TaskAssign)
            .then(|| env.task.as_ref().map(|t| t.id.as_str()))
            .flatten()
            .filter(|id| !id.is_empty());
        let new = self.correlation.record(
            &env.id,
            &env.from,
            env.reply_to.as_deref(),
            env.correlation_id.as_deref(),
            assigned,
            env.kind == Kind::DecisionRequest,
        );
        if env.kind == Kind::TaskAssign
            && let Some(task) = env.task.as_ref().filter(|t| !t.id.is_empty())
        {
            self.correlation.record_task(
                &task.id,
                TaskRequest {
                    message_id: env.id.clone(),
                    requester: env.from.clone(),
                },
            );
        }
        new
    }

    /// Places a message in its conversation:
    /// - progress or a result for a task, with no `reply_to`, answers the task's assignment;
    /// - a reply without a correlation id joins its parent's conversation;
    /// - a chat answering a request for a human decision is that decision;
    /// - a reply (or task progress) reaches the agent it answers when that agent speaks
    ///   another protocol, whose own routing rules would otherwise not deliver it there.
    async fn link_conversation(&self, env: &mut Envelope) {
        // Progress that names no task is about the task its parent assigned; an error
        // answering an assignment is that task's failure.
        // The parent's link, once looked up (the task lookup below keeps `reply_to`).
        let mut parent_link = None;
        if matches!(env.kind, Kind::TaskUpdate | Kind::TaskResult | Kind::Error)
            && env.task.as_ref().is_none_or(|t| t.id.is_empty())
            && let Some(parent) = env.reply_to.as_deref()
        {
            let link = self.link_of(parent).await;
            let assigned = link.as_ref().and_then(|l| l.task_id.clone());
            parent_link = Some(link);
            if let Some(id) = assigned {
                if env.kind == Kind::Error {
                    env.kind = Kind::TaskResult;
                    let task = env.task.get_or_insert_default();
                    task.state = Some(TaskState::Failed);
                    if task.error.is_none() {
                        task.error = env.text.clone();
                    }
                }
                if let Some(task) = env.task.as_mut() {
                    task.id = id;
                }
            }
        }
        let mut answers: Option<String> = None;
        if matches!(env.kind, Kind::TaskUpdate | Kind::TaskResult)
            && let Some(task_id) = env
                .task
                .as_ref()
                .map(|t| t.id.clone())
                .filter(|id| !id.is_empty())
        {
            let request = match self.correlation.task(&task_id) {
                Some(request) => Some(request),
                // Boxed, as the store's other reads here: inline, they would size the future
                // of every message's `stage`, which is moved whole a few times a message.
                None => self.log.task_request(&task_id).await.ok().flatten(),
            };
            if let Some(request) = request {
                if env.reply_to.is_none() {
                    env.reply_to = Some(request.message_id);
                }
                answers = Some(request.requester);
            }
        }
        let Some(parent) = env.reply_to.clone() else {
            return;
        };
        let link = match parent_link {
            Some(link) => link,
            None => self.link_of(&parent).await,
        };
        if env.correlation_id.is_none() {
            // A parent the bridge never saw still starts the conversation.
            env.correlation_id = Some(link.as_ref().map_or(parent.clone(), |l| l.root.clone()));
        }
        // A human's answer to a request for a decision is the decision.
        if env.kind == Kind::Chat && link.as_ref().is_some_and(|l| l.asks_decision) {
            env.kind = Kind::DecisionResponse;
        }
        let author = answers.or(link.map(|l| l.from));
        if let Some(author) = author
            && author != env.from
            && !env.names(&author)
            && self
                .directory
                .protocol_of(&author)
                .is_some_and(|p| p != env.origin.protocol)
        {
            env.to.push(author);
        }
    }

    /// Message `id`'s place in its conversation: remembered, else from the store.
    async fn link_of(&self, id: &str) -> Option<Link> {
        match self.correlation.link(id) {
            Some(link) => Some(link),
            None => self.log.link(id).await.ok().flatten(),
        }
    }

    /// Marks an agent online or offline and tells every protocol (a presence message to
    /// everyone, stored). `native` is the frame its own protocol announces it with, relayed
    /// unchanged to peers of that protocol.
    pub async fn announce_presence(
        &self,
        protocol: Protocol,
        name: &str,
        online: bool,
        status: Status,
        native: Option<serde_json::Value>,
    ) {
        let before = self.directory.set_presence(name, online, status);
        if before.is_some_and(|(was, _)| was != online) {
            telemetry::agent_online(protocol, online);
        }
        let kind = if online {
            Kind::PresenceJoin
        } else {
            Kind::PresenceLeave
        };
        let mut env = Envelope::new(protocol, name, kind);
        if let Some(id) = native
            .as_ref()
            .and_then(|n| n.get("id"))
            .and_then(|i| i.as_str())
        {
            env.id = id.to_owned();
        }
        env.audience = Audience::Everyone;
        env.data = Some(serde_json::json!({ "status": status.as_str() }));
        env.origin.set_native(native);
        if let Err(e) = self.publish(env).await {
            tracing::error!(error = %e, agent = name, "cannot store a presence change");
            if online {
                self.moves.join_refused(name);
            }
        }
    }

    /// Tells every protocol that an online agent is now busy, idle or plain online. Not
    /// kept: only the latest status matters, and the directory holds it.
    pub async fn announce_status(&self, protocol: Protocol, name: &str, status: Status) {
        self.directory.set_presence(name, true, status);
        let mut env = Envelope::new(protocol, name, Kind::PresenceStatus);
        env.audience = Audience::Everyone;
        env.data = Some(serde_json::json!({ "status": status.as_str() }));
        self.publish_transient(env).await;
    }

    /// The original id behind a UUID that `uuid_form` derived for a message; any other id
    /// is returned unchanged.
    pub async fn original_id(&self, id: &str) -> String {
        if let Some(original) = self.correlation.original_of(id) {
            return original;
        }
        match self.log.id_by_uuid(id).await {
            Ok(Some(original)) => {
                if original != id {
                    self.correlation.record_derived(id, &original);
                }
                original
            }
            _ => id.to_owned(),
        }
    }
}

/// `id` as a UUID, for protocols whose ids must be UUIDs: itself when it is one, else a
/// stable UUIDv5 of it. `Core::original_id` maps a derived one back.
pub fn uuid_form(id: &str) -> String {
    envelope::uuid_text(message_uuid(id))
}

/// `uuid_form` before it is written out.
pub fn message_uuid(id: &str) -> uuid::Uuid {
    uuid::Uuid::parse_str(id).unwrap_or_else(|_| derived_uuid("message", id))
}
