//! One name held by two bridges at once. A name is claimed fleet-wide before an agent takes
//! it (`claims`), but two bridges cut off from NATS together each claim names in their own
//! directory alone, and a bridge the fleet took for gone while it was only cut off comes
//! back with its agents still online. Either can leave an agent online through two
//! bridges under one name, each bridge delivering what the fleet sends to it.
//!
//! A bridge finds such a clash when a card of another bridge's shows the name online there
//! while it is online here: one its watch of the agents bucket brings (`presence`), or, as
//! NATS comes back, one the bucket holds for a name it holds online (put while it was
//! away, which the watch may not bring), read before it puts its own cards over them.
//! Every card another bridge put is noted, the newest of each name and bridge, and the
//! revision of this bridge's own; a clash is settled a moment after it is found, only if
//! the newest card from that bridge still shows it, and only by the bridge whose card is
//! the older (the other's turn comes if its card is put again). A card the watch brought
//! late (from before the agent's leave there, which let it move here) is older than this
//! bridge's card of the agent, and settles nothing. Nor does a clash with a bridge whose
//! last heartbeat says its cards are coming (back from a cut-off, its cards in the bucket
//! may be from before it): the cards it puts find the clash again.
//!
//! Each of the two settles it by one rule both compute alike from the two cards, whatever
//! order they came in: an agent with a connection open keeps the name from one with none
//! (a Skynet member waiting out its grace period after its socket went); then the earlier
//! registration keeps it; and of two in the same millisecond (one registration held
//! through both), the one on the bridge whose id sorts first. The bridge that keeps it
//! announces the agent's status again, which carries its card to every bridge (the one
//! that lost may have put its card last). The one that lost gives the name up
//! (`Core::yield_name`): its agent's connections are refused with their protocol's
//! name-taken error, and no leave is announced; it puts its card of the name showing its
//! agent offline, and hands the winner the name's key where it still names its own
//! agent. A bridge that sees another's card showing a name offline that it holds online
//! puts its own card again, so the bucket ends on the holder's. Of two bridges that both
//! gave a name up (each read the other's card before a change of it came), each then
//! reads the other's offline card, and the name is free for the agent to connect again.
//! The same agent online through two bridges is a clash only in a protocol where one
//! agent may not be (`Endpoint::ONLINE_THROUGH_SEVERAL_BRIDGES`).

use std::sync::Arc;

use std::time::{Duration, Instant};

use dashmap::DashMap;
use parking_lot::Mutex;

use super::cards::CardKeeper;
use super::claims::FleetClaims;
use super::link::put_card;
use super::wire::Card;
use crate::core::{AgentInfo, BRIDGE_PROTOCOL, Core};
use crate::protocols::registry;

/// How long after a clash is found it is settled: the watch brings meanwhile what it had
/// yet to of the other bridge's cards (a card put again after a failed put comes within
/// two seconds, `cards`).
const SETTLED_AFTER: Duration = Duration::from_secs(3);

/// How long the revision of a card showing its agent offline is remembered: a card read
/// from the bucket (as NATS comes back) that is older is not taken for the newest.
const OFFLINE_REMEMBERED: Duration = Duration::from_secs(60);

/// The newest card a bridge put of a name: its revision in the bucket, and the card while
/// it shows the agent online (else when it came).
type Newest = (u64, Result<Card, Instant>);

pub struct Clashes {
    core: Arc<Core>,
    claims: Arc<FleetClaims>,
    cards: Arc<CardKeeper>,
    /// The newest card each other bridge put of each name.
    newest: DashMap<(String, String), Newest>,
    /// The revision of this bridge's newest card of each name it holds online.
    own: DashMap<String, u64>,
    /// When offline cards were last forgotten (`OFFLINE_REMEMBERED`).
    pruned: Mutex<Instant>,
    /// The bridges whose last heartbeat said their cards are coming
    /// (`Heartbeat::cards_coming`): a clash with one is settled once they came.
    cards_coming: DashMap<String, ()>,
}

impl Clashes {
    pub fn new(core: Arc<Core>, claims: Arc<FleetClaims>, cards: Arc<CardKeeper>) -> Clashes {
        Clashes {
            core,
            claims,
            cards,
            newest: DashMap::new(),
            own: DashMap::new(),
            pruned: Mutex::new(Instant::now()),
            cards_coming: DashMap::new(),
        }
    }

    /// Notes `card`, another bridge's, at `revision` in the agents bucket, and settles in
    /// the background the clash it makes with the agent this bridge holds under its name,
    /// if it makes one.
    pub fn card(self: &Arc<Self>, card: &Card, revision: u64) {
        let key = (card.name.clone(), card.bridge.clone());
        let newer = (self.newest.get(&key)).is_none_or(|known| known.0 < revision);
        if !newer {
            return;
        }
        let here = self.core.directory.get(&card.name);
        if !card.online {
            self.newest.insert(key, (revision, Err(Instant::now())));
            self.forget_offline();
            // The bucket is to end on the card of the bridge that holds the agent.
            if here.is_some_and(|here| here.is_online_here()) {
                self.cards.keep(&card.name);
            }
            return;
        }
        self.newest.insert(key, (revision, Ok(card.clone())));
        let Some(here) = here else {
            return;
        };
        if clash(&here, card) {
            self.settle_soon(here, &card.bridge);
        }
    }

    /// Settles in the background, a moment from now, the clash of `here` with `bridge`'s
    /// newest card of its name.
    fn settle_soon(self: &Arc<Self>, here: AgentInfo, bridge: &str) {
        let (clashes, bridge) = (self.clone(), bridge.to_owned());
        tokio::spawn(async move {
            tokio::time::sleep(SETTLED_AFTER).await;
            clashes.settle(here, &bridge).await;
        });
    }

    /// Notes `card`, this bridge's own, at `revision` in the agents bucket.
    pub fn own_card(&self, card: &Card, revision: u64) {
        match card.online {
            true => {
                let mut newest = self.own.entry(card.name.clone()).or_default();
                *newest = (*newest).max(revision);
            }
            false => drop(self.own.remove_if(&card.name, |_, known| *known < revision)),
        }
    }

    /// Forgets the cards of `bridge`, gone from the fleet: it holds no agent now, and one
    /// back puts its cards again.
    pub fn bridge_gone(&self, bridge: &str) {
        self.newest.retain(|(_, of), _| of != bridge);
        self.cards_coming.remove(bridge);
    }

    /// Notes whether `bridge`'s last heartbeat said its cards are coming. Once they came,
    /// the clashes its newest cards make that were left unsettled meanwhile are settled.
    pub fn cards_coming(self: &Arc<Self>, bridge: &str, coming: bool) {
        if coming {
            self.cards_coming.insert(bridge.to_owned(), ());
            return;
        }
        if self.cards_coming.remove(bridge).is_none() {
            return;
        }
        let clashing: Vec<AgentInfo> = (self.newest.iter())
            .filter(|entry| entry.key().1 == bridge)
            .filter_map(|entry| {
                let Ok(there) = &entry.value().1 else {
                    return None;
                };
                (self.core.directory.get(&there.name)).filter(|here| clash(here, there))
            })
            .collect();
        for here in clashing {
            self.settle_soon(here, bridge);
        }
    }

    /// Forgets, at most once a `OFFLINE_REMEMBERED`, the offline cards older than that.
    fn forget_offline(&self) {
        let mut pruned = self.pruned.lock();
        if pruned.elapsed() < OFFLINE_REMEMBERED {
            return;
        }
        *pruned = Instant::now();
        drop(pruned);
        (self.newest).retain(|_, (_, card)| {
            (card.as_ref()).map_or_else(|at| at.elapsed() < OFFLINE_REMEMBERED, |_| true)
        });
    }

    /// Settles the clash of `here` (this bridge's agent of the name, as it was when the
    /// clash was found) with the newest card `bridge` put of the name, if both still make
    /// it.
    async fn settle(&self, here: AgentInfo, bridge: &str) {
        let name = here.name.as_str();
        let key = (here.name.clone(), bridge.to_owned());
        let Some((revision, Ok(there))) = self.newest.get(&key).map(|newest| newest.clone()) else {
            return;
        };
        // Its card may be from before it was cut off (a heartbeat put then may have landed
        // after, saying nothing of it): the card it puts now finds the clash again.
        if self.cards_coming.contains_key(bridge) {
            return;
        }
        // This bridge put its card of the name after that one: the other bridge settles
        // (its card is the older), and puts its card again if it keeps the name. So a
        // card the watch brought from before the agent moved here settles nothing.
        if (self.own.get(name)).is_some_and(|own| *own > revision) {
            return;
        }
        let still_here = (self.core.directory.get(name))
            .filter(|now| now.is_same_agent(&here) && clash(now, &there));
        let Some(here) = still_here else {
            return;
        };
        let this_bridge = self.claims.link.bridge_id.as_str();
        let connected = self.core.router.is_connected(name);
        let keeps = keeps_name(
            (!connected, here.created_at, this_bridge),
            (!there.connected, there.created_at, bridge),
        );
        if keeps {
            tracing::warn!(
                name,
                other = bridge,
                "federation: a name held here and on another bridge at once stays here"
            );
            // Its card, to every bridge: in the stream, and the bucket.
            (self.core)
                .announce_status(here.protocol, name, here.status)
                .await;
            return;
        }
        let Some(winner) = there.into_info() else {
            return;
        };
        tracing::warn!(
            name,
            other = bridge,
            connected,
            "federation: a name held here and on another bridge at once is given up to it"
        );
        self.claims.forget_claimed_alone(&here);
        if self.core.yield_name(winner.clone(), &here).await {
            // The winner, and every bridge, see this bridge hold it no more; the winner
            // then puts its own card over this one.
            let mut gone = here.clone();
            (gone.online, gone.bridge) = (false, None);
            let card = Card::of(&gone, this_bridge).connected(false);
            if let Some(ready) = self.claims.link.ready()
                && let Err(e) = put_card(&ready.agents, &card).await
            {
                tracing::warn!(error = %e, name, "federation: the card of a name given up was not put");
            }
            self.claims.hand_key_over(&winner, &here).await;
        }
    }
}

/// Whether `here` (this bridge's entry of a name) and `there` (another bridge's card of
/// it) hold the name online through both bridges where only one may.
fn clash(here: &AgentInfo, there: &Card) -> bool {
    // Of a protocol whose agents may be online through several bridges, one name is one
    // agent (a Tracker member's slug), whatever id each bridge knows it by.
    let several =
        here.protocol == there.protocol && registry::online_through_several_bridges(here.protocol);
    here.is_online_here() && there.online && here.protocol != BRIDGE_PROTOCOL && !several
}

/// Whether the agent described by `here` (with no connection open, registered at, on the
/// bridge) keeps a name from the one `there` describes: one connected keeps it from one
/// not; then the earlier registration; then the bridge whose id sorts first.
fn keeps_name(here: (bool, i64, &str), there: (bool, i64, &str)) -> bool {
    here < there
}

#[cfg(test)]
mod tests {
    use super::{clash, keeps_name};
    use crate::core::AgentInfo;
    use crate::federation::wire::Card;

    #[test]
    fn the_rule_prefers_a_connected_agent_then_the_earlier_registration_then_the_bridge() {
        for (a, b) in [
            ((false, 9, "b1"), (true, 5, "b0")),
            ((false, 5, "b1"), (false, 7, "b0")),
            ((false, 5, "b0"), (false, 5, "b1")),
        ] {
            assert!(keeps_name(a, b), "{a:?} keeps it from {b:?}");
            assert!(!keeps_name(b, a), "{b:?} gives it to {a:?}");
        }
    }

    #[test]
    fn only_a_name_online_through_two_bridges_where_one_may_be_clashes() {
        let info = |protocol, native: &str| {
            let mut info = AgentInfo::new("x", protocol, native);
            info.online = true;
            info
        };
        let card = |protocol, native: &str| {
            let mut there = info(protocol, native);
            there.bridge = Some("b0".into());
            Card::of(&there, "b1")
        };
        let here = info("grid", "x");
        assert!(clash(&here, &card("grid", "x")));
        assert!(clash(&here, &card("synapse", "x")));
        let mut offline = card("grid", "x");
        offline.online = false;
        assert!(!clash(&here, &offline));
        // A Tracker member may be online through several bridges; another agent may not.
        let member = info("tracker", "m-1");
        assert!(!clash(&member, &card("tracker", "m-1")));
        assert!(clash(&member, &card("grid", "x")));
    }
}
