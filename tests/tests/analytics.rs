//! `reports-server query`'s named questions and the analytics views (docs/analytics.md) on
//! SQLite, PostgreSQL and MariaDB: each answer equals what the test computes from the fixtures
//! it seeded (Pod Security Standards reports across namespaces, Trivy-shaped vulnerability
//! reports, a second cluster), and `--sql` cannot write.
//!
//! `REPORTS_SERVER_ANALYTICS_KEEP=DIR` leaves the SQLite fixture database in `DIR/reports.db`,
//! for `reports-server query --data-dir DIR …` (the outputs shown in docs/analytics.md).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;

use reports_server_analytics::{
    self as analytics, AnalyticsError, Grouping, Output, Question, ResultFilter, Table,
};
use reports_server_apiserver::statistics::{
    Clock, StatisticsMetrics, StatisticsOptions, StatisticsWorker,
};
use reports_server_apiserver::store::statistics::SnapshotOutcome;
use reports_server_apiserver::store::{Mutation, Store, StoreError, StoreOptions};
use reports_server_crds::catalog::POLICY_REPORT;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use reports_server_tests::Backend;
use sea_orm::DatabaseConnection;
use serde_json::{Value, json};

const CLUSTER: &str = "default";
const OTHER_CLUSTER: &str = "staging";
const TIMESTAMP: i64 = 1_764_300_000;

/// One stored report: its cluster and its body.
struct Fixture {
    cluster: &'static str,
    report: Value,
}

/// A Pod Security Standards report on `pod-<n>` in `namespace` with the rules at `failing`
/// failing, written `age` seconds before [`TIMESTAMP`].
fn pss(cluster: &'static str, namespace: &str, n: u64, failing: &[usize], age: i64) -> Fixture {
    let subject = Subject::pod(namespace, n);
    let mut report = serde_json::to_value(pss_policy_report(&subject, TIMESTAMP - age, failing))
        .expect("a fixture serializes");
    report["metadata"]["uid"] = json!(format!("report-{n}"));
    report["metadata"]["creationTimestamp"] = json!("2026-11-28T00:00:00Z");
    Fixture { cluster, report }
}

/// A vulnerability: ID, package, installed and fixed version, severity, CVSS score.
type Vulnerability = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
);

/// A Trivy-shaped report, as trivy-operator's VulnerabilityReports look once written as a
/// PolicyReport (policy-reporter's Trivy plugin, the trivy-operator-polr-adapter): scope the
/// workload, one result per vulnerability, `fail` for critical and high, `warn` below, the
/// details as string properties.
fn trivy(
    namespace: &str,
    deployment: &str,
    image: &str,
    vulnerabilities: &[Vulnerability],
) -> Fixture {
    let results: Vec<Value> = vulnerabilities
        .iter()
        .map(|(id, package, installed, fixed, severity, score)| {
            let failing = matches!(*severity, "critical" | "high");
            json!({
                "source": "Trivy Vulnerability",
                "policy": id,
                "rule": package,
                "category": "Vulnerability Scan",
                "severity": severity,
                "result": if failing { "fail" } else { "warn" },
                "timestamp": {"seconds": TIMESTAMP, "nanos": 0},
                "message": format!("{package} {installed}: {id}"),
                "properties": {
                    "vulnerabilityID": id,
                    "resource": package,
                    "installedVersion": installed,
                    "fixedVersion": fixed,
                    "score": score,
                    "artifact.repository": image,
                    "primaryURL": format!("https://avd.aquasec.com/nvd/{}", id.to_lowercase()),
                },
            })
        })
        .collect();
    let mut summary = json!({"pass": 0, "fail": 0, "warn": 0, "error": 0, "skip": 0});
    for result in &results {
        let outcome = result["result"].as_str().unwrap();
        summary[outcome] = json!(summary[outcome].as_i64().unwrap() + 1);
    }
    let report = json!({
        "apiVersion": "wgpolicyk8s.io/v1alpha2",
        "kind": "PolicyReport",
        "metadata": {
            "name": format!("trivy-vuln-deployment-{deployment}"),
            "namespace": namespace,
            "uid": format!("trivy-{namespace}-{deployment}"),
            "creationTimestamp": "2026-11-28T00:00:00Z",
            "labels": {"app.kubernetes.io/created-by": "trivy-operator-polr-adapter"},
        },
        "scope": {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "namespace": namespace,
            "name": deployment,
            "uid": format!("deployment-{namespace}-{deployment}"),
        },
        "summary": summary,
        "results": results,
    });
    Fixture {
        cluster: CLUSTER,
        report,
    }
}

fn fixtures() -> Vec<Fixture> {
    let mut all = vec![
        pss(CLUSTER, "team-a", 1, &[0, 3, 5], 0),
        pss(CLUSTER, "team-a", 2, &[0], 0),
        pss(CLUSTER, "team-a", 3, &[], 0),
        pss(CLUSTER, "team-b", 4, &[0, 1, 2, 3, 4, 5, 6], 0),
        pss(CLUSTER, "team-b", 5, &[3], 0),
        pss(CLUSTER, "payments", 6, &[2, 8], 0),
        pss(OTHER_CLUSTER, "team-a", 7, &[0, 1], 0),
    ];
    // A property name with a quote and a backslash: MySQL's view builds a JSON path from it.
    all.last_mut().unwrap().report["results"][0]["properties"]["odd\"key\\"] = json!("kept");
    // pod-2 reported a second time, an hour earlier, under another name: `latest_results`
    // keeps the newer result of each rule.
    let mut stale = pss(CLUSTER, "team-a", 2, &[0, 1, 2], 3600);
    stale.report["metadata"]["name"] = json!("pod-2-previous-scan");
    stale.report["metadata"]["uid"] = json!("report-2-previous");
    all.push(stale);
    all.extend([
        trivy(
            "team-a",
            "web",
            "library/nginx",
            &[
                (
                    "CVE-2024-6119",
                    "libssl3",
                    "3.0.11-1",
                    "3.0.14-1",
                    "high",
                    "7.5",
                ),
                (
                    "CVE-2024-45490",
                    "libexpat1",
                    "2.5.0-1",
                    "2.5.0-1+deb12u1",
                    "critical",
                    "9.8",
                ),
                (
                    "CVE-2023-50387",
                    "libsystemd0",
                    "252.17-1",
                    "252.23-1",
                    "high",
                    "8.1",
                ),
                (
                    "CVE-2024-2511",
                    "libssl3",
                    "3.0.11-1",
                    "3.0.14-1",
                    "medium",
                    "5.9",
                ),
            ],
        ),
        trivy(
            "payments",
            "checkout",
            "payments/checkout",
            &[
                (
                    "CVE-2024-45490",
                    "libexpat1",
                    "2.5.0-1",
                    "2.5.0-1+deb12u1",
                    "critical",
                    "9.8",
                ),
                (
                    "CVE-2024-37371",
                    "libkrb5-3",
                    "1.20.1-2",
                    "1.20.1-2+deb12u2",
                    "critical",
                    "9.1",
                ),
                (
                    "CVE-2024-28182",
                    "libnghttp2-14",
                    "1.52.0-1",
                    "1.52.0-1+deb12u2",
                    "medium",
                    "5.3",
                ),
                // A score that is not a number never matches a numeric condition.
                ("TEMP-0841856", "bash", "5.2.15-2", "", "low", "N/A"),
            ],
        ),
    ]);
    all
}

async fn seed(url: &str) -> Vec<Fixture> {
    let fixtures = fixtures();
    for cluster in [CLUSTER, OTHER_CLUSTER] {
        let mut options = StoreOptions::new(url.to_owned());
        options.cluster_id = cluster.into();
        let store = Store::connect(options).await.expect("the store opens");
        for fixture in fixtures.iter().filter(|f| f.cluster == cluster) {
            let namespace = fixture.report["metadata"]["namespace"].as_str().unwrap();
            let name = fixture.report["metadata"]["name"].as_str().unwrap();
            store
                .mutate::<StoreError, _>(&POLICY_REPORT, namespace, name, false, |_| {
                    Ok(Mutation::Put(fixture.report.clone()))
                })
                .await
                .expect("a fixture is stored");
        }
    }
    fixtures
}

/// One result as the views see it: the report's namespace, the subject (its own or the
/// report's scope), the rule, the outcome, the properties.
#[derive(Clone, Debug)]
struct Row {
    cluster: &'static str,
    namespace: String,
    kind: String,
    subject_namespace: String,
    subject: String,
    source: String,
    policy: String,
    rule: String,
    result: String,
    severity: String,
    timestamp: i64,
    properties: BTreeMap<String, String>,
}

fn rows(fixtures: &[Fixture]) -> Vec<Row> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let mut rows = Vec::new();
    for fixture in fixtures {
        let report = &fixture.report;
        for result in report["results"].as_array().unwrap() {
            let subject = result["resources"].get(0).unwrap_or(&report["scope"]);
            rows.push(Row {
                cluster: fixture.cluster,
                namespace: text(&report["metadata"]["namespace"]),
                kind: text(&subject["kind"]),
                subject_namespace: text(&subject["namespace"]),
                subject: text(&subject["name"]),
                source: text(&result["source"]),
                policy: text(&result["policy"]),
                rule: text(&result["rule"]),
                result: text(&result["result"]),
                severity: text(&result["severity"]),
                timestamp: result["timestamp"]["seconds"].as_i64().unwrap(),
                properties: serde_json::from_value(result["properties"].clone()).unwrap(),
            });
        }
    }
    rows
}

fn column(table: &Table, name: &str) -> usize {
    table
        .columns
        .iter()
        .position(|c| c == name)
        .unwrap_or_else(|| panic!("no column {name} in {:?}", table.columns))
}

fn text_of(table: &Table, row: &[Value], name: &str) -> String {
    match &row[column(table, name)] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Two text columns of every row, in the table's order.
fn text_pairs(table: &Table, first: &str, second: &str) -> Vec<(String, String)> {
    table
        .rows
        .iter()
        .map(|r| (text_of(table, r, first), text_of(table, r, second)))
        .collect()
}

fn number_of(table: &Table, row: &[Value], name: &str) -> i64 {
    row[column(table, name)]
        .as_i64()
        .unwrap_or_else(|| panic!("{name} is not an integer: {row:?}"))
}

fn filter() -> ResultFilter {
    ResultFilter {
        cluster_id: CLUSTER.into(),
        ..ResultFilter::default()
    }
}

async fn ask(db: &DatabaseConnection, question: Question) -> Table {
    analytics::run_question(db, &question)
        .await
        .unwrap_or_else(|e| panic!("{question:?}: {e}"))
}

async fn failing_results(db: &DatabaseConnection, all: &[Row], backend: Backend) {
    let narrowed = ResultFilter {
        policy: Some("disallow-host-namespaces".into()),
        namespace: Some("team-b".into()),
        kind: Some("Pod".into()),
        severity: Some("medium".into()),
        ..filter()
    };
    let by_source = ResultFilter {
        source: Some("Trivy Vulnerability".into()),
        category: Some("Vulnerability Scan".into()),
        ..filter()
    };
    for filter in [filter(), narrowed, by_source] {
        let answer = ask(
            db,
            Question::Failing {
                filter: filter.clone(),
                limit: 1000,
            },
        )
        .await;
        let got: Vec<(String, String, String, String)> = answer
            .rows
            .iter()
            .map(|r| {
                let t = |c| text_of(&answer, r, c);
                (t("namespace"), t("subject_name"), t("policy"), t("rule"))
            })
            .collect();
        let same = |want: &Option<String>, have: &str| want.as_deref().is_none_or(|w| w == have);
        let mut want: Vec<(String, String, String, String)> = all
            .iter()
            .filter(|r| r.cluster == CLUSTER && r.result == "fail")
            .filter(|r| same(&filter.policy, &r.policy) && same(&filter.namespace, &r.namespace))
            .filter(|r| same(&filter.kind, &r.kind) && same(&filter.severity, &r.severity))
            .filter(|r| same(&filter.source, &r.source))
            .map(|r| {
                (
                    r.namespace.clone(),
                    r.subject.clone(),
                    r.policy.clone(),
                    r.rule.clone(),
                )
            })
            .collect();
        want.sort();
        let mut sorted = got.clone();
        sorted.sort();
        assert_eq!(sorted, want, "{backend:?} {filter:?}");
        assert!(
            !want.is_empty(),
            "{filter:?}: the fixtures have such failures"
        );
        // Ordered by namespace first (then kind, subject, policy, rule).
        assert!(got.windows(2).all(|w| w[0].0 <= w[1].0), "{got:?}");
    }
    let limited = ask(
        db,
        Question::Failing {
            filter: filter(),
            limit: 3,
        },
    )
    .await;
    assert_eq!(limited.rows.len(), 3, "{backend:?}: --limit");
}

/// pass, fail, warn, error, skip, total of `rows`.
fn counts<'r>(rows: impl Iterator<Item = &'r Row>) -> [i64; 6] {
    let mut counts = [0; 6];
    for row in rows {
        let i = ["pass", "fail", "warn", "error", "skip"]
            .iter()
            .position(|o| *o == row.result)
            .unwrap();
        counts[i] += 1;
        counts[5] += 1;
    }
    counts
}

fn check_counters(table: &Table, row: &[Value], want: [i64; 6], context: &str) {
    let got: Vec<i64> = ["pass", "fail", "warn", "error", "skip", "total"]
        .iter()
        .map(|c| number_of(table, row, c))
        .collect();
    assert_eq!(got, want, "{context}");
    let judged = (want[0] + want[1] + want[2] + want[3]) as f64;
    let ratio = row[column(table, "ratio")].as_f64().expect("a ratio");
    assert!(
        (ratio - want[0] as f64 / judged).abs() < 1e-9,
        "{context}: {ratio}"
    );
}

async fn compliance(db: &DatabaseConnection, all: &[Row], backend: Backend) {
    let ask_by = |by, filter| Question::Compliance { by, filter };
    let by_namespace = ask(db, ask_by(Grouping::Namespace, filter())).await;
    let namespaces: BTreeSet<&str> = all
        .iter()
        .filter(|r| r.cluster == CLUSTER)
        .map(|r| r.namespace.as_str())
        .collect();
    assert_eq!(by_namespace.rows.len(), namespaces.len(), "{backend:?}");
    for row in &by_namespace.rows {
        let namespace = text_of(&by_namespace, row, "namespace");
        let want = counts(
            all.iter()
                .filter(|r| r.cluster == CLUSTER && r.namespace == namespace),
        );
        check_counters(
            &by_namespace,
            row,
            want,
            &format!("{backend:?} {namespace}"),
        );
    }
    let one = ResultFilter {
        namespace: Some("payments".into()),
        ..filter()
    };
    assert_eq!(
        ask(db, ask_by(Grouping::Namespace, one)).await.rows.len(),
        1
    );

    let kyverno = ResultFilter {
        source: Some("kyverno".into()),
        ..filter()
    };
    let by_policy = ask(db, ask_by(Grouping::Policy, kyverno)).await;
    let policies: BTreeSet<&str> = all
        .iter()
        .filter(|r| r.cluster == CLUSTER && r.source == "kyverno")
        .map(|r| r.policy.as_str())
        .collect();
    assert_eq!(by_policy.rows.len(), policies.len(), "{backend:?}");
    for row in &by_policy.rows {
        let policy = text_of(&by_policy, row, "policy");
        let want = counts(
            all.iter()
                .filter(|r| r.cluster == CLUSTER && r.source == "kyverno" && r.policy == policy),
        );
        check_counters(&by_policy, row, want, &format!("{backend:?} {policy}"));
    }

    // `--cluster-id all`: every cluster's namespaces, each row naming its cluster.
    let every = ResultFilter {
        cluster_id: analytics::ALL_CLUSTERS.into(),
        ..ResultFilter::default()
    };
    let fleet = ask(db, ask_by(Grouping::Namespace, every.clone())).await;
    let pairs: BTreeSet<(String, String)> = all
        .iter()
        .map(|r| (r.cluster.to_owned(), r.namespace.clone()))
        .collect();
    assert_eq!(
        text_pairs(&fleet, "cluster_id", "namespace"),
        pairs.iter().cloned().collect::<Vec<_>>(),
        "{backend:?}: every cluster's namespaces"
    );
    for row in &fleet.rows {
        let (cluster, namespace) = (
            text_of(&fleet, row, "cluster_id"),
            text_of(&fleet, row, "namespace"),
        );
        let want = counts(
            all.iter()
                .filter(|r| r.cluster == cluster && r.namespace == namespace),
        );
        check_counters(
            &fleet,
            row,
            want,
            &format!("{backend:?} {cluster}/{namespace}"),
        );
    }
    let failing_everywhere = ask(
        db,
        Question::Failing {
            filter: every,
            limit: 1000,
        },
    )
    .await;
    assert_eq!(
        failing_everywhere.rows.len(),
        all.iter().filter(|r| r.result == "fail").count(),
        "{backend:?}: failing results of every cluster"
    );

    let top_everywhere = ask(
        db,
        Question::TopFailing {
            filter: ResultFilter {
                cluster_id: analytics::ALL_CLUSTERS.into(),
                ..ResultFilter::default()
            },
            limit: 1000,
        },
    )
    .await;
    let failing_clusters: BTreeSet<String> = top_everywhere
        .rows
        .iter()
        .map(|r| text_of(&top_everywhere, r, "cluster_id"))
        .collect();
    let want: BTreeSet<String> = all
        .iter()
        .filter(|r| r.result == "fail")
        .map(|r| r.cluster.to_owned())
        .collect();
    assert_eq!(
        failing_clusters, want,
        "{backend:?}: top-failing of every cluster"
    );

    let by_cluster = ask(db, ask_by(Grouping::Cluster, filter())).await;
    let clusters: Vec<String> = by_cluster
        .rows
        .iter()
        .map(|r| text_of(&by_cluster, r, "cluster_id"))
        .collect();
    assert_eq!(clusters, [CLUSTER, OTHER_CLUSTER], "{backend:?}");
    for row in &by_cluster.rows {
        let cluster = text_of(&by_cluster, row, "cluster_id");
        let want = counts(all.iter().filter(|r| r.cluster == cluster));
        check_counters(&by_cluster, row, want, &format!("{backend:?} {cluster}"));
    }
}

async fn top_failing(db: &DatabaseConnection, all: &[Row], backend: Backend) {
    let answer = ask(
        db,
        Question::TopFailing {
            filter: filter(),
            limit: 3,
        },
    )
    .await;
    let mut per_resource: BTreeMap<(String, String, String), (i64, BTreeSet<String>)> =
        BTreeMap::new();
    for row in all
        .iter()
        .filter(|r| r.cluster == CLUSTER && r.result == "fail")
    {
        let entry = per_resource
            .entry((
                row.subject_namespace.clone(),
                row.subject.clone(),
                row.kind.clone(),
            ))
            .or_default();
        entry.0 += 1;
        entry.1.insert(row.policy.clone());
    }
    let mut want: Vec<_> = per_resource.into_iter().collect();
    want.sort_by(|a, b| b.1.0.cmp(&a.1.0).then(a.0.cmp(&b.0)));
    want.truncate(3);
    let got: Vec<(String, String, i64, i64)> = answer
        .rows
        .iter()
        .map(|r| {
            (
                text_of(&answer, r, "subject_namespace"),
                text_of(&answer, r, "subject_name"),
                number_of(&answer, r, "failures"),
                number_of(&answer, r, "policies"),
            )
        })
        .collect();
    let want: Vec<(String, String, i64, i64)> = want
        .into_iter()
        .map(|((ns, name, _), (failures, policies))| (ns, name, failures, policies.len() as i64))
        .collect();
    assert_eq!(got, want, "{backend:?}");
}

async fn properties(db: &DatabaseConnection, all: &[Row], backend: Backend) {
    // The CVSS question: every result scored 8.0 or more.
    let question = |conditions: &[&str]| Question::Properties {
        filter: filter(),
        conditions: conditions.iter().map(|c| c.parse().unwrap()).collect(),
        limit: 1000,
    };
    let score = |r: &Row| {
        r.properties
            .get("score")
            .and_then(|s| s.parse::<f64>().ok())
    };
    let answer = ask(db, question(&["score>=8.0"])).await;
    let got: BTreeSet<(String, String, String)> = answer
        .rows
        .iter()
        .map(|r| {
            let t = |c| text_of(&answer, r, c);
            (t("subject_name"), t("policy"), t("score"))
        })
        .collect();
    let want: BTreeSet<(String, String, String)> = all
        .iter()
        .filter(|r| r.cluster == CLUSTER && score(r).is_some_and(|s| s >= 8.0))
        .map(|r| {
            (
                r.subject.clone(),
                r.policy.clone(),
                r.properties["score"].clone(),
            )
        })
        .collect();
    assert_eq!(got, want, "{backend:?}");
    assert_eq!(got.len(), 4, "{backend:?}: 9.8 twice, 9.1, 8.1");

    let combined = ask(
        db,
        question(&["score<9", "installedVersion!=252.17-1", "score>-1"]),
    )
    .await;
    let want: usize = all
        .iter()
        .filter(|r| score(r).is_some_and(|s| s < 9.0))
        .filter(|r| r.properties["installedVersion"] != "252.17-1")
        .count();
    assert_eq!(combined.rows.len(), want, "{backend:?}: {combined:?}");

    let one = ask(
        db,
        question(&[
            "vulnerabilityID=CVE-2024-45490",
            "artifact.repository=payments/checkout",
        ]),
    )
    .await;
    assert_eq!(one.rows.len(), 1, "{backend:?}: {one:?}");
    assert_eq!(text_of(&one, &one.rows[0], "subject_name"), "checkout");
    assert_eq!(
        text_of(&one, &one.rows[0], "artifact.repository"),
        "payments/checkout"
    );
}

async fn views(db: &DatabaseConnection, all: &[Row], backend: Backend) {
    let sql = |s: &'static str| async move {
        analytics::run_sql(db, s)
            .await
            .unwrap_or_else(|e| panic!("{backend:?} {s}: {e}"))
    };
    // latest_results: one row per resource and rule, the newest.
    let latest = sql(
        "SELECT subject_name, policy, rule, result, timestamp FROM latest_results \
                      WHERE cluster_id = 'default'",
    )
    .await;
    let mut newest: BTreeMap<(String, String, String, String), (i64, String)> = BTreeMap::new();
    for row in all.iter().filter(|r| r.cluster == CLUSTER) {
        let key = (
            row.subject.clone(),
            row.source.clone(),
            row.policy.clone(),
            row.rule.clone(),
        );
        let entry = newest.entry(key).or_insert((i64::MIN, String::new()));
        if row.timestamp > entry.0 {
            *entry = (row.timestamp, row.result.clone());
        }
    }
    assert_eq!(latest.rows.len(), newest.len(), "{backend:?}");
    let stale_failures = latest
        .rows
        .iter()
        .filter(|r| text_of(&latest, r, "subject_name") == "pod-2")
        .filter(|r| text_of(&latest, r, "result") == "fail")
        .count();
    assert_eq!(
        stale_failures, 1,
        "{backend:?}: pod-2's newer scan fails one rule"
    );

    // result_properties: one row per result and property.
    let properties = sql("SELECT property, value FROM result_properties \
                          WHERE cluster_id = 'default' AND policy = 'CVE-2023-50387'")
    .await;
    let got: BTreeMap<String, String> = text_pairs(&properties, "property", "value")
        .into_iter()
        .collect();
    let want = &all
        .iter()
        .find(|r| r.policy == "CVE-2023-50387")
        .unwrap()
        .properties;
    assert_eq!(&got, want, "{backend:?}");
    // docs/analytics.md's CVSS question in SQL, as written there for each backend.
    let cvss = analytics::run_sql(db, documented_cvss_sql(backend))
        .await
        .unwrap();
    let want = all
        .iter()
        .filter(|r| r.cluster == CLUSTER)
        .filter_map(|r| r.properties.get("score")?.parse::<f64>().ok())
        .filter(|score| *score >= 8.0)
        .count();
    assert_eq!(cvss.rows.len(), want, "{backend:?}: {cvss:?}");
    let odd = sql("SELECT property, value FROM result_properties WHERE value = 'kept'").await;
    assert_eq!(
        odd.rows,
        [[json!("odd\"key\\"), json!("kept")]],
        "{backend:?}"
    );
    let total = sql("SELECT COUNT(*) AS n FROM result_properties").await;
    let want: usize = all.iter().map(|r| r.properties.len()).sum();
    assert_eq!(
        number_of(&total, &total.rows[0], "n"),
        want as i64,
        "{backend:?}"
    );
}

fn documented_cvss_sql(backend: Backend) -> &'static str {
    match backend {
        Backend::Sqlite => {
            "SELECT namespace, subject_name, policy, value AS score FROM result_properties \
             WHERE property = 'score' AND value GLOB '[0-9]*' AND CAST(value AS REAL) >= 8.0 \
             AND cluster_id = 'default'"
        }
        Backend::Postgres => {
            "SELECT namespace, subject_name, policy, value AS score FROM result_properties \
             WHERE property = 'score' AND CASE WHEN value ~ '^[0-9]+([.][0-9]+)?$' \
             THEN CAST(value AS DOUBLE PRECISION) END >= 8.0 AND cluster_id = 'default'"
        }
        Backend::MariaDb => {
            "SELECT namespace, subject_name, policy, value AS score FROM result_properties \
             WHERE property = 'score' AND value REGEXP '^[0-9]+([.][0-9]+)?$' \
             AND CAST(value AS DOUBLE) >= 8.0 AND cluster_id = 'default'"
        }
    }
}

async fn read_only(db: &DatabaseConnection, backend: Backend) {
    let count = "SELECT COUNT(*) AS n FROM objects";
    let before = analytics::run_sql(db, count).await.unwrap();
    let mut writes = vec!["DELETE FROM objects", "UPDATE store_state SET rv = rv + 1"];
    if backend == Backend::Sqlite {
        // SQLite runs every statement of the text: the file itself is open read-only.
        writes.push("PRAGMA query_only = OFF; DELETE FROM objects");
    }
    for write in writes {
        let error = analytics::run_sql(db, write).await.unwrap_err();
        assert!(
            matches!(error, AnalyticsError::AdHoc(_)),
            "{backend:?} {write}: {error:?}"
        );
        let told = error.to_string();
        assert!(
            told.contains("read-only transaction: statements that write are refused"),
            "{backend:?} {write}: {told}"
        );
        // The database's own words say why: PostgreSQL's and MySQL's read-only transaction,
        // SQLite's read-only database.
        let cause = std::error::Error::source(&error)
            .unwrap()
            .to_string()
            .to_lowercase();
        assert!(
            cause.contains("read") && cause.contains("only"),
            "{backend:?} {write}: {cause}"
        );
    }
    // Leaving the read-only transaction first: PostgreSQL and MySQL refuse a second statement
    // in a prepared query, SQLite's connection stays read-only.
    for escape in [
        "COMMIT; DELETE FROM objects",
        "SET TRANSACTION READ WRITE; DELETE FROM objects",
        "ROLLBACK; SET SESSION TRANSACTION READ WRITE; DELETE FROM objects",
    ] {
        let refused = analytics::run_sql(db, escape).await;
        assert!(refused.is_err(), "{backend:?} {escape}: {refused:?}");
    }
    let after = analytics::run_sql(db, count).await.unwrap();
    assert_eq!(after, before, "{backend:?}: nothing deleted");
    assert!(number_of(&after, &after.rows[0], "n") > 0);
}

async fn outputs(db: &DatabaseConnection, backend: Backend) {
    let answer = ask(
        db,
        Question::Compliance {
            by: Grouping::Namespace,
            filter: filter(),
        },
    )
    .await;
    let json: Value = serde_json::from_str(&answer.render(Output::Json).unwrap()).unwrap();
    let yaml: Value = serde_yaml::from_str(&answer.render(Output::Yaml).unwrap()).unwrap();
    assert_eq!(json, yaml, "{backend:?}");
    assert_eq!(json.as_array().unwrap().len(), answer.rows.len());
    let csv = answer.render(Output::Csv).unwrap();
    assert_eq!(
        csv.lines().count(),
        answer.rows.len() + 1,
        "{backend:?}: header and rows"
    );
    let table = answer.render(Output::Table).unwrap();
    assert!(table.starts_with("NAMESPACE"), "{table}");
}

#[tokio::test]
async fn named_questions_and_views_answer_from_the_fixtures_on_every_backend() {
    for backend in Backend::ALL {
        let temporary = tempfile::tempdir().unwrap();
        let keep = std::env::var_os("REPORTS_SERVER_ANALYTICS_KEEP").map(std::path::PathBuf::from);
        let dir = match (&keep, backend) {
            (Some(dir), Backend::Sqlite) => dir.clone(),
            _ => temporary.path().to_owned(),
        };
        let url = backend
            .database_url(&dir)
            .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"));
        let all = rows(&seed(&url).await);
        let db = analytics::connect_read_only(&url, std::time::Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{backend:?}: {e}"));
        failing_results(&db, &all, backend).await;
        compliance(&db, &all, backend).await;
        top_failing(&db, &all, backend).await;
        properties(&db, &all, backend).await;
        views(&db, &all, backend).await;
        read_only(&db, backend).await;
        outputs(&db, backend).await;
    }
}

/// `latest_results` at its edges, on a database of their own (the fixtures above feed the
/// documented outputs): results about no resource stay their report's, and a result without a
/// timestamp loses to one with on every backend (PostgreSQL sorts NULLs first).
#[tokio::test]
async fn latest_results_keeps_subjectless_results_and_prefers_timestamps() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let url = backend
            .database_url(dir.path())
            .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"));
        let store = Store::connect(StoreOptions::new(url.clone()))
            .await
            .expect("the store opens");
        let report = |name: &str, scope: Option<Value>, result: Value| {
            let mut r = json!({
                "apiVersion": "wgpolicyk8s.io/v1alpha2",
                "kind": "PolicyReport",
                "metadata": {"name": name, "namespace": "edges"},
                "results": [result],
            });
            if let Some(scope) = scope {
                r["scope"] = scope;
            }
            r
        };
        let bench = |outcome: &str| {
            json!({"policy": "cis", "rule": "1.1.1", "result": outcome, "source": "kube-bench",
                   "timestamp": {"seconds": TIMESTAMP, "nanos": 0}})
        };
        let pod = json!({"apiVersion": "v1", "kind": "Pod", "namespace": "edges", "name": "p"});
        let reports = [
            report("node-a", None, bench("pass")),
            report("node-b", None, bench("fail")),
            report("pod-z-timed", Some(pod.clone()), bench("pass")),
            report(
                // First by name: only its missing timestamp ranks it below the other.
                "pod-a-untimed",
                Some(pod),
                json!({"policy": "cis", "rule": "1.1.1", "result": "fail", "source": "kube-bench"}),
            ),
        ];
        for r in &reports {
            let name = r["metadata"]["name"].as_str().unwrap();
            store
                .mutate::<StoreError, _>(&POLICY_REPORT, "edges", name, false, |_| {
                    Ok(Mutation::Put(r.clone()))
                })
                .await
                .expect("a report is stored");
        }
        let db = analytics::connect_read_only(&url, std::time::Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{backend:?}: {e}"));
        let latest = analytics::run_sql(
            &db,
            "SELECT report_name, result FROM latest_results ORDER BY report_name",
        )
        .await
        .unwrap_or_else(|e| panic!("{backend:?}: {e}"));
        let got = text_pairs(&latest, "report_name", "result");
        let want = [
            ("node-a", "pass"),
            ("node-b", "fail"),
            ("pod-z-timed", "pass"),
        ]
        .map(|(n, r)| (n.to_owned(), r.to_owned()));
        assert_eq!(got, want, "{backend:?}");
    }
}

// ---- history and gauges ------------------------------------------------------------------

/// A clock the test moves by hand.
#[derive(Default)]
struct ManualClock(std::sync::atomic::AtomicI64);

impl ManualClock {
    fn set(&self, at: i64) {
        self.0.store(at, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> i64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

const DAY: i64 = 86_400;
/// 2026-11-28T00:00:00Z.
const MIDNIGHT: i64 = 1_795_824_000;

/// A store of `cluster`, its statistics worker on `clock` (daily snapshots kept a week), and
/// the registry its gauges are published in.
async fn statistics_of(
    url: &str,
    cluster: &str,
    clock: &Arc<ManualClock>,
) -> (Store, StatisticsWorker, Registry) {
    let mut options = StoreOptions::new(url.to_owned());
    options.cluster_id = cluster.into();
    let store = Store::connect(options).await.expect("the store opens");
    let metrics = StatisticsMetrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    metrics.set_leading(true);
    let options = StatisticsOptions {
        history_interval: Duration::from_secs(DAY as u64),
        history_retention: Duration::from_secs(7 * DAY as u64),
        ..StatisticsOptions::default()
    };
    let worker = StatisticsWorker::new(store.clone(), options, metrics)
        .with_clock(clock.clone() as Arc<dyn Clock>);
    (store, worker, registry)
}

/// Stores a PSS report on `pod-<n>` of `namespace` with the rules at `failing` failing.
async fn put_pss(store: &Store, namespace: &str, n: u64, failing: &[usize]) -> Value {
    let report = pss(CLUSTER, namespace, n, failing, 0).report;
    let name = report["metadata"]["name"].as_str().unwrap().to_owned();
    store
        .mutate::<StoreError, _>(&POLICY_REPORT, namespace, &name, false, |_| {
            Ok(Mutation::Put(report.clone()))
        })
        .await
        .expect("a report is stored");
    report
}

/// The totals of `reports` as a trend row's counters.
fn totals(reports: &[&Value]) -> [i64; 6] {
    let fixtures: Vec<Fixture> = reports
        .iter()
        .map(|r| Fixture {
            cluster: CLUSTER,
            report: (*r).clone(),
        })
        .collect();
    counts(rows(&fixtures).iter())
}

fn rfc3339(at: i64) -> String {
    chrono::DateTime::from_timestamp(at, 0)
        .unwrap()
        .format("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

fn trend(by: Option<Grouping>, since: i64) -> Question {
    Question::Trend {
        by,
        filter: filter(),
        since,
    }
}

/// The value of each series of `metric` in the text exposition, by its label text.
fn series(registry: &Registry, metric: &str) -> BTreeMap<String, i64> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(metric)?.strip_prefix('{')?;
            let (labels, value) = rest.rsplit_once("} ")?;
            Some((labels.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// What the gauges must say: the database's own counts, read with SQL of the test's.
async fn check_gauges(db: &DatabaseConnection, registry: &Registry, context: &str) {
    let sql = "SELECT COALESCE(source, '') AS source, policy, result, COUNT(*) AS n \
               FROM report_results WHERE cluster_id = 'default' \
               GROUP BY COALESCE(source, ''), policy, result";
    let table = analytics::run_sql(db, sql).await.unwrap();
    let want: BTreeMap<String, i64> = table
        .rows
        .iter()
        .map(|r| {
            let labels = format!(
                "source=\"{}\",policy=\"{}\",result=\"{}\"",
                text_of(&table, r, "source"),
                text_of(&table, r, "policy"),
                text_of(&table, r, "result")
            );
            (labels, number_of(&table, r, "n"))
        })
        .collect();
    assert_eq!(
        series(registry, "reports_server_statistics_results"),
        want,
        "{context}: result gauges"
    );
    let objects = analytics::run_sql(
        db,
        "SELECT COUNT(*) AS n FROM objects WHERE cluster_id = 'default'",
    )
    .await
    .unwrap();
    let objects = number_of(&objects, &objects.rows[0], "n");
    let gauges = series(registry, "reports_server_statistics_objects");
    let resource = "resource=\"policyreports.wgpolicyk8s.io\"";
    assert_eq!(
        gauges.get(resource).copied().unwrap_or(0),
        objects,
        "{context}: object gauges {gauges:?}"
    );
}

/// Snapshots on a controlled clock: one per daily slot from the first round, none between,
/// pruned after the retention; `query trend` gives each snapshot's counts as they were, in
/// totals (empty snapshots too), per namespace and per cluster; and the gauges follow the
/// database through writes and deletes.
#[tokio::test]
async fn history_snapshots_and_gauges_follow_a_controlled_clock_on_every_backend() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let url = backend
            .database_url(dir.path())
            .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"));
        let clock = Arc::new(ManualClock::default());
        let (store, worker, registry) = statistics_of(&url, CLUSTER, &clock).await;
        let db = analytics::connect_read_only(&url, Duration::from_secs(10))
            .await
            .unwrap();
        let slot = |n: i64| MIDNIGHT + n * DAY;
        let day = |n: i64| slot(n) + 3_600;

        // Day 0: nothing stored yet; the snapshot is taken all the same.
        clock.set(day(0));
        assert!(worker.round().await);
        check_gauges(&db, &registry, &format!("{backend:?} empty")).await;
        // Day 1: two reports; a second round the same day takes nothing.
        let a = put_pss(&store, "team-a", 1, &[0, 1, 2]).await;
        let b = put_pss(&store, "team-b", 2, &[3]).await;
        clock.set(day(1));
        assert!(worker.round().await);
        clock.set(day(1) + 7_000);
        assert!(worker.round().await);
        // A second server that also believes it leads (a paused process) writes no second
        // snapshot for the slot: the slot is the key.
        let (_twin, twin, _) = statistics_of(&url, CLUSTER, &clock).await;
        assert!(twin.round().await, "{backend:?}");
        assert_eq!(
            store.take_compliance_snapshot(slot(1)).await.unwrap(),
            SnapshotOutcome::Exists,
            "{backend:?}"
        );
        check_gauges(&db, &registry, &format!("{backend:?} day 1")).await;
        // Day 2: team-a fixed two of its failures, team-b's report deleted.
        let a2 = put_pss(&store, "team-a", 1, &[0]).await;
        let b_name = b["metadata"]["name"].as_str().unwrap();
        store
            .mutate::<StoreError, _>(&POLICY_REPORT, "team-b", b_name, false, |_| {
                Ok(Mutation::Delete)
            })
            .await
            .expect("the report is deleted");
        clock.set(day(2));
        assert!(worker.round().await);
        check_gauges(&db, &registry, &format!("{backend:?} day 2")).await;

        let answer = ask(&db, trend(None, MIDNIGHT)).await;
        let times: Vec<String> = answer
            .rows
            .iter()
            .map(|r| text_of(&answer, r, "taken_at"))
            .collect();
        assert_eq!(
            times,
            [rfc3339(slot(0)), rfc3339(slot(1)), rfc3339(slot(2))],
            "{backend:?}: one snapshot per day, recorded under the day's start"
        );
        let got: Vec<[i64; 5]> = answer
            .rows
            .iter()
            .map(|r| ["pass", "fail", "warn", "error", "skip"].map(|c| number_of(&answer, r, c)))
            .collect();
        assert_eq!(got[0], [0; 5], "{backend:?}: the empty day");
        assert_eq!(answer.rows[0][column(&answer, "ratio")], Value::Null);
        check_counters(&answer, &answer.rows[1], totals(&[&a, &b]), "day 1");
        check_counters(&answer, &answer.rows[2], totals(&[&a2]), "day 2");

        let by_namespace = ask(&db, trend(Some(Grouping::Namespace), MIDNIGHT)).await;
        let keys: Vec<(String, String)> = text_pairs(&by_namespace, "taken_at", "namespace");
        assert_eq!(
            keys,
            [
                (rfc3339(slot(1)), "team-a".to_owned()),
                (rfc3339(slot(1)), "team-b".to_owned()),
                (rfc3339(slot(2)), "team-a".to_owned()),
            ],
            "{backend:?}"
        );
        check_counters(
            &by_namespace,
            &by_namespace.rows[1],
            totals(&[&b]),
            "team-b",
        );
        let since_day_2 = ask(&db, trend(None, slot(2))).await;
        assert_eq!(since_day_2.rows.len(), 1, "{backend:?}: --since");

        // Another cluster of the database keeps its own history.
        let (_other, other_worker, _) = statistics_of(&url, OTHER_CLUSTER, &clock).await;
        assert!(other_worker.round().await);
        let fleet = ask(&db, trend(Some(Grouping::Cluster), MIDNIGHT)).await;
        let clusters: BTreeMap<String, usize> =
            fleet.rows.iter().fold(BTreeMap::new(), |mut m, r| {
                *m.entry(text_of(&fleet, r, "cluster_id")).or_default() += 1;
                m
            });
        assert_eq!(
            clusters,
            BTreeMap::from([(CLUSTER.to_owned(), 3), (OTHER_CLUSTER.to_owned(), 1)]),
            "{backend:?}"
        );

        if backend == Backend::Sqlite {
            copy_of_history(&url, dir.path(), &answer).await;
        }

        // Day 9 at 00:00: a week's retention keeps day 2's snapshot (recorded at day 2's
        // start, exactly a week earlier) and drops days 0 and 1.
        clock.set(slot(9));
        assert!(worker.round().await);
        let kept = ask(&db, trend(None, 0)).await;
        let times: Vec<String> = kept
            .rows
            .iter()
            .map(|r| text_of(&kept, r, "taken_at"))
            .collect();
        assert_eq!(times, [rfc3339(slot(2)), rfc3339(slot(9))], "{backend:?}");
        check_counters(&kept, &kept.rows[1], totals(&[&a2]), "day 9");
    }
}

/// `reports-server backup`'s copy of the SQLite database, taken with the store open, answers
/// as the original; with `REPORTS_SERVER_ANALYTICS_KEEP=DIR` it is left in `DIR/history` for the
/// `query trend` outputs of docs/analytics.md.
async fn copy_of_history(url: &str, dir: &std::path::Path, original: &Table) {
    let keep = std::env::var_os("REPORTS_SERVER_ANALYTICS_KEEP").map(std::path::PathBuf::from);
    let into = match keep {
        Some(keep) => keep.join("history"),
        None => dir.join("copy"),
    };
    std::fs::create_dir_all(&into).unwrap();
    let file = into.join("reports.db");
    let _ = std::fs::remove_file(&file);
    let bytes = analytics::copy_sqlite(url, &file, Duration::from_secs(10))
        .await
        .expect("the copy is taken");
    assert!(bytes > 0);
    let again = analytics::copy_sqlite(url, &file, Duration::from_secs(10)).await;
    assert!(
        matches!(again, Err(AnalyticsError::Copy(_))),
        "an existing file is never overwritten: {again:?}"
    );
    let copy = format!("sqlite://{}", file.display());
    let db = analytics::connect_read_only(&copy, Duration::from_secs(10))
        .await
        .unwrap();
    let answer = ask(&db, trend(None, MIDNIGHT)).await;
    assert_eq!(
        answer.rows, original.rows,
        "the copy answers as the original"
    );
}
