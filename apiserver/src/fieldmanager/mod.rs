//! Field ownership and server-side apply, as kube-apiserver does them for custom resources.
//!
//! Every write records in `metadata.managedFields` which field manager set which fields, and
//! `PATCH` with `application/apply-patch+yaml` merges a manager's configuration into the live
//! object, removes what that manager applied before and no longer applies, and refuses to change
//! fields other managers own unless forced. Clients (kubectl, client-go's apply configurations,
//! kube-rs `Patch::Apply`) depend on the exact rules and wire format, so they follow
//! structured-merge-diff, the library kube-apiserver uses: the same field-set encoding
//! (`FieldsV1`), the same merge, comparison and pruning rules, the same conflict messages, the
//! same treatment of server-owned metadata, `before-first-apply` and `ancient-changes`.
//!
//! The module is pure (no I/O, no clock): callers pass the time and run it inside the store's
//! write transaction, so a read-modify-write of ownership is atomic with the object's write.
//!
//! * [`schema`]: the merge shape of a kind (granular maps, atomic values, set and keyed lists)
//!   from the same structural schemas as the CRDs; pruning of applied configurations.
//! * [`fieldset`]: field sets and their `FieldsV1` encoding.
//! * [`walk`]: merge, compare, field listing and removal over JSON guided by the shape.
//! * [`managed`]: managedFields entries and the update/apply bookkeeping.

pub mod fieldset;
pub mod managed;
pub mod schema;
pub mod walk;

use serde_json::{Map, Value, json};

pub use self::managed::{BEFORE_FIRST_APPLY, Conflict, Entry, ManagedFields, Operation};
pub use self::schema::KindSchema;

/// kube-apiserver's limit on field manager names (bytes).
pub const MAX_MANAGER_LENGTH: usize = 128;

/// Entries a request's `metadata.managedFields` may have (422 above). kube-apiserver keeps at
/// most ten Update entries and one per applier; a real object has a handful. Bounding the
/// count bounds the set arithmetic a single write can cause.
pub const MAX_MANAGED_FIELDS_ENTRIES: usize = 256;

/// Why a write could not be recorded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FieldManagerError {
    /// The apply would change fields other managers own.
    #[error("{}", conflict_message(.0))]
    Conflicts(Vec<Conflict>),
    /// The applied configuration cannot be merged (e.g. duplicate items in a keyed list).
    #[error("{0}")]
    InvalidConfig(String),
    /// The stored managedFields cannot be read.
    #[error("failed to decode managed fields: {0}")]
    CorruptManagedFields(String),
}

/// kube-apiserver's conflict message: `Apply failed with 1 conflict: conflict with "kubectl":
/// .summary.pass`, or one paragraph per manager for several.
pub fn conflict_message(conflicts: &[Conflict]) -> String {
    if let [c] = conflicts {
        return format!(
            "Apply failed with 1 conflict: conflict with {}: {}",
            c.manager, c.field
        );
    }
    let mut managers: Vec<&str> = conflicts.iter().map(|c| c.manager.as_str()).collect();
    managers.sort_unstable();
    managers.dedup();
    let mut lines = Vec::new();
    for m in managers {
        lines.push(format!("conflicts with {m}:"));
        for c in conflicts.iter().filter(|c| c.manager == m) {
            lines.push(format!("- {}", c.field));
        }
    }
    format!(
        "Apply failed with {} conflicts: {}",
        conflicts.len(),
        lines.join("\n")
    )
}

/// Go's `unicode.IsPrint`, near enough: graphic characters and the ASCII space.
fn printable(c: char) -> bool {
    c == ' ' || !(c.is_control() || c.is_whitespace() || ('\u{200b}'..='\u{200f}').contains(&c))
}

/// The field manager kube-apiserver derives from a `User-Agent` when a request names none:
/// what precedes the first `/` (`kubectl/v1.32.0 (linux/amd64)` → `kubectl`), printable
/// characters only, at most 128 bytes; `unknown` when nothing is left.
pub fn manager_from_user_agent(user_agent: Option<&str>) -> String {
    let prefix = user_agent.unwrap_or("").split('/').next().unwrap_or("");
    let mut out = String::new();
    for c in prefix.chars().filter(|c| printable(*c)) {
        if out.len() + c.len_utf8() > MAX_MANAGER_LENGTH {
            break;
        }
        out.push(c);
    }
    if out.is_empty() {
        "unknown".into()
    } else {
        out
    }
}

/// Problems with a `fieldManager` query parameter: (message, reason) pairs for a 422.
pub fn validate_manager(name: &str) -> Vec<(String, &'static str)> {
    let mut problems = Vec::new();
    if name.len() > MAX_MANAGER_LENGTH {
        problems.push((
            format!("Too long: may not be more than {MAX_MANAGER_LENGTH} bytes"),
            "FieldValueTooLong",
        ));
    }
    // The first offending character only, and the name cut to the limit: a message must not
    // grow with the input (one per character of an 8 KiB name, each quoting it, was 121 MiB).
    if let Some((i, c)) = name.char_indices().find(|(_, c)| !printable(*c)) {
        let mut shown: String = String::new();
        for c in name.chars() {
            if shown.len() + c.len_utf8() > MAX_MANAGER_LENGTH {
                shown.push('…');
                break;
            }
            shown.push(c);
        }
        problems.push((
            format!(
                "Invalid value: {}: invalid character U+{:04X} (at position {i})",
                serde_json::to_string(&shown).expect("strings serialize"),
                c as u32
            ),
            "FieldValueInvalid",
        ));
    }
    problems
}

/// What a manager writes as: its name, the API version of the request and the current time.
#[derive(Clone, Debug)]
pub struct Writer<'a> {
    pub manager: &'a str,
    pub api_version: &'a str,
    /// RFC 3339, seconds.
    pub now: &'a str,
}

/// An object of the kind with nothing in it: what a create starts from.
pub fn empty_object(api_version: &str, kind: &str) -> Value {
    json!({"apiVersion": api_version, "kind": kind})
}

fn without_managed_fields(object: &Value) -> Value {
    let mut o = object.clone();
    if let Some(meta) = o.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("managedFields");
    }
    o
}

fn set_managed_fields(object: &mut Value, managed: &ManagedFields) {
    let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    match managed.encode() {
        Some(list) => {
            meta.insert("managedFields".into(), list);
        }
        None => {
            meta.remove("managedFields");
        }
    }
}

/// `[]` or `[{}]`: how a client asks for managedFields to be cleared.
fn is_reset(v: &Value) -> bool {
    match v {
        Value::Array(items) => {
            items.is_empty() || (items.len() == 1 && items[0] == Value::Object(Map::new()))
        }
        _ => false,
    }
}

/// Records a create (`live` is `None`), update or non-apply patch in `new`'s managedFields.
///
/// The managedFields `new` carries win when present and valid (a client may rewrite them; `[]`
/// clears them), otherwise the live ones are kept. An existing object without managedFields
/// stays untracked until its first apply, as in kube-apiserver.
pub fn track_update(kind: &KindSchema, live: Option<&Value>, new: &mut Value, w: &Writer<'_>) {
    let sent = new
        .get_mut("metadata")
        .and_then(Value::as_object_mut)
        .and_then(|m| m.remove("managedFields"));
    let stored = || {
        ManagedFields::decode(live.and_then(|l| l["metadata"].get("managedFields")))
            .unwrap_or_default()
    };
    let mut managed = match &sent {
        Some(v) if is_reset(v) => ManagedFields::default(),
        Some(v) => match ManagedFields::decode(Some(v)) {
            Ok(m) if !m.is_empty() => m,
            _ => stored(),
        },
        None => stored(),
    };
    let existing =
        live.is_some_and(|l| l["metadata"]["uid"].as_str().is_some_and(|u| !u.is_empty()));
    if managed.is_empty() && existing {
        return;
    }
    let old = match live {
        Some(l) => without_managed_fields(l),
        None => empty_object(
            new["apiVersion"].as_str().unwrap_or(w.api_version),
            new["kind"].as_str().unwrap_or(""),
        ),
    };
    managed.update(&kind.shape, &old, new, w.manager, w.api_version, w.now);
    set_managed_fields(new, &managed);
}

/// A server-side apply between merging the configuration and recording ownership: the caller
/// validates and completes [`ApplyPlan::merged`] (schema, server-owned metadata), then
/// [`ApplyPlan::finish`]es with the result.
#[derive(Debug)]
pub struct ApplyPlan {
    kind: &'static KindSchema,
    live: Value,
    managed: ManagedFields,
    applied: fieldset::FieldSet,
    merged: Value,
    manager: String,
    api_version: String,
    now: String,
}

impl ApplyPlan {
    /// Merges `config` (already pruned to the schema, without managedFields) into `live`
    /// (`None`: the object does not exist and is created from `empty`), and removes the fields
    /// the manager applied last time and no longer applies, unless someone else owns them.
    pub fn begin(
        kind: &'static KindSchema,
        live: Option<&Value>,
        empty: &Value,
        config: &Value,
        w: &Writer<'_>,
    ) -> Result<ApplyPlan, FieldManagerError> {
        let live_object = live
            .map(without_managed_fields)
            .unwrap_or_else(|| empty.clone());
        let mut managed =
            ManagedFields::decode(live.and_then(|l| l["metadata"].get("managedFields")))
                .map_err(FieldManagerError::CorruptManagedFields)?;
        if managed.is_empty() && live.is_some() {
            managed.adopt_existing(&kind.shape, empty, &live_object, w.api_version, w.now);
        }
        let merged = walk::merge(&live_object, config, &kind.shape)
            .map_err(FieldManagerError::InvalidConfig)?;
        let applied = walk::field_set(config, &kind.shape);
        let merged = managed.prune(&kind.shape, merged, w.manager, &applied);
        Ok(ApplyPlan {
            kind,
            live: live_object,
            managed,
            applied,
            merged,
            manager: w.manager.to_owned(),
            api_version: w.api_version.to_owned(),
            now: w.now.to_owned(),
        })
    }

    /// The merged object, before validation.
    pub fn merged(&self) -> &Value {
        &self.merged
    }

    /// Records the apply that produced `new` (the validated merged object): conflicts unless
    /// `force`, ownership moved to the applier, managedFields written into `new`.
    ///
    /// kubectl's own applies (manager `kubectl`) may take over, without `force`, the fields of
    /// their earlier client-side applies that still hold the values recorded in the
    /// `kubectl.kubernetes.io/last-applied-configuration` annotation; that annotation then
    /// follows the applied configuration. This is how kube-apiserver lets `kubectl apply` move
    /// to `--server-side` without conflicts.
    pub fn finish(
        &self,
        mut new: Value,
        config: &Value,
        force: bool,
    ) -> Result<Value, FieldManagerError> {
        match self.record(&mut new, force) {
            Err(FieldManagerError::Conflicts(conflicts))
                if self.manager == KUBECTL && self.last_applied_allows(&conflicts) =>
            {
                self.record(&mut new, true)?
            }
            other => other?,
        }
        if self.manager == KUBECTL {
            update_last_applied(&mut new, config);
        }
        Ok(new)
    }

    fn last_applied_allows(&self, conflicts: &[Conflict]) -> bool {
        let Some(text) = self.live["metadata"]["annotations"][LAST_APPLIED].as_str() else {
            return false;
        };
        let Ok(last) = serde_json::from_str::<Value>(text) else {
            return false;
        };
        if !last.is_object() || last["apiVersion"].as_str() != Some(self.api_version.as_str()) {
            return false;
        }
        let shape = &self.kind.shape;
        let c = walk::compare(&last, &self.live, shape);
        let allowed = walk::field_set(&last, shape)
            .difference(&c.modified)
            .difference(&c.added)
            .difference(&c.removed);
        conflicts.iter().all(|c| allowed.contains(&c.path))
    }

    /// Writes the managedFields of this apply into `new`; on conflicts `new` keeps none.
    fn record(&self, new: &mut Value, force: bool) -> Result<(), FieldManagerError> {
        if let Some(meta) = new.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("managedFields");
        }
        let mut managed = self.managed.clone();
        managed
            .record_apply(
                &self.kind.shape,
                &self.live,
                new,
                &self.manager,
                &self.api_version,
                &self.applied,
                force,
                &self.now,
            )
            .map_err(FieldManagerError::Conflicts)?;
        set_managed_fields(new, &managed);
        Ok(())
    }
}

/// The manager name kubectl applies with, which kube-apiserver treats specially.
const KUBECTL: &str = "kubectl";
/// Client-side `kubectl apply`'s record of what it applied.
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";
/// kube-apiserver's limit on the total size of an object's annotations.
const MAX_ANNOTATIONS_BYTES: usize = 256 * 1024;

/// JSON with object keys sorted, as Go encodes a map.
fn sorted_json(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            Value::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), sorted_json(&m[k])))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted_json).collect()),
        other => other.clone(),
    }
}

/// Keeps an existing last-applied-configuration annotation in step with server-side applies,
/// dropping it when it would push the annotations over their size limit.
fn update_last_applied(object: &mut Value, config: &Value) {
    let Some(annotations) = object["metadata"]
        .get_mut("annotations")
        .and_then(Value::as_object_mut)
    else {
        return;
    };
    if annotations
        .get(LAST_APPLIED)
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        return;
    }
    let mut applied = config.clone();
    if let Some(a) = applied["metadata"]
        .get_mut("annotations")
        .and_then(Value::as_object_mut)
    {
        a.remove(LAST_APPLIED);
    }
    annotations.insert(
        LAST_APPLIED.into(),
        json!(sorted_json(&applied).to_string()),
    );
    let size: usize = annotations
        .iter()
        .map(|(k, v)| k.len() + v.as_str().map_or(0, str::len))
        .sum();
    if size > MAX_ANNOTATIONS_BYTES {
        annotations.remove(LAST_APPLIED);
    }
}

#[cfg(test)]
mod tests;
