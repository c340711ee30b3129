//! Tracker tasks as records a fleet shares (`core::SharedRecords`): a task created, taken
//! or changed through any bridge is one task, and `take` is atomic fleet-wide. A change
//! reads the fleet's record, applies to it what the client asked, and writes it back at
//! the revision it read: a second writer in between makes the write fail, and the change
//! is made again on what that writer left (so the second taker is told who holds the
//! task). Every bridge, the writer's too, applies each revision to its own tables, where
//! reads are served from, and tells its own connections with the task events. A bridge
//! alone keeps its tasks in its tables only.

use std::sync::{Arc, Weak};

use super::Tracker;
use super::db::TaskRow;
use super::tasks::{Refused, TaskError};
use crate::core::{Expect, RecordChange, RecordError, RecordSink, Revision, SharedRecords};
use crate::store::StoreError;

/// The table of tasks in the fleet's records.
pub const TASKS: &str = "tracker-tasks";

/// Writes made again after another bridge's came first, before the change is refused as
/// too contended (each one lost means another writer won, so the task moved on).
const ATTEMPTS: usize = 32;
const RETRY_AFTER: std::time::Duration = std::time::Duration::from_millis(2);

/// Applies the fleet's task records to this bridge's tables.
pub struct TaskSink(pub Weak<Tracker>);

impl RecordSink for TaskSink {
    fn apply(
        &self,
        change: RecordChange,
    ) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            let Some(tracker) = self.0.upgrade() else {
                return;
            };
            let applied = match change.value {
                Some(value) => match decode(&value) {
                    Ok(task) => tracker.apply_task(task, change.revision).await.map(drop),
                    Err(e) => Err(e),
                },
                None => tracker.remove_task(&change.key).await.map(drop),
            };
            if let Err(e) = applied {
                tracing::error!(error = %e, task = %change.key, "tracker: cannot apply a shared task");
            }
        })
    }
}

fn encode(task: &TaskRow) -> bytes::Bytes {
    serde_json::to_vec(task)
        .expect("a task row is plain data")
        .into()
}

fn decode(value: &[u8]) -> Result<TaskRow, StoreError> {
    serde_json::from_slice(value).map_err(|e| StoreError::Corrupt(format!("a shared task: {e}")))
}

impl Tracker {
    /// Follows the fleet's tasks, when there is a fleet.
    pub fn follow_shared_tasks(self: &Arc<Self>) {
        if let Some(records) = self.core.records() {
            records.follow(TASKS, Arc::new(TaskSink(Arc::downgrade(self))));
        }
    }

    /// Creates `task` in the fleet's records (refused with `Conflict` when a task with its
    /// id exists), then here.
    pub(super) async fn create_shared(
        &self,
        records: &dyn SharedRecords,
        task: TaskRow,
    ) -> Result<TaskRow, TaskError> {
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
    ) -> Result<Result<(TaskRow, TaskRow), Refused>, TaskError>
    where
        F: Fn(&mut TaskRow) -> Result<(), String>,
    {
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                // A replica may answer the read before it has the write that won.
                tokio::time::sleep(RETRY_AFTER * attempt as u32).await;
            }
            let Some((before, expected)) = self.current(records, id).await? else {
                return Ok(Err(Refused::Missing));
            };
            let mut after = before.clone();
            if let Err(reason) = change(&mut after) {
                return Ok(Err(Refused::Conflict(reason)));
            }
            if after == before && expected != Expect::Absent {
                // Answered with the record the decision was made on, which this bridge may
                // not have applied yet.
                let mut current = before;
                self.localise(&mut current)?;
                return Ok(Ok((current.clone(), current)));
            }
            after.updated_at = crate::core::now_ms();
            match records.write(TASKS, id, encode(&after), expected).await {
                Ok(revision) => {
                    let after = self.apply_task(after, revision).await?;
                    let mut before = before;
                    self.localise(&mut before)?;
                    return Ok(Ok((before, after)));
                }
                Err(RecordError::Conflict) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(RecordError::Conflict.into())
    }

    /// Removes task `id` from the fleet's records, then here.
    pub(super) async fn delete_shared(
        &self,
        records: &dyn SharedRecords,
        id: &str,
    ) -> Result<Option<TaskRow>, TaskError> {
        let Some((existing, _)) = self.current(records, id).await? else {
            return Ok(None);
        };
        records.remove(TASKS, id).await?;
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
    ) -> Result<Option<(TaskRow, Expect)>, TaskError> {
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
        match self.db.apply_task(task.clone(), revision).await? {
            Some((before, after)) => {
                if before.is_none() {
                    self.chats.index(&after);
                }
                self.announce_task(before.as_ref(), &after);
                Ok(after)
            }
            // Applied already (the watch came first), or overtaken since: what the writer
            // is answered with is still its own write.
            None => Ok(task),
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
        if let Some(task) = &removed {
            self.chats.forget(task);
        }
        Ok(removed)
    }
}
