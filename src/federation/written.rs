//! What tells that the deliveries a batch of the stream made here are done, which its
//! acknowledgement waits for (`acks`) and a late batch is carried in heartbeats and the
//! floors record until (`unwritten`).

use std::time::Duration;

use crate::core::HeldBy;
use crate::telemetry;

/// How long an acknowledgement waits for the batch's deliveries to be written: past this,
/// the batch is late, and acknowledged once the heartbeat and the floors record carry
/// where it starts (`UnwrittenFloor`). Well within the consumer's `ack_wait`, and short
/// enough that a slow reader does not hold back applying once `max_ack_pending` messages
/// of the stream wait.
pub(super) const WRITTEN_WITHIN: Duration = Duration::from_secs(5);

/// What tells that a batch's deliveries here are done: written, kept or dropped.
#[derive(Clone)]
pub(super) struct Written {
    /// Done once every delivery the batch made that took up its hold is done.
    pub(super) routed: HeldBy,
    /// Done once each of this run's own messages the batch carries is done.
    pub(super) own: Vec<HeldBy>,
}

impl Written {
    /// Nothing to wait for.
    pub(super) fn nothing() -> Written {
        Written {
            routed: HeldBy::nothing(),
            own: Vec::new(),
        }
    }

    /// Whether every delivery it waits for is done.
    pub(super) fn is_done(&self) -> bool {
        self.routed.is_done() && self.own.iter().all(|own| own.is_done())
    }

    async fn done(&self) {
        self.routed.done().await;
        for own in &self.own {
            own.done().await;
        }
    }

    /// The agents whose deliveries are not yet done (`HeldBy::holders`); `None` if a
    /// delivery held for no named agent (a hub's) is not.
    pub(super) fn holders(&self) -> Option<Vec<String>> {
        let mut holders = Vec::new();
        for held_by in std::iter::once(&self.routed).chain(&self.own) {
            holders.extend(held_by.holders()?);
        }
        holders.sort_unstable();
        holders.dedup();
        Some(holders)
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
