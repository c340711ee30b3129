//! The refusals axum writes itself — a body over the limit (413), a wrong method (405), a
//! path or query it cannot extract (400), a content type it will not take (415), the
//! WebSocket upgrade's checks — rewritten into the endpoint's own error shape, so that a
//! client only ever reads errors of its protocol's form.
//!
//! They are told apart from the endpoint's own answers by their form: axum's are plain
//! text or empty, an endpoint's never are. gRPC calls are left alone: tonic answers them.

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;

use crate::telemetry;

/// What a refused request asked for, for a shape that answers in the requested format.
#[derive(Clone, Debug, Default)]
pub struct Asked {
    pub accept: Option<HeaderValue>,
    pub content_type: Option<HeaderValue>,
}

impl Asked {
    /// Whether the request sent JSON or asks for it back.
    pub fn json(&self) -> bool {
        let has_json = |v: &Option<HeaderValue>| {
            (v.as_ref())
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains("json"))
        };
        has_json(&self.accept) || has_json(&self.content_type)
    }
}

/// An endpoint's error response for `status` with the refusal's `text`.
pub type Shape = fn(StatusCode, &str, &Asked) -> Response;

/// `app` with the framework's refusals written by `shape`, counted as malformed input of
/// `protocol` when they are the client's fault in form (400, 413, 415, 422).
pub fn shaped(app: Router, protocol: &'static str, shape: Shape) -> Router {
    app.layer(axum::middleware::from_fn_with_state(
        (protocol, shape),
        reshape,
    ))
}

async fn reshape(
    State((protocol, shape)): State<(&'static str, Shape)>,
    request: Request,
    next: Next,
) -> Response {
    if is_grpc(request.headers()) {
        return next.run(request).await;
    }
    let asked = Asked {
        accept: request.headers().get(header::ACCEPT).cloned(),
        content_type: request.headers().get(header::CONTENT_TYPE).cloned(),
    };
    let response = next.run(request).await;
    if !is_framework_refusal(&response) {
        return response;
    }
    let status = response.status();
    let (parts, body) = response.into_parts();
    // axum's refusal texts are a line or two.
    let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let text = match text.trim() {
        "" => status.canonical_reason().unwrap_or("Request refused"),
        text => text,
    };
    if matches!(status.as_u16(), 400 | 413 | 415 | 422) {
        telemetry::decode_error(protocol);
    }
    let mut shaped = shape(status, text, &asked);
    for name in [header::ALLOW, header::WWW_AUTHENTICATE] {
        if let Some(value) = parts.headers.get(&name) {
            shaped.headers_mut().insert(name, value.clone());
        }
    }
    shaped
}

fn is_framework_refusal(response: &Response) -> bool {
    let status = response.status();
    (status.is_client_error() || status.is_server_error())
        && response
            .headers()
            .get(header::CONTENT_TYPE)
            .is_none_or(|v| v.as_bytes().starts_with(b"text/plain"))
}

fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}
