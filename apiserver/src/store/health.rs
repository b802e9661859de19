//! Whether the database answers, known without asking it on every request.
//!
//! A database outage must not take the API groups out of the cluster: readiness does not depend
//! on the database (a Service emptied by failing probes makes kube-apiserver mark the
//! APIServices unavailable, and every client doing discovery fails with them). Instead the store
//! keeps a *circuit*: a probe on a connection of its own (a saturated pool must not look like an
//! outage) asks the database every [`PROBE_INTERVAL`], each answer bounded by a deadline, so
//! that a database that drops packets is noticed as fast as one that refuses connections. While
//! the circuit is open, data requests answer 503 at once instead of each waiting out a
//! connection timeout, and requests caught in flight when it opens are ended (see
//! `http::database_gate`). The state is a gauge and one log line per transition, never readiness.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sea_orm::DatabaseConnection;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::StoreError;

/// How often the probe asks the database.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(500);

/// What the store knows of its database, shared by every clone of the store.
#[derive(Clone)]
pub struct DatabaseHealth {
    inner: Arc<Inner>,
}

struct Inner {
    /// `true` while the database answers; starts `false` until the first answer.
    up: watch::Sender<bool>,
    /// Set once migrations ran and the change feed started: the store can serve.
    ready: AtomicBool,
    /// Since when the circuit is open and why (`None` before the first failure and while up).
    down: Mutex<Option<(Instant, String)>>,
    gauge: Gauge,
    outages: Counter,
}

impl Default for DatabaseHealth {
    fn default() -> Self {
        DatabaseHealth {
            inner: Arc::new(Inner {
                up: watch::Sender::new(false),
                ready: AtomicBool::new(false),
                down: Mutex::new(None),
                gauge: Gauge::default(),
                outages: Counter::default(),
            }),
        }
    }
}

impl DatabaseHealth {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "reports_server_database_up",
            "1 while the database answers (data requests are served), 0 while it does not (they answer 503)",
            self.inner.gauge.clone(),
        );
        registry.register(
            "reports_server_database_outages",
            "Times the database stopped answering",
            self.inner.outages.clone(),
        );
    }

    /// Whether data requests may go to the database: it answered last time it was asked, and
    /// the store finished starting on it.
    pub fn is_up(&self) -> bool {
        *self.inner.up.borrow() && self.inner.ready.load(Ordering::SeqCst)
    }

    /// Why data requests are refused, and for how long they have been (`None` while up).
    pub fn outage(&self) -> Option<(Duration, String)> {
        if self.is_up() {
            return None;
        }
        let down = self.inner.down.lock().expect("health lock");
        Some(match &*down {
            Some((since, cause)) => (since.elapsed(), cause.clone()),
            None => (Duration::ZERO, "the store is still starting".into()),
        })
    }

    /// Resolves when the database stops answering (at once if it does not answer now).
    pub async fn went_down(&self) {
        let mut up = self.inner.up.subscribe();
        // An error means the sender is gone, which it never is while `self` lives.
        let _ = up.wait_for(|up| !*up).await;
    }

    /// Resolves when data requests can be served.
    pub async fn came_up(&self) {
        let mut up = self.inner.up.subscribe();
        loop {
            if self.is_up() {
                return;
            }
            if up.changed().await.is_err() {
                return;
            }
        }
    }

    pub(super) fn set_ready(&self) {
        self.inner.ready.store(true, Ordering::SeqCst);
        // Wakes `came_up` waiters: readiness is part of what they wait for.
        self.inner.up.send_modify(|_| {});
    }

    /// Records an answer from the database.
    pub(super) fn answered(&self) {
        if self
            .inner
            .up
            .send_if_modified(|up| !std::mem::replace(up, true))
        {
            let down = self.inner.down.lock().expect("health lock").take();
            self.inner.gauge.set(1);
            match down {
                Some((since, _)) if self.inner.outages.get() > 0 => tracing::info!(
                    after_seconds = since.elapsed().as_secs_f64(),
                    "the database answers again; serving data requests"
                ),
                _ => tracing::debug!("the database answers"),
            }
        }
    }

    /// Records that the database did not answer; opens the circuit if it was closed.
    pub(super) fn failed(&self, cause: &str) {
        let went_down = self
            .inner
            .up
            .send_if_modified(|up| std::mem::replace(up, false));
        {
            let mut down = self.inner.down.lock().expect("health lock");
            match &mut *down {
                Some((_, last)) if !went_down => cause.clone_into(last),
                _ => *down = Some((Instant::now(), cause.into())),
            }
        }
        if went_down {
            self.inner.gauge.set(0);
            self.inner.outages.inc();
            tracing::warn!(
                cause,
                "the database stopped answering; data requests answer 503 until it answers again \
                 (discovery, /readyz and open watches are not affected)"
            );
        }
    }

    /// Asks the database every [`PROBE_INTERVAL`] on `probe`, each answer bounded by `deadline`,
    /// until `stop`.
    pub(super) async fn probe(
        self,
        probe: DatabaseConnection,
        deadline: Duration,
        stop: CancellationToken,
    ) {
        loop {
            let answer = tokio::time::timeout(deadline, probe.ping()).await;
            match answer {
                Ok(Ok(())) => self.answered(),
                Ok(Err(e)) => self.failed(&StoreError::from(e).to_string()),
                Err(_) => self.failed(&format!(
                    "no answer within {deadline:?} (--database-timeout-seconds)"
                )),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(PROBE_INTERVAL) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_circuit_opens_and_closes_once_per_transition() {
        let health = DatabaseHealth::default();
        assert!(!health.is_up(), "down until the database first answers");
        health.answered();
        assert!(!health.is_up(), "and until the store is ready");
        health.set_ready();
        assert!(health.is_up());
        assert_eq!(health.inner.gauge.get(), 1);
        health.failed("connection refused");
        health.failed("connection refused again");
        assert_eq!(
            health.inner.outages.get(),
            1,
            "one outage, however many failures"
        );
        let (_, cause) = health.outage().expect("down");
        assert_eq!(cause, "connection refused again");
        assert_eq!(health.inner.gauge.get(), 0);
        tokio::time::timeout(Duration::from_secs(1), health.went_down())
            .await
            .expect("went_down resolves while down");
        let waiter = tokio::spawn({
            let health = health.clone();
            async move { health.came_up().await }
        });
        health.answered();
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("came_up resolves on the answer")
            .unwrap();
        assert!(health.outage().is_none());
    }
}
