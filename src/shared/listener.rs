//! The HTTP listeners every endpoint (and the admin listener) serve on: hyper's HTTP/1.1
//! and HTTP/2 behind one accept loop, with the time limits a public listener needs, and a
//! graceful end on shutdown.
//!
//! Not `axum::serve`: it gives no way to set hyper's timer, so a client could hold a
//! connection open forever by sending its request one byte at a time, or by never sending
//! one. Here a connection must send a complete request head within `header_read_timeout`
//! of opening (and, over HTTP/1.1, of its previous request's end: hyper's header timer
//! runs while a kept-alive connection waits), and a connection with no request in flight
//! for `idle_timeout` is closed (an HTTP/2 connection gracefully, with GOAWAY). A request
//! is in flight until its response's body is done, so streams (gRPC's server streams, the
//! Grid's long answers) are never cut; a WebSocket leaves the listener's accounting once
//! upgraded. A request body (other than a gRPC stream's, which may rightly be quiet for
//! hours) must arrive whole within `body_read_timeout`, HTTP/2 peers that stop answering
//! pings are dropped, and a connection asked to end on shutdown is dropped if it has not
//! within `drain_timeout`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, HttpBody};
use axum::extract::Request;
use axum::response::Response;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use super::latch::Latch;

/// `[limits]`: what the bridge allows any one client, whichever endpoint it uses.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// A connection must send a request's whole head within this, counted from when it
    /// opened or finished its previous request.
    pub header_read_timeout_ms: u64,
    /// A connection with no request in flight for this long is closed.
    pub idle_timeout_ms: u64,
    /// A request's body (gRPC streams aside) must arrive whole within this of its head.
    pub body_read_timeout_ms: u64,
    /// On shutdown, how long a connection may take to finish what it is answering.
    pub drain_timeout_ms: u64,
    /// Bytes of large inbound WebSocket messages (64 KiB and more) the whole bridge holds
    /// at once while they are read and handled; past it, such a message is refused.
    pub read_budget_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            body_read_timeout_ms: 30_000,
            drain_timeout_ms: 10_000,
            read_budget_bytes: 64 * 1024 * 1024,
        }
    }
}

impl Limits {
    fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms.max(1))
    }

    fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms.max(1))
    }

    fn body_read_timeout(&self) -> Duration {
        Duration::from_millis(self.body_read_timeout_ms.max(1))
    }

    fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms.max(1))
    }
}

/// Binds a listener; the error names the address.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))
}

/// `[limits]` as every listener reads it, once for each connection it accepts: a reload
/// of the config changes them for the connections that open after it.
#[derive(Clone, Debug)]
pub struct SharedLimits(Arc<arc_swap::ArcSwap<Limits>>);

impl SharedLimits {
    pub fn new(limits: Limits) -> SharedLimits {
        SharedLimits(Arc::new(arc_swap::ArcSwap::from_pointee(limits)))
    }

    pub fn load(&self) -> Arc<Limits> {
        self.0.load_full()
    }

    pub fn set(&self, limits: Limits) {
        self.0.store(Arc::new(limits));
    }
}

/// How a listener serves connections under `limits`.
struct Serving {
    limits: Arc<Limits>,
    builder: Builder<TokioExecutor>,
    timeouts: Timeouts,
    body_read_timeout: Duration,
}

impl Serving {
    fn new(limits: Arc<Limits>) -> Serving {
        let mut builder = Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout());
        // RFC 8441: WebSockets over HTTP/2.
        // A peer that does not answer a ping within the header timeout is gone.
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(limits.idle_timeout())
            .keep_alive_timeout(limits.header_read_timeout())
            .enable_connect_protocol();
        Serving {
            timeouts: Timeouts {
                first_request: limits.header_read_timeout(),
                idle: limits.idle_timeout(),
                drain: limits.drain_timeout(),
            },
            body_read_timeout: limits.body_read_timeout(),
            builder,
            limits,
        }
    }
}

/// Serves `app` on `listener`, once `doors` open, until `shutdown`, then lets each
/// connection finish what it is answering; open WebSocket sessions watch `shutdown`
/// themselves.
pub fn serve(
    endpoint: &'static str,
    listener: TcpListener,
    app: axum::Router,
    limits: &SharedLimits,
    doors: Latch,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let shared = limits.clone();
    let mut serving = Serving::new(shared.load());
    tokio::spawn(async move {
        tokio::select! {
            () = doors.opened() => {}
            _ = shutdown.cancelled() => return,
        }
        let mut listener = listener;
        let connections = CancellationToken::new();
        let (done_tx, mut done_rx) = tokio::sync::mpsc::channel::<Infallible>(1);
        loop {
            let (tcp, _) = tokio::select! {
                accepted = axum::serve::Listener::accept(&mut listener) => accepted,
                _ = shutdown.cancelled() => break,
            };
            let limits = shared.load();
            if !Arc::ptr_eq(&limits, &serving.limits) {
                serving = Serving::new(limits);
            }
            let (timeouts, body_read_timeout) = (serving.timeouts, serving.body_read_timeout);
            let builder = &serving.builder;
            // Small frames are the norm here: send them now rather than wait to coalesce.
            let _ = tcp.set_nodelay(true);
            let activity = Arc::new(Activity::new());
            let service = Tracked {
                app: app.clone(),
                activity: activity.clone(),
                body_read_timeout,
            };
            // Boxed once: moved into the task by value, hyper's connection (1.5 KiB) took
            // room twice in the task of every connection, idle or not.
            let conn = Box::pin(
                builder
                    .serve_connection_with_upgrades(TokioIo::new(tcp), service)
                    .into_owned(),
            );
            let stop = connections.clone();
            let done = done_tx.clone();
            tokio::spawn(async move {
                let _done = done;
                if let Err(e) = watch(conn, &activity, timeouts, stop).await {
                    tracing::debug!(endpoint, error = %e, "connection ended");
                }
            });
        }
        // Every connection winds down; the listener's task ends when the last one has.
        connections.cancel();
        drop(done_tx);
        let _ = done_rx.recv().await;
    })
}

#[derive(Clone, Copy)]
struct Timeouts {
    first_request: Duration,
    idle: Duration,
    drain: Duration,
}

/// Drives a connection, ending it gracefully on shutdown or once idle too long, and
/// dropping it if it has not ended `drain` after being asked to.
async fn watch<C>(
    mut conn: Pin<Box<C>>,
    activity: &Activity,
    timeouts: Timeouts,
    stop: CancellationToken,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    C: Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>> + Graceful,
{
    let mut ending = false;
    let deadline = tokio::time::sleep(timeouts.first_request);
    let mut deadline = pin!(deadline);
    loop {
        tokio::select! {
            ended = conn.as_mut() => return ended,
            _ = stop.cancelled(), if !ending => {
                ending = true;
                begin_ending(conn.as_mut(), deadline.as_mut(), timeouts.drain);
            }
            _ = &mut deadline => {
                if ending {
                    return Err("still busy when its drain time ran out".into());
                }
                match activity.idle_until(timeouts) {
                    Some(until) if until > Instant::now() => deadline.as_mut().reset(until),
                    Some(_) => {
                        ending = true;
                        begin_ending(conn.as_mut(), deadline.as_mut(), timeouts.drain);
                    }
                    // Busy: look again once a full idle period could have passed.
                    None => deadline.as_mut().reset(Instant::now() + timeouts.idle),
                }
            }
        }
    }
}

/// Asks `conn` to end gracefully, and gives it `drain` to do so.
fn begin_ending<C: Graceful>(
    conn: Pin<&mut C>,
    deadline: Pin<&mut tokio::time::Sleep>,
    drain: Duration,
) {
    conn.begin_graceful_shutdown();
    deadline.reset(Instant::now() + drain);
}

/// The connection types `serve` drives, which can be asked to end gracefully.
trait Graceful {
    fn begin_graceful_shutdown(self: Pin<&mut Self>);
}

impl<I, S, E, B> Graceful for hyper_util::server::conn::auto::UpgradeableConnection<'_, I, S, E>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    B: HttpBody + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    E: hyper_util::server::conn::auto::HttpServerConnExec<S::Future, B>,
{
    fn begin_graceful_shutdown(self: Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

/// Requests a connection has in flight, and since when it has had none.
struct Activity {
    opened: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds after `opened` when the last request ended; `u64::MAX` before one has.
    idle_since_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            opened: Instant::now(),
            in_flight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(u64::MAX),
        }
    }

    /// When the connection will have been idle too long, or `None` while it is busy.
    fn idle_until(&self, timeouts: Timeouts) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(match self.idle_since_ms.load(Ordering::Acquire) {
            u64::MAX => self.opened + timeouts.first_request,
            ms => self.opened + Duration::from_millis(ms) + timeouts.idle,
        })
    }
}

/// A request in flight, from the service's call to its response body's end.
struct Busy(Arc<Activity>);

impl Busy {
    fn new(activity: &Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        Busy(activity.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let ms = self.0.opened.elapsed().as_millis() as u64;
        self.0.idle_since_ms.store(ms, Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The app, counting its requests in flight for the idle timeout and timing their bodies.
#[derive(Clone)]
struct Tracked {
    app: axum::Router,
    activity: Arc<Activity>,
    body_read_timeout: Duration,
}

impl hyper::service::Service<Request<Incoming>> for Tracked {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let busy = Busy::new(&self.activity);
        let app = self.app.clone();
        // A request without a body (a GET, a WebSocket upgrade) has nothing to time.
        let request = if is_grpc_call(&request) || request.body().is_end_stream() {
            request.map(Body::new)
        } else {
            let deadline = Box::pin(tokio::time::sleep(self.body_read_timeout));
            request.map(|body| Body::new(TimedBody { body, deadline }))
        };
        Box::pin(async move {
            let response = app.oneshot(request).await?;
            Ok(response.map(|body| Body::new(TrackedBody { body, _busy: busy })))
        })
    }
}

/// A response body that keeps its request in flight until it is done.
struct TrackedBody {
    body: Body,
    _busy: Busy,
}

impl HttpBody for TrackedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// gRPC calls are streams a client may keep open, quiet, for as long as it likes. A call
/// is told by its content type and its path's form, `/<package>.<Service>/<Method>`: no
/// endpoint's own route has a dot in its first segment, so the header alone does not let
/// a plain request's body past the timeout.
fn is_grpc_call<B>(request: &Request<B>) -> bool {
    let grpc = (request.headers().get(axum::http::header::CONTENT_TYPE))
        .is_some_and(|t| t.as_bytes().starts_with(b"application/grpc"));
    let path = request.uri().path().strip_prefix('/').unwrap_or_default();
    grpc && path.split_once('/').is_some_and(|(service, method)| {
        service.contains('.') && !method.is_empty() && !method.contains('/')
    })
}

/// A request body that fails once its deadline passes before it has all arrived.
struct TimedBody {
    body: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl HttpBody for TimedBody {
    type Data = axum::body::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match this.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err("the request body was too slow".into()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}
