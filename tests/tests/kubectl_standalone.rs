//! The real `kubectl` against a standalone server: the commands a user runs on day one.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use reports_server_tests::kubectl::Kubectl;
use reports_server_tests::server::ServerProcess;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures");

const CLUSTER_REPORT: &str = r#"
apiVersion: wgpolicyk8s.io/v1alpha2
kind: ClusterPolicyReport
metadata:
  name: cluster-scan
scope:
  apiVersion: v1
  kind: Node
  name: node-1
summary: {pass: 3, fail: 1, warn: 0, error: 0, skip: 0}
results:
- policy: require-labels
  rule: check-team
  result: fail
  source: kyverno
  timestamp: {seconds: 1700000000, nanos: 0}
"#;

const EPHEMERAL_REPORT: &str = r#"
apiVersion: reports.kyverno.io/v1
kind: EphemeralReport
metadata:
  name: 6c737f35-260c-4e4f-8516-61a125c9fb78
  namespace: apps
  labels:
    audit.kyverno.io/source: admission
    audit.kyverno.io/resource.kind: Pod
    audit.kyverno.io/resource.uid: 6c737f35-260c-4e4f-8516-61a125c9fb78
  annotations:
    audit.kyverno.io/resource.name: web-0
spec:
  owner: {apiVersion: "", kind: "", name: "", uid: ""}
  summary: {pass: 1, fail: 0, warn: 0, error: 0, skip: 0}
  results:
  - policy: disallow-host-path
    rule: host-path
    result: pass
    source: kyverno
    timestamp: {seconds: 1700000000, nanos: 0}
"#;

#[tokio::test]
async fn kubectl_day_one() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), None).await.unwrap();
    let k = Kubectl::new(&server.kubeconfig);

    // Discovery.
    let resources = k.run(&["api-resources"]).unwrap();
    for needle in [
        "policyreports",
        "polr",
        "clusterpolicyreports",
        "cpolr",
        "ephemeralreports",
        "ephr",
        "reports.kyverno.io/v1",
        "openreports.io/v1alpha1",
        "creps",
    ] {
        assert!(
            resources.contains(needle),
            "api-resources lacks {needle}:\n{resources}"
        );
    }
    let kyverno = k
        .run(&["api-resources", "--categories", "kyverno", "-o", "name"])
        .unwrap();
    assert_eq!(
        kyverno.lines().collect::<Vec<_>>(),
        [
            "clusterephemeralreports.reports.kyverno.io",
            "ephemeralreports.reports.kyverno.io"
        ]
    );
    let versions = k.run(&["api-versions"]).unwrap();
    assert!(versions.contains("wgpolicyk8s.io/v1alpha2"), "{versions}");

    // apply, get, -o yaml.
    let applied = k
        .run(&["apply", "-f", &format!("{FIXTURES}/peer/report-1.yaml")])
        .unwrap();
    assert!(
        applied.contains("test-1 created") && applied.contains("test-2 created"),
        "{applied}"
    );
    k.run_with_stdin(&["apply", "-f", "-"], Some(CLUSTER_REPORT))
        .unwrap();
    k.run_with_stdin(&["apply", "-f", "-"], Some(EPHEMERAL_REPORT))
        .unwrap();

    let table = k.run(&["get", "polr", "-A"]).unwrap();
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAMESPACE",
            "NAME",
            "KIND",
            "NAME",
            "PASS",
            "FAIL",
            "WARN",
            "ERROR",
            "SKIP",
            "AGE"
        ],
        "{table}"
    );
    assert!(
        table.lines().any(|l| l.starts_with("default")
            && l.contains("test-1")
            && l.contains("Pod")
            && l.contains("test-pod")),
        "{table}"
    );

    let yaml = k
        .run(&["get", "polr", "-n", "default", "-o", "yaml"])
        .unwrap();
    assert!(
        yaml.contains("kind: List")
            && yaml.contains("policy: validate-images")
            && yaml.contains("resourceVersion:"),
        "{yaml}"
    );

    let cluster = k.run(&["get", "cpolr"]).unwrap();
    assert!(
        cluster.contains("cluster-scan") && cluster.contains("Node"),
        "{cluster}"
    );
    let eph = k.run(&["get", "ephr", "-A"]).unwrap();
    let eph_header: Vec<&str> = eph.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        eph_header,
        [
            "NAMESPACE",
            "NAME",
            "SOURCE",
            "GROUP",
            "KIND",
            "OWNER",
            "PASS",
            "FAIL",
            "WARN",
            "ERROR",
            "SKIP",
            "AGE"
        ],
        "{eph}"
    );
    assert!(eph.contains("admission") && eph.contains("web-0"), "{eph}");

    // Label selectors.
    let selected = k
        .run(&[
            "get",
            "polr",
            "-A",
            "-l",
            "app.kubernetes.io/managed-by=kyverno",
            "-o",
            "name",
        ])
        .unwrap();
    assert_eq!(selected.trim(), "policyreport.wgpolicyk8s.io/test-2");
    let none = k
        .run(&[
            "get",
            "polr",
            "-A",
            "-l",
            "app.kubernetes.io/managed-by notin (kyverno)",
            "-o",
            "name",
        ])
        .unwrap();
    assert_eq!(none.trim(), "policyreport.wgpolicyk8s.io/test-1");

    // Watch: a change made while `kubectl get -w` runs shows up.
    let mut watch = k
        .spawn(&["get", "polr", "-n", "default", "-w", "-o", "name"])
        .unwrap();
    let stdout = watch.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut lines = Vec::new();
    while lines.len() < 2 && Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            lines.push(l);
        }
    }
    assert_eq!(lines.len(), 2, "initial list of the watch: {lines:?}");
    k.run(&["apply", "-f", &format!("{FIXTURES}/peer/report-3.yaml")])
        .unwrap();
    let mut saw = false;
    while Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200))
            && l.contains("test-3")
        {
            saw = true;
            break;
        }
    }
    let _ = watch.kill();
    let _ = watch.wait();
    assert!(saw, "kubectl get -w did not show test-3");

    // Update through apply (merge patch) and delete (kubectl waits with a field-selected watch).
    let configured = k
        .run(&["apply", "-f", &format!("{FIXTURES}/peer/report-2.yaml")])
        .unwrap();
    assert!(configured.contains("test-2 configured"), "{configured}");
    let scope = k
        .run(&[
            "get",
            "polr",
            "-n",
            "default",
            "test-2",
            "-o",
            "jsonpath={.scope.name}",
        ])
        .unwrap();
    assert_eq!(scope, "test-pod-2");
    let deleted = k
        .run(&["delete", "polr", "-n", "default", "test-1"])
        .unwrap();
    assert!(deleted.contains("deleted"), "{deleted}");
    let gone = k
        .output(&["get", "polr", "-n", "default", "test-1"], None)
        .unwrap();
    assert!(
        !gone.status.success() && String::from_utf8_lossy(&gone.stderr).contains("NotFound"),
        "{gone:?}"
    );

    // Explain works from our OpenAPI v3.
    let explain = k.run(&["explain", "policyreport.results.result"]).unwrap();
    assert!(
        explain.contains("pass") || explain.contains("Result indicates"),
        "{explain}"
    );

    // Anything without our client certificate is 401; health endpoints are open.
    let anonymous = tempfile::NamedTempFile::new().unwrap();
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: u\n  user:\n    token: not-a-real-token\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\n",
        server.url(),
        dir.path().join("ca.crt").display()
    );
    std::fs::write(anonymous.path(), kubeconfig).unwrap();
    let denied = Kubectl::new(anonymous.path())
        .output(&["get", "polr", "-A"], None)
        .unwrap();
    assert!(!denied.status.success());
    // kubectl's wording for a 401 Unauthorized.
    let stderr = String::from_utf8_lossy(&denied.stderr);
    assert!(
        stderr.contains("provide credentials") || stderr.contains("Unauthorized"),
        "{stderr}"
    );
    let livez = Kubectl::new(anonymous.path())
        .run(&["get", "--raw", "/livez"])
        .unwrap();
    assert_eq!(livez.trim(), "ok");
    let readyz = k.run(&["get", "--raw", "/readyz"]).unwrap();
    assert_eq!(readyz.trim(), "ok");
}
