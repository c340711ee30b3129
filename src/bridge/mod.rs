//! Assembles a running bridge from a `Config`: store, core, admin listener, endpoints; and
//! takes it down again. Shutdown is one broadcast (a `CancellationToken`) that every
//! listener and session watches; the store is closed last, after queued writes commit. A
//! reload of the config (`reload.rs`) goes through the same validation as start-up.

mod reload;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use reload::LogLevelHook;

use crate::admin::{self, Readiness, ReloadReport, Token};
use crate::config::Config;
use crate::core::{Core, MessageLog};
use crate::federation::Federation;
use crate::protocols::{self, StartError};
use crate::shared::budget::ByteBudget;
use crate::shared::latch::Latch;
use crate::shared::listener::SharedLimits;
use crate::store::{RedeliveringLog, Store};
use crate::telemetry;

/// How long a stop waits for the writes whose clients went away (`Core::to_the_end`).
const FINISH_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

pub struct Bridge {
    core: Arc<Core>,
    store: Store,
    /// The log that keeps what is not yet delivered (`store::redelivery`), with the store on
    /// disk.
    redelivery: Option<Arc<RedeliveringLog>>,
    read_budget: ByteBudget,
    admin: Option<SocketAddr>,
    readiness: Readiness,
    listeners: Vec<(&'static str, &'static str, SocketAddr)>,
    tasks: Vec<JoinHandle<()>>,
    shutdown: CancellationToken,
    live: Arc<reload::Live>,
}

/// What a bridge is started with besides its config.
#[derive(Default)]
pub struct Options {
    /// The file the config was read from, read again on a reload.
    pub config_path: Option<PathBuf>,
    /// Sets the log filter when `[bridge] log_level` is reloaded.
    pub log_level: Option<LogLevelHook>,
}

impl Bridge {
    /// Starts everything the config asks for. Every listener is bound when this returns.
    pub async fn start(config: Config) -> Result<Bridge, StartError> {
        Bridge::start_with(config, Options::default()).await
    }

    /// Starts `config`, read from `path`, which a reload reads again.
    pub async fn start_from(
        path: &std::path::Path,
        options: Options,
    ) -> Result<Bridge, StartError> {
        let config = Config::load(path).map_err(|e| StartError::new("config", e))?;
        let options = Options {
            config_path: Some(path.to_owned()),
            ..options
        };
        Bridge::start_with(config, options).await
    }

    /// As `start`, with `options`.
    pub async fn start_with(config: Config, options: Options) -> Result<Bridge, StartError> {
        let metrics = telemetry::install();
        let store = Store::open(&config.bridge.data_dir)
            .await
            .map_err(|e| StartError::new("store", e))?;
        let shutdown = CancellationToken::new();
        let readiness = Readiness::default();
        let data_dir = (config.bridge.data_dir != crate::store::IN_MEMORY)
            .then(|| std::path::Path::new(&config.bridge.data_dir));
        // With its store on disk, a bridge keeps which messages it has not done with
        // (`store::redelivery`): alone, it routes them again as it starts; in a fleet, it
        // reads its stream again and leaves out what its last run had done with.
        let (redelivery, left_undelivered) = match (&config.federation, data_dir) {
            (None, Some(_)) => {
                let opened = RedeliveringLog::open(store.clone()).await;
                (Some(opened.map_err(|e| StartError::new("store", e))?), None)
            }
            (Some(_), Some(_)) => {
                let opened = RedeliveringLog::open_in_fleet(store.clone()).await;
                let (log, left) = opened.map_err(|e| StartError::new("store", e))?;
                (Some(log), Some(left))
            }
            (_, None) => (None, None),
        };
        let local: Arc<dyn MessageLog> = match &redelivery {
            Some(redelivery) => redelivery.clone(),
            None => Arc::new(store.clone()),
        };
        let federation = match &config.federation {
            Some(section) => Some(
                Federation::connect(
                    section,
                    local.clone(),
                    left_undelivered.unwrap_or_default(),
                    data_dir,
                    readiness.clone(),
                )
                .await
                .map_err(|e| StartError::new("federation", e))?,
            ),
            None => None,
        };
        let log = match &federation {
            Some(federation) => federation.log(),
            None => local,
        };
        if let (Some(federation), Some(redelivery)) = (&federation, &redelivery) {
            redelivery.keep_unwritten_from(federation.kept_by_store());
        }
        let core = Core::new(log, Arc::new(store.clone()), &config.routing);
        let bridge_id = (config.federation.as_ref()).map(|f| f.bridge_id.clone());
        let mut tasks = Vec::new();
        if let Some(federation) = federation {
            tasks.extend(federation.start(core.clone(), shutdown.clone()));
        }
        let mut listeners = Vec::new();
        let limits = SharedLimits::new(config.limits.clone());
        let live = Arc::new(reload::Live {
            path: options.config_path,
            running: Mutex::new(config.source.0.clone()),
            core: core.clone(),
            token: Token::new(config.admin.as_ref().and_then(|a| a.token.clone())),
            admin_on_loopback: (config.admin.as_ref()).is_none_or(|a| a.listen.ip().is_loopback()),
            limits: limits.clone(),
            log_level: options.log_level,
            endpoints: OnceLock::new(),
            reloading: tokio::sync::Mutex::new(()),
        });

        let admin = match &config.admin {
            Some(section) => {
                let listener = protocols::bind("admin", section.listen).await?;
                let addr = listener
                    .local_addr()
                    .map_err(|e| StartError::new("admin", e))?;
                let admin = admin::Admin {
                    metrics,
                    readiness: readiness.clone(),
                    token: live.token.clone(),
                    sources: admin::Sources {
                        core: core.clone(),
                        bridge_id,
                    },
                    reload: live.clone(),
                };
                tasks.push(protocols::serve(
                    "admin",
                    listener,
                    admin::router(admin),
                    &limits,
                    Latch::always_open(),
                    shutdown.clone(),
                ));
                listeners.push(("admin", "http", addr));
                Some(addr)
            }
            None => None,
        };

        let context = protocols::Context {
            core: core.clone(),
            store: store.clone(),
            shutdown: shutdown.clone(),
            limits,
            read_budget: ByteBudget::new(config.limits.read_budget_bytes),
            doors: readiness.doors(),
        };
        let read_budget = context.read_budget.clone();
        let started = async {
            let mut running = Vec::new();
            for section in &config.endpoints {
                running.push(section.start(&context).await?);
            }
            Ok::<_, StartError>(running)
        };
        let endpoints = match started.await {
            Ok(endpoints) => endpoints,
            Err(e) => {
                shutdown.cancel();
                for task in tasks {
                    let _ = task.await;
                }
                store.close().await;
                return Err(e);
            }
        };
        let mut reloaders = Vec::new();
        for endpoint in endpoints {
            telemetry::endpoint_started(endpoint.name);
            for (role, addr) in endpoint.listeners {
                listeners.push((endpoint.name, role, addr));
            }
            tasks.extend(endpoint.tasks);
            reloaders.push((endpoint.name, endpoint.reload));
        }
        if let Some(redelivery) = &redelivery {
            // Once every endpoint is up: the mail of agents away has somewhere to go.
            if config.federation.is_none() {
                let routed = redelivery.route_undelivered(&core).await;
                if routed > 0 {
                    tracing::info!(routed, "routed again what the last run had not delivered");
                }
            }
            tasks.push(redelivery.keep_pending(shutdown.clone()));
        }
        // A bridge alone has routed again what its last run left: clients may come in. A
        // fleet's opens its doors once it has read its stream again (`federation`).
        if config.federation.is_none() {
            readiness.open_doors();
        }
        let protocols: Vec<&'static str> = reloaders.iter().map(|(name, _)| *name).collect();
        telemetry::bridge_started(&protocols, config.federation.is_some());
        let _ = live.endpoints.set(reloaders);
        for (endpoint, role, addr) in &listeners {
            tracing::info!(endpoint = %endpoint, role = %role, addr = %addr, "listening");
        }
        readiness.set_ready();
        tracing::info!("ready");
        Ok(Bridge {
            core,
            store,
            redelivery,
            read_budget,
            admin,
            readiness,
            listeners,
            tasks,
            shutdown,
            live,
        })
    }

    /// Reads the config file again and applies what can change while running
    /// (`reload.rs`); what it did.
    pub async fn reload(&self) -> ReloadReport {
        self.live.reload().await
    }

    /// The first address `endpoint` listens on.
    pub fn addr(&self, endpoint: &str) -> Option<SocketAddr> {
        self.listeners
            .iter()
            .find(|(name, _, _)| *name == endpoint)
            .map(|(_, _, addr)| *addr)
    }

    /// Every listener, as (endpoint, role, address).
    pub fn listeners(&self) -> &[(&'static str, &'static str, SocketAddr)] {
        &self.listeners
    }

    /// Whether the bridge is ready, and why it is degraded if it is.
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin
    }

    pub fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// The bridge-wide budget large inbound WebSocket messages take from.
    pub fn read_budget(&self) -> &ByteBudget {
        &self.read_budget
    }

    /// Stops listening, closes every connection, keeps what was not delivered to route it
    /// again at the next start, and closes the store once its queued writes are committed.
    pub async fn shutdown(self) {
        if let Some(redelivery) = &self.redelivery {
            redelivery.stopping();
        }
        self.shutdown.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        // Writes whose clients went away, made to their end before the store closes.
        if !self.core.to_the_end.finish(FINISH_WITHIN).await {
            tracing::warn!(within = ?FINISH_WITHIN, "stopping before every write whose client went away was made to its end");
        }
        if let Some(redelivery) = &self.redelivery {
            redelivery.stopped().await;
        }
        self.store.close().await;
    }

    /// Runs until SIGINT or SIGTERM, then shuts down; reloads the config on SIGHUP.
    pub async fn run_until(self, mut signals: Signals) {
        loop {
            tokio::select! {
                _ = signals.interrupt.recv() => break,
                _ = signals.term.recv() => break,
                _ = signals.hangup.recv() => {
                    tracing::info!("SIGHUP: reading the config again");
                    self.reload().await;
                }
            }
        }
        tracing::info!("shutting down");
        self.shutdown().await;
    }
}

/// The process signals a running bridge answers. Installed before the bridge starts: a
/// SIGHUP or SIGTERM sent as soon as it says "ready" must not meet the default action,
/// which ends the process.
pub struct Signals {
    interrupt: Signal,
    term: Signal,
    hangup: Signal,
}

impl Signals {
    /// Takes over SIGINT, SIGTERM and SIGHUP (within a tokio runtime).
    pub fn install() -> std::io::Result<Signals> {
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }
}
