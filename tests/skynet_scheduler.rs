//! Skynet's scheduler over real sockets, checked against skynet-scheduler.md: the
//! `/api/schedules` routes, and the `task.assign` each tick sends its agent.
//!
//! Ticks use a six-field expression (`* * * * * *`, every second), which croner takes
//! beside the standard five fields, so that a test waits a second for one, not a minute.

mod common;

use std::time::Duration;

use common::skynet::{SkynetHttp, SkynetWs};
use common::{WAIT, start_bridge, start_bridge_in};
use serde_json::{Value, json};

fn daily_review(agent_id: &Value, created_by: &Value) -> Value {
    json!({
        "name": "daily-review",
        "cronExpr": "0 9 * * *",
        "agentId": agent_id,
        "taskTemplate": {
            "title": "Daily PR review",
            "description": "Review all open PRs from yesterday and summarize."
        },
        "createdBy": created_by,
    })
}

/// The next message `ws` receives that is not presence.
async fn next_task(ws: &mut SkynetWs) -> Value {
    loop {
        let message = ws.next_message().await;
        if message["type"] != "agent.join" && message["type"] != "agent.leave" {
            return message;
        }
    }
}

#[tokio::test]
async fn schedules_are_created_listed_updated_and_deleted() {
    let bridge = start_bridge("").await;
    let http = SkynetHttp::new(bridge.addr("skynet").unwrap());
    let backend = http.agent("backend").await;
    let alice = http.human("alice").await;

    let before = agentbridge::core::now_ms();
    let (status, created) = http
        .post("/api/schedules", daily_review(&backend["id"], &alice["id"]))
        .await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    assert_eq!(created["name"], "daily-review");
    assert_eq!(created["cronExpr"], "0 9 * * *");
    assert_eq!(created["agentId"], backend["id"]);
    assert_eq!(created["taskTemplate"]["title"], "Daily PR review");
    assert_eq!(created["enabled"], true);
    assert_eq!(created["createdBy"], alice["id"]);
    // Left out until it has run, as Skynet's server leaves it out.
    assert!(created.get("lastRunAt").is_none(), "{created}");
    let next = created["nextRunAt"].as_i64().unwrap();
    assert!(
        next > before && next <= before + 24 * 3600 * 1000,
        "{created}"
    );
    assert_eq!(next % (24 * 3600 * 1000), 9 * 3600 * 1000, "09:00 UTC");
    assert!(created["createdAt"].as_i64().unwrap() >= before);
    assert_eq!(created["updatedAt"], created["createdAt"]);

    // By the agent's name too, as Skynet's server looks agents up; kept as given.
    let mut by_name = daily_review(&json!("backend"), &Value::Null);
    by_name["name"] = json!("by-name");
    let (status, second) = http.post("/api/schedules", by_name).await;
    assert_eq!(status, 201, "{second}");
    assert_eq!(second["agentId"], "backend");
    assert!(second.get("createdBy").is_none(), "{second}");

    // Refusals, with the texts of Skynet's server.
    let required = "name, cronExpr, agentId, and taskTemplate are required";
    let template = json!({ "title": "t", "description": "d" });
    let refused = [
        (
            json!({ "cronExpr": "0 9 * * *", "agentId": backend["id"], "taskTemplate": template }),
            400,
            required,
        ),
        (
            json!({ "name": "x", "cronExpr": "0 9 * * *", "agentId": backend["id"] }),
            400,
            required,
        ),
        (
            json!({ "name": "x", "cronExpr": "not a cron", "agentId": backend["id"], "taskTemplate": template }),
            400,
            "Invalid cron expression: ",
        ),
        (
            json!({ "name": "x", "cronExpr": "61 * * * *", "agentId": backend["id"], "taskTemplate": template }),
            400,
            "Invalid cron expression: ",
        ),
        (
            json!({ "name": "x", "cronExpr": "0 9 * * *", "agentId": "nobody", "taskTemplate": template }),
            404,
            "Agent 'nobody' not found",
        ),
        // A human is no agent.
        (
            json!({ "name": "x", "cronExpr": "0 9 * * *", "agentId": alice["id"], "taskTemplate": template }),
            404,
            "Agent '",
        ),
    ];
    for (body, status, says) in refused {
        let (got, answer) = http.post("/api/schedules", body.clone()).await;
        assert_eq!(got, status, "{body} → {answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(error.starts_with(says), "{body} → {answer}");
    }

    // One that never fires is kept, with no next run, as croner keeps it.
    let mut never = daily_review(&backend["id"], &Value::Null);
    never["name"] = json!("never");
    never["cronExpr"] = json!("0 0 30 2 *");
    let (status, kept) = http.post("/api/schedules", never).await;
    assert_eq!(status, 201, "{kept}");
    assert_eq!(kept["nextRunAt"], Value::Null);
    let path = format!("/api/schedules/{}", kept["id"].as_str().unwrap());
    assert_eq!(http.delete(&path).await.0, 200);

    // Listed, by agent too.
    let (status, all) = http.get("/api/schedules").await;
    assert_eq!(status, 200);
    let names: Vec<&str> = (all.as_array().unwrap().iter())
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["daily-review", "by-name"]);
    let agent_id = backend["id"].as_str().unwrap();
    let (_, mine) = http
        .get(&format!("/api/schedules?agentId={agent_id}"))
        .await;
    assert_eq!(mine.as_array().unwrap().len(), 1);
    let (_, none) = http.get("/api/schedules?agentId=someone-else").await;
    assert_eq!(none, json!([]));
    let (status, one) = http.get(&format!("/api/schedules/{id}")).await;
    assert_eq!((status, &one), (200, &created));
    let (status, missing) = http.get("/api/schedules/no-such-id").await;
    assert_eq!(
        (status, missing),
        (404, json!({ "error": "Schedule not found" }))
    );

    // Updated: a field at a time; disabled, it has no next run.
    let (status, updated) = http
        .patch(
            &format!("/api/schedules/{id}"),
            json!({ "cronExpr": "0 17 * * 1-5", "enabled": false }),
        )
        .await;
    assert_eq!(status, 200, "{updated}");
    assert_eq!(updated["cronExpr"], "0 17 * * 1-5");
    assert_eq!(updated["enabled"], false);
    assert!(updated.get("nextRunAt").is_none(), "{updated}");
    assert_eq!(updated["name"], "daily-review");
    assert!(updated["updatedAt"].as_i64() >= created["updatedAt"].as_i64());
    let (status, _) = http
        .patch(
            &format!("/api/schedules/{id}"),
            json!({ "cronExpr": "nope" }),
        )
        .await;
    assert_eq!(status, 400);
    let (status, _) = http
        .patch("/api/schedules/no-such-id", json!({ "enabled": true }))
        .await;
    assert_eq!(status, 404);
    let (status, enabled) = http
        .patch(&format!("/api/schedules/{id}"), json!({ "enabled": true }))
        .await;
    assert_eq!(status, 200);
    assert!(enabled["nextRunAt"].is_i64(), "{enabled}");

    // Deleted.
    let (status, deleted) = http.delete(&format!("/api/schedules/{id}")).await;
    assert_eq!((status, deleted), (200, json!({ "deleted": true })));
    let (status, _) = http.delete(&format!("/api/schedules/{id}")).await;
    assert_eq!(status, 404);
    assert_eq!(
        http.get("/api/schedules").await.1.as_array().unwrap().len(),
        1
    );
    bridge.shutdown().await;
}

#[tokio::test]
async fn each_tick_sends_the_agent_a_task_from_the_scheduler() {
    let bridge = start_bridge("").await;
    let addr = bridge.addr("skynet").unwrap();
    let http = SkynetHttp::new(addr);
    let backend = http.agent("backend").await;
    let alice = http.human("alice").await;
    let (mut ws, _) = SkynetWs::join(addr, &backend).await;
    let mut every_second = daily_review(&backend["id"], &alice["id"]);
    every_second["cronExpr"] = json!("* * * * * *");
    every_second["taskTemplate"]["files"] = json!(["CHANGELOG.md"]);
    let (status, schedule) = http.post("/api/schedules", every_second).await;
    assert_eq!(status, 201, "{schedule}");

    let first = next_task(&mut ws).await;
    assert_eq!(first["type"], "task.assign", "{first}");
    assert_eq!(first["from"], "system:scheduler");
    assert_eq!(first["mentions"], json!([backend["id"]]));
    let payload = &first["payload"];
    assert_eq!(payload["title"], "Daily PR review");
    assert_eq!(
        payload["description"],
        "Review all open PRs from yesterday and summarize."
    );
    assert_eq!(payload["files"], json!(["CHANGELOG.md"]));
    assert!(payload["taskId"].is_string());
    // A TaskPayload: assigned to the schedule's agent, its schedule in `metadata` too.
    assert_eq!(payload["status"], "pending");
    assert_eq!(payload["assignee"], backend["id"]);
    assert_eq!(payload["metadata"]["scheduledBy"], schedule["id"]);
    assert_eq!(payload["metadata"]["scheduleName"], "daily-review");
    let at = first["timestamp"].as_i64().unwrap();
    assert_eq!(at % 1000, 0, "the tick's own time: {first}");

    // The agent runner answers a task mentioning its sender, the scheduler: passed over,
    // not refused (the SDK raises an `error` event no runner listens for).
    ws.chat_with(json!({
        "type": "task.result",
        "payload": { "taskId": payload["taskId"], "success": true, "summary": "done" },
        "mentions": ["system:scheduler"],
    }))
    .await;
    ws.no_error_before_a_sentinel().await;

    let second = next_task(&mut ws).await;
    assert_eq!(second["type"], "task.assign");
    assert_ne!(second["id"], first["id"]);
    assert_ne!(second["payload"]["taskId"], payload["taskId"]);
    assert!(second["timestamp"].as_i64().unwrap() > at);

    // Stored, as any sent message is, and shown as run.
    let (_, history) = http.get("/api/messages").await;
    assert!(
        (history.as_array().unwrap().iter()).any(|m| m["id"] == first["id"]),
        "{history}"
    );
    let id = schedule["id"].as_str().unwrap();
    let (_, shown) = http.get(&format!("/api/schedules/{id}")).await;
    assert!(shown["lastRunAt"].as_i64().unwrap() >= at, "{shown}");
    bridge.shutdown().await;
}

#[tokio::test]
async fn a_task_fired_while_its_agent_is_away_is_in_its_joins_replay() {
    let bridge = start_bridge("").await;
    let addr = bridge.addr("skynet").unwrap();
    let http = SkynetHttp::new(addr);
    let backend = http.agent("backend").await;
    let mut every_second = daily_review(&backend["id"], &Value::Null);
    every_second["cronExpr"] = json!("* * * * * *");
    let (_, schedule) = http.post("/api/schedules", every_second).await;
    let id = schedule["id"].as_str().unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (_, shown) = http.get(&format!("/api/schedules/{id}")).await;
        if shown["lastRunAt"].is_i64() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never ran: {shown}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    http.delete(&format!("/api/schedules/{id}")).await;
    let (_ws, state) = SkynetWs::join(addr, &backend).await;
    let replayed = state["recentMessages"].as_array().unwrap();
    let task = (replayed.iter())
        .find(|m| m["type"] == "task.assign")
        .unwrap_or_else(|| panic!("no task in {state}"));
    assert_eq!(task["from"], "system:scheduler");
    assert_eq!(task["payload"]["metadata"]["scheduledBy"], schedule["id"]);
    bridge.shutdown().await;
}

#[tokio::test]
async fn schedules_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().to_str().unwrap();
    let (id, agent) = {
        let bridge = start_bridge_in(data_dir, "").await;
        let http = SkynetHttp::new(bridge.addr("skynet").unwrap());
        let backend = http.agent("backend").await;
        let (_, created) = http
            .post("/api/schedules", daily_review(&backend["id"], &Value::Null))
            .await;
        bridge.shutdown().await;
        (
            created["id"].as_str().unwrap().to_owned(),
            backend["id"].clone(),
        )
    };
    let bridge = start_bridge_in(data_dir, "").await;
    let http = SkynetHttp::new(bridge.addr("skynet").unwrap());
    let (status, kept) = http.get(&format!("/api/schedules/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(kept["agentId"], agent);
    assert!(kept["nextRunAt"].is_i64());
    bridge.shutdown().await;
}

/// The agent a schedule names may be any protocol's, by the card id Skynet clients see it
/// under: each tick reaches it as its protocol's task assignment.
#[tokio::test]
async fn a_schedule_for_another_protocols_agent_reaches_it_as_a_task() {
    use common::peers::{Net, Proto, What};

    let net = Net::start().await;
    let http = SkynetHttp::new(net.skynet);
    for proto in [Proto::Tracker, Proto::Synapse, Proto::Grid] {
        let mut peer = net.peer(proto).await;
        let (_, members) = http.get("/api/members").await;
        let card = (members.as_array().unwrap().iter())
            .find(|m| m["name"] == proto.agent())
            .unwrap_or_else(|| panic!("{proto:?} is no member: {members}"))
            .clone();
        let mut every_second = daily_review(&card["id"], &Value::Null);
        every_second["cronExpr"] = json!("* * * * * *");
        let (status, schedule) = http.post("/api/schedules", every_second).await;
        assert_eq!(status, 201, "{proto:?}: {schedule}");
        let task = peer.next(What::TaskAssigned).await;
        assert_eq!(task.from, "system:scheduler", "{proto:?}: {}", task.raw);
        // The task's title or description, as the protocol shows a task's text.
        assert!(
            task.text.contains("Daily PR review") || task.text.contains("Review all open PRs"),
            "{proto:?}: {task:?}"
        );
        let path = format!("/api/schedules/{}", schedule["id"].as_str().unwrap());
        assert_eq!(http.delete(&path).await.0, 200);
    }
    net.bridge.shutdown().await;
}

#[tokio::test]
async fn schedules_are_bounded_in_number_and_size() {
    let bridge = start_bridge("[skynet]\nlisten = \"127.0.0.1:0\"\nmax_schedules = 2\n").await;
    let http = SkynetHttp::new(bridge.addr("skynet").unwrap());
    let backend = http.agent("backend").await;
    let mut huge = daily_review(&backend["id"], &Value::Null);
    huge["taskTemplate"]["description"] = json!("x".repeat(70_000));
    let (status, refused) = http.post("/api/schedules", huge).await;
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused["error"]
            .as_str()
            .unwrap()
            .contains("limit is 65536")
    );
    for _ in 0..2 {
        let (status, _) = http
            .post("/api/schedules", daily_review(&backend["id"], &Value::Null))
            .await;
        assert_eq!(status, 201);
    }
    let (status, refused) = http
        .post("/api/schedules", daily_review(&backend["id"], &Value::Null))
        .await;
    assert_eq!(status, 409, "{refused}");
    assert!(
        refused["error"]
            .as_str()
            .unwrap()
            .starts_with("Too many schedules"),
        "{refused}"
    );
    bridge.shutdown().await;
}

/// A connected human sees every tick, as humans see every message; an agent deleted takes
/// its schedules with it.
#[tokio::test]
async fn humans_see_ticks_and_an_agents_schedules_go_with_it() {
    let bridge = start_bridge("").await;
    let addr = bridge.addr("skynet").unwrap();
    let http = SkynetHttp::new(addr);
    let backend = http.agent("backend").await;
    let alice = http.human("alice").await;
    let (mut watcher, _) = SkynetWs::join(addr, &alice).await;
    let mut every_second = daily_review(&backend["id"], &alice["id"]);
    every_second["cronExpr"] = json!("* * * * * *");
    let (_, schedule) = http.post("/api/schedules", every_second).await;
    // One that names the agent by its name goes with it too.
    let by_name = daily_review(&json!("backend"), &Value::Null);
    assert_eq!(http.post("/api/schedules", by_name).await.0, 201);
    let seen = next_task(&mut watcher).await;
    assert_eq!(seen["type"], "task.assign", "{seen}");
    assert_eq!(seen["mentions"], json!([backend["id"]]));

    let path = format!("/api/agents/{}", backend["id"].as_str().unwrap());
    let (status, deleted) = http.delete(&path).await;
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted["deletedSchedules"], 2);
    let schedule_path = format!("/api/schedules/{}", schedule["id"].as_str().unwrap());
    assert_eq!(http.get(&schedule_path).await.0, 404);
    bridge.shutdown().await;
}
