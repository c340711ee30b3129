//! Synapse groups as records a fleet shares (`core::SharedRecords`): a group created through
//! any bridge is one group — every bridge lists it, routes a message for it to its members
//! wherever they are, and takes joins and leaves of it. A change reads the fleet's record,
//! makes the change (with its checks) on what it read, and writes it back at that revision,
//! again when another write came first: two joins through two bridges at once both count,
//! and the member limit holds. A bridge alone keeps its groups in its own tables only.

use std::sync::Arc;
use std::time::Duration;

use tonic::Status;

use super::agents::{internal, not_recorded};
use super::{Group, Synapse};
use crate::core::{
    Expect, Record, RecordChange, RecordError, Revision, SharedRecords, Tried, sink, unless_lost,
    until_not_lost,
};
use crate::store::StoreError;

/// The table of groups in the fleet's records, keyed by group id.
const GROUPS: &str = "synapse-groups";

/// Reads of a group neither the fleet nor this bridge has, before it is not found.
const UNSEEN_ATTEMPTS: usize = 5;
const UNSEEN_AFTER: Duration = Duration::from_millis(20);

/// Follows the fleet's groups, when there is a fleet.
pub fn follow(synapse: &Arc<Synapse>) {
    if let Some(records) = synapse.core.records() {
        records.follow(GROUPS, sink(synapse, "synapse group", apply_change));
    }
}

async fn apply_change(synapse: Arc<Synapse>, change: RecordChange) -> Result<(), StoreError> {
    let group = change.value.as_deref().map(decode).transpose()?;
    synapse
        .apply_group(&change.key, group, change.revision)
        .await
}

fn encode(group: &Group) -> bytes::Bytes {
    serde_json::to_vec(group)
        .expect("a group is plain data")
        .into()
}

fn decode(value: &[u8]) -> Result<Group, StoreError> {
    serde_json::from_slice(value).map_err(|e| StoreError::Corrupt(format!("a shared group: {e}")))
}

impl Synapse {
    /// Creates `group` in the fleet's records, then here.
    pub(super) async fn create_shared_group(
        &self,
        records: &dyn SharedRecords,
        group: &Group,
    ) -> Result<(), Status> {
        let revision = records
            .write(GROUPS, &group.row.id, encode(group), Expect::Absent)
            .await
            .map_err(refused)?;
        self.apply_group(&group.row.id, Some(group.clone()), revision)
            .await
            .map_err(internal)
    }

    /// Makes `change` to group `id` as the fleet holds it; its refusal, or `not_found`
    /// when there is no such group.
    pub(super) async fn change_shared_group<T>(
        &self,
        records: &dyn SharedRecords,
        id: &str,
        change: impl Fn(&mut Group) -> Result<T, Status>,
    ) -> Result<T, Status> {
        let changed = until_not_lost::<_, Status, _, _>(|| async {
            let (mut group, expected) = self.current_group(records, id).await?;
            let out = change(&mut group)?;
            let written = records.write(GROUPS, id, encode(&group), expected).await;
            let Some(revision) = unless_lost(written).map_err(refused)? else {
                return Ok(Tried::Lost);
            };
            self.apply_group(id, Some(group), revision)
                .await
                .map_err(internal)?;
            Ok(Tried::Done(out))
        })
        .await?;
        changed.ok_or_else(|| refused(RecordError::Conflict))
    }

    /// Removes group `id` from the fleet's records, then here.
    pub(super) async fn remove_shared_group(
        &self,
        records: &dyn SharedRecords,
        id: &str,
    ) -> Result<(), Status> {
        self.current_group(records, id).await?;
        records.remove(GROUPS, id).await.map_err(refused)?;
        // Removed here at once; the revision the watch brings is applied over it.
        self.forget_group(id);
        Ok(())
    }

    /// Group `id` as the fleet holds it, with what a write of it expects; one this bridge
    /// made before it was one of a fleet is taken from here.
    async fn current_group(
        &self,
        records: &dyn SharedRecords,
        id: &str,
    ) -> Result<(Group, Expect), Status> {
        for attempt in 0..UNSEEN_ATTEMPTS {
            if attempt > 0 {
                // A replica may answer before it has the create.
                tokio::time::sleep(UNSEEN_AFTER).await;
            }
            match records.read(GROUPS, id).await.map_err(refused)? {
                Some(Record {
                    value: Some(value),
                    revision,
                }) => return Ok((decode(&value).map_err(internal)?, Expect::At(revision))),
                Some(Record { value: None, .. }) => break,
                None => {
                    if let Ok(group) = self.group(id) {
                        return Ok((group, Expect::Absent));
                    }
                }
            }
        }
        Err(Status::not_found(format!("group '{id}' not found")))
    }

    /// Makes this bridge's group `id` what the fleet's record at `revision` says.
    async fn apply_group(
        &self,
        id: &str,
        group: Option<Group>,
        revision: Revision,
    ) -> Result<(), StoreError> {
        let rows = group.clone().map(|g| (g.row, g.members));
        if !self.db.apply_group(id, rows, revision).await? {
            return Ok(());
        }
        // The writer's own apply and the watch's may finish out of order: the newer stays.
        let mut applied = self.group_revisions.entry(id.to_owned()).or_default();
        if *applied >= revision {
            return Ok(());
        }
        *applied = revision;
        match group {
            Some(group) => self.keep_group(group),
            None => self.forget_group(id),
        }
        Ok(())
    }
}

/// A change the fleet's records did not take, as gRPC says it.
fn refused(e: RecordError) -> Status {
    not_recorded("group", e)
}
