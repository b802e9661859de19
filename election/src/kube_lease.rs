//! One active aggregator per cluster: a `coordination.k8s.io/v1` Lease as the
//! [`LeaseStore`] of the shared election loop (the crate root, where the rules are).
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
//!
//! What is Lease-specific lives here: the compare-and-swap is a `replace` carrying the
//! resourceVersion that was read (409 = someone wrote first), `acquireTime` and
//! `leaseTransitions` are kept as client-go keeps them, and the record declares its own
//! `leaseDurationSeconds`, which candidates honour.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};

use crate::{ElectionTiming, Elector, LeaseSnapshot, LeaseStore};

/// 409 (someone wrote the Lease since we read it) or 409 AlreadyExists (someone created it
/// first): either way another candidate won this round.
fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.is_conflict() || s.is_already_exists())
}

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
        let timing = ElectionTiming::default();
        LeaseConfig {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            duration: timing.duration,
            renew_interval: timing.renew_interval,
            renew_deadline: timing.renew_deadline,
            retry_interval: timing.retry_interval,
        }
    }

    /// The same Lease with `duration` (at least 3 s) and the renew interval and deadline at a
    /// third and two thirds of it, the proportions of the defaults.
    pub fn with_duration(mut self, duration: Duration) -> Self {
        let duration = duration.max(Duration::from_secs(3));
        self.duration = duration;
        self.renew_interval = duration / 3;
        self.renew_deadline = duration * 2 / 3;
        self
    }

    /// The election timing these settings describe.
    pub fn timing(&self) -> ElectionTiming {
        ElectionTiming {
            duration: self.duration,
            renew_interval: self.renew_interval,
            renew_deadline: self.renew_deadline,
            retry_interval: self.retry_interval,
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

/// The election over the Lease `config` names.
pub fn elector(client: Client, config: &LeaseConfig) -> Elector<KubeLease> {
    Elector::new(KubeLease::new(client, config), config.timing())
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

impl LeaseSnapshot for Lease {
    fn holder(&self) -> &str {
        self.spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref())
            .unwrap_or_default()
    }

    fn declared_duration(&self) -> Option<Duration> {
        self.spec
            .as_ref()
            .and_then(|s| s.lease_duration_seconds)
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs)
    }

    fn same_write(&self, other: &Self) -> bool {
        self.metadata
            .resource_version
            .as_deref()
            .unwrap_or_default()
            == other
                .metadata
                .resource_version
                .as_deref()
                .unwrap_or_default()
    }
}

/// One Lease, as the [`LeaseStore`] of this process.
pub struct KubeLease {
    api: Api<Lease>,
    namespace: String,
    name: String,
    identity: String,
    /// `namespace/name`, for log lines.
    qualified_name: String,
}

impl KubeLease {
    pub fn new(client: Client, config: &LeaseConfig) -> Self {
        KubeLease {
            api: Api::namespaced(client, &config.namespace),
            namespace: config.namespace.clone(),
            name: config.name.clone(),
            identity: config.identity.clone(),
            qualified_name: format!("{}/{}", config.namespace, config.name),
        }
    }

    fn holds(&self, lease: &Lease) -> bool {
        lease.holder() == self.identity
    }

    /// The spec this process writes over `previous` (client-go's bookkeeping: `acquireTime`
    /// and `leaseTransitions` change only when the holder does).
    fn spec(&self, previous: Option<&LeaseSpec>, duration: Duration) -> LeaseSpec {
        let me = &self.identity;
        let same_holder = previous.and_then(|s| s.holder_identity.as_deref()) == Some(me.as_str());
        let transitions = previous.and_then(|s| s.lease_transitions).unwrap_or(0);
        let had_holder = previous
            .and_then(|s| s.holder_identity.as_deref())
            .is_some_and(|h| !h.is_empty());
        LeaseSpec {
            holder_identity: Some(me.clone()),
            lease_duration_seconds: Some(
                i32::try_from(duration.as_secs().max(1)).unwrap_or(i32::MAX),
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

    /// Writes `lease` if its resourceVersion is still current: `Ok(None)` on 409.
    async fn replace_if_unchanged(&self, lease: &Lease) -> Result<Option<Lease>, kube::Error> {
        match self
            .api
            .replace(&self.name, &PostParams::default(), lease)
            .await
        {
            Ok(written) => Ok(Some(written)),
            Err(e) if is_conflict(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl LeaseStore for KubeLease {
    type Snapshot = Lease;
    type Error = kube::Error;

    fn identity(&self) -> &str {
        &self.identity
    }

    fn lease_name(&self) -> &str {
        &self.qualified_name
    }

    async fn read(&self) -> Result<Option<Lease>, kube::Error> {
        self.api.get_opt(&self.name).await
    }

    async fn acquire(
        &self,
        observed: Option<&Lease>,
        duration: Duration,
    ) -> Result<Option<Lease>, kube::Error> {
        let Some(current) = observed else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    namespace: Some(self.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec(None, duration)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(lease) => Ok(Some(lease)),
                Err(e) if is_conflict(&e) => Ok(None),
                Err(e) => Err(e),
            };
        };
        let mut lease = current.clone();
        lease.spec = Some(self.spec(current.spec.as_ref(), duration));
        self.replace_if_unchanged(&lease).await
    }

    async fn renew(&self, held: &Lease, duration: Duration) -> Result<Option<Lease>, kube::Error> {
        let mut current = held.clone();
        for _ in 0..2 {
            if !self.holds(&current) {
                return Ok(None);
            }
            let mut renewal = current.clone();
            renewal.spec = Some(self.spec(current.spec.as_ref(), duration));
            if let Some(renewed) = self.replace_if_unchanged(&renewal).await? {
                return Ok(Some(renewed));
            }
            // Someone wrote the Lease (or an earlier renewal of ours landed after a timeout):
            // re-read and look at the holder again.
            match self.api.get_opt(&self.name).await? {
                Some(fresh) => current = fresh,
                None => return Ok(None),
            }
        }
        Ok(None)
    }

    async fn release(&self, held: &Lease) -> Result<(), kube::Error> {
        let Some(mut current) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        if !self.holds(&current) {
            return Ok(());
        }
        current.spec = Some(LeaseSpec {
            holder_identity: None,
            lease_duration_seconds: Some(1),
            renew_time: Some(now()),
            acquire_time: Some(now()),
            lease_transitions: held.spec.as_ref().and_then(|s| s.lease_transitions),
            ..LeaseSpec::default()
        });
        self.replace_if_unchanged(&current).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, seconds: Option<i32>, version: &str) -> Lease {
        Lease {
            metadata: ObjectMeta {
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_owned),
                lease_duration_seconds: seconds,
                ..LeaseSpec::default()
            }),
        }
    }

    #[test]
    fn a_lease_reads_as_a_snapshot() {
        let held = lease(Some("other"), Some(15), "7");
        assert_eq!(held.holder(), "other");
        assert_eq!(held.declared_duration(), Some(Duration::from_secs(15)));
        // Released or never held: no holder. A nonsensical duration is no declaration.
        assert_eq!(lease(None, Some(-1), "7").holder(), "");
        assert_eq!(lease(Some(""), None, "7").holder(), "");
        assert_eq!(lease(None, Some(-1), "7").declared_duration(), None);
        assert_eq!(Lease::default().holder(), "");
        // The resourceVersion alone tells writes apart.
        assert!(held.same_write(&lease(Some("other"), Some(15), "7")));
        assert!(!held.same_write(&lease(Some("other"), Some(15), "8")));
    }

    #[test]
    fn config_timing_is_the_election_default() {
        let c = LeaseConfig::new("ns", DEFAULT_NAME, "me");
        assert_eq!(c.timing(), ElectionTiming::default());
    }
}
