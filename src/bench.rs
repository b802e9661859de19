//! `reports-server bench`: figures of a fresh standalone server running in this process, driven
//! by the kube-rs client over HTTPS exactly as a real client would. Prints figures; asserts only
//! correctness (every object listed exactly once, every watcher receives every event), never
//! speed.
//!
//! Phases (`--phases`, comma-separated, run in this order):
//! - `create`: `--reports` Pod Security Standards reports through the API;
//! - `list`: a paginated list of everything;
//! - `watcher-sync`: a kube-rs watcher's initial list;
//! - `watch-latency`: `--watchers` concurrent watches while `--write-rate` creates per second
//!   run for `--write-seconds`; the latency of each event from the moment its write was sent
//!   (stamped into the object) to its arrival at each watcher;
//! - `rss`: `--rss-reports` reports loaded in bulk through the store, then the process's
//!   resident memory (`VmRSS`, peak `VmHWM` from `/proc/self/status`) idle and after a full
//!   paginated list. The server runs in this process, so that is the server's memory (plus the
//!   benchmark client's, which holds one page at a time).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use clap::Args;
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use reports_server_apiserver::http::ApiOptions;
use reports_server_apiserver::registry::stamp_new;
use reports_server_apiserver::startup::{self, RunningServer, ServerConfig};
use reports_server_apiserver::store::{Store, StoreOptions};
use reports_server_crds::PolicyReport;
use reports_server_crds::catalog::POLICY_REPORT;
use reports_server_crds::fixtures::{Subject, pss_policy_report};

/// Every phase, in the order they run.
const PHASES: [&str; 5] = ["create", "list", "watcher-sync", "watch-latency", "rss"];

/// The annotation carrying the moment a latency write was sent (nanoseconds since the epoch).
const SENT_AT: &str = "bench.reports-server.io/sent-at-ns";

#[derive(Args)]
pub struct BenchArgs {
    /// Phases to run, comma-separated: create, list, watcher-sync, watch-latency, rss, or all.
    #[arg(
        long,
        env = "REPORTS_SERVER_BENCH_PHASES",
        value_delimiter = ',',
        default_value = "create,list,watcher-sync"
    )]
    phases: Vec<String>,
    /// Number of ~9 KB Pod Security Standards reports to create (phase create).
    #[arg(long, env = "REPORTS_SERVER_BENCH_REPORTS", default_value_t = 10_000)]
    reports: u64,
    /// Namespaces to spread them over.
    #[arg(long, env = "REPORTS_SERVER_BENCH_NAMESPACES", default_value_t = 10)]
    namespaces: u64,
    /// Concurrent create requests.
    #[arg(long, env = "REPORTS_SERVER_BENCH_CONCURRENCY", default_value_t = 16)]
    concurrency: usize,
    /// Page size of the paginated lists.
    #[arg(long, env = "REPORTS_SERVER_BENCH_PAGE_SIZE", default_value_t = 500)]
    page_size: u32,
    /// Concurrent watchers (phase watch-latency).
    #[arg(long, env = "REPORTS_SERVER_BENCH_WATCHERS", default_value_t = 100)]
    watchers: usize,
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
    /// Database to benchmark [default: a fresh SQLite file in a temporary directory].
    #[arg(long, env = "REPORTS_SERVER_BENCH_DATABASE_URL")]
    database_url: Option<String>,
    /// The server's `--group-commit-max-writes` (1: one write per transaction, as before group
    /// commit).
    #[arg(
        long,
        env = "REPORTS_SERVER_GROUP_COMMIT_MAX_WRITES",
        default_value_t = 256
    )]
    group_commit_max_writes: usize,
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
    Ok(PHASES
        .into_iter()
        .filter(|p| wanted.iter().any(|w| w == "all" || w == p))
        .collect())
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let phases = selected(&args)?;
    let dir = tempfile::tempdir()?;
    let baseline = memory()?;
    let (server, client) = start_server(
        dir.path(),
        args.database_url.as_deref(),
        Some(args.group_commit_max_writes),
    )
    .await?;
    println!(
        "backend: {:?} ({}); {} build; phases: {}",
        server.store.backend(),
        if args.database_url.is_some() {
            "given URL"
        } else {
            "temporary SQLite file"
        },
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        phases.join(",")
    );
    let sample = serde_json::to_vec(&pss_policy_report(
        &Subject::pod("ns-0", 0),
        1_700_000_000,
        &[1, 7],
    ))?
    .len();
    let mut rows: Vec<(String, String)> = Vec::new();
    let mut created = 0u64;
    let mut listed = None;

    if phases.contains(&"create") {
        let secs = create(&args, &client, sample).await?;
        created = args.reports;
        rows.push((
            format!("create ({} concurrent)", args.concurrency),
            format!(
                "{:.0} reports/s ({secs:.1} s for {})",
                args.reports as f64 / secs,
                args.reports
            ),
        ));
        // What the store keeps per report, against the JSON a client sent (`sample` bytes).
        if let Some(bytes) = server.store.storage_bytes().await? {
            let per_report = bytes as f64 / args.reports as f64;
            rows.push((
                "stored (tables + indexes)".into(),
                format!(
                    "{} ({:.1} KB per report, {:.2}x the report's JSON)",
                    mb(bytes),
                    per_report / 1e3,
                    per_report / sample as f64
                ),
            ));
        }
    }
    let api: Api<PolicyReport> = Api::all(client.clone());
    if phases.contains(&"list") {
        let started = Instant::now();
        let (n, pages) = list_all(&api, args.page_size).await?;
        let secs = started.elapsed().as_secs_f64();
        if n as u64 != created {
            bail!("listed {n} objects, created {created}");
        }
        rows.push((
            format!("paginated list (limit={})", args.page_size),
            format!(
                "{:.0} reports/s, {:.1} MB/s ({pages} pages, {secs:.2} s)",
                n as f64 / secs,
                (n * sample) as f64 / secs / 1e6,
            ),
        ));
        listed = Some(n);
    }
    if phases.contains(&"watcher-sync") {
        // A watchlist-style pass: how fast a full relist through a reflector runs.
        let started = Instant::now();
        let relisted = kube::runtime::watcher(api.clone(), Default::default())
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
        rows.push((
            "kube-rs watcher initial sync".into(),
            format!(
                "{:.0} reports/s ({relisted} objects, {secs:.2} s)",
                relisted as f64 / secs
            ),
        ));
    }
    if phases.contains(&"watch-latency") {
        rows.extend(watch_latency(&args, &client).await?);
    }
    if phases.contains(&"rss") {
        rows.extend(rss(&args, &server.store, &client, baseline).await?);
    }

    println!("| measurement | value |");
    println!("|---|---|");
    for (k, v) in &rows {
        println!("| {k} | {v} |");
    }
    if let Some(n) = listed {
        println!("every object listed exactly once: yes ({n} of {created})");
    }
    server.shutdown().await;
    Ok(())
}

async fn create(args: &BenchArgs, client: &kube::Client, sample: usize) -> anyhow::Result<f64> {
    println!(
        "creating {} PolicyReports of {} bytes in {} namespaces, {} concurrent requests",
        args.reports, sample, args.namespaces, args.concurrency
    );
    let started = Instant::now();
    let mut done = 0u64;
    let mut creates = futures::stream::iter(0..args.reports)
        .map(|i| {
            let ns = format!("ns-{}", i % args.namespaces);
            let api: Api<PolicyReport> = Api::namespaced(client.clone(), &ns);
            async move {
                let report =
                    pss_policy_report(&Subject::pod(&ns, i), 1_700_000_000, &[(i % 19) as usize]);
                api.create(&PostParams::default(), &report).await
            }
        })
        .buffer_unordered(args.concurrency);
    while let Some(result) = creates.next().await {
        result.context("create failed")?;
        done += 1;
        if done.is_multiple_of(1000) || done == args.reports {
            eprint!("\r  created {done}/{}", args.reports);
        }
    }
    eprintln!();
    Ok(started.elapsed().as_secs_f64())
}

/// Lists everything page by page; fails if an object comes back twice. Returns (objects, pages).
async fn list_all(api: &Api<PolicyReport>, page_size: u32) -> anyhow::Result<(usize, usize)> {
    let mut seen = HashSet::new();
    let mut pages = 0;
    let mut params = ListParams::default().limit(page_size);
    loop {
        let page = api.list(&params).await?;
        pages += 1;
        for item in &page.items {
            let key = (
                item.metadata.namespace.clone().unwrap_or_default(),
                item.metadata.name.clone().unwrap_or_default(),
            );
            if !seen.insert(key.clone()) {
                bail!("object {key:?} was listed twice");
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => params = params.continue_token(&c),
            None => return Ok((seen.len(), pages)),
        }
    }
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

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// A report for the latency load: small unless `full` (a whole PSS report, ~9 KB).
fn latency_report(n: u64, full: bool) -> PolicyReport {
    let mut r = pss_policy_report(&Subject::pod("bench-latency", n), 1_700_000_000, &[]);
    if !full {
        r.results = None;
    }
    r.metadata.name = Some(format!("lat-{n:07}"));
    r.metadata.annotations = Some([(SENT_AT.to_owned(), now_ns().to_string())].into());
    r
}

async fn watch_latency(
    args: &BenchArgs,
    client: &kube::Client,
) -> anyhow::Result<Vec<(String, String)>> {
    let ns = "bench-latency";
    let api: Api<PolicyReport> = Api::namespaced(client.clone(), ns);
    let expected = args.write_rate as u64 * args.write_seconds;
    println!(
        "watch latency: {} watchers, {} creates/s of {} reports for {} s ({expected} events per watcher)",
        args.watchers,
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
    let mut watchers = Vec::with_capacity(args.watchers);
    for _ in 0..args.watchers {
        let api = api.clone();
        let from = from.clone();
        watchers.push(tokio::spawn(async move {
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
        writes.push(tokio::spawn(async move {
            let sent = Instant::now();
            let r = api
                .create(&PostParams::default(), &latency_report(n, full))
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
    for w in watchers {
        let (latencies, names, outcome) = w.await?;
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
    let delivered = all.len();
    Ok(vec![
        (
            format!(
                "watch delivery latency ({} watchers, {} creates/s target)",
                args.watchers, args.write_rate
            ),
            format!(
                "p50 {}, p99 {}, max {} (from sending the write to each watcher's receipt)",
                ms(percentile(&all, 50.0)),
                ms(percentile(&all, 99.0)),
                ms(*all.last().unwrap_or(&Duration::ZERO))
            ),
        ),
        (
            "watch events delivered".into(),
            format!(
                "{delivered} of {} expected ({} watchers × {expected}); every watcher got every event: yes",
                args.watchers as u64 * expected,
                args.watchers
            ),
        ),
        (
            "write acknowledgement under that load".into(),
            format!(
                "p50 {}, p99 {}; achieved {:.0} creates/s",
                ms(percentile(&ack, 50.0)),
                ms(percentile(&ack, 99.0)),
                expected as f64 / write_secs
            ),
        ),
    ])
}

/// `VmRSS` and `VmHWM` of this process, in bytes.
pub(crate) fn memory() -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status")
        .context("reading /proc/self/status (the rss phase needs Linux)")?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("{name} missing from /proc/self/status"))?;
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
) -> anyhow::Result<Vec<(String, String)>> {
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
    Ok(vec![
        (
            format!("bulk load of {total} reports through the store (rss phase)"),
            format!(
                "{:.0} reports/s ({load_secs:.0} s)",
                total as f64 / load_secs
            ),
        ),
        (
            "RSS before the server started".into(),
            format!("{} (VmHWM {})", mb(baseline.0), mb(baseline.1)),
        ),
        (
            format!("RSS idle with {total} stored reports"),
            format!("{} (VmHWM {})", mb(idle.0), mb(idle.1)),
        ),
        (
            format!("RSS after a full paginated list (limit={})", args.page_size),
            format!(
                "{} (VmHWM {}); {n} objects in {pages} pages, {list_secs:.1} s",
                mb(after_list.0),
                mb(after_list.1)
            ),
        ),
    ])
}
