//! Our chart's monitoring and analytics values rendered by `helm template` (pure rendering, no
//! cluster, as `kyverno_chart.rs` renders Kyverno's): by default no Prometheus Operator object,
//! no binding and no extra NetworkPolicy peer; with the values of the chart README's "Scraping
//! /metrics" section, a ServiceMonitor on the servers' HTTPS port with the Prometheus' token
//! and the given TLS settings, a PodMonitor on the operator's metrics port, a ClusterRoleBinding
//! of the named account to the shipped `reports-server:metrics-reader` (which grants `get` on
//! `/metrics` only), and `networkPolicy.postgresFrom` among the PostgreSQL's peers. Values of
//! the wrong shape are refused by `values.schema.json`. (`e2e_operator.rs` dry-runs the chart
//! against a real kube-apiserver; the Prometheus Operator's kinds are not served there.)
//!
//! Needs the helm of `tests/tools/build.sh`; a missing one fails with what to run.

use anyhow::{Context, Result, ensure};
use reports_server_tests::{
    controlplane::workspace_root,
    operator::{helm, yaml_docs},
    tools::tool,
};
use serde_json::{Value, json};

const NS: &str = "reports-server";

fn find<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

async fn render(values: Option<&str>) -> Result<Result<Vec<Value>, String>> {
    let helm_bin = tool("helm").await?;
    let tmp = tempfile::tempdir()?;
    let chart = workspace_root().join("manifests/helm/reports-server");
    let mut args = vec![
        "template".to_owned(),
        "reports-server".to_owned(),
        chart.display().to_string(),
        "--namespace".to_owned(),
        NS.to_owned(),
    ];
    if let Some(values) = values {
        let file = tmp.path().join("values.yaml");
        std::fs::write(&file, values)?;
        args.extend(["--values".to_owned(), file.display().to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // A kubeconfig that does not exist keeps the user's out of it.
    Ok(
        match helm(&helm_bin, &tmp.path().join("no-kubeconfig"), &args) {
            Ok(out) => Ok(yaml_docs(&out)?),
            Err(e) => Err(format!("{e:#}")),
        },
    )
}

#[tokio::test]
async fn monitoring_objects_only_when_asked_and_as_documented() -> Result<()> {
    let plain = render(None).await?.map_err(anyhow::Error::msg)?;
    for kind in ["ServiceMonitor", "PodMonitor", "ClusterRoleBinding"] {
        let names: Vec<&Value> = find(&plain, kind)
            .into_iter()
            .filter(|d| {
                kind != "ClusterRoleBinding" || d["metadata"]["name"] != "reports-server-operator"
            })
            .collect();
        ensure!(names.is_empty(), "{kind} rendered by default: {names:#?}");
    }
    let reader = plain
        .iter()
        .find(|d| {
            d["kind"] == "ClusterRole" && d["metadata"]["name"] == "reports-server:metrics-reader"
        })
        .context("the chart ships reports-server:metrics-reader")?;
    ensure!(
        reader["rules"] == json!([{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]),
        "reports-server:metrics-reader grants more than get /metrics: {}",
        reader["rules"]
    );

    let values = r#"
networkPolicy:
  enabled: true
  postgresFrom: [{podSelector: {matchLabels: {team: analysts}}}]
metrics:
  serviceMonitor:
    enabled: true
    interval: 1m
    labels: {release: kube-prometheus-stack}
    tlsConfig: {ca: {secret: {name: reports-server-tls, key: ca.crt}}, serverName: reports-server.reports-server.svc}
  podMonitor:
    enabled: true
  scraper:
    serviceAccountName: kube-prometheus-stack-prometheus
    namespace: monitoring
"#;
    let endpoint = |docs: &[Value]| {
        find(docs, "ServiceMonitor")
            .first()
            .map(|m| m["spec"]["endpoints"][0].clone())
            .unwrap_or_default()
    };
    // Prometheus sends its own token: without a CA the render fails, unless the certificate is
    // left unverified explicitly (the chart cannot know each CA); a given tlsConfig replaces the
    // default whole (Helm would merge maps: checked below).
    let refused = render(Some("metrics: {serviceMonitor: {enabled: true}}")).await?;
    ensure!(
        refused
            .as_ref()
            .is_err_and(|e| e.contains("metrics.serviceMonitor.tlsConfig is required")),
        "{refused:?}"
    );
    let unverified = render(Some(
        "metrics: {serviceMonitor: {enabled: true, tlsConfig: {insecureSkipVerify: true}}}",
    ))
    .await?
    .map_err(anyhow::Error::msg)?;
    ensure!(
        endpoint(&unverified)["tlsConfig"] == json!({"insecureSkipVerify": true}),
        "{}",
        endpoint(&unverified)
    );
    let docs = render(Some(values)).await?.map_err(anyhow::Error::msg)?;
    let monitor = find(&docs, "ServiceMonitor");
    ensure!(monitor.len() == 1, "{monitor:#?}");
    let monitor = monitor[0];
    // Not `reports-server`, the name of a ReportsServer `reports-server`'s own ServiceMonitor.
    ensure!(
        monitor["metadata"]["name"] == "reports-server-chart",
        "{monitor}"
    );
    ensure!(
        monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack",
        "{monitor}"
    );
    ensure!(
        monitor["spec"]["selector"]["matchLabels"]
            == json!({"app.kubernetes.io/name": "reports-server", "app.kubernetes.io/managed-by": "reports-server-operator"}),
        "{monitor}"
    );
    let endpoint = &monitor["spec"]["endpoints"][0];
    for (key, want) in [
        ("port", json!("https")),
        ("scheme", json!("https")),
        ("path", json!("/metrics")),
        ("interval", json!("1m")),
        ("scrapeTimeout", json!("10s")),
        (
            "bearerTokenFile",
            json!("/var/run/secrets/kubernetes.io/serviceaccount/token"),
        ),
        (
            "tlsConfig",
            json!({"ca": {"secret": {"name": "reports-server-tls", "key": "ca.crt"}}, "serverName": "reports-server.reports-server.svc"}),
        ),
    ] {
        ensure!(
            endpoint[key] == want,
            "endpoint {key}: {} (want {want})",
            endpoint[key]
        );
    }
    let pod_monitor = find(&docs, "PodMonitor");
    ensure!(
        pod_monitor.len() == 1
            && pod_monitor[0]["metadata"]["name"] == "reports-server-operator"
            && pod_monitor[0]["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
                == "reports-server-operator"
            && pod_monitor[0]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics",
        "{pod_monitor:#?}"
    );
    let binding = docs
        .iter()
        .find(|d| {
            d["kind"] == "ClusterRoleBinding"
                && d["roleRef"]["name"] == "reports-server:metrics-reader"
        })
        .context("no binding of the scraper")?;
    ensure!(
        binding["subjects"]
            == json!([{"kind": "ServiceAccount", "name": "kube-prometheus-stack-prometheus", "namespace": "monitoring"}]),
        "{binding}"
    );
    let postgres = docs
        .iter()
        .find(|d| {
            d["kind"] == "NetworkPolicy" && d["metadata"]["name"] == "reports-server-postgres"
        })
        .context("the PostgreSQL's NetworkPolicy")?;
    let peers = &postgres["spec"]["ingress"][0]["from"];
    for peer in [
        json!({"podSelector": {"matchLabels": {"app.kubernetes.io/name": "reports-server"}}}),
        json!({"podSelector": {"matchLabels": {"app.kubernetes.io/name": "reports-server-operator"}}}),
        json!({"podSelector": {"matchLabels": {"team": "analysts"}}}),
    ] {
        ensure!(
            peers.as_array().is_some_and(|p| p.contains(&peer)),
            "{peer} not among the PostgreSQL's peers: {peers}"
        );
    }

    // The scraper without a namespace: the release's.
    let docs = render(Some("metrics: {scraper: {serviceAccountName: prometheus}}"))
        .await?
        .map_err(anyhow::Error::msg)?;
    ensure!(
        docs.iter().any(|d| d["kind"] == "ClusterRoleBinding"
            && d["subjects"][0]["namespace"] == NS
            && d["subjects"][0]["name"] == "prometheus"),
        "the scraper's namespace defaults to the release's"
    );

    // Wrong shapes are refused before anything renders.
    for bad in [
        "metrics: {serviceMonitor: {interval: often}}",
        "metrics: {serviceMonitor: {labels: {a: 1}}}",
        "metrics: {serviceMonitors: {enabled: true}}",
    ] {
        let refused = render(Some(bad)).await?;
        ensure!(
            refused.as_ref().is_err_and(|e| e.contains("schema")),
            "{bad} was not refused by values.schema.json: {refused:?}"
        );
    }
    Ok(())
}
