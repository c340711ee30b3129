//! Senders that send each message as one request and take its answer — Synapse's unary
//! `SendMessage` over gRPC and over its HTTP/JSON gateway, the Tracker's `POST
//! /api/v1/messages`, the Grid's `POST /grid/v1/messages` — for the request/response rows.
//! As many requests are in flight as the window allows, on connections kept open between
//! them (one HTTP/2 connection for gRPC; a pool of HTTP/1.1 keep-alive connections).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use agentbridge::protocols::synapse::proto::SendMessageRequest;
use agentbridge::protocols::synapse::proto::synapse_message_service_client::SynapseMessageServiceClient;
use futures_util::future::BoxFuture;
use serde_json::json;

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

/// One request for a message, started by `send` and left to finish on its own.
type Request = Arc<dyn Fn(String) -> BoxFuture<'static, Result<(), Error>> + Send + Sync>;

/// A message's request body (or, for gRPC, its text) from its number and marker text.
type Frame = Box<dyn FnMut(u64, &str) -> String + Send>;

/// Starts each message's request and returns at once; a request that fails is counted
/// (its message is then lost, as the run sees it) and told on stderr once.
struct Requests {
    request: Request,
    failed: Arc<AtomicU64>,
}

impl FrameSink for Requests {
    fn send(&mut self, _seq: u64, frame: String) -> BoxFuture<'_, Result<(), Error>> {
        let (request, failed) = (self.request.clone(), self.failed.clone());
        tokio::spawn(async move {
            if let Err(e) = request(frame).await
                && failed.fetch_add(1, Ordering::Relaxed) == 0
            {
                eprintln!("loadgen: a request failed: {e}");
            }
        });
        Box::pin(std::future::ready(Ok(())))
    }
}

/// The sender of `pairing` that sends by `via` (not `Stream`).
pub async fn sender(pairing: Pairing<'_>, via: Via) -> Result<Sender, Error> {
    let Pairing {
        endpoints,
        from,
        sender: name,
        receiver,
        client_ids,
        ..
    } = pairing;
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(|e| e.to_string())?;
    let base = endpoints.base(from)?.to_owned();
    let failed = Arc::new(AtomicU64::new(0));
    let post = |url: String, token: Option<String>, content_type: &'static str| -> Request {
        let http = http.clone();
        Arc::new(move |body: String| {
            let mut request = (http.post(&url))
                .header("content-type", content_type)
                .body(body);
            if let Some(token) = &token {
                request = request.bearer_auth(token);
            }
            Box::pin(async move {
                let answer = request.send().await.map_err(|e| e.to_string())?;
                match answer.status().is_success() {
                    true => Ok(()),
                    false => Err(format!(
                        "{}: {}",
                        answer.status(),
                        answer.text().await.unwrap_or_default()
                    )),
                }
            })
        })
    };
    let (request, frame): (Request, Frame) = match (from, via) {
        (Proto::Synapse, Via::Unary) => {
            let client = SynapseMessageServiceClient::new(agents::grpc_channel(&base).await?);
            let (from, to) = (name.clone(), receiver.clone());
            let request: Request = Arc::new(move |text: String| {
                let mut client = client.clone();
                let id = match client_ids {
                    true => uuid::Uuid::new_v4().to_string(),
                    false => String::new(),
                };
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
            (request, Box::new(|_, text| text.to_owned()))
        }
        (Proto::Synapse, Via::Http) => {
            let url = format!("{base}/api/v1/synapse/message");
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
            (post(url, None, "application/json"), Box::new(frame))
        }
        (Proto::Tracker, Via::Http) => {
            let (ws, lobby, token) = agents::tracker_auth(endpoints, &name).await?;
            drop(ws);
            let url = format!("{base}/api/v1/messages");
            let frame = move |_, text: &str| {
                json!({ "chat_id": lobby, "content": text, "mentions": [receiver] }).to_string()
            };
            (post(url, Some(token), "application/json"), Box::new(frame))
        }
        (Proto::Grid, Via::Http) => {
            let url = format!("{base}/grid/v1/messages");
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
            (post(url, None, "application/json"), Box::new(frame))
        }
        (proto, via) => {
            return Err(format!(
                "{} has no {via:?} way to send (synapse/unary, synapse/http, tracker/http, grid/http)",
                proto.name()
            ));
        }
    };
    Ok(Sender::over(Requests { request, failed }, frame))
}
