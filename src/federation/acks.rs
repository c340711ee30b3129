//! Acknowledging what the applier routed: a batch of the stream is acknowledged, and with
//! it every batch before (`AckPolicy::All`), only once the deliveries it made here for
//! agents whose mail the fleet keeps were written or kept, so that a bridge killed before
//! leaves them in the stretch the other bridges read again (`missed_mail`).

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_nats::jetstream::consumer::SequenceInfo;
use tokio_util::sync::CancellationToken;

use super::unwritten::{Numbering, UnwrittenFloor};
use super::written::Written;

/// A routed batch waiting for its acknowledgement.
struct ToAcknowledge {
    /// The stream sequences of its first and last messages, and their numbering.
    sequences: RangeInclusive<u64>,
    numbering: Numbering,
    /// The consumer that delivered it (`Acks::consumer_made_again`).
    consumer: u64,
    last: Last,
    written: Written,
    at: tokio::time::Instant,
}

/// What acknowledges a batch, and with it every batch before (`AckPolicy::All`).
pub(super) enum Last {
    /// The batch's last message (boxed: it is several times the size of the other).
    Message(Box<async_nats::jetstream::Message>),
    /// The consumer's last delivery, made to an earlier reading or run and read again from
    /// the stream (`Applier::apply_unacknowledged`): its acknowledgement subject
    /// (`ack_subject`), on this client.
    Delivery {
        client: async_nats::Client,
        subject: String,
    },
}

impl Last {
    async fn ack(self) -> Result<(), async_nats::Error> {
        match self {
            Last::Message(message) => message.ack().await,
            Last::Delivery { client, subject } => {
                Ok(client.publish(subject, bytes::Bytes::new()).await?)
            }
        }
    }
}

/// The subject acknowledging the consumer's delivery `delivered`, as JetStream names it in
/// the delivery's reply (`$JS.ACK.<stream>.<consumer>.<times delivered>.<stream
/// sequence>.<consumer sequence>.<time>.<pending>`). Under `AckPolicy::All` the server
/// reads only the two sequences from it and acknowledges every delivery up to them; the
/// other tokens are given as 1 and 0. (NATS 2.14's consumer reset would move the
/// acknowledgement floor too, but refuses a consumer made with `DeliverPolicy::New`.)
pub(super) fn ack_subject(stream: &str, consumer: &str, delivered: &SequenceInfo) -> String {
    let (stream_seq, consumer_seq) = (delivered.stream_sequence, delivered.consumer_sequence);
    format!("$JS.ACK.{stream}.{consumer}.1.{stream_seq}.{consumer_seq}.0.0")
}

/// Acknowledges routed batches, one after another in stream order, each once what it
/// routed here for agents whose mail the fleet keeps (Grid programs, Synapse agents) was
/// written to their connections or kept (`Outstanding`): a bridge killed before has the
/// batch in the stretch the others read again (`missed_mail`) and keep for its agents,
/// rather than lose what waited in a mailbox. Meanwhile the applier routes on; a slow
/// client holds back acknowledgements, not routing. A batch acknowledged unwritten, past
/// `WRITTEN_WITHIN`, is late: it is acknowledged once the heartbeat and the floors record
/// carry it, and the store where it keeps the floor (`UnwrittenFloor`), so that the stretch
/// read again for a killed bridge starts there.
pub(super) struct Acks {
    queued: tokio::sync::mpsc::UnboundedSender<ToAcknowledge>,
    /// Where the batches routed are named until they are written (`UnwrittenFloor::routed`).
    unwritten: Arc<UnwrittenFloor>,
    /// The stream sequence acknowledged up to, by this run or before it (`acknowledged`).
    through: Arc<AtomicU64>,
    /// Counts the consumers made again this run (`consumer_made_again`).
    consumer: Arc<AtomicU64>,
    /// Held from a batch's check of its consumer until its acknowledgement is on its way,
    /// and while the count goes up: an acknowledgement for the old consumer goes out
    /// before the request that makes the new one, on the same connection, and so finds no
    /// consumer of that name.
    acknowledging: Arc<tokio::sync::Mutex<()>>,
}

impl Acks {
    /// The task that acknowledges what is queued, until the queue is dropped or the bridge
    /// shuts down. Nothing is acknowledged once it does: what a shutdown dropped (a
    /// mailbox's contents, a callback) stays in the stretch the others read again.
    pub(super) fn start(unwritten: Arc<UnwrittenFloor>, shutdown: CancellationToken) -> Acks {
        let (queued, mut to_ack) = tokio::sync::mpsc::unbounded_channel::<ToAcknowledge>();
        let (through, consumer) = (Arc::<AtomicU64>::default(), Arc::<AtomicU64>::default());
        let (acknowledged, current) = (through.clone(), consumer.clone());
        let acknowledging = Arc::new(tokio::sync::Mutex::new(()));
        let gate = acknowledging.clone();
        let floor = unwritten.clone();
        tokio::spawn(async move {
            while let Some(ToAcknowledge {
                sequences,
                numbering,
                consumer,
                last,
                written,
                at,
            }) = to_ack.recv().await
            {
                let first = (numbering, *sequences.start());
                let written_or_carried = unwritten.written_or_carried(first, written, at);
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return,
                    () = written_or_carried => {}
                }
                // An acknowledgement meant for a consumer since made again would reach the
                // new one, of the same name, and move its floor of deliveries past where
                // its own are numbered: the new one delivers the batch again instead.
                let _acknowledging = gate.lock().await;
                if consumer != current.load(Ordering::Relaxed) {
                    continue;
                }
                match last.ack().await {
                    Ok(()) => _ = acknowledged.fetch_max(*sequences.end(), Ordering::Relaxed),
                    // Redelivered after `ack_wait`, and passed over as applied already.
                    Err(e) => {
                        tracing::debug!(error = %e, "federation: a batch was not acknowledged")
                    }
                }
            }
        });
        Acks {
            queued,
            unwritten: floor,
            through,
            consumer,
            acknowledging,
        }
    }

    /// Acknowledges the batch of the stream `sequences` hold, ending with `last`, once
    /// `written`. Batches come in stream order, routed, their holds let go by the router.
    pub(super) fn ack(&self, sequences: RangeInclusive<u64>, last: Last, written: Written) {
        let at = tokio::time::Instant::now();
        let (first, end) = (*sequences.start(), *sequences.end());
        self.unwritten.routed(first, end, written.clone());
        let _ = self.queued.send(ToAcknowledge {
            sequences,
            numbering: self.unwritten.numbering(),
            consumer: self.consumer.load(Ordering::Relaxed),
            last,
            written,
            at,
        });
    }

    /// The stream sequence acknowledged up to: what this run acknowledged, or the
    /// consumer's floor as a reading found it (`acknowledged_at_least`), or where a consumer
    /// made again starts (`consumer_made_again`).
    pub(super) fn acknowledged(&self) -> u64 {
        self.through.load(Ordering::Relaxed)
    }

    /// The consumer's acknowledgement floor is at least `floor`.
    pub(super) fn acknowledged_at_least(&self, floor: u64) {
        self.through.fetch_max(floor, Ordering::Relaxed);
    }

    /// The consumer was made again, `acknowledged` up to that stream sequence: the batches
    /// queued before, which the old one delivered, are waited for as before and not
    /// acknowledged.
    pub(super) async fn consumer_made_again(&self, acknowledged: u64) {
        let _acknowledging = self.acknowledging.lock().await;
        self.consumer.fetch_add(1, Ordering::Relaxed);
        self.through.store(acknowledged, Ordering::Relaxed);
    }
}
