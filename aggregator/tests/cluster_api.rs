//! The cluster backend against a mocked API server.
//!
//! The kube `Client` runs over a `tower_test` mock service; the test plays the API server: it
//! takes each request the client sends, checks it (method, path, body, headers) and answers it.
//! Time is paused, so "the client sends nothing more until answered" is checked exactly: the
//! clock only moves when every task is idle (see [`ApiServer::assert_quiet`]).
//!
//! What is checked is what the code's correctness rests on but a real API server would not
//! show: the order of the requests of a plan (the crash-safety argument of the `cluster`
//! module), the preconditions they carry, the Lease protocol of the election, and that the
//! ephemeral-report watch asks for metadata only.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::client::Body;
use reports_server_aggregator::backend::{AggregationBackend, Applied, BackendError};
use reports_server_aggregator::cluster::backend::{KubeBackend, KubeBackendConfig};
use reports_server_aggregator::cluster::runner::enqueue_changed_namespaces;
use reports_server_aggregator::{
    CancellationToken, FinalReport, ObjectKey, Plan, QueueConfig, ReportKind, WorkQueue,
};
use reports_server_election::kube_lease::{self as lease, LeaseConfig};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::time::Instant;
use tower_test::mock::{self, Handle, SendResponse};

/// A request as the API server received it.
#[derive(Debug)]
struct Received {
    method: Method,
    path: String,
    query: String,
    accept: String,
    body: Value,
}

impl Received {
    fn is(&self, method: Method, path: &str) -> bool {
        self.method == method && self.path == path
    }

    fn assert_is(&self, method: Method, path: &str) {
        assert!(
            self.is(method.clone(), path),
            "expected {method} {path}, got {self:?}"
        );
    }
}

/// The test's side of the mock: the API server the client talks to.
struct ApiServer {
    handle: Handle<Request<Body>, Response<Body>>,
}

/// A client whose every request arrives at the returned [`ApiServer`].
fn mocked_api() -> (Client, ApiServer) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, "default"), ApiServer { handle })
}

impl ApiServer {
    /// The next request, and the means to answer it.
    async fn next(&mut self) -> (Received, SendResponse<Response<Body>>) {
        let (request, respond) =
            tokio::time::timeout(Duration::from_secs(3600), self.handle.next_request())
                .await
                .expect("the client sends another request")
                .expect("the client is still there");
        let (parts, body) = request.into_parts();
        let bytes = body.collect_bytes().await.expect("a readable request body");
        let received = Received {
            method: parts.method,
            path: parts.uri.path().to_owned(),
            query: parts.uri.query().unwrap_or_default().to_owned(),
            accept: parts
                .headers
                .get(http::header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned(),
            body: if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).expect("a JSON request body")
            },
        };
        (received, respond)
    }

    /// The next `n` requests, in a stable order (by method, then path), whatever order
    /// concurrent requests arrived in.
    async fn next_batch(&mut self, n: usize) -> Vec<(Received, SendResponse<Response<Body>>)> {
        let mut batch = Vec::new();
        for _ in 0..n {
            batch.push(self.next().await);
        }
        batch.sort_by(|(a, _), (b, _)| {
            (a.method.as_str(), &a.path).cmp(&(b.method.as_str(), &b.path))
        });
        batch
    }

    /// Asserts that the client sends nothing more (until the requests it waits for are
    /// answered). With paused time, the timeout only fires once every task is idle.
    async fn assert_quiet(&mut self) {
        match tokio::time::timeout(Duration::from_secs(1), self.handle.next_request()).await {
            Err(_) | Ok(None) => {}
            Ok(Some((request, _))) => {
                panic!("unexpected {} {}", request.method(), request.uri())
            }
        }
    }
}

fn answer(respond: SendResponse<Response<Body>>, status: u16, body: &Value) {
    respond.send_response(
        Response::builder()
            .status(StatusCode::from_u16(status).expect("a valid status"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from(serde_json::to_vec(body).expect("JSON")))
            .expect("a valid response"),
    );
}

/// A `v1 Status` failure, as the API server sends it.
fn failure(code: u16, reason: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "reason": reason,
        "code": code,
        "message": format!("{reason} (mocked)"),
    })
}

/// The `v1 Status` of a successful delete.
fn success() -> Value {
    json!({ "apiVersion": "v1", "kind": "Status", "status": "Success", "code": 200 })
}

/// `object` as stored, with a new resourceVersion.
fn stored(object: &Value, resource_version: &str) -> Value {
    let mut object = object.clone();
    object["metadata"]["resourceVersion"] = json!(resource_version);
    object
}

// --- The crash-safe apply order -------------------------------------------------------------

const POLICY_REPORTS: &str = "/apis/wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports";
const EPHEMERAL_REPORTS: &str = "/apis/reports.kyverno.io/v1/namespaces/ns/ephemeralreports";

fn report(name: &str, resource_version: Option<&str>) -> FinalReport {
    FinalReport::new(
        ReportKind::PolicyReport,
        ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            resource_version: resource_version.map(str::to_owned),
            ..ObjectMeta::default()
        },
    )
}

fn key(kind: ReportKind, name: &str, uid: &str, resource_version: &str) -> ObjectKey {
    ObjectKey {
        kind,
        namespace: "ns".into(),
        name: name.into(),
        uid: Some(uid.into()),
        resource_version: Some(resource_version.into()),
    }
}

/// A plan with one of everything: create `a`, update `b` (read at resourceVersion 5), delete
/// the report `c` and the consumed ephemeral reports `e1`, `e2`.
fn full_plan() -> Plan {
    Plan {
        creates: vec![report("a", None)],
        updates: vec![report("b", Some("5"))],
        deletes: vec![key(ReportKind::PolicyReport, "c", "uid-c", "6")],
        ephemeral_deletes: vec![
            key(ReportKind::EphemeralReport, "e1", "uid-e1", "7"),
            key(ReportKind::EphemeralReport, "e2", "uid-e2", "8"),
        ],
        ..Plan::default()
    }
}

fn backend(client: Client) -> KubeBackend {
    KubeBackend::new(client, watch::channel(None).1, KubeBackendConfig::default())
}

/// Applies `plan` in a task (so that the test can play the API server meanwhile).
fn apply(client: Client, plan: Plan) -> tokio::task::JoinHandle<Result<Applied, BackendError>> {
    let backend = backend(client);
    tokio::spawn(async move { backend.apply(&plan).await })
}

fn assert_preconditions(request: &Received, uid: &str, resource_version: &str) {
    assert_eq!(
        request.body["preconditions"],
        json!({ "uid": uid, "resourceVersion": resource_version }),
        "{request:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_plan_writes_reports_then_deletes_reports_then_deletes_ephemerals() {
    let (client, mut api) = mocked_api();
    let applying = apply(client, full_plan());

    // 1. The report writes, concurrently; nothing else until they are answered.
    let writes = api.next_batch(2).await;
    api.assert_quiet().await;
    let [(create, created), (update, updated)]: [_; 2] = writes.try_into().expect("two writes");
    create.assert_is(Method::POST, POLICY_REPORTS);
    assert_eq!(create.body["metadata"]["name"], "a");
    assert!(
        create.body["metadata"].get("resourceVersion").is_none(),
        "a create carries no resourceVersion: {create:?}"
    );
    update.assert_is(Method::PUT, &format!("{POLICY_REPORTS}/b"));
    assert_eq!(
        update.body["metadata"]["resourceVersion"], "5",
        "an update is conditional on the version it was computed from"
    );
    answer(created, 201, &stored(&create.body, "10"));
    answer(updated, 200, &stored(&update.body, "11"));

    // 2. The reports no longer wanted, with preconditions; still no ephemeral delete.
    let (delete, deleted) = api.next().await;
    api.assert_quiet().await;
    delete.assert_is(Method::DELETE, &format!("{POLICY_REPORTS}/c"));
    assert_preconditions(&delete, "uid-c", "6");
    answer(deleted, 200, &success());

    // 3. Only now the consumed ephemeral reports, each conditional on the version merged; one
    // is gone already, which is fine.
    let ephemerals = api.next_batch(2).await;
    let [(e1, e1_deleted), (e2, e2_deleted)]: [_; 2] =
        ephemerals.try_into().expect("two ephemeral deletes");
    e1.assert_is(Method::DELETE, &format!("{EPHEMERAL_REPORTS}/e1"));
    assert_preconditions(&e1, "uid-e1", "7");
    e2.assert_is(Method::DELETE, &format!("{EPHEMERAL_REPORTS}/e2"));
    assert_preconditions(&e2, "uid-e2", "8");
    answer(e1_deleted, 200, &success());
    answer(e2_deleted, 404, &failure(404, "NotFound"));

    let applied = applying.await.unwrap().expect("the plan applied");
    assert_eq!(applied, Applied::default());
    api.assert_quiet().await;
}

#[tokio::test(start_paused = true)]
async fn an_ephemeral_rewritten_since_loaded_is_left_for_the_next_pass() {
    let (client, mut api) = mocked_api();
    let plan = Plan {
        ephemeral_deletes: vec![
            key(ReportKind::EphemeralReport, "e1", "uid-e1", "7"),
            key(ReportKind::EphemeralReport, "e2", "uid-e2", "8"),
        ],
        ..Plan::default()
    };
    let applying = apply(client, plan);
    let [(e1, e1_deleted), (e2, e2_deleted)]: [_; 2] = api
        .next_batch(2)
        .await
        .try_into()
        .expect("two ephemeral deletes");
    e1.assert_is(Method::DELETE, &format!("{EPHEMERAL_REPORTS}/e1"));
    e2.assert_is(Method::DELETE, &format!("{EPHEMERAL_REPORTS}/e2"));
    // The scanner rewrote e2 after the merge loaded it: the precondition fails.
    answer(e1_deleted, 200, &success());
    answer(e2_deleted, 409, &failure(409, "Conflict"));
    let applied = applying
        .await
        .unwrap()
        .expect("a rewritten ephemeral fails nothing");
    assert_eq!(applied.ephemerals_rewritten, 1);
    api.assert_quiet().await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_report_write_deletes_nothing() {
    let (client, mut api) = mocked_api();
    let applying = apply(client, full_plan());
    let writes = api.next_batch(2).await;
    let [(create, created), (update, updated)]: [_; 2] = writes.try_into().expect("two writes");
    create.assert_is(Method::POST, POLICY_REPORTS);
    update.assert_is(Method::PUT, &format!("{POLICY_REPORTS}/b"));
    // Someone else created `a` meanwhile; `b` is written.
    answer(created, 409, &failure(409, "AlreadyExists"));
    answer(updated, 200, &stored(&update.body, "11"));
    let outcome = applying.await.unwrap();
    assert!(
        matches!(outcome, Err(BackendError::Conflict(_))),
        "a 409 is a conflict (re-merge): {outcome:?}"
    );
    // Neither the old report nor any ephemeral report is deleted: `a`'s results live only in
    // the ephemeral reports, and the next pass merges them again.
    api.assert_quiet().await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_report_delete_keeps_the_ephemerals() {
    let (client, mut api) = mocked_api();
    let plan = Plan {
        deletes: vec![key(ReportKind::PolicyReport, "c", "uid-c", "6")],
        ephemeral_deletes: vec![key(ReportKind::EphemeralReport, "e1", "uid-e1", "7")],
        ..Plan::default()
    };
    let applying = apply(client, plan);
    let (delete, deleted) = api.next().await;
    delete.assert_is(Method::DELETE, &format!("{POLICY_REPORTS}/c"));
    answer(deleted, 500, &failure(500, "InternalError"));
    let outcome = applying.await.unwrap();
    assert!(
        matches!(outcome, Err(BackendError::Unavailable(_))),
        "{outcome:?}"
    );
    api.assert_quiet().await;
}

// --- The Lease election ----------------------------------------------------------------------

const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/kyverno/leases/agg";
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/kyverno/leases";

/// When the elector said it started and stopped leading, from the test's start.
type Leading = Arc<Mutex<Vec<(Duration, bool)>>>;

/// Runs the elector of identity `me` on the Lease `kyverno/agg` in a task.
fn elect(client: Client, cancel: &CancellationToken) -> (tokio::task::JoinHandle<()>, Leading) {
    let config = LeaseConfig::new("kyverno", "agg", "me");
    let leading: Leading = Arc::default();
    let (log, cancel, start) = (leading.clone(), cancel.clone(), Instant::now());
    let task = tokio::spawn(async move {
        lease::elector(client, &config)
            .run(
                cancel,
                |term: CancellationToken| async move { term.cancelled().await },
                |now_leading| log.lock().unwrap().push((start.elapsed(), now_leading)),
            )
            .await
    });
    (task, leading)
}

fn lease_held_by(holder: &str, resource_version: &str, transitions: i32) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": { "name": "agg", "namespace": "kyverno", "resourceVersion": resource_version },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 15,
            "leaseTransitions": transitions,
            "acquireTime": "2026-01-01T00:00:00.000000Z",
            "renewTime": "2026-01-01T00:00:00.000000Z",
        },
    })
}

#[tokio::test(start_paused = true)]
async fn the_lease_is_created_renewed_and_released() {
    let (client, mut api) = mocked_api();
    let cancel = CancellationToken::new();
    let start = Instant::now();
    let (elector, leading) = elect(client, &cancel);

    let (read, not_found) = api.next().await;
    read.assert_is(Method::GET, LEASE);
    answer(not_found, 404, &failure(404, "NotFound"));

    let (create, created) = api.next().await;
    create.assert_is(Method::POST, LEASES);
    let spec = &create.body["spec"];
    assert_eq!(create.body["metadata"]["name"], "agg");
    assert_eq!(spec["holderIdentity"], "me");
    assert_eq!(spec["leaseDurationSeconds"], 15);
    assert_eq!(spec["leaseTransitions"], 0);
    let acquire_time = spec["acquireTime"].clone();
    assert!(acquire_time.is_string() && spec["renewTime"].is_string());
    answer(created, 201, &stored(&create.body, "1"));

    // A renewal every 5 s, conditional on the version written last; acquireTime kept.
    for (written, next) in [("1", "2"), ("2", "3")] {
        let (renew, renewed) = api.next().await;
        renew.assert_is(Method::PUT, LEASE);
        assert_eq!(renew.body["metadata"]["resourceVersion"], written);
        assert_eq!(renew.body["spec"]["holderIdentity"], "me");
        assert_eq!(renew.body["spec"]["acquireTime"], acquire_time);
        assert_eq!(renew.body["spec"]["leaseTransitions"], 0);
        answer(renewed, 200, &stored(&renew.body, next));
    }
    assert_eq!(start.elapsed(), Duration::from_secs(10));

    // A clean stop: read the Lease, and hand it back if it is still ours.
    cancel.cancel();
    let (reread, current) = api.next().await;
    reread.assert_is(Method::GET, LEASE);
    answer(current, 200, &lease_held_by("me", "3", 0));
    let (release, released) = api.next().await;
    release.assert_is(Method::PUT, LEASE);
    assert_eq!(release.body["metadata"]["resourceVersion"], "3");
    assert!(
        release.body["spec"].get("holderIdentity").is_none(),
        "{release:?}"
    );
    assert_eq!(release.body["spec"]["leaseDurationSeconds"], 1);
    answer(released, 200, &stored(&release.body, "4"));

    elector.await.unwrap();
    assert_eq!(
        *leading.lock().unwrap(),
        [(Duration::ZERO, true), (Duration::from_secs(10), false)]
    );
    api.assert_quiet().await;
}

#[tokio::test(start_paused = true)]
async fn a_lease_left_by_another_holder_is_taken_over_after_its_duration() {
    let (client, mut api) = mocked_api();
    let cancel = CancellationToken::new();
    let start = Instant::now();
    let (elector, leading) = elect(client, &cancel);

    // The same record (resourceVersion 9) every 2 s, until it has been unchanged for 15 s.
    let mut reads = 0;
    let (takeover, taken) = loop {
        let (request, respond) = api.next().await;
        if request.method != Method::GET {
            break (request, respond);
        }
        request.assert_is(Method::GET, LEASE);
        reads += 1;
        answer(respond, 200, &lease_held_by("other", "9", 2));
    };
    assert_eq!(reads, 9, "reads at 0, 2, …, 16 s");
    assert_eq!(start.elapsed(), Duration::from_secs(16));
    takeover.assert_is(Method::PUT, LEASE);
    assert_eq!(takeover.body["metadata"]["resourceVersion"], "9");
    assert_eq!(takeover.body["spec"]["holderIdentity"], "me");
    assert_eq!(takeover.body["spec"]["leaseTransitions"], 3, "a new holder");
    answer(taken, 200, &stored(&takeover.body, "10"));

    // The first renewal: someone else wrote the Lease meanwhile (409); re-read, it is theirs.
    let (renew, refused) = api.next().await;
    renew.assert_is(Method::PUT, LEASE);
    answer(refused, 409, &failure(409, "Conflict"));
    let (reread, current) = api.next().await;
    reread.assert_is(Method::GET, LEASE);
    answer(current, 200, &lease_held_by("third", "11", 3));

    // Lost: the work stops and the Lease is not touched; the next request is a new attempt's
    // read, one retry interval later.
    let (attempt, respond) = api.next().await;
    attempt.assert_is(Method::GET, LEASE);
    assert_eq!(start.elapsed(), Duration::from_secs(23));
    assert_eq!(
        *leading.lock().unwrap(),
        [
            (Duration::from_secs(16), true),
            (Duration::from_secs(21), false)
        ]
    );
    cancel.cancel();
    answer(respond, 200, &lease_held_by("third", "11", 3));
    elector.await.unwrap();
    api.assert_quiet().await;
}

// --- The metadata-only watch of ephemeral reports -------------------------------------------

fn partial(namespace: &str, name: &str, resource_version: &str) -> Value {
    json!({
        "apiVersion": "meta.k8s.io/v1",
        "kind": "PartialObjectMetadata",
        "metadata": { "name": name, "namespace": namespace, "resourceVersion": resource_version },
    })
}

#[tokio::test(start_paused = true)]
async fn ephemeral_reports_are_watched_as_metadata_and_enqueue_their_namespaces() {
    let (client, mut api) = mocked_api();
    let queue = WorkQueue::new(QueueConfig::default(), None);
    let term = CancellationToken::new();
    let watching = {
        let (queue, term) = (queue.clone(), term.clone());
        tokio::spawn(async move {
            enqueue_changed_namespaces(&client, ReportKind::EphemeralReport, &queue, &term).await
        })
    };

    let (list, listed) = api.next().await;
    list.assert_is(Method::GET, "/apis/reports.kyverno.io/v1/ephemeralreports");
    assert_eq!(
        list.accept, "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1",
        "the list asks for metadata only"
    );
    answer(
        listed,
        200,
        &json!({
            "apiVersion": "meta.k8s.io/v1",
            "kind": "PartialObjectMetadataList",
            "metadata": { "resourceVersion": "10" },
            "items": [partial("a", "e1", "3"), partial("b", "e2", "4"), partial("a", "e3", "5")],
        }),
    );

    let (watch, events) = api.next().await;
    watch.assert_is(Method::GET, "/apis/reports.kyverno.io/v1/ephemeralreports");
    assert!(
        watch.query.contains("watch=true") && watch.query.contains("resourceVersion=10"),
        "{watch:?}"
    );
    assert_eq!(
        watch.accept, "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1",
        "the watch asks for metadata only"
    );
    // A deletion (ignored), then an addition.
    let stream = [
        json!({ "type": "DELETED", "object": partial("d", "e4", "11") }),
        json!({ "type": "ADDED", "object": partial("c", "e5", "12") }),
    ]
    .iter()
    .map(|e| format!("{e}\n"))
    .collect::<String>();
    events.send_response(
        Response::builder()
            .status(200)
            .body(Body::from(stream.into_bytes()))
            .expect("a valid response"),
    );

    // The watch ended with the body; the watcher watches again from the last version seen.
    let (rewatch, _pending) = api.next().await;
    assert!(rewatch.query.contains("resourceVersion=12"), "{rewatch:?}");
    // a, b (listed) and c (added); not d (deleted).
    assert_eq!(queue.len(), 3);
    term.cancel();
    watching.await.unwrap();
}
