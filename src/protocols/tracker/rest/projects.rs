//! `GET /projects`, `GET /projects/{slug}`.

use axum::extract::{Path, State};
use axum::response::Response;

use super::{ApiError, ApiResult, Caller, Shared, ok};
use crate::protocols::tracker::db::ProjectRow;
use crate::protocols::tracker::wire::ProjectOut;
use crate::shared::clock::iso8601;

pub fn project_out(p: &ProjectRow) -> ProjectOut {
    ProjectOut {
        id: p.id.clone(),
        slug: p.slug.clone(),
        name: p.name.clone(),
        description: p.description.clone(),
        chat_id: p.chat_id.clone(),
        created_at: iso8601(p.created_at),
    }
}

pub async fn list(State(tracker): Shared, _caller: Caller) -> Response {
    let projects: Vec<ProjectOut> = tracker
        .chats
        .projects
        .load()
        .iter()
        .map(project_out)
        .collect();
    ok(projects)
}

pub async fn get(
    State(tracker): Shared,
    _caller: Caller,
    Path(slug): Path<String>,
) -> ApiResult<Response> {
    tracker
        .chats
        .projects
        .load()
        .iter()
        .find(|p| p.slug == slug)
        .map(|p| ok(project_out(p)))
        .ok_or_else(|| ApiError::not_found("Project not found"))
}
