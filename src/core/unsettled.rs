//! Mail of a fleet whose take this bridge cannot be sure of: a take NATS did not answer
//! (its row put back at the revision it was taken at), or one that landed without its
//! answer (the fleet's removal names this bridge, and the row is still here). If such a
//! take landed, every other bridge dropped its copy, and only the mark it left — which
//! lives `TAKEN_REMEMBERED` — says the message is this bridge's to deliver. So that the
//! mail neither waits here for an agent that now connects elsewhere nor is lost when the
//! mark goes, the endpoint settles it once NATS is back (`settle`): it takes the rows
//! again, keeps what it then holds as the fleet's record again, which any bridge may
//! deliver, and drops what another bridge took. An agent with a connection here that
//! takes its mail is left to that connection, which takes it again itself
//! (`TAKE_AGAIN_AFTER`).

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{SharedRecords, TAKE_AGAIN_AFTER};

/// Unsettled mail, by agent: the ids of its messages.
#[derive(Default)]
pub struct UnsettledMail {
    by_agent: Mutex<HashMap<String, HashSet<String>>>,
    /// Agents whose mail is being settled now: a take of their mail waits until it is
    /// (`settled`), as it would find some of it gone for a moment.
    settling: Mutex<HashSet<String>>,
    /// Told when an agent's settling ends.
    done: Notify,
}

impl UnsettledMail {
    /// Notes message `id` of `agent`'s as unsettled.
    pub fn note(&self, agent: &str, id: &str) {
        let mut by_agent = lock(&self.by_agent);
        let ids = by_agent.entry(agent.to_owned()).or_default();
        ids.insert(id.to_owned());
    }

    /// Returns once `agent`'s mail is not being settled. A take of the agent's mail waits
    /// for this first: a connection known here only after a settling began would
    /// otherwise miss what it keeps again, and a poll would, until the next.
    pub async fn settled(&self, agent: &str) {
        loop {
            let done = self.done.notified();
            let mut done = std::pin::pin!(done);
            done.as_mut().enable();
            if !lock(&self.settling).contains(agent) {
                return;
            }
            done.await;
        }
    }

    /// Settles the mail noted so far with `settle` (which takes it again, and keeps again
    /// what it took), an agent at a time, but not that of agents `connected_here` says
    /// have a connection here that takes their mail.
    pub async fn settle<F, Fut>(&self, connected_here: impl Fn(&str) -> bool, mut settle: F)
    where
        F: FnMut(String, Vec<String>) -> Fut,
        Fut: Future<Output = ()>,
    {
        let agents: Vec<String> = lock(&self.by_agent).keys().cloned().collect();
        for agent in agents {
            // Marked before asking whether the agent is connected: a connection known only
            // after that waits for `settled` before it takes.
            lock(&self.settling).insert(agent.clone());
            let ids = if connected_here(&agent) {
                None
            } else {
                lock(&self.by_agent).remove(&agent)
            };
            if let Some(ids) = ids {
                settle(agent.clone(), ids.into_iter().collect()).await;
            }
            lock(&self.settling).remove(&agent);
            self.done.notify_waiters();
        }
    }

    /// Whether any mail is noted.
    pub fn is_empty(&self) -> bool {
        lock(&self.by_agent).is_empty()
    }

    /// Settles the mail noted (`settle`) every `TAKE_AGAIN_AFTER` while `records` can be
    /// reached, until `shutdown`.
    pub async fn keep_settling<C, F, Fut>(
        &self,
        records: &dyn SharedRecords,
        shutdown: &CancellationToken,
        connected_here: C,
        mut settle: F,
    ) where
        C: Fn(&str) -> bool,
        F: FnMut(String, Vec<String>) -> Fut,
        Fut: Future<Output = ()>,
    {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(TAKE_AGAIN_AFTER) => {}
            }
            if !self.is_empty() && records.reachable() {
                self.settle(&connected_here, &mut settle).await;
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn mail_is_settled_once_by_agent_but_that_of_connected_agents() {
        let mail = UnsettledMail::default();
        mail.note("away", "m1");
        mail.note("away", "m2");
        mail.note("here", "m3");
        let mut settled = Vec::new();
        mail.settle(
            |agent| agent == "here",
            |agent, mut ids| {
                ids.sort();
                settled.push((agent, ids));
                async {}
            },
        )
        .await;
        assert_eq!(
            settled,
            [("away".to_owned(), vec!["m1".to_owned(), "m2".to_owned()])]
        );
        // The connected agent's stays noted, for when it is not.
        assert!(!mail.is_empty());
        mail.settle(
            |_| false,
            |agent, _| {
                assert_eq!(agent, "here");
                async {}
            },
        )
        .await;
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
                mail.settle(
                    |_| false,
                    |_, _| {
                        let _ = started.take().unwrap().send(());
                        let finished = finished.take().unwrap();
                        async move {
                            let _ = finished.await;
                        }
                    },
                )
                .await
            }
        });
        start.await.unwrap();
        // Another agent's take goes on; this one's waits for the settling.
        mail.settled("other").await;
        let waiting = tokio::spawn({
            let mail = mail.clone();
            async move { mail.settled("away").await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        finish.send(()).unwrap();
        settling.await.unwrap();
        waiting.await.unwrap();
    }
}
