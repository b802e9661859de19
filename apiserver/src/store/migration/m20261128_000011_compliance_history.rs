//! `compliance_snapshots` and `compliance_history`: the counts of results per namespace, source
//! and policy, kept at an interval so that "how did compliance change this month" is one query
//! (`reports-server query trend`, docs/analytics.md).
//!
//! The reports themselves keep only the present: a violation fixed yesterday leaves no row.
//! Snapshots are taken by one server per cluster (`crate::statistics`) and pruned after the
//! retention. A snapshot's own row exists even when the cluster had no result, so a trend
//! shows the empty days too, and its primary key keeps two servers that both believe they
//! lead (a paused process) from writing one snapshot twice.
//!
//! The history is data, not a cache: `down` drops it (the downgrade in docs/sql-schema.md
//! says so).

use sea_orm_migration::prelude::*;

use crate::store::schema::{ComplianceHistory, ComplianceSnapshots};

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261128_000011_compliance_history"
    }
}

fn text(column: impl IntoIden, len: u32) -> ColumnDef {
    let mut c = ColumnDef::new(column);
    c.string_len(len).not_null();
    c
}

fn count(column: impl IntoIden) -> ColumnDef {
    let mut c = ColumnDef::new(column);
    c.big_integer().not_null();
    c
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(ComplianceSnapshots::Table)
                    .if_not_exists()
                    .col(text(ComplianceSnapshots::ClusterId, 64))
                    .col(count(ComplianceSnapshots::TakenAt))
                    .primary_key(
                        Index::create()
                            .col(ComplianceSnapshots::ClusterId)
                            .col(ComplianceSnapshots::TakenAt),
                    )
                    .to_owned(),
            )
            .await?;
        // Key lengths as in `objects` and `policy_rules`; together within MySQL's 3,072-byte
        // limit for a key in utf8mb4.
        manager
            .create_table(
                Table::create()
                    .table(ComplianceHistory::Table)
                    .if_not_exists()
                    .col(text(ComplianceHistory::ClusterId, 64))
                    .col(count(ComplianceHistory::TakenAt))
                    .col(text(ComplianceHistory::Namespace, 63))
                    .col(text(ComplianceHistory::Source, 253))
                    .col(text(ComplianceHistory::Policy, 253))
                    .col(count(ComplianceHistory::Pass))
                    .col(count(ComplianceHistory::Fail))
                    .col(count(ComplianceHistory::Warn))
                    .col(count(ComplianceHistory::Error))
                    .col(count(ComplianceHistory::Skip))
                    .primary_key(
                        Index::create()
                            .col(ComplianceHistory::ClusterId)
                            .col(ComplianceHistory::TakenAt)
                            .col(ComplianceHistory::Namespace)
                            .col(ComplianceHistory::Source)
                            .col(ComplianceHistory::Policy),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            ComplianceHistory::Table.into_iden(),
            ComplianceSnapshots::Table.into_iden(),
        ] {
            manager
                .drop_table(Table::drop().table(table).if_exists().to_owned())
                .await?;
        }
        Ok(())
    }
}
