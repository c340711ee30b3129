//! The endpoints, one folder per protocol, each built the same way: `config.rs` (its
//! bridge.toml section), `wire.rs` (its frames), `translate.rs` (frame ⇄ Envelope), its
//! listeners, and `start()`. An endpoint talks only to the core, never to another endpoint.
//!
//! Adding a protocol means adding its folder, its section in `Config`, and a line in
//! `start_all` and `listeners` below.

pub mod at_names;
pub mod clock;
pub mod contract;
pub mod grid;
pub mod http_refusals;
pub mod listener;
pub mod raw_object;
pub mod skynet;
pub mod synapse;
pub mod tracker;
pub mod websocket;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use listener::{Limits, bind, serve};

use crate::config::Config;
use crate::core::{ByteBudget, Core, Delivery, Protocol};
use crate::telemetry;

/// What every endpoint starts with: the core it talks to, the shutdown every listener and
/// session watches, and the bridge-wide limits its clients are held to.
#[derive(Clone)]
pub struct Context {
    pub core: Arc<Core>,
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

/// Records that `delivery` was written to a connection of protocol `to`: counted, timed,
/// and marked written for a sender waiting on synchronous delivery.
pub fn written(delivery: &Delivery, to: Protocol) {
    let env = &delivery.envelope;
    telemetry::message_delivered(
        &env.origin.protocol,
        to,
        env.kind.family(),
        env.origin.decoded_at().elapsed(),
    );
    delivery.mark_written();
}

/// Values a client sent, named in an error text: at most the first five, each cut to 64
/// characters, then how many more there were. An answer never grows with the input.
pub fn a_few(values: &[impl AsRef<str>]) -> String {
    const SHOWN: usize = 5;
    const CHARS: usize = 64;
    let mut text = String::new();
    for (i, value) in values.iter().take(SHOWN).enumerate() {
        if i > 0 {
            text.push_str(", ");
        }
        let value = value.as_ref();
        match value.char_indices().nth(CHARS) {
            Some((cut, _)) => {
                text.push_str(&value[..cut]);
                text.push('…');
            }
            None => text.push_str(value),
        }
    }
    if values.len() > SHOWN {
        text.push_str(&format!(" and {} more", values.len() - SHOWN));
    }
    text
}

/// The token of an `Authorization: Bearer <token>` header value.
pub fn bearer_token(authorization: &str) -> Option<&str> {
    authorization
        .strip_prefix("Bearer ")
        .or_else(|| authorization.strip_prefix("bearer "))
        .map(str::trim)
}

/// Lower-case hex of `bytes` (digests kept as text: token hashes, scratchpad entries).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{Envelope, Kind};

    /// Slow samples (`> 0.05 s`) of `route_duration_seconds` so far.
    fn slow_route_samples(handle: &metrics_exporter_prometheus::PrometheusHandle) -> u64 {
        let text = handle.render();
        let value = |prefix: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(prefix))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        let name = telemetry::ROUTE_DURATION;
        value(&format!("{name}_count ")) - value(&format!("{name}_bucket{{le=\"0.05\"}} "))
    }

    /// `route_duration_seconds` runs from when the message was decoded, so a message that
    /// waited (for the store, say) before it was routed shows that wait.
    #[test]
    fn a_few_names_at_most_five_values_each_cut_short() {
        assert_eq!(a_few(&["a", "b"]), "a, b");
        let many: Vec<String> = (0..60_000).map(|i| format!("id-{i}")).collect();
        assert_eq!(a_few(&many), "id-0, id-1, id-2, id-3, id-4 and 59995 more");
        let long = "é".repeat(100);
        assert_eq!(a_few(&[&long]), format!("{}…", "é".repeat(64)));
    }

    #[test]
    fn route_duration_counts_from_the_decode_not_from_routing() {
        let handle = telemetry::install();
        let env = Envelope::new("test", "decoded-early", Kind::Chat);
        std::thread::sleep(std::time::Duration::from_millis(60));
        let slow_before = slow_route_samples(&handle);
        written(&Delivery::new(env), "test");
        // Other tests share the recorder; they can only add samples.
        assert!(slow_route_samples(&handle) > slow_before);
    }
}
