//! Bridges federated over a real NATS cluster, for the federation tests. The test binary
//! shares one 3-node cluster (started on first use, stopped when the binary exits); each
//! fleet keeps to its own subjects, stream and buckets by a prefix of its own. Tests that
//! stop NATS servers start a cluster of their own (`nats::Cluster::start`).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use agentbridge::{Bridge, Config};

use super::nats::Cluster;
use super::peers::Net;
use super::{WAIT, bridge_toml};

/// The shared cluster's `nats = [...]` list.
fn shared_cluster() -> &'static str {
    static URLS: OnceLock<String> = OnceLock::new();
    URLS.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        // Its own thread, parked for the life of the binary: the servers are told to die
        // with the thread that started them (`PR_SET_PDEATHSIG`).
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            let cluster = runtime.block_on(Cluster::start(3));
            tx.send(cluster.toml_list()).expect("the test waits");
            loop {
                std::thread::park();
            }
        });
        rx.recv().expect("the shared NATS cluster starts")
    })
}

/// A prefix no other fleet of this test binary uses.
fn fresh_prefix() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "t{}x{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// How long a bridge may take to set up its stream and buckets: each replicated stream,
/// bucket and consumer it creates elects a leader, seconds apiece on a busy machine.
pub const SET_UP_WAIT: Duration = Duration::from_secs(WAIT.as_secs() * 3);

/// How quickly the tests' bridges notice one another go: a fast presence TTL, a short
/// publish timeout.
pub const QUICK: &str = "heartbeat_ms = 200\npresence_ttl_ms = 1500\npublish_timeout_ms = 2000\n";

/// The `[federation]` section of bridge `id` on the cluster `nats` (a TOML list), with as
/// many replicas as the cluster has servers, up to 3, and `timing`'s keys (`QUICK`).
pub fn federation_section(nats: &str, prefix: &str, id: &str, timing: &str) -> String {
    let replicas = nats.matches("nats://").count().clamp(1, 3);
    format!(
        "[federation]\nnats = {nats}\nbridge_id = \"{id}\"\nprefix = \"{prefix}\"\nreplicas = {replicas}\n{timing}"
    )
}

/// Bridges `b0`, `b1`, … of one fleet, each with every endpoint on loopback ports.
pub struct Fleet {
    pub nets: Vec<Net>,
    pub prefix: String,
    pub nats: String,
}

impl Fleet {
    /// `size` bridges on the shared cluster, each with its stream consumer and heartbeats
    /// running when this returns.
    pub async fn start(size: usize) -> Fleet {
        let nats = shared_cluster().to_owned();
        Fleet::start_on(&nats, size, QUICK).await
    }

    /// As `start`, with `timing`'s `[federation]` keys.
    pub async fn start_timed(size: usize, timing: &str) -> Fleet {
        Fleet::start_on(shared_cluster(), size, timing).await
    }

    /// As `start`, on the cluster `nats`, with `timing`'s `[federation]` keys.
    pub async fn start_on(nats: &str, size: usize, timing: &str) -> Fleet {
        let prefix = fresh_prefix();
        let mut nets = Vec::new();
        for i in 0..size {
            nets.push(start_member(nats, &prefix, &format!("b{i}"), ":memory:", timing).await);
        }
        let fleet = Fleet {
            nets,
            prefix,
            nats: nats.to_owned(),
        };
        fleet.wait_set_up().await;
        fleet
    }

    /// Waits until every bridge is connected with its stream and buckets set up, and lets
    /// clients in.
    pub async fn wait_set_up(&self) {
        let deadline = Instant::now() + SET_UP_WAIT;
        for net in &self.nets {
            let readiness = net.bridge.readiness();
            while readiness.degraded().is_some() || !readiness.doors().is_open() {
                assert!(
                    Instant::now() < deadline,
                    "a bridge of the fleet did not get ready: {:?}",
                    readiness.degraded()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// Waits until bridge `i` knows agent `name` (held by another bridge) as online.
    pub async fn wait_known(&self, i: usize, name: &str) {
        let directory = &self.nets[i].bridge.core().directory;
        let deadline = Instant::now() + WAIT;
        while !directory
            .get(name)
            .is_some_and(|a| a.online && a.bridge.is_some())
        {
            assert!(
                Instant::now() < deadline,
                "bridge b{i} does not show {name} online on another bridge: {:?}",
                directory.get(name)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// How many live records `table` of the fleet's shared records holds, read from NATS
    /// itself (`docs/federation.md`: the records bucket, keys `<table>.<key>`).
    pub async fn records_in(&self, table: &str) -> usize {
        use futures_util::StreamExt;
        let bucket = self.bucket("records").await;
        let mut keys = bucket.keys().await.expect("the records' keys");
        let mut count = 0;
        while let Some(key) = keys.next().await {
            if key.expect("a key").starts_with(&format!("{table}.")) {
                count += 1;
            }
        }
        count
    }

    /// Waits until `table` of the fleet's shared records holds `count` live records.
    pub async fn wait_records_in(&self, table: &str, count: usize) {
        let deadline = Instant::now() + WAIT;
        loop {
            let held = self.records_in(table).await;
            if held == count {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the fleet's {table} holds {held} records, not {count}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// The name of the fleet's stream of messages.
    pub fn stream_name(&self) -> String {
        format!("{}_MESSAGES", self.prefix.to_ascii_uppercase())
    }

    /// A JetStream client of the fleet's cluster.
    pub async fn jetstream(&self) -> async_nats::jetstream::Context {
        let url = self.nats.split('"').nth(1).expect("a NATS URL");
        let client = async_nats::connect(url).await.expect("NATS answers");
        async_nats::jetstream::new(client)
    }

    /// The fleet's names bucket: which bridge holds each name a client registered.
    pub async fn names(&self) -> async_nats::jetstream::kv::Store {
        self.bucket("names").await
    }

    /// The fleet's KV bucket `name` (`bridges`, `floors`, `records`, …: docs/federation.md,
    /// *Names in NATS*).
    pub async fn bucket(&self, name: &str) -> async_nats::jetstream::kv::Store {
        let js = self.jetstream().await;
        let bucket = js.get_key_value(format!("{}_{name}", self.prefix)).await;
        bucket.unwrap_or_else(|e| panic!("the {name} bucket: {e}"))
    }

    pub async fn shutdown(self) {
        for net in self.nets {
            net.bridge.shutdown().await;
        }
    }
}

/// Bridge `id` of the fleet `prefix` on `nats`.
pub async fn start_member(nats: &str, prefix: &str, id: &str, data_dir: &str, timing: &str) -> Net {
    let text = bridge_toml(data_dir, &federation_section(nats, prefix, id, timing));
    let config = Config::parse(&text, "fleet.toml").expect("the fleet's config parses");
    Net::on(
        Bridge::start(config)
            .await
            .expect("a bridge of the fleet starts"),
    )
}

/// What the names bucket `names` (`Fleet::names`) says of `name`: its claim as JSON, `Null`
/// when there is none; `Err` when NATS does not answer.
pub async fn claim_of(
    names: &async_nats::jetstream::kv::Store,
    name: &str,
) -> Result<serde_json::Value, String> {
    let key = base64::Engine::encode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, name);
    let claim = names.get(&key).await.map_err(|e| e.to_string())?;
    Ok(claim
        .map(|c| serde_json::from_slice(&c).expect("a claim is JSON"))
        .unwrap_or_default())
}
