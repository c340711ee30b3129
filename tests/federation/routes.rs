//! Messages cross bridges as they cross protocols in one bridge: broadcasts and observers,
//! once under their id, in the order sent.

use std::time::{Duration, Instant};

use crate::common::fleet::{Fleet, QUICK, start_member};
use crate::common::nats::Cluster;
use crate::common::peers::{Proto, What};
use crate::common::skynet::{SkynetHttp, SkynetWs, text_of};
use crate::common::tracker::TrackerWs;
use crate::common::{self, WAIT, eventually};
use crate::support::{
    chats_in_order, holds_text, listed, on_one_server, readiness_is, skynet_on_b0_to_tracker_on_b1,
    spawn_bridge,
};

/// Broadcasts and observers are the fleet's: a Grid broadcast and a Skynet `@all` from b1
/// reach a Grid program on b0, and a Skynet human and a Tracker member listening to all on
/// b0 see them, and a message between two agents on b1, once each.
#[tokio::test]
async fn broadcasts_and_observers_cross_bridges() {
    use common::grid::GridWs;
    use common::skynet::text_of;

    /// The next Skynet message whose text is not presence.
    async fn next_text(ws: &mut SkynetWs) -> String {
        loop {
            let frame = ws.next_message().await;
            if !frame["type"]
                .as_str()
                .unwrap_or_default()
                .starts_with("agent.")
            {
                return text_of(&frame).to_owned();
            }
        }
    }

    let fleet = Fleet::start(2).await;
    let sk0 = SkynetHttp::new(fleet.nets[0].skynet);
    let (mut boss, _) = SkynetWs::join(fleet.nets[0].skynet, &sk0.human("boss").await).await;
    let (mut listener, _) = TrackerWs::auth_subscribed(fleet.nets[0].tracker, "tb-listener").await;
    let (mut mc, _) = GridWs::connect(fleet.nets[0].grid, "mc", None).await;
    let (mut scout, _) = GridWs::connect(fleet.nets[1].grid, "scout", None).await;
    let sk1 = SkynetHttp::new(fleet.nets[1].skynet);
    let (mut alice, _) = SkynetWs::join(fleet.nets[1].skynet, &sk1.agent("alice").await).await;
    for name in ["scout", "alice"] {
        fleet.wait_known(0, name).await;
    }
    fleet.wait_known(1, "mc").await;
    fleet.wait_known(1, "boss").await;

    scout.send("message: { id: msg-b, type: notification, sender: { agent: scout }, receiver: { agent: broadcast }, content: { action: discovery, payload: { text: Found the auth bug } } }").await;
    assert_eq!(mc.next_message().await["id"], "msg-b");
    assert_eq!(next_text(&mut boss).await, "Found the auth bug");
    assert_eq!(listener.next_content().await, "Found the auth bug");

    alice.chat("@all standup in 5").await;
    let got = mc.next_message().await;
    assert_eq!(
        (
            got["receiver"]["agent"].as_str(),
            got["content"]["payload"]["text"].as_str()
        ),
        (Some("broadcast"), Some("@all standup in 5"))
    );
    assert_eq!(next_text(&mut boss).await, "@all standup in 5");
    assert_eq!(listener.next_content().await, "@all standup in 5");

    // Between two agents of b1, observed on b0.
    scout.send("message: { id: msg-n, type: notification, sender: { agent: scout }, receiver: { agent: alice }, content: { action: discovery, payload: { text: just for alice } } }").await;
    assert_eq!(next_text(&mut boss).await, "just for alice");
    assert_eq!(listener.next_content().await, "just for alice");
    // Once each: nothing else follows.
    let more = tokio::time::timeout(Duration::from_millis(500), listener.next_content()).await;
    assert!(more.is_err(), "the listener got a copy twice: {more:?}");
    let more = tokio::time::timeout(Duration::from_millis(500), next_text(&mut boss)).await;
    assert!(more.is_err(), "the human got a copy twice: {more:?}");
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_broadcast_from_each_of_three_bridges_reaches_every_recipient_once() {
    let fleet = Fleet::start(3).await;
    let mut agents = Vec::new();
    for (i, net) in fleet.nets.iter().enumerate() {
        agents.push(net.named_peer(Proto::Grid, &format!("prog{i}")).await);
    }
    for i in 0..3 {
        for j in 0..3 {
            if i != j {
                fleet.wait_known(i, &format!("prog{j}")).await;
            }
        }
    }
    for (i, agent) in agents.iter_mut().enumerate() {
        agent
            .chat("broadcast", &format!("hello from {i}"), None)
            .await;
    }
    for (i, agent) in agents.iter_mut().enumerate() {
        let mut seen = Vec::new();
        for _ in 0..2 {
            seen.push(agent.next(What::Chat).await.text);
        }
        seen.sort();
        let expected: Vec<String> = (0..3)
            .filter(|&j| j != i)
            .map(|j| format!("hello from {j}"))
            .collect();
        assert_eq!(seen, expected, "prog{i}");
        // Nothing else follows: no copy came twice.
        let more = tokio::time::timeout(Duration::from_millis(500), agent.next(What::Chat)).await;
        assert!(more.is_err(), "prog{i} got a copy twice: {more:?}");
    }
    fleet.shutdown().await;
}

/// A message is published to the stream once, by the bridge that accepted it, under its
/// envelope's id (`Nats-Msg-Id`); the bridges that apply it never publish it again.
#[tokio::test]
async fn a_message_is_published_once_under_its_id_and_never_again() {
    use common::grid::GridWs;

    let fleet = Fleet::start(3).await;
    let (mut sender, _) = GridWs::connect(fleet.nets[0].grid, "herald", None).await;
    let (mut one, _) = GridWs::connect(fleet.nets[1].grid, "listener1", None).await;
    let (mut two, _) = GridWs::connect(fleet.nets[2].grid, "listener2", None).await;
    for (i, name) in ["herald", "listener1", "listener2"].into_iter().enumerate() {
        for other in (0..3).filter(|&j| j != i) {
            fleet.wait_known(other, name).await;
        }
    }
    let js = fleet.jetstream().await;
    let stream_name = fleet.stream_name();
    let mut stream = js.get_stream(&stream_name).await.expect("the stream");
    let before = stream.info().await.expect("its info").state.last_sequence;

    sender.send("message: { id: once-1, type: notification, sender: { agent: herald }, receiver: { agent: broadcast }, content: { action: discovery, payload: { text: heard once } } }").await;
    assert_eq!(one.next_message().await["id"], "once-1");
    assert_eq!(two.next_message().await["id"], "once-1");
    // Room for a bridge that wrongly published what it applied to have done so.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = stream.info().await.expect("its info").state.last_sequence;
    let mut published = Vec::new();
    for sequence in before + 1..=after {
        let message = stream.get_raw_message(sequence).await.expect("a message");
        if String::from_utf8_lossy(&message.payload).contains("heard once") {
            published.push(message);
        }
    }
    assert_eq!(published.len(), 1, "published once: {published:?}");
    let message = &published[0];
    let body: serde_json::Value = serde_json::from_slice(&message.payload).expect("JSON");
    let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
    let id = header("Nats-Msg-Id").unwrap_or_default();
    match &body {
        // Sent alone (as at rest): under its envelope's id.
        serde_json::Value::Object(_) => assert_eq!(
            Some(id.as_str()),
            body["envelope"]["id"].as_str(),
            "published under its envelope's id: {body}"
        ),
        // In a batch with what else was appended meanwhile (docs/federation.md).
        _ => assert!(id.starts_with("batch:"), "{id}: {body}"),
    }
    assert_eq!(header("Agentbridge-Bridge").as_deref(), Some("b0"));
    fleet.shutdown().await;
}

#[tokio::test]
async fn messages_from_one_sender_to_one_recipient_arrive_in_order() {
    let fleet = Fleet::start(2).await;
    let (mut sender, mut receiver) = skynet_on_b0_to_tracker_on_b1(&fleet).await;
    const COUNT: usize = 200;
    for n in 0..COUNT {
        sender
            .chat(&receiver.name, &format!("@coder {n}"), None)
            .await;
    }
    chats_in_order(&mut receiver, COUNT).await;
    fleet.shutdown().await;
}

/// A message a bridge refused (cut off from NATS, it could not reach the fleet) and its
/// client then sent again through another bridge reaches that first bridge's agents too:
/// the refusal left nothing there that takes the second copy for one seen already.
#[tokio::test]
async fn a_message_refused_by_a_bridge_cut_off_and_sent_again_through_another_reaches_it() {
    use common::grid::{GridHttp, GridWs, stamped};
    let mut cluster = Cluster::start(3).await;
    let urls = cluster.urls();
    let dir = tempfile::tempdir().unwrap();
    // b0 refuses soon; b1 rides out the stream's leader being elected again after.
    let on_server = |i: usize, publish_timeout_ms: u32| {
        on_one_server(&urls[i], i, "refused", 60_000, publish_timeout_ms)
    };
    let b0 = spawn_bridge(dir.path(), "b0", &on_server(0, 1_000)).await;
    let b1 = spawn_bridge(dir.path(), "b1", &on_server(1, 15_000)).await;
    let mut reader = GridWs::quiet(b0.addr("grid"), "reader", None).await;
    // An agent on b1, so that a broadcast from b0 must cross.
    let _far = GridWs::quiet(b1.addr("grid"), "far", None).await;
    eventually("b0 knows far", async || listed(&b0, "far").await.is_some()).await;
    let broadcast = "message: { id: twice, type: notification, sender: { agent: caller }, receiver: { agent: broadcast }, content: { action: note, payload: { text: twice } } }";

    cluster.kill(0);
    readiness_is(&b0, false).await;
    let (status, answer) = GridHttp::new(b0.addr("grid"))
        .post(&stamped(broadcast))
        .await;
    let refusal = &answer["message"]["content"]["payload"]["error_message"];
    assert!(
        status != 202 && refusal.as_str().is_some_and(|r| r.contains("unreachable")),
        "b0, cut off, refuses a broadcast: {status} {answer:?}"
    );
    cluster.restart(0).await;
    readiness_is(&b0, true).await;
    GridHttp::new(b1.addr("grid")).send(broadcast).await;

    reader.wait_up_to(Duration::from_secs(15));
    let got = reader.next_message().await;
    assert_eq!(got["id"], "twice", "{got}");
}

/// Messages from one sender to one recipient arrive in the order sent, once, across a
/// restart of the sender's bridge.
#[tokio::test]
async fn messages_keep_their_order_across_a_restart_of_the_senders_bridge() {
    let fleet = Fleet::start(1).await;
    let mut receiver = fleet.nets[0].peer(Proto::Tracker).await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data-b1");
    let data = data.to_str().unwrap();
    let start_b1 = async || {
        let b1 = start_member(&fleet.nats, &fleet.prefix, "b1", data, QUICK).await;
        eventually("b1 knows the receiver on b0", async || {
            (b1.bridge.core().directory.get("coder"))
                .is_some_and(|a| a.online && a.bridge.as_deref() == Some("b0"))
        })
        .await;
        b1
    };
    const EACH: usize = 50;
    let b1 = start_b1().await;
    let mut sender = b1.named_peer(Proto::Grid, "crier").await;
    for n in 0..EACH {
        sender.chat("coder", &format!("@coder {n}"), None).await;
    }
    // Grid does not acknowledge: stopped once b1 holds them all (accepted), not before.
    let last = format!("@coder {}", EACH - 1);
    eventually("b1 accepted the first messages", async || {
        holds_text(&b1.bridge, &last).await
    })
    .await;
    drop(sender);
    b1.bridge.shutdown().await;
    let b1 = start_b1().await;
    let mut sender = b1.named_peer(Proto::Grid, "crier").await;
    for n in EACH..2 * EACH {
        sender.chat("coder", &format!("@coder {n}"), None).await;
    }
    for n in 0..2 * EACH {
        assert_eq!(receiver.next(What::Chat).await.text, format!("@coder {n}"));
    }
    let more = tokio::time::timeout(Duration::from_millis(500), receiver.next(What::Chat)).await;
    assert!(more.is_err(), "a message came twice: {more:?}");
    b1.bridge.shutdown().await;
    fleet.shutdown().await;
}

/// A message that reaches the stream twice under two NATS ids — published, its answer
/// lost, then sent again by its client in a batch — is delivered once, also when so much
/// passed in between that the applying bridge no longer remembers it (the second carries
/// `resent`, and the applying bridge asks its store), and when both copies come in one
/// batch. Written here as a bridge `bx` would publish it.
#[tokio::test]
async fn a_message_resent_under_another_nats_id_is_delivered_once() {
    use agentbridge::core::{Envelope, Kind};
    let fleet = Fleet::start(1).await;
    let mut receiver = fleet.nets[0].peer(Proto::Skynet).await;
    let js = fleet.jetstream().await;
    let subject = format!("{}.msg.bx", fleet.prefix);
    let chat = |id: String, text: &str| {
        let mut env = Envelope::with_id(id, "skynet", "someone-on-bx", Kind::Chat);
        env.to = vec![receiver.name.clone()];
        env.text = Some(text.to_owned());
        serde_json::json!({ "envelope": env })
    };
    let publish = async |nats_id: String, payload: serde_json::Value| {
        let publish = async_nats::jetstream::message::PublishMessage::build()
            .payload(payload.to_string().into())
            .message_id(nats_id)
            .header("Agentbridge-Bridge", "bx");
        let ack = js.send_publish(subject.clone(), publish).await.unwrap();
        ack.await.unwrap();
    };
    publish("twice".into(), chat("twice".into(), "once only")).await;
    // More than the bridge remembers of recent messages (16,384), in batches.
    const BETWEEN: usize = 17_000;
    for start in (0..BETWEEN).step_by(250) {
        let batch: Vec<_> = (start..(start + 250).min(BETWEEN))
            .map(|i| chat(format!("between-{i}"), "between"))
            .collect();
        publish(format!("batch:{start}"), batch.into()).await;
    }
    let mut again = chat("twice".into(), "once only");
    again["resent"] = true.into();
    publish("batch:again".into(), vec![again].into()).await;
    // Both copies in one batch, as a bridge catching up reads them.
    let mut together = chat("together".into(), "together once");
    together["resent"] = true.into();
    let batch = vec![chat("together".into(), "together once"), together];
    publish("batch:together".into(), batch.into()).await;
    publish("last".into(), chat("last".into(), "last")).await;

    let mut seen = Vec::new();
    loop {
        let text = receiver.next(What::Chat).await.text;
        if text == "last" {
            break;
        }
        if text != "between" {
            seen.push(text);
        }
    }
    assert_eq!(seen, ["once only", "together once"]);
    fleet.shutdown().await;
}

/// A payload nested as deep as a JSON reader takes crosses bridges whole: the replica that
/// carries it, a few levels deeper, is read on the other side.
#[tokio::test]
async fn a_deeply_nested_payload_crosses_bridges() {
    let fleet = Fleet::start(2).await;
    let diver = SkynetHttp::new(fleet.nets[0].skynet).agent("diver").await;
    let (mut diver, _) = SkynetWs::join(fleet.nets[0].skynet, &diver).await;
    let card = SkynetHttp::new(fleet.nets[1].skynet).agent("watcher").await;
    let (mut watcher, _) = SkynetWs::join(fleet.nets[1].skynet, &card).await;
    fleet.wait_known(0, "watcher").await;
    fleet.wait_known(1, "diver").await;
    let frame = common::skynet::deep_share("deep-1", &[card["id"].clone()]);
    diver.send_text(frame).await;
    // Each read within WAIT: presence events first, perhaps.
    while !watcher.next_text().await.contains("deep-1") {}
    fleet.shutdown().await;
}

/// Between two Synapse agents on two bridges, a message keeps its id, its `reply_to` and
/// its `correlation_id` (the conversation), as within one bridge.
#[tokio::test]
async fn a_synapse_message_keeps_its_ids_across_bridges() {
    use crate::common::synapse::{self, Stream};
    let fleet = Fleet::start(2).await;
    let mut receiver = Stream::open(fleet.nets[1].synapse, "syn-b").await;
    fleet.wait_known(0, "syn-b").await;
    let mut clients = synapse::clients(fleet.nets[0].synapse).await;
    let mut message = synapse::chat("syn-a", "syn-b", "across");
    message.id = "syn-msg-1".into();
    message.reply_to = "syn-msg-0".into();
    message.correlation_id = "conversation-7".into();
    synapse::send(&mut clients, message)
        .await
        .expect("SendMessage");
    let got = receiver.next().await;
    assert_eq!(
        (
            got.id.as_str(),
            got.reply_to.as_str(),
            got.correlation_id.as_str()
        ),
        ("syn-msg-1", "syn-msg-0", "conversation-7"),
        "{got:?}"
    );
    assert_eq!(synapse::text_of(&got), "across");
    fleet.shutdown().await;
}

/// Skynet's `interrupt` asked of one bridge for an agent joined through another reaches the
/// agent there: it is connected, as the fleet sees it, not refused as away.
#[tokio::test]
async fn a_skynet_interrupt_reaches_an_agent_joined_through_another_bridge() {
    let fleet = Fleet::start(2).await;
    let (agent, mut scout) = scout_joined_on_b1(&fleet).await;
    let id = agent["id"].as_str().unwrap();
    let sk0 = SkynetHttp::new(fleet.nets[0].skynet);
    let path = format!("/api/agents/{id}/interrupt");
    let body = serde_json::json!({ "reason": "stop" });
    let (status, answer) = sk0.post(&path, body).await;
    assert_eq!(status, 200, "{answer}");
    let interrupt = scout.next_message().await;
    assert_eq!(
        (&interrupt["type"], &interrupt["payload"]["reason"]),
        (
            &serde_json::json!("agent.interrupt"),
            &serde_json::json!("stop")
        ),
        "{interrupt}"
    );
    fleet.shutdown().await;
}

/// Which agents a human watches is the fleet's: a watch asked of the agent's bridge has
/// the agent's execution logs sent to the human on another, and an unwatch stops them.
#[tokio::test]
async fn a_watch_asked_of_one_bridge_sends_the_logs_to_a_human_on_another() {
    use serde_json::json;
    let fleet = Fleet::start(2).await;
    let (sk0, sk1) = (
        SkynetHttp::new(fleet.nets[0].skynet),
        SkynetHttp::new(fleet.nets[1].skynet),
    );
    let boss = sk0.human("boss").await;
    let (mut boss_ws, _) = SkynetWs::join(fleet.nets[0].skynet, &boss).await;
    let (scout, mut scout_ws) = scout_joined_on_b1(&fleet).await;
    let boss_on_b1 = format!("/api/humans/{}", boss["id"].as_str().unwrap());
    eventually("b1 has applied boss's registration", async || {
        sk1.get(&boss_on_b1).await.0 == 200
    })
    .await;
    let watch = |on: &str| format!("/api/agents/{}/{on}", scout["id"].as_str().unwrap());
    let human = json!({ "humanId": boss["id"] });
    let (status, answer) = sk1.post(&watch("watch"), human.clone()).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(scout_ws.next_message().await["type"], "agent.watch");

    // Logs, each followed by a chat every human sees, until a log comes before its chat:
    // b0 follows the watch record as it comes.
    let deadline = Instant::now() + WAIT;
    for n in 0.. {
        let log = json!({ "event": "thinking", "summary": format!("log {n}"), "level": "info" });
        scout_ws
            .chat_with(json!({ "type": "execution.log", "payload": log }))
            .await;
        scout_ws.chat(&format!("after log {n}")).await;
        let mut logged = false;
        loop {
            let seen = boss_ws.next_message().await;
            logged |= seen["type"] == "execution.log";
            if text_of(&seen) == format!("after log {n}") {
                break;
            }
        }
        if logged {
            break;
        }
        assert!(Instant::now() < deadline, "no log reached the human on b0");
    }

    // Unwatched through b0: no log reaches the human any more.
    let (status, _) = sk0.post(&watch("unwatch"), human).await;
    assert_eq!(status, 200);
    assert_eq!(scout_ws.next_message().await["type"], "agent.unwatch");
    eventually("b1 lets the watch go", async || {
        let log = json!({ "event": "thinking", "summary": "unwatched", "level": "info" });
        scout_ws
            .chat_with(json!({ "type": "execution.log", "payload": log }))
            .await;
        scout_ws.chat("after unwatched").await;
        loop {
            let seen = boss_ws.next_message().await;
            if seen["type"] == "execution.log" {
                return false;
            }
            if text_of(&seen) == "after unwatched" {
                return true;
            }
        }
    })
    .await;
    fleet.shutdown().await;
}

/// A Skynet agent, `scout`, registered and joined through b1, once b0 knows it online and
/// has applied its registration: its card, and its socket.
async fn scout_joined_on_b1(fleet: &Fleet) -> (serde_json::Value, SkynetWs) {
    let card = SkynetHttp::new(fleet.nets[1].skynet).agent("scout").await;
    let (socket, _) = SkynetWs::join(fleet.nets[1].skynet, &card).await;
    fleet.wait_known(0, "scout").await;
    let on_b0 = SkynetHttp::new(fleet.nets[0].skynet);
    let path = format!("/api/agents/{}", card["id"].as_str().unwrap());
    eventually("b0 has applied scout's registration", async || {
        on_b0.get(&path).await.0 == 200
    })
    .await;
    (card, socket)
}
