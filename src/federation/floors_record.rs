//! This bridge's floors record: the floors its heartbeats carry (`UnwrittenFloor`), put
//! whenever they changed, at most every `RECORD_EVERY`, in a bucket nobody watches. A
//! bridge taking this one for gone reads it (`missed_mail`) and goes by it when it is
//! later than the heartbeat: what this bridge routed after the floors the others go by is
//! kept again for every agent it held, so a kill sends again about `RECORD_EVERY`'s worth
//! of its traffic rather than a heartbeat's.

use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::link::{NatsLink, Ready, put_started};
use super::unwritten::{Carrier, RECORD_EVERY};
use crate::shared::pace::Pace;

/// Working the floors out goes over every batch not yet written, under the lock the
/// applier takes as it routes each batch: the next put waits twenty times as long as that
/// took, if that is longer than `RECORD_EVERY`, so that a long backlog (a reader stuck for
/// seconds) costs that lock a small share of its time.
const PACE: Pace = Pace {
    every: RECORD_EVERY,
    times: 20,
};

/// Puts the floors record whenever the floors changed, or a late batch waits for it, until
/// shutdown. A put that fails is tried again at the next turn.
pub async fn keep_put(link: Arc<NatsLink>, ready: Arc<Ready>, shutdown: CancellationToken) {
    loop {
        let began = Instant::now();
        let put = ready.unwritten.start_put_if_changed(Carrier::Record);
        let next = PACE.next_after(began);
        if let Some(put) = put
            && let Err(e) = put_started(&link, &ready.floors, put, false).await
        {
            tracing::debug!(error = %e, "federation: floors record not put");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            () = tokio::time::sleep_until(next) => {}
            () = ready.unwritten.wanted(Carrier::Record) => {}
        }
    }
}
