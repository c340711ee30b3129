//! Tasks submitted through `TaskService`: each is given to an agent (of any protocol) as a
//! task assignment, and its record follows the assignee's progress and result — whichever
//! protocol they arrive in — for `GetTask`, `ListTasks`, `StreamTaskStatus` watchers and the
//! submitter's callback.

use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use dashmap::DashSet;
use prost::Message;
use serde_json::Value;
use tokio::task::JoinHandle;
use tonic::Status;

use super::db::{FileRow, TaskRow, Update};
use super::outbound::Callback;
use super::proto::{
    MessageType, SubmitTaskRequest, SynapseMessage, TaskError, TaskInfo as TaskInfoPb, TaskResult,
    TaskStatus, TaskStatusUpdate, TransportMode,
};
use super::{PROTOCOL, Synapse, agents::internal, translate, wire};
use crate::core::BRIDGE_AGENT as BRIDGE_AGENT_ID;
use crate::core::{
    Attachment, Delivery, Directory, Envelope, Kind, Priority, TaskInfo, TaskState, new_message_id,
};
use crate::protocols::hub::{Hub, HubFilter};

/// Largest file accepted with a task.
pub const MAX_FILE: usize = 5 * 1024 * 1024;

/// The hub's routing name; not an agent name any client can register.
const HUB: &str = "\0synapse-hub";

impl Synapse {
    /// Picks the agent for `task_type`: the agent of that name, else an agent (online
    /// first) that lists it among its capabilities.
    fn assignee_for(&self, task_type: &str) -> Option<String> {
        if self.core.directory.contains(task_type) {
            return Some(task_type.to_owned());
        }
        let mut best: Option<(bool, i64, String)> = None;
        self.core.directory.for_each(|agent| {
            if agent.capabilities.iter().any(|c| c == task_type) {
                let candidate = (agent.online, -agent.created_at, agent.name.clone());
                if best
                    .as_ref()
                    .is_none_or(|b| (candidate.0, candidate.1) > (b.0, b.1))
                {
                    best = Some(candidate);
                }
            }
        });
        best.map(|(_, _, name)| name)
    }

    /// Records a task and gives it to the agent that takes its type. When no agent does
    /// yet, it waits (RECEIVED) for one to appear, as a broker keeps work for a worker.
    pub async fn submit_task(
        &self,
        request: SubmitTaskRequest,
        submitter: Option<String>,
        files: Vec<FileRow>,
    ) -> Result<TaskRow, Status> {
        if request.task_type.trim().is_empty() {
            return Err(Status::invalid_argument("task_type is required"));
        }
        if priority_of(&request.priority).is_none() {
            return Err(Status::invalid_argument(format!(
                "priority must be low, normal or high, not '{}'",
                request.priority
            )));
        }
        if !request.callback_url.is_empty() {
            super::agents::check_url(&request.callback_url, "callback_url")?;
        }
        let assignee = self.assignee_for(&request.task_type);
        if assignee.is_none() && self.pending.len() >= self.config.max_waiting_tasks {
            return Err(Status::resource_exhausted(format!(
                "{} tasks already wait for an agent; no agent takes '{}'",
                self.pending.len(),
                crate::shared::text::a_few(&[&request.task_type])
            )));
        }
        // Anonymous callers (no `x-synapse-agent-id`) submit through the bridge itself.
        let submitter = submitter.unwrap_or_else(|| BRIDGE_AGENT_ID.to_owned());
        let now = crate::core::now_ms();
        let id = uuid::Uuid::new_v4().to_string();
        let row = TaskRow {
            id: id.clone(),
            task_type: request.task_type.clone(),
            status: TaskStatus::Received as i32,
            progress: 0,
            message: match &assignee {
                Some(assignee) => format!("assigned to {assignee}"),
                None => format!("waiting for an agent that takes '{}'", request.task_type),
            },
            payload: request.payload.as_ref().map(|p| p.encode_to_vec()),
            external_task_id: Some(request.external_task_id.clone()).filter(|e| !e.is_empty()),
            priority: request.priority.clone(),
            callback_url: Some(request.callback_url.clone()).filter(|u| !u.is_empty()),
            callback_token: Some(request.callback_token.clone()).filter(|t| !t.is_empty()),
            transport: request.preferred_transport,
            submitter,
            assignee: assignee.clone().unwrap_or_default(),
            request_message_id: new_message_id(),
            result: None,
            error_code: String::new(),
            error_message: String::new(),
            created_at: now,
            updated_at: now,
            completed_at: None,
        };
        let attached = attachments(&files);
        let row = self.insert_task(row, files).await?.ok_or_else(|| {
            Status::already_exists(format!(
                "a task with external_task_id '{}' exists",
                request.external_task_id
            ))
        })?;
        self.tasks.insert(id.clone());
        if assignee.is_some() {
            self.core
                .publish(assignment(&row, attached))
                .await
                .map_err(internal)?;
        } else {
            self.pending.insert(id);
            // An agent may have appeared since it was looked for.
            self.assign_pending().await;
        }
        Ok(row)
    }

    /// Gives waiting tasks, oldest first, to the agents that take them now. Called when an
    /// agent appears: a Synapse agent registers, or an agent of any protocol comes online.
    pub async fn assign_pending(&self) {
        if self.pending.is_empty() {
            return;
        }
        let waiting = match self.db.waiting_tasks().await {
            Ok(waiting) => waiting,
            Err(e) => {
                tracing::error!(error = %e, "synapse: cannot read waiting tasks");
                return;
            }
        };
        // The directory is looked through once per task type, not once per task.
        let mut assignees: foldhash::HashMap<String, Option<String>> = Default::default();
        for task in waiting {
            let assignee = assignees
                .entry(task.task_type.clone())
                .or_insert_with(|| self.assignee_for(&task.task_type))
                .clone();
            if let Some(assignee) = assignee {
                self.assign(&task.id, &assignee).await;
            }
        }
    }

    /// Gives a waiting task to `assignee`, unless someone else did first (in a fleet,
    /// another bridge may).
    async fn assign(&self, id: &str, assignee: &str) {
        let (to, message) = (assignee.to_owned(), format!("assigned to {assignee}"));
        let claimed = self
            .update_task(id, move |t| {
                if t.assignee.is_empty() && t.status == TaskStatus::Received as i32 {
                    t.assignee = to.clone();
                    t.message = message.clone();
                }
            })
            .await;
        let task = match claimed {
            Ok(Update::Changed(task)) => task,
            Ok(Update::Unchanged(_) | Update::Missing) => {
                self.pending.remove(id);
                return;
            }
            // Still waiting: the next agent that appears tries again.
            Err(e) => {
                tracing::error!(error = %e.message(), task = id, "synapse: cannot assign a waiting task");
                return;
            }
        };
        self.pending.remove(id);
        let files = self.task_files(id).await.unwrap_or_else(|e| {
            tracing::error!(error = %e.message(), task = id, "synapse: cannot read a task's files");
            Vec::new()
        });
        if let Err(e) = self
            .core
            .publish(assignment(&task, attachments(&files)))
            .await
        {
            tracing::error!(error = %e, task = id, "synapse: cannot send a task assignment");
        }
        self.call_back(&task);
    }

    pub async fn task(&self, id: &str) -> Result<TaskRow, Status> {
        self.db
            .task(id)
            .await
            .map_err(internal)?
            .ok_or_else(|| Status::not_found(format!("task '{id}' not found")))
    }

    /// Cancels a task that has not finished and tells its assignee.
    pub async fn cancel_task(&self, id: &str) -> Result<TaskRow, Status> {
        let now = crate::core::now_ms();
        let update = self
            .update_task(id, move |t| {
                if !is_finished(t) {
                    t.status = TaskStatus::Cancelled as i32;
                    t.message = "cancelled".into();
                    t.completed_at = Some(now);
                }
            })
            .await?;
        let task = match update {
            Update::Changed(task) => task,
            Update::Unchanged(task) => {
                return Err(Status::failed_precondition(format!(
                    "task '{id}' is already {}",
                    wire::status_name(task.status)
                )));
            }
            Update::Missing => return Err(Status::not_found(format!("task '{id}' not found"))),
        };
        self.pending.remove(id);
        if task.assignee.is_empty() {
            // Still waiting for an agent: no one to tell.
            self.call_back(&task);
            return Ok(task);
        }
        let mut env = Envelope::new(PROTOCOL, &task.submitter, Kind::TaskUpdate);
        env.to = vec![task.assignee.clone()];
        env.reply_to = Some(task.request_message_id.clone());
        env.text = Some("cancelled".into());
        env.task = Some(Box::new(TaskInfo {
            id: task.id.clone(),
            title: Some(task.task_type.clone()),
            state: Some(TaskState::Cancelled),
            ..Default::default()
        }));
        self.core.publish(env).await.map_err(internal)?;
        self.call_back(&task);
        Ok(task)
    }

    pub fn task_info(&self, task: &TaskRow, with_result: bool) -> TaskInfoPb {
        // Ended without a result: the error says why (failed, rejected or cancelled), when
        // its assignee said.
        let failed = task.status == TaskStatus::Failed as i32
            || ([TaskStatus::Rejected, TaskStatus::Cancelled].iter())
                .any(|s| task.status == *s as i32 && !task.error_code.is_empty());
        TaskInfoPb {
            id: task.id.clone(),
            r#type: task.task_type.clone(),
            status: task.status,
            progress: task.progress,
            message: task.message.clone(),
            created_at: Some(wire::timestamp(task.created_at)),
            updated_at: Some(wire::timestamp(task.updated_at)),
            completed_at: task.completed_at.map(wire::timestamp),
            eta: None,
            result: if with_result {
                task.result
                    .as_ref()
                    .and_then(|b| prost_types::Any::decode(b.as_slice()).ok())
            } else {
                None
            },
            error: failed.then(|| TaskError {
                code: task.error_code.clone(),
                message: task.error_message.clone(),
            }),
            external_task_id: task.external_task_id.clone().unwrap_or_default(),
        }
    }

    pub fn status_update(task: &TaskRow) -> TaskStatusUpdate {
        TaskStatusUpdate {
            task_id: task.id.clone(),
            status: task.status,
            progress: task.progress,
            message: task.message.clone(),
            details: None,
        }
    }

    /// What a task write calls as its change commits: pushes the changed task to this
    /// bridge's `StreamTaskStatus` watchers of it. Called on the store's thread, in the
    /// order changes commit (`Store::write_then`); their callers, woken together, could
    /// tell a watcher of an older state after a newer one.
    pub(super) fn told_watchers(&self) -> impl FnOnce(&TaskRow) + Send + 'static {
        let watchers = self.task_watchers.clone();
        move |task| {
            let update = Self::status_update(task);
            if let Some(mut watchers) = watchers.get_mut(&task.id) {
                watchers.retain(|w| w.try_send(update.clone()).is_ok() || !w.is_closed());
            }
        }
    }

    /// Tells a changed task's submitter, at its callback URL if it gave one (in a fleet,
    /// the bridge that wrote the change does).
    fn call_back(&self, task: &TaskRow) {
        // A submitter that asked to poll is not called back, its callback URL or not.
        if task.transport == TransportMode::Polling as i32 {
            return;
        }
        if let Some(url) = &task.callback_url {
            let update = Self::status_update(task);
            let status = TaskStatus::try_from(task.status).unwrap_or(TaskStatus::Unspecified);
            let (msg_type, payload) = match status {
                TaskStatus::Completed => (
                    MessageType::P2pTaskComplete,
                    wire::pack(
                        wire::TASK_RESULT,
                        &TaskResult {
                            task_id: task.id.clone(),
                            task_type: task.task_type.clone(),
                            result: task
                                .result
                                .as_ref()
                                .and_then(|b| prost_types::Any::decode(b.as_slice()).ok()),
                            summary: task.message.clone(),
                        },
                    ),
                ),
                TaskStatus::Failed | TaskStatus::Rejected => (
                    MessageType::P2pTaskFailed,
                    wire::pack(
                        wire::TASK_RESULT,
                        &TaskResult {
                            task_id: task.id.clone(),
                            task_type: task.task_type.clone(),
                            result: None,
                            summary: task.error_message.clone(),
                        },
                    ),
                ),
                _ => (
                    MessageType::P2pStatusUpdate,
                    wire::pack(wire::TASK_STATUS_UPDATE, &update),
                ),
            };
            let message = SynapseMessage {
                id: new_message_id(),
                version: translate::PROTOCOL_VERSION.to_owned(),
                r#type: msg_type as i32,
                sender: Some(translate::Context::endpoint_of(self, &task.assignee)),
                receiver: Some(translate::Context::endpoint_of(self, &task.submitter)),
                correlation_id: task.request_message_id.clone(),
                reply_to: task.request_message_id.clone(),
                group_id: String::new(),
                timestamp: Some(wire::timestamp(task.updated_at)),
                payload: Some(payload),
                signature: String::new(),
            };
            self.outbound.callback(Callback {
                url: url.clone(),
                token: task.callback_token.clone(),
                message,
                fallback: (task.submitter != BRIDGE_AGENT_ID).then(|| task.submitter.clone()),
                outstanding: None,
            });
        }
    }

    /// Applies progress or a result (from any protocol) to a submitted task. In a fleet,
    /// the bridge that accepted the message writes it: another bridge's hub, behind in the
    /// stream, would write an older step over a newer one (and call back twice).
    async fn apply_progress(&self, env: &Envelope) {
        if self.core.directory.held_elsewhere(&env.from) {
            return;
        }
        let Some(info) = env.task.as_deref().cloned() else {
            return;
        };
        let state = info.state.unwrap_or(match env.kind {
            Kind::TaskResult => TaskState::Completed,
            _ => TaskState::Working,
        });
        let status = wire::status_for(state);
        let text = env
            .text
            .clone()
            .or(info.summary.clone())
            .or(info.error.clone());
        let result = env
            .data
            .as_ref()
            .map(wire::json)
            .or_else(|| info.summary.as_deref().map(wire::text))
            .map(|any| any.encode_to_vec());
        let now = crate::core::now_ms();
        let id = info.id.clone();
        let updated = self
            .update_task(&id, move |t| {
                // Late news of a finished task, or progress applied again after its
                // result as the hub catches up (`Hub::catch_up`): it stays finished.
                if is_finished(t) {
                    return;
                }
                t.status = status as i32;
                if let Some(progress) = info.progress {
                    t.progress = i32::from(progress);
                }
                if let Some(text) = &text {
                    t.message = text.clone();
                }
                match status {
                    TaskStatus::Completed => {
                        t.progress = 100;
                        t.result = result.clone();
                        t.completed_at = Some(now);
                    }
                    TaskStatus::Failed | TaskStatus::Rejected | TaskStatus::Cancelled => {
                        t.error_code = status
                            .as_str_name()
                            .trim_start_matches("TASK_STATUS_")
                            .to_owned();
                        t.error_message = info.error.clone().or(text.clone()).unwrap_or_default();
                        t.completed_at = Some(now);
                    }
                    _ => {}
                }
            })
            .await;
        match updated {
            Ok(Update::Changed(task)) => self.call_back(&task),
            // Late news of a finished task, or nothing new (another bridge of the fleet
            // wrote it): no one is told twice.
            Ok(Update::Unchanged(_) | Update::Missing) => {}
            Err(e) => tracing::error!(error = %e.message(), "synapse: cannot record task progress"),
        }
    }
}

fn priority_of(text: &str) -> Option<Priority> {
    match text.to_ascii_lowercase().as_str() {
        "" | "normal" | "medium" => Some(Priority::Normal),
        "high" | "urgent" | "critical" => Some(Priority::High),
        "low" => Some(Priority::Low),
        _ => None,
    }
}

/// A task's files as its assignment carries them: their names, and the files.
fn attachments(files: &[FileRow]) -> (Vec<String>, Vec<Attachment>) {
    let names = files.iter().map(|f| f.filename.clone()).collect();
    let attachments = files
        .iter()
        .map(|f| Attachment {
            name: f.filename.clone(),
            mime_type: f.mime_type.clone(),
            size: f.data.len() as u64,
            data: BASE64.encode(&f.data),
        })
        .collect();
    (names, attachments)
}

/// The message giving `task` to its assignee, from its submitter.
fn assignment(task: &TaskRow, (names, attachments): (Vec<String>, Vec<Attachment>)) -> Envelope {
    let payload = task
        .payload
        .as_ref()
        .and_then(|bytes| prost_types::Any::decode(bytes.as_slice()).ok());
    let payload = wire::unpack(payload.as_ref());
    let mut env = Envelope::new(PROTOCOL, &task.submitter, Kind::TaskAssign);
    env.id = task.request_message_id.clone();
    env.to = vec![task.assignee.clone()];
    env.priority = priority_of(&task.priority).unwrap_or(Priority::Normal);
    env.text = payload.text();
    env.data = payload.json().filter(Value::is_object);
    env.attachments = attachments;
    env.task = Some(Box::new(TaskInfo {
        id: task.id.clone(),
        title: Some(task.task_type.clone()),
        description: payload.text(),
        state: Some(TaskState::Assigned),
        assignee: Some(task.assignee.clone()),
        files: names,
        external_id: task.external_task_id.clone(),
        ..Default::default()
    }));
    env
}

fn is_finished(task: &TaskRow) -> bool {
    wire::is_terminal(TaskStatus::try_from(task.status).unwrap_or(TaskStatus::Unspecified))
}

/// Observes progress and results for submitted tasks, from any protocol, and agents
/// coming online while tasks wait for one.
struct HubInterest {
    tasks: Arc<DashSet<String>>,
    pending: Arc<DashSet<String>>,
    directory: Arc<Directory>,
}

impl HubInterest {
    /// Progress or a result for a submitted task, from its assignee or anyone else.
    fn is_progress(&self, env: &Envelope) -> bool {
        matches!(env.kind, Kind::TaskUpdate | Kind::TaskResult)
            // The bridge's own updates (cancellations) are not progress.
            && env.from != BRIDGE_AGENT_ID
            && env
                .task
                .as_ref()
                .is_some_and(|t| self.tasks.contains(&t.id))
    }
}

impl HubFilter for HubInterest {
    fn wants(&self, env: &Envelope) -> bool {
        if env.kind == Kind::PresenceJoin {
            return !self.pending.is_empty();
        }
        self.is_progress(env) && self.directory.contains(&env.from)
    }

    /// Its sender was known as it sent it, and may be away now.
    fn wants_again(&self, env: &Envelope) -> bool {
        self.is_progress(env)
    }
}

pub fn start_hub(synapse: Arc<Synapse>) -> JoinHandle<()> {
    let filter = HubInterest {
        tasks: synapse.tasks.clone(),
        pending: synapse.pending.clone(),
        directory: synapse.core.directory.clone(),
    };
    let hub = Hub::attach(&synapse.core, PROTOCOL, HUB, filter);
    tokio::spawn(async move {
        let shutdown = &synapse.shutdown;
        let synapse = &synapse;
        let again = |env: Envelope| async move { synapse.apply_progress(&env).await };
        let live = |delivery: Arc<Delivery>| async move {
            match delivery.envelope.kind {
                Kind::PresenceJoin => synapse.assign_pending().await,
                _ => synapse.apply_progress(&delivery.envelope).await,
            }
        };
        hub.apply(shutdown, again, live).await;
    })
}
