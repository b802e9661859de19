//! HTTPS serving: rustls with an optional client-certificate check, HTTP/1.1 and h2 on one port
//! (ALPN), and the verified peer chain handed to the router as a request extension.

use std::net::SocketAddr;
use std::sync::Arc;

use futures::FutureExt;
use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

mod connection;

pub use connection::ConnectionLimits;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("invalid TLS material: {0}")]
    Tls(String),
    #[error("cannot listen on {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
}

/// How the TLS layer treats client certificates.
pub enum ClientAuth {
    /// Verify presented certificates against these CA PEMs (standalone mode).
    Roots(Vec<String>),
    /// A verifier that follows CA rotation (delegated mode).
    Verifier(Arc<dyn rustls::server::danger::ClientCertVerifier>),
}

/// The serving certificate, replaceable while the server runs: a renewed certificate (a
/// Secret the kubelet updates in place, cert-manager, the operator's renewal) is picked up by
/// new TLS handshakes without a restart; connections already open keep theirs.
#[derive(Debug)]
pub struct ServingCert {
    current: std::sync::RwLock<Arc<CertifiedKey>>,
}

impl ServingCert {
    pub fn new(cert_pem: &str, key_pem: &str) -> Result<Arc<Self>, ServeError> {
        Ok(Arc::new(ServingCert {
            current: std::sync::RwLock::new(Arc::new(certified_key(cert_pem, key_pem)?)),
        }))
    }

    /// Replaces the certificate; on invalid material the current one stays.
    pub fn replace(&self, cert_pem: &str, key_pem: &str) -> Result<(), ServeError> {
        let key = certified_key(cert_pem, key_pem)?;
        *self.current.write().expect("not poisoned") = Arc::new(key);
        Ok(())
    }

    /// The DER of the current leaf certificate.
    pub fn leaf(&self) -> CertificateDer<'static> {
        self.current.read().expect("not poisoned").cert[0].clone()
    }

    /// Re-reads `cert_file` and `key_file` every `interval` and replaces the certificate when
    /// either changed, until `shutdown`. A pair that does not load (the two files are updated
    /// one after the other, or are being written) is retried at the next tick; the certificate
    /// in use stays until a valid pair is read.
    /// `in_use` is the (certificate, key) PEM the current certificate was built from.
    pub async fn reload_from_files(
        self: Arc<Self>,
        cert_file: std::path::PathBuf,
        key_file: std::path::PathBuf,
        in_use: (String, String),
        interval: std::time::Duration,
        shutdown: CancellationToken,
    ) {
        let read = || {
            Some((
                std::fs::read_to_string(&cert_file).ok()?,
                std::fs::read_to_string(&key_file).ok()?,
            ))
        };
        let mut loaded = Some(in_use);
        let mut failing = false;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
            let Some(now) = read() else {
                if !failing {
                    tracing::warn!(cert = %cert_file.display(), key = %key_file.display(), "cannot read the serving certificate files; keeping the current certificate");
                }
                failing = true;
                continue;
            };
            if loaded.as_ref() == Some(&now) {
                failing = false;
                continue;
            }
            match self.replace(&now.0, &now.1) {
                Ok(()) => {
                    tracing::info!(cert = %cert_file.display(), "serving certificate reloaded");
                    loaded = Some(now);
                    failing = false;
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, cert = %cert_file.display(), "the changed serving certificate does not load; keeping the current one until it does");
                    }
                    failing = true;
                }
            }
        }
    }
}

impl rustls::server::ResolvesServerCert for ServingCert {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().expect("not poisoned").clone())
    }
}

fn certified_key(cert_pem: &str, key_pem: &str) -> Result<CertifiedKey, ServeError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| ServeError::Tls(format!("serving certificate: {e}")))?;
    if certs.is_empty() {
        return Err(ServeError::Tls(
            "serving certificate: no PEM certificate".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| ServeError::Tls(format!("serving key: {e}")))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| ServeError::Tls(format!("serving key: {e}")))?;
    let certified = CertifiedKey::new(certs, signing);
    certified.keys_match().map_err(|e| {
        ServeError::Tls(format!(
            "the serving key does not belong to the certificate: {e}"
        ))
    })?;
    Ok(certified)
}

/// Builds the rustls configuration: our serving certificate, and client certificates verified
/// when presented (never required, so probes and token clients work). ALPN offers h2 and
/// HTTP/1.1.
pub fn tls_config(
    serving: Arc<ServingCert>,
    client_auth: ClientAuth,
) -> Result<rustls::ServerConfig, ServeError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let verifier: Arc<dyn rustls::server::danger::ClientCertVerifier> = match client_auth {
        ClientAuth::Verifier(v) => v,
        ClientAuth::Roots(pems) => {
            let mut roots = RootCertStore::empty();
            for pem in &pems {
                for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                    let cert = cert.map_err(|e| ServeError::Tls(format!("client CA: {e}")))?;
                    roots
                        .add(cert)
                        .map_err(|e| ServeError::Tls(format!("client CA: {e}")))?;
                }
            }
            WebPkiClientVerifier::builder(Arc::new(roots))
                .allow_unauthenticated()
                .build()
                .map_err(|e| ServeError::Tls(format!("client verifier: {e}")))?
        }
    };
    let mut config = rustls::ServerConfig::builder()
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(serving);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// Binds the listener (separately from serving, so callers learn the port before serving).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| ServeError::Bind(addr, e))
}

/// Serves `router` over TLS until `shutdown` is cancelled, each connection within `limits`.
pub async fn serve(
    listener: TcpListener,
    tls: rustls::ServerConfig,
    router: axum::Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
) {
    let acceptor = TlsAcceptor::from(Arc::new(tls));
    let limits = Arc::new(limits);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        // At the cap no connection is accepted: clients wait in the listen backlog.
        let slot = tokio::select! {
            _ = shutdown.cancelled() => return,
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
        };
        let (tcp, remote) = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let span = tracing::debug_span!("connection", %remote);
        tokio::spawn(
            connection::serve_connection(
                tcp,
                acceptor.clone(),
                router.clone(),
                limits.clone(),
                shutdown.clone(),
            )
            .map(move |()| drop(slot))
            .instrument(span),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{issue_serving, new_ca};

    fn leaf_of(pem: &str) -> CertificateDer<'static> {
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .next()
            .unwrap()
            .unwrap()
    }

    #[tokio::test]
    async fn a_renewed_certificate_on_disk_replaces_the_served_one() {
        let ca = new_ca("test-ca").unwrap();
        let first = issue_serving(&ca, &["first.example".into()]).unwrap();
        let second = issue_serving(&ca, &["second.example".into()]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (cert_file, key_file) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&cert_file, &first.cert_pem).unwrap();
        std::fs::write(&key_file, &first.key_pem).unwrap();
        let serving = ServingCert::new(&first.cert_pem, &first.key_pem).unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(serving.clone().reload_from_files(
            cert_file.clone(),
            key_file.clone(),
            (first.cert_pem.clone(), first.key_pem.clone()),
            std::time::Duration::from_millis(10),
            stop.clone(),
        ));
        let wait_for = |want: CertificateDer<'static>| {
            let serving = serving.clone();
            async move {
                for _ in 0..300 {
                    if serving.leaf() == want {
                        return true;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                false
            }
        };
        // A certificate whose key has not been written yet does not load: the old pair stays.
        std::fs::write(&cert_file, &second.cert_pem).unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(serving.leaf(), leaf_of(&first.cert_pem), "mismatched pair");
        std::fs::write(&key_file, &second.key_pem).unwrap();
        assert!(wait_for(leaf_of(&second.cert_pem)).await, "renewed pair");
        // Garbage is ignored; the next valid pair is picked up.
        std::fs::write(&key_file, "not a key").unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(serving.leaf(), leaf_of(&second.cert_pem), "garbage key");
        std::fs::write(&cert_file, &first.cert_pem).unwrap();
        std::fs::write(&key_file, &first.key_pem).unwrap();
        assert!(
            wait_for(leaf_of(&first.cert_pem)).await,
            "back to the first pair"
        );
        stop.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn a_renewal_written_during_startup_is_picked_up() {
        let ca = new_ca("test-ca").unwrap();
        let first = issue_serving(&ca, &["first.example".into()]).unwrap();
        let second = issue_serving(&ca, &["second.example".into()]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (cert_file, key_file) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        // Read at startup: the first pair; on disk by the time reloading starts: the second.
        std::fs::write(&cert_file, &second.cert_pem).unwrap();
        std::fs::write(&key_file, &second.key_pem).unwrap();
        let serving = ServingCert::new(&first.cert_pem, &first.key_pem).unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(serving.clone().reload_from_files(
            cert_file,
            key_file,
            (first.cert_pem.clone(), first.key_pem.clone()),
            std::time::Duration::from_millis(10),
            stop.clone(),
        ));
        let mut picked_up = false;
        for _ in 0..300 {
            if serving.leaf() == leaf_of(&second.cert_pem) {
                picked_up = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        stop.cancel();
        task.await.unwrap();
        assert!(
            picked_up,
            "the pair on disk replaces the one read at startup"
        );
    }
}
