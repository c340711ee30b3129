//! A fleet bridge lets clients in once it has read its stream again up to where the stream
//! ended as it was set up (`shared::latch`): what its earlier run accepted and had not
//! delivered is routed again as its consumer reads it, and a client let in before could
//! be sent, or send, something that overtakes it. Set-up and reading are bounded by
//! `CAUGHT_UP_WITHIN`, counted from when every endpoint listens (loading their stores
//! comes first, and routes nothing): a bridge that cannot reach NATS as it starts still
//! serves its own agents after that.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::link::NatsLink;
use super::routed::Place;

/// The longest clients wait for a starting bridge to read its stream again.
const CAUGHT_UP_WITHIN: Duration = Duration::from_secs(10);

/// How often a starting bridge looks whether its stream and buckets are set up.
const LOOK_AGAIN_AFTER: Duration = Duration::from_millis(20);

/// How soon a starting bridge asks again where its stream ends, after NATS did not answer.
const ASK_AGAIN_AFTER: Duration = Duration::from_millis(100);

/// Opens the bridge's doors once what the stream held as the bridge was set up is routed
/// (`NatsLink::routed`), or `CAUGHT_UP_WITHIN` after every endpoint listens.
pub async fn open_once_caught_up(link: Arc<NatsLink>, shutdown: CancellationToken) {
    let caught_up = async {
        let ready = loop {
            match link.set_up() {
                Some(ready) => break ready,
                None => tokio::time::sleep(LOOK_AGAIN_AFTER).await,
            }
        };
        // Asked again while NATS does not answer (a stream electing its leader as the
        // fleet restarts): within the bound, not given up at the first failure.
        let end = loop {
            match ready.js.get_stream(&link.names.stream).await {
                Ok(stream) => break Place::end_of(stream.cached_info()),
                Err(e) => {
                    tracing::debug!(error = %e, "federation: asking again where the stream ends");
                    tokio::time::sleep(ASK_AGAIN_AFTER).await;
                }
            }
        };
        link.routed.reached(end).await
    };
    let listening = link.clone();
    let caught_up = async move {
        listening.endpoints_listening().await;
        tokio::time::timeout(CAUGHT_UP_WITHIN, caught_up).await
    };
    let caught_up = tokio::select! {
        _ = shutdown.cancelled() => return,
        caught_up = caught_up => caught_up,
    };
    if caught_up.is_err() {
        tracing::warn!(
            within = ?CAUGHT_UP_WITHIN,
            "federation: letting clients in before the stream is read again; what the last run left for them may come after newer messages"
        );
    }
    link.open_doors();
}
