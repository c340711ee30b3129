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
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::link::{NatsLink, Ready};
use super::routed::Place;

/// How long a held card waits for the stream before it is let go anyway.
const HELD_AT_MOST: Duration = Duration::from_secs(30);

/// Where cards are handed to be held.
pub struct HeldCards(mpsc::UnboundedSender<Entry>);

impl HeldCards {
    /// Starts holding cards; those let go come out of the receiver (not always in the
    /// order held: a newer card of an agent may come out before an older one).
    pub fn start(
        link: Arc<NatsLink>,
        ready: Arc<Ready>,
        shutdown: CancellationToken,
    ) -> (HeldCards, mpsc::UnboundedReceiver<Entry>) {
        let (hold, held) = mpsc::unbounded_channel();
        let (let_go, released) = mpsc::unbounded_channel();
        tokio::spawn(hold_cards(link, ready, held, let_go, shutdown));
        (HeldCards(hold), released)
    }

    pub fn hold(&self, card: Entry) {
        let _ = self.0.send(card);
    }
}

async fn hold_cards(
    link: Arc<NatsLink>,
    ready: Arc<Ready>,
    mut held: mpsc::UnboundedReceiver<Entry>,
    let_go: mpsc::UnboundedSender<Entry>,
    shutdown: CancellationToken,
) {
    // Each round waits on its own: a card that comes during another's wait does not wait
    // for it too.
    let mut waiting = FuturesUnordered::new();
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => return,
            Some(cards) = waiting.next(), if !waiting.is_empty() => {
                for card in cards {
                    let _ = let_go.send(card);
                }
                continue;
            }
            card = held.recv() => match card {
                Some(card) => card,
                None => return,
            },
        };
        let mut cards = vec![first];
        while let Ok(card) = held.try_recv() {
            cards.push(card);
        }
        let until = tokio::time::Instant::now() + HELD_AT_MOST;
        let (link, ready) = (link.clone(), ready.clone());
        waiting.push(async move {
            // Read after every one of these came; not told by `until`, the cards wait
            // their longest.
            let caught_up = async {
                match stream_end(&link, &ready, until).await {
                    Some(end) => link.routed.reached(end).await,
                    None => std::future::pending().await,
                }
            };
            let _ = tokio::time::timeout_at(until, caught_up).await;
            cards
        });
    }
}

/// Where the stream ends now, asked again a few times; none if it cannot be told by
/// `until`.
async fn stream_end(link: &NatsLink, ready: &Ready, until: tokio::time::Instant) -> Option<Place> {
    let mut wait = Duration::from_millis(50);
    loop {
        let asked = tokio::time::timeout_at(until, ready.js.get_stream(&link.names.stream));
        let Ok(answer) = asked.await else {
            return None;
        };
        match answer {
            Ok(stream) => return Some(Place::end_of(stream.cached_info())),
            Err(e) if tokio::time::Instant::now() + wait < until => {
                tracing::debug!(error = %e, "federation: the stream's end is not known yet");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
            Err(e) => {
                tracing::debug!(error = %e, "federation: the stream's end is not known; cards wait their longest");
                return None;
            }
        }
    }
}
