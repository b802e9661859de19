//! Handlers for the resource verbs: get, list, create, update, patch, delete, deletecollection
//! (watch lives in `watch.rs`). Each one decodes what HTTP carries (body, content type,
//! options), asks the [`crate::registry`] and renders the answer; object rules live there.

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use serde_json::Value;

use super::AppState;
use super::negotiate::{Encoding, Negotiated, Representation, Target};
use super::render::{
    StreamedItems, accept, deleted_list_response, include_object, list_response, object_response,
    streamed_list_response, with_warnings,
};
use super::request::{Params, decode_body, decode_body_noting_duplicates};
use super::status::ApiError;
use super::table::IncludeObject;
use crate::fieldmanager;
use crate::registry::fields;
use crate::registry::patch::ObjectLimits;
use crate::registry::{
    Cause, DeletePreconditions, FieldValidation, Patch, RegistryError, ResourceRef, Validation,
    WriteOptions, Written,
};

pub async fn get(
    state: &AppState,
    r: &ResourceRef,
    name: &str,
    params: &Params,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Object)?;
    let include = include_object(params)?;
    let object = state.registry.get(r, name).await?;
    Ok(object_response(
        StatusCode::OK,
        r.resource,
        n,
        include,
        &object,
        None,
    ))
}

pub async fn list(
    state: &AppState,
    r: &ResourceRef,
    params: &Params,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Collection)?;
    let include = include_object(params)?;
    // `includeObject` shapes Table rows only; metadata lists never need the bodies.
    let metadata_only = match n.representation {
        Representation::Metadata(_) => true,
        Representation::Table(_) => include != IncludeObject::Object,
        Representation::Object | Representation::Discovery(_) => false,
    };
    let page = state
        .registry
        .list_stream(r, &params.list_options(), metadata_only)
        .await?;
    let streamed = match n.representation {
        Representation::Object | Representation::Discovery(_) => Some(StreamedItems::Objects),
        Representation::Metadata(v) => Some(StreamedItems::Metadata(v)),
        Representation::Table(_) => None,
    };
    match streamed {
        Some(items) if n.encoding == Encoding::Json => {
            streamed_list_response(r.resource, items, page).await
        }
        _ => list_response(r.resource, n, include, &page.collect().await?),
    }
}

fn content_type(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
}

/// `fieldValidation` plus the keys the body repeats (a parsed value has lost them).
fn validation(params: &Params, duplicates: Vec<String>) -> Validation {
    Validation::new(
        FieldValidation::parse(params.field_validation.as_deref()),
        duplicates,
    )
}

/// The write's field manager: the `fieldManager` parameter (validated), else derived from the
/// `User-Agent`. Server-side apply requires the parameter.
fn field_manager(
    params: &Params,
    headers: &HeaderMap,
    options: &'static str,
    mut causes: Vec<Cause>,
    apply: bool,
) -> Result<String, RegistryError> {
    let sent = params.field_manager.as_deref().unwrap_or("");
    if apply && sent.is_empty() {
        causes.insert(
            0,
            Cause::new(
                "fieldManager",
                "Required value: is required for apply patch",
                "FieldValueRequired",
            ),
        );
    }
    for (message, reason) in fieldmanager::validate_manager(sent) {
        causes.push(Cause::new("fieldManager", message, reason));
    }
    if !causes.is_empty() {
        return Err(RegistryError::InvalidOptions { options, causes });
    }
    if !sent.is_empty() {
        return Ok(sent.to_owned());
    }
    let agent = headers
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok());
    Ok(fieldmanager::manager_from_user_agent(agent))
}

fn write_options(
    state: &AppState,
    params: &Params,
    manager: String,
    duplicates: Vec<String>,
) -> WriteOptions {
    WriteOptions {
        dry_run: params.dry_run,
        manager,
        validation: validation(params, duplicates),
        limits: ObjectLimits {
            max_object_bytes: state.options.max_request_bytes,
        },
    }
}

/// The object a write stored, with its field-validation warnings.
fn written_response(
    code: StatusCode,
    r: &ResourceRef,
    n: Negotiated,
    written: &Written,
) -> Response {
    with_warnings(
        object_response(
            code,
            r.resource,
            n,
            IncludeObject::default(),
            &written.object,
            written.json.as_ref(),
        ),
        &written.warnings,
    )
}

pub async fn create(
    state: &AppState,
    r: &ResourceRef,
    params: &Params,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Object)?;
    let manager = field_manager(params, headers, "CreateOptions", Vec::new(), false)?;
    let (object, duplicates) = decode_body_noting_duplicates(content_type(headers), &body)?;
    let options = write_options(state, params, manager, duplicates);
    let written = state.registry.create(r, object, &options).await?;
    Ok(written_response(StatusCode::CREATED, r, n, &written))
}

pub async fn update(
    state: &AppState,
    r: &ResourceRef,
    name: &str,
    params: &Params,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Object)?;
    let manager = field_manager(params, headers, "UpdateOptions", Vec::new(), false)?;
    let (desired, duplicates) = decode_body_noting_duplicates(content_type(headers), &body)?;
    let options = write_options(state, params, manager, duplicates);
    let written = state.registry.update(r, name, desired, &options).await?;
    Ok(written_response(StatusCode::OK, r, n, &written))
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

#[allow(clippy::too_many_arguments)]
pub async fn patch(
    state: &AppState,
    r: &ResourceRef,
    name: &str,
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
    let merge = match media.as_str() {
        "application/apply-patch+yaml" => {
            let manager = field_manager(params, headers, "PatchOptions", Vec::new(), true)?;
            let (config, duplicates) = decode_apply_body(&body)?;
            let options = write_options(state, params, manager, duplicates);
            let written = state
                .registry
                .apply(r, name, config, force.unwrap_or(false), &options)
                .await?;
            let code = if written.created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            return Ok(written_response(code, r, n, &written));
        }
        "application/merge-patch+json" => true,
        "application/json-patch+json" => false,
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
        vec![Cause::new(
            "force",
            "Forbidden: may not be specified for non-apply patch",
            "FieldValueForbidden",
        )]
    } else {
        Vec::new()
    };
    let manager = field_manager(params, headers, "PatchOptions", forbidden, false)?;
    let (value, duplicates) = fields::parse_noting_duplicates(&body)
        .map_err(|e| ApiError::bad_request(format!("the patch is not valid JSON: {e}")))?;
    let patch = if merge {
        if !value.is_object() {
            return Err(ApiError::bad_request("a merge patch must be a JSON object"));
        }
        Patch::Merge(value)
    } else {
        Patch::Json(
            serde_json::from_value(value)
                .map_err(|e| ApiError::bad_request(format!("the JSON patch is malformed: {e}")))?,
        )
    };
    let options = write_options(state, params, manager, duplicates);
    let written = state.registry.patch(r, name, &patch, &options).await?;
    Ok(written_response(StatusCode::OK, r, n, &written))
}

/// An `application/apply-patch+yaml` body: YAML, or JSON (which kubectl and client-go send),
/// with the keys a JSON body repeats (YAML: none).
fn decode_apply_body(body: &[u8]) -> Result<(Value, Vec<String>), ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
    if text.trim_start().starts_with('{')
        && let Ok(parsed) = fields::parse_noting_duplicates(body)
    {
        return Ok(parsed);
    }
    let v: Value = fields::parse_yaml(text.as_bytes())
        .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
    Ok((v, Vec::new()))
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
    r: &ResourceRef,
    name: &str,
    params: &Params,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Object)?;
    let pre = delete_options(headers, &body, params)?;
    let object = state.registry.delete(r, name, &pre).await?;
    Ok(object_response(
        StatusCode::OK,
        r.resource,
        n,
        IncludeObject::default(),
        &object,
        None,
    ))
}

/// Deletes every matching object (in batches, see `Registry::delete_collection`) and returns
/// them as a list.
pub async fn delete_collection(
    state: &AppState,
    r: &ResourceRef,
    params: &Params,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Collection)?;
    let pre = delete_options(headers, &body, params)?;
    let (items, resource_version) = state
        .registry
        .delete_collection(r, &params.list_options(), &pre)
        .await?;
    Ok(deleted_list_response(
        r.resource,
        n,
        items,
        resource_version,
    ))
}
