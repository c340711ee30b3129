//! Names claimed across bridges. A bridge alone needs nothing more than its directory; in a
//! fleet, two bridges registering one name at the same instant must not both win, so a
//! registration is first claimed in a record the whole fleet shares (`federation`).

use std::pin::Pin;
use std::sync::Arc;

use dashmap::DashMap;

use super::directory::{AgentInfo, Directory, NameTaken};

pub type ClaimFuture<'a> = Pin<Box<dyn Future<Output = Result<(), NameTaken>> + Send + 'a>>;

/// What a claim is for, which says who may take the name from whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claiming {
    /// An agent this bridge holds: the same agent (the same protocol and native id) takes
    /// the name to another bridge while it is not online here; once this bridge is gone,
    /// another agent may take it.
    Held,
    /// A registration the whole fleet keeps (a shared record): the name stays its own after
    /// the bridge that claimed it is gone; only the same agent (the same protocol and
    /// native id) may take it to another bridge.
    Registration,
    /// An agent the fleet registered, connecting through this bridge: the name comes here
    /// from the bridge that holds it for the same agent, unless it is online there.
    Move,
}

pub trait NameClaims: Send + Sync {
    /// Claims `info.name` for this bridge, as `how` allows; refused, naming the holder,
    /// when another bridge holds it.
    fn claim<'a>(&'a self, info: &'a AgentInfo, how: Claiming) -> ClaimFuture<'a>;

    /// Gives `agent`'s name up (it was unregistered here, or a claim given up could not be
    /// at once): the claim this bridge holds, or a registration's wherever it is (the
    /// registration is gone for the fleet). In the background, until NATS takes it.
    fn release(&self, agent: &AgentInfo);

    /// Gives up a claim this bridge just made for `agent`, which no agent here holds: tried
    /// until it lands, for as long as a claim waits, before the future ends; then as
    /// `release` does.
    fn give_up<'a>(&'a self, agent: &'a AgentInfo)
    -> Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

    /// Writes the claim of `holder`'s name as its bridge's (`holder.bridge`), if it is still
    /// this bridge's claim for `loser`: the name is `holder`'s, held there, and this
    /// bridge's claim of it was not to stand (a clash settled on the other, or a move that
    /// did not complete). Tried for as long as a claim waits, and then left: the key names
    /// this bridge until the name's next claim.
    fn hand_over<'a>(
        &'a self,
        holder: &'a AgentInfo,
        loser: &'a AgentInfo,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>>;
}

/// Claims of one name on this bridge, one at a time: each is settled (its agent
/// registered in the directory, or the claim given up) before the next claim of the name
/// starts. So the fleet's key for a name this bridge holds describes the agent the
/// directory holds it for (of two agents registering one name here at once, the second is
/// refused by the directory, not let through by the key the first made), and a claim given
/// up never deletes a key that a later claim found and relies on (unless NATS did not
/// answer for as long as a claim waits, and the release went on in the background).
#[derive(Default)]
pub struct ClaimLocks(DashMap<String, Arc<tokio::sync::Mutex<()>>>);

impl ClaimLocks {
    pub(super) async fn lock(self: &Arc<Self>, name: &str) -> NameLock {
        let lock = self.0.entry(name.to_owned()).or_default().clone();
        NameLock {
            locks: self.clone(),
            name: name.to_owned(),
            guard: Some(lock.lock_owned().await),
        }
    }
}

/// The right to claim a name on this bridge (`ClaimLocks`), until dropped.
pub(super) struct NameLock {
    locks: Arc<ClaimLocks>,
    name: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for NameLock {
    fn drop(&mut self) {
        drop(self.guard.take());
        // Forgotten once nobody holds or waits for it (each holds a clone), so that names
        // claimed once do not stay in memory.
        (self.locks.0).remove_if(&self.name, |_, lock| Arc::strong_count(lock) == 1);
    }
}

/// A name the fleet holds for this bridge from a claim, until the directory holds it here
/// too; no other claim of the name starts here meanwhile (`ClaimLocks`). Dropped while
/// the directory does not hold the name here (another bridge's agent holds it, or the
/// caller went away mid-claim), the claim is given up before the next claim of the name
/// starts: the fleet never keeps a name for this bridge that no agent here holds, which
/// would refuse it on every other bridge. A registration moved here is still the same
/// agent's, and kept; a held agent's name claimed from the bridge that holds it
/// (`hand_back_to`) goes back to that bridge.
pub struct Claimed {
    claims: Arc<dyn NameClaims>,
    directory: Arc<Directory>,
    info: AgentInfo,
    how: Claiming,
    hand_back_to: Option<String>,
    lock: Option<NameLock>,
}

impl Claimed {
    /// Where the claim goes if it is dropped while the directory does not hold the name
    /// here: handed to `bridge`, which holds the same agent, or given up.
    pub(super) fn hand_back_to(&mut self, bridge: Option<String>) {
        self.hand_back_to = bridge;
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        let held_here = (self.directory.get(&self.info.name)).is_some_and(|a| a.bridge.is_none());
        if self.how == Claiming::Move || held_here {
            return;
        }
        let (claims, info, lock) = (self.claims.clone(), self.info.clone(), self.lock.take());
        let hand_back_to = self.hand_back_to.take();
        tokio::spawn(async move {
            match hand_back_to {
                Some(bridge) => {
                    let holder = AgentInfo {
                        bridge: Some(bridge),
                        ..info.clone()
                    };
                    claims.hand_over(&holder, &info).await;
                }
                None => claims.give_up(&info).await,
            }
            drop(lock);
        });
    }
}

/// Claims `info.name` through `claims` as `how` allows, once the directory here would
/// register it, in a task of its own: a caller dropped mid-claim (its client went away
/// while NATS was slow to answer) does not stop it half-way, with the name perhaps claimed
/// in NATS; what it claimed is given up, or handed back to `hand_back_to`, once it settles
/// (`Claimed`, dropped unread with the channel).
pub async fn claim_to_the_end(
    locks: &Arc<ClaimLocks>,
    claims: &Arc<dyn NameClaims>,
    directory: &Arc<Directory>,
    info: &AgentInfo,
    how: Claiming,
    hand_back_to: Option<String>,
) -> Result<Claimed, NameTaken> {
    let (locks, claims, directory) = (locks.clone(), claims.clone(), directory.clone());
    let info = info.clone();
    let name = info.name.clone();
    let (answer, answered) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let lock = locks.lock(&info.name).await;
        let claimed = match directory.check_claim(&info, how == Claiming::Move) {
            Ok(()) => claims.claim(&info, how).await,
            Err(taken) => Err(taken),
        };
        let claimed = claimed.map(|()| Claimed {
            claims,
            directory,
            info,
            how,
            hand_back_to,
            lock: Some(lock),
        });
        let _ = answer.send(claimed);
    });
    answered
        .await
        .unwrap_or_else(|_| Err(NameTaken::unsettled(&name)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;
    use tokio::sync::Notify;

    /// Claims that land once `land` is notified, and what became of them afterwards.
    #[derive(Default)]
    struct SlowClaims {
        started: Notify,
        land: Notify,
        after: Mutex<Vec<String>>,
    }

    impl SlowClaims {
        fn note(&self, what: String) {
            self.after.lock().push(what);
        }

        /// What became of the claims, once something did (within a bound).
        async fn settled(&self) -> Vec<String> {
            for _ in 0..500 {
                let after = self.after.lock().clone();
                if !after.is_empty() {
                    return after;
                }
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            Vec::new()
        }
    }

    impl NameClaims for SlowClaims {
        fn claim<'a>(&'a self, _: &'a AgentInfo, _: Claiming) -> ClaimFuture<'a> {
            Box::pin(async move {
                self.started.notify_one();
                self.land.notified().await;
                Ok(())
            })
        }

        fn release(&self, agent: &AgentInfo) {
            self.note(format!("released {}", agent.name));
        }

        fn give_up<'a>(
            &'a self,
            agent: &'a AgentInfo,
        ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
            Box::pin(async move { self.note(format!("gave up {}", agent.name)) })
        }

        fn hand_over<'a>(
            &'a self,
            holder: &'a AgentInfo,
            _: &'a AgentInfo,
        ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
            let to = holder.bridge.clone().unwrap_or_default();
            Box::pin(async move { self.note(format!("handed {} to {to}", holder.name)) })
        }
    }

    /// Claims `mover`, which bridge b0 holds, for this bridge, and drops the caller while
    /// the claim waits; then lets the claim land. What became of it.
    async fn claim_dropped_mid_way(hand_back_to: Option<String>) -> Vec<String> {
        let claims = Arc::new(SlowClaims::default());
        let directory = Arc::new(Directory::new());
        let mut held = AgentInfo::new("mover", "synapse", "mover");
        held.bridge = Some("b0".into());
        directory.register_replica(held.clone());
        let info = AgentInfo {
            bridge: None,
            ..held
        };
        let claiming = tokio::spawn({
            let (claims, directory) = (claims.clone() as Arc<dyn NameClaims>, directory.clone());
            async move {
                let locks = Arc::default();
                let how = Claiming::Held;
                claim_to_the_end(&locks, &claims, &directory, &info, how, hand_back_to)
                    .await
                    .map(drop)
            }
        });
        claims.started.notified().await;
        claiming.abort();
        assert!(claiming.await.unwrap_err().is_cancelled());
        claims.land.notify_one();
        claims.settled().await
    }

    #[tokio::test]
    async fn a_name_taken_from_its_holder_for_a_caller_gone_mid_claim_goes_back_to_it() {
        let after = claim_dropped_mid_way(Some("b0".into())).await;
        assert_eq!(after, ["handed mover to b0"]);
    }

    #[tokio::test]
    async fn a_name_claimed_for_a_caller_gone_mid_claim_is_given_up() {
        let after = claim_dropped_mid_way(None).await;
        assert_eq!(after, ["gave up mover"]);
    }
}
