//! Leader election on a `coordination.k8s.io/v1` Lease, so two operator replicas never apply
//! conflicting objects.
//!
//! Why hand-written: kube-runtime has no leader election, and the protocol is small — read the
//! Lease, take it when it is free, ours or expired, write it back with its resourceVersion
//! (optimistic concurrency decides races), renew well inside the lease duration. A replica that
//! cannot renew in time stops reconciling at once (the binary exits and the Deployment restarts
//! it as a standby), so two leaders never overlap for longer than the clock skew. On a clean
//! shutdown the Lease is released, so the successor takes over without waiting for expiry.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};

/// Lease settings.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's identity (the pod name).
    pub identity: String,
    /// How long a Lease stays valid without renewal.
    pub duration: Duration,
    /// How often the holder renews and a standby retries.
    pub retry: Duration,
}

/// What to do with the Lease as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Take or renew it.
    Take,
    /// Someone else holds a valid Lease.
    Wait { holder: String },
}

/// Pure decision: the Lease is free, ours, or expired at `now`.
pub fn decide(lease: Option<&Lease>, identity: &str, now: Timestamp) -> Decision {
    let Some(spec) = lease.and_then(|l| l.spec.as_ref()) else {
        return Decision::Take;
    };
    let holder = spec.holder_identity.clone().unwrap_or_default();
    if holder.is_empty() || holder == identity {
        return Decision::Take;
    }
    let duration = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    let renewed = spec
        .renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map(|t| t.0.as_second())
        .unwrap_or(0);
    if renewed + duration < now.as_second() {
        Decision::Take
    } else {
        Decision::Wait { holder }
    }
}

/// A held (or wanted) Lease.
pub struct Elector {
    api: Api<Lease>,
    config: LeaseConfig,
}

impl Elector {
    pub fn new(client: Client, config: LeaseConfig) -> Self {
        Elector {
            api: Api::namespaced(client, &config.namespace),
            config,
        }
    }

    /// One attempt: `Ok(true)` when this replica holds the Lease afterwards.
    pub async fn try_acquire_or_renew(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let current = self.api.get_opt(&self.config.name).await?;
        match decide(current.as_ref(), &self.config.identity, now) {
            Decision::Wait { holder } => {
                tracing::debug!(%holder, "leader Lease held by another replica");
                Ok(false)
            }
            Decision::Take => {
                let previous = current
                    .as_ref()
                    .and_then(|l| l.spec.clone())
                    .unwrap_or_default();
                let ours = previous.holder_identity.as_deref() == Some(&self.config.identity);
                let spec = LeaseSpec {
                    holder_identity: Some(self.config.identity.clone()),
                    lease_duration_seconds: Some(self.config.duration.as_secs() as i32),
                    acquire_time: if ours {
                        previous.acquire_time.clone()
                    } else {
                        Some(MicroTime(now))
                    },
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(
                        previous.lease_transitions.unwrap_or(0)
                            + i32::from(!ours && current.is_some()),
                    ),
                    ..Default::default()
                };
                let result = match current {
                    Some(mut lease) => {
                        lease.spec = Some(spec);
                        self.api
                            .replace(&self.config.name, &PostParams::default(), &lease)
                            .await
                    }
                    None => {
                        let lease = Lease {
                            metadata: ObjectMeta {
                                name: Some(self.config.name.clone()),
                                namespace: Some(self.config.namespace.clone()),
                                ..Default::default()
                            },
                            spec: Some(spec),
                        };
                        self.api.create(&PostParams::default(), &lease).await
                    }
                };
                match result {
                    Ok(_) => Ok(true),
                    // Someone else wrote first: not ours this round.
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// Waits until this replica holds the Lease.
    pub async fn acquire(&self) {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election"),
            }
            tokio::time::sleep(self.config.retry).await;
        }
    }

    /// Renews until a renewal fails to land within the lease duration; returns then (the
    /// caller must stop acting as leader).
    pub async fn hold(&self) {
        let mut last_ok = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(self.config.retry).await;
            match self.try_acquire_or_renew().await {
                Ok(true) => last_ok = tokio::time::Instant::now(),
                Ok(false) => return,
                Err(e) => tracing::warn!(error = %e, "renewing the leader Lease"),
            }
            // Stop before the Lease can expire in others' eyes.
            if last_ok.elapsed() + self.config.retry >= self.config.duration {
                return;
            }
        }
    }

    /// Gives the Lease up (clean shutdown), so a standby takes over at once.
    pub async fn release(&self) {
        if let Ok(Some(mut lease)) = self.api.get_opt(&self.config.name).await
            && let Some(spec) = lease.spec.as_mut()
            && spec.holder_identity.as_deref() == Some(&self.config.identity)
        {
            spec.holder_identity = None;
            let _ = self
                .api
                .replace(&self.config.name, &PostParams::default(), &lease)
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, renewed: i64, duration: i32) -> Lease {
        Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                lease_duration_seconds: Some(duration),
                renew_time: Some(MicroTime(Timestamp::from_second(renewed).unwrap())),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn takes_free_own_or_expired_leases_only() {
        let now = Timestamp::from_second(1000).unwrap();
        assert_eq!(decide(None, "a", now), Decision::Take);
        assert_eq!(decide(Some(&lease("a", 999, 15)), "a", now), Decision::Take);
        assert_eq!(decide(Some(&lease("", 999, 15)), "a", now), Decision::Take);
        assert_eq!(
            decide(Some(&lease("b", 990, 15)), "a", now),
            Decision::Wait { holder: "b".into() }
        );
        assert_eq!(decide(Some(&lease("b", 980, 15)), "a", now), Decision::Take);
    }
}
