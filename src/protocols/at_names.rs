//! Finding `@name` mentions in chat text, case-insensitively, for the protocols whose
//! servers work them out from the text (Skynet, the Tracker). Each decides what counts as
//! the end of a name; finding where a name may start is shared.

/// How `@name` is looked for: lower-cased, with its `@`.
pub fn needle(name: &str) -> String {
    format!("@{}", name.to_lowercase())
}

/// The lower-cased text from each of its `@`s on. A needle occurs in the text exactly
/// where one of these starts with it: a few byte compares per name rather than a search
/// through the whole text.
pub fn from_each_at(lower: &str) -> Vec<&str> {
    lower
        .match_indices('@')
        .map(|(at, _)| &lower[at..])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_at_starts_a_slice() {
        assert_eq!(needle("Bob"), "@bob");
        assert_eq!(from_each_at("x@bob, @@al"), ["@bob, @@al", "@@al", "@al"]);
        assert!(from_each_at("no mention").is_empty());
    }
}
