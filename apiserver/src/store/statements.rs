//! The SQL statements of a write round, built with sea-query on `schema.rs`: the heads of the
//! multi-row inserts (objects, labels, results, changes), chunked deletes, common table
//! expressions, and the driver's unique violation as `AlreadyExists`. Chunk sizes keep every
//! statement far below each backend's bind-parameter limit.

use std::collections::BTreeMap;

use sea_orm::sea_query::{
    ColumnRef, CommonTableExpression, Condition, DeleteStatement, Expr, ExprTrait, InsertStatement,
    IntoColumnRef, OnConflict, Query, TableRef,
};
use sea_orm::{ConnectionTrait, DatabaseTransaction};

use super::StoreError;
use super::result_diff::{RESULT_COLUMN_COUNT, ResultColumns, ResultValues};
use super::schema::{Changes, ObjectLabels, Objects, Results};

/// Result rows per INSERT: far below every backend's bind-parameter limit (SQLite 32766,
/// PostgreSQL 65535) at [`RESULT_COLUMN_COUNT`] columns a row.
pub(super) const RESULT_ROWS_PER_STATEMENT: usize = 1000;

/// Ids or versions per `IN (…)` list of a round's deletes and retirements.
pub(super) const KEYS_PER_STATEMENT: usize = 1000;

/// A named common table expression of `query` (built in place: sea-query's chained builders
/// end in a clone of the whole statement, values and all).
pub(super) fn cte(
    name: impl sea_orm::sea_query::IntoIden,
    query: impl Into<sea_orm::sea_query::SubQueryStatement>,
) -> CommonTableExpression {
    let mut cte = CommonTableExpression::new();
    cte.query(query).table_name(name);
    cte
}

/// Inserts `rows` with `head`, [`RESULT_ROWS_PER_STATEMENT`] rows per statement.
pub(super) async fn insert_in_chunks<const N: usize>(
    txn: &DatabaseTransaction,
    head: fn() -> InsertStatement,
    rows: Vec<[Expr; N]>,
) -> Result<(), StoreError> {
    for insert in multi_row_inserts(head, rows) {
        txn.execute(&insert).await?;
    }
    Ok(())
}

/// `DELETE FROM table WHERE column IN (ids)`, [`KEYS_PER_STATEMENT`] ids per statement.
pub(super) async fn delete_where_in(
    txn: &DatabaseTransaction,
    table: impl Into<TableRef>,
    column: impl IntoColumnRef,
    ids: &[i64],
) -> Result<(), StoreError> {
    let (table, column): (TableRef, ColumnRef) = (table.into(), column.into_column_ref());
    for chunk in ids.chunks(KEYS_PER_STATEMENT) {
        txn.execute(&delete_in(table.clone(), column.clone(), chunk))
            .await?;
    }
    Ok(())
}

/// `DELETE FROM table WHERE column IN (ids)`.
pub(super) fn delete_in(
    table: impl Into<TableRef>,
    column: impl IntoColumnRef,
    ids: &[i64],
) -> DeleteStatement {
    Query::delete()
        .from_table(table)
        .and_where(Expr::col(column).is_in(ids.iter().copied()))
        .to_owned()
}

/// `INSERT INTO objects (…)` without values; [`Store::object_values`] gives a row.
pub(super) fn objects_head() -> InsertStatement {
    Query::insert()
        .into_table(Objects::Table)
        .columns(OBJECT_COLUMNS)
        .to_owned()
}

/// `INSERT INTO objects (id, …)`: a replaced object's row again under its id, which its side
/// rows keep referring to.
pub(super) fn objects_with_id_head() -> InsertStatement {
    Query::insert()
        .into_table(Objects::Table)
        .columns(std::iter::once(Objects::Id).chain(OBJECT_COLUMNS))
        .to_owned()
}

/// How many columns an `objects` row has but its id.
pub(super) const OBJECT_COLUMN_COUNT: usize = 22;

/// The values of an `objects` row, in [`OBJECT_COLUMNS`]' order.
pub(super) type ObjectValues = [Expr; OBJECT_COLUMN_COUNT];

/// The columns of an `objects` row but its id, in [`Store::object_values`]' order: first the
/// [`UNIQUE_KEY_COLUMNS`] of its unique key.
pub(super) const OBJECT_COLUMNS: [Objects; OBJECT_COLUMN_COUNT] = [
    Objects::ClusterId,
    Objects::Resource,
    Objects::Namespace,
    Objects::Name,
    Objects::Uid,
    Objects::ResourceVersion,
    Objects::Generation,
    Objects::CreatedAt,
    Objects::DeletedAt,
    Objects::OwnerUids,
    Objects::SummaryPass,
    Objects::SummaryFail,
    Objects::SummaryWarn,
    Objects::SummaryError,
    Objects::SummarySkip,
    Objects::ScopeKind,
    Objects::ScopeNamespace,
    Objects::ScopeName,
    Objects::ScopeUid,
    Objects::Metadata,
    Objects::Body,
    Objects::ResultsTimestamp,
];

/// How many of [`OBJECT_COLUMNS`] make the object's unique key (cluster, resource, namespace,
/// name).
pub(super) const UNIQUE_KEY_COLUMNS: usize = 4;

pub(super) fn labels_head() -> InsertStatement {
    Query::insert()
        .into_table(ObjectLabels::Table)
        .columns([
            ObjectLabels::ObjectId,
            ObjectLabels::Key,
            ObjectLabels::Value,
        ])
        .to_owned()
}

/// The columns of a `results` row, in [`ResultColumns::values`]' order.
pub(super) const RESULT_COLUMNS: [Results; RESULT_COLUMN_COUNT] = [
    Results::ObjectId,
    Results::Ordinal,
    Results::RuleId,
    Results::Result,
    Results::OwnSubject,
    Results::SubjectApiVersion,
    Results::SubjectKind,
    Results::SubjectNamespace,
    Results::SubjectName,
    Results::SubjectUid,
    Results::Timestamp,
    Results::Message,
    Results::Properties,
    Results::OwnTimestamp,
];

/// `INSERT INTO results (…)`; [`slot_values`] gives the rows.
pub(super) fn results_head() -> InsertStatement {
    Query::insert()
        .into_table(Results::Table)
        .columns(RESULT_COLUMNS)
        .to_owned()
}

/// The `results` rows of report `id` (its id or an expression giving it) at their slots, in
/// [`results_head`]'s column order.
pub(super) fn slot_values(
    id: &Expr,
    rows: Vec<(i32, ResultColumns)>,
) -> impl Iterator<Item = ResultValues> + '_ {
    rows.into_iter()
        .map(move |(slot, row)| row.values(id, slot))
}

/// `DELETE FROM results` of the `(object_id, ordinal)` slots, [`KEYS_PER_STATEMENT`] slots per
/// statement, each report's slots as one `IN` list.
pub(super) fn delete_slots(slots: &[(i64, i32)]) -> Vec<DeleteStatement> {
    slots
        .chunks(KEYS_PER_STATEMENT)
        .map(|chunk| {
            let mut by_report: BTreeMap<i64, Vec<i32>> = BTreeMap::new();
            for (id, slot) in chunk {
                by_report.entry(*id).or_default().push(*slot);
            }
            let mut any = Condition::any();
            for (id, slots) in by_report {
                any = any.add(
                    Condition::all()
                        .add(Expr::col(Results::ObjectId).eq(id))
                        .add(Expr::col(Results::Ordinal).is_in(slots)),
                );
            }
            Query::delete()
                .from_table(Results::Table)
                .cond_where(any)
                .to_owned()
        })
        .collect()
}

/// `rows` as INSERTs made by `head`, [`RESULT_ROWS_PER_STATEMENT`] rows per statement.
pub(super) fn multi_row_inserts<const N: usize>(
    head: fn() -> InsertStatement,
    rows: impl IntoIterator<Item = [Expr; N]>,
) -> Vec<InsertStatement> {
    let mut rows = rows.into_iter().peekable();
    let mut inserts = Vec::new();
    while rows.peek().is_some() {
        let mut insert = head();
        for row in rows.by_ref().take(RESULT_ROWS_PER_STATEMENT) {
            insert.values_panic(row);
        }
        inserts.push(insert);
    }
    inserts
}

/// `INSERT INTO changes (…) … ON CONFLICT DO NOTHING`; [`Store::change_values`] gives a row.
/// MySQL has no `ON CONFLICT`; sea-query renders a bare `do_nothing()` there as the invalid
/// `ON DUPLICATE KEY IGNORE`, and `do_nothing_on` as its no-op `ON DUPLICATE KEY UPDATE rv = rv`
/// (PostgreSQL and SQLite get the same `ON CONFLICT DO NOTHING` either way).
pub(super) fn changes_head() -> InsertStatement {
    Query::insert()
        .into_table(Changes::Table)
        .columns([
            Changes::ClusterId,
            Changes::Rv,
            Changes::Resource,
            Changes::Namespace,
            Changes::Name,
            Changes::EventType,
            Changes::Labels,
            Changes::PrevLabels,
            Changes::Body,
            Changes::CreatedAt,
        ])
        .on_conflict(OnConflict::new().do_nothing_on([Changes::Rv]).to_owned())
        .to_owned()
}

/// The INSERT of one change-log row (from [`Store::change_values`]).
pub(super) fn one_change(row: [Expr; 10]) -> InsertStatement {
    let mut insert = changes_head();
    insert.values_panic(row);
    insert
}

/// The primary key already taken: the driver's unique-violation code, not its wording.
pub(super) fn unique_to_exists(e: sea_orm::DbErr) -> StoreError {
    if matches!(
        e.sql_err(),
        Some(sea_orm::SqlErr::UniqueConstraintViolation(_))
    ) {
        StoreError::AlreadyExists
    } else {
        e.into()
    }
}
