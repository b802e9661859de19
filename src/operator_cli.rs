//! `reports-server operator`: flags (each with an environment variable) mapped onto
//! [`reports_server_operator::RunOptions`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tracing::Instrument;

use anyhow::Context as _;
use clap::Args;
use reports_server_election::kube_lease as lease;
use reports_server_operator::{LeaseConfig, OperatorConfig, RunOptions, desired::PodIds};
use tokio_util::sync::CancellationToken;

#[derive(Args)]
pub struct OperatorArgs {
    /// Kubeconfig [default: in-cluster configuration, then $KUBECONFIG].
    #[arg(long, env = "REPORTS_SERVER_OPERATOR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Image of the servers when a ReportsServer names none.
    #[arg(long, env = "REPORTS_SERVER_OPERATOR_SERVER_IMAGE", default_value = reports_server_operator::DEFAULT_IMAGE)]
    server_image: String,
    /// What `spec.image` of a ReportsServer may name, comma-separated: repositories (every tag
    /// and digest of `ghcr.io/acme/reports-server`), prefixes ending in `/` (every repository
    /// under `registry.corp/mirror/`) or `*` (anything: whoever may create a ReportsServer then
    /// runs any image with the server's cluster-wide rights) [default: the repository of
    /// --server-image].
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_ALLOWED_SERVER_IMAGES",
        value_delimiter = ','
    )]
    allowed_server_images: Vec<String>,
    /// Who chooses the user and group ids of the server and PostgreSQL pods: `fixed` (the
    /// images' users, 65532 and 999, also as fsGroup so new volumes are writable), `platform`
    /// (none set: OpenShift's restricted SCC assigns them from the namespace's range and refuses
    /// others), or `auto` (`platform` when --watch-namespace carries OpenShift's
    /// `openshift.io/sa.scc.uid-range` annotation; without --watch-namespace, when the cluster
    /// serves `security.openshift.io`).
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_POD_IDS",
        value_enum,
        default_value_t = PodIdsArg::Auto
    )]
    pod_ids: PodIdsArg,
    /// Watch ReportsServers in this namespace only [default: all namespaces].
    #[arg(long, env = "REPORTS_SERVER_OPERATOR_WATCH_NAMESPACE")]
    watch_namespace: Option<String>,
    /// The operator's own Deployment (in --watch-namespace): when it is deleted, the stopping
    /// operator removes its finalizer from its ReportsServers, as when that namespace is
    /// terminating or its own account is refused [default: none, only those two].
    #[arg(long, env = "REPORTS_SERVER_OPERATOR_DEPLOYMENT_NAME")]
    deployment_name: Option<String>,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_METRICS_ADDRESS",
        default_value = "0.0.0.0:8080"
    )]
    metrics_address: SocketAddr,
    /// Elect a leader through a Lease, so several replicas never act at once.
    #[arg(long, env = "REPORTS_SERVER_OPERATOR_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// Namespace of the leader Lease (the operator's own namespace).
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_NAMESPACE",
        default_value = "reports-server"
    )]
    lease_namespace: String,
    /// Name of the leader Lease.
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_LEASE_NAME",
        default_value = "reports-server-operator"
    )]
    lease_name: String,
    /// This replica's identity in the Lease and in Events [default: `<hostname>_<pid>_<random>`].
    #[arg(long, env = "REPORTS_SERVER_OPERATOR_POD_NAME")]
    pod_name: Option<String>,
    /// Seconds a Lease stays valid without renewal.
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_LEASE_DURATION_SECONDS",
        default_value_t = 15
    )]
    lease_duration_seconds: u64,
    /// Seconds between a standby's attempts to take the Lease. The holder renews every third
    /// of the duration and stops reconciling when two thirds have passed without a renewal.
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_LEASE_RETRY_SECONDS",
        default_value_t = 2
    )]
    lease_retry_seconds: u64,
    /// Seconds between reconciles while an installation converges.
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_PROGRESS_REQUEUE_SECONDS",
        default_value_t = 3
    )]
    progress_requeue_seconds: u64,
    /// Seconds between reconciles while degraded (how soon a fixed Secret is noticed).
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_DEGRADED_REQUEUE_SECONDS",
        default_value_t = 15
    )]
    degraded_requeue_seconds: u64,
    /// Seconds between reconciles of a ready installation (drift repair, certificate renewal).
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_READY_REQUEUE_SECONDS",
        default_value_t = 300
    )]
    ready_requeue_seconds: u64,
    /// Seconds between asking every server whether it reaches its database (the
    /// `DatabaseAvailable` condition).
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_DATABASE_CHECK_INTERVAL_SECONDS",
        default_value_t = 10
    )]
    database_check_interval_seconds: u64,
    /// Longest backoff after failed reconciles, in seconds.
    #[arg(
        long,
        env = "REPORTS_SERVER_OPERATOR_MAX_BACKOFF_SECONDS",
        default_value_t = 300
    )]
    max_backoff_seconds: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PodIdsArg {
    Auto,
    Fixed,
    Platform,
}

/// The annotation OpenShift puts on every namespace: the user-id range its restricted SCC
/// assigns pods from (and refuses any other).
const OPENSHIFT_UID_RANGE: &str = "openshift.io/sa.scc.uid-range";
/// The API group of OpenShift's SCCs: the sign when the operator watches every namespace.
const OPENSHIFT_SECURITY_GROUP: &str = "security.openshift.io";

/// `--pod-ids auto`: `platform` where OpenShift assigns ids. The namespace annotation is the
/// precise sign (an SCC CRD installed on plain Kubernetes by some bundle serves the group too,
/// and `platform` there would leave a root image without a user and a new volume unwritable);
/// the API group only when the operator watches every namespace or may not read its own.
async fn resolve_pod_ids(
    client: &kube::Client,
    arg: PodIdsArg,
    namespace: Option<&str>,
) -> anyhow::Result<PodIds> {
    let platform = |yes: bool| if yes { PodIds::Platform } else { PodIds::Fixed };
    let ids = match arg {
        PodIdsArg::Fixed => PodIds::Fixed,
        PodIdsArg::Platform => PodIds::Platform,
        PodIdsArg::Auto => match namespace_assigns_ids(client, namespace).await {
            Some(yes) => platform(yes),
            None => {
                let groups = client.list_api_groups().await.context(
                    "cannot list the cluster's API groups to choose --pod-ids (set --pod-ids \
                     fixed or platform to skip the check)",
                )?;
                platform(
                    groups
                        .groups
                        .iter()
                        .any(|g| g.name == OPENSHIFT_SECURITY_GROUP),
                )
            }
        },
    };
    tracing::info!(pod_ids = ?ids, "pod user and group ids");
    Ok(ids)
}

/// Whether `namespace` carries OpenShift's uid range; `None` when there is no namespace to ask
/// or it cannot be read.
async fn namespace_assigns_ids(client: &kube::Client, namespace: Option<&str>) -> Option<bool> {
    let namespace = namespace?;
    let api: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(client.clone());
    match api.get(namespace).await {
        Ok(ns) => Some(
            ns.metadata
                .annotations
                .is_some_and(|a| a.contains_key(OPENSHIFT_UID_RANGE)),
        ),
        Err(e) => {
            tracing::warn!(error = %e, namespace, "cannot read the operator's namespace to choose --pod-ids; deciding by the API groups");
            None
        }
    }
}

pub async fn run(args: OperatorArgs) -> anyhow::Result<()> {
    let client_config = crate::cluster_config(args.kubeconfig.as_deref()).await?;
    let client = kube::Client::try_from(client_config.clone())
        .context("cannot build a Kubernetes client")?;
    let identity = args
        .pod_name
        .clone()
        .unwrap_or_else(lease::default_identity);
    let pod_ids = resolve_pod_ids(&client, args.pod_ids, args.watch_namespace.as_deref()).await?;
    let options = RunOptions {
        config: OperatorConfig {
            pod_ids,
            allowed_images: if args.allowed_server_images.is_empty() {
                vec![reports_server_operator::desired::image_repository(&args.server_image).into()]
            } else {
                args.allowed_server_images
            },
            default_image: args.server_image,
            watch_namespace: args.watch_namespace,
            deployment_name: args.deployment_name,
            progress_requeue: Duration::from_secs(args.progress_requeue_seconds),
            degraded_requeue: Duration::from_secs(args.degraded_requeue_seconds),
            ready_requeue: Duration::from_secs(args.ready_requeue_seconds),
            max_backoff: Duration::from_secs(args.max_backoff_seconds),
            database_check_interval: Duration::from_secs(
                args.database_check_interval_seconds.max(1),
            ),
            instance: Some(identity.clone()),
        },
        metrics_address: args.metrics_address,
        lease: args.leader_election.then(|| {
            let mut lease = LeaseConfig::new(args.lease_namespace, args.lease_name, identity)
                .with_duration(Duration::from_secs(args.lease_duration_seconds));
            lease.retry_interval = Duration::from_secs(args.lease_retry_seconds.max(1));
            lease
        }),
        client_config: Some(client_config),
    };
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(
        async move {
            crate::shutdown_signal().await;
            signal.cancel();
        }
        .instrument(tracing::info_span!("shutdown_signal")),
    );
    reports_server_operator::operate(client, options, shutdown).await?;
    Ok(())
}
