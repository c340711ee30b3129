//! `CapabilitiesService`: the bridge's own capabilities, and every agent of every protocol.

use tonic::{Request, Response, Status};

use super::SynapseApi;
use crate::core::AgentInfo;
use crate::core::BRIDGE_AGENT as BRIDGE_AGENT_ID;
use crate::protocols::synapse::PROTOCOL;
use crate::protocols::synapse::proto::capabilities_service_server::CapabilitiesService;
use crate::protocols::synapse::proto::{
    AgentCapabilities, AgentInfo as AgentInfoPb, CapabilitiesResponse, ListAgentsResponse,
    QueryAgentRequest, SupportedTaskType, TransportMode,
};
use crate::protocols::synapse::tasks::MAX_FILE;
use crate::protocols::synapse::translate::PROTOCOL_VERSION;

const ALL_TRANSPORTS: [TransportMode; 4] = [
    TransportMode::Callback,
    TransportMode::Polling,
    TransportMode::Sync,
    TransportMode::Hybrid,
];

fn task_type(name: &str, description: String) -> SupportedTaskType {
    SupportedTaskType {
        r#type: name.to_owned(),
        name: name.to_owned(),
        description,
        ..Default::default()
    }
}

impl SynapseApi {
    fn capabilities_of(&self, agent: &AgentInfo) -> AgentCapabilities {
        let mut types = vec![task_type(
            &agent.name,
            format!("anything, done by {}", agent.name),
        )];
        types.extend(
            agent
                .capabilities
                .iter()
                .map(|c| task_type(c, format!("{c}, done by {}", agent.name))),
        );
        AgentCapabilities {
            agent_id: agent.name.clone(),
            agent_name: agent
                .description
                .clone()
                .unwrap_or_else(|| agent.name.clone()),
            system_id: agent.protocol.to_owned(),
            protocol_version: PROTOCOL_VERSION.into(),
            supported_task_types: types,
            supported_content_types: vec!["text/plain".into(), "application/json".into()],
            supported_transport_modes: if agent.protocol == PROTOCOL {
                ALL_TRANSPORTS.iter().map(|t| *t as i32).collect()
            } else {
                // Agents of other protocols are reached through the bridge's own connection.
                vec![TransportMode::Sync as i32]
            },
            max_file_size: MAX_FILE as i64,
            max_concurrent_tasks: 0,
            max_task_duration_seconds: 0,
            support_progress_updates: true,
            support_streaming: agent.protocol == PROTOCOL,
            support_hil: true,
            support_groups: true,
        }
    }
}

#[tonic::async_trait]
impl CapabilitiesService for SynapseApi {
    /// The bridge's own: it takes any task type an agent it knows takes.
    async fn get_capabilities(
        &self,
        _request: Request<()>,
    ) -> Result<Response<CapabilitiesResponse>, Status> {
        let mut types: Vec<SupportedTaskType> = Vec::new();
        // Each type once, in linear time however many agents and capabilities there are.
        let mut seen = foldhash::HashSet::default();
        for agent in self.synapse.core.directory.list() {
            for capability in std::iter::once(&agent.name).chain(agent.capabilities.iter()) {
                if seen.insert(capability.clone()) {
                    types.push(task_type(capability, format!("handled by {}", agent.name)));
                }
            }
        }
        Ok(Response::new(CapabilitiesResponse {
            success: true,
            capabilities: Some(AgentCapabilities {
                agent_id: BRIDGE_AGENT_ID.into(),
                agent_name: "agentbridge".into(),
                system_id: "agentbridge".into(),
                protocol_version: PROTOCOL_VERSION.into(),
                supported_task_types: types,
                supported_content_types: vec!["text/plain".into(), "application/json".into()],
                supported_transport_modes: ALL_TRANSPORTS.iter().map(|t| *t as i32).collect(),
                max_file_size: MAX_FILE as i64,
                max_concurrent_tasks: 0,
                max_task_duration_seconds: 0,
                support_progress_updates: true,
                support_streaming: true,
                support_hil: true,
                support_groups: true,
            }),
            error: String::new(),
        }))
    }

    async fn query_agent(
        &self,
        request: Request<QueryAgentRequest>,
    ) -> Result<Response<CapabilitiesResponse>, Status> {
        let id = request.into_inner().agent_id;
        if id.is_empty() {
            return Err(Status::invalid_argument("agent_id is required"));
        }
        let agent = self
            .synapse
            .core
            .directory
            .get(&id)
            .ok_or_else(|| Status::not_found(format!("agent '{id}' not found")))?;
        Ok(Response::new(CapabilitiesResponse {
            success: true,
            capabilities: Some(self.capabilities_of(&agent)),
            error: String::new(),
        }))
    }

    /// Every agent the bridge knows, whatever its protocol (`system_id`); not the bridge
    /// itself (the directory does not list it), which is the service answering rather
    /// than a peer (`GetCapabilities`).
    /// `endpoint` is the agent's own Synapse endpoint where this bridge holds one; in a
    /// fleet, otherwise, the id of the bridge that holds the agent, in place of an
    /// address, as `AgentInfo` has no field of its own for that.
    async fn list_agents(
        &self,
        _request: Request<()>,
    ) -> Result<Response<ListAgentsResponse>, Status> {
        let directory = &self.synapse.core.directory;
        let agents: Vec<AgentInfoPb> = directory
            .list()
            .into_iter()
            .map(|a| {
                let own_endpoint = (self.synapse.agents.get(&a.name))
                    .map(|s| s.endpoint.clone())
                    .filter(|endpoint| !endpoint.is_empty());
                let endpoint = own_endpoint
                    .or_else(|| directory.holding_bridge(&a).map(str::to_owned))
                    .unwrap_or_default();
                AgentInfoPb {
                    id: a.native_id.clone(),
                    agent_id: a.name.clone(),
                    agent_name: a.description.clone().unwrap_or_else(|| a.name.clone()),
                    system_id: a.protocol.to_owned(),
                    endpoint,
                    is_active: a.online,
                    trust_level: 0,
                }
            })
            .collect();
        Ok(Response::new(ListAgentsResponse {
            success: true,
            total: agents.len() as i32,
            agents,
        }))
    }
}
