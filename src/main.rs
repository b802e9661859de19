//! `reports-server`: Kubernetes policy reports served from SQL.
//!
//! This binary only parses flags and wires the crates together.

// Every production function fits on a screen (threshold in clippy.toml); tests may be longer.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

/// mimalloc instead of glibc's allocator: a write allocates and frees many short-lived JSON
/// values and SQL parameters, and glibc spent a third of the server's CPU on that
/// (`malloc_consolidate`, `unlink_chunk`, …) and kept the high-water mark of bulk loads
/// resident (docs/benchmarks.md, "lean results and mimalloc").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod aggregation_cli;
mod apiservices;
mod backup_cli;
#[cfg(feature = "bench")]
mod bench;
#[cfg(feature = "bench")]
mod bench_aggregation;
mod database_url;
mod limits_cli;
mod migrate_cli;
mod operator_cli;
mod query_cli;
mod statistics_cli;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;
use tracing::Instrument;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use reports_server_apiserver::http::ApiOptions;
use reports_server_apiserver::pki::CertPair;
use reports_server_apiserver::startup::{self, AuthMode, ServerConfig, ServingReload};
use reports_server_apiserver::store::StoreOptions;

#[derive(Parser)]
#[command(
    name = "reports-server",
    version,
    about = "Kubernetes policy reports served from SQL through the API aggregation layer"
)]
struct Cli {
    /// Log filter (tracing-subscriber EnvFilter syntax).
    #[arg(
        long,
        env = "REPORTS_SERVER_LOG",
        default_value = "info",
        global = true
    )]
    log: String,
    /// Log line format: `text` (coloured only on a terminal and without `NO_COLOR`) or `json`
    /// (one object per line, for log collectors).
    #[arg(
        long,
        env = "REPORTS_SERVER_LOG_FORMAT",
        default_value = "text",
        global = true,
        value_enum
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Logs to stderr in the chosen format. Colour codes only reach a terminal: a log piped to a
/// file or a collector stays plain text.
fn init_logging(filter: &str, format: LogFormat) -> anyhow::Result<()> {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .with_context(|| format!("invalid --log filter {filter:?}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
            .init(),
        LogFormat::Json => builder.json().with_current_span(true).init(),
    }
    Ok(())
}

#[derive(Subcommand)]
enum Command {
    /// Serve the report APIs. With no flags: 127.0.0.1:6443, embedded SQLite, own CA and a kubeconfig.
    Serve(Box<ServeArgs>),
    /// Print the CustomResourceDefinitions of the served kinds (generated from the Rust types).
    Crds,
    /// Apply database schema migrations and exit; `migrate to-database` moves a cluster's
    /// reports from etcd-backed CRDs into the database and switches the APIServices.
    Migrate(Box<migrate_cli::MigrateArgs>),
    /// Measure create and list throughput against a fresh standalone server.
    #[cfg(feature = "bench")]
    Bench(bench::BenchArgs),
    /// Print the ExternalName Service and the three APIServices that route a cluster's report
    /// APIs to a server running outside the cluster (pipe into `kubectl apply -f -`).
    Apiservices(apiservices::ApiservicesArgs),
    /// Merge ephemeral reports into policy reports: offline (`--input`, YAML in, YAML out), or
    /// continuously in a cluster through its API (`--kubeconfig`/`--in-cluster`).
    Aggregate(aggregation_cli::AggregateArgs),
    /// Measure end-to-end in-process aggregation: ephemeral reports created through the API
    /// until every one is merged into policy reports, for both layouts.
    #[cfg(feature = "bench")]
    BenchAggregation(bench_aggregation::BenchAggregationArgs),
    /// Run the ReportsServer operator (reconciles reportsserver.io/v1alpha1 objects).
    Operator(Box<operator_cli::OperatorArgs>),
    /// Ask the database a named question (failing results, compliance, top failing resources,
    /// results by property, compliance trend) or read-only SQL (`--sql`), through a read-only
    /// connection (docs/analytics.md).
    Query(Box<query_cli::QueryArgs>),
    /// Copy the embedded SQLite database into a new file, consistent as of one moment, while
    /// the server runs (for analysts' tools, or as a backup).
    Backup(Box<backup_cli::BackupArgs>),
}

/// How `serve` authenticates and authorizes callers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum AuthModeArg {
    /// Own CA, admin client certificate and kubeconfig; no cluster.
    Standalone,
    /// Behind kube-apiserver: front-proxy certificates, TokenReview, SubjectAccessReview.
    Delegated,
}

#[derive(Args, Clone)]
pub struct DatabaseArgs {
    /// Database URL: sqlite://PATH?mode=rwc, postgres://USER:PASS@HOST:PORT/DB or mysql://…
    /// [default: SQLite file `reports.db` in --data-dir; or built from DB_HOST/DB_PORT/DB_DATABASE/DB_USER/DB_PASSWORD when DB_HOST is set]
    #[arg(long, env = "REPORTS_SERVER_DATABASE_URL")]
    database_url: Option<String>,
    /// Directory for the embedded database, certificates and kubeconfig.
    #[arg(long, env = "REPORTS_SERVER_DATA_DIR", default_value_t = default_data_dir())]
    data_dir: String,
    /// Partition key so several clusters can share one database. In delegated mode the first
    /// server of a cluster records the cluster (its kube-system namespace UID) on the id, and a
    /// server of another cluster refuses to start on it. `all` is reserved (for `query`).
    #[arg(long, env = "REPORTS_SERVER_CLUSTER_ID", default_value = "default")]
    cluster_id: String,
    /// Take --cluster-id over for this cluster even though the database recorded another one
    /// for it: for a cluster rebuilt from scratch (a new kube-system UID) that keeps its reports.
    /// Start once with it, then without.
    #[arg(
        long,
        env = "REPORTS_SERVER_RECLAIM_CLUSTER_ID",
        default_value_t = false
    )]
    reclaim_cluster_id: bool,
    /// Maximum database connections of this process.
    #[arg(long, env = "REPORTS_SERVER_DB_MAX_CONNECTIONS", default_value_t = 10)]
    db_max_connections: u32,
    /// Seconds an operation waits for a database connection before the request fails with 503.
    #[arg(
        long,
        env = "REPORTS_SERVER_DB_CONNECT_TIMEOUT_SECONDS",
        default_value_t = 10
    )]
    db_connect_timeout_seconds: u64,
    /// Milliseconds the health probe (every 500 ms, on a connection of its own) waits for the
    /// database; without an answer, data requests answer 503 at once until it answers again.
    /// Discovery and readiness never depend on it.
    #[arg(
        long,
        env = "REPORTS_SERVER_DB_PROBE_TIMEOUT_MS",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    db_probe_timeout_ms: u64,
    /// Seconds PostgreSQL lets a session of ours idle inside a transaction before it ends the
    /// session (`idle_in_transaction_session_timeout`): a transaction abandoned on a half-open
    /// connection during a network outage would otherwise keep its row locks, and stall every
    /// write, until TCP keepalive notices (hours). Ours idle for milliseconds. Also how long a
    /// list's read waits, holding its connection, for a client that takes no rows (any
    /// database).
    #[arg(
        long,
        env = "REPORTS_SERVER_DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS",
        default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    db_idle_in_transaction_timeout_seconds: u64,
    /// Most objects written in one transaction by group commit: writes that arrive while a
    /// commit runs share the next one (each keeps its own resourceVersion; a failing write
    /// fails alone). 1 turns grouping off.
    #[arg(
        long,
        env = "REPORTS_SERVER_GROUP_COMMIT_MAX_WRITES",
        default_value_t = 256,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    group_commit_max_writes: u32,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    aggregation: aggregation_cli::AggregationArgs,
    #[command(flatten)]
    migration: migrate_cli::ServeMigrationArgs,
    #[command(flatten)]
    limits: limits_cli::LimitsArgs,
    #[command(flatten)]
    statistics: statistics_cli::StatisticsArgs,
    /// Address to listen on.
    #[arg(long, env = "REPORTS_SERVER_BIND_ADDRESS", default_value = "127.0.0.1")]
    bind_address: IpAddr,
    /// HTTPS port.
    #[arg(long, env = "REPORTS_SERVER_SECURE_PORT", default_value_t = 6443)]
    secure_port: u16,
    /// Where to write the admin kubeconfig [default: <data-dir>/kubeconfig].
    #[arg(long, env = "REPORTS_SERVER_WRITE_KUBECONFIG")]
    write_kubeconfig: Option<PathBuf>,
    /// Largest accepted request body in bytes (larger requests get 413). kube-apiserver's
    /// proxy passes bodies of any size: this is the largest report the cluster can store.
    #[arg(
        long,
        env = "REPORTS_SERVER_MAX_REQUEST_BYTES",
        default_value_t = reports_server_apiserver::http::DEFAULT_MAX_REQUEST_BYTES
    )]
    max_request_bytes: usize,
    /// Bytes of request bodies handled at once, all requests together, counted as they arrive; a
    /// body that does not fit gets 429 (handling a body takes tens of times its size in memory at
    /// its peak). At least --max-request-bytes, at most 4 GiB.
    #[arg(
        long,
        env = "REPORTS_SERVER_MAX_INFLIGHT_REQUEST_BYTES",
        default_value_t = reports_server_apiserver::http::DEFAULT_MAX_INFLIGHT_REQUEST_BYTES
    )]
    max_inflight_request_bytes: usize,
    /// Seconds between BOOKMARK events on watches that allow them.
    #[arg(
        long,
        env = "REPORTS_SERVER_BOOKMARK_INTERVAL_SECONDS",
        default_value_t = 60
    )]
    bookmark_interval_seconds: u64,
    /// Change-log entries younger than this many seconds are kept for resuming watches.
    #[arg(
        long,
        env = "REPORTS_SERVER_WATCH_HISTORY_SECONDS",
        default_value_t = 600
    )]
    watch_history_seconds: u64,
    /// At most this many change-log entries are kept.
    #[arg(
        long,
        env = "REPORTS_SERVER_WATCH_HISTORY_MAX_EVENTS",
        default_value_t = 100_000
    )]
    watch_history_max_events: i64,
    /// Most bytes of changes buffered for live watchers that have yet to read them (their JSON,
    /// shared by all of them; a change every watcher has read is dropped); a watcher further
    /// behind is cut off and resumes from the change log. Default 64 MiB.
    #[arg(
        long,
        env = "REPORTS_SERVER_WATCH_BUFFER_BYTES",
        default_value_t = 64 * 1024 * 1024,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    watch_buffer_bytes: u64,
    /// Most bytes of a JSON list's rows read from the database ahead of its client. A page up
    /// to this size is read at the database's pace and its connection goes back to the pool at
    /// once; a larger one (a list without `limit`) keeps its connection while a slow client
    /// reads instead of holding every body in memory, and ends when the client takes nothing
    /// for --db-idle-in-transaction-timeout-seconds. From 64 KiB (one batch of rows) to 4 GiB
    /// (permits are counted in 32 bits). Default 8 MiB.
    #[arg(
        long,
        env = "REPORTS_SERVER_LIST_READ_AHEAD_BYTES",
        default_value_t = 8 * 1024 * 1024,
        value_parser = clap::value_parser!(u64).range(65536..=4_294_967_295)
    )]
    list_read_ahead_bytes: u64,
    /// Authentication and authorization: standalone or delegated to the cluster.
    #[arg(
        long,
        env = "REPORTS_SERVER_AUTH_MODE",
        value_enum,
        default_value = "standalone"
    )]
    auth_mode: AuthModeArg,
    /// On SIGTERM, keep serving this many seconds with `/readyz` failing before stopping, so
    /// that endpoints (and kube-apiserver's aggregator) stop sending requests first. The operator
    /// sets 5 for its pods; 0 stops at once.
    #[arg(
        long,
        env = "REPORTS_SERVER_SHUTDOWN_DELAY_SECONDS",
        default_value_t = 0
    )]
    shutdown_delay_seconds: u64,
    /// Kubeconfig for delegated mode [default: in-cluster configuration, then $KUBECONFIG].
    #[arg(long, env = "REPORTS_SERVER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Serving certificate (PEM) [default: generated in --data-dir, signed by the data-dir CA].
    #[arg(
        long,
        env = "REPORTS_SERVER_TLS_CERT_FILE",
        requires = "tls_private_key_file"
    )]
    tls_cert_file: Option<PathBuf>,
    /// Key of --tls-cert-file (PEM).
    #[arg(
        long,
        env = "REPORTS_SERVER_TLS_PRIVATE_KEY_FILE",
        requires = "tls_cert_file"
    )]
    tls_private_key_file: Option<PathBuf>,
    /// Seconds between checks of --tls-cert-file/--tls-private-key-file for a renewed
    /// certificate, which new connections then get without a restart; 0 never re-reads them.
    #[arg(
        long,
        env = "REPORTS_SERVER_TLS_RELOAD_INTERVAL_SECONDS",
        default_value_t = 10
    )]
    tls_reload_interval_seconds: u64,
    /// Extra names for the generated serving certificate, comma-separated.
    #[arg(
        long,
        env = "REPORTS_SERVER_SERVING_CERT_NAMES",
        value_delimiter = ',',
        default_value = "reports-server.reports-server.svc"
    )]
    serving_cert_names: Vec<String>,
    /// Seconds between change-log compactions.
    #[arg(
        long,
        env = "REPORTS_SERVER_COMPACTION_INTERVAL_SECONDS",
        default_value_t = 30
    )]
    compaction_interval_seconds: u64,
}

fn default_data_dir() -> String {
    match std::env::var_os("XDG_DATA_HOME").or_else(|| {
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share").into_os_string())
    }) {
        Some(base) => PathBuf::from(base)
            .join("reports-server")
            .display()
            .to_string(),
        None => ".reports-server".into(),
    }
}

impl DatabaseArgs {
    /// The effective URL: the flag, the peer's DB_* variables, or the embedded SQLite file.
    fn url(&self) -> anyhow::Result<String> {
        if let Some(url) = database_url::named(self.database_url.as_deref(), |name| {
            std::env::var(name).ok()
        }) {
            return Ok(url);
        }
        let dir = PathBuf::from(&self.data_dir);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create the data directory {}", dir.display()))?;
        Ok(database_url::embedded_sqlite(&dir))
    }

    pub(crate) fn store_options(&self) -> anyhow::Result<StoreOptions> {
        if self.cluster_id == reports_server_analytics::ALL_CLUSTERS {
            anyhow::bail!(
                "--cluster-id {:?} is reserved: `reports-server query --cluster-id all` reads \
                 every cluster of the database; give this cluster another id",
                reports_server_analytics::ALL_CLUSTERS
            );
        }
        let mut options = StoreOptions::new(self.url()?);
        options.cluster_id = self.cluster_id.clone();
        options.reclaim_cluster_id = self.reclaim_cluster_id;
        options.max_connections = self.db_max_connections;
        options.connect_timeout = std::time::Duration::from_secs(self.db_connect_timeout_seconds);
        options.probe_timeout = std::time::Duration::from_millis(self.db_probe_timeout_ms);
        options.idle_in_transaction_timeout =
            std::time::Duration::from_secs(self.db_idle_in_transaction_timeout_seconds);
        options.group_commit_max_writes = self.group_commit_max_writes as usize;
        Ok(options)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(&cli.log, cli.log_format)?;
    match cli.command {
        Command::Crds => {
            print!("{}", reports_server_crds::crd::all_crds_yaml());
            Ok(())
        }
        Command::Migrate(args) => migrate_cli::run(*args).await,
        Command::Serve(args) => serve(*args).await,
        #[cfg(feature = "bench")]
        Command::Bench(args) => bench::run(args).await,
        Command::Apiservices(args) => apiservices::run(args),
        Command::Aggregate(args) => aggregation_cli::run_aggregate(args).await,
        #[cfg(feature = "bench")]
        Command::BenchAggregation(args) => bench_aggregation::run(args).await,
        Command::Operator(args) => operator_cli::run(*args).await,
        Command::Query(args) => query_cli::run(*args).await,
        Command::Backup(args) => backup_cli::run(*args).await,
    }
}

/// The HTTP layer's tunables from `serve`'s flags.
fn api_options(args: &ServeArgs) -> anyhow::Result<ApiOptions> {
    anyhow::ensure!(
        args.max_inflight_request_bytes >= args.max_request_bytes,
        "--max-inflight-request-bytes ({}) is below --max-request-bytes ({}): a body of \
         the largest accepted size would always be refused; raise the first or lower the second",
        args.max_inflight_request_bytes,
        args.max_request_bytes
    );
    anyhow::ensure!(
        args.max_inflight_request_bytes <= u32::MAX as usize,
        "--max-inflight-request-bytes ({}) is above the largest supported, {} (4 GiB)",
        args.max_inflight_request_bytes,
        u32::MAX
    );
    let mut api = ApiOptions {
        max_request_bytes: args.max_request_bytes,
        max_inflight_request_bytes: args.max_inflight_request_bytes,
        bookmark_interval: Duration::from_secs(args.bookmark_interval_seconds.max(1)),
        ..ApiOptions::default()
    };
    args.limits.apply(&mut api);
    Ok(api)
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    args.statistics.options()?;
    let mut store = args.database.store_options()?;
    store.watch_history = Duration::from_secs(args.watch_history_seconds);
    store.watch_history_max_events = args.watch_history_max_events;
    store.watch_buffer_bytes = usize::try_from(args.watch_buffer_bytes)
        .context("--watch-buffer-bytes does not fit this machine's address space")?;
    store.list_read_ahead_bytes = usize::try_from(args.list_read_ahead_bytes)
        .context("--list-read-ahead-bytes does not fit this machine's address space")?;
    store.compaction_interval = Duration::from_secs(args.compaction_interval_seconds.max(1));
    let data_dir = PathBuf::from(&args.database.data_dir);
    let kubeconfig = args
        .write_kubeconfig
        .clone()
        .unwrap_or_else(|| data_dir.join("kubeconfig"));
    let cluster = match args.auth_mode {
        AuthModeArg::Standalone => None,
        AuthModeArg::Delegated => Some(cluster_client(args.kubeconfig.as_deref()).await?),
    };
    let auth = match &cluster {
        None => AuthMode::Standalone,
        Some(client) => AuthMode::Delegated(client.clone()),
    };
    let serving = match (&args.tls_cert_file, &args.tls_private_key_file) {
        (Some(cert), Some(key)) => Some(CertPair {
            cert_pem: std::fs::read_to_string(cert)
                .with_context(|| format!("cannot read --tls-cert-file {}", cert.display()))?,
            key_pem: std::fs::read_to_string(key)
                .with_context(|| format!("cannot read --tls-private-key-file {}", key.display()))?,
        }),
        _ => None,
    };
    let delegated = matches!(auth, AuthMode::Delegated(_));
    let config = ServerConfig {
        data_dir,
        bind: SocketAddr::new(args.bind_address, args.secure_port),
        store,
        api: api_options(&args)?,
        kubeconfig,
        auth,
        serving,
        serving_reload: match (&args.tls_cert_file, &args.tls_private_key_file) {
            (Some(cert), Some(key)) if args.tls_reload_interval_seconds > 0 => {
                Some(ServingReload {
                    cert_file: cert.clone(),
                    key_file: key.clone(),
                    interval: Duration::from_secs(args.tls_reload_interval_seconds),
                })
            }
            _ => None,
        },
        serving_names: args.serving_cert_names.clone(),
        connections: args.limits.connections(),
    };
    let server = startup::start(config)
        .await
        .context("cannot start the server")?;
    tracing::info!(address = %server.addr, backend = ?server.store.backend(), "serving");
    println!("reports-server is serving on {}", server.url());
    if delegated {
        println!(
            "  authentication and authorization are delegated to the cluster; route the APIs here with"
        );
        println!(
            "  reports-server apiservices --port {} --ca-bundle-file <CA of the serving certificate> | kubectl apply -f -",
            server.addr.port()
        );
    } else {
        println!(
            "  kubectl --kubeconfig {} get policyreports -A",
            server.kubeconfig.display()
        );
    }
    let migration = args.migration.worker(
        cluster.as_ref(),
        reports_server_apiserver::registry::Registry::new(server.store.clone(), None),
    )?;
    let settled = migration.as_ref().map(|w| w.settled());
    let migration = migration.map(|w| spawn_migration(w, &server));
    let aggregation = args.aggregation.spawn(&server, cluster.as_ref(), settled);
    let statistics = args.statistics.spawn(&server)?;
    let token = server.shutdown_token();
    let draining = server.draining_token();
    let delay = Duration::from_secs(args.shutdown_delay_seconds);
    tokio::spawn(
        async move {
            shutdown_signal().await;
            if !delay.is_zero() {
                tracing::info!(
                    delay_seconds = delay.as_secs(),
                    "terminating: /readyz now fails; still serving until the delay ends"
                );
                draining.cancel();
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    // A second signal stops at once.
                    _ = shutdown_signal() => {}
                }
            }
            tracing::info!("shutting down");
            token.cancel();
        }
        .instrument(tracing::info_span!("shutdown_signal")),
    );
    server.wait().await;
    // Each releases its lease on the way out, so another replica takes over without waiting.
    for worker in [aggregation, migration, statistics].into_iter().flatten() {
        let _ = worker.await;
    }
    Ok(())
}

/// Runs the migration worker once the store started: a server started while its database was
/// down migrates once the database answers.
fn spawn_migration(
    worker: reports_server_migration::worker::Worker,
    server: &startup::RunningServer,
) -> tokio::task::JoinHandle<()> {
    let (health, stop) = (server.store.health().clone(), server.shutdown_token());
    tokio::spawn(async move {
        tokio::select! {
            () = health.came_up() => worker.run(stop).await,
            () = stop.cancelled() => {}
        }
    })
}

/// A client for the cluster: `--kubeconfig`, else in-cluster, else `$KUBECONFIG`/`~/.kube/config`.
pub(crate) async fn cluster_client(
    kubeconfig: Option<&std::path::Path>,
) -> anyhow::Result<kube::Client> {
    kube::Client::try_from(cluster_config(kubeconfig).await?)
        .context("cannot build a Kubernetes client")
}

/// The client configuration from `kubeconfig`, or inferred (in a pod, then `$KUBECONFIG`).
pub(crate) async fn cluster_config(
    kubeconfig: Option<&std::path::Path>,
) -> anyhow::Result<kube::Config> {
    match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .with_context(|| format!("kubeconfig {} is not usable", path.display()))
        }
        None => kube::Config::infer()
            .await
            .context("delegated mode needs cluster access: run in a pod, or pass --kubeconfig"),
    }
}

/// A client for the current context of a kubeconfig file.
pub(crate) async fn client_from_kubeconfig(path: &std::path::Path) -> anyhow::Result<kube::Client> {
    kube::Client::try_from(cluster_config(Some(path)).await?)
        .context("cannot build a Kubernetes client")
}

/// Resolves on SIGINT or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
