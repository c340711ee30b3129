//! Mail handed over as an agent moves between bridges. The bridge an agent left keeps what
//! it routes for the agent as mail (a Grid queue, a Synapse inbox: shared records) until it
//! applies the agent's join on its new bridge, in the stream's order; the new bridge sends
//! the agent live what it applies after the agent connected, and the join follows that in
//! the stream. So the mail the old bridge kept comes before what the new one sends live —
//! if the new bridge takes it only once it is there. Before it does, it asks the bridge the
//! agent left (a NATS request on `<prefix>.handover.<bridge>`), which answers once it no
//! longer keeps the agent's mail and what it kept is written, with the last revision it
//! wrote in the mail's table; the new bridge then waits for its own watch of that table
//! to reach it.

use std::sync::Arc;
use std::time::Duration;

use async_nats::client::RequestErrorKind;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::link::NatsLink;
use super::record_positions::RecordPositions;
use crate::core::{Core, HandOver, Revision, wait_while};
use crate::telemetry;

/// How long before the asker stops waiting the bridge asked answers at the latest: what it
/// has written by then is handed over, and the answer has that long to arrive.
const ANSWER_TRAVELS_WITHIN: Duration = Duration::from_secs(1);

/// The longest the bridge asked takes, whatever the request says: an asker waits ten
/// seconds at most (`Core::mail_handed_over`).
const ANSWERED_WITHIN_AT_MOST: Duration = Duration::from_secs(10);

/// A request to hand over `agent`'s mail, kept in `table`, answered within `within_ms`
/// (what is left of the asker's wait).
#[derive(Serialize, Deserialize)]
struct Asked {
    agent: String,
    table: String,
    #[serde(default = "whole_wait_ms")]
    within_ms: u64,
}

/// The asker's whole wait, for a request that does not say what is left of it.
fn whole_wait_ms() -> u64 {
    ANSWERED_WITHIN_AT_MOST.as_millis() as u64
}

/// The answer: the last revision the bridge asked wrote in the table, and whether it let
/// the agent go (it applied the agent's join elsewhere, so keeps no more of its mail).
#[derive(Serialize, Deserialize)]
struct Answer {
    written: Revision,
    let_go: bool,
}

/// Asks `bridge`, which held `agent` until it connected here, to hand over its mail kept
/// in `table`, and waits until this bridge's watch of the table holds what it kept — until
/// `deadline`. Not while NATS is away: nothing would answer.
pub async fn ask(
    link: &NatsLink,
    positions: &RecordPositions,
    agent: &str,
    bridge: &str,
    table: &str,
    deadline: Instant,
) -> HandOver {
    if link.ready().is_none() {
        telemetry::federation_handover("unanswered");
        return HandOver::Kept;
    }
    let within = deadline.saturating_duration_since(Instant::now());
    let asked = Asked {
        agent: agent.to_owned(),
        table: table.to_owned(),
        within_ms: within.as_millis().try_into().unwrap_or(u64::MAX),
    };
    let request = async_nats::Request::new()
        .payload(serde_json::to_vec(&asked).unwrap_or_default().into())
        .timeout(Some(within));
    let asked = link
        .client
        .send_request(link.names.handover_of(bridge), request);
    // No answer (the bridge gone, or too slow): the mail is taken as it is. Nobody there
    // is the asker's to tell (it asks again), and is counted by it.
    let answer = match tokio::time::timeout_at(deadline, asked).await {
        Ok(Ok(answer)) => serde_json::from_slice::<Answer>(&answer.payload).ok(),
        Ok(Err(e)) if e.kind() == RequestErrorKind::NoResponders => return HandOver::NoOneThere,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, agent, bridge, "federation: no hand-over of a moved agent's mail");
            None
        }
        Err(_) => None,
    };
    let Some(answer) = answer else {
        telemetry::federation_handover("unanswered");
        return HandOver::Kept;
    };
    if positions.applied_by(table, answer.written, deadline).await {
        telemetry::federation_handover("handed_over");
    } else {
        tracing::debug!(
            agent,
            bridge,
            "federation: a moved agent's mail is taken before it all arrived"
        );
        telemetry::federation_handover("late");
    }
    match answer.let_go {
        true => HandOver::LetGo,
        false => HandOver::Kept,
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
        let (Some(reply), Ok(asked)) = (
            request.reply,
            serde_json::from_slice::<Asked>(&request.payload),
        ) else {
            continue;
        };
        let (link, core, positions) = (link.clone(), core.clone(), positions.clone());
        tokio::spawn(async move {
            // Half the asker's wait for the join, so that an answer made even without it
            // has time to arrive.
            let within = Duration::from_millis(asked.within_ms).min(ANSWERED_WITHIN_AT_MOST);
            let now = Instant::now();
            let join_by = now + within / 2;
            // Late in the asker's wait, half of what is left rather than nothing.
            let answer_by = now + within.saturating_sub(ANSWER_TRAVELS_WITHIN).max(within / 2);
            let agent = &asked.agent;
            let handed_over = hand_over(&core, agent, join_by.min(answer_by), answer_by);
            let let_go = handed_over.await;
            // Read once the sinks wrote what they were given.
            let written = positions.written(&asked.table);
            let answer = Answer { written, let_go };
            let answer = serde_json::to_vec(&answer).unwrap_or_default();
            if let Err(e) = link.client.publish(reply, answer.into()).await {
                tracing::debug!(error = %e, agent = asked.agent, "federation: a hand-over answer was not sent");
            }
        });
    }
}

/// Ends once this bridge no longer keeps `agent`'s mail — it applied the agent's join on
/// another bridge — or at `join_by`, and then once every offline sink has kept what it
/// was given before, or at `answer_by`. Whether it let the agent go, all it kept written.
async fn hand_over(core: &Core, agent: &str, join_by: Instant, answer_by: Instant) -> bool {
    let directory = &core.directory;
    let kept_here = || {
        directory.keeps_mail_of(agent).is_some() && directory.get(agent).is_some_and(|a| !a.online)
    };
    let let_go = wait_while(join_by, kept_here).await;
    let flushed = tokio::time::timeout_at(answer_by, core.router.flush_offline()).await;
    let_go && flushed.is_ok()
}
