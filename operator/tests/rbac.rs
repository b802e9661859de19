//! What no role of ours may hold, checked on every role the operator ships (install.yaml) or
//! writes (the golden installations): `*` anywhere, Secret read outside the operator's own
//! namespace Role, `escalate`, `impersonate`, or `bind` without `resourceNames`. And the
//! permissions table of docs/operator.md is the one `rbac::permissions_table` renders
//! (`UPDATE_GENERATED=1 cargo test -p reports-server-operator --test rbac` rewrites it).

use std::path::PathBuf;

use reports_server_operator::{manifests, rbac};
use serde::Deserialize;
use serde_json::Value;

fn docs(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|d| Value::deserialize(d).expect("YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn golden(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/golden/{name}.yaml"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every ClusterRole and Role in install.yaml and the golden installations.
fn roles() -> Vec<Value> {
    let mut all = docs(&manifests::install_yaml());
    for name in [
        "sqlite",
        "postgres-managed",
        "postgres-managed-analytics-monitoring",
        "postgres-external",
        "postgres-external-verify-full",
        "external",
    ] {
        all.extend(docs(&golden(name)));
    }
    all.into_iter()
        .filter(|o| o["kind"] == "ClusterRole" || o["kind"] == "Role")
        .collect()
}

fn list(rule: &Value, key: &str) -> Vec<String> {
    rule[key]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// One complaint per rule that breaks a line we hold.
fn violations(role: &Value) -> Vec<String> {
    let kind = role["kind"].as_str().unwrap_or_default();
    let name = role["metadata"]["name"].as_str().unwrap_or_default();
    let namespace = role["metadata"]["namespace"].as_str();
    let operator_namespace_role =
        kind == "Role" && name == manifests::NAME && namespace == Some(manifests::NAMESPACE);
    let mut out = Vec::new();
    for rule in role["rules"].as_array().into_iter().flatten() {
        let (groups, resources, verbs) = (
            list(rule, "apiGroups"),
            list(rule, "resources"),
            list(rule, "verbs"),
        );
        let names = list(rule, "resourceNames");
        let at = format!("{kind} {name} ({namespace:?}): {rule}");
        if [&groups, &resources, &verbs]
            .iter()
            .any(|l| l.iter().any(|s| s.contains('*')))
        {
            out.push(format!("`*` in {at}"));
        }
        let reads = verbs
            .iter()
            .any(|v| ["get", "list", "watch"].contains(&v.as_str()));
        if groups.iter().any(String::is_empty)
            && resources.iter().any(|r| r == "secrets")
            && reads
            && !operator_namespace_role
        {
            out.push(format!("Secret read in {at}"));
        }
        for verb in ["escalate", "impersonate"] {
            if verbs.iter().any(|v| v == verb) {
                out.push(format!("`{verb}` in {at}"));
            }
        }
        if verbs.iter().any(|v| v == "bind") && names.is_empty() {
            out.push(format!("`bind` without resourceNames in {at}"));
        }
    }
    out
}

#[test]
fn no_role_of_ours_holds_wildcards_secret_read_escalate_or_unnamed_bind() {
    let roles = roles();
    assert!(
        roles.len() >= 8,
        "the shipped and written roles were not all found: {}",
        roles.len()
    );
    let found: Vec<String> = roles.iter().flat_map(violations).collect();
    assert!(found.is_empty(), "{found:#?}");
}

#[test]
fn the_checks_catch_what_they_are_for() {
    let bad = serde_json::json!({"kind": "ClusterRole", "metadata": {"name": "x"}, "rules": [
        {"apiGroups": ["*"], "resources": ["*"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"]},
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"], "verbs": ["escalate", "bind"]},
    ]});
    let found = violations(&bad);
    for what in ["`*`", "Secret read", "`escalate`", "`bind` without"] {
        assert!(
            found.iter().any(|f| f.starts_with(what)),
            "{what}: {found:#?}"
        );
    }
}

#[test]
fn the_server_may_read_every_policy_kind_the_merge_watches() {
    let core = rbac::server_core_rules();
    for kind in reports_server_aggregator::POLICY_KINDS {
        let plural = format!("{}ies", kind.kind.to_lowercase().trim_end_matches('y'));
        assert!(
            core.iter()
                .any(|r| r.api_groups.iter().any(|g| g == kind.group)
                    && r.resources.contains(&plural)
                    && r.verbs.iter().any(|v| v == "watch")),
            "{} {plural} is not in {}",
            kind.group,
            rbac::SERVER_CORE_ROLE
        );
    }
    assert_eq!(
        rbac::POLICY_RESOURCES.len(),
        reports_server_aggregator::POLICY_KINDS.len()
    );
}

#[test]
fn the_permissions_table_in_the_docs_is_fresh() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/operator.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let (begin, end) = ("<!-- permissions:begin -->\n", "<!-- permissions:end -->");
    let start = text.find(begin).expect("the begin marker") + begin.len();
    let stop = text.find(end).expect("the end marker");
    let table = rbac::permissions_table();
    if std::env::var_os("UPDATE_GENERATED").is_some() {
        let updated = format!("{}{table}{}", &text[..start], &text[stop..]);
        std::fs::write(&path, updated).unwrap();
        return;
    }
    assert_eq!(
        &text[start..stop],
        table,
        "docs/operator.md's permissions table is stale; run `UPDATE_GENERATED=1 cargo test -p reports-server-operator --test rbac`"
    );
}
