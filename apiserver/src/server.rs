//! HTTPS serving: rustls with an optional client-certificate check, HTTP/1.1 and h2 on one port
//! (ALPN), and the verified peer chain handed to the router as a request extension.

use std::net::SocketAddr;
use std::sync::Arc;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::auth::PeerCertificates;

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

/// Builds the rustls configuration: our serving certificate, and client certificates verified
/// when presented (never required, so probes and token clients work). ALPN offers h2 and
/// HTTP/1.1.
pub fn tls_config(
    cert_pem: &str,
    key_pem: &str,
    client_auth: ClientAuth,
) -> Result<rustls::ServerConfig, ServeError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| ServeError::Tls(format!("serving certificate: {e}")))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| ServeError::Tls(format!("serving key: {e}")))?;
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
        .with_single_cert(certs, key)
        .map_err(|e| ServeError::Tls(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// Binds the listener (separately from serving, so callers learn the port before serving).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| ServeError::Bind(addr, e))
}

/// Serves `router` over TLS until `shutdown` is cancelled.
pub async fn serve(
    listener: TcpListener,
    tls: rustls::ServerConfig,
    router: axum::Router,
    shutdown: CancellationToken,
) {
    let acceptor = TlsAcceptor::from(Arc::new(tls));
    loop {
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
        let acceptor = acceptor.clone();
        let router = router.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(
                std::time::Duration::from_secs(10),
                acceptor.accept(tcp),
            )
            .await
            {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(%remote, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            let peer = PeerCertificates(Arc::new(
                tls.get_ref()
                    .1
                    .peer_certificates()
                    .map(|c| c.to_vec())
                    .unwrap_or_default(),
            ));
            let service = hyper::service::service_fn(
                move |mut request: hyper::Request<hyper::body::Incoming>| {
                    request.extensions_mut().insert(peer.clone());
                    router.clone().oneshot(request.map(axum::body::Body::new))
                },
            );
            let builder = Builder::new(TokioExecutor::new());
            let connection = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
            tokio::pin!(connection);
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(e) = result {
                        tracing::debug!(%remote, error = %e, "connection ended with an error");
                    }
                }
                _ = shutdown.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), connection).await;
                }
            }
        });
    }
}
