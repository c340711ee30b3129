//! The operations listener: `/metrics` (Prometheus text), `/healthz` and `/readyz` for
//! anyone; for operators (`[admin] token`, `auth.rs`), the console at `/`, the API it and
//! `agentbridge trace` read (`api.rs`), and `POST /admin/reload`.

mod api;
mod auth;

use std::pin::Pin;
use std::sync::Arc;

use arc_swap::ArcSwapOption;

use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;

pub use api::{Sources, Summary, Trace};
pub use auth::Token;

use crate::shared::latch::Latch;

/// Whether every configured endpoint is listening, and why the bridge is degraded when
/// it serves with a part missing (federation without NATS).
#[derive(Clone, Default)]
pub struct Readiness(Arc<ReadinessState>);

#[derive(Default)]
struct ReadinessState {
    /// Open once every configured endpoint listens.
    listening: Latch,
    degraded: ArcSwapOption<String>,
    /// Open once the endpoints let clients in.
    doors: Latch,
    /// One report at a time: each reads the state after its own change, so the last to set
    /// the gauge has seen every change before it.
    reporting: parking_lot::Mutex<()>,
}

impl Readiness {
    pub fn set_ready(&self) {
        self.0.listening.open();
        self.report();
    }

    /// The `agentbridge_ready` gauge, as `/readyz` answers: 1 when ready and not degraded.
    fn report(&self) {
        let _one = self.0.reporting.lock();
        crate::telemetry::ready(self.serving() && self.degraded().is_none());
    }

    /// Whether every endpoint listens and lets clients in.
    fn serving(&self) -> bool {
        self.is_ready() && self.0.doors.is_open()
    }

    pub fn is_ready(&self) -> bool {
        self.0.listening.is_open()
    }

    /// Ends once every endpoint is listening (and its mail kept for absent agents has
    /// somewhere to go).
    pub async fn listening(&self) {
        self.0.listening.opened().await
    }

    /// Says why the bridge is degraded, or (`None`) that it no longer is.
    pub fn set_degraded(&self, reason: Option<String>) {
        self.0.degraded.store(reason.map(Arc::new));
        self.report();
    }

    pub fn degraded(&self) -> Option<Arc<String>> {
        self.0.degraded.load_full()
    }

    /// The doors of the bridge's endpoints (`shared::latch`), closed until it may let
    /// clients in (`open_doors`).
    pub fn doors(&self) -> Latch {
        self.0.doors.clone()
    }

    /// Lets clients in to every endpoint, from now on.
    pub fn open_doors(&self) {
        self.0.doors.open();
        self.report();
    }
}

/// What the operations listener serves from.
pub struct Admin {
    pub metrics: PrometheusHandle,
    pub readiness: Readiness,
    pub token: Token,
    pub sources: Sources,
    /// Reads `bridge.toml` again and applies it (`POST /admin/reload`).
    pub reload: Arc<dyn Reload>,
}

/// Reading the config again while running (SIGHUP, `POST /admin/reload`).
pub trait Reload: Send + Sync {
    fn reload(&self) -> Pin<Box<dyn Future<Output = ReloadReport> + Send + '_>>;
}

/// What a reload did.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ReloadReport {
    /// Why nothing changed: the file could not be read, or is not valid (file:line: key).
    pub error: Option<String>,
    /// What changed in place, one line each (`section.key`).
    pub changed: Vec<String>,
    /// What changed in the file and takes a restart, left as it was, one line each.
    pub needs_restart: Vec<String>,
}

/// The operator's console, served whole: plain HTML and script, no build step.
const CONSOLE: &str = include_str!("console.html");

pub fn router(admin: Admin) -> Router {
    let Admin {
        metrics,
        readiness,
        token,
        sources,
        reload,
    } = admin;
    let operators = Router::new()
        .route("/", get(|| async { Html(CONSOLE) }))
        .route("/admin/api/agents", get(api::agents))
        .route("/admin/api/messages", get(api::messages))
        .route("/admin/api/trace", get(api::trace))
        .with_state(sources)
        .route(
            "/admin/reload",
            post(move || {
                let reload = reload.clone();
                async move {
                    let report = reload.reload().await;
                    let status = match report.error {
                        Some(_) => StatusCode::BAD_REQUEST,
                        None => StatusCode::OK,
                    };
                    (status, Json(report))
                }
            }),
        )
        .layer(axum::middleware::from_fn_with_state(
            token.clone(),
            auth::require,
        ));
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    metrics.run_upkeep();
                    (
                        [(
                            header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        metrics.render(),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let ready = readiness.serving();
                let degraded = readiness.degraded();
                async move {
                    // Degraded still serves: the agents on this bridge reach one another.
                    // Starting says what holds the bridge back too (NATS refusing it).
                    match (ready, degraded) {
                        (false, None) => (StatusCode::SERVICE_UNAVAILABLE, "starting\n".to_owned()),
                        (false, Some(reason)) => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("starting: {reason}\n"),
                        ),
                        (true, Some(reason)) => (StatusCode::OK, format!("degraded: {reason}\n")),
                        (true, None) => (StatusCode::OK, "ready\n".to_owned()),
                    }
                    .into_response()
                }
            }),
        )
        .route("/login", post(auth::login).with_state(token))
        .merge(operators)
}
