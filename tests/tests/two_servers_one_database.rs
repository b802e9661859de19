//! Two `reports-server` processes sharing one database (the HA setup): a watch on process A
//! sees every write made through process B, in resourceVersion order and without gaps;
//! resourceVersions of writes interleaved through A and B increase in commit order; optimistic
//! concurrency (409 on a stale resourceVersion, 409 on a duplicate create) holds across them.
//!
//! PostgreSQL is the supported multi-replica backend (LISTEN/NOTIFY wakes the other process).
//! The same test also runs on one SQLite file shared by two processes on one machine, where the
//! other process learns of changes by polling.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use kube::api::{
    Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams, Preconditions, WatchEvent,
    WatchParams,
};
use kube::runtime::watcher;
use reports_server_crds::catalog::POLICY_REPORT;
use reports_server_tests::Backend;
use reports_server_tests::objects::{api_resource, list_rv, name_of, rv_of};
use reports_server_tests::server::ServerProcess;
use serde_json::json;

const PATIENCE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_share_one_postgres_database() {
    two_servers(Backend::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_share_one_sqlite_file() {
    two_servers(Backend::Sqlite).await
}

fn api(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &api_resource(&POLICY_REPORT))
}

fn report(name: &str, pass: i64) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "wgpolicyk8s.io/v1alpha2",
        "kind": "PolicyReport",
        "metadata": {"name": name},
        "scope": {"apiVersion": "v1", "kind": "Pod", "name": name},
        "summary": {"pass": pass, "fail": 0, "warn": 0, "error": 0, "skip": 0},
    }))
    .unwrap()
}

/// (event type, name, rv) of raw watch events until one with `rv >= until`.
async fn events_until<S>(stream: &mut S, until: u64, what: &str) -> Vec<(&'static str, String, u64)>
where
    S: futures::Stream<Item = Result<WatchEvent<DynamicObject>, kube::Error>> + Unpin,
{
    let mut got = Vec::new();
    while got.last().is_none_or(|(_, _, rv)| *rv < until) {
        let event = tokio::time::timeout(PATIENCE, stream.try_next())
            .await
            .unwrap_or_else(|_| panic!("{what}: stalled after {got:?}"))
            .unwrap_or_else(|e| panic!("{what}: {e}"))
            .unwrap_or_else(|| panic!("{what}: the watch ended after {got:?}"));
        match event {
            WatchEvent::Added(o) => got.push(("ADDED", name_of(&o), rv_of(&o))),
            WatchEvent::Modified(o) => got.push(("MODIFIED", name_of(&o), rv_of(&o))),
            WatchEvent::Deleted(o) => got.push(("DELETED", name_of(&o), rv_of(&o))),
            WatchEvent::Bookmark(_) => {}
            WatchEvent::Error(e) => panic!("{what}: {e:?}"),
        }
    }
    got
}

async fn two_servers(backend: Backend) {
    let dir_a = tempfile::tempdir().unwrap();
    let dir_b = tempfile::tempdir().unwrap();
    let url = backend
        .database_url(dir_a.path())
        .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"));
    // Aggregation off: only the test writes, so every event is accounted for.
    let args = ["--aggregation=false"];
    let a = ServerProcess::start_with(dir_a.path(), Some(url.clone()), &args)
        .await
        .unwrap();
    let b = ServerProcess::start_with(dir_b.path(), Some(url.clone()), &args)
        .await
        .unwrap();
    assert_ne!(a.port, b.port);
    let (client_a, client_b) = (a.client().await.unwrap(), b.client().await.unwrap());
    let (on_a, on_b) = (api(&client_a, "ha"), api(&client_b, "ha"));

    // 1. A watch on A sees writes made through B: all of them, in order, nothing else.
    let from = list_rv(&on_a).await;
    assert_eq!(from, list_rv(&on_b).await, "{backend:?}: one counter");
    let mut raw_a = on_a
        .watch(&WatchParams::default().timeout(120), &from.to_string())
        .await
        .unwrap()
        .boxed();
    let mut watcher_a = watcher(on_a.clone(), watcher::Config::default().streaming_lists()).boxed();
    loop {
        let e = tokio::time::timeout(PATIENCE, watcher_a.try_next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if matches!(e, watcher::Event::InitDone) {
            break;
        }
    }
    let mut written = Vec::new();
    for n in 0..20 {
        let o = on_b
            .create(&PostParams::default(), &report(&format!("b-{n:02}"), 0))
            .await
            .unwrap();
        written.push(("ADDED", name_of(&o), rv_of(&o)));
    }
    for n in 0..10 {
        let o = on_b
            .patch(
                &format!("b-{n:02}"),
                &PatchParams::default(),
                &Patch::Merge(json!({"summary": {"pass": 1}})),
            )
            .await
            .unwrap();
        written.push(("MODIFIED", name_of(&o), rv_of(&o)));
    }
    for n in 10..15 {
        let o = on_b
            .delete(&format!("b-{n:02}"), &DeleteParams::default())
            .await
            .unwrap()
            .left()
            .unwrap();
        written.push(("DELETED", name_of(&o), rv_of(&o)));
    }
    let last = written.last().unwrap().2;
    let seen = events_until(&mut raw_a, last, "watch on A").await;
    assert_eq!(
        seen, written,
        "{backend:?}: A's watch vs B's acknowledged writes"
    );
    let rvs: Vec<u64> = written.iter().map(|w| w.2).collect();
    assert_eq!(
        rvs,
        ((from + 1)..=last).collect::<Vec<_>>(),
        "{backend:?}: B's sequential writes got consecutive versions"
    );
    let mut via_watcher = Vec::new();
    while via_watcher.len() < written.len() {
        match tokio::time::timeout(PATIENCE, watcher_a.try_next())
            .await
            .expect("the watcher on A stalled")
            .unwrap()
            .unwrap()
        {
            watcher::Event::Apply(o) => via_watcher.push((name_of(&o), rv_of(&o))),
            watcher::Event::Delete(o) => via_watcher.push((name_of(&o), rv_of(&o))),
            other => panic!("{backend:?}: unexpected {other:?}"),
        }
    }
    let expected: Vec<(String, u64)> = written.iter().map(|w| (w.1.clone(), w.2)).collect();
    assert_eq!(via_watcher, expected, "{backend:?}: kube-rs watcher on A");

    // 2a. Writes alternating between A and B, each acknowledged before the next starts: the
    // versions increase in that (commit) order.
    let mut previous = last;
    for n in 0..20 {
        let (target, who) = if n % 2 == 0 {
            (&on_a, "a")
        } else {
            (&on_b, "b")
        };
        let o = target
            .create(
                &PostParams::default(),
                &report(&format!("alt-{who}-{n:02}"), 0),
            )
            .await
            .unwrap();
        assert!(
            rv_of(&o) > previous,
            "{backend:?}: write {n} through {who} got {} after {previous}",
            rv_of(&o)
        );
        previous = rv_of(&o);
    }

    // 2b. Concurrent writers on both: distinct versions, and watches on A and on B both see the
    // union of what was acknowledged, strictly increasing, with no gap.
    let from = list_rv(&on_a).await;
    let mut watch_a = on_a
        .watch(&WatchParams::default().timeout(120), &from.to_string())
        .await
        .unwrap()
        .boxed();
    let mut watch_b = on_b
        .watch(&WatchParams::default().timeout(120), &from.to_string())
        .await
        .unwrap()
        .boxed();
    let burst = |api: Api<DynamicObject>, who: &'static str| async move {
        futures::stream::iter(0..50)
            .map(|n| {
                let api = api.clone();
                async move {
                    let o = api
                        .create(
                            &PostParams::default(),
                            &report(&format!("par-{who}-{n:02}"), 0),
                        )
                        .await
                        .unwrap();
                    rv_of(&o)
                }
            })
            .buffer_unordered(4)
            .collect::<Vec<u64>>()
            .await
    };
    let (rvs_a, rvs_b) = tokio::join!(burst(on_a.clone(), "a"), burst(on_b.clone(), "b"));
    let acknowledged: BTreeSet<u64> = rvs_a.iter().chain(&rvs_b).copied().collect();
    assert_eq!(
        acknowledged.len(),
        100,
        "{backend:?}: a version was given twice"
    );
    let top = *acknowledged.last().unwrap();
    assert_eq!(
        acknowledged.iter().copied().collect::<Vec<_>>(),
        ((from + 1)..=top).collect::<Vec<_>>(),
        "{backend:?}: versions of the concurrent writes have a hole"
    );
    for (who, stream) in [("A", &mut watch_a), ("B", &mut watch_b)] {
        let seen: Vec<u64> = events_until(stream, top, who)
            .await
            .iter()
            .map(|e| e.2)
            .collect();
        assert_eq!(
            seen,
            acknowledged.iter().copied().collect::<Vec<_>>(),
            "{backend:?}: watch on {who}"
        );
    }
    assert_eq!(list_rv(&on_a).await, list_rv(&on_b).await);

    // 3. Optimistic concurrency across processes.
    let v1 = on_a
        .create(&PostParams::default(), &report("shared", 0))
        .await
        .unwrap();
    let dup = on_b
        .create(&PostParams::default(), &report("shared", 9))
        .await
        .unwrap_err();
    assert!(
        matches!(&dup, kube::Error::Api(s) if s.code == 409 && s.reason == "AlreadyExists"),
        "{backend:?}: duplicate create through the other process: {dup}"
    );
    let mut through_b = on_b.get("shared").await.unwrap();
    assert_eq!(rv_of(&through_b), rv_of(&v1));
    through_b.data["summary"]["pass"] = json!(1);
    let v2 = on_b
        .replace("shared", &PostParams::default(), &through_b)
        .await
        .unwrap();
    let mut stale = v1.clone();
    stale.data["summary"]["pass"] = json!(2);
    let err = on_a
        .replace("shared", &PostParams::default(), &stale)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409 && s.reason == "Conflict"),
        "{backend:?}: an update through A with a version B superseded: {err}"
    );
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: v1.metadata.resource_version.clone(),
            uid: None,
        }),
        ..Default::default()
    };
    let err = on_a.delete("shared", &dp).await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409),
        "{err}"
    );
    assert_eq!(rv_of(&on_a.get("shared").await.unwrap()), rv_of(&v2));

    // Read-modify-write increments racing through both processes: none is lost.
    let conflicts = Arc::new(AtomicUsize::new(0));
    let increments = |api: Api<DynamicObject>, conflicts: Arc<AtomicUsize>| async move {
        for _ in 0..15 {
            loop {
                let mut o = api.get("shared").await.unwrap();
                let pass = o.data["summary"]["pass"].as_i64().unwrap();
                o.data["summary"]["pass"] = json!(pass + 1);
                match api.replace("shared", &PostParams::default(), &o).await {
                    Ok(_) => break,
                    Err(kube::Error::Api(s)) if s.code == 409 => {
                        conflicts.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
    };
    tokio::join!(
        increments(on_a.clone(), conflicts.clone()),
        increments(on_b.clone(), conflicts.clone()),
        increments(on_a.clone(), conflicts.clone()),
        increments(on_b.clone(), conflicts.clone()),
    );
    let end = on_a.get("shared").await.unwrap();
    assert_eq!(
        end.data["summary"]["pass"].as_i64(),
        Some(1 + 60),
        "{backend:?}: lost updates across processes ({} conflicts retried)",
        conflicts.load(Ordering::Relaxed)
    );
    eprintln!(
        "{backend:?}: {} conflicts retried across the two processes",
        conflicts.load(Ordering::Relaxed)
    );
}
