//! `[synapse]` in bridge.toml, with the agents it declares.

use std::net::SocketAddr;

use serde::Deserialize;

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// gRPC (HTTP/2) and the HTTP/JSON gateway (HTTP/1.1 or 2) on one port.
    pub listen: SocketAddr,
    /// The design's names for gRPC's and the gateway's ports. Each listener serves both
    /// (a port is told apart by nothing but its address); either replaces `listen`.
    pub grpc_listen: Option<SocketAddr>,
    pub http_listen: Option<SocketAddr>,
    /// When set, every call must carry it (`authorization: Bearer …`, or `x-synapse-token`);
    /// otherwise UNAUTHENTICATED. The standard gRPC health service stays open.
    pub token: Option<String>,
    /// Attempts per callback delivery before it is counted as failed and kept for polling.
    pub callback_attempts: u32,
    /// Wait before the first retry; it doubles after each failure.
    pub callback_backoff_ms: u64,
    /// How long a synchronous send waits for the recipient's stream to take the message.
    pub sync_timeout_ms: u64,
    /// Largest gRPC message, and largest gateway body: RESOURCE_EXHAUSTED (413 over HTTP)
    /// above it. Files of up to 5 MiB ride inside `SubmitTaskWithFiles`.
    pub max_message_bytes: usize,
    /// Most members a group may hold (its coordinator included); RESOURCE_EXHAUSTED past it.
    pub max_group_members: usize,
    /// Most tasks that may wait for an agent taking their type; RESOURCE_EXHAUSTED past it.
    pub max_waiting_tasks: usize,
    pub agents: Vec<AgentConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            grpc_listen: None,
            http_listen: None,
            token: None,
            callback_attempts: 5,
            callback_backoff_ms: 200,
            sync_timeout_ms: 30_000,
            max_message_bytes: 64 * 1024 * 1024,
            max_group_members: 1024,
            max_waiting_tasks: 10_000,
            agents: Vec::new(),
        }
    }
}

impl Config {
    /// Where to listen, each with its role: `grpc_listen` and `http_listen` when either is
    /// given (one listener when they are the same address, unless that asks for any free
    /// port: two then), else `listen`.
    pub fn listeners(&self) -> Vec<(&'static str, SocketAddr)> {
        match (self.grpc_listen, self.http_listen) {
            (None, None) => vec![("grpc+http", self.listen)],
            (Some(grpc), Some(http)) if grpc == http && grpc.port() != 0 => {
                vec![("grpc+http", grpc)]
            }
            (grpc, http) => {
                let grpc = grpc.map(|addr| ("grpc", addr));
                grpc.into_iter()
                    .chain(http.map(|addr| ("http", addr)))
                    .collect()
            }
        }
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("listen", &self.listen)
            .field("grpc_listen", &self.grpc_listen)
            .field("http_listen", &self.http_listen)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("agents", &self.agents)
            .finish_non_exhaustive()
    }
}

/// An agent declared in bridge.toml, so it is known (and reachable) before it connects.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub agent_id: String,
    pub name: Option<String>,
    /// `callback`, `polling`, `sync` or `hybrid` (stream when connected, else callback).
    #[serde(default = "hybrid")]
    pub transport: String,
    pub callback_url: Option<String>,
    pub callback_token: Option<String>,
    /// Task types (and skills) it takes: `SubmitTask` with one of these reaches it.
    #[serde(default)]
    pub capabilities: Vec<String>,
}

fn hybrid() -> String {
    "hybrid".into()
}

impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("agent_id", &self.agent_id)
            .field("transport", &self.transport)
            .field("callback_url", &self.callback_url)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(text: &str) -> Config {
        toml::from_str(text).expect("a valid [synapse] section")
    }

    #[test]
    fn one_listener_by_default_or_one_for_each_of_the_designs_names() {
        let config = section("");
        assert_eq!(config.listeners(), [("grpc+http", config.listen)]);
        let config =
            section("grpc_listen = \"127.0.0.1:7001\"\nhttp_listen = \"127.0.0.1:7002\"\n");
        let roles: Vec<_> = (config.listeners().into_iter())
            .map(|(role, addr)| (role, addr.port()))
            .collect();
        assert_eq!(roles, [("grpc", 7001), ("http", 7002)]);
    }
}
