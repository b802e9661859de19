//! `reports-server query`: the named questions of `reports-server-analytics` and read-only SQL
//! from the command line, against the database `serve` uses (the same `--database-url`,
//! `DB_*` variables and default SQLite file), printed as a table, JSON, CSV or YAML.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand, ValueEnum};
use reports_server_analytics::{
    self as analytics, AnalyticsError, Condition, Grouping, Output, Question, ResultFilter,
};

use crate::database_url;

#[derive(Args)]
pub struct QueryArgs {
    #[command(subcommand)]
    question: Option<QuestionCommand>,
    /// Run this SQL instead of a named question, in a read-only transaction (a statement that
    /// writes is refused). Query the views of docs/analytics.md and docs/sql-schema.md.
    #[arg(long, env = "REPORTS_SERVER_QUERY_SQL")]
    sql: Option<String>,
    #[command(flatten)]
    connection: ConnectionArgs,
}

/// Where `serve`'s database is, for commands that read it.
#[derive(Args)]
pub struct DatabaseLocation {
    /// Database URL: sqlite://PATH, postgres://USER:PASS@HOST:PORT/DB or mysql://…
    /// [default: `serve`'s: built from DB_HOST/DB_PORT/DB_DATABASE/DB_USER/DB_PASSWORD when DB_HOST is set, else the SQLite file `reports.db` in --data-dir]
    #[arg(long, env = "REPORTS_SERVER_DATABASE_URL", global = true)]
    database_url: Option<String>,
    /// Directory of `serve`'s embedded database.
    #[arg(long, env = "REPORTS_SERVER_DATA_DIR", default_value_t = crate::default_data_dir(), global = true)]
    data_dir: String,
}

#[derive(Args)]
struct ConnectionArgs {
    #[command(flatten)]
    location: DatabaseLocation,
    /// The cluster whose reports to read, when several share the database; `all` reads every
    /// cluster of the database (each row then names its cluster).
    #[arg(
        long,
        env = "REPORTS_SERVER_CLUSTER_ID",
        default_value = "default",
        global = true
    )]
    cluster_id: String,
    /// Seconds to wait for the database connection.
    #[arg(
        long,
        env = "REPORTS_SERVER_DB_CONNECT_TIMEOUT_SECONDS",
        default_value_t = 10,
        global = true
    )]
    db_connect_timeout_seconds: u64,
    /// How to print the answer.
    #[arg(
        long,
        short = 'o',
        env = "REPORTS_SERVER_QUERY_OUTPUT",
        default_value = "table",
        value_enum,
        global = true
    )]
    output: OutputArg,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OutputArg {
    Table,
    Json,
    Csv,
    Yaml,
}

#[derive(Subcommand)]
enum QuestionCommand {
    /// Failing results with their subject, policy, rule and message.
    Failing(Listed),
    /// pass, fail, warn, error, skip, total and ratio (pass / (pass + fail + warn + error)) per
    /// namespace, policy or cluster.
    Compliance(ComplianceArgs),
    /// The resources with the most failing results.
    TopFailing(Listed),
    /// Results whose properties satisfy every --where, e.g. --where 'score>=8.0' on Trivy's
    /// vulnerability reports; shows those properties.
    Properties(PropertiesArgs),
    /// How compliance changed: one row per compliance history snapshot (taken by `serve`
    /// every --history-interval), the cluster's totals or per namespace, policy or cluster.
    Trend(TrendArgs),
}

#[derive(Args)]
struct TrendArgs {
    /// One row per snapshot and namespace, policy (and source), or cluster of the database
    /// [default: the cluster's totals per snapshot].
    #[arg(long, env = "REPORTS_SERVER_QUERY_BY", value_enum)]
    by: Option<GroupingArg>,
    /// Snapshots taken in this last stretch of time, e.g. 7d, 30d, 24h.
    #[arg(long, env = "REPORTS_SERVER_QUERY_SINCE", default_value = "30d", value_parser = crate::aggregation_cli::parse_delay)]
    since: Duration,
    /// Only this namespace's counts.
    #[arg(long, env = "REPORTS_SERVER_QUERY_NAMESPACE")]
    namespace: Option<String>,
    /// Only this policy's counts.
    #[arg(long, env = "REPORTS_SERVER_QUERY_POLICY")]
    policy: Option<String>,
    /// Only this source's counts.
    #[arg(long, env = "REPORTS_SERVER_QUERY_SOURCE")]
    source: Option<String>,
}

#[derive(Args)]
struct Listed {
    #[command(flatten)]
    filter: ResultFilterArgs,
    /// At most this many rows. [default: 10 for top-failing, 100 otherwise]
    #[arg(long, env = "REPORTS_SERVER_QUERY_LIMIT")]
    limit: Option<u32>,
}

/// `--limit`'s default: a top ten of resources, a screenful or two of results.
const TOP_FAILING_LIMIT: u32 = 10;
const RESULTS_LIMIT: u32 = 100;

#[derive(Args)]
struct ResultFilterArgs {
    /// Only this policy.
    #[arg(long, env = "REPORTS_SERVER_QUERY_POLICY")]
    policy: Option<String>,
    /// Only reports in this namespace (`""` for cluster-scoped reports).
    #[arg(long, env = "REPORTS_SERVER_QUERY_NAMESPACE")]
    namespace: Option<String>,
    /// Only this severity: critical, high, medium, low or info.
    #[arg(long, env = "REPORTS_SERVER_QUERY_SEVERITY")]
    severity: Option<String>,
    /// Only this category, e.g. "Pod Security Standards (Baseline)".
    #[arg(long, env = "REPORTS_SERVER_QUERY_CATEGORY")]
    category: Option<String>,
    /// Only this source (the engine that wrote the result), e.g. kyverno.
    #[arg(long, env = "REPORTS_SERVER_QUERY_SOURCE")]
    source: Option<String>,
    /// Only results about this kind of resource, e.g. Pod.
    #[arg(long, env = "REPORTS_SERVER_QUERY_KIND")]
    kind: Option<String>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum GroupingArg {
    Namespace,
    Policy,
    Cluster,
}

#[derive(Args)]
struct ComplianceArgs {
    /// One row per namespace, per policy (and source), or per cluster of the database.
    #[arg(
        long,
        env = "REPORTS_SERVER_QUERY_BY",
        default_value = "namespace",
        value_enum
    )]
    by: GroupingArg,
    /// With --by namespace: only this namespace.
    #[arg(long, env = "REPORTS_SERVER_QUERY_NAMESPACE")]
    namespace: Option<String>,
    /// With --by policy: only this policy.
    #[arg(long, env = "REPORTS_SERVER_QUERY_POLICY")]
    policy: Option<String>,
    /// With --by policy: only this source.
    #[arg(long, env = "REPORTS_SERVER_QUERY_SOURCE")]
    source: Option<String>,
}

#[derive(Args)]
struct PropertiesArgs {
    /// KEY OP VALUE over the result's properties (repeat: all must hold). OP is = or != (text)
    /// or >, >=, <, <= (the property read as a number). KEY holds [A-Za-z0-9_.-].
    #[arg(long = "where", required = true, env = "REPORTS_SERVER_QUERY_WHERE")]
    conditions: Vec<Condition>,
    #[command(flatten)]
    listed: Listed,
}

impl ResultFilterArgs {
    fn filter(self, cluster_id: String) -> ResultFilter {
        ResultFilter {
            cluster_id,
            policy: self.policy,
            namespace: self.namespace,
            severity: self.severity,
            category: self.category,
            source: self.source,
            kind: self.kind,
        }
    }
}

impl From<GroupingArg> for Grouping {
    fn from(arg: GroupingArg) -> Self {
        match arg {
            GroupingArg::Namespace => Grouping::Namespace,
            GroupingArg::Policy => Grouping::Policy,
            GroupingArg::Cluster => Grouping::Cluster,
        }
    }
}

/// Unix seconds now.
fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl QuestionCommand {
    fn question(self, cluster_id: String, now: i64) -> Question {
        match self {
            QuestionCommand::Failing(args) => Question::Failing {
                filter: args.filter.filter(cluster_id),
                limit: args.limit.unwrap_or(RESULTS_LIMIT),
            },
            QuestionCommand::TopFailing(args) => Question::TopFailing {
                filter: args.filter.filter(cluster_id),
                limit: args.limit.unwrap_or(TOP_FAILING_LIMIT),
            },
            QuestionCommand::Compliance(args) => Question::Compliance {
                by: args.by.into(),
                filter: ResultFilter {
                    cluster_id,
                    namespace: args.namespace,
                    policy: args.policy,
                    source: args.source,
                    ..ResultFilter::default()
                },
            },
            QuestionCommand::Properties(args) => Question::Properties {
                filter: args.listed.filter.filter(cluster_id),
                conditions: args.conditions,
                limit: args.listed.limit.unwrap_or(RESULTS_LIMIT),
            },
            QuestionCommand::Trend(args) => Question::Trend {
                by: args.by.map(Grouping::from),
                filter: ResultFilter {
                    cluster_id,
                    namespace: args.namespace,
                    policy: args.policy,
                    source: args.source,
                    ..ResultFilter::default()
                },
                since: now.saturating_sub(i64::try_from(args.since.as_secs()).unwrap_or(i64::MAX)),
            },
        }
    }
}

impl DatabaseLocation {
    /// `serve`'s database; the embedded SQLite file must exist (reading never creates one).
    pub fn url(&self) -> anyhow::Result<String> {
        if let Some(url) = database_url::named(self.database_url.as_deref(), |name| {
            std::env::var(name).ok()
        }) {
            return Ok(url);
        }
        let dir = PathBuf::from(&self.data_dir);
        let file = dir.join("reports.db");
        if !file.exists() {
            bail!(
                "no database at {}: start `reports-server serve` (which creates it), or pass \
                 --data-dir or --database-url",
                file.display()
            );
        }
        Ok(database_url::embedded_sqlite(&dir))
    }
}

/// The views and tables a named question reads: an error naming one means the schema is
/// older.
const VIEWS: [&str; 6] = [
    "namespace_compliance",
    "policy_compliance",
    "cluster_compliance",
    "report_results",
    "compliance_snapshots",
    "compliance_history",
];

pub async fn run(args: QueryArgs) -> anyhow::Result<()> {
    let connection = args.connection;
    let output = match connection.output {
        OutputArg::Table => Output::Table,
        OutputArg::Json => Output::Json,
        OutputArg::Csv => Output::Csv,
        OutputArg::Yaml => Output::Yaml,
    };
    let timeout = Duration::from_secs(connection.db_connect_timeout_seconds);
    let url = connection.location.url()?;
    let db = analytics::connect_read_only(&url, timeout).await?;
    let table = match (args.question, args.sql) {
        (Some(question), None) => {
            let question = question.question(connection.cluster_id.clone(), now_unix());
            analytics::run_question(&db, &question)
                .await
                .map_err(older_schema_hint)?
        }
        (None, Some(sql)) => analytics::run_sql(&db, &sql).await?,
        (Some(_), Some(_)) => {
            bail!("name a question or pass --sql, not both (is REPORTS_SERVER_QUERY_SQL set?)")
        }
        (None, None) => bail!(
            "name a question (failing, compliance, top-failing, properties, trend) or pass --sql; \
             see `reports-server query --help`"
        ),
    };
    if table.rows.is_empty() && matches!(output, Output::Table) {
        // As kubectl says "No resources found": an empty table would print nothing at all.
        eprintln!("no rows");
    }
    print!("{}", table.render(output)?);
    Ok(())
}

fn older_schema_hint(error: AnalyticsError) -> anyhow::Error {
    let older =
        std::iter::successors(Some(&error as &dyn std::error::Error), |e| e.source()).any(|e| {
            let text = e.to_string();
            // Only "missing", in each backend's words: a SELECT-only role without rights on a
            // view also names it ("permission denied for view …"), and migrating is no fix.
            let missing = ["does not exist", "no such table", "doesn't exist"]
                .iter()
                .any(|m| text.contains(m));
            missing && VIEWS.iter().any(|view| text.contains(view))
        });
    let error = anyhow::Error::new(error);
    if older {
        error.context(
            "the database lacks the analytics views of this release: run \
             `reports-server migrate` (or start this release's `serve`) first",
        )
    } else {
        error
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::{Cli, Command};

    fn parse(line: &str) -> Result<QueryArgs, String> {
        let words = shell_words(line);
        match Cli::try_parse_from(words)
            .map_err(|e| e.to_string())?
            .command
        {
            Command::Query(args) => Ok(*args),
            _ => Err("not a query".into()),
        }
    }

    /// Splits on spaces outside single quotes (enough for these command lines).
    fn shell_words(line: &str) -> Vec<String> {
        let mut words = vec![String::new()];
        let mut quoted = false;
        for c in line.chars() {
            match c {
                '\'' => quoted = !quoted,
                ' ' if !quoted => words.push(String::new()),
                c => words.last_mut().unwrap().push(c),
            }
        }
        words
    }

    #[test]
    fn filters_and_shared_flags_reach_the_question_wherever_they_are_written() {
        let args = parse(
            "reports-server query -o csv failing --policy p --namespace '' --severity high \
             --kind Pod --limit 5 --cluster-id east",
        )
        .unwrap();
        assert!(matches!(args.connection.output, OutputArg::Csv));
        let question = args
            .question
            .unwrap()
            .question(args.connection.cluster_id, 0);
        assert_eq!(
            question,
            Question::Failing {
                filter: ResultFilter {
                    cluster_id: "east".into(),
                    policy: Some("p".into()),
                    namespace: Some(String::new()),
                    severity: Some("high".into()),
                    kind: Some("Pod".into()),
                    ..ResultFilter::default()
                },
                limit: 5,
            }
        );
    }

    #[test]
    fn each_question_has_its_defaults() {
        let args = parse("reports-server query top-failing").unwrap();
        assert!(matches!(
            args.question.unwrap().question("default".into(), 0),
            Question::TopFailing { limit: 10, .. }
        ));
        let args = parse("reports-server query failing").unwrap();
        assert!(matches!(
            args.question.unwrap().question("default".into(), 0),
            Question::Failing { limit: 100, .. }
        ));
        let args = parse("reports-server query compliance").unwrap();
        assert!(matches!(
            args.question.unwrap().question("default".into(), 0),
            Question::Compliance {
                by: Grouping::Namespace,
                ..
            }
        ));
        let args = parse("reports-server query --sql 'SELECT 1'").unwrap();
        assert!(args.question.is_none());
        assert_eq!(args.sql.as_deref(), Some("SELECT 1"));
    }

    #[test]
    fn trend_reads_the_stretch_back_from_now() {
        let args = parse("reports-server query trend --since 7d --by policy --policy p").unwrap();
        let question = args.question.unwrap().question("east".into(), 1_000_000);
        assert_eq!(
            question,
            Question::Trend {
                by: Some(Grouping::Policy),
                filter: ResultFilter {
                    cluster_id: "east".into(),
                    policy: Some("p".into()),
                    ..ResultFilter::default()
                },
                since: 1_000_000 - 7 * 86_400,
            }
        );
        let args = parse("reports-server query trend").unwrap();
        assert!(matches!(
            args.question.unwrap().question("default".into(), 40 * 86_400),
            Question::Trend { by: None, since, .. } if since == 10 * 86_400
        ));
    }

    #[test]
    fn property_conditions_are_required_and_checked_while_parsing() {
        let args =
            parse("reports-server query properties --where 'score>=8.0' --where a.b=c").unwrap();
        let Question::Properties { conditions, .. } =
            args.question.unwrap().question("default".into(), 0)
        else {
            panic!("not a properties question");
        };
        assert_eq!(conditions.len(), 2);
        let missing = parse("reports-server query properties").err().unwrap();
        assert!(missing.contains("--where"), "{missing}");
        let invalid = parse("reports-server query properties --where 'score'")
            .err()
            .unwrap();
        assert!(invalid.contains("no operator"), "{invalid}");
    }
}
