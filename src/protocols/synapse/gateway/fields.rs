//! The request message an HTTP call makes: its body as proto3 JSON, then its path
//! variables and query parameters, each setting a field by proto or JSON name (`a.b.c`
//! for a nested one), as grpc-gateway fills a request.

use axum::body::Bytes;
use prost_reflect::{
    DynamicMessage, FieldDescriptor, Kind, MessageDescriptor, ReflectMessage, Value as PValue,
};
use serde_json::Value;
use tonic::Status;

use super::super::json;

/// The request a body holds (an empty one for a blank body).
pub(super) fn from_body(desc: &MessageDescriptor, body: &Bytes) -> Result<DynamicMessage, Status> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(DynamicMessage::new(desc.clone()));
    }
    let refused = |why: String| {
        crate::telemetry::decode_error(super::super::PROTOCOL);
        Status::invalid_argument(why)
    };
    let json: Value = serde_json::from_slice(body)
        .map_err(|e| refused(format!("body is not valid JSON: {e}")))?;
    json::from_json(desc, &json)
        .map_err(|e| refused(format!("body does not fit {}: {e}", desc.name())))
}

/// Where a request field's value came from.
#[derive(Clone, Copy)]
pub(super) enum Place {
    Path,
    Query,
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Place::Path => "path",
            Place::Query => "query",
        })
    }
}

/// Sets `a.b.c` (by proto or JSON name) from a path or query value. A query parameter
/// that names no field is passed over, as grpc-gateway does (a client may add its own,
/// a cache-buster say); a value that does not fit its field is refused.
pub(super) fn set_path(
    message: &mut DynamicMessage,
    dotted: &str,
    value: &str,
    place: Place,
) -> Result<(), Status> {
    let mut parts = dotted.split('.').peekable();
    let mut current = message;
    while let Some(part) = parts.next() {
        let desc = current.descriptor();
        let Some(field) = desc
            .get_field_by_name(part)
            .or_else(|| desc.get_field_by_json_name(part))
        else {
            return match place {
                Place::Query => Ok(()),
                Place::Path => Err(Status::invalid_argument(format!(
                    "{place} parameter '{dotted}': no field '{part}' in {}",
                    desc.name()
                ))),
            };
        };
        if parts.peek().is_none() {
            let parsed = scalar(&field, value).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "{place} parameter '{dotted}': '{value}' is not a valid {:?}",
                    field.kind()
                ))
            })?;
            if field.is_list() {
                if let PValue::List(list) = current.get_field_mut(&field) {
                    list.push(parsed);
                }
            } else {
                current.set_field(&field, parsed);
            }
            return Ok(());
        }
        let Kind::Message(_) = field.kind() else {
            return Err(Status::invalid_argument(format!(
                "{place} parameter '{dotted}': '{part}' is not a message"
            )));
        };
        current = match current.get_field_mut(&field) {
            PValue::Message(inner) => inner,
            _ => {
                return Err(Status::invalid_argument(format!(
                    "{place} parameter '{dotted}' cannot be set"
                )));
            }
        };
    }
    Ok(())
}

fn scalar(field: &FieldDescriptor, text: &str) -> Option<PValue> {
    Some(match field.kind() {
        Kind::String => PValue::String(text.to_owned()),
        Kind::Bool => PValue::Bool(text.parse().ok()?),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => PValue::I32(text.parse().ok()?),
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => PValue::I64(text.parse().ok()?),
        Kind::Uint32 | Kind::Fixed32 => PValue::U32(text.parse().ok()?),
        Kind::Uint64 | Kind::Fixed64 => PValue::U64(text.parse().ok()?),
        Kind::Float => PValue::F32(text.parse().ok()?),
        Kind::Double => PValue::F64(text.parse().ok()?),
        Kind::Bytes => PValue::Bytes(text.as_bytes().to_vec().into()),
        Kind::Enum(e) => PValue::EnumNumber(
            e.get_value_by_name(text)
                .map(|v| v.number())
                .or_else(|| text.parse().ok())?,
        ),
        Kind::Message(_) => return None,
    })
}
