//! Analysts' read-only access to the reports (`spec.analytics.readOnlyRole`,
//! docs/analytics-access.md): a PostgreSQL LOGIN role that may read every table and view of the
//! server's schema, including those later migrations add, and nothing else.
//!
//! How the grants reach the database, and why: the operator connects to its own PostgreSQL
//! (`<name>-postgres`, as the superuser whose password it generated) and runs [`statements`] in
//! one transaction, at every reconcile whose statements differ from the last ones that
//! succeeded and at least every `--ready-requeue-seconds` (default 300 s) otherwise. Every
//! statement is idempotent, so this converges: a role dropped by hand, its grants or its
//! read-only setting revoked, the attributes `SUPERUSER`, `CREATEDB`, `CREATEROLE`,
//! `REPLICATION` or `BYPASSRLS` given to it, a password Secret deleted (a new password is
//! generated and set), an existing installation that turns the option on, all come back to the
//! same state. What is *added* by hand otherwise is not taken away: memberships in other roles,
//! privileges on other schemas or databases, other per-role settings. The password is sent only
//! when the role is created or the Secret's password differs from the one last set (its SHA-256
//! is kept in the Secret's annotation `reportsserver.io/password-sha256`), so that it reaches
//! PostgreSQL's statement log at most once per password. The alternatives were worse: a script in
//! `/docker-entrypoint-initdb.d` runs only when the data directory is first initialised (never
//! for existing installations, never again after a change), and a Job runs once per name and
//! needs its own image pull, retry policy and clean-up. Tables and views created later (the
//! server's migrations run as the owner role) are readable through `ALTER DEFAULT PRIVILEGES`;
//! the regular `GRANT SELECT ON ALL TABLES` catches anything created another way.
//!
//! Least privilege: the role gets `CONNECT`, `USAGE` on the schema and `SELECT`; it owns
//! nothing, and `default_transaction_read_only = on` makes even a slip of its own read-only
//! (belt and braces: the privileges alone already refuse every write). The server's own role is
//! not touched. On the managed database the operator also revokes `CREATE` on the schema from
//! `PUBLIC`, which PostgreSQL 15 and later do by default but 14 and earlier grant to every role;
//! the documented SQL for someone else's PostgreSQL leaves that to its admin, since other
//! applications there may rely on it.
//!
//! [`statements`], [`drop_statements`] and [`secret`] are pure (unit-tested here, run on a real
//! PostgreSQL by `tests/tests/analytics_role.rs`); [`SqlRunner`] is the one piece of I/O, a trait
//! so that the reconciler is tested against a mocked API server without a database.

use std::fmt::Write as _;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{Value, json};

/// The analysts' role in the operator's PostgreSQL.
pub const ROLE: &str = "reports_analytics";
/// The database, schema and owner role of the operator's PostgreSQL (`POSTGRES_DB`,
/// `POSTGRES_USER`; the server's migrations create their tables as that role).
pub const MANAGED_DATABASE: &str = "reports";
pub const MANAGED_OWNER: &str = "reports";
pub const MANAGED_SCHEMA: &str = "public";
/// Port of the operator's PostgreSQL Service.
pub const MANAGED_PORT: u16 = 5432;
/// How long the operator waits for its PostgreSQL to accept a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the grants are about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoleSql<'a> {
    /// The read-only role (created when missing).
    pub role: &'a str,
    /// Its password; `None` leaves the password as it is.
    pub password: Option<&'a str>,
    /// The server's database.
    pub database: &'a str,
    /// The server's schema (`public` unless the server's URL sets a search path).
    pub schema: &'a str,
    /// The role the server connects as, which creates the tables and views in its migrations.
    pub owner: &'a str,
    /// Also revoke `CREATE` on the schema from `PUBLIC` (PostgreSQL ≤ 14 grants it). Only
    /// where nobody else relies on it: the operator's own PostgreSQL.
    pub revoke_public_create: bool,
}

/// A quoted identifier: `"name"`, inner quotes doubled.
pub fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A quoted string literal: `'text'`, inner quotes doubled (standard_conforming_strings, the
/// default since PostgreSQL 9.1, takes backslashes literally).
pub fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The statements that give `sql.role` read-only access, each idempotent, in order; run them
/// in one transaction as the owner or a superuser (a role with `CREATEROLE` that is a member of
/// the owner role will do).
pub fn statements(sql: &RoleSql<'_>) -> Vec<String> {
    let role = ident(sql.role);
    let schema = ident(sql.schema);
    let mut out = vec![
        // CREATE ROLE has no IF NOT EXISTS; a new role has no rights but LOGIN.
        format!(
            "DO $do$ BEGIN IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = {}) \
             THEN CREATE ROLE {role} LOGIN; END IF; END $do$",
            literal(sql.role)
        ),
    ];
    match sql.password {
        Some(password) => out.push(format!(
            "ALTER ROLE {role} WITH LOGIN PASSWORD {}",
            literal(password)
        )),
        None => out.push(format!("ALTER ROLE {role} WITH LOGIN")),
    }
    out.extend([
        format!("ALTER ROLE {role} SET default_transaction_read_only = on"),
        format!(
            "GRANT CONNECT ON DATABASE {} TO {role}",
            ident(sql.database)
        ),
        format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
        format!("GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}"),
        format!(
            "ALTER DEFAULT PRIVILEGES FOR ROLE {} IN SCHEMA {schema} GRANT SELECT ON TABLES TO {role}",
            ident(sql.owner)
        ),
    ]);
    if sql.revoke_public_create {
        out.push(format!("REVOKE CREATE ON SCHEMA {schema} FROM PUBLIC"));
    }
    out
}

/// The statements that remove the role again (the option turned off): its privileges and
/// default privileges in this database, then the role. Idempotent.
pub fn drop_statements(role: &str) -> Vec<String> {
    let quoted = ident(role);
    vec![format!(
        "DO $do$ BEGIN IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = {}) \
         THEN DROP OWNED BY {quoted}; DROP ROLE {quoted}; END IF; END $do$",
        literal(role)
    )]
}

/// What the error of [`managed_statements`] without a password says when the role is missing
/// (dropped by hand): the operator then runs them again with the password.
pub const ROLE_MISSING: &str = "reports-server: the read-only role is missing";

/// The statements the operator runs on its own PostgreSQL, as its superuser. With `password`
/// `None` (the role has the Secret's password already) no statement carries the password, so
/// that it reaches PostgreSQL's statement log at most once per password; a role that does not
/// exist then fails the transaction with [`ROLE_MISSING`] instead of being created without one.
/// Attributes given by hand (`SUPERUSER`, `CREATEDB`, `CREATEROLE`, `REPLICATION`, `BYPASSRLS`)
/// are taken away again.
pub fn managed_statements(password: Option<&str>) -> Vec<String> {
    operator_statements(&RoleSql {
        role: ROLE,
        password,
        database: MANAGED_DATABASE,
        schema: MANAGED_SCHEMA,
        owner: MANAGED_OWNER,
        revoke_public_create: true,
    })
}

/// [`managed_statements`] for any names (run as a superuser): `tests/tests/analytics_role.rs`
/// runs them on a real PostgreSQL under a role name of its own.
pub fn operator_statements(sql: &RoleSql<'_>) -> Vec<String> {
    let mut out = statements(sql);
    if sql.password.is_none() {
        out[0] = format!(
            "DO $do$ BEGIN IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = {}) \
             THEN RAISE EXCEPTION {}; END IF; END $do$",
            literal(sql.role),
            literal(ROLE_MISSING)
        );
    }
    out.insert(
        2,
        format!(
            "ALTER ROLE {} WITH NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS",
            ident(sql.role)
        ),
    );
    out
}

/// The SQL script docs/analytics-access.md shows for someone else's PostgreSQL, with its example
/// names (`reports` database, schema `public`, server role `reports`); `operator/tests` checks
/// the page holds exactly this.
pub fn documented_script() -> String {
    let mut out = String::new();
    for statement in statements(&RoleSql {
        role: ROLE,
        password: Some("change-me"),
        database: MANAGED_DATABASE,
        schema: MANAGED_SCHEMA,
        owner: MANAGED_OWNER,
        revoke_public_create: false,
    }) {
        writeln!(out, "{statement};").expect("writing to a String");
    }
    out
}

/// Where and as whom to connect.
#[derive(Clone, PartialEq, Eq)]
pub struct Connection {
    pub host: String,
    pub port: u16,
    pub database: String,
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password: this lands in logs.
        write!(
            f,
            "{}@{}:{}/{}",
            self.user, self.host, self.port, self.database
        )
    }
}

impl Connection {
    /// A `postgres://` URL (user and password percent-encoded).
    pub fn uri(&self) -> String {
        format!(
            "postgres://{}:{}@{}:{}/{}",
            encode(&self.user),
            encode(&self.password),
            self.host,
            self.port,
            encode(&self.database)
        )
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn encode(text: &str) -> String {
    let mut out = String::new();
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            write!(out, "%{b:02X}").expect("writing to a String");
        }
    }
    out
}

/// The keys of the analysts' Secret: the connection's parts, a `postgres://` URL, and the same
/// URL under the variable `reports-server query` reads (so `envFrom` is enough).
pub fn secret_data(connection: &Connection) -> Value {
    let uri = connection.uri();
    json!({
        "host": connection.host,
        "port": connection.port.to_string(),
        "database": connection.database,
        "username": connection.user,
        "password": connection.password,
        "uri": uri,
        "REPORTS_SERVER_DATABASE_URL": uri,
    })
}

/// The analysts' Secret as created (`stringData`), with `metadata` naming and owning it.
pub fn secret(metadata: Value, connection: &Connection) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "stringData": secret_data(connection),
    })
}

/// Runs statements in one transaction on a PostgreSQL. A trait so that the reconciler is tested
/// without a database; [`PostgresRunner`] is the real one.
pub trait SqlRunner: Send + Sync {
    /// Runs `statements` in order in one transaction; the error says what failed, never with
    /// the password.
    fn run<'a>(
        &'a self,
        connection: &'a Connection,
        statements: &'a [String],
    ) -> BoxFuture<'a, Result<(), String>>;
}

/// [`SqlRunner`] over a fresh sqlx connection (no pool: a handful of statements every few
/// minutes at most).
#[derive(Clone, Copy, Debug, Default)]
pub struct PostgresRunner;

impl SqlRunner for PostgresRunner {
    fn run<'a>(
        &'a self,
        connection: &'a Connection,
        statements: &'a [String],
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            use sqlx::Connection as _;
            let options = sqlx::postgres::PgConnectOptions::new()
                .host(&connection.host)
                .port(connection.port)
                .database(&connection.database)
                .username(&connection.user)
                .password(&connection.password)
                // The operator's own PostgreSQL in the same namespace serves no TLS.
                .ssl_mode(sqlx::postgres::PgSslMode::Disable)
                .application_name("reports-server-operator");
            let mut conn =
                tokio::time::timeout(CONNECT_TIMEOUT, sqlx::PgConnection::connect_with(&options))
                    .await
                    .map_err(|_| {
                        format!("no connection to {connection:?} within {CONNECT_TIMEOUT:?}")
                    })?
                    .map_err(|e| format!("connecting to {connection:?}: {e}"))?;
            let mut tx = conn.begin().await.map_err(|e| e.to_string())?;
            for statement in statements {
                sqlx::raw_sql(sqlx::AssertSqlSafe(statement.as_str()))
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| format!("{}: {e}", redact(statement)))?;
            }
            tx.commit().await.map_err(|e| e.to_string())?;
            conn.close().await.ok();
            Ok(())
        })
    }
}

/// A statement as it may be logged: a password literal replaced.
fn redact(statement: &str) -> String {
    match statement.find(" PASSWORD '") {
        Some(at) => format!("{} PASSWORD '…'", &statement[..at]),
        None => statement.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_managed_statements_grant_reading_only() {
        let all = managed_statements(Some("pw")).join(";\n");
        for wanted in [
            "CREATE ROLE \"reports_analytics\" LOGIN",
            "ALTER ROLE \"reports_analytics\" WITH LOGIN PASSWORD 'pw'",
            "ALTER ROLE \"reports_analytics\" SET default_transaction_read_only = on",
            "GRANT CONNECT ON DATABASE \"reports\" TO \"reports_analytics\"",
            "GRANT USAGE ON SCHEMA \"public\" TO \"reports_analytics\"",
            "GRANT SELECT ON ALL TABLES IN SCHEMA \"public\" TO \"reports_analytics\"",
            "ALTER DEFAULT PRIVILEGES FOR ROLE \"reports\" IN SCHEMA \"public\" GRANT SELECT ON TABLES TO \"reports_analytics\"",
            "REVOKE CREATE ON SCHEMA \"public\" FROM PUBLIC",
        ] {
            assert!(all.contains(wanted), "{wanted} missing from {all}");
        }
        assert!(all.contains(
            "ALTER ROLE \"reports_analytics\" WITH NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"
        ));
        let granted = all.replace(
            " WITH NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS",
            "",
        );
        for never in [
            "INSERT",
            "UPDATE",
            "DELETE",
            "TRUNCATE",
            "SUPERUSER",
            "CREATEDB",
            "CREATEROLE",
            "BYPASSRLS",
            "ALL PRIVILEGES",
        ] {
            assert!(!granted.contains(never), "{never} in {all}");
        }
    }

    #[test]
    fn without_a_password_a_missing_role_is_an_error_not_a_role_without_one() {
        let sql = managed_statements(None);
        assert!(!sql.iter().any(|s| s.contains("PASSWORD")), "{sql:#?}");
        assert!(!sql.iter().any(|s| s.contains("CREATE ROLE")), "{sql:#?}");
        assert!(
            sql[0].contains(&format!("RAISE EXCEPTION '{ROLE_MISSING}'")),
            "{sql:#?}"
        );
        assert_eq!(
            sql[1..],
            managed_statements(Some("pw"))[1..]
                .iter()
                .map(|s| { s.replace(" PASSWORD 'pw'", "") })
                .collect::<Vec<_>>()[..]
        );
    }

    #[test]
    fn names_and_passwords_are_quoted() {
        let sql = statements(&RoleSql {
            role: "a\"b",
            password: Some("it's"),
            database: "d\"b",
            schema: "s",
            owner: "o",
            revoke_public_create: false,
        });
        assert!(
            sql.iter()
                .any(|s| s.contains("CREATE ROLE \"a\"\"b\" LOGIN"))
        );
        assert!(sql.iter().any(|s| s.contains("rolname = 'a\"b'")));
        assert!(sql.iter().any(|s| s.ends_with("PASSWORD 'it''s'")));
        assert!(sql.iter().any(|s| s.contains("DATABASE \"d\"\"b\"")));
        assert!(!sql.iter().any(|s| s.contains("REVOKE")));
    }

    #[test]
    fn no_password_keeps_the_password() {
        let sql = statements(&RoleSql {
            role: ROLE,
            password: None,
            database: "reports",
            schema: "public",
            owner: "reports",
            revoke_public_create: false,
        });
        assert!(!sql.iter().any(|s| s.contains("PASSWORD")), "{sql:#?}");
    }

    #[test]
    fn a_failed_statement_is_reported_without_the_password() {
        assert_eq!(
            redact("ALTER ROLE \"x\" WITH LOGIN PASSWORD 'secret'"),
            "ALTER ROLE \"x\" WITH LOGIN PASSWORD '…'"
        );
        let c = Connection {
            host: "h".into(),
            port: 5432,
            database: "d".into(),
            user: "u".into(),
            password: "secret".into(),
        };
        assert!(!format!("{c:?}").contains("secret"));
    }

    /// docs/analytics-access.md shows exactly [`documented_script`] (the SQL
    /// `tests/tests/analytics_role.rs` runs); `UPDATE_GENERATED=1` rewrites the block.
    #[test]
    fn the_documented_sql_is_the_tested_sql() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/analytics-access.md");
        let text = std::fs::read_to_string(&path).unwrap();
        let (begin, end) = (
            "<!-- read-only-role:begin -->\n```sql\n",
            "```\n<!-- read-only-role:end -->",
        );
        let start = text.find(begin).expect("the begin marker") + begin.len();
        let stop = text.find(end).expect("the end marker");
        let script = documented_script();
        if std::env::var_os("UPDATE_GENERATED").is_some() {
            std::fs::write(
                &path,
                format!("{}{script}{}", &text[..start], &text[stop..]),
            )
            .unwrap();
            return;
        }
        assert_eq!(
            &text[start..stop],
            script,
            "docs/analytics-access.md's SQL is stale; run `UPDATE_GENERATED=1 cargo test -p reports-server-operator --lib analytics`"
        );
    }

    #[test]
    fn the_secret_holds_a_ready_url() {
        let c = Connection {
            host: "rs-postgres.ns.svc".into(),
            port: 5432,
            database: "reports".into(),
            user: ROLE.into(),
            password: "p@ss/word".into(),
        };
        let data = secret_data(&c);
        assert_eq!(
            data["uri"],
            "postgres://reports_analytics:p%40ss%2Fword@rs-postgres.ns.svc:5432/reports"
        );
        assert_eq!(data["REPORTS_SERVER_DATABASE_URL"], data["uri"]);
        for key in ["host", "port", "database", "username", "password"] {
            assert!(data[key].is_string(), "{key}");
        }
    }
}
