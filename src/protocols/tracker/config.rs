//! `[tracker]` in bridge.toml, with the members and projects it declares.

use std::net::SocketAddr;

use serde::Deserialize;

use super::wire::{ChatListen, MemberKind, TaskListen};

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// REST (`/api/v1`) and WebSocket (`/ws`) on one port. The Tracker's default is 8100.
    pub listen: SocketAddr,
    /// A member whose connection sends no heartbeat for this long is offline.
    pub heartbeat_timeout_ms: u64,
    /// A connection must authenticate within this long.
    pub auth_timeout_ms: u64,
    /// Largest WebSocket message accepted; larger ones get an `error` frame, unread.
    pub max_frame_bytes: usize,
    /// Most mentions a message may carry; more are refused (422 / an `error` frame)
    /// before any is looked up.
    pub max_mentions: usize,
    /// Largest REST request body (attachments have their own 5 MiB limit); larger ones
    /// get 413 `{detail}`.
    pub max_body_bytes: usize,
    /// The project (slug) where tasks assigned from other protocols are created; the first
    /// declared project when unset.
    pub default_project: Option<String>,
    pub members: Vec<MemberConfig>,
    pub projects: Vec<ProjectConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8100)),
            heartbeat_timeout_ms: 90_000,
            auth_timeout_ms: 10_000,
            max_frame_bytes: 16 * 1024 * 1024,
            max_mentions: 1024,
            max_body_bytes: 2 * 1024 * 1024,
            default_project: None,
            members: Vec::new(),
            projects: Vec::new(),
        }
    }
}

/// A member declared in bridge.toml; created or updated at start.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemberConfig {
    pub slug: String,
    pub name: Option<String>,
    /// The member's token (`tb-…`); stored hashed, never logged.
    pub token: String,
    #[serde(default)]
    pub kind: MemberKind,
    #[serde(default)]
    pub chat_listen: ChatListen,
    #[serde(default)]
    pub task_listen: TaskListen,
    #[serde(default)]
    pub capabilities: Vec<String>,
    pub prompt: Option<String>,
    pub model: Option<String>,
}

impl std::fmt::Debug for MemberConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemberConfig")
            .field("slug", &self.slug)
            .field("kind", &self.kind)
            .field("token", &"<redacted>")
            .finish_non_exhaustive()
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectConfig {
    pub slug: String,
    pub name: String,
    #[serde(default)]
    pub description: String,
}
