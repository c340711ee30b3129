//! `TaskService`: submit (with or without files), get, list, cancel, and watch tasks.

use std::pin::Pin;

use futures_util::Stream;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::SynapseApi;
use crate::protocols::synapse::agents::internal;
use crate::protocols::synapse::db::{FileRow, TaskRow};
use crate::protocols::synapse::proto::task_service_server::TaskService;
use crate::protocols::synapse::proto::{
    CancelTaskRequest, CancelTaskResponse, GetTaskRequest, ListTasksRequest, ListTasksResponse,
    SubmitTaskRequest, SubmitTaskResponse, SubmitTaskWithFilesRequest, TaskStatus,
    TaskStatusResponse, TaskStatusStreamRequest, TaskStatusUpdate, TransportMode,
};
use crate::protocols::synapse::tasks::MAX_FILE;
use crate::protocols::synapse::{Synapse, wire};

/// `ListTasks` pages are at most this long; 20 when not asked.
const MAX_PAGE: i32 = 100;
const DEFAULT_PAGE: i32 = 20;

impl SynapseApi {
    async fn submit(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        request: SubmitTaskRequest,
        files: Vec<FileRow>,
    ) -> Result<Response<SubmitTaskResponse>, Status> {
        let hints = self.hints(metadata)?;
        if request.preferred_transport == TransportMode::Callback as i32
            && request.callback_url.is_empty()
        {
            return Err(Status::invalid_argument(
                "callback_url is required with preferred_transport TRANSPORT_MODE_CALLBACK",
            ));
        }
        // To the end even if the client goes: a submission dropped half-way would leave
        // its external id taken by no task, or a task nobody was assigned.
        let synapse = self.synapse.clone();
        let task = self.to_the_end().run(async move {
            let caller = synapse.caller(&hints).await?;
            synapse.submit_task(request, caller, files).await
        });
        let task = task.await.unwrap_or_else(|| Err(stopping()))?;
        Ok(Response::new(SubmitTaskResponse {
            success: true,
            task_id: task.id.clone(),
            status: task.status,
            message: task.message.clone(),
            error_code: String::new(),
        }))
    }

    async fn found(
        &self,
        request: GetTaskRequest,
        with_result: bool,
    ) -> Result<Response<TaskStatusResponse>, Status> {
        if request.task_id.is_empty() {
            return Err(Status::invalid_argument("task_id is required"));
        }
        let task = self.synapse.task(&request.task_id).await?;
        Ok(Response::new(TaskStatusResponse {
            success: true,
            task: Some(self.synapse.task_info(&task, with_result)),
            error_code: String::new(),
            error_message: String::new(),
        }))
    }

    /// Where the calls that must not stop half-way run (`Core::to_the_end`).
    fn to_the_end(&self) -> &crate::shared::to_the_end::ToTheEnd {
        &self.synapse.core.to_the_end
    }
}

/// The answer to a call the bridge stopped before it ended (one run to its end).
fn stopping() -> Status {
    Status::unavailable("agentbridge is stopping")
}

type UpdateStream = Pin<Box<dyn Stream<Item = Result<TaskStatusUpdate, Status>> + Send>>;

#[tonic::async_trait]
impl TaskService for SynapseApi {
    async fn submit_task(
        &self,
        request: Request<SubmitTaskRequest>,
    ) -> Result<Response<SubmitTaskResponse>, Status> {
        let (metadata, _, request) = request.into_parts();
        self.submit(&metadata, request, Vec::new()).await
    }

    async fn submit_task_with_files(
        &self,
        request: Request<SubmitTaskWithFilesRequest>,
    ) -> Result<Response<SubmitTaskResponse>, Status> {
        let (metadata, _, request) = request.into_parts();
        let task = request
            .request
            .ok_or_else(|| Status::invalid_argument("request is required"))?;
        let mut files = Vec::with_capacity(request.files.len());
        for (i, file) in request.files.into_iter().enumerate() {
            if file.filename.is_empty() {
                return Err(Status::invalid_argument(format!(
                    "files[{i}].filename is required"
                )));
            }
            if file.data.len() > MAX_FILE {
                return Err(Status::invalid_argument(format!(
                    "files[{i}] ('{}') is {} bytes; the limit is {MAX_FILE} bytes (5 MiB)",
                    file.filename,
                    file.data.len()
                )));
            }
            files.push(FileRow {
                field_name: file.field_name,
                mime_type: if file.mime_type.is_empty() {
                    "application/octet-stream".into()
                } else {
                    file.mime_type
                },
                filename: file.filename,
                data: file.data,
            });
        }
        self.submit(&metadata, task, files).await
    }

    async fn get_task(
        &self,
        request: Request<GetTaskRequest>,
    ) -> Result<Response<TaskStatusResponse>, Status> {
        self.found(request.into_inner(), true).await
    }

    async fn get_task_status(
        &self,
        request: Request<GetTaskRequest>,
    ) -> Result<Response<TaskStatusResponse>, Status> {
        self.found(request.into_inner(), false).await
    }

    async fn list_tasks(
        &self,
        request: Request<ListTasksRequest>,
    ) -> Result<Response<ListTasksResponse>, Status> {
        let request = request.into_inner();
        let status = match request.status.trim() {
            "" => None,
            text => Some(wire::parse_status(text).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "status: '{text}' is not a task status (e.g. TASK_STATUS_PROCESSING)"
                ))
            })? as i32),
        };
        if request.limit < 0 || request.offset < 0 {
            return Err(Status::invalid_argument(
                "limit and offset must not be negative",
            ));
        }
        let limit = if request.limit == 0 {
            DEFAULT_PAGE
        } else {
            request.limit.min(MAX_PAGE)
        };
        let (tasks, total) = self
            .synapse
            .db
            .tasks(status, limit as i64, request.offset as i64)
            .await
            .map_err(internal)?;
        let tasks: Vec<_> = tasks
            .iter()
            .map(|t: &TaskRow| self.synapse.task_info(t, false))
            .collect();
        let has_more = (request.offset as i64 + tasks.len() as i64) < total;
        Ok(Response::new(ListTasksResponse {
            success: true,
            tasks,
            total: i32::try_from(total).unwrap_or(i32::MAX),
            limit,
            offset: request.offset,
            has_more,
        }))
    }

    async fn cancel_task(
        &self,
        request: Request<CancelTaskRequest>,
    ) -> Result<Response<CancelTaskResponse>, Status> {
        let request = request.into_inner();
        if request.task_id.is_empty() {
            return Err(Status::invalid_argument("task_id is required"));
        }
        let synapse = self.synapse.clone();
        let task = self
            .to_the_end()
            .run(async move { synapse.cancel_task(&request.task_id).await });
        let task = task.await.unwrap_or_else(|| Err(stopping()))?;
        Ok(Response::new(CancelTaskResponse {
            success: true,
            task_id: task.id,
            status: TaskStatus::Cancelled as i32,
            message: "cancelled".into(),
        }))
    }

    type StreamTaskStatusStream = UpdateStream;

    /// Subscribe and unsubscribe by task id; each subscription starts with the task's
    /// current status, then every change as it happens.
    async fn stream_task_status(
        &self,
        request: Request<Streaming<TaskStatusStreamRequest>>,
    ) -> Result<Response<Self::StreamTaskStatusStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel::<TaskStatusUpdate>(256);
        let (out_tx, out_rx) = mpsc::channel::<Result<TaskStatusUpdate, Status>>(256);
        let synapse = self.synapse.clone();
        tokio::spawn(async move {
            let mut updates = ReceiverStream::new(rx);
            let mut subscribed: Vec<String> = Vec::new();
            loop {
                tokio::select! {
                    _ = synapse.shutdown.cancelled() => break,
                    next = inbound.next() => match next {
                        Some(Ok(ask)) => {
                            if let Err(status) = watch(&synapse, &ask, &tx, &out_tx, &mut subscribed).await {
                                let _ = out_tx.send(Err(status)).await;
                                break;
                            }
                        }
                        // A request the stream could not read: the client hears why.
                        Some(Err(status)) => {
                            let _ = out_tx.send(Err(status)).await;
                            break;
                        }
                        None => break,
                    },
                    Some(update) = updates.next() => {
                        if subscribed.contains(&update.task_id) && out_tx.send(Ok(update)).await.is_err() {
                            break;
                        }
                    }
                }
            }
            for id in subscribed {
                if let Some(mut watchers) = synapse.task_watchers.get_mut(&id) {
                    watchers.retain(|w| !w.same_channel(&tx));
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out_rx))))
    }
}

async fn watch(
    synapse: &Synapse,
    ask: &TaskStatusStreamRequest,
    tx: &mpsc::Sender<TaskStatusUpdate>,
    out: &mpsc::Sender<Result<TaskStatusUpdate, Status>>,
    subscribed: &mut Vec<String>,
) -> Result<(), Status> {
    if ask.task_id.is_empty() {
        return Err(Status::invalid_argument("task_id is required"));
    }
    if !ask.subscribe {
        subscribed.retain(|id| *id != ask.task_id);
        if let Some(mut watchers) = synapse.task_watchers.get_mut(&ask.task_id) {
            watchers.retain(|w| !w.same_channel(tx));
        }
        return Ok(());
    }
    let task = synapse.task(&ask.task_id).await?;
    if !subscribed.contains(&task.id) {
        subscribed.push(task.id.clone());
        synapse
            .task_watchers
            .entry(task.id.clone())
            .or_default()
            .push(tx.clone());
    }
    let _ = out.send(Ok(Synapse::status_update(&task))).await;
    Ok(())
}
