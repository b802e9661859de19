//! Metrics of the cluster aggregator, next to the aggregator's own [`Metrics`](crate::Metrics).

use std::fmt::Write;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// What happened to an un-owned admission report (label `outcome`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum AdoptionOutcomeLabel {
    /// Owner set from the live resource.
    Adopted,
    /// Deleted: resource not found within the grace period.
    Deleted,
    /// Deleted because the lookup was refused (403), as Kyverno does: the server's role does
    /// not grant `get` on that kind (docs/operator.md says how to add it).
    Forbidden,
    /// Left for a later attempt.
    Pending,
}

impl EncodeLabelValue for AdoptionOutcomeLabel {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        encoder.write_str(match self {
            Self::Adopted => "adopted",
            Self::Deleted => "deleted",
            Self::Forbidden => "forbidden",
            Self::Pending => "pending",
        })
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdoptionLabels {
    pub outcome: AdoptionOutcomeLabel,
}

/// Cheap to clone; every metric is shared.
#[derive(Clone, Debug)]
pub struct ClusterMetrics {
    /// 1 while this process holds the aggregation Lease.
    pub leader: Gauge,
    /// Un-owned admission reports handled, by outcome.
    pub adoptions: Family<AdoptionLabels, Counter>,
    /// Live policies in the policy set (all kinds).
    pub policies: Gauge,
    /// Policy kinds whose policies are unknown (CRD missing, watch failing or not synced).
    pub policy_kinds_unknown: Gauge,
}

impl ClusterMetrics {
    /// Creates the metrics and registers them under the prefix `reports_server_aggregation`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = ClusterMetrics {
            leader: Gauge::default(),
            adoptions: Family::default(),
            policies: Gauge::default(),
            policy_kinds_unknown: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("reports_server_aggregation");
        r.register(
            "leader",
            "1 while this process holds the aggregation lease",
            m.leader.clone(),
        );
        r.register(
            "adoptions",
            "Un-owned admission ephemeral reports adopted, deleted (resource gone, or lookup forbidden) or left pending",
            m.adoptions.clone(),
        );
        r.register(
            "policies",
            "Live policies known to the aggregator",
            m.policies.clone(),
        );
        r.register(
            "policy_kinds_unknown",
            "Policy kinds whose policies are unknown (no result of theirs is dropped)",
            m.policy_kinds_unknown.clone(),
        );
        m
    }

    /// Unregistered metrics, for callers that do not export them.
    pub fn unregistered() -> Self {
        Self::register(&mut Registry::default())
    }

    pub(crate) fn record_adoption(&self, outcome: AdoptionOutcomeLabel) {
        self.adoptions
            .get_or_create(&AdoptionLabels { outcome })
            .inc();
    }
}
