//! One namespace, one presence: an agent on any bridge is listed on every bridge, and a
//! name is claimed once fleet-wide.

use std::time::{Duration, Instant};

use crate::common::fleet::{Fleet, QUICK, claim_of, start_member};
use crate::common::nats::Cluster;
use crate::common::peers::Proto;
use crate::common::skynet::{SkynetHttp, SkynetWs};
use crate::common::tracker::{TrackerHttp, TrackerWs};
use crate::common::{self, WAIT, eventually, eventually_within};
use crate::support::{
    away_program, away_synapse_agent, impatient_client, listed, nats_goes_away, nats_is_back,
    on_one_server, readiness_is, spawn_bridge, spawn_member, wait_held,
};

#[tokio::test]
async fn an_agent_on_one_bridge_is_listed_natively_on_the_others() {
    let fleet = Fleet::start(2).await;
    let sky = fleet.nets[1].peer(Proto::Skynet).await;
    fleet.wait_known(0, &sky.name).await;

    // The Tracker on b0 lists it among its members, online.
    let tracker = TrackerHttp::new(fleet.nets[0].tracker, "tb-admin");
    let (status, members) = tracker.get("/members").await;
    assert_eq!(status, 200, "{members}");
    let listed = members
        .as_array()
        .or_else(|| members["members"].as_array())
        .expect("a list of members")
        .iter()
        .any(|m| m["slug"] == sky.name.as_str());
    assert!(listed, "b0's Tracker lists {}: {members}", sky.name);

    // The Grid on b0 lists it among its agents.
    let grid = common::grid::GridHttp::new(fleet.nets[0].grid);
    let (status, agents) = grid.get("/agents").await;
    assert_eq!(status, 200);
    assert!(agents.to_string().contains(&sky.name), "{agents}");

    // A Skynet human on b0 sees it among the workspace's members.
    let http = SkynetHttp::new(fleet.nets[0].skynet);
    let boss = http.human("boss").await;
    let (_, state) = SkynetWs::join(fleet.nets[0].skynet, &boss).await;
    assert!(
        state["members"].to_string().contains(&sky.name),
        "{}",
        state["members"]
    );
    fleet.shutdown().await;
}

/// Presence crosses bridges in every protocol's events, and every listing names the bridge
/// that holds each agent: a Grid program and a Tracker member connected through b1 join,
/// change status and leave, as a Skynet human and a Tracker member on b0 see them.
#[tokio::test]
async fn presence_crosses_bridges_in_every_protocol_naming_the_holders_bridge() {
    use serde_json::{Value, json};

    /// The next Skynet presence message of `kind` about `who` (its name, or card id).
    async fn skynet_presence(ws: &mut SkynetWs, kind: &str, who: &str) -> Value {
        loop {
            let frame = ws.next_message().await;
            let about = frame["payload"]["agent"]["name"] == who || frame["from"] == who;
            if frame["type"] == kind && about {
                return frame;
            }
        }
    }
    /// The next Skynet `status-change` event about the card `who`.
    async fn skynet_status(ws: &mut SkynetWs, who: &str) -> Value {
        loop {
            let frame = ws.next().await;
            if frame["event"] == "status-change" && frame["data"]["agentId"] == who {
                return frame["data"].clone();
            }
        }
    }
    /// The next Tracker `agent.status` about `slug`.
    async fn tracker_status(ws: &mut TrackerWs, slug: &str) -> Value {
        loop {
            let data = ws.next_of("agent.status").await;
            if data["slug"] == slug {
                return data;
            }
        }
    }

    // A TTL a loaded machine does not outlast, so that nobody flaps offline meanwhile.
    let fleet = Fleet::start_timed(2, "heartbeat_ms = 200\npresence_ttl_ms = 10000\n").await;
    let sk0 = SkynetHttp::new(fleet.nets[0].skynet);
    let boss = sk0.human("boss").await;
    let (mut boss_ws, _) = SkynetWs::join(fleet.nets[0].skynet, &boss).await;
    let (mut admin, _) = TrackerWs::auth_subscribed(fleet.nets[0].tracker, "tb-admin").await;

    // A Grid program connecting through b1 joins on b0, in Skynet and the Tracker.
    let (prog, _) = common::grid::GridWs::connect(fleet.nets[1].grid, "prog", None).await;
    let join = skynet_presence(&mut boss_ws, "agent.join", "prog").await;
    assert_eq!(join["payload"]["agent"]["bridge"], "b1", "{join}");
    let prog_card = join["from"].as_str().unwrap().to_owned();
    let online = tracker_status(&mut admin, "prog").await;
    assert_eq!(online, json!({ "slug": "prog", "status": "online" }));

    // Listed on b0, online and held by b1, in every protocol.
    let (_listener, ok) = TrackerWs::auth_subscribed(fleet.nets[0].tracker, "tb-listener").await;
    let online = ok["online"].as_array().cloned().unwrap_or_default();
    assert!(
        online.contains(&json!("prog")),
        "the Tracker's online list: {ok}"
    );
    let tracker = TrackerHttp::new(fleet.nets[0].tracker, "tb-admin");
    let (_, member) = tracker.get("/members/prog").await;
    assert_eq!(
        (&member["protocol"], &member["is_online"], &member["bridge"]),
        (&json!("grid"), &json!(true), &json!("b1")),
        "Tracker /members: {member}"
    );
    let (_, grid) = common::grid::GridHttp::new(fleet.nets[0].grid)
        .get("/agents")
        .await;
    let listed = |name: &str| {
        (grid["agents"].as_array().unwrap().iter())
            .find(|a| a["agent"] == name)
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(listed("prog")["bridge"], "b1", "Grid /agents: {grid}");
    assert_eq!(listed("boss")["bridge"], "b0", "Grid /agents: {grid}");
    let (_, cards) = sk0.get("/api/members").await;
    let card = (cards.as_array().unwrap().iter())
        .find(|c| c["name"] == "prog")
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (&card["status"], &card["bridge"]),
        (&json!("idle"), &json!("b1")),
        "Skynet /api/members: {cards}"
    );
    let agents = common::synapse::clients(fleet.nets[0].synapse)
        .await
        .capabilities
        .list_agents(())
        .await
        .unwrap()
        .into_inner()
        .agents;
    let info = |name: &str| agents.iter().find(|a| a.agent_id == name);
    assert!(
        info("prog").is_some_and(|a| a.is_active && a.system_id == "grid" && a.endpoint == "b1"),
        "Synapse ListAgents names the holder's bridge as the endpoint: {agents:?}"
    );
    assert!(
        info("boss").is_some_and(|a| a.endpoint == "b0"),
        "Synapse ListAgents: {agents:?}"
    );

    // A Skynet agent joining through b1 is held by b1 in its join and in b0's listing; the
    // human joined through b0, by b0.
    let scout = SkynetHttp::new(fleet.nets[1].skynet).agent("scout").await;
    let (_scout_ws, _) = SkynetWs::join(fleet.nets[1].skynet, &scout).await;
    let join = skynet_presence(&mut boss_ws, "agent.join", "scout").await;
    assert_eq!(join["payload"]["agent"]["bridge"], "b1", "{join}");
    let held_by = async |name: &str| {
        let (_, cards) = sk0.get("/api/members").await;
        (cards.as_array().unwrap().iter())
            .find(|c| c["name"] == name)
            .map(|c| c["bridge"].clone())
    };
    eventually("b0 lists scout, held by b1", async || {
        held_by("scout").await == Some(json!("b1"))
    })
    .await;
    assert_eq!(
        held_by("boss").await,
        Some(json!("b0")),
        "Skynet /api/members"
    );
    // Its profile too, with the status and bridge b1 gives it, once b0 applied the
    // registration (the fleet's records lag a moment).
    let profile_on = async |skynet| {
        let (_, agents) = SkynetHttp::new(skynet).get("/api/agents").await;
        (agents.as_array().unwrap().iter())
            .find(|a| a["name"] == "scout")
            .cloned()
            .unwrap_or_default()
    };
    eventually("b0 lists scout's profile, held by b1", async || {
        profile_on(fleet.nets[0].skynet).await["bridge"] == "b1"
    })
    .await;
    assert_eq!(
        profile_on(fleet.nets[0].skynet).await,
        profile_on(fleet.nets[1].skynet).await
    );

    // A Tracker member on b1 going busy is a Skynet status change on b0.
    let (mut coder, _) = TrackerWs::auth_subscribed(fleet.nets[1].tracker, "tb-coder").await;
    let join = skynet_presence(&mut boss_ws, "agent.join", "coder").await;
    let coder_card = join["from"].as_str().unwrap().to_owned();
    tracker_status(&mut admin, "coder").await;
    coder
        .send(json!({ "type": "heartbeat", "status": "busy" }))
        .await;
    assert_eq!(
        skynet_status(&mut boss_ws, &coder_card).await,
        json!({ "agentId": coder_card, "status": "busy" })
    );
    // b0's Tracker shows its own member online and busy through b1.
    let (_, member) = tracker.get("/members/coder").await;
    assert_eq!(
        (&member["is_online"], &member["status"], &member["bridge"]),
        (&json!(true), &json!("busy"), &json!("b1")),
        "Tracker /members on b0: {member}"
    );

    // Leaving crosses too (the Tracker's `agent.status` is `online | offline` alone).
    drop(prog);
    skynet_presence(&mut boss_ws, "agent.leave", &prog_card).await;
    assert_eq!(
        tracker_status(&mut admin, "prog").await,
        json!({ "slug": "prog", "status": "offline" })
    );
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_name_held_on_another_bridge_is_refused_naming_the_holder_and_its_bridge() {
    let fleet = Fleet::start(2).await;
    let held = fleet.nets[1].named_peer(Proto::Grid, "unique").await;
    fleet.wait_known(0, &held.name).await;
    let http = SkynetHttp::new(fleet.nets[0].skynet);
    let (status, body) = http
        .post(
            "/api/agents",
            serde_json::json!({ "name": "unique", "type": "claude-code" }),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    let error = body.to_string();
    assert!(
        error.contains("grid") && error.contains("'b1'"),
        "names the holder and its bridge: {error}"
    );

    // The Tracker, creating a member of that name.
    let (status, body) = TrackerHttp::new(fleet.nets[0].tracker, "tb-admin")
        .post("/members", serde_json::json!({ "slug": "unique" }))
        .await;
    assert_eq!(status, 409, "{body}");
    let detail = body["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("grid") && detail.contains("'b1'"),
        "names the holder and its bridge: {body}"
    );

    // Synapse, an agent sending under that id.
    let mut synapse = common::synapse::clients(fleet.nets[0].synapse).await;
    let refused = common::synapse::chat("unique", "someone", "hi");
    let status = common::synapse::send(&mut synapse, refused)
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::AlreadyExists, "{status:?}");
    assert!(
        status.message().contains("grid") && status.message().contains("'b1'"),
        "names the holder and its bridge: {status:?}"
    );
    fleet.shutdown().await;
}

/// Two bridges registering one name at the same instant: exactly one wins, the other is
/// refused naming the winner's bridge (the claim is a create in the fleet's names bucket,
/// not a race between the bridges' directories).
#[tokio::test]
async fn of_two_bridges_claiming_one_name_at_once_exactly_one_wins() {
    let fleet = Fleet::start(2).await;
    let a = SkynetHttp::new(fleet.nets[0].skynet);
    let b = SkynetHttp::new(fleet.nets[1].skynet);
    for n in 0..10 {
        let name = format!("racer{n}");
        let body = serde_json::json!({ "name": name, "type": "claude-code" });
        let ((status_a, answer_a), (status_b, answer_b)) = tokio::join!(
            a.post("/api/agents", body.clone()),
            b.post("/api/agents", body.clone())
        );
        let mut statuses = [status_a, status_b];
        statuses.sort();
        assert_eq!(statuses, [201, 409], "{name}: {answer_a} / {answer_b}");
        let refusal = if status_a == 409 { answer_a } else { answer_b };
        assert!(
            refusal.to_string().contains("on bridge 'b"),
            "the refusal names the holder's bridge: {refusal}"
        );
    }
    fleet.shutdown().await;
}

/// A registration whose client went away while its name's claim waited for NATS leaves
/// no claim behind: once NATS answers, what was claimed for it is given up, and another
/// bridge registers the name.
#[tokio::test]
async fn a_registration_whose_client_left_mid_claim_leaves_the_name_free() {
    let cluster = Cluster::start(1).await;
    let fleet = Fleet::start_on(&cluster.toml_list(), 2, QUICK).await;
    let body = serde_json::json!({ "name": "hasty", "type": "claude-code" });
    let url = format!("http://{}/api/agents", fleet.nets[0].skynet);
    // NATS holds the claim unanswered, within the presence TTL, while the client gives up.
    let gave_up = cluster
        .while_paused(Duration::from_millis(800), async {
            let impatient = impatient_client();
            impatient.post(&url).json(&body).send().await
        })
        .await;
    assert!(gave_up.is_err(), "the client gives up first: {gave_up:?}");
    let other = SkynetHttp::new(fleet.nets[1].skynet);
    let mut last = (0, serde_json::Value::Null);
    let deadline = Instant::now() + WAIT;
    while last.0 != 201 {
        assert!(
            Instant::now() < deadline,
            "b1 cannot register the name b0's client left: {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        last = other.post("/api/agents", body.clone()).await;
    }
    fleet.shutdown().await;
}

/// A registration retried at once after its client gave up mid-claim holds the name: the
/// first claim, given up once NATS answers, does not take the key the retry relies on.
#[tokio::test]
async fn a_registration_retried_after_its_client_left_mid_claim_keeps_the_name() {
    let cluster = Cluster::start(1).await;
    let fleet = Fleet::start_on(&cluster.toml_list(), 2, QUICK).await;
    let body = serde_json::json!({ "name": "retrier", "type": "claude-code" });
    let url = format!("http://{}/api/agents", fleet.nets[0].skynet);
    let (gave_up, retried) = cluster
        .while_paused(Duration::from_millis(800), async {
            let impatient = impatient_client();
            let gave_up = impatient.post(&url).json(&body).send().await;
            let retried = common::http().post(&url).json(&body).send().await;
            (gave_up, retried)
        })
        .await;
    assert!(gave_up.is_err(), "the client gives up first: {gave_up:?}");
    let status = retried.expect("the retry is answered").status().as_u16();
    assert_eq!(status, 201, "the retry registers the name");
    // Time for a claim given up to go, if it wrongly were.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let names = fleet.names().await;
    let claim = claim_of(&names, "retrier").await.expect("NATS answers");
    assert_eq!(
        claim["bridge"], "b0",
        "the fleet's key holds the name for b0: {claim}"
    );
    fleet.shutdown().await;
}

/// Of two agents of different protocols registering one name on one bridge at once, the
/// one refused leaves the other's claim in place, and the fleet's key for the name
/// describes the one that holds it: no other bridge registers the name.
#[tokio::test]
async fn a_name_refused_on_its_own_bridge_stays_claimed_for_its_holder() {
    let fleet = Fleet::start(2).await;
    let skynet = SkynetHttp::new(fleet.nets[0].skynet);
    let tracker = TrackerHttp::new(fleet.nets[0].tracker, "tb-admin");
    let other = SkynetHttp::new(fleet.nets[1].skynet);
    let names = fleet.names().await;
    for n in 0..5 {
        let name = format!("twin{n}");
        let agent = serde_json::json!({ "name": name, "type": "claude-code" });
        let member = serde_json::json!({ "slug": name, "name": name, "type": "agent" });
        let (as_agent, as_member) = tokio::join!(
            skynet.post("/api/agents", agent.clone()),
            tracker.post("/members", member)
        );
        let holder = match (as_agent.0, as_member.0) {
            (201, 409) => "skynet",
            (409, 201) => "tracker",
            other => panic!(
                "{name}: exactly one wins: {other:?} {} / {}",
                as_agent.1, as_member.1
            ),
        };
        // Time for a claim given up to go (it is given up in the background).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let claim = claim_of(&names, &name).await.expect("NATS answers");
        assert_eq!(claim["bridge"], "b0", "{name}: {claim}");
        assert_eq!(claim["protocol"], holder, "{name}: {claim}");
        let (status, refusal) = other.post("/api/agents", agent).await;
        assert_eq!(status, 409, "{name} is still claimed: {refusal}");
    }
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_killed_bridges_agents_go_offline_everywhere() {
    let fleet = Fleet::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let process = spawn_member(&fleet, dir.path(), "b1").await;
    let http = SkynetHttp::new(fleet.nets[0].skynet);
    let observer = http.human("observer").await;
    let (mut observer, _) = SkynetWs::join(fleet.nets[0].skynet, &observer).await;

    let grid = process.addr("grid");
    let _doomed = common::grid::GridWs::connect(grid, "doomed", None).await;
    fleet.wait_known(0, "doomed").await;
    process.kill_9();
    let directory = &fleet.nets[0].bridge.core().directory;
    eventually("b0 shows the killed bridge's agent offline", async || {
        directory.get("doomed").is_some_and(|a| !a.online)
    })
    .await;
    loop {
        let event = observer.next().await;
        // The only agent that leaves: shown to Skynet by its card id.
        if event["type"] == "agent.leave" {
            break;
        }
    }
    fleet.shutdown().await;
}

/// Two bridges cut off from NATS together each let a Grid program take one name, and each
/// let one Skynet agent join. Once NATS is back the fleet settles each name on one bridge
/// (the earlier registration; for the one agent, the bridge whose id sorts first): the
/// other's socket is refused in its protocol, naming the bridge that keeps the name, and
/// closed; both bridges list the name there, online; the program's key names that bridge;
/// and what is sent to the name through the bridge that gave it up reaches the program
/// that kept it.
#[tokio::test]
async fn a_name_two_bridges_cut_off_each_let_a_program_take_is_settled_on_one() {
    use common::grid::{GridHttp, GridWs};
    let mut cluster = Cluster::start(3).await;
    let urls = cluster.urls();
    let dir = tempfile::tempdir().unwrap();
    let on_server = |i: usize| on_one_server(&urls[i], i, "clash", 60_000, 1_000);
    let b0 = spawn_bridge(dir.path(), "b0", &on_server(0)).await;
    let b1 = spawn_bridge(dir.path(), "b1", &on_server(1)).await;
    // A Skynet agent both bridges know, which joins through both while they are cut off.
    let dual = SkynetHttp::new(b0.addr("skynet")).agent("dual").await;
    eventually("b1 knows dual", async || {
        listed(&b1, "dual").await.is_some()
    })
    .await;

    cluster.kill(0);
    cluster.kill(1);
    readiness_is(&b0, false).await;
    readiness_is(&b1, false).await;
    let (_dual_kept, _) = SkynetWs::join(b0.addr("skynet"), &dual).await;
    let (mut dual_lost, _) = SkynetWs::join(b1.addr("skynet"), &dual).await;
    let mut kept = GridWs::quiet(b0.addr("grid"), "twin", None).await;
    eventually("b0 holds twin", async || {
        listed(&b0, "twin")
            .await
            .is_some_and(|a| a["online"] == true)
    })
    .await;
    // Registered a little later on b1: b0's is the earlier registration.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut lost = GridWs::quiet(b1.addr("grid"), "twin", None).await;
    eventually("b1 holds twin too", async || {
        listed(&b1, "twin")
            .await
            .is_some_and(|a| a["online"] == true)
    })
    .await;

    cluster.restart(0).await;
    cluster.restart(1).await;
    lost.wait_up_to(Duration::from_secs(30));
    let refused = lost.read_until_closed().await;
    let refusal = &refused.last().expect("b1 refuses its twin")["content"]["payload"];
    assert_eq!(refusal["error_code"], "NAME_TAKEN", "{refused:?}");
    let text = refusal["error_message"].as_str().unwrap_or_default();
    assert!(text.contains("on bridge 'b0'"), "{refused:?}");

    // One registration on both: the tie goes to the bridge whose id sorts first.
    dual_lost.wait_up_to(Duration::from_secs(30));
    let error = loop {
        let frame = dual_lost.next().await;
        if frame["event"] == "error" {
            break frame;
        }
    };
    let text = error["data"]["message"].as_str().unwrap_or_default();
    assert_eq!(
        text, "dual is connected on bridge 'b0'; disconnect it there first",
        "{error}"
    );
    assert!(
        dual_lost.closed().await.is_some(),
        "b1 closes dual's socket"
    );

    // Held by b0 (named by the bridges that do not hold it).
    for name in ["twin", "dual"] {
        for (process, holder) in [(&b0, serde_json::Value::Null), (&b1, "b0".into())] {
            eventually_within(
                "the name is listed online through b0",
                SETTLED_WITHIN,
                async || {
                    listed(process, name)
                        .await
                        .is_some_and(|a| a["online"] == true && a["bridge"] == holder)
                },
            )
            .await;
        }
    }
    let js = async_nats::jetstream::new(async_nats::connect(&urls[2]).await.unwrap());
    eventually_within("twin's key names b0", SETTLED_WITHIN, async || {
        let Ok(names) = js.get_key_value("clash_names").await else {
            return false;
        };
        claim_of(&names, "twin")
            .await
            .is_ok_and(|c| c["bridge"] == "b0")
    })
    .await;

    // Sent again while refused: the stream's leader may still be being elected.
    let to_the_twin = "message: { id: to-the-twin, type: request, sender: { agent: caller }, receiver: { agent: twin }, content: { action: ping } }";
    eventually("b1 takes a message for twin", async || {
        GridHttp::new(b1.addr("grid")).try_send(to_the_twin).await
    })
    .await;
    kept.wait_up_to(Duration::from_secs(15));
    let got = kept.next_message().await;
    assert_eq!(got["id"], "to-the-twin", "{got}");
}

/// A bridge cut off long enough to be taken for gone comes back holding a Skynet member
/// whose socket closed meanwhile (it waits out its grace period, online), while the agent
/// joined through another bridge. The name is held through both; the agent connected
/// keeps it, though the other bridge's id sorts first (which decides between two
/// connected), and its socket is left alone.
#[tokio::test]
async fn a_name_held_only_for_a_member_in_its_grace_period_goes_to_the_bridge_it_is_connected_to() {
    let mut cluster = Cluster::start(3).await;
    let urls = cluster.urls();
    let dir = tempfile::tempdir().unwrap();
    let on_server = |i: usize| on_one_server(&urls[i], i, "graced", 1_500, 1_000);
    let b0 = spawn_bridge(dir.path(), "b0", &on_server(0)).await;
    let b1 = spawn_bridge(dir.path(), "b1", &on_server(1)).await;
    let wanderer = SkynetHttp::new(b0.addr("skynet")).agent("wanderer").await;
    let (on_b0, _) = SkynetWs::join(b0.addr("skynet"), &wanderer).await;
    eventually("b1 shows wanderer online through b0", async || {
        listed(&b1, "wanderer")
            .await
            .is_some_and(|a| a["online"] == true && a["bridge"] == "b0")
    })
    .await;

    cluster.kill(0);
    readiness_is(&b0, false).await;
    on_b0.close().await;
    let joined = async || {
        let mut ws = SkynetWs::connect(b1.addr("skynet")).await;
        ws.action("join", serde_json::json!({ "agent": wanderer }))
            .await;
        (ws.next().await["event"] == "workspace.state").then_some(ws)
    };
    // Refused until the fleet lets b0's claim go (its heartbeat expires).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut on_b1 = loop {
        if let Some(ws) = joined().await {
            break ws;
        }
        assert!(Instant::now() < deadline, "b1 never lets wanderer join");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    cluster.restart(0).await;
    readiness_is(&b0, true).await;
    eventually_within(
        "b0 shows wanderer online through b1",
        SETTLED_WITHIN,
        async || {
            listed(&b0, "wanderer")
                .await
                .is_some_and(|a| a["online"] == true && a["bridge"] == "b1")
        },
    )
    .await;
    // Past the moment b1 settles the clash it found in b0's card.
    tokio::time::sleep(Duration::from_secs(5)).await;
    on_b1.no_error_before_a_sentinel().await;
    let held = listed(&b1, "wanderer").await.expect("b1 lists wanderer");
    assert!(held["online"] == true && held["bridge"].is_null(), "{held}");
}

/// A Skynet agent whose socket dropped on one bridge with no leave (it waits out its grace
/// period there) joins through another at once: a member with no connection open does not
/// keep its name from its own move. The bridge it left lists it once, as the other's, and
/// routes to it there.
#[tokio::test]
async fn a_skynet_agent_waiting_out_its_grace_period_joins_through_another_bridge() {
    use serde_json::json;
    let fleet = Fleet::start(2).await;
    let sk0 = SkynetHttp::new(fleet.nets[0].skynet);
    let roamer = sk0.agent("roamer").await;
    let (on_b0, _) = SkynetWs::join(fleet.nets[0].skynet, &roamer).await;
    let on_b1_directory = &fleet.nets[1].bridge.core().directory;
    eventually("b1 shows roamer online through b0", async || {
        (on_b1_directory.get("roamer"))
            .is_some_and(|a| a.online && a.bridge.as_deref() == Some("b0"))
    })
    .await;
    let sk1 = SkynetHttp::new(fleet.nets[1].skynet);
    let id = roamer["id"].as_str().unwrap();
    eventually("b1 has roamer's registration", async || {
        sk1.get(&format!("/api/agents/{id}")).await.0 == 200
    })
    .await;
    on_b0.close().await;
    eventually("b1 hears roamer has no socket open on b0", async || {
        (on_b1_directory.get("roamer")).is_some_and(|a| a.online && !a.connected)
    })
    .await;

    let mut on_b1 = SkynetWs::connect(fleet.nets[1].skynet).await;
    on_b1.action("join", json!({ "agent": roamer })).await;
    let answer = on_b1.next().await;
    assert_eq!(answer["event"], "workspace.state", "{answer}");

    eventually("b0 lists roamer once, held by b1", async || {
        let (_, members) = sk0.get("/api/members").await;
        let held: Vec<_> = (members.as_array().into_iter().flatten())
            .filter(|card| card["name"] == "roamer")
            .map(|card| card["bridge"].clone())
            .collect();
        held == [json!("b1")]
    })
    .await;
    assert_eq!(sk0.get("/health").await.1["memberCount"], 1);
    let caller = sk0.agent("caller").await;
    let (mut caller, _) = SkynetWs::join(fleet.nets[0].skynet, &caller).await;
    caller.chat("@roamer after the move").await;
    loop {
        let message = on_b1.next_message().await;
        if message["type"] == "chat" {
            assert_eq!(message["payload"]["text"], "@roamer after the move");
            break;
        }
    }
    fleet.shutdown().await;
}

/// How long a clash found as NATS comes back may take to be settled on a loaded machine:
/// the stream and buckets elect their leaders again, cards are put again after failed
/// puts, and a clash is settled seconds after it is found.
const SETTLED_WITHIN: Duration = Duration::from_secs(30);

/// An agent's card whose put failed (the agents bucket gone a moment, as when its stream
/// fails over) is put again once it can be: a bridge that starts later finds the agent
/// where it is.
#[tokio::test]
async fn a_card_whose_put_failed_is_put_again() {
    use futures_util::StreamExt;
    let fleet = Fleet::start(2).await;
    let js = fleet.jetstream().await;
    let bucket = format!("{}_agents", fleet.prefix);
    let stream = js
        .get_stream(format!("KV_{bucket}"))
        .await
        .expect("the agents bucket");
    let config = stream.cached_info().config.clone();
    js.delete_key_value(&bucket).await.expect("the bucket goes");

    let _socket = common::grid::GridWs::quiet(fleet.nets[1].grid, "carded", None).await;
    fleet.wait_known(0, "carded").await;
    // Time for b1 to try the card's first put, which fails while the bucket is gone.
    tokio::time::sleep(Duration::from_millis(500)).await;
    js.create_stream(config).await.expect("the bucket is back");

    let agents = js.get_key_value(&bucket).await.expect("the agents bucket");
    eventually("the bucket holds carded's card", async || {
        let Ok(mut keys) = agents.keys().await else {
            return false;
        };
        while let Some(Ok(key)) = keys.next().await {
            let Ok(Some(card)) = agents.get(&key).await else {
                continue;
            };
            let card: serde_json::Value = serde_json::from_slice(&card).unwrap_or_default();
            if card["name"] == "carded" {
                return card["bridge"] == "b1" && card["online"] == true;
            }
        }
        false
    })
    .await;
    fleet.shutdown().await;
}

/// An agent back on a bridge it held once before is held there again, fleet-wide: every
/// bridge shows it on that bridge (not the one it left), so they send it live there and no
/// other keeps its mail. A Synapse agent's row and a Grid program outlive their
/// connections, so connecting to that bridge again registers nothing new there.
#[tokio::test]
async fn an_agent_back_on_a_bridge_it_left_is_held_there() {
    use common::grid::GridWs;
    use common::synapse::Stream;
    let fleet = Fleet::start(3).await;
    away_synapse_agent(&fleet, 0, "rover").await;
    away_program(&fleet, 0, "roamer").await;
    away_synapse_agent(&fleet, 1, "rover").await;
    away_program(&fleet, 1, "roamer").await;
    for name in ["rover", "roamer"] {
        wait_held(&fleet, 0, name, Some("b1"), false).await;
    }
    let _stream = Stream::open(fleet.nets[0].synapse, "rover").await;
    let _socket = GridWs::quiet(fleet.nets[0].grid, "roamer", None).await;
    for name in ["rover", "roamer"] {
        wait_held(&fleet, 0, name, None, true).await;
        for i in 1..3 {
            wait_held(&fleet, i, name, Some("b0"), true).await;
        }
    }
    fleet.shutdown().await;
}

/// A name registered while NATS was away, claimed then in its bridge's directory alone, is
/// claimed in the fleet's names bucket once NATS is back.
#[tokio::test]
async fn a_name_registered_while_nats_was_away_is_claimed_once_it_is_back() {
    let mut cluster = Cluster::start(1).await;
    let fleet = Fleet::start_on(&cluster.toml_list(), 2, QUICK).await;
    let bridge = &fleet.nets[0].bridge;
    nats_goes_away(&mut cluster, bridge).await;
    let (_newcomer, _) = common::grid::GridWs::connect(fleet.nets[0].grid, "newcomer", None).await;
    nats_is_back(&mut cluster, bridge).await;
    let names = fleet.names().await;
    eventually("the names bucket holds newcomer for b0", async || {
        let claim = claim_of(&names, "newcomer").await;
        claim.is_ok_and(|c| c["bridge"] == "b0")
    })
    .await;
    fleet.shutdown().await;
}

/// An agent unregistered while a claim of its name by the same agent runs is registered
/// again by that claim after: the release its unregistering started does not delete the
/// key the directory now relies on (the name would be free for another bridge to take).
#[tokio::test]
async fn a_release_leaves_the_key_of_a_name_held_here_again() {
    use agentbridge::core::AgentInfo;

    let fleet = Fleet::start(1).await;
    let core = fleet.nets[0].bridge.core();
    let agent = AgentInfo::new("lingerer", "grid", "lingerer");
    core.register(agent.clone()).await.expect("claimed");
    let names = fleet.names().await;
    let held = async || {
        claim_of(&names, "lingerer")
            .await
            .is_ok_and(|c| c["bridge"] == "b0")
    };
    eventually("the names bucket holds lingerer for b0", held).await;
    core.unregister("lingerer", "grid")
        .expect("it was registered");
    // What a claim that ran meanwhile does once it lands, before the release reads the key.
    core.directory.register(agent).expect("registered again");
    // Room for the release, which reads the key at once, to have deleted it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(held().await, "the key was released under a name held here");
    fleet.shutdown().await;
}

/// Two bridges given one `bridge_id` would share one place in the stream: each says so in
/// `/readyz` (the other bridges stay ready), until one of them stops.
#[tokio::test]
async fn a_bridge_id_used_twice_is_told_by_both_until_one_stops() {
    let fleet = Fleet::start(2).await;
    let twin = start_member(&fleet.nats, &fleet.prefix, "b1", ":memory:", QUICK).await;
    let told = async |bridge: &agentbridge::Bridge| {
        let (_, readyz) = common::admin_get(bridge, "/readyz").await;
        readyz.contains("another bridge runs with bridge_id \"b1\"")
    };
    eventually("b1 tells of its twin", async || {
        told(&fleet.nets[1].bridge).await
    })
    .await;
    eventually("the twin tells of b1", async || told(&twin.bridge).await).await;
    let (_, readyz) = common::admin_get(&fleet.nets[0].bridge, "/readyz").await;
    assert_eq!(readyz, "ready\n");
    twin.bridge.shutdown().await;
    eventually("b1 is ready again", async || {
        common::admin_get(&fleet.nets[1].bridge, "/readyz").await.1 == "ready\n"
    })
    .await;
    fleet.shutdown().await;
}
