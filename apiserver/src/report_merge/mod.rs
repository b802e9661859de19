//! The in-process Kyverno report merger: ephemeral reports merged into policy reports, next
//! to the data. (Kyverno calls this "aggregation"; the module is named for what it does, apart
//! from the Kubernetes API aggregation layer and aggregated discovery.)
//!
//! With Kyverno running `--aggregateReports=false`, `reports-server serve` merges the
//! ephemeral reports itself (the merge rules are the aggregator crate's, see
//! `docs/aggregation.md`). Doing it here instead of through the Kubernetes API buys what the
//! API cannot give:
//!
//! * **Atomicity.** [`StoreBackend`]'s `apply` writes a whole plan — policy reports created,
//!   updated and deleted, consumed ephemeral reports deleted — in *one* store transaction
//!   ([`Store::mutate_batch`]). Every precondition (the resourceVersion each object had when it
//!   was read, the `managed-by: kyverno` label) is checked inside that transaction, and any
//!   failure rolls all of it back — except that an ephemeral report rewritten since it was read
//!   is not a failure: it is kept, written again after the page's reports so that its newer
//!   results win the next pass, and counted (`Applied::ephemerals_rewritten`). A crash therefore never loses a result (ephemerals are only
//!   gone if the merged report is committed) and never counts one twice (the merged report and
//!   the deletion of its inputs commit together; re-merging an already stored result is a
//!   no-op because identity, not arrival, decides).
//! * **Bounded memory.** [`StoreBackend`]'s `load_page` cuts a namespace into pages of subjects
//!   (resource UIDs) with keyset paging in SQL, as the paging contract of
//!   `reports_server_aggregator::backend` requires; the queries are the store's
//!   ([`crate::store::merge_input`], which says why [`Store::list`] cannot do it). Nothing
//!   namespace-wide is held in memory.
//! * **One active merger per database.** Replicas share the database, so the singleton is
//!   a lease row in it ([`crate::store::lease`]); only the holder runs workers, a standby takes
//!   over when the holder stops renewing (about 15–20 s after a crash, one retry interval after
//!   a clean shutdown, which releases the lease). Two aggregators running at once (e.g. a
//!   holder cut off from the database that has not noticed yet) would still be safe: every
//!   apply is checked against resourceVersions, so the loser of a race gets a conflict and
//!   re-merges.
//!
//! Events: any change to an `EphemeralReport` or `ClusterEphemeralReport` (from the store's change
//! feed, which also carries other replicas' writes) enqueues its namespace (`""` for cluster
//! scope) with the configured delay. Deletions are ignored: removing an ephemeral report does
//! not change what the merge writes (stored results stay until superseded), and ignoring them
//! keeps our own deletions from scheduling a useless second pass. When the lease is acquired,
//! and whenever the feed reports that this subscriber lagged behind, every namespace that has
//! ephemeral reports is enqueued, so no event is ever lost for good.
//!
//! The parts: `backend` (pages in, plans out), `adoption` (admission reports adopted once
//! their resource has a UID), `runner` (the lease, the workers, what enqueues namespaces).

use reports_server_aggregator::report::{LABEL_MANAGED_BY, LABEL_RESOURCE_UID, MANAGED_BY_VALUE};
use reports_server_aggregator::{BackendError, ReportKind};
use reports_server_crds::{ResourceDescriptor, catalog};
use serde_json::Value;

use crate::store::merge_input::MergeLabels;
use crate::store::{Store, StoreError};

mod adoption;
mod backend;
mod runner;

pub use adoption::StoreEphemeralReports;
pub use backend::StoreBackend;
pub use runner::{ClusterAccess, InProcessMerger, LeaseConfig, run_in_process};

/// Why reading or applying failed. Converted to the aggregator's [`BackendError`], whose
/// variant decides nothing but the log line: every failure is retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum AggregationError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A precondition failed: an object changed, appeared or disappeared since it was read.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The plan would modify a report that is not managed by Kyverno.
    #[error(
        "{kind} {namespace}/{name} is not labelled {LABEL_MANAGED_BY}={MANAGED_BY_VALUE}; not touching it"
    )]
    Unmanaged {
        kind: ReportKind,
        namespace: String,
        name: String,
    },
    /// A stored or planned object does not satisfy the schema or the API rules.
    #[error("invalid {kind} {namespace}/{name}: {message}")]
    Invalid {
        kind: ReportKind,
        namespace: String,
        name: String,
        message: String,
    },
    /// A stored body could not be decoded as the kind its row says.
    #[error("stored object {what} cannot be decoded: {source}")]
    Decode {
        what: String,
        #[source]
        source: reports_server_aggregator::Error,
    },
}

impl From<AggregationError> for BackendError {
    fn from(e: AggregationError) -> Self {
        match e {
            AggregationError::Store(e) if e.is_transient() => {
                BackendError::Unavailable(e.to_string())
            }
            AggregationError::Store(StoreError::AlreadyExists) => {
                BackendError::Conflict("a report to create already exists".into())
            }
            AggregationError::Conflict(m) => BackendError::Conflict(m),
            e @ AggregationError::Unmanaged { .. } => BackendError::Conflict(e.to_string()),
            other => BackendError::Other(Box::new(other)),
        }
    }
}

/// The served resource behind a report kind.
fn descriptor(kind: ReportKind) -> &'static ResourceDescriptor {
    match kind {
        ReportKind::PolicyReport => &catalog::POLICY_REPORT,
        ReportKind::ClusterPolicyReport => &catalog::CLUSTER_POLICY_REPORT,
        ReportKind::Report => &catalog::REPORT,
        ReportKind::ClusterReport => &catalog::CLUSTER_REPORT,
        ReportKind::EphemeralReport => &catalog::EPHEMERAL_REPORT,
        ReportKind::ClusterEphemeralReport => &catalog::CLUSTER_EPHEMERAL_REPORT,
    }
}

/// The ephemeral kind feeding `namespace` (`""` = cluster scope).
fn ephemeral_kind(namespace: &str) -> ReportKind {
    if namespace.is_empty() {
        ReportKind::ClusterEphemeralReport
    } else {
        ReportKind::EphemeralReport
    }
}

fn is_managed(object: &Value) -> bool {
    object["metadata"]["labels"][LABEL_MANAGED_BY].as_str() == Some(MANAGED_BY_VALUE)
}

/// Whether a change-log `resource` (`<plural>.<group>`) is an aggregation input.
fn is_ephemeral_resource(resource: &str) -> bool {
    resource == Store::resource_key(&catalog::EPHEMERAL_REPORT)
        || resource == Store::resource_key(&catalog::CLUSTER_EPHEMERAL_REPORT)
}

/// The labels by which the store recognises the merge's inputs.
const LABELS: MergeLabels<'static> = MergeLabels {
    subject: LABEL_RESOURCE_UID,
    managed_by: (LABEL_MANAGED_BY, MANAGED_BY_VALUE),
};
