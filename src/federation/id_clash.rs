//! Two bridges given one `bridge_id` (a config copied whole, two hosts of one name) would
//! share one consumer of the stream, each taking what was meant for the other's agents,
//! and one heartbeat. A bridge tells from its watch of the heartbeats, which delivers the
//! puts of its own key in the order they landed: once its own run's heartbeat came, a put
//! of that key by another run is another bridge running under its id (a killed earlier
//! run puts nothing more, and a stopped one deletes its key).

/// How many of its own heartbeats in a row, with none of another run between, tell a
/// bridge that the other one under its id has gone.
const OWN_IN_A_ROW: u32 = 3;

/// What the heartbeats put under this bridge's id tell of another bridge using it.
#[derive(Default)]
pub struct IdClash {
    /// Whether this run's own heartbeat has come through the watch yet.
    seen_own: bool,
    /// This run's heartbeats come since the last of another run.
    own_in_a_row: u32,
    /// The other run using this bridge's id, while it seems to.
    other: Option<String>,
}

impl IdClash {
    /// A heartbeat put under this bridge's id by `run` (this run is `own`). What changed:
    /// another run found using the id (`Some(Some(run))`), or gone (`Some(None)`).
    pub fn put_by(&mut self, run: Option<&str>, own: &str) -> Option<Option<String>> {
        if run == Some(own) {
            self.seen_own = true;
            self.own_in_a_row += 1;
            if self.own_in_a_row >= OWN_IN_A_ROW && self.other.is_some() {
                self.other = None;
                return Some(None);
            }
            return None;
        }
        // Before this run's own came: the last heartbeat of an earlier run.
        if !self.seen_own {
            return None;
        }
        self.own_in_a_row = 0;
        let run = run.unwrap_or("of an older version").to_owned();
        match &self.other {
            Some(known) if *known == run => None,
            _ => {
                self.other = Some(run.clone());
                Some(Some(run))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_run_putting_the_key_after_this_one_is_a_clash_until_it_stops() {
        let mut clash = IdClash::default();
        // The earlier run's last heartbeat, read as the watch starts.
        assert_eq!(clash.put_by(Some("earlier"), "now"), None);
        assert_eq!(clash.put_by(Some("now"), "now"), None);
        assert_eq!(
            clash.put_by(Some("other"), "now"),
            Some(Some("other".to_owned()))
        );
        assert_eq!(clash.put_by(Some("now"), "now"), None);
        assert_eq!(clash.put_by(Some("other"), "now"), None, "told once");
        for _ in 1..OWN_IN_A_ROW {
            assert_eq!(clash.put_by(Some("now"), "now"), None);
        }
        assert_eq!(clash.put_by(Some("now"), "now"), Some(None), "gone");
        assert_eq!(clash.put_by(Some("now"), "now"), None);
    }
}
