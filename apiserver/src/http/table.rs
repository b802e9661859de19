//! `meta.k8s.io` Table rendering with the CRDs' printer columns (pure), so `kubectl get` prints
//! exactly the columns it prints for CRD-backed reports.

use reports_server_crds::ResourceDescriptor;
use reports_server_crds::catalog::PrinterColumn;
use serde_json::{Value, json};

/// What `row.object` carries (`includeObject`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum IncludeObject {
    None,
    #[default]
    Metadata,
    Object,
}

impl IncludeObject {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "None" => Some(Self::None),
            "Metadata" | "" => Some(Self::Metadata),
            "Object" => Some(Self::Object),
            _ => None,
        }
    }
}

/// Evaluates the JSONPath subset CRD printer columns use: `.a.b` and `.a['b\.c']`.
pub fn json_path<'a>(object: &'a Value, path: &str) -> Option<&'a Value> {
    let mut current = object;
    let mut rest = path.trim().trim_start_matches('{').trim_end_matches('}');
    while !rest.is_empty() {
        let key: String;
        if let Some(r) = rest.strip_prefix("['").or_else(|| rest.strip_prefix("[\"")) {
            let end = r.find("']").or_else(|| r.find("\"]"))?;
            key = r[..end].replace("\\.", ".");
            rest = &r[end + 2..];
        } else if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(['.', '[']).unwrap_or(r.len());
            key = r[..end].to_owned();
            rest = &r[end..];
        } else {
            return None;
        }
        current = current.get(&key)?;
    }
    Some(current)
}

/// Kubernetes' `duration.HumanDuration`.
pub fn human_duration(seconds: i64) -> String {
    if seconds < -1 {
        return "<invalid>".into();
    }
    let s = seconds.max(0);
    let (m, h) = (s / 60, s / 3600);
    if s < 120 {
        format!("{s}s")
    } else if m < 10 {
        if s % 60 == 0 {
            format!("{m}m")
        } else {
            format!("{m}m{}s", s % 60)
        }
    } else if m < 180 {
        format!("{m}m")
    } else if h < 8 {
        if m % 60 == 0 {
            format!("{h}h")
        } else {
            format!("{h}h{}m", m % 60)
        }
    } else if h < 48 {
        format!("{h}h")
    } else if h < 24 * 8 {
        let d = h / 24;
        if h % 24 == 0 {
            format!("{d}d")
        } else {
            format!("{d}d{}h", h % 24)
        }
    } else if h < 24 * 365 * 2 {
        format!("{}d", h / 24)
    } else if h < 24 * 365 * 8 {
        let (y, d) = (h / 24 / 365, (h / 24) % 365);
        if d == 0 {
            format!("{y}y")
        } else {
            format!("{y}y{d}d")
        }
    } else {
        format!("{}y", h / 24 / 365)
    }
}

fn cell(column: &PrinterColumn, object: &Value, now: i64) -> Value {
    let Some(value) = json_path(object, column.json_path) else {
        return Value::Null;
    };
    match column.type_ {
        "date" => value
            .as_str()
            .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
            .map(|t| Value::String(human_duration(now - t.timestamp())))
            .unwrap_or(Value::Null),
        "integer" => value.as_i64().map(Value::from).unwrap_or(Value::Null),
        _ => match value {
            Value::String(_) => value.clone(),
            Value::Null => Value::Null,
            other => Value::String(other.to_string()),
        },
    }
}

pub fn column_definitions(desc: &ResourceDescriptor) -> Value {
    let mut defs = vec![json!({
        "name": "Name", "type": "string", "format": "name", "priority": 0,
        "description": "Name must be unique within a namespace. Is required when creating resources, although some resources may allow a client to request the generation of an appropriate name automatically. Name is primarily intended for creation idempotence and configuration definition. Cannot be updated. More info: https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names"
    })];
    defs.extend(desc.printer_columns.iter().map(|c| {
        json!({"name": c.name, "type": c.type_, "format": "", "description": c.description, "priority": c.priority})
    }));
    Value::Array(defs)
}

/// The `PartialObjectMetadata` form of an object.
pub fn partial_metadata(version: &str, metadata: Value) -> Value {
    json!({"kind": "PartialObjectMetadata", "apiVersion": format!("meta.k8s.io/{version}"), "metadata": metadata})
}

/// One table row. `object` must have `metadata` and whatever the columns read.
pub fn row(
    desc: &ResourceDescriptor,
    object: &Value,
    include: IncludeObject,
    version: &str,
    now: i64,
) -> Value {
    let name = object["metadata"]["name"].clone();
    let mut cells = vec![name];
    cells.extend(desc.printer_columns.iter().map(|c| cell(c, object, now)));
    let mut row = json!({"cells": cells});
    match include {
        IncludeObject::None => {}
        IncludeObject::Metadata => {
            row["object"] = partial_metadata(version, object["metadata"].clone())
        }
        IncludeObject::Object => row["object"] = object.clone(),
    }
    row
}

/// A whole table.
pub fn table(
    desc: &ResourceDescriptor,
    version: &str,
    rows: Vec<Value>,
    resource_version: &str,
    continue_token: Option<&str>,
) -> Value {
    let mut metadata = json!({"resourceVersion": resource_version});
    if let Some(c) = continue_token {
        metadata["continue"] = json!(c);
    }
    json!({
        "kind": "Table",
        "apiVersion": format!("meta.k8s.io/{version}"),
        "metadata": metadata,
        "columnDefinitions": column_definitions(desc),
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use reports_server_crds::catalog;

    #[test]
    fn json_path_with_escaped_keys() {
        let o = json!({"metadata": {"labels": {"audit.kyverno.io/source": "admission"}}, "spec": {"summary": {"pass": 3}}});
        assert_eq!(
            json_path(&o, r".metadata.labels['audit\.kyverno\.io/source']"),
            Some(&json!("admission"))
        );
        assert_eq!(json_path(&o, ".spec.summary.pass"), Some(&json!(3)));
        assert_eq!(json_path(&o, ".spec.summary.fail"), None);
    }

    #[test]
    fn human_durations_match_kubernetes() {
        for (s, want) in [
            (5, "5s"),
            (119, "119s"),
            (150, "2m30s"),
            (600, "10m"),
            (3 * 3600 + 60, "3h1m"),
            (9 * 3600, "9h"),
            (50 * 3600, "2d2h"),
            (30 * 86400, "30d"),
            (3 * 365 * 86400, "3y"),
        ] {
            assert_eq!(human_duration(s), want, "{s}");
        }
    }

    #[test]
    fn policy_report_row() {
        let o = json!({"metadata": {"name": "r", "namespace": "n", "creationTimestamp": "2024-01-01T00:00:00Z"},
            "scope": {"kind": "Pod", "name": "p"}, "summary": {"pass": 2, "fail": 1, "warn": 0, "error": 0, "skip": 0}});
        let now = chrono::DateTime::parse_from_rfc3339("2024-01-01T00:01:00Z")
            .unwrap()
            .timestamp();
        let r = row(
            &catalog::POLICY_REPORT,
            &o,
            IncludeObject::Metadata,
            "v1",
            now,
        );
        assert_eq!(r["cells"], json!(["r", "Pod", "p", 2, 1, 0, 0, 0, "60s"]));
        assert_eq!(r["object"]["kind"], "PartialObjectMetadata");
        assert_eq!(
            column_definitions(&catalog::POLICY_REPORT)
                .as_array()
                .unwrap()
                .len(),
            9
        );
    }
}
