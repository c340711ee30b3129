//! Synapse's wire vocabulary beyond the generated types: `Any` payloads (text, JSON
//! objects, task messages), timestamps, enum names, and proto3 JSON through the descriptor
//! pool.

use std::sync::LazyLock;

use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor};
use prost_types::{Any, Timestamp};
use serde_json::{Map, Number, Value};

use super::json;
use super::proto::{
    DESCRIPTOR_SET, MessageType, SynapseMessage, TaskPayload, TaskResult, TaskStatus,
    TaskStatusUpdate, TransportMode,
};
use crate::core::TaskState;

pub const STRING_VALUE: &str = "type.googleapis.com/google.protobuf.StringValue";
pub const STRUCT: &str = "type.googleapis.com/google.protobuf.Struct";
pub const TASK_PAYLOAD: &str = "type.googleapis.com/synapse.TaskPayload";
pub const TASK_RESULT: &str = "type.googleapis.com/synapse.TaskResult";
pub const TASK_STATUS_UPDATE: &str = "type.googleapis.com/synapse.TaskStatusUpdate";

/// Every message type of synapse.proto, its imports, and the wrapper and struct types.
pub static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
    DescriptorPool::decode(DESCRIPTOR_SET).expect("the compiled descriptor set decodes")
});

pub fn descriptor(full_name: &str) -> MessageDescriptor {
    POOL.get_message_by_name(full_name)
        .unwrap_or_else(|| panic!("{full_name} is in synapse.proto's descriptor set"))
}

/// Proto3 JSON of a message, as the HTTP gateway writes it (see `json`); an error when the
/// message cannot be written (a payload claiming a known type that its bytes are not, a
/// timestamp out of range, `Any`s nested too deep).
pub fn to_json<M: Message>(message: &M, full_name: &str) -> Result<Value, String> {
    let dynamic = DynamicMessage::decode(descriptor(full_name), message.encode_to_vec().as_slice())
        .map_err(|e| e.to_string())?;
    json::to_json(dynamic)
}

/// A message from proto3 JSON; unknown fields are ignored, as grpc-gateway does.
pub fn from_json<M: Message + Default>(json: &Value, full_name: &str) -> Result<M, String> {
    let dynamic = json::from_json(&descriptor(full_name), json)?;
    M::decode(dynamic.encode_to_vec().as_slice()).map_err(|e| e.to_string())
}

/// Seconds of the earliest and latest instants a `Timestamp` may hold (0001-01-01 and
/// 9999-12-31T23:59:59Z); proto3 JSON cannot write any other.
const TIMESTAMP_SECONDS: std::ops::RangeInclusive<i64> = -62_135_596_800..=253_402_300_799;

/// A `Timestamp` for `ms` since the epoch, clamped into the range a `Timestamp` may hold:
/// times from other protocols are whatever their clients said.
pub fn timestamp(ms: i64) -> Timestamp {
    let earliest = TIMESTAMP_SECONDS.start() * 1000;
    let latest = TIMESTAMP_SECONDS.end() * 1000 + 999;
    let ms = ms.clamp(earliest, latest);
    Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: (ms.rem_euclid(1000) * 1_000_000) as i32,
    }
}

/// Milliseconds since the epoch; saturates rather than overflows on a timestamp no clock
/// could show.
pub fn millis(ts: &Timestamp) -> i64 {
    ts.seconds
        .saturating_mul(1000)
        .saturating_add(i64::from(ts.nanos / 1_000_000))
}

/// Whether `ts` is a valid `Timestamp`: within years 1 to 9999, nanos within a second.
pub fn check_timestamp(ts: &Timestamp) -> Result<(), String> {
    if !TIMESTAMP_SECONDS.contains(&ts.seconds) {
        return Err(format!("seconds {} is outside years 1 to 9999", ts.seconds));
    }
    if !(0..1_000_000_000).contains(&ts.nanos) {
        return Err(format!("nanos {} is not within 0..1e9", ts.nanos));
    }
    Ok(())
}

pub fn pack<M: Message>(type_url: &str, message: &M) -> Any {
    Any {
        type_url: type_url.to_owned(),
        value: message.encode_to_vec(),
    }
}

/// Text as a `google.protobuf.StringValue`.
pub fn text(text: &str) -> Any {
    pack(STRING_VALUE, &text.to_owned())
}

/// A JSON value as a `google.protobuf.Struct` (objects) or a `StringValue` (anything else,
/// as its JSON text); an unknown `Any` that went out as JSON comes back as itself.
pub fn json(value: &Value) -> Any {
    match value {
        Value::Object(map) => {
            json::from_opaque(map).unwrap_or_else(|| pack(STRUCT, &to_struct(map)))
        }
        Value::String(s) => text(s),
        other => text(&other.to_string()),
    }
}

/// What an `Any` payload holds, as far as the bridge understands it.
#[derive(Debug, PartialEq)]
pub enum Payload {
    None,
    Text(String),
    Json(Value),
    Task(TaskPayload),
    Result(TaskResult),
    Status(TaskStatusUpdate),
    /// A type the bridge does not know: kept as its type URL and bytes.
    Opaque {
        type_url: String,
        bytes: Vec<u8>,
    },
}

pub fn unpack(any: Option<&Any>) -> Payload {
    let Some(any) = any else {
        return Payload::None;
    };
    let bytes = any.value.as_slice();
    let decoded = match any.type_url.as_str() {
        STRING_VALUE => String::decode(bytes).map(Payload::Text),
        STRUCT => prost_types::Struct::decode(bytes).map(|s| Payload::Json(from_struct(&s))),
        TASK_PAYLOAD => TaskPayload::decode(bytes).map(Payload::Task),
        TASK_RESULT => TaskResult::decode(bytes).map(Payload::Result),
        TASK_STATUS_UPDATE => TaskStatusUpdate::decode(bytes).map(Payload::Status),
        _ => Ok(Payload::Opaque {
            type_url: any.type_url.clone(),
            bytes: any.value.clone(),
        }),
    };
    decoded.unwrap_or_else(|_| Payload::Opaque {
        type_url: any.type_url.clone(),
        bytes: any.value.clone(),
    })
}

impl Payload {
    /// The payload's text, when it is text or a JSON object with a `text` field.
    pub fn text(&self) -> Option<String> {
        match self {
            Payload::Text(t) => Some(t.clone()),
            Payload::Json(v) => v.get("text").and_then(Value::as_str).map(str::to_owned),
            _ => None,
        }
    }

    /// The payload as JSON, for other protocols' structured data.
    pub fn json(&self) -> Option<Value> {
        self.json_within(json::MAX_DEPTH)
    }

    /// As `json`, with nested payloads written out `depth` levels deep at most.
    fn json_within(&self, depth: usize) -> Option<Value> {
        match self {
            Payload::None => None,
            Payload::Text(t) => Some(Value::String(t.clone())),
            Payload::Json(v) => Some(v.clone()),
            Payload::Task(t) => Some(serde_json::json!({
                "taskId": t.task_id, "taskType": t.task_type, "externalTaskId": t.external_task_id,
                "payload": nested_json(t.payload.as_ref(), depth),
            })),
            Payload::Result(r) => Some(serde_json::json!({
                "taskId": r.task_id, "taskType": r.task_type, "summary": r.summary,
                "result": nested_json(r.result.as_ref(), depth),
            })),
            Payload::Status(s) => Some(serde_json::json!({
                "taskId": s.task_id, "status": status_name(s.status), "progress": s.progress,
                "message": s.message,
            })),
            // Kept whole, so that it can come back to a Synapse agent unchanged.
            Payload::Opaque { type_url, bytes } => Some(json::opaque(&Any {
                type_url: type_url.clone(),
                value: bytes.clone(),
            })),
        }
    }
}

/// A payload inside a payload as JSON; past `depth` levels, as its bytes (each level is
/// decoded on its own, so only a limit bounds the recursion).
fn nested_json(any: Option<&Any>, depth: usize) -> Option<Value> {
    let any = any?;
    match depth.checked_sub(1) {
        Some(depth) => unpack(Some(any)).json_within(depth),
        None => Some(json::opaque(any)),
    }
}

fn to_struct(map: &Map<String, Value>) -> prost_types::Struct {
    prost_types::Struct {
        fields: map
            .iter()
            .map(|(k, v)| (k.clone(), to_proto_value(v)))
            .collect(),
    }
}

fn to_proto_value(value: &Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match value {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(list) => Kind::ListValue(prost_types::ListValue {
            values: list.iter().map(to_proto_value).collect(),
        }),
        Value::Object(map) => Kind::StructValue(to_struct(map)),
    };
    prost_types::Value { kind: Some(kind) }
}

fn from_struct(s: &prost_types::Struct) -> Value {
    Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), from_proto_value(v)))
            .collect(),
    )
}

fn from_proto_value(value: &prost_types::Value) -> Value {
    use prost_types::value::Kind;
    match &value.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(*b),
        Some(Kind::NumberValue(n)) => {
            // Integral numbers come back as integers, as they most likely went in.
            if n.fract() == 0.0 && n.abs() < 9.0e15 {
                Value::Number(Number::from(*n as i64))
            } else {
                Number::from_f64(*n)
                    .map(Value::Number)
                    .unwrap_or(Value::Null)
            }
        }
        Some(Kind::StringValue(s)) => Value::String(s.clone()),
        Some(Kind::ListValue(list)) => {
            Value::Array(list.values.iter().map(from_proto_value).collect())
        }
        Some(Kind::StructValue(s)) => from_struct(s),
    }
}

/// Canonical task state → Synapse `TaskStatus`, and back. One table, both directions.
const TASK_STATES: &[(TaskState, TaskStatus)] = &[
    (TaskState::Assigned, TaskStatus::Received),
    (TaskState::Working, TaskStatus::Processing),
    (TaskState::Waiting, TaskStatus::Waiting),
    (TaskState::Completed, TaskStatus::Completed),
    (TaskState::Failed, TaskStatus::Failed),
    (TaskState::Cancelled, TaskStatus::Cancelled),
    (TaskState::Rejected, TaskStatus::Rejected),
    // Synapse has no words for these; the nearest is shown, and read back as the above.
    (TaskState::Submitted, TaskStatus::Received),
    (TaskState::InReview, TaskStatus::Processing),
];

pub fn status_for(state: TaskState) -> TaskStatus {
    TASK_STATES
        .iter()
        .find(|(s, _)| *s == state)
        .map(|(_, st)| *st)
        .unwrap_or(TaskStatus::Received)
}

pub fn state_of(status: i32) -> Option<TaskState> {
    let status = TaskStatus::try_from(status).ok()?;
    TASK_STATES
        .iter()
        .find(|(_, st)| *st == status)
        .map(|(s, _)| *s)
}

pub fn is_terminal(status: TaskStatus) -> bool {
    matches!(
        status,
        TaskStatus::Completed | TaskStatus::Failed | TaskStatus::Cancelled | TaskStatus::Rejected
    )
}

pub fn status_name(status: i32) -> &'static str {
    TaskStatus::try_from(status)
        .map(|s| s.as_str_name())
        .unwrap_or("TASK_STATUS_UNSPECIFIED")
}

/// A `TaskStatus` from its full name (`TASK_STATUS_PROCESSING`), its short name
/// (`PROCESSING`, any case) or its number.
pub fn parse_status(text: &str) -> Option<TaskStatus> {
    if let Ok(n) = text.parse::<i32>() {
        return TaskStatus::try_from(n).ok();
    }
    let upper = text.trim().to_ascii_uppercase();
    TaskStatus::from_str_name(&upper)
        .or_else(|| TaskStatus::from_str_name(&format!("TASK_STATUS_{upper}")))
}

pub fn message_type(msg: &SynapseMessage) -> MessageType {
    MessageType::try_from(msg.r#type).unwrap_or(MessageType::Unspecified)
}

/// A transport mode from a config or header value: `callback`, `TRANSPORT_MODE_POLLING`, …
pub fn parse_transport(text: &str) -> Option<TransportMode> {
    let upper = text.trim().to_ascii_uppercase();
    TransportMode::from_str_name(&upper)
        .or_else(|| TransportMode::from_str_name(&format!("TRANSPORT_MODE_{upper}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn payloads_round_trip() {
        assert_eq!(unpack(Some(&text("hello"))), Payload::Text("hello".into()));
        let data = json!({ "a": 1, "b": [true, null, "x"], "c": { "d": 2.5 } });
        assert_eq!(unpack(Some(&json(&data))), Payload::Json(data));
        let task = TaskPayload {
            task_id: "t".into(),
            task_type: "review".into(),
            payload: Some(text("diff")),
            external_task_id: String::new(),
        };
        assert_eq!(
            unpack(Some(&pack(TASK_PAYLOAD, &task))),
            Payload::Task(task)
        );
        let odd = Any {
            type_url: "type.googleapis.com/x.Y".into(),
            value: vec![1, 2],
        };
        assert!(matches!(unpack(Some(&odd)), Payload::Opaque { .. }));
    }

    #[test]
    fn statuses_map_both_ways_and_parse_loosely() {
        for (state, status) in TASK_STATES.iter().take(7) {
            assert_eq!(status_for(*state), *status);
            assert_eq!(state_of(*status as i32), Some(*state));
        }
        assert_eq!(parse_status("processing"), Some(TaskStatus::Processing));
        assert_eq!(parse_status("TASK_STATUS_FAILED"), Some(TaskStatus::Failed));
        assert_eq!(parse_status("3"), Some(TaskStatus::Completed));
        assert_eq!(parse_status("done"), None);
        assert_eq!(parse_transport("callback"), Some(TransportMode::Callback));
        assert_eq!(
            parse_transport("TRANSPORT_MODE_SYNC"),
            Some(TransportMode::Sync)
        );
    }

    #[test]
    fn json_is_proto3_canonical() {
        let msg = SynapseMessage {
            id: "m1".into(),
            r#type: MessageType::P2pTaskRequest as i32,
            timestamp: Some(timestamp(1_767_225_600_123)),
            payload: Some(text("hi")),
            ..Default::default()
        };
        let value = to_json(&msg, "synapse.SynapseMessage").unwrap();
        assert_eq!(value["type"], "MESSAGE_TYPE_P2P_TASK_REQUEST");
        assert_eq!(value["timestamp"], "2026-01-01T00:00:00.123Z");
        assert_eq!(value["payload"]["@type"], STRING_VALUE);
        assert_eq!(value["payload"]["value"], "hi");
        assert_eq!(value["correlationId"], "");
        let back: SynapseMessage = from_json(&value, "synapse.SynapseMessage").unwrap();
        assert_eq!(back, msg);
        assert!(
            from_json::<SynapseMessage>(&json!({ "type": 5.5 }), "synapse.SynapseMessage").is_err()
        );
    }

    #[test]
    fn timestamps_convert() {
        assert_eq!(millis(&timestamp(1234)), 1234);
        assert_eq!(millis(&timestamp(-1)), -1);
        let huge = Timestamp {
            seconds: i64::MAX,
            nanos: 999_999_999,
        };
        assert_eq!(millis(&huge), i64::MAX);
        assert_eq!(
            millis(&Timestamp {
                seconds: i64::MIN,
                nanos: -999_999_999
            }),
            i64::MIN
        );
        assert!(check_timestamp(&huge).is_err());
        assert!(
            check_timestamp(&Timestamp {
                seconds: 0,
                nanos: -1
            })
            .is_err()
        );
        assert!(check_timestamp(&timestamp(1_767_225_600_123)).is_ok());
        // Other protocols' times are clamped into what a Timestamp may hold.
        assert!(check_timestamp(&timestamp(i64::MAX)).is_ok());
        assert!(check_timestamp(&timestamp(i64::MIN)).is_ok());
    }

    #[test]
    fn nested_payloads_stop_at_the_depth_limit() {
        let mut any = text("core");
        for _ in 0..1000 {
            any = pack(
                TASK_PAYLOAD,
                &TaskPayload {
                    payload: Some(any),
                    ..Default::default()
                },
            );
        }
        let mut json = unpack(Some(&any)).json().unwrap();
        let mut levels = 0;
        while json["payload"]["taskId"].is_string() {
            json = json["payload"].take();
            levels += 1;
        }
        assert_eq!(levels, json::MAX_DEPTH);
        assert_eq!(json["payload"]["@type"], TASK_PAYLOAD);
    }
}
