//! NATS faults: a server of the cluster killed, NATS wholly away, the fleet's stream or a
//! bridge's consumers gone.

use std::time::{Duration, Instant};

use crate::common::fleet::{Fleet, QUICK, federation_section};
use crate::common::nats::Cluster;
use crate::common::peers::{Peer, Proto, What};
use crate::common::process::BridgeProcess;
use crate::common::tracker::TrackerHttp;
use crate::common::{self, WAIT, eventually, eventually_within};
use crate::support::{
    chats_in_order, holds_text, metric, nats_goes_away, nats_is_back,
    skynet_on_b0_to_tracker_on_b1, spawn_bridge, spawn_member,
};

/// Deliveries of a bridge's consumer that never reach its reading — served to a pull
/// request left from a reading before, or lost in flight as its NATS server failed — are
/// read from the stream, not acknowledged past unapplied. Here another client's pull
/// request on the consumer takes some.
#[tokio::test]
async fn deliveries_taken_from_a_bridges_consumer_elsewhere_still_reach_its_agents() {
    use futures_util::StreamExt;

    let fleet = Fleet::start(2).await;
    let (mut sender, mut receiver) = skynet_on_b0_to_tracker_on_b1(&fleet).await;
    let js = fleet.jetstream().await;
    let client = js.client();
    let inbox = client.new_inbox();
    let mut taken = client
        .subscribe(inbox.clone())
        .await
        .expect("a subscription");
    let stream = fleet.stream_name();
    let request = r#"{"batch":4,"expires":30000000000}"#;
    client
        .publish_with_reply(
            format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.bridge-b1"),
            inbox,
            request.into(),
        )
        .await
        .expect("a pull request");
    client.flush().await.expect("flushed");
    const COUNT: usize = 40;
    for n in 0..COUNT {
        sender
            .chat(&receiver.name, &format!("@coder {n}"), None)
            .await;
        // One publish each, so that the requests waiting on the consumer share them.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut stolen = 0;
    while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(300), taken.next()).await {
        stolen += 1;
    }
    assert!(stolen > 0, "the other pull request was given none");
    chats_in_order(&mut receiver, COUNT).await;
    let (_, metrics) = common::admin_get(&fleet.nets[1].bridge, "/metrics").await;
    let gaps = metrics
        .lines()
        .find_map(|line| line.strip_prefix("agentbridge_federation_delivery_gaps_total "));
    assert!(gaps.is_some_and(|n| n != "0"), "gaps counted: {gaps:?}");
    fleet.shutdown().await;
}

/// A bridge whose consumer of the stream is gone (deleted by hand, as `nats consumer rm`
/// does) makes it again, from the message after the last it acknowledged: what is sent to
/// its agents from another bridge reaches them again, in order, none lost meanwhile.
#[tokio::test]
async fn a_bridge_whose_consumer_was_deleted_makes_it_again_and_misses_nothing() {
    let fleet = Fleet::start(2).await;
    let (mut sender, mut receiver) = skynet_on_b0_to_tracker_on_b1(&fleet).await;
    sender.chat(&receiver.name, "@coder 0", None).await;
    chats_in_order(&mut receiver, 1).await;
    let js = fleet.jetstream().await;
    let stream = fleet.stream_name();
    let stream = js.get_stream(stream).await.expect("the fleet's stream");
    (stream.delete_consumer("bridge-b1").await).expect("b1's consumer deleted");
    const COUNT: usize = 20;
    for n in 1..COUNT {
        sender
            .chat(&receiver.name, &format!("@coder {n}"), None)
            .await;
    }
    for n in 1..COUNT {
        let seen = receiver.next(What::Chat).await;
        assert_eq!(seen.text, format!("@coder {n}"), "message {n} in order");
    }
    fleet.shutdown().await;
}

/// A stream of messages deleted and made again by hand under running bridges, and already
/// past the sequence a bridge had acknowledged on the old one when that bridge makes its
/// consumer again: the bridge reads the new stream from its start (it was made anew, as its
/// creation time says), so a message sent to its agent early in the new stream arrives.
#[tokio::test]
async fn a_bridge_reads_a_stream_made_again_from_its_start_though_it_is_past_the_old_floor() {
    let fleet = Fleet::start(2).await;
    let (mut sender, mut receiver) = skynet_on_b0_to_tracker_on_b1(&fleet).await;
    sender.chat(&receiver.name, "@coder before", None).await;
    assert_eq!(receiver.next(What::Chat).await.text, "@coder before");
    let js = fleet.jetstream().await;
    let name = fleet.stream_name();
    let mut stream = js.get_stream(&name).await.expect("the fleet's stream");
    let old = stream.info().await.expect("its info").clone();
    js.delete_stream(&name).await.expect("the stream deleted");
    // Both bridges' readings fail, and try again backing off, up to two seconds apart.
    tokio::time::sleep(Duration::from_secs(3)).await;
    js.create_stream(old.config.clone())
        .await
        .expect("the stream made again");
    // The receiver's chat first, then, at once, more than the old stream held (messages no
    // bridge reads as its own, passed over with an error logged): the receiving bridge
    // most likely makes its consumer again only once the new stream is past the sequence
    // it had acknowledged on the old one.
    sender.chat(&receiver.name, "@coder after", None).await;
    let subject = format!("{}.msg.filler", fleet.prefix);
    let mut fillers = Vec::new();
    for _ in 0..old.state.last_sequence + 5 {
        let published = js.publish(subject.clone(), "filler".into()).await;
        fillers.push(published.expect("a filler published"));
    }
    for filler in fillers {
        filler.await.expect("a filler stored");
    }
    assert_eq!(receiver.next(What::Chat).await.text, "@coder after");
    fleet.shutdown().await;
}

/// Deletes the consumers of the fleet's bucket `bucket` (`records`, `bridges`, …) whose
/// filter ends with `keys`, as the failure of the NATS server holding them would end them:
/// the clients reading them are not told. How many there were.
async fn consumers_gone(fleet: &Fleet, bucket: &str, keys: &str) -> usize {
    use futures_util::TryStreamExt;
    let js = fleet.jetstream().await;
    let stream = js.get_stream(format!("KV_{}_{bucket}", fleet.prefix));
    let stream = stream.await.expect("the bucket");
    let consumers: Vec<_> = (stream.consumers().try_collect().await).expect("its consumers");
    let mut gone = 0;
    for consumer in consumers
        .iter()
        .filter(|c| c.config.filter_subject.ends_with(keys))
    {
        match stream.delete_consumer(&consumer.name).await {
            Ok(_) => gone += 1,
            // Gone between the listing and the delete: one an ordered reading (a key
            // listing, a watch made again) had for a moment.
            Err(e) if e.to_string().contains("consumer not found") => {}
            Err(e) => panic!("the consumer goes: {e}"),
        }
    }
    gone
}

/// NATS wholly gone: agents on one bridge still reach one another; a message for an agent
/// on another bridge is refused in the sender's protocol; `/readyz` says why. When NATS
/// comes back, so does the fleet, and what was said meanwhile reaches its history.
#[tokio::test]
async fn without_nats_local_traffic_goes_on_and_crossing_traffic_is_refused() {
    let mut cluster = Cluster::start(1).await;
    let fleet = Fleet::start_on(&cluster.toml_list(), 2, QUICK).await;
    let mut remote = fleet.nets[1].peer(Proto::Tracker).await;
    fleet.wait_known(0, &remote.name).await;
    let mut local = fleet.nets[0].peer(Proto::Skynet).await;
    let mut sender = fleet.nets[0].peer(Proto::Grid).await;

    let bridge = &fleet.nets[0].bridge;
    nats_goes_away(&mut cluster, bridge).await;
    let (_, readyz) = common::admin_get(bridge, "/readyz").await;
    assert!(readyz.starts_with("degraded: "), "{readyz}");
    assert!(readyz.contains("NATS"), "{readyz}");

    // Same bridge: delivered.
    sender.chat(&local.name, "still here", None).await;
    assert_eq!(local.next(What::Chat).await.text, "still here");
    // Another bridge: refused in the sender's protocol, not acknowledged and lost.
    let refusal = sender.chat_to_unknown(&remote.name).await;
    assert!(refusal.contains("NATS"), "{refusal}");

    nats_is_back(&mut cluster, bridge).await;
    sender.chat(&remote.name, "@coder back", None).await;
    assert_eq!(remote.next(What::Chat).await.text, "@coder back");
    // What b0's agents said among themselves meanwhile reaches the fleet's history.
    eventually(
        "b1's history has what b0 kept while NATS was away",
        async || holds_text(&fleet.nets[1].bridge, "still here").await,
    )
    .await;
    fleet.shutdown().await;
}

/// One of three NATS servers killed, the one the sending bridge is connected to: its client
/// moves to another, and messages keep crossing, in order.
#[tokio::test]
async fn one_nats_server_of_three_killed_traffic_goes_on() {
    let (mut cluster, fleet, mut sender, mut receiver) = fleet_riding_out_failovers().await;
    sender.chat(&receiver.name, "before", None).await;
    assert_eq!(receiver.next(What::Chat).await.text, "before");
    // The server the sending bridge is connected to: it must connect to another.
    let serving = cluster.serving("agentbridge b0").await;
    let serving = serving.expect("a server serves b0's connection");
    cluster.kill(serving);
    for n in 0..20 {
        sender
            .chat(&receiver.name, &format!("after {n}"), None)
            .await;
    }
    for n in 0..20 {
        assert_eq!(receiver.next(What::Chat).await.text, format!("after {n}"));
    }
    assert!(
        cluster.serving("agentbridge b0").await.is_some(),
        "b0 is connected to another server"
    );
    fleet.shutdown().await;
}

/// One of three NATS servers killed while messages flow, the one the receiving bridge reads
/// the stream through: what that server was passing on as it went is read from the stream
/// (a gap in the consumer's deliveries), and every message arrives once, in order.
#[tokio::test]
async fn the_nats_server_a_bridge_reads_through_killed_mid_flow_loses_nothing() {
    nats_server_killed_mid_flow(async |cluster, _| cluster.serving("agentbridge b1").await).await;
}

/// As above, for the server the sending bridge publishes through: publishes whose answer
/// it took with it are made again, and each message still arrives once, in order.
#[tokio::test]
async fn the_nats_server_a_bridge_publishes_through_killed_mid_flow_loses_nothing() {
    nats_server_killed_mid_flow(async |cluster, _| cluster.serving("agentbridge b0").await).await;
}

/// As above, for the server leading the stream of messages: the others elect another
/// while publishes and deliveries wait.
#[tokio::test]
async fn the_nats_server_leading_the_stream_killed_mid_flow_loses_nothing() {
    nats_server_killed_mid_flow(async |cluster, fleet| {
        let url = cluster.urls().remove(0);
        let stream = fleet.stream_name();
        cluster.leading(&url, &stream).await
    })
    .await;
}

/// Tracker tasks created through a bridge while the NATS server it is connected to fails:
/// each is created once (201; a write whose answer the failed connection took is made
/// again under its id), and the other bridge has every one.
#[tokio::test]
async fn tracker_tasks_created_as_a_bridges_nats_server_fails_are_each_kept_once() {
    let (mut cluster, fleet, _, _) = fleet_riding_out_failovers().await;
    let patient = |addr| TrackerHttp::new(addr, "tb-admin").waiting_up_to(Duration::from_secs(60));
    let (on_a, on_b) = (
        patient(fleet.nets[0].tracker),
        patient(fleet.nets[1].tracker),
    );
    let (mut made, mut killed) = (Vec::new(), false);
    for n in 0..40 {
        if n == 10 {
            let serving = cluster.serving("agentbridge b0").await;
            cluster.kill(serving.expect("a server serves b0's connection"));
            killed = true;
        }
        let task = on_a
            .task(
                "team-board",
                serde_json::json!({ "title": format!("failover {n}") }),
            )
            .await;
        made.push(task["id"].as_str().expect("a task id").to_owned());
    }
    assert!(killed);
    // A watch whose consumer went with the server starts again once it misses a change
    // (`a_records_watch_whose_consumer_went_is_made_again_when_it_misses_a_change`); the
    // stream's leader may be elected again meanwhile.
    eventually_within("b1 has every task once", 3 * WAIT, async || {
        let (_, tasks) = on_b.get("/tasks?project_slug=team-board").await;
        let titles: Vec<String> = (tasks.as_array().into_iter().flatten())
            .filter_map(|t| t["title"].as_str())
            .filter(|t| t.starts_with("failover "))
            .map(str::to_owned)
            .collect();
        titles.len() == 40
            && (0..40).all(|n| {
                titles
                    .iter()
                    .filter(|t| **t == format!("failover {n}"))
                    .count()
                    == 1
            })
    })
    .await;
    fleet.shutdown().await;
}

/// A watch of the fleet's records whose consumer went without a word (its NATS server
/// failed while the bridge's own stayed up) is made again once the stream holds a change it
/// did not deliver, rather than after the ten seconds of missed heartbeats async-nats waits.
/// The watching bridge is a process of its own, so that its metrics are its own.
#[tokio::test]
async fn a_records_watch_whose_consumer_went_is_made_again_when_it_misses_a_change() {
    let fleet = Fleet::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let b1 = spawn_member(&fleet, dir.path(), "b1").await;
    let (on_a, on_b) = (
        TrackerHttp::new(fleet.nets[0].tracker, "tb-admin"),
        TrackerHttp::new(b1.addr("tracker"), "tb-admin"),
    );
    let has = async |title: &str| {
        let (_, tasks) = on_b.get("/tasks?project_slug=team-board").await;
        (tasks.as_array().into_iter().flatten()).any(|t| t["title"] == title)
    };
    on_a.task("team-board", serde_json::json!({ "title": "before" }))
        .await;
    eventually_within("b1 has the task made before", WAIT, async || {
        has("before").await
    })
    .await;

    let before = stalls_counted(&b1, "records").await;
    let gone = consumers_gone(&fleet, "records", ".tracker-tasks.>").await;
    assert!(gone >= 2, "each bridge watches the tasks: {gone}");
    on_a.task("team-board", serde_json::json!({ "title": "after" }))
        .await;
    let made = Instant::now();
    eventually_within("b1 has the task made after", 3 * WAIT, async || {
        has("after").await
    })
    .await;
    println!("b1 had the task {:?} after it was made", made.elapsed());
    let stalls = stalls_counted(&b1, "records").await;
    assert!(stalls > before, "stalls counted: {before}, then {stalls}");
    fleet.shutdown().await;
}

/// A watch of the heartbeats whose consumer went without a word is made again within the
/// presence TTL: its bridge (a process of its own) does not take the others for gone
/// meanwhile, nor show their agents offline.
#[tokio::test]
async fn a_heartbeats_watch_whose_consumer_went_is_made_again_before_the_others_seem_gone() {
    let timing = "heartbeat_ms = 200\npresence_ttl_ms = 3000\npublish_timeout_ms = 2000\n";
    let fleet = Fleet::start_timed(1, timing).await;
    let dir = tempfile::tempdir().unwrap();
    let section = federation_section(&fleet.nats, &fleet.prefix, "b1", timing);
    let b1 = spawn_bridge(dir.path(), "b1", &section).await;
    let sky = fleet.nets[0].peer(Proto::Skynet).await;
    let agents = format!("http://{}/admin/api/agents", b1.addr("admin"));
    // Whether b1 shows the agent on b0 online; `None` when b1 did not answer.
    let online_on_b1 =
        async || {
            let answer = common::http().get(&agents).send().await.ok()?;
            let listed: serde_json::Value = answer.json().await.ok()?;
            let agents = listed["agents"].as_array()?;
            Some((agents.iter()).any(|a| {
                a["name"] == sky.name.as_str() && a["bridge"] == "b0" && a["online"] == true
            }))
        };
    eventually_within("b1 shows the agent on b0 online", WAIT, async || {
        online_on_b1().await == Some(true)
    })
    .await;

    let before = stalls_counted(&b1, "heartbeats").await;
    let gone = consumers_gone(&fleet, "bridges", ">").await;
    assert!(gone >= 2, "each bridge watches the heartbeats: {gone}");
    // Two TTLs, in which a watch left stalled would have its bridge take b0 for gone.
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        let left = until - Instant::now();
        let online = online_on_b1().await;
        assert_ne!(
            online,
            Some(false),
            "b1 took b0 for gone, {left:?} before the end"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stalls = stalls_counted(&b1, "heartbeats").await;
    assert!(stalls > before, "stalls counted: {before}, then {stalls}");
    fleet.shutdown().await;
}

/// How many times the bridge `process` made a watch of `watch` (`records`, `heartbeats`,
/// `cards`) again after it stalled, from its `/metrics`.
async fn stalls_counted(process: &BridgeProcess, watch: &str) -> f64 {
    let metrics = format!("http://{}/metrics", process.addr("admin"));
    let answer = common::http().get(&metrics).send().await;
    let text = answer.expect("the bridge answers").text().await.unwrap();
    let series = format!(r#"agentbridge_federation_watch_stalls_total{{watch="{watch}"}}"#);
    metric(&text, &series).expect("the bridge counts stalls")
}

/// Two bridges on a cluster of three NATS servers, with a Skynet agent on b0 (the sender)
/// and a Grid program on b1 (the receiver) that wait out a server's failover.
async fn fleet_riding_out_failovers() -> (Cluster, Fleet, Peer, Peer) {
    let cluster = Cluster::start(3).await;
    // Room for a stream leader to be elected again on a loaded machine: the bridges must not
    // take one another for dead, nor give up on a publish, meanwhile.
    let timing = "heartbeat_ms = 200\npresence_ttl_ms = 15000\npublish_timeout_ms = 15000\n";
    let fleet = Fleet::start_on(&cluster.toml_list(), 2, timing).await;
    let mut receiver = fleet.nets[1].peer(Proto::Grid).await;
    fleet.wait_known(0, &receiver.name).await;
    let mut sender = fleet.nets[0].peer(Proto::Skynet).await;
    // A message for the other bridge waits for the client to reconnect, and for the
    // stream's leader to be elected again, up to the publish timeout.
    for peer in [&mut sender, &mut receiver] {
        peer.wait_up_to(Duration::from_secs(30));
    }
    (cluster, fleet, sender, receiver)
}

/// Sends 400 chats from a Skynet agent on b0 to a Grid program on b1, and kills the NATS
/// server `pick` names a quarter of the way in.
async fn nats_server_killed_mid_flow(pick: impl AsyncFnOnce(&Cluster, &Fleet) -> Option<usize>) {
    let (mut cluster, fleet, mut sender, mut receiver) = fleet_riding_out_failovers().await;
    const TOTAL: usize = 400;
    const BEFORE: usize = 100;
    let to = receiver.name.clone();
    let sending = tokio::spawn(async move {
        for n in 0..TOTAL {
            sender.chat(&to, &format!("flow {n}"), None).await;
            if n % 10 == 9 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        sender
    });
    for n in 0..BEFORE {
        assert_eq!(receiver.next(What::Chat).await.text, format!("flow {n}"));
    }
    let picked = pick(&cluster, &fleet).await;
    cluster.kill(picked.expect("a server to kill"));
    for n in BEFORE..TOTAL {
        assert_eq!(receiver.next(What::Chat).await.text, format!("flow {n}"));
    }
    drop(sending.await.expect("the sender"));
    fleet.shutdown().await;
}

/// What a bridge makes in JetStream has the `replicas` its config asks for: the stream of
/// messages and every bucket (on the three-server cluster, three), so one server may go.
#[tokio::test]
async fn the_stream_and_buckets_have_the_replicas_asked_for() {
    use futures_util::TryStreamExt;
    let fleet = Fleet::start(1).await;
    let js = fleet.jetstream().await;
    let streams: Vec<_> = (js.streams().try_collect().await).expect("the streams");
    let ours: Vec<_> = (streams.iter())
        .filter(|s| {
            s.config
                .name
                .to_ascii_lowercase()
                .contains(&fleet.prefix.to_ascii_lowercase())
        })
        .map(|s| (s.config.name.clone(), s.config.num_replicas))
        .collect();
    let names: Vec<&str> = ours.iter().map(|(name, _)| name.as_str()).collect();
    for made in [
        "_MESSAGES",
        "_bridges",
        "_agents",
        "_names",
        "_records",
        "_floors",
    ] {
        assert!(
            names.iter().any(|name| name.ends_with(made)),
            "{made} among {names:?}"
        );
    }
    for (name, replicas) in &ours {
        assert_eq!(*replicas, 3, "{name}");
    }
    fleet.shutdown().await;
}
