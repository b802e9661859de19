//! Errors as Kubernetes `v1 Status` responses.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use reports_server_crds::ResourceDescriptor;
use serde_json::{Value, json};

use crate::fieldmanager::FieldManagerError;
use crate::registry::{Cause, RegistryError};
use crate::registry::{Outage, StoreError};

/// An API error: HTTP code, Kubernetes reason, message and details.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: StatusCode,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Box<Value>>,
    /// Extra metadata for the Status (a fresh continue token on 410).
    pub continue_token: Option<String>,
    /// What went wrong below, for the log only: a database driver's text is never sent.
    pub cause: Option<String>,
    /// An expected refusal whose cause the server logged once already (a database outage):
    /// not logged again per request.
    pub logged_elsewhere: bool,
}

impl ApiError {
    pub fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
            continue_token: None,
            cause: None,
            logged_elsewhere: false,
        }
    }

    /// Keeps `cause` for the server's log line of this error; the client sees the message.
    pub fn with_cause(mut self, cause: impl Into<String>) -> Self {
        self.cause = Some(cause.into());
        self
    }

    pub fn with_details(mut self, details: Value) -> Self {
        self.details = Some(Box::new(details));
        self
    }

    pub(crate) fn object_details(desc: &ResourceDescriptor, name: &str) -> Value {
        json!({"name": name, "group": desc.group, "kind": desc.plural})
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "BadRequest", message)
    }

    pub fn not_found(desc: &ResourceDescriptor, name: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("{}.{} \"{name}\" not found", desc.plural, desc.group),
        )
        .with_details(Self::object_details(desc, name))
    }

    pub fn path_not_found() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        )
    }

    pub fn already_exists(desc: &ResourceDescriptor, name: &str) -> Self {
        Self::new(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("{}.{} \"{name}\" already exists", desc.plural, desc.group),
        )
        .with_details(Self::object_details(desc, name))
    }

    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", message)
    }

    pub fn unsupported_media_type(content_type: &str) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml, application/merge-patch+json, application/json-patch+json (got {content_type:?})"
            ),
        )
    }

    pub fn not_acceptable(accept: &str) -> Self {
        Self::new(
            StatusCode::NOT_ACCEPTABLE,
            "NotAcceptable",
            format!(
                "only the following media types are accepted: application/json, application/yaml, application/json;as=Table;v=v1;g=meta.k8s.io, application/json;as=PartialObjectMetadata;v=v1;g=meta.k8s.io (got {accept:?})"
            ),
        )
    }

    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GONE, "Expired", message)
    }

    pub fn unauthorized() -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized")
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "Forbidden", message)
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "RequestEntityTooLarge",
            format!(
                "the request body is larger than the limit of {limit} bytes (--max-request-bytes)"
            ),
        )
    }

    /// 429 with `Retry-After: 1`: client-go retries a 429 only with the header.
    pub fn too_many_requests(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "TooManyRequests", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            message,
        )
    }

    /// A data request refused because the database does not answer or answers read-only (the
    /// circuit is open, see `store::health`): at once, instead of after a connection timeout.
    pub fn database_down(outage: &Outage) -> Self {
        let seconds = outage.down_for.as_secs();
        let message = if outage.read_only {
            format!(
                "the database has been a read-only standby for {seconds}s (a failover or switchover is under way); policy reports cannot be read or written until a primary answers (discovery is not affected); retry later"
            )
        } else {
            format!(
                "the database has not answered for {seconds}s; policy reports cannot be read or written until it does (discovery is not affected); retry later"
            )
        };
        ApiError {
            logged_elsewhere: true,
            ..Self::unavailable(message)
        }
    }

    /// A read in progress when the database stopped answering. (A write caught that way is
    /// answered from the store's error: 503 when nothing was stored, 504 `Timeout` when its
    /// outcome is unknown, which is kube-apiserver's answer for etcd's "request timed out".)
    pub fn database_lost() -> Self {
        ApiError {
            logged_elsewhere: true,
            ..Self::unavailable(
                "the database stopped answering during this request; policy reports cannot be read or written until it answers again; retry later",
            )
        }
    }

    /// The `Status` object.
    pub fn status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code.as_u16(),
        });
        if let Some(details) = &self.details {
            status["details"] = (**details).clone();
        }
        if let Some(token) = &self.continue_token {
            status["metadata"] = json!({"continue": token, "resourceVersion": ""});
        }
        if matches!(
            self.code,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        ) {
            status["details"]["retryAfterSeconds"] = json!(1);
        }
        status
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        RegistryError::Store(e).into()
    }
}

fn causes_json(causes: &[Cause]) -> Value {
    causes
        .iter()
        .map(|c| json!({"reason": c.reason, "message": c.message, "field": c.field}))
        .collect()
}

/// The one place where the registry's outcome becomes a wire status: code, reason, details.
impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        let message = e.to_string();
        match e {
            RegistryError::BadRequest(_) => ApiError::bad_request(message),
            RegistryError::NotFound { resource, name } => ApiError::not_found(resource, &name),
            RegistryError::AlreadyExists { resource, name } => {
                ApiError::already_exists(resource, &name)
            }
            RegistryError::Conflict { resource, name, .. } => {
                ApiError::new(StatusCode::CONFLICT, "Conflict", message)
                    .with_details(ApiError::object_details(resource, &name))
            }
            RegistryError::ApplyConflict { source } => {
                let causes = match &source {
                    FieldManagerError::Conflicts(conflicts) => conflicts
                        .iter()
                        .map(|c| {
                            Cause::new(
                                c.field.clone(),
                                format!("conflict with {}", c.manager),
                                "FieldManagerConflict",
                            )
                        })
                        .collect(),
                    _ => Vec::new(),
                };
                ApiError::new(StatusCode::CONFLICT, "Conflict", message)
                    .with_details(json!({"causes": causes_json(&causes)}))
            }
            RegistryError::Invalid {
                resource,
                name,
                causes,
            } => {
                let mut details = ApiError::object_details(resource, &name);
                details["causes"] = causes_json(&causes);
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", message)
                    .with_details(details)
            }
            RegistryError::InvalidOptions { options, causes } => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", message).with_details(
                    json!({"group": "meta.k8s.io", "kind": options, "causes": causes_json(&causes)}),
                )
            }
            RegistryError::Gone { continue_token, .. } => ApiError {
                continue_token,
                ..ApiError::gone(message)
            },
            RegistryError::ResourceVersionTooLarge { .. } => {
                ApiError::new(StatusCode::GATEWAY_TIMEOUT, "Timeout", message).with_details(json!({"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}], "retryAfterSeconds": 1}))
            }
            RegistryError::NamespaceNotFound(namespace) => {
                ApiError::new(StatusCode::NOT_FOUND, "NotFound", message)
                    .with_details(json!({"name": namespace, "kind": "namespaces"}))
            }
            RegistryError::NamespaceTerminating(namespace) => ApiError::forbidden(message)
                .with_details(json!({"causes": [{"reason": "NamespaceTerminating", "message": format!("namespace {namespace} is being terminated"), "field": "metadata.namespace"}]})),
            RegistryError::Unavailable(_) => ApiError::unavailable(message),
            RegistryError::TooLarge(_) => {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "RequestEntityTooLarge", message)
            }
            RegistryError::Internal(_) => ApiError::internal(message),
            RegistryError::Store(StoreError::AlreadyExists) => ApiError::new(
                StatusCode::CONFLICT,
                "AlreadyExists",
                "object already exists",
            ),
            RegistryError::Store(StoreError::Unavailable { message, .. }) => {
                ApiError::unavailable("the database is unavailable; retry later").with_cause(message)
            }
            RegistryError::Store(StoreError::Refused { refusal, source }) => {
                ApiError::unavailable(format!("{refusal}; retry later"))
                    .with_cause(source.to_string())
            }
            RegistryError::Store(StoreError::Ambiguous(cause)) => ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "Timeout",
                "the database did not confirm this write's commit; whether it was stored is unknown: read the object before writing it again",
            )
            .with_details(json!({"retryAfterSeconds": 1}))
            .with_cause(cause),
            RegistryError::Store(e @ StoreError::Database(_)) => ApiError::internal(
                "the database failed to run the request; the server's log has the cause",
            )
            .with_cause(e.to_string()),
            RegistryError::Store(other) => ApiError::internal(other.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.status().to_string();
        let mut response = (self.code, body).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if matches!(
            self.code,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        ) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.logged_elsewhere {
            response.extensions_mut().insert(super::LoggedElsewhere);
        }
        if self.code.is_server_error() {
            let cause = match self.cause {
                Some(cause) => format!("{}: {cause}", self.message),
                None => self.message,
            };
            response.extensions_mut().insert(super::ErrorCause(cause));
        }
        response
    }
}
