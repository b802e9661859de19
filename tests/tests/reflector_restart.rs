//! A kube-rs reflector (streaming lists) on 10,000 stored reports sees exactly the stored set,
//! then every later create/update/delete exactly once, across a kill -9 and restart of the
//! server in the middle of the writes — by resuming its watch, or by relisting after a 410, but
//! never with a silent gap. On SQLite and on PostgreSQL.
//!
//! How "exactly once" is judged: the server's change log (read from the database after the run)
//! is the list of everything that was committed, in resourceVersion order. The watcher's events
//! after its initial sync must be that list, one event per entry, in order; a relist (Init …
//! InitDone) must be exactly the state after some prefix of it, and the events that follow must
//! continue from there. Every write the clients saw acknowledged must be in the log (an
//! in-flight write cut by the kill may or may not have committed; the log decides).
//!
//! The 10,000 initial reports are written straight into the database with the store library
//! (what the API would store, server-owned metadata included) because creating them through the
//! API takes minutes on a 2-core machine; the property under test starts after them. They are
//! small (one result each): the property does not depend on the size. `REFLECTOR_REPORTS`
//! changes the count.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use reports_server_apiserver::registry::stamp_new;
use reports_server_apiserver::store::feed::read_changes;
use reports_server_apiserver::store::write_target::Target;
use reports_server_apiserver::store::{EventType, Mutation, Store, StoreError, StoreOptions};
use reports_server_crds::catalog::POLICY_REPORT;
use reports_server_tests::Backend;
use reports_server_tests::objects::rv_of;
use reports_server_tests::server::ServerProcess;
use serde_json::{Value, json};

const PATIENCE: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflector_sees_every_change_exactly_once_across_kill_9_sqlite() {
    reflector_across_kill_9(Backend::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflector_sees_every_change_exactly_once_across_kill_9_postgres() {
    reflector_across_kill_9(Backend::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflector_relists_after_410_without_a_gap_sqlite() {
    reflector_relists_after_410(Backend::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflector_relists_after_410_without_a_gap_postgres() {
    reflector_relists_after_410(Backend::Postgres).await
}

type Key = (String, String);

/// What the watcher emitted, reduced to what is compared.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Ev {
    Init,
    InitApply(Key, u64),
    InitDone,
    Apply(Key, u64),
    Delete(Key, u64),
}

/// A committed change, from the change log.
#[derive(Clone, Debug)]
struct Committed {
    key: Key,
    rv: u64,
    deleted: bool,
}

fn policy_reports(client: &kube::Client) -> Api<DynamicObject> {
    Api::all_with(client.clone(), &api_resource())
}

fn api_resource() -> ApiResource {
    reports_server_tests::objects::api_resource(&POLICY_REPORT)
}

fn report(ns: &str, name: &str, pass: i64) -> Value {
    json!({
        "apiVersion": "wgpolicyk8s.io/v1alpha2",
        "kind": "PolicyReport",
        "metadata": {"name": name, "namespace": ns},
        "scope": {"apiVersion": "v1", "kind": "Pod", "name": name},
        "summary": {"pass": pass, "fail": 0, "warn": 0, "error": 0, "skip": 0},
        "results": [{"policy": "require-labels", "rule": "check-team", "result": "pass",
                     "source": "kyverno", "timestamp": {"seconds": 1_700_000_000, "nanos": 0}}],
    })
}

fn key_of(o: &DynamicObject) -> Key {
    (
        o.metadata.namespace.clone().unwrap_or_default(),
        o.metadata.name.clone().unwrap_or_default(),
    )
}

async fn start(backend: Backend, dir: &std::path::Path, extra: &[&str]) -> ServerProcess {
    let url = backend
        .database_url(dir)
        .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"));
    let mut args = vec!["--aggregation=false"];
    args.extend_from_slice(extra);
    ServerProcess::start_with(dir, Some(url), &args)
        .await
        .unwrap_or_else(|e| panic!("{backend:?}: {e:#}"))
}

async fn open_store(url: &str, options: impl FnOnce(&mut StoreOptions)) -> Store {
    let mut o = StoreOptions::new(url.to_owned());
    options(&mut o);
    Store::connect(o)
        .await
        .unwrap_or_else(|e| panic!("open {url}: {e}"))
}

/// Writes reports straight into the database with the metadata the server would set; returns
/// the last resourceVersion.
async fn seed(store: &Store, namespaces: usize, total: usize) -> u64 {
    let keys: Vec<Key> = (0..total)
        .map(|i| (format!("ns-{}", i % namespaces), format!("seed-{i:05}")))
        .collect();
    let mut last = 0;
    for chunk in keys.chunks(1000) {
        let objects = chunk
            .iter()
            .map(|(ns, name)| {
                let mut o = report(ns, name, 1);
                stamp_new(o["metadata"].as_object_mut().expect("metadata"), name);
                o
            })
            .collect();
        last = store.put_all(&POLICY_REPORT, objects).await.unwrap() as u64;
    }
    last
}

/// The policy-report entries of the change log after `after`.
async fn committed_after(store: &Store, after: u64) -> Vec<Committed> {
    let mut out = Vec::new();
    let mut from = after as i64;
    loop {
        let batch = read_changes(store, from, None, 5000).await.unwrap();
        if batch.is_empty() {
            return out;
        }
        for c in batch {
            from = c.resource_version;
            if c.resource == POLICY_REPORT.crd_name() {
                out.push(Committed {
                    key: (c.namespace, c.name),
                    rv: c.resource_version as u64,
                    deleted: c.event == EventType::Deleted,
                });
            }
        }
    }
}

/// The server's current set, by paginated list.
async fn server_state(api: &Api<DynamicObject>) -> BTreeMap<Key, u64> {
    let mut out = BTreeMap::new();
    let mut lp = ListParams::default().limit(2000);
    loop {
        let page = api.list(&lp).await.unwrap();
        out.extend(page.items.iter().map(|o| (key_of(o), rv_of(o))));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp = lp.continue_token(&c),
            None => return out,
        }
    }
}

/// A reflector with streaming lists whose every watcher event is also recorded.
struct Recorded {
    reader: reflector::Store<DynamicObject>,
    events: Arc<Mutex<Vec<Ev>>>,
    errors: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Recorded {
    fn start(api: Api<DynamicObject>) -> Self {
        let writer = reflector::store::Writer::new(api_resource());
        let reader = writer.as_reader();
        let events = Arc::new(Mutex::new(Vec::new()));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let (ev, err) = (events.clone(), errors.clone());
        let stream = watcher(api, watcher::Config::default().streaming_lists())
            .default_backoff()
            .inspect(move |e| match e {
                Ok(e) => ev.lock().unwrap().push(match e {
                    watcher::Event::Init => Ev::Init,
                    watcher::Event::InitApply(o) => Ev::InitApply(key_of(o), rv_of(o)),
                    watcher::Event::InitDone => Ev::InitDone,
                    watcher::Event::Apply(o) => Ev::Apply(key_of(o), rv_of(o)),
                    watcher::Event::Delete(o) => Ev::Delete(key_of(o), rv_of(o)),
                }),
                Err(e) => err.lock().unwrap().push(e.to_string()),
            });
        let task = tokio::spawn(reflector(writer, stream).for_each(|_| async {}));
        Recorded {
            reader,
            events,
            errors,
            task,
        }
    }

    fn state(&self) -> BTreeMap<Key, u64> {
        self.reader
            .state()
            .iter()
            .map(|o| (key_of(o), rv_of(o)))
            .collect()
    }

    fn events(&self) -> Vec<Ev> {
        self.events.lock().unwrap().clone()
    }

    /// Waits until the reflector holds exactly `expected`.
    async fn wait_for(&self, expected: &BTreeMap<Key, u64>, what: &str) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let state = self.state();
            if &state == expected && self.events().contains(&Ev::InitDone) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: the reflector holds {} objects, the server {}; watcher errors: {:?}",
                state.len(),
                expected.len(),
                self.errors.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Recorded {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Checks the initial sync (everything up to the first InitDone) against the stored set;
/// returns the index of that InitDone.
fn initial_sync(label: &str, stored: &BTreeMap<Key, u64>, events: &[Ev]) -> usize {
    let first_done = events
        .iter()
        .position(|e| *e == Ev::InitDone)
        .expect("an initial sync");
    let mut synced: BTreeMap<Key, u64> = BTreeMap::new();
    for e in &events[..first_done] {
        if let Ev::InitApply(k, rv) = e {
            assert!(
                synced.insert(k.clone(), *rv).is_none(),
                "{label}: {k:?} twice in the initial list"
            );
        }
    }
    assert!(
        &synced == stored,
        "{label}: the initial sync is not the stored set"
    );
    first_done
}

/// Checks watcher events against the committed changes, starting from a point where the
/// watcher's state was `start` and `log` holds every change committed after it: applies and
/// deletes must be the log, entry by entry; a relist (Init … InitDone) must be the exact state
/// after some prefix of the log, and the events after it must continue from that prefix. With
/// `require_all` every entry must have been delivered. Returns the number of relists.
fn verify(
    label: &str,
    start: &BTreeMap<Key, u64>,
    events: &[Ev],
    log: &[Committed],
    require_all: bool,
) -> usize {
    let mut model = start.clone();
    let mut p = 0;
    let mut relists = 0;
    let mut relisted: Option<BTreeMap<Key, u64>> = None;
    for (i, e) in events.iter().enumerate() {
        match (e, &mut relisted) {
            (Ev::Init, _) => {
                relists += 1;
                relisted = Some(BTreeMap::new());
            }
            (Ev::InitApply(k, rv), Some(set)) => {
                assert!(
                    set.insert(k.clone(), *rv).is_none(),
                    "{label}: {k:?} twice in a relist"
                );
            }
            (Ev::InitDone, Some(set)) => {
                // The relist is the state after the first p' >= p entries, for some p'.
                while &model != set {
                    assert!(
                        p < log.len(),
                        "{label}: relist #{relists} ({} objects) matches no committed state — a silent gap",
                        set.len()
                    );
                    apply(&mut model, &log[p]);
                    p += 1;
                }
                relisted = None;
            }
            (Ev::Apply(k, rv) | Ev::Delete(k, rv), None) => {
                let expected = log.get(p).unwrap_or_else(|| {
                    panic!("{label}: event {i} {e:?} after the end of the change log")
                });
                let deleted = matches!(e, Ev::Delete(..));
                assert!(
                    (&expected.key, expected.rv, expected.deleted) == (k, *rv, deleted),
                    "{label}: event {i} is {e:?} but the next committed change is {expected:?} \
                     (a gap, a repeat or a reordering)"
                );
                apply(&mut model, expected);
                p += 1;
            }
            (other, _) => panic!("{label}: unexpected {other:?}"),
        }
    }
    if require_all {
        assert_eq!(
            p,
            log.len(),
            "{label}: {} committed changes never reached the watcher (next: {:?})",
            log.len() - p,
            log.get(p)
        );
    }
    relists
}

/// The current set and version, read from the database with the store library.
async fn store_state(store: &Store) -> (BTreeMap<Key, u64>, u64) {
    use reports_server_apiserver::store::ListQuery;
    let page = store
        .list(&ListQuery {
            metadata_only: true,
            ..ListQuery::all(&POLICY_REPORT)
        })
        .await
        .unwrap();
    (
        page.rows
            .iter()
            .map(|r| {
                (
                    (r.namespace.clone(), r.name.clone()),
                    r.resource_version as u64,
                )
            })
            .collect(),
        page.resource_version as u64,
    )
}

fn apply(model: &mut BTreeMap<Key, u64>, c: &Committed) {
    if c.deleted {
        model.remove(&c.key);
    } else {
        model.insert(c.key.clone(), c.rv);
    }
}

/// An acknowledged write: the key and, when the reply said so, its resourceVersion.
#[derive(Clone, Debug)]
struct Acked {
    key: Key,
    rv: Option<u64>,
}

/// One writer: creates, updates and deletes on keys only it touches, retrying through the
/// outage. A retry whose first attempt may have committed is resolved by what the server says
/// (409 on create, 404 on delete, a moved resourceVersion on update).
async fn writer(
    client: kube::Client,
    id: usize,
    ops: usize,
    owned: Vec<Key>,
    progress: Arc<std::sync::atomic::AtomicUsize>,
) -> Vec<Acked> {
    let mut live: Vec<Key> = owned;
    let mut acked = Vec::new();
    let mut seed = 0x9e37_79b9_u64.wrapping_mul(id as u64 + 1);
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for op in 0..ops {
        let choice = rand() % 10;
        let api_for = |ns: &str| -> Api<DynamicObject> {
            Api::namespaced_with(client.clone(), ns, &api_resource())
        };
        if choice < 4 || live.is_empty() {
            let key = (format!("ns-{}", op % 7), format!("w{id}-{op:04}"));
            let api = api_for(&key.0);
            let rv = retry(|| async {
                match api
                    .create(
                        &PostParams::default(),
                        &serde_json::from_value(report(&key.0, &key.1, 0)).unwrap(),
                    )
                    .await
                {
                    Ok(o) => Ok(Some(Some(rv_of(&o)))),
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(Some(None)),
                    Err(e) => Err(e),
                }
            })
            .await;
            acked.push(Acked {
                key: key.clone(),
                rv,
            });
            live.push(key);
        } else if choice < 8 {
            let key = live[(rand() % live.len() as u64) as usize].clone();
            let api = api_for(&key.0);
            let rv = retry(|| async {
                let mut o = api.get(&key.1).await?;
                o.data["summary"]["pass"] =
                    json!(o.data["summary"]["pass"].as_i64().unwrap_or(0) + 1);
                match api.replace(&key.1, &PostParams::default(), &o).await {
                    Ok(o) => Ok(Some(Some(rv_of(&o)))),
                    // Our own earlier attempt committed: this key has no other writer.
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(Some(None)),
                    Err(e) => Err(e),
                }
            })
            .await;
            acked.push(Acked { key, rv });
        } else {
            let i = (rand() % live.len() as u64) as usize;
            let key = live.swap_remove(i);
            let api = api_for(&key.0);
            let rv = retry(|| async {
                match api.delete(&key.1, &DeleteParams::default()).await {
                    Ok(either) => Ok(Some(either.left().map(|o| rv_of(&o)))),
                    Err(kube::Error::Api(s)) if s.code == 404 => Ok(Some(None)),
                    Err(e) => Err(e),
                }
            })
            .await;
            acked.push(Acked { key, rv });
        }
        progress.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    acked
}

/// Retries `f` while the server is away (connection errors, 503), up to [`PATIENCE`].
async fn retry<T, F, Fut>(mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, kube::Error>>,
{
    let deadline = Instant::now() + PATIENCE;
    loop {
        match f().await {
            Ok(Some(v)) => return v,
            Ok(None) => {}
            Err(kube::Error::Api(s)) if s.code < 500 => panic!("write refused: {s:?}"),
            Err(e) => assert!(
                Instant::now() < deadline,
                "the server did not come back: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn reports_count() -> usize {
    std::env::var("REFLECTOR_REPORTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

async fn reflector_across_kill_9(backend: Backend) {
    let started = Instant::now();
    let total = reports_count();
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(backend, dir.path(), &[]).await;
    let store = open_store(&server.database_url, |_| {}).await;
    let seeded_rv = seed(&store, 20, total).await;
    let client = server.client().await.unwrap();
    let api = policy_reports(&client);
    let stored = server_state(&api).await;
    assert_eq!(stored.len(), total);

    // Initial sync: exactly the stored set.
    let recorded = Recorded::start(api.clone());
    recorded
        .wait_for(&stored, &format!("{backend:?} initial sync"))
        .await;
    let synced_at = started.elapsed();

    // Four writers, 150 operations each; kill -9 when half are done.
    let progress = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (writers, ops) = (4, 150);
    let owned: Vec<Vec<Key>> = (0..writers)
        .map(|w| {
            stored
                .keys()
                .enumerate()
                .filter(|(i, _)| i % 97 == w)
                .map(|(_, k)| k.clone())
                .collect()
        })
        .collect();
    let tasks: Vec<_> = owned
        .into_iter()
        .enumerate()
        .map(|(w, keys)| tokio::spawn(writer(client.clone(), w, ops, keys, progress.clone())))
        .collect();
    while progress.load(std::sync::atomic::Ordering::SeqCst) < writers * ops / 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.kill();
    // Writes fail while it is down; the watcher retries with backoff.
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.restart().await.unwrap();
    let mut acked = Vec::new();
    for t in tasks {
        acked.extend(t.await.unwrap());
    }

    // Everything committed, from the database itself.
    let log = committed_after(&store, seeded_rv).await;
    let final_state = server_state(&api).await;
    recorded
        .wait_for(&final_state, &format!("{backend:?} after the writes"))
        .await;
    for a in &acked {
        let found = log
            .iter()
            .any(|c| c.key == a.key && a.rv.is_none_or(|rv| rv == c.rv));
        assert!(
            found,
            "{backend:?}: acknowledged write {a:?} is not in the change log"
        );
    }
    let label = format!("{backend:?} kill -9");
    let events = recorded.events();
    let first_done = initial_sync(&label, &stored, &events);
    let relists = verify(&label, &stored, &events[first_done + 1..], &log, true);
    eprintln!(
        "{label}: {total} reports synced in {:.1}s; {} writes acknowledged, {} committed, all seen exactly once; {relists} relist(s); watcher errors during the outage: {}; total {:.1}s",
        synced_at.as_secs_f64(),
        acked.len(),
        log.len(),
        recorded.errors.lock().unwrap().len(),
        started.elapsed().as_secs_f64()
    );
}

/// The server comes back with a change log compacted past the watcher's resourceVersion, with
/// changes it never streamed: the watcher must get 410 and relist, and the relist must be the
/// exact current state; later changes then arrive exactly once.
async fn reflector_relists_after_410(backend: Backend) {
    let total = 1_000;
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(backend, dir.path(), &[]).await;
    let store = open_store(&server.database_url, |_| {}).await;
    let seeded_rv = seed(&store, 5, total).await;
    let client = server.client().await.unwrap();
    let api = policy_reports(&client);
    let stored = server_state(&api).await;
    let recorded = Recorded::start(api.clone());
    recorded.wait_for(&stored, "initial sync").await;

    // Some changes through the API, streamed as usual.
    let progress = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    writer(client.clone(), 0, 20, Vec::new(), progress.clone()).await;

    // Down; meanwhile the database moves on and its history is compacted (as another replica,
    // or a long outage with a short retention, would leave it).
    server.kill();
    let log_before = committed_after(&store, seeded_rv).await;
    let keys: Vec<Key> = stored.keys().take(30).cloned().collect();
    let targets: Vec<Target<'_>> = keys
        .iter()
        .map(|(ns, name)| Target {
            resource: &POLICY_REPORT,
            namespace: ns,
            name,
        })
        .collect();
    store
        .mutate_batch::<StoreError, _>(&targets, false, |i, current| {
            let mut o = current.expect("seeded");
            Ok(if i % 3 == 0 {
                Mutation::Delete
            } else {
                o["summary"]["pass"] = json!(100);
                Mutation::Put(o)
            })
        })
        .await
        .unwrap();
    let compactor = open_store(&server.database_url, |o| {
        o.watch_history = Duration::ZERO;
        o.watch_history_max_events = 5;
    })
    .await;
    let horizon = compactor.compact().await.unwrap();
    assert!(
        horizon as u64 > log_before.last().unwrap().rv,
        "{backend:?}: the watcher's version was not compacted"
    );
    let (at_restart, restart_rv) = store_state(&store).await;
    server.restart().await.unwrap();

    // More changes after the restart.
    writer(client.clone(), 1, 20, Vec::new(), progress.clone()).await;
    let final_state = server_state(&api).await;
    recorded
        .wait_for(&final_state, &format!("{backend:?} after 410"))
        .await;

    let events = recorded.events();
    let label = format!("{backend:?} 410");
    let first_done = initial_sync(&label, &stored, &events);
    let relist_start = events
        .iter()
        .rposition(|e| *e == Ev::Init)
        .expect("a relist");
    assert!(
        relist_start > first_done,
        "{label}: no relist after the 410"
    );
    let errors = recorded.errors.lock().unwrap().clone();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("410") || e.contains("Expired") || e.contains("too old")),
        "{label}: the watcher never saw a 410: {errors:?}"
    );
    // Before the kill: a gapless prefix of what was committed (the last few may not have been
    // streamed when the server died; the relist has to make up for them).
    verify(
        &label,
        &stored,
        &events[first_done + 1..relist_start],
        &log_before,
        false,
    );
    // After: the relist is the state after some prefix of what was committed since the restart.
    let log_after = committed_after(&store, restart_rv).await;
    let relists = verify(
        &label,
        &at_restart,
        &events[relist_start..],
        &log_after,
        true,
    );
    assert_eq!(relists, 1, "{label}");
}
