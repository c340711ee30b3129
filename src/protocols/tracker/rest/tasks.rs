//! `/tasks`: list, create, get, update, delete, and the actions take / reject / assign /
//! watch. Every change goes through `Tracker::change_task`, which emits the task events and
//! tells agents of other protocols.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::{
    ApiError, ApiResult, Body, Caller, Query, Shared, created, existing_task, not_one_of, ok,
    required_query,
};
use crate::protocols::tracker::Tracker;
use crate::protocols::tracker::chat::NewMessage;
use crate::protocols::tracker::db::{MemberRow, TaskFilter, TaskRow};
use crate::protocols::tracker::tasks::Refused;
use crate::protocols::tracker::translate::task_out;
use crate::protocols::tracker::wire::{AuthorType, MemberKind, Priority, TaskStatus, TaskType};

fn refused(refusal: Refused) -> ApiError {
    match refusal {
        Refused::Missing => ApiError::not_found("Task not found"),
        Refused::Conflict(reason) => ApiError::conflict(reason),
    }
}

/// A Tracker member named by `slug`. As in the Tracker, any token may act for any member
/// here (take, watch, reject); only authorship is tied to the token.
fn member(tracker: &Tracker, slug: &str) -> ApiResult<Arc<MemberRow>> {
    tracker
        .members
        .get(slug)
        .ok_or_else(|| ApiError::not_found(format!("Member '{slug}' not found")))
}

/// A slug that must name an agent the bridge knows (of any protocol).
fn known_agent(tracker: &Tracker, body: &Body, key: &str) -> ApiResult<Option<String>> {
    match body.string(key)? {
        None => Ok(None),
        Some(slug) if tracker.core.directory.contains(&slug) => Ok(Some(slug)),
        Some(slug) => Err(ApiError::field(
            &["body", key],
            "value_error",
            format!("Unknown member '{slug}'"),
        )),
    }
}

pub async fn list(State(tracker): Shared, _caller: Caller, query: Query) -> ApiResult<Response> {
    let status = match query.get("status") {
        None => None,
        Some(s) => Some(
            TaskStatus::parse(s)
                .ok_or_else(|| not_one_of(&["query", "status"], TaskStatus::ALL))?,
        ),
    };
    let mut project_id = query.get("project_id").cloned();
    if let Some(slug) = query.get("project_slug") {
        let id = tracker
            .chats
            .projects
            .load()
            .iter()
            .find(|p| &p.slug == slug)
            .map(|p| p.id.clone());
        project_id = Some(id.ok_or_else(|| ApiError::not_found("Project not found"))?);
    }
    let tasks = tracker
        .db
        .tasks(TaskFilter {
            project_id,
            status,
            assignee: query.get("assignee").cloned(),
        })
        .await?;
    Ok(ok(tasks.iter().map(task_out).collect::<Vec<_>>()))
}

pub async fn get(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let task = existing_task(&tracker, &id).await?;
    Ok(ok(task_out(&task)))
}

pub async fn create(
    State(tracker): Shared,
    caller: Caller,
    query: Query,
    body: Bytes,
) -> ApiResult<Response> {
    let slug = required_query(&query, "project_slug")?;
    let project = tracker
        .chats
        .projects
        .load()
        .iter()
        .find(|p| p.slug == slug)
        .cloned()
        .ok_or_else(|| ApiError::not_found("Project not found"))?;
    let body = Body::parse(&body)?;
    if let Some(author) = body.string("author_slug")? {
        caller.must_be(&author, "author_slug")?;
    }
    let now = crate::core::now_ms();
    let task = TaskRow {
        id: uuid::Uuid::new_v4().to_string(),
        project_id: project.id.clone(),
        project_slug: project.slug.clone(),
        title: body.required("title")?,
        description: body.string("description")?.unwrap_or_default(),
        status: body
            .choice("status", TaskStatus::parse, TaskStatus::ALL)?
            .unwrap_or_default(),
        task_type: body
            .choice("type", TaskType::parse, TaskType::ALL)?
            .unwrap_or_default(),
        priority: body
            .choice("priority", Priority::parse, Priority::ALL)?
            .unwrap_or_default(),
        assignee_slug: known_agent(&tracker, &body, "assignee_slug")?,
        reviewer_slug: known_agent(&tracker, &body, "reviewer_slug")?,
        author_slug: caller.0.slug.clone(),
        watchers: Vec::new(),
        external_id: None,
        requester: None,
        request_message_id: None,
        delegation_message_id: None,
        created_at: now,
        updated_at: now,
    };
    let task = tracker.create_task(task).await?;
    Ok(created(task_out(&task)))
}

pub async fn update(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let body = Body::parse(&body)?;
    let title = match body.has("title") {
        true => Some(body.required("title")?),
        false => None,
    };
    let description = body.string("description")?;
    let status = body.choice("status", TaskStatus::parse, TaskStatus::ALL)?;
    let task_type = body.choice("type", TaskType::parse, TaskType::ALL)?;
    let priority = body.choice("priority", Priority::parse, Priority::ALL)?;
    // Present and null unassigns; absent leaves as is.
    let assignee = body
        .has("assignee_slug")
        .then(|| known_agent(&tracker, &body, "assignee_slug"))
        .transpose()?;
    let reviewer = body
        .has("reviewer_slug")
        .then(|| known_agent(&tracker, &body, "reviewer_slug"))
        .transpose()?;
    let changed = tracker
        .change_task(&id, None, None, move |task| {
            if let Some(title) = &title {
                task.title.clone_from(title);
            }
            if let Some(description) = &description {
                task.description.clone_from(description);
            }
            if let Some(status) = status {
                task.status = status;
            }
            if let Some(task_type) = task_type {
                task.task_type = task_type;
            }
            if let Some(priority) = priority {
                task.priority = priority;
            }
            if let Some(assignee) = &assignee {
                task.assignee_slug.clone_from(assignee);
            }
            if let Some(reviewer) = &reviewer {
                task.reviewer_slug.clone_from(reviewer);
            }
            Ok(())
        })
        .await?
        .map_err(refused)?;
    Ok(ok(task_out(&changed)))
}

pub async fn delete(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    match tracker.delete_task(&id).await? {
        Some(_) => Ok(StatusCode::NO_CONTENT.into_response()),
        None => Err(ApiError::not_found("Task not found")),
    }
}

/// Takes the task for `slug`, atomically: 409 when someone else holds it.
pub async fn take(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
    query: Query,
) -> ApiResult<Response> {
    let slug = required_query(&query, "slug")?;
    member(&tracker, &slug)?;
    let changed = tracker
        .change_task(&id, None, None, move |task| {
            match &task.assignee_slug {
                Some(holder) if *holder != slug => {
                    return Err(format!("Task is already taken by '{holder}'"));
                }
                _ => {}
            }
            task.assignee_slug = Some(slug.clone());
            Ok(())
        })
        .await?
        .map_err(refused)?;
    Ok(ok(task_out(&changed)))
}

/// The assignee declines the task: it is unassigned, back in the backlog, with the reason
/// as a comment (and, for a task from another protocol, as the requester's answer).
pub async fn reject(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let body = Body::parse(&body)?;
    let slug = body.required("slug")?;
    let rejecter = member(&tracker, &slug)?;
    let reason = body.string("reason")?.filter(|r| !r.is_empty());
    let note = reason.clone().unwrap_or_else(|| "rejected".into());
    let who = slug.clone();
    let changed = tracker
        .change_task(&id, Some(note.clone()), None, move |task| {
            if task.assignee_slug.as_deref() != Some(&who) {
                return Err(format!("Task is not assigned to '{who}'"));
            }
            task.assignee_slug = None;
            task.status = TaskStatus::Backlog;
            Ok(())
        })
        .await?
        .map_err(refused)?;
    let comment = NewMessage {
        author_slug: slug.clone(),
        author_type: match rejecter.kind {
            MemberKind::Agent => AuthorType::Agent,
            MemberKind::Human => AuthorType::Human,
        },
        chat_id: None,
        task_id: Some(changed.id.clone()),
        content: format!("Rejected by {slug}: {note}"),
        mentions: Vec::new(),
        reply_to: None,
    };
    if let Err(e) = tracker.post_comment_quietly(comment).await {
        tracing::error!(error = ?e, "tracker: cannot record a rejection");
    }
    Ok(ok(task_out(&changed)))
}

pub async fn assign(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let body = Body::parse(&body)?;
    body.required("assignee_slug")?;
    let assignee = known_agent(&tracker, &body, "assignee_slug")?;
    let changed = tracker
        .change_task(&id, None, None, move |task| {
            task.assignee_slug.clone_from(&assignee);
            Ok(())
        })
        .await?
        .map_err(refused)?;
    Ok(ok(task_out(&changed)))
}

pub async fn watch(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
    query: Query,
) -> ApiResult<Response> {
    set_watch(&tracker, &id, &query, true).await
}

pub async fn unwatch(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
    query: Query,
) -> ApiResult<Response> {
    set_watch(&tracker, &id, &query, false).await
}

async fn set_watch(tracker: &Tracker, id: &str, query: &Query, on: bool) -> ApiResult<Response> {
    let slug = required_query(query, "slug")?;
    member(tracker, &slug)?;
    let changed = tracker
        .change_task(id, None, None, move |task| {
            task.watchers.retain(|w| *w != slug);
            if on {
                task.watchers.push(slug.clone());
            }
            Ok(())
        })
        .await?
        .map_err(refused)?;
    Ok(ok(task_out(&changed)))
}
