//! Operating a bridge: reloading its config while it runs (the admin listener's `POST
//! /admin/reload`, SIGHUP), the admin token, draining on SIGTERM, and log lines a search
//! can follow a message by — against real bridges, in this process and as child
//! processes.

mod common;

use std::path::Path;
use std::time::Duration;

use agentbridge::Bridge;
use agentbridge::bridge::Options;
use common::eventually;
use common::process::BridgeProcess;
use common::skynet::{SkynetHttp, SkynetWs};
use common::tracker::{TrackerHttp, TrackerWs};
use common::{WAIT, bridge_toml};
use serde_json::{Value, json};

/// A bridge started from `text` written to `path`, which a reload reads again.
async fn bridge_from(path: &Path, text: &str) -> Bridge {
    std::fs::write(path, text).unwrap();
    Bridge::start_from(path, Options::default())
        .await
        .expect("the bridge starts")
}

/// `POST /admin/reload` on `admin`, with `token` if given: the status and the report.
async fn reload(admin: std::net::SocketAddr, token: Option<&str>) -> (u16, Value) {
    let mut request = common::http().post(format!("http://{admin}/admin/reload"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let answer = request.send().await.expect("the admin listener answers");
    let status = answer.status().as_u16();
    (status, answer.json().await.expect("a JSON report"))
}

fn listed(report: &Value, key: &str) -> Vec<String> {
    (report[key].as_array().into_iter().flatten())
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

const NEW_MEMBER: &str = "\n[[tracker.members]]\nslug = \"newbie\"\ntoken = \"tb-newbie\"\n\n[[tracker.projects]]\nslug = \"later\"\nname = \"Added Later\"\n";

/// Members, tokens and projects change in place: connections stay up, a new member signs
/// in, a changed token is the member's from then on. A new listen address is reported
/// as taking a restart and the old one kept; tighter limits hold for new connections.
#[tokio::test]
async fn a_reload_changes_members_tokens_projects_and_limits_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bridge.toml");
    let text = bridge_toml(":memory:", "");
    let bridge = bridge_from(&path, &text).await;
    let admin = bridge.admin_addr().unwrap();
    let (tracker, skynet) = (
        bridge.addr("tracker").unwrap(),
        bridge.addr("skynet").unwrap(),
    );
    let (mut listener, ok) = TrackerWs::auth(tracker, "tb-listener").await;
    let lobby = ok["lobby_chat_id"].clone();

    let changed = text
        .replace("token = \"tb-coder\"", "token = \"tb-coder-2\"")
        .replacen(
            "[skynet]\nlisten = \"127.0.0.1:0\"",
            "[skynet]\nlisten = \"127.0.0.1:1\"",
            1,
        )
        .replacen(
            "[admin]\nlisten = \"127.0.0.1:0\"",
            "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"adm1n\"",
            1,
        )
        + NEW_MEMBER
        + "\n[limits]\nheader_read_timeout_ms = 300\n\n[routing]\nmailbox_capacity = 8\n";
    std::fs::write(&path, changed).unwrap();
    let (status, report) = reload(admin, None).await;
    assert_eq!(status, 200, "{report}");
    let applied = listed(&report, "changed");
    for key in [
        "tracker.members",
        "tracker.projects",
        "limits.header_read_timeout_ms",
        "routing.mailbox_capacity",
        "admin.token",
    ] {
        assert!(applied.contains(&key.to_owned()), "{key} not in {report}");
    }
    assert_eq!(
        listed(&report, "needs_restart"),
        ["skynet.listen"],
        "{report}"
    );

    // The admin listener asks for the token from now on.
    let agents = format!("http://{admin}/admin/api/agents");
    assert_eq!(
        common::http().get(&agents).send().await.unwrap().status(),
        401
    );
    let with_token = common::http()
        .get(&agents)
        .bearer_auth("adm1n")
        .send()
        .await
        .unwrap();
    assert_eq!(with_token.status(), 200);
    // The connection open before the reload is still served.
    let admin_http = TrackerHttp::new(tracker, "tb-admin");
    let (status, _) = admin_http
        .post(
            "/messages",
            json!({ "chat_id": lobby, "content": "after the reload" }),
        )
        .await;
    assert_eq!(status, 201);
    assert_eq!(listener.next_content().await, "after the reload");
    // The new member signs in; the changed token is the only one that works.
    assert_eq!(
        TrackerHttp::new(tracker, "tb-newbie")
            .get("/members")
            .await
            .0,
        200
    );
    assert_eq!(
        TrackerHttp::new(tracker, "tb-coder")
            .get("/members")
            .await
            .0,
        401
    );
    assert_eq!(
        TrackerHttp::new(tracker, "tb-coder-2")
            .get("/members")
            .await
            .0,
        200
    );
    let (_, projects) = admin_http.get("/projects").await;
    assert!(projects.to_string().contains("Added Later"), "{projects}");
    // Skynet still listens where it did.
    assert_eq!(SkynetHttp::new(skynet).get("/api/members").await.0, 200);
    // A connection that sends nothing is now closed after the new header timeout (the
    // old one was ten seconds).
    let mut idle = tokio::net::TcpStream::connect(skynet).await.unwrap();
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncReadExt::read(&mut idle, &mut byte),
    )
    .await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "an idle connection is closed: {closed:?}"
    );
    bridge.shutdown().await;
}

/// A file that does not validate changes nothing, and says where it is wrong.
#[tokio::test]
async fn a_bad_file_is_refused_with_its_line_and_the_running_config_stays() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bridge.toml");
    let text = bridge_toml(":memory:", "");
    let bridge = bridge_from(&path, &text).await;
    let admin = bridge.admin_addr().unwrap();
    let tracker = bridge.addr("tracker").unwrap();

    let broken = format!("{text}{NEW_MEMBER}\n[routing]\nmailbox_capacity = 0\n");
    std::fs::write(&path, &broken).unwrap();
    let (status, report) = reload(admin, None).await;
    assert_eq!(status, 400, "{report}");
    let error = report["error"].as_str().unwrap();
    let line = broken
        .lines()
        .position(|l| l.starts_with("mailbox_capacity"))
        .unwrap()
        + 1;
    assert!(
        error.contains(&format!("bridge.toml:{line}: routing.mailbox_capacity:")),
        "{error}"
    );
    // Nothing of the file was taken: the member it adds does not exist.
    assert_eq!(
        TrackerHttp::new(tracker, "tb-newbie")
            .get("/members")
            .await
            .0,
        401
    );
    assert_eq!(
        TrackerHttp::new(tracker, "tb-coder")
            .get("/members")
            .await
            .0,
        200
    );
    let (_, metrics) = common::admin_get(&bridge, "/metrics").await;
    assert!(
        metrics.contains("agentbridge_config_reloads_total{outcome=\"refused\"}"),
        "the refusal is counted"
    );
    bridge.shutdown().await;
}

/// Declared Synapse agents, the Synapse token and the Grid scratchpad list change in place.
#[tokio::test]
async fn a_reload_declares_synapse_agents_and_grid_scratchpads() {
    use agentbridge::protocols::synapse::proto::capabilities_service_client::CapabilitiesServiceClient;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bridge.toml");
    let text = bridge_toml(":memory:", "");
    let bridge = bridge_from(&path, &text).await;
    let admin = bridge.admin_addr().unwrap();
    let (synapse, grid) = (
        bridge.addr("synapse").unwrap(),
        bridge.addr("grid").unwrap(),
    );

    let pad = dir.path().join("SCRATCHPAD.md");
    let changed = text
        .replacen("[synapse]\n", "[synapse]\ntoken = \"syn-secret\"\n", 1)
        .replacen(
            "[grid]\n",
            &format!("[grid]\nscratchpad = {:?}\n", pad.display().to_string()),
            1,
        )
        + "\n[[synapse.agents]]\nagent_id = \"declared-later\"\ncapabilities = [\"review\"]\n";
    std::fs::write(&path, changed).unwrap();
    let (status, report) = reload(admin, None).await;
    assert_eq!(status, 200, "{report}");
    let applied = listed(&report, "changed");
    for key in ["synapse.agents", "synapse.token", "grid.scratchpad"] {
        assert!(applied.contains(&key.to_owned()), "{key} not in {report}");
    }

    let mut capabilities = CapabilitiesServiceClient::new(common::synapse::channel(synapse).await);
    let refused = capabilities
        .list_agents(tonic::Request::new(()))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let request = common::synapse::with_meta((), &[("authorization", "Bearer syn-secret")]);
    let agents = capabilities
        .list_agents(request)
        .await
        .unwrap()
        .into_inner();
    assert!(
        agents.agents.iter().any(|a| a.agent_id == "declared-later"),
        "{:?}",
        agents.agents
    );

    // A message for a Grid program with no socket is appended to the scratchpad now set.
    let http = common::grid::GridHttp::new(grid);
    http.poll("agent=absent").await;
    let sent = http
        .send("message: { id: pad-1, type: request, sender: { agent: planner }, receiver: { agent: absent } }")
        .await;
    assert_eq!(sent, ["pad-1"]);
    eventually("the message is in the scratchpad", async || {
        std::fs::read_to_string(&pad).is_ok_and(|t| t.contains("pad-1"))
    })
    .await;
    bridge.shutdown().await;
}

/// With `[admin] token`, everything on the admin listener but `/healthz`, `/readyz` and
/// `/metrics` asks for it: as a bearer token, or through the console's sign-in.
#[tokio::test]
async fn the_admin_token_guards_all_but_the_probes_and_metrics() {
    let bridge =
        common::start_bridge("[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"adm1n\"\n").await;
    let admin = bridge.admin_addr().unwrap();
    let http = common::http();
    for open in ["/healthz", "/readyz", "/metrics"] {
        let status = http
            .get(format!("http://{admin}{open}"))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, 200, "{open}");
    }
    for guarded in ["/", "/admin/api/agents", "/admin/api/messages"] {
        let answer = http
            .get(format!("http://{admin}{guarded}"))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 401, "{guarded}");
        let with_token = http
            .get(format!("http://{admin}{guarded}"))
            .bearer_auth("adm1n")
            .send()
            .await
            .unwrap();
        assert_eq!(with_token.status(), 200, "{guarded}");
    }
    assert_eq!(reload(admin, None).await.0, 401);
    assert_eq!(reload(admin, Some("wrong")).await.0, 401);
    // A browser asking for the console is shown the sign-in page, then signs in.
    let page = http
        .get(format!("http://{admin}/"))
        .header("accept", "text/html")
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 401);
    assert!(page.text().await.unwrap().contains("action=\"/login\""));
    let no_redirects = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let signed_in = no_redirects
        .post(format!("http://{admin}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("token=adm1n")
        .send()
        .await
        .unwrap();
    assert_eq!(signed_in.status(), 303);
    let cookie = signed_in.headers()["set-cookie"].to_str().unwrap();
    assert!(
        !cookie.contains("adm1n"),
        "the cookie is not the token: {cookie}"
    );
    let session = cookie.split(';').next().unwrap().to_owned();
    let console = http
        .get(format!("http://{admin}/"))
        .header("cookie", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(console.status(), 200);
    assert!(console.text().await.unwrap().contains("trace-input"));
    let refused = no_redirects
        .post(format!("http://{admin}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("token=nope")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    bridge.shutdown().await;
}

/// The bridge as a process: SIGHUP reloads the file (the log level with it), SIGTERM
/// drains — WebSockets are closed with 1001 and the process exits within its drain time.
#[tokio::test]
async fn sighup_reloads_and_sigterm_drains() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bridge.toml");
    let data = dir.path().join("data");
    let text = bridge_toml(
        data.to_str().unwrap(),
        "[limits]\ndrain_timeout_ms = 2000\n",
    );
    std::fs::write(&path, &text).unwrap();
    let mut process = BridgeProcess::spawn(&path);
    let (tracker, skynet) = (process.addr("tracker"), process.addr("skynet"));

    // SIGHUP: a new member, and the log level down to warnings.
    std::fs::write(
        &path,
        text.replacen("[bridge]\n", "[bridge]\nlog_level = \"warn\"\n", 1) + NEW_MEMBER,
    )
    .unwrap();
    process.signal(libc::SIGHUP);
    let newbie = TrackerHttp::new(tracker, "tb-newbie");
    eventually("the member the reload added signs in", async || {
        newbie.get("/members").await.0 == 200
    })
    .await;
    // At `warn`, a refused reload is logged and an applied one (`info`) is not.
    std::fs::write(&path, "[routing]\nmailbox_capacity = 0\n").unwrap();
    process.signal(libc::SIGHUP);
    let refusal = process.next_log(WAIT, |line| {
        line["fields"]["message"] == "config not reloaded: the running config stays"
            || line["fields"]["message"] == "config reloaded"
    });
    let refusal = refusal.expect("the refused reload is logged");
    assert_eq!(refusal["level"], "WARN", "{refusal}");
    assert!(
        refusal["fields"]["error"]
            .as_str()
            .unwrap()
            .contains("routing.mailbox_capacity"),
        "{refusal}"
    );

    // SIGTERM: connected clients are told the server is going away, and it exits.
    let card = SkynetHttp::new(skynet).agent("leaving").await;
    let (mut sky, _) = SkynetWs::join(skynet, &card).await;
    let (mut member, _) = TrackerWs::auth(tracker, "tb-newbie").await;
    process.signal(libc::SIGTERM);
    for close in [sky.closed().await, member.closed().await] {
        let close = close.expect("a close frame");
        assert_eq!(u16::from(close.code), 1001, "{close:?}");
    }
    let status =
        (process.exited(Duration::from_secs(15))).expect("the bridge exits within its drain time");
    assert!(status.success(), "{status:?}");
}

/// In JSON logs at `debug`, a message's line carries its id and correlation id, so a log
/// search follows it.
#[tokio::test]
async fn json_log_lines_carry_the_message_and_correlation_ids() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bridge.toml");
    let data = dir.path().join("data");
    let text = bridge_toml(data.to_str().unwrap(), "").replacen(
        "[bridge]\n",
        "[bridge]\nlog_level = \"info,agentbridge::core=debug\"\n",
        1,
    );
    std::fs::write(&path, text).unwrap();
    let process = BridgeProcess::spawn(&path);
    let (ws, ok) = TrackerWs::auth(process.addr("tracker"), "tb-quiet").await;
    ws.close().await;
    let lobby = ok["lobby_chat_id"].clone();
    let tracker = TrackerHttp::new(process.addr("tracker"), "tb-admin");
    let first = tracker
        .message(json!({ "chat_id": lobby, "content": "first" }))
        .await;
    let first_id = first["id"].as_str().unwrap().to_owned();
    let reply = tracker
        .message(json!({ "chat_id": lobby, "content": "a reply", "reply_to": first_id }))
        .await;
    let reply_id = reply["id"].as_str().unwrap().to_owned();
    let line = process
        .next_log(WAIT, |line| {
            line["fields"]["message"] == "routed"
                && line["fields"]["correlation_id"]
                    .as_str()
                    .is_some_and(|c| !c.is_empty())
        })
        .expect("a routed line with a correlation id");
    let fields = &line["fields"];
    assert!(
        [&first_id, &reply_id].iter().any(|id| fields["message_id"]
            .as_str()
            .is_some_and(|m| agentbridge::core::uuid_form(m) == **id || m == id.as_str())),
        "{line}"
    );
    assert_eq!(fields["protocol"], "tracker", "{line}");
}
