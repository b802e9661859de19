//! The merge's storage: pages of inputs read from the store, plans written in one
//! transaction through the registry's rules.

use std::collections::BTreeSet;
use std::sync::RwLock;

use reports_server_aggregator::{
    AggregationBackend, Applied, BackendError, Ephemeral, FinalReport, InputPage, ObjectKey,
    OutputFormat, PageRequest, Plan, PolicySet, ReportKind,
};
use reports_server_crds::{ResourceDescriptor, catalog};
use serde_json::Value;

use crate::registry::{
    DeletePreconditions, FieldValidation, INTERNAL_MANAGER, RegistryError, ResourceRef, Validation,
    decide_delete, decide_update, prepare_create,
};
use crate::store::merge_input::MergePageQuery;
use crate::store::write_target::Target;
use crate::store::{Mutation, Store, StoreError};

use super::{AggregationError, LABELS, descriptor, ephemeral_kind, is_managed};

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
    pub(super) async fn namespaces(&self, sweep: Sweep) -> Result<Vec<String>, StoreError> {
        let ephemerals = [
            &catalog::EPHEMERAL_REPORT,
            &catalog::CLUSTER_EPHEMERAL_REPORT,
        ];
        let reports = [
            &catalog::POLICY_REPORT,
            &catalog::CLUSTER_POLICY_REPORT,
            &catalog::REPORT,
            &catalog::CLUSTER_REPORT,
        ];
        match sweep {
            Sweep::Ephemerals => self.store.merge_namespaces(&ephemerals, None).await,
            Sweep::Inputs => {
                self.store
                    .merge_namespaces(&ephemerals, Some((&reports[..], LABELS)))
                    .await
            }
            Sweep::OtherGroup(output) => {
                let other: Vec<&ResourceDescriptor> = output
                    .final_kinds()
                    .into_iter()
                    .filter_map(ReportKind::counterpart)
                    .map(descriptor)
                    .collect();
                let namespaces = self
                    .store
                    .merge_namespaces(&[], Some((&other[..], LABELS)))
                    .await?;
                if !namespaces.is_empty() {
                    tracing::info!(
                        namespaces = namespaces.len(),
                        output = %output,
                        "Kyverno's reports of the other report group found (written before the \
                         output group was switched): each namespace's merge moves them into \
                         --aggregation-output and deletes them there"
                    );
                }
                Ok(namespaces)
            }
        }
    }

    async fn page(&self, request: PageRequest<'_>) -> Result<InputPage, AggregationError> {
        let ns = request.namespace;
        let eph_kind = ephemeral_kind(ns);
        let first_page = request.continue_token.is_none();
        // The other report group's managed copies too: the merge takes their results over and
        // deletes them in the same transaction, so that after a switch of the output group
        // (`--aggregation-output`) no stale copy stays behind.
        let taken_over: Vec<&'static ResourceDescriptor> = request
            .report_kind
            .counterpart()
            .map(descriptor)
            .into_iter()
            .collect();
        let rows = self
            .store
            .merge_page(&MergePageQuery {
                namespace: ns,
                reports: descriptor(request.report_kind),
                taken_over: &taken_over,
                ephemerals: descriptor(eph_kind),
                after: request.continue_token,
                limit: request.limit,
                labels: LABELS,
            })
            .await?;
        let wanted: BTreeSet<&str> = rows.subjects.iter().map(String::as_str).collect();
        let mut page = InputPage {
            next: rows.next.clone(),
            ..InputPage::default()
        };
        for value in rows.reports {
            let report =
                FinalReport::from_value(value).map_err(|source| AggregationError::Decode {
                    what: format!("a final report in namespace {ns:?}"),
                    source,
                })?;
            if on_page(&report, &wanted, first_page) {
                page.reports.push(report);
            }
        }
        for value in rows.ephemerals {
            let eph = Ephemeral::from_value(value).map_err(|source| AggregationError::Decode {
                what: format!("{eph_kind} {ns}"),
                source,
            })?;
            page.ephemerals.push(eph);
        }
        Ok(page)
    }

    async fn apply_plan(&self, plan: &Plan) -> Result<Applied, AggregationError> {
        let ops: Vec<Op<'_>> = plan
            .creates
            .iter()
            .map(Op::Create)
            .chain(plan.updates.iter().map(Op::Update))
            .chain(plan.deletes.iter().map(Op::Delete))
            .chain(plan.ephemeral_deletes.iter().map(Op::ConsumeEphemeral))
            .collect();
        if ops.is_empty() {
            return Ok(Applied::default());
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
        let mut rewritten = vec![false; ops.len()];
        self.store
            .mutate_batch(&targets, false, |i, current| {
                rewritten[i] = ops[i].rewritten_since_loaded(current.as_ref());
                match current {
                    // Written again as it is, after this page's reports (the consumptions come
                    // last and a batch takes resourceVersions in order): on a tie of seconds
                    // the merge prefers the greater resourceVersion (merge.rs, rule 1), and the
                    // rewrite must beat what this page merged from the version it replaced.
                    Some(current) if rewritten[i] => Ok(Mutation::Put(current)),
                    current => ops[i].decide(current),
                }
            })
            .await?;
        Ok(Applied {
            ephemerals_rewritten: rewritten.iter().filter(|r| **r).count(),
        })
    }
}

/// Whether a stored report belongs to the page of `subjects`. A managed report belongs to
/// exactly one page: its subject's, or the first if it spans subjects. An unmanaged one is only
/// there to reveal name collisions: on the page of the subject it is named after, and (without
/// a scope, like a per-policy report) also on the first page, for the namespace-wide merge of
/// the per-policy layout, whose report names are not subject UIDs.
fn on_page(report: &FinalReport, subjects: &BTreeSet<&str>, first_page: bool) -> bool {
    let scope_uid = report
        .scope()
        .and_then(|s| s.uid.as_deref())
        .filter(|u| !u.is_empty());
    match (report.is_managed(), scope_uid) {
        (true, Some(uid)) => subjects.contains(uid),
        (true, None) => first_page,
        (false, scope) => subjects.contains(report.name()) || (first_page && scope.is_none()),
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

    /// Whether this is the consumption of an ephemeral report that was rewritten (or deleted
    /// and created anew) since it was loaded: it stays, for the next pass (see `Applied`), with
    /// a resourceVersion newer than this page's reports.
    fn rewritten_since_loaded(&self, current: Option<&Value>) -> bool {
        let (Op::ConsumeEphemeral(key), Some(current)) = (self, current) else {
            return false;
        };
        let differs = |want: &Option<String>, field: &str| {
            want.as_deref()
                .is_some_and(|want| current["metadata"][field].as_str() != Some(want))
        };
        differs(&key.resource_version, "resourceVersion") || differs(&key.uid, "uid")
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
                let (object, _, _) =
                    prepare_create(&path, object, &validation, INTERNAL_MANAGER).map_err(api)?;
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
                let (mutation, _, _) = decide_update(
                    &path,
                    &name,
                    Some(current),
                    report.to_value(),
                    &validation,
                    INTERNAL_MANAGER,
                )
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

    async fn apply(&self, plan: &Plan) -> Result<Applied, BackendError> {
        Ok(self.apply_plan(plan).await?)
    }
}

/// Which namespaces a sweep enqueues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sweep {
    /// Those holding ephemeral reports (new inputs to merge).
    Ephemerals,
    /// Those holding ephemeral reports or Kyverno-managed reports (after a policy change).
    Inputs,
    /// Those holding Kyverno-managed reports of the group this output does not write (at the
    /// start of a term: the output group may have been switched since they were written).
    OtherGroup(OutputFormat),
}
