//! One active aggregator per cluster: a `coordination.k8s.io/v1` Lease.
//!
//! The rules are client-go's leader election, with timings chosen for a fast takeover:
//!
//! * the holder renews every [`LeaseConfig::renew_interval`] (5 s) and stops aggregating if it
//!   could not renew for [`LeaseConfig::renew_deadline`] (10 s);
//! * a candidate takes the lease over when its record (resourceVersion) has not changed for the
//!   lease's `leaseDurationSeconds` (15 s) *as measured on the candidate's own clock*, so clock
//!   skew between machines does not matter; it looks every [`LeaseConfig::retry_interval`] (2 s);
//! * a holder that stops cleanly releases the lease (empty holder), so the next candidate takes
//!   over at its next look instead of after 15 s.
//!
//! Since `renew_deadline` < lease duration, a holder cut off from the API server has stopped
//! before anyone else may start. Two aggregators overlapping anyway (a paused process, say) are
//! still safe: every write carries a resourceVersion precondition, so the loser of a race gets
//! a 409 and re-merges.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::resources::is_conflict;

/// Default Lease name.
pub const DEFAULT_NAME: &str = "reports-server-aggregator";

/// Where the Lease lives and its timing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This process's identity in `holderIdentity` (unique per process).
    pub identity: String,
    /// `leaseDurationSeconds` written into the Lease.
    pub duration: Duration,
    pub renew_interval: Duration,
    pub renew_deadline: Duration,
    pub retry_interval: Duration,
}

impl LeaseConfig {
    /// The default timing (15 s / 5 s / 10 s / 2 s) for a Lease `namespace/name`.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        LeaseConfig {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            duration: Duration::from_secs(15),
            renew_interval: Duration::from_secs(5),
            renew_deadline: Duration::from_secs(10),
            retry_interval: Duration::from_secs(2),
        }
    }
}

/// A unique identity for this process: `<hostname>_<pid>_<random>`.
pub fn default_identity() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "reports-server".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{host}_{}_{nanos:08x}", std::process::id())
}

/// Whether a candidate `me` may take a Lease whose record it has seen unchanged for
/// `unchanged_for` (the pure part of the election).
pub fn takeable(
    spec: Option<&LeaseSpec>,
    me: &str,
    unchanged_for: Duration,
    default_duration: Duration,
) -> bool {
    let holder = spec
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or_default();
    if holder.is_empty() || holder == me {
        return true;
    }
    let duration = spec
        .and_then(|s| s.lease_duration_seconds)
        .and_then(|s| u64::try_from(s).ok())
        .map_or(default_duration, Duration::from_secs);
    unchanged_for >= duration
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// Leader election on one Lease.
pub struct Elector {
    api: Api<Lease>,
    config: LeaseConfig,
}

/// The record a candidate saw last, and since when (on its own clock).
type Observed = Option<(String, Instant)>;

impl Elector {
    pub fn new(client: Client, config: LeaseConfig) -> Self {
        Elector {
            api: Api::namespaced(client, &config.namespace),
            config,
        }
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    fn spec(&self, previous: Option<&LeaseSpec>) -> LeaseSpec {
        let me = &self.config.identity;
        let same_holder = previous.and_then(|s| s.holder_identity.as_deref()) == Some(me.as_str());
        let transitions = previous.and_then(|s| s.lease_transitions).unwrap_or(0);
        let had_holder = previous
            .and_then(|s| s.holder_identity.as_deref())
            .is_some_and(|h| !h.is_empty());
        LeaseSpec {
            holder_identity: Some(me.clone()),
            lease_duration_seconds: Some(
                i32::try_from(self.config.duration.as_secs().max(1)).unwrap_or(i32::MAX),
            ),
            acquire_time: if same_holder {
                previous.and_then(|s| s.acquire_time.clone())
            } else {
                Some(now())
            },
            renew_time: Some(now()),
            lease_transitions: Some(if same_holder || !had_holder {
                transitions
            } else {
                transitions + 1
            }),
            ..LeaseSpec::default()
        }
    }

    /// One acquisition attempt: `Some(lease)` when this process holds it now.
    async fn try_acquire(&self, observed: &mut Observed) -> Result<Option<Lease>, kube::Error> {
        let name = &self.config.name;
        let Some(current) = self.api.get_opt(name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(self.config.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec(None)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(lease) => Ok(Some(lease)),
                Err(e) if is_conflict(&e) => Ok(None),
                Err(e) => Err(e),
            };
        };
        let rv = current
            .metadata
            .resource_version
            .clone()
            .unwrap_or_default();
        let unchanged_for = match observed {
            Some((seen, since)) if *seen == rv => since.elapsed(),
            _ => {
                *observed = Some((rv, Instant::now()));
                Duration::ZERO
            }
        };
        let spec = current.spec.as_ref();
        if !takeable(
            spec,
            &self.config.identity,
            unchanged_for,
            self.config.duration,
        ) {
            return Ok(None);
        }
        let previous = spec
            .and_then(|s| s.holder_identity.as_deref())
            .unwrap_or_default();
        if !previous.is_empty() && previous != self.config.identity {
            tracing::info!(previous, "aggregation lease expired; taking over");
        }
        let mut lease = current.clone();
        lease.spec = Some(self.spec(spec));
        match self.api.replace(name, &PostParams::default(), &lease).await {
            Ok(lease) => Ok(Some(lease)),
            Err(e) if is_conflict(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Waits until this process holds the Lease; `None` when `cancel` fired first.
    pub async fn acquire(&self, cancel: &CancellationToken) -> Option<Lease> {
        let mut observed: Observed = None;
        let mut failing = false;
        loop {
            match self.try_acquire(&mut observed).await {
                Ok(Some(lease)) => return Some(lease),
                Ok(None) => failing = false,
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, lease = %self.config.name, namespace = %self.config.namespace, "cannot read or write the aggregation lease; retrying");
                    }
                    failing = true;
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return None,
                _ = tokio::time::sleep(self.config.retry_interval) => {}
            }
        }
    }

    /// Renews a held Lease: `Ok(Some)` renewed, `Ok(None)` lost to another holder.
    pub async fn renew(&self, lease: &Lease) -> Result<Option<Lease>, kube::Error> {
        let mut current = lease.clone();
        for _ in 0..2 {
            let spec = current.spec.clone();
            let mine = spec.as_ref().and_then(|s| s.holder_identity.as_deref())
                == Some(self.config.identity.as_str());
            if !mine {
                return Ok(None);
            }
            current.spec = Some(self.spec(spec.as_ref()));
            match self
                .api
                .replace(&self.config.name, &PostParams::default(), &current)
                .await
            {
                Ok(renewed) => return Ok(Some(renewed)),
                // Someone wrote the Lease (or an earlier renewal of ours landed after a timeout):
                // re-read and look at the holder again.
                Err(e) if is_conflict(&e) => match self.api.get_opt(&self.config.name).await? {
                    Some(fresh) => current = fresh,
                    None => return Ok(None),
                },
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Hands the Lease back (empty holder) so that a standby takes over at once.
    pub async fn release(&self, lease: &Lease) -> Result<(), kube::Error> {
        let mut current = match self.api.get_opt(&self.config.name).await? {
            Some(current) => current,
            None => return Ok(()),
        };
        let mine = current
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref())
            == Some(self.config.identity.as_str());
        if !mine {
            return Ok(());
        }
        let transitions = lease.spec.as_ref().and_then(|s| s.lease_transitions);
        current.spec = Some(LeaseSpec {
            holder_identity: None,
            lease_duration_seconds: Some(1),
            renew_time: Some(now()),
            acquire_time: Some(now()),
            lease_transitions: transitions,
            ..LeaseSpec::default()
        });
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &current)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_conflict(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Runs `work` whenever this process holds the Lease, until `cancel` fires. `work` gets a
    /// token that is cancelled when the Lease is lost; it is then awaited (it must stop
    /// promptly) and the election starts again. `leading` is told about every change.
    pub async fn run<F, Fut>(&self, cancel: CancellationToken, work: F, leading: impl Fn(bool))
    where
        F: Fn(CancellationToken) -> Fut,
        Fut: Future<Output = ()>,
    {
        tracing::info!(identity = %self.config.identity, lease = %self.config.name, namespace = %self.config.namespace, "waiting for the aggregation lease");
        while !cancel.is_cancelled() {
            let acquired = Instant::now();
            let Some(mut lease) = self.acquire(&cancel).await else {
                break;
            };
            tracing::info!(identity = %self.config.identity, "aggregation lease acquired; aggregating");
            leading(true);
            let term = cancel.child_token();
            let task = work(term.clone());
            tokio::pin!(task);
            let mut finished = false;
            let mut lost = false;
            let mut last_renewed = acquired;
            let mut wait = self.config.renew_interval;
            loop {
                tokio::select! {
                    _ = term.cancelled() => break,
                    _ = &mut task => {
                        finished = true;
                        break;
                    }
                    _ = tokio::time::sleep(wait) => {
                        let started = Instant::now();
                        let budget = self.config.renew_deadline.saturating_sub(last_renewed.elapsed());
                        match tokio::time::timeout(budget, self.renew(&lease)).await {
                            Ok(Ok(Some(renewed))) => {
                                lease = renewed;
                                last_renewed = started;
                                wait = self.config.renew_interval;
                            }
                            Ok(Ok(None)) => {
                                tracing::warn!("aggregation lease taken over by another process; stopping");
                                lost = true;
                                break;
                            }
                            Ok(Err(e)) if last_renewed.elapsed() < self.config.renew_deadline => {
                                tracing::warn!(error = %e, "cannot renew the aggregation lease; retrying");
                                wait = self.config.retry_interval;
                            }
                            Ok(Err(_)) | Err(_) => {
                                tracing::warn!("aggregation lease not renewed before the deadline; stopping");
                                lost = true;
                                break;
                            }
                        }
                    }
                }
            }
            term.cancel();
            if !finished {
                task.await;
            }
            leading(false);
            if !lost {
                match tokio::time::timeout(Duration::from_secs(5), self.release(&lease)).await {
                    Ok(Ok(())) => tracing::info!("aggregation lease released"),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "cannot release the aggregation lease; it will expire")
                    }
                    Err(_) => {
                        tracing::warn!("releasing the aggregation lease timed out; it will expire")
                    }
                }
            }
            if finished && !cancel.is_cancelled() {
                // The work ended on its own (a fatal error it logged); do not spin.
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = tokio::time::sleep(self.config.retry_interval) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: Option<&str>, seconds: Option<i32>) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(str::to_owned),
            lease_duration_seconds: seconds,
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn takeover_rules() {
        let d = Duration::from_secs(15);
        // Free, released or our own: take it.
        assert!(takeable(None, "me", Duration::ZERO, d));
        assert!(takeable(
            Some(&spec(None, Some(15))),
            "me",
            Duration::ZERO,
            d
        ));
        assert!(takeable(
            Some(&spec(Some(""), Some(15))),
            "me",
            Duration::ZERO,
            d
        ));
        assert!(takeable(
            Some(&spec(Some("me"), Some(15))),
            "me",
            Duration::ZERO,
            d
        ));
        // Someone else's: only once unchanged for the lease's own duration.
        let other = spec(Some("other"), Some(15));
        assert!(!takeable(Some(&other), "me", Duration::from_secs(14), d));
        assert!(takeable(Some(&other), "me", Duration::from_secs(15), d));
        let short = spec(Some("other"), Some(3));
        assert!(takeable(Some(&short), "me", Duration::from_secs(3), d));
        // No duration in the record: ours.
        let none = spec(Some("other"), None);
        assert!(!takeable(Some(&none), "me", Duration::from_secs(10), d));
        assert!(takeable(Some(&none), "me", Duration::from_secs(15), d));
    }

    #[test]
    fn renewal_stops_before_anyone_may_take_over() {
        let c = LeaseConfig::new("ns", DEFAULT_NAME, "me");
        assert!(c.renew_interval < c.renew_deadline);
        assert!(c.renew_deadline < c.duration);
    }
}
