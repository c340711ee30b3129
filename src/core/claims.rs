//! Names claimed across bridges. A bridge alone needs nothing more than its directory; in a
//! fleet, two bridges registering one name at the same instant must not both win, so a
//! registration is first claimed in a record the whole fleet shares (`federation`).

use std::pin::Pin;

use super::directory::{AgentInfo, NameTaken};

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
