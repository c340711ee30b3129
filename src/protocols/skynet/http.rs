//! Skynet's HTTP API: registration, listings, history, agent control and schedules, with the status
//! codes and `{error}` bodies of Skynet's reference server.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use super::registry::{Profile, RegisterError};
use super::schedules::ScheduleError;
use super::{PROTOCOL, Skynet, records, schedules, ws};
use crate::core::MessageQuery;
use crate::core::{Audience, Envelope, Kind, Origin, new_message_id, now_ms};
use crate::shared::{http_refusals, to_the_end};

type Shared = State<Arc<Skynet>>;

pub fn router(skynet: Arc<Skynet>) -> Router {
    let body_limit = DefaultBodyLimit::max(skynet.config.max_body_bytes);
    let read_budget = skynet.read_budget.clone();
    let app = Router::new()
        .route("/health", get(health))
        .route("/api/agents/{id}", get(get_agent).delete(delete_agent))
        .route("/api/agents/{id}/interrupt", post(interrupt))
        .route("/api/agents/{id}/forget", post(forget))
        .route("/api/agents/{id}/watch", post(watch))
        .route("/api/agents/{id}/unwatch", post(unwatch))
        .route("/api/humans/{id}", get(get_human).delete(delete_human))
        .route(
            "/api/schedules",
            post(schedules::routes::create).get(schedules::routes::list),
        )
        .route(
            "/api/schedules/{id}",
            get(schedules::routes::get)
                .patch(schedules::routes::update)
                .delete(schedules::routes::delete),
        )
        // Above: a write is made to its end even if its client goes (a profile deleted
        // from the store and still listed, its name still held). A registration runs to
        // its end only once its name is claimed (`Registry::create`).
        .route_layer(to_the_end::WritesToTheEnd(skynet.core.to_the_end.clone()))
        .route("/api/agents", post(create_agent).get(list_agents))
        .route("/api/humans", post(create_human).get(list_humans))
        .route("/api/names/check", get(check_name))
        .route("/api/members", get(members))
        .route("/api/messages", get(messages))
        .route("/ws", get(upgrade))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "Not found") })
        .with_state(skynet)
        .layer(body_limit);
    http_refusals::shaped(app, PROTOCOL, &read_budget, |status, text, _| {
        (status, axum::Json(json!({ "error": text }))).into_response()
    })
}

/// An HTTP error with Skynet's `{error}` body.
pub(super) struct ApiError(StatusCode, String);

impl ApiError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError(status, message.into())
    }

    pub(super) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.0 == StatusCode::BAD_REQUEST {
            crate::telemetry::decode_error(super::PROTOCOL);
        }
        (self.0, axum::Json(json!({ "error": self.1 }))).into_response()
    }
}

pub(super) type ApiResult = Result<Response, ApiError>;

fn error(status: StatusCode, message: &str) -> Response {
    ApiError::new(status, message).into_response()
}

fn ok(value: Value) -> Response {
    axum::Json(value).into_response()
}

/// The request body as a JSON object; an empty body is an empty object.
pub(super) fn body_object(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad_request("body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!(
            "body is not valid JSON: {e}"
        ))),
    }
}

/// An optional string field; present but not a string is an error.
pub(super) fn opt_string(body: &Map<String, Value>, key: &str) -> Result<Option<String>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad_request(format!("{key} must be a string"))),
    }
}

/// An optional boolean field; present but not a boolean is an error.
pub(super) fn opt_bool(body: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::bad_request(format!("{key} must be a boolean"))),
    }
}

pub(super) fn required_string(body: &Map<String, Value>, key: &str) -> Result<String, ApiError> {
    match body.get(key) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        _ => Err(ApiError::bad_request(format!("{key} is required"))),
    }
}

async fn health(State(skynet): Shared) -> Response {
    ok(json!({ "status": "ok", "memberCount": skynet.member_count() }))
}

async fn create_agent(State(skynet): Shared, body: Bytes) -> ApiResult {
    let body = body_object(&body)?;
    let name = required_string(&body, "name")?;
    let agent_type = required_string(&body, "type")?;
    let role = opt_string(&body, "role")?;
    let persona = opt_string(&body, "persona")?;
    let profile = register(
        &skynet,
        &name,
        Some(&agent_type),
        role.as_deref(),
        persona.as_deref(),
    )
    .await?;
    Ok((StatusCode::CREATED, axum::Json(profile.to_json("offline"))).into_response())
}

async fn create_human(State(skynet): Shared, body: Bytes) -> ApiResult {
    let body = body_object(&body)?;
    let name = required_string(&body, "name")?;
    let profile = register(&skynet, &name, None, None, None).await?;
    Ok((StatusCode::CREATED, axum::Json(profile.to_json("offline"))).into_response())
}

async fn register(
    skynet: &Skynet,
    name: &str,
    agent_type: Option<&str>,
    role: Option<&str>,
    persona: Option<&str>,
) -> Result<Profile, ApiError> {
    skynet
        .registry
        .create(name, agent_type, role, persona)
        .await
        .map_err(|e| match e {
            RegisterError::Taken(taken)
                if taken.holder_protocol == PROTOCOL && taken.holder_bridge.is_none() =>
            {
                ApiError::new(
                    StatusCode::CONFLICT,
                    format!("Name '{name}' is already taken"),
                )
            }
            RegisterError::Taken(taken) => ApiError::new(
                StatusCode::CONFLICT,
                format!(
                    "Name '{name}' is already taken by {} {} '{name}'{}",
                    taken.holder_protocol,
                    taken.holder_role,
                    taken.on_bridge()
                ),
            ),
            RegisterError::Store(e) => {
                tracing::error!(error = %e, "skynet: cannot store a registration");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "cannot store the registration",
                )
            }
            RegisterError::Fleet(e) => fleet_unavailable(&e),
        })
}

/// A change the fleet's records did not take (NATS unreachable, or too contended).
pub(super) fn fleet_unavailable(e: &crate::core::RecordError) -> ApiError {
    tracing::warn!(error = %e, "skynet: the fleet's records did not take a change");
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("Service Unavailable: {e}; try again later"),
    )
}

async fn list_agents(State(skynet): Shared) -> Response {
    let agents: Vec<Value> = skynet
        .registry
        .list(false)
        .iter()
        .map(|p| skynet.profile_card(p))
        .collect();
    ok(Value::Array(agents))
}

async fn list_humans(State(skynet): Shared) -> Response {
    let humans: Vec<Value> = skynet
        .registry
        .list(true)
        .iter()
        .map(|p| p.to_json("offline"))
        .collect();
    ok(Value::Array(humans))
}

async fn get_agent(State(skynet): Shared, Path(id): Path<String>) -> Response {
    match skynet.registry.by_id_or_name(&id, false) {
        Some(profile) => ok(skynet.profile_card(&profile)),
        None => error(StatusCode::NOT_FOUND, "Agent not found"),
    }
}

async fn get_human(State(skynet): Shared, Path(id): Path<String>) -> Response {
    match skynet.registry.by_id_or_name(&id, true) {
        Some(profile) => ok(profile.to_json("offline")),
        None => error(StatusCode::NOT_FOUND, "Human not found"),
    }
}

async fn delete_agent(State(skynet): Shared, Path(id): Path<String>) -> Response {
    delete(&skynet, &id, false).await
}

async fn delete_human(State(skynet): Shared, Path(id): Path<String>) -> Response {
    delete(&skynet, &id, true).await
}

/// Whether a member is connected, as Skynet's server means it: joined (a member in its
/// grace period included), here or, in a fleet, through another bridge (which then holds
/// its name, whatever a member it left here waits out).
fn is_connected(skynet: &Skynet, profile: &Profile) -> bool {
    let joined_here = skynet.workspace.is_member(&profile.id) && skynet.listed_here(&profile.name);
    joined_here || skynet.online_elsewhere(profile).is_some()
}

/// Deletes by UUID only (a name is not found), never while the member is joined.
async fn delete(skynet: &Skynet, id: &str, human: bool) -> Response {
    let (not_found, connected) = if human {
        (
            "Human not found",
            "Human is currently connected. Disconnect first.",
        )
    } else {
        (
            "Agent not found",
            "Agent is currently connected. Disconnect it first.",
        )
    };
    let Some(profile) = skynet.registry.by_id(id).filter(|p| p.is_human() == human) else {
        return error(StatusCode::NOT_FOUND, not_found);
    };
    if is_connected(skynet, &profile) {
        return error(StatusCode::CONFLICT, connected);
    }
    // Its watches go first, and a failure leaves the registration to be deleted again.
    if let Err(e) = records::forget_watches(skynet, &profile.name).await {
        return fleet_unavailable(&e).into_response();
    }
    // Then an agent's schedules, as Skynet's server deletes them: a failure leaves the
    // agent, to be deleted again.
    let mut deleted_schedules = None;
    if !human {
        match skynet
            .schedules
            .delete_for_agent(&profile.id, &profile.name)
            .await
        {
            Ok(count) => deleted_schedules = Some(count),
            Err(ScheduleError::Fleet(e)) => return fleet_unavailable(&e).into_response(),
            Err(e) => {
                tracing::error!(error = %e, "skynet: cannot delete an agent's schedules");
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "cannot delete the agent's schedules",
                );
            }
        }
    }
    match skynet.registry.delete(&profile.id).await {
        Ok(_) => {
            let mut answer = json!({ "deleted": profile.to_json("offline") });
            if let Some(count) = deleted_schedules {
                answer["deletedSchedules"] = json!(count);
            }
            ok(answer)
        }
        Err(RegisterError::Fleet(e)) => fleet_unavailable(&e).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "skynet: cannot delete a registration");
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "cannot delete the registration",
            )
        }
    }
}

async fn check_name(State(skynet): Shared, Query(q): Query<HashMap<String, String>>) -> Response {
    match q.get("name").filter(|n| !n.is_empty()) {
        Some(name) => ok(json!({ "available": skynet.core.directory.check_free(name).is_ok() })),
        None => error(StatusCode::BAD_REQUEST, "name query parameter is required"),
    }
}

async fn members(State(skynet): Shared) -> Response {
    ok(Value::Array(skynet.member_cards()))
}

async fn messages(State(skynet): Shared, Query(q): Query<HashMap<String, String>>) -> ApiResult {
    let number = |key: &str| -> Result<Option<i64>, ApiError> {
        match q.get(key).filter(|v| !v.is_empty()) {
            None => Ok(None),
            Some(v) => v
                .parse::<i64>()
                .map(Some)
                .map_err(|_| ApiError::bad_request(format!("{key} must be an integer"))),
        }
    };
    let (limit, before) = (number("limit")?, number("before")?);
    let query = MessageQuery {
        limit: limit.unwrap_or(100).clamp(0, 10_000) as usize,
        // As Skynet's server does, `before=0` means no bound.
        before: before.filter(|b| *b > 0),
        public_only: true,
        ..Default::default()
    };
    let stored = skynet.core.log.read(query).await.map_err(|e| {
        tracing::error!(error = %e, "skynet: cannot read history");
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "cannot read messages")
    })?;
    let messages: Vec<Box<RawValue>> = stored
        .iter()
        .filter_map(|m| skynet.encode_raw(&m.envelope))
        .collect();
    Ok(axum::Json(messages).into_response())
}

async fn interrupt(State(skynet): Shared, Path(id): Path<String>, body: Bytes) -> Response {
    control(&skynet, &id, &body, Kind::ControlInterrupt).await
}

async fn forget(State(skynet): Shared, Path(id): Path<String>, body: Bytes) -> Response {
    control(&skynet, &id, &body, Kind::ControlForget).await
}

async fn watch(State(skynet): Shared, Path(id): Path<String>, body: Bytes) -> Response {
    control(&skynet, &id, &body, Kind::ControlWatch).await
}

async fn unwatch(State(skynet): Shared, Path(id): Path<String>, body: Bytes) -> Response {
    control(&skynet, &id, &body, Kind::ControlUnwatch).await
}

/// Sends an `agent.interrupt | forget | watch | unwatch` to the agent only, unstored.
async fn control(skynet: &Skynet, id: &str, body: &Bytes, kind: Kind) -> Response {
    let Some(agent) = skynet.registry.by_id_or_name(id, false) else {
        return error(StatusCode::NOT_FOUND, "Agent not found");
    };
    if !is_connected(skynet, &agent) {
        return error(StatusCode::CONFLICT, "Agent is not connected");
    }
    let body = match body_object(body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let mut payload = Map::new();
    payload.insert("agentId".into(), json!(agent.id));
    let msg_type = match kind {
        Kind::ControlWatch | Kind::ControlUnwatch => {
            let Some(human_id) = body
                .get("humanId")
                .and_then(Value::as_str)
                .filter(|h| !h.is_empty())
            else {
                return error(StatusCode::BAD_REQUEST, "humanId is required");
            };
            payload.insert("humanId".into(), json!(human_id));
            if let Some(human) = skynet.registry.by_id_or_name(human_id, true) {
                let on = kind == Kind::ControlWatch;
                let watched = records::watch(skynet, &human.name, &agent.name, on).await;
                if let Err(e) = watched {
                    return fleet_unavailable(&e).into_response();
                }
            }
            if kind == Kind::ControlWatch {
                "agent.watch"
            } else {
                "agent.unwatch"
            }
        }
        Kind::ControlForget => "agent.forget",
        _ => {
            if let Some(reason) = body.get("reason").filter(|r| !r.is_null()) {
                payload.insert("reason".into(), reason.clone());
            }
            "agent.interrupt"
        }
    };
    let native = json!({
        "id": new_message_id(),
        "type": msg_type,
        "from": agent.id,
        "timestamp": now_ms(),
        "payload": payload,
        "mentions": [agent.id],
    });
    let mut env = Envelope::new(PROTOCOL, &agent.name, kind);
    env.id = native["id"].as_str().unwrap_or_default().to_owned();
    env.to = vec![agent.name.clone()];
    env.audience = Audience::Private;
    env.text = body
        .get("reason")
        .and_then(Value::as_str)
        .map(str::to_owned);
    env.data = Some(Value::Object(payload));
    env.origin = Origin::new(PROTOCOL, Some(native));
    skynet.core.publish_transient(env).await;
    ok(json!({ "ok": true, "agentId": agent.id }))
}

/// An oversized or over-budget message is refused unread with an `error` event, and the
/// socket stays open (Skynet's server, Node `ws`, would close it above 100 MiB).
async fn upgrade(State(skynet): Shared, upgrade: crate::shared::websocket::Upgrade) -> Response {
    upgrade
        .max_message_size(skynet.config.max_frame_bytes)
        .read_budget(skynet.read_budget.clone())
        .on_upgrade(move |socket| ws::serve(socket, skynet))
}
