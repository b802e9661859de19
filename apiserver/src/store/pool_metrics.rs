//! `/metrics` series of the store's connection pool, read from the pool at each scrape (a
//! gauge updated by the store would be stale between its updates): connections idle and in
//! use, and the configured maximum. A pool at its maximum with requests waiting shows up as
//! `in_use` = `max` and slower requests; raise `--db-max-connections` or the database's limit.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use sea_orm::{DatabaseConnection, DbBackend};

#[derive(Debug)]
pub(super) struct PoolCollector {
    db: DatabaseConnection,
    max: u32,
}

impl PoolCollector {
    pub(super) fn new(db: DatabaseConnection, max: u32) -> Self {
        PoolCollector { db, max }
    }

    /// (open connections, idle connections).
    fn sizes(&self) -> (u32, usize) {
        match self.db.get_database_backend() {
            DbBackend::Postgres => {
                let pool = self.db.get_postgres_connection_pool();
                (pool.size(), pool.num_idle())
            }
            DbBackend::MySql => {
                let pool = self.db.get_mysql_connection_pool();
                (pool.size(), pool.num_idle())
            }
            _ => {
                let pool = self.db.get_sqlite_connection_pool();
                (pool.size(), pool.num_idle())
            }
        }
    }
}

impl Collector for PoolCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (open, idle) = self.sizes();
        let idle = i64::try_from(idle).unwrap_or(i64::MAX);
        let in_use = i64::from(open).saturating_sub(idle).max(0);
        let mut family = encoder.encode_descriptor(
            "reports_server_database_pool_connections",
            "Connections of the store's pool, by state (idle, in_use)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (state, value) in [("idle", idle), ("in_use", in_use)] {
            let labels = [("state", state)];
            ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
        }
        let max = ConstGauge::new(i64::from(self.max));
        max.encode(encoder.encode_descriptor(
            "reports_server_database_pool_max_connections",
            "Most connections the store's pool opens (--db-max-connections)",
            None,
            max.metric_type(),
        )?)
    }
}
