//! One namespace of agent names across every protocol.
//!
//! Each agent has one name in the bridge (a Skynet card name, a Tracker slug, a Synapse
//! agent id, a Grid agent). The directory keeps who holds which name, how each protocol
//! identifies it natively, and whether it is online, so that every endpoint can show every
//! other agent as a native peer. Reads are lock-free on the hot path (sharded `DashMap`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use serde::{Deserialize, Serialize};

use super::BRIDGE_PROTOCOL;
use super::envelope::Protocol;

/// Whether an agent is a program or a person. Humans observe conversations in some protocols.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Agent,
    Human,
}

/// Presence as the bridge tracks it; each protocol maps it onto its own vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Online,
    Idle,
    Busy,
    Offline,
    Error,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Online => "online",
            Status::Idle => "idle",
            Status::Busy => "busy",
            Status::Offline => "offline",
            Status::Error => "error",
        }
    }

    pub fn parse(s: &str) -> Option<Status> {
        Some(match s {
            "online" => Status::Online,
            "idle" => Status::Idle,
            "busy" => Status::Busy,
            "offline" => Status::Offline,
            "error" => Status::Error,
            _ => return None,
        })
    }
}

/// What every protocol may show about an agent of another protocol.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AgentInfo {
    /// The bridge-wide name.
    pub name: String,
    /// The protocol the agent speaks.
    pub protocol: Protocol,
    /// How its own protocol identifies it (a Skynet card UUID, a Tracker member id, …).
    pub native_id: String,
    pub role: Role,
    /// A free-form type label from the agent's protocol (`claude-code`, `executor`, …).
    pub agent_type: Option<String>,
    /// A human-readable description (a Skynet role, a Tracker member name, …).
    pub description: Option<String>,
    pub capabilities: Vec<String>,
    pub online: bool,
    pub status: Status,
    /// Milliseconds since the epoch.
    pub created_at: i64,
    /// Whether listings show it; the bridge's own agent is addressable but not a peer.
    pub listed: bool,
    /// The bridge of the fleet that holds it, when that is not this one: that bridge
    /// delivers to it, and keeps its mail while it is away.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// Whether, online through another bridge, it has a connection open there (one with
    /// none is a Skynet member waiting out its grace period): only a connected agent
    /// keeps its name from its own move here.
    #[serde(skip)]
    pub connected: bool,
}

impl AgentInfo {
    pub fn new(name: impl Into<String>, protocol: Protocol, native_id: impl Into<String>) -> Self {
        AgentInfo {
            name: name.into(),
            protocol,
            native_id: native_id.into(),
            role: Role::Agent,
            agent_type: None,
            description: None,
            capabilities: Vec::new(),
            online: false,
            status: Status::Offline,
            created_at: super::envelope::now_ms(),
            listed: true,
            bridge: None,
            connected: true,
        }
    }

    /// Whether `other` is the same agent: of the same protocol, with the same native id.
    pub fn is_same_agent(&self, other: &AgentInfo) -> bool {
        self.protocol == other.protocol && self.native_id == other.native_id
    }

    /// Whether this bridge holds the agent, and it is online.
    pub fn is_online_here(&self) -> bool {
        self.bridge.is_none() && self.online
    }

    /// Whether another bridge of the fleet holds the agent, and it is online there.
    pub fn is_online_elsewhere(&self) -> bool {
        self.bridge.is_some() && self.online
    }
}

/// A name is held by an agent of some protocol already.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("name '{name}' is already taken by {holder_protocol} {holder_role} '{name}'{}", self.on_bridge())]
pub struct NameTaken {
    pub name: String,
    pub holder_protocol: Protocol,
    pub holder_role: &'static str,
    /// The bridge of the fleet that holds it, when that is not this one.
    pub holder_bridge: Option<String>,
}

impl NameTaken {
    /// " on bridge 'b1'" when another bridge of the fleet holds the name, else nothing.
    pub fn on_bridge(&self) -> String {
        (self.holder_bridge.as_ref()).map_or_else(String::new, |b| format!(" on bridge '{b}'"))
    }

    /// The refusal of a claim on `name` the fleet could not settle in time (NATS did not
    /// answer, or the claim's task ended without an answer).
    pub fn unsettled(name: &str) -> NameTaken {
        NameTaken {
            name: name.to_owned(),
            holder_protocol: BRIDGE_PROTOCOL,
            holder_role: "agent",
            holder_bridge: Some("(the fleet could not settle who holds it; try again)".into()),
        }
    }

    fn by(info: &AgentInfo) -> NameTaken {
        NameTaken {
            name: info.name.clone(),
            holder_protocol: info.protocol,
            holder_role: match info.role {
                Role::Agent => "agent",
                Role::Human => "human",
            },
            holder_bridge: info.bridge.clone(),
        }
    }
}

/// Whether `current`, registered under a name, keeps it from `info`: another agent (of
/// another protocol, or another native id), or the same one online on another bridge of
/// the fleet — unless `info` is its move here (`moving`) and it has no connection open
/// there (a Skynet member waiting out its grace period).
fn keeps_from(current: &AgentInfo, info: &AgentInfo, moving: bool) -> bool {
    if !current.is_same_agent(info) {
        return true;
    }
    current.is_online_elsewhere() && (current.connected || !moving)
}

type Map<K, V> = DashMap<K, V, foldhash::fast::RandomState>;

#[derive(Default)]
pub struct Directory {
    by_name: Map<String, AgentInfo>,
    /// Native or alias id → the name each protocol knows by it. Keyed by the id alone, so
    /// that a lookup (a few for every message) borrows the id rather than building a key.
    by_native: Map<String, Vec<(Protocol, String)>>,
    /// Bumped whenever a name is registered, updated or freed (not on presence), so that
    /// endpoints can cache what they derive from the set of agents.
    generation: AtomicU64,
    /// Bridges of the fleet taken for gone (`bridge_gone`): the bridges still here keep the
    /// mail of the agents they held.
    gone: Map<String, ()>,
    /// This bridge's name in its fleet, once it joined one.
    bridge_id: std::sync::OnceLock<String>,
}

impl Directory {
    pub fn new() -> Self {
        Self::default()
    }

    /// This bridge is `id` in a fleet: listings name the bridge that holds each agent.
    pub fn set_bridge_id(&self, id: &str) {
        let _ = self.bridge_id.set(id.to_owned());
    }

    /// The bridge of the fleet that holds `agent` (this one, or the one it names); `None`
    /// for a bridge alone, whose listings name no bridge.
    pub fn holding_bridge<'a>(&'a self, agent: &'a AgentInfo) -> Option<&'a str> {
        let here = self.bridge_id()?;
        Some(agent.bridge.as_deref().unwrap_or(here))
    }

    /// This bridge's id in a fleet; `None` for a bridge alone.
    pub fn bridge_id(&self) -> Option<&str> {
        self.bridge_id.get().map(String::as_str)
    }

    /// Claims `info.name` for the agent. Re-registering the same agent (same protocol and
    /// native id) updates its profile and keeps its presence.
    pub fn register(&self, info: AgentInfo) -> Result<(), NameTaken> {
        self.claim(info, false)
    }

    /// Registers `info` as its agent's move here from another bridge of the fleet: as
    /// `register`, but over its own entry online there with no connection open.
    pub fn register_moved(&self, info: AgentInfo) -> Result<(), NameTaken> {
        self.claim(info, true)
    }

    /// Registers an agent the bridge knows from its config or its store, as it starts or
    /// reloads: as `register`, but the same agent online through another bridge of the
    /// fleet (it moved there; its card came first) stays held there, which is no refusal.
    pub fn register_known(&self, info: AgentInfo) -> Result<(), NameTaken> {
        let (name, protocol, native_id) =
            (info.name.clone(), info.protocol, info.native_id.clone());
        self.register(info).or_else(|taken| {
            let moved = (self.by_name.get(&name)).is_some_and(|held| {
                held.bridge.is_some() && held.protocol == protocol && held.native_id == native_id
            });
            if moved { Ok(()) } else { Err(taken) }
        })
    }

    /// Whether `register(info)` would be refused (`register_moved`, when `moving`),
    /// without registering.
    pub fn check_claim(&self, info: &AgentInfo, moving: bool) -> Result<(), NameTaken> {
        match self.by_name.get(&info.name) {
            Some(current) if keeps_from(&current, info, moving) => Err(NameTaken::by(&current)),
            _ => Ok(()),
        }
    }

    fn claim(&self, info: AgentInfo, moving: bool) -> Result<(), NameTaken> {
        match self.by_name.entry(info.name.clone()) {
            Entry::Occupied(mut held) => {
                let current = held.get();
                if keeps_from(current, &info, moving) {
                    return Err(NameTaken::by(current));
                }
                // Presence is this bridge's own: what another bridge's entry said of the
                // agent there is not carried here.
                let (online, status) = match current.bridge {
                    Some(_) => (false, Status::Offline),
                    None => (current.online, current.status),
                };
                held.insert(AgentInfo {
                    online,
                    status,
                    ..info
                });
            }
            Entry::Vacant(free) => {
                self.name_native(info.protocol, info.native_id.clone(), &info.name);
                free.insert(info);
            }
        }
        self.generation.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// Frees the name, if `protocol` holds it. Returns the removed entry.
    pub fn unregister(&self, name: &str, protocol: Protocol) -> Option<AgentInfo> {
        let (_, info) = self
            .by_name
            .remove_if(name, |_, info| info.protocol == protocol)?;
        self.by_native.retain(|_, names| {
            names.retain(|(_, n)| n != name);
            !names.is_empty()
        });
        self.generation.fetch_add(1, Ordering::Release);
        Some(info)
    }

    /// Checks whether `name` could be registered by anyone.
    pub fn check_free(&self, name: &str) -> Result<(), NameTaken> {
        match self.by_name.get(name) {
            None => Ok(()),
            Some(held) => Err(NameTaken::by(&held)),
        }
    }

    /// Takes in an agent another bridge of the fleet holds (`info.bridge`), as that bridge
    /// describes it. An agent online here keeps its name: the fleet's claims
    /// (`federation`) keep two bridges from holding one name at once.
    pub fn register_replica(&self, info: AgentInfo) {
        debug_assert!(info.bridge.is_some());
        match self.by_name.entry(info.name.clone()) {
            Entry::Occupied(mut held) => {
                let current = held.get();
                if current.is_online_here() {
                    return;
                }
                if !current.is_same_agent(&info) {
                    self.name_native(info.protocol, info.native_id.clone(), &info.name);
                }
                held.insert(info);
            }
            Entry::Vacant(free) => {
                self.name_native(info.protocol, info.native_id.clone(), &info.name);
                free.insert(info);
            }
        }
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// Gives `winner`'s name, which `loser` (an agent of this bridge) holds, to the agent
    /// another bridge holds under it (`winner.bridge`): unlike `register_replica`, over an
    /// agent online here. Returns the entry replaced; `None`, changing nothing, when the
    /// name is not `loser`'s here.
    pub fn yield_to(&self, winner: AgentInfo, loser: &AgentInfo) -> Option<AgentInfo> {
        debug_assert!(winner.bridge.is_some());
        let Entry::Occupied(mut held) = self.by_name.entry(winner.name.clone()) else {
            return None;
        };
        let current = held.get();
        if current.bridge.is_some() || !current.is_same_agent(loser) {
            return None;
        }
        let lost = held.insert(winner);
        let name = &held.get().name;
        let (protocol, native_id) = (held.get().protocol, held.get().native_id.clone());
        if !lost.is_same_agent(held.get()) {
            if let Some(mut names) = self.by_native.get_mut(&lost.native_id) {
                names.retain(|(p, n)| !(*p == lost.protocol && n == name));
            }
            self.by_native
                .remove_if(&lost.native_id, |_, names| names.is_empty());
            self.name_native(protocol, native_id, name);
        }
        drop(held);
        self.generation.fetch_add(1, Ordering::Release);
        Some(lost)
    }

    /// Whether another bridge of the fleet holds `name`.
    pub fn held_elsewhere(&self, name: &str) -> bool {
        self.by_name.get(name).is_some_and(|e| e.bridge.is_some())
    }

    /// Whether another bridge of the fleet holds any agent (online or not: a bridge cut
    /// off cannot tell).
    pub fn any_held_elsewhere(&self) -> bool {
        self.by_name.iter().any(|e| e.bridge.is_some())
    }

    /// Shows offline every agent `bridge` holds (it stopped telling the fleet it is
    /// alive); returns those that were online, with their protocols.
    pub fn bridge_gone(&self, bridge: &str) -> Vec<(String, Protocol)> {
        self.gone.insert(bridge.to_owned(), ());
        let mut gone = Vec::new();
        for mut entry in self.by_name.iter_mut() {
            if entry.bridge.as_deref() == Some(bridge) && entry.online {
                entry.online = false;
                entry.status = Status::Offline;
                gone.push((entry.name.clone(), entry.protocol));
            }
        }
        gone
    }

    /// The names of the agents `bridge` holds.
    pub fn held_by(&self, bridge: &str) -> Vec<String> {
        (self.by_name.iter())
            .filter(|e| e.bridge.as_deref() == Some(bridge))
            .map(|e| e.name.clone())
            .collect()
    }

    /// Whether `bridge` is taken for gone.
    pub fn is_gone(&self, bridge: &str) -> bool {
        self.gone.contains_key(bridge)
    }

    /// `bridge` tells the fleet it is alive again: it keeps its agents' mail again.
    pub fn bridge_back(&self, bridge: &str) {
        self.gone.remove(bridge);
    }

    /// The names of `protocol`'s agents held by bridges taken for gone: their mail is kept
    /// here (and by every other bridge still in the fleet, once between them).
    pub fn held_by_gone_bridges(&self, protocol: Protocol) -> Vec<String> {
        if self.gone.is_empty() {
            return Vec::new();
        }
        (self.by_name.iter())
            .filter(|e| e.protocol == protocol && self.gone_holder(e))
            .map(|e| e.name.clone())
            .collect()
    }

    /// The bridge taken for gone that holds `name`, if one does.
    pub fn gone_holder_of(&self, name: &str) -> Option<String> {
        let info = self.by_name.get(name)?;
        (self.gone_holder(&info))
            .then(|| info.bridge.clone())
            .flatten()
    }

    fn gone_holder(&self, info: &AgentInfo) -> bool {
        info.bridge
            .as_ref()
            .is_some_and(|b| self.gone.contains_key(b))
    }

    /// Changes whenever the set of names or their profiles changes.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn get(&self, name: &str) -> Option<AgentInfo> {
        self.by_name.get(name).map(|e| e.clone())
    }

    /// How `protocol` identifies agent `name`, when `name` is one of its own.
    pub fn native_id(&self, name: &str, protocol: Protocol) -> Option<String> {
        self.by_name
            .get(name)
            .filter(|e| e.protocol == protocol)
            .map(|e| e.native_id.clone())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    pub fn role_of(&self, name: &str) -> Option<Role> {
        self.by_name.get(name).map(|e| e.role)
    }

    pub fn protocol_of(&self, name: &str) -> Option<Protocol> {
        self.by_name.get(name).map(|e| e.protocol)
    }

    /// Who holds `name`, for a refusal: its protocol, role and (if not this one) bridge.
    /// `None` when the name is free, or held by an agent another bridge held and that is
    /// offline now (a claim here takes it over).
    pub fn holder(&self, name: &str) -> Option<NameTaken> {
        (self.by_name.get(name))
            .filter(|held| held.bridge.is_none() || held.online)
            .map(|held| NameTaken::by(&held))
    }

    /// `name`'s protocol, when this bridge keeps its mail while it is away: this bridge
    /// holds it, or the bridge that held it is gone from the fleet.
    pub fn keeps_mail_of(&self, name: &str) -> Option<Protocol> {
        (self.by_name.get(name))
            .filter(|e| e.bridge.is_none() || self.gone_holder(e))
            .map(|e| e.protocol)
    }

    /// The name behind a protocol-native id (or an alias an endpoint recorded for it).
    pub fn by_native(&self, protocol: Protocol, id: &str) -> Option<String> {
        let names = self.by_native.get(id)?;
        names
            .iter()
            .find(|(p, _)| *p == protocol)
            .map(|(_, name)| name.clone())
    }

    /// Records that `protocol` refers to `name` by `alias` (a derived id it shows for a
    /// foreign agent), so that the alias resolves like a native id.
    pub fn add_alias(&self, protocol: Protocol, alias: String, name: &str) {
        self.name_native(protocol, alias, name);
    }

    fn name_native(&self, protocol: Protocol, id: String, name: &str) {
        let mut names = self.by_native.entry(id).or_default();
        match names.iter_mut().find(|(p, _)| *p == protocol) {
            Some((_, known)) => name.clone_into(known),
            None => names.push((protocol, name.to_owned())),
        }
    }

    /// Updates presence; returns the previous `(online, status)` when the agent exists.
    pub fn set_presence(&self, name: &str, online: bool, status: Status) -> Option<(bool, Status)> {
        let mut entry = self.by_name.get_mut(name)?;
        let before = (entry.online, entry.status);
        entry.online = online;
        entry.status = status;
        Some(before)
    }

    /// Every listed agent, oldest registration first.
    pub fn list(&self) -> Vec<AgentInfo> {
        let mut all: Vec<AgentInfo> = self
            .by_name
            .iter()
            .filter(|e| e.listed)
            .map(|e| e.clone())
            .collect();
        all.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.name.cmp(&b.name)));
        all
    }

    /// Every online agent that `protocol`'s endpoint here does not hold itself: of another
    /// protocol, or on another bridge of the fleet.
    pub fn online_foreign(&self, protocol: Protocol) -> Vec<AgentInfo> {
        let mut peers: Vec<AgentInfo> = self
            .by_name
            .iter()
            .filter(|e| e.listed && e.online && (e.protocol != protocol || e.bridge.is_some()))
            .map(|e| e.clone())
            .collect();
        peers.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.name.cmp(&b.name)));
        peers
    }

    /// Calls `f` with every listed agent, without cloning; `f` must not call back into
    /// the directory.
    pub fn for_each(&self, mut f: impl FnMut(&AgentInfo)) {
        for entry in self.by_name.iter().filter(|e| e.listed) {
            f(&entry);
        }
    }
}

/// Something an endpoint works out from the directory (who may be mentioned, the ids it
/// shows for foreign agents), kept until the directory changes (`Directory::generation`).
pub struct PerGeneration<T> {
    cached: ArcSwap<(u64, Arc<T>)>,
}

impl<T: Default> Default for PerGeneration<T> {
    fn default() -> Self {
        // No generation is u64::MAX: the first use builds the value.
        PerGeneration {
            cached: ArcSwap::from_pointee((u64::MAX, Arc::default())),
        }
    }
}

impl<T> PerGeneration<T> {
    /// The value for the directory as it is: `build` makes it again when the directory has
    /// changed since it was last made. A change while `build` runs makes the next call
    /// build again.
    pub fn get(&self, directory: &Directory, build: impl FnOnce() -> T) -> Arc<T> {
        let generation = directory.generation();
        let cached = self.cached.load();
        if cached.0 == generation {
            return cached.1.clone();
        }
        let fresh = Arc::new(build());
        self.cached.store(Arc::new((generation, fresh.clone())));
        fresh
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_known_here_and_online_through_another_bridge_stays_held_there() {
        let dir = Directory::new();
        let mut elsewhere = AgentInfo::new("coder", "tracker", "c-1");
        (elsewhere.bridge, elsewhere.online) = (Some("b0".into()), true);
        dir.register_replica(elsewhere);
        let known = AgentInfo::new("coder", "tracker", "c-1");
        assert!(dir.register(known.clone()).is_err(), "online elsewhere");
        assert_eq!(dir.register_known(known), Ok(()));
        let held = dir.get("coder").unwrap();
        assert_eq!((held.bridge.as_deref(), held.online), (Some("b0"), true));
        // Another agent of the name is refused all the same.
        let other = AgentInfo::new("coder", "grid", "coder");
        assert!(dir.register_known(other).is_err());
    }

    #[test]
    fn a_value_per_generation_is_built_again_once_the_directory_changes() {
        let dir = Directory::new();
        let names: PerGeneration<Vec<String>> = PerGeneration::default();
        let list = |dir: &Directory| {
            let mut all = Vec::new();
            dir.for_each(|a| all.push(a.name.clone()));
            all
        };
        assert!(names.get(&dir, || list(&dir)).is_empty());
        dir.register(AgentInfo::new("coder", "beta", "m1")).unwrap();
        assert_eq!(*names.get(&dir, || list(&dir)), ["coder"]);
        // Unchanged directory: the value kept is the one returned.
        assert_eq!(*names.get(&dir, || unreachable!()), ["coder"]);
    }

    #[test]
    fn names_are_unique_across_protocols() {
        let dir = Directory::new();
        dir.register(AgentInfo::new("coder", "beta", "m1")).unwrap();
        let err = dir
            .register(AgentInfo::new("coder", "alpha", "u1"))
            .unwrap_err();
        assert_eq!(err.holder_protocol, "beta");
        assert_eq!(
            err.to_string(),
            "name 'coder' is already taken by beta agent 'coder'"
        );
        // The holder may re-register itself.
        let mut again = AgentInfo::new("coder", "beta", "m1");
        again.description = Some("Coder".into());
        dir.register(again).unwrap();
        assert_eq!(
            dir.get("coder").unwrap().description.as_deref(),
            Some("Coder")
        );
    }

    #[test]
    fn native_ids_and_aliases_resolve() {
        let dir = Directory::new();
        dir.register(AgentInfo::new("alice", "alpha", "uuid-a"))
            .unwrap();
        assert_eq!(dir.by_native("alpha", "uuid-a").as_deref(), Some("alice"));
        assert_eq!(dir.by_native("beta", "uuid-a"), None);
        dir.add_alias("beta", "derived-a".into(), "alice");
        assert_eq!(dir.by_native("beta", "derived-a").as_deref(), Some("alice"));
        dir.unregister("alice", "alpha").unwrap();
        assert_eq!(dir.by_native("alpha", "uuid-a"), None);
        assert_eq!(dir.by_native("beta", "derived-a"), None);
        assert!(dir.check_free("alice").is_ok());
    }

    #[test]
    fn unregister_only_by_the_holder() {
        let dir = Directory::new();
        dir.register(AgentInfo::new("bob", "queued", "bob"))
            .unwrap();
        assert!(dir.unregister("bob", "alpha").is_none());
        assert!(dir.contains("bob"));
    }

    #[test]
    fn presence_is_kept_across_re_registration() {
        let dir = Directory::new();
        dir.register(AgentInfo::new("a", "alpha", "1")).unwrap();
        dir.set_presence("a", true, Status::Busy);
        dir.register(AgentInfo::new("a", "alpha", "1")).unwrap();
        let a = dir.get("a").unwrap();
        assert!(a.online);
        assert_eq!(a.status, Status::Busy);
        assert_eq!(dir.online_foreign("beta").len(), 1);
        assert!(dir.online_foreign("alpha").is_empty());
    }

    /// An agent online through another bridge with no connection open there (a Skynet
    /// member waiting out its grace period) is taken by its own move alone, and its
    /// presence there is not carried here.
    #[test]
    fn only_its_own_move_takes_a_name_online_elsewhere_with_no_connection_open() {
        let dir = Directory::new();
        let mut there = AgentInfo::new("roamer", "skynet", "id-1");
        there.bridge = Some("b0".into());
        (there.online, there.status, there.connected) = (true, Status::Online, true);
        dir.register_replica(there.clone());
        let here = AgentInfo::new("roamer", "skynet", "id-1");
        assert!(dir.check_claim(&here, true).is_err(), "connected there");
        there.connected = false;
        dir.register_replica(there);
        assert!(dir.check_claim(&here, false).is_err());
        assert!(
            dir.register(here.clone()).is_err(),
            "a registration is no move"
        );
        assert!(dir.check_claim(&here, true).is_ok());
        dir.register_moved(here).unwrap();
        let now = dir.get("roamer").unwrap();
        assert!(now.bridge.is_none() && !now.online, "{now:?}");
    }

    #[test]
    fn a_name_yielded_to_another_bridge_is_held_there_even_over_an_agent_online_here() {
        let dir = Directory::new();
        dir.register(AgentInfo::new("twin", "grid", "twin"))
            .unwrap();
        dir.set_presence("twin", true, Status::Online);
        let mut winner = AgentInfo::new("twin", "synapse", "twin-s");
        (winner.bridge, winner.online) = (Some("b0".into()), true);
        // A card alone does not take the name from an agent online here.
        dir.register_replica(winner.clone());
        assert_eq!(dir.get("twin").unwrap().protocol, "grid");

        let grid = AgentInfo::new("twin", "grid", "twin");
        assert!(
            dir.yield_to(winner.clone(), &winner).is_none(),
            "not its agent here"
        );
        let lost = dir.yield_to(winner.clone(), &grid).expect("held here");
        assert_eq!((lost.protocol, lost.online), ("grid", true));
        let held = dir.get("twin").unwrap();
        assert_eq!(
            (held.protocol, held.bridge.as_deref()),
            ("synapse", Some("b0"))
        );
        assert_eq!(dir.by_native("grid", "twin"), None);
        assert_eq!(dir.by_native("synapse", "twin-s").as_deref(), Some("twin"));
        // Held elsewhere now: nothing more to yield.
        assert!(dir.yield_to(winner, &grid).is_none());
    }
}
