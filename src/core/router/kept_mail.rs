//! Mail for agents with no session here: each protocol's offline sink (a poll queue, an
//! inbox, a callback), what the router hands it, and the mail held back while a gone
//! bridge's missed mail is read first, so that a sender's messages are kept in the order
//! sent.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use foldhash::HashSet;
use parking_lot::Mutex;

use super::{RouteReport, Router};
use crate::core::delivery::Delivery;
use crate::core::envelope::Audience;

/// Where messages for an agent with no live session go (a callback, a poll queue, a file).
pub trait OfflineSink: Send + Sync {
    fn deliver(&self, agent: &str, delivery: &Arc<Delivery>);

    /// Ends once everything `deliver` was given before this call is kept (a sink that
    /// writes in the background waits for its writer).
    fn flush(&self) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(std::future::ready(()))
    }

    /// Whether the protocol keeps messages to everyone for its absent agents too (its
    /// endpoint does that itself, through its hub; `Router::keep_for` asks).
    fn keeps_broadcasts(&self) -> bool {
        false
    }
}

/// Mail held back, by the gone bridge that held its recipients.
#[derive(Default)]
pub(super) struct HeldBack {
    by_bridge: Mutex<HashMap<String, HeldFor>>,
    /// Whether `by_bridge` has an entry: routing looks no further when it has none.
    any: AtomicBool,
}

/// How many readers of a gone bridge's missed mail are under way, and (recipient, message)
/// held back for its agents meanwhile, in the order routed.
type HeldFor = (usize, Vec<(String, Arc<Delivery>)>);

impl HeldBack {}

impl Router {
    /// Hands `delivery` to the offline sinks of those of its recipients that are among
    /// `names`, once each, as if none had a session here: mail another bridge of the fleet
    /// was to keep and, gone, did not (`federation`). A message to everyone is kept by the
    /// protocols that keep broadcasts. How many copies were handed on.
    pub fn keep_for(
        &self,
        delivery: &Arc<Delivery>,
        names: &std::collections::HashSet<String>,
    ) -> usize {
        let env = &delivery.envelope;
        let members;
        let recipients: Box<dyn Iterator<Item = &str>> = match &env.audience {
            Audience::Everyone => Box::new(names.iter().map(String::as_str)),
            Audience::Addressed | Audience::Private => {
                Box::new(env.to.iter().chain(&env.mentions).map(String::as_str))
            }
            Audience::Group(group) => {
                members = self.members_of(group);
                Box::new(env.addressees().chain(members.iter().map(String::as_str)))
            }
        };
        let mut kept = HashSet::default();
        for name in recipients {
            if name == env.from || !names.contains(name) || kept.contains(name) {
                continue;
            }
            let Some(sink) = self.sink_of(name) else {
                continue;
            };
            if env.audience == Audience::Everyone && !sink.keeps_broadcasts() {
                continue;
            }
            sink.deliver(name, delivery);
            kept.insert(name);
        }
        kept.len()
    }

    /// Where `name`'s protocol keeps mail for its absent agents, if it does. An agent
    /// another bridge of the fleet holds has its mail kept there, while that bridge is here.
    pub(super) fn sink_of(&self, name: &str) -> Option<Arc<dyn OfflineSink>> {
        let protocol = self.directory.keeps_mail_of(name)?;
        self.offline.get(protocol).map(|sink| sink.clone())
    }

    /// Hands `earlier` and then `delivery` to `sink`, for `name` — or holds them back while
    /// the missed mail of the gone bridge that held `name` is read.
    pub(super) fn to_sink(
        &self,
        sink: &dyn OfflineSink,
        name: &str,
        delivery: &Arc<Delivery>,
        earlier: &[Arc<Delivery>],
        report: &mut RouteReport,
    ) {
        report.offline += 1 + earlier.len();
        // Kept for an agent away: held until it is (`Delivery::held_copy_for`).
        let delivery = &delivery.held_copy_for(name);
        if self.held_back.any.load(Ordering::Acquire)
            && let Some(bridge) = self.directory.gone_holder_of(name)
        {
            let mut held_back = self.held_back.by_bridge.lock();
            if let Some((_, held)) = held_back.get_mut(&bridge) {
                let all = earlier.iter().chain([delivery]);
                held.extend(all.map(|d| (name.to_owned(), d.clone())));
                return;
            }
            // Released meanwhile: what it held was handed on under the lock, before this.
        }
        for left in earlier {
            sink.deliver(name, left);
        }
        sink.deliver(name, delivery);
    }

    /// Keeps `delivery` for `name`, an agent with no session here, where its protocol keeps
    /// mail (as `route` does). For an endpoint that keeps some mail itself (a hub's).
    pub fn keep_offline(&self, name: &str, delivery: &Arc<Delivery>) {
        if !delivery.is_kept_for(name) {
            return;
        }
        if let Some(sink) = self.sink_of(name) {
            self.to_sink(&*sink, name, delivery, &[], &mut RouteReport::default());
        }
    }

    /// From now until `release_mail_of(bridge)`, mail kept for the agents `bridge` held
    /// waits: what it missed is read first, so that a sender's messages are kept in the
    /// order sent (`federation`'s missed mail).
    pub fn hold_back_mail_of(&self, bridge: &str) {
        let mut held_back = self.held_back.by_bridge.lock();
        held_back.entry(bridge.to_owned()).or_default().0 += 1;
        self.held_back.any.store(true, Ordering::Release);
    }

    /// Whether mail for the agents `bridge` held is held back now.
    pub fn holds_back_mail_of(&self, bridge: &str) -> bool {
        self.held_back.any.load(Ordering::Acquire)
            && self.held_back.by_bridge.lock().contains_key(bridge)
    }

    /// Keeps what was held back for `bridge`'s agents, in the order it was routed, once
    /// every `hold_back_mail_of(bridge)` is released; from then on their mail is kept as
    /// it is routed. How much was held back (0 while another hold remains).
    pub fn release_mail_of(&self, bridge: &str) -> usize {
        let mut held_back = self.held_back.by_bridge.lock();
        match held_back.get_mut(bridge) {
            Some((holds, _)) if *holds > 1 => {
                *holds -= 1;
                return 0;
            }
            _ => {}
        }
        let (_, held) = held_back.remove(bridge).unwrap_or_default();
        (self.held_back.any).store(!held_back.is_empty(), Ordering::Release);
        // Under the lock: mail routed meanwhile waits for this, and is kept after it.
        for (name, delivery) in &held {
            if let Some(sink) = self.sink_of(name) {
                sink.deliver(name, delivery);
            }
        }
        held.len()
    }
}
