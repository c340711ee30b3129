//! Mail a bridge taken for gone was to keep and never saw. A bridge keeps the mail of the
//! absent agents it holds, and the others keep it only once they take that bridge for gone
//! (`Directory::keeps_mail_of`). What reached the stream in between — after the last batch
//! the gone bridge acknowledged, before the others took it for gone — would wait for it to
//! come back. So each bridge still here reads that stretch of the stream again, from the
//! gone bridge's consumer's acknowledgement floor to the stream's end, and keeps each
//! message for the agents the gone bridge held. Keeping is once fleet-wide (a kept
//! message's record key is used once), so every bridge doing this, and the gone bridge
//! applying the same messages if it restarts, keep one copy between them. What the gone
//! bridge accepted itself is passed over: it routed that when it accepted it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use futures_util::StreamExt;

use super::link::{NatsLink, Ready};
use super::wire::{Names, Replica};
use crate::core::{Core, Delivery, Kind, MovedHere};

/// The longest wait for the next message of the stretch before giving up on it.
const NEXT_WITHIN: Duration = Duration::from_secs(10);

/// How many times a failed read of the stretch is taken up again.
const TRIES: u32 = 3;

/// The most messages read again: the stretch of a bridge that lagged further is cut to
/// its newest this many (and that is logged).
const MOST_READ: u64 = 200_000;

/// Who the gone bridge held, as this bridge knew them just before it took it for gone.
pub struct Held {
    /// Every agent it held: the other bridges' messages are kept for them.
    pub all: HashSet<String>,
    /// Those shown offline then: its own messages are kept for them (it kept them itself,
    /// but may have been killed before the write; one shown online got them live).
    pub offline: HashSet<String>,
    /// Agents that moved from it to this bridge lately (`core::Moves`): what reached the
    /// stream before their join here was the gone bridge's to keep (this one did not send
    /// it to them), so it is kept here (`Reader::away`).
    pub moved: Vec<MovedHere>,
}

/// The agents that moved here from the gone bridge whose mail in the stretch is kept here,
/// as the stretch is read.
#[derive(Default)]
struct Away {
    /// Kept for from the other bridges' messages until their join here.
    agents: HashSet<String>,
    /// Of those, the ones whose leave on the gone bridge is still ahead: its own messages
    /// before that leave it sent them live.
    leave_ahead: HashSet<String>,
}

/// Keeps, for the agents `bridge` held, the mail it did not apply before it was taken for
/// gone; then releases what the router held back for them. Logs what it could not read.
pub async fn keep(
    link: Arc<NatsLink>,
    ready: Arc<Ready>,
    core: Arc<Core>,
    bridge: String,
    held: Held,
) {
    // Released however this ends (a panic below included): held-back mail never stays
    // held for good.
    let _release = ReleaseOnDrop {
        core: &core,
        bridge: &bridge,
    };
    if !held.all.is_empty() || !held.moved.is_empty() {
        let reader = Reader {
            link: &link,
            ready: &ready,
            core: &core,
            bridge: &bridge,
            held: &held,
        };
        reader.read_missed().await;
    }
}

/// Releases the mail held back for `bridge` when dropped.
struct ReleaseOnDrop<'a> {
    core: &'a Core,
    bridge: &'a str,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        self.core.router.release_mail_of(self.bridge);
    }
}

/// What reading one gone bridge's missed stretch needs.
struct Reader<'a> {
    link: &'a NatsLink,
    ready: &'a Ready,
    core: &'a Core,
    bridge: &'a str,
    held: &'a Held,
}

impl Reader<'_> {
    /// Reads the stream from after `bridge`'s acknowledgement floor to its end now (at most
    /// `MOST_READ` messages back), keeping what its agents missed. A failed read is taken up
    /// again where it stopped, `TRIES` times.
    async fn read_missed(&self) {
        let bridge = self.bridge;
        let stretch = match self.stretch().await {
            Ok(Some(stretch)) => stretch,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(bridge, error = %e, "federation: cannot find the mail a gone bridge missed");
                return;
            }
        };
        let (mut next, last) = stretch;
        let mut kept = 0;
        let mut away = match self.held.moved.is_empty() {
            true => Away::default(),
            false => self.away(next, last).await,
        };
        for tries in 1..=TRIES {
            match self.read_from(next, last, &mut kept, &mut away).await {
                Ok(()) => break,
                Err((read_to, e)) => {
                    next = read_to + 1;
                    tracing::warn!(bridge, error = %e, tries, "federation: reading the mail a gone bridge missed failed");
                    if tries < TRIES {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
        if kept > 0 {
            tracing::info!(
                bridge,
                kept,
                "federation: kept the mail a gone bridge missed"
            );
        }
    }

    /// Where the gone bridge's missed stretch begins and ends; `None` if it missed nothing.
    async fn stretch(&self) -> Result<Option<(u64, u64)>, async_nats::Error> {
        let (link, ready, bridge) = (self.link, self.ready, self.bridge);
        let mut stream = ready.js.get_stream(&link.names.stream).await?;
        let floor = (stream.consumer_info(Names::consumer_of(bridge)).await?)
            .ack_floor
            .stream_sequence;
        let state = &stream.info().await?.state;
        let (last, oldest) = (state.last_sequence, state.first_sequence);
        if floor >= last {
            return Ok(None);
        }
        // Not before the stream's first message (what its limits dropped is not there).
        let first = (floor + 1)
            .max(last.saturating_sub(MOST_READ) + 1)
            .max(oldest);
        if first > floor + 1 {
            tracing::warn!(
                bridge,
                skipped = first - floor - 1,
                "federation: a gone bridge missed more than is read again"
            );
        }
        Ok(Some((first, last)))
    }

    /// Of the agents that moved from the gone bridge to this one, those whose mail in the
    /// stretch from `next` to `last` is kept here: each whose join here is in the stretch
    /// (else the gone bridge applied it first, and kept what came before), or was never
    /// published (NATS away; the fleet learnt of the move from its card) — unless its
    /// first presence here in the stretch is a leave: it was here already. Read as the
    /// stretch is (`read_from`); if it cannot be, every one of them, so that their mail is
    /// kept rather than lost.
    async fn away(&self, next: u64, last: u64) -> Away {
        let moved: HashSet<&str> = self.held.moved.iter().map(|m| m.name.as_str()).collect();
        let (here, its_own) = (
            self.link.names.messages_of(&self.link.bridge_id),
            self.link.names.messages_of(self.bridge),
        );
        let mut away = Away::default();
        let mut seen_here = HashSet::new();
        let read = self.each_in(next, last, |subject, replica| {
            let env = &replica.envelope;
            if !env.kind.is_presence() || !moved.contains(env.from.as_str()) {
                return;
            }
            if subject == here
                && seen_here.insert(env.from.clone())
                && env.kind == Kind::PresenceJoin
            {
                away.agents.insert(env.from.clone());
            }
            if subject == its_own && env.kind == Kind::PresenceLeave {
                away.leave_ahead.insert(env.from.clone());
            }
        });
        if let Err((_, e)) = read.await {
            tracing::warn!(bridge = self.bridge, error = %e, "federation: cannot tell when agents moved from a gone bridge; their mail is kept");
            away.agents
                .extend(moved.iter().map(|name| name.to_string()));
            return away;
        }
        for moved in self.held.moved.iter().filter(|m| m.join_refused) {
            if !seen_here.contains(&moved.name) {
                away.agents.insert(moved.name.clone());
            }
        }
        away.leave_ahead.retain(|name| away.agents.contains(name));
        away
    }

    /// Reads the stream from `next` to `last`, keeping what `held` missed (adding to `kept`),
    /// and for the agents `away` what came before their join here; on failure, the last
    /// sequence read, and why.
    async fn read_from(
        &self,
        next: u64,
        last: u64,
        kept: &mut usize,
        away: &mut Away,
    ) -> Result<(), (u64, async_nats::Error)> {
        let (core, held) = (self.core, self.held);
        let its_own = self.link.names.messages_of(self.bridge);
        let here = self.link.names.messages_of(&self.link.bridge_id);
        self.each_in(next, last, |subject, replica| {
            let env = &replica.envelope;
            match env.kind {
                Kind::PresenceJoin if subject == here => {
                    away.agents.remove(&env.from);
                }
                Kind::PresenceLeave if subject == its_own => {
                    away.leave_ahead.remove(&env.from);
                }
                _ => {}
            }
            if replica.transient || replica.history || env.kind.is_presence() {
                return;
            }
            // Its own messages it routed when it accepted them: kept here for those it could
            // only have kept (offline then); the others' for all it held.
            let whom = match subject == its_own {
                true => &held.offline,
                false => &held.all,
            };
            let delivery = Arc::new(Delivery::new(replica.envelope));
            *kept += core.router.keep_for(&delivery, whom);
            if away.agents.is_empty() {
                return;
            }
            if subject != its_own || away.leave_ahead.is_empty() {
                *kept += core.router.keep_for(&delivery, &away.agents);
            } else {
                let left: HashSet<String> =
                    away.agents.difference(&away.leave_ahead).cloned().collect();
                *kept += core.router.keep_for(&delivery, &left);
            }
        })
        .await
    }

    /// Feeds `each` every message of the stream from `next` to `last`, in order, with the
    /// subject it came on; on failure, the last sequence read, and why.
    async fn each_in(
        &self,
        next: u64,
        last: u64,
        mut each: impl FnMut(&str, Replica),
    ) -> Result<(), (u64, async_nats::Error)> {
        let (link, ready) = (self.link, self.ready);
        let read_to = next - 1;
        let stream =
            (ready.js.get_stream(&link.names.stream).await).map_err(|e| (read_to, e.into()))?;
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: next,
                },
                ..Default::default()
            })
            .await
            .map_err(|e| (read_to, e.into()))?;
        let mut messages = consumer.messages().await.map_err(|e| (read_to, e.into()))?;
        let mut read_to = read_to;
        loop {
            let message = match tokio::time::timeout(NEXT_WITHIN, messages.next()).await {
                Ok(Some(Ok(message))) => message,
                Ok(Some(Err(e))) => return Err((read_to, e.into())),
                Ok(None) => return Err((read_to, "the stream ended early".into())),
                Err(_) => return Err((read_to, "the stream stopped sending".into())),
            };
            let sequence = message.info().map_err(|e| (read_to, e))?.stream_sequence;
            match Replica::all_in(&message.payload) {
                Ok(replicas) => {
                    for replica in replicas {
                        each(message.subject.as_str(), replica);
                    }
                }
                Err(e) => {
                    tracing::error!(sequence, error = %e, "federation: a message on the stream is not one of ours")
                }
            }
            read_to = sequence;
            if sequence >= last {
                return Ok(());
            }
        }
    }
}
