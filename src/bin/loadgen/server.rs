//! The bridge under load: started in a child process (`loadgen serve`, so its memory and
//! CPU are its own and its peak RSS can be read) or in this process, on loopback ports,
//! with every endpoint on and the store on disk (durable, as in the bundled config) or in
//! memory.

use std::path::Path;
use std::process::Stdio;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::agents::{Endpoints, Error};

/// The Tracker member token the load uses to create its members.
pub const TRACKER_ADMIN_TOKEN: &str = "tb-loadgen-admin";

/// A configuration with every endpoint on a loopback port the OS picks, and `extra`
/// sections (a `[federation]`) after them.
pub fn config_text(
    data_dir: &str,
    mailbox_capacity: usize,
    when_full: &str,
    extra: &str,
) -> String {
    format!(
        r#"[bridge]
data_dir = {data_dir:?}

[routing]
mailbox_capacity = {mailbox_capacity}
when_full = "{when_full}"

[skynet]
listen = "127.0.0.1:0"

[tracker]
listen = "127.0.0.1:0"

[[tracker.projects]]
slug = "load"
name = "Load"

[[tracker.members]]
slug = "loadgen-admin"
kind = "human"
token = "{TRACKER_ADMIN_TOKEN}"
chat_listen = "none"
task_listen = "none"

[synapse]
listen = "127.0.0.1:0"

[grid]
listen = "127.0.0.1:0"

{extra}"#
    )
}

/// The `[federation]` section of bridge `bridge_id` in the fleet `prefix` on `nats` (a TOML
/// list).
pub fn federation_section(nats: &str, replicas: usize, prefix: &str, bridge_id: &str) -> String {
    format!(
        "[federation]\nnats = {nats}\nbridge_id = \"{bridge_id}\"\nprefix = \"{prefix}\"\nreplicas = {replicas}\n"
    )
}

/// A running bridge; stopped when dropped (a child is killed with the process).
pub struct Server {
    pub endpoints: Endpoints,
    /// The process whose memory is the bridge's (this one when in-process).
    pub pid: u32,
    running: Running,
    _dir: tempfile::TempDir,
}

enum Running {
    Child(Child),
    InProcess(Option<agentbridge::Bridge>),
}

impl Server {
    pub async fn start(
        in_process: bool,
        durable: bool,
        mailbox_capacity: usize,
        when_full: &str,
        federation: &str,
    ) -> Result<Server, Error> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let data_dir = if durable {
            dir.path().join("data").display().to_string()
        } else {
            agentbridge::store::IN_MEMORY.to_owned()
        };
        let text = config_text(&data_dir, mailbox_capacity, when_full, federation);
        if in_process {
            let config =
                agentbridge::Config::parse(&text, "loadgen.toml").map_err(|e| e.to_string())?;
            let bridge = agentbridge::Bridge::start(config)
                .await
                .map_err(|e| e.to_string())?;
            wait_ready(&bridge).await?;
            let endpoints = endpoints_of(|name| bridge.addr(name).map(|a| a.to_string()));
            return Ok(Server {
                endpoints,
                pid: std::process::id(),
                running: Running::InProcess(Some(bridge)),
                _dir: dir,
            });
        }
        let config = dir.path().join("bridge.toml");
        std::fs::write(&config, text).map_err(|e| e.to_string())?;
        let mut child = Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the bridge: {e}"))?;
        let pid = child.id().ok_or("the bridge exited at once")?;
        let stdout = child.stdout.take().ok_or("no stdout from the bridge")?;
        let mut lines = BufReader::new(stdout).lines();
        let listening = loop {
            match lines.next_line().await.map_err(|e| e.to_string())? {
                Some(line) => {
                    if let Some(json) = line.strip_prefix("LISTENING ") {
                        break serde_json::from_str::<Value>(json).map_err(|e| e.to_string())?;
                    }
                }
                None => return Err("the bridge exited before listening".into()),
            }
        };
        let endpoints = endpoints_of(|name| listening[name].as_str().map(str::to_owned));
        Ok(Server {
            endpoints,
            pid,
            running: Running::Child(child),
            _dir: dir,
        })
    }

    pub async fn stop(mut self) {
        match &mut self.running {
            Running::Child(child) => {
                // Closing its stdin asks it to shut down cleanly.
                drop(child.stdin.take());
                let _ =
                    tokio::time::timeout(std::time::Duration::from_secs(10), child.wait()).await;
            }
            Running::InProcess(bridge) => {
                if let Some(bridge) = bridge.take() {
                    bridge.shutdown().await;
                }
            }
        }
    }
}

fn endpoints_of(addr: impl Fn(&str) -> Option<String>) -> Endpoints {
    let http = |name: &str| addr(name).map(|a| format!("http://{a}"));
    Endpoints {
        skynet: http("skynet"),
        tracker: http("tracker"),
        tracker_admin_token: Some(TRACKER_ADMIN_TOKEN.into()),
        synapse: http("synapse"),
        grid: http("grid"),
    }
}

/// Waits until `bridge` is ready: a federated one connected to its fleet.
async fn wait_ready(bridge: &agentbridge::Bridge) -> Result<(), Error> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while let Some(reason) = bridge.readiness().degraded() {
        if std::time::Instant::now() > deadline {
            return Err(format!("the bridge is not ready within 30 s: {reason}"));
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    Ok(())
}

/// `loadgen serve`: runs a bridge from `config`, prints `LISTENING {endpoint: addr}` once
/// every listener is bound and the bridge is ready, and stops when stdin closes.
pub async fn serve(config: &Path) -> Result<(), Error> {
    // The bridge's warnings, on the run's stderr (`RUST_LOG` for more).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .init();
    let config = agentbridge::Config::load(config).map_err(|e| e.to_string())?;
    let bridge = agentbridge::Bridge::start(config)
        .await
        .map_err(|e| e.to_string())?;
    wait_ready(&bridge).await?;
    let listening: serde_json::Map<String, Value> = bridge
        .listeners()
        .iter()
        .map(|(endpoint, _, addr)| (endpoint.to_string(), Value::String(addr.to_string())))
        .collect();
    println!("LISTENING {}", Value::Object(listening));
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(_)) = stdin.next_line().await {}
    bridge.shutdown().await;
    Ok(())
}

/// `(current, peak)` resident set of process `pid`, in KiB (from /proc; Linux only).
pub fn rss_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}
