//! `SynapseMessageService`: send, stream, and poll (`ReceiveCallback`).

use std::pin::Pin;

use futures_util::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::SynapseApi;
use crate::protocols::synapse::agents::AGENT_HEADER;
use crate::protocols::synapse::proto::synapse_message_service_server::SynapseMessageService;
use crate::protocols::synapse::proto::{
    AgentEndpoint, SendMessageRequest, SendMessageResponse, SynapseMessage,
};
use crate::protocols::synapse::{outlet, stream::StreamKind};

pub type MessageStream = Pin<Box<dyn Stream<Item = Result<SynapseMessage, Status>> + Send>>;

/// How many outbound messages may wait for a slow stream reader before the mailbox
/// policy takes over.
const STREAM_BUFFER: usize = 64;

impl SynapseApi {
    /// Opens a stream for the agent named by metadata or by its first message. The call is
    /// answered at once either way: a client may well send its first message only once it
    /// has the answer, so waiting for that message here would deadlock both sides.
    pub async fn open_stream(
        &self,
        request: Request<Streaming<SynapseMessage>>,
        kind: StreamKind,
    ) -> Result<Response<MessageStream>, Status> {
        let hints = self.hints(request.metadata())?;
        let inbound = request.into_inner();
        let (outlet, outgoing) = outlet::outlet(STREAM_BUFFER);
        let synapse = self.synapse.clone();
        match hints.agent_id.clone() {
            // Connected before the call is answered, so anything sent to the agent once it
            // has the answer reaches the stream.
            Some(agent) => {
                let endpoint = AgentEndpoint {
                    agent_id: agent.clone(),
                    ..Default::default()
                };
                // One reconnecting here from another bridge is let in once its leave came.
                if kind == StreamKind::Messages {
                    synapse.core.leave_arrived(&agent).await;
                }
                synapse
                    .ensure_agent(&endpoint, &hints, AGENT_HEADER)
                    .await?;
                let attached = synapse.attach_stream(&agent, kind).await?;
                tokio::spawn(synapse.serve_stream(attached, None, inbound, hints, outlet));
            }
            None => {
                tokio::spawn(synapse.identify_and_serve(kind, inbound, hints, outlet));
            }
        }
        Ok(Response::new(Box::pin(outgoing)))
    }
}

#[tonic::async_trait]
impl SynapseMessageService for SynapseApi {
    async fn send_message(
        &self,
        request: Request<SendMessageRequest>,
    ) -> Result<Response<SendMessageResponse>, Status> {
        let hints = self.hints(request.metadata())?;
        let accepted = match request.into_inner().message {
            Some(message) => self.synapse.accept(message, &hints).await,
            None => Err(Status::invalid_argument("message is required")),
        };
        // A message that cannot be taken as it is is malformed input, as a bad frame is.
        let id = accepted.inspect_err(|status| {
            if status.code() == tonic::Code::InvalidArgument {
                crate::telemetry::decode_error(crate::protocols::synapse::PROTOCOL);
            }
        })?;
        Ok(Response::new(SendMessageResponse {
            success: true,
            message_id: id,
            error: String::new(),
        }))
    }

    type StreamMessagesStream = MessageStream;

    async fn stream_messages(
        &self,
        request: Request<Streaming<SynapseMessage>>,
    ) -> Result<Response<Self::StreamMessagesStream>, Status> {
        self.open_stream(request, StreamKind::Messages).await
    }

    type ReceiveCallbackStream = MessageStream;

    /// Polling: every message kept for the calling agent, oldest first; then the stream ends.
    async fn receive_callback(
        &self,
        request: Request<()>,
    ) -> Result<Response<Self::ReceiveCallbackStream>, Status> {
        let hints = self.hints(request.metadata())?;
        let agent = self.synapse.caller(&hints).await?.ok_or_else(|| {
            Status::invalid_argument(format!(
                "{AGENT_HEADER} metadata names the agent whose messages to fetch"
            ))
        })?;
        // Mail left for a later take (NATS did not answer) is kept again by the bridge's
        // settling of it (`UnsettledMail`), for a later call.
        let messages: Vec<Result<SynapseMessage, Status>> = self
            .synapse
            .take_inbox(&agent)
            .await?
            .taken
            .into_iter()
            .map(|taken| Ok(taken.message))
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(messages))))
    }
}
