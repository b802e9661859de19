//! The move into the database: copy each kind and mirror its changes, fence the CRD storage,
//! bring the copy exactly in line and verify it, raise our resourceVersions above etcd's, switch
//! the APIServices and confirm kube-apiserver routes to us, then lift the fence.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::Instrument;

use futures::StreamExt;
use kube::core::WatchEvent;
use reports_server_apiserver::registry::Registry;
use reports_server_crds::ResourceDescriptor;
use serde_json::Value;
use tokio::task::JoinHandle;

use crate::cluster::Cluster;
use crate::plan::{self, Ledger, ObjectKey, ServiceTarget};
use crate::{
    GroupState, MigrationError, MigrationReport, Phase, Progress, database_keys, group_states,
    kinds_of, scan, wait_for,
};

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

/// Copies every report kind still in CRD storage into the database, fences the CRD storage,
/// brings the copy exactly in line and verifies it, then switches the APIServices to
/// `options.target` and lifts the fence.
pub async fn to_database(
    cluster: &Cluster,
    registry: &Registry,
    options: &ToDatabaseOptions,
    progress: &Progress,
) -> Result<MigrationReport, MigrationError> {
    let run = Run {
        cluster,
        registry,
        options,
        progress,
    };
    let states = group_states(cluster, &options.target, &options.groups).await?;
    let mut report = MigrationReport::starting(options.dry_run, &states);
    let kinds = run.kinds_to_copy(&states).await?;
    if options.dry_run {
        run.count(&kinds).await?;
        report.kinds = progress.snapshot();
        return Ok(report);
    }
    let copies = run.copy_and_mirror(&kinds, &mut report).await?;
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
            floor_source = run.fence_and_verify(&kinds, &copies, &local_groups).await?;
        }
        run.switch(&states, floor_source, &mut report).await?;
        run.end_crd_watches(&states, resumed_after_switch).await
    }
    .await;
    copies.stop_mirrors();
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

/// What one run works with.
struct Run<'a> {
    cluster: &'a Cluster,
    registry: &'a Registry,
    options: &'a ToDatabaseOptions,
    progress: &'a Progress,
}

/// The kinds being copied: each one's ledger of what the copy holds, and the watches that keep
/// the copies current until the fence stands.
struct Copies {
    ledgers: BTreeMap<&'static str, Arc<Mutex<Ledger>>>,
    mirrors: Vec<JoinHandle<()>>,
}

impl Copies {
    fn stop_mirrors(&self) {
        for m in &self.mirrors {
            m.abort();
        }
    }
}

impl Run<'_> {
    /// Lists `r` page by page into the database; returns the list's resourceVersion (where the
    /// mirror's watch starts). Objects in the database that the list does not have are removed.
    async fn copy_kind(
        &self,
        r: &'static ResourceDescriptor,
        ledger: &Mutex<Ledger>,
    ) -> Result<String, MigrationError> {
        let started = Instant::now();
        let mut token: Option<String> = None;
        let mut list_rv = String::new();
        let mut seen = BTreeSet::new();
        let mut copied = 0u64;
        let mut last_log = Instant::now();
        loop {
            let page = self
                .cluster
                .list_page(r, self.options.page_size, token.as_deref())
                .await?;
            if token.is_none() {
                list_rv = page.resource_version.clone();
                let total = page.items.len() as u64 + page.remaining.unwrap_or(0);
                self.progress.update(r.kind, |p| {
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
            self.registry.import(r, page.items).await?;
            copied += n;
            self.progress.update(r.kind, |p| {
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
            if let Some(rate) = self.options.rate.filter(|r| *r > 0.0) {
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
        let stale: Vec<(String, String)> = database_keys(self.registry, r)
            .await?
            .into_iter()
            .filter(|k| !seen.contains(k))
            .map(|k| (k.namespace, k.name))
            .collect();
        if !stale.is_empty() {
            self.registry.remove(r, &stale).await?;
        }
        self.progress.update(r.kind, |p| p.total = copied);
        tracing::info!(
            kind = r.kind,
            copied,
            removed = stale.len(),
            seconds = started.elapsed().as_secs_f64(),
            "copied"
        );
        Ok(list_rv)
    }

    /// Behind the fence: a metadata list of the source, then fetch what the copy lacks or holds
    /// at another version and remove what the source no longer has. Returns the list's revision.
    async fn final_sync(
        &self,
        r: &'static ResourceDescriptor,
        ledger: &Mutex<Ledger>,
    ) -> Result<i64, MigrationError> {
        let (source, revision) = self
            .cluster
            .list_versions(r, self.options.page_size)
            .await?;
        let in_database = database_keys(self.registry, r).await?;
        let sync = {
            let l = ledger.lock().expect("ledger lock");
            plan::sync_plan(&l, &source, &in_database)
        };
        let mut fetched = Vec::new();
        let mut gone = Vec::new();
        for key in &sync.fetch {
            match self.cluster.get(r, key).await? {
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
        for chunk in fetched.chunks(self.options.page_size.max(1) as usize) {
            self.registry.import(r, chunk.to_vec()).await?;
        }
        let removed: Vec<(String, String)> = sync
            .remove
            .iter()
            .chain(gone.iter())
            .map(|k| (k.namespace.clone(), k.name.clone()))
            .collect();
        if !removed.is_empty() {
            self.registry.remove(r, &removed).await?;
        }
        self.progress.update(r.kind, |p| {
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

    /// The kinds of every group still served from CRD storage whose CRD is installed.
    async fn kinds_to_copy(
        &self,
        states: &[(String, String, GroupState)],
    ) -> Result<Vec<&'static ResourceDescriptor>, MigrationError> {
        let mut kinds = Vec::new();
        for (group, version, state) in states {
            if *state == GroupState::Local {
                for r in kinds_of(group, version) {
                    if self.cluster.crd_exists(r).await? {
                        kinds.push(r);
                    } else {
                        tracing::info!(kind = r.kind, "no CRD installed; nothing to copy");
                    }
                }
            }
        }
        Ok(kinds)
    }

    /// The dry run: what each kind holds on both sides.
    async fn count(&self, kinds: &[&'static ResourceDescriptor]) -> Result<(), MigrationError> {
        for r in kinds {
            let (source, _) = self
                .cluster
                .list_versions(r, self.options.page_size)
                .await?;
            let in_database = database_keys(self.registry, r).await?.len() as u64;
            self.progress
                .update(r.kind, |p| p.total = source.len() as u64);
            tracing::info!(
                kind = r.kind,
                in_crds = source.len(),
                in_database,
                "dry run: would copy"
            );
        }
        Ok(())
    }

    /// Step 1: copies each kind, then keeps it current with a watch.
    async fn copy_and_mirror(
        &self,
        kinds: &[&'static ResourceDescriptor],
        report: &mut MigrationReport,
    ) -> Result<Copies, MigrationError> {
        self.progress.set_phase(Phase::Copying);
        let copy_started = Instant::now();
        let mut copies = Copies {
            ledgers: BTreeMap::new(),
            mirrors: Vec::new(),
        };
        let mut copied_total = 0u64;
        for r in kinds {
            let ledger = Arc::new(Mutex::new(Ledger::default()));
            let list_rv = self.copy_kind(r, &ledger).await?;
            copied_total += ledger.lock().expect("ledger lock").len() as u64;
            let span = tracing::info_span!("mirror", kind = r.kind);
            copies.mirrors.push(tokio::spawn(
                mirror(
                    self.cluster.clone(),
                    self.registry.clone(),
                    r,
                    list_rv,
                    ledger.clone(),
                    self.progress.clone(),
                    self.options.page_size,
                )
                .instrument(span),
            ));
            copies.ledgers.insert(r.kind, ledger);
        }
        report.copy_seconds = copy_started.elapsed().as_secs_f64();
        report.copy_objects_per_second = copied_total as f64 / report.copy_seconds.max(1e-9);
        Ok(copies)
    }

    /// Steps 2 and 3: fences the CRD storage, waits until kube-apiserver enforces it, then
    /// brings each copy exactly in line with the fenced source and verifies it. Returns the
    /// highest etcd revision read.
    async fn fence_and_verify(
        &self,
        kinds: &[&'static ResourceDescriptor],
        copies: &Copies,
        local_groups: &[&str],
    ) -> Result<i64, MigrationError> {
        let timeout = self.options.switch_timeout;
        self.progress.set_phase(Phase::Fencing);
        let (policy, binding) = plan::fence(local_groups, None);
        self.cluster.apply_fence(&policy, &binding).await?;
        for r in kinds {
            wait_for(timeout, || self.cluster.fence_holds(r), || {
                format!("the migration fence did not start refusing writes to {} within {timeout:?}; is the ValidatingAdmissionPolicy admission plugin enabled?", r.crd_name())
            })
            .await?;
        }
        tracing::info!(groups = ?local_groups, "fence up: writes to the report CRDs are refused until the switch");
        copies.stop_mirrors();
        self.progress.set_phase(Phase::Verifying);
        let mut floor_source = 0i64;
        for r in kinds {
            let ledger = copies.ledgers[r.kind].clone();
            let revision = self.final_sync(r, &ledger).await?;
            floor_source = floor_source.max(revision);
            verify_kind(self.registry, r, &ledger).await?;
        }
        Ok(floor_source)
    }

    /// Steps 4 and 5: our versions above every etcd revision, the switch, and the
    /// confirmation that kube-apiserver routes each switched group to us.
    async fn switch(
        &self,
        states: &[(String, String, GroupState)],
        mut floor_source: i64,
        report: &mut MigrationReport,
    ) -> Result<(), MigrationError> {
        let timeout = self.options.switch_timeout;
        self.progress.set_phase(Phase::Switching);
        let switch_started = Instant::now();
        let needs_switch = states.iter().any(|(_, _, s)| *s != GroupState::Switched);
        if needs_switch {
            if floor_source == 0 {
                // Nothing was read from etcd (no CRDs): still keep clear of any revision a
                // client may hold from an earlier CRD era of these groups.
                floor_source = self.registry.versions().await?.0;
            }
            let floor = plan::version_floor(floor_source);
            let (current, _) = self.registry.raise_version_floor(floor).await?;
            report.version_floor = floor;
            tracing::info!(
                floor,
                current,
                "resourceVersions raised above the source's revisions"
            );
        }
        for (group, version, state) in states {
            let name = format!("{version}.{group}");
            match state {
                GroupState::Switched => {}
                GroupState::Local => {
                    let patch = plan::takeover_patch(&self.options.target);
                    self.cluster.patch_apiservice(&name, &patch).await?;
                    tracing::info!(api_service = %name, "APIService switched to the server");
                }
                GroupState::Absent => {
                    tracing::info!(api_service = %name, "no APIService; the server's installation creates it");
                }
            }
        }
        let floor = self.registry.versions().await?.1;
        for (group, version, state) in states {
            if *state == GroupState::Absent {
                continue;
            }
            let probe = kinds_of(group, version)[0];
            wait_for(
                timeout,
                || async { Ok(self.cluster.served_revision(probe).await?.is_some_and(|rv| rv >= floor)) },
                || format!("kube-apiserver did not route {group}/{version} to the server within {timeout:?}; the APIService points at it and the fence stays up: check the server and its Service, then run the migration again"),
            )
            .await?;
        }
        if needs_switch {
            report.switch_seconds = switch_started.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// Step 6: watches still attached to the CRD storage end, and their clients come to us.
    async fn end_crd_watches(
        &self,
        states: &[(String, String, GroupState)],
        resumed_after_switch: bool,
    ) -> Result<(), MigrationError> {
        for (group, version, state) in states {
            let switched_now = *state == GroupState::Local;
            if switched_now || (*state == GroupState::Switched && resumed_after_switch) {
                for r in kinds_of(group, version) {
                    if self.cluster.crd_exists(r).await? {
                        self.cluster.end_crd_watches(r).await?;
                    }
                }
            }
        }
        Ok(())
    }
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
