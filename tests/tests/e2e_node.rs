//! A real node (containerd + runc + kubelet + kube-scheduler) running our image: the smoke test
//! of `tests/src/node.rs`. One isolated run (private PID, network and mount namespaces, see the
//! harness docs) covers, in order:
//!
//! 1. a Deployment of `reports-server serve --auth-mode delegated` (2 replicas, read-only root,
//!    non-root, serving certificate from a Secret) becomes Ready through its readiness probe, and
//!    kube-apiserver serves PolicyReports from it through the three APIServices with a real
//!    `caBundle` and aggregator routing to the pods;
//! 2. a rolling update (an env change) with `maxUnavailable: 0` and a PodDisruptionBudget while
//!    a client polls `GET /apis/wgpolicyk8s.io/v1alpha2` every 100 ms: no error is allowed;
//! 3. a StatefulSet with a PersistentVolume keeps its SQLite data across the deletion of its pod.
//!
//! The outer test process then checks that the machine's sysctls, mounts, links, cgroups and
//! processes are as before. `docker_file_matches_image_script` checks that the repository's
//! Dockerfile describes the same image as `tests/node/image.sh`.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use base64::Engine as _;
use reports_server_tests::{
    controlplane::workspace_root,
    delegated::{API_SERVICES, raw},
    kube_client_with_retries,
    kubectl::Kubectl,
    node::{self, Node, REPORTS_SERVER_IMAGE, RunDir},
};

const NS: &str = "reports-server";
/// The poll interval of the client that watches the API during the rolling update.
const POLL_EVERY: Duration = Duration::from_millis(100);

#[test]
fn node_smoke() {
    node::run_isolated("node_smoke", |run| async move { smoke(run).await });
}

async fn smoke(run: RunDir) -> Result<()> {
    let t0 = Instant::now();
    let node = Node::start(&run).await?;
    let result = scenarios(&node, &run).await;
    if let Err(e) = &result {
        eprintln!("[e2e_node] FAILED: {e:#}\n{}", node.diagnostics());
        for pod in pods(&node).unwrap_or_default() {
            eprintln!("{}", node.pod_logs(NS, &pod, 20));
        }
    }
    node.stop().await?;
    eprintln!("[e2e_node] total {:.1?}", t0.elapsed());
    result
}

async fn scenarios(node: &Node, run: &RunDir) -> Result<()> {
    let cp = node.cp();
    let kubectl = Kubectl::new(cp.kubeconfig_path());

    // ---- 1. Deployment behind the APIServices --------------------------------------------
    let t = Instant::now();
    let cert = cp
        .issue_serving_cert(
            "reports-server",
            &[
                &format!("reports-server.{NS}.svc"),
                "reports-server-sts.reports-server.svc",
            ],
        )
        .await?;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    kubectl.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&base_manifests(&b64(&cert.cert_pem), &b64(&cert.key_pem))),
    )?;
    kubectl.run_with_stdin(&["apply", "-f", "-"], Some(&deployment_manifest("1")))?;
    rollout(&kubectl, "deployment/reports-server", node).await?;
    let ready_in = t.elapsed();
    kubectl.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&apiservices_manifest(&b64(cp.ca_pem()), "reports-server")),
    )?;
    let client = kube_client_with_retries(cp.kubeconfig_path(), false).await?;
    wait_routed(node, &client).await?;
    let (status, body) = raw(
        &client,
        "GET",
        "/apis/wgpolicyk8s.io/v1alpha2/policyreports",
    )
    .await?;
    ensure!(
        status == 200 && body.contains("\"kind\":\"PolicyReportList\""),
        "listing PolicyReports through kube-apiserver: {status} {body}"
    );
    let out = kubectl.run(&["get", "policyreports", "-A"])?;
    eprintln!(
        "[e2e_node] Deployment Ready in {ready_in:.1?}; APIServices Available and routed after \
         {:.1?}; kubectl get policyreports -A: {:?}",
        t.elapsed(),
        out.trim()
    );

    // ---- 2. Rolling update under a polling client -----------------------------------------
    let poller =
        node::ApiPoller::start(client.clone(), "/apis/wgpolicyk8s.io/v1alpha2", POLL_EVERY);
    // Some polls against the old pods first, then the update, then some against the new ones.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t = Instant::now();
    let old_pods = pods(node)?;
    kubectl.run_with_stdin(&["apply", "-f", "-"], Some(&deployment_manifest("2")))?;
    rollout(&kubectl, "deployment/reports-server", node).await?;
    let rolled_in = t.elapsed();
    // The old pods terminate after the rollout is complete (preStop sleep, then SIGTERM): keep
    // polling until they are gone, then a little longer.
    let deadline = Instant::now() + Duration::from_secs(60);
    while pods(node)?.iter().any(|p| old_pods.contains(p)) {
        ensure!(
            Instant::now() < deadline,
            "the old pods did not terminate in 60s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (ok, errors) = poller.finish().await?;
    let new_pods = pods(node)?;
    eprintln!(
        "[e2e_node] rolling update in {rolled_in:.1?}: pods {old_pods:?} -> {new_pods:?}; \
         GET /apis/wgpolicyk8s.io/v1alpha2 every {POLL_EVERY:?}: {ok} ok, {} errors",
        errors.len()
    );
    ensure!(
        old_pods.iter().all(|p| !new_pods.contains(p)),
        "the rolling update did not replace the pods: {old_pods:?} -> {new_pods:?}"
    );
    ensure!(
        errors.is_empty() && ok > 0,
        "requests failed during the rolling update ({ok} ok):\n{}",
        errors.join("\n")
    );

    // ---- 3. StatefulSet: SQLite on a PersistentVolume survives the pod -------------------
    let t = Instant::now();
    let pv_dir = run.path().join("node/pv/reports-server-sts-0");
    std::fs::create_dir_all(&pv_dir)?;
    // The image's user owns its data directory; a hostPath volume keeps the host's owner.
    std::os::unix::fs::chown(&pv_dir, Some(65532), Some(65532))?;
    kubectl.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&statefulset_manifest(&pv_dir.display().to_string())),
    )?;
    rollout(&kubectl, "statefulset/reports-server-sts", node).await?;
    kubectl.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&apiservices_manifest(
            &b64(cp.ca_pem()),
            "reports-server-sts",
        )),
    )?;
    // Every group now goes to the StatefulSet's single pod.
    wait_routed(node, &client).await?;
    wait_endpoint_is_sts(&kubectl).await?;
    kubectl.run_with_stdin(&["create", "-f", "-"], Some(POLICY_REPORT))?;
    let before = kubectl.run(REPORT_UID)?;
    let pod_uid = |kubectl: &Kubectl| {
        kubectl.run(&[
            "get",
            "pod",
            "-n",
            NS,
            "reports-server-sts-0",
            "-o",
            "jsonpath={.metadata.uid}",
        ])
    };
    let old_uid = pod_uid(&kubectl)?;
    kubectl.run(&[
        "delete",
        "pod",
        "-n",
        NS,
        "reports-server-sts-0",
        "--wait=true",
    ])?;
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Ok(uid) = pod_uid(&kubectl)
            && !uid.is_empty()
            && uid != old_uid
        {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "reports-server-sts-0 was not recreated"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    rollout(&kubectl, "statefulset/reports-server-sts", node).await?;
    kubectl.run(&[
        "wait",
        "-n",
        NS,
        "pod/reports-server-sts-0",
        "--for=condition=Ready",
        "--timeout=120s",
    ])?;
    // The aggregator may still hold the old pod's endpoint for a moment: retry until it answers.
    let deadline = Instant::now() + Duration::from_secs(60);
    let after = loop {
        match kubectl.run(REPORT_UID) {
            Ok(uid) => break uid,
            Err(e) if Instant::now() > deadline => {
                return Err(e.context("the PolicyReport after the StatefulSet pod was recreated"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    };
    ensure!(
        !before.is_empty() && before == after,
        "the PolicyReport did not survive the pod's deletion (uid {before:?} -> {after:?})"
    );
    eprintln!(
        "[e2e_node] StatefulSet: PolicyReport {before} kept across pod {old_uid} -> new pod ({:.1?})",
        t.elapsed()
    );

    // Hand the groups back before the server goes away (nothing else may block on discovery).
    for name in API_SERVICES {
        let _ = kubectl.run(&["delete", "apiservice", name, "--wait=false"]);
    }
    Ok(())
}

/// `kubectl rollout status` with the node's diagnostics on failure.
async fn rollout(kubectl: &Kubectl, what: &str, node: &Node) -> Result<()> {
    let t = Instant::now();
    kubectl
        .run(&["rollout", "status", "-n", NS, what, "--timeout=180s"])
        .with_context(|| {
            format!(
                "{what} did not roll out in {:.0?}\n{}\n--- pods ---\n{}",
                t.elapsed(),
                node.diagnostics(),
                kubectl
                    .run(&["get", "pods", "-n", NS, "-o", "wide"])
                    .unwrap_or_default()
            )
        })?;
    Ok(())
}

/// Waits until every APIService is Available and kube-apiserver routes its group.
async fn wait_routed(node: &Node, client: &kube::Client) -> Result<()> {
    let cp = node.cp();
    for name in API_SERVICES {
        cp.wait_apiservice_available(name, Duration::from_secs(120))
            .await
            .with_context(|| node.diagnostics())?;
        let (version, group) = name.split_once('.').expect("<version>.<group>");
        let path = format!("/apis/{group}/{version}");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match raw(client, "GET", &path).await {
                Ok((200, _)) => break,
                other if Instant::now() > deadline => {
                    bail!("GET {path} after {name} became Available: {other:?}")
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    Ok(())
}

/// After re-pointing the APIServices, kube-apiserver's discovery of the group comes from the new
/// Service once its EndpointSlice lists the StatefulSet's pod.
async fn wait_endpoint_is_sts(kubectl: &Kubectl) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = kubectl.run(&[
            "get",
            "endpointslices",
            "-n",
            NS,
            "-l",
            "kubernetes.io/service-name=reports-server-sts",
            "-o",
            "jsonpath={.items[*].endpoints[*].conditions.ready}",
        ])?;
        if out.contains("true") {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the StatefulSet's Service has no ready endpoint"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn pods(node: &Node) -> Result<Vec<String>> {
    let out = Kubectl::new(node.cp().kubeconfig_path()).run(&[
        "get",
        "pods",
        "-n",
        NS,
        "-l",
        "app=reports-server",
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ])?;
    let mut v: Vec<String> = out.split_whitespace().map(String::from).collect();
    v.sort();
    Ok(v)
}

/// `kubectl get` of the PolicyReport's uid.
const REPORT_UID: &[&str] = &[
    "get",
    "policyreport",
    "-n",
    "default",
    "e2e-node-report",
    "-o",
    "jsonpath={.metadata.uid}",
];

const POLICY_REPORT: &str = r#"apiVersion: wgpolicyk8s.io/v1alpha2
kind: PolicyReport
metadata:
  name: e2e-node-report
  namespace: default
summary: {pass: 1, fail: 0, warn: 0, error: 0, skip: 0}
results:
- policy: e2e
  rule: survives-pod-deletion
  result: pass
  source: e2e
  timestamp: {seconds: 1700000000, nanos: 0}
"#;

/// Namespace, RBAC for delegated authentication/authorization, the serving certificate, the
/// Services and the PodDisruptionBudget.
fn base_manifests(cert_b64: &str, key_b64: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: {NS}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: reports-server, namespace: {NS}}}
---
# TokenReview + SubjectAccessReview for delegated authentication and authorization.
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: reports-server-auth-delegator}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:auth-delegator"}}
subjects: [{{kind: ServiceAccount, name: reports-server, namespace: {NS}}}]
---
# The server watches Namespaces (to refuse reports in namespaces that do not exist).
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: reports-server-namespaces}}
rules: [{{apiGroups: [""], resources: [namespaces], verbs: [get, list, watch]}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: reports-server-namespaces}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: reports-server-namespaces}}
subjects: [{{kind: ServiceAccount, name: reports-server, namespace: {NS}}}]
---
# The front-proxy CA and allowed names (ConfigMap kube-system/extension-apiserver-authentication).
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: reports-server-auth-reader, namespace: kube-system}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: extension-apiserver-authentication-reader}}
subjects: [{{kind: ServiceAccount, name: reports-server, namespace: {NS}}}]
---
apiVersion: v1
kind: Secret
metadata: {{name: reports-server-tls, namespace: {NS}}}
type: kubernetes.io/tls
data: {{tls.crt: {cert_b64}, tls.key: {key_b64}}}
---
apiVersion: v1
kind: Service
metadata: {{name: reports-server, namespace: {NS}}}
spec:
  selector: {{app: reports-server}}
  ports: [{{name: https, port: 443, targetPort: https}}]
---
apiVersion: v1
kind: Service
metadata: {{name: reports-server-sts, namespace: {NS}}}
spec:
  selector: {{app: reports-server-sts}}
  ports: [{{name: https, port: 443, targetPort: https}}]
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {{name: reports-server, namespace: {NS}}}
spec:
  minAvailable: 1
  selector: {{matchLabels: {{app: reports-server}}}}
"#
    )
}

/// The pod template shared by the Deployment and the StatefulSet: our image, `serve` in
/// delegated mode on 0.0.0.0:6443, read-only root, non-root, probes on `/readyz` and `/livez`.
fn pod_spec(app: &str, generation: &str, data_volume: &str) -> String {
    format!(
        r#"    metadata:
      labels: {{app: {app}}}
    spec:
      serviceAccountName: reports-server
      terminationGracePeriodSeconds: 10
      securityContext:
        runAsNonRoot: true
        seccompProfile: {{type: RuntimeDefault}}
      containers:
      - name: server
        image: {REPORTS_SERVER_IMAGE}
        imagePullPolicy: Never
        args: [serve, --auth-mode=delegated, --bind-address=0.0.0.0, --secure-port=6443,
               --tls-cert-file=/tls/tls.crt, --tls-private-key-file=/tls/tls.key, --aggregation=false]
        env:
        - {{name: E2E_GENERATION, value: "{generation}"}}
        - {{name: REPORTS_SERVER_LOG, value: info}}
        ports: [{{name: https, containerPort: 6443}}]
        readinessProbe:
          httpGet: {{path: /readyz, port: https, scheme: HTTPS}}
          periodSeconds: 1
          failureThreshold: 2
        livenessProbe:
          httpGet: {{path: /livez, port: https, scheme: HTTPS}}
          periodSeconds: 5
        lifecycle:
          # Keep serving while the endpoint removal reaches kube-apiserver's aggregator.
          preStop: {{sleep: {{seconds: 3}}}}
        securityContext:
          readOnlyRootFilesystem: true
          allowPrivilegeEscalation: false
          capabilities: {{drop: [ALL]}}
        volumeMounts:
        - {{name: data, mountPath: /var/lib/reports-server}}
        - {{name: tls, mountPath: /tls, readOnly: true}}
      volumes:
      - {{name: tls, secret: {{secretName: reports-server-tls}}}}
{data_volume}"#
    )
}

fn deployment_manifest(generation: &str) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: reports-server, namespace: {NS}}}
spec:
  replicas: 2
  selector: {{matchLabels: {{app: reports-server}}}}
  strategy:
    type: RollingUpdate
    rollingUpdate: {{maxUnavailable: 0, maxSurge: 1}}
  minReadySeconds: 2
  template:
{}"#,
        pod_spec(
            "reports-server",
            generation,
            "      - {name: data, emptyDir: {}}\n"
        )
    )
}

fn statefulset_manifest(pv_path: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: PersistentVolume
metadata: {{name: reports-server-sts-0}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  storageClassName: e2e-manual
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: "{pv_path}", type: Directory}}
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {{name: reports-server-sts, namespace: {NS}}}
spec:
  replicas: 1
  serviceName: reports-server-sts
  selector: {{matchLabels: {{app: reports-server-sts}}}}
  template:
{}  volumeClaimTemplates:
  - metadata: {{name: data}}
    spec:
      accessModes: [ReadWriteOnce]
      storageClassName: e2e-manual
      resources: {{requests: {{storage: 1Gi}}}}
"#,
        pod_spec("reports-server-sts", "1", "")
    )
}

/// The three APIServices pointing at `service` (port 443) with the cluster CA as `caBundle`.
fn apiservices_manifest(ca_b64: &str, service: &str) -> String {
    API_SERVICES
        .iter()
        .map(|name| {
            let (version, group) = name.split_once('.').expect("<version>.<group>");
            format!(
                r#"apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {{name: {name}}}
spec:
  group: {group}
  version: {version}
  groupPriorityMinimum: 1000
  versionPriority: 100
  caBundle: {ca_b64}
  service: {{namespace: {NS}, name: {service}, port: 443}}
"#
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

/// The repository's Dockerfile (for users) and `tests/node/image.sh` (for the tests) describe
/// the same image: same entrypoint, command, user and environment, and the Dockerfile's final
/// stage takes its files from `image.sh rootfs reports-server`.
#[test]
fn docker_file_matches_image_script() -> Result<()> {
    let root = workspace_root();
    let dockerfile =
        std::fs::read_to_string(root.join("Dockerfile")).context("reading Dockerfile")?;
    let out = Command::new("bash")
        .arg(root.join("tests/node/image.sh"))
        .args(["config", "reports-server"])
        .output()
        .context("running bash tests/node/image.sh config reports-server")?;
    ensure!(
        out.status.success(),
        "image.sh config failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config: serde_json::Value = serde_json::from_slice(&out.stdout)?;

    // The final stage: everything after the last FROM.
    let final_stage = dockerfile
        .rsplit_once("\nFROM ")
        .map(|(_, s)| s)
        .ok_or_else(|| anyhow!("the Dockerfile has no FROM"))?;
    ensure!(
        final_stage.starts_with("scratch"),
        "the Dockerfile's final stage must be FROM scratch, got FROM {}",
        final_stage.lines().next().unwrap_or_default()
    );
    let instructions: Vec<(String, String)> = join_continuations(final_stage)
        .into_iter()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (k, v) = l.trim().split_once(char::is_whitespace)?;
            Some((k.to_ascii_uppercase(), v.trim().to_string()))
        })
        .collect();
    let one = |key: &str| -> Result<String> {
        let v: Vec<_> = instructions.iter().filter(|(k, _)| k == key).collect();
        ensure!(
            v.len() == 1,
            "the final stage needs exactly one {key}, has {}",
            v.len()
        );
        Ok(v[0].1.clone())
    };
    let entrypoint: serde_json::Value = serde_json::from_str(&one("ENTRYPOINT")?)?;
    let cmd: serde_json::Value = serde_json::from_str(&one("CMD")?)?;
    ensure!(
        entrypoint == config["Entrypoint"],
        "ENTRYPOINT {entrypoint} != image.sh {}",
        config["Entrypoint"]
    );
    ensure!(
        cmd == config["Cmd"],
        "CMD {cmd} != image.sh {}",
        config["Cmd"]
    );
    ensure!(
        one("USER")? == config["User"],
        "USER {} != image.sh {}",
        one("USER")?,
        config["User"]
    );
    let mut env: Vec<String> = instructions
        .iter()
        .filter(|(k, _)| k == "ENV")
        .flat_map(|(_, v)| v.split_whitespace().map(String::from).collect::<Vec<_>>())
        .collect();
    env.sort();
    let mut want: Vec<String> = config["Env"]
        .as_array()
        .ok_or_else(|| anyhow!("image.sh config has no Env"))?
        .iter()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    want.sort();
    ensure!(env == want, "ENV {env:?} != image.sh {want:?}");
    ensure!(
        dockerfile.contains("tests/node/image.sh rootfs reports-server"),
        "the Dockerfile must assemble the file tree with `tests/node/image.sh rootfs reports-server`"
    );
    let copies: Vec<_> = instructions.iter().filter(|(k, _)| k == "COPY").collect();
    ensure!(
        copies.len() == 1 && copies[0].1.starts_with("--from=") && copies[0].1.ends_with("/ /"),
        "the final stage must copy exactly the assembled tree (`COPY --from=<stage> <dir>/ /`), got {copies:?}"
    );
    Ok(())
}

fn join_continuations(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        if let Some(stripped) = line.trim_end().strip_suffix('\\') {
            cur.push_str(stripped);
            cur.push(' ');
        } else {
            cur.push_str(line);
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}
