//! `/messages`: a chat's messages or a task's comments, posting, and a message's replies.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;

use super::{ApiError, ApiResult, Body, Caller, Query, Shared, created_message, ok, one_of};
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

/// A posted message's fields, as its body gave them.
#[derive(serde::Deserialize)]
struct Posted {
    author_slug: Option<String>,
    author_type: Option<String>,
    chat_id: Option<String>,
    task_id: Option<String>,
    content: Option<String>,
    mentions: Option<Vec<String>>,
    reply_to: Option<String>,
}

impl Posted {
    /// Read by serde when the body is an object whose fields all have their types (most
    /// posts: a third of the instructions of a JSON `Value` and its copies), else field
    /// by field by `Body`, whose 422 names what is wrong. Either way every field's type
    /// is checked before the handler's own checks run, as FastAPI validates a body.
    fn read(bytes: &Bytes) -> ApiResult<Posted> {
        // Only an object: serde would also read a struct from a JSON array, by position.
        if bytes.trim_ascii_start().first() == Some(&b'{')
            && let Ok(posted) = serde_json::from_slice::<Posted>(bytes)
        {
            return Ok(posted);
        }
        let body = Body::parse(bytes)?;
        Ok(Posted {
            author_slug: body.string("author_slug")?,
            author_type: body.string("author_type")?,
            chat_id: body.string("chat_id")?,
            task_id: body.string("task_id")?,
            content: body.string("content")?,
            mentions: body.strings("mentions")?,
            reply_to: body.string("reply_to")?,
        })
    }
}

pub async fn create(State(tracker): Shared, caller: Caller, body: Bytes) -> ApiResult<Response> {
    let posted = Posted::read(&body)?;
    let author_slug = match posted.author_slug {
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
    if let Some(claimed) = posted.author_type {
        let claimed = one_of("author_type", &claimed, AuthorType::parse, AuthorType::ALL)?;
        if claimed != author_type {
            return Err(ApiError::forbidden(format!(
                "author_type '{}' is not the token's member's type '{}'",
                claimed.as_str(),
                author_type.as_str()
            )));
        }
    }
    let Posted {
        chat_id,
        task_id,
        content,
        mentions,
        reply_to,
        ..
    } = posted;
    if chat_id.is_none() && task_id.is_none() {
        return Err(ApiError::field(
            &["body", "chat_id"],
            "missing",
            "chat_id or task_id is required",
        ));
    }
    let Some(content) = content else {
        return Err(ApiError::field(
            &["body", "content"],
            "missing",
            "Field required",
        ));
    };
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
        mentions: mentions.unwrap_or_default(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn kind_of(body: &str) -> &'static str {
        match Posted::read(&Bytes::from(body.to_owned())) {
            Err(ApiError::Field { kind, .. }) => kind,
            Err(other) => panic!("{other:?}"),
            Ok(_) => "read",
        }
    }

    #[test]
    fn a_body_is_read_whole_or_refused_as_fastapi_would() {
        let posted = Posted::read(&Bytes::from_static(
            br#"{"chat_id": "c", "content": "hi", "mentions": ["a"], "reply_to": null, "extra": 1}"#,
        ))
        .unwrap();
        assert_eq!(posted.chat_id.as_deref(), Some("c"));
        assert_eq!(posted.mentions, Some(vec!["a".to_owned()]));
        assert_eq!(posted.reply_to, None);
        // Refused by `Body`, as before the typed reading: by position, not as an object.
        assert_eq!(kind_of(r#"["c", null, "c", null, "hi"]"#), "dict_type");
        assert_eq!(kind_of(r#"{"chat_id": "c", "content": 3}"#), "string_type");
        assert_eq!(kind_of(r#"{"chat_id": "c", "mentions": [1]}"#), "list_type");
        assert_eq!(kind_of(" "), "missing");
        assert_eq!(kind_of("{"), "json_invalid");
        // A repeated key: the last one, as `Body` reads it.
        let twice = r#"{"content": 1, "content": "x"}"#;
        assert_eq!(kind_of(twice), "read");
    }
}
