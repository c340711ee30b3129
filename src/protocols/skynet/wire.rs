//! Skynet's wire vocabulary: client frames, server events, the texts clients match on.
//!
//! SkynetMessages are kept as JSON objects rather than structs so that fields this server
//! does not know travel unchanged between Skynet clients.

use std::fmt;

use serde::Deserialize;
use serde::de::value::SeqAccessDeserializer;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value, json};

pub use super::sent::SentMessage;
use crate::shared::raw_object::{FieldName, RawObject};

pub const MENTION_ALL: &str = "__all__";
/// Who a schedule's tick is from, as Skynet's scheduler sends it.
pub const SCHEDULER: &str = "system:scheduler";
/// Close code for a socket replaced by a newer one of the same agent.
pub const WS_CLOSE_REPLACED: u16 = 4001;
/// Largest attachment accepted inside a chat payload (5 MB).
pub const MAX_ATTACHMENT_SIZE: u64 = 5 * 1024 * 1024;

pub const EVENT_WORKSPACE_STATE: &str = "workspace.state";
pub const EVENT_HEARTBEAT_ACK: &str = "heartbeat.ack";
pub const EVENT_ERROR: &str = "error";
pub const EVENT_STATUS_CHANGE: &str = "status-change";

pub const ERR_INVALID_FORMAT: &str = "Invalid message format";
pub const ERR_NOT_CONNECTED: &str = "Not connected to workspace";
pub const ERR_UNKNOWN_AGENT: &str = "Unknown agent ID. Register via the HTTP API first.";
pub const ERR_UNKNOWN_HUMAN: &str = "Unknown human ID. Register via the HTTP API first.";

/// A server event: `{"event": name, "data": data}`.
pub fn event_value(name: &str, data: Value) -> Value {
    json!({ "event": name, "data": data })
}

/// A server event frame, as text: `event` first, as the document writes it (a `Value`'s
/// keys come out sorted).
pub fn event(name: &str, data: impl serde::Serialize) -> String {
    #[derive(serde::Serialize)]
    struct Event<'a, T> {
        event: &'a str,
        data: T,
    }
    // The bridge's event data is JSON with string keys, which cannot fail to serialize; if
    // it did, the client hears that something went wrong rather than nothing.
    serde_json::to_string(&Event { event: name, data }).unwrap_or_else(|e| {
        tracing::error!(error = %e, event = name, "skynet: cannot write an event");
        r#"{"event":"error","data":{"message":"Internal error"}}"#.to_owned()
    })
}

/// An `error` event. `detail`, when given, says precisely what was wrong; `message` stays
/// the exact text Skynet clients match on.
pub fn error_event(message: &str, detail: Option<&str>) -> String {
    let mut data = Map::new();
    data.insert("message".into(), json!(message));
    if let Some(detail) = detail {
        data.insert("detail".into(), json!(detail));
    }
    event(EVENT_ERROR, Value::Object(data))
}

/// A timestamp as milliseconds, from a JSON number.
pub fn as_millis(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| v.as_f64().map(|f| f as i64))
}

/// A client frame, checked for shape. A `send` borrows from the frame's text.
#[derive(Debug)]
pub enum ClientFrame<'a> {
    Join(JoinRequest),
    Leave,
    Send(SentMessage<'a>),
    Heartbeat { status: Option<String> },
}

#[derive(Debug)]
pub struct JoinRequest {
    /// The AgentCard as the client sent it.
    pub card: Map<String, Value>,
    pub id: String,
    pub human: bool,
    pub last_seen: Option<i64>,
}

/// Why a frame was refused; `Display` is the error event's text.
#[derive(Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Not JSON, or not the shape the action needs; the string says what was wrong.
    Invalid(String),
    UnknownAction(String),
}

pub fn parse_client_frame(text: &str) -> Result<ClientFrame<'_>, FrameError> {
    let not_json =
        |e: serde_json::Error| FrameError::Invalid(format!("frame is not valid JSON: {e}"));
    let frame: FrameFields = serde_json::from_str(text).map_err(|e| {
        if e.is_data() {
            invalid("frame must be a JSON object {action, data}")
        } else {
            not_json(e)
        }
    })?;
    let action = match frame.action {
        Some(Value::String(a)) => a,
        // As Skynet's server does, a missing action is an unknown one.
        None | Some(Value::Null) => return Err(FrameError::UnknownAction("undefined".into())),
        Some(other) => return Err(FrameError::UnknownAction(other.to_string())),
    };
    let data = frame.data;
    // Only a `send` is read without a `Value`: the others are rare.
    let data_value = |data: Option<Data<'_>>| match data {
        None => Ok(Value::Null),
        Some(Data::Other(value)) => Ok(value),
        Some(Data::Object(fields)) => fields.to_value().map_err(not_json),
    };
    match action.as_str() {
        "join" => parse_join(data_value(data)?).map(ClientFrame::Join),
        "leave" => Ok(ClientFrame::Leave),
        "send" => SentMessage::parse(data).map(ClientFrame::Send),
        "heartbeat" => {
            let status = match data_value(data)?.get("status") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(_) => return Err(invalid("data.status must be a string")),
            };
            Ok(ClientFrame::Heartbeat { status })
        }
        _ => Err(FrameError::UnknownAction(action)),
    }
}

/// A client frame's `action` and `data`, read in one pass. A repeated field counts once,
/// with its last value, as in `JSON.parse`; fields the protocol does not have are passed
/// over.
struct FrameFields<'a> {
    action: Option<Value>,
    data: Option<Data<'a>>,
}

/// A frame's `data`: the object it nearly always is with its fields left as text (a
/// `send`'s SkynetMessage is read from them), else the value.
#[derive(Debug)]
pub enum Data<'a> {
    Object(RawObject<'a>),
    Other(Value),
}

impl<'de> Deserialize<'de> for FrameFields<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FrameVisitor;
        impl<'de> Visitor<'de> for FrameVisitor {
            type Value = FrameFields<'de>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object {action, data}")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut frame = FrameFields {
                    action: None,
                    data: None,
                };
                while let Some(FieldName(name)) = map.next_key()? {
                    match &*name {
                        "action" => frame.action = Some(map.next_value()?),
                        "data" => frame.data = Some(map.next_value()?),
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(frame)
            }
        }
        deserializer.deserialize_map(FrameVisitor)
    }
}

impl<'de> Deserialize<'de> for Data<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DataVisitor;
        impl<'de> Visitor<'de> for DataVisitor {
            type Value = Data<'de>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                RawObject::from_map(map).map(Data::Object)
            }

            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                Value::deserialize(SeqAccessDeserializer::new(seq)).map(Data::Other)
            }

            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Data::Other(Value::Null))
            }

            fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
                Ok(Data::Other(Value::Bool(v)))
            }

            fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Data::Other(Value::from(v)))
            }

            fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Data::Other(Value::from(v)))
            }

            fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
                Ok(Data::Other(Value::from(v)))
            }

            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Data::Other(Value::String(v.to_owned())))
            }
        }
        deserializer.deserialize_any(DataVisitor)
    }
}

/// The `action` of a frame, when it is a JSON object with a string action.
pub fn action_of(text: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Action {
        action: String,
    }
    serde_json::from_str::<Action>(text).ok().map(|a| a.action)
}

fn parse_join(data: Value) -> Result<JoinRequest, FrameError> {
    let Value::Object(mut data) = data else {
        return Err(invalid(
            "data must be an object {agent, lastSeenTimestamp?}",
        ));
    };
    let Some(Value::Object(card)) = data.remove("agent") else {
        return Err(invalid("data.agent must be an AgentCard object"));
    };
    let Some(id) = card.get("id").and_then(Value::as_str).map(str::to_owned) else {
        return Err(invalid("data.agent.id must be a string"));
    };
    let human = card.get("type").and_then(Value::as_str) == Some("human");
    let last_seen = match data.get("lastSeenTimestamp") {
        None | Some(Value::Null) => None,
        Some(v) => {
            Some(as_millis(v).ok_or_else(|| invalid("data.lastSeenTimestamp must be a number"))?)
        }
    };
    Ok(JoinRequest {
        card,
        id,
        human,
        last_seen,
    })
}

pub(super) fn invalid(detail: &str) -> FrameError {
    FrameError::Invalid(detail.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `event` first, as the document writes `{event, data}`.
    #[test]
    fn events_are_written_event_first() {
        assert_eq!(
            event(EVENT_HEARTBEAT_ACK, json!({ "timestamp": 1 })),
            r#"{"event":"heartbeat.ack","data":{"timestamp":1}}"#
        );
        assert!(error_event(ERR_NOT_CONNECTED, None).starts_with(r#"{"event":"error","data":"#));
    }

    fn err(text: &str) -> FrameError {
        parse_client_frame(text).unwrap_err()
    }

    #[test]
    fn bad_frames_say_what_was_wrong() {
        assert!(matches!(err("not json"), FrameError::Invalid(d) if d.contains("not valid JSON")));
        assert!(matches!(err("[1]"), FrameError::Invalid(d) if d.contains("object")));
        assert_eq!(
            err(r#"{"action":"dance"}"#),
            FrameError::UnknownAction("dance".into())
        );
        assert_eq!(
            err(r#"{"data":{}}"#),
            FrameError::UnknownAction("undefined".into())
        );
        assert!(
            matches!(err(r#"{"action":"join","data":{}}"#), FrameError::Invalid(d) if d.contains("data.agent"))
        );
        assert!(
            matches!(err(r#"{"action":"join","data":{"agent":{"name":"x"}}}"#), FrameError::Invalid(d) if d.contains("data.agent.id"))
        );
        assert!(
            matches!(err(r#"{"action":"send","data":{"payload":{}}}"#), FrameError::Invalid(d) if d.contains("data.type"))
        );
        assert!(
            matches!(err(r#"{"action":"send","data":{"type":"chat"}}"#), FrameError::Invalid(d) if d.contains("payload"))
        );
        assert!(
            matches!(err(r#"{"action":"send","data":{"type":"chat","payload":{"text":5}}}"#), FrameError::Invalid(d) if d.contains("text"))
        );
        assert!(
            matches!(err(r#"{"action":"send","data":{"type":"chat","payload":{},"mentions":"x"}}"#), FrameError::Invalid(d) if d.contains("mentions"))
        );
        assert!(
            matches!(err(r#"{"action":"send","data":{"type":"chat","payload":{},"timestamp":"now"}}"#), FrameError::Invalid(d) if d.contains("timestamp"))
        );
    }

    #[test]
    fn data_of_any_shape_is_read_and_judged_by_the_action() {
        assert!(
            matches!(err(r#"{"action":"send","data":[1]}"#), FrameError::Invalid(d) if d.contains("SkynetMessage object"))
        );
        assert!(
            matches!(err(r#"{"action":"send"}"#), FrameError::Invalid(d) if d.contains("SkynetMessage object"))
        );
        assert!(
            matches!(err(r#"{"action":"heartbeat","data":{"status":1}}"#), FrameError::Invalid(d) if d.contains("data.status"))
        );
        assert!(matches!(
            parse_client_frame(r#"{"data":"x","action":"heartbeat","extra":{"a":[1]},"data":{"status":"busy"}}"#),
            Ok(ClientFrame::Heartbeat { status: Some(s) }) if s == "busy"
        ));
        assert!(matches!(
            parse_client_frame(r#"{"action":"heartbeat","data":null}"#),
            Ok(ClientFrame::Heartbeat { status: None })
        ));
        assert!(
            matches!(err(r#"{"action":"send","data":{"a":}}"#), FrameError::Invalid(d) if d.contains("not valid JSON"))
        );
        assert_eq!(
            err(r#"{"action":{"b":1,"a":2}}"#),
            FrameError::UnknownAction(r#"{"a":2,"b":1}"#.into())
        );
    }

    #[test]
    fn good_frames_parse() {
        let join = parse_client_frame(
            r#"{"action":"join","data":{"agent":{"id":"u1","name":"h","type":"human"},"lastSeenTimestamp":5}}"#,
        )
        .unwrap();
        assert!(
            matches!(join, ClientFrame::Join(j) if j.human && j.id == "u1" && j.last_seen == Some(5))
        );
        let send = parse_client_frame(
            r#"{"action":"send","data":{"type":"custom.thing","payload":null}}"#,
        )
        .unwrap();
        assert!(matches!(send, ClientFrame::Send(_)));
    }
}
