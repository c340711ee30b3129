//! Messages over every transport: both streams, synchronous sends, callbacks, hybrid
//! agents, groups, and payloads of types the bridge does not know.

use agentbridge::protocols::synapse::proto::{
    CreateGroupRequest, DisbandGroupRequest, GetTaskRequest, JoinGroupRequest, LeaveGroupRequest,
    ListGroupMembersRequest, MessageType, SendMessageRequest, SynapseMessage, TaskResult,
    TaskStatus,
};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request};

use crate::common;
use crate::common::synapse::{
    CallbackReceiver, Stream, chat, endpoint, send, task_complete, text_of, with_meta,
};
use crate::support::{next_update, submit_type, watch, world};

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
