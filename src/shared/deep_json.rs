//! Reading JSON the bridge wrote itself, however deep. What a client sends is read within
//! serde_json's limit of 128 levels, and the bridge then wraps it (a stored body holds the
//! message's data and its native frame; a replica holds the stored body): read back with
//! the limit, a payload near it would fail to decode, and a message accepted would be lost
//! from history and from the fleet. Such text is read again without the limit, up to
//! `MOST_DEPTH` levels: JSON the bridge writes stays far within that, and a replica that
//! is not a bridge's (the stream takes any publish) cannot recurse past a thread's stack.

use serde::Deserialize;

/// Levels read at most, past serde_json's own limit.
const MOST_DEPTH: usize = 256;

/// `T` from `text`, within `MOST_DEPTH` levels: for JSON the bridge wrote, never a
/// client's. Text within serde_json's limit, as nearly all is, is read once.
pub fn from_own_str<'a, T: Deserialize<'a>>(text: &'a str) -> serde_json::Result<T> {
    match serde_json::from_str(text) {
        Err(e) if too_deep(&e) && depth(text) <= MOST_DEPTH => {
            let mut reader = serde_json::Deserializer::from_str(text);
            reader.disable_recursion_limit();
            let value = T::deserialize(&mut reader)?;
            reader.end()?;
            Ok(value)
        }
        read => read,
    }
}

/// Whether serde_json refused the text for its depth alone.
fn too_deep(e: &serde_json::Error) -> bool {
    e.is_syntax() && e.to_string().starts_with("recursion limit exceeded")
}

/// How deep arrays and objects nest in `text`, strings skipped.
fn depth(text: &str) -> usize {
    let (mut depth, mut most, mut in_string, mut escaped) = (0usize, 0, false, false);
    for byte in text.bytes() {
        match (in_string, byte) {
            (true, _) if escaped => escaped = false,
            (true, b'\\') => escaped = true,
            (true, b'"') => in_string = false,
            (true, _) => {}
            (false, b'"') => in_string = true,
            (false, b'[' | b'{') => {
                depth += 1;
                most = most.max(depth);
            }
            (false, b']' | b'}') => depth = depth.saturating_sub(1),
            (false, _) => {}
        }
    }
    most
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(levels: usize) -> String {
        format!(
            "{{\"a\":{}1{}}}",
            "[".repeat(levels - 1),
            "]".repeat(levels - 1)
        )
    }

    #[test]
    fn json_deeper_than_a_clients_limit_is_read_whole() {
        let deep = nested(200);
        assert!(serde_json::from_str::<serde_json::Value>(&deep).is_err());
        let read: serde_json::Value = from_own_str(&deep).unwrap();
        assert_eq!(read.to_string(), deep);
        assert!(from_own_str::<serde_json::Value>("{} trailing").is_err());
    }

    #[test]
    fn json_past_the_most_depth_is_refused_and_strings_do_not_count() {
        assert!(from_own_str::<serde_json::Value>(&nested(MOST_DEPTH + 1)).is_err());
        assert_eq!(depth(&nested(MOST_DEPTH)), MOST_DEPTH);
        assert_eq!(depth(r#"{"a":"[[[{{\"]]"}"#), 1);
    }
}
