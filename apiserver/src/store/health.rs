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
//!
//! A standby is no better than a database that does not answer: after a failover the old
//! primary comes back as one, and connections still open to it (or opened through a proxy that
//! has not noticed yet) would read stale rows and refuse every write. So when the probe finds
//! the database in recovery (`pg_is_in_recovery()`), the circuit opens like for an outage, and
//! every pooled connection opened before is marked stale: pools close those instead of handing
//! them out again ([`DatabaseHealth::keeps_connection`]). A write refused as read-only marks
//! them stale too (the next ones may lead to the new primary) but opens nothing by itself: a
//! primary set read-only (`default_transaction_read_only`, as some managed services do when
//! their disk fills) still serves current reads, so only its writes are refused, like on a
//! full disk.
//!
//! An outage makes every connection opened before it stale as well: when the network dropped
//! packets instead of refusing them, a connection that was busy then is half-open, and sqlx's
//! ping when it is released waits on TCP retransmission (minutes) while holding a pool slot.
//! Closing stale connections on release keeps the pool's slots free for new connections, so
//! data is served as soon as the probe gets its answer.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::StoreError;

/// How often the probe asks the database.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(500);

/// An open circuit, as data requests are told of it.
#[derive(Clone, Debug)]
pub struct Outage {
    pub down_for: Duration,
    /// The last failure, for the log (it may name hosts: not for anonymous callers).
    pub cause: String,
    /// The database answers, but as a standby (read-only): a failover or switchover under way.
    pub read_only: bool,
}

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
    /// Since when the circuit is open, why, and whether the database is a standby (`None`
    /// before the first failure and while up).
    down: Mutex<Option<(Instant, String, bool)>>,
    gauge: Gauge,
    outages: Counter,
    /// The origin of [`Inner::stale_before`].
    epoch: Instant,
    /// Pooled connections opened before this many nanoseconds after `epoch` are stale (0: none).
    stale_before: AtomicU64,
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
                epoch: Instant::now(),
                stale_before: AtomicU64::new(0),
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
    pub fn outage(&self) -> Option<Outage> {
        if self.is_up() {
            return None;
        }
        let down = self.inner.down.lock().expect("health lock");
        Some(match &*down {
            Some((since, cause, read_only)) => Outage {
                down_for: since.elapsed(),
                cause: cause.clone(),
                read_only: *read_only,
            },
            None => Outage {
                down_for: Duration::ZERO,
                cause: "the store is still starting".into(),
                read_only: false,
            },
        })
    }

    /// Whether the circuit is open after a failure (not merely waiting for a first answer, which
    /// a store that runs no probe never gets): work that would wait on the database is refused
    /// at once rather than after a connection timeout.
    pub fn circuit_open(&self) -> bool {
        !*self.inner.up.borrow() && self.inner.down.lock().expect("health lock").is_some()
    }

    /// Resolves when the database stops answering (at once if it does not answer now).
    pub async fn went_down(&self) {
        let mut up = self.inner.up.subscribe();
        // An error means the sender is gone, which it never is while `self` lives.
        let _ = up.wait_for(|up| !*up).await;
    }

    /// Resolves when an outage begins after the database has answered: at the circuit's next
    /// opening while it is closed; while it is open (or before the first answer), only after
    /// the database answered again and stopped once more. Background work races its database
    /// calls against it ([`super::Store::unless_outage`]), unlike [`Self::went_down`], which
    /// resolves at once while the circuit is open and so would end work that the probe alone
    /// keeps out (a store that runs no probe never answers it).
    pub async fn outage_begins(&self) {
        let mut up = self.inner.up.subscribe();
        // An error means the sender is gone, which it never is while `self` lives.
        if up.wait_for(|up| *up).await.is_ok() {
            let _ = up.wait_for(|up| !*up).await;
        }
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
                Some((since, ..)) if self.inner.outages.get() > 0 => tracing::info!(
                    after_seconds = since.elapsed().as_secs_f64(),
                    "the database answers again; serving data requests"
                ),
                _ => tracing::debug!("the database answers"),
            }
        }
    }

    /// Records that the database did not answer; opens the circuit if it was closed.
    pub(super) fn failed(&self, cause: &str) {
        self.open_circuit(cause, false);
    }

    fn open_circuit(&self, cause: &str, read_only: bool) {
        if *self.inner.up.borrow() {
            // Before the circuit opens: its watchers end the requests in flight, which releases
            // their (maybe half-open) connections.
            self.connections_stale();
        }
        let went_down = self
            .inner
            .up
            .send_if_modified(|up| std::mem::replace(up, false));
        {
            let mut down = self.inner.down.lock().expect("health lock");
            match &mut *down {
                Some((_, last, was_read_only)) if !went_down => {
                    cause.clone_into(last);
                    *was_read_only = read_only;
                }
                _ => *down = Some((Instant::now(), cause.into(), read_only)),
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

    /// Records that the database is a standby (a demoted primary): opens the circuit like an
    /// outage and makes every connection opened until now stale, so that none is reused.
    pub(super) fn read_only(&self, cause: &str) {
        self.connections_stale();
        self.open_circuit(cause, true);
    }

    /// Makes every pooled connection opened until now stale: after a write refused as read-only
    /// (the connection may lead to a demoted primary) and when an outage starts (it may be
    /// half-open). A stale connection is closed when it is released or next acquired.
    pub(super) fn connections_stale(&self) {
        let now = self.inner.epoch.elapsed().as_nanos().max(1);
        self.inner
            .stale_before
            .store(u64::try_from(now).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Records why the store could not start on the database: like [`DatabaseHealth::failed`],
    /// or [`DatabaseHealth::read_only`] when the database refused to write.
    pub(super) fn could_not_start(&self, e: &StoreError) {
        match e {
            StoreError::Refused {
                refusal: super::Refusal::ReadOnly,
                ..
            } => self.read_only(&e.to_string()),
            e => self.failed(&e.to_string()),
        }
    }

    /// Whether a pooled connection opened `age` ago may be handed out again: `false` once an
    /// outage, a standby answer or a read-only refusal came after it was opened (see
    /// [`DatabaseHealth::connections_stale`]).
    pub fn keeps_connection(&self, age: Duration) -> bool {
        let stale_before = self.inner.stale_before.load(Ordering::SeqCst);
        if stale_before == 0 {
            return true;
        }
        let opened = self.inner.epoch.elapsed().saturating_sub(age);
        opened.as_nanos() >= u128::from(stale_before)
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
            let answer = match tokio::time::timeout(deadline, ask(&probe)).await {
                // A missed deadline can be this process's own doing: a task that keeps the
                // runtime busy delays the probe until its time is up before its question is
                // even sent, and opening the circuit then abandons every write in flight. Ask
                // once more at once: a database that is really gone misses that deadline too.
                Err(_) if *self.inner.up.borrow() => {
                    tokio::time::timeout(deadline, ask(&probe)).await
                }
                answer => answer,
            };
            match answer {
                Ok(Ok(Answer::Writable)) => self.answered(),
                Ok(Ok(Answer::ReadOnly)) => self.read_only(READ_ONLY),
                Ok(Err(e)) => self.failed(&StoreError::from(e).to_string()),
                Err(_) => self.failed(&format!(
                    "no answer within {deadline:?} (--db-probe-timeout-ms)"
                )),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(PROBE_INTERVAL) => {}
            }
        }
    }
}

/// Why data requests are refused while the database is a standby.
const READ_ONLY: &str = "the database is a standby (read-only: a failover or switchover is under way, \
     or the server is pointed at a replica); waiting for a primary";

/// What the probe learnt.
enum Answer {
    Writable,
    ReadOnly,
}

/// One probe question: whether the database is a primary. A standby answers a ping just as
/// well; SQLite has nobody to ask but the file.
async fn ask(probe: &DatabaseConnection) -> Result<Answer, sea_orm::DbErr> {
    let backend = probe.get_database_backend();
    let question = match backend {
        DbBackend::Postgres => "SELECT pg_is_in_recovery() AS read_only",
        // A MySQL replica is read-only; a primary set read-only is treated the same.
        DbBackend::MySql => "SELECT @@global.read_only <> 0 AS read_only",
        _ => return probe.ping().await.map(|()| Answer::Writable),
    };
    let row = probe
        .query_one_raw(Statement::from_string(backend, question))
        .await?
        .ok_or_else(|| sea_orm::DbErr::Custom(format!("{question} returned no row")))?;
    Ok(if row.try_get::<bool>("", "read_only")? {
        Answer::ReadOnly
    } else {
        Answer::Writable
    })
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
        let outage = health.outage().expect("down");
        assert_eq!(outage.cause, "connection refused again");
        assert!(!outage.read_only);
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

    #[tokio::test]
    async fn an_outage_begins_only_after_an_answer() {
        let health = DatabaseHealth::default();
        let waiter = tokio::spawn({
            let health = health.clone();
            async move { health.outage_begins().await }
        });
        health.failed("connection refused before the first answer");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiter.is_finished(),
            "work started while the circuit is open is not ended by it"
        );
        health.answered();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "an answer begins no outage");
        health.failed("no answer within 1s");
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("the next opening ends the wait")
            .unwrap();
    }

    #[test]
    fn an_outage_makes_older_connections_stale_only() {
        let health = DatabaseHealth::default();
        health.answered();
        health.set_ready();
        std::thread::sleep(Duration::from_millis(20));
        health.failed("no answer within 1s");
        assert!(
            !health.keeps_connection(Duration::from_millis(10)),
            "opened before the outage: closed, not pinged"
        );
        std::thread::sleep(Duration::from_millis(20));
        assert!(health.keeps_connection(Duration::from_millis(5)));
        health.answered();
        assert!(
            health.keeps_connection(Duration::from_millis(5)),
            "a recovery makes nothing stale"
        );
    }

    #[test]
    fn failures_before_the_first_answer_make_nothing_stale() {
        let health = DatabaseHealth::default();
        health.failed("connection refused");
        assert!(health.keeps_connection(Duration::from_secs(3600)));
    }

    #[test]
    fn a_read_only_answer_makes_older_connections_stale_only() {
        let health = DatabaseHealth::default();
        assert!(health.keeps_connection(Duration::from_secs(3600)));
        std::thread::sleep(Duration::from_millis(20));
        health.read_only("standby");
        assert!(!health.keeps_connection(Duration::from_millis(10)));
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            health.keeps_connection(Duration::from_millis(5)),
            "a connection opened after the read-only answer is kept"
        );
        assert!(!health.is_up());
        let outage = health.outage().expect("down");
        assert_eq!(outage.cause, "standby");
        assert!(outage.read_only);
    }
}
