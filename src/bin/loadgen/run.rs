//! One measured run: each sender sends to its own receiver, at a fixed rate or flat out
//! with a window of messages in flight, for a time or a count; receivers time every message
//! from the send time its marker carries.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::agents::{Receiver, Sender};
use super::marker;

/// How much load to offer.
#[derive(Clone, Debug)]
pub struct Load {
    pub window: usize,
    /// Messages per second over all senders; `None` is flat out within the window.
    pub rate: Option<f64>,
    pub duration: Duration,
    /// Stop after this many messages over all senders, if it comes first.
    pub count: Option<u64>,
    pub payload: usize,
    /// Senders choose their messages' ids (random UUIDv4s).
    pub client_ids: bool,
}

/// What a run measured.
#[derive(Debug)]
pub struct Outcome {
    pub sent: u64,
    pub delivered: u64,
    /// From the first send to the last delivery.
    pub elapsed: Duration,
    /// Latency in microseconds.
    pub latency: Histogram<u64>,
    pub send_errors: u64,
}

impl Outcome {
    pub fn rate(&self) -> f64 {
        self.delivered as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn lost(&self) -> u64 {
        self.sent.saturating_sub(self.delivered)
    }
}

/// A sender and receiver pair's shared count, for the window.
#[derive(Default)]
struct Pair {
    received: AtomicU64,
    arrived: Notify,
}

/// How long, after the last send, deliveries are still waited for before the rest count
/// as lost.
const DRAIN: Duration = Duration::from_secs(5);

pub async fn run(pairs: Vec<(Sender, Receiver)>, load: &Load, progress: &ProgressBar) -> Outcome {
    let n = pairs.len().max(1) as u64;
    let stop_sending = CancellationToken::new();
    let stop_receiving = CancellationToken::new();
    let delivered_total = Arc::new(AtomicU64::new(0));
    let last_delivery_ns = Arc::new(AtomicU64::new(0));
    let start_ns = marker::now_ns();
    let per_sender = load.count.map(|c| c.div_ceil(n));

    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for (sender, receiver) in pairs {
        let pair = Arc::new(Pair::default());
        receivers.push(tokio::spawn(receive(
            receiver,
            pair.clone(),
            delivered_total.clone(),
            last_delivery_ns.clone(),
            stop_receiving.clone(),
        )));
        senders.push(tokio::spawn(send(
            sender,
            pair,
            load.clone(),
            per_sender,
            n,
            stop_sending.clone(),
        )));
    }

    // Sending stops at the deadline (or when every sender reached its count).
    let deadline = tokio::time::sleep(load.duration);
    tokio::pin!(deadline);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let all_sent = futures_util::future::join_all(senders);
    tokio::pin!(all_sent);
    let sent_results = loop {
        tokio::select! {
            results = &mut all_sent => break results,
            _ = &mut deadline, if !stop_sending.is_cancelled() => stop_sending.cancel(),
            _ = tick.tick() => show(progress, &delivered_total, start_ns),
        }
    };
    let (sent, send_errors) = sent_results
        .into_iter()
        .map(|r| r.unwrap_or((0, 1)))
        .fold((0, 0), |(s, e), (s2, e2)| (s + s2, e + e2));

    // Then deliveries are awaited until all arrived or the drain time is up.
    let drain_until = tokio::time::Instant::now() + DRAIN;
    while delivered_total.load(Ordering::Relaxed) < sent
        && tokio::time::Instant::now() < drain_until
    {
        tick.tick().await;
        show(progress, &delivered_total, start_ns);
    }
    stop_receiving.cancel();
    let mut latency = Histogram::<u64>::new(3).expect("3 significant figures is valid");
    for histogram in futures_util::future::join_all(receivers)
        .await
        .into_iter()
        .flatten()
    {
        let _ = latency.add(&histogram);
    }
    let delivered = delivered_total.load(Ordering::Relaxed);
    let end_ns = last_delivery_ns.load(Ordering::Relaxed).max(start_ns + 1);
    Outcome {
        sent,
        delivered,
        elapsed: Duration::from_nanos(end_ns - start_ns),
        latency,
        send_errors,
    }
}

fn show(progress: &ProgressBar, delivered: &AtomicU64, start_ns: u64) {
    let delivered = delivered.load(Ordering::Relaxed);
    let secs = (marker::now_ns() - start_ns) as f64 / 1e9;
    progress.set_message(format!(
        "{delivered} delivered, {:.0} msg/s",
        delivered as f64 / secs.max(1e-9)
    ));
    progress.tick();
}

/// Sends until told to stop or `limit` is reached; returns (sent, errors).
async fn send(
    mut sender: Sender,
    pair: Arc<Pair>,
    load: Load,
    limit: Option<u64>,
    senders: u64,
    stop: CancellationToken,
) -> (u64, u64) {
    let mut pace = load.rate.map(|rate| {
        let mut interval = tokio::time::interval(Duration::from_secs_f64(senders as f64 / rate));
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        interval
    });
    let mut seq = 0u64;
    while !stop.is_cancelled() && limit.is_none_or(|l| seq < l) {
        if let Some(pace) = &mut pace {
            tokio::select! {
                _ = pace.tick() => {}
                _ = stop.cancelled() => break,
            }
        }
        // Never more than `window` in flight: wait for a delivery to free a slot.
        loop {
            let arrived = pair.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if seq.saturating_sub(pair.received.load(Ordering::Acquire)) < load.window as u64 {
                break;
            }
            tokio::select! {
                _ = arrived => {}
                _ = stop.cancelled() => return (seq, 0),
            }
        }
        let text = marker::text(seq, load.payload);
        if sender.send(seq, &text).await.is_err() {
            return (seq, 1);
        }
        seq += 1;
    }
    (seq, 0)
}

/// Receives until told to stop; returns this receiver's latencies.
async fn receive(
    mut receiver: Receiver,
    pair: Arc<Pair>,
    delivered: Arc<AtomicU64>,
    last_delivery_ns: Arc<AtomicU64>,
    stop: CancellationToken,
) -> Histogram<u64> {
    let mut latency = Histogram::<u64>::new(3).expect("3 significant figures is valid");
    loop {
        let frame = tokio::select! {
            frame = receiver.next() => frame,
            _ = stop.cancelled() => break,
        };
        let Some(frame) = frame else { break };
        let mut count = 0;
        let now = marker::now_ns();
        marker::scan(&frame, |_, sent_ns| {
            let _ = latency.record(now.saturating_sub(sent_ns) / 1_000);
            count += 1;
        });
        if count > 0 {
            delivered.fetch_add(count, Ordering::Relaxed);
            last_delivery_ns.fetch_max(now, Ordering::Relaxed);
            pair.received.fetch_add(count, Ordering::Release);
            pair.arrived.notify_one();
        }
    }
    latency
}
