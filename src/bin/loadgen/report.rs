//! Results: one row per measured target, as a plain-text table and as JSON.

use serde::Serialize;

use super::cpu::{Measured, ThreadCpu};
use super::run::Outcome;

#[derive(Debug, Serialize)]
pub struct Row {
    /// What carried the load: `agentbridge`, `raw-relay`, `nats`, `jetstream`, or a Skynet
    /// server URL.
    pub target: String,
    /// `sender→receiver` protocols (`skynet@a→tracker@b` on a fleet of two bridges).
    pub path: String,
    pub pairs: usize,
    pub window: usize,
    pub offered_rate: Option<f64>,
    pub sent: u64,
    pub delivered: u64,
    pub lost: u64,
    pub send_errors: u64,
    pub msgs_per_sec: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
    /// Peak resident set of the server process, when it is measurable.
    pub peak_rss_kib: Option<u64>,
    /// The server process's CPU time (user + system) over the run, per delivered message,
    /// when it runs in a process of its own. Steadier than msgs/s on a shared machine.
    pub cpu_us_per_msg: Option<f64>,
    /// Of `cpu_us_per_msg`, the time in the kernel (socket and file I/O, wake-ups).
    pub system_us_per_msg: Option<f64>,
    /// `cpu_us_per_msg` by thread name, largest first.
    pub server_threads: Vec<ThreadCpu>,
    /// The load generator's own CPU time per delivered message: its clients', and the
    /// relay's for `raw-relay` (it runs in the same process), the bridge's with
    /// `--in-process`.
    pub load_generator_cpu_us_per_msg: Option<f64>,
    /// msgs/s as a fraction of the raw-relay baseline's in the same run.
    pub vs_raw_relay: Option<f64>,
    /// p99 as a multiple of the raw-relay baseline's in the same run.
    pub p99_vs_raw_relay: Option<f64>,
    /// msg/s against agentbridge's skynet→skynet row of the same run (a fleet's path
    /// against the fleet's `skynet@a→skynet@a`), both at full rate.
    pub vs_skynet: Option<f64>,
    /// A fleet's path: msg/s against the JetStream baseline's, both at full rate.
    pub vs_jetstream: Option<f64>,
    /// A request/response path (`synapse/unary→skynet`): msg/s against its protocol's
    /// streaming path to the same receiver (`synapse→skynet`), both at full rate.
    pub vs_stream: Option<f64>,
    /// At an offered rate: p99 as a multiple of its yardstick's at the same offered rate
    /// (skynet→skynet on one bridge; JetStream for a fleet's path).
    pub p99_vs_yardstick: Option<f64>,
}

impl Row {
    pub fn new(
        target: &str,
        path: &str,
        pairs: usize,
        load: &super::run::Load,
        outcome: &Outcome,
    ) -> Row {
        let q = |p: f64| outcome.latency.value_at_quantile(p);
        Row {
            target: target.to_owned(),
            path: path.to_owned(),
            pairs,
            window: load.window,
            offered_rate: load.rate,
            sent: outcome.sent,
            delivered: outcome.delivered,
            lost: outcome.lost(),
            send_errors: outcome.send_errors,
            msgs_per_sec: outcome.rate(),
            p50_us: q(0.5),
            p90_us: q(0.9),
            p99_us: q(0.99),
            p999_us: q(0.999),
            max_us: outcome.latency.max(),
            peak_rss_kib: None,
            cpu_us_per_msg: None,
            system_us_per_msg: None,
            server_threads: Vec::new(),
            load_generator_cpu_us_per_msg: None,
            vs_raw_relay: None,
            p99_vs_raw_relay: None,
            vs_skynet: None,
            vs_jetstream: None,
            vs_stream: None,
            p99_vs_yardstick: None,
        }
    }

    /// Takes in what the run's CPU meter measured.
    pub fn set_cpu(&mut self, measured: Measured) {
        self.cpu_us_per_msg = measured.server.as_ref().map(|c| c.all_us);
        self.system_us_per_msg = measured.server.as_ref().map(|c| c.system_us);
        self.server_threads = measured.server_threads;
        self.load_generator_cpu_us_per_msg = measured.load_generator.map(|c| c.all_us);
    }
}

/// Fills in each row's ratios: to the skynet→skynet row of its kind, to the JetStream
/// baseline, to its yardstick at the same offered rate, and to the raw-relay row.
pub fn compare(rows: &mut [Row]) {
    let full_rate = |target: &str, path: Option<&str>| {
        (rows.iter())
            .find(|r| {
                r.offered_rate.is_none() && r.target == target && path.is_none_or(|p| r.path == p)
            })
            .map(|r| r.msgs_per_sec)
    };
    let skynet = full_rate("agentbridge", Some("skynet→skynet"));
    let fleet_skynet = full_rate("agentbridge", Some("skynet@a→skynet@a"));
    let jetstream = full_rate("jetstream", None);
    let yardstick_p99 = |row: &Row| {
        let fleet = row.path.contains('@');
        (rows.iter())
            .find(|r| {
                r.offered_rate == row.offered_rate
                    && match fleet {
                        true => r.target == "jetstream",
                        false => r.target == "agentbridge" && r.path == "skynet→skynet",
                    }
            })
            .map(|r| r.p99_us)
    };
    let yardsticks: Vec<Option<u64>> = (rows.iter())
        .map(|r| match (r.target.as_str(), r.offered_rate) {
            ("agentbridge", Some(_)) => yardstick_p99(r),
            _ => None,
        })
        .collect();
    // A request/response path's streaming twin: its path without the `/unary`, `/http`.
    let streams: Vec<Option<f64>> = (rows.iter())
        .map(|r| {
            let (sender, receiver) = r.path.split_once('→')?;
            let (protocol, _) = sender.split_once('/')?;
            full_rate("agentbridge", Some(&format!("{protocol}→{receiver}")))
        })
        .collect();
    let ratio = |a: f64, b: f64| a / b.max(1e-9);
    for ((row, yardstick), stream) in rows.iter_mut().zip(yardsticks).zip(streams) {
        if row.target != "agentbridge" {
            continue;
        }
        let fleet = row.path.contains('@');
        if row.offered_rate.is_none() {
            let same_kind = if fleet { fleet_skynet } else { skynet };
            row.vs_skynet = same_kind.map(|rate| ratio(row.msgs_per_sec, rate));
            row.vs_jetstream = jetstream
                .filter(|_| fleet)
                .map(|rate| ratio(row.msgs_per_sec, rate));
            row.vs_stream = stream.map(|rate| ratio(row.msgs_per_sec, rate));
        }
        row.p99_vs_yardstick = yardstick.map(|p99| ratio(row.p99_us as f64, p99.max(1) as f64));
    }
    let Some((rate, p99)) = rows
        .iter()
        .find(|r| r.target == "raw-relay")
        .map(|r| (r.msgs_per_sec, r.p99_us))
    else {
        return;
    };
    for row in rows.iter_mut().filter(|r| r.target != "raw-relay") {
        row.vs_raw_relay = Some(row.msgs_per_sec / rate.max(1e-9));
        row.p99_vs_raw_relay = Some(row.p99_us as f64 / (p99.max(1)) as f64);
    }
}

pub fn table(rows: &[Row]) -> String {
    let header = [
        "target",
        "path",
        "pairs",
        "window",
        "rate",
        "sent",
        "delivered",
        "lost",
        "msg/s",
        "p50",
        "p90",
        "p99",
        "p99.9",
        "peak RSS",
        "CPU/msg (kernel)",
        "loadgen CPU/msg",
        "vs raw",
        "p99 vs raw",
        "vs skynet→skynet",
        "vs jetstream",
        "vs stream",
        "p99 vs yardstick",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.target.clone(),
                r.path.clone(),
                r.pairs.to_string(),
                r.window.to_string(),
                r.offered_rate.map_or("max".into(), |x| format!("{x:.0}")),
                r.sent.to_string(),
                r.delivered.to_string(),
                r.lost.to_string(),
                format!("{:.0}", r.msgs_per_sec),
                micros(r.p50_us),
                micros(r.p90_us),
                micros(r.p99_us),
                micros(r.p999_us),
                r.peak_rss_kib
                    .map_or("-".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0)),
                match (r.cpu_us_per_msg, r.system_us_per_msg) {
                    (Some(all), Some(kernel)) => format!("{all:.1} µs ({kernel:.1})"),
                    (Some(all), None) => format!("{all:.1} µs"),
                    _ => "-".into(),
                },
                r.load_generator_cpu_us_per_msg
                    .map_or("-".into(), |x| format!("{x:.1} µs")),
                r.vs_raw_relay
                    .map_or("-".into(), |x| format!("{:.0}%", x * 100.0)),
                r.p99_vs_raw_relay
                    .map_or("-".into(), |x| format!("{x:.2}×")),
                r.vs_skynet
                    .map_or("-".into(), |x| format!("{:.0}%", x * 100.0)),
                r.vs_jetstream
                    .map_or("-".into(), |x| format!("{:.0}%", x * 100.0)),
                r.vs_stream
                    .map_or("-".into(), |x| format!("{:.0}%", x * 100.0)),
                r.p99_vs_yardstick
                    .map_or("-".into(), |x| format!("{x:.2}×")),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            cells
                .iter()
                .map(|row| row[i].chars().count())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    let line = |out: &mut String, row: Vec<&str>| {
        for (i, cell) in row.iter().enumerate() {
            let pad = widths[i] - cell.chars().count();
            if i > 0 {
                out.push_str("  ");
            }
            out.push_str(cell);
            out.push_str(&" ".repeat(pad));
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
    };
    line(&mut out, header.to_vec());
    for row in &cells {
        line(&mut out, row.iter().map(String::as_str).collect());
    }
    out
}

/// Where each row's CPU went, a line each, beside what `cores` allow a message at its
/// rate: a rate needs the server and the load generator together to fit in that.
pub fn cpu_lines(rows: &[Row], cores: usize) -> String {
    let mut out = format!("CPU a message, user and kernel, in µs ({cores} cores):\n");
    for r in rows.iter().filter(|r| r.msgs_per_sec > 0.0) {
        let mut parts = Vec::new();
        if let Some(all) = r.cpu_us_per_msg {
            let threads: Vec<String> = (r.server_threads.iter())
                .filter(|t| t.cpu.all_us >= 0.05)
                .map(|t| format!("{} {:.2}", t.name, t.cpu.all_us))
                .collect();
            parts.push(format!("server {all:.2} ({})", threads.join(", ")));
        }
        if let Some(own) = r.load_generator_cpu_us_per_msg {
            parts.push(format!("load generator {own:.2}"));
        }
        out.push_str(&format!(
            "  {} {}: {}; at {:.0} msg/s the cores allow {:.2}\n",
            r.target,
            r.path,
            parts.join(", "),
            r.msgs_per_sec,
            cores as f64 * 1e6 / r.msgs_per_sec,
        ));
    }
    out
}

fn micros(us: u64) -> String {
    if us >= 10_000 {
        format!("{:.1} ms", us as f64 / 1000.0)
    } else {
        format!("{us} µs")
    }
}
