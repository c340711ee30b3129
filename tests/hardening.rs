//! A hostile client's probes, over real sockets: nothing it sends stalls the bridge or
//! pins its memory, every refusal is in the sender's own protocol, and nothing accepted
//! is lost to a slow reader.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::Frame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};

use common::grid::{GridWs, yaml};
use common::skynet::{SkynetHttp, SkynetWs, text_of};
use common::tracker::{TrackerHttp, TrackerWs, section_with};
use common::ws::{RawSocket, TestSocket};
use common::{WAIT, decode_errors, start_bridge, ws_url};

/// A text frame whose payload is not UTF-8, as no client library will send one.
fn not_utf8() -> Message {
    let payload = Bytes::from_static(&[b'{', 0xff, 0xfe, b'}']);
    Message::Frame(Frame::message(payload, OpCode::Data(Data::Text), true))
}

/// The next Tracker `error` frame, skipping presence.
async fn tracker_error(ws: &mut TrackerWs) -> Value {
    loop {
        let frame = ws.next().await;
        if frame["type"] != "agent.status" {
            assert_eq!(frame["type"], "error", "{frame}");
            return frame;
        }
    }
}

/// Limits small enough to reach in a test.
const SMALL_FRAMES: &str = "max_frame_bytes = 4096";

async fn small_frame_bridge() -> agentbridge::Bridge {
    start_bridge(&format!(
        "[skynet]\nlisten = \"127.0.0.1:0\"\n{SMALL_FRAMES}\n\
         {}\n\
         [grid]\nlisten = \"127.0.0.1:0\"\n{SMALL_FRAMES}\n",
        section_with(SMALL_FRAMES)
    ))
    .await
}

// ---- 1. No frame stalls the bridge: mentions are bounded and linear -------------------

#[tokio::test]
async fn skynet_too_many_mentions_are_refused_before_any_is_looked_up() {
    let bridge = start_bridge("[skynet]\nlisten = \"127.0.0.1:0\"\nmax_mentions = 100\n").await;
    let addr = bridge.addr("skynet").unwrap();
    let http = SkynetHttp::new(addr);
    let card = http.agent("sender").await;
    let (mut ws, _) = SkynetWs::join(addr, &card).await;
    let mentions: Vec<String> = (0..60_000).map(|i| format!("nobody-{i}")).collect();
    ws.action(
        "send",
        json!({ "type": "chat", "payload": { "text": "@all hi" }, "mentions": mentions }),
    )
    .await;
    let refusal = ws.next_event("error").await;
    assert_eq!(
        refusal["message"],
        "Too many mentions: 60000; the limit is 100"
    );
    // Within the limit, the unknown ones are named a few at a time, however many.
    let mentions: Vec<String> = (0..100).map(|i| format!("nobody-{i}")).collect();
    ws.action(
        "send",
        json!({ "type": "chat", "payload": { "text": "hi" }, "mentions": mentions }),
    )
    .await;
    // The echo and the error, in either order.
    let (first, second) = (ws.next().await, ws.next().await);
    let (echo, unknown) = if first.get("event").is_some() {
        (second, first)
    } else {
        (first, second)
    };
    assert_eq!(text_of(&echo), "hi");
    assert_eq!(
        unknown["data"]["message"],
        "Unknown recipient: nobody-0, nobody-1, nobody-2, nobody-3, nobody-4 and 95 more"
    );
    bridge.shutdown().await;
}

#[tokio::test]
async fn tracker_too_many_mentions_are_refused_over_rest_and_the_socket() {
    let bridge = start_bridge(&section_with("max_mentions = 10")).await;
    let addr = bridge.addr("tracker").unwrap();
    let http = TrackerHttp::new(addr, "tb-coder");
    let (mut ws, ok) = TrackerWs::auth(addr, "tb-coder").await;
    let lobby = ok["lobby_chat_id"].clone();
    let mentions: Vec<String> = (0..5000).map(|_| "admin".to_owned()).collect();
    let (status, body) = http
        .post(
            "/messages",
            json!({ "chat_id": lobby, "content": "hi", "mentions": mentions }),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["detail"][0]["loc"], json!(["body", "mentions"]));
    assert_eq!(
        body["detail"][0]["msg"],
        "Too many mentions: 5000; the limit is 10"
    );
    ws.send(
        json!({ "type": "chat.send", "chat_id": lobby, "content": "hi", "mentions": mentions }),
    )
    .await;
    assert_eq!(
        tracker_error(&mut ws).await["message"],
        "too many mentions: 5000; the limit is 10"
    );
    bridge.shutdown().await;
}

// ---- 2. WebSocket protocol errors are answered, then closed with RFC 6455's code -------

#[tokio::test]
async fn a_text_frame_that_is_not_utf8_is_answered_then_closed_1007_on_every_endpoint() {
    let bridge = small_frame_bridge().await;
    let skynet = bridge.addr("skynet").unwrap();
    let tracker = bridge.addr("tracker").unwrap();
    let grid = bridge.addr("grid").unwrap();

    let before = decode_errors(&bridge, "skynet").await;
    let mut ws = TestSocket::connect(&ws_url(skynet, "/ws")).await;
    ws.send_message(not_utf8()).await;
    let answer: Value = serde_json::from_str(&ws.next_text().await).unwrap();
    assert_eq!(answer["event"], "error");
    assert_eq!(answer["data"]["message"], "Invalid message format");
    assert_eq!(ws.closed().await.map(|c| u16::from(c.code)), Some(1007));
    assert!(decode_errors(&bridge, "skynet").await > before);

    let (mut ws, _) = TrackerWs::auth(tracker, "tb-coder").await;
    let mut raw = TestSocket::connect(&ws_url(tracker, "/ws")).await;
    raw.send_text(json!({ "type": "auth", "token": "tb-listener" }).to_string())
        .await;
    let ok: Value = serde_json::from_str(&raw.next_text().await).unwrap();
    assert_eq!(ok["type"], "auth.ok");
    raw.send_message(not_utf8()).await;
    let answer = loop {
        let frame: Value = serde_json::from_str(&raw.next_text().await).unwrap();
        if frame["type"] != "agent.status" {
            break frame;
        }
    };
    assert_eq!(answer["type"], "error");
    assert_eq!(answer["message"], "Text frame is not valid UTF-8");
    assert_eq!(raw.closed().await.map(|c| u16::from(c.code)), Some(1007));
    ws.settle().await;

    let mut ws = GridWs::quiet(grid, "executor", None).await;
    let mut raw = TestSocket::connect(&ws_url(grid, "/grid/v1/ws?agent=scout")).await;
    raw.send_message(not_utf8()).await;
    let answer = yaml(&raw.next_text().await);
    assert_eq!(answer["message"]["type"], "error");
    assert_eq!(
        answer["message"]["content"]["payload"]["error_message"],
        "Text frame is not valid UTF-8"
    );
    assert_eq!(raw.closed().await.map(|c| u16::from(c.code)), Some(1007));
    ws.send_raw("not: [yaml").await;
    assert_eq!(ws.next().await["type"], "error", "the other socket goes on");
    bridge.shutdown().await;
}

#[tokio::test]
async fn frames_over_the_limit_are_refused_unread_and_the_socket_goes_on() {
    let bridge = small_frame_bridge().await;
    let big = "x".repeat(10_000);

    let skynet = bridge.addr("skynet").unwrap();
    let card = SkynetHttp::new(skynet).agent("big-sender").await;
    let (mut ws, _) = SkynetWs::join(skynet, &card).await;
    ws.send_text(big.clone()).await;
    let refusal = ws.next_event("error").await;
    assert_eq!(
        refusal["message"],
        "Message too large: 10000 bytes; the limit is 4096 bytes"
    );
    assert_eq!(text_of(&ws.chat("still here").await), "still here");

    let tracker = bridge.addr("tracker").unwrap();
    let before = decode_errors(&bridge, "tracker").await;
    let (mut ws, _) = TrackerWs::auth(tracker, "tb-coder").await;
    ws.send_text(big.clone()).await;
    assert_eq!(
        tracker_error(&mut ws).await["message"],
        "Message too large: 10000 bytes; the limit is 4096 bytes"
    );
    ws.settle().await;
    assert!(decode_errors(&bridge, "tracker").await > before);

    let grid = bridge.addr("grid").unwrap();
    let mut ws = GridWs::quiet(grid, "executor", None).await;
    ws.send_raw(&big).await;
    let refusal = ws.next().await;
    assert_eq!(refusal["type"], "error");
    assert_eq!(
        refusal["content"]["payload"]["error_code"],
        "PAYLOAD_TOO_LARGE"
    );
    ws.send_raw("not: [yaml").await;
    assert_eq!(ws.next().await["type"], "error", "the socket goes on");
    bridge.shutdown().await;
}

/// The Tracker's answers to a refused frame are the protocol's `error` frame, with the text.
#[tokio::test]
async fn tracker_refusals_of_frames_say_why() {
    let bridge = small_frame_bridge().await;
    let tracker = bridge.addr("tracker").unwrap();
    let mut raw = TestSocket::connect(&ws_url(tracker, "/ws")).await;
    raw.send_text(json!({ "type": "auth", "token": "tb-quiet" }).to_string())
        .await;
    let _ok = raw.next_text().await;
    raw.send_text("y".repeat(5000)).await;
    let frame: Value = serde_json::from_str(&raw.next_text().await).unwrap();
    assert_eq!(
        frame,
        json!({ "type": "error", "message": "Message too large: 5000 bytes; the limit is 4096 bytes" })
    );
    bridge.shutdown().await;
}

// ---- 3. HTTP refusals are in each endpoint's error shape -----------------------------

/// A response's status and body text.
async fn answer(
    sent: impl std::future::Future<Output = reqwest::Result<reqwest::Response>>,
) -> (u16, String) {
    let res = sent.await.expect("an answer");
    let status = res.status().as_u16();
    (status, res.text().await.expect("a body"))
}

#[tokio::test]
async fn the_frameworks_refusals_are_in_each_endpoints_shape() {
    let bridge = start_bridge(
        "[skynet]\nlisten = \"127.0.0.1:0\"\nmax_body_bytes = 1000\n\
         [grid]\nlisten = \"127.0.0.1:0\"\nmax_body_bytes = 1000\n\
         [synapse]\nlisten = \"127.0.0.1:0\"\nmax_message_bytes = 1000\n",
    )
    .await;
    let http = common::http();
    let big = "z".repeat(5000);
    let post = |addr: SocketAddr, path: &str, content_type: &str| {
        http.post(format!("http://{addr}{path}"))
            .header("content-type", content_type.to_owned())
            .body(big.clone())
            .send()
    };

    let skynet = bridge.addr("skynet").unwrap();
    let (status, body) = answer(post(skynet, "/api/agents", "application/json")).await;
    assert_eq!(status, 413);
    let body: Value = serde_json::from_str(&body).unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("length limit"),
        "{body}"
    );
    let (status, body) = answer(http.put(format!("http://{skynet}/api/agents")).send()).await;
    assert_eq!(
        (status, body),
        (405, json!({ "error": "Method Not Allowed" }).to_string())
    );

    let tracker = bridge.addr("tracker").unwrap();
    let too_long = http
        .post(format!("http://{tracker}/api/v1/messages"))
        .bearer_auth("tb-coder")
        .header("content-type", "application/json")
        .body("w".repeat(3 * 1024 * 1024))
        .send();
    let (status, body) = answer(too_long).await;
    assert_eq!(status, 413);
    let body: Value = serde_json::from_str(&body).unwrap();
    assert!(body["detail"].is_string(), "{body}");
    let (status, body) = answer(http.put(format!("http://{tracker}/api/v1/projects")).send()).await;
    assert_eq!(
        (status, body),
        (405, json!({ "detail": "Method Not Allowed" }).to_string())
    );

    let grid = bridge.addr("grid").unwrap();
    let (status, body) = answer(post(grid, "/grid/v1/messages", "application/yaml")).await;
    assert_eq!(status, 413);
    let body = yaml(&body);
    assert_eq!(body["message"]["type"], "error");
    assert_eq!(
        body["message"]["content"]["payload"]["error_code"],
        "PAYLOAD_TOO_LARGE"
    );
    let (status, body) = answer(http.delete(format!("http://{grid}/grid/v1/agents")).send()).await;
    assert_eq!(status, 405);
    assert_eq!(
        yaml(&body)["message"]["content"]["payload"]["error_code"],
        "METHOD_NOT_ALLOWED"
    );

    let synapse = bridge.addr("synapse").unwrap();
    let res = post(synapse, "/api/v1/synapse/message", "application/json")
        .await
        .unwrap();
    assert_eq!(res.status(), 413);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["code"], 8, "{body}");
    bridge.shutdown().await;
}

// ---- 4. Slow clients do not hold connections forever ----------------------------------

/// Whether the server closes `tcp` within `within`, while it sends a byte every 100 ms.
async fn closed_while_dribbling(mut tcp: TcpStream, within: Duration) -> bool {
    let request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    let deadline = tokio::time::Instant::now() + within;
    let mut i = 0;
    while tokio::time::Instant::now() < deadline {
        if tcp
            .write_all(&request[i % request.len()..][..1])
            .await
            .is_err()
        {
            return true;
        }
        i += 1;
        let mut buf = [0u8; 256];
        match tokio::time::timeout(Duration::from_millis(100), tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            _ => {}
        }
    }
    false
}

#[tokio::test]
async fn slow_headers_and_idle_connections_are_closed_on_every_listener() {
    let bridge =
        start_bridge("[limits]\nheader_read_timeout_ms = 300\nidle_timeout_ms = 600\n").await;
    let mut addrs: Vec<SocketAddr> = bridge.listeners().iter().map(|(_, _, a)| *a).collect();
    addrs.dedup();
    for addr in addrs {
        let tcp = TcpStream::connect(addr).await.unwrap();
        assert!(
            closed_while_dribbling(tcp, WAIT).await,
            "{addr} kept a slow client"
        );
        // A connection that never sends a request at all.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(WAIT, silent.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "{addr} kept a silent connection"
        );
    }
    bridge.shutdown().await;
}

/// Sends a request head promising a body of `length` bytes on `tcp`, then its body a byte
/// every 100 ms; whether the server answers or closes within `within`.
async fn answered_while_dribbling_a_body(
    tcp: &mut TcpStream,
    path: &str,
    length: usize,
    within: Duration,
) -> bool {
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {length}\r\n\r\n"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if tcp.write_all(b" ").await.is_err() {
            return true;
        }
        let mut buf = [0u8; 256];
        match tokio::time::timeout(Duration::from_millis(100), tcp.read(&mut buf)).await {
            Ok(Ok(_)) | Ok(Err(_)) => return true,
            Err(_) => {}
        }
    }
    false
}

#[tokio::test]
async fn a_request_body_sent_a_byte_at_a_time_is_cut_off() {
    let bridge = start_bridge("[limits]\nbody_read_timeout_ms = 300\n").await;
    let paths = [
        ("skynet", "/api/agents/register"),
        ("tracker", "/api/v1/messages"),
        ("grid", "/grid/v1/messages"),
        ("synapse", "/api/v1/synapse/message"),
    ];
    for (protocol, path) in paths {
        let mut tcp = TcpStream::connect(bridge.addr(protocol).unwrap())
            .await
            .unwrap();
        assert!(
            answered_while_dribbling_a_body(&mut tcp, path, 100_000, WAIT).await,
            "{protocol} waited for a slow body"
        );
    }
    bridge.shutdown().await;
}

#[tokio::test]
async fn an_http2_connection_that_sends_no_request_is_closed() {
    // A peer that does not acknowledge the GOAWAY's ping is dropped once its drain time is
    // out.
    let bridge =
        start_bridge("[limits]\nheader_read_timeout_ms = 300\ndrain_timeout_ms = 300\n").await;
    let mut tcp = TcpStream::connect(bridge.addr("synapse").unwrap())
        .await
        .unwrap();
    // The HTTP/2 preface and an empty SETTINGS frame: a connection, and no request on it.
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let closed = tokio::time::timeout(WAIT, async {
        let mut buf = [0u8; 1024];
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "an idle HTTP/2 connection was kept");
    bridge.shutdown().await;
}

#[tokio::test]
async fn shutdown_does_not_wait_past_the_drain_time_for_a_busy_connection() {
    let bridge =
        start_bridge("[limits]\nbody_read_timeout_ms = 600000\ndrain_timeout_ms = 200\n").await;
    let mut tcp = TcpStream::connect(bridge.addr("tracker").unwrap())
        .await
        .unwrap();
    // A request in flight that will not finish by itself: its body is still coming.
    let head = "POST /api/v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{";
    tcp.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        tokio::time::timeout(WAIT, bridge.shutdown()).await.is_ok(),
        "shutdown waited on a connection that would not finish"
    );
}

#[tokio::test]
async fn sockets_that_never_identify_are_closed() {
    let bridge = start_bridge(
        "[skynet]\nlisten = \"127.0.0.1:0\"\njoin_timeout_ms = 200\n\
         [grid]\nlisten = \"127.0.0.1:0\"\nidentify_timeout_ms = 200\n",
    )
    .await;
    let mut skynet = SkynetWs::connect(bridge.addr("skynet").unwrap()).await;
    let told = skynet.next_event("error").await;
    assert!(
        told["message"]
            .as_str()
            .unwrap()
            .starts_with("Join timeout")
    );
    assert_eq!(skynet.closed().await.map(|c| u16::from(c.code)), Some(1008));

    let mut grid = TestSocket::connect(&ws_url(bridge.addr("grid").unwrap(), "/grid/v1/ws")).await;
    let told = yaml(&grid.next_text().await);
    assert_eq!(
        told["message"]["content"]["payload"]["error_code"],
        "IDENTIFY_TIMEOUT"
    );
    assert_eq!(grid.closed().await.map(|c| u16::from(c.code)), Some(1008));
    bridge.shutdown().await;
}

// ---- 5. Memory an attacker can pin is bounded bridge-wide -----------------------------

#[tokio::test]
async fn large_messages_past_the_read_budget_are_refused_until_it_frees() {
    let bridge = start_bridge(
        "[limits]\nread_budget_bytes = 300000\n\
         [skynet]\nlisten = \"127.0.0.1:0\"\njoin_timeout_ms = 600000\n",
    )
    .await;
    let addr = bridge.addr("skynet").unwrap();
    let http = SkynetHttp::new(addr);
    // Two sockets each send all but the last 1000 bytes of a 140 KB frame, and stop: what
    // they sent holds the budget (a header alone would hold nothing).
    let mut holders = Vec::new();
    for _ in 0..2 {
        let mut raw = RawSocket::connect(addr, "/ws").await;
        raw.write(&RawSocket::frame_header(1, true, 140_000)).await;
        raw.write(&[b' '; 139_000]).await;
        holders.push(raw);
    }
    let held = || 300_000 - bridge.read_budget().available();
    let deadline = tokio::time::Instant::now() + WAIT;
    while held() < 278_000 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "held only {}",
            held()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let card = http.agent("third").await;
    let (mut ws, _) = SkynetWs::join(addr, &card).await;
    let text = "q".repeat(100_000);
    ws.action(
        "send",
        json!({ "type": "chat", "payload": { "text": text } }),
    )
    .await;
    let refusal = ws.next_event("error").await;
    assert!(
        refusal["message"]
            .as_str()
            .unwrap()
            .contains("send it again later"),
        "{refusal}"
    );
    // Small messages are never held back.
    assert_eq!(text_of(&ws.chat("small").await), "small");
    // Once one holder's frame is read whole (and answered), its bytes are free again.
    let mut holder = holders.pop().unwrap();
    holder.write(&[b' '; 1000]).await;
    while held() > 140_000 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "still held {}",
            held()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let echo = ws
        .chat_with(json!({ "type": "chat", "payload": { "text": text } }))
        .await;
    assert_eq!(text_of(&echo), text);
    drop(holders);
    bridge.shutdown().await;
}

/// A request's head on `addr` promising a body of `length` bytes, and all but the last
/// `short` of them: the connection holds what it sent until it sends the rest.
async fn held_body(
    addr: SocketAddr,
    path: &str,
    content_type: &str,
    length: usize,
    short: usize,
) -> TcpStream {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n\
         Authorization: Bearer tb-coder\r\nContent-Length: {length}\r\n\r\n"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(&vec![b' '; length - short]).await.unwrap();
    tcp
}

#[tokio::test]
async fn large_request_bodies_past_the_read_budget_are_refused_until_it_frees() {
    let bridge = start_bridge(
        "[limits]\nread_budget_bytes = 300000\nbody_read_timeout_ms = 600000\n\
         [skynet]\nlisten = \"127.0.0.1:0\"\n\
         [grid]\nlisten = \"127.0.0.1:0\"\n\
         [synapse]\nlisten = \"127.0.0.1:0\"\n",
    )
    .await;
    let http = common::http();
    let held = || 300_000 - bridge.read_budget().available();
    let paths = [
        ("skynet", "/api/agents"),
        ("tracker", "/api/v1/messages"),
        ("grid", "/grid/v1/messages"),
        ("synapse", "/api/v1/synapse/message"),
    ];
    for (protocol, path) in paths {
        let addr = bridge.addr(protocol).unwrap();
        let url = format!("http://{addr}{path}");
        let post = |bytes: usize| {
            http.post(&url)
                .bearer_auth("tb-coder")
                .header("content-type", "application/json")
                .body(" ".repeat(bytes))
                .send()
        };
        // One client sends 200 KB of a body and stops: what it sent holds the budget. (A
        // gRPC content type on an endpoint's own route does not let a body past it.)
        let content_type = if protocol == "grid" {
            "application/grpc"
        } else {
            "application/json"
        };
        let mut holder = held_body(addr, path, content_type, 201_000, 1000).await;
        let deadline = tokio::time::Instant::now() + WAIT;
        while held() < 200_000 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{protocol}: held only {}",
                held()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Another's large body does not fit in what is left: 503, in the endpoint's shape.
        let res = post(150_000).await.unwrap();
        assert_eq!(res.status(), 503, "{protocol}");
        assert_eq!(res.headers()["retry-after"], "1", "{protocol}");
        let body = res.text().await.unwrap();
        let said = match protocol {
            "skynet" => serde_json::from_str::<Value>(&body).unwrap()["error"].clone(),
            "tracker" => serde_json::from_str::<Value>(&body).unwrap()["detail"].clone(),
            "synapse" => {
                let body: Value = serde_json::from_str(&body).unwrap();
                assert_eq!(body["code"], 14, "UNAVAILABLE: {body}");
                body["message"].clone()
            }
            _ => {
                let body = yaml(&body);
                let error = &body["message"]["content"]["payload"];
                assert_eq!(error["error_code"], "BUSY", "{body:?}");
                Value::String(format!("{:?}", error["error_message"]))
            }
        };
        assert!(
            said.to_string().contains("send it again later"),
            "{protocol}: {body}"
        );
        assert!(held() < 210_000, "{protocol}: the refused body let go");
        // Small bodies are never held back.
        let (status, _) = answer(post(1000)).await;
        assert_ne!(status, 503, "{protocol}");
        // Once the holder's body is whole (and answered), its bytes are free again.
        holder.write_all(&[b' '; 1000]).await.unwrap();
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(WAIT, holder.read(&mut buf)).await;
        assert!(matches!(read, Ok(Ok(n)) if n > 0), "{protocol}: no answer");
        while held() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{protocol}: still held {}",
                held()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (status, _) = answer(post(150_000)).await;
        assert_ne!(status, 503, "{protocol}");
        // A body larger than the whole budget could never be taken: 413, not "later".
        let (status, body) = answer(post(310_000)).await;
        assert_eq!(status, 413, "{protocol}: {body}");
        assert!(
            body.contains("read budget of 300000 bytes"),
            "{protocol}: {body}"
        );
    }
    bridge.shutdown().await;
}

#[tokio::test]
async fn large_grpc_messages_past_the_read_budget_are_unavailable_until_it_frees() {
    use tokio_stream::StreamExt;
    use tokio_stream::wrappers::ReceiverStream;

    let bridge =
        start_bridge("[limits]\nread_budget_bytes = 300000\n[synapse]\nlisten = \"127.0.0.1:0\"\n")
            .await;
    let addr = bridge.addr("synapse").unwrap();
    let held = || 300_000 - bridge.read_budget().available();
    // A call over raw HTTP/2 whose one message (of 250,000 bytes) stops 50,000 short.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let (body_tx, body_rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    let body = ReceiverStream::new(body_rx).map(Ok::<_, std::convert::Infallible>);
    let call = axum::http::Request::post(format!(
        "http://{addr}/synapse.SynapseMessageService/SendMessage"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(axum::body::Body::from_stream(body))
    .unwrap();
    let answered = tokio::spawn(sender.send_request(call));
    let mut start = vec![0u8];
    start.extend(250_000u32.to_be_bytes());
    start.extend([b' '; 200_000]);
    body_tx.send(start.into()).await.unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while held() < 200_000 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "held only {}",
            held()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let mut clients = common::synapse::clients(addr).await;
    let large = || common::synapse::chat("a", "b", &"q".repeat(150_000));
    let refused = common::synapse::send(&mut clients, large())
        .await
        .expect_err("over the budget");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains("send it again later"),
        "{refused:?}"
    );
    // Small messages are never held back.
    let small = common::synapse::send(&mut clients, common::synapse::chat("a", "b", "hi")).await;
    assert_eq!(small.map_err(|s| s.code()), Err(tonic::Code::NotFound));
    // Once the held message is whole and handled, its bytes are free again.
    body_tx.send(vec![b' '; 50_000].into()).await.unwrap();
    drop(body_tx);
    let answer = tokio::time::timeout(WAIT, answered).await;
    assert!(matches!(answer, Ok(Ok(Ok(_)))), "{answer:?}");
    while held() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "still held {}",
            held()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Read and answered: the receiver, `b`, is no agent.
    let sent = common::synapse::send(&mut clients, large()).await;
    assert_eq!(sent.map_err(|s| s.code()), Err(tonic::Code::NotFound));

    // On an open stream, a message over the budget ends the stream with the status, not
    // with a clean close its sender would read as delivered.
    let mut stream = common::synapse::Stream::open(addr, "streamer").await;
    let holder = bridge.read_budget().try_reserve(250_000).unwrap();
    stream
        .send(common::synapse::chat("streamer", "b", &"s".repeat(100_000)))
        .await;
    let ended = tokio::time::timeout(WAIT, async {
        loop {
            match stream.inbound.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the stream ends");
    let status = ended.expect_err("ended with a status");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    drop(holder);

    // A message larger than the whole budget is refused by its length alone.
    let refused = common::synapse::send(
        &mut clients,
        common::synapse::chat("a", "b", &"z".repeat(310_000)),
    )
    .await
    .expect_err("larger than the budget");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    bridge.shutdown().await;
}

// ---- 6. Authorization ---------------------------------------------------------------------

#[tokio::test]
async fn tracker_authorship_and_member_creation_follow_the_token() {
    let bridge = start_bridge("").await;
    let addr = bridge.addr("tracker").unwrap();
    let coder = TrackerHttp::new(addr, "tb-coder");
    let admin = TrackerHttp::new(addr, "tb-admin");
    let (_, ok) = TrackerWs::auth(addr, "tb-quiet").await;
    let lobby = ok["lobby_chat_id"].clone();
    for forged in ["system", "human"] {
        let (status, body) = coder
            .post(
                "/messages",
                json!({ "chat_id": lobby, "content": "x", "author_type": forged }),
            )
            .await;
        assert_eq!(status, 403, "{forged}: {body}");
    }
    let (status, posted) = coder
        .post(
            "/messages",
            json!({ "chat_id": lobby, "content": "x", "author_type": "agent" }),
        )
        .await;
    assert_eq!((status, &posted["author_type"]), (201, &json!("agent")));

    let (status, body) = coder
        .post("/members", json!({ "slug": "minted", "kind": "human" }))
        .await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = admin
        .post("/members", json!({ "slug": "minted", "kind": "agent" }))
        .await;
    assert_eq!(status, 201, "{body}");
    bridge.shutdown().await;
}

#[tokio::test]
async fn synapse_calls_without_a_valid_token_are_always_unauthenticated() {
    use agentbridge::protocols::synapse::proto::synapse_message_service_client::SynapseMessageServiceClient;
    use tokio_stream::wrappers::ReceiverStream;
    use tonic::Code;

    let bridge = start_bridge("[synapse]\nlisten = \"127.0.0.1:0\"\ntoken = \"letmein\"\n").await;
    let addr = bridge.addr("synapse").unwrap();
    let channel = common::synapse::channel(addr).await;
    for i in 0..30 {
        let mut client = SynapseMessageServiceClient::new(channel.clone());
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        // The client is still sending when it is refused.
        tx.send(common::synapse::chat("a", "b", "hi"))
            .await
            .unwrap();
        let meta: &[(&str, &str)] = if i % 2 == 0 {
            &[]
        } else {
            &[("authorization", "Bearer wrong")]
        };
        let request = common::synapse::with_meta(ReceiverStream::new(rx), meta);
        let answer = tokio::time::timeout(WAIT, client.stream_messages(request))
            .await
            .expect("answered");
        let code = match answer {
            Err(status) => status.code(),
            Ok(response) => {
                let mut inbound = response.into_inner();
                match tokio::time::timeout(WAIT, inbound.message()).await.unwrap() {
                    Err(status) => status.code(),
                    Ok(_) => Code::Ok,
                }
            }
        };
        assert_eq!(code, Code::Unauthenticated, "call {i}");
        drop(tx);
    }
    bridge.shutdown().await;
}

/// The same with gRPC's own Python client (C-core), which reports `INTERNAL "Internal
/// error from Core"` when a stream reset races the refusal.
#[tokio::test]
async fn synapse_unauthenticated_streams_are_unauthenticated_for_grpcs_python_client() {
    let python = common::tools::python_with(&["grpc"], &["grpcio"]);
    let bridge = start_bridge("[synapse]\nlisten = \"127.0.0.1:0\"\ntoken = \"letmein\"\n").await;
    let addr = bridge.addr("synapse").unwrap();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/clients/synapse_unauthenticated.py"
    );
    let mut child = tokio::process::Command::new(python)
        .arg(script)
        .arg(addr.to_string())
        .arg("30")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python runs");
    // Read as it prints, so that a client that does not end still says how far it got.
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut printed = Vec::new();
    let read_all = async {
        while let Ok(Some(line)) = lines.next_line().await {
            printed.push(line);
        }
        child.wait().await
    };
    let status = tokio::time::timeout(Duration::from_secs(120), read_all).await;
    let status = status.unwrap_or_else(|_| panic!("the client ends; it printed {printed:?}"));
    assert!(status.is_ok_and(|s| s.success()), "{printed:?}");
    let codes: Vec<&str> = printed
        .iter()
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    assert_eq!(codes.len(), 30, "{printed:?}");
    assert!(codes.iter().all(|c| *c == "UNAUTHENTICATED"), "{printed:?}");
    bridge.shutdown().await;
}

#[tokio::test]
async fn synapse_an_oversized_grpc_message_is_resource_exhausted() {
    use tonic::Code;
    let bridge =
        start_bridge("[synapse]\nlisten = \"127.0.0.1:0\"\nmax_message_bytes = 2000\n").await;
    let mut clients = common::synapse::clients(bridge.addr("synapse").unwrap()).await;
    let message = common::synapse::chat("a", "b", &"m".repeat(5000));
    let err = common::synapse::send(&mut clients, message)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    bridge.shutdown().await;
}

// ---- 7. A reader slower than a burst loses nothing, or is told ----------------------

/// The text of the `i`th chat of a burst: 64 KB, so that a reader that does not read
/// soon fills the sockets' buffers and its messages wait at the bridge.
fn burst_text(i: usize) -> String {
    format!("m{i} {}", "~".repeat(64 * 1024))
}

/// Sends `count` chats from a Skynet agent as fast as their echoes come back: the sender
/// keeps up with its own echoes, and a recipient that reads nothing falls behind.
async fn burst(ws: &mut SkynetWs, count: usize) {
    for i in 0..count {
        ws.action(
            "send",
            json!({ "type": "chat", "payload": { "text": burst_text(i) } }),
        )
        .await;
        let echo = next_chat(ws).await;
        assert!(text_of(&echo).starts_with(&format!("m{i} ")));
    }
}

/// A Skynet human that reads nothing until told to, over a narrow socket, and the agent
/// that bursts at it.
async fn watcher_and_burster(bridge: &agentbridge::Bridge) -> (SkynetWs, SkynetWs) {
    let addr = bridge.addr("skynet").unwrap();
    let http = SkynetHttp::new(addr);
    let (agent, human) = (http.agent("burster").await, http.human("watcher").await);
    let watcher = SkynetWs::join_narrow(addr, &human).await;
    let (sender, _) = SkynetWs::join(addr, &agent).await;
    (watcher, sender)
}

/// The next chat a Skynet member receives, skipping presence.
async fn next_chat(ws: &mut SkynetWs) -> Value {
    loop {
        let message = ws.next_message().await;
        if message["type"] == "chat" {
            return message;
        }
    }
}

#[tokio::test]
async fn a_burst_five_times_the_mailbox_reaches_a_slow_reader_whole_and_in_order() {
    let bridge = start_bridge("[routing]\nmailbox_capacity = 64\n").await;
    // The human and the Tracker listener read nothing until the burst is over: what their
    // sockets cannot take waits at the bridge, past their mailboxes.
    let (mut watcher, mut sender) = watcher_and_burster(&bridge).await;
    let tracker = bridge.addr("tracker").unwrap();
    let mut listener = TrackerWs::auth_narrow(tracker, "tb-listener").await;
    burst(&mut sender, 320).await;
    for i in 0..320 {
        assert_eq!(text_of(&next_chat(&mut watcher).await), burst_text(i));
        assert_eq!(listener.next_content().await, burst_text(i));
    }
    bridge.shutdown().await;
}

#[tokio::test]
async fn drop_policies_tell_the_recipient_how_many_were_dropped() {
    let bridge =
        start_bridge("[routing]\nmailbox_capacity = 16\nwhen_full = \"drop_oldest\"\n").await;
    let (mut watcher, mut sender) = watcher_and_burster(&bridge).await;
    burst(&mut sender, 100).await;
    let (mut delivered, mut told) = (0, 0);
    while delivered + told < 100 {
        let frame = watcher.next().await;
        if frame["event"] == "error" {
            let text = frame["data"]["message"].as_str().unwrap();
            told += text.split(' ').next().unwrap().parse::<usize>().unwrap();
        } else if frame["type"] == "chat" {
            delivered += 1;
        }
    }
    assert_eq!(delivered + told, 100);
    assert!(told > 0, "a burst over the mailbox dropped something");
    bridge.shutdown().await;
}

#[tokio::test]
async fn a_reader_further_behind_than_the_backlog_is_closed_to_replay() {
    let bridge = start_bridge("[routing]\nmailbox_capacity = 4\nbacklog_limit = 8\n").await;
    let (mut watcher, mut sender) = watcher_and_burster(&bridge).await;
    burst(&mut sender, 100).await;
    // `closed` is bounded by the wait itself.
    let close = watcher.closed().await.expect("a close frame");
    assert_eq!(u16::from(close.code), 1008);
    assert!(close.reason.contains("reconnect to replay"), "{close:?}");
    bridge.shutdown().await;
}

#[tokio::test]
async fn synapse_tasks_waiting_for_an_agent_are_bounded() {
    use agentbridge::protocols::synapse::proto::SubmitTaskRequest;
    use tonic::{Code, Request};
    let bridge = start_bridge("[synapse]\nlisten = \"127.0.0.1:0\"\nmax_waiting_tasks = 2\n").await;
    let mut clients = common::synapse::clients(bridge.addr("synapse").unwrap()).await;
    let submit = |i: usize| SubmitTaskRequest {
        task_type: "nobody-takes-this".into(),
        external_task_id: format!("ext-{i}"),
        priority: "normal".into(),
        ..Default::default()
    };
    for i in 0..2 {
        clients
            .tasks
            .submit_task(Request::new(submit(i)))
            .await
            .unwrap();
    }
    let err = clients
        .tasks
        .submit_task(Request::new(submit(2)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    bridge.shutdown().await;
}

// ---- Deeply nested payloads: refused, or kept whole ------------------------------------

/// A payload nested as deep as a JSON reader takes (127 levels, alone) is either refused
/// in the sender's protocol or kept: once echoed to its sender, it is in the history that
/// replays read, however deep the store's own wrapping takes it.
#[tokio::test]
async fn a_deeply_nested_payload_echoed_to_its_sender_is_in_the_history() {
    let bridge = start_bridge("[skynet]\nlisten = \"127.0.0.1:0\"\n").await;
    let addr = bridge.addr("skynet").unwrap();
    let http = SkynetHttp::new(addr);
    let card = http.agent("diver").await;
    let (mut ws, _) = SkynetWs::join(addr, &card).await;
    ws.send_text(common::skynet::deep_share("deep-1", &[]))
        .await;
    let answer = ws.next_text().await;
    if answer.contains("\"event\":\"error\"") {
        // Refused, and said so: nothing was accepted.
        bridge.shutdown().await;
        return;
    }
    assert!(answer.contains("deep-1"), "the echo: {answer:.200}");
    let (status, history) = http.get_text("/api/messages?limit=10").await;
    assert_eq!(status, 200);
    assert!(
        history.contains("deep-1"),
        "not in the history: {history:.300}"
    );
    bridge.shutdown().await;
}

/// A small Grid body whose aliases would expand it into a message of megabytes is refused,
/// in the Grid's error shape, rather than relayed to every program.
#[tokio::test]
async fn a_grid_body_whose_aliases_expand_it_many_times_over_is_refused() {
    let bridge = start_bridge("[grid]\nlisten = \"127.0.0.1:0\"\n").await;
    let http = common::grid::GridHttp::new(bridge.addr("grid").unwrap());
    let ten = |of: &str| vec![format!("*{of}"); 10].join(", ");
    let body = format!(
        "message:\n  type: notification\n  timestamp: 2026-01-01T00:00:00Z\n  sender: {{agent: x}}\n  content:\n    payload:\n      a: &a \"{}\"\n      b: &b [{}]\n      c: &c [{}]\n      d: &d [{}]\n      e: [{}]\n",
        "x".repeat(1000),
        ten("a"),
        ten("b"),
        ten("c"),
        ten("d"),
    );
    assert!(body.len() < 2_000, "{} bytes", body.len());
    let (status, answer) = http.post(&body).await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["message"]["type"], "error", "{answer}");
    bridge.shutdown().await;
}
