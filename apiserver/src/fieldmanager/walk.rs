//! The schema-guided walks over JSON objects: merging an applied configuration into a live
//! object, comparing two objects, listing the fields of an object and removing fields. Their
//! rules are structured-merge-diff's, so ownership comes out as kube-apiserver records it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde_json::{Map, Value};

use super::fieldset::{FieldSet, OrdValue, PathElement, values_equal};
use super::schema::{ListKind, Shape};

/// A list item's identity: its key fields (`k:`) or, for sets, its value (`v:`).
fn item_element(kind: &ListKind, item: &Value) -> Result<PathElement, String> {
    match kind {
        ListKind::Set => match item {
            Value::Object(_) => Err("set lists may not contain maps".into()),
            Value::Array(_) => Err("set lists may not contain lists".into()),
            Value::Null => Err("set lists may not contain null".into()),
            v => Ok(PathElement::Value(OrdValue(v.clone()))),
        },
        ListKind::Map(keys) => {
            let Value::Object(m) = item else {
                return Err("items of a keyed list must be maps".into());
            };
            let mut fields: Vec<(String, OrdValue)> = keys
                .iter()
                .filter_map(|k| m.get(k).map(|v| (k.clone(), OrdValue(v.clone()))))
                .collect();
            if !keys.is_empty() && fields.is_empty() {
                return Err(format!("an item omits all key fields {keys:?}"));
            }
            fields.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(PathElement::Key(fields))
        }
    }
}

/// Items with their identities; duplicates are an error unless allowed (live objects may
/// carry them, an applied configuration may not).
fn index_items<'a>(
    kind: &ListKind,
    items: &'a [Value],
    allow_duplicates: bool,
    path: &str,
) -> Result<(Vec<PathElement>, BTreeMap<PathElement, &'a Value>), String> {
    let mut order = Vec::with_capacity(items.len());
    let mut by_element = BTreeMap::new();
    for (i, item) in items.iter().enumerate() {
        let pe = item_element(kind, item).map_err(|e| format!("{path}: element {i}: {e}"))?;
        if by_element.contains_key(&pe) {
            if !allow_duplicates {
                return Err(format!("{path}: duplicate entries for key {pe}"));
            }
            continue;
        }
        by_element.insert(pe.clone(), item);
        order.push(pe);
    }
    Ok((order, by_element))
}

fn is_empty_map(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Object(m)) => m.is_empty(),
        _ => false,
    }
}

fn is_empty_list(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Array(a)) => a.is_empty(),
        _ => false,
    }
}

/// Merges `config` into `live`: granular maps key by key, granular lists item by item (in the
/// configuration's order, with live-only items kept where they were), everything else replaced.
pub fn merge(live: &Value, config: &Value, shape: &Shape) -> Result<Value, String> {
    Ok(merge_node(Some(live), Some(config), shape, "")?.unwrap_or(Value::Null))
}

fn merge_node(
    lhs: Option<&Value>,
    rhs: Option<&Value>,
    shape: &Shape,
    path: &str,
) -> Result<Option<Value>, String> {
    let Some(r) = rhs else {
        return Ok(lhs.cloned());
    };
    match shape {
        Shape::Leaf => Ok(Some(r.clone())),
        Shape::Struct { .. } => {
            let l = lhs.and_then(Value::as_object);
            if is_empty_map(lhs) && is_empty_map(rhs) {
                return Ok(Some(r.clone()));
            }
            let rm = match r {
                Value::Object(m) => m,
                // A null over a populated map leaves it alone.
                Value::Null => return Ok(lhs.cloned()),
                _ => return Ok(Some(r.clone())),
            };
            let mut out = Map::new();
            if let Some(lm) = l {
                for (k, lv) in lm {
                    let child = format!("{path}.{k}");
                    if let Some(v) = merge_node(Some(lv), rm.get(k), shape.field(k), &child)? {
                        out.insert(k.clone(), v);
                    }
                }
            }
            for (k, rv) in rm {
                if l.is_some_and(|lm| lm.contains_key(k)) {
                    continue;
                }
                let child = format!("{path}.{k}");
                if let Some(v) = merge_node(None, Some(rv), shape.field(k), &child)? {
                    out.insert(k.clone(), v);
                }
            }
            Ok(Some(Value::Object(out)))
        }
        Shape::List { items, kind } => {
            if is_empty_list(lhs) && is_empty_list(rhs) {
                return Ok(Some(r.clone()));
            }
            let ritems = match r {
                Value::Array(a) => a.as_slice(),
                Value::Null => return Ok(lhs.cloned()),
                _ => return Ok(Some(r.clone())),
            };
            let litems = lhs
                .and_then(Value::as_array)
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            let (rorder, rby) = index_items(kind, ritems, false, path)?;
            let (lorder, lby) = index_items(kind, litems, true, path)?;
            let mut shared: VecDeque<&PathElement> =
                rorder.iter().filter(|pe| lby.contains_key(*pe)).collect();
            let mut next_shared = shared.pop_front();
            let mut emitted: BTreeSet<&PathElement> = BTreeSet::new();
            let mut out = Vec::with_capacity(litems.len().max(ritems.len()));
            let push = |pe: &PathElement, out: &mut Vec<Value>| -> Result<(), String> {
                let child = format!("{path}{pe}");
                if let Some(v) =
                    merge_node(lby.get(pe).copied(), rby.get(pe).copied(), items, &child)?
                {
                    out.push(v);
                }
                Ok(())
            };
            let (mut li, mut ri) = (0, 0);
            while li < lorder.len() || ri < rorder.len() {
                if li < lorder.len() && ri < rorder.len() {
                    let pe = &lorder[li];
                    if *pe == rorder[ri] {
                        emitted.insert(pe);
                        push(pe, &mut out)?;
                        li += 1;
                        ri += 1;
                        next_shared = shared.pop_front();
                        continue;
                    }
                    // A live item the configuration places later: it comes out there.
                    if rby.contains_key(pe) && next_shared.is_some_and(|n| n != pe) {
                        li += 1;
                        continue;
                    }
                }
                if li < lorder.len() {
                    let pe = &lorder[li];
                    if !rby.contains_key(pe) {
                        push(pe, &mut out)?;
                        li += 1;
                        continue;
                    } else if emitted.contains(pe) {
                        li += 1;
                    }
                }
                if ri < rorder.len() {
                    let pe = &rorder[ri];
                    emitted.insert(pe);
                    push(pe, &mut out)?;
                    ri += 1;
                    if next_shared == Some(pe) {
                        next_shared = shared.pop_front();
                    }
                }
            }
            Ok(Some(Value::Array(out)))
        }
    }
}

/// What changed between two versions of an object.
#[derive(Clone, Debug, Default)]
pub struct Comparison {
    pub added: FieldSet,
    pub modified: FieldSet,
    pub removed: FieldSet,
}

impl Comparison {
    /// Fields that are new or have a new value.
    pub fn changed(&self) -> FieldSet {
        self.added.union(&self.modified)
    }
}

/// Compares `old` with `new`: leaves that appear, disappear or change value, and granular nodes
/// that appear or disappear.
pub fn compare(old: &Value, new: &Value, shape: &Shape) -> Comparison {
    let mut c = Comparison::default();
    compare_node(Some(old), Some(new), shape, &mut Vec::new(), &mut c);
    c
}

fn compare_leaf(
    lhs: Option<&Value>,
    rhs: Option<&Value>,
    path: &[PathElement],
    c: &mut Comparison,
) {
    match (lhs, rhs) {
        (None, Some(_)) => c.added.insert(path),
        (Some(_), None) => c.removed.insert(path),
        (Some(l), Some(r)) if !values_equal(l, r) => c.modified.insert(path),
        _ => {}
    }
}

fn compare_node(
    lhs: Option<&Value>,
    rhs: Option<&Value>,
    shape: &Shape,
    path: &mut Vec<PathElement>,
    c: &mut Comparison,
) {
    let granular = match shape {
        Shape::Leaf => false,
        Shape::Struct { .. } => {
            let objects = [lhs, rhs]
                .iter()
                .all(|v| matches!(v, None | Some(Value::Null) | Some(Value::Object(_))));
            objects && !(is_empty_map(lhs) && is_empty_map(rhs))
        }
        Shape::List { kind, .. } => {
            let lists = [lhs, rhs]
                .iter()
                .all(|v| matches!(v, None | Some(Value::Null) | Some(Value::Array(_))));
            lists
                && !(is_empty_list(lhs) && is_empty_list(rhs))
                && [lhs, rhs].iter().all(|v| {
                    v.and_then(Value::as_array)
                        .is_none_or(|items| items.iter().all(|i| item_element(kind, i).is_ok()))
                })
        }
    };
    if !granular {
        compare_leaf(lhs, rhs, path, c);
        return;
    }
    match shape {
        Shape::Struct { .. } => {
            let empty = Map::new();
            let lm = lhs.and_then(Value::as_object).unwrap_or(&empty);
            let rm = rhs.and_then(Value::as_object).unwrap_or(&empty);
            for (k, lv) in lm {
                path.push(PathElement::Field(k.clone()));
                compare_node(Some(lv), rm.get(k), shape.field(k), path, c);
                path.pop();
            }
            for (k, rv) in rm {
                if !lm.contains_key(k) {
                    path.push(PathElement::Field(k.clone()));
                    compare_node(None, Some(rv), shape.field(k), path, c);
                    path.pop();
                }
            }
        }
        Shape::List { items, kind } => {
            let (lorder, lby) = group_items(kind, lhs);
            let (rorder, rby) = group_items(kind, rhs);
            let mut all = lorder.clone();
            all.extend(rorder.into_iter().filter(|pe| !lby.contains_key(pe)));
            for pe in all {
                let l = lby.get(&pe).map(Vec::as_slice).unwrap_or(&[]);
                let r = rby.get(&pe).map(Vec::as_slice).unwrap_or(&[]);
                path.push(pe);
                match (l.len(), r.len()) {
                    (0..=1, 0..=1) => {
                        compare_node(l.first().copied(), r.first().copied(), items, path, c)
                    }
                    (2.., 2..) => {
                        let same =
                            l.len() == r.len() && l.iter().zip(r).all(|(a, b)| values_equal(a, b));
                        if !same {
                            c.modified.insert(path);
                        }
                    }
                    (2.., _) => {
                        if let Some(first) = r.first() {
                            compare_node(None, Some(first), items, path, c);
                        }
                        c.removed.insert(path);
                    }
                    (_, _) => {
                        if let Some(first) = l.first() {
                            compare_node(Some(first), None, items, path, c);
                        }
                        c.added.insert(path);
                    }
                }
                path.pop();
            }
        }
        Shape::Leaf => unreachable!("leaves are compared above"),
    }
    // A granular node that appears or disappears is itself a changed field (the `.` entries).
    match (lhs, rhs) {
        (None, Some(_)) => c.added.insert(path),
        (Some(_), None) => c.removed.insert(path),
        _ => {}
    }
}

/// List items by identity, in first-appearance order; duplicates kept together.
type Grouped<'a> = (Vec<PathElement>, BTreeMap<PathElement, Vec<&'a Value>>);

fn group_items<'a>(kind: &ListKind, v: Option<&'a Value>) -> Grouped<'a> {
    let mut order: Vec<PathElement> = Vec::new();
    let mut by: BTreeMap<PathElement, Vec<&'a Value>> = BTreeMap::new();
    for item in v.and_then(Value::as_array).into_iter().flatten() {
        let Ok(pe) = item_element(kind, item) else {
            continue;
        };
        let entry = by.entry(pe.clone()).or_default();
        if entry.is_empty() {
            order.push(pe);
        }
        entry.push(item);
    }
    (order, by)
}

/// The fields an object (typically an applied configuration) sets: every leaf, every list item,
/// every key of an additionalProperties map, and fields set to null or `{}`.
pub fn field_set(object: &Value, shape: &Shape) -> FieldSet {
    let mut set = FieldSet::new();
    walk_fields(object, shape, &mut Vec::new(), &mut set);
    set
}

fn walk_fields(v: &Value, shape: &Shape, path: &mut Vec<PathElement>, set: &mut FieldSet) {
    match (shape, v) {
        (Shape::Struct { .. }, Value::Object(m)) => {
            for (k, child) in m {
                path.push(PathElement::Field(k.clone()));
                walk_fields(child, shape.field(k), path, set);
                if child.is_null() || is_empty_map(Some(child)) || !shape.declares(k) {
                    set.insert(path);
                }
                path.pop();
            }
        }
        (Shape::List { items, kind }, Value::Array(list)) => {
            let elements: Vec<Option<PathElement>> =
                list.iter().map(|i| item_element(kind, i).ok()).collect();
            let mut seen = BTreeSet::new();
            let mut duplicated = BTreeSet::new();
            for pe in elements.iter().flatten() {
                if !seen.insert(pe) && duplicated.insert(pe) {
                    path.push(pe.clone());
                    set.insert(path);
                    path.pop();
                }
            }
            for (item, pe) in list.iter().zip(&elements) {
                let Some(pe) = pe else { continue };
                if duplicated.contains(pe) {
                    continue;
                }
                path.push(pe.clone());
                walk_fields(item, items, path, set);
                set.insert(path);
                path.pop();
            }
        }
        (Shape::Struct { .. } | Shape::List { .. }, Value::Null) => {}
        _ => set.insert(path),
    }
}

/// Removes the members of `set` (whole subtrees) from `object`. Maps and lists left empty by the
/// removal disappear too, as kube-apiserver drops the nulls they become.
pub fn remove(object: &Value, shape: &Shape, set: &FieldSet) -> Option<Value> {
    if set.is_empty() {
        return Some(object.clone());
    }
    match (shape, object) {
        (Shape::Struct { .. }, Value::Object(m)) if !m.is_empty() => {
            let mut out = Map::new();
            for (k, v) in m {
                let pe = PathElement::Field(k.clone());
                if set.is_member(&pe) {
                    continue;
                }
                let kept = match set.child(&pe) {
                    Some(sub) => remove(v, shape.field(k), sub),
                    None => Some(v.clone()),
                };
                if let Some(kept) = kept {
                    out.insert(k.clone(), kept);
                }
            }
            (!out.is_empty()).then_some(Value::Object(out))
        }
        (Shape::List { items, kind }, Value::Array(list)) if !list.is_empty() => {
            let mut out = Vec::new();
            for item in list {
                let Ok(pe) = item_element(kind, item) else {
                    out.push(item.clone());
                    continue;
                };
                if set.is_member(&pe) {
                    continue;
                }
                let kept = match set.child(&pe) {
                    Some(sub) => remove(item, items, sub),
                    None => Some(item.clone()),
                };
                out.extend(kept);
            }
            (!out.is_empty()).then_some(Value::Array(out))
        }
        _ => Some(object.clone()),
    }
}

/// Adds, as members, the declared struct fields that have members below them, so that pruning
/// a field's last owned child can remove the field itself.
pub fn with_named_parents(set: &FieldSet, shape: &Shape) -> FieldSet {
    let mut out = FieldSet::new();
    for m in set.members() {
        out.add_member(m.clone());
    }
    for (pe, child) in set.children() {
        let child_shape = match (pe, shape) {
            (PathElement::Field(name), Shape::Struct { .. }) => {
                if shape.declares(name) {
                    out.add_member(pe.clone());
                }
                shape.field(name)
            }
            (PathElement::Key(_) | PathElement::Value(_), Shape::List { items, .. }) => items,
            _ => &Shape::Leaf,
        };
        out.set_child(pe.clone(), with_named_parents(child, child_shape));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fieldmanager::schema::KindSchema;
    use reports_server_crds::catalog::POLICY_REPORT;
    use serde_json::json;

    fn shape() -> &'static Shape {
        &KindSchema::of(&POLICY_REPORT).shape
    }

    fn fields(v: Value) -> Value {
        field_set(&v, shape()).to_fields_v1()
    }

    #[test]
    fn field_sets_of_configurations() {
        assert_eq!(
            fields(json!({
                "apiVersion": "wgpolicyk8s.io/v1alpha2",
                "metadata": {"name": "x", "labels": {"a": "1"}, "finalizers": ["f"],
                    "ownerReferences": [{"uid": "u", "kind": "Pod", "name": "p", "apiVersion": "v1"}]},
                "summary": {"pass": 1},
                "scope": {"kind": "Pod", "name": "p"},
                "results": [{"policy": "p"}]
            })),
            json!({
                "f:apiVersion": {},
                "f:metadata": {
                    "f:finalizers": {"v:\"f\"": {}},
                    "f:labels": {"f:a": {}},
                    "f:name": {},
                    "f:ownerReferences": {"k:{\"uid\":\"u\"}": {}}
                },
                "f:results": {},
                "f:scope": {},
                "f:summary": {"f:pass": {}}
            })
        );
        assert_eq!(
            fields(json!({"summary": {}, "scope": null, "metadata": {"finalizers": []}})),
            json!({"f:scope": {}, "f:summary": {}})
        );
    }

    #[test]
    fn compare_marks_new_granular_nodes() {
        let old = json!({"apiVersion": "v", "kind": "K"});
        let new = json!({"apiVersion": "v", "kind": "K", "metadata": {"labels": {"a": "1"}}, "summary": {"pass": 1}, "results": []});
        let c = compare(&old, &new, shape());
        assert_eq!(
            c.added.to_fields_v1(),
            json!({
                "f:metadata": {".": {}, "f:labels": {".": {}, "f:a": {}}},
                "f:results": {},
                "f:summary": {".": {}, "f:pass": {}}
            })
        );
        let c = compare(
            &new,
            &json!({"apiVersion": "v", "kind": "K", "summary": {"pass": 2}}),
            shape(),
        );
        assert_eq!(
            c.modified.to_fields_v1(),
            json!({"f:summary": {"f:pass": {}}})
        );
        assert!(c.removed.contains(&[PathElement::Field("metadata".into())]));
        assert!(c.removed.contains(&[PathElement::Field("results".into())]));
        assert!(c.added.is_empty());
    }

    #[test]
    fn merge_recurses_into_granular_nodes_and_replaces_atomic_ones() {
        let live = json!({"metadata": {"labels": {"a": "1", "b": "2"}, "finalizers": ["x", "y"]},
            "summary": {"pass": 1, "fail": 2}, "results": [{"policy": "old"}]});
        let config = json!({"metadata": {"labels": {"b": "3"}, "finalizers": ["z", "x"]},
            "summary": {"pass": 5}, "results": [{"policy": "new"}]});
        let merged = merge(&live, &config, shape()).unwrap();
        assert_eq!(
            merged,
            json!({"metadata": {"labels": {"a": "1", "b": "3"}, "finalizers": ["z", "x", "y"]},
                "summary": {"pass": 5, "fail": 2}, "results": [{"policy": "new"}]})
        );
        let dup = json!({"metadata": {"finalizers": ["a", "a"]}});
        assert!(
            merge(&live, &dup, shape())
                .unwrap_err()
                .contains("duplicate")
        );
    }

    #[test]
    fn keyed_list_merge_keeps_live_only_items_in_place() {
        let refs = |uids: &[&str]| json!({"metadata": {"ownerReferences": uids.iter().map(|u| json!({"uid": u, "name": u})).collect::<Vec<_>>()}});
        let merged = merge(&refs(&["a", "b", "c"]), &refs(&["c", "d"]), shape()).unwrap();
        let order: Vec<&str> = merged["metadata"]["ownerReferences"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["uid"].as_str().unwrap())
            .collect();
        assert_eq!(order, ["a", "b", "c", "d"]);
    }

    #[test]
    fn removal_drops_emptied_parents_and_named_parents_are_added() {
        let obj = json!({"metadata": {"name": "x", "labels": {"a": "1"}}, "summary": {"pass": 1}});
        let mut set = FieldSet::new();
        set.insert(&[
            PathElement::Field("metadata".into()),
            PathElement::Field("labels".into()),
            PathElement::Field("a".into()),
        ]);
        set.insert(&[
            PathElement::Field("summary".into()),
            PathElement::Field("pass".into()),
        ]);
        assert_eq!(
            remove(&obj, shape(), &set).unwrap(),
            json!({"metadata": {"name": "x"}})
        );
        let named = with_named_parents(&set, shape());
        assert!(named.contains(&[PathElement::Field("summary".into())]));
        assert!(named.contains(&[
            PathElement::Field("metadata".into()),
            PathElement::Field("labels".into())
        ]));
        assert!(!named.contains(&[
            PathElement::Field("metadata".into()),
            PathElement::Field("labels".into()),
            PathElement::Field("b".into())
        ]));
    }
}
