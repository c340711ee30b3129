//! The writer: the one task that keeps messages for programs that are not connected —
//! queued for polling (or a program's next socket) and appended to the scratchpad — and
//! keeps every broadcast for the programs it did not reach.
//!
//! It works in turns. A turn takes in whatever waits, up to `TURN_AT_MOST` jobs, in the
//! order they were routed (`Inputs`), appends its new scratchpad entries in one write and
//! queues its messages together, in that order: in one store commit and, in a fleet, as
//! records sent one after another and answered together
//! (`SharedRecords::write_unused_in_order`), whose revisions are the queue's order. So a flood to a program away is written at the rate of batches, not of
//! one SQLite write, one file append and one NATS round trip a message.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{Grid, PROTOCOL};
use crate::core::Delivery;
use crate::protocols::hub::Hub;

/// Work for the writer.
pub(super) enum Outgoing {
    /// Queue for a program that polls, and append to the scratchpad when `append`.
    Queue {
        agent: String,
        delivery: Arc<Delivery>,
        message: Value,
        append: bool,
    },
    /// Answered once everything sent before it, and every broadcast routed before it
    /// (`asked_at`), is written: a poll waits for this, so it sees every message accepted
    /// before it.
    Flush {
        done: oneshot::Sender<()>,
        asked_at: Instant,
    },
}

impl Outgoing {
    /// Where the job goes among the hub's broadcasts.
    fn routed_at(&self) -> Instant {
        match self {
            Outgoing::Queue { delivery, .. } => delivery.routed_at,
            Outgoing::Flush { asked_at, .. } => *asked_at,
        }
    }
}

/// The writer's two inputs — what is kept for one program, and the hub's broadcasts —
/// read as one, in the order their messages were routed: a program's direct messages and
/// broadcasts from one sender are queued in the order sent, and a flush comes after every
/// broadcast routed before it was asked for. The job channel is in that order already; the
/// hub's mailbox hands out higher priorities first, so what it holds is taken in at once
/// and put back in routing order here (a queue puts priorities first anyway).
struct Inputs {
    jobs: mpsc::UnboundedReceiver<Outgoing>,
    hub: Hub,
    next_job: Option<Outgoing>,
    /// Broadcasts taken from the hub, in routing order.
    broadcasts: VecDeque<Arc<Delivery>>,
}

enum Next {
    Job(Outgoing),
    Broadcast(Arc<Delivery>),
}

enum Waited {
    Ready,
    Stopping,
    Closed,
}

impl Inputs {
    /// Whether broadcasts wait in the hub's backlog (ids kept past its mailbox, read back
    /// only by `recv`) with none taken in: they may have been routed before the next job.
    fn backlog_first(&self) -> bool {
        self.broadcasts.is_empty() && !self.hub.mailbox().is_empty()
    }

    /// Waits until either input has something the writer can take.
    async fn wait(&mut self, shutdown: &CancellationToken) -> Waited {
        while self.next_job.is_some() && self.backlog_first() {
            // Looked at again now and then: what the backlog read back may all have
            // expired, leaving `recv` nothing to return.
            tokio::select! {
                next = self.hub.recv() => match next {
                    Some(delivery) => self.broadcasts.push_back(delivery),
                    None => return Waited::Closed,
                },
                _ = tokio::time::sleep(BACKLOG_RECHECK) => {}
                _ = shutdown.cancelled() => return Waited::Stopping,
            }
        }
        if self.next_job.is_some() || !self.broadcasts.is_empty() {
            return Waited::Ready;
        }
        tokio::select! {
            biased;
            job = self.jobs.recv() => match job {
                Some(job) => self.next_job = Some(job),
                None => return Waited::Closed,
            },
            next = self.hub.recv() => match next {
                Some(delivery) => self.broadcasts.push_back(delivery),
                None => return Waited::Closed,
            },
            _ = shutdown.cancelled() => return Waited::Stopping,
        }
        Waited::Ready
    }

    /// Of what waits in the two inputs, the one routed first.
    fn next(&mut self) -> Option<Next> {
        if self.next_job.is_none() {
            self.next_job = self.jobs.try_recv().ok();
        }
        // After the job: a broadcast routed before it is in the hub by now. Each goes in
        // after those routed no later (mostly at the end: one priority comes in order).
        while let Ok(Some(delivery)) = self.hub.mailbox().try_recv() {
            let at = (self.broadcasts).partition_point(|b| b.routed_at <= delivery.routed_at);
            self.broadcasts.insert(at, delivery);
        }
        let broadcast_first = match (&self.next_job, self.broadcasts.front()) {
            (Some(job), Some(broadcast)) => broadcast.routed_at < job.routed_at(),
            (None, Some(_)) => true,
            // What the backlog holds is read back first (`wait`). (Once some broadcasts
            // are taken in, the backlog's are newer than them: it is read back in order.)
            (Some(_), None) if self.backlog_first() => return None,
            _ => false,
        };
        if broadcast_first {
            self.broadcasts.pop_front().map(Next::Broadcast)
        } else {
            self.next_job.take().map(Next::Job)
        }
    }
}

/// How often a job waiting for the hub's backlog to be read back looks again.
const BACKLOG_RECHECK: std::time::Duration = std::time::Duration::from_millis(20);

/// The jobs one turn takes in at most: enough for a batch to pay for its commit, few
/// enough that a turn's writes are not held back long by one slow record write.
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
    /// here rather than by a task of its own, so that broadcasts take their place among the
    /// other jobs in routing order (`Inputs`).
    pub(super) async fn write_outgoing(
        self: Arc<Self>,
        jobs: mpsc::UnboundedReceiver<Outgoing>,
        hub: Hub,
    ) {
        let mut inputs = Inputs {
            jobs,
            hub,
            next_job: None,
            broadcasts: VecDeque::new(),
        };
        loop {
            // At shutdown, what is already waiting is still written.
            let most = match inputs.wait(&self.shutdown).await {
                Waited::Ready => TURN_AT_MOST,
                Waited::Stopping => usize::MAX,
                Waited::Closed => break,
            };
            let mut turn = Turn::default();
            while turn.jobs < most {
                match inputs.next() {
                    Some(Next::Job(job)) => self.take_job(&mut turn, job),
                    Some(Next::Broadcast(delivery)) => self.take_broadcast(&mut turn, delivery),
                    None => break,
                }
            }
            self.write(turn).await;
            if most == usize::MAX {
                break;
            }
        }
    }

    fn take_job(&self, turn: &mut Turn, job: Outgoing) {
        turn.jobs += 1;
        match job {
            Outgoing::Queue {
                agent,
                delivery,
                message,
                append,
            } => {
                if append {
                    turn.appends.push(message.clone());
                }
                turn.queuings.push(Queuing {
                    agents: vec![agent],
                    delivery,
                    message,
                })
            }
            Outgoing::Flush { done, .. } => turn.flushes.push(done),
        }
    }

    /// A message for every Grid program: appended to the scratchpad, and queued for each
    /// program it did not reach: one with no socket, or whose first socket attached after
    /// the message was routed. In a fleet, also for the programs of bridges gone from it.
    /// One routed again after a restart is queued only for the programs it is for
    /// (`Delivery::is_kept_for`).
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
            .filter(|p| *p != delivery.envelope.from && delivery.is_kept_for(p))
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
        let messages = (turn.queuings.iter())
            .filter(|q| !q.agents.is_empty())
            .map(|q| (q.agents.clone(), Grid::to_queue(&q.delivery, &q.message)));
        self.keep_queued(messages.collect()).await;
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
        let asked_at = Instant::now();
        if self
            .outgoing
            .send(Outgoing::Flush { done, asked_at })
            .is_ok()
        {
            // An error means the writer stopped (shutdown): nothing more will be written.
            let _ = flushed.await;
        }
    }
}
