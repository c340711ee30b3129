//! Mail of a fleet whose take this bridge cannot be sure of: a take NATS did not answer
//! (its row put back at the revision it was taken at), or one that landed without its
//! answer (the fleet's removal names this bridge, and the row is still here). If such a
//! take landed, every other bridge dropped its copy, and only the mark it left — which
//! lives `TAKEN_REMEMBERED` — says the message is this bridge's to deliver. So that the
//! mail neither waits here for an agent that now connects elsewhere nor is lost when the
//! mark goes, the endpoint settles it once NATS is back (`settle`, `settle_record`): it
//! takes each record again, keeps what it then holds as the fleet's record again, which any
//! bridge may deliver, and drops what another bridge took. An agent's open socket or stream whose own
//! take NATS did not answer takes the mail again itself as well (`TAKE_AGAIN_AFTER`), and
//! one open when the settling keeps its mail again is woken to take it: an agent's mail is
//! not taken while it is being settled, nor settled while a take of it is under way.

use std::collections::{HashMap, HashSet};

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{RecordError, Revision, SharedRecords, TAKE_AGAIN_AFTER};

/// What settling one record of unsettled mail came to (`settle_record`).
#[derive(Debug, PartialEq, Eq)]
pub enum Settled {
    /// The take was this bridge's: the mail is the fleet's record again, at this revision.
    KeptAgain(Revision),
    /// Another bridge took it: it is not this bridge's to deliver.
    TakenElsewhere,
    /// NATS did not answer: still unsettled.
    Unsure,
}

/// Settles `table`'s record `key`, mail this bridge holds as written at `revision` and
/// cannot be sure it took: takes it again (its own take's mark answers for a take that
/// landed) and writes `value` back over that take, so that any bridge may deliver it. The
/// row stays where it is meanwhile, so a bridge stopped halfway keeps it.
pub async fn settle_record(
    records: &dyn SharedRecords,
    table: &str,
    key: &str,
    revision: Revision,
    value: bytes::Bytes,
) -> Settled {
    let written = match records.take(table, key, revision).await {
        Ok(()) => records.put_back(table, key, value, revision).await,
        Err(e) => Err(e),
    };
    match written {
        Ok(revision) => Settled::KeptAgain(revision),
        Err(RecordError::Conflict) => Settled::TakenElsewhere,
        Err(RecordError::Unavailable(_)) => Settled::Unsure,
    }
}

/// Unsettled mail, by agent: the ids of its messages.
#[derive(Default)]
pub struct UnsettledMail {
    by_agent: Mutex<HashMap<String, HashSet<String>>>,
    /// Who is taking or settling whose mail: an agent's mail is not taken while it is being
    /// settled, nor settled while a take of it is under way, as a take and a settling of
    /// one row at one revision are both answered by the same mark (this bridge's).
    turns: Mutex<Turns>,
    /// Told when an agent's settling ends.
    settled: Notify,
}

#[derive(Default)]
struct Turns {
    /// Agents whose mail is being settled, with the ids being settled.
    settling: HashMap<String, HashSet<String>>,
    /// Takes of each agent's mail under way.
    taking: HashMap<String, usize>,
}

/// A take of an agent's mail under way (`UnsettledMail::taking`); the take ends with it.
pub struct Taking<'a> {
    mail: &'a UnsettledMail,
    agent: String,
}

impl Drop for Taking<'_> {
    fn drop(&mut self) {
        let mut turns = self.mail.turns.lock();
        if let Some(count) = turns.taking.get_mut(&self.agent) {
            *count -= 1;
            if *count == 0 {
                turns.taking.remove(&self.agent);
            }
        }
    }
}

/// An agent's settling under way; it ends with this, whatever ended it.
struct Settling<'a> {
    mail: &'a UnsettledMail,
    agent: &'a str,
}

impl Drop for Settling<'_> {
    fn drop(&mut self) {
        self.mail.turns.lock().settling.remove(self.agent);
        self.mail.settled.notify_waiters();
    }
}

impl UnsettledMail {
    /// Notes message `id` of `agent`'s as unsettled.
    pub fn note(&self, agent: &str, id: &str) {
        let mut by_agent = self.by_agent.lock();
        let ids = by_agent.entry(agent.to_owned()).or_default();
        ids.insert(id.to_owned());
    }

    /// Whether `agent`'s mail is being settled now.
    pub fn is_settling(&self, agent: &str) -> bool {
        self.turns.lock().settling.contains_key(agent)
    }

    /// Whether message `id` of `agent`'s is being settled now.
    pub fn is_settling_message(&self, agent: &str, id: &str) -> bool {
        (self.turns.lock().settling.get(agent)).is_some_and(|ids| ids.contains(id))
    }

    /// Starts a take of `agent`'s mail, once it is not being settled; no settling of it
    /// starts until the take ends (the `Taking` is dropped).
    pub async fn taking(&self, agent: &str) -> Taking<'_> {
        loop {
            let settled = self.settled.notified();
            let mut settled = std::pin::pin!(settled);
            settled.as_mut().enable();
            if let Some(taking) = self.try_taking(agent) {
                return taking;
            }
            settled.await;
        }
    }

    /// As `taking`, but `None` rather than wait while `agent`'s mail is being settled.
    pub fn try_taking(&self, agent: &str) -> Option<Taking<'_>> {
        let mut turns = self.turns.lock();
        if turns.settling.contains_key(agent) {
            return None;
        }
        *turns.taking.entry(agent.to_owned()).or_default() += 1;
        Some(Taking {
            mail: self,
            agent: agent.to_owned(),
        })
    }

    /// Settles the mail noted so far with `settle` (which takes it again, and keeps again
    /// what it took), an agent at a time, but not that of agents whose mail is being
    /// taken: theirs stays noted for a later settling.
    pub async fn settle<F, Fut>(&self, mut settle: F)
    where
        F: FnMut(String, Vec<String>) -> Fut,
        Fut: Future<Output = ()>,
    {
        let agents: Vec<String> = self.by_agent.lock().keys().cloned().collect();
        for agent in agents {
            let ids = {
                let mut turns = self.turns.lock();
                if turns.taking.contains_key(&agent) {
                    continue;
                }
                let Some(ids) = self.by_agent.lock().remove(&agent) else {
                    continue;
                };
                turns.settling.insert(agent.clone(), ids.clone());
                ids
            };
            let _settling = Settling {
                mail: self,
                agent: &agent,
            };
            settle(agent.clone(), ids.into_iter().collect()).await;
        }
    }

    /// Whether any mail is noted.
    pub fn is_empty(&self) -> bool {
        self.by_agent.lock().is_empty()
    }

    /// Settles the mail noted (`settle`) every `TAKE_AGAIN_AFTER` while `records` can be
    /// reached, until `shutdown`.
    pub async fn keep_settling<F, Fut>(
        &self,
        records: &dyn SharedRecords,
        shutdown: &CancellationToken,
        mut settle: F,
    ) where
        F: FnMut(String, Vec<String>) -> Fut,
        Fut: Future<Output = ()>,
    {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(TAKE_AGAIN_AFTER) => {}
            }
            if !self.is_empty() && records.reachable() {
                self.settle(&mut settle).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn mail_is_settled_once_by_agent() {
        let mail = UnsettledMail::default();
        mail.note("away", "m1");
        mail.note("away", "m2");
        mail.note("other", "m3");
        let mut settled = Vec::new();
        mail.settle(|agent, mut ids| {
            ids.sort();
            settled.push((agent, ids));
            async {}
        })
        .await;
        settled.sort();
        let ids = |ids: &[&str]| ids.iter().map(|id| id.to_string()).collect::<Vec<_>>();
        let expected = [
            ("away".to_owned(), ids(&["m1", "m2"])),
            ("other".to_owned(), ids(&["m3"])),
        ];
        assert_eq!(settled, expected);
        assert!(mail.is_empty());
    }

    #[tokio::test]
    async fn a_take_waits_while_its_agents_mail_is_settled() {
        let mail = std::sync::Arc::new(UnsettledMail::default());
        mail.note("away", "m1");
        let (started, start) = tokio::sync::oneshot::channel();
        let (finish, finished) = tokio::sync::oneshot::channel::<()>();
        let settling = tokio::spawn({
            let mail = mail.clone();
            async move {
                let mut started = Some(started);
                let mut finished = Some(finished);
                mail.settle(|_, _| {
                    let _ = started.take().unwrap().send(());
                    let finished = finished.take().unwrap();
                    async move {
                        let _ = finished.await;
                    }
                })
                .await
            }
        });
        start.await.unwrap();
        // Another agent's take goes on; this one's waits for the settling (or is refused
        // for now: the expiry sweep's).
        drop(mail.taking("other").await);
        assert!(mail.try_taking("away").is_none());
        let waiting = tokio::spawn({
            let mail = mail.clone();
            async move {
                drop(mail.taking("away").await);
            }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        finish.send(()).unwrap();
        settling.await.unwrap();
        waiting.await.unwrap();
    }

    #[tokio::test]
    async fn mail_being_taken_is_left_for_a_later_settling() {
        let mail = UnsettledMail::default();
        mail.note("polling", "m1");
        let taking = mail.taking("polling").await;
        let mut settled = 0;
        mail.settle(|_, _| {
            settled += 1;
            async {}
        })
        .await;
        assert_eq!(settled, 0);
        drop(taking);
        mail.settle(|_, _| {
            settled += 1;
            async {}
        })
        .await;
        assert_eq!(settled, 1);
        assert!(mail.is_empty());
    }
}
