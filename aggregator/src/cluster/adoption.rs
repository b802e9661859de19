//! Adoption of admission reports, as Kyverno ≥ 1.12 does it.
//!
//! Kyverno's admission webhook writes an ephemeral report per admission request without an
//! ownerReference: it only names the resource in labels and annotations. Before such a report is
//! aggregated, Kyverno's front queue *adopts* it: it looks the resource up, sets the
//! ownerReference to the live object and overwrites the `audit.kyverno.io/resource.uid` label
//! with the live UID (so garbage collection removes the report with the resource). A report
//! whose resource does not show up within two minutes of its creation is deleted; a lookup
//! refused with 403 deletes it at once (Kyverno ≥ 1.13).
//!
//! [`locate`] and [`decide`] are the pure part (what to look up, what to do with the answer);
//! [`Adopter`] does the I/O: lookups through the cluster's API, writes wherever the reports
//! live ([`EphemeralReports`]: the API, or reports-server's store for in-process aggregation). Where we differ from Kyverno: a lookup that fails for another
//! reason (API server unavailable, timeout) never deletes a report, whatever its age — an outage
//! must not destroy results; the report is looked at again later.

use std::future::Future;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, Preconditions};
use serde_json::json;

use super::ClusterError;
use super::discovery::{DiscoveryCache, Target};
use super::metrics::{AdoptionOutcomeLabel, ClusterMetrics};
use super::resources::{
    api, ephemeral_kind, is_conflict, is_forbidden, is_not_found, list_metadata_all,
};
use crate::report::{
    ANNOTATION_RESOURCE_NAME, ANNOTATION_RESOURCE_NAMESPACE, LABEL_RESOURCE_GROUP,
    LABEL_RESOURCE_GVR, LABEL_RESOURCE_KIND, LABEL_RESOURCE_UID, LABEL_RESOURCE_VERSION,
};
use crate::{AggregationBackend, Aggregator};

/// Kyverno's `deletionGrace`: how long an unadoptable report is kept.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(120);
/// Kyverno's re-queue delay for a report it could not adopt yet.
pub const DEFAULT_RETRY: Duration = Duration::from_secs(10);

/// Timing of adoption.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptionConfig {
    /// A report whose resource cannot be found is deleted once it is older than this.
    pub grace: Duration,
    /// How soon a report that could not be adopted yet is looked at again.
    pub retry: Duration,
}

impl Default for AdoptionConfig {
    fn default() -> Self {
        AdoptionConfig {
            grace: DEFAULT_GRACE,
            retry: DEFAULT_RETRY,
        }
    }
}

/// Where the subject of an un-owned report lives, from its labels and annotations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Locator {
    pub group: String,
    pub version: String,
    pub target: Target,
    /// `""` for cluster-scoped resources (ignored when the resource turns out cluster-scoped).
    pub namespace: String,
    pub name: String,
}

fn get<'a>(
    map: Option<&'a std::collections::BTreeMap<String, String>>,
    key: &str,
) -> Option<&'a str> {
    map.and_then(|m| m.get(key))
        .map(String::as_str)
        .filter(|v| !v.is_empty())
}

/// The subject of an ephemeral report as Kyverno's webhook describes it:
///
/// * name and namespace: the annotations `audit.kyverno.io/resource.name` / `.namespace`
///   (Kyverno ≥ 1.11), else the labels of the same keys (≤ 1.10), else the report's namespace;
/// * resource: the label `audit.kyverno.io/resource.gvr` = `<resource>.<version>[.<group>]`;
///   else the labels `resource.group`/`resource.version`/`resource.kind` (Kyverno ≥ 1.12);
///   else, for a gvr too long for a label value, Kyverno's fallback of `resource.group` +
///   `resource.version` with the plural under the *label* `audit.kyverno.io/resource.name`.
///
/// `None` when the report does not say enough.
pub fn locate(meta: &ObjectMeta, report_namespace: &str) -> Option<Locator> {
    let labels = meta.labels.as_ref();
    let annotations = meta.annotations.as_ref();
    let name = get(annotations, ANNOTATION_RESOURCE_NAME)
        .or_else(|| get(labels, ANNOTATION_RESOURCE_NAME))?
        .to_owned();
    let namespace = get(annotations, ANNOTATION_RESOURCE_NAMESPACE)
        .or_else(|| get(labels, ANNOTATION_RESOURCE_NAMESPACE))
        .unwrap_or(report_namespace)
        .to_owned();
    let group = get(labels, LABEL_RESOURCE_GROUP).unwrap_or_default();
    let (group, version, target) = if let Some(gvr) = get(labels, LABEL_RESOURCE_GVR) {
        let mut parts = gvr.splitn(3, '.');
        let resource = parts.next().filter(|s| !s.is_empty())?;
        let version = parts.next().filter(|s| !s.is_empty())?;
        let group = parts.next().unwrap_or_default();
        (
            group.to_owned(),
            version.to_owned(),
            Target::Resource(resource.to_owned()),
        )
    } else {
        let version = get(labels, LABEL_RESOURCE_VERSION)?;
        let target = match get(labels, LABEL_RESOURCE_KIND) {
            Some(kind) => Target::Kind(kind.to_owned()),
            // The label holds the plural only when the annotation holds the name.
            None if get(annotations, ANNOTATION_RESOURCE_NAME).is_some() => {
                Target::Resource(get(labels, ANNOTATION_RESOURCE_NAME)?.to_owned())
            }
            None => return None,
        };
        (group.to_owned(), version.to_owned(), target)
    };
    Some(Locator {
        group,
        version,
        target,
        namespace,
        name,
    })
}

/// What looking the subject up gave.
#[derive(Clone, Debug, PartialEq)]
pub enum Lookup {
    /// The live object, as the ownerReference to set.
    Found(OwnerReference),
    /// The resource type is served but no object has that name.
    NotFound,
    /// The report does not say what to look up, or the cluster does not serve that resource.
    Unresolvable,
    /// The lookup was refused (403).
    Forbidden,
    /// Anything else (unreachable API server, timeout…): try again later.
    Failed(String),
}

/// Why a report is deleted instead of adopted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeleteReason {
    /// The lookup was refused (Kyverno ≥ 1.13 deletes such reports).
    Forbidden,
    /// The resource was not found and the report is older than the grace period.
    Expired,
}

/// What to do with one ephemeral report.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// It has an ownerReference: nothing to adopt, it is aggregated as it is.
    Owned,
    /// Set this ownerReference and the `resource.uid` label to its UID.
    Adopt(OwnerReference),
    Delete(DeleteReason),
    /// Look again after this long.
    Retry(Duration),
}

/// Whether a report needs adoption (it has no ownerReference).
pub fn needs_adoption(meta: &ObjectMeta) -> bool {
    meta.owner_references.as_ref().is_none_or(Vec::is_empty)
}

/// The pure adoption rule (see the module docs). `now` and the report's `creationTimestamp`
/// are both API-server times in practice (the report's) and the local clock (`now`); the
/// grace period is long enough for ordinary skew not to matter.
pub fn decide(
    meta: &ObjectMeta,
    lookup: &Lookup,
    now: Timestamp,
    config: &AdoptionConfig,
) -> Decision {
    if !needs_adoption(meta) {
        return Decision::Owned;
    }
    match lookup {
        Lookup::Found(owner) => Decision::Adopt(owner.clone()),
        Lookup::Forbidden => Decision::Delete(DeleteReason::Forbidden),
        Lookup::Failed(_) => Decision::Retry(config.retry),
        Lookup::NotFound | Lookup::Unresolvable => {
            let age_ms = meta
                .creation_timestamp
                .as_ref()
                .map_or(0, |t| now.as_millisecond() - t.0.as_millisecond());
            let grace_ms = i64::try_from(config.grace.as_millis()).unwrap_or(i64::MAX);
            // Kyverno deletes once `creationTimestamp + grace < now`.
            if age_ms > grace_ms {
                Decision::Delete(DeleteReason::Expired)
            } else {
                // Come back just after the grace period ends if that is sooner than the retry.
                let left = Duration::from_millis((grace_ms - age_ms).unsigned_abs() + 100);
                Decision::Retry(config.retry.min(left))
            }
        }
    }
}

/// What one adoption pass over a namespace did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdoptionOutcome {
    pub adopted: usize,
    pub deleted: usize,
    pub pending: usize,
    /// When to look again (the earliest retry), if anything is pending.
    pub retry_after: Option<Duration>,
}

/// What writing one adoption decision did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Written {
    Done,
    /// The report is gone already (someone else consumed or deleted it).
    Gone,
    /// The report changed since it was listed (its `resourceVersion` precondition failed); the
    /// next pass looks at it again.
    Changed,
}

/// A failure of the storage holding the ephemeral reports.
pub type ReportsError = Box<dyn std::error::Error + Send + Sync>;

/// Where the ephemeral reports live: the Kubernetes API ([`ApiEphemeralReports`]) or, for
/// `reports-server serve`'s in-process aggregation, the server's own store. The adoption rules
/// and the lookups are the same for both; only these three operations differ.
pub trait EphemeralReports: Send + Sync {
    /// The metadata of every ephemeral report of `namespace` (`""`: the cluster ephemeral
    /// reports) without an ownerReference.
    fn unowned(
        &self,
        namespace: &str,
    ) -> impl Future<Output = Result<Vec<ObjectMeta>, ReportsError>> + Send;

    /// Sets `owner` as the only ownerReference and its UID as the `audit.kyverno.io/resource.uid`
    /// label, if the report still has the `resourceVersion` of `report`.
    fn adopt(
        &self,
        namespace: &str,
        report: &ObjectMeta,
        owner: &OwnerReference,
    ) -> impl Future<Output = Result<Written, ReportsError>> + Send;

    /// Deletes the report if it still has the `uid` and `resourceVersion` of `report`.
    fn delete(
        &self,
        namespace: &str,
        report: &ObjectMeta,
    ) -> impl Future<Output = Result<Written, ReportsError>> + Send;
}

/// [`EphemeralReports`] through the Kubernetes API.
pub struct ApiEphemeralReports {
    client: Client,
    list_page_size: u32,
}

impl ApiEphemeralReports {
    pub fn new(client: Client, list_page_size: u32) -> Self {
        ApiEphemeralReports {
            client,
            list_page_size: list_page_size.max(1),
        }
    }

    fn api(&self, namespace: &str) -> Api<DynamicObject> {
        api(&self.client, ephemeral_kind(namespace), namespace)
    }
}

/// Not found and conflicts are outcomes, not failures.
fn written(result: Result<(), kube::Error>) -> Result<Written, ReportsError> {
    match result {
        Ok(()) => Ok(Written::Done),
        Err(e) if is_not_found(&e) => Ok(Written::Gone),
        Err(e) if is_conflict(&e) => Ok(Written::Changed),
        Err(e) => Err(e.into()),
    }
}

impl EphemeralReports for ApiEphemeralReports {
    async fn unowned(&self, namespace: &str) -> Result<Vec<ObjectMeta>, ReportsError> {
        let params = ListParams::default().limit(self.list_page_size);
        Ok(list_metadata_all(&self.api(namespace), &params)
            .await?
            .into_iter()
            .map(|o| o.metadata)
            .filter(needs_adoption)
            .collect())
    }

    async fn adopt(
        &self,
        namespace: &str,
        report: &ObjectMeta,
        owner: &OwnerReference,
    ) -> Result<Written, ReportsError> {
        // resourceVersion in a merge patch is a precondition: a report changed since it was
        // listed is left for the next pass.
        let patch = json!({"metadata": {
            "resourceVersion": report.resource_version,
            "ownerReferences": [owner],
            "labels": {LABEL_RESOURCE_UID: owner.uid},
        }});
        let name = report.name.as_deref().unwrap_or_default();
        written(
            self.api(namespace)
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(drop),
        )
    }

    async fn delete(&self, namespace: &str, report: &ObjectMeta) -> Result<Written, ReportsError> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: report.resource_version.clone(),
                uid: report.uid.clone(),
            }),
            ..DeleteParams::default()
        };
        let name = report.name.as_deref().unwrap_or_default();
        written(self.api(namespace).delete(name, &params).await.map(drop))
    }
}

/// The I/O side of adoption: subjects are looked up through the cluster's API, decisions are
/// written wherever the reports live.
pub struct Adopter<R> {
    reports: R,
    client: Client,
    discovery: DiscoveryCache,
    config: AdoptionConfig,
    metrics: ClusterMetrics,
    concurrency: usize,
}

enum Done {
    Adopted,
    Deleted,
    Forbidden,
    Pending(Duration),
    Nothing,
}

impl<R: EphemeralReports> Adopter<R> {
    pub fn new(
        reports: R,
        client: Client,
        discovery: DiscoveryCache,
        config: AdoptionConfig,
        metrics: ClusterMetrics,
        concurrency: usize,
    ) -> Self {
        Adopter {
            reports,
            client,
            discovery,
            config,
            metrics,
            concurrency: concurrency.max(1),
        }
    }

    /// Looks the subject of a report up.
    pub async fn lookup(&self, locator: Option<&Locator>) -> Lookup {
        let Some(loc) = locator else {
            return Lookup::Unresolvable;
        };
        let served = match self
            .discovery
            .resolve(&loc.group, &loc.version, &loc.target)
            .await
        {
            Ok(Some(served)) => served,
            Ok(None) => return Lookup::Unresolvable,
            Err(e) => {
                return Lookup::Failed(format!("discovery of {}/{}: {e}", loc.group, loc.version));
            }
        };
        let ar = &served.resource;
        let api: Api<DynamicObject> = if served.namespaced {
            if loc.namespace.is_empty() {
                return Lookup::Unresolvable;
            }
            Api::namespaced_with(self.client.clone(), &loc.namespace, ar)
        } else {
            Api::all_with(self.client.clone(), ar)
        };
        match api.get_metadata_opt(&loc.name).await {
            Ok(Some(object)) => Lookup::Found(OwnerReference {
                api_version: ar.api_version.clone(),
                kind: ar.kind.clone(),
                name: loc.name.clone(),
                uid: object.metadata.uid.unwrap_or_default(),
                ..Default::default()
            }),
            Ok(None) => Lookup::NotFound,
            Err(e) if is_forbidden(&e) => Lookup::Forbidden,
            Err(e) => Lookup::Failed(format!(
                "get {} {}/{}: {e}",
                ar.kind, loc.namespace, loc.name
            )),
        }
    }

    /// Adopts or deletes every un-owned ephemeral report of `namespace` (`""`: the cluster
    /// ephemeral reports).
    pub async fn adopt_namespace(&self, namespace: &str) -> Result<AdoptionOutcome, ClusterError> {
        let unowned =
            self.reports
                .unowned(namespace)
                .await
                .map_err(|source| ClusterError::Reports {
                    what: format!("list {} in {namespace:?}", ephemeral_kind(namespace)),
                    source,
                })?;
        let mut outcome = AdoptionOutcome::default();
        if unowned.is_empty() {
            return Ok(outcome);
        }
        let results = futures::stream::iter(unowned)
            .map(|meta| async move { self.handle(namespace, meta).await })
            .buffer_unordered(self.concurrency)
            .collect::<Vec<_>>()
            .await;
        for done in results {
            match done {
                Done::Adopted => outcome.adopted += 1,
                Done::Deleted | Done::Forbidden => outcome.deleted += 1,
                Done::Pending(after) => {
                    outcome.pending += 1;
                    outcome.retry_after = Some(outcome.retry_after.map_or(after, |a| a.min(after)));
                }
                Done::Nothing => {}
            }
        }
        Ok(outcome)
    }

    /// One worker pass over `namespace`, as Kyverno's front queue does it: adopt (or delete) its
    /// un-owned admission reports, schedule another pass for those still pending, then merge.
    pub async fn adopt_and_reconcile<B: AggregationBackend>(
        &self,
        aggregator: &Aggregator<B>,
        namespace: &str,
    ) -> Result<(), ClusterError> {
        let adoption = self.adopt_namespace(namespace).await?;
        if let Some(after) = adoption.retry_after {
            aggregator.queue().enqueue_after(namespace, after);
        }
        let outcome = aggregator.reconcile(namespace).await?;
        tracing::debug!(namespace, ?adoption, ?outcome, "namespace aggregated");
        Ok(())
    }

    async fn handle(&self, namespace: &str, meta: ObjectMeta) -> Done {
        let name = meta.name.as_deref().unwrap_or_default();
        let locator = locate(&meta, namespace);
        let lookup = self.lookup(locator.as_ref()).await;
        let decision = decide(&meta, &lookup, Timestamp::now(), &self.config);
        let done = match decision {
            Decision::Owned => Done::Nothing,
            Decision::Adopt(owner) => match self.reports.adopt(namespace, &meta, &owner).await {
                Ok(Written::Done) => {
                    tracing::debug!(
                        namespace,
                        report = name,
                        subject = owner.name,
                        "adopted admission report"
                    );
                    Done::Adopted
                }
                Ok(Written::Gone) => Done::Nothing,
                Ok(Written::Changed) => Done::Pending(self.config.retry),
                Err(e) => {
                    tracing::warn!(namespace, report = name, error = %e, "cannot adopt admission report; will retry");
                    Done::Pending(self.config.retry)
                }
            },
            Decision::Delete(reason) => match self.reports.delete(namespace, &meta).await {
                Ok(Written::Done) if reason == DeleteReason::Forbidden => {
                    tracing::warn!(
                        namespace,
                        report = name,
                        resource = ?locator,
                        "deleted an admission report whose resource this server may not read (as Kyverno does); \
                         to keep such reports, grant `get` on that resource in a ClusterRole labelled \
                         reportsserver.io/aggregate-to-server=true (docs/operator.md)"
                    );
                    Done::Forbidden
                }
                Ok(Written::Done) => {
                    tracing::info!(
                        namespace,
                        report = name,
                        ?reason,
                        ?lookup,
                        "deleted an admission report whose resource cannot be found"
                    );
                    Done::Deleted
                }
                Ok(Written::Gone) => Done::Nothing,
                Ok(Written::Changed) => Done::Pending(self.config.retry),
                Err(e) => {
                    tracing::warn!(namespace, report = name, error = %e, "cannot delete unadoptable report; will retry");
                    Done::Pending(self.config.retry)
                }
            },
            Decision::Retry(after) => {
                if let Lookup::Failed(reason) = &lookup {
                    tracing::warn!(
                        namespace,
                        report = name,
                        reason,
                        "cannot look up the resource of an admission report; will retry"
                    );
                }
                Done::Pending(after)
            }
        };
        let label = match done {
            Done::Adopted => Some(AdoptionOutcomeLabel::Adopted),
            Done::Deleted => Some(AdoptionOutcomeLabel::Deleted),
            Done::Forbidden => Some(AdoptionOutcomeLabel::Forbidden),
            Done::Pending(_) => Some(AdoptionOutcomeLabel::Pending),
            Done::Nothing => None,
        };
        if let Some(label) = label {
            self.metrics.record_adoption(label);
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use std::collections::BTreeMap;

    fn map(pairs: &[(&str, &str)]) -> Option<BTreeMap<String, String>> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        )
    }

    fn report(labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> ObjectMeta {
        ObjectMeta {
            name: Some("3f0c-req-abcde".into()),
            namespace: Some("team".into()),
            labels: map(labels),
            annotations: map(annotations),
            creation_timestamp: Some(Time(Timestamp::from_second(1_000).unwrap())),
            ..Default::default()
        }
    }

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).unwrap()
    }

    #[test]
    fn locates_subjects_of_every_kyverno_generation() {
        // Kyverno 1.12+: gvr label, name and namespace annotations.
        let meta = report(
            &[
                (LABEL_RESOURCE_GVR, "deployments.v1.apps"),
                (LABEL_RESOURCE_UID, "u"),
            ],
            &[
                (ANNOTATION_RESOURCE_NAME, "web"),
                (ANNOTATION_RESOURCE_NAMESPACE, "prod"),
            ],
        );
        assert_eq!(
            locate(&meta, "team"),
            Some(Locator {
                group: "apps".into(),
                version: "v1".into(),
                target: Target::Resource("deployments".into()),
                namespace: "prod".into(),
                name: "web".into(),
            })
        );
        // Core group, namespace from the report, group with dots.
        let meta = report(
            &[(LABEL_RESOURCE_GVR, "pods.v1")],
            &[(ANNOTATION_RESOURCE_NAME, "p")],
        );
        let loc = locate(&meta, "team").unwrap();
        assert_eq!((loc.group.as_str(), loc.version.as_str()), ("", "v1"));
        assert_eq!(loc.namespace, "team");
        let meta = report(
            &[(LABEL_RESOURCE_GVR, "widgets.v1beta1.example.co.uk")],
            &[(ANNOTATION_RESOURCE_NAME, "w")],
        );
        assert_eq!(locate(&meta, "team").unwrap().group, "example.co.uk");
        // Kyverno ≤ 1.10: name and namespace in labels.
        let meta = report(
            &[
                (LABEL_RESOURCE_GVR, "pods.v1"),
                (ANNOTATION_RESOURCE_NAME, "p"),
                (ANNOTATION_RESOURCE_NAMESPACE, "old"),
            ],
            &[],
        );
        let loc = locate(&meta, "team").unwrap();
        assert_eq!((loc.name.as_str(), loc.namespace.as_str()), ("p", "old"));
        // No gvr: group/version/kind labels.
        let meta = report(
            &[
                (LABEL_RESOURCE_GROUP, "apps"),
                (LABEL_RESOURCE_VERSION, "v1"),
                (LABEL_RESOURCE_KIND, "StatefulSet"),
            ],
            &[(ANNOTATION_RESOURCE_NAME, "db")],
        );
        assert_eq!(
            locate(&meta, "team").unwrap().target,
            Target::Kind("StatefulSet".into())
        );
        // A gvr too long for a label: group + version labels, plural under the name label.
        let meta = report(
            &[
                (LABEL_RESOURCE_GROUP, "very.long.example.com"),
                (LABEL_RESOURCE_VERSION, "v1"),
                (ANNOTATION_RESOURCE_NAME, "things"),
            ],
            &[(ANNOTATION_RESOURCE_NAME, "t1")],
        );
        let loc = locate(&meta, "team").unwrap();
        assert_eq!(loc.target, Target::Resource("things".into()));
        assert_eq!(loc.name, "t1");
        // Not enough information.
        assert_eq!(
            locate(&report(&[(LABEL_RESOURCE_GVR, "pods.v1")], &[]), "team"),
            None
        );
        assert_eq!(
            locate(&report(&[], &[(ANNOTATION_RESOURCE_NAME, "p")]), "team"),
            None
        );
        assert_eq!(
            locate(
                &report(
                    &[(LABEL_RESOURCE_GVR, "pods")],
                    &[(ANNOTATION_RESOURCE_NAME, "p")]
                ),
                "team"
            ),
            None
        );
    }

    #[test]
    fn found_subjects_are_adopted_whatever_the_age() {
        let meta = report(&[], &[]);
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: "p".into(),
            uid: "live-uid".into(),
            ..Default::default()
        };
        let config = AdoptionConfig::default();
        for now in [at(1_000), at(1_000 + 3_600)] {
            assert_eq!(
                decide(&meta, &Lookup::Found(owner.clone()), now, &config),
                Decision::Adopt(owner.clone())
            );
        }
    }

    #[test]
    fn missing_subjects_are_deleted_only_after_the_grace_period() {
        let meta = report(&[], &[]);
        let config = AdoptionConfig::default();
        for lookup in [Lookup::NotFound, Lookup::Unresolvable] {
            assert_eq!(
                decide(&meta, &lookup, at(1_000 + 5), &config),
                Decision::Retry(DEFAULT_RETRY)
            );
            // Close to the deadline the retry comes just after it, not a full retry later.
            assert_eq!(
                decide(&meta, &lookup, at(1_000 + 115), &config),
                Decision::Retry(Duration::from_millis(5_100))
            );
            // Exactly at creation + grace Kyverno still waits (strictly older is required).
            assert!(matches!(
                decide(&meta, &lookup, at(1_000 + 120), &config),
                Decision::Retry(_)
            ));
            assert_eq!(
                decide(&meta, &lookup, at(1_000 + 121), &config),
                Decision::Delete(DeleteReason::Expired)
            );
        }
        let short = AdoptionConfig {
            grace: Duration::from_secs(5),
            ..AdoptionConfig::default()
        };
        assert_eq!(
            decide(&meta, &Lookup::NotFound, at(1_000 + 6), &short),
            Decision::Delete(DeleteReason::Expired)
        );
    }

    #[test]
    fn forbidden_deletes_at_once_and_failures_never_delete() {
        let meta = report(&[], &[]);
        let config = AdoptionConfig::default();
        assert_eq!(
            decide(&meta, &Lookup::Forbidden, at(1_000), &config),
            Decision::Delete(DeleteReason::Forbidden)
        );
        assert_eq!(
            decide(
                &meta,
                &Lookup::Failed("timeout".into()),
                at(1_000 + 86_400),
                &config
            ),
            Decision::Retry(DEFAULT_RETRY)
        );
    }

    #[test]
    fn owned_reports_are_left_alone() {
        let mut meta = report(&[], &[]);
        meta.owner_references = Some(vec![OwnerReference::default()]);
        assert!(!needs_adoption(&meta));
        assert_eq!(
            decide(
                &meta,
                &Lookup::NotFound,
                at(1_000_000),
                &AdoptionConfig::default()
            ),
            Decision::Owned
        );
        meta.owner_references = Some(vec![]);
        assert!(needs_adoption(&meta));
    }
}
