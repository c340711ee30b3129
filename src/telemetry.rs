//! Every metric the bridge exports, named and described in this one place.
//!
//! Labels never carry agent names or ids: their cardinality would grow with the fleet.

use std::cell::RefCell;
use std::sync::OnceLock;
use std::thread::LocalKey;
use std::time::Duration;

use foldhash::HashMap;
use metrics::{Counter, counter, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

pub const MESSAGES_RECEIVED: &str = "agentbridge_messages_received_total";
pub const MESSAGES_DELIVERED: &str = "agentbridge_messages_delivered_total";
pub const MESSAGES_DROPPED: &str = "agentbridge_messages_dropped_total";
pub const DECODE_ERRORS: &str = "agentbridge_decode_errors_total";
pub const ROUTE_DURATION: &str = "agentbridge_route_duration_seconds";
pub const CONNECTIONS: &str = "agentbridge_connections";
pub const AGENTS_ONLINE: &str = "agentbridge_agents_online";
pub const MAILBOX_DEPTH: &str = "agentbridge_mailbox_depth";
pub const STORE_WRITE_DURATION: &str = "agentbridge_store_write_duration_seconds";
pub const STORE_BATCH_SIZE: &str = "agentbridge_store_batch_size";
pub const CALLBACK_FAILURES: &str = "agentbridge_callback_failures_total";
pub const BUILD_INFO: &str = "agentbridge_build_info";
pub const FEDERATION_CONNECTED: &str = "agentbridge_federation_connected";
pub const FEDERATION_PUBLISH_DURATION: &str = "agentbridge_federation_publish_duration_seconds";
pub const FEDERATION_MESSAGES: &str = "agentbridge_federation_messages_total";
pub const FEDERATION_REFUSED: &str = "agentbridge_federation_refused_total";
pub const FEDERATION_OUTBOX: &str = "agentbridge_federation_outbox";
pub const FEDERATION_UNSHARED: &str = "agentbridge_federation_unshared";
pub const FEDERATION_APPLY_LAG: &str = "agentbridge_federation_apply_lag_seconds";
pub const FEDERATION_BRIDGES: &str = "agentbridge_federation_bridges";
pub const FEDERATION_HANDOVERS: &str = "agentbridge_federation_handovers_total";
pub const FEDERATION_ACKED_UNWRITTEN: &str = "agentbridge_federation_acknowledged_unwritten_total";
pub const FEDERATION_DELIVERY_GAPS: &str = "agentbridge_federation_delivery_gaps_total";
pub const FEDERATION_WATCH_STALLS: &str = "agentbridge_federation_watch_stalls_total";
pub const READY: &str = "agentbridge_ready";
pub const CONFIG_RELOADS: &str = "agentbridge_config_reloads_total";

/// Every metric name with its help text, for `describe` and the README.
pub const METRICS: &[(&str, &str)] = &[
    (
        MESSAGES_RECEIVED,
        "Messages accepted from senders, by origin protocol and kind.",
    ),
    (
        MESSAGES_DELIVERED,
        "Messages written to a recipient, by sender protocol, recipient protocol and kind.",
    ),
    (
        MESSAGES_DROPPED,
        "Messages not delivered, by recipient protocol and reason.",
    ),
    (DECODE_ERRORS, "Frames refused as malformed, by protocol."),
    (
        ROUTE_DURATION,
        "Seconds from a message being decoded to it being written to a recipient (storing it included).",
    ),
    (CONNECTIONS, "Open client connections, by protocol."),
    (AGENTS_ONLINE, "Agents currently online, by protocol."),
    (
        MAILBOX_DEPTH,
        "Messages waiting in a recipient's mailbox, observed each time the recipient wakes to read.",
    ),
    (
        STORE_WRITE_DURATION,
        "Seconds per store commit (one commit holds a batch of writes).",
    ),
    (
        STORE_BATCH_SIZE,
        "Writes committed together in one store transaction.",
    ),
    (
        CALLBACK_FAILURES,
        "Callback deliveries that failed for good, by protocol and outcome.",
    ),
    (
        BUILD_INFO,
        "Always 1; the version label names the running build.",
    ),
    (
        READY,
        "1 while the bridge is ready and not degraded (every endpoint listening; in a fleet, NATS reachable), else 0.",
    ),
    (
        CONFIG_RELOADS,
        "Reloads of bridge.toml (SIGHUP, POST /admin/reload), by outcome: ok, or refused (the file was not valid; nothing changed).",
    ),
    (
        FEDERATION_CONNECTED,
        "1 while the bridge is connected to NATS with its stream and buckets set up, else 0.",
    ),
    (
        FEDERATION_PUBLISH_DURATION,
        "Seconds from publishing a message to the fleet's stream to JetStream acknowledging it.",
    ),
    (
        FEDERATION_MESSAGES,
        "Messages to other bridges (direction out: published) and from them (in: applied here), by outcome.",
    ),
    (
        FEDERATION_REFUSED,
        "Messages refused because they had to reach another bridge and could not, by reason.",
    ),
    (
        FEDERATION_OUTBOX,
        "Messages published to the fleet's stream and not yet acknowledged by JetStream.",
    ),
    (
        FEDERATION_UNSHARED,
        "Messages among this bridge's own agents kept while NATS was away, waiting to reach the fleet's history.",
    ),
    (
        FEDERATION_APPLY_LAG,
        "Seconds from another bridge accepting a message to this bridge applying it (by the two clocks).",
    ),
    (
        FEDERATION_BRIDGES,
        "Bridges of the fleet alive, as this one sees them (itself included).",
    ),
    (
        FEDERATION_HANDOVERS,
        "Agents that moved here from another bridge whose mail there was asked for, by outcome.",
    ),
    (
        FEDERATION_ACKED_UNWRITTEN,
        "Batches of the stream (the others' applied here, this bridge's own read back) acknowledged before everything routed here was written: a recipient that far behind loses that part if the bridge is killed.",
    ),
    (
        FEDERATION_DELIVERY_GAPS,
        "Readings of this bridge's stream consumer that ended at a gap in its deliveries (lost as a NATS server failed, or served to a pull request left over), which the next reading read from the stream.",
    ),
    (
        FEDERATION_WATCH_STALLS,
        "Watches of the fleet's buckets made again because their stream held a change they had not delivered by the next check, with nothing delivered in between (their consumer's NATS server failed, or the bridge was too busy to read it), by bucket.",
    ),
];

/// The histograms of durations, in seconds, all on the same latency buckets.
const SECONDS_HISTOGRAMS: [&str; 4] = [
    ROUTE_DURATION,
    STORE_WRITE_DURATION,
    FEDERATION_PUBLISH_DURATION,
    FEDERATION_APPLY_LAG,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder (once per process) and returns its handle.
///
/// Several bridges in one process (tests) share the recorder and so their metrics.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let latency = [
                0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25, 0.5, 1.0, 2.5,
            ];
            let depth = [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 256.0, 1024.0, 4096.0];
            let batch = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
            let mut buckets = (SECONDS_HISTOGRAMS.iter().map(|name| (*name, &latency[..])))
                .chain([(MAILBOX_DEPTH, &depth[..]), (STORE_BATCH_SIZE, &batch[..])]);
            let builder = buckets
                .try_fold(PrometheusBuilder::new(), |builder, (name, buckets)| {
                    builder.set_buckets_for_metric(
                        metrics_exporter_prometheus::Matcher::Full(name.into()),
                        buckets,
                    )
                })
                .expect("bucket lists are non-empty");
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics will be empty");
            }
            describe();
            gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
            spawn_upkeep(handle.clone());
            handle
        })
        .clone()
}

/// How often histogram samples are folded into their buckets when nobody scrapes.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// The exporter keeps every histogram sample until it is folded into the buckets, which
/// happens on a scrape or an upkeep. Unscraped, a busy bridge would hold every sample it
/// ever took (one per delivery); the exporter's own `install` (with its own HTTP
/// listener) runs the same loop; `build_recorder`, used here to serve `/metrics` from the
/// admin listener, leaves it to the caller.
fn spawn_upkeep(handle: PrometheusHandle) {
    let spawned = std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(UPKEEP_INTERVAL);
                handle.run_upkeep();
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start metrics upkeep; histograms fold only on scrape");
    }
}

fn describe() {
    for (name, help) in METRICS {
        match *name {
            name if SECONDS_HISTOGRAMS.contains(&name) => {
                metrics::describe_histogram!(name, metrics::Unit::Seconds, *help)
            }
            MAILBOX_DEPTH | STORE_BATCH_SIZE => metrics::describe_histogram!(*name, *help),
            CONNECTIONS | AGENTS_ONLINE | BUILD_INFO | READY | FEDERATION_CONNECTED
            | FEDERATION_OUTBOX | FEDERATION_UNSHARED | FEDERATION_BRIDGES => {
                metrics::describe_gauge!(*name, *help)
            }
            _ => metrics::describe_counter!(*name, *help),
        }
    }
}

pub fn message_received(protocol: &str, kind: &'static str) {
    thread_local! {
        static RECEIVED: Handles<&'static str> = const { Handles::new() };
    }
    increment(
        &RECEIVED,
        protocol,
        kind,
        || counter!(MESSAGES_RECEIVED, "protocol" => protocol.to_owned(), "kind" => kind),
    );
}

pub fn message_delivered(
    from_protocol: &str,
    to_protocol: &'static str,
    kind: &'static str,
    since_accepted: Duration,
) {
    thread_local! {
        static DELIVERED: Handles<(&'static str, &'static str)> = const { Handles::new() };
    }
    static ROUTE: OnceLock<metrics::Histogram> = OnceLock::new();
    increment(&DELIVERED, from_protocol, (to_protocol, kind), || {
        counter!(
            MESSAGES_DELIVERED,
            "from_protocol" => from_protocol.to_owned(),
            "to_protocol" => to_protocol,
            "kind" => kind
        )
    });
    let seconds = since_accepted.as_secs_f64();
    match HANDLE.get() {
        Some(_) => ROUTE
            .get_or_init(|| histogram!(ROUTE_DURATION))
            .record(seconds),
        None => histogram!(ROUTE_DURATION).record(seconds),
    }
}

/// Adds one to the counter of `protocol` and `labels`, through this thread's `handles`.
fn increment<K: Copy + Eq + std::hash::Hash>(
    handles: &'static LocalKey<Handles<K>>,
    protocol: &str,
    labels: K,
    make: impl Fn() -> Counter,
) {
    if handles
        .try_with(|handles| handles.increment(protocol, labels, &make))
        .is_err()
    {
        // The thread is ending and its handles are gone.
        make().increment(1);
    }
}

/// Counter handles of one metric by origin protocol and static labels, for the metrics
/// counted once per message: `counter!` hashes and copies its labels on every call, which
/// shows in profiles. Each thread keeps its own: one map shared by the runtime's threads
/// would move its lock's cache line, and each handle's reference count, between their
/// cores for every message. Handles are only kept once the recorder is installed (one taken
/// before would count nowhere, forever).
struct Handles<K> {
    by_protocol: RefCell<Option<ByProtocol<K>>>,
}

type ByProtocol<K> = HashMap<Box<str>, HashMap<K, Counter>>;

impl<K: Copy + Eq + std::hash::Hash> Handles<K> {
    const fn new() -> Self {
        Handles {
            by_protocol: RefCell::new(None),
        }
    }

    fn increment(&self, protocol: &str, labels: K, make: impl FnOnce() -> Counter) {
        if HANDLE.get().is_none() {
            return make().increment(1);
        }
        if let Some(counter) = self
            .by_protocol
            .borrow()
            .as_ref()
            .and_then(|m| m.get(protocol))
            .and_then(|m| m.get(&labels))
        {
            return counter.increment(1);
        }
        let counter = make();
        counter.increment(1);
        self.by_protocol
            .borrow_mut()
            .get_or_insert_with(HashMap::default)
            .entry(protocol.into())
            .or_default()
            .insert(labels, counter);
    }
}

/// Why a message was dropped: the `reason` label of `MESSAGES_DROPPED`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// Its ttl ran out before it reached its recipient.
    TtlExpired,
    /// A slow reader's backlog could not be kept in the store.
    BacklogNotStored,
    /// The recipient's mailbox was full under `when_full = "disconnect"`.
    MailboxFullDisconnect,
    /// … under `drop_newest`.
    MailboxFullDropNewest,
    /// … under `drop_oldest`.
    MailboxFullDropOldest,
}

impl DropReason {
    const ALL: [DropReason; 5] = [
        DropReason::TtlExpired,
        DropReason::BacklogNotStored,
        DropReason::MailboxFullDisconnect,
        DropReason::MailboxFullDropNewest,
        DropReason::MailboxFullDropOldest,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::TtlExpired => "ttl_expired",
            DropReason::BacklogNotStored => "backlog_not_stored",
            DropReason::MailboxFullDisconnect => "mailbox_full_disconnect",
            DropReason::MailboxFullDropNewest => "mailbox_full_drop_newest",
            DropReason::MailboxFullDropOldest => "mailbox_full_drop_oldest",
        }
    }
}

pub fn message_dropped(protocol: &'static str, reason: DropReason) {
    counter!(MESSAGES_DROPPED, "protocol" => protocol, "reason" => reason.as_str()).increment(1);
}

/// Shows `protocol`'s series in the first scrape, at zero: a series that appears only with
/// its first event reads as missing to dashboards and `rate()` (Prometheus's advice is to
/// export known label sets from the start). Adding zero leaves a value another bridge in
/// this process (tests) has counted as it is.
pub fn endpoint_started(protocol: &'static str) {
    counter!(DECODE_ERRORS, "protocol" => protocol).increment(0);
    gauge!(CONNECTIONS, "protocol" => protocol).increment(0.0);
    gauge!(AGENTS_ONLINE, "protocol" => protocol).increment(0.0);
}

/// Shows the bridge's own series in the first scrape, as `endpoint_started` does an
/// endpoint's: each running protocol's drops by reason and chats received, chats
/// delivered between each pair of them, the histograms, and (`federated`) the fleet's.
pub fn bridge_started(protocols: &[&'static str], federated: bool) {
    ready(false);
    counter!(CONFIG_RELOADS, "outcome" => "ok").increment(0);
    counter!(CONFIG_RELOADS, "outcome" => "refused").increment(0);
    for &protocol in protocols {
        counter!(MESSAGES_RECEIVED, "protocol" => protocol, "kind" => "chat").increment(0);
        for reason in DropReason::ALL {
            counter!(MESSAGES_DROPPED, "protocol" => protocol, "reason" => reason.as_str())
                .increment(0);
        }
        for &to in protocols {
            counter!(MESSAGES_DELIVERED, "from_protocol" => protocol, "to_protocol" => to, "kind" => "chat")
                .increment(0);
        }
    }
    for name in [
        ROUTE_DURATION,
        STORE_WRITE_DURATION,
        STORE_BATCH_SIZE,
        MAILBOX_DEPTH,
    ] {
        drop(histogram!(name));
    }
    if federated {
        gauge!(FEDERATION_CONNECTED).increment(0.0);
        gauge!(FEDERATION_OUTBOX).increment(0.0);
        gauge!(FEDERATION_UNSHARED).increment(0.0);
        gauge!(FEDERATION_BRIDGES).increment(0.0);
        for (direction, outcome) in [("out", "ok"), ("out", "failed"), ("in", "ok")] {
            counter!(FEDERATION_MESSAGES, "direction" => direction, "outcome" => outcome)
                .increment(0);
        }
        counter!(FEDERATION_REFUSED, "reason" => "unreachable").increment(0);
        for outcome in HANDOVER_OUTCOMES {
            counter!(FEDERATION_HANDOVERS, "outcome" => outcome).increment(0);
        }
        counter!(FEDERATION_ACKED_UNWRITTEN).increment(0);
        counter!(FEDERATION_DELIVERY_GAPS).increment(0);
        for watch in WATCHES {
            counter!(FEDERATION_WATCH_STALLS, "watch" => watch).increment(0);
        }
        drop(histogram!(FEDERATION_PUBLISH_DURATION));
        drop(histogram!(FEDERATION_APPLY_LAG));
    }
}

/// Whether the bridge is ready and not degraded (`/readyz` says `ready`).
pub fn ready(ready: bool) {
    gauge!(READY).set(if ready { 1.0 } else { 0.0 });
}

/// A reload of the config, applied (`ok`) or refused.
pub fn config_reloaded(ok: bool) {
    let outcome = if ok { "ok" } else { "refused" };
    counter!(CONFIG_RELOADS, "outcome" => outcome).increment(1);
}

/// Shows `protocol`'s callback outcomes at zero from the start (an endpoint that posts
/// callbacks).
pub fn callbacks_started(protocol: &'static str) {
    for outcome in ["retry", "gave_up", "unencodable"] {
        counter!(CALLBACK_FAILURES, "protocol" => protocol, "outcome" => outcome).increment(0);
    }
}

pub fn decode_error(protocol: &'static str) {
    counter!(DECODE_ERRORS, "protocol" => protocol).increment(1);
}

/// The mailbox depth histogram, fetched once and shared by every mailbox.
pub fn mailbox_depth_histogram() -> metrics::Histogram {
    histogram!(MAILBOX_DEPTH)
}

pub fn store_write(took: Duration, batch: usize) {
    histogram!(STORE_WRITE_DURATION).record(took.as_secs_f64());
    histogram!(STORE_BATCH_SIZE).record(batch as f64);
}

pub fn callback_failed(protocol: &'static str, outcome: &'static str) {
    counter!(CALLBACK_FAILURES, "protocol" => protocol, "outcome" => outcome).increment(1);
}

pub fn connection_opened(protocol: &'static str) {
    gauge!(CONNECTIONS, "protocol" => protocol).increment(1.0);
}

pub fn connection_closed(protocol: &'static str) {
    gauge!(CONNECTIONS, "protocol" => protocol).decrement(1.0);
}

pub fn agent_online(protocol: &'static str, online: bool) {
    let g = gauge!(AGENTS_ONLINE, "protocol" => protocol);
    if online {
        g.increment(1.0)
    } else {
        g.decrement(1.0)
    }
}

pub fn federation_connected(connected: bool) {
    gauge!(FEDERATION_CONNECTED).set(if connected { 1.0 } else { 0.0 });
}

/// `messages` went to the stream in one publish that took `took` to be acknowledged.
pub fn federation_published(took: Duration, messages: usize, ok: bool) {
    histogram!(FEDERATION_PUBLISH_DURATION).record(took.as_secs_f64());
    let outcome = if ok { "ok" } else { "failed" };
    counter!(FEDERATION_MESSAGES, "direction" => "out", "outcome" => outcome)
        .increment(messages as u64);
}

pub fn federation_refused(reason: &'static str) {
    counter!(FEDERATION_REFUSED, "reason" => reason).increment(1);
}

/// `change` more (or fewer) publishes await JetStream's acknowledgement.
pub fn federation_outbox(change: i64) {
    gauge!(FEDERATION_OUTBOX).increment(change as f64);
}

/// `waiting` messages kept while NATS was away wait to be shared, or are being shared.
pub fn federation_unshared(waiting: usize) {
    gauge!(FEDERATION_UNSHARED).set(waiting as f64);
}

/// A message from another bridge was applied here, `lag_ms` after it was accepted there.
pub fn federation_applied(lag_ms: i64) {
    histogram!(FEDERATION_APPLY_LAG).record(lag_ms as f64 / 1000.0);
    counter!(FEDERATION_MESSAGES, "direction" => "in", "outcome" => "ok").increment(1);
}

pub fn federation_bridges(alive: usize) {
    gauge!(FEDERATION_BRIDGES).set(alive as f64);
}

/// How asking for a moved agent's mail ended: `handed_over` (all of it here before it was
/// taken), `late` (answered, not all of it here in time), `unanswered` (no answer in time,
/// or no bridge to answer).
const HANDOVER_OUTCOMES: [&str; 3] = ["handed_over", "late", "unanswered"];

pub fn federation_handover(outcome: &'static str) {
    debug_assert!(HANDOVER_OUTCOMES.contains(&outcome));
    counter!(FEDERATION_HANDOVERS, "outcome" => outcome).increment(1);
}

/// A batch of the stream was acknowledged before all that was routed here was written.
pub fn federation_acknowledged_unwritten() {
    counter!(FEDERATION_ACKED_UNWRITTEN).increment(1);
}

/// A reading of the stream found deliveries of its consumer that went elsewhere.
pub fn federation_delivery_gap() {
    counter!(FEDERATION_DELIVERY_GAPS).increment(1);
}

/// The buckets a bridge watches, as `FEDERATION_WATCH_STALLS` labels them.
const WATCHES: [&str; 3] = ["records", "heartbeats", "cards"];

/// A watch of the fleet's bucket `watch` (one of `WATCHES`) stalled and was made again.
pub fn federation_watch_stalled(watch: &'static str) {
    debug_assert!(WATCHES.contains(&watch));
    counter!(FEDERATION_WATCH_STALLS, "watch" => watch).increment(1);
}

/// Counts a connection for as long as the guard lives.
pub struct ConnectionGuard(&'static str);

impl ConnectionGuard {
    pub fn new(protocol: &'static str) -> Self {
        connection_opened(protocol);
        ConnectionGuard(protocol)
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        connection_closed(self.0);
    }
}
