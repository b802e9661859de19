//! The `ReportsServer` operator: one `ReportsServer` object becomes a running reports-server
//! installation (or, in `external` mode, the routing to a server outside the cluster).
//!
//! Why it is split this way:
//! * [`desired`] and [`tls`] are pure: every object the operator applies is computed from the
//!   ReportsServer and a few looked-up facts, so the installation is reviewed as golden YAML and
//!   tested without a cluster.
//! * [`status`] decides conditions without I/O, so the rule "lastTransitionTime moves only on a
//!   flip" is one tested function.
//! * [`controller`] is the kube-runtime loop (`Controller`, `reconcile`, `error_policy`,
//!   `finalizer`, server-side apply with one field manager, Events); it is tested against a
//!   mocked API server.
//! * Two operator replicas never fight: [`operate`] runs the controller only while holding a
//!   `coordination.k8s.io` Lease, through the election loop the cluster aggregator uses
//!   (`reports_server_election`); [`http`] serves `/metrics`, `/healthz` and
//!   `/readyz`.
//! * [`manifests`] renders the operator's own install objects (CRD, RBAC, Deployment), from the
//!   same constants the controller uses, so the RBAC is exactly what the code calls.
//!
//! The migration engine the operator drives through a ConfigMap runs in the server, which has
//! the database: it is the `reports_server_migration` crate; the operator uses only its
//! mailbox (the ConfigMap's keys) and its phases.
//!
//! What the operator never does (the peer's install failures): flip APIServices on a pod
//! restart or rollout (it only changes them when the spec changes or the ReportsServer is
//! deleted), set `insecureSkipTLSVerify`, or rely on Helm hooks.

// Every production function fits on a screen (threshold in clippy.toml); tests may be longer.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod analytics;
pub mod controller;
pub mod database_check;
pub mod desired;
pub mod http;
pub mod manifests;
pub mod rbac;
pub mod status;
pub mod tls;

/// The single server-side-apply field manager of the operator.
pub const FIELD_MANAGER: &str = "reports-server-operator";
/// Value of `app.kubernetes.io/managed-by` on everything the operator creates.
pub const MANAGED_BY: &str = "reports-server-operator";
/// Finalizer on ReportsServer objects: removes the APIServices (first) and the cluster-scoped
/// objects, which ownerReferences cannot reach.
pub const FINALIZER: &str = "reportsserver.io/cleanup";
/// Annotation `<namespace>/<name>` of the owning ReportsServer on objects that cannot carry an
/// ownerReference (cluster-scoped ones and the RoleBinding in kube-system).
pub const OWNER_ANNOTATION: &str = "reportsserver.io/owner";
/// The image the server runs when the spec names none.
pub const DEFAULT_IMAGE: &str = concat!("reports-server:", env!("CARGO_PKG_VERSION"));

pub use controller::{Context, Error, OperatorConfig, run};
/// The leader Lease settings (shared with the cluster aggregator: one election protocol).
pub use reports_server_election::kube_lease::LeaseConfig;

use std::net::SocketAddr;
use std::sync::Arc;
use tracing::Instrument;

use reports_server_election::kube_lease as lease;
use tokio_util::sync::CancellationToken;

/// How [`operate`] runs.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub config: OperatorConfig,
    /// Where `/metrics`, `/healthz` and `/readyz` listen.
    pub metrics_address: SocketAddr,
    /// Leader election; `None` runs unconditionally (one replica, tests).
    pub lease: Option<LeaseConfig>,
    /// The client configuration `client` was made from: the release accounts' clients are made
    /// from it (`controller::release`). `None` releases nothing on an uninstall.
    pub client_config: Option<kube::Config>,
}

/// Why [`operate`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("serving metrics on {0}: {1}")]
    Metrics(SocketAddr, #[source] std::io::Error),
}

/// Serves metrics and health and runs the controller until `shutdown` fires. With a Lease,
/// the controller runs only while this replica holds it (the election loop the cluster
/// aggregator uses: `election/src/lib.rs`): a replica that cannot renew in time stops
/// reconciling before its Lease can expire and becomes a standby again; on shutdown the Lease
/// is released so a standby takes over at once.
pub async fn operate(
    client: kube::Client,
    options: RunOptions,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let metrics = http::Metrics::new();
    let addr = options.metrics_address;
    let listener = tokio::spawn(
        http::serve(addr, metrics.clone()).instrument(tracing::info_span!("metrics_endpoint")),
    );
    metrics.set_ready();
    let mut ctx = Context::new(client.clone(), options.config, metrics.clone());
    if let Some(config) = options.client_config {
        ctx = ctx.with_client_config(config);
    }
    let ctx = Arc::new(ctx);
    let work = async {
        match &options.lease {
            Some(lease) => {
                lease::elector(client.clone(), lease)
                    .run(
                        shutdown.clone(),
                        |term| run(ctx.clone(), term),
                        |leading| metrics.set_leader(leading),
                    )
                    .await
            }
            None => {
                metrics.set_leader(true);
                run(ctx.clone(), shutdown.clone()).await;
                metrics.set_leader(false);
            }
        }
    };
    let stopped = tokio::select! {
        _ = work => Ok(()),
        r = listener => {
            let e = match r {
                Ok(Ok(())) => std::io::Error::other("the metrics server stopped"),
                Ok(Err(e)) => e,
                Err(e) => std::io::Error::other(e),
            };
            Err(RunError::Metrics(addr, e))
        }
    };
    if shutdown.is_cancelled() {
        controller::release::on_shutdown(&ctx)
            .instrument(tracing::info_span!("release_on_shutdown"))
            .await;
    }
    stopped
}
