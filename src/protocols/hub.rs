//! An endpoint's own session in the router, its hub: it sees, in order, every message its
//! filter wants — whether it names the hub or not, whether any client of the endpoint is
//! connected or not — and the endpoint applies each to its state (the Tracker's and
//! Synapse's task tables, the Grid's queues). Its mailbox never drops: past its capacity
//! messages wait as ids in its backlog (`Router::hub_mailbox`).

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::core::{Core, Delivery, Envelope, Interest, Mailbox, Protocol, Session};

/// Which messages a hub applies.
pub trait HubFilter: Send + Sync + 'static {
    fn wants(&self, env: &Envelope) -> bool;

    /// Whether the hub keeps what it applies as mail for agents away (the Grid's queues):
    /// then what waits in its backlog holds its delivery (`Mailbox::holding`).
    fn keeps_mail(&self) -> bool {
        false
    }
}

/// A filter as the router's interest: the same answer whether a message names the hub or
/// only passes by.
struct Filtered<F>(F);

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
}

impl Hub {
    /// Attaches a hub of `protocol` under `name` (one no client can register).
    pub fn attach(core: &Arc<Core>, protocol: Protocol, name: &str, filter: impl HubFilter) -> Hub {
        let mailbox = core.router.hub_mailbox(protocol, filter.keeps_mail());
        let session = core
            .router
            .attach(name, mailbox, Arc::new(Filtered(filter)));
        Hub {
            core: core.clone(),
            session,
        }
    }

    pub fn mailbox(&self) -> &Mailbox {
        &self.session.mailbox
    }

    /// The next message, in order; `None` once the router lets the hub go. Cancel-safe.
    pub async fn recv(&self) -> Option<Arc<Delivery>> {
        self.session.mailbox.recv().await.ok()
    }

    /// The next message; `None` too once the bridge shuts down.
    pub async fn next(&self, shutdown: &CancellationToken) -> Option<Arc<Delivery>> {
        tokio::select! {
            _ = shutdown.cancelled() => None,
            next = self.recv() => next,
        }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.core.router.detach(&self.session);
    }
}
