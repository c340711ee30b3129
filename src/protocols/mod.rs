//! The endpoints, one folder per protocol, each an `Endpoint` (endpoint.rs): its
//! `bridge.toml` section, its listeners, `start`, and its `Translation` between its frames
//! and the envelope. The registry (registry.rs) is the one list of them. An endpoint talks
//! only to the core (and the store for its own tables), never to another endpoint.

pub mod endpoint;
pub mod grid;
pub mod hub;
pub mod record_json;
pub mod registry;
pub mod session;
pub mod skynet;
pub mod synapse;
pub mod tracker;

use std::net::SocketAddr;

pub use crate::shared::listener::{Limits, serve};
pub use endpoint::{Context, Running, StartError};

/// Binds a listener for `endpoint`, naming both when it cannot.
pub async fn bind(
    endpoint: &'static str,
    addr: SocketAddr,
) -> Result<tokio::net::TcpListener, StartError> {
    crate::shared::listener::bind(addr)
        .await
        .map_err(|e| StartError::new(endpoint, e))
}
