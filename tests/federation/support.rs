//! Helpers more than one of the federation tests' modules use.

use std::time::{Duration, Instant};

use crate::common::fleet::{Fleet, QUICK, SET_UP_WAIT, federation_section};
use crate::common::grid::read_until_got;
use crate::common::nats::Cluster;
use crate::common::peers::{Peer, Proto, What};
use crate::common::process::BridgeProcess;
use crate::common::{self, bridge_toml, eventually};

/// An HTTP client that gives up after 300 ms, well within a NATS pause of the tests.
pub(crate) fn impatient_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap()
}

/// Bridge `id` of `fleet` as a child process (so that it can be killed), its store in
/// `dir`, connected to the fleet when this returns.
pub(crate) async fn spawn_member(fleet: &Fleet, dir: &std::path::Path, id: &str) -> BridgeProcess {
    let section = federation_section(&fleet.nats, &fleet.prefix, id, QUICK);
    spawn_bridge(dir, id, &section).await
}

/// Bridge `id` as a child process with `[federation]` `section`, its store in `dir`,
/// connected to the fleet when this returns.
pub(crate) async fn spawn_bridge(dir: &std::path::Path, id: &str, section: &str) -> BridgeProcess {
    let config = dir.join(format!("{id}.toml"));
    let data = dir.join(format!("data-{id}"));
    std::fs::write(&config, bridge_toml(data.to_str().unwrap(), section)).unwrap();
    let process = BridgeProcess::spawn(&config);
    let readyz = format!("http://{}/readyz", process.addr("admin"));
    let deadline = Instant::now() + SET_UP_WAIT;
    loop {
        let said = match common::http().get(&readyz).send().await {
            Ok(answer) => answer.text().await.unwrap_or_else(|e| e.to_string()),
            Err(e) => e.to_string(),
        };
        if said.starts_with("ready") {
            return process;
        }
        if Instant::now() >= deadline {
            let warned = std::iter::from_fn(|| {
                process.next_log(Duration::from_millis(1), |line| line["level"] == "WARN")
            });
            let warned: Vec<String> = warned.map(|line| line["fields"].to_string()).collect();
            panic!(
                "bridge {id} is not connected to the fleet within {SET_UP_WAIT:?}: {said}\nits warnings:\n{}",
                warned.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Stops the one NATS server of `cluster` and waits until `bridge` says it is degraded.
pub(crate) async fn nats_goes_away(cluster: &mut Cluster, bridge: &agentbridge::Bridge) {
    cluster.kill(0);
    eventually("the bridge says it is degraded", async || {
        bridge.readiness().degraded().is_some()
    })
    .await;
}

/// Starts the NATS server of `cluster` again and waits until `bridge` is ready.
pub(crate) async fn nats_is_back(cluster: &mut Cluster, bridge: &agentbridge::Bridge) {
    cluster.restart(0).await;
    eventually("the bridge is ready again", async || {
        bridge.readiness().degraded().is_none()
    })
    .await;
}

/// A Skynet agent on b0 and, known there, a Tracker agent on b1: sender and receiver.
pub(crate) async fn skynet_on_b0_to_tracker_on_b1(fleet: &Fleet) -> (Peer, Peer) {
    let receiver = fleet.nets[1].peer(Proto::Tracker).await;
    fleet.wait_known(0, &receiver.name).await;
    (fleet.nets[0].peer(Proto::Skynet).await, receiver)
}

/// Reads chats `@coder 0` … `@coder {count - 1}`, each once, in that order.
pub(crate) async fn chats_in_order(receiver: &mut Peer, count: usize) {
    for n in 0..count {
        let seen = receiver.next(What::Chat).await;
        assert_eq!(seen.text, format!("@coder {n}"), "message {n} in order");
    }
}

/// A Grid message with id `id` from `from` to `to`.
pub(crate) fn grid_request(id: &str, from: &str, to: &str) -> String {
    grid_note(id, from, to, id)
}

/// A Grid request with id `id` from `from` to `to` whose payload's text is `text`.
pub(crate) fn grid_note(id: &str, from: &str, to: &str, text: &str) -> String {
    format!(
        "message: {{ id: {id}, type: request, sender: {{ agent: {from} }}, receiver: {{ agent: {to} }}, content: {{ action: note, payload: {{ text: {text} }} }} }}"
    )
}

/// A Grid program known to `fleet`'s bridge `i` and away: mail for it is queued (by that
/// bridge, in the fleet's records) rather than sent.
pub(crate) async fn away_program(fleet: &Fleet, i: usize, name: &str) {
    let (socket, _) = common::grid::GridWs::connect(fleet.nets[i].grid, name, None).await;
    drop(socket);
    for net in &fleet.nets {
        let directory = &net.bridge.core().directory;
        eventually("every bridge shows the program away", async || {
            directory.get(name).is_some_and(|a| !a.online)
        })
        .await;
    }
}

/// The `[federation]` section of bridge `b<i>` of fleet `prefix`, on the one NATS server
/// `nats` of a three-server cluster (so that killing that server cuts it off), with
/// replicated streams and quick heartbeats.
pub(crate) fn on_one_server(
    nats: &str,
    i: usize,
    prefix: &str,
    presence_ttl_ms: u32,
    publish_timeout_ms: u32,
) -> String {
    format!(
        "[federation]\nnats = [\"{nats}\"]\nbridge_id = \"b{i}\"\nprefix = \"{prefix}\"\nreplicas = 3\n\
         heartbeat_ms = 200\npresence_ttl_ms = {presence_ttl_ms}\npublish_timeout_ms = {publish_timeout_ms}\n"
    )
}

/// `name` as bridge `process` lists it (`/admin/api/agents`), if it does.
pub(crate) async fn listed(process: &BridgeProcess, name: &str) -> Option<serde_json::Value> {
    let agents = format!("http://{}/admin/api/agents", process.addr("admin"));
    let answer = common::http().get(&agents).send().await.ok()?;
    let listed: serde_json::Value = answer.json().await.ok()?;
    (listed["agents"].as_array()?.iter())
        .find(|a| a["name"] == name)
        .cloned()
}

/// Waits until bridge `process` says it is ready (`/readyz`), or, with `ready` false,
/// that it is not (degraded: cut off from NATS).
pub(crate) async fn readiness_is(process: &BridgeProcess, ready: bool) {
    let readyz = format!("http://{}/readyz", process.addr("admin"));
    eventually("the bridge's readiness", async || {
        match common::http().get(&readyz).send().await {
            Ok(answer) => (answer.text().await).is_ok_and(|t| t.starts_with("ready") == ready),
            Err(_) => false,
        }
    })
    .await;
}

/// Sends `total` Grid requests `m0`, `m1`, … from `sender`, a socket of `from`, to `to`,
/// resting `pause` after every ten; the socket back once all are sent.
pub(crate) fn send_steadily(
    sender: common::grid::GridWs,
    from: &'static str,
    to: &'static str,
    total: usize,
    pause: Duration,
) -> tokio::task::JoinHandle<common::grid::GridWs> {
    send_steadily_padded(sender, from, to, total, pause, 0)
}

/// As `send_steadily`, each message's text `padding` bytes longer.
pub(crate) fn send_steadily_padded(
    mut sender: common::grid::GridWs,
    from: &'static str,
    to: &'static str,
    total: usize,
    pause: Duration,
    padding: usize,
) -> tokio::task::JoinHandle<common::grid::GridWs> {
    let pad = "x".repeat(padding);
    tokio::spawn(async move {
        for n in 0..total {
            let id = format!("m{n}");
            sender
                .send(&grid_note(&id, from, to, &format!("{id}{pad}")))
                .await;
            if n % 10 == 9 {
                tokio::time::sleep(pause).await;
            }
        }
        sender
    })
}

/// Reads `socket`, a socket of `agent` on the bridge at `addr`, until `got` holds `total`
/// numbers (each once), or nothing comes for `QUIET_AT_MOST`.
pub(crate) async fn read_rest(
    socket: &mut common::grid::GridWs,
    at: (std::net::SocketAddr, &str),
    got: &mut Vec<usize>,
    total: usize,
) {
    read_until_got(socket, at, got, &(0..total).collect()).await;
}

/// The value of `series` (a metric's name with its labels) in a bridge's `/metrics`.
pub(crate) fn metric(metrics: &str, series: &str) -> Option<f64> {
    let line = format!("{series} ");
    (metrics.lines().find_map(|l| l.strip_prefix(line.as_str())))
        .and_then(|n| n.trim().parse::<f64>().ok())
}

/// `got` holds each of `0..total` once, in order.
pub(crate) fn assert_once_in_order(got: &[usize], total: usize) {
    let mut seen = std::collections::HashSet::new();
    let twice: Vec<_> = got.iter().filter(|n| !seen.insert(**n)).collect();
    let missing: Vec<_> = (0..total).filter(|n| !seen.contains(n)).collect();
    let out_of_order: Vec<_> = (got.windows(2))
        .filter(|pair| pair[0] > pair[1])
        .map(|pair| (pair[0], pair[1]))
        .collect();
    assert!(
        twice.is_empty() && missing.is_empty() && out_of_order.is_empty(),
        "twice {twice:?}, missing {missing:?}, out of order {out_of_order:?}"
    );
}

/// Waits until bridge `i` shows `name` held by `bridge` (`None`: itself), online or not.
pub(crate) async fn wait_held(
    fleet: &Fleet,
    i: usize,
    name: &str,
    bridge: Option<&str>,
    online: bool,
) {
    let directory = &fleet.nets[i].bridge.core().directory;
    let what = format!("b{i} shows {name} on {bridge:?}, online {online}");
    eventually(&what, async || {
        (directory.get(name)).is_some_and(|a| a.online == online && a.bridge.as_deref() == bridge)
    })
    .await;
}

/// A Synapse agent known to `fleet`'s bridge `i` and away (its stream opened and closed):
/// mail for it is kept (by that bridge, in the fleet's records) rather than sent.
pub(crate) async fn away_synapse_agent(fleet: &Fleet, i: usize, name: &str) {
    drop(common::synapse::Stream::open(fleet.nets[i].synapse, name).await);
    for net in &fleet.nets {
        let directory = &net.bridge.core().directory;
        eventually("every bridge shows the agent away", async || {
            directory.get(name).is_some_and(|a| !a.online)
        })
        .await;
    }
}

/// Whether `bridge`'s store holds a message saying `text`.
pub(crate) async fn holds_text(bridge: &agentbridge::Bridge, text: &str) -> bool {
    let query = agentbridge::core::MessageQuery {
        limit: 1000,
        ..Default::default()
    };
    let said = |m: &agentbridge::core::StoredMessage| m.envelope.text.as_deref() == Some(text);
    (bridge.core().log.read(query).await).is_ok_and(|all| all.iter().any(said))
}
