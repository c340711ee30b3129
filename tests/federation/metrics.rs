//! The fleet's metrics (point 8 of the issue), read from a bridge in a process of its own,
//! as bridges in one process share one recorder: they move with what crosses, and with
//! NATS going.

use crate::common::fleet::{Fleet, QUICK};
use crate::common::grid::{GridHttp, GridWs};
use crate::common::nats::Cluster;
use crate::common::peers::{Proto, What};
use crate::common::{self, eventually};
use crate::support::{grid_request, metric, spawn_member};

async fn scrape(admin: std::net::SocketAddr) -> String {
    let answer = common::http().get(format!("http://{admin}/metrics")).send();
    answer
        .await
        .expect("/metrics answers")
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_bridges_fleet_metrics_follow_what_crosses_and_nats_going() {
    let mut cluster = Cluster::start(1).await;
    let fleet = Fleet::start_on(&cluster.toml_list(), 1, QUICK).await;
    let dir = tempfile::tempdir().unwrap();
    let process = spawn_member(&fleet, dir.path(), "b1").await;
    let admin = process.addr("admin");
    eventually(
        "b1 counts two bridges, itself included, and is connected",
        async || {
            let scrape = scrape(admin).await;
            metric(&scrape, "agentbridge_federation_bridges") == Some(2.0)
                && metric(&scrape, "agentbridge_federation_connected") == Some(1.0)
        },
    )
    .await;

    // In: b0's Skynet agent to a Grid program on b1, applied there.
    let (mut program, _) = GridWs::connect(process.addr("grid"), "metered", None).await;
    fleet.wait_known(0, "metered").await;
    let mut sky = fleet.nets[0].peer(Proto::Skynet).await;
    sky.chat("metered", "@metered in", None).await;
    let got = program.next_message().await;
    assert!(got.to_string().contains("@metered in"), "{got}");
    // Out: published by b1, for b0's Skynet agent, once b1 knows it.
    let sender = GridHttp::new(process.addr("grid"));
    eventually("b1 knows the Skynet agent", async || {
        let (_, listed) = sender.get("/agents").await;
        let agents = listed["agents"].as_array().cloned().unwrap_or_default();
        agents.iter().any(|a| a["agent"] == sky.name.as_str())
    })
    .await;
    sender
        .send(&grid_request("out-1", "metered", &sky.name))
        .await;
    assert_eq!(sky.next(What::Chat).await.text, "out-1");

    // Counted as each publish's answer lands, which may come after its delivery.
    let counted = |taken: &str| {
        let count = |series: &str| metric(taken, series).unwrap_or_default();
        count(r#"agentbridge_federation_messages_total{direction="in",outcome="ok"}"#) >= 1.0
            && count(r#"agentbridge_federation_messages_total{direction="out",outcome="ok"}"#)
                >= 1.0
            && count("agentbridge_federation_apply_lag_seconds_count") >= 1.0
            && count("agentbridge_federation_publish_duration_seconds_count") >= 1.0
            && metric(taken, "agentbridge_federation_outbox") == Some(0.0)
    };
    eventually(
        "b1 counts a message each way, and nothing in flight",
        async || counted(&scrape(admin).await),
    )
    .await;
    let taken = scrape(admin).await;
    // No agent's name is a label.
    assert!(!taken.contains("metered"), "{taken}");

    // NATS gone: b1 says so, and keeps what its own agents say meanwhile to share later.
    let unshared = "agentbridge_federation_unshared";
    assert_eq!(metric(&taken, unshared), Some(0.0));
    cluster.kill(0);
    eventually("b1 is no longer connected", async || {
        metric(&scrape(admin).await, "agentbridge_federation_connected") == Some(0.0)
    })
    .await;
    sender
        .send(&grid_request("local-1", "poster", "metered"))
        .await;
    assert_eq!(program.next_message().await["id"], "local-1");
    eventually("b1 keeps the local message to share", async || {
        metric(&scrape(admin).await, unshared) == Some(1.0)
    })
    .await;
    drop(process);
    fleet.shutdown().await;
}
