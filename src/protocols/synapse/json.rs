//! Proto3 JSON of synapse.proto's messages through the descriptor pool, including `Any`
//! payloads whose type the pool does not hold.
//!
//! prost-reflect refuses an `Any` it cannot resolve, but a broker relays payloads it does
//! not understand. Such an `Any` is written in the shape proto3 JSON gives an `Any` of a
//! well-known type, `{"@type": url, "value": <base64 of its bytes>}`, and read back from
//! that shape to the same bytes. Everything else is prost-reflect's canonical JSON. Each
//! `Any` level is decoded on its own, so nothing but `MAX_DEPTH` bounds how deep the walk
//! goes: deeper nesting is refused.

use base64::Engine;
use base64::engine::general_purpose::{
    STANDARD, STANDARD_PAD_INDIFFERENT, URL_SAFE_PAD_INDIFFERENT,
};
use prost_reflect::{
    DeserializeOptions, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor, ReflectMessage,
    SerializeOptions, Value as PValue,
};
use serde_json::{Map, Value};

use super::wire::{self, POOL};

const ANY: &str = "google.protobuf.Any";

/// How deep `Any` payloads may nest inside one another.
pub const MAX_DEPTH: usize = 32;

/// A message as proto3 JSON: lowerCamelCase names, enums by name, 64-bit integers as
/// strings, every field present (as grpc-gateway writes it).
pub fn to_json(message: DynamicMessage) -> Result<Value, String> {
    message_json(message, 0)
}

/// A message of type `desc` from proto3 JSON; unknown fields are ignored, as grpc-gateway
/// does.
pub fn from_json(desc: &MessageDescriptor, json: &Value) -> Result<DynamicMessage, String> {
    message_from(desc, json, 0)
}

/// Checks that `any`'s proto3 JSON can be written (what a callback or the gateway will
/// write of it), without keeping it. A `StringValue` is checked by decoding it alone: the
/// generic walk costs a message tens of thousands of instructions.
pub fn check_any(any: &prost_types::Any) -> Result<(), String> {
    if any.type_url == wire::STRING_VALUE {
        return <String as prost::Message>::decode(any.value.as_slice())
            .map(drop)
            .map_err(|e| format!("'{}' holds bytes that are not a string: {e}", any.type_url));
    }
    let dynamic = DynamicMessage::decode(
        POOL.get_message_by_name(ANY).expect("the pool holds Any"),
        prost::Message::encode_to_vec(any).as_slice(),
    )
    .map_err(|e| e.to_string())?;
    any_json(&dynamic, 0).map(drop)
}

/// The JSON of an `Any` the bridge cannot resolve.
pub fn opaque(any: &prost_types::Any) -> Value {
    serde_json::json!({ "@type": any.type_url, "value": STANDARD.encode(&any.value) })
}

/// The `Any` behind JSON in the `opaque` shape, when its type is one the bridge cannot
/// resolve (a resolvable type in that shape is that type's own JSON).
pub fn from_opaque(json: &Map<String, Value>) -> Option<prost_types::Any> {
    let url = json.get("@type")?.as_str()?;
    if json.len() != 2 || resolve(url).is_some() {
        return None;
    }
    Some(prost_types::Any {
        type_url: url.to_owned(),
        value: decode_base64(json.get("value")?.as_str()?)?,
    })
}

/// Proto3 JSON accepts bytes in either base64 alphabet, padded or not.
fn decode_base64(text: &str) -> Option<Vec<u8>> {
    STANDARD_PAD_INDIFFERENT
        .decode(text)
        .or_else(|_| URL_SAFE_PAD_INDIFFERENT.decode(text))
        .ok()
}

fn resolve(type_url: &str) -> Option<MessageDescriptor> {
    let (_, name) = type_url.rsplit_once('/')?;
    POOL.get_message_by_name(name)
}

/// Well-known types have their own JSON, which prost-reflect writes; none holds an `Any`
/// but `Any` itself.
fn is_well_known(desc: &MessageDescriptor) -> bool {
    desc.package_name() == "google.protobuf"
}

/// Fields whose JSON is written here rather than by prost-reflect: `Any`s, and messages
/// that may hold one somewhere inside.
fn written_here(field: &FieldDescriptor) -> bool {
    match field.kind() {
        Kind::Message(desc) if !field.is_map() => desc.full_name() == ANY || !is_well_known(&desc),
        _ => false,
    }
}

fn serialize(message: &DynamicMessage) -> Result<Value, String> {
    let options = SerializeOptions::new()
        .skip_default_fields(false)
        .stringify_64_bit_integers(true);
    message
        .serialize_with_options(serde_json::value::Serializer, &options)
        .map_err(|e| e.to_string())
}

fn deserialize(desc: &MessageDescriptor, json: &Value) -> Result<DynamicMessage, String> {
    let options = DeserializeOptions::new().deny_unknown_fields(false);
    DynamicMessage::deserialize_with_options(desc.clone(), json, &options)
        .map_err(|e| e.to_string())
}

/// Takes the message apart rather than copying it: the fields written here are taken out,
/// prost-reflect writes what is left.
fn message_json(message: DynamicMessage, depth: usize) -> Result<Value, String> {
    let mut rest = message;
    let mut own = Vec::new();
    for field in rest.descriptor().fields() {
        if !written_here(&field) || !rest.has_field(&field) {
            continue;
        }
        let value = rest
            .take_field(&field)
            .unwrap_or_else(|| field.default_value());
        let json = value_json(value, depth).map_err(|e| format!("{}: {e}", field.json_name()))?;
        own.push((field.json_name().to_owned(), json));
    }
    let mut json = serialize(&rest)?;
    if let Value::Object(map) = &mut json {
        // In place of prost-reflect's default for the emptied field: the order stays.
        map.extend(own);
    }
    Ok(json)
}

fn value_json(value: PValue, depth: usize) -> Result<Value, String> {
    match value {
        PValue::Message(message) => nested_json(message, depth),
        PValue::List(items) => items.into_iter().map(|i| value_json(i, depth)).collect(),
        _ => Err("expected a message".into()),
    }
}

fn nested_json(message: DynamicMessage, depth: usize) -> Result<Value, String> {
    if message.descriptor().full_name() == ANY {
        any_json(&message, depth)
    } else {
        message_json(message, depth)
    }
}

fn any_json(any: &DynamicMessage, depth: usize) -> Result<Value, String> {
    if depth >= MAX_DEPTH {
        return Err(format!("Any payloads nest deeper than {MAX_DEPTH} levels"));
    }
    let raw: prost_types::Any = any.transcode_to().map_err(|e| e.to_string())?;
    let Some(desc) = resolve(&raw.type_url) else {
        return Ok(opaque(&raw));
    };
    let inner = DynamicMessage::decode(desc.clone(), raw.value.as_slice()).map_err(|e| {
        format!(
            "'{}' holds bytes that are not a {}: {e}",
            raw.type_url,
            desc.full_name()
        )
    })?;
    if desc.full_name() == ANY {
        return Ok(
            serde_json::json!({ "@type": raw.type_url, "value": any_json(&inner, depth + 1)? }),
        );
    }
    if is_well_known(&desc) {
        return serialize(any);
    }
    let mut out = Map::new();
    out.insert("@type".into(), Value::String(raw.type_url.clone()));
    if let Value::Object(fields) = message_json(inner, depth + 1)? {
        out.extend(fields);
    }
    Ok(Value::Object(out))
}

fn message_from(
    desc: &MessageDescriptor,
    json: &Value,
    depth: usize,
) -> Result<DynamicMessage, String> {
    let Value::Object(map) = json else {
        return deserialize(desc, json);
    };
    let mut rest = map.clone();
    let mut own = Vec::new();
    for field in desc.fields().filter(written_here) {
        for key in [field.json_name(), field.name()] {
            if let Some(value) = rest.remove(key).filter(|v| !v.is_null()) {
                own.push((field.clone(), value));
            }
        }
    }
    let mut message = deserialize(desc, &Value::Object(rest))?;
    for (field, json) in own {
        let value =
            value_from(&field, &json, depth).map_err(|e| format!("{}: {e}", field.json_name()))?;
        message.set_field(&field, value);
    }
    Ok(message)
}

fn value_from(field: &FieldDescriptor, json: &Value, depth: usize) -> Result<PValue, String> {
    let Kind::Message(desc) = field.kind() else {
        return Err("expected a message".into());
    };
    if !field.is_list() {
        return nested_from(&desc, json, depth);
    }
    let items = json.as_array().ok_or("expected an array")?;
    let list = items
        .iter()
        .map(|item| nested_from(&desc, item, depth))
        .collect::<Result<_, _>>()?;
    Ok(PValue::List(list))
}

fn nested_from(desc: &MessageDescriptor, json: &Value, depth: usize) -> Result<PValue, String> {
    let message = if desc.full_name() == ANY {
        any_from(desc, json, depth)?
    } else {
        message_from(desc, json, depth)?
    };
    Ok(PValue::Message(message))
}

fn any_from(any: &MessageDescriptor, json: &Value, depth: usize) -> Result<DynamicMessage, String> {
    if depth >= MAX_DEPTH {
        return Err(format!("Any payloads nest deeper than {MAX_DEPTH} levels"));
    }
    let fields = json
        .as_object()
        .ok_or("an Any is a JSON object with \"@type\"")?;
    let url = fields
        .get("@type")
        .and_then(Value::as_str)
        .ok_or("an Any needs \"@type\"")?;
    let bytes = match resolve(url) {
        Some(desc) if desc.full_name() == ANY => {
            let inner = fields.get("value").ok_or("an Any of an Any needs \"value\"")?;
            prost::Message::encode_to_vec(&any_from(&desc, inner, depth + 1)?)
        }
        Some(desc) if is_well_known(&desc) => return deserialize(any, json),
        Some(desc) => {
            let mut inner = fields.clone();
            inner.remove("@type");
            prost::Message::encode_to_vec(&message_from(&desc, &Value::Object(inner), depth + 1)?)
        }
        None => from_opaque(fields).map(|a| a.value).ok_or_else(|| {
            format!(
                "type '{url}' is unknown to the bridge: send it as {{\"@type\", \"value\": <base64 of its bytes>}}"
            )
        })?,
    };
    let mut message = DynamicMessage::new(any.clone());
    message.set_field_by_name("type_url", PValue::String(url.to_owned()));
    message.set_field_by_name("value", PValue::Bytes(bytes.into()));
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::synapse::proto::{SynapseMessage, TaskPayload};
    use crate::protocols::synapse::wire;
    use serde_json::json;

    fn secret() -> prost_types::Any {
        prost_types::Any {
            type_url: "type.googleapis.com/acme.Secret".into(),
            value: vec![1, 2, 3, 250],
        }
    }

    #[test]
    fn unknown_any_round_trips_at_any_depth() {
        let task = TaskPayload {
            task_id: "t".into(),
            task_type: "x".into(),
            payload: Some(secret()),
            external_task_id: String::new(),
        };
        let msg = SynapseMessage {
            id: "m".into(),
            payload: Some(wire::pack(wire::TASK_PAYLOAD, &task)),
            ..Default::default()
        };
        let value = wire::to_json(&msg, "synapse.SynapseMessage").unwrap();
        assert_eq!(value["payload"]["@type"], wire::TASK_PAYLOAD);
        assert_eq!(value["payload"]["taskId"], "t");
        assert_eq!(
            value["payload"]["payload"],
            json!({ "@type": "type.googleapis.com/acme.Secret", "value": "AQID+g==" })
        );
        let back: SynapseMessage = wire::from_json(&value, "synapse.SynapseMessage").unwrap();
        assert_eq!(back, msg);
    }

    #[test]
    fn opaque_shapes_are_only_for_unknown_types() {
        let map = |v: Value| v.as_object().unwrap().clone();
        assert_eq!(
            from_opaque(&map(json!({ "@type": "x/acme.Secret", "value": "AQID-g" }))),
            Some(prost_types::Any {
                type_url: "x/acme.Secret".into(),
                value: vec![1, 2, 3, 250]
            })
        );
        assert_eq!(
            from_opaque(&map(json!({ "@type": wire::STRING_VALUE, "value": "hi" }))),
            None
        );
        assert_eq!(
            from_opaque(&map(json!({ "@type": "x/a.B", "value": "!" }))),
            None
        );
        assert_eq!(
            from_opaque(&map(json!({ "@type": "x/a.B", "value": "", "more": 1 }))),
            None
        );
        let err = wire::from_json::<SynapseMessage>(
            &json!({ "payload": { "@type": "x/a.B", "field": 1 } }),
            "synapse.SynapseMessage",
        )
        .unwrap_err();
        assert!(err.contains("payload") && err.contains("x/a.B"), "{err}");
    }

    #[test]
    fn bad_bytes_of_a_known_type_and_deep_nesting_are_errors() {
        let msg = SynapseMessage {
            payload: Some(prost_types::Any {
                type_url: wire::TASK_PAYLOAD.into(),
                value: vec![0xff, 0xff],
            }),
            ..Default::default()
        };
        let err = wire::to_json(&msg, "synapse.SynapseMessage").unwrap_err();
        assert!(err.starts_with("payload:"), "{err}");
        let mut any = secret();
        for _ in 0..MAX_DEPTH {
            any = wire::pack(
                wire::TASK_PAYLOAD,
                &TaskPayload {
                    payload: Some(any),
                    ..Default::default()
                },
            );
        }
        let deep = SynapseMessage {
            payload: Some(any),
            ..Default::default()
        };
        assert!(wire::to_json(&deep, "synapse.SynapseMessage").is_err());
    }
}
