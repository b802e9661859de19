//! The analysts' read-only role (`operator/src/analytics.rs`, docs/analytics-access.md) on a
//! real PostgreSQL, after the server's own migrations: the SQL the docs show for someone else's
//! PostgreSQL and the SQL the operator runs on its own, both through the operator's runner.
//!
//! Checked: the role reads `report_results` and every analytics view (`reports-server query`'s
//! read-only path included); it cannot INSERT, UPDATE, DELETE, TRUNCATE, CREATE or DROP, neither
//! in its default read-only transactions nor after `SET TRANSACTION READ WRITE` (the privileges
//! alone refuse); a table and a view the owner creates afterwards, as a later migration would,
//! are readable without granting again; the statements are idempotent; dropping the role undoes
//! it all.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use reports_server_apiserver::store::{Mutation, Store, StoreError, StoreOptions};
use reports_server_crds::catalog::POLICY_REPORT;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use reports_server_operator::analytics::{self, Connection, PostgresRunner, RoleSql, SqlRunner};
use reports_server_tests::postgres;

/// The analytics views of migration `m20261128_000009_analytics_views`.
const VIEWS: [&str; 5] = [
    "namespace_compliance",
    "policy_compliance",
    "cluster_compliance",
    "latest_results",
    "result_properties",
];

/// `postgres://user[:password]@host:port/database` as the runner's connection.
fn connection(url: &str) -> Result<Connection> {
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .context("a postgres:// URL")?;
    let (user_info, rest) = rest.rsplit_once('@').context("a user in the URL")?;
    let (user, password) = user_info.split_once(':').unwrap_or((user_info, ""));
    let (host_port, database) = rest.split_once('/').context("a database in the URL")?;
    let database = database.split('?').next().unwrap_or_default();
    let (host, port) = host_port.rsplit_once(':').unwrap_or((host_port, "5432"));
    Ok(Connection {
        host: host.into(),
        port: port.parse()?,
        database: database.into(),
        user: user.into(),
        password: password.into(),
    })
}

/// Runs `statements` in one transaction as `who`; the database's error when it refuses.
async fn run(who: &Connection, statements: &[&str]) -> Result<(), String> {
    let statements: Vec<String> = statements.iter().map(|s| s.to_string()).collect();
    PostgresRunner.run(who, &statements).await
}

/// `statement` is refused as `who`, in a read-only transaction and in a read-write one, the
/// latter by the privileges.
async fn refused(who: &Connection, statement: &str) -> Result<()> {
    let read_only = run(who, &[statement]).await;
    ensure!(
        read_only
            .as_ref()
            .is_err_and(|e| e.contains("read-only transaction")),
        "{statement} in the role's default transaction: {read_only:?}"
    );
    let read_write = run(who, &["SET TRANSACTION READ WRITE", statement]).await;
    ensure!(
        read_write
            .as_ref()
            .is_err_and(|e| e.contains("permission denied") || e.contains("must be owner")),
        "{statement} after SET TRANSACTION READ WRITE: {read_write:?}"
    );
    Ok(())
}

/// Everything the role may do, and everything it may not.
async fn check_reads_only(role: &Connection, namespace: &str) -> Result<()> {
    for relation in ["report_results", "objects", "results", "policy_rules"] {
        run(role, &[&format!("SELECT count(*) FROM {relation}")])
            .await
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("SELECT on {relation}"))?;
    }
    for view in VIEWS {
        run(role, &[&format!("SELECT * FROM {view}")])
            .await
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("SELECT on {view}"))?;
    }
    // The same path `reports-server query --database-url …` takes.
    let db =
        reports_server_analytics::connect_read_only(&role.uri(), Duration::from_secs(10)).await?;
    let table = reports_server_analytics::run_sql(
        &db,
        &format!("SELECT fail FROM namespace_compliance WHERE namespace = '{namespace}'"),
    )
    .await?;
    ensure!(
        table.rows.len() == 1,
        "namespace_compliance for {namespace}: {:?}",
        table.rows
    );
    for statement in [
        // report_results is a view over these tables.
        "INSERT INTO results DEFAULT VALUES",
        "UPDATE objects SET name = name",
        "DELETE FROM results",
        "TRUNCATE objects",
        "CREATE TABLE analysts_table (x int)",
        "DROP VIEW namespace_compliance",
    ] {
        refused(role, statement).await?;
    }
    Ok(())
}

#[tokio::test]
async fn the_read_only_role_reads_every_table_and_view_and_writes_nothing() -> Result<()> {
    let url = postgres::fresh_database()?;
    let store = Store::connect(StoreOptions::new(url.clone()))
        .await
        .context("the server's migrations")?;
    let namespace = "team-a";
    let report = serde_json::to_value(pss_policy_report(
        &Subject::pod(namespace, 1),
        1_764_300_000,
        &[0, 3],
    ))?;
    store
        .mutate::<StoreError, _>(&POLICY_REPORT, namespace, "pod-1", false, |_| {
            Ok(Mutation::Put(report.clone()))
        })
        .await?;
    let admin = connection(&url)?;
    // Roles belong to the whole PostgreSQL cluster, which other tests share.
    let name = format!("analytics_test_{}", std::process::id());
    let role = Connection {
        user: name.clone(),
        password: "analytics-test-password".into(),
        ..admin.clone()
    };
    let sql = |revoke_public_create| {
        analytics::statements(&RoleSql {
            role: &name,
            password: Some(&role.password),
            database: &admin.database,
            schema: "public",
            owner: &admin.user,
            revoke_public_create,
        })
    };
    run(
        &admin,
        &analytics::drop_statements(&name)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    )
    .await
    .map_err(anyhow::Error::msg)?;

    // What docs/analytics-access.md shows for someone else's PostgreSQL.
    PostgresRunner
        .run(&admin, &sql(false))
        .await
        .map_err(anyhow::Error::msg)
        .context("the documented SQL")?;
    check_reads_only(&role, namespace).await?;

    // A later migration's table and view, created by the owner: readable without a new grant.
    run(
        &admin,
        &[
            "CREATE TABLE later_table (x int)",
            "INSERT INTO later_table VALUES (1)",
            "CREATE VIEW later_view AS SELECT x FROM later_table",
        ],
    )
    .await
    .map_err(anyhow::Error::msg)?;
    for relation in ["later_table", "later_view"] {
        run(&role, &[&format!("SELECT x FROM {relation}")])
            .await
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("{relation}, created after the grants"))?;
    }

    // What the operator runs on its own PostgreSQL, at every convergence: idempotent.
    for _ in 0..2 {
        PostgresRunner
            .run(&admin, &sql(true))
            .await
            .map_err(anyhow::Error::msg)
            .context("the operator's SQL, again")?;
    }
    check_reads_only(&role, namespace).await?;

    // Later convergences send no password (the role keeps the one set), and take away
    // attributes given by hand.
    let operator = |password: Option<&'static str>| {
        analytics::operator_statements(&RoleSql {
            role: &name,
            password,
            database: &admin.database,
            schema: "public",
            owner: &admin.user,
            revoke_public_create: true,
        })
    };
    ensure!(!operator(None).iter().any(|s| s.contains("PASSWORD")));
    run(&admin, &[&format!("ALTER ROLE {name} CREATEDB CREATEROLE")])
        .await
        .map_err(anyhow::Error::msg)?;
    PostgresRunner
        .run(&admin, &operator(None))
        .await
        .map_err(anyhow::Error::msg)
        .context("the operator's SQL without the password")?;
    check_reads_only(&role, namespace).await?;
    run(
        &admin,
        &[&format!(
            "DO $do$ BEGIN IF (SELECT rolcreatedb OR rolcreaterole FROM pg_catalog.pg_roles \
             WHERE rolname = '{name}') THEN RAISE EXCEPTION 'attributes given by hand stayed'; \
             END IF; END $do$"
        )],
    )
    .await
    .map_err(anyhow::Error::msg)?;

    // Turned off: the role is gone (twice: idempotent), with its privileges.
    for _ in 0..2 {
        PostgresRunner
            .run(&admin, &analytics::drop_statements(&name))
            .await
            .map_err(anyhow::Error::msg)
            .context("dropping the role")?;
    }
    let gone = run(&role, &["SELECT 1"]).await;
    ensure!(
        gone.as_ref().is_err_and(|e| e.contains(&name)),
        "the dropped role still connects: {gone:?}"
    );
    // Without the password, a missing role is an error the operator recognises (it then runs
    // the statements with the password), never a role created without one.
    let missing = PostgresRunner.run(&admin, &operator(None)).await;
    ensure!(
        missing
            .as_ref()
            .is_err_and(|e| e.contains(analytics::ROLE_MISSING)),
        "{missing:?}"
    );
    Ok(())
}
