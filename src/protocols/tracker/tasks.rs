//! Task changes and what follows from them: the Tracker's own task events, and task
//! messages for agents of other protocols — the one that asked for the task (its requester)
//! and the one it was handed to (a foreign assignee). In a fleet the task itself is a
//! record every bridge shares (`records`).

use super::db::TaskRow;
use super::translate::{self, state_of};
use super::wire::TaskStatus;
use super::{PROTOCOL, Tracker};
use crate::core::MessageQuery;
use crate::core::{Envelope, Kind, Origin, RecordError, TaskInfo, TaskState, new_message_id};
use crate::store::StoreError;

/// Why a change to a task was refused.
#[derive(Debug)]
pub enum Refused {
    /// No such task.
    Missing,
    /// The change does not apply (someone else holds it, …); the text says why.
    Conflict(String),
}

/// What a task change did, for the caller's response.
pub type Changed = Result<TaskRow, Refused>;

/// Why a task or a member could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The fleet's record of the task could not be written (a bridge of a fleet only).
    #[error(transparent)]
    Fleet(#[from] RecordError),
}

impl Tracker {
    /// Creates a task, announces it, and hands it over when its assignee is foreign. In a
    /// fleet, `Fleet(Conflict)` when a task with its id exists already.
    pub async fn create_task(&self, task: TaskRow) -> Result<TaskRow, WriteError> {
        let task = match self.core.records() {
            Some(records) => self.create_shared(records.as_ref(), task).await?,
            None => {
                let task = self
                    .db
                    .insert_task(task, self.task_events.on_commit())
                    .await?;
                self.chats.index(&task);
                task
            }
        };
        Ok(self.follow_up(None, task, None, None).await?)
    }

    /// Applies `change` to the task; `source` is the agent of another protocol the change
    /// came from, if any (it is not told about its own change).
    pub async fn change_task<F>(
        &self,
        id: &str,
        note: Option<String>,
        source: Option<&str>,
        change: F,
    ) -> Result<Changed, WriteError>
    where
        F: Fn(&mut TaskRow) -> Result<(), String> + Send + Sync + 'static,
    {
        let (before, after) = match self.change_row(id, change).await? {
            Ok(pair) => pair,
            Err(refused) => return Ok(Err(refused)),
        };
        Ok(Ok(self
            .follow_up(Some(&before), after, note, source)
            .await?))
    }

    /// Applies `change` to the task's row — the fleet's record in a fleet, this bridge's
    /// table otherwise — and tells this bridge's connections: (before, after), or why not.
    async fn change_row<F>(
        &self,
        id: &str,
        change: F,
    ) -> Result<Result<(TaskRow, TaskRow), Refused>, WriteError>
    where
        F: Fn(&mut TaskRow) -> Result<(), String> + Send + Sync + 'static,
    {
        if let Some(records) = self.core.records() {
            return self.change_shared(records.as_ref(), id, change).await;
        }
        let changed = (self.db)
            .update_task(id, change, self.task_events.on_commit())
            .await?;
        Ok(match changed {
            None => Err(Refused::Missing),
            Some(Err(reason)) => Err(Refused::Conflict(reason)),
            Some(Ok(pair)) => Ok(pair),
        })
    }

    pub async fn delete_task(&self, id: &str) -> Result<Option<TaskRow>, WriteError> {
        match self.core.records() {
            Some(records) => self.delete_shared(records.as_ref(), id).await,
            None => Ok(self.forget_task(id).await?),
        }
    }

    /// Deletes task `id` from this bridge's tables (a bridge alone).
    async fn forget_task(&self, id: &str) -> Result<Option<TaskRow>, StoreError> {
        let deleted = self.db.delete_task(id).await?;
        if let Some(task) = &deleted {
            self.chats.forget(task);
        }
        Ok(deleted)
    }

    /// Tells task `id`'s requester `note` (a comment on the task), as a change would that
    /// changes nothing; read from this bridge's tables, since nothing is written.
    pub async fn note_task(&self, id: &str, note: String) -> Result<(), WriteError> {
        if let Some(task) = self.db.task(id).await? {
            self.follow_up(Some(&task), task.clone(), Some(note), None)
                .await?;
        }
        Ok(())
    }

    /// Tells this bridge's connections what became of a task: created (`before` is `None`),
    /// assigned, updated. Called in the order changes commit (`task_events`).
    pub(super) fn announce_task(&self, before: Option<&TaskRow>, after: &TaskRow) {
        let Some(before) = before else {
            self.emit_task_event("task.created", after);
            if after.assignee_slug.is_some() {
                self.emit_task_event("task.assigned", after);
            }
            return;
        };
        let reassigned = after.assignee_slug != before.assignee_slug;
        if reassigned && after.assignee_slug.is_some() {
            self.emit_task_event("task.assigned", after);
        }
        // Who holds it, when, and which message handed it over are not an update of their own.
        let otherwise_changed = TaskRow {
            assignee_slug: before.assignee_slug.clone(),
            updated_at: before.updated_at,
            delegation_message_id: before.delegation_message_id.clone(),
            ..after.clone()
        } != *before;
        if otherwise_changed || (reassigned && after.assignee_slug.is_none()) {
            self.emit_task_event("task.updated", after);
        }
    }

    /// Tells agents of other protocols what changed: the requester hears about progress and
    /// the result; a newly assigned foreign agent receives the task.
    async fn follow_up(
        &self,
        before: Option<&TaskRow>,
        mut task: TaskRow,
        note: Option<String>,
        source: Option<&str>,
    ) -> Result<TaskRow, StoreError> {
        if let Some(assignee) = task.assignee_slug.clone()
            && before.and_then(|b| b.assignee_slug.as_deref()) != Some(assignee.as_str())
            && self.is_foreign(&assignee)
            && Some(assignee.as_str()) != source
        {
            let message_id = new_message_id();
            let mut env =
                self.task_message(Kind::TaskAssign, &task, &assignee, TaskState::Assigned);
            env.id = message_id.clone();
            env.text = Some(task.description.clone()).filter(|d| !d.is_empty());
            if let Err(e) = self.core.publish(env).await {
                tracing::error!(error = %e, "tracker: cannot hand a task over");
            } else {
                let handed_over = move |t: &mut TaskRow| {
                    t.delegation_message_id = Some(message_id.clone());
                    Ok(())
                };
                match self.change_row(&task.id, handed_over).await {
                    Ok(Ok((_, updated))) => task = updated,
                    Ok(Err(_)) => {}
                    Err(e) => {
                        tracing::error!(error = %e, "tracker: cannot note a task's hand-over")
                    }
                }
            }
        }

        let Some(requester) = task
            .requester
            .clone()
            .filter(|r| Some(r.as_str()) != source)
        else {
            return Ok(task);
        };
        let status_changed = before.is_some_and(|b| b.status != task.status);
        let rejected = before.is_some_and(|b| b.assignee_slug.is_some())
            && task.assignee_slug.is_none()
            && task.status == TaskStatus::Backlog;
        if !status_changed && note.is_none() && !rejected {
            return Ok(task);
        }
        let state = if rejected {
            TaskState::Rejected
        } else {
            state_of(task.status, task.assignee_slug.is_some())
        };
        let kind = match state {
            TaskState::Completed | TaskState::Rejected => Kind::TaskResult,
            _ => Kind::TaskUpdate,
        };
        let mut env = self.task_message(kind, &task, &requester, state);
        let info = env.task.get_or_insert_default();
        match state {
            TaskState::Completed => {
                let summary = match note {
                    Some(note) => note,
                    None => self
                        .last_comment(&task.id)
                        .await
                        .unwrap_or_else(|| task.title.clone()),
                };
                info.summary = Some(summary.clone());
                env.text = Some(summary);
            }
            TaskState::Rejected => {
                info.error = note.clone().or(Some("rejected".into()));
                env.text = note;
            }
            _ => env.text = note,
        }
        if let Err(e) = self.core.publish(env).await {
            tracing::error!(error = %e, "tracker: cannot report a task change");
        }
        Ok(task)
    }

    /// A task message from the task's author to `to`, in reply to the message that asked.
    fn task_message(&self, kind: Kind, task: &TaskRow, to: &str, state: TaskState) -> Envelope {
        let from = match (kind, &task.assignee_slug) {
            (Kind::TaskAssign, _) | (_, None) => task.author_slug.clone(),
            (_, Some(assignee)) => assignee.clone(),
        };
        let mut env = Envelope::new(PROTOCOL, from, kind);
        env.to = vec![to.to_owned()];
        // The requester knows the task by its own id.
        let id = if Some(to) == task.requester.as_deref() {
            task.external_id.clone().unwrap_or_else(|| task.id.clone())
        } else {
            task.id.clone()
        };
        env.task = Some(Box::new(TaskInfo {
            id,
            title: Some(task.title.clone()),
            description: Some(task.description.clone()).filter(|d| !d.is_empty()),
            state: Some(state),
            assignee: task.assignee_slug.clone(),
            ..Default::default()
        }));
        env.reply_to = if Some(to) == task.requester.as_deref() {
            task.request_message_id.clone()
        } else {
            None
        };
        env.origin = Origin::new(
            PROTOCOL,
            Some(serde_json::to_value(translate::task_out(task)).unwrap_or_default()),
        );
        env
    }

    /// Whether `name` is an agent of another protocol.
    pub fn is_foreign(&self, name: &str) -> bool {
        self.core
            .directory
            .protocol_of(name)
            .is_some_and(|p| p != PROTOCOL)
    }

    async fn last_comment(&self, task_id: &str) -> Option<String> {
        let query = MessageQuery {
            thread: Some(Some(task_id.to_owned())),
            kinds: Some(vec![Kind::Chat.as_str()]),
            limit: 1,
            ..Default::default()
        };
        let stored = self.core.log.read(query).await.ok()?;
        stored.last().and_then(|m| m.envelope.text.clone())
    }
}
