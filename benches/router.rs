//! Router fan-out against the floor: a bare `tokio::sync::mpsc` send of the same `Arc` to
//! the same number of receivers, measured in the same run.
//!
//! Each iteration routes one message to N connected recipients and drains their
//! mailboxes; the baseline sends one `Arc` into N bounded channels and drains them. The
//! Prometheus recorder is installed, as it is in the running bridge.
//!
//! `cargo bench --bench router`

use std::hint::black_box;
use std::sync::Arc;

use agentbridge::core::{AddressedOnly, Delivery, Directory, Envelope, Kind, Router, WhenFull};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

const FAN_OUTS: [usize; 3] = [1, 10, 100];

fn fan_out(c: &mut Criterion) {
    agentbridge::telemetry::install();
    let mut group = c.benchmark_group("fan_out");
    for n in FAN_OUTS {
        group.throughput(Throughput::Elements(n as u64));

        let router = Router::new(Arc::new(Directory::new()), 1024, WhenFull::DropOldest, 0);
        let names: Vec<String> = (0..n).map(|i| format!("agent-{i}")).collect();
        let sessions: Vec<_> = names
            .iter()
            .map(|name| router.attach(name, router.mailbox("bench"), Arc::new(AddressedOnly)))
            .collect();
        let mut env = Envelope::new("bench", "sender", Kind::Chat);
        env.text = Some("hello".into());
        env.mentions = names.clone();
        let delivery = Arc::new(Delivery::new(env));
        group.bench_with_input(BenchmarkId::new("router", n), &n, |b, _| {
            b.iter(|| {
                router.route(black_box(&delivery));
                for session in &sessions {
                    black_box(session.mailbox.try_recv().ok().flatten());
                }
            })
        });

        let channels: Vec<_> = (0..n)
            .map(|_| tokio::sync::mpsc::channel::<Arc<Delivery>>(1024))
            .collect();
        let (senders, mut receivers): (Vec<_>, Vec<_>) = channels.into_iter().unzip();
        group.bench_with_input(BenchmarkId::new("mpsc_baseline", n), &n, |b, _| {
            b.iter(|| {
                for tx in &senders {
                    let _ = tx.try_send(black_box(delivery.clone()));
                }
                for rx in &mut receivers {
                    black_box(rx.try_recv().ok());
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, fan_out);
criterion_main!(benches);
