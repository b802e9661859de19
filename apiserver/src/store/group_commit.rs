//! Group commit: the writes that arrive while a transaction is open share the next one.
//!
//! One write per transaction pays a commit (an fsync) and five round trips under the store's
//! write lock, and the lock holder's continuation waits behind other requests' JSON work on the
//! runtime's threads: with more clients, fewer writes per second got through. Here the writers
//! queue their targets and one *leader* task (spawned when the queue fills, ending when it
//! empties) runs a round for everything queued:
//!
//! 1. it opens a transaction, takes the counter's row lock, and reads the version of every
//!    target in a few statements;
//! 2. it takes each writer whose targets are still at the versions the writer decided on
//!    (writers queue decisions made outside the round, see `mutate`), and offers the others the
//!    current bodies; such a writer decides again in its own task, with its own borrowed
//!    closure, and answers with its mutations, or declines (its decision failed: it returns its
//!    own error, and nothing of it is written, so a failing write fails alone; or deciding is
//!    too costly to do while the round waits: it decides outside and queues again);
//! 3. it applies the accepted mutations in order, each with its own resourceVersion and
//!    change-log entry (so versions stay gapless and commit-ordered), and commits once.
//!
//! If a statement or the commit fails, the round is rolled back and each accepted writer is
//! retried alone with the mutations it already decided, provided its targets are still at the
//! versions it decided on: the writer whose statement fails gets the error, the others commit.
//! A round never holds two writes to one object (a later writer to the same object waits for
//! the next round, so it decides on the earlier one's result).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use reports_server_crds::ResourceDescriptor;
use sea_orm::sea_query::{Expr, ExprTrait, Query, SelectStatement, UnionType};
use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction, TransactionTrait};
use tokio::sync::oneshot;
use tracing::Instrument;

use super::columns::{RuleKey, result_rules};
use super::decision::Seen;
use super::decision::{Applied, Current, Decided, Mutation, StoredResults, Target, WriteOutcome};
use super::feed::{Change, EventType};
use super::policy_rules::RoundRules;
use super::result_diff::StoredRows;
use super::schema::Objects;
use super::staged::StagedWrites;
use super::stored_rows::Replaced;
use super::write::{lock_counter, now_unix};
use super::{Store, StoreError};

/// Keys per current-row read: bind parameters stay far below every backend's limit, and the
/// `UNION ALL` terms below SQLite's 500 (`SQLITE_MAX_COMPOUND_SELECT`).
const KEYS_PER_READ: usize = 200;

/// The current rows of `targets` (their bodies if `with_bodies`): one full-key lookup per
/// target, joined by `UNION ALL`, so that every backend seeks the unique key once per target
/// whatever its statistics say. With one `SELECT … WHERE (…) OR (…)`, SQLite scanned every object
/// of the cluster when the cluster was outside the terms (creates slowed as the store grew: 388
/// reports/s over 100,000 where the first 10,000 went at 1,700/s), and PostgreSQL, on a table not
/// yet analyzed (a new store, or a resource new to it), scanned every object of the resource
/// through the key's prefix and filtered the terms: 2,000 buffers a round at 10,000 reports.
fn current_rows_query(
    cluster_id: &str,
    targets: &[&OwnedTarget],
    with_bodies: bool,
) -> SelectStatement {
    let lookup = |t: &OwnedTarget| {
        let mut query = Query::select();
        query.columns([
            Objects::Id,
            Objects::Resource,
            Objects::Namespace,
            Objects::Name,
            Objects::ResourceVersion,
        ]);
        if with_bodies {
            query.column(Objects::Body);
        }
        query
            .from(Objects::Table)
            .and_where(Expr::col(Objects::ClusterId).eq(cluster_id))
            .and_where(Expr::col(Objects::Resource).eq(t.key.as_str()))
            .and_where(Expr::col(Objects::Namespace).eq(t.namespace.as_str()))
            .and_where(Expr::col(Objects::Name).eq(t.name.as_str()));
        query
    };
    let (first, rest) = targets
        .split_first()
        .expect("a current-row read names at least one target");
    let mut query = lookup(first);
    query.unions(rest.iter().map(|t| (UnionType::All, lookup(t))));
    query
}

/// One writer's place in the queue.
pub(super) struct Request {
    targets: Vec<OwnedTarget>,
    presumed: Presumed,
    /// Whether the round took the presumed decisions, or why the round could not start.
    offer: oneshot::Sender<Result<Admission, StoreError>>,
    decision: oneshot::Receiver<Vec<Decided>>,
    done: oneshot::Sender<Result<Vec<WriteOutcome>, StoreError>>,
    commit_sent: CommitSent,
}

/// A writer's decisions, made on its targets at `versions` (`None`: no such object).
pub(super) struct Presumed {
    pub versions: Vec<Option<i64>>,
    pub decided: Vec<Decided>,
    /// The result rows of the reports it replaces, as it read them (`None`: not read).
    pub stored: Vec<Option<StoredResults>>,
}

/// What a round makes of a writer's presumed decisions.
pub(super) enum Admission {
    /// Its targets are as it saw them: the round writes its decisions.
    Accepted,
    /// A target changed: decide on these rows (`None`: no such object), or decline.
    Changed(Vec<Option<Seen>>),
}

/// The writer's ends of a [`Request`]'s channels.
pub(super) struct Ticket {
    pub offer: oneshot::Receiver<Result<Admission, StoreError>>,
    pub decision: oneshot::Sender<Vec<Decided>>,
    pub done: Outcome,
}

/// The writer's side of its round's outcome.
pub(super) struct Outcome {
    receiver: oneshot::Receiver<Result<Vec<WriteOutcome>, StoreError>>,
    commit_sent: CommitSent,
}

impl Outcome {
    /// The round's answer. A round that ended without one (abandoned when an outage began)
    /// may have committed only if it had sent the COMMIT.
    pub(super) async fn wait(self) -> Result<Vec<WriteOutcome>, StoreError> {
        self.receiver.await.unwrap_or_else(|_| {
            Err(if self.commit_sent.is_set() {
                StoreError::Ambiguous("the write's group commit round ended before it reported".into())
            } else {
                StoreError::unavailable(
                    "the database stopped answering before this write was committed; it was not stored: retry the request",
                )
            })
        })
    }
}

/// Set just before the COMMIT of the transaction holding a writer's changes is sent. A round
/// that ends without a word before then (abandoned when an outage began) stored nothing of
/// it; after, the outcome is unknown.
#[derive(Clone, Default)]
pub(super) struct CommitSent(Arc<AtomicBool>);

impl CommitSent {
    fn mark(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Clone)]
pub(super) struct OwnedTarget {
    resource: &'static ResourceDescriptor,
    key: String,
    namespace: String,
    name: String,
}

impl OwnedTarget {
    /// `targets`, owned; fails when one is named twice: one writer's decisions are all made
    /// on the state before its write.
    pub(super) fn all_of(targets: &[Target<'_>]) -> Result<Vec<OwnedTarget>, StoreError> {
        let mut seen = HashSet::with_capacity(targets.len());
        let mut owned = Vec::with_capacity(targets.len());
        for t in targets {
            let key = Store::resource_key(t.resource);
            if !seen.insert((key.clone(), t.namespace, t.name)) {
                return Err(StoreError::Inconsistent(format!(
                    "one write names {key} {}/{} twice; write it once per batch",
                    t.namespace, t.name
                )));
            }
            owned.push(OwnedTarget {
                resource: t.resource,
                key,
                namespace: t.namespace.to_owned(),
                name: t.name.to_owned(),
            });
        }
        Ok(owned)
    }

    fn target(&self) -> Target<'_> {
        Target {
            resource: self.resource,
            namespace: &self.namespace,
            name: &self.name,
        }
    }

    fn identity(&self) -> (&str, &str, &str) {
        (&self.key, &self.namespace, &self.name)
    }
}

/// The writers waiting for a round, and whether a leader is running one.
#[derive(Default)]
pub(super) struct CommitQueue {
    state: Mutex<QueueState>,
    metrics: RoundMetrics,
}

/// `/metrics` of the rounds: how well writes group, and what a round costs.
#[derive(Clone)]
struct RoundMetrics {
    writes: Histogram,
    seconds: Histogram,
    retried: Counter,
    changed: Counter,
}

impl Default for RoundMetrics {
    fn default() -> Self {
        RoundMetrics {
            writes: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
            seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            retried: Counter::default(),
            changed: Counter::default(),
        }
    }
}

impl CommitQueue {
    /// Adds the round metrics to a `/metrics` registry.
    pub(super) fn register(&self, registry: &mut Registry) {
        let m = &self.metrics;
        registry.register(
            "reports_server_store_group_commit_writes",
            "Objects written per group commit round (one transaction, one commit)",
            m.writes.clone(),
        );
        registry.register(
            "reports_server_store_group_commit_round_seconds",
            "Time of a group commit round, from opening its transaction to its commit",
            m.seconds.clone(),
        );
        registry.register(
            "reports_server_store_group_commit_retried_rounds",
            "Rounds rolled back by a failing statement and retried one writer at a time",
            m.retried.clone(),
        );
        registry.register(
            "reports_server_store_group_commit_changed_targets",
            "Writers whose objects were not as they decided on (changed since their read, or found by a create that presumed none), which decided again",
            m.changed.clone(),
        );
    }
}

#[derive(Default)]
struct QueueState {
    waiting: VecDeque<Request>,
    leading: bool,
}

/// A writer that has decided, waiting for the round's outcome.
struct Accepted {
    targets: Vec<OwnedTarget>,
    currents: Vec<Option<Current>>,
    decided: Vec<Decided>,
    /// The writer's read of the rows its puts replace; taken by the first round that writes it.
    stored: Vec<Option<StoredResults>>,
    done: oneshot::Sender<Result<Vec<WriteOutcome>, StoreError>>,
    commit_sent: CommitSent,
}

impl Store {
    /// Queues a write of `targets` decided as `presumed`, and starts a leader if none is
    /// running.
    pub(super) fn enqueue(&self, targets: Vec<OwnedTarget>, presumed: Presumed) -> Ticket {
        let (offer_tx, offer) = oneshot::channel();
        let (decision, decision_rx) = oneshot::channel();
        let (done_tx, done) = oneshot::channel();
        let commit_sent = CommitSent::default();
        let request = Request {
            targets,
            presumed,
            offer: offer_tx,
            decision: decision_rx,
            done: done_tx,
            commit_sent: commit_sent.clone(),
        };
        let start_leader = {
            let mut state = self
                .commit_queue
                .state
                .lock()
                .expect("commit queue poisoned");
            state.waiting.push_back(request);
            !std::mem::replace(&mut state.leading, true)
        };
        if start_leader {
            let store = self.clone();
            tokio::spawn(
                async move { store.lead().await }.instrument(tracing::debug_span!("group_commit")),
            );
        }
        Ticket {
            offer,
            decision,
            done: Outcome {
                receiver: done,
                commit_sent,
            },
        }
    }

    /// Runs rounds until the queue is empty.
    async fn lead(self) {
        // If this task is dropped (runtime shutdown) or panics, the waiting writers must not
        // wait forever: dropping their requests closes their channels, which they report.
        struct Abdicate<'a>(&'a CommitQueue, bool);
        impl Drop for Abdicate<'_> {
            fn drop(&mut self) {
                if self.1 {
                    let mut state = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
                    state.leading = false;
                    state.waiting.clear();
                }
            }
        }
        let mut guard = Abdicate(&self.commit_queue, true);
        loop {
            let batch = {
                let mut state = self
                    .commit_queue
                    .state
                    .lock()
                    .expect("commit queue poisoned");
                let batch = take_round(&mut state.waiting, self.options().group_commit_max_writes);
                if batch.is_empty() {
                    state.leading = false;
                    guard.1 = false;
                    return;
                }
                batch
            };
            self.round(batch).await;
        }
    }

    /// One round, abandoned when an outage begins meanwhile: caught on a connection made
    /// half-open by a network that drops packets, it would hold the write lock until TCP gives
    /// up, and every write after the outage would queue behind it. Its writers learn it from
    /// their dropped channels: unavailable (nothing stored) unless the COMMIT was already sent
    /// ([`CommitSent`]), outcome unknown after.
    async fn round(&self, batch: Vec<Request>) {
        let mut writer = self.write_lock.lock().await;
        // Queued behind a round the outage ended: a new connection would wait for its connect
        // timeout before failing the same way.
        if self.health().circuit_open() {
            for request in batch {
                let refused = StoreError::unavailable(
                    "the database does not answer; this write was not stored: retry later",
                );
                request.offer.send(Err(refused)).ok();
            }
            return;
        }
        let round = self.unless_outage(async {
            self.run_round(&mut writer, batch).await;
            Ok(())
        });
        if let Err(lost) = round.await {
            writer.discard(&lost);
            tracing::warn!(error = %lost, "a group commit round was abandoned; the writer connection is closed");
        }
    }

    async fn run_round(&self, writer: &mut super::Writer, batch: Vec<Request>) {
        let writers = batch.len();
        let began = std::time::Instant::now();
        let opened = match writer.connection(self.options()).await {
            Ok(db) => self.open_round(&db, &batch).await,
            Err(e) => Err(e),
        };
        let (txn, currents) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                writer.discard(&e);
                for request in batch {
                    request.offer.send(Err(e.duplicate())).ok();
                }
                return;
            }
        };
        let (base_rv, currents) = currents;
        let accepted = match self.admit(&txn, batch, currents).await {
            Ok(accepted) => accepted,
            Err(e) => {
                txn.rollback().await.ok();
                writer.discard(&e);
                tracing::warn!(error = %e, writers, "a group commit round failed to start");
                return;
            }
        };
        let mut accepted = accepted;
        if accepted.is_empty() {
            txn.rollback().await.ok();
            return;
        }
        tracing::debug!(writers, accepted = accepted.len(), "group commit round");
        let metrics = &self.commit_queue.metrics;
        let writes: usize = accepted.iter().map(|a| a.targets.len()).sum();
        match self.apply_and_commit(txn, base_rv, &mut accepted).await {
            Ok(outcomes) => {
                metrics.writes.observe(writes as f64);
                metrics.seconds.observe(began.elapsed().as_secs_f64());
                for (writer, outcomes) in accepted.into_iter().zip(outcomes) {
                    writer.done.send(Ok(outcomes)).ok();
                }
            }
            // Whether a failed commit took effect is unknown: retrying could write twice.
            Err(RoundError::Commit(e)) => {
                writer.discard(&e);
                // If it did, the feed must still deliver the round's changes.
                self.feed().wake();
                for writer in accepted {
                    writer.done.send(Err(e.duplicate())).ok();
                }
            }
            Err(RoundError::Statement(e)) if accepted.len() == 1 => {
                writer.discard(&e);
                let writer = accepted.pop().expect("one writer");
                writer.done.send(Err(e)).ok();
            }
            Err(RoundError::Statement(e)) => {
                metrics.retried.inc();
                writer.discard(&e);
                tracing::warn!(error = %e, writers = accepted.len(),
                    "a group commit failed; retrying its writers one at a time");
                for mut accepted in accepted {
                    let result = match writer.connection(self.options()).await {
                        Ok(db) => self.retry_alone(&db, &mut accepted).await,
                        Err(e) => Err(e),
                    };
                    if let Err(e) = &result {
                        writer.discard(e);
                    }
                    accepted.done.send(result).ok();
                }
            }
        }
    }

    /// Takes each writer whose targets are at the versions it decided on; offers the others
    /// the current rows and collects the decisions of those who decide inside the round.
    /// Fails (every writer of the round told why) when the rows cannot be read.
    async fn admit(
        &self,
        txn: &DatabaseTransaction,
        batch: Vec<Request>,
        currents: Vec<Vec<Option<Current>>>,
    ) -> Result<Vec<Accepted>, StoreError> {
        let mut accepted = Vec::with_capacity(batch.len());
        let mut changed = Vec::new();
        for (request, currents) in batch.into_iter().zip(currents) {
            let now = currents.iter().map(|c| c.as_ref().map(|c| c.rv));
            if !now.eq(request.presumed.versions.iter().copied()) {
                changed.push((request, currents));
            } else if request.offer.send(Ok(Admission::Accepted)).is_ok() {
                accepted.push(Accepted {
                    targets: request.targets,
                    currents,
                    decided: request.presumed.decided,
                    stored: request.presumed.stored,
                    done: request.done,
                    commit_sent: request.commit_sent,
                });
            }
        }
        if changed.is_empty() {
            return Ok(accepted);
        }
        self.commit_queue
            .metrics
            .changed
            .inc_by(changed.len() as u64);
        let groups: Vec<&[OwnedTarget]> = changed.iter().map(|(r, _)| &r.targets[..]).collect();
        let rows = match self.read_rows(txn, &groups, true).await {
            Ok(rows) => rows,
            Err(e) => {
                for (request, _) in changed {
                    request.offer.send(Err(e.duplicate())).ok();
                }
                for writer in accepted {
                    writer.done.send(Err(e.duplicate())).ok();
                }
                return Err(e);
            }
        };
        // Offer everyone first, then collect: the writers decide concurrently.
        let mut offered = Vec::with_capacity(changed.len());
        for ((request, currents), rows) in changed.into_iter().zip(rows) {
            let seen = rows.into_iter().map(|r| r.map(Row::seen)).collect();
            if request.offer.send(Ok(Admission::Changed(seen))).is_ok() {
                let waiting = Accepted {
                    targets: request.targets,
                    currents,
                    decided: Vec::new(),
                    stored: request.presumed.stored,
                    done: request.done,
                    commit_sent: request.commit_sent,
                };
                offered.push((waiting, request.decision));
            }
        }
        for (mut waiting, decision) in offered {
            // A writer that declined (its decision failed, or it decides outside) or went away
            // drops its sender.
            if let Ok(decided) = decision.await {
                waiting.decided = decided;
                accepted.push(waiting);
            }
        }
        Ok(accepted)
    }

    /// Opens the round's transaction on the writer connection and reads the targets' versions.
    async fn open_round(
        &self,
        db: &DatabaseConnection,
        batch: &[Request],
    ) -> Result<(DatabaseTransaction, (i64, Vec<Vec<Option<Current>>>)), StoreError> {
        let txn = db.begin().await?;
        let groups: Vec<&[OwnedTarget]> = batch.iter().map(|r| &r.targets[..]).collect();
        match self.read_currents(&txn, &groups).await {
            Ok(currents) => Ok((txn, currents)),
            Err(e) => {
                txn.rollback().await.ok();
                Err(e)
            }
        }
    }

    /// Applies every accepted writer's mutations in order, advances the counter and commits;
    /// the outcomes are the writers' decisions with the versions they got. The decisions stay
    /// with the writers until the commit succeeds, for a retry if a statement fails.
    async fn apply_and_commit(
        &self,
        txn: DatabaseTransaction,
        base_rv: i64,
        accepted: &mut [Accepted],
    ) -> Result<Vec<Vec<WriteOutcome>>, RoundError> {
        let rules = match self.resolve_rules(&txn, round_rule_keys(accepted)).await {
            Ok(rules) => rules,
            Err(e) => {
                txn.rollback().await.ok();
                return Err(RoundError::Statement(e));
            }
        };
        let (applied, last_rv) = match self.apply_all(&txn, base_rv, accepted, &rules).await {
            Ok(applied) => applied,
            Err(e) => {
                txn.rollback().await.ok();
                return Err(RoundError::Statement(e));
            }
        };
        if last_rv != base_rv {
            // Published below (or the feed woken when it cannot be): the commit's own
            // notification need not send the feed to the change log.
            self.feed().committing(last_rv);
        }
        for writer in accepted.iter() {
            writer.commit_sent.mark();
        }
        txn.commit()
            .await
            .map_err(|e| RoundError::Commit(commit_failure(e.into())))?;
        self.rule_cache.remember(rules);
        let mut committed = Vec::new();
        let outcomes = accepted
            .iter_mut()
            .zip(applied)
            .map(|(writer, applied)| {
                std::mem::take(&mut writer.decided)
                    .into_iter()
                    .zip(applied)
                    .zip(&writer.targets)
                    .map(|((decided, applied), target)| {
                        committed.extend(change_of(target, &decided, &applied));
                        decided.into_outcome(applied)
                    })
                    .collect()
            })
            .collect();
        // The events go out before the writers answer their clients.
        if !committed.is_empty() && !self.feed().publish_committed(base_rv, committed).await {
            self.feed().wake();
        }
        Ok(outcomes)
    }

    async fn apply_all(
        &self,
        txn: &DatabaseTransaction,
        base_rv: i64,
        accepted: &mut [Accepted],
        rules: &RoundRules,
    ) -> Result<(Vec<Vec<Applied>>, i64), StoreError> {
        let now = now_unix();
        let mut rv = base_rv;
        let mut all = Vec::with_capacity(accepted.len());
        let writes = accepted
            .iter()
            .flat_map(|w| w.currents.iter().zip(&w.decided))
            .filter(|(current, d)| match d.mutation {
                Mutation::Put(_) => true,
                Mutation::Delete => current.is_some(),
                Mutation::Unchanged => false,
            })
            .count();
        self.read_stored_results(txn, accepted).await?;
        let mut staged = self.stages(writes).then(StagedWrites::default);
        for writer in accepted.iter_mut() {
            let mut applied = Vec::with_capacity(writer.targets.len());
            for ((target, current), decided) in writer
                .targets
                .iter()
                .zip(&writer.currents)
                .zip(&mut writer.decided)
            {
                let (key, target, current) = (&target.key, target.target(), current.as_ref());
                applied.push(match staged.as_mut() {
                    Some(staged) => self.stage(
                        staged, key, &target, current, decided, &mut rv, base_rv, now, rules,
                    )?,
                    None => {
                        self.apply_one(
                            txn, key, &target, current, decided, &mut rv, base_rv, now, rules,
                        )
                        .await?
                    }
                });
            }
            all.push(applied);
        }
        match staged.filter(|s| !s.is_empty()) {
            Some(staged) => self.write_staged(txn, staged, rv).await?,
            None if rv != base_rv => self.advance_counter(txn, rv).await?,
            None => {}
        }
        Ok((all, rv))
    }

    /// Puts what is known of the stored result rows of every report the round replaces into
    /// its [`Current`] (see `store::stored_rows`).
    async fn read_stored_results(
        &self,
        txn: &DatabaseTransaction,
        accepted: &mut [Accepted],
    ) -> Result<(), StoreError> {
        let mut replaced = Vec::new();
        for writer in accepted.iter_mut() {
            let Accepted {
                targets,
                currents,
                decided,
                stored,
                ..
            } = writer;
            let targets = targets.iter().zip(decided.iter());
            for ((target, decided), (current, read)) in targets.zip(currents.iter_mut().zip(stored))
            {
                if let Some(current) = current {
                    replaced.push(Replaced {
                        resource: target.resource,
                        decided,
                        current,
                        read,
                    });
                }
            }
        }
        self.fill_stored_rows(txn, replaced).await
    }

    /// After a failed round: the writer's decided mutations in a transaction of their own, if
    /// its targets are still as it saw them (another replica may have written in between).
    async fn retry_alone(
        &self,
        db: &DatabaseConnection,
        writer: &mut Accepted,
    ) -> Result<Vec<WriteOutcome>, StoreError> {
        let txn = db.begin().await?;
        let (base_rv, currents) = match self.read_currents(&txn, &[&writer.targets[..]]).await {
            Ok((base_rv, mut currents)) => (base_rv, currents.pop().unwrap_or_default()),
            Err(e) => {
                txn.rollback().await.ok();
                return Err(e);
            }
        };
        let unchanged = currents
            .iter()
            .zip(&writer.currents)
            .all(|(now, then)| now.as_ref().map(|c| c.rv) == then.as_ref().map(|c| c.rv));
        if !unchanged {
            txn.rollback().await.ok();
            return Err(StoreError::unavailable(
                "the object changed while this write was being retried; retry the request",
            ));
        }
        writer.currents = currents;
        let mut outcomes = self
            .apply_and_commit(txn, base_rv, std::slice::from_mut(writer))
            .await
            .map_err(RoundError::into_inner)?;
        Ok(outcomes.pop().unwrap_or_default())
    }

    /// Takes the counter's row lock (ordering this transaction against every writer, in this
    /// process or another) and reads the current version of each request's targets under it.
    async fn read_currents(
        &self,
        txn: &DatabaseTransaction,
        groups: &[&[OwnedTarget]],
    ) -> Result<(i64, Vec<Vec<Option<Current>>>), StoreError> {
        let (base_rv, _) = lock_counter(txn, self.backend(), self.cluster_id()).await?;
        let rows = self.read_rows(txn, groups, false).await?;
        let currents = rows
            .into_iter()
            .map(|group| {
                group
                    .into_iter()
                    .map(|r| {
                        r.map(|r| Current {
                            id: r.id,
                            rv: r.rv,
                            stored_results: StoredRows::default(),
                        })
                    })
                    .collect()
            })
            .collect();
        Ok((base_rv, currents))
    }

    /// What a writer decides on: its targets' rows as they are now, read outside any round.
    pub(super) async fn read_seen(
        &self,
        targets: &[OwnedTarget],
    ) -> Result<Vec<Option<Seen>>, StoreError> {
        let groups = [targets];
        let read = self.read_rows(self.connection(), &groups, true);
        let mut rows = self.unless_outage(read).await?;
        let rows = rows.pop().unwrap_or_default();
        Ok(rows.into_iter().map(|r| r.map(Row::seen)).collect())
    }

    /// The rows of each group's targets, in the groups' shape (`None`: no such object).
    async fn read_rows(
        &self,
        connection: &impl ConnectionTrait,
        groups: &[&[OwnedTarget]],
        with_bodies: bool,
    ) -> Result<Vec<Vec<Option<Row>>>, StoreError> {
        let all: Vec<&OwnedTarget> = groups.iter().flat_map(|g| g.iter()).collect();
        let mut found: HashMap<(String, String, String), Row> = HashMap::new();
        for chunk in all.chunks(KEYS_PER_READ) {
            let query = current_rows_query(self.cluster_id(), chunk, with_bodies);
            for row in connection.query_all(&query).await? {
                let key: (String, String, String) = (
                    row.try_get("", "resource")?,
                    row.try_get("", "namespace")?,
                    row.try_get("", "name")?,
                );
                let body = match with_bodies {
                    true => self
                        .bodies()
                        .decode_required(&row, "body", || format!("{}/{}", key.1, key.2))?,
                    false => String::new(),
                };
                let current = Row {
                    id: row.try_get("", "id")?,
                    rv: row.try_get("", "resource_version")?,
                    body,
                };
                found.insert(key, current);
            }
        }
        Ok(groups
            .iter()
            .map(|targets| {
                targets
                    .iter()
                    .map(|t| {
                        let (key, namespace, name) = t.identity();
                        found.remove(&(key.to_owned(), namespace.to_owned(), name.to_owned()))
                    })
                    .collect()
            })
            .collect())
    }
}

/// An object's row as a round or a writer reads it (`body` empty when not asked for).
struct Row {
    id: i64,
    rv: i64,
    body: String,
}

impl Row {
    fn seen(self) -> Seen {
        Seen {
            id: self.id,
            rv: self.rv,
            body: self.body,
        }
    }
}

/// The rules of the results a round writes (see `store::rules`).
fn round_rule_keys(accepted: &[Accepted]) -> HashSet<RuleKey> {
    let mut keys = HashSet::new();
    for (target, decided) in accepted
        .iter()
        .flat_map(|w| w.targets.iter().zip(&w.decided))
    {
        match (&decided.mutation, &decided.prepared) {
            // Most results share their rule with others of the round: copy each rule once.
            (Mutation::Put(_), Some(prepared)) => {
                let known = prepared
                    .rule_ids
                    .iter()
                    .copied()
                    .chain(std::iter::repeat(None));
                for (row, _) in prepared
                    .results
                    .iter()
                    .zip(known)
                    .filter(|(_, k)| k.is_none())
                {
                    if !keys.contains(&row.rule) {
                        keys.insert(row.rule.clone());
                    }
                }
            }
            (Mutation::Put(object), None) => keys.extend(result_rules(target.resource, object)),
            (Mutation::Delete | Mutation::Unchanged, _) => {}
        }
    }
    keys
}

/// The change-log entry of a committed write, for the feed (see
/// [`super::feed::ChangeFeed::publish_committed`]).
fn change_of(target: &OwnedTarget, decided: &Decided, applied: &Applied) -> Option<Change> {
    let event = applied.event?;
    let (object, previous) = match (&decided.mutation, event) {
        (Mutation::Put(object), _) => (object, decided.current.as_ref()),
        (_, EventType::Deleted) => {
            let last = decided.current.as_ref()?;
            (last, Some(last))
        }
        _ => return None,
    };
    Some(Change::committed(
        applied.resource_version,
        &target.key,
        &target.namespace,
        &target.name,
        event,
        object,
        previous,
        applied.json.clone(),
    ))
}

/// What a failed commit means for its writers: a commit the database answered with an error was
/// rolled back, but one whose connection was lost may have been applied.
fn commit_failure(e: StoreError) -> StoreError {
    if e.is_unavailable() {
        StoreError::Ambiguous(e.to_string())
    } else {
        e
    }
}

/// How a round failed: a statement (nothing committed, the writers can be retried alone) or
/// the commit itself (the outcome is unknown).
enum RoundError {
    Statement(StoreError),
    Commit(StoreError),
}

impl RoundError {
    fn into_inner(self) -> StoreError {
        match self {
            RoundError::Statement(e) | RoundError::Commit(e) => e,
        }
    }
}

/// The requests of the next round, taken from the front of the queue: up to `max_writes`
/// targets (at least one request), none naming an object another request of the round names.
/// Requests left behind keep their order.
fn take_round(waiting: &mut VecDeque<Request>, max_writes: usize) -> Vec<Request> {
    let mut round = Vec::new();
    let mut named: HashSet<(String, String, String)> = HashSet::new();
    let mut writes = 0;
    let mut left = VecDeque::with_capacity(waiting.len());
    while let Some(request) = waiting.pop_front() {
        let keys: Vec<(String, String, String)> = request
            .targets
            .iter()
            .map(|t| (t.key.clone(), t.namespace.clone(), t.name.clone()))
            .collect();
        let fits = round.is_empty() || writes + request.targets.len() <= max_writes;
        if fits && keys.iter().all(|k| !named.contains(k)) {
            writes += request.targets.len();
            named.extend(keys);
            round.push(request);
        } else {
            left.push_back(request);
            if !fits {
                break;
            }
        }
    }
    left.extend(waiting.drain(..));
    *waiting = left;
    round
}

#[cfg(test)]
mod tests {
    use reports_server_crds::catalog::POLICY_REPORT;

    use super::*;
    use crate::store::StoreOptions;

    /// A round's current-row read must seek the unique key per target: a plan that scans
    /// makes every write cost a pass over the whole store.
    #[tokio::test]
    async fn the_current_row_read_seeks_each_key_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("db").display());
        let store = Store::connect(StoreOptions::new(url)).await.unwrap();
        let targets: Vec<OwnedTarget> = (0..16)
            .map(|i| OwnedTarget {
                resource: &POLICY_REPORT,
                key: Store::resource_key(&POLICY_REPORT),
                namespace: format!("ns-{}", i % 5),
                name: format!("report-{i}"),
            })
            .collect();
        let chunk: Vec<&OwnedTarget> = targets.iter().collect();
        let plan = crate::store::sqlite_query_plan(
            &store,
            &current_rows_query(store.cluster_id(), &chunk, true),
        )
        .await;
        let seeks = plan
            .iter()
            .filter(|step| {
                step.contains("objects_key")
                    && step.contains("cluster_id=? AND resource=? AND namespace=? AND name=?")
            })
            .count();
        assert_eq!(seeks, 16, "one key seek per target: {plan:#?}");
        assert!(
            plan.iter().all(|step| !step.starts_with("SCAN")),
            "{plan:#?}"
        );
    }
}
