//! Flags of report aggregation: the in-process aggregator of `reports-server serve`, and
//! `reports-server aggregate`, which either merges report YAML offline (`--input`) or aggregates
//! a cluster continuously through its API (`--kubeconfig` / `--in-cluster`).
//!
//! All share the merge options (layout, chunk size, output group) and their environment
//! variables, so that previewing a dump offline shows exactly what the server would write.
//! Defaults are the aggregator crate's constants, which `docs/aggregation.md` documents.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tracing::Instrument;

use anyhow::Context;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{ArgGroup, Args};
use reports_server_aggregator::aggregator::DEFAULT_PAGE_SIZE;
use reports_server_aggregator::cluster::ClusterMetrics;
use reports_server_aggregator::cluster::adoption::AdoptionConfig;
use reports_server_aggregator::cluster::backend::KubeBackendConfig;
use reports_server_aggregator::cluster::{ClusterAggregator, ClusterConfig};
use reports_server_aggregator::merge::DEFAULT_CHUNK_SIZE;
use reports_server_aggregator::queue::DEFAULT_WORKERS;
use reports_server_aggregator::{
    AggregatorConfig, CancellationToken, Layout, MergeOptions, Metrics, OfflineOptions,
    OutputFormat, QueueConfig, aggregate_offline,
};
use reports_server_apiserver::report_merge::{ClusterAccess, run_in_process};
use reports_server_apiserver::startup::RunningServer;
use reports_server_election::kube_lease::{self as lease, LeaseConfig};

/// `--aggregation-layout` / `--layout` values.
pub(crate) fn layout_parser() -> impl TypedValueParser<Value = Layout> {
    PossibleValuesParser::new(["per-resource", "per-policy"]).map(|s| {
        s.parse::<Layout>()
            .expect("only possible values reach here")
    })
}

/// `--aggregation-output` / `--output` values.
fn output_parser() -> impl TypedValueParser<Value = OutputFormat> {
    PossibleValuesParser::new(["wgpolicy", "openreports"]).map(|s| {
        s.parse::<OutputFormat>()
            .expect("only possible values reach here")
    })
}

/// A duration in seconds (`30`, `0.5`) or with a unit (`30s`, `500ms`, `2m`, `24h`, `90d`),
/// so that `--aggregation-delay 30s` from the docs and a bare number both work.
pub(crate) fn parse_delay(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = text.strip_suffix('h') {
        (n, 3_600.0)
    } else if let Some(n) = text.strip_suffix('d') {
        (n, 86_400.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number.trim().parse().map_err(|_| {
        format!("{text:?} is not a duration (examples: 30, 30s, 500ms, 2m, 24h, 90d)")
    })?;
    Duration::try_from_secs_f64(value * scale).map_err(|e| format!("{text:?}: {e}"))
}

/// In-process aggregation inside `reports-server serve` (run Kyverno with
/// `--aggregateReports=false`).
#[derive(Args, Clone, Debug)]
pub struct AggregationArgs {
    /// Merge Kyverno's ephemeral reports into policy reports inside this server. One replica
    /// per database aggregates at a time (a lease in the database).
    #[arg(
        long = "aggregation",
        env = "REPORTS_SERVER_AGGREGATION",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set,
        value_name = "BOOL"
    )]
    pub enabled: bool,
    /// Delay between a change to an ephemeral report and the merge of its namespace, in
    /// seconds or with a unit (500ms, 30s, 2m). Further changes do not postpone the merge.
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_DELAY", default_value = "30", value_parser = parse_delay)]
    pub aggregation_delay: Duration,
    /// Namespaces merged in parallel.
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_WORKERS", default_value_t = DEFAULT_WORKERS)]
    pub aggregation_workers: usize,
    /// Report layout: one report per resource (Kyverno ≥ 1.11) or per policy (Kyverno ≤ 1.10).
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_LAYOUT", default_value = "per-resource", value_parser = layout_parser())]
    pub aggregation_layout: Layout,
    /// Per-policy layout: maximum results per report (0 = unlimited).
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_CHUNK_SIZE", default_value_t = DEFAULT_CHUNK_SIZE)]
    pub chunk_size: usize,
    /// API group of the reports written: wgpolicyk8s.io PolicyReports or openreports.io Reports.
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_OUTPUT", default_value = "wgpolicy", value_parser = output_parser())]
    pub aggregation_output: OutputFormat,
    /// Per-resource layout: resources merged per page (bounds memory and transaction size).
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_PAGE_SIZE", default_value_t = DEFAULT_PAGE_SIZE)]
    pub aggregation_page_size: usize,
    /// Delegated mode only: the server reads the cluster through `--kubeconfig` to adopt
    /// admission reports and to follow Kyverno's policies.
    #[command(flatten)]
    pub cluster_rules: ClusterRulesArgs,
}

impl AggregationArgs {
    /// The aggregator settings these flags describe.
    pub fn config(&self) -> AggregatorConfig {
        AggregatorConfig {
            queue: QueueConfig {
                delay: self.aggregation_delay,
                workers: self.aggregation_workers.max(1),
                ..QueueConfig::default()
            },
            merge: MergeOptions {
                layout: self.aggregation_layout,
                chunk_size: self.chunk_size,
                output: self.aggregation_output,
                ..MergeOptions::default()
            },
            page_size: self.aggregation_page_size.max(1),
        }
    }

    /// Starts the in-process aggregator next to a running server when enabled; it stops (and
    /// releases its lease) when the server's shutdown token fires. Await the handle after the
    /// server stopped so the lease is handed over at once instead of expiring.
    pub fn spawn(
        &self,
        server: &RunningServer,
        cluster: Option<&kube::Client>,
        settled: Option<tokio::sync::watch::Receiver<bool>>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        if !self.enabled {
            tracing::info!("in-process aggregation disabled");
            return None;
        }
        let config = self.config();
        tracing::info!(
            delay = ?config.queue.delay,
            workers = config.queue.workers,
            layout = %config.merge.layout,
            output = %config.merge.output,
            cluster = cluster.is_some(),
            "in-process aggregation enabled"
        );
        if cluster.is_none() {
            tracing::info!(
                "no cluster to ask (standalone mode): results of deleted policies are kept and admission reports without a resource UID are not merged; see docs/aggregation.md"
            );
        }
        // Exported on the server's /metrics next to the API metrics.
        let metrics = server.metrics.register(Metrics::register);
        let cluster = cluster.map(|client| ClusterAccess {
            client: client.clone(),
            adoption: self.cluster_rules.adoption(),
            watch_policies: self.cluster_rules.watch_policies,
            policy_sync_timeout: self.cluster_rules.policy_sync_timeout,
            metrics: server.metrics.register(ClusterMetrics::register),
        });
        let (store, shutdown) = (server.store.clone(), server.shutdown_token());
        let Some(mut settled) = settled else {
            return Some(tokio::spawn(run_in_process(
                store, config, metrics, cluster, shutdown,
            )));
        };
        // While a migration moves data the aggregator must not touch the database: it would
        // merge copied ephemeral reports that etcd still owns, or change what is being written
        // back. It runs only while the migration worker says nothing moves.
        Some(tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    r = settled.wait_for(|s| *s) => if r.is_err() { return },
                }
                tracing::info!("no migration moving data: in-process aggregation starts");
                let term = shutdown.child_token();
                let running = tokio::spawn(run_in_process(
                    store.clone(),
                    config.clone(),
                    metrics.clone(),
                    cluster.clone(),
                    term.clone(),
                ));
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    r = settled.wait_for(|s| !*s) => if r.is_ok() {
                        tracing::info!("a migration moves data: in-process aggregation pauses");
                    },
                }
                term.cancel();
                let _ = running.await;
                if shutdown.is_cancelled() {
                    return;
                }
            }
        }))
    }
}

/// `reports-server aggregate`: merge report YAML offline and print the resulting reports
/// (`--input`), or aggregate a cluster's ephemeral reports continuously through its API
/// (`--kubeconfig` / `--in-cluster`).
#[derive(Args, Debug)]
#[command(group(ArgGroup::new("mode").required(true).multiple(false).args(["input", "kubeconfig", "in_cluster"])))]
pub struct AggregateArgs {
    /// Offline: report YAML to read: files, or directories searched recursively for *.yaml and
    /// *.yml; `-` reads standard input. Ephemeral reports, policy reports, openreports reports
    /// and Lists of them.
    #[arg(long, short, num_args = 1.., value_name = "FILE_OR_DIR")]
    pub input: Vec<PathBuf>,
    /// Offline: Kyverno policies (same rules); results of missing policies and rules are
    /// dropped. Without it the policy set is unknown and nothing is dropped. (Against a cluster
    /// the policies are watched there.)
    #[arg(long, num_args = 1.., value_name = "FILE_OR_DIR", conflicts_with_all = ["kubeconfig", "in_cluster"])]
    pub policies: Vec<PathBuf>,
    /// Report layout.
    #[arg(long, visible_alias = "aggregation-layout", env = "REPORTS_SERVER_AGGREGATION_LAYOUT", default_value = "per-resource", value_parser = layout_parser())]
    pub layout: Layout,
    /// Per-policy layout: maximum results per report (0 = unlimited).
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_CHUNK_SIZE", default_value_t = DEFAULT_CHUNK_SIZE)]
    pub chunk_size: usize,
    /// API group of the reports written.
    #[arg(long, visible_alias = "aggregation-output", env = "REPORTS_SERVER_AGGREGATION_OUTPUT", default_value = "wgpolicy", value_parser = output_parser())]
    pub output: OutputFormat,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// Flags of `reports-server aggregate --kubeconfig`: continuous aggregation through the
/// Kubernetes API (reports stored as CRDs in etcd, or served by reports-server behind
/// kube-apiserver). Run Kyverno with `--aggregateReports=false`.
#[derive(Args, Debug)]
pub struct ClusterArgs {
    /// Aggregate continuously in the cluster this kubeconfig points at (its current context).
    #[arg(long, env = "REPORTS_SERVER_KUBECONFIG", value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Aggregate continuously in the cluster this pod runs in (service-account credentials).
    #[arg(long, env = "REPORTS_SERVER_IN_CLUSTER")]
    pub in_cluster: bool,
    /// Delay between a change to an ephemeral report and the merge of its namespace, in
    /// seconds or with a unit (500ms, 30s, 2m). Further changes do not postpone the merge.
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_DELAY", default_value = "30", value_parser = parse_delay)]
    pub aggregation_delay: Duration,
    /// Namespaces merged in parallel.
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_WORKERS", default_value_t = DEFAULT_WORKERS)]
    pub aggregation_workers: usize,
    /// Per-resource layout: resources merged per page; also the `limit` of every list request.
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_PAGE_SIZE", default_value_t = DEFAULT_PAGE_SIZE)]
    pub aggregation_page_size: usize,
    /// API requests in flight at once per namespace being merged.
    #[arg(
        long,
        env = "REPORTS_SERVER_AGGREGATION_API_CONCURRENCY",
        default_value_t = 8
    )]
    pub aggregation_api_concurrency: usize,
    /// Namespace of the Lease that keeps one aggregator active per cluster
    /// [default: the pod's namespace in-cluster, else `default`].
    #[arg(
        long,
        visible_alias = "namespace-for-lease",
        env = "REPORTS_SERVER_LEASE_NAMESPACE"
    )]
    pub lease_namespace: Option<String>,
    /// Name of that Lease.
    #[arg(long, env = "REPORTS_SERVER_LEASE_NAME", default_value = lease::DEFAULT_NAME)]
    pub lease_name: String,
    /// leaseDurationSeconds: a standby takes over after seeing the Lease unchanged this long.
    /// The holder renews every third of it and stops aggregating when it could not renew for
    /// two thirds of it.
    #[arg(long, env = "REPORTS_SERVER_LEASE_DURATION", default_value = "15s", value_parser = parse_delay)]
    pub lease_duration: Duration,
    #[command(flatten)]
    pub cluster_rules: ClusterRulesArgs,
    /// Address of the `/metrics` and `/healthz` endpoint (port 0: any free port, logged);
    /// `off` disables it.
    #[arg(long, env = "REPORTS_SERVER_METRICS_BIND_ADDRESS", default_value = "127.0.0.1:9464", value_parser = parse_metrics_address)]
    pub metrics_bind_address: MetricsAddress,
}

/// How aggregation with access to the cluster treats admission reports and policies; shared by
/// `serve` (delegated mode) and `aggregate --kubeconfig`.
#[derive(Args, Clone, Debug)]
pub struct ClusterRulesArgs {
    /// An un-owned admission report whose resource is not found is deleted once older than
    /// this (Kyverno: 2 minutes).
    #[arg(long, env = "REPORTS_SERVER_ADOPTION_GRACE_PERIOD", default_value = "2m", value_parser = parse_delay)]
    pub adoption_grace_period: Duration,
    /// How soon an admission report that could not be adopted yet is looked at again.
    #[arg(long, env = "REPORTS_SERVER_ADOPTION_RETRY", default_value = "10s", value_parser = parse_delay)]
    pub adoption_retry: Duration,
    /// Drop results of deleted policies and rules, watching the cluster's policies (Kyverno
    /// ClusterPolicy/Policy, ValidatingAdmissionPolicy, Kyverno CEL policies). `false` keeps
    /// every result (no read access to policies needed).
    #[arg(
        long,
        env = "REPORTS_SERVER_WATCH_POLICIES",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set,
        value_name = "BOOL"
    )]
    pub watch_policies: bool,
    /// How long a new leader waits for the initial lists of policies before merging anyway
    /// (kinds not listed by then are treated as unknown: none of their results is dropped).
    #[arg(long, env = "REPORTS_SERVER_POLICY_SYNC_TIMEOUT", default_value = "30s", value_parser = parse_delay)]
    pub policy_sync_timeout: Duration,
}

impl ClusterRulesArgs {
    pub fn adoption(&self) -> AdoptionConfig {
        AdoptionConfig {
            grace: self.adoption_grace_period,
            retry: self.adoption_retry.max(Duration::from_millis(100)),
        }
    }
}

/// `--metrics-bind-address`: an address, or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetricsAddress(pub Option<SocketAddr>);

fn parse_metrics_address(text: &str) -> Result<MetricsAddress, String> {
    if matches!(text.trim(), "off" | "none" | "") {
        return Ok(MetricsAddress(None));
    }
    text.trim()
        .parse::<SocketAddr>()
        .map(|a| MetricsAddress(Some(a)))
        .map_err(|_| {
            format!("{text:?} is not an address (examples: 127.0.0.1:9464, 0.0.0.0:9464, off)")
        })
}

/// The Lease namespace when none is given: the service account's namespace in a pod.
fn default_lease_namespace() -> String {
    std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".into())
}

impl AggregateArgs {
    /// The cluster aggregator settings these flags describe.
    pub fn cluster_config(&self) -> ClusterConfig {
        let c = &self.cluster;
        let lease = LeaseConfig::new(
            c.lease_namespace
                .clone()
                .unwrap_or_else(default_lease_namespace),
            c.lease_name.clone(),
            lease::default_identity(),
        )
        .with_duration(c.lease_duration);
        ClusterConfig {
            aggregator: AggregatorConfig {
                queue: QueueConfig {
                    delay: c.aggregation_delay,
                    workers: c.aggregation_workers.max(1),
                    ..QueueConfig::default()
                },
                merge: MergeOptions {
                    layout: self.layout,
                    chunk_size: self.chunk_size,
                    output: self.output,
                    ..MergeOptions::default()
                },
                page_size: c.aggregation_page_size.max(1),
            },
            backend: KubeBackendConfig {
                list_page_size: u32::try_from(c.aggregation_page_size.max(1)).unwrap_or(u32::MAX),
                concurrency: c.aggregation_api_concurrency.max(1),
            },
            lease,
            adoption: c.cluster_rules.adoption(),
            watch_policies: c.cluster_rules.watch_policies,
            policy_sync_timeout: c.cluster_rules.policy_sync_timeout,
            metrics_address: c.metrics_bind_address.0,
        }
    }
}

/// Runs `reports-server aggregate` in the mode its flags select.
pub async fn run_aggregate(args: AggregateArgs) -> anyhow::Result<()> {
    if args.input.is_empty() {
        run_cluster(args).await
    } else {
        run_offline(args)
    }
}

/// A client for `--kubeconfig` (its current context) or the in-cluster service account.
async fn cluster_client(args: &ClusterArgs) -> anyhow::Result<kube::Client> {
    match &args.kubeconfig {
        Some(path) => crate::client_from_kubeconfig(path).await,
        None => {
            let config = kube::Config::incluster().context(
                "--in-cluster needs a pod's service account (KUBERNETES_SERVICE_HOST and the token); outside a cluster pass --kubeconfig PATH",
            )?;
            kube::Client::try_from(config).context("cannot build a Kubernetes client")
        }
    }
}

/// Continuous aggregation through the cluster API until SIGINT/SIGTERM.
async fn run_cluster(args: AggregateArgs) -> anyhow::Result<()> {
    let client = cluster_client(&args.cluster).await?;
    let config = args.cluster_config();
    tracing::info!(
        delay = ?config.aggregator.queue.delay,
        workers = config.aggregator.queue.workers,
        layout = %config.aggregator.merge.layout,
        output = %config.aggregator.merge.output,
        lease = %format!("{}/{}", config.lease.namespace, config.lease.name),
        identity = %config.lease.identity,
        adoption_grace = ?config.adoption.grace,
        watch_policies = config.watch_policies,
        "aggregating through the Kubernetes API"
    );
    let cancel = CancellationToken::new();
    let token = cancel.clone();
    tokio::spawn(
        async move {
            crate::shutdown_signal().await;
            tracing::info!("shutting down");
            token.cancel();
        }
        .instrument(tracing::info_span!("shutdown_signal")),
    );
    ClusterAggregator::new(client, config)
        .run(cancel)
        .await
        .context("aggregation stopped")
}

/// Runs `reports-server aggregate --input`: prints the merged reports as multi-document YAML.
pub fn run_offline(args: AggregateArgs) -> anyhow::Result<()> {
    let yaml = aggregate_offline(
        &args.input,
        &args.policies,
        OfflineOptions {
            layout: args.layout,
            chunk_size: args.chunk_size,
            output: args.output,
        },
    )
    .context("aggregation failed")?;
    let mut out = std::io::stdout().lock();
    out.write_all(yaml.as_bytes())
        .and_then(|()| out.flush())
        .context("cannot write to standard output")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use reports_server_aggregator::cluster::adoption::{DEFAULT_GRACE, DEFAULT_RETRY};
    use reports_server_aggregator::cluster::runner::DEFAULT_POLICY_SYNC_TIMEOUT;
    use reports_server_aggregator::queue::DEFAULT_DELAY;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        aggregation: AggregationArgs,
    }

    #[derive(Parser)]
    struct Offline {
        #[command(flatten)]
        aggregate: AggregateArgs,
    }

    #[test]
    fn serve_defaults_are_the_documented_ones() {
        let args = Serve::try_parse_from(["serve"]).unwrap().aggregation;
        assert!(args.enabled);
        assert_eq!(args.config(), AggregatorConfig::default());
    }

    #[test]
    fn serve_flags() {
        let args = Serve::try_parse_from([
            "serve",
            "--aggregation-delay",
            "1",
            "--aggregation-workers",
            "2",
            "--aggregation-layout",
            "per-policy",
            "--chunk-size",
            "10",
            "--aggregation-output",
            "openreports",
            "--aggregation-page-size",
            "50",
        ])
        .unwrap()
        .aggregation;
        let config = args.config();
        assert_eq!(config.queue.delay, Duration::from_secs(1));
        assert_eq!(config.queue.workers, 2);
        assert_eq!(config.merge.layout, Layout::PerPolicy);
        assert_eq!(config.merge.chunk_size, 10);
        assert_eq!(config.merge.output, OutputFormat::Openreports);
        assert_eq!(config.page_size, 50);
        for (flags, enabled) in [
            (&["serve", "--aggregation"][..], true),
            (&["serve", "--aggregation=false"][..], false),
            (&["serve", "--aggregation", "false"][..], false),
        ] {
            assert_eq!(
                Serve::try_parse_from(flags).unwrap().aggregation.enabled,
                enabled,
                "{flags:?}"
            );
        }
        assert!(Serve::try_parse_from(["serve", "--aggregation-layout", "per-node"]).is_err());
    }

    #[test]
    fn delays() {
        assert_eq!(parse_delay("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_delay("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_delay("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_delay("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_delay("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_delay("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_delay("90d"), Ok(Duration::from_secs(90 * 86_400)));
        assert!(parse_delay("soon").is_err());
        assert!(parse_delay("-1").is_err());
    }

    #[test]
    fn offline_flags() {
        let args = Offline::try_parse_from([
            "aggregate",
            "--input",
            "a.yaml",
            "dir",
            "--input",
            "-",
            "--policies",
            "p.yaml",
            "--layout",
            "per-policy",
            "--chunk-size",
            "0",
            "--output",
            "openreports",
        ])
        .unwrap()
        .aggregate;
        assert_eq!(
            args.input,
            [
                PathBuf::from("a.yaml"),
                PathBuf::from("dir"),
                PathBuf::from("-")
            ]
        );
        assert_eq!(args.policies, [PathBuf::from("p.yaml")]);
        assert_eq!(args.layout, Layout::PerPolicy);
        assert_eq!(args.chunk_size, 0);
        assert_eq!(args.output, OutputFormat::Openreports);
        assert!(Offline::try_parse_from(["aggregate"]).is_err());
    }

    #[test]
    fn cluster_defaults_are_the_documented_ones() {
        let args = Offline::try_parse_from(["aggregate", "--kubeconfig", "kc"])
            .unwrap()
            .aggregate;
        assert!(args.input.is_empty());
        assert_eq!(args.cluster.kubeconfig, Some(PathBuf::from("kc")));
        let config = args.cluster_config();
        assert_eq!(config.aggregator, AggregatorConfig::default());
        assert_eq!(config.aggregator.queue.delay, DEFAULT_DELAY);
        assert_eq!(config.adoption.grace, DEFAULT_GRACE);
        assert_eq!(config.adoption.retry, DEFAULT_RETRY);
        assert_eq!(config.lease.name, "reports-server-aggregator");
        assert_eq!(config.lease.duration, Duration::from_secs(15));
        assert_eq!(config.lease.renew_interval, Duration::from_secs(5));
        assert_eq!(config.lease.renew_deadline, Duration::from_secs(10));
        assert!(config.watch_policies);
        assert_eq!(config.policy_sync_timeout, DEFAULT_POLICY_SYNC_TIMEOUT);
        assert_eq!(
            config.metrics_address,
            Some("127.0.0.1:9464".parse().unwrap())
        );
    }

    #[test]
    fn cluster_flags() {
        let args = Offline::try_parse_from([
            "aggregate",
            "--kubeconfig",
            "kc",
            "--aggregation-delay",
            "1s",
            "--aggregation-layout",
            "per-policy",
            "--namespace-for-lease",
            "kyverno",
            "--lease-name",
            "agg",
            "--lease-duration",
            "6s",
            "--adoption-grace-period",
            "20s",
            "--watch-policies=false",
            "--metrics-bind-address",
            "off",
            "--aggregation-page-size",
            "100",
        ])
        .unwrap()
        .aggregate;
        let config = args.cluster_config();
        assert_eq!(config.aggregator.queue.delay, Duration::from_secs(1));
        assert_eq!(config.aggregator.merge.layout, Layout::PerPolicy);
        assert_eq!(config.aggregator.page_size, 100);
        assert_eq!(config.backend.list_page_size, 100);
        assert_eq!(
            (config.lease.namespace.as_str(), config.lease.name.as_str()),
            ("kyverno", "agg")
        );
        assert_eq!(config.lease.renew_interval, Duration::from_secs(2));
        assert_eq!(config.lease.renew_deadline, Duration::from_secs(4));
        assert_eq!(config.adoption.grace, Duration::from_secs(20));
        assert!(!config.watch_policies);
        assert_eq!(config.metrics_address, None);
        assert!(
            Offline::try_parse_from(["aggregate", "--in-cluster"])
                .unwrap()
                .aggregate
                .cluster
                .in_cluster
        );
    }

    #[test]
    fn offline_and_cluster_modes_exclude_each_other() {
        let err = Offline::try_parse_from(["aggregate", "--input", "a.yaml", "--kubeconfig", "kc"])
            .err()
            .expect("--input with --kubeconfig must be refused")
            .to_string();
        assert!(err.contains("cannot be used with"), "{err}");
        let err = Offline::try_parse_from(["aggregate", "--kubeconfig", "kc", "--in-cluster"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("cannot be used with"), "{err}");
        // --policies is an offline flag.
        assert!(
            Offline::try_parse_from(["aggregate", "--kubeconfig", "kc", "--policies", "p"])
                .is_err()
        );
        let err = Offline::try_parse_from(["aggregate"])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("--input") && err.contains("--kubeconfig"),
            "{err}"
        );
    }
}
