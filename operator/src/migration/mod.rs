//! Moving reports from etcd-backed CRDs into the database without losing a write, and the
//! switch of each group's APIService to the server.
//!
//! Why it is built this way (docs/migration.md has the user's view):
//! * **Copy, then mirror.** Each kind is listed in pages and written in one transaction per page;
//!   a watch from the list's resourceVersion then applies every later change, so the copy
//!   stays current for as long as the copy of the other kinds takes.
//! * **A fence, not a race.** Before the switch a ValidatingAdmissionPolicy refuses writes to the
//!   report groups in the CRD storage for a few seconds. Behind it the copy is brought exactly in
//!   line with a fresh metadata list (fetch what changed, remove what is gone), verified object
//!   by object (content hashes), and only then are the APIServices switched. A write made
//!   before the fence is in the database; a write refused by the fence was never acknowledged
//!   and its client retries it against us. Without the fence, writes already on their way to
//!   etcd when the APIService flips could land after the last read and be stranded there.
//! * **Our versions above theirs.** Before the switch the store's resourceVersion counter and
//!   watch horizon jump far above the etcd revision ([`plan::version_floor`]), so a revision
//!   a client got from etcd gets 410 Gone from us and the client relists; it never resumes at
//!   a wrong place.
//! * **The cluster is the checkpoint.** Copying is idempotent (an object already stored as it
//!   is in the source is not written again), and the state of each group is read from the
//!   cluster on every run: Local APIService → copy; fence present and APIService routed to us →
//!   confirm and lift the fence. A crash or kill at any point is recovered by running again.
//! * **No HTTP types.** The engine writes through the registry, as every background worker does.

pub mod cluster;
pub mod mailbox;
pub mod plan;
pub mod worker;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::Instrument;

use futures::{StreamExt, TryStreamExt};
use kube::core::WatchEvent;
use reports_server_apiserver::registry::{Registry, RegistryError};
use reports_server_apiserver::store::{ListQuery, StoreError};
use reports_server_crds::ResourceDescriptor;
use reports_server_crds::catalog::{ALL, GROUP_VERSIONS};
use serde_json::Value;
use tokio::task::JoinHandle;

use cluster::Cluster;
use plan::{KindProgress, Ledger, ObjectKey, ServiceTarget};

/// Why a migration stopped.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("the source storage answered unexpectedly: {0}")]
    Source(String),
    #[error("database: {0}")]
    Registry(#[from] RegistryError),
    #[error("database: {0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    Refused(String),
    #[error("verification failed for {kind}: {count} difference(s), first: {first}")]
    Verification {
        kind: &'static str,
        count: usize,
        first: String,
    },
    #[error("{0}")]
    Timeout(String),
}

impl MigrationError {
    pub fn kube(what: impl Into<String>, source: kube::Error) -> Self {
        MigrationError::Kube {
            what: what.into(),
            source,
        }
    }
}

/// How a migration to the database runs.
#[derive(Clone, Debug)]
pub struct ToDatabaseOptions {
    /// Where the switched APIServices point.
    pub target: ServiceTarget,
    /// Objects per list page and per database transaction.
    pub page_size: u32,
    /// Objects per second the copy may write at most; `None` for as fast as it goes.
    pub rate: Option<f64>,
    /// Plan and count only; change nothing.
    pub dry_run: bool,
    /// How long the fence may take to hold, and kube-apiserver to route a switched group to us.
    pub switch_timeout: Duration,
    /// The API groups to move (e.g. `wgpolicyk8s.io`); empty moves every served group.
    pub groups: Vec<String>,
}

/// What a group needs, read from the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupState {
    /// Served from CRD storage: to be copied and switched.
    Local,
    /// Already routed to the target (an earlier run switched it).
    Switched,
    /// No APIService: no CRD storage to copy from; the APIService is created.
    Absent,
}

/// The outcome of one group.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupOutcome {
    pub api_service: String,
    pub state_before: String,
}

/// What a migration did, with its figures.
#[derive(Clone, Debug, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MigrationReport {
    pub dry_run: bool,
    pub groups: Vec<GroupOutcome>,
    pub kinds: Vec<KindProgress>,
    /// Objects copied from the lists per second of copying.
    pub copy_objects_per_second: f64,
    pub copy_seconds: f64,
    /// From the fence going up to it coming down: how long writes to the CRD storage were
    /// refused.
    pub fence_seconds: f64,
    /// From the first APIService patch to the last group confirmed routed to us.
    pub switch_seconds: f64,
    /// The resourceVersion floor set before the switch (0 when nothing was switched).
    pub version_floor: i64,
}

impl MigrationReport {
    /// The report of a run that found the groups in `states`.
    fn starting(dry_run: bool, states: &[(String, String, GroupState)]) -> Self {
        MigrationReport {
            dry_run,
            groups: states
                .iter()
                .map(|(g, v, s)| GroupOutcome {
                    api_service: format!("{v}.{g}"),
                    state_before: format!("{s:?}"),
                })
                .collect(),
            ..Default::default()
        }
    }
}

/// Shared, current progress; the engine updates it and callers read it (logs, status, a bar).
#[derive(Clone, Default)]
pub struct Progress {
    kinds: Arc<Mutex<Vec<KindProgress>>>,
    phase: Arc<Mutex<Phase>>,
}

/// Where a run is; published in the operator's status (`status.migration.phase`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Phase {
    /// Nothing to move: every wanted group is served by the server, the others by CRD storage.
    #[default]
    Complete,
    /// Copying from CRD storage into the database (and mirroring changes).
    Copying,
    /// Putting up the fence and waiting until kube-apiserver enforces it.
    Fencing,
    /// Behind the fence: the final sync and the verification.
    Verifying,
    /// APIServices being switched and the routing confirmed.
    Switching,
    /// APIServices being given back to kube-apiserver (hand-back).
    HandingBack,
    /// Reports being written back into CRD storage (hand-back).
    WritingBack,
    /// The last run stopped with an error; it is retried.
    Failed,
}

impl Phase {
    /// Reports are on their way into the database (the groups may already route to the server:
    /// the switch comes before the run reports Complete).
    pub fn moves_in(self) -> bool {
        matches!(
            self,
            Phase::Copying | Phase::Fencing | Phase::Verifying | Phase::Switching
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Complete => "Complete",
            Phase::Copying => "Copying",
            Phase::Fencing => "Fencing",
            Phase::Verifying => "Verifying",
            Phase::Switching => "Switching",
            Phase::HandingBack => "HandingBack",
            Phase::WritingBack => "WritingBack",
            Phase::Failed => "Failed",
        }
    }
}

impl Progress {
    pub fn snapshot(&self) -> Vec<KindProgress> {
        self.kinds.lock().expect("progress lock").clone()
    }

    pub fn phase(&self) -> Phase {
        *self.phase.lock().expect("progress lock")
    }

    pub fn set_phase(&self, phase: Phase) {
        let mut current = self.phase.lock().expect("progress lock");
        if *current != phase {
            tracing::info!(phase = phase.as_str(), "migration phase");
            *current = phase;
        }
    }

    /// Forgets the kinds of an earlier run.
    pub fn reset(&self) {
        self.kinds.lock().expect("progress lock").clear();
    }

    fn update(&self, kind: &str, f: impl FnOnce(&mut KindProgress)) {
        let mut kinds = self.kinds.lock().expect("progress lock");
        let i = match kinds.iter().position(|k| k.kind == kind) {
            Some(i) => i,
            None => {
                kinds.push(KindProgress {
                    kind: kind.to_owned(),
                    ..Default::default()
                });
                kinds.len() - 1
            }
        };
        f(&mut kinds[i]);
    }
}

/// Reads the state of every served group from the cluster.
/// Only the groups in `only` are read, unless it is empty.
pub async fn group_states(
    cluster: &Cluster,
    target: &ServiceTarget,
    only: &[String],
) -> Result<Vec<(String, String, GroupState)>, MigrationError> {
    let mut out = Vec::new();
    for (group, version) in GROUP_VERSIONS {
        if !only.is_empty() && !only.iter().any(|g| g == group) {
            continue;
        }
        let name = format!("{version}.{group}");
        let state = match cluster.apiservice(&name).await? {
            None => GroupState::Absent,
            Some(a) if plan::routes_to(&a, target) => GroupState::Switched,
            Some(a) if plan::is_local(&a) => GroupState::Local,
            Some(a) => {
                return Err(MigrationError::Refused(format!(
                    "APIService {name} routes to Service {}/{}, not to CRD storage nor to {}/{}; move it back to Local (delete it while the CRDs are installed) or point --service-* at it",
                    a["spec"]["service"]["namespace"].as_str().unwrap_or(""),
                    a["spec"]["service"]["name"].as_str().unwrap_or(""),
                    target.namespace,
                    target.name
                )));
            }
        };
        out.push((group.to_owned(), version.to_owned(), state));
    }
    Ok(out)
}

fn kinds_of(group: &str, version: &str) -> Vec<&'static ResourceDescriptor> {
    ALL.iter()
        .filter(|r| r.group == group && r.version == version)
        .collect()
}

/// Copies every report kind still in CRD storage into the database, fences the CRD storage,
/// brings the copy exactly in line and verifies it, then switches the APIServices to
/// `options.target` and lifts the fence.
#[allow(
    clippy::too_many_lines,
    reason = "to split when the migration engine gets its own crate (issue 34, part 5)"
)]
pub async fn to_database(
    cluster: &Cluster,
    registry: &Registry,
    options: &ToDatabaseOptions,
    progress: &Progress,
) -> Result<MigrationReport, MigrationError> {
    let states = group_states(cluster, &options.target, &options.groups).await?;
    let mut report = MigrationReport::starting(options.dry_run, &states);
    let mut kinds = Vec::new();
    for (group, version, state) in &states {
        if *state == GroupState::Local {
            for r in kinds_of(group, version) {
                if cluster.crd_exists(r).await? {
                    kinds.push(r);
                } else {
                    tracing::info!(kind = r.kind, "no CRD installed; nothing to copy");
                }
            }
        }
    }
    if options.dry_run {
        for r in &kinds {
            let (source, _) = cluster.list_versions(r, options.page_size).await?;
            let in_database = database_keys(registry, r).await?.len() as u64;
            progress.update(r.kind, |p| p.total = source.len() as u64);
            tracing::info!(
                kind = r.kind,
                in_crds = source.len(),
                in_database,
                "dry run: would copy"
            );
        }
        report.kinds = progress.snapshot();
        return Ok(report);
    }

    // 1. Copy each kind, then keep it current with a watch.
    progress.set_phase(Phase::Copying);
    let copy_started = Instant::now();
    let mut ledgers: BTreeMap<&'static str, Arc<Mutex<Ledger>>> = BTreeMap::new();
    let mut mirrors: Vec<JoinHandle<()>> = Vec::new();
    let mut copied_total = 0u64;
    for r in &kinds {
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let list_rv = copy_kind(cluster, registry, r, options, progress, &ledger).await?;
        copied_total += ledger.lock().expect("ledger lock").len() as u64;
        let span = tracing::info_span!("mirror", kind = r.kind);
        mirrors.push(tokio::spawn(
            mirror(
                cluster.clone(),
                registry.clone(),
                r,
                list_rv,
                ledger.clone(),
                progress.clone(),
                options.page_size,
            )
            .instrument(span),
        ));
        ledgers.insert(r.kind, ledger);
    }
    report.copy_seconds = copy_started.elapsed().as_secs_f64();
    report.copy_objects_per_second = copied_total as f64 / report.copy_seconds.max(1e-9);

    let local_groups: Vec<&str> = states
        .iter()
        .filter(|(_, _, s)| *s == GroupState::Local)
        .map(|(g, _, _)| g.as_str())
        .collect();
    let fenced = !local_groups.is_empty();
    // A run interrupted after its switch left the fence up: its watches may still need ending.
    let resumed_after_switch = cluster.fence_exists().await?;
    let fence_started = Instant::now();
    let result = async {
        let mut floor_source = 0i64;
        if fenced {
            // 2. Fence the CRD storage and wait until kube-apiserver enforces it.
            progress.set_phase(Phase::Fencing);
            let (policy, binding) = plan::fence(&local_groups, None);
            cluster.apply_fence(&policy, &binding).await?;
            for r in &kinds {
                wait_for(options.switch_timeout, || cluster.fence_holds(r), || {
                    format!("the migration fence did not start refusing writes to {} within {:?}; is the ValidatingAdmissionPolicy admission plugin enabled?", r.crd_name(), options.switch_timeout)
                })
                .await?;
            }
            tracing::info!(groups = ?local_groups, "fence up: writes to the report CRDs are refused until the switch");
            for m in &mirrors {
                m.abort();
            }
            // 3. Bring each copy exactly in line with the fenced source, and verify it.
            progress.set_phase(Phase::Verifying);
            for r in &kinds {
                let ledger = ledgers[r.kind].clone();
                let revision = final_sync(cluster, registry, r, options, progress, &ledger).await?;
                floor_source = floor_source.max(revision);
                verify_kind(registry, r, &ledger).await?;
            }
        }
        // 4. Our versions above every etcd revision, then the switch.
        progress.set_phase(Phase::Switching);
        let switch_started = Instant::now();
        let needs_switch: Vec<&(String, String, GroupState)> = states
            .iter()
            .filter(|(_, _, s)| *s != GroupState::Switched)
            .collect();
        if !needs_switch.is_empty() {
            if floor_source == 0 {
                // Nothing was read from etcd (no CRDs): still keep clear of any revision a
                // client may hold from an earlier CRD era of these groups.
                floor_source = registry.store().versions().await?.0;
            }
            let floor = plan::version_floor(floor_source);
            let (current, _) = registry.store().raise_version_floor(floor).await?;
            report.version_floor = floor;
            tracing::info!(floor, current, "resourceVersions raised above the source's revisions");
        }
        for (group, version, state) in &states {
            let name = format!("{version}.{group}");
            match state {
                GroupState::Switched => {}
                GroupState::Local => {
                    cluster
                        .patch_apiservice(&name, &plan::takeover_patch(&options.target))
                        .await?;
                    tracing::info!(api_service = %name, "APIService switched to the server");
                }
                GroupState::Absent => {
                    tracing::info!(api_service = %name, "no APIService; the server's installation creates it");
                }
            }
        }
        // 5. Confirm kube-apiserver routes each switched group to us.
        let floor = registry.store().versions().await?.1;
        for (group, version, state) in &states {
            if *state == GroupState::Absent {
                continue;
            }
            let probe = kinds_of(group, version)[0];
            wait_for(
                options.switch_timeout,
                || async { Ok(cluster.served_revision(probe).await?.is_some_and(|rv| rv >= floor)) },
                || format!("kube-apiserver did not route {group}/{version} to the server within {:?}; the APIService points at it and the fence stays up: check the server and its Service, then run the migration again", options.switch_timeout),
            )
            .await?;
        }
        if !needs_switch.is_empty() {
            report.switch_seconds = switch_started.elapsed().as_secs_f64();
        }
        // 6. Watches still attached to the CRD storage end, and their clients come to us.
        for (group, version, state) in &states {
            let switched_now = *state == GroupState::Local;
            if switched_now || (*state == GroupState::Switched && resumed_after_switch) {
                for r in kinds_of(group, version) {
                    if cluster.crd_exists(r).await? {
                        cluster.end_crd_watches(r).await?;
                    }
                }
            }
        }
        Ok::<(), MigrationError>(())
    }
    .await;
    for m in &mirrors {
        m.abort();
    }
    match &result {
        // Routed to us but not confirmed: the fence keeps etcd from taking writes meanwhile.
        Err(MigrationError::Timeout(_)) if fenced && report.version_floor > 0 => {}
        _ => {
            if fenced || resumed_after_switch {
                cluster.remove_fence().await?;
                tracing::info!("fence lifted");
            }
        }
    }
    result?;
    if fenced {
        report.fence_seconds = fence_started.elapsed().as_secs_f64();
    }
    report.kinds = progress.snapshot();
    Ok(report)
}

/// Polls `check` until it says yes or `timeout` passes.
async fn wait_for<F, Fut>(
    timeout: Duration,
    mut check: F,
    message: impl FnOnce() -> String,
) -> Result<(), MigrationError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool, MigrationError>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(MigrationError::Timeout(message()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Lists `r` page by page into the database; returns the list's resourceVersion (where the
/// mirror's watch starts). Objects in the database that the list does not have are removed.
async fn copy_kind(
    cluster: &Cluster,
    registry: &Registry,
    r: &'static ResourceDescriptor,
    options: &ToDatabaseOptions,
    progress: &Progress,
    ledger: &Mutex<Ledger>,
) -> Result<String, MigrationError> {
    let started = Instant::now();
    let mut token: Option<String> = None;
    let mut list_rv = String::new();
    let mut seen = BTreeSet::new();
    let mut copied = 0u64;
    let mut last_log = Instant::now();
    loop {
        let page = cluster
            .list_page(r, options.page_size, token.as_deref())
            .await?;
        if token.is_none() {
            list_rv = page.resource_version.clone();
            let total = page.items.len() as u64 + page.remaining.unwrap_or(0);
            progress.update(r.kind, |p| {
                p.total = total;
                p.copied = 0;
            });
        }
        for item in &page.items {
            seen.insert(ObjectKey::of(item));
        }
        let n = page.items.len() as u64;
        {
            let mut l = ledger.lock().expect("ledger lock");
            page.items.iter().for_each(|o| l.record(o));
        }
        registry.import(r, page.items).await?;
        copied += n;
        progress.update(r.kind, |p| {
            p.copied = copied;
            p.total = p.total.max(copied);
        });
        if last_log.elapsed() >= Duration::from_secs(2) {
            last_log = Instant::now();
            tracing::info!(
                kind = r.kind,
                copied,
                rate = copied as f64 / started.elapsed().as_secs_f64(),
                "copying"
            );
        }
        if let Some(rate) = options.rate.filter(|r| *r > 0.0) {
            let due = Duration::from_secs_f64(copied as f64 / rate);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
        token = page.continue_token;
        if token.is_none() {
            break;
        }
    }
    // Whatever the database holds for this kind beyond the list is left from an earlier era.
    let stale: Vec<(String, String)> = database_keys(registry, r)
        .await?
        .into_iter()
        .filter(|k| !seen.contains(k))
        .map(|k| (k.namespace, k.name))
        .collect();
    if !stale.is_empty() {
        registry.remove(r, &stale).await?;
    }
    progress.update(r.kind, |p| p.total = copied);
    tracing::info!(
        kind = r.kind,
        copied,
        removed = stale.len(),
        seconds = started.elapsed().as_secs_f64(),
        "copied"
    );
    Ok(list_rv)
}

/// Applies the source's changes to the copy until aborted. A watch that expires (410) or
/// fails starts again from a fresh list; the final sync behind the fence repairs anything a
/// gap let through, so the mirror only has to keep the last step small.
async fn mirror(
    cluster: Cluster,
    registry: Registry,
    r: &'static ResourceDescriptor,
    mut resource_version: String,
    ledger: Arc<Mutex<Ledger>>,
    progress: Progress,
    page_size: u32,
) {
    loop {
        let stream = match cluster.watch(r, &resource_version).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(kind = r.kind, error = %e, "mirror watch failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        futures::pin_mut!(stream);
        let mut expired = false;
        while let Some(event) = stream.next().await {
            let applied = match event {
                Ok(WatchEvent::Added(o)) | Ok(WatchEvent::Modified(o)) => {
                    resource_version = version_of(&o);
                    ledger.lock().expect("ledger lock").record(&o);
                    registry.import(r, vec![o]).await.map(|_| ())
                }
                Ok(WatchEvent::Deleted(o)) => {
                    resource_version = version_of(&o);
                    let key = ObjectKey::of(&o);
                    ledger.lock().expect("ledger lock").forget(&key);
                    registry
                        .remove(r, &[(key.namespace, key.name)])
                        .await
                        .map(|_| ())
                }
                Ok(WatchEvent::Bookmark(b)) => {
                    resource_version = b.metadata.resource_version;
                    continue;
                }
                Ok(WatchEvent::Error(s)) => {
                    expired = s.code == 410;
                    tracing::info!(kind = r.kind, code = s.code, message = %s.message, "mirror watch ended");
                    break;
                }
                Err(e) => {
                    tracing::info!(kind = r.kind, error = %e, "mirror watch interrupted");
                    break;
                }
            };
            match applied {
                Ok(()) => progress.update(r.kind, |p| p.mirrored += 1),
                // The final sync repairs it; a database hiccup must not stop the mirror.
                Err(e) => {
                    tracing::warn!(kind = r.kind, error = %e, "mirror could not apply a change")
                }
            }
        }
        if expired {
            // Relist: the final sync does the same work, but keeping the gap small keeps the
            // fence short.
            match cluster.list_versions(r, page_size).await {
                Ok((_, revision)) => resource_version = revision.to_string(),
                Err(e) => tracing::warn!(kind = r.kind, error = %e, "mirror relist failed"),
            }
        }
    }
}

fn version_of(o: &Value) -> String {
    o["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

/// Behind the fence: a metadata list of the source, then fetch what the copy lacks or holds
/// at another version and remove what the source no longer has. Returns the list's revision.
async fn final_sync(
    cluster: &Cluster,
    registry: &Registry,
    r: &'static ResourceDescriptor,
    options: &ToDatabaseOptions,
    progress: &Progress,
    ledger: &Mutex<Ledger>,
) -> Result<i64, MigrationError> {
    let (source, revision) = cluster.list_versions(r, options.page_size).await?;
    let in_database = database_keys(registry, r).await?;
    let sync = {
        let l = ledger.lock().expect("ledger lock");
        plan::sync_plan(&l, &source, &in_database)
    };
    let mut fetched = Vec::new();
    let mut gone = Vec::new();
    for key in &sync.fetch {
        match cluster.get(r, key).await? {
            Some(o) => fetched.push(o),
            None => gone.push(key.clone()),
        }
    }
    {
        let mut l = ledger.lock().expect("ledger lock");
        fetched.iter().for_each(|o| l.record(o));
        sync.remove
            .iter()
            .chain(gone.iter())
            .for_each(|k| l.forget(k));
    }
    let synced = (fetched.len() + sync.remove.len() + gone.len()) as u64;
    for chunk in fetched.chunks(options.page_size.max(1) as usize) {
        registry.import(r, chunk.to_vec()).await?;
    }
    let removed: Vec<(String, String)> = sync
        .remove
        .iter()
        .chain(gone.iter())
        .map(|k| (k.namespace.clone(), k.name.clone()))
        .collect();
    if !removed.is_empty() {
        registry.remove(r, &removed).await?;
    }
    progress.update(r.kind, |p| {
        p.synced = synced;
        p.total = source.len() as u64;
    });
    tracing::info!(
        kind = r.kind,
        objects = source.len(),
        fetched = fetched.len(),
        removed = removed.len(),
        revision,
        "final sync behind the fence"
    );
    Ok(revision)
}

/// Every key the database holds for `r`.
async fn database_keys(
    registry: &Registry,
    r: &'static ResourceDescriptor,
) -> Result<BTreeSet<ObjectKey>, MigrationError> {
    let mut out = BTreeSet::new();
    scan(registry, r, true, |row_key, _| {
        out.insert(row_key);
        Ok(())
    })
    .await?;
    Ok(out)
}

/// Visits every stored object of `r` in key order, one page at a time.
async fn scan(
    registry: &Registry,
    r: &'static ResourceDescriptor,
    metadata_only: bool,
    mut visit: impl FnMut(ObjectKey, &str) -> Result<(), MigrationError>,
) -> Result<(), MigrationError> {
    let mut after = None;
    loop {
        let query = ListQuery {
            resource: r,
            namespace: None,
            labels: Default::default(),
            fields: Default::default(),
            limit: Some(1000),
            after: after.clone(),
            metadata_only,
        };
        let page = registry.store().list(&query).await?;
        for row in &page.rows {
            visit(
                ObjectKey {
                    namespace: row.namespace.clone(),
                    name: row.name.clone(),
                },
                &row.body,
            )?;
        }
        match page.rows.last() {
            Some(last) if page.more => after = Some((last.namespace.clone(), last.name.clone())),
            _ => return Ok(()),
        }
    }
}

/// Counts and content hashes of the database against the ledger.
async fn verify_kind(
    registry: &Registry,
    r: &'static ResourceDescriptor,
    ledger: &Mutex<Ledger>,
) -> Result<(), MigrationError> {
    let mut hashes = BTreeMap::new();
    scan(registry, r, false, |key, body| {
        let object: Value = serde_json::from_str(body)
            .map_err(|e| MigrationError::Source(format!("stored {key} is not JSON: {e}")))?;
        hashes.insert(key, plan::content_hash(&object));
        Ok(())
    })
    .await?;
    let mismatches = plan::verify(&ledger.lock().expect("ledger lock"), &hashes);
    if let Some(first) = mismatches.first() {
        return Err(MigrationError::Verification {
            kind: r.kind,
            count: mismatches.len(),
            first: format!("{first}; nothing was switched and the fence is lifted"),
        });
    }
    tracing::info!(
        kind = r.kind,
        objects = hashes.len(),
        "verified: counts and content hashes agree"
    );
    Ok(())
}

/// How a hand-back to CRD storage runs.
#[derive(Clone, Debug)]
pub struct ToCrdsOptions {
    /// The Service the switched APIServices point at (only groups routed there are handed back).
    pub target: ServiceTarget,
    /// The CRDs to install when absent (from `reports-server crds`).
    pub crds: Vec<Value>,
    pub page_size: u32,
    pub dry_run: bool,
    /// How long CRDs may take to be Established, the fence to hold and kube-apiserver to route a
    /// group back to CRD storage.
    pub switch_timeout: Duration,
    /// How long the database must stay unchanged after the switch before it is read: writes
    /// that kube-apiserver sent to the server just before the switch land first.
    pub settle: Duration,
    /// Objects written back to CRD storage at once (the fence stands until all are).
    pub write_concurrency: usize,
    /// The API groups to hand back; empty hands back every group routed to the target.
    pub groups: Vec<String>,
}

/// Hands every group routed to `options.target` back to CRD storage with the data: CRDs
/// installed if absent, the CRD storage fenced against everyone but this migration, the
/// APIServices given back to kube-apiserver, every object in the database written into CRD
/// storage (created, or replaced where an older copy was left there), objects the database does
/// not have removed, the result compared object by object, and the fence lifted.
///
/// CRD storage assigns uid, creationTimestamp, generation and managedFields itself on create;
/// objects that were left in etcd by the move to the database keep their original uid.
#[allow(
    clippy::too_many_lines,
    reason = "to split when the migration engine gets its own crate (issue 34, part 5)"
)]
pub async fn to_crds(
    cluster: &Cluster,
    registry: &Registry,
    options: &ToCrdsOptions,
    progress: &Progress,
) -> Result<MigrationReport, MigrationError> {
    let states = group_states(cluster, &options.target, &options.groups).await?;
    let fenced_before = cluster.fence_exists().await?;
    let mut report = MigrationReport::starting(options.dry_run, &states);
    // Switched groups go back; Local groups behind a fence are a hand-back that was interrupted.
    let groups: Vec<(&str, &str)> = states
        .iter()
        .filter(|(_, _, s)| {
            *s == GroupState::Switched || (*s == GroupState::Local && fenced_before)
        })
        .map(|(g, v, _)| (g.as_str(), v.as_str()))
        .collect();
    let kinds: Vec<&'static ResourceDescriptor> =
        groups.iter().flat_map(|(g, v)| kinds_of(g, v)).collect();
    if options.dry_run || kinds.is_empty() {
        for r in &kinds {
            let n = database_keys(registry, r).await?.len() as u64;
            progress.update(r.kind, |p| p.total = n);
            tracing::info!(kind = r.kind, in_database = n, "dry run: would write back");
        }
        report.kinds = progress.snapshot();
        return Ok(report);
    }
    let wanted: Vec<Value> = options
        .crds
        .iter()
        .filter(|c| {
            kinds
                .iter()
                .any(|r| c["metadata"]["name"] == Value::String(r.crd_name()))
        })
        .cloned()
        .chain([plan::probe_crd()])
        .collect();
    cluster.apply_crds(&wanted, options.switch_timeout).await?;

    // 1. Fence the CRD storage against everyone but us, then give the groups back.
    progress.set_phase(Phase::Fencing);
    let fence_started = Instant::now();
    let me = cluster.username().await?;
    let group_names: Vec<&str> = groups.iter().map(|(g, _)| *g).collect();
    let (policy, binding) = plan::fence(&group_names, Some(&me));
    cluster.apply_fence(&policy, &binding).await?;
    // A write that reached CRD storage after the switch but before kube-apiserver enforces the
    // fence would be overwritten by the write-back (an acknowledged delete undone, an update
    // reverted). The report kinds cannot be probed yet (requests for them still reach us), so
    // the fence is probed on a kind of our own that kube-apiserver serves: once it refuses
    // there, the policy is loaded and refuses the report kinds from the moment they are local.
    wait_for(
        options.switch_timeout,
        || cluster.fence_holds_on_probe(),
        || {
            format!(
                "the migration fence did not start refusing writes within {:?}; is the ValidatingAdmissionPolicy admission plugin enabled?",
                options.switch_timeout
            )
        },
    )
    .await?;
    tracing::info!("fence holds (probed); giving the groups back");
    progress.set_phase(Phase::HandingBack);
    let switch_started = Instant::now();
    let (_, our_floor) = registry.store().versions().await?;
    for (group, version) in &groups {
        let name = format!("{version}.{group}");
        cluster
            .patch_apiservice(&name, &plan::handback_patch())
            .await?;
        tracing::info!(api_service = %name, "APIService given back to kube-apiserver");
    }
    for (group, version) in &groups {
        let probe = kinds_of(group, version)[0];
        wait_for(
            options.switch_timeout,
            || async {
                Ok(cluster
                    .served_revision(probe)
                    .await?
                    .is_some_and(|rv| rv < our_floor || our_floor == 0))
            },
            || format!("kube-apiserver did not serve {group}/{version} from CRD storage within {:?}; run the hand-back again", options.switch_timeout),
        )
        .await?;
        wait_for(
            options.switch_timeout,
            || cluster.fence_holds(probe),
            || {
                format!(
                    "the migration fence did not start refusing writes to {} within {:?}",
                    probe.crd_name(),
                    options.switch_timeout
                )
            },
        )
        .await?;
    }
    report.switch_seconds = switch_started.elapsed().as_secs_f64();
    // 2. Writes sent to us just before the switch land before the database is read.
    let mut last = registry.store().versions().await?.0;
    loop {
        tokio::time::sleep(options.settle).await;
        let now = registry.store().versions().await?.0;
        if now == last {
            break;
        }
        last = now;
    }

    // 3. Write every object back, remove what we do not have, compare.
    progress.set_phase(Phase::WritingBack);
    let copy_started = Instant::now();
    let mut written = 0u64;
    for r in &kinds {
        let theirs = cluster.list_objects(r, options.page_size).await?;
        let mut ours: BTreeMap<ObjectKey, Value> = BTreeMap::new();
        scan(registry, r, false, |key, body| {
            let object: Value = serde_json::from_str(body)
                .map_err(|e| MigrationError::Source(format!("stored {key} is not JSON: {e}")))?;
            ours.insert(key, object);
            Ok(())
        })
        .await?;
        progress.update(r.kind, |p| p.total = ours.len() as u64);
        // One request per object through kube-apiserver, several at once: the fence stands
        // (writers are refused) until the last one is done.
        let done = std::sync::atomic::AtomicU64::new(0);
        futures::stream::iter(ours.iter().filter(|(key, object)| {
            let deleting = object["metadata"]["deletionTimestamp"].is_string();
            if deleting {
                // Being deleted (finalizers pending): CRD storage cannot take it as it is.
                tracing::warn!(kind = r.kind, object = %key, "not written back: it is being deleted");
            }
            !deleting
        }))
        .map(Ok)
        .try_for_each_concurrent(options.write_concurrency.max(1), |(key, object)| {
            let (theirs, done) = (&theirs, &done);
            async move {
                match plan::handback(object, theirs.get(key)) {
                    plan::Handback::Create => cluster.create(r, &plan::for_create(object)).await?,
                    plan::Handback::Update(version) => {
                        let mut replacement = plan::for_create(object);
                        let meta = &theirs[key]["metadata"];
                        replacement["metadata"]["resourceVersion"] = Value::String(version);
                        replacement["metadata"]["uid"] = meta["uid"].clone();
                        cluster.replace(r, &replacement).await?;
                    }
                    plan::Handback::Unchanged => {}
                }
                let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                progress.update(r.kind, |p| p.copied = n);
                Ok::<(), MigrationError>(())
            }
        })
        .await?;
        written += done.into_inner();
        let stale: Vec<&ObjectKey> = theirs.keys().filter(|k| !ours.contains_key(k)).collect();
        futures::stream::iter(stale.iter().map(Ok))
            .try_for_each_concurrent(options.write_concurrency.max(1), |key| {
                cluster.delete(r, key)
            })
            .await?;
        progress.update(r.kind, |p| p.synced = stale.len() as u64);
        // Compare what CRD storage now serves with the database, object by object.
        let now = cluster.list_objects(r, options.page_size).await?;
        let expected: BTreeMap<&ObjectKey, [u8; 32]> = ours
            .iter()
            .filter(|(_, o)| !o["metadata"]["deletionTimestamp"].is_string())
            .map(|(k, o)| (k, plan::portable_hash(o)))
            .collect();
        let served: BTreeMap<&ObjectKey, [u8; 32]> = now
            .iter()
            .map(|(k, o)| (k, plan::portable_hash(o)))
            .collect();
        if expected != served {
            let first = expected
                .iter()
                .find(|(k, h)| served.get(*k) != Some(*h))
                .map(|(k, _)| format!("{k} differs or is missing in CRD storage"))
                .or_else(|| {
                    served
                        .keys()
                        .find(|k| !expected.contains_key(*k))
                        .map(|k| format!("{k} is in CRD storage only"))
                })
                .unwrap_or_default();
            return Err(MigrationError::Verification {
                kind: r.kind,
                count: expected.len().abs_diff(served.len()).max(1),
                first: format!("{first}; the fence stays up: run the hand-back again"),
            });
        }
        tracing::info!(
            kind = r.kind,
            objects = expected.len(),
            removed = stale.len(),
            "written back and verified"
        );
    }
    report.copy_seconds = copy_started.elapsed().as_secs_f64();
    report.copy_objects_per_second = written as f64 / report.copy_seconds.max(1e-9);
    cluster.remove_fence().await?;
    tracing::info!("fence lifted; the report groups are served from CRD storage");
    // Only a leftover if this fails (it never holds an object): not a reason to fail the run.
    if let Err(e) = cluster.remove_probe_crd().await {
        tracing::warn!(error = %e, "could not delete the fence's probe CRD fenceprobes.migration.reportsserver.io; delete it by hand");
    }
    report.fence_seconds = fence_started.elapsed().as_secs_f64();
    report.kinds = progress.snapshot();
    Ok(report)
}
