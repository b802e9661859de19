//! The named questions and the SQL each becomes for a backend. No I/O: every filter value is a
//! bound parameter, and the text holds only our own SQL (plus, for property columns, a key that
//! [`Condition`] limited to `[A-Za-z0-9_.-]`).

use sea_orm::{DbBackend, Value};

use crate::condition::{Comparison, Condition};

/// The `cluster_id` that asks about every cluster of the database (`--cluster-id all`): each
/// row then names its cluster. `serve` refuses it as a cluster's own id.
pub const ALL_CLUSTERS: &str = "all";

/// Narrows the results a question looks at; every `None` matches everything.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResultFilter {
    /// `--cluster-id`: the partition several clusters sharing a database write under, or
    /// [`ALL_CLUSTERS`].
    pub cluster_id: String,
    pub policy: Option<String>,
    /// The report's namespace (`""` for cluster-scoped reports).
    pub namespace: Option<String>,
    pub severity: Option<String>,
    pub category: Option<String>,
    pub source: Option<String>,
    /// The subject's kind, e.g. `Pod`.
    pub kind: Option<String>,
}

impl ResultFilter {
    /// Whether the question is about every cluster of the database.
    pub fn every_cluster(&self) -> bool {
        self.cluster_id == ALL_CLUSTERS
    }

    /// `"cluster_id, "` before a question's columns when rows come from several clusters.
    fn cluster_column(&self) -> &'static str {
        if self.every_cluster() {
            "cluster_id, "
        } else {
            ""
        }
    }
}

/// Which compliance view a compliance question reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grouping {
    Namespace,
    Policy,
    Cluster,
}

/// A question a platform team asks of its reports.
#[derive(Clone, Debug, PartialEq)]
pub enum Question {
    /// Every failing result, with its subject and message.
    Failing { filter: ResultFilter, limit: u32 },
    /// pass/fail/warn/error/skip and the ratio, per namespace, policy or cluster. `Cluster`
    /// lists every cluster of the database; the others stay in `filter.cluster_id` and honour
    /// `namespace` (per namespace), `policy` and `source` (per policy).
    Compliance { by: Grouping, filter: ResultFilter },
    /// The resources with the most failing results.
    TopFailing { filter: ResultFilter, limit: u32 },
    /// Results whose properties satisfy every condition (any outcome), with those properties.
    Properties {
        filter: ResultFilter,
        conditions: Vec<Condition>,
        limit: u32,
    },
    /// The compliance history (`compliance_snapshots`, `compliance_history`): one row per
    /// snapshot taken at or after `since` (Unix seconds), with the cluster's totals (`by`
    /// `None`, snapshots without any result included), per namespace or policy, or per
    /// cluster of the database. Honours `namespace`, `policy` and `source` of the filter.
    Trend {
        by: Option<Grouping>,
        filter: ResultFilter,
        since: i64,
    },
}

/// A statement and its bound values, ready for `Statement::from_sql_and_values`.
#[derive(Clone, Debug, PartialEq)]
pub struct Query {
    pub backend: DbBackend,
    pub sql: String,
    pub values: Vec<Value>,
}

/// Collects bound values and spells each placeholder the backend's way.
struct Binder {
    backend: DbBackend,
    values: Vec<Value>,
}

impl Binder {
    fn bind(&mut self, value: impl Into<Value>) -> String {
        self.values.push(value.into());
        match self.backend {
            DbBackend::Postgres => format!("${}", self.values.len()),
            _ => "?".to_owned(),
        }
    }

    /// `cluster_id = <value>` unless the question is about every cluster (then a term that
    /// always holds, so a `WHERE` always has one).
    fn cluster(&mut self, filter: &ResultFilter, column: &str) -> String {
        if filter.every_cluster() {
            "1 = 1".to_owned()
        } else {
            format!("{column} = {}", self.bind(filter.cluster_id.clone()))
        }
    }

    /// `column = <value>` for each filter that is set, and the cluster.
    fn filter(&mut self, filter: &ResultFilter) -> Vec<String> {
        let mut terms = vec![self.cluster(filter, "cluster_id")];
        for (column, value) in [
            ("policy", &filter.policy),
            ("namespace", &filter.namespace),
            ("severity", &filter.severity),
            ("category", &filter.category),
            ("source", &filter.source),
            ("subject_kind", &filter.kind),
        ] {
            if let Some(value) = value {
                terms.push(format!("{column} = {}", self.bind(value.clone())));
            }
        }
        terms
    }

    /// The text of property `key` of the row's `properties`, NULL when absent.
    fn property(&mut self, key: &str) -> String {
        let path = format!("$.\"{key}\"");
        match self.backend {
            DbBackend::Postgres => format!("(CAST(properties AS jsonb) ->> {})", self.bind(key)),
            DbBackend::MySql => format!(
                "JSON_UNQUOTE(JSON_EXTRACT(properties, {}))",
                self.bind(path)
            ),
            _ => format!("json_extract(properties, {})", self.bind(path)),
        }
    }

    /// Property `key` as a number, NULL when it is not one: PostgreSQL's cast of a non-number
    /// fails the whole query, and SQLite's and MySQL's read one as 0.
    fn numeric_property(&mut self, key: &str) -> String {
        let text = self.property(key);
        let pattern = "'^-?[0-9]+([.][0-9]+)?$'";
        match self.backend {
            DbBackend::Postgres => format!(
                "CASE WHEN {text} ~ {pattern} THEN CAST({} AS DOUBLE PRECISION) END",
                self.property(key)
            ),
            DbBackend::MySql => format!(
                "CASE WHEN {text} REGEXP {pattern} THEN CAST({} AS DOUBLE) END",
                self.property(key)
            ),
            _ => {
                let again = self.property(key);
                format!(
                    "CASE WHEN {text} GLOB '*[0-9]*' AND {again} NOT GLOB '*[^0-9.-]*' \
                     THEN CAST({} AS REAL) END",
                    self.property(key)
                )
            }
        }
    }

    fn condition(&mut self, condition: &Condition) -> String {
        match &condition.comparison {
            Comparison::Equals(value) => {
                format!(
                    "{} = {}",
                    self.property(&condition.key),
                    self.bind(value.clone())
                )
            }
            Comparison::Differs(value) => {
                format!(
                    "{} <> {}",
                    self.property(&condition.key),
                    self.bind(value.clone())
                )
            }
            Comparison::Numeric(order, value) => format!(
                "{} {} {}",
                self.numeric_property(&condition.key),
                order.sql(),
                self.bind(*value)
            ),
        }
    }

    fn quoted(&self, alias: &str) -> String {
        match self.backend {
            DbBackend::MySql => format!("`{alias}`"),
            _ => format!("\"{alias}\""),
        }
    }
}

/// The columns of a compliance view after its grouping columns.
const COUNTERS: &str = "pass, fail, warn, error, skip, total, ratio";

impl Question {
    /// The statement that answers this question on `backend`.
    pub fn to_query(&self, backend: DbBackend) -> Query {
        let mut binder = Binder {
            backend,
            values: Vec::new(),
        };
        let sql = match self {
            Question::Failing { filter, limit } => {
                let mut terms = binder.filter(filter);
                terms.push("result = 'fail'".into());
                format!(
                    "SELECT {cluster}namespace, subject_kind, subject_name, source, policy, \
                     rule, severity, category, message FROM report_results WHERE {} \
                     ORDER BY {cluster}namespace, subject_kind, subject_name, policy, rule \
                     LIMIT {}",
                    terms.join(" AND "),
                    binder.bind(i64::from(*limit)),
                    cluster = filter.cluster_column(),
                )
            }
            Question::Compliance { by, filter } => compliance(&mut binder, *by, filter),
            Question::TopFailing { filter, limit } => {
                let mut terms = binder.filter(filter);
                terms.push("result = 'fail'".into());
                format!(
                    "SELECT {cluster}subject_kind, subject_namespace, subject_name, \
                     COUNT(*) AS failures, COUNT(DISTINCT policy) AS policies \
                     FROM report_results WHERE {} \
                     GROUP BY {cluster}subject_kind, subject_namespace, subject_name \
                     ORDER BY failures DESC, {cluster}subject_namespace, subject_name, \
                     subject_kind LIMIT {}",
                    terms.join(" AND "),
                    binder.bind(i64::from(*limit)),
                    cluster = filter.cluster_column(),
                )
            }
            Question::Properties {
                filter,
                conditions,
                limit,
            } => properties(&mut binder, filter, conditions, *limit),
            Question::Trend { by, filter, since } => trend(&mut binder, *by, filter, *since),
        };
        Query {
            backend,
            sql,
            values: binder.values,
        }
    }
}

fn compliance(binder: &mut Binder, by: Grouping, filter: &ResultFilter) -> String {
    let (view, columns, narrowing) = match by {
        Grouping::Namespace => (
            "namespace_compliance",
            "namespace",
            vec![("namespace", &filter.namespace)],
        ),
        Grouping::Policy => (
            "policy_compliance",
            "source, policy",
            vec![("policy", &filter.policy), ("source", &filter.source)],
        ),
        Grouping::Cluster => {
            return format!(
                "SELECT cluster_id, {COUNTERS} FROM cluster_compliance ORDER BY cluster_id"
            );
        }
    };
    let mut terms = vec![binder.cluster(filter, "cluster_id")];
    for (column, value) in narrowing {
        if let Some(value) = value {
            terms.push(format!("{column} = {}", binder.bind(value.clone())));
        }
    }
    let columns = format!("{}{columns}", filter.cluster_column());
    format!(
        "SELECT {columns}, {COUNTERS} FROM {view} WHERE {} ORDER BY {columns}",
        terms.join(" AND ")
    )
}

/// `column` (Unix seconds) as RFC 3339 text in UTC, whatever the session's time zone.
fn rfc3339(backend: DbBackend, column: &str) -> String {
    match backend {
        DbBackend::Postgres => format!(
            "to_char(to_timestamp({column}) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"
        ),
        // FROM_UNIXTIME would read the session's time zone.
        DbBackend::MySql => format!(
            "DATE_FORMAT(DATE_ADD('1970-01-01 00:00:00', INTERVAL {column} SECOND), \
             '%Y-%m-%dT%H:%i:%sZ')"
        ),
        _ => format!("strftime('%Y-%m-%dT%H:%M:%SZ', {column}, 'unixepoch')"),
    }
}

/// The counters of a trend row: sums of the history's counts (0 for a snapshot without rows),
/// as 64-bit integers (`SUM` of a BIGINT is a NUMERIC on PostgreSQL, a DECIMAL on MySQL).
fn trend_counters(backend: DbBackend) -> String {
    let (integer, double) = match backend {
        DbBackend::Postgres => ("BIGINT", "DOUBLE PRECISION"),
        DbBackend::MySql => ("SIGNED", "DOUBLE"),
        _ => ("INTEGER", "REAL"),
    };
    let sum = |column: &str| format!("CAST(COALESCE(SUM(h.{column}), 0) AS {integer})");
    let counted = "COALESCE(SUM(h.pass + h.fail + h.warn + h.error), 0)";
    format!(
        "{pass} AS pass, {fail} AS fail, {warn} AS warn, {error} AS error, {skip} AS skip, \
         CAST(COALESCE(SUM(h.pass + h.fail + h.warn + h.error + h.skip), 0) AS {integer}) \
         AS total, CAST(SUM(h.pass) AS {double}) / NULLIF({counted}, 0) AS ratio",
        pass = sum("pass"),
        fail = sum("fail"),
        warn = sum("warn"),
        error = sum("error"),
        skip = sum("skip"),
    )
}

fn trend(binder: &mut Binder, by: Option<Grouping>, filter: &ResultFilter, since: i64) -> String {
    let backend = binder.backend;
    let (columns, join) = match by {
        // Totals: every snapshot, with or without rows.
        None | Some(Grouping::Cluster) => ("", "LEFT JOIN"),
        Some(Grouping::Namespace) => ("h.namespace, ", "JOIN"),
        Some(Grouping::Policy) => ("h.source, h.policy, ", "JOIN"),
    };
    // Narrowing in the join keeps the totals' empty snapshots.
    let mut on = vec![
        "h.cluster_id = s.cluster_id".to_owned(),
        "h.taken_at = s.taken_at".to_owned(),
    ];
    for (column, value) in [
        ("namespace", &filter.namespace),
        ("policy", &filter.policy),
        ("source", &filter.source),
    ] {
        if let Some(value) = value {
            on.push(format!("h.{column} = {}", binder.bind(value.clone())));
        }
    }
    let mut terms = vec![format!("s.taken_at >= {}", binder.bind(since))];
    let cluster = if by == Some(Grouping::Cluster) || filter.every_cluster() {
        "s.cluster_id, "
    } else {
        terms.push(binder.cluster(filter, "s.cluster_id"));
        ""
    };
    let grouped = format!("{cluster}s.taken_at, {columns}");
    let grouped = grouped.trim_end_matches(", ");
    format!(
        "SELECT {cluster}{} AS taken_at, {columns}{} \
         FROM compliance_snapshots s {join} compliance_history h ON {} \
         WHERE {} GROUP BY {grouped} ORDER BY {grouped}",
        rfc3339(backend, "s.taken_at"),
        trend_counters(backend),
        on.join(" AND "),
        terms.join(" AND "),
    )
}

fn properties(
    binder: &mut Binder,
    filter: &ResultFilter,
    conditions: &[Condition],
    limit: u32,
) -> String {
    // One column per distinct key a condition names, in the order given.
    let mut keys: Vec<&str> = Vec::new();
    for condition in conditions {
        if !keys.contains(&condition.key.as_str()) {
            keys.push(&condition.key);
        }
    }
    // A property named like a fixed column would make its alias ambiguous (PostgreSQL refuses
    // the ORDER BY, JSON output gets the key twice): it is shown as `property.<key>`.
    let alias = |key: &str| {
        if PROPERTY_ROW_COLUMNS
            .iter()
            .chain(&["cluster_id"])
            .any(|c| c.eq_ignore_ascii_case(key))
        {
            format!("property.{key}")
        } else {
            key.to_owned()
        }
    };
    let shown: Vec<String> = keys
        .iter()
        .map(|key| format!("{} AS {}", binder.property(key), binder.quoted(&alias(key))))
        .collect();
    let mut terms = binder.filter(filter);
    terms.extend(conditions.iter().map(|c| binder.condition(c)));
    let shown = shown
        .iter()
        .map(|column| format!(", {column}"))
        .collect::<String>();
    format!(
        "SELECT {cluster}{}{shown} FROM report_results WHERE {} \
         ORDER BY {cluster}namespace, subject_kind, subject_name, policy, rule LIMIT {}",
        PROPERTY_ROW_COLUMNS.join(", "),
        terms.join(" AND "),
        binder.bind(i64::from(limit)),
        cluster = filter.cluster_column(),
    )
}

/// The columns `properties` shows before the properties a condition names.
const PROPERTY_ROW_COLUMNS: [&str; 8] = [
    "namespace",
    "subject_kind",
    "subject_name",
    "source",
    "policy",
    "rule",
    "result",
    "severity",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_property_named_like_a_column_gets_its_own_alias() {
        let question = Question::Properties {
            filter: filter(),
            conditions: vec![
                "namespace=prod".parse().unwrap(),
                "score>=8".parse().unwrap(),
            ],
            limit: 10,
        };
        let sql = question.to_query(DbBackend::Postgres).sql;
        assert!(sql.contains("AS \"property.namespace\""), "{sql}");
        assert!(sql.contains("AS \"score\""), "{sql}");
    }

    fn filter() -> ResultFilter {
        ResultFilter {
            cluster_id: "default".into(),
            policy: Some("disallow-privileged-containers".into()),
            severity: Some("high".into()),
            ..ResultFilter::default()
        }
    }

    #[test]
    fn filters_are_bound_in_each_backends_placeholders() {
        let question = Question::Failing {
            filter: filter(),
            limit: 50,
        };
        let postgres = question.to_query(DbBackend::Postgres);
        assert!(
            postgres.sql.contains(
                "WHERE cluster_id = $1 AND policy = $2 AND severity = $3 AND result = 'fail'"
            ),
            "{}",
            postgres.sql
        );
        assert!(postgres.sql.ends_with("LIMIT $4"), "{}", postgres.sql);
        let values: Vec<Value> = vec![
            "default".into(),
            "disallow-privileged-containers".into(),
            "high".into(),
            50i64.into(),
        ];
        assert_eq!(postgres.values, values);
        let mysql = question.to_query(DbBackend::MySql);
        assert!(
            mysql
                .sql
                .contains("cluster_id = ? AND policy = ? AND severity = ?")
        );
        assert_eq!(mysql.values, values);
    }

    #[test]
    fn property_conditions_never_carry_their_text_into_sql() {
        let conditions = vec![
            "score>=8.0".parse::<Condition>().unwrap(),
            "vulnerabilityID=CVE-2024-0001"
                .parse::<Condition>()
                .unwrap(),
        ];
        let question = Question::Properties {
            filter: ResultFilter {
                cluster_id: "c".into(),
                ..ResultFilter::default()
            },
            conditions,
            limit: 10,
        };
        for backend in [DbBackend::Sqlite, DbBackend::Postgres, DbBackend::MySql] {
            let query = question.to_query(backend);
            assert!(!query.sql.contains("CVE-2024-0001"), "{}", query.sql);
            assert!(!query.sql.contains("8.0"), "{}", query.sql);
            assert!(query.values.contains(&Value::from(8.0f64)), "{backend:?}");
            assert!(query.values.contains(&Value::from("CVE-2024-0001")));
            // The keys are columns of the answer, quoted.
            let quote = if backend == DbBackend::MySql {
                '`'
            } else {
                '"'
            };
            assert!(
                query.sql.contains(&format!("AS {quote}score{quote}")),
                "{}",
                query.sql
            );
        }
        let postgres = question.to_query(DbBackend::Postgres);
        assert!(postgres.values.contains(&Value::from("score")));
        let sqlite = question.to_query(DbBackend::Sqlite);
        assert!(sqlite.values.contains(&Value::from("$.\"score\"")));
    }

    #[test]
    fn every_cluster_drops_the_cluster_term_and_names_each_rows_cluster() {
        let all = ResultFilter {
            cluster_id: ALL_CLUSTERS.into(),
            policy: Some("p".into()),
            ..ResultFilter::default()
        };
        let failing = Question::Failing {
            filter: all.clone(),
            limit: 5,
        }
        .to_query(DbBackend::Postgres);
        assert!(
            failing.sql.starts_with("SELECT cluster_id, namespace,"),
            "{}",
            failing.sql
        );
        assert!(
            failing.sql.contains("WHERE 1 = 1 AND policy = $1"),
            "{}",
            failing.sql
        );
        assert_eq!(failing.values, vec![Value::from("p"), Value::from(5i64)]);
        let by_namespace = Question::Compliance {
            by: Grouping::Namespace,
            filter: all.clone(),
        }
        .to_query(DbBackend::Sqlite);
        assert!(
            by_namespace
                .sql
                .starts_with("SELECT cluster_id, namespace, pass"),
            "{}",
            by_namespace.sql
        );
        let trend = Question::Trend {
            by: Some(Grouping::Namespace),
            filter: all,
            since: 0,
        }
        .to_query(DbBackend::MySql);
        assert!(
            trend
                .sql
                .contains("GROUP BY s.cluster_id, s.taken_at, h.namespace"),
            "{}",
            trend.sql
        );
    }

    #[test]
    fn compliance_reads_its_view_and_narrows_only_by_its_columns() {
        let question = |by| Question::Compliance {
            by,
            filter: ResultFilter {
                cluster_id: "default".into(),
                namespace: Some("team-a".into()),
                policy: Some("p".into()),
                ..ResultFilter::default()
            },
        };
        let by_namespace = question(Grouping::Namespace).to_query(DbBackend::Sqlite);
        assert_eq!(
            by_namespace.sql,
            "SELECT namespace, pass, fail, warn, error, skip, total, ratio \
             FROM namespace_compliance WHERE cluster_id = ? AND namespace = ? ORDER BY namespace"
        );
        let by_policy = question(Grouping::Policy).to_query(DbBackend::Postgres);
        assert!(by_policy.sql.contains("FROM policy_compliance WHERE cluster_id = $1 AND policy = $2 ORDER BY source, policy"), "{}", by_policy.sql);
        let by_cluster = question(Grouping::Cluster).to_query(DbBackend::MySql);
        assert!(
            by_cluster.values.is_empty(),
            "every cluster of the database"
        );
    }
}
