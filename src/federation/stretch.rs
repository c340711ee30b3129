//! A stretch of the fleet's stream read again, in order, from a sequence on, through an
//! ordered consumer of its own: the stretch a gone bridge missed (`missed_mail`), and the
//! one a bridge's own consumer was given and did not acknowledge (`apply`).

use std::time::Duration;

use async_nats::jetstream::Message;
use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::stream::Stream;
use futures_util::StreamExt;

/// How far back a stretch read again for a bridge reaches at most (`missed_mail` counts
/// from the stream's end, a restarted bridge from its acknowledgement floor): a floor
/// further back is cut, and that is logged.
pub const READ_AGAIN_AT_MOST: u64 = 200_000;

/// The stream sequence a stretch read again for a bridge starts after: its consumer's
/// acknowledgement floor, or the one before the oldest floor of what it acknowledged
/// unwritten (`UnwrittenFloor`), if older.
pub fn start_after(ack_floor: u64, unwritten_from: impl IntoIterator<Item = Option<u64>>) -> u64 {
    (unwritten_from.into_iter().flatten())
        .fold(ack_floor, |after, from| after.min(from.saturating_sub(1)))
}

/// The longest wait for the next message before the reading is given up.
const NEXT_WITHIN: Duration = Duration::from_secs(10);

pub struct Stretch {
    messages: pull::Ordered,
}

impl Stretch {
    /// `stream`'s messages from sequence `first` on.
    pub async fn from(stream: &Stream, first: u64) -> Result<Stretch, async_nats::Error> {
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: first,
                },
                ..Default::default()
            })
            .await?;
        let messages = consumer.messages().await?;
        Ok(Stretch { messages })
    }

    /// The next message and its sequence in the stream; an error when the stream ends, or
    /// sends nothing for `NEXT_WITHIN`.
    pub async fn next(&mut self) -> Result<(u64, Message), async_nats::Error> {
        let message = match tokio::time::timeout(NEXT_WITHIN, self.messages.next()).await {
            Ok(Some(Ok(message))) => message,
            Ok(Some(Err(e))) => return Err(e.into()),
            Ok(None) => return Err("the stream ended early".into()),
            Err(_) => return Err("the stream stopped sending".into()),
        };
        let sequence = message.info()?.stream_sequence;
        Ok((sequence, message))
    }
}
