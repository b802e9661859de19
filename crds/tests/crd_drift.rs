//! Generated CRDs must match the upstream ones in everything a client can observe: names,
//! scope, printer columns and the structure of the schema (fields, types, formats, enums,
//! required lists, list/map markers). Descriptions are free text and are not compared.

use std::collections::BTreeMap;
use std::path::PathBuf;

use reports_server_crds::catalog::ALL;
use reports_server_crds::crd::crd_for;
use serde_json::Value;

fn upstream(crd_name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("upstream")
        .join(format!(
            "{}_{}.yaml",
            crd_name.split_once('.').unwrap().1,
            crd_name.split_once('.').unwrap().0
        ));
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap()
}

/// Flattens a schema into `path -> structural facts`, ignoring descriptions.
fn facts(schema: &Value, path: &str, out: &mut BTreeMap<String, String>) {
    let Some(map) = schema.as_object() else {
        return;
    };
    let mut fact = Vec::new();
    for key in [
        "type",
        "format",
        "enum",
        "required",
        "x-kubernetes-map-type",
        "x-kubernetes-list-type",
        "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-int-or-string",
    ] {
        if let Some(v) = map.get(key) {
            let v = if key == "required" {
                let mut r: Vec<String> = v
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s.as_str().unwrap().to_owned())
                    .collect();
                r.sort();
                serde_json::to_string(&r).unwrap()
            } else {
                v.to_string()
            };
            fact.push(format!("{key}={v}"));
        }
    }
    out.insert(path.to_owned(), fact.join(" "));
    if let Some(props) = map.get("properties").and_then(Value::as_object) {
        for (name, sub) in props {
            facts(sub, &format!("{path}.{name}"), out);
        }
    }
    if let Some(items) = map.get("items") {
        facts(items, &format!("{path}[]"), out);
    }
    if let Some(ap) = map.get("additionalProperties") {
        facts(ap, &format!("{path}{{}}"), out);
    }
}

#[test]
fn generated_crds_match_upstream() {
    let mut failures = Vec::new();
    for desc in ALL.iter() {
        let ours = serde_json::to_value(crd_for(desc)).unwrap();
        let theirs = upstream(&desc.crd_name());
        for pointer in [
            "/spec/group",
            "/spec/names",
            "/spec/scope",
            "/spec/versions/0/name",
        ] {
            let (a, b) = (ours.pointer(pointer), theirs.pointer(pointer));
            if a != b {
                failures.push(format!(
                    "{}: {pointer}: ours {a:?} upstream {b:?}",
                    desc.crd_name()
                ));
            }
        }
        let columns = |v: &Value| {
            v.pointer("/spec/versions/0/additionalPrinterColumns")
                .cloned()
        };
        if columns(&ours) != columns(&theirs) {
            failures.push(format!(
                "{}: printer columns differ:\n ours     {}\n upstream {}",
                desc.crd_name(),
                columns(&ours).unwrap_or_default(),
                columns(&theirs).unwrap_or_default()
            ));
        }
        let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
        facts(
            ours.pointer("/spec/versions/0/schema/openAPIV3Schema")
                .unwrap(),
            "",
            &mut a,
        );
        facts(
            theirs
                .pointer("/spec/versions/0/schema/openAPIV3Schema")
                .unwrap(),
            "",
            &mut b,
        );
        for key in a
            .keys()
            .chain(b.keys())
            .collect::<std::collections::BTreeSet<_>>()
        {
            if a.get(key) != b.get(key) {
                failures.push(format!(
                    "{}: schema{key}: ours {:?} upstream {:?}",
                    desc.crd_name(),
                    a.get(key),
                    b.get(key)
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "generated CRDs drift from upstream:\n{}",
        failures.join("\n")
    );
}

/// The committed `crds/generated/crds.yaml` must be what the code generates now.
#[test]
fn committed_crd_yaml_is_fresh() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("generated/crds.yaml");
    let generated = reports_server_crds::crd::all_crds_yaml();
    if std::env::var_os("UPDATE_GENERATED").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is stale: run `cargo run -- crds > crds/generated/crds.yaml` (or UPDATE_GENERATED=1 cargo test -p reports-server-crds) and commit it",
        path.display()
    );
}

/// The committed `crds/generated/reportsserver.yaml` (the operator's own CRD) must be what the
/// Rust types generate now.
#[test]
fn committed_reportsserver_crd_yaml_is_fresh() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("generated/reportsserver.yaml");
    let generated = reports_server_crds::reportsserver::crd_yaml();
    if std::env::var_os("UPDATE_GENERATED").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is stale: run `UPDATE_GENERATED=1 cargo test -p reports-server-crds --test crd_drift` and commit it",
        path.display()
    );
}
