//! The Synapse endpoint over real sockets: a tonic client generated from synapse.proto for
//! every RPC, both streams, every transport mode (callbacks against a local HTTP receiver),
//! and the HTTP/JSON gateway with a plain HTTP client.

mod common;

use std::net::SocketAddr;

use agentbridge::Bridge;
use agentbridge::protocols::synapse::proto::{
    CancelTaskRequest, CreateGroupRequest, DisbandGroupRequest, FileUpload, GetTaskRequest,
    JoinGroupRequest, LeaveGroupRequest, ListGroupMembersRequest, ListTasksRequest, MessageType,
    QueryAgentRequest, SendMessageRequest, SubmitTaskRequest, SubmitTaskWithFilesRequest,
    SynapseMessage, TaskPayload, TaskResult, TaskStatus, TaskStatusStreamRequest, TaskStatusUpdate,
    TransportMode,
};
use common::start_bridge;
use common::synapse::{
    CallbackReceiver, Clients, Stream, chat, clients, endpoint, send, status_update, task_complete,
    text_of, unpack, with_meta,
};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request};

struct World {
    bridge: Bridge,
    addr: SocketAddr,
    c: Clients,
    http: reqwest::Client,
}

async fn world() -> World {
    world_with("").await
}

async fn world_with(extra: &str) -> World {
    let bridge = start_bridge(extra).await;
    let addr = bridge.addr("synapse").unwrap();
    World {
        c: clients(addr).await,
        http: common::http(),
        addr,
        bridge,
    }
}

impl World {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        self.bodiless(reqwest::Method::GET, path).await
    }

    /// A request of `method` without a body: its status and JSON answer.
    async fn bodiless(&self, method: reqwest::Method, path: &str) -> (u16, Value) {
        let res = self
            .http
            .request(method, self.url(path))
            .send()
            .await
            .unwrap();
        (
            res.status().as_u16(),
            res.json().await.unwrap_or(Value::Null),
        )
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let res = self
            .http
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap();
        (
            res.status().as_u16(),
            res.json().await.unwrap_or(Value::Null),
        )
    }

    async fn post_form(&self, path: &str, form: reqwest::multipart::Form) -> (u16, Value) {
        let res = self
            .http
            .post(self.url(path))
            .multipart(form)
            .send()
            .await
            .unwrap();
        (
            res.status().as_u16(),
            res.json().await.unwrap_or(Value::Null),
        )
    }

    /// Registers `agent` with its transport hints, by a harmless call.
    async fn register(&mut self, agent: &str, meta: &[(&'static str, &str)]) {
        let mut all = vec![("x-synapse-agent-id", agent)];
        all.extend_from_slice(meta);
        self.c
            .capabilities
            .get_capabilities(with_meta((), &[]))
            .await
            .unwrap();
        // Polling with identity registers the agent (and fetches nothing yet).
        let mut polled = self
            .c
            .messages
            .receive_callback(with_meta((), &all))
            .await
            .unwrap()
            .into_inner();
        while polled.next().await.is_some() {}
    }

    async fn poll(&mut self, agent: &str) -> Vec<SynapseMessage> {
        let mut stream = self
            .c
            .messages
            .receive_callback(with_meta((), &[("x-synapse-agent-id", agent)]))
            .await
            .unwrap()
            .into_inner();
        let mut out = Vec::new();
        while let Some(msg) = stream.next().await {
            out.push(msg.unwrap());
        }
        out
    }
}

#[tokio::test]
async fn health_capabilities_and_the_agent_list() {
    let mut w = world().await;
    let health =
        w.c.health
            .health_check(Request::new(()))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(health.status, "SERVING");
    assert_eq!(health.version, env!("CARGO_PKG_VERSION"));

    // The standard gRPC health service and server reflection answer too.
    let mut standard =
        tonic_health::pb::health_client::HealthClient::new(common::synapse::channel(w.addr).await);
    let serving = standard
        .check(tonic_health::pb::HealthCheckRequest {
            service: "synapse.TaskService".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        serving.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(
            common::synapse::channel(w.addr).await,
        );
    let ask = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter(vec![ask]))
        .await
        .unwrap()
        .into_inner();
    let listed = format!("{:?}", answers.next().await.unwrap().unwrap());
    for service in [
        "synapse.TaskService",
        "synapse.SynapseMessageService",
        "synapse.GroupService",
    ] {
        assert!(listed.contains(service), "{listed}");
    }

    let caps =
        w.c.capabilities
            .get_capabilities(Request::new(()))
            .await
            .unwrap()
            .into_inner();
    let caps = caps.capabilities.unwrap();
    assert_eq!(caps.agent_id, "agentbridge");
    assert_eq!(caps.supported_transport_modes.len(), 4);
    assert!(
        caps.supported_task_types.iter().any(|t| t.r#type == "code"),
        "coder's capability"
    );

    w.register("planner", &[]).await;
    let agents =
        w.c.capabilities
            .list_agents(Request::new(()))
            .await
            .unwrap()
            .into_inner();
    let systems: Vec<(String, String)> = agents
        .agents
        .iter()
        .map(|a| (a.agent_id.clone(), a.system_id.clone()))
        .collect();
    assert!(
        systems.contains(&("coder".into(), "tracker".into())),
        "{systems:?}"
    );
    assert!(
        systems.contains(&("planner".into(), "synapse".into())),
        "{systems:?}"
    );
    assert_eq!(agents.total as usize, agents.agents.len());

    let coder =
        w.c.capabilities
            .query_agent(Request::new(QueryAgentRequest {
                agent_id: "coder".into(),
            }))
            .await
            .unwrap()
            .into_inner()
            .capabilities
            .unwrap();
    assert_eq!(
        (coder.system_id.as_str(), coder.agent_name.as_str()),
        ("tracker", "Coder")
    );
    let missing =
        w.c.capabilities
            .query_agent(Request::new(QueryAgentRequest {
                agent_id: "ghost".into(),
            }))
            .await
            .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_burst_on_a_stream_arrives_in_order_even_after_the_sender_left() {
    let w = world().await;
    let mut alpha = Stream::open(w.addr, "alpha").await;
    let beta = Stream::open(w.addr, "beta").await;
    // Sent without waiting: most are still being stored when the next arrives.
    for i in 0..300 {
        beta.send(chat("beta", "alpha", &format!("burst {i}")))
            .await;
    }
    // beta ends its side of the stream while most are still being stored.
    let Stream { out, inbound } = beta;
    drop(out);
    for i in 0..300 {
        assert_eq!(text_of(&alpha.next().await), format!("burst {i}"));
    }
    drop(inbound);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_synchronous_send_on_a_stream_does_not_overtake_what_was_sent_before_it() {
    let mut w = world().await;
    w.register("live", &[("x-synapse-transport", "sync")]).await;
    let mut live = Stream::open(w.addr, "live").await;
    let beta = Stream::open(w.addr, "beta").await;
    let group =
        w.c.groups
            .create_group(with_meta(
                CreateGroupRequest {
                    name: "pair".into(),
                    description: String::new(),
                    coordinator_id: String::new(),
                    initial_members: vec!["live".into()],
                },
                &[("x-synapse-agent-id", "beta")],
            ))
            .await
            .unwrap()
            .into_inner()
            .group_id;
    // Group messages are stored while beta sends on; the last, to live itself, is
    // synchronous and would be routed at once.
    for i in 0..100 {
        let mut msg = chat("beta", "", &format!("group {i}"));
        msg.receiver = None;
        msg.group_id = group.clone();
        beta.send(msg).await;
    }
    beta.send(chat("beta", "live", "direct")).await;
    for i in 0..100 {
        assert_eq!(text_of(&live.next().await), format!("group {i}"));
    }
    assert_eq!(text_of(&live.next().await), "direct");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn streams_carry_messages_both_ways() {
    let mut w = world().await;
    let mut alpha = Stream::open(w.addr, "alpha").await;
    w.register("beta", &[]).await;
    let id = send(&mut w.c, chat("beta", "alpha", "hello alpha"))
        .await
        .unwrap();
    let got = alpha.next().await;
    assert_eq!(got.id, id);
    assert_eq!(text_of(&got), "hello alpha");
    assert_eq!(got.sender.as_ref().unwrap().agent_id, "beta");
    assert_eq!(got.r#type, MessageType::Unspecified as i32);

    // alpha answers on its stream; beta polls for it (it has no stream or callback).
    let mut answer = chat("alpha", "beta", "hi beta");
    answer.reply_to = id.clone();
    alpha.send(answer).await;
    // The answer is in the inbox once the bridge has taken it: wait for it by polling.
    let mut polled = Vec::new();
    for _ in 0..200 {
        polled = w.poll("beta").await;
        if !polled.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(polled.len(), 1);
    assert_eq!(text_of(&polled[0]), "hi beta");
    assert_eq!(polled[0].reply_to, id);
    assert_eq!(
        polled[0].correlation_id, id,
        "a reply joins its parent's conversation"
    );
    assert!(w.poll("beta").await.is_empty(), "fetched messages are gone");

    // A stream identified by its first message instead of metadata.
    let mut client = agentbridge::protocols::synapse::proto::synapse_message_service_client::SynapseMessageServiceClient::new(
        common::synapse::channel(w.addr).await,
    );
    let (tx, rx) = mpsc::channel(8);
    tx.send(chat("gamma", "alpha", "gamma here")).await.unwrap();
    let mut gamma = client
        .stream_messages(Request::new(ReceiverStream::new(rx)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(text_of(&alpha.next().await), "gamma here");
    send(&mut w.c, chat("alpha", "gamma", "welcome"))
        .await
        .unwrap();
    let got = tokio::time::timeout(common::WAIT, gamma.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(text_of(&got), "welcome");

    // A bad message on a stream gets a NACK; the stream stays open.
    tx.send(chat("gamma", "nobody", "lost")).await.unwrap();
    let nack = tokio::time::timeout(common::WAIT, gamma.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(nack.r#type, MessageType::P2pNack as i32);
    assert!(text_of(&nack).contains("nobody"), "{}", text_of(&nack));
    tx.send(chat("gamma", "alpha", "still open")).await.unwrap();
    assert_eq!(text_of(&alpha.next().await), "still open");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn send_message_errors_name_the_problem() {
    let mut w = world().await;
    w.register("beta", &[]).await;
    let err =
        w.c.messages
            .send_message(Request::new(SendMessageRequest { message: None }))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("message"), "{}", err.message());
    let mut no_sender = chat("", "beta", "x");
    no_sender.sender = None;
    let err = send(&mut w.c, no_sender).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("sender.agent_id"),
        "{}",
        err.message()
    );
    let err = send(&mut w.c, chat("beta", "ghost", "x"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(err.message().contains("ghost"), "{}", err.message());
    let mut bad_type = chat("beta", "coder", "x");
    bad_type.r#type = 99;
    assert_eq!(
        send(&mut w.c, bad_type).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    // A Synapse client cannot claim a name another protocol holds.
    let err = send(&mut w.c, chat("coder", "beta", "impostor"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    assert!(err.message().contains("tracker"), "{}", err.message());
    let err = send(
        &mut w.c,
        SynapseMessage {
            group_id: "nope".into(),
            ..chat("beta", "", "x")
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn callback_transport_posts_json_with_the_token_and_retries() {
    let mut w = world().await;
    let mut receiver = CallbackReceiver::start(2).await;
    w.register(
        "hooked",
        &[
            ("x-synapse-transport", "callback"),
            ("x-synapse-callback-url", &receiver.url.clone()),
            ("x-synapse-callback-token", "s3cret"),
        ],
    )
    .await;
    w.register("beta", &[]).await;
    let id = send(&mut w.c, chat("beta", "hooked", "ring ring"))
        .await
        .unwrap();
    // The first two attempts fail; the third lands.
    let got = receiver.next().await;
    assert_eq!(got.authorization.as_deref(), Some("Bearer s3cret"));
    assert_eq!(got.body["id"], json!(id));
    assert_eq!(got.body["type"], "MESSAGE_TYPE_UNSPECIFIED");
    assert_eq!(got.body["sender"]["agentId"], "beta");
    assert_eq!(got.body["payload"]["value"], "ring ring");

    // A callback that never succeeds is counted, and its message kept for polling.
    w.register(
        "broken",
        &[
            ("x-synapse-transport", "callback"),
            ("x-synapse-callback-url", "http://127.0.0.1:1/nothing"),
        ],
    )
    .await;
    send(&mut w.c, chat("beta", "broken", "keep me"))
        .await
        .unwrap();
    let mut kept = Vec::new();
    for _ in 0..300 {
        kept = w.poll("broken").await;
        if !kept.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(kept.iter().map(text_of).collect::<Vec<_>>(), ["keep me"]);
    let (_, metrics) = common::admin_get(&w.bridge, "/metrics").await;
    assert!(
        metrics.contains(
            "agentbridge_callback_failures_total{protocol=\"synapse\",outcome=\"gave_up\"}"
        ),
        "{metrics}"
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn polling_keeps_messages_in_order_until_fetched_even_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    {
        let bridge = common::start_bridge_in(data, "").await;
        let mut c = clients(bridge.addr("synapse").unwrap()).await;
        let mut poller = c
            .messages
            .receive_callback(with_meta(
                (),
                &[
                    ("x-synapse-agent-id", "poller"),
                    ("x-synapse-transport", "polling"),
                ],
            ))
            .await
            .unwrap()
            .into_inner();
        while poller.next().await.is_some() {}
        let mut sender = c
            .messages
            .receive_callback(with_meta((), &[("x-synapse-agent-id", "sender")]))
            .await
            .unwrap()
            .into_inner();
        while sender.next().await.is_some() {}
        for i in 1..=3 {
            send(&mut c, chat("sender", "poller", &format!("m{i}")))
                .await
                .unwrap();
        }
        // Let the inbox writer finish before stopping.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        bridge.shutdown().await;
    }
    let bridge = common::start_bridge_in(data, "").await;
    let mut w = World {
        c: clients(bridge.addr("synapse").unwrap()).await,
        http: common::http(),
        addr: bridge.addr("synapse").unwrap(),
        bridge,
    };
    let got: Vec<String> = w.poll("poller").await.iter().map(text_of).collect();
    assert_eq!(got, ["m1", "m2", "m3"]);
    assert!(w.poll("poller").await.is_empty());
    let err =
        w.c.messages
            .receive_callback(Request::new(()))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn sync_sends_wait_for_the_stream_or_are_unavailable() {
    let mut w = world().await;
    let mut live = Stream::open(w.addr, "live").await;
    w.register("beta", &[]).await;
    w.register("away", &[]).await;
    let response =
        w.c.messages
            .send_message(with_meta(
                SendMessageRequest {
                    message: Some(chat("beta", "live", "now")),
                },
                &[("x-synapse-transport", "sync")],
            ))
            .await
            .unwrap()
            .into_inner();
    assert!(response.success);
    assert_eq!(text_of(&live.next().await), "now");
    let err =
        w.c.messages
            .send_message(with_meta(
                SendMessageRequest {
                    message: Some(chat("beta", "away", "later")),
                },
                &[("x-synapse-transport", "sync")],
            ))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn hybrid_uses_the_stream_when_open_else_the_callback() {
    let mut w = world().await;
    let mut receiver = CallbackReceiver::start(0).await;
    w.register(
        "hy",
        &[
            ("x-synapse-transport", "hybrid"),
            ("x-synapse-callback-url", &receiver.url.clone()),
        ],
    )
    .await;
    w.register("beta", &[]).await;
    send(&mut w.c, chat("beta", "hy", "by callback"))
        .await
        .unwrap();
    assert_eq!(
        receiver.next().await.body["payload"]["value"],
        "by callback"
    );
    let mut stream = Stream::open(w.addr, "hy").await;
    send(&mut w.c, chat("beta", "hy", "by stream"))
        .await
        .unwrap();
    assert_eq!(text_of(&stream.next().await), "by stream");
    assert_eq!(receiver.received.lock().unwrap().len(), 1);
    w.bridge.shutdown().await;
}

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

#[tokio::test]
async fn groups_reach_members_of_every_protocol() {
    let mut w = world().await;
    let skynet = common::skynet::SkynetHttp::new(w.bridge.addr("skynet").unwrap());
    let alice = skynet.agent("alice").await;
    let (mut ws_alice, _) =
        common::skynet::SkynetWs::join(w.bridge.addr("skynet").unwrap(), &alice).await;
    let lead = Stream::open_groups(w.addr, "lead").await;
    let mut member = Stream::open_groups(w.addr, "member").await;

    let created =
        w.c.groups
            .create_group(with_meta(
                CreateGroupRequest {
                    name: "crew".into(),
                    description: "d".into(),
                    coordinator_id: String::new(),
                    initial_members: vec!["alice".into()],
                },
                &[("x-synapse-agent-id", "lead")],
            ))
            .await
            .unwrap()
            .into_inner();
    let group = created.group_id.clone();
    assert_eq!(created.group.unwrap().coordinator_id, "lead");
    w.c.groups
        .join_group(Request::new(JoinGroupRequest {
            group_id: group.clone(),
            agent: endpoint("member"),
        }))
        .await
        .unwrap();
    let err =
        w.c.groups
            .join_group(Request::new(JoinGroupRequest {
                group_id: group.clone(),
                agent: endpoint("member"),
            }))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    let members =
        w.c.groups
            .list_group_members(Request::new(ListGroupMembersRequest {
                group_id: group.clone(),
            }))
            .await
            .unwrap()
            .into_inner();
    let roles: Vec<(String, String)> = members
        .members
        .iter()
        .map(|m| (m.agent_id.clone(), m.role.clone()))
        .collect();
    assert_eq!(
        roles,
        [
            ("lead".into(), "coordinator".into()),
            ("alice".into(), "member".into()),
            ("member".into(), "member".into())
        ]
    );

    let mut msg = chat("lead", "", "crew, gather");
    msg.receiver = None;
    msg.group_id = group.clone();
    lead.send(msg).await;
    let got = member.next().await;
    assert_eq!(
        (text_of(&got), got.group_id.as_str()),
        ("crew, gather".to_owned(), group.as_str())
    );
    let at_alice = ws_alice.next_message().await;
    assert_eq!(common::skynet::text_of(&at_alice), "crew, gather");

    w.c.groups
        .leave_group(Request::new(LeaveGroupRequest {
            group_id: group.clone(),
            agent_id: "member".into(),
        }))
        .await
        .unwrap();
    let err =
        w.c.groups
            .leave_group(Request::new(LeaveGroupRequest {
                group_id: group.clone(),
                agent_id: "member".into(),
            }))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    // Not a member any more: its group messages are refused (a NACK on its stream).
    let mut msg = chat("member", "", "hello?");
    msg.receiver = None;
    msg.group_id = group.clone();
    member.send(msg).await;
    assert_eq!(member.next().await.r#type, MessageType::P2pNack as i32);

    w.c.groups
        .disband_group(Request::new(DisbandGroupRequest {
            group_id: group.clone(),
        }))
        .await
        .unwrap();
    let err =
        w.c.groups
            .list_group_members(Request::new(ListGroupMembersRequest { group_id: group }))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    // Members named by id before they ever connected are Synapse agents from then on, as
    // an agent `JoinGroup` names is.
    let created =
        w.c.groups
            .create_group(Request::new(CreateGroupRequest {
                name: "x".into(),
                coordinator_id: "lead".into(),
                initial_members: vec!["ghost".into()],
                ..Default::default()
            }))
            .await
            .unwrap()
            .into_inner();
    let members =
        w.c.groups
            .list_group_members(Request::new(ListGroupMembersRequest {
                group_id: created.group_id,
            }))
            .await
            .unwrap()
            .into_inner();
    let ids: Vec<&str> = (members.members.iter())
        .map(|m| m.agent_id.as_str())
        .collect();
    assert_eq!(ids, ["lead", "ghost"]);
    // One member that cannot be registered refuses the group, and registers none.
    let err =
        w.c.groups
            .create_group(Request::new(CreateGroupRequest {
                name: "y".into(),
                initial_members: vec!["newcomer".into(), "  ".into()],
                ..Default::default()
            }))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(!w.bridge.core().directory.contains("newcomer"));
    let err =
        w.c.groups
            .create_group(Request::new(CreateGroupRequest::default()))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn the_gateway_serves_every_http_rule() {
    let mut w = world().await;
    let mut worker = Stream::open(w.addr, "worker").await;

    let (status, submitted) = w
        .post("/api/v1/synapse/task", json!({ "taskType": "worker", "payload": { "@type": "type.googleapis.com/google.protobuf.StringValue", "value": "via http" }, "external_task_id": "h-1" }))
        .await;
    assert_eq!(status, 200, "{submitted}");
    assert_eq!(submitted["success"], true);
    assert_eq!(submitted["status"], "TASK_STATUS_RECEIVED");
    let id = submitted["taskId"].as_str().unwrap().to_owned();
    let request = worker.next().await;
    assert_eq!(request.r#type, MessageType::P2pTaskRequest as i32);
    // The assignee is told the id the submitter knows the task by.
    let payload: TaskPayload = unpack(&request);
    assert_eq!(payload.external_task_id, "h-1");

    let (status, got) = w.get(&format!("/api/v1/synapse/task/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(got["task"]["id"], json!(id));
    assert_eq!(got["task"]["externalTaskId"], "h-1");
    assert_eq!(
        w.get(&format!("/api/v1/synapse/task/{id}/status")).await.1["task"]["status"],
        "TASK_STATUS_RECEIVED"
    );
    let (_, listed) = w
        .get("/api/v1/synapse/tasks?status=TASK_STATUS_RECEIVED&limit=5")
        .await;
    assert_eq!(
        (listed["total"].as_i64(), listed["limit"].as_i64()),
        (Some(1), Some(5))
    );
    // Health counts the tasks still open: received, processing or waiting.
    let active = |health: Value| health["activeTasks"].as_i64();
    assert_eq!(active(w.get("/api/v1/synapse/health").await.1), Some(1));
    let (status, cancelled) = w
        .post(&format!("/api/v1/synapse/task/{id}/cancel"), json!({}))
        .await;
    assert_eq!(
        (status, cancelled["status"].as_str()),
        (200, Some("TASK_STATUS_CANCELLED"))
    );
    assert_eq!(active(w.get("/api/v1/synapse/health").await.1), Some(0));
    let (status, files) = w
        .post("/api/v1/synapse/task/multipart", json!({ "request": { "taskType": "worker" }, "files": [{ "filename": "a.txt", "data": "aGVsbG8=" }] }))
        .await;
    assert_eq!(
        (status, files["success"].as_bool()),
        (200, Some(true)),
        "{files}"
    );

    let (status, sent) = w
        .post("/api/v1/synapse/message", json!({ "message": { "sender": { "agentId": "web" }, "receiver": { "agentId": "worker" }, "payload": { "@type": "type.googleapis.com/google.protobuf.StringValue", "value": "hi from http" } } }))
        .await;
    assert_eq!(
        (status, sent["success"].as_bool()),
        (200, Some(true)),
        "{sent}"
    );
    let mut next = worker.next().await;
    while next.r#type != MessageType::Unspecified as i32 {
        next = worker.next().await;
    }
    assert_eq!(text_of(&next), "hi from http");

    assert_eq!(
        w.get("/api/v1/synapse/capabilities").await.1["capabilities"]["agentId"],
        "agentbridge"
    );
    let (_, agents) = w.get("/api/v1/synapse/agents").await;
    assert!(
        agents["agents"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["agentId"] == "web")
    );
    assert_eq!(
        w.get("/api/v1/synapse/agents/coder").await.1["capabilities"]["systemId"],
        "tracker"
    );
    let (_, health) = w.get("/api/v1/synapse/health").await;
    assert_eq!(health["status"], "SERVING");
    assert!(
        health["uptimeSeconds"].is_string(),
        "int64 is a string in proto3 JSON"
    );

    let (_, group) = w
        .post(
            "/api/v1/synapse/group",
            json!({ "name": "g", "coordinatorId": "web" }),
        )
        .await;
    let gid = group["groupId"].as_str().unwrap().to_owned();
    assert_eq!(
        w.post(
            &format!("/api/v1/synapse/group/{gid}/join"),
            json!({ "agent": { "agentId": "worker" } })
        )
        .await
        .0,
        200
    );
    let (_, members) = w.get(&format!("/api/v1/synapse/group/{gid}/members")).await;
    assert_eq!(members["members"].as_array().unwrap().len(), 2);
    assert_eq!(
        w.post(
            &format!("/api/v1/synapse/group/{gid}/leave"),
            json!({ "agentId": "worker" })
        )
        .await
        .0,
        200
    );
    assert_eq!(
        w.post(&format!("/api/v1/synapse/group/{gid}/disband"), json!({}))
            .await
            .0,
        200
    );

    // ReceiveCallback's HTTP form ingests a message from a remote Synapse system.
    let (status, acked) = w
        .post("/api/v1/synapse/callback", json!({ "id": "remote-1", "sender": { "agentId": "remote" }, "receiver": { "agentId": "worker" }, "payload": { "@type": "type.googleapis.com/google.protobuf.StringValue", "value": "from afar" } }))
        .await;
    assert_eq!(status, 200, "{acked}");
    assert_eq!(acked["result"]["type"], "MESSAGE_TYPE_P2P_ACK");
    assert_eq!(acked["result"]["replyTo"], "remote-1");
    assert_eq!(text_of(&worker.next().await), "from afar");

    // Without a message it is ReceiveCallback itself: the caller's kept messages, oldest
    // first, one `{"result": …}` per line as grpc-gateway writes a server stream.
    w.register("poller", &[("x-synapse-transport", "polling")])
        .await;
    for text in ["kept 1", "kept 2"] {
        let (status, _) = w
            .post("/api/v1/synapse/callback", json!({ "sender": { "agentId": "remote" }, "receiver": { "agentId": "poller" }, "payload": { "@type": "type.googleapis.com/google.protobuf.StringValue", "value": text } }))
            .await;
        assert_eq!(status, 200);
    }
    // The agent named in metadata as gRPC sends it, then as grpc-gateway clients do.
    for (body, header) in [
        ("", "x-synapse-agent-id"),
        ("{}", "Grpc-Metadata-X-Synapse-Agent-Id"),
    ] {
        let res = w
            .http
            .post(w.url("/api/v1/synapse/callback"))
            .header(header, "poller")
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status().as_u16(), 200);
        let lines: Vec<Value> = res
            .text()
            .await
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        let texts: Vec<&str> = lines
            .iter()
            .map(|line| line["result"]["payload"]["value"].as_str().unwrap())
            .collect();
        // Fetched once: the second poll finds none left.
        let expected: &[&str] = if body.is_empty() {
            &["kept 1", "kept 2"]
        } else {
            &[]
        };
        assert_eq!(texts, expected, "{body:?}");
    }
    // Without saying whose messages, it is refused as over gRPC.
    let (status, _) = w
        .bodiless(reqwest::Method::POST, "/api/v1/synapse/callback")
        .await;
    assert_eq!(status, 400);

    // Errors: {code, message} with the matching HTTP status.
    let (status, err) = w.get("/api/v1/synapse/task/nope").await;
    assert_eq!((status, err["code"].as_i64()), (404, Some(5)));
    assert!(err["message"].as_str().unwrap().contains("nope"));
    let (status, err) = w.post("/api/v1/synapse/task", json!({})).await;
    assert_eq!((status, err["code"].as_i64()), (400, Some(3)));
    let decode_errors = common::decode_errors(&w.bridge, "synapse").await;
    let (status, _) = w
        .post("/api/v1/synapse/task", json!({ "taskType": 7 }))
        .await;
    assert_eq!(status, 400);
    // A body that does not fit is counted as malformed input, as a bad frame is.
    assert!(common::decode_errors(&w.bridge, "synapse").await > decode_errors);
    let (status, err) = w.get("/api/v1/synapse/tasks?limit=many").await;
    assert_eq!(status, 400, "{err}");
    // As grpc-gateway: a query parameter of no field is passed over, and one the path
    // binds is taken from the path.
    let (status, health) = w.get("/api/v1/synapse/health?cachebust=1").await;
    assert_eq!(status, 200, "{health}");
    for query in ["task_id=other", "taskId=other"] {
        let (status, err) = w.get(&format!("/api/v1/synapse/task/nope?{query}")).await;
        assert_eq!(status, 404, "{query}: {err}");
        assert!(err["message"].as_str().unwrap().contains("nope"), "{err}");
    }
    // No rule: grpc-gateway's 404, not gRPC's UNIMPLEMENTED in a 200.
    let (status, err) = w.get("/api/v1/synapse/nope").await;
    assert_eq!(
        (status, err["code"].as_i64(), err["message"].as_str()),
        (404, Some(5), Some("Not Found"))
    );
    let (status, err) = w
        .bodiless(reqwest::Method::DELETE, "/api/v1/synapse/health")
        .await;
    assert_eq!((status, err["code"].as_i64()), (405, Some(12)), "{err}");
    // A gRPC call of no service is still gRPC's UNIMPLEMENTED.
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", w.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/synapse.v1.Nope/Call");
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    let refused = grpc.unary(Request::new(()), path, codec).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unimplemented);

    let (status, openapi) = w.get("/api/v1/synapse/openapi.json").await;
    assert_eq!(status, 200);
    assert_eq!(openapi["info"]["title"], "Synapse Protocol API");
    assert!(openapi["paths"]["/api/v1/synapse/group/{group_id}/join"]["post"].is_object());
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_configured_token_is_required() {
    let extra = "[synapse]\nlisten = \"127.0.0.1:0\"\ntoken = \"letmein\"\n";
    let mut w = world_with(extra).await;
    let err = w.c.health.health_check(Request::new(())).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    let ok =
        w.c.health
            .health_check(with_meta((), &[("authorization", "Bearer letmein")]))
            .await;
    assert!(ok.is_ok());
    let err =
        w.c.health
            .health_check(with_meta((), &[("authorization", "Bearer nope")]))
            .await
            .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    let (status, body) = w.get("/api/v1/synapse/health").await;
    assert_eq!((status, body["code"].as_i64()), (401, Some(16)));
    let res = w
        .http
        .get(w.url("/api/v1/synapse/health"))
        .bearer_auth("letmein")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 200);
    // The standard health service stays open for probes.
    let mut standard =
        tonic_health::pb::health_client::HealthClient::new(common::synapse::channel(w.addr).await);
    assert!(
        standard
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new()
            })
            .await
            .is_ok()
    );
    w.bridge.shutdown().await;
}

/// A client awaits the call's response headers before it sends anything (as generated
/// clients do when the first message is produced after `stream_messages` returns): the
/// bridge answers at once and identifies the stream from its first message.
#[tokio::test]
async fn a_stream_is_answered_before_its_first_message() {
    use agentbridge::protocols::synapse::proto::group_service_client::GroupServiceClient;
    use agentbridge::protocols::synapse::proto::synapse_message_service_client::SynapseMessageServiceClient;

    let mut w = world().await;
    let mut alpha = Stream::open(w.addr, "alpha").await;
    let mut client = SynapseMessageServiceClient::new(common::synapse::channel(w.addr).await);
    let (tx, rx) = mpsc::channel(8);
    let mut late = tokio::time::timeout(
        common::WAIT,
        client.stream_messages(Request::new(ReceiverStream::new(rx))),
    )
    .await
    .expect("StreamMessages is answered before the first message")
    .unwrap()
    .into_inner();
    tx.send(chat("late", "alpha", "late here")).await.unwrap();
    assert_eq!(text_of(&alpha.next().await), "late here");
    send(&mut w.c, chat("alpha", "late", "welcome"))
        .await
        .unwrap();
    let got = tokio::time::timeout(common::WAIT, late.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(text_of(&got), "welcome");

    // The group stream too: its first message joins a group.
    let mut lead = Stream::open_groups(w.addr, "lead").await;
    let group =
        w.c.groups
            .create_group(with_meta(
                CreateGroupRequest {
                    name: "crew".into(),
                    ..Default::default()
                },
                &[("x-synapse-agent-id", "lead")],
            ))
            .await
            .unwrap()
            .into_inner()
            .group_id;
    let mut groups = GroupServiceClient::new(common::synapse::channel(w.addr).await);
    let (gtx, grx) = mpsc::channel(8);
    let mut glate = tokio::time::timeout(
        common::WAIT,
        groups.stream_group_messages(Request::new(ReceiverStream::new(grx))),
    )
    .await
    .expect("StreamGroupMessages is answered before the first message")
    .unwrap()
    .into_inner();
    gtx.send(SynapseMessage {
        r#type: MessageType::GroupJoin as i32,
        sender: endpoint("glate"),
        group_id: group.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(lead.next().await.r#type, MessageType::GroupJoin as i32);
    let mut hello = chat("lead", "", "welcome aboard");
    hello.receiver = None;
    hello.group_id = group;
    lead.send(hello).await;
    let got = tokio::time::timeout(common::WAIT, glate.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(text_of(&got), "welcome aboard");
    w.bridge.shutdown().await;
}

/// `ReceiveCallback` right after `SendMessage` returns sees the message: the poll waits
/// for the inbox writer to catch up with everything accepted before it.
#[tokio::test]
async fn a_poll_sees_every_message_accepted_before_it() {
    let mut w = world().await;
    w.register("inbox", &[("x-synapse-transport", "polling")])
        .await;
    w.register("beta", &[]).await;
    for round in 0..20 {
        let sends = (0..10).map(|i| {
            let mut client = w.c.messages.clone();
            async move {
                client
                    .send_message(Request::new(SendMessageRequest {
                        message: Some(chat("beta", "inbox", &format!("r{round} m{i}"))),
                    }))
                    .await
                    .unwrap()
            }
        });
        futures_util::future::join_all(sends).await;
        assert_eq!(w.poll("inbox").await.len(), 10, "round {round}");
    }
    w.bridge.shutdown().await;
}

/// What waited in an agent's inbox while it was away arrives, in order, on the stream it
/// opens, and leaves the inbox.
#[tokio::test]
async fn messages_kept_while_offline_arrive_in_order_when_the_stream_opens() {
    let mut w = world().await;
    w.register("sleeper", &[]).await;
    w.register("beta", &[]).await;
    for i in 1..=3 {
        send(&mut w.c, chat("beta", "sleeper", &format!("m{i}")))
            .await
            .unwrap();
    }
    let mut stream = Stream::open(w.addr, "sleeper").await;
    for i in 1..=3 {
        assert_eq!(text_of(&stream.next().await), format!("m{i}"));
    }
    send(&mut w.c, chat("beta", "sleeper", "m4")).await.unwrap();
    assert_eq!(text_of(&stream.next().await), "m4");
    assert!(w.poll("sleeper").await.is_empty(), "delivered, so gone");
    w.bridge.shutdown().await;
}

/// The number a test message carries at the start of its text.
fn seq_of(msg: &SynapseMessage) -> usize {
    text_of(msg)
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a numbered message")
}

/// A stream of `agent` on a narrow channel, `total` messages from "beta" sent to it.
async fn flooded_stream(w: &mut World, agent: &str, total: usize) -> Stream {
    w.register("beta", &[]).await;
    let narrow = common::synapse::narrow_channel(w.addr).await;
    let stream = Stream::open_on(narrow, agent).await;
    flood(w, agent, total).await;
    stream
}

/// Sends `total` numbered messages of about 8 KiB, more than a stream on a narrow channel
/// that is not read can take in (HTTP/2 window, output buffer), so some wait at the bridge.
async fn flood(w: &mut World, to: &str, total: usize) {
    let pad = "x".repeat(8 * 1024);
    for i in 0..total {
        send(&mut w.c, chat("beta", to, &format!("{i} {pad}")))
            .await
            .unwrap();
    }
}

/// A stream that ends (the client closes its side) leaves nothing behind: what it did not
/// write yet goes back to the agent's inbox.
#[tokio::test]
async fn deliveries_queued_for_an_ending_stream_go_back_to_the_inbox() {
    let mut w = world().await;
    let total = 300;
    let Stream { out, mut inbound } = flooded_stream(&mut w, "closing", total).await;
    // The client is done sending: the bridge ends the stream.
    drop(out);
    let mut seen = Vec::new();
    while let Some(msg) = tokio::time::timeout(common::WAIT, inbound.next())
        .await
        .expect("the stream ends within the wait")
    {
        seen.push(seq_of(&msg.unwrap()));
    }
    seen.extend(w.poll("closing").await.iter().map(seq_of));
    assert_eq!(seen, (0..total).collect::<Vec<_>>());
    w.bridge.shutdown().await;
}

/// An agent with two streams open is sent every message on each. What the newer one holds
/// when it ends is not kept for the agent again: its older stream was sent all of it.
#[tokio::test]
async fn what_a_newer_stream_leaves_undelivered_is_not_kept_while_an_older_one_has_it() {
    let mut w = world().await;
    assert_eq!(newer_streams_leftovers(&mut w).await, 0);
    w.bridge.shutdown().await;
}

/// As above, but the older stream's mailbox drops messages when full (`drop_oldest`): it
/// may not have them all, so what the newer one holds is kept.
#[tokio::test]
async fn what_a_newer_stream_leaves_undelivered_is_kept_when_the_older_one_may_drop() {
    let mut w = world_with("[routing]\nwhen_full = \"drop_oldest\"").await;
    assert!(newer_streams_leftovers(&mut w).await > 0);
    w.bridge.shutdown().await;
}

/// Opens two streams of one agent, floods it, reads everything on the older, lets the
/// bridge end the newer with messages still at the bridge: how many are then kept in the
/// agent's inbox.
async fn newer_streams_leftovers(w: &mut World) -> usize {
    let total = 300;
    let mut older = Stream::open(w.addr, "twin").await;
    let Stream { out, mut inbound } = flooded_stream(w, "twin", total).await;
    for i in 0..total {
        assert_eq!(seq_of(&older.next().await), i);
    }
    // The newer stream's client is done sending: the bridge ends that stream, with what
    // the client has not taken in still at the bridge.
    drop(out);
    let mut read = 0;
    while let Some(msg) = tokio::time::timeout(common::WAIT, inbound.next())
        .await
        .expect("the stream ends within the wait")
    {
        msg.unwrap();
        read += 1;
    }
    assert!(read < total, "the newer stream was sent everything: {read}");
    w.poll("twin").await.len()
}

/// A client that goes away (cancels the call) mid-stream: what the bridge still held for
/// it is kept in its inbox, in order, up to the last message.
#[tokio::test]
async fn deliveries_held_for_a_vanished_client_are_kept() {
    let mut w = world().await;
    let total = 300;
    let Stream { out, mut inbound } = flooded_stream(&mut w, "gone", total).await;
    let mut read = Vec::new();
    for _ in 0..5 {
        let msg = tokio::time::timeout(common::WAIT, inbound.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        read.push(seq_of(&msg));
    }
    assert_eq!(read, [0, 1, 2, 3, 4]);
    drop(inbound);
    drop(out);
    // The bridge notices the cancel on its own time.
    let kept = poll_through(&mut w, "gone", total - 1).await;
    // What was in flight on the connection is gone with it; the rest is kept, in order.
    let first = *kept.first().expect("something was kept");
    assert!(first > 4, "{kept:?}");
    assert_eq!(kept, (first..total).collect::<Vec<_>>());
    w.bridge.shutdown().await;
}

/// A stream whose mailbox overflows under `when_full = "disconnect"` is ended, and what
/// its mailbox held, the message that overflowed it and those after go to the agent's
/// inbox: nothing is lost.
#[tokio::test]
async fn a_stream_disconnected_for_overflow_leaves_its_messages_in_the_inbox() {
    let mut w = world_with("[routing]\nmailbox_capacity = 8\nwhen_full = \"disconnect\"").await;
    let total = 300;
    let Stream { out, mut inbound } = flooded_stream(&mut w, "slow", total).await;
    // The bridge ends the stream; what the client can still read, it reads.
    let mut seen = Vec::new();
    while let Some(Ok(msg)) = tokio::time::timeout(common::WAIT, inbound.next())
        .await
        .expect("the stream ends within the wait")
    {
        seen.push(seq_of(&msg));
    }
    drop(out);
    // Everything, the message that overflowed the mailbox included, in order.
    seen.extend(poll_through(&mut w, "slow", total - 1).await);
    assert_eq!(seen, (0..total).collect::<Vec<_>>());
    w.bridge.shutdown().await;
}

/// A stream that names its agent by its first message, whose client leaves while the bridge
/// is still sending what waited in the agent's inbox: that first message is stored and
/// delivered all the same.
#[tokio::test]
async fn the_message_a_stream_opens_with_is_kept_when_its_client_leaves_during_the_backlog() {
    use agentbridge::protocols::synapse::proto::synapse_message_service_client::SynapseMessageServiceClient;

    let mut w = world().await;
    w.register("leaver", &[]).await;
    w.register("peer", &[("x-synapse-transport", "polling")])
        .await;
    w.register("beta", &[]).await;
    // More than a narrow channel that is not read takes in: the backlog send waits.
    flood(&mut w, "leaver", 300).await;
    let narrow = common::synapse::narrow_channel(w.addr).await;
    let (out, rx) = mpsc::channel(4);
    out.send(chat("leaver", "peer", "said on the way out"))
        .await
        .unwrap();
    let inbound = SynapseMessageServiceClient::new(narrow)
        .stream_messages(Request::new(ReceiverStream::new(rx)))
        .await
        .unwrap()
        .into_inner();
    // Nothing is read; the client leaves while its backlog is being sent.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    drop(inbound);
    drop(out);
    let deadline = tokio::time::Instant::now() + common::WAIT;
    loop {
        let polled = w.poll("peer").await;
        if polled.iter().any(|m| text_of(m) == "said on the way out") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stream's first message never reached its receiver"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    w.bridge.shutdown().await;
}

/// The design's `grpc_listen` / `http_listen`: two ports, each serving both.
#[tokio::test]
async fn grpc_and_http_can_listen_on_ports_of_their_own() {
    let bridge =
        start_bridge("[synapse]\ngrpc_listen = \"127.0.0.1:0\"\nhttp_listen = \"127.0.0.1:0\"")
            .await;
    let role = |wanted: &str| {
        (bridge.listeners().iter())
            .find(|(endpoint, role, _)| *endpoint == "synapse" && *role == wanted)
            .map(|(_, _, addr)| *addr)
            .unwrap_or_else(|| panic!("a {wanted} listener: {:?}", bridge.listeners()))
    };
    let (grpc, http) = (role("grpc"), role("http"));
    assert_ne!(grpc, http);
    let mut c = clients(grpc).await;
    let health = c.health.health_check(Request::new(())).await.unwrap();
    assert!(health.into_inner().status.contains("SERVING"));
    let res = common::http()
        .get(format!("http://{http}/api/v1/synapse/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 200);
    bridge.shutdown().await;
}

/// Polls `agent`'s inbox until message `last` is in it; the numbers polled, in order.
async fn poll_through(w: &mut World, agent: &str, last: usize) -> Vec<usize> {
    let mut kept = Vec::new();
    for _ in 0..500 {
        kept.extend(w.poll(agent).await.iter().map(seq_of));
        if kept.last() == Some(&last) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    kept
}

/// Waits for the next update on a `StreamTaskStatus` stream.
async fn next_update(watching: &mut tonic::Streaming<TaskStatusUpdate>) -> TaskStatusUpdate {
    tokio::time::timeout(common::WAIT, watching.next())
        .await
        .expect("an update within the wait")
        .expect("the watch is open")
        .expect("an update, not an error")
}

/// Opens `StreamTaskStatus` subscribed to `ids`; returns the sender (kept open) and stream.
async fn watch(
    w: &mut World,
    ids: &[&str],
) -> (
    mpsc::Sender<TaskStatusStreamRequest>,
    tonic::Streaming<TaskStatusUpdate>,
) {
    let (tx, rx) = mpsc::channel(8);
    for id in ids {
        tx.send(TaskStatusStreamRequest {
            task_id: (*id).to_owned(),
            subscribe: true,
        })
        .await
        .unwrap();
    }
    let watching =
        w.c.tasks
            .stream_task_status(Request::new(ReceiverStream::new(rx)))
            .await
            .unwrap()
            .into_inner();
    (tx, watching)
}

async fn submit_type(w: &mut World, task_type: &str) -> String {
    let submitted =
        w.c.tasks
            .submit_task(Request::new(SubmitTaskRequest {
                task_type: task_type.into(),
                payload: Some(prost_types::Any {
                    type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
                    value: prost::Message::encode_to_vec(&format!("a {task_type} job")),
                }),
                ..Default::default()
            }))
            .await
            .unwrap()
            .into_inner();
    assert!(submitted.success);
    assert_eq!(submitted.status, TaskStatus::Received as i32);
    submitted.task_id
}

/// An `Any` of a type the bridge has no descriptor for is relayed byte for byte: on
/// streams, in callbacks' JSON as `{"@type", "value": base64}`, from that JSON back, and in
/// a task's result. A payload that cannot be relayed is refused, never dropped.
#[tokio::test]
async fn payloads_of_unknown_types_are_relayed_unchanged() {
    let mut w = world().await;
    let mut receiver = CallbackReceiver::start(0).await;
    w.register(
        "hooked",
        &[
            ("x-synapse-transport", "callback"),
            ("x-synapse-callback-url", &receiver.url.clone()),
        ],
    )
    .await;
    let mut streamed = Stream::open(w.addr, "streamed").await;
    w.register("beta", &[]).await;
    let secret = prost_types::Any {
        type_url: "type.googleapis.com/acme.Secret".into(),
        value: vec![1, 2, 3, 250],
    };
    let opaque = |to: &str| SynapseMessage {
        payload: Some(secret.clone()),
        ..chat("beta", to, "")
    };

    send(&mut w.c, opaque("streamed")).await.unwrap();
    assert_eq!(streamed.next().await.payload, Some(secret.clone()));

    send(&mut w.c, opaque("hooked")).await.unwrap();
    let body = receiver.next().await.body;
    assert_eq!(
        body["payload"],
        json!({ "@type": "type.googleapis.com/acme.Secret", "value": "AQID+g==" })
    );
    // A remote Synapse system relaying that JSON to us: the bytes come through unchanged.
    let mut relayed = body.clone();
    relayed["id"] = json!("relay-1");
    relayed["receiver"] = json!({ "agentId": "streamed" });
    let (status, acked) = w.post("/api/v1/synapse/callback", relayed).await;
    assert_eq!(status, 200, "{acked}");
    let got = streamed.next().await;
    assert_eq!(
        (got.id.as_str(), got.payload),
        ("relay-1", Some(secret.clone()))
    );

    // A task whose result is of an unknown type keeps it, over gRPC and the gateway.
    let task_id = submit_type(&mut w, "streamed").await;
    let (_tx, mut watching) = watch(&mut w, &[&task_id]).await;
    assert_eq!(
        next_update(&mut watching).await.status,
        TaskStatus::Received as i32
    );
    let request = streamed.next().await;
    assert_eq!(request.r#type, MessageType::P2pTaskRequest as i32);
    let mut done = task_complete("streamed", "agentbridge", &task_id, "", &request.id);
    done.payload = Some(prost_types::Any {
        type_url: "type.googleapis.com/synapse.TaskResult".into(),
        value: prost::Message::encode_to_vec(&TaskResult {
            task_id: task_id.clone(),
            task_type: "streamed".into(),
            result: Some(secret.clone()),
            summary: "sealed".into(),
        }),
    });
    streamed.send(done).await;
    assert_eq!(
        next_update(&mut watching).await.status,
        TaskStatus::Completed as i32
    );
    let info =
        w.c.tasks
            .get_task(Request::new(GetTaskRequest {
                task_id: task_id.clone(),
            }))
            .await
            .unwrap()
            .into_inner()
            .task
            .unwrap();
    assert_eq!(info.result, Some(secret.clone()));
    let (status, got) = w.get(&format!("/api/v1/synapse/task/{task_id}")).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        got["task"]["result"],
        json!({ "@type": "type.googleapis.com/acme.Secret", "value": "AQID+g==" })
    );

    // Claims a type the bridge knows, but its bytes are not that type: refused.
    let mut broken = opaque("streamed");
    broken.payload = Some(prost_types::Any {
        type_url: "type.googleapis.com/synapse.TaskPayload".into(),
        value: vec![0xff, 0xff, 0xff],
    });
    let err = send(&mut w.c, broken).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("payload"), "{}", err.message());
    w.bridge.shutdown().await;
}

/// Timestamps outside what a Timestamp may hold are refused with INVALID_ARGUMENT, as are
/// payloads nested beyond reason; the bridge neither panics nor overflows its stack.
#[tokio::test]
async fn out_of_range_input_is_refused_without_a_panic() {
    let mut w = world().await;
    w.register("beta", &[]).await;
    w.register("gamma", &[]).await;
    for (seconds, nanos) in [
        (i64::MAX, 0),
        (i64::MIN, 0),
        (0, -1),
        (0, 2_000_000_000),
        (400_000_000_000, 0),
    ] {
        let mut msg = chat("beta", "gamma", "when?");
        msg.timestamp = Some(prost_types::Timestamp { seconds, nanos });
        let err = send(&mut w.c, msg).await.unwrap_err();
        assert_eq!(
            err.code(),
            Code::InvalidArgument,
            "{seconds}/{nanos}: {err:?}"
        );
        assert!(err.message().contains("timestamp"), "{}", err.message());
    }
    // A task payload holding a task payload holding … thousands deep.
    let mut nested = prost::Message::encode_to_vec(&"core".to_owned());
    let mut url = "type.googleapis.com/google.protobuf.StringValue".to_owned();
    for _ in 0..5000 {
        nested = prost::Message::encode_to_vec(&TaskPayload {
            task_id: String::new(),
            task_type: "doll".into(),
            payload: Some(prost_types::Any {
                type_url: url,
                value: nested,
            }),
            external_task_id: String::new(),
        });
        url = "type.googleapis.com/synapse.TaskPayload".to_owned();
    }
    let mut msg = chat("beta", "gamma", "");
    msg.r#type = MessageType::P2pTaskRequest as i32;
    msg.payload = Some(prost_types::Any {
        type_url: url,
        value: nested,
    });
    let err = send(&mut w.c, msg).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    // Still serving.
    w.c.health.health_check(Request::new(())).await.unwrap();
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

/// Reads one HTTP/1.1 response from a raw socket: its status and JSON body.
async fn raw_response(socket: &mut tokio::net::TcpStream) -> (u16, Value) {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(common::WAIT, socket.read(&mut chunk))
            .await
            .expect("a response within the wait")
            .unwrap();
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap())
                })
                .expect("a content-length");
            if body.len() >= length || n == 0 {
                let status = head.split(' ').nth(1).unwrap().parse().unwrap();
                return (status, serde_json::from_str(body).unwrap_or(Value::Null));
            }
        }
        assert!(n > 0, "connection closed mid-response: {text}");
    }
}

/// Files of several MiB go through the gateway's `SubmitTaskWithFiles`; a body over the
/// gateway's limit is refused at once with its usual JSON error.
#[tokio::test]
async fn the_gateway_takes_large_files_and_refuses_huge_bodies_in_json() {
    use base64::Engine;
    let w = world().await;
    let data = base64::engine::general_purpose::STANDARD.encode(vec![7u8; 4 * 1024 * 1024]);
    let (status, body) = w
        .post(
            "/api/v1/synapse/task/multipart",
            json!({ "request": { "taskType": "coder" }, "files": [{ "filename": "big.bin", "data": data }] }),
        )
        .await;
    assert_eq!(
        (status, body["success"].as_bool()),
        (200, Some(true)),
        "{body}"
    );

    use tokio::io::AsyncWriteExt;
    let mut socket = tokio::net::TcpStream::connect(w.addr).await.unwrap();
    socket
        .write_all(
            b"POST /api/v1/synapse/task HTTP/1.1\r\nhost: bridge\r\ncontent-type: application/json\r\ncontent-length: 1000000000\r\n\r\n",
        )
        .await
        .unwrap();
    let (status, err) = raw_response(&mut socket).await;
    assert_eq!(status, 413, "{err}");
    assert_eq!(err["code"].as_i64(), Some(8), "{err}");
    assert!(err["message"].as_str().unwrap().contains("limit"), "{err}");
    w.bridge.shutdown().await;
}

/// The bridge's own directory entry is not one of the agents ListAgents shows.
#[tokio::test]
async fn the_agent_list_leaves_out_the_bridge_itself() {
    let mut w = world().await;
    let agents =
        w.c.capabilities
            .list_agents(Request::new(()))
            .await
            .unwrap()
            .into_inner();
    assert!(!agents.agents.is_empty());
    assert!(
        agents
            .agents
            .iter()
            .all(|a| a.agent_id != "agentbridge" && a.system_id != "bridge"),
        "{:?}",
        agents.agents
    );
    assert_eq!(agents.total as usize, agents.agents.len());
    let (_, listed) = w.get("/api/v1/synapse/agents").await;
    assert!(
        listed["agents"]
            .as_array()
            .unwrap()
            .iter()
            .all(|a| a["agentId"] != "agentbridge")
    );
    w.bridge.shutdown().await;
}

/// `SubmitTaskWithFiles` over HTTP as its proto comment says, a multipart/form-data upload:
/// request fields as form fields, each file a part of its own.
#[tokio::test]
async fn the_gateway_takes_submit_task_with_files_as_a_multipart_form() {
    let w = world().await;
    let skynet_addr = w.bridge.addr("skynet").unwrap();
    let alice = common::skynet::SkynetHttp::new(skynet_addr)
        .agent("alice")
        .await;
    let (mut ws_alice, _) = common::skynet::SkynetWs::join(skynet_addr, &alice).await;
    let file = reqwest::multipart::Part::bytes(b"hello".to_vec())
        .file_name("notes.txt")
        .mime_str("text/plain")
        .unwrap();
    let form = reqwest::multipart::Form::new()
        .text("task_type", "alice")
        .text("externalTaskId", "ext-form-1")
        .part("attachment", file);
    /// Submits `form`; the task alice is given for it.
    async fn given(
        w: &World,
        alice: &mut common::skynet::SkynetWs,
        form: reqwest::multipart::Form,
    ) -> Value {
        let (status, submitted) = w.post_form("/api/v1/synapse/task/multipart", form).await;
        assert_eq!(
            (status, &submitted["success"]),
            (200, &json!(true)),
            "{submitted}"
        );
        alice.next_message().await
    }
    let task = given(&w, &mut ws_alice, form).await;
    assert_eq!(task["payload"]["files"], json!(["notes.txt"]), "{task}");

    // `request` sent as a file (`curl -F request=@task.json`) is still the request, and a
    // file input left empty is no file.
    let request = reqwest::multipart::Part::bytes(br#"{"taskType": "alice"}"#.to_vec())
        .file_name("task.json")
        .mime_str("application/json")
        .unwrap();
    let empty = reqwest::multipart::Part::bytes(Vec::new()).file_name("");
    let form = reqwest::multipart::Form::new()
        .part("request", request)
        .part("attachment", empty);
    let task = given(&w, &mut ws_alice, form).await;
    assert!(task["payload"].get("files").is_none(), "{task}");

    // The `request` part may carry the request as JSON; a field that is not one is refused.
    let form = reqwest::multipart::Form::new()
        .text("request", r#"{"taskType": "alice"}"#)
        .text("colour", "blue");
    let (status, err) = w.post_form("/api/v1/synapse/task/multipart", form).await;
    assert_eq!((status, err["code"].as_i64()), (400, Some(3)), "{err}");
    assert!(err["message"].as_str().unwrap().contains("colour"), "{err}");
    w.bridge.shutdown().await;
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
