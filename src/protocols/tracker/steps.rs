//! A task's steps (its checklist): each change is an edit of the task's whole list — in
//! this bridge's tables alone, or, in a fleet, on the fleet's record of the list
//! (`tracker-steps.<task id>`), written back at the revision read and made again when
//! another write came first. Every bridge applies each revision to its tables; one that
//! arrives before its task (the task's record comes by another watch) waits for it.

use dashmap::DashMap;

use super::Tracker;
use super::db::{StepRow, StepsApplied};
use super::records::{STEPS, decode, encode};
use super::tasks::WriteError;
use crate::core::{
    Expect, Record, RecordError, Revision, SharedRecords, Tried, unless_lost, until_not_lost,
};
use crate::store::StoreError;

/// A change a client asks of a task's steps.
pub enum StepEdit {
    Add {
        title: String,
    },
    Update {
        id: String,
        title: Option<String>,
        done: Option<bool>,
    },
    Remove {
        id: String,
    },
}

impl StepEdit {
    /// Makes the change in `steps`: the step added, changed or removed; `None` when the
    /// step to change is not there.
    fn apply(&self, task_id: &str, steps: &mut Vec<StepRow>) -> Option<StepRow> {
        match self {
            StepEdit::Add { title } => {
                let step = StepRow {
                    id: uuid::Uuid::new_v4().to_string(),
                    task_id: task_id.to_owned(),
                    title: title.clone(),
                    done: false,
                    position: steps.iter().map(|s| s.position).max().unwrap_or(0) + 1,
                    created_at: crate::core::now_ms(),
                };
                steps.push(step.clone());
                Some(step)
            }
            StepEdit::Update { id, title, done } => {
                let step = steps.iter_mut().find(|s| &s.id == id)?;
                if let Some(title) = title {
                    step.title.clone_from(title);
                }
                if let Some(done) = done {
                    step.done = *done;
                }
                Some(step.clone())
            }
            StepEdit::Remove { id } => {
                let at = steps.iter().position(|s| &s.id == id)?;
                Some(steps.remove(at))
            }
        }
    }
}

/// Revisions of checklists whose tasks this bridge has not applied yet.
pub type PendingSteps = DashMap<String, (Vec<StepRow>, Revision)>;

impl Tracker {
    /// Makes `edit` to task `task_id`'s steps; the step it touched, or `None` when the
    /// step it names is not there.
    pub async fn change_steps(
        &self,
        task_id: &str,
        edit: StepEdit,
    ) -> Result<Option<StepRow>, WriteError> {
        let Some(records) = self.core.records() else {
            let id = task_id.to_owned();
            return Ok(self
                .db
                .change_steps(task_id, move |steps| edit.apply(&id, steps))
                .await?);
        };
        let changed = until_not_lost::<_, WriteError, _, _>(|| async {
            let (mut steps, expected) = self.current_steps(records.as_ref(), task_id).await?;
            let Some(touched) = edit.apply(task_id, &mut steps) else {
                return Ok(Tried::Done(None));
            };
            let written = records
                .write(STEPS, task_id, encode(&steps), expected)
                .await;
            let Some(revision) = unless_lost(written)? else {
                return Ok(Tried::Lost);
            };
            self.apply_steps(task_id, steps, revision).await?;
            Ok(Tried::Done(Some(touched)))
        })
        .await?;
        changed.ok_or(RecordError::Conflict.into())
    }

    /// Task `task_id`'s steps as the fleet holds them, with what a write of them expects;
    /// a task's steps made before the bridge was one of a fleet are taken from its table.
    async fn current_steps(
        &self,
        records: &dyn SharedRecords,
        task_id: &str,
    ) -> Result<(Vec<StepRow>, Expect), WriteError> {
        Ok(match records.read(STEPS, task_id).await? {
            Some(Record {
                value: Some(value),
                revision,
            }) => (decode(&value)?, Expect::At(revision)),
            Some(Record {
                value: None,
                revision,
            }) => (Vec::new(), Expect::At(revision)),
            None => (self.db.steps(task_id).await?, Expect::Absent),
        })
    }

    /// Makes this bridge's steps of task `task_id` what revision `revision` of the fleet's
    /// record says (later, once the task is here, if it is not yet).
    pub(super) async fn apply_steps(
        &self,
        task_id: &str,
        steps: Vec<StepRow>,
        revision: Revision,
    ) -> Result<(), StoreError> {
        if self
            .db
            .apply_steps(task_id, steps.clone(), revision)
            .await?
            == StepsApplied::NoTask
            && !self.db.is_removed(task_id).await?
        {
            self.wait_for_task(task_id, steps, revision);
            // The task may have been applied meanwhile, after it looked for these.
            if self.db.task(task_id).await?.is_some() {
                self.apply_pending_steps(task_id).await?;
            }
        }
        Ok(())
    }

    /// Applies the steps that waited for task `task_id`, now that it is here. Steps whose
    /// write failed wait again (unless newer ones came meanwhile), for the task change's
    /// next try (`applied_task_again`) or the task's next change.
    pub(super) async fn apply_pending_steps(&self, task_id: &str) -> Result<(), StoreError> {
        let Some((_, (steps, revision))) = self.pending_steps.remove(task_id) else {
            return Ok(());
        };
        let applied = self.db.apply_steps(task_id, steps.clone(), revision).await;
        if applied.is_err() {
            self.wait_for_task(task_id, steps, revision);
        }
        applied.map(drop)
    }

    /// Keeps `steps` at `revision` until task `task_id` is here, unless newer ones wait.
    fn wait_for_task(&self, task_id: &str, steps: Vec<StepRow>, revision: Revision) {
        let mut pending = self.pending_steps.entry(task_id.to_owned()).or_default();
        if pending.1 < revision {
            *pending = (steps, revision);
        }
    }

    /// A change of task `task_id` was applied already (an earlier try of it committed):
    /// steps that still wait for it, as that try could not write them, are written now.
    pub(super) async fn applied_task_again(&self, task_id: &str) -> Result<(), StoreError> {
        if self.pending_steps.contains_key(task_id) && self.db.task(task_id).await?.is_some() {
            self.apply_pending_steps(task_id).await?;
        }
        Ok(())
    }
}
