//! Attachments: files on messages (a file for a task goes on one of its comments).
//! Upload is `multipart/form-data` with a `file` part, up to 5 MiB.

use axum::extract::multipart::MultipartRejection;
use axum::extract::{Multipart, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::{
    ApiError, ApiResult, Caller, Query, Shared, created, existing_task, ok, required_query,
};
use crate::protocols::tracker::Tracker;
use crate::protocols::tracker::db::AttachmentRow;
use crate::protocols::tracker::wire::AttachmentOut;
use crate::shared::clock::iso8601;

/// Largest file accepted.
pub const MAX_FILE: usize = 5 * 1024 * 1024;
/// Largest request body read; a larger file is refused as soon as it passes `MAX_FILE`.
pub const MAX_UPLOAD_BODY: usize = 64 * 1024 * 1024;

impl Tracker {
    pub fn attachment_out(&self, a: &AttachmentRow) -> AttachmentOut {
        AttachmentOut {
            id: a.id.clone(),
            message_id: a.message_id.clone(),
            task_id: a.task_id.clone(),
            filename: a.filename.clone(),
            mime_type: a.mime_type.clone(),
            size: a.size,
            url: format!("/api/v1/attachments/{}", a.id),
            created_at: iso8601(a.created_at),
        }
    }
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("File too large: the limit is {MAX_FILE} bytes (5 MiB)"),
    )
}

pub async fn upload(
    State(tracker): Shared,
    _caller: Caller,
    Path(message_id): Path<String>,
    multipart: Result<Multipart, MultipartRejection>,
) -> ApiResult<Response> {
    let stored = tracker
        .find_message(&message_id)
        .await
        .map_err(|_| ApiError::not_found("Message not found"))?
        .ok_or_else(|| ApiError::not_found("Message not found"))?;
    // Checked after the message, so an unknown id is a 404 whatever the body.
    let mut multipart = multipart.map_err(|e| {
        ApiError::field(
            &["body"],
            "value_error",
            format!("expected multipart/form-data: {e}"),
        )
    })?;
    let bad_form = |e: axum::extract::multipart::MultipartError| {
        ApiError::field(
            &["body", "file"],
            "value_error",
            format!("invalid multipart body: {e}"),
        )
    };
    let mut field = loop {
        match multipart.next_field().await.map_err(bad_form)? {
            Some(field) if field.name() == Some("file") || field.file_name().is_some() => {
                break field;
            }
            Some(_) => continue,
            None => {
                return Err(ApiError::field(
                    &["body", "file"],
                    "missing",
                    "Field required",
                ));
            }
        }
    };
    let filename = field.file_name().unwrap_or("file").to_owned();
    let mime_type = field
        .content_type()
        .map(str::to_owned)
        .filter(|m| m != "application/octet-stream")
        .unwrap_or_else(|| guess_mime(&filename).to_owned());
    let mut data = Vec::new();
    while let Some(chunk) = field.chunk().await.map_err(bad_form)? {
        if data.len() + chunk.len() > MAX_FILE {
            return Err(too_large());
        }
        data.extend_from_slice(&chunk);
    }
    let task_id = stored
        .envelope
        .task
        .as_ref()
        .filter(|t| stored.envelope.thread.as_deref() == Some(t.id.as_str()))
        .map(|t| t.id.clone());
    let row = AttachmentRow {
        id: uuid::Uuid::new_v4().to_string(),
        message_id: crate::core::uuid_form(&stored.envelope.id),
        task_id,
        filename,
        mime_type,
        size: data.len() as i64,
        created_at: crate::core::now_ms(),
    };
    let row = tracker.keep_attachment(row, data).await?;
    Ok(created(tracker.attachment_out(&row)))
}

pub async fn download(
    State(tracker): Shared,
    _caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let (row, data) = tracker
        .attachment(&id)
        .await?
        .ok_or_else(|| ApiError::not_found("Attachment not found"))?;
    let disposition = format!(
        "attachment; filename=\"{}\"",
        row.filename.replace(['"', '\\', '\r', '\n'], "_")
    );
    Ok((
        [
            (header::CONTENT_TYPE, row.mime_type),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        data,
    )
        .into_response())
}

pub async fn list(State(tracker): Shared, _caller: Caller, query: Query) -> ApiResult<Response> {
    let task_id = required_query(&query, "task_id")?;
    existing_task(&tracker, &task_id).await?;
    let rows = tracker.db.attachments(&task_id, true).await?;
    Ok(ok(rows
        .iter()
        .map(|a| tracker.attachment_out(a))
        .collect::<Vec<_>>()))
}

/// A content type from a file name, for uploads that do not say.
fn guess_mime(filename: &str) -> &'static str {
    let ext = filename
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "svg" => "image/svg+xml",
        "pdf" => "application/pdf",
        "txt" | "log" => "text/plain",
        "md" => "text/markdown",
        "json" => "application/json",
        "yaml" | "yml" => "application/yaml",
        "csv" => "text/csv",
        "html" | "htm" => "text/html",
        "zip" => "application/zip",
        _ => "application/octet-stream",
    }
}
