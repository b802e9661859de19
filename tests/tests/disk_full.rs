//! SQLite on a full disk: writes answer 503 saying the disk is full, reads keep working (it is
//! not an outage: `reports_server_database_up` stays 1), and once space returns the database is
//! intact and writable. The disk is a small tmpfs mounted in a mount namespace of the server's
//! own (`unshare`), so nothing of the machine's is touched; the test fills and frees it from
//! inside that namespace (`nsenter`).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kube::api::{Api, ListParams, PostParams};
use reports_server_crds::PolicyReport;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use reports_server_tests::server::ServerProcess;

const NS: &str = "disk";
const TMPFS_SIZE: &str = "16m";
const PATIENCE: Duration = Duration::from_secs(20);
const FULL_DISK_CREATES: usize = 12;

fn report(name: &str, n: u64) -> PolicyReport {
    let mut r = pss_policy_report(&Subject::pod(NS, n), 1_700_000_000, &[n as usize % 19]);
    r.metadata.name = Some(name.into());
    r.metadata.namespace = Some(NS.into());
    r
}

/// Runs `script` in the server's mount namespace, where the small disk is mounted.
fn in_namespace(pid: u32, script: &str) -> String {
    let out = Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-m", "--", "sh", "-c", script])
        .output()
        .expect("nsenter (util-linux) runs");
    assert!(
        out.status.success(),
        "{script} in the server's mount namespace: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn check_tools() {
    for tool in ["unshare", "nsenter", "sqlite3"] {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).exists()))
            .unwrap_or(false);
        assert!(
            found,
            "{tool} not found: apt-get install -y util-linux sqlite3"
        );
    }
}

async fn start_on_small_disk(dir: &Path, small: &Path) -> ServerProcess {
    std::fs::create_dir_all(small).unwrap();
    let url = format!("sqlite://{}/reports.db?mode=rwc", small.display());
    let mount = format!(
        "mount -t tmpfs -o size={TMPFS_SIZE} tmpfs {} && exec \"$0\" \"$@\"",
        small.display()
    );
    let launcher = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        &mount,
    ];
    ServerProcess::start_launched(dir, Some(url), &[], &launcher)
        .await
        .expect("a server on a tmpfs of its own (unshare needs CAP_SYS_ADMIN: run as root)")
}

#[tokio::test]
async fn sqlite_on_a_full_disk_refuses_writes_keeps_reading_and_recovers() {
    check_tools();
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small");
    let server = start_on_small_disk(dir.path(), &small).await;
    let pid = server.pid().expect("running");
    let client = server.client_without_retries().await.unwrap();
    let api: Api<PolicyReport> = Api::namespaced(client.clone(), NS);
    let mut stored = Vec::new();
    for n in 0..20 {
        let name = format!("before-{n:02}");
        api.create(&PostParams::default(), &report(&name, n))
            .await
            .unwrap_or_else(|e| panic!("create {name} with space left: {e}"));
        stored.push(name);
    }

    // Fill the disk: dd stops at ENOSPC.
    let small_dir = small.display().to_string();
    in_namespace(
        pid,
        &format!("dd if=/dev/zero of={small_dir}/filler bs=64k 2>/dev/null; true"),
    );
    let (mut disk_full, mut refused) = (0, Vec::new());
    for n in 0..FULL_DISK_CREATES as u64 {
        let name = format!("full-{n:02}");
        match api.create(&PostParams::default(), &report(&name, n)).await {
            Ok(_) => stored.push(name),
            Err(kube::Error::Api(s)) if s.code == 503 => {
                assert_eq!(s.reason, "ServiceUnavailable", "{s:?}");
                if s.message.contains("disk") {
                    disk_full += 1;
                }
                refused.push(name);
            }
            Err(e) => panic!("create {name} on a full disk: expected 201 or 503, got {e}"),
        }
    }
    println!(
        "[disk] on the full disk: {} creates stored (free pages), {} refused, {disk_full} saying the disk is full",
        FULL_DISK_CREATES - refused.len(),
        refused.len()
    );
    assert!(
        disk_full > 0,
        "no create on the full disk answered 503 naming the disk; the server log:\n{}",
        server.log_tail()
    );

    // Reads keep working, and it is not an outage.
    let listed = api
        .list(&ListParams::default())
        .await
        .expect("list on a full disk");
    // Every acknowledged create is visible to every reader: a failed transaction once left its
    // connection inside a transaction that never committed, and the writes acknowledged on it
    // after the disk filled were seen by some connections and not others (see store::Writer).
    assert_eq!(
        listed.items.len(),
        stored.len(),
        "every stored report listed"
    );
    for name in &stored {
        api.get(name)
            .await
            .unwrap_or_else(|e| panic!("acknowledged {name} on the full disk: {e}"));
    }
    let metrics = client
        .request_text(http::Request::get("/metrics").body(Vec::new()).unwrap())
        .await
        .unwrap();
    assert!(
        metrics.contains("reports_server_database_up 1"),
        "a full disk is not an outage: reads are served"
    );

    // Space returns: writes succeed again, on an intact database.
    in_namespace(pid, &format!("rm {small_dir}/filler"));
    let deadline = Instant::now() + PATIENCE;
    loop {
        match api
            .create(&PostParams::default(), &report("after", 99))
            .await
        {
            Ok(_) => break,
            Err(kube::Error::Api(s)) if s.code == 503 && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("create once space returned: {e}"),
        }
    }
    stored.push("after".into());
    for name in &stored {
        api.get(name)
            .await
            .unwrap_or_else(|e| panic!("acknowledged {name} after the disk filled: {e}"));
    }
    for name in &refused {
        assert!(
            api.get(name).await.is_err(),
            "{name} was refused with 503 but is stored"
        );
    }
    let check = in_namespace(
        pid,
        &format!("sqlite3 {small_dir}/reports.db 'PRAGMA integrity_check'"),
    );
    assert_eq!(check.trim(), "ok", "integrity_check after the disk filled");
}
