//! What a reading of the stream applies first: what the consumer was given and neither
//! acknowledged nor routed here (`Applier::apply_unacknowledged`), read again from the
//! stream rather than waited for from JetStream.

use super::{Applier, BATCH, Delivered};
use crate::core::{HeldBy, Outstanding};
use crate::federation::acks::{Acks, Last, ack_subject};
use crate::federation::link::Ready;
use crate::federation::stretch::{READ_AGAIN_AT_MOST, Stretch, start_after};
use crate::federation::wire::Names;
use crate::federation::written::Written;

impl Applier {
    /// Applies what the consumer was given and neither acknowledged nor routed here: what a
    /// run killed had taken in, or a reading that failed had fetched ahead. JetStream gives
    /// it again only after `ack_wait`, and acknowledging what follows first would
    /// acknowledge it too (`AckPolicy::All`), so it would never be applied. Read again in
    /// order, each message passed over where this bridge holds it already, and routed once
    /// kept, as the consumer's are: mail for the agents away (all of them, after a
    /// restart), history for replays; what the last run had written to a connection is
    /// sent again. Waited for until written, as a batch is before its acknowledgement;
    /// then acknowledged, after the batches this run queued before (`Acks`): while
    /// `max_ack_pending` deliveries wait, as a run killed under load leaves them, JetStream
    /// delivers nothing new until their `ack_wait` runs out.
    pub(super) async fn apply_unacknowledged(
        &self,
        ready: &Ready,
        acks: &Acks,
    ) -> Result<Delivered, async_nats::Error> {
        let mut stream = ready.js.get_stream(&self.link.names.stream).await?;
        let consumer = Names::consumer_of(&self.link.bridge_id);
        let info = stream.consumer_info(&consumer).await?;
        let delivered_before =
            *(self.delivered_before.lock()).get_or_insert(info.delivered.stream_sequence);
        let routed = self.link.routed.now().sequence;
        // Not before the stream's first message (what its limits dropped is not there, and
        // counts as routed: a stream whose every message was dropped is read to its end).
        // Read after the consumer's, so that it ends past every delivery the consumer's
        // info counts (one served meanwhile to a pull request left over included).
        let state = stream.info().await?.state.clone();
        self.link
            .routed
            .up_to(state.first_sequence.saturating_sub(1));
        let left = ready.unwritten.left_by_last_run();
        let after = read_again_after(info.ack_floor.stream_sequence, left);
        if let Some(left) = left
            && after > left.saturating_sub(1)
        {
            let skipped = after - left.saturating_sub(1);
            tracing::warn!(
                skipped,
                "federation: the last run left more unwritten than is read again"
            );
        }
        let first = (after.max(routed) + 1).max(state.first_sequence);
        let last = info.delivered.stream_sequence.min(state.last_sequence);
        let delivered = Delivered(info.delivered.consumer_sequence);
        if first > last {
            ready.unwritten.read_again();
            self.left_undelivered.read_again();
            return Ok(delivered);
        }
        let (outstanding, routed) = Outstanding::naming();
        let mut own = Vec::new();
        let between = (first, last, delivered_before);
        let read = (self.apply_between(&stream, between, &outstanding, &mut own)).await;
        // Waited for also when the reading failed: what was routed is not acknowledged
        // (by the next reading's first acknowledgement) before it is written.
        drop(outstanding);
        let written = Written { routed, own };
        // Carried on in this run's heartbeats if it is late, as the last run's floor was;
        // named in them meanwhile, as a batch routed is, up to where it was routed (a
        // failed reading stops short).
        let routed_to = self.link.routed.now().sequence.min(last);
        if routed_to >= first {
            ready.unwritten.routed(first, routed_to, written.clone());
        }
        let now = tokio::time::Instant::now();
        ready
            .unwritten
            .written_or_carried((ready.unwritten.numbering(), first), written, now)
            .await;
        read?;
        ready.unwritten.read_again();
        self.left_undelivered.read_again();
        let pending = info.num_ack_pending;
        if pending > 0 && last == info.delivered.stream_sequence {
            let subject = ack_subject(&self.link.names.stream, &consumer, &info.delivered);
            let client = ready.js.client();
            acks.ack(
                first..=last,
                Last::Delivery { client, subject },
                Written::nothing(),
            );
        }
        tracing::info!(
            first,
            last,
            pending,
            "federation: applied what the stream's consumer was given and not acknowledged"
        );
        Ok(delivered)
    }

    /// Reads the stream from `first` to `last` and applies it, offering `outstanding`; adds
    /// to `own` what this run's own messages read wait for. What the consumer had delivered
    /// before this run (up to `delivered_before`) is routed again; the rest this run never
    /// routed.
    async fn apply_between(
        &self,
        stream: &async_nats::jetstream::stream::Stream,
        (first, last, delivered_before): (u64, u64, u64),
        outstanding: &Outstanding,
        own: &mut Vec<HeldBy>,
    ) -> Result<(), async_nats::Error> {
        let mut stretch = Stretch::from(stream, first).await?;
        let mut read_to = first - 1;
        while read_to < last {
            let mut batch = Vec::new();
            while batch.len() < BATCH && read_to < last {
                let message;
                (read_to, message) = stretch.next().await?;
                // Past a gap (messages removed): the consumer gives the rest.
                if read_to > last {
                    break;
                }
                batch.push(message);
            }
            let mut replicas = self.replicas_of(&batch, delivered_before);
            own.append(&mut replicas.own);
            let written = self.apply(replicas).await.await;
            self.route(written, outstanding);
            self.link.routed.up_to(read_to.min(last));
        }
        Ok(())
    }
}

/// What a reading of the stream takes for routed before, given the consumer's
/// acknowledgement floor and the floor the last run's heartbeat carried: read again from
/// the older, at most `READ_AGAIN_AT_MOST` messages before the acknowledgement floor.
pub(super) fn read_again_after(ack_floor: u64, left_by_last_run: Option<u64>) -> u64 {
    start_after(ack_floor, [left_by_last_run]).max(ack_floor.saturating_sub(READ_AGAIN_AT_MOST))
}
