//! Agents of different protocols talking through the bridge, over real sockets: each side
//! uses only its own protocol's client and sees the other as a native peer.

mod common;

use std::net::SocketAddr;

use agentbridge::Bridge;
use common::skynet::{SkynetHttp, SkynetWs, text_of};
use common::start_bridge;
use common::tracker::{TrackerHttp, TrackerWs};
use serde_json::{Value, json};

struct World {
    bridge: Bridge,
    skynet: SocketAddr,
    tracker: SocketAddr,
    sk: SkynetHttp,
}

async fn world() -> World {
    let bridge = start_bridge("").await;
    let skynet = bridge.addr("skynet").unwrap();
    let tracker = bridge.addr("tracker").unwrap();
    World {
        sk: SkynetHttp::new(skynet),
        skynet,
        tracker,
        bridge,
    }
}

fn card_named<'a>(members: &'a Value, name: &str) -> &'a Value {
    members
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .unwrap_or_else(|| panic!("no member {name} in {members}"))
}

/// The next Skynet message that is not a presence message.
async fn next_non_presence(ws: &mut SkynetWs) -> Value {
    loop {
        let msg = ws.next_message().await;
        if !matches!(msg["type"].as_str(), Some("agent.join" | "agent.leave")) {
            return msg;
        }
    }
}

mod skynet_tracker {
    use super::*;

    #[tokio::test]
    async fn a_skynet_mention_reaches_the_tracker_member_in_the_lobby() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let boss = w.sk.human("boss").await;
        let (mut coder, ok) = TrackerWs::auth_subscribed(w.tracker, "tb-coder").await;
        let lobby = ok["lobby_chat_id"].clone();
        let (mut ws_alice, state) = SkynetWs::join(w.skynet, &alice).await;
        let coder_card = card_named(&state["members"], "coder").clone();
        assert_eq!(coder_card["type"], "generic");
        assert!(uuid::Uuid::parse_str(coder_card["id"].as_str().unwrap()).is_ok());

        // By text…
        let echo = ws_alice.chat("@coder can you review?").await;
        assert_eq!(echo["mentions"], json!([coder_card["id"]]));
        let got = coder.next_of("message.new").await;
        assert_eq!(got["content"], "@coder can you review?");
        assert_eq!(got["author_slug"], "alice");
        assert_eq!(got["author_type"], "agent");
        assert_eq!(got["chat_id"], lobby);
        assert_eq!(got["mentions"], json!(["coder"]));
        assert_eq!(
            got["id"],
            json!(agentbridge::core::uuid_form(echo["id"].as_str().unwrap()))
        );
        // …and by the card id the bridge shows for coder.
        ws_alice
            .chat_with(json!({ "type": "chat", "payload": { "text": "by id" }, "mentions": [coder_card["id"]] }))
            .await;
        assert_eq!(coder.next_content().await, "by id");

        let (mut ws_boss, _) = SkynetWs::join(w.skynet, &boss).await;
        ws_boss.chat("@coder from a human").await;
        let got = coder.next_of("message.new").await;
        assert_eq!(
            (got["author_slug"].as_str(), got["author_type"].as_str()),
            (Some("boss"), Some("human"))
        );
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn a_tracker_message_reaches_the_skynet_agent_from_the_listed_card() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let (_coder_ws, ok) = TrackerWs::auth_subscribed(w.tracker, "tb-coder").await;
        let lobby = ok["lobby_chat_id"].clone();
        let (mut ws_alice, state) = SkynetWs::join(w.skynet, &alice).await;
        let coder_card = card_named(&state["members"], "coder").clone();
        let coder = TrackerHttp::new(w.tracker, "tb-coder");

        let posted = coder
            .message(json!({ "chat_id": lobby, "content": "results are in", "mentions": ["alice"], "author_type": "agent", "author_slug": "coder" }))
            .await;
        let got = next_non_presence(&mut ws_alice).await;
        assert_eq!(got["type"], "chat");
        assert_eq!(got["from"], coder_card["id"]);
        assert_eq!(text_of(&got), "results are in");
        assert_eq!(got["id"], posted["id"]);
        assert_eq!(got["mentions"], json!([alice["id"]]));

        // `@name` in the content works as well, from the socket too.
        let (mut coder_ws, _) = (_coder_ws, ());
        coder_ws
            .send(json!({ "type": "chat.send", "chat_id": lobby, "content": "ping @alice", "mentions": [] }))
            .await;
        let got = next_non_presence(&mut ws_alice).await;
        assert_eq!(
            (text_of(&got), got["from"].clone()),
            ("ping @alice", coder_card["id"].clone())
        );
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn presence_crosses_both_ways() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let boss = w.sk.human("boss").await;
        let (mut ws_boss, _) = SkynetWs::join(w.skynet, &boss).await;
        let (mut admin, _) = TrackerWs::auth_subscribed(w.tracker, "tb-admin").await;

        // A Skynet agent joining is an online Tracker member…
        let join = ws_boss.next_message().await;
        assert_eq!(
            (
                join["type"].as_str(),
                join["payload"]["agent"]["name"].as_str()
            ),
            (Some("agent.join"), Some("admin"))
        );
        let (ws_alice, _) = SkynetWs::join(w.skynet, &alice).await;
        assert_eq!(
            admin.next_of("agent.status").await,
            json!({ "slug": "alice", "status": "online" })
        );
        let (_, members) = TrackerHttp::new(w.tracker, "tb-admin")
            .get("/members/alice")
            .await;
        assert_eq!(
            (members["protocol"].as_str(), members["is_online"].as_bool()),
            (Some("skynet"), Some(true))
        );
        let (_coder, ok) = TrackerWs::auth_subscribed(w.tracker, "tb-coder").await;
        let online: Vec<&str> = ok["online"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            online.contains(&"alice") && online.contains(&"boss") && online.contains(&"admin"),
            "{online:?}"
        );

        // …a Tracker member connecting is a Skynet member.
        assert_eq!(
            ws_boss.next_message().await["payload"]["agent"]["name"],
            "alice"
        );
        let coder_join = ws_boss.next_message().await;
        assert_eq!(coder_join["type"], "agent.join");
        assert_eq!(coder_join["payload"]["agent"]["name"], "coder");
        let coder_id = coder_join["from"].clone();
        let (_, members) = w.sk.get("/api/members").await;
        assert_eq!(card_named(&members, "coder")["id"], coder_id);
        admin.next_of("agent.status").await; // coder online

        // Leaving crosses too.
        ws_alice.close().await;
        let mut alice_ws = SkynetWs::connect(w.skynet).await;
        alice_ws.rejoin(&alice, None).await;
        alice_ws.action("leave", json!({})).await;
        assert_eq!(
            admin.next_of("agent.status").await,
            json!({ "slug": "alice", "status": "offline" })
        );
        _coder.close().await;
        let mut left = ws_boss.next_message().await;
        while left["type"] != "agent.leave" || left["from"] != coder_id {
            left = ws_boss.next_message().await;
        }
        assert_eq!(left["payload"]["agentId"], coder_id);
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn reply_chains_survive_both_ways() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let (mut coder, ok) = TrackerWs::auth_subscribed(w.tracker, "tb-coder").await;
        let lobby = ok["lobby_chat_id"].clone();
        let (mut ws_alice, _) = SkynetWs::join(w.skynet, &alice).await;
        let coder_http = TrackerHttp::new(w.tracker, "tb-coder");

        // A: Skynet, with a non-UUID id the Tracker shows as a derived UUID.
        ws_alice
            .chat_with(json!({ "id": "sk-msg-1", "type": "chat", "payload": { "text": "@coder question" } }))
            .await;
        let first = coder.next_of("message.new").await;
        let derived = first["id"].as_str().unwrap().to_owned();
        assert_eq!(derived, agentbridge::core::uuid_form("sk-msg-1"));

        // B: the Tracker answers it; Skynet sees its own original id in replyTo.
        let reply = coder_http
            .message(json!({ "chat_id": lobby, "content": "answer", "mentions": ["alice"], "reply_to": derived }))
            .await;
        let got = next_non_presence(&mut ws_alice).await;
        assert_eq!(
            (got["replyTo"].as_str(), text_of(&got)),
            (Some("sk-msg-1"), "answer")
        );

        // A again, answering the Tracker's message by its id.
        ws_alice
            .chat_with(json!({ "type": "chat", "payload": { "text": "@coder thanks" }, "replyTo": reply["id"] }))
            .await;
        let third = coder.next_of("message.new").await;
        assert_eq!(third["reply_to"], reply["id"]);

        // B again.
        coder_http
            .message(json!({ "chat_id": lobby, "content": "welcome", "mentions": ["alice"], "reply_to": third["id"] }))
            .await;
        let fourth = next_non_presence(&mut ws_alice).await;
        assert_eq!(fourth["replyTo"], json!(third["id"]));

        // The thread of A's first message lists the cross-protocol reply.
        let (_, thread) = coder_http
            .get(&format!("/messages/{derived}/replies"))
            .await;
        assert_eq!(thread.as_array().unwrap().len(), 1);
        assert_eq!(thread[0]["id"], reply["id"]);
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn a_tracker_members_busy_heartbeat_is_a_skynet_status_change() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let (mut coder, _) = TrackerWs::auth_subscribed(w.tracker, "tb-coder").await;
        let (mut ws_alice, state) = SkynetWs::join(w.skynet, &alice).await;
        let coder_id = card_named(&state["members"], "coder")["id"].clone();
        assert_eq!(card_named(&state["members"], "coder")["status"], "idle");

        coder
            .send(json!({ "type": "heartbeat", "status": "busy" }))
            .await;
        assert_eq!(
            ws_alice.next_event("status-change").await,
            json!({ "agentId": coder_id, "status": "busy" })
        );
        let (_, members) = w.sk.get("/api/members").await;
        assert_eq!(card_named(&members, "coder")["status"], "busy");

        // The same status again is no change; plain online is Skynet's idle.
        coder
            .send(json!({ "type": "heartbeat", "status": "busy" }))
            .await;
        coder
            .send(json!({ "type": "heartbeat", "status": "online" }))
            .await;
        assert_eq!(
            ws_alice.next_event("status-change").await,
            json!({ "agentId": coder_id, "status": "idle" })
        );
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn a_skynet_task_for_a_tracker_agent_runs_to_its_result() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let (mut coder, _) = TrackerWs::auth_subscribed(w.tracker, "tb-coder").await;
        let (mut ws_alice, state) = SkynetWs::join(w.skynet, &alice).await;
        let coder_id = card_named(&state["members"], "coder")["id"].clone();
        let coder_http = TrackerHttp::new(w.tracker, "tb-coder");
        let task_id = uuid::Uuid::new_v4().to_string();

        let assign = ws_alice
            .chat_with(json!({
                "id": "assign-1",
                "type": "task.assign",
                "payload": { "taskId": task_id, "title": "Add tests", "description": "Cover the parser", "assignee": coder_id, "status": "assigned" },
                "mentions": [coder_id],
            }))
            .await;
        assert_eq!(assign["type"], "task.assign");
        let created = coder.next_of("task.created").await;
        assert_eq!(
            created["id"],
            json!(task_id),
            "the same task id on both sides"
        );
        assert_eq!(
            (created["title"].as_str(), created["assignee_slug"].as_str()),
            (Some("Add tests"), Some("coder"))
        );
        assert_eq!(created["description"], "Cover the parser");
        assert_eq!(created["author_slug"], "alice");
        let assigned = coder.next_of("task.assigned").await;
        assert_eq!(assigned["id"], json!(task_id));

        // Taking what is already its own changes nothing; starting work is progress for
        // the assigner.
        let (status, _) = coder_http
            .post(&format!("/tasks/{task_id}/take?slug=coder"), json!({}))
            .await;
        assert_eq!(status, 200);
        coder_http
            .patch(
                &format!("/tasks/{task_id}"),
                json!({ "status": "in_progress" }),
            )
            .await;
        let update = next_non_presence(&mut ws_alice).await;
        assert_eq!(update["type"], "task.update");
        assert_eq!(update["payload"]["taskId"], json!(task_id));
        assert_eq!(update["payload"]["status"], "in-progress");
        assert_eq!(update["from"], coder_id);
        assert_eq!(update["replyTo"], "assign-1");

        // A comment on the task comes back as an update carrying it.
        coder_http
            .message(json!({ "task_id": task_id, "content": "halfway there" }))
            .await;
        let comment = next_non_presence(&mut ws_alice).await;
        assert_eq!(comment["type"], "task.update");
        assert_eq!(comment["payload"]["metadata"]["message"], "halfway there");

        // Done is the result, summarised by the last comment.
        coder_http
            .message(json!({ "task_id": task_id, "content": "all tests pass" }))
            .await;
        next_non_presence(&mut ws_alice).await;
        let (status, _) = coder_http
            .patch(&format!("/tasks/{task_id}"), json!({ "status": "done" }))
            .await;
        assert_eq!(status, 200);
        let result = next_non_presence(&mut ws_alice).await;
        assert_eq!(result["type"], "task.result");
        assert_eq!(result["payload"]["taskId"], json!(task_id));
        assert_eq!(result["payload"]["success"], true);
        assert_eq!(result["payload"]["summary"], "all tests pass");
        assert_eq!(result["replyTo"], "assign-1");
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn a_tracker_task_for_a_skynet_agent_comes_back_done() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let (mut ws_alice, _) = SkynetWs::join(w.skynet, &alice).await;
        let (mut admin, _) = TrackerWs::auth_subscribed(w.tracker, "tb-admin").await;
        let admin_http = TrackerHttp::new(w.tracker, "tb-admin");

        let task = admin_http
            .task(
                "team-board",
                json!({ "title": "Write docs", "description": "README", "assignee_slug": "alice" }),
            )
            .await;
        let id = task["id"].as_str().unwrap();
        admin.next_of("task.created").await;
        admin.next_of("task.assigned").await;
        let assign = next_non_presence(&mut ws_alice).await;
        assert_eq!(assign["type"], "task.assign");
        assert_eq!(assign["payload"]["taskId"], json!(id));
        assert_eq!(assign["payload"]["title"], "Write docs");
        assert_eq!(assign["payload"]["assignee"], alice["id"]);
        assert_eq!(assign["mentions"], json!([alice["id"]]));

        ws_alice
            .chat_with(json!({ "type": "task.update", "replyTo": assign["id"], "payload": { "taskId": id, "title": "Write docs", "description": "", "status": "in-progress" } }))
            .await;
        assert_eq!(admin.next_of("task.updated").await["status"], "in_progress");
        ws_alice
            .chat_with(json!({ "type": "task.result", "replyTo": assign["id"], "payload": { "taskId": id, "success": true, "summary": "README written" } }))
            .await;
        // The summary becomes a comment on the task, then the task is done.
        let comment = admin.next_of("message.new").await;
        assert_eq!(
            (comment["task_id"].as_str(), comment["content"].as_str()),
            (Some(id), Some("README written"))
        );
        let done = admin.next_of("task.updated").await;
        assert_eq!(done["status"], "done");
        let (_, comments) = admin_http.get(&format!("/messages?task_id={id}")).await;
        let last = comments.as_array().unwrap().last().unwrap();
        assert_eq!(
            (last["content"].as_str(), last["author_slug"].as_str()),
            (Some("README written"), Some("alice"))
        );
        w.bridge.shutdown().await;
    }

    /// The Tracker's comment restating a Skynet agent's result is the Tracker's alone: a
    /// Skynet human sees the result once, as Skynet sent it, and no chat besides.
    #[tokio::test]
    async fn tracker_comments_restating_a_skynet_result_stay_in_the_tracker() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let boss = w.sk.human("boss").await;
        let (mut ws_alice, _) = SkynetWs::join(w.skynet, &alice).await;
        let (mut admin, _) = TrackerWs::auth_subscribed(w.tracker, "tb-admin").await;
        let (mut ws_boss, _) = SkynetWs::join(w.skynet, &boss).await;
        let task = TrackerHttp::new(w.tracker, "tb-admin")
            .task(
                "team-board",
                json!({ "title": "Write docs", "assignee_slug": "alice" }),
            )
            .await;
        let id = task["id"].as_str().unwrap();
        admin.next_of("task.created").await;
        admin.next_of("task.assigned").await;
        let assign = next_non_presence(&mut ws_alice).await;
        assert_eq!(next_non_presence(&mut ws_boss).await["id"], assign["id"]);

        ws_alice
            .chat_with(json!({ "type": "task.result", "replyTo": assign["id"], "payload": { "taskId": id, "success": true, "summary": "README written" } }))
            .await;
        assert_eq!(
            admin.next_of("message.new").await["content"],
            "README written"
        );
        ws_alice.chat("sentinel").await;
        assert_eq!(next_non_presence(&mut ws_boss).await["type"], "task.result");
        assert_eq!(
            next_non_presence(&mut ws_boss).await["payload"]["text"],
            "sentinel"
        );
        let (_, history) = w.sk.get("/api/messages").await;
        assert!(
            !history.to_string().contains("\"text\":\"README written\""),
            "no restated chat in Skynet's history: {history}"
        );
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn names_are_one_namespace() {
        let w = world().await;
        let (status, body) =
            w.sk.post("/api/agents", json!({ "name": "coder", "type": "generic" }))
                .await;
        assert_eq!(status, 409);
        assert!(
            body["error"].as_str().unwrap().contains("tracker"),
            "{body}"
        );
        assert_eq!(
            w.sk.get("/api/names/check?name=coder").await.1["available"],
            false
        );
        w.sk.agent("alice").await;
        let (status, body) = TrackerHttp::new(w.tracker, "tb-admin")
            .post("/members", json!({ "slug": "alice" }))
            .await;
        assert_eq!(status, 409);
        assert!(
            body["detail"].as_str().unwrap().contains("skynet"),
            "{body}"
        );
        w.bridge.shutdown().await;
    }
}

mod synapse_others {
    use super::*;
    use agentbridge::protocols::synapse::proto::{
        MessageType, SynapseMessage, TaskPayload, TaskResult, TaskStatus, TaskStatusUpdate,
    };
    use common::synapse::{
        Stream, chat, endpoint, status_update, task_complete, task_request, text_of, unpack,
    };

    fn synapse_addr(w: &World) -> SocketAddr {
        w.bridge.addr("synapse").unwrap()
    }

    #[tokio::test]
    async fn a_synapse_task_for_a_skynet_agent_comes_back_complete_or_failed() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let (mut ws_alice, _) = SkynetWs::join(w.skynet, &alice).await;
        let mut planner = Stream::open(synapse_addr(&w), "planner").await;
        next_non_presence_skip(&mut ws_alice).await;

        for (task_id, success) in [("t-ok", true), ("t-bad", false)] {
            planner
                .send(task_request(
                    "planner",
                    "alice",
                    task_id,
                    "review",
                    "check PR 7",
                ))
                .await;
            let assign = next_non_presence(&mut ws_alice).await;
            assert_eq!(assign["type"], "task.assign");
            assert_eq!(assign["id"], json!(format!("req-{task_id}")));
            assert_eq!(assign["payload"]["taskId"], task_id);
            assert_eq!(assign["payload"]["title"], "review");
            assert_eq!(assign["payload"]["description"], "check PR 7");
            assert_eq!(assign["payload"]["assignee"], alice["id"]);
            assert_eq!(assign["mentions"], json!([alice["id"]]));

            // A plain task.result, no replyTo, no mentions: it still finds the requester.
            let mut payload =
                json!({ "taskId": task_id, "success": success, "summary": "looked at it" });
            if !success {
                payload["error"] = json!("tests fail");
            }
            ws_alice
                .chat_with(json!({ "type": "task.result", "payload": payload }))
                .await;
            let back = planner.next().await;
            let expected = if success {
                MessageType::P2pTaskComplete
            } else {
                MessageType::P2pTaskFailed
            };
            assert_eq!(back.r#type, expected as i32);
            assert_eq!(back.reply_to, format!("req-{task_id}"));
            assert_eq!(back.correlation_id, format!("req-{task_id}"));
            assert_eq!(back.sender.as_ref().unwrap().agent_id, "alice");
            assert_eq!(back.sender.as_ref().unwrap().system_id, "skynet");
            let result: TaskResult = unpack(&back);
            assert_eq!(result.task_id, task_id);
            assert_eq!(
                result.summary,
                if success {
                    "looked at it"
                } else {
                    "tests fail"
                }
            );
        }
        w.bridge.shutdown().await;
    }

    /// Skips the presence of a newly opened Synapse stream on a Skynet socket.
    async fn next_non_presence_skip(ws: &mut SkynetWs) {
        let join = ws.next_message().await;
        assert_eq!(join["type"], "agent.join", "{join}");
    }

    #[tokio::test]
    async fn a_synapse_task_for_a_tracker_agent_reports_progress_and_completion() {
        let w = world().await;
        let (mut coder, _) = TrackerWs::auth_subscribed(w.tracker, "tb-coder").await;
        let coder_http = TrackerHttp::new(w.tracker, "tb-coder");
        let mut planner = Stream::open(synapse_addr(&w), "planner").await;
        let task_id = uuid::Uuid::new_v4().to_string();

        planner
            .send(task_request(
                "planner",
                "coder",
                &task_id,
                "Refactor the store",
                "split the module",
            ))
            .await;
        let created = coder.next_of("task.created").await;
        assert_eq!(
            (created["id"].as_str(), created["title"].as_str()),
            (Some(task_id.as_str()), Some("Refactor the store"))
        );
        assert_eq!(created["author_slug"], "planner");
        coder.next_of("task.assigned").await;

        coder_http
            .patch(
                &format!("/tasks/{task_id}"),
                json!({ "status": "in_progress" }),
            )
            .await;
        let progress = planner.next().await;
        assert_eq!(progress.r#type, MessageType::P2pStatusUpdate as i32);
        assert_eq!(progress.reply_to, format!("req-{task_id}"));
        let update: TaskStatusUpdate = unpack(&progress);
        assert_eq!(
            (update.task_id.as_str(), update.status),
            (task_id.as_str(), TaskStatus::Processing as i32)
        );

        coder_http
            .message(json!({ "task_id": task_id, "content": "split into three files" }))
            .await;
        let comment = planner.next().await;
        assert_eq!(comment.r#type, MessageType::P2pStatusUpdate as i32);
        assert_eq!(
            unpack::<TaskStatusUpdate>(&comment).message,
            "split into three files"
        );
        coder_http
            .patch(&format!("/tasks/{task_id}"), json!({ "status": "done" }))
            .await;
        let done = planner.next().await;
        assert_eq!(done.r#type, MessageType::P2pTaskComplete as i32);
        assert_eq!(
            (done.reply_to.as_str(), done.correlation_id.as_str()),
            (
                format!("req-{task_id}").as_str(),
                format!("req-{task_id}").as_str()
            )
        );
        let result: TaskResult = unpack(&done);
        assert_eq!(
            (result.task_id.as_str(), result.summary.as_str()),
            (task_id.as_str(), "split into three files")
        );
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn skynet_and_tracker_give_tasks_to_a_synapse_agent() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let mut worker = Stream::open(synapse_addr(&w), "worker").await;
        let (mut ws_alice, state) = SkynetWs::join(w.skynet, &alice).await;
        let worker_card = card_named(&state["members"], "worker").clone();

        ws_alice
            .chat_with(json!({
                "id": "sk-assign", "type": "task.assign", "mentions": [worker_card["id"]],
                "payload": { "taskId": "sk-task", "title": "translate", "description": "to French", "assignee": worker_card["id"], "status": "assigned" }
            }))
            .await;
        let request = worker.next().await;
        assert_eq!(request.r#type, MessageType::P2pTaskRequest as i32);
        assert_eq!(request.id, "sk-assign");
        assert_eq!(request.sender.as_ref().unwrap().agent_id, "alice");
        let payload: TaskPayload = unpack(&request);
        assert_eq!(
            (payload.task_id.as_str(), payload.task_type.as_str()),
            ("sk-task", "translate")
        );
        worker
            .send(task_complete(
                "worker",
                "alice",
                "sk-task",
                "bonjour",
                &request.id,
            ))
            .await;
        let back = next_non_presence(&mut ws_alice).await;
        assert_eq!(back["type"], "task.result");
        assert_eq!(back["replyTo"], "sk-assign");
        assert_eq!(
            back["payload"],
            json!({ "taskId": "sk-task", "success": true, "summary": "bonjour" })
        );
        assert_eq!(back["from"], worker_card["id"]);

        // A Tracker task assigned to the Synapse agent.
        let (mut admin, _) = TrackerWs::auth_subscribed(w.tracker, "tb-admin").await;
        let admin_http = TrackerHttp::new(w.tracker, "tb-admin");
        let task = admin_http
            .task(
                "team-board",
                json!({ "title": "Summarise", "assignee_slug": "worker" }),
            )
            .await;
        let id = task["id"].as_str().unwrap().to_owned();
        admin.next_of("task.created").await;
        admin.next_of("task.assigned").await;
        let request = worker.next().await;
        assert_eq!(request.r#type, MessageType::P2pTaskRequest as i32);
        assert_eq!(unpack::<TaskPayload>(&request).task_id, id);
        let mut update = status_update("worker", "admin", &id, TaskStatus::Processing, 30, "");
        update.reply_to = request.id.clone();
        worker.send(update).await;
        assert_eq!(admin.next_of("task.updated").await["status"], "in_progress");
        worker
            .send(task_complete(
                "worker",
                "admin",
                &id,
                "summary written",
                &request.id,
            ))
            .await;
        assert_eq!(
            admin.next_of("message.new").await["content"],
            "summary written"
        );
        assert_eq!(admin.next_of("task.updated").await["status"], "done");
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn chat_crosses_synapse_skynet_and_tracker() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let mut worker = Stream::open(synapse_addr(&w), "worker").await;
        let (mut ws_alice, state) = SkynetWs::join(w.skynet, &alice).await;
        let worker_card = card_named(&state["members"], "worker").clone();
        let (mut coder, ok) = TrackerWs::auth_subscribed(w.tracker, "tb-coder").await;
        next_non_presence_skip(&mut ws_alice).await; // coder's join

        worker.send(chat("worker", "alice", "hi alice")).await;
        let got = next_non_presence(&mut ws_alice).await;
        assert_eq!(
            (got["type"].as_str(), text_of_sk(&got), got["from"].clone()),
            (Some("chat"), "hi alice", worker_card["id"].clone())
        );
        ws_alice.chat("@worker hello back").await;
        let back = worker.next().await;
        assert_eq!(
            (back.r#type, text_of(&back)),
            (
                MessageType::Unspecified as i32,
                "@worker hello back".to_owned()
            )
        );
        assert_eq!(back.sender.as_ref().unwrap().system_id, "skynet");

        worker.send(chat("worker", "coder", "hi coder")).await;
        let got = coder.next_of("message.new").await;
        assert_eq!(
            (
                got["author_slug"].as_str(),
                got["content"].as_str(),
                got["chat_id"].clone()
            ),
            (
                Some("worker"),
                Some("hi coder"),
                ok["lobby_chat_id"].clone()
            )
        );
        TrackerHttp::new(w.tracker, "tb-coder")
            .message(json!({ "chat_id": ok["lobby_chat_id"], "content": "thanks @worker" }))
            .await;
        let back = worker.next().await;
        assert_eq!(text_of(&back), "thanks @worker");
        assert_eq!(back.sender.as_ref().unwrap().agent_id, "coder");
        w.bridge.shutdown().await;
    }

    fn text_of_sk(msg: &Value) -> &str {
        common::skynet::text_of(msg)
    }

    #[tokio::test]
    async fn a_human_decision_request_is_answered_from_skynet_or_the_tracker() {
        let w = world().await;
        let boss = w.sk.human("boss").await;
        let (mut ws_boss, _) = SkynetWs::join(w.skynet, &boss).await;
        let (mut admin, ok) = TrackerWs::auth_subscribed(w.tracker, "tb-admin").await;
        let mut worker = Stream::open(synapse_addr(&w), "worker").await;
        ws_boss.next_message().await; // admin joins
        ws_boss.next_message().await; // worker joins

        for (answerer, answer) in [("skynet", "yes, ship it"), ("tracker", "no, wait")] {
            let request = SynapseMessage {
                id: format!("decide-{answerer}"),
                r#type: MessageType::HilDecisionRequest as i32,
                sender: endpoint("worker"),
                payload: Some(prost_types::Any {
                    type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
                    value: prost::Message::encode_to_vec(&"Deploy to production?".to_owned()),
                }),
                ..Default::default()
            };
            worker.send(request).await;
            // Humans on both sides see it as a chat.
            let seen = next_non_presence(&mut ws_boss).await;
            assert_eq!(
                (seen["type"].as_str(), text_of_sk(&seen)),
                (Some("chat"), "Deploy to production?")
            );
            let seen_tracker = admin.next_of("message.new").await;
            assert_eq!(seen_tracker["content"], "Deploy to production?");
            if answerer == "skynet" {
                ws_boss
                    .chat_with(json!({ "type": "chat", "payload": { "text": answer }, "replyTo": seen["id"] }))
                    .await;
                // The Tracker human sees the Skynet answer as well.
                assert_eq!(admin.next_of("message.new").await["content"], answer);
            } else {
                TrackerHttp::new(w.tracker, "tb-admin")
                    .message(json!({ "chat_id": ok["lobby_chat_id"], "content": answer, "reply_to": seen_tracker["id"] }))
                    .await;
                // The Skynet human sees the Tracker answer as well.
                next_non_presence(&mut ws_boss).await;
            }
            let decision = worker.next().await;
            assert_eq!(
                decision.r#type,
                MessageType::HilDecisionResponse as i32,
                "answered from {answerer}"
            );
            assert_eq!(decision.reply_to, format!("decide-{answerer}"));
            assert_eq!(decision.correlation_id, format!("decide-{answerer}"));
            assert_eq!(text_of(&decision), answer);
        }
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn synapse_agents_are_members_everywhere() {
        let w = world().await;
        let boss = w.sk.human("boss").await;
        let (mut ws_boss, _) = SkynetWs::join(w.skynet, &boss).await;
        let (mut admin, _) = TrackerWs::auth_subscribed(w.tracker, "tb-admin").await;
        ws_boss.next_message().await; // admin
        let worker = Stream::open(synapse_addr(&w), "worker").await;
        let join = ws_boss.next_message().await;
        assert_eq!(
            (
                join["type"].as_str(),
                join["payload"]["agent"]["name"].as_str()
            ),
            (Some("agent.join"), Some("worker"))
        );
        assert_eq!(
            admin.next_of("agent.status").await,
            json!({ "slug": "worker", "status": "online" })
        );
        let (_, member) = TrackerHttp::new(w.tracker, "tb-admin")
            .get("/members/worker")
            .await;
        assert_eq!(member["protocol"], "synapse");
        drop(worker);
        assert_eq!(
            admin.next_of("agent.status").await,
            json!({ "slug": "worker", "status": "offline" })
        );
        assert_eq!(ws_boss.next_message().await["type"], "agent.leave");
        w.bridge.shutdown().await;
    }
}

mod grid_others {
    use super::*;
    use agentbridge::protocols::synapse::proto::{MessageType, TaskPayload};
    use common::grid::{GridHttp, GridWs};
    use common::synapse::{Stream, task_complete, unpack};

    fn grid_addr(w: &World) -> SocketAddr {
        w.bridge.addr("grid").unwrap()
    }

    #[tokio::test]
    async fn a_grid_mission_for_a_skynet_agent_is_answered_as_a_grid_response() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let (mut ws_alice, _) = SkynetWs::join(w.skynet, &alice).await;
        let (mut mc, _) = GridWs::connect(grid_addr(&w), "mc", None).await;
        ws_alice.next_message().await; // mc joins

        mc.send("message: { id: msg-mission, type: request, sender: { agent: mc }, receiver: { agent: alice }, content: { action: mission_assigned, payload: { block: block-01, description: Build the login API } } }").await;
        let assign = next_non_presence(&mut ws_alice).await;
        assert_eq!(assign["type"], "task.assign");
        assert_eq!(assign["id"], "msg-mission");
        assert_eq!(assign["payload"]["taskId"], "block-01");
        assert_eq!(assign["payload"]["description"], "Build the login API");
        assert_eq!(assign["payload"]["assignee"], alice["id"]);

        ws_alice
            .chat_with(json!({ "type": "task.update", "payload": { "taskId": "block-01", "title": "", "description": "", "status": "in-progress", "metadata": { "progress": 50 } } }))
            .await;
        let progress = mc.next_message().await;
        assert_eq!(
            (
                progress["content"]["action"].as_str(),
                progress["correlation_id"].as_str()
            ),
            (Some("progress_update"), Some("msg-mission"))
        );
        ws_alice
            .chat_with(json!({ "type": "task.result", "payload": { "taskId": "block-01", "success": true, "summary": "API done" } }))
            .await;
        let done = mc.next_message().await;
        assert_eq!(done["type"], "response");
        assert_eq!(done["correlation_id"], "msg-mission");
        assert_eq!(done["content"]["action"], "task_complete");
        assert_eq!(done["content"]["payload"]["summary"], "API done");
        assert_eq!(done["sender"]["agent"], "alice");
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn a_grid_request_to_a_tracker_agent_is_a_chat_and_its_answer_a_response() {
        let w = world().await;
        let (mut coder, ok) = TrackerWs::auth_subscribed(w.tracker, "tb-coder").await;
        let (mut executor, _) = GridWs::connect(grid_addr(&w), "executor", Some("exec-001")).await;
        executor.send("message: { id: msg-ctx, type: request, sender: { agent: executor, instance_id: exec-001 }, receiver: { agent: coder }, content: { action: request_context, payload: { text: What auth pattern do we use? } } }").await;
        let asked = coder.next_of("message.new").await;
        assert_eq!(
            (asked["author_slug"].as_str(), asked["content"].as_str()),
            (Some("executor"), Some("What auth pattern do we use?"))
        );
        assert_eq!(asked["chat_id"], ok["lobby_chat_id"]);
        TrackerHttp::new(w.tracker, "tb-coder")
            .message(json!({ "chat_id": ok["lobby_chat_id"], "content": "JWT in middleware", "reply_to": asked["id"] }))
            .await;
        let answer = executor.next_message().await;
        assert_eq!(answer["type"], "response");
        assert_eq!(answer["correlation_id"], "msg-ctx");
        assert_eq!(answer["content"]["payload"]["text"], "JWT in middleware");
        assert_eq!(answer["sender"]["agent"], "coder");
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn grid_and_synapse_exchange_tasks() {
        let w = world().await;
        let mut worker = Stream::open(w.bridge.addr("synapse").unwrap(), "worker").await;
        let (mut mc, welcome) = GridWs::connect(grid_addr(&w), "mc", None).await;
        let present = &welcome["content"]["payload"]["agents"];
        assert!(
            present
                .as_array()
                .unwrap()
                .iter()
                .any(|a| a["agent"] == "worker" && a["online"] == true),
            "{present}"
        );
        mc.send("message: { id: msg-m2, type: request, sender: { agent: mc }, receiver: { agent: worker }, content: { action: mission_assigned, payload: { task_id: t-9, title: index, description: Index the repo } } }").await;
        let request = worker.next().await;
        assert_eq!(request.r#type, MessageType::P2pTaskRequest as i32);
        assert_eq!(request.id, "msg-m2");
        let payload: TaskPayload = unpack(&request);
        assert_eq!(
            (payload.task_id.as_str(), payload.task_type.as_str()),
            ("t-9", "index")
        );
        worker
            .send(task_complete(
                "worker",
                "mc",
                "t-9",
                "indexed 120 files",
                &request.id,
            ))
            .await;
        let done = mc.next_message().await;
        assert_eq!(
            (done["type"].as_str(), done["correlation_id"].as_str()),
            (Some("response"), Some("msg-m2"))
        );
        assert_eq!(done["content"]["payload"]["summary"], "indexed 120 files");
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn a_skynet_task_for_a_grid_program_reports_progress_and_failure() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let (mut executor, _) = GridWs::connect(grid_addr(&w), "executor", None).await;
        let (mut ws_alice, state) = SkynetWs::join(w.skynet, &alice).await;
        let executor_card = card_named(&state["members"], "executor").clone();
        assert_eq!(executor.next().await["content"]["action"], "agent_online"); // alice
        ws_alice
            .chat_with(json!({ "id": "sk-1", "type": "task.assign", "mentions": [executor_card["id"]], "payload": { "taskId": "t-1", "title": "migrate", "description": "Migrate the DB", "assignee": executor_card["id"], "status": "assigned" } }))
            .await;
        let mission = executor.next_message().await;
        assert_eq!(
            (
                mission["type"].as_str(),
                mission["content"]["action"].as_str()
            ),
            (Some("request"), Some("mission_assigned"))
        );
        assert_eq!(mission["content"]["payload"]["task_id"], "t-1");
        assert_eq!(mission["id"], "sk-1");

        executor.send("message: { type: notification, correlation_id: sk-1, sender: { agent: executor }, receiver: { agent: alice }, content: { action: progress_update, payload: { percent: 40, status: copying tables } } }").await;
        let update = next_non_presence(&mut ws_alice).await;
        assert_eq!(update["type"], "task.update");
        assert_eq!(update["payload"]["taskId"], "t-1");
        assert_eq!(update["payload"]["status"], "in-progress");
        assert_eq!(update["payload"]["metadata"]["progress"], 40);
        assert_eq!(update["replyTo"], "sk-1");
        executor.send("message: { type: error, correlation_id: sk-1, sender: { agent: executor }, receiver: { agent: alice }, content: { action: error_report, payload: { error_code: MIGRATION_FAILED, error_message: disk full, recoverable: false } } }").await;
        let failed = next_non_presence(&mut ws_alice).await;
        assert_eq!(failed["type"], "task.result");
        assert_eq!(failed["payload"]["taskId"], "t-1");
        assert_eq!(failed["payload"]["success"], false);
        assert!(
            failed["payload"]["error"]
                .as_str()
                .unwrap()
                .contains("disk full"),
            "{failed}"
        );
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn a_checkpoint_is_a_human_decision_answered_from_skynet() {
        let w = world().await;
        let boss = w.sk.human("boss").await;
        let (mut ws_boss, _) = SkynetWs::join(w.skynet, &boss).await;
        let (mut executor, _) = GridWs::connect(grid_addr(&w), "executor", None).await;
        ws_boss.next_message().await; // executor joins
        executor.send("message: { id: msg-cp, type: request, sender: { agent: executor }, receiver: { agent: broadcast }, content: { action: checkpoint_request, payload: { question: Drop the legacy table? } } }").await;
        let asked = next_non_presence(&mut ws_boss).await;
        assert_eq!(
            (asked["type"].as_str(), common::skynet::text_of(&asked)),
            (Some("chat"), "Drop the legacy table?")
        );
        ws_boss
            .chat_with(json!({ "type": "chat", "payload": { "text": "yes" }, "replyTo": "msg-cp" }))
            .await;
        let decision = executor.next_message().await;
        assert_eq!(decision["type"], "response");
        assert_eq!(decision["correlation_id"], "msg-cp");
        assert_eq!(decision["content"]["action"], "checkpoint_response");
        assert_eq!(decision["content"]["payload"]["decision"], "yes");
        w.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn broadcasts_reach_every_grid_program_and_human_observers() {
        let w = world().await;
        let alice = w.sk.agent("alice").await;
        let boss = w.sk.human("boss").await;
        let (mut ws_boss, _) = SkynetWs::join(w.skynet, &boss).await;
        let (mut ws_alice, _) = SkynetWs::join(w.skynet, &alice).await;
        let (mut admin, _) = TrackerWs::auth_subscribed(w.tracker, "tb-admin").await;
        let (mut mc, _) = GridWs::connect(grid_addr(&w), "mc", None).await;
        let (mut scout, _) = GridWs::connect(grid_addr(&w), "scout", None).await;
        let polling = GridHttp::new(grid_addr(&w));
        polling.poll("agent=planner").await; // a program that only polls
        assert_eq!(mc.next().await["content"]["action"], "agent_online"); // scout

        scout.send("message: { id: msg-b, type: notification, sender: { agent: scout }, receiver: { agent: broadcast }, content: { action: discovery, payload: { text: Found the auth bug } } }").await;
        assert_eq!(mc.next_message().await["id"], "msg-b");
        assert_eq!(polling.poll("agent=planner").await[0]["id"], "msg-b");
        let seen = next_non_presence(&mut ws_boss).await;
        assert_eq!(common::skynet::text_of(&seen), "Found the auth bug");
        assert_eq!(
            admin.next_of("message.new").await["content"],
            "Found the auth bug"
        );

        // Another protocol's message to everyone is a Grid broadcast.
        ws_alice.chat("@all standup in 5").await;
        let got = mc.next_message().await;
        assert_eq!(
            (
                got["receiver"]["agent"].as_str(),
                got["content"]["payload"]["text"].as_str()
            ),
            (Some("broadcast"), Some("@all standup in 5"))
        );
        // The Skynet agent was not sent the Grid broadcast: its next message is the echo of
        // its own.
        let echo = next_non_presence(&mut ws_alice).await;
        assert_eq!(common::skynet::text_of(&echo), "@all standup in 5");
        w.bridge.shutdown().await;
    }
}

/// The translation contract's matrix on one bridge (`common::matrix`).
mod matrix {
    use crate::common::matrix::{self, Placement};
    use crate::common::peers::Proto;

    crate::matrix_cells!(Placement::OneBridge);
}

/// The rest of the translation contract: each message reaches each recipient once, every
/// protocol lists the same agents, and a name is one agent's across protocols.
mod contract_rules {
    use super::*;
    use crate::common::grid::GridHttp;
    use crate::common::peers::{Net, Proto, What};
    use crate::common::synapse::{self, Stream, chat as synapse_chat, clients, with_meta};
    use agentbridge::protocols::synapse::proto::CreateGroupRequest;
    use std::collections::BTreeSet;

    /// The next Skynet chat's text, skipping presence and status changes.
    async fn next_chat_text(ws: &mut SkynetWs) -> String {
        loop {
            let msg = ws.next_message().await;
            if msg["type"] == "chat" {
                return msg["payload"]["text"].as_str().unwrap().to_owned();
            }
        }
    }

    #[tokio::test]
    async fn a_skynet_human_mentioned_gets_one_copy() {
        let net = Net::start().await;
        let sk = SkynetHttp::new(net.skynet);
        let boss = sk.human("boss").await;
        let (mut ws_boss, _) = SkynetWs::join(net.skynet, &boss).await;
        let sky = net.peer(Proto::Skynet).await;
        let mut syn = net.peer(Proto::Synapse).await;

        // Observer of everything and named: one copy. Then a message it only observes.
        syn.chat("boss", "for the boss", None).await;
        syn.chat(&sky.name, "sentinel", None).await;
        assert_eq!(next_chat_text(&mut ws_boss).await, "for the boss");
        assert_eq!(next_chat_text(&mut ws_boss).await, "sentinel");
        net.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn a_tracker_member_listening_to_all_and_mentioned_gets_one_copy() {
        let net = Net::start().await;
        let (mut listener, _) = TrackerWs::auth_subscribed(net.tracker, "tb-listener").await;
        let coder = net.peer(Proto::Tracker).await;
        let mut grid = net.peer(Proto::Grid).await;

        grid.chat("listener", "for the listener", None).await;
        grid.chat(&coder.name, "sentinel", None).await;
        assert_eq!(listener.next_content().await, "for the listener");
        assert_eq!(listener.next_content().await, "sentinel");
        net.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn mentioned_twice_is_received_once() {
        let net = Net::start().await;
        let mut coder = net.peer(Proto::Tracker).await;
        let sk = SkynetHttp::new(net.skynet);
        let sky_card = sk.agent("sky").await;
        let (mut sky, state) = SkynetWs::join(net.skynet, &sky_card).await;
        let coder_id = card_named(&state["members"], "coder")["id"].clone();

        // Named in `mentions` twice and as `@coder` in the text.
        sky.chat_with(json!({
            "type": "chat", "payload": { "text": "@coder twice" }, "mentions": [coder_id, coder_id],
        }))
        .await;
        sky.chat_with(
            json!({ "type": "chat", "payload": { "text": "sentinel" }, "mentions": [coder_id] }),
        )
        .await;
        assert_eq!(coder.next(What::Chat).await.text, "@coder twice");
        assert_eq!(coder.next(What::Chat).await.text, "sentinel");

        // The other way: a Tracker post naming the Skynet agent twice.
        let coder_http = TrackerHttp::new(net.tracker, "tb-coder");
        let lobby = coder.lobby().unwrap();
        coder_http
            .message(
                json!({ "chat_id": lobby, "content": "@sky twice", "mentions": ["sky", "sky"] }),
            )
            .await;
        coder_http
            .message(json!({ "chat_id": lobby, "content": "sentinel", "mentions": ["sky"] }))
            .await;
        assert_eq!(next_chat_text(&mut sky).await, "@sky twice");
        assert_eq!(next_chat_text(&mut sky).await, "sentinel");
        net.bridge.shutdown().await;
    }

    #[tokio::test]
    async fn a_group_member_also_addressed_directly_gets_one_copy() {
        let net = Net::start().await;
        let sk = SkynetHttp::new(net.skynet);
        let sky_card = sk.agent("sky").await;
        let (mut sky, _) = SkynetWs::join(net.skynet, &sky_card).await;
        let _lead = Stream::open(net.synapse, "lead").await;
        let mut c = clients(net.synapse).await;
        let group = c
            .groups
            .create_group(with_meta(
                CreateGroupRequest {
                    name: "crew".into(),
                    description: String::new(),
                    coordinator_id: String::new(),
                    initial_members: vec!["sky".into()],
                },
                &[("x-synapse-agent-id", "lead")],
            ))
            .await
            .unwrap()
            .into_inner()
            .group_id;

        let mut to_group_and_sky = synapse_chat("lead", "sky", "for the crew, and sky");
        to_group_and_sky.group_id = group;
        synapse::send(&mut c, to_group_and_sky).await.unwrap();
        synapse::send(&mut c, synapse_chat("lead", "sky", "sentinel"))
            .await
            .unwrap();
        assert_eq!(next_chat_text(&mut sky).await, "for the crew, and sky");
        assert_eq!(next_chat_text(&mut sky).await, "sentinel");
        net.bridge.shutdown().await;
    }

    /// Every protocol's listing shows the same agents online. A Grid program learns who is
    /// there from `GET /grid/v1/agents` (see README, Grid).
    #[tokio::test]
    async fn one_directory_through_every_protocols_listing() {
        let net = Net::start().await;
        let _sky = net.peer(Proto::Skynet).await;
        let _coder = net.peer(Proto::Tracker).await;
        let _syn = net.peer(Proto::Synapse).await;
        let _grid = net.peer(Proto::Grid).await;
        let (_listener, ok) = TrackerWs::auth_subscribed(net.tracker, "tb-listener").await;
        let expected: BTreeSet<String> = ["sky", "coder", "syn", "executor", "listener"]
            .map(String::from)
            .into();
        let names =
            |list: &Value, key: &str, online: &dyn Fn(&Value) -> bool| -> BTreeSet<String> {
                list.as_array()
                    .unwrap()
                    .iter()
                    .filter(|a| online(a))
                    .map(|a| a[key].as_str().unwrap().to_owned())
                    .collect()
            };

        let (_, skynet) = SkynetHttp::new(net.skynet).get("/api/members").await;
        assert_eq!(
            names(&skynet, "name", &|_| true),
            expected,
            "Skynet /api/members"
        );

        let tracker_online: BTreeSet<String> = ok["online"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap().to_owned())
            .collect();
        // auth.ok lists the others online, not the member itself.
        let others: BTreeSet<String> = expected
            .iter()
            .filter(|n| *n != "listener")
            .cloned()
            .collect();
        assert_eq!(tracker_online, others, "Tracker auth.ok online");
        let (_, members) = TrackerHttp::new(net.tracker, "tb-admin")
            .get("/members")
            .await;
        assert_eq!(
            names(&members, "slug", &|m| m["is_online"] == true),
            expected,
            "Tracker /members"
        );
        assert!(
            names(&members, "slug", &|m| m["is_online"] == false).contains("admin"),
            "offline members are listed offline: {members}"
        );

        let listed = clients(net.synapse)
            .await
            .capabilities
            .list_agents(())
            .await
            .unwrap()
            .into_inner();
        let synapse_online: BTreeSet<String> = listed
            .agents
            .iter()
            .filter(|a| a.is_active)
            .map(|a| a.agent_id.clone())
            .collect();
        assert_eq!(synapse_online, expected, "Synapse ListAgents");

        let (_, grid) = GridHttp::new(net.grid).get("/agents").await;
        assert_eq!(
            names(&grid["agents"], "agent", &|a| a["online"] == true),
            expected,
            "Grid /grid/v1/agents"
        );
        net.bridge.shutdown().await;
    }

    /// A name held in one protocol is refused in each other one, naming the holder.
    #[tokio::test]
    async fn name_clashes_name_the_holder_in_the_newcomers_protocol() {
        let net = Net::start().await;
        let _sky = net.peer(Proto::Skynet).await;
        let _syn = net.peer(Proto::Synapse).await;
        let _grid = net.peer(Proto::Grid).await;

        // Skynet, for a Tracker member's name.
        let (status, body) = SkynetHttp::new(net.skynet)
            .post("/api/agents", json!({ "name": "coder", "type": "generic" }))
            .await;
        assert_eq!(status, 409);
        let error = body["error"].as_str().unwrap();
        assert!(
            error.contains("tracker") && error.contains("coder"),
            "{body}"
        );

        // The Tracker, for a Skynet agent's name.
        let (status, body) = TrackerHttp::new(net.tracker, "tb-admin")
            .post("/members", json!({ "slug": "sky" }))
            .await;
        assert_eq!(status, 409);
        assert!(
            body["detail"].as_str().unwrap().contains("skynet"),
            "{body}"
        );

        // Synapse, for a Grid program's name.
        let mut c = clients(net.synapse).await;
        let status = synapse::send(&mut c, synapse_chat("executor", "syn", "hi"))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::AlreadyExists, "{status:?}");
        assert!(status.message().contains("grid"), "{status:?}");

        // Grid, for a Synapse agent's name.
        let (status, body) = GridHttp::new(net.grid)
            .post("message: { id: m1, timestamp: \"2026-01-24T10:00:00Z\", type: notification, sender: { agent: syn }, receiver: { agent: executor }, content: { action: message, payload: { text: hi } } }")
            .await;
        assert_eq!(status, 409, "{body}");
        assert!(body.to_string().contains("synapse"), "{body}");
        net.bridge.shutdown().await;
    }
}

/// The admin listener answers its probes, and a first scrape already names every
/// endpoint's series, at zero until something happens.
#[tokio::test]
async fn the_admin_listener_probes_and_a_first_scrape() {
    let w = world().await;
    let get = |path: &'static str| common::admin_get(&w.bridge, path);
    assert_eq!(get("/healthz").await.0, 200);
    assert_eq!(get("/readyz").await.0, 200);
    let (status, metrics) = get("/metrics").await;
    assert_eq!(status, 200);
    for protocol in ["skynet", "tracker", "synapse", "grid"] {
        for name in [
            "agentbridge_decode_errors_total",
            "agentbridge_connections",
            "agentbridge_agents_online",
        ] {
            let series = format!("{name}{{protocol=\"{protocol}\"}} ");
            assert!(metrics.contains(&series), "{series} in\n{metrics}");
        }
    }
    assert!(metrics.contains("# HELP agentbridge_decode_errors_total"));
    w.bridge.shutdown().await;
}
