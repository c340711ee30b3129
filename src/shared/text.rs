//! Small pieces of text handling every endpoint needs.

/// Values a client sent, named in an error text: at most the first five, each cut to 64
/// characters, then how many more there were. An answer never grows with the input.
pub fn a_few(values: &[impl AsRef<str>]) -> String {
    const SHOWN: usize = 5;
    const CHARS: usize = 64;
    let mut text = String::new();
    for (i, value) in values.iter().take(SHOWN).enumerate() {
        if i > 0 {
            text.push_str(", ");
        }
        let value = value.as_ref();
        match value.char_indices().nth(CHARS) {
            Some((cut, _)) => {
                text.push_str(&value[..cut]);
                text.push('…');
            }
            None => text.push_str(value),
        }
    }
    if values.len() > SHOWN {
        text.push_str(&format!(" and {} more", values.len() - SHOWN));
    }
    text
}

/// The token of an `Authorization: Bearer <token>` header value.
pub fn bearer_token(authorization: &str) -> Option<&str> {
    authorization
        .strip_prefix("Bearer ")
        .or_else(|| authorization.strip_prefix("bearer "))
        .map(str::trim)
}

/// Lower-case hex of `bytes` (digests kept as text: token hashes, scratchpad entries).
/// The `hex` crate's, into one string: a `format!` a byte was 17,000 instructions a
/// Tracker REST call (the token's hash), most of its sign-in.
pub fn hex(bytes: &[u8]) -> String {
    hex::encode(bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn hex_is_lower_case_two_digits_a_byte() {
        assert_eq!(super::hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");
        assert_eq!(super::hex(&[]), "");
    }

    use super::*;

    #[test]
    fn a_few_names_at_most_five_values_each_cut_short() {
        assert_eq!(a_few(&["a", "b"]), "a, b");
        let many: Vec<String> = (0..60_000).map(|i| format!("id-{i}")).collect();
        assert_eq!(a_few(&many), "id-0, id-1, id-2, id-3, id-4 and 59995 more");
        let long = "é".repeat(100);
        assert_eq!(a_few(&[&long]), format!("{}…", "é".repeat(64)));
    }
}

/// Optional bytes as standard base64 text in JSON (`#[serde(with = ...)]`), for records
/// that carry an encoded payload.
pub mod base64_bytes {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(bytes) => s.serialize_some(&STANDARD.encode(bytes)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        let Some(text) = Option::<String>::deserialize(d)? else {
            return Ok(None);
        };
        (STANDARD.decode(text))
            .map(Some)
            .map_err(serde::de::Error::custom)
    }
}
