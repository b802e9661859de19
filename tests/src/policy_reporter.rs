//! A real consumer of the report APIs: Policy Reporter v3.9.0 (kyverno/policy-reporter) as a
//! plain process against the Go-built control plane, reading the reports through kube-apiserver
//! and the APIServices exactly as it does in a cluster, and the comparison of what it shows with
//! `reports-server query compliance` on the server's own database.
//!
//! Why: Policy Reporter is the report consumer users run most. It lists and watches the report
//! kinds with a *metadata-only* informer (`as=PartialObjectMetadataList`), GETs each report it is
//! told about, keeps its own SQLite copy and derives its REST API and its Prometheus gauges from
//! that copy. If our list, watch, get or discovery were subtly wrong (a missed watch event, a
//! stale object, a group not discovered), its counts would drift from the database's; comparing
//! the two per namespace and per policy catches that from the consumer's side.
//!
//! The binary comes from `tests/policy-reporter/build.sh` (source tarball, dependencies from the
//! Go module proxy, cached by version; see docs/e2e.md "Policy Reporter"), or from a directory
//! named by `REPORTS_SERVER_POLICY_REPORTER_DIR` with the same layout (`bin/policy-reporter`).
//!
//! Policy Reporter runs as its own ServiceAccount with a least-privilege ClusterRole ([`RBAC`]):
//! get, list and watch on the four final report kinds, nothing else. The test checks that its log
//! holds no `forbidden` line, so a permission it really needs cannot hide.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    fs::{self, File},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;

use crate::{
    controlplane::{ControlPlane, KubeconfigAuth, run_cache_build_script, spawn_tied_to_test},
    kubectl::Kubectl,
    plain_http::get as http_get,
    server::free_port,
};

pub use crate::plain_http::parse_prometheus;

/// How long Policy Reporter may take to answer one request.
const HTTP_DEADLINE: Duration = Duration::from_secs(10);

/// The Policy Reporter release the suite runs (pinned in `tests/policy-reporter/build.sh`).
pub const POLICY_REPORTER_VERSION: &str = "v3.9.0";
/// A directory with `bin/policy-reporter`; the build script is not run when it is set.
pub const DIR_ENV: &str = "REPORTS_SERVER_POLICY_REPORTER_DIR";
/// Namespace of Policy Reporter's ServiceAccount.
pub const NAMESPACE: &str = "policy-reporter";
/// Policy Reporter's ServiceAccount (and the name of its ClusterRole and binding).
pub const SERVICE_ACCOUNT: &str = "policy-reporter";
/// How long Policy Reporter may take to start: its readiness waits for the informers of both
/// report groups to sync.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long its counts may lag behind the database: it GETs every changed report at its client's
/// default 20 requests per second, and a Kyverno background scan rewrites every report.
pub const CONVERGE_TIMEOUT: Duration = Duration::from_secs(180);

/// What Policy Reporter v3.9.0 needs with the configuration of [`config_yaml`], and nothing more.
/// From its source: `pkg/kubernetes/{wgpolicy,openreports}` list and watch the four kinds through
/// metadata informers and GET each report; discovery (which groups exist) is open to every
/// authenticated user. Features not configured here need more (docs/policy-reporter.md): the
/// namespace-selector endpoint lists `namespaces`, `sourceFilters.uncontrolledOnly` gets `pods`,
/// `replicasets` and `jobs`, targets with `secretRef` read `secrets`, leader election writes
/// `leases`, `crd.targetConfig` watches `targetconfigs.policyreporter.kyverno.io`.
pub const RBAC: &str = "\
apiVersion: v1
kind: Namespace
metadata:
  name: policy-reporter
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: policy-reporter
  namespace: policy-reporter
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: policy-reporter
rules:
- apiGroups: [wgpolicyk8s.io]
  resources: [policyreports, clusterpolicyreports]
  verbs: [get, list, watch]
- apiGroups: [openreports.io]
  resources: [reports, clusterreports]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: policy-reporter
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: policy-reporter
subjects:
- kind: ServiceAccount
  name: policy-reporter
  namespace: policy-reporter
";

/// The five outcomes of a result, in the order every table prints them.
pub const OUTCOMES: [&str; 5] = ["pass", "fail", "warn", "error", "skip"];

/// Policy Reporter's configuration file (`run --config`; keys of `pkg/config/config.go`): the
/// REST API and the metrics on `port`, its SQLite file in `dir`, the Kubernetes client of
/// `kubeconfig` with its default rate limits, no leader election, no targets. There is no switch
/// between wgpolicyk8s.io and openreports.io: v3.9.0 asks discovery for both group versions and
/// watches every one that is served (`pkg/config/resolver.go`), so the same file serves both.
/// `metrics.mode: detailed` (its default) exports one series per result.
pub fn config_yaml(port: u16, dir: &Path, kubeconfig: &Path) -> String {
    format!(
        "api:\n  port: {port}\n\
         rest:\n  enabled: true\n\
         metrics:\n  enabled: true\n  mode: detailed\n\
         dbfile: {db}\n\
         worker: 5\n\
         k8sClient:\n  kubeconfig: {kc}\n  qps: 20\n  burst: 50\n\
         leaderElection:\n  enabled: false\n\
         logging:\n  encoding: console\n  logLevel: 0\n\
         templates:\n  dir: {dir}\n",
        db = serde_json::to_string(&dir.join("policy-reporter.db").display().to_string())
            .expect("string serializes"),
        kc = serde_json::to_string(&kubeconfig.display().to_string()).expect("string serializes"),
        dir = serde_json::to_string(&dir.display().to_string()).expect("string serializes"),
    )
}

/// Policy Reporter running against a [`ControlPlane`] as its own ServiceAccount.
pub struct PolicyReporter {
    child: Option<Child>,
    /// Its REST API, metrics and health checks on `127.0.0.1:<port>` (plain HTTP).
    pub port: u16,
    dir: PathBuf,
    log: PathBuf,
}

impl PolicyReporter {
    /// Creates the ServiceAccount and its ClusterRole ([`RBAC`]), writes a kubeconfig with a
    /// token of that account (TokenRequest, through `kubectl create token`) and the config file,
    /// starts Policy Reporter and waits until `/ready` answers 200 (both informers synced).
    /// Its files and log are in `<control plane dir>/policy-reporter/`.
    pub async fn start(cp: &ControlPlane) -> Result<PolicyReporter> {
        let t0 = Instant::now();
        let bin = policy_reporter_dir()
            .await?
            .join("bin")
            .join("policy-reporter");
        let admin = Kubectl::new(cp.kubeconfig_path());
        admin
            .run_with_stdin(&["apply", "-f", "-"], Some(RBAC))
            .context("creating Policy Reporter's ServiceAccount and ClusterRole")?;
        let token = admin
            .run(&[
                "create",
                "token",
                SERVICE_ACCOUNT,
                "-n",
                NAMESPACE,
                "--duration=24h",
            ])
            .context("a token for Policy Reporter's ServiceAccount")?;
        let kubeconfig = cp.kubeconfig_for_server(
            "policy-reporter",
            cp.server_url(),
            KubeconfigAuth::Token(token.trim()),
        )?;
        let dir = cp.dir().join("policy-reporter");
        fs::create_dir_all(&dir)?;
        let port = free_port();
        let config = dir.join("config.yaml");
        fs::write(&config, config_yaml(port, &dir, &kubeconfig))?;
        let log = dir.join("policy-reporter.log");
        let out = File::create(&log)?;
        let mut cmd = Command::new(&bin);
        // Without --config it would look for ./config.yaml: run it in its own directory.
        cmd.arg("run")
            .arg("--config")
            .arg(&config)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        let child = spawn_tied_to_test(cmd)
            .with_context(|| format!("starting Policy Reporter ({})", bin.display()))?;
        let mut pr = PolicyReporter {
            child: Some(child),
            port,
            dir,
            log,
        };
        pr.wait_ready().await?;
        eprintln!(
            "[policy-reporter] {POLICY_REPORTER_VERSION} ready in {:.1?} on 127.0.0.1:{port} \
             (ServiceAccount {NAMESPACE}/{SERVICE_ACCOUNT})",
            t0.elapsed()
        );
        Ok(pr)
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            self.check_running()?;
            let last = match http_get(self.port, "/ready", HTTP_DEADLINE).await {
                Ok((200, _)) => return Ok(()),
                Ok((code, body)) => format!("GET /ready: {code} {}", body.trim()),
                Err(e) => format!("{e:#}"),
            };
            ensure!(
                Instant::now() < deadline,
                "Policy Reporter not ready after {STARTUP_TIMEOUT:?}; last: {last}\n{}",
                self.diagnostics(40)
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Fails (with the log tail) if the process has exited.
    pub fn check_running(&mut self) -> Result<()> {
        let child = self
            .child
            .as_mut()
            .ok_or_else(|| anyhow!("Policy Reporter is not running"))?;
        if let Some(status) = child.try_wait()? {
            self.child = None;
            bail!(
                "Policy Reporter exited with {status}\n{}",
                self.diagnostics(40)
            );
        }
        Ok(())
    }

    /// Its working directory (config, SQLite file, log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The log tail with its path, for failure messages.
    pub fn diagnostics(&self, lines: usize) -> String {
        format!(
            "--- Policy Reporter ({}) ---\n{}",
            self.log.display(),
            self.log_tail(lines)
        )
    }

    /// Log lines that mean a request was refused for lack of permission.
    pub fn forbidden_lines(&self) -> Vec<String> {
        fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("forbidden") || l.contains("Forbidden"))
            .map(str::to_owned)
            .collect()
    }

    /// GETs a path of its HTTP server and parses the JSON answer.
    async fn get_json(&self, path: &str) -> Result<Value> {
        let (code, body) = http_get(self.port, path, HTTP_DEADLINE).await?;
        ensure!(
            code == 200,
            "Policy Reporter GET {path}: {code} {}",
            body.trim()
        );
        serde_json::from_str(&body)
            .with_context(|| format!("Policy Reporter GET {path}: not JSON: {body}"))
    }

    /// Its REST API's counts: per namespace (the v2 `namespace-scoped/{source}/status-counts`
    /// and, as namespace `""`, `cluster-scoped/{source}/status-counts`, summed over the sources
    /// of `/v2/sources`) and per source and policy (`/v2/policies`).
    pub async fn rest_counts(&self) -> Result<Counts> {
        let mut counts = Counts::default();
        let sources = self.get_json("/v2/sources").await?;
        for source in sources.as_array().into_iter().flatten() {
            let source = source
                .as_str()
                .ok_or_else(|| anyhow!("/v2/sources: {sources}"))?;
            let path = format!("/v2/namespace-scoped/{source}/status-counts");
            let per_ns = self.get_json(&path).await?;
            for (ns, statuses) in per_ns.as_object().into_iter().flatten() {
                counts
                    .by_namespace
                    .entry(ns.clone())
                    .or_default()
                    .add_json(statuses)?;
            }
            let path = format!("/v2/cluster-scoped/{source}/status-counts");
            let cluster = self.get_json(&path).await?;
            counts
                .by_namespace
                .entry(String::new())
                .or_default()
                .add_json(&cluster)?;
        }
        let policies = self.get_json("/v2/policies").await?;
        for p in policies.as_array().into_iter().flatten() {
            let key = (str_field(p, "source"), str_field(p, "policy"));
            counts
                .by_policy
                .entry(key)
                .or_default()
                .add_json(&p["results"])?;
        }
        counts.drop_empty();
        Ok(counts)
    }

    /// `/metrics`: `policy_report_result` (namespaced reports) and `cluster_policy_report_result`
    /// (cluster-scoped, namespace `""`) summed per namespace, source, policy and status. In
    /// detailed mode every series is one result (value 1), labelled with its report, rule,
    /// subject, status, severity, category and source.
    pub async fn metric_counts(&self) -> Result<Counts> {
        let (code, body) = http_get(self.port, "/metrics", HTTP_DEADLINE).await?;
        ensure!(code == 200, "Policy Reporter GET /metrics: {code}");
        let mut counts = Counts::default();
        for sample in parse_prometheus(&body)? {
            let namespace = match sample.name.as_str() {
                "policy_report_result" => sample.label("namespace"),
                "cluster_policy_report_result" => String::new(),
                _ => continue,
            };
            let n = sample.value.round();
            ensure!(
                n >= 0.0 && (sample.value - n).abs() < 1e-9,
                "{} has a value that is no count: {}",
                sample.name,
                sample.value
            );
            counts.add_cell(
                (namespace, sample.label("source"), sample.label("policy")),
                &sample.label("status"),
                n as u64,
            )?;
        }
        counts.drop_empty();
        Ok(counts)
    }

    /// Stops the process (SIGKILL; only this child).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for PolicyReporter {
    fn drop(&mut self) {
        self.stop();
    }
}

fn str_field(v: &Value, key: &str) -> String {
    v[key].as_str().unwrap_or_default().to_owned()
}

/// The cache directory of `tests/policy-reporter/build.sh` (or `$REPORTS_SERVER_POLICY_REPORTER_DIR`),
/// checked for the binary. The script runs at most once per test process and returns at once
/// when the cache is complete.
pub async fn policy_reporter_dir() -> Result<PathBuf> {
    static BUILT: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    let from_env = std::env::var_os(DIR_ENV).filter(|d| !d.is_empty());
    let dir = match &from_env {
        Some(dir) => PathBuf::from(dir),
        None => BUILT.get_or_try_init(run_build_script).await?.clone(),
    };
    if !dir.join("bin").join("policy-reporter").is_file() {
        bail!(
            "{} lacks bin/policy-reporter (run `bash tests/policy-reporter/build.sh`, which needs \
             Go >= 1.26.4, gcc, the Go module proxy and the source tarball{})",
            dir.display(),
            if from_env.is_some() {
                format!(", or fix {DIR_ENV}")
            } else {
                String::new()
            }
        );
    }
    Ok(dir)
}

async fn run_build_script() -> Result<PathBuf> {
    let t0 = Instant::now();
    let dir = run_cache_build_script(
        "tests/policy-reporter/build.sh",
        &format!(
            "Policy Reporter {POLICY_REPORTER_VERSION} (needs Go >= 1.26.4, gcc for cgo, the Go \
             module proxy and its source tarball, REPORTS_SERVER_POLICY_REPORTER_SRC; or set \
             {DIR_ENV} to a directory with bin/policy-reporter)"
        ),
    )
    .await?;
    if t0.elapsed() > Duration::from_secs(5) {
        eprintln!("[policy-reporter] build script took {:.1?}", t0.elapsed());
    }
    Ok(dir)
}

// ---- counts ------------------------------------------------------------------------------------

/// pass, fail, warn, error, skip of one row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally(pub [u64; 5]);

impl Tally {
    fn add(&mut self, outcome: &str, n: u64) -> Result<()> {
        let i = OUTCOMES
            .iter()
            .position(|o| *o == outcome)
            .ok_or_else(|| anyhow!("unknown result {outcome:?}"))?;
        self.0[i] += n;
        Ok(())
    }

    /// Adds an object `{"pass": n, "fail": n, ...}` (missing outcomes count 0).
    fn add_json(&mut self, v: &Value) -> Result<()> {
        for (outcome, n) in v.as_object().into_iter().flatten() {
            let n = n
                .as_u64()
                .ok_or_else(|| anyhow!("count of {outcome} is no number: {v}"))?;
            self.add(outcome, n)?;
        }
        Ok(())
    }

    fn plus(&mut self, other: &Tally) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [p, fl, w, e, s] = self.0;
        write!(f, "{p:>5} {fl:>5} {w:>5} {e:>5} {s:>5}")
    }
}

/// (namespace, source, policy); namespace `""` for cluster-scoped reports.
pub type Cell = (String, String, String);

/// Result counts of one side of the comparison.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Per report namespace (`""` = cluster-scoped reports).
    pub by_namespace: BTreeMap<String, Tally>,
    /// Per (source, policy).
    pub by_policy: BTreeMap<(String, String), Tally>,
    /// Per (namespace, source, policy), where the side has that detail (metrics, SQL).
    pub cells: BTreeMap<Cell, Tally>,
}

impl Counts {
    /// Adds `n` results of `outcome` in a cell, and to its namespace and policy rows.
    fn add_cell(&mut self, cell: Cell, outcome: &str, n: u64) -> Result<()> {
        let (ns, source, policy) = &cell;
        self.by_namespace
            .entry(ns.clone())
            .or_default()
            .add(outcome, n)?;
        self.by_policy
            .entry((source.clone(), policy.clone()))
            .or_default()
            .add(outcome, n)?;
        self.cells.entry(cell).or_default().add(outcome, n)
    }

    /// Rows without any result say nothing (our views have no row then; Policy Reporter's
    /// status-count maps list every outcome with 0).
    fn drop_empty(&mut self) {
        self.by_namespace.retain(|_, t| t.total() > 0);
        self.by_policy.retain(|_, t| t.total() > 0);
        self.cells.retain(|_, t| t.total() > 0);
    }

    /// All results.
    pub fn total(&self) -> u64 {
        let mut t = Tally::default();
        self.by_namespace.values().for_each(|v| t.plus(v));
        t.total()
    }
}

/// Rows where two maps differ, as lines `key: ours | theirs`.
fn diff_rows<K: Ord + std::fmt::Debug>(
    ours: &BTreeMap<K, Tally>,
    theirs: &BTreeMap<K, Tally>,
) -> Vec<String> {
    let keys: BTreeSet<&K> = ours.keys().chain(theirs.keys()).collect();
    let zero = Tally::default();
    keys.into_iter()
        .filter_map(|k| {
            let (a, b) = (ours.get(k).unwrap_or(&zero), theirs.get(k).unwrap_or(&zero));
            (a != b).then(|| format!("  {k:?}: query {a} | Policy Reporter {b}"))
        })
        .collect()
}

/// A table of `rows` under a header, for failure messages.
pub fn render<K: std::fmt::Debug>(title: &str, rows: &BTreeMap<K, Tally>) -> String {
    let mut s = format!("{title}\n  {:<60}  pass  fail  warn error  skip\n", "");
    for (k, t) in rows {
        let _ = writeln!(s, "  {:<60} {t}", format!("{k:?}"));
    }
    s
}

/// Differences between the database's counts (`ours`, from `reports-server query`) and Policy
/// Reporter's: REST per namespace and per policy, metrics per namespace, per policy and per
/// (namespace, source, policy). Empty when they agree.
pub fn differences(ours: &Counts, rest: &Counts, metrics: &Counts) -> Vec<String> {
    let mut out = Vec::new();
    let mut section = |name: &str, rows: Vec<String>| {
        if !rows.is_empty() {
            out.push(format!("{name}:\n{}", rows.join("\n")));
        }
    };
    section(
        "REST per namespace (`query compliance --by namespace`)",
        diff_rows(&ours.by_namespace, &rest.by_namespace),
    );
    section(
        "REST per source and policy (`query compliance --by policy`)",
        diff_rows(&ours.by_policy, &rest.by_policy),
    );
    section(
        "metrics per namespace",
        diff_rows(&ours.by_namespace, &metrics.by_namespace),
    );
    section(
        "metrics per source and policy",
        diff_rows(&ours.by_policy, &metrics.by_policy),
    );
    section(
        "metrics per namespace, source and policy (`report_results`)",
        diff_rows(&ours.cells, &metrics.cells),
    );
    out
}

// ---- our side: reports-server query ------------------------------------------------------------

/// `--database-url` of a `serve` argument list.
pub fn database_url_of(serve_args: &[String]) -> Option<&str> {
    serve_args
        .windows(2)
        .find(|w| w[0] == "--database-url")
        .map(|w| w[1].as_str())
}

/// Runs `reports-server query --database-url <url> -o json <args>` and parses the answer.
fn query_json(bin: &Path, database_url: &str, args: &[&str]) -> Result<Value> {
    let out = Command::new(bin)
        .args(["query", "--database-url", database_url, "-o", "json"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} query", bin.display()))?;
    ensure!(
        out.status.success(),
        "reports-server query {} failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "reports-server query {}: not JSON: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The per-cell counts of `report_results` (the view the compliance views group), read with
/// `query --sql`: what the metrics are compared with cell by cell.
const CELLS_SQL: &str = "SELECT namespace, source, policy, result, COUNT(*) AS n \
     FROM report_results WHERE cluster_id = 'default' \
     GROUP BY namespace, source, policy, result";

/// The database's counts through the CLI users have: `query compliance --by namespace`,
/// `query compliance --by policy` and, per cell, `query --sql` on `report_results`.
pub fn query_counts(bin: &Path, database_url: &str) -> Result<Counts> {
    let mut counts = Counts::default();
    let tally = |row: &Value| -> Result<Tally> {
        let mut t = Tally::default();
        for o in OUTCOMES {
            let n = row[o]
                .as_u64()
                .ok_or_else(|| anyhow!("no count {o} in {row}"))?;
            t.add(o, n)?;
        }
        Ok(t)
    };
    let rows = query_json(bin, database_url, &["compliance", "--by", "namespace"])?;
    for row in rows.as_array().into_iter().flatten() {
        counts
            .by_namespace
            .insert(str_field(row, "namespace"), tally(row)?);
    }
    let rows = query_json(bin, database_url, &["compliance", "--by", "policy"])?;
    for row in rows.as_array().into_iter().flatten() {
        let key = (str_field(row, "source"), str_field(row, "policy"));
        counts.by_policy.insert(key, tally(row)?);
    }
    let rows = query_json(bin, database_url, &["--sql", CELLS_SQL])?;
    for row in rows.as_array().into_iter().flatten() {
        let cell = (
            str_field(row, "namespace"),
            str_field(row, "source"),
            str_field(row, "policy"),
        );
        let n = row["n"]
            .as_u64()
            .ok_or_else(|| anyhow!("no count in {row}"))?;
        counts
            .cells
            .entry(cell)
            .or_default()
            .add(row["result"].as_str().unwrap_or_default(), n)?;
    }
    counts.drop_empty();
    Ok(counts)
}

/// What a successful comparison saw, for the suite's summary.
#[derive(Clone, Debug)]
pub struct Agreement {
    pub namespaces: usize,
    pub policies: usize,
    pub results: u64,
    pub converged_in: Duration,
}

impl std::fmt::Display for Agreement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} results in {} namespaces (\"\" = cluster-scoped) and {} policies agree (REST and \
             metrics), converged after {:.1?}",
            self.results, self.namespaces, self.policies, self.converged_in
        )
    }
}

/// Polls until Policy Reporter's REST counts and metrics equal `reports-server query`'s on the
/// server's database (it learns of changes through its watches, so it may lag), at most
/// [`CONVERGE_TIMEOUT`]. The database must hold results: an empty comparison proves nothing.
/// On timeout the error holds the differences, both sides' tables and Policy Reporter's log tail.
pub async fn expect_agreement(
    pr: &mut PolicyReporter,
    reports_server: &Path,
    database_url: &str,
) -> Result<Agreement> {
    let t0 = Instant::now();
    loop {
        pr.check_running()?;
        let ours = query_counts(reports_server, database_url)?;
        let rest = pr.rest_counts().await?;
        let metrics = pr.metric_counts().await?;
        let diffs = differences(&ours, &rest, &metrics);
        if diffs.is_empty() {
            ensure!(
                ours.total() > 0,
                "the database holds no result: nothing to compare Policy Reporter with"
            );
            return Ok(Agreement {
                namespaces: ours.by_namespace.len(),
                policies: ours.by_policy.len(),
                results: ours.total(),
                converged_in: t0.elapsed(),
            });
        }
        if t0.elapsed() > CONVERGE_TIMEOUT {
            bail!(
                "Policy Reporter's counts still differ from `reports-server query` after \
                 {CONVERGE_TIMEOUT:?}:\n{}\n\n{}\n{}\n{}\n{}\n{}\n{}",
                diffs.join("\n"),
                render("query compliance --by namespace:", &ours.by_namespace),
                render("Policy Reporter REST per namespace:", &rest.by_namespace),
                render("query compliance --by policy:", &ours.by_policy),
                render("Policy Reporter REST per policy:", &rest.by_policy),
                render("Policy Reporter metrics per policy:", &metrics.by_policy),
                pr.diagnostics(40)
            );
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_samples_with_escaped_labels_are_parsed() {
        let text = "# HELP policy_report_result List\n# TYPE policy_report_result gauge\n\
            policy_report_result{category=\"Pod \\\"Security\\\"\",namespace=\"a\",policy=\"p,q\",status=\"fail\"} 1\n\
            cluster_policy_report_result{policy=\"c\",status=\"pass\"} 2\n\
            go_goroutines 12\n";
        let samples = parse_prometheus(text).unwrap();
        assert_eq!(samples.len(), 3);
        assert_eq!(samples[0].name, "policy_report_result");
        assert_eq!(samples[0].label("category"), "Pod \"Security\"");
        assert_eq!(samples[0].label("policy"), "p,q");
        assert_eq!(samples[0].label("status"), "fail");
        assert_eq!(samples[0].value, 1.0);
        assert_eq!(samples[1].label("policy"), "c");
        assert_eq!(samples[1].value, 2.0);
        assert!(samples[2].labels.is_empty());
        assert_eq!(samples[2].value, 12.0);
    }

    #[test]
    fn differences_name_the_rows_that_differ_and_ignore_empty_ones() {
        let mut ours = Counts::default();
        ours.add_cell(("a".into(), "kyverno".into(), "p".into()), "fail", 2)
            .unwrap();
        let mut theirs = ours.clone();
        theirs.by_namespace.insert("empty".into(), Tally::default());
        theirs.drop_empty();
        assert!(differences(&ours, &theirs, &theirs).is_empty());
        theirs
            .add_cell(("a".into(), "kyverno".into(), "p".into()), "pass", 1)
            .unwrap();
        let diffs = differences(&ours, &theirs, &ours);
        assert_eq!(diffs.len(), 2, "{diffs:?}");
        assert!(diffs[0].contains("\"a\""), "{diffs:?}");
        assert!(diffs[1].contains("\"kyverno\", \"p\""), "{diffs:?}");
    }

    #[test]
    fn the_database_url_is_read_from_the_serve_arguments() {
        let args: Vec<String> = ["serve", "--database-url", "sqlite:///x?mode=rwc", "--x"]
            .map(String::from)
            .to_vec();
        assert_eq!(database_url_of(&args), Some("sqlite:///x?mode=rwc"));
        assert_eq!(database_url_of(&args[..2]), None);
    }
}
