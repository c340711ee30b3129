//! loadgen: measures agentbridge. It drives N sender → N receiver agents over a pair of
//! protocols against a bridge it starts (in a child process, on loopback) or one given by
//! URL, and the same load through baselines — `raw-relay` (a forwarder that does nothing
//! but relay frames) and NATS's WebSocket listener when `nats-server` is installed — or
//! through any other Skynet server. It reports msgs/s, latency percentiles, losses and the
//! server's peak RSS as a table and as JSON. A path may also cross a fleet of two bridges
//! (`skynet@a:tracker@b`) federated over a NATS cluster loadgen starts, beside the same load
//! through JetStream alone (`--baseline jetstream`). `loadgen idle` measures memory per idle
//! connection. See BENCHMARKS.md.

mod agents;
mod burst;
mod cpu;
mod idle;
mod jetstream;
mod marker;
mod nats;
mod relay;
mod report;
mod requests;
mod run;
mod server;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use agents::{Endpoints, Error, Proto, Receiver, Sender};
use report::Row;
use run::Load;
use server::Server;

#[derive(Parser)]
#[command(version, about = "Load generator and benchmark for agentbridge")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the load over each path and baseline and reports the results.
    Run(RunArgs),
    /// Measures the bridge's resident memory per idle connection.
    Idle(IdleArgs),
    /// A burst several mailboxes long to a reader slower than the sender: delivered +
    /// told-about = sent.
    Burst(BurstArgs),
    /// Runs a bridge for the load (used by `run` and `idle` as their child process).
    #[command(hide = true)]
    Serve {
        #[arg(long)]
        config: PathBuf,
    },
}

#[derive(Args)]
struct RunArgs {
    /// `sender:receiver` protocols, e.g. `skynet:tracker`; repeat for several paths. With
    /// `@a`/`@b` on both ends (`skynet@a:tracker@b`) the path runs on a fleet of two
    /// federated bridges, a and b, over a NATS cluster loadgen starts.
    #[arg(long = "path", value_parser = parse_route, default_value = "skynet:skynet")]
    paths: Vec<Route>,
    /// Every path instead: skynet→skynet (the yardstick), each ordered pair of two
    /// different protocols, and each request/response way to send to a Skynet receiver
    /// (right after its protocol's streaming path to it).
    #[arg(long)]
    all_paths: bool,
    /// Sender → receiver agent pairs.
    #[arg(long, default_value_t = 4)]
    pairs: usize,
    /// Messages each sender may have in flight (sent, not yet received).
    #[arg(long, default_value_t = 64)]
    window: usize,
    /// Offered messages per second over all senders; without it, flat out within the window.
    #[arg(long)]
    rate: Option<f64>,
    /// Seconds of sending.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Stop after this many messages, if before the duration.
    #[arg(long)]
    count: Option<u64>,
    /// Filler bytes in each message's text, beyond the timing marker.
    #[arg(long, default_value_t = 64)]
    payload: usize,
    /// Senders give every message a random UUIDv4 id of their own, as many clients do:
    /// Skynet's `id`, Grid's `msg-{uuid}`, Synapse's `id`. Without it Skynet messages take
    /// the server's id, and Grid and Synapse ids are `{sender}-{seq}`. (Tracker clients
    /// cannot choose ids.)
    #[arg(long)]
    client_ids: bool,
    /// Baselines to run the same load through: `raw-relay`, `nats` (its WebSocket
    /// listener), `jetstream` (a file-backed stream on the run's NATS cluster), or `none`.
    #[arg(long = "baseline", default_values_t = vec!["raw-relay".to_owned()])]
    baselines: Vec<String>,
    /// Also run skynet→skynet against this Skynet server (`http://host:port`); repeatable.
    #[arg(long = "skynet-server")]
    skynet_servers: Vec<String>,
    /// Use a running agentbridge instead of starting one: `skynet=http://127.0.0.1:4117`,
    /// `tracker=…`, `synapse=…`, `grid=…`; repeatable.
    #[arg(long = "bridge", value_parser = parse_endpoint)]
    bridge: Vec<(Proto, String)>,
    /// With `--bridge`: the receivers connect here instead (`skynet=http://…`; repeatable):
    /// another bridge of a fleet, so that every message crosses bridges.
    #[arg(long = "receiver-bridge", value_parser = parse_endpoint)]
    receiver_bridge: Vec<(Proto, String)>,
    /// With `--bridge`: a Tracker member token allowed to create members.
    #[arg(long)]
    tracker_token: Option<String>,
    /// With `--bridge`: the bridge's pid, to report its peak RSS.
    #[arg(long)]
    bridge_pid: Option<u32>,
    /// Run the started bridge in this process instead of a child (its RSS then includes
    /// the load generator).
    #[arg(long)]
    in_process: bool,
    /// Keep the started bridge's store in memory instead of on disk.
    #[arg(long)]
    memory: bool,
    /// NATS servers in the cluster loadgen starts for fleet paths and the JetStream
    /// baseline; the fleet's stream and buckets have one replica per server, up to three.
    #[arg(long, default_value_t = 1)]
    nats_servers: usize,
    /// Then runs every path again at half the rate it reached, with its yardstick at the
    /// same offered rate (skynet→skynet on one bridge; JetStream for a fleet's path), and
    /// compares their p99s.
    #[arg(long)]
    half_load: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One path of the load: the sender's and the receiver's protocols, and on a fleet, the
/// bridge each is on.
#[derive(Clone, Copy, Debug)]
struct Route {
    from: Proto,
    to: Proto,
    fleet: Option<(Side, Side)>,
    /// How the senders send: their streaming connection, or a request per message.
    via: requests::Via,
}

/// A bridge of the two-bridge fleet a path may run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    A,
    B,
}

impl Route {
    fn label(&self) -> String {
        let end = |proto: Proto, side: Option<Side>| match side {
            None => proto.name().to_owned(),
            Some(Side::A) => format!("{}@a", proto.name()),
            Some(Side::B) => format!("{}@b", proto.name()),
        };
        format!(
            "{}{}→{}",
            end(self.from, self.fleet.map(|f| f.0)),
            self.via.suffix(),
            end(self.to, self.fleet.map(|f| f.1))
        )
    }
}

#[derive(Args)]
struct BurstArgs {
    /// `sender:receiver` protocols.
    #[arg(long = "path", value_parser = parse_path, default_value = "skynet:skynet")]
    path: (Proto, Proto),
    /// The bridge's `routing.mailbox_capacity`.
    #[arg(long, default_value_t = 1024)]
    mailbox: usize,
    /// The bridge's `routing.when_full`.
    #[arg(long, default_value = "replay")]
    when_full: String,
    /// The burst, in mailboxes.
    #[arg(long, default_value_t = 5)]
    factor: usize,
    /// Messages a second the sender sends; 0 sends the burst as fast as it can.
    #[arg(long, default_value_t = 20_000.0)]
    rate: f64,
    /// Messages a second the reader reads; by default 20 % slower than `--rate`.
    #[arg(long)]
    read_rate: Option<f64>,
    /// Filler bytes in each message's text.
    #[arg(long, default_value_t = 512)]
    payload: usize,
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct IdleArgs {
    /// `skynet`, `tracker`, `synapse` or `grid`.
    #[arg(long, default_value = "skynet")]
    protocol: Proto,
    #[arg(long, default_value_t = 5000)]
    connections: usize,
    #[arg(long)]
    json: Option<PathBuf>,
}

fn parse_path(text: &str) -> Result<(Proto, Proto), String> {
    let (a, b) = text
        .split_once(':')
        .ok_or("expected sender:receiver, e.g. skynet:tracker")?;
    let proto = |s: &str| <Proto as clap::ValueEnum>::from_str(s, true);
    Ok((proto(a)?, proto(b)?))
}

/// `skynet:tracker`, or on a fleet `skynet@a:tracker@b`.
fn parse_route(text: &str) -> Result<Route, String> {
    let (a, b) = text
        .split_once(':')
        .ok_or("expected sender:receiver, e.g. skynet:tracker or skynet@a:tracker@b")?;
    let end = |s: &str| -> Result<(Proto, Option<Side>), String> {
        let (proto, side) = match s.split_once('@') {
            None => (s, None),
            Some((proto, "a")) => (proto, Some(Side::A)),
            Some((proto, "b")) => (proto, Some(Side::B)),
            Some((_, other)) => return Err(format!("no bridge {other:?} in the fleet (a, b)")),
        };
        Ok((<Proto as clap::ValueEnum>::from_str(proto, true)?, side))
    };
    // The sender may say how it sends: `synapse/unary`, `synapse/http`, `tracker/http`,
    // `grid/http` (one request a message).
    let (a, via) = match a.split_once('/') {
        Some((a, via)) => (
            a,
            requests::Via::parse(via).ok_or(format!("no way to send {via:?} (unary, http)"))?,
        ),
        None => (a, requests::Via::Stream),
    };
    let ((from, from_side), (to, to_side)) = (end(a)?, end(b)?);
    let fleet = match (from_side, to_side) {
        (None, None) => None,
        (Some(f), Some(t)) => Some((f, t)),
        _ => return Err("name the bridge at both ends (skynet@a:tracker@b) or at neither".into()),
    };
    Ok(Route {
        from,
        to,
        fleet,
        via,
    })
}

fn parse_endpoint(text: &str) -> Result<(Proto, String), String> {
    let (proto, url) = text
        .split_once('=')
        .ok_or("expected protocol=url, e.g. skynet=http://127.0.0.1:4117")?;
    Ok((
        <Proto as clap::ValueEnum>::from_str(proto, true)?,
        url.trim_end_matches('/').to_owned(),
    ))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // reqwest is built without a default TLS provider (as the bridge's own callbacks are).
    rustls::crypto::ring::default_provider()
        .install_default()
        .ok();
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run_all(args).await,
            Command::Idle(args) => idle(args).await,
            Command::Burst(args) => burst(args).await,
            Command::Serve { config } => server::serve(&config).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("loadgen: {e}");
            ExitCode::FAILURE
        }
    }
}

fn spinner(what: &str) -> ProgressBar {
    let bar = ProgressBar::new_spinner().with_prefix(what.to_owned());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {prefix:30} {elapsed:>4} {msg}")
            .expect("a valid template"),
    );
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

async fn run_all(args: RunArgs) -> Result<(), Error> {
    let load = Load {
        window: args.window.max(1),
        rate: args.rate,
        duration: Duration::from_secs_f64(args.duration),
        count: args.count,
        payload: args.payload,
        client_ids: args.client_ids,
    };
    let paths = if args.all_paths {
        let all = <Proto as clap::ValueEnum>::value_variants();
        let route = |from, to| Route {
            from,
            to,
            fleet: None,
            via: requests::Via::Stream,
        };
        // The request/response ways to send, to a Skynet receiver, each run right after
        // its protocol's streaming path to it: a machine shared with others drifts by
        // several per cent a minute, and the two are compared.
        let requests = [
            (Proto::Synapse, requests::Via::Unary),
            (Proto::Synapse, requests::Via::Http),
            (Proto::Tracker, requests::Via::Http),
            (Proto::Grid, requests::Via::Http),
        ];
        let mut paths = vec![route(Proto::Skynet, Proto::Skynet)];
        for &from in all {
            for &to in all.iter().filter(|&&to| to != from) {
                paths.push(route(from, to));
                if to != Proto::Skynet {
                    continue;
                }
                for &(_, via) in requests.iter().filter(|(sender, _)| *sender == from) {
                    paths.push(Route {
                        via,
                        ..route(from, to)
                    });
                }
            }
        }
        paths
    } else {
        args.paths.clone()
    };
    let needs_nats =
        args.baselines.iter().any(|b| b == "jetstream") || paths.iter().any(|r| r.fleet.is_some());
    let cluster = match needs_nats {
        true => Some(nats::start(args.nats_servers).await?),
        false => None,
    };
    let mut rows = Vec::new();

    for baseline in &args.baselines {
        match baseline.as_str() {
            "raw-relay" => rows.push(raw_relay(&args, &load).await?),
            "nats" if nats::binary().is_some() => {
                rows.push(nats_run(&args, &load, cluster.as_ref()).await?)
            }
            "nats" => eprintln!("loadgen: {}; skipping the NATS baseline", nats::MISSING),
            "jetstream" => {
                let cluster = cluster.as_ref().ok_or(nats::MISSING)?;
                rows.push(jetstream_run(&args, &load, cluster).await?)
            }
            "none" => {}
            other => {
                return Err(format!(
                    "unknown baseline {other:?} (raw-relay, nats, jetstream, none)"
                ));
            }
        }
    }
    let mut reached = Vec::new();
    for &route in &paths {
        let row = bridge_run(&args, &load, route, cluster.as_ref()).await?;
        reached.push((route, row.msgs_per_sec));
        rows.push(row);
    }
    if args.half_load {
        for (route, rate) in reached {
            let half = Load {
                rate: Some((rate / 2.0).max(1.0)),
                ..load.clone()
            };
            rows.push(bridge_run(&args, &half, route, cluster.as_ref()).await?);
            let yardstick = match route.fleet {
                Some(_) => {
                    let cluster = cluster.as_ref().ok_or(nats::MISSING)?;
                    jetstream_run(&args, &half, cluster).await?
                }
                None if (route.from, route.to) == (Proto::Skynet, Proto::Skynet) => continue,
                None => bridge_run(&args, &half, SKYNET_SKYNET, None).await?,
            };
            rows.push(yardstick);
        }
    }
    for url in &args.skynet_servers {
        let endpoints = Endpoints {
            skynet: Some(url.clone()),
            ..Default::default()
        };
        let bar = spinner(&format!("{url} skynet→skynet"));
        let pairs = connect(&endpoints, &endpoints, SKYNET_SKYNET, args.pairs, &load).await?;
        let (outcome, measured) = run_measured(pairs, &load, &bar, None).await;
        bar.finish_and_clear();
        let mut row = Row::new(url, "skynet→skynet", args.pairs, &load, &outcome);
        row.set_cpu(measured);
        rows.push(row);
    }

    report::compare(&mut rows);
    print!("{}", report::table(&rows));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    print!("{}", report::cpu_lines(&rows, cores));
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?;
        std::fs::write(path, json).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

const SKYNET_SKYNET: Route = Route {
    from: Proto::Skynet,
    to: Proto::Skynet,
    fleet: None,
    via: requests::Via::Stream,
};

/// The load over `route` through agentbridge: a bridge it starts, the bridges `--bridge`
/// names, or a fleet of two it starts on `cluster`.
async fn bridge_run(
    args: &RunArgs,
    load: &Load,
    route: Route,
    cluster: Option<&nats::Cluster>,
) -> Result<Row, Error> {
    let path = route.label();
    let bar = spinner(&format!("agentbridge {path}"));
    // Every window of every pair fits in a mailbox: losses are the bridge's, not the
    // policy's.
    let capacity = (args.window * 2).max(1024);
    let start = |federation: String| async move {
        Server::start(
            args.in_process,
            !args.memory,
            capacity,
            "drop_newest",
            &federation,
        )
        .await
    };
    let mut servers = Vec::new();
    let (sending, receiving) = match route.fleet {
        Some((from, to)) => {
            let cluster = cluster.ok_or(nats::MISSING)?;
            // A fleet of its own for each row: nothing a row before left in the stream
            // delays this one.
            let prefix = format!("lg{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
            for id in ["a", "b"] {
                let nats = cluster.toml_list();
                let section = server::federation_section(&nats, cluster.replicas(), &prefix, id);
                servers.push(start(section).await?);
            }
            let on = |side: Side| servers[side as usize].endpoints.clone();
            (on(from), on(to))
        }
        None if args.bridge.is_empty() => {
            servers.push(start(String::new()).await?);
            (servers[0].endpoints.clone(), servers[0].endpoints.clone())
        }
        None => {
            let sending = endpoints_of(&args.bridge, args);
            let receiving = match args.receiver_bridge.is_empty() {
                true => sending.clone(),
                false => endpoints_of(&args.receiver_bridge, args),
            };
            (sending, receiving)
        }
    };
    let pairs = connect(&sending, &receiving, route, args.pairs, load).await?;
    // The sending bridge's CPU and memory.
    let pid = match route.fleet {
        Some((from, _)) => Some(servers[from as usize].pid),
        None => servers.first().map(|s| s.pid).or(args.bridge_pid),
    };
    // In process, the bridge's CPU time is the load generator's too: neither is told apart.
    let (outcome, measured) =
        run_measured(pairs, load, &bar, pid.filter(|_| !args.in_process)).await;
    bar.finish_and_clear();
    let mut row = Row::new("agentbridge", &path, args.pairs, load, &outcome);
    row.peak_rss_kib = pid.and_then(server::rss_kib).map(|(_, peak)| peak);
    row.set_cpu(measured);
    for server in servers {
        server.stop().await;
    }
    Ok(row)
}

/// The endpoints `--bridge`-style arguments name.
fn endpoints_of(named: &[(Proto, String)], args: &RunArgs) -> Endpoints {
    let mut endpoints = Endpoints {
        tracker_admin_token: args.tracker_token.clone(),
        ..Default::default()
    };
    for (proto, url) in named {
        let slot = match proto {
            Proto::Skynet => &mut endpoints.skynet,
            Proto::Tracker => &mut endpoints.tracker,
            Proto::Synapse => &mut endpoints.synapse,
            Proto::Grid => &mut endpoints.grid,
        };
        *slot = Some(url.clone());
    }
    endpoints
}

/// Runs the load, with the CPU it took: `server`'s (when it runs in a process of its own)
/// and this process's.
async fn run_measured(
    pairs: Vec<(Sender, Receiver)>,
    load: &Load,
    bar: &ProgressBar,
    server: Option<u32>,
) -> (run::Outcome, cpu::Measured) {
    let meter = cpu::Meter::start(server);
    let outcome = run::run(pairs, load, bar).await;
    let measured = meter.finish(outcome.delivered);
    (outcome, measured)
}

/// Connects `pairs` receivers of `to` (at `receiving`), then a sender of `from` for each.
async fn connect(
    endpoints: &Endpoints,
    receiving: &Endpoints,
    route: Route,
    pairs: usize,
    load: &Load,
) -> Result<Vec<(Sender, Receiver)>, Error> {
    let (from, to) = (route.from, route.to);
    let run = &uuid::Uuid::new_v4().simple().to_string()[..6];
    let mut receivers = Vec::new();
    for i in 0..pairs {
        receivers.push(agents::receiver(receiving, to, &format!("lg{run}-r{i}")).await?);
    }
    if endpoints != receiving {
        // Receivers on another bridge: their presence crosses before senders name them.
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    let mut out = Vec::new();
    for (i, receiver) in receivers.into_iter().enumerate() {
        let pairing = agents::Pairing {
            endpoints,
            from,
            to,
            sender: format!("lg{run}-s{i}"),
            receiver: format!("lg{run}-r{i}"),
            client_ids: load.client_ids,
        };
        let sender = match route.via {
            requests::Via::Stream => agents::sender(pairing).await?,
            via => requests::sender(pairing, via, load.window).await?,
        };
        out.push((sender, receiver));
    }
    Ok(out)
}

/// The same load through the raw relay, with Skynet-sized frames.
async fn raw_relay(args: &RunArgs, load: &Load) -> Result<Row, Error> {
    let bar = spinner("raw-relay");
    let addr = relay::start().await.map_err(|e| e.to_string())?;
    let mut pairs = Vec::new();
    for i in 0..args.pairs {
        let receiver = agents::plain::receiver(&format!("ws://{addr}/?me=r{i}")).await?;
        let client_ids = load.client_ids;
        let sender =
            agents::plain::sender(&format!("ws://{addr}/?me=s{i}&to=r{i}"), move |_, text| {
                agents::skynet_frame(client_ids, text)
            })
            .await?;
        pairs.push((sender, receiver));
    }
    let (outcome, measured) = run_measured(pairs, load, &bar, None).await;
    bar.finish_and_clear();
    let mut row = Row::new("raw-relay", "ws→ws", args.pairs, load, &outcome);
    row.set_cpu(measured);
    Ok(row)
}

/// The same load through NATS's WebSocket listener: the run's cluster's, or a server of
/// its own.
async fn nats_run(
    args: &RunArgs,
    load: &Load,
    cluster: Option<&nats::Cluster>,
) -> Result<Row, Error> {
    let bar = spinner("nats");
    let own = match cluster {
        Some(_) => None,
        None => Some(nats::start(1).await?),
    };
    let server = cluster.or(own.as_ref()).ok_or(nats::MISSING)?;
    let mut pairs = Vec::new();
    for i in 0..args.pairs {
        let receiver = nats::receiver(&server.ws_url, &format!("r{i}")).await?;
        let sender = nats::sender(&server.ws_url, &format!("r{i}")).await?;
        pairs.push((sender, receiver));
    }
    let (outcome, measured) = run_measured(pairs, load, &bar, Some(server.pid())).await;
    bar.finish_and_clear();
    let mut row = Row::new("nats", "ws→ws", args.pairs, load, &outcome);
    row.peak_rss_kib = server::rss_kib(server.pid()).map(|(_, peak)| peak);
    row.set_cpu(measured);
    Ok(row)
}

/// The same load through a file-backed JetStream stream on `cluster`.
async fn jetstream_run(args: &RunArgs, load: &Load, cluster: &nats::Cluster) -> Result<Row, Error> {
    let bar = spinner("jetstream");
    let run = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let baseline = jetstream::Baseline::set_up(cluster, run).await?;
    let mut pairs = Vec::new();
    for i in 0..args.pairs {
        let receiver = baseline.receiver(&format!("r{i}")).await?;
        pairs.push((baseline.sender(&format!("r{i}"), load.client_ids), receiver));
    }
    // The first server's CPU and memory (of a cluster of three, one server's share).
    let (outcome, measured) = run_measured(pairs, load, &bar, Some(cluster.pid())).await;
    bar.finish_and_clear();
    let path = format!("stream, {} replica(s)", cluster.replicas());
    let mut row = Row::new("jetstream", &path, args.pairs, load, &outcome);
    row.peak_rss_kib = server::rss_kib(cluster.pid()).map(|(_, peak)| peak);
    row.set_cpu(measured);
    baseline.remove().await;
    Ok(row)
}

async fn burst(args: BurstArgs) -> Result<(), Error> {
    let bar = spinner("burst");
    let report = burst::run(&burst::Burst {
        from: args.path.0,
        to: args.path.1,
        capacity: args.mailbox,
        when_full: args.when_full,
        factor: args.factor,
        rate: args.rate,
        read_rate: args.read_rate.unwrap_or(args.rate * 0.8).max(1.0),
        payload: args.payload,
    })
    .await?;
    bar.finish_and_clear();
    println!(
        "{} when_full={} mailbox={}: sent {} at {:.0}/s, read at {:.0}/s: delivered {}, told of {}, lost {} ({:.1} s){}",
        report.path,
        report.when_full,
        report.mailbox_capacity,
        report.sent,
        report.send_rate,
        report.read_rate,
        report.delivered,
        report.told,
        report.lost,
        report.seconds,
        if report.lost == 0 {
            ": delivered + told = sent"
        } else {
            ": MESSAGES LOST"
        }
    );
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(path, json).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if report.lost > 0 {
        return Err(format!("{} messages lost", report.lost));
    }
    Ok(())
}

async fn idle(args: IdleArgs) -> Result<(), Error> {
    let bar = ProgressBar::new(args.connections as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} idle connections {elapsed}")
            .expect("a valid template"),
    );
    let report = idle::measure(args.protocol, args.connections, &bar).await?;
    bar.finish_and_clear();
    println!(
        "{} idle {} connections: bridge RSS {:.1} → {:.1} MiB, {:.1} KiB per connection",
        report.connections,
        report.protocol.name(),
        report.rss_before_kib as f64 / 1024.0,
        report.rss_after_kib as f64 / 1024.0,
        report.kib_per_connection
    );
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(path, json).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}
