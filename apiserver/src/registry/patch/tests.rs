use proptest::prelude::*;
use serde_json::json;

use super::*;

fn ops(value: Value) -> Vec<PatchOperation> {
    serde_json::from_value::<json_patch::Patch>(value)
        .unwrap()
        .0
}

fn limits(max_object_bytes: usize) -> ObjectLimits {
    ObjectLimits { max_object_bytes }
}

/// Each pair of operations nests the document one level deeper with a constant-size patch:
/// `{"a": X}` becomes `{"a": {"a": X}}`.
fn nesting_pairs(pairs: usize) -> Vec<PatchOperation> {
    let mut list = Vec::with_capacity(pairs * 2);
    for _ in 0..pairs {
        list.push(json!({"op": "add", "path": "/b", "value": {}}));
        list.push(json!({"op": "move", "from": "/a", "path": "/b/a"}));
        list.push(json!({"op": "move", "from": "/b", "path": "/a"}));
    }
    ops(Value::Array(list))
}

#[test]
fn a_patch_that_nests_without_end_is_refused_before_the_limit() {
    let mut doc = json!({"a": 1});
    let err =
        apply_json_patch(&mut doc, &nesting_pairs(3_000), &ObjectLimits::default()).unwrap_err();
    let PatchFailure::Invalid(message) = err else {
        panic!("{err:?}")
    };
    assert!(message.contains("levels deep"), "{message}");
    assert!(measure(&doc).depth <= MAX_DEPTH);
}

#[test]
fn nesting_up_to_the_limit_applies() {
    let mut doc = json!({"a": 1});
    apply_json_patch(
        &mut doc,
        &nesting_pairs(MAX_DEPTH - 1),
        &ObjectLimits::default(),
    )
    .unwrap();
    assert_eq!(measure(&doc).depth, MAX_DEPTH);
}

#[test]
fn an_add_whose_value_would_nest_too_deep_is_refused() {
    let mut deep = json!(1);
    for _ in 0..100 {
        deep = json!({ "x": deep });
    }
    let mut doc = json!({"a": {"b": {}}});
    let add = |path: String, value: &Value| {
        ops(json!([
            {"op": "test", "path": "/a/b", "value": {}},
            {"op": "add", "path": path, "value": value}
        ]))
    };
    // 3 levels of path and 100 of value: within the limit.
    apply_json_patch(
        &mut doc,
        &add("/a/b/c".into(), &deep),
        &ObjectLimits::default(),
    )
    .unwrap();
    let mut doc = json!({"a": {"b": {}}});
    let beyond = format!("/a/b{}", "/x".repeat(40));
    let err =
        apply_json_patch(&mut doc, &add(beyond, &deep), &ObjectLimits::default()).unwrap_err();
    assert!(
        matches!(err, PatchFailure::Invalid(ref m) if m.contains("operation 1 (add)") && m.contains("142 levels")),
        "{err:?}"
    );
}

#[test]
fn doubling_copies_stop_at_the_budget() {
    let mut doc = json!({"a": "x".repeat(1000)});
    let mut list = Vec::new();
    for i in 0..40 {
        // Each copy takes the whole document so far: its size doubles every time.
        list.push(json!({"op": "copy", "from": "", "path": format!("/c{i}")}));
    }
    let err = apply_json_patch(&mut doc, &ops(Value::Array(list)), &limits(1 << 20)).unwrap_err();
    assert!(
        matches!(err, PatchFailure::TooLarge(ref m) if m.contains("copy and move")),
        "{err:?}"
    );
    assert!(measure(&doc).bytes <= 3 << 20);
}

#[test]
fn too_many_operations_are_refused_before_any_is_applied() {
    let list: Vec<Value> = (0..=MAX_JSON_PATCH_OPERATIONS)
        .map(|_| json!({"op": "test", "path": "/a", "value": 1}))
        .collect();
    let mut doc = json!({"a": 1});
    let err =
        apply_json_patch(&mut doc, &ops(Value::Array(list)), &ObjectLimits::default()).unwrap_err();
    assert!(
        matches!(err, PatchFailure::TooLarge(ref m) if m.contains("10000")),
        "{err:?}"
    );
}

#[test]
fn a_result_over_the_object_limit_is_refused() {
    let mut doc = json!({"a": 1});
    let big = "y".repeat(2_000);
    let err = apply_json_patch(
        &mut doc,
        &ops(json!([{"op": "add", "path": "/b", "value": big}])),
        &limits(1_000),
    )
    .unwrap_err();
    assert!(matches!(err, PatchFailure::TooLarge(_)), "{err:?}");
    let mut doc = json!({"a": 1});
    let err =
        apply_merge_patch(&mut doc, &json!({"b": "z".repeat(2_000)}), &limits(1_000)).unwrap_err();
    assert!(matches!(err, PatchFailure::TooLarge(_)), "{err:?}");
}

#[test]
fn failures_name_the_operation_and_path() {
    let mut doc = json!({"a": 1});
    let err = apply_json_patch(
        &mut doc,
        &ops(json!([
            {"op": "test", "path": "/a", "value": 1},
            {"op": "remove", "path": "/missing"}
        ])),
        &ObjectLimits::default(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "the JSON patch could not be applied: operation 1 (remove) failed at path '/missing': path is invalid"
    );
}

#[test]
fn measure_has_no_recursion_limit() {
    let mut deep = Value::Null;
    for _ in 0..200_000 {
        deep = Value::Array(vec![deep]);
    }
    assert_eq!(measure(&deep).depth, 200_000);
    // Dropping a document this deep would recurse as deep: take it apart level by level.
    while let Value::Array(mut items) = deep {
        deep = items.pop().unwrap_or(Value::Null);
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        "[a-z0-9 ]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-c]{1,2}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn pointer() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof!["[a-c]{1,2}", "[0-2]", Just("-".to_owned())],
        0..3,
    )
    .prop_map(|tokens| tokens.iter().map(|t| format!("/{t}")).collect())
}

fn operation() -> impl Strategy<Value = Value> {
    prop_oneof![
        (pointer(), json_value()).prop_map(|(p, v)| json!({"op": "add", "path": p, "value": v})),
        pointer().prop_map(|p| json!({"op": "remove", "path": p})),
        (pointer(), json_value())
            .prop_map(|(p, v)| json!({"op": "replace", "path": p, "value": v})),
        (pointer(), pointer()).prop_map(|(f, p)| json!({"op": "move", "from": f, "path": p})),
        (pointer(), pointer()).prop_map(|(f, p)| json!({"op": "copy", "from": f, "path": p})),
        (pointer(), json_value()).prop_map(|(p, v)| json!({"op": "test", "path": p, "value": v})),
    ]
}

proptest! {
    /// Within the limits the bounded patch is the RFC's: same result, same success.
    #[test]
    fn within_limits_it_is_rfc_6902(doc in json_value(), list in prop::collection::vec(operation(), 0..6)) {
        let operations = ops(Value::Array(list));
        let mut expected = doc.clone();
        // `json_patch::patch` itself panics on some of these (its undo of a failed patch can
        // fail): the oracle is the plain application, as ours is.
        let rfc = json_patch::patch_unsafe(&mut expected, &operations);
        let mut bounded = doc.clone();
        let ours = apply_json_patch(&mut bounded, &operations, &ObjectLimits::default());
        prop_assert_eq!(rfc.is_ok(), ours.is_ok(), "{:?} / {:?}", rfc, ours);
        if ours.is_ok() {
            prop_assert_eq!(bounded, expected);
        }
    }

    /// The measured size is the compact JSON's length for documents without escapes.
    #[test]
    fn measure_is_the_compact_length(doc in json_value()) {
        prop_assert_eq!(measure(&doc).bytes, serde_json::to_string(&doc).unwrap().len());
    }
}
