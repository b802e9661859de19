//! Restoring a backup never moves resourceVersions backwards. A database restored to an earlier
//! point holds a counter below versions clients have already seen; left alone, the next writes
//! would hand out those versions again with other content, and an informer resuming from one of
//! them would silently miss or mix changes. The documented procedure (docs/operations.md,
//! "Restoring a backup") runs `reports-server migrate after-restore`, which raises the counter
//! and the watch horizon above anything served before: a watcher that saw the later versions
//! gets 410 Gone and relists, and its view becomes the restored state.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use reports_server_crds::PolicyReport;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use reports_server_tests::server::{ServerProcess, binary};

const NS: &str = "restore";
const PATIENCE: Duration = Duration::from_secs(30);

fn report(name: &str, n: u64) -> PolicyReport {
    let mut r = pss_policy_report(&Subject::pod(NS, n), 1_700_000_000, &[n as usize % 19]);
    r.metadata.name = Some(name.into());
    r.metadata.namespace = Some(NS.into());
    r
}

async fn create(server: &ServerProcess, names: &[&str]) {
    let api: Api<PolicyReport> = Api::namespaced(server.client().await.unwrap(), NS);
    for (n, name) in names.iter().enumerate() {
        api.create(&PostParams::default(), &report(name, n as u64))
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
    }
}

/// The SQLite database files: the database, its write-ahead log and shared memory.
fn database_files(dir: &Path) -> Vec<std::path::PathBuf> {
    ["reports.db", "reports.db-wal", "reports.db-shm"]
        .iter()
        .map(|f| dir.join(f))
        .collect()
}

/// What the watcher saw: each event's kind, name and resourceVersion, in order.
type Seen = Arc<Mutex<Vec<(&'static str, String, u64)>>>;

fn seen_entry(kind: &'static str, r: &PolicyReport) -> (&'static str, String, u64) {
    let rv = r.metadata.resource_version.as_deref().unwrap_or("0");
    (
        kind,
        r.metadata.name.clone().unwrap_or_default(),
        rv.parse().unwrap_or(0),
    )
}

/// Follows the namespace's reports the way an informer does: list, then watch from the list's
/// version, relisting on 410, retrying other errors with backoff.
fn follow(client: kube::Client, seen: Seen) -> tokio::task::JoinHandle<()> {
    let api: Api<PolicyReport> = Api::namespaced(client, NS);
    tokio::spawn(async move {
        let mut events = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(event) = events.next().await {
            let entry = match event {
                Ok(watcher::Event::Init) => ("INIT", String::new(), 0),
                Ok(watcher::Event::InitApply(r)) => seen_entry("INIT_APPLY", &r),
                Ok(watcher::Event::InitDone) => ("INIT_DONE", String::new(), 0),
                Ok(watcher::Event::Apply(r)) => seen_entry("APPLY", &r),
                Ok(watcher::Event::Delete(r)) => seen_entry("DELETE", &r),
                Err(_) => continue,
            };
            seen.lock().unwrap().push(entry);
        }
    })
}

async fn wait_until(seen: &Seen, what: &str, done: impl Fn(&[(&str, String, u64)]) -> bool) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if done(&seen.lock().unwrap()) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} within {PATIENCE:?}; the watcher saw {:?}",
            seen.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn after_a_restore_watchers_relist_instead_of_reusing_versions() {
    let dir = tempfile::tempdir().unwrap();
    let backup = tempfile::tempdir().unwrap();
    let mut server = ServerProcess::start(dir.path(), None).await.unwrap();
    create(&server, &["before-0", "before-1", "before-2"]).await;

    // A consistent backup: the files of a stopped server.
    server.kill();
    for file in database_files(dir.path()).iter().filter(|f| f.exists()) {
        std::fs::copy(file, backup.path().join(file.file_name().unwrap())).unwrap();
    }
    server.restart().await.unwrap();
    let seen: Seen = Arc::default();
    let watching = follow(server.client().await.unwrap(), seen.clone());
    create(&server, &["after-0", "after-1", "after-2"]).await;
    wait_until(&seen, "the watcher sees the writes after the backup", |s| {
        s.iter().any(|(k, n, _)| *k == "APPLY" && n == "after-2")
    })
    .await;
    let highest_before_restore = seen.lock().unwrap().iter().map(|e| e.2).max().unwrap();
    let events_before_restore = seen.lock().unwrap().len();

    // The restore, and the procedure.
    server.kill();
    for file in database_files(dir.path()) {
        let _ = std::fs::remove_file(&file);
        let saved = backup.path().join(file.file_name().unwrap());
        if saved.exists() {
            std::fs::copy(&saved, &file).unwrap();
        }
    }
    let out = std::process::Command::new(binary().unwrap())
        .args([
            "migrate",
            "after-restore",
            "--database-url",
            &server.database_url,
        ])
        .args(["--data-dir", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "migrate after-restore failed: {said}");
    println!("[restore] {}", said.trim());
    server.restart().await.unwrap();

    // The watcher relists: a new INIT … INIT_DONE whose objects are the restored ones, at
    // versions above every version it saw before.
    wait_until(&seen, "the watcher relists after the restore", |s| {
        s[events_before_restore..]
            .iter()
            .any(|(k, _, _)| *k == "INIT_DONE")
    })
    .await;
    let after: Vec<_> = seen.lock().unwrap()[events_before_restore..].to_vec();
    watching.abort();
    let init = after
        .iter()
        .position(|(k, _, _)| *k == "INIT")
        .expect("a relist after the restore");
    let done = after
        .iter()
        .position(|(k, _, _)| *k == "INIT_DONE")
        .unwrap();
    assert!(
        after[..init].is_empty(),
        "events between the restore and the relist: {:?}",
        &after[..init]
    );
    let relisted: BTreeSet<&str> = after[init..done]
        .iter()
        .filter(|(k, _, _)| *k == "INIT_APPLY")
        .map(|(_, n, _)| n.as_str())
        .collect();
    assert_eq!(
        relisted,
        BTreeSet::from(["before-0", "before-1", "before-2"]),
        "the relist shows the restored state"
    );
    // The restored objects keep the versions they were stored with (older than the backup);
    // what must never happen is a new write reusing a version a client saw: write one.
    create(&server, &["after-restore"]).await;
    let api: Api<PolicyReport> = Api::namespaced(server.client().await.unwrap(), NS);
    let written = api.get("after-restore").await.unwrap();
    let rv: u64 = written.metadata.resource_version.unwrap().parse().unwrap();
    println!(
        "[restore] highest version seen before the restore {highest_before_restore}; first write after it {rv}; {} events after the restore",
        after.len()
    );
    assert!(
        rv > highest_before_restore,
        "a write after the restore got version {rv}, not above {highest_before_restore} seen before it"
    );
}
