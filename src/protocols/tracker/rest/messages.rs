//! `/messages`: a chat's messages or a task's comments, posting, and a message's replies.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;

use super::{ApiError, ApiResult, Body, Caller, Query, Shared, created_message, ok};
use crate::protocols::tracker::chat::{NewMessage, PostError};
use crate::protocols::tracker::wire::{AuthorType, MemberKind};

/// Most messages one listing returns.
const MAX_LIMIT: usize = 1000;

fn post_error(e: PostError) -> ApiError {
    match e {
        PostError::NotFound(what) => ApiError::not_found(what),
        PostError::UnknownMention(name) => ApiError::field(
            &["body", "mentions"],
            "value_error",
            format!(
                "Unknown member '{}': no agent of any protocol has that name",
                crate::shared::text::a_few(&[name])
            ),
        ),
        PostError::TooManyMentions(count, limit) => ApiError::field(
            &["body", "mentions"],
            "too_long",
            format!("Too many mentions: {count}; the limit is {limit}"),
        ),
        PostError::Store(e) => ApiError::store(e),
        PostError::Refused(reason) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, reason),
    }
}

pub async fn list(State(tracker): Shared, _caller: Caller, query: Query) -> ApiResult<Response> {
    let chat_id = query.get("chat_id").filter(|c| !c.is_empty());
    let task_id = query.get("task_id").filter(|t| !t.is_empty());
    if chat_id.is_none() && task_id.is_none() {
        return Err(ApiError::field(
            &["query", "chat_id"],
            "missing",
            "chat_id or task_id is required",
        ));
    }
    let limit = match query.get("limit") {
        None => 50,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=MAX_LIMIT).contains(l))
            .ok_or_else(|| {
                ApiError::field(
                    &["query", "limit"],
                    "int_parsing",
                    format!("limit must be an integer from 1 to {MAX_LIMIT}"),
                )
            })?,
    };
    let messages = tracker
        .list_messages(
            chat_id.map(String::as_str),
            task_id.map(String::as_str),
            limit,
        )
        .await
        .map_err(post_error)?;
    Ok(ok(messages))
}

pub async fn create(State(tracker): Shared, caller: Caller, body: Bytes) -> ApiResult<Response> {
    let body = Body::parse(&body)?;
    let author_slug = match body.string("author_slug")? {
        Some(slug) => {
            caller.must_be(&slug, "author_slug")?;
            slug
        }
        None => caller.0.slug.clone(),
    };
    // The token's member decides the author's type, as it decides the author.
    let author_type = match caller.0.kind {
        MemberKind::Agent => AuthorType::Agent,
        MemberKind::Human => AuthorType::Human,
    };
    if let Some(claimed) = body.choice("author_type", AuthorType::parse, AuthorType::ALL)?
        && claimed != author_type
    {
        return Err(ApiError::forbidden(format!(
            "author_type '{}' is not the token's member's type '{}'",
            claimed.as_str(),
            author_type.as_str()
        )));
    }
    let chat_id = body.string("chat_id")?;
    let task_id = body.string("task_id")?;
    if chat_id.is_none() && task_id.is_none() {
        return Err(ApiError::field(
            &["body", "chat_id"],
            "missing",
            "chat_id or task_id is required",
        ));
    }
    let content = match body.string("content")? {
        Some(content) => content,
        None => {
            return Err(ApiError::field(
                &["body", "content"],
                "missing",
                "Field required",
            ));
        }
    };
    let reply_to = body.string("reply_to")?;
    if let Some(parent) = &reply_to
        && tracker
            .find_message(parent)
            .await
            .map_err(post_error)?
            .is_none()
    {
        return Err(ApiError::field(
            &["body", "reply_to"],
            "value_error",
            format!("Unknown message '{parent}'"),
        ));
    }
    let message = NewMessage {
        author_slug,
        author_type,
        chat_id,
        task_id,
        content,
        mentions: body.strings("mentions")?.unwrap_or_default(),
        reply_to,
    };
    let out = tracker.post_message(message).await.map_err(post_error)?;
    Ok(created_message(&out))
}

pub async fn replies(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    match tracker.replies(&id).await.map_err(post_error)? {
        Some(replies) => Ok(ok(replies)),
        None => Err(ApiError::not_found("Message not found")),
    }
}
