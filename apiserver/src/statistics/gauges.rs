//! The gauges the statistics worker publishes on `/metrics`: objects per resource and results
//! per policy and outcome, read from the database by the lease holder only. The other replicas
//! publish none of these series, so `sum()` over every replica counts each report once, and a
//! replica that loses the lease drops its series at once rather than leaving stale values.

use std::sync::atomic::{AtomicI64, AtomicU64};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::store::statistics::{ObjectCount, ResultCount};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    pub resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub source: String,
    pub policy: String,
    pub result: String,
}

/// The worker's series; clones share them.
#[derive(Clone, Debug, Default)]
pub struct StatisticsMetrics {
    objects: Family<ResourceLabels, Gauge>,
    results: Family<ResultLabels, Gauge>,
    leading: Gauge,
    refreshed_at: Gauge,
    refresh_seconds: Gauge<f64, AtomicU64>,
    failures: Counter,
    snapshots: Counter,
    snapshot_rows: Gauge<i64, AtomicI64>,
}

impl StatisticsMetrics {
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("reports_server_statistics");
        r.register(
            "objects",
            "Stored objects per resource (<plural>.<group>); published by the statistics lease holder only",
            self.objects.clone(),
        );
        r.register(
            "results",
            "Policy results per source, policy and result (pass, fail, warn, error, skip); published by the statistics lease holder only",
            self.results.clone(),
        );
        r.register(
            "leading",
            "1 while this replica holds the statistics lease and publishes the counts",
            self.leading.clone(),
        );
        r.register(
            "refreshed_timestamp_seconds",
            "Unix time of the last successful read of the counts",
            self.refreshed_at.clone(),
        );
        r.register(
            "refresh_duration_seconds",
            "How long the last read of the counts took",
            self.refresh_seconds.clone(),
        );
        r.register(
            "refresh_failures",
            "Reads of the counts or snapshots that failed (the database did not answer)",
            self.failures.clone(),
        );
        r.register(
            "history_snapshots",
            "Compliance history snapshots this replica took",
            self.snapshots.clone(),
        );
        r.register(
            "history_snapshot_rows",
            "Rows (namespace, source, policy) of the last snapshot this replica took",
            self.snapshot_rows.clone(),
        );
    }

    /// Replaces every published count: series of resources and policies that are gone vanish.
    pub fn publish(&self, objects: &[ObjectCount], results: &[ResultCount], at: i64, took: f64) {
        self.objects.clear();
        for o in objects {
            self.objects
                .get_or_create(&ResourceLabels {
                    resource: o.resource.clone(),
                })
                .set(o.objects);
        }
        self.results.clear();
        for r in results {
            self.results
                .get_or_create(&ResultLabels {
                    source: r.source.clone(),
                    policy: r.policy.clone(),
                    result: r.result.clone(),
                })
                .set(r.results);
        }
        self.refreshed_at.set(at);
        self.refresh_seconds.set(took);
    }

    /// Leading or not; a replica that stops leading publishes no counts.
    pub fn set_leading(&self, leading: bool) {
        self.leading.set(i64::from(leading));
        if !leading {
            self.objects.clear();
            self.results.clear();
        }
    }

    pub fn failed(&self) {
        self.failures.inc();
    }

    pub fn snapshot_taken(&self, rows: u64) {
        self.snapshots.inc();
        self.snapshot_rows
            .set(i64::try_from(rows).unwrap_or(i64::MAX));
    }
}
