//! Reports of realistic shapes at any size, for the big-report test and benchmark: Kyverno's
//! namespace reports of ~1,000 results and Trivy's vulnerability reports of several MB (one
//! result per vulnerability), which outgrow etcd's 1.5 MiB object limit.

use anyhow::{Context as _, Result, ensure};
use serde_json::{Value, json};

/// The namespace the reports are in.
pub const NS: &str = "default";
/// The API version of the reports.
pub const GROUP_VERSION: &str = "wgpolicyk8s.io/v1alpha2";

/// Bytes of the compact JSON, as sent.
pub fn json_len(v: &Value) -> usize {
    serde_json::to_vec(v).expect("JSON values serialize").len()
}

pub fn timestamp(i: usize) -> Value {
    json!({"seconds": 1_700_000_000 + i as i64, "nanos": (i % 1000) as i64 * 1_000_000})
}

pub fn uid(i: usize) -> String {
    format!("{:08x}-7c1e-4b2a-9f3d-{:012x}", i * 7919, i)
}

/// `summary` as the producers compute it: the results counted by outcome.
pub fn summary(results: &[Value]) -> Value {
    let count = |r: &str| results.iter().filter(|x| x["result"] == r).count();
    json!({
        "pass": count("pass"),
        "fail": count("fail"),
        "warn": count("warn"),
        "error": count("error"),
        "skip": count("skip"),
    })
}

pub fn envelope(name: &str, source: &str, scope: Option<Value>) -> Value {
    let mut report = json!({
        "apiVersion": GROUP_VERSION,
        "kind": "PolicyReport",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app.kubernetes.io/managed-by": source, "e2e.reports-server.io/suite": "big"},
        },
        "summary": summary(&[]),
        "results": [],
    });
    if let Some(scope) = scope {
        report["scope"] = scope;
    }
    report
}

/// One result of a Kyverno namespace report: policy, rule, outcome and the resource checked.
pub fn kyverno_result(i: usize) -> Value {
    const POLICIES: [(&str, &str, &str); 6] = [
        (
            "disallow-privileged-containers",
            "privileged-containers",
            "Pod Security Standards (Baseline)",
        ),
        (
            "disallow-host-namespaces",
            "host-namespaces",
            "Pod Security Standards (Baseline)",
        ),
        (
            "require-run-as-nonroot",
            "run-as-non-root",
            "Pod Security Standards (Restricted)",
        ),
        (
            "restrict-image-registries",
            "validate-registries",
            "Best Practices",
        ),
        ("require-pod-probes", "validate-probes", "Best Practices"),
        (
            "disallow-latest-tag",
            "validate-image-tag",
            "Best Practices",
        ),
    ];
    let (policy, rule, category) = POLICIES[i % POLICIES.len()];
    let pod = format!("worker-{}-{:05x}", i / POLICIES.len(), i * 31);
    let (result, message) = if i % 5 == 3 {
        (
            "fail",
            format!(
                "validation error: the policy {policy} forbids this pod spec. rule {rule} failed \
                 at path /spec/containers/{}/",
                i % 3
            ),
        )
    } else {
        ("pass", format!("validation rule '{rule}' passed."))
    };
    json!({
        "source": "kyverno",
        "policy": policy,
        "rule": rule,
        "result": result,
        "scored": true,
        "severity": if i.is_multiple_of(2) { "medium" } else { "high" },
        "category": category,
        "message": message,
        "timestamp": timestamp(i),
        "resources": [{"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": NS, "uid": uid(i)}],
    })
}

/// A Kyverno-like namespace report of `n` results, each naming its resource.
pub fn kyverno_report(name: &str, n: usize) -> Value {
    let results: Vec<Value> = (0..n).map(kyverno_result).collect();
    let mut report = envelope(name, "kyverno", None);
    report["summary"] = summary(&results);
    report["results"] = Value::Array(results);
    report
}

/// One vulnerability of a Trivy image scan: policy = CVE, rule = package.
pub fn trivy_result(i: usize) -> Value {
    const PACKAGES: [&str; 8] = [
        "libssl3",
        "openssl",
        "libc6",
        "zlib1g",
        "libcurl4",
        "libxml2",
        "busybox",
        "libexpat1",
    ];
    const SEVERITIES: [(&str, &str, &str); 4] = [
        ("critical", "fail", "9.8"),
        ("high", "fail", "7.5"),
        ("medium", "warn", "5.3"),
        ("low", "warn", "3.1"),
    ];
    let package = PACKAGES[i % PACKAGES.len()];
    let (severity, result, score) = SEVERITIES[(i / 3) % SEVERITIES.len()];
    let cve = format!("CVE-20{}-{:05}", 19 + i % 6, 1000 + i);
    let message = format!(
        "{package}: {cve} in the {package} package of the scanned image. A crafted input can make \
         the library read past the end of a buffer while parsing, which crashes the process or \
         discloses memory; remote exploitation needs a service that passes untrusted data to the \
         affected function. Upgrade {package} to the fixed version shown in the properties."
    );
    json!({
        "source": "Trivy",
        "policy": cve,
        "rule": package,
        "result": result,
        "severity": severity,
        "category": "Vulnerability Scan",
        "message": message,
        "properties": {
            "installedVersion": format!("3.0.{}-0ubuntu1.{}", i % 9, i % 13),
            "fixedVersion": format!("3.0.{}-0ubuntu1.{}", i % 9, i % 13 + 1),
            "primaryLink": format!("https://avd.aquasec.com/nvd/{}", cve.to_lowercase()),
            "score": score,
            "resource": package,
        },
        "timestamp": timestamp(i),
    })
}

/// A Trivy-shaped vulnerability report whose compact JSON is exactly `bytes` long: results are
/// added while they fit, then the last message is padded to the exact size.
pub fn trivy_report(name: &str, bytes: usize) -> Result<Value> {
    let scope = json!({
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "name": format!("{name}-7d4b9c8f6d"),
        "namespace": NS,
    });
    let mut report = envelope(name, "trivy-operator", Some(scope));
    // Room for the summary's figures, which grow from 0 to the final counts.
    let mut size = json_len(&report) + 64;
    let mut results = Vec::new();
    loop {
        let r = trivy_result(results.len());
        let len = json_len(&r) + 1;
        if size + len > bytes {
            break;
        }
        size += len;
        results.push(r);
    }
    ensure!(
        !results.is_empty(),
        "{bytes} bytes are too few for a report"
    );
    report["summary"] = summary(&results);
    report["results"] = Value::Array(results);
    let short = bytes
        .checked_sub(json_len(&report))
        .with_context(|| format!("{name}: the estimate overshot {bytes} bytes"))?;
    let last = report["results"]
        .as_array_mut()
        .and_then(|r| r.last_mut())
        .expect("at least one result");
    let pad: String = " See the advisory.".chars().cycle().take(short).collect();
    let message = format!("{}{pad}", last["message"].as_str().unwrap_or_default());
    last["message"] = json!(message);
    ensure!(
        json_len(&report) == bytes,
        "{name}: padding missed {bytes} bytes"
    );
    Ok(report)
}
