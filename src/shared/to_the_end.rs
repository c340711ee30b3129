//! Work that must not stop half-way when its caller goes: hyper drops a request's handler
//! once its client goes away, and a handler dropped between two writes (a name claimed and
//! its record not yet written, a message stored and not yet routed) would leave them
//! disagreeing.

use std::convert::Infallible;
use std::future::Future;
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures_util::future::{BoxFuture, Either};
use tower::{Layer, Service};

/// Runs `work` in a task of its own and waits for its output: a caller dropped meanwhile
/// only stops waiting. A panic in `work` goes on in the caller, as if run there; `None`
/// when the runtime shut down first.
pub async fn run_to_the_end<T: Send + 'static>(
    work: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    match tokio::spawn(work).await {
        Ok(out) => Some(out),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}

/// A layer for routes whose writes must not stop half-way: a request that may write (any
/// method but the safe ones, GET, HEAD, OPTIONS and TRACE) is handled to its end
/// (`run_to_the_end`). Reads, long polls among them, still stop with their client, so that
/// nothing is taken for a client that is gone; their future is the route's own (not
/// boxed, as `axum::middleware::from_fn` would for every request: `shared::gate`).
#[derive(Clone, Copy, Default)]
pub struct WritesToTheEnd;

impl<S> Layer<S> for WritesToTheEnd {
    type Service = ToTheEnd<S>;

    fn layer(&self, inner: S) -> ToTheEnd<S> {
        ToTheEnd(inner)
    }
}

#[derive(Clone)]
pub struct ToTheEnd<S>(S);

impl<S> Service<Request> for ToTheEnd<S>
where
    S: Service<Request, Response = Response, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Either<S::Future, BoxFuture<'static, Result<Response, Infallible>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        if request.method().is_safe() {
            return Either::Left(self.0.call(request));
        }
        let handling = self.0.call(request);
        Either::Right(Box::pin(async move {
            let answer = run_to_the_end(handling).await;
            Ok(answer.map_or_else(
                || StatusCode::SERVICE_UNAVAILABLE.into_response(),
                |a| a.unwrap_or_else(|never| match never {}),
            ))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_whose_caller_went_away_goes_on_to_its_end() {
        let (go_on, wait) = tokio::sync::oneshot::channel::<()>();
        let (done, finished) = tokio::sync::oneshot::channel();
        let caller = tokio::spawn(run_to_the_end(async move {
            let _ = wait.await;
            let _ = done.send("done");
        }));
        tokio::task::yield_now().await;
        caller.abort();
        assert!(caller.await.unwrap_err().is_cancelled());
        go_on.send(()).unwrap();
        let finished = tokio::time::timeout(std::time::Duration::from_secs(10), finished);
        assert_eq!(finished.await.unwrap().unwrap(), "done");
    }

    #[tokio::test]
    async fn a_write_whose_client_went_away_is_handled_to_its_end_and_a_read_is_not() {
        use axum::Router;
        use axum::body::Body;
        use axum::routing::get;
        use tower::ServiceExt;

        let (started, mut handling) = tokio::sync::mpsc::unbounded_channel();
        let (ended, mut finished) = tokio::sync::mpsc::unbounded_channel();
        let (go_on, wait) = tokio::sync::watch::channel(false);
        let handler = move |request: Request| {
            let (started, ended, mut wait) = (started.clone(), ended.clone(), wait.clone());
            async move {
                let method = request.method().clone();
                let _ = started.send(());
                let _ = wait.wait_for(|go| *go).await;
                let _ = ended.send(method);
            }
        };
        let app = (Router::new().route("/", get(handler.clone()).post(handler)))
            .route_layer(WritesToTheEnd);
        for method in ["POST", "GET"] {
            let request = Request::builder().method(method).uri("/");
            let request = request.body(Body::empty()).unwrap();
            let caller = tokio::spawn(app.clone().oneshot(request));
            handling.recv().await.unwrap();
            // The client goes away while the handler runs.
            caller.abort();
            assert!(caller.await.unwrap_err().is_cancelled());
        }
        go_on.send(true).unwrap();
        // Once every handler is done or dropped (and the routes with them), the channel
        // ends: the POST's went on to its end, the GET's did not.
        drop(app);
        let mut ends = Vec::new();
        let all = async {
            while let Some(method) = finished.recv().await {
                ends.push(method);
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), all)
            .await
            .unwrap();
        assert_eq!(ends, [axum::http::Method::POST]);
    }

    #[tokio::test]
    async fn its_output_is_the_callers() {
        assert_eq!(run_to_the_end(async { 7 }).await, Some(7));
    }
}
