//! Reading: one connection opened for reading only, every statement inside a read-only
//! transaction that is rolled back, rows decoded into a [`Table`] whatever their columns.
//!
//! Two locks on SQLite, because SQLite runs every statement of a `--sql` text: the file is
//! opened read-only (`mode=ro`, which no statement can lift) and `PRAGMA query_only` refuses
//! writes with a clear message. PostgreSQL and MySQL run one statement per prepared query, in
//! a `READ ONLY` transaction.

use std::time::Duration;

use sea_orm::{
    AccessMode, ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DatabaseTransaction,
    DbBackend, DbErr, QueryResult, Statement, TransactionTrait,
};
use serde_json::Value;

use crate::{AnalyticsError, Question, Table};

/// `url` with SQLite's open mode replaced by `ro` (the store's URLs say `mode=rwc`, which
/// would create a missing file and allow writes).
pub fn read_only_url(url: &str) -> String {
    if !url.starts_with("sqlite:") {
        return url.to_owned();
    }
    let (path, query) = url.split_once('?').unwrap_or((url, ""));
    let mut parameters: Vec<&str> = query
        .split('&')
        .filter(|p| !p.is_empty() && !p.starts_with("mode="))
        .collect();
    parameters.push("mode=ro");
    format!("{path}?{}", parameters.join("&"))
}

/// One connection to `url` that can only read (a CLI asks one question at a time).
pub async fn connect_read_only(
    url: &str,
    connect_timeout: Duration,
) -> Result<DatabaseConnection, AnalyticsError> {
    let mut options = ConnectOptions::new(read_only_url(url));
    options
        .max_connections(1)
        .min_connections(1)
        .connect_timeout(connect_timeout)
        .acquire_timeout(connect_timeout)
        .sqlx_logging(false);
    let db = Database::connect(options)
        .await
        .map_err(AnalyticsError::Connect)?;
    if db.get_database_backend() == DbBackend::Sqlite {
        db.execute_unprepared("PRAGMA query_only = ON")
            .await
            .map_err(AnalyticsError::Connect)?;
    }
    Ok(db)
}

/// Copies the SQLite database at `url` into a new file `to`, consistent as of one moment,
/// while servers keep writing: `VACUUM INTO` through a connection that cannot write the
/// source (`mode=ro`; `PRAGMA query_only` would refuse `VACUUM INTO` as well). The copy is
/// written beside `to` and renamed into place, so `to` is never a half-written file.
pub async fn copy_sqlite(
    url: &str,
    to: &std::path::Path,
    connect_timeout: Duration,
) -> Result<u64, AnalyticsError> {
    if !url.starts_with("sqlite:") {
        return Err(AnalyticsError::NotSqlite);
    }
    if to.exists() {
        return Err(AnalyticsError::Copy(format!(
            "{} exists; name a new file",
            to.display()
        )));
    }
    // Beside the target (so the rename stays on one file system), named for this process.
    let mut partial = to.as_os_str().to_owned();
    partial.push(format!(".{}.partial", std::process::id()));
    let partial = std::path::PathBuf::from(partial);
    let mut options = ConnectOptions::new(read_only_url(url));
    options
        .max_connections(1)
        .connect_timeout(connect_timeout)
        .acquire_timeout(connect_timeout)
        .sqlx_logging(false);
    let db = Database::connect(options)
        .await
        .map_err(AnalyticsError::Connect)?;
    let target = partial.to_string_lossy().into_owned();
    let copied = db
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Sqlite,
            "VACUUM INTO ?",
            [target.into()],
        ))
        .await;
    db.close().await.map_err(AnalyticsError::Connect)?;
    if let Err(e) = copied {
        let _ = std::fs::remove_file(&partial);
        return Err(AnalyticsError::Query(e));
    }
    if to.exists() {
        let _ = std::fs::remove_file(&partial);
        return Err(AnalyticsError::Copy(format!(
            "{} appeared while copying; name a new file",
            to.display()
        )));
    }
    std::fs::rename(&partial, to)
        .map_err(|e| AnalyticsError::Copy(format!("cannot rename the copy into place: {e}")))?;
    let bytes = std::fs::metadata(to)
        .map(|m| m.len())
        .map_err(|e| AnalyticsError::Copy(e.to_string()))?;
    Ok(bytes)
}

async fn read_only_transaction(db: &DatabaseConnection) -> Result<DatabaseTransaction, DbErr> {
    match db.get_database_backend() {
        // `SET TRANSACTION READ ONLY` first in the transaction (PostgreSQL) or before
        // `START TRANSACTION` (MySQL), as sea-orm issues it.
        DbBackend::Postgres | DbBackend::MySql => {
            db.begin_with_config(None, Some(AccessMode::ReadOnly)).await
        }
        // SQLite has no read-only transaction; the connection is (see the module docs).
        _ => db.begin().await,
    }
}

/// Runs `statement` read-only; nothing it did is committed.
async fn read(db: &DatabaseConnection, statement: Statement) -> Result<Table, DbErr> {
    let transaction = read_only_transaction(db).await?;
    let rows = transaction.query_all_raw(statement).await;
    transaction.rollback().await?;
    let rows = rows?;
    decode(&rows).map_err(DbErr::Custom)
}

/// Answers a named question.
pub async fn run_question(
    db: &DatabaseConnection,
    question: &Question,
) -> Result<Table, AnalyticsError> {
    let query = question.to_query(db.get_database_backend());
    let statement = Statement::from_sql_and_values(query.backend, query.sql, query.values);
    read(db, statement)
        .await
        .map_err(unprintable_or(AnalyticsError::Query))
}

/// Runs ad-hoc SQL (`--sql`) read-only.
pub async fn run_sql(db: &DatabaseConnection, sql: &str) -> Result<Table, AnalyticsError> {
    let statement = Statement::from_string(db.get_database_backend(), sql.to_owned());
    read(db, statement)
        .await
        .map_err(unprintable_or(AnalyticsError::AdHoc))
}

/// Marks the column `decode` could not print; see [`unprintable_or`].
const UNPRINTABLE: &str = "unprintable column ";

fn unprintable_or(wrap: fn(DbErr) -> AnalyticsError) -> impl Fn(DbErr) -> AnalyticsError {
    move |error| match &error {
        DbErr::Custom(message) if message.starts_with(UNPRINTABLE) => {
            AnalyticsError::UnprintableColumn {
                column: message[UNPRINTABLE.len()..].to_owned(),
            }
        }
        _ => wrap(error),
    }
}

/// The rows as JSON values; `Err` names a column of a type none of ours decodes.
fn decode(rows: &[QueryResult]) -> Result<Table, String> {
    let Some(first) = rows.first() else {
        return Ok(Table::default());
    };
    let columns = first.column_names();
    let mut table = Table {
        columns: columns.clone(),
        rows: Vec::with_capacity(rows.len()),
    };
    for row in rows {
        let values = (0..columns.len())
            .map(|i| value(row, i).ok_or_else(|| format!("{UNPRINTABLE}{}", columns[i])))
            .collect::<Result<Vec<_>, _>>()?;
        table.rows.push(values);
    }
    Ok(table)
}

/// One cell, trying the types our views and ordinary queries return: integers before floats
/// and booleans (SQLite would read an integer as either), text, JSON (PostgreSQL), bytes.
fn value(row: &QueryResult, i: usize) -> Option<Value> {
    macro_rules! attempt {
        ($($t:ty),*) => {$(
            if let Ok(v) = row.try_get_by_index::<Option<$t>>(i) {
                return Some(v.map_or(Value::Null, Value::from));
            }
        )*};
    }
    attempt!(i64, i32, i16, f64, f32, bool, String, Value);
    if let Ok(v) = row.try_get_by_index::<Option<Vec<u8>>>(i) {
        return Some(v.map_or(Value::Null, |b| {
            Value::String(String::from_utf8_lossy(&b).into_owned())
        }));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_urls_open_read_only_and_others_are_unchanged() {
        assert_eq!(
            read_only_url("sqlite:///var/lib/reports.db?mode=rwc"),
            "sqlite:///var/lib/reports.db?mode=ro"
        );
        assert_eq!(read_only_url("sqlite://r.db"), "sqlite://r.db?mode=ro");
        assert_eq!(
            read_only_url("sqlite://r.db?cache=shared&mode=rw"),
            "sqlite://r.db?cache=shared&mode=ro"
        );
        let postgres = "postgres://u:p@h:5432/reports";
        assert_eq!(read_only_url(postgres), postgres);
    }
}
