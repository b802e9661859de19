//! A real Kyverno (admission controller, reports controller, background controller) as plain
//! processes next to the Go-built control plane, the way `docs/kyverno.md` describes running it
//! out of cluster.
//!
//! The binaries and Kyverno's own CRDs come from `tests/kyverno/build.sh` (Go module proxy,
//! cached by version; see docs/e2e.md), or from a directory named by
//! `REPORTS_SERVER_KYVERNO_DIR` with the same layout (`bin/`, `crds/`).
//!
//! [`Kyverno::install`] needs a running [`ControlPlane`] (with kube-controller-manager) and
//! reports-server already behind the APIServices: it installs Kyverno's CRDs (only `kyverno.io`
//! and `policies.kyverno.io`; the report groups are served by reports-server), the `kyverno`
//! namespace, the `kyverno` ConfigMap with the Helm chart's default resource filters, the
//! service accounts with a cluster-admin binding, starts the three controllers and returns once
//! the admission webhook is registered and answers.

use std::{
    fs::{self, OpenOptions},
    io::Write as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};

use crate::{
    controlplane::{ControlPlane, run_cache_build_script, spawn_tied_to_test},
    kubectl::Kubectl,
    plain_http,
    server::free_port,
};

/// The Kyverno release the suite runs (pinned in `tests/kyverno/build.sh`).
pub const KYVERNO_VERSION: &str = "v1.19.1";
/// A directory with `bin/{kyverno,reports-controller,background-controller}` and
/// `crds/{kyverno,policies.kyverno.io}/*.yaml`; the build script is not run when it is set.
pub const DIR_ENV: &str = "REPORTS_SERVER_KYVERNO_DIR";
/// Kyverno's namespace.
pub const NAMESPACE: &str = "kyverno";
/// Kyverno's CRD directories the harness installs (the report groups are served by us).
pub const CRD_DIRS: [&str; 2] = ["kyverno", "policies.kyverno.io"];

/// The Helm chart's default `config.resourceFilters` (charts/kyverno/values.yaml), rendered as
/// Kyverno reads them: one string of `[kind,namespace,name]` triples. They keep kube-system,
/// Events, Nodes, ReplicaSets and the ephemeral reports out of admission.
pub const RESOURCE_FILTERS: &str = "[Event,*,*][*/*,kube-system,*][*/*,kube-public,*]\
[*/*,kube-node-lease,*][Node,*,*][Node/?*,*,*][APIService,*,*][APIService/?*,*,*]\
[TokenReview,*,*][SubjectAccessReview,*,*][SelfSubjectAccessReview,*,*][Binding,*,*]\
[Pod/binding,*,*][ReplicaSet,*,*][ReplicaSet/?*,*,*][EphemeralReport,*,*]\
[ClusterEphemeralReport,*,*]";

/// Log lines that mean a client-go watch could not be (re)started on our server: the
/// RetryWatcher refusing `resourceVersion: "0"` (the list of an empty database answered "0"),
/// or a reflector failing to list or watch.
pub const WATCH_ERROR_PATTERNS: [&str; 5] = [
    "initial RV",
    "RetryWatcher",
    "Failed to watch",
    "failed to list",
    "Failed to list",
];

/// Kyverno's error lines about reports that every reports server causes, not a failure of
/// ours. The reports controller checks at start that the report groups are CRDs and logs
/// `sanity checks failed` when they are not, even with `--reportsCRDsSanityChecks=false`
/// (which only stops it from exiting; `cmd/reports-controller/main.go` of v1.19.1): groups
/// served through APIServices are never CRDs. docs/kyverno.md tells users to expect it.
///
/// And a controller that is being stopped (the restart scenario) may log that its watches of
/// the resources it scans (Namespaces, Deployments, … from kube-apiserver, never reports)
/// ended with `context canceled`: its own context ending, under `pkg/controllers/report/`.
pub const EXPECTED_REPORT_ERRORS: [&str; 2] = [
    "> sanity checks failed error=",
    "> failed to watch error=\"context canceled\"",
];

/// One of the three Kyverno processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Controller {
    /// `cmd/kyverno`: the admission webhooks (validate, mutate, policy validation).
    Admission,
    /// `cmd/reports-controller`: background scans and (unless `--aggregateReports=false`) the
    /// aggregation of ephemeral reports into policy reports.
    Reports,
    /// `cmd/background-controller`: generate and mutate-existing policies.
    Background,
}

impl Controller {
    pub const ALL: [Controller; 3] = [
        Controller::Admission,
        Controller::Reports,
        Controller::Background,
    ];

    /// The binary (and log file stem).
    pub fn binary(self) -> &'static str {
        match self {
            Controller::Admission => "kyverno",
            Controller::Reports => "reports-controller",
            Controller::Background => "background-controller",
        }
    }

    /// The service account name the chart gives the controller.
    pub fn service_account(self) -> &'static str {
        match self {
            Controller::Admission => "kyverno-admission-controller",
            Controller::Reports => "kyverno-reports-controller",
            Controller::Background => "kyverno-background-controller",
        }
    }
}

impl std::fmt::Display for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.binary())
    }
}

/// How Kyverno is run.
#[derive(Clone, Debug)]
pub struct KyvernoOptions {
    /// `--aggregateReports` of the reports controller: `true` = Kyverno merges ephemeral reports
    /// into policy reports (reports-server then runs with `--aggregation=false`); `false` =
    /// reports-server aggregates in-process.
    pub aggregate_reports: bool,
    /// `--backgroundScanInterval` of the reports controller (Kyverno's default is 1h).
    pub background_scan_interval: Duration,
    /// More arguments for the reports controller.
    pub extra_reports_args: Vec<String>,
    /// How long start-up may take (webhook registered and answering).
    pub startup_timeout: Duration,
}

impl Default for KyvernoOptions {
    fn default() -> Self {
        KyvernoOptions {
            aggregate_reports: true,
            background_scan_interval: Duration::from_secs(60),
            extra_reports_args: Vec::new(),
            startup_timeout: Duration::from_secs(240),
        }
    }
}

struct Proc {
    controller: Controller,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
    starts: u32,
}

impl Proc {
    fn spawn(&mut self, bin: &Path) -> Result<()> {
        self.starts += 1;
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        writeln!(log, "===== e2e: start #{} =====", self.starts)?;
        let mut cmd = Command::new(bin);
        cmd.args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = spawn_tied_to_test(cmd)
            .with_context(|| format!("starting {} ({})", self.controller, bin.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// Fails if the process has exited.
    fn check_running(&mut self) -> Result<()> {
        if let Some(status) = self
            .child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
        {
            self.child = None;
            bail!(
                "Kyverno's {} exited with {status}; args: {:?}\n--- last lines of {} ---\n{}",
                self.controller,
                self.args,
                self.log.display(),
                tail_file(&self.log, 40)
            );
        }
        ensure!(
            self.child.is_some(),
            "Kyverno's {} is not running",
            self.controller
        );
        Ok(())
    }

    fn signal(&self, signal: libc::c_int) {
        if let Some(pid) = self
            .child
            .as_ref()
            .and_then(|c| libc::pid_t::try_from(c.id()).ok())
        {
            // SAFETY: plain syscall on our own, not yet reaped child.
            unsafe {
                libc::kill(pid, signal);
            }
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The three Kyverno controllers, running against a [`ControlPlane`].
pub struct Kyverno {
    dir: PathBuf,
    kubectl: Kubectl,
    procs: Vec<Proc>,
    webhook_port: u16,
}

impl Kyverno {
    /// Installs Kyverno's CRDs, namespace, ConfigMap and service accounts, starts the three
    /// controllers and waits until the admission webhook is registered and answers.
    /// Logs go to `<control plane dir>/logs/kyverno-<binary>.log`.
    pub async fn install(cp: &ControlPlane, opts: KyvernoOptions) -> Result<Kyverno> {
        let t0 = Instant::now();
        let dir = kyverno_dir().await?;
        let kubectl = Kubectl::new(cp.kubeconfig_path());

        // CRDs of Kyverno's own groups. Server-side apply: the CRDs are larger than the
        // last-applied annotation allows.
        let mut args = vec!["apply", "--server-side", "--force-conflicts"];
        let crd_dirs: Vec<String> = CRD_DIRS
            .iter()
            .map(|d| dir.join("crds").join(d).display().to_string())
            .collect();
        for d in &crd_dirs {
            args.extend(["-f", d.as_str()]);
        }
        kubectl.run(&args).context("installing Kyverno's CRDs")?;
        kubectl
            .run(&[
                "wait",
                "--for=condition=Established",
                "crd",
                "--all",
                "--timeout=120s",
            ])
            .context("waiting for Kyverno's CRDs")?;

        let mut objects = format!(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NAMESPACE}\n---\n\
             apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: kyverno\n  namespace: {NAMESPACE}\n\
             data:\n  resourceFilters: '{RESOURCE_FILTERS}'\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  \
             name: kyverno-e2e-admin\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  \
             kind: ClusterRole\n  name: cluster-admin\nsubjects:\n"
        );
        for c in Controller::ALL {
            objects.push_str(&format!(
                "- kind: ServiceAccount\n  name: {}\n  namespace: {NAMESPACE}\n",
                c.service_account()
            ));
        }
        for c in Controller::ALL {
            objects.push_str(&format!(
                "---\napiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: {}\n  namespace: {NAMESPACE}\n",
                c.service_account()
            ));
        }
        kubectl
            .run_with_stdin(&["apply", "-f", "-"], Some(&objects))
            .context("creating Kyverno's namespace, ConfigMap and service accounts")?;

        let log_dir = cp.dir().join("logs");
        fs::create_dir_all(&log_dir)?;
        let webhook_port = free_port();
        let kubeconfig = cp.kubeconfig_path().display().to_string();
        let sa =
            |c: Controller| format!("system:serviceaccount:{NAMESPACE}:{}", c.service_account());
        let common = |c: Controller| -> Vec<String> {
            vec![
                format!("--kubeconfig={kubeconfig}"),
                // Every binary listens for metrics on :8000 by default and exits if it cannot
                // (`--disableMetrics` only stops the export): one free loopback port each.
                "--metricsHost=127.0.0.1".into(),
                format!("--metricsPort={}", free_port()),
                "--enablePolicyException=true".into(),
                "--exceptionNamespace=*".into(),
                "--loggingFormat=text".into(),
                "--disableLogColor=true".into(),
                "-v=2".into(),
                format!(
                    "--clientRateLimitQPS={}",
                    if c == Controller::Reports { 300 } else { 100 }
                ),
                format!(
                    "--clientRateLimitBurst={}",
                    if c == Controller::Reports { 300 } else { 200 }
                ),
            ]
        };
        let mut procs = Vec::new();
        for c in Controller::ALL {
            let mut args = common(c);
            match c {
                Controller::Admission => args.extend([
                    format!("--serverIP=127.0.0.1:{webhook_port}"),
                    "--webhookServerHost=127.0.0.1".into(),
                    format!("--webhookServerPort={webhook_port}"),
                    "--caSecretName=kyverno-svc.kyverno.svc.kyverno-tls-ca".into(),
                    "--tlsSecretName=kyverno-svc.kyverno.svc.kyverno-tls-pair".into(),
                    format!(
                        "--backgroundServiceAccountName={}",
                        sa(Controller::Background)
                    ),
                    format!("--reportsServiceAccountName={}", sa(Controller::Reports)),
                    "--controllerRuntimeMetricsAddress=0".into(),
                    "--admissionReports=true".into(),
                ]),
                Controller::Reports => {
                    args.extend([
                        format!("--aggregateReports={}", opts.aggregate_reports),
                        "--admissionReports=true".into(),
                        "--backgroundScan=true".into(),
                        // wgpolicyk8s.io and reports.kyverno.io are APIServices, not CRDs.
                        "--reportsCRDsSanityChecks=false".into(),
                        format!(
                            "--backgroundScanInterval={}s",
                            opts.background_scan_interval.as_secs().max(1)
                        ),
                    ]);
                    args.extend(opts.extra_reports_args.iter().cloned());
                }
                Controller::Background => {
                    args.push("--controllerRuntimeMetricsAddress=0".into());
                }
            }
            let env = vec![
                ("KYVERNO_NAMESPACE".to_string(), NAMESPACE.to_string()),
                ("INIT_CONFIG".into(), "kyverno".into()),
                ("METRICS_CONFIG".into(), "kyverno-metrics".into()),
                (
                    "KYVERNO_SERVICEACCOUNT_NAME".into(),
                    c.service_account().into(),
                ),
                ("KYVERNO_DEPLOYMENT".into(), c.service_account().into()),
                (
                    "KYVERNO_POD_NAME".into(),
                    format!("{}-e2e", c.service_account()),
                ),
            ];
            procs.push(Proc {
                controller: c,
                args,
                env,
                log: log_dir.join(format!("kyverno-{}.log", c.binary())),
                child: None,
                starts: 0,
            });
        }
        let mut kyverno = Kyverno {
            dir,
            kubectl,
            procs,
            webhook_port,
        };
        for c in Controller::ALL {
            let bin = kyverno.bin(c);
            kyverno.proc_mut(c).spawn(&bin)?;
        }
        kyverno.wait_webhook(opts.startup_timeout).await?;
        eprintln!(
            "[kyverno] {KYVERNO_VERSION} installed and admission webhook answering in {:.1?} \
             (aggregateReports={}, webhook on 127.0.0.1:{webhook_port})",
            t0.elapsed(),
            opts.aggregate_reports
        );
        Ok(kyverno)
    }

    fn bin(&self, c: Controller) -> PathBuf {
        self.dir.join("bin").join(c.binary())
    }

    fn proc(&self, c: Controller) -> &Proc {
        self.procs
            .iter()
            .find(|p| p.controller == c)
            .expect("all controllers have a process")
    }

    fn proc_mut(&mut self, c: Controller) -> &mut Proc {
        self.procs
            .iter_mut()
            .find(|p| p.controller == c)
            .expect("all controllers have a process")
    }

    /// Fails (with the log tail) if any controller has exited.
    pub fn check_running(&mut self) -> Result<()> {
        for p in &mut self.procs {
            p.check_running()?;
        }
        Ok(())
    }

    /// The log file of a controller (appended across restarts; each start begins with a
    /// `===== e2e: start #N =====` line).
    pub fn log_path(&self, c: Controller) -> PathBuf {
        self.proc(c).log.clone()
    }

    /// The last `lines` lines of a controller's log.
    pub fn log_tail(&self, c: Controller, lines: usize) -> String {
        tail_file(&self.proc(c).log, lines)
    }

    /// The tails of all three logs, for failure messages.
    pub fn diagnostics(&self, lines: usize) -> String {
        Controller::ALL
            .iter()
            .map(|c| {
                format!(
                    "--- {} ({}) ---\n{}",
                    c,
                    self.log_path(*c).display(),
                    self.log_tail(*c, lines)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Lines of the given controllers' logs for which `wanted` holds, as `<controller>: <line>`;
    /// with `current_start_only`, only the lines written since the controller's latest
    /// (re)start.
    fn log_lines_where(
        &self,
        controllers: &[Controller],
        current_start_only: bool,
        wanted: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let mut out = Vec::new();
        for c in controllers {
            let p = self.proc(*c);
            let text = fs::read_to_string(&p.log).unwrap_or_default();
            let marker = format!("===== e2e: start #{} =====", p.starts);
            let text = if current_start_only {
                text.split_once(&marker).map(|(_, t)| t).unwrap_or(&text)
            } else {
                &text
            };
            out.extend(
                text.lines()
                    .filter(|l| wanted(l))
                    .map(|l| format!("{c}: {l}")),
            );
        }
        out
    }

    /// Lines matching any of [`WATCH_ERROR_PATTERNS`] in the given controllers' logs.
    pub fn watch_errors(
        &self,
        controllers: &[Controller],
        current_start_only: bool,
    ) -> Vec<String> {
        self.log_lines_where(controllers, current_start_only, |line| {
            WATCH_ERROR_PATTERNS.iter().any(|p| line.contains(p))
        })
    }

    /// Error lines about reports in the given controllers' whole logs: Kyverno's text logger
    /// (zerolog's console writer) marks errors `ERR`, client-go's included; a line counts when
    /// it mentions a report anywhere, the logging file's path (`pkg/controllers/report/…`)
    /// included, unless it is one of [`EXPECTED_REPORT_ERRORS`]. Kyverno logs an error when a
    /// report read, write or merge through us fails.
    pub fn report_errors(&self, controllers: &[Controller]) -> Vec<String> {
        self.log_lines_where(controllers, false, |line| {
            line.contains(" ERR ")
                && line.to_ascii_lowercase().contains("report")
                && !EXPECTED_REPORT_ERRORS.iter().any(|e| line.contains(e))
        })
    }

    /// Waits until the ClusterPolicies `names` are Ready and Kyverno's resource webhooks
    /// (the mutating one too when `mutating`) cover `resource` (a plural such as `pods`):
    /// before that, an admission request is not seen by those policies.
    pub async fn wait_cluster_policies_ready(
        &self,
        names: &[&str],
        resource: &str,
        mutating: bool,
    ) -> Result<Duration> {
        let t0 = Instant::now();
        let mut args = vec!["wait", "--for=condition=Ready", "--timeout=180s"];
        let refs: Vec<String> = names.iter().map(|n| format!("clusterpolicy/{n}")).collect();
        args.extend(refs.iter().map(String::as_str));
        self.kubectl
            .run(&args)
            .with_context(|| format!("ClusterPolicies not Ready\n{}", self.diagnostics(30)))?;
        let mut configs = vec![(
            "validatingwebhookconfiguration",
            "kyverno-resource-validating-webhook-cfg",
        )];
        if mutating {
            configs.push((
                "mutatingwebhookconfiguration",
                "kyverno-resource-mutating-webhook-cfg",
            ));
        }
        let names: Vec<String> = configs.iter().map(|(k, n)| format!("{k}/{n}")).collect();
        self.until_webhooks(&names, "{.webhooks[*].rules[*].resources}", |values| {
            names
                .iter()
                .zip(values)
                .find(|(_, v)| !v.contains(&format!("\"{resource}\"")))
                .map(|(name, _)| format!("{name} does not cover {resource}"))
        })
        .await?;
        Ok(t0.elapsed())
    }

    /// Waits until each CEL policy (`policies.kyverno.io`; `(plural, namespace, name)`, the
    /// namespace empty for the cluster-scoped kinds) reports `status.conditionStatus.ready`
    /// (they have no `Ready` condition for `kubectl wait --for=condition`) and its name is in
    /// the URL of one of Kyverno's resource webhooks: Kyverno marks the webhook configured
    /// before it writes the configuration, and the handler evaluates only the policies its URL
    /// names. Generating policies need no webhook of their own beyond the validating one.
    pub async fn wait_cel_policies_ready(
        &self,
        policies: &[(&str, &str, &str)],
    ) -> Result<Duration> {
        let t0 = Instant::now();
        for (plural, namespace, name) in policies {
            let object = format!("{plural}.policies.kyverno.io/{name}");
            let mut args = vec![
                "wait",
                "--for=jsonpath={.status.conditionStatus.ready}=true",
                "--timeout=180s",
                object.as_str(),
            ];
            if !namespace.is_empty() {
                args.extend(["-n", namespace]);
            }
            self.kubectl
                .run(&args)
                .with_context(|| format!("{object} not ready\n{}", self.diagnostics(30)))?;
        }
        let configs = [
            "validatingwebhookconfiguration/kyverno-resource-validating-webhook-cfg".to_string(),
            "mutatingwebhookconfiguration/kyverno-resource-mutating-webhook-cfg".into(),
        ];
        self.until_webhooks(&configs, "{.webhooks[*].clientConfig.url}", |urls| {
            let urls = urls.join(" ");
            let missing: Vec<&str> = policies
                .iter()
                .map(|(_, _, name)| *name)
                .filter(|name| {
                    !urls
                        .split(|c: char| c == '/' || c.is_whitespace())
                        .any(|segment| segment == *name)
                })
                .collect();
            (!missing.is_empty())
                .then(|| format!("no Kyverno resource webhook names {missing:?} (URLs: {urls})"))
        })
        .await?;
        Ok(t0.elapsed())
    }

    /// Polls `jsonpath` of each of Kyverno's webhook configurations `configs` (`kind/name`)
    /// every 500 ms until `missing` finds nothing missing in their values, for at most 120 s.
    async fn until_webhooks(
        &self,
        configs: &[String],
        jsonpath: &str,
        mut missing: impl FnMut(&[String]) -> Option<String>,
    ) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let output = format!("jsonpath={jsonpath}");
        loop {
            let values: Vec<String> = configs
                .iter()
                .map(|c| {
                    self.kubectl
                        .run(&["get", c, "-o", &output])
                        .unwrap_or_default()
                })
                .collect();
            let Some(what) = missing(&values) else {
                return Ok(());
            };
            ensure!(
                Instant::now() < deadline,
                "{what} after 120 s\n{}",
                self.diagnostics(30)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The process id of a running controller.
    pub fn pid(&self, c: Controller) -> Option<u32> {
        self.proc(c).child.as_ref().map(Child::id)
    }

    /// Stops a controller gracefully (SIGTERM, as a rolling update does; SIGKILL after 30 s)
    /// and starts it again with the same arguments.
    pub async fn restart(&mut self, c: Controller) -> Result<()> {
        let t0 = Instant::now();
        {
            let p = self.proc_mut(c);
            p.signal(libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(30);
            while let Some(child) = p.child.as_mut() {
                if child.try_wait()?.is_some() {
                    p.child = None;
                    break;
                }
                if Instant::now() > deadline {
                    p.kill();
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let bin = self.bin(c);
        self.proc_mut(c).spawn(&bin)?;
        eprintln!(
            "[kyverno] {c} stopped and started again in {:.1?}",
            t0.elapsed()
        );
        Ok(())
    }

    /// How many times a Kyverno circuit breaker (`circuit` as Kyverno names it, e.g.
    /// `admission reports`) dropped a report instead of writing it, from the controller's
    /// `kyverno_breaker_drops` counter (0 before the first drop: OpenTelemetry exports a
    /// counter once it has a value). The admission controller's `admission reports` breaker
    /// drops while its watch counting ephemeral reports is not open, e.g. for the moments after
    /// the only reports server restarted (cmd/kyverno/main.go, pkg/breaker of v1.19.1).
    pub async fn breaker_drops(&self, c: Controller, circuit: &str) -> Result<f64> {
        self.breaker_counter(c, "kyverno_breaker_drops", circuit)
            .await
    }

    /// How many times a Kyverno circuit breaker was asked (dropped or not): a check that
    /// [`Self::breaker_drops`] reads the right series.
    pub async fn breaker_calls(&self, c: Controller, circuit: &str) -> Result<f64> {
        self.breaker_counter(c, "kyverno_breaker_total", circuit)
            .await
    }

    async fn breaker_counter(&self, c: Controller, metric: &str, circuit: &str) -> Result<f64> {
        let port = self
            .proc(c)
            .args
            .iter()
            .find_map(|a| a.strip_prefix("--metricsPort="))
            .ok_or_else(|| anyhow!("{c} runs without --metricsPort"))?
            .to_owned();
        let port: u16 = port.parse().context("--metricsPort")?;
        let (code, text) = plain_http::get(port, "/metrics", Duration::from_secs(10))
            .await
            .with_context(|| format!("reading {c}'s metrics"))?;
        ensure!(code == 200, "{c}'s /metrics answered {code}");
        // `kyverno_breaker_drops` is exported as `kyverno_breaker_drops_total`; a name that
        // already ends in `_total` keeps it.
        let names = [metric.to_owned(), format!("{metric}_total")];
        Ok(plain_http::parse_prometheus(&text)?
            .iter()
            .filter(|s| names.contains(&s.name) && s.label("circuit_name") == circuit)
            .map(|s| s.value)
            .sum())
    }

    /// Switches the reports controller's `--aggregateReports` (mode A when `true`, B when
    /// `false`) and restarts it; the admission and background controllers run the same in both.
    pub async fn set_aggregate_reports(&mut self, on: bool) -> Result<()> {
        let p = self.proc_mut(Controller::Reports);
        let arg = p
            .args
            .iter_mut()
            .find(|a| a.starts_with("--aggregateReports="))
            .ok_or_else(|| anyhow!("the reports controller has no --aggregateReports argument"))?;
        *arg = format!("--aggregateReports={on}");
        self.restart(Controller::Reports).await
    }

    /// Waits until Kyverno's policy-validating webhook configuration exists, a server-side
    /// dry-run of an invalid ClusterPolicy is denied by Kyverno's webhook, and one of a valid
    /// ClusterPolicy is admitted. The second probe passes Kyverno's policy-mutating webhook,
    /// which is registered before its serving certificate is loaded: kube-apiserver then gets
    /// `remote error: tls: internal error` for a while after the validating webhook answers.
    async fn wait_webhook(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        // Schema-valid but semantically invalid (two rules with one name): only Kyverno's
        // policy webhook rejects it.
        let rule = serde_json::json!({
            "name": "dup",
            "match": {"any": [{"resources": {"kinds": ["ConfigMap"]}}]},
            "validate": {"message": "probe", "pattern": {"metadata": {"name": "?*"}}},
        });
        let probe = serde_json::json!({
            "apiVersion": "kyverno.io/v1",
            "kind": "ClusterPolicy",
            "metadata": {"name": "e2e-webhook-probe"},
            "spec": {"background": false, "rules": [rule.clone(), rule]},
        })
        .to_string();
        let valid_probe = serde_json::json!({
            "apiVersion": "kyverno.io/v1",
            "kind": "ClusterPolicy",
            "metadata": {"name": "e2e-webhook-probe"},
            "spec": {"background": false, "rules": [rule]},
        })
        .to_string();
        let mut last;
        loop {
            self.check_running()?;
            // Both policy webhooks registered: otherwise the valid probe below would be
            // admitted without reaching the mutating one.
            let webhook = self.kubectl.output(
                &[
                    "get",
                    "validatingwebhookconfiguration/kyverno-policy-validating-webhook-cfg",
                    "mutatingwebhookconfiguration/kyverno-policy-mutating-webhook-cfg",
                    "-o",
                    "name",
                ],
                None,
            )?;
            if webhook.status.success() {
                let out = self
                    .kubectl
                    .output(&["create", "--dry-run=server", "-f", "-"], Some(&probe))?;
                let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
                if !out.status.success() && stderr.contains("kyverno.svc") {
                    let admitted = self.kubectl.output(
                        &["create", "--dry-run=server", "-f", "-"],
                        Some(&valid_probe),
                    )?;
                    if admitted.status.success() {
                        return Ok(());
                    }
                    last = format!(
                        "dry-run of a valid ClusterPolicy: exit {}, stderr {:?}",
                        admitted.status,
                        String::from_utf8_lossy(&admitted.stderr)
                    );
                } else {
                    last = format!(
                        "dry-run of an invalid ClusterPolicy: exit {}, stdout {:?}, stderr {:?}",
                        out.status,
                        String::from_utf8_lossy(&out.stdout),
                        stderr
                    );
                }
            } else {
                last = format!(
                    "Kyverno's policy webhook configurations not both registered yet: {}",
                    String::from_utf8_lossy(&webhook.stderr).trim()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "Kyverno's admission webhook not ready after {timeout:?} (webhook port {}); \
                     last: {last}\n{}",
                    self.webhook_port,
                    self.diagnostics(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Stops all three controllers (SIGKILL).
    pub fn stop(&mut self) {
        for p in &mut self.procs {
            p.kill();
        }
    }
}

impl Drop for Kyverno {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The cache directory of `tests/kyverno/build.sh` (or `$REPORTS_SERVER_KYVERNO_DIR`), checked
/// for the three binaries and the CRD directories. The script runs at most once per test
/// process and returns at once when the cache is complete.
pub async fn kyverno_dir() -> Result<PathBuf> {
    static BUILT: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    let dir = match std::env::var_os(DIR_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => BUILT.get_or_try_init(run_build_script).await?.clone(),
    };
    let mut missing = Vec::new();
    for c in Controller::ALL {
        if !dir.join("bin").join(c.binary()).is_file() {
            missing.push(format!("bin/{}", c.binary()));
        }
    }
    for d in CRD_DIRS {
        let has_yaml = fs::read_dir(dir.join("crds").join(d))
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .any(|e| e.path().extension().is_some_and(|x| x == "yaml"))
            })
            .unwrap_or(false);
        if !has_yaml {
            missing.push(format!("crds/{d}/*.yaml"));
        }
    }
    if !missing.is_empty() {
        bail!(
            "{} lacks {} (run `bash tests/kyverno/build.sh`, which needs Go >= 1.26.6 and the Go \
             module proxy{})",
            dir.display(),
            missing.join(", "),
            if std::env::var_os(DIR_ENV).is_some() {
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
        "tests/kyverno/build.sh",
        &format!(
            "Kyverno {KYVERNO_VERSION} (needs Go >= 1.26.6 and the Go module proxy; or set \
             {DIR_ENV} to a directory with bin/ and crds/ as the script writes them)"
        ),
    )
    .await?;
    if t0.elapsed() > Duration::from_secs(5) {
        eprintln!("[kyverno] build script took {:.1?}", t0.elapsed());
    }
    Ok(dir)
}

fn tail_file(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
