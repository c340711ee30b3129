//! `SubmitTaskWithFiles` as a `multipart/form-data` upload, as its proto comment says
//! ("提交带文件的任务(Multipart)") and as `FileUpload.field_name` implies: the form is read into
//! the same `SubmitTaskWithFilesRequest` the JSON body and gRPC give.
//!
//! - every other part with a file name is a `FileUpload`: its form field name, file name,
//!   content type (`application/octet-stream` when none) and bytes (an empty file input,
//!   no name and no bytes, is no file);
//! - a `request` part, a file or not, is the `SubmitTaskRequest` as JSON;
//! - any other part is one field of that request, by its proto or JSON name (`task_type`
//!   or `taskType`, …), its text the value; `payload` is JSON (an `Any` with `@type`).

use axum::body::Bytes;
use axum::http::{HeaderMap, header};
use serde_json::{Map, Value};
use tonic::Status;

use super::super::proto::{FileUpload, SubmitTaskRequest, SubmitTaskWithFilesRequest};
use super::super::wire;

/// Whether the request's body is a `multipart/form-data` form.
pub(super) fn is_form(headers: &HeaderMap) -> bool {
    content_type(headers).is_some_and(|t| {
        t.split(';')
            .next()
            .is_some_and(|media| media.trim().eq_ignore_ascii_case("multipart/form-data"))
    })
}

/// The form in `body` as a `SubmitTaskWithFilesRequest`.
pub(super) async fn submit_task_with_files(
    headers: &HeaderMap,
    body: Bytes,
) -> Result<SubmitTaskWithFilesRequest, Status> {
    let boundary = content_type(headers)
        .and_then(|t| multer::parse_boundary(t).ok())
        .ok_or_else(|| Status::invalid_argument("multipart/form-data without a boundary"))?;
    let bad_form = |e: multer::Error| Status::invalid_argument(format!("invalid form: {e}"));
    let body = futures_util::stream::once(async move { Ok::<_, std::io::Error>(body) });
    let mut form = multer::Multipart::new(body, boundary);
    let mut request = Map::new();
    let mut files = Vec::new();
    while let Some(part) = form.next_field().await.map_err(bad_form)? {
        let name = part.name().unwrap_or_default().to_owned();
        // `request` and `payload` are the request's even when sent as files (`curl -F
        // request=@task.json`).
        let file_name = part
            .file_name()
            .filter(|_| !matches!(name.as_str(), "request" | "payload"));
        if let Some(filename) = file_name {
            let filename = filename.to_owned();
            let mime_type = part
                .content_type()
                .map_or("application/octet-stream".to_owned(), ToString::to_string);
            let data = part.bytes().await.map_err(bad_form)?;
            // A form's file input left empty: no file.
            if filename.is_empty() && data.is_empty() {
                continue;
            }
            files.push(FileUpload {
                field_name: name,
                filename,
                mime_type,
                data: data.to_vec(),
            });
            continue;
        }
        let text = part.text().await.map_err(bad_form)?;
        match name.as_str() {
            "request" => match json(&name, &text)? {
                Value::Object(fields) => request.extend(fields),
                _ => {
                    return Err(Status::invalid_argument(
                        "form field 'request' must be a JSON object",
                    ));
                }
            },
            "payload" => {
                request.insert(name.clone(), json(&name, &text)?);
            }
            _ if is_request_field(&name) => {
                request.insert(name, Value::String(text));
            }
            _ => {
                return Err(Status::invalid_argument(format!(
                    "form field '{name}' is neither a file nor a field of SubmitTaskRequest"
                )));
            }
        }
    }
    let request: SubmitTaskRequest =
        wire::from_json(&Value::Object(request), "synapse.SubmitTaskRequest").map_err(|e| {
            Status::invalid_argument(format!("form fields do not fit SubmitTaskRequest: {e}"))
        })?;
    Ok(SubmitTaskWithFilesRequest {
        request: Some(request),
        files,
    })
}

/// Whether `name` is a `SubmitTaskRequest` field, by its proto or its JSON name.
fn is_request_field(name: &str) -> bool {
    let request = wire::descriptor("synapse.SubmitTaskRequest");
    request.get_field_by_name(name).is_some() || request.get_field_by_json_name(name).is_some()
}

fn content_type(headers: &HeaderMap) -> Option<&str> {
    headers.get(header::CONTENT_TYPE)?.to_str().ok()
}

fn json(field: &str, text: &str) -> Result<Value, Status> {
    serde_json::from_str(text)
        .map_err(|e| Status::invalid_argument(format!("form field '{field}' is not JSON: {e}")))
}
