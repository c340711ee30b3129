//! What crosses NATS: names of subjects, streams and buckets, and the JSON of a message
//! with, for a presence change, the card of the agent it is about.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::core::{AgentInfo, BRIDGE_PROTOCOL, Envelope, Protocol, Role, Status};
use crate::protocols::registry;
use crate::shared::deep_json::from_own_str;

/// The header naming the bridge that accepted a message: a bridge applies only the
/// others' messages, so nothing it receives is published again.
pub const BRIDGE_HEADER: &str = "Agentbridge-Bridge";

/// The header naming the run of the bridge (its process) that accepted a message: a bridge
/// passes over what it accepted in this run, which it routed then, and applies what an
/// earlier run of it accepted, as that run may not have written it to its agents.
pub const RUN_HEADER: &str = "Agentbridge-Run";

/// The names one fleet uses in NATS, all from its prefix.
#[derive(Clone, Debug)]
pub struct Names {
    /// The stream of record: every accepted message, on `<prefix>.msg.<bridge>`.
    pub stream: String,
    /// Each agent's card, by name: who holds it, on which bridge, and its presence.
    pub agents: String,
    /// Each bridge's heartbeat, by bridge id.
    pub bridges: String,
    /// Each bridge's floors record, by bridge id: its heartbeat's floors, put more often,
    /// in a bucket nobody watches (`UnwrittenFloor`).
    pub floors: String,
    /// Which bridge holds each name, by name.
    pub claims: String,
    /// The records endpoints share, by table and key (`records`).
    pub records: String,
    /// The files endpoints share (attachments, larger than a record may be), by name.
    pub files: String,
    prefix: String,
}

impl Names {
    pub fn new(prefix: &str) -> Names {
        Names {
            stream: format!("{}_MESSAGES", prefix.to_ascii_uppercase()),
            agents: format!("{prefix}_agents"),
            bridges: format!("{prefix}_bridges"),
            floors: format!("{prefix}_floors"),
            claims: format!("{prefix}_names"),
            records: format!("{prefix}_records"),
            files: format!("{prefix}_files"),
            prefix: prefix.to_owned(),
        }
    }

    /// The subjects the stream holds.
    pub fn all_messages(&self) -> String {
        format!("{}.msg.>", self.prefix)
    }

    /// The subject `bridge` is asked on to hand over the mail of an agent that left it
    /// (`handover`).
    pub fn handover_of(&self, bridge: &str) -> String {
        format!("{}.handover.{bridge}", self.prefix)
    }

    /// The subject `bridge` publishes what it accepts on.
    pub fn messages_of(&self, bridge: &str) -> String {
        format!("{}.msg.{bridge}", self.prefix)
    }

    /// The durable consumer through which `bridge` applies the stream.
    pub fn consumer_of(bridge: &str) -> String {
        format!("bridge-{bridge}")
    }
}

/// Whether `name` can be a bridge id or a prefix: one NATS subject token, one bucket-name
/// part.
pub fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// An agent name as a KV key (keys allow only `[-/_=.a-zA-Z0-9]`; names allow more).
pub fn agent_key(name: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(name)
}

/// A message as it crosses.
#[derive(Serialize)]
pub struct OutgoingReplica<'a> {
    pub envelope: &'a Envelope,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<Card>,
    /// Routed but not kept (a status change).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub transient: bool,
    /// Kept but not routed: history its bridge delivered itself while NATS was away.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub history: bool,
    /// Published again after a publish of it whose outcome is unknown (JetStream's answer
    /// never came): the stream may hold it already, under another NATS id, so a bridge
    /// applying it asks its store first.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub resent: bool,
}

impl OutgoingReplica<'_> {
    /// The replica as JSON, for the stream. The buffer is sized for the message first: grown
    /// from serde_json's default, it is reallocated and copied several times a message,
    /// about 2.4 % of the sending bridge's instructions on skynet@a→skynet@b
    /// (`benches/callgrind-fleet.sh a`).
    pub fn to_json(&self) -> serde_json::Result<Vec<u8>> {
        let mut json = Vec::with_capacity(512 + self.envelope.bulk_len());
        serde_json::to_writer(&mut json, self)?;
        Ok(json)
    }
}

#[derive(Deserialize)]
pub struct Replica {
    pub envelope: Envelope,
    #[serde(default)]
    pub agent: Option<Card>,
    #[serde(default)]
    pub transient: bool,
    #[serde(default)]
    pub history: bool,
    #[serde(default)]
    pub resent: bool,
}

impl Replica {
    /// The messages one message of the stream holds: one, or a batch (a list of them,
    /// `fleet_log`), in the order they were accepted.
    pub fn all_in(payload: &[u8]) -> serde_json::Result<Vec<Replica>> {
        // Checked as UTF-8 once, whole: read from bytes, serde_json checks each string on
        // its own, about 2.4 % more of the applying bridge's instructions
        // (`benches/callgrind-fleet.sh b`).
        let text = std::str::from_utf8(payload).map_err(serde::de::Error::custom)?;
        match text.trim_ascii_start().as_bytes().first() {
            Some(b'[') => from_own_str(text),
            _ => from_own_str(text).map(|one| vec![one]),
        }
    }
}

/// An agent as another bridge is told of it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Card {
    pub name: String,
    pub protocol: String,
    pub native_id: String,
    pub role: Role,
    #[serde(default)]
    pub agent_type: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub capabilities: Vec<String>,
    pub online: bool,
    pub status: Status,
    pub created_at: i64,
    pub listed: bool,
    /// The bridge that holds it.
    pub bridge: String,
    /// Whether a connection of the agent is open on that bridge (one online with none is a
    /// Skynet member waiting out its grace period): of two bridges holding one name at
    /// once, a connected agent keeps it (`clashes`). Absent from cards of bridges that did
    /// not say, which count as connected.
    #[serde(default = "connected_unless_said")]
    pub connected: bool,
}

fn connected_unless_said() -> bool {
    true
}

impl Card {
    /// `info` as held by `bridge` (this one, when `info.bridge` is not set).
    pub fn of(info: &AgentInfo, bridge: &str) -> Card {
        Card {
            name: info.name.clone(),
            protocol: info.protocol.to_owned(),
            native_id: info.native_id.clone(),
            role: info.role,
            agent_type: info.agent_type.clone(),
            description: info.description.clone(),
            capabilities: info.capabilities.clone(),
            online: info.online,
            status: info.status,
            created_at: info.created_at,
            listed: info.listed,
            bridge: info.bridge.clone().unwrap_or_else(|| bridge.to_owned()),
            connected: info.online,
        }
    }

    /// The card, saying whether a connection of the agent is open on its bridge.
    pub fn connected(mut self, connected: bool) -> Card {
        self.connected = connected;
        self
    }

    /// The directory entry, when its protocol is one this bridge knows.
    pub fn into_info(self) -> Option<AgentInfo> {
        let protocol = known_protocol(&self.protocol)?;
        let mut info = AgentInfo::new(self.name, protocol, self.native_id);
        info.role = self.role;
        info.agent_type = self.agent_type;
        info.description = self.description;
        info.capabilities = self.capabilities;
        info.online = self.online;
        info.status = self.status;
        info.created_at = self.created_at;
        info.listed = self.listed;
        info.bridge = Some(self.bridge);
        info.connected = self.connected;
        Some(info)
    }
}

/// The registry's name for `name` (directory entries name protocols by `'static` str).
pub fn known_protocol(name: &str) -> Option<Protocol> {
    (registry::PROTOCOLS.iter().copied())
        .chain(std::iter::once(BRIDGE_PROTOCOL))
        .find(|p| *p == name)
}

/// A bridge's heartbeat, as it is kept in the bridges bucket; and, in the same form, its
/// floors record, kept in the floors bucket.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Heartbeat {
    pub bridge: String,
    /// The run of the bridge that put it (`NatsLink::run_id`). Absent from those of
    /// bridges that did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// Which of that run's puts of its floors, heartbeat or floors record, it is: of two of
    /// one run, the greater carries the later floors.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub put: u64,
    /// Milliseconds since the epoch, by the sending bridge's clock (for people reading
    /// the bucket; liveness is judged by when a heartbeat arrives).
    pub at: i64,
    /// The first stream sequence of what the bridge acknowledged before its deliveries
    /// were all written (`UnwrittenFloor`): a stretch read again for it starts here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unwritten_from: Option<u64>,
    /// Where each agent's deliveries not written begin, when the bridge can tell whose
    /// they are: a stretch read again for it is kept, up to its acknowledgement floor or
    /// `routed_through` if further, only for these agents, each from its own floor
    /// (`Unwritten`); for none if it is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unwritten_for: Option<BTreeMap<String, u64>>,
    /// The stream sequence the bridge had routed, and taken the holds of, through as it
    /// put the heartbeat: up to there, `unwritten_for` names every agent not yet written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_through: Option<u64>,
    /// Whether the bridge's cards in the agents bucket may be older than what it holds
    /// (never said by a floors record):
    /// from its start, or NATS coming back, until it has put its own over them (`cards`).
    /// Another bridge reading them meanwhile finds no clash in them: the newer come.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cards_coming: bool,
}

impl Heartbeat {
    /// The floor a heartbeat's value carries (none in one unreadable).
    pub fn floor_in(value: &[u8]) -> Option<u64> {
        Heartbeat::read(value).and_then(|beat| beat.unwritten_from)
    }

    /// Where its bridge's deliveries not written begin.
    pub fn unwritten(&self) -> Unwritten {
        Unwritten {
            from: self.unwritten_from,
            by_agent: self.unwritten_for.clone(),
            through: self.routed_through.unwrap_or(0),
        }
    }

    /// The heartbeat a value of the bridges bucket holds, or the floors record one of the
    /// floors bucket holds (none if it is unreadable).
    pub fn read(value: &[u8]) -> Option<Heartbeat> {
        serde_json::from_slice(value).ok()
    }

    /// Whether this was put by the run of its bridge that put `other` (`false` where either
    /// does not say).
    pub fn same_run_as(&self, other: &Heartbeat) -> bool {
        self.run.is_some() && self.run == other.run
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Where a bridge's deliveries not yet written begin, as its heartbeat carries them
/// (`UnwrittenFloor`): a stretch read again for it after a kill starts at `from` if that is
/// before its consumer's acknowledgement floor; and what of it is up to that floor, or
/// `through` if further, is kept again only for the agents `by_agent` names, each from its
/// own floor, or for every agent if it is `None` (a bridge that cannot tell whose they
/// are, or one from before agents were named). Past both, it is kept for every agent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Unwritten {
    /// The first sequence of the oldest batch acknowledged before it was written.
    pub from: Option<u64>,
    pub by_agent: Option<BTreeMap<String, u64>>,
    /// Where `by_agent` tells up to, past the acknowledgement floor.
    pub through: u64,
}

impl Unwritten {
    /// Whether the message at `sequence` is kept again for every agent of the bridge, its
    /// consumer's acknowledgement floor `acknowledged`: past what the floors tell of.
    pub fn for_all(&self, sequence: u64, acknowledged: u64) -> bool {
        self.by_agent.is_none() || sequence > acknowledged.max(self.through)
    }

    /// From where `agent`'s deliveries were not written, if any were.
    pub fn of(&self, agent: &str) -> Option<u64> {
        match &self.by_agent {
            None => self.from,
            Some(by_agent) => by_agent.get(agent).copied(),
        }
    }

    /// What either says: the older floor of each agent, told up to the nearer sequence.
    /// (One heartbeat from the bucket, one from the watch: either may be the later.)
    pub fn and(self, other: Unwritten) -> Unwritten {
        let from = self.from.into_iter().chain(other.from).min();
        let by_agent = self.by_agent.zip(other.by_agent).map(|(mut a, b)| {
            for (agent, floor) in b {
                let older = a.entry(agent).or_insert(floor);
                *older = (*older).min(floor);
            }
            a
        });
        Unwritten {
            from,
            by_agent,
            through: self.through.min(other.through),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unwritten(from: u64, by_agent: Option<&[(&str, u64)]>) -> Unwritten {
        Unwritten {
            from: Some(from),
            by_agent: by_agent.map(|floors| {
                (floors.iter())
                    .map(|(agent, floor)| (agent.to_string(), *floor))
                    .collect()
            }),
            through: 0,
        }
    }

    /// Two heartbeats of one bridge (the bucket's, the watch's) say, together, the older
    /// floor of each agent, up to the nearer sequence; if either names none, all are read
    /// from the older floor.
    #[test]
    fn two_heartbeats_together_say_the_older_floor_of_each_agent() {
        let a = Unwritten {
            through: 500,
            ..unwritten(100, Some(&[("slow", 100)]))
        };
        let b = Unwritten {
            through: 400,
            ..unwritten(80, Some(&[("slow", 120), ("late", 80)]))
        };
        let both = a.clone().and(b);
        let expected = unwritten(80, Some(&[("slow", 100), ("late", 80)]));
        assert_eq!(
            both,
            Unwritten {
                through: 400,
                ..expected
            }
        );
        assert_eq!((both.of("slow"), both.of("prompt")), (Some(100), None));
        assert!(!both.for_all(400, 0) && both.for_all(401, 0) && !both.for_all(450, 450));
        let unnamed = unwritten(90, None);
        assert_eq!(a.clone().and(unnamed.clone()).by_agent, None);
        assert_eq!(unnamed.of("prompt"), Some(90));
        assert!(unnamed.for_all(1, 450));
        // One that names nobody behind and no late batch leaves the other's floors.
        let nobody = Unwritten {
            by_agent: Some(BTreeMap::new()),
            through: 600,
            ..Unwritten::default()
        };
        assert_eq!(nobody.and(a.clone()), a);
    }

    /// A heartbeat from a bridge of an older version names no agent.
    #[test]
    fn a_heartbeat_tells_its_floors() {
        let old = br#"{"bridge":"b","at":1,"unwritten_from":7}"#;
        let beat = Heartbeat::read(old).unwrap();
        assert_eq!(beat.unwritten(), unwritten(7, None));
        let named = br#"{"bridge":"b","at":1,"unwritten_from":7,"unwritten_for":{"s":9},"routed_through":12}"#;
        let beat = Heartbeat::read(named).unwrap();
        let expected = unwritten(7, Some(&[("s", 9)]));
        assert_eq!(
            beat.unwritten(),
            Unwritten {
                through: 12,
                ..expected
            }
        );
        let beat = Heartbeat::read(br#"{"bridge":"b","at":1}"#).unwrap();
        assert_eq!(beat.unwritten(), Unwritten::default());
    }
}
