//! The statistics worker: one server per cluster (a lease row in the database, like the
//! in-process aggregator's) reads the counts of stored objects and results at an interval and
//! publishes them as gauges, and takes compliance history snapshots (`query trend`).
//!
//! Why a lease holder and not every replica: every replica reads the same database, so gauges
//! from all of them would count each report once per replica, and snapshots would be written
//! several times. The reads are `GROUP BY`s over the results, which a low interval keeps cheap
//! (docs/operations.md "Metrics" says what they cost); an exporter that lists every report
//! through the API is no longer needed.
//!
//! Time comes from a [`Clock`], so the history's schedule is tested with a controlled clock;
//! the decisions themselves are pure ([`schedule`]). A snapshot is recorded under the start of
//! its slot, which is also what makes it unique: two servers that both believe they lead write
//! one snapshot per slot between them.

pub mod gauges;
pub mod schedule;

use std::sync::Arc;
use std::time::{Duration, Instant};

use reports_server_election::{ElectionTiming, Elector};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use gauges::StatisticsMetrics;

use crate::store::lease::StoreLease;
use crate::store::statistics::SnapshotOutcome;
use crate::store::{Store, StoreError};

/// How soon a failed round is tried again at the latest.
pub const RETRY_AFTER: Duration = Duration::from_secs(30);

/// The wall clock in Unix seconds.
pub trait Clock: Send + Sync {
    fn now(&self) -> i64;
}

/// The system's clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0)
    }
}

/// What the worker does and how often (flags of `serve`, documented in docs/operations.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatisticsOptions {
    /// Between reads of the counts for the gauges; zero publishes none.
    pub refresh_interval: Duration,
    /// Between compliance snapshots (slots from the epoch); zero takes none.
    pub history_interval: Duration,
    /// Snapshots older than this are deleted; zero keeps them all.
    pub history_retention: Duration,
    pub lease: ElectionTiming,
}

impl Default for StatisticsOptions {
    fn default() -> Self {
        StatisticsOptions {
            refresh_interval: Duration::from_secs(60),
            history_interval: Duration::from_secs(86_400),
            history_retention: Duration::from_secs(90 * 86_400),
            lease: ElectionTiming::default(),
        }
    }
}

impl StatisticsOptions {
    /// Whether there is anything to do.
    pub fn enabled(&self) -> bool {
        !self.refresh_interval.is_zero() || !self.history_interval.is_zero()
    }

    /// A retention shorter than the interval would delete each snapshot before the next, and
    /// then take it again at once: refused.
    pub fn check(&self) -> Result<(), String> {
        let (interval, retention) = (self.history_interval, self.history_retention);
        if !interval.is_zero() && !retention.is_zero() && retention < interval {
            return Err(format!(
                "--history-retention ({}s) is shorter than --history-interval ({}s): every \
                 snapshot would be deleted before the next; keep at least one interval, or 0 \
                 for no limit",
                retention.as_secs(),
                interval.as_secs()
            ));
        }
        Ok(())
    }
}

/// Runs the statistics of one store while it holds the lease `statistics/<cluster id>`.
pub struct StatisticsWorker {
    store: Store,
    options: StatisticsOptions,
    metrics: StatisticsMetrics,
    clock: Arc<dyn Clock>,
    holder: String,
}

impl StatisticsWorker {
    pub fn new(store: Store, options: StatisticsOptions, metrics: StatisticsMetrics) -> Self {
        let host = std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "reports-server".into());
        StatisticsWorker {
            store,
            options,
            metrics,
            clock: Arc::new(SystemClock),
            holder: format!("{host}/{}/{}", std::process::id(), uuid::Uuid::new_v4()),
        }
    }

    /// Reads time from `clock` instead of the system's (tests).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Runs until `cancel`: campaigns for the lease and works while holding it.
    pub async fn run(self, cancel: CancellationToken) {
        let lease = StoreLease::new(
            self.store.clone(),
            format!("statistics/{}", self.store.cluster_id()),
            self.holder.clone(),
        );
        let elector = Elector::new(lease, self.options.lease);
        let metrics = self.metrics.clone();
        elector
            .run(
                cancel,
                |term| self.lead(term),
                |leading| metrics.set_leading(leading),
            )
            .await;
        self.metrics.set_leading(false);
    }

    /// One term: a round at once, then one per refresh interval or history slot, whichever
    /// comes first; after a failed round, again within [`RETRY_AFTER`] (a daily snapshot that
    /// failed is not put off to the next day).
    async fn lead(&self, term: CancellationToken) {
        loop {
            let wait = if self.round().await {
                self.next_wait()
            } else {
                self.next_wait().min(RETRY_AFTER)
            };
            tokio::select! {
                () = term.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    fn next_wait(&self) -> Duration {
        let o = &self.options;
        let history = (!o.history_interval.is_zero())
            .then(|| schedule::until_next_slot(self.clock.now(), o.history_interval));
        let refresh = (!o.refresh_interval.is_zero()).then_some(o.refresh_interval);
        match (refresh, history) {
            (Some(r), Some(h)) => r.min(h),
            (Some(w), None) | (None, Some(w)) => w,
            // Nothing to do: `serve` does not start the worker then.
            (None, None) => Duration::from_secs(3_600),
        }
    }

    /// Refreshes the gauges and takes a snapshot when one is due; a failure is logged and
    /// counted, and `false` asks for an early retry.
    pub async fn round(&self) -> bool {
        let mut ok = true;
        if !self.options.refresh_interval.is_zero()
            && let Err(e) = self.refresh().await
        {
            self.metrics.failed();
            tracing::warn!(error = %e, "cannot read the counts for the statistics gauges");
            ok = false;
        }
        if let Err(e) = self.history().await {
            self.metrics.failed();
            tracing::warn!(error = %e, "cannot take or prune the compliance history");
            ok = false;
        }
        ok
    }

    async fn refresh(&self) -> Result<(), StoreError> {
        let started = Instant::now();
        let objects = self.store.object_counts().await?;
        let results = self.store.result_counts().await?;
        let took = started.elapsed().as_secs_f64();
        self.metrics
            .publish(&objects, &results, self.clock.now(), took);
        Ok(())
    }

    async fn history(&self) -> Result<(), StoreError> {
        let o = &self.options;
        if o.history_interval.is_zero() {
            return Ok(());
        }
        let now = self.clock.now();
        let last = self.store.last_compliance_snapshot().await?;
        if schedule::snapshot_due(last, now, o.history_interval) {
            let slot = schedule::slot_of(now, o.history_interval);
            match self.store.take_compliance_snapshot(slot).await? {
                SnapshotOutcome::Taken { rows } => {
                    self.metrics.snapshot_taken(rows);
                    tracing::info!(slot, rows, "compliance history snapshot taken");
                }
                SnapshotOutcome::Exists => {}
            }
        }
        if let Some(before) = schedule::prune_before(now, o.history_retention) {
            let pruned = self.store.prune_compliance_history(before).await?;
            if pruned > 0 {
                tracing::info!(
                    pruned,
                    before,
                    "compliance history snapshots past retention deleted"
                );
            }
        }
        Ok(())
    }
}

/// Starts the worker as a task once the store has started (a server started while its
/// database was down begins when the database answers). `None` when disabled.
pub fn spawn(
    worker: StatisticsWorker,
    cancel: CancellationToken,
) -> Option<tokio::task::JoinHandle<()>> {
    if !worker.options.enabled() {
        return None;
    }
    let health = worker.store.health().clone();
    Some(tokio::spawn(
        async move {
            tokio::select! {
                () = health.came_up() => worker.run(cancel).await,
                () = cancel.cancelled() => {}
            }
        }
        .instrument(tracing::info_span!("statistics")),
    ))
}
