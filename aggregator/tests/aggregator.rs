//! The aggregator end to end over the in-memory backend: queue → paged load → merge → apply.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use reports_server_aggregator::backend::{AggregationBackend, PageRequest};
use reports_server_aggregator::merge::{MergeInput, merge_namespace};
use reports_server_aggregator::{
    Aggregator, AggregatorConfig, CancellationToken, Ephemeral, FinalReport, InMemoryBackend,
    Layout, MergeOptions, Metrics, PolicySet, QueueConfig, ReportKind,
};
use reports_server_crds::fixtures::{PSS_RULES, Subject, pss_ephemeral_report, pss_results};
use reports_server_crds::{ClusterEphemeralReport, PolicyReport};

fn pss_policies() -> PolicySet {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pod-security");
    let mut set = PolicySet::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(f).unwrap();
        let one = PolicySet::from_yaml_str(&text).unwrap();
        for (policy, _, _) in PSS_RULES {
            if let Some(p) = one.kyverno_policy(policy) {
                set.insert_kyverno_policy(policy, p.rules.iter().cloned());
            }
        }
    }
    set
}

fn config(layout: Layout, page_size: usize) -> AggregatorConfig {
    AggregatorConfig {
        queue: QueueConfig {
            workers: 2,
            ..QueueConfig::default()
        },
        merge: MergeOptions {
            layout,
            chunk_size: 10,
            ..MergeOptions::default()
        },
        page_size,
    }
}

fn ephemeral(ns: &str, n: u64, ts: i64, failing: &[usize]) -> Ephemeral {
    let mut e = pss_ephemeral_report(&Subject::pod(ns, n), ts, failing);
    // Kyverno ≥ 1.12 results carry no `resources`; the fixture's are a generation-A leftover.
    for r in e.spec.results.iter_mut().flatten() {
        r.resources = None;
    }
    Ephemeral::Namespaced(e)
}

#[test]
fn pss_fixture_policies_expand_to_57_rule_names() {
    let set = pss_policies();
    let total: usize = PSS_RULES
        .iter()
        .map(|(p, _, _)| *p)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|p| set.kyverno_policy(p).unwrap().rules.len())
        .sum();
    // 19 rules, each with `autogen-` and `autogen-cronjob-` variants.
    assert_eq!(total, 57);
    let p = set.kyverno_policy("disallow-selinux").unwrap();
    assert!(p.rules.contains("autogen-cronjob-selinux-user-role"));
}

#[tokio::test(start_paused = true)]
async fn enqueued_namespace_is_aggregated_after_the_delay() {
    let backend = Arc::new(InMemoryBackend::new(Some(pss_policies())));
    for n in 0..5 {
        backend.put_ephemeral(ephemeral("team-a", n, 1000 + n as i64, &[n as usize]));
    }
    let agg = Aggregator::new(
        backend.clone(),
        config(Layout::PerResource, 2),
        Metrics::unregistered(),
    );
    let cancel = CancellationToken::new();
    let run = tokio::spawn(agg.clone().run(cancel.clone()));
    agg.enqueue("team-a");
    tokio::time::sleep(Duration::from_secs(29)).await;
    assert!(backend.reports().is_empty(), "nothing before the delay");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let reports = backend.reports();
    assert_eq!(reports.len(), 5);
    assert!(backend.ephemerals().is_empty());
    for r in &reports {
        assert_eq!(r.results().len(), 19);
        assert_eq!(r.summary().unwrap().fail, Some(1));
        assert_eq!(r.kind(), ReportKind::PolicyReport);
    }
    // 5 subjects, 2 per page: 3 pages, each applied on its own.
    assert_eq!(backend.pages_loaded(), 3);
    assert_eq!(backend.applies(), 3);
    cancel.cancel();
    run.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn failed_apply_keeps_ephemerals_and_is_retried() {
    let backend = Arc::new(InMemoryBackend::new(None));
    backend.put_ephemeral(ephemeral("ns", 1, 10, &[]));
    backend.fail_next_applies(2);
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::register(&mut registry);
    let agg = Aggregator::new(
        backend.clone(),
        config(Layout::PerResource, 100),
        metrics.clone(),
    );
    let cancel = CancellationToken::new();
    let run = tokio::spawn(agg.clone().run(cancel.clone()));
    agg.enqueue("ns");
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert_eq!(backend.ephemerals().len(), 1, "kept after a failed write");
    assert!(backend.reports().is_empty());
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(backend.ephemerals().is_empty());
    assert_eq!(backend.reports().len(), 1);
    assert_eq!(metrics.errors.get(), 2);
    assert_eq!(metrics.ephemeral_reports_deleted.get(), 1);
    assert_eq!(metrics.results_merged.get(), 19);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("reports_server_aggregation_reports_total{operation=\"create\"} 1"),
        "{text}"
    );
    assert!(text.contains("reports_server_aggregation_reconcile_duration_seconds_count 3"));
    cancel.cancel();
    run.await.unwrap();
}

#[tokio::test]
async fn second_reconcile_writes_nothing() {
    let backend = Arc::new(InMemoryBackend::new(Some(pss_policies())));
    for n in 0..3 {
        backend.put_ephemeral(ephemeral("ns", n, 10, &[]));
    }
    let agg = Aggregator::new(
        backend.clone(),
        config(Layout::PerResource, 2),
        Metrics::unregistered(),
    );
    let first = agg.reconcile("ns").await.unwrap();
    assert_eq!(first.created, 3);
    let before = backend.reports();
    let second = agg.reconcile("ns").await.unwrap();
    assert_eq!(second.applies, 0);
    assert_eq!(backend.reports(), before);
    // A newer background scan of one pod updates only that report, without touching metadata.
    backend.put_ephemeral(ephemeral("ns", 1, 20, &[3]));
    let third = agg.reconcile("ns").await.unwrap();
    assert_eq!((third.created, third.updated, third.deleted), (0, 1, 0));
    let after = backend.reports();
    let changed: Vec<_> = after
        .iter()
        .zip(&before)
        .filter(|(a, b)| a.results() != b.results())
        .collect();
    assert_eq!(changed.len(), 1);
    let (a, b) = changed[0];
    assert_eq!(a.metadata().uid, b.metadata().uid);
    assert_eq!(a.metadata().labels, b.metadata().labels);
    assert_eq!(a.scope(), b.scope());
}

#[tokio::test]
async fn policy_removal_drops_results_and_deletes_empty_reports() {
    let backend = Arc::new(InMemoryBackend::new(Some(pss_policies())));
    backend.put_ephemeral(ephemeral("ns", 1, 10, &[]));
    let agg = Aggregator::new(
        backend.clone(),
        config(Layout::PerResource, 10),
        Metrics::unregistered(),
    );
    agg.reconcile("ns").await.unwrap();
    let mut fewer = PolicySet::new();
    fewer.insert_kyverno_policy("disallow-host-path", ["host-path"]);
    backend.set_policies(Some(fewer));
    agg.reconcile("ns").await.unwrap();
    let reports = backend.reports();
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].results().len(), 1);
    backend.set_policies(Some(PolicySet::new()));
    let outcome = agg.reconcile("ns").await.unwrap();
    assert_eq!(outcome.deleted, 1);
    assert!(backend.reports().is_empty());
}

#[tokio::test]
async fn legacy_per_policy_reports_are_migrated_in_one_piece() {
    let backend = Arc::new(InMemoryBackend::new(None));
    // A generation-A report holding the results of three pods, plus one newer ephemeral.
    let mut results = Vec::new();
    for n in 0..3 {
        results.extend(
            pss_results(&Subject::pod("ns", n), 5, &[])
                .into_iter()
                .take(2),
        );
    }
    backend.put_report(FinalReport::PolicyReport(PolicyReport {
        metadata: ObjectMeta {
            name: Some("cpol-disallow-capabilities".into()),
            namespace: Some("ns".into()),
            labels: Some([("app.kubernetes.io/managed-by".into(), "kyverno".into())].into()),
            ..Default::default()
        },
        results: Some(results),
        ..Default::default()
    }));
    backend.put_ephemeral(ephemeral("ns", 2, 50, &[0]));
    let agg = Aggregator::new(
        backend.clone(),
        config(Layout::PerResource, 1),
        Metrics::unregistered(),
    );
    let outcome = agg.reconcile("ns").await.unwrap();
    assert_eq!(outcome.applies, 1, "namespace-wide merge, one transaction");
    let reports = backend.reports();
    let names: Vec<_> = reports.iter().map(|r| r.name().to_owned()).collect();
    assert!(!names.contains(&"cpol-disallow-capabilities".to_owned()));
    assert_eq!(reports.len(), 3);
    let sizes: Vec<_> = reports.iter().map(|r| r.results().len()).collect();
    assert_eq!(sizes.iter().sum::<usize>(), 2 + 2 + 19);
    assert!(
        reports
            .iter()
            .flat_map(|r| r.results())
            .all(|r| r.resources.is_none())
    );
}

#[tokio::test]
async fn per_policy_layout_chunks_and_removes_stale_chunks() {
    let backend = Arc::new(InMemoryBackend::new(None));
    for n in 0..25 {
        backend.put_ephemeral(ephemeral("ns", n, 10, &[]));
    }
    let agg = Aggregator::new(
        backend.clone(),
        config(Layout::PerPolicy, 7),
        Metrics::unregistered(),
    );
    agg.reconcile("ns").await.unwrap();
    let names: Vec<String> = backend
        .reports()
        .iter()
        .map(|r| r.name().to_owned())
        .collect();
    // 25 results per rule; disallow-selinux has two rules: 50 results → 5 chunks of 10.
    assert!(names.contains(&"cpol-disallow-selinux-4".to_owned()));
    assert!(!names.contains(&"cpol-disallow-selinux-5".to_owned()));
    assert!(names.contains(&"cpol-restrict-seccomp-2".to_owned()));
    assert!(
        backend
            .reports()
            .iter()
            .all(|r| r.results().len() <= 10 && r.scope().is_none())
    );
    // Drop 20 subjects' worth of results: the policy set now only knows one rule of
    // disallow-selinux, so its reports shrink to 3 chunks and the stale ones go.
    let mut set = PolicySet::new();
    set.insert_kyverno_policy("disallow-selinux", ["selinux-type"]);
    backend.set_policies(Some(set));
    let outcome = agg.reconcile("ns").await.unwrap();
    let names: Vec<String> = backend
        .reports()
        .iter()
        .map(|r| r.name().to_owned())
        .collect();
    assert_eq!(
        names,
        [
            "cpol-disallow-selinux",
            "cpol-disallow-selinux-1",
            "cpol-disallow-selinux-2"
        ]
    );
    assert!(outcome.deleted > 0);
}

#[tokio::test]
async fn unmanaged_reports_are_never_touched() {
    let backend = Arc::new(InMemoryBackend::new(None));
    let s = Subject::pod("ns", 1);
    let foreign = FinalReport::PolicyReport(PolicyReport {
        metadata: ObjectMeta {
            name: Some(s.uid.clone()),
            namespace: Some("ns".into()),
            ..Default::default()
        },
        ..Default::default()
    });
    backend.put_report(foreign.clone());
    backend.put_ephemeral(ephemeral("ns", 1, 10, &[]));
    let agg = Aggregator::new(
        backend.clone(),
        config(Layout::PerResource, 10),
        Metrics::unregistered(),
    );
    let outcome = agg.reconcile("ns").await.unwrap();
    assert_eq!(outcome.conflicts, 1);
    assert_eq!(backend.reports()[0].results(), foreign.results());
    assert_eq!(
        backend.ephemerals().len(),
        1,
        "kept: its results were not written"
    );
}

#[tokio::test]
async fn cluster_scope_uses_cluster_kinds() {
    let backend = Arc::new(InMemoryBackend::new(None));
    let e = match ephemeral("", 7, 10, &[]) {
        Ephemeral::Namespaced(e) => e,
        Ephemeral::Cluster(_) => unreachable!(),
    };
    backend.put_ephemeral(Ephemeral::Cluster(ClusterEphemeralReport {
        metadata: ObjectMeta {
            namespace: None,
            ..e.metadata
        },
        spec: e.spec,
        ..Default::default()
    }));
    let agg = Aggregator::new(
        backend.clone(),
        AggregatorConfig {
            merge: MergeOptions {
                output: reports_server_aggregator::OutputFormat::Openreports,
                ..MergeOptions::default()
            },
            ..AggregatorConfig::default()
        },
        Metrics::unregistered(),
    );
    agg.reconcile("").await.unwrap();
    let reports = backend.reports();
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].kind(), ReportKind::ClusterReport);
    assert_eq!(reports[0].metadata().namespace, None);
    assert_eq!(reports[0].scope().unwrap().namespace, None);
}

#[tokio::test]
async fn ephemeral_rewritten_after_load_is_not_deleted() {
    let backend = InMemoryBackend::new(None);
    backend.put_ephemeral(ephemeral("ns", 1, 10, &[]));
    let page = backend
        .load_page(PageRequest {
            namespace: "ns",
            report_kind: ReportKind::PolicyReport,
            continue_token: None,
            limit: 10,
        })
        .await
        .unwrap();
    let plan = merge_namespace(
        &MergeInput {
            namespace: "ns",
            reports: &page.reports,
            ephemerals: &page.ephemerals,
            policies: None,
        },
        &MergeOptions::default(),
    );
    // The scanner rewrites the report between load and apply.
    backend.put_ephemeral(ephemeral("ns", 1, 20, &[1]));
    let applied = backend.apply(&plan).await.unwrap();
    assert_eq!(applied.ephemerals_rewritten, 1);
    // What was merged is written; the newer version stays for the next pass, written again
    // after the report so that a same-second rescan wins the tie.
    let rv = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        m.resource_version
            .as_deref()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    assert_eq!(backend.reports().len(), 1);
    assert_eq!(backend.ephemerals().len(), 1);
    assert!(rv(backend.ephemerals()[0].metadata()) > rv(backend.reports()[0].metadata()));
}
