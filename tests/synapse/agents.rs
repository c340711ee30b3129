//! Health, capabilities and the agent list, and input no Synapse message may hold.

use agentbridge::protocols::synapse::proto::{MessageType, QueryAgentRequest, TaskPayload};
use tokio_stream::StreamExt;
use tonic::{Code, Request};

use crate::common;
use crate::common::synapse::{chat, send};
use crate::support::world;

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
