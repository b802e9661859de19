//! End-to-end suite: the real `reports-server serve --auth-mode delegated` behind a real
//! kube-apiserver (aggregation layer, ExternalName Service to `localhost`, `caBundle` from the
//! cluster CA), with kube-controller-manager's garbage collector and namespace controller, RBAC
//! and delegated authentication/authorization, and a crash in the middle of a write loop.
//!
//! Every test starts its own control plane (etcd + kube-apiserver + kube-controller-manager,
//! built from the Go module proxy and cached; see docs/e2e.md) and its own server process. The
//! tests take a process-wide lock so that they run one after another even without
//! `--test-threads=1`: several control planes on two cores make the timing-sensitive steps
//! (availability probes, garbage collection, restarts) flaky.
//!
//! Needs Go >= 1.26 with the Go module proxy (or `REPORTS_SERVER_CONTROLPLANE_BIN`), `kubectl`
//! and `openssl`; a missing one makes the test fail with what to install, never skip.
//! `REPORTS_SERVER_E2E_BACKEND=postgres` runs the server on PostgreSQL instead of SQLite.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader, Read},
    path::PathBuf,
    process::Child,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use k8s_openapi::{
    api::{
        core::v1::{ConfigMap, Namespace, ServiceAccount},
        rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject},
    },
    apimachinery::pkg::apis::meta::v1::OwnerReference,
    kube_aggregator::pkg::apis::apiregistration::v1::APIService,
};
use kube::{
    Api, ResourceExt as _,
    api::{
        ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, ObjectMeta, Patch,
        PatchParams, PostParams, PropagationPolicy, WatchEvent, WatchParams,
    },
};
use reports_server_tests::{
    controlplane::{Component, ControlPlane, ControlPlaneOptions, KubeconfigAuth, kube_client_for},
    delegated::{self, API_SERVICES, SERVICE_NAME, SERVICE_NAMESPACE, Server, raw, raw_with},
    kubectl::{Kubectl, kubectl_path},
    server,
};
use serde_json::{Value, json};

/// Serializes the tests of this file (see the module documentation).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const LABEL: &str = "e2e.reports-server.io/suite";

// ---- the six resources -------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct Res {
    group: &'static str,
    version: &'static str,
    kind: &'static str,
    plural: &'static str,
    namespaced: bool,
    /// reports.kyverno.io keeps owner, summary and results under `spec`.
    in_spec: bool,
}

const POLR: Res = Res {
    group: "wgpolicyk8s.io",
    version: "v1alpha2",
    kind: "PolicyReport",
    plural: "policyreports",
    namespaced: true,
    in_spec: false,
};
const CPOLR: Res = Res {
    kind: "ClusterPolicyReport",
    plural: "clusterpolicyreports",
    namespaced: false,
    ..POLR
};
const EPHR: Res = Res {
    group: "reports.kyverno.io",
    version: "v1",
    kind: "EphemeralReport",
    plural: "ephemeralreports",
    namespaced: true,
    in_spec: true,
};
const CEPHR: Res = Res {
    kind: "ClusterEphemeralReport",
    plural: "clusterephemeralreports",
    namespaced: false,
    ..EPHR
};
const REP: Res = Res {
    group: "openreports.io",
    version: "v1alpha1",
    kind: "Report",
    plural: "reports",
    namespaced: true,
    in_spec: false,
};
const CREP: Res = Res {
    kind: "ClusterReport",
    plural: "clusterreports",
    namespaced: false,
    ..REP
};
const ALL: [Res; 6] = [POLR, CPOLR, EPHR, CEPHR, REP, CREP];
const NAMESPACED: [Res; 3] = [POLR, EPHR, REP];

impl Res {
    fn api_version(&self) -> String {
        format!("{}/{}", self.group, self.version)
    }

    /// `policyreports.wgpolicyk8s.io`: unambiguous for kubectl.
    fn qualified(&self) -> String {
        format!("{}.{}", self.plural, self.group)
    }

    fn api_resource(&self) -> ApiResource {
        ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(self.group, self.version, self.kind),
            self.plural,
        )
    }

    fn api(&self, client: &kube::Client, ns: Option<&str>) -> Api<DynamicObject> {
        match (self.namespaced, ns) {
            (true, Some(ns)) => Api::namespaced_with(client.clone(), ns, &self.api_resource()),
            _ => Api::all_with(client.clone(), &self.api_resource()),
        }
    }

    /// URL path of the collection, for raw requests.
    fn path(&self, ns: Option<&str>) -> String {
        match ns {
            Some(ns) if self.namespaced => format!(
                "/apis/{}/{}/namespaces/{ns}/{}",
                self.group, self.version, self.plural
            ),
            _ => format!("/apis/{}/{}/{}", self.group, self.version, self.plural),
        }
    }

    /// A valid object with `summary.pass = pass`.
    fn manifest(&self, name: &str, ns: Option<&str>, pass: i64) -> Value {
        let summary = json!({"pass": pass, "fail": 0, "warn": 0, "error": 0, "skip": 0});
        let results = json!([{
            "policy": "require-labels",
            "rule": "check-team",
            "result": "pass",
            "source": "kyverno",
            "scored": true,
            "timestamp": {"seconds": 1_700_000_000, "nanos": 0},
        }]);
        let mut obj = json!({
            "apiVersion": self.api_version(),
            "kind": self.kind,
            "metadata": {"name": name, "labels": {LABEL: "aggregated"}},
        });
        if self.namespaced {
            obj["metadata"]["namespace"] =
                json!(ns.expect("namespaced resource needs a namespace"));
        }
        if self.in_spec {
            obj["spec"] = json!({
                "owner": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": "web-0",
                    "uid": "6c737f35-260c-4e4f-8516-61a125c9fb78",
                },
                "summary": summary,
                "results": results,
            });
        } else {
            obj["scope"] = json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "name": "web-0",
                "namespace": ns.unwrap_or("default"),
            });
            obj["summary"] = summary;
            obj["results"] = results;
        }
        obj
    }

    fn dynamic(&self, name: &str, ns: Option<&str>, pass: i64) -> DynamicObject {
        serde_json::from_value(self.manifest(name, ns, pass)).expect("manifest is a DynamicObject")
    }

    fn pass_jsonpath(&self) -> &'static str {
        if self.in_spec {
            "jsonpath={.spec.summary.pass}"
        } else {
            "jsonpath={.summary.pass}"
        }
    }
}

// ---- one control plane + one server ------------------------------------------------------------

struct Env {
    // Dropped in this order: the server before the control plane, the lock last.
    server: Server,
    cp: ControlPlane,
    /// kubectl as the control plane's admin (system:masters), through kube-apiserver.
    admin: Kubectl,
    /// kube-rs as the admin, through kube-apiserver.
    client: kube::Client,
    /// kube-rs as an admin (client certificate with O=system:masters) straight to our server.
    direct_admin: kube::Client,
    name: &'static str,
    t0: Instant,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

impl Env {
    async fn start(name: &'static str) -> Result<Env> {
        let serial = SERIAL.lock().await;
        kubectl_path()?;
        // Build first: `cargo build` can take minutes, the control plane is up in seconds.
        let t = Instant::now();
        server::binary().context("building reports-server")?;
        eprintln!(
            "[e2e] {name}: reports-server binary built in {:.1?}",
            t.elapsed()
        );
        let t0 = Instant::now();
        let cp = ControlPlane::start(ControlPlaneOptions::with_controller_manager())
            .await
            .context("starting the e2e control plane (see docs/e2e.md)")?;
        let server = Server::start(&cp, &cp.dir().join("reports-server")).await?;
        let admin = Kubectl::new(cp.kubeconfig_path());
        let client = cp.client().await?;
        let cert = cp
            .issue_client_cert("e2e-direct-admin", &["system:masters"])
            .await?;
        let direct_admin = kube_client_for(&cp.kubeconfig_for_server(
            "direct-admin",
            &server.url(),
            KubeconfigAuth::ClientCert(&cert),
        )?)
        .await?;
        let env = Env {
            server,
            cp,
            admin,
            client,
            direct_admin,
            name,
            t0,
            _serial: serial,
        };
        env.register_apiservices().await?;
        eprintln!(
            "[e2e] {name}: control plane + server + APIServices Available in {:.1?}",
            env.t0.elapsed()
        );
        Ok(env)
    }

    /// `reports-server apiservices …` → checked → `kubectl apply -f -` → all Available.
    async fn register_apiservices(&self) -> Result<()> {
        delegated::register_apiservices(&self.cp, &self.server, &self.admin, &self.client).await
    }

    async fn wait_available(&self) -> Result<()> {
        delegated::wait_apiservices_routed(&self.cp, &self.server, &self.client).await
    }

    /// The tails of our server's and kube-apiserver's logs, for failure messages.
    fn diagnostics(&self) -> String {
        delegated::diagnostics(&self.cp, &self.server)
    }

    async fn create_namespace(&self, name: &str) -> Result<()> {
        Api::<Namespace>::all(self.client.clone())
            .create(
                &PostParams::default(),
                &Namespace {
                    metadata: ObjectMeta {
                        name: Some(name.into()),
                        ..Default::default()
                    },
                    ..Default::default()
                },
            )
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        Ok(())
    }

    /// Deletes the APIServices (so that nothing blocks on discovery), then stops the server and
    /// the control plane.
    async fn stop(self) -> Result<()> {
        let Env {
            mut server,
            cp,
            name,
            t0,
            ..
        } = self;
        delegated::unregister_apiservices(&cp).await?;
        server.kill();
        cp.stop().await?;
        eprintln!("[e2e] {name}: done in {:.1?}", t0.elapsed());
        Ok(())
    }
}

// ---- small helpers -----------------------------------------------------------------------------

fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// Polls `check` every 250 ms until it returns true or `timeout` passes; returns the time taken.
async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let start = Instant::now();
    loop {
        if check().await? {
            eprintln!("[e2e] {what}: after {:.1?}", start.elapsed());
            return Ok(start.elapsed());
        }
        if start.elapsed() > timeout {
            bail!("{what}: not true after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Names of the objects of `res` in `ns`.
async fn names(client: &kube::Client, res: Res, ns: Option<&str>) -> Result<BTreeSet<String>> {
    Ok(res
        .api(client, ns)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|o| o.metadata.name)
        .collect())
}

/// A long-running kubectl (e.g. `get -w`) whose stdout lines are collected.
struct KubectlLines {
    child: Child,
    rx: mpsc::Receiver<String>,
    seen: Vec<String>,
    stderr: Arc<Mutex<String>>,
}

impl KubectlLines {
    fn spawn(k: &Kubectl, args: &[&str]) -> Result<KubectlLines> {
        let mut child = k.spawn(args)?;
        let stdout = child.stdout.take().expect("piped stdout");
        let mut err = child.stderr.take().expect("piped stderr");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            sink.lock().unwrap().push_str(&s);
        });
        Ok(KubectlLines {
            child,
            rx,
            seen: Vec::new(),
            stderr,
        })
    }

    /// Waits until at least `n` of the lines so far satisfy `pred`.
    fn wait_for(
        &mut self,
        what: &str,
        n: usize,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.seen.iter().filter(|l| pred(l)).count() >= n {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "{what}: not seen within {timeout:?}; lines so far: {:?}; stderr: {}",
                    self.seen,
                    self.stderr.lock().unwrap()
                );
            }
            if let Ok(line) = self.rx.recv_timeout(left.min(Duration::from_millis(200))) {
                self.seen.push(line);
            }
        }
    }
}

impl Drop for KubectlLines {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---- 1. the APIs through kube-apiserver --------------------------------------------------------

/// The three APIServices become Available; discovery and get/list/watch/
/// apply/create/delete on all six resources with kubectl through kube-apiserver; creating in a
/// namespace that does not exist fails; OpenAPI v3 reaches kube-apiserver (`kubectl explain`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_apis_through_kube_apiserver() -> Result<()> {
    let env = Env::start("e2e_apis_through_kube_apiserver").await?;
    let k = &env.admin;

    // Status of the APIServices as kube-apiserver sees them.
    let apis = Api::<APIService>::all(env.client.clone());
    for name in API_SERVICES {
        let svc = apis.get(name).await?;
        let spec = svc.spec.as_ref().expect("spec");
        let service = spec.service.as_ref().expect("service");
        assert_eq!(
            (
                service.namespace.as_deref(),
                service.name.as_deref(),
                service.port
            ),
            (
                Some(SERVICE_NAMESPACE),
                Some(SERVICE_NAME),
                Some(i32::from(env.server.port))
            ),
            "APIService {name}"
        );
    }

    // Discovery: kubectl api-resources / api-versions through the aggregator.
    let t = Instant::now();
    let want: Vec<String> = ALL.iter().map(Res::qualified).collect();
    eventually(
        "kubectl api-resources lists the six resources",
        Duration::from_secs(60),
        || async {
            let out = k.run(&["api-resources", "-o", "name"])?;
            Ok(want.iter().all(|w| out.lines().any(|l| l == w)))
        },
    )
    .await
    .with_context(|| {
        format!(
            "kubectl api-resources: {:?}",
            k.output(&["api-resources", "-o", "name"], None)
        )
    })?;
    let wide = k.run(&[
        "api-resources",
        "--api-group",
        "wgpolicyk8s.io",
        "-o",
        "wide",
    ])?;
    for verb in [
        "get", "list", "watch", "create", "update", "patch", "delete",
    ] {
        assert!(
            wide.contains(verb),
            "api-resources lacks verb {verb}:\n{wide}"
        );
    }
    let versions = k.run(&["api-versions"])?;
    for gv in [
        "wgpolicyk8s.io/v1alpha2",
        "reports.kyverno.io/v1",
        "openreports.io/v1alpha1",
    ] {
        assert!(
            versions.lines().any(|l| l == gv),
            "api-versions lacks {gv}:\n{versions}"
        );
    }

    eprintln!("[e2e] discovery: {:.1?}", t.elapsed());

    // NamespaceLifecycle: no namespaced report in a namespace that does not exist.
    let missing = "e2e-does-not-exist";
    let out = k.output(
        &["create", "-f", "-"],
        Some(&POLR.manifest("orphan", Some(missing), 1).to_string()),
    )?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("not found"),
        "kubectl create in missing namespace {missing}: {}\nstdout: {}\nstderr: {stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    for res in NAMESPACED {
        let err = res
            .api(&env.client, Some(missing))
            .create(
                &PostParams::default(),
                &res.dynamic("orphan", Some(missing), 1),
            )
            .await
            .expect_err(&format!(
                "creating a {} in missing namespace {missing} must fail",
                res.kind
            ));
        assert_eq!(
            api_code(&err),
            Some(404),
            "{} in a missing namespace: want 404 NotFound as NamespaceLifecycle, got {err}",
            res.kind
        );
        assert!(
            names(&env.direct_admin, res, Some(missing))
                .await?
                .is_empty(),
            "a {} was stored in missing namespace {missing}",
            res.kind
        );
    }

    // get/list/watch/apply/delete on all six resources.
    let ns = "e2e-crud";
    env.create_namespace(ns).await?;
    for res in ALL {
        let t = Instant::now();
        crud_with_kubectl(k, res, ns)
            .with_context(|| format!("kubectl on {}", res.qualified()))
            .with_context(|| env.diagnostics())?;
        eprintln!(
            "[e2e] kubectl crud {}: {:.1?}",
            res.qualified(),
            t.elapsed()
        );
    }

    // OpenAPI v3 as kube-aggregator's downloader fetches it: through the proxy as user
    // system:aggregator with no group headers (k8s.io/apiserver adds system:authenticated to
    // every authenticated user, and RBAC's system:discovery allows /openapi/* for that group).
    let proxy_cert = env.cp.front_proxy_client();
    let proxy = kube_client_for(&env.cp.kubeconfig_for_server(
        "front-proxy",
        &env.server.url(),
        KubeconfigAuth::ClientCert(proxy_cert),
    )?)
    .await?;
    let (status, body) = raw_with(
        &proxy,
        "GET",
        "/openapi/v3",
        &[("X-Remote-User", "system:aggregator")],
        None,
    )
    .await?;
    assert!(
        status == 200 && body.contains("apis/wgpolicyk8s.io/v1alpha2"),
        "GET /openapi/v3 as system:aggregator (kube-aggregator's OpenAPI downloader): {status} \
         {body}"
    );

    // kubectl explain reads the OpenAPI v3 that kube-apiserver aggregated from us.
    let t = Instant::now();
    let explain = std::cell::RefCell::new(String::new());
    eventually(
        "kubectl explain policyreport",
        Duration::from_secs(90),
        || async {
            let o = k.output(&["explain", "policyreport"], None)?;
            let text = if o.status.success() {
                &o.stdout
            } else {
                &o.stderr
            };
            *explain.borrow_mut() = String::from_utf8_lossy(text).into_owned();
            Ok(o.status.success())
        },
    )
    .await
    .with_context(|| format!("last kubectl explain output: {}", explain.borrow()))?;
    let explain = explain.into_inner();
    assert!(
        explain.contains("PolicyReport") && explain.contains("wgpolicyk8s.io"),
        "{explain}"
    );
    let field = k.run(&["explain", "policyreport.results.result"])?;
    assert!(
        field.contains("pass") || field.contains("Result indicates"),
        "{field}"
    );
    eprintln!("[e2e] explain: {:.1?}", t.elapsed());

    env.stop().await
}

/// apply (create, update), create, get, list (names, table, all namespaces), watch and delete of
/// one resource, all with kubectl through kube-apiserver.
fn crud_with_kubectl(k: &Kubectl, res: Res, ns: &str) -> Result<()> {
    let q = res.qualified();
    let ns_args: Vec<&str> = if res.namespaced {
        vec!["-n", ns]
    } else {
        Vec::new()
    };
    let ns_opt = res.namespaced.then_some(ns);
    let with_ns = |args: &[&str]| -> Vec<String> {
        args.iter()
            .chain(ns_args.iter())
            .map(|s| s.to_string())
            .collect()
    };
    let run = |args: &[&str]| -> Result<String> {
        let args = with_ns(args);
        k.run(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let apply = |extra: &[&str], name: &str, pass: i64| -> Result<String> {
        let mut args = vec!["apply", "-f", "-"];
        args.extend_from_slice(extra);
        k.run_with_stdin(&args, Some(&res.manifest(name, ns_opt, pass).to_string()))
    };
    let ends_with = |name: &'static str| move |l: &str| l.ends_with(&format!("/{name}"));

    let watch_args = with_ns(&["get", &q, "-w", "-o", "name"]);
    let mut watch = KubectlLines::spawn(
        k,
        &watch_args.iter().map(String::as_str).collect::<Vec<_>>(),
    )?;

    // Client-side apply: create.
    let created = apply(&[], "crud-a", 1)?;
    ensure!(created.contains("crud-a created"), "apply: {created}");
    watch.wait_for(
        "watch: crud-a added",
        1,
        Duration::from_secs(30),
        ends_with("crud-a"),
    )?;

    // get -o json: server-set metadata.
    let obj: Value = serde_json::from_str(&run(&["get", &q, "crud-a", "-o", "json"])?)?;
    ensure!(
        obj["kind"] == res.kind && obj["apiVersion"] == res.api_version().as_str(),
        "get: {obj}"
    );
    for field in ["uid", "resourceVersion", "creationTimestamp"] {
        ensure!(
            obj["metadata"][field]
                .as_str()
                .is_some_and(|s| !s.is_empty()),
            "get: no metadata.{field}: {obj}"
        );
    }
    if res.namespaced {
        ensure!(obj["metadata"]["namespace"] == ns, "get: {obj}");
    }

    // list: names, the table with the CRD's printer columns, all namespaces.
    let listed = run(&["get", &q, "-o", "name"])?;
    ensure!(listed.lines().any(ends_with("crud-a")), "list: {listed}");
    let table = run(&["get", &q])?;
    let header = table.lines().next().unwrap_or_default();
    ensure!(
        header.starts_with("NAME") && header.contains("PASS") && table.contains("crud-a"),
        "table: {table}"
    );
    if res.namespaced {
        let all = k.run(&[
            "get",
            &q,
            "-A",
            "-o",
            "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name}{\"\\n\"}{end}",
        ])?;
        ensure!(
            all.lines().any(|l| l == format!("{ns}/crud-a")),
            "list -A: {all}"
        );
    }

    // Client-side apply: update (a merge patch); the watch sees the change.
    let configured = apply(&[], "crud-a", 2)?;
    ensure!(
        configured.contains("crud-a configured"),
        "apply: {configured}"
    );
    let pass = run(&["get", &q, "crud-a", "-o", res.pass_jsonpath()])?;
    ensure!(pass == "2", "after apply: pass = {pass:?}");
    watch.wait_for(
        "watch: crud-a modified",
        2,
        Duration::from_secs(30),
        ends_with("crud-a"),
    )?;

    // kubectl create: a second object.
    let out = k.run_with_stdin(
        &["create", "-f", "-"],
        Some(&res.manifest("crud-b", ns_opt, 1).to_string()),
    )?;
    ensure!(out.contains("crud-b created"), "create: {out}");
    watch.wait_for(
        "watch: crud-b",
        1,
        Duration::from_secs(30),
        ends_with("crud-b"),
    )?;

    // delete (kubectl waits for the objects to be gone), then NotFound.
    let deleted = run(&["delete", &q, "crud-a", "crud-b"])?;
    ensure!(deleted.matches("deleted").count() == 2, "delete: {deleted}");
    let args = with_ns(&["get", &q, "crud-a"]);
    let gone = k.output(&args.iter().map(String::as_str).collect::<Vec<_>>(), None)?;
    ensure!(
        !gone.status.success() && String::from_utf8_lossy(&gone.stderr).contains("NotFound"),
        "get after delete: {gone:?}"
    );
    let empty = run(&["get", &q, "-o", "name"])?;
    ensure!(empty.trim().is_empty(), "list after delete: {empty}");
    Ok(())
}

// ---- 1b. server-side apply ----------------------------------------------------------------------

/// `kubectl apply --server-side` through kube-apiserver on all six resources: create, update,
/// managedFields, a conflict with another field manager, `--force-conflicts`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_server_side_apply_through_kube_apiserver() -> Result<()> {
    let env = Env::start("e2e_server_side_apply_through_kube_apiserver").await?;
    let ns = "e2e-ssa";
    env.create_namespace(ns).await?;
    for res in ALL {
        let t = Instant::now();
        server_side_apply_with_kubectl(&env.admin, res, ns)
            .with_context(|| format!("kubectl apply --server-side on {}", res.qualified()))
            .with_context(|| env.diagnostics())?;
        eprintln!(
            "[e2e] server-side apply {}: {:.1?}",
            res.qualified(),
            t.elapsed()
        );
    }
    env.stop().await
}

fn server_side_apply_with_kubectl(k: &Kubectl, res: Res, ns: &str) -> Result<()> {
    let q = res.qualified();
    let ns_opt = res.namespaced.then_some(ns);
    let mut ns_args = Vec::new();
    if res.namespaced {
        ns_args = vec!["-n", ns];
    }
    let apply = |manager: &str, pass: i64, force: bool| {
        let manager = format!("--field-manager={manager}");
        let mut args = vec!["apply", "--server-side", &manager, "-f", "-"];
        if force {
            args.push("--force-conflicts");
        }
        k.output(&args, Some(&res.manifest("ssa", ns_opt, pass).to_string()))
    };
    let get = || -> Result<Value> {
        // kubectl hides managedFields unless asked.
        let mut args = vec!["get", &q, "ssa", "-o", "json", "--show-managed-fields"];
        args.extend_from_slice(&ns_args);
        Ok(serde_json::from_str(&k.run(&args)?)?)
    };
    let pass_of = |obj: &Value| {
        if res.in_spec {
            obj["spec"]["summary"]["pass"].clone()
        } else {
            obj["summary"]["pass"].clone()
        }
    };
    let ok = |out: std::process::Output, what: &str| -> Result<String> {
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        ensure!(
            out.status.success() && stdout.contains("ssa serverside-applied"),
            "{what}: {}\nstdout: {stdout}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(stdout)
    };

    // Create, then update, as manager e2e-ssa.
    ok(apply("e2e-ssa", 1, false)?, "apply --server-side (create)")?;
    ok(apply("e2e-ssa", 3, false)?, "apply --server-side (update)")?;
    let obj = get()?;
    ensure!(pass_of(&obj) == 3, "after server-side apply: {obj}");
    ensure!(
        obj["metadata"]["managedFields"]
            .as_array()
            .is_some_and(|m| m
                .iter()
                .any(|f| f["manager"] == "e2e-ssa" && f["operation"] == "Apply")),
        "no Apply managedFields entry for e2e-ssa: {obj}"
    );

    // Another manager setting the same field to another value conflicts...
    let out = apply("e2e-other", 5, false)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && stderr.to_lowercase().contains("conflict"),
        "a second field manager must conflict: {}\nstderr: {stderr}",
        out.status
    );
    ensure!(
        pass_of(&get()?) == 3,
        "a conflicting apply changed the object"
    );
    // ... unless it forces the conflict and takes the field over.
    ok(
        apply("e2e-other", 5, true)?,
        "apply --server-side --force-conflicts",
    )?;
    ensure!(pass_of(&get()?) == 5, "--force-conflicts did not apply");

    let mut args = vec!["delete", &q, "ssa"];
    args.extend_from_slice(&ns_args);
    let deleted = k.run(&args)?;
    ensure!(deleted.contains("deleted"), "delete: {deleted}");
    Ok(())
}

// ---- 2. garbage collection ---------------------------------------------------------------------

/// kube-controller-manager's garbage collector deletes reports whose owner (a ConfigMap) is
/// deleted, and orphans them (removes the ownerReference) when asked to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_garbage_collection() -> Result<()> {
    let env = Env::start("e2e_garbage_collection").await?;
    let ns = "e2e-gc";
    env.create_namespace(ns).await?;
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), ns);
    let mut owner_refs = BTreeMap::new();
    for owner in ["owner", "orphaner"] {
        let cm = cms
            .create(
                &PostParams::default(),
                &ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(owner.into()),
                        ..Default::default()
                    },
                    ..Default::default()
                },
            )
            .await?;
        owner_refs.insert(
            owner,
            OwnerReference {
                api_version: "v1".into(),
                kind: "ConfigMap".into(),
                name: owner.into(),
                uid: cm.metadata.uid.clone().expect("ConfigMap uid"),
                ..Default::default()
            },
        );
    }

    // Owned by "owner": one of each namespaced kind. Owned by "orphaner": a PolicyReport.
    // Not owned: a PolicyReport that must stay.
    let create = |res: Res, name: &'static str, owner: Option<&'static str>| {
        let mut obj = res.dynamic(name, Some(ns), 1);
        obj.metadata.owner_references = owner.map(|o| vec![owner_refs[o].clone()]);
        let api = res.api(&env.client, Some(ns));
        async move {
            api.create(&PostParams::default(), &obj)
                .await
                .with_context(|| format!("creating {} {name}", res.kind))
        }
    };
    for res in NAMESPACED {
        create(res, "owned", Some("owner")).await?;
    }
    create(POLR, "orphaned", Some("orphaner")).await?;
    create(POLR, "unowned", None).await?;
    let stored = POLR.api(&env.client, Some(ns)).get("owned").await?;
    assert_eq!(
        stored.metadata.owner_references.as_deref(),
        Some(&[owner_refs["owner"].clone()][..]),
        "ownerReferences round trip"
    );

    // Background deletion of the owner: the garbage collector deletes the dependents.
    cms.delete(
        "owner",
        &DeleteParams {
            propagation_policy: Some(PropagationPolicy::Background),
            ..Default::default()
        },
    )
    .await?;
    let gc_time = eventually(
        "garbage collector deleted the owned reports",
        Duration::from_secs(90),
        || async {
            for res in NAMESPACED {
                if res
                    .api(&env.client, Some(ns))
                    .get_opt("owned")
                    .await?
                    .is_some()
                {
                    return Ok(false);
                }
            }
            Ok(true)
        },
    )
    .await
    .with_context(|| {
        format!(
            "{}\n--- kube-controller-manager log ---\n{}",
            env.diagnostics(),
            env.cp.log_tail(Component::KubeControllerManager, 40)
        )
    })?;

    // Orphan deletion: the dependent stays, without the ownerReference.
    cms.delete(
        "orphaner",
        &DeleteParams {
            propagation_policy: Some(PropagationPolicy::Orphan),
            ..Default::default()
        },
    )
    .await?;
    eventually(
        "garbage collector orphaned the report and deleted its owner",
        Duration::from_secs(90),
        || async {
            let report = POLR.api(&env.client, Some(ns)).get("orphaned").await?;
            let refs = report.metadata.owner_references.unwrap_or_default();
            Ok(refs.is_empty() && cms.get_opt("orphaner").await?.is_none())
        },
    )
    .await
    .with_context(|| {
        format!(
            "{}\n--- kube-controller-manager log ---\n{}",
            env.diagnostics(),
            env.cp.log_tail(Component::KubeControllerManager, 40)
        )
    })?;

    // Straight from our server: only the orphaned and the unowned report are left.
    for res in NAMESPACED {
        let left = names(&env.direct_admin, res, Some(ns)).await?;
        let want: BTreeSet<String> = if res.kind == "PolicyReport" {
            ["orphaned", "unowned"].map(String::from).into()
        } else {
            BTreeSet::new()
        };
        assert_eq!(left, want, "{} left in {ns} after GC", res.kind);
    }
    eprintln!("[e2e] garbage collection took {gc_time:.1?}");
    env.stop().await
}

// ---- 3. namespace deletion ---------------------------------------------------------------------

/// Deleting a namespace that holds reports completes: the namespace controller deletes the
/// reports (waiting for a finalizer), creates in the terminating namespace are refused, and
/// nothing is left in our database. Reports in other namespaces stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_namespace_deletion() -> Result<()> {
    let env = Env::start("e2e_namespace_deletion").await?;
    let (ns, keep) = ("e2e-doomed", "e2e-kept");
    env.create_namespace(ns).await?;
    env.create_namespace(keep).await?;
    let pp = PostParams::default();
    for res in NAMESPACED {
        for name in ["r-1", "r-2"] {
            res.api(&env.client, Some(ns))
                .create(&pp, &res.dynamic(name, Some(ns), 1))
                .await
                .with_context(|| format!("creating {} {ns}/{name}", res.kind))?;
        }
        res.api(&env.client, Some(keep))
            .create(&pp, &res.dynamic("r-1", Some(keep), 1))
            .await?;
    }
    // A report with a finalizer keeps the namespace Terminating until the finalizer is removed.
    let hold = "e2e.reports-server.io/hold";
    let mut held = POLR.dynamic("held", Some(ns), 1);
    held.metadata.finalizers = Some(vec![hold.into()]);
    POLR.api(&env.client, Some(ns)).create(&pp, &held).await?;

    let namespaces: Api<Namespace> = Api::all(env.client.clone());
    let t = Instant::now();
    namespaces.delete(ns, &DeleteParams::default()).await?;

    // The namespace controller deletes everything; the held report only gets a
    // deletionTimestamp.
    let polr = POLR.api(&env.client, Some(ns));
    eventually(
        "namespace controller deleted the reports without finalizers",
        Duration::from_secs(90),
        || async {
            for res in NAMESPACED {
                let left = names(&env.client, res, Some(ns)).await?;
                let expected_left = usize::from(res.kind == "PolicyReport");
                if left.len() != expected_left {
                    return Ok(false);
                }
            }
            Ok(polr
                .get("held")
                .await?
                .metadata
                .deletion_timestamp
                .is_some())
        },
    )
    .await
    .with_context(|| {
        format!(
            "{}\n--- kube-controller-manager log ---\n{}",
            env.diagnostics(),
            env.cp.log_tail(Component::KubeControllerManager, 40)
        )
    })?;
    let phase = namespaces
        .get(ns)
        .await?
        .status
        .and_then(|s| s.phase)
        .unwrap_or_default();
    assert_eq!(
        phase, "Terminating",
        "namespace {ns} while a report is held"
    );

    // NamespaceLifecycle: no creates in a terminating namespace (403 Forbidden).
    for res in NAMESPACED {
        let err = res
            .api(&env.client, Some(ns))
            .create(&pp, &res.dynamic("late", Some(ns), 1))
            .await
            .expect_err(&format!(
                "creating a {} in terminating namespace {ns} must fail",
                res.kind
            ));
        assert_eq!(
            api_code(&err),
            Some(403),
            "{} in a terminating namespace: want 403 Forbidden as NamespaceLifecycle, got {err}",
            res.kind
        );
    }

    // Release the finalizer: the report goes, then the namespace.
    polr.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await?;
    eventually(
        "namespace deletion completed",
        Duration::from_secs(120),
        || async { Ok(namespaces.get_opt(ns).await?.is_none()) },
    )
    .await
    .with_context(|| {
        format!(
            "{}\n--- kube-controller-manager log ---\n{}",
            env.diagnostics(),
            env.cp.log_tail(Component::KubeControllerManager, 40)
        )
    })?;
    eprintln!("[e2e] namespace deletion took {:.1?} in all", t.elapsed());

    // Nothing left: through kube-apiserver, straight from our server, and across namespaces.
    for res in NAMESPACED {
        assert!(
            names(&env.client, res, Some(ns)).await?.is_empty(),
            "{} left in {ns} (through kube-apiserver)",
            res.kind
        );
        assert!(
            names(&env.direct_admin, res, Some(ns)).await?.is_empty(),
            "{} left in {ns} (our server directly)",
            res.kind
        );
        let everywhere: Vec<String> = res
            .api(&env.direct_admin, None)
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .map(|o| format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any()))
            .collect();
        assert_eq!(
            everywhere,
            [format!("{keep}/r-1")],
            "{} across all namespaces after deleting {ns}",
            res.kind
        );
    }
    env.stop().await
}

// ---- 4. authentication and authorization -------------------------------------------------------

/// RBAC through kube-apiserver and delegated authentication/authorization on our own port:
/// alice may read policyreports in team-a only, her watch in team-a never shows team-b, and
/// anonymous, unknown or spoofed requests straight to the server are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_authn_authz() -> Result<()> {
    let env = Env::start("e2e_authn_authz").await?;
    let (a, b) = ("team-a", "team-b");
    env.create_namespace(a).await?;
    env.create_namespace(b).await?;

    // RBAC: alice and the service account team-a/robot may get/list/watch policyreports in
    // team-a.
    let robot = "robot";
    Api::<ServiceAccount>::namespaced(env.client.clone(), a)
        .create(
            &PostParams::default(),
            &ServiceAccount {
                metadata: ObjectMeta {
                    name: Some(robot.into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;
    grant_read(
        &env.client,
        a,
        vec![user("alice"), service_account(a, robot)],
    )
    .await?;

    let pp = PostParams::default();
    for ns in [a, b] {
        POLR.api(&env.client, Some(ns))
            .create(&pp, &POLR.dynamic("seed", Some(ns), 1))
            .await?;
    }

    // Through kube-apiserver (kubectl and kube-rs as alice).
    let alice_kc = env.cp.user_kubeconfig("alice", &[]).await?;
    let alice_kubectl = Kubectl::new(&alice_kc);
    let listed =
        alice_kubectl.run(&["get", "policyreports.wgpolicyk8s.io", "-n", a, "-o", "name"])?;
    assert_eq!(listed.trim(), "policyreport.wgpolicyk8s.io/seed");
    let denied = alice_kubectl.output(&["get", "policyreports.wgpolicyk8s.io", "-n", b], None)?;
    let stderr = String::from_utf8_lossy(&denied.stderr);
    assert!(
        !denied.status.success() && stderr.contains("Forbidden"),
        "alice in {b}: {stderr}"
    );
    let alice = kube_client_for(&alice_kc).await?;
    let code = |r: Result<DynamicObject, kube::Error>| r.err().as_ref().and_then(api_code);
    assert!(POLR.api(&alice, Some(a)).get("seed").await.is_ok());
    assert_eq!(code(POLR.api(&alice, Some(b)).get("seed").await), Some(403));
    assert_eq!(
        POLR.api(&alice, None)
            .list(&ListParams::default())
            .await
            .err()
            .as_ref()
            .and_then(api_code),
        Some(403),
        "alice listing all namespaces"
    );
    assert_eq!(
        code(
            POLR.api(&alice, Some(a))
                .create(&pp, &POLR.dynamic("by-alice", Some(a), 1))
                .await
        ),
        Some(403),
        "alice may not create"
    );

    // alice's watch in team-a while the admin writes to both namespaces.
    let alice_polr = POLR.api(&alice, Some(a));
    let rv = alice_polr
        .list(&ListParams::default())
        .await?
        .metadata
        .resource_version
        .expect("list resourceVersion");
    let mut stream = alice_polr
        .watch(&WatchParams::default().timeout(120), &rv)
        .await?
        .boxed();
    let events: Arc<Mutex<Vec<(String, String, String)>>> = Arc::default();
    let sink = events.clone();
    let watcher = tokio::spawn(async move {
        while let Some(ev) = stream.next().await {
            let (kind, obj) = match ev {
                Ok(WatchEvent::Added(o)) => ("ADDED", o),
                Ok(WatchEvent::Modified(o)) => ("MODIFIED", o),
                Ok(WatchEvent::Deleted(o)) => ("DELETED", o),
                Ok(WatchEvent::Bookmark(_)) => continue,
                Ok(WatchEvent::Error(e)) => {
                    sink.lock()
                        .unwrap()
                        .push(("ERROR".into(), String::new(), format!("{e:?}")));
                    break;
                }
                Err(e) => {
                    sink.lock()
                        .unwrap()
                        .push(("ERROR".into(), String::new(), e.to_string()));
                    break;
                }
            };
            sink.lock().unwrap().push((
                kind.into(),
                obj.namespace().unwrap_or_default(),
                obj.name_any(),
            ));
        }
    });
    let admin_polr = |ns: &str| POLR.api(&env.client, Some(ns));
    for i in 0..3 {
        admin_polr(b)
            .create(&pp, &POLR.dynamic(&format!("b-{i}"), Some(b), 1))
            .await?;
        admin_polr(a)
            .create(&pp, &POLR.dynamic(&format!("a-{i}"), Some(a), 1))
            .await?;
    }
    admin_polr(b)
        .patch(
            "seed",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
        )
        .await?;
    admin_polr(b)
        .delete("b-0", &DeleteParams::default())
        .await?;
    // A fence: once alice sees it, every earlier event has been delivered.
    admin_polr(a)
        .create(&pp, &POLR.dynamic("a-fence", Some(a), 1))
        .await?;
    let seen_fence = eventually(
        "alice's watch saw the fence",
        Duration::from_secs(30),
        || async {
            Ok(events
                .lock()
                .unwrap()
                .iter()
                .any(|(_, _, n)| n == "a-fence"))
        },
    )
    .await;
    watcher.abort();
    let events = events.lock().unwrap().clone();
    seen_fence.with_context(|| format!("alice's watch events: {events:?}"))?;
    let added_a: Vec<&str> = events
        .iter()
        .filter(|(k, ns, _)| k == "ADDED" && ns == a)
        .map(|(_, _, n)| n.as_str())
        .collect();
    assert_eq!(
        added_a,
        ["a-0", "a-1", "a-2", "a-fence"],
        "alice's watch events: {events:?}"
    );
    assert!(
        events.iter().all(|(k, ns, _)| k != "ERROR" && ns == a),
        "alice's watch in {a} got events from elsewhere (or errors): {events:?}"
    );

    // Straight to our server, without kube-apiserver in between.
    let url = env.server.url();
    let direct = |name: &str, auth: KubeconfigAuth<'_>| -> Result<PathBuf> {
        env.cp.kubeconfig_for_server(name, &url, auth)
    };
    let path_a = POLR.path(Some(a));
    let path_b = POLR.path(Some(b));
    let path_all = POLR.path(None);
    let spoof_admin: &[(&str, &str)] = &[
        ("X-Remote-User", "kubernetes-admin"),
        ("X-Remote-Group", "system:masters"),
    ];
    let expect = |who: &str, method: &str, path: &str, got: (u16, String), want: u16| {
        assert_eq!(
            got.0, want,
            "{who}: {method} {path} straight to the server: want {want}, got {} {}",
            got.0, got.1
        );
    };

    // No credentials at all: 401 (also with X-Remote-* headers); health endpoints are open.
    let anonymous = kube_client_for(&direct("anonymous", KubeconfigAuth::Anonymous)?).await?;
    expect(
        "anonymous",
        "GET",
        &path_a,
        raw(&anonymous, "GET", &path_a).await?,
        401,
    );
    expect(
        "anonymous with X-Remote-User",
        "GET",
        &path_b,
        raw_with(&anonymous, "GET", &path_b, spoof_admin, None).await?,
        401,
    );
    for health in ["/livez", "/readyz"] {
        let (status, body) = raw(&anonymous, "GET", health).await?;
        assert_eq!((status, body.trim()), (200, "ok"), "anonymous GET {health}");
    }
    // A token the cluster does not know (TokenReview says no): 401.
    let bogus = kube_client_for(&direct(
        "bogus-token",
        KubeconfigAuth::Token("not-a-token"),
    )?)
    .await?;
    expect(
        "bogus token",
        "GET",
        &path_a,
        raw(&bogus, "GET", &path_a).await?,
        401,
    );

    // alice's client certificate (client-ca-file): SubjectAccessReview decides.
    let alice_cert = env.cp.issue_client_cert("alice", &[]).await?;
    let alice_direct = kube_client_for(&direct(
        "alice-direct",
        KubeconfigAuth::ClientCert(&alice_cert),
    )?)
    .await?;
    let (status, body) = raw(&alice_direct, "GET", &path_a).await?;
    assert!(
        status == 200 && body.contains("\"seed\""),
        "alice: GET {path_a} straight to the server: {status} {body}"
    );
    expect(
        "alice",
        "GET",
        &path_b,
        raw(&alice_direct, "GET", &path_b).await?,
        403,
    );
    expect(
        "alice",
        "GET",
        &path_all,
        raw(&alice_direct, "GET", &path_all).await?,
        403,
    );
    expect(
        "alice (watch)",
        "GET",
        &format!("{path_b}?watch=1"),
        raw(
            &alice_direct,
            "GET",
            &format!("{path_b}?watch=1&timeoutSeconds=1"),
        )
        .await?,
        403,
    );
    expect(
        "alice",
        "POST",
        &path_a,
        raw_with(
            &alice_direct,
            "POST",
            &path_a,
            &[],
            Some(&POLR.manifest("by-alice", Some(a), 1)),
        )
        .await?,
        403,
    );
    // X-Remote-* headers are only trusted with the front-proxy certificate.
    expect(
        "alice spoofing X-Remote-User/Group",
        "GET",
        &path_b,
        raw_with(&alice_direct, "GET", &path_b, spoof_admin, None).await?,
        403,
    );

    // The aggregator's certificate (front-proxy CA, allowed CN): the headers are the identity.
    let proxy = kube_client_for(&direct(
        "front-proxy",
        KubeconfigAuth::ClientCert(env.cp.front_proxy_client()),
    )?)
    .await?;
    let as_alice: &[(&str, &str)] = &[
        ("X-Remote-User", "alice"),
        ("X-Remote-Group", "system:authenticated"),
        ("X-Remote-Extra-Reason", "e2e"),
        ("X-Remote-Uid", "alice-uid"),
    ];
    expect(
        "front proxy as alice",
        "GET",
        &path_a,
        raw_with(&proxy, "GET", &path_a, as_alice, None).await?,
        200,
    );
    expect(
        "front proxy as alice",
        "GET",
        &path_b,
        raw_with(&proxy, "GET", &path_b, as_alice, None).await?,
        403,
    );
    expect(
        "front proxy as bob",
        "GET",
        &path_a,
        raw_with(&proxy, "GET", &path_a, &[("X-Remote-User", "bob")], None).await?,
        403,
    );
    expect(
        "front proxy as eve in system:masters",
        "GET",
        &path_b,
        raw_with(
            &proxy,
            "GET",
            &path_b,
            &[
                ("X-Remote-User", "eve"),
                ("X-Remote-Group", "system:masters"),
            ],
            None,
        )
        .await?,
        200,
    );
    expect(
        "front proxy without X-Remote-User",
        "GET",
        &path_a,
        raw(&proxy, "GET", &path_a).await?,
        401,
    );
    // A front-proxy-CA certificate whose CN is not in requestheader-allowed-names.
    let rogue_cert = env
        .cp
        .issue_front_proxy_cert("not-front-proxy-client")
        .await?;
    let rogue = kube_client_for(&direct(
        "rogue-proxy",
        KubeconfigAuth::ClientCert(&rogue_cert),
    )?)
    .await?;
    expect(
        "front-proxy CA cert with a CN not allowed",
        "GET",
        &path_b,
        raw_with(&rogue, "GET", &path_b, spoof_admin, None).await?,
        401,
    );

    // A service-account token (TokenReview), bound in team-a only.
    let token = env
        .admin
        .run(&["create", "token", robot, "-n", a, "--duration=1h"])?;
    let robot_direct =
        kube_client_for(&direct("robot", KubeconfigAuth::Token(token.trim()))?).await?;
    expect(
        "team-a/robot",
        "GET",
        &path_a,
        raw(&robot_direct, "GET", &path_a).await?,
        200,
    );
    expect(
        "team-a/robot",
        "GET",
        &path_b,
        raw(&robot_direct, "GET", &path_b).await?,
        403,
    );

    // The cached denial expires: once alice is granted team-b, she gets in.
    grant_read(&env.client, b, vec![user("alice")]).await?;
    eventually(
        "alice's new RoleBinding in team-b takes effect on our server",
        Duration::from_secs(45),
        || async { Ok(raw(&alice_direct, "GET", &path_b).await?.0 == 200) },
    )
    .await?;

    env.stop().await
}

fn user(name: &str) -> Subject {
    Subject {
        kind: "User".into(),
        name: name.into(),
        api_group: Some("rbac.authorization.k8s.io".into()),
        ..Default::default()
    }
}

fn service_account(ns: &str, name: &str) -> Subject {
    Subject {
        kind: "ServiceAccount".into(),
        name: name.into(),
        namespace: Some(ns.into()),
        ..Default::default()
    }
}

/// A Role allowing get/list/watch on policyreports in `ns`, bound to `subjects`.
async fn grant_read(client: &kube::Client, ns: &str, subjects: Vec<Subject>) -> Result<()> {
    let name = "policyreport-reader";
    Api::<Role>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &Role {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    ..Default::default()
                },
                rules: Some(vec![PolicyRule {
                    api_groups: Some(vec!["wgpolicyk8s.io".into()]),
                    resources: Some(vec!["policyreports".into()]),
                    verbs: vec!["get".into(), "list".into(), "watch".into()],
                    ..Default::default()
                }]),
            },
        )
        .await?;
    Api::<RoleBinding>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &RoleBinding {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    ..Default::default()
                },
                role_ref: RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    kind: "Role".into(),
                    name: name.into(),
                },
                subjects: Some(subjects),
            },
        )
        .await?;
    Ok(())
}

// ---- 5. crash safety ---------------------------------------------------------------------------

/// One `kubectl create` in the write loop.
#[derive(Debug, Clone)]
struct WriteAttempt {
    name: String,
    started: Instant,
    acknowledged: bool,
    uid: String,
    error: String,
}

/// kubectl writes reports in a loop through kube-apiserver while the server is SIGKILLed and
/// restarted; every write kubectl reported as successful is there afterwards, with the uid it
/// was acknowledged with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_restart_keeps_acknowledged_writes() -> Result<()> {
    const BEFORE_KILL: usize = 20;
    const TOTAL: usize = 60;
    const AFTER_RECOVERY: usize = 10;
    let mut env = Env::start("e2e_restart_keeps_acknowledged_writes").await?;
    let ns = "e2e-crash";
    env.create_namespace(ns).await?;

    let progress = Arc::new(AtomicUsize::new(0));
    let recovered = Arc::new(AtomicBool::new(false));
    let writer = {
        let kubeconfig = env.cp.kubeconfig_path().to_path_buf();
        let (progress, recovered) = (progress.clone(), recovered.clone());
        tokio::task::spawn_blocking(move || {
            let k = Kubectl::new(&kubeconfig);
            let t0 = Instant::now();
            let mut writes: Vec<WriteAttempt> = Vec::new();
            let mut recovered_at = None;
            for i in 0.. {
                if recovered_at.is_none() && recovered.load(Ordering::SeqCst) {
                    recovered_at = Some(i);
                }
                let done = i >= TOTAL && recovered_at.is_some_and(|r| i >= r + AFTER_RECOVERY);
                if done || t0.elapsed() > Duration::from_secs(300) {
                    break;
                }
                let name = format!("crash-{i:03}");
                let manifest = POLR.manifest(&name, Some(ns), 1).to_string();
                let started = Instant::now();
                let out = k.output(
                    &[
                        "create",
                        "-f",
                        "-",
                        "--request-timeout=15s",
                        "-o",
                        "jsonpath={.metadata.uid}",
                    ],
                    Some(&manifest),
                );
                let (acknowledged, uid, error) = match out {
                    Ok(o) if o.status.success() => (
                        true,
                        String::from_utf8_lossy(&o.stdout).trim().to_string(),
                        String::new(),
                    ),
                    Ok(o) => (
                        false,
                        String::new(),
                        String::from_utf8_lossy(&o.stderr).trim().to_string(),
                    ),
                    Err(e) => (false, String::new(), format!("{e:#}")),
                };
                writes.push(WriteAttempt {
                    name,
                    started,
                    acknowledged,
                    uid,
                    error,
                });
                progress.store(i + 1, Ordering::SeqCst);
            }
            writes
        })
    };

    // Kill in the middle of the loop, restart on the same port and database.
    let wait_progress = eventually(
        &format!("{BEFORE_KILL} writes attempted"),
        Duration::from_secs(180),
        || async { Ok(progress.load(Ordering::SeqCst) >= BEFORE_KILL) },
    )
    .await;
    if let Err(e) = wait_progress {
        recovered.store(true, Ordering::SeqCst);
        let writes = writer.await?;
        return Err(e.context(format!("writes so far: {writes:#?}")));
    }
    // Let the next kubectl get its request on the wire, then crash.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let killed_at = Instant::now();
    env.server.kill();
    let killed_after = progress.load(Ordering::SeqCst);
    // Down for a few seconds: several writes hit the outage.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let restart = env.server.restart().await;
    let restarted_at = Instant::now();
    let available = match restart {
        Ok(()) => env.wait_available().await,
        Err(e) => Err(e),
    };
    let recovered_at = Instant::now();
    recovered.store(true, Ordering::SeqCst);
    let writes = writer.await?;
    available.context("the server did not come back after the crash")?;
    eprintln!(
        "[e2e] killed after {killed_after} attempts; restarted in {:.1?}; Available again {:.1?} \
         after the kill",
        restarted_at - killed_at,
        recovered_at - killed_at
    );

    // What kube-apiserver (and our server) has now.
    let stored: BTreeMap<String, String> = POLR
        .api(&env.client, Some(ns))
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|o| (o.name_any(), o.uid().unwrap_or_default()))
        .collect();
    let direct = names(&env.direct_admin, POLR, Some(ns)).await?;
    assert_eq!(
        stored.keys().cloned().collect::<BTreeSet<_>>(),
        direct,
        "kube-apiserver and the server directly disagree"
    );

    let phase = |w: &WriteAttempt| {
        if w.started < killed_at {
            "before the kill"
        } else if w.started < recovered_at {
            "while down or recovering"
        } else {
            "after recovery"
        }
    };
    let mut summary: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    let mut lost = Vec::new();
    for w in &writes {
        let present = stored.get(&w.name);
        let outcome = match (w.acknowledged, present) {
            (true, Some(uid)) if *uid == w.uid => "acknowledged, present",
            (true, Some(_)) => {
                lost.push(format!(
                    "{}: acknowledged with uid {} but stored with {:?}",
                    w.name, w.uid, present
                ));
                "acknowledged, different uid"
            }
            (true, None) => {
                lost.push(format!("{}: acknowledged but missing", w.name));
                "acknowledged, LOST"
            }
            (false, Some(_)) => "failed, present",
            (false, None) => "failed, absent",
        };
        *summary.entry((phase(w), outcome)).or_default() += 1;
    }
    eprintln!("[e2e] {} writes: {summary:#?}", writes.len());
    let failures: Vec<String> = writes
        .iter()
        .filter(|w| !w.acknowledged)
        .map(|w| format!("{} ({}): {}", w.name, phase(w), w.error))
        .collect();
    eprintln!("[e2e] failed writes: {failures:#?}");
    let attempted: BTreeSet<&str> = writes.iter().map(|w| w.name.as_str()).collect();
    let strangers: Vec<&String> = stored
        .keys()
        .filter(|n| !attempted.contains(n.as_str()))
        .collect();

    assert!(
        lost.is_empty(),
        "acknowledged writes lost: {lost:#?}\n{}",
        env.diagnostics()
    );
    assert!(strangers.is_empty(), "objects nobody wrote: {strangers:?}");
    assert!(
        writes.len() >= TOTAL,
        "the write loop stopped early after {} attempts",
        writes.len()
    );
    let acked_before = writes
        .iter()
        .filter(|w| w.acknowledged && w.started < killed_at)
        .count();
    assert!(
        acked_before >= BEFORE_KILL - 2,
        "only {acked_before} writes succeeded before the kill: {failures:#?}"
    );
    let after: Vec<&WriteAttempt> = writes
        .iter()
        .filter(|w| w.started >= recovered_at)
        .collect();
    assert!(
        after.len() >= AFTER_RECOVERY && after.iter().all(|w| w.acknowledged),
        "writes after the server was Available again must succeed: {after:#?}"
    );
    env.stop().await
}
