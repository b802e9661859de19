//! [`ClusterAggregator`]: the Lease, the watches, adoption and the workers, together.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

use futures::StreamExt;
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams};
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::adoption::{Adopter, AdoptionConfig, ApiEphemeralReports};
use super::backend::{KubeBackend, KubeBackendConfig};
use super::discovery::{DEFAULT_TTL, DiscoveryCache, Target};
use super::metrics::ClusterMetrics;
use super::policies::{DEFAULT_REDISCOVERY, PolicyWatcher, next_change};
use super::resources::{api_resource, list_metadata_all};
use super::{ClusterError, http};
use crate::aggregator::{Aggregator, AggregatorConfig};
use crate::metrics::Metrics;
use crate::queue::WorkQueue;
use crate::report::{LABEL_MANAGED_BY, MANAGED_BY_VALUE, ReportKind};
use crate::sweep::sweep_namespaces;
use reports_server_election::kube_lease::{self as lease, LeaseConfig};

/// How long a new leader waits for the initial policy lists before aggregating anyway (kinds
/// still not listed then are unknown: none of their results is dropped).
pub const DEFAULT_POLICY_SYNC_TIMEOUT: Duration = Duration::from_secs(30);

/// Everything configurable about the cluster aggregator.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Queue, merge and page settings. `merge.adopt_unowned` is ignored: un-owned admission
    /// reports are adopted through the API (see [`super::adoption`]) before they are merged,
    /// as Kyverno does.
    pub aggregator: AggregatorConfig,
    pub backend: KubeBackendConfig,
    pub lease: LeaseConfig,
    pub adoption: AdoptionConfig,
    /// Filter results against the cluster's policies; `false` keeps every result (policy set
    /// unknown), for clusters where the aggregator may not read policies.
    pub watch_policies: bool,
    pub policy_sync_timeout: Duration,
    /// Where to serve `/metrics` and `/healthz`; `None`: nowhere.
    pub metrics_address: Option<SocketAddr>,
}

/// Aggregation of a cluster's ephemeral reports through its API.
pub struct ClusterAggregator {
    client: Client,
    config: ClusterConfig,
    registry: Arc<Registry>,
    metrics: Metrics,
    cluster_metrics: ClusterMetrics,
}

impl ClusterAggregator {
    pub fn new(client: Client, config: ClusterConfig) -> Self {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let cluster_metrics = ClusterMetrics::register(&mut registry);
        ClusterAggregator {
            client,
            config,
            registry: Arc::new(registry),
            metrics,
            cluster_metrics,
        }
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn cluster_metrics(&self) -> &ClusterMetrics {
        &self.cluster_metrics
    }

    fn output_kinds(&self) -> [ReportKind; 2] {
        let output = self.config.aggregator.merge.output;
        [output.kind_for("ns"), output.kind_for("")]
    }

    /// Fails unless the cluster serves the ephemeral reports and the reports to write.
    pub async fn check_resources(&self) -> Result<(), ClusterError> {
        let discovery = DiscoveryCache::new(self.client.clone(), DEFAULT_TTL);
        let needed = [
            ReportKind::EphemeralReport,
            ReportKind::ClusterEphemeralReport,
        ]
        .into_iter()
        .chain(self.output_kinds());
        for kind in needed {
            let ar = api_resource(kind);
            let served = discovery
                .resolve(&ar.group, &ar.version, &Target::Resource(ar.plural.clone()))
                .await
                .map_err(|e| ClusterError::kube(format!("discovery of {}", ar.api_version), e))?;
            if served.is_none() {
                return Err(ClusterError::MissingResource {
                    resource: format!("{} ({})", ar.plural, ar.api_version),
                });
            }
        }
        Ok(())
    }

    /// Binds the metrics endpoint (if configured) and returns the bound address; the endpoint
    /// serves until `cancel` fires.
    pub async fn serve_metrics(
        &self,
        cancel: &CancellationToken,
    ) -> Result<Option<SocketAddr>, ClusterError> {
        let Some(address) = self.config.metrics_address else {
            return Ok(None);
        };
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .map_err(|source| ClusterError::MetricsBind { address, source })?;
        let bound = listener
            .local_addr()
            .map_err(|source| ClusterError::MetricsBind { address, source })?;
        let registry = self.registry.clone();
        let cancel = cancel.clone();
        tokio::spawn(
            async move {
                if let Err(e) = http::serve(listener, registry, cancel).await {
                    tracing::error!(error = %e, "metrics endpoint failed");
                }
            }
            .instrument(tracing::info_span!("metrics_endpoint")),
        );
        Ok(Some(bound))
    }

    /// Runs until `cancel` fires: checks the cluster, serves metrics, and aggregates whenever
    /// this process holds the Lease.
    #[tracing::instrument(name = "aggregation", skip_all)]
    pub async fn run(self, cancel: CancellationToken) -> Result<(), ClusterError> {
        self.check_resources().await?;
        if let Some(address) = self.serve_metrics(&cancel).await? {
            tracing::info!(%address, "serving /metrics and /healthz");
        }
        let elector = lease::elector(self.client.clone(), &self.config.lease);
        let leader = self.cluster_metrics.leader.clone();
        elector
            .run(
                cancel,
                |term| self.lead(term),
                |leading| {
                    leader.set(i64::from(leading));
                },
            )
            .await;
        Ok(())
    }

    /// One leadership term: everything stops when `term` fires.
    async fn lead(&self, term: CancellationToken) {
        let policies = if self.config.watch_policies {
            let watcher = PolicyWatcher::new(self.cluster_metrics.clone());
            tokio::spawn(
                watcher
                    .clone()
                    .run(self.client.clone(), term.clone(), DEFAULT_REDISCOVERY)
                    .instrument(tracing::info_span!("policy_watcher")),
            );
            if !watcher.wait_synced(self.config.policy_sync_timeout).await {
                tracing::warn!(pending = ?watcher.pending_kinds(), "policies not listed in time; aggregating with those kinds unknown (none of their results dropped)");
            }
            watcher.policies()
        } else {
            watch::channel(None).1
        };
        let mut config = self.config.aggregator.clone();
        config.merge.adopt_unowned = false;
        let backend = Arc::new(KubeBackend::new(
            self.client.clone(),
            policies.clone(),
            self.config.backend.clone(),
        ));
        let aggregator = Aggregator::new(backend, config, self.metrics.clone());
        let adopter = Arc::new(Adopter::new(
            ApiEphemeralReports::new(self.client.clone(), self.config.backend.list_page_size),
            self.client.clone(),
            DiscoveryCache::new(self.client.clone(), DEFAULT_TTL),
            self.config.adoption.clone(),
            self.cluster_metrics.clone(),
            self.config.backend.concurrency,
        ));

        let handler = {
            let aggregator = aggregator.clone();
            move |namespace: String| {
                let aggregator = aggregator.clone();
                let adopter = adopter.clone();
                async move { adopter.adopt_and_reconcile(&aggregator, &namespace).await }
            }
        };
        let workers = aggregator.queue().run(handler, term.clone());
        let ephemerals = self.watch_ephemerals(&aggregator, &term);
        let initial = async {
            self.enqueue_all(&aggregator, &term).await;
        };
        let policy_changes = self.follow_policies(&aggregator, policies, &term);
        tokio::join!(workers, ephemerals, initial, policy_changes);
        self.metrics.queue_depth.set(0);
    }

    /// Namespaces holding managed final reports (`""` for cluster-scoped ones).
    async fn namespaces_with_reports(&self) -> Result<BTreeSet<String>, kube::Error> {
        let params = ListParams::default()
            .labels(&format!("{LABEL_MANAGED_BY}={MANAGED_BY_VALUE}"))
            .limit(self.config.backend.list_page_size.max(1));
        let mut namespaces = BTreeSet::new();
        for kind in self.output_kinds() {
            let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &api_resource(kind));
            if kind.is_cluster_scoped() {
                if !api
                    .list_metadata(&params.clone().limit(1))
                    .await?
                    .items
                    .is_empty()
                {
                    namespaces.insert(String::new());
                }
            } else {
                for item in list_metadata_all(&api, &params).await? {
                    namespaces.insert(item.metadata.namespace.unwrap_or_default());
                }
            }
        }
        Ok(namespaces)
    }

    /// Enqueues every namespace with managed reports (the ephemeral watches' initial lists
    /// enqueue those with ephemeral reports); retries until it worked or `term` fires.
    async fn enqueue_all(&self, aggregator: &Aggregator<KubeBackend>, term: &CancellationToken) {
        sweep_namespaces(aggregator.queue(), term, "with policy reports", || {
            self.namespaces_with_reports()
        })
        .await;
    }

    async fn follow_policies(
        &self,
        aggregator: &Aggregator<KubeBackend>,
        mut policies: watch::Receiver<Option<crate::PolicySet>>,
        term: &CancellationToken,
    ) {
        policies.borrow_and_update();
        while next_change(&mut policies, term).await.is_some() {
            tracing::info!("policy set changed; enqueuing every namespace with policy reports");
            self.enqueue_all(aggregator, term).await;
        }
    }

    /// Metadata-only watches on both ephemeral kinds; every added or modified report enqueues
    /// its namespace.
    async fn watch_ephemerals(
        &self,
        aggregator: &Aggregator<KubeBackend>,
        term: &CancellationToken,
    ) {
        let queue = aggregator.queue();
        tokio::join!(
            enqueue_changed_namespaces(&self.client, ReportKind::EphemeralReport, queue, term),
            enqueue_changed_namespaces(
                &self.client,
                ReportKind::ClusterEphemeralReport,
                queue,
                term
            )
        );
    }
}

/// Watches `kind` until `term` fires and enqueues the namespace (`""` for cluster scope) of
/// every object listed, added or modified; deletions are ignored (see the module docs of
/// `cluster`).
///
/// Only the namespace of an object matters here, so the lists and watches ask for
/// `PartialObjectMetadata` and report bodies (their results are most of their size) never cross
/// the wire. With kube ≥ 5 that is a plain `watcher` over an `Api<PartialObjectMeta<_>>`: the
/// type makes every request metadata-only, and `kube::runtime::metadata_watcher` is deprecated
/// in its favour (it sends the same requests). `tests/cluster_api.rs` checks the `Accept`
/// headers.
pub async fn enqueue_changed_namespaces(
    client: &Client,
    kind: ReportKind,
    queue: &WorkQueue,
    term: &CancellationToken,
) {
    let api: Api<PartialObjectMeta<DynamicObject>> =
        Api::all_with(client.clone(), &api_resource(kind));
    let mut events = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut failing = false;
    loop {
        let event = tokio::select! {
            _ = term.cancelled() => return,
            event = events.next() => event,
        };
        match event {
            None => return,
            Some(Ok(Event::Apply(o) | Event::InitApply(o))) => {
                failing = false;
                queue.enqueue(o.metadata.namespace.unwrap_or_default());
            }
            Some(Ok(_)) => failing = false,
            Some(Err(e)) => {
                if !failing {
                    tracing::warn!(%kind, error = %e, "cannot watch ephemeral reports; retrying");
                }
                failing = true;
            }
        }
    }
}
