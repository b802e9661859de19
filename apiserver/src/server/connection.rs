//! One client connection, bounded in time and in what it may hold open.
//!
//! Without a timer hyper has no header timeout, so a client that opens TLS and then sends half
//! a request line (or nothing) holds its connection, its task and its buffers for ever, before
//! it is even authenticated; a few thousand such clients exhaust the process. Each connection
//! here gets kube-apiserver's bounds: the TLS handshake, the request headers and the time a
//! connection may sit without a request in flight are all limited, and an HTTP/2 connection
//! carries at most so many concurrent streams. The protocol comes from ALPN, so no read waits to
//! sniff it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::auth::PeerCertificates;

/// Bounds on client connections. The defaults are kube-apiserver's where it has one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections served at once; further clients wait in the listen backlog.
    pub max_connections: usize,
    /// Time for the TLS handshake.
    pub tls_handshake_timeout: Duration,
    /// Time for a request's headers, from the first wait for them (kube-apiserver's
    /// `ReadHeaderTimeout`, 32 s). For HTTP/1.1 this also closes a kept-alive connection that
    /// sends nothing; for HTTP/2, a connection that starts no stream in that time.
    pub header_read_timeout: Duration,
    /// Time a connection may stay open with no request in flight (kube-apiserver's
    /// `IdleTimeout`, 90 s). Watches are requests in flight for as long as they stream.
    pub idle_timeout: Duration,
    /// Concurrent HTTP/2 streams per connection (`--http2-max-streams-per-connection`).
    pub max_streams_per_connection: u32,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 10_000,
            tls_handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(32),
            idle_timeout: Duration::from_secs(90),
            max_streams_per_connection: 1_000,
        }
    }
}

/// What a connection has in flight, and since when it has had nothing.
struct Activity {
    in_flight: AtomicUsize,
    /// When the last request ended (or the connection opened), and whether any request began.
    quiet_since: Mutex<(Instant, bool)>,
}

/// One request (or watch) in flight: alive until its response body is done or dropped.
struct InFlight(Arc<Activity>);

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Activity {
            in_flight: AtomicUsize::new(0),
            quiet_since: Mutex::new((Instant::now(), false)),
        })
    }

    fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.quiet_since.lock().expect("not poisoned").1 = true;
        InFlight(self.clone())
    }

    /// Whether the connection has been quiet past its limit: the header timeout before its
    /// first request, the idle timeout after.
    fn expired(&self, limits: &ConnectionLimits) -> bool {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return false;
        }
        let (since, any_request) = *self.quiet_since.lock().expect("not poisoned");
        let limit = if any_request {
            limits.idle_timeout
        } else {
            limits.header_read_timeout
        };
        since.elapsed() >= limit
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.quiet_since.lock().expect("not poisoned").0 = Instant::now();
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How often a connection checks whether it has been quiet too long.
const QUIET_CHECK: Duration = Duration::from_secs(1);
/// How long a connection being closed may take to finish what it has in flight.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Serves one accepted TCP connection until it ends, expires or the server shuts down.
pub(super) async fn serve_connection(
    tcp: TcpStream,
    acceptor: TlsAcceptor,
    router: axum::Router,
    limits: Arc<ConnectionLimits>,
    shutdown: CancellationToken,
) {
    let tls = match tokio::time::timeout(limits.tls_handshake_timeout, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!("TLS handshake timed out");
            return;
        }
    };
    let session = tls.get_ref().1;
    let h2 = session.alpn_protocol() == Some(b"h2".as_slice());
    let peer = PeerCertificates(Arc::new(
        session
            .peer_certificates()
            .map(|c| c.to_vec())
            .unwrap_or_default(),
    ));
    let activity = Activity::new();
    let requests = activity.clone();
    let service =
        hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
            let in_flight = requests.begin();
            request.extensions_mut().insert(peer.clone());
            let response = router.clone().oneshot(request.map(axum::body::Body::new));
            async move {
                let response = response.await?;
                // The request stays in flight until its body is sent (a watch, for hours).
                Ok::<_, std::convert::Infallible>(response.map(|body| {
                    axum::body::Body::new(body.map_frame(move |frame| {
                        let _ = &in_flight;
                        frame
                    }))
                }))
            }
        });
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_streams_per_connection);
    let builder = if h2 {
        builder.http2_only()
    } else {
        builder.http1_only()
    };
    let connection = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
    tokio::pin!(connection);
    let mut quiet_check = tokio::time::interval(QUIET_CHECK);
    let closing = loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = shutdown.cancelled() => break "the server is shutting down",
            _ = quiet_check.tick() => {
                if activity.expired(&limits) {
                    break "the connection was quiet past its limit";
                }
            }
        }
    };
    tracing::debug!(why = closing, "closing a connection");
    connection.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(CLOSE_GRACE, connection).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn quiet_limits_header_timeout_first_idle_timeout_after_and_never_while_in_flight() {
        let limits = ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            ..ConnectionLimits::default()
        };
        let activity = Activity::new();
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(!activity.expired(&limits));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            activity.expired(&limits),
            "no request within the header timeout"
        );

        let activity = Activity::new();
        let watch = activity.begin();
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(
            !activity.expired(&limits),
            "a request in flight is never idle"
        );
        drop(watch);
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(!activity.expired(&limits));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(activity.expired(&limits), "idle after the last request");
    }
}
