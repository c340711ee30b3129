//! The gRPC services of synapse.proto, one file each, on one `SynapseApi`; the standard
//! health and reflection services beside them; and the token check in front of all.

mod capabilities;
mod group;
mod health;
mod message;
mod statuses;
mod task;

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use axum::extract::Request;
use axum::http::{StatusCode, header};
use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::shared::body_budget;
use crate::shared::gate::{Verdict, gate};

use super::Synapse;
use super::agents::Hints;
use super::proto::DESCRIPTOR_SET;
use super::proto::capabilities_service_server::CapabilitiesServiceServer;
use super::proto::group_service_server::GroupServiceServer;
use super::proto::health_service_server::HealthServiceServer;
use super::proto::synapse_message_service_server::SynapseMessageServiceServer;
use super::proto::task_service_server::TaskServiceServer;

/// Every Synapse service; cheap to clone.
#[derive(Clone)]
pub struct SynapseApi {
    pub synapse: Arc<Synapse>,
}

impl SynapseApi {
    fn hints(&self, metadata: &MetadataMap) -> Result<Hints, Status> {
        Hints::from_headers(metadata.as_ref())
    }
}

/// The largest request the standard health service reads.
const PROBE_MESSAGE_BYTES: usize = 4096;

pub fn router(synapse: Arc<Synapse>) -> axum::Router {
    let max_message = synapse.config.max_message_bytes;
    let read_budget = synapse.read_budget.clone();
    let api = SynapseApi { synapse };
    let (health, health_service) = tonic_health::server::health_reporter();
    tokio::spawn(async move {
        health.set_serving::<TaskServiceServer<SynapseApi>>().await;
        health
            .set_serving::<SynapseMessageServiceServer<SynapseApi>>()
            .await;
        health
            .set_serving::<CapabilitiesServiceServer<SynapseApi>>()
            .await;
        health.set_serving::<GroupServiceServer<SynapseApi>>().await;
        health
            .set_serving::<HealthServiceServer<SynapseApi>>()
            .await;
    });
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(DESCRIPTOR_SET)
        .build_v1()
        .expect("the descriptor set is valid");
    tonic::service::Routes::new(
        TaskServiceServer::new(api.clone()).max_decoding_message_size(max_message),
    )
    .add_service(
        SynapseMessageServiceServer::new(api.clone()).max_decoding_message_size(max_message),
    )
    .add_service(CapabilitiesServiceServer::new(api.clone()).max_decoding_message_size(max_message))
    .add_service(GroupServiceServer::new(api.clone()).max_decoding_message_size(max_message))
    .add_service(HealthServiceServer::new(api).max_decoding_message_size(max_message))
    // Open to callers without the token, for probes: its requests are a service name,
    // and tonic's default limit (4 MiB) would let anyone hold that much of the read budget.
    .add_service(health_service.max_decoding_message_size(PROBE_MESSAGE_BYTES))
    .add_service(reflection)
    .into_axum_router()
    .layer(tower::util::MapResponseLayer::new(
        statuses::oversize_is_resource_exhausted as fn(axum::response::Response) -> _,
    ))
    .layer(tower::util::MapRequestLayer::new(move |call| {
        body_budget::charge_grpc(call, &read_budget)
    }))
}

/// Refuses calls without the configured token: UNAUTHENTICATED for gRPC, 401 with the
/// gateway's error body over HTTP. The standard health service stays open for probes.
pub fn with_auth(app: axum::Router, token: Arc<ArcSwapOption<String>>) -> axum::Router {
    app.layer(gate(move |request: Request| {
        let Some(token) = token.load_full() else {
            return Verdict::Pass(request);
        };
        if request.uri().path().starts_with("/grpc.health.v1.Health/") {
            return Verdict::Pass(request);
        }
        let status = match presented(&request) {
            Some(presented) if presented == token.as_str() => return Verdict::Pass(request),
            None => Status::unauthenticated(
                "this call needs the Synapse token (authorization: Bearer <token>)",
            ),
            Some(_) => Status::unauthenticated("the Synapse token is not valid"),
        };
        let refusal = super::gateway::refuse(&request, status, StatusCode::UNAUTHORIZED);
        Verdict::Answer(statuses::holding_request(request, refusal))
    }))
}

fn presented(request: &Request) -> Option<&str> {
    let headers = request.headers();
    if let Some(token) = headers.get("x-synapse-token").and_then(|v| v.to_str().ok()) {
        return Some(token.trim());
    }
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(crate::shared::text::bearer_token)
}
