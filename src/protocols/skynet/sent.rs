//! The `send` action's SkynetMessage: read and checked in one pass, normalised as Skynet's
//! server does, and written out again in the client's own field order.
//!
//! The message is what the store keeps and what Skynet peers are sent, so it is not built
//! into a `Value` (a sorted map of owned strings) only to be written out again: its fields
//! stay the client's text, and only those the server reads are parsed.

use std::sync::Arc;

use serde_json::Value;
use serde_json::value::RawValue;

use super::mentions;
use super::wire::{Data, FrameError, MAX_ATTACHMENT_SIZE, as_millis, invalid};
use crate::core::{new_message_id, now_ms};
use crate::shared::each_once::each_once;
use crate::shared::json_writer::ObjectWriter;
use crate::shared::raw_object::{RawObject, plain_string};

/// A sent SkynetMessage. `stamp` fills in what the server sets.
#[derive(Debug)]
pub struct SentMessage<'a> {
    /// Every field as the client wrote it, in its order.
    fields: RawObject<'a>,
    pub msg_type: String,
    pub id: Option<String>,
    pub timestamp: Option<i64>,
    pub reply_to: Option<String>,
    /// The client's mentions, each once; enrichment adds to them.
    pub mentions: Vec<String>,
    pub payload: Value,
    /// The sending member's card id, once stamped.
    from: String,
}

impl<'a> SentMessage<'a> {
    /// Reads a `send` frame's `data`, refusing what does not have a SkynetMessage's shape.
    pub fn parse(data: Option<Data<'a>>) -> Result<SentMessage<'a>, FrameError> {
        let Some(Data::Object(fields)) = data else {
            return Err(invalid("data must be a SkynetMessage object"));
        };
        let msg_type = match fields.get("type").and_then(string_of) {
            Some(t) if !t.is_empty() => t,
            _ => return Err(invalid("data.type must be a non-empty string")),
        };
        let payload = fields
            .get("payload")
            .ok_or_else(|| invalid("data.payload is required"))?;
        let id = optional_string(&fields, "id")?;
        let reply_to = optional_string(&fields, "replyTo")?;
        let timestamp = match fields
            .get("timestamp")
            .map(|t| serde_json::from_str(t.get()))
        {
            None | Some(Ok(Value::Null)) => None,
            Some(Ok(number @ Value::Number(_))) => as_millis(&number),
            // `1e400` too: a number no JSON reader after us could hold.
            _ => return Err(invalid("data.timestamp must be a number")),
        };
        let mentions = match fields
            .get("mentions")
            .map(|m| serde_json::from_str(m.get()))
        {
            None => Vec::new(),
            Some(Ok(None)) => Vec::new(),
            Some(Ok(Some(list))) => each_once(list),
            Some(Err(_)) => return Err(invalid("data.mentions must be an array of agent ids")),
        };
        let payload: Value = serde_json::from_str(payload.get())
            .map_err(|e| invalid(&format!("data.payload: {e}")))?;
        if msg_type == "chat" {
            check_chat_payload(&payload)?;
        }
        check_other_fields(&fields)?;
        Ok(SentMessage {
            fields,
            msg_type,
            id,
            timestamp,
            reply_to,
            mentions,
            payload,
            from: String::new(),
        })
    }

    /// Normalises the message as Skynet's server does: `from` is the sending socket's
    /// member (`from_card`); a client's `id` and `timestamp` are kept, missing ones filled
    /// in. (A `replyTo` that is not a string, which `parse` lets through only as `null`, is
    /// left out when the message is written.)
    pub fn stamp(&mut self, from_card: &str) {
        from_card.clone_into(&mut self.from);
        self.id.get_or_insert_with(new_message_id);
        self.timestamp.get_or_insert_with(now_ms);
    }

    /// Adds to the mentions whom a chat's `payload.text` names (`mentions::enrich`).
    pub fn enrich_mentions(
        &mut self,
        sender_id: &str,
        candidates: impl FnOnce() -> Arc<mentions::Candidates>,
    ) {
        let text = (self.msg_type == "chat")
            .then(|| self.payload.get("text")?.as_str())
            .flatten();
        mentions::enrich(&mut self.mentions, text, sender_id, candidates);
    }

    /// The first attachment over the 5 MB limit, as an error text.
    pub fn oversized_attachment(&self) -> Option<String> {
        let list = self.payload.get("attachments")?.as_array()?;
        list.iter().find_map(|a| {
            let declared = a.get("size").and_then(Value::as_u64).unwrap_or(0);
            // Base64 carries 3 bytes in every 4 characters.
            let decoded = a
                .get("data")
                .and_then(Value::as_str)
                .map(|d| (d.trim_end_matches('=').len() as u64 * 3) / 4)
                .unwrap_or(0);
            let size = declared.max(decoded);
            (size > MAX_ATTACHMENT_SIZE).then(|| {
                let name = a.get("name").and_then(Value::as_str).unwrap_or("attachment");
                format!(
                    "Attachment too large: '{name}' is {size} bytes; the limit is {MAX_ATTACHMENT_SIZE} bytes (5 MB)"
                )
            })
        })
    }

    /// The message as Skynet peers are sent it and the store keeps it; after `stamp`:
    /// the client's fields in its order, as it wrote them, but for what `stamp` sets and
    /// the mentions as enriched; those the client left out follow.
    pub fn to_json(&self) -> String {
        debug_assert!(
            self.id.is_some() && self.timestamp.is_some(),
            "written before it was stamped"
        );
        let id = self.id.as_deref().unwrap_or_default();
        let timestamp = self.timestamp.unwrap_or_default();
        // Into a buffer sized for it: grown from a few bytes, the text would be copied two
        // or three times.
        let mut json = Vec::with_capacity(self.size_hint());
        let mut object = ObjectWriter::start(&mut json);
        let (mut from_written, mut id_written, mut timestamp_written) = (false, false, false);
        let mut mentions_written = false;
        for (name, value) in self.fields.iter() {
            match name {
                "from" => {
                    object.string(name, &self.from);
                    from_written = true;
                }
                "id" => {
                    object.string(name, id);
                    id_written = true;
                }
                // A client's number as it wrote it (`1.7e12` stays so).
                "timestamp" if is_number(value) => {
                    object.raw(name, value.get());
                    timestamp_written = true;
                }
                "timestamp" => {
                    object.raw(name, itoa::Buffer::new().format(timestamp));
                    timestamp_written = true;
                }
                "replyTo" if self.reply_to.is_none() => {}
                "mentions" => {
                    if !self.mentions.is_empty() {
                        object.strings(name, &self.mentions);
                    }
                    mentions_written = true;
                }
                _ => object.raw(name, value.get()),
            }
        }
        if !from_written {
            object.string("from", &self.from);
        }
        if !id_written {
            object.string("id", id);
        }
        if !timestamp_written {
            object.raw("timestamp", itoa::Buffer::new().format(timestamp));
        }
        if !mentions_written && !self.mentions.is_empty() {
            object.strings("mentions", &self.mentions);
        }
        object.end();
        String::from_utf8(json).expect("written from strings")
    }

    /// About how long `to_json`'s text is: the client's fields as written and what `stamp`
    /// adds, with room for the quotes and separators.
    fn size_hint(&self) -> usize {
        let fields: usize = self
            .fields
            .iter()
            .map(|(name, value)| name.len() + value.get().len() + 4)
            .sum();
        let mentions: usize = self.mentions.iter().map(|m| m.len() + 3).sum();
        let id = self.id.as_ref().map_or(0, String::len);
        fields + mentions + id + self.from.len() + 64
    }
}

fn is_number(value: &RawValue) -> bool {
    value
        .get()
        .starts_with(|c: char| c == '-' || c.is_ascii_digit())
}

/// The fields read above, and `from`, which the server sets.
const READ_FIELDS: [&str; 7] = [
    "type",
    "payload",
    "id",
    "replyTo",
    "timestamp",
    "mentions",
    "from",
];

/// Checks that every other field is JSON that the bridge (and the store, and every client
/// after it) can read back: the frame's text was only scanned for its shape, which lets
/// through nesting deeper than serde_json's limit of 128, lone UTF-16 surrogates and
/// numbers out of range. Most messages have no other field.
fn check_other_fields(fields: &RawObject<'_>) -> Result<(), FrameError> {
    for (name, value) in fields.iter() {
        if !READ_FIELDS.contains(&name) {
            serde_json::from_str::<Value>(value.get())
                .map_err(|e| invalid(&format!("data.{name}: {e}")))?;
        }
    }
    Ok(())
}

/// Field `name`, which may be absent or null but otherwise a string.
fn optional_string(fields: &RawObject<'_>, name: &str) -> Result<Option<String>, FrameError> {
    match fields.get(name) {
        None => Ok(None),
        Some(value) if value.get() == "null" => Ok(None),
        Some(value) => string_of(value)
            .map(Some)
            .ok_or_else(|| invalid(&format!("data.{name} must be a string"))),
    }
}

/// The string a value is, if it is one: one without escapes (an id, a type) straight from
/// its text, which a parser takes 300–400 instructions to read.
fn string_of(value: &RawValue) -> Option<String> {
    match plain_string(value) {
        Some(plain) => Some(plain.to_owned()),
        None => serde_json::from_str(value.get()).ok(),
    }
}

fn check_chat_payload(payload: &Value) -> Result<(), FrameError> {
    if !payload.is_object() {
        return Err(invalid(
            "data.payload must be an object {text, attachments?}",
        ));
    }
    if !matches!(payload.get("text"), None | Some(Value::String(_))) {
        return Err(invalid("data.payload.text must be a string"));
    }
    match payload.get("attachments") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(list)) if list.iter().all(Value::is_object) => Ok(()),
        Some(_) => Err(invalid(
            "data.payload.attachments must be an array of attachments",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parsed(data: &str) -> Result<SentMessage<'_>, FrameError> {
        SentMessage::parse(Some(serde_json::from_str(data).unwrap()))
    }

    #[test]
    fn the_message_keeps_the_clients_order_and_text_with_what_the_server_sets() {
        let mut msg = parsed(
            r#"{"type":"chat", "payload":{"text":"hi","z":1.50},"from":"forged","replyTo":null,"timestamp":1.7e12,"extra":[1, 2]}"#,
        )
        .unwrap();
        msg.stamp("card-a");
        let id = msg.id.clone().unwrap();
        assert_eq!(
            msg.to_json(),
            format!(
                r#"{{"type":"chat","payload":{{"text":"hi","z":1.50}},"from":"card-a","timestamp":1.7e12,"extra":[1, 2],"id":"{id}"}}"#
            )
        );
        assert_eq!(msg.timestamp, Some(1_700_000_000_000));
    }

    #[test]
    fn a_clients_id_and_timestamp_are_kept_and_mentions_are_written_as_enriched() {
        let mut msg = parsed(
            r#"{"id":"m1","type":"chat","payload":{"text":"@bob"},"mentions":["x","x"],"timestamp":5,"replyTo":"m0"}"#,
        )
        .unwrap();
        assert_eq!(msg.mentions, ["x"]);
        msg.stamp("card-a");
        msg.mentions.push("bob".into());
        let json: Value = serde_json::from_str(&msg.to_json()).unwrap();
        assert_eq!(
            json,
            json!({ "id": "m1", "type": "chat", "payload": { "text": "@bob" },
                    "mentions": ["x", "bob"], "timestamp": 5, "replyTo": "m0", "from": "card-a" })
        );

        // Mentions that come to nothing are left out, as Skynet's server does.
        let mut msg =
            parsed(r#"{"type":"t","payload":null,"mentions":[],"timestamp":null}"#).unwrap();
        msg.stamp("card-a");
        let json: Value = serde_json::from_str(&msg.to_json()).unwrap();
        assert!(json.get("mentions").is_none(), "{json}");
        assert!(json["timestamp"].is_i64(), "{json}");
    }

    #[test]
    fn a_misshapen_message_is_refused_saying_why() {
        let detail = |data: &str| match parsed(data) {
            Err(FrameError::Invalid(detail)) => detail,
            other => panic!("{data}: {other:?}"),
        };
        assert!(detail("[]").contains("SkynetMessage object"));
        assert!(detail(r#"{"type":"","payload":1}"#).contains("data.type"));
        assert!(detail(r#"{"type":"chat"}"#).contains("data.payload is required"));
        assert!(detail(r#"{"type":"t","payload":1,"id":5}"#).contains("data.id"));
        assert!(detail(r#"{"type":"t","payload":1,"replyTo":{}}"#).contains("data.replyTo"));
        assert!(detail(r#"{"type":"t","payload":1,"timestamp":"now"}"#).contains("timestamp"));
        assert!(detail(r#"{"type":"t","payload":1,"mentions":[1]}"#).contains("mentions"));
        assert!(detail(r#"{"type":"chat","payload":[]}"#).contains("must be an object"));
        assert!(detail(r#"{"type":"chat","payload":{"text":1}}"#).contains("payload.text"));
        assert!(detail(r#"{"type":"chat","payload":{"attachments":[1]}}"#).contains("attachments"));
        assert!(SentMessage::parse(None).is_err());
    }

    /// What only a full parse catches is refused in every field, so the store and every
    /// reader after it can read back what was accepted.
    #[test]
    fn json_a_reader_cannot_hold_is_refused_in_any_field() {
        let detail = |data: &str| match parsed(data) {
            Err(FrameError::Invalid(detail)) => detail,
            other => panic!("{data}: {other:?}"),
        };
        assert!(detail(r#"{"type":"t","payload":1,"timestamp":1e400}"#).contains("timestamp"));
        let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
        assert!(
            detail(&format!(r#"{{"type":"t","payload":1,"extra":{deep}}}"#)).contains("data.extra")
        );
        assert!(detail(&format!(r#"{{"type":"t","payload":{deep}}}"#)).contains("data.payload"));
        assert!(detail(r#"{"type":"t","payload":1,"extra":"\ud800"}"#).contains("data.extra"));
        assert!(detail(r#"{"type":"t","payload":1,"extra":[1e400]}"#).contains("data.extra"));
        // A client's `from` is replaced, never read or kept: anything goes there.
        assert!(parsed(r#"{"type":"t","payload":1,"from":"\ud800"}"#).is_ok());
    }

    #[test]
    fn attachments_over_5mb_are_named() {
        let big = "A".repeat(7 * 1024 * 1024);
        let data = json!({
            "type": "chat", "payload": { "text": "x", "attachments": [
                { "type": "image", "name": "small.png", "mimeType": "image/png", "data": "AAAA", "size": 3 },
                { "type": "image", "name": "big.png", "mimeType": "image/png", "data": big, "size": 10 }
            ]}
        })
        .to_string();
        let e = parsed(&data).unwrap().oversized_attachment().unwrap();
        assert!(e.contains("big.png"), "{e}");
        let declared = json!({
            "type": "chat", "payload": { "attachments": [ { "name": "x", "data": "", "size": 6_000_000 } ] }
        })
        .to_string();
        assert!(parsed(&declared).unwrap().oversized_attachment().is_some());
    }
}
