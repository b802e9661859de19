//! Input handling of the offline mode: files, directories, lists, errors.

use std::path::PathBuf;

use reports_server_aggregator::{Error, Layout, OfflineOptions, OutputFormat, aggregate_offline};

const EPHEMERAL: &str = r#"
apiVersion: reports.kyverno.io/v1
kind: EphemeralReport
metadata:
  name: 11111111-2222-4333-8444-555555555555-abcde
  namespace: team
  labels:
    app.kubernetes.io/managed-by: kyverno
    audit.kyverno.io/resource.uid: 11111111-2222-4333-8444-555555555555
  ownerReferences:
  - apiVersion: apps/v1
    kind: Deployment
    name: web
    uid: 11111111-2222-4333-8444-555555555555
spec:
  owner: {apiVersion: "", kind: "", name: "", uid: ""}
  results:
  - policy: disallow-host-path
    rule: autogen-host-path
    result: pass
    scored: true
    source: kyverno
    timestamp: {seconds: 10, nanos: 0}
"#;

fn write(dir: &std::path::Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn reads_directories_recursively_and_ignores_other_files() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "a/b/report.yml", EPHEMERAL);
    write(tmp.path(), "notes.txt", "not yaml: [");
    let out = aggregate_offline(&[tmp.path().to_owned()], &[], OfflineOptions::default()).unwrap();
    assert!(out.starts_with("---\napiVersion: wgpolicyk8s.io/v1alpha2\nkind: PolicyReport\n"));
    assert!(out.contains("name: 11111111-2222-4333-8444-555555555555\n"));
    assert!(out.contains("kind: Deployment"));
    assert!(
        !out.contains("EphemeralReport"),
        "consumed ephemerals are not printed"
    );
}

#[test]
fn accepts_lists_and_typed_lists() {
    let tmp = tempfile::tempdir().unwrap();
    let item = EPHEMERAL.replace('\n', "\n    ");
    let list = format!("apiVersion: v1\nkind: List\nitems:\n  - {}\n", item.trim());
    let typed = list
        .replace(
            "apiVersion: v1\nkind: List",
            "apiVersion: reports.kyverno.io/v1\nkind: EphemeralReportList",
        )
        .replace(
            "    apiVersion: reports.kyverno.io/v1\n    kind: EphemeralReport\n",
            "",
        );
    let a = write(tmp.path(), "list.yaml", &list);
    let b = write(tmp.path(), "typed.yaml", &typed);
    let one = aggregate_offline(&[a], &[], OfflineOptions::default()).unwrap();
    let two = aggregate_offline(&[b], &[], OfflineOptions::default()).unwrap();
    assert_eq!(one, two);
    assert!(one.contains("autogen-host-path"));
}

#[test]
fn policies_filter_results_and_per_policy_layout_names_reports() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(tmp.path(), "in.yaml", EPHEMERAL);
    let policy = write(
        tmp.path(),
        "pol.yaml",
        "apiVersion: kyverno.io/v1\nkind: ClusterPolicy\nmetadata: {name: disallow-host-path, resourceVersion: '7'}\nspec:\n  rules:\n  - name: host-path\n    match: {any: [{resources: {kinds: [Pod]}}]}\n    validate: {pattern: {spec: {}}}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: ignored}\n",
    );
    let opts = OfflineOptions {
        layout: Layout::PerPolicy,
        chunk_size: 0,
        output: OutputFormat::Wgpolicy,
    };
    let out = aggregate_offline(std::slice::from_ref(&input), &[policy], opts).unwrap();
    assert!(out.contains("name: cpol-disallow-host-path\n"));
    assert!(out.contains("cpol.kyverno.io/disallow-host-path: '7'"));
    // A policy set without the rule drops the result: nothing to write.
    let other = write(
        tmp.path(),
        "other.yaml",
        "apiVersion: kyverno.io/v1\nkind: ClusterPolicy\nmetadata: {name: disallow-host-path}\nspec:\n  rules:\n  - name: host-path\n    match: {any: [{resources: {kinds: [Namespace]}}]}\n    validate: {pattern: {spec: {}}}\n",
    );
    assert_eq!(aggregate_offline(&[input], &[other], opts).unwrap(), "");
}

#[test]
fn unsupported_kinds_are_errors_with_context() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(
        tmp.path(),
        "bad.yaml",
        &format!("{EPHEMERAL}---\napiVersion: v1\nkind: Pod\nmetadata: {{name: x}}\n"),
    );
    let err = aggregate_offline(&[input], &[], OfflineOptions::default()).unwrap_err();
    assert!(matches!(err, Error::UnsupportedKind { .. }), "{err}");
    assert!(err.to_string().contains("bad.yaml: document 2"), "{err}");
}

#[test]
fn missing_files_and_bad_yaml_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope.yaml");
    assert!(matches!(
        aggregate_offline(&[missing], &[], OfflineOptions::default()),
        Err(Error::Io { .. })
    ));
    let bad = write(tmp.path(), "bad.yaml", "kind: [unclosed\n");
    assert!(matches!(
        aggregate_offline(&[bad], &[], OfflineOptions::default()),
        Err(Error::Yaml { .. })
    ));
}

#[test]
fn namespaced_reports_without_namespace_land_in_default() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(
        tmp.path(),
        "in.yaml",
        &EPHEMERAL.replace("  namespace: team\n", ""),
    );
    let out = aggregate_offline(&[input], &[], OfflineOptions::default()).unwrap();
    assert!(out.contains("  namespace: default\n"), "{out}");
}
