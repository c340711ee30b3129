//! Applies the other bridges' messages, in the stream's order: each is kept in this
//! bridge's store (a materialised view of the fleet's log, so history and replays read
//! locally) and routed to the agents and hubs here. A message is applied once: the
//! consumer is durable (a restarted bridge resumes where it acknowledged), and an id
//! already kept here is passed over, since JetStream redelivers what was not acknowledged.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;

use super::link::{NatsLink, Ready};
use super::wire::{BRIDGE_HEADER, Replica};
use crate::core::{Core, Envelope, Kind, MessageLog, Status, now_ms};
use crate::telemetry;

/// Messages taken from the stream and applied together: one read of the store finds the
/// ones already kept, and their writes commit together.
const BATCH: usize = 256;

pub struct Applier {
    pub link: Arc<NatsLink>,
    pub core: Arc<Core>,
    /// The bridge's own store (not the fleet log: nothing applied is published again).
    pub local: Arc<dyn MessageLog>,
}

impl Applier {
    pub async fn run(self, ready: Arc<Ready>, shutdown: CancellationToken) {
        let mut delay = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            match self.consume(&ready, &shutdown).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "federation: reading the stream failed; again shortly")
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    async fn consume(
        &self,
        ready: &Ready,
        shutdown: &CancellationToken,
    ) -> Result<(), async_nats::Error> {
        let mut messages = ready.consumer.messages().await?;
        loop {
            let first = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                next = messages.next() => match next {
                    Some(message) => message?,
                    None => return Err("the stream's consumer ended".into()),
                },
            };
            let mut batch = vec![first];
            while batch.len() < BATCH
                && let Some(Some(Ok(message))) = messages.next().now_or_never()
            {
                batch.push(message);
            }
            self.apply(&batch).await;
            // Acknowledging the last acknowledges the batch (`AckPolicy::All`).
            if let Some(last) = batch.last() {
                last.ack().await?;
            }
        }
    }

    async fn apply(&self, batch: &[async_nats::jetstream::Message]) {
        let own = self.link.bridge_id.as_str();
        let mut replicas = Vec::with_capacity(batch.len());
        for message in batch {
            let from_here = (message.headers.as_ref())
                .and_then(|h| h.get(BRIDGE_HEADER))
                .is_some_and(|b| b.as_str() == own);
            if from_here {
                continue;
            }
            match serde_json::from_slice::<Replica>(&message.payload) {
                // Passed through here already (a redelivery this bridge remembers).
                Ok(replica)
                    if !replica.transient && self.core.recently_seen(&replica.envelope.id) => {}
                Ok(replica) => replicas.push(replica),
                Err(e) => {
                    tracing::error!(error = %e, subject = %message.subject, "federation: a message on the stream is not one of ours")
                }
            }
        }
        // Ids this bridge already keeps: a redelivery after a restart.
        let unknown: Vec<String> = (replicas.iter())
            .filter(|r| !r.transient)
            .map(|r| r.envelope.id.clone())
            .collect();
        let kept: HashSet<String> = match self.local.read_ids(unknown).await {
            Ok(found) => found.into_iter().map(|m| m.envelope.id).collect(),
            Err(e) => {
                tracing::error!(error = %e, "federation: cannot read the store");
                HashSet::new()
            }
        };
        let mut writes = Vec::new();
        let mut routed: Vec<(Envelope, bool)> = Vec::new();
        for replica in replicas {
            let Replica {
                envelope,
                agent,
                transient,
            } = replica;
            if !transient && kept.contains(&envelope.id) {
                continue;
            }
            if let Some(info) = agent.and_then(|card| card.into_info()) {
                self.core.directory.register_replica(info);
            }
            self.presence(&envelope);
            telemetry::federation_applied((now_ms() - envelope.timestamp).max(0));
            if !transient {
                writes.push(self.local.append(&envelope));
            }
            routed.push((envelope, !transient));
        }
        // In the order they were queued: one result for each message to keep.
        let mut written = futures_util::future::join_all(writes).await.into_iter();
        for (envelope, to_keep) in routed {
            let kept = to_keep
                && match written.next() {
                    Some(Ok(())) => true,
                    Some(Err(e)) => {
                        tracing::error!(error = %e, "federation: cannot keep a message from another bridge");
                        false
                    }
                    None => false,
                };
            self.core.accept_replica(envelope, kept);
        }
    }

    /// A presence change of an agent another bridge holds, as the directory here shows it.
    fn presence(&self, env: &Envelope) {
        let status = || {
            (env.data.as_ref())
                .and_then(|d| d.get("status"))
                .and_then(|s| s.as_str())
                .and_then(Status::parse)
        };
        let directory = &self.core.directory;
        if !directory.held_elsewhere(&env.from) {
            return;
        }
        match env.kind {
            Kind::PresenceJoin | Kind::PresenceStatus => {
                directory.set_presence(&env.from, true, status().unwrap_or(Status::Online));
            }
            Kind::PresenceLeave => {
                directory.set_presence(&env.from, false, Status::Offline);
            }
            _ => {}
        }
    }
}
