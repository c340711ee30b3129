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
/// would refuse it on every other bridge. A name moved here is still the same agent's,
/// and kept.
pub struct Claimed {
    claims: Arc<dyn NameClaims>,
    directory: Arc<Directory>,
    info: AgentInfo,
    how: Claiming,
    lock: Option<NameLock>,
}

impl Drop for Claimed {
    fn drop(&mut self) {
        let held_here = (self.directory.get(&self.info.name)).is_some_and(|a| a.bridge.is_none());
        if self.how == Claiming::Move || held_here {
            return;
        }
        let (claims, info, lock) = (self.claims.clone(), self.info.clone(), self.lock.take());
        tokio::spawn(async move {
            claims.give_up(&info).await;
            drop(lock);
        });
    }
}

/// Claims `info.name` through `claims` as `how` allows, once the directory here would
/// register it, in a task of its own: a caller dropped mid-claim (its client went away
/// while NATS was slow to answer) does not stop it half-way, with the name perhaps claimed
/// in NATS; what it claimed is given up once it settles (`Claimed`, dropped unread with
/// the channel).
pub async fn claim_to_the_end(
    locks: &Arc<ClaimLocks>,
    claims: &Arc<dyn NameClaims>,
    directory: &Arc<Directory>,
    info: &AgentInfo,
    how: Claiming,
) -> Result<Claimed, NameTaken> {
    let (locks, claims, directory) = (locks.clone(), claims.clone(), directory.clone());
    let info = info.clone();
    let name = info.name.clone();
    let (answer, answered) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let lock = locks.lock(&info.name).await;
        let claimed = match directory.check_claim(&info) {
            Ok(()) => claims.claim(&info, how).await,
            Err(taken) => Err(taken),
        };
        let claimed = claimed.map(|()| Claimed {
            claims,
            directory,
            info,
            how,
            lock: Some(lock),
        });
        let _ = answer.send(claimed);
    });
    answered
        .await
        .unwrap_or_else(|_| Err(NameTaken::unsettled(&name)))
}
