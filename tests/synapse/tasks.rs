//! Tasks: submitted, assigned, updated, completed, cancelled, refused, and waiting for an
//! agent able to take them, across a restart too.

use agentbridge::protocols::synapse::proto::{
    CancelTaskRequest, FileUpload, GetTaskRequest, ListTasksRequest, MessageType,
    SubmitTaskRequest, SubmitTaskWithFilesRequest, TaskPayload, TaskStatus,
    TaskStatusStreamRequest, TransportMode,
};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request};

use crate::common;
use crate::common::synapse::{
    CallbackReceiver, Stream, clients, status_update, task_complete, unpack,
};
use crate::support::{World, next_update, submit_type, watch, world};

#[tokio::test]
async fn submitted_tasks_follow_the_assignee_to_completion() {
    let mut w = world().await;
    let mut worker = Stream::open(w.addr, "worker").await;
    let mut receiver = CallbackReceiver::start(0).await;
    let submitted =
        w.c.tasks
            .submit_task(Request::new(SubmitTaskRequest {
                task_type: "worker".into(),
                payload: Some(prost_types::Any {
                    type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
                    value: prost::Message::encode_to_vec(&"summarise the logs".to_owned()),
                }),
                external_task_id: "ext-1".into(),
                priority: "high".into(),
                callback_url: receiver.url.clone(),
                callback_token: "tok".into(),
                preferred_transport: 1,
            }))
            .await
            .unwrap()
            .into_inner();
    assert!(submitted.success);
    assert_eq!(submitted.status, TaskStatus::Received as i32);
    let task_id = submitted.task_id.clone();

    // A watcher sees the current status, then every change.
    let (watch_tx, watch_rx) = mpsc::channel(8);
    watch_tx
        .send(TaskStatusStreamRequest {
            task_id: task_id.clone(),
            subscribe: true,
        })
        .await
        .unwrap();
    let mut watching =
        w.c.tasks
            .stream_task_status(Request::new(ReceiverStream::new(watch_rx)))
            .await
            .unwrap()
            .into_inner();
    let first = tokio::time::timeout(common::WAIT, watching.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.status, TaskStatus::Received as i32);

    let request = worker.next().await;
    assert_eq!(request.r#type, MessageType::P2pTaskRequest as i32);
    let payload: TaskPayload = unpack(&request);
    assert_eq!(
        (payload.task_id.as_str(), payload.task_type.as_str()),
        (task_id.as_str(), "worker")
    );
    let text: String = prost::Message::decode(payload.payload.unwrap().value.as_slice()).unwrap();
    assert_eq!(text, "summarise the logs");

    worker
        .send(status_update(
            "worker",
            "agentbridge",
            &task_id,
            TaskStatus::Processing,
            50,
            "half",
        ))
        .await;
    let update = tokio::time::timeout(common::WAIT, watching.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        (update.status, update.progress, update.message.as_str()),
        (TaskStatus::Processing as i32, 50, "half")
    );
    assert_eq!(
        receiver.next().await.body["type"],
        "MESSAGE_TYPE_P2P_STATUS_UPDATE"
    );

    worker
        .send(task_complete(
            "worker",
            "agentbridge",
            &task_id,
            "3 errors found",
            &request.id,
        ))
        .await;
    let done = tokio::time::timeout(common::WAIT, watching.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        (done.status, done.progress),
        (TaskStatus::Completed as i32, 100)
    );
    let callback = receiver.next().await;
    assert_eq!(callback.body["type"], "MESSAGE_TYPE_P2P_TASK_COMPLETE");
    assert_eq!(callback.authorization.as_deref(), Some("Bearer tok"));
    assert_eq!(callback.body["replyTo"], json!(request.id));

    let got =
        w.c.tasks
            .get_task(Request::new(GetTaskRequest {
                task_id: task_id.clone(),
            }))
            .await
            .unwrap()
            .into_inner();
    let info = got.task.unwrap();
    assert_eq!(
        (info.status, info.external_task_id.as_str()),
        (TaskStatus::Completed as i32, "ext-1")
    );
    assert!(info.completed_at.is_some());
    let result: String = prost::Message::decode(info.result.unwrap().value.as_slice()).unwrap();
    assert_eq!(result, "3 errors found");
    let status =
        w.c.tasks
            .get_task_status(Request::new(GetTaskRequest {
                task_id: task_id.clone(),
            }))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(status.task.unwrap().status, TaskStatus::Completed as i32);

    // Finished tasks cannot be cancelled; unknown ones are not found.
    let err =
        w.c.tasks
            .cancel_task(Request::new(CancelTaskRequest {
                task_id: task_id.clone(),
            }))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    let err =
        w.c.tasks
            .get_task(Request::new(GetTaskRequest {
                task_id: "nope".into(),
            }))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn task_submission_errors_listing_and_cancelling() {
    let mut w = world().await;
    let submit = |task_type: &str, external: &str| SubmitTaskRequest {
        task_type: task_type.into(),
        external_task_id: external.into(),
        ..Default::default()
    };
    let err =
        w.c.tasks
            .submit_task(Request::new(submit("", "")))
            .await
            .unwrap_err();
    assert_eq!(
        (err.code(), err.message().contains("task_type")),
        (Code::InvalidArgument, true)
    );
    let err =
        w.c.tasks
            .submit_task(Request::new(SubmitTaskRequest {
                priority: "whenever".into(),
                ..submit("coder", "")
            }))
            .await
            .unwrap_err();
    assert_eq!(
        (err.code(), err.message().contains("priority")),
        (Code::InvalidArgument, true)
    );
    let err =
        w.c.tasks
            .submit_task(Request::new(SubmitTaskRequest {
                preferred_transport: 1,
                ..submit("coder", "")
            }))
            .await
            .unwrap_err();
    assert!(err.message().contains("callback_url"), "{}", err.message());

    // By capability: "code" is coder's.
    let mut ids = Vec::new();
    for i in 0..3 {
        let r =
            w.c.tasks
                .submit_task(Request::new(submit("code", &format!("e{i}"))))
                .await
                .unwrap()
                .into_inner();
        ids.push(r.task_id);
    }
    let err =
        w.c.tasks
            .submit_task(Request::new(submit("code", "e0")))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);

    let cancelled =
        w.c.tasks
            .cancel_task(Request::new(CancelTaskRequest {
                task_id: ids[0].clone(),
            }))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(cancelled.status, TaskStatus::Cancelled as i32);
    let page =
        w.c.tasks
            .list_tasks(Request::new(ListTasksRequest {
                status: String::new(),
                limit: 2,
                offset: 0,
            }))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(
        (page.tasks.len(), page.total, page.has_more, page.limit),
        (2, 3, true, 2)
    );
    let rest =
        w.c.tasks
            .list_tasks(Request::new(ListTasksRequest {
                status: String::new(),
                limit: 2,
                offset: 2,
            }))
            .await
            .unwrap()
            .into_inner();
    assert_eq!((rest.tasks.len(), rest.has_more), (1, false));
    let received =
        w.c.tasks
            .list_tasks(Request::new(ListTasksRequest {
                status: "TASK_STATUS_RECEIVED".into(),
                limit: 0,
                offset: 0,
            }))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(received.total, 2);
    let cancelled =
        w.c.tasks
            .list_tasks(Request::new(ListTasksRequest {
                status: "cancelled".into(),
                limit: 0,
                offset: 0,
            }))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(cancelled.tasks[0].id, ids[0]);
    let err =
        w.c.tasks
            .list_tasks(Request::new(ListTasksRequest {
                status: "sleeping".into(),
                limit: 0,
                offset: 0,
            }))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // Files: kept with the task, 5 MiB each at most.
    let with_files = |size: usize| SubmitTaskWithFilesRequest {
        request: Some(submit("coder", "")),
        files: vec![FileUpload {
            field_name: "file".into(),
            filename: "log.txt".into(),
            mime_type: "text/plain".into(),
            data: vec![b'x'; size],
        }],
    };
    let ok =
        w.c.tasks
            .submit_task_with_files(Request::new(with_files(1024)))
            .await
            .unwrap()
            .into_inner();
    assert!(ok.success);
    let err =
        w.c.tasks
            .submit_task_with_files(Request::new(with_files(5 * 1024 * 1024 + 1)))
            .await
            .unwrap_err();
    assert_eq!(
        (err.code(), err.message().contains("log.txt")),
        (Code::InvalidArgument, true)
    );
    w.bridge.shutdown().await;
}

/// A finished task gets no second CANCELLED or COMPLETED update when a late message about
/// it arrives: the next update a watcher sees is another task's.
#[tokio::test]
async fn a_finished_task_reports_its_end_once() {
    let mut w = world().await;
    let mut worker = Stream::open(w.addr, "worker").await;
    let first = submit_type(&mut w, "worker").await;
    let second = submit_type(&mut w, "worker").await;
    let (_tx, mut watching) = watch(&mut w, &[&first, &second]).await;
    for id in [&first, &second] {
        assert_eq!(&next_update(&mut watching).await.task_id, id);
    }
    let request = worker.next().await;
    assert_eq!(unpack::<TaskPayload>(&request).task_id, first);
    w.c.tasks
        .cancel_task(Request::new(CancelTaskRequest {
            task_id: first.clone(),
        }))
        .await
        .unwrap();
    let cancelled = next_update(&mut watching).await;
    assert_eq!(
        (cancelled.task_id.as_str(), cancelled.status),
        (first.as_str(), TaskStatus::Cancelled as i32)
    );
    // The worker finishes the cancelled task anyway, then starts the second.
    worker
        .send(task_complete(
            "worker",
            "agentbridge",
            &first,
            "done anyway",
            &request.id,
        ))
        .await;
    worker
        .send(status_update(
            "worker",
            "agentbridge",
            &second,
            TaskStatus::Processing,
            10,
            "started",
        ))
        .await;
    let next = next_update(&mut watching).await;
    assert_eq!(
        (next.task_id.as_str(), next.status),
        (second.as_str(), TaskStatus::Processing as i32),
        "no second end for {first}"
    );
    w.bridge.shutdown().await;
}

/// SubmitTask takes a task no agent takes yet: it waits (RECEIVED) and can be read,
/// listed, watched and cancelled, and goes to the first agent that appears with that name
/// or capability.
#[tokio::test]
async fn a_task_nobody_takes_yet_waits_for_a_capable_agent() {
    let mut w = world().await;
    let by_name = submit_type(&mut w, "translator").await;
    let by_skill = submit_type(&mut w, "proofread").await;
    let dropped = submit_type(&mut w, "astrology").await;
    let info =
        w.c.tasks
            .get_task(Request::new(GetTaskRequest {
                task_id: by_name.clone(),
            }))
            .await
            .unwrap()
            .into_inner()
            .task
            .unwrap();
    assert_eq!(info.status, TaskStatus::Received as i32);
    let listed =
        w.c.tasks
            .list_tasks(Request::new(ListTasksRequest {
                status: "received".into(),
                limit: 0,
                offset: 0,
            }))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(listed.total, 3);
    let cancelled =
        w.c.tasks
            .cancel_task(Request::new(CancelTaskRequest {
                task_id: dropped.clone(),
            }))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(cancelled.status, TaskStatus::Cancelled as i32);

    let (_tx, mut watching) = watch(&mut w, &[&by_name, &by_skill]).await;
    for _ in 0..2 {
        assert_eq!(
            next_update(&mut watching).await.status,
            TaskStatus::Received as i32
        );
    }
    // An agent of that name appears.
    let mut translator = Stream::open(w.addr, "translator").await;
    let request = translator.next().await;
    assert_eq!(request.r#type, MessageType::P2pTaskRequest as i32);
    let payload: TaskPayload = unpack(&request);
    assert_eq!(
        (payload.task_id.as_str(), payload.task_type.as_str()),
        (by_name.as_str(), "translator")
    );
    let assigned = next_update(&mut watching).await;
    assert_eq!(assigned.task_id, by_name);
    assert!(assigned.message.contains("translator"), "{assigned:?}");

    // A Tracker member that declares the capability comes online.
    let tracker = w.bridge.addr("tracker").unwrap();
    let admin = common::tracker::TrackerHttp::new(tracker, "tb-admin");
    let (status, editor) = admin
        .post(
            "/members",
            json!({ "slug": "editor", "type": "agent", "capabilities": ["proofread"] }),
        )
        .await;
    assert_eq!(status, 201, "{editor}");
    let (_ws, _) =
        common::tracker::TrackerWs::auth(tracker, editor["token"].as_str().unwrap()).await;
    let assigned = next_update(&mut watching).await;
    assert_eq!(assigned.task_id, by_skill);
    assert!(assigned.message.contains("editor"), "{assigned:?}");
    w.bridge.shutdown().await;
}

/// A task left waiting when the bridge stops still goes to its agent after a restart.
#[tokio::test]
async fn a_waiting_task_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let task_id = {
        let bridge = common::start_bridge_in(data, "").await;
        let mut w = World {
            c: clients(bridge.addr("synapse").unwrap()).await,
            http: common::http(),
            addr: bridge.addr("synapse").unwrap(),
            bridge,
        };
        let id = submit_type(&mut w, "nightshift").await;
        w.bridge.shutdown().await;
        id
    };
    let bridge = common::start_bridge_in(data, "").await;
    let mut stream = Stream::open(bridge.addr("synapse").unwrap(), "nightshift").await;
    let request = stream.next().await;
    assert_eq!(unpack::<TaskPayload>(&request).task_id, task_id);
    bridge.shutdown().await;
}

/// A task its assignee rejects, or that is cancelled, ends without a result: its
/// `TaskInfo.error` says why, as a failed one's does.
#[tokio::test]
async fn a_rejected_task_says_why() {
    let w = world().await;
    let mut worker = Stream::open(w.addr, "worker").await;
    let (status, submitted) = w
        .post("/api/v1/synapse/task", json!({ "taskType": "worker", "payload": { "@type": "type.googleapis.com/google.protobuf.StringValue", "value": "not for me" } }))
        .await;
    assert_eq!(status, 200, "{submitted}");
    let id = submitted["taskId"].as_str().unwrap().to_owned();
    assert_eq!(
        worker.next().await.r#type,
        MessageType::P2pTaskRequest as i32
    );
    worker
        .send(common::synapse::status_update(
            "worker",
            "agentbridge",
            &id,
            TaskStatus::Rejected,
            0,
            "not mine",
        ))
        .await;
    let deadline = tokio::time::Instant::now() + common::WAIT;
    let task = loop {
        let (_, got) = w.get(&format!("/api/v1/synapse/task/{id}")).await;
        if got["task"]["status"] == "TASK_STATUS_REJECTED" {
            break got["task"].clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "{got}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(
        task["error"],
        json!({ "code": "REJECTED", "message": "not mine" })
    );
    w.bridge.shutdown().await;
}

/// A submitter that asks to poll (`preferred_transport: POLLING`) is not called back, even
/// with a callback URL; one that asks for callbacks is.
#[tokio::test]
async fn a_submitter_that_polls_is_not_called_back() {
    let mut w = world().await;
    let mut worker = Stream::open(w.addr, "worker").await;
    let mut receiver = CallbackReceiver::start(0).await;
    let mut submit = async |transport: TransportMode| {
        let submitted =
            w.c.tasks
                .submit_task(Request::new(SubmitTaskRequest {
                    task_type: "worker".into(),
                    callback_url: receiver.url.clone(),
                    preferred_transport: transport as i32,
                    ..Default::default()
                }))
                .await
                .unwrap()
                .into_inner();
        let request = worker.next().await;
        assert_eq!(request.r#type, MessageType::P2pTaskRequest as i32);
        worker
            .send(common::synapse::status_update(
                "worker",
                "agentbridge",
                &submitted.task_id,
                TaskStatus::Processing,
                10,
                "started",
            ))
            .await;
        submitted.task_id
    };
    let _polled = submit(TransportMode::Polling).await;
    let called = submit(TransportMode::Callback).await;
    let first = receiver.next().await;
    assert_eq!(
        first.body["payload"]["taskId"], called,
        "the first callback is the second task's: {}",
        first.body
    );
    w.bridge.shutdown().await;
}
