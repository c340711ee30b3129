//! The deploy artefacts under `deploy/`: the Grafana dashboard and the Prometheus alerts
//! query only metrics a real bridge exports, promtool accepts the bridge's scrape and the
//! alert rules (with their unit tests), and the Kubernetes manifests validate against the
//! Kubernetes schemas. The image itself is checked by `deploy/check.sh` (podman, root).

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::bridge_toml;
use common::fleet::{QUICK, SET_UP_WAIT, federation_section};
use common::nats::Cluster;
use common::process::BridgeProcess;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn deploy(path: &str) -> PathBuf {
    repo().join("deploy").join(path)
}

/// The files whose queries must name exported metrics only.
const QUERYING: [&str; 2] = ["grafana/agentbridge.json", "prometheus/alerts.yml"];

/// Every `agentbridge_…` identifier in `text` (a metric name, or a histogram's
/// `_bucket` / `_sum` / `_count` series).
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("agentbridge_") {
        let glued = rest[..at]
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_');
        let tail = &rest[at..];
        let len = tail
            .bytes()
            .take_while(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_')
            .count();
        if !glued {
            names.insert(tail[..len].trim_end_matches('_').to_owned());
        }
        rest = &tail[len..];
    }
    names
}

/// The names a scrape answers to: each family named by a `# TYPE` line (with a
/// histogram's `_bucket`, `_sum` and `_count`, a summary's `_sum` and `_count`), and
/// each sample's name.
fn exported_names(scrape: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in scrape.lines() {
        if let Some(family) = line.strip_prefix("# TYPE ") {
            let mut words = family.split_whitespace();
            let (Some(name), Some(kind)) = (words.next(), words.next()) else {
                continue;
            };
            names.insert(name.to_owned());
            let suffixes: &[&str] = match kind {
                "histogram" => &["_bucket", "_sum", "_count"],
                "summary" => &["_sum", "_count"],
                _ => &[],
            };
            for suffix in suffixes {
                names.insert(format!("{name}{suffix}"));
            }
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            names.insert(name.to_owned());
        }
    }
    names
}

/// Every metric name the dashboard and the alerts query.
fn queried_names() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for file in QUERYING {
        let text =
            std::fs::read_to_string(deploy(file)).unwrap_or_else(|e| panic!("deploy/{file}: {e}"));
        let found = metric_names(&text);
        assert!(
            !found.is_empty(),
            "deploy/{file} queries no agentbridge metric"
        );
        names.extend(found);
    }
    names
}

/// Runs `program` with `args` from the repository root, `input` on its stdin. A missing
/// program fails the test saying how to install it.
fn run_tool(program: &str, args: &[&str], input: Option<&str>, install: &str) -> Output {
    let mut command = Command::new(program);
    command
        .args(args)
        .current_dir(repo())
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!("{program} is not installed: {install} (`.ci/run` installs it)")
        }
        Err(e) => panic!("cannot run {program}: {e}"),
    };
    if let Some(input) = input {
        let mut stdin = child.stdin.take().expect("stdin is piped");
        stdin
            .write_all(input.as_bytes())
            .expect("the program reads its input");
    }
    child.wait_with_output().expect("the program runs")
}

fn promtool(args: &[&str], input: Option<&str>) -> Output {
    let promtool = common::tools::debian_binary("prometheus", "promtool");
    run_tool(
        promtool.to_str().expect("a UTF-8 path"),
        args,
        input,
        "apt-get install prometheus",
    )
}

fn assert_success(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A scrape of a real, federated bridge (the `agentbridge` binary on a one-server NATS
/// cluster, every endpoint configured), taken once it exports every name in `wanted` or
/// after `SET_UP_WAIT`, whichever is first.
async fn scrape_of_a_federated_bridge(wanted: &BTreeSet<String>) -> String {
    let cluster = Cluster::start(1).await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let config = dir.path().join("bridge.toml");
    let data = dir.path().join("data");
    std::fs::write(
        &config,
        bridge_toml(
            data.to_str().expect("a UTF-8 temp path"),
            &federation_section(&cluster.toml_list(), "deploytest", "d0", QUICK),
        ),
    )
    .expect("the config is written");
    let process = BridgeProcess::spawn(&config);
    let metrics = format!("http://{}/metrics", process.addr("admin"));
    let deadline = Instant::now() + SET_UP_WAIT;
    loop {
        let scrape = match common::http().get(&metrics).send().await {
            Ok(answer) if answer.status().is_success() => answer.text().await.unwrap_or_default(),
            _ => String::new(),
        };
        let exported = exported_names(&scrape);
        if wanted.is_subset(&exported) || Instant::now() >= deadline {
            drop(process);
            drop(cluster);
            return scrape;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn metric_names_are_found_in_queries() {
    let names = metric_names(
        r#"histogram_quantile(0.99, sum by (le) (rate(agentbridge_route_duration_seconds_bucket{job="agentbridge"}[5m]))) / agentbridge_up_ x_agentbridge_no"#,
    );
    let expected: BTreeSet<String> = [
        "agentbridge_route_duration_seconds_bucket",
        "agentbridge_up",
    ]
    .map(String::from)
    .into();
    assert_eq!(names, expected);
    let exported = exported_names(
        "# TYPE agentbridge_route_duration_seconds histogram\nagentbridge_route_duration_seconds_bucket{le=\"+Inf\"} 0\n# TYPE agentbridge_connections gauge\nagentbridge_connections{protocol=\"grid\"} 0\n",
    );
    assert!(exported.contains("agentbridge_route_duration_seconds_count"));
    assert!(exported.contains("agentbridge_route_duration_seconds"));
    assert!(exported.contains("agentbridge_connections"));
    assert!(!exported.contains("agentbridge_connections_count"));
}

/// No panel and no alert on a name the bridge does not export, and promtool's linter
/// accepts what it exports.
#[tokio::test]
async fn the_dashboard_and_alerts_query_only_what_a_real_scrape_holds() {
    let queried = queried_names();
    let scrape = scrape_of_a_federated_bridge(&queried).await;
    let exported = exported_names(&scrape);
    let missing: Vec<&String> = queried.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "deploy/grafana/agentbridge.json or deploy/prometheus/alerts.yml query metrics a \
         federated bridge does not export: {missing:?}\n--- its scrape:\n{scrape}"
    );

    let out = promtool(&["check", "metrics"], Some(scrape.as_str()));
    assert_success("promtool check metrics (on a real scrape)", &out);
}

#[test]
fn promtool_accepts_the_rules_and_their_unit_tests_pass() {
    assert_success(
        "promtool check rules deploy/prometheus/alerts.yml",
        &promtool(&["check", "rules", "deploy/prometheus/alerts.yml"], None),
    );
    assert_success(
        "promtool check config deploy/prometheus/prometheus.yml",
        &promtool(
            &["check", "config", "deploy/prometheus/prometheus.yml"],
            None,
        ),
    );
    assert_success(
        "promtool test rules deploy/prometheus/alerts_test.yml",
        &promtool(
            &["test", "rules", "deploy/prometheus/alerts_test.yml"],
            None,
        ),
    );
}

/// The unit tests cover every alert of the rule file.
#[test]
fn every_alert_has_a_unit_test() {
    let rules = std::fs::read_to_string(deploy("prometheus/alerts.yml")).expect("alerts.yml");
    let tests =
        std::fs::read_to_string(deploy("prometheus/alerts_test.yml")).expect("alerts_test.yml");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
        .map(str::trim)
        .collect();
    assert!(!alerts.is_empty(), "alerts.yml has no alert");
    for alert in alerts {
        let tested = tests
            .lines()
            .filter_map(|l| l.trim().strip_prefix("alertname:"))
            .filter(|name| name.trim() == alert)
            .count();
        // Once not firing, once firing, at least.
        assert!(
            tested >= 2,
            "alerts_test.yml evaluates {alert} {tested} time(s)"
        );
    }
}

#[test]
fn the_dashboard_reads_its_datasource_from_a_variable() {
    let text = std::fs::read_to_string(deploy("grafana/agentbridge.json")).expect("the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating variables");
    assert!(
        variables
            .iter()
            .any(|v| v["name"] == "DS_PROMETHEUS" && v["type"] == "datasource"),
        "no DS_PROMETHEUS datasource variable"
    );
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut queries = 0;
    for panel in panels.iter().filter(|p| p["type"] != "row") {
        assert_eq!(
            panel["datasource"]["uid"], "${DS_PROMETHEUS}",
            "panel {}",
            panel["title"]
        );
        for target in panel["targets"].as_array().expect("targets") {
            assert_eq!(
                target["datasource"]["uid"], "${DS_PROMETHEUS}",
                "panel {}",
                panel["title"]
            );
            queries += 1;
        }
    }
    assert!(queries > 0, "the dashboard has no query");
}

/// Against the Kubernetes schemas (PyPI `kubernetes-validate`, installed into the tools'
/// venv on first use), how the pieces fit, and `agentbridge check` on the configs they
/// carry.
#[test]
fn the_kubernetes_manifests_validate() {
    let out = Command::new("bash")
        .arg("deploy/kubernetes/validate.sh")
        .current_dir(repo())
        // With the binary, the ConfigMap's and the image's bridge.toml must pass
        // `agentbridge check` too.
        .env("AGENTBRIDGE", common::process::BIN)
        .output()
        .expect("bash runs");
    assert_success("deploy/kubernetes/validate.sh", &out);
}
