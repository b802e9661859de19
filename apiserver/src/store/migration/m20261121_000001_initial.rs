//! The initial schema: objects with indexed metadata, their labels, the change log, the
//! resourceVersion counter and one row per policy result for analytics.
//!
//! `docs/sql-schema.md` documents these tables and the `report_results` view as a supported
//! interface.

use sea_orm::DbBackend;
use sea_orm_migration::prelude::*;

use crate::store::schema::{Changes, ObjectLabels, Objects, StoreState};

/// The `results` table as this migration creates it; `m20261125_000005_lean_results` replaces
/// it with narrower rows.
#[derive(DeriveIden)]
pub(super) enum Results {
    Table,
    Id,
    ObjectId,
    ClusterId,
    Resource,
    Namespace,
    ReportName,
    Source,
    Policy,
    Rule,
    Result,
    Severity,
    Category,
    Scored,
    SubjectApiVersion,
    SubjectKind,
    SubjectNamespace,
    SubjectName,
    SubjectUid,
    Timestamp,
    Message,
    Properties,
}

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261121_000001_initial"
    }
}

/// A column for JSON documents of any size (MySQL's TEXT stops at 64 KiB).
fn document(backend: DbBackend, col: impl IntoIden) -> ColumnDef {
    let mut c = ColumnDef::new(col);
    match backend {
        DbBackend::MySql => c.custom(Alias::new("LONGTEXT")),
        _ => c.text(),
    };
    c.not_null();
    c
}

fn key_string(col: impl IntoIden, len: u32) -> ColumnDef {
    let mut c = ColumnDef::new(col);
    c.string_len(len).not_null();
    c
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        create_store_state(manager).await?;
        create_objects(manager).await?;
        create_object_labels(manager).await?;
        create_changes(manager).await?;
        create_wide_results(manager).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .get_connection()
            .execute_unprepared("DROP VIEW IF EXISTS report_results")
            .await?;
        for table in [
            Results::Table.into_iden(),
            Changes::Table.into_iden(),
            ObjectLabels::Table.into_iden(),
            Objects::Table.into_iden(),
            StoreState::Table.into_iden(),
        ] {
            manager
                .drop_table(Table::drop().table(table).if_exists().to_owned())
                .await?;
        }
        Ok(())
    }
}

// The statements below are this released migration's, in its order; only their grouping into
// functions is new, so what it creates cannot change.

/// The resourceVersion counter and compaction horizon, one row per cluster id.
async fn create_store_state(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    manager
        .create_table(
            Table::create()
                .table(StoreState::Table)
                .if_not_exists()
                .col(key_string(StoreState::ClusterId, 64).primary_key())
                .col(ColumnDef::new(StoreState::Rv).big_integer().not_null())
                .col(
                    ColumnDef::new(StoreState::CompactedRv)
                        .big_integer()
                        .not_null(),
                )
                .to_owned(),
        )
        .await?;
    Ok(())
}

/// Objects with their key, uid, scope and version indexes.
async fn create_objects(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    let backend = manager.get_database_backend();
    manager
        .create_table(
            Table::create()
                .table(Objects::Table)
                .if_not_exists()
                .col(
                    ColumnDef::new(Objects::Id)
                        .big_integer()
                        .not_null()
                        .auto_increment()
                        .primary_key(),
                )
                .col(key_string(Objects::ClusterId, 64))
                .col(key_string(Objects::Resource, 100))
                .col(key_string(Objects::Namespace, 63))
                .col(key_string(Objects::Name, 253))
                .col(key_string(Objects::Uid, 36))
                .col(
                    ColumnDef::new(Objects::ResourceVersion)
                        .big_integer()
                        .not_null(),
                )
                .col(ColumnDef::new(Objects::Generation).big_integer().not_null())
                .col(ColumnDef::new(Objects::CreatedAt).big_integer().not_null())
                .col(ColumnDef::new(Objects::DeletedAt).big_integer().null())
                .col(
                    ColumnDef::new(Objects::OwnerUids)
                        .string_len(1024)
                        .not_null(),
                )
                .col(
                    ColumnDef::new(Objects::SummaryPass)
                        .big_integer()
                        .not_null(),
                )
                .col(
                    ColumnDef::new(Objects::SummaryFail)
                        .big_integer()
                        .not_null(),
                )
                .col(
                    ColumnDef::new(Objects::SummaryWarn)
                        .big_integer()
                        .not_null(),
                )
                .col(
                    ColumnDef::new(Objects::SummaryError)
                        .big_integer()
                        .not_null(),
                )
                .col(
                    ColumnDef::new(Objects::SummarySkip)
                        .big_integer()
                        .not_null(),
                )
                .col(ColumnDef::new(Objects::ScopeKind).string_len(253).null())
                .col(
                    ColumnDef::new(Objects::ScopeNamespace)
                        .string_len(63)
                        .null(),
                )
                .col(ColumnDef::new(Objects::ScopeName).string_len(253).null())
                .col(ColumnDef::new(Objects::ScopeUid).string_len(64).null())
                .col(document(backend, Objects::Metadata))
                .col(document(backend, Objects::Body))
                .to_owned(),
        )
        .await?;
    for (name, cols) in [
        (
            "objects_key",
            vec![
                Objects::ClusterId,
                Objects::Resource,
                Objects::Namespace,
                Objects::Name,
            ],
        ),
        ("objects_uid", vec![Objects::Uid]),
        ("objects_scope_uid", vec![Objects::ScopeUid]),
        (
            "objects_rv",
            vec![Objects::ClusterId, Objects::ResourceVersion],
        ),
    ] {
        let mut index = Index::create();
        index.name(name).table(Objects::Table).if_not_exists();
        if name == "objects_key" {
            index.unique();
        }
        for c in cols {
            index.col(c);
        }
        manager.create_index(index.to_owned()).await?;
    }
    Ok(())
}

/// Label rows of objects, indexed for selectors.
async fn create_object_labels(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    manager
        .create_table(
            Table::create()
                .table(ObjectLabels::Table)
                .if_not_exists()
                .col(
                    ColumnDef::new(ObjectLabels::ObjectId)
                        .big_integer()
                        .not_null(),
                )
                .col(key_string(ObjectLabels::Key, 317))
                .col(key_string(ObjectLabels::Value, 63))
                .primary_key(
                    Index::create()
                        .col(ObjectLabels::ObjectId)
                        .col(ObjectLabels::Key),
                )
                .to_owned(),
        )
        .await?;
    manager
        .create_index(
            Index::create()
                .name("object_labels_key_value")
                .table(ObjectLabels::Table)
                .if_not_exists()
                .col(ObjectLabels::Key)
                .col(ObjectLabels::Value)
                .col(ObjectLabels::ObjectId)
                .to_owned(),
        )
        .await?;
    Ok(())
}

/// The change log, keyed by cluster id and resourceVersion.
async fn create_changes(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    let backend = manager.get_database_backend();
    manager
        .create_table(
            Table::create()
                .table(Changes::Table)
                .if_not_exists()
                .col(key_string(Changes::ClusterId, 64))
                .col(ColumnDef::new(Changes::Rv).big_integer().not_null())
                .col(key_string(Changes::Resource, 100))
                .col(key_string(Changes::Namespace, 63))
                .col(key_string(Changes::Name, 253))
                .col(key_string(Changes::EventType, 16))
                .col(document(backend, Changes::Labels))
                .col(document(backend, Changes::PrevLabels))
                .col(document(backend, Changes::Body))
                .col(ColumnDef::new(Changes::CreatedAt).big_integer().not_null())
                .primary_key(Index::create().col(Changes::ClusterId).col(Changes::Rv))
                .to_owned(),
        )
        .await?;
    Ok(())
}

/// The `results` table, its indexes and the `report_results` view as this migration made
/// them; also what `m20261125_000005_lean_results` restores on a downgrade.
pub(super) async fn create_wide_results(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    let backend = manager.get_database_backend();
    manager
        .create_table(
            Table::create()
                .table(Results::Table)
                .if_not_exists()
                .col(
                    ColumnDef::new(Results::Id)
                        .big_integer()
                        .not_null()
                        .auto_increment()
                        .primary_key(),
                )
                .col(ColumnDef::new(Results::ObjectId).big_integer().not_null())
                .col(key_string(Results::ClusterId, 64))
                .col(key_string(Results::Resource, 100))
                .col(key_string(Results::Namespace, 63))
                .col(key_string(Results::ReportName, 253))
                .col(ColumnDef::new(Results::Source).string_len(253).null())
                .col(key_string(Results::Policy, 253))
                .col(ColumnDef::new(Results::Rule).string_len(253).null())
                .col(ColumnDef::new(Results::Result).string_len(16).null())
                .col(ColumnDef::new(Results::Severity).string_len(16).null())
                .col(ColumnDef::new(Results::Category).string_len(253).null())
                .col(ColumnDef::new(Results::Scored).boolean().null())
                .col(
                    ColumnDef::new(Results::SubjectApiVersion)
                        .string_len(253)
                        .null(),
                )
                .col(ColumnDef::new(Results::SubjectKind).string_len(253).null())
                .col(
                    ColumnDef::new(Results::SubjectNamespace)
                        .string_len(63)
                        .null(),
                )
                .col(ColumnDef::new(Results::SubjectName).string_len(253).null())
                .col(ColumnDef::new(Results::SubjectUid).string_len(64).null())
                .col(ColumnDef::new(Results::Timestamp).big_integer().null())
                .col(ColumnDef::new(Results::Message).text().null())
                .col(ColumnDef::new(Results::Properties).text().null())
                .to_owned(),
        )
        .await?;
    for (name, cols) in [
        ("results_object", vec![Results::ObjectId]),
        (
            "results_policy",
            vec![
                Results::ClusterId,
                Results::Policy,
                Results::Result,
                Results::Severity,
            ],
        ),
        ("results_subject", vec![Results::SubjectUid]),
    ] {
        let mut index = Index::create();
        index.name(name).table(Results::Table).if_not_exists();
        for c in cols {
            index.col(c);
        }
        manager.create_index(index.to_owned()).await?;
    }

    // A stable, documented view for analytics: one row per result with its report's identity.
    let view = "CREATE VIEW report_results AS \
            SELECT r.cluster_id, r.resource, r.namespace, r.report_name, r.source, r.policy, r.rule, \
            r.result, r.severity, r.category, r.scored, r.subject_api_version, r.subject_kind, \
            r.subject_namespace, r.subject_name, r.subject_uid, r.timestamp, r.message, r.properties \
            FROM results r";
    let create_view = match backend {
        DbBackend::Postgres | DbBackend::MySql => {
            view.replacen("CREATE VIEW", "CREATE OR REPLACE VIEW", 1)
        }
        _ => view.replacen("CREATE VIEW", "CREATE VIEW IF NOT EXISTS", 1),
    };
    manager
        .get_connection()
        .execute_unprepared(&create_view)
        .await?;
    Ok(())
}
