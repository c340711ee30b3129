//! Finding `@name` mentions in chat text, case-insensitively, for the protocols whose
//! servers work them out from the text (Skynet, the Tracker). Each decides what counts as
//! the end of a name; finding where a name may start is shared.

/// Whether `text` has an `@`, without which it mentions no one: the test a chat passes
/// before the text is lower-cased and the directory's names are looked for in it.
/// `memchr` rather than `contains('@')`, whose searcher cost 150 instructions an `@`.
pub fn has_at(text: &str) -> bool {
    memchr::memchr(b'@', text.as_bytes()).is_some()
}

/// How `@name` is looked for: lower-cased, with its `@`.
pub fn needle(name: &str) -> String {
    format!("@{}", name.to_lowercase())
}

/// The `@name`s of a directory, indexed by the first byte of the name: each `@` of a text
/// is compared only with the names that begin with the byte after it. Built once per
/// directory change; with 5,000 members a chat with an `@` would otherwise make 5,000
/// comparisons for each of its `@`s. A name found answers with its label (what the
/// protocol calls that member: a card id, the name itself).
#[derive(Debug)]
pub struct Needles<T> {
    labels: Vec<T>,
    needles: Vec<String>,
    /// Positions in `needles`, by the name's first byte (the needle's second).
    by_first_byte: Vec<Vec<u32>>,
    /// Needles of an empty name, which every `@` matches.
    bare: Vec<u32>,
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
        let mut by_first_byte = vec![Vec::new(); 256];
        let mut bare = Vec::new();
        for (i, needle) in needles.iter().enumerate() {
            match needle.as_bytes().get(1) {
                Some(&byte) => by_first_byte[usize::from(byte)].push(i as u32),
                None => bare.push(i as u32),
            }
        }
        Needles {
            labels,
            needles,
            by_first_byte,
            bare,
        }
    }

    /// The labels (in their order, each once) of the names that occur in `lower`, a
    /// lower-cased text, right after one of its `@`s, where `ends` accepts what follows
    /// the name.
    pub fn found_in(&self, lower: &str, ends: impl Fn(&str) -> bool) -> impl Iterator<Item = &T> {
        let mut found = Vec::new();
        // memchr rather than `match_indices('@')`, as in `has_at`.
        for at in memchr::memchr_iter(b'@', lower.as_bytes()) {
            let rest = &lower[at..];
            let same_start = rest
                .as_bytes()
                .get(1)
                .and_then(|&byte| self.by_first_byte.get(usize::from(byte)))
                .map_or(&[][..], Vec::as_slice);
            for &i in same_start.iter().chain(&self.bare) {
                let i = i as usize;
                if rest
                    .strip_prefix(self.needles[i].as_str())
                    .is_some_and(&ends)
                {
                    found.push(i);
                }
            }
        }
        found.sort_unstable();
        found.dedup();
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
