//! A minimal Skynet client, written from the protocol documents: HTTP registration and the
//! `{action, data}` WebSocket.

use std::net::SocketAddr;

use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::protocol::CloseFrame;

use super::ws::TestSocket;
use super::{http, http_url, ws_url};

pub struct SkynetHttp {
    pub base: String,
    client: reqwest::Client,
}

impl SkynetHttp {
    pub fn new(addr: SocketAddr) -> Self {
        SkynetHttp {
            base: http_url(addr),
            client: http(),
        }
    }

    /// A GET's status and body as the server wrote it.
    pub async fn get_text(&self, path: &str) -> (u16, String) {
        let res = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("request");
        (res.status().as_u16(), res.text().await.expect("body"))
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let (status, body) = self.get_text(path).await;
        (status, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    /// A request's status and JSON answer (`null` when it has none).
    async fn answer(&self, request: reqwest::RequestBuilder) -> (u16, Value) {
        let res = request.send().await.unwrap();
        let status = res.status().as_u16();
        (status, res.json().await.unwrap_or(Value::Null))
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.answer(self.client.post(self.url(path)).json(&body))
            .await
    }

    pub async fn post_raw(&self, path: &str, body: &'static str) -> (u16, Value) {
        let request = (self.client.post(self.url(path)))
            .header("content-type", "application/json")
            .body(body);
        self.answer(request).await
    }

    pub async fn patch(&self, path: &str, body: Value) -> (u16, Value) {
        self.answer(self.client.patch(self.url(path)).json(&body))
            .await
    }

    pub async fn delete(&self, path: &str) -> (u16, Value) {
        self.answer(self.client.delete(self.url(path))).await
    }

    /// Registers an agent and returns its card.
    pub async fn agent(&self, name: &str) -> Value {
        let (status, card) = self
            .post(
                "/api/agents",
                json!({ "name": name, "type": "claude-code" }),
            )
            .await;
        assert_eq!(status, 201, "registering {name}: {card}");
        card
    }

    /// Registers a human and returns its profile, shaped as a card for joining.
    pub async fn human(&self, name: &str) -> Value {
        let (status, profile) = self.post("/api/humans", json!({ "name": name })).await;
        assert_eq!(status, 201, "registering {name}: {profile}");
        json!({ "id": profile["id"], "name": name, "type": "human", "status": "idle" })
    }
}

pub struct SkynetWs {
    socket: TestSocket,
}

impl SkynetWs {
    /// Lets each read wait up to `wait` (`TestSocket::wait_up_to`).
    pub fn wait_up_to(&mut self, wait: std::time::Duration) {
        self.socket.wait_up_to(wait);
    }

    pub async fn connect(addr: SocketAddr) -> Self {
        SkynetWs {
            socket: TestSocket::connect(&ws_url(addr, "/ws")).await,
        }
    }

    /// Joins as `card` over a socket with a small receive buffer (`TestSocket::connect_narrow`).
    pub async fn join_narrow(addr: SocketAddr, card: &Value) -> Self {
        let mut ws = SkynetWs {
            socket: TestSocket::connect_narrow(&ws_url(addr, "/ws")).await,
        };
        ws.rejoin(card, None).await;
        ws
    }

    /// Connects, joins as `card`, and returns the client with its `workspace.state` data.
    pub async fn join(addr: SocketAddr, card: &Value) -> (Self, Value) {
        Self::join_since(addr, card, None).await
    }

    pub async fn join_since(addr: SocketAddr, card: &Value, since: Option<i64>) -> (Self, Value) {
        let mut ws = Self::connect(addr).await;
        let state = ws.rejoin(card, since).await;
        (ws, state)
    }

    /// Sends a join on this socket and waits for `workspace.state`.
    pub async fn rejoin(&mut self, card: &Value, since: Option<i64>) -> Value {
        let mut data = json!({ "agent": card });
        if let Some(since) = since {
            data["lastSeenTimestamp"] = json!(since);
        }
        self.action("join", data).await;
        let state = self.next().await;
        assert_eq!(
            state["event"], "workspace.state",
            "join answered with {state}"
        );
        state["data"].clone()
    }

    pub async fn action(&mut self, action: &str, data: Value) {
        self.send_text(json!({ "action": action, "data": data }).to_string())
            .await;
    }

    pub async fn send_text(&mut self, text: String) {
        self.socket.send_text(text).await;
    }

    /// Sends a chat and returns the echo the server sends back.
    pub async fn chat(&mut self, text: &str) -> Value {
        self.chat_with(json!({ "type": "chat", "payload": { "text": text } }))
            .await
    }

    /// Sends `message` (a partial SkynetMessage) and returns its echo.
    pub async fn chat_with(&mut self, message: Value) -> Value {
        self.action("send", message).await;
        self.next_message().await
    }

    /// The next frame, as JSON (events and messages alike).
    /// Sends a chat and reads up to its echo, failing on any `error` event before it: what
    /// was sent before drew none.
    pub async fn no_error_before_a_sentinel(&mut self) {
        let sentinel = json!({ "type": "chat", "payload": { "text": "sentinel" } });
        self.action("send", sentinel).await;
        loop {
            let frame = self.next().await;
            assert_ne!(frame["event"], "error", "{frame}");
            if frame["type"] == "chat" {
                assert_eq!(text_of(&frame), "sentinel");
                return;
            }
        }
    }

    pub async fn next(&mut self) -> Value {
        serde_json::from_str(&self.next_text().await).expect("JSON frame")
    }

    /// The next frame as the server wrote it.
    pub async fn next_text(&mut self) -> String {
        self.socket.next_text().await
    }

    /// The next bare SkynetMessage, skipping `status-change` events.
    pub async fn next_message(&mut self) -> Value {
        loop {
            let frame = self.next().await;
            if frame.get("event").is_none() {
                return frame;
            }
            if frame["event"] == "status-change" {
                continue;
            }
            panic!("expected a message, got event {frame}");
        }
    }

    /// The next frame that is the event `name`.
    pub async fn next_event(&mut self, name: &str) -> Value {
        let frame = self.next().await;
        assert_eq!(frame["event"], name, "expected event {name}, got {frame}");
        frame["data"].clone()
    }

    /// Waits for the server to close the socket and returns the close frame.
    pub async fn closed(&mut self) -> Option<CloseFrame> {
        self.socket.closed().await
    }

    pub async fn close(self) {
        self.socket.close().await;
    }
}

/// A chat message's text.
pub fn text_of(msg: &Value) -> &str {
    msg["payload"]["text"].as_str().unwrap_or_default()
}

/// A `send` frame, `id`, of a `context.share` whose payload nests 127 levels, as deep as a
/// JSON reader takes it alone, and `mentions` (card ids, as JSON).
pub fn deep_share(id: &str, mentions: &[Value]) -> String {
    let deep = format!("{}1{}", "[".repeat(126), "]".repeat(126));
    let mentions = Value::from(mentions.to_vec());
    format!(
        "{{\"action\":\"send\",\"data\":{{\"id\":\"{id}\",\"type\":\"context.share\",\"mentions\":{mentions},\"payload\":{{\"d\":{deep}}}}}}}"
    )
}
