//! The refusals axum writes itself — a body over the limit (413), a wrong method (405), a
//! path or query it cannot extract (400), a content type it will not take (415), the
//! WebSocket upgrade's checks — rewritten into the endpoint's own error shape, so that a
//! client only ever reads errors of its protocol's form.
//!
//! They are told apart from the endpoint's own answers by their form: axum's are plain
//! text or empty, an endpoint's never are. gRPC calls are left alone: tonic answers them.
//!
//! The same layer charges request bodies to the bridge's read budget
//! ([`body_budget`](super::body_budget)), and answers a body the budget could not take
//! with 503 (413 when it is larger than the whole budget) in the endpoint's shape,
//! whatever the endpoint made of its failed read.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::Router;
use axum::body::HttpBody;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use tower::{Layer, Service};

use super::body_budget::{self, Charged, Refusal};
use super::budget::ByteBudget;
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
/// `protocol` when they are the client's fault in form (400, 413, 415, 422), and its
/// request bodies charged to `budget`.
pub fn shaped(app: Router, protocol: &'static str, budget: &ByteBudget, shape: Shape) -> Router {
    app.layer(ReshapeLayer {
        protocol,
        shape,
        budget: budget.clone(),
    })
}

/// A layer rather than `axum::middleware::from_fn`, which boxes every request's future and
/// a clone of the service it calls: every HTTP request passes through this one, and only
/// a refusal needs more than a look at the response's head.
#[derive(Clone)]
struct ReshapeLayer {
    protocol: &'static str,
    shape: Shape,
    budget: ByteBudget,
}

impl<S> Layer<S> for ReshapeLayer {
    type Service = Reshape<S>;

    fn layer(&self, inner: S) -> Reshape<S> {
        Reshape {
            inner,
            protocol: self.protocol,
            shape: self.shape,
            budget: self.budget.clone(),
        }
    }
}

#[derive(Clone)]
struct Reshape<S> {
    inner: S,
    protocol: &'static str,
    shape: Shape,
    budget: ByteBudget,
}

impl<S> Service<Request> for Reshape<S>
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Reshaping<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // gRPC calls are tonic's to answer, and their streams' messages tonic's to bound.
        let asked = (!is_grpc(request.headers())).then(|| Asked {
            accept: request.headers().get(header::ACCEPT).cloned(),
            content_type: request.headers().get(header::CONTENT_TYPE).cloned(),
        });
        // Every body here is charged, gRPC's content type or not: no gRPC call reaches an
        // endpoint's own routes, and the header must not let a body past the budget.
        let (request, charged) = if request.body().is_end_stream() {
            (request, None)
        } else {
            let (request, charged) = body_budget::charge(request, &self.budget);
            (request, Some(charged))
        };
        Reshaping {
            inner: self.inner.call(request),
            asked,
            charged,
            budget: self.budget.bytes(),
            protocol: self.protocol,
            shape: self.shape,
            refusal: None,
        }
    }
}

pin_project_lite::pin_project! {
    /// The endpoint's answer, or once it turns out to be a framework's refusal, its
    /// reshaping (which reads the refusal's body).
    struct Reshaping<F> {
        #[pin]
        inner: F,
        asked: Option<Asked>,
        charged: Option<Charged>,
        budget: usize,
        protocol: &'static str,
        shape: Shape,
        refusal: Option<Pin<Box<dyn Future<Output = Response> + Send>>>,
    }
}

impl<F> Future for Reshaping<F>
where
    F: Future<Output = Result<Response, Infallible>>,
{
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Some(refusal) = this.refusal {
            return refusal.as_mut().poll(cx).map(Ok);
        }
        let response = ready!(this.inner.poll(cx))?;
        // Whatever the endpoint made of a body the budget refused, it is told as such.
        let refused_body = this.charged.as_ref().and_then(Charged::refusal);
        if let Some(refusal) = refused_body
            && (response.status().is_client_error() || response.status().is_server_error())
        {
            let asked = this.asked.take().unwrap_or_default();
            return Poll::Ready(Ok(over_budget(refusal, *this.budget, *this.shape, &asked)));
        }
        let Some(asked) = this.asked.take() else {
            return Poll::Ready(Ok(response));
        };
        if !is_framework_refusal(&response) {
            return Poll::Ready(Ok(response));
        }
        let mut refusal = Box::pin(reshape(response, asked, this.protocol, *this.shape));
        let polled = refusal.as_mut().poll(cx);
        *this.refusal = Some(refusal);
        polled.map(Ok)
    }
}

/// A body the read budget refused, in the endpoint's shape: 503 to be sent again, or 413
/// when it is larger than the whole budget.
fn over_budget(refusal: Refusal, budget: usize, shape: Shape, asked: &Asked) -> Response {
    let text = refusal.text(budget);
    if refusal == Refusal::LargerThanBudget {
        return shape(StatusCode::PAYLOAD_TOO_LARGE, &text, asked);
    }
    let mut refused = shape(StatusCode::SERVICE_UNAVAILABLE, &text, asked);
    (refused.headers_mut()).insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    refused
}

/// A framework's refusal, in the endpoint's shape.
async fn reshape(
    response: Response,
    asked: Asked,
    protocol: &'static str,
    shape: Shape,
) -> Response {
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
