//! Named, read-only questions over the SQL views reports-server documents as a supported
//! interface (docs/sql-schema.md, docs/analytics.md).
//!
//! The store keeps one row per policy result so that a platform team can ask "what fails, where,
//! how compliant are we" in SQL. This crate is why they need not write that SQL against an
//! undocumented connection: each question is built from typed filters for the backend at hand
//! (values bound as parameters, never spliced into the text) and run in a read-only
//! transaction, on SQLite, PostgreSQL and MySQL/MariaDB alike.
//!
//! * [`condition`]: the `--where 'score>=8.0'` syntax over result properties, parsed into a
//!   typed filter;
//! * [`question`]: the named questions and the SQL each becomes for a backend (no I/O);
//! * [`run`]: a read-only connection, the read-only transaction, rows decoded into a [`Table`];
//!   and a consistent copy of a SQLite database for analysts ([`copy_sqlite`]);
//! * [`render`]: a [`Table`] as `table`, `json`, `csv` or `yaml`.

#![forbid(unsafe_code)]
// Every production function fits on a screen (threshold in clippy.toml); tests may be longer.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod condition;
pub mod question;
pub mod render;
pub mod run;

pub use condition::{Comparison, Condition};
pub use question::{ALL_CLUSTERS, Grouping, Query, Question, ResultFilter};
pub use render::{Output, Table};
pub use run::{connect_read_only, copy_sqlite, run_question, run_sql};

/// What can go wrong, each with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum AnalyticsError {
    #[error(
        "invalid property condition {expression:?}: {reason} (write KEY OP VALUE, e.g. \
         'score>=8.0' or 'vulnerabilityID=CVE-2024-1234'; OP is one of = != > >= < <=)"
    )]
    InvalidCondition { expression: String, reason: String },
    #[error("cannot open the database read-only (is the URL right, and the database up?)")]
    Connect(#[source] sea_orm::DbErr),
    #[error("the database refused the query")]
    Query(#[source] sea_orm::DbErr),
    #[error(
        "the database refused the statement (`--sql` runs in a read-only transaction: \
         statements that write are refused; change reports through the Kubernetes API)"
    )]
    AdHoc(#[source] sea_orm::DbErr),
    #[error(
        "column {column:?} has a type this command cannot print (such as NUMERIC/DECIMAL): \
         CAST it in the query, e.g. CAST(… AS DOUBLE PRECISION) on PostgreSQL, \
         CAST(… AS DOUBLE) on MySQL, or to text"
    )]
    UnprintableColumn { column: String },
    #[error("cannot write the output: {0}")]
    Render(String),
    #[error(
        "`backup` copies the embedded SQLite database only; back PostgreSQL up with pg_dump or \
         your provider's snapshots, MySQL/MariaDB with mysqldump or mariadb-backup"
    )]
    NotSqlite,
    #[error("cannot write the copy: {0}")]
    Copy(String),
}
