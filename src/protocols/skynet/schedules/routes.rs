//! The scheduler's HTTP API (`/api/schedules`), with the status codes and `{error}`
//! bodies of Skynet's other routes.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{Changes, Schedule, ScheduleError, parse_cron};
use crate::core::{Role, now_ms};
use crate::protocols::skynet::Skynet;
use crate::protocols::skynet::http::{
    ApiError, ApiResult, body_object, fleet_unavailable, opt_bool, opt_string,
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
            "Invalid cron expression: {e}"
        ))),
    }
}

/// The most bytes a task template may take as JSON: every schedule's is held in memory,
/// and sent on each tick.
const TEMPLATE_BYTES: usize = 64 * 1024;

/// `taskTemplate` (`{title, description, files?, metadata?}`), an object of at most
/// `TEMPLATE_BYTES`; its fields are the agent's to read, as Skynet's server leaves them.
fn task_template(template: &Value) -> Result<Value, ApiError> {
    if !template.is_object() {
        return Err(ApiError::bad_request(
            "taskTemplate must be an object: {title, description, files?, metadata?}",
        ));
    }
    let bytes = serde_json::to_vec(template).map_or(usize::MAX, |t| t.len());
    if bytes > TEMPLATE_BYTES {
        return Err(ApiError::bad_request(format!(
            "taskTemplate is {bytes} bytes of JSON; the limit is {TEMPLATE_BYTES}"
        )));
    }
    Ok(template.clone())
}

/// Whether `agent_id` names an agent: a registered Skynet agent by id or name, as
/// Skynet's server looks it up, or another protocol's agent by the card id Skynet
/// clients see it under (not a human).
fn is_agent(skynet: &Skynet, agent_id: &str) -> bool {
    if skynet.registry.by_id_or_name(agent_id, false).is_some() {
        return true;
    }
    let Some(name) = skynet.name_of(agent_id) else {
        return false;
    };
    (skynet.core.directory.get(&name))
        .is_some_and(|a| a.protocol != super::super::PROTOCOL && a.role != Role::Human)
}

fn agent_not_found(agent_id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("Agent '{agent_id}' not found"),
    )
}

pub async fn create(State(skynet): Shared, body: Bytes) -> ApiResult {
    let body = body_object(&body)?;
    let text = |key: &str| (body.get(key).and_then(Value::as_str)).filter(|s| !s.is_empty());
    let (Some(name), Some(cron), Some(agent_id), Some(template)) = (
        text("name"),
        text("cronExpr"),
        text("agentId"),
        body.get("taskTemplate").filter(|t| !t.is_null()),
    ) else {
        return Err(ApiError::bad_request(
            "name, cronExpr, agentId, and taskTemplate are required",
        ));
    };
    if !is_agent(&skynet, agent_id) {
        return Err(agent_not_found(agent_id));
    }
    let cron = cron_expr(cron.to_owned())?;
    let task_template = task_template(template)?;
    let created_by = opt_string(&body, "createdBy")?;
    let enabled = opt_bool(&body, "enabled")?.unwrap_or(true);
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
        name: name.to_owned(),
        cron_expr: cron,
        agent_id: agent_id.to_owned(),
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
        agent_id: match non_empty("agentId")? {
            Some(agent_id) if !is_agent(&skynet, &agent_id) => {
                return Err(agent_not_found(&agent_id));
            }
            agent_id => agent_id,
        },
        task_template: match body.get("taskTemplate") {
            None | Some(Value::Null) => None,
            Some(template) => Some(task_template(template)?),
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
