//! A fleet bridge lets clients in once it has read its stream again up to where the stream
//! ended as it was set up (`shared::latch`): what its earlier run accepted and had not
//! delivered is routed again as its consumer reads it, and a client let in before could
//! be sent, or send, something that overtakes it. Set-up and reading are bounded by
//! `CAUGHT_UP_WITHIN`: a bridge that cannot reach NATS as it starts still serves its own
//! agents after that.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::link::NatsLink;

/// The longest clients wait for a starting bridge to read its stream again.
const CAUGHT_UP_WITHIN: Duration = Duration::from_secs(10);

/// How often a starting bridge looks whether its stream and buckets are set up.
const LOOK_AGAIN_AFTER: Duration = Duration::from_millis(20);

/// Opens the bridge's doors once what the stream held as the bridge was set up is routed
/// (`routed`, the stream sequence routed up to), or after `CAUGHT_UP_WITHIN`.
pub async fn open_once_caught_up(
    link: Arc<NatsLink>,
    mut routed: tokio::sync::watch::Receiver<u64>,
    shutdown: CancellationToken,
) {
    let caught_up = async {
        // Whether it caught up (`false`: NATS could not tell where the stream ended).
        let ready = loop {
            match link.set_up() {
                Some(ready) => break ready,
                None => tokio::time::sleep(LOOK_AGAIN_AFTER).await,
            }
        };
        let Ok(mut stream) = ready.js.get_stream(&link.names.stream).await else {
            return false;
        };
        let Ok(info) = stream.info().await else {
            return false;
        };
        let end = info.state.last_sequence;
        routed.wait_for(|routed| *routed >= end).await.is_ok()
    };
    let caught_up = tokio::select! {
        _ = shutdown.cancelled() => return,
        caught_up = tokio::time::timeout(CAUGHT_UP_WITHIN, caught_up) => caught_up,
    };
    if !matches!(caught_up, Ok(true)) {
        tracing::warn!(
            within = ?CAUGHT_UP_WITHIN,
            "federation: letting clients in before the stream is read again; what the last run left for them may come after newer messages"
        );
    }
    link.open_doors();
}
