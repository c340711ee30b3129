//! The scratchpad's entry form: one message as a markdown heading and a fenced YAML block,
//! written by `entry` and read back by `parse_entries`:
//!
//! ````markdown
//! ### [2026-01-24T16:30:00Z] notification | executor-001 -> broadcast
//!
//! ```yaml
//! message:
//!   action: "discovery"
//!   payload: { … }
//! ```
//! ````

use std::borrow::Cow;

use serde_json::{Value, json};

use super::wire::{
    BROADCAST, CONTENT_FIELDS, Invalid, Message, Party, to_yaml, validate, yaml_options,
};
use crate::shared::clock::iso8601;

/// One scratchpad entry for `message` (a `message:` object with type, sender, receiver).
pub fn entry(message: &Value) -> String {
    let field = |path: &[&str]| {
        path.iter()
            .try_fold(message, |v, k| v.get(k))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let timestamp = Some(field(&["timestamp"]))
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| iso8601(crate::core::now_ms()));
    let sender = match (
        field(&["sender", "agent"]),
        field(&["sender", "instance_id"]),
    ) {
        (agent, instance) if instance.is_empty() => agent,
        (_, instance) => instance,
    };
    let receiver = Some(field(&["receiver", "agent"]))
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| BROADCAST.into());
    format!(
        "\n### [{timestamp}] {} | {sender} -> {receiver}\n\n```yaml\n{}```\n",
        field(&["type"]),
        to_yaml(&short_form(message))
    )
}

/// `message` as the document's scratchpad example writes it: `action`, `payload` and
/// `context` right under `message:`, not under `content:` (`validate` reads both forms).
/// A `content` holding anything else is left whole: read back, a `content:` mapping is
/// where all three are looked for.
fn short_form(message: &Value) -> Cow<'_, Value> {
    let Value::Object(fields) = message else {
        return Cow::Borrowed(message);
    };
    let short = match fields.get("content") {
        Some(Value::Object(content)) => {
            content.keys().all(|k| CONTENT_FIELDS.contains(&k.as_str()))
                && CONTENT_FIELDS.iter().all(|k| !fields.contains_key(*k))
        }
        _ => false,
    };
    if !short {
        return Cow::Borrowed(message);
    }
    let mut fields = fields.clone();
    if let Some(Value::Object(content)) = fields.remove("content") {
        fields.extend(content);
    }
    Cow::Owned(Value::Object(fields))
}

/// A scratchpad entry found in a file: its text, and the message it holds or why not.
#[derive(Debug)]
pub struct Entry<'a> {
    pub text: &'a str,
    pub message: Result<Message, Invalid>,
}

/// The complete entries in `text`, and how many bytes of it were consumed (an entry still
/// being written is left for the next read).
pub fn parse_entries(text: &str) -> (Vec<Entry<'_>>, usize) {
    let mut entries = Vec::new();
    let mut consumed = 0;
    let mut at = 0;
    while let Some(found) = text[at..].find("### [") {
        let start = at + found;
        // Only headings at the start of a line.
        if start > 0 && text.as_bytes()[start - 1] != b'\n' {
            at = start + 5;
            continue;
        }
        let heading_end = match text[start..].find('\n') {
            Some(n) => start + n,
            None => return (entries, start),
        };
        let heading = text[start..heading_end].trim_end_matches('\r');
        let rest = &text[heading_end + 1..];
        // The fenced block must follow, after blank lines.
        let trimmed = rest.trim_start_matches(['\n', '\r', ' ', '\t']);
        let fence_start = heading_end + 1 + (rest.len() - trimmed.len());
        if !(trimmed.starts_with("```yaml") || trimmed.starts_with("```yml")) {
            let first = trimmed.split('\n').next().unwrap_or("");
            if !trimmed.contains('\n')
                && ("```yaml".starts_with(first) || "```yml".starts_with(first))
            {
                // The block may not be written yet.
                return (entries, start);
            }
            // A heading of that shape with no yaml block is just markdown.
            at = heading_end;
            consumed = heading_end;
            continue;
        }
        let body_start = match text[fence_start..].find('\n') {
            Some(n) => fence_start + n + 1,
            None => return (entries, start),
        };
        let (message, end) = match find_fence_end(&text[body_start..]) {
            FenceEnd::Pending => return (entries, start),
            FenceEnd::Closed { line, after } => (
                parse_entry(heading, &text[body_start..body_start + line]),
                body_start + after,
            ),
            // The next entry began before this one's block was closed: this entry alone is
            // refused, and the next is read as itself.
            FenceEnd::Unclosed { next } => (Err(unclosed(heading)), body_start + next),
        };
        entries.push(Entry {
            text: &text[start..end],
            message,
        });
        consumed = end;
        at = end;
    }
    // The rest is plain text, except a last line still being written, which may yet
    // become a heading.
    let complete = text[consumed..]
        .rfind('\n')
        .map_or(consumed, |n| consumed + n + 1);
    (entries, complete)
}

/// How an entry's fenced block ends.
enum FenceEnd {
    /// At the closing fence: the offset of its line, and of what follows it.
    Closed { line: usize, after: usize },
    /// Not before the next entry's heading, at this offset.
    Unclosed { next: usize },
    /// Not yet: the block may still be being written.
    Pending,
}

fn find_fence_end(body: &str) -> FenceEnd {
    let mut offset = 0;
    for line in body.split_inclusive('\n') {
        // A closing fence needs no newline after it: a writer that trims its entry ends
        // the file with one. (Only spaces may follow a closing fence, so the block is
        // whole either way.)
        if line.trim_end() == "```" {
            return FenceEnd::Closed {
                line: offset,
                after: offset + line.len(),
            };
        }
        if line.starts_with("### [") {
            return FenceEnd::Unclosed { next: offset };
        }
        offset += line.len();
    }
    FenceEnd::Pending
}

/// Why an entry whose block was never closed is refused, addressed to its sender.
fn unclosed(heading: &str) -> Invalid {
    let mut invalid = Invalid::new(
        "message",
        "the entry's ```yaml block is not closed (no ``` line) before the next entry",
    );
    match parse_heading(heading) {
        Ok((_, _, sender, _)) => {
            invalid.sender = Some(Box::new(Party {
                agent: sender,
                instance_id: None,
            }))
        }
        Err(heading_invalid) => invalid.sender = heading_invalid.sender,
    }
    invalid
}

fn parse_entry(heading: &str, body: &str) -> Result<Message, Invalid> {
    let (timestamp, msg_type, sender, receiver) = parse_heading(heading)?;
    let with_sender = |mut e: Invalid| {
        e.sender = Some(Box::new(Party {
            agent: sender.clone(),
            instance_id: None,
        }));
        e
    };
    let doc: Value =
        serde_saphyr::from_str_with_options(body, yaml_options(body)).map_err(|e| {
            with_sender(Invalid::new(
                "message",
                format!("the entry's yaml does not parse: {e}"),
            ))
        })?;
    let Some(Value::Object(mut msg)) = doc.get("message").cloned() else {
        return Err(with_sender(Invalid::new(
            "message",
            "the entry's yaml must hold a `message:` mapping",
        )));
    };
    // The heading supplies what the block leaves out.
    msg.entry("timestamp").or_insert(json!(timestamp));
    msg.entry("type").or_insert(json!(msg_type));
    msg.entry("sender").or_insert(json!({ "agent": sender }));
    msg.entry("receiver")
        .or_insert(json!({ "agent": receiver }));
    validate(json!({ "message": msg }))
}

/// `### [time] type | sender -> receiver`
fn parse_heading(heading: &str) -> Result<(String, String, String, String), Invalid> {
    let bad = || {
        Invalid::new(
            "heading",
            format!(
                "entry heading must be `### [ISO-time] type | sender -> receiver`, not `{heading}`"
            ),
        )
    };
    let rest = heading.strip_prefix("### [").ok_or_else(bad)?;
    let (timestamp, rest) = rest.split_once(']').ok_or_else(bad)?;
    let (msg_type, rest) = rest.split_once('|').ok_or_else(bad)?;
    let (sender, receiver) = rest.split_once("->").ok_or_else(bad)?;
    let (msg_type, sender, receiver) = (msg_type.trim(), sender.trim(), receiver.trim());
    if msg_type.is_empty()
        || sender.is_empty()
        || receiver.is_empty()
        || sender.contains(' ')
        || receiver.contains(' ')
    {
        let mut e = bad();
        if !sender.is_empty() && !sender.contains(' ') {
            e.sender = Some(Box::new(Party {
                agent: sender.to_owned(),
                instance_id: None,
            }));
        }
        return Err(e);
    }
    Ok((
        timestamp.trim().to_owned(),
        msg_type.to_owned(),
        sender.to_owned(),
        receiver.to_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::clock::parse_iso8601;

    fn doc(yaml: &str) -> Value {
        serde_saphyr::from_str(yaml).unwrap()
    }

    #[test]
    fn scratchpad_entries_parse_from_the_documented_form() {
        let text = "# Scratchpad\n\nsome notes\n\n### [2026-01-24T16:30:00Z] notification | executor-001 -> broadcast\n\n```yaml\nmessage:\n  action: \"discovery\"\n  payload:\n    topic: \"auth\"\n```\n\nmore notes\n";
        let (entries, consumed) = parse_entries(text);
        assert_eq!(consumed, text.len());
        assert_eq!(entries.len(), 1);
        let msg = entries[0].message.as_ref().unwrap();
        assert_eq!(
            (msg.msg_type.as_str(), msg.sender.agent.as_str()),
            ("notification", "executor-001")
        );
        assert!(msg.receiver.is_broadcast());
        assert_eq!(msg.action.as_deref(), Some("discovery"));
        assert_eq!(msg.payload()["topic"], "auth");
        assert_eq!(
            msg.timestamp,
            parse_iso8601("2026-01-24T16:30:00Z").unwrap()
        );
        assert_eq!(
            msg.raw["content"]["action"], "discovery",
            "the short form is normalised"
        );
        assert!(msg.raw.get("action").is_none());
    }

    #[test]
    fn an_entry_being_written_is_left_for_later() {
        let whole = "### [2026-01-24T16:30:00Z] request | planner -> executor\n\n```yaml\nmessage:\n  action: mission_assigned\n```\n";
        for cut in [10, 40, 60, 75, whole.len() - 2] {
            let (entries, consumed) = parse_entries(&whole[..cut]);
            assert!(entries.is_empty(), "cut at {cut}");
            assert_eq!(consumed, 0, "cut at {cut}");
        }
        let (entries, consumed) = parse_entries(whole);
        assert_eq!((entries.len(), consumed), (1, whole.len()));
        // Written without a last newline, as by a writer that trims its entry.
        let trimmed = whole.trim_end();
        let (entries, consumed) = parse_entries(trimmed);
        assert_eq!((entries.len(), consumed), (1, trimmed.len()));
        assert!(entries[0].message.is_ok());
    }

    #[test]
    fn malformed_entries_are_reported_with_their_sender() {
        let text = "### [2026-01-24T16:30:00Z] request | planner -> executor\n\n```yaml\nmessage: [not, a, map\n```\n### [bad heading\n\n```yaml\nmessage: {}\n```\n";
        let (entries, consumed) = parse_entries(text);
        assert_eq!((entries.len(), consumed), (2, text.len()));
        let first = entries[0].message.as_ref().unwrap_err();
        assert_eq!(first.sender.as_ref().unwrap().agent, "planner");
        assert_eq!(entries[1].message.as_ref().unwrap_err().field, "heading");
    }

    #[test]
    fn an_unclosed_block_is_refused_alone() {
        let text = "### [2026-01-24T16:30:00Z] request | planner -> executor\n\n```yaml\nmessage:\n  action: lost\n\n### [2026-01-24T16:31:00Z] request | mc -> executor\n\n```yaml\nmessage:\n  action: next\n```\n";
        let (entries, consumed) = parse_entries(text);
        assert_eq!((entries.len(), consumed), (2, text.len()));
        let refused = entries[0].message.as_ref().unwrap_err();
        assert_eq!(refused.sender.as_ref().unwrap().agent, "planner");
        assert!(
            entries[0].text.ends_with("action: lost\n\n"),
            "{:?}",
            entries[0].text
        );
        let next = entries[1].message.as_ref().unwrap();
        assert_eq!(
            (next.sender.agent.as_str(), next.action.as_deref()),
            ("mc", Some("next"))
        );
        // With no next entry yet, an open block is still being written.
        let (entries, consumed) = parse_entries(&text[..70]);
        assert_eq!((entries.len(), consumed), (0, 0));
    }

    #[test]
    fn entries_written_by_the_bridge_read_back() {
        let msg = validate(doc("message: { timestamp: 2026-01-24T10:00:00Z, id: msg-1, type: request, sender: { agent: mc }, receiver: { agent: executor }, content: { action: abort, payload: { reason: stop } } }")).unwrap();
        let text = entry(&msg.raw);
        assert!(
            text.contains("message:\n  id: msg-1\n  timestamp: "),
            "{text}"
        );
        // The document's form: action and payload right under `message:`.
        assert!(
            text.contains("\n  action: abort\n  payload:\n    reason: stop\n"),
            "{text}"
        );
        assert!(!text.contains("content:"), "{text}");

        // `context` too; a `content` holding more than the three is written whole. Both
        // read back as they were.
        for content in [
            "{ action: abort, payload: { reason: stop }, context: { block: b-2 } }",
            "{ action: abort, payload: { reason: stop }, hint: soon }",
        ] {
            let msg = validate(doc(&format!("message: {{ timestamp: 2026-01-24T10:00:00Z, id: msg-2, type: request, sender: {{ agent: mc }}, receiver: {{ agent: executor }}, content: {content} }}"))).unwrap();
            let text = entry(&msg.raw);
            assert_eq!(
                text.contains("content:"),
                content.contains("hint"),
                "{text}"
            );
            let (entries, _) = parse_entries(&text);
            let back = entries[0].message.as_ref().unwrap();
            assert_eq!(
                (back.action.as_deref(), back.payload(), back.context()),
                (Some("abort"), msg.payload(), msg.context()),
                "{text}"
            );
        }
        let (entries, consumed) = parse_entries(&text);
        assert_eq!(consumed, text.len());
        let back = entries[0].message.as_ref().unwrap();
        assert_eq!(
            (back.id.as_str(), back.receiver.agent.as_str()),
            ("msg-1", "executor")
        );
        assert_eq!(back.payload()["reason"], "stop");
    }
}
