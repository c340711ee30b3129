//! The Synapse endpoint: the six services of synapse.proto over gRPC (tonic), the standard
//! gRPC health and reflection services, and the HTTP/JSON gateway built from the proto's
//! `google.api.http` rules — all on one port.
//!
//! Synapse agents are known by their `agent_id`. They are reached by their transport mode:
//! a live `StreamMessages` stream, a callback (the message POSTed as JSON to their callback
//! URL), or polling (kept in an inbox until `ReceiveCallback` fetches it). Tasks submitted
//! through `TaskService` are the endpoint's own records; the hub applies progress and
//! results from whichever protocol the assignee speaks.

mod agents;
mod codec;
mod config;
mod db;
mod gateway;
mod groups;
mod inbound;
mod json;
mod outbound;
mod outlet;
pub mod proto;
mod services;
mod shared_groups;
mod shared_inbox;
mod shared_tasks;
mod stream;
mod tasks;
/// SynapseMessage ⇄ Envelope; public for `benches/translate.rs`.
pub mod translate;
/// `Any` payloads, timestamps and proto3 JSON; public for `benches/translate.rs`.
pub mod wire;

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwapOption;
use dashmap::{DashMap, DashSet};
use tokio_util::sync::CancellationToken;

pub use config::Config;

use super::endpoint::{Endpoint, Listening, Reloader};
use super::{Context, Running, StartError};
use crate::core::{Core, Protocol, UnsettledMail};
use crate::shared::budget::ByteBudget;
use db::{AgentRow, Db, GroupRow, MemberRow};
use proto::{AgentEndpoint, TaskStatusUpdate};

pub const PROTOCOL: Protocol = "synapse";

/// A group and its members (as the fleet's record of it holds them, too).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Group {
    pub row: GroupRow,
    pub members: Vec<MemberRow>,
}

/// An agent's open `StreamMessages` streams.
struct OpenStreams {
    /// Their router sessions' ids, which grow in the order streams attach.
    sessions: Vec<u64>,
    /// Wakes one of them to take what was kept in the agent's inbox while they are open
    /// (by another bridge that took it for away, or kept again).
    wake: Arc<tokio::sync::Notify>,
}

pub struct Synapse {
    core: Arc<Core>,
    config: Config,
    db: Db,
    started: Instant,
    /// Synapse agents (any protocol's agents are in the core's directory).
    agents: DashMap<String, AgentRow>,
    /// agent id → its open `StreamMessages` streams.
    streams: DashMap<String, OpenStreams>,
    /// agent id → open `StreamGroupMessages` streams.
    group_streams: DashMap<String, usize>,
    /// Inbox messages of the fleet's whose take this bridge cannot be sure of.
    unsettled: UnsettledMail,
    groups: DashMap<String, Group>,
    /// In a fleet: the revision of the fleet's record each group (removed ones too) was
    /// last applied from, so that what `groups` and the router hold never goes back.
    group_revisions: DashMap<String, crate::core::Revision>,
    /// Ids of tasks submitted through `TaskService`.
    tasks: Arc<DashSet<String>>,
    /// Ids of those still waiting for an agent that takes their type.
    pending: Arc<DashSet<String>>,
    /// task id → `StreamTaskStatus` subscribers; told of changes from the store's thread
    /// as they commit (`tasks::told_watchers`).
    task_watchers: Arc<DashMap<String, Vec<tokio::sync::mpsc::Sender<TaskStatusUpdate>>>>,
    outbound: outbound::Outbound,
    /// The token calls must carry (`[synapse] token`), if any; a reload may change it.
    token: Arc<ArcSwapOption<String>>,
    /// Charged by large request bodies and gRPC messages.
    read_budget: ByteBudget,
    shutdown: CancellationToken,
}

impl translate::Context for Synapse {
    fn endpoint_of(&self, name: &str) -> AgentEndpoint {
        if let Some(agent) = self.agents.get(name) {
            return AgentEndpoint {
                agent_id: agent.agent_id.clone(),
                agent_name: agent.name.clone(),
                system_id: agent.system_id.clone(),
                endpoint: agent.endpoint.clone(),
                version: agent.version.clone(),
            };
        }
        match self.core.directory.get(name) {
            Some(info) => AgentEndpoint {
                agent_id: info.name.clone(),
                agent_name: info.description.clone().unwrap_or(info.name),
                system_id: info.protocol.to_owned(),
                endpoint: String::new(),
                version: String::new(),
            },
            None => AgentEndpoint {
                agent_id: name.to_owned(),
                agent_name: name.to_owned(),
                system_id: String::new(),
                endpoint: String::new(),
                version: String::new(),
            },
        }
    }
}

impl Synapse {
    /// Makes the agents `[synapse]` declares real — created or updated in the table and
    /// the directory — with every one checked before any is written. At start and at every
    /// reload of the config: one code path.
    async fn declare(&self, declared: &[config::AgentConfig]) -> Result<(), String> {
        let mut rows = Vec::with_capacity(declared.len());
        for declared in declared {
            let transport = wire::parse_transport(&declared.transport).ok_or_else(|| {
                format!(
                    "agent '{}': transport '{}' is not callback, polling, sync or hybrid",
                    declared.agent_id, declared.transport
                )
            })?;
            rows.push(AgentRow {
                agent_id: declared.agent_id.clone(),
                name: (declared.name.clone()).unwrap_or_else(|| declared.agent_id.clone()),
                system_id: PROTOCOL.to_owned(),
                endpoint: declared.callback_url.clone().unwrap_or_default(),
                version: translate::PROTOCOL_VERSION.to_owned(),
                transport: transport as i32,
                callback_url: declared.callback_url.clone(),
                callback_token: declared.callback_token.clone(),
                capabilities: declared.capabilities.clone(),
                created_at: crate::core::now_ms(),
            });
        }
        for row in rows {
            self.db.put_agent(row).await.map_err(|e| e.to_string())?;
        }
        for agent in self.db.agents().await.map_err(|e| e.to_string())? {
            self.core
                .directory
                .register_known(agents::directory_entry(&agent))
                .map_err(|e| format!("agent '{}': {e}", agent.agent_id))?;
            self.agents.insert(agent.agent_id.clone(), agent);
        }
        Ok(())
    }
}

impl Endpoint for Synapse {
    const NAME: &'static str = PROTOCOL;
    type Config = Config;
    type Translation = translate::Translator;

    fn listeners(config: &Config) -> Vec<Listening> {
        (config.listeners().into_iter())
            .map(|(_, addr)| Listening {
                serves: "grpc + http/json gateway /api/v1/synapse",
                addr,
            })
            .collect()
    }

    async fn start(config: &Config, ctx: &Context) -> Result<Running, StartError> {
        start(config, ctx).await
    }

    const RELOADABLE: &'static [&'static str] = &["agents", "token"];

    /// Declared agents anew (one the file no longer declares stays, as one registered
    /// through the API does), and the token calls must carry.
    async fn reload(self: &Arc<Self>, config: &Config) -> Result<(), String> {
        self.declare(&config.agents).await?;
        self.token.store(config.token.clone().map(Arc::new));
        // Waiting tasks may go to an agent declared just now.
        self.assign_pending().await;
        Ok(())
    }
}

pub async fn start(config: &Config, ctx: &Context) -> Result<Running, StartError> {
    let (core, shutdown) = (ctx.core.clone(), ctx.shutdown.clone());
    let fail = |e: &dyn std::fmt::Display| StartError::new(PROTOCOL, e);
    let db = Db::open(ctx.store.clone()).await.map_err(|e| fail(&e))?;
    let synapse = Arc::new(Synapse {
        core: core.clone(),
        config: config.clone(),
        db: db.clone(),
        started: Instant::now(),
        agents: DashMap::new(),
        streams: DashMap::new(),
        group_streams: DashMap::new(),
        unsettled: UnsettledMail::default(),
        groups: DashMap::new(),
        group_revisions: DashMap::new(),
        tasks: Arc::new(DashSet::new()),
        pending: Arc::new(DashSet::new()),
        task_watchers: Arc::default(),
        outbound: outbound::Outbound::new(config),
        token: Arc::new(ArcSwapOption::from(config.token.clone().map(Arc::new))),
        read_budget: ctx.read_budget.clone(),
        shutdown: shutdown.clone(),
    });
    synapse.load().await.map_err(|e| fail(&e))?;
    shared_groups::follow(&synapse);
    let settler = shared_inbox::follow(&synapse);
    shared_tasks::follow(&synapse);

    let mut listeners = Vec::new();
    for (role, addr) in config.listeners() {
        let listener = super::bind(PROTOCOL, addr).await?;
        let addr = listener.local_addr().map_err(|e| fail(&e))?;
        listeners.push((role, listener, addr));
    }
    crate::telemetry::callbacks_started(PROTOCOL);
    let mut tasks = synapse.outbound.start(&synapse);
    tasks.extend(settler);
    let reload = Reloader::of(&synapse);
    tasks.push(tasks::start_hub(synapse.clone()));
    // Agents of the endpoints started before this one may take tasks left waiting.
    synapse.assign_pending().await;
    let app = services::router(synapse.clone())
        .merge(gateway::router(synapse.clone()))
        .fallback(gateway::unrouted);
    let app = services::with_auth(app, synapse.token.clone());
    let mut addrs = Vec::new();
    for (role, listener, addr) in listeners {
        tasks.push(super::serve(
            PROTOCOL,
            listener,
            app.clone(),
            &ctx.limits,
            ctx.doors.clone(),
            shutdown.clone(),
        ));
        addrs.push((role, addr));
    }
    Ok(Running {
        name: PROTOCOL,
        listeners: addrs,
        tasks,
        reload,
    })
}

impl Synapse {
    /// Loads agents, groups and task ids, and declares the configured agents.
    async fn load(self: &Arc<Self>) -> Result<(), String> {
        self.declare(&self.config.agents).await?;
        for (row, members) in self.db.groups().await.map_err(|e| e.to_string())? {
            self.keep_group(Group { row, members });
        }
        for id in self.db.task_ids().await.map_err(|e| e.to_string())? {
            self.tasks.insert(id);
        }
        for task in self.db.waiting_tasks().await.map_err(|e| e.to_string())? {
            self.pending.insert(task.id);
        }
        self.core
            .router
            .set_offline_sink(PROTOCOL, Arc::new(outbound::Sink(Arc::downgrade(self))));
        Ok(())
    }
}
