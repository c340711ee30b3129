//! The session loop every WebSocket endpoint runs. One task owns the socket and serves, in
//! this order: shutdown, the endpoint's deadline (an identification it waits for, a
//! heartbeat), its wake-ups, its sent messages as each is stored, the client's frames, and
//! the mailbox.
//! Handling a frame to its end before taking the next mailbox item is what puts an
//! endpoint's greeting (Skynet's `workspace.state`) on the wire before anything routed to
//! it. The endpoint plugs in what its protocol does (`WsSession`); the loop does the rest
//! alike for all: refusals in the protocol's error frame and RFC 6455 closes, the writes
//! of a mailbox batch gathered into one flush, drop notices, the overflow close, and
//! settling what was still being stored when the socket went.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::core::{Closed, Delivery, Envelope, InFlight, LogError, Mailbox, Protocol};
use crate::shared::websocket::{self, Message, Refusal, Refused, Socket, Utf8Bytes};
use crate::telemetry::{self, ConnectionGuard};

/// Routed messages written per flush, so a backlog drains in few syscalls.
pub const WRITE_BATCH: usize = 64;

/// Whether a session goes on after a handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Close,
}

impl Flow {
    /// `Continue` when a write to the client worked.
    pub fn sent<E>(sent: Result<(), E>) -> Flow {
        match sent {
            Ok(()) => Flow::Continue,
            Err(_) => Flow::Close,
        }
    }
}

/// A session's connection: its socket, and the messages it sent that are being stored,
/// each with what the endpoint does once it is.
pub struct Io<P> {
    pub socket: Socket,
    pub pending: InFlight<P>,
}

impl<P: Send + 'static> Io<P> {
    /// Sends `frame` now.
    pub async fn send(&mut self, frame: String) -> Flow {
        Flow::sent(self.socket.send(Message::Text(frame.into())).await)
    }

    /// Closes with `code` and `reason`; the session ends.
    pub async fn close(&mut self, code: u16, reason: &'static str) -> Flow {
        self.socket.close(code, reason).await;
        Flow::Close
    }
}

/// What an endpoint's WebSocket connection does in its protocol.
pub trait WsSession: Send {
    /// The endpoint's protocol.
    const PROTOCOL: Protocol;
    /// What each sent message carries while it is stored.
    type Pending: Send + 'static;

    /// The session's mailbox, once it has one (a client that has identified itself).
    fn mailbox(&self) -> Option<&Arc<Mailbox>>;

    /// The protocol's error frame saying `text`: refusals and drop notices are sent in it.
    fn error_frame(&self, text: &str) -> String;

    /// What the client is told of `count` messages its mailbox dropped.
    fn drop_notice(&self, count: u64) -> String {
        self.error_frame(&websocket::dropped_text(count))
    }

    /// Called once as the session starts, before anything is read.
    fn on_open(&mut self, _io: &mut Io<Self::Pending>) -> impl Future<Output = Flow> + Send {
        async { Flow::Continue }
    }

    /// The frame a refused message is answered with.
    fn refusal_frame(&self, refusal: &Refusal) -> String {
        self.error_frame(&refusal.to_string())
    }

    /// Handles a data frame from the client.
    fn on_frame(
        &mut self,
        io: &mut Io<Self::Pending>,
        message: Message,
    ) -> impl Future<Output = Flow> + Send;

    /// A message the client sent is durable (`Ok`, to be routed now) or could not be
    /// stored.
    fn on_stored(
        &mut self,
        io: &mut Io<Self::Pending>,
        stored: Result<Envelope, LogError>,
        pending: Self::Pending,
    ) -> impl Future<Output = Flow> + Send;

    /// The same once the socket is gone: what was sent before it went is delivered all the
    /// same.
    fn settle(
        &mut self,
        stored: Result<Envelope, LogError>,
        pending: Self::Pending,
    ) -> impl Future<Output = ()> + Send;

    /// The text frame `delivery` is written as, or `None` when it is not written to this
    /// client (it saw it already; it is kept for someone else).
    fn frame(&mut self, delivery: &Arc<Delivery>) -> Option<Utf8Bytes>;

    /// Deliveries fed to the socket whose flush failed: the endpoint may keep them by
    /// other means (the Grid queues them again).
    fn unsent(&mut self, _batch: Vec<Arc<Delivery>>) {}

    /// The mailbox closed for `reason` (not an overflow or shutdown, which the loop
    /// answers itself).
    fn on_closed(
        &mut self,
        _io: &mut Io<Self::Pending>,
        _reason: Closed,
    ) -> impl Future<Output = Flow> + Send {
        async { Flow::Close }
    }

    /// What wakes the session when something outside the connection wants it to act
    /// (`on_wake`): mail queued for its agent while it is open, say. Asked once, after
    /// `on_open`; none by default.
    fn waker(&self) -> Option<Arc<Notify>> {
        None
    }

    fn on_wake(&mut self, _io: &mut Io<Self::Pending>) -> impl Future<Output = Flow> + Send {
        async { Flow::Continue }
    }

    /// When the endpoint next wants `on_deadline`: an identification it waits for, a
    /// heartbeat it expects. Asked each turn; the timer moves only when it changes.
    fn deadline(&self) -> Option<Instant> {
        None
    }

    fn on_deadline(&mut self, _io: &mut Io<Self::Pending>) -> impl Future<Output = Flow> + Send {
        async { Flow::Continue }
    }

    /// The session is over; what it was sent has been settled.
    fn finish(self) -> impl Future<Output = ()> + Send;
}

/// Resolves when `waker` is notified; never without one.
async fn woken_by(waker: Option<&Notify>) {
    match waker {
        Some(waker) => waker.notified().await,
        None => std::future::pending().await,
    }
}

/// Far enough away to mean "no deadline".
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// Serves `socket` as `session` until either ends.
///
/// Not an `async fn`: one keeps its arguments twice in the future it returns, as arguments
/// and as the locals they are moved into, and every idle connection holds that future.
/// Here the block owns `session` and `io` once; an endpoint with nothing to await before
/// the session starts returns this future as its connection's, with no wrapper around it.
pub fn run<S: WsSession>(
    mut session: S,
    socket: Socket,
    shutdown: CancellationToken,
) -> impl Future<Output = ()> {
    let mut io = Io {
        socket,
        pending: InFlight::new(),
    };
    async move {
        let _counted = ConnectionGuard::new(S::PROTOCOL);
        // Made once: a `cancelled()` or a timer made afresh each turn would register with
        // the token (or the timer wheel) and leave it again for every frame and delivery.
        let mut shutting_down = std::pin::pin!(shutdown.cancelled());
        // Every handler is boxed: a session's future is as large as its largest state, and
        // every idle connection holds one. A handler's future lives only while it runs.
        let mut flow = Box::pin(session.on_open(&mut io)).await;
        // Armed once and again after each wake-up, not every turn: a waiter made afresh
        // each turn would join and leave the `Notify`'s list of waiters every time.
        let waker = session.waker();
        let mut woken = std::pin::pin!(woken_by(waker.as_deref()));
        let mut armed = session.deadline();
        let mut timer = std::pin::pin!(tokio::time::sleep_until(
            armed.unwrap_or_else(|| Instant::now() + NEVER)
        ));
        while flow == Flow::Continue {
            let wanted = session.deadline();
            if wanted != armed {
                armed = wanted;
                (timer.as_mut()).reset(armed.unwrap_or_else(|| Instant::now() + NEVER));
            }
            let mailbox = session.mailbox().cloned();
            flow = tokio::select! {
                biased;
                _ = &mut shutting_down => {
                    Box::pin(io.socket.close(1001, "server shutting down")).await;
                    Flow::Close
                }
                _ = &mut timer, if armed.is_some() => {
                    armed = None;
                    Box::pin(session.on_deadline(&mut io)).await
                }
                () = &mut woken => {
                    woken.set(woken_by(waker.as_deref()));
                    Box::pin(session.on_wake(&mut io)).await
                }
                Some((stored, pending)) = io.pending.next(), if !io.pending.is_empty() => {
                    Box::pin(session.on_stored(&mut io, stored, pending)).await
                }
                frame = io.socket.recv(), if io.pending.has_room() => match frame {
                    Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => Flow::Continue,
                    Some(Ok(Message::Close(_))) | None => Flow::Close,
                    Some(Ok(message)) => Box::pin(session.on_frame(&mut io, message)).await,
                    Some(Err(refused)) => Box::pin(refuse(&session, &mut io, refused)).await,
                },
                next = next_delivery(mailbox.as_deref()) => match next {
                    Ok(first) => Box::pin(write_batch(&mut session, &mut io, first, mailbox.as_deref())).await,
                    Err(Closed::Overflow) => Box::pin(io.close(1008, websocket::BEHIND_REASON)).await,
                    Err(Closed::Shutdown) => Flow::Close,
                    Err(reason) => Box::pin(session.on_closed(&mut io, reason)).await,
                },
            };
        }
        while let Some((stored, pending)) = io.pending.next().await {
            Box::pin(session.settle(stored, pending)).await;
        }
        Box::pin(session.finish()).await;
    }
}

async fn next_delivery(mailbox: Option<&Mailbox>) -> Result<Arc<Delivery>, Closed> {
    match mailbox {
        Some(mailbox) => mailbox.recv().await,
        None => std::future::pending().await,
    }
}

/// A message the socket would not take (too large, over the bridge's read budget, not
/// UTF-8): the protocol's error frame, and the RFC 6455 close when the socket cannot go on.
async fn refuse<S: WsSession>(session: &S, io: &mut Io<S::Pending>, refused: Refused) -> Flow {
    telemetry::decode_error(S::PROTOCOL);
    let refusal = refused.refusal;
    if io.send(session.refusal_frame(&refusal)).await == Flow::Close {
        return Flow::Close;
    }
    if refused.fatal {
        return io.close(refusal.close_code(), refusal.close_reason()).await;
    }
    Flow::Continue
}

/// Writes `first` and whatever else the mailbox holds (up to `WRITE_BATCH`), then any
/// drop notice, and flushes once.
async fn write_batch<S: WsSession>(
    session: &mut S,
    io: &mut Io<S::Pending>,
    first: Arc<Delivery>,
    mailbox: Option<&Mailbox>,
) -> Flow {
    let mut batch = Vec::new();
    let mut next = Some(first);
    let mut taken = 0;
    let mut failed = false;
    let mut yielded = false;
    while let Some(delivery) = next.take() {
        if let Some(frame) = session.frame(&delivery) {
            if io.socket.feed(Message::Text(frame)).await.is_err() {
                failed = true;
                batch.push(delivery);
                break;
            }
            delivery.written_to(S::PROTOCOL);
            batch.push(delivery);
        }
        taken += 1;
        if taken < WRITE_BATCH {
            next = mailbox.and_then(|m| m.try_recv().ok().flatten());
            if next.is_none() && !yielded {
                // Once per batch, let the tasks already waiting to run go first: senders
                // that each route one message (HTTP requests, one per connection) then
                // share this flush instead of paying a socket write each.
                yielded = true;
                tokio::task::yield_now().await;
                next = mailbox.and_then(|m| m.try_recv().ok().flatten());
            }
        }
    }
    // Told after the batch: a drop while it was written has a batch after it, or is told
    // here.
    if !failed && let Some(dropped) = mailbox.map(Mailbox::take_untold_drops).filter(|&n| n > 0) {
        let notice = session.drop_notice(dropped);
        failed = io.socket.feed(Message::Text(notice.into())).await.is_err();
    }
    if failed || io.socket.flush().await.is_err() {
        session.unsent(batch);
        return Flow::Close;
    }
    Flow::Continue
}
