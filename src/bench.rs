//! `reports-server bench`: figures of a reports API driven by the kube-rs client over HTTPS
//! exactly as a real client would — a fresh standalone server in this process by default, or
//! whatever API a `--kubeconfig` names (kube-apiserver serving the report CRDs from etcd, the
//! peer or this server behind the aggregation layer). Prints figures (and writes them as JSON
//! with `--json`); asserts only correctness (every object listed exactly once, every watcher
//! receives every event), never speed.
//!
//! Phases (`--phases`, comma-separated, run in this order):
//! - `create`: `--reports` Pod Security Standards reports through the API;
//! - `update`: each created report replaced once (another rule failing), with its
//!   resourceVersion, as Kyverno updates a report;
//! - `list`: a paginated list of everything (`--repeat` times);
//! - `raw-list`: the same pages read as bytes, parsing only each item's name and the
//!   `continue` token: what the server and the wire cost, without a client building 10,000
//!   typed objects (kube-rs decoding a full list costs about as much as serving it);
//! - `database-read` (in-process server only): every stored body read with one `SELECT`
//!   through the server's own connection pool — the floor a full list is compared with;
//! - `metadata-list`: the same as `PartialObjectMetadataList` (what metadata informers and
//!   garbage collection read);
//! - `kubectl-get`: `kubectl get polr -A`, a Table list in kubectl's chunks of 500;
//! - `watcher-sync`: a kube-rs watcher's initial list;
//! - `watch-latency`: for each count in `--watchers`, that many concurrent watches while
//!   `--write-rate` creates per second run for `--write-seconds`; the latency of each event
//!   from the moment its write was sent (stamped into the object) to its arrival at each
//!   watcher;
//! - `rss` (in-process server only): `--rss-reports` reports loaded in bulk through the store,
//!   then the process's resident memory (`VmRSS`, peak `VmHWM` from `/proc/self/status`) idle
//!   and after a full paginated list.
//!
//! With `--server-pid name=PID` the peak RSS and the CPU time of those processes (a server
//! behind a kubeconfig: kube-apiserver, etcd, the peer, ours) are read from `/proc` per phase.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use clap::Args;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use reports_server_apiserver::http::ApiOptions;
use reports_server_apiserver::registry::stamp_new;
use reports_server_apiserver::startup::{self, RunningServer, ServerConfig};
use reports_server_apiserver::store::{Store, StoreOptions};
use reports_server_crds::PolicyReport;
use reports_server_crds::catalog::POLICY_REPORT;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use serde_json::json;

/// Every phase, in the order they run.
const PHASES: [&str; 10] = [
    "create",
    "update",
    "list",
    "raw-list",
    "database-read",
    "metadata-list",
    "kubectl-get",
    "watcher-sync",
    "watch-latency",
    "rss",
];

/// The annotation carrying the moment a latency write was sent (nanoseconds since the epoch).
const SENT_AT: &str = "bench.reports-server.io/sent-at-ns";

/// Linux reports `utime`/`stime` in `/proc/<pid>/stat` in USER_HZ, 100 on every architecture
/// the ABI fixes it for (x86, arm64).
const USER_HZ: f64 = 100.0;

#[derive(Args)]
pub struct BenchArgs {
    /// Phases to run, comma-separated: create, update, list, raw-list, database-read,
    /// metadata-list, kubectl-get, watcher-sync, watch-latency, rss, or all.
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
    /// Reports loaded before measuring memory (phase rss).
    #[arg(
        long,
        env = "REPORTS_SERVER_BENCH_RSS_REPORTS",
        default_value_t = 100_000
    )]
    rss_reports: u64,
    /// Database of the in-process server [default: a fresh SQLite file in a temporary
    /// directory].
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
        .filter(|p| wanted.iter().any(|w| w == "all" || w == p))
        .collect();
    if args.kubeconfig.is_some() && wanted.iter().any(|w| w == "rss") {
        bail!(
            "phase rss loads reports through the in-process server's store; it cannot run against \
             --kubeconfig (measure that server with --server-pid name=PID instead)"
        );
    }
    if phases.contains(&"update") && !phases.contains(&"create") {
        bail!("phase update replaces the reports phase create made: run both");
    }
    Ok(phases)
}

/// The figures of one run: printed as a Markdown table, written as JSON with `--json`.
#[derive(Default)]
struct Figures {
    rows: Vec<(String, String)>,
    json: Vec<serde_json::Value>,
}

impl Figures {
    /// A figure with text only (no number to compare).
    fn note(&mut self, label: impl Into<String>, text: impl Into<String>) {
        self.rows.push((label.into(), text.into()));
    }

    /// A measured figure: `samples` of one quantity in `unit`; the table shows the median and
    /// the spread, then `detail`.
    fn add(
        &mut self,
        key: &str,
        label: impl Into<String>,
        unit: &str,
        samples: &[f64],
        detail: &str,
    ) {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let median = median(&sorted);
        let (min, max) = (sorted[0], sorted[sorted.len() - 1]);
        let spread = if sorted.len() > 1 {
            format!(" ({} to {}, {} runs)", num(min), num(max), sorted.len())
        } else {
            String::new()
        };
        let sep = if detail.is_empty() { "" } else { "; " };
        self.rows.push((
            label.into(),
            format!("{} {unit}{spread}{sep}{detail}", num(median)),
        ));
        self.json.push(json!({
            "key": key, "unit": unit, "median": median, "min": min, "max": max,
            "samples": samples, "detail": detail,
        }));
    }
}

fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Three significant figures at most, no exponent.
fn num(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The processes being measured and their CPU time at the start of the current phase.
struct Processes {
    pids: Vec<(String, u32)>,
    cpu_at_phase_start: Vec<f64>,
}

impl Processes {
    fn new(pids: Vec<(String, u32)>) -> anyhow::Result<Self> {
        let cpu_at_phase_start = pids
            .iter()
            .map(|(_, pid)| cpu_seconds(*pid))
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            pids,
            cpu_at_phase_start,
        })
    }

    /// Records each process's CPU seconds since the previous call as figures of `phase`.
    fn phase_done(&mut self, phase: &str, figures: &mut Figures) -> anyhow::Result<()> {
        for (i, (name, pid)) in self.pids.iter().enumerate() {
            let now = cpu_seconds(*pid)?;
            let used = now - self.cpu_at_phase_start[i];
            self.cpu_at_phase_start[i] = now;
            figures.add(
                &format!("cpu_seconds.{phase}.{name}"),
                format!("CPU of {name} during {phase}"),
                "s",
                &[used],
                "",
            );
        }
        Ok(())
    }

    fn peaks(&self, figures: &mut Figures) -> anyhow::Result<()> {
        for (name, pid) in &self.pids {
            let (rss, hwm) = memory_of(&pid.to_string())?;
            figures.add(
                &format!("peak_rss_mib.{name}"),
                format!("peak RSS of {name} (VmHWM)"),
                "MiB",
                &[hwm as f64 / MIB],
                &format!("{:.0} MiB at the end", rss as f64 / MIB),
            );
        }
        Ok(())
    }
}

const MIB: f64 = 1024.0 * 1024.0;

/// User plus system CPU time of a process (all its threads, live and exited), in seconds.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat (is process {pid} running?)"))?;
    // The command name (field 2) may hold spaces; the fields after its closing parenthesis are
    // fixed: state is field 3, utime field 14, stime field 15.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .with_context(|| format!("cannot parse /proc/{pid}/stat"))?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<f64> {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .with_context(|| format!("cannot parse /proc/{pid}/stat"))
    };
    Ok((ticks(11)? + ticks(12)?) / USER_HZ)
}

/// The 1-minute load average, as a record of how busy the machine was.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Creates the namespaces the reports go to (kube-apiserver refuses namespaced custom
/// resources in a namespace that does not exist); one that exists already is fine, and a
/// server that serves no namespaces at all (a standalone reports-server, which needs none) is
/// left as it is.
async fn ensure_namespaces(client: &kube::Client, names: &[String]) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    for name in names {
        let ns = Namespace {
            metadata: kube::api::ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {
                println!(
                    "the server serves no namespaces (a standalone reports-server): none created"
                );
                return Ok(());
            }
            Err(e) => {
                return Err(e).with_context(|| format!("creating namespace {name}"));
            }
        }
    }
    Ok(())
}

#[allow(
    clippy::too_many_lines,
    reason = "development-only load generator; to split (issue 34)"
)]
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let phases = selected(&args)?;
    let dir = tempfile::tempdir()?;
    let baseline = memory()?;
    let mut server = None;
    let (client, kubeconfig, target_kind) = match &args.kubeconfig {
        Some(path) => (
            crate::client_from_kubeconfig(path).await?,
            path.clone(),
            format!("the API of kubeconfig {}", path.display()),
        ),
        None => {
            let (s, client) = start_server(
                dir.path(),
                args.database_url.as_deref(),
                Some(args.group_commit_max_writes),
            )
            .await?;
            let kubeconfig = s.kubeconfig.clone();
            let kind = format!(
                "in-process server on {:?} ({})",
                s.store.backend(),
                if args.database_url.is_some() {
                    "given URL"
                } else {
                    "temporary SQLite file"
                }
            );
            server = Some(s);
            (client, kubeconfig, kind)
        }
    };
    println!(
        "target {}: {target_kind}; {} build; phases: {}",
        args.target,
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        phases.join(",")
    );
    if args.kubeconfig.is_some() {
        let mut names: Vec<String> = (0..args.namespaces).map(|i| format!("ns-{i}")).collect();
        names.extend((0..args.watchers.len()).map(latency_namespace));
        ensure_namespaces(&client, &names).await?;
    }
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
    let mut figures = Figures::default();
    let mut created = Vec::new();
    let mut listed = None;
    let api: Api<PolicyReport> = Api::all(client.clone());

    for phase in &phases {
        match *phase {
            "create" => {
                let (secs, versions) = create(&args, &client, sample).await?;
                created = versions;
                figures.add(
                    "create_per_s",
                    format!("create ({} concurrent)", args.concurrency),
                    "reports/s",
                    &[args.reports as f64 / secs],
                    &format!("{secs:.1} s for {}", args.reports),
                );
                // What the store keeps per report, against the JSON a client sent.
                if let Some(s) = &server
                    && let Some(bytes) = s.store.storage_bytes().await?
                {
                    let per_report = bytes as f64 / args.reports as f64;
                    figures.add(
                        "stored_bytes_per_report",
                        "stored (tables + indexes) per report",
                        "bytes",
                        &[per_report],
                        &format!(
                            "{} in all, {:.2}x the report's JSON",
                            mb(bytes),
                            per_report / sample as f64
                        ),
                    );
                }
            }
            "update" => {
                let secs = update(&args, &client, &created).await?;
                figures.add(
                    "update_per_s",
                    format!("update ({} concurrent)", args.concurrency),
                    "reports/s",
                    &[created.len() as f64 / secs],
                    &format!("{secs:.1} s for {}", created.len()),
                );
            }
            "list" => {
                let (samples, (n, pages)) = repeated(args.repeat, || async {
                    let (n, pages) = list_all(&api, args.page_size).await?;
                    check_count("list", n, created.len(), args.kubeconfig.is_some())?;
                    Ok((n, pages))
                })
                .await?;
                listed = Some(n);
                figures.add(
                    "list_seconds",
                    format!("paginated list (limit={})", args.page_size),
                    "s",
                    &samples,
                    &format!("{} objects in {pages} pages", listed.unwrap_or(0)),
                );
            }
            "raw-list" => {
                let (samples, n) = repeated(args.repeat, || async {
                    let n = list_raw_all(&client, args.page_size).await?;
                    check_count("raw-list", n, created.len(), args.kubeconfig.is_some())?;
                    Ok(n)
                })
                .await?;
                figures.add(
                    "raw_list_seconds",
                    format!(
                        "paginated list read as bytes, names parsed (limit={})",
                        args.page_size
                    ),
                    "s",
                    &samples,
                    &format!("{n} objects"),
                );
            }
            "database-read" => {
                let s = server
                    .as_ref()
                    .context("phase database-read needs the in-process server")?;
                let (samples, read) = repeated(args.repeat, || read_every_body(&s.store)).await?;
                figures.add(
                    "database_read_seconds",
                    "SELECT every stored body (the database's floor for a full list)",
                    "s",
                    &samples,
                    &format!("{} bodies, {} as stored", read.0, mb(read.1)),
                );
            }
            "metadata-list" => {
                let (samples, n) = repeated(args.repeat, || async {
                    let n = list_metadata_all(&api, args.page_size).await?;
                    check_count("metadata-list", n, created.len(), args.kubeconfig.is_some())?;
                    Ok(n)
                })
                .await?;
                figures.add(
                    "metadata_list_seconds",
                    format!("metadata-only paginated list (limit={})", args.page_size),
                    "s",
                    &samples,
                    &format!("{n} objects"),
                );
            }
            "kubectl-get" => {
                let (samples, n) = repeated(args.repeat, || async {
                    let n = kubectl_get_all(&kubeconfig).await?;
                    check_count(
                        "kubectl get polr -A",
                        n,
                        created.len(),
                        args.kubeconfig.is_some(),
                    )?;
                    Ok(n)
                })
                .await?;
                figures.add(
                    "kubectl_get_seconds",
                    "kubectl get polr -A",
                    "s",
                    &samples,
                    &format!("{n} rows"),
                );
            }
            "watcher-sync" => {
                // A watchlist-style pass: how fast a full relist through a reflector runs.
                let started = Instant::now();
                let relisted = kube::runtime::watcher(api.clone(), Default::default())
                    .take_while(|e| {
                        futures::future::ready(!matches!(
                            e,
                            Ok(kube::runtime::watcher::Event::InitDone)
                        ))
                    })
                    .try_fold(0usize, |n, e| async move {
                        Ok(n + matches!(e, kube::runtime::watcher::Event::InitApply(_)) as usize)
                    });
                let relisted = tokio::time::timeout(Duration::from_secs(600), relisted)
                    .await
                    .context("watcher initial list timed out")??;
                let secs = started.elapsed().as_secs_f64();
                figures.add(
                    "watcher_sync_per_s",
                    "kube-rs watcher initial sync",
                    "reports/s",
                    &[relisted as f64 / secs],
                    &format!("{relisted} objects, {secs:.2} s"),
                );
            }
            "watch-latency" => {
                for run in 0..args.watchers.len() {
                    watch_latency(&args, &client, run, &mut figures).await?;
                }
            }
            "rss" => {
                let s = server
                    .as_ref()
                    .context("phase rss needs the in-process server")?;
                rss(&args, &s.store, &client, baseline, &mut figures).await?;
            }
            other => unreachable!("phase {other} is not in PHASES"),
        }
        processes.phase_done(phase, &mut figures)?;
    }
    processes.peaks(&mut figures)?;
    let load_after = load_average();
    figures.note(
        "machine load (1-minute average) before and after",
        format!("{load_before:.2}, {load_after:.2}"),
    );

    println!("| measurement ({}) | value |", args.target);
    println!("|---|---|");
    for (k, v) in &figures.rows {
        println!("| {k} | {v} |");
    }
    if let Some(n) = listed {
        println!(
            "every object listed exactly once: yes ({n} of {})",
            created.len()
        );
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "target": args.target,
            "reports": args.reports,
            "report_json_bytes": sample,
            "concurrency": args.concurrency,
            "page_size": args.page_size,
            "build": if cfg!(debug_assertions) { "debug" } else { "release" },
            "load_average_before": load_before,
            "load_average_after": load_after,
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "figures": figures.json,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(s) = server {
        s.shutdown().await;
    }
    Ok(())
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

async fn create(
    args: &BenchArgs,
    client: &kube::Client,
    sample: usize,
) -> anyhow::Result<(f64, Created)> {
    println!(
        "creating {} PolicyReports of {} bytes in {} namespaces, {} concurrent requests",
        args.reports, sample, args.namespaces, args.concurrency
    );
    let started = Instant::now();
    let mut created = Vec::with_capacity(args.reports as usize);
    let mut creates = futures::stream::iter(0..args.reports)
        .map(|i| {
            let ns = format!("ns-{}", i % args.namespaces);
            let api: Api<PolicyReport> = Api::namespaced(client.clone(), &ns);
            async move {
                let report =
                    pss_policy_report(&Subject::pod(&ns, i), 1_700_000_000, &[(i % 19) as usize]);
                let stored = api.create(&PostParams::default(), &report).await?;
                Ok::<_, kube::Error>((
                    ns,
                    stored.metadata.name.unwrap_or_default(),
                    stored.metadata.resource_version.unwrap_or_default(),
                ))
            }
        })
        .buffer_unordered(args.concurrency);
    while let Some(result) = creates.next().await {
        created.push(result.context("create failed")?);
        progress("created", created.len() as u64, args.reports);
    }
    eprintln!();
    Ok((started.elapsed().as_secs_f64(), created))
}

fn progress(what: &str, done: u64, total: u64) {
    if done.is_multiple_of(1000) || done == total {
        eprint!("\r  {what} {done}/{total}");
    }
}

/// Replaces every created report once, each with its resourceVersion and another rule failing.
async fn update(args: &BenchArgs, client: &kube::Client, created: &Created) -> anyhow::Result<f64> {
    println!(
        "updating {} PolicyReports, {} concurrent requests",
        created.len(),
        args.concurrency
    );
    let started = Instant::now();
    let total = created.len() as u64;
    let mut done = 0u64;
    let mut updates = futures::stream::iter(created.iter().enumerate())
        .map(|(i, (ns, name, rv))| {
            let api: Api<PolicyReport> = Api::namespaced(client.clone(), ns);
            async move {
                let mut report =
                    pss_policy_report(&Subject::pod(ns, i as u64), 1_700_000_100, &[(i + 1) % 19]);
                report.metadata.name = Some(name.clone());
                report.metadata.resource_version = Some(rv.clone());
                api.replace(name, &PostParams::default(), &report).await
            }
        })
        .buffer_unordered(args.concurrency);
    while let Some(result) = updates.next().await {
        result.context("update failed")?;
        done += 1;
        progress("updated", done, total);
    }
    eprintln!();
    Ok(started.elapsed().as_secs_f64())
}

/// Lists everything page by page; fails if an object comes back twice. Returns (objects, pages).
async fn list_all(api: &Api<PolicyReport>, page_size: u32) -> anyhow::Result<(usize, usize)> {
    walk_pages(page_size, |params| async move {
        Ok(KeysPage::of(api.list(&params).await?))
    })
    .await
}

/// [`list_all`] reading each page as bytes and parsing only the names and the `continue`
/// token (unknown fields are skipped by the parser, not built).
async fn list_raw_all(client: &kube::Client, page_size: u32) -> anyhow::Result<usize> {
    #[derive(serde::Deserialize)]
    struct Page {
        metadata: ListMeta,
        items: Vec<Item>,
    }
    #[derive(serde::Deserialize)]
    struct ListMeta {
        #[serde(rename = "continue")]
        continue_: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct Item {
        metadata: ItemMeta,
    }
    #[derive(serde::Deserialize)]
    struct ItemMeta {
        namespace: Option<String>,
        name: String,
    }
    let url = format!(
        "/apis/{}/{}/{}",
        POLICY_REPORT.group, POLICY_REPORT.version, POLICY_REPORT.plural
    );
    let request = kube::core::Request::new(url);
    Ok(walk_pages(page_size, |params| {
        let (client, request) = (client.clone(), &request);
        async move {
            let bytes = client
                .request_text(request.list(&params).context("list request")?)
                .await?;
            let page: Page = serde_json::from_str(&bytes).context("list page")?;
            Ok(KeysPage {
                keys: page
                    .items
                    .into_iter()
                    .map(|i| (i.metadata.namespace.unwrap_or_default(), i.metadata.name))
                    .collect(),
                continue_: page.metadata.continue_,
            })
        }
    })
    .await?
    .0)
}

/// Every stored PolicyReport body, read through the server's own connection: (bodies, bytes
/// as stored — compressed on SQLite).
async fn read_every_body(store: &Store) -> anyhow::Result<(usize, u64)> {
    let rows = store
        .query_raw(&format!(
            "SELECT body FROM objects WHERE cluster_id = '{}' AND resource = '{}'",
            store.cluster_id(),
            Store::resource_key(&POLICY_REPORT)
        ))
        .await?;
    let mut bytes = 0;
    for row in &rows {
        bytes += match store.backend() {
            sea_orm::DbBackend::Sqlite => row.try_get::<Vec<u8>>("", "body")?.len(),
            _ => row.try_get::<String>("", "body")?.len(),
        } as u64;
    }
    Ok((rows.len(), bytes))
}

/// [`list_all`] as `PartialObjectMetadataList` pages.
async fn list_metadata_all(api: &Api<PolicyReport>, page_size: u32) -> anyhow::Result<usize> {
    Ok(walk_pages(page_size, |params| async move {
        Ok(KeysPage::of(api.list_metadata(&params).await?))
    })
    .await?
    .0)
}

/// What [`walk_pages`] needs of a page: its objects' (namespace, name) and `continue` token.
struct KeysPage {
    keys: Vec<(String, String)>,
    continue_: Option<String>,
}

impl KeysPage {
    fn of<T: kube::Resource + Clone>(page: kube::core::ObjectList<T>) -> Self {
        use kube::ResourceExt as _;
        KeysPage {
            keys: page
                .items
                .iter()
                .map(|item| (item.namespace().unwrap_or_default(), item.name_any()))
                .collect(),
            continue_: page.metadata.continue_,
        }
    }
}

/// Follows `continue` tokens from the first page of `page_size` until the last, checking that
/// no object comes back twice. Returns (objects, pages).
async fn walk_pages<F, Fut>(page_size: u32, mut fetch: F) -> anyhow::Result<(usize, usize)>
where
    F: FnMut(ListParams) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<KeysPage>>,
{
    let mut seen = HashSet::new();
    let mut pages = 0;
    let mut params = ListParams::default().limit(page_size);
    loop {
        let page = fetch(params.clone()).await?;
        pages += 1;
        for key in page.keys {
            if !seen.insert(key.clone()) {
                bail!("object {key:?} was listed twice");
            }
        }
        match page.continue_.filter(|c| !c.is_empty()) {
            Some(c) => params = params.continue_token(&c),
            None => return Ok((seen.len(), pages)),
        }
    }
}

/// Runs `kubectl get polr -A --no-headers` against `kubeconfig`; returns the number of rows.
async fn kubectl_get_all(kubeconfig: &Path) -> anyhow::Result<usize> {
    let out = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["get", "polr", "-A", "--no-headers"])
        .output()
        .await
        .context(
            "running kubectl (phase kubectl-get needs kubectl on PATH: apt-get install -y kubectl)",
        )?;
    if !out.status.success() {
        bail!(
            "kubectl get polr -A failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out
        .stdout
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .count())
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// The p-th percentile (0..=100) of sorted samples.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Where run `run` of the latency load writes (created first when driving a kubeconfig): a
/// namespace of its own, empty when its watchers start (a server that replays a namespace on
/// every watch, as the peer does, then replays nothing of earlier runs).
fn latency_namespace(run: usize) -> String {
    format!("bench-latency-{run}")
}

/// A report for the latency load: small unless `full` (a whole PSS report, ~9 KB).
fn latency_report(namespace: &str, n: u64, full: bool) -> PolicyReport {
    let mut r = pss_policy_report(&Subject::pod(namespace, n), 1_700_000_000, &[]);
    if !full {
        r.results = None;
    }
    r.metadata.name = Some(format!("lat-{n:07}"));
    r.metadata.annotations = Some([(SENT_AT.to_owned(), now_ns().to_string())].into());
    r
}

#[allow(
    clippy::too_many_lines,
    reason = "development-only load generator; to split (issue 34)"
)]
async fn watch_latency(
    args: &BenchArgs,
    client: &kube::Client,
    run: usize,
    figures: &mut Figures,
) -> anyhow::Result<()> {
    let watchers = args.watchers[run];
    let namespace = latency_namespace(run);
    let api: Api<PolicyReport> = Api::namespaced(client.clone(), &namespace);
    let expected = args.write_rate as u64 * args.write_seconds;
    println!(
        "watch latency: {watchers} watchers, {} creates/s of {} reports for {} s ({expected} events per watcher)",
        args.write_rate,
        if args.latency_full_reports {
            "~9 KB"
        } else {
            "small"
        },
        args.write_seconds
    );
    let from = api
        .list(&ListParams::default().limit(1))
        .await?
        .metadata
        .resource_version
        .unwrap_or_default();

    // Every watcher from the same version, each on its own connection; it stops after the
    // expected number of events (or when the deadline passes, which fails the phase).
    let deadline = Duration::from_secs(args.write_seconds + 120);
    let mut tasks = Vec::with_capacity(watchers);
    for _ in 0..watchers {
        let api = api.clone();
        let from = from.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(expected as usize);
            let mut names = HashSet::with_capacity(expected as usize);
            let mut rv = from;
            let run = async {
                // Resume like any client if the stream ends (timeout or cut-off).
                while (names.len() as u64) < expected {
                    let mut events = api
                        .watch(&WatchParams::default().timeout(600), &rv)
                        .await?
                        .boxed();
                    while let Some(event) = events.try_next().await? {
                        if let WatchEvent::Added(o) = event {
                            let received = now_ns();
                            let sent: u128 = o
                                .metadata
                                .annotations
                                .as_ref()
                                .and_then(|a| a.get(SENT_AT))
                                .and_then(|v| v.parse().ok())
                                .unwrap_or(received);
                            latencies
                                .push(Duration::from_nanos(received.saturating_sub(sent) as u64));
                            rv = o.metadata.resource_version.clone().unwrap_or_default();
                            names.insert(o.metadata.name.unwrap_or_default());
                            if names.len() as u64 == expected {
                                break;
                            }
                        }
                    }
                }
                Ok::<_, kube::Error>(())
            };
            let outcome = tokio::time::timeout(deadline, run).await;
            (
                latencies,
                names,
                outcome.map(|r| r.map_err(|e| e.to_string())),
            )
        }));
    }
    // Give every watch time to be established before the first write.
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Steady load: one create every 1/rate seconds, never more than 64 in flight.
    let started = Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / args.write_rate as f64));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let in_flight = Arc::new(tokio::sync::Semaphore::new(64));
    let mut writes = Vec::with_capacity(expected as usize);
    let full = args.latency_full_reports;
    for n in 0..expected {
        ticker.tick().await;
        let permit = in_flight.clone().acquire_owned().await?;
        let api = api.clone();
        let namespace = namespace.clone();
        writes.push(tokio::spawn(async move {
            let sent = Instant::now();
            let r = api
                .create(&PostParams::default(), &latency_report(&namespace, n, full))
                .await;
            drop(permit);
            r.map(|_| sent.elapsed())
        }));
    }
    let mut ack = Vec::with_capacity(writes.len());
    for w in writes {
        ack.push(w.await?.context("latency write failed")?);
    }
    let write_secs = started.elapsed().as_secs_f64();

    let mut all = Vec::new();
    let mut short = 0;
    for t in tasks {
        let (latencies, names, outcome) = t.await?;
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => bail!("a watcher failed: {e}"),
            Err(_) => bail!(
                "a watcher received {} of {expected} events before the deadline",
                names.len()
            ),
        }
        if names.len() as u64 != expected || latencies.len() as u64 != expected {
            short += 1;
        }
        all.extend(latencies);
    }
    if short > 0 {
        bail!("{short} watchers did not receive every event exactly once");
    }
    all.sort();
    ack.sort();
    let label = format!(
        "watch delivery latency, {watchers} watchers, {} creates/s",
        args.write_rate
    );
    let detail = format!(
        "max {:.1} ms; {} events, every watcher got every event (from sending the write to each watcher's receipt)",
        millis(*all.last().unwrap_or(&Duration::ZERO)),
        all.len()
    );
    figures.add(
        &format!("watch_p50_ms.{watchers}"),
        format!("{label}: p50"),
        "ms",
        &[millis(percentile(&all, 50.0))],
        "",
    );
    figures.add(
        &format!("watch_p99_ms.{watchers}"),
        format!("{label}: p99"),
        "ms",
        &[millis(percentile(&all, 99.0))],
        &detail,
    );
    figures.add(
        &format!("write_ack_p99_ms.{watchers}"),
        format!("write acknowledgement under that load ({watchers} watchers): p99"),
        "ms",
        &[millis(percentile(&ack, 99.0))],
        &format!(
            "p50 {:.1} ms; achieved {:.0} creates/s",
            millis(percentile(&ack, 50.0)),
            expected as f64 / write_secs
        ),
    );
    Ok(())
}

/// `VmRSS` and `VmHWM` of this process, in bytes.
pub(crate) fn memory() -> anyhow::Result<(u64, u64)> {
    memory_of("self")
}

/// `VmRSS` and `VmHWM` of `/proc/<pid>`, in bytes.
fn memory_of(pid: &str) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status (memory figures need Linux)"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("{name} missing from /proc/{pid}/status"))?;
        let kb: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("cannot parse {line:?}"))?;
        Ok(kb * 1024)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

fn mb(bytes: u64) -> String {
    format!("{:.0} MB", bytes as f64 / 1e6)
}

/// Loads reports in bulk through the store (one transaction per 1,000, the same rows the API
/// writes), then reads the process's memory idle and after a full paginated list.
async fn rss(
    args: &BenchArgs,
    store: &Store,
    client: &kube::Client,
    baseline: (u64, u64),
    figures: &mut Figures,
) -> anyhow::Result<()> {
    let total = args.rss_reports;
    println!("rss: loading {total} reports through the store");
    let started = Instant::now();
    let step = (total / 10).max(1);
    let mut loaded = 0u64;
    while loaded < total {
        let n = (total - loaded).min(1000);
        let objects: Vec<serde_json::Value> = (loaded..loaded + n)
            .map(|i| {
                let subject = Subject::pod(&format!("rss-{}", i % args.namespaces), i);
                let mut v = serde_json::to_value(pss_policy_report(
                    &subject,
                    1_700_000_000,
                    &[(i % 19) as usize],
                ))?;
                stamp_new(
                    v["metadata"]
                        .as_object_mut()
                        .context("report without metadata")?,
                    &subject.uid,
                );
                Ok(v)
            })
            .collect::<anyhow::Result<_>>()?;
        store
            .put_all(&POLICY_REPORT, objects)
            .await
            .context("bulk load")?;
        let before = loaded;
        loaded += n;
        if loaded / step != before / step || loaded == total {
            eprintln!(
                "  loaded {loaded}/{total} ({:.0}%, {:.0} s)",
                loaded as f64 * 100.0 / total as f64,
                started.elapsed().as_secs_f64()
            );
        }
    }
    let load_secs = started.elapsed().as_secs_f64();
    // Let the change feed broadcast what was loaded and settle before reading memory.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = memory()?;

    let api: Api<PolicyReport> = Api::all(client.clone());
    let started = Instant::now();
    let (n, pages) = list_all(&api, args.page_size).await?;
    let list_secs = started.elapsed().as_secs_f64();
    if (n as u64) < total {
        bail!("listed {n} objects, loaded {total}");
    }
    let after_list = memory()?;
    figures.add(
        "rss_bulk_load_per_s",
        format!("bulk load of {total} reports through the store (rss phase)"),
        "reports/s",
        &[total as f64 / load_secs],
        &format!("{load_secs:.0} s"),
    );
    figures.add(
        "rss_before_start_mib",
        "RSS before the server started",
        "MiB",
        &[baseline.0 as f64 / MIB],
        &format!("VmHWM {:.0} MiB", baseline.1 as f64 / MIB),
    );
    figures.add(
        "rss_idle_mib",
        format!("RSS idle with {total} stored reports"),
        "MiB",
        &[idle.0 as f64 / MIB],
        &format!("VmHWM {:.0} MiB", idle.1 as f64 / MIB),
    );
    figures.add(
        "rss_after_list_mib",
        format!("RSS after a full paginated list (limit={})", args.page_size),
        "MiB",
        &[after_list.0 as f64 / MIB],
        &format!(
            "VmHWM {:.0} MiB; {n} objects in {pages} pages, {list_secs:.1} s",
            after_list.1 as f64 / MIB
        ),
    );
    Ok(())
}
