//! The settings every database session of the store gets when it connects: what the server
//! relies on from a session but cannot pass as a startup parameter (connection poolers such as
//! PgBouncer refuse those).

use std::time::Duration;

/// Sets up a PostgreSQL session, in one round trip:
///
/// - PostgreSQL ends the session when it idles `after` inside a transaction: a client that
///   abandoned its transaction on a half-open connection (ended when an outage began, see
///   [`super::Store::unless_outage`]) cannot tell the server, whose session would keep the
///   transaction's row locks.
/// - PostgreSQL plans every execution of a prepared statement with its parameters, never with
///   a generic plan it keeps. The driver prepares each statement once per connection, and
///   PostgreSQL switches a statement to a generic plan after five executions when that plan
///   looks as cheap: on a new store, whose `objects` table holds a few rows then, the generic
///   plan of a lookup by key is a sequential scan, kept until autovacuum first analyzes the
///   table (a minute or more), while the table grows. Measured: the round's lookups of 10,000
///   creates read 400–2,300 buffers each instead of a few, and PostgreSQL's CPU per create went
///   from 0.5 to 1.5–2.2 ms in the runs where the analyze came late. Planning each execution
///   of the store's short statements costs less than one such scan. PostgreSQL 11 and older
///   have no `plan_cache_mode` and keep their default.
///
/// `set_config` after connecting rather than startup parameters, which connection poolers
/// such as PgBouncer refuse.
pub(super) async fn set_up_postgres(
    db: &mut sqlx::PgConnection,
    idle_in_transaction: Duration,
) -> Result<(), sqlx::Error> {
    let millis = idle_in_transaction.as_millis().max(1).to_string();
    sqlx::query(
        "SELECT set_config('idle_in_transaction_session_timeout', $1, false), \
         CASE WHEN current_setting('server_version_num')::int >= 120000 \
         THEN set_config('plan_cache_mode', 'force_custom_plan', false) END",
    )
    .bind(millis)
    .execute(db)
    .await?;
    Ok(())
}

/// What [`set_up_postgres`] does against abandoned transactions, for MariaDB
/// (`idle_transaction_timeout`, whole seconds).
/// MySQL has no such variable and refuses the `SET`; its sessions go on without it.
pub(super) async fn end_abandoned_mariadb_transactions(
    db: &mut sqlx::MySqlConnection,
    after: Duration,
) -> Result<(), sqlx::Error> {
    // A number, formatted: not every server takes a placeholder in SET.
    let seconds = after.as_secs().max(1);
    let sql = sqlx::AssertSqlSafe(format!("SET SESSION idle_transaction_timeout = {seconds}"));
    let set = sqlx::raw_sql(sql).execute(db).await;
    if let Err(e) = set {
        tracing::debug!(error = %e, "this server has no idle_transaction_timeout (MySQL)");
    }
    Ok(())
}
