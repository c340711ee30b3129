//! The Skynet endpoint: Skynet's HTTP registration API, its WebSocket workspace and its
//! scheduler, as described in `skynet-protocol.md`, `skynet-workspace-rules.md` and
//! `skynet-scheduler.md`, on one listener.

mod config;
mod http;
/// Server-side `@name` enrichment of chat messages; public for `benches/translate.rs`.
pub mod mentions;
mod records;
mod registry;
mod schedules;
mod sent;
/// SkynetMessage ⇄ Envelope; public for `benches/translate.rs`.
pub mod translate;
/// Skynet's client frames and server events; public for `benches/translate.rs`.
pub mod wire;
mod workspace;
mod ws;

use std::sync::Arc;

use dashmap::DashMap;

use tokio_util::sync::CancellationToken;

pub use config::Config;

use super::endpoint::{Endpoint, Listening, Reloader};
use super::{Context, Running, StartError};
use crate::core::{Core, PerGeneration, Protocol};
use crate::shared::budget::ByteBudget;
use registry::Registry;
use schedules::Schedules;
use workspace::Workspace;

pub const PROTOCOL: Protocol = "skynet";

/// Everyone a chat may `@mention`, in the order they are tried.
pub type MentionCandidates = Arc<mentions::Candidates>;

/// The endpoint's shared state.
pub struct Skynet {
    core: Arc<Core>,
    config: Config,
    registry: Arc<Registry>,
    schedules: Arc<Schedules>,
    workspace: Workspace,
    /// Everyone a chat may @mention.
    mention_cache: PerGeneration<mentions::Candidates>,
    /// Card ids shown for registered agents of other protocols (UUIDv5 of their names),
    /// worked out once per name rather than once per message; emptied when the directory
    /// changes, so the map never outgrows it and an unregistered name's alias is recorded
    /// again.
    foreign_card_ids: PerGeneration<DashMap<String, String>>,
    /// The other way: foreign agents by the card id derived from their name.
    derived_names: PerGeneration<foldhash::HashMap<String, String>>,
    shutdown: CancellationToken,
    read_budget: ByteBudget,
}

impl Endpoint for Skynet {
    const NAME: &'static str = PROTOCOL;
    type Config = Config;
    type Translation = translate::Translator;

    fn listeners(config: &Config) -> Vec<Listening> {
        vec![Listening {
            serves: "http + websocket /ws",
            addr: config.listen,
        }]
    }

    async fn start(config: &Config, ctx: &Context) -> Result<Running, StartError> {
        start(config, ctx).await
    }
}

pub async fn start(config: &Config, ctx: &Context) -> Result<Running, StartError> {
    let (core, shutdown) = (ctx.core.clone(), ctx.shutdown.clone());
    let registry = Registry::load(core.clone(), ctx.store.clone())
        .await
        .map_err(|e| StartError::new(PROTOCOL, e))?;
    let schedules = Schedules::load(core.clone(), ctx.store.clone())
        .await
        .map_err(|e| StartError::new(PROTOCOL, e))?;
    let listener = super::bind(PROTOCOL, config.listen).await?;
    let addr = listener
        .local_addr()
        .map_err(|e| StartError::new(PROTOCOL, e))?;
    let skynet = Arc::new(Skynet {
        core,
        config: config.clone(),
        registry: Arc::new(registry),
        schedules: Arc::new(schedules),
        workspace: Workspace::new(),
        mention_cache: PerGeneration::default(),
        foreign_card_ids: PerGeneration::default(),
        derived_names: PerGeneration::default(),
        shutdown: shutdown.clone(),
        read_budget: ctx.read_budget.clone(),
    });
    let reload = Reloader::of(&skynet);
    records::follow(&skynet);
    skynet.schedules.follow();
    let ticks = tokio::spawn(schedules::ticks::run(skynet.clone()));
    let task = super::serve(
        PROTOCOL,
        listener,
        http::router(skynet),
        &ctx.limits,
        ctx.doors.clone(),
        shutdown,
    );
    Ok(Running {
        name: PROTOCOL,
        listeners: vec![("http+ws", addr)],
        tasks: vec![task, ticks],
        reload,
    })
}
