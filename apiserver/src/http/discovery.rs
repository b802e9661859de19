//! Discovery documents: `/apis` (legacy `APIGroupList` and aggregated v2 with ETag),
//! `/apis/{group}`, `/apis/{group}/{version}`, `/api` and `/version`. None of them touch the
//! database: kube-aggregator's availability probe hits `/apis/{group}/{version}` and must stay
//! cheap and independent of the store.

use reports_server_crds::catalog::{self, GROUP_VERSIONS, ResourceDescriptor};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

pub const VERBS: [&str; 8] = [
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

fn group_json(group: &str, version: &str) -> Value {
    let gv = json!({"groupVersion": format!("{group}/{version}"), "version": version});
    json!({"name": group, "versions": [gv], "preferredVersion": gv})
}

pub fn api_group_list() -> Value {
    json!({
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": GROUP_VERSIONS.iter().map(|(g, v)| group_json(g, v)).collect::<Vec<_>>(),
    })
}

pub fn api_group(group: &str) -> Option<Value> {
    let (g, v) = GROUP_VERSIONS.iter().find(|(g, _)| *g == group)?;
    let mut doc = group_json(g, v);
    doc["kind"] = json!("APIGroup");
    doc["apiVersion"] = json!("v1");
    Some(doc)
}

fn resource_json(d: &ResourceDescriptor) -> Value {
    let mut r = json!({
        "name": d.plural,
        "singularName": d.singular,
        "namespaced": d.namespaced,
        "kind": d.kind,
        "verbs": VERBS,
    });
    if !d.short_names.is_empty() {
        r["shortNames"] = json!(d.short_names);
    }
    if !d.categories.is_empty() {
        r["categories"] = json!(d.categories);
    }
    r
}

pub fn api_resource_list(group: &str, version: &str) -> Option<Value> {
    GROUP_VERSIONS
        .iter()
        .find(|(g, v)| *g == group && *v == version)?;
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": format!("{group}/{version}"),
        "resources": catalog::resources_of(group, version).map(resource_json).collect::<Vec<_>>(),
    }))
}

/// `APIGroupDiscoveryList` (`apidiscovery.k8s.io/{v2,v2beta1}`) and its ETag.
pub fn aggregated(version: &str) -> (Value, String) {
    let groups: Vec<Value> = GROUP_VERSIONS
        .iter()
        .map(|(g, v)| {
            let resources: Vec<Value> = catalog::resources_of(g, v)
                .map(|d| {
                    let mut r = json!({
                        "resource": d.plural,
                        "responseKind": {"group": d.group, "version": d.version, "kind": d.kind},
                        "scope": if d.namespaced { "Namespaced" } else { "Cluster" },
                        "singularResource": d.singular,
                        "verbs": VERBS,
                    });
                    if !d.short_names.is_empty() {
                        r["shortNames"] = json!(d.short_names);
                    }
                    if !d.categories.is_empty() {
                        r["categories"] = json!(d.categories);
                    }
                    r
                })
                .collect();
            json!({"metadata": {"name": g}, "versions": [{"version": v, "resources": resources, "freshness": "Current"}]})
        })
        .collect();
    let doc = json!({"kind": "APIGroupDiscoveryList", "apiVersion": format!("apidiscovery.k8s.io/{version}"), "metadata": {}, "items": groups});
    let etag = hex::encode(&Sha256::digest(doc.to_string().as_bytes())[..16]);
    (doc, format!("\"{etag}\""))
}

/// `/api`: this server has no core group; an empty document keeps clients' discovery happy.
pub fn core_versions() -> Value {
    json!({"kind": "APIVersions", "versions": [], "serverAddressByClientCIDRs": []})
}

pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "36",
        "gitVersion": concat!("v", env!("CARGO_PKG_VERSION"), "+reports-server"),
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "",
        "goVersion": "",
        "compiler": "rustc",
        "platform": format!("{}/{}", std::env::consts::OS, std::env::consts::ARCH),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_list_has_names_and_verbs() {
        let list = api_resource_list("reports.kyverno.io", "v1").unwrap();
        let resources = list["resources"].as_array().unwrap();
        assert_eq!(resources.len(), 2);
        assert_eq!(resources[0]["shortNames"], json!(["ephr"]));
        assert_eq!(resources[0]["categories"], json!(["kyverno"]));
        assert!(api_resource_list("reports.kyverno.io", "v2").is_none());
    }

    #[test]
    fn aggregated_discovery_is_stable() {
        let (doc, etag) = aggregated("v2");
        assert_eq!(doc["items"].as_array().unwrap().len(), 3);
        assert_eq!(aggregated("v2").1, etag);
        assert_eq!(
            doc["items"][0]["versions"][0]["resources"][0]["responseKind"]["kind"],
            "PolicyReport"
        );
    }
}
