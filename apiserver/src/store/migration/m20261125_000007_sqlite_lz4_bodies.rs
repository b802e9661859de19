//! SQLite stores bodies LZ4-compressed (`store::body`): `up` compresses the bodies already
//! stored, `down` turns every body back into JSON text for a release that reads only text.
//!
//! The server reads both forms, so `up` is not needed for correctness; it is there so that an
//! upgraded database is as small as a new one (a 10,000-report store keeps ~8 KB less per
//! report; SQLite reuses the freed pages, `VACUUM` gives them back to the file system). `down`
//! is needed: a release before this one would read a compressed body as corrupt JSON, and
//! sea-orm-migration makes such a release refuse to start while this migration is recorded.
//! PostgreSQL and MySQL: nothing to do (docs/sql-schema.md "Compression").
//!
//! Rows are rewritten in batches of [`ROWS_PER_BATCH`], in Rust (SQLite has no compression
//! function), inside the transaction every migration run takes (`store::change_schema`).

use sea_orm::{ConnectionTrait, DbBackend, Statement, Value};
use sea_orm_migration::prelude::*;

use crate::store::body::{compress, decode};

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261125_000007_sqlite_lz4_bodies"
    }
}

const ROWS_PER_BATCH: i64 = 500;

/// A progress line each time this many more bodies are rewritten.
const PROGRESS_EVERY: u64 = 10_000;

/// The tables holding whole bodies; the change log's empty marker is left as it is.
const BODY_TABLES: [&str; 2] = ["objects", "changes"];

/// Which way a run rewrites bodies.
#[derive(Clone, Copy)]
enum Direction {
    Compress,
    Decompress,
}

impl Direction {
    /// The bodies still to rewrite: text (not the empty marker), or compressed.
    fn stored_as(self) -> &'static str {
        match self {
            Direction::Compress => "typeof(body) = 'text' AND body <> ''",
            Direction::Decompress => "typeof(body) = 'blob'",
        }
    }

    fn rewrite(self, table: &str, rowid: i64, stored: Vec<u8>) -> Result<Value, DbErr> {
        match self {
            Direction::Compress => Ok(compress(&stored).into()),
            Direction::Decompress => decode(stored).map(Value::from).map_err(|why| {
                DbErr::Custom(format!(
                    "cannot decompress the body of {table} row {rowid}: {why}; \
                     restore the database from a backup taken before the upgrade"
                ))
            }),
        }
    }
}

async fn rewrite_bodies(manager: &SchemaManager<'_>, direction: Direction) -> Result<(), DbErr> {
    if manager.get_database_backend() != DbBackend::Sqlite {
        return Ok(());
    }
    let db = manager.get_connection();
    for table in BODY_TABLES {
        let (mut after, mut rewritten) = (0_i64, 0_u64);
        loop {
            let rows = db
                .query_all_raw(Statement::from_sql_and_values(
                    DbBackend::Sqlite,
                    format!(
                        "SELECT rowid AS r, body FROM {table} WHERE rowid > ? AND {} \
                         ORDER BY rowid LIMIT ?",
                        direction.stored_as()
                    ),
                    [after.into(), ROWS_PER_BATCH.into()],
                ))
                .await?;
            let Some(last) = rows.last() else { break };
            after = last.try_get("", "r")?;
            for row in &rows {
                let rowid: i64 = row.try_get("", "r")?;
                let stored: Vec<u8> = row.try_get("", "body")?;
                db.execute_raw(Statement::from_sql_and_values(
                    DbBackend::Sqlite,
                    format!("UPDATE {table} SET body = ? WHERE rowid = ?"),
                    [direction.rewrite(table, rowid, stored)?, rowid.into()],
                ))
                .await?;
            }
            let before = rewritten;
            rewritten += rows.len() as u64;
            if rewritten / PROGRESS_EVERY > before / PROGRESS_EVERY {
                tracing::info!(table, rewritten, "rewriting bodies");
            }
        }
        if rewritten > 0 {
            tracing::info!(table, rewritten, "bodies rewritten");
        }
    }
    Ok(())
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        rewrite_bodies(manager, Direction::Compress).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        rewrite_bodies(manager, Direction::Decompress).await
    }
}
