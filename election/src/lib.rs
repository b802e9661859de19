//! Leader election over any lease store: one loop for the Kubernetes Lease of the cluster
//! backend and the SQL lease row of the in-process backend.
//!
//! Both backends must run exactly one active aggregator (per cluster, or per database), and
//! both use client-go's leader-election rules. Those rules are subtle (whose clock measures
//! what, when to stop, when to give the lease back), so they live here once, behind
//! [`LeaseStore`], and each backend supplies only the four storage operations.
//!
//! # The rules
//!
//! * A candidate takes the lease when nobody holds it (never created, or released), when it
//!   is already its own, or when it has seen the *same record* (a write counter such as a
//!   resourceVersion, never a timestamp compared with its own clock) unchanged for the lease
//!   duration **as measured on its own clock**. Clock skew between machines therefore cannot
//!   cut a live lease short. It looks every [`ElectionTiming::retry_interval`].
//! * Taking and renewing are compare-and-swap writes: the store refuses a write based on a
//!   record someone else has changed since, so of two candidates racing for one record, one
//!   wins and the other sees a changed record.
//! * The holder renews every [`ElectionTiming::renew_interval`]; a failed renewal is retried
//!   every `retry_interval`. When [`ElectionTiming::renew_deadline`] has passed since the
//!   *start* of its last successful write (the acquiring one included) it stops its work,
//!   at the deadline itself, not at its next retry, and a renewal still in flight then is
//!   abandoned. Since `renew_deadline` < lease duration and a candidate starts measuring only
//!   once it has read the last record (which was written after that start), the holder has
//!   stopped before anyone may take over, whatever the retry interval.
//! * A holder that stops cleanly (cancelled, or its work ended on its own) releases the lease,
//!   so the next candidate takes it at its next look instead of after a lease duration. A
//!   holder that lost the lease (taken over, or the deadline passed) does not touch it.
//!
//! Two holders overlapping anyway (a process paused longer than the lease, say) are still safe
//! for aggregation: every write carries a resourceVersion precondition, so the loser of a race
//! gets a conflict and re-merges.
//!
//! The decision itself ([`takeable`], [`Observer`]) is pure; [`Elector::run`] is the loop, with
//! time from `tokio::time`, so every transition is tested with paused time and an in-memory
//! store (see the tests below).
//!
//! Its users: the cluster aggregator and the operator (a Kubernetes Lease, [`kube_lease`], behind
//! the `kube` feature), and the in-process aggregator and the migration worker (a row of the
//! database, `reports_server_apiserver::store::lease`). It has its own crate so that none of them
//! depends on another for it.

#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]
#![forbid(unsafe_code)]

#[cfg(feature = "kube")]
pub mod kube_lease;

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long releasing the lease on the way out may take before it is left to expire.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// The timing of an election (client-go's defaults, with a shorter retry for a faster
/// takeover).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ElectionTiming {
    /// How long a record must stay unchanged (on the observer's clock) before a candidate
    /// takes it over; written into the record where the store has a field for it.
    pub duration: Duration,
    /// How often the holder renews.
    pub renew_interval: Duration,
    /// The holder stops working when it could not renew for this long; shorter than
    /// `duration`, so it has stopped before anyone else may start.
    pub renew_deadline: Duration,
    /// How often a candidate looks at the lease (and a failed renewal is retried).
    pub retry_interval: Duration,
}

impl Default for ElectionTiming {
    fn default() -> Self {
        ElectionTiming {
            duration: Duration::from_secs(15),
            renew_interval: Duration::from_secs(5),
            renew_deadline: Duration::from_secs(10),
            retry_interval: Duration::from_secs(2),
        }
    }
}

/// A lease record as one read (or one successful write) returned it.
pub trait LeaseSnapshot: Clone + Send + Sync {
    /// The holder's identity; `""` when the lease was released.
    fn holder(&self) -> &str;

    /// The lease duration the record itself declares, if the store keeps one; `None` means the
    /// candidate's own [`ElectionTiming::duration`] applies.
    fn declared_duration(&self) -> Option<Duration>;

    /// Whether `other` is the same write of the record (no renewal, takeover or release in
    /// between).
    fn same_write(&self, other: &Self) -> bool;
}

/// Where a lease lives: the compare-and-swap operations the election needs.
///
/// Every write is conditional on the record the caller read or wrote last, so that no write
/// ever overwrites one it has not seen. Errors are only logged and retried.
pub trait LeaseStore: Send + Sync {
    type Snapshot: LeaseSnapshot;
    type Error: std::error::Error + Send + Sync + 'static;

    /// This process's identity, as written into the record (unique per process).
    fn identity(&self) -> &str;

    /// How log lines name the lease.
    fn lease_name(&self) -> &str;

    /// Reads the lease; `None` if it was never created.
    fn read(&self) -> impl Future<Output = Result<Option<Self::Snapshot>, Self::Error>> + Send;

    /// Takes the lease for [`identity`](Self::identity) if it is still exactly `observed`
    /// (`None`: it does not exist yet, create it). `Ok(None)` when someone else wrote it first.
    fn acquire(
        &self,
        observed: Option<&Self::Snapshot>,
        duration: Duration,
    ) -> impl Future<Output = Result<Option<Self::Snapshot>, Self::Error>> + Send;

    /// Extends a lease this process holds, last seen as `held`. `Ok(None)` when it is no
    /// longer this process's.
    fn renew(
        &self,
        held: &Self::Snapshot,
        duration: Duration,
    ) -> impl Future<Output = Result<Option<Self::Snapshot>, Self::Error>> + Send;

    /// Gives the lease up (empty holder) if this process still holds it; does nothing
    /// otherwise.
    fn release(
        &self,
        held: &Self::Snapshot,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// Whether a candidate `me` may take `current`, a record it has seen unchanged for
/// `unchanged_for` (see the module docs). `own_duration` applies when the record declares
/// none.
pub fn takeable<S: LeaseSnapshot>(
    current: &S,
    me: &str,
    unchanged_for: Duration,
    own_duration: Duration,
) -> bool {
    let holder = current.holder();
    if holder.is_empty() || holder == me {
        return true;
    }
    unchanged_for >= current.declared_duration().unwrap_or(own_duration)
}

/// The record a candidate saw last, and since when on its own clock.
#[derive(Debug)]
pub struct Observer<S> {
    last: Option<(S, Instant)>,
}

impl<S> Default for Observer<S> {
    fn default() -> Self {
        Observer { last: None }
    }
}

impl<S: LeaseSnapshot> Observer<S> {
    /// Records that `current` was read at `now`; returns how long that same write has been
    /// seen (zero for a record not seen before).
    pub fn unchanged_for(&mut self, current: &S, now: Instant) -> Duration {
        match &self.last {
            Some((seen, since)) if seen.same_write(current) => {
                now.saturating_duration_since(*since)
            }
            _ => {
                self.last = Some((current.clone(), now));
                Duration::ZERO
            }
        }
    }
}

/// How a leadership term ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TermEnd {
    /// Cancelled, or the work returned: the lease is given back.
    Stopped,
    /// Taken over, or not renewed in time: the lease is not touched.
    Lost,
}

/// Runs the election on one [`LeaseStore`].
pub struct Elector<S> {
    store: S,
    timing: ElectionTiming,
}

impl<S: LeaseStore> Elector<S> {
    pub fn new(store: S, timing: ElectionTiming) -> Self {
        Elector { store, timing }
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    pub fn timing(&self) -> &ElectionTiming {
        &self.timing
    }

    /// Runs `work` whenever this process holds the lease, until `cancel` fires.
    ///
    /// `work` gets a token that is cancelled when the term ends (lease lost, or `cancel`); it
    /// must then return promptly, and it is awaited before anything else happens. If it
    /// returns on its own, the lease is released and sought again after a retry interval.
    /// `leading` is told `true` before the work starts and `false` once it has returned.
    #[tracing::instrument(name = "election", skip_all)]
    pub async fn run<F, Fut>(&self, cancel: CancellationToken, work: F, leading: impl Fn(bool))
    where
        F: Fn(CancellationToken) -> Fut,
        Fut: Future<Output = ()>,
    {
        let (identity, lease) = (self.store.identity(), self.store.lease_name());
        tracing::info!(identity, lease, "waiting for the lease");
        let mut observer = Observer::default();
        let mut failing = false;
        while !cancel.is_cancelled() {
            let attempt = Instant::now();
            match self.try_acquire(&mut observer).await {
                Ok(Some(held)) => {
                    failing = false;
                    observer = Observer::default();
                    self.lead(held, attempt, &cancel, &work, &leading).await;
                }
                Ok(None) => failing = false,
                Err(e) => {
                    // Once per outage, not every retry.
                    if !failing {
                        tracing::warn!(error = %e, lease, "cannot read or write the lease; retrying");
                    }
                    failing = true;
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(self.timing.retry_interval) => {}
            }
        }
    }

    /// One acquisition attempt: `Some` when this process holds the lease now.
    async fn try_acquire(
        &self,
        observer: &mut Observer<S::Snapshot>,
    ) -> Result<Option<S::Snapshot>, S::Error> {
        let Some(current) = self.store.read().await? else {
            return self.store.acquire(None, self.timing.duration).await;
        };
        let me = self.store.identity();
        let unchanged_for = observer.unchanged_for(&current, Instant::now());
        if !takeable(&current, me, unchanged_for, self.timing.duration) {
            return Ok(None);
        }
        let previous = current.holder();
        if !previous.is_empty() && previous != me {
            tracing::info!(previous, "lease expired; taking over");
        }
        self.store
            .acquire(Some(&current), self.timing.duration)
            .await
    }

    /// One leadership term: runs `work` and renews until the lease is lost or `cancel` fires,
    /// then stops the work and, unless the lease was lost, releases it. `acquired` is when the
    /// acquiring write started: the renew deadline counts from there.
    async fn lead<F, Fut>(
        &self,
        mut held: S::Snapshot,
        acquired: Instant,
        cancel: &CancellationToken,
        work: &F,
        leading: &impl Fn(bool),
    ) where
        F: Fn(CancellationToken) -> Fut,
        Fut: Future<Output = ()>,
    {
        let deadline = self.timing.renew_deadline;
        if acquired.elapsed() >= deadline {
            // The write may have landed long before its answer: a candidate may already count
            // the record as expired. Ours still, so the next attempt takes it again at once.
            tracing::warn!(
                "acquiring the lease took longer than the renew deadline; not working under it"
            );
            return;
        }
        tracing::info!(identity = self.store.identity(), "lease acquired; leading");
        leading(true);
        let term = cancel.child_token();
        let task = work(term.clone());
        tokio::pin!(task);
        let mut work_returned = false;
        let mut last_renewed = acquired;
        let mut wait = self.timing.renew_interval;
        let end = loop {
            // Wake up at the deadline at the latest, so that the work stops exactly then.
            let pause = wait.min(deadline.saturating_sub(last_renewed.elapsed()));
            tokio::select! {
                _ = term.cancelled() => break TermEnd::Stopped,
                _ = &mut task => {
                    work_returned = true;
                    tracing::warn!("the work stopped on its own; giving the lease back");
                    break TermEnd::Stopped;
                }
                _ = tokio::time::sleep(pause) => {
                    let started = Instant::now();
                    // The renewal must land before the deadline, or we must stop anyway.
                    let budget = deadline.saturating_sub(last_renewed.elapsed());
                    if budget.is_zero() {
                        tracing::warn!("lease not renewed before the deadline; stopping");
                        break TermEnd::Lost;
                    }
                    match tokio::time::timeout(budget, self.store.renew(&held, self.timing.duration)).await {
                        Ok(Ok(Some(renewed))) => {
                            held = renewed;
                            last_renewed = started;
                            wait = self.timing.renew_interval;
                        }
                        Ok(Ok(None)) => {
                            tracing::warn!("lease taken over by another process; stopping");
                            break TermEnd::Lost;
                        }
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, "cannot renew the lease; retrying");
                            wait = self.timing.retry_interval;
                        }
                        Err(_) => {
                            tracing::warn!("lease not renewed before the deadline; stopping");
                            break TermEnd::Lost;
                        }
                    }
                }
            }
        };
        term.cancel();
        if !work_returned {
            // The work stops at its next await point; an interrupted apply is safe (see the
            // backends' docs).
            task.await;
        }
        leading(false);
        if end == TermEnd::Stopped {
            log_release(tokio::time::timeout(RELEASE_TIMEOUT, self.store.release(&held)).await);
        }
    }
}

fn log_release<E: Display>(outcome: Result<Result<(), E>, tokio::time::error::Elapsed>) {
    match outcome {
        Ok(Ok(())) => tracing::info!("lease released"),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot release the lease; it will expire")
        }
        Err(_) => tracing::warn!("releasing the lease timed out; it will expire"),
    }
}

#[cfg(test)]
mod tests;
