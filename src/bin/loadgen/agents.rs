//! Load agents: a sender and a receiver of each protocol, set up with only what the
//! protocol's documents give a client (Skynet HTTP registration and WebSocket, Tracker
//! members and WebSocket, Synapse `StreamMessages`, Grid WebSocket), plus the baselines'
//! plain WebSocket clients. A sender turns a marker text into one frame; a receiver yields
//! the frames that arrive, and the run scans them for markers.

use std::time::Duration;

use agentbridge::protocols::synapse::proto::synapse_message_service_client::SynapseMessageServiceClient;
use agentbridge::protocols::synapse::proto::{AgentEndpoint, MessageType, SynapseMessage};
use bytes::Bytes;
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;
pub type Error = String;

/// One HTTP client for every registration: connections are reused.
static HTTP: std::sync::LazyLock<reqwest::Client> = std::sync::LazyLock::new(reqwest::Client::new);

/// A protocol agentbridge speaks, as a load end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Skynet,
    Tracker,
    Synapse,
    Grid,
}

impl Proto {
    pub fn name(self) -> &'static str {
        match self {
            Proto::Skynet => "skynet",
            Proto::Tracker => "tracker",
            Proto::Synapse => "synapse",
            Proto::Grid => "grid",
        }
    }
}

/// Where a bridge's endpoints listen (`http://host:port` bases).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Endpoints {
    pub skynet: Option<String>,
    pub tracker: Option<String>,
    /// A Tracker member token allowed to create members (`POST /api/v1/members`).
    pub tracker_admin_token: Option<String>,
    pub synapse: Option<String>,
    pub grid: Option<String>,
}

impl Endpoints {
    pub fn base(&self, proto: Proto) -> Result<&str, Error> {
        let base = match proto {
            Proto::Skynet => &self.skynet,
            Proto::Tracker => &self.tracker,
            Proto::Synapse => &self.synapse,
            Proto::Grid => &self.grid,
        };
        base.as_deref()
            .ok_or_else(|| format!("no {} endpoint to connect to", proto.name()))
    }
}

fn ws_url(base: &str, path: &str) -> String {
    let rest = base
        .strip_prefix("http://")
        .or_else(|| base.strip_prefix("https://"))
        .unwrap_or(base);
    format!("ws://{}{path}", rest.trim_end_matches('/'))
}

/// The kernel receive buffer of the sockets connected next, when not 0 (`burst`'s reader).
static RECEIVE_BUFFER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

pub fn set_receive_buffer(bytes: u32) {
    RECEIVE_BUFFER.store(bytes, std::sync::atomic::Ordering::Relaxed);
}

async fn connect_ws(url: &str) -> Result<Ws, Error> {
    let buffer = RECEIVE_BUFFER.load(std::sync::atomic::Ordering::Relaxed);
    let ws = if buffer == 0 {
        tokio_tungstenite::connect_async(url)
            .await
            .map(|(ws, _)| ws)
    } else {
        let addr = url
            .trim_start_matches("ws://")
            .split('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        let addr = tokio::net::lookup_host(addr)
            .await
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| format!("cannot resolve {url}"))?;
        let socket = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
        socket
            .set_recv_buffer_size(buffer)
            .map_err(|e| e.to_string())?;
        let tcp = socket
            .connect(addr)
            .await
            .map_err(|e| format!("cannot connect to {url}: {e}"))?;
        tokio_tungstenite::client_async(url, MaybeTlsStream::Plain(tcp))
            .await
            .map(|(ws, _)| ws)
    };
    let ws = ws.map_err(|e| format!("cannot connect to {url}: {e}"))?;
    if let MaybeTlsStream::Plain(tcp) = ws.get_ref() {
        let _ = tcp.set_nodelay(true);
    }
    Ok(ws)
}

/// Reads frames until one satisfies `wanted`, within a setup timeout.
async fn read_until(
    ws: &mut Ws,
    what: &str,
    wanted: impl Fn(&Value) -> bool,
) -> Result<Value, Error> {
    let wait = async {
        while let Some(frame) = ws.next().await {
            if let Ok(Message::Text(text)) = frame
                && let Ok(value) = serde_json::from_str::<Value>(&text)
                && wanted(&value)
            {
                return Ok(value);
            }
        }
        Err(format!("the socket closed before {what}"))
    };
    tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .map_err(|_| format!("no {what} within 30 s"))?
}

/// A connected receiver: frames arrive here.
pub enum Receiver {
    Ws(SplitStream<Ws>),
    Synapse {
        stream: Box<tonic::Streaming<SynapseMessage>>,
        /// The request half, kept open for the stream's life.
        _request: mpsc::Sender<SynapseMessage>,
    },
    /// A baseline's own transport (JetStream's pull consumer).
    Frames(futures_util::stream::BoxStream<'static, Bytes>),
}

impl Receiver {
    /// The next frame's bytes; `None` when the connection is gone.
    pub async fn next(&mut self) -> Option<Bytes> {
        match self {
            Receiver::Ws(stream) => loop {
                match stream.next().await? {
                    Ok(Message::Text(text)) => return Some(text.into()),
                    Ok(Message::Binary(bytes)) => return Some(bytes),
                    Ok(Message::Close(_)) | Err(_) => return None,
                    Ok(_) => continue,
                }
            },
            Receiver::Synapse { stream, .. } => {
                let msg = stream.next().await?.ok()?;
                Some(msg.payload.map(|p| p.value).unwrap_or_default().into())
            }
            Receiver::Frames(frames) => frames.next().await,
        }
    }
}

/// A connected sender: `send` writes one load message to its receiver.
pub struct Sender {
    sink: SenderSink,
    frame: FrameFn,
}

enum SenderSink {
    Ws(SplitSink<Ws, Message>),
    Synapse(mpsc::Sender<SynapseMessage>),
    Other(Box<dyn FrameSink>),
}

/// A baseline's own transport for a sender's frames (JetStream's publish).
pub trait FrameSink: Send {
    /// Sends message `seq`'s frame; done when the transport has taken it.
    fn send(
        &mut self,
        seq: u64,
        frame: String,
    ) -> futures_util::future::BoxFuture<'_, Result<(), Error>>;
}

impl Sender {
    /// A sender of `frame(seq, text)` over `sink`.
    pub fn over(
        sink: Box<dyn FrameSink>,
        mut frame: impl FnMut(u64, &str) -> String + Send + 'static,
    ) -> Sender {
        Sender {
            sink: SenderSink::Other(sink),
            frame: Box::new(move |seq, text| Outgoing::Text(frame(seq, text))),
        }
    }
}

/// Builds message `seq`'s frame around its marker text.
type FrameFn = Box<dyn FnMut(u64, &str) -> Outgoing + Send>;

enum Outgoing {
    Text(String),
    Synapse(Box<SynapseMessage>),
}

impl Sender {
    pub async fn send(&mut self, seq: u64, text: &str) -> Result<(), Error> {
        match (&mut self.sink, (self.frame)(seq, text)) {
            (SenderSink::Ws(sink), Outgoing::Text(frame)) => sink
                .send(Message::Text(frame.into()))
                .await
                .map_err(|e| format!("send: {e}")),
            (SenderSink::Synapse(tx), Outgoing::Synapse(msg)) => {
                tx.send(*msg).await.map_err(|_| "stream closed".to_owned())
            }
            (SenderSink::Other(sink), Outgoing::Text(frame)) => sink.send(seq, frame).await,
            _ => Err("a sender built for another transport".into()),
        }
    }
}

/// Whatever a sender's own connection receives (echoes, acks) is read and dropped, so the
/// server never blocks writing to it.
fn drain<S: futures_util::Stream + Send + Unpin + 'static>(mut stream: S) {
    tokio::spawn(async move { while stream.next().await.is_some() {} });
}

/// A Skynet `send` frame of chat `text`, as a Skynet agent sends it (the baselines' frames).
pub fn skynet_frame(client_ids: bool, text: &str) -> String {
    let id = skynet_id_field(client_ids);
    format!(
        r#"{{"action":"send","data":{{{id}"type":"chat","payload":{{"text":"{text}"}},"mentions":["00000000-0000-0000-0000-000000000000"]}}}}"#
    )
}

/// One sender → receiver pair's addresses as the sender's protocol names the receiver.
pub struct Pairing<'a> {
    pub endpoints: &'a Endpoints,
    pub from: Proto,
    pub to: Proto,
    pub sender: String,
    pub receiver: String,
    /// Each message carries a random UUIDv4 id of the sender's choosing.
    pub client_ids: bool,
}

/// The `"id":"…",` a Skynet client that chooses its ids puts first in a message's data
/// (nothing when the server is left to choose).
pub fn skynet_id_field(client_ids: bool) -> String {
    if client_ids {
        format!(r#""id":"{}","#, uuid::Uuid::new_v4())
    } else {
        String::new()
    }
}

/// A Grid or Synapse message id: `{prefix}` and a random UUIDv4 when the client chooses
/// them that way (Grid's documented form is `msg-{uuid}`, Synapse's a bare UUID), else
/// `{sender}-{seq}`.
pub fn client_id(client_ids: bool, prefix: &str, sender: &str, seq: u64) -> String {
    if client_ids {
        format!("{prefix}{}", uuid::Uuid::new_v4())
    } else {
        format!("{sender}-{seq}")
    }
}

/// Connects `receiver` of protocol `to`, registering it where its protocol requires.
pub async fn receiver(endpoints: &Endpoints, to: Proto, name: &str) -> Result<Receiver, Error> {
    match to {
        Proto::Synapse => {
            let (tx, stream) = synapse_stream(endpoints.base(to)?, name).await?;
            Ok(Receiver::Synapse {
                stream: Box::new(stream),
                _request: tx,
            })
        }
        _ => Ok(Receiver::Ws(idle(endpoints, to, name).await?.split().1)),
    }
}

/// The Grid socket of program `name`.
fn grid_ws_url(base: &str, name: &str) -> String {
    ws_url(base, &format!("/grid/v1/ws?agent={name}"))
}

/// Connects `name` of `proto` and leaves it idle: joined (Skynet), authenticated (Tracker).
pub async fn idle(endpoints: &Endpoints, proto: Proto, name: &str) -> Result<Ws, Error> {
    match proto {
        Proto::Skynet => Ok(skynet_join(endpoints.base(proto)?, name).await?.1),
        Proto::Tracker => Ok(tracker_auth(endpoints, name).await?.0),
        Proto::Grid => connect_ws(&grid_ws_url(endpoints.base(proto)?, name)).await,
        Proto::Synapse => Err("idle connections are measured for the WebSocket protocols".into()),
    }
}

/// Connects the sender of `pairing`, ready to send to its (already connected) receiver.
pub async fn sender(pairing: Pairing<'_>) -> Result<Sender, Error> {
    let Pairing {
        endpoints,
        from,
        to,
        sender: name,
        receiver,
        client_ids,
    } = pairing;
    let base = endpoints.base(from)?;
    match from {
        Proto::Skynet => {
            let (_, ws) = skynet_join(base, &name).await?;
            let target = skynet_member_id(base, &receiver, to == Proto::Skynet).await?;
            let (sink, stream) = ws.split();
            drain(stream);
            let suffix = format!(r#""}},"mentions":["{target}"]}}}}"#);
            Ok(Sender {
                sink: SenderSink::Ws(sink),
                frame: Box::new(move |_, text| {
                    let id = skynet_id_field(client_ids);
                    Outgoing::Text(format!(
                        r#"{{"action":"send","data":{{{id}"type":"chat","payload":{{"text":"{text}{suffix}"#
                    ))
                }),
            })
        }
        Proto::Tracker => {
            let (ws, lobby, _) = tracker_auth(endpoints, &name).await?;
            let (sink, stream) = ws.split();
            drain(stream);
            let prefix = format!(r#"{{"type":"chat.send","chat_id":"{lobby}","content":""#);
            let suffix = format!(r#"","mentions":["{receiver}"]}}"#);
            Ok(Sender {
                sink: SenderSink::Ws(sink),
                frame: Box::new(move |_, text| Outgoing::Text(format!("{prefix}{text}{suffix}"))),
            })
        }
        Proto::Synapse => {
            let (tx, stream) = synapse_stream(base, &name).await?;
            drain(stream);
            Ok(Sender {
                sink: SenderSink::Synapse(tx),
                frame: Box::new(move |seq, text| {
                    let id = client_id(client_ids, "", &name, seq);
                    Outgoing::Synapse(Box::new(synapse_chat(id, &name, &receiver, text)))
                }),
            })
        }
        Proto::Grid => {
            let ws = connect_ws(&grid_ws_url(base, &name)).await?;
            let (sink, stream) = ws.split();
            drain(stream);
            Ok(Sender {
                sink: SenderSink::Ws(sink),
                frame: Box::new(move |seq, text| {
                    Outgoing::Text(format!(
                        r#"{{"message":{{"id":"{}","timestamp":"{}","type":"notification","sender":{{"agent":"{name}"}},"receiver":{{"agent":"{receiver}"}},"content":{{"action":"message","payload":{{"text":"{text}"}}}}}}}}"#,
                        client_id(client_ids, "msg-", &name, seq),
                        agentbridge::shared::clock::iso8601(agentbridge::core::now_ms())
                    ))
                }),
            })
        }
    }
}

/// A gRPC connection of its own to the Synapse endpoint at `base`.
pub async fn grpc_channel(base: &str) -> Result<tonic::transport::Channel, Error> {
    tonic::transport::Channel::from_shared(base.to_owned())
        .map_err(|e| format!("{base}: {e}"))?
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| format!("cannot connect to {base}: {e}"))
}

/// A Synapse chat message with text `text`, under `id` (empty: the bridge chooses).
pub fn synapse_chat(id: String, from: &str, to: &str, text: &str) -> SynapseMessage {
    SynapseMessage {
        id,
        r#type: MessageType::Unspecified as i32,
        sender: Some(endpoint(from)),
        receiver: Some(endpoint(to)),
        payload: Some(prost_types::Any {
            type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
            value: prost::Message::encode_to_vec(&text.to_owned()),
        }),
        ..Default::default()
    }
}

fn endpoint(name: &str) -> AgentEndpoint {
    AgentEndpoint {
        agent_id: name.to_owned(),
        agent_name: name.to_owned(),
        ..Default::default()
    }
}

/// Registers a Skynet agent over HTTP and joins it on a WebSocket; returns its card.
async fn skynet_join(base: &str, name: &str) -> Result<(Value, Ws), Error> {
    let response = HTTP
        .post(format!("{base}/api/agents"))
        .json(&json!({ "name": name, "type": "loadgen" }))
        .send()
        .await
        .map_err(|e| format!("registering {name}: {e}"))?;
    let status = response.status();
    let card: Value = response
        .json()
        .await
        .map_err(|e| format!("registering {name}: {e}"))?;
    if !status.is_success() {
        return Err(format!("registering {name}: {status} {card}"));
    }
    let mut ws = connect_ws(&ws_url(base, "/ws")).await?;
    let join = json!({ "action": "join", "data": { "agent": card } });
    ws.send(Message::Text(join.to_string().into()))
        .await
        .map_err(|e| format!("join: {e}"))?;
    read_until(&mut ws, "workspace.state", |v| {
        v["event"] == "workspace.state"
    })
    .await?;
    Ok((card, ws))
}

/// The id a Skynet client mentions `name` by: its card id, from the member list (its
/// registered agents first, for a Skynet receiver). A receiver on another bridge of a
/// fleet is listed once its presence has crossed: looked for again for a few seconds.
async fn skynet_member_id(base: &str, name: &str, local: bool) -> Result<String, Error> {
    let paths: &[&str] = if local {
        &["/api/agents", "/api/members"]
    } else {
        &["/api/members"]
    };
    for _ in 0..50 {
        for path in paths {
            let members: Value = HTTP
                .get(format!("{base}{path}"))
                .send()
                .await
                .map_err(|e| format!("listing members: {e}"))?
                .json()
                .await
                .map_err(|e| format!("listing members: {e}"))?;
            let found = (members.as_array().into_iter().flatten())
                .find(|m| m["name"] == name)
                .and_then(|m| m["id"].as_str());
            if let Some(id) = found {
                return Ok(id.to_owned());
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    Err(format!("{name} is not among Skynet's members"))
}

/// Creates a Tracker member `name` (chat_listen = mentions) with the admin token and
/// authenticates it on the WebSocket; returns the socket, the lobby chat id and the
/// member's token.
pub async fn tracker_auth(
    endpoints: &Endpoints,
    name: &str,
) -> Result<(Ws, String, String), Error> {
    let token = tracker_member(endpoints, name).await?;
    let base = endpoints.base(Proto::Tracker)?;
    let mut ws = connect_ws(&ws_url(base, "/ws")).await?;
    let auth = json!({ "type": "auth", "token": token });
    ws.send(Message::Text(auth.to_string().into()))
        .await
        .map_err(|e| format!("auth: {e}"))?;
    let ok = read_until(&mut ws, "auth.ok", |v| v["type"] == "auth.ok").await?;
    let lobby = ok["data"]["lobby_chat_id"]
        .as_str()
        .ok_or("auth.ok has no lobby_chat_id")?
        .to_owned();
    Ok((ws, lobby, token))
}

/// Creates a Tracker member `name` (chat_listen = mentions) with the admin token; its
/// token.
async fn tracker_member(endpoints: &Endpoints, name: &str) -> Result<String, Error> {
    let base = endpoints.base(Proto::Tracker)?;
    let admin = endpoints
        .tracker_admin_token
        .as_deref()
        .ok_or("a Tracker load needs a member token that may create members")?;
    let response = HTTP
        .post(format!("{base}/api/v1/members"))
        .bearer_auth(admin)
        .json(&json!({ "slug": name, "chat_listen": "mentions", "task_listen": "none" }))
        .send()
        .await
        .map_err(|e| format!("creating member {name}: {e}"))?;
    let status = response.status();
    let member: Value = response
        .json()
        .await
        .map_err(|e| format!("creating member {name}: {e}"))?;
    let token = member["token"]
        .as_str()
        .ok_or_else(|| format!("creating member {name}: {status} {member}"))?;
    Ok(token.to_owned())
}

/// Opens `StreamMessages` as `name` (identified by metadata).
async fn synapse_stream(
    base: &str,
    name: &str,
) -> Result<
    (
        mpsc::Sender<SynapseMessage>,
        tonic::Streaming<SynapseMessage>,
    ),
    Error,
> {
    let channel = grpc_channel(base).await?;
    let (tx, rx) = mpsc::channel(1024);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.metadata_mut().insert(
        "x-synapse-agent-id",
        name.parse()
            .map_err(|_| format!("{name} is not a metadata value"))?,
    );
    let stream = SynapseMessageServiceClient::new(channel)
        .stream_messages(request)
        .await
        .map_err(|e| format!("StreamMessages as {name}: {e}"))?
        .into_inner();
    Ok((tx, stream))
}

/// A baseline's plain WebSocket pair: frames are relayed as they are.
pub mod plain {
    use super::*;

    pub async fn receiver(url: &str) -> Result<Receiver, Error> {
        Ok(Receiver::Ws(connect_ws(url).await?.split().1))
    }

    /// A sender whose frames are `frame(seq, text)`; whatever comes back is dropped.
    pub async fn sender(
        url: &str,
        mut frame: impl FnMut(u64, &str) -> String + Send + 'static,
    ) -> Result<Sender, Error> {
        let (sink, stream) = connect_ws(url).await?.split();
        drain(stream);
        Ok(Sender {
            sink: SenderSink::Ws(sink),
            frame: Box::new(move |seq, text| Outgoing::Text(frame(seq, text))),
        })
    }

    /// A connection that is set up by hand before it becomes a receiver.
    pub struct Duplex(Ws);

    pub async fn duplex(url: &str) -> Result<Duplex, Error> {
        Ok(Duplex(connect_ws(url).await?))
    }

    impl Duplex {
        pub async fn send(&mut self, text: &str) -> Result<(), Error> {
            self.0
                .send(Message::Text(text.to_owned().into()))
                .await
                .map_err(|e| format!("send: {e}"))
        }

        /// Reads until a frame contains `needle`.
        pub async fn wait_for(&mut self, needle: &str) -> Result<(), Error> {
            let wait = async {
                while let Some(Ok(frame)) = self.0.next().await {
                    let bytes: &[u8] = match &frame {
                        Message::Text(t) => t.as_bytes(),
                        Message::Binary(b) => b,
                        _ => continue,
                    };
                    if memchr::memmem::find(bytes, needle.as_bytes()).is_some() {
                        return Ok(());
                    }
                }
                Err(format!("the socket closed before {needle}"))
            };
            tokio::time::timeout(Duration::from_secs(30), wait)
                .await
                .map_err(|_| format!("no {needle} within 30 s"))?
        }

        pub fn into_receiver(self) -> Receiver {
            Receiver::Ws(self.0.split().1)
        }
    }
}
