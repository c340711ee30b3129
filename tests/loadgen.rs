//! The load generator measures what it claims to: every path it offers delivers each
//! message it sends, through a bridge it starts itself (a child process, store in memory).
//! The benchmark numbers come from these same senders and receivers.

mod common;

use std::time::Duration;

use serde_json::Value;

const LOADGEN: &str = env!("CARGO_BIN_EXE_loadgen");

/// Runs `loadgen run` over `paths` with a small count and returns its rows (`--json`).
fn run(paths: &[&str], count: u64) -> Vec<Value> {
    run_with_baseline(paths, "none", count)
}

fn run_with_baseline(paths: &[&str], baseline: &str, count: u64) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rows.json");
    let count = count.to_string();
    let mut args = vec![
        "run",
        "--baseline",
        baseline,
        "--memory",
        "--pairs",
        "2",
        "--window",
        "8",
        "--count",
        &count,
        "--duration",
        "60",
    ];
    for path in paths {
        args.extend(["--path", path]);
    }
    args.extend(["--json", json.to_str().unwrap()]);
    let (code, out, err) = common::process::run_program(LOADGEN, &args, Duration::from_secs(180));
    assert_eq!(code, 0, "loadgen failed:\n{out}\n{err}");
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

/// Each row sent at least `count` messages, without an error, and delivered each.
fn every_message_delivered(rows: &[Value], count: u64) {
    for row in rows {
        let path = row["path"].as_str().unwrap();
        assert_eq!(row["send_errors"], 0, "{path}: {row:#}");
        assert_eq!(row["lost"], 0, "{path}: {row:#}");
        assert!(row["sent"].as_u64().unwrap() >= count, "{path}: {row:#}");
        assert_eq!(row["delivered"], row["sent"], "{path}: {row:#}");
    }
}

/// The federation measurement: paths across two bridges of a fleet, and the JetStream
/// baseline, on a NATS server loadgen starts, deliver every message they send.
#[test]
fn fleet_paths_and_the_jetstream_baseline_deliver_every_message_they_send() {
    // Installed where loadgen looks for it (`target/test-tools`), if it is not yet.
    common::nats::server_binary();
    let paths = [
        "skynet@a:skynet@b",
        "tracker@a:synapse@b",
        "grid@a:skynet@b",
    ];
    let rows = run_with_baseline(&paths, "jetstream", 400);
    let named: Vec<&str> = rows.iter().filter_map(|r| r["path"].as_str()).collect();
    assert!(named.iter().any(|p| p.starts_with("stream")), "{named:?}");
    assert_eq!(rows.len(), paths.len() + 1, "{rows:#?}");
    every_message_delivered(&rows, 400);
}

#[test]
fn request_senders_deliver_every_message_they_send() {
    let paths = [
        "tracker/http:skynet",
        "grid/http:skynet",
        "synapse/http:skynet",
        "synapse/unary:skynet",
        "skynet:grid",
    ];
    let rows = run(&paths, 400);
    assert_eq!(rows.len(), paths.len(), "{rows:#?}");
    every_message_delivered(&rows, 400);
}
