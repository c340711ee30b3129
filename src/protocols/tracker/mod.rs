//! The Tracker endpoint: the Team Board agent protocol (WebSocket `/ws` and REST
//! `/api/v1`) on one listener, as `tracker-agent-protocol.md` describes it — including the
//! parts it marks TODO (task events, attachments, REST authentication).
//!
//! Chat crosses protocols through the router like any message. Tasks are the Tracker's own
//! state: the endpoint's `hub` session turns task messages from other protocols into
//! Tracker tasks, and `tasks.rs` turns Tracker task changes into task messages for agents
//! of other protocols. Task events (`task.created` …) are rendered from the task table and
//! fanned out to the endpoint's own connections.

mod attachments;
mod chat;
mod config;
mod db;
mod hub;
mod members;
mod records;
mod rest;
mod steps;
mod task_events;
mod tasks;
/// Tracker frames ⇄ Envelope; public for `benches/translate.rs`.
pub mod translate;
/// The Tracker's frames and resources; public for `benches/translate.rs`.
pub mod wire;
mod ws;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::{ArcSwap, ArcSwapOption};
use dashmap::DashMap;
use parking_lot::RwLock;
use tokio_util::sync::CancellationToken;

pub use config::Config;

use super::endpoint::{Endpoint, Listening, Reloader};
use super::{Context, Running, StartError};
use crate::core::{
    AgentInfo, Core, Delivery, Envelope, Interest, Kind, Mailbox, Origin, PerGeneration, Protocol,
    Role, Status, derived_uuid,
};
use crate::shared::budget::ByteBudget;
use db::{Db, MemberRow, ProjectRow, TaskRow};
use members::{Members, Transition, hash_token};
use wire::{AuthorType, ChatListen, HeartbeatStatus, MemberKind, TaskListen};

pub const PROTOCOL: Protocol = "tracker";

/// What routing decisions need about chats and tasks, shared with connection interests.
pub struct Chats {
    lobby_chat_id: String,
    projects: ArcSwap<Vec<ProjectRow>>,
    /// task id → project id, for filtering task comments by subscription.
    task_projects: DashMap<String, String>,
    /// external (other-protocol) task id → Tracker task id.
    external_tasks: DashMap<String, String>,
}

impl Chats {
    fn project_of_chat(&self, chat_id: &str) -> Option<String> {
        self.projects
            .load()
            .iter()
            .find(|p| p.chat_id == chat_id)
            .map(|p| p.id.clone())
    }

    /// The project a message's thread belongs to; `None` for the lobby.
    fn project_of_thread(&self, thread: Option<&str>) -> Option<String> {
        let thread = thread?;
        self.project_of_chat(thread)
            .or_else(|| self.task_projects.get(thread).map(|p| p.clone()))
    }

    /// The Tracker task a task id from any protocol refers to.
    fn task_id_for(&self, id: &str) -> Option<String> {
        if self.task_projects.contains_key(id) {
            return Some(id.to_owned());
        }
        self.external_tasks.get(id).map(|t| t.clone())
    }

    fn index(&self, task: &TaskRow) {
        self.task_projects
            .insert(task.id.clone(), task.project_id.clone());
        if let Some(external) = &task.external_id {
            self.external_tasks
                .insert(external.clone(), task.id.clone());
        }
    }

    fn forget(&self, task: &TaskRow) {
        self.task_projects.remove(&task.id);
        if let Some(external) = &task.external_id {
            self.external_tasks.remove(external);
        }
    }
}

/// One authenticated WebSocket connection.
pub struct Conn {
    id: u64,
    slug: String,
    mailbox: Arc<Mailbox>,
    chat_listen: ChatListen,
    task_listen: TaskListen,
    subscriptions: RwLock<HashSet<String>>,
    chats: Arc<Chats>,
}

impl Conn {
    fn subscribed(&self, project_id: &str) -> bool {
        self.subscriptions.read().contains(project_id)
    }

    /// Lobby messages reach everyone; a project's only its subscribers.
    fn sees_thread(&self, thread: Option<&str>) -> bool {
        match self.chats.project_of_thread(thread) {
            None => true,
            Some(project) => self.subscribed(&project),
        }
    }

    /// Whether a task event reaches this connection (`task_listen`, subscriptions).
    fn wants_task(&self, task: &TaskRow) -> bool {
        let involved = task.assignee_slug.as_deref() == Some(&self.slug)
            || task.reviewer_slug.as_deref() == Some(&self.slug)
            || task.watchers.contains(&self.slug);
        // As the document says: without a subscription to the task's project, no task events.
        self.subscribed(&task.project_id)
            && match self.task_listen {
                TaskListen::None => false,
                TaskListen::Assigned => involved,
                TaskListen::All => true,
            }
    }
}

/// Routing interest of a connection: chat filtered by `chat_listen` and subscriptions;
/// presence always; task messages never (the hub turns them into task events).
struct ConnInterest(Arc<Conn>);

impl Interest for ConnInterest {
    fn observes(&self, env: &Envelope) -> bool {
        let conn = &self.0;
        conn.chat_listen == ChatListen::All
            && translate::is_chat_like(env)
            && conn.sees_thread(env.thread.as_deref())
    }

    fn accepts(&self, env: &Envelope) -> bool {
        let conn = &self.0;
        if env.kind.is_presence() {
            return env.from != conn.slug;
        }
        conn.chat_listen != ChatListen::None
            && translate::is_chat_like(env)
            && conn.sees_thread(env.thread.as_deref())
    }
}

pub struct Tracker {
    core: Arc<Core>,
    config: Config,
    db: Db,
    chats: Arc<Chats>,
    /// Where tasks from other protocols are created.
    default_project: ArcSwapOption<ProjectRow>,
    members: Members,
    conns: DashMap<u64, Arc<Conn>>,
    next_conn: AtomicU64,
    /// Every agent's `@name`, for mentions in chat text.
    mention_names: PerGeneration<chat::MentionNames>,
    /// The fleet's checklists of tasks not applied here yet.
    pending_steps: steps::PendingSteps,
    /// Where task writes send their changes as they commit, to be announced in that order.
    task_events: task_events::TaskEvents,
    shutdown: CancellationToken,
    read_budget: ByteBudget,
}

impl translate::Context for Tracker {
    fn lobby_chat_id(&self) -> &str {
        &self.chats.lobby_chat_id
    }

    fn is_project_chat(&self, thread: &str) -> bool {
        self.chats.project_of_chat(thread).is_some()
    }

    fn author_type(&self, name: &str) -> AuthorType {
        match self.core.directory.role_of(name) {
            Some(Role::Human) => AuthorType::Human,
            _ => AuthorType::Agent,
        }
    }
}

impl Endpoint for Tracker {
    const NAME: &'static str = PROTOCOL;
    type Config = Config;
    type Translation = translate::Translator;
    /// A member may hold several connections, through one bridge or several.
    const ONLINE_THROUGH_SEVERAL_BRIDGES: bool = true;

    fn listeners(config: &Config) -> Vec<Listening> {
        vec![Listening {
            serves: "rest /api/v1 + websocket /ws",
            addr: config.listen,
        }]
    }

    async fn start(config: &Config, ctx: &Context) -> Result<Running, StartError> {
        start(config, ctx).await
    }

    const RELOADABLE: &'static [&'static str] = &["projects", "members", "default_project"];

    /// Projects and members declared anew (a changed token is the member's from now on);
    /// one the file no longer declares stays, as one created over REST does.
    async fn reload(self: &Arc<Self>, config: &Config) -> Result<(), String> {
        let (projects, default_project) = declare(&self.db, config).await?;
        self.chats.projects.store(Arc::new(projects));
        self.default_project.store(default_project.map(Arc::new));
        register_members(&self.db, &self.core, &self.members).await
    }
}

/// Registers every stored member in the directory and the endpoint's member list, at start
/// and at every reload: one code path. A name the directory refuses is reported, the
/// others registered.
async fn register_members(db: &Db, core: &Core, members: &Members) -> Result<(), String> {
    let mut refused = Vec::new();
    for member in db.members().await.map_err(|e| e.to_string())? {
        match core.directory.register_known(directory_entry(&member)) {
            Ok(()) => members.insert(member),
            Err(e) => refused.push(format!("member '{}': {e}", member.slug)),
        }
    }
    match refused.is_empty() {
        true => Ok(()),
        false => Err(refused.join("; ")),
    }
}

/// Makes what `[tracker]` declares real in the endpoint's tables — its projects and its
/// members, created or updated — and returns the projects and the default one. At start
/// and at every reload of the config: one code path. Everything is checked before anything
/// is written.
async fn declare(
    db: &Db,
    config: &Config,
) -> Result<(Vec<ProjectRow>, Option<ProjectRow>), String> {
    for project in &config.projects {
        check_slug("project", &project.slug)?;
    }
    for declared in &config.members {
        check_slug("member", &declared.slug)?;
    }
    if let Some(slug) = &config.default_project {
        let stored = db.projects().await.map_err(|e| e.to_string())?;
        let declared = (config.projects.iter().map(|p| &p.slug))
            .chain(stored.iter().map(|p| &p.slug))
            .any(|p| p == slug);
        if !declared {
            return Err(format!(
                "default_project '{slug}' is not a declared project"
            ));
        }
    }
    for project in &config.projects {
        db.put_project(&project.slug, &project.name, &project.description)
            .await
            .map_err(|e| e.to_string())?;
    }
    for declared in &config.members {
        let row = MemberRow {
            // The same on every bridge that declares the member (a stored one keeps its id).
            id: derived_uuid("member", &declared.slug).to_string(),
            slug: declared.slug.clone(),
            name: declared
                .name
                .clone()
                .unwrap_or_else(|| declared.slug.clone()),
            kind: declared.kind,
            token_hash: hash_token(&declared.token),
            chat_listen: declared.chat_listen,
            task_listen: declared.task_listen,
            capabilities: declared.capabilities.clone(),
            prompt: declared.prompt.clone(),
            model: declared.model.clone(),
            created_at: crate::core::now_ms(),
        };
        db.put_member(row, true).await.map_err(|e| e.to_string())?;
    }
    let projects = db.projects().await.map_err(|e| e.to_string())?;
    let default_project = match &config.default_project {
        Some(slug) => projects.iter().find(|p| &p.slug == slug).cloned(),
        None => projects.first().cloned(),
    };
    Ok((projects, default_project))
}

pub async fn start(config: &Config, ctx: &Context) -> Result<Running, StartError> {
    let (core, shutdown) = (ctx.core.clone(), ctx.shutdown.clone());
    let fail = |e: &dyn std::fmt::Display| StartError::new(PROTOCOL, e);
    let db = Db::open(ctx.store.clone()).await.map_err(|e| fail(&e))?;
    let lobby_chat_id = db.lobby_chat_id().await.map_err(|e| fail(&e))?;
    let (projects, default_project) = declare(&db, config).await.map_err(|e| fail(&e))?;
    let members = Members::default();
    register_members(&db, &core, &members)
        .await
        .map_err(|e| fail(&e))?;
    let chats = Arc::new(Chats {
        lobby_chat_id,
        projects: ArcSwap::from_pointee(projects),
        task_projects: DashMap::new(),
        external_tasks: DashMap::new(),
    });
    for task in db
        .tasks(db::TaskFilter::default())
        .await
        .map_err(|e| fail(&e))?
    {
        chats.index(&task);
    }

    let listener = super::bind(PROTOCOL, config.listen).await?;
    let addr = listener.local_addr().map_err(|e| fail(&e))?;
    let (task_events, committed) = task_events::channel();
    let tracker = Arc::new(Tracker {
        core,
        config: config.clone(),
        db,
        chats,
        default_project: ArcSwapOption::from(default_project.map(Arc::new)),
        members,
        conns: DashMap::new(),
        next_conn: AtomicU64::new(1),
        mention_names: PerGeneration::default(),
        pending_steps: steps::PendingSteps::default(),
        task_events,
        shutdown: shutdown.clone(),
        read_budget: ctx.read_budget.clone(),
    });
    let reload = Reloader::of(&tracker);
    tracker.follow_shared();
    tracker.follow_attachments();
    let hub = hub::start(tracker.clone());
    let announcer = task_events::announce(tracker.clone(), committed);
    let server = super::serve(
        PROTOCOL,
        listener,
        rest::router(tracker),
        &ctx.limits,
        ctx.doors.clone(),
        shutdown,
    );
    Ok(Running {
        name: PROTOCOL,
        listeners: vec![("rest+ws", addr)],
        tasks: vec![server, hub, announcer],
        reload,
    })
}

/// Slugs are `a-z`, `0-9` and `-`, as the protocol document says.
pub fn check_slug(what: &str, slug: &str) -> Result<(), String> {
    if !slug.is_empty()
        && slug
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        Ok(())
    } else {
        Err(format!(
            "{what} slug '{slug}' must be non-empty and use only a-z, 0-9 and -"
        ))
    }
}

fn directory_entry(member: &MemberRow) -> AgentInfo {
    let mut info = AgentInfo::new(&member.slug, PROTOCOL, &member.id);
    info.role = match member.kind {
        MemberKind::Agent => Role::Agent,
        MemberKind::Human => Role::Human,
    };
    info.agent_type = Some(member.kind.as_str().to_owned());
    info.description = Some(member.name.clone());
    info.capabilities = member.capabilities.clone();
    info.created_at = member.created_at;
    info
}

impl Tracker {
    fn next_conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// Announces a member going online or offline to every protocol.
    async fn announce(&self, slug: &str, transition: Option<Transition>) {
        let Some(transition) = transition else { return };
        // The name is another agent's now (`Core::yield_name`): its presence is not ours.
        if (self.core.directory.protocol_of(slug)).is_some_and(|p| p != PROTOCOL) {
            return;
        }
        let (online, status) = match transition {
            Transition::CameOnline => (true, Status::Online),
            Transition::WentOffline => (false, Status::Offline),
            Transition::StatusChanged(status) => {
                let status = match status {
                    HeartbeatStatus::Busy => Status::Busy,
                    HeartbeatStatus::Idle => Status::Idle,
                    HeartbeatStatus::Online => Status::Online,
                };
                self.core.announce_status(PROTOCOL, slug, status).await;
                return;
            }
        };
        let native = translate::agent_status(slug, status.as_str());
        self.core
            .announce_presence(PROTOCOL, slug, online, status, Some(native))
            .await;
    }

    /// Sends a task event (`task.created`, `task.updated`, `task.assigned`) to every
    /// connection that wants it.
    fn emit_task_event(&self, kind: &str, task: &TaskRow) {
        let frame = wire::event(kind, translate::task_out(task));
        let mut env = Envelope::new(PROTOCOL, &task.author_slug, Kind::TaskUpdate);
        env.origin = Origin::new(PROTOCOL, Some(frame));
        let delivery = Arc::new(Delivery::new(env));
        for conn in self.conns.iter() {
            if conn.wants_task(task) {
                conn.mailbox.push(delivery.clone());
            }
        }
    }

    /// Shows a message only to the Tracker's connections whose filters want it, as an
    /// observer would get it from the router.
    fn show_locally(&self, delivery: &Arc<Delivery>) {
        for conn in self.conns.iter() {
            if ConnInterest(conn.clone()).observes(&delivery.envelope) {
                conn.mailbox.push(delivery.clone());
            }
        }
    }

    /// Names of every online agent, whatever its protocol.
    fn online_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        self.core.directory.for_each(|agent| {
            if agent.online {
                names.push((agent.created_at, agent.name.clone()));
            }
        });
        names.sort();
        names.into_iter().map(|(_, n)| n).collect()
    }
}
