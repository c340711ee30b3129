//! Finding `@name` mentions in a chat against directories of 10 to 5,000 members: the
//! bridge's index (`at_names::Needles`, one Aho-Corasick automaton of every `@name`)
//! against the naive search, every member's `@name` compared at every `@` of the text,
//! measured in the same run.
//!
//! `cargo bench --bench mentions`

use std::hint::black_box;

use agentbridge::shared::at_names::{Needles, needle};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

const SIZES: [usize; 3] = [10, 1_000, 5_000];
const WORDS: [&str; 8] = [
    "alpha", "bravo", "delta", "kilo", "mike", "nova", "sierra", "tango",
];
/// Three `@`s: two names and an address.
const TEXT: &str = "Hey @Tango-7 and @mike-3, the build at x@ci.example is green again.";

fn mentions(c: &mut Criterion) {
    let mut group = c.benchmark_group("mentions");
    let lower = TEXT.to_lowercase();
    for n in SIZES {
        let names: Vec<String> = (0..n)
            .map(|i| format!("{}-{i}", WORDS[i % WORDS.len()]))
            .collect();
        let indexed = Needles::new(names.iter().map(String::as_str).enumerate());
        group.bench_with_input(BenchmarkId::new("indexed", n), &lower, |b, lower| {
            b.iter(|| {
                indexed
                    .found_in(black_box(lower), |_| true)
                    .copied()
                    .collect::<Vec<_>>()
            })
        });
        let needles: Vec<String> = names.iter().map(|name| needle(name)).collect();
        group.bench_with_input(BenchmarkId::new("every_member", n), &lower, |b, lower| {
            b.iter(|| {
                let from_each_at: Vec<&str> = black_box(lower)
                    .match_indices('@')
                    .map(|(at, _)| &lower[at..])
                    .collect();
                needles
                    .iter()
                    .enumerate()
                    .filter(|(_, needle)| from_each_at.iter().any(|rest| rest.starts_with(*needle)))
                    .map(|(i, _)| i)
                    .collect::<Vec<_>>()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, mentions);
criterion_main!(benches);
