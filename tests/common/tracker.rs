//! A minimal Tracker agent, written from tracker-agent-protocol.md: REST with a bearer
//! token, and the `{"type": …}` WebSocket.

use std::net::SocketAddr;

use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::protocol::CloseFrame;

use super::ws::TestSocket;
use super::{http, http_url, ws_url};

/// The `[tracker]` test section with `keys` added (e.g. `heartbeat_timeout_ms = 200`).
pub fn section_with(keys: &str) -> String {
    format!("[tracker]\n{keys}\n{}", super::TRACKER_SECTION)
}

#[derive(Clone)]
pub struct TrackerHttp {
    pub base: String,
    pub token: Option<String>,
    client: reqwest::Client,
}

impl TrackerHttp {
    pub fn new(addr: SocketAddr, token: &str) -> Self {
        TrackerHttp {
            base: format!("{}/api/v1", http_url(addr)),
            token: Some(token.to_owned()),
            client: http(),
        }
    }

    /// Waits up to `wait` for each answer (a write held up by a NATS failover, say).
    pub fn waiting_up_to(self, wait: std::time::Duration) -> Self {
        let _ = http();
        let client = reqwest::Client::builder().timeout(wait).build();
        TrackerHttp {
            client: client.expect("http client"),
            ..self
        }
    }

    pub fn anonymous(addr: SocketAddr) -> Self {
        TrackerHttp {
            token: None,
            ..Self::new(addr, "")
        }
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let builder = self.client.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => builder.bearer_auth(token),
            None => builder,
        }
    }

    async fn finish(builder: reqwest::RequestBuilder) -> (u16, Value) {
        let res = builder.send().await.unwrap();
        let status = res.status().as_u16();
        (status, res.json().await.unwrap_or(Value::Null))
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        Self::finish(self.request(reqwest::Method::GET, path)).await
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        Self::finish(self.request(reqwest::Method::POST, path).json(&body)).await
    }

    /// As `post`; `None` when the bridge does not answer (it was killed).
    pub async fn try_post(&self, path: &str, body: Value) -> Option<(u16, Value)> {
        let sent = self.request(reqwest::Method::POST, path).json(&body).send();
        let answer = sent.await.ok()?;
        let status = answer.status().as_u16();
        Some((status, answer.json().await.ok()?))
    }

    pub async fn post_raw(&self, path: &str, body: &'static str) -> (u16, Value) {
        Self::finish(
            self.request(reqwest::Method::POST, path)
                .header("content-type", "application/json")
                .body(body),
        )
        .await
    }

    pub async fn patch(&self, path: &str, body: Value) -> (u16, Value) {
        Self::finish(self.request(reqwest::Method::PATCH, path).json(&body)).await
    }

    pub async fn delete(&self, path: &str) -> (u16, Value) {
        Self::finish(self.request(reqwest::Method::DELETE, path)).await
    }

    /// Uploads `data` as the multipart `file` part.
    pub async fn upload(
        &self,
        path: &str,
        filename: &str,
        mime: &str,
        data: Vec<u8>,
    ) -> (u16, Value) {
        let part = reqwest::multipart::Part::bytes(data)
            .file_name(filename.to_owned())
            .mime_str(mime)
            .unwrap();
        let form = reqwest::multipart::Form::new().part("file", part);
        Self::finish(self.request(reqwest::Method::POST, path).multipart(form)).await
    }

    /// Raw bytes and content type of a download.
    pub async fn download(&self, path: &str) -> (u16, String, Vec<u8>) {
        let res = self
            .request(reqwest::Method::GET, path)
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let mime = res
            .headers()
            .get("content-type")
            .map(|h| h.to_str().unwrap().to_owned())
            .unwrap_or_default();
        (status, mime, res.bytes().await.unwrap().to_vec())
    }

    /// Creates a task in `project` and returns it.
    pub async fn task(&self, project: &str, body: Value) -> Value {
        let (status, task) = self
            .post(&format!("/tasks?project_slug={project}"), body)
            .await;
        assert_eq!(status, 201, "creating a task: {task}");
        task
    }

    /// Posts a message and returns it.
    pub async fn message(&self, body: Value) -> Value {
        let (status, msg) = self.post("/messages", body).await;
        assert_eq!(status, 201, "posting a message: {msg}");
        msg
    }
}

pub struct TrackerWs {
    socket: TestSocket,
}

impl TrackerWs {
    pub async fn connect(addr: SocketAddr) -> Self {
        TrackerWs {
            socket: TestSocket::connect(&ws_url(addr, "/ws")).await,
        }
    }

    /// Authenticates over a socket with a small receive buffer (`TestSocket::connect_narrow`).
    pub async fn auth_narrow(addr: SocketAddr, token: &str) -> Self {
        let mut ws = TrackerWs {
            socket: TestSocket::connect_narrow(&ws_url(addr, "/ws")).await,
        };
        ws.send(json!({ "type": "auth", "token": token })).await;
        let ok = ws.next().await;
        assert_eq!(ok["type"], "auth.ok", "auth answered with {ok}");
        ws
    }

    /// Connects and authenticates; returns the client and the `auth.ok` data.
    pub async fn auth(addr: SocketAddr, token: &str) -> (Self, Value) {
        let mut ws = Self::connect(addr).await;
        ws.send(json!({ "type": "auth", "token": token })).await;
        let ok = ws.next().await;
        assert_eq!(ok["type"], "auth.ok", "auth answered with {ok}");
        (ws, ok["data"].clone())
    }

    /// Authenticates and subscribes to every project.
    pub async fn auth_subscribed(addr: SocketAddr, token: &str) -> (Self, Value) {
        let (mut ws, ok) = Self::auth(addr, token).await;
        for project in ok["projects"].as_array().unwrap() {
            ws.send(json!({ "type": "project.subscribe", "project_id": project["id"] }))
                .await;
        }
        ws.settle().await;
        (ws, ok)
    }

    /// Returns once the frames sent before are handled: the Tracker acknowledges neither
    /// subscriptions nor heartbeats, but answers an unknown frame, in order.
    pub async fn settle(&mut self) {
        self.send(json!({ "type": "settle" })).await;
        loop {
            let frame = self.next().await;
            if frame["type"] == "error" {
                assert!(frame.to_string().contains("settle"), "{frame}");
                return;
            }
            assert_eq!(frame["type"], "agent.status", "unexpected {frame}");
        }
    }

    pub async fn send(&mut self, frame: Value) {
        self.send_text(frame.to_string()).await;
    }

    pub async fn send_text(&mut self, text: String) {
        self.socket.send_text(text).await;
    }

    pub async fn next(&mut self) -> Value {
        serde_json::from_str(&self.next_text().await).expect("JSON frame")
    }

    /// The next frame as the bridge wrote it.
    pub async fn next_text(&mut self) -> String {
        self.socket.next_text().await
    }

    /// The next frame of type `kind`, skipping `agent.status` frames when `kind` is another.
    pub async fn next_of(&mut self, kind: &str) -> Value {
        loop {
            let frame = self.next().await;
            if frame["type"] == kind {
                return frame["data"].clone();
            }
            if frame["type"] == "agent.status" {
                continue;
            }
            panic!("expected {kind}, got {frame}");
        }
    }

    /// The next `message.new`'s content (skipping presence).
    pub async fn next_content(&mut self) -> String {
        self.next_of("message.new").await["content"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    pub async fn closed(&mut self) -> Option<CloseFrame> {
        self.socket.closed().await
    }

    pub async fn close(self) {
        self.socket.close().await;
    }
}
