//! Authentication and authorization behind small traits, so standalone mode (our own client
//! CA) and delegated mode (front-proxy, TokenReview, SubjectAccessReview) plug into the same
//! router.

use std::sync::Arc;

use rustls_pki_types::CertificateDer;

/// Who is calling.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct UserInfo {
    pub name: String,
    pub groups: Vec<String>,
    pub uid: Option<String>,
    pub extra: std::collections::BTreeMap<String, Vec<String>>,
}

impl UserInfo {
    /// Adds `system:authenticated` as k8s.io/apiserver does for every authenticated user
    /// (not for `system:anonymous`, and not twice). RBAC's default `system:discovery` and
    /// `system:public-info-viewer` bindings name that group, so without it kube-aggregator's
    /// OpenAPI downloader (user `system:aggregator`, no group headers) would be denied.
    pub fn with_authenticated_group(mut self) -> Self {
        let has_marker = self
            .groups
            .iter()
            .any(|g| g == "system:authenticated" || g == "system:unauthenticated");
        if self.name != "system:anonymous" && !has_marker {
            self.groups.push("system:authenticated".into());
        }
        self
    }
}

/// The verified client certificate chain of a TLS connection (leaf first), if any.
#[derive(Clone, Debug, Default)]
pub struct PeerCertificates(pub Arc<Vec<CertificateDer<'static>>>);

/// What the authenticator may look at.
pub struct AuthRequest<'a> {
    pub peer: &'a PeerCertificates,
    pub headers: &'a http::HeaderMap,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("authentication backend unavailable: {0}")]
    Unavailable(String),
}

#[async_trait::async_trait]
pub trait Authenticator: Send + Sync + 'static {
    /// `Ok(None)`: anonymous (answered 401).
    async fn authenticate(&self, request: &AuthRequest<'_>) -> Result<Option<UserInfo>, AuthError>;
}

/// Trusts client certificates that the TLS layer verified against our client CA:
/// user = CN, groups = O.
pub struct ClientCertAuthenticator;

/// CN and O values of a DER certificate.
pub fn subject_of(der: &CertificateDer<'_>) -> Option<UserInfo> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
    let subject = cert.subject();
    let name = subject.iter_common_name().next()?.as_str().ok()?.to_owned();
    let groups = subject
        .iter_organization()
        .filter_map(|o| o.as_str().ok().map(str::to_owned))
        .collect();
    Some(UserInfo {
        name,
        groups,
        uid: None,
        extra: Default::default(),
    })
}

#[async_trait::async_trait]
impl Authenticator for ClientCertAuthenticator {
    async fn authenticate(&self, request: &AuthRequest<'_>) -> Result<Option<UserInfo>, AuthError> {
        Ok(request.peer.0.first().and_then(subject_of))
    }
}

/// The subset of a request an authorizer decides on.
#[derive(Clone, Debug)]
pub struct Attributes {
    pub verb: String,
    pub group: String,
    pub version: String,
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
    /// For non-resource requests (`/apis`, `/openapi/v3`).
    pub path: Option<String>,
}

#[async_trait::async_trait]
pub trait Authorizer: Send + Sync + 'static {
    /// `Ok(Err(reason))` is a denial.
    async fn authorize(
        &self,
        user: &UserInfo,
        attributes: &Attributes,
    ) -> Result<Result<(), String>, AuthError>;
}

/// Standalone mode: every authenticated client holds a certificate we issued, so it may do
/// everything.
pub struct AllowAuthenticated;

#[async_trait::async_trait]
impl Authorizer for AllowAuthenticated {
    async fn authorize(
        &self,
        _: &UserInfo,
        _: &Attributes,
    ) -> Result<Result<(), String>, AuthError> {
        Ok(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(name: &str, groups: &[&str]) -> UserInfo {
        UserInfo {
            name: name.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn authenticated_users_join_system_authenticated_once() {
        assert_eq!(
            user("system:aggregator", &[])
                .with_authenticated_group()
                .groups,
            ["system:authenticated"]
        );
        assert_eq!(
            user("alice", &["dev", "system:authenticated"])
                .with_authenticated_group()
                .groups,
            ["dev", "system:authenticated"]
        );
        assert!(
            user("system:anonymous", &["system:unauthenticated"])
                .with_authenticated_group()
                .groups
                .iter()
                .all(|g| g != "system:authenticated")
        );
    }
}
