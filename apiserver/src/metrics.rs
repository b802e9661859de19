//! Prometheus metrics of the API server (`/metrics`).

use std::sync::Arc;
use std::sync::atomic::AtomicI64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub verb: String,
    pub resource: String,
    pub code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabels {
    pub verb: String,
    pub resource: String,
}

pub struct Metrics {
    /// Behind a lock so components started later (the in-process aggregator) can add theirs.
    registry: std::sync::Mutex<Registry>,
    requests: Family<RequestLabels, Counter>,
    durations: Family<VerbLabels, Histogram>,
    watchers: Gauge<i64, AtomicI64>,
    watchers_cut_off: Counter,
}

/// Decrements the watcher gauge when a watch ends.
pub struct WatcherGuard(Arc<Metrics>);

impl Drop for WatcherGuard {
    fn drop(&mut self) {
        self.0.watchers.dec();
    }
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        // No registry prefix: every component names its metrics `reports_server_<component>_…`.
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let durations = Family::<VerbLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 16))
        });
        let watchers = Gauge::<i64, AtomicI64>::default();
        let watchers_cut_off = Counter::default();
        registry.register(
            "reports_server_apiserver_requests",
            "API requests by verb, resource and HTTP code",
            requests.clone(),
        );
        registry.register(
            "reports_server_apiserver_request_duration_seconds",
            "API request latency (watches and JSON object lists, which stream: until the response starts)",
            durations.clone(),
        );
        registry.register(
            "reports_server_apiserver_watchers",
            "Open watch streams",
            watchers.clone(),
        );
        registry.register(
            "reports_server_apiserver_watchers_cut_off",
            "Watchers ended because they fell behind the change feed",
            watchers_cut_off.clone(),
        );
        registry.register(
            "reports_server_build",
            "The running release: version, and the git commit when the build recorded one",
            prometheus_client::metrics::info::Info::new(vec![
                ("version", env!("CARGO_PKG_VERSION")),
                // For builds that record it (`REPORTS_SERVER_GIT_COMMIT=$(git rev-parse HEAD)
                // cargo build …`); `unknown` otherwise.
                (
                    "commit",
                    option_env!("REPORTS_SERVER_GIT_COMMIT").unwrap_or("unknown"),
                ),
            ]),
        );
        Arc::new(Metrics {
            registry: std::sync::Mutex::new(registry),
            requests,
            durations,
            watchers,
            watchers_cut_off,
        })
    }

    pub fn observe(&self, verb: &str, resource: &str, code: u16, seconds: f64) {
        self.requests
            .get_or_create(&RequestLabels {
                verb: verb.into(),
                resource: resource.into(),
                code,
            })
            .inc();
        self.durations
            .get_or_create(&VerbLabels {
                verb: verb.into(),
                resource: resource.into(),
            })
            .observe(seconds);
    }

    pub fn watcher_started(self: &Arc<Self>) -> WatcherGuard {
        self.watchers.inc();
        WatcherGuard(self.clone())
    }

    pub fn watcher_cut_off(&self) {
        self.watchers_cut_off.inc();
    }

    /// Lets another component register its metrics in the `/metrics` registry.
    pub fn register<T>(&self, f: impl FnOnce(&mut Registry) -> T) -> T {
        f(&mut self.registry.lock().expect("metrics registry"))
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().expect("metrics registry");
        prometheus_client::encoding::text::encode(&mut out, &registry).expect("metrics encode");
        out
    }
}
