//! A real MariaDB for tests: the server named by `MYSQL_DATABASE_URL` (a `mysql://` URL of an
//! account that may create databases and users, e.g. `mysql://root:secret@127.0.0.1:3306`), or a
//! throwaway `mariadbd` started from Debian's `mariadb-server` package in a temp directory on a
//! free loopback port. Each caller gets a fresh database and an account of its own, allowed on
//! that database only, so that a test can cut its server off (see [`lock_out`]) without touching
//! the tests beside it.
//!
//! The throwaway server runs with the character set Debian's package configures
//! (`utf8mb4`, `utf8mb4_general_ci`: case-insensitive, as MySQL 8's default is too), not the
//! compiled-in `latin1`, so that the store meets what an operator's server has.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The environment variable naming an existing server to use instead of a throwaway one.
pub const URL_VARIABLE: &str = "MYSQL_DATABASE_URL";

const INSTALL_HINT: &str = "install them with `apt-get install -y mariadb-server` (or set MYSQL_DATABASE_URL=mysql://USER:PASSWORD@HOST:PORT to use a running server)";

struct Server {
    /// `mysql://root@127.0.0.1:port` (or the configured account) without a database.
    admin_url: String,
    /// `host:port` as the per-test URLs name it.
    address: String,
    /// The server this process started; `None` when `MYSQL_DATABASE_URL` names one.
    instance: Option<Instance>,
}

static SERVER: OnceLock<Result<Server, String>> = OnceLock::new();
static COUNTER: Mutex<u32> = Mutex::new(0);

/// A `mariadbd` of this process: its directory (data, socket, log) and the child process.
struct Instance {
    dir: PathBuf,
    child: Mutex<Child>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Redo log size for install and server: the 96 MiB default is disk the tests do not need.
const REDO_LOG: &str = "--innodb-log-file-size=16M";

impl Instance {
    /// `mariadb-install-db` into a new directory, then `mariadbd` on a free loopback port,
    /// waiting until it accepts connections.
    fn start() -> anyhow::Result<(Instance, u16)> {
        let server = Path::new("/usr/sbin/mariadbd");
        let install = super::postgres::which("mariadb-install-db")
            .filter(|_| server.exists())
            .with_context(|| format!("MariaDB server binaries not found: {INSTALL_HINT}"))?;
        let dir = std::env::temp_dir().join(format!(
            "reports-server-mariadb-{}-{}",
            std::process::id(),
            free_port()
        ));
        let data = dir.join("data");
        std::fs::create_dir_all(&data)?;
        // A temp directory of its own: mariadbd deletes every `#sql*` file of its temp
        // directory when it starts, so in a shared `/tmp` one test's server starting removes
        // another's internal temp tables under it ("Error on delete of '/tmp/#sql-temptable-…'").
        let tmp = dir.join("tmp");
        std::fs::create_dir_all(&tmp)?;
        // mariadbd refuses to run as root; as root we hand it to the package's `mysql` user,
        // which `--user` makes it switch to.
        let user: &[&str] = if is_root() {
            let status = Command::new("chown")
                .args(["-R", "mysql:mysql", dir.to_str().unwrap()])
                .status()?;
            if !status.success() {
                let _ = std::fs::remove_dir_all(&dir);
                bail!(
                    "cannot chown {} to mysql (is the mysql user present? {INSTALL_HINT})",
                    dir.display()
                );
            }
            &["--user=mysql"]
        } else {
            &[]
        };
        let datadir = format!("--datadir={}", data.display());
        let tmpdir = format!("--tmpdir={}", tmp.display());
        let out = Command::new(install)
            .args(["--no-defaults", &datadir, &tmpdir])
            .args(user)
            // Passwordless root on the loopback addresses: a throwaway server, no test database.
            .args([
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                REDO_LOG,
            ])
            .output()?;
        if !out.status.success() {
            let _ = std::fs::remove_dir_all(&dir);
            bail!(
                "mariadb-install-db failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let port = free_port();
        let child = Command::new(server)
            .arg("--no-defaults")
            .arg(&datadir)
            .args(user)
            .arg(format!("--socket={}", dir.join("sock").display()))
            .arg(format!("--pid-file={}", dir.join("pid").display()))
            .arg(format!("--log-error={}", dir.join("error.log").display()))
            .arg(&tmpdir)
            .arg(format!("--port={port}"))
            .args([
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                "--skip-log-bin",
                "--character-set-server=utf8mb4",
                "--collation-server=utf8mb4_general_ci",
                // Throwaway data: no flush per commit, as PostgreSQL's fsync=off.
                "--innodb-flush-log-at-trx-commit=0",
                "--innodb-doublewrite=0",
                "--max-connections=1000",
                REDO_LOG,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start mariadbd")?;
        let instance = Instance {
            dir,
            child: Mutex::new(child),
        };
        if let Err(e) = instance.wait_until_listening(port) {
            instance.discard();
            return Err(e);
        }
        Ok((instance, port))
    }

    /// Waits until `port` accepts connections; fails with the server's log if it exits first.
    fn wait_until_listening(&self, port: u16) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(());
            }
            let exited = self.child.lock().unwrap().try_wait()?;
            if exited.is_some() || Instant::now() > deadline {
                let log = std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default();
                bail!("mariadbd did not start ({exited:?}):\n{log}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills the server (its data is thrown away) and removes its directory.
    fn discard(&self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

extern "C" fn stop_server() {
    if let Some(Ok(Server {
        instance: Some(instance),
        ..
    })) = SERVER.get()
    {
        instance.discard();
    }
}

/// `(scheme://, user:password, host:port)` of a URL `scheme://[user[:password]@]host:port[/…]`.
fn split_url(url: &str) -> anyhow::Result<(&str, &str, &str)> {
    let (scheme, rest) = url
        .split_once("://")
        .with_context(|| format!("{URL_VARIABLE}={url:?} is not a URL"))?;
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let (credentials, address) = authority.rsplit_once('@').unwrap_or(("", authority));
    Ok((&url[..scheme.len() + 3], credentials, address))
}

fn start_server() -> anyhow::Result<Server> {
    if let Ok(url) = std::env::var(URL_VARIABLE) {
        let (scheme, credentials, address) = split_url(&url)?;
        let at = if credentials.is_empty() { "" } else { "@" };
        return Ok(Server {
            admin_url: format!("{scheme}{credentials}{at}{address}"),
            address: address.to_owned(),
            instance: None,
        });
    }
    let (instance, port) = Instance::start()?;
    // SAFETY: registers a plain function; it only touches the `SERVER` static.
    unsafe { libc::atexit(stop_server) };
    let address = format!("127.0.0.1:{port}");
    Ok(Server {
        admin_url: format!("mysql://root@{address}"),
        address,
        instance: Some(instance),
    })
}

fn server() -> anyhow::Result<&'static Server> {
    match SERVER.get_or_init(|| start_server().map_err(|e| format!("{e:#}"))) {
        Ok(server) => Ok(server),
        Err(e) => bail!("no MariaDB for the tests: {e}"),
    }
}

/// Runs `statements` in order on one connection as the server's administrator. Blocking: the
/// callers (URL factories, tests between requests) are synchronous, so the statements run on a
/// runtime of their own in a thread of their own.
pub fn admin(statements: &[String]) -> anyhow::Result<()> {
    let url = server()?.admin_url.clone();
    let run = async move {
        use sea_orm::ConnectionTrait;
        let mut options = sea_orm::ConnectOptions::new(url);
        options
            .max_connections(1)
            .connect_timeout(Duration::from_secs(30))
            .sqlx_logging(false);
        let db = sea_orm::Database::connect(options)
            .await
            .context("connect to MariaDB as its administrator")?;
        for statement in statements {
            db.execute_unprepared(statement)
                .await
                .with_context(|| format!("MariaDB: {statement}"))?;
        }
        db.close().await?;
        Ok(())
    };
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
                    .block_on(run)
            })
            .join()
            .expect("the MariaDB admin thread panicked")
    })
}

/// A fresh, empty database on the test MariaDB and an account allowed on it alone; returns the
/// URL that account connects with.
pub fn fresh_database() -> anyhow::Result<String> {
    let server = server()?;
    let n = {
        let mut c = COUNTER.lock().unwrap();
        *c += 1;
        *c
    };
    let name = format!(
        "rs_test_{}_{}_{n}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .subsec_nanos()
    );
    // Account names stop at 80 characters; a test's database name stays well below that.
    admin(&[
        format!("CREATE DATABASE {name}"),
        format!("CREATE USER '{name}'@'%' IDENTIFIED BY '{name}'"),
        format!("GRANT ALL PRIVILEGES ON {name}.* TO '{name}'@'%'"),
    ])?;
    Ok(format!("mysql://{name}:{name}@{}/{name}", server.address))
}

/// What a server sees when its database goes away: the account of `database_url` (one made by
/// [`fresh_database`]) is locked, so new connections are refused, and its open connections are
/// cut. [`let_in`] undoes it.
pub fn lock_out(database_url: &str) -> anyhow::Result<()> {
    let user = account_of(database_url)?;
    admin(&[
        format!("ALTER USER '{user}'@'%' ACCOUNT LOCK"),
        format!("KILL CONNECTION USER '{user}'"),
    ])
}

/// Undoes [`lock_out`]: the account may connect again.
pub fn let_in(database_url: &str) -> anyhow::Result<()> {
    let user = account_of(database_url)?;
    admin(&[format!("ALTER USER '{user}'@'%' ACCOUNT UNLOCK")])
}

fn account_of(database_url: &str) -> anyhow::Result<&str> {
    let (_, credentials, _) = split_url(database_url)?;
    let user = credentials.split(':').next().unwrap_or_default();
    if !user.starts_with("rs_test_") {
        bail!("{database_url} is not a URL made by mariadb::fresh_database");
    }
    Ok(user)
}

#[cfg(test)]
mod tests {
    use super::split_url;

    #[test]
    fn urls_split_into_scheme_credentials_and_address() {
        assert_eq!(
            split_url("mysql://root:pw@db:3306/x?ssl-mode=disabled").unwrap(),
            ("mysql://", "root:pw", "db:3306")
        );
        assert_eq!(
            split_url("mariadb://127.0.0.1:3306").unwrap(),
            ("mariadb://", "", "127.0.0.1:3306")
        );
    }
}
