//! `serve`'s bounds on clients: connection timeouts and counts, requests in flight, the request
//! deadline. Defaults are kube-apiserver's where it has one; docs/api.md "Limits and timeouts"
//! lists them all.

use std::time::Duration;

use clap::Args;
use reports_server_apiserver::http::ApiOptions;
use reports_server_apiserver::server::ConnectionLimits;

#[derive(Args, Clone, Debug)]
pub struct LimitsArgs {
    /// Client connections served at once; more wait in the listen backlog.
    #[arg(long, env = "REPORTS_SERVER_MAX_CONNECTIONS", default_value_t = 10_000)]
    max_connections: usize,
    /// Seconds a client has to complete the TLS handshake.
    #[arg(
        long,
        env = "REPORTS_SERVER_TLS_HANDSHAKE_TIMEOUT_SECONDS",
        default_value_t = 10
    )]
    tls_handshake_timeout_seconds: u64,
    /// Seconds a client has to send a request's headers (and an HTTP/2 client to start its
    /// first stream); a kept-alive HTTP/1.1 connection that sends nothing is closed after it too.
    #[arg(
        long,
        env = "REPORTS_SERVER_HEADER_READ_TIMEOUT_SECONDS",
        default_value_t = 32
    )]
    header_read_timeout_seconds: u64,
    /// Seconds a connection may stay open with no request in flight.
    #[arg(
        long,
        env = "REPORTS_SERVER_IDLE_TIMEOUT_SECONDS",
        default_value_t = 90
    )]
    idle_timeout_seconds: u64,
    /// Concurrent streams of one HTTP/2 connection (kube-apiserver's proxy multiplexes all
    /// requests of a cluster over few connections: keep this well above its watch count).
    #[arg(
        long,
        env = "REPORTS_SERVER_HTTP2_MAX_STREAMS_PER_CONNECTION",
        default_value_t = 1_000
    )]
    http2_max_streams_per_connection: u32,
    /// Read-only requests (get, list, discovery) in flight at once; more get 429. Watches are
    /// not counted.
    #[arg(
        long,
        env = "REPORTS_SERVER_MAX_REQUESTS_INFLIGHT",
        default_value_t = 400
    )]
    max_requests_inflight: usize,
    /// Writes in flight at once; more get 429.
    #[arg(
        long,
        env = "REPORTS_SERVER_MAX_MUTATING_REQUESTS_INFLIGHT",
        default_value_t = 200
    )]
    max_mutating_requests_inflight: usize,
    /// Seconds a request other than a watch may run before it is answered 504.
    #[arg(
        long,
        env = "REPORTS_SERVER_REQUEST_TIMEOUT_SECONDS",
        default_value_t = 60
    )]
    request_timeout_seconds: u64,
}

impl LimitsArgs {
    pub fn connections(&self) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: self.max_connections.max(1),
            tls_handshake_timeout: seconds(self.tls_handshake_timeout_seconds),
            header_read_timeout: seconds(self.header_read_timeout_seconds),
            idle_timeout: seconds(self.idle_timeout_seconds),
            max_streams_per_connection: self.http2_max_streams_per_connection.max(1),
        }
    }

    /// Sets the request limits of `api`.
    pub fn apply(&self, api: &mut ApiOptions) {
        api.max_requests_inflight = self.max_requests_inflight.max(1);
        api.max_mutating_requests_inflight = self.max_mutating_requests_inflight.max(1);
        api.request_timeout = seconds(self.request_timeout_seconds);
    }
}

/// At least a second: a zero timeout would close every connection at once.
fn seconds(n: u64) -> Duration {
    Duration::from_secs(n.max(1))
}
