//! Which Grid programs have a socket open, for which instances, and since when.
//!
//! The router knows sessions, not instances, and cannot tell when a program's first socket
//! attached; the Grid needs both: a message for an instance with no socket must still be
//! kept by some socket of the agent (to be queued), and a broadcast routed before a
//! program's first socket attached must be queued for it, since that socket never saw it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use dashmap::DashMap;
use tokio::sync::Notify;

/// One program's open sockets.
struct Open {
    /// When the first of them attached to the router; `None` until it has.
    since: Option<Instant>,
    /// Oldest first.
    sockets: Vec<OpenSocket>,
}

struct OpenSocket {
    id: u64,
    instance: Option<String>,
    /// Wakes the socket to take what was queued for its agent (`Sockets::wake`).
    wake: Arc<Notify>,
}

#[derive(Default)]
pub struct Sockets {
    by_agent: DashMap<String, Open>,
    next: AtomicU64,
}

impl Sockets {
    /// Records a socket about to attach, woken by `wake`; returns its id and whether it is
    /// the agent's first.
    pub fn open(&self, agent: &str, instance: Option<&str>, wake: Arc<Notify>) -> (u64, bool) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut open = self.by_agent.entry(agent.to_owned()).or_insert(Open {
            since: None,
            sockets: Vec::new(),
        });
        let instance = instance.map(str::to_owned);
        open.sockets.push(OpenSocket { id, instance, wake });
        (id, open.sockets.len() == 1)
    }

    /// Wakes the agent's sockets that take what was queued for it, for `instance` if it
    /// names one, while they are open.
    pub fn wake(&self, agent: &str, instance: Option<&str>) {
        if let Some(open) = self.by_agent.get(agent) {
            for socket in &open.sockets {
                if instance.is_none() || socket.instance.as_deref() == instance {
                    socket.wake.notify_one();
                }
            }
        }
    }

    /// Records that the agent's socket has attached to the router (the first time counts).
    pub fn attached(&self, agent: &str) {
        if let Some(mut open) = self.by_agent.get_mut(agent) {
            open.since.get_or_insert_with(Instant::now);
        }
    }

    /// Forgets a socket; true when it was the agent's last.
    pub fn close(&self, agent: &str, id: u64) -> bool {
        let last = match self.by_agent.get_mut(agent) {
            Some(mut open) => {
                open.sockets.retain(|socket| socket.id != id);
                open.sockets.is_empty()
            }
            None => true,
        };
        if last {
            self.by_agent
                .remove_if(agent, |_, open| open.sockets.is_empty());
        }
        last
    }

    /// Whether the agent has had a socket attached since `at` or earlier, so that a message
    /// routed to everyone at `at` reached it.
    pub fn attached_by(&self, agent: &str, at: Instant) -> bool {
        self.by_agent
            .get(agent)
            .and_then(|open| open.since)
            .is_some_and(|since| since <= at)
    }

    /// Whether socket `id` keeps a message for `instance` of `agent`: the agent's oldest
    /// socket does when that instance has none, so that exactly one takes it (to queue it).
    /// With no socket recorded, every session still attached keeps it: it is closing and
    /// will queue what it holds.
    pub fn keeps_for(&self, agent: &str, instance: &str, id: u64) -> bool {
        let Some(open) = self.by_agent.get(agent) else {
            return true;
        };
        let live = open
            .sockets
            .iter()
            .any(|socket| socket.instance.as_deref() == Some(instance));
        !live && open.sockets.first().is_some_and(|socket| socket.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_socket_keeps_what_is_for_an_absent_instance() {
        let sockets = Sockets::default();
        let (a, first) = sockets.open("executor", Some("exec-001"), Default::default());
        assert!(first);
        let (b, first) = sockets.open("executor", None, Default::default());
        assert!(!first);
        assert!(sockets.keeps_for("executor", "exec-002", a));
        assert!(!sockets.keeps_for("executor", "exec-002", b));
        let (c, _) = sockets.open("executor", Some("exec-002"), Default::default());
        assert!(
            !sockets.keeps_for("executor", "exec-002", a),
            "exec-002 is there"
        );
        assert!(!sockets.close("executor", a));
        assert!(sockets.keeps_for("executor", "exec-001", b));
        assert!(!sockets.close("executor", c));
        assert!(sockets.close("executor", b));
        assert!(
            sockets.keeps_for("executor", "exec-002", b),
            "closing: keep, to queue"
        );
    }

    #[test]
    fn a_program_is_attached_from_its_first_socket_on() {
        let sockets = Sockets::default();
        let before = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(1));
        let (a, _) = sockets.open("mc", None, Default::default());
        assert!(
            !sockets.attached_by("mc", Instant::now()),
            "not attached yet"
        );
        sockets.attached("mc");
        let after = Instant::now();
        assert!(sockets.attached_by("mc", after));
        assert!(!sockets.attached_by("mc", before));
        let (b, _) = sockets.open("mc", None, Default::default());
        sockets.attached("mc");
        assert!(
            !sockets.attached_by("mc", before),
            "the first socket's time counts"
        );
        sockets.close("mc", a);
        sockets.close("mc", b);
        assert!(!sockets.attached_by("mc", Instant::now()));
    }
}
