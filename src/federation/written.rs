//! What tells that the deliveries a batch of the stream made here are done, which its
//! acknowledgement waits for (`acks`) and a late batch is carried in heartbeats until
//! (`unwritten`).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::telemetry;

/// How long an acknowledgement waits for the batch's deliveries to be written: past this,
/// the batch is late, and acknowledged once the heartbeat carries where it starts
/// (`UnwrittenFloor`). Well within the consumer's `ack_wait`, and short enough that a slow
/// reader does not hold back applying once `max_ack_pending` messages of the stream wait.
pub(super) const WRITTEN_WITHIN: Duration = Duration::from_secs(5);

/// What tells that a batch's deliveries here are done: written, kept or dropped.
#[derive(Clone)]
pub(super) struct Written {
    /// Cancelled once every delivery the batch made that took up its hold is done.
    pub(super) routed: CancellationToken,
    /// Cancelled once each of this run's own messages the batch carries is done.
    pub(super) own: Vec<CancellationToken>,
}

impl Written {
    /// Nothing to wait for.
    pub(super) fn nothing() -> Written {
        let routed = CancellationToken::new();
        routed.cancel();
        Written {
            routed,
            own: Vec::new(),
        }
    }

    /// Whether every delivery it waits for is done.
    pub(super) fn is_done(&self) -> bool {
        self.routed.is_cancelled() && self.own.iter().all(|own| own.is_cancelled())
    }

    async fn done(&self) {
        self.routed.cancelled().await;
        for own in &self.own {
            own.cancelled().await;
        }
    }

    /// Waits until done, at most until `by`; whether it was.
    pub(super) async fn done_by(&self, by: tokio::time::Instant) -> bool {
        let done = tokio::time::timeout_at(by, self.done()).await.is_ok();
        if !done {
            telemetry::federation_acknowledged_unwritten();
        }
        done
    }
}
