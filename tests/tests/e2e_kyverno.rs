//! A real Kyverno v1.19.1 writing its reports through reports-server, in both aggregation modes:
//!
//! * **A** — Kyverno's reports controller aggregates (`--aggregateReports=true`); reports-server
//!   only stores (`serve --aggregation=false`);
//! * **B** — Kyverno writes ephemeral reports only (`--aggregateReports=false`); reports-server
//!   aggregates in-process (`serve --aggregation=true --aggregation-delay 2s`);
//!
//! each once with the reports in `wgpolicyk8s.io` and once in `openreports.io` (Kyverno's
//! `--openreportsEnabled=true`; in B also `serve --aggregation-output openreports`): four runs.
//! Mode B also runs the CEL policy kinds of `policies.kyverno.io`.
//!
//! Each mode gets one control plane (etcd, kube-apiserver, kube-controller-manager), one
//! `reports-server serve --auth-mode delegated` behind the APIServices, and one Kyverno (admission,
//! reports and background controllers as processes; `reports_server_tests::kyverno`), shared by
//! the scenarios of that mode. Every scenario asserts the exact PolicyReport content read
//! through kube-apiserver (results: policy, rule, result, source, scored, category, severity,
//! properties; summary; scope; ownerReference; labels). A scenario that fails is recorded and the
//! next one runs; the test fails at the end with the list. Then the reports of A and B, of A in
//! both groups and of B in both groups are compared (UIDs, timestamps and server bookkeeping
//! normalised away; openreports mapped onto wgpolicy by [`openreports_as_wgpolicy`]), and a
//! background scan of many Pods prints how long it took and the server's peak memory (figures
//! only, nothing timed is asserted). In every run a real consumer, Policy Reporter v3.9.0, follows
//! the reports through kube-apiserver from the start, and at the end its REST API's counts and
//! its `policy_report_result` metrics must equal `reports-server query compliance` on the
//! server's database, per namespace and per policy ([`Consumer`]; docs/policy-reporter.md).
//!
//! Needs what `e2e_aggregated` needs (Go + module proxy for the control plane, kubectl, openssl)
//! plus the Kyverno build (`bash tests/kyverno/build.sh`, run automatically, cached; see
//! docs/e2e.md and docs/kyverno.md) and the Policy Reporter build (`bash
//! tests/policy-reporter/build.sh`, run automatically, cached; needs gcc too). Nothing is skipped.
//!
//! `REPORTS_SERVER_KYVERNO_PODS` sets the size of the background-scan figure (default 500).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::{
    Api,
    api::{
        ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
        PostParams,
    },
};
use reports_server_tests::{
    controlplane::{ControlPlane, ControlPlaneOptions},
    delegated::{self, Server},
    kubectl::{Kubectl, kubectl_path},
    kyverno::{Controller, KYVERNO_VERSION, Kyverno, KyvernoOptions},
    kyverno_fixtures::{MUTATE_RULE, mutate_label_policy},
    policy_reporter::{self, POLICY_REPORTER_VERSION, PolicyReporter},
    server,
};
use serde_json::{Value, json};

/// The tests of this file run one after another (several control planes on two cores make the
/// timing-sensitive steps flaky).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long a report may take to reach its expected content. Kyverno's own path is slow by design
/// (10 s front queue + 10 s back queue, a background scan 30 s after a resource change), and
/// CI's two cores are shared with kube-apiserver, etcd, KCM, three Kyverno processes and us.
const REPORT_TIMEOUT: Duration = Duration::from_secs(240);
/// Garbage collection and namespace deletion.
const GC_TIMEOUT: Duration = Duration::from_secs(180);
const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
const PAUSE: &str = "registry.k8s.io/pause:3.10";

// ---- modes -------------------------------------------------------------------------------------

/// Who merges Kyverno's ephemeral reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Merger {
    /// A: Kyverno's reports controller aggregates; our server only stores.
    Kyverno,
    /// B: Kyverno runs `--aggregateReports=false`; our server aggregates in-process.
    Server,
}

/// The API group of the final reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Group {
    /// `wgpolicyk8s.io/v1alpha2` PolicyReport / ClusterPolicyReport.
    Wgpolicy,
    /// `openreports.io/v1alpha1` Report / ClusterReport: Kyverno's `--openreportsEnabled` (A),
    /// our `--aggregation-output openreports` (B).
    Openreports,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mode {
    merger: Merger,
    group: Group,
}

impl Mode {
    const A: Mode = Mode {
        merger: Merger::Kyverno,
        group: Group::Wgpolicy,
    };
    const B: Mode = Mode {
        merger: Merger::Server,
        group: Group::Wgpolicy,
    };

    fn in_openreports(self) -> Mode {
        Mode {
            group: Group::Openreports,
            ..self
        }
    }

    fn short(self) -> &'static str {
        match (self.merger, self.group) {
            (Merger::Kyverno, Group::Wgpolicy) => "A",
            (Merger::Server, Group::Wgpolicy) => "B",
            (Merger::Kyverno, Group::Openreports) => "A/openreports",
            (Merger::Server, Group::Openreports) => "B/openreports",
        }
    }

    fn describe(self) -> String {
        let merger = match self.merger {
            Merger::Kyverno => {
                "A: Kyverno aggregates (--aggregateReports=true), reports-server --aggregation=false"
            }
            Merger::Server => {
                "B: reports-server aggregates (--aggregation=true --aggregation-delay 2s), Kyverno --aggregateReports=false"
            }
        };
        match self.group {
            Group::Wgpolicy => merger.to_string(),
            Group::Openreports => format!(
                "{merger}; reports in openreports.io (Kyverno --openreportsEnabled=true{})",
                if self.merger == Merger::Server {
                    ", reports-server --aggregation-output openreports"
                } else {
                    ""
                }
            ),
        }
    }

    fn server_args(self) -> Vec<&'static str> {
        let mut args = match self.merger {
            Merger::Kyverno => vec!["--aggregation=false"],
            Merger::Server => vec!["--aggregation=true", "--aggregation-delay", "2s"],
        };
        if self == (Mode::B.in_openreports()) {
            args.extend(["--aggregation-output", "openreports"]);
        }
        args
    }

    fn kyverno_options(self) -> KyvernoOptions {
        KyvernoOptions {
            aggregate_reports: self.merger == Merger::Kyverno,
            background_scan_interval: Duration::from_secs(60),
            // Only the reports controller (and the chart's init container) knows the flag.
            extra_reports_args: match self.group {
                Group::Wgpolicy => Vec::new(),
                Group::Openreports => vec!["--openreportsEnabled=true".into()],
            },
            ..KyvernoOptions::default()
        }
    }

    /// The namespaced and the cluster-scoped final report kinds.
    fn report_resources(self) -> (ApiResource, ApiResource) {
        match self.group {
            Group::Wgpolicy => (
                ar(
                    "wgpolicyk8s.io",
                    "v1alpha2",
                    "PolicyReport",
                    "policyreports",
                ),
                ar(
                    "wgpolicyk8s.io",
                    "v1alpha2",
                    "ClusterPolicyReport",
                    "clusterpolicyreports",
                ),
            ),
            Group::Openreports => (
                ar("openreports.io", "v1alpha1", "Report", "reports"),
                ar(
                    "openreports.io",
                    "v1alpha1",
                    "ClusterReport",
                    "clusterreports",
                ),
            ),
        }
    }
}

// ---- resources ---------------------------------------------------------------------------------

fn ar(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

fn ephr_resource() -> ApiResource {
    ar(
        "reports.kyverno.io",
        "v1",
        "EphemeralReport",
        "ephemeralreports",
    )
}

/// The resource a report is about.
#[derive(Clone, Debug)]
struct Subject {
    kind: &'static str,
    name: String,
    namespace: Option<String>,
    uid: String,
}

impl Subject {
    fn pod(p: &Pod) -> Subject {
        Subject {
            kind: "Pod",
            name: p.metadata.name.clone().unwrap_or_default(),
            namespace: p.metadata.namespace.clone(),
            uid: p.metadata.uid.clone().unwrap_or_default(),
        }
    }

    fn namespace(n: &Namespace) -> Subject {
        Subject {
            kind: "Namespace",
            name: n.metadata.name.clone().unwrap_or_default(),
            namespace: None,
            uid: n.metadata.uid.clone().unwrap_or_default(),
        }
    }

    fn label(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{} {ns}/{}", self.kind, self.name),
            None => format!("{} {}", self.kind, self.name),
        }
    }
}

// ---- expected results --------------------------------------------------------------------------

/// One expected result, compared with the projection [`project`] of a report's result.
fn res(
    policy: &str,
    rule: &str,
    result: &str,
    category: &str,
    severity: &str,
    props: Value,
) -> Value {
    let mut r = json!({
        "policy": policy,
        "rule": rule,
        "result": result,
        "source": "kyverno",
        "scored": true,
        "properties": props,
    });
    if !category.is_empty() {
        r["category"] = json!(category);
    }
    if !severity.is_empty() {
        r["severity"] = json!(severity);
    }
    r
}

/// `properties` of a result from a policy with `background: true` (Kyverno ≥ 1.14 describes the
/// policy in `process`, not where the result came from).
fn bg() -> Value {
    json!({"process": "background scan"})
}

/// `properties` of a result from a policy with `background: false`.
fn adm() -> Value {
    json!({"process": "admission review"})
}

/// What of a result is compared: everything but `timestamp` and `message` (checked apart).
fn project(r: &Value) -> Value {
    let mut p = json!({});
    for k in [
        "policy",
        "rule",
        "result",
        "source",
        "scored",
        "category",
        "severity",
        "properties",
    ] {
        if let Some(v) = r.get(k) {
            p[k] = v.clone();
        }
    }
    if p.get("properties").is_none() {
        p["properties"] = json!({});
    }
    p
}

fn summary_of(expected: &[Value]) -> Value {
    let mut s = json!({"pass": 0, "fail": 0, "warn": 0, "error": 0, "skip": 0});
    for r in expected {
        let k = r["result"].as_str().unwrap_or("");
        s[k] = json!(s[k].as_i64().unwrap_or(0) + 1);
    }
    s
}

/// Checks a PolicyReport / ClusterPolicyReport against the subject and the expected results
/// (in Kyverno's order: policy, rule).
fn check_report(report: &Value, subject: &Subject, expected: &[Value]) -> Result<()> {
    let meta = &report["metadata"];
    ensure!(
        meta["name"] == subject.uid.as_str(),
        "name {} is not the {} uid {}",
        meta["name"],
        subject.label(),
        subject.uid
    );
    ensure!(
        meta["labels"] == json!({MANAGED_BY: "kyverno"}),
        "labels: {}",
        meta["labels"]
    );
    let owner = json!([{
        "apiVersion": "v1",
        "kind": subject.kind,
        "name": subject.name,
        "uid": subject.uid,
    }]);
    ensure!(
        meta["ownerReferences"] == owner,
        "ownerReferences: {} (want {owner})",
        meta["ownerReferences"]
    );
    let mut scope = json!({
        "apiVersion": "v1",
        "kind": subject.kind,
        "name": subject.name,
        "uid": subject.uid,
    });
    if let Some(ns) = &subject.namespace {
        scope["namespace"] = json!(ns);
    }
    ensure!(
        report["scope"] == scope,
        "scope: {} (want {scope})",
        report["scope"]
    );
    let results = report["results"].as_array().cloned().unwrap_or_default();
    let got: Vec<Value> = results.iter().map(project).collect();
    ensure!(
        got == expected,
        "results differ:\n got: {}\nwant: {}",
        serde_json::to_string_pretty(&got)?,
        serde_json::to_string_pretty(&expected)?
    );
    for r in &results {
        ensure!(
            r["timestamp"]["seconds"].as_i64().is_some_and(|s| s > 0)
                && r["timestamp"]["nanos"] == 0,
            "timestamp of {}/{}: {}",
            r["policy"],
            r["rule"],
            r["timestamp"]
        );
        ensure!(
            r["message"].as_str().is_some_and(|m| !m.is_empty()),
            "message of {}/{}: {}",
            r["policy"],
            r["rule"],
            r["message"]
        );
    }
    let want = summary_of(expected);
    ensure!(
        report["summary"] == want,
        "summary: {} (want {want})",
        report["summary"]
    );
    Ok(())
}

/// A report with everything that legitimately differs between two runs replaced: the subject's
/// uid (name, scope, owner), timestamps, resourceVersion, generation, managedFields.
fn normalise(report: &Value, subject_uid: &str) -> Value {
    let mut r = report.clone();
    let text = r.to_string().replace(subject_uid, "<subject-uid>");
    r = serde_json::from_str(&text).expect("round trip");
    if let Some(m) = r["metadata"].as_object_mut() {
        for k in [
            "uid",
            "resourceVersion",
            "generation",
            "creationTimestamp",
            "managedFields",
        ] {
            m.remove(k);
        }
    }
    if let Some(results) = r["results"].as_array_mut() {
        for x in results {
            if let Some(o) = x.as_object_mut() {
                o.remove("timestamp");
            }
        }
    }
    openreports_as_wgpolicy(&mut r);
    r
}

/// The documented mapping (docs/kyverno.md "openreports.io"): a Report / ClusterReport is the
/// PolicyReport / ClusterPolicyReport of the same name with the group renamed and a top-level
/// `source` (empty from Kyverno v1.19.1's own merge, `kyverno` from ours); everything else is
/// equal.
fn openreports_as_wgpolicy(report: &mut Value) {
    if report["apiVersion"] != "openreports.io/v1alpha1" {
        return;
    }
    report["apiVersion"] = json!("wgpolicyk8s.io/v1alpha2");
    let kind = match report["kind"].as_str() {
        Some("ClusterReport") => "ClusterPolicyReport",
        _ => "PolicyReport",
    };
    report["kind"] = json!(kind);
    if let Some(o) = report.as_object_mut()
        && o.get("source").is_some_and(|s| s == "kyverno" || s == "")
    {
        o.remove("source");
    }
}

// ---- the environment of one mode ---------------------------------------------------------------

struct Env {
    // Dropped in this order: Kyverno, our server, the control plane.
    kyverno: Kyverno,
    server: Server,
    cp: ControlPlane,
    admin: Kubectl,
    client: kube::Client,
    mode: Mode,
    /// Normalised reports by `<scenario>/<subject>`, compared across the modes.
    snapshots: BTreeMap<String, Value>,
    started_in: Duration,
}

impl Env {
    async fn start(mode: Mode) -> Result<Env> {
        kubectl_path()?;
        let t = Instant::now();
        server::binary().context("building reports-server")?;
        eprintln!(
            "[kyverno-e2e] reports-server binary built in {:.1?}",
            t.elapsed()
        );
        // The Kyverno build (cold: 15-25 min) before any process is started.
        let t = Instant::now();
        reports_server_tests::kyverno::kyverno_dir()
            .await
            .context("building Kyverno (see docs/kyverno.md)")?;
        eprintln!(
            "[kyverno-e2e] Kyverno {KYVERNO_VERSION} binaries ready in {:.1?}",
            t.elapsed()
        );
        let t0 = Instant::now();
        let cp = ControlPlane::start(ControlPlaneOptions::with_controller_manager())
            .await
            .context("starting the e2e control plane (see docs/e2e.md)")?;
        let server =
            Server::start_with(&cp, &cp.dir().join("reports-server"), &mode.server_args()).await?;
        let admin = Kubectl::new(cp.kubeconfig_path());
        let client = cp.client().await?;
        delegated::register_apiservices(&cp, &server, &admin, &client).await?;
        let kyverno = Kyverno::install(&cp, mode.kyverno_options())
            .await
            .with_context(|| delegated::diagnostics(&cp, &server))?;
        let started_in = t0.elapsed();
        eprintln!(
            "[kyverno-e2e] mode {}: control plane + server + APIServices + Kyverno ready in {started_in:.1?} (dir {})",
            mode.short(),
            cp.dir().display()
        );
        Ok(Env {
            kyverno,
            server,
            cp,
            admin,
            client,
            mode,
            snapshots: BTreeMap::new(),
            started_in,
        })
    }

    async fn stop(self) -> Result<()> {
        let Env {
            mut kyverno,
            mut server,
            cp,
            ..
        } = self;
        kyverno.stop();
        delegated::unregister_apiservices(&cp).await?;
        server.kill();
        cp.stop().await?;
        Ok(())
    }

    fn diagnostics(&self) -> String {
        format!(
            "{}\n{}",
            self.kyverno.diagnostics(25),
            delegated::diagnostics(&self.cp, &self.server)
        )
    }

    fn apply(&self, manifest: &Value) -> Result<()> {
        self.admin
            .run_with_stdin(&["apply", "-f", "-"], Some(&manifest.to_string()))
            .map(|_| ())
    }

    async fn create_namespace(&self, name: &str, labels: Value) -> Result<Namespace> {
        let ns: Namespace = serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": labels},
        }))?;
        let created = Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        // The ServiceAccount admission plugin refuses Pods until `default` exists.
        let sas = Api::<ServiceAccount>::namespaced(self.client.clone(), name);
        eventually(
            &format!("ServiceAccount {name}/default"),
            Duration::from_secs(60),
            || async { Ok(sas.get_opt("default").await?.is_some()) },
        )
        .await?;
        Ok(created)
    }

    async fn create_pod(&self, ns: &str, pod: Value) -> Result<Pod> {
        let pod: Pod = serde_json::from_value(pod)?;
        let name = pod.metadata.name.clone().unwrap_or_default();
        Api::<Pod>::namespaced(self.client.clone(), ns)
            .create(&PostParams::default(), &pod)
            .await
            .with_context(|| format!("creating Pod {ns}/{name}"))
    }

    fn polr(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), ns, &self.mode.report_resources().0)
    }

    fn polr_all(&self) -> Api<DynamicObject> {
        Api::all_with(self.client.clone(), &self.mode.report_resources().0)
    }

    fn cpolr(&self) -> Api<DynamicObject> {
        Api::all_with(self.client.clone(), &self.mode.report_resources().1)
    }

    fn ephr(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), ns, &ephr_resource())
    }

    /// The report of `subject` (PolicyReport, or ClusterPolicyReport for cluster-scoped
    /// subjects) through kube-apiserver, if it exists.
    async fn report_of(&self, subject: &Subject) -> Result<Option<Value>> {
        let api = match &subject.namespace {
            Some(ns) => self.polr(ns),
            None => self.cpolr(),
        };
        Ok(api
            .get_opt(&subject.uid)
            .await?
            .map(|o| serde_json::to_value(o).expect("DynamicObject serialises")))
    }

    /// Waits until the report of `subject` has exactly the expected content; records its
    /// normalised form under `key` for the comparison of the modes.
    async fn expect_report(
        &mut self,
        key: &str,
        subject: &Subject,
        expected: &[Value],
    ) -> Result<Duration> {
        let t0 = Instant::now();
        let mut last;
        loop {
            self.kyverno.check_running()?;
            match self.report_of(subject).await {
                Ok(Some(report)) => match check_report(&report, subject, expected) {
                    Ok(()) => {
                        let took = t0.elapsed();
                        eprintln!(
                            "[kyverno-e2e] mode {}: report of {} as expected after {took:.1?}",
                            self.mode.short(),
                            subject.label()
                        );
                        self.snapshots
                            .insert(key.to_string(), normalise(&report, &subject.uid));
                        return Ok(took);
                    }
                    Err(e) => {
                        last = format!(
                            "{e:#}\n--- report ---\n{}",
                            serde_json::to_string_pretty(&report)?
                        )
                    }
                },
                Ok(None) => last = String::from("no report yet"),
                Err(e) => last = format!("reading the report failed: {e:#}"),
            }
            if t0.elapsed() > REPORT_TIMEOUT {
                bail!(
                    "the report of {} did not reach the expected content within {REPORT_TIMEOUT:?}; \
                     last: {last}\n{}",
                    subject.label(),
                    self.diagnostics()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits until the report of `subject` is gone.
    async fn expect_no_report(&self, subject: &Subject, timeout: Duration) -> Result<Duration> {
        let t0 = Instant::now();
        loop {
            if self.report_of(subject).await?.is_none() {
                return Ok(t0.elapsed());
            }
            if t0.elapsed() > timeout {
                bail!(
                    "the report of {} still exists after {timeout:?}\n{}",
                    subject.label(),
                    self.diagnostics()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// `kubectl wait --for=condition=Ready` on ClusterPolicies, then until Kyverno's resource
    /// webhooks (validating, and mutating if asked) cover `resource`, so that the next admission
    /// request is evaluated.
    async fn wait_policies_ready(
        &self,
        names: &[&str],
        resource: &str,
        mutating: bool,
    ) -> Result<()> {
        let took = self
            .kyverno
            .wait_cluster_policies_ready(names, resource, mutating)
            .await
            .with_context(|| self.diagnostics())?;
        eprintln!(
            "[kyverno-e2e] mode {}: policies {names:?} Ready in {took:.1?}",
            self.mode.short(),
        );
        Ok(())
    }

    async fn delete_cluster_policy(&self, name: &str) -> Result<()> {
        self.admin
            .run(&["delete", "clusterpolicy", name, "--wait=true"])
            .map(|_| ())
    }

    /// Results of `policy` in any PolicyReport or ClusterPolicyReport, as `<report>: <rule>`.
    async fn results_of_policy(&self, policies: &[&str]) -> Result<Vec<String>> {
        let mut found = Vec::new();
        for api in [self.polr_all(), self.cpolr()] {
            for r in api.list(&ListParams::default()).await?.items {
                let v = serde_json::to_value(&r)?;
                for x in v["results"].as_array().into_iter().flatten() {
                    if policies.iter().any(|p| x["policy"] == *p) {
                        found.push(format!(
                            "{}/{}: {}/{}",
                            v["metadata"]["namespace"].as_str().unwrap_or(""),
                            v["metadata"]["name"].as_str().unwrap_or(""),
                            x["policy"].as_str().unwrap_or(""),
                            x["rule"].as_str().unwrap_or("")
                        ));
                    }
                }
            }
        }
        Ok(found)
    }
}

/// Polls `check` every 500 ms until it returns true or `timeout` passes; returns the time taken.
async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let start = Instant::now();
    loop {
        if check().await? {
            return Ok(start.elapsed());
        }
        if start.elapsed() > timeout {
            bail!("{what}: not true after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

// ---- manifests ---------------------------------------------------------------------------------

/// A ClusterPolicy with one validate rule requiring label `label` on Pods in `namespaces`.
fn require_label_policy(
    name: &str,
    rule: &str,
    namespaces: &[&str],
    label: &str,
    background: bool,
    category: &str,
    severity: &str,
) -> Value {
    json!({
        "apiVersion": "kyverno.io/v1",
        "kind": "ClusterPolicy",
        "metadata": {
            "name": name,
            "annotations": {
                "policies.kyverno.io/category": category,
                "policies.kyverno.io/severity": severity,
            },
        },
        "spec": {
            "validationFailureAction": "Audit",
            "background": background,
            "rules": [{
                "name": rule,
                "match": {"any": [{"resources": {"kinds": ["Pod"], "namespaces": namespaces}}]},
                "validate": {
                    "message": format!("label '{label}' is required"),
                    "pattern": {"metadata": {"labels": {label: "?*"}}},
                },
            }],
        },
    })
}

/// A Pod that needs no node (it stays Pending; Kyverno scans Pending Pods like any other).
fn pod(name: &str, labels: Value, image: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "automountServiceAccountToken": false,
            "containers": [{"name": "c", "image": image}],
        },
    })
}

/// Compliant with the restricted Pod Security Standard.
fn pss_good_pod(name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "automountServiceAccountToken": false,
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [{
                "name": "c",
                "image": PAUSE,
                "securityContext": {
                    "allowPrivilegeEscalation": false,
                    "capabilities": {"drop": ["ALL"]},
                },
            }],
        },
    })
}

/// Violates the baseline (host network, privileged) and the restricted standard (no
/// runAsNonRoot, no seccomp profile, privilege escalation allowed, capabilities not dropped).
fn pss_bad_pod(name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "automountServiceAccountToken": false,
            "hostNetwork": true,
            "containers": [{
                "name": "c",
                "image": PAUSE,
                "securityContext": {"privileged": true},
            }],
        },
    })
}

/// The 17 Pod Security Standards policies of tests/fixtures/kyverno-policies (name, category).
fn pss_policies() -> Result<Vec<(String, String, Value)>> {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/kyverno-policies/pod-security");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_none_or(|x| x != "yaml") {
            continue;
        }
        let v: Value = serde_yaml::from_str(&std::fs::read_to_string(&path)?)
            .with_context(|| format!("parsing {}", path.display()))?;
        let name = v["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let category = v["metadata"]["annotations"]["policies.kyverno.io/category"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        out.push((name, category, v));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    ensure!(
        out.len() == 17,
        "expected 17 PSS policies in {}, found {}",
        dir.display(),
        out.len()
    );
    Ok(out)
}

/// Rule names of a policy, in order.
fn rules_of(policy: &Value) -> Vec<String> {
    policy["spec"]["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["name"].as_str().map(str::to_string))
        .collect()
}

/// The expected PSS results for a Pod: `fail` for the (policy, rule) pairs in `failing`, `pass`
/// otherwise; all medium severity, sorted by policy then rule.
fn pss_expected(policies: &[(String, String, Value)], failing: &[(&str, &str)]) -> Vec<Value> {
    let mut out = Vec::new();
    for (name, category, p) in policies {
        let mut rules = rules_of(p);
        rules.sort();
        for rule in rules {
            let result = if failing.iter().any(|(fp, fr)| fp == name && *fr == rule) {
                "fail"
            } else {
                "pass"
            };
            out.push(res(name, &rule, result, category, "medium", bg()));
        }
    }
    out
}

// ---- scenarios ---------------------------------------------------------------------------------

const NS_FRESH: &str = "kyv-fresh";
const NS_ADMISSION: &str = "kyv-admission";
const NS_MUTATE: &str = "kyv-mutate";
const NS_UPDATE: &str = "kyv-update";
const NS_EXCEPTION: &str = "kyv-exception";
const NS_PSS: &str = "kyv-pss";
const NS_RESTART: &str = "kyv-restart";
const NS_SCALE: &str = "kyv-scale";

const P_FRESH: &str = "e2e-fresh-require-team";
const P_ADMISSION: &str = "e2e-admission-require-app";
const P_MUTATE: &str = "e2e-mutate-add-label";
const P_UPDATE: &str = "e2e-update-no-latest";
const P_EXCEPTION: &str = "e2e-exception-require-team";
const P_NAMESPACE: &str = "e2e-namespace-require-owner";
const P_RESTART: &str = "e2e-restart-require-team";
const P_SCALE: &str = "e2e-scale-require-team";
const MUTATED_LABEL: &str = "e2e.reports-server.io/mutated";

/// The per-scenario policies, installed once before the scenarios (one Ready wait instead of
/// one per scenario). Each matches only its scenario's namespace (or namespaces named
/// `kyv-cluster-*`).
async fn install_scenario_policies(env: &Env) -> Result<()> {
    let policies = vec![
        require_label_policy(
            P_FRESH,
            "require-team",
            &[NS_FRESH],
            "team",
            true,
            "E2E Fresh",
            "low",
        ),
        require_label_policy(
            P_ADMISSION,
            "require-app",
            &[NS_ADMISSION],
            "app",
            false,
            "E2E Admission",
            "high",
        ),
        mutate_label_policy(P_MUTATE, NS_MUTATE, MUTATED_LABEL, "E2E Mutate", "info"),
        json!({
            "apiVersion": "kyverno.io/v1",
            "kind": "ClusterPolicy",
            "metadata": {
                "name": P_UPDATE,
                "annotations": {
                    "policies.kyverno.io/category": "E2E Update",
                    "policies.kyverno.io/severity": "medium",
                },
            },
            "spec": {
                "validationFailureAction": "Audit",
                "background": true,
                "rules": [{
                    "name": "no-latest-tag",
                    "match": {"any": [{"resources": {"kinds": ["Pod"], "namespaces": [NS_UPDATE]}}]},
                    "validate": {
                        "message": "images must not use the latest tag",
                        "pattern": {"spec": {"containers": [{"image": "!*:latest"}]}},
                    },
                }],
            },
        }),
        require_label_policy(
            P_EXCEPTION,
            "require-team",
            &[NS_EXCEPTION],
            "team",
            true,
            "E2E Exception",
            "low",
        ),
        json!({
            "apiVersion": "kyverno.io/v1",
            "kind": "ClusterPolicy",
            "metadata": {
                "name": P_NAMESPACE,
                "annotations": {
                    "policies.kyverno.io/category": "E2E Cluster",
                    "policies.kyverno.io/severity": "critical",
                },
            },
            "spec": {
                "validationFailureAction": "Audit",
                "background": true,
                "rules": [{
                    "name": "require-owner",
                    "match": {"any": [{"resources": {"kinds": ["Namespace"], "names": ["kyv-cluster-*"]}}]},
                    "validate": {
                        "message": "label 'owner' is required",
                        "pattern": {"metadata": {"labels": {"owner": "?*"}}},
                    },
                }],
            },
        }),
        require_label_policy(
            P_RESTART,
            "require-team",
            &[NS_RESTART],
            "team",
            true,
            "E2E Restart",
            "low",
        ),
    ];
    let list = json!({"apiVersion": "v1", "kind": "List", "items": policies});
    env.apply(&list)?;
    env.wait_policies_ready(
        &[
            P_FRESH,
            P_ADMISSION,
            P_MUTATE,
            P_UPDATE,
            P_EXCEPTION,
            P_NAMESPACE,
            P_RESTART,
        ],
        "pods",
        true,
    )
    .await
}

/// Fresh install: the first PolicyReport appears, and no Kyverno controller logged a watch that
/// could not start (client-go's RetryWatcher refuses a list resourceVersion of "0").
async fn s_fresh_install(env: &mut Env) -> Result<()> {
    env.create_namespace(NS_FRESH, json!({})).await?;
    let p = env
        .create_pod(NS_FRESH, pod("no-team", json!({}), PAUSE))
        .await?;
    let subject = Subject::pod(&p);
    env.expect_report(
        "fresh/no-team",
        &subject,
        &[res(
            P_FRESH,
            "require-team",
            "fail",
            "E2E Fresh",
            "low",
            bg(),
        )],
    )
    .await?;
    let errors = env.kyverno.watch_errors(&Controller::ALL, false);
    ensure!(
        errors.is_empty(),
        "Kyverno logged watch errors against reports-server:\n{}",
        errors.join("\n")
    );
    Ok(())
}

/// Admission audit: a policy with `background: false` only produces admission results; the
/// report is named by the Pod uid and owned by the Pod.
async fn s_admission_audit(env: &mut Env) -> Result<()> {
    env.create_namespace(NS_ADMISSION, json!({})).await?;
    let good = env
        .create_pod(NS_ADMISSION, pod("with-app", json!({"app": "web"}), PAUSE))
        .await?;
    let bad = env
        .create_pod(NS_ADMISSION, pod("without-app", json!({}), PAUSE))
        .await?;
    env.expect_report(
        "admission/with-app",
        &Subject::pod(&good),
        &[res(
            P_ADMISSION,
            "require-app",
            "pass",
            "E2E Admission",
            "high",
            adm(),
        )],
    )
    .await?;
    env.expect_report(
        "admission/without-app",
        &Subject::pod(&bad),
        &[res(
            P_ADMISSION,
            "require-app",
            "fail",
            "E2E Admission",
            "high",
            adm(),
        )],
    )
    .await?;
    Ok(())
}

/// A mutating policy: Kyverno's mutating webhook writes its admission report before the Pod has
/// a uid (`audit.kyverno.io/resource.uid: ""`); the result must still end in the Pod's report
/// and no EphemeralReport may be left behind.
async fn s_mutate(env: &mut Env) -> Result<()> {
    env.create_namespace(NS_MUTATE, json!({})).await?;
    let p = env
        .create_pod(NS_MUTATE, pod("mutated", json!({}), PAUSE))
        .await?;
    let labels = p.metadata.labels.clone().unwrap_or_default();
    ensure!(
        labels.get(MUTATED_LABEL).map(String::as_str) == Some("true"),
        "Kyverno's mutating webhook did not add {MUTATED_LABEL}: labels {labels:?}"
    );
    env.expect_report(
        "mutate/mutated",
        &Subject::pod(&p),
        &[res(
            P_MUTATE,
            MUTATE_RULE,
            "pass",
            "E2E Mutate",
            "info",
            adm(),
        )],
    )
    .await?;
    let ephr = env.ephr(NS_MUTATE);
    let t0 = Instant::now();
    loop {
        let left = ephr.list(&ListParams::default()).await?.items;
        if left.is_empty() {
            eprintln!(
                "[kyverno-e2e] mode {}: no EphemeralReport left after {:.1?}",
                env.mode.short(),
                t0.elapsed()
            );
            return Ok(());
        }
        if t0.elapsed() > REPORT_TIMEOUT {
            let left: Vec<String> = left
                .iter()
                .map(|o| serde_json::to_string(o).unwrap_or_default())
                .collect();
            bail!(
                "EphemeralReports left in {NS_MUTATE} after {REPORT_TIMEOUT:?}:\n{}\n{}",
                left.join("\n"),
                env.diagnostics()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Update path: changing the Pod's image flips the result of a policy that checks it.
async fn s_update(env: &mut Env) -> Result<()> {
    env.create_namespace(NS_UPDATE, json!({})).await?;
    let p = env
        .create_pod(
            NS_UPDATE,
            pod("web", json!({}), "registry.k8s.io/pause:latest"),
        )
        .await?;
    let subject = Subject::pod(&p);
    env.expect_report(
        "update/web-before",
        &subject,
        &[res(
            P_UPDATE,
            "no-latest-tag",
            "fail",
            "E2E Update",
            "medium",
            bg(),
        )],
    )
    .await?;
    Api::<Pod>::namespaced(env.client.clone(), NS_UPDATE)
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"containers": [{"name": "c", "image": PAUSE}]}})),
        )
        .await
        .context("changing the Pod's image")?;
    env.expect_report(
        "update/web-after",
        &subject,
        &[res(
            P_UPDATE,
            "no-latest-tag",
            "pass",
            "E2E Update",
            "medium",
            bg(),
        )],
    )
    .await?;
    Ok(())
}

/// A PolicyException turns the result of the excepted Pod into `skip`.
async fn s_exception(env: &mut Env) -> Result<()> {
    env.create_namespace(NS_EXCEPTION, json!({})).await?;
    env.apply(&json!({
        "apiVersion": "kyverno.io/v2",
        "kind": "PolicyException",
        "metadata": {"name": "e2e-exempt", "namespace": NS_EXCEPTION},
        "spec": {
            "exceptions": [{"policyName": P_EXCEPTION, "ruleNames": ["require-team"]}],
            "match": {"any": [{"resources": {
                "kinds": ["Pod"],
                "namespaces": [NS_EXCEPTION],
                "names": ["exempt-*"],
            }}]},
        },
    }))?;
    let exempt = env
        .create_pod(NS_EXCEPTION, pod("exempt-1", json!({}), PAUSE))
        .await?;
    let normal = env
        .create_pod(NS_EXCEPTION, pod("normal-1", json!({}), PAUSE))
        .await?;
    env.expect_report(
        "exception/exempt-1",
        &Subject::pod(&exempt),
        &[res(
            P_EXCEPTION,
            "require-team",
            "skip",
            "E2E Exception",
            "low",
            json!({"exceptions": "e2e-exempt", "process": "background scan"}),
        )],
    )
    .await?;
    env.expect_report(
        "exception/normal-1",
        &Subject::pod(&normal),
        &[res(
            P_EXCEPTION,
            "require-team",
            "fail",
            "E2E Exception",
            "low",
            bg(),
        )],
    )
    .await?;
    Ok(())
}

/// A cluster-scoped resource (a Namespace) gets a ClusterPolicyReport.
async fn s_cluster_scoped(env: &mut Env) -> Result<()> {
    let bad = env.create_namespace("kyv-cluster-a", json!({})).await?;
    let good = env
        .create_namespace("kyv-cluster-b", json!({"owner": "team-b"}))
        .await?;
    env.expect_report(
        "cluster/kyv-cluster-a",
        &Subject::namespace(&bad),
        &[res(
            P_NAMESPACE,
            "require-owner",
            "fail",
            "E2E Cluster",
            "critical",
            bg(),
        )],
    )
    .await?;
    env.expect_report(
        "cluster/kyv-cluster-b",
        &Subject::namespace(&good),
        &[res(
            P_NAMESPACE,
            "require-owner",
            "pass",
            "E2E Cluster",
            "critical",
            bg(),
        )],
    )
    .await?;
    Ok(())
}

/// Background scan with the 17 Pod Security Standards policies: Pods created before the
/// policies get their results from the scan alone.
async fn s_pss_background(env: &mut Env) -> Result<()> {
    let policies = pss_policies()?;
    env.create_namespace(NS_PSS, json!({})).await?;
    let good = env.create_pod(NS_PSS, pss_good_pod("good")).await?;
    let bad = env.create_pod(NS_PSS, pss_bad_pod("bad")).await?;
    let list = json!({
        "apiVersion": "v1",
        "kind": "List",
        "items": policies.iter().map(|p| p.2.clone()).collect::<Vec<_>>(),
    });
    env.apply(&list)?;
    let names: Vec<&str> = policies.iter().map(|p| p.0.as_str()).collect();
    env.wait_policies_ready(&names, "pods", false).await?;
    env.expect_report(
        "pss/good",
        &Subject::pod(&good),
        &pss_expected(&policies, &[]),
    )
    .await?;
    env.expect_report(
        "pss/bad",
        &Subject::pod(&bad),
        &pss_expected(
            &policies,
            &[
                ("disallow-capabilities-strict", "require-drop-all"),
                ("disallow-host-namespaces", "host-namespaces"),
                ("disallow-privilege-escalation", "privilege-escalation"),
                ("disallow-privileged-containers", "privileged-containers"),
                ("require-run-as-nonroot", "run-as-non-root"),
                ("restrict-seccomp-strict", "check-seccomp-strict"),
            ],
        ),
    )
    .await?;
    Ok(())
}

/// Deleting ClusterPolicies removes their results from every report: first one PSS policy
/// (the bad Pod's report loses exactly those results), then the other 16 (reports left without
/// results are deleted; the reports of the other scenarios are back to their own results).
async fn s_delete_policy(env: &mut Env) -> Result<()> {
    let policies = pss_policies()?;
    let pods = Api::<Pod>::namespaced(env.client.clone(), NS_PSS);
    let bad = Subject::pod(&pods.get("bad").await?);
    let good = Subject::pod(&pods.get("good").await?);
    let removed = "disallow-privileged-containers";
    env.delete_cluster_policy(removed).await?;
    let remaining: Vec<(String, String, Value)> = policies
        .iter()
        .filter(|p| p.0 != removed)
        .cloned()
        .collect();
    let first = delete_one_policy(env, &bad, removed, &remaining).await;
    // The other 16 go whatever happened above, so that later scenarios see no PSS results.
    for (name, _, _) in &remaining {
        env.delete_cluster_policy(name).await?;
    }
    first?;
    let names: Vec<&str> = policies.iter().map(|p| p.0.as_str()).collect();
    let gone = eventually(
        "no result of the 17 PSS policies in any report",
        REPORT_TIMEOUT,
        || async { Ok(env.results_of_policy(&names).await?.is_empty()) },
    )
    .await;
    if let Err(e) = gone {
        let left = env.results_of_policy(&names).await?;
        return Err(e.context(format!(
            "{} results left:\n{}\n{}",
            left.len(),
            left.iter().take(40).cloned().collect::<Vec<_>>().join("\n"),
            env.diagnostics()
        )));
    }
    // Reports with no result left are deleted.
    env.expect_no_report(&good, REPORT_TIMEOUT).await?;
    env.expect_no_report(&bad, REPORT_TIMEOUT).await?;
    Ok(())
}

/// One PSS policy deleted: the bad Pod's report loses exactly its result, and no report keeps
/// one.
async fn delete_one_policy(
    env: &mut Env,
    bad: &Subject,
    removed: &str,
    remaining: &[(String, String, Value)],
) -> Result<()> {
    env.expect_report(
        "delete-policy/bad",
        bad,
        &pss_expected(
            remaining,
            &[
                ("disallow-capabilities-strict", "require-drop-all"),
                ("disallow-host-namespaces", "host-namespaces"),
                ("disallow-privilege-escalation", "privilege-escalation"),
                ("require-run-as-nonroot", "run-as-non-root"),
                ("restrict-seccomp-strict", "check-seccomp-strict"),
            ],
        ),
    )
    .await?;
    let everywhere = eventually(
        &format!("no result of {removed} in any report"),
        REPORT_TIMEOUT,
        || async { Ok(env.results_of_policy(&[removed]).await?.is_empty()) },
    )
    .await;
    if let Err(e) = everywhere {
        let left = env.results_of_policy(&[removed]).await?;
        return Err(e.context(format!("left:\n{}\n{}", left.join("\n"), env.diagnostics())));
    }
    Ok(())
}

// ---- the CEL policy kinds of policies.kyverno.io (mode B) ----------------------------------------

const NS_CEL: &str = "kyv-cel";
/// Where the Namespaced* kinds live (their results name them `<namespace>/<name>`).
const NS_CEL_NAMESPACED: &str = "kyv-cel-ns";
/// A ValidatingPolicy over both CEL namespaces that is never deleted: the Pods' reports keep a
/// result, so "the deleted policies' results are gone" cannot pass by the report vanishing.
const CEL_KEEP: &str = "e2e-vpol-keep";
const CEL_DISABLED: &str = "e2e-vpol-disabled";
const CEL_MUTATED_LABEL: &str = "celmutated";
const VPOL: &str = "KyvernoValidatingPolicy";
const MPOL: &str = "KyvernoMutatingPolicy";
const GPOL: &str = "KyvernoGeneratingPolicy";

/// `matchConstraints` for Pods, in `namespaces` (cluster kinds; by namespace selector, since a
/// false matchCondition would still make a MutatingPolicy's background scan report `skip`).
fn cel_pods(namespaces: &[&str], operations: &[&str]) -> Value {
    let mut m = json!({"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
        "operations": operations, "resources": ["pods"]}]});
    if !namespaces.is_empty() {
        m["namespaceSelector"] = json!({"matchExpressions": [{"key": "kubernetes.io/metadata.name",
            "operator": "In", "values": namespaces}]});
    }
    m
}

fn cel_policy(kind: &str, name: &str, namespace: &str, spec: Value) -> Value {
    let mut metadata = json!({"name": name});
    if !namespace.is_empty() {
        metadata["namespace"] = json!(namespace);
    }
    json!({"apiVersion": "policies.kyverno.io/v1beta1", "kind": kind, "metadata": metadata,
           "spec": spec})
}

/// Audit (a Deny that fails writes no admission report), at admission and in the background.
fn requires_label(namespaces: &[&str], label: &str) -> Value {
    json!({"validationActions": ["Audit"],
        "evaluation": {"admission": {"enabled": true}, "background": {"enabled": true}},
        "matchConstraints": cel_pods(namespaces, &["CREATE", "UPDATE"]),
        "validations": [{
            "expression": format!("has(object.metadata.labels) && '{label}' in object.metadata.labels"),
            "message": format!("label {label} is required")}]})
}

fn adds_label(namespaces: &[&str]) -> Value {
    json!({"evaluation": {"admission": {"enabled": true}, "background": {"enabled": true}},
        "matchConstraints": cel_pods(namespaces, &["CREATE"]),
        "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
            format!("Object{{metadata: Object.metadata{{labels: Object.metadata.labels{{{CEL_MUTATED_LABEL}: \"true\"}}}}}}")}}]})
}

/// A ConfigMap `<prefix>-<pod>` next to each new Pod (the namespaced kind generates into its
/// own namespace only, and its `generator.apply` takes no namespace).
fn generates_config_map(namespaces: &[&str], prefix: &str, namespaced: bool) -> Value {
    let (metadata, apply) = if namespaced {
        (
            format!(r#"dyn({{"name": "{prefix}-" + string(object.metadata.name)}})"#),
            "generator.apply(variables.cm)",
        )
    } else {
        (
            format!(
                r#"dyn({{"name": "{prefix}-" + string(object.metadata.name), "namespace": string(object.metadata.namespace)}})"#
            ),
            "generator.apply(string(object.metadata.namespace), variables.cm)",
        )
    };
    json!({"matchConstraints": cel_pods(namespaces, &["CREATE"]),
        "variables": [{"name": "cm", "expression": format!(
            r#"[{{"kind": dyn("ConfigMap"), "apiVersion": dyn("v1"), "metadata": {metadata}, "data": dyn({{"trigger": string(object.metadata.name)}})}}]"#)}],
        "generate": [{"expression": apply}]})
}

/// `(policy, source)` → result of every CEL-kind result (source not `kyverno`) in a report.
fn cel_results(report: &Value) -> BTreeMap<(String, String), String> {
    report["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["source"] != "kyverno")
        .map(|r| {
            let s = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
            ((s("policy"), s("source")), s("result"))
        })
        .collect()
}

/// Waits until the CEL results of `subject`'s report are exactly `expected` (`None`: any
/// result).
async fn expect_cel_results(
    env: &Env,
    subject: &Subject,
    expected: &[(&str, &str, Option<&str>)],
) -> Result<Duration> {
    let wanted: BTreeSet<(String, String)> = expected
        .iter()
        .map(|(p, s, _)| (p.to_string(), s.to_string()))
        .collect();
    let t0 = Instant::now();
    loop {
        let seen = env
            .report_of(subject)
            .await?
            .map(|r| cel_results(&r))
            .unwrap_or_default();
        let keys: BTreeSet<(String, String)> = seen.keys().cloned().collect();
        let results_right = expected.iter().all(|(p, s, result)| {
            result.is_none_or(|r| {
                seen.get(&(p.to_string(), s.to_string()))
                    .is_some_and(|x| x == r)
            })
        });
        if keys == wanted && results_right {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > REPORT_TIMEOUT {
            bail!(
                "the CEL results of {} are not {expected:?} after {REPORT_TIMEOUT:?}; last seen: \
                 {seen:?}\n{}",
                subject.label(),
                env.diagnostics()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The CEL policies the scenario deletes: `(plural, namespace, name)`.
const CEL_DELETED: [(&str, &str, &str); 6] = [
    ("validatingpolicies", "", "e2e-vpol-team"),
    ("mutatingpolicies", "", "e2e-mpol-label"),
    ("generatingpolicies", "", "e2e-gpol-cm"),
    (
        "namespacedvalidatingpolicies",
        NS_CEL_NAMESPACED,
        "e2e-nvpol-team",
    ),
    (
        "namespacedmutatingpolicies",
        NS_CEL_NAMESPACED,
        "e2e-nmpol-label",
    ),
    (
        "namespacedgeneratingpolicies",
        NS_CEL_NAMESPACED,
        "e2e-ngpol-cm",
    ),
];

/// The kept, the disabled and the six deleted CEL policies.
fn cel_policies() -> Vec<Value> {
    let nsd = NS_CEL_NAMESPACED;
    let mut disabled = cel_policy(
        "ValidatingPolicy",
        CEL_DISABLED,
        "",
        requires_label(&[NS_CEL], "disabled-check"),
    );
    disabled["metadata"]["labels"] = json!({"reports.kyverno.io/disabled": "true"});
    vec![
        cel_policy(
            "ValidatingPolicy",
            CEL_KEEP,
            "",
            requires_label(&[NS_CEL, nsd], "keep"),
        ),
        disabled,
        cel_policy(
            "ValidatingPolicy",
            "e2e-vpol-team",
            "",
            requires_label(&[NS_CEL], "team"),
        ),
        cel_policy(
            "MutatingPolicy",
            "e2e-mpol-label",
            "",
            adds_label(&[NS_CEL]),
        ),
        cel_policy(
            "GeneratingPolicy",
            "e2e-gpol-cm",
            "",
            generates_config_map(&[NS_CEL], "e2e-gpol", false),
        ),
        cel_policy(
            "NamespacedValidatingPolicy",
            "e2e-nvpol-team",
            nsd,
            requires_label(&[], "team"),
        ),
        cel_policy(
            "NamespacedMutatingPolicy",
            "e2e-nmpol-label",
            nsd,
            adds_label(&[]),
        ),
        cel_policy(
            "NamespacedGeneratingPolicy",
            "e2e-ngpol-cm",
            nsd,
            generates_config_map(&[], "e2e-ngpol", true),
        ),
    ]
}

async fn install_cel_policies(env: &mut Env) -> Result<()> {
    for ns in [NS_CEL, NS_CEL_NAMESPACED] {
        env.create_namespace(ns, json!({})).await?;
    }
    env.apply(&json!({"apiVersion": "v1", "kind": "List", "items": cel_policies()}))?;
    let mut ready: Vec<(&str, &str, &str)> = vec![("validatingpolicies", "", CEL_KEEP)];
    ready.extend(CEL_DELETED);
    let took = env.kyverno.wait_cel_policies_ready(&ready).await?;
    eprintln!(
        "[kyverno-e2e] mode {}: CEL policies ready in {took:.1?}",
        env.mode.short()
    );
    Ok(())
}

async fn delete_cel_policies(env: &Env) -> Result<()> {
    for (plural, ns, name) in CEL_DELETED {
        let object = format!("{plural}.policies.kyverno.io");
        let mut args = vec!["delete", object.as_str(), name, "--wait=true"];
        if !ns.is_empty() {
            args.extend(["-n", ns]);
        }
        env.admin.run(&args)?;
    }
    Ok(())
}

/// ValidatingPolicy, MutatingPolicy and GeneratingPolicy, cluster-scoped and namespaced: each
/// reports on the Pods it matches (results named `<name>` or `<namespace>/<name>`, rule-less
/// except for generation); a policy labelled `reports.kyverno.io/disabled` reports nothing;
/// deleting the six drops their results from the reports, the kept policy's stay.
async fn s_cel_policies(env: &mut Env) -> Result<()> {
    install_cel_policies(env).await?;
    let nsd = NS_CEL_NAMESPACED;
    let cluster_pod = Subject::pod(&env.create_pod(NS_CEL, pod("cel", json!({}), PAUSE)).await?);
    let namespaced_pod = Subject::pod(&env.create_pod(nsd, pod("cel-ns", json!({}), PAUSE)).await?);
    for (ns, name) in [(NS_CEL, "cel"), (nsd, "cel-ns")] {
        let p = Api::<Pod>::namespaced(env.client.clone(), ns)
            .get(name)
            .await?;
        let labels = p.metadata.labels.unwrap_or_default();
        ensure!(
            labels.get(CEL_MUTATED_LABEL).map(String::as_str) == Some("true"),
            "the MutatingPolicy of {ns} did not label Pod {name}: {labels:?}"
        );
    }
    let keep = (CEL_KEEP, VPOL, Some("fail"));
    expect_cel_results(
        env,
        &cluster_pod,
        &[
            keep,
            ("e2e-vpol-team", VPOL, Some("fail")),
            ("e2e-mpol-label", MPOL, None),
            ("e2e-gpol-cm", GPOL, Some("pass")),
        ],
    )
    .await?;
    let (nvpol, nmpol, ngpol) = (
        format!("{nsd}/e2e-nvpol-team"),
        format!("{nsd}/e2e-nmpol-label"),
        format!("{nsd}/e2e-ngpol-cm"),
    );
    expect_cel_results(
        env,
        &namespaced_pod,
        &[
            keep,
            (&nvpol, VPOL, Some("fail")),
            (&nmpol, MPOL, None),
            (&ngpol, GPOL, Some("pass")),
        ],
    )
    .await?;
    let leaked = env.results_of_policy(&[CEL_DISABLED]).await?;
    ensure!(
        leaked.is_empty(),
        "results of the report-disabled {CEL_DISABLED}: {leaked:?}"
    );
    eprintln!(
        "[kyverno-e2e] mode {}: six CEL policy kinds reported, the disabled one did not",
        env.mode.short()
    );

    delete_cel_policies(env).await?;
    let t = Instant::now();
    expect_cel_results(env, &cluster_pod, &[keep]).await?;
    expect_cel_results(env, &namespaced_pod, &[keep]).await?;
    let names: Vec<&str> = ["e2e-vpol-team", "e2e-mpol-label", "e2e-gpol-cm"]
        .into_iter()
        .chain([nvpol.as_str(), nmpol.as_str(), ngpol.as_str()])
        .collect();
    let left = env.results_of_policy(&names).await?;
    ensure!(
        left.is_empty(),
        "results of deleted CEL policies left: {left:?}"
    );
    eprintln!(
        "[kyverno-e2e] mode {}: results of the six deleted CEL policies dropped in {:.1?}",
        env.mode.short(),
        t.elapsed()
    );
    Ok(())
}

/// Deleting a Pod garbage-collects its PolicyReport (kube-controller-manager, ownerReference).
async fn s_pod_deletion(env: &mut Env) -> Result<()> {
    let pods = Api::<Pod>::namespaced(env.client.clone(), NS_ADMISSION);
    let doomed = Subject::pod(&pods.get("with-app").await?);
    let kept = Subject::pod(&pods.get("without-app").await?);
    ensure!(
        env.report_of(&doomed).await?.is_some(),
        "the report of {} is missing before the deletion",
        doomed.label()
    );
    pods.delete("with-app", &DeleteParams::background().grace_period(0))
        .await?;
    let took = env.expect_no_report(&doomed, GC_TIMEOUT).await?;
    eprintln!(
        "[kyverno-e2e] mode {}: PolicyReport of the deleted Pod garbage-collected after {took:.1?}",
        env.mode.short()
    );
    ensure!(
        env.report_of(&kept).await?.is_some(),
        "the report of {} (not deleted) disappeared",
        kept.label()
    );
    Ok(())
}

/// Deleting a namespace removes its reports; deleting a Namespace that has a
/// ClusterPolicyReport garbage-collects that report.
async fn s_namespace_deletion(env: &mut Env) -> Result<()> {
    let pods = Api::<Pod>::namespaced(env.client.clone(), NS_UPDATE);
    let web = Subject::pod(&pods.get("web").await?);
    ensure!(
        env.report_of(&web).await?.is_some(),
        "the report of {} is missing before the deletion",
        web.label()
    );
    let cluster_a = Subject::namespace(
        &Api::<Namespace>::all(env.client.clone())
            .get("kyv-cluster-a")
            .await?,
    );
    let namespaces = Api::<Namespace>::all(env.client.clone());
    for ns in [NS_UPDATE, "kyv-cluster-a"] {
        namespaces.delete(ns, &DeleteParams::default()).await?;
    }
    let polr = env.polr(NS_UPDATE);
    let took = eventually(
        "namespace kyv-update and its reports gone",
        GC_TIMEOUT,
        || async {
            Ok(namespaces.get_opt(NS_UPDATE).await?.is_none()
                && polr.list(&ListParams::default()).await?.items.is_empty())
        },
    )
    .await
    .with_context(|| env.diagnostics())?;
    eprintln!(
        "[kyverno-e2e] mode {}: namespace and its reports gone after {took:.1?}",
        env.mode.short()
    );
    env.expect_no_report(&cluster_a, GC_TIMEOUT).await?;
    Ok(())
}

/// Kyverno's reports controller restarted: it resumes its watches on our server (no list or
/// watch error in its new log) and reports keep coming.
async fn s_reports_controller_restart(env: &mut Env) -> Result<()> {
    env.kyverno.restart(Controller::Reports).await?;
    env.create_namespace(NS_RESTART, json!({})).await?;
    let p = env
        .create_pod(NS_RESTART, pod("after-restart", json!({}), PAUSE))
        .await?;
    env.expect_report(
        "restart/after-restart",
        &Subject::pod(&p),
        &[res(
            P_RESTART,
            "require-team",
            "fail",
            "E2E Restart",
            "low",
            bg(),
        )],
    )
    .await?;
    let errors = env.kyverno.watch_errors(&[Controller::Reports], true);
    ensure!(
        errors.is_empty(),
        "the restarted reports controller logged list/watch errors:\n{}",
        errors.join("\n")
    );
    Ok(())
}

/// Figures, nothing timed is asserted: `n` Pods exist, then a policy matching them is created;
/// the background scan must produce `n` PolicyReports with the expected result. Prints the time
/// from the policy's creation to the last report and our server's peak RSS meanwhile.
async fn s_figures(env: &mut Env, n: usize) -> Result<Figures> {
    env.create_namespace(NS_SCALE, json!({})).await?;
    let pods = Api::<Pod>::namespaced(env.client.clone(), NS_SCALE);
    let t = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let pods = pods.clone();
            async move {
                let p: Pod = serde_json::from_value(pod(&format!("p-{i:04}"), json!({}), PAUSE))?;
                pods.create(&PostParams::default(), &p).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(8)
        .try_collect::<Vec<_>>()
        .await
        .context("creating the Pods")?;
    let created_in = t.elapsed();
    eprintln!(
        "[kyverno-e2e] mode {}: {n} Pods created in {created_in:.1?}",
        env.mode.short()
    );
    // Sample our server's RSS while the scan runs.
    let pid = env
        .server
        .pid()
        .ok_or_else(|| anyhow!("server not running"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Some(kb) = reports_server_tests::proc_status::kib(pid, "VmRSS") {
                    peak.fetch_max(kb, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let rss_before = reports_server_tests::proc_status::kib(pid, "VmRSS").unwrap_or(0);
    let t = Instant::now();
    env.apply(&require_label_policy(
        P_SCALE,
        "require-team",
        &[NS_SCALE],
        "team",
        true,
        "E2E Scale",
        "low",
    ))?;
    let polr = env.polr(NS_SCALE);
    let deadline = Instant::now() + Duration::from_secs(900);
    let waited = loop {
        let items = polr.list(&ListParams::default()).await?.items;
        let count = items
            .iter()
            .filter(|o| {
                let v = serde_json::to_value(o).unwrap_or_default();
                v["results"].as_array().is_some_and(|rs| {
                    rs.iter().any(|r| {
                        r["policy"] == P_SCALE
                            && r["rule"] == "require-team"
                            && r["result"] == "fail"
                    })
                })
            })
            .count();
        if count == n {
            break Ok(());
        }
        if Instant::now() > deadline {
            break Err(anyhow!("{count} of {n} PolicyReports complete after 900 s"));
        }
        tokio::time::sleep(Duration::from_millis(1000)).await;
    };
    let took = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let hwm = reports_server_tests::proc_status::kib(pid, "VmHWM").unwrap_or(0);
    waited.with_context(|| env.diagnostics())?;
    let f = Figures {
        pods: n,
        created_in,
        reports_in: took,
        rss_before_kb: rss_before,
        rss_peak_kb: peak.load(Ordering::Relaxed),
        vm_hwm_kb: hwm,
    };
    eprintln!("[kyverno-e2e] mode {}: FIGURES {f}", env.mode.short());
    Ok(f)
}

#[derive(Clone, Debug)]
struct Figures {
    pods: usize,
    created_in: Duration,
    reports_in: Duration,
    rss_before_kb: u64,
    rss_peak_kb: u64,
    vm_hwm_kb: u64,
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} Pods created in {:.1?}; policy created -> {} PolicyReports in {:.1?}; reports-server RSS {:.0} MiB before, peak {:.0} MiB during the scan (VmHWM {:.0} MiB)",
            self.pods,
            self.created_in,
            self.pods,
            self.reports_in,
            self.rss_before_kb as f64 / 1024.0,
            self.rss_peak_kb as f64 / 1024.0,
            self.vm_hwm_kb as f64 / 1024.0
        )
    }
}

// ---- one mode ----------------------------------------------------------------------------------

struct Outcome {
    name: &'static str,
    error: Option<String>,
    took: Duration,
}

struct ModeRun {
    mode: Mode,
    started_in: Duration,
    outcomes: Vec<Outcome>,
    snapshots: BTreeMap<String, Value>,
    figures: Option<Figures>,
}

macro_rules! scenario {
    ($env:expr, $outcomes:expr, $name:literal, $f:ident) => {{
        let t = Instant::now();
        eprintln!(
            "[kyverno-e2e] mode {}: scenario {} ...",
            $env.mode.short(),
            $name
        );
        let r = $f(&mut $env).await;
        let took = t.elapsed();
        match &r {
            Ok(()) => eprintln!(
                "[kyverno-e2e] mode {}: scenario {} PASSED in {took:.1?}",
                $env.mode.short(),
                $name
            ),
            Err(e) => eprintln!(
                "[kyverno-e2e] mode {}: scenario {} FAILED in {took:.1?}: {e:#}",
                $env.mode.short(),
                $name
            ),
        }
        $outcomes.push(Outcome {
            name: $name,
            error: r.err().map(|e| format!("{e:#}")),
            took,
        });
    }};
}

async fn run_mode(mode: Mode, pods: usize) -> Result<ModeRun> {
    eprintln!("[kyverno-e2e] ===== mode {} =====", mode.describe());
    let mut env = Env::start(mode).await?;
    let mut consumer = Consumer::start(&env).await;
    let mut outcomes = Vec::new();
    let t = Instant::now();
    let installed = install_scenario_policies(&env).await;
    outcomes.push(Outcome {
        name: "install scenario policies",
        error: installed.as_ref().err().map(|e| format!("{e:#}")),
        took: t.elapsed(),
    });
    if installed.is_ok() {
        scenario!(
            env,
            outcomes,
            "fresh install: first report, no RV error",
            s_fresh_install
        );
        scenario!(env, outcomes, "admission audit", s_admission_audit);
        scenario!(
            env,
            outcomes,
            "mutating policy, no ephemeral left",
            s_mutate
        );
        scenario!(env, outcomes, "update flips a result", s_update);
        scenario!(env, outcomes, "PolicyException -> skip", s_exception);
        scenario!(
            env,
            outcomes,
            "cluster-scoped -> ClusterPolicyReport",
            s_cluster_scoped
        );
        scenario!(
            env,
            outcomes,
            "background scan, 17 PSS policies",
            s_pss_background
        );
        // The most results of the run's scenarios (19 rules on each PSS Pod) are in place here.
        outcomes.push(
            consumer
                .check(
                    &env,
                    "Policy Reporter v3.9.0 = query compliance, after the PSS scan",
                )
                .await,
        );
        scenario!(
            env,
            outcomes,
            "deleting ClusterPolicies drops results",
            s_delete_policy
        );
        if env.mode.merger == Merger::Server {
            scenario!(
                env,
                outcomes,
                "CEL policy kinds: results, disabled label, deletion",
                s_cel_policies
            );
        }
        scenario!(env, outcomes, "Pod deletion GCs its report", s_pod_deletion);
        scenario!(
            env,
            outcomes,
            "namespace deletion removes reports",
            s_namespace_deletion
        );
        scenario!(
            env,
            outcomes,
            "reports controller restart",
            s_reports_controller_restart
        );
    }
    // The figures measure the merge, not the group it writes: once per merger is enough.
    let figures = if mode.group == Group::Wgpolicy {
        let t = Instant::now();
        let figures = s_figures(&mut env, pods).await;
        outcomes.push(Outcome {
            name: "figures: background scan of many Pods",
            error: figures.as_ref().err().map(|e| format!("{e:#}")),
            took: t.elapsed(),
        });
        figures.ok()
    } else {
        None
    };
    outcomes.push(
        consumer
            .check(
                &env,
                "Policy Reporter v3.9.0 = query compliance, at the end of the run",
            )
            .await,
    );
    consumer.stop();
    // Bug-1 regression over the whole run: no watch error in any Kyverno log.
    let errors = env.kyverno.watch_errors(&Controller::ALL, false);
    outcomes.push(Outcome {
        name: "whole run: no list/watch error in Kyverno's logs",
        error: log_lines_failure(&errors),
        took: Duration::ZERO,
    });
    let errors = env.kyverno.report_errors(&Controller::ALL);
    outcomes.push(Outcome {
        name: "whole run: no ERR line about reports in Kyverno's logs",
        error: log_lines_failure(&errors),
        took: Duration::ZERO,
    });
    let run = ModeRun {
        mode,
        started_in: env.started_in,
        outcomes,
        snapshots: std::mem::take(&mut env.snapshots),
        figures,
    };
    if std::env::var_os("REPORTS_SERVER_KEEP_E2E").is_some() {
        eprintln!("[kyverno-e2e] logs kept in {}", env.cp.dir().display());
    }
    env.stop().await?;
    Ok(run)
}

// ---- Policy Reporter, a real consumer ----------------------------------------------------------

/// Policy Reporter v3.9.0 (`reports_server_tests::policy_reporter`), started before the first
/// report of the run so that it follows the whole run through its watches (creations, updates,
/// garbage collection, namespace deletion, the many-Pods scan), not just a final list.
struct Consumer {
    /// The start-up error is kept as text: every check of the run reports it.
    reporter: Result<PolicyReporter, String>,
}

impl Consumer {
    async fn start(env: &Env) -> Consumer {
        let reporter = PolicyReporter::start(&env.cp)
            .await
            .context("starting Policy Reporter (see docs/policy-reporter.md)")
            .map_err(|e| format!("{e:#}"));
        Consumer { reporter }
    }

    /// Policy Reporter's REST counts and `policy_report_result` metrics equal `reports-server
    /// query compliance` on this server's database, per namespace and per policy, once it has
    /// caught up; and it was never refused a request (its ServiceAccount has only get, list and
    /// watch on the report kinds).
    async fn check(&mut self, env: &Env, name: &'static str) -> Outcome {
        let t = Instant::now();
        let checked = async {
            let pr = self.reporter.as_mut().map_err(|e| anyhow!("{e}"))?;
            let bin = server::binary()?;
            let url = policy_reporter::database_url_of(&env.server.args)
                .ok_or_else(|| anyhow!("the server runs without --database-url"))?;
            let agreed = policy_reporter::expect_agreement(pr, &bin, url).await?;
            let forbidden = pr.forbidden_lines();
            ensure!(
                forbidden.is_empty(),
                "Policy Reporter was refused requests (its ClusterRole lacks something):\n{}",
                forbidden.join("\n")
            );
            eprintln!(
                "[kyverno-e2e] mode {}: Policy Reporter {POLICY_REPORTER_VERSION}: {agreed}",
                env.mode.short()
            );
            anyhow::Ok(())
        }
        .await;
        Outcome {
            name,
            error: checked.err().map(|e| format!("{e:#}")),
            took: t.elapsed(),
        }
    }

    /// Stops Policy Reporter before the APIServices go away (it would log their absence).
    fn stop(self) {
        if let Ok(mut pr) = self.reporter {
            pr.stop();
        }
    }
}

/// A failure naming the first of `lines`, or none when there are none.
fn log_lines_failure(lines: &[String]) -> Option<String> {
    (!lines.is_empty()).then(|| {
        let first: Vec<&str> = lines.iter().take(20).map(String::as_str).collect();
        format!("{} lines, first ones:\n{}", lines.len(), first.join("\n"))
    })
}

/// Differences between the normalised reports of the two modes.
fn compare_modes(a: &ModeRun, b: &ModeRun) -> Vec<String> {
    let mut diffs = Vec::new();
    for (key, ra) in &a.snapshots {
        match b.snapshots.get(key) {
            None => diffs.push(format!("{key}: only in mode {}", a.mode.short())),
            Some(rb) if ra != rb => diffs.push(format!(
                "{key}:\n  mode {}: {}\n  mode {}: {}",
                a.mode.short(),
                ra,
                b.mode.short(),
                rb
            )),
            Some(_) => {}
        }
    }
    for key in b.snapshots.keys() {
        if !a.snapshots.contains_key(key) {
            diffs.push(format!("{key}: only in mode {}", b.mode.short()));
        }
    }
    diffs
}

fn pods_for_figures() -> usize {
    std::env::var("REPORTS_SERVER_KYVERNO_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500)
}

/// Both aggregation modes, every scenario, then the comparison of the reports they produced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_kyverno_both_aggregation_modes() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let t0 = Instant::now();
    let pods = pods_for_figures();
    let mut runs = Vec::new();
    for mode in [
        Mode::A,
        Mode::B,
        Mode::A.in_openreports(),
        Mode::B.in_openreports(),
    ] {
        runs.push(run_mode(mode, pods).await?);
    }
    // The two mergers against each other, and each group against the other (modulo the
    // documented mapping, `openreports_as_wgpolicy`).
    let comparisons: Vec<(usize, usize, Vec<String>)> = [(0, 1), (0, 2), (1, 3)]
        .into_iter()
        .map(|(x, y)| (x, y, compare_modes(&runs[x], &runs[y])))
        .collect();

    let mut table = String::new();
    writeln!(
        table,
        "\n[kyverno-e2e] ===== summary (Kyverno {KYVERNO_VERSION}) ====="
    )?;
    for run in &runs {
        writeln!(
            table,
            "mode {} (ready in {:.1?})",
            run.mode.describe(),
            run.started_in
        )?;
        for o in &run.outcomes {
            writeln!(
                table,
                "  {:<6} {:>7.1?}  {}",
                if o.error.is_none() { "PASS" } else { "FAIL" },
                o.took,
                o.name
            )?;
        }
        if let Some(f) = &run.figures {
            writeln!(table, "  figures: {f}")?;
        }
    }
    for (x, y, diffs) in &comparisons {
        writeln!(
            table,
            "compared: {} reports in {}, {} in {}, {} differences",
            runs[*x].snapshots.len(),
            runs[*x].mode.short(),
            runs[*y].snapshots.len(),
            runs[*y].mode.short(),
            diffs.len()
        )?;
    }
    writeln!(table, "total {:.1?}", t0.elapsed())?;
    eprintln!("{table}");

    let mut failures = Vec::new();
    for run in &runs {
        for o in &run.outcomes {
            if let Some(e) = &o.error {
                failures.push(format!("mode {} / {}: {e}", run.mode.short(), o.name));
            }
        }
    }
    for (x, y, diffs) in &comparisons {
        if !diffs.is_empty() {
            failures.push(format!(
                "modes {} and {} produced different reports:\n{}",
                runs[*x].mode.short(),
                runs[*y].mode.short(),
                diffs.join("\n")
            ));
        }
    }
    if !failures.is_empty() {
        bail!(
            "{} failure(s):\n\n{}",
            failures.len(),
            failures.join("\n\n")
        );
    }
    Ok(())
}
