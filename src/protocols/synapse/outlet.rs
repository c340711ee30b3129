//! A stream's output queue: the bridge's end (`Outlet`) and tonic's (`Outgoing`), which
//! hands back what the client left unread when tonic drops it, rather than lose it.

use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use super::proto::SynapseMessage;
use crate::core::Outstanding;

/// The bridge's end of a stream's output.
pub struct Outlet {
    pub tx: StreamSender,
    /// What the client left unread, once its end (`Outgoing`) is dropped.
    pub unread: oneshot::Receiver<Unread>,
}

/// What a stream's client left unread, and the holds of those of its messages routed
/// here (`Outstanding`), to keep until the messages are kept elsewhere.
#[derive(Default)]
pub struct Unread {
    pub messages: Vec<SynapseMessage>,
    pub holds: Vec<Outstanding>,
}

/// What a stream's output queue holds: boxed, because tokio allocates a queue's slots 32
/// at a time, and a message beside a status unboxed (~465 bytes) made that block ~15 KiB
/// of every idle stream's memory. A message routed here keeps its delivery's hold until
/// tonic takes it (`Outstanding`).
type Queued = Result<(Box<SynapseMessage>, Option<Outstanding>), Box<Status>>;

/// The sending side of a stream's output queue.
pub struct StreamSender(mpsc::Sender<Queued>);

impl StreamSender {
    /// Queues `message` for the client, waiting for room; gives it back if the client is
    /// gone.
    pub async fn send(&self, message: SynapseMessage) -> Result<(), Option<SynapseMessage>> {
        self.send_holding(message, None).await
    }

    /// As `send`, keeping `outstanding` until tonic takes the message (the caller keeps
    /// its own clone for a message given back).
    pub async fn send_holding(
        &self,
        message: SynapseMessage,
        outstanding: Option<Outstanding>,
    ) -> Result<(), Option<SynapseMessage>> {
        (self.0.send(Ok((Box::new(message), outstanding))).await)
            .map_err(|refused| refused.0.ok().map(|(message, _)| *message))
    }

    /// Ends the stream with `status`, after what is queued.
    pub async fn fail(&self, status: Status) {
        let _ = self.0.send(Err(Box::new(status))).await;
    }

    /// Whether the client is gone.
    pub fn is_closed(&self) -> bool {
        self.0.is_closed()
    }

    /// Resolves once the client is gone.
    pub async fn closed(&self) {
        self.0.closed().await
    }
}

/// The client's end of a stream's output, as tonic sends it. When tonic drops it (the
/// client went away) the messages still queued in it are handed back rather than lost.
pub struct Outgoing {
    rx: mpsc::Receiver<Queued>,
    unread: Option<oneshot::Sender<Unread>>,
}

/// A stream's output queue, `capacity` messages deep.
pub fn outlet(capacity: usize) -> (Outlet, Outgoing) {
    let (tx, rx) = mpsc::channel(capacity);
    let (unread_tx, unread) = oneshot::channel();
    (
        Outlet {
            tx: StreamSender(tx),
            unread,
        },
        Outgoing {
            rx,
            unread: Some(unread_tx),
        },
    )
}

impl futures_util::Stream for Outgoing {
    type Item = Result<SynapseMessage, Status>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let next = self.get_mut().rx.poll_recv(cx);
        next.map(|item| item.map(|queued| queued.map(|(m, _)| *m).map_err(|s| *s)))
    }
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        // Closed first, so that nothing can be queued behind the drain; then whatever is
        // queued is handed back to the serving task (or its stand-in).
        self.rx.close();
        let mut unread = Unread::default();
        while let Ok(item) = self.rx.try_recv() {
            if let Ok((message, hold)) = item {
                unread.messages.push(*message);
                unread.holds.extend(hold);
            }
        }
        if let Some(back) = self.unread.take() {
            let _ = back.send(unread);
        }
    }
}
