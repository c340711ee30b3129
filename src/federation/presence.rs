//! Which bridges of the fleet are alive, and so which agents are online. Every bridge puts
//! a heartbeat in the bridges bucket; one whose heartbeat stops arriving for the presence
//! TTL (killed, cut off) has its agents shown offline here, each with a leave event in
//! every protocol. Liveness is judged by when heartbeats arrive, not by the clocks that
//! stamped them. A bridge that stops cleanly deletes its heartbeat: the others see it go
//! at once.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::bucket_watch::{self, BucketWatch};
use super::cards::CardKeeper;
use super::claims::FleetClaims;
use super::clashes::Clashes;
use super::config::FederationConfig;
use super::held_cards::HeldCards;
use super::id_clash::IdClash;
use super::link::{NatsLink, Ready, put_heartbeat};
use super::unwritten::Carrier;
use super::wire::{Card, Heartbeat, agent_key};
use crate::core::{Audience, Core, Envelope, Kind, Replicated, Status};
use crate::telemetry;

/// The shortest wait between two stall checks of the heartbeats' watch.
const MIN_CHECK: Duration = Duration::from_millis(100);

pub struct Presence {
    pub link: Arc<NatsLink>,
    pub core: Arc<Core>,
    pub heartbeat: Duration,
    pub ttl: Duration,
    pub cards: Arc<CardKeeper>,
    /// Settles a name a card shows held elsewhere while it is held here too.
    pub clashes: Arc<Clashes>,
}

impl Presence {
    pub fn new(
        link: Arc<NatsLink>,
        core: Arc<Core>,
        config: &FederationConfig,
        cards: Arc<CardKeeper>,
        claims: Arc<FleetClaims>,
    ) -> Presence {
        let clashes = Arc::new(Clashes::new(core.clone(), claims, cards.clone()));
        Presence {
            link,
            core,
            heartbeat: Duration::from_millis(config.heartbeat_ms.max(1)),
            ttl: Duration::from_millis(config.presence_ttl_ms.max(1)),
            cards,
            clashes,
        }
    }

    /// Takes in the agents other bridges hold (from their cards), then keeps this bridge's
    /// heartbeat going and the others' liveness up to date until shutdown.
    pub async fn run(self, ready: Arc<Ready>, shutdown: CancellationToken) {
        let mut alive: HashMap<String, Instant> = HashMap::new();
        // Bridges this one heard a heartbeat from: only their missed mail is read again
        // when they go (a bridge known from its cards alone may have left long ago).
        let mut heard: HashSet<String> = HashSet::new();
        // Each bridge's last heartbeat: where it says its deliveries not written begin, from
        // where its missed mail is read again if it goes (`UnwrittenFloor`).
        let mut last_beats: HashMap<String, Heartbeat> = HashMap::new();
        let mut id_clash = IdClash::new(self.ttl);
        self.take_in_cards(&ready, &mut alive).await;
        let mut beat = tokio::time::interval(self.heartbeat);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (mut watch, mut cards) = (None, None);
        let mut watched_before = false;
        let mut was_connected = false;
        let (held_cards, mut let_go) =
            HeldCards::start(self.link.clone(), ready.clone(), shutdown.clone());
        // The revision of the newest watched card of each agent with a card held: a held
        // card let go after a newer one came is not taken in.
        let mut newest_held: HashMap<String, u64> = HashMap::new();
        loop {
            if watch.is_none() {
                // With the history once, to learn who is alive. It is checked for a stall
                // every heartbeat, so that one is caught within a TTL; made again (stalled,
                // or failed), it goes on from where it was, and the heartbeats it missed
                // show their bridges alive as they were. One that ended (its client closed)
                // is made again from now, or heartbeats a sweep took for gone would bring
                // their bridges back (a live bridge's next heartbeat comes within one beat).
                let (bridges, every) = (&ready.bridges, self.heartbeat.max(MIN_CHECK));
                watch = Some(match watched_before {
                    false => BucketWatch::from_last_values(bridges, ">", every, "heartbeats"),
                    true => BucketWatch::from_next(bridges, ">", every, "heartbeats"),
                });
                watched_before = true;
            }
            if cards.is_none() {
                let every = bucket_watch::CHECKED_EVERY;
                cards = Some(BucketWatch::from_next(&ready.agents, ">", every, "cards"));
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = beat.tick() => {
                    let connected = self.link.is_connected();
                    if connected && !was_connected {
                        // Presence changes while NATS was away did not reach the others:
                        // its cards go in, once the others' are read (`clashes`). Until
                        // they have landed, the heartbeats say they are coming, so that a
                        // bridge that took this one for gone finds no clash in the cards
                        // from before (put with the agent connected, say, whose socket
                        // closed while NATS was away).
                        let time = self.cards.start_coming();
                        let cards = self.cards.clone();
                        let read_then_put = read_cards_then_put_own(
                            ready.clone(),
                            self.core.clone(),
                            cards.clone(),
                            self.clashes.clone(),
                            self.link.bridge_id.clone(),
                        );
                        let shutdown = shutdown.clone();
                        tokio::spawn(async move {
                            let put = async {
                                read_then_put.await;
                                cards.all_put().await;
                            };
                            // They come at the latest then; the reads and puts go on.
                            let at_most = async {
                                tokio::time::sleep(CARDS_COMING_AT_MOST).await;
                                cards.come(time);
                                std::future::pending::<()>().await
                            };
                            tokio::select! {
                                _ = shutdown.cancelled() => {}
                                () = put => cards.come(time),
                                () = at_most => {}
                            }
                        });
                    }
                    was_connected = connected;
                    self.beat(&ready).await;
                    self.sweep(&ready, &mut alive, &heard, &last_beats);
                }
                // A batch acknowledged before it was written waits for a heartbeat that
                // carries it.
                () = ready.unwritten.wanted(Carrier::Heartbeat) => self.beat(&ready).await,
                card = next_entry(&mut cards) => match card {
                    Some(entry) => match self.moves_away_kept_mail(&entry.value) {
                        true => {
                            newest_held.insert(entry.key.clone(), entry.revision);
                            held_cards.hold(entry);
                        }
                        false => {
                            newest_held.remove(&entry.key);
                            self.take_in_card(&entry.value, Some(entry.revision), &mut alive);
                        }
                    },
                    None => cards = None,
                },
                Some(entry) = let_go.recv() => {
                    if newest_held.get(&entry.key) == Some(&entry.revision) {
                        newest_held.remove(&entry.key);
                        self.take_in_card(&entry.value, Some(entry.revision), &mut alive);
                    }
                }
                entry = next_entry(&mut watch) => match entry {
                    Some(entry) => {
                        use async_nats::jetstream::kv::Operation;
                        if entry.key == self.link.bridge_id {
                            if entry.operation == Operation::Put {
                                let run = Heartbeat::read(&entry.value).and_then(|beat| beat.run);
                                let (own, now) = (&self.link.run_id, Instant::now());
                                if let Some(clash) = id_clash.put_by(run.as_deref(), own, now) {
                                    self.link.tell_id_clash(clash);
                                }
                            }
                            continue;
                        }
                        match entry.operation {
                            Operation::Put => {
                                let bridge = entry.key;
                                let beat = Heartbeat::read(&entry.value);
                                let coming = beat.as_ref().is_some_and(|beat| beat.cards_coming);
                                match beat {
                                    Some(beat) => last_beats.insert(bridge.clone(), beat),
                                    None => last_beats.remove(&bridge),
                                };
                                heard.insert(bridge.clone());
                                self.clashes.cards_coming(&bridge, coming);
                                if alive.insert(bridge.clone(), Instant::now()).is_none() {
                                    // Back after it was taken for gone (a NATS failover
                                    // longer than the TTL): its agents are online again.
                                    self.revive(&ready, &bridge, coming, &mut alive).await;
                                }
                            }
                            Operation::Delete | Operation::Purge => {
                                alive.remove(&entry.key);
                                let bridge = &entry.key;
                                let beat = last_beats.get(bridge).cloned();
                                self.gone(&ready, bridge, heard.contains(bridge), beat);
                            }
                        }
                        telemetry::federation_bridges(alive.len() + 1);
                    }
                    None => watch = None,
                },
            }
        }
        // Stopping cleanly: the others show this bridge's agents offline now, not after
        // the TTL.
        let _ = ready.bridges.delete(&self.link.bridge_id).await;
    }

    async fn take_in_cards(&self, ready: &Ready, alive: &mut HashMap<String, Instant>) {
        for (value, _) in all_cards(ready).await {
            self.take_in_card(&value, None, alive);
        }
    }

    /// Shows online again the agents whose cards say `bridge` holds them online, each with a
    /// join event here. Its cards may show a clash, unless its heartbeat says newer ones
    /// are `coming` (those will, as the watch brings them).
    async fn revive(
        &self,
        ready: &Ready,
        bridge: &str,
        coming: bool,
        alive: &mut HashMap<String, Instant>,
    ) {
        self.core.directory.bridge_back(bridge);
        for (value, revision) in all_cards(ready).await {
            let Ok(card) = serde_json::from_slice::<Card>(&value) else {
                continue;
            };
            // Its cards, which this bridge forgot as it took it for gone: one may show a
            // name online there that is online here too (`clashes`).
            if card.bridge == bridge && !coming {
                self.clashes.card(&card, revision);
            }
            let known_offline = (self.core.directory.get(&card.name))
                .is_some_and(|a| !a.online && a.bridge.as_deref() == Some(bridge));
            if card.bridge != bridge || !card.online || !known_offline {
                continue;
            }
            let (name, protocol) = (card.name.clone(), card.protocol.clone());
            self.take_in_card(&value, None, alive);
            if let Some(protocol) = super::wire::known_protocol(&protocol) {
                let mut env = Envelope::new(protocol, name, Kind::PresenceJoin);
                env.audience = Audience::Everyone;
                env.data = Some(serde_json::json!({ "status": Status::Online.as_str() }));
                self.core.accept_replica(env, Replicated::default());
            }
        }
    }

    /// Whether a card another bridge just put moves an agent whose mail this bridge keeps:
    /// then it is held until the stream has caught up with it (`HeldCards`). The agent's
    /// join, in the stream, moves it in order too; a card is what moves it after a join
    /// NATS did not take.
    fn moves_away_kept_mail(&self, value: &[u8]) -> bool {
        serde_json::from_slice::<Card>(value).is_ok_and(|card| {
            card.bridge != self.link.bridge_id
                && (self.core.directory.keeps_mail_of(&card.name)).is_some()
        })
    }

    /// Registers the agent a card from another bridge describes; one at `revision` of the
    /// bucket, from its watch, may show a clash too (`clashes`).
    fn take_in_card(
        &self,
        value: &[u8],
        revision: Option<u64>,
        alive: &mut HashMap<String, Instant>,
    ) {
        let Ok(card) = serde_json::from_slice::<Card>(value) else {
            return;
        };
        if card.bridge == self.link.bridge_id {
            if let Some(revision) = revision {
                self.clashes.own_card(&card, revision);
            }
            return;
        }
        // Every bridge named gets one TTL to show it is alive; one back before its first
        // heartbeat arrives keeps its agents' mail again.
        if let std::collections::hash_map::Entry::Vacant(new) = alive.entry(card.bridge.clone()) {
            new.insert(Instant::now());
            self.core.directory.bridge_back(&card.bridge);
        }
        if let Some(revision) = revision {
            self.clashes.card(&card, revision);
        }
        if let Some(info) = card.into_info() {
            self.core.directory.register_replica(info);
        }
    }

    async fn beat(&self, ready: &Ready) {
        let (bridges, unwritten) = (&ready.bridges, &ready.unwritten);
        // Coming also while NATS is away: a heartbeat the client holds until it is back may
        // land before the first tick that sees it back starts a time of its cards coming.
        let coming = self.cards.coming() || !self.link.is_connected();
        if let Err(e) = put_heartbeat(&self.link, bridges, unwritten, coming).await {
            tracing::debug!(error = %e, "federation: heartbeat not sent");
        }
    }

    /// Bridges not heard from within the TTL are gone.
    fn sweep(
        &self,
        ready: &Arc<Ready>,
        alive: &mut HashMap<String, Instant>,
        heard: &HashSet<String>,
        last_beats: &HashMap<String, Heartbeat>,
    ) {
        let now = Instant::now();
        let silent: Vec<String> = (alive.iter())
            .filter(|(_, seen)| now.duration_since(**seen) > self.ttl)
            .map(|(bridge, _)| bridge.clone())
            .collect();
        for bridge in silent {
            alive.remove(&bridge);
            tracing::warn!(bridge = %bridge, "federation: a bridge stopped sending heartbeats");
            let beat = last_beats.get(&bridge).cloned();
            self.gone(ready, &bridge, heard.contains(&bridge), beat);
        }
        telemetry::federation_bridges(alive.len() + 1);
    }

    /// Shows `bridge`'s agents offline, each with a leave event to everyone here, and keeps
    /// the mail it missed for those whose protocols keep mail (`missed_mail`) if it was
    /// `heard` alive — from its acknowledgement floor, or from where its last heartbeat
    /// (`last_beat`, as the watch brought it) said its deliveries not written begin if that
    /// is older; their mail routed meanwhile waits for that.
    fn gone(&self, ready: &Arc<Ready>, bridge: &str, heard: bool, last_beat: Option<Heartbeat>) {
        self.clashes.bridge_gone(bridge);
        let directory = &self.core.directory;
        // Once a bridge is gone, its missed mail is being read or was (a second notice of
        // one departure, a heartbeat's delete after the TTL's sweep, reads nothing new).
        let read_missed = heard && !directory.is_gone(bridge);
        let held = read_missed.then(|| {
            let all = directory.held_by(bridge).into_iter().collect();
            // Those still held here.
            let moved = (self.core.moves.moved_from(bridge).into_iter())
                .filter(|moved| {
                    directory
                        .get(&moved.name)
                        .is_some_and(|a| a.bridge.is_none())
                })
                .collect();
            super::missed_mail::Held {
                all,
                moved,
                last_beat,
            }
        });
        if read_missed {
            self.core.router.hold_back_mail_of(bridge);
        }
        for (name, protocol) in directory.bridge_gone(bridge) {
            let mut env = Envelope::new(protocol, name, Kind::PresenceLeave);
            env.audience = Audience::Everyone;
            env.data = Some(serde_json::json!({ "status": Status::Offline.as_str() }));
            self.core.accept_replica(env, Replicated::default());
        }
        if let Some(held) = held {
            tokio::spawn(super::missed_mail::keep(
                self.link.clone(),
                ready.clone(),
                self.core.clone(),
                bridge.to_owned(),
                held,
            ));
        }
    }
}

/// How long heartbeats say this bridge's cards are coming, at most, from NATS coming back:
/// many cards to read, a card whose put keeps failing, or cards kept without a pause do
/// not keep the others from settling a clash with it for long.
const CARDS_COMING_AT_MOST: Duration = Duration::from_secs(10);

/// How many cards are read at once as NATS is back, and how long each read may take.
const READS_AT_ONCE: usize = 64;
const READ_WITHIN: Duration = Duration::from_secs(2);

/// As NATS is back: reads the card of each agent this bridge holds online (another bridge
/// may have put one showing the name online there meanwhile, which the watch may not
/// bring: `clashes`), then puts this bridge's cards over them.
async fn read_cards_then_put_own(
    ready: Arc<Ready>,
    core: Arc<Core>,
    cards: Arc<CardKeeper>,
    clashes: Arc<Clashes>,
    this_bridge: String,
) {
    let held_online = || {
        let mut names = Vec::new();
        core.directory.for_each(|info| {
            if info.is_online_here() {
                names.push(info.name.clone());
            }
        });
        names
    };
    let reads = futures_util::stream::iter(held_online()).map(|name| {
        let read = ready.agents.entry(agent_key(&name));
        async move { tokio::time::timeout(READ_WITHIN, read).await }
    });
    let mut reads = reads.buffer_unordered(READS_AT_ONCE);
    while let Some(read) = reads.next().await {
        let Ok(Ok(Some(entry))) = read else {
            continue;
        };
        let card = serde_json::from_slice::<Card>(&entry.value).ok();
        if let Some(card) = card.filter(|card| card.bridge != this_bridge) {
            clashes.card(&card, entry.revision);
        }
    }
    for name in held_online() {
        cards.keep(&name);
    }
}

/// Every card in the agents bucket, as stored, with its revision.
async fn all_cards(ready: &Ready) -> Vec<(bytes::Bytes, u64)> {
    use async_nats::jetstream::kv::Operation;
    let Ok(mut keys) = ready.agents.keys().await else {
        return Vec::new();
    };
    let mut names = Vec::new();
    while let Some(Ok(key)) = keys.next().await {
        names.push(key);
    }
    let mut cards = Vec::with_capacity(names.len());
    for key in names {
        if let Ok(Some(entry)) = ready.agents.entry(&key).await
            && entry.operation == Operation::Put
        {
            cards.push((entry.value, entry.revision));
        }
    }
    cards
}

async fn next_entry(watch: &mut Option<BucketWatch>) -> Option<async_nats::jetstream::kv::Entry> {
    match watch {
        Some(watch) => watch.next().await,
        None => std::future::pending().await,
    }
}
