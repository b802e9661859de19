//! Scenarios checked against what kube-apiserver records for a custom resource, and properties
//! of apply.

use proptest::prelude::*;
use reports_server_crds::catalog::POLICY_REPORT;
use serde_json::{Value, json};

use super::*;

const AV: &str = "wgpolicyk8s.io/v1alpha2";

fn kind() -> &'static KindSchema {
    KindSchema::of(&POLICY_REPORT)
}

fn empty() -> Value {
    empty_object(AV, "PolicyReport")
}

fn writer<'a>(manager: &'a str, now: &'a str) -> Writer<'a> {
    Writer {
        manager,
        api_version: AV,
        now,
    }
}

fn apply_at(
    live: Option<&Value>,
    config: &Value,
    manager: &str,
    force: bool,
    now: &str,
) -> Result<Value, FieldManagerError> {
    let plan = ApplyPlan::begin(kind(), live, &empty(), config, &writer(manager, now))?;
    let mut merged = plan.merged().clone();
    // The server fields a create gets, as objects.rs sets them.
    if live.is_none() {
        merged["metadata"]["uid"] = json!("u-1");
        merged["metadata"]["creationTimestamp"] = json!(now);
    }
    plan.finish(merged, config, force)
}

fn apply(live: Option<&Value>, config: &Value, manager: &str) -> Result<Value, FieldManagerError> {
    apply_at(live, config, manager, false, "2024-05-01T10:00:00Z")
}

fn config(extra: Value) -> Value {
    let mut c = json!({"apiVersion": AV, "kind": "PolicyReport", "metadata": {"name": "r", "namespace": "ns"}});
    if let (Some(c), Value::Object(extra)) = (c.as_object_mut(), extra) {
        for (k, v) in extra {
            if k == "metadata" {
                for (mk, mv) in v.as_object().unwrap() {
                    c["metadata"][mk] = mv.clone();
                }
            } else {
                c.insert(k, v);
            }
        }
    }
    c
}

fn entries(object: &Value) -> Vec<(String, String, Value)> {
    object["metadata"]["managedFields"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|e| {
                    (
                        e["manager"].as_str().unwrap().to_owned(),
                        e["operation"].as_str().unwrap().to_owned(),
                        e["fieldsV1"].clone(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn create_gives_the_creator_every_field_as_kube_apiserver_records_it() {
    let mut new = config(json!({
        "metadata": {"uid": "u", "creationTimestamp": "2024-01-01T00:00:00Z", "generation": 1,
            "labels": {"app": "a"}, "finalizers": ["f"]},
        "scope": {"kind": "Pod", "name": "p"},
        "summary": {"pass": 1},
        "results": [{"policy": "p"}]
    }));
    track_update(
        kind(),
        None,
        &mut new,
        &writer("kubectl-create", "2024-01-01T00:00:00Z"),
    );
    assert_eq!(
        new["metadata"]["managedFields"],
        json!([{
            "manager": "kubectl-create", "operation": "Update", "apiVersion": AV,
            "time": "2024-01-01T00:00:00Z", "fieldsType": "FieldsV1",
            "fieldsV1": {
                "f:metadata": {
                    "f:finalizers": {".": {}, "v:\"f\"": {}},
                    "f:labels": {".": {}, "f:app": {}}
                },
                "f:results": {},
                "f:scope": {},
                "f:summary": {".": {}, "f:pass": {}}
            }
        }])
    );
}

#[test]
fn apply_creates_with_one_apply_entry_without_dot_entries() {
    let created = apply(
        None,
        &config(json!({"metadata": {"labels": {"app": "a"}}, "summary": {"pass": 1, "fail": 0}})),
        "kubectl",
    )
    .unwrap();
    assert_eq!(created["summary"], json!({"pass": 1, "fail": 0}));
    assert_eq!(
        entries(&created),
        [(
            "kubectl".into(),
            "Apply".into(),
            json!({"f:metadata": {"f:labels": {"f:app": {}}}, "f:summary": {"f:fail": {}, "f:pass": {}}})
        )]
    );
    assert_eq!(
        created["metadata"]["managedFields"][0]["time"],
        "2024-05-01T10:00:00Z"
    );
}

#[test]
fn reapplying_the_same_configuration_changes_nothing_not_even_the_time() {
    let c = config(json!({"summary": {"pass": 1}}));
    let first = apply(None, &c, "kubectl").unwrap();
    let second = apply_at(Some(&first), &c, "kubectl", false, "2030-01-01T00:00:00Z").unwrap();
    assert_eq!(second, first);
}

#[test]
fn a_second_manager_conflicts_and_force_takes_the_field() {
    let first = apply(
        None,
        &config(json!({"summary": {"pass": 1, "fail": 2}})),
        "kubectl",
    )
    .unwrap();
    let err = apply(
        Some(&first),
        &config(json!({"summary": {"pass": 5}})),
        "other",
    )
    .unwrap_err();
    assert_eq!(
        err,
        FieldManagerError::Conflicts(vec![Conflict {
            manager: "\"kubectl\"".into(),
            field: ".summary.pass".into(),
            path: vec![
                fieldset::PathElement::Field("summary".into()),
                fieldset::PathElement::Field("pass".into())
            ],
        }])
    );
    assert_eq!(
        err.to_string(),
        "Apply failed with 1 conflict: conflict with \"kubectl\": .summary.pass"
    );
    // The same value is shared ownership, not a conflict.
    let shared = apply(
        Some(&first),
        &config(json!({"summary": {"pass": 1}})),
        "other",
    )
    .unwrap();
    assert_eq!(entries(&shared).len(), 2);

    let forced = apply_at(
        Some(&first),
        &config(json!({"summary": {"pass": 5}})),
        "other",
        true,
        "2024-05-01T11:00:00Z",
    )
    .unwrap();
    assert_eq!(forced["summary"], json!({"pass": 5, "fail": 2}));
    assert_eq!(
        entries(&forced),
        [
            (
                "kubectl".into(),
                "Apply".into(),
                json!({"f:summary": {"f:fail": {}}})
            ),
            (
                "other".into(),
                "Apply".into(),
                json!({"f:summary": {"f:pass": {}}})
            ),
        ]
    );
}

#[test]
fn fields_no_longer_applied_are_removed_unless_someone_else_owns_them() {
    let c1 = config(
        json!({"metadata": {"labels": {"a": "1", "b": "2"}}, "summary": {"pass": 1, "fail": 2}}),
    );
    let first = apply(None, &c1, "kubectl").unwrap();
    // "other" shares summary.fail.
    let shared = apply(
        Some(&first),
        &config(json!({"summary": {"fail": 2}})),
        "other",
    )
    .unwrap();
    let c2 = config(json!({"metadata": {"labels": {"a": "1"}}, "summary": {"pass": 1}}));
    let pruned = apply(Some(&shared), &c2, "kubectl").unwrap();
    assert_eq!(pruned["metadata"]["labels"], json!({"a": "1"}));
    assert_eq!(
        pruned["summary"],
        json!({"pass": 1, "fail": 2}),
        "fail is still owned by other"
    );
    // Dropping every label removes the map; dropping summary leaves what "other" owns.
    let bare = apply(Some(&pruned), &config(json!({})), "kubectl").unwrap();
    assert!(bare["metadata"].get("labels").is_none(), "{bare}");
    assert_eq!(bare["summary"], json!({"fail": 2}));
    assert_eq!(bare["metadata"]["name"], "r");
    assert_eq!(
        bare["metadata"]["uid"], "u-1",
        "server fields are never pruned"
    );
}

#[test]
fn an_update_takes_changed_fields_and_then_conflicts_with_the_applier() {
    let applied = apply(
        None,
        &config(json!({"summary": {"pass": 1, "fail": 0}})),
        "kubectl",
    )
    .unwrap();
    let mut put = applied.clone();
    put["summary"]["pass"] = json!(7);
    track_update(
        kind(),
        Some(&applied),
        &mut put,
        &writer("putter", "2024-05-01T12:00:00Z"),
    );
    assert_eq!(
        entries(&put),
        [
            (
                "kubectl".into(),
                "Apply".into(),
                json!({"f:summary": {"f:fail": {}}})
            ),
            (
                "putter".into(),
                "Update".into(),
                json!({"f:summary": {"f:pass": {}}})
            ),
        ]
    );
    let err = apply(
        Some(&put),
        &config(json!({"summary": {"pass": 1, "fail": 0}})),
        "kubectl",
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("Apply failed with 1 conflict: conflict with \"putter\" using {AV}: .summary.pass")
    );
    // Removing a field removes it from its owners.
    let mut removed = put.clone();
    removed["summary"].as_object_mut().unwrap().remove("fail");
    track_update(
        kind(),
        Some(&put),
        &mut removed,
        &writer("putter", "2024-05-01T12:00:00Z"),
    );
    assert_eq!(
        entries(&removed),
        [(
            "putter".into(),
            "Update".into(),
            json!({"f:summary": {"f:pass": {}}})
        )]
    );
}

#[test]
fn managed_fields_sent_by_a_client_replace_or_clear_the_stored_ones() {
    let applied = apply(None, &config(json!({"summary": {"pass": 1}})), "kubectl").unwrap();
    // Absent: kept.
    let mut put = applied.clone();
    put["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("managedFields");
    track_update(
        kind(),
        Some(&applied),
        &mut put,
        &writer("x", "2024-05-01T12:00:00Z"),
    );
    assert_eq!(
        put["metadata"]["managedFields"],
        applied["metadata"]["managedFields"]
    );
    // Empty list: cleared, and the update itself is not tracked.
    let mut cleared = applied.clone();
    cleared["metadata"]["managedFields"] = json!([]);
    cleared["summary"]["pass"] = json!(2);
    track_update(
        kind(),
        Some(&applied),
        &mut cleared,
        &writer("x", "2024-05-01T12:00:00Z"),
    );
    assert!(cleared["metadata"].get("managedFields").is_none());
    // Untracked objects stay untracked on update...
    let mut again = cleared.clone();
    again["summary"]["pass"] = json!(3);
    track_update(
        kind(),
        Some(&cleared),
        &mut again,
        &writer("x", "2024-05-01T12:00:00Z"),
    );
    assert!(again["metadata"].get("managedFields").is_none());
    // ... and their first apply hands what exists to before-first-apply.
    let first = apply(
        Some(&again),
        &config(json!({"summary": {"pass": 4}})),
        "kubectl",
    )
    .unwrap_err();
    assert!(
        first.to_string().contains("\"before-first-apply\" using"),
        "{first}"
    );
    // Different, valid entries: taken.
    let mut rewritten = applied.clone();
    rewritten["metadata"]["managedFields"][0]["manager"] = json!("renamed");
    track_update(
        kind(),
        Some(&applied),
        &mut rewritten,
        &writer("x", "2024-05-01T12:00:00Z"),
    );
    assert_eq!(entries(&rewritten)[0].0, "renamed");
    // Invalid entries: ignored in favour of the stored ones.
    let mut invalid = applied.clone();
    invalid["metadata"]["managedFields"][0]["operation"] = json!("Patch");
    track_update(
        kind(),
        Some(&applied),
        &mut invalid,
        &writer("x", "2024-05-01T12:00:00Z"),
    );
    assert_eq!(
        invalid["metadata"]["managedFields"],
        applied["metadata"]["managedFields"]
    );
}

#[test]
fn keyed_and_set_lists_are_owned_item_by_item() {
    let owner = |uid: &str| json!({"apiVersion": "v1", "kind": "Pod", "name": uid, "uid": uid});
    let a = apply(
        None,
        &config(json!({"metadata": {"finalizers": ["a"], "ownerReferences": [owner("1")]}})),
        "one",
    )
    .unwrap();
    let b = apply(
        Some(&a),
        &config(json!({"metadata": {"finalizers": ["b"], "ownerReferences": [owner("2")]}})),
        "two",
    )
    .unwrap();
    assert_eq!(b["metadata"]["finalizers"], json!(["a", "b"]));
    assert_eq!(
        b["metadata"]["ownerReferences"].as_array().unwrap().len(),
        2
    );
    let c = apply(Some(&b), &config(json!({})), "one").unwrap();
    assert_eq!(c["metadata"]["finalizers"], json!(["b"]));
    assert_eq!(c["metadata"]["ownerReferences"], json!([owner("2")]));
    assert_eq!(
        entries(&c),
        [(
            "two".into(),
            "Apply".into(),
            json!({"f:metadata": {"f:finalizers": {"v:\"b\"": {}}, "f:ownerReferences": {"k:{\"uid\":\"2\"}": {}}}})
        )]
    );
}

#[test]
fn conflicts_with_several_managers_are_listed_per_manager() {
    let a = apply(None, &config(json!({"summary": {"pass": 1}})), "a").unwrap();
    let b = apply(
        Some(&a),
        &config(json!({"summary": {"fail": 1}, "metadata": {"labels": {"x": "1"}}})),
        "b",
    )
    .unwrap();
    let err = apply(
        Some(&b),
        &config(json!({"summary": {"pass": 2, "fail": 2}, "metadata": {"labels": {"x": "2"}}})),
        "c",
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "Apply failed with 3 conflicts: conflicts with \"a\":\n- .summary.pass\nconflicts with \"b\":\n- .metadata.labels.x\n- .summary.fail"
    );
}

#[test]
fn kubectl_takes_over_its_client_side_apply_fields_without_force() {
    // `kubectl apply` (client-side) created the object and recorded what it applied.
    let csa = config(json!({"summary": {"pass": 1, "fail": 0}}));
    let mut live = csa.clone();
    live["metadata"]["uid"] = json!("u");
    live["metadata"]["annotations"] = json!({LAST_APPLIED: csa.to_string()});
    track_update(
        kind(),
        None,
        &mut live,
        &writer("kubectl-client-side-apply", "2024-01-01T00:00:00Z"),
    );
    let ssa = config(json!({"summary": {"pass": 2, "fail": 0}}));
    let upgraded = apply(Some(&live), &ssa, "kubectl").unwrap();
    assert_eq!(upgraded["summary"]["pass"], 2);
    let recorded: Value = serde_json::from_str(
        upgraded["metadata"]["annotations"][LAST_APPLIED]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        recorded["summary"]["pass"], 2,
        "the annotation follows the apply"
    );
    // Any other manager still conflicts, and so does kubectl once someone else changed the field.
    assert!(apply(Some(&live), &ssa, "other").is_err());
    let mut edited = live.clone();
    edited["summary"]["pass"] = json!(9);
    track_update(
        kind(),
        Some(&live),
        &mut edited,
        &writer("kubectl-client-side-apply", "2024-01-01T00:00:00Z"),
    );
    assert!(apply(Some(&edited), &ssa, "kubectl").is_err());
}

#[test]
fn manager_names_from_user_agents_and_validation() {
    assert_eq!(
        manager_from_user_agent(Some("kubectl/v1.32.4 (linux/amd64) kubernetes/abc")),
        "kubectl"
    );
    assert_eq!(manager_from_user_agent(Some("kube-rs")), "kube-rs");
    assert_eq!(manager_from_user_agent(None), "unknown");
    assert_eq!(manager_from_user_agent(Some(&"x".repeat(300))).len(), 128);
    assert!(validate_manager("kubectl").is_empty());
    assert_eq!(validate_manager(&"x".repeat(129))[0].1, "FieldValueTooLong");
    assert_eq!(
        validate_manager("a\tb")[0].0,
        "Invalid value: \"a\\tb\": invalid character U+0009 (at position 1)"
    );
}

fn arb_config() -> impl Strategy<Value = Value> {
    let labels = prop::collection::btree_map("[a-c]", "[x-z]", 0..3);
    let summary = prop::collection::btree_map(
        prop::sample::select(vec!["pass", "fail", "warn"]),
        0i64..3,
        0..3,
    );
    let finalizers = prop::collection::btree_set("[f-h]", 0..3);
    let results = prop::option::of(prop::collection::vec("[p-r]", 0..2));
    (labels, summary, finalizers, results).prop_map(|(labels, summary, finalizers, results)| {
        let mut extra = json!({"metadata": {}});
        if !labels.is_empty() {
            extra["metadata"]["labels"] = json!(labels);
        }
        if !finalizers.is_empty() {
            extra["metadata"]["finalizers"] = json!(finalizers);
        }
        if !summary.is_empty() {
            extra["summary"] = json!(summary);
        }
        if let Some(r) = results {
            extra["results"] = json!(r.iter().map(|p| json!({"policy": p})).collect::<Vec<_>>());
        }
        config(extra)
    })
}

proptest! {
    #[test]
    fn applying_twice_is_a_no_op(base in arb_config(), c in arb_config()) {
        let live = apply(None, &base, "base").unwrap();
        if let Ok(once) = apply_at(Some(&live), &c, "me", true, "2024-06-01T00:00:00Z") {
            let twice = apply_at(Some(&once), &c, "me", false, "2024-07-01T00:00:00Z").unwrap();
            prop_assert_eq!(twice, once);
        }
    }

    #[test]
    fn the_sole_owner_applying_nothing_removes_what_it_applied(c in arb_config()) {
        let created = apply(None, &c, "me").unwrap();
        let emptied = apply(Some(&created), &config(json!({})), "me").unwrap();
        prop_assert!(emptied["metadata"].get("managedFields").is_none(), "{}", emptied);
        for field in ["summary", "results"] {
            prop_assert!(emptied.get(field).is_none(), "{} left in {}", field, emptied);
        }
        for field in ["labels", "finalizers"] {
            prop_assert!(emptied["metadata"].get(field).is_none(), "{} left in {}", field, emptied);
        }
        prop_assert_eq!(&emptied["metadata"]["name"], "r");
    }

    #[test]
    fn fields_v1_round_trips(c in arb_config()) {
        let set = walk::field_set(&c, &kind().shape);
        let wire = set.to_fields_v1();
        prop_assert_eq!(fieldset::FieldSet::from_fields_v1(&wire).unwrap(), set);
    }
}
