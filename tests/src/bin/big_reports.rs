//! `big-reports`: how big a report kube-apiserver's aggregation proxy passes to us, what each
//! size costs (create and get time through kube-apiserver, the server's memory) and whether other
//! clients are delayed meanwhile (a discovery read every 200 ms through kube-apiserver). One
//! fresh control plane and server; Trivy-shaped reports (one result per vulnerability) of each
//! `--sizes` MiB. The server runs with limits raised above the largest size so that the proxy,
//! not our `--max-request-bytes`, is what is measured. Prints a line per size and writes the
//! figures as JSON with `--json`. A benchmark, never part of CI (docs/benchmarks.md "Scale").

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use reports_server_tests::big_report_fixtures::trivy_report;
use reports_server_tests::controlplane::{ControlPlane, ControlPlaneOptions};
use reports_server_tests::delegated::{self, Server, raw_with};
use reports_server_tests::kubectl::Kubectl;
use reports_server_tests::proc_status;
use serde_json::json;

const COLLECTION: &str = "/apis/wgpolicyk8s.io/v1alpha2/namespaces/default/policyreports";

#[derive(Parser)]
#[command(about = "Push reports of growing size through kube-apiserver to reports-server")]
struct Args {
    /// Report sizes in MiB, comma-separated.
    #[arg(
        long,
        env = "BIG_REPORTS_SIZES",
        value_delimiter = ',',
        default_value = "1,4,8,16,32,64,128,256"
    )]
    sizes: Vec<usize>,
    /// Where to write the figures as JSON.
    #[arg(long, env = "BIG_REPORTS_JSON")]
    json: Option<PathBuf>,
}

/// Reads the discovery document every 200 ms until `stop`; returns (reads, failures, slowest).
async fn sample_discovery(client: kube::Client, stop: Arc<AtomicBool>) -> (u64, u64, Duration) {
    let (mut reads, mut failures, mut slowest) = (0, 0, Duration::ZERO);
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let answer = raw_with(&client, "GET", "/apis/wgpolicyk8s.io/v1alpha2", &[], None).await;
        slowest = slowest.max(t.elapsed());
        reads += 1;
        failures += u64::from(!matches!(answer, Ok((200, _))));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (reads, failures, slowest)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let largest = (args.sizes.iter().max().copied().unwrap_or(1) * 2) << 20;
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let limit = largest.to_string();
    let server = Server::start_with(
        &cp,
        &cp.dir().join("reports-server"),
        &[
            "--max-request-bytes",
            &limit,
            "--max-inflight-request-bytes",
            &limit,
            "--request-timeout-seconds",
            "600",
        ],
    )
    .await?;
    let client = cp.client().await?;
    let admin = Kubectl::new(cp.kubeconfig_path());
    delegated::register_apiservices(&cp, &server, &admin, &client).await?;
    let pid = server.pid().context("the server's pid")?;
    let (idle_mib, _) = (
        proc_status::mib(pid, "VmHWM"),
        proc_status::mib(pid, "VmRSS"),
    );
    eprintln!("[big-reports] server idle: {idle_mib} MiB");
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample_discovery(client.clone(), stop.clone()));
    let mut rows = Vec::new();
    for mib in &args.sizes {
        let name = format!("trivy-{mib}mib");
        let report = trivy_report(&name, mib << 20)?;
        let bytes = report.to_string().len();
        let t = Instant::now();
        let (created, _) = raw_with(&client, "POST", COLLECTION, &[], Some(&report)).await?;
        let create_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (got, body) =
            raw_with(&client, "GET", &format!("{COLLECTION}/{name}"), &[], None).await?;
        let get_s = t.elapsed().as_secs_f64();
        let (peak_mib, rss_mib) = (
            proc_status::mib(pid, "VmHWM"),
            proc_status::mib(pid, "VmRSS"),
        );
        eprintln!(
            "[big-reports] {mib} MiB ({bytes} bytes): create {created} in {create_s:.2} s, get {got} ({} bytes) in {get_s:.2} s; server peak {peak_mib} MiB, now {rss_mib} MiB",
            body.len()
        );
        rows.push(json!({"mib": mib, "bytes": bytes, "create_status": created, "create_seconds": create_s,
            "get_status": got, "get_bytes": body.len(), "get_seconds": get_s, "server_peak_mib": peak_mib, "server_rss_mib": rss_mib}));
    }
    stop.store(true, Ordering::Relaxed);
    let (reads, failures, slowest) = sampler.await?;
    eprintln!(
        "[big-reports] discovery through kube-apiserver meanwhile: {reads} reads, {failures} failed, slowest {slowest:.2?}"
    );
    let figures = json!({"server_idle_mib": idle_mib, "sizes": rows,
        "discovery": {"reads": reads, "failures": failures, "slowest_seconds": slowest.as_secs_f64()}});
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&figures)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    delegated::unregister_apiservices(&cp).await?;
    drop(server);
    cp.stop().await
}
