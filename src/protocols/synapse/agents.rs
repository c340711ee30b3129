//! Synapse agents: registered on first contact (or declared in bridge.toml), claimed in the
//! bridge's directory, and online while they hold a message stream.

use std::sync::Arc;

use axum::http::HeaderMap;
use tokio::sync::Notify;
use tonic::Status;

use super::db::AgentRow;
use super::proto::{AgentEndpoint, TransportMode};
use super::{OpenStreams, PROTOCOL, Synapse, translate, wire};
use crate::core::{AgentInfo, Status as Presence};

/// Metadata naming the calling agent.
pub const AGENT_HEADER: &str = "x-synapse-agent-id";
/// Metadata choosing how the calling agent is reached: `callback`, `polling`, `sync`,
/// `hybrid`.
pub const TRANSPORT_HEADER: &str = "x-synapse-transport";
pub const CALLBACK_URL_HEADER: &str = "x-synapse-callback-url";
pub const CALLBACK_TOKEN_HEADER: &str = "x-synapse-callback-token";

/// How a caller asked to be reached, from its request metadata.
#[derive(Clone, Debug, Default)]
pub struct Hints {
    pub agent_id: Option<String>,
    pub transport: Option<TransportMode>,
    pub callback_url: Option<String>,
    pub callback_token: Option<String>,
}

impl Hints {
    /// `agent_id` as given, or the caller's `x-synapse-agent-id` when it is empty.
    pub fn agent_or_caller(&self, agent_id: String) -> String {
        match &self.agent_id {
            Some(caller) if agent_id.is_empty() => caller.clone(),
            _ => agent_id,
        }
    }

    pub fn from_headers(headers: &HeaderMap) -> Result<Hints, Status> {
        let get = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_owned)
        };
        let transport = match get(TRANSPORT_HEADER) {
            None => None,
            Some(t) => Some(wire::parse_transport(&t).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "{TRANSPORT_HEADER}: '{t}' is not callback, polling, sync or hybrid"
                ))
            })?),
        };
        let callback_url = get(CALLBACK_URL_HEADER);
        if let Some(url) = &callback_url {
            check_url(url, CALLBACK_URL_HEADER)?;
        }
        Ok(Hints {
            agent_id: get(AGENT_HEADER),
            transport,
            callback_url,
            callback_token: get(CALLBACK_TOKEN_HEADER),
        })
    }
}

/// Callback URLs must be http(s) URLs.
pub fn check_url(url: &str, field: &str) -> Result<(), Status> {
    if (url.starts_with("http://") || url.starts_with("https://")) && url.len() > "http://".len() {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "{field} must be an http:// or https:// URL, not '{url}'"
        )))
    }
}

pub fn directory_entry(agent: &AgentRow) -> AgentInfo {
    let mut info = AgentInfo::new(&agent.agent_id, PROTOCOL, &agent.agent_id);
    info.agent_type = Some(agent.system_id.clone()).filter(|s| !s.is_empty());
    info.description = Some(agent.name.clone()).filter(|n| !n.is_empty());
    info.capabilities = agent.capabilities.clone();
    info.created_at = agent.created_at;
    info
}

/// `row` with what `endpoint` and the call's `hints` say of the agent (each only when
/// given); whether that changed anything.
fn update(row: &mut AgentRow, endpoint: &AgentEndpoint, hints: &Hints) -> bool {
    let mut changed = false;
    for (field, value) in [
        (&mut row.name, &endpoint.agent_name),
        (&mut row.system_id, &endpoint.system_id),
        (&mut row.endpoint, &endpoint.endpoint),
        (&mut row.version, &endpoint.version),
    ] {
        if !value.is_empty() && field != value {
            field.clone_from(value);
            changed = true;
        }
    }
    if let Some(transport) = hints.transport.map(|t| t as i32)
        && row.transport != transport
    {
        row.transport = transport;
        changed = true;
    }
    let url_in_endpoint = (endpoint.endpoint.starts_with("http://")
        || endpoint.endpoint.starts_with("https://"))
    .then_some(&endpoint.endpoint);
    if let Some(url) = hints.callback_url.as_ref().or(url_in_endpoint)
        && row.callback_url.as_ref() != Some(url)
    {
        row.callback_url = Some(url.clone());
        changed = true;
    }
    if let Some(token) = &hints.callback_token
        && row.callback_token.as_ref() != Some(token)
    {
        row.callback_token = Some(token.clone());
        changed = true;
    }
    changed
}

impl Synapse {
    /// Registers the Synapse agent `endpoint` describes, or updates what changed about it.
    /// `field` names where the endpoint came from, for errors. An agent sending again as
    /// it did before, nearly every call, is settled here without waiting: the registering
    /// is boxed, so that this future (part of every message's) stays small, as moving a
    /// future of kilobytes into each box on the way cost a tenth of the gateway's CPU.
    /// Whether a Synapse agent `id` may be registered here (or is already): refused when
    /// empty, the bridge's own, or another protocol's or another bridge's agent.
    pub fn may_register(&self, id: &str, field: &str) -> Result<(), Status> {
        if id.is_empty() {
            return Err(Status::invalid_argument(format!(
                "{field}.agent_id is required"
            )));
        }
        if id == crate::core::BRIDGE_AGENT {
            return Err(Status::already_exists(format!(
                "agent_id '{id}' is the bridge's own"
            )));
        }
        if let Some(holder) = self.core.directory.holder(id)
            && (holder.holder_protocol != PROTOCOL || holder.holder_bridge.is_some())
        {
            return Err(Status::already_exists(format!(
                "agent_id '{id}' is already taken by {} agent '{id}'{}",
                holder.holder_protocol,
                holder.on_bridge()
            )));
        }
        Ok(())
    }

    pub async fn ensure_agent(
        &self,
        endpoint: &AgentEndpoint,
        hints: &Hints,
        field: &str,
    ) -> Result<(), Status> {
        let id = endpoint.agent_id.trim();
        self.may_register(id, field)?;
        let known = self.agents.get(id).map(|a| a.clone());
        let new = known.is_none();
        let mut row = known.unwrap_or_else(|| AgentRow {
            agent_id: id.to_owned(),
            name: id.to_owned(),
            system_id: PROTOCOL.to_owned(),
            endpoint: String::new(),
            version: translate::PROTOCOL_VERSION.to_owned(),
            transport: TransportMode::Hybrid as i32,
            callback_url: None,
            callback_token: None,
            capabilities: Vec::new(),
            created_at: crate::core::now_ms(),
        });
        if !update(&mut row, endpoint, hints) && !new {
            return Ok(());
        }
        Box::pin(self.keep_agent(row, new)).await
    }

    /// Keeps an agent's new or changed `row`: a new one is registered first, and its name
    /// given up again if the row cannot be stored.
    async fn keep_agent(&self, row: AgentRow, new: bool) -> Result<(), Status> {
        let entry = directory_entry(&row);
        let name = entry.name.clone();
        if new {
            self.core
                .register(entry)
                .await
                .map_err(|taken| Status::already_exists(taken.to_string()))?;
        }
        if let Err(e) = self.db.put_agent(row.clone()).await {
            if new {
                self.core.unregister(&name, PROTOCOL);
            }
            return Err(internal(e));
        }
        self.agents.insert(row.agent_id.clone(), row);
        if new {
            // A new agent may be the one a waiting task was submitted for.
            self.assign_pending().await;
        }
        Ok(())
    }

    /// Registers the caller named by `x-synapse-agent-id`, when there is one.
    pub async fn caller(&self, hints: &Hints) -> Result<Option<String>, Status> {
        let Some(id) = &hints.agent_id else {
            return Ok(None);
        };
        let endpoint = AgentEndpoint {
            agent_id: id.clone(),
            ..Default::default()
        };
        self.ensure_agent(&endpoint, hints, AGENT_HEADER).await?;
        Ok(Some(id.clone()))
    }

    /// How an agent is reached: its mode, and its callback URL and token.
    pub fn reach(&self, agent_id: &str) -> (TransportMode, Option<String>, Option<String>) {
        match self.agents.get(agent_id) {
            Some(a) => (
                TransportMode::try_from(a.transport).unwrap_or(TransportMode::Hybrid),
                a.callback_url.clone(),
                a.callback_token.clone(),
            ),
            None => (TransportMode::Hybrid, None, None),
        }
    }

    /// Counts a stream of `agent_id` open; what wakes its streams (`inbox_kept`).
    pub async fn stream_opened(&self, agent_id: &str, session: u64) -> Arc<Notify> {
        let (first, wake) = {
            let mut open = self
                .streams
                .entry(agent_id.to_owned())
                .or_insert(OpenStreams {
                    sessions: Vec::new(),
                    wake: Arc::default(),
                });
            open.sessions.push(session);
            (open.sessions.len() == 1, open.wake.clone())
        };
        if first {
            self.core
                .announce_presence(PROTOCOL, agent_id, true, Presence::Online, None)
                .await;
        }
        wake
    }

    /// Wakes a stream of `agent_id`, if it has one open that takes its inbox: something
    /// was kept in it.
    pub fn inbox_kept(&self, agent_id: &str) {
        let Some(wake) = self.streams.get(agent_id).map(|open| open.wake.clone()) else {
            return;
        };
        if self.route_for(agent_id, true) == super::outbound::Route::Stream {
            wake.notify_one();
        }
    }

    /// Whether the agent of `session`, a `StreamMessages` stream, has another such stream
    /// that attached before it and still receives everything (`Router::older_session_receiving`):
    /// asked once `session` is detached, that one was sent every message this one was.
    pub fn older_stream_receiving(&self, session: &crate::core::Session) -> bool {
        let streams: Vec<u64> = match self.streams.get(&session.agent) {
            Some(open) => open.sessions.clone(),
            None => return false,
        };
        let router = &self.core.router;
        router.older_session_receiving(session, |id| streams.contains(&id))
    }

    pub async fn stream_closed(&self, agent_id: &str, session: u64) {
        let last = match self.streams.get_mut(agent_id) {
            Some(mut open) => {
                open.sessions.retain(|&open| open != session);
                open.sessions.is_empty()
            }
            None => false,
        };
        if last {
            self.streams
                .remove_if(agent_id, |_, open| open.sessions.is_empty());
            // Unless the name is another bridge's now (`Core::yield_name`): its presence is
            // that bridge's to tell.
            let held_here = !self.core.directory.held_elsewhere(agent_id);
            if held_here && !self.shutdown.is_cancelled() {
                self.core
                    .announce_presence(PROTOCOL, agent_id, false, Presence::Offline, None)
                    .await;
            }
        }
    }
}

/// A message the log would not take: UNAVAILABLE with the reason when it refused (the
/// client may send it again later), else an internal error.
pub fn not_stored(e: crate::core::LogError) -> Status {
    match e {
        crate::core::LogError::Refused(reason) => Status::unavailable(reason),
        other => internal(other),
    }
}

/// A change of a shared `what` (a task, a group) the fleet's records did not take.
pub fn not_recorded(what: &str, e: crate::core::RecordError) -> Status {
    match e {
        crate::core::RecordError::Conflict => Status::aborted(format!(
            "the {what} was changed by many writers at once; try again"
        )),
        crate::core::RecordError::Unavailable(why) => {
            Status::unavailable(format!("the fleet's records are unavailable: {why}"))
        }
    }
}

pub fn internal(e: impl std::fmt::Display) -> Status {
    tracing::error!(error = %e, "synapse: internal error");
    Status::internal("internal error; the request was not applied")
}
