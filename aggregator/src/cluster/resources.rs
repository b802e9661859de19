//! The report kinds as dynamic API resources, and the mapping of API errors.

use kube::api::{Api, ApiResource, DynamicObject, ListParams, ObjectList};
use kube::core::{PartialObjectMeta, TypeMeta};
use kube::{Client, Error as KubeError};
use serde_json::Value;

use crate::backend::BackendError;
use crate::report::ReportKind;

/// The plural resource name of a report kind.
pub fn plural(kind: ReportKind) -> &'static str {
    match kind {
        ReportKind::PolicyReport => "policyreports",
        ReportKind::ClusterPolicyReport => "clusterpolicyreports",
        ReportKind::Report => "reports",
        ReportKind::ClusterReport => "clusterreports",
        ReportKind::EphemeralReport => "ephemeralreports",
        ReportKind::ClusterEphemeralReport => "clusterephemeralreports",
    }
}

/// The dynamic API resource of a report kind.
pub fn api_resource(kind: ReportKind) -> ApiResource {
    let api_version = kind.api_version();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    ApiResource {
        group: group.to_owned(),
        version: version.to_owned(),
        api_version: api_version.to_owned(),
        kind: kind.as_str().to_owned(),
        plural: plural(kind).to_owned(),
    }
}

/// The ephemeral kind feeding `namespace` (`""` = cluster scope).
pub fn ephemeral_kind(namespace: &str) -> ReportKind {
    if namespace.is_empty() {
        ReportKind::ClusterEphemeralReport
    } else {
        ReportKind::EphemeralReport
    }
}

/// An `Api` for `kind` in `namespace` (`""`: cluster-scoped kinds, or all namespaces).
pub fn api(client: &Client, kind: ReportKind, namespace: &str) -> Api<DynamicObject> {
    let ar = api_resource(kind);
    if kind.is_cluster_scoped() || namespace.is_empty() {
        Api::all_with(client.clone(), &ar)
    } else {
        Api::namespaced_with(client.clone(), namespace, &ar)
    }
}

/// The JSON of a dynamic object with `apiVersion`/`kind` filled in (list items of built-in
/// kinds come without them).
pub fn to_value(mut object: DynamicObject, ar: &ApiResource) -> Value {
    if object.types.as_ref().is_none_or(|t| t.kind.is_empty()) {
        object.types = Some(TypeMeta {
            api_version: ar.api_version.clone(),
            kind: ar.kind.clone(),
        });
    }
    serde_json::to_value(object).expect("dynamic objects always serialise")
}

/// A dynamic object from the JSON of a report.
pub fn from_value(value: Value) -> Result<DynamicObject, BackendError> {
    serde_json::from_value(value).map_err(|e| BackendError::Other(Box::new(e)))
}

/// Whether an API error is 404 Not Found.
pub fn is_not_found(e: &KubeError) -> bool {
    matches!(e, KubeError::Api(s) if s.is_not_found())
}

/// Whether an API error is 403 Forbidden.
pub fn is_forbidden(e: &KubeError) -> bool {
    matches!(e, KubeError::Api(s) if s.is_forbidden())
}

/// Whether an API error is 409 (Conflict or AlreadyExists).
pub fn is_conflict(e: &KubeError) -> bool {
    matches!(e, KubeError::Api(s) if s.is_conflict() || s.is_already_exists())
}

/// Maps an API error to the aggregator's error kinds: 409 is a conflict (the next attempt
/// reloads and re-merges), everything else makes the backend unavailable for this attempt.
pub fn backend_error(what: impl std::fmt::Display, e: KubeError) -> BackendError {
    if is_conflict(&e) {
        BackendError::Conflict(format!("{what}: {e}"))
    } else {
        BackendError::Unavailable(format!("{what}: {e}"))
    }
}

/// Every page of a metadata-only list.
pub async fn list_metadata_all(
    api: &Api<DynamicObject>,
    params: &ListParams,
) -> Result<Vec<PartialObjectMeta<DynamicObject>>, KubeError> {
    let mut params = params.clone();
    let mut items = Vec::new();
    loop {
        let page: ObjectList<PartialObjectMeta<DynamicObject>> = api.list_metadata(&params).await?;
        items.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params.continue_token = Some(token),
            None => return Ok(items),
        }
    }
}

/// Every page of a full list.
pub async fn list_all(
    api: &Api<DynamicObject>,
    params: &ListParams,
) -> Result<Vec<DynamicObject>, KubeError> {
    let mut params = params.clone();
    let mut items = Vec::new();
    loop {
        let page = api.list(&params).await?;
        items.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params.continue_token = Some(token),
            None => return Ok(items),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_kinds_map_to_their_served_resources() {
        let ar = api_resource(ReportKind::EphemeralReport);
        assert_eq!(ar.group, "reports.kyverno.io");
        assert_eq!(ar.version, "v1");
        assert_eq!(ar.api_version, "reports.kyverno.io/v1");
        assert_eq!(ar.plural, "ephemeralreports");
        let ar = api_resource(ReportKind::ClusterPolicyReport);
        assert_eq!(
            (ar.group.as_str(), ar.version.as_str(), ar.kind.as_str()),
            ("wgpolicyk8s.io", "v1alpha2", "ClusterPolicyReport")
        );
        assert_eq!(ephemeral_kind(""), ReportKind::ClusterEphemeralReport);
        assert_eq!(ephemeral_kind("ns"), ReportKind::EphemeralReport);
    }
}
