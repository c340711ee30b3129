//! Tracker tasks, their checklists and members as records a fleet shares
//! (`core::SharedRecords`).
//!
//! A task created, taken or changed through any bridge is one task, and `take` is atomic
//! fleet-wide. A change reads the fleet's record, applies to it what the client asked, and
//! writes it back at the revision it read: a second writer in between makes the write
//! fail, and the change is made again on what that writer left (so the second taker is
//! told who holds the task). Every bridge, the writer's too, applies each revision to its
//! own tables, where reads are served from, and tells its own connections with the task
//! events. Checklists are changed the same way (`steps`). A member created over REST
//! (`POST /members`) is created in the fleet's records, and every bridge keeps it and
//! accepts its token (members declared in `bridge.toml` are alike on every bridge that
//! declares them). A bridge alone keeps all of these in its tables only.

use std::sync::Arc;

use super::db::{MemberRow, TaskRow};
use super::tasks::{Refused, WriteError};
use super::{Tracker, directory_entry};
use crate::core::{
    Expect, RecordChange, RecordError, Revision, SharedRecords, Tried, sink, unless_lost,
    until_not_lost,
};
use crate::store::StoreError;

/// The table of tasks in the fleet's records.
pub const TASKS: &str = "tracker-tasks";

/// The table of members created over REST, keyed by slug.
pub const MEMBERS: &str = "tracker-members";

/// The table of task checklists, keyed by task id (`steps`).
pub const STEPS: &str = "tracker-steps";

/// Applies a change of the fleet's tasks to this bridge's tables.
async fn apply_task_change(tracker: Arc<Tracker>, change: RecordChange) -> Result<(), StoreError> {
    match change.value {
        Some(value) => tracker
            .apply_task(decode(&value)?, change.revision)
            .await
            .map(drop),
        None => tracker.remove_task(&change.key).await.map(drop),
    }
}

/// Applies a change of the fleet's task checklists to this bridge's tables.
async fn apply_steps_change(tracker: Arc<Tracker>, change: RecordChange) -> Result<(), StoreError> {
    let steps = change.value.as_deref().map(decode).transpose()?;
    (tracker.apply_steps(&change.key, steps.unwrap_or_default(), change.revision)).await
}

/// Applies a change of the fleet's members to this bridge's. Members are not removed (the
/// protocol has no way to), so a removal is none.
async fn apply_member_change(
    tracker: Arc<Tracker>,
    change: RecordChange,
) -> Result<(), StoreError> {
    match change.value {
        Some(value) => tracker.apply_member(decode(&value)?).await,
        None => Ok(()),
    }
}

pub(super) use crate::protocols::record_json::{decode, encode};

impl Tracker {
    /// Follows the fleet's tasks, their steps and members, when there is a fleet.
    pub fn follow_shared(self: &Arc<Self>) {
        if let Some(records) = self.core.records() {
            records.follow(MEMBERS, sink(self, "tracker member", apply_member_change));
            records.follow(TASKS, sink(self, "tracker task", apply_task_change));
            records.follow(STEPS, sink(self, "tracker checklist", apply_steps_change));
        }
    }

    /// Creates `member` in the fleet's records (`Conflict` when one with its slug
    /// exists), then here.
    pub(super) async fn create_shared_member(
        &self,
        records: &dyn SharedRecords,
        member: MemberRow,
    ) -> Result<MemberRow, WriteError> {
        records
            .write(MEMBERS, &member.slug, encode(&member), Expect::Absent)
            .await?;
        Ok(self.keep_member(member).await?)
    }

    /// A member the fleet created (through this bridge or another): kept here, its token
    /// accepted, its slug in this bridge's directory unless an agent online through
    /// another bridge has it.
    async fn apply_member(&self, member: MemberRow) -> Result<(), StoreError> {
        match self.members.get(&member.slug) {
            Some(known) if *known == member => return Ok(()),
            // Declared here under the same slug (ids of declared members derive from slugs):
            // this bridge's own member and token stay.
            Some(known) if known.id != member.id => {
                tracing::warn!(slug = %member.slug, "tracker: a shared member's slug is a member of this bridge's own; not applied");
                return Ok(());
            }
            _ => {}
        }
        if let Err(e) = self.core.directory.register(directory_entry(&member)) {
            tracing::debug!(reason = %e, "tracker: a shared member's slug is held here by another");
        }
        self.keep_member(member).await.map(drop)
    }

    /// Stores `member` (over one of its slug: the fleet's record may come first) and
    /// accepts its token.
    pub(super) async fn keep_member(&self, member: MemberRow) -> Result<MemberRow, StoreError> {
        let stored = self.db.put_member(member, true).await?;
        self.members.insert(stored.clone());
        Ok(stored)
    }

    /// Creates `task` in the fleet's records (refused with `Conflict` when a task with its
    /// id exists), then here.
    pub(super) async fn create_shared(
        &self,
        records: &dyn SharedRecords,
        task: TaskRow,
    ) -> Result<TaskRow, WriteError> {
        // A removed task is not made again (the same task from another protocol, late).
        if self.db.is_removed(&task.id).await? {
            return Err(RecordError::Conflict.into());
        }
        let revision = records
            .write(TASKS, &task.id, encode(&task), Expect::Absent)
            .await?;
        Ok(self.apply_task(task, revision).await?)
    }

    /// Applies `change` to the fleet's record of task `id`: (before, after), or why not.
    pub(super) async fn change_shared<F>(
        &self,
        records: &dyn SharedRecords,
        id: &str,
        change: F,
    ) -> Result<Result<(TaskRow, TaskRow), Refused>, WriteError>
    where
        F: Fn(&mut TaskRow) -> Result<(), String>,
    {
        let changed = until_not_lost::<_, WriteError, _, _>(|| async {
            let Some((before, expected)) = self.current(records, id).await? else {
                return Ok(Tried::Done(Err(Refused::Missing)));
            };
            let mut after = before.clone();
            if let Err(reason) = change(&mut after) {
                return Ok(Tried::Done(Err(Refused::Conflict(reason))));
            }
            if after == before && expected != Expect::Absent {
                // Answered with the record the decision was made on, which this bridge may
                // not have applied yet.
                let mut current = before;
                self.localise(&mut current)?;
                return Ok(Tried::Done(Ok((current.clone(), current))));
            }
            after.updated_at = crate::core::now_ms();
            let written = records.write(TASKS, id, encode(&after), expected).await;
            let Some(revision) = unless_lost(written)? else {
                return Ok(Tried::Lost);
            };
            let after = self.apply_task(after, revision).await?;
            let mut before = before;
            self.localise(&mut before)?;
            Ok(Tried::Done(Ok((before, after))))
        })
        .await?;
        changed.ok_or(RecordError::Conflict.into())
    }

    /// Removes task `id` from the fleet's records, then here.
    pub(super) async fn delete_shared(
        &self,
        records: &dyn SharedRecords,
        id: &str,
    ) -> Result<Option<TaskRow>, WriteError> {
        let Some((existing, _)) = self.current(records, id).await? else {
            return Ok(None);
        };
        records.remove(TASKS, id).await?;
        // Its steps go with it here (by cascade); the fleet's record of them is let go.
        if let Err(e) = records.remove(STEPS, id).await {
            tracing::debug!(error = %e, task = %id, "tracker: a removed task's steps stay in the fleet's records");
        }
        self.remove_task(id).await?;
        Ok(Some(existing))
    }

    /// Task `id` as the fleet holds it, with what a write of it expects; `None` when there
    /// is none or it was removed. A task this bridge made before it was one of a fleet is
    /// taken from its table, and joins the fleet's records with its first write.
    async fn current(
        &self,
        records: &dyn SharedRecords,
        id: &str,
    ) -> Result<Option<(TaskRow, Expect)>, WriteError> {
        Ok(match records.read(TASKS, id).await? {
            Some(record) => match &record.value {
                Some(value) => Some((decode(value)?, Expect::At(record.revision))),
                None => None,
            },
            None => self.db.task(id).await?.map(|local| (local, Expect::Absent)),
        })
    }

    /// Makes this bridge's row of the task what the fleet's record at `revision` says,
    /// unless it has applied that revision or a later one (or the task's removal), and
    /// tells its connections what changed. The task as this revision has it.
    async fn apply_task(
        &self,
        mut task: TaskRow,
        revision: Revision,
    ) -> Result<TaskRow, StoreError> {
        self.localise(&mut task)?;
        let applied = (self.db)
            .apply_task(task.clone(), revision, self.task_events.on_commit())
            .await?;
        match applied {
            Some((before, after)) => {
                if before.is_none() {
                    self.chats.index(&after);
                    self.apply_pending_steps(&after.id).await?;
                } else if let Err(e) = self.apply_pending_steps(&after.id).await {
                    // Steps whose write failed as the task came: they wait for its next change.
                    tracing::warn!(error = %e, task = %after.id, "tracker: cannot write a task's steps yet");
                }
                Ok(after)
            }
            // Applied already (the watch came first, or an earlier try of this change),
            // or overtaken since: what the writer is answered with is still its own write.
            None => {
                self.applied_task_again(&task.id).await?;
                Ok(task)
            }
        }
    }

    /// Puts `task` in this bridge's project of its slug: projects are declared alike on
    /// every bridge, and ids made before they were derived from slugs differ.
    fn localise(&self, task: &mut TaskRow) -> Result<(), StoreError> {
        let projects = self.chats.projects.load();
        let Some(project) = projects.iter().find(|p| p.slug == task.project_slug) else {
            return Err(StoreError::Corrupt(format!(
                "task {} is in project '{}', which this bridge does not declare",
                task.id, task.project_slug
            )));
        };
        task.project_id.clone_from(&project.id);
        Ok(())
    }

    /// Removes task `id` here for good, as the fleet did.
    async fn remove_task(&self, id: &str) -> Result<Option<TaskRow>, StoreError> {
        let removed = self.db.remove_task(id).await?;
        self.pending_steps.remove(id);
        if let Some(task) = &removed {
            self.chats.forget(task);
        }
        Ok(removed)
    }
}
