//! Server-side object semantics for writes (pure): type checks, schema validation, name rules,
//! server-authoritative metadata, generation bumps and optimistic concurrency.

use reports_server_crds::ResourceDescriptor;
use serde_json::{Map, Value, json};

use super::request::{ResourcePath, is_dns_subdomain};
use super::status::ApiError;
use crate::store::Mutation;

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
    pub fn new(mode: FieldValidation, raw_json: Option<&[u8]>) -> Self {
        let duplicates = match (mode, raw_json) {
            (FieldValidation::Ignore, _) | (_, None) => Vec::new(),
            (_, Some(raw)) => super::fields::duplicate_fields(raw),
        };
        Validation { mode, duplicates }
    }

    /// Applies the mode to the problems found: an error for Strict, warnings for Warn.
    fn judge(&self, unknown: Vec<String>) -> Result<Vec<String>, ApiError> {
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
            return Err(ApiError::bad_request(format!(
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
    path: &ResourcePath,
    object: Value,
    validation: &Validation,
) -> Result<(Value, Vec<String>), ApiError> {
    let sent = object.clone();
    let kept = check_and_prune(path, object)?;
    let warnings = validation.judge(super::fields::unknown_fields(&sent, &kept))?;
    Ok((kept, warnings))
}

fn check_and_prune(path: &ResourcePath, mut object: Value) -> Result<Value, ApiError> {
    let desc = path.resource;
    let Some(map) = object.as_object_mut() else {
        return Err(ApiError::bad_request(format!(
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
            return Err(ApiError::bad_request(format!(
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
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                desc.kind
            )));
        }
    }
    if !map.get("metadata").is_none_or(Value::is_object) {
        return Err(ApiError::invalid(
            desc,
            "",
            vec![(
                "metadata".into(),
                "must be an object".into(),
                "FieldValueInvalid",
            )],
        ));
    }
    let metadata = map
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    match (
        &path.namespace,
        metadata.get("namespace").and_then(Value::as_str),
    ) {
        (Some(url), Some(body)) if !body.is_empty() && body != url => {
            return Err(ApiError::bad_request(
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
    let name = name_of(&object).to_owned();
    desc.normalize(object).map_err(|e| {
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
        ApiError::invalid(desc, &name, vec![(field, e.message, reason)])
    })
}

fn validate_name(desc: &ResourceDescriptor, name: &str) -> Result<(), ApiError> {
    if name.is_empty() {
        return Err(ApiError::invalid(
            desc,
            name,
            vec![(
                "metadata.name".into(),
                "Required value: name or generateName is required".into(),
                "FieldValueRequired",
            )],
        ));
    }
    if !is_dns_subdomain(name) {
        return Err(ApiError::invalid(
            desc,
            name,
            vec![(
                "metadata.name".into(),
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

/// Prepares an object for creation: resolves `generateName`, validates the name and sets the
/// server-owned metadata. Returns the object and its name.
pub fn prepare_create(
    path: &ResourcePath,
    object: Value,
    validation: &Validation,
) -> Result<(Value, String, Vec<String>), ApiError> {
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
        return Err(ApiError::bad_request(
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
    for f in SERVER_FIELDS {
        meta.remove(f);
    }
    meta.remove("managedFields");
    meta.insert("name".into(), json!(name));
    meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
    meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
    meta.insert("generation".into(), json!(1));
    if meta
        .get("labels")
        .is_some_and(|l| l.as_object().is_some_and(|m| m.is_empty()))
    {
        meta.remove("labels");
    }
    Ok((object, name, warnings))
}

/// Everything but the metadata: what a generation bump looks at.
fn content(object: &Value) -> Map<String, Value> {
    let mut map = object.as_object().cloned().unwrap_or_default();
    map.remove("metadata");
    map.remove("apiVersion");
    map.remove("kind");
    map
}

/// Decides an update of `current` to `desired` (a PUT body or a patched object): optimistic
/// concurrency, server-owned metadata, generation bump, finalizer-driven deletion.
pub fn decide_update(
    path: &ResourcePath,
    name: &str,
    current: Option<Value>,
    desired: Value,
    validation: &Validation,
) -> Result<(Mutation, Value, Vec<String>), ApiError> {
    let desc = path.resource;
    let current = current.ok_or_else(|| ApiError::not_found(desc, name))?;
    let (mut desired, warnings) = check_and_normalize(path, desired, validation)?;
    let body_name = name_of(&desired);
    if body_name.is_empty() {
        desired["metadata"]["name"] = json!(name);
    } else if body_name != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    let current_rv = current["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    match desired["metadata"]["resourceVersion"].as_str() {
        None | Some("") => {
            return Err(ApiError::invalid(
                desc,
                name,
                vec![(
                    "metadata.resourceVersion".into(),
                    "Invalid value: 0x0: must be specified for an update".into(),
                    "FieldValueInvalid",
                )],
            ));
        }
        Some(rv) if rv != current_rv => {
            return Err(ApiError::conflict(
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
        return Err(ApiError::conflict(
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
    meta.remove("managedFields");
    if meta
        .get("labels")
        .is_some_and(|l| l.as_object().is_some_and(|m| m.is_empty()))
    {
        meta.remove("labels");
    }
    if content(&desired) != content(&current) {
        let generation = current["metadata"]["generation"].as_i64().unwrap_or(1);
        desired["metadata"]["generation"] = json!(generation + 1);
    }
    let terminating = current["metadata"].get("deletionTimestamp").is_some();
    let no_finalizers = desired["metadata"]["finalizers"]
        .as_array()
        .is_none_or(Vec::is_empty);
    if terminating && no_finalizers {
        return Ok((Mutation::Delete, desired, warnings));
    }
    if desired == current {
        return Ok((Mutation::Unchanged, current, warnings));
    }
    Ok((Mutation::Put(desired.clone()), desired, warnings))
}

/// Delete preconditions from a `DeleteOptions` body.
#[derive(Clone, Debug, Default)]
pub struct DeletePreconditions {
    pub uid: Option<String>,
    pub resource_version: Option<String>,
    pub dry_run: bool,
}

impl DeletePreconditions {
    pub fn from_body(body: &Value) -> Result<Self, ApiError> {
        if body.is_null() {
            return Ok(Self::default());
        }
        if !body.is_object() {
            return Err(ApiError::bad_request(
                "the request body must be a DeleteOptions object",
            ));
        }
        let dry_run = match &body["dryRun"] {
            Value::Null => false,
            Value::Array(a) if a.is_empty() => false,
            Value::Array(a) if a.len() == 1 && a[0] == "All" => true,
            other => {
                return Err(ApiError::bad_request(format!(
                    "dryRun: unsupported value {other} (supported: [\"All\"])"
                )));
            }
        };
        if let Some(p) = body["propagationPolicy"].as_str()
            && !matches!(p, "Orphan" | "Background" | "Foreground")
        {
            return Err(ApiError::bad_request(format!(
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
    desc: &ResourceDescriptor,
    name: &str,
    current: Option<Value>,
    pre: &DeletePreconditions,
) -> Result<Mutation, ApiError> {
    let current = current.ok_or_else(|| ApiError::not_found(desc, name))?;
    let meta = &current["metadata"];
    if let Some(uid) = &pre.uid
        && meta["uid"].as_str() != Some(uid)
    {
        return Err(ApiError::conflict(
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
        return Err(ApiError::conflict(
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
    use crate::http::request::parse_path;

    const V: Validation = Validation {
        mode: FieldValidation::Warn,
        duplicates: Vec::new(),
    };

    #[test]
    fn field_validation_modes() {
        let p = path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports");
        let body = json!({"metadata": {"name": "x"}, "summry": {"pass": 1}});
        let (obj, _, warnings) = prepare_create(&p, body.clone(), &V).unwrap();
        assert_eq!(warnings, ["unknown field \"summry\""]);
        assert!(obj.get("summry").is_none());
        let strict = Validation {
            mode: FieldValidation::Strict,
            duplicates: vec!["metadata.name".into()],
        };
        let err = prepare_create(&p, body.clone(), &strict).unwrap_err();
        assert_eq!(err.code, 400);
        assert!(
            err.message.contains("unknown field \"summry\"")
                && err.message.contains("duplicate field \"metadata.name\""),
            "{}",
            err.message
        );
        let ignore = Validation {
            mode: FieldValidation::Ignore,
            duplicates: Vec::new(),
        };
        assert!(prepare_create(&p, body, &ignore).unwrap().2.is_empty());
    }

    fn path(p: &str) -> ResourcePath {
        parse_path(p).unwrap()
    }

    #[test]
    fn create_sets_server_metadata_and_generate_name() {
        let p = path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports");
        let (obj, name, _) = prepare_create(
            &p,
            json!({"metadata": {"generateName": "r-", "uid": "mine"}}),
            &V,
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
            prepare_create(&p, json!({"metadata": {}}), &V)
                .unwrap_err()
                .code,
            422
        );
        assert_eq!(
            prepare_create(&p, json!({"metadata": {"name": "Bad_Name"}}), &V)
                .unwrap_err()
                .code,
            422
        );
        assert_eq!(
            prepare_create(&p, json!({"kind": "Pod", "metadata": {"name": "x"}}), &V)
                .unwrap_err()
                .code,
            400
        );
        assert_eq!(
            prepare_create(
                &p,
                json!({"metadata": {"name": "x", "namespace": "other"}}),
                &V
            )
            .unwrap_err()
            .code,
            400
        );
        let err = prepare_create(
            &p,
            json!({"metadata": {"name": "x"}, "results": [{"policy": "p", "result": "maybe"}]}),
            &V,
        )
        .unwrap_err();
        assert_eq!(err.code, 422);
        assert_eq!(
            err.details.unwrap()["causes"][0]["field"],
            "results[0].result"
        );
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
            decide_update(&p, "x", Some(current.clone()), stale, &V)
                .unwrap_err()
                .code,
            409
        );
        // missing rv
        let mut norv = current.clone();
        norv["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("resourceVersion");
        assert_eq!(
            decide_update(&p, "x", Some(current.clone()), norv, &V)
                .unwrap_err()
                .code,
            422
        );
        // label-only change keeps generation
        let mut relabel = current.clone();
        relabel["metadata"]["labels"] = json!({"a": "b"});
        let (_, out, _) = decide_update(&p, "x", Some(current.clone()), relabel, &V).unwrap();
        assert_eq!(out["metadata"]["generation"], 1);
        // content change bumps generation, server fields kept
        let mut changed = current.clone();
        changed["summary"]["pass"] = json!(2);
        changed["metadata"]["uid"] = json!("u");
        changed["metadata"]["creationTimestamp"] = json!("2030-01-01T00:00:00Z");
        let (m, out, _) = decide_update(&p, "x", Some(current.clone()), changed, &V).unwrap();
        assert!(matches!(m, Mutation::Put(_)));
        assert_eq!(out["metadata"]["generation"], 2);
        assert_eq!(out["metadata"]["creationTimestamp"], "2024-01-01T00:00:00Z");
        // identical → no-op
        assert!(matches!(
            decide_update(&p, "x", Some(current.clone()), current.clone(), &V)
                .unwrap()
                .0,
            Mutation::Unchanged
        ));
        // missing → 404
        assert_eq!(
            decide_update(&p, "x", None, current, &V).unwrap_err().code,
            404
        );
    }

    #[test]
    fn delete_with_finalizers_marks_then_removes() {
        let desc = &reports_server_crds::catalog::POLICY_REPORT;
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
            decide_delete(desc, "x", Some(obj), &pre).unwrap_err().code,
            409
        );
        let plain = json!({"metadata": {"name": "x"}});
        assert!(matches!(
            decide_delete(desc, "x", Some(plain), &Default::default()).unwrap(),
            Mutation::Delete
        ));
    }
}
