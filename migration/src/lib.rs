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

// Every production function fits on a screen (threshold in clippy.toml); tests may be longer.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod cluster;
pub mod mailbox;
pub mod plan;
mod to_crds;
mod to_database;
pub mod worker;

pub use to_crds::{ToCrdsOptions, to_crds};
pub use to_database::{ToDatabaseOptions, to_database};

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reports_server_apiserver::registry::{Registry, RegistryError};
use reports_server_crds::ResourceDescriptor;
use reports_server_crds::catalog::{ALL, GROUP_VERSIONS};

use cluster::Cluster;
use plan::{KindProgress, ObjectKey, ServiceTarget};

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

/// Visits every stored object of `r` in key order.
async fn scan(
    registry: &Registry,
    r: &'static ResourceDescriptor,
    metadata_only: bool,
    mut visit: impl FnMut(ObjectKey, &str) -> Result<(), MigrationError>,
) -> Result<(), MigrationError> {
    registry
        .scan(r, metadata_only, |row| {
            let key = ObjectKey {
                namespace: row.namespace.to_owned(),
                name: row.name.to_owned(),
            };
            visit(key, row.body)
        })
        .await
}
