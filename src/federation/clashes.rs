//! One name held by two bridges at once. A name is claimed fleet-wide before an agent takes
//! it (`claims`), but two bridges cut off from NATS together each claim names in their own
//! directory alone, and a bridge the fleet took for gone while it was only cut off comes
//! back with its agents still online. Either can leave an agent online through two
//! bridges under one name, each bridge delivering what the fleet sends to it.
//!
//! A bridge finds such a clash when a card of another bridge's shows the name online there
//! while it is online here: one its watch of the agents bucket brings (`presence`), or, as
//! NATS comes back, one the bucket holds for a name it holds online (put while it was
//! away, which the watch may not bring), read before it puts its own cards over them. It
//! settles nothing on a watched card alone, which may have come late (older than the
//! agent's leave there, which let it move here): it reads the card the bucket holds, and
//! settles only while that one shows the clash too.
//!
//! A bridge where no connection of the agent is open (a Skynet member waiting out its
//! grace period after its socket went) gives the name up at once. Otherwise, after a pause
//! that lets such a bridge go first, each of the two settles it by one rule both compute
//! alike from the two cards, whatever order they came in: the agent whose card shows the
//! earlier registration keeps the name, and of two registered in the same millisecond
//! (one registration held through both), the one on the bridge whose id sorts first. The
//! bridge that keeps it announces the agent's status again, which carries its card to
//! every bridge, in the stream and the bucket (the one that lost may have put its card
//! last). The one that lost gives the name up (`Core::yield_name`): its agent's
//! connections are refused with their protocol's name-taken error, and no leave is
//! announced; and it hands the winner the name's key and the agent's card where they
//! still name it. The same agent online through two bridges is a clash only in a protocol
//! where one agent may not be (`Endpoint::ONLINE_THROUGH_SEVERAL_BRIDGES`).

use std::sync::Arc;
use std::time::Duration;

use super::claims::FleetClaims;
use super::link::Ready;
use super::wire::{Card, agent_key};
use crate::core::{AgentInfo, BRIDGE_PROTOCOL, Core};
use crate::protocols::registry;

/// How long a bridge whose agent is connected waits before it settles a clash: a bridge
/// whose agent is not gives the name up meanwhile, with no rule.
const CONNECTED_SETTLES_AFTER: Duration = Duration::from_secs(3);

/// How long apart the bucket's card is read again when NATS does not answer.
const ASK_AGAIN_AFTER: Duration = Duration::from_millis(250);

/// Where a card that may show a clash was read.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// Brought by the bucket's watch, perhaps late: settled only once the bucket shows the
    /// clash too.
    FromTheWatch,
    /// From the bucket just now, before this bridge put its own card over it (as NATS is
    /// back, `presence`).
    FromTheBucket,
}

pub struct Clashes {
    pub core: Arc<Core>,
    pub claims: Arc<FleetClaims>,
}

impl Clashes {
    /// Settles, in the background, the clash `there` makes (an agent as another bridge's
    /// card describes it, `there.bridge` naming that bridge) with the agent this bridge
    /// holds under its name, if it makes one.
    pub fn settle(&self, there: &AgentInfo, read: Read) {
        let Some(here) = self.core.directory.get(&there.name) else {
            return;
        };
        if !clash(&here, there) {
            return;
        }
        let (core, claims) = (self.core.clone(), self.claims.clone());
        let there = there.clone();
        tokio::spawn(async move {
            let connected = core.router.is_connected(&here.name);
            let this_bridge = claims.link.bridge_id.clone();
            let (ready, there) = match (connected, read) {
                // Nothing here to refuse: given up on the card just read.
                (false, Read::FromTheBucket) => match claims.link.ready() {
                    Some(ready) => (ready, there),
                    None => return,
                },
                (false, Read::FromTheWatch) => {
                    match clash_in_bucket(&core, &claims, &here, &there).await {
                        Some(clash) => clash,
                        None => return,
                    }
                }
                (true, _) => {
                    tokio::time::sleep(CONNECTED_SETTLES_AFTER).await;
                    match clash_in_bucket(&core, &claims, &here, &there).await {
                        Some(clash) => clash,
                        None => return,
                    }
                }
            };
            let Some(bridge) = there.bridge.clone() else {
                return;
            };
            let name = &here.name;
            let connected = core.router.is_connected(name);
            let keeps = keeps_name((here.created_at, &this_bridge), (there.created_at, &bridge));
            if connected && keeps {
                tracing::warn!(
                    name,
                    other = bridge,
                    "federation: a name held here and on another bridge at once stays here"
                );
                core.announce_status(here.protocol, name, here.status).await;
                return;
            }
            tracing::warn!(
                name,
                other = bridge,
                connected,
                "federation: a name held here and on another bridge at once is given up to it"
            );
            claims.forget_claimed_alone(&here);
            if core.yield_name(there.clone(), &here).await {
                hand_card_over(&ready, &there, &this_bridge).await;
                claims.hand_key_over(&there).await;
            }
        });
    }
}

/// Whether `here` (this bridge's entry of a name) and `there` (another bridge's card of
/// it) hold the name online through both bridges where only one may.
fn clash(here: &AgentInfo, there: &AgentInfo) -> bool {
    let same = here.protocol == there.protocol && here.native_id == there.native_id;
    here.bridge.is_none()
        && there.bridge.is_some()
        && here.online
        && there.online
        && here.protocol != BRIDGE_PROTOCOL
        && !(same && registry::online_through_several_bridges(here.protocol))
}

/// The other bridge's agent as the bucket's card of the name shows it now, if the clash
/// with `here` still stands: the card shows an agent online through the bridge `there`
/// names, and the directory still holds `here`'s agent online. Read again while NATS does
/// not answer, for as long as the directory shows the clash.
async fn clash_in_bucket(
    core: &Core,
    claims: &FleetClaims,
    here: &AgentInfo,
    there: &AgentInfo,
) -> Option<(Arc<Ready>, AgentInfo)> {
    let still_here = || {
        (core.directory.get(&here.name)).is_some_and(|now| {
            now.bridge.is_none()
                && now.online
                && now.protocol == here.protocol
                && now.native_id == here.native_id
        })
    };
    let key = agent_key(&here.name);
    while still_here() {
        let read = match claims.link.ready() {
            Some(ready) => ready.agents.get(&key).await.map(|card| (ready, card)),
            None => {
                tokio::time::sleep(ASK_AGAIN_AFTER).await;
                continue;
            }
        };
        let Ok((ready, card)) = read else {
            tokio::time::sleep(ASK_AGAIN_AFTER).await;
            continue;
        };
        let card = card.and_then(|value| serde_json::from_slice::<Card>(&value).ok())?;
        let now = card.into_info()?;
        return (now.bridge == there.bridge && clash(here, &now)).then_some((ready, now));
    }
    None
}

/// Puts `winner`'s card in place of this bridge's card of the name, if the bucket still
/// holds this bridge's: the bridges that read it show the name where it is held.
async fn hand_card_over(ready: &Ready, winner: &AgentInfo, this_bridge: &str) {
    let key = agent_key(&winner.name);
    let Ok(Some(entry)) = ready.agents.entry(&key).await else {
        return;
    };
    let ours = serde_json::from_slice::<Card>(&entry.value).is_ok_and(|c| c.bridge == this_bridge);
    let Ok(card) = serde_json::to_vec(&Card::of(winner, this_bridge)) else {
        return;
    };
    if ours {
        // Another put came first: it is the winner's, or newer.
        let _ = ready.agents.update(&key, card.into(), entry.revision).await;
    }
}

/// Whether the agent registered at `here` (milliseconds since the epoch, and its bridge)
/// keeps a name from the one registered at `there`: the earlier keeps it, and of two in
/// the same millisecond, the one whose bridge's id sorts first.
fn keeps_name(here: (i64, &str), there: (i64, &str)) -> bool {
    here < there
}

#[cfg(test)]
mod tests {
    use super::{clash, keeps_name};
    use crate::core::AgentInfo;

    #[test]
    fn the_earlier_registration_keeps_the_name_and_the_rule_is_the_same_from_both_sides() {
        for (a, b) in [((5, "b1"), (7, "b0")), ((5, "b0"), (5, "b1"))] {
            assert!(keeps_name(a, b), "{a:?} keeps it from {b:?}");
            assert!(!keeps_name(b, a), "{b:?} gives it to {a:?}");
        }
    }

    #[test]
    fn only_a_name_online_through_two_bridges_where_one_may_be_clashes() {
        let online = |protocol, native: &str, bridge: Option<&str>| {
            let mut info = AgentInfo::new("x", protocol, native);
            (info.online, info.bridge) = (true, bridge.map(str::to_owned));
            info
        };
        let here = online("grid", "x", None);
        assert!(clash(&here, &online("grid", "x", Some("b0"))));
        assert!(clash(&here, &online("synapse", "x", Some("b0"))));
        let mut offline = online("grid", "x", Some("b0"));
        offline.online = false;
        assert!(!clash(&here, &offline));
        // A Tracker member may be online through several bridges; another agent may not.
        let member = online("tracker", "m-1", None);
        assert!(!clash(&member, &online("tracker", "m-1", Some("b0"))));
        assert!(clash(&member, &online("grid", "x", Some("b0"))));
    }
}
