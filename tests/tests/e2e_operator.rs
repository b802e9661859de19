//! The operator end to end on the real control plane (etcd + kube-apiserver +
//! kube-controller-manager), in `external` mode — the one that needs no node:
//!
//! 1. `kubectl apply -f manifests/install.yaml` (namespace, CRD, operator RBAC and Deployment;
//!    the Deployment's pod stays Pending without a node) and `--dry-run=server` of the same
//!    objects rendered by kustomize and by `helm template`.
//! 2. `reports-server serve --auth-mode delegated` next to the control plane
//!    ([`delegated::Server`]), and `reports-server operator` as a process that authenticates as
//!    the operator's ServiceAccount (a token from the TokenRequest API), so the generated
//!    least-privilege RBAC is what is exercised.
//! 3. `manifests/examples/external-server.yaml` with the test's port and CA: the three
//!    APIServices become Available, `kubectl get polr -A` is served by our server through
//!    kube-apiserver, the ReportsServer is `Ready=True` with `observedGeneration == generation`,
//!    and kstatus (`sigs.k8s.io/cli-utils`) computes `Current` for it.
//! 4. Deleting the ReportsServer removes the APIServices before the Service (which the garbage
//!    collector removes through its ownerReference) and nothing else.
//!
//! Needs what the control plane needs (Go, kubectl, openssl) plus the tools of
//! `tests/tools/build.sh` (helm, kstatus); a missing one fails with what to install.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::Api;
use reports_server_tests::{
    controlplane::{
        ControlPlane, ControlPlaneOptions, KubeconfigAuth, spawn_tied_to_test, workspace_root,
    },
    delegated::{self, API_SERVICES, Server},
    kubectl::Kubectl,
    operator::{self, NS, condition, manifest, rs_json, yaml_docs},
    server,
    tools::tool,
};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(120);

/// `kubectl apply --dry-run=server` of a YAML stream; the error says which rendering failed.
fn dry_run(admin: &Kubectl, what: &str, yaml: &str) -> Result<()> {
    let out = admin.output(&["apply", "--dry-run=server", "-f", "-"], Some(yaml))?;
    ensure!(
        out.status.success(),
        "kubectl apply --dry-run=server of {what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Runs a tool of `tests/tools/` with `obj` as JSON on stdin and returns its one JSON line.
fn judge(bin: &Path, args: &[&std::ffi::OsStr], obj: &Value) -> Result<Value> {
    let mut child = Command::new(bin)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", bin.display()))?;
    use std::io::Write as _;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(obj.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "{} failed: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// kstatus' verdict on an object.
fn kstatus(bin: &Path, obj: &Value) -> Result<String> {
    Ok(judge(bin, &[], obj)?["status"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

#[tokio::test]
async fn e2e_operator_external_mode() -> Result<()> {
    let t0 = Instant::now();
    let helm = tool("helm").await?;
    let kstatus_bin = tool("kstatus").await?;
    let bin = server::binary().context("building reports-server")?;
    let cp = ControlPlane::start(ControlPlaneOptions::with_controller_manager()).await?;
    let admin = Kubectl::new(cp.kubeconfig_path());
    let client = cp.client().await?;
    eprintln!("[e2e] control plane ready after {:.1?}", t0.elapsed());

    // 1. install.yaml for real; kustomize and helm renderings dry-run against it.
    let install = manifest("install.yaml")?;
    admin.run_with_stdin(&["apply", "--server-side", "-f", "-"], Some(&install))?;
    admin.run(&[
        "wait",
        "--for=condition=Established",
        "crd/reportsservers.reportsserver.io",
        "--timeout=60s",
    ])?;
    dry_run(&admin, "manifests/install.yaml", &install)?;
    let kustomized = admin.run(&[
        "kustomize",
        &workspace_root().join("manifests").display().to_string(),
    ])?;
    dry_run(&admin, "kubectl kustomize manifests", &kustomized)?;
    let helm_out = Command::new(&helm)
        .args(["template", "reports-server"])
        .arg(workspace_root().join("manifests/helm/reports-server"))
        .args(["--namespace", NS, "--include-crds"])
        .output()
        .context("running helm template")?;
    ensure!(
        helm_out.status.success(),
        "helm template failed: {}",
        String::from_utf8_lossy(&helm_out.stderr)
    );
    let rendered = String::from_utf8(helm_out.stdout)?;
    ensure!(
        rendered.contains("kind: Deployment")
            && rendered.contains("kind: CustomResourceDefinition")
    );
    dry_run(
        &admin,
        "helm template manifests/helm/reports-server",
        &rendered,
    )?;
    for example in [
        "sqlite.yaml",
        "postgres-managed.yaml",
        "postgres-external.yaml",
        "external-server.yaml",
    ] {
        dry_run(
            &admin,
            &format!("manifests/examples/{example}"),
            &manifest(&format!("examples/{example}"))?,
        )?;
    }
    eprintln!("[e2e] install.yaml applied; kustomize, helm and examples pass server dry-run");
    crd_refuses_mistakes(&admin)?;
    least_privilege(&admin).await?;

    // A bystander that must survive the ReportsServer's deletion.
    admin.run(&[
        "create",
        "configmap",
        "-n",
        NS,
        "bystander",
        "--from-literal=a=b",
    ])?;

    // 2. The server and the operator (as its ServiceAccount).
    let dir = cp.dir().join("reports-server");
    let server = Server::start(&cp, &dir).await?;
    let token = admin
        .run(&[
            "create",
            "token",
            "-n",
            NS,
            "reports-server-operator",
            "--duration=2h",
        ])?
        .trim()
        .to_string();
    let operator_kubeconfig =
        cp.kubeconfig_for_server("operator", cp.server_url(), KubeconfigAuth::Token(&token))?;
    let metrics_port = server::free_port();
    let log_path = cp.dir().join("logs/operator.log");
    let log = std::fs::File::create(&log_path)?;
    let mut cmd = Command::new(&bin);
    cmd.args(["operator", "--kubeconfig"])
        .arg(&operator_kubeconfig)
        .args(["--metrics-address", &format!("127.0.0.1:{metrics_port}")])
        .args(["--lease-namespace", NS, "--pod-name", "e2e-operator"])
        // As install.yaml runs it: its namespaced rights are a Role in its own namespace.
        .args(["--watch-namespace", NS])
        .args(["--progress-requeue-seconds", "1"])
        .args(["--log-format", "json"])
        .env("REPORTS_SERVER_LOG", "info,reports_server_operator=debug")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    let mut operator = spawn_tied_to_test(cmd).context("starting reports-server operator")?;
    let operator_log = || {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    };

    // 3. The example, templated with this server's port and the cluster CA.
    let mut docs = yaml_docs(&manifest("examples/external-server.yaml")?)?;
    ensure!(
        docs.len() == 1 && docs[0]["kind"] == "ReportsServer",
        "external-server.yaml: {docs:?}"
    );
    docs[0]["spec"]["external"]["port"] = json!(server.port);
    docs[0]["spec"]["external"]["caBundle"] = json!(cp.ca_pem());
    let applied = admin.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&serde_yaml::to_string(&docs[0])?),
    )?;
    ensure!(
        applied.contains("reportsserver.reportsserver.io/reports-server created"),
        "{applied}"
    );
    let t_apply = Instant::now();
    let rs = loop {
        let rs = rs_json(&admin)?;
        let ready = condition(&rs, "Ready").is_some_and(|c| c["status"] == "True");
        if ready && rs["status"]["observedGeneration"] == rs["metadata"]["generation"] {
            break rs;
        }
        if t_apply.elapsed() > TIMEOUT {
            bail!(
                "ReportsServer not Ready after {TIMEOUT:?}: {}\n--- operator log ---\n{}",
                rs["status"],
                operator_log()
            );
        }
        if let Ok(Some(status)) = operator.try_wait() {
            bail!(
                "reports-server operator exited with {status}\n{}",
                operator_log()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    eprintln!(
        "[e2e] ReportsServer Ready {:.1?} after apply",
        t_apply.elapsed()
    );
    // One reconcile in the operator's JSON log: each step under its span.
    let log = reports_server_tests::json_log::read(&log_path)?;
    let steps = reports_server_tests::json_log::steps_under(
        &log,
        "reconcile",
        ("reports_server", "reports-server"),
        &[
            "prepare_database",
            "prepare_tls",
            "claim_api_services",
            "apply_workload",
            "apply_api_services",
            "remove_turned_off",
            "publish_status",
        ],
    )
    .with_context(operator_log)?;
    for line in steps {
        eprintln!("[e2e] reconcile step: {line}");
    }
    ensure!(
        rs["status"]["database"]["type"] == "external",
        "{}",
        rs["status"]
    );
    ensure!(
        rs["metadata"]["finalizers"] == json!(["reportsserver.io/cleanup"]),
        "{}",
        rs["metadata"]
    );
    for name in API_SERVICES {
        cp.wait_apiservice_available(name, TIMEOUT).await?;
    }
    delegated::wait_apiservices_routed(&cp, &server, &client).await?;
    let table = admin.run(&["get", "rsrv", "-n", NS])?;
    ensure!(
        table.contains("READY") && table.contains("True") && table.contains("external"),
        "{table}"
    );
    ensure!(
        kstatus(&kstatus_bin, &rs)? == "Current",
        "kstatus of a Ready ReportsServer"
    );

    image_not_allowed(&admin).await?;

    // Reports through kube-apiserver, served by our server.
    admin.run(&["create", "namespace", "test-ns"])?;
    let report =
        std::fs::read_to_string(workspace_root().join("tests/fixtures/peer/report-1.yaml"))?
            .replace("namespace: default", "namespace: test-ns");
    admin.run_with_stdin(&["apply", "-f", "-"], Some(&report))?;
    let polr = admin.run(&["get", "polr", "-A"])?;
    ensure!(
        polr.contains("test-ns") && polr.contains("test-1"),
        "kubectl get polr -A:\n{polr}"
    );

    // Events record the decisions.
    let events = admin.run(&[
        "get",
        "events",
        "-n",
        NS,
        "--field-selector",
        "involvedObject.kind=ReportsServer",
    ])?;
    ensure!(events.contains("Ready"), "no Ready event:\n{events}");

    // Metrics of the operator.
    let metrics = reqwest_text(&format!("http://127.0.0.1:{metrics_port}/metrics")).await?;
    ensure!(
        metrics.contains("reports_server_operator_leader 1"),
        "{metrics}"
    );

    // A ReportsServer outside the operator's namespace: left alone, with an Event saying why.
    admin.run(&["create", "namespace", "elsewhere"])?;
    let mut foreign = docs[0].clone();
    foreign["metadata"]["namespace"] = json!("elsewhere");
    admin.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&serde_yaml::to_string(&foreign)?),
    )?;
    let t_foreign = Instant::now();
    loop {
        let events = admin.run(&[
            "get",
            "events",
            "-n",
            "elsewhere",
            "--field-selector",
            "reason=NotReconciled",
            "-o",
            "name",
        ])?;
        if !events.trim().is_empty() {
            break;
        }
        ensure!(
            t_foreign.elapsed() < Duration::from_secs(30),
            "no NotReconciled Event for a ReportsServer outside {NS}\n{}",
            operator_log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let foreign: Value = serde_json::from_str(&admin.run(&[
        "get",
        "rsrv",
        "-n",
        "elsewhere",
        "reports-server",
        "-o",
        "json",
    ])?)?;
    ensure!(
        foreign["metadata"]["finalizers"].is_null() && foreign["status"].is_null(),
        "a ReportsServer outside {NS} was reconciled: {foreign:#}"
    );
    admin.run(&["delete", "rsrv", "-n", "elsewhere", "reports-server"])?;
    eprintln!(
        "[e2e] a ReportsServer outside {NS} is not reconciled: Event after {:.1?}",
        t_foreign.elapsed()
    );

    // 4. Deletion: APIServices first, then the Service (garbage collector), nothing else.
    let apis: Api<APIService> = Api::all(client.clone());
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    admin.run(&["delete", "rsrv", "-n", NS, "reports-server", "--wait=false"])?;
    let t_delete = Instant::now();
    let (mut apis_gone, mut svc_gone) = (None, None);
    while apis_gone.is_none() || svc_gone.is_none() {
        let mut all_gone = true;
        for name in API_SERVICES {
            all_gone &= apis.get_opt(name).await?.is_none();
        }
        if all_gone && apis_gone.is_none() {
            apis_gone = Some(t_delete.elapsed());
        }
        if svc_gone.is_none() && services.get_opt("reports-server").await?.is_none() {
            svc_gone = Some(t_delete.elapsed());
            ensure!(
                apis_gone.is_some(),
                "the Service went before the APIServices"
            );
        }
        if t_delete.elapsed() > TIMEOUT {
            bail!(
                "after {TIMEOUT:?}: APIServices gone {apis_gone:?}, Service gone {svc_gone:?}\n{}",
                operator_log()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("[e2e] deletion: APIServices gone after {apis_gone:?}, Service after {svc_gone:?}");
    let out = admin.output(&["get", "rsrv", "-n", NS, "reports-server"], None)?;
    ensure!(!out.status.success(), "the ReportsServer still exists");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    ensure!(
        cms.get_opt("bystander").await?.is_some(),
        "the bystander ConfigMap was deleted"
    );
    admin.run(&["get", "namespace", NS, "test-ns"])?;
    admin.run(&["get", "crd", "reportsservers.reportsserver.io"])?;
    admin.run(&["get", "clusterrole", "reports-server-operator"])?;

    let _ = operator.kill();
    let _ = operator.wait();
    drop(server);
    cp.stop().await?;
    eprintln!(
        "[e2e] e2e_operator_external_mode passed in {:.1?}",
        t0.elapsed()
    );
    Ok(())
}

/// A plain-HTTP GET through kube's hyper stack would need a client; curl is simpler and is on
/// every build machine with the control plane.
async fn reqwest_text(url: &str) -> Result<String> {
    let out = tokio::process::Command::new("curl")
        .args(["-sSf", url])
        .output()
        .await
        .context("running curl (install curl)")?;
    ensure!(
        out.status.success(),
        "curl {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// ReportsServer objects in each state, as the operator writes them.
fn rs_in_state(generation: i64, observed: Option<i64>, outcome: &str) -> Value {
    let cond = |t: &str, s: bool, reason: &str| {
        json!({"type": t, "status": if s { "True" } else { "False" }, "reason": reason, "message": reason,
               "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": observed})
    };
    let conditions = match outcome {
        "ready" => vec![
            cond("Ready", true, "Ready"),
            cond("Reconciling", false, "Ready"),
            cond("Stalled", false, "Ready"),
            cond("Degraded", false, "Ready"),
        ],
        "progressing" => vec![
            cond("Ready", false, "WaitingForPods"),
            cond("Reconciling", true, "WaitingForPods"),
            cond("Stalled", false, "Progressing"),
            cond("Degraded", false, "Progressing"),
        ],
        "degraded" => vec![
            cond("Ready", false, "DatabaseSecretMissing"),
            cond("Reconciling", false, "DatabaseSecretMissing"),
            cond("Stalled", true, "DatabaseSecretMissing"),
            cond("Degraded", true, "DatabaseSecretMissing"),
        ],
        _ => vec![],
    };
    let mut rs = json!({"apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
        "metadata": {"name": format!("{outcome}-{generation}-{observed:?}"), "namespace": NS, "generation": generation},
        "spec": {}});
    if outcome != "none" {
        rs["status"] = json!({"observedGeneration": observed, "conditions": conditions});
    }
    rs
}

/// (object, Argo CD health, kstatus status) for every state the operator can write. kstatus
/// calls an object without any status `Current` (it cannot know a controller will write one),
/// so the state before the operator's first reconcile has no kstatus expectation; see
/// docs/operator.md.
fn judged_states() -> Vec<(Value, &'static str, Option<&'static str>)> {
    vec![
        (rs_in_state(1, None, "none"), "Progressing", None),
        (rs_in_state(2, Some(2), "ready"), "Healthy", Some("Current")),
        (
            rs_in_state(3, Some(2), "ready"),
            "Progressing",
            Some("InProgress"),
        ),
        (
            rs_in_state(2, Some(2), "progressing"),
            "Progressing",
            Some("InProgress"),
        ),
        (
            rs_in_state(2, Some(2), "degraded"),
            "Degraded",
            Some("Failed"),
        ),
    ]
}

/// kstatus (cli-utils v0.37.2) on every state the operator writes.
#[tokio::test]
async fn kstatus_judges_reportsserver_statuses() -> Result<()> {
    let bin = tool("kstatus").await?;
    for (obj, _, want) in judged_states() {
        let Some(want) = want else { continue };
        let got = kstatus(&bin, &obj)?;
        ensure!(
            got == want,
            "kstatus of {}: {got}, want {want}\n{obj:#}",
            obj["metadata"]["name"]
        );
    }
    Ok(())
}

/// Argo CD's own Lua runner (argo-cd v3.6.1 util/lua) on manifests/argocd/health.lua.
#[tokio::test]
async fn argocd_health_lua_judges_reportsserver_statuses() -> Result<()> {
    let bin = tool("argocd").await?;
    let script = workspace_root().join("manifests/argocd/health.lua");
    for (obj, want, _) in judged_states() {
        let line = judge(&bin, &[script.as_os_str()], &obj)?;
        ensure!(
            line["status"] == want,
            "Argo CD health of {}: {line}, want {want}",
            obj["metadata"]["name"]
        );
    }
    Ok(())
}

/// `kubectl auth can-i` as `user`: true for "yes".
/// Specs that cannot work are refused by kube-apiserver at apply time (the CRD's CEL rules and
/// enums), each with a message naming the field and what to do.
fn crd_refuses_mistakes(admin: &Kubectl) -> Result<()> {
    let cases = [
        (
            json!({"replicas": 3}),
            "SQLite (the default database) is one file only one pod may open",
        ),
        (
            json!({"replicas": 2, "database": {"sqlite": {}}}),
            "set spec.replicas to 1, or use spec.database.postgres",
        ),
        (
            json!({"database": {"sqlite": {}, "postgres": {"managed": {}}}}),
            "set only one of spec.database.sqlite and spec.database.postgres",
        ),
        (
            json!({"database": {"postgres": {}}}),
            "set exactly one of spec.database.postgres.managed and spec.database.postgres.external",
        ),
        (
            json!({"database": {"postgres": {"external": {}}}}),
            "secretName must name the Secret",
        ),
        (
            json!({"external": {"host": "h", "port": 443}, "database": {"sqlite": {}}}),
            "spec.external runs the server outside the cluster",
        ),
        (
            json!({"imagePullPolicy": "Sometimes"}),
            "supported values: \"Always\", \"IfNotPresent\", \"Never\"",
        ),
        (
            json!({"aggregation": {"layout": "flat"}}),
            "spec.aggregation.layout",
        ),
        (
            json!({"aggregation": {"delay": "soon"}}),
            "spec.aggregation.delay",
        ),
        (
            json!({"apiServices": {"groupPriorityMinimum": 0}}),
            "spec.apiServices.groupPriorityMinimum",
        ),
    ];
    for (spec, wanted) in cases {
        let rs = json!({"apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
            "metadata": {"name": "mistake", "namespace": NS}, "spec": spec});
        let out = admin.output(
            &["apply", "--dry-run=server", "-f", "-"],
            Some(&rs.to_string()),
        )?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(
            !out.status.success() && stderr.contains(wanted),
            "spec {spec} was {} (wanted a refusal saying {wanted:?}): {stderr}",
            if out.status.success() {
                "accepted"
            } else {
                "refused differently"
            }
        );
    }
    for spec in [
        json!({}),
        json!({"replicas": 1, "database": {"sqlite": {}}}),
        json!({"replicas": 3, "database": {"postgres": {"managed": {}}}}),
        json!({"replicas": 2, "database": {"postgres": {"external": {"secretName": "db"}}}}),
        json!({"external": {"host": "h", "port": 443}, "replicas": 1}),
        json!({"aggregation": {"delay": "500ms", "layout": "per-policy"}}),
    ] {
        let rs = json!({"apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
            "metadata": {"name": "fine", "namespace": NS}, "spec": spec});
        dry_run(
            admin,
            &format!("a ReportsServer with spec {spec}"),
            &rs.to_string(),
        )?;
    }
    eprintln!(
        "[e2e] the CRD refuses 10 broken specs with their rule's message, accepts 6 good ones"
    );
    Ok(())
}

/// A ReportsServer naming an image outside `--allowed-server-images` runs nothing: `Stalled`
/// with reason `ImageNotAllowed`, and no workload is created.
async fn image_not_allowed(admin: &Kubectl) -> Result<()> {
    let rs = json!({"apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
        "metadata": {"name": "imposter", "namespace": NS},
        "spec": {"image": "registry.example/someone/else:1"}});
    admin.run_with_stdin(&["apply", "-f", "-"], Some(&rs.to_string()))?;
    let deadline = Instant::now() + TIMEOUT;
    let message = loop {
        let live: Value = serde_json::from_str(
            &admin.run(&["get", "rsrv", "-n", NS, "imposter", "-o", "json"])?,
        )?;
        if let Some(c) = condition(&live, "Stalled").filter(|c| c["reason"] == "ImageNotAllowed") {
            break c["message"].as_str().unwrap_or_default().to_string();
        }
        ensure!(
            Instant::now() < deadline,
            "imposter not Stalled/ImageNotAllowed after {TIMEOUT:?}: {}",
            live["status"]
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    ensure!(
        message.contains("--allowed-server-images"),
        "the message does not say how to allow it: {message}"
    );
    let workloads = admin.run(&[
        "get",
        "deploy,sts,svc",
        "-n",
        NS,
        "-l",
        "app.kubernetes.io/instance=imposter",
        "-o",
        "name",
    ])?;
    ensure!(
        workloads.trim().is_empty(),
        "objects created for imposter: {workloads}"
    );
    let table = admin.run(&["get", "rsrv", "-n", NS, "imposter"])?;
    ensure!(
        table.contains("ImageNotAllowed"),
        "the REASON column: {table}"
    );
    admin.run(&[
        "delete",
        "rsrv",
        "-n",
        NS,
        "imposter",
        "--wait=true",
        "--timeout=60s",
    ])?;
    eprintln!("[e2e] spec.image outside --allowed-server-images: Stalled: {message}");
    Ok(())
}

/// `helm upgrade` from the chart that shipped the CRD in `crds/` (which Helm never updates) to
/// today's, with the CRD in `templates/`: the documented `--take-ownership` adopts the CRD and
/// updates it, so a field the old CRD lacked is accepted afterwards; every value of the new chart
/// set at once renders objects kube-apiserver accepts; and `helm uninstall` keeps the CRD.
#[tokio::test]
async fn helm_upgrade_updates_the_crd() -> Result<()> {
    let helm = tool("helm").await?;
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
    let admin = Kubectl::new(cp.kubeconfig_path());
    let old_chart = workspace_root().join("tests/fixtures/helm-chart-0.1.0-crds-dir");
    let new_chart = workspace_root().join("manifests/helm/reports-server");
    let ns = "helm-upgrade";
    let run_helm = |args: &[&str]| operator::helm(&helm, cp.kubeconfig_path(), args);
    let old = old_chart.display().to_string();
    let new = new_chart.display().to_string();
    run_helm(&[
        "install",
        "reports-server",
        &old,
        "-n",
        ns,
        "--create-namespace",
    ])?;
    let rs = json!({"apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
        "metadata": {"name": "pulls", "namespace": ns},
        "spec": {"imagePullSecrets": [{"name": "registry"}]}});
    let before = admin.output(
        &["apply", "--dry-run=server", "--validate=strict", "-f", "-"],
        Some(&rs.to_string()),
    )?;
    ensure!(
        !before.status.success()
            && String::from_utf8_lossy(&before.stderr).contains("imagePullSecrets"),
        "the old CRD should not know spec.imagePullSecrets: {}",
        String::from_utf8_lossy(&before.stderr)
    );
    run_helm(&[
        "upgrade",
        "reports-server",
        &new,
        "-n",
        ns,
        "--take-ownership",
    ])?;
    dry_run(
        &admin,
        "a ReportsServer with spec.imagePullSecrets after the upgrade",
        &rs.to_string(),
    )?;
    let crd: Value = serde_json::from_str(&admin.run(&[
        "get",
        "crd",
        "reportsservers.reportsserver.io",
        "-o",
        "json",
    ])?)?;
    ensure!(
        crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
            && crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == "reports-server",
        "the CRD was not adopted by the release: {}",
        crd["metadata"]
    );
    // Every value at once.
    let values = r#"
imagePullSecrets: [{name: registry}]
nodeSelector: {kubernetes.io/os: linux}
tolerations: [{key: dedicated, operator: Equal, value: platform, effect: NoSchedule}]
affinity: {nodeAffinity: {preferredDuringSchedulingIgnoredDuringExecution: [{weight: 1, preference: {matchExpressions: [{key: kubernetes.io/arch, operator: In, values: [amd64]}]}}]}}
topologySpreadConstraints: [{maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: ScheduleAnyway, labelSelector: {matchLabels: {app.kubernetes.io/name: reports-server-operator}}}]
priorityClassName: system-node-critical
replicas: 2
extraArgs: ["--allowed-server-images=ghcr.io/acme/reports-server"]
podIds: platform
networkPolicy: {enabled: true, serverFrom: [{ipBlock: {cidr: 10.0.0.0/8}}], metricsFrom: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}]}
"#;
    let values_file = cp.dir().join("all-values.yaml");
    std::fs::write(&values_file, values)?;
    let rendered = run_helm(&[
        "template",
        "reports-server",
        &new,
        "-n",
        ns,
        "-f",
        &values_file.display().to_string(),
    ])?;
    for wanted in [
        "imagePullSecrets:",
        "kubernetes.io/os: linux",
        "dedicated",
        "nodeAffinity",
        "topologySpreadConstraints",
        "priorityClassName: \"system-node-critical\"",
        "--allowed-server-images=ghcr.io/acme/reports-server",
        "value: \"platform\"",
        "kind: NetworkPolicy",
        "cidr: 10.0.0.0/8",
        "kubernetes.io/metadata.name: monitoring",
    ] {
        ensure!(
            rendered.contains(wanted),
            "helm template with every value lacks {wanted:?}"
        );
    }
    dry_run(&admin, "helm template with every value set", &rendered)?;
    run_helm(&["uninstall", "reports-server", "-n", ns, "--wait"])?;
    admin
        .run(&["get", "crd", "reportsservers.reportsserver.io"])
        .context("helm uninstall deleted the CRD (helm.sh/resource-policy: keep)")?;
    eprintln!(
        "[e2e] helm upgrade --take-ownership from the crds/ chart updated the CRD; every value \
         renders and passes a server-side dry-run; helm uninstall kept the CRD"
    );
    Ok(())
}

fn can_i(admin: &Kubectl, user: &str, args: &[&str]) -> Result<bool> {
    let mut all = vec!["auth", "can-i"];
    all.extend_from_slice(args);
    all.extend(["--as", user]);
    let out = admin.output(&all, None)?;
    let answer = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    ensure!(
        answer == "yes" || answer == "no",
        "kubectl auth can-i {args:?} --as {user}: {answer:?} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(answer == "yes")
}

/// The shipped roles as kube-apiserver evaluates them: neither account reads Secrets anywhere,
/// the operator cannot escalate and binds only the server's roles, and the aggregated server
/// role holds what its labelled parts grant once kube-controller-manager has aggregated them.
async fn least_privilege(admin: &Kubectl) -> Result<()> {
    let operator = format!("system:serviceaccount:{NS}:reports-server-operator");
    let server = format!("system:serviceaccount:{NS}:reports-server");
    // A server's binding as the operator writes it, for a ServiceAccount that needs no pod.
    admin.run(&[
        "create",
        "clusterrolebinding",
        "e2e-server-rights",
        "--clusterrole=reports-server",
        &format!("--serviceaccount={NS}:reports-server"),
    ])?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !can_i(admin, &server, &["get", "pods", "-A"])? {
        ensure!(
            Instant::now() < deadline,
            "the aggregated ClusterRole reports-server never granted get pods (is the clusterrole-aggregation controller running?)"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for (user, what) in [
        (&operator, &["get", "secrets", "-A"][..]),
        (&server, &["get", "secrets", "-A"]),
        (&server, &["list", "secrets", "-n", NS]),
        (&operator, &["escalate", "clusterroles"]),
        (&operator, &["bind", "clusterroles/cluster-admin"]),
        (&operator, &["create", "clusterroles"]),
        (&operator, &["get", "secrets", "-n", "kube-system"]),
        (&server, &["delete", "customresourcedefinitions"]),
        (&server, &["patch", "apiservices"]),
    ] {
        ensure!(!can_i(admin, user, what)?, "{user} may {what:?}");
    }
    for (user, what) in [
        (&operator, &["get", "secrets", "-n", NS][..]),
        (&operator, &["bind", "clusterroles/reports-server"]),
        (
            &operator,
            &["bind", "clusterroles/reports-server:migration"],
        ),
        (&server, &["create", "tokenreviews"]),
        // (Kyverno's CRDs are not installed here, and kubectl can only ask about kinds it knows.)
        (
            &server,
            &[
                "watch",
                "validatingadmissionpolicies.admissionregistration.k8s.io",
            ],
        ),
        (&server, &["get", "deployments.apps", "-A"]),
    ] {
        ensure!(can_i(admin, user, what)?, "{user} may not {what:?}");
    }
    admin.run(&["delete", "clusterrolebinding", "e2e-server-rights"])?;
    eprintln!("[e2e] least privilege: no Secret read, no escalate, bind only on the shipped roles");
    Ok(())
}
