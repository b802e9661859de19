//! `serve`'s statistics flags: the `/metrics` gauges of stored objects and results, and the
//! compliance history (see `reports_server_apiserver::statistics`).

use std::time::Duration;

use clap::Args;
use reports_server_apiserver::startup::RunningServer;
use reports_server_apiserver::statistics::{
    self, StatisticsMetrics, StatisticsOptions, StatisticsWorker,
};

use crate::aggregation_cli::parse_delay;

#[derive(Args, Clone, Debug)]
pub struct StatisticsArgs {
    /// How often the statistics lease holder reads the counts of stored objects and results
    /// for `/metrics` (`reports_server_statistics_*`); 0 publishes none. Each read is a
    /// `GROUP BY` over every result of the cluster.
    #[arg(long, env = "REPORTS_SERVER_STATISTICS_INTERVAL", default_value = "60s", value_parser = parse_delay)]
    pub statistics_interval: Duration,
    /// How often a compliance history snapshot is taken (counts per namespace, source and
    /// policy, for `reports-server query trend`), in slots counted from the Unix epoch (`24h`:
    /// once per UTC day); 0 keeps no history.
    #[arg(long, env = "REPORTS_SERVER_HISTORY_INTERVAL", default_value = "24h", value_parser = parse_delay)]
    pub history_interval: Duration,
    /// Snapshots older than this are deleted; 0 keeps them all.
    #[arg(long, env = "REPORTS_SERVER_HISTORY_RETENTION", default_value = "90d", value_parser = parse_delay)]
    pub history_retention: Duration,
}

impl StatisticsArgs {
    /// Starts the worker beside `server` (stopped by its shutdown); `None` when both intervals
    /// are 0.
    pub fn spawn(
        &self,
        server: &RunningServer,
    ) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
        let options = self.options()?;
        let metrics = StatisticsMetrics::default();
        server
            .metrics
            .register(|registry| metrics.register(registry));
        let worker = StatisticsWorker::new(server.store.clone(), options, metrics);
        Ok(statistics::spawn(worker, server.shutdown_token()))
    }

    /// The worker's options, checked (before the server starts, so a bad pair fails `serve`).
    pub fn options(&self) -> anyhow::Result<StatisticsOptions> {
        let options = StatisticsOptions {
            refresh_interval: self.statistics_interval,
            history_interval: self.history_interval,
            history_retention: self.history_retention,
            ..StatisticsOptions::default()
        };
        options.check().map_err(anyhow::Error::msg)?;
        Ok(options)
    }
}
