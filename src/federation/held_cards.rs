//! Agent cards held back until the stream has caught up with them. A card another bridge
//! puts in the agents bucket reaches this bridge through its watch, ahead of the stream; a
//! card that moves an agent whose mail this bridge keeps must wait until this bridge has
//! routed the stream up to where it ended when the card came: the messages sent to the
//! agent before it connected on that bridge, which that bridge did not send it, are this
//! bridge's to keep until then. One read of the stream's end serves every card that came
//! meanwhile.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::Entry;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::link::{NatsLink, Ready};

/// How long a held card waits for the stream before it is let go anyway.
const HELD_AT_MOST: Duration = Duration::from_secs(30);

/// Where cards are handed to be held.
pub struct HeldCards(mpsc::UnboundedSender<Entry>);

impl HeldCards {
    /// Starts holding cards; those let go come out of the receiver, in the order held.
    /// `routed` is the stream sequence this bridge has routed everything up to.
    pub fn start(
        link: Arc<NatsLink>,
        ready: Arc<Ready>,
        routed: watch::Receiver<u64>,
        shutdown: CancellationToken,
    ) -> (HeldCards, mpsc::UnboundedReceiver<Entry>) {
        let (hold, held) = mpsc::unbounded_channel();
        let (let_go, released) = mpsc::unbounded_channel();
        tokio::spawn(hold_cards(link, ready, routed, held, let_go, shutdown));
        (HeldCards(hold), released)
    }

    pub fn hold(&self, card: Entry) {
        let _ = self.0.send(card);
    }
}

async fn hold_cards(
    link: Arc<NatsLink>,
    ready: Arc<Ready>,
    mut routed: watch::Receiver<u64>,
    mut held: mpsc::UnboundedReceiver<Entry>,
    let_go: mpsc::UnboundedSender<Entry>,
    shutdown: CancellationToken,
) {
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => return,
            card = held.recv() => match card {
                Some(card) => card,
                None => return,
            },
        };
        let mut cards = vec![first];
        while let Ok(card) = held.try_recv() {
            cards.push(card);
        }
        // Read after every one of these came.
        let end = match ready.js.get_stream(&link.names.stream).await {
            Ok(stream) => stream.cached_info().state.last_sequence,
            Err(e) => {
                tracing::debug!(error = %e, "federation: the stream's end is not known; cards wait their longest");
                u64::MAX
            }
        };
        let caught_up = routed.wait_for(|&at| at >= end);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::timeout(HELD_AT_MOST, caught_up) => {}
        }
        for card in cards {
            let _ = let_go.send(card);
        }
    }
}
