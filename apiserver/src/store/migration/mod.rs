//! Versioned schema migrations (sea-orm-migration).
//!
//! Migrations run at start-up (`reports-server serve`) and from `reports-server migrate`. They are
//! idempotent (`IF NOT EXISTS`) and sea-orm-migration records applied versions in
//! `seaql_migrations`, so several replicas starting at once converge; on PostgreSQL the runner
//! additionally takes an advisory lock (see `Store::migrate`).

use sea_orm_migration::prelude::*;

pub(crate) mod m20261121_000001_initial;
pub(crate) mod m20261122_000002_aggregator_lease;
pub(crate) mod m20261123_000003_nonzero_resource_version;
pub(crate) mod m20261124_000004_one_body_copy;
pub(crate) mod m20261125_000005_lean_results;
pub(crate) mod m20261125_000006_lz4_bodies;
pub(crate) mod m20261125_000007_sqlite_lz4_bodies;
pub(crate) mod m20261127_000008_mysql_binary_collation;
pub(crate) mod m20261128_000009_analytics_views;
pub(crate) mod m20261128_000010_cluster_identity;
pub(crate) mod m20261128_000011_compliance_history;
pub(crate) mod m20261129_000012_report_result_timestamp;

pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20261121_000001_initial::Migration),
            Box::new(m20261122_000002_aggregator_lease::Migration),
            Box::new(m20261123_000003_nonzero_resource_version::Migration),
            Box::new(m20261124_000004_one_body_copy::Migration),
            Box::new(m20261125_000005_lean_results::Migration),
            Box::new(m20261125_000006_lz4_bodies::Migration),
            Box::new(m20261125_000007_sqlite_lz4_bodies::Migration),
            Box::new(m20261127_000008_mysql_binary_collation::Migration),
            Box::new(m20261128_000009_analytics_views::Migration),
            Box::new(m20261128_000010_cluster_identity::Migration),
            Box::new(m20261128_000011_compliance_history::Migration),
            Box::new(m20261129_000012_report_result_timestamp::Migration),
        ]
    }
}

/// Runs one statement of SQL text (views and data copies, which sea-query does not build).
pub(super) async fn execute(manager: &SchemaManager<'_>, sql: &str) -> Result<(), DbErr> {
    manager.get_connection().execute_unprepared(sql).await?;
    Ok(())
}

/// Whether `table` has `column`: what a migration that adds one checks first, since a replica
/// may have run part of it on MySQL, whose DDL is not transactional.
pub(super) async fn has_column(
    manager: &SchemaManager<'_>,
    table: &impl Iden,
    column: &impl Iden,
) -> Result<bool, DbErr> {
    manager
        .has_column(table.to_string(), column.to_string())
        .await
}

/// Adds `column` to `table` unless it is there ([`has_column`]).
pub(super) async fn add_column_unless_present(
    manager: &SchemaManager<'_>,
    table: impl Iden + 'static,
    mut column: ColumnDef,
) -> Result<(), DbErr> {
    if has_column(manager, &table, &Alias::new(column.get_column_name())).await? {
        return Ok(());
    }
    manager
        .alter_table(
            Table::alter()
                .table(table)
                .add_column(&mut column)
                .to_owned(),
        )
        .await
}

/// Drops `column` of `table` if it is there ([`has_column`]).
pub(super) async fn drop_column_if_present(
    manager: &SchemaManager<'_>,
    table: impl Iden + 'static,
    column: impl Iden + 'static,
) -> Result<(), DbErr> {
    if !has_column(manager, &table, &column).await? {
        return Ok(());
    }
    manager
        .alter_table(Table::alter().table(table).drop_column(column).to_owned())
        .await
}
