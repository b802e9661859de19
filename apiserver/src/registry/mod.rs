//! Kubernetes object semantics for the report kinds, between HTTP and the store.
//!
//! The HTTP layer (`crate::http`) turns a request into a [`ResourceRef`], options and a body;
//! this layer decides what the request means for the stored objects and runs it on the
//! [`Store`]:
//!
//! * [`rules`]: pure decisions — validation and pruning, names, server-owned metadata,
//!   generation, optimistic concurrency, finalizers, managedFields and server-side apply;
//! * [`operations`]: the orchestration of each verb over the store (the read-decide-write
//!   transaction, admission before creates, dry runs);
//! * [`list`]: continue tokens and `resourceVersion`/`resourceVersionMatch` rules of lists;
//! * [`watch`]: the watch state machine over the change log and the change feed;
//! * [`error`]: [`RegistryError`], the typed outcome every caller matches on;
//! * [`bulk`]: what background workers need of the whole store (versions, the version floor,
//!   scans in key order, a lease row).
//!
//! Background workers (the in-process Kyverno report merger, the migration engine) write through the same rules, so
//! their writes are indistinguishable from a client's; they never touch HTTP types. Only
//! `http::status` turns a [`RegistryError`] into a `v1 Status`.

pub mod bulk;
pub mod error;
pub mod fields;
pub mod list;
pub mod operations;
pub mod patch;
pub mod rules;
pub mod watch;

use reports_server_crds::ResourceDescriptor;

pub use crate::store::StoreError;
pub use crate::store::health::{DatabaseHealth, Outage};
pub use error::{Cause, RegistryError};
pub use list::{ListOptions, ListPageStream, ListResult};
pub use operations::{Imported, Patch, Registry, WriteOptions, Written, same_content};
pub use rules::{
    DeletePreconditions, FieldValidation, INTERNAL_MANAGER, Validation, decide_apply,
    decide_delete, decide_update, prepare_create, stamp_new,
};

/// A collection of one served kind: all namespaces, one namespace, or the cluster scope.
#[derive(Clone, Debug)]
pub struct ResourceRef {
    pub resource: &'static ResourceDescriptor,
    /// `Some` for namespaced requests; `None` for cluster-scoped kinds or all namespaces.
    pub namespace: Option<String>,
}

impl ResourceRef {
    /// The collection of `resource` in `namespace` (`""` is the cluster scope).
    pub fn new(resource: &'static ResourceDescriptor, namespace: &str) -> Self {
        ResourceRef {
            resource,
            namespace: (!namespace.is_empty()).then(|| namespace.to_owned()),
        }
    }

    /// The namespace column value of the addressed objects (`""` for cluster scope).
    pub fn object_namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or("")
    }
}

/// Refuses creates in namespaces that do not exist or are terminating (NamespaceLifecycle, as
/// kube-apiserver's admission does; only wired when serving behind kube-apiserver).
#[async_trait::async_trait]
pub trait Admission: Send + Sync + 'static {
    async fn admit_create(&self, namespace: &str) -> Result<(), RegistryError>;
}

/// RFC 1123 label: namespaces.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// RFC 1123 subdomain: object names of these kinds.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(is_dns_subdomain("6c737f35-260c-4e4f-8516-61a125c9fb78"));
        assert!(is_dns_subdomain("cpol-disallow-host-path-1"));
        assert!(!is_dns_subdomain("Upper"));
        assert!(!is_dns_subdomain("a..b"));
        assert!(!is_dns_label("a.b"));
    }
}
