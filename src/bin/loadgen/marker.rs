//! What each load message carries so its receiver can time it: `@@lg:<seq>:<ns>@@`, where
//! `ns` is the send time in nanoseconds on this process's monotonic clock. Senders and
//! receivers run in the same process, so no clock sync is involved. The marker is plain
//! ASCII, so it survives every protocol's encoding (JSON, YAML, protobuf bytes) verbatim
//! and is found by a byte search without parsing the frame. The search is `memchr`'s
//! vectorised one: the load generator shares the machine with the server it measures, so
//! every cycle it spends per message is one the server does not get.

use std::sync::OnceLock;
use std::time::Instant;

static EPOCH: OnceLock<Instant> = OnceLock::new();

/// Nanoseconds since the first call in this process.
pub fn now_ns() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

const OPEN: &[u8] = b"@@lg:";

/// The text of message `seq`, padded with `padding` bytes of filler.
pub fn text(seq: u64, padding: usize) -> String {
    let mut text = format!("@@lg:{seq}:{}@@", now_ns());
    text.extend(std::iter::repeat_n('x', padding));
    text
}

/// Every `(seq, sent_ns)` marker in `frame` (a NATS frame may carry several messages).
pub fn scan(frame: &[u8], mut found: impl FnMut(u64, u64)) {
    let mut rest = frame;
    while let Some(at) = find(rest, OPEN) {
        rest = &rest[at + OPEN.len()..];
        let (seq, after) = number(rest);
        if after.first() != Some(&b':') {
            continue;
        }
        let (ns, after) = number(&after[1..]);
        if after.starts_with(b"@@")
            && let (Some(seq), Some(ns)) = (seq, ns)
        {
            found(seq, ns);
        }
        rest = after;
    }
}

fn number(bytes: &[u8]) -> (Option<u64>, &[u8]) {
    let digits = bytes.iter().take_while(|b| b.is_ascii_digit()).count();
    let value = std::str::from_utf8(&bytes[..digits])
        .ok()
        .and_then(|s| s.parse().ok());
    (value, &bytes[digits..])
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_found_inside_any_encoding() {
        let a = text(7, 3);
        let b = text(8, 0);
        let frame = format!("{{\"text\":\"{a}\"}}\r\nMSG x 1 9\r\n{b}\r\n@@lg:bad@@");
        let mut seen = Vec::new();
        scan(frame.as_bytes(), |seq, _| seen.push(seq));
        assert_eq!(seen, [7, 8]);
    }
}
