//! A fleet bridge lets clients in once it has read its stream again up to where the stream
//! ended as it was set up (`shared::doors`): what its earlier run accepted and had not
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
        let ready = loop {
            match link.set_up() {
                Some(ready) => break ready,
                None => tokio::time::sleep(LOOK_AGAIN_AFTER).await,
            }
        };
        // Unknown (NATS gone again): nothing is waited for.
        let Ok(mut stream) = ready.js.get_stream(&link.names.stream).await else {
            return;
        };
        let Ok(info) = stream.info().await else {
            return;
        };
        let end = info.state.last_sequence;
        let _ = routed.wait_for(|routed| *routed >= end).await;
    };
    tokio::select! {
        _ = shutdown.cancelled() => return,
        _ = tokio::time::timeout(CAUGHT_UP_WITHIN, caught_up) => {}
    }
    link.doors().open();
}
