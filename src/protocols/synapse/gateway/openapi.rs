//! The gateway's OpenAPI 3 document, generated from the descriptor set: one operation per
//! `google.api.http` rule, a schema per message (proto3 JSON names and types), and the
//! title, version and description of the proto's `openapiv2_swagger` option.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use axum::response::{IntoResponse, Response};
use prost_reflect::{FieldDescriptor, Kind, MessageDescriptor};
use serde_json::{Map, Value, json};

use super::{RECEIVE_CALLBACK, Rule, SUBMIT_TASK_WITH_FILES, rules};
use crate::protocols::synapse::wire;

static DOCUMENT: LazyLock<Value> = LazyLock::new(document);

pub async fn serve() -> Response {
    axum::Json(DOCUMENT.clone()).into_response()
}

fn info() -> Value {
    let mut info = json!({ "title": "Synapse Protocol API", "version": "1.0.0" });
    let pool = &*wire::POOL;
    let (Some(file), Some(swagger)) = (
        pool.get_file_by_name("synapse.proto"),
        pool.get_extension_by_name("grpc.gateway.protoc_gen_openapiv2.options.openapiv2_swagger"),
    ) else {
        return info;
    };
    let options = file.options();
    if !options.has_extension(&swagger) {
        return info;
    }
    let value = options.get_extension(&swagger);
    let Some(declared) = value
        .as_message()
        .and_then(|s| s.get_field_by_name("info"))
        .and_then(|i| i.as_message().cloned())
    else {
        return info;
    };
    for key in ["title", "version", "description"] {
        if let Some(text) = declared
            .get_field_by_name(key)
            .and_then(|v| v.as_str().map(str::to_owned))
            && !text.is_empty()
        {
            info[key] = Value::String(text);
        }
    }
    info
}

fn document() -> Value {
    let mut schemas: BTreeMap<String, Value> = BTreeMap::new();
    let mut paths: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    schemas.insert(
        "Status".into(),
        json!({
            "type": "object",
            "description": "An error: the gRPC status code, and what was wrong.",
            "properties": {
                "code": { "type": "integer", "format": "int32" },
                "message": { "type": "string" },
                "details": { "type": "array", "items": { "type": "object" } }
            }
        }),
    );
    for rule in rules() {
        let operation = operation(&rule, &mut schemas);
        paths
            .entry(rule.path.clone())
            .or_default()
            .insert(rule.method.as_str().to_ascii_lowercase(), operation);
    }
    json!({
        "openapi": "3.0.3",
        "info": info(),
        "paths": paths,
        "components": { "schemas": schemas },
    })
}

fn operation(rule: &Rule, schemas: &mut BTreeMap<String, Value>) -> Value {
    let rpc = &rule.rpc;
    let input = rpc.input();
    let variables = rule.variables();
    let mut parameters: Vec<Value> = variables
        .iter()
        .map(|name| {
            let schema = input
                .get_field_by_name(name)
                .map(|f| field_schema(&f, schemas))
                .unwrap_or(json!({ "type": "string" }));
            json!({ "name": name, "in": "path", "required": true, "schema": schema })
        })
        .collect();
    if rule.body.is_empty() {
        for field in input.fields() {
            if variables.contains(&field.name().to_owned())
                || matches!(field.kind(), Kind::Message(_))
            {
                continue;
            }
            parameters.push(json!({
                "name": field.name(),
                "in": "query",
                "required": false,
                "schema": field_schema(&field, schemas),
            }));
        }
    }
    let streaming = rpc.is_server_streaming();
    let success = if streaming {
        json!({
            "description": "A stream of results, each `{\"result\": …}`.",
            "content": { "application/json": { "schema": {
                "type": "object",
                "properties": { "result": message_ref(&rpc.output(), schemas) }
            } } }
        })
    } else {
        json!({
            "description": "OK",
            "content": { "application/json": { "schema": message_ref(&rpc.output(), schemas) } }
        })
    };
    let mut op = json!({
        "operationId": format!("{}_{}", rpc.parent_service().name(), rpc.name()),
        "tags": [rpc.parent_service().name()],
        "summary": format!("{}.{}", rpc.parent_service().name(), rpc.name()),
        "responses": {
            "200": success,
            "default": {
                "description": "An error",
                "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Status" } } }
            }
        }
    });
    if !parameters.is_empty() {
        op["parameters"] = Value::Array(parameters);
    }
    if !rule.body.is_empty() {
        // ReceiveCallback's HTTP form takes the message being delivered (or nothing, to
        // poll).
        let body_schema = if rpc.full_name() == RECEIVE_CALLBACK {
            message_ref(&wire::descriptor("synapse.SynapseMessage"), schemas)
        } else if rule.body == "*" {
            message_ref(&input, schemas)
        } else {
            input
                .get_field_by_name(&rule.body)
                .map(|f| field_schema(&f, schemas))
                .unwrap_or(json!({ "type": "object" }))
        };
        op["requestBody"] = json!({
            "required": rpc.full_name() != RECEIVE_CALLBACK,
            "content": { "application/json": { "schema": body_schema } }
        });
        if rpc.full_name() == SUBMIT_TASK_WITH_FILES {
            // Also a form (form.rs): request fields as fields, each file a part.
            op["requestBody"]["content"]["multipart/form-data"] = json!({
                "schema": {
                    "type": "object",
                    "description": "SubmitTaskRequest fields (or `request`, as JSON) as form fields; every part with a file name is one of `files`",
                    "additionalProperties": { "type": "string", "format": "binary" }
                }
            });
        }
    }
    op
}

fn message_ref(desc: &MessageDescriptor, schemas: &mut BTreeMap<String, Value>) -> Value {
    if let Some(inline) = well_known(desc.full_name()) {
        return inline;
    }
    let name = desc.full_name().to_owned();
    if !schemas.contains_key(&name) {
        // Reserve the name first: messages may refer to themselves.
        schemas.insert(name.clone(), Value::Null);
        let mut properties = Map::new();
        for field in desc.fields() {
            properties.insert(field.json_name().to_owned(), field_schema(&field, schemas));
        }
        schemas.insert(
            name.clone(),
            json!({ "type": "object", "properties": properties }),
        );
    }
    json!({ "$ref": format!("#/components/schemas/{name}") })
}

fn field_schema(field: &FieldDescriptor, schemas: &mut BTreeMap<String, Value>) -> Value {
    if field.is_map() {
        let Kind::Message(entry) = field.kind() else {
            return json!({ "type": "object" });
        };
        let value = entry.map_entry_value_field();
        return json!({ "type": "object", "additionalProperties": field_schema(&value, schemas) });
    }
    let single = match field.kind() {
        Kind::String => json!({ "type": "string" }),
        Kind::Bool => json!({ "type": "boolean" }),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => {
            json!({ "type": "integer", "format": "int32" })
        }
        Kind::Uint32 | Kind::Fixed32 => json!({ "type": "integer", "format": "int64" }),
        // Proto3 JSON writes 64-bit integers as strings.
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 | Kind::Uint64 | Kind::Fixed64 => {
            json!({ "type": "string", "format": "int64" })
        }
        Kind::Float => json!({ "type": "number", "format": "float" }),
        Kind::Double => json!({ "type": "number", "format": "double" }),
        Kind::Bytes => json!({ "type": "string", "format": "byte" }),
        Kind::Enum(e) => json!({
            "type": "string",
            "enum": e.values().map(|v| v.name().to_owned()).collect::<Vec<_>>(),
        }),
        Kind::Message(m) => message_ref(&m, schemas),
    };
    if field.is_list() {
        json!({ "type": "array", "items": single })
    } else {
        single
    }
}

/// Well-known types, written as proto3 JSON writes them.
fn well_known(full_name: &str) -> Option<Value> {
    Some(match full_name {
        "google.protobuf.Timestamp" => json!({ "type": "string", "format": "date-time" }),
        "google.protobuf.Empty" => json!({ "type": "object" }),
        "google.protobuf.Any" => json!({
            "type": "object",
            "description": "Any message, with its type in \"@type\" (e.g. type.googleapis.com/google.protobuf.StringValue and its \"value\").",
            "properties": { "@type": { "type": "string" } },
            "additionalProperties": true,
        }),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rule_is_an_operation() {
        let doc = document();
        assert_eq!(doc["info"]["title"], "Synapse Protocol API");
        assert_eq!(doc["info"]["version"], "1.0.0");
        let paths = doc["paths"].as_object().unwrap();
        let operations: usize = paths.values().map(|p| p.as_object().unwrap().len()).sum();
        assert_eq!(operations, rules().len());
        assert_eq!(rules().len(), 17);
        let get = &doc["paths"]["/api/v1/synapse/task/{task_id}"]["get"];
        assert_eq!(get["parameters"][0]["name"], "task_id");
        assert_eq!(get["parameters"][0]["in"], "path");
        let schema = &doc["components"]["schemas"]["synapse.TaskInfo"]["properties"];
        assert_eq!(schema["externalTaskId"]["type"], "string");
        assert_eq!(schema["createdAt"]["format"], "date-time");
        assert!(
            schema["status"]["enum"]
                .as_array()
                .unwrap()
                .contains(&json!("TASK_STATUS_PROCESSING"))
        );
        let list = &doc["paths"]["/api/v1/synapse/tasks"]["get"]["parameters"];
        let names: Vec<&str> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["status", "limit", "offset"]);
    }
}
