//! `GET /members`, `GET /members/{slug}`, `POST /members` (the token is shown once).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::Response;
use serde_json::Value;

use super::{ApiError, ApiResult, Body, Caller, Shared, created, ok};
use crate::core::{AgentInfo, RecordError, Role, derived_uuid};
use crate::protocols::tracker::db::MemberRow;
use crate::protocols::tracker::members::{hash_token, new_token};
use crate::protocols::tracker::tasks::WriteError;
use crate::protocols::tracker::wire::{ChatListen, MemberKind, MemberOut, TaskListen};
use crate::protocols::tracker::{PROTOCOL, Tracker, check_slug, directory_entry};
use crate::shared::clock::iso8601;
use crate::store::StoreError;

impl Tracker {
    /// A member as `/members` shows it: online while it has a connection here or, in a
    /// fleet, through another bridge (whose presence the directory has).
    fn member_out(&self, m: &MemberRow) -> MemberOut {
        let agent = self.core.directory.get(&m.slug);
        let online_here = self.members.is_online(&m.slug);
        let online_elsewhere = (agent.as_ref())
            .filter(|a| !online_here && a.is_online_elsewhere() && a.protocol == PROTOCOL);
        let (status, is_online) = match online_elsewhere {
            Some(a) => (a.status.as_str(), true),
            None => (self.members.status(&m.slug), online_here),
        };
        MemberOut {
            id: m.id.clone(),
            slug: m.slug.clone(),
            name: m.name.clone(),
            kind: m.kind,
            capabilities: m.capabilities.clone(),
            chat_listen: m.chat_listen,
            task_listen: m.task_listen,
            prompt: m.prompt.clone(),
            model: m.model.clone(),
            status: status.to_owned(),
            is_online,
            protocol: PROTOCOL.to_owned(),
            bridge: (agent.as_ref())
                .and_then(|a| self.core.directory.holding_bridge(a).map(str::to_owned)),
            created_at: iso8601(m.created_at),
        }
    }

    /// An agent of another protocol, shown as a member.
    fn peer_out(&self, a: &AgentInfo) -> MemberOut {
        MemberOut {
            id: derived_uuid("agent", &a.name).to_string(),
            slug: a.name.clone(),
            name: a.description.clone().unwrap_or_else(|| a.name.clone()),
            kind: match a.role {
                Role::Human => MemberKind::Human,
                Role::Agent => MemberKind::Agent,
            },
            capabilities: a.capabilities.clone(),
            chat_listen: ChatListen::Mentions,
            task_listen: TaskListen::Assigned,
            prompt: None,
            model: None,
            status: if a.online {
                a.status.as_str()
            } else {
                "offline"
            }
            .to_owned(),
            is_online: a.online,
            protocol: a.protocol.to_owned(),
            bridge: self.core.directory.holding_bridge(a).map(str::to_owned),
            created_at: iso8601(a.created_at),
        }
    }
}

pub async fn list(State(tracker): Shared, _caller: Caller) -> Response {
    let mut all: Vec<MemberOut> = tracker
        .members
        .list()
        .iter()
        .map(|m| tracker.member_out(m))
        .collect();
    for agent in tracker.core.directory.list() {
        if agent.protocol != PROTOCOL {
            all.push(tracker.peer_out(&agent));
        }
    }
    ok(all)
}

pub async fn get(
    State(tracker): Shared,
    _caller: Caller,
    Path(slug): Path<String>,
) -> ApiResult<Response> {
    if let Some(member) = tracker.members.get(&slug) {
        return Ok(ok(tracker.member_out(&member)));
    }
    match tracker.core.directory.get(&slug) {
        Some(agent) => Ok(ok(tracker.peer_out(&agent))),
        None => Err(ApiError::not_found("Member not found")),
    }
}

/// Creating a member mints a token: only a human member (an admin) may.
pub async fn create(State(tracker): Shared, caller: Caller, body: Bytes) -> ApiResult<Response> {
    if caller.0.kind != MemberKind::Human {
        return Err(ApiError::forbidden(format!(
            "member '{}' is an agent; only a human member may create members",
            caller.0.slug
        )));
    }
    let body = Body::parse(&body)?;
    let slug = body.required("slug")?;
    check_slug("member", &slug)
        .map_err(|e| ApiError::field(&["body", "slug"], "string_pattern_mismatch", e))?;
    let kind_key = if body.has("type") { "type" } else { "kind" };
    let member = MemberRow {
        id: uuid::Uuid::new_v4().to_string(),
        name: body
            .string("name")?
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| slug.clone()),
        kind: body
            .choice(kind_key, MemberKind::parse, MemberKind::ALL)?
            .unwrap_or_default(),
        token_hash: String::new(),
        chat_listen: body
            .choice("chat_listen", ChatListen::parse, ChatListen::ALL)?
            .unwrap_or_default(),
        task_listen: body
            .choice("task_listen", TaskListen::parse, TaskListen::ALL)?
            .unwrap_or_default(),
        capabilities: body.strings("capabilities")?.unwrap_or_default(),
        prompt: body.string("prompt")?,
        model: body.string("model")?,
        created_at: crate::core::now_ms(),
        slug,
    };
    let token = new_token();
    let member = MemberRow {
        token_hash: hash_token(&token),
        ..member
    };
    tracker
        .core
        .register_for_fleet(directory_entry(&member))
        .await
        .map_err(|taken| ApiError::conflict(taken.to_string()))?;
    // Claimed, the member is created to the end even if its client goes: dropped before
    // its record is written or refused, it would leave the name claimed with no member.
    let keeping = tracker.clone();
    let stored = tracker
        .core
        .to_the_end
        .run(async move { keep(&keeping, member).await });
    let stored = stored.await;
    let stored = stored.unwrap_or_else(|| Err(ApiError::store(StoreError::Closed)))?;
    let mut out = serde_json::to_value(tracker.member_out(&stored)).unwrap_or_default();
    out["token"] = Value::String(token);
    Ok(created(out))
}

/// Keeps `member`, whose name is claimed: in the fleet's records when there is a fleet,
/// else here. The name is given up if the member is not kept; but once the fleet's record
/// is written, the member is the fleet's (its watch keeps it here too), and so is its name.
async fn keep(tracker: &Tracker, member: MemberRow) -> Result<MemberRow, ApiError> {
    let (stored, recorded) = match tracker.core.records() {
        Some(records) => {
            let created = (tracker.create_shared_member(records.as_ref(), member.clone())).await;
            let recorded = matches!(created, Ok(_) | Err(WriteError::Store(_)));
            let created = created.map_err(|e| match e {
                WriteError::Fleet(RecordError::Conflict) => {
                    ApiError::conflict(format!("member '{}' exists", member.slug))
                }
                e => ApiError::from(e),
            });
            (created, recorded)
        }
        None => {
            let put = (tracker.db.put_member(member.clone(), false)).await;
            let put = put.inspect(|stored| tracker.members.insert(stored.clone()));
            (put.map_err(ApiError::store), false)
        }
    };
    if stored.is_err() && !recorded {
        tracker.core.unregister(&member.slug, PROTOCOL);
    }
    stored
}
