//! Every way users remove reports-server ends clean, on a real node (`tests/src/node.rs`).
//!
//! Each path installs as a user does (`manifests/install.yaml` or the Helm chart, then
//! `manifests/examples/sqlite.yaml`), writes reports through kube-apiserver, removes everything
//! the way that path does, and then asserts within 120 s of the removal's start:
//!
//! - the three APIServices are gone or `Local` (none routes to a missing Service), and
//!   `kubectl api-resources` answers without an error;
//! - the namespace is gone (nothing stuck in Terminating, no finalizer left);
//! - no object of ours is left anywhere (listed: APIServices, ClusterRoleBindings, the
//!   RoleBinding in kube-system, ReportsServers);
//! - the reports are where `docs/operator.md` (Uninstall) says that path leaves them: the operator
//!   cannot hand them back in any of these paths, so they stay in the database, here the SQLite
//!   file on the retained volume.
//!
//! The paths: `kubectl delete -f manifests/install.yaml`; `kubectl delete namespace`;
//! `helm uninstall` (then the namespace); the operator's Deployment deleted before the
//! ReportsServer (then the namespace); and every object deleted at once with foreground
//! propagation, as Argo CD deletes an Application's resources.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use reports_server_tests::{
    controlplane::{run_cache_build_script, workspace_root},
    delegated::API_SERVICES,
    kubectl::Kubectl,
    node::{self, Node, RunDir},
    operator::{self, NS, condition, manifest, rs_json, yaml_docs},
};
use serde_json::Value;

const READY_TIMEOUT: Duration = Duration::from_secs(240);
/// What the issue allows each path.
const CLEAN_WITHIN: Duration = Duration::from_secs(120);
const REPORTS: usize = 10;
const OPERATOR: &str = "reports-server-operator";

#[test]
fn every_uninstall_path_ends_clean() {
    node::run_isolated("every_uninstall_path_ends_clean", |run| async move {
        let node = Node::start(&run).await?;
        let result = paths(&node, &run).await;
        if let Err(e) = &result {
            eprintln!("[e2e_uninstall_node] FAILED: {e:#}\n{}", node.diagnostics());
        }
        node.stop().await?;
        result
    });
}

async fn paths(node: &Node, run: &RunDir) -> Result<()> {
    let kubectl = Kubectl::new(node.cp().kubeconfig_path());
    let helm = run_cache_build_script("tests/tools/helm.sh", "helm").await?;
    let mut summary = Vec::new();
    for (i, path) in [
        Removal::DeleteInstallYaml,
        Removal::DeleteNamespace,
        Removal::HelmUninstall,
        Removal::OperatorFirst,
        Removal::AllAtOnce,
    ]
    .into_iter()
    .enumerate()
    {
        let volume = run.path().join(format!("node/pv/uninstall-{i}"));
        install(node, &kubectl, &helm, path, &volume, i).await?;
        // The operator's log, held open so that it can be read after its pod is gone: what the
        // operator decided on its way out is the point.
        let logs = open_pod_logs(node, &format!("{NS}_{OPERATOR}-"));
        let t = Instant::now();
        let outcome = async {
            remove(&kubectl, &helm, path).await?;
            wait_clean(&kubectl, path, t).await
        }
        .await;
        let took = match outcome {
            Ok(took) => took,
            Err(e) => {
                let state: Vec<String> = [
                    vec!["get", "namespace", NS, "-o", "yaml"],
                    vec!["get", "rsrv", "-A", "-o", "yaml"],
                    vec!["get", "pods", "-A", "-o", "wide"],
                    vec!["get", "events", "-n", NS],
                ]
                .iter()
                .map(|args| kubectl.run(args).unwrap_or_else(|e| format!("{e:#}")))
                .collect();
                return Err(e.context(format!(
                    "--- namespace, ReportsServers, pods, events ---\n{}\n--- operator log ---\n{}",
                    state.join("\n"),
                    read_all(logs)
                )));
            }
        };
        let kept = reports_in_sqlite(&volume)?;
        ensure!(
            kept == REPORTS,
            "{path:?}: {kept} of the {REPORTS} reports are in the database on the retained volume"
        );
        eprintln!(
            "[e2e_uninstall_node] {path:?}: clean {took:.1?} after the removal began; \
             {kept} reports stay in the database"
        );
        summary.push(format!("{path:?} {took:.1?}"));
        reset(&kubectl)?;
    }
    eprintln!("[e2e_uninstall_node] {}", summary.join(", "));
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Removal {
    DeleteInstallYaml,
    DeleteNamespace,
    HelmUninstall,
    OperatorFirst,
    AllAtOnce,
}

/// The operator (install.yaml, or the chart for the Helm path), a SQLite ReportsServer on a
/// retained host-path volume, Ready, with [`REPORTS`] reports written through kube-apiserver.
async fn install(
    node: &Node,
    kubectl: &Kubectl,
    helm: &Path,
    path: Removal,
    volume: &Path,
    i: usize,
) -> Result<()> {
    let t = Instant::now();
    if path == Removal::HelmUninstall {
        let image = operator::install_image()?;
        node.tag_image(node::REPORTS_SERVER_IMAGE, &image)?;
        let chart = workspace_root().join("manifests/helm/reports-server");
        operator::helm(
            helm,
            node.cp().kubeconfig_path(),
            &[
                "install",
                "reports-server",
                &chart.display().to_string(),
                "--namespace",
                NS,
                "--create-namespace",
            ],
        )?;
    } else {
        operator::install_on_node(node, kubectl)?;
    }
    kubectl.run(&[
        "rollout",
        "status",
        "-n",
        NS,
        &format!("deployment/{OPERATOR}"),
        "--timeout=180s",
    ])?;
    std::fs::create_dir_all(volume)?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(volume, std::fs::Permissions::from_mode(0o1777))?;
    }
    kubectl.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&format!(
            "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: uninstall-{i}}}\nspec:\n  \
             capacity: {{storage: 10Gi}}\n  accessModes: [ReadWriteOnce]\n  \
             persistentVolumeReclaimPolicy: Retain\n  hostPath: {{path: \"{}\", type: Directory}}\n",
            volume.display()
        )),
    )?;
    kubectl.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&manifest("examples/sqlite.yaml")?),
    )?;
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let rs = rs_json(kubectl).unwrap_or(Value::Null);
        if condition(&rs, "Ready").is_some_and(|c| c["status"] == "True") {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "{path:?}: the ReportsServer is not Ready after {READY_TIMEOUT:?}: {}",
            rs["status"]
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut yaml = String::new();
    for n in 0..REPORTS {
        yaml.push_str(&format!(
            "---\napiVersion: wgpolicyk8s.io/v1alpha2\nkind: PolicyReport\nmetadata: {{name: uninstall-{n}, namespace: default}}\n\
             summary: {{pass: 1, fail: 0, warn: 0, error: 0, skip: 0}}\nresults:\n\
             - {{policy: e2e, rule: uninstall, result: pass, source: e2e, timestamp: {{seconds: 1700000000, nanos: 0}}}}\n"
        ));
    }
    kubectl.run_with_stdin(&["create", "-f", "-"], Some(&yaml))?;
    eprintln!(
        "[e2e_uninstall_node] {path:?}: installed, Ready, {REPORTS} reports written in {:.1?}",
        t.elapsed()
    );
    Ok(())
}

/// Removes reports-server the way `path` does.
async fn remove(kubectl: &Kubectl, helm: &Path, path: Removal) -> Result<()> {
    let timeout = format!("--timeout={}s", CLEAN_WITHIN.as_secs());
    match path {
        Removal::DeleteInstallYaml => {
            kubectl.run_with_stdin(
                &["delete", "-f", "-", &timeout],
                Some(&manifest("install.yaml")?),
            )?;
        }
        Removal::DeleteNamespace => {
            kubectl.run(&["delete", "namespace", NS, &timeout])?;
        }
        Removal::HelmUninstall => {
            // Without --wait, as users run it: helm 4 waits for every deleted object's watch
            // to report it gone, which outlasts its own timeout here.
            operator::helm(
                helm,
                kubectl.kubeconfig(),
                &["uninstall", "reports-server", "--namespace", NS],
            )?;
            released(kubectl, path).await?;
            kubectl.run(&["delete", "namespace", NS, &timeout])?;
        }
        Removal::OperatorFirst => {
            kubectl.run(&[
                "delete",
                "deployment",
                "-n",
                NS,
                OPERATOR,
                "--wait=true",
                &timeout,
            ])?;
            released(kubectl, path).await?;
            // On its way out the operator took the groups off its servers (docs/operator.md,
            // Uninstall): nothing routes to a Service that the deletions below remove.
            for name in API_SERVICES {
                let out = kubectl.output(&["get", "apiservice", name, "-o", "json"], None)?;
                if out.status.success() {
                    let a: Value = serde_json::from_slice(&out.stdout)?;
                    ensure!(
                        a["spec"]["service"].is_null(),
                        "{path:?}: APIService {name} still routes to {} after the operator left",
                        a["spec"]["service"]
                    );
                }
            }
            kubectl.run(&["delete", "rsrv", "-n", NS, "reports-server", &timeout])?;
            kubectl.run(&["delete", "namespace", NS, &timeout])?;
        }
        Removal::AllAtOnce => {
            // Argo CD deletes an Application's resources together, with foreground propagation.
            let mut all = manifest("install.yaml")?;
            all.push_str("---\n");
            all.push_str(&manifest("examples/sqlite.yaml")?);
            let docs = yaml_docs(&all)?;
            let mut stream = String::new();
            for d in docs.iter().rev() {
                stream.push_str("---\n");
                stream.push_str(&serde_yaml::to_string(d)?);
            }
            kubectl.run_with_stdin(
                &["delete", "-f", "-", "--cascade=foreground", "--wait=false"],
                Some(&stream),
            )?;
        }
    }
    Ok(())
}

/// With the operator gone but the ReportsServer still there, the operator has removed its
/// finalizer on its way out (and said so in an Event).
async fn released(kubectl: &Kubectl, path: Removal) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pods = kubectl.run(&[
            "get",
            "pods",
            "-n",
            NS,
            "-l",
            &format!("app.kubernetes.io/name={OPERATOR}"),
            "-o",
            "name",
        ])?;
        if pods.trim().is_empty() {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "{path:?}: the operator pod is still there: {pods}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let rs = rs_json(kubectl)?;
    ensure!(
        rs["metadata"]["finalizers"]
            .as_array()
            .is_none_or(Vec::is_empty),
        "{path:?}: the stopped operator left its finalizer: {}",
        rs["metadata"]
    );
    let events = kubectl.run(&[
        "get",
        "events",
        "-n",
        NS,
        "--field-selector",
        "reason=ReleasedOnUninstall",
        "-o",
        "name",
    ])?;
    ensure!(
        !events.trim().is_empty(),
        "{path:?}: no ReleasedOnUninstall Event"
    );
    Ok(())
}

/// Waits until nothing of ours is left and discovery is whole; returns how long it took.
async fn wait_clean(kubectl: &Kubectl, path: Removal, started: Instant) -> Result<Duration> {
    loop {
        let left = leftovers(kubectl)?;
        let discovery = kubectl.output(&["api-resources", "-o", "name"], None)?;
        let discovery_ok = discovery.status.success()
            && !String::from_utf8_lossy(&discovery.stderr).contains("unable to retrieve");
        if left.is_empty() && discovery_ok {
            return Ok(started.elapsed());
        }
        if started.elapsed() > CLEAN_WITHIN {
            bail!(
                "{path:?}: not clean {CLEAN_WITHIN:?} after the removal began: {left:#?}; \
                 kubectl api-resources: {}",
                String::from_utf8_lossy(&discovery.stderr)
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// What of ours is still there: the namespace, APIServices routed to a Service (or carrying our
/// owner annotation), the installation's ClusterRoleBindings and kube-system RoleBinding,
/// ReportsServers anywhere.
fn leftovers(kubectl: &Kubectl) -> Result<Vec<String>> {
    let mut left = Vec::new();
    let ns = kubectl.output(&["get", "namespace", NS, "-o", "json"], None)?;
    if ns.status.success() {
        let ns: Value = serde_json::from_slice(&ns.stdout)?;
        left.push(format!(
            "namespace {NS} ({}, finalizers {})",
            ns["status"]["phase"], ns["spec"]["finalizers"]
        ));
    }
    for name in API_SERVICES {
        let out = kubectl.output(&["get", "apiservice", name, "-o", "json"], None)?;
        if !out.status.success() {
            continue;
        }
        let a: Value = serde_json::from_slice(&out.stdout)?;
        if !a["spec"]["service"].is_null()
            || !a["metadata"]["annotations"]["reportsserver.io/owner"].is_null()
        {
            left.push(format!("APIService {name} -> {}", a["spec"]["service"]));
        }
    }
    let managed = "app.kubernetes.io/managed-by=reports-server-operator";
    for (what, args) in [
        (
            "ClusterRoleBinding",
            vec!["get", "clusterrolebindings", "-l", managed, "-o", "name"],
        ),
        (
            "RoleBinding in kube-system",
            vec![
                "get",
                "rolebindings",
                "-n",
                "kube-system",
                "-l",
                managed,
                "-o",
                "name",
            ],
        ),
    ] {
        for name in kubectl.run(&args)?.lines().filter(|l| !l.is_empty()) {
            left.push(format!("{what} {name}"));
        }
    }
    // Without the CRD (deleted with install.yaml) there can be no ReportsServer.
    let rs = kubectl.output(&["get", "rsrv", "-A", "-o", "name"], None)?;
    if rs.status.success() {
        for name in String::from_utf8_lossy(&rs.stdout)
            .lines()
            .filter(|l| !l.is_empty())
        {
            left.push(format!("ReportsServer {name}"));
        }
    }
    Ok(left)
}

/// The container log files of the pods whose log directory starts with `prefix`, opened now.
fn open_pod_logs(node: &Node, prefix: &str) -> Vec<std::fs::File> {
    fn walk(dir: &Path, out: &mut Vec<std::fs::File>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if let Ok(f) = std::fs::File::open(&p) {
                out.push(f);
            }
        }
    }
    let mut files = Vec::new();
    for e in std::fs::read_dir(node.dir().join("pod-logs"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if e.file_name().to_string_lossy().starts_with(prefix) {
            walk(&e.path(), &mut files);
        }
    }
    files
}

fn read_all(files: Vec<std::fs::File>) -> String {
    use std::io::Read as _;
    let mut out = String::new();
    for mut f in files {
        let _ = f.read_to_string(&mut out);
    }
    out
}

/// Live (not deleted) reports named `uninstall-*` in the SQLite database the server left on
/// its volume.
fn reports_in_sqlite(volume: &Path) -> Result<usize> {
    let script = r#"
import glob, os, sqlite3, sys
files = [f for f in glob.glob(os.path.join(sys.argv[1], "**", "*"), recursive=True)
         if os.path.isfile(f) and open(f, "rb").read(16) == b"SQLite format 3\x00"]
if len(files) != 1:
    sys.exit("want one SQLite database under %s, found %s" % (sys.argv[1], files))
db = sqlite3.connect(files[0])
print(db.execute("select count(*) from objects where name like 'uninstall-%' and deleted_at is null").fetchone()[0])
"#;
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(volume)
        .output()
        .context("running python3 (apt-get install python3) to read the SQLite file")?;
    ensure!(
        out.status.success(),
        "reading the database on the volume: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

/// Between paths: what a path leaves on purpose (the install-level objects after a namespace
/// deletion, the CRD Helm keeps) goes, so the next path starts from an empty cluster.
fn reset(kubectl: &Kubectl) -> Result<()> {
    kubectl.run_with_stdin(
        &["delete", "-f", "-", "--ignore-not-found", "--timeout=120s"],
        Some(&manifest("install.yaml")?),
    )?;
    kubectl
        .run(&[
            "delete",
            "policyreports",
            "-n",
            "default",
            "--all",
            "--ignore-not-found",
        ])
        .ok();
    Ok(())
}
