//! What the database has written so far, for benchmarks that report the database work of a
//! write rather than its time: PostgreSQL's write-ahead log position and its per-table row
//! counters. Two readings taken around a load give that load's bytes of WAL and rows inserted,
//! updated and deleted per table.

use std::collections::BTreeMap;

use sea_orm::{ConnectionTrait, DbBackend, Statement};

use super::{Store, StoreError};

/// Rows a table has had inserted, updated (HOT updates among them) and deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowCounts {
    pub inserted: i64,
    pub updated: i64,
    pub hot_updated: i64,
    pub deleted: i64,
}

impl RowCounts {
    /// Rows touched: what a write costs in heap tuples and, but for HOT updates, index entries.
    pub fn touched(&self) -> i64 {
        self.inserted + self.updated + self.deleted
    }

    fn since(&self, before: &RowCounts) -> RowCounts {
        RowCounts {
            inserted: self.inserted - before.inserted,
            updated: self.updated - before.updated,
            hot_updated: self.hot_updated - before.hot_updated,
            deleted: self.deleted - before.deleted,
        }
    }
}

/// One reading of the database's write counters.
#[derive(Clone, Debug, Default)]
pub struct WriteActivity {
    /// Bytes of write-ahead log generated since the cluster was created (every database of
    /// the PostgreSQL cluster counts: read it on a cluster the load has to itself).
    pub wal_bytes: u64,
    /// Row counters of the store's tables, by table name.
    pub rows: BTreeMap<String, RowCounts>,
}

impl WriteActivity {
    /// What happened between `before` and this reading.
    pub fn since(&self, before: &WriteActivity) -> WriteActivity {
        WriteActivity {
            wal_bytes: self.wal_bytes.saturating_sub(before.wal_bytes),
            rows: self
                .rows
                .iter()
                .map(|(table, now)| {
                    let then = before.rows.get(table).copied().unwrap_or_default();
                    (table.clone(), now.since(&then))
                })
                .collect(),
        }
    }
}

impl Store {
    /// The database's write counters, on PostgreSQL (`None` on other backends). Row counters
    /// reach `pg_stat_user_tables` when each backend flushes its statistics (at most a second
    /// after its transaction): wait that long after a load before reading.
    pub async fn write_activity(&self) -> Result<Option<WriteActivity>, StoreError> {
        if self.backend != DbBackend::Postgres {
            return Ok(None);
        }
        let single = |sql: &str| Statement::from_string(self.backend, sql.to_owned());
        let wal: i64 = self
            .db
            .query_one_raw(single(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS n",
            ))
            .await?
            .map(|r| r.try_get("", "n"))
            .transpose()?
            .unwrap_or(0);
        let rows = self
            .db
            .query_all_raw(single(
                "SELECT relname::text AS name, n_tup_ins AS ins, n_tup_upd AS upd, \
                 n_tup_hot_upd AS hot, n_tup_del AS del \
                 FROM pg_stat_user_tables WHERE schemaname = current_schema()",
            ))
            .await?;
        let mut activity = WriteActivity {
            wal_bytes: wal.max(0) as u64,
            rows: BTreeMap::new(),
        };
        for row in rows {
            activity.rows.insert(
                row.try_get("", "name")?,
                RowCounts {
                    inserted: row.try_get("", "ins")?,
                    updated: row.try_get("", "upd")?,
                    hot_updated: row.try_get("", "hot")?,
                    deleted: row.try_get("", "del")?,
                },
            );
        }
        Ok(Some(activity))
    }
}
