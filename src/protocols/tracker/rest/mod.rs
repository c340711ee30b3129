//! The Tracker's REST API under `/api/v1`, one file per resource. Every call needs
//! `Authorization: Bearer <member token>`. Errors follow the FastAPI conventions Tracker
//! clients expect: `{"detail": "…"}`, and 422 `{"detail": [{"type", "loc", "msg"}]}` naming
//! the offending field.

mod attachments;
mod members;
mod messages;
mod projects;
mod steps;
mod tasks;

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, patch, post};
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::db::{MemberRow, TaskRow};
use super::tasks::WriteError;
use super::wire::MessageOut;
use super::{Tracker, ws};
use crate::shared::{http_refusals, to_the_end};
use crate::store::StoreError;

type Shared = State<Arc<Tracker>>;

pub fn router(tracker: Arc<Tracker>) -> Router {
    // Whole paths rather than `nest("/api/v1", …)`, which strips the prefix from every
    // request's URI (a new URI each) and wraps every route in two more services.
    let app = Router::new()
        .route("/api/v1/projects", get(projects::list))
        .route("/api/v1/projects/{slug}", get(projects::get))
        .route("/api/v1/tasks", get(tasks::list).post(tasks::create))
        .route(
            "/api/v1/tasks/{id}",
            get(tasks::get).patch(tasks::update).delete(tasks::delete),
        )
        .route("/api/v1/tasks/{id}/take", post(tasks::take))
        .route("/api/v1/tasks/{id}/reject", post(tasks::reject))
        .route("/api/v1/tasks/{id}/assign", post(tasks::assign))
        .route(
            "/api/v1/tasks/{id}/watch",
            post(tasks::watch).delete(tasks::unwatch),
        )
        .route(
            "/api/v1/tasks/{id}/steps",
            get(steps::list).post(steps::create),
        )
        .route(
            "/api/v1/tasks/{id}/steps/{step}",
            patch(steps::update).delete(steps::delete),
        )
        .route(
            "/api/v1/messages",
            get(messages::list).post(messages::create),
        )
        .route("/api/v1/messages/{id}/replies", get(messages::replies))
        .route(
            "/api/v1/messages/{id}/attachments",
            post(attachments::upload).layer(axum::extract::DefaultBodyLimit::max(
                attachments::MAX_UPLOAD_BODY,
            )),
        )
        .route("/api/v1/attachments", get(attachments::list))
        .route("/api/v1/attachments/{id}", get(attachments::download))
        // Above: a write is made to its end even if its client goes (else a task could be
        // changed and its messages never sent). A member's creation runs to its end only
        // once its name is claimed (`members::create`): a client gone mid-claim would never
        // get the member's token, so no member is made for it.
        .route_layer(to_the_end::WritesToTheEnd(tracker.core.to_the_end.clone()))
        .route("/api/v1/members", get(members::list).post(members::create))
        .route("/api/v1/members/{slug}", get(members::get))
        .route("/ws", get(upgrade))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "Not Found") });
    let body_limit = axum::extract::DefaultBodyLimit::max(tracker.config.max_body_bytes);
    let read_budget = tracker.read_budget.clone();
    let app = app.with_state(tracker).layer(body_limit);
    http_refusals::shaped(app, super::PROTOCOL, &read_budget, |status, text, _| {
        (status, axum::Json(json!({ "detail": text }))).into_response()
    })
}

async fn upgrade(State(tracker): Shared, upgrade: crate::shared::websocket::Upgrade) -> Response {
    upgrade
        .max_message_size(tracker.config.max_frame_bytes)
        .read_budget(tracker.read_budget.clone())
        .on_upgrade(move |socket| ws::serve(socket, tracker))
}

/// An error response: `{"detail": "…"}`, or for a field, 422 with FastAPI's list form.
#[derive(Debug)]
pub enum ApiError {
    Detail(StatusCode, String),
    Field {
        loc: Vec<String>,
        kind: &'static str,
        msg: String,
    },
}

impl ApiError {
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        ApiError::Detail(status, detail.into())
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, detail)
    }

    pub fn conflict(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, detail)
    }

    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, detail)
    }

    /// A 422 naming `loc` (e.g. `["body", "title"]`).
    pub fn field(loc: &[&str], kind: &'static str, msg: impl Into<String>) -> Self {
        ApiError::Field {
            loc: loc.iter().map(|s| s.to_string()).collect(),
            kind,
            msg: msg.into(),
        }
    }

    pub fn store(e: StoreError) -> Self {
        tracing::error!(error = %e, "tracker: store error");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error")
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        ApiError::store(e)
    }
}

impl From<WriteError> for ApiError {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::Store(e) => ApiError::store(e),
            // A bridge of a fleet that cannot reach the fleet's record: the change is not
            // made, and the client may try again.
            WriteError::Fleet(e) => {
                tracing::warn!(error = %e, "tracker: a change is refused");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("Service Unavailable: {e}"),
                )
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // A body or query the API cannot take is malformed input, as a bad frame is.
        if matches!(self, ApiError::Field { .. })
            || matches!(self, ApiError::Detail(StatusCode::BAD_REQUEST, _))
        {
            crate::telemetry::decode_error(super::PROTOCOL);
        }
        match self {
            ApiError::Detail(status, detail) => {
                let mut response =
                    (status, axum::Json(json!({ "detail": detail }))).into_response();
                if status == StatusCode::UNAUTHORIZED {
                    response.headers_mut().insert(
                        header::WWW_AUTHENTICATE,
                        header::HeaderValue::from_static("Bearer"),
                    );
                }
                response
            }
            ApiError::Field { loc, kind, msg } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                axum::Json(json!({ "detail": [{ "type": kind, "loc": loc, "msg": msg }] })),
            )
                .into_response(),
        }
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// The task `id`, or the API's 404.
pub async fn existing_task(tracker: &Tracker, id: &str) -> ApiResult<TaskRow> {
    tracker
        .db
        .task(id)
        .await?
        .ok_or_else(|| ApiError::not_found("Task not found"))
}

pub fn created(value: impl Serialize) -> Response {
    (StatusCode::CREATED, axum::Json(value)).into_response()
}

/// A posted message's 201, written by `MessageOut::write_json` rather than serde: half the
/// instructions, on every message posted over REST.
pub fn created_message(message: &MessageOut) -> Response {
    let mut body = Vec::with_capacity(384);
    if message.write_json(&mut body).is_err() {
        return created(message);
    }
    let json = [(header::CONTENT_TYPE, "application/json")];
    (StatusCode::CREATED, json, body).into_response()
}

pub fn ok(value: impl Serialize) -> Response {
    axum::Json(value).into_response()
}

/// The member a request's bearer token belongs to.
pub struct Caller(pub Arc<MemberRow>);

impl FromRequestParts<Arc<Tracker>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        tracker: &Arc<Tracker>,
    ) -> Result<Self, Self::Rejection> {
        let header = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|h| h.to_str().ok())
            .ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "Not authenticated"))?;
        let token = crate::shared::text::bearer_token(header)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "Authorization must be 'Bearer <token>'",
                )
            })?;
        tracker
            .members
            .by_token(token)
            .map(Caller)
            .ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "Invalid token"))
    }
}

impl Caller {
    /// Refuses acting as another member (`slug` other than the caller's own).
    pub fn must_be(&self, slug: &str, field: &str) -> ApiResult<()> {
        if slug == self.0.slug {
            Ok(())
        } else {
            Err(ApiError::forbidden(format!(
                "{field} '{slug}' is not the token's member '{}'",
                self.0.slug
            )))
        }
    }
}

/// A JSON object request body; `body` locates errors in it.
pub struct Body(pub Map<String, Value>);

impl Body {
    pub fn parse(bytes: &Bytes) -> ApiResult<Body> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ApiError::field(&["body"], "missing", "Field required"));
        }
        match serde_json::from_slice::<Value>(bytes) {
            Ok(Value::Object(map)) => Ok(Body(map)),
            Ok(_) => Err(ApiError::field(
                &["body"],
                "dict_type",
                "Input should be a valid dictionary",
            )),
            Err(e) => Err(ApiError::field(
                &["body"],
                "json_invalid",
                format!("JSON decode error: {e}"),
            )),
        }
    }

    pub fn has(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    pub fn string(&self, key: &str) -> ApiResult<Option<String>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::field(
                &["body", key],
                "string_type",
                "Input should be a valid string",
            )),
        }
    }

    pub fn required(&self, key: &str) -> ApiResult<String> {
        match self.string(key)? {
            Some(s) if !s.trim().is_empty() => Ok(s),
            Some(_) => Err(ApiError::field(
                &["body", key],
                "string_too_short",
                "String should have at least 1 character",
            )),
            None => Err(ApiError::field(&["body", key], "missing", "Field required")),
        }
    }

    pub fn boolean(&self, key: &str) -> ApiResult<Option<bool>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(ApiError::field(
                &["body", key],
                "bool_type",
                "Input should be a valid boolean",
            )),
        }
    }

    pub fn strings(&self, key: &str) -> ApiResult<Option<Vec<String>>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(list)) if list.iter().all(Value::is_string) => Ok(Some(
                list.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect(),
            )),
            Some(_) => Err(ApiError::field(
                &["body", key],
                "list_type",
                "Input should be a valid list of strings",
            )),
        }
    }

    /// One of a closed set of values (`parse`), naming the allowed ones when it is not.
    pub fn choice<T>(
        &self,
        key: &str,
        parse: fn(&str) -> Option<T>,
        allowed: &[&str],
    ) -> ApiResult<Option<T>> {
        match self.string(key)? {
            None => Ok(None),
            Some(s) => one_of(key, &s, parse, allowed).map(Some),
        }
    }
}

/// Field `key`'s `value` as one of `allowed`, else FastAPI's "Input should be …" error.
pub fn one_of<T>(
    key: &str,
    value: &str,
    parse: fn(&str) -> Option<T>,
    allowed: &[&str],
) -> ApiResult<T> {
    parse(value).ok_or_else(|| not_one_of(&["body", key], allowed))
}

/// The FastAPI-style "Input should be 'a', 'b' or 'c'" error.
pub fn not_one_of(loc: &[&str], allowed: &[&str]) -> ApiError {
    let quoted: Vec<String> = allowed.iter().map(|a| format!("'{a}'")).collect();
    let list = match quoted.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => quoted.join(""),
    };
    ApiError::field(loc, "enum", format!("Input should be {list}"))
}

/// Query parameters.
pub type Query = axum::extract::Query<HashMap<String, String>>;

/// A query parameter that must be given.
pub fn required_query(query: &HashMap<String, String>, key: &str) -> ApiResult<String> {
    query
        .get(key)
        .filter(|v| !v.is_empty())
        .cloned()
        .ok_or_else(|| ApiError::field(&["query", key], "missing", "Field required"))
}
