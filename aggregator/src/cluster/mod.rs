//! Aggregation through the Kubernetes API (cargo feature `kube`), for clusters whose reports
//! stay in etcd as CRDs — or are served by reports-server behind kube-apiserver, which is the
//! same API. `reports-server aggregate --kubeconfig` runs it; Kyverno then runs with
//! `--aggregateReports=false`.
//!
//! The pieces:
//!
//! * [`backend::KubeBackend`]: the [`AggregationBackend`](crate::AggregationBackend) over
//!   list/get/create/update/delete calls;
//! * [`adoption`]: Kyverno's adoption of admission reports (owner set from the live resource),
//!   a pure decision function and its I/O;
//! * [`policies`]: the live [`PolicySet`](crate::PolicySet), from watches on every policy kind
//!   the cluster serves;
//! * [`runner`]: everything together — watches that enqueue namespaces, the workers, the
//!   metrics endpoint.
//!
//! # Why a crash never loses or doubles a result
//!
//! Over the API a plan cannot be applied atomically: every object is its own request. The
//! backend therefore orders a plan so that every prefix of it is safe:
//!
//! 1. policy reports are created and updated (each update carries the `resourceVersion` it was
//!    computed from, so a concurrent writer makes it fail with 409 instead of being
//!    overwritten);
//! 2. policy reports that are no longer wanted are deleted (with `resourceVersion`/`uid`
//!    preconditions);
//! 3. only when all of that succeeded are the consumed ephemeral reports deleted, each with a
//!    `resourceVersion` precondition, so an ephemeral report rewritten since it was read (a
//!    newer scan) is kept for the next pass.
//!
//! A crash (or a lost lease) between any two requests leaves results that are *both* in a
//! policy report and still in an ephemeral report, never in neither. The next pass merges the
//! same inputs again. A result's identity is `(source, policy, rule, subject uid)` and, for equal
//! `timestamp.seconds`, the stored result beats the ephemeral copy, so re-merging a result that
//! was already written changes nothing: it is not counted twice, and the ephemeral reports are
//! then deleted. A crash in the per-policy layout between writing two chunks can show a result
//! in two chunks for that short window; the next pass (the namespace is re-enqueued by the
//! restart's initial sweep) removes the duplicate.
//!
//! # Triggers
//!
//! Metadata-only watches on EphemeralReport and ClusterEphemeralReport enqueue the namespace of
//! every added or modified report (`""` for cluster scope) with the aggregation delay; deletions
//! are ignored (they do not change what the merge writes, and ignoring them keeps our own
//! deletions from scheduling a useless pass). When the lease is acquired, every namespace
//! holding ephemeral reports or managed policy reports is enqueued. A change of the policy set
//! enqueues every namespace holding managed policy reports or ephemeral reports: finding only
//! the reports with results of the changed policy would need the results of every report, which
//! only a full read can give over the API, and policy changes are rare.

pub mod adoption;
pub mod backend;
pub mod discovery;
pub mod http;
pub mod metrics;
pub mod policies;
pub mod resources;
pub mod runner;

pub use adoption::{
    Adopter, AdoptionConfig, ApiEphemeralReports, Decision, EphemeralReports, Lookup, Written,
};
pub use backend::KubeBackend;
pub use metrics::ClusterMetrics;
pub use policies::PolicyWatcher;
pub use reports_server_election::kube_lease::LeaseConfig;
pub use runner::{ClusterAggregator, ClusterConfig};

/// Failures of the cluster aggregator that are not retried in place.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A Kubernetes API call failed.
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// The cluster does not serve a resource the aggregator needs.
    #[error(
        "the cluster does not serve {resource}; install the report CRDs (`reports-server crds | kubectl apply -f -`) or reports-server's APIServices (`reports-server apiservices`)"
    )]
    MissingResource { resource: String },
    /// The metrics endpoint could not be bound.
    #[error("cannot listen on {address} for metrics: {source}")]
    MetricsBind {
        address: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing ephemeral reports failed.
    #[error("{what}: {source}")]
    Reports {
        what: String,
        #[source]
        source: adoption::ReportsError,
    },
    /// A merge failed.
    #[error(transparent)]
    Aggregation(#[from] crate::Error),
}

impl ClusterError {
    pub(crate) fn kube(what: impl Into<String>, source: kube::Error) -> Self {
        ClusterError::Kube {
            what: what.into(),
            source,
        }
    }
}
