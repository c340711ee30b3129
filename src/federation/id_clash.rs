//! Two bridges given one `bridge_id` (a config copied whole, two hosts of one name) would
//! share one consumer of the stream, each taking what was meant for the other's agents,
//! and one heartbeat. A bridge tells from its watch of the heartbeats, which delivers the
//! puts of its own key in the order they landed: once its own run's heartbeat came, a put
//! of that key by another run is another bridge running under its id (a killed earlier
//! run puts nothing more, and a stopped one deletes its key).

use std::time::Duration;

use tokio::time::Instant;

/// What the heartbeats put under this bridge's id tell of another bridge using it.
pub struct IdClash {
    /// How long after its last heartbeat the other bridge is taken for gone (the presence
    /// TTL, as for any bridge).
    ttl: Duration,
    /// Whether this run's own heartbeat has come through the watch yet.
    seen_own: bool,
    /// The other run using this bridge's id, and when its last heartbeat came.
    other: Option<(String, Instant)>,
}

/// What a heartbeat under this bridge's id changed.
#[derive(Debug, PartialEq, Eq)]
pub enum Clash {
    /// Another run (named by its run id) puts heartbeats under this bridge's id.
    Found(String),
    /// It has put none for a TTL.
    Over,
}

impl IdClash {
    pub fn new(ttl: Duration) -> IdClash {
        IdClash {
            ttl,
            seen_own: false,
            other: None,
        }
    }

    /// A heartbeat put under this bridge's id by `run` (this run is `own`), come `now`.
    pub fn put_by(&mut self, run: Option<&str>, own: &str, now: Instant) -> Option<Clash> {
        if run == Some(own) {
            self.seen_own = true;
            let over = (self.other.as_ref()).is_some_and(|(_, last)| now - *last > self.ttl);
            return over.then(|| {
                self.other = None;
                Clash::Over
            });
        }
        // Before this run's own came: the last heartbeat of an earlier run.
        if !self.seen_own {
            return None;
        }
        let run = run.unwrap_or("(not named: a bridge of an older version)");
        let found = self.other.as_ref().is_none_or(|(known, _)| known != run);
        self.other = Some((run.to_owned(), now));
        found.then(|| Clash::Found(run.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_run_putting_the_key_after_this_one_is_a_clash_until_a_ttl_without_it() {
        let ttl = Duration::from_secs(5);
        let mut clash = IdClash::new(ttl);
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        // The earlier run's last heartbeat, read as the watch starts.
        assert_eq!(clash.put_by(Some("earlier"), "now", at(0)), None);
        assert_eq!(clash.put_by(Some("now"), "now", at(10)), None);
        let found = clash.put_by(Some("other"), "now", at(20));
        assert_eq!(found, Some(Clash::Found("other".to_owned())));
        // Told once, however the two bridges' heartbeats fall.
        for ms in [30, 40, 50] {
            assert_eq!(clash.put_by(Some("now"), "now", at(ms)), None);
        }
        assert_eq!(clash.put_by(Some("other"), "now", at(1_000)), None);
        assert_eq!(
            clash.put_by(Some("now"), "now", at(5_000)),
            None,
            "within a TTL"
        );
        assert_eq!(
            clash.put_by(Some("now"), "now", at(6_001)),
            Some(Clash::Over)
        );
        assert_eq!(clash.put_by(Some("now"), "now", at(7_000)), None);
    }
}
