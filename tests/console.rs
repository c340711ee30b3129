//! Seeing the traffic: the admin listener's API, `agentbridge trace` and `top`, and the
//! console in a real browser (headless Chromium) — against a bridge process carrying a
//! conversation that crosses from Skynet to the Tracker.

mod common;

use std::path::Path;
use std::process::Command;

use common::process::{BIN, BridgeProcess};
use common::skynet::{SkynetHttp, SkynetWs};
use common::tracker::{TrackerHttp, TrackerWs};
use serde_json::{Value, json};

/// A bridge process carrying a conversation (`bridge_with_a_conversation`).
struct Conversation {
    /// The config file's path.
    config: std::path::PathBuf,
    process: BridgeProcess,
    /// The answer's id, and the Tracker chat it is in.
    answer: String,
    chat: Value,
}

/// A bridge process with a two-hop conversation: Skynet agent `sky` asks Tracker member
/// `coder` (`trace-1`), who answers it over REST.
async fn bridge_with_a_conversation(dir: &Path) -> Conversation {
    let path = dir.join("bridge.toml");
    let data = dir.join("data");
    std::fs::write(&path, common::bridge_toml(data.to_str().unwrap(), "")).unwrap();
    let process = BridgeProcess::spawn(&path);
    let (skynet, tracker) = (process.addr("skynet"), process.addr("tracker"));
    let (mut coder, _) = TrackerWs::auth(tracker, "tb-coder").await;
    let card = SkynetHttp::new(skynet).agent("sky").await;
    let (mut sky, _) = SkynetWs::join(skynet, &card).await;
    let members = SkynetHttp::new(skynet).get("/api/members").await.1;
    let coder_card = (members.as_array().unwrap().iter())
        .find(|m| m["name"] == "coder")
        .expect("Skynet lists the Tracker member")["id"]
        .clone();
    let asked = json!({
        "id": "trace-1", "type": "chat", "payload": { "text": "@coder please look" },
        "mentions": [coder_card],
    });
    sky.action("send", asked).await;
    let question = coder.next_of("message.new").await;
    let answer = TrackerHttp::new(tracker, "tb-coder")
        .message(json!({
            "chat_id": question["chat_id"], "content": "done",
            "reply_to": question["id"],
        }))
        .await;
    Conversation {
        config: path,
        process,
        answer: answer["id"].as_str().unwrap().to_owned(),
        chat: question["chat_id"].clone(),
    }
}

/// Runs the binary to completion: whether it succeeded, stdout, stderr.
fn agentbridge(args: &[&str]) -> (bool, String, String) {
    let (code, out, err) = common::process::run(args);
    (code == 0, out, err)
}

/// `trace` shows the whole conversation from any hop's id in any protocol's form;
/// `top` shows the rates between protocols.
#[tokio::test]
async fn trace_follows_a_conversation_across_protocols_and_top_shows_the_rates() {
    let dir = tempfile::tempdir().unwrap();
    let Conversation {
        config,
        process,
        answer,
        ..
    } = bridge_with_a_conversation(dir.path()).await;
    let config = config.to_str().unwrap();
    let admin = format!("http://{}", process.addr("admin"));
    let agentbridge = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--config", config, "--admin", admin.as_str()]);
        agentbridge(&all)
    };
    let uuid = agentbridge::core::uuid_form("trace-1");
    for asked in ["trace-1", uuid.as_str(), answer.as_str()] {
        let (ok, out, err) = agentbridge(&["trace", asked, "--json"]);
        assert!(ok, "trace {asked}: {err}");
        let trace: Value = serde_json::from_str(&out).expect("trace --json prints JSON");
        assert_eq!(trace["correlation_id"], "trace-1", "{trace}");
        let hops: Vec<(&str, &str)> = (trace["messages"].as_array().unwrap().iter())
            .map(|m| (m["protocol"].as_str().unwrap(), m["from"].as_str().unwrap()))
            .collect();
        assert_eq!(hops, [("skynet", "sky"), ("tracker", "coder")], "{trace}");
    }
    let (ok, out, _) = agentbridge(&["trace", "trace-1"]);
    assert!(ok);
    assert!(
        out.starts_with("conversation trace-1 (2 messages)"),
        "{out}"
    );
    assert!(
        out.contains("sky → coder") && out.contains("coder → sky"),
        "{out}"
    );
    let (ok, _, err) = agentbridge(&["trace", "no-such-id"]);
    assert!(!ok && err.contains("no message has id no-such-id"), "{err}");

    let (ok, out, err) = agentbridge(&["top", "--once", "--interval", "0.3"]);
    assert!(ok, "{err}");
    assert!(out.contains("skynet → tracker"), "{out}");
    assert!(
        out.contains("busiest senders") && out.contains("sky"),
        "{out}"
    );
    drop(process);
}

/// `trace --follow --json` prints the hops there are, then each new one as it arrives.
#[tokio::test]
async fn trace_follow_prints_each_new_hop_as_it_arrives() {
    let dir = tempfile::tempdir().unwrap();
    let Conversation {
        config,
        process,
        answer,
        chat,
    } = bridge_with_a_conversation(dir.path()).await;
    let admin = format!("http://{}", process.addr("admin"));
    let mut follow = Command::new(BIN)
        .args([
            "trace", "trace-1", "--follow", "--json", "--admin", &admin, "--config",
        ])
        .arg(&config)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("agentbridge trace runs");
    let stdout = follow.stdout.take().unwrap();
    let (tx, hops) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let next_hop = || -> Value {
        let line = (hops.recv_timeout(std::time::Duration::from_secs(15)))
            .expect("trace --follow prints a hop");
        serde_json::from_str(&line).expect("one JSON object a hop")
    };
    assert_eq!(next_hop()["from"], "sky");
    assert_eq!(next_hop()["from"], "coder");

    // A third hop, a while later: printed when it arrives, and only it.
    TrackerHttp::new(process.addr("tracker"), "tb-coder")
        .message(json!({ "chat_id": chat, "content": "one more thing", "reply_to": answer }))
        .await;
    let third = next_hop();
    assert_eq!(
        (&third["from"], &third["text"], &third["reply_to"]),
        (&json!("coder"), &json!("one more thing"), &json!(answer)),
        "{third}"
    );
    let _ = follow.kill();
    let _ = follow.wait();
    drop(process);
}

/// The console, loaded in headless Chromium from the bridge's admin listener: the agents,
/// the rates between protocols, the recent messages, and a conversation traced from the
/// page's address.
#[tokio::test]
async fn the_console_shows_agents_traffic_and_a_traced_conversation_in_a_browser() {
    let chromium = common::tools::debian_binary("chromium", "chromium");
    let dir = tempfile::tempdir().unwrap();
    let Conversation {
        process, answer, ..
    } = bridge_with_a_conversation(dir.path()).await;
    let url = format!("http://{}/#trace=trace-1", process.addr("admin"));
    let profile = tempfile::tempdir().unwrap();
    let browse = |extra: &[&str]| {
        Command::new(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--virtual-time-budget=6000",
                "--window-size=1400,1000",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(extra)
            .arg(&url)
            .output()
            .expect("chromium runs")
    };
    let dom = String::from_utf8_lossy(&browse(&["--dump-dom"]).stdout).into_owned();
    let expected = [
        "data-agent=\"sky\"",
        "data-agent=\"coder\"",
        "data-from=\"skynet\"",
        "data-message-id=\"trace-1\"",
        &format!("data-message-id=\"{answer}\""),
    ];
    let missing: Vec<&&str> = expected.iter().filter(|e| !dom.contains(**e)).collect();
    let hops = dom.matches("class=\"hop").count();
    if !missing.is_empty() || hops < 2 {
        let shot = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-output/console.png");
        std::fs::create_dir_all(shot.parent().unwrap()).unwrap();
        browse(&[&format!("--screenshot={}", shot.display())]);
        panic!(
            "the console lacks {missing:?} ({hops} hops drawn); screenshot: {}\n{dom}",
            shot.display()
        );
    }
    drop(process);
}
