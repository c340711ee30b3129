//! The Grid endpoint over real sockets and a real scratchpad file: YAML over HTTP and the
//! WebSocket, polling, every validation error, priority, ttl expiry, and the scratchpad in
//! a temporary directory (routed, appended, malformed, restarted, truncated, moved).

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentbridge::Bridge;
use common::grid::{GridHttp, GridWs};
use common::{start_bridge, start_bridge_in};
use serde_json::{Value, json};

struct World {
    bridge: Bridge,
    addr: SocketAddr,
    http: GridHttp,
}

async fn world() -> World {
    world_from(start_bridge("").await)
}

fn world_from(bridge: Bridge) -> World {
    let addr = bridge.addr("grid").unwrap();
    World {
        http: GridHttp::new(addr),
        addr,
        bridge,
    }
}

fn grid_section(pad: &Path) -> String {
    format!(
        "[grid]\nlisten = \"127.0.0.1:0\"\nexpiry_check_ms = 50\nscratchpad_poll_ms = 20\nscratchpad = {:?}\n",
        pad.display().to_string()
    )
}

fn request(id: &str, from: &str, to: &str, action: &str) -> String {
    format!(
        "message:\n  id: \"{id}\"\n  timestamp: \"2026-01-24T10:00:00Z\"\n  type: \"request\"\n  sender:\n    agent: \"{from}\"\n  receiver:\n    agent: \"{to}\"\n  content:\n    action: \"{action}\"\n    payload:\n      text: \"{id}\"\n"
    )
}

/// Registers programs by polling as them.
async fn programs(w: &World, names: &[&str]) {
    for name in names {
        w.http.poll(&format!("agent={name}")).await;
    }
}

#[tokio::test]
async fn the_documents_request_is_accepted_and_polled() {
    let w = world().await;
    programs(&w, &["mc"]).await;
    // The protocol document's own example, stamped with the timestamp the document asks
    // every sender to include.
    let example = "message:\n  id: \"msg-abc123\"\n  type: \"request\"\n  sender:\n    agent: \"executor\"\n    instance_id: \"exec-001\"\n  receiver:\n    agent: \"mc\"\n  content:\n    action: \"request_context\"\n    payload:\n      context_type: \"warmth\"\n      since: \"2026-01-24T10:00:00Z\"\n";
    assert_eq!(w.http.send(example).await, ["msg-abc123"]);
    let got = w.http.poll("agent=mc").await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["id"], "msg-abc123");
    assert_eq!(got[0]["sender"]["instance_id"], "exec-001");
    assert_eq!(got[0]["content"]["payload"]["context_type"], "warmth");
    assert!(got[0]["timestamp"].is_string());
    assert!(
        w.http.poll("agent=mc").await.is_empty(),
        "fetched messages are gone"
    );

    // A YAML stream of several, ids generated in the documented form, and JSON.
    let ids = w
        .http
        .send("message: { type: notification, sender: { agent: executor }, receiver: { agent: mc }, content: { action: progress_update, payload: { percent: 10 } } }\n---\nmessage: { type: notification, sender: { agent: executor }, receiver: { agent: mc }, content: { action: progress_update, payload: { percent: 20 } } }\n")
        .await;
    assert_eq!(ids.len(), 2);
    assert!(
        ids.iter()
            .all(|id| id.starts_with("msg-") && uuid::Uuid::parse_str(&id[4..]).is_ok()),
        "{ids:?}"
    );
    let (status, answer) = w
        .http
        .post_json(json!({ "message": { "type": "notification", "timestamp": "2026-01-24T10:00:00Z", "sender": { "agent": "executor" }, "receiver": { "agent": "mc" }, "content": { "action": "task_started" } } }))
        .await;
    assert_eq!(status, 202);
    assert_eq!(answer["accepted"].as_array().unwrap().len(), 1);
    let got = w.http.poll("agent=mc").await;
    let actions: Vec<&str> = got
        .iter()
        .map(|m| m["content"]["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions,
        ["progress_update", "progress_update", "task_started"]
    );
    // `since` leaves out what is older.
    w.http.send(&request("old", "executor", "mc", "note")).await;
    w.http.send("message: { id: new, timestamp: \"2026-06-01T00:00:00Z\", type: request, sender: { agent: executor }, receiver: { agent: mc } }").await;
    let got = w.http.poll("agent=mc&since=2026-03-01T00:00:00Z").await;
    assert_eq!(
        got.iter()
            .map(|m| m["id"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["new"]
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn every_validation_error_is_a_400_naming_the_field() {
    let w = world().await;
    programs(&w, &["mc"]).await;
    let decode_errors = common::decode_errors(&w.bridge, "grid").await;
    let mut refused = 0.0;
    for (body, field) in [
        (
            "message: { type: request, receiver: { agent: mc } }",
            "sender.agent",
        ),
        (
            "message: { sender: { agent: x }, receiver: { agent: mc } }",
            "type",
        ),
        (
            "message: { type: yell, sender: { agent: x }, receiver: { agent: mc } }",
            "type",
        ),
        (
            "message: { timestamp: \"2026-01-24T10:00:00Z\", type: response, sender: { agent: x }, receiver: { agent: mc } }",
            "correlation_id",
        ),
        (
            "message: { timestamp: \"2026-01-24T10:00:00Z\", type: error, sender: { agent: x }, receiver: { agent: mc } }",
            "correlation_id",
        ),
        (
            "message: { type: request, timestamp: soon, sender: { agent: x }, receiver: { agent: mc } }",
            "timestamp",
        ),
        (
            "message: { type: request, sender: { agent: x }, receiver: { agent: mc } }",
            "timestamp",
        ),
        (
            "message: { timestamp: \"2026-01-24T10:00:00Z\", type: request, sender: { agent: x }, receiver: { agent: mc }, metadata: { priority: asap } }",
            "metadata.priority",
        ),
        (
            "message: { timestamp: \"2026-01-24T10:00:00Z\", type: request, sender: { agent: x }, receiver: { agent: mc }, metadata: { ttl: soon } }",
            "metadata.ttl",
        ),
        (
            "message: { timestamp: \"2026-01-24T10:00:00Z\", type: request, sender: { agent: x }, receiver: [mc] }",
            "receiver",
        ),
        (
            "message: { timestamp: \"2026-01-24T10:00:00Z\", type: request, sender: 7, receiver: { agent: mc } }",
            "sender",
        ),
        (
            "message: { timestamp: \"2026-01-24T10:00:00Z\", type: request, sender: { agent: x }, receiver: { agent: mc }, content: abort }",
            "content",
        ),
        (
            "message: { timestamp: \"2026-01-24T10:00:00Z\", type: request, sender: { agent: x }, receiver: { agent: mc }, metadata: high }",
            "metadata",
        ),
        ("not: a message", "message"),
        ("message: [unclosed", "body"),
    ] {
        let (status, answer) = w.http.post(body).await;
        assert_eq!(status, 400, "{body}: {answer}");
        refused += 1.0;
        let error = &answer["message"];
        assert_eq!(error["type"], "error", "{answer}");
        assert_eq!(error["content"]["action"], "error_report");
        assert_eq!(
            error["content"]["payload"]["error_code"],
            "VALIDATION_FAILED"
        );
        assert_eq!(
            error["content"]["payload"]["field"], field,
            "{body}: {answer}"
        );
        // "Every response MUST include correlation_id": a refused message without an id
        // is given one, and the error names it.
        if body.starts_with("message: {") {
            assert!(error["correlation_id"].is_string(), "{body}: {answer}");
        }
    }
    // Each is counted as malformed input, as a bad frame is.
    assert!(common::decode_errors(&w.bridge, "grid").await >= decode_errors + refused);
    let (status, answer) = w
        .http
        .post(&request("msg-x", "executor", "nobody", "hello"))
        .await;
    assert_eq!(status, 404);
    assert_eq!(
        answer["message"]["content"]["payload"]["error_code"],
        "UNKNOWN_RECEIVER"
    );
    assert_eq!(answer["message"]["correlation_id"], "msg-x");
    // A bad second document refuses the whole request: nothing was accepted.
    let (status, _) = w
        .http
        .post(&format!(
            "{}---\nmessage: {{ type: request }}\n",
            request("first", "executor", "mc", "a")
        ))
        .await;
    assert_eq!(status, 400);
    assert!(w.http.poll("agent=mc").await.is_empty());
    // `receiver: mc` is short for `receiver: { agent: mc }`, and relayed in full.
    let (status, answer) = w
        .http
        .post("message: { id: short, timestamp: \"2026-01-24T10:00:00Z\", type: request, sender: executor, receiver: mc }")
        .await;
    assert_eq!(status, 202, "{answer}");
    let got = w.http.poll("agent=mc").await;
    assert_eq!(
        (
            got[0]["id"].as_str(),
            got[0]["sender"]["agent"].as_str(),
            got[0]["receiver"]["agent"].as_str()
        ),
        (Some("short"), Some("executor"), Some("mc")),
        "{got:?}"
    );
    let (status, answer) = w.http.get("/messages").await;
    assert_eq!(
        (
            status,
            answer["message"]["content"]["payload"]["field"].as_str()
        ),
        (400, Some("agent"))
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn the_websocket_carries_yaml_both_ways() {
    let w = world().await;
    let (mut mc, welcome) = GridWs::connect(w.addr, "mc", None).await;
    assert!(
        welcome["content"]["payload"]["agents"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["agent"] == "mc")
    );
    let (mut exec1, _) = GridWs::connect(w.addr, "executor", Some("exec-001")).await;
    let (mut exec2, _) = GridWs::connect(w.addr, "executor", Some("exec-002")).await;

    exec1
        .send(&request("msg-1", "executor", "mc", "request_context"))
        .await;
    let got = mc.next_message().await;
    assert_eq!(
        (got["id"].as_str(), got["content"]["action"].as_str()),
        (Some("msg-1"), Some("request_context"))
    );

    // To one instance only.
    mc.send("message: { id: msg-2, type: response, correlation_id: msg-1, sender: { agent: mc }, receiver: { agent: executor, instance_id: exec-002 }, content: { action: context_provided, payload: { warmth: {} } } }").await;
    let got = exec2.next_message().await;
    assert_eq!(
        (got["id"].as_str(), got["correlation_id"].as_str()),
        (Some("msg-2"), Some("msg-1"))
    );
    // To the agent: every instance.
    mc.send("message: { id: msg-3, type: request, sender: { agent: mc }, receiver: { agent: executor }, content: { action: abort } }").await;
    assert_eq!(
        exec1.next_message().await["id"],
        "msg-3",
        "exec-001 never saw msg-2"
    );
    assert_eq!(exec2.next_message().await["id"], "msg-3");
    // Broadcast: every Grid program but the sender.
    exec1.send("message: { id: msg-4, type: notification, sender: { agent: executor, instance_id: exec-001 }, receiver: { agent: broadcast }, content: { action: discovery, payload: { topic: auth } } }").await;
    assert_eq!(mc.next_message().await["id"], "msg-4");

    // A bad frame gets an error message; the socket stays open.
    mc.send("message: { type: request, sender: { agent: mc }, receiver: { agent: ghost } }")
        .await;
    let error = mc.next_message().await;
    assert_eq!(
        (
            error["type"].as_str(),
            error["content"]["payload"]["error_code"].as_str()
        ),
        (Some("error"), Some("UNKNOWN_RECEIVER"))
    );
    mc.send("message: [unclosed").await;
    assert_eq!(
        mc.next_message().await["content"]["payload"]["field"],
        "body"
    );
    mc.send(&request("msg-5", "mc", "executor", "still-here"))
        .await;
    assert_eq!(exec1.next_message().await["id"], "msg-5");

    // Identified by the first message instead of the query.
    let mut scout = GridWs::anonymous(w.addr).await;
    scout.send(&request("msg-6", "scout", "mc", "found")).await;
    assert_eq!(mc.next_message().await["id"], "msg-6");
    mc.send(&request("msg-7", "mc", "scout", "thanks")).await;
    assert_eq!(scout.next_message().await["id"], "msg-7");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_burst_over_a_socket_arrives_in_order_once_even_after_the_sender_left() {
    let w = world().await;
    let (mut mc, _) = GridWs::connect(w.addr, "mc", None).await;
    let (mut scout, _) = GridWs::connect(w.addr, "scout", None).await;
    // Sent without waiting: most are still being stored when the next arrives, and each
    // is sent twice (a repeat of a message not yet stored is still a repeat).
    for i in 0..300 {
        let frame = request(&format!("burst-{i}"), "scout", "mc", "found");
        scout.send(&frame).await;
        scout.send(&frame).await;
    }
    scout.send(&request("last", "scout", "mc", "done")).await;
    drop(scout);
    for i in 0..300 {
        assert_eq!(mc.next_message().await["id"], format!("burst-{i}"));
    }
    assert_eq!(mc.next_message().await["id"], "last");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_queue_serves_high_before_normal_before_low() {
    let w = world().await;
    programs(&w, &["mc", "planner"]).await;
    for (id, priority) in [
        ("low-1", "low"),
        ("normal-1", "normal"),
        ("high-1", "high"),
        ("low-2", "low"),
        ("high-2", "high"),
    ] {
        w.http
            .send(&format!("message: {{ id: {id}, type: request, sender: {{ agent: planner }}, receiver: {{ agent: mc }}, metadata: {{ priority: {priority} }} }}"))
            .await;
    }
    let got: Vec<String> = w
        .http
        .poll("agent=mc")
        .await
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(got, ["high-1", "high-2", "normal-1", "low-1", "low-2"]);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn an_expired_message_is_dropped_and_its_sender_told() {
    let w = world().await;
    programs(&w, &["sleeper"]).await;
    let (mut planner, _) = GridWs::connect(w.addr, "planner", None).await;
    planner
        .send("message: { id: msg-ttl, type: request, sender: { agent: planner }, receiver: { agent: sleeper }, content: { action: mission_assigned }, metadata: { ttl: 1 } }")
        .await;
    let error = planner.next_message().await;
    assert_eq!(error["type"], "error");
    assert_eq!(error["correlation_id"], "msg-ttl");
    assert_eq!(error["content"]["payload"]["error_code"], "TTL_EXPIRED");
    assert!(
        w.http.poll("agent=sleeper").await.is_empty(),
        "the expired message is gone"
    );
    let (_, metrics) = common::admin_get(&w.bridge, "/metrics").await;
    assert!(
        metrics.contains(
            "agentbridge_messages_dropped_total{protocol=\"grid\",reason=\"ttl_expired\"}"
        ),
        "{metrics}"
    );
    w.bridge.shutdown().await;
}

/// Appends `text` to `path` as another program would.
fn write_entry(path: &Path, text: &str) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    file.write_all(text.as_bytes()).unwrap();
}

fn entry(from: &str, to: &str, body: &str) -> String {
    format!(
        "\n### [2026-01-24T16:30:00Z] request | {from} -> {to}\n\n```yaml\nmessage:\n{body}```\n"
    )
}

/// Waits until `path` contains `needle`.
async fn file_contains(path: &Path, needle: &str) -> String {
    for _ in 0..500 {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{} never contained {needle}", path.display());
}

#[tokio::test]
async fn the_scratchpad_is_read_and_appended() {
    let dir = tempfile::tempdir().unwrap();
    let pad: PathBuf = dir.path().join(".grid").join("SCRATCHPAD.md");
    let w = world_from(start_bridge(&grid_section(&pad)).await);
    let (mut mc, _) = GridWs::connect(w.addr, "mc", None).await;
    programs(&w, &["executor"]).await;

    // The file does not exist yet: it is picked up once created.
    std::fs::create_dir_all(pad.parent().unwrap()).unwrap();
    std::fs::write(&pad, "# Scratchpad\n\nNotes by hand.\n").unwrap();
    write_entry(
        &pad,
        &entry(
            "executor",
            "mc",
            "  action: \"discovery\"\n  payload:\n    finding: \"Middleware runs before validation\"\n",
        ),
    );
    let got = mc.next_message().await;
    assert_eq!(got["content"]["action"], "discovery");
    assert_eq!(got["sender"]["agent"], "executor");
    assert_eq!(
        got["content"]["payload"]["finding"],
        "Middleware runs before validation"
    );
    assert!(got["id"].as_str().unwrap().starts_with("msg-"));

    // A message for a program that is not connected is appended in the same form.
    mc.send("message: { id: msg-out, type: request, sender: { agent: mc }, receiver: { agent: executor }, content: { action: mission_assigned, payload: { block: block-02 } } }").await;
    let text = file_contains(&pad, "msg-out").await;
    assert!(
        text.starts_with("# Scratchpad\n\nNotes by hand.\n"),
        "what others wrote is untouched"
    );
    assert!(text.contains("] request | mc -> executor\n"), "{text}");
    // As the document's example writes an entry: action and payload right under `message:`.
    assert!(
        text.contains("\n  action: mission_assigned\n  payload:\n    block: block-02\n"),
        "{text}"
    );
    // …and queued for polling too; and never read back as a new message.
    assert_eq!(w.http.poll("agent=executor").await[0]["id"], "msg-out");

    // A malformed entry is skipped, and its sender told.
    write_entry(&pad, &entry("mc", "executor", "  action: [unclosed\n"));
    let error = mc.next_message().await;
    assert_eq!(
        (
            error["type"].as_str(),
            error["content"]["payload"]["error_code"].as_str()
        ),
        (Some("error"), Some("VALIDATION_FAILED"))
    );
    write_entry(
        &pad,
        &entry("executor", "mc", "  id: msg-after\n  action: \"next\"\n"),
    );
    assert_eq!(mc.next_message().await["id"], "msg-after");
    // …even a sender never seen before: the error waits in its queue. (Polling registers
    // a program, so the poll waits until the entry after it has been read.)
    write_entry(&pad, &entry("newcomer", "mc", "  action: [unclosed\n"));
    write_entry(
        &pad,
        &entry("executor", "mc", "  id: msg-later\n  action: \"next\"\n"),
    );
    assert_eq!(mc.next_message().await["id"], "msg-later");
    let told = poll_until_some(&w, "newcomer").await;
    assert_eq!(
        (
            told[0]["type"].as_str(),
            told[0]["content"]["payload"]["error_code"].as_str()
        ),
        (Some("error"), Some("VALIDATION_FAILED"))
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_message_kept_for_several_programs_is_appended_to_the_scratchpad_once() {
    let dir = tempfile::tempdir().unwrap();
    let pad = dir.path().join("SCRATCHPAD.md");
    let w = world_from(start_bridge(&grid_section(&pad)).await);
    programs(&w, &["executor", "reviewer"]).await;
    let skynet = w.bridge.addr("skynet").unwrap();
    let alice = common::skynet::SkynetHttp::new(skynet).agent("alice").await;
    let (mut ws_alice, _) = common::skynet::SkynetWs::join(skynet, &alice).await;
    ws_alice
        .chat_with(json!({ "type": "chat", "payload": { "text": "@executor @reviewer ship it" } }))
        .await;
    // Queued for each program; appended before the second is queued.
    for program in ["executor", "reviewer"] {
        let got = poll_until_some(&w, program).await;
        assert_eq!(
            got[0]["content"]["payload"]["text"],
            "@executor @reviewer ship it"
        );
    }
    let text = file_contains(&pad, "ship it").await;
    assert_eq!(text.matches("ship it").count(), 1, "{text}");
    w.bridge.shutdown().await;
}

/// A burst to a program that is not connected: the writer takes it in turns of many
/// messages (queued together, appended in one write), yet the program's queue and the
/// scratchpad hold each message once, in the order sent.
#[tokio::test]
async fn a_burst_to_a_program_away_is_queued_and_appended_in_order_once() {
    const BURST: usize = 400;
    let dir = tempfile::tempdir().unwrap();
    let pad = dir.path().join("SCRATCHPAD.md");
    let w = world_from(start_bridge(&grid_section(&pad)).await);
    programs(&w, &["mc"]).await;
    let (mut scout, _) = GridWs::connect(w.addr, "scout", None).await;
    for i in 0..BURST {
        (scout.send(&request(&format!("away-{i}"), "scout", "mc", "found"))).await;
    }
    scout
        .send(&request("away-last", "scout", "mc", "done"))
        .await;
    let mut got = Vec::new();
    while got.last().is_none_or(|id| id != "away-last") {
        got.extend(
            poll_until_some(&w, "mc")
                .await
                .iter()
                .map(|m| m["id"].as_str().unwrap_or_default().to_owned()),
        );
        assert!(got.len() <= BURST + 1, "more than was sent: {got:?}");
    }
    let sent: Vec<String> = (0..BURST).map(|i| format!("away-{i}")).collect();
    assert_eq!(got[..BURST], sent[..], "in the order sent, once");
    let text = file_contains(&pad, "away-last").await;
    let appended: Vec<usize> = (0..BURST)
        .map(|i| {
            let id = format!("id: away-{i}\n");
            assert_eq!(text.matches(&id).count(), 1, "away-{i} once in {text}");
            text.find(&id).unwrap()
        })
        .collect();
    assert!(appended.is_sorted(), "appended in the order sent");
    w.bridge.shutdown().await;
}

/// Direct messages and broadcasts from one sender to a program away, interleaved and sent
/// without waiting: the program's queue holds them in the order sent, though the writer
/// takes them from two places (what is kept for one program, and the hub's broadcasts).
#[tokio::test]
async fn direct_messages_and_broadcasts_to_a_program_away_are_queued_in_the_order_sent() {
    direct_and_broadcasts_in_order(world().await).await;
}

/// The same with the Grid's hub holding most broadcasts past its mailbox, as ids to read
/// back from the store, while the direct messages wait in memory.
#[tokio::test]
async fn direct_messages_and_broadcasts_past_the_hubs_mailbox_are_queued_in_the_order_sent() {
    let w = world_from(start_bridge("[routing]\nmailbox_capacity = 4\n").await);
    direct_and_broadcasts_in_order(w).await;
}

async fn direct_and_broadcasts_in_order(w: World) {
    const EACH: usize = 150;
    programs(&w, &["mc"]).await;
    let (mut scout, _) = GridWs::connect(w.addr, "scout", None).await;
    let mut sent = Vec::new();
    for i in 0..EACH {
        let direct = format!("direct-{i}");
        scout.send(&request(&direct, "scout", "mc", "found")).await;
        let broadcast = format!("all-{i}");
        scout
            .send(&format!("message: {{ id: {broadcast}, type: notification, sender: {{ agent: scout }}, receiver: {{ agent: broadcast }}, content: {{ action: note }} }}"))
            .await;
        sent.extend([direct, broadcast]);
    }
    let mut got: Vec<String> = Vec::new();
    while got.len() < sent.len() {
        let polled = poll_until_some(&w, "mc").await;
        got.extend(
            polled
                .iter()
                .map(|m| m["id"].as_str().unwrap_or_default().to_owned()),
        );
    }
    assert_eq!(got, sent);
    w.bridge.shutdown().await;
}

/// Polls `agent`'s queue until something arrives.
async fn poll_until_some(w: &World, agent: &str) -> Vec<Value> {
    for _ in 0..500 {
        let got = w.http.poll(&format!("agent={agent}")).await;
        if !got.is_empty() {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("nothing arrived for {agent}");
}

#[tokio::test]
async fn a_restart_reads_nothing_twice_and_skips_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let pad = dir.path().join("SCRATCHPAD.md");
    let data = dir.path().join("data");
    let data = data.to_str().unwrap();
    {
        let w = world_from(start_bridge_in(data, &grid_section(&pad)).await);
        let (mut mc, _) = GridWs::connect(w.addr, "mc", None).await;
        write_entry(&pad, &entry("executor", "mc", "  action: \"first\"\n"));
        assert_eq!(mc.next_message().await["content"]["action"], "first");
        w.bridge.shutdown().await;
    }
    // Written while the bridge was down: read at start, for mc (not connected) to poll.
    write_entry(&pad, &entry("executor", "mc", "  action: \"second\"\n"));
    let w = world_from(start_bridge_in(data, &grid_section(&pad)).await);
    let got = poll_until_some(&w, "mc").await;
    let actions: Vec<&str> = got
        .iter()
        .map(|m| m["content"]["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["second"]);
    w.http
        .send(&request("sentinel", "executor", "mc", "sentinel"))
        .await;
    let got = poll_until_some(&w, "mc").await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["id"], "sentinel", "'first' was not routed again");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_truncated_or_moved_scratchpad_is_read_from_its_start() {
    let dir = tempfile::tempdir().unwrap();
    let pad = dir.path().join("SCRATCHPAD.md");
    let w = world_from(start_bridge(&grid_section(&pad)).await);
    let (mut mc, _) = GridWs::connect(w.addr, "mc", None).await;
    write_entry(&pad, &entry("executor", "mc", "  action: \"one\"\n"));
    write_entry(&pad, &entry("executor", "mc", "  action: \"two\"\n"));
    assert_eq!(mc.next_message().await["content"]["action"], "one");
    assert_eq!(mc.next_message().await["content"]["action"], "two");

    // Someone truncates it and starts over: the new entry is routed, the old not again.
    std::fs::write(&pad, "").unwrap();
    write_entry(&pad, &entry("executor", "mc", "  action: \"three\"\n"));
    assert_eq!(mc.next_message().await["content"]["action"], "three");

    // Someone moves it away and writes a new one.
    std::fs::rename(&pad, dir.path().join("old.md")).unwrap();
    write_entry(&pad, &entry("executor", "mc", "  action: \"three\"\n"));
    write_entry(&pad, &entry("executor", "mc", "  action: \"four\"\n"));
    assert_eq!(
        mc.next_message().await["content"]["action"],
        "four",
        "an entry identical to one routed is not routed again"
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn who_is_there() {
    let w = world().await;
    let (_mc, _) = GridWs::connect(w.addr, "mc", None).await;
    let (status, roster) = w.http.get("/agents").await;
    assert_eq!(status, 200);
    let agents = roster["agents"].as_array().unwrap();
    let mc = agents.iter().find(|a| a["agent"] == "mc").unwrap();
    assert_eq!(
        (mc["protocol"].as_str(), mc["online"].as_bool()),
        (Some("grid"), Some(true))
    );
    let coder = agents.iter().find(|a| a["agent"] == "coder").unwrap();
    assert_eq!(
        (coder["protocol"].as_str(), coder["online"].as_bool()),
        (Some("tracker"), Some(false))
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_huge_ttl_is_a_long_life_not_a_crash() {
    let w = world().await;
    programs(&w, &["mc"]).await;
    let (status, answer) = w
        .http
        .post_json(json!({ "message": { "id": "msg-forever", "timestamp": "2026-01-24T10:00:00Z", "type": "request", "sender": { "agent": "planner" }, "receiver": { "agent": "mc" }, "metadata": { "ttl": u64::MAX } } }))
        .await;
    assert_eq!(status, 202, "{answer}");
    let got = w.http.poll("agent=mc").await;
    assert_eq!(got[0]["id"], "msg-forever");
    assert_eq!(got[0]["metadata"]["ttl"], u64::MAX);
    // The bridge still works.
    w.http
        .send(&request("after", "planner", "mc", "next"))
        .await;
    assert_eq!(w.http.poll("agent=mc").await[0]["id"], "after");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_socket_is_sent_presence_only_when_it_asks() {
    let w = world().await;
    let mut mc = GridWs::quiet(w.addr, "mc", None).await;
    let mut scout = GridWs::quiet(w.addr, "scout", None).await;
    scout.send(&request("msg-hi", "scout", "mc", "found")).await;
    assert_eq!(
        mc.next().await["id"],
        "msg-hi",
        "no welcome and no agent_online first"
    );
    // Asked for: the roster on arrival, and who comes and goes.
    let (mut watcher, welcome) = GridWs::connect(w.addr, "recognizer", None).await;
    assert!(
        welcome["content"]["payload"]["agents"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["agent"] == "scout" && a["online"] == true)
    );
    drop(scout);
    let left = watcher.next().await;
    assert_eq!(
        (
            left["content"]["action"].as_str(),
            left["content"]["payload"]["agent"].as_str()
        ),
        (Some("agent_offline"), Some("scout"))
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn timestamps_are_required_and_relayed_as_written() {
    let w = world().await;
    programs(&w, &["mc"]).await;
    let (status, answer) = w
        .http
        .post("message: { id: msg-when, type: request, sender: { agent: planner }, receiver: { agent: mc } }")
        .await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(
        answer["message"]["content"]["payload"]["field"],
        "timestamp"
    );

    // With an offset, kept as written; without one, taken as UTC.
    w.http
        .send("message: { id: msg-plus2, timestamp: \"2026-01-24T12:00:00+02:00\", type: request, sender: { agent: planner }, receiver: { agent: mc } }")
        .await;
    w.http
        .send("message: { id: msg-local, timestamp: \"2026-01-24T10:00:00\", type: request, sender: { agent: planner }, receiver: { agent: mc } }")
        .await;
    let got = w.http.poll("agent=mc&since=2026-01-24T09:59:59Z").await;
    let stamps: Vec<(&str, &str)> = got
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["timestamp"].as_str().unwrap()))
        .collect();
    assert_eq!(
        stamps,
        [
            ("msg-plus2", "2026-01-24T12:00:00+02:00"),
            ("msg-local", "2026-01-24T10:00:00")
        ]
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_program_the_document_names_is_reachable_before_it_is_seen() {
    let w = world().await;
    // Nobody has polled or connected as mc: it is one of the Grid's own programs.
    w.http
        .send(&request("msg-early", "executor", "mc", "request_context"))
        .await;
    assert_eq!(w.http.poll("agent=mc").await[0]["id"], "msg-early");
    let (status, answer) = w
        .http
        .post(&request("msg-lost", "executor", "nobody", "hello"))
        .await;
    assert_eq!(
        (
            status,
            answer["message"]["content"]["payload"]["error_code"].as_str()
        ),
        (404, Some("UNKNOWN_RECEIVER"))
    );
    w.bridge.shutdown().await;

    // The list is configurable.
    let w = world_from(
        start_bridge(
            "[grid]\nlisten = \"127.0.0.1:0\"\nexpiry_check_ms = 50\nprograms = [\"custodian\"]\n",
        )
        .await,
    );
    w.http
        .send(&request("msg-c", "executor", "custodian", "sweep"))
        .await;
    assert_eq!(w.http.poll("agent=custodian").await[0]["id"], "msg-c");
    let (status, _) = w
        .http
        .post(&request("msg-mc", "executor", "mc", "hello"))
        .await;
    assert_eq!(status, 404, "mc is not a program of this configuration");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_poll_sees_every_message_accepted_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let w = world_from(start_bridge_in(dir.path().to_str().unwrap(), "").await);
    let pollers: Vec<String> = (0..20).map(|i| format!("poller-{i}")).collect();
    for name in &pollers {
        w.http.poll(&format!("agent={name}")).await;
    }
    // Broadcasts and direct messages, accepted in one request…
    let mut body = String::new();
    for i in 0..30 {
        body.push_str(&format!("---\nmessage: {{ id: b-{i}, type: notification, sender: {{ agent: executor }}, receiver: {{ agent: broadcast }} }}\n"));
        body.push_str(&format!("---\nmessage: {{ id: d-{i}, type: request, sender: {{ agent: executor }}, receiver: {{ agent: poller-19 }} }}\n"));
    }
    assert_eq!(w.http.send(&body).await.len(), 60);
    // …are all there for a poll that follows at once.
    for name in &pollers {
        let got = w.http.poll(&format!("agent={name}")).await;
        let expected = if name == "poller-19" { 60 } else { 30 };
        assert_eq!(got.len(), expected, "{name}");
    }
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn polling_as_an_instance_takes_only_what_it_is_given() {
    let w = world().await;
    programs(&w, &["executor"]).await;
    for (id, instance) in [("for-1", "exec-001"), ("for-2", "exec-002")] {
        w.http
            .send(&format!("message: {{ id: {id}, type: request, sender: {{ agent: mc }}, receiver: {{ agent: executor, instance_id: {instance} }} }}"))
            .await;
    }
    w.http
        .send("message: { id: for-all, type: request, sender: { agent: mc }, receiver: { agent: executor } }")
        .await;
    let ids = |got: Vec<Value>| -> Vec<String> {
        got.iter()
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        ids(w.http.poll("agent=executor&instance_id=exec-001").await),
        ["for-1", "for-all"]
    );
    assert_eq!(
        ids(w.http.poll("agent=executor&instance_id=exec-002").await),
        ["for-2"],
        "exec-001's poll left exec-002's message"
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_message_for_an_instance_without_a_socket_is_queued() {
    let w = world().await;
    let mut exec1 = GridWs::quiet(w.addr, "executor", Some("exec-001")).await;
    w.http
        .send("message: { id: for-2, type: request, sender: { agent: mc }, receiver: { agent: executor, instance_id: exec-002 } }")
        .await;
    w.http
        .send("message: { id: for-all, type: request, sender: { agent: mc }, receiver: { agent: executor } }")
        .await;
    assert_eq!(
        exec1.next().await["id"],
        "for-all",
        "exec-001 is not given exec-002's message"
    );
    let got = w.http.poll("agent=executor&instance_id=exec-002").await;
    assert_eq!(
        got.iter()
            .map(|m| m["id"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["for-2"]
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_socket_is_given_what_was_queued_for_it_first() {
    let w = world().await;
    programs(&w, &["mc"]).await;
    for (id, priority) in [("q-1", "normal"), ("q-2", "low"), ("q-3", "high")] {
        w.http
            .send(&format!("message: {{ id: {id}, type: request, sender: {{ agent: planner }}, receiver: {{ agent: mc }}, metadata: {{ priority: {priority} }} }}"))
            .await;
    }
    let mut mc = GridWs::quiet(w.addr, "mc", None).await;
    for id in ["q-3", "q-1", "q-2"] {
        assert_eq!(mc.next().await["id"], id);
    }
    w.http.send(&request("live", "planner", "mc", "next")).await;
    assert_eq!(mc.next().await["id"], "live");
    assert!(
        w.http.poll("agent=mc").await.is_empty(),
        "what the socket was given left the queue"
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn what_a_closed_socket_had_not_sent_is_queued_again() {
    let w = world().await;
    // A reader with a small window that never reads: the bridge's writes back up.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let tcp = socket.connect(w.addr).await.unwrap();
    let (stream, _) =
        tokio_tungstenite::client_async(format!("ws://{}/grid/v1/ws?agent=mc", w.addr), tcp)
            .await
            .unwrap();
    let ids = post_big_requests(&w, "mc").await;
    // The program goes away without reading.
    drop(stream.into_inner());
    let got: Vec<String> = poll_until_some(&w, "mc")
        .await
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        ids.ends_with(&got),
        "the rest, in order: {:?}",
        got.iter().collect::<Vec<_>>()
    );
    w.bridge.shutdown().await;
}

/// Posts 24 requests of 512 KiB each to `to`, more than a socket that does not read takes
/// in, so some wait at the bridge; their ids, in the order sent.
async fn post_big_requests(w: &World, to: &str) -> Vec<String> {
    let big = "x".repeat(512 * 1024);
    let ids: Vec<String> = (0..24).map(|i| format!("big-{i}")).collect();
    for id in &ids {
        let (status, _) = w
            .http
            .post_json(json!({ "message": { "id": id, "timestamp": "2026-01-24T10:00:00Z", "type": "request", "sender": { "agent": "planner" }, "receiver": { "agent": to }, "content": { "payload": { "text": big } } } }))
            .await;
        assert_eq!(status, 202);
    }
    ids
}

/// A socket that goes away with messages unsent has them queued again even while its
/// program has another socket open, when that one opened after they were routed: it was
/// not sent them, and takes them from the queue.
#[tokio::test]
async fn what_a_socket_had_not_sent_reaches_a_newer_socket_of_its_program() {
    let w = world().await;
    let older = GridWs::quiet_narrow(w.addr, "mc").await;
    let directory = &w.bridge.core().directory;
    for _ in 0..500 {
        if directory.get("mc").is_some_and(|a| a.online) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ids = post_big_requests(&w, "mc").await;
    let mut newer = GridWs::quiet(w.addr, "mc", None).await;
    // The older socket goes away without reading.
    drop(older);
    let mut got = Vec::new();
    while got.last() != ids.last() {
        got.push(
            newer.next_message().await["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    assert!(ids.ends_with(&got), "the rest, in order: {got:?}");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn an_expired_broadcast_is_one_notice() {
    let w = world().await;
    programs(&w, &["sleeper-1", "sleeper-2", "sleeper-3"]).await;
    let mut planner = GridWs::quiet(w.addr, "planner", None).await;
    planner
        .send("message: { id: msg-all, type: notification, sender: { agent: planner }, receiver: { agent: broadcast }, content: { action: discovery }, metadata: { ttl: 1 } }")
        .await;
    let notice = planner.next().await;
    assert_eq!(
        (
            notice["correlation_id"].as_str(),
            notice["content"]["payload"]["error_code"].as_str()
        ),
        (Some("msg-all"), Some("TTL_EXPIRED"))
    );
    // The next thing the planner hears is its own sentinel, not a second notice.
    w.http
        .send(&request("sentinel", "executor", "planner", "sentinel"))
        .await;
    assert_eq!(planner.next().await["id"], "sentinel");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn an_unclosed_fence_spoils_only_its_own_entry() {
    let dir = tempfile::tempdir().unwrap();
    let pad = dir.path().join("SCRATCHPAD.md");
    let w = world_from(start_bridge(&grid_section(&pad)).await);
    let mut mc = GridWs::quiet(w.addr, "mc", None).await;
    let broken = "\n### [2026-01-24T16:30:00Z] request | mc -> executor\n\n```yaml\nmessage:\n  action: \"never closed\"\n";
    write_entry(
        &pad,
        &format!(
            "{broken}{}",
            entry("executor", "mc", "  id: msg-next\n  action: \"next\"\n")
        ),
    );
    let error = mc.next().await;
    assert_eq!(
        (
            error["type"].as_str(),
            error["content"]["payload"]["error_code"].as_str()
        ),
        (Some("error"), Some("VALIDATION_FAILED")),
        "{error}"
    );
    assert_eq!(mc.next().await["id"], "msg-next");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn entries_written_again_after_a_rewrite_are_routed_again() {
    let dir = tempfile::tempdir().unwrap();
    let pad = dir.path().join("SCRATCHPAD.md");
    let w = world_from(start_bridge(&grid_section(&pad)).await);
    let mut mc = GridWs::quiet(w.addr, "mc", None).await;
    let one = entry("executor", "mc", "  action: \"one\"\n");
    std::fs::write(&pad, format!("# Scratchpad, first session\n{one}")).unwrap();
    assert_eq!(mc.next().await["content"]["action"], "one");

    // Replaced in place, at once, by a file that begins differently and is longer.
    let two = entry("executor", "mc", "  action: \"two\"\n");
    std::fs::write(&pad, format!("# Second\n{one}{two}")).unwrap();
    assert_eq!(
        mc.next().await["content"]["action"],
        "one",
        "the same words written again are a new message"
    );
    assert_eq!(mc.next().await["content"]["action"], "two");

    // Emptied, then the same entry once more.
    std::fs::write(&pad, "").unwrap();
    write_entry(&pad, &one);
    assert_eq!(mc.next().await["content"]["action"], "one");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn structured_data_from_another_protocol_reaches_the_grid_payload() {
    let w = world().await;
    let skynet = w.bridge.addr("skynet").unwrap();
    let sk = common::skynet::SkynetHttp::new(skynet);
    let mut executor = GridWs::quiet(w.addr, "executor", None).await;
    let alice = sk.agent("alice").await;
    let (mut ws_alice, state) = common::skynet::SkynetWs::join(skynet, &alice).await;
    let card = state["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "executor")
        .unwrap()
        .clone();
    ws_alice
        .chat_with(json!({ "id": "sk-data", "type": "task.assign", "mentions": [card["id"]], "payload": { "taskId": "t-7", "title": "lint", "description": "Lint the repo", "assignee": card["id"], "status": "assigned", "metadata": { "repo": "agentbridge", "task_id": "not-this" } } }))
        .await;
    let mission = executor.next().await;
    let payload = &mission["content"]["payload"];
    assert_eq!(payload["repo"], "agentbridge", "{mission}");
    assert_eq!(payload["task_id"], "t-7", "what the bridge sets stays");
    w.bridge.shutdown().await;
}

/// A scratchpad that starts with a byte-order mark and holds a byte that is not UTF-8 is
/// still read: the first entry is not hidden by the mark, the bad byte is read as `?`, and
/// the entries after it reach their programs.
#[tokio::test]
async fn a_scratchpad_with_a_byte_order_mark_and_a_byte_not_utf8_is_read_on() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let pad: PathBuf = dir.path().join("SCRATCHPAD.md");
    let first = entry(
        "executor",
        "mc",
        "  action: \"discovery\"\n  payload:\n    n: \"first\"\n",
    );
    let mut bytes = "\u{feff}".as_bytes().to_vec();
    bytes.extend_from_slice(first.trim_start().as_bytes());
    std::fs::write(&pad, bytes).unwrap();
    let w = world_from(start_bridge(&grid_section(&pad)).await);
    let (mut mc, _) = GridWs::connect(w.addr, "mc", None).await;
    programs(&w, &["executor"]).await;
    assert_eq!(mc.next_message().await["content"]["payload"]["n"], "first");
    let mut file = std::fs::OpenOptions::new().append(true).open(&pad).unwrap();
    let bad = entry(
        "executor",
        "mc",
        "  action: \"discovery\"\n  payload:\n    n: \"cafX\"\n",
    );
    let bad: Vec<u8> = bad
        .bytes()
        .map(|b| if b == b'X' { 0xe9 } else { b })
        .collect();
    file.write_all(&bad).unwrap();
    drop(file);
    write_entry(
        &pad,
        &entry(
            "executor",
            "mc",
            "  action: \"discovery\"\n  payload:\n    n: \"after\"\n",
        ),
    );
    // The entry with the bad byte, then the one after; each read within WAIT.
    let mut seen = Vec::new();
    while seen.last() != Some(&serde_json::json!("after")) {
        assert!(seen.len() < 4, "not read on: {seen:?}");
        seen.push(mc.next_message().await["content"]["payload"]["n"].clone());
    }
    assert_eq!(seen, ["caf?", "after"], "each once");
    // Read on from where it was, not again from the start.
    let last = entry(
        "executor",
        "mc",
        "  action: \"discovery\"\n  payload:\n    n: \"last\"\n",
    );
    write_entry(&pad, &last);
    assert_eq!(mc.next_message().await["content"]["payload"]["n"], "last");
    w.bridge.shutdown().await;
}
