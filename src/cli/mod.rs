//! The operator's commands of the command line, which talk to a running bridge over its
//! admin listener: `health` (a container's health check), `trace` (a conversation, hop by
//! hop) and `top` (live rates, depths, the busiest agents). Part of the binary, not the
//! library: they are clients of the bridge like any other.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::IsTerminal;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use agentbridge::Config;
use agentbridge::admin::{Summary, Trace};
use agentbridge::telemetry;
use serde_json::Value;

use prometheus_parse::{Sample, Scrape};

/// Where the running bridge's admin listener is, and the token it asks for.
pub struct AdminClient {
    base: Option<String>,
    token: Option<String>,
    http: reqwest::Client,
}

impl AdminClient {
    /// The admin listener at `url`, or else the one `config` names (its unspecified
    /// address asked on loopback); the token is the config's.
    pub fn for_config(config: &Config, url: Option<String>) -> AdminClient {
        let named = url.map(|url| url.trim_end_matches('/').to_owned());
        let base = named.or_else(|| {
            config.admin.as_ref().map(|admin| {
                let addr = match admin.listen.ip() {
                    IpAddr::V4(ip) if ip.is_unspecified() => {
                        SocketAddr::new(Ipv4Addr::LOCALHOST.into(), admin.listen.port())
                    }
                    IpAddr::V6(ip) if ip.is_unspecified() => {
                        SocketAddr::new(Ipv6Addr::LOCALHOST.into(), admin.listen.port())
                    }
                    _ => admin.listen,
                };
                format!("http://{addr}")
            })
        });
        // reqwest asks rustls for the process's provider, even for plain HTTP.
        let _ = rustls::crypto::ring::default_provider().install_default();
        AdminClient {
            base,
            token: config.admin.as_ref().and_then(|a| a.token.clone()),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .expect("an HTTP client without TLS builds"),
        }
    }

    async fn get(&self, path: &str) -> Result<reqwest::Response, String> {
        let base = (self.base.as_ref())
            .ok_or("the config has no [admin] section: the bridge has no admin listener")?;
        let mut request = self.http.get(format!("{base}{path}"));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        request
            .send()
            .await
            .map_err(|e| format!("cannot reach the bridge at {base}: {e}"))
    }

    async fn json(&self, path: &str) -> Result<Value, String> {
        let answer = self.get(path).await?;
        let status = answer.status();
        let body: Value = answer.json().await.map_err(|e| e.to_string())?;
        if !status.is_success() {
            let why = body["error"].as_str().unwrap_or("no reason given");
            return Err(format!("{path}: {status}: {why}"));
        }
        Ok(body)
    }
}

fn fail(reason: impl std::fmt::Display) -> ExitCode {
    eprintln!("agentbridge: error: {reason}");
    ExitCode::FAILURE
}

/// `agentbridge health [--ready]`.
pub async fn health(admin: AdminClient, ready: bool) -> ExitCode {
    let path = if ready { "/readyz" } else { "/healthz" };
    match admin.get(path).await {
        Ok(answer) if answer.status().is_success() => {
            print!("{}", answer.text().await.unwrap_or_default());
            ExitCode::SUCCESS
        }
        Ok(answer) => fail(format!("{path}: {}", answer.status())),
        Err(e) => fail(e),
    }
}

#[derive(clap::Args)]
pub struct TraceArgs {
    /// A message id in any protocol's form (a UUID derived from one too), or a
    /// conversation's id.
    id: String,
    /// Keep watching, and print each new hop as it arrives.
    #[arg(long)]
    follow: bool,
    /// Print JSON (one object; with --follow, one per hop) for scripts.
    #[arg(long)]
    json: bool,
}

/// `agentbridge trace ID [--follow] [--json]`.
pub async fn trace(admin: AdminClient, args: TraceArgs) -> ExitCode {
    let path = format!("/admin/api/trace?id={}", encode(&args.id));
    let mut shown: HashSet<i64> = HashSet::new();
    loop {
        let trace = match admin.json(&path).await.and_then(|v| {
            serde_json::from_value::<Trace>(v).map_err(|e| format!("an answer not understood: {e}"))
        }) {
            Ok(trace) => trace,
            Err(e) => return fail(e),
        };
        if args.json && !args.follow {
            println!(
                "{}",
                serde_json::to_string_pretty(&trace).unwrap_or_default()
            );
            return ExitCode::SUCCESS;
        }
        if shown.is_empty() && !args.json {
            // The header, once.
            println!(
                "conversation {} ({} message{})",
                trace.correlation_id,
                trace.messages.len(),
                if trace.messages.len() == 1 { "" } else { "s" }
            );
        }
        for hop in &trace.messages {
            if !shown.insert(hop.seq) {
                continue;
            }
            if args.json {
                println!("{}", serde_json::to_string(hop).unwrap_or_default());
            } else {
                println!("{}", hop_line(hop, &trace.id));
            }
        }
        if !args.follow {
            return ExitCode::SUCCESS;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// One hop of a conversation, as `trace` prints it.
fn hop_line(hop: &Summary, asked: &str) -> String {
    let to = if hop.audience == "everyone" {
        "everyone".to_owned()
    } else if let Some(group) = &hop.group {
        format!("group {group}")
    } else {
        hop.to.join(", ")
    };
    let mut line = format!(
        "{}  {:<8} {} → {}  {:<14} {}",
        hop.time, hop.protocol, hop.from, to, hop.kind, hop.id
    );
    if hop.uuid != hop.id {
        line.push_str(&format!(" (uuid {})", hop.uuid));
    }
    if let Some(parent) = &hop.reply_to {
        line.push_str(&format!(" ← {parent}"));
    }
    if hop.id == asked {
        line.push_str("  ◀");
    }
    line
}

/// `s` as a query-string value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[derive(clap::Args)]
pub struct TopArgs {
    /// Seconds between two looks.
    #[arg(long, default_value_t = 2.0)]
    interval: f64,
    /// Look twice, print once, and exit (for scripts).
    #[arg(long)]
    once: bool,
}

/// `agentbridge top [--interval S] [--once]`.
pub async fn top(admin: AdminClient, args: TopArgs) -> ExitCode {
    let interval = Duration::from_secs_f64(args.interval.max(0.2));
    let mut before = match scrape(&admin).await {
        Ok(samples) => samples,
        Err(e) => return fail(e),
    };
    loop {
        tokio::time::sleep(interval).await;
        let now = match scrape(&admin).await {
            Ok(samples) => samples,
            Err(e) => return fail(e),
        };
        let busiest = busiest(&admin).await.unwrap_or_default();
        let screen = render(&before, &now, interval.as_secs_f64(), &busiest);
        if std::io::stdout().is_terminal() && !args.once {
            print!("\x1b[2J\x1b[H");
        }
        println!("{screen}");
        if args.once {
            return ExitCode::SUCCESS;
        }
        before = now;
    }
}

async fn scrape(admin: &AdminClient) -> Result<Vec<Sample>, String> {
    let answer = admin.get("/metrics").await?;
    let text = answer.text().await.map_err(|e| e.to_string())?;
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    Ok(Scrape::parse(lines).map_err(|e| e.to_string())?.samples)
}

/// A counter's or a gauge's value (histograms are not shown).
fn value(sample: &Sample) -> f64 {
    use prometheus_parse::Value;
    match sample.value {
        Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
        Value::Histogram(_) | Value::Summary(_) => 0.0,
    }
}

fn label<'a>(sample: &'a Sample, name: &str) -> &'a str {
    sample.labels.get(name).unwrap_or_default()
}

/// Who sent most of the most recent messages (the metrics carry no agent names).
async fn busiest(admin: &AdminClient) -> Result<Vec<(String, usize)>, String> {
    let recent = admin.json("/admin/api/messages?limit=500").await?;
    let mut counts: HashMap<String, usize> = HashMap::new();
    for message in recent["messages"].as_array().into_iter().flatten() {
        if let Some(from) = message["from"].as_str() {
            *counts.entry(from.to_owned()).or_default() += 1;
        }
    }
    let mut counts: Vec<(String, usize)> = counts.into_iter().collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    counts.truncate(10);
    Ok(counts)
}

/// One screen of `top`: what changed between two scrapes `seconds` apart.
fn render(before: &[Sample], now: &[Sample], seconds: f64, busiest: &[(String, usize)]) -> String {
    let rate = |name: &str, keys: &[&str]| -> BTreeMap<Vec<String>, f64> {
        let mut rates = BTreeMap::new();
        for sample in now.iter().filter(|s| s.metric == name) {
            let earlier = (before.iter())
                .find(|b| b.metric == name && *b.labels == *sample.labels)
                .map_or(0.0, value);
            let key: Vec<String> = keys.iter().map(|k| label(sample, k).to_owned()).collect();
            *rates.entry(key).or_insert(0.0) += (value(sample) - earlier).max(0.0) / seconds;
        }
        rates
    };
    let gauge = |name: &str| -> BTreeMap<String, f64> {
        (now.iter().filter(|s| s.metric == name))
            .map(|s| (label(s, "protocol").to_owned(), value(s)))
            .collect()
    };
    let mut out = String::from("agentbridge top\n\nmessages/s  from → to\n");
    for (pair, value) in rate(
        telemetry::MESSAGES_DELIVERED,
        &["from_protocol", "to_protocol"],
    ) {
        out.push_str(&format!("{value:>10.1}  {} → {}\n", pair[0], pair[1]));
    }
    out.push_str("\nprotocol   received/s  connections  agents online  decode errors/s\n");
    let received = rate(telemetry::MESSAGES_RECEIVED, &["protocol"]);
    let errors = rate(telemetry::DECODE_ERRORS, &["protocol"]);
    let (connections, online) = (
        gauge(telemetry::CONNECTIONS),
        gauge(telemetry::AGENTS_ONLINE),
    );
    for protocol in connections.keys() {
        let key = vec![protocol.clone()];
        out.push_str(&format!(
            "{protocol:<10} {:>10.1}  {:>11}  {:>13}  {:>15.1}\n",
            received.get(&key).copied().unwrap_or(0.0),
            connections.get(protocol).copied().unwrap_or(0.0),
            online.get(protocol).copied().unwrap_or(0.0),
            errors.get(&key).copied().unwrap_or(0.0),
        ));
    }
    let drops: Vec<_> = rate(telemetry::MESSAGES_DROPPED, &["protocol", "reason"])
        .into_iter()
        .filter(|(_, v)| *v > 0.0)
        .collect();
    out.push_str("\ndrops/s\n");
    if drops.is_empty() {
        out.push_str("  none\n");
    }
    for (key, value) in drops {
        out.push_str(&format!("{value:>10.1}  {} {}\n", key[0], key[1]));
    }
    out.push_str("\nbusiest senders (of the last 500 messages)\n");
    for (agent, count) in busiest {
        out.push_str(&format!("{count:>10}  {agent}\n"));
    }
    out
}
