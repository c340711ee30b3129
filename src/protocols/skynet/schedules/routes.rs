//! The scheduler's HTTP API (`/api/schedules`), with the status codes and `{error}`
//! bodies of Skynet's other routes.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::{Changes, Schedule, ScheduleError, parse_cron};
use crate::core::now_ms;
use crate::protocols::skynet::Skynet;
use crate::protocols::skynet::http::{
    ApiError, ApiResult, body_object, fleet_unavailable, opt_bool, opt_string, required_string,
};
use crate::protocols::skynet::translate::Peers;

type Shared = State<Arc<Skynet>>;

fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "Schedule not found")
}

fn failed(e: ScheduleError) -> ApiError {
    match e {
        ScheduleError::NotFound => not_found(),
        ScheduleError::Fleet(e) => fleet_unavailable(&e),
        ScheduleError::Store(e) => {
            tracing::error!(error = %e, "skynet: cannot store a schedule");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "cannot store the schedule",
            )
        }
    }
}

/// `cronExpr`, checked as the scheduler will read it.
fn cron_expr(value: String) -> Result<String, ApiError> {
    match parse_cron(&value) {
        Ok(_) => Ok(value),
        Err(e) => Err(ApiError::bad_request(format!(
            "Invalid cron expression '{value}': {e}"
        ))),
    }
}

/// The most bytes a task template may take as JSON: every schedule's is held in memory,
/// and sent on each tick.
const TEMPLATE_BYTES: usize = 64 * 1024;

/// `taskTemplate`: an object with a `title` and a `description`.
fn task_template(body: &Map<String, Value>) -> Result<Value, ApiError> {
    let Some(Value::Object(template)) = body.get("taskTemplate") else {
        return Err(ApiError::bad_request(
            "taskTemplate is required: {title, description, files?, metadata?}",
        ));
    };
    let bytes = serde_json::to_vec(template).map_or(usize::MAX, |t| t.len());
    if bytes > TEMPLATE_BYTES {
        return Err(ApiError::bad_request(format!(
            "taskTemplate is {bytes} bytes of JSON; the limit is {TEMPLATE_BYTES}"
        )));
    }
    let text = |key: &str| template.get(key).is_some_and(Value::is_string);
    if !text("title") || !text("description") {
        return Err(ApiError::bad_request(
            "taskTemplate.title and taskTemplate.description are required",
        ));
    }
    if template
        .get("files")
        .is_some_and(|f| !f.is_array() && !f.is_null())
    {
        return Err(ApiError::bad_request("taskTemplate.files must be an array"));
    }
    Ok(Value::Object(template.clone()))
}

/// The agent `agentId` names (by id or name), as the card id its tasks mention.
fn target(skynet: &Skynet, agent_id: &str) -> Result<String, ApiError> {
    if let Some(profile) = skynet.registry.by_id_or_name(agent_id, false) {
        return Ok(profile.id);
    }
    // An agent of another protocol, by the card id Skynet clients see it under.
    if skynet.name_of(agent_id).is_some() {
        return Ok(agent_id.to_owned());
    }
    Err(ApiError::new(StatusCode::NOT_FOUND, "Agent not found"))
}

pub async fn create(State(skynet): Shared, body: Bytes) -> ApiResult {
    let body = body_object(&body)?;
    let name = required_string(&body, "name")?;
    let cron = cron_expr(required_string(&body, "cronExpr")?)?;
    let agent_id = required_string(&body, "agentId")?;
    let task_template = task_template(&body)?;
    let created_by = opt_string(&body, "createdBy")?;
    let enabled = opt_bool(&body, "enabled")?.unwrap_or(true);
    let agent_id = target(&skynet, &agent_id)?;
    let limit = skynet.config.max_schedules;
    if skynet.schedules.count() >= limit {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("Too many schedules: the limit is {limit}; delete one first"),
        ));
    }
    let now = now_ms();
    let schedule = Schedule {
        id: uuid::Uuid::new_v4().to_string(),
        name,
        cron_expr: cron,
        agent_id,
        task_template,
        enabled,
        created_by,
        created_at: now,
        updated_at: now,
    };
    let info = skynet.schedules.create(schedule).await.map_err(failed)?;
    Ok((StatusCode::CREATED, axum::Json(info)).into_response())
}

pub async fn list(State(skynet): Shared, Query(q): Query<HashMap<String, String>>) -> Response {
    let agent_id = q.get("agentId").filter(|a| !a.is_empty());
    axum::Json(skynet.schedules.list(agent_id.map(String::as_str))).into_response()
}

pub async fn get(State(skynet): Shared, Path(id): Path<String>) -> ApiResult {
    let info = skynet.schedules.info(&id).ok_or_else(not_found)?;
    Ok(axum::Json(info).into_response())
}

pub async fn update(State(skynet): Shared, Path(id): Path<String>, body: Bytes) -> ApiResult {
    if skynet.schedules.info(&id).is_none() {
        return Err(not_found());
    }
    let body = body_object(&body)?;
    let non_empty = |key: &str| match opt_string(&body, key)? {
        Some(s) if s.is_empty() => Err(ApiError::bad_request(format!("{key} must not be empty"))),
        other => Ok(other),
    };
    let changes = Changes {
        name: non_empty("name")?,
        cron_expr: non_empty("cronExpr")?.map(cron_expr).transpose()?,
        agent_id: (non_empty("agentId")?)
            .map(|a| target(&skynet, &a))
            .transpose()?,
        task_template: match body.get("taskTemplate") {
            None | Some(Value::Null) => None,
            Some(_) => Some(task_template(&body)?),
        },
        enabled: opt_bool(&body, "enabled")?,
    };
    let info = skynet
        .schedules
        .update(&id, &changes)
        .await
        .map_err(failed)?;
    Ok(axum::Json(info).into_response())
}

pub async fn delete(State(skynet): Shared, Path(id): Path<String>) -> ApiResult {
    skynet.schedules.delete(&id).await.map_err(failed)?;
    Ok(axum::Json(json!({ "deleted": true })).into_response())
}
