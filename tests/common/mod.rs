//! Helpers shared by the integration tests: a bridge on `127.0.0.1:0` ports, and thin real
//! clients for each protocol. Every wait is bounded, so a broken bridge fails a test rather
//! than hanging it.

#![allow(dead_code)]

pub mod fleet;
pub mod grid;
pub mod matrix;
pub mod nats;
pub mod peers;
pub mod process;
pub mod skynet;
pub mod synapse;
pub mod tools;
pub mod tracker;
pub mod ws;

use std::net::SocketAddr;
use std::time::Duration;

use agentbridge::{Bridge, Config};

/// How long any single expected frame or response may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(10);

/// Waits, bounded by `WAIT`, until `done` holds.
pub async fn eventually(what: &str, done: impl AsyncFnMut() -> bool) {
    eventually_within(what, WAIT, done).await;
}

/// Waits, bounded by `wait`, until `done` holds.
pub async fn eventually_within(what: &str, wait: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + wait;
    while !done().await {
        assert!(
            std::time::Instant::now() < deadline,
            "not within {wait:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A bridge with every endpoint on an ephemeral loopback port and an in-memory store,
/// plus `extra` TOML (which may override sections).
pub async fn start_bridge(extra: &str) -> Bridge {
    start_bridge_in(":memory:", extra).await
}

/// As `start_bridge`, with the store in `data_dir`.
pub async fn start_bridge_in(data_dir: &str, extra: &str) -> Bridge {
    let text = bridge_toml(data_dir, extra);
    let config = Config::parse(&text, "test.toml").expect("test config parses");
    Bridge::start(config).await.expect("bridge starts")
}

/// The test config: defaults for every endpoint, with `extra`'s sections replacing them.
pub fn bridge_toml(data_dir: &str, extra: &str) -> String {
    let mut sections = vec![
        ("bridge", format!("data_dir = {data_dir:?}")),
        ("admin", "listen = \"127.0.0.1:0\"".to_owned()),
    ];
    // Every registered protocol, each on a free port.
    for name in agentbridge::protocols::registry::PROTOCOLS {
        sections.push((*name, peers::Proto::named(name).section().to_owned()));
    }
    // `extra` may replace a default section wholesale.
    let mut text = String::new();
    let overridden: Vec<&str> = extra
        .lines()
        .filter_map(|l| l.trim().strip_prefix('[')?.strip_suffix(']'))
        .collect();
    sections.retain(|(name, _)| !overridden.contains(name));
    for (name, body) in sections {
        text.push_str(&format!("[{name}]\n{body}\n\n"));
    }
    text.push_str(extra);
    text
}

/// The Tracker's test setup: two projects and members with every listen setting.
pub const TRACKER_SECTION: &str = r#"listen = "127.0.0.1:0"
default_project = "team-board"

[[tracker.projects]]
slug = "team-board"
name = "Team Board"

[[tracker.projects]]
slug = "side"
name = "Side Project"

[[tracker.members]]
slug = "admin"
name = "Admin"
kind = "human"
token = "tb-admin"
chat_listen = "all"
task_listen = "all"

[[tracker.members]]
slug = "coder"
name = "Coder"
token = "tb-coder"
chat_listen = "mentions"
task_listen = "assigned"
capabilities = ["code"]

[[tracker.members]]
slug = "listener"
token = "tb-listener"
chat_listen = "all"
task_listen = "all"

[[tracker.members]]
slug = "quiet"
token = "tb-quiet"
chat_listen = "none"
task_listen = "none"
"#;

pub fn http_url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

pub fn ws_url(addr: SocketAddr, path: &str) -> String {
    format!("ws://{addr}{path}")
}

pub fn http() -> reqwest::Client {
    // reqwest is built with rustls but no default crypto provider (the bridge picks ring).
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .timeout(WAIT)
        .build()
        .expect("http client")
}

/// `GET path` on the bridge's admin listener: the status and the body.
pub async fn admin_get(bridge: &Bridge, path: &str) -> (u16, String) {
    let admin = bridge.admin_addr().expect("the admin listener");
    let answer = (http().get(format!("http://{admin}{path}")).send())
        .await
        .expect("the admin listener answers");
    let status = answer.status().as_u16();
    (status, answer.text().await.expect("its text"))
}

/// The bridge's count of malformed input from `protocol`
/// (`agentbridge_decode_errors_total`), 0 before the first. The recorder is shared by
/// every test in a binary, so compare a value with an earlier one, not with a number.
pub async fn decode_errors(bridge: &Bridge, protocol: &str) -> f64 {
    let (_, text) = admin_get(bridge, "/metrics").await;
    let series = format!("agentbridge_decode_errors_total{{protocol=\"{protocol}\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&series))
        .map_or(0.0, |value| value.trim().parse().expect("a number"))
}
