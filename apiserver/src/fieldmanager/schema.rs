//! The merge-relevant shape of a kind, derived from its structural schema: which maps are
//! granular (merged key by key) and which values are atomic (replaced whole), which lists are
//! sets or keyed maps. Plus pruning of an applied configuration to the schema.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use reports_server_crds::ResourceDescriptor;
use reports_server_crds::catalog::ALL;
use serde_json::Value;

/// How a value merges and which of its parts can be owned separately.
#[derive(Clone, Debug, PartialEq)]
pub enum Shape {
    /// Scalars, atomic maps, atomic lists and anything the schema does not describe: replaced
    /// whole and owned as one field.
    Leaf,
    /// A map merged key by key: declared `fields`, and `values` for the keys of an
    /// `additionalProperties` map (labels, annotations).
    Struct {
        fields: BTreeMap<String, Shape>,
        values: Option<Box<Shape>>,
    },
    /// A list whose items are merged and owned one by one.
    List { items: Box<Shape>, kind: ListKind },
}

/// `x-kubernetes-list-type` of a granular list.
#[derive(Clone, Debug, PartialEq)]
pub enum ListKind {
    /// Items are scalars, identified by value (`v:`).
    Set,
    /// Items are maps identified by these key fields (`k:`).
    Map(Vec<String>),
}

impl Shape {
    /// The shape of a struct field or map key (`Leaf` for keys the schema does not declare).
    pub fn field(&self, name: &str) -> &Shape {
        match self {
            Shape::Struct { fields, values } => fields
                .get(name)
                .or(values.as_deref())
                .unwrap_or(&Shape::Leaf),
            _ => &Shape::Leaf,
        }
    }

    /// Whether `name` is a declared struct field (not a key of an additionalProperties map).
    pub fn declares(&self, name: &str) -> bool {
        matches!(self, Shape::Struct { fields, .. } if fields.contains_key(name))
    }

    /// Builds the shape of an OpenAPI v3 structural schema. Lists without
    /// `x-kubernetes-list-type` are atomic, as kube-apiserver treats them for custom resources.
    pub fn from_schema(schema: &Value) -> Shape {
        let flag = |k: &str| schema.get(k).and_then(Value::as_str);
        if flag("x-kubernetes-map-type") == Some("atomic")
            || schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true))
            || schema.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true))
        {
            return Shape::Leaf;
        }
        let ty = flag("type").unwrap_or(if schema.get("properties").is_some() {
            "object"
        } else {
            ""
        });
        match ty {
            "object" => {
                let fields: BTreeMap<String, Shape> = schema
                    .get("properties")
                    .and_then(Value::as_object)
                    .map(|p| {
                        p.iter()
                            .map(|(k, v)| (k.clone(), Shape::from_schema(v)))
                            .collect()
                    })
                    .unwrap_or_default();
                let values = match schema.get("additionalProperties") {
                    Some(v @ Value::Object(_)) => Some(Box::new(Shape::from_schema(v))),
                    Some(Value::Bool(true)) => Some(Box::new(Shape::Leaf)),
                    _ => None,
                };
                if fields.is_empty() && values.is_none() {
                    Shape::Leaf
                } else {
                    Shape::Struct { fields, values }
                }
            }
            "array" => {
                let items = Box::new(
                    schema
                        .get("items")
                        .map(Shape::from_schema)
                        .unwrap_or(Shape::Leaf),
                );
                match flag("x-kubernetes-list-type") {
                    Some("set") => Shape::List {
                        items,
                        kind: ListKind::Set,
                    },
                    Some("map") => Shape::List {
                        items,
                        kind: ListKind::Map(
                            schema
                                .get("x-kubernetes-list-map-keys")
                                .and_then(Value::as_array)
                                .map(|keys| {
                                    keys.iter()
                                        .filter_map(Value::as_str)
                                        .map(str::to_owned)
                                        .collect()
                                })
                                .unwrap_or_default(),
                        ),
                    },
                    _ => Shape::Leaf,
                }
            }
            _ => Shape::Leaf,
        }
    }

    /// `ObjectMeta` as kube-apiserver's merge schema describes it: labels and annotations are
    /// granular maps, `ownerReferences` a list keyed by `uid` of atomic items, `finalizers` a
    /// set, `managedFields` atomic. (The CRD-style schemas only say `metadata: object`.)
    pub fn object_meta() -> Shape {
        let mut fields: BTreeMap<String, Shape> = [
            "name",
            "generateName",
            "namespace",
            "selfLink",
            "uid",
            "resourceVersion",
            "generation",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "managedFields",
        ]
        .into_iter()
        .map(|k| (k.to_owned(), Shape::Leaf))
        .collect();
        for map in ["labels", "annotations"] {
            fields.insert(
                map.into(),
                Shape::Struct {
                    fields: BTreeMap::new(),
                    values: Some(Box::new(Shape::Leaf)),
                },
            );
        }
        fields.insert(
            "ownerReferences".into(),
            Shape::List {
                items: Box::new(Shape::Leaf),
                kind: ListKind::Map(vec!["uid".into()]),
            },
        );
        fields.insert(
            "finalizers".into(),
            Shape::List {
                items: Box::new(Shape::Leaf),
                kind: ListKind::Set,
            },
        );
        Shape::Struct {
            fields,
            values: None,
        }
    }
}

/// Everything the field manager needs to know about one kind.
#[derive(Debug)]
pub struct KindSchema {
    pub shape: Shape,
    /// The structural schema with the full `ObjectMeta` schema in place of `metadata: object`,
    /// for pruning applied configurations.
    pub schema: Value,
}

impl KindSchema {
    fn build(desc: &ResourceDescriptor) -> Self {
        let mut schema = desc.schema();
        let mut shape = Shape::from_schema(&schema);
        if let Shape::Struct { fields, .. } = &mut shape {
            fields.insert("metadata".into(), Shape::object_meta());
        }
        if let Some(props) = schema.get_mut("properties").and_then(Value::as_object_mut) {
            props.insert(
                "metadata".into(),
                reports_server_crds::schema::structural_schema_for::<ObjectMeta>(),
            );
        }
        KindSchema { shape, schema }
    }

    /// The schema of a served kind (built once).
    pub fn of(desc: &ResourceDescriptor) -> &'static KindSchema {
        static ALL_KINDS: OnceLock<Vec<KindSchema>> = OnceLock::new();
        let all = ALL_KINDS.get_or_init(|| ALL.iter().map(KindSchema::build).collect());
        let i = ALL
            .iter()
            .position(|d| d == desc)
            .expect("a served kind is in the catalog");
        &all[i]
    }

    /// Removes fields the schema does not declare, as CRD storage prunes them, and returns
    /// their paths (`spec.foo`, `results[0].bar`) for field validation.
    pub fn prune_unknown(&self, object: &mut Value) -> Vec<String> {
        let mut unknown = Vec::new();
        prune(object, &self.schema, "", &mut unknown);
        unknown
    }
}

fn prune(v: &mut Value, schema: &Value, path: &str, unknown: &mut Vec<String>) {
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) {
        return;
    }
    let join = |k: &str| {
        if path.is_empty() {
            k.to_owned()
        } else {
            format!("{path}.{k}")
        }
    };
    match v {
        Value::Object(map) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let extra = schema.get("additionalProperties");
            let open = match extra {
                Some(Value::Bool(b)) => *b,
                Some(Value::Object(_)) => true,
                _ => false,
            };
            // An object schema with neither keeps nothing; a non-object schema is not ours to
            // judge (the type check happens when the merged object is validated).
            if props.is_none()
                && !open
                && schema.get("type").and_then(Value::as_str) != Some("object")
            {
                return;
            }
            let keys: Vec<String> = map.keys().cloned().collect();
            for k in keys {
                let child_schema = props.and_then(|p| p.get(&k)).or(match extra {
                    Some(s @ Value::Object(_)) => Some(s),
                    _ => None,
                });
                match child_schema {
                    Some(s) => prune(map.get_mut(&k).expect("key listed"), s, &join(&k), unknown),
                    None if open => {}
                    None => {
                        let removed = map.remove(&k);
                        // A null the schema does not know is "unset", not unknown.
                        if removed.is_some_and(|r| !r.is_null()) {
                            unknown.push(join(&k));
                        }
                    }
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter_mut().enumerate() {
                    prune(item, item_schema, &format!("{path}[{i}]"), unknown);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reports_server_crds::catalog::{EPHEMERAL_REPORT, POLICY_REPORT};
    use serde_json::json;

    #[test]
    fn report_shapes_follow_the_schema_markers() {
        let polr = &KindSchema::of(&POLICY_REPORT).shape;
        assert_eq!(*polr.field("results"), Shape::Leaf, "results is atomic");
        assert_eq!(*polr.field("scope"), Shape::Leaf, "scope is an atomic map");
        assert!(matches!(polr.field("summary"), Shape::Struct { .. }));
        let meta = polr.field("metadata");
        assert!(matches!(
            meta.field("labels"),
            Shape::Struct {
                values: Some(_),
                ..
            }
        ));
        assert!(matches!(
            meta.field("ownerReferences"),
            Shape::List { kind: ListKind::Map(k), .. } if k == &["uid"]
        ));
        assert!(matches!(
            meta.field("finalizers"),
            Shape::List {
                kind: ListKind::Set,
                ..
            }
        ));
        let ephr = &KindSchema::of(&EPHEMERAL_REPORT).shape;
        assert_eq!(*ephr.field("spec").field("owner"), Shape::Leaf);
        assert!(ephr.declares("spec") && !meta.declares("app"));
    }

    #[test]
    fn pruning_reports_unknown_fields_at_any_depth() {
        let k = KindSchema::of(&POLICY_REPORT);
        let mut config = json!({
            "metadata": {"name": "x", "labelz": {"a": "b"}, "labels": {"any": "thing"}},
            "summary": {"pass": 1, "passed": 2},
            "results": [{"policy": "p", "bogus": true}],
            "extra": null,
            "typo": 1
        });
        let unknown = k.prune_unknown(&mut config);
        assert_eq!(
            unknown,
            [
                "metadata.labelz",
                "summary.passed",
                "results[0].bogus",
                "typo"
            ]
        );
        assert_eq!(
            config,
            json!({"metadata": {"name": "x", "labels": {"any": "thing"}}, "summary": {"pass": 1}, "results": [{"policy": "p"}]})
        );
    }
}
