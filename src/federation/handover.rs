//! Mail handed over as an agent moves between bridges. The bridge an agent left keeps what
//! it routes for the agent as mail (a Grid queue, a Synapse inbox: shared records) until it
//! applies the agent's join on its new bridge, in the stream's order; the new bridge sends
//! the agent live what it applies after the agent connected, and the join follows that in
//! the stream. So the mail the old bridge kept comes before what the new one sends live —
//! if the new bridge takes it only once it is there. Before it does, it asks the bridge the
//! agent left (a NATS request on `<prefix>.handover.<bridge>`), which answers once it no
//! longer keeps the agent's mail and what it kept is written, with the last revision it
//! wrote in each records table; the new bridge then waits for its own watches of those
//! tables to reach them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::link::NatsLink;
use crate::core::{Core, Revision};
use crate::telemetry;

/// How often a bridge asked for an agent's mail looks whether it still keeps it.
const LOOK_EVERY: Duration = Duration::from_millis(10);

/// How long a bridge waits for a moved agent's mail before it takes what it has: the bridge
/// asked may first have to apply a stretch of the stream and write the mail it kept from
/// it, one record write each, and meanwhile the agent's connection sends nothing.
const HANDED_OVER_WITHIN: Duration = Duration::from_secs(10);

/// Per records table, the last revision this bridge wrote and the last its watch applied.
#[derive(Default)]
pub struct RecordPositions {
    written: DashMap<String, Revision>,
    applied: DashMap<String, watch::Sender<Revision>>,
}

impl RecordPositions {
    pub fn wrote(&self, table: &str, revision: Revision) {
        let mut last = self.written.entry(table.to_owned()).or_default();
        *last = (*last).max(revision);
    }

    pub fn applied(&self, table: &str, revision: Revision) {
        if let Some(applied) = self.applied.get(table) {
            applied.send_if_modified(|last| {
                let newer = revision > *last;
                *last = (*last).max(revision);
                newer
            });
        }
    }

    /// `table` is followed here: its applied revision is kept from now on.
    pub fn follows(&self, table: &str) {
        (self.applied.entry(table.to_owned())).or_insert_with(|| watch::channel(0).0);
    }

    /// Waits until this bridge's watch of each followed table of `written` has applied its
    /// revision there; false when `deadline` came first.
    async fn wait_applied(&self, written: &HashMap<String, Revision>, deadline: Instant) -> bool {
        for (table, &revision) in written {
            let Some(mut applied) = self.applied.get(table).map(|a| a.subscribe()) else {
                continue; // not followed here
            };
            let reached = applied.wait_for(|&at| at >= revision);
            if !matches!(tokio::time::timeout_at(deadline, reached).await, Ok(Ok(_))) {
                return false;
            }
        }
        true
    }
}

/// Asks `bridge`, which held `agent` until it connected here, to hand its mail over, and
/// waits until this bridge's records hold what it kept — within `HANDED_OVER_WITHIN`.
pub async fn ask(link: &NatsLink, positions: &RecordPositions, agent: &str, bridge: &str) {
    let deadline = Instant::now() + HANDED_OVER_WITHIN;
    let subject = link.names.handover_of(bridge);
    let request = async_nats::Request::new()
        .payload(agent.to_owned().into())
        .timeout(Some(HANDED_OVER_WITHIN));
    let asked = link.client.send_request(subject, request);
    // No answer (NATS away, the bridge gone or too slow): the mail is taken as it is.
    let answer = match tokio::time::timeout_at(deadline, asked).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, agent, bridge, "federation: no hand-over of a moved agent's mail");
            return telemetry::federation_handover("unanswered");
        }
        Err(_) => {
            tracing::debug!(
                agent,
                bridge,
                "federation: no hand-over of a moved agent's mail in time"
            );
            return telemetry::federation_handover("unanswered");
        }
    };
    let Ok(written) = serde_json::from_slice::<HashMap<String, Revision>>(&answer.payload) else {
        return telemetry::federation_handover("unanswered");
    };
    if positions.wait_applied(&written, deadline).await {
        telemetry::federation_handover("handed_over");
    } else {
        tracing::debug!(
            agent,
            bridge,
            "federation: a moved agent's mail is taken before it all arrived"
        );
        telemetry::federation_handover("late");
    }
}

/// Answers this bridge's hand-over requests until `shutdown`.
pub async fn serve(
    link: Arc<NatsLink>,
    core: Arc<Core>,
    positions: Arc<RecordPositions>,
    shutdown: CancellationToken,
) {
    let subject = link.names.handover_of(&link.bridge_id);
    let mut requests = loop {
        match link.client.subscribe(subject.clone()).await {
            Ok(requests) => break requests,
            Err(e) => tracing::warn!(error = %e, "federation: cannot take hand-over requests yet"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    };
    loop {
        let request = tokio::select! {
            _ = shutdown.cancelled() => return,
            request = requests.next() => match request {
                Some(request) => request,
                None => return,
            },
        };
        let (Some(reply), Ok(agent)) = (request.reply, std::str::from_utf8(&request.payload))
        else {
            continue;
        };
        let agent = agent.to_owned();
        let (link, core, positions) = (link.clone(), core.clone(), positions.clone());
        tokio::spawn(async move {
            hand_over(&core, &agent, Instant::now() + HANDED_OVER_WITHIN).await;
            let written: HashMap<String, Revision> = (positions.written.iter())
                .map(|entry| (entry.key().clone(), *entry.value()))
                .collect();
            let answer = serde_json::to_vec(&written).unwrap_or_default();
            if let Err(e) = link.client.publish(reply, answer.into()).await {
                tracing::debug!(error = %e, agent, "federation: a hand-over answer was not sent");
            }
        });
    }
}

/// Ends once this bridge no longer keeps `agent`'s mail — it applied the agent's join on
/// another bridge — and every offline sink has kept what it was given before; or at
/// `deadline`.
async fn hand_over(core: &Core, agent: &str, deadline: Instant) {
    let directory = &core.directory;
    let kept_here = || {
        directory.keeps_mail_of(agent).is_some() && directory.get(agent).is_some_and(|a| !a.online)
    };
    while kept_here() && Instant::now() < deadline {
        tokio::time::sleep(LOOK_EVERY).await;
    }
    core.router.flush_offline().await;
}
