//! `reports-server aggregate --kubeconfig` against a real kube-apiserver with the report CRDs
//! stored in etcd: Kyverno-like ephemeral reports for ConfigMaps become per-resource
//! PolicyReports (name = subject uid, scope, ownerReference, merged results, summary) and are
//! deleted; an un-owned admission report is adopted (owner found through discovery) and
//! merged; one whose resource does not exist is deleted once older than the grace period; a
//! deleted ClusterPolicy's results are dropped on the next pass; and an aggregator killed with
//! SIGKILL in the middle of a namespace loses and doubles nothing once a successor has taken
//! over the Lease.
//!
//! Needs what the control plane needs (Go or `REPORTS_SERVER_CONTROLPLANE_BIN`, kubectl,
//! openssl); a missing piece fails the test with what to install. See docs/e2e.md.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, ObjectMeta, PostParams};
use reports_server_crds::fixtures::{PSS_RULES, Subject, pss_ephemeral_report};
use reports_server_crds::{
    ClusterEphemeralReport, ClusterPolicyReport, EphemeralReport, PolicyReport, PolicyResult,
    ReportResult,
};
use reports_server_tests::controlplane::{ControlPlane, ControlPlaneOptions, spawn_tied_to_test};
use reports_server_tests::kubectl::Kubectl;
use reports_server_tests::kyverno_fixtures::{
    CLUSTER_POLICY_CRD, admission_report, background_report, cluster_policy_api,
    pss_cluster_policies, subject_of,
};
use reports_server_tests::server::{binary, free_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const T0: i64 = 1_700_000_000;
/// `--adoption-grace-period` of the test (Kyverno's default, 2 minutes, would make it slow).
const GRACE: Duration = Duration::from_secs(20);
const LEASE_NAMESPACE: &str = "default";
const LEASE_NAME: &str = "reports-server-aggregator";
/// The policy deleted half-way (rule `host-path`).
const DELETED_POLICY: &str = "disallow-host-path";

/// `reports-server aggregate --kubeconfig …` as a child process.
struct AggregatorProcess {
    child: Option<Child>,
    log: PathBuf,
    metrics_port: u16,
}

impl AggregatorProcess {
    fn start(
        bin: &Path,
        kubeconfig: &Path,
        dir: &Path,
        name: &str,
        extra: &[&str],
    ) -> Result<Self> {
        let log = dir.join(format!("{name}.log"));
        let metrics_port = free_port();
        let mut cmd = Command::new(bin);
        cmd.arg("aggregate")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--aggregation-delay", "1s"])
            .args(["--adoption-grace-period", &format!("{}s", GRACE.as_secs())])
            .args(["--adoption-retry", "2s"])
            .args(["--lease-namespace", LEASE_NAMESPACE])
            .args(["--lease-duration", "6s"])
            .args([
                "--metrics-bind-address",
                &format!("127.0.0.1:{metrics_port}"),
            ])
            .args(extra)
            .env("REPORTS_SERVER_LOG", "info,reports_server_aggregator=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        let child = spawn_tied_to_test(cmd).context("spawn reports-server aggregate")?;
        eprintln!(
            "[e2e-agg] started {name} (pid {}), log {}",
            child.id(),
            log.display()
        );
        Ok(AggregatorProcess {
            child: Some(child),
            log,
            metrics_port,
        })
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Fails if the process has exited.
    fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self
            .child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
        {
            bail!("the aggregator exited with {status}:\n{}", self.log_tail());
        }
        Ok(())
    }

    /// SIGKILL: no lease release, no graceful stop, as in a crash.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for AggregatorProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `check` every 100 ms until it holds; on timeout fails with the aggregator's log.
async fn eventually<F, Fut>(
    what: &str,
    timeout: Duration,
    agg: &mut AggregatorProcess,
    mut check: F,
) -> Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let start = Instant::now();
    loop {
        agg.check_alive()?;
        if check().await? {
            eprintln!("[e2e-agg] {what}: after {:.1?}", start.elapsed());
            return Ok(start.elapsed());
        }
        if start.elapsed() > timeout {
            bail!(
                "{what}: not true after {timeout:?}; aggregator log:\n{}",
                agg.log_tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A plain HTTP/1.1 GET on 127.0.0.1 (status, body).
async fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no HTTP status line")?;
    let body = response
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    Ok((status, body))
}

/// What a subject's PolicyReport must hold.
struct Expected<'a> {
    ts: i64,
    /// Indexes into PSS_RULES of the failing rules.
    failing: &'a [usize],
    /// Whether the deleted policy's results must be gone.
    policy_deleted: bool,
}

fn check_results(what: &str, results: &[ReportResult], expected: &Expected<'_>) -> Result<()> {
    let wanted: BTreeSet<(&str, &str)> = PSS_RULES
        .iter()
        .filter(|(p, _, _)| !(expected.policy_deleted && *p == DELETED_POLICY))
        .map(|(p, r, _)| (*p, *r))
        .collect();
    let got: Vec<(&str, &str)> = results
        .iter()
        .map(|r| (r.policy.as_str(), r.rule.as_deref().unwrap_or_default()))
        .collect();
    let unique: BTreeSet<(&str, &str)> = got.iter().copied().collect();
    if unique.len() != got.len() {
        bail!("{what}: a result is stored twice: {got:?}");
    }
    if unique != wanted {
        bail!(
            "{what}: results {:?} differ from the expected {:?}",
            unique.symmetric_difference(&wanted).collect::<Vec<_>>(),
            wanted.len()
        );
    }
    let failing: BTreeSet<&str> = expected.failing.iter().map(|i| PSS_RULES[*i].1).collect();
    for r in results {
        let ts = r.timestamp.as_ref().map(|t| t.seconds);
        if ts != Some(expected.ts) {
            bail!(
                "{what}: {}/{:?} has timestamp {ts:?}, expected {} (the newest)",
                r.policy,
                r.rule,
                expected.ts
            );
        }
        let fails = failing.contains(r.rule.as_deref().unwrap_or_default());
        let want = if fails {
            PolicyResult::Fail
        } else {
            PolicyResult::Pass
        };
        if r.result != Some(want) {
            bail!(
                "{what}: {}/{:?} is {:?}, expected {want:?}",
                r.policy,
                r.rule,
                r.result
            );
        }
    }
    Ok(())
}

/// Checks a subject's per-resource PolicyReport completely.
fn check_report(report: &PolicyReport, cm: &ConfigMap, expected: &Expected<'_>) -> Result<()> {
    let subject = subject_of(cm);
    let what = format!("PolicyReport {}/{}", subject.namespace, subject.uid);
    let labels = report.metadata.labels.clone().unwrap_or_default();
    if labels
        != BTreeMap::from([(
            "app.kubernetes.io/managed-by".to_owned(),
            "kyverno".to_owned(),
        )])
    {
        bail!("{what}: labels {labels:?}");
    }
    let scope = report.scope.as_ref().context("no scope")?;
    let scope_ok = scope.kind.as_deref() == Some("ConfigMap")
        && scope.api_version.as_deref() == Some("v1")
        && scope.name.as_deref() == Some(subject.name.as_str())
        && scope.namespace.as_deref() == Some(subject.namespace.as_str())
        && scope.uid.as_deref() == Some(subject.uid.as_str());
    if !scope_ok {
        bail!("{what}: scope {scope:?}");
    }
    let owners = report.metadata.owner_references.clone().unwrap_or_default();
    let want_owner = OwnerReference {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: subject.name.clone(),
        uid: subject.uid.clone(),
        ..Default::default()
    };
    if owners != [want_owner] {
        bail!("{what}: ownerReferences {owners:?}");
    }
    let results = report.results.as_deref().unwrap_or_default();
    check_results(&what, results, expected)?;
    let summary = report.summary.as_ref().context("no summary")?;
    let fails = results
        .iter()
        .filter(|r| r.result == Some(PolicyResult::Fail))
        .count() as i64;
    let passes = results
        .iter()
        .filter(|r| r.result == Some(PolicyResult::Pass))
        .count() as i64;
    if (summary.fail, summary.pass) != (Some(fails), Some(passes)) {
        bail!("{what}: summary {summary:?}, results say fail={fails} pass={passes}");
    }
    Ok(())
}

/// Every ConfigMap's report once the ClusterPolicy is gone: the first ConfigMap has its newer
/// admission results, the others their background results, none has the deleted policy's.
async fn check_reports_after_policy_deletion(
    client: &kube::Client,
    cms: &[&ConfigMap],
) -> Result<()> {
    for (i, cm) in cms.iter().enumerate() {
        let ns = cm.metadata.namespace.as_deref().unwrap();
        let report = Api::<PolicyReport>::namespaced(client.clone(), ns)
            .get(cm.metadata.uid.as_deref().unwrap())
            .await?;
        let (ts, failing) = if i == 0 {
            (T0 + 60, vec![5])
        } else {
            (T0, vec![i % PSS_RULES.len()])
        };
        check_report(
            &report,
            cm,
            &Expected {
                ts,
                failing: &failing,
                policy_deleted: true,
            },
        )?;
    }
    Ok(())
}

async fn create_namespace(client: &kube::Client, name: &str) -> Result<Namespace> {
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Ok(Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?)
}

async fn create_configmaps(client: &kube::Client, ns: &str, n: usize) -> Result<Vec<ConfigMap>> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let mut out = Vec::new();
    for i in 0..n {
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(format!("cm-{i}")),
                ..Default::default()
            },
            data: Some(BTreeMap::from([("i".to_owned(), i.to_string())])),
            ..Default::default()
        };
        out.push(api.create(&PostParams::default(), &cm).await?);
    }
    Ok(out)
}

async fn ephemeral_names(client: &kube::Client, ns: &str) -> Result<BTreeSet<String>> {
    Ok(Api::<EphemeralReport>::namespaced(client.clone(), ns)
        .list_metadata(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|o| o.metadata.name)
        .collect())
}

async fn policy_reports(client: &kube::Client, ns: &str) -> Result<BTreeMap<String, PolicyReport>> {
    Ok(Api::<PolicyReport>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|r| (r.metadata.name.clone().unwrap_or_default(), r))
        .collect())
}

fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregator_through_kube_apiserver() -> Result<()> {
    let started = Instant::now();
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .context("starting the e2e control plane (see docs/e2e.md)")?;
    let kubeconfig = cp.kubeconfig_path().to_owned();
    let kubectl = Kubectl::new(&kubeconfig);
    let bin = binary()?;
    let logs = tempfile::tempdir()?;
    let logs_dir = if std::env::var("REPORTS_SERVER_KEEP_E2E").is_ok_and(|v| v == "1") {
        logs.keep()
    } else {
        logs.path().to_owned()
    };

    // The report CRDs exactly as `reports-server crds` prints them, plus a minimal ClusterPolicy
    // CRD; no Policy CRD, so namespaced Kyverno policies stay unknown.
    let crds = Command::new(&bin).arg("crds").output()?;
    assert!(crds.status.success(), "reports-server crds failed");
    kubectl.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&String::from_utf8(crds.stdout)?),
    )?;
    kubectl.run_with_stdin(&["apply", "-f", "-"], Some(CLUSTER_POLICY_CRD))?;
    kubectl.run(&[
        "wait",
        "--for=condition=Established",
        "crd",
        "--all",
        "--timeout=60s",
    ])?;
    let client = cp.client().await?;
    let cpols = cluster_policy_api(&client);
    for policy in pss_cluster_policies() {
        let object: DynamicObject = serde_json::from_value(policy)?;
        cpols.create(&PostParams::default(), &object).await?;
    }
    eprintln!(
        "[e2e-agg] CRDs and 17 ClusterPolicies installed after {:.1?}",
        started.elapsed()
    );

    // Subjects and Kyverno-like ephemeral reports.
    let ns_a = create_namespace(&client, "agg-a").await?;
    create_namespace(&client, "agg-b").await?;
    let cms_a = create_configmaps(&client, "agg-a", 3).await?;
    let cms_b = create_configmaps(&client, "agg-b", 3).await?;
    for (i, cm) in cms_a.iter().chain(&cms_b).enumerate() {
        let ns = cm.metadata.namespace.clone().unwrap();
        let report = background_report(&subject_of(cm), "bg", T0, &[i % PSS_RULES.len()]);
        Api::<EphemeralReport>::namespaced(client.clone(), &ns)
            .create(&PostParams::default(), &report)
            .await?;
    }
    // agg-a/cm-0 was just updated: its admission report is newer than the scan and says rule 5
    // fails. It has no owner: the aggregator must adopt it.
    let cm0 = &cms_a[0];
    let adm = admission_report(&subject_of(cm0), "3c1f7d0e-adm-x1", T0 + 60, &[5]);
    Api::<EphemeralReport>::namespaced(client.clone(), "agg-a")
        .create(&PostParams::default(), &adm)
        .await?;
    // An admission report for a ConfigMap that does not exist (deleted before adoption).
    let ghost = Subject {
        namespace: "agg-b".into(),
        name: "ghost".into(),
        uid: "00000000-dead-4000-8000-000000000000".into(),
    };
    let ghost_created = Instant::now();
    Api::<EphemeralReport>::namespaced(client.clone(), "agg-b")
        .create(
            &PostParams::default(),
            &admission_report(&ghost, "9e2b-adm-ghost", T0 + 60, &[]),
        )
        .await?;
    // A cluster-scoped subject: the namespace agg-a.
    let ns_subject = Subject {
        namespace: String::new(),
        name: "agg-a".into(),
        uid: ns_a.metadata.uid.clone().unwrap(),
    };
    let mut cluster_eph = pss_ephemeral_report(&ns_subject, T0, &[3]);
    cluster_eph.metadata.namespace = None;
    for owner in cluster_eph.metadata.owner_references.iter_mut().flatten() {
        owner.kind = "Namespace".into();
    }
    let cluster_eph = ClusterEphemeralReport {
        metadata: cluster_eph.metadata,
        spec: cluster_eph.spec,
        ..Default::default()
    };
    Api::<ClusterEphemeralReport>::all(client.clone())
        .create(&PostParams::default(), &cluster_eph)
        .await?;

    // ---- 1. aggregation, adoption ----------------------------------------------------------
    let mut agg = AggregatorProcess::start(&bin, &kubeconfig, &logs_dir, "aggregator-1", &[])?;
    let all_cms: Vec<&ConfigMap> = cms_a.iter().chain(&cms_b).collect();
    eventually(
        "every ConfigMap has its PolicyReport, inputs consumed",
        Duration::from_secs(90),
        &mut agg,
        || async {
            for ns in ["agg-a", "agg-b"] {
                let reports = policy_reports(&client, ns).await?;
                let cms = all_cms
                    .iter()
                    .filter(|c| c.metadata.namespace.as_deref() == Some(ns));
                if cms
                    .clone()
                    .any(|c| !reports.contains_key(c.metadata.uid.as_deref().unwrap()))
                {
                    return Ok(false);
                }
            }
            // Cluster scope is its own queue entry: it may finish after the namespaces.
            let cluster_reports = Api::<ClusterPolicyReport>::all(client.clone());
            if cluster_reports.get_opt(&ns_subject.uid).await?.is_none() {
                return Ok(false);
            }
            let cluster_left = Api::<ClusterEphemeralReport>::all(client.clone())
                .list_metadata(&ListParams::default())
                .await?;
            if !cluster_left.items.is_empty() {
                return Ok(false);
            }
            let left_a = ephemeral_names(&client, "agg-a").await?;
            let left_b = ephemeral_names(&client, "agg-b").await?;
            Ok(left_a.is_empty() && left_b.iter().all(|n| n == "9e2b-adm-ghost"))
        },
    )
    .await?;
    for (i, cm) in all_cms.iter().enumerate() {
        let ns = cm.metadata.namespace.as_deref().unwrap();
        let report = Api::<PolicyReport>::namespaced(client.clone(), ns)
            .get(cm.metadata.uid.as_deref().unwrap())
            .await?;
        let expected = if i == 0 {
            // The adopted admission report's results are newer and win everywhere.
            Expected {
                ts: T0 + 60,
                failing: &[5],
                policy_deleted: false,
            }
        } else {
            Expected {
                ts: T0,
                failing: &[i % PSS_RULES.len()],
                policy_deleted: false,
            }
        };
        check_report(&report, cm, &expected)?;
    }
    let cluster_report = Api::<ClusterPolicyReport>::all(client.clone())
        .get(&ns_subject.uid)
        .await
        .context("the ClusterPolicyReport of namespace agg-a")?;
    check_results(
        "ClusterPolicyReport",
        cluster_report.results.as_deref().unwrap_or_default(),
        &Expected {
            ts: T0,
            failing: &[3],
            policy_deleted: false,
        },
    )?;
    assert_eq!(
        cluster_report
            .scope
            .as_ref()
            .and_then(|s| s.kind.as_deref()),
        Some("Namespace")
    );
    assert!(
        Api::<ClusterEphemeralReport>::all(client.clone())
            .list_metadata(&ListParams::default())
            .await?
            .items
            .is_empty(),
        "the cluster ephemeral report was not consumed"
    );
    eprintln!(
        "[e2e-agg] 6 PolicyReports and 1 ClusterPolicyReport checked (scope, owner, labels, results, summary)"
    );

    // The metrics endpoint, the Lease, and the adoption counter.
    let (status, health) = http_get(agg.metrics_port, "/healthz").await?;
    assert_eq!((status, health.trim()), (200, "ok"));
    let (status, metrics) = http_get(agg.metrics_port, "/metrics").await?;
    assert_eq!(status, 200, "{metrics}");
    assert_eq!(
        metric(&metrics, "reports_server_aggregation_leader "),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "reports_server_aggregation_adoptions_total{outcome=\"adopted\"} "
        ),
        Some(1.0),
        "{metrics}"
    );
    assert!(
        metric(
            &metrics,
            "reports_server_aggregation_ephemeral_reports_deleted_total "
        )
        .unwrap_or(0.0)
            >= 8.0,
        "{metrics}"
    );
    assert!(
        metric(&metrics, "reports_server_aggregation_results_merged_total ").unwrap_or(0.0)
            >= 7.0 * 19.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "reports_server_aggregation_policies "),
        Some(17.0),
        "{metrics}"
    );
    let lease = Api::<Lease>::namespaced(client.clone(), LEASE_NAMESPACE)
        .get(LEASE_NAME)
        .await?;
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    assert!(
        holder.contains(&format!("_{}_", agg.pid())),
        "lease holder {holder:?}"
    );

    // ---- 2. the unadoptable admission report goes after the grace period --------------------
    if ghost_created.elapsed() < GRACE - Duration::from_secs(2) {
        assert!(
            ephemeral_names(&client, "agg-b")
                .await?
                .contains("9e2b-adm-ghost"),
            "the report of a missing resource was deleted before its grace period"
        );
    }
    eventually(
        "the report of a missing ConfigMap is deleted after the grace period",
        GRACE + Duration::from_secs(30),
        &mut agg,
        || async { Ok(ephemeral_names(&client, "agg-b").await?.is_empty()) },
    )
    .await?;
    // creationTimestamp has whole seconds (truncated), so the server-side age can be up to a
    // second more than what this process measured.
    assert!(
        ghost_created.elapsed() + Duration::from_secs(1) >= GRACE,
        "deleted after {:?}, before the {GRACE:?} grace period",
        ghost_created.elapsed()
    );
    // The counter moves after the DELETE's answer reaches the aggregator, which can be later
    // than this process sees the report gone (CI failed on that race under load).
    let port = agg.metrics_port;
    eventually(
        "the deletion is counted in reports_server_aggregation_adoptions_total",
        Duration::from_secs(10),
        &mut agg,
        || async move {
            let (_, metrics) = http_get(port, "/metrics").await?;
            let deleted = metric(
                &metrics,
                "reports_server_aggregation_adoptions_total{outcome=\"deleted\"} ",
            );
            ensure!(
                deleted.unwrap_or(0.0) <= 1.0,
                "more than one deletion counted:\n{metrics}"
            );
            Ok(deleted == Some(1.0))
        },
    )
    .await?;

    // ---- 3. a deleted policy's results are dropped -----------------------------------------
    cpols
        .delete(DELETED_POLICY, &DeleteParams::default())
        .await?;
    eventually(
        "the deleted ClusterPolicy's results are dropped everywhere",
        Duration::from_secs(60),
        &mut agg,
        || async {
            for ns in ["agg-a", "agg-b"] {
                for report in policy_reports(&client, ns).await?.values() {
                    if report
                        .results
                        .iter()
                        .flatten()
                        .any(|r| r.policy == DELETED_POLICY)
                    {
                        return Ok(false);
                    }
                }
            }
            let cluster = Api::<ClusterPolicyReport>::all(client.clone())
                .get(&ns_subject.uid)
                .await?;
            Ok(!cluster
                .results
                .iter()
                .flatten()
                .any(|r| r.policy == DELETED_POLICY))
        },
    )
    .await?;
    check_reports_after_policy_deletion(&client, &all_cms).await?;

    // ---- 4. SIGKILL in the middle of a namespace, successor takes over ---------------------
    agg.kill();
    eprintln!("[e2e-agg] aggregator-1 killed (lease not released)");
    create_namespace(&client, "agg-c").await?;
    let cms_c = create_configmaps(&client, "agg-c", 60).await?;
    let eph_c: Api<EphemeralReport> = Api::namespaced(client.clone(), "agg-c");
    for cm in &cms_c {
        let subject = subject_of(cm);
        // An older and a newer scan of each ConfigMap; the newer must win, once.
        eph_c
            .create(
                &PostParams::default(),
                &background_report(&subject, "old", T0 + 100, &[0]),
            )
            .await?;
        eph_c
            .create(
                &PostParams::default(),
                &background_report(&subject, "new", T0 + 200, &[1]),
            )
            .await?;
    }
    // Small pages and one request at a time make the pass long enough to be interrupted.
    let slow = [
        "--aggregation-page-size",
        "1",
        "--aggregation-api-concurrency",
        "1",
    ];
    let mut agg2 = AggregatorProcess::start(&bin, &kubeconfig, &logs_dir, "aggregator-2", &slow)?;
    eventually(
        "aggregator-2 took over the lease and started writing agg-c",
        Duration::from_secs(60),
        &mut agg2,
        || async { Ok(!policy_reports(&client, "agg-c").await?.is_empty()) },
    )
    .await?;
    agg2.kill();
    let written = policy_reports(&client, "agg-c").await?.len();
    let left = ephemeral_names(&client, "agg-c").await?.len();
    eprintln!(
        "[e2e-agg] aggregator-2 killed mid-run: {written} of 60 PolicyReports written, {left} of 120 ephemeral reports left"
    );
    let mut agg3 = AggregatorProcess::start(&bin, &kubeconfig, &logs_dir, "aggregator-3", &slow)?;
    eventually(
        "aggregator-3 finished agg-c",
        Duration::from_secs(120),
        &mut agg3,
        || async {
            Ok(ephemeral_names(&client, "agg-c").await?.is_empty()
                && policy_reports(&client, "agg-c").await?.len() == cms_c.len())
        },
    )
    .await?;
    let reports = policy_reports(&client, "agg-c").await?;
    for cm in &cms_c {
        let report = &reports[cm.metadata.uid.as_deref().unwrap()];
        check_report(
            report,
            cm,
            &Expected {
                ts: T0 + 200,
                failing: &[1],
                policy_deleted: true,
            },
        )?;
    }
    let lease = Api::<Lease>::namespaced(client.clone(), LEASE_NAMESPACE)
        .get(LEASE_NAME)
        .await?;
    let spec = lease.spec.unwrap_or_default();
    let holder = spec.holder_identity.unwrap_or_default();
    assert!(
        holder.contains(&format!("_{}_", agg3.pid())),
        "lease holder {holder:?}"
    );
    assert!(
        spec.lease_transitions.unwrap_or(0) >= 2,
        "lease transitions {:?}",
        spec.lease_transitions
    );
    // The earlier namespaces were re-merged by the new leader's initial sweep: still intact.
    check_reports_after_policy_deletion(&client, &all_cms).await?;
    eprintln!(
        "[e2e-agg] after the crash: 60 reports with 18 results each, newest scan won, none doubled; total {:.1?}",
        started.elapsed()
    );
    agg3.kill();
    cp.stop().await?;
    Ok(())
}
