//! The merger's life: one active merger per database (a lease row), its workers, and what
//! enqueues namespaces (the change feed, sweeps, policy changes).

use std::sync::Arc;
use std::time::Duration;

use reports_server_aggregator::cluster::discovery::{DEFAULT_TTL, DiscoveryCache};
use reports_server_aggregator::cluster::policies::{DEFAULT_REDISCOVERY, next_change};
use reports_server_aggregator::cluster::{Adopter, AdoptionConfig, ClusterMetrics, PolicyWatcher};
use reports_server_aggregator::sweep::sweep_namespaces;
use reports_server_aggregator::{
    Aggregator, AggregatorConfig, CancellationToken, Metrics, PolicySet,
};
use reports_server_election::Elector;
use tokio::sync::watch;
use tracing::Instrument;

use crate::store::feed::Subscription;
use crate::store::lease::StoreLease;
use crate::store::ring::Lagged;
use crate::store::{EventType, Store};

use super::adoption::StoreEphemeralReports;
use super::backend::{StoreBackend, Sweep};
use super::is_ephemeral_resource;

/// Cluster access for in-process aggregation (`serve --auth-mode delegated`): with it, results
/// of deleted or report-disabled policies are dropped and admission reports written before
/// their resource had a UID are adopted, as Kyverno's own aggregation does. Without it (a
/// server with no cluster) the policy set is unknown — no result is ever dropped for a missing
/// policy — and such reports are kept, unmerged, until they are deleted.
#[derive(Clone)]
pub struct ClusterAccess {
    pub client: kube::Client,
    pub adoption: AdoptionConfig,
    /// Follow Kyverno's policies (`false`: the policy set stays unknown, nothing is dropped).
    pub watch_policies: bool,
    /// How long a new leader waits for the first complete policy lists before it aggregates
    /// with the missing kinds unknown.
    pub policy_sync_timeout: Duration,
    pub metrics: ClusterMetrics,
}

/// Timing of the database lease that makes one aggregator active per database: the same
/// election rules and defaults as the Kubernetes Lease of `reports-server aggregate`
/// (`reports_server_election`).
pub use reports_server_election::ElectionTiming as LeaseConfig;

/// The in-process aggregator of `reports-server serve`: leader election on the database
/// lease, event wiring from the change feed, and the aggregator's workers over a
/// [`StoreBackend`].
pub struct InProcessMerger {
    store: Store,
    backend: Arc<StoreBackend>,
    config: AggregatorConfig,
    metrics: Metrics,
    lease: LeaseConfig,
    lease_name: String,
    holder: String,
    leading: watch::Sender<bool>,
    cluster: Option<ClusterAccess>,
}

impl InProcessMerger {
    pub fn new(store: Store, config: AggregatorConfig, metrics: Metrics) -> Self {
        let host = std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "reports-server".into());
        // Unique per process, readable in `SELECT * FROM leases` (the pod name on Kubernetes).
        let holder = format!("{host}/{}/{}", std::process::id(), uuid::Uuid::new_v4());
        InProcessMerger {
            lease_name: format!("aggregator/{}", store.cluster_id()),
            backend: Arc::new(StoreBackend::new(store.clone())),
            store,
            config,
            metrics,
            lease: LeaseConfig::default(),
            holder,
            leading: watch::channel(false).0,
            cluster: None,
        }
    }

    /// Gives the aggregator the cluster: policies are watched and un-owned admission reports
    /// adopted (see [`ClusterAccess`]).
    pub fn with_cluster(mut self, cluster: ClusterAccess) -> Self {
        self.cluster = Some(cluster);
        self
    }

    pub fn with_lease(mut self, lease: LeaseConfig) -> Self {
        self.lease = lease;
        self
    }

    /// The backend, e.g. to pass a policy set in.
    pub fn backend(&self) -> &Arc<StoreBackend> {
        &self.backend
    }

    /// This process's identity in the lease row.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// The lease row's name: `aggregator/<cluster id>`.
    pub fn lease_name(&self) -> &str {
        &self.lease_name
    }

    /// `true` while this instance holds the lease and runs workers.
    pub fn leading(&self) -> watch::Receiver<bool> {
        self.leading.subscribe()
    }

    /// Runs until `cancel` fires: waits for the lease, aggregates while holding it, and
    /// releases it on the way out. The election is the aggregator crate's one loop
    /// ([`Elector`]) over the database lease row ([`StoreLease`]).
    pub async fn run(self, cancel: CancellationToken) {
        let elector = Elector::new(
            StoreLease::new(self.store.clone(), &self.lease_name, &self.holder),
            self.lease,
        );
        elector
            .run(
                cancel,
                |term| self.work(term),
                |leading| {
                    self.leading.send_replace(leading);
                    if !leading {
                        self.metrics.queue_depth.set(0);
                    }
                },
            )
            .await;
        self.metrics.queue_depth.set(0);
    }

    /// One leadership term: a fresh queue (a cancelled queue may keep keys marked as in
    /// progress), the change feed, the policy watch and adoption when the cluster is known, and
    /// the workers, all stopped by `term`.
    async fn work(&self, term: CancellationToken) {
        let mut config = self.config.clone();
        let adopter = self.cluster.as_ref().map(|cluster| {
            // Kyverno merges only adopted reports; guessing an owner from labels is for servers
            // without a cluster to ask.
            config.merge.adopt_unowned = false;
            Arc::new(Adopter::new(
                StoreEphemeralReports::new(self.store.clone()),
                cluster.client.clone(),
                DiscoveryCache::new(cluster.client.clone(), DEFAULT_TTL),
                cluster.adoption.clone(),
                cluster.metrics.clone(),
                config.queue.workers,
            ))
        });
        let policies = match &self.cluster {
            Some(cluster) if cluster.watch_policies => {
                Some(self.watch_policies(cluster, &term).await)
            }
            _ => None,
        };
        let output = config.merge.output;
        let aggregator = Aggregator::new(self.backend.clone(), config, self.metrics.clone());
        // Subscribe before listing, so that a change is either in the listing or on the feed.
        let (changes, _) = self.store.feed().subscribe().await;
        // Beside the change feed, not before it: a long first sweep after a switch of the
        // output group must not hold back new ephemeral reports.
        let events = async {
            tokio::join!(
                enqueue_all(&self.backend, &aggregator, &term, Sweep::OtherGroup(output)),
                follow_changes(&self.backend, &aggregator, changes, &term),
            );
        };
        let handler = {
            let aggregator = aggregator.clone();
            move |namespace: String| {
                let aggregator = aggregator.clone();
                let adopter = adopter.clone();
                async move {
                    match adopter {
                        Some(adopter) => adopter
                            .adopt_and_reconcile(&aggregator, &namespace)
                            .await
                            .map_err(|e| e.to_string()),
                        None => aggregator
                            .reconcile(&namespace)
                            .await
                            .map(|outcome| {
                                tracing::debug!(namespace, ?outcome, "namespace aggregated")
                            })
                            .map_err(|e| e.to_string()),
                    }
                }
            }
        };
        let workers = aggregator.queue().run(handler, term.clone());
        let policy_changes = async {
            if let Some(policies) = policies {
                follow_policies(&self.backend, &aggregator, policies, &term).await;
            }
        };
        tokio::join!(events, workers, policy_changes);
    }

    /// Starts watching Kyverno's policy kinds for this term and waits (bounded) for the first
    /// complete lists, so that the first merges already drop results of deleted policies.
    async fn watch_policies(
        &self,
        cluster: &ClusterAccess,
        term: &CancellationToken,
    ) -> watch::Receiver<Option<PolicySet>> {
        let watcher = PolicyWatcher::new(cluster.metrics.clone());
        tokio::spawn(
            watcher
                .clone()
                .run(cluster.client.clone(), term.clone(), DEFAULT_REDISCOVERY)
                .instrument(tracing::info_span!("policy_watcher")),
        );
        if !watcher.wait_synced(cluster.policy_sync_timeout).await {
            tracing::warn!(pending = ?watcher.pending_kinds(), "policies not listed in time; aggregating with those kinds unknown (none of their results dropped)");
        }
        let mut policies = watcher.policies();
        self.backend
            .set_policies(policies.borrow_and_update().clone());
        policies
    }
}

/// Keeps the backend's policy set current and, after each change (a burst of changes counts
/// once), re-merges every namespace whose reports it can change.
async fn follow_policies(
    backend: &StoreBackend,
    aggregator: &Aggregator<StoreBackend>,
    mut policies: watch::Receiver<Option<PolicySet>>,
    term: &CancellationToken,
) {
    while let Some(set) = next_change(&mut policies, term).await {
        backend.set_policies(set);
        tracing::info!("policy set changed; re-merging every namespace with reports");
        enqueue_all(backend, aggregator, term, Sweep::Inputs).await;
    }
}

/// Enqueues every namespace of `sweep`; retries until it succeeds or `cancel` fires (a
/// database outage must not lose a sweep).
async fn enqueue_all(
    backend: &StoreBackend,
    aggregator: &Aggregator<StoreBackend>,
    cancel: &CancellationToken,
    sweep: Sweep,
) {
    let what = match sweep {
        Sweep::Ephemerals => "with ephemeral reports",
        Sweep::Inputs => "with ephemeral or Kyverno-managed reports",
        Sweep::OtherGroup(_) => "with Kyverno-managed reports of the other report group",
    };
    sweep_namespaces(aggregator.queue(), cancel, what, || {
        backend.namespaces(sweep)
    })
    .await
}

/// Turns change-feed events into queue entries until `cancel` fires.
async fn follow_changes(
    backend: &StoreBackend,
    aggregator: &Aggregator<StoreBackend>,
    mut changes: Subscription,
    cancel: &CancellationToken,
) {
    enqueue_all(backend, aggregator, cancel, Sweep::Ephemerals).await;
    loop {
        let received = tokio::select! {
            _ = cancel.cancelled() => return,
            received = changes.recv() => received,
        };
        match received {
            Ok(change) => {
                if change.event != EventType::Deleted && is_ephemeral_resource(&change.resource) {
                    aggregator.enqueue(change.namespace.as_str());
                }
            }
            Err(Lagged(missed)) => {
                tracing::warn!(
                    missed,
                    "aggregation fell behind the change feed; re-enqueuing every namespace"
                );
                enqueue_all(backend, aggregator, cancel, Sweep::Ephemerals).await;
            }
        }
    }
}

/// Runs in-process aggregation on `store` until `cancel` fires (the entry point of
/// `reports-server serve`), with the default lease timing.
#[tracing::instrument(name = "in_process_aggregation", skip_all)]
pub async fn run_in_process(
    store: Store,
    config: AggregatorConfig,
    metrics: Metrics,
    cluster: Option<ClusterAccess>,
    cancel: CancellationToken,
) {
    // A server started while its database was down starts aggregating once the store started.
    tokio::select! {
        () = store.health().came_up() => {}
        () = cancel.cancelled() => return,
    }
    let mut aggregator = InProcessMerger::new(store, config, metrics);
    if let Some(cluster) = cluster {
        aggregator = aggregator.with_cluster(cluster);
    }
    aggregator.run(cancel).await
}
