//! `[grid]` in bridge.toml.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `POST/GET /grid/v1/messages`, `GET /grid/v1/agents` and the WebSocket `/grid/v1/ws`.
    pub listen: SocketAddr,
    /// Scratchpad files shared with Grid programs (one path or a list). Entries appended
    /// to them are routed; messages for Grid programs that are not connected are appended
    /// to the first. A relative path is taken from the directory of the config file.
    pub scratchpad: Scratchpads,
    /// How often the scratchpad files are checked for new entries.
    pub scratchpad_poll_ms: u64,
    /// How often queued messages are checked for an expired `metadata.ttl`.
    pub expiry_check_ms: u64,
    /// The Grid's own programs: a message to one is accepted (and queued) before it has
    /// posted, polled or connected. Each is claimed as a Grid agent when first addressed,
    /// so the name stays free for another protocol's agent until then.
    pub programs: Vec<String>,
    /// Largest WebSocket message accepted; larger ones get a `type: error` message, unread.
    pub max_frame_bytes: usize,
    /// A socket that has neither named its agent in its URL nor sent a message within this
    /// long is closed.
    pub identify_timeout_ms: u64,
    /// Largest HTTP request body; larger ones get 413 with a `type: error` message.
    pub max_body_bytes: usize,
}

/// The programs `grid-message-protocol.md` names as senders and receivers.
pub const DOCUMENTED_PROGRAMS: &[&str] = &["executor", "planner", "recognizer", "scout", "mc"];

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8300)),
            scratchpad: Scratchpads::default(),
            scratchpad_poll_ms: 250,
            expiry_check_ms: 1000,
            programs: DOCUMENTED_PROGRAMS.iter().map(|p| p.to_string()).collect(),
            max_frame_bytes: 16 * 1024 * 1024,
            identify_timeout_ms: 10_000,
            max_body_bytes: 2 * 1024 * 1024,
        }
    }
}

/// One scratchpad path or several.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(from = "OneOrMany")]
pub struct Scratchpads(pub Vec<PathBuf>);

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(PathBuf),
    Many(Vec<PathBuf>),
}

impl From<OneOrMany> for Scratchpads {
    fn from(value: OneOrMany) -> Self {
        match value {
            OneOrMany::One(path) => Scratchpads(vec![path]),
            OneOrMany::Many(paths) => Scratchpads(paths),
        }
    }
}
