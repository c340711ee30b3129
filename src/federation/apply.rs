//! Applies the other bridges' messages, in the stream's order: each is kept in this
//! bridge's store (a materialised view of the fleet's log, so history and replays read
//! locally) and routed to the agents and hubs here. A message is applied once: the
//! consumer is durable (a restarted bridge resumes where it acknowledged), and an id
//! already kept here is passed over, since JetStream redelivers what was not acknowledged.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::FuturesOrdered;
use futures_util::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;

use super::link::{NatsLink, Ready};
use super::wire::{BRIDGE_HEADER, Replica};
use crate::core::{Core, Envelope, Kind, MessageLog, Status, now_ms};
use crate::telemetry;

/// Messages taken from the stream and applied together.
const BATCH: usize = 256;

/// Applied batches whose store writes may be under way at once before the next waits.
const WRITING: usize = 16;

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
        // Applied batches whose store writes are under way, in stream order: the next
        // batch is applied meanwhile, and each is acknowledged once its writes and those of
        // every batch before it are done.
        let mut writing = FuturesOrdered::new();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                Some(last) = writing.next(), if !writing.is_empty() => {
                    // Acknowledging the last acknowledges the batch (`AckPolicy::All`).
                    let last: async_nats::jetstream::Message = last;
                    last.ack().await?;
                }
                next = messages.next(), if writing.len() < WRITING => {
                    let first = match next {
                        Some(message) => message?,
                        None => return Err("the stream's consumer ended".into()),
                    };
                    let mut batch = vec![first];
                    while batch.len() < BATCH
                        && let Some(Some(Ok(message))) = messages.next().now_or_never()
                    {
                        batch.push(message);
                    }
                    let written = self.apply(&batch).await;
                    let last = batch.pop().expect("a batch holds a message");
                    writing.push_back(async move {
                        written.await;
                        last
                    });
                }
            }
        }
    }

    /// Routes `batch`'s messages here and queues their writes to this bridge's store; the
    /// future that ends when the store holds them.
    async fn apply(
        &self,
        batch: &[async_nats::jetstream::Message],
    ) -> impl Future<Output = ()> + Send + 'static {
        let own = self.link.bridge_id.as_str();
        let mut replicas = Vec::with_capacity(batch.len());
        // Ids to look for in the store: those of messages delivered before (a redelivery
        // after a restart, or after an acknowledgement was lost), which it may hold.
        let mut redelivered = Vec::new();
        for message in batch {
            let from_here = (message.headers.as_ref())
                .and_then(|h| h.get(BRIDGE_HEADER))
                .is_some_and(|b| b.as_str() == own);
            if from_here {
                continue;
            }
            let again = message.info().is_ok_and(|info| info.delivered > 1);
            match Replica::all_in(&message.payload) {
                Ok(all) => {
                    for replica in all {
                        // Passed through here already (a redelivery this bridge remembers).
                        if !replica.transient && self.core.recently_seen(&replica.envelope.id) {
                            continue;
                        }
                        if again && !replica.transient {
                            redelivered.push(replica.envelope.id.clone());
                        }
                        replicas.push(replica);
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, subject = %message.subject, "federation: a message on the stream is not one of ours")
                }
            }
        }
        let kept: HashSet<String> = match redelivered.is_empty() {
            true => HashSet::new(),
            false => match self.local.read_ids(redelivered).await {
                Ok(found) => found.into_iter().map(|m| m.envelope.id).collect(),
                Err(e) => {
                    tracing::error!(error = %e, "federation: cannot read the store");
                    HashSet::new()
                }
            },
        };
        let mut writes = Vec::new();
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
                // Queued now, so that a read after the routing below finds it.
                writes.push(self.local.append(&envelope));
            }
            // Routed without waiting for this bridge's store: the stream holds the message
            // already. Until the store does, a full mailbox keeps it whole, not by its id.
            self.core.accept_replica(envelope, false);
        }
        async move {
            for written in futures_util::future::join_all(writes).await {
                if let Err(e) = written {
                    tracing::error!(error = %e, "federation: cannot keep a message from another bridge");
                }
            }
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
