//! What can go wrong with a request on the report kinds, as the Kubernetes API names it.
//!
//! The variants are Kubernetes `StatusReason`s, not HTTP codes: the registry decides *what*
//! happened, and only `http::status` decides how it looks on the wire (code, `Status` details).
//! The `Display` text is the `Status.message` kube-apiserver would send, so logs and clients see
//! the same words.

use reports_server_crds::ResourceDescriptor;

use crate::fieldmanager::FieldManagerError;
use crate::store::StoreError;

/// One invalid field of a request (`Status.details.causes[]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cause {
    /// The field path (`metadata.name`, `results[0].result`), empty for the whole object.
    pub field: String,
    pub message: String,
    /// `FieldValueInvalid`, `FieldValueRequired`, `FieldManagerConflict`, …
    pub reason: &'static str,
}

impl Cause {
    pub fn new(field: impl Into<String>, message: impl Into<String>, reason: &'static str) -> Self {
        Cause {
            field: field.into(),
            message: message.into(),
            reason,
        }
    }
}

/// Errors of the registry: object rules, preconditions, admission and the store below.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The request itself is malformed (wrong kind, names that disagree, bad options).
    #[error("{0}")]
    BadRequest(String),
    #[error("{}.{} \"{name}\" not found", resource.plural, resource.group)]
    NotFound {
        resource: &'static ResourceDescriptor,
        name: String,
    },
    #[error("{}.{} \"{name}\" already exists", resource.plural, resource.group)]
    AlreadyExists {
        resource: &'static ResourceDescriptor,
        name: String,
    },
    /// Optimistic concurrency or a UID precondition failed.
    #[error("Operation cannot be fulfilled on {}.{} \"{name}\": {why}", resource.plural, resource.group)]
    Conflict {
        resource: &'static ResourceDescriptor,
        name: String,
        why: String,
    },
    /// A server-side apply would change fields another manager owns.
    #[error("{source}")]
    ApplyConflict {
        #[source]
        source: FieldManagerError,
    },
    /// The object fails validation; one cause per field.
    #[error("{} \"{name}\" is invalid: {}", resource.kind, summary(causes))]
    Invalid {
        resource: &'static ResourceDescriptor,
        name: String,
        causes: Vec<Cause>,
    },
    /// The request options (`CreateOptions`, `PatchOptions`, …) are invalid.
    #[error("{options}.meta.k8s.io \"\" is invalid: {}", summary(causes))]
    InvalidOptions {
        options: &'static str,
        causes: Vec<Cause>,
    },
    /// The requested resourceVersion is older than what the store keeps (410 Expired).
    #[error("{message}")]
    Gone {
        message: String,
        /// A continue token that restarts the list at the current state, when one exists.
        continue_token: Option<String>,
    },
    /// A resourceVersion newer than the store's: the client must wait (504 Timeout).
    #[error("Too large resource version: {requested}, current: {current}")]
    ResourceVersionTooLarge { requested: i64, current: i64 },
    /// NamespaceLifecycle: the namespace of a create does not exist.
    #[error("namespaces \"{0}\" not found")]
    NamespaceNotFound(String),
    /// NamespaceLifecycle: the namespace of a create is being deleted.
    #[error("unable to create new content in namespace {0} because it is being terminated")]
    NamespaceTerminating(String),
    /// The request would make the server build something beyond a limit (a JSON patch with
    /// too many operations, a patched object over the size limit): 413.
    #[error("{0}")]
    TooLarge(String),
    /// A dependency other than the database (the cluster, for admission) did not answer.
    #[error("{0}")]
    Unavailable(String),
    /// Stored data the server cannot use (corrupt managedFields, undecodable metadata).
    #[error("{0}")]
    Internal(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn summary(causes: &[Cause]) -> String {
    causes
        .iter()
        .map(|c| {
            if c.field.is_empty() {
                c.message.clone()
            } else {
                format!("{}: {}", c.field, c.message)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

impl RegistryError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        RegistryError::BadRequest(message.into())
    }

    pub fn not_found(resource: &'static ResourceDescriptor, name: &str) -> Self {
        RegistryError::NotFound {
            resource,
            name: name.to_owned(),
        }
    }

    pub fn already_exists(resource: &'static ResourceDescriptor, name: &str) -> Self {
        RegistryError::AlreadyExists {
            resource,
            name: name.to_owned(),
        }
    }

    pub fn conflict(resource: &'static ResourceDescriptor, name: &str, why: &str) -> Self {
        RegistryError::Conflict {
            resource,
            name: name.to_owned(),
            why: why.to_owned(),
        }
    }

    pub fn invalid(resource: &'static ResourceDescriptor, name: &str, causes: Vec<Cause>) -> Self {
        RegistryError::Invalid {
            resource,
            name: name.to_owned(),
            causes,
        }
    }

    /// One invalid field.
    pub fn invalid_field(
        resource: &'static ResourceDescriptor,
        name: &str,
        field: impl Into<String>,
        message: impl Into<String>,
        reason: &'static str,
    ) -> Self {
        Self::invalid(resource, name, vec![Cause::new(field, message, reason)])
    }

    pub fn gone(message: impl Into<String>) -> Self {
        RegistryError::Gone {
            message: message.into(),
            continue_token: None,
        }
    }

    /// The Kubernetes `StatusReason` of this error.
    pub fn reason(&self) -> &'static str {
        match self {
            RegistryError::BadRequest(_) => "BadRequest",
            RegistryError::NotFound { .. } | RegistryError::NamespaceNotFound(_) => "NotFound",
            RegistryError::AlreadyExists { .. } => "AlreadyExists",
            RegistryError::Conflict { .. } | RegistryError::ApplyConflict { .. } => "Conflict",
            RegistryError::Invalid { .. } | RegistryError::InvalidOptions { .. } => "Invalid",
            RegistryError::Gone { .. } => "Expired",
            RegistryError::ResourceVersionTooLarge { .. } => "Timeout",
            RegistryError::NamespaceTerminating(_) => "Forbidden",
            RegistryError::TooLarge(_) => "RequestEntityTooLarge",
            RegistryError::Unavailable(_) => "ServiceUnavailable",
            RegistryError::Internal(_) => "InternalError",
            RegistryError::Store(StoreError::AlreadyExists) => "AlreadyExists",
            RegistryError::Store(e) if e.is_unavailable() => "ServiceUnavailable",
            RegistryError::Store(StoreError::Refused { .. }) => "ServiceUnavailable",
            RegistryError::Store(StoreError::Ambiguous(_)) => "Timeout",
            RegistryError::Store(_) => "InternalError",
        }
    }

    /// `true` for the errors a writer resolves by reading again and retrying: a stale
    /// resourceVersion, a UID that changed, an object that appeared or vanished meanwhile.
    pub fn is_conflict(&self) -> bool {
        matches!(
            self,
            RegistryError::Conflict { .. }
                | RegistryError::ApplyConflict { .. }
                | RegistryError::AlreadyExists { .. }
                | RegistryError::Store(StoreError::AlreadyExists)
        )
    }

    /// The field causes, for tests and logs.
    pub fn causes(&self) -> &[Cause] {
        match self {
            RegistryError::Invalid { causes, .. }
            | RegistryError::InvalidOptions { causes, .. } => causes,
            _ => &[],
        }
    }
}
