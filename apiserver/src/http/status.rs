//! Errors as Kubernetes `v1 Status` responses.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use reports_server_crds::ResourceDescriptor;
use serde_json::{Value, json};

use crate::store::StoreError;

/// An API error: HTTP code, Kubernetes reason, message and details.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: StatusCode,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Box<Value>>,
    /// Extra metadata for the Status (a fresh continue token on 410).
    pub continue_token: Option<String>,
}

impl ApiError {
    pub fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
            continue_token: None,
        }
    }

    pub fn with_details(mut self, details: Value) -> Self {
        self.details = Some(Box::new(details));
        self
    }

    fn object_details(desc: &ResourceDescriptor, name: &str) -> Value {
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

    pub fn conflict(desc: &ResourceDescriptor, name: &str, why: &str) -> Self {
        Self::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {}.{} \"{name}\": {why}",
                desc.plural, desc.group
            ),
        )
        .with_details(Self::object_details(desc, name))
    }

    /// 422 with one cause per invalid field.
    pub fn invalid(
        desc: &ResourceDescriptor,
        name: &str,
        causes: Vec<(String, String, &'static str)>,
    ) -> Self {
        let summary: Vec<String> = causes
            .iter()
            .map(|(f, m, _)| {
                if f.is_empty() {
                    m.clone()
                } else {
                    format!("{f}: {m}")
                }
            })
            .collect();
        let mut details = Self::object_details(desc, name);
        details["causes"] =
            causes.iter().map(|(field, message, reason)| json!({"reason": reason, "message": message, "field": field})).collect();
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!(
                "{} \"{name}\" is invalid: {}",
                desc.kind,
                summary.join(", ")
            ),
        )
        .with_details(details)
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
        if self.code == StatusCode::SERVICE_UNAVAILABLE {
            status["details"]["retryAfterSeconds"] = json!(1);
        }
        status
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(m) => {
                ApiError::unavailable(format!("the database is unavailable, retry later: {m}"))
            }
            StoreError::AlreadyExists => ApiError::new(
                StatusCode::CONFLICT,
                "AlreadyExists",
                "object already exists",
            ),
            other => ApiError::internal(other.to_string()),
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
        if self.code == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}
