//! Turning schemars output into CRD-style structural schemas, and checking objects against the
//! Rust types.
//!
//! The generated schema is post-processed into the shape the apiextensions apiserver accepts and
//! controller-gen emits: subschemas inlined, `Option<T>` as plain `T` (no `anyOf`/`nullable`),
//! `metadata` as a bare `object`, and the list/map-type markers upstream puts on references and
//! selectors.

use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Map, Value, json};

/// A body that does not fit its kind's schema.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SchemaError {
    /// The JSON path of the offending field, e.g. `results[0].result`.
    pub field: String,
    pub message: String,
}

/// Deserializes `object` as `T` and serializes it back: unknown fields are pruned and a field of
/// the wrong type or an invalid enum value is an error naming the field.
pub fn normalize_object<T: DeserializeOwned + Serialize>(
    object: &Value,
) -> Result<Value, SchemaError> {
    // Tracking the path costs on every field of every write; only a failure needs it, so a
    // failure is deserialized again to name its field (the same visitor gives the same error).
    let typed = match T::deserialize(object) {
        Ok(typed) => typed,
        Err(first) => {
            return Err(match serde_path_to_error::deserialize::<_, T>(object) {
                Err(e) => {
                    let field = e.path().to_string();
                    SchemaError {
                        field: if field == "." { String::new() } else { field },
                        message: e.into_inner().to_string(),
                    }
                }
                Ok(_) => SchemaError {
                    field: String::new(),
                    message: first.to_string(),
                },
            });
        }
    };
    serde_json::to_value(&typed).map_err(|e| SchemaError {
        field: String::new(),
        message: e.to_string(),
    })
}

/// `{"type": "integer"}` without a `format`, as controller-gen emits for Go `int`.
pub fn plain_integer(_: &mut SchemaGenerator) -> Schema {
    schemars::json_schema!({"type": "integer"})
}

/// Converts a schemars root schema into a self-contained structural schema.
pub fn structural_schema(root: Schema) -> Value {
    let mut root = root.to_value();
    let definitions = root
        .as_object_mut()
        .and_then(|o| {
            o.remove("components")
                .or_else(|| o.remove("$defs"))
                .or_else(|| o.remove("definitions"))
        })
        .map(|c| match c {
            Value::Object(mut o) => o.remove("schemas").unwrap_or(Value::Object(o)),
            other => other,
        })
        .unwrap_or(Value::Object(Map::new()));
    let mut schema = inline(root, &definitions, 0);
    if let Some(props) = schema.get_mut("properties").and_then(Value::as_object_mut)
        && props.contains_key("metadata")
    {
        props.insert("metadata".into(), json!({"type": "object"}));
    }
    clean(&mut schema);
    schema
}

fn inline(mut node: Value, definitions: &Value, depth: usize) -> Value {
    assert!(
        depth < 64,
        "schema recursion too deep; a recursive type cannot be a structural schema"
    );
    if let Some(reference) = node.get("$ref").and_then(Value::as_str).map(str::to_owned) {
        let name = reference.rsplit('/').next().unwrap_or_default();
        let mut target = definitions
            .get(name)
            .cloned()
            .unwrap_or_else(|| panic!("unresolved schema reference {reference}"));
        // Sibling keywords next to a $ref (descriptions, extensions) override the target's.
        if let (Some(t), Some(n)) = (target.as_object_mut(), node.as_object()) {
            for (k, v) in n {
                if k != "$ref" {
                    t.insert(k.clone(), v.clone());
                }
            }
        }
        return inline(target, definitions, depth + 1);
    }
    match &mut node {
        Value::Object(map) => {
            for value in map.values_mut() {
                let taken = std::mem::take(value);
                *value = inline(taken, definitions, depth + 1);
            }
        }
        Value::Array(items) => {
            for value in items.iter_mut() {
                let taken = std::mem::take(value);
                *value = inline(taken, definitions, depth + 1);
            }
        }
        _ => {}
    }
    node
}

fn is_null_schema(v: &Value) -> bool {
    v.get("type").and_then(Value::as_str) == Some("null")
        || v.get("enum").is_some_and(|e| e == &json!([null]))
        || v.get("nullable").is_some_and(|n| n == &json!(true))
            && v.as_object().is_some_and(|o| o.len() == 1)
}

fn clean(node: &mut Value) {
    let Value::Object(map) = node else {
        if let Value::Array(items) = node {
            items.iter_mut().for_each(clean);
        }
        return;
    };
    // Option<T> comes out as anyOf/oneOf [T, null]: collapse to T.
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(branches)) = map.get(key) {
            let non_null: Vec<&Value> = branches.iter().filter(|b| !is_null_schema(b)).collect();
            if non_null.len() == 1 && branches.len() == 2 {
                let keep = non_null[0].clone();
                map.remove(key);
                if let Value::Object(inner) = keep {
                    for (k, v) in inner {
                        map.entry(k).or_insert(v);
                    }
                }
            }
        }
    }
    // `type: [T, "null"]` likewise.
    if let Some(Value::Array(types)) = map.get("type") {
        let non_null: Vec<Value> = types
            .iter()
            .filter(|t| t.as_str() != Some("null"))
            .cloned()
            .collect();
        if non_null.len() == 1 {
            map.insert("type".into(), non_null[0].clone());
        }
    }
    if let Some(Value::Array(values)) = map.get_mut("enum") {
        values.retain(|v| !v.is_null());
    }
    for key in [
        "nullable", "$schema", "title", "default", "examples", "minimum", "maximum",
    ] {
        map.remove(key);
    }
    if let Some(Value::String(d)) = map.get("description")
        && d.is_empty()
    {
        map.remove("description");
    }
    if let Some(Value::Array(required)) = map.get("required")
        && required.is_empty()
    {
        map.remove("required");
    }
    mark_atomic(map);
    for value in map.values_mut() {
        clean(value);
    }
}

/// Upstream marks object references and label selectors as atomic maps and selector lists as
/// atomic lists; server-side apply relies on these markers.
fn mark_atomic(map: &mut Map<String, Value>) {
    let Some(Value::Object(props)) = map.get("properties") else {
        return;
    };
    let is_reference = props.contains_key("fieldPath") && props.contains_key("resourceVersion");
    let is_owner_reference =
        props.contains_key("blockOwnerDeletion") && props.contains_key("controller");
    let is_selector = props.contains_key("matchLabels") && props.contains_key("matchExpressions");
    if is_reference || is_owner_reference || is_selector {
        map.insert("x-kubernetes-map-type".into(), json!("atomic"));
    }
    if let Some(Value::Object(props)) = map.get_mut("properties") {
        if is_selector && let Some(Value::Object(me)) = props.get_mut("matchExpressions") {
            me.insert("x-kubernetes-list-type".into(), json!("atomic"));
        }
        if props.contains_key("operator")
            && props.contains_key("values")
            && let Some(Value::Object(values)) = props.get_mut("values")
        {
            values.insert("x-kubernetes-list-type".into(), json!("atomic"));
        }
    }
}

/// The schema of `T` in structural form; convenience for tests and generators.
pub fn structural_schema_for<T: JsonSchema>() -> Value {
    structural_schema(
        schemars::generate::SchemaSettings::openapi3()
            .into_generator()
            .into_root_schema_for::<T>(),
    )
}
