//! Upstream objects survive a trip through our types unchanged, and bad values are rejected with
//! the path of the offending field.

use reports_server_crds::catalog::{self, ResourceDescriptor};
use reports_server_crds::fixtures::{Subject, pss_ephemeral_report, pss_policy_report};
use serde_json::{Value, json};

fn documents(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(format!(
        "{}/../tests/fixtures/{path}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

fn descriptor_for(object: &Value) -> &'static ResourceDescriptor {
    let api_version = object["apiVersion"].as_str().unwrap();
    let kind = object["kind"].as_str().unwrap();
    catalog::ALL
        .iter()
        .find(|d| d.api_version() == api_version && d.kind == kind)
        .unwrap()
}

#[test]
fn peer_fixtures_round_trip_losslessly() {
    let mut seen = 0;
    for file in [
        "peer/report-1.yaml",
        "peer/report-2.yaml",
        "peer/report-3.yaml",
        "peer/report-4.yaml",
    ] {
        for doc in documents(file) {
            let normalized = descriptor_for(&doc).normalize(&doc).unwrap();
            assert_eq!(normalized, doc, "{file}");
            seen += 1;
        }
    }
    assert!(seen >= 5);
}

#[test]
fn every_field_of_every_kind_round_trips() {
    let reference = json!({"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": "n", "uid": "u",
        "resourceVersion": "7", "fieldPath": "spec.containers[0]"});
    let selector = json!({"matchLabels": {"a": "b"}, "matchExpressions": [{"key": "k", "operator": "In", "values": ["x"]}]});
    let result = json!({
        "source": "kyverno", "policy": "p", "rule": "r", "category": "c", "severity": "high",
        "timestamp": {"seconds": 1700000000, "nanos": 0}, "result": "fail", "scored": false,
        "resources": [reference], "resourceSelector": selector, "message": "",
        "properties": {"process": "admission review", "empty": ""}
    });
    let metadata = json!({"name": "x", "namespace": "n", "labels": {"l": "v"}, "annotations": {"a": "b"},
        "uid": "1f0e0d2c-0000-4000-8000-000000000000", "resourceVersion": "12", "generation": 3,
        "creationTimestamp": "2024-05-01T10:00:00Z", "finalizers": ["f"],
        "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u", "controller": true}]});
    let summary = json!({"pass": 0, "fail": 1, "warn": 0, "error": 0, "skip": 0});
    for desc in catalog::ALL.iter() {
        let mut object =
            json!({"apiVersion": desc.api_version(), "kind": desc.kind, "metadata": metadata});
        match desc.layout {
            catalog::ReportLayout::TopLevel => {
                object["scope"] = reference.clone();
                object["scopeSelector"] = selector.clone();
                object["summary"] = summary.clone();
                object["results"] = json!([result]);
                if desc.group == "openreports.io" {
                    object["source"] = json!("kyverno");
                    object["configuration"] =
                        json!({"limits": {"maxResults": 10, "statusFilter": ["fail"]}});
                }
            }
            catalog::ReportLayout::Spec => {
                object["spec"] = json!({"owner": {"apiVersion": "", "kind": "", "name": "", "uid": ""},
                    "summary": summary, "results": [result]});
            }
        }
        assert_eq!(desc.normalize(&object).unwrap(), object, "{desc:?}");
    }
}

#[test]
fn unknown_fields_are_pruned_like_crd_storage() {
    let object = json!({"apiVersion": "wgpolicyk8s.io/v1alpha2", "kind": "PolicyReport",
        "metadata": {"name": "x"}, "bogus": 1, "summary": {"pass": 1, "extra": true}});
    let normalized = catalog::POLICY_REPORT.normalize(&object).unwrap();
    assert_eq!(
        normalized,
        json!({"apiVersion": "wgpolicyk8s.io/v1alpha2", "kind": "PolicyReport",
        "metadata": {"name": "x"}, "summary": {"pass": 1}})
    );
}

#[test]
fn invalid_values_name_the_field() {
    let object =
        json!({"metadata": {"name": "x"}, "results": [{"policy": "p", "result": "maybe"}]});
    let err = catalog::POLICY_REPORT.normalize(&object).unwrap_err();
    assert_eq!(err.field, "results[0].result");
    assert!(err.message.contains("maybe"), "{}", err.message);

    let err = catalog::POLICY_REPORT
        .normalize(&json!({"summary": {"pass": "many"}}))
        .unwrap_err();
    assert_eq!(err.field, "summary.pass");

    let err = catalog::EPHEMERAL_REPORT
        .normalize(&json!({"metadata": {"name": "x"}}))
        .unwrap_err();
    assert!(err.message.contains("spec"), "{err}");
}

#[test]
fn pss_fixture_is_realistic() {
    let subject = Subject::pod("ns-1", 42);
    let report = serde_json::to_vec(&pss_policy_report(&subject, 1_700_000_000, &[1, 7])).unwrap();
    assert!(
        (5_000..10_000).contains(&report.len()),
        "PSS report is {} bytes",
        report.len()
    );
    let value: Value = serde_json::from_slice(&report).unwrap();
    assert_eq!(
        value["summary"],
        json!({"pass": 17, "fail": 2, "warn": 0, "error": 0, "skip": 0})
    );
    let eph = serde_json::to_value(pss_ephemeral_report(&subject, 1, &[])).unwrap();
    assert_eq!(
        eph["spec"]["owner"],
        json!({"apiVersion": "", "kind": "", "name": "", "uid": ""})
    );
    assert_eq!(catalog::EPHEMERAL_REPORT.normalize(&eph).unwrap(), eph);
}
