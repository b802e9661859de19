//! API conformance for issue 3: one test per weakness of the peer listed in
//! `peer-reports-server.md` §9 (items 1–10 and 16), each named after the behaviour it proves and
//! each run on every backend: SQLite and PostgreSQL in the `conformance` binary
//! (`<test>::sqlite`, `<test>::postgres`), MariaDB in `conformance_mariadb` (`<test>::mariadb`).
//! Two binaries so that `cargo xtask test` runs the MariaDB half beside the rest instead of
//! after it; the test bodies are this module, shared by both.
//!
//! Every test drives a real `reports-server serve` process over HTTPS with real clients: kubectl
//! where a user would use it (printer columns, categories, `get -w`, `replace`, `apply`), the
//! kube-rs `Api` and `kube::runtime::watcher` (with and without streaming lists) elsewhere, and
//! raw HTTP only for what no client exposes (status codes, `Accept` headers, a stalled reader).
//!
//! In-process aggregation is switched off (`--aggregation=false`): these tests observe every
//! write, and a background merge writing policy reports would add events nobody asked for.
//! Server-side apply (item 4) is tested with its implementation, not here.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    Preconditions, PropagationPolicy, WatchEvent, WatchParams,
};
use kube::runtime::watcher;
use reports_server_apiserver::registry::stamp_new;
use reports_server_crds::ResourceDescriptor;
use reports_server_crds::catalog;
use reports_server_tests::Backend;
use reports_server_tests::kubectl::Kubectl;
use reports_server_tests::objects::{api_error, list_rv, name_of, rv_of};
use reports_server_tests::server::ServerProcess;
use serde_json::{Value, json};

/// Generous bound on any single wait: only there so a broken server fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(60);

/// Generates, for every conformance test `<name>`, a module `<name>` with one test per backend
/// given as `function: Variant`: `on_backends!(sqlite: Sqlite, postgres: Postgres)` makes
/// `<name>::sqlite` and `<name>::postgres`. Each binary names its backends (see the header).
macro_rules! on_backends {
    ($($test:ident: $backend:ident),* $(,)?) => {
        on_backends!(@each [$($test: $backend),*]
            resource_versions_are_global_persisted_and_monotonic,
            stale_update_is_rejected_with_409_and_no_update_is_lost,
            duplicate_create_is_409_and_update_of_missing_is_404,
            watch_from_zero_and_unset_starts_with_current_state,
            initial_events_are_a_consistent_snapshot_under_concurrent_writes,
            watch_resumes_from_any_retained_version_else_410,
            bookmarks_report_progress_and_streaming_lists_end_with_initial_events_end,
            namespaced_watch_never_leaks_other_namespaces,
            slow_watcher_is_cut_off_without_blocking_writers,
            selectors_and_pagination_are_served_by_sql,
            metadata_is_stored_in_indexed_columns_and_results_one_row_each,
            partial_object_metadata_and_table_are_served,
            finalizers_defer_deletion_and_deletecollection_is_atomic,
            printer_columns_and_categories_match_the_crds,
            generation_is_one_on_create_and_bumps_only_on_content_change,
            objects_come_back_as_sent_without_added_annotations,
        );
    };
    (@each $backends:tt $($name:ident,)*) => {$(
        mod $name {
            on_backends!(@one $name $backends);
        }
    )*};
    (@one $name:ident [$($test:ident: $backend:ident),*]) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            crate::conformance_suite::$name(reports_server_tests::Backend::$backend).await
        }
    )*};
}

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

async fn start(backend: Backend, dir: &Path, extra: &[&str]) -> ServerProcess {
    let url = backend
        .database_url(dir)
        .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"));
    let mut args = vec!["--aggregation=false"];
    args.extend_from_slice(extra);
    ServerProcess::start_with(dir, Some(url), &args)
        .await
        .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"))
}

fn resource(desc: &ResourceDescriptor) -> ApiResource {
    reports_server_tests::objects::api_resource(desc)
}

/// A dynamic API for `desc`, namespaced when the kind is.
fn dyn_api(client: &kube::Client, desc: &ResourceDescriptor, ns: &str) -> Api<DynamicObject> {
    let ar = resource(desc);
    if desc.namespaced {
        Api::namespaced_with(client.clone(), ns, &ar)
    } else {
        Api::all_with(client.clone(), &ar)
    }
}

fn polr_api(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    dyn_api(client, &catalog::POLICY_REPORT, ns)
}

/// A small report of any kind: one result, summary, scope/owner, and the given labels. Small on
/// purpose: these tests are about API semantics, not payload size.
fn report(desc: &ResourceDescriptor, name: &str, labels: &[(&str, &str)], pass: i64) -> Value {
    let result = json!({
        "policy": "require-labels", "rule": "check-team", "result": "pass", "source": "kyverno",
        "severity": "medium", "category": "Best Practices", "scored": true,
        "timestamp": {"seconds": 1_700_000_000, "nanos": 0},
        "message": "validation rule 'check-team' passed."
    });
    let summary = json!({"pass": pass, "fail": 0, "warn": 0, "error": 0, "skip": 0});
    let mut object = json!({
        "apiVersion": desc.api_version(),
        "kind": desc.kind,
        "metadata": {"name": name},
    });
    if !labels.is_empty() {
        object["metadata"]["labels"] = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect::<serde_json::Map<_, _>>()
            .into();
    }
    match desc.layout {
        reports_server_crds::ReportLayout::TopLevel => {
            object["scope"] =
                json!({"apiVersion": "v1", "kind": "Pod", "name": format!("pod-{name}")});
            object["summary"] = summary;
            object["results"] = json!([result]);
        }
        reports_server_crds::ReportLayout::Spec => {
            object["spec"] = json!({
                "owner": {"apiVersion": "v1", "kind": "Pod", "name": format!("pod-{name}"), "uid": "00000000-0000-4000-8000-000000000001"},
                "summary": summary,
                "results": [result],
            });
        }
    }
    object
}

fn dynamic(value: Value) -> DynamicObject {
    serde_json::from_value(value).expect("a valid object")
}

fn polr(name: &str, labels: &[(&str, &str)], pass: i64) -> DynamicObject {
    dynamic(report(&catalog::POLICY_REPORT, name, labels, pass))
}

fn pass_of(o: &DynamicObject) -> i64 {
    o.data["summary"]["pass"].as_i64().unwrap_or(-1)
}

/// A request no client library shapes for us: returns status, headers and body.
async fn raw(
    client: &kube::Client,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, http::HeaderMap, Value) {
    let mut request = http::Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let response = tokio::time::timeout(
        PATIENCE,
        client.send(
            request
                .body(body.as_bytes().to_vec())
                .unwrap()
                .map(kube::client::Body::from),
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("{method} {uri}: no response within {PATIENCE:?}"))
    .unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = tokio::time::timeout(
        PATIENCE,
        http_body_util::BodyExt::collect(response.into_body()),
    )
    .await
    .unwrap_or_else(|_| panic!("{method} {uri}: body not complete within {PATIENCE:?}"))
    .unwrap()
    .to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| json!(String::from_utf8_lossy(&bytes).to_string()));
    (status, headers, value)
}

/// The next item of a stream, failing (instead of hanging) after [`PATIENCE`].
async fn next<S: Stream + Unpin>(stream: &mut S, what: &str) -> Option<S::Item> {
    tokio::time::timeout(PATIENCE, stream.next())
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within {PATIENCE:?}"))
}

/// One watch event reduced to what the assertions compare.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Seen {
    kind: &'static str,
    namespace: String,
    name: String,
    rv: u64,
}

fn seen(kind: &'static str, o: &DynamicObject) -> Seen {
    Seen {
        kind,
        namespace: o.metadata.namespace.clone().unwrap_or_default(),
        name: name_of(o),
        rv: rv_of(o),
    }
}

/// Reads raw watch events until `done` says so; BOOKMARKs are returned too.
async fn collect_events<S>(
    stream: &mut S,
    what: &str,
    mut done: impl FnMut(&[Seen]) -> bool,
) -> Vec<Seen>
where
    S: Stream<Item = Result<WatchEvent<DynamicObject>, kube::Error>> + Unpin,
{
    let mut got = Vec::new();
    while !done(&got) {
        match next(stream, what).await {
            Some(Ok(WatchEvent::Added(o))) => got.push(seen("ADDED", &o)),
            Some(Ok(WatchEvent::Modified(o))) => got.push(seen("MODIFIED", &o)),
            Some(Ok(WatchEvent::Deleted(o))) => got.push(seen("DELETED", &o)),
            Some(Ok(WatchEvent::Bookmark(b))) => got.push(Seen {
                kind: "BOOKMARK",
                namespace: String::new(),
                name: String::new(),
                rv: b.metadata.resource_version.parse().unwrap(),
            }),
            Some(Ok(WatchEvent::Error(e))) => panic!("{what}: ERROR event {e:?}"),
            Some(Err(e)) => panic!("{what}: {e}"),
            None => panic!("{what}: the watch ended early after {got:?}"),
        }
    }
    got
}

/// Events of a `kube::runtime::watcher`, reduced the same way.
async fn collect_watcher<S>(
    stream: &mut S,
    what: &str,
    mut done: impl FnMut(&[Seen]) -> bool,
) -> Vec<Seen>
where
    S: Stream<Item = Result<watcher::Event<DynamicObject>, watcher::Error>> + Unpin,
{
    let mut got = Vec::new();
    while !done(&got) {
        match next(stream, what).await {
            Some(Ok(watcher::Event::Init)) => got.push(marker("INIT")),
            Some(Ok(watcher::Event::InitApply(o))) => got.push(seen("INIT_APPLY", &o)),
            Some(Ok(watcher::Event::InitDone)) => got.push(marker("INIT_DONE")),
            Some(Ok(watcher::Event::Apply(o))) => got.push(seen("APPLY", &o)),
            Some(Ok(watcher::Event::Delete(o))) => got.push(seen("DELETE", &o)),
            Some(Err(e)) => panic!("{what}: watcher error {e}"),
            None => panic!("{what}: the watcher ended"),
        }
    }
    got
}

fn marker(kind: &'static str) -> Seen {
    Seen {
        kind,
        namespace: String::new(),
        name: String::new(),
        rv: 0,
    }
}

fn names(events: &[Seen], kind: &str) -> BTreeSet<String> {
    events
        .iter()
        .filter(|e| e.kind == kind)
        .map(|e| e.name.clone())
        .collect()
}

fn has(events: &[Seen], kind: &str, name: &str) -> bool {
    events.iter().any(|e| e.kind == kind && e.name == name)
}

/// Runs `psql -c sql` against the PostgreSQL holding `database_url`, as its administrator.
fn psql(database_url: &str, sql: &str) -> String {
    let (base, _) = database_url.rsplit_once('/').expect("a database URL");
    let out = std::process::Command::new("psql")
        .args([
            &format!("{base}/postgres"),
            "-v",
            "ON_ERROR_STOP=1",
            "-qAtc",
            sql,
        ])
        .output()
        .expect("psql not found: apt-get install -y postgresql-client");
    assert!(
        out.status.success(),
        "psql {sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Opens the server's own database from the test process (the store library, not the API), to
/// look at SQL columns or to write more than the API could in the time a test has.
async fn open_store(url: &str) -> reports_server_apiserver::store::Store {
    reports_server_apiserver::store::Store::connect(
        reports_server_apiserver::store::StoreOptions::new(url.to_owned()),
    )
    .await
    .unwrap_or_else(|e| panic!("open {url}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// §9.1 resourceVersions
// ---------------------------------------------------------------------------------------------

/// One counter for all kinds: every write of any kind gets a larger resourceVersion than every
/// earlier write, concurrent writes never share one, a list's version is the newest write (not a
/// per-kind or constant value), and all of it survives kill -9.
pub async fn resource_versions_are_global_persisted_and_monotonic(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();

    // Interleave all six kinds; each write must be newer than the previous one.
    let mut written: Vec<(&'static ResourceDescriptor, String, u64)> = Vec::new();
    let mut last = 0;
    for i in 0..18 {
        let desc = &catalog::ALL[i % catalog::ALL.len()];
        let name = format!("rv-{i}");
        let api = dyn_api(&client, desc, "rv-ns");
        let created = api
            .create(
                &PostParams::default(),
                &dynamic(report(desc, &name, &[], 1)),
            )
            .await
            .unwrap_or_else(|e| panic!("{backend:?} create {desc:?}: {e}"));
        let rv = rv_of(&created);
        assert!(rv > last, "{backend:?}: {desc:?} got rv {rv} after {last}");
        last = rv;
        written.push((desc, name, rv));
    }
    // An update and a delete move the same counter.
    let api = dyn_api(&client, written[0].0, "rv-ns");
    let mut o = api.get(&written[0].1).await.unwrap();
    o.data["summary"]["pass"] = json!(2);
    let updated = api
        .replace(&written[0].1, &PostParams::default(), &o)
        .await
        .unwrap();
    assert!(rv_of(&updated) > last);
    last = rv_of(&updated);
    written[0].2 = last;
    let gone = dyn_api(&client, written[1].0, "rv-ns");
    let deleted = gone
        .delete(&written[1].1, &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .expect("the deleted object");
    assert!(
        rv_of(&deleted) > last,
        "a delete is a write with its own rv"
    );
    last = rv_of(&deleted);
    written.remove(1);

    // A list of any kind carries the global newest version, not a per-kind or constant one.
    for desc in &catalog::ALL {
        assert_eq!(
            list_rv(&dyn_api(&client, desc, "rv-ns")).await,
            last,
            "{backend:?}: list rv of {desc:?}"
        );
    }

    // Concurrent writers never share a version.
    let concurrent: Vec<u64> = futures::stream::iter(0..40)
        .map(|i| {
            let desc = &catalog::ALL[i % catalog::ALL.len()];
            let api = dyn_api(&client, desc, "rv-par");
            async move {
                let o = api
                    .create(
                        &PostParams::default(),
                        &dynamic(report(desc, &format!("par-{i}"), &[], 1)),
                    )
                    .await
                    .unwrap();
                rv_of(&o)
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let unique: BTreeSet<u64> = concurrent.iter().copied().collect();
    assert_eq!(
        unique.len(),
        40,
        "{backend:?}: duplicate rvs in {concurrent:?}"
    );
    assert!(unique.iter().all(|rv| *rv > last));
    last = *unique.iter().max().unwrap();

    // kubectl sees the same versions as kube-rs.
    let k = Kubectl::new(&server.kubeconfig);
    let by_kubectl = k
        .run(&[
            "get",
            "policyreports.wgpolicyk8s.io",
            "-n",
            "rv-ns",
            "rv-0",
            "-o",
            "jsonpath={.metadata.resourceVersion}",
        ])
        .unwrap();
    assert_eq!(by_kubectl, written[0].2.to_string());

    // kill -9, same database: every object keeps its version, the counter continues.
    server.restart().await.unwrap();
    let client = server.client().await.unwrap();
    for (desc, name, rv) in &written {
        let o = dyn_api(&client, desc, "rv-ns").get(name).await.unwrap();
        assert_eq!(rv_of(&o), *rv, "{backend:?}: {desc:?} {name} after restart");
    }
    assert_eq!(list_rv(&polr_api(&client, "rv-ns")).await, last);
    let after = polr_api(&client, "rv-ns")
        .create(&PostParams::default(), &polr("after-restart", &[], 1))
        .await
        .unwrap();
    assert!(
        rv_of(&after) > last,
        "{backend:?}: rv {} after restart is not above {last}",
        rv_of(&after)
    );
}

// ---------------------------------------------------------------------------------------------
// §9.2 optimistic concurrency
// ---------------------------------------------------------------------------------------------

/// Every write path that carries a resourceVersion (PUT, merge patch, JSON patch, delete
/// preconditions, kubectl replace) is refused with 409 when it is stale, and read-modify-write
/// clients racing on one object lose no update.
pub async fn stale_update_is_rejected_with_409_and_no_update_is_lost(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    let api = polr_api(&client, "occ");
    let v1 = api
        .create(&PostParams::default(), &polr("shared", &[], 0))
        .await
        .unwrap();
    let mut fresh = v1.clone();
    fresh.data["summary"]["pass"] = json!(1);
    let v2 = api
        .replace("shared", &PostParams::default(), &fresh)
        .await
        .unwrap();
    let stale_rv = v1.metadata.resource_version.clone().unwrap();

    // PUT with the old version.
    let mut stale = v1.clone();
    stale.data["summary"]["pass"] = json!(99);
    assert_eq!(
        api_error(
            api.replace("shared", &PostParams::default(), &stale)
                .await
                .unwrap_err()
        ),
        (409, "Conflict".into()),
        "{backend:?}"
    );
    // JSON patch that pins the old version.
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "replace", "path": "/metadata/resourceVersion", "value": stale_rv},
        {"op": "replace", "path": "/summary/pass", "value": 99}
    ]))
    .unwrap();
    assert_eq!(
        api_error(
            api.patch("shared", &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
                .unwrap_err()
        )
        .0,
        409
    );
    // Delete preconditions: stale version, wrong uid.
    for pre in [
        Preconditions {
            resource_version: Some(stale_rv.clone()),
            uid: None,
        },
        Preconditions {
            resource_version: None,
            uid: Some("00000000-0000-0000-0000-000000000000".into()),
        },
    ] {
        let dp = DeleteParams {
            preconditions: Some(pre),
            ..Default::default()
        };
        assert_eq!(
            api_error(api.delete("shared", &dp).await.unwrap_err()).0,
            409
        );
    }
    // kubectl replace with a file holding the old version.
    let k = Kubectl::new(&server.kubeconfig);
    let mut file = serde_json::to_value(&stale).unwrap();
    file["metadata"]["namespace"] = json!("occ");
    let out = k
        .output(&["replace", "-f", "-"], Some(&file.to_string()))
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("the object has been modified"),
        "{backend:?}: kubectl replace with a stale version: {stderr}"
    );
    // Nothing of the above changed the object.
    let now = api.get("shared").await.unwrap();
    assert_eq!(rv_of(&now), rv_of(&v2));
    assert_eq!(pass_of(&now), 1);
    // The right preconditions delete.
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: now.metadata.resource_version.clone(),
            uid: now.metadata.uid.clone(),
        }),
        ..Default::default()
    };
    api.delete("shared", &dp).await.unwrap();

    // Racing read-modify-write increments: each client retries on 409; none is lost.
    api.create(&PostParams::default(), &polr("counter", &[], 0))
        .await
        .unwrap();
    let conflicts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (clients, increments) = (6, 10);
    futures::future::join_all((0..clients).map(|_| {
        let api = api.clone();
        let conflicts = conflicts.clone();
        async move {
            for _ in 0..increments {
                loop {
                    let mut o = api.get("counter").await.unwrap();
                    o.data["summary"]["pass"] = json!(pass_of(&o) + 1);
                    match api.replace("counter", &PostParams::default(), &o).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(s)) if s.code == 409 => {
                            conflicts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Err(e) => panic!("increment: {e}"),
                    }
                }
            }
        }
    }))
    .await;
    let counter = api.get("counter").await.unwrap();
    assert_eq!(
        pass_of(&counter),
        clients * increments,
        "{backend:?}: lost updates ({} conflicts were retried)",
        conflicts.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_eq!(
        counter.metadata.generation,
        Some(1 + clients * increments),
        "every accepted increment is one content change"
    );
}

// ---------------------------------------------------------------------------------------------
// §9.3 create/update semantics and status codes
// ---------------------------------------------------------------------------------------------

/// Create is 201 and a duplicate is 409 AlreadyExists (the original untouched); update is 200 and
/// of a missing object 404 (not 500); a missing name is 422; errors name the right group for
/// every kind; uid, creationTimestamp and generation are the server's, whatever the client sends.
pub async fn duplicate_create_is_409_and_update_of_missing_is_404(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    let json_ct = [("content-type", "application/json")];

    for desc in &catalog::ALL {
        let base = if desc.namespaced {
            format!(
                "/apis/{}/namespaces/codes/{}",
                desc.api_version(),
                desc.plural
            )
        } else {
            format!("/apis/{}/{}", desc.api_version(), desc.plural)
        };
        let mut body = report(desc, "dup", &[], 1);
        // Client-supplied server fields are ignored.
        body["metadata"]["uid"] = json!("11111111-1111-1111-1111-111111111111");
        body["metadata"]["creationTimestamp"] = json!("2001-01-01T00:00:00Z");
        body["metadata"]["generation"] = json!(7);
        let (code, _, created) = raw(&client, "POST", &base, &json_ct, &body.to_string()).await;
        assert_eq!(code, 201, "{backend:?} {desc:?}: {created}");
        assert_ne!(
            created["metadata"]["uid"],
            "11111111-1111-1111-1111-111111111111"
        );
        assert_ne!(
            created["metadata"]["creationTimestamp"],
            "2001-01-01T00:00:00Z"
        );
        assert_eq!(created["metadata"]["generation"], 1);

        let mut again = report(desc, "dup", &[], 42);
        again["metadata"]["labels"] = json!({"second": "true"});
        let (code, _, status) = raw(&client, "POST", &base, &json_ct, &again.to_string()).await;
        assert_eq!(
            (code, status["reason"].as_str()),
            (409, Some("AlreadyExists")),
            "{backend:?} {desc:?}: {status}"
        );
        assert_eq!(status["kind"], "Status");
        assert_eq!(status["details"]["group"], desc.group, "{status}");
        assert_eq!(status["details"]["kind"], desc.plural, "{status}");
        assert_eq!(status["details"]["name"], "dup");
        let (_, _, now) = raw(&client, "GET", &format!("{base}/dup"), &[], "").await;
        assert_eq!(
            now["metadata"]["resourceVersion"], created["metadata"]["resourceVersion"],
            "{desc:?}: a refused create must not touch the original"
        );
        assert!(now["metadata"]["labels"].is_null());

        // PUT of an existing object is 200; of a missing one 404 with the right group.
        let (code, _, updated) = raw(
            &client,
            "PUT",
            &format!("{base}/dup"),
            &json_ct,
            &now.to_string(),
        )
        .await;
        assert_eq!(code, 200, "{desc:?}: {updated}");
        let mut missing = now.clone();
        missing["metadata"]["name"] = json!("missing");
        let (code, _, status) = raw(
            &client,
            "PUT",
            &format!("{base}/missing"),
            &json_ct,
            &missing.to_string(),
        )
        .await;
        assert_eq!(
            (code, status["reason"].as_str()),
            (404, Some("NotFound")),
            "{backend:?} {desc:?}: {status}"
        );
        assert_eq!(status["details"]["group"], desc.group);
        assert!(
            status["message"]
                .as_str()
                .unwrap()
                .contains(&format!("{}.{}", desc.plural, desc.group)),
            "{status}"
        );
        for method in ["PATCH", "DELETE", "GET"] {
            let ct = if method == "PATCH" {
                vec![("content-type", "application/merge-patch+json")]
            } else {
                vec![]
            };
            let body = if method == "PATCH" { "{}" } else { "" };
            let (code, _, status) =
                raw(&client, method, &format!("{base}/missing"), &ct, body).await;
            assert_eq!(code, 404, "{desc:?} {method} of a missing object: {status}");
            assert_eq!(status["details"]["group"], desc.group);
        }

        // No name: 422 pointing at metadata.name.
        let mut nameless = report(desc, "x", &[], 1);
        nameless["metadata"] = json!({});
        let (code, _, status) = raw(&client, "POST", &base, &json_ct, &nameless.to_string()).await;
        assert_eq!(
            (code, status["reason"].as_str()),
            (422, Some("Invalid")),
            "{desc:?}: {status}"
        );
        assert_eq!(status["details"]["causes"][0]["field"], "metadata.name");
        assert_eq!(status["details"]["group"], desc.group);

        // An update cannot move the server-owned fields either.
        let mut forged = updated.clone();
        forged["metadata"]["creationTimestamp"] = json!("2001-01-01T00:00:00Z");
        forged["metadata"]["generation"] = json!(99);
        let (code, _, kept) = raw(
            &client,
            "PUT",
            &format!("{base}/dup"),
            &json_ct,
            &forged.to_string(),
        )
        .await;
        assert_eq!(code, 200, "{kept}");
        assert_eq!(
            kept["metadata"]["creationTimestamp"],
            created["metadata"]["creationTimestamp"]
        );
        assert_eq!(kept["metadata"]["generation"], 1);
        assert_eq!(kept["metadata"]["uid"], created["metadata"]["uid"]);
    }

    // kubectl reports the duplicate as AlreadyExists.
    let k = Kubectl::new(&server.kubeconfig);
    let mut file = report(&catalog::POLICY_REPORT, "kubectl-dup", &[], 1);
    file["metadata"]["namespace"] = json!("codes");
    k.run_with_stdin(&["create", "-f", "-"], Some(&file.to_string()))
        .unwrap();
    let out = k
        .output(&["create", "-f", "-"], Some(&file.to_string()))
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("AlreadyExists"),
        "{backend:?}: {stderr}"
    );
}

/// Takes the database of `database_url` away from its server (`cut`: new connections are
/// refused and open ones cut) or gives it back. PostgreSQL: the database stops allowing
/// connections. MariaDB has no such switch; the test's own account is locked instead
/// (`reports_server_tests::mariadb::lock_out`). SQLite cannot be taken from a running process.
fn cut_off(backend: Backend, database_url: &str, cut: bool) {
    let db = database_url.rsplit('/').next().unwrap();
    match (backend, cut) {
        (Backend::Postgres, true) => {
            psql(
                database_url,
                &format!(
                    "ALTER DATABASE {db} ALLOW_CONNECTIONS false; SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = '{db}'"
                ),
            );
        }
        (Backend::Postgres, false) => {
            psql(
                database_url,
                &format!("ALTER DATABASE {db} ALLOW_CONNECTIONS true"),
            );
        }
        (Backend::MariaDb, true) => reports_server_tests::mariadb::lock_out(database_url)
            .unwrap_or_else(|e| panic!("{e:#}")),
        (Backend::MariaDb, false) => {
            reports_server_tests::mariadb::let_in(database_url).unwrap_or_else(|e| panic!("{e:#}"))
        }
        (Backend::Sqlite, _) => panic!("an outage of the embedded SQLite cannot be staged"),
    }
}

/// While the database is unreachable every request is 503 ServiceUnavailable (never a 404 that
/// would tell Kyverno or the garbage collector the object is gone) while /readyz stays 200; when
/// the database is back, so is the data.
pub async fn database_outage_is_503_not_404(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &["--log=info,sqlx=debug"]).await;
    // kube-rs retries 503s by default; this test looks at the server's own answers.
    let client = server.client_without_retries().await.unwrap();
    let api = polr_api(&client, "outage");
    api.create(&PostParams::default(), &polr("kept", &[], 1))
        .await
        .unwrap();
    cut_off(backend, &server.database_url, true);
    let path = "/apis/wgpolicyk8s.io/v1alpha2/namespaces/outage/policyreports";
    let mut codes = Vec::new();
    for (method, uri, body) in [
        ("GET", format!("{path}/kept"), ""),
        ("GET", format!("{path}/kept"), ""),
        ("GET", path.to_owned(), ""),
        ("GET", format!("{path}/never-existed"), ""),
        ("DELETE", format!("{path}/kept"), ""),
        ("GET", format!("{path}?watch=true&timeoutSeconds=1"), ""),
    ] {
        let Ok((code, headers, status)) = tokio::time::timeout(
            Duration::from_secs(30),
            raw(&client, method, &uri, &[], body),
        )
        .await
        else {
            let log = std::fs::read_to_string(server.log_path()).unwrap_or_default();
            let log: Vec<&str> = log.lines().filter(|l| !l.contains("store::feed")).collect();
            panic!(
                "{method} {uri} hangs during the outage; server log:\n{}",
                log[log.len().saturating_sub(60)..].join("\n")
            )
        };
        codes.push(code);
        assert_eq!(
            (code, status["reason"].as_str()),
            (503, Some("ServiceUnavailable")),
            "{method} {uri} during the outage: {status}"
        );
        assert!(headers.contains_key("retry-after"), "{method} {uri}");
    }
    // Readiness is the process's, not the database's: failing it on every replica would take
    // the API groups out of the cluster's discovery (see store::health).
    let (code, _, _) = raw(&client, "GET", "/readyz", &[], "").await;
    assert_eq!(code, 200, "/readyz during the outage");

    cut_off(backend, &server.database_url, false);
    let deadline = Instant::now() + PATIENCE;
    loop {
        match api.get("kept").await {
            Ok(o) => {
                assert_eq!(pass_of(&o), 1);
                break;
            }
            Err(kube::Error::Api(s)) if s.code == 503 && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("after the outage: {e}"),
        }
    }
    let (code, _, _) = raw(&client, "GET", "/readyz", &[], "").await;
    assert_eq!(code, 200);
}

// ---------------------------------------------------------------------------------------------
// §9.5 watch semantics
// ---------------------------------------------------------------------------------------------

/// `kubectl get -w` (or any `--watch` command) as a line stream.
struct KubectlWatch {
    child: std::process::Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl KubectlWatch {
    fn start(k: &Kubectl, args: &[&str]) -> Self {
        let mut child = k.spawn(args).unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        KubectlWatch { child, lines }
    }

    /// Reads lines until one contains `needle`; returns all lines read.
    async fn until(&mut self, needle: &str) -> Vec<String> {
        let mut got = Vec::new();
        loop {
            match tokio::time::timeout(PATIENCE, self.lines.recv()).await {
                Ok(Some(line)) => {
                    let hit = line.contains(needle);
                    got.push(line);
                    if hit {
                        return got;
                    }
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    let out = self.child.wait_with_output_ref();
                    panic!("kubectl watch ended before {needle:?}: {got:?}\n{out}")
                }
                Err(_) => panic!("kubectl watch: no {needle:?} within {PATIENCE:?}: {got:?}"),
            }
        }
    }
}

trait ChildExt {
    fn wait_with_output_ref(&mut self) -> String;
}

impl ChildExt for std::process::Child {
    fn wait_with_output_ref(&mut self) -> String {
        let mut err = String::new();
        if let Some(mut e) = self.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        err
    }
}

impl Drop for KubectlWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Without `resourceVersion` and with `"0"` a watch starts with a synthetic ADDED for every
/// current object and then streams live events; with the list's version it starts with nothing.
/// The kube-rs watcher (list+watch and streaming list) and `kubectl get -w` see the same state.
pub async fn watch_from_zero_and_unset_starts_with_current_state(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    let api = polr_api(&client, "w");
    for name in ["a", "b", "c"] {
        api.create(&PostParams::default(), &polr(name, &[], 1))
            .await
            .unwrap();
    }
    polr_api(&client, "w-other")
        .create(&PostParams::default(), &polr("elsewhere", &[], 1))
        .await
        .unwrap();
    let mut current: BTreeSet<String> = ["a", "b", "c"].map(String::from).into();

    for (label, start_rv) in [("unset", ""), ("zero", "0")] {
        let mut events = api
            .watch(&WatchParams::default().timeout(60), start_rv)
            .await
            .unwrap()
            .boxed();
        let initial = collect_events(&mut events, label, |g| g.len() == current.len()).await;
        assert!(
            initial
                .iter()
                .all(|e| e.kind == "ADDED" && e.namespace == "w"),
            "{backend:?} {label}: {initial:?}"
        );
        assert_eq!(names(&initial, "ADDED"), current, "{backend:?} {label}");
        // Each synthetic event carries the object's own version.
        for e in &initial {
            assert_eq!(e.rv, rv_of(&api.get(&e.name).await.unwrap()));
        }
        let live = format!("live-{label}");
        api.create(&PostParams::default(), &polr(&live, &[], 1))
            .await
            .unwrap();
        let more = collect_events(&mut events, label, |g| !g.is_empty()).await;
        assert_eq!(
            (more[0].kind, more[0].name.as_str()),
            ("ADDED", live.as_str()),
            "{backend:?} {label}: the first live event"
        );
        current.insert(live);
    }

    // From the list's version: nothing synthetic, only what comes after.
    let rv = list_rv(&api).await;
    let mut events = api
        .watch(&WatchParams::default().timeout(60), &rv.to_string())
        .await
        .unwrap()
        .boxed();
    api.create(&PostParams::default(), &polr("after-list", &[], 1))
        .await
        .unwrap();
    let first = collect_events(&mut events, "from list rv", |g| !g.is_empty()).await;
    assert_eq!(first[0].name, "after-list", "{backend:?}: {first:?}");
    assert!(first[0].rv > rv);
    current.insert("after-list".into());

    // kube-rs watcher, both initial-list strategies.
    for (label, config) in [
        ("list+watch", watcher::Config::default()),
        (
            "streaming list",
            watcher::Config::default().streaming_lists(),
        ),
    ] {
        let mut w = watcher(api.clone(), config).boxed();
        let got = collect_watcher(&mut w, label, |g| {
            g.last().is_some_and(|e| e.kind == "INIT_DONE")
        })
        .await;
        assert_eq!(got[0].kind, "INIT", "{backend:?} {label}: {got:?}");
        assert_eq!(names(&got, "INIT_APPLY"), current, "{backend:?} {label}");
        assert_eq!(got.len(), current.len() + 2, "{label}: no duplicates");
        let live = format!("watcher-{}", label.replace([' ', '+'], "-"));
        api.create(&PostParams::default(), &polr(&live, &[], 1))
            .await
            .unwrap();
        let more = collect_watcher(&mut w, label, |g| !g.is_empty()).await;
        assert_eq!(
            (more[0].kind, more[0].name.as_str()),
            ("APPLY", live.as_str())
        );
        current.insert(live);
    }

    // kubectl get -w: the current objects first, then the live change.
    let k = Kubectl::new(&server.kubeconfig);
    let mut watch = KubectlWatch::start(
        &k,
        &[
            "get",
            "policyreports.wgpolicyk8s.io",
            "-n",
            "w",
            "-w",
            "-o",
            "name",
        ],
    );
    let last = current.iter().next_back().unwrap().clone();
    let lines = watch.until(&format!("/{last}")).await;
    let listed: BTreeSet<String> = lines
        .iter()
        .map(|l| l.rsplit('/').next().unwrap().to_owned())
        .collect();
    assert_eq!(listed, current, "{backend:?}: kubectl get -w initial state");
    api.create(&PostParams::default(), &polr("kubectl-live", &[], 1))
        .await
        .unwrap();
    watch.until("/kubectl-live").await;
}

/// Writes objects straight into the database through the store library (not the API), with the
/// metadata the server would set: for tests that need more changes than the API could take in
/// the time a test has. Returns the last resourceVersion written.
async fn bulk_create(
    store: &reports_server_apiserver::store::Store,
    desc: &'static ResourceDescriptor,
    ns: &str,
    names: &[String],
) -> i64 {
    let mut last = 0;
    for chunk in names.chunks(1000) {
        let objects = chunk
            .iter()
            .map(|n| {
                let mut o = report(desc, n, &[("bulk", "true")], 1);
                if desc.namespaced {
                    o["metadata"]["namespace"] = json!(ns);
                }
                stamp_new(o["metadata"].as_object_mut().expect("metadata"), n);
                o
            })
            .collect();
        last = store.put_all(desc, objects).await.unwrap();
    }
    last
}

/// A watch that starts with the current state (`"0"`, unset, or a streaming list) delivers each
/// change exactly once even when writes land while the initial events are being produced: no
/// object is ADDED twice, no version is repeated or goes backwards, no DELETED arrives for an
/// object the watcher was never told about, and the state it ends with is the server's.
pub async fn initial_events_are_a_consistent_snapshot_under_concurrent_writes(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    let api = polr_api(&client, "snap");
    // Several pages' worth (the server reads initial state 500 objects at a time).
    let store = open_store(&server.database_url).await;
    let seeded: Vec<String> = (0..1500).map(|i| format!("s-{i:04}")).collect();
    bulk_create(&store, &catalog::POLICY_REPORT, "snap", &seeded).await;
    drop(store);

    for round in 0..6 {
        let streaming = round % 2 == 1;
        // Writers aim at the end of the key space, i.e. at pages read last.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let api = api.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let name = format!("s-{:04}", 1499 - (i % 40));
                    if let Ok(mut o) = api.get(&name).await {
                        o.data["summary"]["pass"] = json!(pass_of(&o) + 1);
                        let _ = api.replace(&name, &PostParams::default(), &o).await;
                    }
                    let fresh = format!("t-{round}-{i:04}");
                    api.create(&PostParams::default(), &polr(&fresh, &[], 1))
                        .await
                        .unwrap();
                    if i % 3 == 0 {
                        let _ = api.delete(&fresh, &DeleteParams::default()).await;
                    }
                    i += 1;
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let wp = if streaming {
            WatchParams::streaming_lists()
        } else {
            WatchParams::default()
        };
        let mut events = api.watch(&wp.timeout(120), "0").await.unwrap().boxed();
        // Let the writer run through the whole initial phase, then a little more.
        let mut got: Vec<Seen> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(4);
        while Instant::now() < deadline {
            let more = collect_events(&mut events, "snapshot", |g| !g.is_empty()).await;
            got.extend(more);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.await.unwrap();
        let end = format!("end-{round}");
        api.create(&PostParams::default(), &polr(&end, &[], 1))
            .await
            .unwrap();
        // On a loaded machine the initial events may not have begun within the 4 s above, and
        // then `end` is part of them: its ADDED may come before the initial-events-end bookmark,
        // which a streaming watch must still send.
        let had_bookmark = got.iter().any(|e| e.kind == "BOOKMARK");
        let tail = collect_events(&mut events, "snapshot tail", |g| {
            has(g, "ADDED", &end)
                && (!streaming || had_bookmark || g.iter().any(|e| e.kind == "BOOKMARK"))
        })
        .await;
        got.extend(tail);

        let label = format!("{backend:?} round {round} (streaming: {streaming})");
        let mut state: BTreeMap<String, u64> = BTreeMap::new();
        let mut last_rv: HashMap<String, u64> = HashMap::new();
        for e in got.iter().filter(|e| e.kind != "BOOKMARK") {
            if let Some(prev) = last_rv.get(&e.name) {
                assert!(
                    e.rv > *prev,
                    "{label}: {} {} at rv {} after rv {prev} — a repeated or reordered event",
                    e.kind,
                    e.name,
                    e.rv
                );
            }
            last_rv.insert(e.name.clone(), e.rv);
            match e.kind {
                "ADDED" => assert!(
                    state.insert(e.name.clone(), e.rv).is_none(),
                    "{label}: ADDED twice for {}",
                    e.name
                ),
                "MODIFIED" => assert!(
                    state.insert(e.name.clone(), e.rv).is_some(),
                    "{label}: MODIFIED for {} never added",
                    e.name
                ),
                "DELETED" => assert!(
                    state.remove(&e.name).is_some(),
                    "{label}: DELETED for {}, which this watch never announced",
                    e.name
                ),
                other => panic!("{other}"),
            }
        }
        let listed: BTreeMap<String, u64> = api
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .map(|o| (name_of(o), rv_of(o)))
            .collect();
        assert_eq!(state.len(), listed.len(), "{label}");
        assert!(
            state == listed,
            "{label}: the watch's state is not the server's"
        );
        if streaming {
            let bookmarks = got.iter().filter(|e| e.kind == "BOOKMARK").count();
            assert!(bookmarks >= 1, "{label}: no initial-events-end bookmark");
        }
    }
}

/// A watch from any retained resourceVersion replays exactly the later changes, filtered by
/// namespace and labels like live events (also after a restart); one from a compacted version
/// is an ERROR event with 410 Expired, and so is an Exact list of an old version.
pub async fn watch_resumes_from_any_retained_version_else_410(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    let api = polr_api(&client, "resume");
    let other = polr_api(&client, "resume-other");
    // (rv after the write, event a namespaced watch sees, event a team=x watch sees)
    let mut log: Vec<(u64, Option<Seen>, Option<Seen>)> = Vec::new();
    let ev = |kind: &'static str, name: &str, rv: u64| {
        Some(Seen {
            kind,
            namespace: "resume".into(),
            name: name.into(),
            rv,
        })
    };
    // A write elsewhere first: a watch from "0" means "the current state", not "replay all".
    other
        .create(&PostParams::default(), &polr("warm-up", &[], 1))
        .await
        .unwrap();
    let start_rv = list_rv(&api).await;
    let o = api
        .create(&PostParams::default(), &polr("a", &[("team", "x")], 1))
        .await
        .unwrap();
    log.push((
        rv_of(&o),
        ev("ADDED", "a", rv_of(&o)),
        ev("ADDED", "a", rv_of(&o)),
    ));
    let o = api
        .create(&PostParams::default(), &polr("b", &[], 1))
        .await
        .unwrap();
    log.push((rv_of(&o), ev("ADDED", "b", rv_of(&o)), None));
    let o = other
        .create(&PostParams::default(), &polr("a", &[("team", "x")], 1))
        .await
        .unwrap();
    log.push((rv_of(&o), None, None));
    let o = api
        .patch(
            "b",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "x"}}})),
        )
        .await
        .unwrap();
    // b starts matching team=x: ADDED for the selector watch.
    log.push((
        rv_of(&o),
        ev("MODIFIED", "b", rv_of(&o)),
        ev("ADDED", "b", rv_of(&o)),
    ));
    let o = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "y"}}})),
        )
        .await
        .unwrap();
    // a stops matching: DELETED for the selector watch.
    log.push((
        rv_of(&o),
        ev("MODIFIED", "a", rv_of(&o)),
        ev("DELETED", "a", rv_of(&o)),
    ));
    let o = api
        .delete("b", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .unwrap();
    log.push((
        rv_of(&o),
        ev("DELETED", "b", rv_of(&o)),
        ev("DELETED", "b", rv_of(&o)),
    ));
    let o = api
        .delete("a", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .unwrap();
    log.push((rv_of(&o), ev("DELETED", "a", rv_of(&o)), None));

    // The replay survives a crash: it comes from the change log, not from memory.
    server.restart().await.unwrap();
    let client = server.client().await.unwrap();
    let api = polr_api(&client, "resume");
    let from_points: Vec<u64> = std::iter::once(start_rv)
        .chain(log.iter().map(|(rv, _, _)| *rv))
        .collect();
    for (i, from) in from_points.iter().enumerate() {
        for (label, selector) in [("namespace", None), ("team=x", Some("team=x"))] {
            let expected: Vec<Seen> = log[i..]
                .iter()
                .filter_map(|(_, plain, labelled)| {
                    if selector.is_some() {
                        labelled.clone()
                    } else {
                        plain.clone()
                    }
                })
                .collect();
            let mut wp = WatchParams::default().timeout(60);
            if let Some(s) = selector {
                wp = wp.labels(s);
            }
            let mut events = api.watch(&wp, &from.to_string()).await.unwrap().boxed();
            // A marker after everything else bounds the replay.
            let marker = format!("m-{i}-{}", label.replace('=', "-"));
            let mut labels = vec![];
            if selector.is_some() {
                labels.push(("team", "x"));
            }
            api.create(&PostParams::default(), &polr(&marker, &labels, 1))
                .await
                .unwrap();
            let got = collect_events(&mut events, label, |g| has(g, "ADDED", &marker)).await;
            // Markers of earlier rounds are changes too; they are not what is compared here.
            let got: Vec<Seen> = got
                .into_iter()
                .filter(|e| !e.name.starts_with("m-"))
                .collect();
            assert_eq!(
                got[..],
                expected[..],
                "{backend:?}: replay from {from} ({label})"
            );
            api.delete(&marker, &DeleteParams::default()).await.unwrap();
        }
    }

    // Compaction: restart with a tiny history and a fast compaction.
    server.extra_args.extend(
        [
            "--watch-history-max-events",
            "3",
            "--compaction-interval-seconds",
            "1",
        ]
        .map(String::from),
    );
    server.restart().await.unwrap();
    let client = server.client().await.unwrap();
    let api = polr_api(&client, "resume");
    for n in 0..10 {
        api.create(&PostParams::default(), &polr(&format!("c-{n}"), &[], 1))
            .await
            .unwrap();
    }
    let deadline = Instant::now() + PATIENCE;
    loop {
        let mut events = api
            .watch(&WatchParams::default().timeout(2), &start_rv.to_string())
            .await
            .unwrap()
            .boxed();
        match next(&mut events, "410").await {
            Some(Ok(WatchEvent::Error(e))) => {
                assert_eq!((e.code, e.reason.as_str()), (410, "Expired"), "{backend:?}");
                break;
            }
            // Not compacted yet: the replay started instead.
            Some(Ok(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(300)).await
            }
            other => panic!("{backend:?}: expected a 410 ERROR event, got {other:?}"),
        }
    }
    let err = api
        .list(
            &ListParams::default()
                .at(&start_rv.to_string())
                .matching(kube::api::VersionMatch::Exact),
        )
        .await
        .unwrap_err();
    assert_eq!(
        api_error(err).0,
        410,
        "{backend:?}: Exact list of an old version"
    );
}

/// Bookmarks advance with writes this watcher does not see (so a quiet watcher resumes from a
/// recent version, not from the start), a streaming list ends its initial events with the
/// `k8s.io/initial-events-end` bookmark, malformed streaming-list requests are 422, and a kube-rs
/// streaming-list watcher whose watches time out resumes from its bookmark instead of relisting.
pub async fn bookmarks_report_progress_and_streaming_lists_end_with_initial_events_end(
    backend: Backend,
) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &["--bookmark-interval-seconds", "1"]).await;
    let client = server.client().await.unwrap();
    let api = polr_api(&client, "bm");
    let other = polr_api(&client, "bm-other");
    for name in ["a", "b", "c"] {
        api.create(&PostParams::default(), &polr(name, &[], 1))
            .await
            .unwrap();
    }
    other
        .create(&PostParams::default(), &polr("x", &[], 1))
        .await
        .unwrap();

    // Streaming list: ADDED for this namespace's objects, then the end bookmark.
    let mut events = api
        .watch(&WatchParams::streaming_lists().timeout(60), "0")
        .await
        .unwrap()
        .boxed();
    let mut added = BTreeSet::new();
    let end_rv = loop {
        match next(&mut events, "streaming list").await {
            Some(Ok(WatchEvent::Added(o))) => {
                assert_eq!(o.metadata.namespace.as_deref(), Some("bm"));
                added.insert(name_of(&o));
            }
            Some(Ok(WatchEvent::Bookmark(b))) => {
                if b.metadata
                    .annotations
                    .get("k8s.io/initial-events-end")
                    .is_some_and(|v| v == "true")
                {
                    break b.metadata.resource_version.parse::<u64>().unwrap();
                }
            }
            other => panic!("{backend:?}: unexpected {other:?}"),
        }
    };
    assert_eq!(added, ["a", "b", "c"].map(String::from).into());
    assert!(
        end_rv >= list_rv(&other).await,
        "the end bookmark is at least the list's version"
    );

    // Writes elsewhere: this watch sees none of them, but its bookmarks move past them.
    let mut last_other = 0;
    for n in 0..3 {
        last_other = rv_of(
            &other
                .create(&PostParams::default(), &polr(&format!("y-{n}"), &[], 1))
                .await
                .unwrap(),
        );
    }
    let got = collect_events(&mut events, "progress", |g| {
        g.iter().any(|e| e.kind == "BOOKMARK" && e.rv >= last_other)
    })
    .await;
    assert!(
        got.iter().all(|e| e.kind == "BOOKMARK"),
        "{backend:?}: {got:?}"
    );
    let rvs: Vec<u64> = got.iter().map(|e| e.rv).collect();
    assert!(
        rvs.windows(2).all(|w| w[0] <= w[1]),
        "bookmarks never go back: {rvs:?}"
    );

    // Malformed streaming-list requests.
    let path = "/apis/wgpolicyk8s.io/v1alpha2/namespaces/bm/policyreports";
    for query in [
        "watch=true&sendInitialEvents=true&allowWatchBookmarks=true",
        "watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
    ] {
        let (code, _, status) = raw(&client, "GET", &format!("{path}?{query}"), &[], "").await;
        assert_eq!(code, 422, "{backend:?} {query}: {status}");
    }

    // A streaming-list watcher through several server-side watch timeouts: one Init, and every
    // write exactly once.
    let mut w = watcher(
        api.clone(),
        watcher::Config::default().streaming_lists().timeout(1),
    )
    .boxed();
    let init = collect_watcher(&mut w, "timeouts", |g| {
        g.last().is_some_and(|e| e.kind == "INIT_DONE")
    })
    .await;
    assert_eq!(names(&init, "INIT_APPLY").len(), 3);
    let mut written = Vec::new();
    let mut got = Vec::new();
    for n in 0..4 {
        let name = format!("t-{n}");
        let o = api
            .create(&PostParams::default(), &polr(&name, &[], 1))
            .await
            .unwrap();
        written.push(seen("APPLY", &o));
        got.extend(collect_watcher(&mut w, "timeouts", |g| has(g, "APPLY", &name)).await);
        // Longer than the watch timeout: the next write arrives on a resumed watch.
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    assert_eq!(
        got, written,
        "{backend:?}: resumed without relisting or repeating"
    );
}

/// Nothing from another namespace or another kind reaches a namespaced watch — not in the initial
/// events, not live, not in a replay — whichever way the watch is made: kube-rs raw watch, the
/// kube-rs watcher in both modes, a cluster-wide watch with a `metadata.namespace` field
/// selector, a label-selected watch, and `kubectl get -w`. (The peer fans every namespace's events
/// out to every watcher: an authorization bug.)
pub async fn namespaced_watch_never_leaks_other_namespaces(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    let a = polr_api(&client, "leak-a");
    let b = polr_api(&client, "leak-b");
    let all: Api<DynamicObject> = Api::all_with(client.clone(), &resource(&catalog::POLICY_REPORT));
    let team = [("team", "x")];
    a.create(&PostParams::default(), &polr("pre", &team, 1))
        .await
        .unwrap();
    b.create(&PostParams::default(), &polr("pre", &team, 1))
        .await
        .unwrap();
    b.create(&PostParams::default(), &polr("b-only", &team, 1))
        .await
        .unwrap();
    let before_writes = list_rv(&a).await;

    let wp = || WatchParams::default().timeout(120);
    let mut raw_ns = a.watch(&wp(), "0").await.unwrap().boxed();
    let mut raw_field = all
        .watch(&wp().fields("metadata.namespace=leak-a"), "0")
        .await
        .unwrap()
        .boxed();
    let mut raw_labels = a.watch(&wp().labels("team=x"), "0").await.unwrap().boxed();
    let mut listwatch = watcher(a.clone(), watcher::Config::default()).boxed();
    let mut streaming = watcher(a.clone(), watcher::Config::default().streaming_lists()).boxed();
    let mut field_watcher = watcher(
        all.clone(),
        watcher::Config::default()
            .streaming_lists()
            .fields("metadata.namespace=leak-a"),
    )
    .boxed();
    let k = Kubectl::new(&server.kubeconfig);
    let mut kubectl = KubectlWatch::start(
        &k,
        &[
            "get",
            "policyreports.wgpolicyk8s.io",
            "-n",
            "leak-a",
            "-w",
            "--output-watch-events",
            "-o",
            "custom-columns=EVENT:.type,NS:.object.metadata.namespace,NAME:.object.metadata.name",
        ],
    );
    // Let every watch get established before the writes (kubectl lists first, then watches).
    kubectl.until("pre").await;
    for (w, what) in [
        (&mut listwatch, "list+watch"),
        (&mut streaming, "streaming"),
        (&mut field_watcher, "field watcher"),
    ] {
        collect_watcher(w, what, |g| g.last().is_some_and(|e| e.kind == "INIT_DONE")).await;
    }

    // Interleaved writes: namespace b, a cluster-scoped kind, and another namespaced kind in a.
    b.create(&PostParams::default(), &polr("b-1", &team, 1))
        .await
        .unwrap();
    a.create(&PostParams::default(), &polr("a-1", &team, 1))
        .await
        .unwrap();
    b.patch(
        "pre",
        &PatchParams::default(),
        &Patch::Merge(json!({"summary": {"pass": 5}})),
    )
    .await
    .unwrap();
    dyn_api(&client, &catalog::CLUSTER_POLICY_REPORT, "")
        .create(
            &PostParams::default(),
            &dynamic(report(&catalog::CLUSTER_POLICY_REPORT, "leak-a", &team, 1)),
        )
        .await
        .unwrap();
    dyn_api(&client, &catalog::REPORT, "leak-a")
        .create(
            &PostParams::default(),
            &dynamic(report(&catalog::REPORT, "same-ns-other-kind", &team, 1)),
        )
        .await
        .unwrap();
    a.patch(
        "pre",
        &PatchParams::default(),
        &Patch::Merge(json!({"summary": {"pass": 5}})),
    )
    .await
    .unwrap();
    b.delete("b-only", &DeleteParams::default()).await.unwrap();
    a.delete("a-1", &DeleteParams::default()).await.unwrap();
    a.create(&PostParams::default(), &polr("zz-done", &team, 1))
        .await
        .unwrap();

    let a_names: BTreeSet<String> = ["pre", "a-1", "zz-done"].map(String::from).into();
    let check = |what: &str, events: &[Seen]| {
        for e in events.iter().filter(|e| !e.name.is_empty()) {
            assert!(
                e.namespace == "leak-a" && a_names.contains(&e.name),
                "{backend:?} {what}: leaked {e:?}"
            );
        }
    };
    for (what, stream) in [
        ("raw namespaced", &mut raw_ns),
        ("raw field selector", &mut raw_field),
        ("raw label selector", &mut raw_labels),
    ] {
        let got = collect_events(stream, what, |g| has(g, "ADDED", "zz-done")).await;
        check(what, &got);
        let kinds: Vec<(&str, &str)> = got
            .iter()
            .filter(|e| e.kind != "BOOKMARK")
            .map(|e| (e.kind, e.name.as_str()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("ADDED", "pre"),
                ("ADDED", "a-1"),
                ("MODIFIED", "pre"),
                ("DELETED", "a-1"),
                ("ADDED", "zz-done")
            ],
            "{backend:?} {what}"
        );
    }
    for (what, stream) in [
        ("list+watch", &mut listwatch),
        ("streaming", &mut streaming),
        ("field watcher", &mut field_watcher),
    ] {
        let got = collect_watcher(stream, what, |g| has(g, "APPLY", "zz-done")).await;
        check(what, &got);
        assert_eq!(got.len(), 4, "{backend:?} {what}: {got:?}");
    }
    // The replay path filters too.
    let mut replay = a
        .watch(&wp(), &before_writes.to_string())
        .await
        .unwrap()
        .boxed();
    let got = collect_events(&mut replay, "replay", |g| has(g, "ADDED", "zz-done")).await;
    check("replay", &got);
    assert_eq!(got.len(), 4, "{backend:?} replay: {got:?}");

    let lines = kubectl.until("zz-done").await;
    for line in &lines[1..] {
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            cols.get(1),
            Some(&"leak-a"),
            "{backend:?} kubectl leaked: {line}"
        );
    }
    let deleted = lines
        .iter()
        .any(|l| l.starts_with("DELETED") && l.contains("a-1"));
    assert!(deleted, "kubectl saw the delete: {lines:?}");
}

// ---------------------------------------------------------------------------------------------
// §9.6 slow watchers
// ---------------------------------------------------------------------------------------------

/// A watch read by hand over TLS from a socket with a tiny receive buffer, so that "the client
/// stopped reading" is a fact of the kernel, not of some library's buffering.
struct StalledWatch {
    tls: rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>,
}

impl StalledWatch {
    /// Sends the request and reads the response head; the body is left unread.
    fn open(server: &ServerProcess, path_and_query: &str) -> Self {
        use base64::Engine;
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
        use std::io::Write;
        use std::os::fd::FromRawFd;

        let kubeconfig: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(&server.kubeconfig).unwrap()).unwrap();
        let field = |v: &serde_yaml::Value| {
            base64::engine::general_purpose::STANDARD
                .decode(v.as_str().unwrap())
                .unwrap()
        };
        let ca = field(&kubeconfig["clusters"][0]["cluster"]["certificate-authority-data"]);
        let cert = field(&kubeconfig["users"][0]["user"]["client-certificate-data"]);
        let key = field(&kubeconfig["users"][0]["user"]["client-key-data"]);
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&ca) {
            roots.add(c.unwrap()).unwrap();
        }
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert)
            .map(Result::unwrap)
            .collect();
        let key = PrivateKeyDer::from_pem_slice(&key).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .unwrap();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];

        // SO_RCVBUF before connect(): the window is negotiated small and autotuning is off.
        let socket = unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0);
            let size: libc::c_int = 4096;
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                &size as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
            let addr = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: server.port.to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes([127, 0, 0, 1]),
                },
                sin_zero: [0; 8],
            };
            let rc = libc::connect(
                fd,
                &addr as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            );
            assert_eq!(rc, 0, "connect: {}", std::io::Error::last_os_error());
            std::net::TcpStream::from_raw_fd(fd)
        };
        socket.set_read_timeout(Some(PATIENCE)).unwrap();
        let name = ServerName::try_from("127.0.0.1").unwrap();
        let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, socket);
        write!(
            tls,
            "GET {path_and_query} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: application/json\r\n\r\n"
        )
        .unwrap();
        tls.flush().unwrap();
        let mut watch = StalledWatch { tls };
        let status = watch.line();
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        loop {
            let header = watch.line();
            if header.is_empty() {
                break;
            }
            assert!(
                !header.to_ascii_lowercase().starts_with("content-length"),
                "a watch response is chunked"
            );
        }
        watch
    }

    fn line(&mut self) -> String {
        let mut line = Vec::new();
        let mut byte = [0u8];
        loop {
            std::io::Read::read_exact(&mut self.tls, &mut byte).expect("read from the watch");
            if byte[0] == b'\n' {
                break;
            }
            line.push(byte[0]);
        }
        String::from_utf8(line).unwrap().trim_end().to_owned()
    }

    /// Reads the chunked body to its end (the server ending the stream). Panics if the stream
    /// does not end within [`PATIENCE`] of silence: then the watcher was never cut off.
    fn drain(mut self) -> Vec<Value> {
        let mut body = Vec::new();
        loop {
            let size = usize::from_str_radix(self.line().split(';').next().unwrap(), 16).unwrap();
            if size == 0 {
                break;
            }
            let mut chunk = vec![0; size];
            std::io::Read::read_exact(&mut self.tls, &mut chunk).expect("read a chunk");
            body.extend_from_slice(&chunk);
            assert!(self.line().is_empty());
        }
        body.split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect()
    }
}

/// A watcher that stops reading never slows writers or other watchers: writes keep being
/// acknowledged while it is stalled, a second watcher receives everything, and the stalled one
/// is cut off once it is more than the server's buffer behind (its stream ends; memory stays
/// bounded) — after which it resumes from its last version with no gap. (The peer's broadcaster
/// blocks every writer on the slowest watcher.)
pub async fn slow_watcher_is_cut_off_without_blocking_writers(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    // A 2 MiB buffer (the default is 64 MiB) holds about 1,500 of this test's reports.
    let server = start(backend, dir.path(), &["--watch-buffer-bytes", "2097152"]).await;
    let client = server.client().await.unwrap();
    let api = polr_api(&client, "slow");
    let from = list_rv(&api).await;
    let path = format!(
        "/apis/wgpolicyk8s.io/v1alpha2/namespaces/slow/policyreports?watch=true&timeoutSeconds=600&resourceVersion={from}"
    );
    let stalled = {
        let server_ref = &server;
        tokio::task::block_in_place(|| StalledWatch::open(server_ref, &path))
    };

    // A watcher that keeps up, resuming like any client if it is ever cut off itself.
    let fast_seen = Arc::new(Mutex::new(Vec::<u64>::new()));
    let fast = {
        let api = api.clone();
        let seen = fast_seen.clone();
        tokio::spawn(async move {
            let mut resumed = 0;
            let mut rv = from;
            loop {
                let mut events = api
                    .watch(&WatchParams::default().timeout(600), &rv.to_string())
                    .await
                    .unwrap()
                    .boxed();
                while let Some(e) = events.next().await {
                    if let Ok(WatchEvent::Added(o)) = e {
                        rv = rv_of(&o);
                        seen.lock().unwrap().push(rv);
                    }
                }
                resumed += 1;
                if resumed > 1000 {
                    return;
                }
            }
        })
    };

    // Far more changes than the server buffers (`--watch-buffer-bytes` above), written in bulk
    // through the store, while API writes go on: all of them must be acknowledged.
    let bulk: Vec<String> = (0..24_000).map(|i| format!("bulk-{i:05}")).collect();
    let store = open_store(&server.database_url).await;
    let api_writes = async {
        let mut rvs = Vec::new();
        for n in 0..20 {
            let created = tokio::time::timeout(
                PATIENCE,
                api.create(
                    &PostParams::default(),
                    &polr(&format!("api-{n:02}"), &[], 1),
                ),
            )
            .await
            .expect("a write blocked behind a stalled watcher")
            .unwrap();
            rvs.push(rv_of(&created));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        rvs
    };
    let (_, api_rvs) = tokio::join!(
        bulk_create(&store, &catalog::POLICY_REPORT, "slow", &bulk),
        api_writes
    );
    let last = list_rv(&api).await;
    let total = (last - from) as usize;
    assert_eq!(total, bulk.len() + api_rvs.len(), "only this test writes");

    // The fast watcher got everything, in order, exactly once.
    let deadline = Instant::now() + PATIENCE * 3;
    while fast_seen.lock().unwrap().last().copied() != Some(last) {
        assert!(
            Instant::now() < deadline,
            "{backend:?}: the fast watcher stalled at {:?} of {last}",
            fast_seen.lock().unwrap().last()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fast.abort();
    let fast_rvs = fast_seen.lock().unwrap().clone();
    assert_eq!(
        fast_rvs,
        ((from + 1)..=last).collect::<Vec<_>>(),
        "{backend:?}"
    );

    // The stalled watcher: what it had been sent, then the end of its stream.
    let events = tokio::task::block_in_place(|| stalled.drain());
    let rvs: Vec<u64> = events
        .iter()
        .map(|e| {
            assert_eq!(e["type"], "ADDED", "{e}");
            e["object"]["metadata"]["resourceVersion"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert!(
        rvs.len() < total,
        "{backend:?}: the stalled watcher was never cut off ({} of {total} events)",
        rvs.len()
    );
    assert_eq!(
        rvs,
        ((from + 1)..=(from + rvs.len() as u64)).collect::<Vec<_>>(),
        "{backend:?}: what the stalled watcher got is a gapless prefix"
    );
    let (_, _, metrics) = raw(&client, "GET", "/metrics", &[], "").await;
    let cut = metrics
        .as_str()
        .unwrap()
        .lines()
        .find(|l| l.starts_with("reports_server_apiserver_watchers_cut_off"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(cut >= 1.0, "{backend:?}: cut-off not counted in /metrics");

    // Resuming from the last version it saw delivers exactly the rest.
    let resume_from = rvs.last().copied().unwrap_or(from);
    let mut events = api
        .watch(
            &WatchParams::default().timeout(600),
            &resume_from.to_string(),
        )
        .await
        .unwrap()
        .boxed();
    let rest = collect_events(&mut events, "resume", |g| {
        g.last().is_some_and(|e| e.rv == last)
    })
    .await;
    let rest: Vec<u64> = rest.iter().map(|e| e.rv).collect();
    assert_eq!(rest, ((resume_from + 1)..=last).collect::<Vec<_>>());
}

// ---------------------------------------------------------------------------------------------
// §9.7 selectors and pagination in SQL
// ---------------------------------------------------------------------------------------------

/// Lists every page of `params` (page size `limit`), checking each page is full except the last
/// and carries the first page's version; returns (namespace, name) in order.
async fn all_pages(
    api: &Api<DynamicObject>,
    params: ListParams,
    what: &str,
) -> Vec<(String, String)> {
    let limit = params.limit.unwrap() as usize;
    let mut params = params;
    let mut out = Vec::new();
    let mut first_rv = None;
    loop {
        let page = api
            .list(&params)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let rv = page.metadata.resource_version.clone();
        assert_eq!(
            first_rv.get_or_insert(rv.clone()),
            &rv,
            "{what}: page versions"
        );
        let more = page.metadata.continue_.clone().filter(|c| !c.is_empty());
        if more.is_some() {
            // A full page before every token: the limit applies to matching rows (the filter
            // runs in the query), not to rows fetched and filtered afterwards.
            assert_eq!(
                page.items.len(),
                limit,
                "{what}: short page before a continue token"
            );
        }
        out.extend(
            page.items
                .iter()
                .map(|o| (o.metadata.namespace.clone().unwrap_or_default(), name_of(o))),
        );
        match more {
            Some(c) => params = params.continue_token(&c),
            None => return out,
        }
    }
}

/// Label selectors (every operator) and `metadata.name`/`metadata.namespace` field selectors,
/// alone and combined, paged with `limit`/`continue`, return exactly the matching set once each,
/// in key order, with full pages; a continue token is bound to its query (other selectors or
/// another namespace: 400); `resourceVersion`/`resourceVersionMatch` are honoured; kubectl's
/// chunked list agrees.
pub async fn selectors_and_pagination_are_served_by_sql(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    // 90 objects over three namespaces with a spread of labels.
    let mut objects: Vec<(String, String, BTreeMap<String, String>)> = Vec::new();
    for i in 0..90u32 {
        let ns = format!("sel-{}", i % 3);
        let name = format!("r-{i:03}");
        let tier = ["gold", "silver", "bronze"][(i / 3 % 3) as usize];
        let mut labels = vec![("tier", tier)];
        if i % 4 == 0 {
            labels.push(("env", "prod"));
        }
        if i % 5 == 0 {
            labels.push(("env", "dev"));
        }
        let api = polr_api(&client, &ns);
        api.create(&PostParams::default(), &polr(&name, &labels, 1))
            .await
            .unwrap();
        objects.push((
            ns,
            name,
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        ));
    }
    let all: Api<DynamicObject> = Api::all_with(client.clone(), &resource(&catalog::POLICY_REPORT));

    type Pred = fn(&str, &str, &BTreeMap<String, String>) -> bool;
    let cases: Vec<(&str, &str, Pred)> = vec![
        ("tier=gold", "", |_, _, l| {
            l.get("tier").is_some_and(|v| v == "gold")
        }),
        ("tier==gold", "", |_, _, l| {
            l.get("tier").is_some_and(|v| v == "gold")
        }),
        ("tier!=gold", "", |_, _, l| {
            l.get("tier").is_none_or(|v| v != "gold")
        }),
        ("tier in (gold,bronze)", "", |_, _, l| {
            l.get("tier").is_some_and(|v| v == "gold" || v == "bronze")
        }),
        ("tier notin (gold,bronze)", "", |_, _, l| {
            l.get("tier").is_none_or(|v| v != "gold" && v != "bronze")
        }),
        ("env", "", |_, _, l| l.contains_key("env")),
        ("!env", "", |_, _, l| !l.contains_key("env")),
        ("env,tier=silver", "", |_, _, l| {
            l.contains_key("env") && l.get("tier").is_some_and(|v| v == "silver")
        }),
        ("", "metadata.namespace=sel-1", |ns, _, _| ns == "sel-1"),
        ("", "metadata.namespace!=sel-1", |ns, _, _| ns != "sel-1"),
        ("", "metadata.name=r-042", |_, n, _| n == "r-042"),
        (
            "",
            "metadata.name!=r-042,metadata.namespace==sel-0",
            |ns, n, _| n != "r-042" && ns == "sel-0",
        ),
        ("tier=gold,!env", "metadata.namespace!=sel-2", |ns, _, l| {
            ns != "sel-2" && l.get("tier").is_some_and(|v| v == "gold") && !l.contains_key("env")
        }),
        ("env in (prod)", "metadata.namespace=sel-0", |ns, _, l| {
            ns == "sel-0" && l.get("env").is_some_and(|v| v == "prod")
        }),
        ("tier=none", "", |_, _, _| false),
    ];
    for (labels, fields, pred) in &cases {
        let mut expected: Vec<(String, String)> = objects
            .iter()
            .filter(|(ns, n, l)| pred(ns, n, l))
            .map(|(ns, n, _)| (ns.clone(), n.clone()))
            .collect();
        expected.sort();
        for limit in [1, 7, 500] {
            let what = format!("{backend:?} labels {labels:?} fields {fields:?} limit {limit}");
            let got = all_pages(
                &all,
                ListParams::default()
                    .labels(labels)
                    .fields(fields)
                    .limit(limit),
                &what,
            )
            .await;
            assert_eq!(got, expected, "{what}");
        }
        // The same within one namespace.
        let ns_api = polr_api(&client, "sel-0");
        let in_ns: Vec<(String, String)> = expected
            .iter()
            .filter(|(ns, _)| ns == "sel-0")
            .cloned()
            .collect();
        let got = all_pages(
            &ns_api,
            ListParams::default().labels(labels).fields(fields).limit(4),
            labels,
        )
        .await;
        assert_eq!(got, in_ns, "{backend:?} namespaced {labels:?} {fields:?}");
    }

    // A token is bound to its query.
    let page = all
        .list(&ListParams::default().labels("tier=gold").limit(5))
        .await
        .unwrap();
    let token = page.metadata.continue_.unwrap();
    for (what, api, params) in [
        ("labels", &all, ListParams::default().labels("tier=silver")),
        (
            "fields",
            &all,
            ListParams::default()
                .labels("tier=gold")
                .fields("metadata.namespace=sel-0"),
        ),
        (
            "namespace",
            &polr_api(&client, "sel-0"),
            ListParams::default().labels("tier=gold"),
        ),
    ] {
        let err = api
            .list(&params.limit(5).continue_token(&token))
            .await
            .unwrap_err();
        assert_eq!(
            api_error(err).0,
            400,
            "{backend:?}: token replayed with other {what}"
        );
    }
    let err = all
        .list(&ListParams::default().limit(5).continue_token("not-a-token"))
        .await
        .unwrap_err();
    assert_eq!(api_error(err).0, 400);
    for bad in ["tier in (", "a=b=c", "!"] {
        let err = all
            .list(&ListParams::default().labels(bad))
            .await
            .unwrap_err();
        assert_eq!(api_error(err).0, 400, "label selector {bad:?}");
    }
    let err = all
        .list(&ListParams::default().fields("spec.x=y"))
        .await
        .unwrap_err();
    assert_eq!(api_error(err).0, 400, "unsupported field selector");

    // resourceVersion semantics of list.
    let current = list_rv(&all).await;
    for (rv, m, code) in [
        (current, Some(kube::api::VersionMatch::NotOlderThan), None),
        (current, Some(kube::api::VersionMatch::Exact), None),
        (1, Some(kube::api::VersionMatch::NotOlderThan), None),
        (current + 1000, None, Some(504)),
        (current - 1, Some(kube::api::VersionMatch::Exact), Some(410)),
    ] {
        let mut lp = ListParams::default().at(&rv.to_string());
        if let Some(m) = &m {
            lp = lp.matching(m.clone());
        }
        match (all.list(&lp).await, code) {
            (Ok(list), None) => assert_eq!(list.items.len(), 90),
            (Err(e), Some(code)) => assert_eq!(api_error(e).0, code, "rv {rv} {m:?}"),
            (r, _) => panic!("{backend:?}: rv {rv} {m:?}: {:?}", r.map(|l| l.items.len())),
        }
    }

    // kubectl's chunked list (--chunk-size) with both kinds of selector.
    let k = Kubectl::new(&server.kubeconfig);
    let out = k
        .run(&[
            "get",
            "policyreports.wgpolicyk8s.io",
            "-A",
            "-l",
            "tier in (gold,silver),!env",
            "--field-selector",
            "metadata.namespace!=sel-2",
            "--chunk-size",
            "3",
            "-o",
            "custom-columns=NS:.metadata.namespace,NAME:.metadata.name",
            "--no-headers",
        ])
        .unwrap();
    let got: Vec<(String, String)> = out
        .lines()
        .map(|l| {
            let mut c = l.split_whitespace();
            (c.next().unwrap().to_owned(), c.next().unwrap().to_owned())
        })
        .collect();
    let mut expected: Vec<(String, String)> = objects
        .iter()
        .filter(|(ns, _, l)| {
            ns != "sel-2"
                && !l.contains_key("env")
                && l.get("tier").is_some_and(|v| v == "gold" || v == "silver")
        })
        .map(|(ns, n, _)| (ns.clone(), n.clone()))
        .collect();
    expected.sort();
    assert_eq!(got, expected, "{backend:?}: kubectl --chunk-size");
}

// ---------------------------------------------------------------------------------------------
// §9.8 metadata in columns
// ---------------------------------------------------------------------------------------------

/// A text column of a raw query result (the row type is sea-orm's, which this crate does not
/// name).
macro_rules! text {
    ($row:expr, $col:expr) => {
        $row.try_get::<String>("", $col)
            .unwrap_or_else(|e| panic!("column {}: {e}", $col))
    };
}

macro_rules! int {
    ($row:expr, $col:expr) => {
        $row.try_get::<i64>("", $col)
            .unwrap_or_else(|e| panic!("column {}: {e}", $col))
    };
}

/// What the API stores is queryable in SQL: uid, resourceVersion, generation, owner UIDs, the
/// summary counts and the scope are real (indexed) columns equal to the object's fields, labels
/// are rows, every policy result is a row of `report_results`, and all of it follows updates and
/// deletes through the API.
pub async fn metadata_is_stored_in_indexed_columns_and_results_one_row_each(backend: Backend) {
    use reports_server_crds::fixtures::{Subject, pss_policy_report};
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    let subject = Subject::pod("sql", 7);
    let mut typed = pss_policy_report(&subject, 1_700_000_000, &[1, 7]);
    typed
        .metadata
        .labels
        .get_or_insert_default()
        .insert("team".into(), "payments".into());
    let api: Api<reports_server_crds::PolicyReport> = Api::namespaced(client.clone(), "sql");
    let created = api.create(&PostParams::default(), &typed).await.unwrap();
    let name = created.metadata.name.clone().unwrap();
    let store = open_store(&server.database_url).await;

    let columns = format!(
        "SELECT uid, resource_version, generation, owner_uids, summary_pass, summary_fail, scope_kind, scope_name, scope_uid, resource FROM objects WHERE namespace = 'sql' AND name = '{name}'"
    );
    let rows = store.query_raw(&columns).await.unwrap();
    assert_eq!(rows.len(), 1, "{backend:?}");
    let row = &rows[0];
    assert_eq!(Some(text!(row, "uid")), created.metadata.uid);
    assert_eq!(
        int!(row, "resource_version").to_string(),
        created.metadata.resource_version.clone().unwrap()
    );
    assert_eq!(int!(row, "generation"), 1);
    assert!(text!(row, "owner_uids").contains(&subject.uid));
    assert_eq!(
        (int!(row, "summary_pass"), int!(row, "summary_fail")),
        (17, 2),
        "{backend:?}"
    );
    assert_eq!(
        (
            text!(row, "scope_kind"),
            text!(row, "scope_name"),
            text!(row, "scope_uid")
        ),
        ("Pod".into(), subject.name.clone(), subject.uid.clone())
    );
    assert_eq!(text!(row, "resource"), "policyreports.wgpolicyk8s.io");

    let labels_sql = format!(
        "SELECT l.key AS label_key, l.value AS label_value FROM object_labels l JOIN objects o ON o.id = l.object_id WHERE o.namespace = 'sql' AND o.name = '{name}' ORDER BY l.key"
    );
    let labels: BTreeMap<String, String> = store
        .query_raw(&labels_sql)
        .await
        .unwrap()
        .iter()
        .map(|r| (text!(r, "label_key"), text!(r, "label_value")))
        .collect();
    assert_eq!(Some(labels), created.metadata.labels, "{backend:?}");

    let results_sql = format!(
        "SELECT policy, rule, result, severity, subject_uid FROM report_results WHERE namespace = 'sql' AND report_name = '{name}'"
    );
    let results = store.query_raw(&results_sql).await.unwrap();
    assert_eq!(results.len(), 19, "{backend:?}: one row per result");
    let failing: BTreeSet<String> = results
        .iter()
        .filter(|r| text!(r, "result") == "fail")
        .map(|r| text!(r, "rule"))
        .collect();
    let expected_failing: BTreeSet<String> = created
        .results
        .as_ref()
        .unwrap()
        .iter()
        .filter(|r| r.result == Some(reports_server_crds::PolicyResult::Fail))
        .map(|r| r.rule.clone().unwrap())
        .collect();
    assert_eq!(failing, expected_failing);
    assert!(
        results
            .iter()
            .all(|r| text!(r, "subject_uid") == subject.uid)
    );

    // The documented analytics query.
    let policy = &reports_server_crds::fixtures::PSS_RULES[7].0;
    let n = store
        .query_raw(&format!(
            "SELECT COUNT(*) AS n FROM report_results WHERE policy = '{policy}' AND result = 'fail' AND severity = 'medium'"
        ))
        .await
        .unwrap();
    assert_eq!(int!(&n[0], "n"), 1);

    // Indexes on the metadata columns.
    let index_sql = match backend {
        Backend::Sqlite => {
            "SELECT sql AS def FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL AND tbl_name IN ('objects', 'object_labels')"
        }
        Backend::Postgres => {
            "SELECT indexdef AS def FROM pg_indexes WHERE tablename IN ('objects', 'object_labels')"
        }
        // One row per indexed column, named by its index.
        Backend::MariaDb => {
            "SELECT CONCAT(index_name, ' ', column_name) AS def FROM information_schema.statistics WHERE table_schema = DATABASE() AND table_name IN ('objects', 'object_labels')"
        }
    };
    let indexes: Vec<String> = store
        .query_raw(index_sql)
        .await
        .unwrap()
        .iter()
        .map(|r| text!(r, "def").to_lowercase())
        .collect();
    for column in ["uid", "resource_version", "scope_uid", "key"] {
        assert!(
            indexes.iter().any(|d| d.contains(column)),
            "{backend:?}: no index on {column}: {indexes:?}"
        );
    }

    // An update through the API moves the columns and rows with it.
    let mut changed = created.clone();
    changed.summary.as_mut().unwrap().fail = Some(0);
    changed.summary.as_mut().unwrap().pass = Some(19);
    for r in changed.results.as_mut().unwrap() {
        r.result = Some(reports_server_crds::PolicyResult::Pass);
    }
    changed
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("team".into(), "risk".into());
    let updated = api
        .replace(&name, &PostParams::default(), &changed)
        .await
        .unwrap();
    let row = &store.query_raw(&columns).await.unwrap()[0];
    assert_eq!(
        int!(row, "resource_version").to_string(),
        updated.metadata.resource_version.unwrap()
    );
    assert_eq!((int!(row, "summary_fail"), int!(row, "generation")), (0, 2));
    let team = store.query_raw(&labels_sql).await.unwrap();
    assert!(
        team.iter()
            .any(|r| text!(r, "label_key") == "team" && text!(r, "label_value") == "risk")
    );
    let results = store.query_raw(&results_sql).await.unwrap();
    assert!(results.iter().all(|r| text!(r, "result") == "pass"));

    api.delete(&name, &DeleteParams::default()).await.unwrap();
    assert!(store.query_raw(&columns).await.unwrap().is_empty());
    assert!(store.query_raw(&labels_sql).await.unwrap().is_empty());
    assert!(store.query_raw(&results_sql).await.unwrap().is_empty());
}

// ---------------------------------------------------------------------------------------------
// §9.9 metadata-only and Table encodings
// ---------------------------------------------------------------------------------------------

const TABLE: &str = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json";
/// What client-go's metadata informers send (Kyverno, the garbage collector, the namespace
/// controller): protobuf first, JSON as the alternative.
const METADATA_LIST: &str = "application/vnd.kubernetes.protobuf;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json";
const METADATA: &str = "application/vnd.kubernetes.protobuf;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json";

/// `as=PartialObjectMetadata[List]` and `as=Table` are served for get, list and watch, as the
/// metadata clients of Kyverno, the garbage collector and the namespace controller and kubectl
/// request them (protobuf offered first is answered with the JSON alternative; protobuf alone is
/// 406); the kube-rs metadata API and `metadata_watcher` (both modes) work on them.
pub async fn partial_object_metadata_and_table_are_served(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &["--bookmark-interval-seconds", "1"]).await;
    let client = server.client().await.unwrap();
    let api = polr_api(&client, "meta");
    for (name, team) in [("a", "x"), ("b", "y")] {
        let mut o = polr(name, &[("team", team)], 3);
        o.metadata.annotations = Some([("note".to_owned(), name.to_owned())].into());
        o.metadata.finalizers = Some(vec!["example.com/keep".into()]);
        api.create(&PostParams::default(), &o).await.unwrap();
    }
    let path = "/apis/wgpolicyk8s.io/v1alpha2/namespaces/meta/policyreports";

    // Metadata list and get.
    let (code, headers, list) = raw(&client, "GET", path, &[("accept", METADATA_LIST)], "").await;
    assert_eq!(code, 200, "{backend:?}: {list}");
    let ct = headers["content-type"].to_str().unwrap();
    assert!(
        ct.starts_with("application/json") && ct.contains("as=PartialObjectMetadataList"),
        "{ct}"
    );
    assert_eq!(list["kind"], "PartialObjectMetadataList");
    assert_eq!(list["apiVersion"], "meta.k8s.io/v1");
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
    for item in list["items"].as_array().unwrap() {
        assert_eq!(item["kind"], "PartialObjectMetadata");
        assert!(
            item.get("results").is_none() && item.get("summary").is_none(),
            "{item}"
        );
        assert_eq!(item["metadata"]["finalizers"][0], "example.com/keep");
        assert!(
            item["metadata"]["uid"].is_string() && item["metadata"]["resourceVersion"].is_string()
        );
        // Exactly the metadata the object itself is served with.
        let name = item["metadata"]["name"].as_str().unwrap();
        let (code, _, object) = raw(&client, "GET", &format!("{path}/{name}"), &[], "").await;
        assert_eq!(code, 200, "{object}");
        assert_eq!(item["metadata"], object["metadata"], "{backend:?}");
    }
    // `includeObject` is a Table parameter; a metadata list ignores it.
    let (code, _, same) = raw(
        &client,
        "GET",
        &format!("{path}?includeObject=Object"),
        &[("accept", METADATA_LIST)],
        "",
    )
    .await;
    assert_eq!((code, &same["items"]), (200, &list["items"]), "{same}");
    let (code, _, one) = raw(
        &client,
        "GET",
        &format!("{path}/a"),
        &[("accept", METADATA)],
        "",
    )
    .await;
    assert_eq!(
        (code, one["kind"].as_str()),
        (200, Some("PartialObjectMetadata")),
        "{one}"
    );
    assert_eq!(one["metadata"]["annotations"]["note"], "a");
    let (code, _, _) = raw(
        &client,
        "GET",
        path,
        &[("accept", "application/vnd.kubernetes.protobuf")],
        "",
    )
    .await;
    assert_eq!(code, 406, "{backend:?}: protobuf alone");

    // kube-rs metadata API.
    let metas = api
        .list_metadata(&ListParams::default().labels("team=x"))
        .await
        .unwrap();
    assert_eq!(metas.items.len(), 1);
    assert_eq!(metas.items[0].metadata.name.as_deref(), Some("a"));
    let meta = api.get_metadata("b").await.unwrap();
    assert_eq!(meta.metadata.labels.unwrap()["team"], "y");

    // Table: list, get, includeObject, watch.
    let (code, headers, table) = raw(&client, "GET", path, &[("accept", TABLE)], "").await;
    assert_eq!(code, 200, "{table}");
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .contains("as=Table")
    );
    assert_eq!(table["kind"], "Table");
    let columns: Vec<&str> = table["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(columns[0], "Name");
    assert!(columns.contains(&"Pass"), "{columns:?}");
    let rows = table["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["cells"][0], "a");
    assert_eq!(
        rows[0]["object"]["kind"], "PartialObjectMetadata",
        "default includeObject=Metadata"
    );
    let pass_col = columns.iter().position(|c| *c == "Pass").unwrap();
    assert_eq!(rows[0]["cells"][pass_col], 3);
    for (include, expect) in [("None", None), ("Object", Some("PolicyReport"))] {
        let (_, _, t) = raw(
            &client,
            "GET",
            &format!("{path}?includeObject={include}"),
            &[("accept", TABLE)],
            "",
        )
        .await;
        assert_eq!(
            t["rows"][0]["object"]["kind"].as_str(),
            expect,
            "includeObject={include}: {}",
            t["rows"][0]
        );
    }
    let (code, _, t) = raw(
        &client,
        "GET",
        &format!("{path}/b"),
        &[("accept", TABLE)],
        "",
    )
    .await;
    assert_eq!((code, t["rows"].as_array().map(Vec::len)), (200, Some(1)));

    // A Table watch (what `kubectl get -w` asks for): each event's object is a one-row Table.
    let request = http::Request::get(format!(
        "{path}?watch=true&resourceVersion=0&timeoutSeconds=5"
    ))
    .header("accept", TABLE)
    .body(Vec::new())
    .unwrap();
    let body = client.request_text(request).await.unwrap();
    let events: Vec<Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let tables: Vec<&Value> = events.iter().filter(|e| e["type"] == "ADDED").collect();
    assert_eq!(tables.len(), 2, "{backend:?}: {body}");
    for e in tables {
        assert_eq!(e["object"]["kind"], "Table");
        assert_eq!(e["object"]["rows"].as_array().unwrap().len(), 1);
    }

    // Metadata watches: raw, and the metadata watcher in both modes.
    let rv = list_rv(&api).await;
    let mut events = api
        .watch_metadata(&WatchParams::default().timeout(30), &rv.to_string())
        .await
        .unwrap()
        .boxed();
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"summary": {"pass": 4}})),
    )
    .await
    .unwrap();
    match next(&mut events, "metadata watch").await {
        Some(Ok(WatchEvent::Modified(m))) => {
            assert_eq!(m.metadata.name.as_deref(), Some("a"));
            assert_eq!(
                m.types.as_ref().map(|t| t.kind.as_str()),
                Some("PartialObjectMetadata")
            );
        }
        other => panic!("{backend:?}: {other:?}"),
    }
    for config in [
        watcher::Config::default(),
        watcher::Config::default().streaming_lists(),
    ] {
        let metadata_api: Api<kube::core::PartialObjectMeta<DynamicObject>> =
            Api::namespaced_with(client.clone(), "meta", &resource(&catalog::POLICY_REPORT));
        let mut w = watcher(metadata_api, config).boxed();
        let mut init = BTreeSet::new();
        loop {
            match next(&mut w, "metadata watcher").await.unwrap().unwrap() {
                watcher::Event::InitApply(m) => {
                    init.insert(m.metadata.name.unwrap());
                }
                watcher::Event::InitDone => break,
                _ => {}
            }
        }
        assert_eq!(init, ["a", "b"].map(String::from).into(), "{backend:?}");
        api.patch(
            "b",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"seen": "yes"}}})),
        )
        .await
        .unwrap();
        match next(&mut w, "metadata watcher").await.unwrap().unwrap() {
            watcher::Event::Apply(m) => assert_eq!(m.metadata.labels.unwrap()["seen"], "yes"),
            other => panic!("{backend:?}: {other:?}"),
        }
        api.patch(
            "b",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"seen": null}}})),
        )
        .await
        .unwrap();
        next(&mut w, "metadata watcher").await;
    }
}

// ---------------------------------------------------------------------------------------------
// §9.10 finalizers and deletecollection
// ---------------------------------------------------------------------------------------------

/// Deleting an object with finalizers only marks it (`deletionTimestamp`, a MODIFIED event); it
/// goes (a DELETED event) when the last finalizer is removed. deletecollection removes every
/// match in one transaction — its events carry consecutive resourceVersions even while other
/// writers run — marks the finalized matches instead, and leaves non-matches alone; dry-run
/// changes nothing; propagationPolicy and gracePeriodSeconds are accepted as for CRDs.
pub async fn finalizers_defer_deletion_and_deletecollection_is_atomic(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    let api = polr_api(&client, "fin");
    let mut held = polr("held", &[], 1);
    held.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    let created = api.create(&PostParams::default(), &held).await.unwrap();
    let mut events = api
        .watch(
            &WatchParams::default().timeout(120),
            &rv_of(&created).to_string(),
        )
        .await
        .unwrap()
        .boxed();

    let marked = api
        .delete("held", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .expect("the marked object, not a Status");
    let ts = marked
        .metadata
        .deletion_timestamp
        .clone()
        .expect("deletionTimestamp");
    let still = api.get("held").await.unwrap();
    assert_eq!(
        still.metadata.deletion_timestamp,
        Some(ts.clone()),
        "{backend:?}"
    );
    let got = collect_events(&mut events, "mark", |g| !g.is_empty()).await;
    assert_eq!((got[0].kind, got[0].name.as_str()), ("MODIFIED", "held"));
    // A second delete changes nothing.
    let again = api
        .delete("held", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .unwrap();
    assert_eq!(again.metadata.deletion_timestamp, Some(ts));
    assert_eq!(rv_of(&again), rv_of(&still));
    // kubectl removes the finalizer: now it is gone.
    let k = Kubectl::new(&server.kubeconfig);
    k.run(&[
        "patch",
        "policyreports.wgpolicyk8s.io",
        "-n",
        "fin",
        "held",
        "--type",
        "merge",
        "-p",
        r#"{"metadata":{"finalizers":null}}"#,
    ])
    .unwrap();
    assert_eq!(
        api_error(api.get("held").await.unwrap_err()).0,
        404,
        "{backend:?}"
    );
    let got = collect_events(&mut events, "finalized", |g| !g.is_empty()).await;
    assert_eq!((got[0].kind, got[0].name.as_str()), ("DELETED", "held"));

    // Options CRD storage accepts.
    for (i, policy) in [
        PropagationPolicy::Background,
        PropagationPolicy::Foreground,
        PropagationPolicy::Orphan,
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("opt-{i}");
        api.create(&PostParams::default(), &polr(&name, &[], 1))
            .await
            .unwrap();
        let dp = DeleteParams {
            propagation_policy: Some(policy),
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        api.delete(&name, &dp).await.unwrap();
    }
    let (code, _, _) = raw(
        &client,
        "DELETE",
        "/apis/wgpolicyk8s.io/v1alpha2/namespaces/fin/policyreports/x",
        &[("content-type", "application/json")],
        r#"{"propagationPolicy":"Sideways"}"#,
    )
    .await;
    assert_eq!(code, 400);

    // deletecollection: 30 plain matches, 2 finalized matches, 5 non-matches.
    let batch = [("batch", "x")];
    for i in 0..30 {
        api.create(
            &PostParams::default(),
            &polr(&format!("m-{i:02}"), &batch, 1),
        )
        .await
        .unwrap();
    }
    for i in 0..2 {
        let mut o = polr(&format!("f-{i}"), &batch, 1);
        o.metadata.finalizers = Some(vec!["example.com/hold".into()]);
        api.create(&PostParams::default(), &o).await.unwrap();
    }
    for i in 0..5 {
        api.create(&PostParams::default(), &polr(&format!("keep-{i}"), &[], 1))
            .await
            .unwrap();
    }
    let lp = ListParams::default().labels("batch=x");
    let dry = DeleteParams {
        dry_run: true,
        ..Default::default()
    };
    api.delete_collection(&dry, &lp).await.unwrap();
    assert_eq!(
        api.list(&lp).await.unwrap().items.len(),
        32,
        "dry run deletes nothing"
    );
    let from = list_rv(&api).await;

    // Another writer runs in a different namespace throughout.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let noise = {
        let other = polr_api(&client, "fin-noise");
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                other
                    .create(&PostParams::default(), &polr(&format!("n-{i}"), &[], 1))
                    .await
                    .unwrap();
                i += 1;
            }
            i
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let deleted = api
        .delete_collection(&DeleteParams::default(), &lp)
        .await
        .unwrap()
        .left()
        .expect("a list of what was deleted");
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let noise_writes = noise.await.unwrap();
    assert!(noise_writes > 0);
    assert_eq!(deleted.items.len(), 32, "{backend:?}");

    let remaining = api.list(&ListParams::default()).await.unwrap();
    let left: BTreeSet<String> = remaining.items.iter().map(name_of).collect();
    let expected: BTreeSet<String> = [
        "f-0", "f-1", "keep-0", "keep-1", "keep-2", "keep-3", "keep-4",
    ]
    .map(String::from)
    .into();
    assert_eq!(left, expected, "{backend:?}");
    for o in &remaining.items {
        assert_eq!(
            o.metadata.deletion_timestamp.is_some(),
            name_of(o).starts_with("f-"),
            "{}",
            name_of(o)
        );
    }
    // The collection's events, seen by a watcher of the whole kind, are one unbroken run.
    let all: Api<DynamicObject> = Api::all_with(client.clone(), &resource(&catalog::POLICY_REPORT));
    let mut w = all
        .watch(&WatchParams::default().timeout(60), &from.to_string())
        .await
        .unwrap()
        .boxed();
    all.create(
        &PostParams::default(),
        &dynamic({
            let mut v = report(&catalog::POLICY_REPORT, "fin-end", &[], 1);
            v["metadata"]["namespace"] = json!("fin");
            v
        }),
    )
    .await
    .unwrap();
    let got = collect_events(&mut w, "deletecollection", |g| has(g, "ADDED", "fin-end")).await;
    let batch_events: Vec<&Seen> = got
        .iter()
        .filter(|e| e.namespace == "fin" && e.name != "fin-end")
        .collect();
    assert_eq!(batch_events.len(), 32);
    let rvs: Vec<u64> = batch_events.iter().map(|e| e.rv).collect();
    assert_eq!(
        rvs,
        (rvs[0]..rvs[0] + 32).collect::<Vec<_>>(),
        "{backend:?}: deletecollection interleaved with other writes"
    );
    assert_eq!(
        batch_events.iter().filter(|e| e.kind == "MODIFIED").count(),
        2,
        "the finalized ones are marked, not deleted"
    );
}

// ---------------------------------------------------------------------------------------------
// §9.16 fidelity with CRD behaviour
// ---------------------------------------------------------------------------------------------

/// The upstream CRD of a kind (`crds/upstream/`), the compatibility reference.
fn upstream_crd(desc: &ResourceDescriptor) -> serde_yaml::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("crds/upstream")
        .join(format!("{}_{}.yaml", desc.group, desc.plural));
    serde_yaml::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

/// An object of `desc` with every printer-column field filled (so no cell is empty).
fn full_report(desc: &ResourceDescriptor, name: &str) -> DynamicObject {
    let mut v = report(desc, name, &[], 4);
    v["metadata"]["labels"] = json!({
        "audit.kyverno.io/source": "admission",
        "audit.kyverno.io/resource.group": "apps",
        "audit.kyverno.io/resource.kind": "Deployment",
        "audit.kyverno.io/resource.uid": "6c737f35-260c-4e4f-8516-61a125c9fb78",
        "audit.kyverno.io/resource.hash": "abc123",
    });
    v["metadata"]["annotations"] = json!({"audit.kyverno.io/resource.name": "web"});
    match desc.layout {
        reports_server_crds::ReportLayout::TopLevel => {
            v["scope"] = json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "web"});
            v["summary"] = json!({"pass": 4, "fail": 3, "warn": 2, "error": 1, "skip": 5});
        }
        reports_server_crds::ReportLayout::Spec => {
            v["spec"]["summary"] = json!({"pass": 4, "fail": 3, "warn": 2, "error": 1, "skip": 5});
        }
    }
    dynamic(v)
}

/// For all six kinds, what `kubectl get` prints is what it prints for the upstream CRD: the
/// header (default and `-o wide`) is the CRD's printer columns, every cell equals the CRD's
/// jsonPath evaluated by kubectl itself (`custom-columns`) on the full object, ages are human
/// durations; discovery carries the CRDs' short names, singular names, categories and scope; and
/// `kubectl get kyverno` lists exactly the kinds in the `kyverno` category.
pub async fn printer_columns_and_categories_match_the_crds(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    let k = Kubectl::new(&server.kubeconfig);
    let mut in_kyverno_category = BTreeSet::new();

    for desc in &catalog::ALL {
        let crd = upstream_crd(desc);
        let spec = &crd["spec"];
        let name = format!("cols-{}", desc.singular);
        dyn_api(&client, desc, "cols")
            .create(&PostParams::default(), &full_report(desc, &name))
            .await
            .unwrap();
        let resource_arg = format!("{}.{}", desc.plural, desc.group);
        let scope_args: Vec<&str> = if desc.namespaced {
            vec!["-n", "cols"]
        } else {
            vec![]
        };
        let columns = spec["versions"][0]["additionalPrinterColumns"]
            .as_sequence()
            .unwrap()
            .clone();
        let header = |wide: bool| -> Vec<String> {
            std::iter::once("NAME".to_owned())
                .chain(
                    columns
                        .iter()
                        .filter(|c| wide || c["priority"].as_i64().unwrap_or(0) == 0)
                        .map(|c| c["name"].as_str().unwrap().to_uppercase()),
                )
                .collect()
        };
        for wide in [false, true] {
            let mut args = vec!["get", resource_arg.as_str()];
            args.extend(&scope_args);
            if wide {
                args.extend(["-o", "wide"]);
            }
            let out = k.run(&args).unwrap();
            let mut lines = out.lines();
            let got: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
            assert_eq!(
                got,
                header(wide),
                "{backend:?} {desc:?} wide={wide}:\n{out}"
            );
            let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
            assert_eq!(row.len(), got.len(), "{desc:?}: a cell is empty:\n{out}");
            // Age: a human duration of a just-created object.
            let age = got.iter().position(|h| *h == "AGE").unwrap();
            assert!(
                row[age].ends_with('s') && row[age][..row[age].len() - 1].parse::<u32>().is_ok(),
                "{desc:?}: AGE {}",
                row[age]
            );
            // Every other cell equals kubectl's own evaluation of the CRD's jsonPath.
            let template = format!(
                "{}\n{}\n",
                std::iter::once("NAME")
                    .chain(
                        columns
                            .iter()
                            .filter(|c| wide || c["priority"].as_i64().unwrap_or(0) == 0)
                            .map(|c| c["name"].as_str().unwrap())
                    )
                    .collect::<Vec<_>>()
                    .join(" "),
                std::iter::once(".metadata.name")
                    .chain(
                        columns
                            .iter()
                            .filter(|c| wide || c["priority"].as_i64().unwrap_or(0) == 0)
                            .map(|c| c["jsonPath"].as_str().unwrap())
                    )
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            let file = dir.path().join(format!("{}-{wide}.columns", desc.plural));
            std::fs::write(&file, template).unwrap();
            let custom_arg = format!("custom-columns-file={}", file.display());
            let mut args = vec!["get", resource_arg.as_str()];
            args.extend(&scope_args);
            args.extend(["-o", custom_arg.as_str(), "--no-headers"]);
            let reference = k.run(&args).unwrap();
            // The one object's row (kubectl prints the file's header line despite --no-headers).
            let reference: Vec<&str> = reference
                .lines()
                .last()
                .unwrap_or_default()
                .split_whitespace()
                .collect();
            for (i, h) in got.iter().enumerate() {
                if *h != "AGE" {
                    assert_eq!(
                        row[i], reference[i],
                        "{backend:?} {desc:?}: column {h} differs from the CRD's jsonPath"
                    );
                }
            }
        }
        // -A adds the namespace column to namespaced kinds only.
        let all = k.run(&["get", resource_arg.as_str(), "-A"]).unwrap();
        let first = all
            .lines()
            .next()
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap();
        assert_eq!(first == "NAMESPACE", desc.namespaced, "{desc:?}: {all}");

        // Names and categories, through discovery and kubectl.
        let names = &spec["names"];
        let (_, _, discovery) = raw(
            &client,
            "GET",
            &format!("/apis/{}", desc.api_version()),
            &[],
            "",
        )
        .await;
        let entry = discovery["resources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == desc.plural)
            .unwrap_or_else(|| panic!("{desc:?} not in discovery: {discovery}"))
            .clone();
        let yaml_list = |v: &serde_yaml::Value| -> Vec<String> {
            v.as_sequence()
                .map(|s| s.iter().map(|x| x.as_str().unwrap().to_owned()).collect())
                .unwrap_or_default()
        };
        let json_list = |v: &Value| -> Vec<String> {
            v.as_array()
                .map(|s| s.iter().map(|x| x.as_str().unwrap().to_owned()).collect())
                .unwrap_or_default()
        };
        assert_eq!(
            json_list(&entry["shortNames"]),
            yaml_list(&names["shortNames"]),
            "{desc:?}"
        );
        assert_eq!(
            json_list(&entry["categories"]),
            yaml_list(&names["categories"]),
            "{desc:?}"
        );
        assert_eq!(entry["singularName"].as_str(), names["singular"].as_str());
        assert_eq!(entry["kind"].as_str(), names["kind"].as_str());
        assert_eq!(
            entry["namespaced"].as_bool(),
            Some(spec["scope"].as_str() == Some("Namespaced"))
        );
        for short in yaml_list(&names["shortNames"]) {
            let mut args = vec!["get", short.as_str(), "-o", "name"];
            args.extend(&scope_args);
            let out = k.run(&args).unwrap();
            assert!(
                out.contains(&name),
                "{backend:?}: kubectl get {short}: {out}"
            );
        }
        if yaml_list(&names["categories"]).contains(&"kyverno".to_owned()) {
            in_kyverno_category.insert(format!("{}.{}/{name}", desc.singular, desc.group));
        }
    }
    let out = k.run(&["get", "kyverno", "-A", "-o", "name"]).unwrap();
    let got: BTreeSet<String> = out.lines().map(str::to_owned).collect();
    assert_eq!(got, in_kyverno_category, "{backend:?}: kubectl get kyverno");
}

/// generation is 1 on create and moves only when something outside `metadata` changes — labels,
/// annotations and finalizers (kubectl label/annotate/patch) keep it, content changes through
/// kubectl apply or JSON patch bump it by one, and a write that changes nothing changes neither
/// generation nor resourceVersion; the same for the spec-layout ephemeral reports. (Kyverno's
/// conformance suite asserts generation 1 on reports it writes.)
pub async fn generation_is_one_on_create_and_bumps_only_on_content_change(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    let k = Kubectl::new(&server.kubeconfig);
    for desc in [&catalog::POLICY_REPORT, &catalog::EPHEMERAL_REPORT] {
        let api = dyn_api(&client, desc, "gen");
        let resource_arg = format!("{}.{}", desc.plural, desc.group);
        let state = || async {
            let o = api.get("g").await.unwrap();
            (o.metadata.generation.unwrap(), rv_of(&o))
        };
        let mut file = report(desc, "g", &[], 1);
        file["metadata"]["namespace"] = json!("gen");
        let apply = |v: &Value| {
            k.run_with_stdin(&["apply", "-f", "-"], Some(&v.to_string()))
                .unwrap()
        };
        assert!(apply(&file).contains("created"));
        let (g0, rv0) = state().await;
        assert_eq!(g0, 1, "{backend:?} {desc:?}");

        let kubectl = |args: &[&str]| {
            let mut full = vec![args[0], resource_arg.as_str(), "-n", "gen", "g"];
            full.extend(&args[1..]);
            k.run(&full).unwrap();
        };
        kubectl(&["label", "team=a"]);
        kubectl(&["annotate", "note=x"]);
        kubectl(&[
            "patch",
            "--type",
            "merge",
            "-p",
            r#"{"metadata":{"finalizers":["example.com/x"]}}"#,
        ]);
        let (g, rv) = state().await;
        assert_eq!(
            g, 1,
            "{backend:?} {desc:?}: metadata-only changes keep the generation"
        );
        assert!(rv > rv0);

        // Unchanged apply: kubectl sends nothing; the server's no-op PUT changes nothing either.
        assert!(apply(&file).contains("unchanged"));
        let same = api.get("g").await.unwrap();
        let replaced = api
            .replace("g", &PostParams::default(), &same)
            .await
            .unwrap();
        assert_eq!(
            (replaced.metadata.generation.unwrap(), rv_of(&replaced)),
            (1, rv)
        );

        // Content changes.
        let summary_path = match desc.layout {
            reports_server_crds::ReportLayout::TopLevel => "/summary/pass",
            reports_server_crds::ReportLayout::Spec => "/spec/summary/pass",
        };
        match desc.layout {
            reports_server_crds::ReportLayout::TopLevel => file["summary"]["pass"] = json!(2),
            reports_server_crds::ReportLayout::Spec => file["spec"]["summary"]["pass"] = json!(2),
        }
        assert!(apply(&file).contains("configured"));
        assert_eq!(
            state().await.0,
            2,
            "{backend:?} {desc:?}: apply of a content change"
        );
        kubectl(&[
            "patch",
            "--type",
            "json",
            "-p",
            &format!(r#"[{{"op":"replace","path":"{summary_path}","value":3}}]"#),
        ]);
        assert_eq!(state().await.0, 3, "{backend:?} {desc:?}: JSON patch");
        kubectl(&["label", "team-"]);
        assert_eq!(state().await.0, 3);
        kubectl(&[
            "patch",
            "--type",
            "merge",
            "-p",
            r#"{"metadata":{"finalizers":null}}"#,
        ]);
    }
}

/// Objects come back exactly as they were sent plus the server-owned metadata: no annotation or
/// label is added (the peer stamps `kyverno.reports-server.io/served-by` on everything), on get,
/// list, watch and the metadata-only path alike.
pub async fn objects_come_back_as_sent_without_added_annotations(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let server = start(backend, dir.path(), &[]).await;
    let client = server.client().await.unwrap();
    for desc in &catalog::ALL {
        let api = dyn_api(&client, desc, "asis");
        let rv = list_rv(&api).await;
        let mut events = api
            .watch(&WatchParams::default().timeout(60), &rv.to_string())
            .await
            .unwrap()
            .boxed();
        let plain = dynamic(report(desc, "plain", &[], 1));
        let mut annotated = dynamic(report(desc, "annotated", &[("l", "v")], 1));
        annotated.metadata.annotations = Some([("mine".to_owned(), "kept".to_owned())].into());
        for sent in [&plain, &annotated] {
            let created = api.create(&PostParams::default(), sent).await.unwrap();
            let name = name_of(sent);
            let got = api.get(&name).await.unwrap();
            let meta_only = api.get_metadata(&name).await.unwrap();
            let listed = api
                .list(&ListParams::default().fields(&format!("metadata.name={name}")))
                .await
                .unwrap()
                .items
                .remove(0);
            let watched = match next(&mut events, "as sent").await {
                Some(Ok(WatchEvent::Added(o))) => o,
                other => panic!("{other:?}"),
            };
            for (what, o) in [
                ("create", &created),
                ("get", &got),
                ("list", &listed),
                ("watch", &watched),
            ] {
                assert_eq!(
                    o.metadata.annotations, sent.metadata.annotations,
                    "{backend:?} {desc:?} {what}: annotations"
                );
                assert_eq!(
                    o.metadata.labels, sent.metadata.labels,
                    "{desc:?} {what}: labels"
                );
                assert_eq!(o.data, sent.data, "{backend:?} {desc:?} {what}: body");
            }
            assert_eq!(meta_only.metadata.annotations, sent.metadata.annotations);
        }
    }
}
