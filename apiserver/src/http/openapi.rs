//! OpenAPI v3 documents (`/openapi/v3` and `/openapi/v3/apis/{group}/{version}`) and the
//! Swagger 2.0 document (`/openapi/v2`), generated from the same schemas as the CRDs, so
//! `kubectl explain`, client-side validation and `kubectl apply --server-side` see exactly what
//! they would see for CRD-backed kinds, and kube-aggregator can merge our definitions into the
//! cluster's v2 spec as it does for every aggregated API server.

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

const V2_REF_PREFIX: &str = "#/definitions/";

/// A v3 schema in Swagger 2.0 terms: `#/definitions/` references, no `nullable` (v2 has no
/// null) and no `anyOf`/`oneOf` around a single non-null alternative.
fn v2_schema(v: &Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut out = Map::new();
            for (k, child) in map {
                match k.as_str() {
                    "nullable" => {}
                    "$ref" => {
                        let target = child.as_str().unwrap_or_default();
                        let name = target.strip_prefix(REF_PREFIX).unwrap_or(target);
                        out.insert(k.clone(), json!(format!("{V2_REF_PREFIX}{name}")));
                    }
                    "anyOf" | "oneOf" => {
                        let alternatives: Vec<&Value> = child
                            .as_array()
                            .map(|a| {
                                a.iter()
                                    .filter(|s| {
                                        s.get("type").and_then(Value::as_str) != Some("null")
                                    })
                                    .collect()
                            })
                            .unwrap_or_default();
                        if let [only] = alternatives.as_slice()
                            && let Value::Object(inner) = v2_schema(only)
                        {
                            for (ik, iv) in inner {
                                out.entry(ik).or_insert(iv);
                            }
                        }
                    }
                    "type" => {
                        let ty = match child {
                            Value::Array(types) => types
                                .iter()
                                .find(|t| t.as_str() != Some("null"))
                                .cloned()
                                .unwrap_or(json!("object")),
                            other => other.clone(),
                        };
                        out.insert(k.clone(), ty);
                    }
                    _ => {
                        out.insert(k.clone(), v2_schema(child));
                    }
                }
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(v2_schema).collect()),
        other => other.clone(),
    }
}

/// A v3 operation as a Swagger 2.0 operation: query parameters with inline types, a body
/// parameter for writes, responses with `schema` instead of `content`.
fn v2_operation(method: &str, op: &Value) -> Value {
    let mut out = op.clone();
    let mut params: Vec<Value> = op["parameters"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    json!({
                        "name": p["name"],
                        "in": p["in"],
                        "type": p["schema"]["type"],
                        "uniqueItems": true,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let schema_ref = op["responses"]["200"]["content"]["application/json"]["schema"].clone();
    let schema = v2_schema(&schema_ref);
    let (consumes, body) = match method {
        "post" | "put" => (json!(["*/*"]), Some(schema.clone())),
        "patch" => (
            json!([
                "application/json-patch+json",
                "application/merge-patch+json",
                "application/apply-patch+yaml"
            ]),
            Some(
                json!({"type": "object", "description": "Patch is provided to give a concrete name and type to the Kubernetes PATCH request body."}),
            ),
        ),
        _ => (json!(["*/*"]), None),
    };
    if let Some(body) = body {
        params.insert(
            0,
            json!({"name": "body", "in": "body", "required": true, "schema": body}),
        );
    }
    out["parameters"] = Value::Array(params);
    out["consumes"] = consumes;
    out["produces"] = json!(["application/json", "application/yaml"]);
    out["schemes"] = json!(["https"]);
    let mut responses = json!({"200": {"description": "OK", "schema": schema}});
    if method == "post" || (method == "patch") {
        responses["201"] = json!({"description": "Created", "schema": schema});
    }
    responses["401"] = json!({"description": "Unauthorized"});
    out["responses"] = responses;
    out
}

/// The Swagger 2.0 document of every served kind (`/openapi/v2`): `definitions` with
/// `x-kubernetes-group-version-kind` for the kinds and their lists, and the paths.
pub fn v2_document() -> Value {
    let mut definitions = Map::new();
    let mut paths = Map::new();
    for (g, v) in GROUP_VERSIONS {
        let doc = group_version_document(g, v).expect("served group-version");
        if let Some(schemas) = doc["components"]["schemas"].as_object() {
            for (name, schema) in schemas {
                definitions.insert(name.clone(), v2_schema(schema));
            }
        }
        if let Some(items) = doc["paths"].as_object() {
            for (p, item) in items {
                let mut v2_item = Map::new();
                if let Some(ops) = item.as_object() {
                    for (method, op) in ops {
                        v2_item.insert(method.clone(), v2_operation(method, op));
                    }
                }
                let path_params: Vec<Value> = ["namespace", "name"]
                    .iter()
                    .filter(|n| p.contains(&format!("{{{n}}}")))
                    .map(|n| json!({"name": n, "in": "path", "required": true, "type": "string", "uniqueItems": true}))
                    .collect();
                if !path_params.is_empty() {
                    v2_item.insert("parameters".into(), Value::Array(path_params));
                }
                paths.insert(p.clone(), Value::Object(v2_item));
            }
        }
    }
    json!({
        "swagger": "2.0",
        "info": {"title": "reports-server", "version": env!("CARGO_PKG_VERSION")},
        "paths": paths,
        "definitions": definitions,
    })
}

/// The serialized `/openapi/v2` document and its ETag (quoted, as kube-apiserver sends it).
pub fn v2() -> (&'static str, &'static str) {
    static DOC: OnceLock<(String, String)> = OnceLock::new();
    let (doc, etag) = DOC.get_or_init(|| {
        let doc = v2_document().to_string();
        let hash = hex::encode(&Sha256::digest(doc.as_bytes())[..16]).to_uppercase();
        (doc, format!("\"{hash}\""))
    });
    (doc.as_str(), etag.as_str())
}

/// Whether an `Accept` header admits JSON: kube-aggregator and client-go ask for
/// `application/com.github.proto-openapi.spec.v2@v1.0+protobuf` first and JSON second; the
/// protobuf encoding is not served, so only JSON (or a wildcard) with a non-zero q will do.
pub fn v2_accepts_json(accept: Option<&str>) -> bool {
    let Some(accept) = accept.map(str::trim).filter(|a| !a.is_empty()) else {
        return true;
    };
    accept.split(',').any(|range| {
        let mut parts = range.split(';');
        let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.trim().strip_prefix("q="))
            .find_map(|q| q.trim().parse::<f32>().ok())
            .unwrap_or(1.0);
        q > 0.0 && matches!(media.as_str(), "application/json" | "application/*" | "*/*")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_is_swagger_with_every_kind_and_list() {
        let (text, etag) = v2();
        assert!(etag.starts_with('"') && etag.ends_with('"') && etag.len() == 34);
        let doc: Value = serde_json::from_str(text).expect("valid JSON");
        assert_eq!(doc["swagger"], "2.0");
        let defs = doc["definitions"].as_object().unwrap();
        for d in &catalog::ALL {
            for kind in [d.kind, d.list_kind] {
                let def = &defs[&schema_name(d, kind)];
                assert_eq!(
                    def["x-kubernetes-group-version-kind"][0],
                    json!({"group": d.group, "version": d.version, "kind": kind}),
                    "{kind}"
                );
            }
        }
        for banned in ["#/components/", "\"nullable\"", "\"anyOf\"", "\"oneOf\""] {
            assert!(!text.contains(banned), "{banned} left in the v2 document");
        }
        for (i, _) in text.match_indices(V2_REF_PREFIX) {
            let name: String = text[i + V2_REF_PREFIX.len()..]
                .chars()
                .take_while(|c| *c != '"')
                .collect();
            assert!(defs.contains_key(&name), "unresolved $ref {name}");
        }
        let patch = &doc["paths"]["/apis/wgpolicyk8s.io/v1alpha2/namespaces/{namespace}/policyreports/{name}"]
            ["patch"];
        assert!(
            patch["consumes"]
                .as_array()
                .unwrap()
                .contains(&json!("application/apply-patch+yaml"))
        );
        assert_eq!(
            patch["responses"]["200"]["schema"]["$ref"],
            "#/definitions/io.wgpolicyk8s.v1alpha2.PolicyReport"
        );
    }

    #[test]
    fn v2_accept_negotiation() {
        assert!(v2_accepts_json(None));
        assert!(v2_accepts_json(Some(
            "application/com.github.proto-openapi.spec.v2@v1.0+protobuf, application/json"
        )));
        assert!(v2_accepts_json(Some(
            "application/com.github.proto-openapi.spec.v2.v1.0+protobuf;q=1, */*;q=0.5"
        )));
        assert!(!v2_accepts_json(Some(
            "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"
        )));
        assert!(!v2_accepts_json(Some(
            "application/json;q=0, application/com.github.proto-openapi.spec.v2@v1.0+protobuf"
        )));
    }

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
