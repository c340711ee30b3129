//! This bridge's agents' cards in the fleet's agents bucket: what a bridge that starts
//! later knows the agents by, and what moves an agent whose join NATS did not take. One
//! worker puts them, each made from the directory as it is then and only while this bridge
//! holds the agent (one that moved on meanwhile is another bridge's to put): never two of
//! one agent at once, so an older card cannot land after a newer one. A put that failed
//! (NATS away, a stream failing over) is made again, backing off, until it lands; a card
//! kept waiting that long may be older than one another bridge put meanwhile, so a card
//! showing the agent offline is not put over one showing it online through another bridge
//! (a revision check).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::kv::{self, CreateErrorKind, Operation};
use futures_util::StreamExt;
use parking_lot::Mutex;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::link::{NatsLink, lost_race, put_card};
use super::wire::{Card, agent_key};
use crate::core::Core;

/// How long the worker waits before it puts again the cards whose put failed; doubled
/// while they keep failing, up to `PUT_AGAIN_AT_MOST`.
const PUT_AGAIN_AFTER: Duration = Duration::from_millis(100);
const PUT_AGAIN_AT_MOST: Duration = Duration::from_secs(2);

/// How many puts of one card fail before it is logged as a warning (some 8 s of trying).
const WARN_AFTER_FAILURES: u32 = 8;

/// How many cards are put at once: a connect storm's cards go in a few round trips, without
/// a request per agent in flight.
const PUTS_AT_ONCE: usize = 64;

/// How many times a card showing an agent offline is put again when another put of the
/// same key came between its read and its write.
const RACES_AT_MOST: usize = 3;

/// The agents whose cards wait to be put.
pub struct CardKeeper {
    waiting: Mutex<HashSet<String>>,
    wake: Notify,
    /// Whether cards wait to be put, or failed: set as one is kept, cleared once a round
    /// of puts ends with none waiting and none failed.
    behind: watch::Sender<bool>,
    /// Whether the cards in the bucket may be older than what this bridge holds: from its
    /// start, or NATS coming back, until it has put its own over them (`presence`). Each
    /// time is numbered, and they are no longer coming once the last numbered has come.
    coming_from: AtomicU64,
    came: AtomicU64,
}

impl Default for CardKeeper {
    fn default() -> CardKeeper {
        CardKeeper {
            waiting: Mutex::default(),
            wake: Notify::new(),
            behind: watch::Sender::new(false),
            // Coming from the start, until the first time NATS is reached has come.
            coming_from: AtomicU64::new(1),
            came: AtomicU64::new(0),
        }
    }
}

/// Cards whose put failed, put again at `again_at`.
struct Failed {
    /// Each agent's failures in a row.
    names: HashMap<String, u32>,
    again_at: Instant,
    pause: Duration,
}

impl CardKeeper {
    /// Puts the card of agent `name` soon, as the directory then has it.
    pub fn keep(&self, name: &str) {
        let mut waiting = self.waiting.lock();
        if !waiting.contains(name) {
            waiting.insert(name.to_owned());
        }
        self.behind.send_replace(true);
        drop(waiting);
        self.wake.notify_one();
    }

    /// Once every card kept so far has landed (those kept meanwhile too).
    pub async fn all_put(&self) {
        let _ = self.behind.subscribe().wait_for(|behind| !behind).await;
    }

    /// Whether this bridge's cards in the bucket may be older than what it holds.
    pub fn coming(&self) -> bool {
        self.came.load(Ordering::Acquire) < self.coming_from.load(Ordering::Acquire)
    }

    /// This bridge's cards in the bucket may be older than what it holds, until the number
    /// this gives has `come`.
    pub fn start_coming(&self) -> u64 {
        self.coming_from.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// The cards numbered `time` by `start_coming` were put (or waited for long enough).
    pub fn come(&self, time: u64) {
        self.came.fetch_max(time, Ordering::AcqRel);
    }

    /// Puts the cards kept, until `shutdown`. New cards are put as they come, also while
    /// failed ones wait to be put again.
    pub async fn run(
        self: Arc<Self>,
        link: Arc<NatsLink>,
        core: Arc<Core>,
        shutdown: CancellationToken,
    ) {
        let mut failed = Failed {
            names: HashMap::new(),
            again_at: Instant::now(),
            pause: PUT_AGAIN_AFTER,
        };
        loop {
            let retry = async {
                match failed.names.is_empty() {
                    true => std::future::pending().await,
                    false => tokio::time::sleep_until(failed.again_at).await,
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = retry => {}
            }
            let mut names: HashMap<String, u32> = (std::mem::take(&mut *self.waiting.lock())
                .into_iter())
            .map(|name| (name, 0))
            .collect();
            if Instant::now() >= failed.again_at {
                for (name, failures) in failed.names.drain() {
                    names.entry(name).or_insert(failures);
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                () = self.put(&link, &core, names, &mut failed) => {}
            }
            let waiting = self.waiting.lock();
            if waiting.is_empty() && failed.names.is_empty() {
                self.behind.send_replace(false);
            }
        }
    }

    /// Puts the cards of `names` (each with its failures so far) that this bridge holds;
    /// those that fail wait in `failed`.
    async fn put(
        &self,
        link: &NatsLink,
        core: &Core,
        names: HashMap<String, u32>,
        failed: &mut Failed,
    ) {
        let mut failing = Vec::new();
        match link.ready() {
            None => failing.extend(names),
            Some(ready) => {
                let (agents, bridge) = (&ready.agents, link.bridge_id.as_str());
                let cards = names.into_iter().filter_map(|(name, failures)| {
                    let info = (core.directory.get(&name)).filter(|info| info.bridge.is_none())?;
                    let connected = core.router.is_connected(&name);
                    Some((Card::of(&info, bridge).connected(connected), failures))
                });
                let puts = futures_util::stream::iter(cards).map(|(card, failures)| async move {
                    let put = put_own_card(agents, &card).await;
                    (card.name, failures, put)
                });
                let mut puts = puts.buffer_unordered(PUTS_AT_ONCE);
                while let Some((name, failures, put)) = puts.next().await {
                    if let Err(e) = put {
                        if failures + 1 == WARN_AFTER_FAILURES {
                            tracing::warn!(error = %e, agent = %name, "federation: cannot keep an agent's card yet");
                        }
                        failing.push((name, failures + 1));
                    }
                }
            }
        }
        if failing.is_empty() {
            if failed.names.is_empty() {
                failed.pause = PUT_AGAIN_AFTER;
            }
            return;
        }
        // Cards already waiting are not put off by new failures.
        if failed.names.is_empty() {
            failed.again_at = Instant::now() + failed.pause;
            failed.pause = (failed.pause * 2).min(PUT_AGAIN_AT_MOST);
        }
        failed.names.extend(failing);
    }
}

/// Puts `card`, of an agent this bridge holds. One showing the agent online and connected
/// is the latest word on it, and is put as it is; one showing it offline, or online with
/// no connection open (its last one closing), not over a card showing it online through
/// another bridge: it connected there after it left here, and that card is the newer.
/// (Over another bridge's offline card it goes: the agent may have moved here from there,
/// its card here never landing before it left.)
async fn put_own_card(agents: &kv::Store, card: &Card) -> Result<(), async_nats::Error> {
    if card.online && card.connected {
        return put_card(agents, card).await;
    }
    let key = agent_key(&card.name);
    let value: bytes::Bytes = serde_json::to_vec(card)?.into();
    for _ in 0..RACES_AT_MOST {
        let written = match agents.entry(&key).await? {
            Some(entry) if entry.operation == Operation::Put => {
                let held = serde_json::from_slice::<Card>(&entry.value);
                if held.is_ok_and(|held| held.online && held.bridge != card.bridge) {
                    return Ok(());
                }
                (agents.update(&key, value.clone(), entry.revision).await).map(drop)
            }
            Some(entry) => (agents.update(&key, value.clone(), entry.revision).await).map(drop),
            None => match agents.create(&key, value.clone()).await {
                Ok(_) => Ok(()),
                Err(e) if e.kind() == CreateErrorKind::AlreadyExists || lost_race(&e) => continue,
                Err(e) => return Err(e.into()),
            },
        };
        match written {
            Ok(()) => return Ok(()),
            Err(e) if lost_race(&e) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    // Others kept putting cards of it between a read and a write: theirs are the newer.
    Ok(())
}
