//! The migration as a background worker of `reports-server serve` (`--migrate-from-crds`): how
//! the operator's `spec.migration` runs.
//!
//! Why in the server: the engine writes through the registry, and only the server has the
//! database (the embedded SQLite file lives in its pod). Why declarative: the worker is told
//! which groups the server should serve (the mailbox's `groups`, else `--migration-groups`) and
//! converges the cluster on it — a Local group that is wanted is copied in and switched, a
//! switched group that is not wanted any more (the group turned off, the ReportsServer deleted)
//! is handed back with its data. Every step reads the state from the cluster (the engine's
//! checkpoint), so a worker killed in any phase is resumed by the next leader.
//!
//! One replica moves data (the database lease `migration/<cluster id>`), every replica watches
//! whether something is moving: in-process aggregation must not run meanwhile (it would merge
//! copied ephemeral reports that etcd still owns, or change the database during a write-back).
//! The server's health does not depend on the worker: a long migration never fails a probe.

use std::time::Duration;

use reports_server_apiserver::registry::Registry;
use reports_server_crds::catalog::GROUP_VERSIONS;
use reports_server_election::{ElectionTiming, Elector};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::cluster::Cluster;
use super::mailbox::{self, Mailbox};
use super::{
    GroupState, MigrationError, Phase, Progress, ToCrdsOptions, ToDatabaseOptions, group_states,
};

/// How the worker runs.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// Settings of a move into the database; `groups` is the default wanted set.
    pub to_database: ToDatabaseOptions,
    /// Settings of a hand-back (`groups` is filled per run).
    pub to_crds: ToCrdsOptions,
    /// `namespace/name` of the mailbox ConfigMap, when an operator drives the worker.
    pub mailbox: Option<String>,
    /// How often the cluster is checked when nothing moves (and the retry delay after a
    /// failure).
    pub interval: Duration,
    /// The database lease that makes one replica the mover.
    pub lease: ElectionTiming,
}

/// What the cluster needs next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Every wanted group is served by the server (or has no CRD storage), the others by CRD
    /// storage.
    Nothing,
    /// Hand these groups back (first: a group to give back is never copied in again).
    ToCrds(Vec<String>),
    /// Move these groups into the database (or finish a move interrupted after its switch).
    ToDatabase(Vec<String>),
}

/// The next step from the groups' states, the wanted groups and whether the fence is up.
pub fn next_step(states: &[(String, String, GroupState)], wanted: &[String], fenced: bool) -> Step {
    let is_wanted = |g: &str| wanted.iter().any(|w| w == g);
    let back: Vec<String> = states
        .iter()
        .filter(|(g, _, s)| {
            !is_wanted(g) && (*s == GroupState::Switched || (*s == GroupState::Local && fenced))
        })
        .map(|(g, _, _)| g.clone())
        .collect();
    if !back.is_empty() {
        return Step::ToCrds(back);
    }
    let into: Vec<String> = states
        .iter()
        .filter(|(g, _, s)| {
            is_wanted(g) && (*s == GroupState::Local || (*s == GroupState::Switched && fenced))
        })
        .map(|(g, _, _)| g.clone())
        .collect();
    if into.is_empty() {
        Step::Nothing
    } else {
        Step::ToDatabase(into)
    }
}

/// The migration worker of one server process.
pub struct Worker {
    cluster: Cluster,
    registry: Registry,
    options: WorkerOptions,
    mailbox: Option<Mailbox>,
    settled: watch::Sender<bool>,
    holder: String,
}

impl Worker {
    pub fn new(
        client: kube::Client,
        registry: Registry,
        options: WorkerOptions,
    ) -> Result<Self, MigrationError> {
        let mailbox = options
            .mailbox
            .as_deref()
            .map(|m| Mailbox::new(client.clone(), m))
            .transpose()?;
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "reports-server".into());
        Ok(Worker {
            cluster: Cluster::new(client),
            registry,
            options,
            mailbox,
            settled: watch::channel(false).0,
            holder: format!("{host}/{}", std::process::id()),
        })
    }

    /// `true` while nothing moves (in-process aggregation may run); starts `false` until the
    /// cluster has been read once.
    pub fn settled(&self) -> watch::Receiver<bool> {
        self.settled.subscribe()
    }

    /// Runs until `cancel`: every replica keeps [`Worker::settled`] current, the lease holder
    /// moves data.
    #[tracing::instrument(name = "migration_worker", skip_all)]
    pub async fn run(self, cancel: CancellationToken) {
        let lease = self.registry.lease("migration", self.holder.clone());
        let elector = Elector::new(lease, self.options.lease);
        let worker = std::sync::Arc::new(self);
        // Each term's work runs as a task of its own: polled inside the election loop, its
        // stretches of CPU work (parsing and hashing every object of a write-back) delayed the
        // renewals on a busy machine until the lease was lost, and the next term started the
        // hand-back over, again and again.
        let term_task = |term: CancellationToken| {
            let worker = worker.clone();
            async move {
                let task = tokio::spawn(
                    async move { worker.lead(term).await }.instrument(tracing::Span::current()),
                );
                if let Err(e) = task.await {
                    tracing::error!(error = %e, "the migration term's task failed");
                }
            }
        };
        tokio::join!(
            worker.observe(cancel.clone()),
            elector.run(cancel.clone(), term_task, |_| {})
        );
    }

    /// The wanted groups, the next step, and the wanted groups' text for reports.
    async fn assess(&self) -> Result<(Vec<String>, Step), MigrationError> {
        let from_mailbox = match &self.mailbox {
            Some(m) => m.read().await?.as_ref().and_then(mailbox::wanted_groups),
            None => None,
        };
        let wanted = from_mailbox.unwrap_or_else(|| self.default_groups());
        let states = group_states(&self.cluster, &self.options.to_database.target, &[]).await?;
        let fenced = self.cluster.fence_exists().await?;
        let step = next_step(&states, &wanted, fenced);
        self.settled.send_replace(step == Step::Nothing);
        Ok((wanted, step))
    }

    fn default_groups(&self) -> Vec<String> {
        if self.options.to_database.groups.is_empty() {
            GROUP_VERSIONS.iter().map(|(g, _)| g.to_string()).collect()
        } else {
            self.options.to_database.groups.clone()
        }
    }

    async fn observe(&self, cancel: CancellationToken) {
        let mut failing = false;
        while !cancel.is_cancelled() {
            match self.assess().await {
                Ok(_) => failing = false,
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "cannot read the migration state; retrying");
                }
                Err(_) => {}
            }
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = tokio::time::sleep(self.options.interval) => {}
            }
        }
    }

    /// One term as the mover: assess, move, report, until the term ends.
    async fn lead(&self, term: CancellationToken) {
        let mut published: Option<(Vec<String>, Phase, String)> = None;
        while !term.is_cancelled() {
            let delay = match self.assess().await {
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the migration state; retrying");
                    self.options.interval
                }
                Ok((wanted, Step::Nothing)) => {
                    let now = (wanted.clone(), Phase::Complete, String::new());
                    if published.as_ref() != Some(&now) {
                        self.publish(&wanted, Phase::Complete, &Progress::default(), "", None)
                            .await;
                        published = Some(now);
                    }
                    self.options.interval
                }
                Ok((wanted, step)) => {
                    published = None;
                    tokio::select! {
                        _ = term.cancelled() => return,
                        ok = self.move_data(&wanted, step) => if ok {
                            Duration::ZERO
                        } else {
                            self.options.interval
                        },
                    }
                }
            };
            tokio::select! {
                _ = term.cancelled() => {}
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// Runs one step with progress published every 2 s; `false` when it failed (reported).
    async fn move_data(&self, wanted: &[String], step: Step) -> bool {
        let progress = Progress::default();
        let reporter = async {
            loop {
                self.publish(wanted, progress.phase(), &progress, "", None)
                    .await;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        };
        let run = async {
            match &step {
                Step::ToDatabase(groups) => {
                    tracing::info!(
                        ?groups,
                        "moving report groups from CRD storage into the database"
                    );
                    let options = ToDatabaseOptions {
                        groups: groups.clone(),
                        ..self.options.to_database.clone()
                    };
                    super::to_database(&self.cluster, &self.registry, &options, &progress).await
                }
                Step::ToCrds(groups) => {
                    tracing::info!(?groups, "handing report groups back to CRD storage");
                    let options = ToCrdsOptions {
                        groups: groups.clone(),
                        ..self.options.to_crds.clone()
                    };
                    super::to_crds(&self.cluster, &self.registry, &options, &progress).await
                }
                Step::Nothing => unreachable!("only called with work to do"),
            }
        };
        progress.set_phase(match step {
            Step::ToCrds(_) => Phase::Fencing,
            _ => Phase::Copying,
        });
        let result = tokio::select! {
            r = run => r,
            _ = reporter => unreachable!("the reporter never ends"),
        };
        match result {
            Ok(report) => {
                tracing::info!(
                    copy_objects_per_second = report.copy_objects_per_second,
                    fence_seconds = report.fence_seconds,
                    switch_seconds = report.switch_seconds,
                    "migration step finished"
                );
                let run = serde_json::to_value(&report).ok();
                // `Complete` is published by the next assessment, once it agrees.
                self.publish(wanted, progress.phase(), &progress, "", run.as_ref())
                    .await;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "migration step failed; it is retried");
                self.publish(wanted, Phase::Failed, &progress, &e.to_string(), None)
                    .await;
                false
            }
        }
    }

    async fn publish(
        &self,
        wanted: &[String],
        phase: Phase,
        progress: &Progress,
        message: &str,
        last_run: Option<&serde_json::Value>,
    ) {
        let Some(mailbox) = &self.mailbox else {
            return;
        };
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let patch =
            mailbox::report_patch(wanted, phase, &progress.snapshot(), message, last_run, &now);
        if let Err(e) = mailbox.publish(&patch).await {
            tracing::warn!(error = %e, "cannot report migration progress");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn states(s: &[(&str, GroupState)]) -> Vec<(String, String, GroupState)> {
        s.iter()
            .map(|(g, st)| (g.to_string(), "v1".to_string(), st.clone()))
            .collect()
    }

    fn groups(g: &[&str]) -> Vec<String> {
        g.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn wanted_local_groups_move_in() {
        let s = states(&[
            ("a", GroupState::Local),
            ("b", GroupState::Switched),
            ("c", GroupState::Absent),
        ]);
        assert_eq!(
            next_step(&s, &groups(&["a", "b", "c"]), false),
            Step::ToDatabase(groups(&["a"]))
        );
        // Not wanted and local: left alone.
        assert_eq!(next_step(&s, &groups(&["b", "c"]), false), Step::Nothing);
    }

    #[test]
    fn unwanted_switched_groups_go_back_first() {
        let s = states(&[("a", GroupState::Local), ("b", GroupState::Switched)]);
        assert_eq!(
            next_step(&s, &groups(&["a"]), false),
            Step::ToCrds(groups(&["b"]))
        );
        assert_eq!(
            next_step(&s, &[], false),
            Step::ToCrds(groups(&["b"])),
            "deletion hands everything back"
        );
    }

    #[test]
    fn a_fence_left_up_is_finished_in_its_direction() {
        // A hand-back interrupted after its switch: Local, fenced, not wanted.
        let s = states(&[("a", GroupState::Local)]);
        assert_eq!(next_step(&s, &[], true), Step::ToCrds(groups(&["a"])));
        // A move interrupted after its switch: Switched, fenced, wanted.
        let s = states(&[("a", GroupState::Switched)]);
        assert_eq!(
            next_step(&s, &groups(&["a"]), true),
            Step::ToDatabase(groups(&["a"]))
        );
        assert_eq!(next_step(&s, &groups(&["a"]), false), Step::Nothing);
    }
}
