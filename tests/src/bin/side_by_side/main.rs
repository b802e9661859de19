//! `side-by-side`: the same benchmark (`reports-server bench --kubeconfig …`) against each way
//! of serving policy reports, each on a fresh control plane and a fresh database, through the
//! same kube-apiserver:
//!
//! - `crds`: the report CRDs (crds/upstream) in etcd, served by kube-apiserver itself;
//! - `peer`: kyverno/reports-server on PostgreSQL behind the aggregation layer (built outside
//!   this repository by bench/peer/build.sh; `--peer-bin`);
//! - `postgres`, `sqlite`: this server on each backend behind the aggregation layer;
//! - `postgres-direct`, `sqlite-direct`: this server in the benchmark's own process, no
//!   kube-apiserver (what the server itself costs).
//!
//! With `--driver plain` the client is bench/plain_creates.py instead (creates only, through
//! kube-apiserver: `<out>/<target>-<reports>-plain.json` with the CPU per create of every
//! process, PostgreSQL's backends included). Each run writes `<out>/<target>-<reports>.json` (every figure with its samples) with the
//! bytes on disk and the processes' peak RSS and CPU added; at the end `<out>/summary.csv` and a
//! Markdown table with the ratios us/peer and us/CRDs. A benchmark, never part of CI
//! (docs/benchmarks.md "Side by side").

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use reports_server_tests::controlplane::{
    Component, ControlPlane, ControlPlaneOptions, ExternalApiService, spawn_tied_to_test,
    workspace_root,
};
use reports_server_tests::delegated::{self, Server};
use reports_server_tests::kubectl::Kubectl;
use reports_server_tests::{kube_client, postgres, server};
use serde_json::{Value, json};

mod summary;

/// Every target, in the order they run.
const TARGETS: [&str; 6] = [
    "crds",
    "peer",
    "postgres",
    "sqlite",
    "postgres-direct",
    "sqlite-direct",
];

#[derive(Parser)]
#[command(about = "Benchmark the report CRDs, the peer and reports-server side by side")]
struct Args {
    /// Targets, comma-separated: crds, peer, postgres, sqlite, postgres-direct, sqlite-direct.
    #[arg(
        long,
        env = "SIDE_BY_SIDE_TARGETS",
        value_delimiter = ',',
        default_value = "crds,peer,postgres,sqlite,postgres-direct,sqlite-direct"
    )]
    targets: Vec<String>,
    /// Report counts, comma-separated; every target runs at each.
    #[arg(
        long,
        env = "SIDE_BY_SIDE_SIZES",
        value_delimiter = ',',
        default_value = "1000,10000"
    )]
    sizes: Vec<u64>,
    /// Concurrent create/update clients.
    #[arg(long, env = "SIDE_BY_SIDE_CONCURRENCY", default_value_t = 8)]
    concurrency: usize,
    /// Namespaces the reports are spread over.
    #[arg(long, env = "SIDE_BY_SIDE_NAMESPACES", default_value_t = 30)]
    namespaces: u64,
    /// Watcher counts of the latency phase.
    #[arg(long, env = "SIDE_BY_SIDE_WATCHERS", default_value = "10,100")]
    watchers: String,
    /// The driver's phases (`reports-server bench --phases`). With `--seed`, only reads make
    /// sense: e.g. `raw-list,metadata-list,list`.
    #[arg(
        long,
        env = "SIDE_BY_SIDE_PHASES",
        default_value = "create,update,list,raw-list,metadata-list,kubectl-get,watch-latency"
    )]
    phases: String,
    /// Load the reports directly into our store (the migration's bulk path, `bench --phases
    /// seed`) before the server starts, instead of creating them through the API: sizes that
    /// creating would take hours to reach. Our targets only.
    #[arg(long, env = "SIDE_BY_SIDE_SEED")]
    seed: bool,
    /// Runs of each read phase (the figure is their median).
    #[arg(long, env = "SIDE_BY_SIDE_REPEAT", default_value_t = 3)]
    repeat: usize,
    /// The reports-server binary built with `--features bench` (release), used as the server
    /// and as the benchmark driver.
    #[arg(
        long,
        env = "REPORTS_SERVER_BIN",
        required_unless_present = "summarize_only"
    )]
    server_bin: Option<PathBuf>,
    /// The peer's binary (bench/peer/build.sh prints its path); needed by target peer.
    #[arg(long, env = "REPORTS_SERVER_PEER_BIN")]
    peer_bin: Option<PathBuf>,
    /// Only print the summary of the JSON already in `--out` (no benchmark runs).
    #[arg(long)]
    summarize_only: bool,
    /// The client: `bench` (`reports-server bench`, every phase) or `plain` (creates only, by
    /// bench/plain_creates.py: Python threads that decode nothing, with the CPU per create of
    /// every process, PostgreSQL's included, and our group-commit rounds).
    #[arg(long, env = "SIDE_BY_SIDE_DRIVER", default_value = "bench", value_parser = ["bench", "plain"])]
    driver: String,
    /// Where the JSON of each run and summary.csv go.
    #[arg(
        long,
        env = "SIDE_BY_SIDE_OUT",
        default_value = "docs/bench/side-by-side"
    )]
    out: PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.summarize_only {
        return summary::summarize(&args.out);
    }
    for t in &args.targets {
        ensure!(
            TARGETS.contains(&t.as_str()),
            "unknown target {t:?} (targets: {})",
            TARGETS.join(", ")
        );
    }
    let server_bin = args.server_bin.as_ref().expect("clap requires it");
    ensure!(
        server_bin.exists(),
        "{} does not exist: build it with `cargo build --release --features bench --bin reports-server`",
        server_bin.display()
    );
    if args.targets.iter().any(|t| t == "peer") {
        let peer = args.peer_bin.as_ref().context(
            "target peer needs --peer-bin (or REPORTS_SERVER_PEER_BIN): build it with \
             `bash bench/peer/build.sh <kyverno/reports-server source>`",
        )?;
        ensure!(peer.exists(), "{} does not exist", peer.display());
    }
    if args.seed {
        ensure!(
            args.driver == "bench",
            "--seed reads what it loaded: --driver plain only creates"
        );
        if let Some(t) = args
            .targets
            .iter()
            .find(|t| !t.starts_with("postgres") && !t.starts_with("sqlite"))
        {
            bail!(
                "--seed loads through our store: target {t} has none (postgres, sqlite and their -direct forms do)"
            );
        }
        let phases: Vec<&str> = args.phases.split(',').collect();
        if let Some(p) = ["create", "update", "watch-latency", "rewrite"]
            .into_iter()
            .find(|p| phases.contains(p))
        {
            bail!(
                "--seed measures reads of what it loaded: phase {p} would write through the API \
                 (use e.g. --phases raw-list,metadata-list,list)"
            );
        }
    }
    if args
        .targets
        .iter()
        .any(|t| t.starts_with("postgres") || t == "peer")
        && std::env::var("DATABASE_URL").is_err()
    {
        eprintln!(
            "[side-by-side] DATABASE_URL is not set: PostgreSQL targets use a throw-away cluster \
             with fsync=off (the tests' settings); set DATABASE_URL=postgres://… for a durable one"
        );
    }
    // SAFETY: no other thread exists yet; the harness's server::binary() reads this variable.
    unsafe { std::env::set_var("REPORTS_SERVER_BIN", server_bin) };
    fs::create_dir_all(&args.out)?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(run_all(&args))
}

async fn run_all(args: &Args) -> Result<()> {
    let started = Instant::now();
    for &size in &args.sizes {
        for target in &args.targets {
            let t = Instant::now();
            eprintln!("[side-by-side] {target} at {size} reports");
            let json = match args.driver.as_str() {
                "plain" => args.out.join(format!("{target}-{size}-plain.json")),
                _ => args.out.join(format!("{target}-{size}.json")),
            };
            run_one(args, target, size, &json)
                .await
                .with_context(|| format!("target {target} at {size} reports"))?;
            eprintln!(
                "[side-by-side] {target} at {size} reports done in {:.0?}",
                t.elapsed()
            );
        }
    }
    if args.driver == "bench" {
        summary::summarize(&args.out)?;
    }
    eprintln!("[side-by-side] all done in {:.0?}", started.elapsed());
    Ok(())
}

/// `reports-server bench --phases <phases>`, quiet but for warnings: the driver, the seed and
/// the floor all run it.
fn bench(args: &Args, phases: &str) -> Command {
    let mut cmd = Command::new(args.server_bin.as_ref().expect("checked in main"));
    cmd.args(["bench", "--phases", phases])
        .env("REPORTS_SERVER_LOG", "warn");
    cmd
}

/// The driver's command line for `size` reports, writing `json`.
fn driver(args: &Args, target: &str, size: u64, json: &Path) -> Command {
    let mut cmd = bench(args, &args.phases);
    cmd.args(["--target", target])
        .args(["--reports", &size.to_string()])
        .args(["--namespaces", &args.namespaces.to_string()])
        .args(["--concurrency", &args.concurrency.to_string()])
        .args(["--repeat", &args.repeat.to_string()])
        .args(["--watchers", &args.watchers])
        .arg("--json")
        .arg(json);
    cmd
}

/// bench/plain_creates.py for `size` creates through `kubeconfig`'s kube-apiserver, with the
/// CPU of `pids` (and their descendants) and, for our server, its group-commit rounds.
fn plain_driver(
    args: &Args,
    size: u64,
    json: &Path,
    kubeconfig: &Path,
    pids: &[(String, u32)],
    metrics_url: Option<String>,
) -> Result<Command> {
    let template = json.with_extension("template.json");
    let subject = Subject {
        namespace: "__NAMESPACE__".into(),
        name: "__POD__".into(),
        uid: "__UID__".into(),
    };
    let mut report = serde_json::to_value(pss_policy_report(&subject, 1_700_000_000, &[0, 3]))?;
    report["apiVersion"] = json!("wgpolicyk8s.io/v1alpha2");
    report["kind"] = json!("PolicyReport");
    fs::write(&template, serde_json::to_vec(&report)?)?;
    let mut cmd = Command::new("python3");
    cmd.arg(workspace_root().join("bench/plain_creates.py"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--template")
        .arg(&template)
        .args(["--reports", &size.to_string()])
        .args(["--threads", &args.concurrency.to_string()])
        .args(["--namespaces", &args.namespaces.to_string()])
        .arg("--json")
        .arg(json);
    for (name, pid) in pids {
        cmd.args(["--pid", &format!("{name}={pid}")]);
    }
    if let Some(url) = metrics_url {
        cmd.args(["--metrics-url", &url]);
    }
    Ok(cmd)
}

/// The postmaster of the PostgreSQL cluster `url` names, which must run on this machine: the
/// first line of `postmaster.pid` in its data directory.
fn postmaster_pid(url: &str) -> Result<u32> {
    let dir = psql_value(url, "SHOW data_directory")
        .context("SHOW data_directory needs a superuser or pg_read_all_settings")?;
    let file = Path::new(&dir).join("postmaster.pid");
    let text = fs::read_to_string(&file)
        .with_context(|| format!("reading {} (run as its owner or root)", file.display()))?;
    text.lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .with_context(|| format!("no pid on the first line of {}", file.display()))
}

fn run_driver(mut cmd: Command) -> Result<()> {
    let status = cmd
        .stdin(Stdio::null())
        .status()
        .context("running the benchmark driver")?;
    ensure!(status.success(), "the benchmark driver failed ({status})");
    Ok(())
}

async fn run_one(args: &Args, target: &str, size: u64, json: &Path) -> Result<()> {
    let work = tempfile::Builder::new()
        .prefix(&format!("side-by-side-{target}-"))
        .tempdir()?;
    ensure!(
        args.driver == "bench" || !target.ends_with("-direct"),
        "--driver plain goes through kube-apiserver: target {target} has none"
    );
    if let Some(backend) = target.strip_suffix("-direct") {
        let url = database_url(backend, work.path())?;
        let disk = disk_of(backend, &url, work.path())?;
        if args.seed {
            seed(args, &url, size)?;
        }
        let mut cmd = driver(args, target, size, json);
        cmd.args(["--database-url", &url]);
        run_driver(cmd)?;
        add_disk_figure(json, &disk)?;
        return add_floor_figure(args, &url, json);
    }

    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let admin = Kubectl::new(cp.kubeconfig_path());
    let client = kube_client(cp.kubeconfig_path()).await?;
    let mut pids = vec![
        (
            "kube-apiserver".to_owned(),
            cp.pid(Component::KubeApiserver)?,
        ),
        ("etcd".to_owned(), cp.pid(Component::Etcd)?),
    ];
    // Kept alive until the driver is done.
    let mut ours = None;
    let mut peer = None;
    let mut metrics_url = None;
    let mut floor_url = None;
    let disk = match target {
        "crds" => {
            for file in fs::read_dir(workspace_root().join("crds/upstream"))? {
                let path = file?.path();
                if path.extension().is_some_and(|e| e == "yaml") {
                    admin.run(&["apply", "--server-side", "-f", &path.display().to_string()])?;
                }
            }
            admin.run(&[
                "wait",
                "--for=condition=Established",
                "crd",
                "--all",
                "--timeout=120s",
            ])?;
            Disk::Etcd(cp.dir().join("etcd/member/snap/db"))
        }
        "peer" => {
            let url = postgres::fresh_database()?;
            let disk = disk_of("postgres", &url, work.path())?;
            let p = Peer::start(
                &cp,
                args.peer_bin.as_deref().expect("checked"),
                &url,
                work.path(),
            )
            .await?;
            pids.push(("peer".to_owned(), p.pid()));
            peer = Some(p);
            disk
        }
        backend @ ("postgres" | "sqlite") => {
            let url = database_url(backend, work.path())?;
            let disk = disk_of(backend, &url, work.path())?;
            if args.seed {
                seed(args, &url, size)?;
            }
            floor_url = Some(url.clone());
            let s = Server::start_on(&cp, work.path(), &url, &[]).await?;
            delegated::register_apiservices(&cp, &s, &admin, &client).await?;
            pids.push((
                "reports-server".to_owned(),
                s.pid().context("reports-server is not running")?,
            ));
            metrics_url = Some(format!("{}/metrics", s.url()));
            ours = Some(s);
            disk
        }
        other => bail!("unknown target {other}"),
    };
    if args.driver == "plain" {
        if let Disk::Postgres { url, .. } = &disk {
            pids.push(("postgres".to_owned(), postmaster_pid(url)?));
        }
        let cmd = plain_driver(args, size, json, cp.kubeconfig_path(), &pids, metrics_url)?;
        run_driver(cmd)?;
    } else {
        let mut cmd = driver(args, target, size, json);
        cmd.arg("--kubeconfig").arg(cp.kubeconfig_path());
        for (name, pid) in &pids {
            cmd.args(["--server-pid", &format!("{name}={pid}")]);
        }
        run_driver(cmd)?;
        add_disk_figure(json, &disk)?;
    }
    if ours.is_some() {
        delegated::unregister_apiservices(&cp).await?;
    }
    drop(ours);
    drop(peer);
    cp.stop().await?;
    if let Some(url) = floor_url
        && args.driver == "bench"
    {
        add_floor_figure(args, &url, json)?;
    }
    Ok(())
}

/// Loads `size` reports into the database at `url` through the store, as the migration's
/// import does (`bench --phases seed`), with its progress on stderr.
fn seed(args: &Args, url: &str, size: u64) -> Result<()> {
    let t = Instant::now();
    let mut cmd = bench(args, "seed");
    cmd.args(["--database-url", url])
        .args(["--seed-reports", &size.to_string()])
        .args(["--namespaces", &args.namespaces.to_string()]);
    run_driver(cmd)?;
    eprintln!(
        "[side-by-side] seeded {size} reports in {:.0?}",
        t.elapsed()
    );
    Ok(())
}

/// Adds the database's floor for a full list to a run's JSON: one `SELECT` of every stored body
/// (`bench --phases database-read`), on the run's database once the server has stopped, so that
/// the summary can put each list against what the database alone takes.
fn add_floor_figure(args: &Args, url: &str, json: &Path) -> Result<()> {
    // Not next to an SQLite database, whose directory's size is the disk figure.
    let dir = tempfile::tempdir()?;
    let floor = dir.path().join("floor.json");
    let mut cmd = bench(args, "database-read");
    cmd.args(["--database-url", url])
        .args(["--repeat", &args.repeat.to_string()])
        .arg("--json")
        .arg(&floor);
    run_driver(cmd)?;
    let doc: Value = serde_json::from_slice(&fs::read(&floor)?)?;
    let figures = doc["figures"]
        .as_array()
        .context("the floor's JSON has no figures")?;
    // Only the floor itself: the floor process's own CPU and memory are not the target's.
    let floor = figures
        .iter()
        .filter(|f| f["key"] == "database_read_seconds")
        .cloned();
    push_figures(json, floor)
}

/// Appends figures to a run's JSON.
fn push_figures(json: &Path, figures: impl IntoIterator<Item = Value>) -> Result<()> {
    let mut doc: Value = serde_json::from_slice(&fs::read(json)?)?;
    doc["figures"]
        .as_array_mut()
        .context("the driver's JSON has no figures")?
        .extend(figures);
    fs::write(json, serde_json::to_vec_pretty(&doc)?)?;
    Ok(())
}

fn database_url(backend: &str, dir: &Path) -> Result<String> {
    match backend {
        "postgres" => postgres::fresh_database(),
        "sqlite" => Ok(format!(
            "sqlite://{}?mode=rwc",
            dir.join("reports.db").display()
        )),
        other => bail!("unknown backend {other}"),
    }
}

/// Where a target keeps its data, to measure its size after the run.
enum Disk {
    /// etcd's bbolt database file (its write-ahead log segments are preallocated 64 MB files
    /// whatever they hold, and kube-apiserver compacts history every 5 minutes).
    Etcd(PathBuf),
    /// A database and its size when it was empty (PostgreSQL's catalog of an empty database
    /// takes about 7.6 MB, which is not the target's).
    Postgres {
        url: String,
        empty: u64,
    },
    Sqlite(PathBuf),
}

/// The data of a target on a database made by [`database_url`].
fn disk_of(backend: &str, url: &str, dir: &Path) -> Result<Disk> {
    Ok(match backend {
        "postgres" => Disk::Postgres {
            url: url.to_owned(),
            empty: pg_database_size(url)?,
        },
        _ => Disk::Sqlite(dir.to_owned()),
    })
}

fn pg_database_size(url: &str) -> Result<u64> {
    Ok(psql_value(url, "SELECT pg_database_size(current_database())")?.parse()?)
}

/// The one value `sql` returns on `url`.
fn psql_value(url: &str, sql: &str) -> Result<String> {
    Ok(postgres::psql(url, sql)?.trim().to_owned())
}

impl Disk {
    fn bytes(&self) -> Result<(u64, &'static str)> {
        match self {
            Disk::Etcd(db) => Ok((
                fs::metadata(db)
                    .with_context(|| format!("reading {}", db.display()))?
                    .len(),
                "etcd's database file (member/snap/db)",
            )),
            Disk::Sqlite(dir) => Ok((dir_size(dir)?, "SQLite database, WAL and shared memory")),
            Disk::Postgres { url, empty } => Ok((
                pg_database_size(url)?.saturating_sub(*empty),
                "pg_database_size less that of the empty database",
            )),
        }
    }
}

/// Bytes of the regular files under `dir` (SQLite: the database with its write-ahead log, which
/// keeps its high-water size after checkpoints).
fn dir_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let meta = entry.metadata()?;
        if meta.is_dir() {
            total += dir_size(&entry.path())?;
        } else if meta.is_file() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            // The server's own files next to its SQLite database (certificates, kubeconfig,
            // log) are not data.
            if !name.ends_with(".log") && !name.ends_with(".pem") && name != "kubeconfig" {
                total += meta.len();
            }
        }
    }
    Ok(total)
}

/// Adds the bytes on disk to a run's JSON, as a figure like the driver's.
fn add_disk_figure(json: &Path, disk: &Disk) -> Result<()> {
    let (bytes, what) = disk.bytes()?;
    let doc: Value = serde_json::from_slice(&fs::read(json)?)?;
    let reports = doc["reports"].as_f64().unwrap_or(1.0);
    let mib = bytes as f64 / (1024.0 * 1024.0);
    push_figures(
        json,
        [
            ("disk_mib", mib, "MiB"),
            ("disk_bytes_per_report", bytes as f64 / reports, "bytes"),
        ]
        .map(|(key, value, unit)| {
            json!({
                "key": key, "unit": unit, "median": value, "min": value, "max": value,
                "samples": [value], "detail": what,
            })
        }),
    )?;
    eprintln!("[side-by-side] on disk: {mib:.1} MiB ({what})");
    Ok(())
}

/// kyverno/reports-server as a plain process next to the control plane, on PostgreSQL, with
/// the cluster's admin kubeconfig and a serving certificate from the cluster CA. The harness
/// registers its APIServices (as for ours: an ExternalName Service to localhost, the CA as
/// `caBundle`) after it is up, because it deletes existing ones at start-up; with its
/// `--store*=false` flags it neither rewrites them every 10 s nor copies CRD reports in.
struct Peer {
    child: Child,
}

/// The groups the peer serves, as `(group, version)`.
const PEER_GROUPS: [(&str, &str); 3] = [
    ("wgpolicyk8s.io", "v1alpha2"),
    ("reports.kyverno.io", "v1"),
    ("openreports.io", "v1alpha1"),
];

impl Peer {
    async fn start(cp: &ControlPlane, bin: &Path, database_url: &str, dir: &Path) -> Result<Peer> {
        let db = url_parts(database_url)?;
        let port = server::free_port();
        let probe = ExternalApiService::new(PEER_GROUPS[0].0, PEER_GROUPS[0].1, port);
        let cert = cp
            .issue_serving_cert("peer", &[&probe.server_name(), "localhost", "127.0.0.1"])
            .await?;
        let kubeconfig = cp.kubeconfig_path().display().to_string();
        let log_path = dir.join("peer.log");
        let log = fs::File::create(&log_path)?;
        let mut cmd = Command::new(bin);
        cmd.args([
            format!("--kubeconfig={kubeconfig}"),
            format!("--authentication-kubeconfig={kubeconfig}"),
            format!("--authorization-kubeconfig={kubeconfig}"),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            format!("--tls-cert-file={}", cert.cert_path.display()),
            format!("--tls-private-key-file={}", cert.key_path.display()),
            format!("--servicename={}", probe.service_name),
            format!("--servicens={}", probe.service_namespace),
            "--clusterrolename=".into(),
            "--storereports=false".into(),
            "--storeephemeralreports=false".into(),
            "--storeopenreports=false".into(),
        ])
        .envs([
            ("DB_HOST", db.host.as_str()),
            ("DB_PORT", db.port.as_str()),
            ("DB_DATABASE", db.database.as_str()),
            ("DB_USER", db.user.as_str()),
            // An empty password shifts the peer's connection string (it would connect to the
            // database `postgres`); trust authentication ignores the value.
            ("DB_PASSWORD", db.password.as_deref().unwrap_or("unused")),
        ])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
        let child = spawn_tied_to_test(cmd).context("starting the peer")?;
        let mut peer = Peer { child };
        let started = Instant::now();
        let ready = format!("Serving securely on 127.0.0.1:{port}");
        loop {
            if fs::read_to_string(&log_path)?.contains(&ready) {
                break;
            }
            if let Some(status) = peer.child.try_wait()? {
                bail!("the peer exited with {status}:\n{}", tail(&log_path, 30));
            }
            if started.elapsed() > Duration::from_secs(180) {
                bail!(
                    "the peer did not serve within 180 s:\n{}",
                    tail(&log_path, 30)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for (group, version) in PEER_GROUPS {
            let mut svc = ExternalApiService::new(group, version, port);
            svc.ca_bundle_pem = Some(cp.ca_pem().to_owned());
            cp.register_external_apiservice(&svc).await?;
            cp.wait_apiservice_available(&svc.name(), Duration::from_secs(120))
                .await
                .with_context(|| tail(&log_path, 30))?;
        }
        eprintln!(
            "[side-by-side] peer serving on 127.0.0.1:{port} after {:.1?}",
            started.elapsed()
        );
        Ok(peer)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The parts of a `postgres://user[:password]@host:port/database` URL the peer takes as
/// `DB_*` variables.
struct UrlParts {
    user: String,
    password: Option<String>,
    host: String,
    port: String,
    database: String,
}

fn url_parts(url: &str) -> Result<UrlParts> {
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .with_context(|| format!("{url}: the peer needs a postgres:// URL"))?;
    let (credentials, rest) = rest
        .split_once('@')
        .with_context(|| format!("{url}: no user@ part"))?;
    let (user, password) = match credentials.split_once(':') {
        Some((u, p)) => (u.to_owned(), Some(p.to_owned())),
        None => (credentials.to_owned(), None),
    };
    let (address, database) = rest
        .split_once('/')
        .with_context(|| format!("{url}: no /database part"))?;
    let database = database.split('?').next().unwrap_or_default().to_owned();
    let (host, port) = address
        .rsplit_once(':')
        .map(|(h, p)| (h.to_owned(), p.to_owned()))
        .unwrap_or_else(|| (address.to_owned(), "5432".to_owned()));
    Ok(UrlParts {
        user,
        password,
        host,
        port,
        database,
    })
}
