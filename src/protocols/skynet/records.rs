//! Skynet registrations as records a fleet shares (`core::SharedRecords`): an agent or
//! human registered through any bridge is listed by every bridge's `GET /api/agents` and
//! `/api/humans` under the same id, may join through any of them, and is deleted for all.
//! The fleet's claim on the name is made at registration and moves with the agent to the
//! bridge it joins through (`Core::move_here`). A bridge alone keeps registrations in its
//! own tables only.

use std::sync::Arc;

use super::Skynet;
use super::registry::PROFILES;
use crate::core::{RecordChange, sink};
use crate::store::StoreError;

/// Follows the fleet's registrations, when there is a fleet.
pub fn follow(skynet: &Arc<Skynet>) {
    if let Some(records) = skynet.core.records() {
        records.follow(PROFILES, sink(skynet, "skynet registration", apply));
    }
}

async fn apply(skynet: Arc<Skynet>, change: RecordChange) -> Result<(), StoreError> {
    // Deleted through another bridge while joined here: the member leaves first.
    if change.value.is_none() && skynet.workspace.is_member(&change.key) {
        skynet.leave(&change.key).await;
    }
    skynet.registry.apply(change).await
}
