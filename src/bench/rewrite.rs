//! The `rewrite` phase: a rewrite-heavy producer, as falcosidekick or a per-namespace scanner
//! writes — one report of `--rewrite-results` results in each of `--rewrite-reports`
//! namespaces, replaced `--rewrite-rate` times a second in all, one result changed each time.
//!
//! What it measures is the database work of one such update, against the report's size: the
//! write-ahead log and the rows touched per table (PostgreSQL, in-process server), the bytes
//! this process wrote to storage (SQLite, in-process server), and the update's latency.

use std::time::{Duration, Instant};

use anyhow::Context;
use futures::future::try_join_all;
use kube::api::{Api, PostParams};
use reports_server_apiserver::startup::RunningServer;
use reports_server_apiserver::store::WriteActivity;
use reports_server_crds::PolicyReport;
use reports_server_crds::fixtures::Subject;
use serde_json::{Value, json};

use super::BenchArgs;
use super::figures::{Figures, millis, percentile};
use super::load::ensure_namespaces;

const T0: i64 = 1_700_000_000;

/// The namespace of rewritten report `n`.
fn namespace(n: usize) -> String {
    format!("bench-rewrite-{n}")
}

/// Result `i` of a rewritten report: a policy of 40, a rule and a pod of its own.
fn result(namespace: &str, i: usize, failing: bool, seconds: i64) -> Value {
    let pod = Subject::pod(namespace, i as u64);
    json!({
        "source": "falco",
        "policy": format!("policy-{}", i % 40),
        "rule": format!("rule-{i}"),
        "category": "runtime",
        "severity": if failing { "high" } else { "low" },
        "result": if failing { "fail" } else { "pass" },
        "message": format!("rule-{i} {} on {}", if failing { "fired" } else { "quiet" }, pod.name),
        "timestamp": {"seconds": seconds, "nanos": 0},
        "properties": {"priority": if failing { "Warning" } else { "Notice" }},
        "resources": [{
            "apiVersion": "v1", "kind": "Pod", "namespace": namespace,
            "name": pod.name, "uid": pod.uid,
        }],
    })
}

/// A rewritten report's state: its results, changed one at a time.
struct Rewritten {
    namespace: String,
    results: Vec<Value>,
    resource_version: String,
    updates: u64,
}

impl Rewritten {
    fn new(n: usize, results: usize) -> Self {
        let namespace = namespace(n);
        let results = (0..results)
            .map(|i| result(&namespace, i, false, T0))
            .collect();
        Rewritten {
            namespace,
            results,
            resource_version: String::new(),
            updates: 0,
        }
    }

    fn report(&self) -> anyhow::Result<PolicyReport> {
        let mut summary = json!({"pass": 0, "fail": 0});
        for r in &self.results {
            let key = r["result"].as_str().unwrap_or("pass");
            summary[key] = json!(summary[key].as_u64().unwrap_or(0) + 1);
        }
        let mut report: PolicyReport = serde_json::from_value(json!({
            "apiVersion": "wgpolicyk8s.io/v1alpha2",
            "kind": "PolicyReport",
            "metadata": {"name": "rewritten", "namespace": self.namespace,
                         "labels": {"app.kubernetes.io/managed-by": "bench-rewrite"}},
            "summary": summary,
            "results": self.results,
        }))?;
        if !self.resource_version.is_empty() {
            report.metadata.resource_version = Some(self.resource_version.clone());
        }
        Ok(report)
    }

    /// Changes one result (another each time, spread over the report): its outcome, severity,
    /// message, properties and timestamp.
    fn change_one(&mut self) {
        self.updates += 1;
        let i = (self.updates as usize).wrapping_mul(7_919) % self.results.len();
        let failing = self.results[i]["result"] != "fail";
        self.results[i] = result(&self.namespace, i, failing, T0 + self.updates as i64);
    }
}

/// Bytes this process has caused to be written to storage (`/proc/self/io`).
fn written_bytes() -> anyhow::Result<u64> {
    let io = std::fs::read_to_string("/proc/self/io").context("reading /proc/self/io")?;
    io.lines()
        .find_map(|l| l.strip_prefix("write_bytes:"))
        .and_then(|v| v.trim().parse().ok())
        .context("no write_bytes in /proc/self/io")
}

/// What the database has written so far: PostgreSQL's counters, or the bytes this process has
/// written to storage when it holds the database (SQLite in the in-process server).
async fn reading(
    server: Option<&RunningServer>,
) -> anyhow::Result<(Option<WriteActivity>, Option<u64>)> {
    let Some(s) = server else {
        return Ok((None, None));
    };
    Ok(match s.store.backend() {
        sea_orm::DbBackend::Sqlite => (None, Some(written_bytes()?)),
        _ => (s.store.write_activity().await?, None),
    })
}

/// How long a PostgreSQL backend may keep the row counts of its transactions before they reach
/// `pg_stat_user_tables`: an idle backend flushes them within 10 s (`PGSTAT_IDLE_INTERVAL`).
const STATISTICS_FLUSH: Duration = Duration::from_secs(11);

/// How long to wait before a reading for the load before it to be counted (nothing to wait for
/// but PostgreSQL's statistics).
fn statistics_flush(server: Option<&RunningServer>) -> Duration {
    match server.map(|s| s.store.backend()) {
        Some(sea_orm::DbBackend::Postgres) => STATISTICS_FLUSH,
        _ => Duration::ZERO,
    }
}

pub(super) async fn rewrite(
    args: &BenchArgs,
    client: &kube::Client,
    server: Option<&RunningServer>,
    figures: &mut Figures,
) -> anyhow::Result<()> {
    let reports = args.rewrite_reports.max(1);
    if args.kubeconfig.is_some() {
        ensure_namespaces(client, &(0..reports).map(namespace).collect::<Vec<_>>()).await?;
    }
    let results = args.rewrite_results.max(1);
    let mut states: Vec<Rewritten> = (0..reports).map(|n| Rewritten::new(n, results)).collect();
    for state in &mut states {
        let api: Api<PolicyReport> = Api::namespaced(client.clone(), &state.namespace);
        let created = api.create(&PostParams::default(), &state.report()?).await?;
        state.resource_version = created.metadata.resource_version.unwrap_or_default();
    }
    let size = serde_json::to_vec(&states[0].report()?)?.len();
    let per_report = Duration::from_secs_f64(reports as f64 / args.rewrite_rate.max(1) as f64);
    println!(
        "rewrite: {reports} reports of {results} results ({size} bytes of JSON), {} updates/s in all, one result changed each, for {} s",
        args.rewrite_rate, args.rewrite_seconds
    );
    let flush = statistics_flush(server);
    tokio::time::sleep(flush).await;
    let before = reading(server).await?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.rewrite_seconds);
    let latencies: Vec<Vec<Duration>> = try_join_all(
        states
            .iter_mut()
            .map(|state| rewrite_one(client, state, per_report, deadline)),
    )
    .await?;
    let elapsed = started.elapsed().as_secs_f64();
    tokio::time::sleep(flush).await;
    let after = reading(server).await?;
    let mut latencies: Vec<Duration> = latencies.into_iter().flatten().collect();
    latencies.sort();
    let updates = latencies.len() as f64;
    figures.add(
        "rewrite_updates_per_s",
        format!("rewrite: updates of a {results}-result report"),
        "updates/s",
        &[updates / elapsed],
        &format!(
            "{updates} in {elapsed:.1} s, {size} bytes of JSON each; p50 {:.1} ms, p99 {:.1} ms",
            millis(percentile(&latencies, 0.5)),
            millis(percentile(&latencies, 0.99))
        ),
    );
    per_update_figures(figures, &before, &after, updates, size);
    Ok(())
}

/// Replaces `state`'s report every `every` until `deadline`, one result changed each time;
/// the latency of each replace.
async fn rewrite_one(
    client: &kube::Client,
    state: &mut Rewritten,
    every: Duration,
    deadline: Instant,
) -> anyhow::Result<Vec<Duration>> {
    let api: Api<PolicyReport> = Api::namespaced(client.clone(), &state.namespace);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut latencies = Vec::new();
    while Instant::now() < deadline {
        tick.tick().await;
        state.change_one();
        let report = state.report()?;
        let sent = Instant::now();
        let stored = api
            .replace("rewritten", &PostParams::default(), &report)
            .await
            .with_context(|| format!("replacing the report in {}", state.namespace))?;
        latencies.push(sent.elapsed());
        state.resource_version = stored.metadata.resource_version.unwrap_or_default();
    }
    Ok(latencies)
}

/// The database work per update between two readings, against the report's JSON size.
fn per_update_figures(
    figures: &mut Figures,
    before: &(Option<WriteActivity>, Option<u64>),
    after: &(Option<WriteActivity>, Option<u64>),
    updates: f64,
    size: usize,
) {
    if updates == 0.0 {
        return;
    }
    if let (Some(b), Some(a)) = (&before.0, &after.0) {
        let done = a.since(b);
        let wal = done.wal_bytes as f64 / updates;
        figures.add(
            "rewrite_wal_bytes_per_update",
            "rewrite: PostgreSQL WAL per update",
            "bytes",
            &[wal],
            &format!("{:.3}x the report's JSON", wal / size as f64),
        );
        for (table, rows) in &done.rows {
            if rows.touched() == 0 {
                continue;
            }
            figures.add(
                &format!("rewrite_rows_per_update.{table}"),
                format!("rewrite: {table} rows touched per update"),
                "rows",
                &[rows.touched() as f64 / updates],
                &format!(
                    "inserted {:.1}, updated {:.1} (HOT {:.1}), deleted {:.1}",
                    rows.inserted as f64 / updates,
                    rows.updated as f64 / updates,
                    rows.hot_updated as f64 / updates,
                    rows.deleted as f64 / updates
                ),
            );
        }
    }
    if let (Some(b), Some(a)) = (before.1, after.1) {
        let written = a.saturating_sub(b) as f64 / updates;
        figures.add(
            "rewrite_process_written_bytes_per_update",
            "rewrite: bytes written to storage per update (SQLite, in the bench process)",
            "bytes",
            &[written],
            &format!("{:.3}x the report's JSON", written / size as f64),
        );
    }
}
