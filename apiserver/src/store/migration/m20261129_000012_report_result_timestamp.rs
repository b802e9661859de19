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

use super::m20261125_000005_lean_results::{ROW_TIMESTAMP, report_results_view};
use super::{add_column_unless_present, drop_column_if_present, execute, has_column};
use crate::store::schema::{Objects, Results};

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261129_000012_report_result_timestamp"
    }
}

/// Each row's time in `report_results`: its own, or its report's.
const ROW_OR_REPORT_TIMESTAMP: &str =
    "CASE WHEN r.own_timestamp THEN r.timestamp ELSE o.results_timestamp END";

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

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let mut report_time = ColumnDef::new(Objects::ResultsTimestamp);
        report_time.big_integer().null();
        add_column_unless_present(manager, Objects::Table, report_time).await?;
        let mut own = ColumnDef::new(Results::OwnTimestamp);
        own.boolean().not_null().default(true);
        add_column_unless_present(manager, Results::Table, own).await?;
        replace_view(manager, &report_results_view(ROW_OR_REPORT_TIMESTAMP)).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if has_column(manager, &Results::Table, &Results::OwnTimestamp).await? {
            // Every row its own time: the view gives the same rows either way from here.
            execute(
                manager,
                "UPDATE results SET timestamp = (SELECT o.results_timestamp FROM objects o \
                 WHERE o.id = results.object_id), own_timestamp = TRUE WHERE NOT own_timestamp",
            )
            .await?;
        }
        // Neither PostgreSQL nor SQLite drops a column that a view reads.
        replace_view(manager, &report_results_view(ROW_TIMESTAMP)).await?;
        drop_column_if_present(manager, Results::Table, Results::OwnTimestamp).await?;
        drop_column_if_present(manager, Objects::Table, Objects::ResultsTimestamp).await
    }
}
