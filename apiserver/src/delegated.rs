//! Serving behind kube-apiserver: delegated authentication and authorization, and the
//! NamespaceLifecycle admission check, as `k8s.io/apiserver` does for aggregated API servers.
//!
//! * Authentication: client certificates chained to the request-header (front-proxy) CA with an
//!   allowed CN carry the identity in `X-Remote-*` headers; certificates chained to the client CA
//!   are users (CN) in groups (O); bearer tokens go to a cached TokenReview. The CAs and header
//!   names come from `kube-system/extension-apiserver-authentication`, which is watched so CA
//!   rotation takes effect without a restart.
//! * Authorization: a SubjectAccessReview per decision, cached (allowed and denied, 10 s each);
//!   `system:masters` is allowed without asking, which kube-aggregator's availability probe
//!   relies on.
//! * Admission: creates in a namespace that does not exist or is terminating are refused.
//!
//! Both review caches are bounded ([`review_cache`]).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tracing::Instrument;

use futures::StreamExt;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, UnixTime};

use crate::auth::{
    Attributes, AuthError, AuthRequest, Authenticator, Authorizer, UserInfo, subject_of,
};
use crate::registry::{Admission, RegistryError};

mod review_cache;

use review_cache::ReviewCache;

const CONFIGMAP: &str = "extension-apiserver-authentication";
const CACHE_TTL: Duration = Duration::from_secs(10);
/// Answers kept per cache; beyond it the oldest are evicted one by one.
const CACHE_ENTRIES: usize = 10_000;

/// What `extension-apiserver-authentication` says.
#[derive(Clone)]
pub struct AuthenticationConfig {
    requestheader: Option<Arc<dyn ClientCertVerifier>>,
    allowed_names: Vec<String>,
    username_headers: Vec<String>,
    group_headers: Vec<String>,
    extra_prefixes: Vec<String>,
    uid_headers: Vec<String>,
    client_ca: Option<Arc<dyn ClientCertVerifier>>,
    /// Both CAs: what the TLS layer accepts.
    any: Option<Arc<dyn ClientCertVerifier>>,
}

#[derive(Debug, thiserror::Error)]
pub enum DelegationError {
    #[error(
        "cannot read kube-system/{CONFIGMAP}: {0} (the server's service account needs the extension-apiserver-authentication-reader Role in kube-system)"
    )]
    ConfigMap(kube::Error),
    #[error("invalid {0} in kube-system/{CONFIGMAP}: {1}")]
    Invalid(&'static str, String),
    #[error(
        "cannot read the kube-system namespace, whose UID tells this cluster's reports apart in a shared database: {0}{hint}",
        hint = if matches!(.0, kube::Error::Api(s) if s.code == 403) {
            " (the server's service account needs get on namespaces: re-apply the shipped ClusterRole reports-server:core)"
        } else {
            " (is kube-apiserver reachable with --kubeconfig or the in-cluster account?)"
        }
    )]
    ClusterUid(kube::Error),
    #[error(
        "the kube-system namespace has no metadata.uid, so this cluster cannot be told apart in a shared database (kube-apiserver always sets one: is --kubeconfig pointing at a real cluster?)"
    )]
    NoClusterUid,
}

/// The UID of the `kube-system` namespace: it lives as long as the cluster, so it names the
/// cluster (as the peer's default cluster id does).
pub async fn cluster_uid(client: &kube::Client) -> Result<String, DelegationError> {
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> =
        kube::Api::all(client.clone());
    let namespace = namespaces
        .get("kube-system")
        .await
        .map_err(DelegationError::ClusterUid)?;
    namespace.metadata.uid.ok_or(DelegationError::NoClusterUid)
}

fn verifier(roots: &RootCertStore) -> Result<Option<Arc<dyn ClientCertVerifier>>, String> {
    if roots.is_empty() {
        return Ok(None);
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    WebPkiClientVerifier::builder(Arc::new(roots.clone()))
        .allow_unauthenticated()
        .build()
        .map(|v| Some(v as Arc<dyn ClientCertVerifier>))
        .map_err(|e| e.to_string())
}

fn roots(pem: Option<&String>, what: &'static str) -> Result<RootCertStore, DelegationError> {
    let mut store = RootCertStore::empty();
    if let Some(pem) = pem {
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            let cert = cert.map_err(|e| DelegationError::Invalid(what, e.to_string()))?;
            store
                .add(cert)
                .map_err(|e| DelegationError::Invalid(what, e.to_string()))?;
        }
    }
    Ok(store)
}

fn json_list(
    data: &BTreeMap<String, String>,
    key: &'static str,
) -> Result<Vec<String>, DelegationError> {
    match data.get(key).map(|s| s.trim()).filter(|s| !s.is_empty()) {
        None => Ok(Vec::new()),
        Some(text) => {
            serde_json::from_str(text).map_err(|e| DelegationError::Invalid(key, e.to_string()))
        }
    }
}

impl AuthenticationConfig {
    pub fn from_configmap(data: &BTreeMap<String, String>) -> Result<Self, DelegationError> {
        let requestheader_roots = roots(
            data.get("requestheader-client-ca-file"),
            "requestheader-client-ca-file",
        )?;
        let client_roots = roots(data.get("client-ca-file"), "client-ca-file")?;
        let mut all = requestheader_roots.clone();
        for anchor in client_roots.roots.iter() {
            all.roots.push(anchor.clone());
        }
        let v =
            |r: &RootCertStore, what| verifier(r).map_err(|e| DelegationError::Invalid(what, e));
        Ok(AuthenticationConfig {
            requestheader: v(&requestheader_roots, "requestheader-client-ca-file")?,
            allowed_names: json_list(data, "requestheader-allowed-names")?,
            username_headers: json_list(data, "requestheader-username-headers")?,
            group_headers: json_list(data, "requestheader-group-headers")?,
            extra_prefixes: json_list(data, "requestheader-extra-headers-prefix")?,
            uid_headers: json_list(data, "requestheader-uid-headers")?,
            client_ca: v(&client_roots, "client-ca-file")?,
            any: v(&all, "client CAs")?,
        })
    }
}

fn chain_verifies(
    verifier: &Option<Arc<dyn ClientCertVerifier>>,
    chain: &[CertificateDer<'static>],
) -> bool {
    match (verifier, chain.split_first()) {
        (Some(v), Some((leaf, intermediates))) => v
            .verify_client_cert(leaf, intermediates, UnixTime::now())
            .is_ok(),
        _ => false,
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The identity carried in request headers by a verified front proxy.
pub fn identity_from_headers(
    config: &AuthenticationConfig,
    headers: &http::HeaderMap,
) -> Option<UserInfo> {
    let values = |name: &str| {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok().map(str::to_owned))
            .collect::<Vec<_>>()
    };
    let name = config
        .username_headers
        .iter()
        .flat_map(|h| values(h))
        .find(|v| !v.is_empty())?;
    let groups = config
        .group_headers
        .iter()
        .flat_map(|h| values(h))
        .collect();
    let uid = config
        .uid_headers
        .iter()
        .flat_map(|h| values(h))
        .find(|v| !v.is_empty());
    let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (header, value) in headers {
        let header = header.as_str();
        for prefix in &config.extra_prefixes {
            if let Some(key) = header.strip_prefix(&prefix.to_ascii_lowercase())
                && let Ok(v) = value.to_str()
            {
                extra
                    .entry(percent_decode(key).to_ascii_lowercase())
                    .or_default()
                    .push(v.to_owned());
            }
        }
    }
    Some(UserInfo {
        name,
        groups,
        uid,
        extra,
    })
}

/// Authenticates like a delegating `k8s.io/apiserver`.
pub struct DelegatedAuthenticator {
    config: Arc<RwLock<Arc<AuthenticationConfig>>>,
    client: kube::Client,
    tokens: ReviewCache<Option<UserInfo>>,
}

impl DelegatedAuthenticator {
    /// Reads the ConfigMap once (failing start-up if it cannot) and keeps watching it.
    pub async fn start(
        client: kube::Client,
    ) -> Result<(Arc<Self>, DynamicClientVerifier), DelegationError> {
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), "kube-system");
        let cm = api
            .get(CONFIGMAP)
            .await
            .map_err(DelegationError::ConfigMap)?;
        let config = Arc::new(AuthenticationConfig::from_configmap(
            &cm.data.unwrap_or_default(),
        )?);
        let shared = Arc::new(RwLock::new(config));
        let this = Arc::new(DelegatedAuthenticator {
            config: shared.clone(),
            client,
            tokens: ReviewCache::new(CACHE_TTL, CACHE_ENTRIES),
        });
        let watched = shared.clone();
        tokio::spawn(
            async move {
                let cfg = watcher::Config::default().fields(&format!("metadata.name={CONFIGMAP}"));
                let mut stream = watcher(api, cfg)
                    .default_backoff()
                    .applied_objects()
                    .boxed();
                while let Some(event) = stream.next().await {
                    match event {
                        Ok(cm) => {
                            match AuthenticationConfig::from_configmap(&cm.data.unwrap_or_default())
                            {
                                Ok(c) => {
                                    *watched.write().expect("config lock") = Arc::new(c);
                                    tracing::info!("reloaded {CONFIGMAP}");
                                }
                                Err(e) => {
                                    tracing::warn!(error = %e, "ignoring invalid {CONFIGMAP}")
                                }
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "watching {CONFIGMAP}"),
                    }
                }
            }
            .instrument(tracing::info_span!("auth_config_watch")),
        );
        Ok((this, DynamicClientVerifier { config: shared }))
    }

    fn current(&self) -> Arc<AuthenticationConfig> {
        self.config.read().expect("config lock").clone()
    }

    async fn token_review(&self, token: &str) -> Result<Option<UserInfo>, AuthError> {
        let key = ReviewCache::<Option<UserInfo>>::key(&[token.as_bytes()]);
        if let Some(user) = self.tokens.get(&key) {
            return Ok(user);
        }
        let _turn = self.tokens.turn().await;
        // Another request may have asked for the same token while this one waited.
        if let Some(user) = self.tokens.get(&key) {
            return Ok(user);
        }
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                ..Default::default()
            },
            ..Default::default()
        };
        let result = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| AuthError::Unavailable(format!("TokenReview: {e}")))?;
        let status = result.status.unwrap_or_default();
        let user = if status.authenticated == Some(true) {
            status.user.map(|u| UserInfo {
                name: u.username.unwrap_or_default(),
                groups: u.groups.unwrap_or_default(),
                uid: u.uid,
                extra: u.extra.unwrap_or_default().into_iter().collect(),
            })
        } else {
            None
        };
        self.tokens.insert(key, user.clone());
        Ok(user)
    }
}

#[async_trait::async_trait]
impl Authenticator for DelegatedAuthenticator {
    async fn authenticate(&self, request: &AuthRequest<'_>) -> Result<Option<UserInfo>, AuthError> {
        Ok(self
            .identify(request)
            .await?
            .map(UserInfo::with_authenticated_group))
    }
}

impl DelegatedAuthenticator {
    /// Who the request says it is, by the first method that applies: front-proxy headers, a
    /// client certificate, a bearer token.
    async fn identify(&self, request: &AuthRequest<'_>) -> Result<Option<UserInfo>, AuthError> {
        let config = self.current();
        let chain = request.peer.0.as_slice();
        if !chain.is_empty() {
            if chain_verifies(&config.requestheader, chain) {
                let cn = subject_of(&chain[0]).map(|u| u.name).unwrap_or_default();
                if config.allowed_names.is_empty() || config.allowed_names.contains(&cn) {
                    return Ok(identity_from_headers(&config, request.headers));
                }
            }
            if chain_verifies(&config.client_ca, chain) {
                return Ok(subject_of(&chain[0]));
            }
        }
        let bearer = request
            .headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty());
        match bearer {
            Some(token) => self.token_review(token).await,
            None => Ok(None),
        }
    }
}

/// A TLS client-certificate verifier that follows CA rotation in the ConfigMap. Certificates are
/// optional (probes and token clients have none); which CA a certificate chains to is decided
/// again per request by the authenticator.
#[derive(Clone)]
pub struct DynamicClientVerifier {
    config: Arc<RwLock<Arc<AuthenticationConfig>>>,
}

impl std::fmt::Debug for DynamicClientVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DynamicClientVerifier")
    }
}

impl DynamicClientVerifier {
    fn inner(&self) -> Option<Arc<dyn ClientCertVerifier>> {
        self.config.read().expect("config lock").any.clone()
    }
}

impl ClientCertVerifier for DynamicClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }
    fn client_auth_mandatory(&self) -> bool {
        false
    }
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // No hints: Go clients then send their certificate whatever CA issued it.
        &[]
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        match self.inner() {
            Some(v) => v.verify_client_cert(end_entity, intermediates, now),
            None => Err(rustls::Error::General("no client CA configured".into())),
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &rustls::crypto::ring::default_provider().signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &rustls::crypto::ring::default_provider().signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Authorizes with SubjectAccessReviews, caching allowed and denied answers (`Err` carries the
/// denial reason).
pub struct SarAuthorizer {
    client: kube::Client,
    cache: ReviewCache<Result<(), String>>,
}

impl SarAuthorizer {
    pub fn new(client: kube::Client) -> Self {
        SarAuthorizer {
            client,
            cache: ReviewCache::new(CACHE_TTL, CACHE_ENTRIES),
        }
    }
}

#[async_trait::async_trait]
impl Authorizer for SarAuthorizer {
    async fn authorize(
        &self,
        user: &UserInfo,
        a: &Attributes,
    ) -> Result<Result<(), String>, AuthError> {
        if user.groups.iter().any(|g| g == "system:masters") {
            return Ok(Ok(()));
        }
        let key = ReviewCache::<Result<(), String>>::key(&[
            user.name.as_bytes(),
            format!(
                "{:?}\u{0}{:?}\u{0}{:?}\u{0}{a:?}",
                user.groups, user.uid, user.extra
            )
            .as_bytes(),
        ]);
        if let Some(decision) = self.cache.get(&key) {
            return Ok(decision);
        }
        let _turn = self.cache.turn().await;
        if let Some(decision) = self.cache.get(&key) {
            return Ok(decision);
        }
        let spec = SubjectAccessReviewSpec {
            user: Some(user.name.clone()),
            groups: Some(user.groups.clone()),
            uid: user.uid.clone(),
            extra: (!user.extra.is_empty()).then(|| user.extra.clone().into_iter().collect()),
            resource_attributes: a.path.is_none().then(|| ResourceAttributes {
                verb: Some(a.verb.clone()),
                group: Some(a.group.clone()),
                version: Some(a.version.clone()),
                resource: Some(a.resource.clone()),
                namespace: a.namespace.clone(),
                name: a.name.clone(),
                ..Default::default()
            }),
            non_resource_attributes: a.path.as_ref().map(|p| NonResourceAttributes {
                path: Some(p.clone()),
                verb: Some(a.verb.clone()),
            }),
        };
        let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let review = api
            .create(
                &PostParams::default(),
                &SubjectAccessReview {
                    spec,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| AuthError::Unavailable(format!("SubjectAccessReview: {e}")))?;
        let status = review.status.unwrap_or_default();
        let decision = if status.allowed {
            Ok(())
        } else {
            Err(status.reason.unwrap_or_default())
        };
        self.cache.insert(key, decision.clone());
        Ok(decision)
    }
}

/// NamespaceLifecycle admission from a reflector of the cluster's namespaces.
pub struct NamespaceLifecycle {
    client: kube::Client,
    namespaces: reflector::Store<Namespace>,
}

impl NamespaceLifecycle {
    pub async fn start(client: kube::Client) -> Arc<Self> {
        let (reader, writer) = reflector::store();
        let api: Api<Namespace> = Api::all(client.clone());
        let stream = reflector(writer, watcher(api, watcher::Config::default()))
            .default_backoff()
            .touched_objects();
        tokio::spawn(
            async move {
                futures::pin_mut!(stream);
                while let Some(event) = stream.next().await {
                    if let Err(e) = event {
                        tracing::warn!(error = %e, "watching namespaces");
                    }
                }
            }
            .instrument(tracing::info_span!("namespace_watch")),
        );
        let _ = tokio::time::timeout(Duration::from_secs(10), reader.wait_until_ready()).await;
        Arc::new(NamespaceLifecycle {
            client,
            namespaces: reader,
        })
    }
}

fn terminating(ns: &Namespace) -> bool {
    ns.metadata.deletion_timestamp.is_some()
        || ns.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Terminating")
}

#[async_trait::async_trait]
impl Admission for NamespaceLifecycle {
    async fn admit_create(&self, namespace: &str) -> Result<(), RegistryError> {
        let cached = self.namespaces.get(&reflector::ObjectRef::new(namespace));
        let ns = match cached {
            Some(ns) => Some((*ns).clone()),
            // Maybe created a moment ago: ask the cluster.
            None => Api::<Namespace>::all(self.client.clone())
                .get_opt(namespace)
                .await
                .map_err(|e| {
                    RegistryError::Unavailable(format!("cannot look up namespace {namespace}: {e}"))
                })?,
        };
        match ns {
            None => Err(RegistryError::NamespaceNotFound(namespace.to_owned())),
            Some(ns) if terminating(&ns) => {
                Err(RegistryError::NamespaceTerminating(namespace.to_owned()))
            }
            Some(_) => Ok(()),
        }
    }
}
