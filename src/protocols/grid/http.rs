//! The Grid's HTTP interface: post messages (YAML, or JSON), poll for messages, list who
//! is there, and the WebSocket upgrade. Answers are YAML unless the request was JSON or
//! asks for it (`Accept: application/json`).

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use super::db::Instances;
use super::wire::{self, Invalid, Message};
use super::{Grid, Source, ws};
use crate::core::Role;
use crate::shared::deep_json::from_own_str;
use crate::shared::http_refusals::{self, Asked};

type Shared = State<Arc<Grid>>;

pub fn router(grid: Arc<Grid>) -> Router {
    let body_limit = axum::extract::DefaultBodyLimit::max(grid.config.max_body_bytes);
    let read_budget = grid.read_budget.clone();
    let app = Router::new()
        .route("/grid/v1/messages", post(post_messages).get(poll))
        .route("/grid/v1/agents", get(agents))
        .route("/grid/v1/ws", get(upgrade))
        .fallback(|headers: HeaderMap| async move {
            let missing = Invalid {
                code: "NOT_FOUND",
                ..invalid(
                    "path",
                    "no such Grid resource; see /grid/v1/messages, /grid/v1/agents, /grid/v1/ws"
                        .into(),
                )
            };
            error(&missing, wants_json(&headers, false))
        })
        .with_state(grid)
        .layer(body_limit);
    http_refusals::shaped(app, super::PROTOCOL, &read_budget, refused)
}

/// A refusal of axum's (a body over the limit, a bad query, a wrong method) as a Grid
/// error message, with axum's status.
fn refused(status: StatusCode, text: &str, asked: &Asked) -> Response {
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "PAYLOAD_TOO_LARGE",
        StatusCode::METHOD_NOT_ALLOWED => "METHOD_NOT_ALLOWED",
        StatusCode::NOT_FOUND => "NOT_FOUND",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "UNSUPPORTED_MEDIA_TYPE",
        StatusCode::SERVICE_UNAVAILABLE => "BUSY",
        s if s.is_server_error() => "INTERNAL",
        _ => "VALIDATION_FAILED",
    };
    let field = if status == StatusCode::PAYLOAD_TOO_LARGE {
        "body"
    } else {
        "request"
    };
    let refusal = Invalid {
        code,
        ..invalid(field, text.to_owned())
    };
    let message = wire::error_message(&refusal);
    if asked.json() {
        return answer(status, &json!({ "message": message }), true);
    }
    yaml_answer(status, wire::to_yaml(&message))
}

fn wants_json(headers: &HeaderMap, sent_json: bool) -> bool {
    sent_json
        || headers
            .get(header::ACCEPT)
            .and_then(|a| a.to_str().ok())
            .is_some_and(|a| a.contains("application/json"))
}

/// A YAML (or JSON) answer.
fn answer(status: StatusCode, body: &Value, json: bool) -> Response {
    if json {
        return (status, axum::Json(body.clone())).into_response();
    }
    yaml_answer(status, serde_saphyr::to_string(body).unwrap_or_default())
}

fn yaml_answer(status: StatusCode, yaml: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/yaml")], yaml).into_response()
}

/// A Grid error message as the answer, with the status its code calls for.
fn error(invalid: &Invalid, json: bool) -> Response {
    let status = match invalid.code {
        "UNKNOWN_RECEIVER" | "NOT_FOUND" => StatusCode::NOT_FOUND,
        "NAME_TAKEN" => StatusCode::CONFLICT,
        "STORE_FAILED" => StatusCode::INTERNAL_SERVER_ERROR,
        _ => StatusCode::BAD_REQUEST,
    };
    if invalid.code == "VALIDATION_FAILED" {
        crate::telemetry::decode_error(super::PROTOCOL);
    }
    let message = wire::error_message(invalid);
    if json {
        return answer(status, &json!({ "message": message }), true);
    }
    // Written as every Grid message is, in the document's field order.
    yaml_answer(status, wire::to_yaml(&message))
}

fn invalid(field: &str, message: String) -> Invalid {
    Invalid {
        code: "VALIDATION_FAILED",
        field: field.into(),
        message,
        id: None,
        sender: None,
    }
}

async fn post_messages(State(grid): Shared, headers: HeaderMap, body: Bytes) -> Response {
    let sent_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|c| c.to_str().ok())
        .is_some_and(|c| c.contains("json"));
    let json = wants_json(&headers, sent_json);
    let Ok(text) = std::str::from_utf8(&body) else {
        return error(&invalid("body", "the body is not UTF-8 text".into()), json);
    };
    let docs = match wire::parse_documents(text, sent_json) {
        Ok(docs) => docs,
        Err(e) => return error(&e, json),
    };
    // Every message is checked before any is accepted: a bad one refuses the request.
    let mut messages: Vec<Message> = Vec::with_capacity(docs.len());
    let several = docs.len() > 1;
    for (i, doc) in docs.into_iter().enumerate() {
        match wire::validate(doc) {
            Ok(msg) => messages.push(msg),
            Err(mut e) => {
                if several {
                    e.message = format!("document {}: {}", i + 1, e.message);
                }
                return error(&e, json);
            }
        }
    }
    for msg in &messages {
        if let Err(refusal) = grid.check_receiver(msg).await {
            return error(&refusal, json);
        }
    }
    let mut accepted = Vec::with_capacity(messages.len());
    for msg in messages {
        match grid.accept(msg, Source::Http).await {
            Ok(id) => accepted.push(id),
            Err(e) => return error(&e, json),
        }
    }
    answer(StatusCode::ACCEPTED, &json!({ "accepted": accepted }), json)
}

/// `since`: an ISO-8601 time or milliseconds since the epoch.
fn since(query: &HashMap<String, String>) -> Result<Option<i64>, Invalid> {
    match query.get("since").filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(text) => text
            .parse::<i64>()
            .ok()
            .or_else(|| wire::parse_timestamp(text))
            .map(Some)
            .ok_or_else(|| {
                invalid(
                    "since",
                    format!("since must be an ISO-8601 time or milliseconds, not '{text}'"),
                )
            }),
    }
}

/// The messages waiting for `agent` (highest priority first); fetched messages are gone.
async fn poll(
    State(grid): Shared,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let json = wants_json(&headers, false);
    let Some(agent) = query.get("agent").filter(|a| !a.is_empty()).cloned() else {
        return error(
            &invalid(
                "agent",
                "agent (the polling program's name) is required".into(),
            ),
            json,
        );
    };
    let since = match since(&query) {
        Ok(since) => since,
        Err(e) => return error(&e, json),
    };
    if let Err(e) = grid.register(&agent).await {
        return error(&e, json);
    }
    // What was accepted before this poll may still be on its way to the queue.
    grid.flush().await;
    // A poll that names its instance takes what is for the agent and for that instance,
    // and leaves what is for the others.
    let instances = match query.get("instance_id").filter(|i| !i.is_empty()) {
        Some(instance) => Instances::Of(Some(instance)),
        None => Instances::All,
    };
    // Mail left for a later take (NATS did not answer) is kept again by the bridge's
    // settling of it (`UnsettledMail`), for a later poll.
    let queued = match grid.take_queued(&agent, since, instances).await {
        Ok(mail) => mail.taken,
        Err(e) => {
            tracing::error!(error = %e, "grid: cannot read the queue");
            return error(
                &Invalid {
                    code: "STORE_FAILED",
                    ..invalid("agent", "the queue could not be read".into())
                },
                json,
            );
        }
    };
    let messages: Vec<Value> = queued
        .iter()
        .filter_map(|q| from_own_str::<Value>(&q.message.body).ok())
        .collect();
    if json {
        return answer(StatusCode::OK, &json!({ "messages": messages }), true);
    }
    yaml_answer(StatusCode::OK, wire::to_yaml_stream(&messages))
}

/// Who is there: every agent the bridge knows, of every protocol, and whether it is online.
async fn agents(State(grid): Shared, headers: HeaderMap) -> Response {
    answer(
        StatusCode::OK,
        &json!({ "agents": grid.roster() }),
        wants_json(&headers, false),
    )
}

impl Grid {
    pub fn roster(&self) -> Vec<Value> {
        self.core
            .directory
            .list()
            .into_iter()
            .map(|a| {
                let mut agent = json!({
                    "agent": a.name,
                    "protocol": a.protocol,
                    "role": match a.role { Role::Human => "human", Role::Agent => "agent" },
                    "online": a.online,
                    "status": if a.online { a.status.as_str() } else { "offline" },
                });
                // In a fleet, the bridge that holds it.
                if let Some(bridge) = self.core.directory.holding_bridge(&a) {
                    agent["bridge"] = json!(bridge);
                }
                agent
            })
            .collect()
    }
}

async fn upgrade(
    State(grid): Shared,
    Query(query): Query<HashMap<String, String>>,
    upgrade: crate::shared::websocket::Upgrade,
) -> Response {
    upgrade
        .max_message_size(grid.config.max_frame_bytes)
        .read_budget(grid.read_budget.clone())
        .on_upgrade(move |socket| ws::serve(socket, grid, query))
}
