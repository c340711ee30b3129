//! One accepted message on its way to its recipients.
//!
//! Fan-out shares a single `Arc<Delivery>` between every recipient's mailbox, and every
//! copy of a delivery (`Delivery::held_copy`) shares what it routes (`Routed`). The first
//! recipient of a protocol to write it encodes the native frame and leaves it in that
//! cache; every other recipient of that protocol reuses it, so a message is encoded once
//! per protocol, not once per recipient.

use std::any::Any;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::envelope::{Envelope, Protocol};
use super::hold::{Offered, Outstanding};

type Encoded = Arc<dyn Any + Send + Sync>;

/// A message routed to its recipients: a delivery and each of its copies share it.
pub struct Delivery {
    routed: Arc<Routed>,
    /// What its source offered to hold it by (`Outstanding`): not kept alive by the
    /// delivery; a recipient that takes it up takes a copy that holds it (`held_copy`).
    offered: Option<Offered>,
    /// What this copy holds: the hold is each holding recipient's, so that a recipient
    /// that holds nothing (one replaying from history) and reads slowly holds nothing back.
    held: Option<Outstanding>,
    /// Which of its recipients it is for (`route_to`).
    recipients: Recipients,
}

/// Which of its recipients a message is routed to (`Delivery::route_to`). A bridge routing
/// again what an earlier run of it routed sends it only to the recipients that write or
/// keep it for an agent away (holding mailboxes, offline sinks), where it can: those
/// replaying from history had it from there, and only those that hold may not have been
/// written it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Recipients {
    /// Every one.
    #[default]
    All,
    /// Every recipient that holds.
    Holders,
    /// The recipients that hold for one of these agents: those whose copies still held it
    /// when the run that routed it last said (`HoldersOf::holders`).
    HoldersFor(Arc<[String]>),
}

impl Recipients {
    /// Whether a recipient that holds for `agent` is one.
    pub fn include_holder_for(&self, agent: &str) -> bool {
        match self {
            Recipients::All | Recipients::Holders => true,
            Recipients::HoldersFor(agents) => agents.iter().any(|a| a == agent),
        }
    }
}

/// What every copy of a delivery shares.
pub struct Routed {
    pub envelope: Envelope,
    /// When the bridge routed the message (after storing it, for a stored one).
    pub routed_at: Instant,
    /// When an undelivered copy of it must be dropped (from the envelope's ttl).
    pub expires_at: Option<Instant>,
    /// Whether the store holds it, so that a mailbox may keep only its id (`Mailbox`'s
    /// backlog) and read it back when the recipient gets to it.
    pub stored: bool,
    encoded: Mutex<Vec<(Protocol, Encoded)>>,
    /// Set once the message has been written to some recipient's connection.
    written: AtomicBool,
    written_notify: Notify,
}

impl Deref for Delivery {
    type Target = Routed;

    fn deref(&self) -> &Routed {
        &self.routed
    }
}

impl Delivery {
    pub fn new(envelope: Envelope) -> Self {
        Delivery::of(envelope, false, Instant::now())
    }

    /// A delivery of a message the store holds.
    pub fn stored(envelope: Envelope) -> Self {
        Delivery::of(envelope, true, Instant::now())
    }

    /// A delivery, made again, of a stored message routed at `routed_at` (its ttl runs from
    /// then), holding `held` (what its first delivery's copy held).
    pub fn stored_again(envelope: Envelope, routed_at: Instant, held: Option<Outstanding>) -> Self {
        Delivery {
            held,
            ..Delivery::of(envelope, true, routed_at)
        }
    }

    fn of(envelope: Envelope, stored: bool, routed_at: Instant) -> Self {
        // A ttl too long for the clock to represent is a message that never expires.
        let expires_at = envelope
            .ttl_secs
            .and_then(|secs| routed_at.checked_add(std::time::Duration::from_secs(secs)));
        Delivery {
            routed: Arc::new(Routed {
                envelope,
                routed_at,
                expires_at,
                stored,
                encoded: Mutex::new(Vec::new()),
                written: AtomicBool::new(false),
                written_notify: Notify::new(),
            }),
            offered: None,
            held: None,
            recipients: Recipients::All,
        }
    }

    /// Offers it `outstanding`, which a recipient's copy holds once it takes it up
    /// (`held_copy`), for as long as its source keeps its own.
    pub fn offer(&mut self, outstanding: &Outstanding) {
        self.offered = Some(outstanding.offered());
    }

    /// It for a recipient that writes or keeps it for an agent away, holding for others
    /// or unable to say for whom (a hub's): as `held_copy_for`, naming nobody.
    pub fn held_copy(self: &Arc<Self>) -> Arc<Delivery> {
        self.held_copy_by(None)
    }

    /// It for a recipient that writes or keeps it for `agent`, away or not: a copy holding
    /// what it was offered, if that is not done yet, so that the source learns it
    /// was done with only once this recipient (and whatever it hands the copy on to) was
    /// done; the other recipients' copies do not hold it. It itself if it holds already,
    /// or was offered nothing that is still kept.
    pub fn held_copy_for(self: &Arc<Self>, agent: &str) -> Arc<Delivery> {
        self.held_copy_by(Some(agent))
    }

    fn held_copy_by(self: &Arc<Self>, recipient: Option<&str>) -> Arc<Delivery> {
        if self.held.is_some() {
            return self.clone();
        }
        match self.offered.as_ref().and_then(|o| o.take_up(recipient)) {
            Some(held) => Arc::new(Delivery {
                routed: self.routed.clone(),
                offered: None,
                held: Some(held),
                recipients: self.recipients.clone(),
            }),
            None => self.clone(),
        }
    }

    /// What it holds, for whatever carries the message on without the delivery.
    pub fn held(&self) -> Option<Outstanding> {
        self.held.clone()
    }

    /// Routes it to `recipients` only (all of them unless this is called).
    pub fn route_to(&mut self, recipients: Recipients) {
        self.recipients = recipients;
    }

    /// Which of its recipients it is routed to (`route_to`).
    pub fn recipients(&self) -> &Recipients {
        &self.recipients
    }

    /// Whether it is to be kept for `agent`, away (by an offline sink, or a hub keeping mail
    /// for agents away): always, unless it is routed again for the holders for some agents
    /// only (`Recipients::HoldersFor`).
    pub fn is_kept_for(&self, agent: &str) -> bool {
        self.recipients.include_holder_for(agent)
    }
}

impl Routed {
    /// Records that the message was written to a connection of protocol `to`: counted,
    /// timed from its decode, and marked written for a sender waiting on synchronous
    /// delivery.
    pub fn written_to(&self, to: Protocol) {
        let env = &self.envelope;
        crate::telemetry::message_delivered(
            &env.origin.protocol,
            to,
            env.kind.family(),
            env.origin.decoded_at().elapsed(),
        );
        self.mark_written();
    }

    /// Records that a recipient's connection took the message. Only the first call wakes
    /// anyone, so writers pay one atomic swap.
    pub fn mark_written(&self) {
        if !self.written.swap(true, Ordering::AcqRel) {
            self.written_notify.notify_waiters();
        }
    }

    /// Waits until some recipient's connection took the message (a sender asking for
    /// synchronous delivery waits on this).
    pub async fn written(&self) {
        loop {
            let notified = self.written_notify.notified();
            if self.written.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    pub fn is_expired(&self, now: Instant) -> bool {
        self.expires_at.is_some_and(|at| now >= at)
    }

    /// The message encoded for `protocol` as a `T`, computed by `encode` on first use. An
    /// endpoint may keep more than one form (say, the message and its text); each
    /// is cached under its type.
    ///
    /// The lock is not held while encoding: two recipients racing may both encode, and the
    /// first result is kept; that is cheaper than making every reader wait.
    pub fn encoded<T, F>(&self, protocol: Protocol, encode: F) -> T
    where
        T: Clone + Send + Sync + 'static,
        F: FnOnce(&Envelope) -> T,
    {
        if let Some(hit) = self.cached::<T>(protocol) {
            return hit;
        }
        let fresh = encode(&self.envelope);
        let mut cache = self.encoded.lock();
        if let Some(existing) = find::<T>(&cache, protocol) {
            return existing;
        }
        cache.push((protocol, Arc::new(fresh.clone())));
        fresh
    }

    fn cached<T: Clone + 'static>(&self, protocol: Protocol) -> Option<T> {
        let cache = self.encoded.lock();
        find(&cache, protocol)
    }
}

/// The `T` cached for `protocol`, if any.
fn find<T: Clone + 'static>(cache: &[(Protocol, Encoded)], protocol: Protocol) -> Option<T> {
    cache
        .iter()
        .filter(|(p, _)| *p == protocol)
        .find_map(|(_, v)| v.downcast_ref::<T>().cloned())
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("id", &self.envelope.id)
            .field("kind", &self.envelope.kind)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slow samples (`> 0.05 s`) of `route_duration_seconds` so far.
    fn slow_route_samples(handle: &metrics_exporter_prometheus::PrometheusHandle) -> u64 {
        let text = handle.render();
        let value = |prefix: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(prefix))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        let name = crate::telemetry::ROUTE_DURATION;
        value(&format!("{name}_count ")) - value(&format!("{name}_bucket{{le=\"0.05\"}} "))
    }

    /// `route_duration_seconds` runs from when the message was decoded, so a message that
    /// waited (for the store, say) before it was routed shows that wait.
    #[test]
    fn route_duration_counts_from_the_decode_not_from_routing() {
        let handle = crate::telemetry::install();
        let env = Envelope::new("test", "decoded-early", Kind::Chat);
        std::thread::sleep(std::time::Duration::from_millis(60));
        let slow_before = slow_route_samples(&handle);
        Delivery::new(env).written_to("test");
        // Other tests share the recorder; they can only add samples.
        assert!(slow_route_samples(&handle) > slow_before);
    }
    use crate::core::envelope::Kind;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn each_form_of_one_protocol_is_encoded_once() {
        let delivery = Delivery::new(Envelope::new("test", "a", Kind::Chat));
        let calls = AtomicUsize::new(0);
        for _ in 0..3 {
            let _: u32 = delivery.encoded("p", |_| {
                calls.fetch_add(1, Ordering::Relaxed);
                7
            });
            let text: String = delivery.encoded("p", |_| {
                calls.fetch_add(1, Ordering::Relaxed);
                "seven".into()
            });
            assert_eq!(text, "seven");
        }
        assert_eq!(calls.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn encodes_once_per_protocol() {
        let delivery = Delivery::new(Envelope::new("test", "a", Kind::Chat));
        let calls = AtomicUsize::new(0);
        for _ in 0..10 {
            let frame: Arc<str> = delivery.encoded("p1", |env| {
                calls.fetch_add(1, Ordering::Relaxed);
                Arc::from(env.id.as_str())
            });
            assert_eq!(&*frame, delivery.envelope.id);
        }
        let _: Arc<str> = delivery.encoded("p2", |_| {
            calls.fetch_add(1, Ordering::Relaxed);
            Arc::from("other")
        });
        assert_eq!(calls.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_ttl_beyond_the_clock_never_expires() {
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.ttl_secs = Some(u64::MAX);
        let delivery = Delivery::new(env);
        assert_eq!(delivery.expires_at, None);
        assert!(!delivery.is_expired(Instant::now()));
    }

    #[test]
    fn a_hold_is_done_once_every_delivery_that_took_it_up_is_dropped() {
        let (outstanding, done) = Outstanding::new();
        let made = |text: &str| {
            let mut delivery = Delivery::new(Envelope::new("test", text, Kind::Chat));
            delivery.offer(&outstanding);
            Arc::new(delivery)
        };
        let (one, two, unheld) = (made("one"), made("two"), made("unheld"));
        let (one_held, two_held) = (one.held_copy(), two.held_copy());
        assert!(Arc::ptr_eq(&one_held, &one_held.held_copy()), "held once");
        let passed_on = one_held.clone();
        drop(outstanding);
        drop(one_held);
        drop(two_held);
        assert!(!done.is_cancelled(), "a copy of the first is still held");
        drop(passed_on);
        assert!(
            done.is_cancelled(),
            "the deliveries themselves, and one offered and never held, hold nothing"
        );
        // Offered once the source let go: there is nothing left to hold.
        assert!(unheld.held_copy().held().is_none());
        assert_eq!(one.envelope.from, "one");
    }

    #[tokio::test]
    async fn waiting_for_the_write_ends_when_a_writer_marks_it() {
        let delivery = Arc::new(Delivery::new(Envelope::new("test", "a", Kind::Chat)));
        let waiter = {
            let d = delivery.clone();
            tokio::spawn(async move { d.written().await })
        };
        tokio::task::yield_now().await;
        delivery.mark_written();
        delivery.mark_written();
        waiter.await.unwrap();
        // Already written: returns at once.
        delivery.written().await;
    }
}
