//! Names claimed fleet-wide, through a KV bucket of the fleet: a registration creates its
//! name's key (JetStream's create fails if the key exists), so of two bridges registering
//! one name at once, exactly one wins. A name whose holder's bridge is gone (no heartbeat
//! in the bridges bucket) is taken over with a revision check, which is as linearisable.
//! While NATS is away, names are claimed in this bridge's directory alone; a claim NATS
//! does not answer in time is refused.

use std::sync::Arc;

use async_nats::jetstream::kv::CreateErrorKind;
use serde::{Deserialize, Serialize};

use super::link::{NatsLink, Ready, lost_race};
use super::wire::{agent_key, known_protocol};
use crate::core::{AgentInfo, BRIDGE_PROTOCOL, ClaimFuture, NameClaims, NameTaken, Role};

/// Who holds a name, as its key in the names bucket says.
#[derive(Debug, Serialize, Deserialize)]
struct Claim {
    bridge: String,
    protocol: String,
    role: Role,
    /// The agent's id in its protocol (absent in claims made before it was kept).
    #[serde(default)]
    native_id: Option<String>,
}

impl Claim {
    /// Whether the name is held for the agent `info` describes.
    fn is_for(&self, info: &AgentInfo) -> bool {
        self.protocol == info.protocol && self.native_id.as_deref() == Some(&info.native_id)
    }
}

/// Tries at a contended or unanswered claim before it is refused (two seconds' worth).
const ATTEMPTS: usize = 20;
const RETRY_AFTER: std::time::Duration = std::time::Duration::from_millis(100);

pub struct FleetClaims {
    pub link: Arc<NatsLink>,
}

impl FleetClaims {
    /// Claims the name for this bridge; with `moving`, also from a live bridge that holds
    /// it for the same agent.
    async fn claim_in(
        &self,
        ready: &Ready,
        info: &AgentInfo,
        moving: bool,
    ) -> Result<(), NameTaken> {
        let key = agent_key(&info.name);
        let mine = Claim {
            bridge: self.link.bridge_id.clone(),
            protocol: info.protocol.to_owned(),
            role: info.role,
            native_id: Some(info.native_id.clone()),
        };
        let Ok(value) = serde_json::to_vec(&mine) else {
            return Ok(());
        };
        let value = bytes::Bytes::from(value);
        for _ in 0..ATTEMPTS {
            match ready.names.create(&key, value.clone()).await {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == CreateErrorKind::AlreadyExists => {}
                Err(e) => {
                    // A bucket just made may have no leader yet: asked again, not decided
                    // here alone, so that a name never has two holders.
                    tracing::debug!(error = %e, name = %info.name, "federation: claiming a name again");
                    tokio::time::sleep(RETRY_AFTER).await;
                    continue;
                }
            }
            let Ok(Some(entry)) = ready.names.entry(&key).await else {
                tokio::time::sleep(RETRY_AFTER).await;
                continue;
            };
            match serde_json::from_slice::<Claim>(&entry.value) {
                Ok(held) if held.bridge == self.link.bridge_id => return Ok(()),
                Ok(held)
                    if !(moving && held.is_for(info))
                        && self.is_alive(ready, &held.bridge).await =>
                {
                    return Err(NameTaken {
                        name: info.name.clone(),
                        holder_protocol: known_protocol(&held.protocol).unwrap_or(BRIDGE_PROTOCOL),
                        holder_role: match held.role {
                            Role::Agent => "agent",
                            Role::Human => "human",
                        },
                        holder_bridge: Some(held.bridge),
                    });
                }
                // Its holder's bridge is gone, the agent moves here, or the record is not
                // one of ours.
                _ => match ready
                    .names
                    .update(&key, value.clone(), entry.revision)
                    .await
                {
                    Ok(_) => return Ok(()),
                    Err(e) if lost_race(&e) => continue,
                    Err(e) => {
                        tracing::debug!(error = %e, name = %info.name, "federation: taking a name over again");
                        tokio::time::sleep(RETRY_AFTER).await;
                        continue;
                    }
                },
            }
        }
        Err(NameTaken {
            name: info.name.clone(),
            holder_protocol: BRIDGE_PROTOCOL,
            holder_role: "agent",
            holder_bridge: Some("(the fleet could not settle who holds it; try again)".into()),
        })
    }

    /// Whether `bridge` has a heartbeat in the bridges bucket (which forgets one a few
    /// TTLs old): a bridge that has just stopped keeps its names a little longer, rather
    /// than a name ever having two holders.
    async fn is_alive(&self, ready: &Ready, bridge: &str) -> bool {
        !matches!(ready.bridges.get(bridge).await, Ok(None))
    }
}

impl NameClaims for FleetClaims {
    fn claim<'a>(&'a self, info: &'a AgentInfo) -> ClaimFuture<'a> {
        Box::pin(async move {
            match self.link.ready() {
                Some(ready) => self.claim_in(&ready, info, false).await,
                None => Ok(()),
            }
        })
    }

    fn move_here<'a>(&'a self, info: &'a AgentInfo) -> ClaimFuture<'a> {
        Box::pin(async move {
            match self.link.ready() {
                Some(ready) => self.claim_in(&ready, info, true).await,
                None => Ok(()),
            }
        })
    }

    fn release(&self, name: &str) {
        let Some(ready) = self.link.ready() else {
            return;
        };
        let key = agent_key(name);
        let bridge = self.link.bridge_id.clone();
        tokio::spawn(async move {
            let Ok(Some(entry)) = ready.names.entry(&key).await else {
                return;
            };
            let ours =
                serde_json::from_slice::<Claim>(&entry.value).is_ok_and(|c| c.bridge == bridge);
            if ours {
                let _ = ready
                    .names
                    .delete_expect_revision(&key, Some(entry.revision))
                    .await;
            }
        });
    }
}
