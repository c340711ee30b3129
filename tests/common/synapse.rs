//! A Synapse client: tonic clients generated from the proto, metadata helpers, an open
//! message stream, and a local HTTP receiver for callbacks.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use agentbridge::protocols::synapse::proto::capabilities_service_client::CapabilitiesServiceClient;
use agentbridge::protocols::synapse::proto::group_service_client::GroupServiceClient;
use agentbridge::protocols::synapse::proto::health_service_client::HealthServiceClient;
use agentbridge::protocols::synapse::proto::synapse_message_service_client::SynapseMessageServiceClient;
use agentbridge::protocols::synapse::proto::task_service_client::TaskServiceClient;
use agentbridge::protocols::synapse::proto::{
    AgentEndpoint, MessageType, SendMessageRequest, SynapseMessage, TaskResult, TaskStatus,
    TaskStatusUpdate,
};
use axum::http::HeaderMap;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Status, Streaming};

use super::WAIT;

pub async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("gRPC connects")
}

/// A channel whose HTTP/2 receive windows are the protocol's minimum (64 KiB), so a
/// stream that is not read soon leaves messages waiting at the bridge.
pub async fn narrow_channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .connect()
        .await
        .expect("gRPC connects")
}

#[derive(Clone)]
pub struct Clients {
    pub tasks: TaskServiceClient<Channel>,
    pub messages: SynapseMessageServiceClient<Channel>,
    pub capabilities: CapabilitiesServiceClient<Channel>,
    pub groups: GroupServiceClient<Channel>,
    pub health: HealthServiceClient<Channel>,
}

pub async fn clients(addr: SocketAddr) -> Clients {
    let channel = channel(addr).await;
    Clients {
        tasks: TaskServiceClient::new(channel.clone()),
        messages: SynapseMessageServiceClient::new(channel.clone()),
        capabilities: CapabilitiesServiceClient::new(channel.clone()),
        groups: GroupServiceClient::new(channel.clone()),
        health: HealthServiceClient::new(channel),
    }
}

/// A request with `(key, value)` metadata.
pub fn with_meta<T>(message: T, meta: &[(&'static str, &str)]) -> Request<T> {
    let mut request = Request::new(message);
    for (key, value) in meta {
        request
            .metadata_mut()
            .insert(*key, value.parse().expect("valid metadata"));
    }
    request
}

pub fn endpoint(agent_id: &str) -> Option<AgentEndpoint> {
    Some(AgentEndpoint {
        agent_id: agent_id.into(),
        agent_name: agent_id.into(),
        ..Default::default()
    })
}

/// A text (chat) message from `from` to `to`.
pub fn chat(from: &str, to: &str, text: &str) -> SynapseMessage {
    SynapseMessage {
        r#type: MessageType::Unspecified as i32,
        sender: endpoint(from),
        receiver: endpoint(to),
        payload: Some(prost_types::Any {
            type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
            value: prost::Message::encode_to_vec(&text.to_owned()),
        }),
        ..Default::default()
    }
}

pub fn text_of(msg: &SynapseMessage) -> String {
    let any = msg.payload.as_ref().expect("a payload");
    assert_eq!(
        any.type_url,
        "type.googleapis.com/google.protobuf.StringValue"
    );
    <String as prost::Message>::decode(any.value.as_slice()).unwrap()
}

pub fn unpack<M: prost::Message + Default>(msg: &SynapseMessage) -> M {
    M::decode(msg.payload.as_ref().expect("a payload").value.as_slice()).unwrap()
}

/// A `P2P_TASK_REQUEST` carrying a `TaskPayload` with a text payload.
pub fn task_request(from: &str, to: &str, task_id: &str, kind: &str, text: &str) -> SynapseMessage {
    SynapseMessage {
        id: format!("req-{task_id}"),
        r#type: MessageType::P2pTaskRequest as i32,
        sender: endpoint(from),
        receiver: endpoint(to),
        payload: Some(prost_types::Any {
            type_url: "type.googleapis.com/synapse.TaskPayload".into(),
            value: prost::Message::encode_to_vec(
                &agentbridge::protocols::synapse::proto::TaskPayload {
                    task_id: task_id.into(),
                    task_type: kind.into(),
                    payload: Some(prost_types::Any {
                        type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
                        value: prost::Message::encode_to_vec(&text.to_owned()),
                    }),
                    external_task_id: String::new(),
                },
            ),
        }),
        ..Default::default()
    }
}

/// Sends `message` and returns its id.
pub async fn send(clients: &mut Clients, message: SynapseMessage) -> Result<String, Status> {
    let response = clients
        .messages
        .send_message(Request::new(SendMessageRequest {
            message: Some(message),
        }))
        .await?;
    Ok(response.into_inner().message_id)
}

/// An open `StreamMessages` (or group) stream of one agent.
pub struct Stream {
    pub out: mpsc::Sender<SynapseMessage>,
    pub inbound: Streaming<SynapseMessage>,
}

impl Stream {
    /// Opens `StreamMessages` as `agent`, identified by metadata.
    pub async fn open(addr: SocketAddr, agent: &str) -> Stream {
        Self::open_on(channel(addr).await, agent).await
    }

    /// Opens `StreamMessages` as `agent` on `channel`.
    pub async fn open_on(channel: Channel, agent: &str) -> Stream {
        Self::try_open_on(channel, agent).await.unwrap()
    }

    /// As `open_on`, the bridge's refusal given back.
    async fn try_open_on(channel: Channel, agent: &str) -> Result<Stream, Status> {
        let mut client = SynapseMessageServiceClient::new(channel);
        let (out, rx) = mpsc::channel(64);
        let request = with_meta(ReceiverStream::new(rx), &[("x-synapse-agent-id", agent)]);
        // The bridge has connected the stream by the time it answers the call.
        let inbound = client.stream_messages(request).await?.into_inner();
        Ok(Stream { out, inbound })
    }

    /// As `open`, again and again while the bridge refuses it (the agent is still online
    /// through a bridge that is gone, and the fleet does not yet let it go), as an agent
    /// that reconnects would; within `WAIT`.
    pub async fn open_once_free(addr: SocketAddr, agent: &str) -> Stream {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            match Self::try_open_on(channel(addr).await, agent).await {
                Ok(stream) => return stream,
                Err(refused) => assert!(
                    std::time::Instant::now() < deadline,
                    "{agent} still refused: {refused:?}"
                ),
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Opens `StreamGroupMessages` as `agent`.
    pub async fn open_groups(addr: SocketAddr, agent: &str) -> Stream {
        let mut client = GroupServiceClient::new(channel(addr).await);
        let (out, rx) = mpsc::channel(64);
        let request = with_meta(ReceiverStream::new(rx), &[("x-synapse-agent-id", agent)]);
        let inbound = client
            .stream_group_messages(request)
            .await
            .unwrap()
            .into_inner();
        Stream { out, inbound }
    }

    pub async fn send(&self, message: SynapseMessage) {
        self.out.send(message).await.expect("stream open");
    }

    /// Ends the stream from the client's side; what the bridge sent before it saw the end.
    pub async fn close_reading(self) -> Vec<SynapseMessage> {
        let Stream { out, mut inbound } = self;
        drop(out);
        read_to_end(&mut inbound).await
    }

    /// What the bridge sends until the stream ends (its bridge went).
    pub async fn read_until_ended(&mut self) -> Vec<SynapseMessage> {
        read_to_end(&mut self.inbound).await
    }

    pub async fn next(&mut self) -> SynapseMessage {
        tokio::time::timeout(WAIT, self.inbound.next())
            .await
            .expect("a message within the wait")
            .expect("the stream is open")
            .expect("a message, not an error")
    }
}

/// What `inbound` brings until it ends (or is silent for `WAIT`).
async fn read_to_end(inbound: &mut Streaming<SynapseMessage>) -> Vec<SynapseMessage> {
    let mut read = Vec::new();
    while let Ok(Some(Ok(message))) = tokio::time::timeout(WAIT, inbound.next()).await {
        read.push(message);
    }
    read
}

/// What a callback receiver got: the JSON body and the Authorization header.
#[derive(Clone, Debug)]
pub struct Received {
    pub body: Value,
    pub authorization: Option<String>,
}

/// A local HTTP server recording POSTs; it answers 500 to the first `fail_first` of them.
pub struct CallbackReceiver {
    pub url: String,
    pub received: Arc<Mutex<Vec<Received>>>,
    pub rx: mpsc::UnboundedReceiver<Received>,
}

impl CallbackReceiver {
    pub async fn start(fail_first: usize) -> CallbackReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let received = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::unbounded_channel();
        let seen = Arc::new(Mutex::new(0usize));
        let app = axum::Router::new().route(
            "/callback",
            axum::routing::post({
                let received = received.clone();
                move |headers: HeaderMap, body: axum::body::Bytes| {
                    let (received, tx, seen) = (received.clone(), tx.clone(), seen.clone());
                    async move {
                        let attempt = {
                            let mut seen = seen.lock().unwrap();
                            *seen += 1;
                            *seen
                        };
                        if attempt <= fail_first {
                            return axum::http::StatusCode::INTERNAL_SERVER_ERROR;
                        }
                        let got = Received {
                            body: serde_json::from_slice(&body).unwrap_or(Value::Null),
                            authorization: headers
                                .get("authorization")
                                .map(|h| h.to_str().unwrap().to_owned()),
                        };
                        received.lock().unwrap().push(got.clone());
                        let _ = tx.send(got);
                        axum::http::StatusCode::OK
                    }
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        CallbackReceiver {
            url: format!("http://{addr}/callback"),
            received,
            rx,
        }
    }

    pub async fn next(&mut self) -> Received {
        tokio::time::timeout(WAIT, self.rx.recv())
            .await
            .expect("a callback within the wait")
            .expect("receiver running")
    }
}

/// A `P2P_STATUS_UPDATE` of task `task_id`.
pub fn status_update(
    from: &str,
    to: &str,
    task_id: &str,
    status: TaskStatus,
    progress: i32,
    text: &str,
) -> SynapseMessage {
    SynapseMessage {
        r#type: MessageType::P2pStatusUpdate as i32,
        sender: endpoint(from),
        receiver: endpoint(to),
        payload: Some(prost_types::Any {
            type_url: "type.googleapis.com/synapse.TaskStatusUpdate".into(),
            value: prost::Message::encode_to_vec(&TaskStatusUpdate {
                task_id: task_id.into(),
                status: status as i32,
                progress,
                message: text.into(),
                details: None,
            }),
        }),
        ..Default::default()
    }
}

/// A `P2P_TASK_COMPLETE` of task `task_id`.
pub fn task_complete(
    from: &str,
    to: &str,
    task_id: &str,
    summary: &str,
    reply_to: &str,
) -> SynapseMessage {
    SynapseMessage {
        r#type: MessageType::P2pTaskComplete as i32,
        sender: endpoint(from),
        receiver: endpoint(to),
        reply_to: reply_to.into(),
        payload: Some(prost_types::Any {
            type_url: "type.googleapis.com/synapse.TaskResult".into(),
            value: prost::Message::encode_to_vec(&TaskResult {
                task_id: task_id.into(),
                task_type: String::new(),
                result: None,
                summary: summary.into(),
            }),
        }),
        ..Default::default()
    }
}
