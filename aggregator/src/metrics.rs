//! Prometheus metrics of the aggregator.
//!
//! Kyverno exposes only generic controller counters for its aggregator (see the reference,
//! §10); these say what an operator actually wants to know: is the queue keeping up, how long
//! does a namespace take, how much is written.

use std::fmt::Write;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// What happened to a report (label `operation`: `create`, `update`, `delete`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Operation {
    Create,
    Update,
    Delete,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Update => "update",
            Self::Delete => "delete",
        }
    }
}

impl EncodeLabelValue for Operation {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    pub operation: Operation,
}

/// All aggregator metrics; cheap to clone (every metric is shared).
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Keys waiting in the queue (not counting keys being processed).
    pub queue_depth: Gauge,
    /// Wall time of one namespace reconcile, successful or not.
    pub reconcile_duration: Histogram,
    /// Results in the final reports a pass computed, written or found unchanged.
    pub results_merged: Counter,
    /// Final reports created, updated or deleted.
    pub reports_written: Family<OperationLabels, Counter>,
    /// Ephemeral reports consumed and deleted.
    pub ephemeral_reports_deleted: Counter,
    /// Ephemeral reports merged but not deleted: rewritten since the merge loaded them, they
    /// wait for the next pass.
    pub ephemeral_reports_rewritten: Counter,
    /// Failed reconciles (each is retried with backoff).
    pub errors: Counter,
    /// Desired reports not written because an unmanaged report holds the name.
    pub conflicts: Counter,
}

impl Metrics {
    /// Creates the metrics and registers them under the prefix `reports_server_aggregation`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics {
            queue_depth: Gauge::default(),
            // 1 ms … ~65 s.
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            results_merged: Counter::default(),
            reports_written: Family::default(),
            ephemeral_reports_deleted: Counter::default(),
            ephemeral_reports_rewritten: Counter::default(),
            errors: Counter::default(),
            conflicts: Counter::default(),
        };
        let r = registry.sub_registry_with_prefix("reports_server_aggregation");
        r.register(
            "queue_depth",
            "Namespaces waiting to be aggregated",
            m.queue_depth.clone(),
        );
        r.register(
            "reconcile_duration_seconds",
            "Time to aggregate one namespace",
            m.reconcile_duration.clone(),
        );
        r.register(
            "results_merged",
            "Results in the policy reports each pass computed, written or found unchanged",
            m.results_merged.clone(),
        );
        r.register(
            "reports",
            "Policy reports created, updated or deleted by the aggregator",
            m.reports_written.clone(),
        );
        r.register(
            "ephemeral_reports_deleted",
            "Ephemeral reports consumed and deleted",
            m.ephemeral_reports_deleted.clone(),
        );
        r.register(
            "ephemeral_reports_rewritten",
            "Ephemeral reports rewritten while their namespace was merged: left for the next pass",
            m.ephemeral_reports_rewritten.clone(),
        );
        r.register(
            "errors",
            "Failed namespace reconciles (retried with backoff)",
            m.errors.clone(),
        );
        r.register(
            "conflicts",
            "Reports not written because an unmanaged report has the same name",
            m.conflicts.clone(),
        );
        m
    }

    /// Unregistered metrics, for callers that do not export them.
    pub fn unregistered() -> Self {
        Self::register(&mut Registry::default())
    }

    pub(crate) fn record_written(&self, op: Operation, n: usize) {
        if n > 0 {
            self.reports_written
                .get_or_create(&OperationLabels { operation: op })
                .inc_by(n as u64);
        }
    }
}
