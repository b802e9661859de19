//! The `leases` table: named leader leases kept in the database itself.
//!
//! The in-process aggregator must run in one replica at a time per database. A row in the
//! database everyone already shares works on every backend (SQLite, PostgreSQL, MySQL) and needs
//! neither a Kubernetes API nor session-bound advisory locks, which a connection pool would hand
//! to arbitrary connections. See `store::lease` for the protocol.

use sea_orm_migration::prelude::*;

pub use crate::store::schema::Leases;

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261122_000002_aggregator_lease"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Leases::Table)
                    .if_not_exists()
                    .col(
                        ColumnDef::new(Leases::Name)
                            .string_len(253)
                            .not_null()
                            .primary_key(),
                    )
                    .col(ColumnDef::new(Leases::Holder).string_len(253).not_null())
                    .col(ColumnDef::new(Leases::RenewedAt).big_integer().not_null())
                    .col(ColumnDef::new(Leases::ExpiresAt).big_integer().not_null())
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Leases::Table).if_exists().to_owned())
            .await
    }
}
