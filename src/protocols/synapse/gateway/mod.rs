//! The HTTP/JSON gateway: every `google.api.http` rule of synapse.proto, served with
//! proto3-canonical JSON. The route table is read from the descriptor's annotations at
//! start, not written route by route: path variables fill request fields, `body: "*"` is
//! the whole request, and the remaining fields of a GET come from the query string. Each
//! call goes to the same service code the gRPC server runs. Errors are
//! `{"code", "message", "details"}` with the matching HTTP status, as grpc-gateway does.

mod fields;
mod form;
mod openapi;
mod send_message;

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter, on};
use prost::Message;
use prost_reflect::{DynamicMessage, Kind, MessageDescriptor, MethodDescriptor, Value as PValue};
use serde_json::{Map, Value, json};
use tonic::Status;
use tonic::codegen::http::Extensions;
use tonic::metadata::MetadataMap;

use self::fields::{Place, from_body, set_path};
use super::agents::{Hints, internal};
use super::proto::{SendMessageRequest, SynapseMessage};
use super::services::SynapseApi;
use super::{Synapse, json, translate, wire};
use crate::shared::gate::{Verdict, gate};
use crate::shared::http_refusals;

/// One HTTP binding of an RPC.
#[derive(Clone, Debug)]
pub struct Rule {
    pub method: Method,
    /// The path template, e.g. `/api/v1/synapse/task/{task_id}`.
    pub path: String,
    /// `"*"`, a field name, or empty.
    pub body: String,
    pub rpc: MethodDescriptor,
}

impl Rule {
    /// The names of the `{variables}` in the path.
    pub fn variables(&self) -> Vec<String> {
        self.path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}'))
            .map(|v| v.split('=').next().unwrap_or(v).to_owned())
            .collect()
    }
}

/// Every `google.api.http` rule in the descriptor set, in declaration order.
pub fn rules() -> Vec<Rule> {
    let pool = &*wire::POOL;
    let Some(http) = pool.get_extension_by_name("google.api.http") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for service in pool.services() {
        for rpc in service.methods() {
            let options = rpc.options();
            if !options.has_extension(&http) {
                continue;
            }
            let rule = options.get_extension(&http);
            let Some(rule) = rule.as_message() else {
                continue;
            };
            let text = |name: &str| {
                rule.get_field_by_name(name)
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default()
            };
            let (method, path) = [
                (Method::GET, "get"),
                (Method::PUT, "put"),
                (Method::POST, "post"),
                (Method::DELETE, "delete"),
                (Method::PATCH, "patch"),
            ]
            .into_iter()
            .map(|(m, f)| (m, text(f)))
            .find(|(_, p)| !p.is_empty())
            .unwrap_or((Method::GET, String::new()));
            if path.is_empty() {
                continue;
            }
            out.push(Rule {
                method,
                path,
                body: text("body"),
                rpc: rpc.clone(),
            });
        }
    }
    out
}

struct Gateway {
    api: SynapseApi,
    /// Largest request body: as large as a gRPC request may be, so that
    /// `SubmitTaskWithFiles` takes 5 MiB files here too (base64 makes them a third larger
    /// in JSON).
    max_body: usize,
}

pub fn router(synapse: Arc<Synapse>) -> Router {
    let max_body = synapse.config.max_message_bytes;
    let read_budget = synapse.read_budget.clone();
    let gateway = Arc::new(Gateway {
        api: SynapseApi { synapse },
        max_body,
    });
    let mut by_path: BTreeMap<String, MethodRouter<Arc<Gateway>>> = BTreeMap::new();
    for rule in rules() {
        let filter = MethodFilter::try_from(rule.method.clone()).expect("a standard method");
        let rule = Arc::new(rule);
        let handler = {
            let rule = rule.clone();
            move |state: State<Arc<Gateway>>,
                  path: Option<Path<BTreeMap<String, String>>>,
                  query: Result<Query<Vec<(String, String)>>, QueryRejection>,
                  headers: HeaderMap,
                  body: Result<Bytes, BytesRejection>| async move {
                let body = match body {
                    Ok(body) => body,
                    Err(rejection) => return body_refused(&rejection, state.max_body),
                };
                let query = match query {
                    Ok(query) => query,
                    Err(rejection) => {
                        let status = Status::invalid_argument(rejection.body_text());
                        return error_response(&status, StatusCode::BAD_REQUEST);
                    }
                };
                handle(
                    state,
                    rule,
                    path.map(|p| p.0).unwrap_or_default(),
                    query,
                    headers,
                    body,
                )
                .await
            }
        };
        let entry = by_path.remove(&rule.path).unwrap_or_default();
        by_path.insert(rule.path.clone(), entry.merge(on(filter, handler)));
    }
    let mut router = Router::new().route(
        "/api/v1/synapse/openapi.json",
        axum::routing::get(openapi::serve),
    );
    for (path, methods) in by_path {
        router = router.route(&path, methods);
    }
    let router = router
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(gateway)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(gate(move |request: Request| {
            refuse_declared_oversize(request, max_body)
        }));
    http_refusals::shaped(router, super::PROTOCOL, &read_budget, |status, text, _| {
        let code = match status {
            StatusCode::PAYLOAD_TOO_LARGE => tonic::Code::ResourceExhausted,
            StatusCode::NOT_FOUND => tonic::Code::NotFound,
            StatusCode::METHOD_NOT_ALLOWED => tonic::Code::Unimplemented,
            StatusCode::UNAUTHORIZED => tonic::Code::Unauthenticated,
            StatusCode::SERVICE_UNAVAILABLE => tonic::Code::Unavailable,
            s if s.is_server_error() => tonic::Code::Internal,
            _ => tonic::Code::InvalidArgument,
        };
        error_response(&Status::new(code, text), status)
    })
}

/// A request no route takes: gRPC's UNIMPLEMENTED for a gRPC call, as tonic answers it;
/// grpc-gateway's 404 `{"code": 5, "message": "Not Found"}` for anything else (tonic's
/// answer, a 200 with an empty body, reads as success to an HTTP client).
pub async fn unrouted(request: Request) -> Response {
    if is_grpc(&request) {
        return Status::unimplemented("").into_http();
    }
    error_response(&Status::not_found("Not Found"), StatusCode::NOT_FOUND)
}

/// `status` answered in the caller's own form: as gRPC to a gRPC call, else as the
/// gateway's error body with HTTP status `http`.
pub fn refuse(request: &Request, status: Status, http: StatusCode) -> Response {
    if is_grpc(request) {
        status.into_http()
    } else {
        error_response(&status, http)
    }
}

fn is_grpc(request: &Request) -> bool {
    request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// A known path with a method it does not take, in the gateway's error shape.
async fn method_not_allowed() -> Response {
    let status = Status::unimplemented("Method Not Allowed");
    error_response(&status, StatusCode::METHOD_NOT_ALLOWED)
}

/// Refuses a body that says it is over the limit before reading any of it.
fn refuse_declared_oversize(request: Request, max_body: usize) -> Verdict {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|length| length > max_body as u64) {
        return Verdict::Answer(too_large(max_body));
    }
    Verdict::Pass(request)
}

/// A body that could not be read, in the gateway's error shape rather than axum's text.
fn body_refused(rejection: &BytesRejection, max_body: usize) -> Response {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large(max_body);
    }
    error_response(
        &Status::invalid_argument(rejection.body_text()),
        StatusCode::BAD_REQUEST,
    )
}

fn too_large(max_body: usize) -> Response {
    let status = Status::resource_exhausted(format!(
        "the request body is over the gateway's limit of {max_body} bytes"
    ));
    error_response(&status, StatusCode::PAYLOAD_TOO_LARGE)
}

async fn handle(
    State(gateway): State<Arc<Gateway>>,
    rule: Arc<Rule>,
    path: BTreeMap<String, String>,
    Query(query): Query<Vec<(String, String)>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match call(&gateway, &rule, path, query, headers, body).await {
        Ok(Answer::One(json)) => axum::Json(json).into_response(),
        Ok(Answer::Stream(items)) => stream_response(&items),
        Err(status) => error_response(&status, http_status(status.code())),
    }
}

/// What an RPC answers over HTTP: one message, or a server stream's messages.
enum Answer {
    One(Value),
    /// Each `{"result": message}`, as grpc-gateway writes a server stream.
    Stream(Vec<Value>),
}

/// A server stream as grpc-gateway sends it: one `{"result": …}` object per line.
fn stream_response(items: &[Value]) -> Response {
    let mut body = String::new();
    for item in items {
        body.push_str(&item.to_string());
        body.push('\n');
    }
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn call(
    gateway: &Gateway,
    rule: &Rule,
    path: BTreeMap<String, String>,
    query: Vec<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Answer, Status> {
    // ReceiveCallback's HTTP form: without a message, as over gRPC, the caller's kept
    // messages; with one, a remote Synapse system delivering it.
    if rule.rpc.full_name() == RECEIVE_CALLBACK {
        return match callback_body(&body)? {
            None => poll(gateway, headers).await,
            Some(message) => ingest(gateway, headers, message).await,
        };
    }
    if rule.rpc.full_name() == SEND_MESSAGE
        && let Some(request) = send_message::read(&body)
    {
        return send(gateway, request, headers).await;
    }
    if rule.rpc.full_name() == SUBMIT_TASK_WITH_FILES && form::is_form(&headers) {
        let request = form::submit_task_with_files(&headers, body).await?;
        return unary(gateway, rule, &request.encode_to_vec(), headers).await;
    }
    let input = rule.rpc.input();
    let mut request = match rule.body.as_str() {
        "" => DynamicMessage::new(input.clone()),
        "*" => from_body(&input, &body)?,
        field => {
            let mut request = DynamicMessage::new(input.clone());
            let desc = input.get_field_by_name(field).ok_or_else(|| {
                Status::internal(format!(
                    "body field '{field}' is not in {}",
                    input.full_name()
                ))
            })?;
            let Kind::Message(inner) = desc.kind() else {
                return Err(Status::internal("a body field must be a message"));
            };
            request.set_field(&desc, PValue::Message(from_body(&inner, &body)?));
            request
        }
    };
    for (name, value) in &path {
        set_path(&mut request, name, value, Place::Path)?;
    }
    if rule.body != "*" {
        // As grpc-gateway: a field the path binds is not taken from the query, by its
        // proto name (`task_id`) or its JSON one (`taskId`).
        let bound = |name: &str| {
            let first = name.split('.').next().unwrap_or(name);
            let field =
                (input.get_field_by_name(first)).or_else(|| input.get_field_by_json_name(first));
            path.contains_key(field.as_ref().map_or(first, |f| f.name()))
        };
        for (name, value) in query.iter().filter(|(name, _)| !bound(name)) {
            set_path(&mut request, name, value, Place::Query)?;
        }
    }
    unary(gateway, rule, &request.encode_to_vec(), headers).await
}

/// Calls `rule`'s RPC with `request` (the encoded input message), the headers as its
/// metadata, and answers with the output as JSON.
async fn unary(
    gateway: &Gateway,
    rule: &Rule,
    request: &[u8],
    headers: HeaderMap,
) -> Result<Answer, Status> {
    let (output, response) = dispatch(&gateway.api, rule.rpc.full_name(), request, headers).await?;
    let decoded = DynamicMessage::decode(output, response.as_slice())
        .map_err(|e| Status::internal(e.to_string()))?;
    json_of(decoded).map(Answer::One)
}

/// `SendMessage` with its request read here (`send_message`): called and answered without
/// the descriptor pool.
async fn send(
    gateway: &Gateway,
    request: SendMessageRequest,
    headers: HeaderMap,
) -> Result<Answer, Status> {
    use super::proto::synapse_message_service_server::SynapseMessageService;
    let response = gateway
        .api
        .send_message(rpc_request(headers, request))
        .await?;
    let response = response.into_inner();
    Ok(Answer::One(send_message::answer(&response)))
}

const SEND_MESSAGE: &str = "synapse.SynapseMessageService.SendMessage";
const RECEIVE_CALLBACK: &str = "synapse.SynapseMessageService.ReceiveCallback";
const SUBMIT_TASK_WITH_FILES: &str = "synapse.TaskService.SubmitTaskWithFiles";

/// The message a ReceiveCallback body delivers, or `None` for an empty body or `{}`:
/// ReceiveCallback's own request (`google.protobuf.Empty`).
fn callback_body(body: &Bytes) -> Result<Option<Value>, Status> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let json: Value = serde_json::from_slice(body)
        .map_err(|e| Status::invalid_argument(format!("body is not valid JSON: {e}")))?;
    Ok(Some(json).filter(|json| !json.as_object().is_some_and(Map::is_empty)))
}

/// ReceiveCallback as over gRPC: every message kept for the agent named by
/// `x-synapse-agent-id`, oldest first.
async fn poll(gateway: &Gateway, headers: HeaderMap) -> Result<Answer, Status> {
    use super::proto::synapse_message_service_server::SynapseMessageService;
    use futures_util::StreamExt;
    let mut messages = gateway
        .api
        .receive_callback(rpc_request(headers, ()))
        .await?
        .into_inner();
    let mut items = Vec::new();
    while let Some(message) = messages.next().await {
        // The messages are taken out of the inbox already: one that cannot be written as
        // JSON is answered in its place as grpc-gateway answers a stream's error.
        items.push(
            match message.and_then(|m| wire::to_json(&m, "synapse.SynapseMessage").map_err(internal)) {
                Ok(message) => json!({ "result": message }),
                Err(status) => {
                    tracing::error!(error = %status.message(), "synapse: a polled message cannot be written as JSON");
                    json!({ "error": error_json(&status) })
                }
            },
        );
    }
    Ok(Answer::Stream(items))
}

/// A remote system's callback: `json`, the body, is a SynapseMessage. Answered, in the
/// server-streaming form grpc-gateway uses, with the bridge's acknowledgement.
async fn ingest(gateway: &Gateway, headers: HeaderMap, json: Value) -> Result<Answer, Status> {
    // The message may come bare or wrapped as `{"message": …}`.
    let json = match json.get("message") {
        Some(inner) if inner.is_object() => inner.clone(),
        _ => json,
    };
    let msg: SynapseMessage = wire::from_json(&json, "synapse.SynapseMessage")
        .map_err(|e| Status::invalid_argument(format!("body is not a SynapseMessage: {e}")))?;
    let hints = Hints::from_headers(&headers)?;
    let synapse = &gateway.api.synapse;
    let id = synapse.accept(msg.clone(), &hints).await?;
    let mut acked = msg;
    acked.id = id;
    let ack = translate::ack(&acked, synapse.bridge_endpoint());
    let ack = wire::to_json(&ack, "synapse.SynapseMessage").map_err(internal)?;
    Ok(Answer::Stream(vec![json!({ "result": ack })]))
}

/// Proto3 JSON of a response: lowerCamelCase, every field, enums by name.
pub fn json_of(message: DynamicMessage) -> Result<Value, Status> {
    json::to_json(message).map_err(internal)
}

/// grpc-gateway's mapping of gRPC codes to HTTP statuses.
pub fn http_status(code: tonic::Code) -> StatusCode {
    use tonic::Code;
    match code {
        Code::Ok => StatusCode::OK,
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
            StatusCode::BAD_REQUEST
        }
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// `{"code", "message", "details"}` with `http` as the status.
pub fn error_response(status: &Status, http: StatusCode) -> Response {
    (http, axum::Json(error_json(status))).into_response()
}

/// A gRPC status as grpc-gateway writes it: `{"code", "message", "details"}`.
fn error_json(status: &Status) -> Value {
    json!({ "code": status.code() as i32, "message": status.message(), "details": [] })
}

/// An RPC's request as the gateway calls it: the HTTP request's headers are its metadata,
/// and a `Grpc-Metadata-<key>` header is metadata `<key>`, as grpc-gateway passes it.
fn rpc_request<T>(mut headers: HeaderMap, message: T) -> tonic::Request<T> {
    let prefixed: Vec<(axum::http::HeaderName, axum::http::HeaderValue)> = (headers.iter())
        .filter_map(|(name, value)| {
            let key = name.as_str().strip_prefix(GRPC_METADATA)?;
            Some((axum::http::HeaderName::try_from(key).ok()?, value.clone()))
        })
        .collect();
    for (name, value) in prefixed {
        headers.insert(name, value);
    }
    tonic::Request::from_parts(
        MetadataMap::from_headers(headers),
        Extensions::default(),
        message,
    )
}

/// The prefix grpc-gateway clients give metadata sent as HTTP headers (lower case, as
/// `HeaderName` keeps names).
const GRPC_METADATA: &str = "grpc-metadata-";

/// Calls the RPC `name` with an encoded request and `headers`; returns the response's
/// descriptor and bytes.
async fn dispatch(
    api: &SynapseApi,
    name: &str,
    request: &[u8],
    headers: HeaderMap,
) -> Result<(MessageDescriptor, Vec<u8>), Status> {
    use super::proto::capabilities_service_server::CapabilitiesService;
    use super::proto::group_service_server::GroupService;
    use super::proto::health_service_server::HealthService;
    use super::proto::synapse_message_service_server::SynapseMessageService;
    use super::proto::task_service_server::TaskService;

    macro_rules! unary {
        ($service:ident :: $rpc:ident, $input:ty, $output:literal) => {{
            let input =
                <$input>::decode(request).map_err(|e| Status::invalid_argument(e.to_string()))?;
            let response = $service::$rpc(api, rpc_request(headers, input)).await?;
            (
                wire::descriptor($output),
                response.into_inner().encode_to_vec(),
            )
        }};
    }
    use super::proto as pb;
    Ok(match name {
        "synapse.TaskService.SubmitTask" => unary!(
            TaskService::submit_task,
            pb::SubmitTaskRequest,
            "synapse.SubmitTaskResponse"
        ),
        "synapse.TaskService.SubmitTaskWithFiles" => unary!(
            TaskService::submit_task_with_files,
            pb::SubmitTaskWithFilesRequest,
            "synapse.SubmitTaskResponse"
        ),
        "synapse.TaskService.GetTask" => unary!(
            TaskService::get_task,
            pb::GetTaskRequest,
            "synapse.TaskStatusResponse"
        ),
        "synapse.TaskService.GetTaskStatus" => unary!(
            TaskService::get_task_status,
            pb::GetTaskRequest,
            "synapse.TaskStatusResponse"
        ),
        "synapse.TaskService.ListTasks" => unary!(
            TaskService::list_tasks,
            pb::ListTasksRequest,
            "synapse.ListTasksResponse"
        ),
        "synapse.TaskService.CancelTask" => unary!(
            TaskService::cancel_task,
            pb::CancelTaskRequest,
            "synapse.CancelTaskResponse"
        ),
        "synapse.SynapseMessageService.SendMessage" => unary!(
            SynapseMessageService::send_message,
            pb::SendMessageRequest,
            "synapse.SendMessageResponse"
        ),
        "synapse.CapabilitiesService.GetCapabilities" => unary!(
            CapabilitiesService::get_capabilities,
            (),
            "synapse.CapabilitiesResponse"
        ),
        "synapse.CapabilitiesService.QueryAgent" => unary!(
            CapabilitiesService::query_agent,
            pb::QueryAgentRequest,
            "synapse.CapabilitiesResponse"
        ),
        "synapse.CapabilitiesService.ListAgents" => unary!(
            CapabilitiesService::list_agents,
            (),
            "synapse.ListAgentsResponse"
        ),
        "synapse.GroupService.CreateGroup" => unary!(
            GroupService::create_group,
            pb::CreateGroupRequest,
            "synapse.CreateGroupResponse"
        ),
        "synapse.GroupService.JoinGroup" => unary!(
            GroupService::join_group,
            pb::JoinGroupRequest,
            "synapse.JoinGroupResponse"
        ),
        "synapse.GroupService.LeaveGroup" => unary!(
            GroupService::leave_group,
            pb::LeaveGroupRequest,
            "synapse.LeaveGroupResponse"
        ),
        "synapse.GroupService.DisbandGroup" => unary!(
            GroupService::disband_group,
            pb::DisbandGroupRequest,
            "synapse.DisbandGroupResponse"
        ),
        "synapse.GroupService.ListGroupMembers" => unary!(
            GroupService::list_group_members,
            pb::ListGroupMembersRequest,
            "synapse.ListGroupMembersResponse"
        ),
        "synapse.HealthService.HealthCheck" => unary!(
            HealthService::health_check,
            (),
            "synapse.HealthCheckResponse"
        ),
        other => {
            return Err(Status::unimplemented(format!(
                "{other} has no HTTP binding here"
            )));
        }
    })
}
