//! The writer: the one task that keeps messages for programs that are not connected —
//! queued for polling (or a program's next socket) and appended to the scratchpad — and
//! keeps every broadcast for the programs it did not reach.
//!
//! It works in turns. A turn takes in whatever waits, up to `TURN_AT_MOST` jobs, appends its
//! new scratchpad entries in one write and queues its messages together, in the order they
//! were routed: in one store batch and, in a fleet, as records sent one after another and
//! answered together (`SharedRecords::write_unused_in_order`), whose revisions are the
//! queue's order. So a flood to a program away is written at the rate of batches, not of
//! one SQLite write, one file append and one NATS round trip a message.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use super::{Grid, PROTOCOL};
use crate::core::{Delivery, Mailbox};
use crate::protocols::hub::Hub;

/// Work for the writer.
pub(super) enum Outgoing {
    /// Queue for a program that polls.
    Queue {
        agent: String,
        delivery: Arc<Delivery>,
        message: Value,
    },
    /// Append to the scratchpad.
    Append(Value),
    /// Answered once everything sent before it, and every broadcast routed before it, is
    /// written: a poll waits for this, so it sees every message accepted before it.
    Flush(oneshot::Sender<()>),
}

/// The jobs one turn takes in at most (a flush also takes in every broadcast waiting):
/// enough for a batch to pay for its commit, few enough that a turn's writes are not held
/// back long by one slow record write.
const TURN_AT_MOST: usize = 256;

/// What one turn writes.
#[derive(Default)]
struct Turn {
    jobs: usize,
    /// Messages for the scratchpad, in the order routed.
    appends: Vec<Value>,
    /// Messages to queue, in the order routed.
    queuings: Vec<Queuing>,
    /// Flushes answered once the turn is written.
    flushes: Vec<oneshot::Sender<()>>,
}

/// A message to queue for `agents` (none: a broadcast that reached every program). Its
/// delivery is kept until the turn is written, as what holds the message's
/// acknowledgement waits for the delivery to be dropped.
struct Queuing {
    agents: Vec<String>,
    delivery: Arc<Delivery>,
    message: Value,
}

impl Grid {
    /// Writes queued messages and scratchpad appends in the order they were sent, and keeps
    /// every broadcast for the programs that are not connected. The hub's mailbox is read
    /// here rather than by a task of its own, so a flush can take in what it holds.
    pub(super) async fn write_outgoing(
        self: Arc<Self>,
        mut rx: mpsc::UnboundedReceiver<Outgoing>,
        hub: Hub,
    ) {
        loop {
            let mut turn = Turn::default();
            tokio::select! {
                biased;
                job = rx.recv() => match job {
                    Some(job) => self.take_job(&mut turn, job, hub.mailbox()),
                    None => break,
                },
                next = hub.recv() => match next {
                    Some(delivery) => self.take_broadcast(&mut turn, delivery),
                    None => break,
                },
                _ = self.shutdown.cancelled() => {
                    // At shutdown, what is already waiting is still written.
                    self.take_waiting(&mut turn, &mut rx, hub.mailbox(), usize::MAX);
                    self.write(turn).await;
                    break;
                }
            }
            self.take_waiting(&mut turn, &mut rx, hub.mailbox(), TURN_AT_MOST);
            self.write(turn).await;
        }
    }

    /// Takes into `turn` what waits, until it holds `most` jobs: what was sent first, then
    /// broadcasts.
    fn take_waiting(
        &self,
        turn: &mut Turn,
        rx: &mut mpsc::UnboundedReceiver<Outgoing>,
        hub: &Mailbox,
        most: usize,
    ) {
        while turn.jobs < most {
            if let Ok(job) = rx.try_recv() {
                self.take_job(turn, job, hub);
                continue;
            }
            match hub.try_recv() {
                Ok(Some(delivery)) => self.take_broadcast(turn, delivery),
                _ => break,
            }
        }
    }

    fn take_job(&self, turn: &mut Turn, job: Outgoing, hub: &Mailbox) {
        turn.jobs += 1;
        match job {
            Outgoing::Queue {
                agent,
                delivery,
                message,
            } => turn.queuings.push(Queuing {
                agents: vec![agent],
                delivery,
                message,
            }),
            Outgoing::Append(message) => turn.appends.push(message),
            Outgoing::Flush(done) => {
                while let Ok(Some(delivery)) = hub.try_recv() {
                    self.take_broadcast(turn, delivery);
                }
                turn.flushes.push(done);
            }
        }
    }

    /// A message for every Grid program: appended to the scratchpad, and queued for each
    /// program it did not reach: one with no socket, or whose first socket attached after
    /// the message was routed. In a fleet, also for the programs of bridges gone from it.
    fn take_broadcast(&self, turn: &mut Turn, delivery: Arc<Delivery>) {
        turn.jobs += 1;
        let Some(message) = self.encode(&delivery) else {
            return;
        };
        // Through the router, which holds them back while a gone bridge's missed mail is read.
        for orphan in self.core.directory.held_by_gone_bridges(PROTOCOL) {
            if orphan != delivery.envelope.from {
                self.core.router.keep_offline(&orphan, &delivery);
            }
        }
        let agents: Vec<String> = (self.programs.iter())
            .map(|p| p.clone())
            .filter(|p| !self.reached_by_broadcast(p, &delivery))
            .filter(|p| *p != delivery.envelope.from)
            .collect();
        turn.appends.push(message.clone());
        // Kept, even for no program, until the turn is written: what holds the message's
        // acknowledgement waits for its scratchpad entry too.
        turn.queuings.push(Queuing {
            agents,
            delivery,
            message,
        });
    }

    fn reached_by_broadcast(&self, program: &str, delivery: &Delivery) -> bool {
        self.core.router.is_connected(program)
            && self.sockets.attached_by(program, delivery.routed_at)
    }

    /// Writes `turn`: its scratchpad entries, then its queued messages; then answers its
    /// flushes.
    async fn write(&self, turn: Turn) {
        self.append_new(&turn.appends).await;
        let rows = (turn.queuings.iter()).flat_map(|q| {
            let queued = Grid::to_queue(&q.delivery, &q.message);
            (q.agents.iter()).map(move |agent| (agent.clone(), queued.clone()))
        });
        self.keep_queued(rows.collect()).await;
        drop(turn.queuings);
        for done in turn.flushes {
            let _ = done.send(());
        }
    }

    /// Appends to the scratchpad, in one write, each of `messages` it does not hold yet
    /// (once, however many programs a message was kept for). A failed append is tried
    /// again by a message's next copy.
    async fn append_new(&self, messages: &[Value]) {
        let mut ids = HashSet::new();
        let new: Vec<&Value> = (messages.iter())
            .filter(|message| {
                let id = message.get("id").and_then(Value::as_str);
                self.for_scratchpad(id) && id.is_none_or(|id| ids.insert(id))
            })
            .collect();
        if new.is_empty() {
            return;
        }
        match self.append_to_scratchpad(&new).await {
            Ok(()) => {
                for id in ids {
                    self.mark_in_scratchpad(id);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, entries = new.len(), "grid: cannot append to the scratchpad")
            }
        }
    }

    /// Waits until every message accepted so far is in the queue.
    pub async fn flush(&self) {
        let (done, flushed) = oneshot::channel();
        if self.outgoing.send(Outgoing::Flush(done)).is_ok() {
            // An error means the writer stopped (shutdown): nothing more will be written.
            let _ = flushed.await;
        }
    }
}
