//! The axum router that speaks the Kubernetes API for the report kinds.
//!
//! A request passes these layers, outermost first:
//!
//! 1. `trace_request`: a span per request (method, path, request id; verb, resource,
//!    namespace, name and user once known) and one log line for every 5xx with its cause;
//! 2. `authenticate`: the user, or 401;
//! 3. `limits::limit_request`: requests in flight capped (429) and each given a deadline
//!    (504), watches exempt;
//! 4. `authorize_non_resource` / `authorize_resource`: for resource paths the request is
//!    resolved once into a [`RequestInfo`] (404/400/405 while resolving), then authorized (403);
//! 5. `observe_request` (resource and group discovery paths): request metrics by verb and
//!    resource;
//! 6. the handler, which takes the already-resolved, already-authorized request.
//!
//! Object semantics live in [`crate::registry`]; rendering in [`render`]; `v1 Status` errors
//! in [`status`].

pub mod body;
pub mod discovery;
pub mod limits;
pub mod negotiate;
pub mod openapi;
pub mod render;
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
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use serde_json::Value;
use tracing::Instrument;

use self::negotiate::{Representation, Target};
use self::request::{Params, RequestInfo, Verb};
use self::status::ApiError;
use crate::auth::{Attributes, AuthRequest, Authenticator, Authorizer, PeerCertificates, UserInfo};
use crate::metrics::Metrics;
use crate::registry::Registry;

/// `--max-request-bytes`: a body holds one object, so the largest object the registry stores.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = crate::registry::patch::DEFAULT_MAX_OBJECT_BYTES;

/// `--max-inflight-request-bytes`: two maximal bodies at once (handling one takes 18–25× its
/// size at peak for a create, up to 55× for a create and an update: a few hundred MiB), or some
/// 1,800 reports of the usual 9 KB, far more than the 200 writes
/// `--max-mutating-requests-inflight` lets in.
pub const DEFAULT_MAX_INFLIGHT_REQUEST_BYTES: usize = 2 * DEFAULT_MAX_REQUEST_BYTES;

/// Tunables of the HTTP layer.
#[derive(Clone, Debug)]
pub struct ApiOptions {
    /// Largest accepted request body (413 above it).
    pub max_request_bytes: usize,
    /// Bytes of request bodies handled at once, all requests together (429 above it).
    pub max_inflight_request_bytes: usize,
    /// Interval between BOOKMARK events on watches that allow them.
    pub bookmark_interval: Duration,
    /// Non-watch requests in flight at once: reads, and writes (429 above).
    pub max_requests_inflight: usize,
    pub max_mutating_requests_inflight: usize,
    /// How long a non-watch request may take before it is answered 504.
    pub request_timeout: Duration,
}

impl Default for ApiOptions {
    fn default() -> Self {
        ApiOptions {
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            max_inflight_request_bytes: DEFAULT_MAX_INFLIGHT_REQUEST_BYTES,
            bookmark_interval: Duration::from_secs(60),
            max_requests_inflight: 400,
            max_mutating_requests_inflight: 200,
            request_timeout: Duration::from_secs(60),
        }
    }
}

/// Everything handlers need.
#[derive(Clone)]
pub struct AppState {
    /// The object rules over the store (with admission when behind kube-apiserver).
    pub registry: Registry,
    pub authenticator: Arc<dyn Authenticator>,
    pub authorizer: Arc<dyn Authorizer>,
    pub metrics: Arc<Metrics>,
    pub options: ApiOptions,
    /// Cancelled when the process was asked to stop but keeps serving for a while (see
    /// `serve --shutdown-delay-seconds`): `/readyz` fails from then on, so endpoints drop the
    /// pod while requests already routed to it still succeed.
    pub draining: tokio_util::sync::CancellationToken,
}

/// Builds the router.
pub fn router(state: AppState) -> Router {
    let non_resource = Router::new()
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
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            authorize_non_resource,
        ));
    // One static route per served group and group-version: static segments take precedence
    // over the resource catch-all, which a path parameter could not share a level with.
    let mut group_discovery = Router::new();
    for (group, version) in reports_server_crds::catalog::GROUP_VERSIONS {
        let group_doc = move |headers: HeaderMap| async move {
            discovery_response(&headers, discovery::api_group(group))
        };
        let version_doc = move |headers: HeaderMap| async move {
            discovery_response(&headers, discovery::api_resource_list(group, version))
        };
        group_discovery = group_discovery
            .route(&format!("/apis/{group}"), any(group_doc))
            .route(&format!("/apis/{group}/"), any(group_doc))
            .route(&format!("/apis/{group}/{version}"), any(version_doc))
            .route(&format!("/apis/{group}/{version}/"), any(version_doc));
    }
    let group_discovery = group_discovery
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            authorize_discovery,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            observe_request,
        ));
    let budget = body::BodyBudget::new(state.options.max_inflight_request_bytes, &state.metrics);
    let resources = Router::new()
        .route("/apis/{*rest}", any(resource))
        .layer(axum::Extension(budget))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            authorize_resource,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            observe_request,
        ));
    let limits = limits::RequestLimits::new(
        state.options.max_requests_inflight,
        state.options.max_mutating_requests_inflight,
        state.options.request_timeout,
    );
    let authenticated = non_resource
        .merge(group_discovery)
        .merge(resources)
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            limits,
            limits::limit_request,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .route("/livez", get(livez))
        .route("/healthz", get(livez))
        .route("/readyz", get(readyz))
        .merge(authenticated)
        .layer(middleware::from_fn(trace_request))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::path_not_found()
}

async fn livez() -> &'static str {
    "ok"
}

/// Ready means "this process can serve the API": listening, certificates loaded, not draining.
/// The database's state is not part of it: a failing probe on every replica would empty the
/// Service, and kube-apiserver would take the API groups out of discovery for the whole
/// cluster (namespace deletion, the garbage collector, Helm and Argo CD stall on that). It is
/// reported on its own: `reports_server_database_up`, the log, and 503s naming it.
async fn readyz(State(state): State<AppState>, Query(query): Query<ReadyzQuery>) -> Response {
    if state.draining.is_cancelled() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "[-]shutdown: the server is terminating\nreadyz check failed\n",
        )
            .into_response();
    }
    if query.verbose.is_none() {
        return "ok".into_response();
    }
    let database = match state.registry.health().outage() {
        None => "[+]database ok (informational)".to_owned(),
        // The cause stays in the log: /readyz answers anyone.
        Some(outage) => format!(
            "[-]database: {} for {}s, see the server's log (informational: data requests answer 503)",
            if outage.read_only {
                "read-only"
            } else {
                "no answer"
            },
            outage.down_for.as_secs()
        ),
    };
    format!("[+]ping ok\n[+]shutdown ok\n{database}\nreadyz check passed\n").into_response()
}

#[derive(serde::Deserialize)]
struct ReadyzQuery {
    verbose: Option<String>,
}

/// The cause of an error response, kept for the one log line of a 5xx.
#[derive(Clone, Debug)]
pub struct ErrorCause(pub String);

/// Marks an expected 5xx whose cause was logged once elsewhere (every request refused during
/// a database outage would otherwise log the outage again).
#[derive(Clone, Copy, Debug)]
pub struct LoggedElsewhere;

/// One span per request; every 5xx logged once, with its cause, inside it.
async fn trace_request(request: Request, next: Next) -> Response {
    let request_id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let span = tracing::info_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        request_id = %request_id,
        user = tracing::field::Empty,
        verb = tracing::field::Empty,
        resource = tracing::field::Empty,
        namespace = tracing::field::Empty,
        name = tracing::field::Empty,
    );
    async move {
        let response = next.run(request).await;
        if response.status().is_server_error() {
            let cause = response
                .extensions()
                .get::<ErrorCause>()
                .map_or("", |c| c.0.as_str());
            let status = response.status().as_u16();
            if response.extensions().get::<LoggedElsewhere>().is_some() {
                tracing::debug!(status, cause, "request refused");
            } else {
                tracing::error!(status, cause, "request failed");
            }
        }
        response
    }
    .instrument(span)
    .await
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
            tracing::Span::current().record("user", user.name.as_str());
            request.extensions_mut().insert(user);
            next.run(request).await
        }
        Ok(None) => ApiError::unauthorized().into_response(),
        Err(e) => {
            ApiError::unavailable(format!("cannot authenticate the request: {e}")).into_response()
        }
    }
}

fn user_of(request: &Request) -> UserInfo {
    request
        .extensions()
        .get::<UserInfo>()
        .cloned()
        .unwrap_or_default()
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

/// Authorizes `get` on the request's path (discovery, version, OpenAPI, metrics).
async fn authorize_non_resource(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let attributes = non_resource(request.uri().path());
    match authorize(&state, &user_of(&request), &attributes).await {
        Ok(()) => next.run(request).await,
        Err(e) => e.into_response(),
    }
}

/// Group discovery (`/apis/{group}[/{version}]`) is a `get` on its path; other methods find
/// no resource there (404, as before any authorization).
async fn authorize_discovery(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() != Method::GET {
        return ApiError::path_not_found().into_response();
    }
    authorize_non_resource(State(state), request, next).await
}

/// A resolved and authorized resource request: what resource handlers take.
#[derive(Clone, Debug)]
pub struct ResourceRequest {
    pub info: RequestInfo,
    pub params: Params,
    /// `force` of a patch (server-side apply), as sent.
    pub force: Option<String>,
}

/// Resolves a resource request into a [`RequestInfo`] and authorizes it. The info also goes
/// into the response's extensions, for request metrics.
async fn authorize_resource(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    mut request: Request,
    next: Next,
) -> Response {
    let rest = request.uri().path().trim_start_matches("/apis/").to_owned();
    let resolved = Params::parse(&query).and_then(|params| {
        Ok((
            RequestInfo::resolve(request.method(), &rest, &params)?,
            params,
        ))
    });
    let (info, params) = match resolved {
        Ok(resolved) => resolved,
        Err(e) => return e.into_response(),
    };
    let span = tracing::Span::current();
    span.record("verb", info.verb.as_str());
    span.record("resource", info.resource.resource.plural);
    if let Some(ns) = &info.resource.namespace {
        span.record("namespace", ns.as_str());
    }
    if let Some(name) = &info.name {
        span.record("name", name.as_str());
    }
    let mut response = match authorize(&state, &user_of(&request), &info.attributes()).await {
        Ok(()) => {
            request.extensions_mut().insert(ResourceRequest {
                info: info.clone(),
                params,
                force: query.get("force").cloned(),
            });
            next.run(request).await
        }
        Err(e) => e.into_response(),
    };
    response.extensions_mut().insert(info);
    response
}

/// Request count and latency by verb and resource (`unknown`/empty when the request did not
/// resolve).
async fn observe_request(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let response = next.run(request).await;
    let (verb, resource) = response
        .extensions()
        .get::<RequestInfo>()
        .map_or(("unknown", ""), |info| {
            (info.verb.as_str(), info.resource.resource.plural)
        });
    state.metrics.observe(
        verb,
        resource,
        response.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    response
}

async fn version() -> Response {
    axum::Json(discovery::version()).into_response()
}

async fn core_api(headers: HeaderMap) -> Response {
    match render::accept(&headers, Target::Discovery) {
        Ok(n) if matches!(n.representation, Representation::Discovery(_)) => {
            let v = match n.representation {
                Representation::Discovery(v) => v,
                _ => "v2",
            };
            let doc = serde_json::json!({"kind": "APIGroupDiscoveryList", "apiVersion": format!("apidiscovery.k8s.io/{v}"), "metadata": {}, "items": []});
            render::encode(StatusCode::OK, n, false, &doc)
        }
        Ok(n) => render::encode(StatusCode::OK, n, false, &discovery::core_versions()),
        Err(e) => e.into_response(),
    }
}

async fn apis(headers: HeaderMap) -> Response {
    let n = match render::accept(&headers, Target::Discovery) {
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
                render::encode(StatusCode::OK, n, false, &doc)
            };
            response.headers_mut().insert(
                header::ETAG,
                HeaderValue::from_str(&etag).expect("hex etag"),
            );
            response
        }
        _ => render::encode(StatusCode::OK, n, false, &discovery::api_group_list()),
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let mut response = state.metrics.encode().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    response
}

async fn openapi_index() -> Response {
    axum::Json(openapi::index()).into_response()
}

async fn openapi_v2(request: Request) -> Response {
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

async fn openapi_document(Path(path): Path<String>, request: Request) -> Response {
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

/// A group discovery document (`APIGroup`, `APIResourceList`) in the negotiated encoding.
fn discovery_response(headers: &HeaderMap, doc: Option<Value>) -> Response {
    let result = render::accept(headers, Target::Discovery).and_then(|n| {
        doc.map(|d| {
            render::encode(
                StatusCode::OK,
                negotiate::Negotiated {
                    representation: Representation::Object,
                    ..n
                },
                false,
                &d,
            )
        })
        .ok_or_else(ApiError::path_not_found)
    });
    result.unwrap_or_else(IntoResponse::into_response)
}

/// Every resource verb, on a request [`authorize_resource`] resolved and authorized.
async fn resource(
    State(state): State<AppState>,
    axum::Extension(request): axum::Extension<ResourceRequest>,
    axum::Extension(budget): axum::Extension<body::BodyBudget>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    // While the database does not answer, refuse at once rather than after a connection
    // timeout; a request caught in flight when it stops is ended (see `store::health`).
    let health = state.registry.health().clone();
    if let Some(outage) = health.outage() {
        return ApiError::database_down(&outage).into_response();
    }
    let is_write = request.info.verb.is_write();
    let work = async move {
        if !request.info.verb.has_body() {
            return dispatch(state, request, headers, bytes::Bytes::new()).await;
        }
        let limit = state.options.max_request_bytes;
        let (body, reservation) = budget.read(&headers, body, limit).await?;
        if !body::is_heavy(body.len(), request.info.verb == Verb::Patch) {
            let _held_until_answered = reservation;
            return dispatch(state, request, headers, body).await;
        }
        body::offload(async move {
            let _held_until_answered = reservation;
            dispatch(state, request, headers, body).await
        })
        .await
    };
    // A read caught in flight when the database stops answering is ended here. A write is
    // ended by the store, which races each of its database calls against the outage
    // (`Store::unless_outage`) and so knows whether its COMMIT was sent: 503 when it was not
    // (nothing stored), 504 when it was (the outcome is unknown).
    let result: Result<Response, ApiError> = if is_write {
        work.await
    } else {
        tokio::select! {
            result = work => result,
            () = health.went_down() => Err(ApiError::database_lost()),
        }
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

/// The verb's handler, given the request's whole body (empty for verbs without one).
async fn dispatch(
    state: AppState,
    request: ResourceRequest,
    headers: HeaderMap,
    body: bytes::Bytes,
) -> Result<Response, ApiError> {
    let ResourceRequest {
        info,
        mut params,
        force,
    } = request;
    let state = &state;
    let headers = &headers;
    let r = &info.resource;
    match (info.verb, info.name.as_deref()) {
        (Verb::Get, Some(name)) => resources::get(state, r, name, &params, headers).await,
        (Verb::List, None) => resources::list(state, r, &params, headers).await,
        (Verb::Watch, name) => {
            if let Some(name) = name {
                // A watch on a single object is a field-selected watch.
                params.fields = std::mem::take(&mut params.fields)
                    .for_named_watch(name)
                    .map_err(|e| ApiError::bad_request(e.to_string()))?;
            }
            watch::watch(state, r, &params, headers).await
        }
        (Verb::Create, None) => resources::create(state, r, &params, headers, body).await,
        (Verb::Update, Some(name)) => {
            resources::update(state, r, name, &params, headers, body).await
        }
        (Verb::Patch, Some(name)) => {
            resources::patch(state, r, name, &params, force.as_deref(), headers, body).await
        }
        (Verb::Delete, Some(name)) => {
            resources::delete(state, r, name, &params, headers, body).await
        }
        (Verb::DeleteCollection, None) => {
            resources::delete_collection(state, r, &params, headers, body).await
        }
        // RequestInfo::resolve pairs each verb with its kind of path.
        (verb, _) => Err(ApiError::method_not_allowed(format!(
            "{} is not allowed on this path",
            verb.as_str()
        ))),
    }
}
