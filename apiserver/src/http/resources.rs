//! Handlers for the resource verbs: get, list, create, update, patch, delete, deletecollection
//! (watch lives in `watch.rs`).

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};

use super::AppState;
use super::negotiate::{Encoding, Negotiated, Representation, Target, negotiate};
use super::objects::{
    DeletePreconditions, FieldValidation, Validation, decide_apply, decide_delete,
    decide_update_as, prepare_create_as,
};
use super::request::{Params, ResourcePath, decode_body};
use super::status::ApiError;
use super::table::{self, IncludeObject};
use crate::continuation::{ContinueToken, TokenError, query_fingerprint};
use crate::fieldmanager;
use crate::store::{EventType, ListQuery, ListRow, Mutation, Store, StoreError};

pub fn accept(headers: &HeaderMap, target: Target) -> Result<Negotiated, ApiError> {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    negotiate(accept, target).map_err(|_| ApiError::not_acceptable(accept.unwrap_or("")))
}

pub fn include_object(params: &Params) -> Result<IncludeObject, ApiError> {
    match &params.include_object {
        None => Ok(IncludeObject::default()),
        Some(s) => IncludeObject::parse(s).ok_or_else(|| {
            ApiError::bad_request(format!(
                "includeObject: unsupported value {s:?} (None, Metadata, Object)"
            ))
        }),
    }
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

/// Encodes a response body in the negotiated encoding.
pub fn encode(code: StatusCode, n: Negotiated, list: bool, body: &Value) -> Response {
    let bytes = match n.encoding {
        Encoding::Json => serde_json::to_vec(body).expect("JSON values serialize"),
        Encoding::Yaml => serde_yaml::to_string(body)
            .expect("JSON values serialize as YAML")
            .into_bytes(),
    };
    let mut response = (code, bytes).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_str(&n.content_type(list)).expect("ASCII content type"),
    );
    response
}

/// Renders one object in the negotiated representation.
pub fn render_object(
    path: &ResourcePath,
    n: Negotiated,
    include: IncludeObject,
    object: &Value,
) -> Value {
    match n.representation {
        Representation::Object | Representation::Discovery(_) => object.clone(),
        Representation::Metadata(v) => table::partial_metadata(v, object["metadata"].clone()),
        Representation::Table(v) => {
            let rv = object["metadata"]["resourceVersion"].as_str().unwrap_or("");
            table::table(
                path.resource,
                v,
                vec![table::row(path.resource, object, include, v, now())],
                rv,
                None,
            )
        }
    }
}

fn respond_object(
    code: StatusCode,
    path: &ResourcePath,
    n: Negotiated,
    include: IncludeObject,
    object: &Value,
) -> Response {
    encode(code, n, false, &render_object(path, n, include, object))
}

/// A partial object good enough for table cells: metadata plus the indexed columns.
pub fn table_source(path: &ResourcePath, row: &ListRow) -> Result<Value, ApiError> {
    let metadata: Value = serde_json::from_str(&row.metadata)
        .map_err(|e| ApiError::internal(format!("stored metadata is corrupt: {e}")))?;
    let [pass, fail, warn, error, skip] = row.summary;
    let summary = json!({"pass": pass, "fail": fail, "warn": warn, "error": error, "skip": skip});
    Ok(match path.resource.layout {
        reports_server_crds::ReportLayout::TopLevel => json!({
            "metadata": metadata,
            "scope": {"kind": row.scope_kind, "name": row.scope_name},
            "summary": summary,
        }),
        reports_server_crds::ReportLayout::Spec => {
            json!({"metadata": metadata, "spec": {"summary": summary}})
        }
    })
}

pub async fn get(
    state: &AppState,
    path: &ResourcePath,
    params: &Params,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Object)?;
    let include = include_object(params)?;
    let name = path.name.as_deref().expect("get has a name");
    let object = state
        .store
        .get_object(path.resource, path.object_namespace(), name)
        .await?
        .ok_or_else(|| ApiError::not_found(path.resource, name))?;
    Ok(respond_object(StatusCode::OK, path, n, include, &object))
}

fn list_query(
    path: &ResourcePath,
    params: &Params,
    metadata_only: bool,
) -> Result<(ListQuery, String, Option<ContinueToken>), ApiError> {
    let fingerprint = query_fingerprint(
        &Store::resource_key(path.resource),
        path.namespace.as_deref(),
        &params.labels.to_string(),
        &params.fields.to_string(),
    );
    let token = match &params.continue_token {
        Some(t) => Some(ContinueToken::decode(t, &fingerprint).map_err(|e| match e {
            TokenError::Malformed(_) | TokenError::QueryMismatch => {
                ApiError::bad_request(e.to_string())
            }
        })?),
        None => None,
    };
    let query = ListQuery {
        resource: path.resource,
        namespace: path.namespace.clone(),
        labels: params.labels.clone(),
        fields: params.fields.clone(),
        limit: params.limit,
        after: token
            .as_ref()
            .map(|t| (t.namespace.clone(), t.name.clone())),
        metadata_only,
    };
    Ok((query, fingerprint, token))
}

/// Checks a list's `resourceVersion`/`resourceVersionMatch` against what the store can serve.
fn check_list_version(params: &Params, current: i64, compacted: i64) -> Result<(), ApiError> {
    let Some(rv) = params.resource_version.as_deref() else {
        if params.resource_version_match.is_some() {
            return Err(ApiError::bad_request(
                "resourceVersionMatch is forbidden unless resourceVersion is provided",
            ));
        }
        return Ok(());
    };
    let n: i64 = rv
        .parse()
        .map_err(|_| ApiError::bad_request(format!("resourceVersion: invalid value {rv:?}")))?;
    if n > current {
        return Err(ApiError::new(StatusCode::GATEWAY_TIMEOUT, "Timeout", format!("Too large resource version: {n}, current: {current}"))
            .with_details(json!({"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}], "retryAfterSeconds": 1})));
    }
    if params.resource_version_match.as_deref() == Some("Exact") && n != current {
        // The store serves the live table only; an older exact snapshot is gone, as after an
        // etcd compaction.
        return Err(ApiError::gone(format!(
            "The resourceVersion for the provided list is too old: {n} (current {current}, compacted {compacted})"
        )));
    }
    Ok(())
}

pub async fn list(
    state: &AppState,
    path: &ResourcePath,
    params: &Params,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Collection)?;
    let include = include_object(params)?;
    let metadata_only = matches!(
        n.representation,
        Representation::Metadata(_) | Representation::Table(_)
    ) && include != IncludeObject::Object;
    let (query, fingerprint, token) = list_query(path, params, metadata_only)?;
    let (current, compacted) = state.store.versions().await?;
    check_list_version(params, current, compacted)?;
    let page = state.store.list(&query).await?;
    let list_rv = match &token {
        Some(t) => t.resource_version,
        None => page.resource_version,
    };
    let next = match (page.more, page.rows.last()) {
        (true, Some(last)) => Some(
            ContinueToken {
                resource_version: list_rv,
                namespace: last.namespace.clone(),
                name: last.name.clone(),
                query: fingerprint,
            }
            .encode(),
        ),
        _ => None,
    };
    let rv_string = list_rv.to_string();
    match n.representation {
        Representation::Object | Representation::Discovery(_) if n.encoding == Encoding::Json => {
            // Fast path: stored bodies are spliced in without decoding.
            let mut out = String::with_capacity(
                page.rows.iter().map(|r| r.body.len() + 1).sum::<usize>() + 256,
            );
            out.push_str(&format!(
                "{{\"apiVersion\":\"{}\",\"items\":[",
                path.resource.api_version()
            ));
            for (i, row) in page.rows.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&row.body);
            }
            let mut metadata = json!({"resourceVersion": rv_string});
            if let Some(c) = &next {
                metadata["continue"] = json!(c);
            }
            out.push_str(&format!(
                "],\"kind\":\"{}\",\"metadata\":{}}}",
                path.resource.list_kind, metadata
            ));
            let mut response = (StatusCode::OK, out).into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            Ok(response)
        }
        Representation::Object | Representation::Discovery(_) => {
            let items = page
                .rows
                .iter()
                .map(|r| {
                    crate::store::parse_document_public(&r.name, &r.body).map_err(ApiError::from)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let mut metadata = json!({"resourceVersion": rv_string});
            if let Some(c) = &next {
                metadata["continue"] = json!(c);
            }
            Ok(encode(
                StatusCode::OK,
                n,
                true,
                &json!({"apiVersion": path.resource.api_version(), "items": items, "kind": path.resource.list_kind, "metadata": metadata}),
            ))
        }
        Representation::Metadata(v) => {
            let items = page
                .rows
                .iter()
                .map(|r| {
                    serde_json::from_str::<Value>(&r.metadata)
                        .map(|m| table::partial_metadata(v, m))
                        .map_err(|e| ApiError::internal(format!("stored metadata is corrupt: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let mut metadata = json!({"resourceVersion": rv_string});
            if let Some(c) = &next {
                metadata["continue"] = json!(c);
            }
            Ok(encode(
                StatusCode::OK,
                n,
                true,
                &json!({"kind": "PartialObjectMetadataList", "apiVersion": format!("meta.k8s.io/{v}"), "metadata": metadata, "items": items}),
            ))
        }
        Representation::Table(v) => {
            let now = now();
            let rows = page
                .rows
                .iter()
                .map(|r| {
                    let source = if include == IncludeObject::Object {
                        crate::store::parse_document_public(&r.name, &r.body)?
                    } else {
                        table_source(path, r)?
                    };
                    Ok(table::row(path.resource, &source, include, v, now))
                })
                .collect::<Result<Vec<_>, ApiError>>()?;
            Ok(encode(
                StatusCode::OK,
                n,
                true,
                &table::table(path.resource, v, rows, &rv_string, next.as_deref()),
            ))
        }
    }
}

/// Adds `Warning: 299 - "…"` headers, as kube-apiserver does for field-validation warnings.
fn with_warnings(mut response: Response, warnings: &[String]) -> Response {
    for w in warnings {
        let text = format!("299 - \"{}\"", w.replace('"', "\\\""));
        if let Ok(v) = HeaderValue::from_str(&text) {
            response.headers_mut().append("warning", v);
        }
    }
    response
}

fn validation(params: &Params, headers: &HeaderMap, body: &[u8]) -> Validation {
    let json = content_type(headers)
        .is_none_or(|c| c.split(';').next().unwrap_or("").trim().ends_with("json"));
    Validation::new(
        FieldValidation::parse(params.field_validation.as_deref()),
        json.then_some(body),
    )
}

fn content_type(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
}

/// A 422 about request options (`CreateOptions`, `UpdateOptions`, `PatchOptions`), worded as
/// kube-apiserver words it.
fn invalid_options(options: &str, causes: Vec<(&str, String, &'static str)>) -> ApiError {
    let summary: Vec<String> = causes
        .iter()
        .map(|(field, message, _)| format!("{field}: {message}"))
        .collect();
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        format!(
            "{options}.meta.k8s.io \"\" is invalid: {}",
            summary.join(", ")
        ),
    )
    .with_details(json!({
        "group": "meta.k8s.io",
        "kind": options,
        "causes": causes.iter().map(|(field, message, reason)| json!({"reason": reason, "message": message, "field": field})).collect::<Vec<_>>(),
    }))
}

/// The write's field manager: the `fieldManager` parameter (validated), else derived from the
/// `User-Agent`. Server-side apply requires the parameter.
fn field_manager(
    params: &Params,
    headers: &HeaderMap,
    options: &str,
    mut causes: Vec<(&'static str, String, &'static str)>,
    apply: bool,
) -> Result<String, ApiError> {
    let sent = params.field_manager.as_deref().unwrap_or("");
    if apply && sent.is_empty() {
        causes.insert(
            0,
            (
                "fieldManager",
                "Required value: is required for apply patch".into(),
                "FieldValueRequired",
            ),
        );
    }
    for (message, reason) in fieldmanager::validate_manager(sent) {
        causes.push(("fieldManager", message, reason));
    }
    if !causes.is_empty() {
        return Err(invalid_options(options, causes));
    }
    if !sent.is_empty() {
        return Ok(sent.to_owned());
    }
    let agent = headers
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok());
    Ok(fieldmanager::manager_from_user_agent(agent))
}

pub async fn create(
    state: &AppState,
    path: &ResourcePath,
    params: &Params,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Object)?;
    let manager = field_manager(params, headers, "CreateOptions", Vec::new(), false)?;
    let object = decode_body(content_type(headers), &body)?;
    let (object, name, warnings) =
        prepare_create_as(path, object, &validation(params, headers, &body), &manager)?;
    if let (Some(admission), Some(namespace)) = (&state.admission, &path.namespace) {
        admission.admit_create(namespace).await?;
    }
    let outcome = state
        .store
        .mutate(
            path.resource,
            path.object_namespace(),
            &name,
            params.dry_run,
            |current| {
                if current.is_some() {
                    return Err(ApiError::already_exists(path.resource, &name));
                }
                Ok(Mutation::Put(object))
            },
        )
        .await
        .map_err(|e: ApiError| {
            if e.reason == "AlreadyExists" {
                ApiError::already_exists(path.resource, &name)
            } else {
                e
            }
        })?;
    let object = outcome.object.expect("a create stores an object");
    Ok(with_warnings(
        respond_object(
            StatusCode::CREATED,
            path,
            n,
            IncludeObject::default(),
            &object,
        ),
        &warnings,
    ))
}

pub async fn update(
    state: &AppState,
    path: &ResourcePath,
    params: &Params,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Object)?;
    let manager = field_manager(params, headers, "UpdateOptions", Vec::new(), false)?;
    let desired = decode_body(content_type(headers), &body)?;
    let name = path.name.clone().expect("update has a name");
    let validation = validation(params, headers, &body);
    let mut warnings = Vec::new();
    let outcome = state
        .store
        .mutate(
            path.resource,
            path.object_namespace(),
            &name,
            params.dry_run,
            |current| {
                decide_update_as(path, &name, current, desired, &validation, &manager).map(
                    |(m, _, w)| {
                        warnings = w;
                        m
                    },
                )
            },
        )
        .await?;
    let object = outcome.object.unwrap_or(Value::Null);
    Ok(with_warnings(
        respond_object(StatusCode::OK, path, n, IncludeObject::default(), &object),
        &warnings,
    ))
}

/// The patch formats CRD storage accepts besides server-side apply.
enum PatchKind {
    Merge,
    Json,
}

/// `force` of a patch request: Go's `strconv.ParseBool` spellings.
fn parse_force(force: Option<&str>) -> Result<Option<bool>, ApiError> {
    match force {
        None => Ok(None),
        Some("1" | "t" | "T" | "true" | "TRUE" | "True") => Ok(Some(true)),
        Some("0" | "f" | "F" | "false" | "FALSE" | "False") => Ok(Some(false)),
        Some(other) => Err(ApiError::bad_request(format!(
            "force: invalid boolean {other:?}"
        ))),
    }
}

pub async fn patch(
    state: &AppState,
    path: &ResourcePath,
    params: &Params,
    force: Option<&str>,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Object)?;
    let force = parse_force(force)?;
    let media = content_type(headers)
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let kind = match media.as_str() {
        "application/apply-patch+yaml" => {
            let manager = field_manager(params, headers, "PatchOptions", Vec::new(), true)?;
            return apply(
                state,
                path,
                params,
                force.unwrap_or(false),
                &manager,
                n,
                body,
            )
            .await;
        }
        "application/merge-patch+json" => PatchKind::Merge,
        "application/json-patch+json" => PatchKind::Json,
        "application/strategic-merge-patch+json" => {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json (strategic merge patch is not supported for custom resources; use a merge patch)",
            ));
        }
        "application/apply-patch+cbor" => {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (CBOR is not supported)",
            ));
        }
        other => return Err(ApiError::unsupported_media_type(other)),
    };
    let forbidden = if force.is_some() {
        vec![(
            "force",
            "Forbidden: may not be specified for non-apply patch".to_owned(),
            "FieldValueForbidden",
        )]
    } else {
        Vec::new()
    };
    let manager = field_manager(params, headers, "PatchOptions", forbidden, false)?;
    let patch: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("the patch is not valid JSON: {e}")))?;
    let json_patch: Option<json_patch::Patch> = match kind {
        PatchKind::Json => Some(
            serde_json::from_value(patch.clone())
                .map_err(|e| ApiError::bad_request(format!("the JSON patch is malformed: {e}")))?,
        ),
        PatchKind::Merge => {
            if !patch.is_object() {
                return Err(ApiError::bad_request("a merge patch must be a JSON object"));
            }
            None
        }
    };
    let name = path.name.clone().expect("patch has a name");
    let validation = validation(params, headers, &body);
    let mut warnings = Vec::new();
    let outcome = state
        .store
        .mutate(
            path.resource,
            path.object_namespace(),
            &name,
            params.dry_run,
            |current| {
                let current = current.ok_or_else(|| ApiError::not_found(path.resource, &name))?;
                let mut patched = current.clone();
                match &json_patch {
                    Some(p) => json_patch::patch(&mut patched, p).map_err(|e| {
                        ApiError::invalid(
                            path.resource,
                            &name,
                            vec![(
                                String::new(),
                                format!("the JSON patch could not be applied: {e}"),
                                "FieldValueInvalid",
                            )],
                        )
                    })?,
                    None => json_patch::merge(&mut patched, &patch),
                }
                decide_update_as(path, &name, Some(current), patched, &validation, &manager).map(
                    |(m, _, w)| {
                        warnings = w;
                        m
                    },
                )
            },
        )
        .await?;
    let object = outcome.object.unwrap_or(Value::Null);
    Ok(with_warnings(
        respond_object(StatusCode::OK, path, n, IncludeObject::default(), &object),
        &warnings,
    ))
}

/// An `application/apply-patch+yaml` body: YAML, or JSON (which kubectl and client-go send).
fn decode_apply_body(body: &[u8]) -> Result<(Value, bool), ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
    if text.trim_start().starts_with('{')
        && let Ok(v) = serde_json::from_str::<Value>(text)
    {
        return Ok((v, true));
    }
    let v: Value = serde_yaml::from_str(text)
        .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
    Ok((v, false))
}

/// Why an apply's decision did not produce a mutation.
enum ApplyFailure {
    Api(ApiError),
    /// The object is missing: a create, which must pass admission first.
    NeedsAdmission,
}

impl From<StoreError> for ApplyFailure {
    fn from(e: StoreError) -> Self {
        ApplyFailure::Api(e.into())
    }
}

/// Server-side apply: creates the object (201) or merges the configuration into it (200).
async fn apply(
    state: &AppState,
    path: &ResourcePath,
    params: &Params,
    force: bool,
    manager: &str,
    n: Negotiated,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (config, json) = decode_apply_body(&body)?;
    let validation = Validation::new(
        FieldValidation::parse(params.field_validation.as_deref()),
        json.then_some(&body[..]),
    );
    let name = path.name.clone().expect("patch has a name");
    // Admission (NamespaceLifecycle) runs for creates only, and cannot run under the store's
    // write lock: admit first when the object looks missing, and start over if it vanished
    // between the look and the write.
    let mut admitted = state.admission.is_none() || path.namespace.is_none();
    let mut warnings = Vec::new();
    let outcome = loop {
        if !admitted && let (Some(admission), Some(namespace)) = (&state.admission, &path.namespace)
        {
            let exists = state
                .store
                .get_object(path.resource, path.object_namespace(), &name)
                .await?
                .is_some();
            if !exists {
                admission.admit_create(namespace).await?;
                admitted = true;
            }
        }
        let result = state
            .store
            .mutate(
                path.resource,
                path.object_namespace(),
                &name,
                params.dry_run,
                |current| {
                    if current.is_none() && !admitted {
                        return Err(ApplyFailure::NeedsAdmission);
                    }
                    decide_apply(
                        path,
                        &name,
                        current,
                        config.clone(),
                        &validation,
                        manager,
                        force,
                    )
                    .map(|(m, w)| {
                        warnings = w;
                        m
                    })
                    .map_err(ApplyFailure::Api)
                },
            )
            .await;
        match result {
            Ok(outcome) => break outcome,
            Err(ApplyFailure::Api(e)) => return Err(e),
            Err(ApplyFailure::NeedsAdmission) => continue,
        }
    };
    let code = if outcome.event == Some(EventType::Added) {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let object = outcome.object.unwrap_or(Value::Null);
    Ok(with_warnings(
        respond_object(code, path, n, IncludeObject::default(), &object),
        &warnings,
    ))
}

fn delete_options(
    headers: &HeaderMap,
    body: &Bytes,
    params: &Params,
) -> Result<DeletePreconditions, ApiError> {
    let options = if body.iter().all(u8::is_ascii_whitespace) {
        Value::Null
    } else {
        decode_body(content_type(headers), body)?
    };
    let mut pre = DeletePreconditions::from_body(&options)?;
    pre.dry_run |= params.dry_run;
    Ok(pre)
}

pub async fn delete(
    state: &AppState,
    path: &ResourcePath,
    params: &Params,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Object)?;
    let pre = delete_options(headers, &body, params)?;
    let name = path.name.clone().expect("delete has a name");
    let outcome = state
        .store
        .mutate(
            path.resource,
            path.object_namespace(),
            &name,
            pre.dry_run,
            |current| decide_delete(path.resource, &name, current, &pre),
        )
        .await?;
    let object = outcome.object.unwrap_or(Value::Null);
    Ok(respond_object(
        StatusCode::OK,
        path,
        n,
        IncludeObject::default(),
        &object,
    ))
}

/// Deletes every matching object in one transaction and returns them as a list.
pub async fn delete_collection(
    state: &AppState,
    path: &ResourcePath,
    params: &Params,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Collection)?;
    let pre = delete_options(headers, &body, params)?;
    if params.continue_token.is_some() || params.limit.is_some() {
        return Err(ApiError::bad_request(
            "deletecollection does not support limit or continue",
        ));
    }
    let (query, _, _) = list_query(path, params, true)?;
    let page = state.store.list(&query).await?;
    let targets: Vec<crate::store::write_target::Target<'_>> = page
        .rows
        .iter()
        .map(|r| crate::store::write_target::Target {
            resource: path.resource,
            namespace: &r.namespace,
            name: &r.name,
        })
        .collect();
    let outcomes = state
        .store
        .mutate_batch(&targets, pre.dry_run, |i, current| match current {
            // Deleted by someone else since the list: nothing to do.
            None => Ok(Mutation::Unchanged),
            Some(c) => decide_delete(
                path.resource,
                &page.rows[i].name,
                Some(c),
                &DeletePreconditions {
                    dry_run: pre.dry_run,
                    ..Default::default()
                },
            ),
        })
        .await?;
    let items: Vec<Value> = outcomes
        .into_iter()
        .filter_map(|o| o.event.and(o.object))
        .collect();
    let (current, _) = state.store.versions().await?;
    Ok(encode(
        StatusCode::OK,
        Negotiated {
            encoding: n.encoding,
            representation: Representation::Object,
        },
        true,
        &json!({"apiVersion": path.resource.api_version(), "items": items, "kind": path.resource.list_kind, "metadata": {"resourceVersion": current.to_string()}}),
    ))
}
