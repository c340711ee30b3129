//! How messages from Synapse agents enter the bridge (`SendMessage`, the streams, the HTTP
//! callback ingest): checked, staged for the store and routed once durable, or refused
//! with a nack. An open stream is served in `stream.rs`.

use std::time::Duration;

use tonic::Status;

use super::agents::{Hints, not_stored};
use super::proto::{AgentEndpoint, MessageType, SynapseMessage, TransportMode};
use super::{PROTOCOL, Synapse, translate, wire};
use crate::core::BRIDGE_AGENT as BRIDGE_AGENT_ID;
use crate::core::{Delivery, Envelope, Staged, new_message_id, now_ms};
use crate::protocols::endpoint::Translation;

impl Synapse {
    /// The message as Synapse agents receive it, encoded once per message.
    pub fn encode(&self, delivery: &Delivery) -> Option<SynapseMessage> {
        delivery.encoded(PROTOCOL, |env| translate::Translator::encode(self, env))
    }

    /// The bridge as a Synapse endpoint.
    pub fn bridge_endpoint(&self) -> AgentEndpoint {
        AgentEndpoint {
            agent_id: BRIDGE_AGENT_ID.into(),
            agent_name: "agentbridge".into(),
            system_id: "agentbridge".into(),
            endpoint: String::new(),
            version: env!("CARGO_PKG_VERSION").into(),
        }
    }

    /// Accepts a message from a Synapse agent: checks it, registers its sender, applies
    /// group housekeeping, and publishes it. Returns the message id once it is durable (for
    /// a synchronous send, once the recipient's stream took it).
    pub async fn accept(&self, msg: SynapseMessage, hints: &Hints) -> Result<String, Status> {
        let (id, storing) = self.stage(msg, hints).await?;
        if let Some(staged) = storing {
            self.core.publish_staged(staged).await.map_err(not_stored)?;
        }
        Ok(id)
    }

    /// `accept` up to queuing the store write, for a stream that keeps reading while its
    /// earlier messages are written: the message id, and its store write when there is
    /// one to wait for (routed once durable). A heartbeat has none; a synchronous send is
    /// taken to its end here, answered only once its recipient took it.
    pub(super) async fn stage(
        &self,
        mut msg: SynapseMessage,
        hints: &Hints,
    ) -> Result<(String, Option<Staged>), Status> {
        let msg_type = MessageType::try_from(msg.r#type).map_err(|_| {
            Status::invalid_argument(format!("message.type: {} is not a MessageType", msg.r#type))
        })?;
        let mut sender = msg.sender.clone().unwrap_or_default();
        sender.agent_id = hints.agent_or_caller(sender.agent_id);
        if sender.agent_id.is_empty() {
            return Err(Status::invalid_argument(
                "message.sender.agent_id is required (or x-synapse-agent-id metadata)",
            ));
        }
        msg.sender = Some(sender.clone());
        if msg.id.is_empty() {
            msg.id = new_message_id();
        }
        match &msg.timestamp {
            None => msg.timestamp = Some(wire::timestamp(now_ms())),
            Some(ts) => wire::check_timestamp(ts)
                .map_err(|e| Status::invalid_argument(format!("message.timestamp: {e}")))?,
        }
        // A message the bridge could not relay as it came is refused now, while its sender
        // can still hear why, rather than lost on the way.
        let env = translate::Translator::decode(self, &msg)
            .map(|decoded| decoded.envelope)
            .map_err(|e| Status::invalid_argument(format!("message cannot be relayed: {e}")))?;
        self.ensure_agent(&sender, hints, "message.sender").await?;
        if msg_type == MessageType::Heartbeat {
            return Ok((msg.id, None));
        }

        // `decode` addressed the envelope to the receiver, if the message names one.
        let receiver = env.to.first().cloned();
        if !msg.group_id.is_empty() {
            self.group(&msg.group_id)?;
            let member = self.is_member(&msg.group_id, &sender.agent_id);
            match (msg_type, member) {
                // Boxed, as the synchronous send below: rare, and kilobytes of future
                // that every message's would otherwise carry.
                (MessageType::GroupJoin, false) => {
                    Box::pin(self.join_group(&msg.group_id, &sender, hints)).await?;
                }
                (MessageType::GroupLeave, true) => {
                    Box::pin(self.leave_group(&msg.group_id, &sender.agent_id)).await?;
                }
                (MessageType::GroupJoin | MessageType::GroupLeave, _) => {}
                (_, false) => {
                    return Err(Status::failed_precondition(format!(
                        "sender '{}' is not a member of group '{}'",
                        sender.agent_id, msg.group_id
                    )));
                }
                _ => {}
            }
        } else if let Some(receiver) = &receiver {
            if !self.core.directory.contains(receiver) {
                return Err(Status::not_found(format!(
                    "message.receiver.agent_id '{receiver}' is not a known agent"
                )));
            }
        } else if !matches!(
            msg_type,
            MessageType::Unspecified
                | MessageType::HilDecisionRequest
                | MessageType::GroupVoteResult
        ) {
            return Err(Status::invalid_argument(
                "message.receiver.agent_id (or message.group_id) is required",
            ));
        }

        if !self.sends_synchronously(receiver.as_deref(), hints) {
            return Ok((msg.id, Some(self.core.stage(env).await)));
        }
        Box::pin(self.send_synchronously(env, receiver)).await?;
        Ok((msg.id, None))
    }

    /// Sends `env` to `receiver` and waits until its stream took it.
    async fn send_synchronously(
        &self,
        env: Envelope,
        receiver: Option<String>,
    ) -> Result<(), Status> {
        let Some(receiver) = receiver else {
            return Err(Status::invalid_argument(
                "a synchronous send needs message.receiver.agent_id",
            ));
        };
        if !self.core.router.is_connected(&receiver) {
            return Err(Status::unavailable(format!(
                "receiver '{receiver}' has no open connection to deliver to synchronously"
            )));
        }
        let delivery = self.core.publish(env).await.map_err(not_stored)?;
        let timeout = Duration::from_millis(self.config.sync_timeout_ms);
        tokio::time::timeout(timeout, delivery.written())
            .await
            .map_err(|_| {
                Status::unavailable(format!(
                    "receiver '{receiver}' did not take the message within {} ms",
                    timeout.as_millis()
                ))
            })?;
        Ok(())
    }

    /// Whether a message to `receiver` is delivered synchronously: the sender is answered
    /// once the receiver's stream took it.
    pub(super) fn sends_synchronously(&self, receiver: Option<&str>, hints: &Hints) -> bool {
        hints.transport == Some(TransportMode::Sync)
            || receiver.is_some_and(|r| {
                self.reach(r).0 == TransportMode::Sync && self.agents.contains_key(r)
            })
    }

    /// A `P2P_NACK` from the bridge answering `msg`, carrying why it was refused.
    pub fn nack(&self, msg: &SynapseMessage, why: &Status) -> SynapseMessage {
        let mut nack = translate::ack(msg, self.bridge_endpoint());
        nack.r#type = MessageType::P2pNack as i32;
        nack.payload = Some(wire::text(&format!("{:?}: {}", why.code(), why.message())));
        nack
    }
}
