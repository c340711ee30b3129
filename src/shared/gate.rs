//! A layer that answers some requests itself — a missing token, a body declared too
//! large — before the service it wraps sees them.
//!
//! `axum::middleware::from_fn` would do as much, but it boxes every request's future and a
//! clone of the service it calls, on every request an endpoint serves; this layer's
//! future is the service's own, or the answer it gave. The service is asked whether it is
//! ready before the check runs, which suits axum's routes (always ready); over a service
//! that reserves room when asked (tower's `Buffer`, `ConcurrencyLimit`), an answered
//! request would hold that room until the next call.

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::response::Response;
use futures_util::future::Either;
use tower::{Layer, Service};

/// What a gate's check decided of a request.
pub enum Verdict {
    /// It goes on to the service, given back.
    Pass(Request),
    /// It is answered here.
    Answer(Response),
}

/// A layer whose `check` lets each request pass or answers it.
pub fn gate<F>(check: F) -> Gate<F>
where
    F: Fn(Request) -> Verdict + Clone,
{
    Gate { check }
}

#[derive(Clone)]
pub struct Gate<F> {
    check: F,
}

impl<F: Clone, S> Layer<S> for Gate<F> {
    type Service = Gated<F, S>;

    fn layer(&self, inner: S) -> Gated<F, S> {
        Gated {
            check: self.check.clone(),
            inner,
        }
    }
}

#[derive(Clone)]
pub struct Gated<F, S> {
    check: F,
    inner: S,
}

impl<F, S> Service<Request> for Gated<F, S>
where
    F: Fn(Request) -> Verdict,
    S: Service<Request, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Either<S::Future, Ready<Result<Response, Infallible>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        match (self.check)(request) {
            Verdict::Pass(request) => Either::Left(self.inner.call(request)),
            Verdict::Answer(answer) => Either::Right(ready(Ok(answer))),
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::body::Body;
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    use tower::ServiceExt;

    use super::*;

    #[tokio::test]
    async fn a_request_the_check_answers_never_reaches_the_service() {
        let app = Router::new()
            .route("/", axum::routing::get(|| async { "served" }))
            .layer(gate(|request: Request| {
                match request.headers().contains_key("x-stop") {
                    true => Verdict::Answer(StatusCode::FORBIDDEN.into_response()),
                    false => Verdict::Pass(request),
                }
            }));
        let ask = |stop: bool| {
            let mut request = Request::get("/");
            if stop {
                request = request.header("x-stop", "1");
            }
            app.clone().oneshot(request.body(Body::empty()).unwrap())
        };
        let served = ask(false).await.unwrap();
        assert_eq!(served.status(), StatusCode::OK);
        let body = axum::body::to_bytes(served.into_body(), 64).await.unwrap();
        assert_eq!(&body[..], b"served");
        assert_eq!(ask(true).await.unwrap().status(), StatusCode::FORBIDDEN);
    }
}
