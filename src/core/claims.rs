//! Names claimed across bridges. A bridge alone needs nothing more than its directory; in a
//! fleet, two bridges registering one name at the same instant must not both win, so a
//! registration is first claimed in a record the whole fleet shares (`federation`).

use std::pin::Pin;

use super::directory::{AgentInfo, NameTaken};

pub type ClaimFuture<'a> = Pin<Box<dyn Future<Output = Result<(), NameTaken>> + Send + 'a>>;

pub trait NameClaims: Send + Sync {
    /// Claims `info.name` for this bridge; refused when another bridge holds it.
    fn claim<'a>(&'a self, info: &'a AgentInfo) -> ClaimFuture<'a>;

    /// Claims `info.name` for this bridge also from another bridge that holds it for the
    /// same agent (the same protocol and native id): an agent registered once for the
    /// whole fleet that connects through another bridge takes its name along. Refused
    /// when another agent holds the name.
    fn move_here<'a>(&'a self, info: &'a AgentInfo) -> ClaimFuture<'a>;

    /// Gives the name up (its agent was unregistered here).
    fn release(&self, name: &str);
}
