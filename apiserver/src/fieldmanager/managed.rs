//! `metadata.managedFields`: decoding, the ownership bookkeeping of updates and applies, and
//! encoding in kube-apiserver's order.

use serde_json::{Map, Value, json};

use super::fieldset::{FieldSet, PathElement, display_path};
use super::schema::Shape;
use super::walk::{self, Comparison};

/// `operation` of a managedFields entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Operation {
    Apply,
    Update,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Apply => "Apply",
            Operation::Update => "Update",
        }
    }
}

/// One managedFields entry.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub manager: String,
    pub operation: Operation,
    pub api_version: String,
    pub subresource: String,
    /// RFC 3339, seconds.
    pub time: Option<String>,
    pub fields: FieldSet,
}

impl Entry {
    /// Entries are one per (manager, operation, subresource) and, for updates, API version:
    /// an applier owns its fields whatever version it applies with.
    fn same_owner(&self, other: &Entry) -> bool {
        self.manager == other.manager
            && self.operation == other.operation
            && self.subresource == other.subresource
            && (self.operation == Operation::Apply || self.api_version == other.api_version)
    }

    /// How conflict messages name the owner: `"kubectl"`, `"kubectl-edit" using v1`.
    pub fn describe(&self) -> String {
        let mut s = format!("{:?}", self.manager);
        if !self.subresource.is_empty() {
            s.push_str(&format!(" with subresource {:?}", self.subresource));
        }
        if self.operation == Operation::Update {
            s.push_str(&format!(" using {}", self.api_version));
        }
        s
    }

    fn seconds(&self) -> i64 {
        self.time
            .as_deref()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.timestamp())
            .unwrap_or(0)
    }

    fn decode(i: usize, v: &Value) -> Result<Entry, String> {
        let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        let operation = match v.get("operation").and_then(Value::as_str) {
            Some("Apply") => Operation::Apply,
            Some("Update") => Operation::Update,
            _ => return Err("operation must be `Apply` or `Update`".into()),
        };
        let api_version = s("apiVersion");
        if api_version.is_empty() {
            return Err("apiVersion must not be empty".into());
        }
        match v.get("fieldsType").and_then(Value::as_str) {
            Some("FieldsV1") => {}
            None | Some("") => {
                return Err(format!("missing fieldsType in managed fields entry {i}"));
            }
            Some(other) => {
                return Err(format!(
                    "invalid fieldsType {other:?} in managed fields entry {i}"
                ));
            }
        }
        let fields = match v.get("fieldsV1") {
            None | Some(Value::Null) => FieldSet::new(),
            Some(f) => FieldSet::from_fields_v1(f)
                .map_err(|e| format!("error decoding managed fields entry {i}: {e}"))?,
        };
        Ok(Entry {
            manager: s("manager"),
            operation,
            api_version,
            subresource: s("subresource"),
            time: v
                .get("time")
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
                .map(str::to_owned),
            fields,
        })
    }

    fn encode(&self) -> Value {
        let mut m = Map::new();
        m.insert("manager".into(), json!(self.manager));
        m.insert("operation".into(), json!(self.operation.as_str()));
        m.insert("apiVersion".into(), json!(self.api_version));
        if let Some(t) = &self.time {
            m.insert("time".into(), json!(t));
        }
        m.insert("fieldsType".into(), json!("FieldsV1"));
        m.insert("fieldsV1".into(), self.fields.to_fields_v1());
        if !self.subresource.is_empty() {
            m.insert("subresource".into(), json!(self.subresource));
        }
        Value::Object(m)
    }
}

/// A field another manager owns that an apply would change.
#[derive(Clone, Debug, PartialEq)]
pub struct Conflict {
    /// The owner, as conflict messages print it.
    pub manager: String,
    /// The field, as `.summary.pass`.
    pub field: String,
    pub path: Vec<PathElement>,
}

/// Kubernetes keeps at most this many Update entries; older ones are folded into one.
const MAX_UPDATE_MANAGERS: usize = 10;
const ANCIENT_CHANGES: &str = "ancient-changes";
/// Owner of the fields an object had before its first apply.
pub const BEFORE_FIRST_APPLY: &str = "before-first-apply";

/// Metadata fields the server owns or that name the object: never recorded.
fn strip(set: &FieldSet) -> FieldSet {
    let f = |s: &str| PathElement::Field(s.into());
    let mut server = FieldSet::new();
    for top in ["apiVersion", "kind", "metadata"] {
        server.insert(&[f(top)]);
    }
    for m in [
        "name",
        "namespace",
        "creationTimestamp",
        "selfLink",
        "uid",
        "clusterName",
        "generation",
        "managedFields",
        "resourceVersion",
    ] {
        server.insert(&[f("metadata"), f(m)]);
    }
    set.difference(&server)
}

/// The decoded managedFields of an object.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ManagedFields {
    entries: Vec<Entry>,
}

impl ManagedFields {
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Decodes `metadata.managedFields`; absent or null is empty. A later entry for the same
    /// owner replaces an earlier one.
    pub fn decode(v: Option<&Value>) -> Result<Self, String> {
        let items = match v {
            None | Some(Value::Null) => return Ok(Self::default()),
            Some(Value::Array(items)) => items,
            Some(other) => return Err(format!("managedFields must be a list, got {other}")),
        };
        let mut out = ManagedFields::default();
        for (i, item) in items.iter().enumerate() {
            let entry = Entry::decode(i, item)?;
            out.entries.retain(|e| !e.same_owner(&entry));
            out.entries.push(entry);
        }
        Ok(out)
    }

    /// The managedFields list, sorted as kube-apiserver sorts it (operation, time, manager,
    /// apiVersion, subresource); `None` when there is nothing to record.
    pub fn encode(&self) -> Option<Value> {
        if self.entries.is_empty() {
            return None;
        }
        let mut entries: Vec<&Entry> = self.entries.iter().collect();
        entries.sort_by(|p, q| {
            p.operation
                .cmp(&q.operation)
                .then_with(|| p.seconds().cmp(&q.seconds()))
                .then_with(|| p.manager.cmp(&q.manager))
                .then_with(|| p.api_version.cmp(&q.api_version))
                .then_with(|| p.subresource.cmp(&q.subresource))
        });
        Some(Value::Array(
            entries.into_iter().map(Entry::encode).collect(),
        ))
    }

    fn drop_empty(&mut self) {
        self.entries.retain(|e| !e.fields.is_empty());
    }

    /// Records a non-apply write by `manager` from `old` to `new` (neither carrying
    /// managedFields): changed and added fields move to `manager`, removed fields leave every
    /// owner.
    pub fn update(
        &mut self,
        shape: &Shape,
        old: &Value,
        new: &Value,
        manager: &str,
        api_version: &str,
        now: &str,
    ) {
        let c = walk::compare(old, new, shape);
        self.record_update(&c, manager, api_version, now);
    }

    fn record_update(&mut self, c: &Comparison, manager: &str, api_version: &str, now: &str) {
        let changed = c.changed();
        for e in &mut self.entries {
            e.fields = e.fields.difference(&changed).difference(&c.removed);
        }
        self.drop_empty();
        let mine = strip(&changed);
        if mine.is_empty() {
            return;
        }
        let probe = Entry {
            manager: manager.to_owned(),
            operation: Operation::Update,
            api_version: api_version.to_owned(),
            subresource: String::new(),
            time: Some(now.to_owned()),
            fields: mine,
        };
        match self.entries.iter_mut().find(|e| e.same_owner(&probe)) {
            Some(e) => {
                e.fields = e.fields.union(&probe.fields);
                e.time = probe.time;
            }
            None => self.entries.push(probe),
        }
        self.cap_update_managers();
    }

    /// Folds the oldest Update entries into one `ancient-changes` entry per API version once
    /// there are more than ten, as kube-apiserver does.
    fn cap_update_managers(&mut self) {
        let mut updaters: Vec<usize> = (0..self.entries.len())
            .filter(|&i| self.entries[i].operation == Operation::Update)
            .collect();
        if updaters.len() <= MAX_UPDATE_MANAGERS {
            return;
        }
        updaters.sort_by(|&a, &b| {
            let (p, q) = (&self.entries[a], &self.entries[b]);
            p.seconds()
                .cmp(&q.seconds())
                .then_with(|| p.manager.cmp(&q.manager))
        });
        let is_bucket = |e: &Entry, version: &str| {
            e.manager == ANCIENT_CHANGES
                && e.operation == Operation::Update
                && e.api_version == version
                && e.subresource.is_empty()
        };
        let mut excess = updaters.len() - MAX_UPDATE_MANAGERS;
        let mut first_of_version: Vec<(String, usize)> = Vec::new();
        let mut removed = vec![false; self.entries.len()];
        for &i in &updaters {
            if excess == 0 {
                break;
            }
            let version = self.entries[i].api_version.clone();
            if is_bucket(&self.entries[i], &version) {
                continue;
            }
            let Some(&(_, first)) = first_of_version.iter().find(|(v, _)| *v == version) else {
                first_of_version.push((version, i));
                continue;
            };
            let bucket = (0..self.entries.len())
                .find(|&b| !removed[b] && is_bucket(&self.entries[b], &version))
                .unwrap_or(first);
            let (fields, time) = (self.entries[i].fields.clone(), self.entries[i].time.clone());
            let b = &mut self.entries[bucket];
            b.manager = ANCIENT_CHANGES.into();
            b.fields = b.fields.union(&fields);
            b.time = time;
            removed[i] = true;
            excess -= 1;
        }
        let mut removed = removed.into_iter();
        self.entries.retain(|_| !removed.next().unwrap_or(false));
    }

    /// Takes ownership of what was there before the first apply, as kube-apiserver does for
    /// objects without managedFields.
    pub fn adopt_existing(
        &mut self,
        shape: &Shape,
        empty: &Value,
        live: &Value,
        api_version: &str,
        now: &str,
    ) {
        self.update(shape, empty, live, BEFORE_FIRST_APPLY, api_version, now);
    }

    /// The apply bookkeeping: `merged` is `config` merged into `live` (before pruning).
    /// Returns the object with the fields `manager` applied last time and no longer applies
    /// removed (unless someone else owns them).
    pub(super) fn prune(
        &self,
        shape: &Shape,
        merged: Value,
        manager: &str,
        applied: &FieldSet,
    ) -> Value {
        let Some(last) = self.entries.iter().find(|e| {
            e.operation == Operation::Apply && e.manager == manager && e.subresource.is_empty()
        }) else {
            return merged;
        };
        let mut owned = applied.clone();
        for e in &self.entries {
            if !std::ptr::eq(e, last) {
                owned = owned.union(&e.fields);
            }
        }
        let owned = walk::with_named_parents(&owned, shape);
        let last = walk::with_named_parents(&last.fields, shape);
        walk::remove(&merged, shape, &last.difference(&owned))
            .unwrap_or_else(|| Value::Object(Map::new()))
    }

    /// Records an apply by `manager` that turned `live` into `new` with the configuration's
    /// fields `applied`: conflicts with other owners of changed fields (taken over when
    /// `force`), removed fields leave every owner.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn record_apply(
        &mut self,
        shape: &Shape,
        live: &Value,
        new: &Value,
        manager: &str,
        api_version: &str,
        applied: &FieldSet,
        force: bool,
        now: &str,
    ) -> Result<(), Vec<Conflict>> {
        let probe = |e: &Entry| {
            e.operation == Operation::Apply && e.manager == manager && e.subresource.is_empty()
        };
        let previous = self
            .entries
            .iter()
            .position(probe)
            .map(|i| self.entries.remove(i));
        let c = walk::compare(live, new, shape);
        let changed = c.changed();
        let mut conflicts = Vec::new();
        for e in &self.entries {
            for path in e.fields.intersection(&changed).paths() {
                conflicts.push((e.describe(), path));
            }
        }
        if !force && !conflicts.is_empty() {
            conflicts.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
            return Err(conflicts
                .into_iter()
                .map(|(manager, path)| Conflict {
                    manager,
                    field: display_path(&path),
                    path,
                })
                .collect());
        }
        for e in &mut self.entries {
            e.fields = e.fields.difference(&changed).difference(&c.removed);
        }
        self.drop_empty();
        let fields = strip(applied);
        if fields.is_empty() {
            return Ok(());
        }
        // The time says when the applier last changed the object, not when it last asked.
        let object_changed = !changed.is_empty() || !c.removed.is_empty();
        let time = if object_changed {
            Some(now.to_owned())
        } else {
            previous.and_then(|p| p.time)
        };
        self.entries.push(Entry {
            manager: manager.to_owned(),
            operation: Operation::Apply,
            api_version: api_version.to_owned(),
            subresource: String::new(),
            time,
            fields,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_rejects_what_kubernetes_rejects_and_encode_sorts() {
        let entry = |m: &str, op: &str, t: &str| json!({"manager": m, "operation": op, "apiVersion": "g/v", "time": t, "fieldsType": "FieldsV1", "fieldsV1": {"f:summary": {"f:pass": {}}}});
        let list = json!([
            entry("z", "Update", "2024-01-01T00:00:00Z"),
            entry("b", "Update", "2023-01-01T00:00:00Z"),
            entry("a", "Apply", "2025-01-01T00:00:00Z"),
        ]);
        let m = ManagedFields::decode(Some(&list)).unwrap();
        let names: Vec<String> = m
            .encode()
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["manager"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(names, ["a", "b", "z"]);
        assert!(ManagedFields::decode(Some(&json!([{"manager": "x", "operation": "Patch", "apiVersion": "v1", "fieldsType": "FieldsV1"}]))).is_err());
        assert!(
            ManagedFields::decode(Some(
                &json!([{"manager": "x", "operation": "Apply", "apiVersion": "v1"}])
            ))
            .is_err()
        );
        assert!(
            ManagedFields::decode(Some(
                &json!([{"manager": "x", "operation": "Apply", "fieldsType": "FieldsV1"}])
            ))
            .is_err()
        );
        assert!(ManagedFields::decode(None).unwrap().encode().is_none());
    }

    #[test]
    fn update_entries_are_capped() {
        let shape = &crate::fieldmanager::schema::KindSchema::of(
            &reports_server_crds::catalog::POLICY_REPORT,
        )
        .shape;
        let mut m = ManagedFields::default();
        let mut obj = json!({"metadata": {"labels": {}}});
        for i in 0..12 {
            let mut next = obj.clone();
            next["metadata"]["labels"][format!("l{i}")] = json!("x");
            m.update(
                shape,
                &obj,
                &next,
                &format!("m{i:02}"),
                "g/v",
                &format!("2024-01-01T00:00:{i:02}Z"),
            );
            obj = next;
        }
        assert_eq!(m.entries().len(), 10);
        let ancient = m
            .entries()
            .iter()
            .find(|e| e.manager == ANCIENT_CHANGES)
            .unwrap();
        assert_eq!(
            ancient.fields.paths().len(),
            3,
            "{:?}",
            ancient.fields.paths()
        );
    }
}
