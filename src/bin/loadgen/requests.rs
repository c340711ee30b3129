//! Senders that send each message as one request and take its answer — Synapse's unary
//! `SendMessage` over gRPC and over its HTTP/JSON gateway, the Tracker's `POST
//! /api/v1/messages`, the Grid's `POST /grid/v1/messages` — for the request/response rows.
//! As many requests are in flight as the window allows, on connections kept open between
//! them (one HTTP/2 connection for gRPC; a window's worth of HTTP/1.1 keep-alive connections).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use agentbridge::protocols::synapse::proto::SendMessageRequest;
use agentbridge::protocols::synapse::proto::synapse_message_service_client::SynapseMessageServiceClient;
use axum::http;
use futures_util::future::BoxFuture;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::sync::mpsc;

use super::agents::{self, Error, FrameSink, Pairing, Proto, Sender};

/// How a sender sends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Via {
    /// Its protocol's streaming connection (the WebSockets, Synapse `StreamMessages`).
    #[default]
    Stream,
    /// gRPC unary calls (Synapse `SendMessage`).
    Unary,
    /// HTTP requests (the Synapse gateway, the Tracker's REST API, the Grid's HTTP).
    Http,
}

impl Via {
    /// `""`, `"/unary"` or `"/http"`: how a path names it after the sender's protocol.
    pub fn suffix(self) -> &'static str {
        match self {
            Via::Stream => "",
            Via::Unary => "/unary",
            Via::Http => "/http",
        }
    }

    pub fn parse(text: &str) -> Option<Via> {
        Some(match text {
            "" | "stream" => Via::Stream,
            "unary" | "grpc" => Via::Unary,
            "http" | "rest" => Via::Http,
            _ => return None,
        })
    }
}

/// One request for a message (its number and text), started by `send` and left to finish
/// on its own.
type Request = Arc<dyn Fn(u64, String) -> BoxFuture<'static, Result<(), Error>> + Send + Sync>;

/// A message's request body (or, for gRPC, its text) from its number and marker text.
type Frame = Box<dyn FnMut(u64, &str) -> String + Send>;

/// Starts each message's request and returns at once; a request that fails is counted
/// (its message is then lost, as the run sees it) and told on stderr once.
struct Requests {
    request: Request,
    failed: Arc<AtomicU64>,
}

impl FrameSink for Requests {
    fn send(&mut self, seq: u64, frame: String) -> BoxFuture<'_, Result<(), Error>> {
        let (request, failed) = (self.request.clone(), self.failed.clone());
        tokio::spawn(async move { count_failure(&failed, request(seq, frame).await) });
        Box::pin(std::future::ready(Ok(())))
    }
}

fn count_failure(failed: &AtomicU64, outcome: Result<(), Error>) {
    if let Err(e) = outcome
        && failed.fetch_add(1, Ordering::Relaxed) == 0
    {
        eprintln!("loadgen: a request failed: {e}");
    }
}

/// The sender of `pairing` that sends by `via` (not `Stream`).
pub async fn sender(pairing: Pairing<'_>, via: Via, window: usize) -> Result<Sender, Error> {
    let Pairing {
        endpoints,
        from,
        sender: name,
        receiver,
        client_ids,
        ..
    } = pairing;
    let base = endpoints.base(from)?.to_owned();
    let failed = Arc::new(AtomicU64::new(0));
    let post = async |path: &str, token: Option<String>| -> Result<Box<dyn FrameSink>, Error> {
        let posts = KeepAlivePosts::open(&base, path, token, window, failed.clone()).await?;
        Ok(Box::new(posts) as Box<dyn FrameSink>)
    };
    let (sink, frame): (Box<dyn FrameSink>, Frame) = match (from, via) {
        (Proto::Synapse, Via::Unary) => {
            let client = SynapseMessageServiceClient::new(agents::grpc_channel(&base).await?);
            let (from, to) = (name.clone(), receiver.clone());
            let request: Request = Arc::new(move |seq, text: String| {
                let mut client = client.clone();
                // The ids the streaming sender and the gateway's give (`--client-ids`).
                let id = agents::client_id(client_ids, "", &from, seq);
                let message = agents::synapse_chat(id, &from, &to, &text);
                Box::pin(async move {
                    let request = SendMessageRequest {
                        message: Some(message),
                    };
                    client
                        .send_message(request)
                        .await
                        .map(drop)
                        .map_err(|e| e.to_string())
                })
            });
            let requests = Requests {
                request,
                failed: failed.clone(),
            };
            (Box::new(requests), Box::new(|_, text| text.to_owned()))
        }
        (Proto::Synapse, Via::Http) => {
            let (from, to) = (name.clone(), receiver.clone());
            let frame = move |seq, text: &str| {
                json!({ "message": {
                    "id": agents::client_id(client_ids, "", &from, seq),
                    "sender": { "agentId": from, "agentName": from },
                    "receiver": { "agentId": to, "agentName": to },
                    "payload": { "@type": "type.googleapis.com/google.protobuf.StringValue", "value": text },
                } })
                .to_string()
            };
            (
                post("/api/v1/synapse/message", None).await?,
                Box::new(frame),
            )
        }
        (Proto::Tracker, Via::Http) => {
            let (ws, lobby, token) = agents::tracker_auth(endpoints, &name).await?;
            drop(ws);
            let frame = move |_, text: &str| {
                json!({ "chat_id": lobby, "content": text, "mentions": [receiver] }).to_string()
            };
            (
                post("/api/v1/messages", Some(token)).await?,
                Box::new(frame),
            )
        }
        (Proto::Grid, Via::Http) => {
            let frame = move |seq, text: &str| {
                json!({ "message": {
                    "id": agents::client_id(client_ids, "msg-", &name, seq),
                    "timestamp": agentbridge::shared::clock::iso8601(agentbridge::core::now_ms()),
                    "type": "notification",
                    "sender": { "agent": name },
                    "receiver": { "agent": receiver },
                    "content": { "action": "message", "payload": { "text": text } },
                } })
                .to_string()
            };
            (post("/grid/v1/messages", None).await?, Box::new(frame))
        }
        (proto, via) => {
            return Err(format!(
                "{} has no {via:?} way to send (synapse/unary, synapse/http, tracker/http, grid/http)",
                proto.name()
            ));
        }
    };
    Ok(Sender::over(sink, frame))
}

/// POSTs each body over one of a window's worth of HTTP/1.1 keep-alive connections,
/// opened before the run, in turn, one request at a time on each, as `wrk` does: hyper's
/// client connection, each driven by one task, without reqwest's pool, whose checkout and
/// task a request cost the load generator 26 µs of CPU against 14–18 here, on the cores the
/// bridge shares.
struct KeepAlivePosts {
    connections: Vec<mpsc::UnboundedSender<String>>,
    next: usize,
}

impl KeepAlivePosts {
    async fn open(
        base: &str,
        path: &str,
        token: Option<String>,
        connections: usize,
        failed: Arc<AtomicU64>,
    ) -> Result<KeepAlivePosts, Error> {
        let uri: http::Uri = base.parse().map_err(|e| format!("{base}: {e}"))?;
        let authority = (uri.authority())
            .ok_or_else(|| format!("{base}: no host"))?
            .to_string();
        let target = Target {
            path: path.parse().map_err(|e| format!("{path}: {e}"))?,
            bearer: token.map(|t| format!("Bearer {t}")),
            authority,
        };
        let target = Arc::new(target);
        let mut queues = Vec::new();
        for _ in 0..connections.max(1) {
            let connection = connect(&target.authority).await?;
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(post_each(connection, target.clone(), rx, failed.clone()));
            queues.push(tx);
        }
        Ok(KeepAlivePosts {
            connections: queues,
            next: 0,
        })
    }
}

impl FrameSink for KeepAlivePosts {
    fn send(&mut self, _seq: u64, body: String) -> BoxFuture<'_, Result<(), Error>> {
        self.next = (self.next + 1) % self.connections.len();
        let queued = self.connections[self.next].send(body);
        Box::pin(std::future::ready(
            queued.map_err(|_| "a connection's task has ended".to_owned()),
        ))
    }
}

/// Where and as whom the requests go.
struct Target {
    authority: String,
    path: http::uri::PathAndQuery,
    bearer: Option<String>,
}

/// One keep-alive connection's loop: sends each queued body in turn and reads the whole
/// answer; after an error, the next request connects again.
async fn post_each(
    connection: http1::SendRequest<String>,
    target: Arc<Target>,
    mut queue: mpsc::UnboundedReceiver<String>,
    failed: Arc<AtomicU64>,
) {
    let mut connection = Some(connection);
    while let Some(body) = queue.recv().await {
        let outcome = async {
            let sender = match &mut connection {
                Some(sender) => sender,
                None => connection.insert(connect(&target.authority).await?),
            };
            let mut request = http::Request::post(target.path.clone())
                .header(http::header::HOST, &target.authority)
                .header(http::header::CONTENT_TYPE, "application/json");
            if let Some(bearer) = &target.bearer {
                request = request.header(http::header::AUTHORIZATION, bearer);
            }
            let request = request.body(body).map_err(|e| e.to_string())?;
            let response = (sender.send_request(request).await).map_err(|e| e.to_string())?;
            let status = response.status();
            let text = axum::body::to_bytes(axum::body::Body::new(response.into_body()), 1 << 20)
                .await
                .map_err(|e| e.to_string())?;
            match status.is_success() {
                true => Ok(()),
                false => Err(format!("{status}: {}", String::from_utf8_lossy(&text))),
            }
        }
        .await;
        if outcome.is_err() {
            connection = None;
        }
        count_failure(&failed, outcome);
    }
}

async fn connect(authority: &str) -> Result<http1::SendRequest<String>, Error> {
    let stream = tokio::net::TcpStream::connect(authority)
        .await
        .map_err(|e| format!("{authority}: {e}"))?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let (sender, connection) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    Ok(sender)
}
