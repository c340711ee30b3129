//! The HTTP/JSON gateway, every HTTP rule of synapse.proto, and the listeners and token
//! that guard the endpoint.

use agentbridge::protocols::synapse::proto::{MessageType, TaskPayload};
use serde_json::{Value, json};
use tonic::{Code, Request};

use crate::common::synapse::{Stream, clients, text_of, unpack, with_meta};
use crate::common::{self, start_bridge};
use crate::support::{World, world, world_with};

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
