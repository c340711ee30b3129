//! Work that must not stop half-way when its caller goes: hyper drops a request's handler
//! once its client goes away, and a handler dropped between two writes (a name claimed and
//! its record not yet written, a message stored and not yet routed) would leave them
//! disagreeing.

use std::convert::Infallible;
use std::future::Future;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures_util::future::{BoxFuture, Either};
use tokio_util::task::TaskTracker;
use tower::{Layer, Service};

/// The work a bridge runs to its end, waited for as the bridge stops (`finish`), before its
/// store closes. Not bounded in number: each piece is bounded in time by its own waits (a
/// body read, a store write, a NATS request), and a bound on how many run would let a
/// client that trickles its requests' bodies hold every slot.
#[derive(Clone, Default)]
pub struct ToTheEnd {
    running: TaskTracker,
}

impl ToTheEnd {
    /// Runs `work` in a task of its own and waits for its output: a caller dropped
    /// meanwhile only stops waiting. A panic in `work` goes on in the caller, as if run
    /// there; `None` when the runtime shut down first.
    pub fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> impl Future<Output = Option<T>> + Send + 'static {
        let running = self.running.spawn(work);
        async move {
            match running.await {
                Ok(out) => Some(out),
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(_) => None,
            }
        }
    }

    /// Ends once every piece of work started has ended (what starts meanwhile too), or
    /// after `within`; whether it all ended.
    pub async fn finish(&self, within: Duration) -> bool {
        self.running.close();
        tokio::time::timeout(within, self.running.wait())
            .await
            .is_ok()
    }
}

/// A layer for routes whose writes must not stop half-way: a request that may write (any
/// method but the safe ones, GET, HEAD, OPTIONS and TRACE) is handled to its end
/// (`ToTheEnd::run`). Reads, long polls among them, still stop with their client, so that
/// nothing is taken for a client that is gone; their future is the route's own (not
/// boxed, as `axum::middleware::from_fn` would for every request: `shared::gate`).
#[derive(Clone)]
pub struct WritesToTheEnd(pub ToTheEnd);

impl<S> Layer<S> for WritesToTheEnd {
    type Service = WriteToTheEnd<S>;

    fn layer(&self, inner: S) -> WriteToTheEnd<S> {
        WriteToTheEnd(inner, self.0.clone())
    }
}

#[derive(Clone)]
pub struct WriteToTheEnd<S>(S, ToTheEnd);

impl<S> Service<Request> for WriteToTheEnd<S>
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
        let (handling, to_the_end) = (self.0.call(request), self.1.clone());
        Either::Right(Box::pin(async move {
            let answer = to_the_end.run(handling).await;
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
        let to_the_end = ToTheEnd::default();
        let caller = tokio::spawn(async move {
            (to_the_end.run(async move {
                let _ = wait.await;
                let _ = done.send("done");
            }))
            .await
        });
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
            .route_layer(WritesToTheEnd(ToTheEnd::default()));
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
        assert_eq!(ToTheEnd::default().run(async { 7 }).await, Some(7));
    }

    #[tokio::test]
    async fn finishing_waits_for_what_runs() {
        let to_the_end = ToTheEnd::default();
        let (go_on, wait) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn({
            let to_the_end = to_the_end.clone();
            async move { to_the_end.run(async move { wait.await.is_ok() }).await }
        });
        tokio::task::yield_now().await;
        let within = std::time::Duration::from_millis(50);
        assert!(!to_the_end.finish(within).await, "ended while work ran");
        go_on.send(()).unwrap();
        assert!(to_the_end.finish(std::time::Duration::from_secs(10)).await);
        assert_eq!(running.await.unwrap(), Some(true));
    }
}
