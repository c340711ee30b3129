//! Shared protocol state is one state: what a protocol presents as its server's state is
//! the same whichever bridge a client asks.

use std::time::{Duration, Instant};

use crate::common::fleet::{Fleet, QUICK, start_member};
use crate::common::nats::Cluster;
use crate::common::peers::{Proto, What};
use crate::common::skynet::{SkynetHttp, SkynetWs};
use crate::common::tracker::{TrackerHttp, TrackerWs};
use crate::common::{self, WAIT, eventually};
use crate::support::{holds_text, impatient_client, nats_goes_away, spawn_member};

/// Presence as quick as `QUICK`, but writes that wait for NATS longer than a pause of the
/// tests, however loaded the machine: a write whose client left must still land.
const PATIENT_WRITES: &str =
    "heartbeat_ms = 200\npresence_ttl_ms = 1500\npublish_timeout_ms = 15000\n";

/// A Tracker write whose REST client gave up while NATS held it is made to its end: a task
/// assigned to an agent of another protocol reaches it once NATS answers.
#[tokio::test]
async fn a_tracker_task_whose_client_left_mid_write_still_reaches_its_assignee() {
    let cluster = Cluster::start(1).await;
    let fleet = Fleet::start_on(&cluster.toml_list(), 2, PATIENT_WRITES).await;
    let mut sky = fleet.nets[1].peer(Proto::Skynet).await;
    fleet.wait_known(0, "sky").await;
    let url = format!(
        "http://{}/api/v1/tasks?project_slug=team-board",
        fleet.nets[0].tracker
    );
    let task = serde_json::json!({ "title": "left behind", "assignee_slug": "sky" });
    let gave_up = cluster
        .while_paused(Duration::from_millis(800), async {
            let impatient = impatient_client();
            impatient
                .post(&url)
                .bearer_auth("tb-coder")
                .json(&task)
                .send()
                .await
        })
        .await;
    assert!(gave_up.is_err(), "the client gives up first: {gave_up:?}");
    // Within WAIT, or the test fails.
    sky.next_assignment().await;
    fleet.shutdown().await;
}

/// A Synapse task whose client gave up while NATS held its submission is submitted to its
/// end: its agent on another bridge is asked for it once NATS answers, and its external id
/// is the task's.
#[tokio::test]
async fn a_synapse_task_whose_client_left_mid_submit_still_reaches_its_agent() {
    use agentbridge::protocols::synapse::proto::{MessageType, SubmitTaskRequest};
    use common::synapse::{Stream, clients};

    let cluster = Cluster::start(1).await;
    let fleet = Fleet::start_on(&cluster.toml_list(), 2, PATIENT_WRITES).await;
    let mut worker = Stream::open(fleet.nets[1].synapse, "worker").await;
    fleet.wait_known(0, "worker").await;
    let mut c0 = clients(fleet.nets[0].synapse).await;
    let submit = SubmitTaskRequest {
        task_type: "worker".into(),
        external_task_id: "ext-left".into(),
        ..Default::default()
    };
    let gave_up = cluster
        .while_paused(Duration::from_millis(800), async {
            let submitting = c0.tasks.submit_task(submit.clone());
            tokio::time::timeout(Duration::from_millis(300), submitting).await
        })
        .await;
    assert!(gave_up.is_err(), "the client gives up first: {gave_up:?}");
    let request = worker.next().await;
    assert_eq!(request.r#type, MessageType::P2pTaskRequest as i32);
    let again = c0.tasks.submit_task(submit).await.unwrap_err();
    assert_eq!(again.code(), tonic::Code::AlreadyExists, "{again:?}");
    fleet.shutdown().await;
}

/// Skynet's message history is the fleet's: what an agent said on one bridge is in
/// `GET /api/messages` on the other, as the same messages.
#[tokio::test]
async fn skynet_history_is_the_same_on_every_bridge() {
    let fleet = Fleet::start(2).await;
    let http = SkynetHttp::new(fleet.nets[0].skynet);
    let speaker = http.agent("speaker").await;
    let (mut ws, _) = SkynetWs::join(fleet.nets[0].skynet, &speaker).await;
    let mut said = Vec::new();
    for i in 0..5 {
        said.push(ws.chat(&format!("for the record {i}")).await["id"].clone());
    }
    let on_b = SkynetHttp::new(fleet.nets[1].skynet);
    eventually("b1's history holds what was said on b0", async || {
        let (_, history) = on_b.get("/api/messages").await;
        let ids: Vec<_> = (history.as_array().into_iter().flatten())
            .map(|m| m["id"].clone())
            .filter(|id| said.contains(id))
            .collect();
        ids == said
    })
    .await;
    fleet.shutdown().await;
}

/// The Tracker's messages are the fleet's: what is posted through one bridge, over REST or
/// from another protocol, is listed alike by every bridge, with its ids and `reply_to`.
#[tokio::test]
async fn tracker_messages_are_the_same_on_every_bridge() {
    use serde_json::json;

    let fleet = Fleet::start(2).await;
    let admin = TrackerHttp::new(fleet.nets[0].tracker, "tb-admin");
    let (_, ok) = TrackerWs::auth_subscribed(fleet.nets[0].tracker, "tb-admin").await;
    let lobby = ok["lobby_chat_id"].as_str().unwrap().to_owned();
    let first = admin
        .message(json!({ "chat_id": lobby, "content": "hello @coder" }))
        .await;
    // From another protocol, through the other bridge.
    let (_coder, _) = TrackerWs::auth_subscribed(fleet.nets[0].tracker, "tb-coder").await;
    fleet.wait_known(1, "coder").await;
    let mut sky = fleet.nets[1].peer(Proto::Skynet).await;
    sky.chat("coder", "@coder from skynet", None).await;
    let reply = admin
        .message(json!({ "chat_id": lobby, "content": "thread", "reply_to": first["id"] }))
        .await;
    let listed = async |i: usize| {
        let http = TrackerHttp::new(fleet.nets[i].tracker, "tb-admin");
        let (_, listed) = http
            .get(&format!("/messages?chat_id={lobby}&limit=50"))
            .await;
        (listed.as_array().into_iter().flatten())
            .map(|m| (m["id"].clone(), m["content"].clone(), m["reply_to"].clone()))
            .collect::<Vec<_>>()
    };
    let said = (reply["id"].clone(), json!("thread"), first["id"].clone());
    let mut on_a = Vec::new();
    eventually("b0 lists the message from b1, and its own", async || {
        on_a = listed(0).await;
        on_a.iter().any(|m| m.1 == "@coder from skynet") && on_a.contains(&said)
    })
    .await;
    eventually("b1 lists b0's messages alike", async || {
        listed(1).await == on_a
    })
    .await;
    fleet.shutdown().await;
}

/// A Skynet schedule made through b0 for an agent registered through b0 and joined on b1.
struct ScheduleAcross {
    on_a: SkynetHttp,
    on_b: SkynetHttp,
    /// The agent's socket, on b1.
    ws: SkynetWs,
    id: String,
    path: String,
}

impl ScheduleAcross {
    /// With `cron`, enabled or not; listed on b1 when this returns.
    async fn made(fleet: &Fleet, cron: &str, enabled: bool) -> ScheduleAcross {
        let (a, b) = (fleet.nets[0].skynet, fleet.nets[1].skynet);
        let (on_a, on_b) = (SkynetHttp::new(a), SkynetHttp::new(b));
        let backend = on_a.agent("backend").await;
        eventually("b1 lists the agent registered through b0", async || {
            on_b.get("/api/agents/backend").await.0 == 200
        })
        .await;
        let (ws, _) = SkynetWs::join(b, &backend).await;
        fleet.wait_known(0, "backend").await;
        let schedule = serde_json::json!({
            "name": "ticking",
            "cronExpr": cron,
            "agentId": backend["id"],
            "taskTemplate": { "title": "Tick", "description": "Every tick" },
            "enabled": enabled,
        });
        let (status, schedule) = on_a.post("/api/schedules", schedule).await;
        assert_eq!(status, 201, "{schedule}");
        let id = schedule["id"].as_str().unwrap().to_owned();
        let path = format!("/api/schedules/{id}");
        eventually("b1 lists the schedule created through b0", async || {
            on_b.get(&path).await.0 == 200
        })
        .await;
        ScheduleAcross {
            on_a,
            on_b,
            ws,
            id,
            path,
        }
    }
}

/// A tick another bridge claimed and never sent (killed between its claim and its send)
/// is sent by the others once it has not reached them a while after: the tick's claim is
/// written here as a claimer would, and nobody sends it.
#[tokio::test]
async fn a_tick_claimed_by_a_bridge_that_never_sent_it_is_sent_by_another() {
    use base64::Engine;
    let fleet = Fleet::start(2).await;
    let mut across = ScheduleAcross::made(&fleet, "*/2 * * * * *", false).await;

    // The claim of a tick a few seconds ahead, as a bridge that then died wrote it.
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let tick = ((now_s + 6) / 2 * 2) * 1000;
    let records = fleet.bucket("records").await;
    let key = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&across.id);
    let claimed = records.put(
        format!("skynet-schedule-ticks.{key}"),
        tick.to_string().into(),
    );
    claimed.await.expect("the claim is written");
    let enable = serde_json::json!({ "enabled": true });
    assert_eq!(across.on_a.patch(&across.path, enable).await.0, 200);

    // The ticks after it come as ever; it comes too, once, after the bridges' wait.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    let mut after = 0;
    while !seen.contains(&tick) || after < 2 {
        assert!(Instant::now() < deadline, "tick {tick} not sent: {seen:?}");
        let message = across.ws.next_message().await;
        if message["type"] != "task.assign" {
            continue;
        }
        let at = message["timestamp"].as_i64().expect("a tick's time");
        assert!(!seen.contains(&at), "tick {at} came twice: {message}");
        seen.push(at);
        if seen.contains(&tick) && at != tick {
            after += 1;
        }
    }
    // Sent by one bridge, the first to claim sending it.
    assert_eq!(fleet.records_in("skynet-schedule-resent-ticks").await, 1);
    fleet.shutdown().await;
}

/// A Skynet schedule is the fleet's: listed and changed through any bridge. Of the
/// bridges each tick comes due on, one fires it, and it reaches the agent once.
#[tokio::test]
async fn a_skynet_schedule_is_the_fleets_and_each_tick_reaches_its_agent_once() {
    let fleet = Fleet::start(2).await;
    let ScheduleAcross {
        on_a,
        on_b,
        mut ws,
        path,
        ..
    } = ScheduleAcross::made(&fleet, "* * * * * *", true).await;

    // A tick both bridges fire twice over would come twice: same id, same time.
    let mut ticks = Vec::new();
    while ticks.len() < 4 {
        let message = ws.next_message().await;
        if message["type"] == "task.assign" {
            ticks.push(message);
        }
    }
    for pair in ticks.windows(2) {
        assert_ne!(pair[0]["id"], pair[1]["id"], "{pair:?}");
        assert!(
            pair[0]["timestamp"].as_i64() < pair[1]["timestamp"].as_i64(),
            "{pair:?}"
        );
    }

    // The fleet keeps one record of the schedule's last tick, not one a tick.
    assert_eq!(fleet.records_in("skynet-schedule-ticks").await, 1);

    // Changed through b1, for both; deleted through b0, for both.
    let (status, _) = on_b
        .patch(&path, serde_json::json!({ "enabled": false }))
        .await;
    assert_eq!(status, 200);
    eventually("b0 shows the schedule disabled through b1", async || {
        on_a.get(&path).await.1["enabled"] == false
    })
    .await;
    assert_eq!(on_a.delete(&path).await.0, 200);
    eventually(
        "b1 no longer lists the schedule deleted through b0",
        async || on_b.get(&path).await.0 == 404,
    )
    .await;
    assert_eq!(fleet.records_in("skynet-schedule-ticks").await, 0);
    fleet.shutdown().await;
}

/// A Skynet registration is the fleet's: listed by every bridge under the same id, able to
/// join through any of them and be reached there, its name taken fleet-wide, and deleted
/// for all — but not while it is online anywhere.
#[tokio::test]
async fn a_skynet_registration_is_the_fleets_and_joins_through_any_bridge() {
    let fleet = Fleet::start(2).await;
    let (a, b) = (fleet.nets[0].skynet, fleet.nets[1].skynet);
    let (on_a, on_b) = (SkynetHttp::new(a), SkynetHttp::new(b));
    let roamer = on_a.agent("roamer").await;
    let watcher = on_a.human("watcher").await;
    let listed = async |http: &SkynetHttp, path: &str, id: &serde_json::Value| {
        let (_, all) = http.get(path).await;
        (all.as_array().into_iter().flatten()).any(|p| p["id"] == *id)
    };
    eventually(
        "b1 lists the agent and the human registered through b0",
        async || {
            listed(&on_b, "/api/agents", &roamer["id"]).await
                && listed(&on_b, "/api/humans", &watcher["id"]).await
        },
    )
    .await;

    // It joins through b1 with the card b0 gave it, and a peer on b0 reaches it there.
    let (mut ws, _) = SkynetWs::join(b, &roamer).await;
    fleet.wait_known(0, "roamer").await;
    let mut peer = fleet.nets[0].peer(Proto::Grid).await;
    peer.chat("roamer", "@roamer over here", None).await;
    let message = loop {
        let message = ws.next_message().await;
        if message["type"] == "chat" {
            break message;
        }
    };
    assert!(
        common::skynet::text_of(&message).contains("over here"),
        "{message}"
    );

    // While it is online through b1, it cannot join through b0 as well.
    let mut twin = SkynetWs::connect(a).await;
    twin.action("join", serde_json::json!({ "agent": roamer }))
        .await;
    let refusal = twin.next().await;
    assert_eq!(refusal["event"], "error", "{refusal}");
    let text = refusal["data"]["message"].as_str().unwrap_or_default();
    assert!(
        text.contains("'b1'"),
        "the refusal names the bridge: {text}"
    );

    // Its name is the fleet's, and it is not deleted while online through b1.
    let (status, body) = on_b
        .post(
            "/api/agents",
            serde_json::json!({ "name": "roamer", "type": "claude-code" }),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    let path = format!("/api/agents/{}", roamer["id"].as_str().unwrap());
    let (status, body) = on_a.delete(&path).await;
    assert_eq!(status, 409, "{body}");

    ws.action("leave", serde_json::json!({})).await;
    let directory = &fleet.nets[0].bridge.core().directory;
    eventually("b0 shows roamer gone offline", async || {
        directory.get("roamer").is_some_and(|a| !a.online)
    })
    .await;
    let (status, body) = on_a.delete(&path).await;
    assert_eq!(status, 200, "{body}");
    eventually("b1 no longer lists the deleted agent", async || {
        !listed(&on_b, "/api/agents", &roamer["id"]).await
    })
    .await;
    // Its name is free again, fleet-wide.
    eventually("the name is registered again through b1", async || {
        let agent = serde_json::json!({ "name": "roamer", "type": "claude-code" });
        on_b.post("/api/agents", agent).await.0 == 201
    })
    .await;
    fleet.shutdown().await;
}

/// A Skynet human on a bridge killed with SIGKILL joins again through a bridge that never
/// held it, with the `lastSeenTimestamp` of what it saw, once the fleet has let the killed
/// bridge go: the replay has every message sent meanwhile, and nothing it saw before, so
/// it sees each message once.
#[tokio::test]
async fn a_human_whose_bridge_was_killed_rejoins_through_another_and_misses_nothing() {
    let fleet = Fleet::start(2).await;
    let dir = tempfile::tempdir().unwrap();
    let process = spawn_member(&fleet, dir.path(), "b2").await;
    let on_dying = SkynetHttp::new(process.addr("skynet"));
    let human = on_dying.human("nightwatch").await;
    let (mut watch, _) = SkynetWs::join(process.addr("skynet"), &human).await;
    fleet.wait_known(1, "nightwatch").await;
    let on_b1 = SkynetHttp::new(fleet.nets[1].skynet);
    eventually("b1 lists the human registered through b2", async || {
        let (_, humans) = on_b1.get("/api/humans").await;
        (humans.as_array().into_iter().flatten()).any(|h| h["id"] == human["id"])
    })
    .await;

    let speaker = SkynetHttp::new(fleet.nets[0].skynet).agent("speaker").await;
    let (mut speaker, _) = SkynetWs::join(fleet.nets[0].skynet, &speaker).await;
    let mut sent = Vec::new();
    let mut seen = Vec::new();
    let mut last_seen = 0;
    for n in 0..10 {
        sent.push(speaker.chat(&format!("before {n}")).await["id"].clone());
    }
    while seen.len() < 10 {
        let message = watch.next_message().await;
        if message["type"] == "chat" {
            last_seen = last_seen.max(message["timestamp"].as_i64().unwrap());
            seen.push(message["id"].clone());
        }
    }
    process.kill_9();
    // Acknowledged by b0 while the human's bridge is gone.
    for n in 0..10 {
        sent.push(speaker.chat(&format!("after {n}")).await["id"].clone());
    }
    let directory = &fleet.nets[1].bridge.core().directory;
    eventually("b1 shows the killed bridge's human offline", async || {
        directory.get("nightwatch").is_some_and(|a| !a.online)
    })
    .await;
    eventually("b1 has what b0 acknowledged", async || {
        let (_, history) = on_b1.get("/api/messages").await;
        let ids: Vec<_> = (history.as_array().into_iter().flatten())
            .map(|m| m["id"].clone())
            .collect();
        sent.iter().all(|id| ids.contains(id))
    })
    .await;

    // Let through at once, since b1 shows the human offline (though the card the killed
    // bridge left says online there, and the bucket keeps its heartbeat another TTL).
    let mut rejoined = SkynetWs::connect(fleet.nets[1].skynet).await;
    let join = serde_json::json!({ "agent": human, "lastSeenTimestamp": last_seen });
    rejoined.action("join", join).await;
    let answer = rejoined.next().await;
    assert_eq!(answer["event"], "workspace.state", "{answer}");
    let state = answer["data"].clone();
    let replayed = (state["recentMessages"].as_array().into_iter().flatten())
        .filter(|m| m["type"] == "chat")
        .map(|m| m["id"].clone());
    seen.extend(replayed);
    let mut once = seen.clone();
    once.sort_by_key(|id| id.to_string());
    once.dedup();
    assert_eq!(once.len(), seen.len(), "a message was seen twice: {seen:?}");
    assert_eq!(seen, sent, "what the human saw, live and replayed");
    fleet.shutdown().await;
}

/// Tracker members are one set: those declared alike have one id on every bridge, and a
/// member created over REST through one bridge is listed by the other, signs in there
/// with its token, and keeps its slug fleet-wide.
#[tokio::test]
async fn a_tracker_member_created_through_one_bridge_signs_in_through_any() {
    let fleet = Fleet::start(2).await;
    let (on_a, on_b) = (
        TrackerHttp::new(fleet.nets[0].tracker, "tb-admin"),
        TrackerHttp::new(fleet.nets[1].tracker, "tb-admin"),
    );
    let own_members = async |http: &TrackerHttp| {
        let (_, members) = http.get("/members").await;
        let mut own: Vec<_> = (members.as_array().into_iter().flatten())
            .filter(|m| m["protocol"] == "tracker")
            .map(|m| (m["slug"].clone(), m["id"].clone()))
            .collect();
        own.sort_by_key(|(slug, _)| slug.to_string());
        own
    };
    assert_eq!(own_members(&on_a).await, own_members(&on_b).await);

    let (status, created) = on_a
        .post(
            "/members",
            serde_json::json!({ "slug": "newcomer", "name": "Newcomer", "type": "agent" }),
        )
        .await;
    assert_eq!(status, 201, "{created}");
    eventually("b1 lists the member created through b0", async || {
        let (status, member) = on_b.get("/members/newcomer").await;
        status == 200 && member["id"] == created["id"] && member["protocol"] == "tracker"
    })
    .await;
    let token = created["token"].as_str().unwrap();
    let (_ws, ok) = TrackerWs::auth(fleet.nets[1].tracker, token).await;
    assert_eq!(ok["slug"], "newcomer", "{ok}");
    let (status, body) = on_b
        .post("/members", serde_json::json!({ "slug": "newcomer" }))
        .await;
    assert_eq!(status, 409, "{body}");

    // Created through both bridges at once: the fleet's claim lets exactly one through.
    for round in 0..3 {
        let racer = serde_json::json!({ "slug": format!("racer-{round}") });
        let (first, second) = tokio::join!(
            on_a.post("/members", racer.clone()),
            on_b.post("/members", racer.clone())
        );
        let mut codes = [first.0, second.0];
        codes.sort();
        assert_eq!(codes, [201, 409], "{} {}", first.1, second.1);
    }
    fleet.shutdown().await;
}

/// A task's steps are one checklist: added at once through both bridges, both are kept;
/// ticked through one, ticked on the other; removed through one, gone from both.
#[tokio::test]
async fn a_tasks_steps_are_one_checklist_fleet_wide() {
    let fleet = Fleet::start(2).await;
    let (on_a, on_b) = (
        TrackerHttp::new(fleet.nets[0].tracker, "tb-admin"),
        TrackerHttp::new(fleet.nets[1].tracker, "tb-admin"),
    );
    let made = on_a
        .task("team-board", serde_json::json!({ "title": "with steps" }))
        .await;
    let steps = format!("/tasks/{}/steps", made["id"].as_str().unwrap());
    eventually("b1 has the task", async || {
        on_b.get(&format!("/tasks/{}", made["id"].as_str().unwrap()))
            .await
            .0
            == 200
    })
    .await;
    let titles = async |http: &TrackerHttp| {
        let (_, all) = http.get(&steps).await;
        (all.as_array().into_iter().flatten())
            .map(|s| {
                (
                    s["title"].as_str().unwrap_or("").to_owned(),
                    s["done"] == true,
                )
            })
            .collect::<Vec<_>>()
    };
    for round in 0..3 {
        let add = |title: String| serde_json::json!({ "title": title });
        let (first, second) = tokio::join!(
            on_a.post(&steps, add(format!("a{round}"))),
            on_b.post(&steps, add(format!("b{round}")))
        );
        assert_eq!((first.0, second.0), (201, 201), "{} {}", first.1, second.1);
    }
    // The write that lost a race reaches the other bridge by its watch.
    eventually("every step added is kept", async || {
        titles(&on_a).await.len() == 6
    })
    .await;
    let mut expected = titles(&on_a).await;
    eventually("b1's checklist is b0's", async || {
        titles(&on_b).await == expected
    })
    .await;

    let (_, all) = on_b.get(&steps).await;
    let first = all[0]["id"].as_str().unwrap().to_owned();
    let (status, ticked) = on_b
        .patch(
            &format!("{steps}/{first}"),
            serde_json::json!({ "done": true }),
        )
        .await;
    assert_eq!(status, 200, "{ticked}");
    expected[0].1 = true;
    eventually("b0 shows the step ticked through b1", async || {
        titles(&on_a).await == expected
    })
    .await;
    let (status, body) = on_a.delete(&format!("{steps}/{first}")).await;
    assert_eq!(status, 204, "{body}");
    expected.remove(0);
    eventually("b1 no longer has the removed step", async || {
        titles(&on_b).await == expected
    })
    .await;
    let (status, _) = on_b.delete(&format!("{steps}/{first}")).await;
    assert_eq!(status, 404);
    fleet.shutdown().await;
}

/// A Synapse group is one group: created through one bridge, joined through the other,
/// its membership the same on both (a second join through either is refused), a message
/// for it reaches its members on every bridge, and disbanded through one, it is gone from
/// both.
#[tokio::test]
async fn a_synapse_group_is_one_group_fleet_wide() {
    use agentbridge::protocols::synapse::proto::{
        CreateGroupRequest, DisbandGroupRequest, JoinGroupRequest, ListGroupMembersRequest,
    };
    use common::synapse::{Stream, chat, clients, endpoint, text_of, with_meta};
    use tonic::{Code, Request};

    let fleet = Fleet::start(2).await;
    let (mut on_a, mut on_b) = (
        clients(fleet.nets[0].synapse).await,
        clients(fleet.nets[1].synapse).await,
    );
    let lead = Stream::open_groups(fleet.nets[0].synapse, "lead").await;
    // Its message stream makes it an agent, online; group messages come on the other.
    let _far_messages = Stream::open(fleet.nets[1].synapse, "far").await;
    let mut far = Stream::open_groups(fleet.nets[1].synapse, "far").await;
    fleet.wait_known(0, "far").await;
    let create = CreateGroupRequest {
        name: "crew".into(),
        description: "across".into(),
        coordinator_id: String::new(),
        initial_members: vec![],
    };
    let created = on_a
        .groups
        .create_group(with_meta(create, &[("x-synapse-agent-id", "lead")]))
        .await
        .unwrap()
        .into_inner();
    let group = created.group_id;
    let join = |agent: &str| {
        Request::new(JoinGroupRequest {
            group_id: group.clone(),
            agent: endpoint(agent),
        })
    };
    on_b.groups.join_group(join("far")).await.unwrap();
    let again = on_a.groups.join_group(join("far")).await.unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists, "{again:?}");

    let expected = vec![
        ("lead".to_owned(), "coordinator".to_owned()),
        ("far".to_owned(), "member".to_owned()),
    ];
    for clients in [&mut on_a, &mut on_b] {
        let mut members = Vec::new();
        eventually("both bridges list the group's members", async || {
            let listed = (clients.groups)
                .list_group_members(Request::new(ListGroupMembersRequest {
                    group_id: group.clone(),
                }))
                .await;
            members = listed.map_or_else(
                |_| Vec::new(),
                |l| {
                    (l.into_inner().members.iter())
                        .map(|m| (m.agent_id.clone(), m.role.clone()))
                        .collect()
                },
            );
            members == expected
        })
        .await;
    }

    let mut msg = chat("lead", "", "crew, gather");
    msg.receiver = None;
    msg.group_id = group.clone();
    lead.send(msg).await;
    let got = far.next().await;
    assert_eq!(
        (text_of(&got), got.group_id.as_str()),
        ("crew, gather".to_owned(), group.as_str())
    );

    on_b.groups
        .disband_group(Request::new(DisbandGroupRequest {
            group_id: group.clone(),
        }))
        .await
        .unwrap();
    eventually("b0 no longer has the disbanded group", async || {
        let listed = (on_a.groups)
            .list_group_members(Request::new(ListGroupMembersRequest {
                group_id: group.clone(),
            }))
            .await;
        listed.is_err_and(|e| e.code() == Code::NotFound)
    })
    .await;
    fleet.shutdown().await;
}

/// Tracker tasks are one state: a task made through one bridge is listed through the other
/// with the same id, in the same project, and its members there are told of it; `take` is
/// atomic fleet-wide, so of two takers on two bridges exactly one wins and the other is
/// told who holds the task.
#[tokio::test]
async fn a_tracker_task_is_one_task_fleet_wide_and_take_is_atomic() {
    let fleet = Fleet::start(2).await;
    let (on_a, on_b) = (
        TrackerHttp::new(fleet.nets[0].tracker, "tb-admin"),
        TrackerHttp::new(fleet.nets[1].tracker, "tb-admin"),
    );
    let ids = async |http: &TrackerHttp| {
        let (_, projects) = http.get("/projects").await;
        (projects.as_array().into_iter().flatten())
            .map(|p| (p["slug"].clone(), p["id"].clone(), p["chat_id"].clone()))
            .collect::<Vec<_>>()
    };
    let known_on_a = ids(&on_a).await;
    assert_eq!(known_on_a.len(), 2, "{known_on_a:?}");
    assert_eq!(
        known_on_a,
        ids(&on_b).await,
        "both bridges know the projects by one id"
    );
    let (mut watcher, _) = TrackerWs::auth_subscribed(fleet.nets[1].tracker, "tb-listener").await;

    for round in 0..5 {
        let made = on_a
            .task(
                "team-board",
                serde_json::json!({ "title": format!("round {round}") }),
            )
            .await;
        let id = made["id"].as_str().expect("a task id").to_owned();
        let event = watcher.next_of("task.created").await;
        assert_eq!(event["id"], made["id"], "{event}");
        let seen = on_b.get(&format!("/tasks/{id}")).await;
        assert_eq!(seen.0, 200, "b1 serves the task b0 made: {}", seen.1);
        assert_eq!(seen.1["project_id"], made["project_id"]);

        // Two takers at once, one through each bridge.
        async fn take(http: &TrackerHttp, id: &str, slug: &str) -> (u16, serde_json::Value) {
            let path = format!("/tasks/{id}/take?slug={slug}");
            http.post(&path, serde_json::json!({})).await
        }
        let (first, second) = tokio::join!(take(&on_a, &id, "coder"), take(&on_b, &id, "listener"));
        let (winner, loser) = match (first.0, second.0) {
            (200, 409) => ("coder", &second.1),
            (409, 200) => ("listener", &first.1),
            other => panic!("exactly one take wins: {other:?} {} {}", first.1, second.1),
        };
        let detail = loser["detail"].as_str().expect("a detail");
        assert!(
            detail.contains(winner),
            "the loser is told who holds it: {detail}"
        );
        for http in [&on_a, &on_b] {
            eventually(
                "both bridges show the winner holding the task",
                async || {
                    let (_, task) = http.get(&format!("/tasks/{id}")).await;
                    task["assignee_slug"] == winner
                },
            )
            .await;
        }
        let event = watcher.next_of("task.assigned").await;
        assert_eq!(event["assignee_slug"], winner, "{event}");

        // Deleted through one bridge, gone from the other.
        let (status, _) = on_b.delete(&format!("/tasks/{id}")).await;
        assert_eq!(status, 204);
        eventually("b0 forgets the task b1 deleted", async || {
            on_a.get(&format!("/tasks/{id}")).await.0 == 404
        })
        .await;
    }
    fleet.shutdown().await;
}

/// A write whose answer NATS did not give in time, but which reached the stream, is the
/// writer's all the same: it is made again under its id, which JetStream answers with the
/// first's revision, rather than refused to the client while the fleet holds it (and what
/// it was to set off never done).
#[tokio::test]
async fn a_write_that_landed_without_its_answer_is_the_writers() {
    landed_writes_are_the_writers(1).await;
}

/// As on one server, on three, where the stream's leader refuses the second try while it
/// still replicates the first.
#[tokio::test]
async fn a_write_that_landed_without_its_answer_is_the_writers_on_a_cluster() {
    landed_writes_are_the_writers(3).await;
}

/// A create and then a change, each made while every server of a cluster of `servers`
/// stands still past the publish timeout, land once and are the writer's.
async fn landed_writes_are_the_writers(servers: usize) {
    use agentbridge::core::Expect;
    let cluster = Cluster::start(servers).await;
    let fleet = Fleet::start_on(&cluster.toml_list(), 1, QUICK).await;
    let records = fleet.nets[0].bridge.core().records().unwrap();
    let (first, second) = (
        bytes::Bytes::from_static(b"created late"),
        bytes::Bytes::from_static(b"changed late"),
    );
    // Longer than QUICK's publish timeout (2 s), and not as long as a second try waits.
    let still = Duration::from_millis(2_500);
    let write = records.write("test-writes", "w0", first, Expect::Absent);
    let created = cluster.while_paused(still, write).await;
    let created = created.expect("the create landed");
    let write = records.write("test-writes", "w0", second.clone(), Expect::At(created));
    let changed = cluster.while_paused(still, write).await;
    let changed = changed.expect("the change landed");
    let record = records.read("test-writes", "w0").await.unwrap().unwrap();
    assert_eq!(
        (record.revision, record.value),
        (changed, Some(second.clone()))
    );
    assert!(changed > created);
    // Mail taken and put back (not delivered) is as sure of its answer.
    records.take("test-writes", "w0", changed).await.unwrap();
    let put_back = records.put_back("test-writes", "w0", second.clone(), changed);
    let kept_again = cluster.while_paused(still, put_back).await;
    let kept_again = kept_again.expect("the put-back landed");
    let record = records.read("test-writes", "w0").await.unwrap().unwrap();
    assert_eq!((record.revision, record.value), (kept_again, Some(second)));
    fleet.shutdown().await;
}

/// A Synapse task submitted through one bridge is the fleet's: every bridge reads, lists
/// and watches it, follows its assignee's progress wherever that arrives, and refuses its
/// external id again; a task that waits for an agent goes, with its file, to the agent
/// when it appears on another bridge, once.
#[tokio::test]
async fn a_synapse_task_is_one_task_fleet_wide() {
    use agentbridge::protocols::synapse::proto::{
        GetTaskRequest, MessageType, SubmitTaskRequest, TaskStatus, TaskStatusStreamRequest,
    };
    use common::synapse::{Stream, clients, status_update, task_complete};

    let fleet = Fleet::start(2).await;
    let mut worker = Stream::open(fleet.nets[1].synapse, "worker").await;
    fleet.wait_known(0, "worker").await;
    let (mut c0, mut c1) = (
        clients(fleet.nets[0].synapse).await,
        clients(fleet.nets[1].synapse).await,
    );
    let submit = |external: &str| SubmitTaskRequest {
        task_type: "worker".into(),
        external_task_id: external.into(),
        ..Default::default()
    };
    let id = (c0.tasks.submit_task(submit("ext-1")).await)
        .unwrap()
        .into_inner()
        .task_id;
    let again = c1.tasks.submit_task(submit("ext-1")).await.unwrap_err();
    assert_eq!(again.code(), tonic::Code::AlreadyExists, "{again:?}");

    let request = worker.next().await;
    assert_eq!(request.r#type, MessageType::P2pTaskRequest as i32);
    // b1 reads and watches the task b0 took.
    let status_on = async |c: &mut common::synapse::Clients| {
        let request = GetTaskRequest {
            task_id: id.clone(),
        };
        match c.tasks.get_task(request).await {
            Ok(answer) => answer.into_inner().task.map(|t| (t.status, t.progress)),
            Err(_) => None,
        }
    };
    eventually("b1 has the task", async || {
        status_on(&mut c1).await.is_some()
    })
    .await;
    let (watch, requests) = tokio::sync::mpsc::channel(1);
    let subscribe = TaskStatusStreamRequest {
        task_id: id.clone(),
        subscribe: true,
    };
    watch.send(subscribe).await.unwrap();
    let mut watching = (c1.tasks)
        .stream_task_status(tokio_stream::wrappers::ReceiverStream::new(requests))
        .await
        .unwrap()
        .into_inner();
    let mut next_update = async || {
        let update = tokio::time::timeout(WAIT, futures_util::StreamExt::next(&mut watching));
        update.await.unwrap().unwrap().unwrap()
    };
    assert_eq!(next_update().await.status, TaskStatus::Received as i32);

    let progress = status_update(
        "worker",
        "agentbridge",
        &id,
        TaskStatus::Processing,
        50,
        "half",
    );
    worker.send(progress).await;
    let update = next_update().await;
    assert_eq!(
        (update.status, update.progress),
        (TaskStatus::Processing as i32, 50)
    );
    let processing = Some((TaskStatus::Processing as i32, 50));
    eventually("b0 shows the progress", async || {
        status_on(&mut c0).await == processing
    })
    .await;
    worker
        .send(task_complete(
            "worker",
            "agentbridge",
            &id,
            "done",
            &request.id,
        ))
        .await;
    assert_eq!(next_update().await.status, TaskStatus::Completed as i32);
    let completed = Some((TaskStatus::Completed as i32, 100));
    eventually("b0 shows it completed", async || {
        status_on(&mut c0).await == completed
    })
    .await;

    // A task for an agent not there yet, with a file, through b0's gateway.
    let file = reqwest::multipart::Part::bytes(b"hello".to_vec())
        .file_name("notes.txt")
        .mime_str("text/plain")
        .unwrap();
    let form = reqwest::multipart::Form::new()
        .text("task_type", "later")
        .part("attachment", file);
    let url = format!(
        "http://{}/api/v1/synapse/task/multipart",
        fleet.nets[0].synapse
    );
    let answer = common::http()
        .post(url)
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200, "{:?}", answer.text().await);
    // The agent appears on b1, as a Skynet agent: it is given the task once, with its file.
    let skynet = fleet.nets[1].skynet;
    let later = SkynetHttp::new(skynet).agent("later").await;
    let (mut later, _) = SkynetWs::join(skynet, &later).await;
    let task = later.next_message().await;
    assert_eq!(
        task["payload"]["files"],
        serde_json::json!(["notes.txt"]),
        "{task}"
    );
    // And not a second time by the other bridge.
    while let Ok(frame) = tokio::time::timeout(Duration::from_millis(700), later.next()).await {
        assert!(frame.get("event").is_some(), "a second message: {frame}");
    }
    fleet.shutdown().await;
}

/// A file attached through one bridge is listed with its task and downloaded, byte for
/// byte, through another.
#[tokio::test]
async fn a_tracker_attachment_is_the_fleets() {
    let fleet = Fleet::start(2).await;
    let (a, b) = (
        TrackerHttp::new(fleet.nets[0].tracker, "tb-coder"),
        TrackerHttp::new(fleet.nets[1].tracker, "tb-coder"),
    );
    let task = a
        .task("team-board", serde_json::json!({ "title": "Files" }))
        .await;
    let task_id = task["id"].as_str().unwrap();
    let comment = a
        .message(serde_json::json!({ "task_id": task_id, "content": "log attached" }))
        .await;
    let path = format!("/messages/{}/attachments", comment["id"].as_str().unwrap());
    let bytes: Vec<u8> = (0..300_000u32).map(|n| (n % 251) as u8).collect();
    let (status, attachment) = a
        .upload(&path, "run.log", "text/plain", bytes.clone())
        .await;
    assert_eq!(status, 201, "{attachment}");

    let listed = format!("/attachments?task_id={task_id}");
    eventually("b1 lists the attachment", async || {
        let (status, list) = b.get(&listed).await;
        status == 200 && list.as_array().is_some_and(|l| l.len() == 1)
    })
    .await;
    let download = format!("/attachments/{}", attachment["id"].as_str().unwrap());
    let (status, mime, downloaded) = b.download(&download).await;
    assert_eq!((status, mime.as_str()), (200, "text/plain"));
    assert!(downloaded == bytes, "b1 serves the bytes b0 took");
    fleet.shutdown().await;
}

/// What a bridge's agents said among themselves while NATS was away reaches the fleet's
/// history even when that bridge restarts before NATS is back: it waits in a file of the
/// bridge's data directory, not in memory alone.
#[tokio::test]
async fn what_was_said_while_nats_was_away_is_shared_after_a_restart() {
    let mut cluster = Cluster::start(1).await;
    let fleet = Fleet::start_on(&cluster.toml_list(), 1, QUICK).await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data-b1");
    let data = data.to_str().unwrap();
    let start_b1 = async || start_member(&fleet.nats, &fleet.prefix, "b1", data, QUICK).await;
    let b1 = start_b1().await;
    eventually("b1 is connected to the fleet", async || {
        b1.bridge.readiness().degraded().is_none()
    })
    .await;
    let mut local = b1.peer(Proto::Skynet).await;
    let mut sender = b1.peer(Proto::Grid).await;

    nats_goes_away(&mut cluster, &b1.bridge).await;
    sender.chat(&local.name, "said while away", None).await;
    assert_eq!(local.next(What::Chat).await.text, "said while away");
    drop((local, sender));
    b1.bridge.shutdown().await;

    let b1 = start_b1().await;
    assert!(holds_text(&b1.bridge, "said while away").await);
    cluster.restart(0).await;
    eventually(
        "b0's history has what b1 kept while NATS was away, across b1's restart",
        async || holds_text(&fleet.nets[0].bridge, "said while away").await,
    )
    .await;
    b1.bridge.shutdown().await;
    fleet.shutdown().await;
}
