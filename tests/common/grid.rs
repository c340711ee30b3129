//! A Grid program's clients, written from grid-message-protocol.md: YAML over HTTP and
//! over a WebSocket.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;

use super::http;
use super::ws::TestSocket;

pub fn yaml(text: &str) -> Value {
    serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("not YAML ({e}): {text}"))
}

/// `text` with a `timestamp` stamped on each message that lacks one, as the document asks
/// every sender to include; text that does not parse is returned as it is.
pub fn stamped(text: &str) -> String {
    let Ok(mut docs) = serde_saphyr::from_multiple::<Value>(text) else {
        return text.to_owned();
    };
    let now = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .expect("now formats");
    let mut changed = false;
    for doc in &mut docs {
        if let Some(Value::Object(msg)) = doc.get_mut("message")
            && !msg.contains_key("timestamp")
        {
            msg.insert("timestamp".into(), Value::String(now.clone()));
            changed = true;
        }
    }
    if !changed {
        return text.to_owned();
    }
    docs.iter()
        .filter(|d| !d.is_null())
        .map(|d| format!("---\n{}", serde_saphyr::to_string(d).expect("yaml")))
        .collect()
}

pub fn yaml_stream(text: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(text)
        .unwrap_or_else(|e| panic!("not a YAML stream ({e}): {text}"))
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

pub struct GridHttp {
    base: String,
    client: reqwest::Client,
}

impl GridHttp {
    pub fn new(addr: SocketAddr) -> Self {
        GridHttp {
            base: format!("http://{addr}/grid/v1"),
            client: http(),
        }
    }

    /// Posts a YAML body; returns the status and the YAML answer.
    pub async fn post(&self, body: &str) -> (u16, Value) {
        let res = self
            .client
            .post(format!("{}/messages", self.base))
            .header("content-type", "application/yaml")
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let text = res.text().await.unwrap();
        (status, yaml(&text))
    }

    /// Posts (stamping a timestamp where one is missing); whether it was accepted. Refused,
    /// or no bridge answering, is `false`.
    pub async fn try_send(&self, body: &str) -> bool {
        let res = (self.client)
            .post(format!("{}/messages", self.base))
            .header("content-type", "application/yaml")
            .body(stamped(body))
            .send()
            .await;
        res.is_ok_and(|res| res.status().as_u16() == 202)
    }

    pub async fn post_json(&self, body: Value) -> (u16, Value) {
        let res = self
            .client
            .post(format!("{}/messages", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        (res.status().as_u16(), res.json().await.unwrap())
    }

    /// Posts (stamping a timestamp where one is missing) and expects it accepted; returns
    /// the accepted ids.
    pub async fn send(&self, body: &str) -> Vec<String> {
        let (status, answer) = self.post(&stamped(body)).await;
        assert_eq!(status, 202, "{answer}");
        answer["accepted"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| id.as_str().unwrap().to_owned())
            .collect()
    }

    /// The `message:` objects waiting for `agent`.
    pub async fn poll(&self, query: &str) -> Vec<Value> {
        let res = self
            .client
            .get(format!("{}/messages?{query}", self.base))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status().as_u16(), 200);
        let text = res.text().await.unwrap();
        yaml_stream(&text)
            .into_iter()
            .map(|d| d["message"].clone())
            .collect()
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let res = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let text = res.text().await.unwrap();
        (status, yaml(&text))
    }
}

pub struct GridWs {
    socket: TestSocket,
}

impl GridWs {
    /// Lets each read wait up to `wait` (`TestSocket::wait_up_to`).
    pub fn wait_up_to(&mut self, wait: std::time::Duration) {
        self.socket.wait_up_to(wait);
    }

    /// Connects as `agent` (identified by the query), asking for presence, and reads the
    /// welcome (`agents_present`).
    pub async fn connect(addr: SocketAddr, agent: &str, instance: Option<&str>) -> (Self, Value) {
        let mut ws = Self::open(&format!("{}&presence=1", Self::url(addr, agent, instance))).await;
        let welcome = ws.next().await;
        assert_eq!(welcome["content"]["action"], "agents_present", "{welcome}");
        (ws, welcome)
    }

    /// As `connect`, again and again while the name is refused as taken (its holder's
    /// bridge is gone, and the fleet does not yet let the name go), as a program that
    /// reconnects would; within `WAIT`.
    pub async fn connect_once_free(addr: SocketAddr, agent: &str) -> Self {
        Self::connect_once_free_within(addr, agent, super::WAIT).await
    }

    /// As `connect_once_free`, waiting up to `wait` for the name to be free.
    pub async fn connect_once_free_within(
        addr: SocketAddr,
        agent: &str,
        wait: std::time::Duration,
    ) -> Self {
        let deadline = std::time::Instant::now() + wait;
        loop {
            let mut ws = Self::open(&format!("{}&presence=1", Self::url(addr, agent, None))).await;
            // Refused with an error report, then a close.
            let first = ws.socket.next_text_or_close().await;
            let welcome = first.as_deref().map(|text| yaml(text)["message"].clone());
            match welcome {
                Ok(welcome) if welcome["content"]["action"] == "agents_present" => return ws,
                refused => assert!(
                    std::time::Instant::now() < deadline,
                    "{agent} still refused: {refused:?}"
                ),
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Connects as `agent` without asking for presence: only messages arrive.
    pub async fn quiet(addr: SocketAddr, agent: &str, instance: Option<&str>) -> Self {
        Self::open(&Self::url(addr, agent, instance)).await
    }

    /// As `quiet`, over a socket with a small receive buffer (`TestSocket::connect_narrow`):
    /// what the client does not read soon waits at the bridge.
    pub async fn quiet_narrow(addr: SocketAddr, agent: &str) -> Self {
        GridWs {
            socket: TestSocket::connect_narrow(&Self::url(addr, agent, None)).await,
        }
    }

    fn url(addr: SocketAddr, agent: &str, instance: Option<&str>) -> String {
        let mut url = format!("ws://{addr}/grid/v1/ws?agent={agent}");
        if let Some(instance) = instance {
            url.push_str(&format!("&instance_id={instance}"));
        }
        url
    }

    async fn open(url: &str) -> Self {
        GridWs {
            socket: TestSocket::connect(url).await,
        }
    }

    /// Connects without identifying.
    pub async fn anonymous(addr: SocketAddr) -> Self {
        Self::open(&format!("ws://{addr}/grid/v1/ws")).await
    }

    /// Sends a frame, stamping a timestamp on messages that lack one.
    pub async fn send(&mut self, yaml_text: &str) {
        self.send_raw(&stamped(yaml_text)).await;
    }

    /// Sends a frame as it is.
    pub async fn send_raw(&mut self, yaml_text: &str) {
        self.socket.send_text(yaml_text).await;
    }

    /// Closes the socket; the `message:` objects the bridge sent before it saw the close.
    pub async fn close_reading(self) -> Vec<Value> {
        let texts = self.socket.close_reading().await;
        texts
            .iter()
            .map(|text| yaml(text)["message"].clone())
            .collect()
    }

    /// Every `message:` object the bridge sent until the socket ended (the bridge went).
    pub async fn read_until_closed(&mut self) -> Vec<Value> {
        let mut messages = Vec::new();
        while let Ok(text) = self.socket.next_text_or_close().await {
            messages.push(yaml(&text)["message"].clone());
        }
        messages
    }

    /// The next frame's `message:` object.
    pub async fn next(&mut self) -> Value {
        yaml(&self.socket.next_text().await)["message"].clone()
    }

    /// The next message that is not a presence notification; `None` once the bridge
    /// closes the socket.
    pub async fn next_message_or_closed(&mut self) -> Option<Value> {
        loop {
            let msg = yaml(&self.socket.next_text_or_close().await.ok()?)["message"].clone();
            if !is_presence(&msg) {
                return Some(msg);
            }
        }
    }

    /// The next message that is not a presence notification.
    pub async fn next_message(&mut self) -> Value {
        loop {
            let msg = self.next().await;
            if !is_presence(&msg) {
                return msg;
            }
        }
    }
}

/// Whether a `message:` object is a presence notification (`agent_online`, `agent_offline`).
fn is_presence(msg: &Value) -> bool {
    let action = msg["content"]["action"].as_str().unwrap_or_default();
    action == "agent_online" || action == "agent_offline"
}

/// The longest a flooded reader waits for the next message before it takes the rest for
/// lost: on a busy machine the bridge it reconnected to may take seconds to keep, then
/// hand it, the hundreds of messages a killed bridge left (one record write each).
pub const QUIET_AT_MOST: Duration = Duration::from_secs(20);

/// The number of a numbered message (`m<n>`).
pub fn numbered(message: &Value) -> Option<usize> {
    message["id"].as_str()?.strip_prefix('m')?.parse().ok()
}

/// Reads `socket`, a socket of `agent` on the bridge at `addr`, until `got` holds every
/// number `wanted` holds, or nothing comes for `QUIET_AT_MOST`. A socket the bridge closes
/// (too far behind, on a busy machine) is opened again, as its program would: what it had
/// not sent is kept for the program, in order.
pub async fn read_until_got(
    socket: &mut GridWs,
    (addr, agent): (std::net::SocketAddr, &str),
    got: &mut Vec<usize>,
    wanted: &std::collections::HashSet<usize>,
) {
    let mut seen: std::collections::HashSet<usize> = got.iter().copied().collect();
    // The wait below is the one that ends the reading, not the socket's own.
    socket.wait_up_to(2 * QUIET_AT_MOST);
    while !wanted.is_subset(&seen) {
        let next = socket.next_message_or_closed();
        let Ok(next) = tokio::time::timeout(QUIET_AT_MOST, next).await else {
            break;
        };
        let Some(message) = next else {
            *socket = GridWs::connect_once_free(addr, agent).await;
            socket.wait_up_to(2 * QUIET_AT_MOST);
            continue;
        };
        if let Some(n) = numbered(&message) {
            seen.insert(n);
            got.push(n);
        }
    }
}

/// The numbers `got` holds more than once, each once, in order.
pub fn got_twice(got: &[usize]) -> Vec<usize> {
    let mut counts = std::collections::BTreeMap::new();
    for n in got {
        *counts.entry(*n).or_insert(0) += 1;
    }
    counts
        .into_iter()
        .filter(|(_, count)| *count > 1)
        .map(|(n, _)| n)
        .collect()
}
