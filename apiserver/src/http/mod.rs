//! The axum router that speaks the Kubernetes API for the report kinds.

pub mod discovery;
pub mod fields;
pub mod negotiate;
pub mod objects;
pub mod openapi;
pub mod request;
pub mod resources;
pub mod status;
pub mod table;
pub mod watch;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::Value;

use self::negotiate::{Representation, Target};
use self::request::{Params, parse_path};
use self::status::ApiError;
use crate::auth::{Attributes, AuthRequest, Authenticator, Authorizer, PeerCertificates, UserInfo};
use crate::metrics::Metrics;
use crate::store::Store;

/// Tunables of the HTTP layer.
#[derive(Clone, Debug)]
pub struct ApiOptions {
    /// Largest accepted request body (413 above it).
    pub max_request_bytes: usize,
    /// Interval between BOOKMARK events on watches that allow them.
    pub bookmark_interval: Duration,
}

impl Default for ApiOptions {
    fn default() -> Self {
        ApiOptions {
            max_request_bytes: 3 * 1024 * 1024,
            bookmark_interval: Duration::from_secs(60),
        }
    }
}

/// Everything handlers need.
#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub authenticator: Arc<dyn Authenticator>,
    pub authorizer: Arc<dyn Authorizer>,
    /// Admission checks on creates (NamespaceLifecycle when behind kube-apiserver).
    pub admission: Option<Arc<dyn crate::delegated::Admission>>,
    pub metrics: Arc<Metrics>,
    pub options: ApiOptions,
}

/// Builds the router.
pub fn router(state: AppState) -> Router {
    let authenticated = Router::new()
        .route("/version", get(version))
        .route("/version/", get(version))
        .route("/api", get(core_api))
        .route("/api/", get(core_api))
        .route("/apis", get(apis))
        .route("/apis/", get(apis))
        .route("/metrics", get(metrics))
        .route("/openapi/v2", get(openapi_v2))
        .route("/openapi/v3", get(openapi_index))
        .route("/openapi/v3/", get(openapi_index))
        .route("/openapi/v3/{*path}", get(openapi_document))
        .route("/apis/{*rest}", axum::routing::any(resource))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .route("/livez", get(livez))
        .route("/healthz", get(livez))
        .route("/readyz", get(readyz))
        .merge(authenticated)
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::path_not_found()
}

async fn livez() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<AppState>) -> Response {
    match tokio::time::timeout(Duration::from_secs(5), state.store.ping()).await {
        Ok(Ok(())) => "ok".into_response(),
        Ok(Err(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("[-]database failed: {e}\nreadyz check failed\n"),
        )
            .into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "[-]database failed: no answer within 5s\nreadyz check failed\n",
        )
            .into_response(),
    }
}

/// Authenticates every request that reaches the API; unauthenticated callers get 401.
async fn authenticate(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    let peer = request
        .extensions()
        .get::<PeerCertificates>()
        .cloned()
        .unwrap_or_default();
    let user = state
        .authenticator
        .authenticate(&AuthRequest {
            peer: &peer,
            headers: request.headers(),
        })
        .await;
    match user {
        Ok(Some(user)) => {
            request.extensions_mut().insert(user);
            next.run(request).await
        }
        Ok(None) => ApiError::unauthorized().into_response(),
        Err(e) => {
            ApiError::unavailable(format!("cannot authenticate the request: {e}")).into_response()
        }
    }
}

async fn authorize(
    state: &AppState,
    user: &UserInfo,
    attributes: &Attributes,
) -> Result<(), ApiError> {
    match state.authorizer.authorize(user, attributes).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(reason)) => {
            let what = match (&attributes.path, &attributes.namespace) {
                (Some(path), _) => format!("cannot {} path \"{path}\"", attributes.verb),
                (None, Some(ns)) => format!(
                    "cannot {} resource \"{}\" in API group \"{}\" in the namespace \"{ns}\"",
                    attributes.verb, attributes.resource, attributes.group
                ),
                (None, None) => format!(
                    "cannot {} resource \"{}\" in API group \"{}\" at the cluster scope",
                    attributes.verb, attributes.resource, attributes.group
                ),
            };
            let mut msg = format!(
                "{}.{} is forbidden: User \"{}\" {what}",
                attributes.resource, attributes.group, user.name
            );
            if !reason.is_empty() {
                msg.push_str(&format!(": {reason}"));
            }
            Err(ApiError::forbidden(msg))
        }
        Err(e) => Err(ApiError::unavailable(format!(
            "cannot authorize the request: {e}"
        ))),
    }
}

fn non_resource(path: &str) -> Attributes {
    Attributes {
        verb: "get".into(),
        group: String::new(),
        version: String::new(),
        resource: String::new(),
        namespace: None,
        name: None,
        path: Some(path.into()),
    }
}

async fn version(State(state): State<AppState>, request: Request) -> Response {
    let user = request
        .extensions()
        .get::<UserInfo>()
        .cloned()
        .unwrap_or_default();
    if let Err(e) = authorize(&state, &user, &non_resource("/version")).await {
        return e.into_response();
    }
    axum::Json(discovery::version()).into_response()
}

async fn core_api(State(state): State<AppState>, headers: HeaderMap, request: Request) -> Response {
    let user = request
        .extensions()
        .get::<UserInfo>()
        .cloned()
        .unwrap_or_default();
    if let Err(e) = authorize(&state, &user, &non_resource("/api")).await {
        return e.into_response();
    }
    match resources::accept(&headers, Target::Discovery) {
        Ok(n) if matches!(n.representation, Representation::Discovery(_)) => {
            let v = match n.representation {
                Representation::Discovery(v) => v,
                _ => "v2",
            };
            let doc = serde_json::json!({"kind": "APIGroupDiscoveryList", "apiVersion": format!("apidiscovery.k8s.io/{v}"), "metadata": {}, "items": []});
            resources::encode(StatusCode::OK, n, false, &doc)
        }
        Ok(n) => resources::encode(StatusCode::OK, n, false, &discovery::core_versions()),
        Err(e) => e.into_response(),
    }
}

async fn apis(State(state): State<AppState>, headers: HeaderMap, request: Request) -> Response {
    let user = request
        .extensions()
        .get::<UserInfo>()
        .cloned()
        .unwrap_or_default();
    if let Err(e) = authorize(&state, &user, &non_resource("/apis")).await {
        return e.into_response();
    }
    let n = match resources::accept(&headers, Target::Discovery) {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    match n.representation {
        Representation::Discovery(v) => {
            let (doc, etag) = discovery::aggregated(v);
            let mut response = if headers
                .get(header::IF_NONE_MATCH)
                .and_then(|h| h.to_str().ok())
                == Some(etag.as_str())
            {
                StatusCode::NOT_MODIFIED.into_response()
            } else {
                resources::encode(StatusCode::OK, n, false, &doc)
            };
            response.headers_mut().insert(
                header::ETAG,
                HeaderValue::from_str(&etag).expect("hex etag"),
            );
            response
        }
        _ => resources::encode(StatusCode::OK, n, false, &discovery::api_group_list()),
    }
}

async fn metrics(State(state): State<AppState>, request: Request) -> Response {
    let user = request
        .extensions()
        .get::<UserInfo>()
        .cloned()
        .unwrap_or_default();
    if let Err(e) = authorize(&state, &user, &non_resource("/metrics")).await {
        return e.into_response();
    }
    let mut response = state.metrics.encode().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    response
}

async fn openapi_index(State(state): State<AppState>, request: Request) -> Response {
    let user = request
        .extensions()
        .get::<UserInfo>()
        .cloned()
        .unwrap_or_default();
    if let Err(e) = authorize(&state, &user, &non_resource("/openapi/v3")).await {
        return e.into_response();
    }
    axum::Json(openapi::index()).into_response()
}

async fn openapi_v2(State(state): State<AppState>, request: Request) -> Response {
    let user = request
        .extensions()
        .get::<UserInfo>()
        .cloned()
        .unwrap_or_default();
    if let Err(e) = authorize(&state, &user, &non_resource("/openapi/v2")).await {
        return e.into_response();
    }
    let accept = request
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok());
    if !openapi::v2_accepts_json(accept) {
        return ApiError::new(
            StatusCode::NOT_ACCEPTABLE,
            "NotAcceptable",
            format!(
                "only the following media types are accepted: application/json (got {:?})",
                accept.unwrap_or("")
            ),
        )
        .into_response();
    }
    let (doc, etag) = openapi::v2();
    let mut response = if request
        .headers()
        .get(header::IF_NONE_MATCH)
        .and_then(|h| h.to_str().ok())
        .is_some_and(|h| h.split(',').any(|t| t.trim() == etag || t.trim() == "*"))
    {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        let mut r = doc.into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    };
    let headers = response.headers_mut();
    headers.insert(header::ETAG, HeaderValue::from_str(etag).expect("hex etag"));
    headers.insert(header::VARY, HeaderValue::from_static("Accept"));
    response
}

async fn openapi_document(
    State(state): State<AppState>,
    axum::extract::Path(path): axum::extract::Path<String>,
    request: Request,
) -> Response {
    let user = request
        .extensions()
        .get::<UserInfo>()
        .cloned()
        .unwrap_or_default();
    if let Err(e) = authorize(&state, &user, &non_resource(request.uri().path())).await {
        return e.into_response();
    }
    match openapi::document(&path) {
        Some((doc, hash)) => {
            let mut response = doc.to_owned().into_response();
            let headers = response.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            headers.insert(
                header::ETAG,
                HeaderValue::from_str(&format!("\"{hash}\"")).expect("hex etag"),
            );
            // The hash in the URL pins the content, as kube-apiserver does.
            if request.uri().query().is_some_and(|q| q.contains("hash=")) {
                headers.insert(
                    header::CACHE_CONTROL,
                    HeaderValue::from_static("public, immutable"),
                );
            }
            response
        }
        None => ApiError::path_not_found().into_response(),
    }
}

/// The Kubernetes verb of a resource request.
fn verb(method: &Method, has_name: bool, watch: bool) -> Option<&'static str> {
    Some(match (method.as_str(), has_name) {
        ("GET", true) if watch => "watch",
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", false) => "create",
        ("PUT", true) => "update",
        ("PATCH", true) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => return None,
    })
}

async fn resource(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    request: Request,
) -> Response {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let rest = parts.uri.path().trim_start_matches("/apis/").to_owned();
    let user = parts
        .extensions
        .get::<UserInfo>()
        .cloned()
        .unwrap_or_default();
    let mut verb_label = "unknown";
    let mut resource_label = String::new();
    let result: Result<Response, ApiError> = async {
        // `/apis/{group}` and `/apis/{group}/{version}` are discovery documents.
        let segments: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
        if parts.method == Method::GET && segments.len() <= 2 {
            authorize(&state, &user, &non_resource(parts.uri.path())).await?;
            let doc = match segments.as_slice() {
                [g] => discovery::api_group(g),
                [g, v] => discovery::api_resource_list(g, v),
                _ => None,
            };
            let n = resources::accept(&parts.headers, Target::Discovery)?;
            return doc
                .map(|d| {
                    resources::encode(
                        StatusCode::OK,
                        negotiate::Negotiated {
                            representation: Representation::Object,
                            ..n
                        },
                        false,
                        &d,
                    )
                })
                .ok_or_else(ApiError::path_not_found);
        }
        let path = parse_path(&rest)?;
        let params = Params::parse(&query)?;
        let v = verb(&parts.method, path.name.is_some(), params.watch).ok_or_else(|| {
            ApiError::method_not_allowed(format!(
                "the server does not allow this method on the requested resource ({})",
                parts.method
            ))
        })?;
        verb_label = v;
        resource_label = path.resource.plural.to_owned();
        authorize(
            &state,
            &user,
            &Attributes {
                verb: v.into(),
                group: path.resource.group.into(),
                version: path.resource.version.into(),
                resource: path.resource.plural.into(),
                namespace: path.namespace.clone(),
                name: path.name.clone(),
                path: None,
            },
        )
        .await?;
        let body = match v {
            "create" | "update" | "patch" | "delete" | "deletecollection" => {
                read_body(body, state.options.max_request_bytes).await?
            }
            _ => bytes::Bytes::new(),
        };
        match v {
            "get" => resources::get(&state, &path, &params, &parts.headers).await,
            "list" => resources::list(&state, &path, &params, &parts.headers).await,
            "watch" => {
                let mut params = params;
                if let Some(name) = &path.name {
                    // A watch on a single object is a field-selected watch.
                    let selector = format!("metadata.name={name}");
                    params.fields = crate::selector::FieldSelector::parse(&selector)
                        .map_err(|e| ApiError::bad_request(e.to_string()))?;
                }
                let path = request::ResourcePath { name: None, ..path };
                watch::watch(&state, &path, &params, &parts.headers).await
            }
            "create" => resources::create(&state, &path, &params, &parts.headers, body).await,
            "update" => resources::update(&state, &path, &params, &parts.headers, body).await,
            "patch" => {
                let force = query.get("force").map(String::as_str);
                resources::patch(&state, &path, &params, force, &parts.headers, body).await
            }
            "delete" => resources::delete(&state, &path, &params, &parts.headers, body).await,
            _ => resources::delete_collection(&state, &path, &params, &parts.headers, body).await,
        }
    }
    .await;
    let response = result.unwrap_or_else(IntoResponse::into_response);
    state.metrics.observe(
        verb_label,
        &resource_label,
        response.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    response
}

async fn read_body(body: Body, limit: usize) -> Result<bytes::Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        if std::error::Error::source(&e).is_some_and(|s| s.to_string().contains("length limit"))
            || e.to_string().contains("length limit")
        {
            ApiError::too_large(limit)
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"))
        }
    })
}

/// Serializes a value for logs and tests.
pub fn to_json(v: &Value) -> String {
    v.to_string()
}
