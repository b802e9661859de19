//! Starting the server. Two modes share everything but authentication:
//! * standalone: its own CA, an admin client certificate and a kubeconfig, no cluster;
//! * delegated: behind kube-apiserver, authenticating and authorizing through the cluster
//!   (`crate::delegated`), with a serving certificate for `<service>.<namespace>.svc`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

use tokio_util::sync::CancellationToken;

use crate::auth::{AllowAuthenticated, ClientCertAuthenticator};
use crate::delegated::{DelegatedAuthenticator, NamespaceLifecycle, SarAuthorizer};
use crate::http::{ApiOptions, AppState, router};
use crate::metrics::Metrics;
use crate::pki::CertPair;
use crate::pki::StandalonePki;
use crate::registry::{Admission, Registry};
use crate::server;
use crate::server::ClientAuth;
use crate::store::{Store, StoreOptions};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Pki(#[from] crate::pki::PkiError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    Serve(#[from] server::ServeError),
    #[error(transparent)]
    Delegation(#[from] crate::delegated::DelegationError),
}

/// How callers are authenticated and authorized.
#[derive(Clone, Default)]
pub enum AuthMode {
    /// Our own CA; every holder of a certificate it issued may do everything.
    #[default]
    Standalone,
    /// Delegated to the cluster this client talks to.
    Delegated(kube::Client),
}

#[derive(Clone)]
pub struct ServerConfig {
    pub data_dir: PathBuf,
    pub bind: SocketAddr,
    pub store: StoreOptions,
    pub api: ApiOptions,
    /// Where to write the admin kubeconfig (standalone mode only).
    pub kubeconfig: PathBuf,
    pub auth: AuthMode,
    /// A serving certificate and key (PEM) to use instead of generating one.
    pub serving: Option<CertPair>,
    /// Where `serving` was read from, re-read every interval for a renewed certificate.
    pub serving_reload: Option<ServingReload>,
    /// Extra names the generated serving certificate covers (e.g. `<service>.<namespace>.svc`).
    pub serving_names: Vec<String>,
    /// Bounds on client connections (timeouts, counts).
    pub connections: server::ConnectionLimits,
}

/// A running server.
pub struct RunningServer {
    pub addr: SocketAddr,
    /// The `/metrics` registry, for components started next to the server.
    pub metrics: Arc<Metrics>,
    pub kubeconfig: PathBuf,
    pub store: Store,
    pub pki: StandalonePki,
    shutdown: CancellationToken,
    draining: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl RunningServer {
    pub fn url(&self) -> String {
        let host = match self.addr.ip() {
            ip if ip.is_unspecified() => "127.0.0.1".to_owned(),
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
            ip => ip.to_string(),
        };
        format!("https://{host}:{}", self.addr.port())
    }

    /// Stops accepting, drains connections (up to 5 s) and returns.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }

    /// Waits until the server stops (it only stops when shut down).
    pub async fn wait(self) {
        let _ = self.task.await;
    }

    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Cancel to start draining: `/readyz` fails, everything else keeps serving until
    /// [`Self::shutdown_token`] is cancelled.
    pub fn draining_token(&self) -> CancellationToken {
        self.draining.clone()
    }
}

/// Files the serving certificate is reloaded from (see [`server::ServingCert`]).
#[derive(Clone, Debug)]
pub struct ServingReload {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub interval: Duration,
}

/// Starts the server: PKI, database (migrated), listener, and in standalone mode the kubeconfig.
/// A database that cannot be reached does not stop it: discovery is served at once, data
/// requests once the database answers (see `store::health`).
pub async fn start(config: ServerConfig) -> Result<RunningServer, StartError> {
    let mut extra_names = vec![config.bind.ip().to_string()];
    extra_names.extend(config.serving_names.iter().cloned());
    let pki = StandalonePki::load_or_create(&config.data_dir, &extra_names)?;
    let serving = config
        .serving
        .clone()
        .unwrap_or_else(|| pki.serving.clone());
    let mut store_options = config.store.clone();
    if let AuthMode::Delegated(client) = &config.auth {
        store_options.cluster_uid = Some(crate::delegated::cluster_uid(client).await?);
    }
    let store = Store::connect_or_wait(store_options).await?;
    let listener = server::bind(config.bind).await?;
    let addr = listener
        .local_addr()
        .map_err(|e| server::ServeError::Bind(config.bind, e))?;
    let metrics = Metrics::new();
    metrics.register(|registry| store.register_metrics(registry));
    let draining = CancellationToken::new();
    let shutdown = CancellationToken::new();
    let serving_cert = server::ServingCert::new(&serving.cert_pem, &serving.key_pem)?;
    let (state, tls) = match &config.auth {
        AuthMode::Standalone => {
            let client_auth = ClientAuth::Roots(vec![pki.ca.cert_pem.clone()]);
            let tls = server::tls_config(serving_cert.clone(), client_auth)?;
            let state = AppState {
                registry: Registry::new(store.clone(), None),
                authenticator: Arc::new(ClientCertAuthenticator),
                authorizer: Arc::new(AllowAuthenticated),
                metrics: metrics.clone(),
                options: config.api.clone(),
                draining: draining.clone(),
            };
            (state, tls)
        }
        AuthMode::Delegated(client) => {
            let (authenticator, verifier) = DelegatedAuthenticator::start(client.clone()).await?;
            let client_auth = ClientAuth::Verifier(Arc::new(verifier));
            let tls = server::tls_config(serving_cert.clone(), client_auth)?;
            let admission: Arc<dyn Admission> = NamespaceLifecycle::start(client.clone()).await;
            let state = AppState {
                registry: Registry::new(store.clone(), Some(admission)),
                authenticator,
                authorizer: Arc::new(SarAuthorizer::new(client.clone())),
                metrics: metrics.clone(),
                options: config.api.clone(),
                draining: draining.clone(),
            };
            (state, tls)
        }
    };
    if let Some(reload) = &config.serving_reload {
        // Compared with what the certificate was built from, not with a later read: a renewal
        // written while the database connected is picked up at the first tick.
        tokio::spawn(
            serving_cert
                .clone()
                .reload_from_files(
                    reload.cert_file.clone(),
                    reload.key_file.clone(),
                    (serving.cert_pem.clone(), serving.key_pem.clone()),
                    reload.interval,
                    shutdown.clone(),
                )
                .instrument(tracing::info_span!("serving_cert_reload")),
        );
    }
    let task = tokio::spawn(server::serve(
        listener,
        tls,
        router(state),
        config.connections.clone(),
        shutdown.clone(),
    ));
    let running = RunningServer {
        addr,
        metrics,
        kubeconfig: config.kubeconfig.clone(),
        store,
        pki,
        shutdown,
        draining,
        task,
    };
    if matches!(config.auth, AuthMode::Standalone) {
        running
            .pki
            .write_kubeconfig(&config.kubeconfig, &running.url())?;
    }
    Ok(running)
}
