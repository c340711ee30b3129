//! The contract every endpoint keeps: its name and `bridge.toml` section, where it listens,
//! how it starts, and its translation between its frames and the envelope. The registry
//! (`registry.rs`) lists the endpoints; nothing else in the bridge names one.

use std::any::Any;
use std::fmt::Debug;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::core::{Core, Envelope, TaskState};
use crate::shared::budget::ByteBudget;
use crate::shared::latch::Latch;
use crate::shared::listener::SharedLimits;
use crate::store::Store;

/// A protocol's endpoint.
pub trait Endpoint: 'static {
    /// The protocol's name: its `[section]`, its metrics label, its agents' protocol in the
    /// directory.
    const NAME: &'static str;
    /// Its section of `bridge.toml`; unknown keys are refused (`deny_unknown_fields`).
    type Config: DeserializeOwned + Clone + Debug + Send + Sync + 'static;
    /// Its frames ⇄ the envelope.
    type Translation: Translation;
    /// Whether one agent of the protocol may be online through several bridges of a fleet
    /// at once. Where it may not, an agent found online through two (bridges cut off from
    /// the fleet together each let it in) is settled on one (`federation::clashes`).
    const ONLINE_THROUGH_SEVERAL_BRIDGES: bool = false;

    /// Where `config` has it listen, with what each listener serves (for `agentbridge
    /// check`).
    fn listeners(config: &Self::Config) -> Vec<Listening>;

    /// Makes the section's relative paths relative to the config file's directory.
    fn resolve_paths(_config: &mut Self::Config, _base: &Path) {}

    /// Starts serving: every listener is bound when this returns.
    fn start(
        config: &Self::Config,
        ctx: &Context,
    ) -> impl Future<Output = Result<Running, StartError>> + Send;

    /// The keys of its section that change while it runs when `bridge.toml` is read again
    /// (`reload`); a change to any other key (where it listens, say) takes a restart.
    const RELOADABLE: &'static [&'static str] = &[];

    /// Takes its section, read again, while running: what `RELOADABLE` names changes in
    /// place, with the same code that applied it at start. Its error leaves the endpoint as
    /// it was.
    fn reload(
        self: &Arc<Self>,
        _config: &Self::Config,
    ) -> impl Future<Output = Result<(), String>> + Send
    where
        Self: Sized,
    {
        async { Ok(()) }
    }
}

/// One listener an endpoint opens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listening {
    /// What it serves, e.g. "http + websocket /ws".
    pub serves: &'static str,
    pub addr: SocketAddr,
}

/// The translation between a protocol's frames and the envelope, the same shape for every
/// protocol. What the endpoint does around it — reading the frame off its transport,
/// answering a refusal in its protocol, writing the frame out — is the endpoint's.
pub trait Translation {
    /// A frame as the protocol's clients send it, read and checked for its shape.
    type Inbound<'a>;
    /// A message as the protocol's clients receive it.
    type Outbound;
    /// Why a frame cannot become a message; the endpoint answers it in its protocol.
    type Refusal;
    /// What translating needs to know of the bridge (who a native id names, a peer's
    /// card, …).
    type Context: ?Sized;

    fn decode(ctx: &Self::Context, frame: Self::Inbound<'_>) -> Result<Decoded, Self::Refusal>;

    /// The message as this protocol's clients receive it; `None` when it does not cross
    /// into this protocol.
    fn encode(ctx: &Self::Context, env: &Envelope) -> Option<Self::Outbound>;

    /// A canonical task state as this protocol shows it, and the state read back from that.
    fn task_state(state: TaskState) -> (String, Option<TaskState>);

    /// The frames a peer of this protocol receives for `env`, as JSON: what the
    /// translation contract (docs/translation.md) is generated from.
    fn preview(env: &Envelope) -> Vec<PreviewFrame>;
}

/// A decoded frame: the message, and what of it could not be resolved (the ids it names
/// that no agent holds), for the endpoint to tell the sender.
#[derive(Debug)]
pub struct Decoded {
    pub envelope: Envelope,
    pub unresolved: Vec<String>,
}

impl From<Envelope> for Decoded {
    fn from(envelope: Envelope) -> Self {
        Decoded {
            envelope,
            unresolved: Vec::new(),
        }
    }
}

/// One frame a peer receives for an envelope: what it is called, and its JSON.
pub struct PreviewFrame {
    pub label: String,
    pub body: Value,
}

/// What every endpoint starts with: the core it talks to, the store for its own tables,
/// the shutdown every listener and session watches, and the bridge-wide limits its clients
/// are held to.
#[derive(Clone)]
pub struct Context {
    pub core: Arc<Core>,
    /// For the endpoint's own tables (the core reaches messages through `core.log`).
    pub store: Store,
    pub shutdown: CancellationToken,
    pub limits: SharedLimits,
    /// Shared by every WebSocket of every endpoint (`Limits::read_budget_bytes`).
    pub read_budget: ByteBudget,
    /// Open once the bridge may let clients in (`shared::latch`): every listener of an
    /// endpoint waits for them.
    pub doors: Latch,
}

/// An endpoint that is up: where it listens, the task serving it, and how a reload of the
/// config reaches it.
pub struct Running {
    pub name: &'static str,
    pub listeners: Vec<(&'static str, SocketAddr)>,
    pub tasks: Vec<JoinHandle<()>>,
    pub reload: Reloader,
}

type ReloadFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;
type ReloadFn = dyn Fn(&dyn Section) -> ReloadFuture + Send + Sync;

/// A running endpoint as a reload of the config reaches it, whichever endpoint it is.
pub struct Reloader(Box<ReloadFn>);

impl Reloader {
    /// Reaches `endpoint` (`Endpoint::reload`).
    pub fn of<E: Endpoint + Send + Sync>(endpoint: &Arc<E>) -> Reloader {
        let endpoint = endpoint.clone();
        Reloader(Box::new(move |section| {
            let config = section.as_any().downcast_ref::<E::Config>().cloned();
            let endpoint = endpoint.clone();
            Box::pin(async move {
                match config {
                    Some(config) => E::reload(&endpoint, &config).await,
                    None => Err(format!("{}: not this endpoint's section", E::NAME)),
                }
            })
        }))
    }

    pub fn reload(&self, section: &dyn Section) -> ReloadFuture {
        (self.0)(section)
    }
}

/// An endpoint could not start; the message names the cause.
#[derive(Debug, thiserror::Error)]
#[error("{endpoint}: {message}")]
pub struct StartError {
    pub endpoint: &'static str,
    pub message: String,
}

impl StartError {
    pub fn new(endpoint: &'static str, message: impl std::fmt::Display) -> Self {
        StartError {
            endpoint,
            message: message.to_string(),
        }
    }
}

/// An endpoint's section as `Config` holds it, whichever endpoint it is.
pub trait Section: Debug + Send + Sync {
    fn protocol(&self) -> &'static str;
    fn listeners(&self) -> Vec<Listening>;
    fn resolve_paths(&mut self, base: &Path);
    fn start<'a>(
        &'a self,
        ctx: &'a Context,
    ) -> Pin<Box<dyn Future<Output = Result<Running, StartError>> + Send + 'a>>;
    /// The section as its endpoint's `Config` type (`Config::endpoint`).
    fn as_any(&self) -> &dyn Any;
    /// Its keys that change while the endpoint runs (`Endpoint::RELOADABLE`).
    fn reloadable(&self) -> &'static [&'static str];
}

/// The section of endpoint `E`.
pub struct Configured<E: Endpoint>(pub E::Config);

impl<E: Endpoint> Debug for Configured<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple(E::NAME).field(&self.0).finish()
    }
}

impl<E: Endpoint> Section for Configured<E> {
    fn protocol(&self) -> &'static str {
        E::NAME
    }

    fn listeners(&self) -> Vec<Listening> {
        E::listeners(&self.0)
    }

    fn resolve_paths(&mut self, base: &Path) {
        E::resolve_paths(&mut self.0, base);
    }

    fn start<'a>(
        &'a self,
        ctx: &'a Context,
    ) -> Pin<Box<dyn Future<Output = Result<Running, StartError>> + Send + 'a>> {
        Box::pin(E::start(&self.0, ctx))
    }

    fn as_any(&self) -> &dyn Any {
        &self.0
    }

    fn reloadable(&self) -> &'static [&'static str] {
        E::RELOADABLE
    }
}

/// A protocol's translation seen from the contract document: its name, previews and task
/// states, whatever its frame types.
pub trait Described: Send + Sync {
    fn protocol(&self) -> &'static str;
    fn preview(&self, env: &Envelope) -> Vec<PreviewFrame>;
    fn task_state(&self, state: TaskState) -> (String, Option<TaskState>);
}

/// Endpoint `E`'s translation as a `Described`.
pub struct DescribedBy<E>(pub std::marker::PhantomData<fn() -> E>);

impl<E: Endpoint> Described for DescribedBy<E> {
    fn protocol(&self) -> &'static str {
        E::NAME
    }

    fn preview(&self, env: &Envelope) -> Vec<PreviewFrame> {
        E::Translation::preview(env)
    }

    fn task_state(&self, state: TaskState) -> (String, Option<TaskState>) {
        E::Translation::task_state(state)
    }
}
