//! Reading JSON the bridge wrote itself, however deep. What a client sends is read within
//! serde_json's limit of 128 levels, and the bridge then wraps it (a stored body holds the
//! message's data and its native frame; a replica holds the stored body): read back with
//! the limit, a payload near it would fail to decode, and a message accepted would be lost
//! from history and from the fleet. The depth is bounded by what the endpoints accept plus
//! a few levels of wrapping, far within a thread's stack.

use serde::Deserialize;

/// `T` from `text`, with no recursion limit: for JSON the bridge wrote, never a client's.
pub fn from_own_str<'a, T: Deserialize<'a>>(text: &'a str) -> serde_json::Result<T> {
    let mut reader = serde_json::Deserializer::from_str(text);
    reader.disable_recursion_limit();
    let value = T::deserialize(&mut reader)?;
    reader.end()?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_deeper_than_a_clients_limit_is_read_whole() {
        let deep = format!("{{\"a\":{}1{}}}", "[".repeat(200), "]".repeat(200));
        assert!(serde_json::from_str::<serde_json::Value>(&deep).is_err());
        let read: serde_json::Value = from_own_str(&deep).unwrap();
        assert_eq!(read.to_string(), deep);
        assert!(from_own_str::<serde_json::Value>("{} trailing").is_err());
    }
}
