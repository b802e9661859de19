//! The store behaves the same on SQLite, on a real PostgreSQL and on a real MariaDB: resourceVersions increase in
//! commit order and survive reconnects, the change log has no gaps (also with two writers on one
//! database), label selectors and pagination run in SQL, and compaction moves the horizon.

use std::sync::Arc;
use std::time::Duration;

use reports_server_apiserver::selector::{FieldSelector, LabelSelector};
use reports_server_apiserver::store::feed::read_changes;
use reports_server_apiserver::store::write_target::Target;
use reports_server_apiserver::store::{
    EventType, ListQuery, Mutation, Store, StoreError, StoreOptions,
};
use reports_server_crds::catalog::{EPHEMERAL_REPORT, POLICY_REPORT};
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use reports_server_tests::Backend;
use serde_json::{Value, json};

async fn open(backend: Backend, dir: &std::path::Path) -> (Store, String) {
    let url = backend
        .database_url(dir)
        .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"));
    let store = Store::connect(StoreOptions::new(url.clone()))
        .await
        .unwrap_or_else(|e| panic!("{backend:?}: {e}"));
    (store, url)
}

fn report(ns: &str, n: u64, labels: &[(&str, &str)]) -> Value {
    let mut v =
        serde_json::to_value(pss_policy_report(&Subject::pod(ns, n), 1_700_000_000, &[])).unwrap();
    v["metadata"]["name"] = json!(format!("r-{n:05}"));
    v["metadata"]["uid"] = json!(format!("uid-{n}"));
    v["metadata"]["creationTimestamp"] = json!("2024-01-01T00:00:00Z");
    for (k, val) in labels {
        v["metadata"]["labels"][*k] = json!(val);
    }
    v
}

async fn put(store: &Store, ns: &str, name: &str, object: Value) -> i64 {
    store
        .mutate::<StoreError, _>(&POLICY_REPORT, ns, name, false, |_| {
            Ok(Mutation::Put(object.clone()))
        })
        .await
        .unwrap()
        .resource_version
}

#[tokio::test]
async fn versions_persist_and_changes_are_gapless() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, url) = open(backend, dir.path()).await;
        let (start, _) = store.versions().await.unwrap();
        let mut rvs = Vec::new();
        for n in 0..20 {
            rvs.push(put(&store, "ns-a", &format!("r-{n:05}"), report("ns-a", n, &[])).await);
        }
        assert!(
            rvs.windows(2).all(|w| w[1] == w[0] + 1),
            "{backend:?}: {rvs:?}"
        );
        let deleted = store
            .mutate::<StoreError, _>(&POLICY_REPORT, "ns-a", "r-00003", false, |_| {
                Ok(Mutation::Delete)
            })
            .await
            .unwrap();
        assert_eq!(deleted.event, Some(EventType::Deleted));
        drop(store);

        // Reconnect: same data, same counter, change log intact.
        let store = Store::connect(StoreOptions::new(url)).await.unwrap();
        let (current, _) = store.versions().await.unwrap();
        assert_eq!(current, deleted.resource_version, "{backend:?}");
        let changes = read_changes(&store, start, None, 1000).await.unwrap();
        let seen: Vec<i64> = changes.iter().map(|c| c.resource_version).collect();
        assert_eq!(
            seen,
            ((start + 1)..=current).collect::<Vec<_>>(),
            "{backend:?}"
        );
        assert_eq!(changes.last().unwrap().event, EventType::Deleted);
        assert!(
            store
                .get_object(&POLICY_REPORT, "ns-a", "r-00003")
                .await
                .unwrap()
                .is_none()
        );
        assert_eq!(store.count(&POLICY_REPORT).await.unwrap(), 19);
        let next = put(&store, "ns-a", "r-99999", report("ns-a", 99_999, &[])).await;
        assert_eq!(next, current + 1, "{backend:?}");
    }
}

#[tokio::test]
async fn two_writers_on_one_database_stay_ordered() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (a, url) = open(backend, dir.path()).await;
        let b = Store::connect(StoreOptions::new(url)).await.unwrap();
        let (start, _) = a.versions().await.unwrap();
        let write = |store: Store, prefix: &'static str| async move {
            for n in 0..40u64 {
                put(&store, "ns", &format!("{prefix}-{n}"), report("ns", n, &[])).await;
            }
        };
        tokio::join!(write(a.clone(), "a"), write(b.clone(), "b"));
        let changes = read_changes(&a, start, None, 1000).await.unwrap();
        let rvs: Vec<i64> = changes.iter().map(|c| c.resource_version).collect();
        assert_eq!(
            rvs,
            ((start + 1)..=(start + 80)).collect::<Vec<_>>(),
            "{backend:?}: resourceVersions must be gapless and ordered"
        );
        // Each object carries the resourceVersion of its change.
        for c in &changes {
            assert_eq!(
                c.object()["metadata"]["resourceVersion"],
                json!(c.resource_version.to_string())
            );
        }
        // Process B's feed sees A's writes (LISTEN/NOTIFY on Postgres, polling elsewhere).
        let (mut rx, delivered) = b.feed().subscribe().await;
        let before = delivered;
        put(&a, "ns", "late", report("ns", 1000, &[])).await;
        let got = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let c = rx.recv().await.unwrap();
                if c.name == "late" {
                    return c;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{backend:?}: B never saw A's write"));
        assert!(got.resource_version > before);
    }
}

#[tokio::test]
async fn selectors_and_keyset_pages_run_in_sql() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(backend, dir.path()).await;
        for n in 0..30u64 {
            let tier = if n % 3 == 0 { "gold" } else { "silver" };
            let ns = if n % 2 == 0 { "even" } else { "odd" };
            put(
                &store,
                ns,
                &format!("r-{n:05}"),
                report(ns, n, &[("tier", tier)]),
            )
            .await;
        }
        let query = |labels: &str, fields: &str, namespace: Option<&str>| ListQuery {
            resource: &POLICY_REPORT,
            namespace: namespace.map(str::to_owned),
            labels: LabelSelector::parse(labels).unwrap(),
            fields: FieldSelector::parse(fields).unwrap(),
            limit: None,
            after: None,
            metadata_only: true,
        };
        let count = |q: ListQuery| {
            let store = store.clone();
            async move { store.list(&q).await.unwrap().rows.len() }
        };
        assert_eq!(count(query("tier=gold", "", None)).await, 10, "{backend:?}");
        assert_eq!(count(query("tier!=gold", "", None)).await, 20);
        assert_eq!(
            count(query("tier in (gold,bronze)", "", Some("even"))).await,
            5
        );
        assert_eq!(count(query("!tier", "", None)).await, 0);
        assert_eq!(
            count(query("app.kubernetes.io/managed-by=kyverno,tier", "", None)).await,
            30
        );
        assert_eq!(count(query("", "metadata.name=r-00004", None)).await, 1);
        assert_eq!(count(query("", "metadata.namespace!=even", None)).await, 15);
        // Other kinds are separate.
        let eph = ListQuery {
            resource: &EPHEMERAL_REPORT,
            ..query("", "", None)
        };
        assert_eq!(count(eph).await, 0);

        // Keyset pages: every object exactly once, in (namespace, name) order.
        let mut after = None;
        let mut seen = Vec::new();
        loop {
            let page = store
                .list(&ListQuery {
                    limit: Some(7),
                    after: after.clone(),
                    ..query("", "", None)
                })
                .await
                .unwrap();
            seen.extend(
                page.rows
                    .iter()
                    .map(|r| (r.namespace.clone(), r.name.clone())),
            );
            if !page.more {
                break;
            }
            after = page
                .rows
                .last()
                .map(|r| (r.namespace.clone(), r.name.clone()));
        }
        let mut sorted = seen.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(seen, sorted, "{backend:?}");
        assert_eq!(seen.len(), 30);

        // Analytics rows exist, one per result, queryable in SQL.
        let rows = store
            .query_raw(
                "SELECT COUNT(*) AS n FROM report_results WHERE policy = 'disallow-host-path'",
            )
            .await
            .unwrap();
        let n: i64 = rows[0].try_get("", "n").unwrap();
        assert_eq!(n, 30, "{backend:?}");
    }
}

/// A round's writes take a different path by size (on PostgreSQL a small round is folded into
/// two statements, a bulk round is written table by table): both leave the same rows — one
/// label row per label, one `results` row per result, nothing of a replaced or deleted object
/// behind — and every superseded version keeps its own body in the change log.
#[tokio::test]
async fn small_and_bulk_rounds_leave_the_same_rows() {
    const EACH: u64 = 150;
    let each = report("ns", 0, &[("tier", "x")]);
    let results_per_report = each["results"].as_array().unwrap().len() as i64;
    // The fixture's own labels plus `tier`.
    let labels_per_report = each["metadata"]["labels"].as_object().unwrap().len() as i64;
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(backend, dir.path()).await;
        let (start, _) = store.versions().await.unwrap();
        // Each tier in one bulk round (a few hundred parameters a report: far past what
        // PostgreSQL folds) and in rounds of one write each; silver replaces gold.
        for tier in ["gold", "silver"] {
            store
                .put_all(
                    &POLICY_REPORT,
                    (0..EACH)
                        .map(|n| report("bulk", n, &[("tier", tier)]))
                        .collect(),
                )
                .await
                .unwrap();
            for n in 0..EACH {
                put(
                    &store,
                    "single",
                    &format!("r-{n:05}"),
                    report("single", n, &[("tier", tier)]),
                )
                .await;
            }
        }
        // Then a third of each goes, in one round and one by one.
        let doomed: Vec<String> = (0..EACH).step_by(3).map(|n| format!("r-{n:05}")).collect();
        let targets: Vec<Target<'_>> = doomed
            .iter()
            .map(|name| Target {
                resource: &POLICY_REPORT,
                namespace: "bulk",
                name,
            })
            .collect();
        store
            .mutate_batch::<StoreError, _>(&targets, false, |_, _| Ok(Mutation::Delete))
            .await
            .unwrap();
        for name in &doomed {
            store
                .mutate::<StoreError, _>(&POLICY_REPORT, "single", name, false, |_| {
                    Ok(Mutation::Delete)
                })
                .await
                .unwrap();
        }

        let left = (EACH - doomed.len() as u64) as i64;
        let scalar = |sql: String| {
            let store = store.clone();
            async move {
                let rows = store.query_raw(&sql).await.unwrap();
                rows[0].try_get::<i64>("", "n").unwrap()
            }
        };
        for ns in ["bulk", "single"] {
            let rows_in_ns = |table: &str, also: &str| {
                scalar(format!(
                    "SELECT COUNT(*) AS n FROM objects o JOIN {table} s \
                     ON s.object_id = o.id WHERE o.namespace = '{ns}'{also}"
                ))
            };
            let labels = rows_in_ns("object_labels", "");
            let results = rows_in_ns("results", "");
            let silver = rows_in_ns(
                "object_labels",
                " AND s.key = 'tier' AND s.value = 'silver'",
            );
            assert_eq!(
                labels.await,
                left * labels_per_report,
                "{backend:?} {ns}: label rows"
            );
            assert_eq!(
                silver.await,
                left,
                "{backend:?} {ns}: the replacements' labels"
            );
            assert_eq!(
                results.await,
                left * results_per_report,
                "{backend:?} {ns}: result rows"
            );
        }
        // Nothing of a replaced or deleted object is left behind.
        for table in ["object_labels", "results"] {
            let orphans = scalar(format!(
                "SELECT COUNT(*) AS n FROM {table} s WHERE NOT EXISTS \
                 (SELECT 1 FROM objects o WHERE o.id = s.object_id)"
            ));
            assert_eq!(orphans.await, 0, "{backend:?}: {table} rows of no object");
        }
        assert_eq!(store.count(&POLICY_REPORT).await.unwrap(), 2 * left);

        // Every version is in the log with its own body: the first with tier gold, the
        // replacement with silver, the deletion with the replacement's state.
        let (current, _) = store.versions().await.unwrap();
        let changes = read_changes(&store, start, None, 10_000).await.unwrap();
        assert_eq!(
            changes
                .iter()
                .map(|c| c.resource_version)
                .collect::<Vec<_>>(),
            ((start + 1)..=current).collect::<Vec<_>>(),
            "{backend:?}: a gapless log"
        );
        for change in &changes {
            let tier = change.object()["metadata"]["labels"]["tier"].clone();
            let expected = match change.event {
                EventType::Added => "gold",
                EventType::Modified | EventType::Deleted => "silver",
            };
            assert_eq!(
                tier,
                json!(expected),
                "{backend:?}: {:?} of {}/{} at {}",
                change.event,
                change.namespace,
                change.name,
                change.resource_version
            );
        }
    }
}

/// A lease row has one holder: of two candidates creating it, the second is told it lost (on
/// MySQL an `INSERT` that meets the row must not count as taking it), and a takeover names the
/// record it replaces.
#[tokio::test]
async fn a_new_lease_row_goes_to_one_candidate() {
    let duration = Duration::from_secs(30);
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(backend, dir.path()).await;
        let first = store.lease_acquire("merge", "a", None, duration).await;
        let first = first
            .unwrap()
            .unwrap_or_else(|| panic!("{backend:?}: nobody held it"));
        let second = store.lease_acquire("merge", "b", None, duration).await;
        assert_eq!(
            second.unwrap(),
            None,
            "{backend:?}: b created a row a holds"
        );
        let read = store.lease_read("merge").await.unwrap();
        assert_eq!(read.as_ref(), Some(&first), "{backend:?}");
        let taken = store.lease_acquire("merge", "b", Some(&first), duration);
        let taken = taken
            .await
            .unwrap()
            .expect("b takes over the record it saw");
        let stale = store
            .lease_acquire("merge", "c", Some(&first), duration)
            .await;
        assert_eq!(
            stale.unwrap(),
            None,
            "{backend:?}: c replaced a record b had replaced"
        );
        assert_eq!(store.lease_read("merge").await.unwrap(), Some(taken));
    }
}

/// Names, label keys and values, and rule names that differ only in case are different, as
/// they are in Kubernetes: MySQL's usual collations (`utf8mb4_general_ci`, MySQL 8's
/// `utf8mb4_0900_ai_ci`) compare text case-insensitively, which would merge them.
#[tokio::test]
async fn text_that_differs_only_in_case_stays_apart() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(backend, dir.path()).await;
        let mut lower = report("ns", 1, &[("team", "payments")]);
        lower["metadata"]["labels"]["Team"] = json!("Payments");
        lower["results"][0]["rule"] = json!("check-team");
        lower["results"][1]["rule"] = json!("Check-Team");
        put(&store, "ns", "report", lower.clone()).await;
        let mut upper = report("ns", 2, &[("team", "Payments")]);
        upper["metadata"]["name"] = json!("Report");
        put(&store, "ns", "Report", upper).await;
        assert_eq!(store.count(&POLICY_REPORT).await.unwrap(), 2, "{backend:?}");
        let stored = store.get_object(&POLICY_REPORT, "ns", "report").await;
        let stored = stored.unwrap().expect("report");
        assert_eq!(stored["metadata"]["labels"], lower["metadata"]["labels"]);
        assert_eq!(stored["results"], lower["results"], "{backend:?}");
        for (selector, expected) in [
            ("team=payments", vec!["report"]),
            ("team=Payments", vec!["Report"]),
            ("Team=Payments", vec!["report"]),
            ("Team", vec!["report"]),
        ] {
            let page = store
                .list(&ListQuery {
                    labels: LabelSelector::parse(selector).unwrap(),
                    metadata_only: true,
                    ..ListQuery::all(&POLICY_REPORT)
                })
                .await
                .unwrap();
            let names: Vec<&str> = page.rows.iter().map(|r| r.name.as_str()).collect();
            assert_eq!(names, expected, "{backend:?}: {selector}");
        }
    }
}

#[tokio::test]
async fn compaction_advances_the_horizon() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let url = backend.database_url(dir.path()).unwrap();
        let mut options = StoreOptions::new(url);
        options.watch_history_max_events = 5;
        options.watch_history = Duration::from_secs(3600);
        let store = Store::connect(options).await.unwrap();
        for n in 0..12u64 {
            put(&store, "ns", &format!("r-{n}"), report("ns", n, &[])).await;
        }
        let horizon = store.compact().await.unwrap();
        let (current, compacted) = store.versions().await.unwrap();
        assert_eq!(horizon, compacted);
        assert_eq!(compacted, current - 5, "{backend:?}");
        let left = read_changes(&store, 0, None, 100).await.unwrap();
        assert_eq!(left.len(), 5);
    }
}

#[tokio::test]
async fn a_failed_decision_writes_nothing() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(backend, dir.path()).await;
        put(&store, "ns", "keep", report("ns", 1, &[])).await;
        let (before, _) = store.versions().await.unwrap();
        let store = Arc::new(store);
        let result = store
            .mutate::<StoreError, _>(&POLICY_REPORT, "ns", "keep", false, |_| {
                Err(StoreError::AlreadyExists)
            })
            .await;
        assert!(result.is_err());
        assert_eq!(store.versions().await.unwrap().0, before);
    }
}

/// A create decides on "no object" without reading first; when the round finds one, the
/// decision is made again on it, so the create fails and the stored object stays as it was.
#[tokio::test]
async fn a_create_that_presumed_no_object_decides_again_on_the_stored_one() {
    let target = |name| Target {
        resource: &POLICY_REPORT,
        namespace: "ns",
        name,
    };
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(backend, dir.path()).await;
        let rv = put(&store, "ns", "taken", report("ns", 1, &[])).await;
        let mut seen = Vec::new();
        let result = store
            .mutate_new::<StoreError, _>(target("taken"), false, |current| {
                seen.push(current.is_some());
                match current {
                    Some(_) => Err(StoreError::AlreadyExists),
                    None => Ok(Mutation::Put(report("ns", 2, &[]))),
                }
            })
            .await;
        assert!(
            matches!(result, Err(StoreError::AlreadyExists)),
            "{backend:?}"
        );
        assert_eq!(seen, [false, true], "{backend:?}: presumed, then read");
        assert_eq!(store.versions().await.unwrap().0, rv, "{backend:?}");
        let fresh = store
            .mutate_new::<StoreError, _>(target("free"), false, |current| {
                assert!(current.is_none());
                Ok(Mutation::Put(report("ns", 3, &[])))
            })
            .await
            .unwrap();
        assert_eq!(fresh.resource_version, rv + 1, "{backend:?}");
    }
}

/// Regression (a real Kyverno on a fresh install): an empty store answered lists with
/// resourceVersion "0", which client-go reads as "any version" and its RetryWatcher refuses, so
/// no Kyverno controller ever started its report watcher. The counter starts above zero for a
/// fresh database, for a further `cluster_id` in an existing one, and after the migration of a
/// database whose counter row was created at 0.
#[tokio::test]
async fn the_current_resource_version_is_never_zero() {
    use reports_server_apiserver::store::FIRST_RESOURCE_VERSION;
    use sea_orm::ConnectionTrait as _;

    const { assert!(FIRST_RESOURCE_VERSION > 0) };
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, url) = open(backend, dir.path()).await;
        let (current, compacted) = store.versions().await.unwrap();
        assert_eq!(
            current, FIRST_RESOURCE_VERSION,
            "{backend:?}: fresh database"
        );
        assert!(compacted <= current, "{backend:?}");
        let page = store
            .list(&ListQuery {
                limit: Some(10),
                ..ListQuery::all(&POLICY_REPORT)
            })
            .await
            .unwrap();
        assert!(page.rows.is_empty());
        assert_eq!(
            page.resource_version, FIRST_RESOURCE_VERSION,
            "{backend:?}: empty list"
        );
        // The first write comes after it, still gapless from there.
        let rv = put(&store, "ns", "first", report("ns", 1, &[])).await;
        assert_eq!(rv, FIRST_RESOURCE_VERSION + 1, "{backend:?}");

        // A second cluster sharing the database gets its own counter, also above zero.
        let mut other = StoreOptions::new(url.clone());
        other.cluster_id = "cluster-b".into();
        let b = Store::connect(other).await.unwrap();
        assert_eq!(
            b.versions().await.unwrap().0,
            FIRST_RESOURCE_VERSION,
            "{backend:?}"
        );
        drop(b);
        drop(store);

        // A database from before the fix: a counter row at 0 and the migration not yet applied.
        let db = sea_orm::Database::connect(url.as_str()).await.unwrap();
        db.execute_unprepared(
            "UPDATE store_state SET rv = 0, compacted_rv = 0 WHERE cluster_id = 'cluster-b'",
        )
        .await
        .unwrap();
        db.execute_unprepared(
            "DELETE FROM seaql_migrations WHERE version = 'm20261123_000003_nonzero_resource_version'",
        )
        .await
        .unwrap();
        db.close().await.unwrap();
        let mut legacy = StoreOptions::new(url.clone());
        legacy.cluster_id = "cluster-b".into();
        let b = Store::connect(legacy).await.unwrap();
        assert_eq!(
            b.versions().await.unwrap().0,
            FIRST_RESOURCE_VERSION,
            "{backend:?}: migrated counter"
        );
        // The migration leaves counters that are already in use alone.
        let a = Store::connect(StoreOptions::new(url)).await.unwrap();
        assert_eq!(
            a.versions().await.unwrap().0,
            FIRST_RESOURCE_VERSION + 1,
            "{backend:?}"
        );
    }
}

/// The change log does not repeat the body of an object's current version (it reads it from the
/// object's row), yet a watch resumed from before a series of writes still gets every version as
/// it was written: the write that supersedes a version moves its body into the log.
#[tokio::test]
async fn each_version_reaches_a_resumed_watch_with_one_body_copy_stored() {
    use sea_orm::{ConnectionTrait, Database, Statement};
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, url) = open(backend, dir.path()).await;
        let (start, _) = store.versions().await.unwrap();
        let mut written = Vec::new();
        for step in ["one", "two", "three"] {
            let object = report("ns-a", 1, &[("step", step)]);
            let rv = put(&store, "ns-a", "r-00001", object.clone()).await;
            written.push((rv, Some(step)));
        }
        put(
            &store,
            "ns-a",
            "r-00002",
            report("ns-a", 2, &[("step", "kept")]),
        )
        .await;
        let deleted = store
            .mutate::<StoreError, _>(&POLICY_REPORT, "ns-a", "r-00001", false, |_| {
                Ok(Mutation::Delete)
            })
            .await
            .unwrap();
        written.push((deleted.resource_version, Some("three")));

        let changes = read_changes(&store, start, None, 100).await.unwrap();
        let seen: Vec<(i64, String, Option<String>, String)> = changes
            .iter()
            .map(|c| {
                (
                    c.resource_version,
                    c.name.clone(),
                    c.object()["metadata"]["labels"]["step"]
                        .as_str()
                        .map(str::to_owned),
                    c.object()["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap()
                        .to_owned(),
                )
            })
            .collect();
        let expected = vec![
            (written[0].0, "r-00001".to_owned(), Some("one".to_owned())),
            (written[1].0, "r-00001".to_owned(), Some("two".to_owned())),
            (written[2].0, "r-00001".to_owned(), Some("three".to_owned())),
            (
                written[2].0 + 1,
                "r-00002".to_owned(),
                Some("kept".to_owned()),
            ),
            (written[3].0, "r-00001".to_owned(), Some("three".to_owned())),
        ];
        assert_eq!(
            seen.iter()
                .map(|(rv, name, step, _)| (*rv, name.clone(), step.clone()))
                .collect::<Vec<_>>(),
            expected,
            "{backend:?}"
        );
        for (rv, _, _, body_rv) in &seen {
            assert_eq!(
                body_rv,
                &rv.to_string(),
                "{backend:?}: each event's own version"
            );
        }

        // Stored: a body for each superseded version (two updates' predecessors, the last
        // state before the delete, the delete itself) but none for r-00002's current version.
        let db = Database::connect(url.as_str()).await.unwrap();
        let row = db
            .query_one_raw(Statement::from_string(
                db.get_database_backend(),
                "SELECT COUNT(*) AS n FROM changes WHERE body <> ''",
            ))
            .await
            .unwrap()
            .unwrap();
        let with_body: i64 = row.try_get("", "n").unwrap();
        assert_eq!(with_body, 4, "{backend:?}");
    }
}

/// A database written before `m20261124_000004_one_body_copy` (a body in every change-log
/// entry) loses the repeated bodies when the migration runs, and the documented downgrade
/// statement puts them back; watches read the same events throughout.
#[tokio::test]
async fn the_one_body_copy_migration_and_its_downgrade_keep_every_event() {
    use sea_orm::{ConnectionTrait, Database, Statement};
    const RESTORE: &str = "UPDATE changes SET body = (SELECT o.body FROM objects o \
        WHERE o.cluster_id = changes.cluster_id AND o.resource = changes.resource \
        AND o.namespace = changes.namespace AND o.name = changes.name \
        AND o.resource_version = changes.rv) WHERE body = ''";
    const FORGET: &str =
        "DELETE FROM seaql_migrations WHERE version = 'm20261124_000004_one_body_copy'";
    const WITH_BODY: &str = "SELECT COUNT(*) AS n FROM changes WHERE body <> ''";
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, url) = open(backend, dir.path()).await;
        let (start, _) = store.versions().await.unwrap();
        for n in 0..5 {
            put(&store, "ns-a", &format!("r-{n:05}"), report("ns-a", n, &[])).await;
        }
        put(
            &store,
            "ns-a",
            "r-00000",
            report("ns-a", 0, &[("step", "two")]),
        )
        .await;
        let events = |changes: Vec<reports_server_apiserver::store::Change>| {
            changes
                .into_iter()
                .map(|c| (c.resource_version, c.object()))
                .collect::<Vec<_>>()
        };
        let before = events(read_changes(&store, start, None, 100).await.unwrap());
        drop(store);

        let db = Database::connect(url.as_str()).await.unwrap();
        let sql = |s: &str| Statement::from_string(db.get_database_backend(), s.to_owned());
        let with_body = async |db: &sea_orm::DatabaseConnection| -> i64 {
            let row = db.query_one_raw(sql(WITH_BODY)).await.unwrap().unwrap();
            row.try_get("", "n").unwrap()
        };
        // Downgrade: every entry has its body, as older releases wrote them.
        db.execute_raw(sql(RESTORE)).await.unwrap();
        db.execute_raw(sql(FORGET)).await.unwrap();
        assert_eq!(with_body(&db).await, 6, "{backend:?}");

        // Upgrade again: the migration empties the five current versions' copies.
        let store = Store::connect(StoreOptions::new(url.clone()))
            .await
            .unwrap();
        assert_eq!(with_body(&db).await, 1, "{backend:?}");
        let after = events(read_changes(&store, start, None, 100).await.unwrap());
        assert_eq!(after, before, "{backend:?}");
    }
}

/// Group commit (32 concurrent writers sharing transactions, with failing decisions mixed in):
/// resourceVersions stay gapless, every acknowledged write and nothing else is in the change
/// log, a write acknowledged before another one started has the smaller version, and
/// read-modify-writes of one shared object lose no update.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_commit_keeps_versions_gapless_and_commit_ordered_under_32_writers() {
    const WRITERS: u64 = 32;
    const WRITES_EACH: u64 = 30;
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, url) = open(backend, dir.path()).await;
        let mut registry = prometheus_client::registry::Registry::default();
        store.register_metrics(&mut registry);
        put(&store, "ns", "hot", report("ns", 0, &[("count", "0")])).await;
        let (start, _) = store.versions().await.unwrap();
        let epoch = std::time::Instant::now();
        let mut tasks = Vec::new();
        for w in 0..WRITERS {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                // (started, acknowledged, resourceVersion) of each acknowledged write.
                let mut acked = Vec::new();
                let (mut failed, mut increments) = (0u64, 0u64);
                for i in 0..WRITES_EACH {
                    let began = epoch.elapsed();
                    let name = format!("w{w}-{}", i % 7);
                    let result = match i % 5 {
                        // A decision that fails: must leave no trace and no gap.
                        0 => store
                            .mutate::<StoreError, _>(&POLICY_REPORT, "ns", &name, false, |_| {
                                Err(StoreError::AlreadyExists)
                            })
                            .await
                            .map(Some),
                        // Read-modify-write of the object every writer increments.
                        1 => store
                            .mutate::<StoreError, _>(&POLICY_REPORT, "ns", "hot", false, |c| {
                                let mut hot = c.expect("hot exists");
                                let n: u64 = hot["metadata"]["labels"]["count"]
                                    .as_str()
                                    .unwrap()
                                    .parse()
                                    .unwrap();
                                hot["metadata"]["labels"]["count"] = json!((n + 1).to_string());
                                Ok(Mutation::Put(hot))
                            })
                            .await
                            .map(Some),
                        // A delete, of an object that may or may not exist.
                        2 if i % 3 == 0 => store
                            .mutate::<StoreError, _>(&POLICY_REPORT, "ns", &name, false, |_| {
                                Ok(Mutation::Delete)
                            })
                            .await
                            .map(Some),
                        // Creates and updates.
                        _ => store
                            .mutate::<StoreError, _>(&POLICY_REPORT, "ns", &name, false, |_| {
                                let mut r = report("ns", w * 1000 + i, &[]);
                                r["metadata"]["name"] = json!(name);
                                Ok(Mutation::Put(r))
                            })
                            .await
                            .map(Some),
                    };
                    match result {
                        Ok(Some(outcome)) if outcome.event.is_some() => {
                            if i % 5 == 1 {
                                increments += 1;
                            }
                            acked.push((began, epoch.elapsed(), outcome.resource_version));
                        }
                        Ok(_) => {}
                        Err(StoreError::AlreadyExists) => failed += 1,
                        Err(e) => panic!("{backend:?}: writer {w}, write {i}: {e}"),
                    }
                }
                (acked, failed, increments)
            }));
        }
        let mut acked = Vec::new();
        let (mut failed, mut increments) = (0, 0);
        for task in tasks {
            let (a, f, n) = task.await.unwrap();
            acked.extend(a);
            failed += f;
            increments += n;
        }
        assert_eq!(failed, WRITERS * WRITES_EACH.div_ceil(5), "{backend:?}");

        let (current, _) = store.versions().await.unwrap();
        let changes = read_changes(&store, start, None, 100_000).await.unwrap();
        let logged: Vec<i64> = changes.iter().map(|c| c.resource_version).collect();
        assert_eq!(
            logged,
            ((start + 1)..=current).collect::<Vec<_>>(),
            "{backend:?}: the change log must be gapless"
        );
        let mut acknowledged: Vec<i64> = acked.iter().map(|a| a.2).collect();
        acknowledged.sort_unstable();
        assert_eq!(
            acknowledged, logged,
            "{backend:?}: exactly the acknowledged writes are in the log"
        );
        for c in &changes {
            if c.event != EventType::Deleted {
                assert_eq!(
                    c.object()["metadata"]["resourceVersion"],
                    json!(c.resource_version.to_string()),
                    "{backend:?}"
                );
            }
        }
        // Commit order: acknowledged before another began ⇒ smaller resourceVersion.
        for a in &acked {
            for b in &acked {
                if a.1 < b.0 {
                    assert!(
                        a.2 < b.2,
                        "{backend:?}: {a:?} acknowledged before {b:?} began"
                    );
                }
            }
        }
        let hot = store
            .get_object(&POLICY_REPORT, "ns", "hot")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            hot["metadata"]["labels"]["count"],
            json!(increments.to_string()),
            "{backend:?}: no read-modify-write may be lost"
        );
        // Creates of one round are written with multi-row statements: every stored object has
        // exactly its own label and result rows.
        let all = store
            .list(&ListQuery {
                metadata_only: true,
                ..ListQuery::all(&POLICY_REPORT)
            })
            .await
            .unwrap()
            .rows;
        let mut objects: Vec<Value> = Vec::with_capacity(all.len());
        for row in &all {
            let object = store.get_object(&POLICY_REPORT, &row.namespace, &row.name);
            objects.push(object.await.unwrap().unwrap());
        }
        let expected_results: usize = objects
            .iter()
            .map(|o| o["results"].as_array().map_or(0, Vec::len))
            .sum();
        let expected_labels: usize = objects
            .iter()
            .map(|o| o["metadata"]["labels"].as_object().map_or(0, |l| l.len()))
            .sum();
        {
            use sea_orm::{ConnectionTrait, Database, Statement};
            let db = Database::connect(url.as_str()).await.unwrap();
            let count = async |table: &str| -> i64 {
                let sql = format!("SELECT COUNT(*) AS n FROM {table}");
                let statement = Statement::from_string(db.get_database_backend(), sql);
                let row = db.query_one_raw(statement).await.unwrap().unwrap();
                row.try_get("", "n").unwrap()
            };
            assert_eq!(
                count("results").await as usize,
                expected_results,
                "{backend:?}"
            );
            assert_eq!(
                count("object_labels").await as usize,
                expected_labels,
                "{backend:?}"
            );
        }
        let with_kyverno_label = store
            .list(&ListQuery {
                labels: LabelSelector::parse("app.kubernetes.io/managed-by=kyverno").unwrap(),
                metadata_only: true,
                ..ListQuery::all(&POLICY_REPORT)
            })
            .await
            .unwrap()
            .rows
            .len();
        assert_eq!(with_kyverno_label, objects.len(), "{backend:?}");

        // The writes did share commits (`/metrics`: objects per round).
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let figure = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
        };
        let rounds = figure("reports_server_store_group_commit_writes_count");
        let written = figure("reports_server_store_group_commit_writes_sum");
        assert!(
            written / rounds > 1.0,
            "{backend:?}: {written} objects in {rounds} rounds: no write shared a commit"
        );
        eprintln!(
            "{backend:?}: {} writes acknowledged by {WRITERS} writers in {rounds} commits, \
             {failed} failed decisions, versions {}..={current} gapless",
            acked.len(),
            start + 1
        );
    }
}

/// A label value the database refuses (the value reaches `object_labels` as it is): PostgreSQL
/// refuses a NUL character in a text column; MariaDB accepts one but, in its default strict
/// mode, refuses a value longer than the column's 63 characters. SQLite refuses neither, so the
/// test runs on the database servers only.
fn refused_label_value(backend: Backend) -> String {
    match backend {
        Backend::Postgres => "nul\u{0}inside".into(),
        Backend::MariaDb => "x".repeat(64),
        Backend::Sqlite => panic!("SQLite stores any label value"),
    }
}

/// A statement that fails for one writer of a group commit round (see
/// [`refused_label_value`]) rolls the round back; the writers are retried one at a time, so
/// only that writer gets the error and the others' writes are stored, with gapless versions.
/// Creates first, then updates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_statement_fails_only_its_writer() {
    for backend in [Backend::Postgres, Backend::MariaDb] {
        a_failing_statement_fails_only_its_writer_on(backend).await;
    }
}

async fn a_failing_statement_fails_only_its_writer_on(backend: Backend) {
    const WRITERS: u64 = 16;
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(backend, dir.path()).await;
    let mut registry = prometheus_client::registry::Registry::default();
    store.register_metrics(&mut registry);
    let (start, _) = store.versions().await.unwrap();
    let bad = WRITERS / 2;
    let barrier = Arc::new(tokio::sync::Barrier::new(WRITERS as usize));
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let (store, barrier) = (store.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let value = if w == bad {
                refused_label_value(backend)
            } else {
                "fine".into()
            };
            let object = report("ns", w, &[("value", &value)]);
            barrier.wait().await;
            store
                .mutate::<StoreError, _>(&POLICY_REPORT, "ns", &format!("r-{w:05}"), false, |_| {
                    Ok(Mutation::Put(object.clone()))
                })
                .await
        }));
    }
    let mut acknowledged = Vec::new();
    for (w, task) in tasks.into_iter().enumerate() {
        match task.await.unwrap() {
            Ok(outcome) => {
                assert_ne!(
                    w as u64, bad,
                    "{backend:?}: the refused label value was stored"
                );
                acknowledged.push(outcome.resource_version);
            }
            Err(e) => {
                assert_eq!(
                    w as u64, bad,
                    "{backend:?}: writer {w} failed with another's error: {e}"
                );
                assert!(matches!(e, StoreError::Database(_)), "{e:?}");
            }
        }
    }
    assert_eq!(acknowledged.len() as u64, WRITERS - 1);
    assert_log_holds_exactly(&store, start, acknowledged).await;
    assert_eq!(
        store.count(&POLICY_REPORT).await.unwrap(),
        WRITERS as i64 - 1
    );

    // The same for updates, which a round stages as well (the old row goes, the new one is
    // inserted): the one whose label value is refused fails alone and its object stays as it was.
    let (start, _) = store.versions().await.unwrap();
    let bad_update = 0;
    let before = store
        .get_object(&POLICY_REPORT, "ns", "r-00000")
        .await
        .unwrap()
        .expect("r-00000 was created");
    let writers: Vec<u64> = (0..WRITERS).filter(|w| *w != bad).collect();
    let barrier = Arc::new(tokio::sync::Barrier::new(writers.len()));
    let mut tasks = Vec::new();
    for &w in &writers {
        let (store, barrier) = (store.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let value = if w == bad_update {
                refused_label_value(backend)
            } else {
                "updated".into()
            };
            barrier.wait().await;
            let outcome = store
                .mutate::<StoreError, _>(&POLICY_REPORT, "ns", &format!("r-{w:05}"), false, |c| {
                    let mut object = c.expect("created above");
                    object["metadata"]["labels"]["value"] = json!(value);
                    Ok(Mutation::Put(object))
                })
                .await;
            (w, outcome)
        }));
    }
    let mut acknowledged = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            (w, Ok(outcome)) => {
                assert_ne!(w, bad_update, "{backend:?}: the refused update was stored");
                acknowledged.push(outcome.resource_version);
            }
            (w, Err(e)) => {
                assert_eq!(
                    w, bad_update,
                    "{backend:?}: writer {w} failed with another's error: {e}"
                );
                assert!(matches!(e, StoreError::Database(_)), "{e:?}");
            }
        }
    }
    assert_eq!(acknowledged.len(), writers.len() - 1);
    assert_log_holds_exactly(&store, start, acknowledged).await;
    let after = store
        .get_object(&POLICY_REPORT, "ns", "r-00000")
        .await
        .unwrap()
        .expect("the failed update left r-00000 in place");
    assert_eq!(after, before, "a failed update changes nothing");
    for &w in writers.iter().filter(|w| **w != bad_update) {
        let object = store
            .get_object(&POLICY_REPORT, "ns", &format!("r-{w:05}"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(object["metadata"]["labels"]["value"], json!("updated"));
    }

    // Whether the bad write shared its round depends on timing: say what happened.
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let retried = text
        .lines()
        .find(|l| l.starts_with("reports_server_store_group_commit_retried_rounds_total "))
        .unwrap_or_else(|| panic!("no retried-rounds counter in /metrics:\n{text}"));
    eprintln!("{retried}");
}

/// The change log after `start` is gapless up to the current version and holds exactly the
/// `acknowledged` versions.
async fn assert_log_holds_exactly(store: &Store, start: i64, mut acknowledged: Vec<i64>) {
    acknowledged.sort_unstable();
    let (current, _) = store.versions().await.unwrap();
    let logged: Vec<i64> = read_changes(store, start, None, 1000)
        .await
        .unwrap()
        .iter()
        .map(|c| c.resource_version)
        .collect();
    assert_eq!(logged, ((start + 1)..=current).collect::<Vec<_>>());
    assert_eq!(logged, acknowledged);
}

/// Every row of `report_results`, as text, in a fixed order.
async fn report_results(db: &impl sea_orm::ConnectionTrait) -> Vec<String> {
    use sea_orm::Statement;
    let rows = db
        .query_all_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT * FROM report_results ORDER BY namespace, report_name, policy, rule, message",
        ))
        .await
        .unwrap();
    let columns = [
        &["cluster_id", "resource", "namespace"][..],
        &RESULT_COLUMNS[..],
    ]
    .concat();
    rows.iter().map(|r| result_text(r, &columns)).collect()
}

/// The `report_results` columns a test compares, but the report's cluster, kind and namespace.
const RESULT_COLUMNS: [&str; 14] = [
    "report_name",
    "source",
    "policy",
    "rule",
    "result",
    "severity",
    "category",
    "subject_api_version",
    "subject_kind",
    "subject_namespace",
    "subject_name",
    "subject_uid",
    "message",
    "properties",
];

/// A `report_results` row as text: `columns`, then `scored` and `timestamp`.
fn result_text(r: &sea_orm::QueryResult, columns: &[&str]) -> String {
    let text = |c: &str| -> String {
        r.try_get::<Option<String>>("", c)
            .unwrap()
            .unwrap_or_else(|| "∅".into())
    };
    let mut fields: Vec<String> = columns.iter().map(|c| text(c)).collect();
    fields.push(format!(
        "{:?}",
        r.try_get::<Option<bool>>("", "scored").unwrap()
    ));
    fields.push(format!(
        "{:?}",
        r.try_get::<Option<i64>>("", "timestamp").unwrap()
    ));
    fields.join("|")
}

/// The compression method of `objects.body` and `changes.body` on PostgreSQL (`pg_attribute`:
/// `l` LZ4, `p` pglz).
async fn body_compression(db: &sea_orm::DatabaseConnection) -> Vec<String> {
    use sea_orm::ConnectionTrait;
    db.query_all_raw(sea_orm::Statement::from_string(
        sea_orm::DbBackend::Postgres,
        "SELECT attcompression::text AS c FROM pg_attribute \
         WHERE attrelid IN ('objects'::regclass, 'changes'::regclass) AND attname = 'body' \
         ORDER BY attrelid::regclass::text DESC",
    ))
    .await
    .unwrap()
    .iter()
    .map(|r| r.try_get("", "c").unwrap())
    .collect()
}

/// `m20261125_000005_lean_results` keeps every row of `report_results` as it was, and so does
/// its downgrade: creates alone and in a round, updates, results about other objects than the
/// scope, results without a subject, a source or a score.
#[tokio::test]
async fn the_lean_results_migration_and_its_downgrade_keep_report_results() {
    use reports_server_apiserver::store::downgrade_schema;
    use sea_orm::{ConnectionTrait, Database};
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, url) = open(backend, dir.path()).await;
        put(&store, "ns-a", "r-00000", report("ns-a", 0, &[])).await;
        let mut odd = report("ns-a", 1, &[]);
        odd["results"][1]["resources"] = json!([{
            "apiVersion": "apps/v1", "kind": "Deployment", "namespace": "ns-b",
            "name": "web", "uid": "deployment-uid"
        }]);
        let first = odd["results"][2].as_object_mut().unwrap();
        first.remove("resources");
        first.remove("source");
        first.remove("scored");
        odd["results"][3]["result"] = json!("fail");
        odd["results"][3]["message"] = json!("validation error: privileged");
        // Results with a time other than the report's, and without any.
        odd["results"][4]["timestamp"]["seconds"] = json!(1_600_000_000);
        odd["results"][5]
            .as_object_mut()
            .unwrap()
            .remove("timestamp");
        put(&store, "ns-a", "r-00001", odd).await;
        // An update replaces the report's rows.
        let mut updated = report("ns-a", 0, &[]);
        updated["results"][0]["result"] = json!("fail");
        put(&store, "ns-a", "r-00000", updated).await;
        // Several creates in one round take the staged multi-row path.
        store
            .put_all(
                &POLICY_REPORT,
                (2..6).map(|n| report("ns-c", n, &[])).collect(),
            )
            .await
            .unwrap();
        let db = Database::connect(url.as_str()).await.unwrap();
        let lean = report_results(&db).await;
        assert_eq!(lean.len(), 6 * 19, "{backend:?}");
        if backend == Backend::Postgres {
            // `m20261125_000006_lz4_bodies`: PostgreSQL 15 from Debian has LZ4.
            assert_eq!(body_compression(&db).await, ["l", "l"], "new bodies: LZ4");
        }
        if backend == Backend::Sqlite {
            // `m20261125_000007_sqlite_lz4_bodies`: the store compresses bodies itself.
            assert_eq!(body_forms(&db).await, ["blob: 6"], "bodies: LZ4 blobs");
        }
        let objects = every_object(&store).await;
        assert!(
            lean.iter()
                .any(|r| r.contains("|apps/v1|Deployment|ns-b|web|deployment-uid|")),
            "{backend:?}: a result's own subject is kept: {lean:#?}"
        );
        let rules = store
            .query_raw("SELECT COUNT(*) AS n FROM policy_rules")
            .await
            .unwrap();
        let rules: i64 = rules[0].try_get("", "n").unwrap();
        assert_eq!(rules, 19 + 1, "{backend:?}: one row per distinct rule");
        drop(store);

        // What `reports-server migrate schema-downgrade --to …` does.
        let options = StoreOptions::new(url.clone());
        let undone = downgrade_schema(&options, "m20261124_000004_one_body_copy")
            .await
            .unwrap();
        assert_eq!(
            undone,
            [
                "m20261129_000012_report_result_timestamp",
                "m20261128_000011_compliance_history",
                "m20261128_000010_cluster_identity",
                "m20261128_000009_analytics_views",
                "m20261127_000008_mysql_binary_collation",
                "m20261125_000007_sqlite_lz4_bodies",
                "m20261125_000006_lz4_bodies",
                "m20261125_000005_lean_results"
            ],
            "{backend:?}"
        );
        if backend == Backend::Sqlite {
            assert_eq!(body_forms(&db).await, ["text: 6"], "JSON text again");
        }
        assert_eq!(
            report_results(&db).await,
            lean,
            "{backend:?}: after the downgrade"
        );
        if backend == Backend::Postgres {
            assert_eq!(body_compression(&db).await, ["p", "p"], "pglz again");
        }
        let wide = db
            .query_all_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT COUNT(*) AS n FROM results WHERE cluster_id IS NOT NULL",
            ))
            .await
            .unwrap();
        let wide: i64 = wide[0].try_get("", "n").unwrap();
        assert_eq!(
            wide,
            lean.len() as i64,
            "{backend:?}: the wide rows are back"
        );
        assert!(
            downgrade_schema(&options, "m20261124_000004_one_body_copy")
                .await
                .unwrap()
                .is_empty(),
            "{backend:?}: a second downgrade has nothing to undo"
        );
        assert!(
            downgrade_schema(&options, "m20261125_000005_lean_results")
                .await
                .unwrap()
                .is_empty(),
            "{backend:?}: a downgrade to a migration newer than the database undoes nothing"
        );
        assert_eq!(report_results(&db).await, lean, "{backend:?}: still there");
        let store = Store::connect(options).await.unwrap();
        assert_eq!(
            report_results(&db).await,
            lean,
            "{backend:?}: after the upgrade"
        );
        if backend == Backend::Sqlite {
            // The upgrade compressed the text bodies the downgrade had left.
            assert_eq!(body_forms(&db).await, ["blob: 6"], "compressed again");
        }
        assert_eq!(every_object(&store).await, objects, "{backend:?}: bodies");
        // The downgrade gave every row its own time: a rescan by this release replaces them
        // with the rows a create of the same report writes.
        let mut rescanned = report("ns-a", 0, &[]);
        rescan(rescanned["results"].as_array_mut().unwrap(), 1_800_000_000);
        flip(&mut rescanned["results"][7]);
        put(&store, "ns-a", "r-00000", rescanned.clone()).await;
        assert_eq!(
            results_of(&store, "ns-a", "r-00000").await,
            results_of_a_create(&store, &rescanned, "ns-fresh").await,
            "{backend:?}: rescanned after the upgrade"
        );
    }
}

/// How the `objects` rows hold their bodies on SQLite: `typeof(body): rows`.
async fn body_forms(db: &sea_orm::DatabaseConnection) -> Vec<String> {
    use sea_orm::ConnectionTrait;
    db.query_all_raw(sea_orm::Statement::from_string(
        sea_orm::DbBackend::Sqlite,
        "SELECT typeof(body) AS form, COUNT(*) AS n FROM objects GROUP BY form ORDER BY form",
    ))
    .await
    .unwrap()
    .iter()
    .map(|r| {
        let form: String = r.try_get("", "form").unwrap();
        let n: i64 = r.try_get("", "n").unwrap();
        format!("{form}: {n}")
    })
    .collect()
}

/// Every stored PolicyReport, as the store reads it.
async fn every_object(store: &Store) -> Vec<Value> {
    let page = store
        .list(&ListQuery::all(&POLICY_REPORT))
        .await
        .expect("list");
    page.rows
        .iter()
        .map(|r| serde_json::from_str(&r.body).expect("JSON"))
        .collect()
}

/// Every session of the store is set to end when it idles inside a transaction: one abandoned
/// by a client behind a network that drops packets would otherwise hold the resourceVersion
/// counter's row lock, and so every write, until TCP keepalive noticed. SQLite has no sessions
/// to lose; MySQL (not tested) has no such setting.
#[tokio::test]
async fn sessions_end_when_idle_inside_a_transaction() {
    for (backend, sql, want) in [
        (
            Backend::Postgres,
            "SHOW idle_in_transaction_session_timeout",
            "3s",
        ),
        (
            Backend::MariaDb,
            "SELECT CAST(@@SESSION.idle_transaction_timeout AS CHAR)",
            "3",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let url = backend.database_url(dir.path()).unwrap();
        let mut options = StoreOptions::new(url);
        options.idle_in_transaction_timeout = Duration::from_secs(3);
        let store = Store::connect(options).await.unwrap();
        let rows = store.query_raw(sql).await.unwrap();
        let got: String = rows[0].try_get_by_index(0).unwrap();
        assert_eq!(got, want, "{backend:?}");
    }
}

/// Every PostgreSQL session plans each execution with its parameters: a generic plan made while
/// a new store's `objects` table was nearly empty scanned it on every lookup by key.
#[tokio::test]
async fn postgres_sessions_plan_every_execution() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = open(Backend::Postgres, dir.path()).await;
    let rows = store.query_raw("SHOW plan_cache_mode").await.unwrap();
    let got: String = rows[0].try_get_by_index(0).unwrap();
    assert_eq!(got, "force_custom_plan");
}

/// A small deterministic generator (no dependency, the same sequence on every run).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

/// One step of [`an_update_leaves_the_result_rows_a_create_of_the_same_report_writes`]: the
/// next version of `report`'s results and labels, changed in one of the ways producers change
/// them.
fn next_version(report: &mut Value, step: u64, rng: &mut Lcg) {
    let fresh = |n: u64| {
        let r = pss_policy_report(&Subject::pod("diff", n), 1_700_000_000 + n as i64, &[0]);
        serde_json::to_value(&r.results.unwrap()[(n % 19) as usize]).unwrap()
    };
    let results = report["results"].as_array_mut().unwrap();
    let len = results.len();
    match rng.below(12) {
        // One result changes outcome and message.
        0 if len > 0 => {
            let r = &mut results[rng.below(len)];
            flip(r);
            r["message"] = json!(format!("changed at step {step}"));
        }
        1 if len > 0 => {
            results.remove(rng.below(len));
        }
        // A duplicate: equal rows are a multiset, not a set.
        2 if len > 0 => {
            let copy = results[rng.below(len)].clone();
            results.insert(rng.below(len + 1), copy);
        }
        // Rotation, as a ring of the newest events.
        3 if len > 0 => {
            results.remove(0);
            results.push(fresh(100 + step));
        }
        4 => results.reverse(),
        5 => rescan(results, 1_800_000_000 + step as i64),
        6 => results.clear(),
        7 => {
            report["metadata"]["labels"]["step"] = json!(format!("s{}", step % 3));
        }
        // A result of another time than the others (a partial rescan).
        8 if len > 0 => {
            results[rng.below(len)]["timestamp"]["seconds"] = json!(1_600_000_000 + step);
        }
        // A result without a time.
        9 if len > 0 => {
            let r = results[rng.below(len)].as_object_mut().unwrap();
            r.remove("timestamp");
        }
        // A rescan: every result at a new time, one outcome changed.
        10 if len > 0 => {
            rescan(results, 1_900_000_000 + step as i64);
            flip(&mut results[rng.below(len)]);
        }
        // A result about a subject of its own (not the report's scope), or new results.
        _ => {
            if len > 0 {
                let r = &mut results[rng.below(len)];
                r["resources"] = json!([{"apiVersion": "v1", "kind": "Pod",
                    "namespace": "diff", "name": format!("other-{step}"), "uid": format!("u-{step}")}]);
            }
            for n in 0..rng.below(4) as u64 {
                results.push(fresh(step * 10 + n));
            }
        }
    }
}

/// `report_results` rows of namespace `ns`, as text without the namespace, sorted.
async fn results_in(store: &Store, ns: &str) -> Vec<String> {
    let rows = store
        .query_raw(&format!(
            "SELECT * FROM report_results WHERE namespace = '{ns}'"
        ))
        .await
        .unwrap();
    let mut out: Vec<String> = rows
        .iter()
        .map(|r| result_text(r, &RESULT_COLUMNS))
        .collect();
    out.sort();
    out
}

/// The `key=value` label rows of the objects in namespace `ns`, sorted.
async fn labels_in(store: &Store, ns: &str) -> Vec<String> {
    let rows = store
        .query_raw(&format!(
            "SELECT l.key, l.value FROM object_labels l JOIN objects o ON o.id = l.object_id \
             WHERE o.namespace = '{ns}'"
        ))
        .await
        .unwrap();
    let mut out: Vec<String> = rows
        .iter()
        .map(|r| {
            let key: String = r.try_get("", "key").unwrap();
            let value: String = r.try_get("", "value").unwrap();
            format!("{key}={value}")
        })
        .collect();
    out.sort();
    out
}

/// Stamps every one of `results` with `seconds`, as a scan does.
fn rescan(results: &mut [Value], seconds: i64) {
    for r in results {
        r["timestamp"]["seconds"] = json!(seconds);
    }
}

/// The `report_results` rows (as [`results_in`] gives them) that a create of `report` writes,
/// made in namespace `ns` after deleting whatever is there: what an update to `report` must
/// leave.
async fn results_of_a_create(store: &Store, report: &Value, ns: &str) -> Vec<String> {
    let name = report["metadata"]["name"].as_str().expect("a named report");
    store
        .mutate::<StoreError, _>(&POLICY_REPORT, ns, name, false, |_| Ok(Mutation::Delete))
        .await
        .unwrap();
    let mut created = report.clone();
    created["metadata"]["namespace"] = json!(ns);
    put(store, ns, name, created).await;
    results_in(store, ns).await
}

/// The rows of report `name` among [`results_in`] `ns`.
async fn results_of(store: &Store, ns: &str, name: &str) -> Vec<String> {
    let prefix = format!("{name}|");
    let mut rows = results_in(store, ns).await;
    rows.retain(|r| r.starts_with(&prefix));
    rows
}

/// A store on `backend` in `dir` holding `first` as `ns/r-00001` and then another report,
/// whose rows come after `first`'s: a row re-inserted for `first` cannot get its rowid back.
async fn store_with(backend: Backend, dir: &std::path::Path, ns: &str, first: &Value) -> Store {
    let (store, _) = open(backend, dir).await;
    put(&store, ns, "r-00001", first.clone()).await;
    put(&store, ns, "r-00002", report(ns, 2, &[])).await;
    store
}

/// Flips a result's outcome between pass and fail.
fn flip(result: &mut Value) {
    result["result"] = json!(if result["result"] == "fail" {
        "pass"
    } else {
        "fail"
    });
}

/// The physical identity of each `results` row of report `ns/name`, by slot: PostgreSQL's
/// `ctid` or SQLite's `rowid`, which a re-inserted row does not keep. MariaDB has none.
async fn row_identities(
    store: &Store,
    backend: Backend,
    ns: &str,
    name: &str,
) -> Option<Vec<(i32, String)>> {
    let identity = match backend {
        Backend::Postgres => "CAST(r.ctid AS TEXT)",
        Backend::Sqlite => "CAST(r.rowid AS TEXT)",
        Backend::MariaDb => return None,
    };
    let rows = store
        .query_raw(&format!(
            "SELECT r.ordinal, {identity} AS id FROM results r \
             JOIN objects o ON o.id = r.object_id \
             WHERE o.namespace = '{ns}' AND o.name = '{name}' ORDER BY r.ordinal"
        ))
        .await
        .unwrap();
    Some(
        rows.iter()
            .map(|r| {
                (
                    r.try_get("", "ordinal").unwrap(),
                    r.try_get("", "id").unwrap(),
                )
            })
            .collect(),
    )
}

/// A Kyverno rescan stamps every result with the scan's time; the rows leave that time to
/// their report (`m20261129_000012_report_result_timestamp`), so a rescan that changes one
/// outcome rewrites that one row, whether the update is alone in its round or in a bulk one,
/// and `report_results` still gives every result its time.
#[tokio::test]
async fn a_rescan_rewrites_only_the_rows_whose_outcome_changed() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let mut scanned = report("rescan", 1, &[]);
        let store = store_with(backend, dir.path(), "rescan", &scanned).await;
        for round in 0..2i32 {
            let before = row_identities(&store, backend, "rescan", "r-00001").await;
            rescan(
                scanned["results"].as_array_mut().unwrap(),
                1_800_000_000 + i64::from(round),
            );
            flip(&mut scanned["results"][3 + round as usize]);
            if round == 0 {
                put(&store, "rescan", "r-00001", scanned.clone()).await;
            } else {
                let other = report("rescan", 3, &[]);
                store
                    .put_all(&POLICY_REPORT, vec![scanned.clone(), other])
                    .await
                    .unwrap();
            }
            if let Some(rewritten) =
                rewritten_slots(&store, backend, "rescan", "r-00001", before).await
            {
                assert_eq!(rewritten, [3 + round], "{backend:?}: round {round}");
            }
            assert_eq!(
                results_of(&store, "rescan", "r-00001").await,
                results_of_a_create(&store, &scanned, "created").await,
                "{backend:?}: round {round}"
            );
        }
    }
}

/// The slots of report `ns/name` whose rows an update replaced: the rows it re-inserted or
/// moved (`before`'s identities, read before the update); `None` on MariaDB.
async fn rewritten_slots(
    store: &Store,
    backend: Backend,
    ns: &str,
    name: &str,
    before: Option<Vec<(i32, String)>>,
) -> Option<Vec<i32>> {
    let after = row_identities(store, backend, ns, name).await?;
    let before = before?;
    let slots = |rows: &[(i32, String)]| rows.iter().map(|(s, _)| *s).collect::<Vec<_>>();
    assert_eq!(slots(&before), slots(&after), "{backend:?}: the same slots");
    Some(
        before
            .iter()
            .zip(&after)
            .filter(|(b, a)| b.1 != a.1)
            .map(|(b, _)| b.0)
            .collect(),
    )
}

/// A report of events, each result at the time of its event (falcosidekick's ring: the oldest
/// dropped, the newest appended; some in the same second), has no time of its own: rotating it
/// replaces one row, the dropped one's slot taken by the new one, and no other row moves with
/// the report's newest or most common time.
#[tokio::test]
async fn a_ring_of_events_at_their_own_times_rewrites_one_row_per_event() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let mut ring = report("events", 1, &[]);
        for (i, r) in ring["results"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .enumerate()
        {
            // Two events a second.
            r["timestamp"]["seconds"] = json!(1_800_000_000 + (i / 2) as i64);
        }
        let store = store_with(backend, dir.path(), "events", &ring).await;
        let before = row_identities(&store, backend, "events", "r-00001").await;
        let results = ring["results"].as_array_mut().unwrap();
        let mut newest = results.remove(0);
        newest["timestamp"]["seconds"] = json!(1_800_000_100);
        newest["message"] = json!("the newest event");
        results.push(newest);
        put(&store, "events", "r-00001", ring).await;
        if let Some(rewritten) = rewritten_slots(&store, backend, "events", "r-00001", before).await
        {
            assert_eq!(rewritten, [0], "{backend:?}");
        }
    }
}

/// Updates diff a report's result rows against the stored ones instead of rewriting them
/// (`store::result_diff`): after any sequence of updates — results changed, removed,
/// duplicated, rotated, reordered, emptied, given subjects of their own, rescanned, given
/// times of their own or none, labels changed — in
/// rounds of one write and in bulk rounds, `report_results` holds exactly the rows a create
/// of the same report writes, and each report's slots stay unique.
#[tokio::test]
async fn an_update_leaves_the_result_rows_a_create_of_the_same_report_writes() {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(backend, dir.path()).await;
        let mut rng = Lcg(37);
        let mut updated = report("diff", 1, &[("step", "s0")]);
        updated["metadata"]["namespace"] = json!("updated");
        put(&store, "updated", "r-00001", updated.clone()).await;
        for step in 0..60 {
            next_version(&mut updated, step, &mut rng);
            // Alone in its round (SQLite updates the row in place), or in a bulk round with
            // another report (SQLite stages it; PostgreSQL stages every round).
            if step % 2 == 0 {
                put(&store, "updated", "r-00001", updated.clone()).await;
            } else {
                let mut other = report("bulk", step, &[]);
                other["metadata"]["namespace"] = json!("bulk");
                store
                    .put_all(&POLICY_REPORT, vec![updated.clone(), other])
                    .await
                    .unwrap();
            }
            assert_eq!(
                results_in(&store, "updated").await,
                results_of_a_create(&store, &updated, "created").await,
                "{backend:?}: step {step}, {} results",
                updated["results"].as_array().unwrap().len()
            );
            assert_eq!(
                labels_in(&store, "updated").await,
                labels_in(&store, "created").await,
                "{backend:?}: step {step}"
            );
        }
        racing_updates_of_one_report(&store, backend).await;
        // Only PostgreSQL folds the freed slots into one statement; the others delete them
        // chunk by chunk.
        if backend == Backend::Postgres {
            big_reports_with_most_results_changed(&store, backend).await;
        }
        let slots = store
            .query_raw(
                "SELECT COUNT(*) AS n FROM (SELECT object_id, ordinal FROM results \
                 GROUP BY object_id, ordinal HAVING COUNT(*) > 1) d",
            )
            .await
            .unwrap();
        assert_eq!(slots[0].try_get::<i64>("", "n").unwrap(), 0, "{backend:?}");
    }
}

/// Gives `report` `count` copies of its first result, the i-th with message `result {i}` and
/// then `edit(i, result)`.
fn with_results(report: &mut Value, count: usize, edit: impl Fn(usize, &mut Value)) {
    let one = report["results"][0].clone();
    let results = (0..count).map(|i| {
        let mut r = one.clone();
        r["message"] = json!(format!("result {i}"));
        edit(i, &mut r);
        r
    });
    report["results"] = Value::Array(results.collect());
}

/// Eight writers editing one report at once: most find it changed when their round comes and
/// decide again on what is current, so the result rows they read beside their first decision
/// are stale and the round must read the current ones. The rows are then those a create of the
/// final version writes.
async fn racing_updates_of_one_report(store: &Store, backend: Backend) {
    let mut seed = report("race", 1, &[]);
    seed["metadata"]["namespace"] = json!("racing");
    with_results(&mut seed, 12, |_, _| {});
    put(store, "racing", "r-00001", seed).await;
    let writers: Vec<_> = (0..8)
        .map(|writer| {
            let store = store.clone();
            tokio::spawn(async move {
                for edit in 0..5 {
                    let decide = |current: Option<Value>| {
                        let mut next = current.expect("the report exists");
                        let results = next["results"].as_array_mut().unwrap();
                        results.rotate_left(1 + writer % 3);
                        results[writer % 12]["message"] = json!(format!("{writer}/{edit}"));
                        Ok(Mutation::Put(next))
                    };
                    store
                        .mutate::<StoreError, _>(&POLICY_REPORT, "racing", "r-00001", false, decide)
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    let mut last = store
        .get_object(&POLICY_REPORT, "racing", "r-00001")
        .await
        .unwrap()
        .unwrap();
    last["metadata"]["namespace"] = json!("raced");
    put(store, "raced", "r-00001", last).await;
    assert_eq!(
        results_in(store, "racing").await,
        results_in(store, "raced").await,
        "{backend:?}: after racing updates"
    );
}

/// 70 reports of 1,000 results in one bulk round, then again with 950 of each changed: 66,500
/// freed slots in one round, more than one statement may bind (65,535 parameters on
/// PostgreSQL); the rows are then those of the new versions.
async fn big_reports_with_most_results_changed(store: &Store, backend: Backend) {
    let version = |n: u64, seconds: i64| {
        let mut v = report("big", n, &[]);
        v["metadata"]["namespace"] = json!("big");
        with_results(&mut v, 1000, |i, r| {
            r["timestamp"]["seconds"] = json!(if i < 950 { seconds } else { 1 });
        });
        v
    };
    for seconds in [1_700_000_000, 1_800_000_000] {
        let reports = (0..70).map(|n| version(n, seconds)).collect();
        store.put_all(&POLICY_REPORT, reports).await.unwrap();
    }
    let rows = store
        .query_raw(
            "SELECT COUNT(*) AS n FROM report_results WHERE namespace = 'big' \
             AND timestamp IN (1, 1800000000)",
        )
        .await
        .unwrap();
    assert_eq!(
        rows[0].try_get::<i64>("", "n").unwrap(),
        70_000,
        "{backend:?}"
    );
}
