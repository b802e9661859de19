//! The in-process Kyverno report merger: ephemeral reports merged into policy reports, next
//! to the data. (Kyverno calls this "aggregation"; the module is named for what it does, apart
//! from the Kubernetes API aggregation layer and aggregated discovery.)
//!
//! With Kyverno running `--aggregateReports=false`, `reports-server serve` merges the
//! ephemeral reports itself (the merge rules are the aggregator crate's, see
//! `docs/aggregation.md`). Doing it here instead of through the Kubernetes API buys what the
//! API cannot give:
//!
//! * **Atomicity.** [`StoreBackend::apply`] writes a whole plan — policy reports created,
//!   updated and deleted, consumed ephemeral reports deleted — in *one* store transaction
//!   ([`Store::mutate_batch`]). Every precondition (the resourceVersion each object had when it
//!   was read, the `managed-by: kyverno` label) is checked inside that transaction, and any
//!   failure rolls all of it back. A crash therefore never loses a result (ephemerals are only
//!   gone if the merged report is committed) and never counts one twice (the merged report and
//!   the deletion of its inputs commit together; re-merging an already stored result is a
//!   no-op because identity, not arrival, decides).
//! * **Bounded memory.** [`StoreBackend::load_page`] cuts a namespace into pages of subjects
//!   (resource UIDs) with keyset paging in SQL, as the paging contract of
//!   `reports_server_aggregator::backend` requires. [`Store::list`] cannot do this: it pages by
//!   object name, but ephemeral reports written by the admission webhook have random names and
//!   are tied to their subject only by a label (or ownerReference), and per-resource reports by
//!   `scope.uid`. So the page queries here select the next subject UIDs from the indexed
//!   `scope_uid`, `object_labels` and `owner_uids` columns and then load the bodies of exactly
//!   those subjects. Nothing namespace-wide is held in memory.
//! * **One active aggregator per database.** Replicas share the database, so the singleton is
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

use std::collections::BTreeSet;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use reports_server_aggregator::cluster::adoption::ReportsError;
use reports_server_aggregator::cluster::discovery::{DEFAULT_TTL, DiscoveryCache};
use reports_server_aggregator::cluster::policies::{DEFAULT_REDISCOVERY, next_change};
use reports_server_aggregator::cluster::{
    Adopter, AdoptionConfig, ClusterMetrics, EphemeralReports, PolicyWatcher, Written,
};
use reports_server_aggregator::report::{LABEL_MANAGED_BY, LABEL_RESOURCE_UID, MANAGED_BY_VALUE};
use reports_server_aggregator::sweep::sweep_namespaces;
use reports_server_aggregator::{
    AggregationBackend, Aggregator, AggregatorConfig, BackendError, CancellationToken, Ephemeral,
    FinalReport, InputPage, Metrics, ObjectKey, PageRequest, Plan, PolicySet, ReportKind,
};
use reports_server_crds::{ResourceDescriptor, catalog};
use reports_server_election::Elector;
use sea_orm::{
    AccessMode, ConnectionTrait, DbBackend, IsolationLevel, Statement, TransactionTrait,
};
use serde_json::Value;
use tokio::sync::watch;
use tracing::Instrument;

use crate::registry::{
    DeletePreconditions, FieldValidation, RegistryError, ResourceRef, Validation, decide_delete,
    decide_update, prepare_create,
};
use crate::store::feed::Subscription;
use crate::store::lease::StoreLease;
use crate::store::ring::Lagged;
use crate::store::write_target::Target;
use crate::store::{EventType, Mutation, Store, StoreError, parse_document};

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

/// A raw SQL statement with backend-specific placeholders, so that the page queries can be
/// written as readable SQL (a `UNION` under an `ORDER BY`, a per-backend string function).
struct Sql {
    backend: DbBackend,
    text: String,
    values: Vec<sea_orm::Value>,
}

impl Sql {
    fn new(backend: DbBackend) -> Self {
        Sql {
            backend,
            text: String::new(),
            values: Vec::new(),
        }
    }

    fn push(&mut self, sql: &str) -> &mut Self {
        self.text.push_str(sql);
        self
    }

    fn bind(&mut self, value: impl Into<sea_orm::Value>) -> &mut Self {
        self.values.push(value.into());
        if self.backend == DbBackend::Postgres {
            let n = self.values.len();
            self.text.push_str(&format!("${n}"));
        } else {
            self.text.push('?');
        }
        self
    }

    /// `(v1, v2, …)`; callers never pass an empty list.
    fn bind_list<'a>(&mut self, values: impl IntoIterator<Item = &'a String>) -> &mut Self {
        self.push("(");
        for (i, v) in values.into_iter().enumerate() {
            if i > 0 {
                self.push(", ");
            }
            self.bind(v.as_str());
        }
        self.push(")")
    }

    fn build(self) -> Statement {
        Statement::from_sql_and_values(self.backend, self.text, self.values)
    }
}

/// SQL for the subject UID of an ephemeral report row `o` left-joined with its
/// `audit.kyverno.io/resource.uid` label row `l`: the label, else the first ownerReference UID
/// (`owner_uids` is the comma-joined list), exactly as `Ephemeral::subject_uid` decides.
fn ephemeral_subject_sql(backend: DbBackend) -> String {
    let first_owner = match backend {
        DbBackend::Postgres => "split_part(o.owner_uids, ',', 1)",
        DbBackend::MySql => "SUBSTRING_INDEX(o.owner_uids, ',', 1)",
        _ => {
            "CASE WHEN instr(o.owner_uids, ',') > 0 \
             THEN substr(o.owner_uids, 1, instr(o.owner_uids, ',') - 1) ELSE o.owner_uids END"
        }
    };
    format!("COALESCE(NULLIF(l.value, ''), NULLIF({first_owner}, ''))")
}

/// [`AggregationBackend`] over the SQL [`Store`].
///
/// `load_page` follows the paging contract of `reports_server_aggregator::backend`: subjects
/// in UID order (the database's order for the column, used consistently for both the cut and
/// the comparison, so the keyset never skips or repeats a subject), each page carrying every
/// input of its subjects; final reports without `scope.uid` on the first page only. `apply`
/// is one transaction.
pub struct StoreBackend {
    store: Store,
    policies: RwLock<Option<PolicySet>>,
}

impl StoreBackend {
    /// A backend with an unknown policy set (no result is dropped for a missing policy).
    pub fn new(store: Store) -> Self {
        StoreBackend {
            store,
            policies: RwLock::new(None),
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Sets the live policy set used by the next merges (`None`: unknown). The in-process
    /// server has no cluster API to watch Kyverno policies; whoever does (a controller, a
    /// test) passes them in here and should enqueue the namespaces afterwards.
    pub fn set_policies(&self, policies: Option<PolicySet>) {
        *self.policies.write().unwrap_or_else(|e| e.into_inner()) = policies;
    }

    /// The namespaces (`""` = cluster scope) a sweep enqueues (see [`Sweep`]).
    async fn namespaces(&self, sweep: Sweep) -> Result<Vec<String>, StoreError> {
        let store = &self.store;
        let mut q = Sql::new(store.backend());
        q.push("SELECT DISTINCT o.namespace FROM objects o WHERE o.cluster_id = ")
            .bind(store.cluster_id())
            .push(" AND (o.resource IN ")
            .bind_list(&[
                Store::resource_key(&catalog::EPHEMERAL_REPORT),
                Store::resource_key(&catalog::CLUSTER_EPHEMERAL_REPORT),
            ]);
        if sweep == Sweep::Inputs {
            q.push(" OR (o.resource IN ")
                .bind_list(&[
                    Store::resource_key(&catalog::POLICY_REPORT),
                    Store::resource_key(&catalog::CLUSTER_POLICY_REPORT),
                    Store::resource_key(&catalog::REPORT),
                    Store::resource_key(&catalog::CLUSTER_REPORT),
                ])
                .push(" AND EXISTS (SELECT 1 FROM object_labels m WHERE m.object_id = o.id AND m.key = ")
                .bind(LABEL_MANAGED_BY)
                .push(" AND m.value = ")
                .bind(MANAGED_BY_VALUE)
                .push("))");
        }
        q.push(")");
        let rows = store.connection().query_all_raw(q.build()).await?;
        rows.iter()
            .map(|r| Ok(r.try_get::<String>("", "namespace")?))
            .collect()
    }

    #[allow(
        clippy::too_many_lines,
        reason = "to split when its SQL moves into store/ (issue 34, part 2)"
    )]
    async fn page(&self, request: PageRequest<'_>) -> Result<InputPage, AggregationError> {
        let store = &self.store;
        let backend = store.backend();
        let cluster = store.cluster_id();
        let ns = request.namespace;
        let final_key = Store::resource_key(descriptor(request.report_kind));
        let eph_kind = ephemeral_kind(ns);
        let eph_key = Store::resource_key(descriptor(eph_kind));
        let first_page = request.continue_token.is_none();
        let after = request.continue_token.unwrap_or("");
        let limit = request.limit.max(1);
        let subject = ephemeral_subject_sql(backend);

        // One read snapshot for the whole page, as `Store::list` does.
        let txn = match backend {
            DbBackend::Postgres | DbBackend::MySql => {
                store
                    .connection()
                    .begin_with_config(
                        Some(IsolationLevel::RepeatableRead),
                        Some(AccessMode::ReadOnly),
                    )
                    .await
            }
            _ => store.connection().begin().await,
        }
        .map_err(StoreError::from)?;

        // The next `limit` subjects after the token (one more to know whether a page follows):
        // subjects of ephemeral reports and of managed reports with a `scope.uid`. `> ''` also
        // drops rows without a subject.
        let mut q = Sql::new(backend);
        q.push(&format!(
            "SELECT s.subject FROM (SELECT {subject} AS subject FROM objects o "
        ))
        .push("LEFT JOIN object_labels l ON l.object_id = o.id AND l.key = ")
        .bind(LABEL_RESOURCE_UID)
        .push(" WHERE o.cluster_id = ")
        .bind(cluster)
        .push(" AND o.resource = ")
        .bind(eph_key.as_str())
        .push(" AND o.namespace = ")
        .bind(ns)
        .push(" UNION SELECT o.scope_uid AS subject FROM objects o WHERE o.cluster_id = ")
        .bind(cluster)
        .push(" AND o.resource = ")
        .bind(final_key.as_str())
        .push(" AND o.namespace = ")
        .bind(ns)
        .push(" AND EXISTS (SELECT 1 FROM object_labels m WHERE m.object_id = o.id AND m.key = ")
        .bind(LABEL_MANAGED_BY)
        .push(" AND m.value = ")
        .bind(MANAGED_BY_VALUE)
        .push(")) s WHERE s.subject > ")
        .bind(after)
        .push(&format!(" ORDER BY s.subject LIMIT {}", limit + 1));
        let mut subjects: Vec<String> = txn
            .query_all_raw(q.build())
            .await
            .map_err(StoreError::from)?
            .iter()
            .map(|r| r.try_get::<String>("", "subject"))
            .collect::<Result<_, _>>()
            .map_err(StoreError::from)?;
        let next = if subjects.len() > limit {
            subjects.truncate(limit);
            subjects.last().cloned()
        } else {
            None
        };

        let mut page = InputPage {
            next,
            ..InputPage::default()
        };
        let wanted: BTreeSet<&str> = subjects.iter().map(String::as_str).collect();

        if !subjects.is_empty() || first_page {
            // Final reports: those scoped to a subject of the page, unmanaged ones named like
            // one (name collisions), and on the first page every report without a scope
            // (per-policy reports span subjects and are merged namespace-wide).
            let mut q = Sql::new(backend);
            q.push("SELECT o.body FROM objects o WHERE o.cluster_id = ")
                .bind(cluster)
                .push(" AND o.resource = ")
                .bind(final_key.as_str())
                .push(" AND o.namespace = ")
                .bind(ns)
                .push(" AND (");
            let mut any = false;
            if !subjects.is_empty() {
                q.push("o.scope_uid IN ")
                    .bind_list(&subjects)
                    .push(" OR o.name IN ")
                    .bind_list(&subjects);
                any = true;
            }
            if first_page {
                if any {
                    q.push(" OR ");
                }
                q.push("o.scope_uid IS NULL OR o.scope_uid = ''");
            }
            q.push(") ORDER BY o.name");
            for row in txn
                .query_all_raw(q.build())
                .await
                .map_err(StoreError::from)?
            {
                let body = store.body_of_row(&row, || format!("{ns}/{final_key}"))?;
                let value = parse_document(&format!("{ns}/{final_key}"), &body)?;
                let report =
                    FinalReport::from_value(value).map_err(|source| AggregationError::Decode {
                        what: format!("{} {ns}", request.report_kind),
                        source,
                    })?;
                // A managed report belongs to exactly one page: its subject's, or the first if
                // it spans subjects. An unmanaged one is only there to reveal name collisions:
                // on the page of the subject it is named after, and (without a scope, like a
                // per-policy report) also on the first page, for the namespace-wide merge of
                // the per-policy layout, whose report names are not subject UIDs.
                let scope_uid = report
                    .scope()
                    .and_then(|s| s.uid.as_deref())
                    .filter(|u| !u.is_empty());
                let keep = match (report.is_managed(), scope_uid) {
                    (true, Some(uid)) => wanted.contains(uid),
                    (true, None) => first_page,
                    (false, scope) => {
                        wanted.contains(report.name()) || (first_page && scope.is_none())
                    }
                };
                if keep {
                    page.reports.push(report);
                }
            }
        }

        if !subjects.is_empty() {
            let mut q = Sql::new(backend);
            q.push("SELECT o.body FROM objects o ")
                .push("LEFT JOIN object_labels l ON l.object_id = o.id AND l.key = ")
                .bind(LABEL_RESOURCE_UID)
                .push(" WHERE o.cluster_id = ")
                .bind(cluster)
                .push(" AND o.resource = ")
                .bind(eph_key.as_str())
                .push(" AND o.namespace = ")
                .bind(ns)
                .push(&format!(" AND {subject} IN "))
                .bind_list(&subjects)
                .push(" ORDER BY o.name");
            for row in txn
                .query_all_raw(q.build())
                .await
                .map_err(StoreError::from)?
            {
                let body = store.body_of_row(&row, || format!("{ns}/{eph_key}"))?;
                let value = parse_document(&format!("{ns}/{eph_key}"), &body)?;
                let eph =
                    Ephemeral::from_value(value).map_err(|source| AggregationError::Decode {
                        what: format!("{eph_kind} {ns}"),
                        source,
                    })?;
                page.ephemerals.push(eph);
            }
        }
        txn.commit().await.map_err(StoreError::from)?;
        Ok(page)
    }

    async fn apply_plan(&self, plan: &Plan) -> Result<(), AggregationError> {
        let ops: Vec<Op<'_>> = plan
            .creates
            .iter()
            .map(Op::Create)
            .chain(plan.updates.iter().map(Op::Update))
            .chain(plan.deletes.iter().map(Op::Delete))
            .chain(plan.ephemeral_deletes.iter().map(Op::ConsumeEphemeral))
            .collect();
        if ops.is_empty() {
            return Ok(());
        }
        let addresses: Vec<(ReportKind, String, String)> = ops.iter().map(Op::address).collect();
        let targets: Vec<Target<'_>> = addresses
            .iter()
            .map(|(kind, namespace, name)| Target {
                resource: descriptor(*kind),
                namespace,
                name,
            })
            .collect();
        // All or nothing: an error from any decision rolls the whole transaction back.
        self.store
            .mutate_batch(&targets, false, |i, current| ops[i].decide(current))
            .await?;
        Ok(())
    }
}

/// One write of a plan.
enum Op<'a> {
    Create(&'a FinalReport),
    Update(&'a FinalReport),
    Delete(&'a ObjectKey),
    ConsumeEphemeral(&'a ObjectKey),
}

impl Op<'_> {
    fn address(&self) -> (ReportKind, String, String) {
        match self {
            Op::Create(r) | Op::Update(r) => {
                (r.kind(), r.namespace().to_owned(), r.name().to_owned())
            }
            Op::Delete(k) | Op::ConsumeEphemeral(k) => {
                (k.kind, k.namespace.clone(), k.name.clone())
            }
        }
    }

    /// Decides the write from the current state, inside the transaction. Reuses the registry's
    /// object rules (`prepare_create`, `decide_update`, `decide_delete`) so that aggregated
    /// writes are indistinguishable from API writes:
    /// server-owned metadata on creation, generation bumped on content changes, optimistic
    /// concurrency, finalizers honoured on deletion.
    fn decide(&self, current: Option<Value>) -> Result<Mutation, AggregationError> {
        let (kind, namespace, name) = self.address();
        let desc = descriptor(kind);
        let path = ResourceRef::new(desc, &namespace);
        // Objects come from typed structs: nothing unknown to warn about.
        let validation = Validation {
            mode: FieldValidation::Ignore,
            duplicates: Vec::new(),
        };
        let api = |e: RegistryError| {
            if e.is_conflict() {
                AggregationError::Conflict(e.to_string())
            } else {
                AggregationError::Invalid {
                    kind,
                    namespace: namespace.clone(),
                    name: name.clone(),
                    message: e.to_string(),
                }
            }
        };
        let unmanaged = || AggregationError::Unmanaged {
            kind,
            namespace: namespace.clone(),
            name: name.clone(),
        };
        match self {
            Op::Create(report) => {
                if current.is_some() {
                    return Err(AggregationError::Conflict(format!(
                        "{kind} {namespace}/{name} appeared since it was read"
                    )));
                }
                let mut object = report.to_value();
                if let Some(meta) = object["metadata"].as_object_mut() {
                    meta.remove("resourceVersion");
                }
                let (object, _, _) = prepare_create(&path, object, &validation).map_err(api)?;
                Ok(Mutation::Put(object))
            }
            Op::Update(report) => {
                let Some(current) = current else {
                    return Err(AggregationError::Conflict(format!(
                        "{kind} {namespace}/{name} was deleted since it was read"
                    )));
                };
                if !is_managed(&current) {
                    return Err(unmanaged());
                }
                let (mutation, _, _) =
                    decide_update(&path, &name, Some(current), report.to_value(), &validation)
                        .map_err(api)?;
                Ok(mutation)
            }
            Op::Delete(key) | Op::ConsumeEphemeral(key) => {
                // Already gone is fine: someone else did the work.
                let Some(current) = current else {
                    return Ok(Mutation::Unchanged);
                };
                if matches!(self, Op::Delete(_)) && !is_managed(&current) {
                    return Err(unmanaged());
                }
                let preconditions = DeletePreconditions {
                    uid: key.uid.clone(),
                    resource_version: key.resource_version.clone(),
                    dry_run: false,
                };
                decide_delete(desc, &name, Some(current), &preconditions).map_err(api)
            }
        }
    }
}

impl AggregationBackend for StoreBackend {
    async fn policies(&self) -> Result<Option<PolicySet>, BackendError> {
        Ok(self
            .policies
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone())
    }

    async fn load_page(&self, request: PageRequest<'_>) -> Result<InputPage, BackendError> {
        Ok(self.page(request).await?)
    }

    async fn apply(&self, plan: &Plan) -> Result<(), BackendError> {
        Ok(self.apply_plan(plan).await?)
    }
}

/// The store's ephemeral reports, for adoption ([`Adopter`]): Kyverno's mutating webhook
/// writes its admission report before the object has a UID, so such a report names its
/// resource only by name and has neither an ownerReference nor a `resource.uid`. The adopter
/// looks the resource up in the cluster; the decision is written here, with the same
/// preconditions as an API write.
pub struct StoreEphemeralReports {
    store: Store,
}

impl StoreEphemeralReports {
    pub fn new(store: Store) -> Self {
        StoreEphemeralReports { store }
    }

    /// Applies `change` to the report if it still has the `uid` and `resourceVersion` it was
    /// listed with.
    async fn write(
        &self,
        namespace: &str,
        report: &ObjectMeta,
        change: impl Fn(&ResourceRef, &str, Value) -> Result<Mutation, RegistryError> + Send,
    ) -> Result<Written, ReportsError> {
        let desc = descriptor(ephemeral_kind(namespace));
        let name = report.name.clone().unwrap_or_default();
        let path = ResourceRef::new(desc, namespace);
        let mut written = Written::Done;
        let outcome = self
            .store
            .mutate::<AggregationError, _>(desc, namespace, &name, false, |current| {
                // Decided again if the report changes before the write: only the last counts.
                written = Written::Done;
                let Some(current) = current else {
                    written = Written::Gone;
                    return Ok(Mutation::Unchanged);
                };
                let meta = &current["metadata"];
                if meta["uid"].as_str() != report.uid.as_deref()
                    || meta["resourceVersion"].as_str() != report.resource_version.as_deref()
                {
                    written = Written::Changed;
                    return Ok(Mutation::Unchanged);
                }
                change(&path, &name, current).map_err(|e| {
                    if e.is_conflict() {
                        AggregationError::Conflict(e.to_string())
                    } else {
                        AggregationError::Invalid {
                            kind: ephemeral_kind(namespace),
                            namespace: namespace.to_owned(),
                            name: name.clone(),
                            message: e.to_string(),
                        }
                    }
                })
            })
            .await;
        match outcome {
            Ok(_) => Ok(written),
            Err(AggregationError::Conflict(_)) => Ok(Written::Changed),
            Err(e) => Err(Box::new(e)),
        }
    }
}

impl EphemeralReports for StoreEphemeralReports {
    async fn unowned(&self, namespace: &str) -> Result<Vec<ObjectMeta>, ReportsError> {
        let store = &self.store;
        let key = Store::resource_key(descriptor(ephemeral_kind(namespace)));
        let mut q = Sql::new(store.backend());
        q.push("SELECT o.metadata FROM objects o WHERE o.cluster_id = ")
            .bind(store.cluster_id())
            .push(" AND o.resource = ")
            .bind(key.as_str())
            .push(" AND o.namespace = ")
            .bind(namespace)
            .push(" AND (o.owner_uids IS NULL OR o.owner_uids = '') ORDER BY o.name");
        let rows = store
            .connection()
            .query_all_raw(q.build())
            .await
            .map_err(StoreError::from)?;
        let mut unowned = Vec::with_capacity(rows.len());
        for row in rows {
            let text: String = row.try_get("", "metadata").map_err(StoreError::from)?;
            let meta = parse_document(&format!("{namespace}/{key}"), &text)?;
            unowned.push(serde_json::from_value::<ObjectMeta>(meta)?);
        }
        Ok(unowned)
    }

    async fn adopt(
        &self,
        namespace: &str,
        report: &ObjectMeta,
        owner: &OwnerReference,
    ) -> Result<Written, ReportsError> {
        let owner_value = serde_json::to_value(owner)?;
        self.write(namespace, report, |path, name, current| {
            let mut adopted = current.clone();
            adopted["metadata"]["ownerReferences"] = Value::Array(vec![owner_value.clone()]);
            adopted["metadata"]["labels"][LABEL_RESOURCE_UID] = Value::String(owner.uid.clone());
            let validation = Validation {
                mode: FieldValidation::Ignore,
                duplicates: Vec::new(),
            };
            decide_update(path, name, Some(current), adopted, &validation).map(|(m, _, _)| m)
        })
        .await
    }

    async fn delete(&self, namespace: &str, report: &ObjectMeta) -> Result<Written, ReportsError> {
        let preconditions = DeletePreconditions {
            uid: report.uid.clone(),
            resource_version: report.resource_version.clone(),
            dry_run: false,
        };
        self.write(namespace, report, |path, name, current| {
            decide_delete(path.resource, name, Some(current), &preconditions)
        })
        .await
    }
}

/// Cluster access for in-process aggregation (`serve --auth-mode delegated`): with it, results
/// of deleted or report-disabled policies are dropped and admission reports written before
/// their resource had a UID are adopted, as Kyverno's own aggregation does. Without it (a
/// server with no cluster) the policy set is unknown — no result is ever dropped for a missing
/// policy — and such reports are kept, unmerged, until they are deleted.
#[derive(Clone)]
pub struct ClusterAccess {
    pub client: kube::Client,
    pub adoption: AdoptionConfig,
    /// Follow Kyverno's policies (`false`: the policy set stays unknown, nothing is dropped).
    pub watch_policies: bool,
    /// How long a new leader waits for the first complete policy lists before it aggregates
    /// with the missing kinds unknown.
    pub policy_sync_timeout: Duration,
    pub metrics: ClusterMetrics,
}

/// Timing of the database lease that makes one aggregator active per database: the same
/// election rules and defaults as the Kubernetes Lease of `reports-server aggregate`
/// (`reports_server_election`).
pub use reports_server_election::ElectionTiming as LeaseConfig;

/// The in-process aggregator of `reports-server serve`: leader election on the database
/// lease, event wiring from the change feed, and the aggregator's workers over a
/// [`StoreBackend`].
pub struct InProcessAggregator {
    store: Store,
    backend: Arc<StoreBackend>,
    config: AggregatorConfig,
    metrics: Metrics,
    lease: LeaseConfig,
    lease_name: String,
    holder: String,
    leading: watch::Sender<bool>,
    cluster: Option<ClusterAccess>,
}

impl InProcessAggregator {
    pub fn new(store: Store, config: AggregatorConfig, metrics: Metrics) -> Self {
        let host = std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "reports-server".into());
        // Unique per process, readable in `SELECT * FROM leases` (the pod name on Kubernetes).
        let holder = format!("{host}/{}/{}", std::process::id(), uuid::Uuid::new_v4());
        InProcessAggregator {
            lease_name: format!("aggregator/{}", store.cluster_id()),
            backend: Arc::new(StoreBackend::new(store.clone())),
            store,
            config,
            metrics,
            lease: LeaseConfig::default(),
            holder,
            leading: watch::channel(false).0,
            cluster: None,
        }
    }

    /// Gives the aggregator the cluster: policies are watched and un-owned admission reports
    /// adopted (see [`ClusterAccess`]).
    pub fn with_cluster(mut self, cluster: ClusterAccess) -> Self {
        self.cluster = Some(cluster);
        self
    }

    pub fn with_lease(mut self, lease: LeaseConfig) -> Self {
        self.lease = lease;
        self
    }

    /// The backend, e.g. to pass a policy set in.
    pub fn backend(&self) -> &Arc<StoreBackend> {
        &self.backend
    }

    /// This process's identity in the lease row.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// The lease row's name: `aggregator/<cluster id>`.
    pub fn lease_name(&self) -> &str {
        &self.lease_name
    }

    /// `true` while this instance holds the lease and runs workers.
    pub fn leading(&self) -> watch::Receiver<bool> {
        self.leading.subscribe()
    }

    /// Runs until `cancel` fires: waits for the lease, aggregates while holding it, and
    /// releases it on the way out. The election is the aggregator crate's one loop
    /// ([`Elector`]) over the database lease row ([`StoreLease`]).
    pub async fn run(self, cancel: CancellationToken) {
        let elector = Elector::new(
            StoreLease::new(self.store.clone(), &self.lease_name, &self.holder),
            self.lease,
        );
        elector
            .run(
                cancel,
                |term| self.work(term),
                |leading| {
                    self.leading.send_replace(leading);
                    if !leading {
                        self.metrics.queue_depth.set(0);
                    }
                },
            )
            .await;
        self.metrics.queue_depth.set(0);
    }

    /// One leadership term: a fresh queue (a cancelled queue may keep keys marked as in
    /// progress), the change feed, the policy watch and adoption when the cluster is known, and
    /// the workers, all stopped by `term`.
    async fn work(&self, term: CancellationToken) {
        let mut config = self.config.clone();
        let adopter = self.cluster.as_ref().map(|cluster| {
            // Kyverno merges only adopted reports; guessing an owner from labels is for servers
            // without a cluster to ask.
            config.merge.adopt_unowned = false;
            Arc::new(Adopter::new(
                StoreEphemeralReports::new(self.store.clone()),
                cluster.client.clone(),
                DiscoveryCache::new(cluster.client.clone(), DEFAULT_TTL),
                cluster.adoption.clone(),
                cluster.metrics.clone(),
                config.queue.workers,
            ))
        });
        let policies = match &self.cluster {
            Some(cluster) if cluster.watch_policies => {
                Some(self.watch_policies(cluster, &term).await)
            }
            _ => None,
        };
        let aggregator = Aggregator::new(self.backend.clone(), config, self.metrics.clone());
        // Subscribe before listing, so that a change is either in the listing or on the feed.
        let (changes, _) = self.store.feed().subscribe().await;
        let events = follow_changes(&self.backend, &aggregator, changes, &term);
        let handler = {
            let aggregator = aggregator.clone();
            move |namespace: String| {
                let aggregator = aggregator.clone();
                let adopter = adopter.clone();
                async move {
                    match adopter {
                        Some(adopter) => adopter
                            .adopt_and_reconcile(&aggregator, &namespace)
                            .await
                            .map_err(|e| e.to_string()),
                        None => aggregator
                            .reconcile(&namespace)
                            .await
                            .map(|outcome| {
                                tracing::debug!(namespace, ?outcome, "namespace aggregated")
                            })
                            .map_err(|e| e.to_string()),
                    }
                }
            }
        };
        let workers = aggregator.queue().run(handler, term.clone());
        let policy_changes = async {
            if let Some(policies) = policies {
                follow_policies(&self.backend, &aggregator, policies, &term).await;
            }
        };
        tokio::join!(events, workers, policy_changes);
    }

    /// Starts watching Kyverno's policy kinds for this term and waits (bounded) for the first
    /// complete lists, so that the first merges already drop results of deleted policies.
    async fn watch_policies(
        &self,
        cluster: &ClusterAccess,
        term: &CancellationToken,
    ) -> watch::Receiver<Option<PolicySet>> {
        let watcher = PolicyWatcher::new(cluster.metrics.clone());
        tokio::spawn(
            watcher
                .clone()
                .run(cluster.client.clone(), term.clone(), DEFAULT_REDISCOVERY)
                .instrument(tracing::info_span!("policy_watcher")),
        );
        if !watcher.wait_synced(cluster.policy_sync_timeout).await {
            tracing::warn!(pending = ?watcher.pending_kinds(), "policies not listed in time; aggregating with those kinds unknown (none of their results dropped)");
        }
        let mut policies = watcher.policies();
        self.backend
            .set_policies(policies.borrow_and_update().clone());
        policies
    }
}

/// Keeps the backend's policy set current and, after each change (a burst of changes counts
/// once), re-merges every namespace whose reports it can change.
async fn follow_policies(
    backend: &StoreBackend,
    aggregator: &Aggregator<StoreBackend>,
    mut policies: watch::Receiver<Option<PolicySet>>,
    term: &CancellationToken,
) {
    while let Some(set) = next_change(&mut policies, term).await {
        backend.set_policies(set);
        tracing::info!("policy set changed; re-merging every namespace with reports");
        enqueue_all(backend, aggregator, term, Sweep::Inputs).await;
    }
}

/// Which namespaces a sweep enqueues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sweep {
    /// Those holding ephemeral reports (new inputs to merge).
    Ephemerals,
    /// Those holding ephemeral reports or Kyverno-managed reports (after a policy change).
    Inputs,
}

/// Enqueues every namespace of `sweep`; retries until it succeeds or `cancel` fires (a
/// database outage must not lose a sweep).
async fn enqueue_all(
    backend: &StoreBackend,
    aggregator: &Aggregator<StoreBackend>,
    cancel: &CancellationToken,
    sweep: Sweep,
) {
    let what = match sweep {
        Sweep::Ephemerals => "with ephemeral reports",
        Sweep::Inputs => "with ephemeral or Kyverno-managed reports",
    };
    sweep_namespaces(aggregator.queue(), cancel, what, || {
        backend.namespaces(sweep)
    })
    .await
}

/// Turns change-feed events into queue entries until `cancel` fires.
async fn follow_changes(
    backend: &StoreBackend,
    aggregator: &Aggregator<StoreBackend>,
    mut changes: Subscription,
    cancel: &CancellationToken,
) {
    enqueue_all(backend, aggregator, cancel, Sweep::Ephemerals).await;
    loop {
        let received = tokio::select! {
            _ = cancel.cancelled() => return,
            received = changes.recv() => received,
        };
        match received {
            Ok(change) => {
                if change.event != EventType::Deleted && is_ephemeral_resource(&change.resource) {
                    aggregator.enqueue(change.namespace.as_str());
                }
            }
            Err(Lagged(missed)) => {
                tracing::warn!(
                    missed,
                    "aggregation fell behind the change feed; re-enqueuing every namespace"
                );
                enqueue_all(backend, aggregator, cancel, Sweep::Ephemerals).await;
            }
        }
    }
}

/// Runs in-process aggregation on `store` until `cancel` fires (the entry point of
/// `reports-server serve`), with the default lease timing.
#[tracing::instrument(name = "in_process_aggregation", skip_all)]
pub async fn run_in_process(
    store: Store,
    config: AggregatorConfig,
    metrics: Metrics,
    cluster: Option<ClusterAccess>,
    cancel: CancellationToken,
) {
    // A server started while its database was down starts aggregating once the store started.
    tokio::select! {
        () = store.health().came_up() => {}
        () = cancel.cancelled() => return,
    }
    let mut aggregator = InProcessAggregator::new(store, config, metrics);
    if let Some(cluster) = cluster {
        aggregator = aggregator.with_cluster(cluster);
    }
    aggregator.run(cancel).await
}
