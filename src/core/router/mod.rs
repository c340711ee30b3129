//! Decides who receives an accepted message and puts it in their mailboxes.
//!
//! Recipients are, in this order and each at most once: the sender (when the message asks
//! for an echo), the agents named in `to` and `mentions` (or every online agent, or a group's
//! members), and then the observers whose filter wants the message. Observers — a human who
//! sees everything, a member listening to a whole project — are sessions
//! with an `Interest`, not special cases here.
//!
//! The router never waits: each mailbox applies its own `when_full` policy, so one stalled
//! recipient cannot slow the others. The session list is an `arc-swap` snapshot, read
//! without locks on every message and replaced on the rare attach or detach.

mod kept_mail;
mod reached;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use arc_swap::ArcSwap;
use dashmap::DashMap;

use super::delivery::{Delivery, Recipients};
use super::directory::{AgentInfo, Directory};
use super::envelope::{Audience, Envelope, Protocol};
use super::mailbox::{BacklogReader, Closed, Holding, Mailbox, Pushed, WhenFull};
use crate::telemetry;
use kept_mail::HeldBack;
pub use kept_mail::OfflineSink;
use reached::Reached;

/// A connected recipient's say in what reaches it.
pub trait Interest: Send + Sync {
    /// Whether it wants a copy of a message that does not name it (it observes).
    fn observes(&self, _env: &Envelope) -> bool {
        false
    }

    /// Whether it takes a message that names it, or that goes to everyone.
    fn accepts(&self, _env: &Envelope) -> bool {
        true
    }

    /// Whether `observes` can ever be true. A session that cannot is left out of the scan
    /// for observers that every message makes.
    fn can_observe(&self) -> bool {
        true
    }
}

/// Takes what is addressed to it and observes nothing else.
pub struct AddressedOnly;
impl Interest for AddressedOnly {
    fn can_observe(&self) -> bool {
        false
    }
}

/// One live connection of an agent.
pub struct Session {
    pub id: u64,
    pub agent: String,
    pub mailbox: Arc<Mailbox>,
    interest: Arc<dyn Interest>,
    /// `interest.can_observe()`, asked once: the session is in the observer list or not
    /// for its whole life.
    can_observe: bool,
}

impl Session {
    /// Open, and losing nothing it is pushed.
    fn receives_all(&self) -> bool {
        self.mailbox.closed().is_none() && self.mailbox.is_lossless()
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id)
            .field("agent", &self.agent)
            .finish_non_exhaustive()
    }
}

/// What `route` did with one message.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RouteReport {
    /// Mailboxes the message was queued in.
    pub queued: usize,
    /// Copies handed to offline sinks.
    pub offline: usize,
    /// Copies lost to full mailboxes.
    pub dropped: usize,
}

/// How the mailboxes the router makes behave (`[routing]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MailboxSettings {
    capacity: usize,
    policy: WhenFull,
    backlog_limit: usize,
}

/// What is told of an agent whose first connection opened or last closed
/// (`Router::on_connections_changed`).
pub type ConnectionsHook = Arc<dyn Fn(&str) + Send + Sync>;

pub struct Router {
    directory: Arc<Directory>,
    /// Read for each mailbox made; a reload of the config changes them for the
    /// connections that open after it.
    settings: ArcSwap<MailboxSettings>,
    backlog_reader: std::sync::OnceLock<BacklogReader>,
    next_session: AtomicU64,
    by_agent: DashMap<String, Vec<Arc<Session>>, foldhash::fast::RandomState>,
    /// Names this bridge gave up to agents of other bridges (`name_lost`), each with the
    /// agent it went to.
    names_lost: DashMap<String, AgentInfo>,
    /// How many names `names_lost` holds: read on every attach, without a lock.
    names_lost_count: AtomicUsize,
    /// Told the agent's name when its first session attaches or its last detaches.
    connections_changed: std::sync::OnceLock<ConnectionsHook>,
    sessions: ArcSwap<Vec<Arc<Session>>>,
    /// The sessions whose interest can observe (`Interest::can_observe`).
    observers: ArcSwap<Vec<Arc<Session>>>,
    offline: DashMap<Protocol, Arc<dyn OfflineSink>>,
    groups: DashMap<String, Vec<String>>,
    mailbox_depth: metrics::Histogram,
    expiry: std::sync::OnceLock<ExpiryHandler>,
    /// Mail for the agents of bridges gone from the fleet whose missed mail is still being
    /// read (`hold_back_mail_of`), by bridge, in the order it was routed.
    held_back: HeldBack,
}

/// What becomes of a message whose ttl ran out in a mailbox of the given protocol.
pub type ExpiryHandler = Arc<dyn Fn(Arc<Delivery>, Protocol) + Send + Sync>;

impl Router {
    pub fn new(
        directory: Arc<Directory>,
        capacity: usize,
        policy: WhenFull,
        backlog_limit: usize,
    ) -> Self {
        Router {
            directory,
            settings: ArcSwap::from_pointee(MailboxSettings {
                capacity,
                policy,
                backlog_limit,
            }),
            backlog_reader: std::sync::OnceLock::new(),
            next_session: AtomicU64::new(1),
            by_agent: DashMap::default(),
            names_lost: DashMap::default(),
            names_lost_count: AtomicUsize::new(0),
            connections_changed: std::sync::OnceLock::new(),
            sessions: ArcSwap::from_pointee(Vec::new()),
            observers: ArcSwap::from_pointee(Vec::new()),
            offline: DashMap::new(),
            groups: DashMap::new(),
            mailbox_depth: telemetry::mailbox_depth_histogram(),
            expiry: std::sync::OnceLock::new(),
            held_back: HeldBack::default(),
        }
    }

    /// Sets what happens to messages that expire in mailboxes (once).
    pub fn set_expiry_handler(&self, handler: ExpiryHandler) {
        let _ = self.expiry.set(handler);
    }

    /// Sets how mailboxes read their backlog back from the store (once).
    pub fn set_backlog_reader(&self, reader: BacklogReader) {
        let _ = self.backlog_reader.set(reader);
    }

    /// A mailbox sized and governed by the bridge's routing settings. Under `replay` it
    /// has a backlog unless `protocol` keeps mail for absent agents (an inbox, a queue):
    /// that connection's overflow is handed there instead, as under `disconnect`; and
    /// such a mailbox holds what it is given (`Mailbox::holding`).
    pub fn mailbox(&self, protocol: Protocol) -> Arc<Mailbox> {
        let settings = **self.settings.load();
        let keeps_mail = self.offline.contains_key(protocol);
        let backlog =
            (settings.policy == WhenFull::Replay && !keeps_mail).then_some(settings.backlog_limit);
        self.make_mailbox(
            protocol,
            settings.capacity,
            settings.policy,
            backlog,
            keeps_mail.then_some(Holding::ForItsAgent),
        )
    }

    /// Mailboxes made from now on take these settings; those already made keep theirs.
    pub fn reconfigure(&self, capacity: usize, policy: WhenFull, backlog_limit: usize) {
        self.settings.store(Arc::new(MailboxSettings {
            capacity,
            policy,
            backlog_limit,
        }));
    }

    /// A mailbox for an endpoint's own session (a hub applying task messages to its
    /// tables), which must see every message whatever the policy: one whose backlog has no
    /// bound but memory, a message's id each. One for a hub that `keeps_mail` for agents
    /// away holds what it is given (`Mailbox::holding`).
    pub fn hub_mailbox(&self, protocol: Protocol, keeps_mail: bool) -> Arc<Mailbox> {
        let capacity = self.settings.load().capacity;
        let backlog = Some(usize::MAX);
        let holding = keeps_mail.then_some(Holding::ForOthers);
        self.make_mailbox(protocol, capacity, WhenFull::Replay, backlog, holding)
    }

    /// A mailbox of one reading of the settings (a reload between two would mix them);
    /// one for a reader that keeps mail for agents away is `holding`.
    fn make_mailbox(
        &self,
        protocol: Protocol,
        capacity: usize,
        policy: WhenFull,
        backlog: Option<usize>,
        holding: Option<Holding>,
    ) -> Arc<Mailbox> {
        let mut mailbox = Mailbox::new(protocol, capacity, policy)
            .with_depth_histogram(self.mailbox_depth.clone());
        if let (Some(limit), Some(reader)) = (backlog, self.backlog_reader.get()) {
            mailbox = mailbox.with_backlog(limit, reader.clone());
        }
        if let Some(handler) = self.expiry.get() {
            let handler = handler.clone();
            mailbox =
                mailbox.with_expiry_hook(Arc::new(move |delivery| handler(delivery, protocol)));
        }
        if let Some(whom) = holding {
            mailbox = mailbox.holding(whom);
        }
        Arc::new(mailbox)
    }

    /// Connects `mailbox` as a live session of `agent`.
    pub fn attach(
        &self,
        agent: &str,
        mailbox: Arc<Mailbox>,
        interest: Arc<dyn Interest>,
    ) -> Arc<Session> {
        let can_observe = interest.can_observe();
        // Numbered and listed under the agent's entry: a session of the agent with a lower
        // id is in every list before this one, so it is routed everything this one is
        // (`older_session_receiving`).
        let mut of_agent = self.by_agent.entry(agent.to_owned()).or_default();
        let first = of_agent.is_empty();
        let session = Arc::new(Session {
            id: self.next_session.fetch_add(1, Ordering::Relaxed),
            agent: agent.to_owned(),
            mailbox,
            can_observe,
            interest,
        });
        of_agent.push(session.clone());
        let add = |list: &ArcSwap<Vec<Arc<Session>>>| {
            list.rcu(|all| {
                let mut next = Vec::with_capacity(all.len() + 1);
                next.extend(all.iter().cloned());
                next.push(session.clone());
                next
            });
        };
        add(&self.sessions);
        if session.can_observe {
            add(&self.observers);
        }
        drop(of_agent);
        if self.lost_to_another(agent) {
            session.mailbox.close(Closed::NameTaken);
        }
        if first {
            self.connections_changed(agent);
        }
        session
    }

    /// Disconnects a session; messages stop reaching its mailbox.
    pub fn detach(&self, session: &Session) {
        let mut last = false;
        if let dashmap::mapref::entry::Entry::Occupied(mut list) =
            self.by_agent.entry(session.agent.clone())
        {
            list.get_mut().retain(|s| s.id != session.id);
            if list.get().is_empty() {
                list.remove();
                last = true;
            }
        }
        if last {
            self.connections_changed(&session.agent);
        }
        let remove = |list: &ArcSwap<Vec<Arc<Session>>>| {
            list.rcu(|all| {
                all.iter()
                    .filter(|s| s.id != session.id)
                    .cloned()
                    .collect::<Vec<_>>()
            });
        };
        remove(&self.sessions);
        if session.can_observe {
            remove(&self.observers);
        }
    }

    /// Tells `hook` the name of an agent whose first session attached or last detached.
    pub fn on_connections_changed(&self, hook: ConnectionsHook) {
        let _ = self.connections_changed.set(hook);
    }

    fn connections_changed(&self, agent: &str) {
        if let Some(hook) = self.connections_changed.get() {
            hook(agent);
        }
    }

    /// Closes the mailbox of every session of `agent`, whose name this bridge gave up to
    /// `winner`, another bridge's agent (`Core::yield_name`), with `Closed::NameTaken`:
    /// each detaches as its connection ends. So is a session that attaches while the
    /// directory shows `winner` online under the name (one whose claim ran before the name
    /// was given up).
    pub fn name_lost(&self, agent: &str, winner: &AgentInfo) {
        if (self.names_lost.insert(agent.to_owned(), winner.clone())).is_none() {
            self.names_lost_count.fetch_add(1, Ordering::Relaxed);
        }
        let sessions = (self.by_agent.get(agent)).map(|sessions| sessions.clone());
        for session in sessions.into_iter().flatten() {
            session.mailbox.close(Closed::NameTaken);
        }
    }

    /// Whether a session of `agent` attaching now comes too late for a name given up
    /// (`name_lost`): the name is online through another bridge. Once it is not, the name
    /// is forgotten.
    fn lost_to_another(&self, agent: &str) -> bool {
        if self.names_lost_count.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let Some(winner) = self.names_lost.get(agent).map(|w| w.clone()) else {
            return false;
        };
        let held = (self.directory.get(agent))
            .is_some_and(|a| a.is_online_elsewhere() && a.is_same_agent(&winner));
        if !held && self.names_lost.remove(agent).is_some() {
            self.names_lost_count.fetch_sub(1, Ordering::Relaxed);
        }
        held
    }

    pub fn is_connected(&self, agent: &str) -> bool {
        self.by_agent.contains_key(agent)
    }

    /// Whether a session of `session`'s agent that attached before it, and that `among`
    /// picks by id, is still attached with its mailbox open and losing nothing. Asked once
    /// `session` is detached, such a session holds everything `session` was routed that
    /// it accepts.
    pub fn older_session_receiving(&self, session: &Session, among: impl Fn(u64) -> bool) -> bool {
        (self.by_agent.get(&session.agent)).is_some_and(|sessions| {
            (sessions.iter()).any(|s| s.id < session.id && among(s.id) && s.receives_all())
        })
    }

    /// Ends once every offline sink has kept what it was given before this call.
    pub async fn flush_offline(&self) {
        // Collected first: no shard lock is held over the waits.
        let sinks: Vec<Arc<dyn OfflineSink>> = self.offline.iter().map(|s| s.clone()).collect();
        for sink in sinks {
            sink.flush().await;
        }
    }

    /// Where messages for offline agents of `protocol` go.
    pub fn set_offline_sink(&self, protocol: Protocol, sink: Arc<dyn OfflineSink>) {
        self.offline.insert(protocol, sink);
    }

    pub fn set_group(&self, group: &str, members: Vec<String>) {
        self.groups.insert(group.to_owned(), members);
    }

    pub fn remove_group(&self, group: &str) {
        self.groups.remove(group);
    }

    /// The members of `group` (none if it is unknown), copied out of the map.
    fn members_of(&self, group: &str) -> Vec<String> {
        (self.groups.get(group))
            .map(|m| m.clone())
            .unwrap_or_default()
    }

    /// Puts the message in the mailbox of each of its recipients, once each.
    pub fn route(&self, delivery: &Arc<Delivery>) -> RouteReport {
        let env = &delivery.envelope;
        let mut report = RouteReport::default();
        let mut reached = Reached::default();

        if env.echo
            && let Some(sessions) = self.by_agent.get(&env.from)
        {
            for session in sessions.iter() {
                self.push(session, delivery, &mut reached, &mut report);
            }
        }

        match &env.audience {
            Audience::Everyone => {
                for session in self.sessions.load().iter() {
                    if session.agent == env.from && !env.echo {
                        continue;
                    }
                    if session.interest.accepts(env) {
                        self.push(session, delivery, &mut reached, &mut report);
                    }
                }
            }
            Audience::Addressed | Audience::Private => {
                // Repeated names are harmless: `reached` keeps each session to one copy.
                for name in env.to.iter().chain(env.mentions.iter()) {
                    self.deliver_to(name, delivery, &mut reached, &mut report);
                }
            }
            Audience::Group(group) => {
                let members = self.members_of(group);
                for name in env.addressees().chain(members.iter().map(String::as_str)) {
                    if name != env.from {
                        self.deliver_to(name, delivery, &mut reached, &mut report);
                    }
                }
            }
        }

        if env.audience != Audience::Private {
            for session in self.observers.load().iter() {
                if !reached.contains(session.id)
                    && session.agent != env.from
                    && session.interest.observes(env)
                {
                    self.push(session, delivery, &mut reached, &mut report);
                }
            }
        }
        report
    }

    fn deliver_to(
        &self,
        name: &str,
        delivery: &Arc<Delivery>,
        reached: &mut Reached,
        report: &mut RouteReport,
    ) {
        let env = &delivery.envelope;
        let mut taken = false;
        // Sessions of the agent whose mailbox is closed: by this very overflow or before.
        let mut closed: Vec<(Arc<Mailbox>, bool)> = Vec::new();
        if let Some(sessions) = self.by_agent.get(name) {
            for session in sessions.iter() {
                if session.interest.accepts(env) {
                    match self.offer(session, delivery, reached, report) {
                        Offer::Taken => taken = true,
                        Offer::Overflowed => closed.push((session.mailbox.clone(), true)),
                        Offer::Closed => closed.push((session.mailbox.clone(), false)),
                    }
                }
            }
        }
        if closed.is_empty() {
            // The common case: a live session took it, or none is open.
            if !taken
                && reached.insert_name(name)
                && delivery.is_kept_for(name)
                && let Some(sink) = self.sink_of(name)
            {
                self.to_sink(&*sink, name, delivery, &[], report);
            }
            return;
        }
        let Some(sink) = self.sink_of(name) else {
            // Clients of a protocol without offline mail replay from the store: each overflow
            // is a drop.
            for (mailbox, _) in closed.iter().filter(|(_, overflowed)| *overflowed) {
                Self::overflow_dropped(mailbox.protocol(), report);
            }
            return;
        };
        if taken || !reached.insert_name(name) {
            return; // a live session of the agent has it
        }
        // Where the agent's protocol keeps mail, a mailbox an overflow closed keeps this
        // too: its connection, ending, hands everything on in order, after what it had in
        // hand and through its own filters (`Mailbox::take_left`). Once that mailbox holds
        // twice its capacity (the connection is stuck on a slow client), what it holds
        // goes to the sink now, then this. One copy, in the first mailbox that keeps it.
        let held = delivery.held_copy_for(name);
        if (closed.iter()).any(|(mailbox, _)| mailbox.keep_after_overflow(held.clone())) {
            return;
        }
        let earlier: Vec<_> = (closed.iter())
            .flat_map(|(mailbox, _)| mailbox.take_left())
            .collect();
        self.to_sink(&*sink, name, delivery, &earlier, report);
    }

    /// Gives `delivery` to `session`, once; counts what the mailbox's policy dropped.
    fn push(
        &self,
        session: &Session,
        delivery: &Arc<Delivery>,
        reached: &mut Reached,
        report: &mut RouteReport,
    ) {
        if let Offer::Overflowed = self.offer(session, delivery, reached, report) {
            Self::overflow_dropped(session.mailbox.protocol(), report);
        }
    }

    /// As `push`, but an overflow that closes the mailbox is left to the caller, who may
    /// have somewhere else to put the message.
    fn offer(
        &self,
        session: &Session,
        delivery: &Arc<Delivery>,
        reached: &mut Reached,
        report: &mut RouteReport,
    ) -> Offer {
        if !reached.insert(session.id) {
            return Offer::Taken;
        }
        // Its client has it from history, or it had been written or kept for its agent. A
        // hub keeping mail for others keeps it only for those it is for (`is_kept_for`).
        let passed_over = match delivery.recipients() {
            Recipients::All => false,
            again => {
                !session.mailbox.is_holding()
                    || session.mailbox.holds_for_its_agent()
                        && !again.include_holder_for(&session.agent)
            }
        };
        if passed_over {
            return Offer::Taken;
        }
        let protocol = session.mailbox.protocol();
        let delivery = match session.mailbox.holds_for_its_agent() {
            true => delivery.held_copy_for(&session.agent),
            false => delivery.clone(),
        };
        match session.mailbox.push(delivery) {
            Pushed::Queued | Pushed::Behind => report.queued += 1,
            Pushed::DroppedOldest => {
                report.queued += 1;
                report.dropped += 1;
                telemetry::message_dropped(protocol, telemetry::DropReason::MailboxFullDropOldest);
            }
            Pushed::DroppedNewest => {
                report.dropped += 1;
                telemetry::message_dropped(protocol, telemetry::DropReason::MailboxFullDropNewest);
            }
            Pushed::Disconnected => return Offer::Overflowed,
            Pushed::Closed => return Offer::Closed,
        }
        Offer::Taken
    }

    fn overflow_dropped(protocol: Protocol, report: &mut RouteReport) {
        report.dropped += 1;
        telemetry::message_dropped(protocol, telemetry::DropReason::MailboxFullDisconnect);
    }
}

/// What a session did with a message offered to it.
enum Offer {
    /// Queued (or dropped by the mailbox's policy, and counted), or had it already.
    Taken,
    /// Its mailbox overflowed and closed (`WhenFull::Disconnect`) without it.
    Overflowed,
    /// Its mailbox was closed already: its connection is ending.
    Closed,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::directory::AgentInfo;
    use crate::core::envelope::Kind;
    use crate::core::mailbox::Closed;
    use crate::core::{Outstanding, Recipients};

    struct Observer;
    impl Interest for Observer {
        fn observes(&self, env: &Envelope) -> bool {
            env.kind != Kind::Log
        }
    }

    struct Refuses;
    impl Interest for Refuses {
        fn accepts(&self, _: &Envelope) -> bool {
            false
        }
    }

    fn router(capacity: usize, policy: WhenFull) -> Router {
        Router::new(Arc::new(Directory::new()), capacity, policy, 0)
    }

    fn connect(router: &Router, name: &str, interest: Arc<dyn Interest>) -> Arc<Session> {
        router.attach(name, router.mailbox("test"), interest)
    }

    fn chat(from: &str, mentions: &[&str]) -> Arc<Delivery> {
        let mut env = Envelope::new("test", from, Kind::Chat);
        env.mentions = mentions.iter().map(|s| s.to_string()).collect();
        Arc::new(Delivery::new(env))
    }

    fn received(session: &Session) -> Vec<String> {
        let mut ids = Vec::new();
        while let Ok(Some(d)) = session.mailbox.try_recv() {
            ids.push(d.envelope.id.clone());
        }
        ids
    }

    #[test]
    fn addressed_reaches_named_agents_and_observers_once() {
        let r = router(16, WhenFull::DropOldest);
        let a = connect(&r, "a", Arc::new(AddressedOnly));
        let b = connect(&r, "b", Arc::new(AddressedOnly));
        let c = connect(&r, "c", Arc::new(AddressedOnly));
        let human = connect(&r, "h", Arc::new(Observer));

        // Mentioned twice and observing: still one copy each.
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.to = vec!["b".into(), "h".into()];
        env.mentions = vec!["b".into(), "h".into()];
        let d = Arc::new(Delivery::new(env));
        let report = r.route(&d);
        assert_eq!(report.queued, 2);
        assert_eq!(received(&b), vec![d.envelope.id.clone()]);
        assert_eq!(received(&human), vec![d.envelope.id.clone()]);
        assert!(received(&a).is_empty());
        assert!(received(&c).is_empty());
    }

    #[test]
    fn echo_goes_to_the_sender_first() {
        let r = router(16, WhenFull::DropOldest);
        let a = connect(&r, "a", Arc::new(AddressedOnly));
        let d = chat("a", &[]);
        let mut env = d.envelope.clone();
        env.echo = true;
        let d = Arc::new(Delivery::new(env));
        assert_eq!(r.route(&d).queued, 1);
        assert_eq!(received(&a), vec![d.envelope.id.clone()]);
    }

    #[test]
    fn observers_filter_and_private_messages_skip_them() {
        let r = router(16, WhenFull::DropOldest);
        let human = connect(&r, "h", Arc::new(Observer));
        let _b = connect(&r, "b", Arc::new(AddressedOnly));

        let mut log = Envelope::new("test", "b", Kind::Log);
        log.mentions = vec![];
        r.route(&Arc::new(Delivery::new(log)));
        assert!(received(&human).is_empty(), "observer filter refuses logs");

        let mut control = Envelope::new("test", "b", Kind::ControlInterrupt);
        control.to = vec!["b".into()];
        control.audience = Audience::Private;
        r.route(&Arc::new(Delivery::new(control)));
        assert!(
            received(&human).is_empty(),
            "private messages are not observed"
        );

        // A human named in a log's mentions still gets it.
        let mut log = Envelope::new("test", "b", Kind::Log);
        log.mentions = vec!["h".into()];
        let d = Arc::new(Delivery::new(log));
        r.route(&d);
        assert_eq!(received(&human), vec![d.envelope.id.clone()]);
    }

    #[test]
    fn everyone_reaches_all_sessions_and_respects_echo() {
        let r = router(16, WhenFull::DropOldest);
        let a = connect(&r, "a", Arc::new(AddressedOnly));
        let b = connect(&r, "b", Arc::new(AddressedOnly));
        let h = connect(&r, "h", Arc::new(Observer));
        let refuses = connect(&r, "r", Arc::new(Refuses));

        let mut env = Envelope::new("test", "a", Kind::PresenceJoin);
        env.audience = Audience::Everyone;
        let d = Arc::new(Delivery::new(env.clone()));
        assert_eq!(r.route(&d).queued, 2);
        assert!(received(&a).is_empty());
        assert_eq!(received(&b).len(), 1);
        assert_eq!(received(&h).len(), 1);
        assert!(received(&refuses).is_empty());

        env.echo = true;
        env.id = "second".into();
        let d = Arc::new(Delivery::new(env));
        assert_eq!(r.route(&d).queued, 3);
        assert_eq!(received(&a), ["second"]);
    }

    #[test]
    fn group_members_get_one_copy_even_when_also_addressed() {
        let r = router(16, WhenFull::DropOldest);
        let a = connect(&r, "a", Arc::new(AddressedOnly));
        let b = connect(&r, "b", Arc::new(AddressedOnly));
        let c = connect(&r, "c", Arc::new(AddressedOnly));
        r.set_group("g", vec!["a".into(), "b".into()]);
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.audience = Audience::Group("g".into());
        env.to = vec!["b".into()];
        r.route(&Arc::new(Delivery::new(env)));
        assert!(
            received(&a).is_empty(),
            "the sender is not its own group recipient"
        );
        assert_eq!(received(&b).len(), 1);
        assert!(received(&c).is_empty());
    }

    /// An offline sink that keeps what it is given: the agent, and the message's id.
    #[derive(Default)]
    struct KeptSink(parking_lot::Mutex<Vec<(String, String)>>);

    impl OfflineSink for KeptSink {
        fn deliver(&self, agent: &str, delivery: &Arc<Delivery>) {
            let kept = (agent.to_owned(), delivery.envelope.id.clone());
            self.0.lock().push(kept);
        }
    }

    impl KeptSink {
        fn agents(&self) -> Vec<String> {
            self.0.lock().iter().map(|k| k.0.clone()).collect()
        }

        fn ids(&self) -> Vec<String> {
            self.0.lock().iter().map(|k| k.1.clone()).collect()
        }
    }

    /// A router over `agents` (name, protocol), a protocol's offline mail kept in the sink.
    fn router_with_sink(
        agents: &[(&str, Protocol)],
        capacity: usize,
        policy: WhenFull,
    ) -> (Router, Arc<KeptSink>) {
        let dir = Arc::new(Directory::new());
        for &(name, protocol) in agents {
            dir.register(AgentInfo::new(name, protocol, name)).unwrap();
        }
        let r = Router::new(dir, capacity, policy, 0);
        let sink = Arc::new(KeptSink::default());
        r.set_offline_sink("queued", sink.clone());
        (r, sink)
    }

    /// Mail for an agent of a gone bridge waits while what that bridge missed is kept,
    /// then follows it: a sender's messages are kept in the order sent.
    #[test]
    fn mail_held_back_for_a_gone_bridge_follows_what_it_missed() {
        let dir = Arc::new(Directory::new());
        let away = AgentInfo {
            bridge: Some("c".into()),
            ..AgentInfo::new("away", "queued", "away")
        };
        dir.register_replica(away);
        let r = Router::new(dir.clone(), 4, WhenFull::DropOldest, 0);
        let sink = Arc::new(KeptSink::default());
        r.set_offline_sink("queued", sink.clone());
        let (missed, later) = (chat("a", &["away"]), chat("a", &["away"]));

        // While c is here, its agents' mail is c's to keep.
        r.route(&missed);
        assert!(sink.ids().is_empty());
        r.hold_back_mail_of("c");
        dir.bridge_gone("c");
        r.route(&later);
        assert!(sink.ids().is_empty(), "held back");
        let names = std::collections::HashSet::from(["away".to_owned()]);
        assert_eq!(r.keep_for(&missed, &names), 1);
        assert_eq!(r.release_mail_of("c"), 1);
        let ids = [&missed, &later].map(|d| d.envelope.id.clone());
        assert_eq!(sink.ids(), ids);
        // Released, its agents' mail is kept as it is routed.
        let next = chat("a", &["away"]);
        r.route(&next);
        assert_eq!(sink.ids().last(), Some(&next.envelope.id));
    }

    /// Only what keeps or writes a message for an agent whose mail the fleet would keep
    /// again (a sink here, a session of the sink's protocol) takes up the hold its delivery
    /// was offered, each for its own copy: a client of a protocol that replays from
    /// history holds nothing, so one that reads slowly holds nothing back, also of a
    /// message another recipient holds.
    #[test]
    fn only_what_keeps_mail_takes_up_a_hold() {
        let agents = [("away", "queued"), ("here", "queued")];
        let (r, _sink) = router_with_sink(&agents, 4, WhenFull::DropOldest);
        let watcher = connect(&r, "h", Arc::new(Observer));
        let here = r.attach("here", r.mailbox("queued"), Arc::new(AddressedOnly));
        let offered = |outstanding: &Outstanding, mentions: &[&str]| {
            let mut env = Envelope::new("test", "a", Kind::Chat);
            env.mentions = mentions.iter().map(|s| s.to_string()).collect();
            let mut delivery = Delivery::new(env);
            delivery.offer(outstanding);
            Arc::new(delivery)
        };
        let (outstanding, done) = Outstanding::new();
        r.route(&offered(&outstanding, &[]));
        drop(outstanding);
        assert!(done.is_cancelled(), "the watcher took nothing up");

        // The sink kept it at once; the watcher's copy, unread, holds nothing.
        let (outstanding, done) = Outstanding::new();
        r.route(&offered(&outstanding, &["away"]));
        drop(outstanding);
        assert!(
            done.is_cancelled(),
            "kept for `away`, and only that held it"
        );

        let (outstanding, done) = Outstanding::new();
        r.route(&offered(&outstanding, &["here"]));
        drop(outstanding);
        assert!(!done.is_cancelled(), "waiting in `here`'s mailbox: held");
        assert_eq!(received(&watcher).len(), 3);
        assert!(
            !done.is_cancelled(),
            "the watcher's copy was not what held it"
        );
        assert_eq!(received(&here).len(), 1);
        assert!(done.is_cancelled(), "no holding copy left");
    }

    /// A message routed again for the recipients that hold (`Recipients::Holders`)
    /// reaches them, and the sinks of agents away, but not a client that replays from
    /// history.
    #[test]
    fn a_message_for_holders_passes_over_those_that_replay_from_history() {
        let agents = [("away", "queued"), ("here", "queued"), ("reader", "test")];
        let (r, sink) = router_with_sink(&agents, 4, WhenFull::DropOldest);
        let watcher = connect(&r, "h", Arc::new(Observer));
        let reader = connect(&r, "reader", Arc::new(AddressedOnly));
        let here = r.attach("here", r.mailbox("queued"), Arc::new(AddressedOnly));
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.mentions = vec!["away".into(), "here".into(), "reader".into()];
        let mut delivery = Delivery::new(env);
        delivery.route_to(Recipients::Holders);
        r.route(&Arc::new(delivery));
        assert_eq!(sink.agents(), ["away"]);
        assert_eq!(received(&here).len(), 1);
        assert!(received(&reader).is_empty() && received(&watcher).is_empty());
    }

    /// A message routed again for some holders only (`Recipients::HoldersFor`: those its last run
    /// had not written it or kept it for) reaches those, connected or away, and no other
    /// recipient that holds for its agent; a hub keeping mail for others has it, to keep
    /// for those only (`Delivery::is_kept_for`).
    #[test]
    fn a_message_for_named_holders_passes_over_the_other_holders() {
        let agents = [
            ("away", "queued"),
            ("gone", "queued"),
            ("here", "queued"),
            ("done", "queued"),
        ];
        let (r, sink) = router_with_sink(&agents, 4, WhenFull::DropOldest);
        let here = r.attach("here", r.mailbox("queued"), Arc::new(AddressedOnly));
        let done = r.attach("done", r.mailbox("queued"), Arc::new(AddressedOnly));
        let hub = r.attach("\0hub", r.hub_mailbox("queued", true), Arc::new(Observer));
        let mut env = Envelope::new("test", "a", Kind::Chat);
        env.mentions = ["away", "gone", "here", "done"].map(String::from).to_vec();
        let mut delivery = Delivery::new(env);
        let named: Arc<[String]> = ["away", "here"].map(String::from).into();
        delivery.route_to(Recipients::HoldersFor(named));
        r.route(&Arc::new(delivery));
        assert_eq!(sink.agents(), ["away"]);
        assert_eq!(received(&here).len(), 1);
        assert!(received(&done).is_empty());
        let kept_by_hub = hub
            .mailbox
            .try_recv()
            .ok()
            .flatten()
            .expect("the hub has it");
        assert!(kept_by_hub.is_kept_for("away") && !kept_by_hub.is_kept_for("gone"));
    }

    #[test]
    fn offline_agents_go_to_their_protocols_sink() {
        let agents = [("away", "queued"), ("nosink", "alpha")];
        let (r, sink) = router_with_sink(&agents, 4, WhenFull::DropOldest);
        let report = r.route(&chat("a", &["away", "nosink", "away"]));
        assert_eq!(report.offline, 1);
        assert_eq!(sink.agents(), ["away"]);
    }

    #[test]
    fn a_session_that_refuses_leaves_the_message_for_the_sink() {
        struct Refuses;
        impl Interest for Refuses {
            fn accepts(&self, _: &Envelope) -> bool {
                false
            }
        }
        let (r, sink) = router_with_sink(&[("grouped", "queued")], 4, WhenFull::DropOldest);
        let stream = connect(&r, "grouped", Arc::new(Refuses));
        let report = r.route(&chat("a", &["grouped", "grouped"]));
        assert_eq!((report.queued, report.offline), (0, 1));
        assert!(received(&stream).is_empty());
        assert_eq!(sink.agents(), ["grouped"]);
    }

    #[test]
    fn an_overflowed_mailbox_keeps_what_follows_where_there_is_a_sink() {
        let agents = [("slow", "queued"), ("gone", "alpha")];
        let (r, sink) = router_with_sink(&agents, 2, WhenFull::Disconnect);
        let slow = connect(&r, "slow", Arc::new(AddressedOnly));
        let sent: Vec<Arc<Delivery>> = (0..5).map(|_| chat("a", &["slow"])).collect();
        let ids: Vec<String> = sent.iter().map(|d| d.envelope.id.clone()).collect();
        for delivery in &sent {
            assert_eq!(r.route(delivery).dropped, 0);
        }
        // The first two were queued; the third overflowed the mailbox, which closed, and
        // keeps it and the fourth (up to twice its capacity) for its connection to hand on
        // in order as it ends. The fifth found it at that limit: the four, then the fifth,
        // went to the sink.
        assert_eq!(slow.mailbox.try_recv().unwrap_err(), Closed::Overflow);
        assert!(slow.mailbox.take_left().is_empty());
        assert_eq!(sink.ids(), ids);
        // Kept again after that, in order behind them.
        let sixth = chat("a", &["slow"]);
        r.route(&sixth);
        let kept: Vec<String> = (slow.mailbox.take_left().iter())
            .map(|d| d.envelope.id.clone())
            .collect();
        assert_eq!(kept, std::slice::from_ref(&sixth.envelope.id));
        // Where the protocol has no sink, an overflow drops the message, counted.
        let _gone = connect(&r, "gone", Arc::new(AddressedOnly));
        for expected_dropped in [0, 0, 1] {
            assert_eq!(r.route(&chat("a", &["gone"])).dropped, expected_dropped);
        }
    }

    #[test]
    fn a_live_sibling_session_takes_what_an_overflowed_one_would_keep() {
        for (agent, protocol, dropped) in [("twin", "queued", 0), ("pair", "alpha", 1)] {
            let (r, sink) = router_with_sink(&[(agent, protocol)], 1, WhenFull::Disconnect);
            let stuck = connect(&r, agent, Arc::new(AddressedOnly));
            let live = connect(&r, agent, Arc::new(AddressedOnly));
            let first = chat("a", &[agent]);
            r.route(&first);
            assert_eq!(received(&live), std::slice::from_ref(&first.envelope.id));
            // The stuck session overflows; the live one has the message: no second copy
            // is kept, and only where nothing keeps mail is the overflow a drop.
            let second = chat("a", &[agent]);
            assert_eq!(r.route(&second).dropped, dropped, "{protocol}");
            assert_eq!(received(&live), std::slice::from_ref(&second.envelope.id));
            let kept: Vec<String> = (stuck.mailbox.take_left().iter())
                .map(|d| d.envelope.id.clone())
                .collect();
            assert_eq!(kept, std::slice::from_ref(&first.envelope.id), "{protocol}");
            assert!(sink.ids().is_empty(), "{protocol}");
        }
    }

    #[test]
    fn detached_sessions_receive_nothing() {
        let r = router(16, WhenFull::DropOldest);
        let b = connect(&r, "b", Arc::new(Observer));
        r.detach(&b);
        assert!(!r.is_connected("b"));
        assert_eq!(r.route(&chat("a", &["b"])).queued, 0);
        assert!(received(&b).is_empty());
    }

    #[test]
    fn a_stalled_recipient_does_not_hold_back_the_others() {
        for policy in [
            WhenFull::DropOldest,
            WhenFull::DropNewest,
            WhenFull::Disconnect,
            WhenFull::Replay,
        ] {
            let r = router(4, policy);
            let stalled = connect(&r, "stalled", Arc::new(AddressedOnly));
            let live = connect(&r, "live", Arc::new(AddressedOnly));
            // The stalled recipient never reads; the live one drains as it goes.
            for i in 0..100 {
                let report = r.route(&chat("a", &["stalled", "live"]));
                assert!(report.queued >= 1, "{policy:?}: message {i} reached nobody");
                assert_eq!(
                    received(&live).len(),
                    1,
                    "{policy:?}: live missed message {i}"
                );
            }
            match policy {
                WhenFull::DropOldest | WhenFull::DropNewest => {
                    assert_eq!(stalled.mailbox.len(), 4)
                }
                // Without a backlog (no store here), `replay` closes as `disconnect` does.
                WhenFull::Disconnect | WhenFull::Replay => {
                    assert_eq!(stalled.mailbox.try_recv().unwrap_err(), Closed::Overflow)
                }
            }
        }
    }

    #[test]
    fn full_mailbox_policies_are_reported() {
        let r = router(1, WhenFull::DropNewest);
        let b = connect(&r, "b", Arc::new(AddressedOnly));
        assert_eq!(r.route(&chat("a", &["b"])).queued, 1);
        let report = r.route(&chat("a", &["b"]));
        assert_eq!((report.queued, report.dropped), (0, 1));
        assert_eq!(received(&b).len(), 1);

        let r = router(1, WhenFull::DropOldest);
        let b = connect(&r, "b", Arc::new(AddressedOnly));
        r.route(&chat("a", &["b"]));
        let last = chat("a", &["b"]);
        let report = r.route(&last);
        assert_eq!((report.queued, report.dropped), (1, 1));
        assert_eq!(received(&b), vec![last.envelope.id.clone()]);
    }
}
