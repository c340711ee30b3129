//! Grid queues in a fleet (`core::SharedRecords`): a message queued for a program is a
//! record of the fleet, so the program takes it through whichever bridge it polls or opens
//! a socket on — the one that queued it, or another after that one died — and takes it once.
//!
//! Queuing writes the record only if its key was never used (`Expect::Unused`): the bridge
//! that holds the program queues its mail, and while that bridge is gone every other one
//! does, and of bridges queuing one message for one program, one does. Taking it is a take
//! of the record at the revision this bridge applied (`SharedRecords::take`): of bridges
//! taking it at once one gets it, and its key is then not used again, so a late copy of the
//! message is not queued a second time. Every bridge applies the queue's records to its own
//! `grid_queue` table (revision order) and reads candidates from there. A bridge alone, or
//! one cut off from NATS, queues in its own table only.
//!
//! A take NATS did not answer leaves its mail this bridge's to settle (`UnsettledMail`);
//! mail taken and not delivered goes back over the take's mark (`SharedRecords::put_back`);
//! and mail queued here for a program with a socket open here wakes that socket to take it.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::future::join_all;
use tokio::task::JoinHandle;

use super::Grid;
use super::db::{Instances, Queued, ToQueue};
use crate::core::{
    RecordChange, RecordError, Settled, SharedRecords, TakenMail, settle_record, sink, take_each,
};
use crate::store::StoreError;

/// The table of queued messages in the fleet's records, keyed by `key`.
const QUEUE: &str = "grid-queue";

/// A queued message as the fleet holds it.
#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    agent: String,
    #[serde(flatten)]
    message: ToQueue,
}

/// The record of `message_id` queued for `agent`: the pair, as JSON (any text can be a
/// name or an id, so no separator would do).
fn key(agent: &str, message_id: &str) -> String {
    serde_json::to_string(&(agent, message_id)).expect("two strings encode")
}

fn corrupt(e: serde_json::Error) -> StoreError {
    StoreError::Corrupt(format!("a shared queued message: {e}"))
}

/// Follows the fleet's queues, and settles the mail whose take this bridge cannot be sure
/// of (`UnsettledMail`), when there is a fleet: the settling's task, which ends at
/// shutdown.
pub fn follow(grid: &Arc<Grid>) -> Option<JoinHandle<()>> {
    let records = grid.core.records()?;
    records.follow(QUEUE, sink(grid, "grid queued message", apply_change));
    let (grid, records) = (grid.clone(), records.clone());
    let settler = tokio::spawn(async move {
        let settle = |agent, ids| grid.settle_queued(agent, ids);
        (grid.unsettled)
            .keep_settling(records.as_ref(), &grid.shutdown, settle)
            .await
    });
    Some(settler)
}

async fn apply_change(grid: Arc<Grid>, change: RecordChange) -> Result<(), StoreError> {
    match change.value {
        Some(value) => {
            let record: Record = serde_json::from_slice(&value).map_err(corrupt)?;
            grid.apply_queued(record, change.revision).await
        }
        None => {
            let (agent, id): (String, String) =
                serde_json::from_str(&change.key).map_err(corrupt)?;
            if !change.taken_here {
                return grid.db.forget_queued(agent, id, change.revision).await;
            }
            // A row from before the take still here is one whose take's answer was lost:
            // this bridge's to deliver, or to keep again as the fleet's.
            // Not the mark of a settling's own take, which keeps the row again meanwhile.
            if grid.unsettled.is_settling_message(&agent, &id) {
                return Ok(());
            }
            let db = &grid.db;
            let from_before = db.holds_from_before(agent.clone(), id.clone(), change.revision);
            if from_before.await? {
                grid.unsettled.note(&agent, &id);
            }
            Ok(())
        }
    }
}

impl Grid {
    /// Queues the fleet's `record` as written at `revision`, and wakes its program's open
    /// sockets to take it: a bridge that took the program for away (its presence on its
    /// way), or one keeping again what it took, queued it meanwhile.
    async fn apply_queued(&self, record: Record, revision: u64) -> Result<(), StoreError> {
        let instance = record.message.instance.clone();
        let queued = (self.db)
            .apply_queued(record.agent.clone(), record.message, revision)
            .await?;
        if queued {
            self.sockets.wake(&record.agent, instance.as_deref());
        }
        Ok(())
    }

    /// Queues each message for its programs, in the order given: in a fleet, as the
    /// fleet's records (each applied here as it is written); alone, or without NATS, here
    /// only. Either way an open socket that takes one is woken to (a socket that closed
    /// with it unsent hands it to the program's others this way). What cannot be queued is
    /// logged.
    pub(super) async fn keep_queued(&self, messages: Vec<(Vec<String>, ToQueue)>) {
        let here_only = match self.core.records() {
            Some(records) if !messages.is_empty() => self.keep_in_fleet(&**records, messages).await,
            _ => messages,
        };
        self.queue_here(here_only).await;
    }

    /// Writes `messages` as the fleet's records (one a program), in order, and applies here
    /// those written; what is to be queued on this bridge only, as NATS did not take it.
    async fn keep_in_fleet(
        &self,
        records: &dyn SharedRecords,
        messages: Vec<(Vec<String>, ToQueue)>,
    ) -> Vec<(Vec<String>, ToQueue)> {
        let rows: Vec<Record> = (messages.into_iter())
            .flat_map(|(agents, message)| {
                (agents.into_iter()).map(move |agent| Record {
                    agent,
                    message: message.clone(),
                })
            })
            .collect();
        let writes = (rows.iter())
            .map(|record| {
                let value = serde_json::to_vec(record).expect("a record encodes");
                (key(&record.agent, &record.message.message_id), value.into())
            })
            .collect();
        let written = match records.write_unused_in_order(QUEUE, writes).await {
            Ok(written) => written,
            Err(e) => {
                tracing::warn!(error = %e, "grid: queued on this bridge only");
                return rows
                    .into_iter()
                    .map(|r| (vec![r.agent], r.message))
                    .collect();
            }
        };
        let mut here_only = Vec::new();
        let mut applies = Vec::new();
        for (written, record) in written.into_iter().zip(rows) {
            match written {
                Ok(revision) => {
                    let id = record.message.message_id.clone();
                    applies.push(async move { (id, self.apply_queued(record, revision).await) });
                }
                // Queued already by another bridge (applied here as its record arrives),
                // or taken already.
                Err(RecordError::Conflict) => {}
                Err(RecordError::Unavailable(why)) => {
                    tracing::warn!(%why, agent = %record.agent, "grid: queued on this bridge only");
                    here_only.push((vec![record.agent], record.message));
                }
            }
        }
        // Together: the store commits them in one batch, not one a message.
        for (id, applied) in join_all(applies).await {
            if let Err(e) = applied {
                tracing::error!(error = %e, message_id = %id, "grid: cannot queue a message");
            }
        }
        here_only
    }

    /// Queues each message for its programs in this bridge's table only, and wakes the
    /// open sockets that take them. Each message is a store write of its own, so that one
    /// that fails fails alone, and all are queued at once, so that they commit together.
    async fn queue_here(&self, messages: Vec<(Vec<String>, ToQueue)>) {
        let writes: Vec<_> = (messages.into_iter())
            .map(|(agents, message)| {
                let (id, instance) = (message.message_id.clone(), message.instance.clone());
                let written = self.db.enqueue(agents.clone(), message);
                async move { (id, agents, instance, written.await) }
            })
            .collect();
        for (id, agents, instance, written) in join_all(writes).await {
            match written {
                Ok(()) => {
                    for agent in &agents {
                        self.sockets.wake(agent, instance.as_deref());
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, message_id = %id, "grid: cannot queue a message")
                }
            }
        }
    }

    /// Ends once the queue `bridge` kept for `agent`, a program that moved here from it, can
    /// be taken here (`Core::mail_handed_over`).
    pub(super) async fn queue_handed_over(&self, agent: &str, bridge: &str) {
        self.core.mail_handed_over(agent, bridge, QUEUE).await;
    }

    /// Takes the messages waiting for `agent` that `instances` covers (`Db::take`); in a
    /// fleet, each from the fleet as well: one another bridge took first is left out, and
    /// one NATS did not answer for waits here, to be taken again or settled.
    pub(super) async fn take_queued(
        &self,
        agent: &str,
        since: Option<i64>,
        instances: Instances<'_>,
    ) -> Result<TakenMail<Queued>, StoreError> {
        let _taking = self.unsettled.taking(agent).await;
        let candidates = self.db.take(agent, since, instances).await?;
        self.taken_from_fleet(candidates).await
    }

    /// Of `candidates`, taken from this bridge's table, those also taken from the fleet's
    /// records (all of them for a bridge alone), in queue order.
    pub(super) async fn taken_from_fleet(
        &self,
        candidates: Vec<Queued>,
    ) -> Result<TakenMail<Queued>, StoreError> {
        let Some(records) = self.core.records() else {
            return Ok(TakenMail::all(candidates));
        };
        let each = take_each(records.as_ref(), QUEUE, candidates, |queued| {
            let key = key(&queued.agent, &queued.message.message_id);
            queued.fleet_revision.map(|revision| (key, revision))
        })
        .await;
        // Whether a take NATS did not answer landed is not known yet: the row is put back
        // at its revision, and the next take of it finds out (`SharedRecords::take`), or
        // its settling (`UnsettledMail`). Its mark, if it landed, names this bridge, so the
        // fleet's removal leaves the row.
        let (mail, unreachable) = each.noting_unsettled(&self.unsettled, |queued| {
            (&queued.agent, &queued.message.message_id)
        });
        self.db.restore(unreachable).await?;
        Ok(mail)
    }

    /// Queues again messages taken but not sent: in a fleet, what was taken from the fleet
    /// is its record again (at a new revision, after what was queued meanwhile) over the
    /// take's mark, and queued here as the watch would (not if this bridge took it again
    /// meanwhile); while the fleet cannot be reached, it waits here at the revision it was
    /// taken at, to be settled (`UnsettledMail`); one whose record another bridge took
    /// since is not this bridge's any more. The rest goes back where it was.
    pub(super) async fn put_back(&self, taken: Vec<Queued>) -> Result<(), StoreError> {
        let Some(records) = self.core.records() else {
            return self.db.restore(taken).await;
        };
        let mut as_it_was = Vec::new();
        for queued in taken {
            let Some(taken_at) = queued.fleet_revision else {
                as_it_was.push(queued);
                continue;
            };
            match self.write_back(records.as_ref(), &queued, taken_at).await {
                Ok(revision) => {
                    let record = Record {
                        agent: queued.agent,
                        message: queued.message,
                    };
                    self.apply_queued(record, revision).await?;
                }
                Err(RecordError::Conflict) => {}
                Err(RecordError::Unavailable(why)) => {
                    tracing::warn!(%why, agent = %queued.agent, "grid: queued again, to settle once NATS is back");
                    (self.unsettled).note(&queued.agent, &queued.message.message_id);
                    as_it_was.push(queued);
                }
            }
        }
        self.db.restore(as_it_was).await
    }

    /// Settles messages `ids` queued for `agent` (`UnsettledMail`, `settle_record`): each
    /// the fleet's record again, or dropped if another bridge took it. Mail whose ttl ran
    /// out is left to the expiry sweep, which tells its sender. While NATS does not answer,
    /// the rest waits for the next settling.
    async fn settle_queued(&self, agent: String, ids: Vec<String>) {
        let Some(records) = self.core.records() else {
            return;
        };
        let rows = match self.db.queued_ids(&agent, ids.clone()).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::error!(error = %e, agent, "grid: cannot settle queued messages");
                ids.iter().for_each(|id| self.unsettled.note(&agent, id));
                return;
            }
        };
        let now = crate::core::now_ms();
        let mut rows = rows.into_iter();
        while let Some(queued) = rows.next() {
            let Some(revision) = queued.fleet_revision else {
                continue;
            };
            if queued.message.expires_at.is_some_and(|at| at <= now) {
                continue;
            }
            let id = queued.message.message_id.clone();
            let record = Record {
                agent: queued.agent,
                message: queued.message,
            };
            let value = serde_json::to_vec(&record).expect("a record encodes");
            let key = key(&agent, &id);
            let applied =
                match settle_record(records.as_ref(), QUEUE, &key, revision, value.into()).await {
                    Settled::KeptAgain(revision) => self.apply_queued(record, revision).await,
                    Settled::TakenElsewhere => {
                        (self.db)
                            .forget_queued(agent.clone(), id.clone(), revision + 1)
                            .await
                    }
                    Settled::Unsure => {
                        self.unsettled.note(&agent, &id);
                        rows.for_each(|rest| self.unsettled.note(&agent, &rest.message.message_id));
                        return;
                    }
                };
            if let Err(e) = applied {
                tracing::error!(error = %e, agent, "grid: cannot settle a queued message");
                self.unsettled.note(&agent, &id);
            }
        }
    }

    /// Of expired `candidates` (taken from this bridge's table), those also taken from the
    /// fleet's records. Those of agents whose mail is being settled go back for the next
    /// sweep: a settling and a take of one row are answered by the same mark.
    pub(super) async fn taken_expired(
        &self,
        candidates: Vec<Queued>,
    ) -> Result<Vec<Queued>, StoreError> {
        let mut takes = HashMap::new();
        let (mut now, mut later) = (Vec::new(), Vec::new());
        for queued in candidates {
            if !takes.contains_key(&queued.agent)
                && let Some(taking) = self.unsettled.try_taking(&queued.agent)
            {
                takes.insert(queued.agent.clone(), taking);
            }
            if takes.contains_key(&queued.agent) {
                now.push(queued);
            } else {
                later.push(queued);
            }
        }
        self.db.restore(later).await?;
        Ok(self.taken_from_fleet(now).await?.taken)
    }

    /// Writes `queued` back as the fleet's record over the mark its take at `taken_at`
    /// left; its new revision.
    async fn write_back(
        &self,
        records: &dyn SharedRecords,
        queued: &Queued,
        taken_at: u64,
    ) -> Result<u64, RecordError> {
        let record = Record {
            agent: queued.agent.clone(),
            message: queued.message.clone(),
        };
        let value = serde_json::to_vec(&record).expect("a record encodes");
        let key = key(&queued.agent, &queued.message.message_id);
        records.put_back(QUEUE, &key, value.into(), taken_at).await
    }
}
