//! The endpoint's own session: it observes task messages from other protocols that concern
//! the Tracker — a task assigned to a member, progress or a result for a Tracker task — and
//! applies them to the task table, in order, whether or not the members involved are
//! connected. The resulting task events reach members through `emit_task_event`.

use std::sync::Arc;

use tokio::task::JoinHandle;

use super::tasks::WriteError;
use super::translate::{TaskChange, task_change, task_from};
use super::wire::TaskStatus;
use super::{Chats, PROTOCOL, Tracker};
use crate::core::{Audience, Delivery, Directory, Envelope, Kind, Origin, RecordError, TaskInfo};
use crate::protocols::hub::{Hub, HubFilter};

/// The hub's routing name; not an agent name any client can register.
const HUB: &str = "\0tracker-hub";

struct HubInterest {
    chats: Arc<Chats>,
    directory: Arc<Directory>,
}

impl HubInterest {
    fn is_member(&self, name: &str) -> bool {
        self.directory.protocol_of(name) == Some(PROTOCOL)
    }

    fn concerns_tracker(&self, env: &Envelope) -> bool {
        if env.origin_is(PROTOCOL)
            || !matches!(
                env.kind,
                Kind::TaskAssign | Kind::TaskUpdate | Kind::TaskResult
            )
        {
            return false;
        }
        let task = env.task.as_ref();
        task.is_some_and(|t| self.chats.task_id_for(&t.id).is_some())
            || task
                .and_then(|t| t.assignee.as_deref())
                .is_some_and(|a| self.is_member(a))
            || (env.kind == Kind::TaskAssign && env.addressees().any(|n| self.is_member(n)))
    }
}

impl HubFilter for HubInterest {
    fn wants(&self, env: &Envelope) -> bool {
        self.concerns_tracker(env)
    }
}

pub fn start(tracker: Arc<Tracker>) -> JoinHandle<()> {
    let filter = HubInterest {
        chats: tracker.chats.clone(),
        directory: tracker.core.directory.clone(),
    };
    let hub = Hub::attach(&tracker.core, PROTOCOL, HUB, filter);
    tokio::spawn(async move {
        let shutdown = &tracker.shutdown;
        let tracker = &tracker;
        let again = |env: Envelope| async move { tracker.apply(&env, Applying::Again).await };
        let live = |delivery: Arc<Delivery>| async move {
            tracker.apply(&delivery.envelope, Applying::Live).await
        };
        hub.apply(shutdown, again, live).await;
    })
}

/// Whether a task message is applied as it comes, or again as the hub catches up after a
/// restart (`Hub::catch_up`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Applying {
    Live,
    Again,
}

impl Tracker {
    async fn apply(&self, env: &Envelope, applying: Applying) {
        let known = env
            .task
            .as_ref()
            .and_then(|t| self.chats.task_id_for(&t.id));
        let result = match (env.kind, known) {
            (_, Some(task_id)) => self.apply_progress(env, &task_id, applying).await,
            (Kind::TaskAssign, None) => self.apply_assignment(env).await,
            _ => Ok(()),
        };
        if let Err(e) = result {
            tracing::error!(error = %e, "tracker: cannot apply a task message");
        }
    }

    /// A task assigned to a member from another protocol becomes a Tracker task.
    async fn apply_assignment(&self, env: &Envelope) -> Result<(), WriteError> {
        let info = env.task.clone().unwrap_or_default();
        let assignee = info
            .assignee
            .clone()
            .filter(|a| self.members.contains(a))
            .or_else(|| {
                env.addressees()
                    .find(|n| self.members.contains(n))
                    .map(str::to_owned)
            });
        let Some(assignee) = assignee else {
            return Ok(());
        };
        let Some(project) = self.default_project.load_full() else {
            self.refuse(env, "the Tracker has no project to create the task in")
                .await;
            return Ok(());
        };
        let task = task_from(env, assignee, &project, crate::core::now_ms());
        match self.create_task(task).await {
            // In a fleet every bridge's hub sees the assignment; one bridge makes the task.
            Err(WriteError::Fleet(RecordError::Conflict)) => Ok(()),
            created => created.map(drop),
        }
    }

    /// Progress or a result from another protocol for a Tracker task.
    async fn apply_progress(
        &self,
        env: &Envelope,
        task_id: &str,
        applying: Applying,
    ) -> Result<(), WriteError> {
        let TaskChange {
            status,
            note,
            reassign,
        } = task_change(env);
        // Applied again (`Applying::Again`): a task done since stays done, rather than an
        // older progress undoing its result (another bridge of the fleet may have applied
        // both, or a member closed it).
        if applying == Applying::Again {
            let task = self.db.task(task_id).await?;
            if task.is_none_or(|task| task.status == TaskStatus::Done) {
                return Ok(());
            }
        }
        if let Some(note) = note.as_ref().filter(|n| !n.is_empty()) {
            self.comment(env, task_id, note).await;
        }
        // A task deleted meanwhile has nothing left to update.
        let _applied = self
            .change_task(task_id, None, Some(&env.from), move |task| {
                if applying == Applying::Again && task.status == TaskStatus::Done {
                    return Ok(());
                }
                if let Some(status) = status {
                    task.status = status;
                }
                if let Some(assignee) = &reassign {
                    task.assignee_slug = Some(assignee.clone());
                }
                Ok(())
            })
            .await?;
        Ok(())
    }

    /// Records what another protocol's agent said about a task as a comment on it. The
    /// comment is the Tracker's rendering of a message every other protocol already has:
    /// kept private (out of other protocols' histories and observers) and shown to the
    /// Tracker's own connections here.
    async fn comment(&self, env: &Envelope, task_id: &str, text: &str) {
        let mut comment = Envelope::new(PROTOCOL, &env.from, Kind::Chat);
        comment.id = format!("{}#comment", env.id);
        comment.thread = Some(task_id.to_owned());
        comment.task = Some(Box::new(TaskInfo {
            id: task_id.to_owned(),
            ..Default::default()
        }));
        comment.text = Some(text.to_owned());
        comment.reply_to = Some(env.id.clone());
        comment.timestamp = env.timestamp;
        comment.audience = Audience::Private;
        comment.origin = Origin::new(env.origin.protocol.clone(), None);
        match self.core.publish(comment).await {
            Ok(delivery) => self.show_locally(&delivery),
            Err(e) => tracing::error!(error = %e, "tracker: cannot store a task comment"),
        }
    }

    /// Tells the sender, in its own protocol, that its task could not be taken.
    async fn refuse(&self, env: &Envelope, reason: &str) {
        let mut error = Envelope::new(PROTOCOL, HUB.trim_start_matches('\0'), Kind::Error);
        error.to = vec![env.from.clone()];
        error.audience = Audience::Private;
        error.reply_to = Some(env.id.clone());
        error.text = Some(format!("task not created: {reason}"));
        self.core.publish_transient(error).await;
    }
}
