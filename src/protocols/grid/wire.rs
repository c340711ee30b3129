//! Grid messages: YAML documents holding one `message:` each, validated as the protocol
//! document's "When receiving" asks (the scratchpad's entry form around them is `entry`).
//!
//! Messages are kept as JSON values (`serde_json::Value`) so fields the bridge does not know
//! travel unchanged between Grid programs (their fields written in the document's order,
//! see `order`).

use std::sync::LazyLock;

use serde_json::{Map, Value, json};
use time::PrimitiveDateTime;
use time::format_description::OwnedFormatItem;

use super::order;
use crate::core::{Priority, new_message_id};
use crate::shared::clock::{iso8601, parse_iso8601};

pub const TYPES: &[&str] = &["request", "response", "notification", "error"];
pub const BROADCAST: &str = "broadcast";

/// Why a message was refused: the field at fault and what was wrong, with what is known
/// of the message to address the answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Invalid {
    pub code: &'static str,
    pub field: String,
    pub message: String,
    pub id: Option<String>,
    /// Boxed: an error stays small enough to return by value cheaply.
    pub sender: Option<Box<Party>>,
}

impl Invalid {
    pub fn new(field: &str, message: impl Into<String>) -> Self {
        Invalid {
            code: "VALIDATION_FAILED",
            field: field.to_owned(),
            message: message.into(),
            id: None,
            sender: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Party {
    pub agent: String,
    pub instance_id: Option<String>,
}

impl Party {
    pub fn broadcast() -> Self {
        Party {
            agent: BROADCAST.into(),
            instance_id: None,
        }
    }

    pub fn is_broadcast(&self) -> bool {
        self.agent == BROADCAST
    }

    pub fn to_json(&self) -> Value {
        let mut out = Map::new();
        out.insert("agent".into(), json!(self.agent));
        if let Some(instance) = &self.instance_id {
            out.insert("instance_id".into(), json!(instance));
        }
        Value::Object(out)
    }

    fn from(value: &Value, field: &str, required: bool) -> Result<Option<Party>, Invalid> {
        // `receiver: mc` is short for `receiver: { agent: mc }` (read as a mapping, it would
        // have had no agent, and been a broadcast).
        let shorthand;
        let value = match value {
            Value::String(agent) => {
                shorthand = json!({ "agent": agent });
                &shorthand
            }
            Value::Object(_) | Value::Null => value,
            _ => {
                return Err(Invalid::new(
                    field,
                    format!("{field} must be a mapping: {{agent, instance_id}}"),
                ));
            }
        };
        let agent = match value.get("agent") {
            Some(Value::String(a)) if !a.trim().is_empty() => a.trim().to_owned(),
            None | Some(Value::Null) if !required => return Ok(None),
            Some(Value::String(_)) | None | Some(Value::Null) => {
                return Err(Invalid::new(
                    &format!("{field}.agent"),
                    format!("{field}.agent is required"),
                ));
            }
            Some(_) => {
                return Err(Invalid::new(
                    &format!("{field}.agent"),
                    format!("{field}.agent must be a string"),
                ));
            }
        };
        let instance_id = match value.get("instance_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(i)) => Some(i.clone()).filter(|i| !i.is_empty()),
            Some(_) => {
                return Err(Invalid::new(
                    &format!("{field}.instance_id"),
                    format!("{field}.instance_id must be a string"),
                ));
            }
        };
        Ok(Some(Party { agent, instance_id }))
    }
}

/// A message that passed validation, with the defaults filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    pub id: String,
    pub timestamp: i64,
    pub msg_type: String,
    pub sender: Party,
    pub receiver: Party,
    pub correlation_id: Option<String>,
    pub action: Option<String>,
    pub priority: Priority,
    pub ttl: Option<u64>,
    /// The whole `message:` object as it arrived, with id and timestamp filled in.
    pub raw: Value,
}

impl Message {
    /// `content.payload`, read where `raw` holds it: a copy kept beside `raw` was made and
    /// dropped for every message.
    pub fn payload(&self) -> &Value {
        self.content_field("payload")
    }

    /// `content.context`.
    pub fn context(&self) -> &Value {
        self.content_field("context")
    }

    fn content_field(&self, key: &str) -> &Value {
        static NULL: Value = Value::Null;
        (self.raw.get("content").and_then(|content| content.get(key))).unwrap_or(&NULL)
    }
}

/// Most messages one request may hold (serde-saphyr's own bound on a YAML stream).
pub const MAX_DOCUMENTS: usize = 1024;

/// Parses a request body: a YAML stream of `message:` documents, or JSON (one document or
/// an array of them).
pub fn parse_documents(body: &str, json: bool) -> Result<Vec<Value>, Invalid> {
    if json {
        return match serde_json::from_str::<Value>(body) {
            // As many as serde-saphyr takes in one YAML stream.
            Ok(Value::Array(docs)) if docs.len() > MAX_DOCUMENTS => Err(Invalid::new(
                "body",
                format!(
                    "{} messages in one request; at most {MAX_DOCUMENTS}",
                    docs.len()
                ),
            )),
            Ok(Value::Array(docs)) => Ok(docs),
            Ok(doc) => Ok(vec![doc]),
            Err(e) => Err(Invalid::new("body", format!("body is not valid JSON: {e}"))),
        };
    }
    let docs: Vec<Value> = serde_saphyr::from_multiple_with_options(body, yaml_options(body))
        .map_err(|e| Invalid::new("body", format!("body is not valid YAML: {e}")))?;
    let docs: Vec<Value> = docs.into_iter().filter(|d| !d.is_null()).collect();
    if docs.is_empty() {
        return Err(Invalid::new("message", "the body holds no message"));
    }
    Ok(docs)
}

/// What aliases may add to a document beyond its own text.
const ALIAS_ALLOWANCE: usize = 64 << 10;

/// Events aliases may replay in one parse, besides one for every eight bytes of its text
/// (a stream of many documents each merging a mapping, `<<: *defaults`, replays more).
const MOST_REPLAYED_EVENTS: usize = 10_000;

/// How a client's YAML is read: what aliases replay is bounded by the text's own size (plus
/// `ALIAS_ALLOWANCE`), so that a small body or frame, within every size limit, cannot expand
/// into a message many times its size (serde-saphyr's default budget allows 64 MiB of
/// scalars and a million replayed events).
pub(super) fn yaml_options(text: &str) -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_total_scalar_bytes = text.len() + ALIAS_ALLOWANCE;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options.alias_limits.max_total_replayed_events = MOST_REPLAYED_EVENTS + text.len() / 8;
    options
}

/// The documents of a WebSocket text frame, which says nothing of its format: JSON when it
/// looks like JSON and is, else YAML (a one-line YAML flow mapping, `{message: {…}}`,
/// looks like JSON too). Refused as JSON when it looks like JSON and is neither.
pub fn parse_frame(text: &str) -> Result<Vec<Value>, Invalid> {
    if !text.trim_start().starts_with(['{', '[']) {
        return parse_documents(text, false);
    }
    parse_documents(text, true).or_else(|as_json| {
        let mut docs = parse_documents(text, false).map_err(|_| as_json)?;
        // `[{message: …}, …]` holds several, as the same list in JSON does.
        if let [Value::Array(list)] = docs.as_mut_slice() {
            return Ok(std::mem::take(list));
        }
        Ok(docs)
    })
}

/// An ISO-8601 date-time without a UTC offset, which the Grid takes as UTC.
static WITHOUT_OFFSET: LazyLock<OwnedFormatItem> = LazyLock::new(|| {
    time::format_description::parse_owned::<2>(
        "[year]-[month]-[day][first [T][t][ ]][hour]:[minute][optional [:[second][optional [[first [.][,]][subsecond]]]]]",
    )
    .expect("a valid format description")
});

/// An ISO-8601 timestamp as milliseconds since the epoch: RFC 3339 with any offset, or a
/// date-time with none (UTC, as Grid programs often write them).
pub fn parse_timestamp(text: &str) -> Option<i64> {
    parse_iso8601(text).or_else(|| {
        let at = PrimitiveDateTime::parse(text.trim(), &*WITHOUT_OFFSET).ok()?;
        Some((at.assume_utc().unix_timestamp_nanos() / 1_000_000) as i64)
    })
}

/// Checks one `{message: …}` document; fills in a `msg-{uuid}` id when it is missing (the
/// issue asks for that; the timestamp, also required, is not invented).
pub fn validate(doc: Value) -> Result<Message, Invalid> {
    // The message's mapping is taken out of its document: it becomes `raw` as it is.
    let msg = match doc {
        Value::Object(mut doc) => doc.remove("message"),
        _ => None,
    };
    let Some(Value::Object(msg)) = msg else {
        return Err(Invalid::new(
            "message",
            "each document must hold a `message:` mapping",
        ));
    };
    let string = |key: &str| -> Result<Option<String>, Invalid> {
        match msg.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone()).filter(|s| !s.is_empty())),
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(_) => Err(Invalid::new(key, format!("{key} must be a string"))),
        }
    };
    // Given now rather than once the message passed, so that an error refusing it can
    // carry a `correlation_id` too ("every response MUST include" one).
    let id = string("id")?.unwrap_or_else(new_message_id_grid);
    let with_id = |mut e: Invalid| {
        e.id = Some(id.clone());
        e
    };
    let sender = Party::from(msg.get("sender").unwrap_or(&Value::Null), "sender", true)
        .map_err(with_id)?
        .ok_or_else(|| with_id(Invalid::new("sender.agent", "sender.agent is required")))?;
    let with_sender = |mut e: Invalid| {
        e.id = Some(id.clone());
        e.sender = Some(Box::new(sender.clone()));
        e
    };
    let msg_type = string("type").map_err(with_sender)?.ok_or_else(|| {
        with_sender(Invalid::new(
            "type",
            "type is required (request, response, notification or error)",
        ))
    })?;
    if !TYPES.contains(&msg_type.as_str()) {
        return Err(with_sender(Invalid::new(
            "type",
            format!("type must be request, response, notification or error, not '{msg_type}'"),
        )));
    }
    let timestamp = match string("timestamp").map_err(with_sender)? {
        None => {
            return Err(with_sender(Invalid::new(
                "timestamp",
                "timestamp is required (ISO-8601, when the message was created)",
            )));
        }
        Some(text) => parse_timestamp(&text).ok_or_else(|| {
            with_sender(Invalid::new(
                "timestamp",
                format!("timestamp must be ISO-8601, not '{text}'"),
            ))
        })?,
    };
    let receiver = Party::from(
        msg.get("receiver").unwrap_or(&Value::Null),
        "receiver",
        false,
    )
    .map_err(with_sender)?
    .unwrap_or_else(Party::broadcast);
    let correlation_id = string("correlation_id").map_err(with_sender)?;
    if correlation_id.is_none() && (msg_type == "response" || msg_type == "error") {
        return Err(with_sender(Invalid::new(
            "correlation_id",
            format!("a {msg_type} must carry correlation_id (the id of the message it answers)"),
        )));
    }
    // The scratchpad's short form puts action and payload right under `message:`.
    let content = match msg.get("content") {
        Some(Value::Object(content)) => content,
        None | Some(Value::Null) => &msg,
        Some(_) => {
            return Err(with_sender(Invalid::new(
                "content",
                "content must be a mapping: {action, payload, context}",
            )));
        }
    };
    let action = match content.get("action") {
        None | Some(Value::Null) => None,
        Some(Value::String(a)) => Some(a.clone()),
        Some(_) => {
            return Err(with_sender(Invalid::new(
                "content.action",
                "content.action must be a string",
            )));
        }
    };
    let metadata = match msg.get("metadata") {
        None | Some(Value::Null) => &Value::Null,
        Some(metadata @ Value::Object(_)) => metadata,
        Some(_) => {
            return Err(with_sender(Invalid::new(
                "metadata",
                "metadata must be a mapping: {priority, ttl}",
            )));
        }
    };
    let priority = match metadata.get("priority") {
        None | Some(Value::Null) => Priority::Normal,
        Some(Value::String(p)) => match p.as_str() {
            "high" => Priority::High,
            "normal" => Priority::Normal,
            "low" => Priority::Low,
            other => {
                return Err(with_sender(Invalid::new(
                    "metadata.priority",
                    format!("metadata.priority must be high, normal or low, not '{other}'"),
                )));
            }
        },
        Some(_) => {
            return Err(with_sender(Invalid::new(
                "metadata.priority",
                "metadata.priority must be a string",
            )));
        }
    };
    let ttl = match metadata.get("ttl") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            with_sender(Invalid::new(
                "metadata.ttl",
                "metadata.ttl must be a whole number of seconds",
            ))
        })?),
    };
    let mut raw = msg;
    // The short form becomes the full one: action, payload and context under `content`.
    if !raw.get("content").is_some_and(Value::is_object) {
        let mut content = Map::new();
        for key in CONTENT_FIELDS {
            if let Some(value) = raw.remove(key) {
                content.insert(key.into(), value);
            }
        }
        if !content.is_empty() {
            raw.insert("content".into(), Value::Object(content));
        }
    }
    // A party written short is relayed in the full form.
    for (key, party) in [("sender", &sender), ("receiver", &receiver)] {
        if raw.get(key).is_some_and(Value::is_string) {
            raw.insert(key.into(), party.to_json());
        }
    }
    // The timestamp stays as its sender wrote it: Grid programs receive it unchanged.
    raw.insert("id".into(), json!(id));
    raw.insert("type".into(), json!(msg_type));
    Ok(Message {
        id,
        timestamp,
        msg_type,
        sender,
        receiver,
        correlation_id,
        action,
        priority,
        ttl,
        raw: Value::Object(raw),
    })
}

/// `{message: …}` as YAML, its fields in the document's order.
pub fn to_yaml(message: &Value) -> String {
    #[derive(serde::Serialize)]
    struct Document<T> {
        message: T,
    }
    serde_saphyr::to_string(&Document {
        message: order::message(message),
    })
    .unwrap_or_default()
}

/// Several messages as a YAML stream.
pub fn to_yaml_stream(messages: &[Value]) -> String {
    messages
        .iter()
        .map(|m| format!("---\n{}", to_yaml(m)))
        .collect::<Vec<_>>()
        .join("")
}

/// A Grid `type: error` message from the bridge answering a refused message.
pub fn error_message(invalid: &Invalid) -> Value {
    let mut msg = Map::new();
    msg.insert("id".into(), json!(new_message_id_grid()));
    msg.insert("timestamp".into(), json!(iso8601(crate::core::now_ms())));
    msg.insert("type".into(), json!("error"));
    msg.insert(
        "sender".into(),
        json!({ "agent": crate::core::BRIDGE_AGENT }),
    );
    if let Some(sender) = &invalid.sender {
        msg.insert("receiver".into(), sender.to_json());
    }
    if let Some(id) = &invalid.id {
        msg.insert("correlation_id".into(), json!(id));
    }
    msg.insert(
        "content".into(),
        json!({
            "action": "error_report",
            "payload": {
                "error_code": invalid.code,
                "error_message": invalid.message,
                "field": invalid.field,
                "recoverable": true,
            }
        }),
    );
    msg.insert("metadata".into(), json!({ "priority": "high" }));
    Value::Object(msg)
}

/// What a message's `content` holds; the scratchpad's short form has them under `message:`.
pub(super) const CONTENT_FIELDS: [&str; 3] = ["action", "payload", "context"];

/// A fresh id in the documented `msg-{uuid}` form.
pub fn new_message_id_grid() -> String {
    format!("msg-{}", new_message_id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(yaml: &str) -> Value {
        serde_saphyr::from_str(yaml).unwrap()
    }

    /// Strings a YAML 1.1 reader (PyYAML) would take for something else are quoted, as
    /// the document's own examples quote timestamps: they arrive as strings.
    #[test]
    fn strings_that_read_as_other_types_are_quoted() {
        let text = to_yaml(&json!({
            "timestamp": "2026-01-24T10:00:00Z",
            "payload": { "since": "2026-01-24", "ok": "yes", "flag": "on", "count": "12", "text": "plain words" }
        }));
        for quoted in [
            r#"timestamp: "2026-01-24T10:00:00Z""#,
            r#"since: "2026-01-24""#,
            r#"ok: "yes""#,
            r#"flag: "on""#,
            r#"count: "12""#,
        ] {
            assert!(text.contains(quoted), "{quoted} in\n{text}");
        }
        assert!(text.contains("text: plain words"), "{text}");
    }

    #[test]
    fn the_documents_examples_validate() {
        let request = validate(doc(
            "message:\n  id: \"msg-abc123\"\n  timestamp: \"2026-01-24T10:00:00Z\"\n  type: \"request\"\n  sender:\n    agent: \"executor\"\n    instance_id: \"exec-001\"\n  receiver:\n    agent: \"mc\"\n  content:\n    action: \"request_context\"\n    payload:\n      context_type: \"warmth\"\n      since: \"2026-01-24T10:00:00Z\"\n",
        ))
        .unwrap();
        assert_eq!(request.id, "msg-abc123");
        assert_eq!(
            request.sender,
            Party {
                agent: "executor".into(),
                instance_id: Some("exec-001".into())
            }
        );
        assert_eq!(request.receiver.agent, "mc");
        assert_eq!(request.action.as_deref(), Some("request_context"));
        assert_eq!(request.payload()["context_type"], "warmth");
        assert_eq!(request.priority, Priority::Normal);

        let response = validate(doc(
            "message:\n  id: msg-def456\n  timestamp: 2026-01-24T10:00:05Z\n  type: response\n  correlation_id: msg-abc123\n  sender: { agent: mc }\n  receiver: { agent: executor, instance_id: exec-001 }\n  content: { action: context_provided, payload: { warmth: { gotchas: [x] } } }\n  metadata: { priority: high, ttl: 300 }\n",
        ))
        .unwrap();
        assert_eq!(
            (
                response.correlation_id.as_deref(),
                response.priority,
                response.ttl
            ),
            (Some("msg-abc123"), Priority::High, Some(300))
        );
    }

    #[test]
    fn every_validation_error_names_its_field() {
        for (yaml, field) in [
            ("just: text", "message"),
            ("message: { type: request }", "sender.agent"),
            ("message: { type: request, sender: {} }", "sender.agent"),
            ("message: { sender: { agent: x } }", "type"),
            ("message: { type: shout, sender: { agent: x } }", "type"),
            (
                "message: { timestamp: 2026-01-24T10:00:00Z, type: response, sender: { agent: x } }",
                "correlation_id",
            ),
            (
                "message: { timestamp: 2026-01-24T10:00:00Z, type: error, sender: { agent: x } }",
                "correlation_id",
            ),
            (
                "message: { type: request, sender: { agent: x }, timestamp: yesterday }",
                "timestamp",
            ),
            (
                "message: { type: request, sender: { agent: x } }",
                "timestamp",
            ),
            (
                "message: { timestamp: 2026-01-24T10:00:00Z, type: request, sender: { agent: x }, metadata: { priority: urgent } }",
                "metadata.priority",
            ),
            (
                "message: { timestamp: 2026-01-24T10:00:00Z, type: request, sender: { agent: x }, metadata: { ttl: -1 } }",
                "metadata.ttl",
            ),
            (
                "message: { timestamp: 2026-01-24T10:00:00Z, type: request, sender: { agent: x }, receiver: { agent: 5 } }",
                "receiver.agent",
            ),
        ] {
            let err = validate(doc(yaml)).unwrap_err();
            assert_eq!(err.field, field, "{yaml}: {err:?}");
        }
        let generated = validate(doc(
            "message: { timestamp: 2026-01-24T10:00:00Z, type: notification, sender: { agent: x } }",
        ))
        .unwrap();
        assert!(generated.id.starts_with("msg-"), "{}", generated.id);
        assert!(uuid::Uuid::parse_str(&generated.id[4..]).is_ok());
        assert!(generated.receiver.is_broadcast());
    }

    #[test]
    fn timestamps_without_an_offset_are_utc_and_kept_as_written() {
        let utc = parse_iso8601("2026-01-24T10:00:00Z");
        for text in [
            "2026-01-24T10:00:00",
            "2026-01-24 10:00:00",
            "2026-01-24T10:00",
            "2026-01-24T12:00:00+02:00",
        ] {
            assert_eq!(parse_timestamp(text), utc, "{text}");
        }
        assert_eq!(
            parse_timestamp("2026-01-24T10:00:00.250"),
            utc.map(|ms| ms + 250)
        );
        assert_eq!(parse_timestamp("2026-01-24"), None);
        let msg = validate(doc(
            "message: { type: request, timestamp: \"2026-01-24T12:00:00+02:00\", sender: { agent: x } }",
        ))
        .unwrap();
        assert_eq!(msg.timestamp, utc.unwrap());
        assert_eq!(msg.raw["timestamp"], "2026-01-24T12:00:00+02:00");
    }

    #[test]
    fn streams_of_documents_and_json_parse() {
        let docs = parse_documents("message: { type: request, sender: { agent: a } }\n---\nmessage: { type: notification, sender: { agent: b } }\n", false).unwrap();
        assert_eq!(docs.len(), 2);
        let docs = parse_documents(
            r#"[{"message":{"type":"request","sender":{"agent":"a"}}}]"#,
            true,
        )
        .unwrap();
        assert_eq!(docs.len(), 1);
        assert_eq!(
            parse_documents("key: [unclosed", false).unwrap_err().field,
            "body"
        );
    }

    #[test]
    fn frames_are_json_or_yaml_even_when_they_look_like_json() {
        let json = parse_frame(r#"{"message": {"type": "request"}}"#).unwrap();
        let flow = parse_frame("{message: {type: request}}").unwrap();
        let block = parse_frame("message:\n  type: request\n").unwrap();
        assert_eq!(json, flow);
        assert_eq!(json, block);
        let list = parse_frame(r#"[{"message": {}}, {"message": {}}]"#).unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(list, parse_frame("[{message: {}}, {message: {}}]").unwrap());
        let refused = parse_frame("{message: [unclosed").unwrap_err();
        assert!(
            refused.message.contains("not valid JSON"),
            "{}",
            refused.message
        );
    }
}
