//! Agents moving between bridges of a fleet: an agent another bridge held that connects
//! here is claimed for this bridge (`Core::claim_move`), held here once its connection is
//! attached (`Core::complete_move`), and takes its mail only once the bridge it left has
//! handed it over (`Core::mail_handed_over`). Each move is remembered a while (`Moves`): if
//! the bridge left is killed before it applied the agent's join here, what it was to keep
//! for the agent meanwhile is kept here from what it missed (`federation::missed_mail`).
//! A name the fleet finds held here and by another bridge at once, and settles on the
//! other's agent, is given up to it (`Core::yield_name`).

use std::time::{Duration, Instant};

use dashmap::DashMap;

use super::Core;
use super::claims::{self, Claimed, Claiming};
use super::directory::{AgentInfo, NameTaken};
use super::envelope::Protocol;
use super::records::HandOver;
use crate::telemetry;

/// An agent's name claimed for this bridge as it connects here, from the bridge that held
/// it (`Core::claim_move`). Dropped before its move completed (`Core::complete_move`), the
/// name's claim goes back to that bridge, which holds the agent still.
pub struct MoveClaim {
    info: AgentInfo,
    /// The bridge that held it.
    pub from: String,
    /// The claim in the fleet, and the right to claim the name here, until the move
    /// completes; none for a bridge alone.
    claimed: Option<Claimed>,
}

/// How long a connection of an agent that moved here waits before it takes its mail
/// (`Core::mail_handed_over`): the bridge it left may first have to apply a stretch of the
/// stream and write the mail it kept from it, one record write each, or, gone from the
/// fleet, be taken for gone (a presence TTL) and what it missed be read; meanwhile the
/// agent's connection sends nothing.
const HANDED_OVER_WITHIN: Duration = Duration::from_secs(10);

/// How soon a bridge nobody takes hand-over requests for is asked again.
const ASK_AGAIN_AFTER: Duration = Duration::from_millis(250);

/// How often `wait_while` looks again.
const LOOK_AGAIN_AFTER: Duration = Duration::from_millis(10);

/// How long `Core::claim_move` waits for the leave of an agent still shown online through
/// another bridge before it refuses it: one reconnecting at once is let in.
const LEAVE_ARRIVES_WITHIN: Duration = Duration::from_secs(1);

/// How many times `Core::claim_move` claims an agent's name again when the agent moved on
/// to another bridge while the claim waited for its turn.
const MOVE_CLAIM_TRIES: usize = 3;

/// How long a move is remembered when the bridge left did not say it let the agent go:
/// far longer than a bridge takes to apply a join, or to be taken for gone.
const MOVES_REMEMBERED: Duration = Duration::from_secs(600);

/// Looks again every `LOOK_AGAIN_AFTER` while `busy` holds, until `deadline`; whether it
/// stopped holding by then.
pub async fn wait_while(deadline: tokio::time::Instant, mut busy: impl FnMut() -> bool) -> bool {
    while busy() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(LOOK_AGAIN_AFTER).await;
    }
    true
}

/// The recent moves of agents to this bridge whose bridge left has not said it let them go.
#[derive(Default)]
pub struct Moves {
    recent: DashMap<String, Moved>,
}

struct Moved {
    from: String,
    at: Instant,
    /// Its join here did not reach the fleet (NATS was away): the others learn of the move
    /// from its card alone.
    join_refused: bool,
}

/// An agent that moved here from a bridge (`Moves::moved_from`).
pub struct MovedHere {
    pub name: String,
    /// Whether its join here did not reach the fleet.
    pub join_refused: bool,
}

impl MoveClaim {
    /// The agent moving here, as the bridge it left held it.
    pub fn agent(&self) -> &AgentInfo {
        &self.info
    }
}

impl Moves {
    fn moved(&self, name: &str, from: &str) {
        self.recent
            .retain(|_, moved| moved.at.elapsed() < MOVES_REMEMBERED);
        let moved = Moved {
            from: from.to_owned(),
            at: Instant::now(),
            join_refused: false,
        };
        self.recent.insert(name.to_owned(), moved);
    }

    /// `name`'s join, announcing it here, was not taken by the fleet's log.
    pub(super) fn join_refused(&self, name: &str) {
        if let Some(mut moved) = self.recent.get_mut(name) {
            moved.join_refused = true;
        }
    }

    /// `bridge`, which `name` left, let it go: nothing more of its mail is kept there.
    fn let_go(&self, name: &str, bridge: &str) {
        self.recent.remove_if(name, |_, moved| moved.from == bridge);
    }

    /// The agents that moved here from `bridge` and are remembered still.
    pub fn moved_from(&self, bridge: &str) -> Vec<MovedHere> {
        self.recent
            .retain(|_, moved| moved.at.elapsed() < MOVES_REMEMBERED);
        (self.recent.iter())
            .filter(|moved| moved.from == bridge)
            .map(|moved| MovedHere {
                name: moved.key().clone(),
                join_refused: moved.join_refused,
            })
            .collect()
    }
}

impl Core {
    /// Claims `name` for this bridge as its agent, of `protocol`, connects through it, when
    /// the directory shows it held by another bridge of the fleet (it was connected there,
    /// and is not now): the name's claim comes here (refused while the agent is online
    /// through that bridge). The directory moves it once the connection is attached
    /// (`complete_move`), so that no message routed meanwhile is kept here as mail as well
    /// as there. The claim runs to its end whether or not its caller waits
    /// (`claims::claim_to_the_end`), one claim of the name at a time here, as for a
    /// registration (`ClaimLocks`).
    pub async fn claim_move(
        &self,
        name: &str,
        protocol: Protocol,
    ) -> Result<Option<MoveClaim>, NameTaken> {
        self.leave_arrived(name).await;
        for _ in 0..MOVE_CLAIM_TRIES {
            // Another protocol's agent is not moved: the connection's registration refuses it.
            let Some(mut info) = (self.directory.get(name)).filter(|a| a.protocol == protocol)
            else {
                return Ok(None);
            };
            let Some(from) = info.bridge.take() else {
                return Ok(None);
            };
            self.directory.check_claim(&info, false)?;
            let Some(claims) = self.claims.get() else {
                return Ok(Some(MoveClaim {
                    info,
                    from,
                    claimed: None,
                }));
            };
            let (locks, directory, how) = (&self.claim_locks, &self.directory, Claiming::Held);
            let hand_back_to = Some(from.clone());
            let mut claimed =
                claims::claim_to_the_end(locks, claims, directory, &info, how, hand_back_to)
                    .await?;
            // Read again, now that no other claim of the name runs here: it may have
            // changed while this claim waited for its turn.
            match self.directory.get(name) {
                // Another connection of the agent moved it here: nothing is left to move.
                Some(now) if now.bridge.is_none() => return Ok(None),
                Some(now) if now.is_same_agent(&info) && now.bridge.as_deref() == Some(&from) => {
                    let claimed = Some(claimed);
                    return Ok(Some(MoveClaim {
                        info,
                        from,
                        claimed,
                    }));
                }
                // It moved on to another bridge: the claim goes there, and the move is
                // claimed again from it.
                Some(now) if now.is_same_agent(&info) => claimed.hand_back_to(now.bridge),
                // Gone, or another agent's: the claim is given up, and the connection
                // registers the name as any other.
                _ => {
                    claimed.hand_back_to(None);
                    return Ok(None);
                }
            }
        }
        Err(NameTaken::unsettled(name))
    }

    /// Gives the name `loser`, an agent of this bridge, holds to `winner`, the agent another
    /// bridge holds under it (`winner.bridge`): the fleet found the name held through both
    /// at once and settled it on the other's. `loser`'s connections here are closed with
    /// their protocol's name-taken refusal (`Closed::NameTaken`), and so is any that
    /// attaches while the name is held online elsewhere; no leave is announced (the name
    /// is online elsewhere). Returns whether the name was `loser`'s here.
    pub async fn yield_name(&self, winner: AgentInfo, loser: &AgentInfo) -> bool {
        // Not while a claim of the name runs here: that claim settles first.
        let _lock = self.claim_locks.lock(&winner.name).await;
        let Some(lost) = self.directory.yield_to(winner.clone(), loser) else {
            return false;
        };
        if lost.online {
            telemetry::agent_online(lost.protocol, false);
        }
        self.router.name_lost(&winner.name, &winner);
        true
    }

    /// Ends once `name` is not shown online through another bridge, or after
    /// `LEAVE_ARRIVES_WITHIN`: an agent connecting here the moment it left another bridge
    /// is let in once its leave has come. Whether a connection is open there is not asked:
    /// a card put as a connection attaches may say none for a moment.
    pub async fn leave_arrived(&self, name: &str) {
        let deadline = tokio::time::Instant::now() + LEAVE_ARRIVES_WITHIN;
        let online_elsewhere =
            || (self.directory.get(name)).is_some_and(|a| a.is_online_elsewhere());
        wait_while(deadline, online_elsewhere).await;
    }

    /// Holds the agent `claim` moved here, its connection attached: every bridge sends it
    /// live here from its join on, and none other keeps its mail. Refused (the agent is
    /// online through another bridge since), the claim goes back once `claim` is dropped.
    pub fn complete_move(&self, claim: &mut MoveClaim) -> Result<(), NameTaken> {
        self.directory.register(claim.info.clone())?;
        self.moves.moved(&claim.info.name, &claim.from);
        // Held here: the claim stands, and the next claim of the name may start.
        claim.claimed = None;
        Ok(())
    }

    /// Ends once the mail kept for `agent`, which moved here from `bridge`, in `table` (a
    /// shared records table) can be taken here: a connection takes its agent's mail after
    /// this, then sends it live. From a bridge still in the fleet it is handed over
    /// (`SharedRecords::mail_handed_over`); one gone from it kept nothing more, and the
    /// mail the bridges still here kept for its agents waits while what it missed is read
    /// (`Router::hold_back_mail_of`): this bridge's share of it is kept first. All within
    /// `HANDED_OVER_WITHIN`.
    pub async fn mail_handed_over(&self, agent: &str, bridge: &str, table: &str) {
        let Some(records) = self.records() else {
            return;
        };
        let deadline = tokio::time::Instant::now() + HANDED_OVER_WITHIN;
        let gone = || self.directory.is_gone(bridge);
        let mut asked = false;
        while !gone() {
            asked = true;
            match records
                .mail_handed_over(agent, bridge, table, deadline)
                .await
            {
                HandOver::LetGo => return self.moves.let_go(agent, bridge),
                HandOver::Kept => return,
                // Killed, most likely, and not yet taken for gone — or alive with no one
                // taking the question yet (starting, or resubscribing after a reconnect):
                // asked again shortly, until it answers or is taken for gone.
                HandOver::NoOneThere => {
                    let again = tokio::time::Instant::now() + ASK_AGAIN_AFTER;
                    wait_while(again.min(deadline), || !gone()).await;
                    if tokio::time::Instant::now() >= deadline {
                        break;
                    }
                }
            }
        }
        if asked {
            telemetry::federation_handover("unanswered");
        }
        // Once it is gone, what it missed is read, and this bridge keeps the agent's share.
        wait_while(deadline, || self.router.holds_back_mail_of(bridge)).await;
        let _ = tokio::time::timeout_at(deadline, self.router.flush_offline()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_is_remembered_by_the_bridge_left_until_it_lets_the_agent_go() {
        let moves = Moves::default();
        moves.moved("rover", "b0");
        moves.moved("glider", "b1");
        moves.join_refused("glider");
        let from_b0: Vec<_> = moves.moved_from("b0").into_iter().map(|m| m.name).collect();
        assert_eq!(from_b0, ["rover"]);
        let from_b1 = moves.moved_from("b1");
        assert_eq!(from_b1.len(), 1);
        assert!(from_b1[0].join_refused);
        moves.let_go("rover", "b1");
        assert_eq!(moves.moved_from("b0").len(), 1, "let go by another bridge");
        moves.let_go("rover", "b0");
        assert!(moves.moved_from("b0").is_empty());
        // Moving again from elsewhere replaces the older move.
        moves.moved("glider", "b2");
        assert!(moves.moved_from("b1").is_empty());
        assert!(!moves.moved_from("b2")[0].join_refused);
    }
}
