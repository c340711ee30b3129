//! The Skynet workspace: who is joined, on which connection, and the join / leave /
//! heartbeat rules of Skynet's reference server.
//!
//! Members are kept under one std `Mutex` (never held across an `.await`); every broadcast
//! they cause goes through the core as an Envelope, so agents of other protocols see them.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use parking_lot::Mutex;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};
use tokio::task::AbortHandle;

use super::mentions::Candidates;
use super::registry::{Profile, status_from_skynet, status_to_skynet};
use super::translate::{self, Peers};
use super::{MentionCandidates, PROTOCOL, Skynet, wire};
use crate::core::{
    AgentInfo, Audience, Closed, Envelope, Interest, Kind, Origin, Role, Session, Status,
    derived_uuid, new_message_id, now_ms,
};
use crate::protocols::endpoint::Translation;
use crate::telemetry;

/// human name → agent names whose execution logs the human watches.
type Watching = Arc<DashMap<String, HashSet<String>>>;

pub struct Workspace {
    members: Mutex<Members>,
    watching: Watching,
    next_conn: AtomicU64,
}

#[derive(Default)]
struct Members {
    by_id: HashMap<String, Member>,
    next_seq: u64,
}

struct Member {
    name: String,
    /// The AgentCard as sent in the join, with the latest heartbeat status.
    card: Map<String, Value>,
    status: Option<String>,
    /// The connection currently holding the membership, while it is open.
    live: Option<(u64, Arc<Session>)>,
    pending_leave: Option<AbortHandle>,
    seq: u64,
}

/// What a successful join gives the connection.
pub struct Joined {
    pub agent_id: String,
    pub name: String,
    pub human: bool,
    pub session: Arc<Session>,
    /// A genuinely new member (not a reconnect).
    pub is_new: bool,
}

impl Workspace {
    pub fn new() -> Self {
        Workspace {
            members: Mutex::new(Members::default()),
            watching: Arc::new(DashMap::new()),
            next_conn: AtomicU64::new(1),
        }
    }

    pub fn next_conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// The members `listed` takes, by name.
    pub fn member_count(&self, listed: impl Fn(&str) -> bool) -> usize {
        let members = self.members.lock();
        members.by_id.values().filter(|m| listed(&m.name)).count()
    }

    /// Removes member `id` if it has no socket open (it waits out its grace period).
    fn remove_if_away(&self, id: &str) -> Option<Member> {
        let mut members = self.members.lock();
        match members.by_id.get(id) {
            Some(member) if member.live.is_none() => members.by_id.remove(id),
            _ => None,
        }
    }

    /// Joined, whether or not its socket is open (a member in its grace period is joined).
    pub fn is_member(&self, id: &str) -> bool {
        self.members.lock().by_id.contains_key(id)
    }

    pub fn status_of(&self, id: &str) -> Option<String> {
        self.members
            .lock()
            .by_id
            .get(id)
            .and_then(|m| m.status.clone())
    }

    pub fn card_of_name(&self, name: &str) -> Option<Value> {
        let members = self.members.lock();
        members
            .by_id
            .values()
            .find(|m| m.name == name)
            .map(|m| Value::Object(m.card.clone()))
    }

    /// The cards of the joined Skynet members `listed` takes by name, in join order.
    pub fn cards(&self, listed: impl Fn(&str) -> bool) -> Vec<Value> {
        let members = self.members.lock();
        let mut list: Vec<&Member> = (members.by_id.values())
            .filter(|m| listed(&m.name))
            .collect();
        list.sort_by_key(|m| m.seq);
        list.iter().map(|m| Value::Object(m.card.clone())).collect()
    }

    pub fn watch(&self, human: &str, agent: &str, on: bool) {
        if on {
            self.watching
                .entry(human.to_owned())
                .or_default()
                .insert(agent.to_owned());
        } else if let Some(mut set) = self.watching.get_mut(human) {
            set.remove(agent);
        }
    }

    /// The watches `name` is in, as the human or as the agent: `(human, agent)` pairs.
    pub fn watches_of(&self, name: &str) -> Vec<(String, String)> {
        let mut pairs = Vec::new();
        for entry in self.watching.iter() {
            let human = entry.key();
            for agent in entry.value() {
                if human == name || agent == name {
                    pairs.push((human.clone(), agent.clone()));
                }
            }
        }
        pairs
    }
}

/// A Skynet connection's say in routing: humans observe everything but execution logs of
/// agents they do not watch; agents only take what names them.
struct MemberInterest {
    human: Option<(String, Watching)>,
}

impl Interest for MemberInterest {
    fn observes(&self, env: &Envelope) -> bool {
        let Some((name, watching)) = &self.human else {
            return false;
        };
        env.kind != Kind::Log
            || watching
                .get(name)
                .is_some_and(|agents| agents.contains(&env.from))
    }
}

impl Skynet {
    /// Joins `profile` on connection `conn_id`; an older connection of the same member is
    /// told to close with 4001.
    pub fn join(&self, conn_id: u64, profile: &Profile, card: Map<String, Value>) -> Joined {
        let ws = &self.workspace;
        let human = profile.is_human();
        let status = card
            .get("status")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let mut members = ws.members.lock();
        let is_new = !members.by_id.contains_key(&profile.id);
        if is_new {
            let seq = members.next_seq;
            members.next_seq += 1;
            members.by_id.insert(
                profile.id.clone(),
                Member {
                    name: profile.name.clone(),
                    card: Map::new(),
                    status: None,
                    live: None,
                    pending_leave: None,
                    seq,
                },
            );
        }
        let member = members.by_id.get_mut(&profile.id).expect("just inserted");
        if let Some(timer) = member.pending_leave.take() {
            timer.abort();
        }
        member.card = card;
        member.status = status.clone();
        let session = match member.live.take() {
            Some((live_conn, session)) if live_conn == conn_id => session,
            older => {
                if let Some((_, old)) = older {
                    self.core.router.detach(&old);
                    old.mailbox.close(Closed::Replaced);
                }
                let interest = MemberInterest {
                    human: human.then(|| (profile.name.clone(), ws.watching.clone())),
                };
                self.core.router.attach(
                    &profile.name,
                    self.core.router.mailbox(PROTOCOL),
                    Arc::new(interest),
                )
            }
        };
        member.live = Some((conn_id, session.clone()));
        drop(members);

        let status = status
            .as_deref()
            .map(status_from_skynet)
            .unwrap_or(Status::Online);
        if let Some((was_online, _)) = self
            .core
            .directory
            .set_presence(&profile.name, true, status)
            && !was_online
        {
            telemetry::agent_online(PROTOCOL, true);
        }
        Joined {
            agent_id: profile.id.clone(),
            name: profile.name.clone(),
            human,
            session,
            is_new,
        }
    }

    /// Broadcasts (and stores) the `agent.join` of a new member.
    pub async fn announce_join(&self, joined: &Joined) {
        let card = (self.workspace.card_of_name(&joined.name))
            .map_or(Value::Null, |card| self.held_here(card));
        let status = card
            .get("status")
            .and_then(Value::as_str)
            .map(status_from_skynet)
            .unwrap_or(Status::Online);
        let native = json!({
            "id": new_message_id(),
            "type": "agent.join",
            "from": joined.agent_id,
            "timestamp": now_ms(),
            "payload": { "agent": card },
        });
        self.core
            .announce_presence(PROTOCOL, &joined.name, true, status, Some(native))
            .await;
    }

    /// The explicit `leave` action: the member is removed at once.
    pub async fn leave(&self, agent_id: &str) {
        let removed = {
            let mut members = self.workspace.members.lock();
            members.by_id.remove(agent_id)
        };
        let Some(member) = removed else { return };
        if let Some(timer) = member.pending_leave {
            timer.abort();
        }
        if let Some((_, session)) = member.live {
            self.core.router.detach(&session);
            session.mailbox.close(Closed::Gone);
        }
        self.announce_leave(agent_id, &member.name).await;
    }

    /// A connection closed: its member waits out the grace period before leaving.
    pub fn disconnected(self: &Arc<Self>, agent_id: &str, conn_id: u64) {
        // The bridge is stopping: nobody is left to tell, and the store is closing.
        if self.shutdown.is_cancelled() {
            return;
        }
        let mut members = self.workspace.members.lock();
        let Some(member) = members.by_id.get_mut(agent_id) else {
            return;
        };
        match &member.live {
            Some((live_conn, session)) if *live_conn == conn_id => {
                self.core.router.detach(session);
            }
            // A newer connection took over (or the member already lost its socket).
            _ => return,
        }
        member.live = None;
        if member.pending_leave.is_none() {
            let skynet = self.clone();
            let id = agent_id.to_owned();
            let grace = Duration::from_millis(self.config.disconnect_grace_ms);
            let timer = tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                skynet.grace_expired(&id).await;
            });
            member.pending_leave = Some(timer.abort_handle());
        }
    }

    /// The fleet gave the member's name to an agent another bridge holds
    /// (`Core::yield_name`): its connection `conn_id` is closing, and the member goes at
    /// once, with no leave (the name is online elsewhere).
    pub fn lost_name(&self, agent_id: &str, conn_id: u64) {
        let mut members = self.workspace.members.lock();
        let live_here = (members.by_id.get(agent_id))
            .is_some_and(|m| m.live.as_ref().is_some_and(|(conn, _)| *conn == conn_id));
        if !live_here {
            return;
        }
        let Some(member) = members.by_id.remove(agent_id) else {
            return;
        };
        drop(members);
        if let Some(timer) = member.pending_leave {
            timer.abort();
        }
        if let Some((_, session)) = member.live {
            self.core.router.detach(&session);
        }
    }

    async fn grace_expired(&self, agent_id: &str) {
        if let Some(member) = self.workspace.remove_if_away(agent_id) {
            self.announce_leave(agent_id, &member.name).await;
        }
    }

    async fn announce_leave(&self, agent_id: &str, name: &str) {
        // The name is another bridge's now (`lost_name`): its presence is that bridge's to
        // tell.
        if self.core.directory.held_elsewhere(name) {
            return;
        }
        let native = json!({
            "id": new_message_id(),
            "type": "agent.leave",
            "from": agent_id,
            "timestamp": now_ms(),
            "payload": { "agentId": agent_id },
        });
        self.core
            .announce_presence(PROTOCOL, name, false, Status::Offline, Some(native))
            .await;
    }

    /// Records a heartbeat's status; a change is announced to every other member.
    pub async fn heartbeat(&self, agent_id: &str, name: &str, status: Option<String>) {
        let changed = {
            let mut members = self.workspace.members.lock();
            let Some(member) = members.by_id.get_mut(agent_id) else {
                return;
            };
            let changed = member.status != status;
            member.status = status.clone();
            match &status {
                Some(s) => member.card.insert("status".into(), json!(s)),
                None => member.card.remove("status"),
            };
            changed
        };
        if !changed {
            return;
        }
        // A heartbeat without a status clears it: the event then has no `status`, as
        // Skynet's server writes an unset one.
        let data = match &status {
            Some(s) => json!({ "agentId": agent_id, "status": s }),
            None => json!({ "agentId": agent_id }),
        };
        let native = wire::event_value(wire::EVENT_STATUS_CHANGE, data);
        let status = status.unwrap_or_default();
        self.core
            .directory
            .set_presence(name, true, status_from_skynet(&status));
        let env = presence(
            Kind::PresenceStatus,
            name,
            native,
            json!({ "status": status }),
        );
        self.core.publish_transient(env).await;
    }

    /// Everyone a chat may `@mention` (card id and lower-cased `@name`), in the order
    /// Skynet tries them: registered agents, registered humans, then agents of other
    /// protocols or on other bridges of the fleet.
    pub fn mention_candidates(&self) -> MentionCandidates {
        // Rebuilt only when an agent is registered, changed or removed anywhere: every
        // chat with an `@` in it asks for this list.
        self.mention_cache.get(&self.core.directory, || {
            let mut members: Vec<(String, String)> = self
                .registry
                .list(false)
                .into_iter()
                .chain(self.registry.list(true))
                .map(|p| (p.id, p.name))
                .collect();
            let mut foreign = Vec::new();
            self.core.directory.for_each(|agent| {
                if agent.protocol != PROTOCOL || agent.bridge.is_some() {
                    foreign.push((agent.created_at, agent.name.clone()));
                }
            });
            foreign.sort();
            members.extend(
                foreign
                    .into_iter()
                    .map(|(_, name)| (self.card_id(&name), name)),
            );
            Candidates::new(members)
        })
    }

    /// Every member as Skynet shows them: members joined here, then the agents online
    /// elsewhere (other protocols' agents, and in a fleet Skynet agents joined through
    /// other bridges) as cards.
    pub fn member_cards(&self) -> Vec<Value> {
        let mut cards: Vec<Value> = (self.workspace.cards(|name| self.listed_here(name)))
            .into_iter()
            .map(|card| self.held_here(card))
            .collect();
        for peer in self.core.directory.online_foreign(PROTOCOL) {
            cards.push(self.card_elsewhere(&peer));
        }
        cards
    }

    /// A registered agent's profile with its live status, as `GET /api/agents` shows it:
    /// joined here, or in a fleet online through another bridge (which it names);
    /// offline otherwise.
    pub fn profile_card(&self, profile: &Profile) -> Value {
        if let Some(status) = self.workspace.status_of(&profile.id)
            && self.listed_here(&profile.name)
        {
            return self.held_here(profile.to_json(&status));
        }
        match self.online_elsewhere(profile) {
            Some(agent) => self.profile_held(profile, &agent),
            None => profile.to_json("offline"),
        }
    }

    /// The agent `profile` registers, while it is online through another bridge of the
    /// fleet.
    pub fn online_elsewhere(&self, profile: &Profile) -> Option<AgentInfo> {
        (self.core.directory.get(&profile.name))
            .filter(|agent| agent.is_online_elsewhere() && agent.native_id == profile.id)
    }

    pub fn member_count(&self) -> usize {
        let here = self.workspace.member_count(|name| self.listed_here(name));
        here + self.core.directory.online_foreign(PROTOCOL).len()
    }

    /// Whether a member joined here is listed as this bridge's: not one waiting out its
    /// grace period whose agent joined through another bridge since, which the fleet gave
    /// the name to (listed as that bridge's; its leave, when the grace period ends, is not
    /// announced).
    pub(super) fn listed_here(&self, name: &str) -> bool {
        !self.core.directory.held_elsewhere(name)
    }

    /// Forgets `profile`'s member here while it waits out its grace period and the fleet
    /// gave its name to its agent joined through another bridge (`listed_here`), with no
    /// leave: the agent joining here again is a new member, announced to the fleet, not a
    /// reconnect.
    pub fn forget_member_held_elsewhere(&self, profile: &Profile) {
        if self.listed_here(&profile.name) {
            return;
        }
        let removed = self.workspace.remove_if_away(&profile.id);
        if let Some(timer) = removed.and_then(|member| member.pending_leave) {
            timer.abort();
        }
    }

    /// The card of a member joined here, naming this bridge in a fleet (as every card
    /// there names the bridge holding its agent).
    fn held_here(&self, card: Value) -> Value {
        held_by(card, self.core.directory.bridge_id())
    }

    /// The card of an agent not joined here: a Skynet agent's own profile (registrations
    /// are the fleet's), another protocol's as `foreign_card`; naming its bridge in a fleet.
    fn card_elsewhere(&self, agent: &AgentInfo) -> Value {
        match self.profile_of(agent) {
            Some(profile) => self.profile_held(&profile, agent),
            None => self.foreign_card(agent),
        }
    }

    /// A Skynet agent's registration; none for another protocol's agent.
    fn profile_of(&self, agent: &AgentInfo) -> Option<Profile> {
        (agent.protocol == PROTOCOL)
            .then(|| self.registry.by_id(&agent.native_id))
            .flatten()
    }

    /// A Skynet agent's registered profile, with the status and bridge its presence
    /// carries.
    fn profile_held(&self, profile: &Profile, agent: &AgentInfo) -> Value {
        let card = profile.to_json(status_to_skynet(agent.status));
        held_by(card, self.core.directory.holding_bridge(agent))
    }

    /// The card shown for an agent of another protocol: a stable UUIDv5 id, `generic`.
    fn foreign_card(&self, peer: &AgentInfo) -> Value {
        let mut card = Map::new();
        card.insert("id".into(), json!(self.card_id(&peer.name)));
        card.insert("name".into(), json!(peer.name));
        card.insert(
            "type".into(),
            json!(if peer.role == Role::Human {
                "human"
            } else {
                "generic"
            }),
        );
        if let Some(description) = &peer.description {
            card.insert("role".into(), json!(description));
        }
        if !peer.capabilities.is_empty() {
            card.insert("capabilities".into(), json!(peer.capabilities));
        }
        card.insert(
            "status".into(),
            json!(if peer.online {
                status_to_skynet(peer.status)
            } else {
                "offline"
            }),
        );
        card.insert("createdAt".into(), json!(peer.created_at));
        held_by(
            Value::Object(card),
            self.core.directory.holding_bridge(peer),
        )
    }

    /// A message as Skynet clients see it.
    pub fn encode(&self, env: &Envelope) -> Option<Value> {
        translate::Translator::encode(self, env)
    }

    /// `encode`, as JSON written inside another frame or answer (a join's replay, the
    /// history API): a Skynet client's own message as it came, in its field order, as it
    /// was sent live.
    pub fn encode_raw(&self, env: &Envelope) -> Option<Box<RawValue>> {
        match own_message(env) {
            Some(message) => RawValue::from_string(message.to_owned()).ok(),
            None => serde_json::value::to_raw_value(&self.encode(env)?).ok(),
        }
    }

    /// `encode`, as the text written to a socket. A Skynet client's own frame is written
    /// as it came, in the JSON text made once for the store.
    pub fn encode_text(&self, env: &Envelope) -> Option<String> {
        match own_message(env) {
            Some(message) => Some(message.to_owned()),
            // Straight into a buffer: `Value`'s `to_string` goes through `fmt` a piece at
            // a time, as slow again as the encoding.
            None => self
                .encode(env)
                .and_then(|v| serde_json::to_string(&v).ok()),
        }
    }
}

/// A Skynet client's own message, as the text it was sent and stored in. Another
/// protocol's frame is not asked for its text, which may not have been written yet.
fn own_message(env: &Envelope) -> Option<&str> {
    if env.origin_is(PROTOCOL) {
        env.origin.native_json()
    } else {
        None
    }
}

impl Peers for Skynet {
    fn card_id(&self, name: &str) -> String {
        if let Some(id) = self.core.directory.native_id(name, PROTOCOL) {
            return id;
        }
        let known = self
            .foreign_card_ids
            .get(&self.core.directory, DashMap::new);
        if let Some(id) = known.get(name) {
            return id.clone();
        }
        let id = derived_uuid("agent", name).to_string();
        self.core.directory.add_alias(PROTOCOL, id.clone(), name);
        // Only registered names are kept, so unknown names cannot grow the map.
        if self.core.directory.contains(name) {
            known.insert(name.to_owned(), id.clone());
        }
        id
    }

    fn name_of(&self, card_id: &str) -> Option<String> {
        if let Some(name) = self.core.directory.by_native(PROTOCOL, card_id) {
            return Some(name);
        }
        // A foreign agent whose derived id this process has not shown yet (after a restart):
        // every foreign agent's id worked out once per directory change, not per lookup.
        let derived = self.derived_names.get(&self.core.directory, || {
            let mut by_id = foldhash::HashMap::default();
            self.core.directory.for_each(|agent| {
                if agent.protocol != PROTOCOL {
                    let id = derived_uuid("agent", &agent.name).to_string();
                    by_id.insert(id, agent.name.clone());
                }
            });
            by_id
        });
        let found = derived.get(card_id).cloned();
        if let Some(name) = &found {
            self.core
                .directory
                .add_alias(PROTOCOL, card_id.to_owned(), name);
        }
        found
    }

    fn card(&self, name: &str) -> Option<Value> {
        if let Some(card) = self.workspace.card_of_name(name)
            && self.listed_here(name)
        {
            return Some(self.held_here(card));
        }
        let agent = self.core.directory.get(name)?;
        if agent.protocol == PROTOCOL {
            return (self.profile_of(&agent)).map(|profile| self.profile_held(&profile, &agent));
        }
        Some(self.foreign_card(&agent))
    }
}

/// `card`, naming `bridge` as the one holding its agent (in a fleet).
fn held_by(mut card: Value, bridge: Option<&str>) -> Value {
    if let (Some(bridge), Some(fields)) = (bridge, card.as_object_mut()) {
        fields.insert("bridge".into(), json!(bridge));
    }
    card
}

fn presence(kind: Kind, name: &str, native: Value, data: Value) -> Envelope {
    let mut env = Envelope::new(PROTOCOL, name, kind);
    if let Some(id) = native.get("id").and_then(Value::as_str) {
        env.id = id.to_owned();
    }
    env.audience = Audience::Everyone;
    env.data = Some(data);
    env.origin = Origin::new(PROTOCOL, Some(native));
    env
}

impl Default for Workspace {
    fn default() -> Self {
        Self::new()
    }
}
