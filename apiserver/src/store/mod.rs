//! The SQL store behind the API: objects with indexed metadata, labels, a commit-ordered
//! resourceVersion, a change log for watches and one row per policy result.
//!
//! # resourceVersion
//! One 64-bit counter per `cluster_id` lives in `store_state`, starting at
//! [`FIRST_RESOURCE_VERSION`] (never `"0"`, which client-go reads as "any version"). Every write transaction starts by
//! incrementing it (`UPDATE … SET rv = rv + 1`), which takes the row lock and holds it until
//! commit. Writers are therefore serialized and commit in counter order, on every backend and
//! across replicas sharing a database, so a reader that has seen rv N has seen every rv < N: the
//! change log has no gaps for watchers to fall into (a plain sequence would not give this).
//!
//! # Change log
//! Each write appends `(rv, resource, namespace, name, type, labels, object)` to `changes` in the
//! same transaction. Watches replay it from any retained rv; older requests get 410 Expired.
//! Retention is bounded by age and count (see [`StoreOptions`]).

mod activity;
mod body;
mod change_log;
mod cluster_identity;
pub mod columns;
mod compaction;
mod decision;
pub mod feed;
mod group_commit;
pub mod health;
pub mod lease;
pub mod merge_input;
pub mod migration;
mod mutate;
mod policy_rules;
mod pool_metrics;
mod prepared;
mod read;
mod result_diff;
pub mod ring;
pub mod schema;
mod session;
mod staged;
mod statements;
pub mod statistics;
mod stored_rows;
mod write;

use std::sync::Arc;
use std::time::Duration;

use reports_server_crds::ResourceDescriptor;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, DbErr, Statement,
};
use sea_orm_migration::MigratorTrait;
use serde_json::Value;
use tracing::Instrument;

pub use activity::{RowCounts, WriteActivity};
pub use decision::{Mutation, WriteOutcome};
pub use feed::{Change, ChangeFeed, EventType};
pub use migration::m20261123_000003_nonzero_resource_version::FIRST_RESOURCE_VERSION;
pub use read::{ListPage, ListQuery, ListRow, ListStream};

/// The addressing of one object in a batch write.
pub mod write_target {
    pub use super::decision::Target;
}

/// Errors of the store. The registry maps them to its typed errors; only the HTTP layer turns
/// those into `Status` responses.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or refused the connection: worth retrying later.
    #[error("the database is unavailable: {message}")]
    Unavailable {
        message: String,
        #[source]
        source: Option<DbErr>,
    },
    /// The database answered but refuses the work for now: read-only (a standby, a failover
    /// under way), out of disk, or too busy (lock timeouts, serialization failures).
    #[error("{refusal}: {source}")]
    Refused {
        refusal: Refusal,
        #[source]
        source: DbErr,
    },
    /// The database stopped answering after a write's commit was sent: it may or may not have
    /// been stored.
    #[error("the outcome of the write is unknown: {0}")]
    Ambiguous(String),
    /// The database answered with an error a retry will not fix.
    #[error("database error: {0}")]
    Database(#[source] DbErr),
    /// The database answered, but not what the schema promises (a missing state row, …).
    #[error("database error: {0}")]
    Inconsistent(String),
    #[error("stored object {0} is corrupt: {1}")]
    Corrupt(String, String),
    /// A list's client took no rows for this long while its read waited with a database
    /// connection; the read ended to give the connection back.
    #[error(
        "the list's client took no rows for {0:?}; the read ended to free its database \
         connection (--db-idle-in-transaction-timeout-seconds)"
    )]
    ReaderStalled(std::time::Duration),
    #[error("an object with this name already exists")]
    AlreadyExists,
    /// The configuration cannot work (an unknown database URL scheme, …); retrying will not help.
    #[error("invalid database configuration: {0}")]
    Config(String),
    /// Another cluster's reports are stored under this cluster id (see `cluster_identity`).
    #[error(
        "the database holds the reports of another cluster under cluster id {cluster_id:?} \
         (its kube-system namespace UID is {recorded}, this cluster's is {ours}); two clusters \
         sharing an id would read and overwrite each other's reports. Give this cluster its own \
         --cluster-id (the ReportsServer's spec.clusterId), or, if this is the same cluster \
         rebuilt and it should keep those reports, start once with --reclaim-cluster-id"
    )]
    ClusterIdTaken {
        cluster_id: String,
        recorded: String,
        ours: String,
    },
}

impl StoreError {
    /// `true` when the database could not be reached: the request may succeed later.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. })
    }

    /// `true` when the database could not be reached or refused the work for now (read-only
    /// during a failover, out of disk, busy): waiting for it, not giving up, is the answer.
    pub fn is_transient(&self) -> bool {
        self.is_unavailable() || matches!(self, StoreError::Refused { .. })
    }

    /// The same error again, for another writer of a group commit round that failed with it
    /// (a driver error is kept as its text).
    pub(super) fn duplicate(&self) -> StoreError {
        match self {
            StoreError::Unavailable { message, .. } => StoreError::unavailable(message.clone()),
            StoreError::Refused { refusal, source } => StoreError::Refused {
                refusal: *refusal,
                source: DbErr::Custom(source.to_string()),
            },
            StoreError::Database(e) => StoreError::Database(DbErr::Custom(e.to_string())),
            StoreError::Ambiguous(m) => StoreError::Ambiguous(m.clone()),
            StoreError::Inconsistent(m) => StoreError::Inconsistent(m.clone()),
            StoreError::Corrupt(what, why) => StoreError::Corrupt(what.clone(), why.clone()),
            StoreError::ReaderStalled(waited) => StoreError::ReaderStalled(*waited),
            StoreError::AlreadyExists => StoreError::AlreadyExists,
            StoreError::Config(m) => StoreError::Config(m.clone()),
            StoreError::ClusterIdTaken {
                cluster_id,
                recorded,
                ours,
            } => StoreError::ClusterIdTaken {
                cluster_id: cluster_id.clone(),
                recorded: recorded.clone(),
                ours: ours.clone(),
            },
        }
    }

    fn unavailable(message: impl Into<String>) -> Self {
        StoreError::Unavailable {
            message: message.into(),
            source: None,
        }
    }
}

impl From<DbErr> for StoreError {
    fn from(e: DbErr) -> Self {
        if connection_lost(&e) {
            StoreError::Unavailable {
                message: e.to_string(),
                source: Some(e),
            }
        } else if let Some(refusal) = refusal(&e) {
            StoreError::Refused { refusal, source: e }
        } else {
            StoreError::Database(e)
        }
    }
}

/// Why a database that answered will not do the work now (it may later).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the database is read-only (a standby, or a failover in progress)")]
    ReadOnly,
    #[error("the database is out of disk space")]
    DiskFull,
    #[error("the database is busy (locked, or the transaction conflicted with another)")]
    Busy,
}

/// The refusal an error reports, from each backend's own error codes.
fn refusal(e: &DbErr) -> Option<Refusal> {
    let (DbErr::Exec(sea_orm::RuntimeErr::SqlxError(s))
    | DbErr::Query(sea_orm::RuntimeErr::SqlxError(s))) = e
    else {
        return None;
    };
    let sqlx::Error::Database(db) = s.as_ref() else {
        return None;
    };
    let code = db.code()?;
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        // Extended result codes: the primary code is the low byte.
        return match code.parse::<i64>().ok()? & 0xff {
            5 | 6 => Some(Refusal::Busy),
            8 => Some(Refusal::ReadOnly),
            13 => Some(Refusal::DiskFull),
            _ => None,
        };
    }
    if db
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some()
    {
        return match code.as_ref() {
            "1290" | "1792" => Some(Refusal::ReadOnly),
            "1021" | "1114" => Some(Refusal::DiskFull),
            "1205" | "1213" => Some(Refusal::Busy),
            _ => None,
        };
    }
    match code.as_ref() {
        "25006" => Some(Refusal::ReadOnly),
        "53100" => Some(Refusal::DiskFull),
        "40001" | "40P01" | "55P03" => Some(Refusal::Busy),
        _ => None,
    }
}

/// Whether an error means the database is out of reach rather than that the statement failed,
/// decided from the driver's error kind and SQLSTATE/result code, not from message text.
fn connection_lost(e: &DbErr) -> bool {
    let sqlx = match e {
        DbErr::ConnectionAcquire(_) | DbErr::Conn(_) => return true,
        DbErr::Exec(sea_orm::RuntimeErr::SqlxError(s))
        | DbErr::Query(sea_orm::RuntimeErr::SqlxError(s)) => s,
        _ => return false,
    };
    match sqlx.as_ref() {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| unavailable_code(&code)),
        _ => false,
    }
}

/// Codes of "cannot serve you now" answers: PostgreSQL's SQLSTATE classes 08 (connection
/// exception) and 57P (operator intervention: shutdown, recovery, "the database system is
/// starting up") plus 53300 (too many connections); SQLite's SQLITE_CANTOPEN (14); MySQL's
/// server-gone and too-many-connections errors.
fn unavailable_code(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("57P")
        || code == "53300"
        || code == "14"
        || matches!(code, "1040" | "2002" | "2003" | "2006" | "2013")
}

/// Tunables of the store; the CLI exposes each as a flag.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// `sqlite://path?mode=rwc`, `postgres://…` or `mysql://…`.
    pub database_url: String,
    /// Partition key so several clusters can share one database (the peer uses the kube-system
    /// namespace UID).
    pub cluster_id: String,
    /// The cluster this process serves (the `kube-system` namespace's UID), when it knows it:
    /// the store then refuses to start on a `cluster_id` recorded for another cluster.
    pub cluster_uid: Option<String>,
    /// Take `cluster_id` over for `cluster_uid` whatever cluster it was recorded for (a cluster
    /// rebuilt with a new UID that keeps its reports).
    pub reclaim_cluster_id: bool,
    pub max_connections: u32,
    /// How long an operation waits for a database connection (and a new connection for the
    /// server to answer) before it fails; requests then get 503 instead of hanging.
    pub connect_timeout: Duration,
    /// Change-log entries younger than this are always kept for resuming watches.
    pub watch_history: Duration,
    /// Upper bound on retained change-log entries (the newest are kept).
    pub watch_history_max_events: i64,
    /// How often the change feed polls when nothing woke it (other processes on SQLite/MySQL).
    pub poll_interval: Duration,
    /// How often old change-log entries are deleted.
    pub compaction_interval: Duration,
    /// Most objects written in one group commit round (one transaction and one commit for
    /// every write queued while the previous round ran); a single larger batch still goes alone.
    pub group_commit_max_writes: usize,
    /// Bound on the bytes of recent changes the change feed buffers for live watchers; a
    /// watcher further behind is cut off and resumes from the change log.
    pub watch_buffer_bytes: usize,
    /// Bytes of a list's rows read ahead of the client, at most. A page up to this size is
    /// read at the database's pace and its connection goes back to the pool at once; a larger
    /// one (a list without `limit`) keeps its connection while its client reads, rather than
    /// hold every body in memory, and ends when the client takes nothing for
    /// `idle_in_transaction_timeout`.
    pub list_read_ahead_bytes: usize,
    /// How long the health probe waits for the database to answer before data requests are
    /// refused with 503 (see [`health`]).
    pub probe_timeout: Duration,
    /// PostgreSQL ends a session of ours that stays this long inside a transaction without
    /// sending a statement (`idle_in_transaction_session_timeout`). Ours pause for
    /// milliseconds; a session whose client is gone behind a network that drops packets
    /// pauses forever, and would hold the resourceVersion counter's row lock, and so every
    /// write of every replica, until TCP keepalive noticed (two hours by default).
    pub idle_in_transaction_timeout: Duration,
}

/// Default of [`StoreOptions::list_read_ahead_bytes`]: room for a whole page as kubectl and
/// client-go ask for it (500 reports of about 9 KB), so paged lists never wait on their client.
pub const DEFAULT_LIST_READ_AHEAD_BYTES: usize = 8 * 1024 * 1024;

impl StoreOptions {
    pub fn new(database_url: impl Into<String>) -> Self {
        StoreOptions {
            database_url: database_url.into(),
            cluster_id: "default".into(),
            cluster_uid: None,
            reclaim_cluster_id: false,
            max_connections: 10,
            connect_timeout: Duration::from_secs(10),
            watch_history: Duration::from_secs(600),
            watch_history_max_events: 100_000,
            poll_interval: Duration::from_secs(1),
            compaction_interval: Duration::from_secs(30),
            group_commit_max_writes: 256,
            watch_buffer_bytes: feed::DEFAULT_WATCH_BUFFER_BYTES,
            list_read_ahead_bytes: DEFAULT_LIST_READ_AHEAD_BYTES,
            probe_timeout: Duration::from_secs(1),
            idle_in_transaction_timeout: Duration::from_secs(10),
        }
    }
}

/// A handle on the database; cheap to clone.
#[derive(Clone)]
pub struct Store {
    db: DatabaseConnection,
    backend: DbBackend,
    cluster_id: Arc<str>,
    options: Arc<StoreOptions>,
    /// Serializes this process's write transactions (group commit rounds, compaction, raising
    /// the version floor); the counter row lock serializes them across processes. Holding it
    /// here keeps SQLite from spinning on busy timeouts.
    write_lock: Arc<tokio::sync::Mutex<Writer>>,
    /// Writers waiting for the next group commit round (see `group_commit`).
    commit_queue: Arc<group_commit::CommitQueue>,
    /// Ids of the `policy_rules` rows this process has seen committed.
    rule_cache: Arc<policy_rules::RuleCache>,
    feed: ChangeFeed,
    health: health::DatabaseHealth,
}

impl Store {
    /// Connects, runs migrations and starts the change feed and the health probe.
    pub async fn connect(options: StoreOptions) -> Result<Self, StoreError> {
        let health = health::DatabaseHealth::default();
        let db = open_database(&options, false, &health, PING_AFTER_IDLE).await?;
        let store = Store::on(db, options, health);
        store.start().await?;
        Ok(store)
    }

    /// As [`Store::connect`], but a database that cannot be reached is not an error: the store
    /// is returned at once, refusing data requests (see [`health`]), and starts (migrations,
    /// the change feed) in the background as soon as the database answers. Any other failure
    /// (a bad URL, a refused password, a schema newer than this release) is returned.
    pub async fn connect_or_wait(options: StoreOptions) -> Result<Self, StoreError> {
        // The first attempt waits no longer than the health probe would: a database that is
        // down should not delay serving discovery by a whole connection timeout.
        let first = StoreOptions {
            connect_timeout: options.probe_timeout.min(options.connect_timeout),
            ..options.clone()
        };
        let health = health::DatabaseHealth::default();
        let attempt = match open_database(&first, false, &health, PING_AFTER_IDLE).await {
            Ok(reachable) => {
                drop(reachable);
                Store::connect(options.clone()).await
            }
            Err(e) => Err(e),
        };
        let e = match attempt {
            Ok(store) => return Ok(store),
            Err(e) if e.is_transient() => e,
            Err(e) => return Err(e),
        };
        let db = open_database(&options, true, &health, PING_AFTER_IDLE).await?;
        let store = Store::on(db, options, health);
        store.health.could_not_start(&e);
        tracing::warn!(error = %e, "the database does not answer; serving discovery now, data once it answers");
        let starting = store.clone();
        tokio::spawn(
            async move { starting.start_when_reachable().await }
                .instrument(tracing::info_span!("store_start")),
        );
        Ok(store)
    }

    fn on(db: DatabaseConnection, options: StoreOptions, health: health::DatabaseHealth) -> Store {
        Store {
            backend: db.get_database_backend(),
            cluster_id: options.cluster_id.clone().into(),
            feed: ChangeFeed::new(options.watch_buffer_bytes),
            db,
            options: Arc::new(options),
            write_lock: Arc::new(tokio::sync::Mutex::new(Writer::new(health.clone()))),
            commit_queue: Arc::default(),
            rule_cache: Arc::default(),
            health,
        }
    }

    /// Migrations, the counter row, the change feed and the health probe; then data requests
    /// are served.
    async fn start(&self) -> Result<(), StoreError> {
        self.migrate().await?;
        self.ensure_state_row().await?;
        if let Some(ours) = &self.options.cluster_uid {
            cluster_identity::claim(
                &self.db,
                self.backend,
                &self.cluster_id,
                ours,
                self.options.reclaim_cluster_id,
            )
            .await?;
        }
        self.feed.start(self.clone()).await?;
        let mut probe_options = (*self.options).clone();
        probe_options.max_connections = 1;
        probe_options.connect_timeout = self.options.probe_timeout;
        // The probe's one connection is pinged on every use: a connection the database closed
        // must not look like an outage.
        let probe = open_database(&probe_options, true, &self.health, Duration::ZERO).await?;
        tokio::spawn(
            self.health
                .clone()
                .probe(probe, self.options.probe_timeout, Default::default())
                .instrument(tracing::info_span!("database_probe")),
        );
        self.health.answered();
        self.health.set_ready();
        Ok(())
    }

    /// Retries [`Store::start`] until it succeeds, backing off to 5 s between attempts while
    /// the database cannot be reached (30 s while it answers but the store cannot start).
    async fn start_when_reachable(self) {
        let mut wait = Duration::from_millis(500);
        loop {
            tokio::time::sleep(wait).await;
            match self.start().await {
                Ok(()) => return,
                Err(e) if e.is_transient() => {
                    self.health.could_not_start(&e);
                    wait = (wait * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    // Data requests say why (a cluster id of another cluster, a newer schema).
                    self.health.could_not_start(&e);
                    tracing::error!(error = %e, "the database answers but the store cannot start on it; retrying");
                    wait = (wait * 2).min(Duration::from_secs(30));
                }
            }
        }
    }

    /// What the store knows of its database: whether data requests can be served.
    pub fn health(&self) -> &health::DatabaseHealth {
        &self.health
    }

    /// Applies pending migrations (see [`change_schema`] for how concurrent replicas take
    /// turns).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        change_schema(&self.db, SchemaChange::Up).await.map(drop)
    }

    /// Creates this `cluster_id`'s counter row at [`FIRST_RESOURCE_VERSION`], never 0: client-go
    /// reads `"0"` as "any version" and its `RetryWatcher` refuses it (see the migration that
    /// defines the constant).
    async fn ensure_state_row(&self) -> Result<(), StoreError> {
        let sql = match self.backend {
            DbBackend::MySql => {
                "INSERT IGNORE INTO store_state (cluster_id, rv, compacted_rv) VALUES (?, ?, 0)"
            }
            DbBackend::Postgres => {
                "INSERT INTO store_state (cluster_id, rv, compacted_rv) VALUES ($1, $2, 0) ON CONFLICT DO NOTHING"
            }
            _ => {
                "INSERT OR IGNORE INTO store_state (cluster_id, rv, compacted_rv) VALUES (?, ?, 0)"
            }
        };
        self.db
            .execute_raw(Statement::from_sql_and_values(
                self.backend,
                sql,
                [
                    self.cluster_id.to_string().into(),
                    FIRST_RESOURCE_VERSION.into(),
                ],
            ))
            .await?;
        Ok(())
    }

    pub fn backend(&self) -> DbBackend {
        self.backend
    }

    /// How this backend's `body` columns hold documents.
    fn bodies(&self) -> body::BodyCodec {
        body::BodyCodec::of(self.backend)
    }

    /// The JSON text of the `body` column of a row of `objects` read with SQL of one's own
    /// (on SQLite bodies are stored compressed); `what` names the object in errors.
    pub fn body_of_row(
        &self,
        row: &sea_orm::QueryResult,
        what: impl Fn() -> String,
    ) -> Result<String, StoreError> {
        self.bodies().decode_required(row, "body", what)
    }

    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    pub fn options(&self) -> &StoreOptions {
        &self.options
    }

    /// Adds the store's metrics (group commit rounds) to a `/metrics` registry.
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.health.register(registry);
        registry.register_collector(Box::new(pool_metrics::PoolCollector::new(
            self.db.clone(),
            self.options.max_connections,
        )));
        self.commit_queue.register(registry);
        self.feed.register(registry);
    }

    pub fn feed(&self) -> &ChangeFeed {
        &self.feed
    }

    pub(crate) fn connection(&self) -> &DatabaseConnection {
        &self.db
    }

    /// Runs `work`, a database call of a background task, unless an outage begins first: a
    /// call caught by a network that drops packets waits on a half-open connection until TCP
    /// gives up (minutes after the database is back), and requests are ended the same way
    /// (`http::database_gate`). Dropping `work` drops its connection, which the pool closes
    /// (the outage made it stale).
    pub async fn unless_outage<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::select! {
            result = work => result,
            () = self.health.outage_begins() => Err(StoreError::unavailable(
                "the database stopped answering while this was in progress",
            )),
        }
    }

    /// Fails when the database does not answer; `/readyz` uses it.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.db.ping().await.map_err(|e| StoreError::Unavailable {
            message: e.to_string(),
            source: Some(e),
        })
    }

    /// The newest committed resourceVersion and the oldest one a watch can resume from.
    pub async fn versions(&self) -> Result<(i64, i64), StoreError> {
        self.unless_outage(read::versions(&self.db, self.backend, &self.cluster_id))
            .await
    }

    /// Bytes the store's tables and indexes take on disk, for capacity figures (`bench`). On
    /// SQLite the write-ahead log is checkpointed first so the file holds everything, and free
    /// pages are not counted; on PostgreSQL it is `pg_total_relation_size` (TOAST and indexes
    /// included) of the store's tables. Other backends: `None`.
    pub async fn storage_bytes(&self) -> Result<Option<u64>, StoreError> {
        let single = |sql: &str| Statement::from_string(self.backend, sql.to_owned());
        let bytes: i64 = match self.backend {
            DbBackend::Sqlite => {
                self.db
                    .execute_raw(single("PRAGMA wal_checkpoint(TRUNCATE)"))
                    .await?;
                let row = self
                    .db
                    .query_one_raw(single(
                        "SELECT (p.page_count - f.freelist_count) * s.page_size AS n \
                         FROM pragma_page_count() p, pragma_freelist_count() f, \
                         pragma_page_size() s",
                    ))
                    .await?;
                row.map(|r| r.try_get("", "n")).transpose()?.unwrap_or(0)
            }
            DbBackend::Postgres => {
                let row = self
                    .db
                    .query_one_raw(single(
                        "SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0)::bigint AS n \
                         FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace \
                         WHERE s.nspname = current_schema() AND c.relkind = 'r' \
                         AND c.relname IN ('objects', 'object_labels', 'changes', 'results', \
                         'policy_rules', 'store_state')",
                    ))
                    .await?;
                row.map(|r| r.try_get("", "n")).transpose()?.unwrap_or(0)
            }
            _ => return Ok(None),
        };
        Ok(Some(bytes.max(0) as u64))
    }

    /// The resource key used in the `resource` columns: `<plural>.<group>`.
    pub fn resource_key(desc: &ResourceDescriptor) -> String {
        desc.crd_name()
    }

    /// Deletes change-log entries beyond the retention bounds and records the horizon.
    pub async fn compact(&self) -> Result<i64, StoreError> {
        compaction::compact(self).await
    }

    /// Raises the resourceVersion counter and the watch horizon to at least `floor` (see
    /// [`compaction::raise_version_floor`]); returns the new `(current, compacted)` pair.
    pub async fn raise_version_floor(&self, floor: i64) -> Result<(i64, i64), StoreError> {
        // Boxed: callers' futures (the migration worker's) would otherwise nest past the
        // compiler's layout depth.
        Box::pin(compaction::raise_version_floor(self, floor)).await
    }
}

/// The connection this process's write transactions run on, one at a time (behind
/// `Store::write_lock`). A connection whose transaction failed is closed, never reused: after
/// an error such as SQLite's "database or disk is full" the database may have ended the
/// transaction on its own while the driver still counts it open, and the next "transaction" on
/// that connection became a savepoint inside a transaction that never committed — writes
/// acknowledged but invisible to other connections, and lost at restart.
pub(crate) struct Writer {
    db: Option<DatabaseConnection>,
    health: health::DatabaseHealth,
}

impl Writer {
    fn new(health: health::DatabaseHealth) -> Writer {
        Writer { db: None, health }
    }

    /// The writer connection, opened on first use.
    pub(crate) async fn connection(
        &mut self,
        options: &StoreOptions,
    ) -> Result<DatabaseConnection, StoreError> {
        if let Some(db) = &self.db {
            return Ok(db.clone());
        }
        let single = StoreOptions {
            max_connections: 1,
            ..options.clone()
        };
        // Pinged on every round: a connection closed since the last round would otherwise fail
        // every write of the next one.
        let db = open_database(&single, true, &self.health, Duration::ZERO).await?;
        self.db = Some(db.clone());
        Ok(db)
    }

    /// Closes the connection after a transaction failed with `cause`; the next write opens a new
    /// one. After a read-only refusal (the primary may have been demoted) every other pooled
    /// connection opened until now is stale too; the probe tells whether it was a standby.
    pub(crate) fn discard(&mut self, cause: &StoreError) {
        if let StoreError::Refused {
            refusal: Refusal::ReadOnly,
            ..
        } = cause
        {
            self.health.connections_stale();
        }
        if let Some(db) = self.db.take() {
            tokio::spawn(
                async move { db.close().await.ok() }
                    .instrument(tracing::debug_span!("close_writer_connection")),
            );
        }
    }
}

/// A pooled connection of the request pools used this recently is handed out without a ping
/// first: a ping on every acquire (sqlx's default) is one more round trip per request, as long
/// as a get's own, and sqlx pinged the connection when it came back to the pool.
const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// `pool` closing the connections `health` says are stale (opened before a read-only answer,
/// which may lead to a demoted primary, or before an outage, after which they may be half-open)
/// when they are next taken and when they are released. On release sqlx would otherwise ping
/// them first, without a deadline: on a half-open connection that ping holds a pool slot until
/// TCP gives up, and a pool whose slots are all held answers "pool timed out" long after the
/// database is back.
///
/// A connection idle for `ping_after_idle` or longer is pinged before use, as sqlx would ping
/// every one: the server, a proxy or a firewall may have dropped it meanwhile. The ping gets
/// `ping_deadline`: one a dropped connection never answers fails then, and the pool opens a new
/// connection, instead of holding the request until the acquire timeout. A stale one is closed
/// without a ping.
fn closing_stale<DB: sqlx::Database>(
    pool: sqlx::pool::PoolOptions<DB>,
    health: &health::DatabaseHealth,
    ping_after_idle: Duration,
    ping_deadline: Duration,
) -> sqlx::pool::PoolOptions<DB> {
    use sqlx::Connection as _;
    let (on_acquire, on_release) = (health.clone(), health.clone());
    pool.test_before_acquire(false)
        .before_acquire(move |db, opened| {
            let keep = on_acquire.keeps_connection(opened.age);
            Box::pin(async move {
                if keep && opened.idle_for >= ping_after_idle {
                    tokio::time::timeout(ping_deadline, db.ping())
                        .await
                        .map_err(|_| {
                            let late = format!("no answer to a ping within {ping_deadline:?}");
                            sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, late))
                        })??;
                }
                Ok(keep)
            })
        })
        .after_release(move |_, opened| {
            let keep = on_release.keeps_connection(opened.age);
            Box::pin(async move { Ok(keep) })
        })
}

/// A connection pool to the database `options` name, with the session settings the store
/// relies on (SQLite: WAL, full sync, a busy timeout); no migration. A `lazy` pool connects on
/// first use (the database need not answer now). The pool closes, instead of handing out or
/// keeping, a connection that `health` says is stale ([`closing_stale`]).
async fn open_database(
    options: &StoreOptions,
    lazy: bool,
    health: &health::DatabaseHealth,
    ping_after_idle: Duration,
) -> Result<DatabaseConnection, StoreError> {
    check_database_url(&options.database_url)?;
    let mut connect = ConnectOptions::new(options.database_url.clone());
    connect
        .max_connections(options.max_connections)
        .min_connections(if lazy { 0 } else { 1 })
        .connect_lazy(lazy)
        .connect_timeout(options.connect_timeout)
        .acquire_timeout(options.connect_timeout)
        .sqlx_logging(false);
    let postgres = health.clone();
    let ping_deadline = options.probe_timeout;
    let idle_in_transaction = options.idle_in_transaction_timeout;
    connect.map_sqlx_postgres_pool_opts(move |pool| {
        closing_stale(pool, &postgres, ping_after_idle, ping_deadline)
            .after_connect(move |db, _| Box::pin(session::set_up_postgres(db, idle_in_transaction)))
    });
    let mysql = health.clone();
    connect.map_sqlx_mysql_pool_opts(move |pool| {
        closing_stale(pool, &mysql, ping_after_idle, ping_deadline).after_connect(move |db, _| {
            Box::pin(session::end_abandoned_mariadb_transactions(
                db,
                idle_in_transaction,
            ))
        })
    });
    if options.database_url.starts_with("sqlite:") {
        // PostgreSQL and MySQL ping in `closing_stale`, which replaces sea-orm's hook.
        connect.test_before_acquire_if_idle_for(ping_after_idle);
        connect.map_sqlx_sqlite_opts(|o| {
            o.journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
                .busy_timeout(Duration::from_secs(30))
                .foreign_keys(false)
        });
    }
    let db = match Database::connect(connect).await {
        Ok(db) => db,
        Err(e) if is_pool_timeout(&e) => return Err(explain_pool_timeout(options).await),
        Err(e) => return Err(e.into()),
    };
    Ok(db)
}

/// Undoes the schema migrations applied after `to` (a migration's name, see
/// `seaql_migrations`), newest first, so that the release whose last migration is `to` can
/// start on the database; returns the names undone (none when the database is at `to` or
/// older). Every replica must be stopped first: a running newer release would write rows the
/// older schema cannot hold.
pub async fn downgrade_schema(options: &StoreOptions, to: &str) -> Result<Vec<String>, StoreError> {
    let known = migration_names();
    if !known.iter().any(|name| name == to) {
        return Err(StoreError::Config(format!(
            "--to {to:?} is not a migration of this release; it knows {}",
            known.join(", ")
        )));
    }
    change_schema(
        &open_database(
            options,
            false,
            &health::DatabaseHealth::default(),
            PING_AFTER_IDLE,
        )
        .await?,
        SchemaChange::DownTo(to),
    )
    .await
}

/// This release's migrations, oldest first.
fn migration_names() -> Vec<String> {
    migration::Migrator::migrations()
        .iter()
        .map(|m| m.name().to_owned())
        .collect()
}

/// What a schema run does.
enum SchemaChange<'a> {
    /// Apply every pending migration.
    Up,
    /// Undo the applied migrations that come after this one in the release's order.
    DownTo(&'a str),
}

/// Runs `change` where migrations run: in one transaction on PostgreSQL, under an advisory
/// lock, so replicas starting at once take turns; in one transaction on SQLite too, whose DDL
/// is transactional — statements spread over the pool's connections could meet a schema that
/// another connection had just changed ("there is already another table …" after a DROP and a
/// RENAME); on the pool on MySQL, whose DDL commits implicitly (there the idempotent DDL and
/// the migrations table make a race harmless). Returns the migrations undone.
async fn change_schema(
    db: &DatabaseConnection,
    change: SchemaChange<'_>,
) -> Result<Vec<String>, StoreError> {
    if db.get_database_backend() == DbBackend::MySql {
        return apply_schema_change(db.into(), change).await;
    }
    let txn = sea_orm::TransactionTrait::begin(db).await?;
    if db.get_database_backend() == DbBackend::Postgres {
        txn.execute_unprepared("SELECT pg_advisory_xact_lock(7242519)")
            .await?;
    }
    match apply_schema_change((&txn).into(), change).await {
        Ok(undone) => {
            txn.commit().await?;
            Ok(undone)
        }
        Err(e) => {
            txn.rollback().await.ok();
            Err(e)
        }
    }
}

async fn apply_schema_change(
    conn: sea_orm::DatabaseExecutor<'_>,
    change: SchemaChange<'_>,
) -> Result<Vec<String>, StoreError> {
    let to = match change {
        SchemaChange::Up => {
            migration::Migrator::up(conn, None).await?;
            return Ok(Vec::new());
        }
        SchemaChange::DownTo(to) => to,
    };
    let order = migration_names();
    let after =
        |name: &str| order.iter().position(|n| n == name) > order.iter().position(|n| n == to);
    let undone: Vec<String> = migration::Migrator::get_applied_migrations(&conn)
        .await?
        .iter()
        .map(|m| m.name().to_owned())
        .filter(|name| after(name))
        .rev()
        .collect();
    if !undone.is_empty() {
        migration::Migrator::down(conn, Some(undone.len() as u32)).await?;
    }
    Ok(undone)
}

/// The URL schemes the store has drivers for.
const DATABASE_SCHEMES: [&str; 5] = ["sqlite", "postgres", "postgresql", "mysql", "mariadb"];

/// Refuses a database URL no driver can open, as the configuration error it is (sea-orm would
/// report it as a connection failure).
fn check_database_url(url: &str) -> Result<(), StoreError> {
    let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
    if DATABASE_SCHEMES.contains(&scheme) {
        return Ok(());
    }
    Err(StoreError::Config(format!(
        "--database-url {:?} has the scheme {scheme:?}; use sqlite://PATH?mode=rwc, postgres://USER:PASSWORD@HOST:PORT/DATABASE or mysql://…",
        redact_password(url)
    )))
}

fn is_pool_timeout(e: &DbErr) -> bool {
    matches!(
        e,
        DbErr::ConnectionAcquire(sea_orm::ConnAcquireErr::Timeout)
    ) || e.to_string().contains("pool timed out")
}

/// A pool that times out hides why no connection could be made ("pool timed out while waiting
/// for an open connection"); one direct connection attempt tells (connection refused, unknown
/// host, password authentication failed, …).
async fn explain_pool_timeout(options: &StoreOptions) -> StoreError {
    use sqlx::ConnectOptions as _;
    let url = &options.database_url;
    let attempt = async {
        let e = if url.starts_with("postgres") {
            url.parse::<sqlx::postgres::PgConnectOptions>()?
                .connect()
                .await
                .err()
        } else if url.starts_with("mysql") || url.starts_with("mariadb") {
            url.parse::<sqlx::mysql::MySqlConnectOptions>()?
                .connect()
                .await
                .err()
        } else {
            url.parse::<sqlx::sqlite::SqliteConnectOptions>()?
                .connect()
                .await
                .err()
        };
        Ok::<_, sqlx::Error>(e)
    };
    let cause = match tokio::time::timeout(options.connect_timeout, attempt).await {
        Ok(Ok(Some(e)) | Err(e)) => e.to_string(),
        Ok(Ok(None)) => "a direct connection works now; the database was slow to answer".into(),
        Err(_) => format!(
            "no answer within {:?} (--db-connect-timeout-seconds)",
            options.connect_timeout
        ),
    };
    StoreError::unavailable(format!(
        "cannot connect to {}: {cause}",
        redact_password(url)
    ))
}

/// The URL with its password replaced, for error messages.
fn redact_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((userinfo, host)) = rest.split_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

/// Decodes a stored JSON document (bodies returned by lists).
pub fn parse_document_public(what: &str, text: &str) -> Result<Value, StoreError> {
    parse_document(what, text)
}

/// Reads a JSON document column.
pub(crate) fn parse_document(what: &str, text: &str) -> Result<Value, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt(what.to_owned(), e.to_string()))
}

/// SQLite's plan for a statement, one step per line (`EXPLAIN QUERY PLAN`'s `detail`): tests
/// pin the index a hot query seeks with.
#[cfg(test)]
pub(crate) async fn sqlite_query_plan(
    store: &Store,
    statement: &impl sea_orm::StatementBuilder,
) -> Vec<String> {
    let connection = store.connection();
    let mut explain = connection.get_database_backend().build(statement);
    explain.sql = format!("EXPLAIN QUERY PLAN {}", explain.sql);
    connection
        .query_all_raw(explain)
        .await
        .expect("EXPLAIN QUERY PLAN")
        .iter()
        .map(|row| {
            row.try_get::<String>("", "detail")
                .expect("a detail column")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls_without_a_driver_are_configuration_errors() {
        for ok in [
            "sqlite:///tmp/x.db?mode=rwc",
            "sqlite::memory:",
            "postgres://u:p@h/db",
            "postgresql://h/db",
            "mysql://h/db",
        ] {
            assert!(check_database_url(ok).is_ok(), "{ok}");
        }
        for bad in ["foo://bar", "reports.db", "", "http://db:5432"] {
            let e = check_database_url(bad).unwrap_err();
            assert!(matches!(e, StoreError::Config(_)), "{bad}: {e}");
            assert!(e.to_string().contains("--database-url"), "{e}");
        }
    }

    #[test]
    fn passwords_are_left_out_of_messages() {
        assert_eq!(
            redact_password("postgres://rs:s3cret@db:5432/reports"),
            "postgres://rs:***@db:5432/reports"
        );
        assert_eq!(
            redact_password("postgres://db/reports"),
            "postgres://db/reports"
        );
        assert_eq!(redact_password("sqlite:///x.db"), "sqlite:///x.db");
    }

    #[tokio::test]
    async fn an_unreachable_database_names_the_cause() {
        // A port nothing listens on: the pool would only say "pool timed out".
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let mut options = StoreOptions::new(format!("postgres://rs:pw@127.0.0.1:{port}/reports"));
        options.connect_timeout = Duration::from_secs(2);
        let e = match Store::connect(options).await {
            Ok(_) => panic!("nothing listens on port {port}"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
        assert!(e.to_lowercase().contains("refused"), "{e}");
        assert!(!e.contains("pw@"), "{e}");
    }
}
