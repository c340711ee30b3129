//! This bridge's agents' cards in the fleet's agents bucket (`link::put_card`): what a
//! bridge that starts later knows the agents by, and what moves an agent whose join NATS
//! did not take. One worker puts them, each made from the directory as it is then: never
//! two of one agent at once, so an older card cannot land after a newer one, and a put
//! that failed (a stream failing over) is made again until it lands. A card is put only
//! while this bridge holds the agent: one that moved on meanwhile is another bridge's to
//! put. While NATS is away none is put; the cards of the agents online here are put again
//! when it is back (`presence`).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::link::{NatsLink, put_card};
use super::wire::Card;
use crate::core::Directory;

/// How long the worker waits before it puts again the cards whose put failed; doubled
/// while they keep failing, up to `PUT_AGAIN_AT_MOST`.
const PUT_AGAIN_AFTER: Duration = Duration::from_millis(100);
const PUT_AGAIN_AT_MOST: Duration = Duration::from_secs(2);

/// How many cards are put at once: a connect storm's cards go in a few round trips, without
/// a request per agent in flight.
const PUTS_AT_ONCE: usize = 64;

/// The agents whose cards wait to be put.
#[derive(Default)]
pub struct CardKeeper {
    waiting: Mutex<HashSet<String>>,
    wake: Notify,
}

impl CardKeeper {
    /// Puts the card of agent `name` soon, as the directory then has it.
    pub fn keep(&self, name: &str) {
        let mut waiting = self.lock();
        if !waiting.contains(name) {
            waiting.insert(name.to_owned());
        }
        drop(waiting);
        self.wake.notify_one();
    }

    /// Puts the cards kept, until `shutdown`.
    pub async fn run(
        self: Arc<Self>,
        link: Arc<NatsLink>,
        directory: Arc<Directory>,
        shutdown: CancellationToken,
    ) {
        let mut pause = PUT_AGAIN_AFTER;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.wake.notified() => {}
            }
            while !self.put_waiting(&link, &directory).await {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(PUT_AGAIN_AT_MOST);
            }
            pause = PUT_AGAIN_AFTER;
        }
    }

    /// Puts the card of every agent waiting that this bridge holds; whether none failed.
    /// Those that did wait again.
    async fn put_waiting(&self, link: &NatsLink, directory: &Directory) -> bool {
        loop {
            let names = std::mem::take(&mut *self.lock());
            if names.is_empty() {
                return true;
            }
            let Some(ready) = link.ready() else {
                return true;
            };
            let (agents, bridge) = (&ready.agents, link.bridge_id.as_str());
            let cards = names.into_iter().filter_map(|name| {
                let info = directory.get(&name).filter(|info| info.bridge.is_none())?;
                Some(Card::of(&info, bridge))
            });
            let puts = futures_util::stream::iter(cards).map(|card| async move {
                let put = put_card(agents, &card).await;
                put.map_err(|e| (card.name, e))
            });
            let mut puts = puts.buffer_unordered(PUTS_AT_ONCE);
            let mut failed = Vec::new();
            while let Some(put) = puts.next().await {
                if let Err((name, e)) = put {
                    tracing::debug!(error = %e, agent = %name, "federation: an agent's card is put again");
                    failed.push(name);
                }
            }
            if !failed.is_empty() {
                self.lock().extend(failed);
                return false;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}
