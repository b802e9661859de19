//! Rendering of responses: an object or a list as the client negotiated it (the object,
//! `Table`, `PartialObjectMetadata[List]`), encoded as JSON or YAML.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use reports_server_crds::{ReportLayout, ResourceDescriptor};
use serde_json::{Value, json};

use super::negotiate::{Encoding, Negotiated, Representation, Target, negotiate};
use super::request::Params;
use super::status::ApiError;
use super::table::{self, IncludeObject};
use crate::registry::list::{ListRow, parse_stored};
use crate::registry::{ListPageStream, ListResult};

/// The representation and encoding the `Accept` header asks for.
pub fn accept(headers: &HeaderMap, target: Target) -> Result<Negotiated, ApiError> {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    negotiate(accept, target).map_err(|_| ApiError::not_acceptable(accept.unwrap_or("")))
}

/// `includeObject` of a Table request.
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
    encoded(code, n, list, bytes)
}

/// A response of bytes already in `n`'s encoding.
fn encoded(code: StatusCode, n: Negotiated, list: bool, bytes: impl IntoResponse) -> Response {
    let mut response = (code, bytes).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_str(&n.content_type(list)).expect("ASCII content type"),
    );
    response
}

/// One object in the negotiated representation.
pub fn render_object(
    resource: &'static ResourceDescriptor,
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
                resource,
                v,
                vec![table::row(resource, object, include, v, now())],
                rv,
                None,
            )
        }
    }
}

/// [`render_object`], encoded. `json`, when the caller has it, is exactly `object` serialized
/// (a write's stored JSON): sent as it is when the client asked for the JSON object.
pub fn object_response(
    code: StatusCode,
    resource: &'static ResourceDescriptor,
    n: Negotiated,
    include: IncludeObject,
    object: &Value,
    json: Option<&bytes::Bytes>,
) -> Response {
    match (n.representation, n.encoding, json) {
        (Representation::Object, Encoding::Json, Some(json)) => {
            encoded(code, n, false, json.clone())
        }
        (Representation::Object | Representation::Discovery(_), _, _) => {
            encode(code, n, false, object)
        }
        _ => encode(code, n, false, &render_object(resource, n, include, object)),
    }
}

/// Adds `Warning: 299 - "…"` headers, as kube-apiserver does for field-validation warnings.
pub fn with_warnings(mut response: Response, warnings: &[String]) -> Response {
    for w in warnings {
        let text = format!("299 - \"{}\"", w.replace('"', "\\\""));
        if let Ok(v) = HeaderValue::from_str(&text) {
            response.headers_mut().append("warning", v);
        }
    }
    response
}

/// A partial object good enough for table cells: metadata plus the indexed columns.
pub fn table_source(resource: &ResourceDescriptor, row: &ListRow) -> Result<Value, ApiError> {
    let metadata: Value = serde_json::from_str(&row.metadata)
        .map_err(|e| ApiError::internal(format!("stored metadata is corrupt: {e}")))?;
    let [pass, fail, warn, error, skip] = row.summary;
    let summary = json!({"pass": pass, "fail": fail, "warn": warn, "error": error, "skip": skip});
    Ok(match resource.layout {
        ReportLayout::TopLevel => json!({
            "metadata": metadata,
            "scope": {"kind": row.scope_kind, "name": row.scope_name},
            "summary": summary,
        }),
        ReportLayout::Spec => {
            json!({"metadata": metadata, "spec": {"summary": summary}})
        }
    })
}

/// An object list in JSON goes out in chunks of about this size while the page is still being
/// read: big enough that the cost of a chunk (a frame, a write) is small against its bytes,
/// small enough that the first bytes leave after a few rows.
const LIST_CHUNK_BYTES: usize = 64 * 1024;

/// What each item of a streamed JSON list is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamedItems {
    /// The stored body: the object itself.
    Objects,
    /// `PartialObjectMetadata` of this `meta.k8s.io` version around the stored `metadata`
    /// column (what client-go's metadata informers — the garbage collector, the namespace
    /// controller, Kyverno — list).
    Metadata(&'static str),
}

impl StreamedItems {
    /// The list's `apiVersion` and `kind`.
    fn list_type(self, resource: &'static ResourceDescriptor) -> (String, &'static str) {
        match self {
            StreamedItems::Objects => (resource.api_version(), resource.list_kind),
            StreamedItems::Metadata(v) => (format!("meta.k8s.io/{v}"), "PartialObjectMetadataList"),
        }
    }

    /// The list's `Content-Type`: the negotiated one of its representation, in JSON.
    fn content_type(self) -> HeaderValue {
        let representation = match self {
            StreamedItems::Objects => Representation::Object,
            StreamedItems::Metadata(v) => Representation::Metadata(v),
        };
        let n = Negotiated {
            encoding: Encoding::Json,
            representation,
        };
        HeaderValue::from_str(&n.content_type(true)).expect("ASCII content type")
    }

    /// Appends `row` as one item of the list.
    fn push(self, row: &ListRow, out: &mut Vec<u8>) {
        match self {
            StreamedItems::Objects => out.extend_from_slice(row.body.as_bytes()),
            StreamedItems::Metadata(v) => {
                out.extend_from_slice(b"{\"apiVersion\":\"meta.k8s.io/");
                out.extend_from_slice(v.as_bytes());
                out.extend_from_slice(b"\",\"kind\":\"PartialObjectMetadata\",\"metadata\":");
                out.extend_from_slice(row.metadata.as_bytes());
                out.push(b'}');
            }
        }
    }
}

/// A page in JSON, sent as the store reads it: the stored bodies (or `metadata` columns) are
/// spliced in without decoding, and the page is never assembled in memory. The first row is
/// read before the status line goes out, so a read that fails at once still gets its `Status`;
/// a read that fails later can only cut the response short (the client sees a broken body,
/// never a shorter list that parses as complete).
pub async fn streamed_list_response(
    resource: &'static ResourceDescriptor,
    items: StreamedItems,
    mut page: ListPageStream,
) -> Result<Response, ApiError> {
    let first = page.next_row().await.transpose()?;
    let span = tracing::Span::current();
    let (api_version, list_kind) = items.list_type(resource);
    let body = async_stream::stream! {
        let mut chunk = Vec::with_capacity(LIST_CHUNK_BYTES * 2);
        chunk.extend_from_slice(b"{\"apiVersion\":\"");
        chunk.extend_from_slice(api_version.as_bytes());
        chunk.extend_from_slice(b"\",\"items\":[");
        let mut next = first;
        let mut separator = false;
        while let Some(row) = next {
            if separator {
                chunk.push(b',');
            }
            separator = true;
            items.push(&row, &mut chunk);
            if chunk.len() >= LIST_CHUNK_BYTES {
                let full = std::mem::replace(&mut chunk, Vec::with_capacity(LIST_CHUNK_BYTES * 2));
                yield Ok(bytes::Bytes::from(full));
            }
            next = match page.next_row().await {
                Some(Ok(row)) => Some(row),
                None => None,
                Some(Err(e)) => {
                    span.in_scope(|| {
                        tracing::error!(
                            cause = %e,
                            "a list failed after its response began; the response is cut short"
                        )
                    });
                    yield Err(std::io::Error::other(e.to_string()));
                    return;
                }
            };
        }
        let mut metadata = json!({"resourceVersion": page.resource_version().to_string()});
        if let Some(c) = page.continue_token() {
            metadata["continue"] = json!(c);
        }
        chunk.extend_from_slice(
            format!("],\"kind\":\"{list_kind}\",\"metadata\":{metadata}}}").as_bytes(),
        );
        yield Ok(bytes::Bytes::from(chunk));
    };
    let mut response = axum::body::Body::from_stream(body).into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, items.content_type());
    Ok(response)
}

/// A list page in the negotiated representation.
pub fn list_response(
    resource: &'static ResourceDescriptor,
    n: Negotiated,
    include: IncludeObject,
    page: &ListResult,
) -> Result<Response, ApiError> {
    let rv_string = page.resource_version.to_string();
    let mut metadata = json!({"resourceVersion": rv_string});
    if let Some(c) = &page.continue_token {
        metadata["continue"] = json!(c);
    }
    match n.representation {
        Representation::Object | Representation::Discovery(_) => {
            let items = page
                .rows
                .iter()
                .map(|r| parse_stored(&r.name, &r.body).map_err(ApiError::from))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(encode(
                StatusCode::OK,
                n,
                true,
                &json!({"apiVersion": resource.api_version(), "items": items, "kind": resource.list_kind, "metadata": metadata}),
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
                        parse_stored(&r.name, &r.body)?
                    } else {
                        table_source(resource, r)?
                    };
                    Ok(table::row(resource, &source, include, v, now))
                })
                .collect::<Result<Vec<_>, ApiError>>()?;
            Ok(encode(
                StatusCode::OK,
                n,
                true,
                &table::table(
                    resource,
                    v,
                    rows,
                    &rv_string,
                    page.continue_token.as_deref(),
                ),
            ))
        }
    }
}

/// The items a deletecollection removed, as a list of objects.
pub fn deleted_list_response(
    resource: &'static ResourceDescriptor,
    n: Negotiated,
    items: Vec<Value>,
    resource_version: i64,
) -> Response {
    encode(
        StatusCode::OK,
        Negotiated {
            encoding: n.encoding,
            representation: Representation::Object,
        },
        true,
        &json!({"apiVersion": resource.api_version(), "items": items, "kind": resource.list_kind, "metadata": {"resourceVersion": resource_version.to_string()}}),
    )
}

#[cfg(test)]
mod tests {
    use reports_server_crds::catalog::POLICY_REPORT;

    use super::*;
    use crate::registry::StoreError;

    fn page(names: &[&str], failure: Option<StoreError>) -> ListPageStream {
        let rows = names.iter().map(|name| row(name)).collect();
        ListPageStream::scripted(rows, failure)
    }

    /// A row as a list reads it, with both its body and its `metadata` column.
    fn row(name: &str) -> ListRow {
        let metadata = json!({"name": name, "namespace": "ns", "labels": {"team": "x\"y"}});
        ListRow {
            namespace: "ns".into(),
            name: name.into(),
            body: json!({"metadata": metadata, "summary": {"pass": 1}}).to_string(),
            metadata: metadata.to_string(),
            ..ListRow::default()
        }
    }

    async fn body(response: Response) -> Result<bytes::Bytes, axum::Error> {
        axum::body::to_bytes(response.into_body(), usize::MAX).await
    }

    #[tokio::test]
    async fn a_streamed_page_is_the_list_it_would_have_been() {
        for names in [&[][..], &["a"][..], &["a", "b", "c"][..]] {
            let response =
                streamed_list_response(&POLICY_REPORT, StreamedItems::Objects, page(names, None))
                    .await
                    .unwrap();
            assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
            let list: Value = serde_json::from_slice(&body(response).await.unwrap()).unwrap();
            let listed: Vec<&str> = list["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|item| item["metadata"]["name"].as_str().unwrap())
                .collect();
            assert_eq!(listed, names);
            assert_eq!(list["kind"], "PolicyReportList");
            assert_eq!(list["apiVersion"], "wgpolicyk8s.io/v1alpha2");
            assert_eq!(list["metadata"], json!({"resourceVersion": "7"}));
        }
    }

    /// The streamed metadata list is the document the collected one renders, item for item.
    #[tokio::test]
    async fn a_streamed_metadata_page_is_the_list_it_would_have_been() {
        let names = ["a", "b", "c"];
        for version in ["v1", "v1beta1"] {
            let n = Negotiated {
                encoding: Encoding::Json,
                representation: Representation::Metadata(version),
            };
            let streamed = streamed_list_response(
                &POLICY_REPORT,
                StreamedItems::Metadata(version),
                page(&names, None),
            )
            .await
            .unwrap();
            let collected = ListResult {
                rows: names.iter().map(|name| row(name)).collect(),
                resource_version: 7,
                continue_token: None,
            };
            let collected =
                list_response(&POLICY_REPORT, n, IncludeObject::default(), &collected).unwrap();
            assert_eq!(
                streamed.headers()[header::CONTENT_TYPE],
                collected.headers()[header::CONTENT_TYPE]
            );
            let streamed: Value = serde_json::from_slice(&body(streamed).await.unwrap()).unwrap();
            let collected: Value = serde_json::from_slice(&body(collected).await.unwrap()).unwrap();
            assert_eq!(streamed, collected);
            assert_eq!(streamed["items"][2]["metadata"]["labels"]["team"], "x\"y");
            assert!(streamed["items"][0].get("summary").is_none());
        }
    }

    #[tokio::test]
    async fn a_page_that_fails_at_once_is_an_error_status() {
        let failure = StoreError::Inconsistent("the database went away".into());
        let error = streamed_list_response(
            &POLICY_REPORT,
            StreamedItems::Objects,
            page(&[], Some(failure)),
        )
        .await
        .unwrap_err();
        assert_eq!(error.code, StatusCode::INTERNAL_SERVER_ERROR);
    }

    /// After the status line, a failure can only break the body: never a shorter list that
    /// parses as complete.
    #[tokio::test]
    async fn a_page_that_fails_midway_breaks_the_body() {
        // More than a chunk before the failure, so some bytes were already sent.
        let names: Vec<String> = (0..3000).map(|i| format!("report-{i:04}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let failure = StoreError::Inconsistent("the database went away".into());
        let response = streamed_list_response(
            &POLICY_REPORT,
            StreamedItems::Objects,
            page(&names, Some(failure)),
        )
        .await
        .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(body(response).await.is_err());
    }
}
