//! Work that must not stop half-way when its caller goes: hyper drops a request's handler
//! once its client goes away, and a handler dropped between two writes (a name claimed and
//! its record not yet written, a message stored and not yet routed) would leave them
//! disagreeing.

use std::future::Future;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

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

/// Middleware for routes whose writes must not stop half-way: a request that may write
/// (any method but the safe ones, GET, HEAD, OPTIONS and TRACE) is handled to its end
/// (`run_to_the_end`). Reads, long polls among them, still stop with their client, so that
/// nothing is taken for a client that is gone.
pub async fn writes_to_the_end(request: Request, next: Next) -> Response {
    if request.method().is_safe() {
        return next.run(request).await;
    }
    (run_to_the_end(next.run(request)).await)
        .unwrap_or_else(|| StatusCode::SERVICE_UNAVAILABLE.into_response())
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
    async fn its_output_is_the_callers() {
        assert_eq!(run_to_the_end(async { 7 }).await, Some(7));
    }
}
