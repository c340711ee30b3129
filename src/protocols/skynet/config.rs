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
    /// Largest WebSocket message accepted; larger ones get an `error` event, unread.
    pub max_frame_bytes: usize,
    /// Most mentions a message may carry, the client's and those found in its text
    /// together; more are refused with an `error` event before any is looked up.
    pub max_mentions: usize,
    /// A socket that has not joined within this long is closed.
    pub join_timeout_ms: u64,
    /// Largest HTTP request body; larger ones get 413 `{error}`.
    pub max_body_bytes: usize,
    /// Most schedules (fleet-wide, in a fleet); creating another is refused with 409.
    pub max_schedules: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 4117)),
            disconnect_grace_ms: 300_000,
            recent_mentions_limit: 3,
            max_frame_bytes: 16 * 1024 * 1024,
            max_mentions: 1024,
            join_timeout_ms: 10_000,
            max_body_bytes: 2 * 1024 * 1024,
            max_schedules: 1000,
        }
    }
}
