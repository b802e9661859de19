//! A database outage on the real node (`tests/src/node.rs`), where kubelet probes decide which
//! pods stay behind the Service and kube-apiserver decides from that whether three API groups
//! stay in discovery.
//!
//! Installed as a user installs it: the operator from `manifests/install.yaml`, a ReportsServer
//! with two replicas on a PostgreSQL the test controls (a Deployment with its data on a host
//! path, standing for the user's database), and Kyverno v1.19.1 as processes in mode B
//! (`--aggregateReports=false`: the servers merge its ephemeral reports). While a writer creates
//! PolicyReports through kube-apiserver every 100 ms, a Pod is created every 2 s (half of them
//! failing Kyverno's audit policy), and pollers read `/apis` and run `kubectl api-resources`
//! every 100 ms, the database goes away for `REPORTS_SERVER_OUTAGE_SECONDS` (default 120):
//!
//! 1. **stopped**: the PostgreSQL Deployment scaled to 0 (its pod killed), then back to 1;
//! 2. **black-holed**: every packet into the PostgreSQL pod's network namespace dropped
//!    (nftables in that namespace), then let through again.
//!
//! First, with the database up, Kyverno's admission-report adoption: a mutating policy's report,
//! written before its Pod had a uid, ends in the Pod's PolicyReport through the servers' shipped
//! ClusterRole (the adoption reads the Pod; no Secret, no `*`).
//!
//! Each outage must show: no discovery failure; the three APIServices Available and both server pods
//! Ready with no restart throughout; every data call after detection answered 503 within 1 s;
//! every acknowledged write present and every refused one absent afterwards (ambiguous ones
//! counted); no Kyverno restart; every Pod's PolicyReport right within 60 s of recovery; the
//! `DatabaseAvailable` condition False during the outage and True after; and a namespace deleted
//! during the outage gone after it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use reports_server_tests::{
    delegated::{API_SERVICES, raw_with},
    kube_client_with_retries,
    kubectl::Kubectl,
    kyverno::{Controller, Kyverno, KyvernoOptions},
    kyverno_fixtures::{MUTATE_RULE, mutate_label_policy},
    node::{self, ApiPoller, Node, POSTGRES_IMAGE, RunDir},
    operator::{self, NS, condition, rs_json},
};
use serde_json::{Value, json};

const PG: &str = "outage-db";
/// The user's database lives in a namespace of its own: it needs a host path, which the
/// restricted Pod Security Standard of the operator's namespace refuses.
const DB_NS: &str = "outage-db";
const PG_PASSWORD: &str = "e2e-outage-password";
const PODS_NS: &str = "outage-pods";
const WRITES_NS: &str = "outage-writes";
const POLICY: &str = "require-team";
/// Where a mutating policy's admission report must be adopted.
const ADOPTION_NS: &str = "adoption";
const ADOPTION_POLICY: &str = "e2e-mutate-add-label";
const MUTATED_LABEL: &str = "e2e.reports-server.io/mutated";
const SERVER_PODS: &str =
    "app.kubernetes.io/name=reports-server,app.kubernetes.io/instance=reports-server";
const READY_TIMEOUT: Duration = Duration::from_secs(240);
/// Load before the outage, and after recovery before the checks.
const WARM: Duration = Duration::from_secs(20);
/// The servers notice an outage within about 2.5 s (probe every 500 ms, 1 s deadline, a missed
/// deadline asked again once).
const DETECTION: Duration = Duration::from_secs(3);
const FAST: Duration = Duration::from_secs(1);
/// From the database's return to every Pod's report being right and the namespace gone:
/// kube-controller-manager retries a failing namespace deletion at most every 60 s (5 ms,
/// doubling, capped), so after a 2-minute outage its next try may come a minute after the
/// database is back (a black-holed run settled at 60.4 s, a stopped one at 37 s); Kyverno
/// rescans every 30 s (its `--backgroundScanInterval` here).
const SETTLE: Duration = Duration::from_secs(90);

fn outage_length() -> Duration {
    let seconds = std::env::var("REPORTS_SERVER_OUTAGE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    Duration::from_secs(seconds)
}

/// The outages to stage, in order: both unless `REPORTS_SERVER_OUTAGES` names some
/// (`stopped`, `blackholed`, comma-separated), to look at one alone.
fn outages_to_stage() -> Result<Vec<Outage>> {
    let Ok(names) = std::env::var("REPORTS_SERVER_OUTAGES") else {
        return Ok(vec![Outage::Stopped, Outage::BlackHoled]);
    };
    names
        .split(',')
        .map(|name| match name.trim().to_ascii_lowercase().as_str() {
            "stopped" => Ok(Outage::Stopped),
            "blackholed" => Ok(Outage::BlackHoled),
            other => {
                bail!("REPORTS_SERVER_OUTAGES: unknown outage {other:?} (stopped, blackholed)")
            }
        })
        .collect()
}

#[test]
fn database_outage_on_the_node() {
    node::run_isolated("database_outage_on_the_node", |run| async move {
        on_the_node(run).await
    });
}

async fn on_the_node(run: RunDir) -> Result<()> {
    let node = Node::start(&run).await?;
    let result = async {
        let mut env = Env::install(&node, &run).await?;
        let mut failures = Vec::new();
        if let Err(e) = env.admission_report_adoption().await {
            eprintln!("[e2e_outage_node] admission-report adoption FAILED: {e:#}");
            failures.push(format!("admission-report adoption: {e:#}"));
        }
        for outage in outages_to_stage()? {
            if let Err(e) = env.outage(outage).await {
                eprintln!("[e2e_outage_node] {outage:?} FAILED: {e:#}");
                failures.push(format!("{outage:?}: {e:#}"));
            }
        }
        env.kyverno.stop();
        ensure!(failures.is_empty(), "{}", failures.join("\n\n"));
        Ok(())
    }
    .await;
    if let Err(e) = &result {
        let kubectl = Kubectl::new(node.cp().kubeconfig_path());
        let pods = kubectl
            .run(&["get", "pods,rsrv,apiservices", "-A", "-o", "wide"])
            .unwrap_or_default();
        eprintln!(
            "[e2e_outage_node] FAILED: {e:#}\n{pods}\n{}",
            node.diagnostics()
        );
        for pod in names(&kubectl, NS, SERVER_PODS).unwrap_or_default() {
            eprintln!("{}", node.pod_logs(NS, &pod, 150));
        }
    }
    node.stop().await?;
    result
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outage {
    Stopped,
    BlackHoled,
}

/// The installation and Kyverno, shared by both outages.
struct Env<'a> {
    node: &'a Node,
    kubectl: Kubectl,
    /// Shows every answer as sent (no retries of 503).
    client: kube::Client,
    kyverno: Kyverno,
    kyverno_pids: Vec<Option<u32>>,
}

impl<'a> Env<'a> {
    async fn install(node: &'a Node, run: &RunDir) -> Result<Env<'a>> {
        let t = Instant::now();
        let kubectl = Kubectl::new(node.cp().kubeconfig_path());
        operator::install_on_node(node, &kubectl)?;
        postgres(&kubectl, run)?;
        kubectl.run_with_stdin(&["apply", "-f", "-"], Some(&installation()))?;
        operator::wait_condition(&kubectl, "Ready", READY_TIMEOUT).await?;
        eprintln!(
            "[e2e_outage_node] operator, PostgreSQL and 2 servers Ready in {:.1?}",
            t.elapsed()
        );
        let t = Instant::now();
        let options = KyvernoOptions {
            aggregate_reports: false,
            background_scan_interval: Duration::from_secs(30),
            ..Default::default()
        };
        let kyverno = Kyverno::install(node.cp(), options).await?;
        let kyverno_pids = Controller::ALL.iter().map(|c| kyverno.pid(*c)).collect();
        kubectl.run_with_stdin(&["apply", "-f", "-"], Some(&workload_yaml()))?;
        eprintln!(
            "[e2e_outage_node] Kyverno (mode B) and its policy in {:.1?}",
            t.elapsed()
        );
        Ok(Env {
            node,
            client: kube_client_with_retries(node.cp().kubeconfig_path(), false).await?,
            kubectl,
            kyverno,
            kyverno_pids,
        })
    }

    /// One outage under load, judged.
    async fn outage(&mut self, outage: Outage) -> Result<()> {
        let tag = match outage {
            Outage::Stopped => "stop",
            Outage::BlackHoled => "hole",
        };
        let doomed = format!("outage-doomed-{tag}");
        self.kubectl
            .run_with_stdin(&["apply", "-f", "-"], Some(&doomed_yaml(&doomed)))?;
        let load = Load::start(self, tag);
        tokio::time::sleep(WARM).await;
        let began = Instant::now();
        self.begin(outage)?;
        eprintln!("[e2e_outage_node] {outage:?}: the database is gone");
        tokio::time::sleep(Duration::from_secs(10)).await;
        self.kubectl
            .run(&["delete", "namespace", &doomed, "--wait=false"])?;
        let condition_during =
            wait_database_condition(&self.kubectl, "False", Duration::from_secs(40)).await;
        tokio::time::sleep_until((began + outage_length()).into()).await;
        let ended = Instant::now();
        self.end(outage).await?;
        let back = Instant::now();
        eprintln!(
            "[e2e_outage_node] {outage:?}: the database is back after {:.1?} ({:.1?} to start it)",
            back - began,
            back - ended
        );
        tokio::time::sleep(WARM).await;
        let seen = load.finish().await?;
        let mut problems = seen.judge(began, ended);
        problems.extend(
            condition_during
                .err()
                .map(|e| format!("DatabaseAvailable during the outage: {e:#}")),
        );
        problems.extend(self.after_recovery(&seen, &doomed, back).await);
        problems.extend(self.kyverno_unchanged());
        ensure!(
            problems.is_empty(),
            "{} problem(s):\n- {}",
            problems.len(),
            problems.join("\n- ")
        );
        Ok(())
    }

    fn begin(&self, outage: Outage) -> Result<()> {
        match outage {
            Outage::Stopped => {
                let deployment = format!("deployment/{PG}");
                self.kubectl
                    .run(&["scale", "-n", DB_NS, &deployment, "--replicas=0"])?;
                self.kubectl.run(&[
                    "wait",
                    "-n",
                    DB_NS,
                    "--for=delete",
                    "pod",
                    "-l",
                    &format!("app={PG}"),
                    "--timeout=60s",
                ])?;
            }
            // Loopback stays open: the pod's own readiness probe (pg_isready) keeps passing, so
            // the Service keeps its endpoint and connections to it hang instead of failing.
            Outage::BlackHoled => nft(
                &self.database_netns()?,
                &[
                    "add table inet blackhole",
                    "add chain inet blackhole input { type filter hook input priority -300; policy drop; }",
                    "add rule inet blackhole input iifname lo accept",
                    "add chain inet blackhole output { type filter hook output priority -300; policy drop; }",
                    "add rule inet blackhole output oifname lo accept",
                ],
            )?,
        }
        Ok(())
    }

    async fn end(&self, outage: Outage) -> Result<()> {
        match outage {
            Outage::Stopped => {
                let deployment = format!("deployment/{PG}");
                self.kubectl
                    .run(&["scale", "-n", DB_NS, &deployment, "--replicas=1"])?;
                self.kubectl.run(&[
                    "rollout",
                    "status",
                    "-n",
                    DB_NS,
                    &deployment,
                    "--timeout=120s",
                ])?;
            }
            Outage::BlackHoled => nft(&self.database_netns()?, &["delete table inet blackhole"])?,
        }
        Ok(())
    }

    /// The network namespace of the PostgreSQL pod (`/run/netns/cni-…` holding its IP).
    fn database_netns(&self) -> Result<String> {
        let ip = self.kubectl.run(&[
            "get",
            "pods",
            "-n",
            DB_NS,
            "-l",
            &format!("app={PG}"),
            "-o",
            "jsonpath={.items[0].status.podIP}",
        ])?;
        let ip = ip.trim();
        ensure!(!ip.is_empty(), "the PostgreSQL pod has no IP");
        for entry in std::fs::read_dir("/run/netns")? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            let out = std::process::Command::new("ip")
                .args(["-n", &name, "-o", "addr"])
                .output()?;
            if String::from_utf8_lossy(&out.stdout).contains(&format!(" {ip}/")) {
                return Ok(name);
            }
        }
        bail!("no network namespace under /run/netns holds {ip}")
    }

    /// Kyverno's mutating webhook writes its admission report before the Pod has a uid; the
    /// servers, with no more rights than the shipped `reports-server` ClusterRole (no Secrets,
    /// read of the kinds Kyverno reports on), must find the Pod, adopt the report and merge it
    /// into the Pod's PolicyReport, leaving no EphemeralReport behind.
    async fn admission_report_adoption(&self) -> Result<()> {
        let t = Instant::now();
        let policy = mutate_label_policy(
            ADOPTION_POLICY,
            ADOPTION_NS,
            MUTATED_LABEL,
            "E2E Mutate",
            "info",
        );
        let objects = json!({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ADOPTION_NS}},
            policy,
        ]});
        self.kubectl
            .run_with_stdin(&["apply", "-f", "-"], Some(&objects.to_string()))?;
        self.kyverno
            .wait_cluster_policies_ready(&[ADOPTION_POLICY], "pods", true)
            .await?;
        let mut pod = pending_pod("adopted", true);
        pod["metadata"]["namespace"] = json!(ADOPTION_NS);
        let created: Value = serde_json::from_str(
            &self
                .kubectl
                .run_with_stdin(&["create", "-o", "json", "-f", "-"], Some(&pod.to_string()))?,
        )?;
        ensure!(
            created["metadata"]["labels"][MUTATED_LABEL] == "true",
            "Kyverno's mutating webhook did not add {MUTATED_LABEL}: {}",
            created["metadata"]
        );
        let uid = created["metadata"]["uid"].as_str().unwrap_or_default();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let report = self
                .kubectl
                .run(&["get", "policyreport", "-n", ADOPTION_NS, uid, "-o", "json"])
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok());
            let ephemeral =
                self.kubectl
                    .run(&["get", "ephemeralreports", "-n", ADOPTION_NS, "-o", "name"])?;
            let merged = report.as_ref().is_some_and(|r| {
                r["metadata"]["ownerReferences"][0]["uid"] == uid
                    && r["results"].as_array().is_some_and(|results| {
                        results.iter().any(|x| {
                            x["policy"] == ADOPTION_POLICY
                                && x["rule"] == MUTATE_RULE
                                && x["result"] == "pass"
                        })
                    })
            });
            if merged && ephemeral.trim().is_empty() {
                break;
            }
            ensure!(
                Instant::now() < deadline,
                "after 120 s: the Pod's PolicyReport {} and EphemeralReports left {:?}\n{}",
                report
                    .map(|r| r.to_string())
                    .unwrap_or_else(|| "missing".into()),
                ephemeral.trim(),
                self.kyverno.diagnostics(20)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        eprintln!(
            "[e2e_outage_node] admission report written before the Pod had a uid: adopted and \
             merged into the Pod's PolicyReport, none left, in {:.1?}",
            t.elapsed()
        );
        Ok(())
    }

    /// After the database is back: the writes, every Pod's report, the namespace, the condition.
    async fn after_recovery(&self, seen: &Seen, doomed: &str, back: Instant) -> Vec<String> {
        let mut problems = Vec::new();
        match stored_reports(&self.kubectl) {
            Ok(stored) => problems.extend(seen.check_writes(&stored)),
            Err(e) => problems.push(format!("list the written reports: {e:#}")),
        }
        let deadline = back + SETTLE;
        if let Err(e) = pod_reports_right(&self.kubectl, deadline).await {
            problems.push(format!("Pod reports {SETTLE:?} after recovery: {e:#}"));
        }
        if let Err(e) = gone(&self.kubectl, doomed, deadline).await {
            problems.push(format!("namespace deleted during the outage: {e:#}"));
        }
        if let Err(e) =
            wait_database_condition(&self.kubectl, "True", Duration::from_secs(40)).await
        {
            problems.push(format!("DatabaseAvailable after recovery: {e:#}"));
        }
        eprintln!(
            "[e2e_outage_node] settled {:.1?} after the database came back",
            back.elapsed()
        );
        problems
    }

    fn kyverno_unchanged(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Err(e) = self.kyverno.check_running() {
            problems.push(format!("Kyverno: {e:#}"));
        }
        let pids: Vec<Option<u32>> = Controller::ALL
            .iter()
            .map(|c| self.kyverno.pid(*c))
            .collect();
        if pids != self.kyverno_pids {
            problems.push(format!(
                "a Kyverno controller was restarted: pids {:?} -> {pids:?}",
                self.kyverno_pids
            ));
        }
        problems
    }
}

// ---- objects ----------------------------------------------------------------------------------

/// The user's PostgreSQL: a Deployment whose data lives on a host path, so that scaling it to 0
/// and back is a database stopped and started again, and a Service in front of it.
fn postgres(kubectl: &Kubectl, run: &RunDir) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let data = run.path().join("node/outage-db");
    std::fs::create_dir_all(&data)?;
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o1777))?;
    let yaml = format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: {DB_NS}}}
---
apiVersion: v1
kind: Service
metadata: {{name: {PG}, namespace: {DB_NS}}}
spec:
  selector: {{app: {PG}}}
  ports: [{{name: postgres, port: 5432, targetPort: 5432}}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: {PG}, namespace: {DB_NS}}}
spec:
  replicas: 1
  strategy: {{type: Recreate}}
  selector: {{matchLabels: {{app: {PG}}}}}
  template:
    metadata: {{labels: {{app: {PG}}}}}
    spec:
      # Stopping is a kill: PostgreSQL's smart shutdown would wait for the servers' connections.
      terminationGracePeriodSeconds: 1
      containers:
      - name: postgres
        image: {POSTGRES_IMAGE}
        env:
        - {{name: POSTGRES_USER, value: reports}}
        - {{name: POSTGRES_DB, value: reports}}
        - {{name: POSTGRES_PASSWORD, value: {PG_PASSWORD}}}
        ports: [{{containerPort: 5432}}]
        readinessProbe:
          exec: {{command: [pg_isready, -U, reports, -d, reports]}}
          periodSeconds: 1
        volumeMounts: [{{name: data, mountPath: /var/lib/postgresql/data}}]
      volumes:
      - {{name: data, hostPath: {{path: "{data}", type: Directory}}}}
"#,
        data = data.display()
    );
    kubectl.run_with_stdin(&["apply", "-f", "-"], Some(&yaml))?;
    kubectl.run(&[
        "rollout",
        "status",
        "-n",
        DB_NS,
        &format!("deployment/{PG}"),
        "--timeout=180s",
    ])?;
    Ok(())
}

/// Two replicas on that PostgreSQL, aggregating Kyverno's ephemeral reports (mode B).
fn installation() -> String {
    format!(
        r#"apiVersion: v1
kind: Secret
metadata: {{name: reports-db, namespace: {NS}}}
stringData: {{host: {PG}.{DB_NS}.svc, port: "5432", database: reports, username: reports, password: {PG_PASSWORD}}}
---
apiVersion: reportsserver.io/v1alpha1
kind: ReportsServer
metadata: {{name: reports-server, namespace: {NS}}}
spec:
  replicas: 2
  database: {{postgres: {{external: {{secretName: reports-db, sslMode: disable}}}}}}
  aggregation: {{enabled: true, delay: 2s}}
"#
    )
}

/// The namespaces of the load and Kyverno's audit policy for their Pods.
fn workload_yaml() -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: {PODS_NS}}}
---
apiVersion: v1
kind: Namespace
metadata: {{name: {WRITES_NS}}}
---
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata: {{name: {POLICY}}}
spec:
  validationFailureAction: Audit
  background: true
  rules:
  - name: team-label
    match: {{any: [{{resources: {{kinds: [Pod], namespaces: [{PODS_NS}]}}}}]}}
    validate:
      message: "label 'team' is required"
      pattern: {{metadata: {{labels: {{team: "?*"}}}}}}
"#
    )
}

/// A namespace with a report in it, to be deleted during the outage.
fn doomed_yaml(ns: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: {ns}}}
---
apiVersion: wgpolicyk8s.io/v1alpha2
kind: PolicyReport
metadata: {{name: kept-until-deleted, namespace: {ns}}}
results: []
"#
    )
}

fn policy_report(name: &str) -> Value {
    json!({
        "apiVersion": "wgpolicyk8s.io/v1alpha2",
        "kind": "PolicyReport",
        "metadata": {"name": name, "namespace": WRITES_NS},
        "summary": {"pass": 1},
        "results": [{"policy": "outage", "rule": "write", "result": "pass", "source": "e2e"}],
    })
}

/// A Pod that needs no node (it stays Pending; Kyverno reports on it all the same).
fn pending_pod(name: &str, team: bool) -> Value {
    let labels = if team {
        json!({"team": "a"})
    } else {
        json!({})
    };
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": PODS_NS, "labels": labels},
        "spec": {
            "automountServiceAccountToken": false,
            "nodeSelector": {"e2e/never": "true"},
            "containers": [{"name": "c", "image": node::PAUSE_IMAGE}],
        },
    })
}

// ---- the load and what it saw -----------------------------------------------------------------

/// One write through kube-apiserver.
struct Write {
    name: String,
    started: Instant,
    took: Duration,
    /// `None`: no answer within 10 s.
    code: Option<u16>,
    body: String,
}

#[derive(Default)]
struct Seen {
    writes: Vec<Write>,
    discovery_ok: u64,
    discovery_failures: Vec<String>,
    api_resources_runs: u64,
    api_resources_failures: Vec<String>,
    /// Samples (one a second) where an APIService was not Available or a server pod not Ready
    /// or restarted.
    health_failures: Vec<String>,
    health_samples: u64,
    pods_created: u64,
}

struct Load {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    poller: ApiPoller,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(env: &Env<'_>, tag: &'static str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let poller = ApiPoller::start(env.client.clone(), "/apis", Duration::from_millis(100));
        let kubeconfig = env.node.cp().kubeconfig_path().to_owned();
        let tasks = vec![
            tokio::spawn(writer(env.client.clone(), tag, stop.clone(), seen.clone())),
            tokio::spawn(pod_maker(
                env.client.clone(),
                tag,
                stop.clone(),
                seen.clone(),
            )),
            tokio::task::spawn_blocking({
                let (stop, seen, kubeconfig) = (stop.clone(), seen.clone(), kubeconfig.clone());
                move || api_resources(&Kubectl::new(&kubeconfig), &stop, &seen)
            }),
            tokio::task::spawn_blocking({
                let (stop, seen) = (stop.clone(), seen.clone());
                move || health(&Kubectl::new(&kubeconfig), &stop, &seen)
            }),
        ];
        Load {
            stop,
            seen,
            poller,
            tasks,
        }
    }

    async fn finish(self) -> Result<Seen> {
        self.stop.store(true, Ordering::SeqCst);
        for task in self.tasks {
            task.await?;
        }
        let (ok, failures) = self.poller.finish().await?;
        let mut seen = std::mem::take(&mut *self.seen.lock().unwrap());
        seen.discovery_ok = ok;
        seen.discovery_failures = failures;
        Ok(seen)
    }
}

async fn writer(client: kube::Client, tag: &str, stop: Arc<AtomicBool>, seen: Arc<Mutex<Seen>>) {
    let path = format!("/apis/wgpolicyk8s.io/v1alpha2/namespaces/{WRITES_NS}/policyreports");
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    for n in 0.. {
        tick.tick().await;
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let name = format!("w-{tag}-{n}");
        let started = Instant::now();
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            raw_with(&client, "POST", &path, &[], Some(&policy_report(&name))),
        )
        .await;
        let (code, body) = match answer {
            Ok(Ok((code, body))) => (Some(code), body),
            Ok(Err(e)) => (None, format!("{e:#}")),
            Err(_) => (None, "no answer within 10s".into()),
        };
        seen.lock().unwrap().writes.push(Write {
            name,
            started,
            took: started.elapsed(),
            code,
            body,
        });
    }
}

async fn pod_maker(client: kube::Client, tag: &str, stop: Arc<AtomicBool>, seen: Arc<Mutex<Seen>>) {
    let path = format!("/api/v1/namespaces/{PODS_NS}/pods");
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    for n in 0.. {
        tick.tick().await;
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let pod = pending_pod(&format!("p-{tag}-{n}"), n % 2 == 0);
        if let Ok(Ok((201, _))) = tokio::time::timeout(
            Duration::from_secs(10),
            raw_with(&client, "POST", &path, &[], Some(&pod)),
        )
        .await
        {
            seen.lock().unwrap().pods_created += 1;
        }
    }
}

/// `kubectl api-resources` (full discovery, as namespace deletion and Helm do) every 100 ms.
fn api_resources(kubectl: &Kubectl, stop: &AtomicBool, seen: &Mutex<Seen>) {
    while !stop.load(Ordering::SeqCst) {
        let started = Instant::now();
        let failure = match kubectl.output(&["api-resources", "-o", "name"], None) {
            Ok(out) if out.status.success() => {
                let names = String::from_utf8_lossy(&out.stdout);
                let missing: Vec<&str> = [
                    "policyreports.wgpolicyk8s.io",
                    "ephemeralreports.reports.kyverno.io",
                ]
                .into_iter()
                .filter(|r| !names.lines().any(|l| l == *r))
                .collect();
                (!missing.is_empty()).then(|| format!("missing {missing:?}"))
            }
            Ok(out) => Some(
                String::from_utf8_lossy(&out.stderr)
                    .chars()
                    .take(300)
                    .collect(),
            ),
            Err(e) => Some(format!("{e:#}")),
        };
        let mut seen = seen.lock().unwrap();
        seen.api_resources_runs += 1;
        if let Some(failure) = failure {
            seen.api_resources_failures
                .push(format!("after {:.1?}: {failure}", started.elapsed()));
        }
        drop(seen);
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Once a second: every APIService Available, both server pods Ready, no restart.
fn health(kubectl: &Kubectl, stop: &AtomicBool, seen: &Mutex<Seen>) {
    let mut restarts: Option<BTreeMap<String, i64>> = None;
    while !stop.load(Ordering::SeqCst) {
        let mut problems = Vec::new();
        match available_apiservices(kubectl) {
            Ok(available) => problems.extend(
                API_SERVICES
                    .iter()
                    .filter(|name| !available.contains(**name))
                    .map(|name| format!("APIService {name} not Available")),
            ),
            Err(e) => problems.push(format!("get APIServices: {e:#}")),
        }
        match server_pods(kubectl) {
            Ok(pods) => {
                let ready = pods.values().filter(|(ready, _)| *ready).count();
                if pods.len() != 2 || ready != 2 {
                    problems.push(format!("{ready} of {} server pods Ready", pods.len()));
                }
                let now: BTreeMap<String, i64> =
                    pods.iter().map(|(k, (_, r))| (k.clone(), *r)).collect();
                match &restarts {
                    Some(before) if *before != now => {
                        problems.push(format!("server pods restarted: {before:?} -> {now:?}"))
                    }
                    _ => restarts = Some(now),
                }
            }
            Err(e) => problems.push(format!("get server pods: {e:#}")),
        }
        let mut seen = seen.lock().unwrap();
        seen.health_samples += 1;
        seen.health_failures.extend(problems);
        drop(seen);
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Names of the APIServices whose `Available` condition is True.
fn available_apiservices(kubectl: &Kubectl) -> Result<BTreeSet<String>> {
    let list: Value = serde_json::from_str(&kubectl.run(&["get", "apiservices", "-o", "json"])?)?;
    Ok(list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| {
            a["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Available" && c["status"] == "True")
        })
        .filter_map(|a| a["metadata"]["name"].as_str().map(str::to_owned))
        .collect())
}

/// Server pod name → (Ready, restarts).
fn server_pods(kubectl: &Kubectl) -> Result<BTreeMap<String, (bool, i64)>> {
    let list: Value = serde_json::from_str(&kubectl.run(&[
        "get",
        "pods",
        "-n",
        NS,
        "-l",
        SERVER_PODS,
        "-o",
        "json",
    ])?)?;
    let mut out = BTreeMap::new();
    for pod in list["items"].as_array().into_iter().flatten() {
        let ready = pod["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        let restarts = pod["status"]["containerStatuses"][0]["restartCount"]
            .as_i64()
            .unwrap_or(0);
        out.insert(
            pod["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            (ready, restarts),
        );
    }
    Ok(out)
}

impl Seen {
    /// The rules that need no database afterwards.
    fn judge(&self, began: Instant, ended: Instant) -> Vec<String> {
        let mut problems = Vec::new();
        let first = |v: &[String]| v.iter().take(3).cloned().collect::<Vec<_>>().join("; ");
        eprintln!(
            "[e2e_outage_node] discovery: GET /apis {} ok, {} failed; kubectl api-resources {} runs, {} failed; health samples {}, {} problems",
            self.discovery_ok,
            self.discovery_failures.len(),
            self.api_resources_runs,
            self.api_resources_failures.len(),
            self.health_samples,
            self.health_failures.len()
        );
        if !self.discovery_failures.is_empty() {
            problems.push(format!(
                "{} discovery failures, e.g. {}",
                self.discovery_failures.len(),
                first(&self.discovery_failures)
            ));
        }
        if !self.api_resources_failures.is_empty() {
            problems.push(format!(
                "{} kubectl api-resources failures, e.g. {}",
                self.api_resources_failures.len(),
                first(&self.api_resources_failures)
            ));
        }
        if !self.health_failures.is_empty() {
            problems.push(format!(
                "{} health problems, e.g. {}",
                self.health_failures.len(),
                first(&self.health_failures)
            ));
        }
        let during: Vec<&Write> = self
            .writes
            .iter()
            .filter(|w| w.started >= began + DETECTION && w.started + w.took <= ended)
            .collect();
        let slow_or_not_503: Vec<String> = during
            .iter()
            .filter(|w| w.code != Some(503) || w.took > FAST)
            .map(|w| {
                format!(
                    "{} {:?} after {:.0?}: {}",
                    w.name,
                    w.code,
                    w.took,
                    w.body.chars().take(200).collect::<String>()
                )
            })
            .collect();
        let mut took: Vec<Duration> = during.iter().map(|w| w.took).collect();
        took.sort();
        eprintln!(
            "[e2e_outage_node] writes during the outage (after detection): {}, median {:?}, max {:?}; {} Pods created in all",
            during.len(),
            took.get(took.len() / 2),
            took.last(),
            self.pods_created
        );
        if during.is_empty() {
            problems.push("no write was made during the outage".into());
        }
        if !slow_or_not_503.is_empty() {
            problems.push(format!(
                "{} data calls during the outage not 503 within {FAST:?}, e.g. {}",
                slow_or_not_503.len(),
                first(&slow_or_not_503)
            ));
        }
        problems
    }

    /// Acknowledged writes present, refused ones absent; ambiguous ones counted.
    fn check_writes(&self, stored: &BTreeSet<String>) -> Vec<String> {
        let (mut acked, mut refused, mut ambiguous) = (0, 0, 0);
        let mut problems = Vec::new();
        for w in &self.writes {
            match w.code {
                Some(201) => {
                    acked += 1;
                    if !stored.contains(&w.name) {
                        problems.push(format!("acknowledged write {} is missing", w.name));
                    }
                }
                Some(400..=499 | 503) => {
                    refused += 1;
                    if stored.contains(&w.name) {
                        problems.push(format!(
                            "refused write {} ({:?}: {}) was stored",
                            w.name,
                            w.code,
                            w.body.chars().take(200).collect::<String>()
                        ));
                    }
                }
                _ => ambiguous += 1,
            }
        }
        eprintln!(
            "[e2e_outage_node] writes: {acked} acknowledged, {refused} refused, {ambiguous} ambiguous (504 or no answer); {} stored",
            stored.len()
        );
        problems
    }
}

// ---- checks against the cluster ---------------------------------------------------------------

fn names(kubectl: &Kubectl, ns: &str, selector: &str) -> Result<Vec<String>> {
    Ok(kubectl
        .run(&[
            "get",
            "pods",
            "-n",
            ns,
            "-l",
            selector,
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ])?
        .split_whitespace()
        .map(str::to_owned)
        .collect())
}

fn stored_reports(kubectl: &Kubectl) -> Result<BTreeSet<String>> {
    let list: Value = serde_json::from_str(&kubectl.run(&[
        "get",
        "policyreports",
        "-n",
        WRITES_NS,
        "-o",
        "json",
    ])?)?;
    Ok(list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["metadata"]["name"].as_str().map(str::to_owned))
        .collect())
}

/// Waits until every Pod of the load has its PolicyReport (named by the Pod's uid) with the
/// policy's result: `pass` with the `team` label, `fail` without.
async fn pod_reports_right(kubectl: &Kubectl, deadline: Instant) -> Result<()> {
    loop {
        let wrong = wrong_pod_reports(kubectl)?;
        if wrong.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            // Whether Kyverno wrote its ephemeral reports (then the merge is behind) or not.
            let ephemeral = kubectl
                .run(&["get", "ephemeralreports", "-n", PODS_NS, "-o", "name"])
                .map(|out| out.lines().count().to_string())
                .unwrap_or_else(|e| format!("unknown ({e:#})"));
            bail!(
                "{} Pods without a right report ({ephemeral} ephemeral reports in {PODS_NS}), e.g. {}",
                wrong.len(),
                wrong.iter().take(5).cloned().collect::<Vec<_>>().join("; ")
            );
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

fn wrong_pod_reports(kubectl: &Kubectl) -> Result<Vec<String>> {
    let pods: Value =
        serde_json::from_str(&kubectl.run(&["get", "pods", "-n", PODS_NS, "-o", "json"])?)?;
    let reports: Value = serde_json::from_str(&kubectl.run(&[
        "get",
        "policyreports",
        "-n",
        PODS_NS,
        "-o",
        "json",
    ])?)?;
    let by_name: BTreeMap<&str, &Value> = reports["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| Some((r["metadata"]["name"].as_str()?, r)))
        .collect();
    let mut wrong = Vec::new();
    for pod in pods["items"].as_array().into_iter().flatten() {
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
        let want = if pod["metadata"]["labels"]["team"].is_string() {
            "pass"
        } else {
            "fail"
        };
        let got = by_name.get(uid).and_then(|r| {
            r["results"]
                .as_array()?
                .iter()
                .find(|x| x["policy"] == POLICY)?["result"]
                .as_str()
        });
        if got != Some(want) {
            wrong.push(format!("{name}: want {want}, report has {got:?}"));
        }
    }
    Ok(wrong)
}

async fn gone(kubectl: &Kubectl, ns: &str, deadline: Instant) -> Result<()> {
    loop {
        let out = kubectl.output(&["get", "namespace", ns, "-o", "name"], None)?;
        if !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("NotFound") {
            return Ok(());
        }
        if Instant::now() > deadline {
            let status = kubectl
                .run(&["get", "namespace", ns, "-o", "jsonpath={.status}"])
                .unwrap_or_default();
            bail!("namespace {ns} still exists: {status}");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Waits for the ReportsServer's `DatabaseAvailable` condition to have `status`.
async fn wait_database_condition(kubectl: &Kubectl, status: &str, timeout: Duration) -> Result<()> {
    let t = Instant::now();
    loop {
        let rs = rs_json(kubectl)?;
        let c = condition(&rs, "DatabaseAvailable")
            .cloned()
            .unwrap_or(Value::Null);
        if c["status"] == status {
            eprintln!(
                "[e2e_outage_node] DatabaseAvailable={status} ({}) after {:.1?}: {}",
                c["reason"],
                t.elapsed(),
                c["message"]
            );
            return Ok(());
        }
        ensure!(
            t.elapsed() < timeout,
            "DatabaseAvailable is not {status} after {timeout:?}: {c}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Runs nft commands in a network namespace of the node (`/run/netns/<netns>`).
fn nft(netns: &str, commands: &[&str]) -> Result<()> {
    let net = format!("--net=/run/netns/{netns}");
    for command in commands {
        let out = std::process::Command::new("nsenter")
            .args([net.as_str(), "nft", command])
            .output()
            .context("nsenter … nft (apt-get install -y nftables util-linux)")?;
        ensure!(
            out.status.success(),
            "nft {command} in {netns}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}
