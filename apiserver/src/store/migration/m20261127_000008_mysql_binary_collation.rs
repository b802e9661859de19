//! MySQL and MariaDB: the store's tables compare text byte for byte (`utf8mb4_bin`), as
//! Kubernetes compares names, label keys and values, and as PostgreSQL and SQLite do.
//!
//! The earlier migrations create tables in the database's default collation. The defaults
//! operators get are case-insensitive (Debian's MariaDB `utf8mb4_general_ci`, MySQL 8's
//! `utf8mb4_0900_ai_ci`) or not even UTF-8 (MariaDB's compiled-in `latin1_swedish_ci`): the
//! labels `team` and `Team` of one object then collide in `object_labels`' primary key, and
//! `team=payments` selects `team=Payments`. `up` converts each table that is not yet
//! `utf8mb4_bin` and makes it the database's default, so that tables later migrations create
//! inherit it. `utf8mb4_bin` ignores trailing spaces in comparisons (PAD SPACE; MySQL 8 has no
//! `nopad` variant of it), which no Kubernetes name or label value can end with.
//!
//! `down` changes nothing: an older release works on these tables as they are, better than on
//! case-insensitive ones. PostgreSQL and SQLite: nothing to do.

use sea_orm::{ConnectionTrait, DbBackend, Statement};
use sea_orm_migration::prelude::*;

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "m20261127_000008_mysql_binary_collation"
    }
}

/// Every table the store's migrations create (`results` is the lean one since migration 5).
const TABLES: [&str; 7] = [
    "store_state",
    "objects",
    "object_labels",
    "changes",
    "results",
    "policy_rules",
    "leases",
];

const COLLATION: &str = "utf8mb4_bin";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() != DbBackend::MySql {
            return Ok(());
        }
        let db = manager.get_connection();
        let listed = TABLES.map(|t| format!("'{t}'")).join(", ");
        // Only the tables still to convert: each conversion copies its table, and a replica
        // that starts beside this one may have converted some already (MySQL's DDL is not
        // transactional, see `store::change_schema`).
        let pending = db
            .query_all_raw(Statement::from_string(
                DbBackend::MySql,
                format!(
                    "SELECT table_name AS name FROM information_schema.tables \
                     WHERE table_schema = DATABASE() AND table_type = 'BASE TABLE' \
                     AND table_name IN ({listed}) AND table_collation <> '{COLLATION}'"
                ),
            ))
            .await?;
        for row in pending {
            let table: String = row.try_get("", "name")?;
            db.execute_unprepared(&format!(
                "ALTER TABLE `{table}` CONVERT TO CHARACTER SET utf8mb4 COLLATE {COLLATION}"
            ))
            .await?;
        }
        db.execute_unprepared(&format!(
            "ALTER DATABASE CHARACTER SET utf8mb4 COLLATE {COLLATION}"
        ))
        .await?;
        Ok(())
    }

    async fn down(&self, _: &SchemaManager) -> Result<(), DbErr> {
        Ok(())
    }
}
