//! What the console and `agentbridge trace` read: the agents the bridge knows, the most
//! recent messages, and a message's whole conversation — from the directory and the
//! message log, the same data the bridge routes from. Rates come from `/metrics`.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::core::{Audience, Core, Envelope, MessageQuery, StoredMessage, uuid_form};
use crate::shared::clock::iso8601;

/// The longest text a message summary shows.
const TEXT_CHARS: usize = 200;
/// The most recent messages one request may ask for.
const MOST_RECENT: usize = 500;
/// The most messages of one conversation a trace shows (its newest).
const CONVERSATION: usize = 5_000;

/// What the API reads from.
#[derive(Clone)]
pub struct Sources {
    pub core: Arc<Core>,
    /// This bridge's name in its fleet, when it is in one.
    pub bridge_id: Option<String>,
}

/// A message as the console and `trace` show it.
#[derive(Debug, Serialize, Deserialize)]
pub struct Summary {
    pub seq: i64,
    /// Its id in its sender's protocol.
    pub id: String,
    /// Its id as a UUID, as protocols whose ids must be UUIDs show it.
    pub uuid: String,
    pub ts: i64,
    pub time: String,
    /// The protocol its sender spoke.
    pub protocol: String,
    pub from: String,
    pub to: Vec<String>,
    pub audience: String,
    pub group: Option<String>,
    pub kind: String,
    pub reply_to: Option<String>,
    pub correlation_id: Option<String>,
    pub thread: Option<String>,
    pub task_id: Option<String>,
    pub text: Option<String>,
}

impl Summary {
    pub fn of(stored: &StoredMessage) -> Summary {
        let env: &Envelope = &stored.envelope;
        let (audience, group) = match &env.audience {
            Audience::Addressed => ("addressed", None),
            Audience::Private => ("private", None),
            Audience::Everyone => ("everyone", None),
            Audience::Group(group) => ("group", Some(group.clone())),
        };
        let mut to = env.to.clone();
        for mention in &env.mentions {
            if !to.contains(mention) {
                to.push(mention.clone());
            }
        }
        Summary {
            seq: stored.seq,
            id: env.id.clone(),
            uuid: uuid_form(&env.id),
            ts: env.timestamp,
            time: iso8601(env.timestamp),
            protocol: env.origin.protocol.to_string(),
            from: env.from.clone(),
            to,
            audience: audience.to_owned(),
            group,
            kind: env.kind.as_str().to_owned(),
            reply_to: env.reply_to.clone(),
            correlation_id: env.correlation_id.clone(),
            thread: env.thread.clone(),
            task_id: env.task.as_ref().map(|t| t.id.clone()),
            text: (env.text.as_deref()).map(|t| t.chars().take(TEXT_CHARS).collect()),
        }
    }
}

/// A conversation, as `trace` asks for it.
#[derive(Debug, Serialize, Deserialize)]
pub struct Trace {
    /// The id as it was asked for.
    pub query: String,
    /// The message's own id (the id asked for may be a UUID derived from it).
    pub id: String,
    /// The id of the conversation's first message.
    pub correlation_id: String,
    /// Every message of the conversation, oldest first.
    pub messages: Vec<Summary>,
}

fn failed(e: impl std::fmt::Display) -> Response {
    let answer = json!({ "error": format!("the message log could not be read: {e}") });
    (StatusCode::INTERNAL_SERVER_ERROR, Json(answer)).into_response()
}

/// `GET /admin/api/agents`: every agent the bridge knows, with its presence and bridge.
pub async fn agents(State(sources): State<Sources>) -> Response {
    let mut agents = Vec::new();
    sources.core.directory.for_each(|a| {
        if a.listed {
            agents.push(json!({
                "name": a.name,
                "protocol": a.protocol,
                "role": match a.role { crate::core::Role::Human => "human", crate::core::Role::Agent => "agent" },
                "online": a.online,
                "status": if a.online { a.status.as_str() } else { "offline" },
                "bridge": a.bridge,
                "native_id": a.native_id,
            }));
        }
    });
    agents.sort_by(|a, b| {
        (a["protocol"].as_str(), a["name"].as_str())
            .cmp(&(b["protocol"].as_str(), b["name"].as_str()))
    });
    Json(json!({ "bridge_id": sources.bridge_id, "agents": agents })).into_response()
}

#[derive(Deserialize)]
pub struct Recent {
    limit: Option<usize>,
    /// Only messages newer than this (ms), for a view that follows.
    after: Option<i64>,
}

/// `GET /admin/api/messages?limit=N`: the most recent messages, oldest first.
pub async fn messages(State(sources): State<Sources>, Query(recent): Query<Recent>) -> Response {
    let query = MessageQuery {
        after: recent.after,
        limit: recent.limit.unwrap_or(50).clamp(1, MOST_RECENT),
        ..Default::default()
    };
    match sources.core.log.read(query).await {
        Ok(found) => {
            let messages: Vec<Summary> = found.iter().map(Summary::of).collect();
            Json(json!({ "messages": messages })).into_response()
        }
        Err(e) => failed(e),
    }
}

#[derive(Deserialize)]
pub struct Traced {
    id: String,
}

/// `GET /admin/api/trace?id=ID`: the conversation message `ID` belongs to — `ID` in any
/// protocol's form (a UUID derived from it resolves to it), or a conversation's id.
pub async fn trace(State(sources): State<Sources>, Query(traced): Query<Traced>) -> Response {
    let core = &sources.core;
    let id = core.original_id(traced.id.trim()).await;
    let found = match core.log.get(&id).await {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let Some(found) = found else {
        let answer = json!({ "error": format!("no message has id {}", traced.id) });
        return (StatusCode::NOT_FOUND, Json(answer)).into_response();
    };
    let root = (found.envelope.correlation_id.clone()).unwrap_or_else(|| found.envelope.id.clone());
    let query = MessageQuery {
        conversation: Some(root.clone()),
        limit: CONVERSATION,
        ..Default::default()
    };
    let mut messages = match core.log.read(query).await {
        Ok(messages) => messages,
        Err(e) => return failed(e),
    };
    // A conversation is known by its first message; one whose first message this bridge
    // does not keep still shows the message asked for.
    if !messages.iter().any(|m| m.envelope.id == found.envelope.id) {
        messages.push(found);
        messages.sort_by_key(|m| (m.envelope.timestamp, m.seq));
    }
    Json(Trace {
        query: traced.id,
        id,
        correlation_id: root,
        messages: messages.iter().map(Summary::of).collect(),
    })
    .into_response()
}
