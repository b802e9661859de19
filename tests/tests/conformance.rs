//! API conformance (issue 3) on SQLite and PostgreSQL; the tests are in `conformance_suite`,
//! which `conformance_mariadb` runs on MariaDB.

#[macro_use]
mod conformance_suite;

on_backends!(sqlite: Sqlite, postgres: Postgres);

/// A database outage has no SQLite counterpart: the embedded database cannot be taken away from
/// a running process, so this one runs on the database servers only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_outage_is_503_not_404_postgres() {
    conformance_suite::database_outage_is_503_not_404(reports_server_tests::Backend::Postgres).await
}
