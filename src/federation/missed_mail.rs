//! Mail a bridge taken for gone was to keep and never saw. A bridge keeps the mail of the
//! absent agents it holds, and the others keep it only once they take that bridge for gone
//! (`Directory::keeps_mail_of`). What reached the stream in between — after the last batch
//! the gone bridge acknowledged, before the others took it for gone — would wait for it to
//! come back. So each bridge still here reads that stretch of the stream again, from the
//! gone bridge's consumer's acknowledgement floor to the stream's end, and keeps each
//! message for the agents the gone bridge held. Keeping is once fleet-wide (a kept
//! message's record key is used once), so every bridge doing this, and the gone bridge
//! applying the same messages if it restarts, keep one copy between them. What the gone
//! bridge accepted itself is passed over: it routed that when it accepted it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use futures_util::StreamExt;

use super::link::{NatsLink, Ready};
use super::wire::{Names, Replica};
use crate::core::{Core, Delivery};

/// The longest wait for the next message of the stretch before giving up on it.
const NEXT_WITHIN: Duration = Duration::from_secs(10);

/// Keeps, for the agents `bridge` held, the mail it did not apply before it was taken for
/// gone; then releases what the router held back for them. Logs what it could not read.
pub async fn keep(link: Arc<NatsLink>, ready: Arc<Ready>, core: Arc<Core>, bridge: String) {
    let held = core.directory.held_by(&bridge);
    let read = match held.is_empty() {
        true => Ok(0),
        false => read_missed(&link, &ready, &core, &bridge, &held).await,
    };
    match read {
        Ok(0) => {}
        Ok(kept) => {
            tracing::info!(bridge = %bridge, kept, "federation: kept the mail a gone bridge missed")
        }
        Err(e) => {
            tracing::warn!(bridge = %bridge, error = %e, "federation: cannot read the mail a gone bridge missed")
        }
    }
    core.router.release_mail_of(&bridge);
}

/// Reads the stream from after `bridge`'s acknowledgement floor to its end now; how many
/// copies were kept.
async fn read_missed(
    link: &NatsLink,
    ready: &Ready,
    core: &Core,
    bridge: &str,
    held: &HashSet<String>,
) -> Result<usize, async_nats::Error> {
    let mut stream = ready.js.get_stream(&link.names.stream).await?;
    let floor = (stream.consumer_info(Names::consumer_of(bridge)).await?)
        .ack_floor
        .stream_sequence;
    let last = stream.info().await?.state.last_sequence;
    if floor >= last {
        return Ok(0);
    }
    let consumer = stream
        .create_consumer(pull::OrderedConfig {
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: floor + 1,
            },
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let its_own = link.names.messages_of(bridge);
    let mut kept = 0;
    loop {
        let message = match tokio::time::timeout(NEXT_WITHIN, messages.next()).await {
            Ok(Some(message)) => message?,
            Ok(None) => return Err("the stream ended early".into()),
            Err(_) => return Err("the stream stopped sending".into()),
        };
        let sequence = message.info()?.stream_sequence;
        if message.subject.as_str() != its_own {
            for replica in Replica::all_in(&message.payload)? {
                if replica.transient || replica.envelope.kind.is_presence() {
                    continue;
                }
                let delivery = Arc::new(Delivery::new(replica.envelope));
                kept += core.router.keep_for(&delivery, held);
            }
        }
        if sequence >= last {
            return Ok(kept);
        }
    }
}
