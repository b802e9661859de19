//! Named leader leases stored in the database (table `leases`).
//!
//! Why a row and not a Kubernetes Lease or a database lock: the in-process aggregator has to be
//! a singleton per *database* (replicas of one installation, or several installations sharing a
//! PostgreSQL), it runs without any cluster API in standalone mode, and session-level locks
//! (`pg_advisory_lock`, `GET_LOCK`) do not exist on SQLite and are tied to one pooled connection
//! whose loss the pool hides. A row works on every backend.
//!
//! The protocol is client-go's leader election, reduced to compare-and-swap updates:
//! * the holder renews by updating the row `WHERE holder = me`; every renewal strictly increases
//!   `renewed_at`;
//! * a candidate takes the row over only with an update that names the exact `(holder,
//!   renewed_at)` it observed, and only after it has seen that record unchanged for a whole
//!   lease duration *on its own clock*, so clock skew between replicas cannot cut a live lease
//!   short (the stored timestamps are compared for equality, never against another clock);
//! * a holder that shuts down releases the row (`holder = ''`), which a candidate may take at
//!   once: handover on a rolling update costs one retry interval, not a lease duration.
//!
//! The policy (when to take over, renew, give up, release) is the aggregator's election loop,
//! shared with the cluster backend's Kubernetes Lease (`reports_server_election`);
//! these are the primitive row operations, and [`StoreLease`] is the one lease row as that
//! loop's `LeaseStore`.

use std::time::Duration;

use reports_server_election::{LeaseSnapshot, LeaseStore};
use sea_orm::sea_query::{Expr, ExprTrait, OnConflict, Query};
use sea_orm::{ConnectionTrait, DbBackend, SqlErr};

use super::migration::m20261122_000002_aggregator_lease::Leases;
use super::{Store, StoreError};

/// One lease row as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRecord {
    /// `""` when released.
    pub holder: String,
    /// Unix milliseconds (the holder's clock) of the last acquire or renew.
    pub renewed_at: i64,
    /// Unix milliseconds (the holder's clock) after which the holder considers itself expired.
    pub expires_at: i64,
}

impl LeaseRecord {
    /// Whether nobody holds the lease (released by its last holder).
    pub fn is_released(&self) -> bool {
        self.holder.is_empty()
    }
}

fn now_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Store {
    /// Reads the lease `name`; `None` if it was never taken.
    pub async fn lease_read(&self, name: &str) -> Result<Option<LeaseRecord>, StoreError> {
        let row = self
            .connection()
            .query_one(
                &Query::select()
                    .columns([Leases::Holder, Leases::RenewedAt, Leases::ExpiresAt])
                    .from(Leases::Table)
                    .and_where(Expr::col(Leases::Name).eq(name))
                    .to_owned(),
            )
            .await?;
        match row {
            Some(r) => Ok(Some(LeaseRecord {
                holder: r.try_get("", "holder")?,
                renewed_at: r.try_get("", "renewed_at")?,
                expires_at: r.try_get("", "expires_at")?,
            })),
            None => Ok(None),
        }
    }

    /// Takes the lease for `holder` if it is still exactly as `observed` (`None`: the row does
    /// not exist yet). Returns the new record, or `None` when someone else changed it first.
    /// Deciding *whether* `observed` is stale enough to take is the caller's job.
    pub async fn lease_acquire(
        &self,
        name: &str,
        holder: &str,
        observed: Option<&LeaseRecord>,
        duration: Duration,
    ) -> Result<Option<LeaseRecord>, StoreError> {
        // Strictly after the observed value, so that observers see a change even if this
        // process's clock is behind the previous holder's.
        let renewed_at = observed.map_or(now_millis(), |o| {
            std::cmp::max(now_millis(), o.renewed_at + 1)
        });
        let record = LeaseRecord {
            holder: holder.to_owned(),
            renewed_at,
            expires_at: renewed_at.saturating_add(millis(duration)),
        };
        let result = match observed {
            None => {
                let mut insert = Query::insert();
                insert
                    .into_table(Leases::Table)
                    .columns([
                        Leases::Name,
                        Leases::Holder,
                        Leases::RenewedAt,
                        Leases::ExpiresAt,
                    ])
                    .values_panic([
                        name.into(),
                        holder.into(),
                        record.renewed_at.into(),
                        record.expires_at.into(),
                    ]);
                // MySQL has no `ON CONFLICT DO NOTHING`, and its stand-in `ON DUPLICATE KEY
                // UPDATE name = name` counts the existing row as affected (sqlx connects with
                // CLIENT_FOUND_ROWS), which would tell two candidates they both took the lease.
                // There the plain INSERT's duplicate-key error is the "someone was first".
                let mysql = self.backend() == DbBackend::MySql;
                if !mysql {
                    insert.on_conflict(OnConflict::new().do_nothing().to_owned());
                }
                match self.connection().execute(&insert).await {
                    Err(e)
                        if mysql
                            && matches!(
                                e.sql_err(),
                                Some(SqlErr::UniqueConstraintViolation(_))
                            ) =>
                    {
                        return Ok(None);
                    }
                    result => result?,
                }
            }
            Some(o) => {
                self.connection()
                    .execute(
                        &Query::update()
                            .table(Leases::Table)
                            .values([
                                (Leases::Holder, holder.into()),
                                (Leases::RenewedAt, record.renewed_at.into()),
                                (Leases::ExpiresAt, record.expires_at.into()),
                            ])
                            .and_where(Expr::col(Leases::Name).eq(name))
                            .and_where(Expr::col(Leases::Holder).eq(o.holder.as_str()))
                            .and_where(Expr::col(Leases::RenewedAt).eq(o.renewed_at))
                            .to_owned(),
                    )
                    .await?
            }
        };
        Ok((result.rows_affected() == 1).then_some(record))
    }

    /// Extends the lease held by `holder`, whose last record is `current`. Returns the new
    /// record, or `None` when `holder` no longer holds the lease.
    pub async fn lease_renew(
        &self,
        name: &str,
        holder: &str,
        current: &LeaseRecord,
        duration: Duration,
    ) -> Result<Option<LeaseRecord>, StoreError> {
        // Only the holder writes `renewed_at` while it holds the row, so the new value can be
        // computed here; it must strictly increase for observers to see the lease alive.
        let renewed_at = std::cmp::max(now_millis(), current.renewed_at + 1);
        let record = LeaseRecord {
            holder: holder.to_owned(),
            renewed_at,
            expires_at: renewed_at.saturating_add(millis(duration)),
        };
        let result = self
            .connection()
            .execute(
                &Query::update()
                    .table(Leases::Table)
                    .values([
                        (Leases::RenewedAt, record.renewed_at.into()),
                        (Leases::ExpiresAt, record.expires_at.into()),
                    ])
                    .and_where(Expr::col(Leases::Name).eq(name))
                    .and_where(Expr::col(Leases::Holder).eq(holder))
                    .to_owned(),
            )
            .await?;
        Ok((result.rows_affected() == 1).then_some(record))
    }

    /// Gives the lease up so that a candidate can take it without waiting for it to expire.
    /// Returns whether `holder` still held it.
    pub async fn lease_release(&self, name: &str, holder: &str) -> Result<bool, StoreError> {
        let now = now_millis();
        let result = self
            .connection()
            .execute(
                &Query::update()
                    .table(Leases::Table)
                    .values([(Leases::Holder, "".into()), (Leases::ExpiresAt, now.into())])
                    .and_where(Expr::col(Leases::Name).eq(name))
                    .and_where(Expr::col(Leases::Holder).eq(holder))
                    .to_owned(),
            )
            .await?;
        Ok(result.rows_affected() == 1)
    }
}

impl LeaseSnapshot for LeaseRecord {
    fn holder(&self) -> &str {
        &self.holder
    }

    /// None: a candidate waits for its own configured duration. `expires_at - renewed_at` is
    /// the holder's duration, but replicas of one installation share their configuration, and
    /// the row's timestamps are another machine's clock, which the rules never compare with
    /// ours.
    fn declared_duration(&self) -> Option<Duration> {
        None
    }

    /// Every write changes `renewed_at` (strictly increasing) or the holder, so the whole row
    /// identifies a write.
    fn same_write(&self, other: &Self) -> bool {
        self == other
    }
}

/// The lease row `name` as seen by the process `holder`: the store of the aggregator's
/// election loop (`reports_server_election::Elector`). Each call is abandoned when an outage
/// begins ([`Store::unless_outage`]): a loop stuck on a half-open connection would neither
/// stop its work nor campaign again until TCP gives up.
#[derive(Clone)]
pub struct StoreLease {
    store: Store,
    name: String,
    holder: String,
}

impl StoreLease {
    pub fn new(store: Store, name: impl Into<String>, holder: impl Into<String>) -> Self {
        StoreLease {
            store,
            name: name.into(),
            holder: holder.into(),
        }
    }
}

impl LeaseStore for StoreLease {
    type Snapshot = LeaseRecord;
    type Error = StoreError;

    fn identity(&self) -> &str {
        &self.holder
    }

    fn lease_name(&self) -> &str {
        &self.name
    }

    async fn read(&self) -> Result<Option<LeaseRecord>, StoreError> {
        let store = &self.store;
        store.unless_outage(store.lease_read(&self.name)).await
    }

    async fn acquire(
        &self,
        observed: Option<&LeaseRecord>,
        duration: Duration,
    ) -> Result<Option<LeaseRecord>, StoreError> {
        let store = &self.store;
        store
            .unless_outage(store.lease_acquire(&self.name, &self.holder, observed, duration))
            .await
    }

    async fn renew(
        &self,
        held: &LeaseRecord,
        duration: Duration,
    ) -> Result<Option<LeaseRecord>, StoreError> {
        let store = &self.store;
        store
            .unless_outage(store.lease_renew(&self.name, &self.holder, held, duration))
            .await
    }

    async fn release(&self, _held: &LeaseRecord) -> Result<(), StoreError> {
        // `false` (someone else holds it now) is what release means to do nothing about.
        let store = &self.store;
        store
            .unless_outage(store.lease_release(&self.name, &self.holder))
            .await
            .map(drop)
    }
}
