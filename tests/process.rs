//! The `agentbridge` binary itself: its command line, start-up failures, and a store that
//! survives `kill -9`.

mod common;

use std::io::Write;

use common::peers::grid_message;
use common::process::{BridgeProcess, run};
use common::skynet::{SkynetHttp, SkynetWs, text_of};
use serde_json::json;

/// The config of a bridge with every endpoint and its store in `dir`, `extra`'s sections
/// replacing the defaults.
fn config_on_disk(dir: &std::path::Path, extra: &str) -> std::path::PathBuf {
    let data = dir.join("data");
    config_file(dir, &common::bridge_toml(data.to_str().unwrap(), extra))
}

/// Posts `count` Grid messages (`message(i)`), `in_flight` at once, each accepted (202).
async fn flood(
    grid: &common::grid::GridHttp,
    count: usize,
    in_flight: usize,
    message: impl Fn(usize) -> String,
) {
    use futures_util::StreamExt;
    let sent = futures_util::stream::iter(0..count)
        .map(|i| {
            let body = message(i);
            async move { grid.post(&body).await }
        })
        .buffer_unordered(in_flight)
        .collect::<Vec<_>>()
        .await;
    for (status, answer) in sent {
        assert_eq!(status, 202, "{answer}");
    }
}

fn config_file(dir: &std::path::Path, text: &str) -> std::path::PathBuf {
    let path = dir.join("bridge.toml");
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(text.as_bytes()).unwrap();
    path
}

#[test]
fn help_is_available_everywhere() {
    for args in [&["--help"][..], &["run", "--help"], &["check", "--help"]] {
        let (code, out, _) = run(args);
        assert_eq!(code, 0, "{args:?}");
        assert!(out.contains("--config"), "{args:?}: {out}");
    }
    let (_, out, _) = run(&["--help"]);
    assert!(out.contains("run") && out.contains("check"), "{out}");
}

#[test]
fn check_prints_the_listeners_of_the_bundled_config() {
    let bundled = concat!(env!("CARGO_MANIFEST_DIR"), "/bridge.toml");
    let dir = tempfile::tempdir().unwrap();
    // The bundled config with its data dir moved out of the source tree.
    let text = std::fs::read_to_string(bundled).unwrap().replace(
        "data_dir = \"./data\"",
        &format!("data_dir = {:?}", dir.path().join("data")),
    );
    let path = config_file(dir.path(), &text);
    let (code, out, err) = run(&["check", "--config", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("skynet") && out.contains("127.0.0.1:4117"),
        "{out}"
    );
    assert!(
        out.contains("admin") && out.contains("127.0.0.1:9464"),
        "{out}"
    );
}

#[test]
fn bad_configs_fail_with_one_line_naming_file_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = config_file(
        dir.path(),
        "[skynet]\nlisten = \"127.0.0.1:0\"\nrecent_mentions = 5\n",
    );
    let shown = path.display().to_string();
    for command in ["check", "run"] {
        let (code, _, err) = run(&[command, "--config", &shown]);
        assert_ne!(code, 0);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(
            err.contains(&format!("{shown}:3: skynet.recent_mentions: unknown field")),
            "{err}"
        );
    }
    let (code, _, err) = run(&["check", "--config", "/nonexistent/bridge.toml"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent/bridge.toml"), "{err}");
}

#[test]
fn start_up_failures_name_their_cause() {
    let dir = tempfile::tempdir().unwrap();
    // A port already in use.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let path = config_file(
        dir.path(),
        &format!("[bridge]\ndata_dir = \":memory:\"\n[skynet]\nlisten = \"127.0.0.1:{port}\"\n"),
    );
    let (code, _, err) = run(&["run", "--config", path.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(
        err.contains(&format!("skynet: cannot listen on 127.0.0.1:{port}")),
        "{err}"
    );

    // A data dir that cannot be created.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let bad_dir = file.join("data");
    let path = config_file(
        dir.path(),
        &format!("[bridge]\ndata_dir = {:?}\n", bad_dir.display().to_string()),
    );
    for command in ["check", "run"] {
        let (code, _, err) = run(&[command, "--config", path.to_str().unwrap()]);
        assert_ne!(code, 0, "{command}");
        assert!(
            err.contains(&bad_dir.display().to_string()),
            "{command}: {err}"
        );
    }
}

#[tokio::test]
async fn accepted_messages_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_file(
        dir.path(),
        &format!(
            "[bridge]\ndata_dir = {:?}\n[admin]\nlisten = \"127.0.0.1:0\"\n[skynet]\nlisten = \"127.0.0.1:0\"\n",
            dir.path().join("data").display().to_string()
        ),
    );
    let (a, b);
    {
        let process = BridgeProcess::spawn(&config);
        let addr = process.addr("skynet");
        let http = SkynetHttp::new(addr);
        a = http.agent("a").await;
        b = http.agent("b").await;
        let (mut ws_a, _) = SkynetWs::join(addr, &a).await;
        // The echo comes back only after the message is stored.
        for i in 1..=20 {
            ws_a.chat(&format!("@b accepted {i}")).await;
        }
        process.kill_9();
    }
    let process = BridgeProcess::spawn(&config);
    let addr = process.addr("skynet");
    let http = SkynetHttp::new(addr);
    let (_, history) = http.get("/api/messages").await;
    let texts: Vec<&str> = history
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["type"] == "chat")
        .map(text_of)
        .collect();
    let expected: Vec<String> = (1..=20).map(|i| format!("@b accepted {i}")).collect();
    assert_eq!(texts, expected);
    let (_ws_b, state) = SkynetWs::join(addr, &b).await;
    let replay: Vec<&str> = state["recentMessages"]
        .as_array()
        .unwrap()
        .iter()
        .map(text_of)
        .collect();
    assert_eq!(
        replay,
        ["@b accepted 18", "@b accepted 19", "@b accepted 20"]
    );
    assert_eq!(http.get("/api/agents/a").await.1["id"], json!(a["id"]));
    process.kill_9();
}

/// Tasks assigned to a Tracker member from another protocol as fast as they are accepted,
/// the bridge killed right after the last acknowledgement: restarted, the Tracker has every
/// one of them once, those its hub had not yet made into tasks included.
#[tokio::test]
async fn task_assignments_accepted_before_kill_9_are_all_tasks_after_a_restart() {
    use common::grid::GridHttp;
    const TASKS: usize = 600;
    let dir = tempfile::tempdir().unwrap();
    let config = config_on_disk(dir.path(), "");
    {
        let process = BridgeProcess::spawn(&config);
        let grid = GridHttp::new(process.addr("grid"));
        let assignment = |i: usize| {
            let payload = json!({ "task_id": format!("job-{i}"), "title": format!("job {i}") });
            let id = format!("assign-{i}");
            grid_message(
                &id,
                "request",
                "planner",
                "coder",
                "mission_assigned",
                payload,
                None,
            )
        };
        flood(&grid, TASKS, 16, assignment).await;
        process.kill_9();
    }
    let process = BridgeProcess::spawn(&config);
    let tracker = common::tracker::TrackerHttp::new(process.addr("tracker"), "tb-admin");
    let mut titles = Vec::new();
    let deadline = std::time::Instant::now() + common::WAIT;
    while titles.len() < TASKS && std::time::Instant::now() < deadline {
        let (status, tasks) = tracker.get("/tasks?assignee=coder").await;
        assert_eq!(status, 200, "{tasks}");
        titles = (tasks.as_array().into_iter().flatten())
            .filter_map(|t| t["title"].as_str().map(str::to_owned))
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    titles.sort();
    let mut expected: Vec<String> = (0..TASKS).map(|i| format!("job {i}")).collect();
    expected.sort();
    assert_eq!(
        titles.len(),
        TASKS,
        "missing: {:?}",
        expected
            .iter()
            .filter(|t| !titles.contains(t))
            .take(20)
            .collect::<Vec<_>>()
    );
    assert_eq!(titles, expected);
    process.kill_9();
}

/// Progress and results for Synapse tasks sent as fast as they are accepted, the bridge
/// killed right after the last acknowledgement: restarted, every task is completed, those
/// whose result its hub had not yet applied included.
#[tokio::test]
async fn task_results_accepted_before_kill_9_complete_their_tasks_after_a_restart() {
    use agentbridge::protocols::synapse::proto::{GetTaskRequest, SubmitTaskRequest, TaskStatus};
    use common::synapse::{Stream, clients, send, status_update, task_complete};
    use futures_util::StreamExt;
    const TASKS: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let config = config_on_disk(dir.path(), "");
    let mut ids = Vec::new();
    {
        let process = BridgeProcess::spawn(&config);
        let addr = process.addr("synapse");
        let _worker = Stream::open(addr, "worker").await;
        let mut c = clients(addr).await;
        for i in 0..TASKS {
            let submitted = c
                .tasks
                .submit_task(SubmitTaskRequest {
                    task_type: "worker".into(),
                    external_task_id: format!("ext-{i}"),
                    ..Default::default()
                })
                .await
                .expect("the task is taken")
                .into_inner();
            ids.push(submitted.task_id);
        }
        // Progress, then the result, for each task: the result lands after the progress,
        // however far behind the hub is.
        let sent = futures_util::stream::iter(ids.clone())
            .map(|id| {
                let mut c = c.clone();
                async move {
                    let half = status_update(
                        "worker",
                        "agentbridge",
                        &id,
                        TaskStatus::Processing,
                        50,
                        "half",
                    );
                    send(&mut c, half).await?;
                    send(
                        &mut c,
                        task_complete("worker", "agentbridge", &id, "done", ""),
                    )
                    .await
                }
            })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await;
        for result in sent {
            result.expect("the result is accepted");
        }
        process.kill_9();
    }
    let process = BridgeProcess::spawn(&config);
    let mut c = clients(process.addr("synapse")).await;
    let mut open = ids.clone();
    let deadline = std::time::Instant::now() + common::WAIT;
    while !open.is_empty() && std::time::Instant::now() < deadline {
        let mut still = Vec::new();
        for id in open {
            let task = c
                .tasks
                .get_task(GetTaskRequest {
                    task_id: id.clone(),
                })
                .await;
            let status = task
                .ok()
                .and_then(|t| t.into_inner().task)
                .map(|t| t.status);
            if status != Some(TaskStatus::Completed as i32) {
                still.push(id);
            }
        }
        open = still;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        open.is_empty(),
        "{} of {TASKS} tasks not completed",
        open.len()
    );
    process.kill_9();
}

/// Messages to a Grid program away sent as fast as they are accepted, the bridge killed
/// right after the last acknowledgement, or stopped: restarted, the program polls every
/// one of them once, those the queue writer had not yet kept included.
#[tokio::test]
async fn mail_for_a_program_away_accepted_before_kill_9_or_a_stop_is_kept() {
    for stop in [libc::SIGKILL, libc::SIGTERM] {
        let (polled, scratchpad) = mail_for_a_program_away_across_a_restart(stop, 1000).await;
        let expected: std::collections::BTreeSet<String> =
            (0..1000).map(|i| format!("m-{i}")).collect();
        assert_eq!(
            polled.len(),
            expected.len(),
            "signal {stop}: polled {}",
            polled.len()
        );
        let polled: std::collections::BTreeSet<String> = polled.into_iter().collect();
        assert_eq!(polled, expected, "signal {stop}");
        // Each appended to the scratchpad once, those routed again included.
        let entries: Vec<&str> = (scratchpad.lines())
            .filter_map(|line| line.trim().strip_prefix("id: "))
            .collect();
        let distinct: std::collections::BTreeSet<String> =
            entries.iter().map(|id| id.to_string()).collect();
        assert_eq!(distinct, expected, "signal {stop}: the scratchpad");
        assert_eq!(entries.len(), expected.len(), "signal {stop}: once each");
    }
}

/// Sends `count` messages to the declared Grid program `absent`, ends the bridge with
/// `signal`, starts it again and polls everything `absent` is given; with the scratchpad
/// as it is then.
async fn mail_for_a_program_away_across_a_restart(
    signal: i32,
    count: usize,
) -> (Vec<String>, String) {
    use common::grid::GridHttp;
    let dir = tempfile::tempdir().unwrap();
    let pad = dir.path().join("SCRATCHPAD.md");
    let grid = format!(
        "[grid]\nlisten = \"127.0.0.1:0\"\nscratchpad = {:?}\nprograms = [\"absent\"]\n",
        pad.display().to_string()
    );
    let config = config_on_disk(dir.path(), &grid);
    {
        let mut process = BridgeProcess::spawn(&config);
        let http = GridHttp::new(process.addr("grid"));
        let note = |i: usize| {
            let id = format!("m-{i}");
            grid_message(
                &id,
                "notification",
                "sender",
                "absent",
                "note",
                json!({ "n": i }),
                None,
            )
        };
        flood(&http, count, 32, note).await;
        process.signal(signal);
        assert!(
            process.exited(common::WAIT).is_some(),
            "the bridge ends on signal {signal}"
        );
    }
    let process = BridgeProcess::spawn(&config);
    let http = GridHttp::new(process.addr("grid"));
    let mut polled = Vec::new();
    // Polled until nothing more waits.
    for _ in 0..100 {
        let got = http.poll("agent=absent").await;
        if got.is_empty() {
            break;
        }
        polled.extend(
            got.iter()
                .filter_map(|m| m["id"].as_str().map(str::to_owned)),
        );
    }
    // The poll waited for the queue writer, which appends before it queues.
    let scratchpad = std::fs::read_to_string(&pad).unwrap_or_default();
    process.kill_9();
    (polled, scratchpad)
}

/// Messages to a Synapse agent away sent as fast as they are accepted, the bridge killed
/// right after the last acknowledgement: restarted, the agent fetches from its inbox every
/// one of them once, those the inbox writer had not yet kept included.
#[tokio::test]
async fn mail_for_a_synapse_agent_away_accepted_before_kill_9_is_kept() {
    use common::synapse::{Stream, chat, clients, send, text_of, with_meta};
    use futures_util::StreamExt;
    const COUNT: usize = 500;
    let dir = tempfile::tempdir().unwrap();
    let config = config_on_disk(dir.path(), "");
    {
        let process = BridgeProcess::spawn(&config);
        let addr = process.addr("synapse");
        // Known, then away: its mail goes to its inbox.
        drop(Stream::open(addr, "inboxer").await);
        let c = clients(addr).await;
        let sent = futures_util::stream::iter(0..COUNT)
            .map(|i| {
                let mut c = c.clone();
                async move { send(&mut c, chat("writer", "inboxer", &format!("n{i}"))).await }
            })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await;
        for result in sent {
            result.expect("the message is accepted");
        }
        process.kill_9();
    }
    let process = BridgeProcess::spawn(&config);
    let mut poller = clients(process.addr("synapse")).await;
    let request = with_meta((), &[("x-synapse-agent-id", "inboxer")]);
    let mut inbound = (poller.messages.receive_callback(request).await)
        .expect("the inbox answers")
        .into_inner();
    let mut texts = Vec::new();
    while let Ok(Some(Ok(message))) = tokio::time::timeout(common::WAIT, inbound.next()).await {
        texts.push(text_of(&message));
    }
    let expected: std::collections::BTreeSet<String> =
        (0..COUNT).map(|i| format!("n{i}")).collect();
    assert_eq!(texts.len(), COUNT, "fetched {}", texts.len());
    let texts: std::collections::BTreeSet<String> = texts.into_iter().collect();
    assert_eq!(texts, expected);
    process.kill_9();
}

/// A Grid program reading slowly (a narrow socket, not read) and one reading as it is sent
/// to are sent the same broadcasts, of 16 KiB, more than the slow one's socket holds. The
/// bridge, alone, is killed once the prompt one read them all: started again, it routes
/// again what its killed run had not written to the slow one to that one only (the agents
/// it kept each message pending for, `store::redelivery`), and the prompt one gets none of
/// them twice.
#[tokio::test]
async fn a_broadcast_a_slow_program_held_back_is_routed_again_after_kill_9_to_it_only() {
    broadcasts_held_back_across_a_restart(libc::SIGKILL).await;
}

/// As `a_broadcast_a_slow_program_held_back_is_routed_again_after_kill_9_to_it_only`, the
/// bridge stopped: the copies its stop drops unwritten leave their messages pending for
/// the slow program still.
#[tokio::test]
async fn a_broadcast_a_slow_program_held_back_is_routed_again_after_a_stop_to_it_only() {
    broadcasts_held_back_across_a_restart(libc::SIGTERM).await;
}

/// Sends broadcasts to a slow program and a prompt one, ends the bridge with `signal` once
/// the prompt one read them all, starts it again, and reads both programs' mail: the slow
/// one gets everything, the prompt one nothing twice.
async fn broadcasts_held_back_across_a_restart(signal: i32) {
    use common::grid::{GridHttp, GridWs, numbered, read_until_got};
    const SENT: usize = 300;
    const LAST: usize = 9_999;
    let dir = tempfile::tempdir().unwrap();
    let config = config_on_disk(dir.path(), "");
    let mut process = BridgeProcess::spawn(&config);
    let grid = process.addr("grid");
    let http = GridHttp::new(grid);
    let mut slow = GridWs::quiet_narrow(grid, "stayer").await;
    let mut prompt = GridWs::quiet(grid, "prompt", None).await;
    let online = async || {
        let (_, listed) = http.get("/agents").await;
        let online = |name: &str| {
            (listed["agents"].as_array().into_iter().flatten())
                .any(|a| a["agent"] == name && a["online"] == true)
        };
        online("stayer") && online("prompt")
    };
    common::eventually("both programs online", online).await;
    let pad = "x".repeat(16 << 10);
    let broadcast = |n: usize| {
        let id = format!("m{n}");
        let text = json!({ "text": pad });
        grid_message(
            &id,
            "notification",
            "neighbour",
            "broadcast",
            "note",
            text,
            None,
        )
    };
    let (mut got_by_prompt, everything) = (Vec::new(), (0..SENT).collect());
    tokio::join!(
        flood(&http, SENT, 8, broadcast),
        read_until_got(
            &mut prompt,
            (grid, "prompt"),
            &mut got_by_prompt,
            &everything
        ),
    );
    // Ended well after the prompt program read its last broadcast: what was done with in
    // the last 200 ms before a kill is routed again (the bridge keeps what is pending that
    // often).
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    process.signal(signal);
    let mut got: Vec<usize> = (slow.read_until_closed().await.iter())
        .filter_map(numbered)
        .collect();
    got_by_prompt.extend(prompt.read_until_closed().await.iter().filter_map(numbered));
    assert!(process.exited(common::WAIT).is_some(), "the bridge ends");
    assert!(
        got.len() < SENT,
        "the slow program was written everything already"
    );

    let process = BridgeProcess::spawn(&config);
    let grid = process.addr("grid");
    let mut slow = GridWs::connect_once_free(grid, "stayer").await;
    read_until_got(&mut slow, (grid, "stayer"), &mut got, &everything).await;
    let missing: Vec<usize> = (0..SENT).filter(|n| !got.contains(n)).collect();
    assert!(missing.is_empty(), "the slow program missed {missing:?}");
    // A last note, read after whatever was kept for the prompt program.
    let mut prompt = GridWs::connect_once_free(grid, "prompt").await;
    let last = format!("m{LAST}");
    let last = grid_message(
        &last,
        "notification",
        "neighbour",
        "prompt",
        "note",
        json!({}),
        None,
    );
    GridHttp::new(grid).send(&last).await;
    read_until_got(
        &mut prompt,
        (grid, "prompt"),
        &mut got_by_prompt,
        &[LAST].into(),
    )
    .await;
    assert!(got_by_prompt.contains(&LAST), "the last note came");
    let twice = common::grid::got_twice(&got_by_prompt);
    assert!(twice.is_empty(), "the prompt program got {twice:?} twice");
    process.kill_9();
}
