//! An endpoint's own session in the router, its hub: it sees, in order, every message its
//! filter wants — whether it names the hub or not, whether any client of the endpoint is
//! connected or not — and the endpoint applies each to its state (the Tracker's and
//! Synapse's task tables, the Grid's queues). Its mailbox never drops: past its capacity
//! messages wait as ids in its backlog (`Router::hub_mailbox`).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio_util::sync::CancellationToken;

use crate::core::{Core, Delivery, Envelope, Interest, Mailbox, Protocol, Session};

/// How many of the newest task messages a hub looks through as it catches up: a hub
/// further behind than that when its bridge stopped does not apply the oldest it missed.
const CATCH_UP_AT_MOST: usize = 10_000;
/// How many of its applied marks a hub keeps: the mark of any message among the newest
/// `CATCH_UP_AT_MOST` is among them.
const MARKS_KEPT: usize = 2 * CATCH_UP_AT_MOST;
/// Task messages read at once as a hub catches up.
const CATCH_UP_PAGE: usize = 256;
/// Marks made between two prunings of a hub's old marks.
const PRUNE_EVERY: usize = 4096;

/// Which messages a hub applies.
pub trait HubFilter: Send + Sync + 'static {
    fn wants(&self, env: &Envelope) -> bool;

    /// Whether the hub, catching up after a restart (`Hub::catch_up`), applies a message
    /// routed to it before: as `wants`, less what only held as the message was routed
    /// (its sender connected then).
    fn wants_again(&self, env: &Envelope) -> bool {
        self.wants(env)
    }

    /// Whether the hub keeps what it applies as mail for agents away (the Grid's queues):
    /// then what waits in its backlog holds its delivery (`Mailbox::holding`).
    fn keeps_mail(&self) -> bool {
        false
    }
}

/// A filter as the router's interest: the same answer whether a message names the hub or
/// only passes by.
struct Filtered<F>(Arc<F>);

impl<F: HubFilter> Interest for Filtered<F> {
    fn observes(&self, env: &Envelope) -> bool {
        self.0.wants(env)
    }

    fn accepts(&self, env: &Envelope) -> bool {
        self.0.wants(env)
    }
}

/// A hub's session; detached when dropped.
pub struct Hub {
    core: Arc<Core>,
    session: Arc<Session>,
    protocol: Protocol,
    filter: Arc<dyn HubFilter>,
    /// The messages it applied as it caught up, or before the restart, passed over if they
    /// are routed to it too.
    caught_up: parking_lot::Mutex<HashSet<String>>,
    marked: AtomicUsize,
}

impl Hub {
    /// Attaches a hub of `protocol` under `name` (one no client can register).
    pub fn attach(core: &Arc<Core>, protocol: Protocol, name: &str, filter: impl HubFilter) -> Hub {
        let mailbox = core.router.hub_mailbox(protocol, filter.keeps_mail());
        let filter = Arc::new(filter);
        let session = core
            .router
            .attach(name, mailbox, Arc::new(Filtered(filter.clone())));
        Hub {
            core: core.clone(),
            session,
            protocol,
            filter,
            caught_up: parking_lot::Mutex::default(),
            marked: AtomicUsize::new(0),
        }
    }

    /// Runs a hub that applies task messages to its endpoint's tables, until `shutdown`:
    /// first applies with `again` what it missed before its bridge restarted
    /// (`catch_up`), then applies with `live` each message routed to it (but for those it
    /// just caught up on), marking every task message applied once it is done with it.
    pub async fn apply<F, G>(
        &self,
        shutdown: &CancellationToken,
        again: impl FnMut(Envelope) -> F,
        mut live: impl FnMut(Arc<Delivery>) -> G,
    ) where
        F: Future<Output = ()>,
        G: Future<Output = ()>,
    {
        self.catch_up(shutdown, again).await;
        while let Some(delivery) = self.next(shutdown).await {
            live(delivery.clone()).await;
            self.applied(&delivery);
        }
    }

    /// Applies, with `apply`, the task messages the log holds that this hub wants and has
    /// not marked applied (`applied`): those it was routed before its bridge last stopped,
    /// or was killed, and had not applied then; in the order stored, read a page at a
    /// time. Called once, as the hub starts: what is routed to it meanwhile waits in its
    /// mailbox.
    async fn catch_up<F>(&self, shutdown: &CancellationToken, mut apply: impl FnMut(Envelope) -> F)
    where
        F: Future<Output = ()>,
    {
        let marks = &self.core.applied;
        let failed = |e: crate::core::LogError| {
            tracing::error!(error = %e, hub = self.protocol, "cannot read what the hub missed");
        };
        let mut window = match marks.catch_up_window(self.protocol, CATCH_UP_AT_MOST).await {
            Ok(window) => window,
            Err(e) => return failed(e),
        };
        let through = window.through;
        let mut applied = 0;
        loop {
            let page = match marks
                .unapplied_tasks(self.protocol, window, CATCH_UP_PAGE)
                .await
            {
                Ok(page) => page,
                Err(e) => return failed(e),
            };
            let Some(last) = page.last() else { break };
            window.after = last.seq;
            for stored in page {
                if shutdown.is_cancelled() {
                    return;
                }
                let env = stored.envelope;
                if !self.filter.wants_again(&env) {
                    continue;
                }
                let id = env.id.clone();
                self.caught_up.lock().insert(id.clone());
                apply(env).await;
                self.mark(&id);
                applied += 1;
            }
        }
        if applied > 0 {
            tracing::info!(
                hub = self.protocol,
                applied,
                "applied the task messages the hub had missed"
            );
        }
        match marks.caught_up(self.protocol, through).await {
            // Applied before the restart: passed over too if they are routed again (a fleet
            // routes again what its consumer had not acknowledged).
            Ok(marked) => self.caught_up.lock().extend(marked),
            Err(e) => {
                tracing::error!(error = %e, hub = self.protocol, "cannot keep how far the hub caught up")
            }
        }
    }

    /// Marks a delivery applied, once `apply` is done with it (`catch_up`).
    fn applied(&self, delivery: &Delivery) {
        if delivery.stored && delivery.envelope.task.is_some() {
            self.mark(&delivery.envelope.id);
        }
    }

    fn mark(&self, id: &str) {
        let marked = self.marked.fetch_add(1, Ordering::Relaxed) + 1;
        let prune = marked.is_multiple_of(PRUNE_EVERY).then_some(MARKS_KEPT);
        // Queued at the call, after the writes of what it marks.
        drop(self.core.applied.mark_applied(self.protocol, id, prune));
    }

    pub fn mailbox(&self) -> &Mailbox {
        &self.session.mailbox
    }

    /// The next message, in order; `None` once the router lets the hub go. Cancel-safe.
    pub async fn recv(&self) -> Option<Arc<Delivery>> {
        self.session.mailbox.recv().await.ok()
    }

    /// The next message, but for those it applied as it caught up; `None` too once the
    /// bridge shuts down.
    async fn next(&self, shutdown: &CancellationToken) -> Option<Arc<Delivery>> {
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => None,
                next = self.recv() => next,
            }?;
            let mut caught_up = self.caught_up.lock();
            if caught_up.is_empty() || !caught_up.remove(&next.envelope.id) {
                return Some(next);
            }
        }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.core.router.detach(&self.session);
    }
}
