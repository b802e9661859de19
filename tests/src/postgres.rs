//! A real PostgreSQL for tests: the one named by `DATABASE_URL` (a `postgres://` URL), or a
//! throwaway cluster started with Debian's `initdb`/`pg_ctl` on a free loopback port. Each
//! caller gets a fresh database in it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use anyhow::{Context, bail};

struct Cluster {
    /// `postgres://user@127.0.0.1:port` without a database.
    base_url: String,
    data_dir: Option<PathBuf>,
    bin: PathBuf,
}

static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();
static COUNTER: Mutex<u32> = Mutex::new(0);

fn pg_bin() -> anyhow::Result<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    candidates.sort();
    candidates
        .into_iter()
        .rev()
        .find(|p| p.join("initdb").exists())
        .context("PostgreSQL server binaries not found: install them with `apt-get install -y postgresql` (or set PG_BIN, or DATABASE_URL=postgres://… to use a running server)")
}

/// Runs a command as the `postgres` user when we are root (initdb refuses to run as root).
fn as_postgres(program: &Path, args: &[&str]) -> Command {
    if unsafe { libc::geteuid() } == 0 {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program).args(args);
        c
    } else {
        let mut c = Command::new(program);
        c.args(args);
        c
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

extern "C" fn stop_cluster() {
    if let Some(Ok(Cluster {
        data_dir: Some(dir),
        bin,
        ..
    })) = CLUSTER.get()
    {
        let _ = as_postgres(
            &bin.join("pg_ctl"),
            &["-D", dir.to_str().unwrap(), "-m", "immediate", "-w", "stop"],
        )
        .output();
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn start_cluster() -> anyhow::Result<Cluster> {
    if let Ok(url) = std::env::var("DATABASE_URL")
        && url.starts_with("postgres")
    {
        let base = url
            .rsplit_once('/')
            .map(|(b, _)| b.to_owned())
            .unwrap_or(url);
        return Ok(Cluster {
            base_url: base,
            data_dir: None,
            bin: pg_bin().unwrap_or_default(),
        });
    }
    let bin = pg_bin()?;
    let dir = std::env::temp_dir().join(format!(
        "reports-server-pg-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir)?;
    if unsafe { libc::geteuid() } == 0 {
        let status = Command::new("chown")
            .args(["postgres:postgres", dir.to_str().unwrap()])
            .status()?;
        if !status.success() {
            bail!(
                "cannot chown {} to postgres (is the postgres user present? apt-get install -y postgresql)",
                dir.display()
            );
        }
    }
    let d = dir.to_str().unwrap();
    let out = as_postgres(
        &bin.join("initdb"),
        &[
            "-D",
            d,
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ],
    )
    .output()?;
    if !out.status.success() {
        bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let port = free_port();
    let opts = format!(
        "-p {port} -k {d} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300 -c shared_buffers=128MB"
    );
    let out = as_postgres(
        &bin.join("pg_ctl"),
        &[
            "-D",
            d,
            "-o",
            &opts,
            "-l",
            &format!("{d}/log"),
            "-w",
            "-t",
            "60",
            "start",
        ],
    )
    .output()?;
    if !out.status.success() {
        let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
        bail!(
            "pg_ctl start failed: {}\n{log}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    unsafe { libc::atexit(stop_cluster) };
    Ok(Cluster {
        base_url: format!("postgres://postgres@127.0.0.1:{port}"),
        data_dir: Some(dir),
        bin,
    })
}

/// A fresh, empty database on the test PostgreSQL; returns its URL.
pub fn fresh_database() -> anyhow::Result<String> {
    let cluster = CLUSTER.get_or_init(|| start_cluster().map_err(|e| format!("{e:#}")));
    let cluster = match cluster {
        Ok(c) => c,
        Err(e) => bail!("no PostgreSQL for the tests: {e}"),
    };
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
    let admin = format!("{}/postgres", cluster.base_url);
    let psql = which("psql").context("psql not found: apt-get install -y postgresql-client")?;
    let out = Command::new(psql)
        .args([
            &admin,
            "-v",
            "ON_ERROR_STOP=1",
            "-qc",
            &format!("CREATE DATABASE {name}"),
        ])
        .output()?;
    if !out.status.success() {
        bail!(
            "CREATE DATABASE failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(format!("{}/{name}", cluster.base_url))
}

pub(crate) fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(program))
        .find(|p| p.exists())
}
