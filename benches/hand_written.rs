//! The hand-written pieces of `shared/` against the crate each stands in for, on the same
//! input: what the doc comment of each claims is measured here.
//!
//! - `shared::clock::iso8601` against `time`'s formatter with the same description;
//! - `shared::json_writer::ObjectWriter` against `serde_json::to_writer` of a derived
//!   `Serialize` struct with the same fields, byte for byte the same text.

use std::hint::black_box;

use agentbridge::shared::clock::iso8601;
use agentbridge::shared::json_writer::ObjectWriter;
use criterion::{Criterion, criterion_group, criterion_main};
use serde::Serialize;
use time::OffsetDateTime;
use time::format_description::BorrowedFormatItem;

const AT_MS: i64 = 1_769_272_200_123;

fn clock(c: &mut Criterion) {
    let format: Vec<BorrowedFormatItem<'static>> = time::format_description::parse(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z",
    )
    .unwrap();
    let with_time = |ms: i64| {
        OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
            .unwrap()
            .format(&format)
            .unwrap()
    };
    assert_eq!(iso8601(AT_MS), with_time(AT_MS));
    let mut group = c.benchmark_group("iso8601");
    group.bench_function("shared::clock", |b| b.iter(|| iso8601(black_box(AT_MS))));
    group.bench_function("time", |b| b.iter(|| with_time(black_box(AT_MS))));
    group.finish();
}

/// A chat as the bridge writes it to a Skynet peer: short strings, mostly.
#[derive(Serialize)]
struct Chat<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    id: &'a str,
    from: &'a str,
    from_name: &'a str,
    to: &'a str,
    text: &'a str,
    timestamp: &'a str,
    reply_to: Option<&'a str>,
    correlation_id: &'a str,
    thread: &'a str,
    mentions: &'a [String],
}

const CHAT: Chat<'static> = Chat {
    kind: "message",
    id: "0193f1a2-7c4e-7d2b-9a51-3f0e6c2b8d14",
    from: "6f1d2c3b-4a5e-4f60-8a7b-9c0d1e2f3a4b",
    from_name: "planner",
    to: "coder",
    text: "@coder the build on main fails in store::writer; can you take it?",
    timestamp: "2026-01-24T16:30:00.123Z",
    reply_to: None,
    correlation_id: "0193f1a2-7c4e-7d2b-9a51-3f0e6c2b8d10",
    thread: "build",
    mentions: &[],
};

fn written(chat: &Chat<'_>, out: &mut Vec<u8>) {
    let mut o = ObjectWriter::start(out);
    o.string("type", chat.kind);
    o.string("id", chat.id);
    o.string("from", chat.from);
    o.string("from_name", chat.from_name);
    o.string("to", chat.to);
    o.string("text", chat.text);
    o.string("timestamp", chat.timestamp);
    o.string_or_null("reply_to", chat.reply_to);
    o.string("correlation_id", chat.correlation_id);
    o.string("thread", chat.thread);
    o.strings("mentions", chat.mentions);
    o.end();
}

fn json_object(c: &mut Criterion) {
    let mentions = vec!["coder".to_owned()];
    let chat = Chat {
        mentions: &mentions,
        ..CHAT
    };
    let mut ours = Vec::new();
    written(&chat, &mut ours);
    assert_eq!(ours, serde_json::to_vec(&chat).unwrap(), "the same text");
    let mut group = c.benchmark_group("json_object");
    group.bench_function("shared::json_writer", |b| {
        let mut out = Vec::with_capacity(512);
        b.iter(|| {
            out.clear();
            written(black_box(&chat), &mut out);
            black_box(out.len())
        })
    });
    group.bench_function("serde_json", |b| {
        let mut out = Vec::with_capacity(512);
        b.iter(|| {
            out.clear();
            serde_json::to_writer(&mut out, black_box(&chat)).unwrap();
            black_box(out.len())
        })
    });
    group.finish();
}

criterion_group!(benches, clock, json_object);
criterion_main!(benches);
