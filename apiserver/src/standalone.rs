//! Standalone mode: the server with its own PKI and an embedded or given database, no cluster.
//! Used by `reports-server serve`, the benchmarks and the tests.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::auth::{AllowAuthenticated, ClientCertAuthenticator};
use crate::http::{ApiOptions, AppState, router};
use crate::metrics::Metrics;
use crate::pki::StandalonePki;
use crate::server;
use crate::store::{Store, StoreOptions};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Pki(#[from] crate::pki::PkiError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    Serve(#[from] server::ServeError),
}

#[derive(Clone, Debug)]
pub struct StandaloneConfig {
    pub data_dir: PathBuf,
    pub bind: SocketAddr,
    pub store: StoreOptions,
    pub api: ApiOptions,
    /// Where to write the admin kubeconfig.
    pub kubeconfig: PathBuf,
}

/// A running server.
pub struct RunningServer {
    pub addr: SocketAddr,
    pub kubeconfig: PathBuf,
    pub store: Store,
    pub pki: StandalonePki,
    shutdown: CancellationToken,
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
}

/// Starts the server: PKI, database (migrated), listener, kubeconfig.
pub async fn start(config: StandaloneConfig) -> Result<RunningServer, StartError> {
    let extra_names = vec![config.bind.ip().to_string()];
    let pki = StandalonePki::load_or_create(&config.data_dir, &extra_names)?;
    let store = Store::connect(config.store.clone()).await?;
    let listener = server::bind(config.bind).await?;
    let addr = listener
        .local_addr()
        .map_err(|e| server::ServeError::Bind(config.bind, e))?;
    let tls = server::tls_config(
        &pki.serving.cert_pem,
        &pki.serving.key_pem,
        std::slice::from_ref(&pki.ca.cert_pem),
    )?;
    let state = AppState {
        store: store.clone(),
        authenticator: Arc::new(ClientCertAuthenticator),
        authorizer: Arc::new(AllowAuthenticated),
        metrics: Metrics::new(),
        options: config.api.clone(),
    };
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(server::serve(
        listener,
        tls,
        router(state),
        shutdown.clone(),
    ));
    let running = RunningServer {
        addr,
        kubeconfig: config.kubeconfig.clone(),
        store,
        pki,
        shutdown,
        task,
    };
    running
        .pki
        .write_kubeconfig(&config.kubeconfig, &running.url())?;
    Ok(running)
}
