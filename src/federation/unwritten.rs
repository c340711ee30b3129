//! Where this bridge's deliveries not yet written begin, for a bridge killed after it
//! acknowledged them. A batch of the stream is acknowledged once its deliveries here were
//! written, but no later than `WRITTEN_WITHIN` (`acks`), so that one slow reader does not
//! hold back applying; a batch acknowledged unwritten is *late*, and the first stream
//! sequence of the oldest late batch not yet done (its *floor*) rides in every heartbeat
//! (`Heartbeat::unwritten_from`). A bridge taken for gone is read again from there by the
//! others (`missed_mail`), and by itself when it starts again while the bridges bucket
//! still holds its heartbeat (`Applier::apply_unacknowledged`), rather than from its
//! consumer's acknowledgement floor: what waited for a slow reader is kept or sent again,
//! not lost. A late batch waits, before its acknowledgement, for a heartbeat carrying a
//! floor at or before it to land with no put under way carrying a later one, or for its
//! deliveries to be written meanwhile; up to `CARRIED_WITHIN` more, after which it is
//! acknowledged all the same (and that is logged).

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::written::{WRITTEN_WITHIN, Written};

/// How long past `WRITTEN_WITHIN` a late batch waits for a heartbeat that carries it:
/// after that (NATS away, heartbeats failing) it is acknowledged all the same, so that
/// applying goes on. Counted from when the batch was queued, so that batches late at once
/// wait out one such stretch between them, not one each.
pub(super) const CARRIED_WITHIN: Duration = Duration::from_secs(2);

/// How long a wait for a heartbeat lets a put that failed rest before it asks for another.
const AFTER_A_FAILED_PUT: Duration = Duration::from_millis(200);

/// A floor as a heartbeat carries it: `None` for none.
type Floor = Option<u64>;

/// The late batches of this run, what the last run left, and the heartbeat puts that
/// carry their floor.
pub(super) struct UnwrittenFloor {
    state: Mutex<State>,
    /// Asks for a heartbeat now: a late batch waits for one that carries it.
    wanted: Notify,
    /// Changed as each heartbeat put ends.
    ended: watch::Sender<()>,
}

struct State {
    /// The floor the last run's heartbeat carried, until this run has read again from it.
    left_by_last_run: Floor,
    /// Late batches not yet found done: the first sequence of each, and what says it is
    /// done. Pushed by the acknowledgements and by a reading of the stream's unacknowledged
    /// stretch, so not in stream order.
    late: Vec<(u64, Written)>,
    /// The floor of the heartbeat put under way, if one is.
    in_flight: Option<Floor>,
    /// The floor the bridges bucket holds for this bridge, as far as it knows: `None` when
    /// none, or when a put failed and may or may not have landed.
    landed: Floor,
    /// Whether the last put failed.
    failed: bool,
}

/// Whether a heartbeat carrying `floor` covers a batch starting at `first`.
fn covers(floor: Floor, first: u64) -> bool {
    floor.is_some_and(|floor| floor <= first)
}

impl UnwrittenFloor {
    /// With the floor the last run's heartbeat carried, which the bridges bucket holds.
    pub(super) fn new(left_by_last_run: Floor) -> UnwrittenFloor {
        UnwrittenFloor {
            state: Mutex::new(State {
                left_by_last_run,
                late: Vec::new(),
                in_flight: None,
                landed: left_by_last_run,
                failed: false,
            }),
            wanted: Notify::new(),
            ended: watch::Sender::new(()),
        }
    }

    /// The floor the last run left, if this run has not read again from it yet.
    pub(super) fn left_by_last_run(&self) -> Floor {
        self.lock().left_by_last_run
    }

    /// This run has read again from the floor the last one left (and carries what of that
    /// was not written in time as late).
    pub(super) fn read_again(&self) {
        self.lock().left_by_last_run = None;
    }

    /// Waits, before the batch starting at `first` is acknowledged, until `written` says it
    /// is done, at most `WRITTEN_WITHIN` from `since`; past that the batch is late, and
    /// waits to be carried in the heartbeats (`carry`), at most `CARRIED_WITHIN` more.
    pub(super) async fn written_or_carried(&self, first: u64, written: Written, since: Instant) {
        if !written.done_by(since + WRITTEN_WITHIN).await {
            let by = since + WRITTEN_WITHIN + CARRIED_WITHIN;
            self.carry(first, written, by).await;
        }
    }

    /// Carries the batch starting at `first`, about to be acknowledged before `written`
    /// says it is done, in the heartbeats: waits until one carrying it has landed (asking
    /// for one), or it is done, at most until `by`; whether either came.
    pub(super) async fn carry(&self, first: u64, written: Written, by: Instant) -> bool {
        let mut ended = self.ended.subscribe();
        self.lock().late.push((first, written.clone()));
        let carried = async {
            while !self.is_carried(first) && !written.is_done() {
                if self.lock().failed {
                    tokio::time::sleep(AFTER_A_FAILED_PUT).await;
                }
                self.wanted.notify_one();
                // The sender is this floor's own: it outlives the wait.
                let _ = ended.changed().await;
            }
        };
        let carried = tokio::time::timeout_at(by, carried).await.is_ok();
        if !carried {
            tracing::warn!(
                first,
                "federation: a batch was acknowledged unwritten before a heartbeat carried it"
            );
        }
        carried
    }

    /// Whether the bucket holds a floor covering `first`, and the put under way does too.
    fn is_carried(&self, first: u64) -> bool {
        let state = self.lock();
        covers(state.landed, first) && state.in_flight.is_none_or(|floor| covers(floor, first))
    }

    /// Resolves once a late batch waits for a heartbeat.
    pub(super) async fn wanted(&self) {
        self.wanted.notified().await;
    }

    /// Starts a heartbeat put, carrying the oldest of the late batches not yet done and of
    /// what the last run left.
    pub(super) fn start_put(&self) -> PutUnderWay<'_> {
        let mut state = self.lock();
        state.late.retain(|(_, written)| !written.is_done());
        let late = state.late.iter().map(|(first, _)| *first).min();
        let floor = match (state.left_by_last_run, late) {
            (Some(left), Some(late)) => Some(left.min(late)),
            (left, late) => left.or(late),
        };
        state.in_flight = Some(floor);
        PutUnderWay {
            unwritten: self,
            carries: floor,
            landed: false,
        }
    }

    /// The put under way ended: it `landed`, or may not have.
    fn put_ended(&self, landed: bool) {
        let mut state = self.lock();
        if let Some(floor) = state.in_flight.take() {
            // A put that failed may have landed all the same: the bucket holds one floor
            // or the other, and a later batch is covered only by both.
            state.landed = match landed {
                true => floor,
                false if floor == state.landed => floor,
                false => None,
            };
            state.failed = !landed;
        }
        drop(state);
        self.ended.send_replace(());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A heartbeat put under way (`UnwrittenFloor::start_put`). Dropped before it is said to
/// have `landed` (failed, or given up half-way), it may or may not have.
pub(super) struct PutUnderWay<'a> {
    unwritten: &'a UnwrittenFloor,
    carries: Floor,
    landed: bool,
}

impl PutUnderWay<'_> {
    /// The floor the heartbeat carries.
    pub(super) fn carries(&self) -> Floor {
        self.carries
    }

    /// The put landed.
    pub(super) fn landed(mut self) {
        self.landed = true;
    }
}

impl Drop for PutUnderWay<'_> {
    fn drop(&mut self) {
        self.unwritten.put_ended(self.landed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// What a batch is done by, and the token that says so once cancelled.
    fn batch() -> (Written, tokio_util::sync::CancellationToken) {
        let routed = tokio_util::sync::CancellationToken::new();
        let written = Written {
            routed: routed.clone(),
            own: Vec::new(),
        };
        (written, routed)
    }

    fn in_ms(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    /// Puts heartbeats whenever asked, each landing.
    fn heartbeat(floor: Arc<UnwrittenFloor>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                floor.wanted().await;
                let put = floor.start_put();
                tokio::task::yield_now().await;
                put.landed();
            }
        })
    }

    #[tokio::test]
    async fn a_late_batch_waits_for_a_heartbeat_that_carries_it() {
        let floor = Arc::new(UnwrittenFloor::new(None));
        let beating = heartbeat(floor.clone());
        let (written, done) = batch();
        assert!(floor.carry(100, written, in_ms(5000)).await);
        assert_eq!(floor.start_put().carries(), Some(100));
        // Once done, the floor moves on.
        done.cancel();
        assert_eq!(floor.start_put().carries(), None);
        beating.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_batch_is_not_taken_for_carried_by_a_put_made_before_it() {
        let floor = UnwrittenFloor::new(None);
        let (older, older_done) = batch();
        // No one puts heartbeats: the first late batch waits in vain.
        assert!(!floor.carry(100, older, in_ms(10)).await);
        let put = floor.start_put();
        assert_eq!(put.carries(), Some(100));
        put.landed();
        // The older batch is done, and a put of no floor is under way as a newer batch
        // goes late: the bucket's floor covers it, the put under way does not.
        older_done.cancel();
        let put = floor.start_put();
        assert_eq!(put.carries(), None);
        let (newer, _newer_done) = batch();
        assert!(!floor.carry(200, newer, in_ms(10)).await);
        put.landed();
        let put = floor.start_put();
        assert_eq!(put.carries(), Some(200));
        put.landed();
        assert!(floor.is_carried(200));
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_batch_written_meanwhile_waits_for_no_heartbeat() {
        let floor = UnwrittenFloor::new(None);
        let (written, done) = batch();
        let by = in_ms(60_000);
        let carrying = floor.carry(100, written, by);
        tokio::pin!(carrying);
        assert!(futures_util::poll!(&mut carrying).is_pending());
        done.cancel();
        // Woken by the next put's end, whatever it carries.
        floor.start_put().landed();
        assert!(carrying.await);
        assert!(Instant::now() < by);
    }

    #[tokio::test(start_paused = true)]
    async fn a_put_that_failed_may_have_landed() {
        let floor = UnwrittenFloor::new(Some(50));
        assert!(floor.is_carried(60));
        let (written, done) = batch();
        assert!(floor.carry(60, written, Instant::now()).await);
        floor.read_again();
        done.cancel();
        // A put of no floor fails: the bucket may hold either.
        let put = floor.start_put();
        assert_eq!(put.carries(), None);
        drop(put);
        assert!(!floor.is_carried(70));
    }

    #[test]
    fn the_floor_is_the_oldest_of_what_the_last_run_left_and_what_is_late() {
        let floor = UnwrittenFloor::new(Some(300));
        let (newer, _newer_done) = batch();
        let (older, _older_done) = batch();
        // Late batches need not come in stream order.
        floor.lock().late.extend([(250, newer), (200, older)]);
        floor.start_put().landed();
        assert!(floor.is_carried(200) && !floor.is_carried(199));
        assert_eq!(floor.left_by_last_run(), Some(300));
        floor.read_again();
        assert_eq!(floor.start_put().carries(), Some(200));
    }
}
