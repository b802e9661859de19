//! A report's results share one timestamp, held by the report.
//!
//! Kyverno stamps every result of a scan with the scan's time, so until this version a rescan
//! changed every `results` row of a report, and an update deleted and re-inserted all of
//! them even when one outcome changed (19 rows for a Pod Security Standards report: a fifth
//! of a PostgreSQL store's bytes were those rows' second generation). Now `objects` holds the
//! time more than half of a report's results carry (`results_timestamp`) and a row whose
//! result has that time leaves it to the report (`own_timestamp` false, `timestamp` NULL), so
//! a rescan leaves such rows equal and the update rewrites only the results that changed
//! (`store::result_diff`). `report_results` gives every row its time as before.
//!
//! `up` adds the two columns without touching a row: rows written before keep their own
//! timestamps (`own_timestamp` defaults to true), which the view reads as it did. The view is
//! replaced in place (SQLite has no `CREATE OR REPLACE VIEW`: there it is dropped and created),
//! so the views that read it, and any a user built on it, stay. `down` writes the report's
//! time back into the rows that left it to the report, restores the view, then drops the
//! columns (docs/sql-schema.md "Downgrading"); each step is guarded, so a `down` that stopped
//! halfway on MySQL, whose DDL is not transactional, runs again.
//!
//! During a rolling update, a replica of an earlier release writes rows without
//! `own_timestamp` (so with their own times: correct). It keeps a stored row that leaves its
//! time to the report when its new version has an equal row without any timestamp. On
//! PostgreSQL it re-inserts the `objects` row without a report time, which is then right; on
//! MySQL, whose updates keep the `objects` row, such a row shows the report's old time until
//! the next update by this release.

use sea_orm::DbBackend;
use sea_orm_migration::prelude::*;

use super::m20261125_000005_lean_results::REPORT_RESULTS_VIEW;
use super::{execute, has_column};
use crate::store::schema::{Objects, Results};

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261129_000012_report_result_timestamp"
    }
}

/// `report_results` with each row's time: its own, or its report's.
const VIEW: &str = "CREATE VIEW report_results AS \
    SELECT o.cluster_id, o.resource, o.namespace, o.name AS report_name, \
    p.source, p.policy, p.rule, r.result, p.severity, p.category, p.scored, \
    r.subject_api_version, \
    CASE WHEN r.own_subject THEN r.subject_kind ELSE o.scope_kind END AS subject_kind, \
    CASE WHEN r.own_subject THEN r.subject_namespace ELSE o.scope_namespace END AS subject_namespace, \
    CASE WHEN r.own_subject THEN r.subject_name ELSE o.scope_name END AS subject_name, \
    CASE WHEN r.own_subject THEN r.subject_uid ELSE o.scope_uid END AS subject_uid, \
    CASE WHEN r.own_timestamp THEN r.timestamp ELSE o.results_timestamp END AS timestamp, \
    r.message, r.properties \
    FROM results r \
    JOIN objects o ON o.id = r.object_id \
    JOIN policy_rules p ON p.id = r.rule_id";

/// Replaces `report_results` by the view `create` (a `CREATE VIEW report_results …` with the
/// same columns), keeping the views that read it.
async fn replace_view(manager: &SchemaManager<'_>, create: &str) -> Result<(), DbErr> {
    match manager.get_database_backend() {
        DbBackend::Sqlite => {
            execute(manager, "DROP VIEW IF EXISTS report_results").await?;
            execute(manager, create).await
        }
        _ => {
            let replace = create.replacen("CREATE VIEW", "CREATE OR REPLACE VIEW", 1);
            execute(manager, &replace).await
        }
    }
}

/// `ALTER TABLE table DROP COLUMN column`.
async fn drop_column(
    manager: &SchemaManager<'_>,
    table: impl IntoTableRef,
    column: impl IntoIden,
) -> Result<(), DbErr> {
    manager
        .alter_table(Table::alter().table(table).drop_column(column).to_owned())
        .await
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if !has_column(manager, Objects::Table, Objects::ResultsTimestamp).await? {
            manager
                .alter_table(
                    Table::alter()
                        .table(Objects::Table)
                        .add_column(
                            ColumnDef::new(Objects::ResultsTimestamp)
                                .big_integer()
                                .null(),
                        )
                        .to_owned(),
                )
                .await?;
        }
        if !has_column(manager, Results::Table, Results::OwnTimestamp).await? {
            manager
                .alter_table(
                    Table::alter()
                        .table(Results::Table)
                        .add_column(
                            ColumnDef::new(Results::OwnTimestamp)
                                .boolean()
                                .not_null()
                                .default(true),
                        )
                        .to_owned(),
                )
                .await?;
        }
        replace_view(manager, VIEW).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let own = has_column(manager, Results::Table, Results::OwnTimestamp).await?;
        if own {
            // Every row its own time: the view gives the same rows either way from here.
            execute(
                manager,
                "UPDATE results SET timestamp = (SELECT o.results_timestamp FROM objects o \
                 WHERE o.id = results.object_id), own_timestamp = TRUE WHERE NOT own_timestamp",
            )
            .await?;
        }
        // Neither PostgreSQL nor SQLite drops a column that a view reads.
        replace_view(manager, REPORT_RESULTS_VIEW).await?;
        if own {
            drop_column(manager, Results::Table, Results::OwnTimestamp).await?;
        }
        if has_column(manager, Objects::Table, Objects::ResultsTimestamp).await? {
            drop_column(manager, Objects::Table, Objects::ResultsTimestamp).await?;
        }
        Ok(())
    }
}
