//! What an agent's connections sent live while the rest of the fleet may not yet see the
//! agent here.
//!
//! A bridge keeps mail for an agent it takes for away — its own, offline, or one a gone
//! bridge held — until the agent's presence on another bridge reaches it. So when an
//! agent connects to one bridge, a message for it in that moment is sent live by this
//! bridge and may also be kept as the agent's mail by another that does not see it here
//! yet. A connection of the agent takes that mail in its turn (woken to, or when it next
//! takes its backlog) and must not send it twice: it remembers the ids it sent live in
//! its first `ARRIVAL_WINDOW`, and mail taken with one of those ids is dropped — taken, so
//! that no bridge keeps it, and not sent. What a connection sent is final only once it
//! closed (what it then had unsent goes back to the mail, given back with
//! `SentOnArrival::unsent`); from then on the agent's other connections on this bridge know
//! those ids too (`SentOnArrival::closed`), so that one reconnecting at once does not send
//! again a copy kept for it meanwhile. A connection still open shares nothing: dropping a
//! copy for an id it may yet give back would lose the message.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use parking_lot::Mutex;

use super::Kind;

/// How long after a connection opens its live messages are remembered: far longer than
/// the fleet takes to see its agent's presence (a KV watch, milliseconds), so that no
/// bridge still keeps mail for the agent once it ends.
pub const ARRIVAL_WINDOW: Duration = Duration::from_secs(10);

/// How long after a connection opens the ids are kept: the copies bridges kept before
/// the window ended reach this one well within this.
const FORGET_AFTER: Duration = Duration::from_secs(2 * ARRIVAL_WINDOW.as_secs());

/// The most ids one connection remembers (some 100 KiB), and one agent's closed
/// connections together: what it is sent in the fleet's first moments after it connects
/// is far fewer, even under load.
const MOST_REMEMBERED: usize = 1_024;

/// How often the agents whose closed connections' ids are forgotten are let go: at most
/// once a second, not on every connection of a reconnect storm.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The agents whose connections here closed lately, with what those had sent live on
/// arrival (`Core::sent_on_arrival`).
pub struct Arrivals {
    agents: DashMap<String, Arc<Mutex<Closed>>>,
    /// When the agents whose ids are forgotten were last let go.
    swept: Mutex<Instant>,
}

impl Default for Arrivals {
    fn default() -> Self {
        Arrivals {
            agents: DashMap::new(),
            swept: Mutex::new(Instant::now()),
        }
    }
}

impl Arrivals {
    /// What a connection of `agent` opening now remembers: one of a fleet remembers, one of
    /// a bridge alone does not (it keeps mail only while its agent is away, and no other
    /// bridge does).
    pub fn opening(&self, fleet: bool, agent: &str) -> SentOnArrival {
        if !fleet {
            return SentOnArrival(None);
        }
        self.sweep();
        let closed = self.agents.entry(agent.to_owned()).or_default().clone();
        SentOnArrival(Some(Box::new(Arriving {
            opened: Instant::now(),
            remembering: true,
            ids: HashSet::new(),
            closed,
        })))
    }

    fn sweep(&self) {
        {
            let mut swept = self.swept.lock();
            if swept.elapsed() < SWEEP_EVERY {
                return;
            }
            *swept = Instant::now();
        }
        // Not one an open connection of the agent will merge into when it closes.
        (self.agents)
            .retain(|_, closed| Arc::strong_count(closed) > 1 || !closed.lock().forgotten());
    }
}

/// What an agent's closed connections sent live on arrival, each id until twice
/// `ARRIVAL_WINDOW` after the connection that sent it opened.
#[derive(Default)]
struct Closed {
    ids: HashMap<String, Instant>,
}

impl Closed {
    /// Whether every id is let go (none remembered yet, for an agent new here).
    fn forgotten(&self) -> bool {
        let now = Instant::now();
        self.ids.values().all(|until| now >= *until)
    }
}

/// The ids a connection sent live in its first `ARRIVAL_WINDOW`, in a fleet (boxed: every
/// idle connection holds one); none outside one.
#[derive(Default)]
pub struct SentOnArrival(Option<Box<Arriving>>);

struct Arriving {
    opened: Instant,
    /// Whether live messages are still remembered: not once `ARRIVAL_WINDOW` has passed
    /// or `MOST_REMEMBERED` are.
    remembering: bool,
    ids: HashSet<String>,
    /// What the agent's connections that closed lately sent.
    closed: Arc<Mutex<Closed>>,
}

impl SentOnArrival {
    /// Notes that a message of `kind` was sent live under `id` (presence is never anyone's
    /// mail, and is not noted). The ids are let go once no copy kept elsewhere can still
    /// come.
    pub fn sent(&mut self, kind: Kind, id: &str) {
        let Some(arriving) = &mut self.0 else {
            return;
        };
        if !arriving.remembering {
            if arriving.opened.elapsed() >= FORGET_AFTER {
                self.0 = None;
            }
            return;
        }
        if kind.is_presence() {
            return;
        }
        if arriving.opened.elapsed() >= ARRIVAL_WINDOW {
            arriving.remembering = false;
            return;
        }
        if arriving.ids.len() >= MOST_REMEMBERED {
            tracing::debug!("more live messages on a connection's arrival than it remembers");
            arriving.remembering = false;
            return;
        }
        arriving.ids.insert(id.to_owned());
    }

    /// Gives back message `id`, noted as sent but not delivered after all (the connection
    /// is closing with it unsent, and it goes back to the agent's mail).
    pub fn unsent(&mut self, id: &str) {
        if let Some(arriving) = &mut self.0 {
            arriving.ids.remove(id);
        }
    }

    /// Whether message `id` was sent live, by this connection or by one of the agent's
    /// that closed lately: mail with that id is a second copy.
    pub fn was_sent(&mut self, id: &str) -> bool {
        let Some(arriving) = &self.0 else {
            return false;
        };
        if arriving.opened.elapsed() >= FORGET_AFTER {
            self.0 = None;
            return false;
        }
        if arriving.ids.contains(id) {
            return true;
        }
        let closed = arriving.closed.lock();
        (closed.ids.get(id)).is_some_and(|until| Instant::now() < *until)
    }

    /// The connection closed, and what it had unsent is given back: what it sent is final,
    /// and the agent's next connections here know it for as long as this one would have.
    pub fn closed(self) {
        let Some(arriving) = self.0 else {
            return;
        };
        let until = arriving.opened + FORGET_AFTER;
        if arriving.ids.is_empty() || Instant::now() >= until {
            return;
        }
        let mut closed = arriving.closed.lock();
        let now = Instant::now();
        closed.ids.retain(|_, until| now < *until);
        let room = MOST_REMEMBERED.saturating_sub(closed.ids.len());
        let ids = arriving.ids.into_iter().take(room);
        closed.ids.extend(ids.map(|id| (id, until)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opening(agent: &str) -> (Arrivals, SentOnArrival) {
        let arrivals = Arrivals::default();
        let sent = arrivals.opening(true, agent);
        (arrivals, sent)
    }

    /// Moves the connection's opening `by` into the past.
    fn age(sent: &mut SentOnArrival, by: Duration) {
        sent.0.as_mut().unwrap().opened -= by;
    }

    #[test]
    fn a_connection_of_a_fleet_remembers_what_it_sent_on_arrival() {
        let (_arrivals, mut sent) = opening("a");
        sent.sent(Kind::Chat, "m1");
        assert!(sent.was_sent("m1"));
        assert!(!sent.was_sent("m2"));
    }

    #[test]
    fn a_connection_of_a_bridge_alone_remembers_nothing() {
        let mut sent = Arrivals::default().opening(false, "a");
        sent.sent(Kind::Chat, "m1");
        assert!(!sent.was_sent("m1"));
    }

    #[test]
    fn the_next_connection_knows_what_a_closed_one_sent_and_did_not_give_back() {
        let (arrivals, mut first) = opening("a");
        let mut beside = arrivals.opening(true, "a");
        first.sent(Kind::Chat, "sent");
        first.sent(Kind::Chat, "unsent");
        // While it is open, what it sent may yet come back: nobody else drops it.
        assert!(!beside.was_sent("sent"));
        first.unsent("unsent");
        first.closed();
        assert!(beside.was_sent("sent"));
        let mut next = arrivals.opening(true, "a");
        assert!(next.was_sent("sent"));
        assert!(!next.was_sent("unsent"));
        let mut other = arrivals.opening(true, "b");
        assert!(!other.was_sent("sent"));
    }

    #[test]
    fn what_is_sent_after_the_window_is_not_remembered() {
        let (_arrivals, mut sent) = opening("a");
        sent.sent(Kind::Chat, "early");
        age(&mut sent, ARRIVAL_WINDOW);
        sent.sent(Kind::Chat, "late");
        assert!(sent.was_sent("early"));
        assert!(!sent.was_sent("late"));
    }

    #[test]
    fn presence_is_not_remembered() {
        let (_arrivals, mut sent) = opening("a");
        sent.sent(Kind::PresenceJoin, "join");
        assert!(!sent.was_sent("join"));
    }

    #[test]
    fn what_was_sent_on_arrival_is_let_go_as_more_is_sent() {
        let (_arrivals, mut sent) = opening("a");
        sent.sent(Kind::Chat, "early");
        age(&mut sent, FORGET_AFTER);
        sent.sent(Kind::Chat, "late");
        sent.sent(Kind::Chat, "later");
        assert!(sent.0.is_none());
    }

    #[test]
    fn what_was_sent_on_arrival_is_let_go_in_the_end() {
        let (arrivals, mut sent) = opening("a");
        sent.sent(Kind::Chat, "early");
        age(&mut sent, FORGET_AFTER);
        assert!(!sent.was_sent("early"));
        assert!(sent.0.is_none());
        // A connection closing that long after it opened leaves nothing for the next.
        let mut old = arrivals.opening(true, "a");
        old.sent(Kind::Chat, "old");
        age(&mut old, FORGET_AFTER);
        old.closed();
        assert!(!arrivals.opening(true, "a").was_sent("old"));
    }

    #[test]
    fn a_closed_connections_ids_are_let_go_in_the_end() {
        let (arrivals, mut first) = opening("a");
        first.sent(Kind::Chat, "m1");
        first.closed();
        {
            let entry = arrivals.agents.get("a").unwrap();
            let mut closed = entry.lock();
            closed
                .ids
                .values_mut()
                .for_each(|until| *until = Instant::now());
        }
        assert!(!arrivals.opening(true, "a").was_sent("m1"));
        *arrivals.swept.lock() -= SWEEP_EVERY;
        let _other = arrivals.opening(true, "b");
        assert!(!arrivals.agents.contains_key("a"));
    }

    #[test]
    fn at_most_so_many_ids_are_remembered() {
        let (_arrivals, mut sent) = opening("a");
        for i in 0..MOST_REMEMBERED + 10 {
            sent.sent(Kind::Chat, &i.to_string());
        }
        assert!(sent.was_sent("0"));
        assert!(!sent.was_sent(&MOST_REMEMBERED.to_string()));
    }

    #[test]
    fn a_sweep_keeps_what_an_open_connection_will_close_into() {
        let (arrivals, mut open) = opening("a");
        open.sent(Kind::Chat, "m1");
        *arrivals.swept.lock() -= SWEEP_EVERY;
        let _other = arrivals.opening(true, "b");
        open.closed();
        assert!(arrivals.opening(true, "a").was_sent("m1"));
    }

    #[test]
    fn each_closed_connections_ids_last_as_long_as_it_would_have() {
        let (arrivals, mut older) = opening("a");
        older.sent(Kind::Chat, "older");
        age(&mut older, ARRIVAL_WINDOW);
        older.closed();
        let mut newer = arrivals.opening(true, "a");
        newer.sent(Kind::Chat, "newer");
        newer.closed();
        let mut next = arrivals.opening(true, "a");
        assert!(next.was_sent("older") && next.was_sent("newer"));
        // The older connection's ids go when it would have let them go.
        *arrivals
            .agents
            .get("a")
            .unwrap()
            .lock()
            .ids
            .get_mut("older")
            .unwrap() = Instant::now();
        assert!(!next.was_sent("older"));
        assert!(next.was_sent("newer"));
    }
}
