//! One name held by two bridges at once. A name is claimed fleet-wide before an agent takes
//! it (`claims`), but two bridges cut off from NATS together each claim names in their own
//! directory alone, and a bridge the fleet took for gone while it was only cut off comes
//! back with its agents still online. Either can leave an agent online through two
//! bridges under one name, each bridge delivering what the fleet sends to it.
//!
//! A bridge finds such a clash when a card of another bridge's (`presence`) shows the name
//! online there while it is online here, and settles it by one rule each of the two
//! computes alike from the two cards, whatever order they came in: the agent whose card
//! shows the earlier registration keeps the name, and of two registered in the same
//! millisecond, the one on the bridge whose id sorts first. The bridge that keeps it puts
//! its card again (the one that lost may have put its card last, and the others show the
//! card that came last) and writes the name's key as its own; the one that lost gives the
//! name up (`Core::yield_name`): its agent's connections are refused with their protocol's
//! name-taken error, and no leave is announced. The same agent online through two bridges
//! is a clash only in a protocol where one agent may not be
//! (`Endpoint::ONLINE_THROUGH_SEVERAL_BRIDGES`).

use std::sync::Arc;

use super::cards::CardKeeper;
use super::claims::FleetClaims;
use super::wire::{Card, agent_key};
use crate::core::{AgentInfo, BRIDGE_PROTOCOL, Core};
use crate::protocols::registry;

pub struct Clashes {
    pub core: Arc<Core>,
    pub claims: Arc<FleetClaims>,
    pub cards: Arc<CardKeeper>,
}

impl Clashes {
    /// Settles the clash, if any, between `there` (an agent as another bridge's card
    /// describes it, `there.bridge` naming that bridge) and the agent this bridge holds
    /// under its name.
    pub fn settle(&self, there: &AgentInfo) {
        let Some(bridge) = there.bridge.as_deref() else {
            return;
        };
        let Some(here) = self.core.directory.get(&there.name) else {
            return;
        };
        if here.bridge.is_some() || !here.online || !there.online {
            return;
        }
        let same = here.protocol == there.protocol && here.native_id == there.native_id;
        if here.protocol == BRIDGE_PROTOCOL
            || (same && registry::online_through_several_bridges(here.protocol))
        {
            return;
        }
        let keeps = keeps_name(
            (here.created_at, &self.claims.link.bridge_id),
            (there.created_at, bridge),
        );
        let (core, claims, cards) = (self.core.clone(), self.claims.clone(), self.cards.clone());
        let there = there.clone();
        tokio::spawn(async move {
            // Settled only while the card the bucket holds now still shows the other agent
            // online there: a card the watch brought late may be older than the agent's
            // leave there, which let it move here.
            let mut online = None;
            for _ in 0..ASKED_AT_MOST {
                online = still_online_there(&claims, &there).await;
                if online.is_some() {
                    break;
                }
                tokio::time::sleep(ASK_AGAIN_AFTER).await;
            }
            if online != Some(true) {
                return;
            }
            let (name, other) = (&here.name, there.bridge.as_deref().unwrap_or_default());
            if keeps {
                tracing::warn!(
                    name,
                    other,
                    "federation: a name held here and on another bridge at once stays here"
                );
                cards.keep(name);
                claims.keep_here(here).await;
            } else {
                tracing::warn!(
                    name,
                    other,
                    "federation: a name held here and on another bridge at once is given up to it"
                );
                claims.forget_claimed_alone(&here);
                core.yield_name(there).await;
            }
        });
    }
}

/// How many times the card of a name held twice is read when NATS does not answer, and
/// how long apart: past that, the clash waits for the next card.
const ASKED_AT_MOST: usize = 20;
const ASK_AGAIN_AFTER: std::time::Duration = std::time::Duration::from_millis(250);

/// Whether the agents bucket's card of `there`'s name shows it online through the bridge
/// `there` names; `None` when NATS does not answer.
async fn still_online_there(claims: &FleetClaims, there: &AgentInfo) -> Option<bool> {
    let ready = claims.link.ready()?;
    let value = ready.agents.get(agent_key(&there.name)).await.ok()?;
    Some(value.is_some_and(|value| {
        serde_json::from_slice::<Card>(&value).is_ok_and(|card| {
            card.online
                && Some(&card.bridge) == there.bridge.as_ref()
                && card.protocol == there.protocol
                && card.native_id == there.native_id
        })
    }))
}

/// Whether the agent registered at `here` (milliseconds since the epoch, and its bridge)
/// keeps a name from the one registered at `there`: the earlier keeps it, and of two in
/// the same millisecond, the one whose bridge's id sorts first.
fn keeps_name(here: (i64, &str), there: (i64, &str)) -> bool {
    here < there
}

#[cfg(test)]
mod tests {
    use super::keeps_name;

    #[test]
    fn the_earlier_registration_keeps_the_name_and_the_rule_is_the_same_from_both_sides() {
        for (a, b) in [((5, "b1"), (7, "b0")), ((5, "b0"), (5, "b1"))] {
            assert!(keeps_name(a, b), "{a:?} keeps it from {b:?}");
            assert!(!keeps_name(b, a), "{b:?} gives it to {a:?}");
        }
    }
}
