//! OpenAPI v3 documents (`/openapi/v3` and `/openapi/v3/apis/{group}/{version}`), generated from
//! the same schemas as the CRDs, so `kubectl explain`, client-side validation and
//! `kubectl apply --server-side` see exactly what they would see for CRD-backed kinds.
//! `/openapi/v2` answers 404, which kube-aggregator and kubectl treat as "no v2 spec".

use std::sync::OnceLock;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ListMeta, ObjectMeta};
use reports_server_crds::catalog::{self, GROUP_VERSIONS, ResourceDescriptor};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

/// `io.wgpolicyk8s.v1alpha2.PolicyReport`: reversed group, version, kind — the naming
/// kube-apiserver uses for CRD schemas.
pub fn schema_name(d: &ResourceDescriptor, kind: &str) -> String {
    let reversed: Vec<&str> = d.group.split('.').rev().collect();
    format!("{}.{}.{kind}", reversed.join("."), d.version)
}

const REF_PREFIX: &str = "#/components/schemas/";

fn meta_definitions() -> (Map<String, Value>, Value, Value) {
    let mut generator = schemars::generate::SchemaSettings::openapi3().into_generator();
    let object_meta = generator.subschema_for::<ObjectMeta>().to_value();
    let list_meta = generator.subschema_for::<ListMeta>().to_value();
    let defs: Map<String, Value> = generator.take_definitions(true).into_iter().collect();
    (defs, object_meta, list_meta)
}

fn query_parameter(name: &str, ty: &str) -> Value {
    json!({"name": name, "in": "query", "schema": {"type": ty}, "uniqueItems": true})
}

fn operation(
    id: &str,
    d: &ResourceDescriptor,
    action: &str,
    schema_ref: &str,
    params: &[&str],
) -> Value {
    json!({
        "operationId": id,
        "tags": [format!("{}_{}", d.group, d.version)],
        "parameters": params.iter().map(|p| query_parameter(p, if matches!(*p, "limit" | "timeoutSeconds") { "integer" } else if matches!(*p, "watch" | "allowWatchBookmarks" | "sendInitialEvents") { "boolean" } else { "string" })).collect::<Vec<_>>(),
        "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": {"$ref": format!("{REF_PREFIX}{schema_ref}")}}}}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": d.group, "version": d.version, "kind": d.kind},
    })
}

fn paths_for(d: &ResourceDescriptor) -> Vec<(String, Value)> {
    let kind_ref = schema_name(d, d.kind);
    let list_ref = schema_name(d, d.list_kind);
    let list_params = [
        "labelSelector",
        "fieldSelector",
        "limit",
        "continue",
        "resourceVersion",
        "resourceVersionMatch",
        "timeoutSeconds",
        "watch",
        "allowWatchBookmarks",
        "sendInitialEvents",
    ];
    let write_params = ["dryRun", "fieldManager", "fieldValidation"];
    let patch_params = ["dryRun", "fieldManager", "fieldValidation", "force"];
    let base = if d.namespaced {
        format!(
            "/apis/{}/{}/namespaces/{{namespace}}/{}",
            d.group, d.version, d.plural
        )
    } else {
        format!("/apis/{}/{}/{}", d.group, d.version, d.plural)
    };
    let op = |verb: &str| format!("{verb}{}{}", d.group.replace('.', "_"), d.kind);
    let mut paths = vec![
        (
            base.clone(),
            json!({
                "get": operation(&op("list"), d, "list", &list_ref, &list_params),
                "post": operation(&op("create"), d, "post", &kind_ref, &write_params),
                "delete": operation(&op("deletecollection"), d, "deletecollection", &list_ref, &["labelSelector", "fieldSelector", "dryRun"]),
            }),
        ),
        (
            format!("{base}/{{name}}"),
            json!({
                "get": operation(&op("read"), d, "get", &kind_ref, &[]),
                "put": operation(&op("replace"), d, "put", &kind_ref, &write_params),
                "patch": operation(&op("patch"), d, "patch", &kind_ref, &patch_params),
                "delete": operation(&op("delete"), d, "delete", &kind_ref, &["dryRun"]),
            }),
        ),
    ];
    if d.namespaced {
        paths.push((
            format!("/apis/{}/{}/{}", d.group, d.version, d.plural),
            json!({"get": operation(&op("listAllNamespaces"), d, "list", &list_ref, &list_params)}),
        ));
    }
    paths
}

/// The document of one group-version.
pub fn group_version_document(group: &str, version: &str) -> Option<Value> {
    GROUP_VERSIONS
        .iter()
        .find(|(g, v)| *g == group && *v == version)?;
    let (defs, object_meta, list_meta) = meta_definitions();
    let mut schemas: Map<String, Value> = defs;
    let mut paths = Map::new();
    for d in catalog::resources_of(group, version) {
        let gvk = |kind: &str| json!([{"group": d.group, "version": d.version, "kind": kind}]);
        let mut schema = d.schema();
        schema["properties"]["metadata"] = object_meta.clone();
        schema["x-kubernetes-group-version-kind"] = gvk(d.kind);
        schemas.insert(schema_name(d, d.kind), schema);
        schemas.insert(
            schema_name(d, d.list_kind),
            json!({
                "description": format!("{} is a list of {}", d.list_kind, d.kind),
                "type": "object",
                "required": ["items"],
                "properties": {
                    "apiVersion": {"type": "string", "description": "APIVersion defines the versioned schema of this representation of an object."},
                    "kind": {"type": "string", "description": "Kind is a string value representing the REST resource this object represents."},
                    "metadata": list_meta.clone(),
                    "items": {"type": "array", "items": {"$ref": format!("{REF_PREFIX}{}", schema_name(d, d.kind))}},
                },
                "x-kubernetes-group-version-kind": gvk(d.list_kind),
            }),
        );
        for (p, item) in paths_for(d) {
            paths.insert(p, item);
        }
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "reports-server", "version": env!("CARGO_PKG_VERSION")},
        "paths": paths,
        "components": {"schemas": schemas},
    }))
}

struct Documents {
    index: Value,
    by_path: Vec<(String, String, String)>,
}

fn documents() -> &'static Documents {
    static DOCS: OnceLock<Documents> = OnceLock::new();
    DOCS.get_or_init(|| {
        let mut index = Map::new();
        let mut by_path = Vec::new();
        for (g, v) in GROUP_VERSIONS {
            let doc = group_version_document(g, v)
                .expect("served group-version")
                .to_string();
            let hash = hex::encode(&Sha256::digest(doc.as_bytes())[..16]).to_uppercase();
            let key = format!("apis/{g}/{v}");
            index.insert(
                key.clone(),
                json!({"serverRelativeURL": format!("/openapi/v3/{key}?hash={hash}")}),
            );
            by_path.push((key, doc, hash));
        }
        Documents {
            index: json!({"paths": index}),
            by_path,
        }
    })
}

/// The `/openapi/v3` index.
pub fn index() -> &'static Value {
    &documents().index
}

/// The serialized document at `/openapi/v3/{path}` and its ETag hash.
pub fn document(path: &str) -> Option<(&'static str, &'static str)> {
    documents()
        .by_path
        .iter()
        .find(|(k, _, _)| k == path.trim_matches('/'))
        .map(|(_, d, h)| (d.as_str(), h.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_carry_gvk_and_resolvable_refs() {
        let doc = group_version_document("wgpolicyk8s.io", "v1alpha2").unwrap();
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        let polr = &schemas["io.wgpolicyk8s.v1alpha2.PolicyReport"];
        assert_eq!(
            polr["x-kubernetes-group-version-kind"][0]["kind"],
            "PolicyReport"
        );
        let text = doc.to_string();
        for (i, _) in text.match_indices(REF_PREFIX) {
            let name: String = text[i + REF_PREFIX.len()..]
                .chars()
                .take_while(|c| *c != '"')
                .collect();
            assert!(schemas.contains_key(&name), "unresolved $ref {name}");
        }
        assert!(doc["paths"]["/apis/wgpolicyk8s.io/v1alpha2/namespaces/{namespace}/policyreports/{name}"]["patch"].is_object());
        assert_eq!(index()["paths"].as_object().unwrap().len(), 3);
    }
}
