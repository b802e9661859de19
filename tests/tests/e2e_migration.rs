//! Migration from etcd-backed report CRDs into the database, end to end: a real kube-apiserver
//! with the report CRDs installed and reports stored in etcd, `reports-server migrate
//! to-database` (the path without the operator) while a writer creates, updates and deletes
//! reports through kube-apiserver and a kube-rs reflector watches them, then:
//! * every preloaded object is served by us through kube-apiserver with the content it had in
//!   etcd (everything but `resourceVersion`), counted per kind;
//! * the writer's log and the served state agree name by name (writes refused by the fence are
//!   retried by the writer and counted);
//! * the reflector's cache equals the server's state;
//! * kube-controller-manager's garbage collector deletes a migrated report whose owner goes;
//! * `--dry-run` before changed nothing; a second run finds everything switched;
//! * `reports-server migrate to-crds` (the way back) while the writer writes again returns every
//!   object to etcd (content compared, counted), the writer's log agrees with etcd, the
//!   APIServices are Local again and a report the garbage collector deleted while we served it
//!   does not come back from its stale copy in etcd.
//!
//! Size: `REPORTS_SERVER_MIGRATION_E2E_REPORTS` PolicyReports (default 10,000) and a fifth as
//! many EphemeralReports. Needs what `e2e_aggregated` needs (docs/e2e.md).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
use kube::core::ObjectMeta;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use reports_server_crds::ResourceDescriptor;
use reports_server_crds::catalog::{EPHEMERAL_REPORT, POLICY_REPORT};
use reports_server_crds::fixtures::{Subject, pss_ephemeral_report, pss_policy_report};
use reports_server_tests::controlplane::{ControlPlane, ControlPlaneOptions};
use reports_server_tests::delegated::{
    self, API_SERVICES, SERVICE_NAME, SERVICE_NAMESPACE, Server,
};
use reports_server_tests::kubectl::Kubectl;
use reports_server_tests::server;
use serde_json::{Value, json};

const NAMESPACES: usize = 30;
const CHURN_NAMESPACE: &str = "churn";
const CHURN_NAMES: usize = 40;

fn api_resource(r: &ResourceDescriptor) -> ApiResource {
    reports_server_tests::objects::api_resource(r)
}

fn without_version(mut v: Value) -> Value {
    if let Some(m) = v["metadata"].as_object_mut() {
        m.remove("resourceVersion");
    }
    v
}

/// Every object of `r` through kube-apiserver, by namespace/name.
async fn list_all(
    client: &kube::Client,
    r: &ResourceDescriptor,
) -> Result<(BTreeMap<String, Value>, String)> {
    let mut out = BTreeMap::new();
    let mut token: Option<String> = None;
    let mut rv = String::new();
    loop {
        let mut path = format!("/apis/{}/{}/{}?limit=500", r.group, r.version, r.plural);
        if let Some(t) = &token {
            path.push_str(&format!("&continue={}", urlencode(t)));
        }
        let list: Value = client
            .request(http::Request::get(&path).body(Vec::new())?)
            .await
            .with_context(|| format!("GET {path}"))?;
        if token.is_none() {
            rv = list["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or("")
                .to_owned();
        }
        for item in list["items"].as_array().into_iter().flatten() {
            let key = format!(
                "{}/{}",
                item["metadata"]["namespace"].as_str().unwrap_or(""),
                item["metadata"]["name"].as_str().unwrap_or("")
            );
            out.insert(key, item.clone());
        }
        let next = list["metadata"]["continue"]
            .as_str()
            .filter(|t| !t.is_empty())
            .map(str::to_owned);
        match next {
            None => return Ok((out, rv)),
            // A server that hands the same token back would keep this loop (and CI) busy forever.
            Some(t) if token.as_ref() == Some(&t) => {
                bail!("GET {path} answered its own continue token again")
            }
            Some(t) => token = Some(t),
        }
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Creates `objects` through kube-apiserver, `parallel` at a time.
async fn create_all(
    client: &kube::Client,
    r: &ResourceDescriptor,
    objects: Vec<Value>,
    parallel: usize,
) -> Result<()> {
    let ar = api_resource(r);
    let total = objects.len();
    let t = Instant::now();
    let results: Vec<Result<()>> = futures::stream::iter(objects)
        .map(|o| {
            let ns = o["metadata"]["namespace"].as_str().unwrap_or("").to_owned();
            let api: Api<DynamicObject> = if r.namespaced {
                Api::namespaced_with(client.clone(), &ns, &ar)
            } else {
                Api::all_with(client.clone(), &ar)
            };
            async move {
                let obj: DynamicObject = serde_json::from_value(o)?;
                api.create(&PostParams::default(), &obj).await?;
                Ok(())
            }
        })
        .buffer_unordered(parallel)
        .collect()
        .await;
    for r in results {
        r?;
    }
    eprintln!(
        "[e2e] created {total} {} in etcd in {:.1?} ({:.0}/s)",
        r.plural,
        t.elapsed(),
        total as f64 / t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn fixture_reports(n: usize) -> (Vec<Value>, Vec<Value>) {
    let mut policy = Vec::with_capacity(n);
    let mut ephemeral = Vec::with_capacity(n / 5);
    for i in 0..n {
        let subject = Subject::pod(&format!("mig-{}", i % NAMESPACES), i as u64);
        let mut v = serde_json::to_value(pss_policy_report(
            &subject,
            1_700_000_000 + i as i64,
            &[i % 19],
        ))
        .unwrap();
        // The pods do not exist: without this the garbage collector would delete the reports.
        v["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("ownerReferences");
        v["apiVersion"] = json!(POLICY_REPORT.api_version());
        v["kind"] = json!(POLICY_REPORT.kind);
        policy.push(v);
        if i % 5 == 0 {
            let mut e =
                serde_json::to_value(pss_ephemeral_report(&subject, 1_700_000_000, &[])).unwrap();
            e["metadata"]
                .as_object_mut()
                .unwrap()
                .remove("ownerReferences");
            e["apiVersion"] = json!(EPHEMERAL_REPORT.api_version());
            e["kind"] = json!(EPHEMERAL_REPORT.kind);
            ephemeral.push(e);
        }
    }
    (policy, ephemeral)
}

/// What the writer knows it did, name by name: `Some(seq)` when the report exists with label
/// `seq`, `None` when it was deleted (or never created).
#[derive(Default)]
struct WriterLog {
    state: BTreeMap<String, Option<u64>>,
    acknowledged: u64,
    refused_by_fence: u64,
    other_errors: u64,
    /// Acknowledged writes while the migration ran.
    during_migration: u64,
}

fn churn_report(name: &str, seq: u64) -> Value {
    json!({
        "apiVersion": POLICY_REPORT.api_version(),
        "kind": POLICY_REPORT.kind,
        "metadata": {"name": name, "namespace": CHURN_NAMESPACE, "labels": {"seq": seq.to_string()}},
        "summary": {"pass": seq as i64, "fail": 0, "warn": 0, "error": 0, "skip": 0},
    })
}

impl WriterLog {
    /// What the writer expects to exist: `churn/<name>` → its `seq` label.
    fn expected(&self) -> BTreeMap<String, u64> {
        self.state
            .iter()
            .filter_map(|(n, s)| s.map(|s| (format!("{CHURN_NAMESPACE}/{n}"), s)))
            .collect()
    }
}

/// The writer's reports in `objects` (keyed `namespace/name`): `churn/<name>` → `seq` label.
fn churn_state(objects: &BTreeMap<String, Value>) -> BTreeMap<String, u64> {
    objects
        .iter()
        .filter(|(k, _)| k.starts_with(&format!("{CHURN_NAMESPACE}/")))
        .map(|(k, v)| {
            (
                k.clone(),
                v["metadata"]["labels"]["seq"]
                    .as_str()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0),
            )
        })
        .collect()
}

/// An object without what CRD storage assigns on create (compared across a hand-back).
fn portable(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(m) = v["metadata"].as_object_mut() {
        for f in [
            "resourceVersion",
            "uid",
            "creationTimestamp",
            "generation",
            "managedFields",
        ] {
            m.remove(f);
        }
    }
    v
}

/// A kube-rs reflector on PolicyReports (as a client-go informer would hold them), ready; the
/// counter counts its (re)lists.
async fn spawn_reflector(
    client: &kube::Client,
) -> Result<(
    reflector::Store<DynamicObject>,
    tokio::task::JoinHandle<()>,
    Arc<AtomicU64>,
)> {
    let store_writer = reflector::store::Writer::<DynamicObject>::new(api_resource(&POLICY_REPORT));
    let reader = store_writer.as_reader();
    let relists = Arc::new(AtomicU64::new(0));
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &api_resource(&POLICY_REPORT));
    let counter = relists.clone();
    let task = tokio::spawn(async move {
        let stream = reflector(
            store_writer,
            watcher(api, watcher::Config::default()).default_backoff(),
        );
        futures::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            if let Ok(watcher::Event::Init) = event {
                counter.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    reader.wait_until_ready().await?;
    Ok((reader, task, relists))
}

/// Waits (60 s at most) until a reflector's cache equals what the server lists, by name and
/// resourceVersion.
async fn reflector_matches(
    client: &kube::Client,
    reader: &reflector::Store<DynamicObject>,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (now, _) = list_all(client, &POLICY_REPORT).await?;
        let cached: BTreeMap<String, String> = reader
            .state()
            .iter()
            .map(|o| {
                (
                    format!(
                        "{}/{}",
                        o.metadata.namespace.clone().unwrap_or_default(),
                        o.metadata.name.clone().unwrap_or_default()
                    ),
                    o.metadata.resource_version.clone().unwrap_or_default(),
                )
            })
            .collect();
        let served: BTreeMap<String, String> = now
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap_or("")
                        .to_owned(),
                )
            })
            .collect();
        if cached == served {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the reflector's cache ({} objects) never matched the server's {} objects",
                cached.len(),
                served.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Creates, updates and deletes reports in `churn` through kube-apiserver until `stop`.
async fn writer(
    client: kube::Client,
    stop: Arc<AtomicBool>,
    migrating: Arc<AtomicBool>,
    log: Arc<Mutex<WriterLog>>,
) {
    let ar = api_resource(&POLICY_REPORT);
    let api: Api<DynamicObject> = Api::namespaced_with(client, CHURN_NAMESPACE, &ar);
    let mut seq = 0u64;
    let mut uncertain: BTreeSet<String> = BTreeSet::new();
    // xorshift: a spread of names without a dependency on a random crate.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    while !stop.load(Ordering::SeqCst) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let name = format!("w-{}", x % CHURN_NAMES as u64);
        if uncertain.contains(&name) {
            // An earlier write's outcome is unknown: learn it before writing again — but not
            // while a migration runs: during a hand-back kube-apiserver serves the CRD storage
            // as it is being filled, so a read may miss an object that exists.
            if migrating.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            match api.get_opt(&name).await {
                Ok(found) => {
                    let seq = found.and_then(|o| o.metadata.labels?.get("seq")?.parse().ok());
                    log.lock().unwrap().state.insert(name.clone(), seq);
                    uncertain.remove(&name);
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            }
        }
        seq += 1;
        let current = log.lock().unwrap().state.get(&name).copied().flatten();
        let (result, after) = match current {
            None => {
                let obj: DynamicObject = serde_json::from_value(churn_report(&name, seq)).unwrap();
                (
                    api.create(&PostParams::default(), &obj).await.map(|_| ()),
                    Some(seq),
                )
            }
            Some(_) if seq.is_multiple_of(3) => (
                api.delete(&name, &DeleteParams::default())
                    .await
                    .map(|_| ()),
                None,
            ),
            Some(_) => {
                let patch = json!({"metadata": {"labels": {"seq": seq.to_string()}}, "summary": {"pass": seq as i64}});
                (
                    api.patch(
                        &name,
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::Merge(&patch),
                    )
                    .await
                    .map(|_| ()),
                    Some(seq),
                )
            }
        };
        let refused = {
            let mut l = log.lock().unwrap();
            match result {
                Ok(()) => {
                    l.state.insert(name, after);
                    l.acknowledged += 1;
                    if migrating.load(Ordering::SeqCst) {
                        l.during_migration += 1;
                    }
                    false
                }
                Err(kube::Error::Api(s))
                    if s.message.contains("reports-server-migration-fence") =>
                {
                    l.refused_by_fence += 1;
                    true
                }
                Err(e) => {
                    l.other_errors += 1;
                    eprintln!(
                        "[e2e] writer: {name}: {e} (outcome unknown; read back before the next write)"
                    );
                    uncertain.insert(name);
                    false
                }
            }
        };
        if refused {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Outcomes still unknown are learnt now, after the migration.
    for name in uncertain {
        loop {
            match api.get_opt(&name).await {
                Ok(found) => {
                    let seq = found.and_then(|o| o.metadata.labels?.get("seq")?.parse().ok());
                    log.lock().unwrap().state.insert(name, seq);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

/// A control plane with the report CRDs, `n` PolicyReports (and a fifth as many
/// EphemeralReports, and one PolicyReport owned by a ConfigMap in `gc`) in etcd, and our server
/// running (not routed to yet) behind an ExternalName Service.
struct Env {
    bin: std::path::PathBuf,
    cp: ControlPlane,
    admin: Kubectl,
    client: kube::Client,
    server: Server,
    database_url: String,
    n_policy: usize,
    n_ephemeral: usize,
    etcd_policy: BTreeMap<String, Value>,
    etcd_ephemeral: BTreeMap<String, Value>,
}

fn report_count(default: usize) -> Result<usize> {
    Ok(std::env::var("REPORTS_SERVER_MIGRATION_E2E_REPORTS")
        .ok()
        .map(|v| {
            v.parse()
                .context("REPORTS_SERVER_MIGRATION_E2E_REPORTS must be a number")
        })
        .transpose()?
        .unwrap_or(default))
}

/// One control plane at a time: two on two cores make the timing-sensitive steps flaky.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn setup(n: usize) -> Result<Env> {
    let bin = server::binary().context("building reports-server")?;
    let cp = ControlPlane::start(ControlPlaneOptions::with_controller_manager())
        .await
        .context("starting the e2e control plane (see docs/e2e.md)")?;
    let admin = Kubectl::new(cp.kubeconfig_path());
    let client = cp.client().await?;

    // The report CRDs, as a cluster with Kyverno's CRDs has them.
    let crds = Command::new(&bin).arg("crds").output()?;
    ensure!(crds.status.success(), "reports-server crds failed");
    admin.run_with_stdin(
        &["apply", "--server-side", "-f", "-"],
        Some(&String::from_utf8(crds.stdout)?),
    )?;
    admin.run(&[
        "wait",
        "--for=condition=Established",
        "crd",
        "--all",
        "--timeout=60s",
    ])?;
    for name in API_SERVICES {
        cp.wait_apiservice_available(name, Duration::from_secs(60))
            .await?;
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for ns in (0..NAMESPACES)
        .map(|i| format!("mig-{i}"))
        .chain([CHURN_NAMESPACE.to_owned(), "gc".to_owned()])
    {
        namespaces
            .create(
                &PostParams::default(),
                &Namespace {
                    metadata: ObjectMeta {
                        name: Some(ns),
                        ..Default::default()
                    },
                    ..Default::default()
                },
            )
            .await?;
    }

    // Preload etcd.
    let (policy, ephemeral) = fixture_reports(n);
    let (n_policy, n_ephemeral) = (policy.len(), ephemeral.len());
    create_all(&client, &POLICY_REPORT, policy, 8).await?;
    create_all(&client, &EPHEMERAL_REPORT, ephemeral, 8).await?;
    // A report owned by a real ConfigMap, for the garbage collector after the move.
    let owner = Api::<ConfigMap>::namespaced(client.clone(), "gc")
        .create(
            &PostParams::default(),
            &ConfigMap {
                metadata: ObjectMeta {
                    name: Some("owner".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;
    let mut owned = churn_report("owned", 0);
    owned["metadata"]["namespace"] = json!("gc");
    owned["metadata"]["ownerReferences"] = json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}]);
    create_all(&client, &POLICY_REPORT, vec![owned], 1).await?;
    let (etcd_policy, _) = list_all(&client, &POLICY_REPORT).await?;
    let (etcd_ephemeral, _) = list_all(&client, &EPHEMERAL_REPORT).await?;
    ensure!(
        etcd_policy.len() == n_policy + 1 && etcd_ephemeral.len() == n_ephemeral,
        "preload: {} policy, {} ephemeral in etcd",
        etcd_policy.len(),
        etcd_ephemeral.len()
    );

    // Our server, not yet routed to (aggregation off: it would merge the copied ephemeral
    // reports before the switch, and the copy must equal the source).
    let server = Server::start_with(
        &cp,
        &cp.dir().join("reports-server"),
        &["--aggregation=false"],
    )
    .await?;
    admin.run_with_stdin(
        &["apply", "-f", "-"],
        Some(&format!(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {SERVICE_NAMESPACE}\n---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {SERVICE_NAME}\n  namespace: {SERVICE_NAMESPACE}\nspec:\n  type: ExternalName\n  externalName: localhost\n  ports:\n  - name: https\n    port: {}\n",
            server.port
        )),
    )?;
    let database_url = server
        .args
        .iter()
        .skip_while(|a| *a != "--database-url")
        .nth(1)
        .cloned()
        .context("the server's --database-url")?;
    Ok(Env {
        bin,
        cp,
        admin,
        client,
        server,
        database_url,
        n_policy,
        n_ephemeral,
        etcd_policy,
        etcd_ephemeral,
    })
}

impl Env {
    /// `reports-server migrate <direction> …` against this cluster, database and Service.
    fn migrate(&self, direction: &str, extra: &[&str]) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.args(["migrate", direction, "--kubeconfig"])
            .arg(self.cp.kubeconfig_path())
            .args(["--database-url", &self.database_url])
            .args([
                "--service-namespace",
                SERVICE_NAMESPACE,
                "--service-name",
                SERVICE_NAME,
            ]);
        if direction == "to-database" {
            cmd.args(["--service-port", &self.server.port.to_string()])
                .arg("--ca-bundle-file")
                .arg(self.cp.ca_cert_path());
        }
        cmd.args(extra).env("REPORTS_SERVER_LOG", "info");
        cmd
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_to_database_loses_nothing() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let env = setup(report_count(10_000)?).await?;
    let Env {
        bin: _,
        cp,
        admin,
        client,
        server,
        database_url: _,
        n_policy,
        n_ephemeral,
        etcd_policy,
        etcd_ephemeral,
    } = &env;
    let (n_policy, n_ephemeral) = (*n_policy, *n_ephemeral);
    let migrate = |extra: &[&str]| env.migrate("to-database", extra);

    // --dry-run changes nothing.
    let out = migrate(&["--dry-run"]).output()?;
    ensure!(
        out.status.success(),
        "migrate --dry-run failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dry: Value =
        serde_json::from_slice(&out.stdout).context("--dry-run prints its report as JSON")?;
    let planned: u64 = dry["kinds"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|k| k["total"].as_u64().unwrap_or(0))
        .sum();
    ensure!(
        planned as usize == n_policy + 1 + n_ephemeral,
        "dry run planned {planned} objects:\n{dry:#}"
    );
    for name in API_SERVICES {
        let a = admin.run(&["get", "apiservice", name, "-o", "json"])?;
        let a: Value = serde_json::from_str(&a)?;
        ensure!(
            a["spec"]["service"].is_null(),
            "--dry-run changed APIService {name}: {a:#}"
        );
    }
    let (served, _) = list_all(client, &POLICY_REPORT).await?;
    ensure!(&served == etcd_policy, "--dry-run changed what etcd serves");
    let vap = admin.output(
        &[
            "get",
            "validatingadmissionpolicy",
            "reports-server-migration-fence",
        ],
        None,
    )?;
    ensure!(!vap.status.success(), "--dry-run left a fence");

    // The writer and the reflector run before, during and after the migration. The writer is a
    // user of its own: the hand-back's fence lets the migration's own user (the admin) through.
    let writer_client = cp
        .user_client("e2e-report-writer", &["system:masters"])
        .await?;

    let stop = Arc::new(AtomicBool::new(false));
    let migrating = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(WriterLog::default()));
    let writer_task = tokio::spawn(writer(
        writer_client.clone(),
        stop.clone(),
        migrating.clone(),
        log.clone(),
    ));
    let (reader, reflector_task, relists) = spawn_reflector(client).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    migrating.store(true, Ordering::SeqCst);
    let t = Instant::now();
    let out = migrate(&[]).output()?;
    let migration_wall = t.elapsed();
    migrating.store(false, Ordering::SeqCst);
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success(),
        "migrate to-database failed:\n{stderr}\n{}",
        delegated::diagnostics(cp, server)
    );
    let report: Value =
        serde_json::from_slice(&out.stdout).context("the migration prints its report as JSON")?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::SeqCst);
    writer_task.await?;

    // Routed to us.
    for name in API_SERVICES {
        let a: Value =
            serde_json::from_str(&admin.run(&["get", "apiservice", name, "-o", "json"])?)?;
        ensure!(
            a["spec"]["service"]["name"] == SERVICE_NAME,
            "APIService {name} not switched: {a:#}"
        );
        ensure!(
            a["metadata"]["labels"]["kube-aggregator.kubernetes.io/automanaged"].is_null(),
            "{name} is still automanaged"
        );
    }
    let floor = report["versionFloor"].as_i64().context("versionFloor")?;
    let (ours_policy, list_rv) = list_all(client, &POLICY_REPORT).await?;
    ensure!(
        list_rv.parse::<i64>()? >= floor,
        "the list after the switch came from etcd (resourceVersion {list_rv} < floor {floor})"
    );
    let (ours_ephemeral, _) = list_all(client, &EPHEMERAL_REPORT).await?;

    // Every preloaded object, identical but for resourceVersion.
    let mut compared = 0;
    for (source, ours) in [
        (&etcd_policy, &ours_policy),
        (&etcd_ephemeral, &ours_ephemeral),
    ] {
        for (key, object) in source
            .iter()
            .filter(|(k, _)| !k.starts_with(&format!("{CHURN_NAMESPACE}/")))
        {
            let Some(found) = ours.get(key) else {
                bail!("{key} was not migrated")
            };
            ensure!(
                without_version(found.clone()) == without_version(object.clone()),
                "{key} differs after migration:\n etcd: {object}\n ours: {found}"
            );
            compared += 1;
        }
    }
    ensure!(
        ours_ephemeral.len() == n_ephemeral,
        "{} ephemeral reports served, {n_ephemeral} expected",
        ours_ephemeral.len()
    );

    // The writer's log, name by name.
    let shared_log = log.clone();
    let log = std::mem::take(&mut *log.lock().unwrap());
    shared_log.lock().unwrap().state = log.state.clone();
    let expected = log.expected();
    let actual = churn_state(&ours_policy);
    ensure!(
        actual == expected,
        "the writer's log and the server disagree:\n log:    {expected:?}\n server: {actual:?}"
    );

    // The reflector converges on the server's state.
    reflector_matches(client, &reader).await?;
    reflector_task.abort();

    eprintln!(
        "[e2e] migration figures: {} objects compared identical; copy {:.0} objects/s ({:.1} s); writes refused by the fence for {:.1} s; switch {:.1} s; migration wall time {:.1?}; writer: {} acknowledged ({} during the migration), {} refused by the fence and retried, {} other errors; reflector relists: {}",
        compared,
        report["copyObjectsPerSecond"].as_f64().unwrap_or(0.0),
        report["copySeconds"].as_f64().unwrap_or(0.0),
        report["fenceSeconds"].as_f64().unwrap_or(0.0),
        report["switchSeconds"].as_f64().unwrap_or(0.0),
        migration_wall,
        log.acknowledged,
        log.during_migration,
        log.refused_by_fence,
        log.other_errors,
        relists.load(Ordering::SeqCst)
    );
    ensure!(
        log.during_migration > 0,
        "the writer made no write during the migration"
    );

    // The garbage collector still works on migrated reports.
    Api::<ConfigMap>::namespaced(client.clone(), "gc")
        .delete("owner", &DeleteParams::default())
        .await?;
    let gc_api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), "gc", &api_resource(&POLICY_REPORT));
    let deadline = Instant::now() + Duration::from_secs(90);
    while gc_api.get_opt("owned").await?.is_some() {
        ensure!(
            Instant::now() < deadline,
            "the garbage collector did not delete the migrated report of a deleted owner"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // A second run finds everything switched and changes nothing.
    let out = migrate(&[]).output()?;
    ensure!(
        out.status.success(),
        "a second migrate to-database failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let again: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        again["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|g| g["stateBefore"] == "Switched"),
        "second run: {again:#}"
    );

    // The way back: `migrate to-crds` while the writer writes again.
    let to_crds = |extra: &[&str]| env.migrate("to-crds", extra);
    let out = to_crds(&["--dry-run"]).output()?;
    ensure!(
        out.status.success(),
        "to-crds --dry-run failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in API_SERVICES {
        let a: Value =
            serde_json::from_str(&admin.run(&["get", "apiservice", name, "-o", "json"])?)?;
        ensure!(
            a["spec"]["service"]["name"] == SERVICE_NAME,
            "to-crds --dry-run changed APIService {name}"
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writer_task = tokio::spawn(writer(
        writer_client.clone(),
        stop.clone(),
        migrating.clone(),
        shared_log.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (before, _) = list_all(client, &POLICY_REPORT).await?;
    migrating.store(true, Ordering::SeqCst);
    let t = Instant::now();
    let out = to_crds(&[]).output()?;
    let handback_wall = t.elapsed();
    migrating.store(false, Ordering::SeqCst);
    ensure!(
        out.status.success(),
        "migrate to-crds failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        delegated::diagnostics(cp, server)
    );
    let back: Value = serde_json::from_slice(&out.stdout)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::SeqCst);
    writer_task.await?;
    for name in API_SERVICES {
        let a: Value =
            serde_json::from_str(&admin.run(&["get", "apiservice", name, "-o", "json"])?)?;
        ensure!(
            a["spec"]["service"].is_null(),
            "APIService {name} not Local after to-crds: {a:#}"
        );
    }
    let (crd_policy, crd_rv) = list_all(client, &POLICY_REPORT).await?;
    ensure!(
        crd_rv.parse::<i64>()? < floor,
        "after to-crds the list still comes from us ({crd_rv})"
    );
    let (crd_ephemeral, _) = list_all(client, &EPHEMERAL_REPORT).await?;
    ensure!(
        crd_ephemeral.len() == ours_ephemeral.len(),
        "{} ephemeral reports back in etcd, {} expected",
        crd_ephemeral.len(),
        ours_ephemeral.len()
    );
    let mut returned = 0;
    for (key, object) in before
        .iter()
        .filter(|(k, _)| !k.starts_with(&format!("{CHURN_NAMESPACE}/")))
    {
        let Some(found) = crd_policy.get(key) else {
            bail!("{key} did not return to etcd")
        };
        ensure!(
            portable(found) == portable(object),
            "{key} differs after to-crds:\n ours: {object}\n etcd: {found}"
        );
        returned += 1;
    }
    for (key, object) in &ours_ephemeral {
        ensure!(
            crd_ephemeral.get(key).map(portable) == Some(portable(object)),
            "ephemeral {key} differs after to-crds"
        );
        returned += 1;
    }
    let log2 = std::mem::take(&mut *shared_log.lock().unwrap());
    let expected = log2.expected();
    let actual = churn_state(&crd_policy);
    ensure!(
        actual == expected,
        "after to-crds the writer's log and etcd disagree:\n log:  {expected:?}\n etcd: {actual:?}"
    );
    ensure!(
        !crd_policy.contains_key("gc/owned"),
        "the garbage-collected report came back from etcd's stale copy"
    );
    eprintln!(
        "[e2e] hand-back figures: {returned} objects compared; written back {:.0} objects/s ({:.1} s); writes refused for {:.1} s; switch {:.1} s; wall {:.1?}; writer: {} acknowledged ({} during the hand-back), {} refused by the fence, {} other errors",
        back["copyObjectsPerSecond"].as_f64().unwrap_or(0.0),
        back["copySeconds"].as_f64().unwrap_or(0.0),
        back["fenceSeconds"].as_f64().unwrap_or(0.0),
        back["switchSeconds"].as_f64().unwrap_or(0.0),
        handback_wall,
        log2.acknowledged,
        log2.during_migration,
        log2.refused_by_fence,
        log2.other_errors,
    );
    let vap = admin.output(
        &[
            "get",
            "validatingadmissionpolicy",
            "reports-server-migration-fence",
        ],
        None,
    )?;
    ensure!(!vap.status.success(), "to-crds left its fence");

    let Env { server, cp, .. } = env;
    drop(server);
    cp.stop().await?;
    Ok(())
}

/// Waits until `log` contains `marker`, or fails if `child` exits first.
async fn wait_for_marker(
    child: &mut std::process::Child,
    log: &std::path::Path,
    marker: &str,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if std::fs::read_to_string(log)
            .unwrap_or_default()
            .contains(marker)
        {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "the migration exited ({status}) before {marker:?}:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        ensure!(
            Instant::now() < deadline,
            "no {marker:?} in {} after 300 s",
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Everything preloaded is served by us, identical but for resourceVersion, counted.
async fn check_migrated(env: &Env, floor: i64) -> Result<usize> {
    let (policy, rv) = list_all(&env.client, &POLICY_REPORT).await?;
    ensure!(
        rv.parse::<i64>()? >= floor,
        "the list came from etcd (resourceVersion {rv} < floor {floor})"
    );
    let (ephemeral, _) = list_all(&env.client, &EPHEMERAL_REPORT).await?;
    ensure!(
        policy.len() == env.etcd_policy.len() && ephemeral.len() == env.etcd_ephemeral.len(),
        "{} policy and {} ephemeral reports served, {} and {} expected",
        policy.len(),
        ephemeral.len(),
        env.etcd_policy.len(),
        env.etcd_ephemeral.len()
    );
    for (source, ours) in [
        (&env.etcd_policy, &policy),
        (&env.etcd_ephemeral, &ephemeral),
    ] {
        for (key, object) in source {
            let found = ours
                .get(key)
                .with_context(|| format!("{key} was not migrated"))?;
            ensure!(
                without_version(found.clone()) == without_version(object.clone()),
                "{key} differs after migration"
            );
        }
    }
    Ok(policy.len() + ephemeral.len())
}

async fn fence_exists(env: &Env) -> Result<bool> {
    Ok(env
        .admin
        .output(
            &[
                "get",
                "validatingadmissionpolicybinding",
                "reports-server-migration-fence",
            ],
            None,
        )?
        .status
        .success())
}

/// SIGKILL of `migrate to-database` in each phase (copying, behind the fence, right after the
/// switch), then a run to the end: nothing lost, nothing duplicated, the fence gone; then the
/// same with the server killed right after the switch and started again 2 s later. Between
/// rounds `migrate to-crds` goes back to CRD storage, so every round starts from etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_resumes_after_a_kill_in_each_phase() -> Result<()> {
    let _serial = SERIAL.lock().await;
    // The kills must land while data is copied: 1,000 reports at the throttled rate leave time.
    let mut env = setup((report_count(10_000)? / 5).max(1_000)).await?;
    let rounds = [
        ("copy", "copied", false),
        ("fence", "fence up", false),
        ("switch", "APIService switched", false),
        ("server", "APIService switched", true),
    ];
    for (round, marker, kill_server) in rounds {
        let log = env.cp.dir().join(format!("migrate-{round}.log"));
        let mut child = env
            .migrate("to-database", &[])
            .stdout(Stdio::null())
            .stderr(File::create(&log)?)
            .spawn()?;
        wait_for_marker(&mut child, &log, marker).await?;
        let outcome = if kill_server {
            env.server.kill();
            tokio::time::sleep(Duration::from_secs(2)).await;
            env.server.restart().await?;
            let out = child.wait_with_output()?;
            ensure!(
                out.status.success(),
                "the migration did not survive a server restart:\n{}",
                std::fs::read_to_string(&log)?
            );
            "the migration finished across the server restart"
        } else {
            child.kill()?;
            child.wait()?;
            let out = env.migrate("to-database", &[]).output()?;
            ensure!(
                out.status.success(),
                "the run after a kill during {round} failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            "a second run finished it"
        };
        let floor: i64 = {
            let (_, rv) = list_all(&env.client, &POLICY_REPORT).await?;
            rv.parse()?
        };
        ensure!(
            floor > 1 << 32,
            "after the round {round} the list resourceVersion is {floor}: not ours"
        );
        let n = check_migrated(&env, 1 << 32).await?;
        ensure!(
            !fence_exists(&env).await?,
            "round {round}: the fence is still up"
        );
        eprintln!("[e2e] kill during {round}: {outcome}; {n} objects served identical, fence gone");
        // Back to CRD storage for the next round.
        let out = env.migrate("to-crds", &[]).output()?;
        ensure!(
            out.status.success(),
            "to-crds after round {round} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (back, rv) = list_all(&env.client, &POLICY_REPORT).await?;
        ensure!(
            rv.parse::<i64>()? < 1 << 32,
            "after to-crds the list still comes from us"
        );
        ensure!(
            back.len() == env.etcd_policy.len(),
            "{} policy reports back in etcd, {} expected",
            back.len(),
            env.etcd_policy.len()
        );
    }
    let Env { server, cp, .. } = env;
    drop(server);
    cp.stop().await?;
    Ok(())
}

/// Ends a migration for the writer, lets it write 2 s more, then stops it.
async fn stop_writer(
    migrating: &AtomicBool,
    stop: &AtomicBool,
    writer_task: tokio::task::JoinHandle<()>,
) -> Result<()> {
    migrating.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::SeqCst);
    Ok(writer_task.await?)
}

/// Reads the migration mailbox's `phase` (what the server's worker last published).
fn mailbox_phase(admin: &Kubectl) -> String {
    admin
        .output(
            &[
                "get",
                "configmap",
                "-n",
                SERVICE_NAMESPACE,
                "reports-server-migration",
                "-o",
                "jsonpath={.data.phase}",
            ],
            None,
        )
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// The operator as a child process (admin credentials), logging to `log`.
fn start_operator(env: &Env, log: &std::path::Path) -> Result<std::process::Child> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let mut cmd = Command::new(&env.bin);
    cmd.args(["operator", "--kubeconfig"])
        .arg(env.cp.kubeconfig_path())
        .args([
            "--metrics-address",
            &format!("127.0.0.1:{}", server::free_port()),
        ])
        .args([
            "--lease-namespace",
            SERVICE_NAMESPACE,
            "--pod-name",
            "e2e-operator",
        ])
        .args([
            "--lease-duration-seconds",
            "4",
            "--lease-retry-seconds",
            "1",
        ])
        .args(["--progress-requeue-seconds", "1"])
        .env("REPORTS_SERVER_LOG", "info")
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file);
    Ok(reports_server_tests::controlplane::spawn_tied_to_test(cmd)?)
}

/// The migration the operator's way: a ReportsServer (external mode: the server runs here with
/// `serve --migrate-from-crds`, its migration worker driven by the operator's mailbox) adopts a
/// cluster whose reports are in etcd while the writer and a reflector run, with SIGKILLs of the
/// operator and of the server while data moves; then deleting the ReportsServer hands every
/// report back to etcd while the writer writes again (the operator killed once meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_moves_reports_in_and_hands_them_back_on_delete() -> Result<()> {
    let _serial = SERIAL.lock().await;
    // A tenth of the main test's size: the kills, not the volume, are what this test is about;
    // at least 500, so that the copy lasts long enough for them (5 s at the throttled rate).
    let mut env = setup((report_count(10_000)? / 10).max(500)).await?;
    let client = env.client.clone();

    // The ReportsServer CRD (from install.yaml) and the operator.
    let crd = reports_server_tests::operator::yaml_docs(
        &reports_server_tests::operator::manifest("install.yaml")?,
    )?
    .into_iter()
    .find(|d| d["kind"] == "CustomResourceDefinition")
    .context("install.yaml has the ReportsServer CRD")?;
    env.admin.run_with_stdin(
        &["apply", "--server-side", "-f", "-"],
        Some(&serde_json::to_string(&crd)?),
    )?;
    env.admin.run(&[
        "wait",
        "--for=condition=Established",
        "crd/reportsservers.reportsserver.io",
        "--timeout=60s",
    ])?;
    let operator_log = env.cp.dir().join("operator.log");
    let mut operator = start_operator(&env, &operator_log)?;
    let rs = json!({
        "apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
        "metadata": {"name": "reports-server", "namespace": SERVICE_NAMESPACE},
        "spec": {"external": {"host": "localhost", "port": env.server.port, "caBundle": env.cp.ca_pem()}},
    });
    env.admin
        .run_with_stdin(&["apply", "-f", "-"], Some(&rs.to_string()))?;

    // The groups are Local with reports in etcd: the operator leaves them to the migration.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let rs = reports_server_tests::operator::rs_json(&env.admin)?;
        let ready = reports_server_tests::operator::condition(&rs, "Ready").cloned();
        if ready.as_ref().is_some_and(|c| c["reason"] == "Migrating") {
            ensure!(
                reports_server_tests::operator::condition(&rs, "Degraded")
                    .is_some_and(|c| c["status"] == "False"),
                "a migration is not a fault: {rs:#}"
            );
            break;
        }
        ensure!(Instant::now() < deadline, "never Migrating: {rs:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for name in API_SERVICES {
        let a: Value =
            serde_json::from_str(&env.admin.run(&["get", "apiservice", name, "-o", "json"])?)?;
        ensure!(
            a["spec"]["service"].is_null(),
            "{name} switched before the copy: {a:#}"
        );
    }

    // The writer, the reflector, then the server with its migration worker.
    let writer_client = env
        .cp
        .user_client("e2e-report-writer", &["system:masters"])
        .await?;
    let stop = Arc::new(AtomicBool::new(false));
    let migrating = Arc::new(AtomicBool::new(true));
    let log = Arc::new(Mutex::new(WriterLog::default()));
    let writer_task = tokio::spawn(writer(
        writer_client.clone(),
        stop.clone(),
        migrating.clone(),
        log.clone(),
    ));
    let (reader, reflector_task, relists) = spawn_reflector(&client).await?;
    let port = env.server.port.to_string();
    env.server.args.extend(
        [
            "--migrate-from-crds",
            "--migration-mailbox",
            &format!("{SERVICE_NAMESPACE}/reports-server-migration"),
            "--migration-service-namespace",
            SERVICE_NAMESPACE,
            "--migration-service-name",
            SERVICE_NAME,
            "--migration-service-port",
            &port,
            "--migration-ca-bundle-file",
            env.cp.ca_cert_path().to_str().context("CA path")?,
            "--migration-interval-seconds",
            "1",
            // Slow enough that the kills below land while data is copied.
            "--migration-rate",
            "100",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    let t = Instant::now();
    env.server.restart().await?;

    // SIGKILLs while data moves: the server and the operator during the copy, the server again
    // behind the fence when the worker is seen there.
    let mut kills: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut seen = String::new();
    let final_rs = loop {
        let phase = mailbox_phase(&env.admin);
        if phase != seen {
            eprintln!("[e2e] {:>6.1?} worker phase {phase}", t.elapsed());
            seen = phase.clone();
        }
        let did = |what: &str| kills.iter().any(|k| k.starts_with(what));
        if phase == "Copying" && !did("server during Copying") {
            env.server.kill();
            kills.push(format!("server during Copying at {:.1?}", t.elapsed()));
            tokio::time::sleep(Duration::from_secs(1)).await;
            env.server.restart().await?;
        } else if phase == "Copying" && !did("operator during Copying") {
            operator.kill()?;
            operator.wait()?;
            kills.push(format!("operator during Copying at {:.1?}", t.elapsed()));
            operator = start_operator(&env, &operator_log)?;
        } else if matches!(phase.as_str(), "Fencing" | "Verifying" | "Switching")
            && !did("server behind the fence")
        {
            env.server.kill();
            kills.push(format!(
                "server behind the fence ({phase}) at {:.1?}",
                t.elapsed()
            ));
            tokio::time::sleep(Duration::from_secs(1)).await;
            env.server.restart().await?;
        }
        let rs = reports_server_tests::operator::rs_json(&env.admin)?;
        if reports_server_tests::operator::condition(&rs, "Ready")
            .is_some_and(|c| c["status"] == "True")
        {
            break rs;
        }
        ensure!(
            Instant::now() < deadline,
            "the operator's migration did not finish in 600 s: {rs:#}\nserver log:\n{}",
            env.server.log_tail(60)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let wall = t.elapsed();
    stop_writer(&migrating, &stop, writer_task).await?;
    ensure!(
        kills.iter().any(|k| k.starts_with("server during")),
        "no kill happened during the copy (it was over before the first look): {kills:?}"
    );

    // Status: per kind, and every migration condition True.
    let m = &final_rs["status"]["migration"];
    ensure!(m["phase"] == "Complete", "status.migration: {m:#}");
    for c in m["conditions"].as_array().context("migration conditions")? {
        ensure!(c["status"] == "True", "migration condition not True: {c}");
    }
    let kind_total = |k: &str| {
        m["kinds"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|x| x["kind"] == k)
            .and_then(|x| x["total"].as_u64())
    };
    ensure!(
        kind_total("EphemeralReport") == Some(env.n_ephemeral as u64),
        "status.migration kinds: {m:#}"
    );
    for name in API_SERVICES {
        let a: Value =
            serde_json::from_str(&env.admin.run(&["get", "apiservice", name, "-o", "json"])?)?;
        ensure!(
            a["spec"]["service"]["name"] == SERVICE_NAME
                && a["metadata"]["annotations"]["reportsserver.io/owner"]
                    == format!("{SERVICE_NAMESPACE}/reports-server"),
            "{name} not switched and adopted: {a:#}"
        );
    }

    // Every preloaded object identical but for resourceVersion; the writer's log = the server.
    let (ours_policy, rv) = list_all(&client, &POLICY_REPORT).await?;
    ensure!(
        rv.parse::<i64>()? > 1 << 32,
        "the list came from etcd ({rv})"
    );
    let (ours_ephemeral, _) = list_all(&client, &EPHEMERAL_REPORT).await?;
    let mut compared = 0;
    for (source, ours) in [
        (&env.etcd_policy, &ours_policy),
        (&env.etcd_ephemeral, &ours_ephemeral),
    ] {
        for (key, object) in source {
            let found = ours
                .get(key)
                .with_context(|| format!("{key} was not migrated"))?;
            ensure!(
                without_version(found.clone()) == without_version(object.clone()),
                "{key} differs after the migration"
            );
            compared += 1;
        }
    }
    ensure!(
        ours_policy.len() - churn_state(&ours_policy).len() == env.etcd_policy.len()
            && ours_ephemeral.len() == env.etcd_ephemeral.len(),
        "extra objects after the migration"
    );
    let written = std::mem::take(&mut *log.lock().unwrap());
    ensure!(
        churn_state(&ours_policy) == written.expected(),
        "the writer's log and the server disagree:\n log:    {:?}\n server: {:?}",
        written.expected(),
        churn_state(&ours_policy)
    );
    reflector_matches(&client, &reader).await?;
    reflector_task.abort();
    eprintln!(
        "[e2e] operator migration: {compared} objects identical; Ready after {wall:.1?}; last run {}; kills: {kills:?}; writer {} acknowledged ({} during), {} refused by the fence, {} other errors; reflector relists {}",
        m["lastRun"],
        written.acknowledged,
        written.during_migration,
        written.refused_by_fence,
        written.other_errors,
        relists.load(Ordering::SeqCst)
    );
    ensure!(
        written.during_migration > 0,
        "no write during the migration"
    );

    // Deleting the ReportsServer hands everything back while the writer writes again.
    let shared = Arc::new(Mutex::new(WriterLog {
        state: written.state.clone(),
        ..Default::default()
    }));
    let stop = Arc::new(AtomicBool::new(false));
    migrating.store(true, Ordering::SeqCst);
    let writer_task = tokio::spawn(writer(
        writer_client,
        stop.clone(),
        migrating.clone(),
        shared.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (before_policy, _) = list_all(&client, &POLICY_REPORT).await?;
    let t = Instant::now();
    env.admin.run(&[
        "delete",
        "rsrv",
        "-n",
        SERVICE_NAMESPACE,
        "reports-server",
        "--wait=false",
    ])?;
    let mut operator_killed = false;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let gone = !env
            .admin
            .output(
                &["get", "rsrv", "-n", SERVICE_NAMESPACE, "reports-server"],
                None,
            )?
            .status
            .success();
        if gone {
            break;
        }
        let phase = mailbox_phase(&env.admin);
        if phase != seen {
            eprintln!("[e2e] {:>6.1?} worker phase {phase}", t.elapsed());
            seen = phase.clone();
        }
        if !operator_killed && phase == "WritingBack" {
            operator.kill()?;
            operator.wait()?;
            operator_killed = true;
            operator = start_operator(&env, &operator_log)?;
        }
        ensure!(
            Instant::now() < deadline,
            "the ReportsServer was not deleted within 600 s\nserver log:\n{}",
            env.server.log_tail(60)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let handback_wall = t.elapsed();
    stop_writer(&migrating, &stop, writer_task).await?;
    for name in API_SERVICES {
        let a: Value =
            serde_json::from_str(&env.admin.run(&["get", "apiservice", name, "-o", "json"])?)?;
        ensure!(
            a["spec"]["service"].is_null()
                && a["metadata"]["annotations"]["reportsserver.io/owner"].is_null(),
            "{name} not handed back and released: {a:#}"
        );
    }
    let (crd_policy, crd_rv) = list_all(&client, &POLICY_REPORT).await?;
    ensure!(
        crd_rv.parse::<i64>()? < 1 << 32,
        "after the deletion the list still comes from us ({crd_rv})"
    );
    let (crd_ephemeral, _) = list_all(&client, &EPHEMERAL_REPORT).await?;
    let mut returned = 0;
    for (ours, theirs) in [
        (&before_policy, &crd_policy),
        (&ours_ephemeral, &crd_ephemeral),
    ] {
        for (key, object) in ours
            .iter()
            .filter(|(k, _)| !k.starts_with(&format!("{CHURN_NAMESPACE}/")))
        {
            ensure!(
                theirs.get(key).map(portable) == Some(portable(object)),
                "{key} did not come back to etcd as it was:\n ours: {object}\n etcd: {:?}",
                theirs.get(key)
            );
            returned += 1;
        }
    }
    ensure!(
        crd_ephemeral.len() == ours_ephemeral.len(),
        "{} ephemeral reports in etcd after the hand-back, {} expected",
        crd_ephemeral.len(),
        ours_ephemeral.len()
    );
    let back_log = std::mem::take(&mut *shared.lock().unwrap());
    ensure!(
        churn_state(&crd_policy) == back_log.expected(),
        "after the hand-back the writer's log and etcd disagree:\n log:  {:?}\n etcd: {:?}",
        back_log.expected(),
        churn_state(&crd_policy)
    );
    eprintln!(
        "[e2e] operator hand-back on delete: {returned} objects back in etcd, compared; deletion took {handback_wall:.1?}; operator killed while writing back: {operator_killed}; writer {} acknowledged ({} during), {} refused by the fence, {} other errors",
        back_log.acknowledged,
        back_log.during_migration,
        back_log.refused_by_fence,
        back_log.other_errors
    );
    operator.kill()?;
    let Env { server, cp, .. } = env;
    drop(server);
    cp.stop().await?;
    Ok(())
}
