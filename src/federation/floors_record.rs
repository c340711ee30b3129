//! This bridge's floors record: the floors its heartbeats carry (`UnwrittenFloor`), put
//! whenever they changed, at most every `RECORD_EVERY`, in a bucket nobody watches. A
//! bridge taking this one for gone reads it (`missed_mail`) and goes by it when it is
//! later than the heartbeat: what this bridge routed after the floors the others go by is
//! kept again for every agent it held, so a kill sends again about `RECORD_EVERY`'s worth
//! of its traffic rather than a heartbeat's.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::link::{NatsLink, Ready, put_started};
use super::unwritten::{Carrier, RECORD_EVERY};

/// Puts the floors record whenever the floors changed, or a late batch waits for it, until
/// shutdown. A put that fails is tried again at the next turn.
pub async fn keep_put(link: Arc<NatsLink>, ready: Arc<Ready>, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(RECORD_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = every.tick() => {}
            () = ready.unwritten.wanted(Carrier::Record) => {}
        }
        let Some(put) = ready.unwritten.start_put_if_changed(Carrier::Record) else {
            continue;
        };
        if let Err(e) = put_started(&link, &ready.floors, put, false).await {
            tracing::debug!(error = %e, "federation: floors record not put");
        }
    }
}
