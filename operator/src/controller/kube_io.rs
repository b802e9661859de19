//! Small Kubernetes API helpers of the reconciler: server-side apply of dynamic objects,
//! ownership checks and references, Secret reads, deletes that tolerate a missing object.

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Client, Resource, ResourceExt};
use reports_server_crds::reportsserver::ReportsServer;
use serde_json::{Value, json};

use crate::{FIELD_MANAGER, OWNER_ANNOTATION};

/// The API resource of a desired object's `apiVersion`/`kind`.
pub(super) fn api_resource(obj: &Value) -> ApiResource {
    let api_version = obj["apiVersion"].as_str().unwrap_or_default();
    let kind = obj["kind"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let plural = match kind {
        "Service" => "services",
        "ServiceAccount" => "serviceaccounts",
        "Secret" => "secrets",
        "ConfigMap" => "configmaps",
        "Deployment" => "deployments",
        "StatefulSet" => "statefulsets",
        "PodDisruptionBudget" => "poddisruptionbudgets",
        "ClusterRole" => "clusterroles",
        "ClusterRoleBinding" => "clusterrolebindings",
        "Role" => "roles",
        "RoleBinding" => "rolebindings",
        "APIService" => "apiservices",
        "ServiceMonitor" => "servicemonitors",
        other => panic!("desired objects never have kind {other}"),
    };
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

pub(super) fn dynamic_api(client: &Client, obj: &Value) -> Api<DynamicObject> {
    let ar = api_resource(obj);
    match obj["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    }
}

/// Server-side apply with the operator's field manager, taking fields over from others.
pub(super) async fn apply(client: &Client, obj: &Value) -> Result<DynamicObject, kube::Error> {
    tracing::debug!(
        kind = obj["kind"].as_str().unwrap_or(""),
        name = obj["metadata"]["name"].as_str().unwrap_or(""),
        "server-side apply"
    );
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    dynamic_api(client, obj)
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(obj),
        )
        .await
}

pub(super) fn owner_key(rs: &ReportsServer) -> String {
    format!("{}/{}", rs.namespace().unwrap_or_default(), rs.name_any())
}

pub(super) fn is_ours<K: Resource>(obj: &K, rs: &ReportsServer) -> bool {
    obj.meta()
        .annotations
        .as_ref()
        .and_then(|a| a.get(OWNER_ANNOTATION))
        .is_some_and(|o| *o == owner_key(rs))
}

pub(super) async fn get_opt<K>(api: &Api<K>, name: &str) -> Result<Option<K>, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.get_opt(name).await
}

pub(super) fn secret_str(secret: &Secret, key: &str) -> Option<String> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(key).cloned())
        })
}

pub(super) fn owner_reference(rs: &ReportsServer) -> Value {
    json!({
        "apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
        "name": rs.name_any(), "uid": rs.metadata.uid.clone().unwrap_or_default(),
        "controller": true, "blockOwnerDeletion": true,
    })
}

pub(super) async fn delete_ignoring_missing<K>(api: &Api<K>, name: &str) -> Result<(), kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}
