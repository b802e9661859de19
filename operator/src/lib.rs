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
//! * [`leader`] keeps two operator replicas from fighting (a `coordination.k8s.io` Lease), and
//!   [`http`] serves `/metrics`, `/healthz` and `/readyz`.
//! * [`manifests`] renders the operator's own install objects (CRD, RBAC, Deployment), from the
//!   same constants the controller uses, so the RBAC is exactly what the code calls.
//!
//! What the operator never does (the peer's install failures): flip APIServices on a pod
//! restart or rollout (it only changes them when the spec changes or the ReportsServer is
//! deleted), set `insecureSkipTLSVerify`, or rely on Helm hooks.

pub mod controller;
pub mod desired;
pub mod http;
pub mod leader;
pub mod manifests;
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

use std::net::SocketAddr;
use std::sync::Arc;

/// How [`operate`] runs.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub config: OperatorConfig,
    /// Where `/metrics`, `/healthz` and `/readyz` listen.
    pub metrics_address: SocketAddr,
    /// Leader election; `None` runs unconditionally (one replica, tests).
    pub lease: Option<leader::LeaseConfig>,
}

/// Why [`operate`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("serving metrics on {0}: {1}")]
    Metrics(SocketAddr, #[source] std::io::Error),
    #[error("lost the leader Lease; stopping so a standby takes over")]
    LeaseLost,
}

/// Serves metrics and health, waits for the leader Lease, and runs the controller until a
/// shutdown signal (then releases the Lease) or until the Lease is lost (an error: the process
/// must exit so it never acts as a second leader).
pub async fn operate(client: kube::Client, options: RunOptions) -> Result<(), RunError> {
    let metrics = http::Metrics::new();
    let addr = options.metrics_address;
    let listener = tokio::spawn(http::serve(addr, metrics.clone()));
    metrics.set_ready();
    let elector = options
        .lease
        .clone()
        .map(|l| leader::Elector::new(client.clone(), l));
    if let Some(e) = &elector {
        tracing::info!("waiting for the leader Lease");
        tokio::select! {
            _ = e.acquire() => {}
            r = listener => {
                let e = match r {
                    Ok(Ok(())) => std::io::Error::other("the metrics server stopped"),
                    Ok(Err(e)) => e,
                    Err(e) => std::io::Error::other(e),
                };
                return Err(RunError::Metrics(addr, e));
            }
        }
        tracing::info!("acquired the leader Lease");
    }
    metrics.set_leader(true);
    let ctx = Arc::new(Context::new(client, options.config, metrics.clone()));
    let result = match &elector {
        Some(e) => tokio::select! {
            _ = run(ctx) => Ok(()),
            _ = e.hold() => Err(RunError::LeaseLost),
        },
        None => {
            run(ctx).await;
            Ok(())
        }
    };
    metrics.set_leader(false);
    if result.is_ok()
        && let Some(e) = &elector
    {
        e.release().await;
    }
    result
}
