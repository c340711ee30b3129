//! The Grid endpoint: YAML messages over HTTP (`POST`/`GET /grid/v1/messages`) and a
//! WebSocket (`/grid/v1/ws`), and the shared scratchpad file(s) Grid programs read and
//! append to, as `grid-message-protocol.md` describes them.
//!
//! A Grid program is known by its `sender.agent` (the configured `programs` are known
//! before they are seen). A message for a program with an open socket goes there; otherwise
//! it is queued for `GET /grid/v1/messages` (or the program's next socket) and appended to
//! the scratchpad. `receiver: broadcast` reaches every Grid program (and is observed by the
//! humans of other protocols); another protocol's message to everyone reaches every Grid
//! program as a broadcast.

mod config;
mod db;
mod entry;
mod http;
mod order;
mod scratchpad;
mod shared_queue;
mod sockets;
/// Grid message ⇄ Envelope; public for `benches/translate.rs`.
pub mod translate;
/// Grid messages: parsing, validation, YAML; public for `benches/translate.rs`.
pub mod wire;
mod writer;
mod ws;

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use dashmap::DashSet;
use parking_lot::Mutex;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use config::Config;

use super::endpoint::{Endpoint, Listening, Reloader};
use super::{Context, Running, StartError};
use crate::core::{
    AgentInfo, Core, Delivery, Envelope, Kind, LogError, MoveClaim, OfflineSink, Protocol, Staged,
    UnsettledMail,
};
use crate::protocols::endpoint::{Decoded, Translation};
use crate::protocols::hub::{Hub, HubFilter};
use crate::shared::budget::ByteBudget;
use crate::telemetry;
use db::Db;
use wire::{Invalid, Message, Party};
use writer::Outgoing;

pub const PROTOCOL: Protocol = "grid";

/// Ids of messages the scratchpad holds (read from it or appended), remembered so none is
/// written to it again; and of expired messages whose sender was told, so it is told once.
const RECENT_MEMORY: usize = 10_000;

/// A bounded memory of recent ids.
#[derive(Default)]
struct Recent {
    ids: HashSet<String>,
    order: VecDeque<String>,
}

impl Recent {
    /// Remembers `id`; false when it was remembered already.
    fn remember(&mut self, id: &str) -> bool {
        if !self.ids.insert(id.to_owned()) {
            return false;
        }
        self.order.push_back(id.to_owned());
        while self.order.len() > RECENT_MEMORY {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
        true
    }
}

/// Where an accepted message came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Http,
    Socket,
    Scratchpad,
}

/// The refusal of a name another agent holds.
fn name_taken(taken: crate::core::NameTaken) -> Invalid {
    Invalid {
        code: "NAME_TAKEN",
        field: "sender.agent".into(),
        message: taken.to_string(),
        id: None,
        sender: None,
    }
}

/// The refusal of a message that could not be stored.
pub fn store_failed(id: &str, sender: &Party, error: &LogError) -> Invalid {
    tracing::error!(error = %error, "grid: cannot store a message");
    Invalid {
        code: "STORE_FAILED",
        field: "message".into(),
        message: error.tell_sender("the message could not be stored; it was not delivered"),
        id: Some(id.to_owned()),
        sender: Some(Box::new(sender.clone())),
    }
}

pub struct Grid {
    core: Arc<Core>,
    config: Config,
    /// The scratchpad files (`[grid] scratchpad`), and the programs known before they are
    /// seen (`[grid] programs`): what a reload of the config changes while running.
    scratchpads: ArcSwap<Vec<std::path::PathBuf>>,
    declared_programs: ArcSwap<Vec<String>>,
    db: Db,
    /// Grid programs the bridge knows.
    programs: DashSet<String>,
    /// Programs' open sockets.
    sockets: sockets::Sockets,
    /// Queued messages of the fleet's whose take this bridge cannot be sure of.
    unsettled: UnsettledMail,
    /// Ids of messages the scratchpad holds: read from it, or appended by the bridge. A
    /// message is written to it once, however many programs it is kept for.
    in_scratchpad: Mutex<Recent>,
    /// Expired messages whose sender was told.
    expiry_told: Mutex<Recent>,
    outgoing: mpsc::UnboundedSender<Outgoing>,
    shutdown: CancellationToken,
    read_budget: ByteBudget,
}

impl Endpoint for Grid {
    const NAME: &'static str = PROTOCOL;
    type Config = Config;
    type Translation = translate::Translator;

    fn listeners(config: &Config) -> Vec<Listening> {
        vec![Listening {
            serves: "http /grid/v1 + websocket /grid/v1/ws",
            addr: config.listen,
        }]
    }

    /// Scratchpad paths are taken from the config file's directory.
    fn resolve_paths(config: &mut Config, base: &std::path::Path) {
        for pad in &mut config.scratchpad.0 {
            if pad.is_relative() {
                *pad = base.join(&*pad);
            }
        }
    }

    async fn start(config: &Config, ctx: &Context) -> Result<Running, StartError> {
        start(config, ctx).await
    }

    const RELOADABLE: &'static [&'static str] = &["scratchpad", "programs"];

    /// The scratchpad files watched and appended to, and the programs known before they
    /// are seen, from now on.
    async fn reload(self: &Arc<Self>, config: &Config) -> Result<(), String> {
        self.scratchpads
            .store(Arc::new(config.scratchpad.0.clone()));
        self.declared_programs
            .store(Arc::new(config.programs.clone()));
        Ok(())
    }
}

pub async fn start(config: &Config, ctx: &Context) -> Result<Running, StartError> {
    let (core, shutdown) = (ctx.core.clone(), ctx.shutdown.clone());
    let fail = |e: &dyn std::fmt::Display| StartError::new(PROTOCOL, e);
    let db = Db::open(ctx.store.clone()).await.map_err(|e| fail(&e))?;
    scratchpad::settle_appending(&db)
        .await
        .map_err(|e| fail(&e))?;
    let (outgoing, outgoing_rx) = mpsc::unbounded_channel();
    let grid = Arc::new(Grid {
        core: core.clone(),
        config: config.clone(),
        scratchpads: ArcSwap::from_pointee(config.scratchpad.0.clone()),
        declared_programs: ArcSwap::from_pointee(config.programs.clone()),
        db: db.clone(),
        programs: DashSet::new(),
        sockets: sockets::Sockets::default(),
        unsettled: UnsettledMail::default(),
        in_scratchpad: Mutex::new(Recent::default()),
        expiry_told: Mutex::new(Recent::default()),
        outgoing,
        shutdown: shutdown.clone(),
        read_budget: ctx.read_budget.clone(),
    });
    for (agent, created_at) in db.agents().await.map_err(|e| fail(&e))? {
        grid.keep(&agent, created_at)
            .map_err(|e| fail(&e.message))?;
    }
    core.router
        .set_offline_sink(PROTOCOL, Arc::new(Sink(Arc::downgrade(&grid))));
    let settler = shared_queue::follow(&grid);

    let listener = super::bind(PROTOCOL, config.listen).await?;
    let addr = listener.local_addr().map_err(|e| fail(&e))?;
    let hub = Hub::attach(&core, PROTOCOL, HUB, HubInterest);
    let reload = Reloader::of(&grid);
    let mut tasks = vec![
        tokio::spawn(grid.clone().write_outgoing(outgoing_rx, hub)),
        tokio::spawn(grid.clone().expire_queued()),
    ];
    tasks.push(tokio::spawn(grid.clone().watch_scratchpads()));
    tasks.extend(settler);
    tasks.push(super::serve(
        PROTOCOL,
        listener,
        http::router(grid),
        &ctx.limits,
        ctx.doors.clone(),
        shutdown,
    ));
    Ok(Running {
        name: PROTOCOL,
        listeners: vec![("http+ws", addr)],
        tasks,
        reload,
    })
}

impl Grid {
    /// A Grid program's directory entry.
    fn program(agent: &str, created_at: i64) -> AgentInfo {
        let mut info = AgentInfo::new(agent, PROTOCOL, agent);
        info.agent_type = Some("grid-program".into());
        info.created_at = created_at;
        info
    }

    /// Takes in a program this bridge kept from before it started.
    fn keep(&self, agent: &str, created_at: i64) -> Result<(), Invalid> {
        (self.core.directory)
            .register_known(Self::program(agent, created_at))
            .map_err(name_taken)?;
        self.programs.insert(agent.to_owned());
        Ok(())
    }

    /// Registers a program the first time it is seen: its name claimed (fleet-wide, in a
    /// fleet) and kept.
    async fn register(&self, agent: &str) -> Result<(), Invalid> {
        if self.programs.contains(agent) {
            return Ok(());
        }
        let now = crate::core::now_ms();
        (self.core.register(Self::program(agent, now)).await).map_err(name_taken)?;
        self.store_program(agent, now).await;
        Ok(())
    }

    /// Keeps `agent` among the programs this bridge has seen, here and in its store.
    pub(super) async fn store_program(&self, agent: &str, created_at: i64) {
        if !self.programs.insert(agent.to_owned()) {
            return;
        }
        if let Err(e) = self.db.add_agent(agent, created_at).await {
            tracing::error!(error = %e, agent, "grid: cannot store a program");
        }
    }

    /// Registers a program opening a socket here; when another bridge of the fleet held
    /// it, its name is claimed here, to complete once the socket is attached
    /// (`Core::claim_move`), and the program is kept as one seen here once it completes
    /// (`store_program`).
    pub(super) async fn hold_program(&self, agent: &str) -> Result<Option<MoveClaim>, Invalid> {
        let moving = self
            .core
            .claim_move(agent, PROTOCOL)
            .await
            .map_err(name_taken)?;
        if moving.is_none() {
            self.register(agent).await?;
        }
        Ok(moving)
    }

    /// Checks that `msg` can reach its receiver: everyone, its own sender, an agent some
    /// protocol knows, or one of the configured Grid programs — claimed now if it has not
    /// been seen, so what is sent to it waits in its queue.
    pub async fn check_receiver(&self, msg: &Message) -> Result<(), Invalid> {
        let receiver = &msg.receiver.agent;
        if msg.receiver.is_broadcast()
            || *receiver == msg.sender.agent
            || self.core.directory.contains(receiver)
        {
            return Ok(());
        }
        let answering = |mut e: Invalid| {
            e.id = Some(msg.id.clone());
            e.sender = Some(Box::new(msg.sender.clone()));
            e
        };
        if self.declared_programs.load().iter().any(|p| p == receiver) {
            return self.register(receiver).await.map_err(answering);
        }
        Err(answering(Invalid {
            code: "UNKNOWN_RECEIVER",
            field: "receiver.agent".into(),
            message: format!("receiver.agent '{receiver}' is not an agent the bridge knows"),
            id: None,
            sender: None,
        }))
    }

    /// Accepts a message from a Grid program: registers its sender, checks its receiver,
    /// and publishes it. A message whose id was accepted before is not routed again.
    pub async fn accept(&self, msg: Message, source: Source) -> Result<String, Invalid> {
        let id = msg.id.clone();
        let sender = msg.sender.clone();
        if let Some(staged) = self.stage(msg, source).await? {
            self.core
                .publish_staged(staged)
                .await
                .map_err(|e| store_failed(&id, &sender, &e))?;
        }
        Ok(id)
    }

    /// The first half of `accept`, for a socket that keeps reading while its earlier
    /// messages are written: everything up to queuing the store write. Once the write is
    /// durable the message is routed (`Core::route`), in the order it was staged. `None`
    /// for a message whose id was accepted before: acknowledged, not routed again.
    pub async fn stage(&self, msg: Message, source: Source) -> Result<Option<Staged>, Invalid> {
        // A repeat is acknowledged before anything else: it changes nothing.
        if self.is_repeat(&msg.id, source).await {
            return Ok(None);
        }
        self.register(&msg.sender.agent).await.map_err(|mut e| {
            e.id = Some(msg.id.clone());
            e.sender = Some(Box::new(msg.sender.clone()));
            e
        })?;
        self.check_receiver(&msg).await?;
        if source == Source::Scratchpad {
            // Read from the scratchpad: never written back to it.
            self.mark_in_scratchpad(&msg.id);
        }
        let Ok(Decoded { envelope: env, .. }) = translate::Translator::decode(&(), msg);
        Ok(Some(self.core.stage(env).await))
    }

    /// Whether a message with `id` was accepted before. A scratchpad rewritten in place
    /// holds entries routed long before, some the bridge's own: the store says. A program
    /// sends a message again soon after, when it retries: only an id the bridge's memory of
    /// recent messages holds (`Core::recently_seen`) is looked up in the store — the lookup
    /// for every message, and the writer's commit it forced, were most of a Grid sender's
    /// cost — and only a stored one is a repeat (one refused before is not).
    async fn is_repeat(&self, id: &str, source: Source) -> bool {
        if source != Source::Scratchpad && !self.core.recently_seen(id) {
            return false;
        }
        match self.core.log.contains(id).await {
            Ok(seen) => seen,
            Err(e) => {
                tracing::warn!(error = %e, message_id = id, "grid: cannot check for a repeated message");
                false
            }
        }
    }

    /// Tells the sender of a refused message what was wrong, in a Grid `type: error`
    /// message — over its socket, queue and scratchpad like any other message.
    pub async fn report(&self, invalid: &Invalid) {
        telemetry::decode_error(PROTOCOL);
        let Some(sender) = &invalid.sender else {
            return;
        };
        // A sender not seen before is registered as a valid message would register it, so
        // that the error waits in its queue (or scratchpad) for it; unless the name is
        // another protocol's agent.
        if !self.programs.contains(&sender.agent) && self.register(&sender.agent).await.is_err() {
            return;
        }
        let error = wire::error_message(invalid);
        let mut env = Envelope::new(
            crate::core::BRIDGE_PROTOCOL,
            crate::core::BRIDGE_AGENT,
            Kind::Error,
        );
        env.to = vec![sender.agent.clone()];
        env.audience = crate::core::Audience::Private;
        env.priority = crate::core::Priority::High;
        env.reply_to = invalid.id.clone();
        env.text = Some(invalid.message.clone());
        env.data = Some(error["content"]["payload"].clone());
        if let Err(e) = self.core.publish(env).await {
            tracing::error!(error = %e, "grid: cannot report an error");
        }
    }

    fn mark_in_scratchpad(&self, id: &str) {
        self.in_scratchpad.lock().remember(id);
    }

    fn in_scratchpad(&self, id: &str) -> bool {
        self.in_scratchpad.lock().ids.contains(id)
    }

    /// Whether a message with this id is for the scratchpad: there is one, and it does not
    /// hold the message yet.
    fn for_scratchpad(&self, id: Option<&str>) -> bool {
        !self.scratchpads.load().is_empty() && !id.is_some_and(|id| self.in_scratchpad(id))
    }

    /// The message as Grid programs receive it, encoded once per message.
    pub fn encode(&self, delivery: &Delivery) -> Option<Value> {
        delivery.encoded(PROTOCOL, translate::encode)
    }

    /// Keeps a message for a program that is not connected: queued for polling, and
    /// appended to the scratchpad.
    fn hold(&self, agent: &str, delivery: &Arc<Delivery>) {
        let Some(message) = self.encode(delivery) else {
            return;
        };
        let _ = self.outgoing.send(Outgoing::Queue {
            agent: agent.to_owned(),
            delivery: delivery.clone(),
            message,
            // Checked again by the writer; here it saves it a copy.
            append: self.for_scratchpad(Some(&delivery.envelope.id)),
        });
    }

    /// Queues again a message a socket took but did not send. Not presence, which is news
    /// only while it is new; not appended to the scratchpad, as it was for a socket.
    fn requeue(&self, agent: &str, delivery: &Arc<Delivery>) {
        if delivery.envelope.kind.is_presence() {
            return;
        }
        let Some(message) = self.encode(delivery) else {
            return;
        };
        let _ = self.outgoing.send(Outgoing::Queue {
            agent: agent.to_owned(),
            delivery: delivery.clone(),
            message,
            append: false,
        });
    }

    /// `message`, the encoding of `delivery`, as it is queued.
    fn to_queue(delivery: &Delivery, message: &Value) -> db::ToQueue {
        let env = &delivery.envelope;
        db::ToQueue {
            message_id: env.id.clone(),
            instance: (message["receiver"]["instance_id"].as_str()).map(str::to_owned),
            priority: env.priority.lane() as i64,
            ts: env.timestamp,
            expires_at: queue_expiry(env, crate::core::now_ms()),
            body: message.to_string(),
        }
    }

    /// Drops queued messages whose ttl ran out, telling their senders.
    async fn expire_queued(self: Arc<Self>) {
        let every = Duration::from_millis(self.config.expiry_check_ms.max(10));
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let now = crate::core::now_ms();
            // Mail the fleet holds cannot be taken while NATS is away: it expires once
            // NATS is back, rather than being taken and put back at every sweep.
            let here_only = (self.core.records()).is_some_and(|records| !records.reachable());
            let expired = match self.db.take_expired(now, here_only).await {
                // In a fleet, the bridge that takes an expired message from the fleet's
                // queue tells its sender.
                Ok(expired) => self.taken_expired(expired).await,
                Err(e) => Err(e),
            };
            let expired = match expired {
                Ok(expired) => expired,
                Err(e) => {
                    tracing::error!(error = %e, "grid: cannot check queued messages");
                    continue;
                }
            };
            for queued in expired {
                self.expired(&queued.message.message_id).await;
            }
        }
    }

    /// A queued copy of a message expired: counted for each copy, but its sender is told
    /// once per message, not once per program it was queued for.
    async fn expired(self: &Arc<Self>, message_id: &str) {
        let first = self.expiry_told.lock().remember(message_id);
        if !first {
            telemetry::message_dropped(PROTOCOL, telemetry::DropReason::TtlExpired);
            return;
        }
        match self.core.log.get(message_id).await {
            Ok(Some(stored)) => self.core.expired(&Delivery::new(stored.envelope), PROTOCOL),
            _ => telemetry::message_dropped(PROTOCOL, telemetry::DropReason::TtlExpired),
        }
    }
}

/// When a queued copy of `env` must be dropped (ms): its ttl counted from when it was sent,
/// or from `now` when its timestamp is older. A ttl past what the clock can count saturates:
/// the sender's number is not a reason to fail.
fn queue_expiry(env: &Envelope, now: i64) -> Option<i64> {
    let ttl = env.ttl_secs?;
    let ttl_ms = i64::try_from(ttl).unwrap_or(i64::MAX).saturating_mul(1000);
    Some(env.timestamp.max(now).saturating_add(ttl_ms))
}

/// The router's way to Grid programs with no open socket.
struct Sink(Weak<Grid>);

impl OfflineSink for Sink {
    fn deliver(&self, agent: &str, delivery: &Arc<Delivery>) {
        if let Some(grid) = self.0.upgrade() {
            grid.hold(agent, delivery);
            delivery.written_to(PROTOCOL);
        }
    }

    /// A Grid broadcast is queued for every program it did not reach (`keep_broadcast`).
    fn keeps_broadcasts(&self) -> bool {
        true
    }

    fn flush(&self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            if let Some(grid) = self.0.upgrade() {
                grid.flush().await;
            }
        })
    }
}

/// The hub's routing name; not an agent name any client can register.
const HUB: &str = "\0grid-hub";

/// The endpoint's own session: messages for every Grid program (Grid broadcasts, other
/// protocols' messages to everyone) are kept for the programs that are not connected.
struct HubInterest;

impl HubFilter for HubInterest {
    fn wants(&self, env: &Envelope) -> bool {
        translate::for_every_program(env)
    }

    fn keeps_mail(&self) -> bool {
        true
    }
}
