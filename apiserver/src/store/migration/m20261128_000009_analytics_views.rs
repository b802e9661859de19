//! Stable analytics views next to `report_results` (docs/analytics.md): compliance per
//! namespace, per policy and per cluster, the latest result per resource and rule, and one row
//! per result property, so that the questions a platform team asks are a `SELECT` on every
//! backend, and `reports-server query` has a documented interface to read.
//!
//! The views only read `report_results`; they hold no data, so `up` and `down` are cheap and
//! `down` drops them (the downgrade in docs/sql-schema.md). Their text is frozen here: a later
//! change of a view is a new migration, as for tables. A later migration that replaces
//! `report_results` drops these views first (PostgreSQL refuses to drop a view that others
//! read) and creates them again after.

use sea_orm::DbBackend;
use sea_orm_migration::prelude::*;

use super::execute;

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261128_000009_analytics_views"
    }
}

/// Every view this migration creates, in the order `down` drops them.
const VIEWS: [&str; 5] = [
    "namespace_compliance",
    "policy_compliance",
    "cluster_compliance",
    "latest_results",
    "result_properties",
];

/// The counters of a compliance view and its ratio: passing results among those that passed,
/// failed, warned or errored (a skipped rule says nothing about compliance); NULL without any.
/// `COUNT(CASE …)` is a 64-bit integer on every backend (`SUM` would be a DECIMAL on MySQL).
fn counters(backend: DbBackend) -> String {
    let double = match backend {
        DbBackend::Postgres => "DOUBLE PRECISION",
        DbBackend::MySql => "DOUBLE",
        _ => "REAL",
    };
    let count = |outcome: &str| format!("COUNT(CASE WHEN result = '{outcome}' THEN 1 END)");
    format!(
        "{pass} AS pass, {fail} AS fail, {warn} AS warn, {error} AS error, {skip} AS skip, \
         COUNT(*) AS total, \
         CAST({pass} AS {double}) / NULLIF({pass} + {fail} + {warn} + {error}, 0) AS ratio",
        pass = count("pass"),
        fail = count("fail"),
        warn = count("warn"),
        error = count("error"),
        skip = count("skip"),
    )
}

fn compliance_views(backend: DbBackend) -> [String; 3] {
    let counters = counters(backend);
    [
        format!(
            "CREATE VIEW namespace_compliance AS SELECT cluster_id, namespace, {counters} \
             FROM report_results GROUP BY cluster_id, namespace"
        ),
        format!(
            "CREATE VIEW policy_compliance AS SELECT cluster_id, source, policy, {counters} \
             FROM report_results GROUP BY cluster_id, source, policy"
        ),
        format!(
            "CREATE VIEW cluster_compliance AS SELECT cluster_id, {counters} \
             FROM report_results GROUP BY cluster_id"
        ),
    ]
}

/// The columns of `report_results` that `latest_results` and `result_properties` repeat.
const RESULT_COLUMNS: &str = "cluster_id, resource, namespace, report_name, source, policy, \
    rule, result, severity, category, scored, subject_api_version, subject_kind, \
    subject_namespace, subject_name, subject_uid, timestamp, message, properties";

/// One row per resource and rule: the result with the newest timestamp, whichever report holds
/// it (a resource scanned by two reports of one source, or reported twice during a rename). A
/// result about no resource (no scope, no `resources`, e.g. a per-node benchmark report) is its
/// report's own: `PARTITION BY` treats NULL subjects as equal and would keep one of them. A
/// result without a timestamp loses to one with: PostgreSQL sorts NULLs first in `DESC`, SQLite
/// and MySQL last, so the order says it.
fn latest_results_view() -> String {
    let unless_subject = |column: &str| format!("CASE WHEN subject_name IS NULL THEN {column} END");
    format!(
        "CREATE VIEW latest_results AS SELECT {RESULT_COLUMNS} FROM (\
         SELECT rr.*, ROW_NUMBER() OVER (PARTITION BY cluster_id, subject_kind, \
         subject_namespace, subject_name, {}, {}, {}, source, policy, rule \
         ORDER BY CASE WHEN timestamp IS NULL THEN 1 ELSE 0 END, timestamp DESC, \
         resource, namespace, report_name) AS newest \
         FROM report_results rr) ranked WHERE newest = 1",
        unless_subject("resource"),
        unless_subject("namespace"),
        unless_subject("report_name"),
    )
}

/// One row per result and property (`properties` is a JSON object of strings): each backend
/// unnests JSON its own way. PostgreSQL's `jsonb_each_text` fails the whole query on anything
/// but an object, hence its guard (MySQL's `JSON_KEYS` gives NULL, SQLite's `json_each` the
/// elements). MySQL has no function listing an object's members, so it lists the
/// keys and extracts each by a quoted path (a `"` or `\` inside a key is escaped for the path).
fn result_properties_view(backend: DbBackend) -> String {
    let identity = "rr.cluster_id, rr.resource, rr.namespace, rr.report_name, rr.source, \
        rr.policy, rr.rule, rr.result, rr.severity, rr.category, rr.subject_kind, \
        rr.subject_namespace, rr.subject_name, rr.subject_uid, rr.timestamp";
    match backend {
        DbBackend::Postgres => format!(
            "CREATE VIEW result_properties AS SELECT {identity}, p.key AS property, \
             p.value AS value FROM report_results rr \
             CROSS JOIN LATERAL jsonb_each_text(CASE \
             WHEN jsonb_typeof(CAST(rr.properties AS jsonb)) = 'object' \
             THEN CAST(rr.properties AS jsonb) END) p"
        ),
        DbBackend::MySql => format!(
            "CREATE VIEW result_properties AS SELECT {identity}, k.property AS property, \
             JSON_UNQUOTE(JSON_EXTRACT(rr.properties, CONCAT('$.\"', \
             REPLACE(REPLACE(k.property, {backslash}, CONCAT({backslash}, {backslash})), \
             '\"', CONCAT({backslash}, '\"')), '\"'))) AS value \
             FROM report_results rr \
             JOIN JSON_TABLE(JSON_KEYS(rr.properties), '$[*]' \
             COLUMNS (property VARCHAR(253) PATH '$')) k",
            // Not a `\\` literal: its meaning depends on the NO_BACKSLASH_ESCAPES mode.
            backslash = "CHAR(92 USING utf8mb4)"
        ),
        _ => format!(
            "CREATE VIEW result_properties AS SELECT {identity}, p.key AS property, \
             p.value AS value FROM report_results rr, json_each(rr.properties) p"
        ),
    }
}

async fn drop_views(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    for view in VIEWS {
        execute(manager, &format!("DROP VIEW IF EXISTS {view}")).await?;
    }
    Ok(())
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // A replica that ran part of this migration (MySQL's DDL is not transactional) left
        // some views behind: start from none.
        drop_views(manager).await?;
        let backend = manager.get_database_backend();
        for view in compliance_views(backend) {
            execute(manager, &view).await?;
        }
        execute(manager, &latest_results_view()).await?;
        execute(manager, &result_properties_view(backend)).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        drop_views(manager).await
    }
}
