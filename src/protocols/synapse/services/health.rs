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
        let mut active = 0;
        for status in [
            TaskStatus::Received,
            TaskStatus::Processing,
            TaskStatus::Waiting,
        ] {
            let (_, count) = self
                .synapse
                .db
                .tasks(Some(status as i32), 0, 0)
                .await
                .map_err(internal)?;
            active += count;
        }
        Ok(Response::new(HealthCheckResponse {
            status: "SERVING".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_seconds: self.synapse.started.elapsed().as_secs() as i64,
            active_tasks: active as i32,
        }))
    }
}
