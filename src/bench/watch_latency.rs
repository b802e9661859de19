//! The `watch-latency` phase: watchers on one namespace while creates run at a steady rate; the
//! latency of each event from its write's sending (stamped into the object) to each watcher.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use reports_server_crds::PolicyReport;
use reports_server_crds::fixtures::{Subject, pss_policy_report};

use super::BenchArgs;
use super::figures::{Figures, millis, percentile};

/// The annotation carrying the moment a latency write was sent (nanoseconds since the epoch).
pub(super) const SENT_AT: &str = "bench.reports-server.io/sent-at-ns";

pub(super) fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Where run `run` of the latency load writes (created first when driving a kubeconfig): a
/// namespace of its own, empty when its watchers start (a server that replays a namespace on
/// every watch, as the peer does, then replays nothing of earlier runs).
pub(super) fn latency_namespace(run: usize) -> String {
    format!("bench-latency-{run}")
}

/// A report for the latency load: small unless `full` (a whole PSS report, ~9 KB).
pub(super) fn latency_report(namespace: &str, n: u64, full: bool) -> PolicyReport {
    let mut r = pss_policy_report(&Subject::pod(namespace, n), 1_700_000_000, &[]);
    if !full {
        r.results = None;
    }
    r.metadata.name = Some(format!("lat-{n:07}"));
    r.metadata.annotations = Some([(SENT_AT.to_owned(), now_ns().to_string())].into());
    r
}

/// One `--watchers` count: that many watchers, then the writes, then the figures.
pub(super) async fn watch_latency(
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
    let tasks: Vec<_> = (0..watchers)
        .map(|_| tokio::spawn(watch_until(api.clone(), from.clone(), expected, deadline)))
        .collect();
    // Give every watch time to be established before the first write.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = Instant::now();
    let mut ack = write_steadily(args, &api, &namespace, expected).await?;
    let write_secs = started.elapsed().as_secs_f64();
    let mut all = Vec::new();
    let mut short = 0;
    for t in tasks {
        let seen = t.await?;
        match seen.outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => bail!("a watcher failed: {e}"),
            Err(_) => bail!(
                "a watcher received {} of {expected} events before the deadline",
                seen.names.len()
            ),
        }
        if seen.names.len() as u64 != expected || seen.latencies.len() as u64 != expected {
            short += 1;
        }
        all.extend(seen.latencies);
    }
    if short > 0 {
        bail!("{short} watchers did not receive every event exactly once");
    }
    all.sort();
    ack.sort();
    let achieved = expected as f64 / write_secs;
    record(args, watchers, &all, &ack, achieved, figures);
    Ok(())
}

/// What one watcher saw.
struct Seen {
    latencies: Vec<Duration>,
    names: HashSet<String>,
    /// `Err` when the deadline passed first.
    outcome: Result<Result<(), String>, tokio::time::error::Elapsed>,
}

/// Watches from `from` until `expected` distinct objects were ADDED, resuming like any client
/// when the stream ends (timeout or cut-off), for at most `deadline`.
async fn watch_until(
    api: Api<PolicyReport>,
    from: String,
    expected: u64,
    deadline: Duration,
) -> Seen {
    let mut latencies = Vec::with_capacity(expected as usize);
    let mut names = HashSet::with_capacity(expected as usize);
    let mut rv = from;
    let run = async {
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
                    latencies.push(Duration::from_nanos(received.saturating_sub(sent) as u64));
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
    Seen {
        latencies,
        names,
        outcome: outcome.map(|r| r.map_err(|e| e.to_string())),
    }
}

/// Steady load: one create every 1/rate seconds, never more than 64 in flight; answers each
/// write's acknowledgement time.
async fn write_steadily(
    args: &BenchArgs,
    api: &Api<PolicyReport>,
    namespace: &str,
    expected: u64,
) -> anyhow::Result<Vec<Duration>> {
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / args.write_rate as f64));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let in_flight = Arc::new(tokio::sync::Semaphore::new(64));
    let mut writes = Vec::with_capacity(expected as usize);
    let full = args.latency_full_reports;
    for n in 0..expected {
        ticker.tick().await;
        let permit = in_flight.clone().acquire_owned().await?;
        let api = api.clone();
        let namespace = namespace.to_owned();
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
    Ok(ack)
}

/// The latency figures of one watcher count; `all` and `ack` sorted.
fn record(
    args: &BenchArgs,
    watchers: usize,
    all: &[Duration],
    ack: &[Duration],
    achieved: f64,
    figures: &mut Figures,
) {
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
        &[millis(percentile(all, 50.0))],
        "",
    );
    figures.add(
        &format!("watch_p99_ms.{watchers}"),
        format!("{label}: p99"),
        "ms",
        &[millis(percentile(all, 99.0))],
        &detail,
    );
    figures.add(
        &format!("write_ack_p99_ms.{watchers}"),
        format!("write acknowledgement under that load ({watchers} watchers): p99"),
        "ms",
        &[millis(percentile(ack, 99.0))],
        &format!(
            "p50 {:.1} ms; achieved {achieved:.0} creates/s",
            millis(percentile(ack, 50.0)),
        ),
    );
}
