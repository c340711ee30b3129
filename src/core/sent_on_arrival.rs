//! What an agent's connections sent live while the rest of the fleet may not yet see the
//! agent here.
//!
//! A bridge keeps mail for an agent it takes for away — its own, offline, or one a gone
//! bridge held — until the agent's presence on another bridge reaches it. So when an
//! agent connects to one bridge, a message for it in that moment is sent live by this
//! bridge and may also be kept as the agent's mail by another that does not see it here
//! yet. A connection of the agent takes that mail in its turn (woken to, when it next
//! takes its backlog, or a connection opened after the one that was sent it live) and
//! must not send it twice: the agent's connections on this bridge remember together the
//! ids they sent live in the `ARRIVAL_WINDOW` after the latest of them opened, and mail
//! taken with one of those ids is dropped — taken, so that no bridge keeps it, and not
//! sent. A connection that closes with some of them unsent after all gives them back
//! (`SentOnArrival::unsent`) as they go back to the agent's mail, to be sent from there.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dashmap::DashMap;

use super::Kind;

/// How long after a connection opens its live messages are remembered: far longer than
/// the fleet takes to see its agent's presence (a KV watch, milliseconds), so that no
/// bridge still keeps mail for the agent once it ends.
pub const ARRIVAL_WINDOW: Duration = Duration::from_secs(10);

/// How long after a connection opens the ids are kept: the copies bridges kept before
/// the window ended reach this one well within this.
const FORGET_AFTER: Duration = Duration::from_secs(2 * ARRIVAL_WINDOW.as_secs());

/// The most ids one agent's connections remember (some 100 KiB): what it is sent in the
/// fleet's first moments after it connects is far fewer, even under load.
const MOST_REMEMBERED: usize = 1_024;

/// The agents that connected here lately, each with what its connections sent live since
/// (`Core::sent_on_arrival`).
pub struct Arrivals {
    agents: DashMap<String, Arc<Mutex<Arriving>>>,
    /// When the agents whose arrival is forgotten were last let go.
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

/// How often the agents whose arrival is forgotten are let go: at most once a second, not
/// on every connection of a reconnect storm.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

impl Arrivals {
    /// What a connection of `agent` opening now remembers, with the agent's other
    /// connections here: one of a fleet remembers, one of a bridge alone does not (it keeps
    /// mail only while its agent is away, and no other bridge does).
    pub fn opening(&self, fleet: bool, agent: &str) -> SentOnArrival {
        if !fleet {
            return SentOnArrival(None);
        }
        self.sweep();
        let arriving = self.agents.entry(agent.to_owned()).or_default().clone();
        lock(&arriving).opened_again();
        SentOnArrival(Some(Box::new(Share {
            arriving,
            noted: HashSet::new(),
        })))
    }

    fn sweep(&self) {
        {
            let mut swept = self.swept.lock().unwrap_or_else(|e| e.into_inner());
            if swept.elapsed() < SWEEP_EVERY {
                return;
            }
            *swept = Instant::now();
        }
        self.agents
            .retain(|_, arriving| !lock(arriving).forgotten());
    }
}

/// The ids an agent's connections sent live since the latest of them opened, each with how
/// many of them sent it and did not give it back.
struct Arriving {
    opened: Instant,
    /// Whether live messages are still remembered: not once `ARRIVAL_WINDOW` has passed
    /// or `MOST_REMEMBERED` are.
    remembering: bool,
    ids: HashMap<String, u32>,
}

impl Default for Arriving {
    fn default() -> Self {
        Arriving {
            opened: Instant::now(),
            remembering: true,
            ids: HashMap::new(),
        }
    }
}

impl Arriving {
    /// Another connection of the agent opened: its window starts now.
    fn opened_again(&mut self) {
        self.opened = Instant::now();
        self.remembering = self.ids.len() < MOST_REMEMBERED;
    }

    /// Whether no copy of what was remembered can still come.
    fn forgotten(&self) -> bool {
        self.opened.elapsed() >= FORGET_AFTER
    }
}

fn lock(arriving: &Mutex<Arriving>) -> MutexGuard<'_, Arriving> {
    arriving.lock().unwrap_or_else(|e| e.into_inner())
}

/// A connection's share of its agent's `Arriving`, in a fleet (boxed: every idle
/// connection holds one); none outside one.
#[derive(Default)]
pub struct SentOnArrival(Option<Box<Share>>);

struct Share {
    arriving: Arc<Mutex<Arriving>>,
    /// What this connection noted: only those it can give back.
    noted: HashSet<String>,
}

impl SentOnArrival {
    /// Notes that a message of `kind` was sent live under `id` (presence is never anyone's
    /// mail, and is not noted). The connection lets the ids go once no copy kept
    /// elsewhere can still come.
    pub fn sent(&mut self, kind: Kind, id: &str) {
        let Some(share) = &mut self.0 else {
            return;
        };
        let mut arriving = lock(&share.arriving);
        if !arriving.remembering {
            if arriving.forgotten() {
                drop(arriving);
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
            tracing::debug!("more live messages on an agent's arrival than it remembers");
            arriving.remembering = false;
            return;
        }
        if share.noted.insert(id.to_owned()) {
            *arriving.ids.entry(id.to_owned()).or_default() += 1;
        }
    }

    /// Gives back message `id`, noted as sent but not delivered after all (the connection
    /// closed with it unsent, and it goes back to the agent's mail): a connection of the
    /// agent that takes it from there sends it, unless another one was sent it too.
    pub fn unsent(&mut self, id: &str) {
        let Some(share) = &mut self.0 else {
            return;
        };
        if !share.noted.remove(id) {
            return;
        }
        let mut arriving = lock(&share.arriving);
        if let Some(count) = arriving.ids.get_mut(id) {
            *count -= 1;
            if *count == 0 {
                arriving.ids.remove(id);
            }
        }
    }

    /// Whether message `id` was sent live to a connection of the agent: mail with that id
    /// is a second copy. What is remembered is let go once no such copy can still come.
    pub fn was_sent(&mut self, id: &str) -> bool {
        let Some(share) = &self.0 else {
            return false;
        };
        let arriving = lock(&share.arriving);
        if arriving.forgotten() {
            drop(arriving);
            self.0 = None;
            return false;
        }
        arriving.ids.contains_key(id)
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

    /// Moves the agent's arrival `by` into the past.
    fn age(sent: &SentOnArrival, by: Duration) {
        lock(&sent.0.as_ref().unwrap().arriving).opened -= by;
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
    fn an_agents_connections_remember_together() {
        let (arrivals, mut first) = opening("a");
        first.sent(Kind::Chat, "m1");
        drop(first);
        // Opened after the first closed, or beside it: it knows what the first was sent.
        let mut second = arrivals.opening(true, "a");
        assert!(second.was_sent("m1"));
        second.sent(Kind::Chat, "m2");
        let mut other = arrivals.opening(true, "b");
        assert!(!other.was_sent("m1"));
        assert!(!other.was_sent("m2"));
    }

    #[test]
    fn what_a_connection_gives_back_unsent_is_not_taken_for_sent() {
        let (arrivals, mut first) = opening("a");
        first.sent(Kind::Chat, "both");
        first.sent(Kind::Chat, "unsent");
        let mut second = arrivals.opening(true, "a");
        second.sent(Kind::Chat, "both");
        first.unsent("both");
        first.unsent("unsent");
        // Given back by one, and still sent to the other.
        assert!(second.was_sent("both"));
        assert!(!second.was_sent("unsent"));
        // What a connection did not note, it cannot give back.
        second.unsent("never");
        first.unsent("both");
        assert!(second.was_sent("both"));
    }

    #[test]
    fn a_connection_opening_starts_the_window_again() {
        let (arrivals, mut first) = opening("a");
        first.sent(Kind::Chat, "early");
        age(&first, ARRIVAL_WINDOW);
        first.sent(Kind::Chat, "unremembered");
        let mut second = arrivals.opening(true, "a");
        first.sent(Kind::Chat, "again");
        assert!(second.was_sent("early"));
        assert!(!second.was_sent("unremembered"));
        assert!(second.was_sent("again"));
    }

    #[test]
    fn what_is_sent_after_the_window_is_not_remembered() {
        let (_arrivals, mut sent) = opening("a");
        sent.sent(Kind::Chat, "early");
        age(&sent, ARRIVAL_WINDOW);
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
        age(&sent, FORGET_AFTER);
        sent.sent(Kind::Chat, "late");
        sent.sent(Kind::Chat, "later");
        assert!(sent.0.is_none());
    }

    #[test]
    fn what_was_sent_on_arrival_is_let_go_in_the_end() {
        let (arrivals, mut sent) = opening("a");
        sent.sent(Kind::Chat, "early");
        age(&sent, FORGET_AFTER);
        assert!(!sent.was_sent("early"));
        assert!(sent.0.is_none());
        // And the bridge forgets the agent's arrival as another opens, a sweep later.
        *arrivals.swept.lock().unwrap() -= SWEEP_EVERY;
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
}
