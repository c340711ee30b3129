//! `[skynet]` in bridge.toml.

use std::net::SocketAddr;

use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// HTTP API and WebSocket (`/ws`) on one port. Skynet's default is 4117.
    pub listen: SocketAddr,
    /// How long a dropped member stays joined, waiting for a reconnect, before its leave is
    /// broadcast.
    pub disconnect_grace_ms: u64,
    /// Messages mentioning an agent replayed to it in `workspace.state`.
    pub recent_mentions_limit: usize,
    /// Largest WebSocket frame accepted; larger ones get an `error` event.
    pub max_frame_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 4117)),
            disconnect_grace_ms: 300_000,
            recent_mentions_limit: 3,
            max_frame_bytes: 16 * 1024 * 1024,
        }
    }
}
