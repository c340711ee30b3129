//! Skynet state as records a fleet shares (`core::SharedRecords`).
//!
//! - Registrations: an agent or human registered through any bridge is listed by every
//!   bridge's `GET /api/agents` and `/api/humans` under the same id, may join through any
//!   of them, and is deleted for all. The fleet's claim on the name is made at
//!   registration and moves with the agent to the bridge it joins through
//!   (`Core::move_here`).
//! - Watches: which agents each human watches (`POST /api/agents/:id/watch`), one record
//!   a pair, so that a human is sent the execution logs of an agent it watches whichever
//!   bridges the two joined through and whichever bridge was asked.
//!
//! A bridge alone keeps registrations in its own tables only, and watches in memory.

use std::sync::Arc;

use bytes::Bytes;

use super::Skynet;
use super::registry::PROFILES;
use crate::core::{Expect, RecordChange, RecordError, sink};
use crate::store::StoreError;

/// The fleet's watches, keyed by `[human, agent]` (names, as JSON).
const WATCHES: &str = "skynet-watches";

/// Follows the fleet's registrations and watches, when there is a fleet.
pub fn follow(skynet: &Arc<Skynet>) {
    if let Some(records) = skynet.core.records() {
        records.follow(PROFILES, sink(skynet, "skynet registration", apply));
        records.follow(WATCHES, sink(skynet, "skynet watch", apply_watch));
    }
}

async fn apply(skynet: Arc<Skynet>, change: RecordChange) -> Result<(), StoreError> {
    // Deleted through another bridge while joined here: the member leaves first.
    if change.value.is_none() && skynet.workspace.is_member(&change.key) {
        skynet.leave(&change.key).await;
    }
    skynet.registry.apply(change).await
}

/// `human` watches `agent` (`on`) or no longer does: for the whole fleet, when there is
/// one, then here.
pub async fn watch(skynet: &Skynet, human: &str, agent: &str, on: bool) -> Result<(), RecordError> {
    if let Some(records) = skynet.core.records() {
        let key = serde_json::json!([human, agent]).to_string();
        if on {
            let value = Bytes::from_static(b"{}");
            match records.write(WATCHES, &key, value, Expect::Absent).await {
                // Watched already.
                Ok(_) | Err(RecordError::Conflict) => {}
                Err(e) => return Err(e),
            }
        } else {
            records.remove(WATCHES, &key).await?;
        }
    }
    skynet.workspace.watch(human, agent, on);
    Ok(())
}

/// Forgets every watch `name` is in, as the human or as the agent, for the whole fleet:
/// a registration deleted takes its watches with it, so that one made later under its
/// name starts with none.
pub async fn forget_watches(skynet: &Skynet, name: &str) -> Result<(), RecordError> {
    for (human, agent) in skynet.workspace.watches_of(name) {
        watch(skynet, &human, &agent, false).await?;
    }
    Ok(())
}

async fn apply_watch(skynet: Arc<Skynet>, change: RecordChange) -> Result<(), StoreError> {
    match serde_json::from_str::<(String, String)>(&change.key) {
        Ok((human, agent)) => (skynet.workspace).watch(&human, &agent, change.value.is_some()),
        Err(e) => {
            tracing::warn!(error = %e, key = %change.key, "skynet: a watch record's key is not [human, agent]")
        }
    }
    Ok(())
}
