//! When a task that repeats costly work in the background takes its next turn: after its
//! interval, or, when a turn took long (a backlog grew, what it runs on is busy), after
//! a multiple of how long that turn took, so that the work keeps to a small share of the
//! thread or lock it runs on however long a turn grows.

use std::time::Duration;

use tokio::time::Instant;

/// At most one turn every `every`, and a rest of `times` as long as a turn took.
#[derive(Clone, Copy, Debug)]
pub struct Pace {
    pub every: Duration,
    pub times: u32,
}

impl Pace {
    /// When the next turn may begin, the last having begun at `began` and just ended.
    pub fn next_after(&self, began: Instant) -> Instant {
        began + self.every.max(began.elapsed() * self.times)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_short_turn_waits_the_interval_and_a_long_one_its_multiple() {
        let pace = Pace {
            every: Duration::from_millis(50),
            times: 10,
        };
        let began = Instant::now();
        tokio::time::advance(Duration::from_millis(2)).await;
        assert_eq!(pace.next_after(began), began + Duration::from_millis(50));
        tokio::time::advance(Duration::from_millis(18)).await;
        assert_eq!(pace.next_after(began), began + Duration::from_millis(200));
    }
}
