//! The WebSocket upgrade the endpoints share, and a socket that sends large text messages
//! as fragments.
//!
//! Why not axum's `WebSocketUpgrade`: tungstenite formats every outgoing frame whole into a
//! per-connection write buffer that never shrinks, so a connection would keep, for as long
//! as it lives, a buffer the size of the largest message it was ever sent — and a Skynet
//! `workspace.state` listing 5,000 members is about a megabyte. Sent as fragments of at
//! most [`FRAGMENT_BYTES`], a message never needs more buffer than that. axum's socket
//! cannot send fragments; tungstenite's can. Every WebSocket client reassembles fragments
//! (RFC 6455 §5.4), so what arrives is the same message.

use std::future::Future;

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use hyper::upgrade::{OnUpgrade, Upgraded};
use hyper_util::rt::TokioIo;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::Frame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::{CloseCode, Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};

mod coalesced;
mod gate;
use coalesced::Coalesced;
use gate::Gate;
pub use gate::{Limits, Refusal};

pub use tokio_tungstenite::tungstenite::protocol::CloseFrame;
pub use tokio_tungstenite::tungstenite::{Error, Message, Utf8Bytes};

/// The largest frame the bridge sends; longer text messages go out in fragments.
pub const FRAGMENT_BYTES: usize = 2 * 1024;

/// Buffers sized for many mostly idle connections: tungstenite's defaults reserve 128 KiB
/// to read into per connection, up front. Frames larger than the read buffer are still
/// read whole, in more steps. What tungstenite writes out of its buffer is gathered again
/// until a flush (`Coalesced`), in a buffer that is let go once written.
const READ_BUFFER_BYTES: usize = 2 * 1024;
const WRITE_BUFFER_BYTES: usize = FRAGMENT_BYTES;

/// Why a connection whose mailbox overflowed is closed (with 1008): it fell further behind
/// than the bridge keeps for it, and replays from the store once it reconnects.
pub const BEHIND_REASON: &str =
    "too far behind: messages were not read fast enough; reconnect to replay";

/// What a recipient is told of messages its mailbox dropped (`drop_oldest`,
/// `drop_newest`), in its protocol's error form.
pub fn dropped_text(count: u64) -> String {
    format!(
        "{count} message(s) for this connection were dropped: it did not read them fast enough (routing.when_full)"
    )
}

/// The largest message a client may send unless its endpoint says otherwise.
pub const DEFAULT_MAX_MESSAGE: usize = 16 * 1024 * 1024;

/// A WebSocket upgrade request, checked as axum's own extractor checks it (and refused
/// with the same statuses and texts).
pub struct Upgrade {
    /// `None` over HTTP/2 (RFC 8441), where the answer carries no accept key.
    accept_key: Option<HeaderValue>,
    on_upgrade: OnUpgrade,
    config: WebSocketConfig,
    limits: Limits,
}

impl<S: Send + Sync> FromRequestParts<S> for Upgrade {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
        let refuse = |status: StatusCode, text: &'static str| (status, text).into_response();
        let key = if parts.version <= Version::HTTP_11 {
            if parts.method != Method::GET {
                return Err(refuse(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "Request method must be `GET`",
                ));
            }
            if !header_contains(&parts.headers, header::CONNECTION, "upgrade") {
                return Err(refuse(
                    StatusCode::BAD_REQUEST,
                    "Connection header did not include 'upgrade'",
                ));
            }
            if !header_is(&parts.headers, header::UPGRADE, "websocket") {
                return Err(refuse(
                    StatusCode::BAD_REQUEST,
                    "`Upgrade` header did not include 'websocket'",
                ));
            }
            let Some(key) = parts.headers.get(header::SEC_WEBSOCKET_KEY) else {
                return Err(refuse(
                    StatusCode::BAD_REQUEST,
                    "`Sec-WebSocket-Key` header missing",
                ));
            };
            Some(
                HeaderValue::from_str(&derive_accept_key(key.as_bytes()))
                    .expect("base64 is a valid header value"),
            )
        } else {
            let websocket = parts
                .extensions
                .get::<hyper::ext::Protocol>()
                .is_some_and(|p| p.as_str() == "websocket");
            if parts.method != Method::CONNECT || !websocket {
                return Err(refuse(
                    StatusCode::BAD_REQUEST,
                    "Request must be an extended CONNECT for `websocket`",
                ));
            }
            None
        };
        if !header_is(&parts.headers, header::SEC_WEBSOCKET_VERSION, "13") {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "`Sec-WebSocket-Version` header did not include '13'",
            ));
        }
        let Some(on_upgrade) = parts.extensions.remove::<OnUpgrade>() else {
            return Err(refuse(
                StatusCode::UPGRADE_REQUIRED,
                "WebSocket request couldn't be upgraded since no upgrade state was present",
            ));
        };
        let config = WebSocketConfig::default()
            .read_buffer_size(READ_BUFFER_BYTES)
            .write_buffer_size(WRITE_BUFFER_BYTES);
        let limits = Limits {
            max_message: DEFAULT_MAX_MESSAGE as u64,
            budget: None,
        };
        Ok(Self {
            accept_key: key,
            on_upgrade,
            config,
            limits,
        }
        .max_message_size(DEFAULT_MAX_MESSAGE))
    }
}

impl Upgrade {
    /// The largest message (all its fragments) a client may send. A larger one is
    /// refused unread (`Socket::recv`), and the connection goes on.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.limits.max_message = bytes as u64;
        // tungstenite's own limit, behind the gate's, only guards against a gate bug.
        self.config = self
            .config
            .max_message_size(Some(bytes))
            .max_frame_size(Some(bytes));
        self
    }

    /// The bridge-wide budget large messages take from while they are read and handled.
    pub fn read_budget(mut self, budget: super::budget::ByteBudget) -> Self {
        self.limits.budget = Some(budget);
        self
    }

    /// Answers the upgrade and, once the connection has switched, serves it with `serve`.
    pub fn on_upgrade<F, Fut>(self, serve: F) -> Response
    where
        F: FnOnce(Socket) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let Self {
            accept_key,
            on_upgrade,
            config,
            limits,
        } = self;
        tokio::spawn(async move {
            let Ok(upgraded) = on_upgrade.await else {
                return;
            };
            let stream = WebSocketStream::from_raw_socket(
                Coalesced::new(Gate::new(TokioIo::new(upgraded), limits)),
                Role::Server,
                Some(config),
            )
            .await;
            serve(Socket {
                stream,
                holds_message: false,
            })
            .await;
        });
        match accept_key {
            Some(key) => Response::builder()
                .status(StatusCode::SWITCHING_PROTOCOLS)
                .header(header::CONNECTION, "upgrade")
                .header(header::UPGRADE, "websocket")
                .header(header::SEC_WEBSOCKET_ACCEPT, key)
                .body(Body::empty())
                .expect("a valid response"),
            None => Response::new(Body::empty()),
        }
    }
}

/// One upgraded connection.
pub struct Socket {
    stream: WebSocketStream<Coalesced<Gate<TokioIo<Upgraded>>>>,
    /// Whether the last `recv` returned a data message, whose budget the next gives back.
    holds_message: bool,
}

/// A message the client sent that the bridge would not take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    pub refusal: Refusal,
    /// The connection cannot go on: the endpoint answers, then closes with
    /// `refusal.close_code()`.
    pub fatal: bool,
}

impl Socket {
    /// The next message from the client, or a message refused (too large, over the read
    /// budget, not UTF-8): the endpoint answers it in its protocol. `None` once the
    /// connection is gone. Cancel-safe.
    pub async fn recv(&mut self) -> Option<Result<Message, Refused>> {
        if std::mem::take(&mut self.holds_message) {
            self.gate().release_one();
        }
        let refused = match self.stream.next().await? {
            Ok(Message::Pong(payload)) => match self.gate().take_refusal() {
                Some(refusal) => Refused {
                    refusal,
                    fatal: false,
                },
                None => return Some(Ok(Message::Pong(payload))),
            },
            Ok(message) => {
                self.holds_message = matches!(message, Message::Text(_) | Message::Binary(_));
                return Some(Ok(message));
            }
            Err(Error::Utf8(_)) => {
                self.holds_message = true;
                Refused {
                    refusal: Refusal::NotUtf8,
                    fatal: true,
                }
            }
            Err(Error::Io(e)) => {
                let refusal = e.get_ref()?.downcast_ref::<Refusal>()?.clone();
                Refused {
                    refusal,
                    fatal: true,
                }
            }
            Err(_) => return None,
        };
        Some(Err(refused))
    }

    fn gate(&mut self) -> &mut Gate<TokioIo<Upgraded>> {
        self.stream.get_mut().get_mut()
    }

    /// Queues `message` to be sent; it reaches the socket at the next `flush` (or once
    /// 16 KiB are queued, `Coalesced`). Texts longer than [`FRAGMENT_BYTES`] are queued as
    /// fragments.
    pub async fn feed(&mut self, message: Message) -> Result<(), Error> {
        match message {
            Message::Text(text) if text.len() > FRAGMENT_BYTES => {
                for frame in fragments(text) {
                    self.stream.feed(Message::Frame(frame)).await?;
                }
                Ok(())
            }
            message => self.stream.feed(message).await,
        }
    }

    /// Writes out everything queued.
    pub async fn flush(&mut self) -> Result<(), Error> {
        self.stream.flush().await
    }

    /// Sends `message` now.
    pub async fn send(&mut self, message: Message) -> Result<(), Error> {
        self.feed(message).await?;
        self.flush().await
    }

    /// Sends a close frame; the caller then drops the socket.
    pub async fn close(&mut self, code: u16, reason: &'static str) {
        let frame = CloseFrame {
            code: CloseCode::from(code),
            reason: reason.into(),
        };
        let _ = self.send(Message::Close(Some(frame))).await;
        // After the client's own close, tungstenite writes the frame out of its buffer but
        // no longer flushes: what it wrote is gathered below it, and would be dropped.
        let _ = tokio::io::AsyncWriteExt::flush(self.stream.get_mut()).await;
    }
}

/// `text` as a text frame followed by continuation frames, each at most [`FRAGMENT_BYTES`]
/// and cut between characters (so each fragment is valid UTF-8 on its own too).
fn fragments(text: Utf8Bytes) -> Vec<Frame> {
    let bounds = fragment_bounds(text.as_str());
    let bytes = Bytes::from(text);
    let last = bounds.len() - 1;
    bounds
        .iter()
        .enumerate()
        .map(|(i, range)| {
            let opcode = if i == 0 { Data::Text } else { Data::Continue };
            Frame::message(bytes.slice(range.clone()), OpCode::Data(opcode), i == last)
        })
        .collect()
}

fn fragment_bounds(text: &str) -> Vec<std::ops::Range<usize>> {
    let mut bounds = Vec::with_capacity(text.len() / FRAGMENT_BYTES + 1);
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + FRAGMENT_BYTES).min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        bounds.push(start..end);
        start = end;
    }
    bounds
}

fn header_is(headers: &HeaderMap, name: HeaderName, value: &str) -> bool {
    headers
        .get(&name)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(value.as_bytes()))
}

fn header_contains(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    headers.get_all(&name).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',')
                .any(|part| part.trim().eq_ignore_ascii_case(token))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_texts_are_one_fragment_and_long_ones_are_cut_between_characters() {
        assert_eq!(fragment_bounds("hello"), vec![0..5]);
        let text = "é".repeat(FRAGMENT_BYTES); // two bytes each: 2 × FRAGMENT_BYTES
        let bounds = fragment_bounds(&text);
        assert_eq!(bounds.len(), 2);
        assert!(bounds.iter().all(|r| r.len() <= FRAGMENT_BYTES));
        assert_eq!(bounds.last().unwrap().end, text.len());
        let odd = format!("a{}", "é".repeat(FRAGMENT_BYTES / 2));
        let bounds = fragment_bounds(&odd);
        assert_eq!(
            bounds[0],
            0..FRAGMENT_BYTES - 1,
            "a cut inside 'é' moves back"
        );
        assert!(
            bounds
                .iter()
                .all(|r| odd.is_char_boundary(r.start) && odd.is_char_boundary(r.end))
        );
    }

    #[test]
    fn fragments_are_a_text_frame_then_continuations_with_fin_on_the_last() {
        let text = "x".repeat(FRAGMENT_BYTES * 2 + 1);
        let frames = fragments(Utf8Bytes::from(text));
        let shape: Vec<_> = frames
            .iter()
            .map(|f| (f.header().opcode, f.header().is_final, f.payload().len()))
            .collect();
        let text = OpCode::Data(Data::Text);
        let more = OpCode::Data(Data::Continue);
        assert_eq!(
            shape,
            vec![
                (text, false, FRAGMENT_BYTES),
                (more, false, FRAGMENT_BYTES),
                (more, true, 1)
            ]
        );
    }
}
