//! A Grid message written with its fields in the order the Grid document writes them.
//!
//! The bridge's JSON maps are sorted by key (serde_json without `preserve_order`, whose
//! hashing costs a tenth of a relayed message), so a message would otherwise come out as
//! `content`, `correlation_id`, `id`, … . YAML mappings have no order, but the scratchpad is
//! also read by people and by models: `id`, `timestamp` and `type` come first, as in every
//! example of the document. Fields the document does not name follow, sorted.

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::Value;

const MESSAGE: &[&str] = &[
    "id",
    "timestamp",
    "type",
    "sender",
    "receiver",
    "correlation_id",
    "content",
    // The scratchpad's short form has these instead of `content`.
    "action",
    "payload",
    "context",
    "metadata",
];
const PARTY: &[&str] = &["agent", "instance_id"];
const CONTENT: &[&str] = &["action", "payload", "context"];
const METADATA: &[&str] = &["priority", "ttl"];

/// `message` (the object under `message:`) in the document's order.
pub fn message(message: &Value) -> impl Serialize + '_ {
    Ordered {
        value: message,
        order: MESSAGE,
    }
}

struct Ordered<'a> {
    value: &'a Value,
    order: &'static [&'static str],
}

/// The order of the fields inside a message field.
fn order_within(field: &str) -> &'static [&'static str] {
    match field {
        "sender" | "receiver" => PARTY,
        "content" => CONTENT,
        "metadata" => METADATA,
        _ => &[],
    }
}

impl Serialize for Ordered<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let Value::Object(map) = self.value else {
            return self.value.serialize(serializer);
        };
        let mut out = serializer.serialize_map(Some(map.len()))?;
        for &key in self.order {
            if let Some(value) = map.get(key) {
                // Only the message's own fields order their children.
                let order = if self.order == MESSAGE {
                    order_within(key)
                } else {
                    &[]
                };
                out.serialize_entry(key, &Ordered { value, order })?;
            }
        }
        for (key, value) in map {
            if !self.order.contains(&key.as_str()) {
                out.serialize_entry(key, value)?;
            }
        }
        out.end()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn named_fields_come_in_the_documents_order_and_the_rest_after_them_sorted() {
        let msg = json!({
            "zeta": 1,
            "content": { "payload": { "b": 1, "a": 2 }, "action": "go", "extra": true },
            "type": "request",
            "receiver": { "instance_id": "e-1", "agent": "executor" },
            "id": "msg-1",
            "metadata": { "ttl": 5, "priority": "high" },
            "timestamp": "2026-01-24T10:00:00Z",
            "sender": { "agent": "mc" },
            "correlation_id": "msg-0",
        });
        let text = serde_json::to_string(&super::message(&msg)).unwrap();
        assert_eq!(
            text,
            r#"{"id":"msg-1","timestamp":"2026-01-24T10:00:00Z","type":"request","sender":{"agent":"mc"},"receiver":{"agent":"executor","instance_id":"e-1"},"correlation_id":"msg-0","content":{"action":"go","payload":{"a":2,"b":1},"extra":true},"metadata":{"priority":"high","ttl":5},"zeta":1}"#
        );
    }
}
