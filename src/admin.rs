//! The operations listener: `/metrics` (Prometheus text), `/healthz`, `/readyz`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwapOption;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;

/// Whether every configured endpoint is listening, and why the bridge is degraded when
/// it serves with a part missing (federation without NATS).
#[derive(Clone, Default)]
pub struct Readiness {
    ready: Arc<AtomicBool>,
    degraded: Arc<ArcSwapOption<String>>,
}

impl Readiness {
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Says why the bridge is degraded, or (`None`) that it no longer is.
    pub fn set_degraded(&self, reason: Option<String>) {
        self.degraded.store(reason.map(Arc::new));
    }

    pub fn degraded(&self) -> Option<Arc<String>> {
        self.degraded.load_full()
    }
}

pub fn router(metrics: PrometheusHandle, readiness: Readiness) -> Router {
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
                let ready = readiness.is_ready();
                let degraded = readiness.degraded();
                async move {
                    // Degraded still serves: the agents on this bridge reach one another.
                    match (ready, degraded) {
                        (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "starting\n".to_owned()),
                        (true, Some(reason)) => (StatusCode::OK, format!("degraded: {reason}\n")),
                        (true, None) => (StatusCode::OK, "ready\n".to_owned()),
                    }
                    .into_response()
                }
            }),
        )
}
