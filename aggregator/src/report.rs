//! Kind-agnostic handles on the report objects the aggregator reads and writes.
//!
//! The merge treats the four final kinds (PolicyReport, ClusterPolicyReport, Report,
//! ClusterReport) alike and the two ephemeral kinds alike; only the output kind and the
//! namespace decide which struct is built. These enums keep the concrete `reports-server-crds`
//! structs (so nothing is lost on a round trip) and expose the few parts the merge needs.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use reports_server_crds::{
    ClusterEphemeralReport, ClusterPolicyReport, ClusterReport, EphemeralReport, PolicyReport,
    Report, ReportBody, ReportResult, Summary,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::Error;

/// `app.kubernetes.io/managed-by`: the only reports the aggregator may modify or delete carry
/// this label with value [`MANAGED_BY_VALUE`].
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Value of [`LABEL_MANAGED_BY`] on reports written by Kyverno (and by us in its place).
pub const MANAGED_BY_VALUE: &str = "kyverno";
/// Label carrying the subject UID on ephemeral reports; the join key of every aggregation.
pub const LABEL_RESOURCE_UID: &str = "audit.kyverno.io/resource.uid";
/// Label carrying `<resource>.<version>[.<group>]` on admission ephemeral reports.
pub const LABEL_RESOURCE_GVR: &str = "audit.kyverno.io/resource.gvr";
/// Labels carrying the subject group/version/kind on ephemeral reports (Kyverno ≥ 1.12).
pub const LABEL_RESOURCE_GROUP: &str = "audit.kyverno.io/resource.group";
pub const LABEL_RESOURCE_VERSION: &str = "audit.kyverno.io/resource.version";
pub const LABEL_RESOURCE_KIND: &str = "audit.kyverno.io/resource.kind";
/// Annotation (label before v1.11) carrying the subject name on ephemeral reports.
pub const ANNOTATION_RESOURCE_NAME: &str = "audit.kyverno.io/resource.name";
/// Annotation (label before v1.11) carrying the subject namespace on ephemeral reports.
pub const ANNOTATION_RESOURCE_NAMESPACE: &str = "audit.kyverno.io/resource.namespace";

/// Every report kind the aggregator knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ReportKind {
    PolicyReport,
    ClusterPolicyReport,
    Report,
    ClusterReport,
    EphemeralReport,
    ClusterEphemeralReport,
}

impl ReportKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PolicyReport => "PolicyReport",
            Self::ClusterPolicyReport => "ClusterPolicyReport",
            Self::Report => "Report",
            Self::ClusterReport => "ClusterReport",
            Self::EphemeralReport => "EphemeralReport",
            Self::ClusterEphemeralReport => "ClusterEphemeralReport",
        }
    }

    pub fn api_version(self) -> &'static str {
        match self {
            Self::PolicyReport | Self::ClusterPolicyReport => "wgpolicyk8s.io/v1alpha2",
            Self::Report | Self::ClusterReport => "openreports.io/v1alpha1",
            Self::EphemeralReport | Self::ClusterEphemeralReport => "reports.kyverno.io/v1",
        }
    }

    pub fn is_cluster_scoped(self) -> bool {
        matches!(
            self,
            Self::ClusterPolicyReport | Self::ClusterReport | Self::ClusterEphemeralReport
        )
    }

    /// The same final kind in the other report group (`PolicyReport` ↔ `Report`,
    /// `ClusterPolicyReport` ↔ `ClusterReport`): what Kyverno wrote before the output group was
    /// switched (`--openreportsEnabled`, `--aggregation-output`). `None` for ephemeral kinds.
    pub fn counterpart(self) -> Option<Self> {
        Some(match self {
            Self::PolicyReport => Self::Report,
            Self::Report => Self::PolicyReport,
            Self::ClusterPolicyReport => Self::ClusterReport,
            Self::ClusterReport => Self::ClusterPolicyReport,
            Self::EphemeralReport | Self::ClusterEphemeralReport => return None,
        })
    }

    /// Recognises `kind` in `apiVersion` (group checked, version ignored so that a future
    /// version of the same kind is not silently taken for something else).
    pub fn from_type(api_version: &str, kind: &str) -> Option<Self> {
        let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
        let k = match (group, kind) {
            ("wgpolicyk8s.io", "PolicyReport") => Self::PolicyReport,
            ("wgpolicyk8s.io", "ClusterPolicyReport") => Self::ClusterPolicyReport,
            ("openreports.io", "Report") => Self::Report,
            ("openreports.io", "ClusterReport") => Self::ClusterReport,
            ("reports.kyverno.io", "EphemeralReport") => Self::EphemeralReport,
            ("reports.kyverno.io", "ClusterEphemeralReport") => Self::ClusterEphemeralReport,
            _ => return None,
        };
        Some(k)
    }
}

impl fmt::Display for ReportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Identifies one stored object in a plan (for deletes) and carries the preconditions a
/// backend should check so that a concurrent writer is not overwritten.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ObjectKey {
    pub kind: ReportKind,
    /// `""` for cluster-scoped kinds.
    pub namespace: String,
    pub name: String,
    /// `metadata.uid` when known (precondition).
    pub uid: Option<String>,
    /// `metadata.resourceVersion` when known (precondition).
    pub resource_version: Option<String>,
}

impl ObjectKey {
    fn of(kind: ReportKind, meta: &ObjectMeta) -> Self {
        ObjectKey {
            kind,
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone(),
            resource_version: meta.resource_version.clone(),
        }
    }
}

fn is_managed(meta: &ObjectMeta) -> bool {
    meta.labels
        .as_ref()
        .and_then(|l| l.get(LABEL_MANAGED_BY))
        .is_some_and(|v| v == MANAGED_BY_VALUE)
}

/// A final report: what the aggregator writes.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum FinalReport {
    PolicyReport(PolicyReport),
    ClusterPolicyReport(ClusterPolicyReport),
    Report(Report),
    ClusterReport(ClusterReport),
}

macro_rules! each_final {
    ($self:expr, $r:ident => $e:expr) => {
        match $self {
            FinalReport::PolicyReport($r) => $e,
            FinalReport::ClusterPolicyReport($r) => $e,
            FinalReport::Report($r) => $e,
            FinalReport::ClusterReport($r) => $e,
        }
    };
}

impl FinalReport {
    /// An empty report of `kind` (which must be a final kind) with `metadata`.
    pub fn new(kind: ReportKind, metadata: ObjectMeta) -> Self {
        match kind {
            ReportKind::PolicyReport => Self::PolicyReport(PolicyReport {
                metadata,
                ..Default::default()
            }),
            ReportKind::ClusterPolicyReport => Self::ClusterPolicyReport(ClusterPolicyReport {
                metadata,
                ..Default::default()
            }),
            ReportKind::Report => Self::Report(Report {
                metadata,
                ..Default::default()
            }),
            ReportKind::ClusterReport => Self::ClusterReport(ClusterReport {
                metadata,
                ..Default::default()
            }),
            ReportKind::EphemeralReport | ReportKind::ClusterEphemeralReport => {
                panic!("FinalReport::new called with an ephemeral kind {kind}")
            }
        }
    }

    /// Decodes a JSON object whose `apiVersion`/`kind` name a final kind.
    pub fn from_value(value: Value) -> Result<Self, Error> {
        let (api_version, kind) = type_of(&value);
        let decode = |kind: &str, e| Error::Decode {
            context: "report".into(),
            kind: kind.to_owned(),
            source: e,
        };
        Ok(match ReportKind::from_type(&api_version, &kind) {
            Some(ReportKind::PolicyReport) => {
                Self::PolicyReport(serde_json::from_value(value).map_err(|e| decode(&kind, e))?)
            }
            Some(ReportKind::ClusterPolicyReport) => Self::ClusterPolicyReport(
                serde_json::from_value(value).map_err(|e| decode(&kind, e))?,
            ),
            Some(ReportKind::Report) => {
                Self::Report(serde_json::from_value(value).map_err(|e| decode(&kind, e))?)
            }
            Some(ReportKind::ClusterReport) => {
                Self::ClusterReport(serde_json::from_value(value).map_err(|e| decode(&kind, e))?)
            }
            _ => {
                return Err(Error::UnsupportedKind {
                    context: "report".into(),
                    api_version,
                    kind,
                });
            }
        })
    }

    pub fn kind(&self) -> ReportKind {
        match self {
            Self::PolicyReport(_) => ReportKind::PolicyReport,
            Self::ClusterPolicyReport(_) => ReportKind::ClusterPolicyReport,
            Self::Report(_) => ReportKind::Report,
            Self::ClusterReport(_) => ReportKind::ClusterReport,
        }
    }

    pub fn metadata(&self) -> &ObjectMeta {
        each_final!(self, r => &r.metadata)
    }

    pub fn metadata_mut(&mut self) -> &mut ObjectMeta {
        each_final!(self, r => &mut r.metadata)
    }

    pub fn name(&self) -> &str {
        self.metadata().name.as_deref().unwrap_or_default()
    }

    /// `""` for cluster-scoped reports.
    pub fn namespace(&self) -> &str {
        if self.kind().is_cluster_scoped() {
            ""
        } else {
            self.metadata().namespace.as_deref().unwrap_or_default()
        }
    }

    /// Whether the report carries `app.kubernetes.io/managed-by: kyverno`.
    pub fn is_managed(&self) -> bool {
        is_managed(self.metadata())
    }

    pub fn key(&self) -> ObjectKey {
        let mut key = ObjectKey::of(self.kind(), self.metadata());
        key.namespace = self.namespace().to_owned();
        key
    }

    pub fn results(&self) -> &[ReportResult] {
        each_final!(self, r => r.results())
    }

    pub fn summary(&self) -> Option<&Summary> {
        each_final!(self, r => r.summary.as_ref())
    }

    pub fn scope(&self) -> Option<&ObjectReference> {
        each_final!(self, r => r.scope.as_ref())
    }

    pub fn set_scope(&mut self, scope: Option<ObjectReference>) {
        each_final!(self, r => r.scope = scope)
    }

    /// Replaces the results and recomputes the summary the way Kyverno does (all five
    /// counters, zeros included). Kyverno's Go field is `omitempty`, so an empty list is
    /// stored as `None` and disappears from the serialised object.
    pub fn set_results(&mut self, results: Vec<ReportResult>) {
        let summary = Summary::of(&results);
        each_final!(self, r => {
            r.summary = Some(summary);
            r.results = if results.is_empty() { None } else { Some(results) };
        })
    }

    /// Sets the top-level `source` of openreports kinds; no-op for wgpolicyk8s.io kinds.
    pub fn set_source(&mut self, source: &str) {
        match self {
            Self::Report(r) => r.source = Some(source.to_owned()),
            Self::ClusterReport(r) => r.source = Some(source.to_owned()),
            _ => {}
        }
    }

    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("report types always serialise")
    }
}

/// An intermediate report written by Kyverno's webhook or background scanner.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Ephemeral {
    Namespaced(EphemeralReport),
    Cluster(ClusterEphemeralReport),
}

impl Ephemeral {
    /// Decodes a JSON object whose `apiVersion`/`kind` name an ephemeral kind.
    pub fn from_value(value: Value) -> Result<Self, Error> {
        let (api_version, kind) = type_of(&value);
        let decode = |e| Error::Decode {
            context: "ephemeral report".into(),
            kind: kind.clone(),
            source: e,
        };
        Ok(match ReportKind::from_type(&api_version, &kind) {
            Some(ReportKind::EphemeralReport) => {
                Self::Namespaced(serde_json::from_value(value).map_err(decode)?)
            }
            Some(ReportKind::ClusterEphemeralReport) => {
                Self::Cluster(serde_json::from_value(value).map_err(decode)?)
            }
            _ => {
                return Err(Error::UnsupportedKind {
                    context: "ephemeral report".into(),
                    api_version,
                    kind,
                });
            }
        })
    }

    pub fn kind(&self) -> ReportKind {
        match self {
            Self::Namespaced(_) => ReportKind::EphemeralReport,
            Self::Cluster(_) => ReportKind::ClusterEphemeralReport,
        }
    }

    pub fn metadata_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Self::Namespaced(r) => &mut r.metadata,
            Self::Cluster(r) => &mut r.metadata,
        }
    }

    pub fn metadata(&self) -> &ObjectMeta {
        match self {
            Self::Namespaced(r) => &r.metadata,
            Self::Cluster(r) => &r.metadata,
        }
    }

    pub fn name(&self) -> &str {
        self.metadata().name.as_deref().unwrap_or_default()
    }

    /// `""` for cluster-scoped reports.
    pub fn namespace(&self) -> &str {
        match self {
            Self::Namespaced(r) => r.metadata.namespace.as_deref().unwrap_or_default(),
            Self::Cluster(_) => "",
        }
    }

    pub fn key(&self) -> ObjectKey {
        let mut key = ObjectKey::of(self.kind(), self.metadata());
        key.namespace = self.namespace().to_owned();
        key
    }

    pub fn results(&self) -> &[ReportResult] {
        match self {
            Self::Namespaced(r) => r.results(),
            Self::Cluster(r) => r.results(),
        }
    }

    fn label(&self, key: &str) -> Option<&str> {
        self.metadata()
            .labels
            .as_ref()
            .and_then(|l| l.get(key))
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    /// The UID of the resource this report is about: the `audit.kyverno.io/resource.uid`
    /// label (Kyverno's aggregation key), else the first ownerReference's UID.
    pub fn subject_uid(&self) -> Option<&str> {
        self.label(LABEL_RESOURCE_UID).or_else(|| {
            self.metadata()
                .owner_references
                .as_ref()
                .and_then(|o| o.first())
                .map(|o| o.uid.as_str())
                .filter(|u| !u.is_empty())
        })
    }

    /// The first ownerReference, set by the background scanner or by adoption.
    pub fn owner(&self) -> Option<&OwnerReference> {
        self.metadata()
            .owner_references
            .as_ref()
            .and_then(|o| o.first())
    }

    /// The subject as an owner reference reconstructed from the labels and annotations Kyverno's
    /// webhook puts on admission reports, for reports nobody adopted. `None` when the kind or
    /// name is unknown.
    pub fn owner_from_labels(&self) -> Option<OwnerReference> {
        let uid = self.label(LABEL_RESOURCE_UID)?;
        let name = self
            .metadata()
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_RESOURCE_NAME))
            .map(String::as_str)
            .or_else(|| self.label(ANNOTATION_RESOURCE_NAME))
            .filter(|n| !n.is_empty())?;
        let kind = self.label(LABEL_RESOURCE_KIND)?;
        let labels = self.metadata().labels.as_ref();
        let group = labels
            .and_then(|l| l.get(LABEL_RESOURCE_GROUP))
            .map(String::as_str)
            .unwrap_or_default();
        // The version label is absent on some admission reports; the gvr label
        // (`<resource>.<version>[.<group>]`) then supplies it.
        let version = self
            .label(LABEL_RESOURCE_VERSION)
            .map(str::to_owned)
            .or_else(|| {
                self.label(LABEL_RESOURCE_GVR)
                    .and_then(|gvr| gvr.split('.').nth(1).map(str::to_owned))
            })?;
        let api_version = if group.is_empty() {
            version
        } else {
            format!("{group}/{version}")
        };
        Some(OwnerReference {
            api_version,
            kind: kind.to_owned(),
            name: name.to_owned(),
            uid: uid.to_owned(),
            ..Default::default()
        })
    }
}

/// `(apiVersion, kind)` of a JSON object, empty strings when absent.
pub(crate) fn type_of(value: &Value) -> (String, String) {
    let s = |k: &str| {
        value
            .get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    (s("apiVersion"), s("kind"))
}

/// The labels Kyverno puts on a report it creates: only `managed-by`.
pub(crate) fn managed_labels() -> BTreeMap<String, String> {
    BTreeMap::from([(LABEL_MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned())])
}
