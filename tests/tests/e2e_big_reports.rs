//! End-to-end: big policy reports through a real kube-apiserver (aggregation layer) with the
//! server's default limits.
//!
//! Why: reports are where the big objects of a cluster live. Trivy vulnerability reports of a
//! large image outgrow etcd's 1.5 MiB request limit ("etcdserver: request is too large",
//! aquasecurity/trivy-operator#441 and #757), and Kyverno's or falcosidekick's namespace reports
//! carry around 1,000 results. This server keeps reports in SQL, so the only limit is ours:
//! kube-apiserver's aggregation proxy passes request bodies through unchanged (measured: at least
//! 256 MiB), and the server refuses a body above `--max-request-bytes` (default 8 MiB) with 413
//! `RequestEntityTooLarge`.
//!
//! One test, through kube-apiserver with kube-rs, on `policyreports.wgpolicyk8s.io/v1alpha2`:
//! a watch opened before any write; a 1,000-result Kyverno-like report and a ~4 MB Trivy-shaped
//! one created, read back and listed (full and metadata-only); the Trivy report replaced with one
//! result changed; a report just under 8 MiB accepted and one just over refused with 413 (and not
//! stored); the watch saw every write with all its results. Meanwhile a sampler reads the group's
//! discovery document every 200 ms: a big request must neither stall other clients nor make
//! kube-apiserver mark the APIService unavailable (its availability probe gives up after 5 s).
//! Timings and the server's peak RSS are printed, never asserted.
//!
//! Needs what `e2e_aggregated` needs (the Go-built control plane, `kubectl`, `openssl`);
//! `REPORTS_SERVER_E2E_BACKEND=postgres` runs the server on PostgreSQL instead of SQLite.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use kube::{
    Api, ResourceExt as _,
    api::{
        ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams, WatchEvent,
        WatchParams,
    },
};
use reports_server_tests::{
    big_report_fixtures::{GROUP_VERSION, NS, json_len, kyverno_report, trivy_report},
    controlplane::{ControlPlane, ControlPlaneOptions},
    delegated::{self, Server, raw, raw_with},
    kube_client_with_retries,
    kubectl::{Kubectl, kubectl_path},
    proc_status, server,
};
use serde_json::{Value, json};

const PLURAL: &str = "policyreports";
const MIB: usize = 1 << 20;
/// The server's default `--max-request-bytes`.
const MAX_REQUEST_BYTES: usize = 8 * MIB;
/// How far under and over that limit the boundary reports are.
const MARGIN: usize = 64 * 1024;
const KYVERNO_RESULTS: usize = 1_000;
const TRIVY_BYTES: usize = 4_000_000;
const WATCH_TIMEOUT: Duration = Duration::from_secs(60);
const SAMPLE_EVERY: Duration = Duration::from_millis(200);

const KYVERNO: &str = "kyverno-1000-results";
const TRIVY: &str = "trivy-4mb";
const LARGEST: &str = "just-under-limit";
const TOO_LARGE: &str = "just-over-limit";

// ---- one control plane + one server ------------------------------------------------------------

struct Env {
    // Dropped in this order: the server before the control plane.
    server: Server,
    cp: ControlPlane,
    /// kube-rs as the admin, through kube-apiserver.
    client: kube::Client,
    t0: Instant,
}

impl Env {
    async fn start() -> Result<Env> {
        kubectl_path()?;
        // Build first: `cargo build` can take minutes, the control plane is up in seconds.
        let t = Instant::now();
        server::binary().context("building reports-server")?;
        eprintln!("[big] reports-server binary built in {:.1?}", t.elapsed());
        let t0 = Instant::now();
        let cp = ControlPlane::start(ControlPlaneOptions::default())
            .await
            .context("starting the e2e control plane (see docs/e2e.md)")?;
        // No limit flags: the defaults are what this test is about.
        let server = Server::start(&cp, &cp.dir().join("reports-server")).await?;
        let admin = Kubectl::new(cp.kubeconfig_path());
        let client = cp.client().await?;
        delegated::register_apiservices(&cp, &server, &admin, &client).await?;
        eprintln!(
            "[big] control plane + server ({}) + APIServices Available in {:.1?}",
            std::env::var("REPORTS_SERVER_E2E_BACKEND").unwrap_or_else(|_| "sqlite".into()),
            t0.elapsed()
        );
        Ok(Env {
            server,
            cp,
            client,
            t0,
        })
    }

    fn diagnostics(&self) -> String {
        delegated::diagnostics(&self.cp, &self.server)
    }

    fn api(&self) -> Api<DynamicObject> {
        let (group, version) = GROUP_VERSION.split_once('/').expect("group/version");
        let gvk = GroupVersionKind::gvk(group, version, "PolicyReport");
        let ar = ApiResource::from_gvk_with_plural(&gvk, PLURAL);
        Api::namespaced_with(self.client.clone(), NS, &ar)
    }

    /// Prints the server's peak RSS, deletes the APIServices (so that nothing blocks on
    /// discovery once the server is gone), then stops the server and the control plane.
    async fn stop(self) -> Result<()> {
        let Env {
            mut server, cp, t0, ..
        } = self;
        match server.pid() {
            Some(pid) => eprintln!(
                "[big] reports-server memory: VmHWM {} MiB, VmRSS {} MiB",
                proc_status::mib(pid, "VmHWM"),
                proc_status::mib(pid, "VmRSS")
            ),
            None => eprintln!("[big] reports-server is not running"),
        }
        delegated::unregister_apiservices(&cp).await?;
        server.kill();
        cp.stop().await?;
        eprintln!("[big] done in {:.1?}", t0.elapsed());
        Ok(())
    }
}

// ---- the reports -------------------------------------------------------------------------------

fn results_of(v: &Value) -> usize {
    v["results"].as_array().map_or(0, Vec::len)
}

fn dynamic(report: &Value) -> Result<DynamicObject> {
    serde_json::from_value(report.clone()).context("a report is a DynamicObject")
}

/// Where two `results` arrays first differ (they are too big to print whole).
fn first_difference(sent: &Value, got: &Value) -> String {
    let (Some(a), Some(b)) = (sent.as_array(), got.as_array()) else {
        return format!("results is not an array: {:.200}", got.to_string());
    };
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => format!("result {i} differs:\n sent {}\n  got {}", a[i], b[i]),
        None => format!("{} results sent, {} returned", a.len(), b.len()),
    }
}

// ---- the watch ---------------------------------------------------------------------------------

/// (type, name, number of results) of every event of a watch through kube-apiserver.
type Events = Arc<Mutex<Vec<(String, String, usize)>>>;

struct Watch {
    events: Events,
    task: tokio::task::JoinHandle<()>,
}

impl Watch {
    /// Opens the watch at the resourceVersion of a list, so that it sees every later write.
    async fn start(api: &Api<DynamicObject>) -> Result<Watch> {
        let rv = api
            .list(&ListParams::default())
            .await
            .context("listing policyreports before the watch")?
            .metadata
            .resource_version
            .context("the list has no resourceVersion")?;
        let mut stream = api
            .watch(&WatchParams::default().timeout(290), &rv)
            .await
            .with_context(|| format!("watching policyreports from resourceVersion {rv}"))?
            .boxed();
        let events: Events = Arc::default();
        let sink = events.clone();
        let task = tokio::spawn(async move {
            while let Some(ev) = stream.next().await {
                let (kind, obj) = match ev {
                    Ok(WatchEvent::Added(o)) => ("ADDED", o),
                    Ok(WatchEvent::Modified(o)) => ("MODIFIED", o),
                    Ok(WatchEvent::Deleted(o)) => ("DELETED", o),
                    Ok(WatchEvent::Bookmark(_)) => continue,
                    Ok(WatchEvent::Error(e)) => {
                        sink.lock()
                            .unwrap()
                            .push(("ERROR".into(), format!("{e:?}"), 0));
                        break;
                    }
                    Err(e) => {
                        sink.lock()
                            .unwrap()
                            .push(("ERROR".into(), e.to_string(), 0));
                        break;
                    }
                };
                let n = obj.data["results"].as_array().map_or(0, Vec::len);
                sink.lock().unwrap().push((kind.into(), obj.name_any(), n));
            }
            sink.lock().unwrap().push(("END".into(), String::new(), 0));
        });
        Ok(Watch { events, task })
    }

    /// Waits until the watch has delivered `expected.len()` events (or ended), then compares.
    async fn expect(self, expected: &[(&str, &str, usize)], diagnostics: &str) -> Result<()> {
        let t = Instant::now();
        let done = |events: &Vec<(String, String, usize)>| {
            events.len() >= expected.len()
                || events.iter().any(|(k, ..)| k == "ERROR" || k == "END")
        };
        while !done(&self.events.lock().unwrap()) && t.elapsed() < WATCH_TIMEOUT {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // A moment more for any event that should not be there.
        tokio::time::sleep(Duration::from_millis(500)).await;
        self.task.abort();
        let events = self.events.lock().unwrap().clone();
        eprintln!("[big] watch events after {:.1?}: {events:?}", t.elapsed());
        let want: Vec<(String, String, usize)> = expected
            .iter()
            .map(|(k, n, c)| (k.to_string(), n.to_string(), *c))
            .collect();
        ensure!(
            events == want,
            "the watch through kube-apiserver delivered {events:?}, expected {want:?} (waited up \
             to {WATCH_TIMEOUT:?})\n{diagnostics}"
        );
        Ok(())
    }
}

// ---- the discovery sampler ---------------------------------------------------------------------

struct Sample {
    /// Since the sampler started.
    at: Duration,
    latency: Duration,
    /// The status, or why there was none.
    outcome: Result<u16, String>,
    body: String,
}

/// GETs the group's discovery document through kube-apiserver every 200 ms, on a client of its
/// own that does not retry (a 503 must show).
struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<Sample>>,
}

impl Sampler {
    async fn start(cp: &ControlPlane) -> Result<Sampler> {
        let client = kube_client_with_retries(cp.kubeconfig_path(), false).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let path = format!("/apis/{GROUP_VERSION}");
            let mut samples = Vec::new();
            let t0 = Instant::now();
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stopped.load(Ordering::SeqCst) {
                tick.tick().await;
                let at = t0.elapsed();
                let t = Instant::now();
                let res = tokio::time::timeout(Duration::from_secs(30), raw(&client, "GET", &path));
                let (outcome, body) = match res.await {
                    Ok(Ok((status, body))) => (Ok(status), body),
                    Ok(Err(e)) => (Err(format!("{e:#}")), String::new()),
                    Err(_) => (Err("no answer within 30s".into()), String::new()),
                };
                let latency = t.elapsed();
                samples.push(Sample {
                    at,
                    latency,
                    outcome,
                    body,
                });
            }
            samples
        });
        Ok(Sampler { stop, task })
    }

    /// Stops sampling; every sample must have been a 200.
    async fn finish(self, diagnostics: impl FnOnce() -> String) -> Result<()> {
        self.stop.store(true, Ordering::SeqCst);
        let samples = self.task.await.context("the discovery sampler panicked")?;
        ensure!(!samples.is_empty(), "the discovery sampler took no sample");
        let slowest = samples.iter().max_by_key(|s| s.latency).expect("not empty");
        eprintln!(
            "[big] discovery GET /apis/{GROUP_VERSION} through kube-apiserver: {} samples, \
             slowest {:.1?} (at {:.1?})",
            samples.len(),
            slowest.latency,
            slowest.at
        );
        let bad: Vec<String> = samples
            .iter()
            .filter(|s| s.outcome != Ok(200))
            .map(|s| {
                let body: String = s.body.chars().take(300).collect();
                format!(
                    "at {:.1?} after {:.1?}: {:?} {body}",
                    s.at, s.latency, s.outcome
                )
            })
            .collect();
        if !bad.is_empty() {
            bail!(
                "{} of {} discovery samples were not 200 (a big request stalled other clients or \
                 made the APIService unavailable):\n{}\n{}",
                bad.len(),
                samples.len(),
                bad.join("\n"),
                diagnostics()
            );
        }
        Ok(())
    }
}

// ---- the steps ---------------------------------------------------------------------------------

/// Creates `report` with kube-rs, then GETs it back: the same results and summary.
async fn create_and_read_back(env: &Env, report: &Value) -> Result<()> {
    let api = env.api();
    let obj = dynamic(report)?;
    let name = obj.name_any();
    let bytes = serde_json::to_vec(&obj)?.len();
    let t = Instant::now();
    api.create(&PostParams::default(), &obj)
        .await
        .with_context(|| format!("creating {name} ({bytes} bytes)\n{}", env.diagnostics()))?;
    let created = t.elapsed();
    let t = Instant::now();
    let got = api
        .get(&name)
        .await
        .with_context(|| format!("getting {name}\n{}", env.diagnostics()))?;
    eprintln!(
        "[big] {name}: {} results, {bytes} bytes; create {created:.1?}, get {:.1?}",
        results_of(report),
        t.elapsed()
    );
    same_report(&name, report, &got)
}

fn same_report(name: &str, sent: &Value, got: &DynamicObject) -> Result<()> {
    ensure!(
        got.data["results"] == sent["results"],
        "{name}: GET returned other results than were sent: {}",
        first_difference(&sent["results"], &got.data["results"])
    );
    ensure!(
        got.data["summary"] == sent["summary"],
        "{name}: summary sent {}, got {}",
        sent["summary"],
        got.data["summary"]
    );
    Ok(())
}

/// The full list carries every result; the metadata-only list the names and no results.
async fn check_lists(env: &Env, expected: &[(&str, usize)]) -> Result<()> {
    let t = Instant::now();
    let list = env
        .api()
        .list(&ListParams::default())
        .await
        .with_context(|| format!("listing policyreports\n{}", env.diagnostics()))?;
    eprintln!(
        "[big] list of {} reports in {:.1?}",
        list.items.len(),
        t.elapsed()
    );
    for (name, n) in expected {
        let item = list
            .items
            .iter()
            .find(|o| o.name_any() == *name)
            .with_context(|| format!("{name} missing from the list"))?;
        let got = item.data["results"].as_array().map_or(0, Vec::len);
        ensure!(
            got == *n,
            "{name} in the list has {got} results, {n} were sent"
        );
    }
    let path = format!("/apis/{GROUP_VERSION}/namespaces/{NS}/{PLURAL}");
    let accept = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1";
    let (status, body) = raw_with(&env.client, "GET", &path, &[("Accept", accept)], None).await?;
    ensure!(
        status == 200,
        "metadata-only list: {status} {body:.500}\n{}",
        env.diagnostics()
    );
    eprintln!("[big] metadata-only list: {} bytes", body.len());
    let meta: Value = serde_json::from_str(&body).context("metadata-only list is not JSON")?;
    ensure!(
        meta["kind"] == "PartialObjectMetadataList",
        "metadata-only list kind: {}",
        meta["kind"]
    );
    let items = meta["items"]
        .as_array()
        .context("metadata-only list has no items")?;
    for (name, _) in expected {
        ensure!(
            items.iter().any(|i| i["metadata"]["name"] == *name),
            "{name} missing from the metadata-only list"
        );
    }
    ensure!(
        items
            .iter()
            .all(|i| i.get("results").is_none() && i.get("summary").is_none()),
        "the metadata-only list carries report content: {body:.500}"
    );
    Ok(())
}

/// Replaces `name` (PUT with its resourceVersion) with one result changed; GET shows it.
async fn replace_one_result(env: &Env, name: &str) -> Result<()> {
    let api = env.api();
    let mut obj = api
        .get(name)
        .await
        .with_context(|| format!("getting {name}"))?;
    let before = obj.resource_version().context("no resourceVersion")?;
    let results = obj.data["results"].as_array_mut().context("no results")?;
    let i = results.len() / 2;
    results[i]["properties"]["fixedVersion"] = json!("99.0.0-replaced");
    results[i]["message"] = json!("replaced by the e2e test: one result changed");
    let expected = obj.data["results"].clone();
    let bytes = serde_json::to_vec(&obj)?.len();
    let t = Instant::now();
    let replaced = api
        .replace(name, &PostParams::default(), &obj)
        .await
        .with_context(|| format!("replacing {name} ({bytes} bytes)\n{}", env.diagnostics()))?;
    eprintln!(
        "[big] {name}: replace of {bytes} bytes in {:.1?}",
        t.elapsed()
    );
    ensure!(
        replaced.resource_version().as_deref() != Some(before.as_str()),
        "{name}: the replace kept resourceVersion {before}"
    );
    let got = api
        .get(name)
        .await
        .with_context(|| format!("getting {name}"))?;
    ensure!(
        got.data["results"] == expected,
        "{name}: after the replace GET returned {}",
        first_difference(&expected, &got.data["results"])
    );
    Ok(())
}

/// The largest accepted body: just under `--max-request-bytes` → 201 and readable; just over →
/// 413 through kube-apiserver, and nothing stored. Returns the accepted report's result count.
async fn limit_boundary(env: &Env) -> Result<usize> {
    let path = format!("/apis/{GROUP_VERSION}/namespaces/{NS}/{PLURAL}");
    let under = trivy_report(LARGEST, MAX_REQUEST_BYTES - MARGIN)?;
    let over = trivy_report(TOO_LARGE, MAX_REQUEST_BYTES + MARGIN)?;

    let t = Instant::now();
    let (status, body) = raw_with(&env.client, "POST", &path, &[], Some(&under)).await?;
    ensure!(
        status == 201,
        "{LARGEST} ({} bytes, under the {MAX_REQUEST_BYTES}-byte limit): {status} {body:.500}\n{}",
        json_len(&under),
        env.diagnostics()
    );
    let created = t.elapsed();
    let t = Instant::now();
    let got = env
        .api()
        .get(LARGEST)
        .await
        .with_context(|| format!("getting {LARGEST}\n{}", env.diagnostics()))?;
    eprintln!(
        "[big] {LARGEST}: {} results, {} bytes; create {created:.1?}, get {:.1?}",
        results_of(&under),
        json_len(&under),
        t.elapsed()
    );
    same_report(LARGEST, &under, &got)?;

    let t = Instant::now();
    let (status, body) = raw_with(&env.client, "POST", &path, &[], Some(&over)).await?;
    let took = t.elapsed();
    let refusal: Value = serde_json::from_str(&body).with_context(|| {
        format!("{TOO_LARGE}: {status} with a body that is not a Status: {body:.500}")
    })?;
    let message = refusal["message"].as_str().unwrap_or_default();
    eprintln!(
        "[big] {TOO_LARGE}: {} bytes refused with {status} {} in {took:.1?}: {message}",
        json_len(&over),
        refusal["reason"]
    );
    ensure!(
        status == 413
            && refusal["kind"] == "Status"
            && refusal["reason"] == "RequestEntityTooLarge"
            && message.contains("--max-request-bytes"),
        "{TOO_LARGE} ({} bytes, over the {MAX_REQUEST_BYTES}-byte limit): expected 413 \
         RequestEntityTooLarge naming --max-request-bytes, got {status} {body:.500}\n{}",
        json_len(&over),
        env.diagnostics()
    );
    let (status, body) = raw(&env.client, "GET", &format!("{path}/{TOO_LARGE}")).await?;
    ensure!(
        status == 404,
        "GET {TOO_LARGE} after the 413: {status} {body:.300}"
    );
    Ok(results_of(&under))
}

// ---- the test ----------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_reports_through_kube_apiserver_with_default_limits() -> Result<()> {
    let env = Env::start().await?;
    // Built before the sampler starts, so that building them does not delay its samples.
    let kyverno = kyverno_report(KYVERNO, KYVERNO_RESULTS);
    let trivy = trivy_report(TRIVY, TRIVY_BYTES)?;
    let (kyverno_n, trivy_n) = (results_of(&kyverno), results_of(&trivy));

    let watch = Watch::start(&env.api()).await?;
    let sampler = Sampler::start(&env.cp).await?;
    let steps = async {
        create_and_read_back(&env, &kyverno).await?;
        create_and_read_back(&env, &trivy).await?;
        check_lists(&env, &[(KYVERNO, kyverno_n), (TRIVY, trivy_n)]).await?;
        replace_one_result(&env, TRIVY).await?;
        limit_boundary(&env).await
    };
    let steps = steps.await;
    // The sampler's verdict even when a step failed: a stall may be the cause.
    let sampled = sampler.finish(|| env.diagnostics()).await;
    let largest_n = steps.map_err(|e| match &sampled {
        Err(s) => e.context(format!("and the discovery sampler failed too: {s:#}")),
        Ok(()) => e,
    })?;
    sampled?;
    watch
        .expect(
            &[
                ("ADDED", KYVERNO, kyverno_n),
                ("ADDED", TRIVY, trivy_n),
                ("MODIFIED", TRIVY, trivy_n),
                ("ADDED", LARGEST, largest_n),
            ],
            &env.diagnostics(),
        )
        .await?;
    env.stop().await
}
