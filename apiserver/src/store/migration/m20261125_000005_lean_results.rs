//! Lean result rows: what every result of a policy rule shares is stored once.
//!
//! Until this version each `results` row repeated its report's identity (cluster, resource,
//! namespace, name), the rule's names, category and severity, and its subject even when that
//! was the report's scope: about 360 bytes a row, 19 rows for a Pod Security Standards report,
//! more than half of a PostgreSQL store. Now a row holds its report's `objects.id`, its
//! position, a `policy_rules.id`, the outcome, the subject only when it is not the scope, the
//! timestamp, message and properties. The `report_results` view keeps its columns and their
//! meaning, so queries against it are unchanged; it joins the three tables.
//!
//! The copy runs in SQL on the database (no rows travel through the process), inside the
//! transaction every migration run takes (`store::change_schema`). `down` restores the wide
//! table from the lean one, for a downgrade (docs/sql-schema.md "Downgrading").

use sea_orm::DbBackend;
use sea_orm_migration::prelude::*;

use super::execute;
use super::m20261121_000001_initial::create_wide_results;
use crate::store::schema::{PolicyRules, Results};

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261125_000005_lean_results"
    }
}

/// The lean table is built under this name next to the wide one, then renamed.
const LEAN: &str = "results_lean";

/// The `report_results` view over the lean rows: the report's identity from `objects`, the
/// rule's from `policy_rules`, the scope as the subject of results without one of their own,
/// and `timestamp` as the expression `timestamp` gives it (this migration: the row's column;
/// `m20261129_000012_report_result_timestamp`: the row's or its report's).
pub(crate) fn report_results_view(timestamp: &str) -> String {
    format!(
        "CREATE VIEW report_results AS \
         SELECT o.cluster_id, o.resource, o.namespace, o.name AS report_name, \
         p.source, p.policy, p.rule, r.result, p.severity, p.category, p.scored, \
         r.subject_api_version, \
         CASE WHEN r.own_subject THEN r.subject_kind ELSE o.scope_kind END AS subject_kind, \
         CASE WHEN r.own_subject THEN r.subject_namespace ELSE o.scope_namespace END \
         AS subject_namespace, \
         CASE WHEN r.own_subject THEN r.subject_name ELSE o.scope_name END AS subject_name, \
         CASE WHEN r.own_subject THEN r.subject_uid ELSE o.scope_uid END AS subject_uid, \
         {timestamp} AS timestamp, r.message, r.properties \
         FROM results r \
         JOIN objects o ON o.id = r.object_id \
         JOIN policy_rules p ON p.id = r.rule_id"
    )
}

/// The row's own `timestamp`, as this migration's view gives it.
pub(crate) const ROW_TIMESTAMP: &str = "r.timestamp";

/// `a` equals `b`, NULL equal to NULL, in the backend's spelling.
fn same(backend: DbBackend, a: &str, b: &str) -> String {
    match backend {
        DbBackend::Postgres => format!("{a} IS NOT DISTINCT FROM {b}"),
        DbBackend::MySql => format!("{a} <=> {b}"),
        _ => format!("{a} IS {b}"),
    }
}

fn nullable_string(col: impl IntoIden, len: u32) -> ColumnDef {
    let mut c = ColumnDef::new(col);
    c.string_len(len).null();
    c
}

async fn create_policy_rules(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    manager
        .create_table(
            Table::create()
                .table(PolicyRules::Table)
                .if_not_exists()
                .col(
                    ColumnDef::new(PolicyRules::Id)
                        .big_integer()
                        .not_null()
                        .auto_increment()
                        .primary_key(),
                )
                .col(nullable_string(PolicyRules::Source, 253))
                .col(
                    ColumnDef::new(PolicyRules::Policy)
                        .string_len(253)
                        .not_null(),
                )
                .col(nullable_string(PolicyRules::Rule, 253))
                .col(nullable_string(PolicyRules::Category, 253))
                .col(nullable_string(PolicyRules::Severity, 16))
                .col(ColumnDef::new(PolicyRules::Scored).boolean().null())
                .to_owned(),
        )
        .await?;
    manager
        .create_index(
            Index::create()
                .name("policy_rules_policy")
                .table(PolicyRules::Table)
                .if_not_exists()
                .col(PolicyRules::Policy)
                .to_owned(),
        )
        .await
}

async fn create_lean_results(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    manager
        .create_table(
            Table::create()
                .table(Alias::new(LEAN))
                .if_not_exists()
                .col(ColumnDef::new(Results::ObjectId).big_integer().not_null())
                .col(ColumnDef::new(Results::Ordinal).integer().not_null())
                .col(ColumnDef::new(Results::RuleId).big_integer().not_null())
                .col(nullable_string(Results::Result, 16))
                .col(ColumnDef::new(Results::OwnSubject).boolean().not_null())
                .col(nullable_string(Results::SubjectApiVersion, 253))
                .col(nullable_string(Results::SubjectKind, 253))
                .col(nullable_string(Results::SubjectNamespace, 63))
                .col(nullable_string(Results::SubjectName, 253))
                .col(nullable_string(Results::SubjectUid, 64))
                .col(ColumnDef::new(Results::Timestamp).big_integer().null())
                .col(ColumnDef::new(Results::Message).text().null())
                .col(ColumnDef::new(Results::Properties).text().null())
                .primary_key(Index::create().col(Results::ObjectId).col(Results::Ordinal))
                .to_owned(),
        )
        .await
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let backend = manager.get_database_backend();
        execute(manager, "DROP VIEW IF EXISTS report_results").await?;
        create_policy_rules(manager).await?;
        execute(
            manager,
            "INSERT INTO policy_rules (source, policy, rule, category, severity, scored) \
             SELECT DISTINCT source, policy, rule, category, severity, scored FROM results",
        )
        .await?;
        create_lean_results(manager).await?;
        let rule = ["source", "rule", "category", "severity", "scored"]
            .map(|c| same(backend, &format!("p.{c}"), &format!("r.{c}")))
            .join(" AND ");
        let scope = [
            ("subject_kind", "scope_kind"),
            ("subject_namespace", "scope_namespace"),
            ("subject_name", "scope_name"),
            ("subject_uid", "scope_uid"),
        ];
        let is_scope = scope
            .map(|(s, o)| same(backend, &format!("r.{s}"), &format!("o.{o}")))
            .join(" AND ");
        let own = |c: &str| format!("CASE WHEN {is_scope} THEN NULL ELSE r.{c} END");
        execute(
            manager,
            &format!(
                "INSERT INTO {LEAN} (object_id, ordinal, rule_id, result, own_subject, \
                 subject_api_version, subject_kind, subject_namespace, subject_name, subject_uid, \
                 timestamp, message, properties) \
                 SELECT r.object_id, \
                 ROW_NUMBER() OVER (PARTITION BY r.object_id ORDER BY r.id) - 1, p.id, r.result, \
                 CASE WHEN {is_scope} THEN {no} ELSE {yes} END, r.subject_api_version, \
                 {kind}, {namespace}, {name}, {uid}, r.timestamp, r.message, r.properties \
                 FROM results r \
                 JOIN objects o ON o.id = r.object_id \
                 JOIN policy_rules p ON p.policy = r.policy AND {rule}",
                no = boolean(backend, false),
                yes = boolean(backend, true),
                kind = own("subject_kind"),
                namespace = own("subject_namespace"),
                name = own("subject_name"),
                uid = own("subject_uid"),
            ),
        )
        .await?;
        manager
            .drop_table(Table::drop().table(Alias::new("results")).to_owned())
            .await?;
        manager
            .rename_table(
                Table::rename()
                    .table(Alias::new(LEAN), Results::Table)
                    .to_owned(),
            )
            .await?;
        for (name, cols) in [
            ("results_rule", vec![Results::RuleId, Results::Result]),
            ("results_own_subject_uid", vec![Results::SubjectUid]),
        ] {
            let mut index = Index::create();
            index.name(name).table(Results::Table).if_not_exists();
            for c in cols {
                index.col(c);
            }
            manager.create_index(index.to_owned()).await?;
        }
        execute(manager, &report_results_view(ROW_TIMESTAMP)).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        execute(manager, "DROP VIEW IF EXISTS report_results").await?;
        manager
            .rename_table(
                Table::rename()
                    .table(Results::Table, Alias::new(LEAN))
                    .to_owned(),
            )
            .await?;
        create_wide_results(manager).await?;
        let subject =
            |c: &str, o: &str| format!("CASE WHEN r.own_subject THEN r.{c} ELSE o.{o} END");
        execute(
            manager,
            &format!(
                "INSERT INTO results (object_id, cluster_id, resource, namespace, report_name, \
                 source, policy, rule, result, severity, category, scored, subject_api_version, \
                 subject_kind, subject_namespace, subject_name, subject_uid, timestamp, message, \
                 properties) \
                 SELECT r.object_id, o.cluster_id, o.resource, o.namespace, o.name, p.source, \
                 p.policy, p.rule, r.result, p.severity, p.category, p.scored, \
                 r.subject_api_version, {kind}, {namespace}, {name}, {uid}, r.timestamp, \
                 r.message, r.properties \
                 FROM {LEAN} r \
                 JOIN objects o ON o.id = r.object_id \
                 JOIN policy_rules p ON p.id = r.rule_id \
                 ORDER BY r.object_id, r.ordinal",
                kind = subject("subject_kind", "scope_kind"),
                namespace = subject("subject_namespace", "scope_namespace"),
                name = subject("subject_name", "scope_name"),
                uid = subject("subject_uid", "scope_uid"),
            ),
        )
        .await?;
        for table in [LEAN, "policy_rules"] {
            manager
                .drop_table(Table::drop().table(Alias::new(table)).to_owned())
                .await?;
        }
        Ok(())
    }
}

/// A boolean literal the backend stores in a boolean column.
fn boolean(backend: DbBackend, value: bool) -> &'static str {
    match (backend, value) {
        (DbBackend::Postgres, true) => "TRUE",
        (DbBackend::Postgres, false) => "FALSE",
        (_, true) => "1",
        (_, false) => "0",
    }
}
