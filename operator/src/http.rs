//! `/metrics` (Prometheus text), `/healthz` and `/readyz` of the operator.
//!
//! Why: a controller that silently stops reconciling is the failure nobody notices; the
//! reconcile counters and the leader gauge make that visible, and the probes let the kubelet
//! restart a wedged process. `/readyz` is ready once the process runs (standby replicas are
//! ready too: they are healthy and waiting for the Lease).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// The operator's metrics.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    reconciles: Family<ResultLabel, Counter>,
    duration: Histogram,
    leader: Gauge,
    ready: Arc<AtomicBool>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("reports_server_operator");
        let reconciles = Family::<ResultLabel, Counter>::default();
        let duration = Histogram::new(exponential_buckets(0.01, 2.0, 12));
        let leader = Gauge::default();
        registry.register(
            "reconciles",
            "Reconciles by result (ok, error)",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Duration of one reconcile",
            duration.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease",
            leader.clone(),
        );
        Metrics {
            registry: Arc::new(registry),
            reconciles,
            duration,
            leader,
            ready: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Records one reconcile.
    pub fn observe(&self, took: Duration, ok: bool) {
        self.reconciles
            .get_or_create(&ResultLabel {
                result: if ok { "ok" } else { "error" },
            })
            .inc();
        self.duration.observe(took.as_secs_f64());
    }

    /// Sets the leader gauge.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// Marks the process ready.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Serves the endpoints until the process ends.
pub async fn serve(addr: SocketAddr, metrics: Metrics) -> std::io::Result<()> {
    let m = metrics.clone();
    let r = metrics.ready.clone();
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = m.clone();
                async move { m.render() }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let r = r.clone();
                async move {
                    if r.load(Ordering::Relaxed) {
                        (axum::http::StatusCode::OK, "ok")
                    } else {
                        (axum::http::StatusCode::SERVICE_UNAVAILABLE, "starting")
                    }
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_render_counters_and_leader() {
        let m = Metrics::new();
        m.observe(Duration::from_millis(20), true);
        m.observe(Duration::from_millis(20), false);
        m.set_leader(true);
        let text = m.render();
        assert!(
            text.contains("reports_server_operator_reconciles_total{result=\"ok\"} 1"),
            "{text}"
        );
        assert!(text.contains("reports_server_operator_leader 1"), "{text}");
    }
}
