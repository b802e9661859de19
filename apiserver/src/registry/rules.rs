//! Server-side object semantics for writes (pure): type checks, schema validation, name rules,
//! server-authoritative metadata, generation bumps, optimistic concurrency, and field ownership
//! (`managedFields`) and server-side apply through [`crate::fieldmanager`].

use reports_server_crds::ResourceDescriptor;
use serde_json::{Map, Value, json};

use super::error::{Cause, RegistryError};
use super::{ResourceRef, is_dns_subdomain};
use crate::fieldmanager::{self, ApplyPlan, FieldManagerError, KindSchema, Writer, track_update};
use crate::store::Mutation;

/// The field manager of writes the server makes on its own behalf (the in-process aggregator).
pub const INTERNAL_MANAGER: &str = "reports-server";

/// Fields of `metadata` only the server sets.
const SERVER_FIELDS: [&str; 6] = [
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "selfLink",
];

pub fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

fn name_of(object: &Value) -> &str {
    object["metadata"]["name"].as_str().unwrap_or("")
}

/// How to treat unknown and duplicate fields (`fieldValidation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FieldValidation {
    Ignore,
    /// The default: accept, prune, and say so in `Warning` headers.
    #[default]
    Warn,
    Strict,
}

impl FieldValidation {
    pub fn parse(value: Option<&str>) -> Self {
        match value {
            Some("Ignore") => Self::Ignore,
            Some("Strict") => Self::Strict,
            _ => Self::Warn,
        }
    }
}

/// Field validation settings of one request plus the duplicate keys found in its raw body.
#[derive(Clone, Debug, Default)]
pub struct Validation {
    pub mode: FieldValidation,
    pub duplicates: Vec<String>,
}

impl Validation {
    /// `duplicates`: the paths of the keys the request body repeats (see
    /// [`super::fields::parse_noting_duplicates`]); ignored with [`FieldValidation::Ignore`].
    pub fn new(mode: FieldValidation, mut duplicates: Vec<String>) -> Self {
        if mode == FieldValidation::Ignore {
            duplicates.clear();
        }
        Validation { mode, duplicates }
    }

    /// Applies the mode to the problems found: an error for Strict, warnings for Warn.
    fn judge(&self, unknown: Vec<String>) -> Result<Vec<String>, RegistryError> {
        if self.mode == FieldValidation::Ignore {
            return Ok(Vec::new());
        }
        let problems: Vec<String> = unknown
            .into_iter()
            .map(|f| format!("unknown field \"{f}\""))
            .chain(
                self.duplicates
                    .iter()
                    .map(|f| format!("duplicate field \"{f}\"")),
            )
            .collect();
        if self.mode == FieldValidation::Strict && !problems.is_empty() {
            return Err(RegistryError::bad_request(format!(
                "strict decoding error: {}",
                problems.join(", ")
            )));
        }
        Ok(problems)
    }
}

/// Checks `apiVersion`/`kind` (filling them in when absent), the namespace against the URL and
/// the schema; returns the canonical (pruned) object and field-validation warnings.
pub fn check_and_normalize(
    path: &ResourceRef,
    object: Value,
    validation: &Validation,
) -> Result<(Value, Vec<String>), RegistryError> {
    let (sent, kept) = check_and_prune(path, object)?;
    let warnings = validation.judge(super::fields::unknown_fields(&sent, &kept))?;
    Ok((kept, warnings))
}

/// The object as sent (apiVersion, kind and namespace filled in) and as the schema keeps it.
fn check_and_prune(path: &ResourceRef, mut object: Value) -> Result<(Value, Value), RegistryError> {
    let desc = path.resource;
    let Some(map) = object.as_object_mut() else {
        return Err(RegistryError::bad_request(format!(
            "the request body must be a {} object",
            desc.kind
        )));
    };
    let api_version = desc.api_version();
    match map.get("apiVersion").and_then(Value::as_str) {
        None | Some("") => {
            map.insert("apiVersion".into(), json!(api_version));
        }
        Some(v) if v == api_version => {}
        Some(v) => {
            return Err(RegistryError::bad_request(format!(
                "the API version in the data ({v}) does not match the expected API version ({api_version})"
            )));
        }
    }
    match map.get("kind").and_then(Value::as_str) {
        None | Some("") => {
            map.insert("kind".into(), json!(desc.kind));
        }
        Some(k) if k == desc.kind => {}
        Some(k) => {
            return Err(RegistryError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                desc.kind
            )));
        }
    }
    if !map.get("metadata").is_none_or(Value::is_object) {
        return Err(RegistryError::invalid(
            desc,
            "",
            vec![Cause::new(
                "metadata",
                "must be an object",
                "FieldValueInvalid",
            )],
        ));
    }
    let metadata = map
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    // Before any field-set arithmetic: its cost grows with the entries a client may send.
    if let Some(entries) = metadata.get("managedFields").and_then(Value::as_array)
        && entries.len() > crate::fieldmanager::MAX_MANAGED_FIELDS_ENTRIES
    {
        return Err(RegistryError::invalid(
            desc,
            metadata.get("name").and_then(Value::as_str).unwrap_or(""),
            vec![Cause::new(
                "metadata.managedFields",
                format!(
                    "Too many: {}: must have at most {} items",
                    entries.len(),
                    crate::fieldmanager::MAX_MANAGED_FIELDS_ENTRIES
                ),
                "FieldValueTooMany",
            )],
        ));
    }
    match (
        &path.namespace,
        metadata.get("namespace").and_then(Value::as_str),
    ) {
        (Some(url), Some(body)) if !body.is_empty() && body != url => {
            return Err(RegistryError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        (Some(url), _) => metadata["namespace"] = json!(url),
        (None, _) => {
            if let Some(m) = metadata.as_object_mut() {
                m.remove("namespace");
            }
        }
    }
    let kept = desc.normalize(&object).map_err(|e| {
        let reason = if e.message.contains("unknown variant") {
            "FieldValueNotSupported"
        } else {
            "FieldValueInvalid"
        };
        let field = if e.field.is_empty() {
            "<root>".to_owned()
        } else {
            e.field.clone()
        };
        RegistryError::invalid(
            desc,
            name_of(&object),
            vec![Cause::new(field, e.message, reason)],
        )
    })?;
    Ok((object, kept))
}

fn validate_name(desc: &'static ResourceDescriptor, name: &str) -> Result<(), RegistryError> {
    if name.is_empty() {
        return Err(RegistryError::invalid(
            desc,
            name,
            vec![Cause::new(
                "metadata.name",
                "Required value: name or generateName is required",
                "FieldValueRequired",
            )],
        ));
    }
    if !is_dns_subdomain(name) {
        return Err(RegistryError::invalid(
            desc,
            name,
            vec![Cause::new(
                "metadata.name",
                format!(
                    "Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
                ),
                "FieldValueInvalid",
            )],
        ));
    }
    Ok(())
}

fn random_suffix() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    (0..5)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// Prepares an object for creation on behalf of field manager `manager`, who then owns every
/// field (the server's own writes pass [`INTERNAL_MANAGER`]): resolves `generateName`, validates
/// the name and sets the server-owned metadata. Returns the object and its name.
pub fn prepare_create(
    path: &ResourceRef,
    object: Value,
    validation: &Validation,
    manager: &str,
) -> Result<(Value, String, Vec<String>), RegistryError> {
    let desc = path.resource;
    let (mut object, warnings) = check_and_normalize(path, object, validation)?;
    let meta = object["metadata"]
        .as_object_mut()
        .expect("normalized objects have metadata");
    if meta
        .get("resourceVersion")
        .and_then(Value::as_str)
        .is_some_and(|rv| !rv.is_empty())
    {
        return Err(RegistryError::bad_request(
            "resourceVersion should not be set on objects to be created",
        ));
    }
    let mut name = meta
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    if name.is_empty()
        && let Some(prefix) = meta
            .get("generateName")
            .and_then(Value::as_str)
            .filter(|p| !p.is_empty())
    {
        let prefix: String = prefix.chars().take(253 - 5).collect();
        name = format!("{prefix}{}", random_suffix());
    }
    validate_name(desc, &name)?;
    stamp_new(meta, &name);
    let (now, api_version) = (now_rfc3339(), desc.api_version());
    track_update(
        KindSchema::of(desc),
        None,
        &mut object,
        &writer(&api_version, manager, &now),
    );
    Ok((object, name, warnings))
}

/// The server-owned metadata of a new object (also used to seed stores in bulk with objects
/// exactly as a create would have stored them).
pub fn stamp_new(meta: &mut Map<String, Value>, name: &str) {
    for f in SERVER_FIELDS {
        meta.remove(f);
    }
    meta.remove("resourceVersion");
    meta.insert("name".into(), json!(name));
    meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
    meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
    meta.insert("generation".into(), json!(1));
    drop_empty_labels(meta);
}

fn drop_empty_labels(meta: &mut Map<String, Value>) {
    if meta
        .get("labels")
        .is_some_and(|l| l.as_object().is_some_and(|m| m.is_empty()))
    {
        meta.remove("labels");
    }
}

/// Every served kind has one version, so a request's `apiVersion` is the kind's.
fn writer<'a>(api_version: &'a str, manager: &'a str, now: &'a str) -> Writer<'a> {
    Writer {
        manager,
        api_version,
        now,
    }
}

/// Everything but the metadata: what a generation bump looks at.
fn content(object: &Value) -> Map<String, Value> {
    let mut map = object.as_object().cloned().unwrap_or_default();
    map.remove("metadata");
    map.remove("apiVersion");
    map.remove("kind");
    map
}

/// Decides an update of `current` to `desired` (a PUT body or a patched object) on behalf of
/// field manager `manager`, who then owns what it changed (the server's own writes pass
/// [`INTERNAL_MANAGER`]): optimistic concurrency, server-owned metadata, generation bump,
/// finalizer-driven deletion.
pub fn decide_update(
    path: &ResourceRef,
    name: &str,
    current: Option<Value>,
    desired: Value,
    validation: &Validation,
    manager: &str,
) -> Result<(Mutation, Value, Vec<String>), RegistryError> {
    let desc = path.resource;
    let current = current.ok_or_else(|| RegistryError::not_found(desc, name))?;
    let (mut desired, warnings) = check_and_normalize(path, desired, validation)?;
    check_update(path, name, &current, &mut desired)?;
    let (now, api_version) = (now_rfc3339(), desc.api_version());
    track_update(
        KindSchema::of(desc),
        Some(&current),
        &mut desired,
        &writer(&api_version, manager, &now),
    );
    let (mutation, object) = conclude_update(current, desired);
    Ok((mutation, object, warnings))
}

/// Name, optimistic concurrency and UID checks of an update; restores server-owned metadata.
fn check_update(
    path: &ResourceRef,
    name: &str,
    current: &Value,
    desired: &mut Value,
) -> Result<(), RegistryError> {
    let desc = path.resource;
    let body_name = name_of(desired);
    if body_name.is_empty() {
        desired["metadata"]["name"] = json!(name);
    } else if body_name != name {
        return Err(RegistryError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    let current_rv = current["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    match desired["metadata"]["resourceVersion"].as_str() {
        None | Some("") => {
            return Err(RegistryError::invalid(
                desc,
                name,
                vec![Cause::new(
                    "metadata.resourceVersion",
                    "Invalid value: 0x0: must be specified for an update",
                    "FieldValueInvalid",
                )],
            ));
        }
        Some(rv) if rv != current_rv => {
            return Err(RegistryError::conflict(
                desc,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        Some(_) => {}
    }
    if let Some(uid) = desired["metadata"]["uid"]
        .as_str()
        .filter(|u| !u.is_empty())
        && Some(uid) != current["metadata"]["uid"].as_str()
    {
        return Err(RegistryError::conflict(
            desc,
            name,
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                current["metadata"]["uid"].as_str().unwrap_or("")
            ),
        ));
    }
    let meta = desired["metadata"]
        .as_object_mut()
        .expect("normalized objects have metadata");
    for f in SERVER_FIELDS {
        match current["metadata"].get(f) {
            Some(v) => meta.insert(f.to_owned(), v.clone()),
            None => meta.remove(f),
        };
    }
    drop_empty_labels(meta);
    Ok(())
}

/// Generation bump on content changes, deletion once a terminating object has no finalizers
/// left, and no write at all when nothing changed.
fn conclude_update(current: Value, mut desired: Value) -> (Mutation, Value) {
    if content(&desired) != content(&current) {
        let generation = current["metadata"]["generation"].as_i64().unwrap_or(1);
        desired["metadata"]["generation"] = json!(generation + 1);
    }
    let terminating = current["metadata"].get("deletionTimestamp").is_some();
    let no_finalizers = desired["metadata"]["finalizers"]
        .as_array()
        .is_none_or(Vec::is_empty);
    if terminating && no_finalizers {
        return (Mutation::Delete, desired);
    }
    if desired == current {
        return (Mutation::Unchanged, current);
    }
    (Mutation::Put(desired.clone()), desired)
}

/// `group/version, Kind=kind` as Go prints a GroupVersionKind.
fn gvk_string(api_version: &str, kind: &str) -> String {
    let (group, version) = match api_version.split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", api_version),
    };
    format!("{group}/{version}, Kind={kind}")
}

fn apply_error(
    desc: &'static ResourceDescriptor,
    name: &str,
    e: FieldManagerError,
) -> RegistryError {
    match e {
        FieldManagerError::Conflicts(_) => RegistryError::ApplyConflict { source: e },
        FieldManagerError::InvalidConfig(m) => RegistryError::invalid_field(
            desc,
            name,
            "",
            format!("failed to merge the applied configuration: {m}"),
            "FieldValueInvalid",
        ),
        FieldManagerError::CorruptManagedFields(_) => RegistryError::Internal(e.to_string()),
    }
}

/// Decides a server-side apply of `config` (the decoded `application/apply-patch+yaml` body)
/// by field manager `manager`: creates the object when `current` is `None`, otherwise merges
/// the configuration into it. Conflicts with other managers are a 409 unless `force`.
/// An applied configuration: an object (an empty body is an empty one).
fn config_object(desc: &ResourceDescriptor, config: Value) -> Result<Value, RegistryError> {
    match config {
        Value::Null => Ok(Value::Object(Map::new())),
        c @ Value::Object(_) => Ok(c),
        _ => Err(RegistryError::bad_request(format!(
            "the request body must be a {} object",
            desc.kind
        ))),
    }
}

pub fn decide_apply(
    path: &ResourceRef,
    name: &str,
    current: Option<Value>,
    config: Value,
    validation: &Validation,
    manager: &str,
    force: bool,
) -> Result<(Mutation, Vec<String>), RegistryError> {
    let desc = path.resource;
    let api_version = desc.api_version();
    let mut config = config_object(desc, config)?;
    // What the client applied, as kubectl's last-applied-configuration records it.
    let applied = config.clone();
    // Only this kind at this version can be applied here; nothing is filled in.
    let sent_version = config["apiVersion"].as_str().unwrap_or("");
    let sent_kind = config["kind"].as_str().unwrap_or("");
    if sent_version != api_version || sent_kind != desc.kind {
        return Err(RegistryError::bad_request(format!(
            "invalid object type: {}",
            gvk_string(sent_version, sent_kind)
        )));
    }
    let meta = config
        .as_object_mut()
        .expect("checked above")
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    let Some(meta) = meta.as_object_mut() else {
        return Err(RegistryError::invalid(
            desc,
            name,
            vec![Cause::new(
                "metadata",
                "must be an object",
                "FieldValueInvalid",
            )],
        ));
    };
    if meta.get("managedFields").is_some_and(|m| !m.is_null()) {
        return Err(RegistryError::bad_request(
            "metadata.managedFields must be nil",
        ));
    }
    match meta.get("name").and_then(Value::as_str).unwrap_or("") {
        "" if current.is_some() => {
            meta.insert("name".into(), json!(name));
        }
        body if body != name => {
            return Err(RegistryError::bad_request(format!(
                "the name of the object ({body}) does not match the name on the URL ({name})"
            )));
        }
        _ => {}
    }
    match (
        &path.namespace,
        meta.get("namespace").and_then(Value::as_str),
    ) {
        (Some(url), Some(body)) if !body.is_empty() && body != url => {
            return Err(RegistryError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        (Some(url), _) => {
            meta.insert("namespace".into(), json!(url));
        }
        (None, _) => {
            meta.remove("namespace");
        }
    }
    let kind = KindSchema::of(desc);
    let warnings = validation.judge(kind.prune_unknown(&mut config))?;
    if current.is_none()
        && let Some(uid) = config["metadata"]["uid"].as_str().filter(|u| !u.is_empty())
    {
        return Err(RegistryError::conflict(
            desc,
            name,
            &format!(
                "uid mismatch: the provided object specified uid {uid}, and no existing object was found"
            ),
        ));
    }
    let now = now_rfc3339();
    let empty = fieldmanager::empty_object(&api_version, desc.kind);
    let plan = ApplyPlan::begin(
        kind,
        current.as_ref(),
        &empty,
        &config,
        &writer(&api_version, manager, &now),
    )
    .map_err(|e| apply_error(desc, name, e))?;
    let (_, merged) = check_and_prune(path, plan.merged().clone())?;
    match current {
        None => {
            let mut object = merged;
            validate_name(desc, name)?;
            let meta = object["metadata"]
                .as_object_mut()
                .expect("normalized objects have metadata");
            stamp_new(meta, name);
            let object = plan
                .finish(object, &applied, force)
                .map_err(|e| apply_error(desc, name, e))?;
            Ok((Mutation::Put(object), warnings))
        }
        Some(current) => {
            let mut desired = merged;
            check_update(path, name, &current, &mut desired)?;
            let desired = plan
                .finish(desired, &applied, force)
                .map_err(|e| apply_error(desc, name, e))?;
            Ok((conclude_update(current, desired).0, warnings))
        }
    }
}

/// Delete preconditions from a `DeleteOptions` body.
#[derive(Clone, Debug, Default)]
pub struct DeletePreconditions {
    pub uid: Option<String>,
    pub resource_version: Option<String>,
    pub dry_run: bool,
}

impl DeletePreconditions {
    pub fn from_body(body: &Value) -> Result<Self, RegistryError> {
        if body.is_null() {
            return Ok(Self::default());
        }
        if !body.is_object() {
            return Err(RegistryError::bad_request(
                "the request body must be a DeleteOptions object",
            ));
        }
        let dry_run = match &body["dryRun"] {
            Value::Null => false,
            Value::Array(a) if a.is_empty() => false,
            Value::Array(a) if a.len() == 1 && a[0] == "All" => true,
            other => {
                return Err(RegistryError::bad_request(format!(
                    "dryRun: unsupported value {other} (supported: [\"All\"])"
                )));
            }
        };
        if let Some(p) = body["propagationPolicy"].as_str()
            && !matches!(p, "Orphan" | "Background" | "Foreground")
        {
            return Err(RegistryError::bad_request(format!(
                "propagationPolicy: unsupported value {p:?}"
            )));
        }
        let s = |k: &str| {
            body["preconditions"][k]
                .as_str()
                .filter(|v| !v.is_empty())
                .map(str::to_owned)
        };
        Ok(DeletePreconditions {
            uid: s("uid"),
            resource_version: s("resourceVersion"),
            dry_run,
        })
    }
}

/// Decides a delete: preconditions, then immediate removal or, with finalizers, marking.
pub fn decide_delete(
    desc: &'static ResourceDescriptor,
    name: &str,
    current: Option<Value>,
    pre: &DeletePreconditions,
) -> Result<Mutation, RegistryError> {
    let current = current.ok_or_else(|| RegistryError::not_found(desc, name))?;
    let meta = &current["metadata"];
    if let Some(uid) = &pre.uid
        && meta["uid"].as_str() != Some(uid)
    {
        return Err(RegistryError::conflict(
            desc,
            name,
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                meta["uid"].as_str().unwrap_or("")
            ),
        ));
    }
    if let Some(rv) = &pre.resource_version
        && meta["resourceVersion"].as_str() != Some(rv)
    {
        return Err(RegistryError::conflict(
            desc,
            name,
            &format!(
                "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                meta["resourceVersion"].as_str().unwrap_or("")
            ),
        ));
    }
    let has_finalizers = meta["finalizers"].as_array().is_some_and(|f| !f.is_empty());
    if has_finalizers {
        if meta.get("deletionTimestamp").is_some() {
            return Ok(Mutation::Unchanged);
        }
        let mut marked = current.clone();
        marked["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
        marked["metadata"]["deletionGracePeriodSeconds"] = json!(0);
        return Ok(Mutation::Put(marked));
    }
    Ok(Mutation::Delete)
}

#[cfg(test)]
mod tests {
    use super::*;
    use reports_server_crds::catalog;

    const V: Validation = Validation {
        mode: FieldValidation::Warn,
        duplicates: Vec::new(),
    };

    #[test]
    fn field_validation_modes() {
        let p = path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports");
        let body = json!({"metadata": {"name": "x"}, "summry": {"pass": 1}});
        let (obj, _, warnings) = prepare_create(&p, body.clone(), &V, INTERNAL_MANAGER).unwrap();
        assert_eq!(warnings, ["unknown field \"summry\""]);
        assert!(obj.get("summry").is_none());
        let strict = Validation {
            mode: FieldValidation::Strict,
            duplicates: vec!["metadata.name".into()],
        };
        let err = prepare_create(&p, body.clone(), &strict, INTERNAL_MANAGER).unwrap_err();
        assert_eq!(err.reason(), "BadRequest");
        assert!(
            err.to_string().contains("unknown field \"summry\"")
                && err
                    .to_string()
                    .contains("duplicate field \"metadata.name\""),
            "{}",
            err.to_string()
        );
        let ignore = Validation {
            mode: FieldValidation::Ignore,
            duplicates: Vec::new(),
        };
        assert!(
            prepare_create(&p, body, &ignore, INTERNAL_MANAGER)
                .unwrap()
                .2
                .is_empty()
        );
    }

    /// The collection a path after `/apis/` names (object names are passed separately).
    fn path(p: &str) -> ResourceRef {
        let segments: Vec<&str> = p.split('/').collect();
        let (group, version, namespace, plural) = match segments.as_slice() {
            [g, v, "namespaces", ns, plural, ..] => (*g, *v, *ns, *plural),
            [g, v, plural, ..] => (*g, *v, "", *plural),
            _ => panic!("{p}"),
        };
        ResourceRef::new(catalog::find(group, version, plural).unwrap(), namespace)
    }

    #[test]
    fn create_sets_server_metadata_and_generate_name() {
        let p = path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports");
        let (obj, name, _) = prepare_create(
            &p,
            json!({"metadata": {"generateName": "r-", "uid": "mine"}}),
            &V,
            INTERNAL_MANAGER,
        )
        .unwrap();
        assert!(name.starts_with("r-") && name.len() == 7, "{name}");
        assert_eq!(obj["metadata"]["namespace"], "ns");
        assert_eq!(obj["metadata"]["generation"], 1);
        assert_ne!(obj["metadata"]["uid"], "mine");
        assert_eq!(obj["apiVersion"], "wgpolicyk8s.io/v1alpha2");
    }

    #[test]
    fn create_rejects_bad_input() {
        let p = path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports");
        assert_eq!(
            prepare_create(&p, json!({"metadata": {}}), &V, INTERNAL_MANAGER)
                .unwrap_err()
                .reason(),
            "Invalid"
        );
        assert_eq!(
            prepare_create(
                &p,
                json!({"metadata": {"name": "Bad_Name"}}),
                &V,
                INTERNAL_MANAGER
            )
            .unwrap_err()
            .reason(),
            "Invalid"
        );
        assert_eq!(
            prepare_create(
                &p,
                json!({"kind": "Pod", "metadata": {"name": "x"}}),
                &V,
                INTERNAL_MANAGER
            )
            .unwrap_err()
            .reason(),
            "BadRequest"
        );
        assert_eq!(
            prepare_create(
                &p,
                json!({"metadata": {"name": "x", "namespace": "other"}}),
                &V,
                INTERNAL_MANAGER
            )
            .unwrap_err()
            .reason(),
            "BadRequest"
        );
        let err = prepare_create(
            &p,
            json!({"metadata": {"name": "x"}, "results": [{"policy": "p", "result": "maybe"}]}),
            &V,
            INTERNAL_MANAGER,
        )
        .unwrap_err();
        assert_eq!(err.reason(), "Invalid");
        assert_eq!(err.causes()[0].field, "results[0].result");
    }

    #[test]
    fn update_semantics() {
        let p = path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports/x");
        let current = json!({"apiVersion": "wgpolicyk8s.io/v1alpha2", "kind": "PolicyReport",
            "metadata": {"name": "x", "namespace": "ns", "uid": "u", "resourceVersion": "5", "generation": 1, "creationTimestamp": "2024-01-01T00:00:00Z"},
            "summary": {"pass": 1}});
        // stale
        let mut stale = current.clone();
        stale["metadata"]["resourceVersion"] = json!("4");
        assert_eq!(
            decide_update(&p, "x", Some(current.clone()), stale, &V, INTERNAL_MANAGER)
                .unwrap_err()
                .reason(),
            "Conflict"
        );
        // missing rv
        let mut norv = current.clone();
        norv["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("resourceVersion");
        assert_eq!(
            decide_update(&p, "x", Some(current.clone()), norv, &V, INTERNAL_MANAGER)
                .unwrap_err()
                .reason(),
            "Invalid"
        );
        // label-only change keeps generation
        let mut relabel = current.clone();
        relabel["metadata"]["labels"] = json!({"a": "b"});
        let (_, out, _) = decide_update(
            &p,
            "x",
            Some(current.clone()),
            relabel,
            &V,
            INTERNAL_MANAGER,
        )
        .unwrap();
        assert_eq!(out["metadata"]["generation"], 1);
        // content change bumps generation, server fields kept
        let mut changed = current.clone();
        changed["summary"]["pass"] = json!(2);
        changed["metadata"]["uid"] = json!("u");
        changed["metadata"]["creationTimestamp"] = json!("2030-01-01T00:00:00Z");
        let (m, out, _) = decide_update(
            &p,
            "x",
            Some(current.clone()),
            changed,
            &V,
            INTERNAL_MANAGER,
        )
        .unwrap();
        assert!(matches!(m, Mutation::Put(_)));
        assert_eq!(out["metadata"]["generation"], 2);
        assert_eq!(out["metadata"]["creationTimestamp"], "2024-01-01T00:00:00Z");
        // identical → no-op
        assert!(matches!(
            decide_update(
                &p,
                "x",
                Some(current.clone()),
                current.clone(),
                &V,
                INTERNAL_MANAGER
            )
            .unwrap()
            .0,
            Mutation::Unchanged
        ));
        // missing → 404
        assert_eq!(
            decide_update(&p, "x", None, current, &V, INTERNAL_MANAGER)
                .unwrap_err()
                .reason(),
            "NotFound"
        );
    }

    fn apply_config(extra: Value) -> Value {
        let mut c = json!({"apiVersion": "wgpolicyk8s.io/v1alpha2", "kind": "PolicyReport",
            "metadata": {"name": "x", "namespace": "ns"}});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    fn stored(m: Mutation) -> Value {
        let Mutation::Put(mut o) = m else {
            panic!("expected a write")
        };
        o["metadata"]["resourceVersion"] = json!("7");
        o
    }

    #[test]
    fn apply_creates_with_server_metadata_and_an_apply_entry() {
        let p = path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports/x");
        let c = apply_config(
            json!({"summary": {"pass": 1}, "metadata": {"name": "x", "resourceVersion": "3"}}),
        );
        let (m, warnings) = decide_apply(&p, "x", None, c, &V, "kubectl", false).unwrap();
        assert!(warnings.is_empty());
        let obj = stored(m);
        assert_eq!(obj["metadata"]["generation"], 1);
        assert_eq!(obj["metadata"]["namespace"], "ns");
        assert!(
            obj["metadata"]["uid"]
                .as_str()
                .is_some_and(|u| u.len() == 36)
        );
        assert!(obj["metadata"]["creationTimestamp"].is_string());
        let mf = &obj["metadata"]["managedFields"];
        assert_eq!(mf.as_array().unwrap().len(), 1, "{mf}");
        assert_eq!(mf[0]["manager"], "kubectl");
        assert_eq!(mf[0]["operation"], "Apply");
        assert_eq!(mf[0]["apiVersion"], "wgpolicyk8s.io/v1alpha2");
        assert_eq!(mf[0]["fieldsType"], "FieldsV1");
        assert_eq!(mf[0]["fieldsV1"], json!({"f:summary": {"f:pass": {}}}));
    }

    #[test]
    fn apply_rejects_what_kube_apiserver_rejects() {
        let p = path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports/x");
        let apply = |c: Value| decide_apply(&p, "x", None, c, &V, "m", false).unwrap_err();
        let mut wrong = apply_config(json!({}));
        wrong["kind"] = json!("ClusterPolicyReport");
        let e = apply(wrong);
        assert_eq!(
            (e.reason(), e.to_string()),
            (
                "BadRequest",
                "invalid object type: wgpolicyk8s.io/v1alpha2, Kind=ClusterPolicyReport".to_owned()
            )
        );
        let e = apply(json!({"metadata": {"name": "x"}}));
        assert_eq!(e.to_string(), "invalid object type: /, Kind=");
        let e = apply(apply_config(
            json!({"metadata": {"name": "x", "managedFields": []}}),
        ));
        assert_eq!(
            (e.reason(), e.to_string()),
            (
                "BadRequest",
                "metadata.managedFields must be nil".to_owned()
            )
        );
        let e = apply(apply_config(json!({"metadata": {"name": "y"}})));
        assert_eq!(
            e.to_string(),
            "the name of the object (y) does not match the name on the URL (x)"
        );
        let e = apply(apply_config(json!({"metadata": {}})));
        assert_eq!(e.reason(), "BadRequest", "a create needs the name");
        let e = apply(apply_config(
            json!({"metadata": {"name": "x", "namespace": "other"}}),
        ));
        assert_eq!(e.reason(), "BadRequest");
        let e = apply(apply_config(
            json!({"metadata": {"name": "x", "uid": "abc"}}),
        ));
        assert_eq!(e.reason(), "Conflict");
        assert!(e.to_string().contains("uid mismatch"), "{}", e.to_string());
        let e = apply(apply_config(
            json!({"results": [{"policy": "p", "result": "maybe"}]}),
        ));
        assert_eq!(e.reason(), "Invalid");
        let strict = Validation {
            mode: FieldValidation::Strict,
            duplicates: Vec::new(),
        };
        let e = decide_apply(
            &p,
            "x",
            None,
            apply_config(json!({"summry": {}})),
            &strict,
            "m",
            false,
        )
        .unwrap_err();
        assert_eq!(
            (e.reason(), e.to_string()),
            (
                "BadRequest",
                "strict decoding error: unknown field \"summry\"".to_owned()
            )
        );
        let (_, warnings) = decide_apply(
            &p,
            "x",
            None,
            apply_config(json!({"summry": {}})),
            &V,
            "m",
            false,
        )
        .unwrap();
        assert_eq!(warnings, ["unknown field \"summry\""]);
    }

    #[test]
    fn apply_updates_with_conflicts_concurrency_and_generation() {
        let p = path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports/x");
        let created = stored(
            decide_apply(
                &p,
                "x",
                None,
                apply_config(json!({"summary": {"pass": 1}})),
                &V,
                "a",
                false,
            )
            .unwrap()
            .0,
        );
        // Same configuration again: nothing to write.
        let (m, _) = decide_apply(
            &p,
            "x",
            Some(created.clone()),
            apply_config(json!({"summary": {"pass": 1}})),
            &V,
            "a",
            false,
        )
        .unwrap();
        assert!(matches!(m, Mutation::Unchanged));
        // Another manager changing the field: 409 with a FieldManagerConflict cause.
        let e = decide_apply(
            &p,
            "x",
            Some(created.clone()),
            apply_config(json!({"summary": {"pass": 2}})),
            &V,
            "b",
            false,
        )
        .unwrap_err();
        assert_eq!(e.reason(), "Conflict");
        assert_eq!(
            e.to_string(),
            "Apply failed with 1 conflict: conflict with \"a\": .summary.pass"
        );
        assert!(matches!(e, RegistryError::ApplyConflict { .. }), "{e:?}");
        // Forced: content change bumps the generation.
        let forced = stored(
            decide_apply(
                &p,
                "x",
                Some(created.clone()),
                apply_config(json!({"summary": {"pass": 2}})),
                &V,
                "b",
                true,
            )
            .unwrap()
            .0,
        );
        assert_eq!(forced["metadata"]["generation"], 2);
        assert_eq!(forced["metadata"]["uid"], created["metadata"]["uid"]);
        // Labels only: same generation.
        let relabelled = stored(
            decide_apply(
                &p,
                "x",
                Some(forced.clone()),
                apply_config(json!({"metadata": {"name": "x", "labels": {"l": "v"}}})),
                &V,
                "c",
                false,
            )
            .unwrap()
            .0,
        );
        assert_eq!(relabelled["metadata"]["generation"], 2);
        // A stale resourceVersion in the configuration: 409; the current one: fine.
        let stale = apply_config(
            json!({"metadata": {"name": "x", "resourceVersion": "1"}, "summary": {"pass": 2}}),
        );
        assert_eq!(
            decide_apply(&p, "x", Some(relabelled.clone()), stale, &V, "b", false)
                .unwrap_err()
                .reason(),
            "Conflict"
        );
        let fresh = apply_config(
            json!({"metadata": {"name": "x", "resourceVersion": "7"}, "summary": {"pass": 2}}),
        );
        assert!(decide_apply(&p, "x", Some(relabelled), fresh, &V, "b", false).is_ok());
    }

    #[test]
    fn apply_merges_partial_configurations_of_ephemeral_reports() {
        let p = path("reports.kyverno.io/v1/namespaces/ns/ephemeralreports/e");
        let owner = json!({"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u"});
        let full = json!({"apiVersion": "reports.kyverno.io/v1", "kind": "EphemeralReport", "metadata": {"name": "e"},
            "spec": {"owner": owner, "summary": {"pass": 1}}});
        let created = stored(
            decide_apply(&p, "e", None, full, &V, "kyverno", false)
                .unwrap()
                .0,
        );
        let partial = json!({"apiVersion": "reports.kyverno.io/v1", "kind": "EphemeralReport", "metadata": {"name": "e"},
            "spec": {"summary": {"fail": 1}}});
        let updated = stored(
            decide_apply(&p, "e", Some(created), partial, &V, "other", false)
                .unwrap()
                .0,
        );
        assert_eq!(updated["spec"]["owner"], owner);
        assert_eq!(updated["spec"]["summary"], json!({"pass": 1, "fail": 1}));
    }

    #[test]
    fn writes_record_their_field_manager() {
        let p = path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports/x");
        let (created, _, _) = prepare_create(
            &p,
            json!({"metadata": {"name": "x"}, "summary": {"pass": 1}}),
            &V,
            "kubectl-create",
        )
        .unwrap();
        assert_eq!(
            created["metadata"]["managedFields"][0]["manager"],
            "kubectl-create"
        );
        assert_eq!(
            created["metadata"]["managedFields"][0]["operation"],
            "Update"
        );
        let mut current = created.clone();
        current["metadata"]["resourceVersion"] = json!("5");
        let mut put = current.clone();
        put["summary"]["pass"] = json!(2);
        let (_, out, _) = decide_update(&p, "x", Some(current.clone()), put, &V, "editor").unwrap();
        let managers: Vec<&str> = out["metadata"]["managedFields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["manager"].as_str().unwrap())
            .collect();
        assert_eq!(managers.len(), 2);
        assert!(managers.contains(&"editor"));
        // A body without managedFields keeps the stored ones; a no-op stays a no-op.
        let mut bare = current.clone();
        bare["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("managedFields");
        assert!(matches!(
            decide_update(&p, "x", Some(current), bare, &V, "editor")
                .unwrap()
                .0,
            Mutation::Unchanged
        ));
    }

    #[test]
    fn delete_with_finalizers_marks_then_removes() {
        let desc = &catalog::POLICY_REPORT;
        let obj = json!({"metadata": {"name": "x", "uid": "u", "resourceVersion": "3", "finalizers": ["f"]}});
        let Mutation::Put(marked) =
            decide_delete(desc, "x", Some(obj.clone()), &Default::default()).unwrap()
        else {
            panic!()
        };
        assert!(marked["metadata"]["deletionTimestamp"].is_string());
        let pre = DeletePreconditions {
            uid: Some("other".into()),
            ..Default::default()
        };
        assert_eq!(
            decide_delete(desc, "x", Some(obj), &pre)
                .unwrap_err()
                .reason(),
            "Conflict"
        );
        let plain = json!({"metadata": {"name": "x"}});
        assert!(matches!(
            decide_delete(desc, "x", Some(plain), &Default::default()).unwrap(),
            Mutation::Delete
        ));
    }
}
