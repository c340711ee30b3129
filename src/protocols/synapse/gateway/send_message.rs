//! `POST /api/v1/synapse/message` read straight into its typed request.
//!
//! The generic route reads a body into a JSON `Value`, then into a `DynamicMessage` through
//! the descriptor pool, encodes that and decodes the typed request from the bytes: a third
//! of the instructions the gateway spends on a message (`benches/callgrind.sh
//! synapse/http:skynet`). This reader takes the body as agents send it — known fields by
//! their JSON or proto names, strings, the message type by name, a text payload — into the
//! typed request directly, and declines anything else (an unknown or repeated field, a
//! payload of another type, a number where a name goes, malformed JSON), which then takes
//! the generic route and gets its answer and its errors. What it takes, it reads as the
//! generic route would: `tests` holds the two to the same request.

use prost_reflect::DynamicMessage;
use prost_types::Timestamp;
use serde::Deserialize;
use serde_json::{Value, json};

use super::super::proto::{
    AgentEndpoint, MessageType, SendMessageRequest, SendMessageResponse, SynapseMessage,
};
use super::super::wire;

/// `body` as a `SendMessageRequest`, or `None` when it is not in the shape read here.
pub(super) fn read(body: &[u8]) -> Option<SendMessageRequest> {
    let body: Body = serde_json::from_slice(body).ok()?;
    let message = match body.message {
        Some(message) => Some(message.typed()?),
        None => None,
    };
    Some(SendMessageRequest { message })
}

/// The JSON of a `SendMessageResponse`, as the generic route writes every response: every
/// field, by its JSON name.
pub(super) fn answer(response: &SendMessageResponse) -> Value {
    json!({
        "success": response.success,
        "messageId": response.message_id,
        "error": response.error,
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    message: Option<Message>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Message {
    id: Option<String>,
    version: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    sender: Option<Endpoint>,
    receiver: Option<Endpoint>,
    #[serde(rename = "correlationId", alias = "correlation_id")]
    correlation_id: Option<String>,
    #[serde(rename = "replyTo", alias = "reply_to")]
    reply_to: Option<String>,
    #[serde(rename = "groupId", alias = "group_id")]
    group_id: Option<String>,
    timestamp: Option<String>,
    payload: Option<Payload>,
    signature: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Endpoint {
    #[serde(rename = "agentId", alias = "agent_id")]
    agent_id: Option<String>,
    #[serde(rename = "agentName", alias = "agent_name")]
    agent_name: Option<String>,
    #[serde(rename = "systemId", alias = "system_id")]
    system_id: Option<String>,
    endpoint: Option<String>,
    version: Option<String>,
}

/// A payload read here: text, as a `google.protobuf.StringValue`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Payload {
    #[serde(rename = "@type")]
    type_url: String,
    value: String,
}

impl Message {
    fn typed(self) -> Option<SynapseMessage> {
        let kind = match self.kind {
            Some(name) => MessageType::from_str_name(&name)? as i32,
            None => 0,
        };
        let payload = match self.payload {
            Some(p) if p.type_url == wire::STRING_VALUE => Some(wire::text(&p.value)),
            Some(_) => return None,
            None => None,
        };
        let timestamp = match self.timestamp {
            Some(text) => Some(timestamp(&text)?),
            None => None,
        };
        Some(SynapseMessage {
            id: self.id.unwrap_or_default(),
            version: self.version.unwrap_or_default(),
            r#type: kind,
            sender: self.sender.map(Endpoint::typed),
            receiver: self.receiver.map(Endpoint::typed),
            correlation_id: self.correlation_id.unwrap_or_default(),
            reply_to: self.reply_to.unwrap_or_default(),
            group_id: self.group_id.unwrap_or_default(),
            timestamp,
            payload,
            signature: self.signature.unwrap_or_default(),
        })
    }
}

impl Endpoint {
    fn typed(self) -> AgentEndpoint {
        AgentEndpoint {
            agent_id: self.agent_id.unwrap_or_default(),
            agent_name: self.agent_name.unwrap_or_default(),
            system_id: self.system_id.unwrap_or_default(),
            endpoint: self.endpoint.unwrap_or_default(),
            version: self.version.unwrap_or_default(),
        }
    }
}

/// An RFC 3339 time as a `Timestamp`, read by prost-reflect as the generic route reads it
/// (its rules for what RFC 3339 text it takes are its own); `None` for one it refuses.
fn timestamp(text: &str) -> Option<Timestamp> {
    let desc = wire::descriptor("google.protobuf.Timestamp");
    let dynamic = DynamicMessage::deserialize(desc, Value::from(text)).ok()?;
    dynamic.transcode_to().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::synapse::gateway::json_of;
    use prost::Message as _;

    /// The request the generic route reads from `body`.
    fn generic(body: &Value) -> Result<SendMessageRequest, String> {
        wire::from_json(body, "synapse.SendMessageRequest")
    }

    fn typed(body: &Value) -> Option<SendMessageRequest> {
        read(body.to_string().as_bytes())
    }

    #[test]
    fn what_it_reads_is_what_the_generic_route_reads() {
        let bodies = [
            json!({}),
            json!({ "message": null }),
            json!({ "message": {} }),
            json!({ "message": {
                "id": "m-1",
                "version": "1.0",
                "type": "MESSAGE_TYPE_P2P_TASK_REQUEST",
                "sender": { "agentId": "a", "agentName": "A \"quoted\" \u{e9}", "systemId": "s", "endpoint": "e", "version": "v" },
                "receiver": { "agent_id": "b", "agent_name": "B" },
                "correlationId": "c", "replyTo": "r", "groupId": "g",
                "timestamp": "2026-12-05T07:30:00.123Z",
                "payload": { "@type": wire::STRING_VALUE, "value": "hello\nworld" },
                "signature": "sig",
            } }),
            json!({ "message": {
                "correlation_id": "c", "reply_to": "r", "group_id": "g",
                "timestamp": "2026-12-05T09:30:00+02:00",
                "sender": null, "receiver": { "agentId": null }, "payload": null, "type": null,
            } }),
            json!({ "message": { "payload": { "@type": wire::STRING_VALUE, "value": "" } } }),
        ];
        for body in &bodies {
            let typed = typed(body).unwrap_or_else(|| panic!("read here: {body}"));
            assert_eq!(Ok(typed), generic(body), "{body}");
        }
    }

    #[test]
    fn what_it_declines_goes_the_generic_way() {
        let declined = [
            json!({ "message": { "unknown": 1 } }),
            json!({ "message": { "id": "m" }, "extra": true }),
            json!({ "message": { "type": 1 } }),
            json!({ "message": { "type": "NOT_A_TYPE" } }),
            json!({ "message": { "id": 7 } }),
            json!({ "message": { "sender": { "agentId": "a", "nickname": "x" } } }),
            json!({ "message": { "timestamp": "yesterday" } }),
            json!({ "message": { "timestamp": "2026-12-05 07:30:00Z" } }),
            json!({ "message": { "payload": { "@type": wire::TASK_PAYLOAD, "taskId": "t" } } }),
            json!({ "message": { "payload": { "@type": wire::STRING_VALUE, "value": 3 } } }),
            json!([]),
        ];
        for body in &declined {
            assert!(typed(body).is_none(), "declined: {body}");
        }
        // Repeated fields (one by each name) and trailing text are not JSON a struct takes.
        let repeated = br#"{"message": {"replyTo": "a", "reply_to": "b"}}"#;
        assert!(read(repeated).is_none());
        assert!(read(br#"{"message": {}} x"#).is_none());
        assert!(read(b"").is_none());
    }

    #[test]
    fn its_answer_is_the_generic_answer() {
        for (success, id, error) in [(true, "m-1", ""), (false, "", "why")] {
            let response = SendMessageResponse {
                success,
                message_id: id.into(),
                error: error.into(),
            };
            let dynamic = DynamicMessage::decode(
                wire::descriptor("synapse.SendMessageResponse"),
                response.encode_to_vec().as_slice(),
            )
            .unwrap();
            assert_eq!(answer(&response), json_of(dynamic).unwrap());
        }
    }
}
