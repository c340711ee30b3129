//! Assembles a running bridge from a `Config`: store, core, admin listener, endpoints; and
//! takes it down again. Shutdown is one broadcast (a `CancellationToken`) that every
//! listener and session watches; the store is closed last, after queued writes commit.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admin::{self, Readiness};
use crate::config::Config;
use crate::core::{Core, MessageLog};
use crate::federation::Federation;
use crate::protocols::{self, StartError};
use crate::shared::budget::ByteBudget;
use crate::store::Store;
use crate::telemetry;

pub struct Bridge {
    core: Arc<Core>,
    store: Store,
    read_budget: ByteBudget,
    admin: Option<SocketAddr>,
    readiness: Readiness,
    listeners: Vec<(&'static str, &'static str, SocketAddr)>,
    tasks: Vec<JoinHandle<()>>,
    shutdown: CancellationToken,
}

impl Bridge {
    /// Starts everything the config asks for. Every listener is bound when this returns.
    pub async fn start(config: Config) -> Result<Bridge, StartError> {
        let metrics = telemetry::install();
        let store = Store::open(&config.bridge.data_dir)
            .await
            .map_err(|e| StartError::new("store", e))?;
        let shutdown = CancellationToken::new();
        let readiness = Readiness::default();
        let local: Arc<dyn MessageLog> = Arc::new(store.clone());
        let federation = match &config.federation {
            Some(section) => Some(
                Federation::connect(section, local.clone(), readiness.clone())
                    .await
                    .map_err(|e| StartError::new("federation", e))?,
            ),
            None => None,
        };
        let log = federation.as_ref().map_or(local, Federation::log);
        let core = Core::new(log, &config.routing);
        let mut tasks = Vec::new();
        if let Some(federation) = federation {
            tasks.extend(federation.start(core.clone(), shutdown.clone()));
        }
        let mut listeners = Vec::new();

        let admin = match &config.admin {
            Some(section) => {
                let listener = protocols::bind("admin", section.listen).await?;
                let addr = listener
                    .local_addr()
                    .map_err(|e| StartError::new("admin", e))?;
                tasks.push(protocols::serve(
                    "admin",
                    listener,
                    admin::router(metrics, readiness.clone()),
                    &config.limits,
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
            limits: config.limits.clone(),
            read_budget: ByteBudget::new(config.limits.read_budget_bytes),
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
        for endpoint in endpoints {
            telemetry::endpoint_started(endpoint.name);
            for (role, addr) in endpoint.listeners {
                listeners.push((endpoint.name, role, addr));
            }
            tasks.extend(endpoint.tasks);
        }
        for (endpoint, role, addr) in &listeners {
            tracing::info!(endpoint = %endpoint, role = %role, addr = %addr, "listening");
        }
        readiness.set_ready();
        tracing::info!("ready");
        Ok(Bridge {
            core,
            store,
            read_budget,
            admin,
            readiness,
            listeners,
            tasks,
            shutdown,
        })
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

    /// Stops listening, closes every connection, and closes the store once its queued
    /// writes are committed.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        self.store.close().await;
    }

    /// Runs until SIGINT or SIGTERM, then shuts down.
    pub async fn run_until_signal(self) {
        wait_for_signal().await;
        tracing::info!("shutting down");
        self.shutdown().await;
    }
}

async fn wait_for_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
