//! The endpoints, one folder per protocol, each built the same way: `config.rs` (its
//! bridge.toml section), `wire.rs` (its frames), `translate.rs` (frame ⇄ Envelope), its
//! listeners, and `start()`. An endpoint talks only to the core, never to another endpoint.
//!
//! Adding a protocol means adding its folder, its section in `Config`, and a line in
//! `start_all` and `listeners` below.

pub mod contract;
pub mod grid;
pub mod skynet;
pub mod synapse;
pub mod tracker;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use crate::shared::listener::{Limits, serve};

use crate::config::Config;
use crate::core::Core;
use crate::shared::budget::ByteBudget;
use crate::store::Store;

/// What every endpoint starts with: the core it talks to, the shutdown every listener and
/// session watches, and the bridge-wide limits its clients are held to.
#[derive(Clone)]
pub struct Context {
    pub core: Arc<Core>,
    /// For the endpoint's own tables (the core reaches messages through `core.log`).
    pub store: Store,
    pub shutdown: CancellationToken,
    pub limits: Limits,
    /// Shared by every WebSocket of every endpoint (`Limits::read_budget_bytes`).
    pub read_budget: ByteBudget,
}

/// An endpoint that is up: where it listens, and the task serving it.
pub struct Running {
    pub name: &'static str,
    pub listeners: Vec<(&'static str, SocketAddr)>,
    pub tasks: Vec<JoinHandle<()>>,
}

/// An endpoint could not start; the message names the cause.
#[derive(Debug, thiserror::Error)]
#[error("{endpoint}: {message}")]
pub struct StartError {
    pub endpoint: &'static str,
    pub message: String,
}

impl StartError {
    pub fn new(endpoint: &'static str, message: impl std::fmt::Display) -> Self {
        StartError {
            endpoint,
            message: message.to_string(),
        }
    }
}

/// Binds a listener for `endpoint`, naming both when it cannot.
pub async fn bind(
    endpoint: &'static str,
    addr: SocketAddr,
) -> Result<tokio::net::TcpListener, StartError> {
    crate::shared::listener::bind(addr)
        .await
        .map_err(|e| StartError::new(endpoint, e))
}

/// Starts every endpoint the config has a section for.
pub async fn start_all(config: &Config, ctx: &Context) -> Result<Vec<Running>, StartError> {
    let mut running = Vec::new();
    if let Some(section) = &config.skynet {
        running.push(skynet::start(section, ctx).await?);
    }
    if let Some(section) = &config.tracker {
        running.push(tracker::start(section, ctx).await?);
    }
    if let Some(section) = &config.synapse {
        running.push(synapse::start(section, ctx).await?);
    }
    if let Some(section) = &config.grid {
        running.push(grid::start(section, ctx).await?);
    }
    Ok(running)
}

/// Every listener the config asks for, as (endpoint, what it serves, address).
pub fn listeners(config: &Config) -> Vec<(&'static str, &'static str, SocketAddr)> {
    let mut out = Vec::new();
    if let Some(section) = &config.skynet {
        out.push((skynet::PROTOCOL, "http + websocket /ws", section.listen));
    }
    if let Some(section) = &config.tracker {
        out.push((
            tracker::PROTOCOL,
            "rest /api/v1 + websocket /ws",
            section.listen,
        ));
    }
    if let Some(section) = &config.synapse {
        for (_, addr) in section.listeners() {
            out.push((
                synapse::PROTOCOL,
                "grpc + http/json gateway /api/v1/synapse",
                addr,
            ));
        }
    }
    if let Some(section) = &config.grid {
        out.push((
            grid::PROTOCOL,
            "http /grid/v1 + websocket /grid/v1/ws",
            section.listen,
        ));
    }
    out
}
