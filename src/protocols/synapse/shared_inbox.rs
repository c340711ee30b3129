//! Synapse polling inboxes in a fleet (`core::SharedRecords`), as Grid's queues are
//! (`grid/shared_queue.rs` says why each step is as it is): a message kept for an agent is
//! a record of the fleet, kept once (`Expect::Unused`) by the bridge that holds the agent —
//! or, while that bridge is gone, by whichever other bridge keeps it first — and taken once,
//! through whichever bridge the agent polls or opens its stream on. Every bridge applies the
//! records to its own `synapse_inbox`; a bridge alone, or cut off from NATS, keeps its own.

use std::sync::Arc;

use prost::Message;
use tokio::task::JoinHandle;

use super::Synapse;
use super::db::InboxRow;
use super::proto::SynapseMessage;
use crate::core::{
    Expect, RecordChange, RecordError, Revision, Settled, TakenMail, settle_record, sink, take_each,
};
use crate::store::StoreError;

/// The table of kept messages in the fleet's records, keyed by `key`; the value is the
/// `SynapseMessage`, encoded.
const INBOX: &str = "synapse-inbox";

/// The record of `message_id` kept for `agent`: the pair, as JSON.
fn key(agent: &str, message_id: &str) -> String {
    serde_json::to_string(&(agent, message_id)).expect("two strings encode")
}

fn agent_and_id(key: &str) -> Result<(String, String), StoreError> {
    serde_json::from_str(key).map_err(|e| StoreError::Corrupt(format!("a shared inbox key: {e}")))
}

/// Follows the fleet's inboxes, and settles the messages whose take this bridge cannot be
/// sure of (`UnsettledMail`), when there is a fleet: the settling's task, which ends at
/// shutdown.
pub fn follow(synapse: &Arc<Synapse>) -> Option<JoinHandle<()>> {
    let records = synapse.core.records()?;
    records.follow(INBOX, sink(synapse, "synapse inbox message", apply_change));
    let (synapse, records) = (synapse.clone(), records.clone());
    let settler = tokio::spawn(async move {
        let settle = |agent, ids| synapse.settle_inbox(agent, ids);
        (synapse.unsettled)
            .keep_settling(records.as_ref(), &synapse.shutdown, settle)
            .await
    });
    Some(settler)
}

async fn apply_change(synapse: Arc<Synapse>, change: RecordChange) -> Result<(), StoreError> {
    let (agent, id) = agent_and_id(&change.key)?;
    match change.value {
        Some(message) => {
            let kept = (synapse.db)
                .apply_inbox(agent.clone(), id, message.to_vec(), change.revision)
                .await?;
            if kept {
                synapse.inbox_kept(&agent);
            }
            Ok(())
        }
        None if !change.taken_here => synapse.db.forget_inbox(agent, id, change.revision).await,
        // A row from before the take still here is one whose take's answer was lost: this
        // bridge's to deliver, or to keep again as the fleet's.
        None => {
            // Not the mark of a settling's own take, which keeps the row again meanwhile.
            if synapse.unsettled.is_settling_message(&agent, &id) {
                return Ok(());
            }
            let db = &synapse.db;
            let from_before = db.holds_from_before(agent.clone(), id.clone(), change.revision);
            if from_before.await? {
                synapse.unsettled.note(&agent, &id);
            }
            Ok(())
        }
    }
}

/// Whether a message is kept for an agent for the first time, or again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keeping {
    /// Kept once, fleet-wide: not by a bridge that finds it kept or taken already (a
    /// late copy of it).
    New,
    /// Taken from the inbox by this bridge and not delivered (its stream's client left
    /// before reading it): the fleet's record again over the mark of its take at this
    /// revision (`SharedRecords::put_back`), or, with none, this bridge's own again.
    Again(Option<Revision>),
}

impl Synapse {
    /// Ends once the inbox `bridge` kept for `agent`, an agent that moved here from it, can
    /// be taken here (`Core::mail_handed_over`).
    pub(super) async fn inbox_handed_over(&self, agent: &str, bridge: &str) {
        self.core.mail_handed_over(agent, bridge, INBOX).await;
    }

    /// Keeps `message` in `agent`'s inbox: in a fleet, as the fleet's record (applied here
    /// as it is written); alone, or without NATS, here only. Mail put back while NATS is
    /// away waits here at the revision it was taken at, to be settled (`UnsettledMail`).
    pub(super) async fn keep_in_inbox(
        &self,
        agent: &str,
        message: &SynapseMessage,
        keeping: Keeping,
    ) -> Result<(), StoreError> {
        let encoded = message.encode_to_vec();
        let key = key(agent, &message.id);
        let value = bytes::Bytes::from(encoded.clone());
        let written = match (self.core.records(), keeping) {
            (Some(records), Keeping::New) => {
                records.write(INBOX, &key, value, Expect::Unused).await
            }
            (Some(records), Keeping::Again(Some(taken_at))) => {
                records.put_back(INBOX, &key, value, taken_at).await
            }
            _ => return self.db.push_inbox(agent, &message.id, encoded, None).await,
        };
        match (written, keeping) {
            (Ok(revision), _) => {
                let kept = (self.db)
                    .apply_inbox(agent.to_owned(), message.id.clone(), encoded, revision)
                    .await?;
                if kept {
                    self.inbox_kept(agent);
                }
                Ok(())
            }
            // Kept already by another bridge (applied here as its record arrives), or taken
            // (by another bridge, since this one took it).
            (Err(RecordError::Conflict), _) => Ok(()),
            (Err(RecordError::Unavailable(why)), Keeping::Again(taken_at)) => {
                tracing::warn!(%why, agent, "synapse: put back, to settle once NATS is back");
                self.unsettled.note(agent, &message.id);
                (self.db)
                    .push_inbox(agent, &message.id, encoded, taken_at)
                    .await
            }
            (Err(RecordError::Unavailable(why)), Keeping::New) => {
                tracing::warn!(%why, agent, "synapse: kept in this bridge's inbox only");
                self.db.push_inbox(agent, &message.id, encoded, None).await
            }
        }
    }

    /// Takes every message waiting for `agent`, in inbox order; in a fleet, each from the
    /// fleet as well: one another bridge took first is left out, and one that cannot be
    /// taken while NATS is away stays for later.
    pub(super) async fn take_inbox_rows(
        &self,
        agent: &str,
    ) -> Result<TakenMail<InboxRow>, StoreError> {
        let _taking = self.unsettled.taking(agent).await;
        let candidates = self.db.take_inbox(agent).await?;
        self.taken_from_fleet(candidates).await
    }

    /// Of `candidates`, taken from this bridge's inbox, those also taken from the fleet's
    /// records (all of them for a bridge alone), in inbox order.
    async fn taken_from_fleet(
        &self,
        candidates: Vec<InboxRow>,
    ) -> Result<TakenMail<InboxRow>, StoreError> {
        let Some(records) = self.core.records() else {
            return Ok(TakenMail::all(candidates));
        };
        let each = take_each(records.as_ref(), INBOX, candidates, |row| {
            let id = row.message_id.as_deref()?;
            Some((key(&row.agent_id, id), row.fleet_revision?))
        })
        .await;
        // As Grid's queue does (`grid/shared_queue.rs`): a take NATS did not answer is found
        // out by the next take of the row, put back at its revision.
        // (Only rows with an id have a record to take.)
        let (mail, unreachable) = each.noting_unsettled(&self.unsettled, |row| {
            (&row.agent_id, row.message_id.as_deref().unwrap_or_default())
        });
        self.db.restore_inbox(unreachable).await?;
        Ok(mail)
    }

    /// Settles messages `ids` of `agent`'s inbox (`UnsettledMail`, `settle_record`): each
    /// the fleet's record again, or dropped if another bridge took it. While NATS does not
    /// answer, the rest waits for the next settling.
    async fn settle_inbox(&self, agent: String, ids: Vec<String>) {
        let Some(records) = self.core.records() else {
            return;
        };
        let rows = match self.db.inbox_ids(&agent, ids.clone()).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::error!(error = %e, agent, "synapse: cannot settle inbox messages");
                ids.iter().for_each(|id| self.unsettled.note(&agent, id));
                return;
            }
        };
        let mut rows = rows.into_iter();
        while let Some(row) = rows.next() {
            let (Some(id), Some(revision)) = (row.message_id, row.fleet_revision) else {
                continue;
            };
            let key = key(&agent, &id);
            let value = bytes::Bytes::from(row.message.clone());
            let applied = match settle_record(records.as_ref(), INBOX, &key, revision, value).await
            {
                Settled::KeptAgain(revision) => {
                    let db = &self.db;
                    let kept = db.apply_inbox(agent.clone(), id.clone(), row.message, revision);
                    kept.await.map(|kept| {
                        if kept {
                            self.inbox_kept(&agent);
                        }
                    })
                }
                Settled::TakenElsewhere => {
                    (self.db)
                        .forget_inbox(agent.clone(), id.clone(), revision + 1)
                        .await
                }
                Settled::Unsure => {
                    self.unsettled.note(&agent, &id);
                    for rest in rows {
                        if let Some(rest) = &rest.message_id {
                            self.unsettled.note(&agent, rest);
                        }
                    }
                    return;
                }
            };
            if let Err(e) = applied {
                tracing::error!(error = %e, agent, "synapse: cannot settle an inbox message");
                self.unsettled.note(&agent, &id);
            }
        }
    }
}
