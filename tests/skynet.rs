//! The Skynet endpoint over real sockets, checked against skynet-protocol.md and
//! skynet-workspace-rules.md.
//!
//! "X does not receive M" is checked without sleeping: after M, the same sender sends a
//! sentinel that X does receive; messages from one sender reach a recipient in order, so
//! X's next message must be the sentinel.

mod common;

use std::net::SocketAddr;

use agentbridge::Bridge;
use common::skynet::{SkynetHttp, SkynetWs, text_of};
use common::{start_bridge, start_bridge_in};
use serde_json::{Value, json};

struct World {
    bridge: Bridge,
    addr: SocketAddr,
    http: SkynetHttp,
}

async fn world() -> World {
    world_with("").await
}

async fn world_with(skynet_section: &str) -> World {
    let extra = if skynet_section.is_empty() {
        String::new()
    } else {
        format!("[skynet]\nlisten = \"127.0.0.1:0\"\n{skynet_section}\n")
    };
    let bridge = start_bridge(&extra).await;
    let addr = bridge.addr("skynet").unwrap();
    World {
        http: SkynetHttp::new(addr),
        addr,
        bridge,
    }
}

fn id(card: &Value) -> &str {
    card["id"].as_str().unwrap()
}

/// Asserts `ws`'s next message is the chat `text` (the sentinel after a negative check).
async fn next_is(ws: &mut SkynetWs, text: &str) {
    let msg = ws.next_message().await;
    assert_eq!(text_of(&msg), text, "expected '{text}', got {msg}");
}

#[tokio::test]
async fn health_and_registration_statuses() {
    let w = world().await;
    assert_eq!(
        w.http.get("/health").await,
        (200, json!({ "status": "ok", "memberCount": 0 }))
    );

    let (status, card) = w
        .http
        .post(
            "/api/agents",
            json!({ "name": "alpha", "type": "claude-code", "role": "backend", "persona": "# Alex" }),
        )
        .await;
    assert_eq!(status, 201);
    assert!(uuid::Uuid::parse_str(id(&card)).is_ok(), "{card}");
    assert_eq!(card["name"], "alpha");
    assert_eq!(card["type"], "claude-code");
    assert_eq!(card["role"], "backend");
    assert_eq!(card["persona"], "# Alex");
    assert_eq!(card["status"], "offline");
    assert!(card["createdAt"].is_i64());

    let decode_errors = common::decode_errors(&w.bridge, "skynet").await;
    for body in [
        json!({ "type": "generic" }),
        json!({ "name": "", "type": "generic" }),
    ] {
        let (status, err) = w.http.post("/api/agents", body).await;
        assert_eq!(status, 400);
        assert_eq!(err["error"], "name is required");
    }
    // Counted as malformed input, as a bad frame is.
    assert!(common::decode_errors(&w.bridge, "skynet").await >= decode_errors + 2.0);
    let (status, err) = w.http.post("/api/agents", json!({ "name": "beta" })).await;
    assert_eq!(
        (status, err["error"].as_str()),
        (400, Some("type is required"))
    );
    let (status, err) = w.http.post_raw("/api/agents", "{not json").await;
    assert_eq!(status, 400);
    assert!(err["error"].is_string());
    let (status, err) = w
        .http
        .post("/api/agents", json!({ "name": "alpha", "type": "generic" }))
        .await;
    assert_eq!(status, 409);
    assert_eq!(err["error"], "Name 'alpha' is already taken");

    let (status, human) = w.http.post("/api/humans", json!({ "name": "alice" })).await;
    assert_eq!(status, 201);
    assert_eq!(human.as_object().unwrap().len(), 3, "{human}");
    assert_eq!(human["name"], "alice");
    assert!(human["createdAt"].is_i64());
    assert_eq!(w.http.post("/api/humans", json!({})).await.0, 400);
    // Names are unique across agents and humans.
    assert_eq!(
        w.http
            .post("/api/humans", json!({ "name": "alpha" }))
            .await
            .0,
        409
    );
    assert_eq!(
        w.http
            .post("/api/agents", json!({ "name": "alice", "type": "generic" }))
            .await
            .0,
        409
    );

    let (status, list) = w.http.get("/api/agents").await;
    assert_eq!(status, 200);
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(
        w.http.get(&format!("/api/agents/{}", id(&card))).await.1["name"],
        "alpha"
    );
    assert_eq!(w.http.get("/api/agents/alpha").await.1["id"], card["id"]);
    let (status, err) = w.http.get("/api/agents/nobody").await;
    assert_eq!(
        (status, err["error"].as_str()),
        (404, Some("Agent not found"))
    );
    // A human is not an agent.
    assert_eq!(w.http.get("/api/agents/alice").await.0, 404);
    assert_eq!(
        w.http.get("/api/humans").await.1.as_array().unwrap().len(),
        1
    );
    assert_eq!(w.http.get("/api/humans/alice").await.1["id"], human["id"]);
    assert_eq!(
        w.http.get(&format!("/api/humans/{}", id(&human))).await.0,
        200
    );
    assert_eq!(w.http.get("/api/humans/nobody").await.0, 404);

    assert_eq!(
        w.http.get("/api/names/check?name=alpha").await,
        (200, json!({ "available": false }))
    );
    assert_eq!(
        w.http.get("/api/names/check?name=gamma").await,
        (200, json!({ "available": true }))
    );
    assert_eq!(w.http.get("/api/names/check").await.0, 400);

    // Deleting goes by UUID only.
    assert_eq!(w.http.delete("/api/agents/alpha").await.0, 404);
    let (status, deleted) = w.http.delete(&format!("/api/agents/{}", id(&card))).await;
    assert_eq!(status, 200);
    assert_eq!(deleted["deleted"]["name"], "alpha");
    assert_eq!(w.http.get("/api/agents/alpha").await.0, 404);
    assert_eq!(
        w.http.get("/api/names/check?name=alpha").await.1["available"],
        true
    );
    assert_eq!(
        w.http.delete(&format!("/api/agents/{}", id(&card))).await.0,
        404
    );
    assert_eq!(w.http.delete("/api/humans/alice").await.0, 404);
    assert_eq!(
        w.http
            .delete(&format!("/api/humans/{}", id(&human)))
            .await
            .0,
        200
    );

    // Not while joined.
    let a = w.http.agent("connected").await;
    let h = w.http.human("watcher").await;
    let (_ws_a, _) = SkynetWs::join(w.addr, &a).await;
    let (_ws_h, _) = SkynetWs::join(w.addr, &h).await;
    assert_eq!(
        w.http.delete(&format!("/api/agents/{}", id(&a))).await.0,
        409
    );
    assert_eq!(
        w.http.delete(&format!("/api/humans/{}", id(&h))).await.0,
        409
    );
    assert_eq!(w.http.get("/health").await.1["memberCount"], 2);
    let (_, members) = w.http.get("/api/members").await;
    let names: Vec<&str> = members
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["connected", "watcher"]);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn unregistered_joins_are_refused_and_closed() {
    let w = world().await;
    for (card, text) in [
        (
            json!({ "id": uuid::Uuid::new_v4().to_string(), "name": "ghost", "type": "claude-code" }),
            "Unknown agent ID. Register via the HTTP API first.",
        ),
        (
            json!({ "id": uuid::Uuid::new_v4().to_string(), "name": "ghost", "type": "human" }),
            "Unknown human ID. Register via the HTTP API first.",
        ),
    ] {
        let mut ws = SkynetWs::connect(w.addr).await;
        ws.action("join", json!({ "agent": card })).await;
        let error = ws.next_event("error").await;
        assert_eq!(error["message"], text);
        ws.closed().await;
    }
    // A registered agent joining with the human type is not a registered human.
    let agent = w.http.agent("real").await;
    let mut ws = SkynetWs::connect(w.addr).await;
    let mut as_human = agent.clone();
    as_human["type"] = json!("human");
    ws.action("join", json!({ "agent": as_human })).await;
    assert_eq!(
        ws.next_event("error").await["message"],
        "Unknown human ID. Register via the HTTP API first."
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn messages_reach_only_the_sender_and_the_mentioned() {
    let w = world().await;
    let (a, b, c) = (
        w.http.agent("a").await,
        w.http.agent("b").await,
        w.http.agent("c").await,
    );
    let (mut ws_b, _) = SkynetWs::join(w.addr, &b).await;
    let (mut ws_c, _) = SkynetWs::join(w.addr, &c).await;
    let (mut ws_a, state) = SkynetWs::join(w.addr, &a).await;
    assert_eq!(state["members"].as_array().unwrap().len(), 3);
    // b and c each saw a join: c's, then a's (b) / a's (c).
    assert_eq!(ws_b.next_message().await["type"], "agent.join");
    let join = ws_b.next_message().await;
    assert_eq!(
        (join["type"].as_str(), join["from"].as_str()),
        (Some("agent.join"), Some(id(&a)))
    );
    assert_eq!(join["payload"]["agent"]["name"], "a");
    assert_eq!(ws_c.next_message().await["from"], a["id"]);

    let echo = ws_a.chat("hello @b").await;
    assert_eq!(echo["from"], a["id"]);
    assert_eq!(echo["type"], "chat");
    assert_eq!(echo["mentions"], json!([id(&b)]));
    let got = ws_b.next_message().await;
    assert_eq!(got, echo);

    ws_a.chat("@c sentinel").await;
    next_is(&mut ws_c, "@c sentinel").await;
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn from_is_overwritten_and_client_id_and_timestamp_kept() {
    let w = world().await;
    let a = w.http.agent("a").await;
    let (mut ws, _) = SkynetWs::join(w.addr, &a).await;
    let echo = ws
        .chat_with(json!({
            "id": "client-id-1", "type": "chat", "from": "forged", "timestamp": 12345,
            "payload": { "text": "hi" }, "replyTo": "earlier"
        }))
        .await;
    assert_eq!(echo["id"], "client-id-1");
    assert_eq!(echo["from"], a["id"]);
    assert_eq!(echo["timestamp"], 12345);
    assert_eq!(echo["replyTo"], "earlier");
    assert!(
        echo.get("mentions").is_none(),
        "no mentions key when empty: {echo}"
    );

    let fresh = ws.chat("no id").await;
    assert!(uuid::Uuid::parse_str(fresh["id"].as_str().unwrap()).is_ok());
    assert!(fresh["timestamp"].as_i64().unwrap() > 1_700_000_000_000);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn humans_observe_everything_except_unmentioned_execution_logs() {
    let w = world().await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let h = w.http.human("boss").await;
    let (mut ws_h, _) = SkynetWs::join(w.addr, &h).await;
    let (mut ws_b, _) = SkynetWs::join(w.addr, &b).await;
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    assert_eq!(ws_h.next_message().await["type"], "agent.join");
    assert_eq!(ws_h.next_message().await["type"], "agent.join");
    assert_eq!(ws_b.next_message().await["type"], "agent.join");

    ws_a.chat("to b @b").await;
    next_is(&mut ws_h, "to b @b").await;
    next_is(&mut ws_b, "to b @b").await;
    ws_a.chat("to nobody").await;
    next_is(&mut ws_h, "to nobody").await;

    let log = |mentions: Value| json!({ "type": "execution.log", "payload": { "event": "tool.call", "summary": "ls", "level": "info" }, "mentions": mentions });
    ws_a.chat_with(log(json!([]))).await;
    ws_a.chat_with(log(json!([id(&b)]))).await;
    // The log mentioning b reaches b; neither log reaches the human.
    assert_eq!(ws_b.next_message().await["type"], "execution.log");
    ws_a.chat("sentinel").await;
    next_is(&mut ws_h, "sentinel").await;

    ws_a.chat_with(log(json!([id(&h)]))).await;
    let got = ws_h.next_message().await;
    assert_eq!(got["type"], "execution.log");
    assert_eq!(got["mentions"], json!([id(&h)]));
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn at_all_reaches_every_member_once_sender_included() {
    let w = world().await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let h = w.http.human("boss").await;
    let (mut ws_h, _) = SkynetWs::join(w.addr, &h).await;
    let (mut ws_b, _) = SkynetWs::join(w.addr, &b).await;
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    for _ in 0..2 {
        ws_h.next_message().await;
    }
    ws_b.next_message().await;

    let echo = ws_a.chat("standup @all").await;
    assert_eq!(echo["mentions"], json!(["__all__"]));
    assert_eq!(ws_b.next_message().await, echo);
    assert_eq!(ws_h.next_message().await, echo);
    // Exactly once each: the next thing everyone sees is the sentinel.
    ws_a.chat("@b @boss sentinel").await;
    next_is(&mut ws_b, "@b @boss sentinel").await;
    next_is(&mut ws_h, "@b @boss sentinel").await;
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn mentions_are_enriched_from_text_without_duplicates() {
    let w = world().await;
    let a = w.http.agent("a").await;
    let backend = w.http.agent("Backend").await;
    let h = w.http.human("Alice").await;
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;

    let echo = ws_a.chat("**@backend** please, and @ALICE").await;
    assert_eq!(echo["mentions"], json!([id(&backend), id(&h)]));

    let echo = ws_a
        .chat_with(json!({ "type": "chat", "payload": { "text": "@Backend again" }, "mentions": [id(&backend), id(&backend)] }))
        .await;
    assert_eq!(echo["mentions"], json!([id(&backend)]));

    // The sender never mentions itself; only chat is enriched.
    let echo = ws_a.chat("I am @a").await;
    assert!(echo.get("mentions").is_none(), "{echo}");
    let echo = ws_a
        .chat_with(
            json!({ "type": "task.update", "payload": { "text": "@backend", "taskId": "t" } }),
        )
        .await;
    assert!(echo.get("mentions").is_none(), "{echo}");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_second_socket_replaces_the_first_with_4001() {
    let w = world().await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let (mut ws_b, _) = SkynetWs::join(w.addr, &b).await;
    let (mut first, _) = SkynetWs::join(w.addr, &a).await;
    assert_eq!(ws_b.next_message().await["type"], "agent.join");

    let (mut second, state) = SkynetWs::join(w.addr, &a).await;
    assert_eq!(state["members"].as_array().unwrap().len(), 2);
    let close = first.closed().await.expect("a close frame");
    assert_eq!(u16::from(close.code), 4001);
    assert_eq!(close.reason.as_str(), "replaced");

    // No join or leave for b: its next message is the sentinel, sent on the new socket.
    second.chat("@b sentinel").await;
    next_is(&mut ws_b, "@b sentinel").await;
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn reconnects_within_the_grace_period_are_silent() {
    let w = world().await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let (mut ws_b, _) = SkynetWs::join(w.addr, &b).await;
    let (ws_a, _) = SkynetWs::join(w.addr, &a).await;
    assert_eq!(ws_b.next_message().await["type"], "agent.join");
    ws_a.close().await;

    let (mut ws_a, state) = SkynetWs::join(w.addr, &a).await;
    let members: Vec<&str> = state["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(members, ["b", "a"]);
    ws_a.chat("@b back").await;
    next_is(&mut ws_b, "@b back").await;
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn the_leave_follows_the_grace_period_and_a_later_join_is_new() {
    let w = world_with("disconnect_grace_ms = 150").await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let (mut ws_b, _) = SkynetWs::join(w.addr, &b).await;
    let (ws_a, _) = SkynetWs::join(w.addr, &a).await;
    assert_eq!(ws_b.next_message().await["type"], "agent.join");
    ws_a.close().await;

    let leave = ws_b.next_message().await;
    assert_eq!(leave["type"], "agent.leave");
    assert_eq!(leave["from"], a["id"]);
    assert_eq!(leave["payload"]["agentId"], a["id"]);
    assert_eq!(w.http.get("/health").await.1["memberCount"], 1);

    let (_ws_a, _) = SkynetWs::join(w.addr, &a).await;
    assert_eq!(ws_b.next_message().await["type"], "agent.join");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn an_explicit_leave_is_immediate_and_the_socket_stays_open() {
    let w = world().await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let (mut ws_b, _) = SkynetWs::join(w.addr, &b).await;
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    assert_eq!(ws_b.next_message().await["type"], "agent.join");

    ws_a.action("leave", json!({})).await;
    let leave = ws_b.next_message().await;
    assert_eq!(
        (leave["type"].as_str(), leave["from"].as_str()),
        (Some("agent.leave"), Some(id(&a)))
    );
    ws_a.action(
        "send",
        json!({ "type": "chat", "payload": { "text": "still here?" } }),
    )
    .await;
    assert_eq!(
        ws_a.next_event("error").await["message"],
        "Not connected to workspace"
    );
    // The same socket can join again: a genuinely new member.
    ws_a.rejoin(&a, None).await;
    assert_eq!(ws_b.next_message().await["type"], "agent.join");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn workspace_state_replays_by_role_and_last_seen() {
    let w = world().await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let h = w.http.human("boss").await;
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    // Clients may stamp their messages; distinct stamps keep lastSeenTimestamp exact even
    // when several messages go out within one millisecond.
    let start = agentbridge::core::now_ms();
    let mut stamps = Vec::new();
    for i in 1..=5 {
        let stamped = |text: String, at: i64| json!({ "type": "chat", "payload": { "text": text }, "timestamp": at });
        stamps.push(
            ws_a.chat_with(stamped(format!("@b number {i}"), start + i * 10))
                .await["timestamp"]
                .as_i64()
                .unwrap(),
        );
        ws_a.chat_with(stamped(format!("not for b {i}"), start + i * 10 + 5))
            .await;
    }
    ws_a.chat_with(
        json!({ "type": "chat", "payload": { "text": "@all everyone" }, "timestamp": start + 100 }),
    )
    .await;

    // An agent gets only what mentions it (or @all), at most recent_mentions_limit (3).
    let (ws_b, state) = SkynetWs::join(w.addr, &b).await;
    let texts: Vec<&str> = state["recentMessages"]
        .as_array()
        .unwrap()
        .iter()
        .map(text_of)
        .collect();
    assert_eq!(texts, ["@b number 4", "@b number 5", "@all everyone"]);
    ws_b.close().await;

    // Newer than lastSeenTimestamp only.
    let mut ws_b = SkynetWs::connect(w.addr).await;
    let state = ws_b.rejoin(&b, Some(stamps[3])).await;
    let texts: Vec<&str> = state["recentMessages"]
        .as_array()
        .unwrap()
        .iter()
        .map(text_of)
        .collect();
    assert_eq!(texts, ["@b number 5", "@all everyone"]);

    // A human gets the last 100 of any type, including the joins.
    let (_ws_h, state) = SkynetWs::join(w.addr, &h).await;
    let recent = state["recentMessages"].as_array().unwrap();
    assert_eq!(recent.len(), 13, "{recent:?}");
    let joins = recent.iter().filter(|m| m["type"] == "agent.join").count();
    assert_eq!(joins, 2, "{recent:?}");
    let chats: Vec<&str> = recent
        .iter()
        .filter(|m| m["type"] == "chat")
        .map(text_of)
        .collect();
    assert_eq!(chats[..2], ["@b number 1", "not for b 1"]);
    assert_eq!(chats.last(), Some(&"@all everyone"));
    let members = state["members"].as_array().unwrap();
    assert!(
        members.iter().any(|m| m["id"] == h["id"]),
        "members include the joiner"
    );
    w.bridge.shutdown().await;
}

/// A message keeps the client's field order, and its text, wherever it is shown: to its
/// peers and its sender live, in a later member's replay and in the history API. The
/// fields the server sets (`from`, `id`, `timestamp`) follow the client's own.
#[tokio::test]
async fn a_message_is_shown_in_the_clients_field_order_live_and_in_replay() {
    let w = world().await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    ws_a.send_text(
        r#"{"action":"send","data":{"type":"chat","zeta":[1, 2],"payload":{"text":"@b hi","x":1.50},"alpha":{"b":1,"a":2}}}"#
            .to_owned(),
    )
    .await;
    let echo = ws_a.next_text().await;
    let start = format!(
        r#"{{"type":"chat","zeta":[1, 2],"payload":{{"text":"@b hi","x":1.50}},"alpha":{{"b":1,"a":2}},"from":"{}","id":""#,
        a["id"].as_str().unwrap()
    );
    assert!(echo.starts_with(&start), "{echo}");
    let (_first, state) = SkynetWs::join(w.addr, &b).await;
    assert_eq!(
        serde_json::from_str::<Value>(&echo).unwrap(),
        state["recentMessages"][0]
    );
    // The workspace.state frame, as text, holds the echo's text (a second socket of b's:
    // it takes the membership over).
    let mut ws_b = SkynetWs::connect(w.addr).await;
    ws_b.action("join", json!({ "agent": b })).await;
    let frame = ws_b.next_text().await;
    assert!(frame.contains(&echo), "{frame}\n{echo}");
    let (status, history) = w.http.get_text("/api/messages").await;
    assert_eq!(status, 200);
    assert!(history.contains(&echo), "{history}\n{echo}");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn the_agent_replay_limit_is_configurable() {
    let w = world_with("recent_mentions_limit = 1").await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    for i in 1..=3 {
        ws_a.chat(&format!("@b {i}")).await;
    }
    let (_ws_b, state) = SkynetWs::join(w.addr, &b).await;
    let recent = state["recentMessages"].as_array().unwrap();
    assert_eq!(recent.len(), 1);
    assert_eq!(text_of(&recent[0]), "@b 3");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn status_changes_go_to_the_others_and_are_not_echoed() {
    let w = world().await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let (mut ws_b, _) = SkynetWs::join(w.addr, &b).await;
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    assert_eq!(ws_b.next_message().await["type"], "agent.join");

    ws_a.action("heartbeat", json!({ "agentId": id(&a), "status": "busy" }))
        .await;
    let ack = ws_a.next_event("heartbeat.ack").await;
    assert!(ack["timestamp"].as_i64().unwrap() > 0);
    assert_eq!(
        ws_b.next().await,
        json!({ "event": "status-change", "data": { "agentId": id(&a), "status": "busy" } })
    );
    // The same status again is no change.
    ws_a.action("heartbeat", json!({ "agentId": id(&a), "status": "busy" }))
        .await;
    ws_a.next_event("heartbeat.ack").await;
    ws_a.chat("@b sentinel").await;
    let next = ws_b.next().await;
    assert_eq!(text_of(&next), "@b sentinel", "{next}");

    let (_, agents) = w.http.get(&format!("/api/agents/{}", id(&a))).await;
    assert_eq!(agents["status"], "busy");

    // A heartbeat without a status clears it: the event carries none.
    ws_a.action("heartbeat", json!({ "agentId": id(&a) })).await;
    ws_a.next_event("heartbeat.ack").await;
    assert_eq!(
        ws_b.next().await,
        json!({ "event": "status-change", "data": { "agentId": id(&a) } })
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn control_endpoints_reach_only_the_agent_and_are_not_stored() {
    let w = world().await;
    let (a, idle) = (w.http.agent("a").await, w.http.agent("idle").await);
    let h = w.http.human("boss").await;
    let (mut ws_h, _) = SkynetWs::join(w.addr, &h).await;
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    assert_eq!(ws_h.next_message().await["type"], "agent.join");

    for action in ["interrupt", "forget", "watch", "unwatch"] {
        let (status, err) = w
            .http
            .post(&format!("/api/agents/nobody/{action}"), json!({}))
            .await;
        assert_eq!(
            (status, err["error"].as_str()),
            (404, Some("Agent not found"))
        );
        let (status, err) = w
            .http
            .post(
                &format!("/api/agents/{}/{action}", id(&idle)),
                json!({ "humanId": id(&h) }),
            )
            .await;
        assert_eq!(
            (status, err["error"].as_str()),
            (409, Some("Agent is not connected"))
        );
    }
    for action in ["watch", "unwatch"] {
        let (status, err) = w
            .http
            .post(&format!("/api/agents/{}/{action}", id(&a)), json!({}))
            .await;
        assert_eq!(
            (status, err["error"].as_str()),
            (400, Some("humanId is required"))
        );
    }

    let (status, body) = w
        .http
        .post(
            &format!("/api/agents/{}/interrupt", id(&a)),
            json!({ "reason": "stop" }),
        )
        .await;
    assert_eq!(
        (status, body),
        (200, json!({ "ok": true, "agentId": id(&a) }))
    );
    let msg = ws_a.next_message().await;
    assert_eq!(msg["type"], "agent.interrupt");
    assert_eq!(msg["from"], a["id"]);
    assert_eq!(msg["mentions"], json!([id(&a)]));
    assert_eq!(
        msg["payload"],
        json!({ "agentId": id(&a), "reason": "stop" })
    );

    // By name too, as Skynet's server looks agents up.
    assert_eq!(w.http.post("/api/agents/a/forget", json!({})).await.0, 200);
    assert_eq!(ws_a.next_message().await["type"], "agent.forget");

    let (status, _) = w
        .http
        .post(
            &format!("/api/agents/{}/watch", id(&a)),
            json!({ "humanId": id(&h) }),
        )
        .await;
    assert_eq!(status, 200);
    let msg = ws_a.next_message().await;
    assert_eq!(msg["type"], "agent.watch");
    assert_eq!(
        msg["payload"],
        json!({ "agentId": id(&a), "humanId": id(&h) })
    );

    // Once watched, the agent's execution logs reach the human.
    ws_a.chat_with(json!({ "type": "execution.log", "payload": { "event": "thinking", "summary": "hmm", "level": "info" } }))
        .await;
    let log = ws_h.next_message().await;
    assert_eq!(log["type"], "execution.log");

    w.http
        .post(
            &format!("/api/agents/{}/unwatch", id(&a)),
            json!({ "humanId": id(&h) }),
        )
        .await;
    assert_eq!(ws_a.next_message().await["type"], "agent.unwatch");
    ws_a.chat_with(json!({ "type": "execution.log", "payload": { "event": "thinking", "summary": "quiet", "level": "info" } }))
        .await;
    // Control messages and unwatched logs never reached the human.
    ws_a.chat("sentinel").await;
    next_is(&mut ws_h, "sentinel").await;

    let (_, history) = w.http.get("/api/messages").await;
    let types: Vec<&str> = history
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["type"].as_str().unwrap())
        .collect();
    assert!(
        !types.iter().any(|t| t.starts_with("agent.interrupt")
            || *t == "agent.forget"
            || *t == "agent.watch"),
        "{types:?}"
    );
    w.bridge.shutdown().await;
}

/// A registration deleted takes its watches with it: a human or agent registered later
/// under its name starts with none.
#[tokio::test]
async fn a_deleted_registrations_watches_go_with_it() {
    let w = world_with("disconnect_grace_ms = 150").await;
    let log = |summary: &str| json!({ "type": "execution.log", "payload": { "event": "thinking", "summary": summary, "level": "info" } });
    let watch = async |agent: &Value, human: &Value| {
        let path = format!("/api/agents/{}/watch", id(agent));
        let (status, _) = w.http.post(&path, json!({ "humanId": id(human) })).await;
        assert_eq!(status, 200);
    };

    // A human who was never joined watches `a`, and is deleted.
    let a = w.http.agent("a").await;
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    let gone = w.http.human("boss").await;
    watch(&a, &gone).await;
    assert_eq!(ws_a.next_message().await["type"], "agent.watch");
    let path = format!("/api/humans/{}", id(&gone));
    assert_eq!(w.http.delete(&path).await.0, 200);

    // A human of the same name is not sent `a`'s logs.
    let boss = w.http.human("boss").await;
    let (mut ws_boss, _) = SkynetWs::join(w.addr, &boss).await;
    ws_a.chat_with(log("for the old boss")).await;
    ws_a.chat("sentinel").await;
    next_is(&mut ws_boss, "sentinel").await;

    // The new boss watches `a`; `a` leaves and is deleted; an agent of the same name is
    // not watched.
    watch(&a, &boss).await;
    ws_a.close().await;
    assert_eq!(ws_boss.next_message().await["type"], "agent.leave");
    let path = format!("/api/agents/{}", id(&a));
    assert_eq!(w.http.delete(&path).await.0, 200);
    let again = w.http.agent("a").await;
    let (mut ws_again, _) = SkynetWs::join(w.addr, &again).await;
    assert_eq!(ws_boss.next_message().await["type"], "agent.join");
    ws_again.chat_with(log("from the new a")).await;
    ws_again.chat("sentinel again").await;
    next_is(&mut ws_boss, "sentinel again").await;
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn history_paginates_by_timestamp() {
    let w = world().await;
    let a = w.http.agent("a").await;
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    let base = 4_000_000_000_000_i64;
    for i in 1..=5 {
        ws_a.chat_with(json!({ "type": "chat", "timestamp": base + i, "payload": { "text": format!("m{i}") } }))
            .await;
    }
    let texts = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|m| text_of(m).to_owned())
            .collect()
    };
    let (status, page) = w.http.get("/api/messages?limit=2").await;
    assert_eq!(status, 200);
    assert_eq!(texts(&page), ["m4", "m5"]);
    let (_, older) = w
        .http
        .get(&format!("/api/messages?limit=2&before={}", base + 4))
        .await;
    assert_eq!(texts(&older), ["m2", "m3"]);
    let (_, all) = w.http.get("/api/messages").await;
    assert_eq!(all.as_array().unwrap().len(), 6, "the join and five chats");
    assert_eq!(all[0]["type"], "agent.join");
    assert_eq!(w.http.get("/api/messages?limit=abc").await.0, 400);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn bad_frames_get_error_events_and_the_socket_stays_open() {
    let w = world_with("max_frame_bytes = 2048").await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let mut ws = SkynetWs::connect(w.addr).await;

    let expect = async |ws: &mut SkynetWs, frame: &str, message: &str, detail: Option<&str>| {
        ws.send_text(frame.to_owned()).await;
        let error = ws.next_event("error").await;
        assert_eq!(error["message"], message, "for {frame}: {error}");
        if let Some(detail) = detail {
            let said = error["detail"].as_str().unwrap_or_default();
            assert!(said.contains(detail), "for {frame}: {error}");
        }
    };
    expect(
        &mut ws,
        "not json",
        "Invalid message format",
        Some("not valid JSON"),
    )
    .await;
    expect(&mut ws, "[1,2]", "Invalid message format", Some("object")).await;
    expect(
        &mut ws,
        r#"{"action":"dance","data":{}}"#,
        "Unknown action: dance",
        None,
    )
    .await;
    expect(
        &mut ws,
        r#"{"action":"join","data":{}}"#,
        "Invalid message format",
        Some("data.agent"),
    )
    .await;
    expect(
        &mut ws,
        r#"{"action":"join","data":{"agent":{"name":"x"}}}"#,
        "Invalid message format",
        Some("data.agent.id"),
    )
    .await;
    expect(
        &mut ws,
        r#"{"action":"send","data":{"type":"chat","payload":{"text":"hi"}}}"#,
        "Not connected to workspace",
        None,
    )
    .await;
    // A heartbeat before join is ignored: the next thing said is about the malformed send
    // that follows it, which is refused for not being joined, whatever its shape.
    ws.send_text(r#"{"action":"heartbeat","data":{"status":"busy"}}"#.into())
        .await;
    expect(
        &mut ws,
        r#"{"action":"send","data":{"payload":{"text":"hi"}}}"#,
        "Not connected to workspace",
        None,
    )
    .await;

    ws.rejoin(&a, None).await;
    expect(
        &mut ws,
        r#"{"action":"send","data":{"payload":{"text":"hi"}}}"#,
        "Invalid message format",
        Some("data.type"),
    )
    .await;
    expect(
        &mut ws,
        r#"{"action":"send","data":{"type":"chat"}}"#,
        "Invalid message format",
        Some("data.payload"),
    )
    .await;
    expect(
        &mut ws,
        r#"{"action":"send","data":{"type":"chat","payload":{"text":["x"]}}}"#,
        "Invalid message format",
        Some("text"),
    )
    .await;
    expect(
        &mut ws,
        r#"{"action":"send","data":{"type":"chat","payload":{},"mentions":[1]}}"#,
        "Invalid message format",
        Some("mentions"),
    )
    .await;
    expect(
        &mut ws,
        r#"{"action":"send","data":"chat"}"#,
        "Invalid message format",
        Some("data"),
    )
    .await;
    ws.send_text(format!(
        r#"{{"action":"send","data":{{"type":"chat","payload":{{"text":"{}"}}}}}}"#,
        "x".repeat(4096)
    ))
    .await;
    let error = ws.next_event("error").await;
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .starts_with("Message too large"),
        "{error}"
    );

    // After all of it the socket still works.
    let (mut ws_b, _) = SkynetWs::join(w.addr, &b).await;
    ws.next_message().await; // b's join
    ws.chat("@b fine").await;
    next_is(&mut ws_b, "@b fine").await;
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn attachments_over_5mb_are_refused_and_not_delivered() {
    let w = world().await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let (mut ws_b, _) = SkynetWs::join(w.addr, &b).await;
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    ws_b.next_message().await;

    let small = json!({ "type": "image", "mimeType": "image/png", "name": "ok.png", "data": "iVBORw0KGgo=", "size": 8 });
    let echo = ws_a
        .chat_with(
            json!({ "type": "chat", "payload": { "text": "@b look", "attachments": [small] } }),
        )
        .await;
    assert_eq!(echo["payload"]["attachments"][0]["name"], "ok.png");
    assert_eq!(ws_b.next_message().await, echo);

    let big = "A".repeat(5 * 1024 * 1024 * 4 / 3 + 16);
    ws_a.action(
        "send",
        json!({ "type": "chat", "payload": { "text": "@b huge", "attachments": [
            { "type": "image", "mimeType": "image/png", "name": "huge.png", "data": big, "size": 5 * 1024 * 1024 + 12 }
        ] } }),
    )
    .await;
    let error = ws_a.next_event("error").await;
    assert!(
        error["message"].as_str().unwrap().contains("huge.png"),
        "{error}"
    );
    ws_a.chat("@b sentinel").await;
    next_is(&mut ws_b, "@b sentinel").await;
    let (_, history) = w.http.get("/api/messages").await;
    assert!(
        !history
            .as_array()
            .unwrap()
            .iter()
            .any(|m| text_of(m) == "@b huge")
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn history_and_registrations_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().to_str().unwrap();
    let (a_card, b_card);
    {
        let bridge = start_bridge_in(data_dir, "").await;
        let addr = bridge.addr("skynet").unwrap();
        let http = SkynetHttp::new(addr);
        a_card = http.agent("a").await;
        b_card = http.agent("b").await;
        let (mut ws_a, _) = SkynetWs::join(addr, &a_card).await;
        for i in 1..=3 {
            ws_a.chat(&format!("@b before restart {i}")).await;
        }
        bridge.shutdown().await;
    }
    let bridge = start_bridge_in(data_dir, "").await;
    let addr = bridge.addr("skynet").unwrap();
    let http = SkynetHttp::new(addr);
    assert_eq!(http.get("/api/agents/a").await.1["id"], a_card["id"]);
    let (_, history) = http.get("/api/messages").await;
    let texts: Vec<&str> = history
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["type"] == "chat")
        .map(text_of)
        .collect();
    assert_eq!(
        texts,
        [
            "@b before restart 1",
            "@b before restart 2",
            "@b before restart 3"
        ]
    );
    let (_ws_b, state) = SkynetWs::join(addr, &b_card).await;
    assert_eq!(state["recentMessages"].as_array().unwrap().len(), 3);
    // The name is still taken.
    assert_eq!(
        http.post("/api/agents", json!({ "name": "a", "type": "generic" }))
            .await
            .0,
        409
    );
    bridge.shutdown().await;
}

/// The bridge sends long messages as fragments of a few KiB (so no connection keeps a
/// buffer the size of its largest message); a client still reads each as one message.
#[tokio::test]
async fn long_messages_arrive_whole_and_plain_gets_of_ws_are_refused_in_skynets_shape() {
    let w = world().await;
    let (a, b) = (w.http.agent("a").await, w.http.agent("b").await);
    let (mut ws_b, _) = SkynetWs::join(w.addr, &b).await;
    let (mut ws_a, _) = SkynetWs::join(w.addr, &a).await;
    assert_eq!(ws_b.next_message().await["type"], "agent.join");
    // Multi-byte characters, so fragment boundaries fall inside some of them.
    let text = format!("@b {}", "héllo wörld ✓ ".repeat(20_000));
    let echo = ws_a.chat(&text).await;
    assert_eq!(text_of(&echo), text);
    let got = ws_b.next_message().await;
    assert_eq!(text_of(&got), text);

    let plain = reqwest::get(format!("http://{}/ws", w.addr)).await.unwrap();
    assert_eq!(plain.status(), 400);
    // The upgrade's refusal is in Skynet's `{error}` shape, as every HTTP refusal is.
    assert_eq!(
        plain.json::<serde_json::Value>().await.unwrap(),
        json!({ "error": "Connection header did not include 'upgrade'" })
    );
    w.bridge.shutdown().await;
}

/// An execution log mentions the humans its agent was told watch it; one that is gone is
/// passed over without an `error` event, which Skynet's agent runner has no listener for.
#[tokio::test]
async fn an_execution_log_for_a_watcher_that_is_gone_is_not_refused() {
    let w = world().await;
    let a = w.http.agent("a").await;
    let (mut ws, _) = SkynetWs::join(w.addr, &a).await;
    ws.action(
        "send",
        json!({ "type": "execution.log", "payload": { "event": "thinking", "summary": "hm" }, "mentions": ["gone-human"] }),
    )
    .await;
    ws.no_error_before_a_sentinel().await;
    w.bridge.shutdown().await;
}
