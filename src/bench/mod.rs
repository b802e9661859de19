//! `reports-server bench`: figures of a reports API driven by the kube-rs client over HTTPS
//! exactly as a real client would — a fresh standalone server in this process by default, or
//! whatever API a `--kubeconfig` names (kube-apiserver serving the report CRDs from etcd, the
//! peer or this server behind the aggregation layer). Prints figures (and writes them as JSON
//! with `--json`); asserts only correctness (every object listed exactly once, every watcher
//! receives every event), never speed.
//!
//! Phases (`--phases`, comma-separated, run in this order):
//! - `seed` (in-process server only): `--seed-reports` reports loaded in bulk through the store
//!   (as the migration imports), for the read phases to run at a size the API would take long
//!   to create; the read phases then expect them too;
//! - `create`: `--reports` Pod Security Standards reports through the API;
//! - `update`: each created report replaced once (another rule failing), with its
//!   resourceVersion, as Kyverno updates a report;
//! - `list`: a paginated list of everything (`--repeat` times);
//! - `raw-list`: the same pages read as bytes, parsing only each item's name and the
//!   `continue` token: what the server and the wire cost, without a client building 10,000
//!   typed objects (kube-rs decoding a full list costs about as much as serving it);
//! - `bytes-list`: the same pages taken as bytes and dropped, nothing parsed but the list's
//!   own `metadata` (for the `continue` token): what the server and the wire cost, like for
//!   like with `database-read`, which parses no body either; checks the number of pages;
//! - `database-read` (in-process server only): every stored body read with one `SELECT`
//!   through the server's own connection pool and decoded as a list decodes it (decompressed on
//!   SQLite; PostgreSQL decompresses inside the database) — the floor a full list is compared
//!   with;
//! - `metadata-list`: the same as `PartialObjectMetadataList` (what metadata informers and
//!   garbage collection read);
//! - `kubectl-get`: `kubectl get polr -A`, a Table list in kubectl's chunks of 500;
//! - `watcher-sync`: a kube-rs watcher's initial list;
//! - `watch-latency`: for each count in `--watchers`, that many concurrent watches while
//!   `--write-rate` creates per second run for `--write-seconds`; the latency of each event
//!   from the moment its write was sent (stamped into the object) to its arrival at each
//!   watcher;
//! - `rewrite`: one `--rewrite-results`-result report per namespace replaced at
//!   `--rewrite-rate` per second, one result changed each time: the database work per update
//!   (WAL and rows touched on PostgreSQL, bytes written on SQLite) against the report's size;
//! - `rss` (in-process server only): `--rss-reports` reports loaded in bulk through the store,
//!   then the process's resident memory (`VmRSS`, peak `VmHWM` from `/proc/self/status`) idle
//!   and after a full paginated list.
//!
//! With `--server-pid name=PID` the peak RSS and the CPU time of those processes (a server
//! behind a kubeconfig: kube-apiserver, etcd, the peer, ours) are read from `/proc` per phase.

mod figures;
mod load;
mod reads;
mod rewrite;
mod rss;
mod watch_latency;

pub(crate) use figures::memory;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use figures::{Figures, Processes, load_average, mb};
use futures::{StreamExt, TryStreamExt};
use kube::api::Api;
use load::{create, ensure_namespaces, update};
use reads::{
    kubectl_get_all, list_all, list_bytes_all, list_metadata_all, list_raw_all, read_every_body,
};
use reports_server_apiserver::http::ApiOptions;
use reports_server_apiserver::startup::{self, RunningServer, ServerConfig};
use reports_server_apiserver::store::StoreOptions;
use reports_server_crds::PolicyReport;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use rss::{bulk_load, rss};
use serde_json::json;
use watch_latency::{latency_namespace, watch_latency};

/// Every phase, in the order they run.
const PHASES: [&str; 13] = [
    "seed",
    "create",
    "update",
    "list",
    "raw-list",
    "bytes-list",
    "database-read",
    "metadata-list",
    "kubectl-get",
    "watcher-sync",
    "watch-latency",
    "rewrite",
    "rss",
];

#[derive(Args)]
pub struct BenchArgs {
    /// Phases to run, comma-separated (`all`: every phase but seed): seed, create, update, list, raw-list, database-read,
    /// metadata-list, kubectl-get, watcher-sync, watch-latency, rewrite, rss, or all.
    #[arg(
        long,
        env = "REPORTS_SERVER_BENCH_PHASES",
        value_delimiter = ',',
        default_value = "create,list,watcher-sync"
    )]
    phases: Vec<String>,
    /// Drive the API this kubeconfig names instead of a fresh server in this process: kube-apiserver
    /// serving the report CRDs, the peer or this server behind the aggregation layer. The
    /// namespaces the reports go to are created first. Phase rss and the storage figure need the
    /// in-process server.
    #[arg(long, env = "REPORTS_SERVER_BENCH_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Number of ~9 KB Pod Security Standards reports to create (phase create).
    #[arg(long, env = "REPORTS_SERVER_BENCH_REPORTS", default_value_t = 10_000)]
    reports: u64,
    /// Namespaces to spread them over.
    #[arg(long, env = "REPORTS_SERVER_BENCH_NAMESPACES", default_value_t = 10)]
    namespaces: u64,
    /// Concurrent create and update requests.
    #[arg(long, env = "REPORTS_SERVER_BENCH_CONCURRENCY", default_value_t = 16)]
    concurrency: usize,
    /// Page size of the paginated lists.
    #[arg(long, env = "REPORTS_SERVER_BENCH_PAGE_SIZE", default_value_t = 500)]
    page_size: u32,
    /// How many times each read phase (list, metadata-list, kubectl-get) runs; the figure is the
    /// median, with the spread.
    #[arg(long, env = "REPORTS_SERVER_BENCH_REPEAT", default_value_t = 3)]
    repeat: usize,
    /// Concurrent watchers (phase watch-latency); a comma-separated list runs the phase once per
    /// count.
    #[arg(
        long,
        env = "REPORTS_SERVER_BENCH_WATCHERS",
        value_delimiter = ',',
        default_value = "100"
    )]
    watchers: Vec<usize>,
    /// Steady write load while the watchers run, in creates per second (phase watch-latency).
    #[arg(long, env = "REPORTS_SERVER_BENCH_WRITE_RATE", default_value_t = 200)]
    write_rate: u32,
    /// How long the write load runs, in seconds (phase watch-latency).
    #[arg(long, env = "REPORTS_SERVER_BENCH_WRITE_SECONDS", default_value_t = 10)]
    write_seconds: u64,
    /// Write whole ~9 KB reports in the latency load (what Kyverno writes) instead of small
    /// ones: the fan-out then costs what it costs in a cluster.
    #[arg(long, env = "REPORTS_SERVER_BENCH_LATENCY_FULL_REPORTS")]
    latency_full_reports: bool,
    /// Reports loaded in bulk through the store before the other phases (phase seed).
    #[arg(
        long,
        env = "REPORTS_SERVER_BENCH_SEED_REPORTS",
        default_value_t = 100_000
    )]
    seed_reports: u64,
    /// Reports rewritten, one per namespace (phase rewrite).
    #[arg(
        long,
        env = "REPORTS_SERVER_BENCH_REWRITE_REPORTS",
        default_value_t = 10
    )]
    rewrite_reports: usize,
    /// Results of each rewritten report (phase rewrite).
    #[arg(
        long,
        env = "REPORTS_SERVER_BENCH_REWRITE_RESULTS",
        default_value_t = 1_000
    )]
    rewrite_results: usize,
    /// Updates per second of the rewritten reports, in all (phase rewrite).
    #[arg(long, env = "REPORTS_SERVER_BENCH_REWRITE_RATE", default_value_t = 50)]
    rewrite_rate: u32,
    /// How long the updates run, in seconds (phase rewrite).
    #[arg(
        long,
        env = "REPORTS_SERVER_BENCH_REWRITE_SECONDS",
        default_value_t = 20
    )]
    rewrite_seconds: u64,
    /// Reports loaded before measuring memory (phase rss).
    #[arg(
        long,
        env = "REPORTS_SERVER_BENCH_RSS_REPORTS",
        default_value_t = 100_000
    )]
    rss_reports: u64,
    /// Database of the in-process server [default: a fresh SQLite file in a temporary
    /// directory]. Reports already stored there count in lists (a list must hold at least what
    /// this run wrote): seed once, then measure the read phases again and again.
    #[arg(long, env = "REPORTS_SERVER_BENCH_DATABASE_URL")]
    database_url: Option<String>,
    /// The in-process server's `--group-commit-max-writes` (1: one write per transaction, as
    /// before group commit).
    #[arg(
        long,
        env = "REPORTS_SERVER_GROUP_COMMIT_MAX_WRITES",
        default_value_t = 256
    )]
    group_commit_max_writes: usize,
    /// Processes whose peak RSS and CPU time to report, as `name=PID` (repeatable), e.g. the
    /// server and kube-apiserver behind `--kubeconfig`. The in-process server is always
    /// measured as `bench`.
    #[arg(long = "server-pid", value_parser = parse_named_pid)]
    server_pids: Vec<(String, u32)>,
    /// Name of the target in the printed table and the JSON (e.g. `peer-postgres`).
    #[arg(
        long,
        env = "REPORTS_SERVER_BENCH_TARGET",
        default_value = "reports-server"
    )]
    target: String,
    /// Also write every figure, with its samples, as JSON to this file.
    #[arg(long, env = "REPORTS_SERVER_BENCH_JSON")]
    json: Option<PathBuf>,
}

fn parse_named_pid(s: &str) -> Result<(String, u32), String> {
    let (name, pid) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected name=PID, e.g. kube-apiserver=1234"))?;
    let pid = pid
        .parse()
        .map_err(|_| format!("{s:?}: {pid:?} is not a process id"))?;
    Ok((name.to_owned(), pid))
}

/// A fresh standalone server for a benchmark, in this process: on `database_url`, else on a new
/// SQLite file in `dir`; and a kube-rs client for it.
pub(crate) async fn start_server(
    dir: &Path,
    database_url: Option<&str>,
    group_commit_max_writes: Option<usize>,
) -> anyhow::Result<(RunningServer, kube::Client)> {
    let url = database_url.map_or_else(
        || format!("sqlite://{}?mode=rwc", dir.join("bench.db").display()),
        str::to_owned,
    );
    let mut store = StoreOptions::new(url);
    if let Some(max) = group_commit_max_writes {
        store.group_commit_max_writes = max.max(1);
    }
    let server = startup::start(ServerConfig {
        data_dir: dir.to_owned(),
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        store,
        api: ApiOptions::default(),
        kubeconfig: dir.join("kubeconfig"),
        auth: Default::default(),
        serving: None,
        serving_reload: None,
        serving_names: Vec::new(),
        connections: Default::default(),
    })
    .await?;
    let client = crate::client_from_kubeconfig(&server.kubeconfig).await?;
    Ok((server, client))
}

fn selected(args: &BenchArgs) -> anyhow::Result<Vec<&'static str>> {
    let wanted: Vec<String> = args.phases.iter().map(|p| p.trim().to_owned()).collect();
    for p in &wanted {
        if p != "all" && !PHASES.contains(&p.as_str()) {
            bail!(
                "unknown phase {p:?} (phases: {}, or all)",
                PHASES.join(", ")
            );
        }
    }
    let phases: Vec<&'static str> = PHASES
        .into_iter()
        // `all` leaves out seed: it changes what the read phases read.
        .filter(|p| {
            wanted
                .iter()
                .any(|w| w == p || (w == "all" && *p != "seed"))
        })
        .collect();
    for store_phase in ["rss", "seed"] {
        if args.kubeconfig.is_some() && phases.contains(&store_phase) {
            bail!(
                "phase {store_phase} loads reports through the in-process server's store; it \
                 cannot run against --kubeconfig (measure that server with --server-pid name=PID \
                 instead)"
            );
        }
    }
    if phases.contains(&"update") && !phases.contains(&"create") {
        bail!("phase update replaces the reports phase create made: run both");
    }
    Ok(phases)
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let phases = selected(&args)?;
    let dir = tempfile::tempdir()?;
    let baseline = memory()?;
    let (client, kubeconfig, server) = connect(&args, &phases, dir.path()).await?;
    let mut pids = args.server_pids.clone();
    if server.is_some() {
        pids.push(("bench".to_owned(), std::process::id()));
    }
    let mut processes = Processes::new(pids)?;
    let load_before = load_average();
    let sample = serde_json::to_vec(&pss_policy_report(
        &Subject::pod("ns-0", 0),
        1_700_000_000,
        &[1, 7],
    ))?
    .len();
    let mut bench = Run {
        args: &args,
        api: Api::all(client.clone()),
        client,
        kubeconfig,
        server: server.as_ref(),
        sample,
        baseline,
        figures: Figures::default(),
        created: Vec::new(),
        seeded: 0,
        listed: None,
    };
    for phase in &phases {
        bench.phase(phase).await?;
        processes.phase_done(phase, &mut bench.figures)?;
    }
    processes.peaks(&mut bench.figures)?;
    bench.report(load_before)?;
    if let Some(s) = server {
        s.shutdown().await;
    }
    Ok(())
}

/// The API to drive: the one `--kubeconfig` names (its namespaces made ready), or a fresh
/// standalone server in this process. Prints what it is.
async fn connect(
    args: &BenchArgs,
    phases: &[&str],
    dir: &Path,
) -> anyhow::Result<(kube::Client, PathBuf, Option<RunningServer>)> {
    let (client, kubeconfig, server, kind) = match &args.kubeconfig {
        Some(path) => {
            let client = crate::client_from_kubeconfig(path).await?;
            let mut names: Vec<String> = (0..args.namespaces).map(|i| format!("ns-{i}")).collect();
            names.extend((0..args.watchers.len()).map(latency_namespace));
            ensure_namespaces(&client, &names).await?;
            let kind = format!("the API of kubeconfig {}", path.display());
            (client, path.clone(), None, kind)
        }
        None => {
            let (s, client) = start_server(
                dir,
                args.database_url.as_deref(),
                Some(args.group_commit_max_writes),
            )
            .await?;
            let kind = format!(
                "in-process server on {:?} ({})",
                s.store.backend(),
                if args.database_url.is_some() {
                    "given URL"
                } else {
                    "temporary SQLite file"
                }
            );
            (client, s.kubeconfig.clone(), Some(s), kind)
        }
    };
    println!(
        "target {}: {kind}; {} build; phases: {}",
        args.target,
        build_kind(),
        phases.join(",")
    );
    Ok((client, kubeconfig, server))
}

fn build_kind() -> &'static str {
    if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    }
}

/// One bench run: what its phases share.
struct Run<'a> {
    args: &'a BenchArgs,
    client: kube::Client,
    api: Api<PolicyReport>,
    kubeconfig: PathBuf,
    /// The in-process server, when no `--kubeconfig` was given.
    server: Option<&'a RunningServer>,
    /// Bytes of one report's JSON as a client sends it.
    sample: usize,
    /// This process's memory before the server started.
    baseline: (u64, u64),
    figures: Figures,
    created: Created,
    /// Reports the seed phase loaded.
    seeded: usize,
    listed: Option<usize>,
}

impl Run<'_> {
    async fn phase(&mut self, phase: &str) -> anyhow::Result<()> {
        let args = self.args;
        match phase {
            "create" => self.create().await,
            "update" => {
                let secs = update(args, &self.client, &self.created).await?;
                self.figures.add(
                    "update_per_s",
                    format!("update ({} concurrent)", args.concurrency),
                    "reports/s",
                    &[self.created.len() as f64 / secs],
                    &format!("{secs:.1} s for {}", self.created.len()),
                );
                Ok(())
            }
            "list" | "raw-list" | "metadata-list" | "kubectl-get" => self.list(phase).await,
            "bytes-list" => self.bytes_list().await,
            "database-read" => {
                let s = self
                    .server
                    .context("phase database-read needs the in-process server")?;
                let (samples, read) = repeated(args.repeat, || read_every_body(&s.store)).await?;
                self.figures.add(
                    "database_read_seconds",
                    "SELECT every stored body (the database's floor for a full list)",
                    "s",
                    &samples,
                    &format!("{} bodies, {} of JSON", read.0, mb(read.1)),
                );
                Ok(())
            }
            "watcher-sync" => self.watcher_sync().await,
            "watch-latency" => {
                for run in 0..args.watchers.len() {
                    watch_latency(args, &self.client, run, &mut self.figures).await?;
                }
                Ok(())
            }
            "seed" => {
                let s = self
                    .server
                    .context("phase seed loads through the in-process server's store")?;
                let total = args.seed_reports;
                println!("seed: loading {total} reports through the store");
                let secs = bulk_load(&s.store, total, args.namespaces, "seed").await?;
                self.seeded = total as usize;
                self.figures.add(
                    "seed_per_s",
                    format!("bulk load of {total} reports through the store (seed phase)"),
                    "reports/s",
                    &[total as f64 / secs],
                    &format!("{secs:.0} s"),
                );
                Ok(())
            }
            "rewrite" => rewrite::rewrite(args, &self.client, self.server, &mut self.figures).await,
            "rss" => {
                let s = self
                    .server
                    .context("phase rss needs the in-process server")?;
                rss(
                    args,
                    &s.store,
                    &self.client,
                    self.baseline,
                    &mut self.figures,
                )
                .await
            }
            other => unreachable!("phase {other} is not in PHASES"),
        }
    }

    async fn create(&mut self) -> anyhow::Result<()> {
        let args = self.args;
        let (secs, versions) = create(args, &self.client, self.sample).await?;
        self.created = versions;
        self.figures.add(
            "create_per_s",
            format!("create ({} concurrent)", args.concurrency),
            "reports/s",
            &[args.reports as f64 / secs],
            &format!("{secs:.1} s for {}", args.reports),
        );
        // What the store keeps per report, against the JSON a client sent.
        if let Some(s) = self.server
            && let Some(bytes) = s.store.storage_bytes().await?
        {
            let per_report = bytes as f64 / args.reports as f64;
            self.figures.add(
                "stored_bytes_per_report",
                "stored (tables + indexes) per report",
                "bytes",
                &[per_report],
                &format!(
                    "{} in all, {:.2}x the report's JSON",
                    mb(bytes),
                    per_report / self.sample as f64
                ),
            );
        }
        Ok(())
    }

    /// The objects this run wrote (created or seeded), which a list must return, and whether
    /// the API may hold more: behind a kubeconfig, or on a given database (e.g. seeded by an
    /// earlier run).
    fn expected_objects(&self) -> (usize, bool) {
        let shared = self.args.kubeconfig.is_some() || self.args.database_url.is_some();
        (self.created.len() + self.seeded, shared)
    }

    /// The list phases: each pass reads everything, and must see every created object once.
    async fn list(&mut self, phase: &str) -> anyhow::Result<()> {
        let (args, (created, shared)) = (self.args, self.expected_objects());
        let (api, client, kubeconfig) = (&self.api, &self.client, &self.kubeconfig);
        let (samples, (n, pages)) = repeated(args.repeat, || async {
            let (n, pages) = match phase {
                "list" => list_all(api, args.page_size).await?,
                "raw-list" => (list_raw_all(client, args.page_size).await?, 0),
                "metadata-list" => (list_metadata_all(api, args.page_size).await?, 0),
                _ => (kubectl_get_all(kubeconfig).await?, 0),
            };
            check_count(phase, n, created, shared)?;
            Ok((n, pages))
        })
        .await?;
        let (key, label, detail) = match phase {
            "list" => {
                self.listed = Some(n);
                (
                    "list_seconds",
                    format!("paginated list (limit={})", args.page_size),
                    format!("{n} objects in {pages} pages"),
                )
            }
            "raw-list" => (
                "raw_list_seconds",
                format!(
                    "paginated list read as bytes, names parsed (limit={})",
                    args.page_size
                ),
                format!("{n} objects"),
            ),
            "metadata-list" => (
                "metadata_list_seconds",
                format!("metadata-only paginated list (limit={})", args.page_size),
                format!("{n} objects"),
            ),
            _ => (
                "kubectl_get_seconds",
                "kubectl get polr -A".to_owned(),
                format!("{n} rows"),
            ),
        };
        self.figures.add(key, label, "s", &samples, &detail);
        Ok(())
    }

    /// Phase `bytes-list`: every page as bytes, and the number of pages a list of what this run
    /// wrote takes (at least that many when the API may hold more, unless it answered in one
    /// page: the peer ignores `limit`).
    async fn bytes_list(&mut self) -> anyhow::Result<()> {
        let (args, (created, shared)) = (self.args, self.expected_objects());
        let expected = match args.page_size {
            0 => 1,
            size => created.div_ceil(size as usize).max(1),
        };
        let (samples, (pages, bytes)) = repeated(args.repeat, || async {
            let (pages, bytes) = list_bytes_all(&self.client, args.page_size).await?;
            let plausible = pages == expected || (shared && (pages == 1 || pages > expected));
            if !plausible {
                bail!("bytes-list took {pages} pages, {expected} expected for {created} objects");
            }
            Ok((pages, bytes))
        })
        .await?;
        self.figures.add(
            "bytes_list_seconds",
            format!(
                "paginated list taken as bytes, nothing parsed (limit={})",
                args.page_size
            ),
            "s",
            &samples,
            &format!("{pages} pages, {}", mb(bytes)),
        );
        Ok(())
    }

    /// A watchlist-style pass: how fast a full relist through a reflector runs.
    async fn watcher_sync(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        let relisted = kube::runtime::watcher(self.api.clone(), Default::default())
            .take_while(|e| {
                futures::future::ready(!matches!(e, Ok(kube::runtime::watcher::Event::InitDone)))
            })
            .try_fold(0usize, |n, e| async move {
                Ok(n + matches!(e, kube::runtime::watcher::Event::InitApply(_)) as usize)
            });
        let relisted = tokio::time::timeout(Duration::from_secs(600), relisted)
            .await
            .context("watcher initial list timed out")??;
        let secs = started.elapsed().as_secs_f64();
        self.figures.add(
            "watcher_sync_per_s",
            "kube-rs watcher initial sync",
            "reports/s",
            &[relisted as f64 / secs],
            &format!("{relisted} objects, {secs:.2} s"),
        );
        Ok(())
    }

    /// Prints the figures as a Markdown table and writes them as JSON with `--json`.
    fn report(&mut self, load_before: f64) -> anyhow::Result<()> {
        let args = self.args;
        let load_after = load_average();
        self.figures.note(
            "machine load (1-minute average) before and after",
            format!("{load_before:.2}, {load_after:.2}"),
        );
        println!("| measurement ({}) | value |", args.target);
        println!("|---|---|");
        for (k, v) in &self.figures.rows {
            println!("| {k} | {v} |");
        }
        if let Some(n) = self.listed {
            println!(
                "every object listed exactly once: yes ({n} of {})",
                self.expected_objects().0
            );
        }
        if let Some(path) = &args.json {
            let doc = json!({
                "target": args.target,
                "reports": args.reports,
                "report_json_bytes": self.sample,
                "concurrency": args.concurrency,
                "page_size": args.page_size,
                "build": build_kind(),
                "load_average_before": load_before,
                "load_average_after": load_after,
                "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
                "figures": self.figures.json,
            });
            std::fs::write(path, serde_json::to_vec_pretty(&doc)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

/// Runs a read phase's pass `repeat` times (at least once): the wall time of each pass, and
/// what the last one returned.
async fn repeated<T, F, Fut>(repeat: usize, mut pass: F) -> anyhow::Result<(Vec<f64>, T)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut samples = Vec::new();
    let mut last = None;
    for _ in 0..repeat.max(1) {
        let started = Instant::now();
        last = Some(pass().await?);
        samples.push(started.elapsed().as_secs_f64());
    }
    Ok((samples, last.expect("at least one pass")))
}

/// A list must return what this run created; against a kubeconfig other objects may exist too
/// (a cluster's own reports), so there it must return at least as many.
fn check_count(what: &str, got: usize, created: usize, shared: bool) -> anyhow::Result<()> {
    if got == created || (shared && got > created) {
        Ok(())
    } else {
        bail!("{what} returned {got} objects, this run created {created}")
    }
}

/// (namespace, name, resourceVersion) of each created report.
type Created = Vec<(String, String, String)>;
