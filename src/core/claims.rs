//! Names claimed across bridges. A bridge alone needs nothing more than its directory; in a
//! fleet, two bridges registering one name at the same instant must not both win, so a
//! registration is first claimed in a record the whole fleet shares (`federation`).

use std::pin::Pin;
use std::sync::Arc;

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

    /// Gives `agent`'s name up (it was unregistered here): the claim this bridge holds,
    /// or a registration's wherever it is (the registration is gone for the fleet).
    fn release(&self, agent: &AgentInfo);
}

/// A name the fleet holds for this bridge from a claim, until the directory holds it here
/// too. Dropped while the directory does not (the registration was refused, or its caller
/// went away mid-claim), the claim is given up: the fleet never keeps a name for this
/// bridge that no agent here holds, which would refuse it on every other bridge. A name
/// moved here is still the same agent's, and kept.
pub struct Claimed {
    claims: Arc<dyn NameClaims>,
    directory: Arc<Directory>,
    info: AgentInfo,
    how: Claiming,
}

impl Drop for Claimed {
    fn drop(&mut self) {
        let held_here = (self.directory.get(&self.info.name)).is_some_and(|a| a.bridge.is_none());
        if self.how != Claiming::Move && !held_here {
            self.claims.release(&self.info);
        }
    }
}

/// Claims `info.name` through `claims` as `how` allows, in a task of its own: a caller
/// dropped mid-claim (its client went away while NATS was slow to answer) does not stop it
/// half-way, with the name perhaps claimed in NATS; what it claimed is given up once it
/// settles (`Claimed`, dropped unread with the channel).
pub async fn claim_to_the_end(
    claims: &Arc<dyn NameClaims>,
    directory: &Arc<Directory>,
    info: &AgentInfo,
    how: Claiming,
) -> Result<Claimed, NameTaken> {
    let (claims, directory, info) = (claims.clone(), directory.clone(), info.clone());
    let name = info.name.clone();
    let (answer, answered) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let claimed = claims.claim(&info, how).await;
        let claimed = claimed.map(|()| Claimed {
            claims,
            directory,
            info,
            how,
        });
        let _ = answer.send(claimed);
    });
    answered
        .await
        .unwrap_or_else(|_| Err(NameTaken::unsettled(&name)))
}
