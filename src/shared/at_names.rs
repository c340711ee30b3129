//! Finding `@name` mentions in chat text, case-insensitively, for the protocols whose
//! servers work them out from the text (Skynet, the Tracker). Each decides what counts as
//! the end of a name; finding where a name may start is shared.

use aho_corasick::AhoCorasick;

/// Whether `text` has an `@`, without which it mentions no one: the test a chat passes
/// before the text is lower-cased and the directory's names are looked for in it.
/// `memchr` rather than `contains('@')`: the standard library's char searcher does far
/// more work at each `@` (BENCHMARKS.md).
pub fn has_at(text: &str) -> bool {
    memchr::memchr(b'@', text.as_bytes()).is_some()
}

/// How `@name` is looked for: lower-cased, with its `@`.
pub fn needle(name: &str) -> String {
    format!("@{}", name.to_lowercase())
}

/// The most matches of names one text is searched for: far more than a real chat makes,
/// and a bound on the work a hostile one can cause.
pub const MAX_HITS: usize = 65_536;

/// The `@name`s of a directory, searched for all at once: one pass over the text, however
/// many names there are and however many `@`s it has (an Aho-Corasick automaton, built
/// once per directory change). A name found answers with its label (what the protocol
/// calls that member: a card id, the name itself).
#[derive(Debug)]
pub struct Needles<T> {
    labels: Vec<T>,
    /// `None` when there are no names.
    automaton: Option<AhoCorasick>,
}

impl<T> Default for Needles<T> {
    fn default() -> Self {
        Needles::new(std::iter::empty::<(T, &str)>())
    }
}

impl<T> Needles<T> {
    /// `(label, name)` of each name to look for, in the order they are answered.
    pub fn new<N: AsRef<str>>(named: impl IntoIterator<Item = (T, N)>) -> Needles<T> {
        let (labels, needles): (Vec<T>, Vec<String>) = named
            .into_iter()
            .map(|(label, name)| (label, needle(name.as_ref())))
            .unzip();
        let automaton = (!needles.is_empty())
            .then(|| AhoCorasick::new(&needles).expect("plain strings make an automaton"));
        Needles { labels, automaton }
    }

    /// The labels (in their order, each once) of the names that occur in `lower`, a
    /// lower-cased text, right after one of its `@`s, where `ends` accepts what follows
    /// the name. Linear in the text, and bounded: names that are prefixes of one another
    /// (`@a`, `@aa`, …) can match many times at each `@`, so past `MAX_HITS` matches the
    /// rest of the text is not looked at.
    pub fn found_in(&self, lower: &str, ends: impl Fn(&str) -> bool) -> impl Iterator<Item = &T> {
        // Each name once, however often the text repeats it.
        let mut found = Vec::new();
        let mut seen = foldhash::HashSet::default();
        if let Some(automaton) = &self.automaton {
            for hit in automaton.find_overlapping_iter(lower).take(MAX_HITS) {
                let i = hit.pattern().as_usize();
                if !seen.contains(&i) && ends(&lower[hit.end()..]) {
                    seen.insert(i);
                    found.push(i);
                }
            }
        }
        found.sort_unstable();
        found.into_iter().map(|i| &self.labels[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_found_after_any_at_in_their_order_once_each() {
        assert_eq!(needle("Bob"), "@bob");
        let names = Needles::new([(0, "bob"), (1, "al"), (2, "Alice"), (3, "zed")]);
        let found = |text: &str, ends: &dyn Fn(&str) -> bool| -> Vec<i32> {
            names.found_in(text, ends).copied().collect()
        };
        let anywhere = |_: &str| true;
        assert_eq!(found("x@bob, @@alice @al @bob", &anywhere), [0, 1, 2]);
        assert!(found("no mention @ all", &anywhere).is_empty());
        let whole = |after: &str| !after.starts_with(|c: char| c.is_alphanumeric());
        assert_eq!(found("@alice", &whole), [2]);
    }

    #[test]
    fn names_nested_in_one_another_are_looked_for_a_bounded_number_of_times() {
        // 1,000 names each a prefix of the next, then `zed`, in a text of 100 `@`s each
        // followed by all of the nested names: 100,000 matches before `@zed`, past the
        // bound.
        let mut names: Vec<(usize, String)> = (1..=1000).map(|n| (n, "a".repeat(n))).collect();
        names.push((0, "zed".into()));
        let needles = Needles::new(names.iter().map(|(n, name)| (*n, name.as_str())));
        let text = format!("@{}", "a".repeat(1000)).repeat(100) + "@zed";
        let found: Vec<usize> = needles.found_in(&text, |_| true).copied().collect();
        assert_eq!(found.len(), 1000);
        assert!(!found.contains(&0));
    }

    #[test]
    fn a_name_that_is_empty_is_found_at_every_at() {
        let names = Needles::new([("empty", ""), ("bob", "bob")]);
        for text in ["@x", "@"] {
            assert_eq!(
                names.found_in(text, |_| true).collect::<Vec<_>>(),
                [&"empty"]
            );
        }
    }
}
