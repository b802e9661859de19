//! The hand-back to CRD storage: CRDs installed if absent, the CRD storage fenced against
//! everyone but this migration, the APIServices given back, every object written back and
//! compared, and the fence lifted.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use reports_server_apiserver::registry::Registry;
use reports_server_crds::ResourceDescriptor;
use serde_json::Value;

use crate::cluster::Cluster;
use crate::plan::{self, ObjectKey, ServiceTarget};
use crate::{
    GroupState, MigrationError, MigrationReport, Phase, Progress, database_keys, group_states,
    kinds_of, scan, wait_for,
};

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
pub async fn to_crds(
    cluster: &Cluster,
    registry: &Registry,
    options: &ToCrdsOptions,
    progress: &Progress,
) -> Result<MigrationReport, MigrationError> {
    let run = HandBack {
        cluster,
        registry,
        options,
        progress,
    };
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
    run.install_crds(&kinds).await?;
    let fence_started = Instant::now();
    run.fence_and_give_back(&groups, &mut report).await?;
    run.settle().await?;
    progress.set_phase(Phase::WritingBack);
    let copy_started = Instant::now();
    let mut written = 0u64;
    for r in &kinds {
        written += run.write_back(r).await?;
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

/// What one hand-back works with.
struct HandBack<'a> {
    cluster: &'a Cluster,
    registry: &'a Registry,
    options: &'a ToCrdsOptions,
    progress: &'a Progress,
}

impl HandBack<'_> {
    /// The CRDs of `kinds` (and the fence's probe CRD), applied and Established.
    async fn install_crds(
        &self,
        kinds: &[&'static ResourceDescriptor],
    ) -> Result<(), MigrationError> {
        let wanted: Vec<Value> = self
            .options
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
        self.cluster
            .apply_crds(&wanted, self.options.switch_timeout)
            .await
    }

    /// Step 1: fences the CRD storage against everyone but us, then gives the groups back and
    /// waits until kube-apiserver serves them from CRD storage behind the fence.
    async fn fence_and_give_back(
        &self,
        groups: &[(&str, &str)],
        report: &mut MigrationReport,
    ) -> Result<(), MigrationError> {
        let (cluster, timeout) = (self.cluster, self.options.switch_timeout);
        self.progress.set_phase(Phase::Fencing);
        let me = cluster.username().await?;
        let group_names: Vec<&str> = groups.iter().map(|(g, _)| *g).collect();
        let (policy, binding) = plan::fence(&group_names, Some(&me));
        cluster.apply_fence(&policy, &binding).await?;
        // A write that reached CRD storage after the switch but before kube-apiserver enforces
        // the fence would be overwritten by the write-back (an acknowledged delete undone, an
        // update reverted). The report kinds cannot be probed yet (requests for them still
        // reach us), so the fence is probed on a kind of our own that kube-apiserver serves:
        // once it refuses there, the policy is loaded and refuses the report kinds from the
        // moment they are local.
        wait_for(
            timeout,
            || cluster.fence_holds_on_probe(),
            || format!("the migration fence did not start refusing writes within {timeout:?}; is the ValidatingAdmissionPolicy admission plugin enabled?"),
        )
        .await?;
        tracing::info!("fence holds (probed); giving the groups back");
        self.progress.set_phase(Phase::HandingBack);
        let switch_started = Instant::now();
        let (_, our_floor) = self.registry.versions().await?;
        for (group, version) in groups {
            let name = format!("{version}.{group}");
            cluster
                .patch_apiservice(&name, &plan::handback_patch())
                .await?;
            tracing::info!(api_service = %name, "APIService given back to kube-apiserver");
        }
        for (group, version) in groups {
            let probe = kinds_of(group, version)[0];
            wait_for(
                timeout,
                || async {
                    Ok(cluster
                        .served_revision(probe)
                        .await?
                        .is_some_and(|rv| rv < our_floor || our_floor == 0))
                },
                || format!("kube-apiserver did not serve {group}/{version} from CRD storage within {timeout:?}; run the hand-back again"),
            )
            .await?;
            wait_for(
                timeout,
                || cluster.fence_holds(probe),
                || format!("the migration fence did not start refusing writes to {} within {timeout:?}", probe.crd_name()),
            )
            .await?;
        }
        report.switch_seconds = switch_started.elapsed().as_secs_f64();
        Ok(())
    }

    /// Step 2: writes sent to us just before the switch land before the database is read.
    async fn settle(&self) -> Result<(), MigrationError> {
        let mut last = self.registry.versions().await?.0;
        loop {
            tokio::time::sleep(self.options.settle).await;
            let now = self.registry.versions().await?.0;
            if now == last {
                return Ok(());
            }
            last = now;
        }
    }

    /// Step 3 for one kind: writes every object back, removes what the database does not
    /// have, and compares. Returns the number of objects written.
    async fn write_back(&self, r: &'static ResourceDescriptor) -> Result<u64, MigrationError> {
        let (cluster, concurrency) = (self.cluster, self.options.write_concurrency.max(1));
        let theirs = cluster.list_objects(r, self.options.page_size).await?;
        let mut ours: BTreeMap<ObjectKey, Value> = BTreeMap::new();
        scan(self.registry, r, false, |key, body| {
            let object: Value = serde_json::from_str(body)
                .map_err(|e| MigrationError::Source(format!("stored {key} is not JSON: {e}")))?;
            ours.insert(key, object);
            Ok(())
        })
        .await?;
        self.progress
            .update(r.kind, |p| p.total = ours.len() as u64);
        // One request per object through kube-apiserver, several at once: the fence stands
        // (writers are refused) until the last one is done.
        let done = AtomicU64::new(0);
        futures::stream::iter(ours.iter().filter(|(key, object)| {
            let deleting = object["metadata"]["deletionTimestamp"].is_string();
            if deleting {
                // Being deleted (finalizers pending): CRD storage cannot take it as it is.
                tracing::warn!(kind = r.kind, object = %key, "not written back: it is being deleted");
            }
            !deleting
        }))
        .map(Ok)
        .try_for_each_concurrent(concurrency, |(key, object)| {
            let (theirs, done) = (&theirs, &done);
            async move {
                self.write_one(r, object, theirs.get(key)).await?;
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                self.progress.update(r.kind, |p| p.copied = n);
                Ok::<(), MigrationError>(())
            }
        })
        .await?;
        let stale: Vec<&ObjectKey> = theirs.keys().filter(|k| !ours.contains_key(k)).collect();
        futures::stream::iter(stale.iter().map(Ok))
            .try_for_each_concurrent(concurrency, |key| cluster.delete(r, key))
            .await?;
        self.progress
            .update(r.kind, |p| p.synced = stale.len() as u64);
        let compared = self.compare(r, &ours).await?;
        tracing::info!(
            kind = r.kind,
            objects = compared,
            removed = stale.len(),
            "written back and verified"
        );
        Ok(done.into_inner())
    }

    /// Creates `object` in CRD storage, or replaces the older copy left there.
    async fn write_one(
        &self,
        r: &'static ResourceDescriptor,
        object: &Value,
        theirs: Option<&Value>,
    ) -> Result<(), MigrationError> {
        match plan::handback(object, theirs) {
            plan::Handback::Create => self.cluster.create(r, &plan::for_create(object)).await,
            plan::Handback::Update(version) => {
                let mut replacement = plan::for_create(object);
                let meta = &theirs.expect("an update has a current object")["metadata"];
                replacement["metadata"]["resourceVersion"] = Value::String(version);
                replacement["metadata"]["uid"] = meta["uid"].clone();
                self.cluster.replace(r, &replacement).await
            }
            plan::Handback::Unchanged => Ok(()),
        }
    }

    /// Compares what CRD storage now serves with the database, object by object; answers
    /// the number of objects compared.
    async fn compare(
        &self,
        r: &'static ResourceDescriptor,
        ours: &BTreeMap<ObjectKey, Value>,
    ) -> Result<usize, MigrationError> {
        let now = self.cluster.list_objects(r, self.options.page_size).await?;
        let expected: BTreeMap<&ObjectKey, [u8; 32]> = ours
            .iter()
            .filter(|(_, o)| !o["metadata"]["deletionTimestamp"].is_string())
            .map(|(k, o)| (k, plan::portable_hash(o)))
            .collect();
        let served: BTreeMap<&ObjectKey, [u8; 32]> = now
            .iter()
            .map(|(k, o)| (k, plan::portable_hash(o)))
            .collect();
        if expected == served {
            return Ok(expected.len());
        }
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
        Err(MigrationError::Verification {
            kind: r.kind,
            count: expected.len().abs_diff(served.len()).max(1),
            first: format!("{first}; the fence stays up: run the hand-back again"),
        })
    }
}
