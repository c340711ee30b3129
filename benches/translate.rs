//! Each protocol's decode and encode of a typical chat, and translation between every
//! ordered pair of protocols.
//!
//! The message is the same everywhere: `alice` says about 100 bytes of text to `bob`,
//! mentioning him, in reply to an earlier message. Each step does what the endpoint does
//! per message, from the bytes a client sends to the bytes a client receives:
//!
//! - `decode/<p>`: the client's frame as it arrives (Skynet `send` and Tracker `chat.send`
//!   JSON text, a Synapse `SynapseMessage` in protobuf with a `StringValue` payload, a Grid
//!   YAML message) → parsed and checked → its `Envelope`. Skynet's includes stamping and
//!   `@name` enrichment (ws.rs `on_send`); Tracker's builds the `MessageOut` as
//!   `stage_post` does (chat.rs); Synapse's follows a `StreamMessages` message through
//!   `stage` (inbound.rs); Grid's parses and validates as the socket does (ws.rs `on_text`).
//! - `encode/<p>`: an `Envelope` from another protocol → the frame `<p>`'s client receives,
//!   serialized as the endpoint writes it (JSON text, protobuf bytes, YAML text).
//! - `translate/<a>→<b>`: `decode/<a>` then `encode/<b>`.
//!
//! Left out, as they are not translation: the store (publishing, Tracker's reply-to lookup,
//! Grid's repeat check), the router, and the directory (who exists, Tracker's `@name` scan;
//! Skynet's `@name` member list is taken ready-made, as the endpoint takes its cached one).
//! Every iteration encodes afresh, as `Delivery` does once per message and protocol.
//!
//! `cargo bench --bench translate`

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;

use agentbridge::core::{Envelope, Kind, derived_uuid, new_message_id, now_ms};
use agentbridge::protocols::skynet::mentions::Candidates;
use agentbridge::protocols::synapse::proto::{AgentEndpoint, MessageType, SynapseMessage};
use agentbridge::protocols::{grid, skynet, synapse, tracker};
use agentbridge::shared::clock::iso8601;
use criterion::{Criterion, criterion_group, criterion_main};
use prost::Message as _;
use serde_json::{Value, json};

const TEXT: &str = "@bob the retry fix is in: backoff now doubles up to 30 s and resets after a clean run. Can you review?";
const SENDER: &str = "alice";
const RECIPIENT: &str = "bob";
/// Names other members of the workspace go by: Skynet tries each as a mention.
const OTHERS: [&str; 4] = ["carol", "dave", "erin", "frank"];
/// The message being answered.
const REPLY_TO: &str = "0199a3c4-5b6d-7e8f-9a0b-1c2d3e4f5a6b";
/// The Tracker's lobby chat.
const LOBBY: &str = "6f0e4c2a-9d1b-4e7f-8a3c-5b2d1e0f9a8c";
/// Skynet card ids of the members Skynet registered itself.
const CARD_IDS: [(&str, &str); 2] = [
    (SENDER, "3b5f2e8c-1a4d-4c6b-9e7f-0d2a8b6c4e1f"),
    (RECIPIENT, "7c9a1e3b-5d2f-4a8e-b6c0-2e4d6f8a0b1c"),
];

#[derive(Clone, Copy)]
enum Protocol {
    Skynet,
    Tracker,
    Synapse,
    Grid,
}

const PROTOCOLS: [Protocol; 4] = [
    Protocol::Skynet,
    Protocol::Tracker,
    Protocol::Synapse,
    Protocol::Grid,
];

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::Skynet => "skynet",
            Protocol::Tracker => "tracker",
            Protocol::Synapse => "synapse",
            Protocol::Grid => "grid",
        }
    }
}

/// How Skynet card ids and names correspond, as `Skynet`'s `Peers` answers: a member
/// Skynet registered has its card id; anyone else a UUIDv5 derived from the name.
struct SkynetPeers {
    native: HashMap<String, String>,
    names: HashMap<String, String>,
}

impl SkynetPeers {
    /// Peers where `native` are Skynet's own members and every other name is foreign.
    fn new(native: &[&str]) -> Self {
        let native: HashMap<String, String> = CARD_IDS
            .iter()
            .filter(|(name, _)| native.contains(name))
            .map(|(name, id)| (name.to_string(), id.to_string()))
            .collect();
        let mut peers = SkynetPeers {
            native,
            names: HashMap::new(),
        };
        for name in [SENDER, RECIPIENT].into_iter().chain(OTHERS) {
            let id = skynet::translate::Peers::card_id(&peers, name);
            peers.names.insert(id, name.to_owned());
        }
        peers
    }

    /// Everyone a chat may `@mention`: Skynet's own members first.
    fn candidates(&self) -> Candidates {
        let mut names: Vec<&str> = [SENDER, RECIPIENT].into_iter().chain(OTHERS).collect();
        names.sort_by_key(|name| !self.native.contains_key(*name));
        Candidates::new(
            names
                .into_iter()
                .map(|name| (skynet::translate::Peers::card_id(self, name), name)),
        )
    }
}

impl skynet::translate::Peers for SkynetPeers {
    fn card_id(&self, name: &str) -> String {
        match self.native.get(name) {
            Some(id) => id.clone(),
            None => derived_uuid("agent", name).to_string(),
        }
    }
    fn name_of(&self, card_id: &str) -> Option<String> {
        self.names.get(card_id).cloned()
    }
    fn card(&self, _: &str) -> Option<Value> {
        None
    }
}

struct TrackerContext;

impl tracker::translate::Context for TrackerContext {
    fn lobby_chat_id(&self) -> &str {
        LOBBY
    }
    fn is_project_chat(&self, _: &str) -> bool {
        false
    }
    fn author_type(&self, _: &str) -> tracker::wire::AuthorType {
        tracker::wire::AuthorType::Agent
    }
}

struct SynapseContext;

impl synapse::translate::Context for SynapseContext {
    fn endpoint_of(&self, name: &str) -> AgentEndpoint {
        AgentEndpoint {
            agent_id: name.to_owned(),
            agent_name: name.to_owned(),
            system_id: "agentbridge".to_owned(),
            endpoint: String::new(),
            version: String::new(),
        }
    }
}

/// The frames clients send, and what the endpoints know to read and write them.
struct Fixture {
    skynet_frame: String,
    tracker_frame: String,
    synapse_frame: Vec<u8>,
    grid_frame: String,
    /// Skynet when `alice` is its member (it decodes her frame).
    skynet_sending: SkynetPeers,
    /// Skynet when `bob` is its member (it encodes for him).
    skynet_receiving: SkynetPeers,
    candidates: Arc<Candidates>,
}

impl Fixture {
    fn new() -> Self {
        let skynet_sending = SkynetPeers::new(&[SENDER]);
        let skynet_receiving = SkynetPeers::new(&[RECIPIENT]);
        let bob_card = skynet::translate::Peers::card_id(&skynet_sending, RECIPIENT);
        let skynet_frame = json!({
            "action": "send",
            "data": {
                "type": "chat",
                "payload": { "text": TEXT },
                "mentions": [bob_card],
                "replyTo": REPLY_TO,
            }
        })
        .to_string();
        let tracker_frame = json!({
            "type": "chat.send",
            "chat_id": LOBBY,
            "content": TEXT,
            "mentions": [RECIPIENT],
            "reply_to": REPLY_TO,
        })
        .to_string();
        let synapse_frame = SynapseMessage {
            id: new_message_id(),
            version: synapse::translate::PROTOCOL_VERSION.to_owned(),
            r#type: MessageType::Unspecified as i32,
            sender: Some(AgentEndpoint {
                agent_id: SENDER.into(),
                agent_name: SENDER.into(),
                system_id: "lab".into(),
                ..Default::default()
            }),
            receiver: Some(AgentEndpoint {
                agent_id: RECIPIENT.into(),
                ..Default::default()
            }),
            correlation_id: REPLY_TO.into(),
            reply_to: REPLY_TO.into(),
            group_id: String::new(),
            timestamp: Some(synapse::wire::timestamp(now_ms())),
            payload: Some(synapse::wire::text(TEXT)),
            signature: String::new(),
        }
        .encode_to_vec();
        let grid_frame = format!(
            "message:\n  id: msg-{id}\n  timestamp: \"{ts}\"\n  type: response\n  sender:\n    agent: {SENDER}\n  receiver:\n    agent: {RECIPIENT}\n  correlation_id: msg-{REPLY_TO}\n  content:\n    action: reply\n    payload:\n      text: \"{TEXT}\"\n  metadata:\n    priority: normal\n",
            id = uuid::Uuid::new_v4(),
            ts = iso8601(now_ms()),
        );
        let candidates = Arc::new(skynet_sending.candidates());
        Fixture {
            skynet_frame,
            tracker_frame,
            synapse_frame,
            grid_frame,
            skynet_sending,
            skynet_receiving,
            candidates,
        }
    }

    /// The client's frame of `protocol` → its envelope, as the endpoint reads it.
    fn decode(&self, protocol: Protocol) -> Envelope {
        match protocol {
            Protocol::Skynet => self.decode_skynet(),
            Protocol::Tracker => decode_tracker(&self.tracker_frame),
            Protocol::Synapse => decode_synapse(&self.synapse_frame),
            Protocol::Grid => decode_grid(&self.grid_frame),
        }
    }

    /// `env` → the bytes a client of `protocol` receives; empty when it is shown nothing.
    fn encode(&self, protocol: Protocol, env: &Envelope) -> Vec<u8> {
        let encoded = match protocol {
            Protocol::Skynet => skynet::translate::encode(env, &self.skynet_receiving)
                .map(|v| v.to_string().into_bytes()),
            Protocol::Tracker => {
                tracker::translate::encode_text(env, &TrackerContext).map(String::into_bytes)
            }
            Protocol::Synapse => {
                synapse::translate::encode(env, &SynapseContext).map(|m| m.encode_to_vec())
            }
            Protocol::Grid => {
                grid::translate::encode(env).map(|m| grid::wire::to_yaml(&m).into_bytes())
            }
        };
        encoded.expect("a chat is shown in every protocol")
    }

    /// ws.rs `on_frame` → `on_send`.
    fn decode_skynet(&self) -> Envelope {
        let peers = &self.skynet_sending;
        let Ok(skynet::wire::ClientFrame::Send(mut msg)) =
            skynet::wire::parse_client_frame(&self.skynet_frame)
        else {
            panic!("a send frame");
        };
        assert!(msg.oversized_attachment().is_none());
        let sender_id = CARD_IDS[0].1;
        msg.stamp(sender_id);
        // For a text with an `@`, the endpoint takes its cached member list.
        msg.enrich_mentions(sender_id, || self.candidates.clone());
        let (env, unknown) = skynet::translate::decode(msg, SENDER, peers);
        black_box(unknown);
        env
    }
}

/// ws.rs `on_frame` → `handle` → chat.rs `stage_post`, for a lobby message.
fn decode_tracker(frame: &str) -> Envelope {
    let text = frame.to_string();
    let Ok(tracker::wire::ClientFrame::ChatSend {
        chat_id,
        task_id: _,
        content,
        mentions,
        reply_to,
    }) = tracker::wire::parse_client_frame(&text)
    else {
        panic!("a chat.send frame");
    };
    let created = now_ms();
    let out = tracker::wire::MessageOut {
        id: uuid::Uuid::new_v4().to_string(),
        chat_id,
        task_id: None,
        author_type: tracker::wire::AuthorType::Agent,
        author_slug: SENDER.to_owned(),
        content: content.clone(),
        mentions,
        created_at: iso8601(created),
        reply_to: reply_to.clone(),
        attachments: Vec::new(),
    };
    tracker::translate::decode_message(&out, None, reply_to, created)
}

/// A `StreamMessages` message: decoded by tonic, handed to `stage` (as a copy, the
/// original kept to answer a refusal), checked, translated.
fn decode_synapse(frame: &[u8]) -> Envelope {
    let received = SynapseMessage::decode(frame).expect("a SynapseMessage");
    let mut msg = received.clone();
    MessageType::try_from(msg.r#type).expect("a MessageType");
    let sender = msg.sender.clone().unwrap_or_default();
    assert!(!sender.agent_id.is_empty());
    msg.sender = Some(sender);
    if msg.id.is_empty() {
        msg.id = new_message_id();
    }
    match &msg.timestamp {
        None => msg.timestamp = Some(synapse::wire::timestamp(now_ms())),
        Some(ts) => synapse::wire::check_timestamp(ts).expect("a valid timestamp"),
    }
    let env = synapse::translate::decode(&msg).expect("a relayable message");
    let receiver = msg
        .receiver
        .as_ref()
        .map(|r| r.agent_id.clone())
        .filter(|r| !r.is_empty());
    black_box((receiver, received));
    env
}

/// ws.rs `on_text` → `Grid::stage`.
fn decode_grid(frame: &str) -> Envelope {
    let text = frame.to_string();
    let docs = grid::wire::parse_documents(&text, text.trim_start().starts_with(['{', '[']))
        .expect("a YAML message");
    let Ok([doc]) = <[Value; 1]>::try_from(docs) else {
        panic!("one message");
    };
    let msg = grid::wire::validate(doc).expect("a valid message");
    grid::translate::decode(msg)
}

/// A chat from a protocol none of the four speak, as the router hands it to an endpoint.
fn foreign_chat() -> Envelope {
    let mut env = Envelope::new("elsewhere", SENDER, Kind::Chat);
    env.text = Some(TEXT.to_owned());
    env.mentions = vec![RECIPIENT.to_owned()];
    env.reply_to = Some(REPLY_TO.to_owned());
    env
}

fn decode(c: &mut Criterion) {
    let fixture = Fixture::new();
    let mut group = c.benchmark_group("decode");
    for protocol in PROTOCOLS {
        group.bench_function(protocol.name(), |b| {
            b.iter(|| fixture.decode(black_box(protocol)))
        });
    }
    group.finish();
}

fn encode(c: &mut Criterion) {
    let fixture = Fixture::new();
    let env = foreign_chat();
    let mut group = c.benchmark_group("encode");
    for protocol in PROTOCOLS {
        group.bench_function(protocol.name(), |b| {
            b.iter(|| fixture.encode(black_box(protocol), black_box(&env)))
        });
    }
    group.finish();
}

fn translate(c: &mut Criterion) {
    let fixture = Fixture::new();
    let mut group = c.benchmark_group("translate");
    for from in PROTOCOLS {
        for to in PROTOCOLS {
            if from.name() == to.name() {
                continue;
            }
            // What `to`'s client is shown must be `from`'s message, not a stand-in.
            let env = fixture.decode(from);
            assert_eq!(env.text.as_deref(), Some(TEXT), "{}", from.name());
            assert!(env.names(RECIPIENT) && env.reply_to.is_some(), "{env:?}");
            let shown = String::from_utf8_lossy(&fixture.encode(to, &env)).into_owned();
            assert!(
                shown.contains("retry fix"),
                "{} → {}: {shown}",
                from.name(),
                to.name()
            );
            let id = format!("{}→{}", from.name(), to.name());
            group.bench_function(id, |b| {
                b.iter(|| {
                    let env = fixture.decode(black_box(from));
                    fixture.encode(to, &env)
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, decode, encode, translate);
criterion_main!(benches);
