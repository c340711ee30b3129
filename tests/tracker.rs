//! The Tracker endpoint over real sockets, checked against tracker-agent-protocol.md.
//!
//! Negative checks ("X does not receive M") use a sentinel: after M, something X does
//! receive is sent by the same path, and X's next frame must be that.

mod common;

use std::net::SocketAddr;

use agentbridge::Bridge;
use common::tracker::{TrackerHttp, TrackerWs, section_with};
use common::{start_bridge, start_bridge_in};
use serde_json::{Value, json};

struct World {
    bridge: Bridge,
    addr: SocketAddr,
    admin: TrackerHttp,
    coder: TrackerHttp,
}

async fn world() -> World {
    world_with("").await
}

async fn world_with(keys: &str) -> World {
    let extra = if keys.is_empty() {
        String::new()
    } else {
        section_with(keys)
    };
    let bridge = start_bridge(&extra).await;
    let addr = bridge.addr("tracker").unwrap();
    World {
        admin: TrackerHttp::new(addr, "tb-admin"),
        coder: TrackerHttp::new(addr, "tb-coder"),
        addr,
        bridge,
    }
}

async fn lobby(w: &World) -> String {
    let (ws, ok) = TrackerWs::auth(w.addr, "tb-quiet").await;
    ws.close().await;
    ok["lobby_chat_id"].as_str().unwrap().to_owned()
}

fn field_error(body: &Value) -> (&str, Vec<&str>) {
    let detail = &body["detail"][0];
    (
        detail["type"].as_str().unwrap_or_default(),
        detail["loc"]
            .as_array()
            .map(|l| l.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default(),
    )
}

/// JSON parsers do not care, but a client reading the frame as text sees the document's
/// order: `type` first, and the fields of `data` as the document lists them.
#[tokio::test]
async fn auth_ok_and_errors_are_written_in_the_documents_field_order() {
    let w = world().await;
    let mut coder = TrackerWs::connect(w.addr).await;
    coder
        .send(json!({ "type": "auth", "token": "tb-coder" }))
        .await;
    let ok = coder.next_text().await;
    assert!(
        ok.starts_with(r#"{"type":"auth.ok","data":{"slug":"coder","lobby_chat_id":""#),
        "{ok}"
    );
    let data: Value = serde_json::from_str::<Value>(&ok).unwrap()["data"].clone();
    let fields: Vec<usize> = ["\"projects\":[{\"id\":", "\"online\":"]
        .iter()
        .map(|field| ok.find(field).unwrap_or_else(|| panic!("{field} in {ok}")))
        .collect();
    assert!(fields[0] < fields[1], "{ok}");
    assert_eq!(data["projects"][0]["slug"], "team-board");
    coder.send(json!({ "type": "nonsense" })).await;
    let error = coder.next_text().await;
    assert!(
        error.starts_with(r#"{"type":"error","message":"#),
        "{error}"
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn auth_ok_lists_lobby_projects_and_who_is_online() {
    let w = world().await;
    let (_listener, _) = TrackerWs::auth(w.addr, "tb-listener").await;
    let (mut coder, ok) = TrackerWs::auth(w.addr, "tb-coder").await;
    assert_eq!(ok["slug"], "coder");
    assert!(uuid::Uuid::parse_str(ok["lobby_chat_id"].as_str().unwrap()).is_ok());
    let projects = ok["projects"].as_array().unwrap();
    assert_eq!(projects.len(), 2);
    assert_eq!(projects[0]["slug"], "team-board");
    assert_eq!(projects[0]["name"], "Team Board");
    assert!(projects[0]["id"].is_string());
    let online: Vec<&str> = ok["online"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    // The others online, as in the document's example: not the member itself.
    assert!(
        online.contains(&"listener") && !online.contains(&"coder"),
        "{online:?}"
    );

    // Nothing answers a heartbeat, a subscribe or an ack.
    coder
        .send(json!({ "type": "heartbeat", "status": "online" }))
        .await;
    coder
        .send(json!({ "type": "project.subscribe", "project_id": projects[0]["id"] }))
        .await;
    coder.send(json!({ "type": "ack" })).await;
    coder.send(json!({ "type": "dance" })).await;
    let next = coder.next().await;
    assert_eq!(
        next["type"], "error",
        "the first answer is to the bad frame: {next}"
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn bad_auth_is_refused_and_closed() {
    let w = world_with("auth_timeout_ms = 300").await;
    for (first, says) in [
        (
            Some(json!({ "type": "auth", "token": "tb-wrong" }).to_string()),
            "Invalid token",
        ),
        (
            Some(json!({ "type": "auth", "token": "" }).to_string()),
            "Invalid token",
        ),
        (Some(json!({ "type": "auth" }).to_string()), "Invalid token"),
        (
            Some(json!({ "type": "heartbeat", "status": "online" }).to_string()),
            "auth",
        ),
        (Some("not json".to_owned()), "auth"),
        (None, "timeout"),
    ] {
        let mut ws = TrackerWs::connect(w.addr).await;
        if let Some(first) = first {
            ws.send_text(first).await;
        }
        let refusal = ws.next().await;
        assert_eq!(refusal["type"], "auth.error", "{refusal}");
        let message = refusal["message"].as_str().unwrap();
        assert!(message.contains(says), "{message}");
        ws.closed().await;
    }
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn rest_needs_a_valid_bearer_token() {
    let w = world().await;
    let (status, body) = TrackerHttp::anonymous(w.addr).get("/projects").await;
    assert_eq!(
        (status, body["detail"].as_str()),
        (401, Some("Not authenticated"))
    );
    let (status, body) = TrackerHttp::new(w.addr, "tb-nope").get("/tasks").await;
    assert_eq!(
        (status, body["detail"].as_str()),
        (401, Some("Invalid token"))
    );
    assert_eq!(w.coder.get("/projects").await.0, 200);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn projects_list_and_get() {
    let w = world().await;
    let (status, projects) = w.coder.get("/projects").await;
    assert_eq!(status, 200);
    assert_eq!(projects.as_array().unwrap().len(), 2);
    let (status, project) = w.coder.get("/projects/side").await;
    assert_eq!(status, 200);
    assert_eq!(project["name"], "Side Project");
    assert!(project["chat_id"].is_string());
    assert_eq!(w.coder.get("/projects/nope").await.0, 404);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn tasks_are_created_listed_updated_and_deleted() {
    let w = world().await;
    let task = w
        .admin
        .task(
            "team-board",
            json!({ "title": "Fix login", "description": "It fails", "type": "bug", "priority": "high", "assignee_slug": "coder" }),
        )
        .await;
    assert!(uuid::Uuid::parse_str(task["id"].as_str().unwrap()).is_ok());
    assert_eq!(task["status"], "todo");
    assert_eq!(task["type"], "bug");
    assert_eq!(task["priority"], "high");
    assert_eq!(task["assignee_slug"], "coder");
    assert_eq!(task["author_slug"], "admin");
    assert_eq!(task["project_slug"], "team-board");
    let id = task["id"].as_str().unwrap();
    w.admin.task("side", json!({ "title": "Other" })).await;

    let (_, listed) = w
        .coder
        .get(&format!(
            "/tasks?project_id={}",
            task["project_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let (_, listed) = w.coder.get("/tasks?assignee=coder").await;
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let (_, listed) = w.coder.get("/tasks?status=todo").await;
    assert_eq!(listed.as_array().unwrap().len(), 2);
    let (status, body) = w.coder.get("/tasks?status=doing").await;
    assert_eq!(
        (status, field_error(&body)),
        (422, ("enum", vec!["query", "status"]))
    );

    let (status, got) = w.coder.get(&format!("/tasks/{id}")).await;
    assert_eq!((status, &got["title"]), (200, &json!("Fix login")));
    assert_eq!(
        w.coder
            .get(&format!("/tasks/{}", uuid::Uuid::new_v4()))
            .await
            .0,
        404
    );

    let (status, patched) = w
        .coder
        .patch(
            &format!("/tasks/{id}"),
            json!({ "status": "in_review", "reviewer_slug": "admin", "title": "Fix login flow" }),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(patched["status"], "in_review");
    assert_eq!(patched["reviewer_slug"], "admin");
    assert_eq!(patched["title"], "Fix login flow");
    let (_, patched) = w
        .coder
        .patch(&format!("/tasks/{id}"), json!({ "assignee_slug": null }))
        .await;
    assert_eq!(patched["assignee_slug"], Value::Null);

    let (status, _) = w.coder.delete(&format!("/tasks/{id}")).await;
    assert_eq!(status, 204);
    assert_eq!(w.coder.get(&format!("/tasks/{id}")).await.0, 404);
    assert_eq!(w.coder.delete(&format!("/tasks/{id}")).await.0, 404);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn task_validation_names_the_field() {
    let w = world().await;
    let cases = [
        (
            "/tasks?project_slug=team-board",
            json!({ "description": "no title" }),
            422,
            ("missing", vec!["body", "title"]),
        ),
        (
            "/tasks?project_slug=team-board",
            json!({ "title": "t", "status": "doing" }),
            422,
            ("enum", vec!["body", "status"]),
        ),
        (
            "/tasks?project_slug=team-board",
            json!({ "title": "t", "type": "chore" }),
            422,
            ("enum", vec!["body", "type"]),
        ),
        (
            "/tasks?project_slug=team-board",
            json!({ "title": "t", "priority": "urgent" }),
            422,
            ("enum", vec!["body", "priority"]),
        ),
        (
            "/tasks?project_slug=team-board",
            json!({ "title": "t", "assignee_slug": "ghost" }),
            422,
            ("value_error", vec!["body", "assignee_slug"]),
        ),
        (
            "/tasks?project_slug=team-board",
            json!({ "title": 5 }),
            422,
            ("string_type", vec!["body", "title"]),
        ),
        (
            "/tasks",
            json!({ "title": "t" }),
            422,
            ("missing", vec!["query", "project_slug"]),
        ),
    ];
    let decode_errors = common::decode_errors(&w.bridge, "tracker").await;
    for (path, body, status, error) in &cases {
        let (got, answer) = w.coder.post(path, body.clone()).await;
        assert_eq!(got, *status, "{body}: {answer}");
        assert_eq!(field_error(&answer), *error, "{body}: {answer}");
    }
    // Each is counted as malformed input, as a bad frame is.
    let counted = common::decode_errors(&w.bridge, "tracker").await;
    assert!(counted >= decode_errors + cases.len() as f64, "{counted}");
    let (status, answer) = w
        .coder
        .post_raw("/tasks?project_slug=team-board", "{oops")
        .await;
    assert_eq!((status, field_error(&answer).0), (422, "json_invalid"));
    let (status, answer) = w
        .coder
        .post("/tasks?project_slug=nope", json!({ "title": "t" }))
        .await;
    assert_eq!(
        (status, answer["detail"].as_str()),
        (404, Some("Project not found"))
    );
    // Posting as someone else.
    let (status, answer) = w
        .coder
        .post(
            "/tasks?project_slug=team-board",
            json!({ "title": "t", "author_slug": "admin" }),
        )
        .await;
    assert_eq!(status, 403, "{answer}");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn take_is_atomic_and_reject_returns_the_task() {
    let w = world().await;
    let task = w
        .admin
        .task("team-board", json!({ "title": "Grab me" }))
        .await;
    let id = task["id"].as_str().unwrap();
    let listener = TrackerHttp::new(w.addr, "tb-listener");

    let (status, taken) = w
        .coder
        .post(&format!("/tasks/{id}/take?slug=coder"), json!({}))
        .await;
    assert_eq!(status, 200);
    // Taking assigns and nothing else: the status is the agent's to change.
    assert_eq!(
        (taken["assignee_slug"].as_str(), taken["status"].as_str()),
        (Some("coder"), Some("todo"))
    );
    let (status, body) = listener
        .post(&format!("/tasks/{id}/take?slug=listener"), json!({}))
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(body["detail"].as_str().unwrap().contains("coder"));
    // Taking again is harmless; the slug must name a member.
    assert_eq!(
        w.coder
            .post(&format!("/tasks/{id}/take?slug=coder"), json!({}))
            .await
            .0,
        200
    );
    let (status, body) = w
        .coder
        .post(&format!("/tasks/{id}/take?slug=nobody"), json!({}))
        .await;
    assert_eq!(status, 404, "{body}");
    assert!(body["detail"].as_str().unwrap().contains("nobody"));
    assert_eq!(
        w.coder
            .post(&format!("/tasks/{id}/take"), json!({}))
            .await
            .0,
        422
    );

    assert_eq!(
        listener
            .post(
                &format!("/tasks/{id}/reject"),
                json!({ "slug": "listener", "reason": "not mine" })
            )
            .await
            .0,
        409
    );
    let (status, rejected) = w
        .coder
        .post(
            &format!("/tasks/{id}/reject"),
            json!({ "slug": "coder", "reason": "no access" }),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        (
            rejected["assignee_slug"].clone(),
            rejected["status"].as_str()
        ),
        (Value::Null, Some("backlog"))
    );
    let (_, comments) = w.coder.get(&format!("/messages?task_id={id}")).await;
    let last = comments.as_array().unwrap().last().unwrap();
    assert!(
        last["content"].as_str().unwrap().contains("no access"),
        "{last}"
    );
    assert_eq!(last["task_id"], json!(id));

    let (status, assigned) = w
        .admin
        .post(
            &format!("/tasks/{id}/assign"),
            json!({ "assignee_slug": "listener" }),
        )
        .await;
    assert_eq!(
        (status, assigned["assignee_slug"].as_str()),
        (200, Some("listener"))
    );
    assert_eq!(
        w.admin
            .post(&format!("/tasks/{id}/assign"), json!({}))
            .await
            .0,
        422
    );

    let (_, watched) = w
        .coder
        .post(&format!("/tasks/{id}/watch?slug=coder"), json!({}))
        .await;
    assert_eq!(watched["watchers"], json!(["coder"]));
    let (_, unwatched) = w
        .coder
        .delete(&format!("/tasks/{id}/watch?slug=coder"))
        .await;
    assert_eq!(unwatched["watchers"], json!([]));
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn steps_are_a_checklist() {
    let w = world().await;
    let task = w
        .admin
        .task("team-board", json!({ "title": "With steps" }))
        .await;
    let id = task["id"].as_str().unwrap();
    let (status, first) = w
        .coder
        .post(
            &format!("/tasks/{id}/steps"),
            json!({ "title": "Write test" }),
        )
        .await;
    assert_eq!(status, 201);
    assert_eq!(
        (first["done"].as_bool(), first["position"].as_i64()),
        (Some(false), Some(1))
    );
    w.coder
        .post(
            &format!("/tasks/{id}/steps"),
            json!({ "title": "Make it pass" }),
        )
        .await;
    assert_eq!(
        w.coder
            .post(&format!("/tasks/{id}/steps"), json!({}))
            .await
            .0,
        422
    );
    let step = first["id"].as_str().unwrap();
    let (status, done) = w
        .coder
        .patch(
            &format!("/tasks/{id}/steps/{step}"),
            json!({ "done": true }),
        )
        .await;
    assert_eq!((status, done["done"].as_bool()), (200, Some(true)));
    assert_eq!(
        w.coder
            .patch(
                &format!("/tasks/{id}/steps/{step}"),
                json!({ "done": "yes" })
            )
            .await
            .0,
        422
    );
    let (_, steps) = w.coder.get(&format!("/tasks/{id}/steps")).await;
    let titles: Vec<&str> = steps
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["title"].as_str().unwrap())
        .collect();
    assert_eq!(titles, ["Write test", "Make it pass"]);
    assert_eq!(
        w.coder.delete(&format!("/tasks/{id}/steps/{step}")).await.0,
        204
    );
    assert_eq!(
        w.coder.delete(&format!("/tasks/{id}/steps/{step}")).await.0,
        404
    );
    assert_eq!(
        w.coder
            .get(&format!("/tasks/{}/steps", uuid::Uuid::new_v4()))
            .await
            .0,
        404
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn messages_post_list_and_thread() {
    let w = world().await;
    let lobby = lobby(&w).await;
    let first = w
        .coder
        .message(json!({ "chat_id": lobby, "content": "hello @admin", "author_type": "agent", "author_slug": "coder", "mentions": [] }))
        .await;
    assert_eq!(first["author_slug"], "coder");
    assert_eq!(first["author_type"], "agent");
    assert_eq!(
        first["mentions"],
        json!(["admin"]),
        "@name in content is a mention"
    );
    assert_eq!(first["chat_id"], json!(lobby));
    assert_eq!(first["task_id"], Value::Null);
    assert!(first["created_at"].as_str().unwrap().ends_with('Z'));
    let reply = w
        .admin
        .message(json!({ "chat_id": lobby, "content": "hi coder", "reply_to": first["id"] }))
        .await;
    assert_eq!(reply["reply_to"], first["id"]);
    assert_eq!(reply["author_type"], "human");

    let (_, listed) = w
        .coder
        .get(&format!("/messages?chat_id={lobby}&limit=50"))
        .await;
    let contents: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["hello @admin", "hi coder"]);
    let (_, limited) = w
        .coder
        .get(&format!("/messages?chat_id={lobby}&limit=1"))
        .await;
    assert_eq!(limited[0]["content"], "hi coder");
    let (_, thread) = w
        .coder
        .get(&format!(
            "/messages/{}/replies",
            first["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(thread.as_array().unwrap().len(), 1);
    assert_eq!(thread[0]["id"], reply["id"]);
    assert_eq!(
        w.coder
            .get(&format!("/messages/{}/replies", uuid::Uuid::new_v4()))
            .await
            .0,
        404
    );

    let task = w
        .admin
        .task("team-board", json!({ "title": "Discuss" }))
        .await;
    let comment = w
        .coder
        .message(json!({ "task_id": task["id"], "content": "on it" }))
        .await;
    assert_eq!(
        (comment["task_id"].clone(), comment["chat_id"].clone()),
        (task["id"].clone(), Value::Null)
    );
    let (_, comments) = w
        .coder
        .get(&format!(
            "/messages?task_id={}",
            task["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(comments.as_array().unwrap().len(), 1);

    let (status, body) = w
        .coder
        .post("/messages", json!({ "content": "nowhere" }))
        .await;
    assert_eq!(
        (status, field_error(&body).1),
        (422, vec!["body", "chat_id"])
    );
    let (status, body) = w.coder.post("/messages", json!({ "chat_id": lobby })).await;
    assert_eq!(
        (status, field_error(&body).1),
        (422, vec!["body", "content"])
    );
    let (status, _) = w
        .coder
        .post(
            "/messages",
            json!({ "chat_id": lobby, "content": "x", "author_slug": "admin" }),
        )
        .await;
    assert_eq!(status, 403);
    let (status, _) = w
        .coder
        .post(
            "/messages",
            json!({ "chat_id": uuid::Uuid::new_v4(), "content": "x" }),
        )
        .await;
    assert_eq!(status, 404);
    let (status, body) = w
        .coder
        .post(
            "/messages",
            json!({ "chat_id": lobby, "content": "x", "author_type": "robot" }),
        )
        .await;
    assert_eq!((status, field_error(&body).0), (422, "enum"));
    assert_eq!(w.coder.get("/messages").await.0, 422);
    assert_eq!(
        w.coder
            .get(&format!("/messages?chat_id={lobby}&limit=zero"))
            .await
            .0,
        422
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn members_list_get_and_create_with_a_token_once() {
    let w = world().await;
    let (status, members) = w.admin.get("/members").await;
    assert_eq!(status, 200);
    let slugs: Vec<&str> = members
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["slug"].as_str().unwrap())
        .collect();
    assert!(
        ["admin", "coder", "listener", "quiet"]
            .iter()
            .all(|s| slugs.contains(s)),
        "{slugs:?}"
    );
    assert!(
        members
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m.get("token").is_none() && m.get("token_hash").is_none())
    );
    let (status, coder) = w.admin.get("/members/coder").await;
    assert_eq!(status, 200);
    assert_eq!(coder["chat_listen"], "mentions");
    assert_eq!(coder["capabilities"], json!(["code"]));
    assert_eq!(w.admin.get("/members/ghost").await.0, 404);

    let (status, created) = w
        .admin
        .post("/members", json!({ "slug": "tester", "name": "Tester", "type": "agent", "chat_listen": "all", "capabilities": ["test"] }))
        .await;
    assert_eq!(status, 201, "{created}");
    let token = created["token"].as_str().unwrap();
    assert!(token.starts_with("tb-"));
    let (_, again) = w.admin.get("/members/tester").await;
    assert!(again.get("token").is_none());
    let (_ws, ok) = TrackerWs::auth(w.addr, token).await;
    assert_eq!(ok["slug"], "tester");

    let (status, body) = w.admin.post("/members", json!({ "slug": "tester" })).await;
    assert_eq!(status, 409, "{body}");
    let (status, body) = w
        .admin
        .post("/members", json!({ "slug": "Bad Slug" }))
        .await;
    assert_eq!((status, field_error(&body).1), (422, vec!["body", "slug"]));
    let (status, body) = w
        .admin
        .post("/members", json!({ "slug": "x", "chat_listen": "some" }))
        .await;
    assert_eq!(
        (status, field_error(&body).1),
        (422, vec!["body", "chat_listen"])
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn attachments_upload_download_and_list() {
    let w = world().await;
    let task = w
        .admin
        .task("team-board", json!({ "title": "Files" }))
        .await;
    let comment = w
        .coder
        .message(json!({ "task_id": task["id"], "content": "screenshot attached" }))
        .await;
    let msg = comment["id"].as_str().unwrap();
    let png = vec![0x89, b'P', b'N', b'G', 1, 2, 3];
    let (status, attachment) = w
        .coder
        .upload(
            &format!("/messages/{msg}/attachments"),
            "shot.png",
            "image/png",
            png.clone(),
        )
        .await;
    assert_eq!(status, 201, "{attachment}");
    assert_eq!(attachment["filename"], "shot.png");
    assert_eq!(attachment["mime_type"], "image/png");
    assert_eq!(attachment["size"], 7);
    assert_eq!(attachment["task_id"], task["id"]);

    let (status, mime, bytes) = w
        .coder
        .download(&format!(
            "/attachments/{}",
            attachment["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!((status, mime.as_str(), bytes), (200, "image/png", png));
    let (_, listed) = w
        .coder
        .get(&format!(
            "/attachments?task_id={}",
            task["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let (_, comments) = w
        .coder
        .get(&format!(
            "/messages?task_id={}",
            task["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(comments[0]["attachments"][0]["id"], attachment["id"]);

    let big = vec![0u8; 5 * 1024 * 1024 + 1];
    let (status, body) = w
        .coder
        .upload(
            &format!("/messages/{msg}/attachments"),
            "big.bin",
            "application/octet-stream",
            big,
        )
        .await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(
        w.coder
            .upload(
                &format!("/messages/{}/attachments", uuid::Uuid::new_v4()),
                "x.txt",
                "text/plain",
                b"x".to_vec()
            )
            .await
            .0,
        404
    );
    assert_eq!(
        w.coder
            .get(&format!("/attachments/{}", uuid::Uuid::new_v4()))
            .await
            .0,
        404
    );
    assert_eq!(w.coder.get("/attachments").await.0, 422);
    let (status, body) = w
        .coder
        .get(&format!("/attachments?task_id={}", uuid::Uuid::new_v4()))
        .await;
    assert_eq!(status, 404, "{body}");
    // A body that is not a form is a JSON error naming it; an unknown message still 404.
    let (status, body) = w
        .coder
        .post(
            &format!("/messages/{msg}/attachments"),
            json!({ "file": "x" }),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["detail"][0]["loc"], json!(["body"]));
    let (status, _) = w
        .coder
        .post(
            &format!("/messages/{}/attachments", uuid::Uuid::new_v4()),
            json!({ "file": "x" }),
        )
        .await;
    assert_eq!(status, 404);
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn message_new_follows_chat_listen_and_subscriptions() {
    let w = world().await;
    let (mut listener, ok) = TrackerWs::auth(w.addr, "tb-listener").await;
    let (mut coder, _) = TrackerWs::auth(w.addr, "tb-coder").await;
    let (mut quiet, _) = TrackerWs::auth(w.addr, "tb-quiet").await;
    let lobby = ok["lobby_chat_id"].as_str().unwrap().to_owned();
    let side = ok["projects"][1].clone();
    let side_chat = w.admin.get("/projects/side").await.1["chat_id"].clone();

    // chat_listen=all hears the lobby; mentions only what names it; none nothing.
    w.admin
        .message(json!({ "chat_id": lobby, "content": "morning all" }))
        .await;
    let got = listener.next_of("message.new").await;
    assert_eq!(
        (got["content"].as_str(), got["author_slug"].as_str()),
        (Some("morning all"), Some("admin"))
    );
    assert_eq!(got["chat_id"], json!(lobby));
    w.admin
        .message(json!({ "chat_id": lobby, "content": "@coder please" }))
        .await;
    assert_eq!(coder.next_content().await, "@coder please");
    assert_eq!(listener.next_content().await, "@coder please");
    w.admin
        .message(json!({ "chat_id": lobby, "content": "x", "mentions": ["quiet"] }))
        .await;

    // A project's messages only reach its subscribers.
    w.admin
        .message(json!({ "chat_id": side_chat, "content": "side news" }))
        .await;
    w.admin
        .message(json!({ "chat_id": lobby, "content": "sentinel 1" }))
        .await;
    assert_eq!(listener.next_content().await, "x");
    assert_eq!(listener.next_content().await, "sentinel 1");
    listener
        .send(json!({ "type": "project.subscribe", "project_id": side["id"] }))
        .await;
    // The subscription is in place once a later frame is answered.
    listener.send(json!({ "type": "dance" })).await;
    assert_eq!(listener.next().await["type"], "error");
    w.admin
        .message(json!({ "chat_id": side_chat, "content": "side news 2" }))
        .await;
    assert_eq!(listener.next_content().await, "side news 2");
    listener
        .send(json!({ "type": "project.unsubscribe", "project_id": side["id"] }))
        .await;
    listener.send(json!({ "type": "dance" })).await;
    assert_eq!(listener.next().await["type"], "error");
    w.admin
        .message(json!({ "chat_id": side_chat, "content": "side news 3" }))
        .await;
    w.admin
        .message(json!({ "chat_id": lobby, "content": "sentinel 2" }))
        .await;
    assert_eq!(listener.next_content().await, "sentinel 2");

    // The quiet member got nothing at all; the mention-only one nothing unmentioned.
    w.admin
        .message(json!({ "chat_id": lobby, "content": "@coder sentinel 3" }))
        .await;
    assert_eq!(coder.next_content().await, "@coder sentinel 3");
    quiet.send(json!({ "type": "dance" })).await;
    let next = quiet.next().await;
    assert!(
        next["type"] == "error" || next["type"] == "agent.status",
        "{next}"
    );
    w.bridge.shutdown().await;
}

/// A member's message reaches the others as text in the document's order too.
#[tokio::test]
async fn a_relayed_message_new_is_written_type_first() {
    let w = world().await;
    let (mut listener, ok) = TrackerWs::auth(w.addr, "tb-listener").await;
    let (mut coder, _) = TrackerWs::auth(w.addr, "tb-coder").await;
    coder.send(json!({ "type": "chat.send", "chat_id": ok["lobby_chat_id"], "content": "in order", "mentions": [] })).await;
    let text = loop {
        let text = listener.next_text().await;
        if text.contains("message.new") {
            break text;
        }
    };
    assert!(
        text.starts_with(r#"{"type":"message.new","data":{"id":"#),
        "{text}"
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn chat_send_over_the_socket_and_its_errors() {
    let w = world().await;
    let (mut listener, ok) = TrackerWs::auth(w.addr, "tb-listener").await;
    let (mut coder, _) = TrackerWs::auth(w.addr, "tb-coder").await;
    let lobby = ok["lobby_chat_id"].clone();
    coder.send(json!({ "type": "chat.send", "chat_id": lobby, "content": "from the socket", "mentions": [] })).await;
    let got = listener.next_of("message.new").await;
    assert_eq!(
        (got["author_slug"].as_str(), got["content"].as_str()),
        (Some("coder"), Some("from the socket"))
    );
    // A UUID, time-ordered (v7): new messages append to the log's id index.
    let id = uuid::Uuid::parse_str(got["id"].as_str().unwrap()).unwrap();
    assert_eq!(id.get_version_num(), 7, "{id}");
    let (_, history) = w
        .admin
        .get(&format!("/messages?chat_id={}", lobby.as_str().unwrap()))
        .await;
    assert_eq!(history.as_array().unwrap().len(), 1);

    for (frame, says) in [
        (
            json!({ "type": "chat.send", "content": "no place" }),
            "chat_id",
        ),
        (
            json!({ "type": "chat.send", "chat_id": uuid::Uuid::new_v4(), "content": "x" }),
            "not found",
        ),
        (json!({ "type": "chat.send", "chat_id": lobby }), "content"),
        (
            json!({ "type": "project.subscribe", "project_id": "nope" }),
            "nope",
        ),
        (json!({ "type": "heartbeat", "status": "asleep" }), "status"),
        (json!({ "type": "auth", "token": "tb-coder" }), "already"),
        (json!({ "type": "whatever" }), "whatever"),
    ] {
        coder.send(frame.clone()).await;
        let error = coder.next().await;
        assert_eq!(error["type"], "error", "{frame}: {error}");
        assert!(
            error["message"].as_str().unwrap().contains(says),
            "{frame}: {error}"
        );
    }
    coder.send_text("{broken".into()).await;
    assert_eq!(coder.next().await["type"], "error");
    // Still connected.
    coder
        .send(json!({ "type": "chat.send", "chat_id": lobby, "content": "still here" }))
        .await;
    assert_eq!(listener.next_content().await, "still here");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn task_events_follow_task_listen() {
    let w = world().await;
    let (mut admin, _) = TrackerWs::auth_subscribed(w.addr, "tb-admin").await;
    let (mut coder, _) = TrackerWs::auth_subscribed(w.addr, "tb-coder").await;
    let (mut listener, _) = TrackerWs::auth(w.addr, "tb-listener").await;
    admin.next_of("agent.status").await;

    // task_listen=all on a subscribed project: every event. assigned: only its own.
    // Without a subscription to the project, none at all.
    let task = w
        .admin
        .task("team-board", json!({ "title": "Unassigned" }))
        .await;
    let created = admin.next_of("task.created").await;
    assert_eq!(created, task);
    let mine = w
        .admin
        .task(
            "team-board",
            json!({ "title": "Yours", "assignee_slug": "coder" }),
        )
        .await;
    assert_eq!(admin.next_of("task.created").await["id"], mine["id"]);
    assert_eq!(admin.next_of("task.assigned").await["id"], mine["id"]);
    // Its assignee is involved from the start: it hears of the creation, then the assignment.
    assert_eq!(coder.next_of("task.created").await, mine);
    let assigned = coder.next_of("task.assigned").await;
    assert_eq!(
        assigned, mine,
        "data is the task as the REST API returns it"
    );

    let id = mine["id"].as_str().unwrap();
    w.admin
        .patch(&format!("/tasks/{id}"), json!({ "priority": "critical" }))
        .await;
    assert_eq!(coder.next_of("task.updated").await["priority"], "critical");
    assert_eq!(admin.next_of("task.updated").await["priority"], "critical");

    // listener (task_listen=all) is not subscribed: it sees nothing, even what it watches,
    // until it subscribes.
    let other = task["id"].as_str().unwrap();
    let listener_http = TrackerHttp::new(w.addr, "tb-listener");
    listener_http
        .post(&format!("/tasks/{other}/watch?slug=listener"), json!({}))
        .await;
    assert_eq!(
        admin.next_of("task.updated").await["watchers"],
        json!(["listener"])
    );
    listener
        .send(json!({ "type": "project.subscribe", "project_id": task["project_id"] }))
        .await;
    listener.settle().await;
    w.admin
        .patch(&format!("/tasks/{other}"), json!({ "priority": "low" }))
        .await;
    // Its first task event is this one: the watch before it did not reach it.
    let updated = listener.next_of("task.updated").await;
    assert_eq!(
        (updated["id"].as_str(), updated["priority"].as_str()),
        (Some(other), Some("low"))
    );
    w.bridge.shutdown().await;
}

/// Task events come in the order the changes were made: of many changes of one task made
/// at once, the last event a member hears is of the task as it ends up. (Changes that
/// commit together wake their callers in any order.)
#[tokio::test]
async fn task_events_come_in_the_order_the_changes_were_made() {
    let w = world().await;
    let (mut admin, _) = TrackerWs::auth_subscribed(w.addr, "tb-admin").await;
    let task = w.admin.task("team-board", json!({ "title": "t" })).await;
    admin.next_of("task.created").await;
    let id = task["id"].as_str().unwrap();
    const CHANGES: usize = 40;
    let changes = (0..CHANGES).map(|n| {
        let http = TrackerHttp::new(w.addr, "tb-admin");
        let path = format!("/tasks/{id}");
        async move { http.patch(&path, json!({ "title": format!("t{n}") })).await }
    });
    for (status, body) in futures_util::future::join_all(changes).await {
        assert_eq!(status, 200, "{body}");
    }
    let (_, last) = w.admin.get(&format!("/tasks/{id}")).await;
    let mut titles = Vec::new();
    while titles.len() < CHANGES {
        titles.push(admin.next_of("task.updated").await["title"].clone());
    }
    assert_eq!(titles.last(), Some(&last["title"]), "{titles:?}");
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn a_silent_member_goes_offline_and_back() {
    let w = world_with("heartbeat_timeout_ms = 300").await;
    let (mut admin, _) = TrackerWs::auth(w.addr, "tb-admin").await;
    let (mut coder, _) = TrackerWs::auth(w.addr, "tb-coder").await;
    let status = admin.next_of("agent.status").await;
    assert_eq!(status, json!({ "slug": "coder", "status": "online" }));
    // Keep admin alive while coder stays silent.
    let offline = loop {
        admin
            .send(json!({ "type": "heartbeat", "status": "online" }))
            .await;
        let frame = tokio::time::timeout(std::time::Duration::from_millis(100), admin.next()).await;
        if let Ok(frame) = frame {
            break frame;
        }
    };
    assert_eq!(
        offline,
        json!({ "type": "agent.status", "data": { "slug": "coder", "status": "offline" } })
    );
    assert_eq!(w.admin.get("/members/coder").await.1["is_online"], false);
    coder
        .send(json!({ "type": "heartbeat", "status": "busy" }))
        .await;
    assert_eq!(
        admin.next_of("agent.status").await,
        json!({ "slug": "coder", "status": "online" })
    );
    let (_, member) = w.admin.get("/members/coder").await;
    assert_eq!(
        (member["status"].as_str(), member["is_online"].as_bool()),
        (Some("busy"), Some(true))
    );
    coder.close().await;
    assert_eq!(
        admin.next_of("agent.status").await,
        json!({ "slug": "coder", "status": "offline" })
    );
    w.bridge.shutdown().await;
}

#[tokio::test]
async fn everything_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().to_str().unwrap();
    let (task_id, lobby, token);
    {
        let bridge = start_bridge_in(data_dir, "").await;
        let addr = bridge.addr("tracker").unwrap();
        let admin = TrackerHttp::new(addr, "tb-admin");
        let task = admin
            .task(
                "team-board",
                json!({ "title": "Persist me", "assignee_slug": "coder" }),
            )
            .await;
        task_id = task["id"].as_str().unwrap().to_owned();
        admin
            .post(
                &format!("/tasks/{task_id}/steps"),
                json!({ "title": "step" }),
            )
            .await;
        let (_, created) = admin.post("/members", json!({ "slug": "later" })).await;
        token = created["token"].as_str().unwrap().to_owned();
        let (ws, ok) = TrackerWs::auth(addr, "tb-admin").await;
        lobby = ok["lobby_chat_id"].as_str().unwrap().to_owned();
        ws.close().await;
        admin
            .message(json!({ "chat_id": lobby, "content": "remember me" }))
            .await;
        bridge.shutdown().await;
    }
    let bridge = start_bridge_in(data_dir, "").await;
    let addr = bridge.addr("tracker").unwrap();
    let admin = TrackerHttp::new(addr, "tb-admin");
    let (status, task) = admin.get(&format!("/tasks/{task_id}")).await;
    assert_eq!((status, task["title"].as_str()), (200, Some("Persist me")));
    assert_eq!(
        admin
            .get(&format!("/tasks/{task_id}/steps"))
            .await
            .1
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let (_, messages) = admin.get(&format!("/messages?chat_id={lobby}")).await;
    assert_eq!(messages[0]["content"], "remember me");
    let (_ws, ok) = TrackerWs::auth(addr, &token).await;
    assert_eq!(
        (ok["slug"].as_str(), ok["lobby_chat_id"].as_str()),
        (Some("later"), Some(lobby.as_str()))
    );
    bridge.shutdown().await;
}

/// A connection keeps reading while its earlier messages are being stored: a burst arrives
/// whole and in order, also when the sender hangs up right after it.
#[tokio::test]
async fn a_burst_of_chat_sends_arrives_in_order_even_after_the_sender_left() {
    let w = world().await;
    let (mut listener, ok) = TrackerWs::auth(w.addr, "tb-listener").await;
    let (mut coder, _) = TrackerWs::auth(w.addr, "tb-coder").await;
    let lobby = ok["lobby_chat_id"].clone();
    for i in 0..300 {
        coder
            .send(json!({ "type": "chat.send", "chat_id": lobby, "content": format!("burst {i}") }))
            .await;
    }
    coder.close().await;
    for i in 0..300 {
        assert_eq!(listener.next_content().await, format!("burst {i}"));
    }
    w.bridge.shutdown().await;
}
