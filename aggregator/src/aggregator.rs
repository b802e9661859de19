//! The glue between queue, backend and merge: what a worker does for one namespace.

use std::sync::Arc;
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::backend::{AggregationBackend, Applied, InputPage, PageRequest};
use crate::error::Error;
use crate::merge::{
    Layout, MergeInput, MergeOptions, MergeStats, Plan, merge_namespace, merge_page,
};
use crate::metrics::{Metrics, Operation};
use crate::queue::{QueueConfig, WorkQueue};

/// Default number of subjects per page in the per-resource layout.
pub const DEFAULT_PAGE_SIZE: usize = 500;

/// Everything configurable about the running aggregator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AggregatorConfig {
    pub queue: QueueConfig,
    pub merge: MergeOptions,
    /// Subjects per page (per-resource layout).
    pub page_size: usize,
}

impl Default for AggregatorConfig {
    fn default() -> Self {
        AggregatorConfig {
            queue: QueueConfig::default(),
            merge: MergeOptions::default(),
            page_size: DEFAULT_PAGE_SIZE,
        }
    }
}

/// What one reconcile did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileOutcome {
    pub created: usize,
    pub updated: usize,
    pub deleted: usize,
    pub ephemerals_deleted: usize,
    /// Ephemeral reports merged but left in place: rewritten since they were loaded.
    pub ephemerals_rewritten: usize,
    pub conflicts: usize,
    /// Number of plans applied (one per page with changes).
    pub applies: usize,
    pub stats: MergeStats,
}

impl ReconcileOutcome {
    /// What one applied plan did (an empty plan is not sent to the backend).
    fn of(plan: &Plan, applied: Applied) -> Self {
        ReconcileOutcome {
            created: plan.creates.len(),
            updated: plan.updates.len(),
            deleted: plan.deletes.len(),
            ephemerals_deleted: plan
                .ephemeral_deletes
                .len()
                .saturating_sub(applied.ephemerals_rewritten),
            ephemerals_rewritten: applied.ephemerals_rewritten,
            conflicts: plan.conflicts.len(),
            applies: usize::from(!plan.is_empty()),
            stats: plan.stats.clone(),
        }
    }

    fn add(&mut self, page: &ReconcileOutcome) {
        self.created += page.created;
        self.updated += page.updated;
        self.deleted += page.deleted;
        self.ephemerals_deleted += page.ephemerals_deleted;
        self.ephemerals_rewritten += page.ephemerals_rewritten;
        self.conflicts += page.conflicts;
        self.applies += page.applies;
        self.stats.add(&page.stats);
    }
}

/// Aggregates namespaces on demand: enqueue a namespace (`""` for cluster scope) whenever one
/// of its ephemeral reports, policy reports or the policy set changes; [`Aggregator::run`]
/// merges it after the queue delay.
pub struct Aggregator<B> {
    backend: Arc<B>,
    config: AggregatorConfig,
    metrics: Metrics,
    queue: WorkQueue,
}

impl<B: AggregationBackend> Aggregator<B> {
    pub fn new(backend: Arc<B>, config: AggregatorConfig, metrics: Metrics) -> Arc<Self> {
        let queue = WorkQueue::new(config.queue.clone(), Some(metrics.clone()));
        Arc::new(Aggregator {
            backend,
            config,
            metrics,
            queue,
        })
    }

    /// The queue, to enqueue namespaces from event handlers.
    pub fn queue(&self) -> &WorkQueue {
        &self.queue
    }

    /// Shorthand for `queue().enqueue(namespace)`.
    pub fn enqueue(&self, namespace: &str) {
        self.queue.enqueue(namespace);
    }

    pub fn config(&self) -> &AggregatorConfig {
        &self.config
    }

    /// Merges one namespace now and applies the result.
    ///
    /// Per-resource layout: page by page, each page's plan applied on its own, so memory is
    /// bounded by the page size. If the first page holds multi-subject reports (per-policy
    /// reports from an older Kyverno, or from a switch of layout), the namespace is merged in
    /// one piece instead so that their results move to per-resource reports without loss.
    /// Per-policy layout: always in one piece (a policy's report spans all subjects).
    #[tracing::instrument(name = "merge", skip(self))]
    pub async fn reconcile(&self, namespace: &str) -> Result<ReconcileOutcome, Error> {
        let started = Instant::now();
        let result = self.reconcile_inner(namespace).await;
        self.metrics
            .reconcile_duration
            .observe(started.elapsed().as_secs_f64());
        match &result {
            Ok(outcome) if outcome.conflicts > 0 => {
                tracing::warn!(
                    namespace,
                    conflicts = outcome.conflicts,
                    "reports not written: names taken by reports not managed by kyverno"
                );
            }
            Ok(_) => {}
            Err(_) => {
                self.metrics.errors.inc();
            }
        }
        result
    }

    /// Counts what one applied plan wrote, as soon as it is written: the pages of a pass that
    /// fails later stay written, and the metrics say so.
    fn record(&self, page: &ReconcileOutcome) {
        let m = &self.metrics;
        m.results_merged.inc_by(page.stats.results_out as u64);
        m.record_written(Operation::Create, page.created);
        m.record_written(Operation::Update, page.updated);
        m.record_written(Operation::Delete, page.deleted);
        m.ephemeral_reports_deleted
            .inc_by(page.ephemerals_deleted as u64);
        m.ephemeral_reports_rewritten
            .inc_by(page.ephemerals_rewritten as u64);
        m.conflicts.inc_by(page.conflicts as u64);
    }

    #[tracing::instrument(name = "load_page", level = "debug", skip_all, fields(continued = token.is_some()))]
    async fn load(&self, namespace: &str, token: Option<&str>) -> Result<InputPage, Error> {
        let request = PageRequest {
            namespace,
            report_kind: self.config.merge.output.kind_for(namespace),
            continue_token: token,
            limit: self.config.page_size.max(1),
        };
        let page = self.backend.load_page(request).await?;
        tracing::debug!(
            reports = page.reports.len(),
            ephemerals = page.ephemerals.len(),
            more = page.next.is_some(),
            "page loaded"
        );
        Ok(page)
    }

    #[tracing::instrument(name = "apply_plan", level = "debug", skip_all)]
    async fn apply(&self, plan: &Plan, outcome: &mut ReconcileOutcome) -> Result<(), Error> {
        let applied = if plan.is_empty() {
            Applied::default()
        } else {
            tracing::debug!(
                creates = plan.creates.len(),
                updates = plan.updates.len(),
                deletes = plan.deletes.len(),
                ephemerals_consumed = plan.ephemeral_deletes.len(),
                "applying the plan"
            );
            let applied = self.backend.apply(plan).await?;
            if applied.ephemerals_rewritten > 0 {
                tracing::debug!(
                    rewritten = applied.ephemerals_rewritten,
                    "ephemeral reports rewritten during the merge: left for the next pass"
                );
            }
            applied
        };
        let page = ReconcileOutcome::of(plan, applied);
        self.record(&page);
        outcome.add(&page);
        Ok(())
    }

    async fn reconcile_inner(&self, namespace: &str) -> Result<ReconcileOutcome, Error> {
        let policies = self.backend.policies().await?;
        let options = &self.config.merge;
        let mut outcome = ReconcileOutcome::default();
        let mut page = self.load(namespace, None).await?;
        let multi_subject = page.reports.iter().any(|r| {
            r.is_managed()
                && r.scope()
                    .and_then(|s| s.uid.as_deref())
                    .is_none_or(str::is_empty)
        });
        if options.layout == Layout::PerResource && !multi_subject {
            loop {
                let plan = tracing::debug_span!("plan").in_scope(|| {
                    let plan = merge_page(
                        &MergeInput {
                            namespace,
                            reports: &page.reports,
                            ephemerals: &page.ephemerals,
                            policies: policies.as_ref(),
                        },
                        options,
                    );
                    if let Ok(plan) = &plan {
                        planned(plan);
                    }
                    plan
                })?;
                self.apply(&plan, &mut outcome).await?;
                let Some(next) = page.next.take() else {
                    break;
                };
                page = self.load(namespace, Some(&next)).await?;
            }
            return Ok(outcome);
        }
        let mut all = InputPage::default();
        loop {
            all.reports.append(&mut page.reports);
            all.ephemerals.append(&mut page.ephemerals);
            let Some(next) = page.next.take() else {
                break;
            };
            page = self.load(namespace, Some(&next)).await?;
        }
        let plan = tracing::debug_span!("plan").in_scope(|| {
            let plan = merge_namespace(
                &MergeInput {
                    namespace,
                    reports: &all.reports,
                    ephemerals: &all.ephemerals,
                    policies: policies.as_ref(),
                },
                options,
            );
            planned(&plan);
            plan
        });
        self.apply(&plan, &mut outcome).await?;
        Ok(outcome)
    }

    /// Runs the workers until `cancel` fires.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        let this = self.clone();
        self.queue
            .run(
                move |namespace: String| {
                    let this = this.clone();
                    async move {
                        let outcome = this.reconcile(&namespace).await?;
                        tracing::debug!(namespace, ?outcome, "namespace aggregated");
                        Ok::<(), Error>(())
                    }
                },
                cancel,
            )
            .await;
    }
}

/// What a merge decided, logged inside its `plan` span.
fn planned(plan: &Plan) {
    tracing::debug!(
        creates = plan.creates.len(),
        updates = plan.updates.len(),
        deletes = plan.deletes.len(),
        ephemerals_consumed = plan.ephemeral_deletes.len(),
        conflicts = plan.conflicts.len(),
        results_out = plan.stats.results_out,
        "planned"
    );
}
