//! Skynet registrations as records a fleet shares (`core::SharedRecords`): an agent or
//! human registered through any bridge is listed by every bridge's `GET /api/agents` and
//! `/api/humans` under the same id, may join through any of them, and is deleted for all.
//! The fleet's claim on the name is made at registration and moves with the agent to the
//! bridge it joins through (`Core::move_here`). A bridge alone keeps registrations in its
//! own tables only.

use std::sync::{Arc, Weak};

use super::Skynet;
use super::registry::PROFILES;
use crate::core::{RecordChange, RecordSink};

/// Applies the fleet's registrations to this bridge's registry.
struct ProfileSink(Weak<Skynet>);

impl RecordSink for ProfileSink {
    fn apply(
        &self,
        change: RecordChange,
    ) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            let Some(skynet) = self.0.upgrade() else {
                return;
            };
            let id = change.key.clone();
            // Deleted through another bridge while joined here: the member leaves first.
            if change.value.is_none() && skynet.workspace.is_member(&id) {
                skynet.leave(&id).await;
            }
            if let Err(e) = skynet.registry.apply(change).await {
                tracing::error!(error = %e, %id, "skynet: cannot apply a fleet registration");
            }
        })
    }
}

/// Follows the fleet's registrations, when there is a fleet.
pub fn follow(skynet: &Arc<Skynet>) {
    if let Some(records) = skynet.core.records() {
        records.follow(PROFILES, Arc::new(ProfileSink(Arc::downgrade(skynet))));
    }
}
