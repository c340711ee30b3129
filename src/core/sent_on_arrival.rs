//! What a connection sent live while the rest of the fleet may not yet see its agent here.
//!
//! A bridge keeps mail for an agent it takes for away — its own, offline, or one a gone
//! bridge held — until the agent's presence on another bridge reaches it. So when an
//! agent connects to one bridge, a message for it in that moment is sent live by this
//! bridge and may also be kept as the agent's mail by another that does not see it here
//! yet. The connection takes that mail in its turn (woken to, or when it next takes its
//! backlog) and must not send it twice: it remembers the ids it sent live in its first
//! `ARRIVAL_WINDOW`, and mail taken with one of those ids is dropped — taken, so that no
//! bridge keeps it, and not sent.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::Kind;

/// How long after a connection opens its live messages are remembered: far longer than
/// the fleet takes to see its agent's presence (a KV watch, milliseconds), so that no
/// bridge still keeps mail for the agent once it ends.
pub const ARRIVAL_WINDOW: Duration = Duration::from_secs(10);

/// How long after a connection opens the ids are kept: the copies bridges kept before
/// the window ended reach this one well within this.
const FORGET_AFTER: Duration = Duration::from_secs(2 * ARRIVAL_WINDOW.as_secs());

/// The most ids one connection remembers (some 100 KiB): what it is sent in the fleet's
/// first moments after it opens is far fewer, even under load.
const MOST_REMEMBERED: usize = 1_024;

/// The ids a connection sent live in its first `ARRIVAL_WINDOW`, in a fleet. Boxed, and
/// none outside a fleet: every idle connection holds one.
#[derive(Default)]
pub struct SentOnArrival(Option<Box<Arriving>>);

struct Arriving {
    opened: Instant,
    /// Whether live messages are still remembered: not once `ARRIVAL_WINDOW` has passed
    /// or `MOST_REMEMBERED` are.
    remembering: bool,
    ids: HashSet<String>,
}

impl SentOnArrival {
    /// For a connection opening now: one of a fleet remembers, one of a bridge alone does
    /// not (it keeps mail only while its agent is away, and no other bridge does).
    pub fn opening(fleet: bool) -> Self {
        SentOnArrival(fleet.then(|| {
            Box::new(Arriving {
                opened: Instant::now(),
                remembering: true,
                ids: HashSet::new(),
            })
        }))
    }

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

    /// Whether message `id` was sent live: mail with that id is a second copy. What is
    /// remembered is let go once no such copy can still come.
    pub fn was_sent(&mut self, id: &str) -> bool {
        let Some(arriving) = &self.0 else {
            return false;
        };
        if arriving.opened.elapsed() >= FORGET_AFTER {
            self.0 = None;
            return false;
        }
        arriving.ids.contains(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_of_a_fleet_remembers_what_it_sent_on_arrival() {
        let mut sent = SentOnArrival::opening(true);
        sent.sent(Kind::Chat, "m1");
        assert!(sent.was_sent("m1"));
        assert!(!sent.was_sent("m2"));
    }

    #[test]
    fn a_connection_of_a_bridge_alone_remembers_nothing() {
        let mut sent = SentOnArrival::opening(false);
        sent.sent(Kind::Chat, "m1");
        assert!(!sent.was_sent("m1"));
    }

    #[test]
    fn what_is_sent_after_the_window_is_not_remembered() {
        let mut sent = SentOnArrival::opening(true);
        sent.sent(Kind::Chat, "early");
        sent.0.as_mut().unwrap().opened -= ARRIVAL_WINDOW;
        sent.sent(Kind::Chat, "late");
        assert!(sent.was_sent("early"));
        assert!(!sent.was_sent("late"));
    }

    #[test]
    fn presence_is_not_remembered() {
        let mut sent = SentOnArrival::opening(true);
        sent.sent(Kind::PresenceJoin, "join");
        assert!(!sent.was_sent("join"));
    }

    #[test]
    fn what_was_sent_on_arrival_is_let_go_as_more_is_sent() {
        let mut sent = SentOnArrival::opening(true);
        sent.sent(Kind::Chat, "early");
        sent.0.as_mut().unwrap().opened -= FORGET_AFTER;
        sent.sent(Kind::Chat, "late");
        sent.sent(Kind::Chat, "later");
        assert!(sent.0.is_none());
    }

    #[test]
    fn what_was_sent_on_arrival_is_let_go_in_the_end() {
        let mut sent = SentOnArrival::opening(true);
        sent.sent(Kind::Chat, "early");
        sent.0.as_mut().unwrap().opened -= FORGET_AFTER;
        assert!(!sent.was_sent("early"));
        assert!(sent.0.is_none());
    }

    #[test]
    fn at_most_so_many_ids_are_remembered() {
        let mut sent = SentOnArrival::opening(true);
        for i in 0..MOST_REMEMBERED + 10 {
            sent.sent(Kind::Chat, &i.to_string());
        }
        assert!(sent.was_sent("0"));
        assert!(!sent.was_sent(&MOST_REMEMBERED.to_string()));
    }
}
