//! The storage interface the aggregation workers drive.
//!
//! The aggregator does not know where reports live: the apiserver implements this trait over
//! its SQL store (so that writes and the deletion of consumed ephemeral reports share one
//! transaction), a kube-rs implementation can run against any cluster, and
//! [`InMemoryBackend`](crate::memory::InMemoryBackend) serves the tests.
//!
//! # Paging contract
//!
//! [`AggregationBackend::load_page`] streams a namespace in pages cut at *subject* boundaries,
//! so that the per-resource merge runs in memory bounded by the page size even for a namespace
//! with thousands of resources:
//!
//! * subjects are ordered by UID; a page covers up to `limit` subjects and carries **every**
//!   input of each of them: the final reports whose `scope.uid` is the subject, the ephemeral
//!   reports whose subject UID (label `audit.kyverno.io/resource.uid`, else first
//!   ownerReference UID) is the subject, and unmanaged reports *named* like the subject (so
//!   that name collisions are detected);
//! * final reports without `scope` (per-policy layout, several subjects each) are all returned
//!   on the first page; the worker then switches to one namespace-wide merge;
//! * `next` is an opaque token (in practice the last subject UID of the page); keyset paging
//!   means that writing the reports of one page does not shift the following pages.

use std::future::Future;

use crate::merge::Plan;
use crate::policy::PolicySet;
use crate::report::{Ephemeral, FinalReport, ReportKind};

/// Why a backend call failed. Every error is retried by the queue with backoff.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A precondition failed (the object changed or appeared since it was loaded, or a name is
    /// taken). The next attempt reloads and re-merges.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The storage is unreachable or refused the request.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// Anything else.
    #[error(transparent)]
    Other(Box<dyn std::error::Error + Send + Sync>),
}

/// What to load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRequest<'a> {
    /// `""` for cluster scope.
    pub namespace: &'a str,
    /// The kind of final report the aggregator writes in this namespace; a backend returns
    /// reports of this kind (it may add other final kinds to have them migrated).
    pub report_kind: ReportKind,
    /// `None` for the first page, else the `next` of the previous page.
    pub continue_token: Option<&'a str>,
    /// Maximum number of subjects in the page (a hint; at least 1).
    pub limit: usize,
}

/// What applying a plan did beyond what the plan says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Consumed ephemeral reports left in place because they were rewritten (a new
    /// `resourceVersion` or `uid`) after the page was loaded. The plan's other writes stand: they
    /// are what the merge would have written had the rewrite come just after it, and the rewrite
    /// enqueued the namespace again, so its newer version is merged by the next pass. For that
    /// to hold when the rewrite has results of the same second as the merged version (ties go
    /// to the greater resourceVersion), a backend must leave the rewritten report with a
    /// resourceVersion newer than the plan's reports: the store backend writes it again after
    /// them. Through the Kubernetes API a rewrite that landed before the plan's report writes
    /// keeps its older resourceVersion, and a same-second result in it loses to the one merged
    /// from the version it replaced (it did before this change too: the retried pass compared
    /// the same two versions).
    pub ephemerals_rewritten: usize,
}

/// One page of a namespace's inputs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InputPage {
    pub reports: Vec<FinalReport>,
    pub ephemerals: Vec<Ephemeral>,
    /// Token for the next page; `None` on the last page.
    pub next: Option<String>,
}

/// The storage operations aggregation needs. Implementations must be cheap to share between
/// the queue's workers (`&self`, `Send + Sync`).
pub trait AggregationBackend: Send + Sync + 'static {
    /// The live policy set, or `None` when it is not known (then no result is dropped for a
    /// missing policy or rule).
    fn policies(&self) -> impl Future<Output = Result<Option<PolicySet>, BackendError>> + Send;

    /// One page of a namespace's final and ephemeral reports (see the module docs).
    fn load_page(
        &self,
        request: PageRequest<'_>,
    ) -> impl Future<Output = Result<InputPage, BackendError>> + Send;

    /// Applies a plan atomically: all creates, updates and deletes, and the deletion of the
    /// consumed ephemeral reports, or nothing. Implementations should honour the
    /// `resourceVersion` carried by updates and deletes and return [`BackendError::Conflict`]
    /// when it does not match. An ephemeral report rewritten since it was loaded is not deleted
    /// (its newer results would be lost) and not an error either: it is counted in
    /// [`Applied::ephemerals_rewritten`] — under a storm of rescans, failing the whole plan for it
    /// would fail every pass of a large namespace. Deleting an object that is already gone is
    /// not an error.
    fn apply(&self, plan: &Plan) -> impl Future<Output = Result<Applied, BackendError>> + Send;
}
