//! [`KubeBackend`]: the aggregation backend over the Kubernetes API.
//!
//! # Paging over the API
//!
//! The paging contract (see [`crate::backend`]) wants a namespace cut into pages of *subjects*
//! in UID order, each page carrying every input of its subjects. The API cannot sort by
//! subject: ephemeral reports have random names and name their subject in a label (or an
//! ownerReference). So the first page of a pass builds an index from two metadata-only lists
//! (`limit`/`continue`, a few hundred bytes per object, no results): the final reports of the
//! requested kind and the ephemeral reports of the namespace. The index maps each subject UID
//! to the names of its final reports and records whether it has labelled ephemeral reports.
//! Each page then loads the bodies of exactly its subjects:
//!
//! * ephemeral reports by label selector, `audit.kyverno.io/resource.uid in (…)` for up to
//!   [`UIDS_PER_SELECTOR`] subjects per request (Kyverno's own join key), plus a GET for the
//!   rare report that names its subject only by ownerReference;
//! * final reports by GET of the names in the index (per-resource reports are named by the
//!   subject UID, so one GET each). Unmanaged reports are loaded only when named like a subject
//!   (to detect name collisions), and managed reports without ownerReferences (per-policy
//!   reports, several subjects each) all come with the first page.
//!
//! The index is kept between the pages of one pass; subjects that appear during the pass are
//! picked up by the pass their own event schedules. Memory is bounded by the metadata of one
//! namespace plus the bodies of one page.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use kube::Client;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use tokio::sync::watch;

use super::resources::{
    api, api_resource, backend_error, ephemeral_kind, from_value, is_conflict, is_not_found,
    list_all, list_metadata_all, to_value,
};
use crate::backend::{AggregationBackend, Applied, BackendError, InputPage, PageRequest};
use crate::merge::Plan;
use crate::policy::PolicySet;
use crate::report::{
    Ephemeral, FinalReport, LABEL_MANAGED_BY, LABEL_RESOURCE_UID, MANAGED_BY_VALUE, ObjectKey,
    ReportKind,
};

/// Subjects named in one label-selector request (keeps the URL a few kilobytes long).
pub const UIDS_PER_SELECTOR: usize = 50;

/// Tuning of the API calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeBackendConfig {
    /// `limit` of every list request.
    pub list_page_size: u32,
    /// Requests in flight at once while loading a page or applying a plan.
    pub concurrency: usize,
}

impl Default for KubeBackendConfig {
    fn default() -> Self {
        KubeBackendConfig {
            list_page_size: 500,
            concurrency: 8,
        }
    }
}

#[derive(Debug, Default)]
struct Inputs {
    /// Final reports attributed to this subject (its per-resource report, or an unmanaged
    /// report holding its name).
    reports: Vec<String>,
    /// Whether ephemeral reports carry this subject in the `resource.uid` label.
    labelled: bool,
    /// Ephemeral reports naming this subject only by ownerReference.
    unlabelled: Vec<String>,
}

/// One pass's view of a namespace, from metadata only.
#[derive(Debug, Default)]
struct Index {
    subjects: BTreeMap<String, Inputs>,
    /// Managed final reports without ownerReferences: per-policy reports, several subjects each.
    multi: Vec<String>,
}

fn label<'a>(meta: &'a kube::api::ObjectMeta, key: &str) -> Option<&'a str> {
    meta.labels
        .as_ref()
        .and_then(|l| l.get(key))
        .map(String::as_str)
        .filter(|v| !v.is_empty())
}

fn first_owner_uid(meta: &kube::api::ObjectMeta) -> Option<&str> {
    meta.owner_references
        .as_ref()
        .and_then(|o| o.first())
        .map(|o| o.uid.as_str())
        .filter(|u| !u.is_empty())
}

impl Index {
    fn build(finals: &[kube::api::ObjectMeta], ephemerals: &[kube::api::ObjectMeta]) -> Self {
        let mut index = Index::default();
        for meta in ephemerals {
            let name = meta.name.clone().unwrap_or_default();
            if let Some(uid) = label(meta, LABEL_RESOURCE_UID) {
                index.subjects.entry(uid.to_owned()).or_default().labelled = true;
            } else if let Some(uid) = first_owner_uid(meta) {
                index
                    .subjects
                    .entry(uid.to_owned())
                    .or_default()
                    .unlabelled
                    .push(name);
            }
        }
        let mut unmanaged = Vec::new();
        for meta in finals {
            let name = meta.name.clone().unwrap_or_default();
            if label(meta, LABEL_MANAGED_BY) != Some(MANAGED_BY_VALUE) {
                unmanaged.push(name);
                continue;
            }
            match first_owner_uid(meta) {
                Some(uid) => index
                    .subjects
                    .entry(uid.to_owned())
                    .or_default()
                    .reports
                    .push(name),
                None => index.multi.push(name),
            }
        }
        for name in unmanaged {
            if let Some(inputs) = index.subjects.get_mut(&name) {
                inputs.reports.push(name);
            }
        }
        index
    }
}

/// The [`AggregationBackend`] over a Kubernetes API server.
pub struct KubeBackend {
    client: Client,
    policies: watch::Receiver<Option<PolicySet>>,
    config: KubeBackendConfig,
    /// The index of the pass in progress, per (namespace, kind); one pass per namespace runs at
    /// a time (the queue guarantees it).
    indexes: Mutex<HashMap<(String, ReportKind), Arc<Index>>>,
}

impl KubeBackend {
    /// A backend whose policy set is whatever `policies` holds at the start of each pass
    /// (`None`: unknown, no result dropped for a missing policy).
    pub fn new(
        client: Client,
        policies: watch::Receiver<Option<PolicySet>>,
        config: KubeBackendConfig,
    ) -> Self {
        KubeBackend {
            client,
            policies,
            config,
            indexes: Mutex::new(HashMap::new()),
        }
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    fn indexes(&self) -> std::sync::MutexGuard<'_, HashMap<(String, ReportKind), Arc<Index>>> {
        self.indexes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn list_params(&self) -> ListParams {
        ListParams::default().limit(self.config.list_page_size.max(1))
    }

    async fn build_index(&self, namespace: &str, kind: ReportKind) -> Result<Index, BackendError> {
        let params = self.list_params();
        let finals_api = api(&self.client, kind, namespace);
        let eph_kind = ephemeral_kind(namespace);
        let eph_api = api(&self.client, eph_kind, namespace);
        let (finals, ephemerals) = futures::try_join!(
            async {
                list_metadata_all(&finals_api, &params)
                    .await
                    .map_err(|e| backend_error(format_args!("list {kind} in {namespace:?}"), e))
            },
            async {
                list_metadata_all(&eph_api, &params)
                    .await
                    .map_err(|e| backend_error(format_args!("list {eph_kind} in {namespace:?}"), e))
            }
        )?;
        let finals: Vec<_> = finals.into_iter().map(|o| o.metadata).collect();
        let ephemerals: Vec<_> = ephemerals.into_iter().map(|o| o.metadata).collect();
        Ok(Index::build(&finals, &ephemerals))
    }

    async fn get_final(
        &self,
        kind: ReportKind,
        namespace: &str,
        name: &str,
    ) -> Result<Option<FinalReport>, BackendError> {
        let api = api(&self.client, kind, namespace);
        let Some(object) = api
            .get_opt(name)
            .await
            .map_err(|e| backend_error(format_args!("get {kind} {namespace}/{name}"), e))?
        else {
            return Ok(None);
        };
        let value = to_value(object, &api_resource(kind));
        FinalReport::from_value(value)
            .map(Some)
            .map_err(|e| BackendError::Other(Box::new(e)))
    }

    async fn get_ephemeral(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Ephemeral>, BackendError> {
        let kind = ephemeral_kind(namespace);
        let api = api(&self.client, kind, namespace);
        let Some(object) = api
            .get_opt(name)
            .await
            .map_err(|e| backend_error(format_args!("get {kind} {namespace}/{name}"), e))?
        else {
            return Ok(None);
        };
        Ephemeral::from_value(to_value(object, &api_resource(kind)))
            .map(Some)
            .map_err(|e| BackendError::Other(Box::new(e)))
    }

    async fn list_ephemerals_of(
        &self,
        namespace: &str,
        uids: &[String],
    ) -> Result<Vec<Ephemeral>, BackendError> {
        let kind = ephemeral_kind(namespace);
        let api = api(&self.client, kind, namespace);
        let selector = format!("{LABEL_RESOURCE_UID} in ({})", uids.join(","));
        let objects = list_all(&api, &self.list_params().labels(&selector))
            .await
            .map_err(|e| backend_error(format_args!("list {kind} in {namespace:?}"), e))?;
        let ar = api_resource(kind);
        objects
            .into_iter()
            .map(|o| {
                Ephemeral::from_value(to_value(o, &ar))
                    .map_err(|e| BackendError::Other(Box::new(e)))
            })
            .collect()
    }

    async fn page(&self, request: PageRequest<'_>) -> Result<InputPage, BackendError> {
        let ns = request.namespace;
        let key = (ns.to_owned(), request.report_kind);
        let cached = match request.continue_token {
            Some(_) => self.indexes().get(&key).cloned(),
            None => None,
        };
        let index = match cached {
            Some(index) => index,
            None => {
                let index = Arc::new(self.build_index(ns, request.report_kind).await?);
                self.indexes().insert(key.clone(), index.clone());
                index
            }
        };
        let after = match request.continue_token {
            Some(token) => Bound::Excluded(token.to_owned()),
            None => Bound::Unbounded,
        };
        let mut remaining = index
            .subjects
            .range::<String, _>((after, Bound::Unbounded))
            .peekable();
        let subjects: Vec<(&String, &Inputs)> =
            remaining.by_ref().take(request.limit.max(1)).collect();
        let next = match remaining.peek() {
            Some(_) => subjects.last().map(|(uid, _)| (*uid).clone()),
            None => {
                self.indexes().remove(&key);
                None
            }
        };

        // Owned names: the futures below must not borrow from closure arguments.
        let mut report_names: BTreeSet<String> = BTreeSet::new();
        if request.continue_token.is_none() {
            report_names.extend(index.multi.iter().cloned());
        }
        let mut unlabelled: BTreeSet<String> = BTreeSet::new();
        let mut labelled: Vec<String> = Vec::new();
        for (uid, inputs) in &subjects {
            report_names.extend(inputs.reports.iter().cloned());
            unlabelled.extend(inputs.unlabelled.iter().cloned());
            if inputs.labelled {
                labelled.push((*uid).clone());
            }
        }
        let batches: Vec<Vec<String>> = labelled
            .chunks(UIDS_PER_SELECTOR)
            .map(<[String]>::to_vec)
            .collect();

        let kind = request.report_kind;
        let concurrency = self.config.concurrency.max(1);
        let reports = futures::stream::iter(report_names)
            .map(|name| async move { self.get_final(kind, ns, &name).await })
            .buffer_unordered(concurrency)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .filter_map(Result::transpose)
            .collect::<Result<Vec<_>, _>>()?;
        let mut ephemerals: BTreeMap<String, Ephemeral> = BTreeMap::new();
        let listed = futures::stream::iter(batches)
            .map(|uids| async move { self.list_ephemerals_of(ns, &uids).await })
            .buffer_unordered(concurrency)
            .collect::<Vec<_>>()
            .await;
        for batch in listed {
            for e in batch? {
                ephemerals.insert(e.name().to_owned(), e);
            }
        }
        let fetched = futures::stream::iter(unlabelled)
            .map(|name| async move { self.get_ephemeral(ns, &name).await })
            .buffer_unordered(concurrency)
            .collect::<Vec<_>>()
            .await;
        for e in fetched {
            if let Some(e) = e? {
                ephemerals.insert(e.name().to_owned(), e);
            }
        }
        Ok(InputPage {
            reports,
            ephemerals: ephemerals.into_values().collect(),
            next,
        })
    }

    async fn create(&self, report: &FinalReport) -> Result<(), BackendError> {
        let (kind, ns, name) = (report.kind(), report.namespace(), report.name());
        let mut value = report.to_value();
        if let Some(meta) = value.get_mut("metadata").and_then(|m| m.as_object_mut()) {
            meta.remove("resourceVersion");
            meta.remove("uid");
        }
        api(&self.client, kind, ns)
            .create(&PostParams::default(), &from_value(value)?)
            .await
            .map_err(|e| backend_error(format_args!("create {kind} {ns}/{name}"), e))?;
        Ok(())
    }

    async fn update(&self, report: &FinalReport) -> Result<(), BackendError> {
        let (kind, ns, name) = (report.kind(), report.namespace(), report.name());
        // The object keeps the resourceVersion it was read with: a report changed since then
        // makes the update fail with 409 instead of being overwritten.
        api(&self.client, kind, ns)
            .replace(
                name,
                &PostParams::default(),
                &from_value(report.to_value())?,
            )
            .await
            .map_err(|e| backend_error(format_args!("update {kind} {ns}/{name}"), e))?;
        Ok(())
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), BackendError> {
        self.delete_at_version(key).await.map_err(|e| {
            backend_error(
                format_args!("delete {} {}/{}", key.kind, key.namespace, key.name),
                e,
            )
        })
    }

    /// Deletes a consumed ephemeral report; `Ok(true)` when it was rewritten since it was
    /// loaded (409 on the precondition) and is left for the next pass.
    async fn consume(&self, key: &ObjectKey) -> Result<bool, BackendError> {
        match self.delete_at_version(key).await {
            Ok(()) => Ok(false),
            Err(e) if is_conflict(&e) => Ok(true),
            Err(e) => Err(backend_error(
                format_args!("delete {} {}/{}", key.kind, key.namespace, key.name),
                e,
            )),
        }
    }

    /// Deletes `key` if it still has the `resourceVersion` and `uid` it was loaded with; gone
    /// already is fine.
    async fn delete_at_version(&self, key: &ObjectKey) -> Result<(), kube::Error> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: key.resource_version.clone(),
                uid: key.uid.clone(),
            }),
            ..DeleteParams::default()
        };
        match api(&self.client, key.kind, &key.namespace)
            .delete(&key.name, &params)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Runs `operations` with bounded concurrency; all run even if one fails, the first error
    /// is returned.
    async fn run_all<T: Send>(
        &self,
        operations: Vec<BoxFuture<'_, Result<T, BackendError>>>,
    ) -> Result<Vec<T>, BackendError> {
        let results = futures::stream::iter(operations)
            .buffer_unordered(self.config.concurrency.max(1))
            .collect::<Vec<_>>()
            .await;
        results.into_iter().collect()
    }

    async fn apply_plan(&self, plan: &Plan) -> Result<Applied, BackendError> {
        // The order is what makes a crash safe; see the module docs of `cluster`.
        let writes = plan
            .creates
            .iter()
            .map(|r| self.create(r).boxed())
            .chain(plan.updates.iter().map(|r| self.update(r).boxed()))
            .collect();
        self.run_all(writes).await?;
        self.run_all(
            plan.deletes
                .iter()
                .map(|k| self.delete(k).boxed())
                .collect(),
        )
        .await?;
        let rewritten = self
            .run_all(
                plan.ephemeral_deletes
                    .iter()
                    .map(|k| self.consume(k).boxed())
                    .collect(),
            )
            .await?;
        Ok(Applied {
            ephemerals_rewritten: rewritten.into_iter().filter(|r| *r).count(),
        })
    }
}

impl AggregationBackend for KubeBackend {
    async fn policies(&self) -> Result<Option<PolicySet>, BackendError> {
        Ok(self.policies.borrow().clone())
    }

    async fn load_page(&self, request: PageRequest<'_>) -> Result<InputPage, BackendError> {
        self.page(request).await
    }

    async fn apply(&self, plan: &Plan) -> Result<Applied, BackendError> {
        self.apply_plan(plan).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    fn meta(name: &str, labels: &[(&str, &str)], owner: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            owner_references: owner.map(|uid| {
                vec![OwnerReference {
                    uid: uid.into(),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        }
    }

    #[test]
    fn index_attributes_every_input_to_its_subject() {
        let managed = (LABEL_MANAGED_BY, MANAGED_BY_VALUE);
        let ephemerals = [
            meta("bg-a", &[managed, (LABEL_RESOURCE_UID, "a")], Some("a")),
            meta("adm-a", &[managed, (LABEL_RESOURCE_UID, "a")], None),
            meta("bg-b", &[managed], Some("b")),
            meta("orphan", &[managed], None),
        ];
        let finals = [
            meta("a", &[managed], Some("a")),
            meta("cpol-x", &[managed], None),
            meta("b", &[("owner", "someone-else")], None),
            meta("unrelated", &[], None),
            meta("c", &[managed], Some("c")),
        ];
        let index = Index::build(&finals, &ephemerals);
        assert_eq!(index.multi, ["cpol-x"]);
        let uids: Vec<&str> = index.subjects.keys().map(String::as_str).collect();
        assert_eq!(uids, ["a", "b", "c"]);
        let a = &index.subjects["a"];
        assert!(a.labelled && a.unlabelled.is_empty());
        assert_eq!(a.reports, ["a"]);
        let b = &index.subjects["b"];
        assert!(!b.labelled);
        assert_eq!(b.unlabelled, ["bg-b"]);
        // The unmanaged report named like subject b comes with b (name collision check).
        assert_eq!(b.reports, ["b"]);
        assert_eq!(index.subjects["c"].reports, ["c"]);
    }
}
