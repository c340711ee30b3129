//! A bounded, priority-laned queue of deliveries for one connected recipient.
//!
//! The router pushes without ever waiting: when the mailbox is full its `WhenFull` policy
//! decides what is lost, and the caller counts it. The recipient's session task is the only
//! consumer. A std `Mutex` guards the lanes; it is held for a few pointer moves and never
//! across an `.await`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Deserialize;
use tokio::sync::Notify;

use super::delivery::Delivery;
use super::envelope::Protocol;

/// What happens to a message that arrives at a full mailbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenFull {
    /// The oldest queued message of the lowest priority is dropped to make room.
    #[default]
    DropOldest,
    /// The arriving message is dropped.
    DropNewest,
    /// The recipient is disconnected; it can reconnect and replay from the store.
    Disconnect,
}

/// Why a mailbox stopped delivering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// Another connection of the same agent took over.
    Replaced,
    /// The mailbox overflowed under the `disconnect` policy.
    Overflow,
    /// The agent left or was removed.
    Gone,
    /// The bridge is shutting down.
    Shutdown,
}

/// The outcome of a push, for the router's accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pushed {
    Queued,
    /// Queued after dropping the oldest queued message.
    DroppedOldest,
    /// Not queued: the mailbox was full.
    DroppedNewest,
    /// Not queued: the mailbox was full and is now closed.
    Disconnected,
    /// Not queued: the mailbox was already closed.
    Closed,
}

type ExpiryHook = Arc<dyn Fn(Arc<Delivery>) + Send + Sync>;

pub struct Mailbox {
    protocol: Protocol,
    capacity: usize,
    policy: WhenFull,
    state: Mutex<Lanes>,
    notify: Notify,
    on_expired: Option<ExpiryHook>,
    /// Where the depth is recorded each time the recipient wakes to read (a no-op handle by
    /// default). Once per wake-up, not per message: under load a wake-up drains a batch.
    depth: metrics::Histogram,
}

struct Lanes {
    lanes: [VecDeque<Arc<Delivery>>; 3],
    len: usize,
    closed: Option<Closed>,
}

impl Mailbox {
    pub fn new(protocol: Protocol, capacity: usize, policy: WhenFull) -> Self {
        Mailbox {
            protocol,
            capacity: capacity.max(1),
            policy,
            state: Mutex::new(Lanes {
                lanes: Default::default(),
                len: 0,
                closed: None,
            }),
            notify: Notify::new(),
            on_expired: None,
            depth: metrics::Histogram::noop(),
        }
    }

    /// Records the mailbox's depth in `histogram` whenever `recv` returns a message.
    pub fn with_depth_histogram(mut self, histogram: metrics::Histogram) -> Self {
        self.depth = histogram;
        self
    }

    /// Calls `hook` with every message that expires (its ttl ran out) before it is received.
    pub fn with_expiry_hook(mut self, hook: ExpiryHook) -> Self {
        self.on_expired = Some(hook);
        self
    }

    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    pub fn len(&self) -> usize {
        self.lock().len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn push(&self, delivery: Arc<Delivery>) -> Pushed {
        let lane = delivery.envelope.priority.lane();
        let outcome = {
            let mut state = self.lock();
            if state.closed.is_some() {
                return Pushed::Closed;
            }
            if state.len < self.capacity {
                state.lanes[lane].push_back(delivery);
                state.len += 1;
                Pushed::Queued
            } else {
                match self.policy {
                    WhenFull::DropNewest => return Pushed::DroppedNewest,
                    WhenFull::Disconnect => {
                        state.closed = Some(Closed::Overflow);
                        Pushed::Disconnected
                    }
                    WhenFull::DropOldest => {
                        // Make room at the least important end: the oldest message of the
                        // lowest non-empty lane, unless that lane is less important than the
                        // arrival, in which case the arrival is the one that goes.
                        let victim_lane = (0..3).rev().find(|&l| !state.lanes[l].is_empty());
                        match victim_lane {
                            Some(v) if v >= lane => {
                                state.lanes[v].pop_front();
                                state.lanes[lane].push_back(delivery);
                                Pushed::DroppedOldest
                            }
                            _ => return Pushed::DroppedNewest,
                        }
                    }
                }
            }
        };
        self.notify.notify_one();
        outcome
    }

    /// The next message, highest priority first; `None` once the mailbox is closed.
    ///
    /// Cancel-safe: a message is only taken from the lanes by the call that returns it.
    pub async fn recv(&self) -> Result<Arc<Delivery>, Closed> {
        loop {
            let depth = self.len();
            if let Some(next) = self.try_recv()? {
                self.depth.record(depth as f64);
                return Ok(next);
            }
            // One consumer: a `notify_one` that finds no waiter leaves a permit, so a push
            // between `try_recv` and here is not missed.
            self.notify.notified().await;
        }
    }

    /// The next message if one is queued; `Err` once the mailbox is closed.
    pub fn try_recv(&self) -> Result<Option<Arc<Delivery>>, Closed> {
        loop {
            let next = {
                let mut state = self.lock();
                if let Some(reason) = state.closed {
                    return Err(reason);
                }
                let Some(lane) = (0..3).find(|&l| !state.lanes[l].is_empty()) else {
                    return Ok(None);
                };
                state.len -= 1;
                state.lanes[lane].pop_front()
            };
            let Some(next) = next else { return Ok(None) };
            if let Some(next) = self.unexpired(next, Instant::now()) {
                return Ok(Some(next));
            }
        }
    }

    /// `delivery`, unless it expired by `now`: then it goes to the expiry hook.
    fn unexpired(&self, delivery: Arc<Delivery>, now: Instant) -> Option<Arc<Delivery>> {
        if delivery.expires_at.is_some() && delivery.is_expired(now) {
            if let Some(hook) = &self.on_expired {
                hook(delivery);
            }
            return None;
        }
        Some(delivery)
    }

    /// Queues `delivery` in a mailbox an overflow closed, for its endpoint to keep with
    /// the rest as its connection ends (`take_left`), in order; up to twice the capacity,
    /// so a connection stuck on a slow client holds no more than that. False when the
    /// mailbox is open, closed otherwise, or that full.
    pub fn keep_after_overflow(&self, delivery: Arc<Delivery>) -> bool {
        let mut state = self.lock();
        if state.closed != Some(Closed::Overflow) || state.len >= 2 * self.capacity {
            return false;
        }
        state.lanes[delivery.envelope.priority.lane()].push_back(delivery);
        state.len += 1;
        true
    }

    /// Takes what is still queued, closed or not, highest priority first: an overflow
    /// (`WhenFull::Disconnect`) closes the mailbox but leaves its messages for the
    /// endpoint to keep by other means (Synapse's inbox, Grid's queue) as its connection
    /// ends. Expired ones go to the expiry hook instead.
    pub fn take_left(&self) -> Vec<Arc<Delivery>> {
        let left: Vec<Arc<Delivery>> = {
            let mut state = self.lock();
            state.len = 0;
            state
                .lanes
                .iter_mut()
                .flat_map(|lane| lane.drain(..))
                .collect()
        };
        let now = Instant::now();
        (left.into_iter())
            .filter_map(|delivery| self.unexpired(delivery, now))
            .collect()
    }

    /// Stops delivery: queued messages are discarded and `recv` returns `reason`.
    pub fn close(&self, reason: Closed) {
        {
            let mut state = self.lock();
            if state.closed.is_none() {
                state.closed = Some(reason);
            }
            for lane in &mut state.lanes {
                lane.clear();
            }
            state.len = 0;
        }
        self.notify.notify_one();
    }

    pub fn closed(&self) -> Option<Closed> {
        self.lock().closed
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lanes> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::envelope::{Envelope, Kind, Priority};

    fn msg(text: &str, priority: Priority) -> Arc<Delivery> {
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.text = Some(text.into());
        env.priority = priority;
        Arc::new(Delivery::new(env))
    }

    fn drain(mb: &Mailbox) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(Some(d)) = mb.try_recv() {
            out.push(d.envelope.text.clone().unwrap());
        }
        out
    }

    #[test]
    fn drop_oldest_keeps_the_newest() {
        let mb = Mailbox::new("t", 2, WhenFull::DropOldest);
        assert_eq!(mb.push(msg("1", Priority::Normal)), Pushed::Queued);
        assert_eq!(mb.push(msg("2", Priority::Normal)), Pushed::Queued);
        assert_eq!(mb.push(msg("3", Priority::Normal)), Pushed::DroppedOldest);
        assert_eq!(drain(&mb), ["2", "3"]);
    }

    #[test]
    fn drop_oldest_sacrifices_lower_priority_first() {
        let mb = Mailbox::new("t", 2, WhenFull::DropOldest);
        mb.push(msg("high", Priority::High));
        mb.push(msg("low", Priority::Low));
        assert_eq!(
            mb.push(msg("normal", Priority::Normal)),
            Pushed::DroppedOldest
        );
        assert_eq!(drain(&mb), ["high", "normal"]);
        // A low-priority arrival never pushes out a more important message.
        mb.push(msg("h1", Priority::High));
        mb.push(msg("h2", Priority::High));
        assert_eq!(mb.push(msg("low", Priority::Low)), Pushed::DroppedNewest);
        assert_eq!(drain(&mb), ["h1", "h2"]);
    }

    #[test]
    fn drop_newest_refuses_the_arrival() {
        let mb = Mailbox::new("t", 2, WhenFull::DropNewest);
        mb.push(msg("1", Priority::Normal));
        mb.push(msg("2", Priority::Normal));
        assert_eq!(mb.push(msg("3", Priority::Normal)), Pushed::DroppedNewest);
        assert_eq!(drain(&mb), ["1", "2"]);
    }

    #[test]
    fn disconnect_closes_the_mailbox() {
        let mb = Mailbox::new("t", 1, WhenFull::Disconnect);
        mb.push(msg("1", Priority::Normal));
        assert_eq!(mb.push(msg("2", Priority::Normal)), Pushed::Disconnected);
        assert_eq!(mb.try_recv().unwrap_err(), Closed::Overflow);
        assert_eq!(mb.push(msg("3", Priority::Normal)), Pushed::Closed);
        // What was queued before the overflow is kept for the endpoint to take, and so is
        // what it is given to keep after it, up to twice the capacity.
        assert!(mb.keep_after_overflow(msg("2", Priority::Normal)));
        assert!(!mb.keep_after_overflow(msg("3", Priority::Normal)));
        let left: Vec<_> = (mb.take_left().iter())
            .map(|d| d.envelope.text.clone().unwrap())
            .collect();
        assert_eq!(left, ["1", "2"]);
        assert!(mb.take_left().is_empty());
        // Only an overflow keeps: a mailbox closed otherwise, or open, takes nothing so.
        let open = Mailbox::new("t", 1, WhenFull::Disconnect);
        assert!(!open.keep_after_overflow(msg("1", Priority::Normal)));
        open.close(Closed::Replaced);
        assert!(!open.keep_after_overflow(msg("1", Priority::Normal)));
    }

    #[test]
    fn higher_priority_is_served_first() {
        let mb = Mailbox::new("t", 10, WhenFull::DropOldest);
        mb.push(msg("low", Priority::Low));
        mb.push(msg("n1", Priority::Normal));
        mb.push(msg("high", Priority::High));
        mb.push(msg("n2", Priority::Normal));
        assert_eq!(drain(&mb), ["high", "n1", "n2", "low"]);
    }

    #[test]
    fn expired_messages_go_to_the_hook() {
        let expired = Arc::new(Mutex::new(Vec::new()));
        let sink = expired.clone();
        let mb = Mailbox::new("t", 10, WhenFull::DropOldest).with_expiry_hook(Arc::new(
            move |d: Arc<Delivery>| sink.lock().unwrap().push(d.envelope.id.clone()),
        ));
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.ttl_secs = Some(0);
        let id = env.id.clone();
        mb.push(Arc::new(Delivery::new(env)));
        mb.push(msg("fresh", Priority::Normal));
        assert_eq!(drain(&mb), ["fresh"]);
        assert_eq!(*expired.lock().unwrap(), [id]);
    }

    #[tokio::test]
    async fn recv_wakes_on_push_and_on_close() {
        let mb = Arc::new(Mailbox::new("t", 10, WhenFull::DropOldest));
        let rx = mb.clone();
        let waiter = tokio::spawn(async move { rx.recv().await.map(|d| d.envelope.id.clone()) });
        tokio::task::yield_now().await;
        let d = msg("x", Priority::Normal);
        let id = d.envelope.id.clone();
        mb.push(d);
        assert_eq!(waiter.await.unwrap(), Ok(id));

        let rx = mb.clone();
        let waiter = tokio::spawn(async move { rx.recv().await.map(|_| ()) });
        tokio::task::yield_now().await;
        mb.close(Closed::Replaced);
        assert_eq!(waiter.await.unwrap(), Err(Closed::Replaced));
    }
}
