//! `HealthService`: alive, which version, for how long, and how many tasks are open.

use tonic::{Request, Response, Status};

use super::SynapseApi;
use crate::protocols::synapse::agents::internal;
use crate::protocols::synapse::proto::health_service_server::HealthService;
use crate::protocols::synapse::proto::{HealthCheckResponse, TaskStatus};

#[tonic::async_trait]
impl HealthService for SynapseApi {
    async fn health_check(
        &self,
        _request: Request<()>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let active = self
            .synapse
            .db
            .count_tasks(&[
                TaskStatus::Received as i32,
                TaskStatus::Processing as i32,
                TaskStatus::Waiting as i32,
            ])
            .await
            .map_err(internal)?;
        Ok(Response::new(HealthCheckResponse {
            status: "SERVING".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_seconds: self.synapse.started.elapsed().as_secs() as i64,
            active_tasks: active as i32,
        }))
    }
}
