//! `reports-server bench-aggregation`: end-to-end aggregation throughput of a fresh standalone
//! server with in-process aggregation on.
//!
//! For every pod, Kyverno writes two ephemeral reports with the 19 results of the 17 Pod Security
//! Standards policies: an admission report (random name, no ownerReference, the subject in labels
//! and annotations) and a background-scan report (owned by the pod, newer results, one rule
//! failing). They are created through the HTTPS API with the kube-rs client, as Kyverno would,
//! while the aggregator runs; the clock stops when every ephemeral report has been consumed. The
//! policy reports are then listed and checked: exactly 19 results per pod, the background results
//! (newer) everywhere, summaries matching. Prints figures; asserts only correctness.
//!
//! A storm of background scans (Kyverno's reports controller rescanning every resource, as in
//! kyverno/kyverno#10761) is `--scans N --admission false`: N passes over every pod, each writing
//! the pod's background report anew (created, or replaced while it still waits for the merge, as
//! Kyverno's scanner does), each pass newer than the last. Besides the rates, the run samples
//! what waits (ephemeral reports written but not yet merged, namespaces queued) and the
//! process's memory, and reports how long after the last write every policy report was current.
//!
//! Peak memory is the process's VmHWM (server, aggregator and client together). With
//! `--layout both` each layout runs in a child process of its own, so that each gets its own peak.

use std::collections::{BTreeMap, HashSet};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use futures::StreamExt;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use reports_server_aggregator::aggregator::DEFAULT_PAGE_SIZE;
use reports_server_aggregator::metrics::{Operation, OperationLabels};
use reports_server_aggregator::queue::DEFAULT_WORKERS;
use reports_server_aggregator::{AggregatorConfig, Layout, MergeOptions, Metrics, QueueConfig};
use reports_server_apiserver::report_merge::run_in_process;
use reports_server_crds::fixtures::{PSS_RULES, Subject, pss_ephemeral_report};
use reports_server_crds::{EphemeralReport, PolicyReport};
use serde_json::Value;

use crate::aggregation_cli::parse_delay;
use crate::bench::{memory, start_server};

const T0: i64 = 1_700_000_000;

/// Which layouts to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LayoutChoice {
    Both,
    PerResource,
    PerPolicy,
}

#[derive(Args, Debug)]
pub struct BenchAggregationArgs {
    /// Pods; each gets one admission and `--scans` background ephemeral reports (~7 KB each).
    #[arg(long, env = "REPORTS_SERVER_BENCH_PODS", default_value_t = 5_000)]
    pods: u64,
    /// Background scans of every pod, one pass over all pods after another; each writes the
    /// pod's background report anew with newer results.
    #[arg(long, env = "REPORTS_SERVER_BENCH_SCANS", default_value_t = 1)]
    scans: u64,
    /// Whether every pod also gets an admission report (`--admission false`: a background-scan
    /// storm only).
    #[arg(long, env = "REPORTS_SERVER_BENCH_ADMISSION", default_value_t = true, action = clap::ArgAction::Set)]
    admission: bool,
    /// Namespaces the pods are spread over.
    #[arg(long, env = "REPORTS_SERVER_BENCH_NAMESPACES", default_value_t = 50)]
    namespaces: u64,
    /// Layout(s) to measure; `both` runs each in its own child process.
    #[arg(
        long,
        env = "REPORTS_SERVER_BENCH_LAYOUT",
        value_enum,
        default_value = "both"
    )]
    layout: LayoutChoice,
    /// Concurrent create requests.
    #[arg(long, env = "REPORTS_SERVER_BENCH_CONCURRENCY", default_value_t = 16)]
    concurrency: usize,
    /// Aggregation delay (the server's default is 30s; a benchmark wants the merge to keep up).
    #[arg(long, env = "REPORTS_SERVER_BENCH_AGGREGATION_DELAY", default_value = "1s", value_parser = parse_delay)]
    aggregation_delay: Duration,
    /// Namespaces merged in parallel.
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_WORKERS", default_value_t = DEFAULT_WORKERS)]
    aggregation_workers: usize,
    /// Per-resource layout: resources merged per page.
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_PAGE_SIZE", default_value_t = DEFAULT_PAGE_SIZE)]
    aggregation_page_size: usize,
    /// Give up if the ephemeral reports are not all consumed within this time.
    #[arg(long, env = "REPORTS_SERVER_BENCH_TIMEOUT", default_value = "30m", value_parser = parse_delay)]
    timeout: Duration,
    /// Database to benchmark [default: a fresh SQLite file in a temporary directory].
    #[arg(long, env = "REPORTS_SERVER_BENCH_DATABASE_URL")]
    database_url: Option<String>,
}

/// Figures of one run.
struct Figures {
    layout: Layout,
    create_secs: f64,
    total_secs: f64,
    ephemerals: u64,
    /// Rescans that found their report still waiting for the merge and replaced it.
    replaced: u64,
    /// Ephemeral reports the merge found rewritten between its read and its write.
    rewritten_in_merge: u64,
    waiting: Peaks,
    final_reports: usize,
    results: usize,
    results_written: u64,
    writes: u64,
    peak_rss_kib: Option<u64>,
}

impl Figures {
    fn row(&self) -> String {
        let rss = self
            .peak_rss_kib
            .map_or_else(|| "n/a".into(), |k| format!("{:.0} MiB", k as f64 / 1024.0));
        format!(
            "| {} | {} ({} replaced, {} rewritten during a merge) | {:.1} s | {:.0} | {:.1} s | {:.1} s | {:.0} | {} | {} | {} | {} | {} | {} | {rss} | {} |",
            self.layout,
            self.ephemerals,
            self.replaced,
            self.rewritten_in_merge,
            self.create_secs,
            self.ephemerals as f64 / self.create_secs,
            self.total_secs,
            self.total_secs - self.create_secs,
            (self.ephemerals - self.replaced) as f64 / self.total_secs,
            self.waiting.reports,
            self.waiting.namespaces,
            self.waiting.rss_kib / 1024,
            self.final_reports,
            self.results,
            self.results_written,
            self.writes,
        )
    }
}

const HEADER: &str = "| layout | ephemeral reports written | write phase | written/s | until all consumed | current after the last write | ephemeral reports/s consumed (written, not replaced) | most waiting to be merged | most namespaces queued | most RSS sampled (MiB) | policy reports | results in them | results merged (all passes, written or unchanged) | peak RSS | report writes (create+update+delete) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|";

pub async fn run(args: BenchAggregationArgs) -> anyhow::Result<()> {
    let layouts = match args.layout {
        LayoutChoice::PerResource => {
            return run_one(&args, Layout::PerResource).await.map(|f| {
                println!("{HEADER}\n{}", f.row());
            });
        }
        LayoutChoice::PerPolicy => {
            return run_one(&args, Layout::PerPolicy).await.map(|f| {
                println!("{HEADER}\n{}", f.row());
            });
        }
        LayoutChoice::Both => ["per-resource", "per-policy"],
    };
    let exe = std::env::current_exe().context("cannot find this executable to re-run it")?;
    let mut rows = Vec::new();
    for layout in layouts {
        eprintln!("== layout {layout} (child process) ==");
        // Every other flag, the global `--log` and the environment exactly as given.
        let mut cmd = Command::new(&exe);
        cmd.args(args_without_layout())
            .args(["--layout", layout])
            .stderr(Stdio::inherit());
        let out = cmd
            .output()
            .context("cannot run the benchmark child process")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!("the {layout} run failed ({}):\n{stdout}", out.status);
        }
        rows.extend(
            stdout
                .lines()
                .filter(|l| l.starts_with(&format!("| {layout} |")))
                .map(str::to_owned),
        );
    }
    println!("{HEADER}");
    for row in rows {
        println!("{row}");
    }
    Ok(())
}

/// An admission report for `subject` as Kyverno's webhook writes it: generateName-style name,
/// no ownerReference, the subject in labels (uid, gvr, group/version/kind) and annotations.
fn admission_report(subject: &Subject, n: u64) -> EphemeralReport {
    let mut report = pss_ephemeral_report(subject, T0, &[]);
    let meta = &mut report.metadata;
    meta.name = Some(format!(
        "{:08x}-ad{n:06}-{:05x}",
        n * 2_654_435_761 % 0xffff_ffff,
        n % 0xfffff
    ));
    meta.owner_references = None;
    let labels = meta.labels.get_or_insert_with(Default::default);
    labels.insert("audit.kyverno.io/source".into(), "admission".into());
    labels.insert("audit.kyverno.io/resource.gvr".into(), "pods.v1".into());
    meta.annotations
        .get_or_insert_with(Default::default)
        .insert(
            "audit.kyverno.io/resource.namespace".into(),
            subject.namespace.clone(),
        );
    report
}

/// This command line without its `--layout`, for a child that measures one layout.
fn args_without_layout() -> Vec<std::ffi::OsString> {
    let mut kept = Vec::new();
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--layout" {
            args.next();
        } else if !arg.to_string_lossy().starts_with("--layout=") {
            kept.push(arg);
        }
    }
    kept
}

async fn run_one(args: &BenchAggregationArgs, layout: Layout) -> anyhow::Result<Figures> {
    let dir = tempfile::tempdir()?;
    let (server, client) = start_server(dir.path(), args.database_url.as_deref(), None).await?;
    let metrics = server.metrics.register(Metrics::register);
    let config = AggregatorConfig {
        queue: QueueConfig {
            delay: args.aggregation_delay,
            workers: args.aggregation_workers.max(1),
            ..QueueConfig::default()
        },
        merge: MergeOptions {
            layout,
            ..MergeOptions::default()
        },
        page_size: args.aggregation_page_size.max(1),
    };
    let aggregation = tokio::spawn(run_in_process(
        server.store.clone(),
        config,
        metrics.clone(),
        None,
        server.shutdown_token(),
    ));
    let ephemerals = ephemerals_of(args);
    eprintln!(
        "{layout}: {} pods in {} namespaces, {} scans, admission reports {}, {ephemerals} ephemeral reports of ~{} bytes, backend {:?}, aggregation delay {:?}, {} workers",
        args.pods,
        args.namespaces,
        args.scans,
        args.admission,
        serde_json::to_vec(&admission_report(&Subject::pod("ns-0", 0), 0))?.len(),
        server.store.backend(),
        args.aggregation_delay,
        args.aggregation_workers
    );

    let written = Arc::new(Written::default());
    let sampler = Sampler::start(written.clone(), metrics.clone());
    let started = Instant::now();
    create_ephemerals(args, &client, &metrics, &written).await?;
    let create_secs = started.elapsed().as_secs_f64();
    let to_consume = written.to_consume();
    wait_until_consumed(args, layout, &client, &metrics, to_consume, started).await?;
    let total_secs = started.elapsed().as_secs_f64();
    let waiting = sampler.stop().await;
    eprintln!("\r  consumed {to_consume}/{to_consume} after {total_secs:.1} s");

    let (final_reports, results) = verify(&client, layout, args.pods, last_scan(args)).await?;
    let writes = [Operation::Create, Operation::Update, Operation::Delete]
        .into_iter()
        .map(|operation| {
            metrics
                .reports_written
                .get_or_create(&OperationLabels { operation })
                .get()
        })
        .sum();
    let figures = Figures {
        layout,
        create_secs,
        total_secs,
        ephemerals,
        replaced: written.replaced.load(Ordering::Relaxed),
        rewritten_in_merge: metrics.ephemeral_reports_rewritten.get(),
        waiting,
        final_reports,
        results,
        results_written: metrics.results_merged.get(),
        writes,
        peak_rss_kib: memory().ok().map(|(_, peak)| peak / 1024),
    };
    server.shutdown().await;
    let _ = aggregation.await;
    eprintln!(
        "{layout}: every pod has its 19 results exactly once, the last scan's (newest) results won, summaries match"
    );
    Ok(figures)
}

fn ephemerals_of(args: &BenchAggregationArgs) -> u64 {
    args.pods * (args.scans.max(1) + u64::from(args.admission))
}

/// The timestamp of the last background scan's results: the newest, which must win.
fn last_scan(args: &BenchAggregationArgs) -> i64 {
    T0 + 30 + i64::try_from(args.scans.max(1) - 1).unwrap_or(i64::MAX - T0 - 30)
}

/// Ephemeral reports written so far; a rescan that replaced a report still waiting for the
/// merge wrote no new report to consume.
#[derive(Default)]
struct Written {
    all: AtomicU64,
    replaced: AtomicU64,
}

impl Written {
    fn to_consume(&self) -> u64 {
        let replaced = self.replaced.load(Ordering::Relaxed);
        self.all.load(Ordering::Relaxed).saturating_sub(replaced)
    }
}

/// Writes every pass of ephemeral reports, with progress: pass 0 the admission reports (if
/// any) and the first background scan, every further pass one more scan of every pod. Passes
/// run one after another, so that a pod's scans reach the server in order.
async fn create_ephemerals(
    args: &BenchAggregationArgs,
    client: &kube::Client,
    metrics: &Metrics,
    written: &Written,
) -> anyhow::Result<()> {
    let ephemerals = ephemerals_of(args);
    let namespaces = args.namespaces.max(1);
    for scan in 0..args.scans.max(1) {
        let admission = args.admission && scan == 0;
        let mut writes = futures::stream::iter(0..args.pods)
            .flat_map(|i| {
                let kinds: &[bool] = if admission { &[true, false] } else { &[false] };
                futures::stream::iter(kinds.iter().map(move |&a| (i, a)))
            })
            .map(|(i, admission)| {
                let ns = format!("ns-{}", i % namespaces);
                let api: Api<EphemeralReport> = Api::namespaced(client.clone(), &ns);
                async move {
                    let subject = Subject::pod(&ns, i);
                    if admission {
                        api.create(&PostParams::default(), &admission_report(&subject, i))
                            .await?;
                        return Ok(false);
                    }
                    // Each scan runs later than the last and finds another rule failing.
                    let failing = ((i + scan) % PSS_RULES.len() as u64) as usize;
                    let timestamp = T0 + 30 + i64::try_from(scan)?;
                    write_scan(&api, pss_ephemeral_report(&subject, timestamp, &[failing])).await
                }
            })
            .buffer_unordered(args.concurrency.max(1));
        while let Some(result) = writes.next().await {
            if result.context("write failed")? {
                written.replaced.fetch_add(1, Ordering::Relaxed);
            }
            let done = written.all.fetch_add(1, Ordering::Relaxed) + 1;
            if done.is_multiple_of(1000) || done == ephemerals {
                eprint!(
                    "\r  written {done}/{ephemerals} (scan {}/{}), consumed {}",
                    scan + 1,
                    args.scans.max(1),
                    metrics.ephemeral_reports_deleted.get()
                );
            }
        }
    }
    eprintln!();
    Ok(())
}

/// Writes one background scan's report as Kyverno's scanner does: created, or, while the
/// previous scan's report still waits for the merge, replaced. Returns whether it replaced.
async fn write_scan(
    api: &Api<EphemeralReport>,
    mut report: EphemeralReport,
) -> anyhow::Result<bool> {
    let name = report.metadata.name.clone().unwrap_or_default();
    // Each round trip loses only to the merge or a rewrite; many in a row mean something else.
    for _ in 0..100 {
        report.metadata.resource_version = None;
        match api.create(&PostParams::default(), &report).await {
            Ok(_) => return Ok(false),
            Err(kube::Error::Api(e)) if e.reason == "AlreadyExists" => {}
            Err(e) => return Err(e.into()),
        }
        // Still waiting: replace it, unless the merge consumes it meanwhile (then create again).
        let Some(current) = api.get_opt(&name).await? else {
            continue;
        };
        report.metadata.resource_version = current.metadata.resource_version;
        match api.replace(&name, &PostParams::default(), &report).await {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    bail!("{name}: neither created nor replaced in 100 attempts")
}

/// What waits while the storm runs, sampled every 100 ms: the most ephemeral reports written
/// but not yet consumed, the most namespaces queued for a merge, the most resident memory.
#[derive(Clone, Copy, Debug, Default)]
struct Peaks {
    reports: u64,
    namespaces: i64,
    rss_kib: u64,
}

struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Peaks>,
}

impl Sampler {
    fn start(written: Arc<Written>, metrics: Metrics) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let mut peaks = Peaks::default();
            while !stopped.load(Ordering::Relaxed) {
                let consumed = metrics.ephemeral_reports_deleted.get();
                let waiting = written.to_consume().saturating_sub(consumed);
                peaks.reports = peaks.reports.max(waiting);
                peaks.namespaces = peaks.namespaces.max(metrics.queue_depth.get());
                if let Ok((rss, _)) = memory() {
                    peaks.rss_kib = peaks.rss_kib.max(rss / 1024);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            peaks
        });
        Sampler { stop, task }
    }

    async fn stop(self) -> Peaks {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap_or_default()
    }
}

/// Waits until the merge consumed all `ephemerals` reports (confirmed through the API), or
/// fails after `--timeout` from `started`.
async fn wait_until_consumed(
    args: &BenchAggregationArgs,
    layout: Layout,
    client: &kube::Client,
    metrics: &Metrics,
    ephemerals: u64,
    started: Instant,
) -> anyhow::Result<()> {
    let all_ephemerals: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &kube::api::ApiResource::erase::<EphemeralReport>(&()),
    );
    loop {
        let consumed = metrics.ephemeral_reports_deleted.get();
        if consumed >= ephemerals {
            let left = all_ephemerals
                .list_metadata(&ListParams::default().limit(1))
                .await?;
            if left.items.is_empty() {
                return Ok(());
            }
        }
        if started.elapsed() > args.timeout {
            bail!(
                "{layout}: only {consumed} of {ephemerals} ephemeral reports consumed after {:?}",
                args.timeout
            );
        }
        eprint!("\r  consumed {consumed}/{ephemerals}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Lists the policy reports and checks that they hold exactly the expected results. Returns
/// (number of reports, number of results).
async fn verify(
    client: &kube::Client,
    layout: Layout,
    pods: u64,
    newest: i64,
) -> anyhow::Result<(usize, usize)> {
    let api: Api<PolicyReport> = Api::all(client.clone());
    let mut params = ListParams::default().limit(500);
    let mut reports = 0usize;
    // subject uid → rules seen
    let mut per_subject: BTreeMap<String, HashSet<(String, String)>> = BTreeMap::new();
    let mut results = 0usize;
    loop {
        let page = api.list(&params).await?;
        for report in &page.items {
            reports += 1;
            let list = report.results.as_deref().unwrap_or_default();
            let summary = serde_json::to_value(report.summary.as_ref())?;
            let counted = |what: &str| {
                list.iter()
                    .filter(|r| {
                        serde_json::to_value(r.result.as_ref()).ok() == Some(Value::from(what))
                    })
                    .count() as u64
            };
            for what in ["pass", "fail"] {
                if summary[what].as_u64() != Some(counted(what)) {
                    bail!(
                        "{:?}: summary.{what} is {} but {} results say {what}",
                        report.metadata.name,
                        summary[what],
                        counted(what)
                    );
                }
            }
            for r in list {
                results += 1;
                let uid = match layout {
                    Layout::PerResource => report.scope.as_ref().and_then(|s| s.uid.clone()),
                    Layout::PerPolicy => r
                        .resources
                        .as_ref()
                        .and_then(|v| v.first())
                        .and_then(|s| s.uid.clone()),
                }
                .context("a result without subject")?;
                if r.timestamp.as_ref().map(|t| t.seconds) != Some(newest) {
                    bail!("{uid}: an older (admission or earlier scan) result won: {r:?}");
                }
                let key = (r.policy.clone(), r.rule.clone().unwrap_or_default());
                if !per_subject.entry(uid.clone()).or_default().insert(key) {
                    bail!("{uid}: result {}/{:?} stored twice", r.policy, r.rule);
                }
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => params = params.continue_token(&c),
            None => break,
        }
    }
    if per_subject.len() as u64 != pods {
        bail!("results for {} pods, expected {pods}", per_subject.len());
    }
    if let Some((uid, rules)) = per_subject.iter().find(|(_, r)| r.len() != PSS_RULES.len()) {
        bail!(
            "{uid}: {} results, expected {}",
            rules.len(),
            PSS_RULES.len()
        );
    }
    Ok((reports, results))
}
