//! `/tasks/{id}/steps`: a task's checklist.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::{ApiError, ApiResult, Body, Caller, Shared, created, existing_task, ok};
use crate::protocols::tracker::db::StepRow;
use crate::protocols::tracker::steps::StepEdit;
use crate::protocols::tracker::wire::StepOut;
use crate::shared::clock::iso8601;

fn step_out(s: &StepRow) -> StepOut {
    StepOut {
        id: s.id.clone(),
        task_id: s.task_id.clone(),
        title: s.title.clone(),
        done: s.done,
        position: s.position,
        created_at: iso8601(s.created_at),
    }
}

pub async fn list(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    existing_task(&tracker, &id).await?;
    let steps = tracker.db.steps(&id).await?;
    Ok(ok(steps.iter().map(step_out).collect::<Vec<_>>()))
}

pub async fn create(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    existing_task(&tracker, &id).await?;
    let title = Body::parse(&body)?.required("title")?;
    match tracker.change_steps(&id, StepEdit::Add { title }).await? {
        Some(step) => Ok(created(step_out(&step))),
        None => Err(ApiError::not_found("Step not found")),
    }
}

pub async fn update(
    State(tracker): Shared,
    _caller: Caller,
    Path((id, step)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<Response> {
    let body = Body::parse(&body)?;
    let title = match body.has("title") {
        true => Some(body.required("title")?),
        false => None,
    };
    let done = body.boolean("done")?;
    let edit = StepEdit::Update {
        id: step,
        title,
        done,
    };
    match tracker.change_steps(&id, edit).await? {
        Some(step) => Ok(ok(step_out(&step))),
        None => Err(ApiError::not_found("Step not found")),
    }
}

pub async fn delete(
    State(tracker): Shared,
    _caller: Caller,
    Path((id, step)): Path<(String, String)>,
) -> ApiResult<Response> {
    match tracker
        .change_steps(&id, StepEdit::Remove { id: step })
        .await?
    {
        Some(_) => Ok(StatusCode::NO_CONTENT.into_response()),
        None => Err(ApiError::not_found("Step not found")),
    }
}
