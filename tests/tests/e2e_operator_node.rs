//! The operator's in-cluster modes on a real node (`tests/src/node.rs`: kubelet + containerd
//! running our image), installed the way a user installs them: `kubectl apply` of
//! `manifests/install.yaml` and then of an unmodified example from `manifests/examples/`. The
//! locally built images are tagged with the references those files name
//! (`reports-server:<version>`, the managed PostgreSQL image), so nothing is pulled. Services are
//! reached by DNS name and ClusterIP through the harness' Service network
//! (`tests/src/service_net.rs`).
//!
//! One isolated run covers, in order:
//!
//! 1. **install**: the operator's Deployment becomes Available (in-cluster client, its RBAC),
//!    in a namespace enforcing the restricted Pod Security Standard, which every pod below
//!    (servers, the managed PostgreSQL) passes;
//! 2. **sqlite** (`sqlite.yaml`): the StatefulSet's pod is Ready, the three APIServices are
//!    Available with the operator's CA as `caBundle`, reports are written and read through
//!    kube-apiserver, the live objects match `operator/tests/golden/sqlite.yaml`, and deleting
//!    the pod loses no report;
//! 3. **postgres.managed** (`postgres-managed.yaml`, 2 replicas on the operator's PostgreSQL
//!    StatefulSet): as above, then a spec change that rolls the Deployment while a client polls
//!    `GET /apis/wgpolicyk8s.io/v1alpha2` every 100 ms: no request may fail; then a new serving
//!    certificate (the Secret deleted, the operator issues another) is served by both running
//!    pods without a restart, again with no failed request;
//! 4. **postgres.external** (`postgres-external.yaml` against a PostgreSQL with TLS that the test
//!    runs as "the user's database"): a Secret without the `database` key gives `Degraded=True`
//!    naming the Secret and the key; adding the key returns to `Ready` with nothing restarted by
//!    hand;
//!
//! and between the modes, deleting the ReportsServer hands every report back to CRD storage
//! (`spec.migration.handBackOnDelete`, the default: the report CRDs are installed by the server,
//! the APIServices become Local again) and the garbage collector removes everything it owned;
//! the next mode then finds the reports in etcd and migrates them in (`spec.migration`): the same
//! reports with the same uids, `status.migration` complete.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, ensure};
use base64::Engine as _;
use reports_server_tests::{
    controlplane::workspace_root,
    delegated::{API_SERVICES, raw},
    kube_client_with_retries,
    kubectl::Kubectl,
    node::{self, ApiPoller, Node, POSTGRES_IMAGE, RunDir},
    operator::{
        self, NS, condition, create_volumes, is_ready, manifest, rs_json, wait_condition, yaml_docs,
    },
};
use serde_json::{Value, json};

/// Where the test's reports live.
const REPORTS_NS: &str = "default";
const READY_TIMEOUT: Duration = Duration::from_secs(240);
const POLL_EVERY: Duration = Duration::from_millis(100);
/// Labels of the server pods the operator creates for the ReportsServer `reports-server`.
const SERVER_PODS: &str =
    "app.kubernetes.io/name=reports-server,app.kubernetes.io/instance=reports-server";

#[test]
fn operator_in_cluster_modes() {
    node::run_isolated("operator_in_cluster_modes", |run| async move {
        in_cluster(run).await
    });
}

async fn in_cluster(run: RunDir) -> Result<()> {
    let t0 = Instant::now();
    let node = Node::start(&run).await?;
    let result = modes(&node, &run).await;
    if let Err(e) = &result {
        eprintln!("[e2e_operator_node] FAILED: {e:#}\n{}", node.diagnostics());
        let kubectl = Kubectl::new(node.cp().kubeconfig_path());
        if let Ok(out) = kubectl.run(&[
            "get",
            "rsrv,pods,pvc,svc,endpointslices",
            "-n",
            NS,
            "-o",
            "wide",
        ]) {
            eprintln!("{out}");
        }
        if let Ok(out) = kubectl.run(&["get", "rsrv", "-n", NS, "-o", "yaml"]) {
            eprintln!("{out}");
        }
        for pod in kubectl
            .run(&[
                "get",
                "pods",
                "-n",
                NS,
                "-o",
                "jsonpath={.items[*].metadata.name}",
            ])
            .unwrap_or_default()
            .split_whitespace()
        {
            eprintln!("{}", node.pod_logs(NS, pod, 30));
        }
    }
    node.stop().await?;
    eprintln!("[e2e_operator_node] total {:.1?}", t0.elapsed());
    result
}

async fn modes(node: &Node, run: &RunDir) -> Result<()> {
    let cp = node.cp();
    let kubectl = Kubectl::new(cp.kubeconfig_path());
    let client = kube_client_with_retries(cp.kubeconfig_path(), false).await?;

    // ---- 1. install ---------------------------------------------------------------------------
    let t = Instant::now();
    let postgres_image = reports_server_crds::reportsserver::ManagedPostgresSpec::default().image;
    node.tag_image(POSTGRES_IMAGE, &postgres_image)?;
    let operator_image = operator::install_on_node(node, &kubectl)?;
    kubectl.run(&[
        "rollout",
        "status",
        "-n",
        NS,
        "deployment/reports-server-operator",
        "--timeout=180s",
    ])?;
    eprintln!(
        "[e2e_operator_node] operator ({operator_image}) Available in {:.1?}",
        t.elapsed()
    );
    enforces_restricted(&kubectl)?;
    create_volumes(&kubectl, run, 3)?;

    // ---- 2. sqlite ----------------------------------------------------------------------------
    let t = Instant::now();
    kubectl.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&manifest("examples/sqlite.yaml")?),
    )?;
    let rs = wait_condition(&kubectl, "Ready", READY_TIMEOUT).await?;
    eprintln!("[e2e_operator_node] sqlite: Ready in {:.1?}", t.elapsed());
    check_installation(&kubectl, &client, "sqlite", &rs).await?;
    let written = write_reports(&kubectl, "sqlite", 20)?;
    ensure!(
        read_reports(&kubectl)? == written,
        "sqlite: the reports read back differ"
    );
    let t = Instant::now();
    let old = kubectl.run(&[
        "get",
        "pod",
        "-n",
        NS,
        "reports-server-0",
        "-o",
        "jsonpath={.metadata.uid}",
    ])?;
    kubectl.run(&["delete", "pod", "-n", NS, "reports-server-0", "--wait=true"])?;
    wait_pod_replaced(&kubectl, "reports-server-0", &old).await?;
    wait_condition(&kubectl, "Ready", READY_TIMEOUT).await?;
    let after = retry_read(&kubectl).await?;
    ensure!(
        after == written,
        "sqlite: reports lost or changed across the deletion of the StatefulSet's pod: \
         {} before, {} after",
        written.len(),
        after.len()
    );
    eprintln!(
        "[e2e_operator_node] sqlite: {} reports kept across a pod deletion ({:.1?})",
        after.len(),
        t.elapsed()
    );
    let in_etcd = delete_installation(&kubectl, &rs, &after).await?;

    // ---- 3. postgres.managed with a rolling update -------------------------------------------
    // The hand-back left the reports in CRD storage: this installation migrates them in.
    let t = Instant::now();
    kubectl.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&manifest("examples/postgres-managed.yaml")?),
    )?;
    let rs = wait_condition(&kubectl, "Ready", READY_TIMEOUT).await?;
    eprintln!(
        "[e2e_operator_node] postgres.managed: Ready in {:.1?}",
        t.elapsed()
    );
    check_installation(&kubectl, &client, "postgres-managed", &rs).await?;
    check_migrated_in(&kubectl, "postgres.managed", &rs, &in_etcd)?;
    let written = write_reports(&kubectl, "managed", 20)?;
    ensure!(
        read_reports(&kubectl)? == written,
        "postgres.managed: the reports read back differ"
    );

    let poller = ApiPoller::start(client.clone(), "/apis/wgpolicyk8s.io/v1alpha2", POLL_EVERY);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t = Instant::now();
    let old_pods = pods(&kubectl, SERVER_PODS)?;
    kubectl.run(&[
        "patch",
        "rsrv",
        "-n",
        NS,
        "reports-server",
        "--type=merge",
        "-p",
        r#"{"spec":{"extraEnv":[{"name":"REPORTS_SERVER_LOG","value":"info,reports_server=debug"}]}}"#,
    ])?;
    // The operator applies the new template; the Deployment then rolls one pod at a time.
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let now = pods(&kubectl, SERVER_PODS)?;
        let rs = rs_json(&kubectl)?;
        if !now.iter().any(|p| old_pods.contains(p)) && is_ready(&rs) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the rolling update did not finish: pods {old_pods:?} -> {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let rolled_in = t.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (ok, errors) = poller.finish().await?;
    eprintln!(
        "[e2e_operator_node] postgres.managed: rolling update of 2 replicas in {rolled_in:.1?}: \
         pods {old_pods:?} -> {:?}; GET /apis/wgpolicyk8s.io/v1alpha2 every {POLL_EVERY:?}: \
         {ok} ok, {} errors",
        pods(&kubectl, SERVER_PODS)?,
        errors.len()
    );
    ensure!(
        errors.is_empty() && ok > 0,
        "requests failed during the rolling update ({ok} ok):\n{}",
        errors.join("\n")
    );
    ensure!(
        read_reports(&kubectl)? == written,
        "postgres.managed: reports changed across the rolling update"
    );
    rotate_serving_certificate(&kubectl, &client).await?;
    let in_etcd = delete_installation(&kubectl, &rs, &written).await?;

    // ---- 4. postgres.external -----------------------------------------------------------------
    let t = Instant::now();
    users_postgres(&kubectl, node).await?;
    let example = yaml_docs(&manifest("examples/postgres-external.yaml")?)?;
    let mut secret = example
        .iter()
        .find(|d| d["kind"] == "Secret")
        .cloned()
        .ok_or_else(|| anyhow!("postgres-external.yaml has no Secret"))?;
    let rs_doc = example
        .iter()
        .find(|d| d["kind"] == "ReportsServer")
        .cloned()
        .ok_or_else(|| anyhow!("postgres-external.yaml has no ReportsServer"))?;
    // "Edit it first": the test's database, and at first without the database name.
    let data = secret["stringData"]
        .as_object_mut()
        .ok_or_else(|| anyhow!("the example Secret has no stringData"))?;
    data.insert("host".into(), json!(format!("{USERS_DB}.{NS}.svc")));
    data.insert("password".into(), json!(USERS_DB_PASSWORD));
    let database = data.remove("database").unwrap_or(json!("reports"));
    kubectl.run_with_stdin(&["apply", "-f", "-"], Some(&secret.to_string()))?;
    kubectl.run_with_stdin(&["apply", "-f", "-"], Some(&rs_doc.to_string()))?;
    let degraded = wait_condition(&kubectl, "Degraded", READY_TIMEOUT).await?;
    let message = condition(&degraded, "Degraded")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_string();
    ensure!(
        message.contains(&format!("{NS}/reports-db")) && message.contains("\"database\""),
        "the Degraded message does not name the Secret and its missing key: {message:?}"
    );
    eprintln!(
        "[e2e_operator_node] postgres.external without the database key: Degraded: {message}"
    );
    secret["stringData"]["database"] = database;
    let fixed = Instant::now();
    kubectl.run_with_stdin(&["apply", "-f", "-"], Some(&secret.to_string()))?;
    let rs = wait_condition(&kubectl, "Ready", READY_TIMEOUT).await?;
    ensure!(
        condition(&rs, "Degraded").is_some_and(|c| c["status"] == "False"),
        "Ready while still Degraded: {}",
        rs["status"]
    );
    eprintln!(
        "[e2e_operator_node] postgres.external: Ready {:.1?} after the Secret was fixed ({:.1?} \
         in all)",
        fixed.elapsed(),
        t.elapsed()
    );
    check_installation(&kubectl, &client, "postgres-external", &rs).await?;
    check_migrated_in(&kubectl, "postgres.external", &rs, &in_etcd)?;
    let written = write_reports(&kubectl, "external", 20)?;
    ensure!(
        read_reports(&kubectl)? == written,
        "postgres.external: the reports read back differ"
    );
    delete_installation(&kubectl, &rs, &written).await?;
    Ok(())
}

/// Every pod of the run (servers, the managed PostgreSQL, the test's own database) is admitted
/// under the restricted Pod Security Standard that install.yaml enforces on the namespace.
fn enforces_restricted(kubectl: &Kubectl) -> Result<()> {
    let enforce = kubectl.run(&[
        "get",
        "namespace",
        NS,
        "-o",
        "jsonpath={.metadata.labels.pod-security\\.kubernetes\\.io/enforce}",
    ])?;
    ensure!(
        enforce.trim() == "restricted",
        "namespace {NS} does not enforce the restricted Pod Security Standard: {enforce:?}"
    );
    Ok(())
}

/// A new serving certificate reaches the running pods without a restart and without a failed
/// request: the serving Secret is deleted (as a renewal rewrites it), the operator issues a new
/// one at once (it watches its Secrets), the kubelet updates the pods' volume, and each server
/// reloads the files (`serve --tls-reload-interval-seconds`).
async fn rotate_serving_certificate(kubectl: &Kubectl, client: &kube::Client) -> Result<()> {
    let fingerprint_of_secret = || -> Result<String> {
        let b64 = kubectl.run(&[
            "get",
            "secret",
            "-n",
            NS,
            "reports-server-tls",
            "-o",
            "jsonpath={.data.tls\\.crt}",
        ])?;
        let pem = base64::engine::general_purpose::STANDARD.decode(b64.trim())?;
        fingerprint(&String::from_utf8(pem)?)
    };
    let before = fingerprint_of_secret()?;
    let server_pods = pods(kubectl, SERVER_PODS)?;
    let ips: Vec<String> = server_pods
        .iter()
        .map(|p| kubectl.run(&["get", "pod", "-n", NS, p, "-o", "jsonpath={.status.podIP}"]))
        .collect::<Result<_>>()?;
    for ip in &ips {
        ensure!(
            served_fingerprint(ip)? == before,
            "pod {ip} does not serve the certificate of Secret reports-server-tls"
        );
    }
    let poller = ApiPoller::start(client.clone(), "/apis/wgpolicyk8s.io/v1alpha2", POLL_EVERY);
    let t = Instant::now();
    kubectl.run(&["delete", "secret", "-n", NS, "reports-server-tls"])?;
    let deadline = Instant::now() + Duration::from_secs(180);
    let after = loop {
        if let Ok(f) = fingerprint_of_secret()
            && f != before
        {
            break f;
        }
        ensure!(
            Instant::now() < deadline,
            "the operator did not issue a new serving certificate"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let issued_in = t.elapsed();
    for ip in &ips {
        loop {
            if served_fingerprint(ip).ok().as_deref() == Some(after.as_str()) {
                break;
            }
            ensure!(
                Instant::now() < deadline,
                "pod {ip} still serves the old certificate {:.0?} after the renewal",
                t.elapsed()
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    let served_in = t.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (ok, errors) = poller.finish().await?;
    ensure!(
        pods(kubectl, SERVER_PODS)? == server_pods,
        "the pods were replaced instead of reloading the certificate"
    );
    eprintln!(
        "[e2e_operator_node] certificate rotation: new serving certificate issued in {issued_in:.1?}, served by both pods (no restart) after {served_in:.1?}; GET every {POLL_EVERY:?}: {ok} ok, {} errors",
        errors.len()
    );
    ensure!(
        errors.is_empty() && ok > 0,
        "requests failed during the certificate rotation ({ok} ok):\n{}",
        errors.join("\n")
    );
    Ok(())
}

/// SHA-256 fingerprint of a PEM certificate (`openssl x509`).
fn fingerprint(pem: &str) -> Result<String> {
    use std::io::Write as _;
    let mut child = std::process::Command::new("openssl")
        .args(["x509", "-noout", "-fingerprint", "-sha256"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running openssl (apt-get install -y openssl)")?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(pem.as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "openssl x509: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?.trim().to_string())
}

/// The fingerprint of the certificate a pod serves on its HTTPS port.
fn served_fingerprint(ip: &str) -> Result<String> {
    let out = std::process::Command::new("openssl")
        .args(["s_client", "-connect", &format!("{ip}:6443"), "-showcerts"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .context("running openssl s_client")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text
        .find("-----BEGIN CERTIFICATE-----")
        .ok_or_else(|| anyhow!("no certificate from {ip}:6443"))?;
    let end = text[start..]
        .find("-----END CERTIFICATE-----")
        .ok_or_else(|| anyhow!("truncated certificate from {ip}:6443"))?
        + start
        + "-----END CERTIFICATE-----".len();
    fingerprint(&text[start..end])
}

// ---- checks ---------------------------------------------------------------------------------

/// Pods Ready, APIServices Available with the operator's CA, the live objects as in the golden
/// file of `mode`.
async fn check_installation(
    kubectl: &Kubectl,
    client: &kube::Client,
    mode: &str,
    rs: &Value,
) -> Result<()> {
    ensure!(
        rs["status"]["observedGeneration"] == rs["metadata"]["generation"],
        "{mode}: Ready with observedGeneration {} != generation {}",
        rs["status"]["observedGeneration"],
        rs["metadata"]["generation"]
    );
    let want = rs["spec"]["replicas"].as_u64().unwrap_or(1);
    let ready = kubectl.run(&[
        "get",
        "pods",
        "-n",
        NS,
        "-l",
        SERVER_PODS,
        "-o",
        "jsonpath={.items[*].status.conditions[?(@.type==\"Ready\")].status}",
    ])?;
    ensure!(
        ready.split_whitespace().filter(|s| *s == "True").count() as u64 >= want,
        "{mode}: server pods Ready: {ready:?}, want {want}"
    );
    let ca = kubectl.run(&[
        "get",
        "secret",
        "-n",
        NS,
        "reports-server-ca",
        "-o",
        "jsonpath={.data.ca\\.crt}",
    ])?;
    ensure!(
        !ca.is_empty(),
        "{mode}: the operator's CA Secret has no ca.crt"
    );
    for name in API_SERVICES {
        let api: Value =
            serde_json::from_str(&kubectl.run(&["get", "apiservice", name, "-o", "json"])?)?;
        ensure!(
            api["spec"]["caBundle"].as_str() == Some(ca.as_str()),
            "{mode}: APIService {name} does not carry the operator's CA"
        );
        ensure!(
            api["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Available" && c["status"] == "True"),
            "{mode}: APIService {name} is not Available: {}",
            api["status"]
        );
    }
    let (status, body) = raw(client, "GET", "/apis/wgpolicyk8s.io/v1alpha2/policyreports").await?;
    ensure!(
        status == 200 && body.contains("\"kind\":\"PolicyReportList\""),
        "{mode}: listing PolicyReports through kube-apiserver: {status} {body}"
    );
    let differences = golden_differences(kubectl, mode, rs, &ca)?;
    ensure!(
        differences.is_empty(),
        "{mode}: the live objects differ from operator/tests/golden/{mode}.yaml:\n{}",
        differences.join("\n")
    );
    eprintln!(
        "[e2e_operator_node] {mode}: pods Ready, APIServices Available with the operator's CA, \
         live objects match operator/tests/golden/{mode}.yaml"
    );
    Ok(())
}

/// Every field of every object in the golden file must have the same value in the live object
/// (the API server adds defaults, which are not compared). The golden files are rendered for a
/// ReportsServer with a placeholder uid and CA; those two are replaced by the live ones.
fn golden_differences(
    kubectl: &Kubectl,
    mode: &str,
    rs: &Value,
    ca_b64: &str,
) -> Result<Vec<String>> {
    let path = workspace_root().join(format!("operator/tests/golden/{mode}.yaml"));
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let uid = rs["metadata"]["uid"].as_str().unwrap_or_default();
    let role_uid = kubectl.run(&[
        "get",
        "clusterrole",
        "reports-server-operator",
        "-o",
        "jsonpath={.metadata.uid}",
    ])?;
    let mut differences = Vec::new();
    for mut want in yaml_docs(&text)? {
        if let Some(refs) = want["metadata"]["ownerReferences"].as_array_mut() {
            for r in refs {
                r["uid"] = if r["kind"] == "ClusterRole" {
                    json!(role_uid.trim())
                } else {
                    json!(uid)
                };
            }
        }
        if want["kind"] == "APIService" {
            want["spec"]["caBundle"] = json!(ca_b64);
        }
        let kind = want["kind"].as_str().unwrap_or_default().to_string();
        let name = want["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut args = vec![
            "get".to_string(),
            format!("{kind}.{}", api_group(&want)),
            name.clone(),
            "-o".into(),
            "json".into(),
        ];
        if let Some(ns) = want["metadata"]["namespace"].as_str() {
            args.extend(["-n".into(), ns.into()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        match kubectl.run(&args) {
            Ok(live) => subset_differences(
                &want,
                &serde_json::from_str(&live)?,
                &format!("{kind}/{name}"),
                &mut differences,
            ),
            Err(e) => differences.push(format!("{kind}/{name}: {e:#}")),
        }
    }
    Ok(differences)
}

/// `apps`, `policy`, `rbac.authorization.k8s.io`, … of an object; empty for the core group.
fn api_group(obj: &Value) -> String {
    let api_version = obj["apiVersion"].as_str().unwrap_or_default();
    match api_version.split_once('/') {
        Some((group, _)) => group.to_string(),
        None => String::new(),
    }
}

fn subset_differences(want: &Value, live: &Value, at: &str, out: &mut Vec<String>) {
    match (want, live) {
        (Value::Object(w), Value::Object(l)) => {
            for (k, wv) in w {
                match l.get(k) {
                    Some(lv) => subset_differences(wv, lv, &format!("{at}.{k}"), out),
                    // The builders write `null` for a field they leave out.
                    None if wv.is_null() => {}
                    None => out.push(format!("{at}.{k}: missing (want {wv})")),
                }
            }
        }
        (Value::Array(w), Value::Array(l)) if w.len() == l.len() => {
            for (i, (wv, lv)) in w.iter().zip(l).enumerate() {
                subset_differences(wv, lv, &format!("{at}[{i}]"), out);
            }
        }
        (w, l) if w == l => {}
        // Quantities and ports may come back as strings or numbers of the same value.
        (w, l) if w.to_string().trim_matches('"') == l.to_string().trim_matches('"') => {}
        (w, l) => out.push(format!("{at}: want {w}, live {l}")),
    }
}

// ---- the ReportsServer and its objects ------------------------------------------------------

/// Deletes the ReportsServer: its APIServices must be gone when the object is, and the garbage
/// collector then removes what it owned.
async fn delete_installation(
    kubectl: &Kubectl,
    rs: &Value,
    written: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>> {
    let t = Instant::now();
    let uid = rs["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    kubectl.run(&[
        "delete",
        "rsrv",
        "-n",
        NS,
        "reports-server",
        "--wait=true",
        "--timeout=120s",
    ])?;
    let handed_back_in = t.elapsed();
    // spec.migration.handBackOnDelete (the default): the server wrote every report back into
    // CRD storage and gave the APIServices back to kube-apiserver before the object went.
    for name in API_SERVICES {
        let a: Value =
            serde_json::from_str(&kubectl.run(&["get", "apiservice", name, "-o", "json"])?)?;
        ensure!(
            a["spec"]["service"].is_null()
                && a["metadata"]["annotations"]["reportsserver.io/owner"].is_null(),
            "APIService {name} was not handed back to kube-apiserver: {a:#}"
        );
    }
    let in_etcd = retry_read(kubectl).await?;
    ensure!(
        in_etcd.keys().eq(written.keys()),
        "the hand-back did not return every report to CRD storage: {} written, {} in etcd",
        written.len(),
        in_etcd.len()
    );
    eprintln!(
        "[e2e_operator_node] ReportsServer deleted in {handed_back_in:.1?}: {} reports handed back \
         to CRD storage, APIServices Local again",
        in_etcd.len()
    );
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let text = kubectl.run(&[
            "get",
            "deployments,statefulsets,services,poddisruptionbudgets,serviceaccounts,secrets",
            "-n",
            NS,
            "-o",
            "json",
        ])?;
        let list: Value = serde_json::from_str(&text)?;
        let left: Vec<String> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|o| {
                o["metadata"]["ownerReferences"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|r| r["uid"] == uid.as_str())
            })
            .map(|o| {
                format!(
                    "{}/{}",
                    o["kind"].as_str().unwrap_or("?"),
                    o["metadata"]["name"].as_str().unwrap_or("?")
                )
            })
            .collect();
        let server_pods = pods(kubectl, SERVER_PODS)?;
        if left.is_empty() && server_pods.is_empty() {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "still there 180 s after the ReportsServer was deleted: {left:?}, pods {server_pods:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    eprintln!(
        "[e2e_operator_node] owned objects collected {:.1?} after the deletion",
        t.elapsed()
    );
    Ok(in_etcd)
}

/// After a hand-back the next installation moves the reports from CRD storage into its database
/// (`spec.migration`): the same reports with the same uids, and the migration reported done.
fn check_migrated_in(
    kubectl: &Kubectl,
    mode: &str,
    rs: &Value,
    in_etcd: &BTreeMap<String, String>,
) -> Result<()> {
    let served = read_reports(kubectl)?;
    ensure!(
        &served == in_etcd,
        "{mode}: the reports handed back to etcd were not migrated in as they were: {} in etcd, {} served",
        in_etcd.len(),
        served.len()
    );
    let m = &rs["status"]["migration"];
    ensure!(
        m["phase"] == "Complete"
            && m["conditions"]
                .as_array()
                .is_some_and(|cs| cs.iter().all(|c| c["status"] == "True")),
        "{mode}: status.migration is not complete: {m:#}"
    );
    eprintln!(
        "[e2e_operator_node] {mode}: {} reports migrated in from CRD storage (same uids); last run {}",
        served.len(),
        m["lastRun"]
    );
    Ok(())
}

fn pods(kubectl: &Kubectl, selector: &str) -> Result<Vec<String>> {
    let out = kubectl.run(&[
        "get",
        "pods",
        "-n",
        NS,
        "-l",
        selector,
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ])?;
    let mut v: Vec<String> = out.split_whitespace().map(String::from).collect();
    v.sort();
    Ok(v)
}

async fn wait_pod_replaced(kubectl: &Kubectl, pod: &str, old_uid: &str) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let uid = kubectl
            .run(&[
                "get",
                "pod",
                "-n",
                NS,
                pod,
                "-o",
                "jsonpath={.metadata.uid}",
            ])
            .unwrap_or_default();
        if !uid.is_empty() && uid != old_uid {
            kubectl.run(&[
                "wait",
                "-n",
                NS,
                &format!("pod/{pod}"),
                "--for=condition=Ready",
                "--timeout=180s",
            ])?;
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "{pod} was not recreated");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

// ---- the user's own PostgreSQL (postgres.external) -------------------------------------------

const USERS_DB: &str = "reports-db";
const USERS_DB_PASSWORD: &str = "e2e-external-password";

/// A PostgreSQL with TLS in the cluster, standing for the database a user already runs: a
/// Deployment of the PostgreSQL image with a serving certificate for `reports-db.<ns>.svc` and
/// a Service in front. The example's `sslMode: require` then works unchanged.
async fn users_postgres(kubectl: &Kubectl, node: &Node) -> Result<()> {
    let cert = node
        .cp()
        .issue_serving_cert(USERS_DB, &[&format!("{USERS_DB}.{NS}.svc")])
        .await?;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    let yaml = format!(
        r#"apiVersion: v1
kind: Secret
metadata: {{name: {USERS_DB}-tls, namespace: {NS}}}
data: {{tls.crt: {crt}, tls.key: {key}}}
---
apiVersion: v1
kind: Service
metadata: {{name: {USERS_DB}, namespace: {NS}}}
spec:
  selector: {{app: {USERS_DB}}}
  ports: [{{name: postgres, port: 5432, targetPort: 5432}}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: {USERS_DB}, namespace: {NS}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: {USERS_DB}}}}}
  template:
    metadata: {{labels: {{app: {USERS_DB}}}}}
    spec:
      # The restricted Pod Security Standard of the operator's namespace (install.yaml).
      securityContext: {{runAsNonRoot: true, runAsUser: 999, runAsGroup: 999, fsGroup: 999, seccompProfile: {{type: RuntimeDefault}}}}
      containers:
      - name: postgres
        image: {POSTGRES_IMAGE}
        args: [postgres, -c, ssl=on, -c, ssl_cert_file=/tls/tls.crt, -c, ssl_key_file=/tls/tls.key]
        securityContext: {{allowPrivilegeEscalation: false, capabilities: {{drop: [ALL]}}}}
        env:
        # A directory PostgreSQL creates itself (it insists on owning its data directory).
        - {{name: PGDATA, value: /var/lib/postgresql/data/pgdata}}
        - {{name: POSTGRES_USER, value: reports}}
        - {{name: POSTGRES_DB, value: reports}}
        - {{name: POSTGRES_PASSWORD, value: {USERS_DB_PASSWORD}}}
        ports: [{{containerPort: 5432}}]
        readinessProbe:
          exec: {{command: [pg_isready, -U, reports, -d, reports]}}
          periodSeconds: 2
        volumeMounts:
        - {{name: tls, mountPath: /tls, readOnly: true}}
        - {{name: data, mountPath: /var/lib/postgresql/data}}
      volumes:
      # Owned by root, readable by the postgres group: what PostgreSQL accepts for a key file.
      - {{name: tls, secret: {{secretName: {USERS_DB}-tls, defaultMode: 0640}}}}
      - {{name: data, emptyDir: {{}}}}
"#,
        crt = b64(&cert.cert_pem),
        key = b64(&cert.key_pem),
    );
    kubectl.run_with_stdin(&["apply", "-f", "-"], Some(&yaml))?;
    kubectl.run(&[
        "rollout",
        "status",
        "-n",
        NS,
        &format!("deployment/{USERS_DB}"),
        "--timeout=180s",
    ])?;
    Ok(())
}

// ---- reports ----------------------------------------------------------------------------------

/// Creates `n` PolicyReports through kube-apiserver; returns name → uid.
fn write_reports(kubectl: &Kubectl, prefix: &str, n: usize) -> Result<BTreeMap<String, String>> {
    let mut yaml = String::new();
    for i in 0..n {
        yaml.push_str(&format!(
            "---\napiVersion: wgpolicyk8s.io/v1alpha2\nkind: PolicyReport\nmetadata: {{name: {prefix}-{i}, namespace: {REPORTS_NS}}}\n\
             summary: {{pass: 1, fail: 0, warn: 0, error: 0, skip: 0}}\nresults:\n\
             - {{policy: e2e, rule: {prefix}, result: pass, source: e2e, timestamp: {{seconds: 1700000000, nanos: 0}}}}\n"
        ));
    }
    kubectl.run_with_stdin(&["create", "-f", "-"], Some(&yaml))?;
    let all = read_reports(kubectl)?;
    let mine = all
        .keys()
        .filter(|k| k.starts_with(&format!("{prefix}-")))
        .count();
    ensure!(mine == n, "wrote {n} reports, {mine} are served");
    Ok(all)
}

fn read_reports(kubectl: &Kubectl) -> Result<BTreeMap<String, String>> {
    let text = kubectl.run(&["get", "policyreports", "-n", REPORTS_NS, "-o", "json"])?;
    let list: Value = serde_json::from_str(&text)?;
    Ok(list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|o| {
            (
                o["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                o["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect())
}

/// Reads the reports, retrying while kube-apiserver still routes to an endpoint that is gone.
async fn retry_read(kubectl: &Kubectl) -> Result<BTreeMap<String, String>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match read_reports(kubectl) {
            Ok(r) => return Ok(r),
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

// ---- files ------------------------------------------------------------------------------------
