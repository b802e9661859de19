//! Flags of report aggregation: the in-process aggregator of `reports-server serve` and the
//! offline `reports-server aggregate` command.
//!
//! Both share the merge options (layout, chunk size, output group), so that previewing a dump
//! offline shows exactly what the server would write. Defaults are the aggregator crate's
//! constants, which `docs/aggregation.md` documents.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use reports_server_aggregator::aggregator::DEFAULT_PAGE_SIZE;
use reports_server_aggregator::merge::DEFAULT_CHUNK_SIZE;
use reports_server_aggregator::queue::DEFAULT_WORKERS;
use reports_server_aggregator::{
    AggregatorConfig, Layout, MergeOptions, Metrics, OfflineOptions, OutputFormat, QueueConfig,
    aggregate_offline,
};
use reports_server_apiserver::aggregation::run_in_process;
use reports_server_apiserver::standalone::RunningServer;

/// `--aggregation-layout` / `--layout` values.
fn layout_parser() -> impl TypedValueParser<Value = Layout> {
    PossibleValuesParser::new(["per-resource", "per-policy"]).map(|s| {
        s.parse::<Layout>()
            .expect("only possible values reach here")
    })
}

/// `--aggregation-output` / `--output` values.
fn output_parser() -> impl TypedValueParser<Value = OutputFormat> {
    PossibleValuesParser::new(["wgpolicy", "openreports"]).map(|s| {
        s.parse::<OutputFormat>()
            .expect("only possible values reach here")
    })
}

/// A duration in seconds (`30`, `0.5`) or with a unit (`30s`, `500ms`, `2m`), so that
/// `--aggregation-delay 30s` from the docs and a bare number both work.
fn parse_delay(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (examples: 30, 30s, 500ms, 2m)"))?;
    Duration::try_from_secs_f64(value * scale).map_err(|e| format!("{text:?}: {e}"))
}

/// In-process aggregation inside `reports-server serve` (run Kyverno with
/// `--aggregateReports=false`).
#[derive(Args, Clone, Debug)]
pub struct AggregationArgs {
    /// Merge Kyverno's ephemeral reports into policy reports inside this server. One replica
    /// per database aggregates at a time (a lease in the database).
    #[arg(
        long = "aggregation",
        env = "REPORTS_SERVER_AGGREGATION",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set,
        value_name = "BOOL"
    )]
    pub enabled: bool,
    /// Delay between a change to an ephemeral report and the merge of its namespace, in
    /// seconds or with a unit (500ms, 30s, 2m). Further changes do not postpone the merge.
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_DELAY", default_value = "30", value_parser = parse_delay)]
    pub aggregation_delay: Duration,
    /// Namespaces merged in parallel.
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_WORKERS", default_value_t = DEFAULT_WORKERS)]
    pub aggregation_workers: usize,
    /// Report layout: one report per resource (Kyverno ≥ 1.11) or per policy (Kyverno ≤ 1.10).
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_LAYOUT", default_value = "per-resource", value_parser = layout_parser())]
    pub aggregation_layout: Layout,
    /// Per-policy layout: maximum results per report (0 = unlimited).
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_CHUNK_SIZE", default_value_t = DEFAULT_CHUNK_SIZE)]
    pub chunk_size: usize,
    /// API group of the reports written: wgpolicyk8s.io PolicyReports or openreports.io Reports.
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_OUTPUT", default_value = "wgpolicy", value_parser = output_parser())]
    pub aggregation_output: OutputFormat,
    /// Per-resource layout: resources merged per page (bounds memory and transaction size).
    #[arg(long, env = "REPORTS_SERVER_AGGREGATION_PAGE_SIZE", default_value_t = DEFAULT_PAGE_SIZE)]
    pub aggregation_page_size: usize,
}

impl AggregationArgs {
    /// The aggregator settings these flags describe.
    pub fn config(&self) -> AggregatorConfig {
        AggregatorConfig {
            queue: QueueConfig {
                delay: self.aggregation_delay,
                workers: self.aggregation_workers.max(1),
                ..QueueConfig::default()
            },
            merge: MergeOptions {
                layout: self.aggregation_layout,
                chunk_size: self.chunk_size,
                output: self.aggregation_output,
                ..MergeOptions::default()
            },
            page_size: self.aggregation_page_size.max(1),
        }
    }

    /// Starts the in-process aggregator next to a running server when enabled; it stops (and
    /// releases its lease) when the server's shutdown token fires. Await the handle after the
    /// server stopped so the lease is handed over at once instead of expiring.
    pub fn spawn(&self, server: &RunningServer) -> Option<tokio::task::JoinHandle<()>> {
        if !self.enabled {
            tracing::info!("in-process aggregation disabled");
            return None;
        }
        let config = self.config();
        tracing::info!(
            delay = ?config.queue.delay,
            workers = config.queue.workers,
            layout = %config.merge.layout,
            output = %config.merge.output,
            "in-process aggregation enabled"
        );
        // Exported on the server's /metrics next to the API metrics.
        let metrics = server.metrics.register(Metrics::register);
        Some(tokio::spawn(run_in_process(
            server.store.clone(),
            config,
            metrics,
            server.shutdown_token(),
        )))
    }
}

/// `reports-server aggregate`: merge report YAML offline and print the resulting reports.
#[derive(Args, Debug)]
pub struct AggregateArgs {
    /// Report YAML to read: files, or directories searched recursively for *.yaml and *.yml;
    /// `-` reads standard input. Ephemeral reports, policy reports, openreports reports and
    /// Lists of them.
    #[arg(long, short, required = true, num_args = 1.., value_name = "FILE_OR_DIR")]
    pub input: Vec<PathBuf>,
    /// Kyverno policies (same rules); results of missing policies and rules are dropped.
    /// Without it the policy set is unknown and nothing is dropped.
    #[arg(long, num_args = 1.., value_name = "FILE_OR_DIR")]
    pub policies: Vec<PathBuf>,
    /// Report layout.
    #[arg(long, default_value = "per-resource", value_parser = layout_parser())]
    pub layout: Layout,
    /// Per-policy layout: maximum results per report (0 = unlimited).
    #[arg(long, default_value_t = DEFAULT_CHUNK_SIZE)]
    pub chunk_size: usize,
    /// API group of the reports written.
    #[arg(long, default_value = "wgpolicy", value_parser = output_parser())]
    pub output: OutputFormat,
}

/// Runs `reports-server aggregate`: prints the merged reports as multi-document YAML.
pub fn run_offline(args: AggregateArgs) -> anyhow::Result<()> {
    let yaml = aggregate_offline(
        &args.input,
        &args.policies,
        OfflineOptions {
            layout: args.layout,
            chunk_size: args.chunk_size,
            output: args.output,
        },
    )
    .context("aggregation failed")?;
    let mut out = std::io::stdout().lock();
    out.write_all(yaml.as_bytes())
        .and_then(|()| out.flush())
        .context("cannot write to standard output")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        aggregation: AggregationArgs,
    }

    #[derive(Parser)]
    struct Offline {
        #[command(flatten)]
        aggregate: AggregateArgs,
    }

    #[test]
    fn serve_defaults_are_the_documented_ones() {
        let args = Serve::try_parse_from(["serve"]).unwrap().aggregation;
        assert!(args.enabled);
        assert_eq!(args.config(), AggregatorConfig::default());
    }

    #[test]
    fn serve_flags() {
        let args = Serve::try_parse_from([
            "serve",
            "--aggregation-delay",
            "1",
            "--aggregation-workers",
            "2",
            "--aggregation-layout",
            "per-policy",
            "--chunk-size",
            "10",
            "--aggregation-output",
            "openreports",
            "--aggregation-page-size",
            "50",
        ])
        .unwrap()
        .aggregation;
        let config = args.config();
        assert_eq!(config.queue.delay, Duration::from_secs(1));
        assert_eq!(config.queue.workers, 2);
        assert_eq!(config.merge.layout, Layout::PerPolicy);
        assert_eq!(config.merge.chunk_size, 10);
        assert_eq!(config.merge.output, OutputFormat::Openreports);
        assert_eq!(config.page_size, 50);
        for (flags, enabled) in [
            (&["serve", "--aggregation"][..], true),
            (&["serve", "--aggregation=false"][..], false),
            (&["serve", "--aggregation", "false"][..], false),
        ] {
            assert_eq!(
                Serve::try_parse_from(flags).unwrap().aggregation.enabled,
                enabled,
                "{flags:?}"
            );
        }
        assert!(Serve::try_parse_from(["serve", "--aggregation-layout", "per-node"]).is_err());
    }

    #[test]
    fn delays() {
        assert_eq!(parse_delay("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_delay("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_delay("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_delay("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_delay("0.5"), Ok(Duration::from_millis(500)));
        assert!(parse_delay("soon").is_err());
        assert!(parse_delay("-1").is_err());
    }

    #[test]
    fn offline_flags() {
        let args = Offline::try_parse_from([
            "aggregate",
            "--input",
            "a.yaml",
            "dir",
            "--input",
            "-",
            "--policies",
            "p.yaml",
            "--layout",
            "per-policy",
            "--chunk-size",
            "0",
            "--output",
            "openreports",
        ])
        .unwrap()
        .aggregate;
        assert_eq!(
            args.input,
            [
                PathBuf::from("a.yaml"),
                PathBuf::from("dir"),
                PathBuf::from("-")
            ]
        );
        assert_eq!(args.policies, [PathBuf::from("p.yaml")]);
        assert_eq!(args.layout, Layout::PerPolicy);
        assert_eq!(args.chunk_size, 0);
        assert_eq!(args.output, OutputFormat::Openreports);
        assert!(Offline::try_parse_from(["aggregate"]).is_err());
    }
}
