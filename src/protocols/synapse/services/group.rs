//! `GroupService`: create, join, leave, disband, list members, and the group stream.

use tonic::{Request, Response, Status, Streaming};

use super::SynapseApi;
use super::message::MessageStream;
use crate::protocols::synapse::proto::group_service_server::GroupService;
use crate::protocols::synapse::proto::{
    CreateGroupRequest, CreateGroupResponse, DisbandGroupRequest, DisbandGroupResponse,
    JoinGroupRequest, JoinGroupResponse, LeaveGroupRequest, LeaveGroupResponse,
    ListGroupMembersRequest, ListGroupMembersResponse, SynapseMessage,
};
use crate::protocols::synapse::stream::StreamKind;

#[tonic::async_trait]
impl GroupService for SynapseApi {
    async fn create_group(
        &self,
        request: Request<CreateGroupRequest>,
    ) -> Result<Response<CreateGroupResponse>, Status> {
        let hints = self.hints(request.metadata())?;
        let caller = self.synapse.caller(&hints).await?;
        let group = self
            .synapse
            .create_group(request.into_inner(), caller)
            .await?;
        Ok(Response::new(CreateGroupResponse {
            success: true,
            group_id: group.row.id.clone(),
            group: Some(self.synapse.group_info(&group)),
            error: String::new(),
        }))
    }

    async fn join_group(
        &self,
        request: Request<JoinGroupRequest>,
    ) -> Result<Response<JoinGroupResponse>, Status> {
        let hints = self.hints(request.metadata())?;
        let request = request.into_inner();
        let mut agent = request.agent.unwrap_or_default();
        agent.agent_id = hints.agent_or_caller(agent.agent_id);
        self.synapse
            .join_group(&request.group_id, &agent, &hints)
            .await?;
        Ok(Response::new(JoinGroupResponse {
            success: true,
            error: String::new(),
        }))
    }

    async fn leave_group(
        &self,
        request: Request<LeaveGroupRequest>,
    ) -> Result<Response<LeaveGroupResponse>, Status> {
        let hints = self.hints(request.metadata())?;
        let request = request.into_inner();
        let agent = hints.agent_or_caller(request.agent_id);
        self.synapse.leave_group(&request.group_id, &agent).await?;
        Ok(Response::new(LeaveGroupResponse {
            success: true,
            error: String::new(),
        }))
    }

    async fn disband_group(
        &self,
        request: Request<DisbandGroupRequest>,
    ) -> Result<Response<DisbandGroupResponse>, Status> {
        self.synapse
            .disband_group(&request.into_inner().group_id)
            .await?;
        Ok(Response::new(DisbandGroupResponse {
            success: true,
            error: String::new(),
        }))
    }

    async fn list_group_members(
        &self,
        request: Request<ListGroupMembersRequest>,
    ) -> Result<Response<ListGroupMembersResponse>, Status> {
        let group = self.synapse.group(&request.into_inner().group_id)?;
        Ok(Response::new(ListGroupMembersResponse {
            success: true,
            members: self.synapse.group_members(&group),
        }))
    }

    type StreamGroupMessagesStream = MessageStream;

    async fn stream_group_messages(
        &self,
        request: Request<Streaming<SynapseMessage>>,
    ) -> Result<Response<Self::StreamGroupMessagesStream>, Status> {
        self.open_stream(request, StreamKind::Groups).await
    }
}
