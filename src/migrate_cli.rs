//! `reports-server migrate`: the database schema (alone, as before), and moving the reports of a
//! cluster out of etcd-backed CRDs into the database with the switch of the APIServices — the
//! manual procedure when no operator runs (docs/migration.md).

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use reports_server_apiserver::registry::Registry;
use reports_server_apiserver::store::Store;
use reports_server_operator::migration::{
    self, MigrationReport, Progress, ToCrdsOptions, ToDatabaseOptions, cluster::Cluster,
    plan::ServiceTarget,
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
    /// Copy the reports in etcd-backed CRDs into the database, keep the copy current, fence the
    /// CRD storage for a few seconds, verify the copy object by object and switch the
    /// APIServices to the server. Run it again after an interruption: it resumes.
    ToDatabase(Box<ToDatabaseArgs>),
    /// Hand the groups routed to the server back to CRD storage with the data: install the CRDs
    /// if absent, fence the CRD storage against everyone but this command, give the APIServices
    /// back to kube-apiserver, write every report back, verify, lift the fence. The way back
    /// when the operator is gone. Run it again after an interruption: it resumes.
    ToCrds(Box<ToCrdsArgs>),
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

pub async fn run(args: MigrateArgs) -> anyhow::Result<()> {
    match args.command {
        None => schema(args.database).await,
        Some(MigrateCommand::Schema(db)) => schema(db).await,
        Some(MigrateCommand::ToDatabase(a)) => to_database(*a).await,
        Some(MigrateCommand::ToCrds(a)) => to_crds(*a).await,
    }
}

async fn schema(db: DatabaseArgs) -> anyhow::Result<()> {
    Store::connect(db.store_options()?)
        .await
        .context("migration failed")?;
    eprintln!("database is at the latest schema version");
    Ok(())
}

async fn to_database(args: ToDatabaseArgs) -> anyhow::Result<()> {
    let ca_bundle_pem = std::fs::read_to_string(&args.ca_bundle_file).with_context(|| {
        format!(
            "cannot read --ca-bundle-file {}",
            args.ca_bundle_file.display()
        )
    })?;
    anyhow::ensure!(
        ca_bundle_pem.contains("BEGIN CERTIFICATE"),
        "--ca-bundle-file {} holds no PEM certificate",
        args.ca_bundle_file.display()
    );
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
    let crds = reports_server_crds::crd::all_crds()
        .into_iter()
        .map(serde_json::to_value)
        .collect::<Result<Vec<_>, _>>()?;
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
    let store = Store::connect(db.store_options()?)
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
