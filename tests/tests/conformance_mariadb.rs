//! API conformance (issue 3) on MariaDB, through the store's MySQL driver: the tests of
//! `conformance_suite`, in a binary of their own so that `cargo xtask test` runs them beside the
//! SQLite and PostgreSQL ones (`conformance`) rather than lengthening that binary.
//! `reports_server_tests::mariadb` says which MariaDB they use.

#[macro_use]
mod conformance_suite;

on_backends!(mariadb: MariaDb);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_outage_is_503_not_404_mariadb() {
    conformance_suite::database_outage_is_503_not_404(reports_server_tests::Backend::MariaDb).await
}
