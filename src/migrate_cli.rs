//! `reports-server migrate`: the database schema (alone, as before), and moving the reports of a
//! cluster out of etcd-backed CRDs into the database with the switch of the APIServices — the
//! manual procedure when no operator runs (docs/migration.md).

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use reports_server_apiserver::registry::Registry;
use reports_server_apiserver::store::{Store, downgrade_schema};
use reports_server_migration::{
    self as migration, MigrationReport, Progress, ToCrdsOptions, ToDatabaseOptions,
    cluster::Cluster,
    plan::ServiceTarget,
    worker::{Worker, WorkerOptions},
};

use crate::DatabaseArgs;

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct MigrateArgs {
    #[command(subcommand)]
    command: Option<MigrateCommand>,
    /// With no subcommand: bring the database schema to the latest version and exit.
    #[command(flatten)]
    database: DatabaseArgs,
}

#[derive(Subcommand)]
enum MigrateCommand {
    /// Bring the database schema to the latest version and exit (what `migrate` alone does).
    Schema(DatabaseArgs),
    /// Undo the schema migrations applied after `--to`, newest first, so that an older release
    /// (whose last migration is `--to`) can start on the database. Stop every replica first.
    SchemaDowngrade(SchemaDowngradeArgs),
    /// Copy the reports in etcd-backed CRDs into the database, keep the copy current, fence the
    /// CRD storage for a few seconds, verify the copy object by object and switch the
    /// APIServices to the server. Run it again after an interruption: it resumes.
    ToDatabase(Box<ToDatabaseArgs>),
    /// Hand the groups routed to the server back to CRD storage with the data: install the CRDs
    /// if absent, fence the CRD storage against everyone but this command, give the APIServices
    /// back to kube-apiserver, write every report back, verify, lift the fence. The way back
    /// when the operator is gone. Run it again after an interruption: it resumes.
    ToCrds(Box<ToCrdsArgs>),
    /// After restoring the database from a backup: raise the resourceVersion counter far above
    /// anything served before the restore and drop the watch history below it, so that clients
    /// holding later versions relist (410 Gone) instead of resuming at a version that now names
    /// other content. Stop every replica first; run once, before starting the server.
    AfterRestore(AfterRestoreArgs),
}

#[derive(Args)]
struct AfterRestoreArgs {
    /// The new floor, when the highest resourceVersion served before the restore is known
    /// (any value above it). [default: the restored counter + 2^32, above anything fewer than
    /// four billion writes after the backup could have reached]
    #[arg(long)]
    floor: Option<i64>,
    #[command(flatten)]
    database: DatabaseArgs,
}

#[derive(Args)]
struct SchemaDowngradeArgs {
    /// The last migration to keep, as `seaql_migrations.version` names it, e.g.
    /// `m20261124_000004_one_body_copy` (docs/sql-schema.md lists which release ends where).
    #[arg(long)]
    to: String,
    #[command(flatten)]
    database: DatabaseArgs,
}

/// The cluster, the Service the APIServices point at, and how fast to go: shared by both
/// directions.
#[derive(Args)]
struct ClusterArgs {
    /// Kubeconfig of the cluster [default: in-cluster configuration, then $KUBECONFIG].
    #[arg(long, env = "REPORTS_SERVER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Namespace of the Service in front of the server (the APIServices point at it).
    #[arg(
        long,
        env = "REPORTS_SERVER_SERVICE_NAMESPACE",
        default_value = "reports-server"
    )]
    service_namespace: String,
    /// Name of that Service.
    #[arg(
        long,
        env = "REPORTS_SERVER_SERVICE_NAME",
        default_value = "reports-server"
    )]
    service_name: String,
    /// Objects per list page and per database transaction.
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_PAGE_SIZE",
        default_value_t = 500
    )]
    page_size: u32,
    /// Seconds the fence may take to hold (and CRDs to be Established), and kube-apiserver to
    /// route a switched group.
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_SWITCH_TIMEOUT_SECONDS",
        default_value_t = 120
    )]
    switch_timeout_seconds: u64,
    /// Count what would be copied and change nothing.
    #[arg(long)]
    dry_run: bool,
}

#[derive(Args)]
struct ToCrdsArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Milliseconds the database must stay unchanged after the switch before it is read.
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_SETTLE_MILLISECONDS",
        default_value_t = 1000
    )]
    settle_milliseconds: u64,
    /// Objects written back to CRD storage at once; writers are refused until all are.
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_WRITE_CONCURRENCY",
        default_value_t = 8
    )]
    write_concurrency: usize,
}

#[derive(Args)]
struct ToDatabaseArgs {
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Port of the Service.
    #[arg(long, env = "REPORTS_SERVER_SERVICE_PORT", default_value_t = 443)]
    service_port: i32,
    /// PEM file of the CA that signed the server's certificate (the APIServices' `caBundle`).
    #[arg(long, env = "REPORTS_SERVER_CA_BUNDLE_FILE")]
    ca_bundle_file: PathBuf,
    /// Objects per second the copy writes at most (0: no limit).
    #[arg(long, env = "REPORTS_SERVER_MIGRATION_RATE", default_value_t = 0.0)]
    rate: f64,
}

/// `serve --migrate-from-crds …`: the migration as the server's background worker (how the
/// operator's `spec.migration` runs; docs/migration.md "With the operator").
#[derive(Args, Clone)]
pub struct ServeMigrationArgs {
    /// Move report groups whose APIService is still Local (CRD storage) into the database and
    /// switch them to this server; hand switched groups that are no longer wanted back. Needs
    /// --auth-mode=delegated. In-process aggregation waits while data moves.
    #[arg(long, env = "REPORTS_SERVER_MIGRATE_FROM_CRDS")]
    migrate_from_crds: bool,
    /// `namespace/name` of the ConfigMap through which an operator says which groups to serve
    /// (key `groups`) and the server reports progress [default: none; --migration-groups].
    #[arg(long, env = "REPORTS_SERVER_MIGRATION_MAILBOX")]
    migration_mailbox: Option<String>,
    /// API groups to serve when no mailbox says otherwise, comma-separated.
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_GROUPS",
        value_delimiter = ',',
        default_value = "wgpolicyk8s.io,reports.kyverno.io,openreports.io"
    )]
    migration_groups: Vec<String>,
    /// Namespace of the Service in front of this server (the switched APIServices point at it).
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_SERVICE_NAMESPACE",
        default_value = "reports-server"
    )]
    migration_service_namespace: String,
    /// Name of that Service.
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_SERVICE_NAME",
        default_value = "reports-server"
    )]
    migration_service_name: String,
    /// Port of that Service.
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_SERVICE_PORT",
        default_value_t = 443
    )]
    migration_service_port: i32,
    /// PEM file of the CA of this server's certificate (the switched APIServices' `caBundle`).
    #[arg(long, env = "REPORTS_SERVER_MIGRATION_CA_BUNDLE_FILE")]
    migration_ca_bundle_file: Option<PathBuf>,
    /// Objects per second the copy writes at most (0: no limit).
    #[arg(long, env = "REPORTS_SERVER_MIGRATION_RATE", default_value_t = 0.0)]
    migration_rate: f64,
    /// Objects per list page and per database transaction.
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_PAGE_SIZE",
        default_value_t = 500
    )]
    migration_page_size: u32,
    /// Objects written back to CRD storage at once during a hand-back.
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_WRITE_CONCURRENCY",
        default_value_t = 8
    )]
    migration_write_concurrency: usize,
    /// Seconds the fence may take to hold and kube-apiserver to route a switched group.
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_SWITCH_TIMEOUT_SECONDS",
        default_value_t = 120
    )]
    migration_switch_timeout_seconds: u64,
    /// Seconds between checks of the cluster when nothing moves (and after a failed step).
    #[arg(
        long,
        env = "REPORTS_SERVER_MIGRATION_INTERVAL_SECONDS",
        default_value_t = 5
    )]
    migration_interval_seconds: u64,
}

impl ServeMigrationArgs {
    /// The worker, when asked for. `client` is the cluster of delegated mode.
    pub fn worker(
        &self,
        client: Option<&kube::Client>,
        registry: Registry,
    ) -> anyhow::Result<Option<Worker>> {
        if !self.migrate_from_crds {
            return Ok(None);
        }
        let client = client
            .context("--migrate-from-crds needs the cluster: run with --auth-mode=delegated")?;
        let ca_file = self.migration_ca_bundle_file.as_ref().context(
            "--migrate-from-crds needs --migration-ca-bundle-file (the CA of this server's certificate)",
        )?;
        let ca_bundle_pem = read_ca_bundle(ca_file)?;
        anyhow::ensure!(
            self.migration_page_size > 0,
            "--migration-page-size must be at least 1"
        );
        let target = ServiceTarget {
            namespace: self.migration_service_namespace.clone(),
            name: self.migration_service_name.clone(),
            port: self.migration_service_port,
            ca_bundle_pem,
        };
        let switch_timeout = Duration::from_secs(self.migration_switch_timeout_seconds);
        let options = WorkerOptions {
            to_database: ToDatabaseOptions {
                target: target.clone(),
                page_size: self.migration_page_size,
                rate: (self.migration_rate > 0.0).then_some(self.migration_rate),
                dry_run: false,
                switch_timeout,
                groups: self.migration_groups.clone(),
            },
            to_crds: ToCrdsOptions {
                target,
                crds: all_crds()?,
                page_size: self.migration_page_size,
                dry_run: false,
                switch_timeout,
                settle: Duration::from_secs(1),
                write_concurrency: self.migration_write_concurrency,
                groups: Vec::new(),
            },
            mailbox: self.migration_mailbox.clone(),
            interval: Duration::from_secs(self.migration_interval_seconds.max(1)),
            lease: Default::default(),
        };
        Ok(Some(Worker::new(client.clone(), registry, options)?))
    }
}

fn read_ca_bundle(path: &std::path::Path) -> anyhow::Result<String> {
    let pem = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the CA bundle file {}", path.display()))?;
    anyhow::ensure!(
        pem.contains("BEGIN CERTIFICATE"),
        "the CA bundle file {} holds no PEM certificate",
        path.display()
    );
    Ok(pem)
}

fn all_crds() -> anyhow::Result<Vec<serde_json::Value>> {
    Ok(reports_server_crds::crd::all_crds()
        .into_iter()
        .map(serde_json::to_value)
        .collect::<Result<Vec<_>, _>>()?)
}

pub async fn run(args: MigrateArgs) -> anyhow::Result<()> {
    match args.command {
        None => schema(args.database).await,
        Some(MigrateCommand::Schema(db)) => schema(db).await,
        Some(MigrateCommand::SchemaDowngrade(a)) => schema_downgrade(a).await,
        Some(MigrateCommand::ToDatabase(a)) => to_database(*a).await,
        Some(MigrateCommand::ToCrds(a)) => to_crds(*a).await,
        Some(MigrateCommand::AfterRestore(a)) => after_restore(a).await,
    }
}

async fn after_restore(args: AfterRestoreArgs) -> anyhow::Result<()> {
    let store = Store::connect(args.database.store_options()?)
        .await
        .context("cannot open the restored database")?;
    let (restored, _) = store.versions().await?;
    let floor = args
        .floor
        .unwrap_or_else(|| migration::plan::version_floor(restored));
    anyhow::ensure!(
        floor > restored,
        "--floor {floor} is not above the restored database's resourceVersion {restored}: clients may already hold versions up to it"
    );
    let (current, compacted) = store.raise_version_floor(floor).await?;
    eprintln!(
        "resourceVersion raised from {restored} to {current}; watch history up to {compacted} dropped: clients that saw versions from before the restore get 410 Gone and relist"
    );
    Ok(())
}

async fn schema(db: DatabaseArgs) -> anyhow::Result<()> {
    Store::connect(db.store_options()?)
        .await
        .context("migration failed")?;
    eprintln!("database is at the latest schema version");
    Ok(())
}

async fn schema_downgrade(args: SchemaDowngradeArgs) -> anyhow::Result<()> {
    let undone = downgrade_schema(&args.database.store_options()?, &args.to)
        .await
        .context("schema downgrade failed")?;
    if undone.is_empty() {
        eprintln!("nothing to undo: the database is at {} or older", args.to);
    }
    for name in undone {
        eprintln!("undone: {name}");
    }
    Ok(())
}

async fn to_database(args: ToDatabaseArgs) -> anyhow::Result<()> {
    let ca_bundle_pem = read_ca_bundle(&args.ca_bundle_file)?;
    let (cluster, registry) = connect(&args.cluster, &args.database).await?;
    let c = args.cluster;
    let options = ToDatabaseOptions {
        target: ServiceTarget {
            namespace: c.service_namespace,
            name: c.service_name,
            port: args.service_port,
            ca_bundle_pem,
        },
        page_size: c.page_size,
        rate: (args.rate > 0.0).then_some(args.rate),
        dry_run: c.dry_run,
        switch_timeout: Duration::from_secs(c.switch_timeout_seconds),
        groups: Vec::new(),
    };
    let progress = Progress::default();
    let bar = tokio::spawn(show_progress(progress.clone()));
    let result = migration::to_database(&cluster, &registry, &options, &progress).await;
    bar.abort();
    finish(result.context("migration to the database stopped")?)
}

async fn to_crds(args: ToCrdsArgs) -> anyhow::Result<()> {
    let (cluster, registry) = connect(&args.cluster, &args.database).await?;
    let c = args.cluster;
    let crds = all_crds()?;
    let options = ToCrdsOptions {
        target: ServiceTarget {
            namespace: c.service_namespace,
            name: c.service_name,
            port: 0,
            ca_bundle_pem: String::new(),
        },
        crds,
        page_size: c.page_size,
        dry_run: c.dry_run,
        switch_timeout: Duration::from_secs(c.switch_timeout_seconds),
        settle: Duration::from_millis(args.settle_milliseconds),
        write_concurrency: args.write_concurrency,
        groups: Vec::new(),
    };
    let progress = Progress::default();
    let bar = tokio::spawn(show_progress(progress.clone()));
    let result = migration::to_crds(&cluster, &registry, &options, &progress).await;
    bar.abort();
    finish(result.context("hand-back to CRD storage stopped")?)
}

async fn connect(c: &ClusterArgs, db: &DatabaseArgs) -> anyhow::Result<(Cluster, Registry)> {
    anyhow::ensure!(c.page_size > 0, "--page-size must be at least 1");
    let client = crate::cluster_client(c.kubeconfig.as_deref()).await?;
    // The same check as a server's: moving this cluster's reports under an id another cluster
    // holds would mix the two.
    let mut options = db.store_options()?;
    options.cluster_uid = Some(reports_server_apiserver::delegated::cluster_uid(&client).await?);
    let store = Store::connect(options)
        .await
        .context("cannot open the database")?;
    Ok((Cluster::new(client), Registry::new(store, None)))
}

fn finish(report: MigrationReport) -> anyhow::Result<()> {
    summarize(&report);
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// A progress bar on a terminal, a line every 5 s otherwise.
async fn show_progress(progress: Progress) {
    let terminal = std::io::stderr().is_terminal();
    let mut tick = tokio::time::interval(if terminal {
        Duration::from_millis(250)
    } else {
        Duration::from_secs(5)
    });
    tick.tick().await;
    loop {
        tick.tick().await;
        let kinds = progress.snapshot();
        let total: u64 = kinds.iter().map(|k| k.total).sum();
        let copied: u64 = kinds.iter().map(|k| k.copied).sum();
        let mirrored: u64 = kinds.iter().map(|k| k.mirrored).sum();
        let line = format!(
            "{} {copied}/{total} copied, {mirrored} changes mirrored",
            bar(copied, total)
        );
        if terminal {
            eprint!("\r{line}\x1b[K");
        } else {
            eprintln!("{line}");
        }
    }
}

fn bar(done: u64, total: u64) -> String {
    const WIDTH: u64 = 30;
    let filled = (done * WIDTH).checked_div(total).unwrap_or(0).min(WIDTH) as usize;
    format!(
        "[{}{}]",
        "#".repeat(filled),
        ".".repeat(WIDTH as usize - filled)
    )
}

fn summarize(report: &MigrationReport) {
    for g in &report.groups {
        eprintln!("{:<28} was {}", g.api_service, g.state_before);
    }
    for k in &report.kinds {
        eprintln!(
            "{:<24} {:>7} objects, {:>6} changes mirrored, {:>5} fixed behind the fence",
            k.kind, k.total, k.mirrored, k.synced
        );
    }
    if report.dry_run {
        eprintln!("dry run: nothing was changed");
    } else {
        eprintln!(
            "copy {:.1} s ({:.0} objects/s); writes refused for {:.1} s; switch {:.1} s",
            report.copy_seconds,
            report.copy_objects_per_second,
            report.fence_seconds,
            report.switch_seconds
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_bar_fills_with_progress() {
        assert_eq!(super::bar(0, 0), format!("[{}]", ".".repeat(30)));
        assert_eq!(
            super::bar(5, 10),
            format!("[{}{}]", "#".repeat(15), ".".repeat(15))
        );
        assert_eq!(super::bar(12, 10), format!("[{}]", "#".repeat(30)));
    }
}
