//! What the statistics worker (`crate::statistics`) reads and writes: the compliance history
//! (`compliance_snapshots`, `compliance_history`; see their migration) and the counts behind
//! the `/metrics` gauges. Every statement is scoped to this store's cluster id.
//!
//! A snapshot's counts are one consistent `SELECT … GROUP BY` over `report_results`; a short
//! transaction then claims the snapshot's row, keyed by the slot (see
//! `crate::statistics::schedule`), and writes them: of two servers that both think they lead
//! (a paused process), the second gets a primary-key violation and writes nothing.

use sea_orm::sea_query::{InsertStatement, Query};
use sea_orm::{ConnectionTrait, DbBackend, SqlErr, Statement, TransactionTrait, Value};

use super::schema::ComplianceHistory;
use super::{Store, StoreError};

/// What [`Store::take_compliance_snapshot`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotOutcome {
    /// Written, with this many (namespace, source, policy) rows.
    Taken { rows: u64 },
    /// The slot has its snapshot already (another server took it).
    Exists,
}

/// Stored objects of one resource (`<plural>.<group>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectCount {
    pub resource: String,
    pub objects: i64,
}

/// Results of one policy with one outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResultCount {
    /// `""` when the results name no source.
    pub source: String,
    pub policy: String,
    pub result: String,
    pub results: i64,
}

/// `sql` with `?` placeholders spelled the backend's way (`$1`, `$2`, … on PostgreSQL).
fn placeholders(backend: DbBackend, sql: &str) -> String {
    if backend != DbBackend::Postgres {
        return sql.to_owned();
    }
    let mut out = String::with_capacity(sql.len() + 8);
    let mut n = 0;
    for c in sql.chars() {
        if c == '?' {
            n += 1;
            out.push_str(&format!("${n}"));
        } else {
            out.push(c);
        }
    }
    out
}

fn statement(backend: DbBackend, sql: &str, values: impl IntoIterator<Item = Value>) -> Statement {
    Statement::from_sql_and_values(backend, placeholders(backend, sql), values)
}

/// The counts of every (namespace, source, policy) of one cluster.
const SNAPSHOT_COUNTS: &str = "SELECT COALESCE(namespace, '') AS namespace, \
    COALESCE(source, '') AS source, policy, \
    COUNT(CASE WHEN result = 'pass' THEN 1 END) AS pass, \
    COUNT(CASE WHEN result = 'fail' THEN 1 END) AS fail, \
    COUNT(CASE WHEN result = 'warn' THEN 1 END) AS warn, \
    COUNT(CASE WHEN result = 'error' THEN 1 END) AS error, \
    COUNT(CASE WHEN result = 'skip' THEN 1 END) AS skip \
    FROM report_results WHERE cluster_id = ? \
    GROUP BY COALESCE(namespace, ''), COALESCE(source, ''), policy";

/// History rows per `INSERT`: 10 values each, far below every backend's limit on bound values.
const SNAPSHOT_BATCH: usize = 500;

impl Store {
    /// Records the compliance counts of this cluster as they are now under the slot start
    /// `slot` (Unix seconds). The counts are one plain `SELECT` (a consistent read that locks
    /// nothing: an `INSERT … SELECT` would hold shared locks on every result row on MySQL, and
    /// SQLite's write lock for the whole scan); then one short transaction claims the slot's
    /// row and writes them, so a snapshot is whole or absent and a slot has one.
    pub async fn take_compliance_snapshot(&self, slot: i64) -> Result<SnapshotOutcome, StoreError> {
        let backend = self.backend();
        let cluster = self.cluster_id().to_owned();
        self.unless_outage(async {
            let counts = self
                .connection()
                .query_all_raw(statement(
                    backend,
                    SNAPSHOT_COUNTS,
                    [cluster.clone().into()],
                ))
                .await?;
            let txn = self.connection().begin().await?;
            let claimed = txn
                .execute_raw(statement(
                    backend,
                    "INSERT INTO compliance_snapshots (cluster_id, taken_at) VALUES (?, ?)",
                    [cluster.clone().into(), slot.into()],
                ))
                .await;
            match claimed {
                Err(e) if matches!(e.sql_err(), Some(SqlErr::UniqueConstraintViolation(_))) => {
                    txn.rollback().await?;
                    return Ok(SnapshotOutcome::Exists);
                }
                other => {
                    other?;
                }
            }
            for batch in counts.chunks(SNAPSHOT_BATCH) {
                txn.execute(&history_insert(&cluster, slot, batch)?).await?;
            }
            txn.commit().await?;
            Ok(SnapshotOutcome::Taken {
                rows: counts.len() as u64,
            })
        })
        .await
    }

    /// Deletes this cluster's snapshots taken before `before` (Unix seconds); returns how many
    /// snapshots went.
    pub async fn prune_compliance_history(&self, before: i64) -> Result<u64, StoreError> {
        let backend = self.backend();
        let values = || [Value::from(self.cluster_id().to_owned()), before.into()];
        self.unless_outage(async {
            let txn = self.connection().begin().await?;
            txn.execute_raw(statement(
                backend,
                "DELETE FROM compliance_history WHERE cluster_id = ? AND taken_at < ?",
                values(),
            ))
            .await?;
            let snapshots = txn
                .execute_raw(statement(
                    backend,
                    "DELETE FROM compliance_snapshots WHERE cluster_id = ? AND taken_at < ?",
                    values(),
                ))
                .await?
                .rows_affected();
            txn.commit().await?;
            Ok(snapshots)
        })
        .await
    }

    /// When this cluster's newest snapshot was taken (Unix seconds), if it has any.
    pub async fn last_compliance_snapshot(&self) -> Result<Option<i64>, StoreError> {
        let backend = self.backend();
        let row = self
            .unless_outage(async {
                Ok(self
                    .connection()
                    .query_one_raw(statement(
                        backend,
                        "SELECT MAX(taken_at) AS last FROM compliance_snapshots \
                         WHERE cluster_id = ?",
                        [self.cluster_id().to_owned().into()],
                    ))
                    .await?)
            })
            .await?;
        Ok(row
            .map(|r| r.try_get::<Option<i64>>("", "last"))
            .transpose()?
            .flatten())
    }

    /// Stored objects per resource, for this cluster.
    pub async fn object_counts(&self) -> Result<Vec<ObjectCount>, StoreError> {
        let rows = self
            .read_counts(
                "SELECT resource, COUNT(*) AS n FROM objects WHERE cluster_id = ? \
                 GROUP BY resource ORDER BY resource",
            )
            .await?;
        rows.iter()
            .map(|row| {
                Ok(ObjectCount {
                    resource: row.try_get("", "resource")?,
                    objects: row.try_get("", "n")?,
                })
            })
            .collect()
    }

    /// Results per source, policy and outcome, for this cluster.
    pub async fn result_counts(&self) -> Result<Vec<ResultCount>, StoreError> {
        let rows = self
            .read_counts(
                "SELECT COALESCE(source, '') AS source, policy, result, COUNT(*) AS n \
                 FROM report_results WHERE cluster_id = ? \
                 GROUP BY COALESCE(source, ''), policy, result ORDER BY 1, 2, 3",
            )
            .await?;
        rows.iter()
            .map(|row| {
                Ok(ResultCount {
                    source: row.try_get("", "source")?,
                    policy: row.try_get("", "policy")?,
                    result: row.try_get("", "result")?,
                    results: row.try_get("", "n")?,
                })
            })
            .collect()
    }

    async fn read_counts(&self, sql: &str) -> Result<Vec<sea_orm::QueryResult>, StoreError> {
        let backend = self.backend();
        self.unless_outage(async {
            Ok(self
                .connection()
                .query_all_raw(statement(
                    backend,
                    sql,
                    [self.cluster_id().to_owned().into()],
                ))
                .await?)
        })
        .await
    }
}

/// One multi-row `INSERT` of snapshot counts (`rows` read with [`SNAPSHOT_COUNTS`]).
fn history_insert(
    cluster: &str,
    slot: i64,
    rows: &[sea_orm::QueryResult],
) -> Result<InsertStatement, StoreError> {
    let mut insert = Query::insert();
    insert.into_table(ComplianceHistory::Table).columns([
        ComplianceHistory::ClusterId,
        ComplianceHistory::TakenAt,
        ComplianceHistory::Namespace,
        ComplianceHistory::Source,
        ComplianceHistory::Policy,
        ComplianceHistory::Pass,
        ComplianceHistory::Fail,
        ComplianceHistory::Warn,
        ComplianceHistory::Error,
        ComplianceHistory::Skip,
    ]);
    for row in rows {
        let text = |column: &str| row.try_get::<String>("", column);
        let count = |column: &str| row.try_get::<i64>("", column);
        insert.values_panic([
            cluster.into(),
            slot.into(),
            text("namespace")?.into(),
            text("source")?.into(),
            text("policy")?.into(),
            count("pass")?.into(),
            count("fail")?.into(),
            count("warn")?.into(),
            count("error")?.into(),
            count("skip")?.into(),
        ]);
    }
    Ok(insert)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_numbered_on_postgres_only() {
        let sql = "SELECT 1 WHERE a = ? AND b = ?";
        assert_eq!(
            placeholders(DbBackend::Postgres, sql),
            "SELECT 1 WHERE a = $1 AND b = $2"
        );
        assert_eq!(placeholders(DbBackend::Sqlite, sql), sql);
        assert_eq!(placeholders(DbBackend::MySql, sql), sql);
    }
}
