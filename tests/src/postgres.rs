//! A real PostgreSQL for tests: the one named by `DATABASE_URL` (a `postgres://` URL), or a
//! throwaway cluster started with Debian's `initdb`/`pg_ctl` on a free loopback port. Each
//! caller gets a fresh database in it. A test that stops and starts its database (an outage)
//! owns a cluster of its own instead: [`OwnedPostgres`].

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use anyhow::{Context, bail, ensure};

struct Cluster {
    /// `postgres://user@127.0.0.1:port` without a database.
    base_url: String,
    /// The cluster this process started; `None` when `DATABASE_URL` names one.
    instance: Option<Instance>,
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

/// One PostgreSQL cluster of this process: a data directory under the temp dir and the port
/// it serves on, which stays the same across stops so that URLs handed out keep working.
struct Instance {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
}

impl Instance {
    /// `initdb` into a new directory (not started yet).
    fn create(label: &str) -> anyhow::Result<Instance> {
        let bin = pg_bin()?;
        let dir = std::env::temp_dir().join(format!(
            "reports-server-pg-{label}{}-{}",
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
        let out = as_postgres(
            &bin.join("initdb"),
            &[
                "-D",
                dir.to_str().unwrap(),
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
            let _ = std::fs::remove_dir_all(&dir);
            bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(Instance {
            bin,
            dir,
            port: free_port(),
        })
    }

    /// `pg_ctl start`, waiting until it accepts connections.
    fn start(&self) -> anyhow::Result<()> {
        let d = self.dir.to_str().unwrap();
        let opts = format!(
            "-p {} -k {d} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300 -c shared_buffers=128MB",
            self.port
        );
        let out = as_postgres(
            &self.bin.join("pg_ctl"),
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
            let log = std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
            bail!(
                "pg_ctl start failed: {}\n{log}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// `pg_ctl stop -m immediate`: connections are cut at once, as when the database host dies.
    fn stop(&self) -> anyhow::Result<()> {
        let out = as_postgres(
            &self.bin.join("pg_ctl"),
            &[
                "-D",
                self.dir.to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
        )
        .output()?;
        if !out.status.success() {
            bail!(
                "pg_ctl stop failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    fn base_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    /// Stops it (if running) and removes its directory.
    fn discard(&self) {
        let _ = self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

extern "C" fn stop_cluster() {
    if let Some(Ok(Cluster {
        instance: Some(instance),
        ..
    })) = CLUSTER.get()
    {
        instance.discard();
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
            instance: None,
        });
    }
    let instance = Instance::create("")?;
    if let Err(e) = instance.start() {
        instance.discard();
        return Err(e);
    }
    unsafe { libc::atexit(stop_cluster) };
    Ok(Cluster {
        base_url: instance.base_url(),
        instance: Some(instance),
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
    psql(
        &format!("{}/postgres", cluster.base_url),
        &format!("CREATE DATABASE {name}"),
    )?;
    Ok(format!("{}/{name}", cluster.base_url))
}

/// Runs `statement` with psql on the database `url` names; returns its unaligned output (one
/// line per row, `|` between columns).
pub fn psql(url: &str, statement: &str) -> anyhow::Result<String> {
    let psql = which("psql").context("psql not found: apt-get install -y postgresql-client")?;
    let out = Command::new(psql)
        .args([url, "-v", "ON_ERROR_STOP=1", "-Atc", statement])
        .output()?;
    if !out.status.success() {
        bail!(
            "psql -c {statement:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A PostgreSQL cluster of one test's own, which the test may stop and start again (a database
/// outage) without touching the databases of the tests beside it. Always a local throwaway
/// cluster, even when `DATABASE_URL` names a server: a test cannot stop a server it does not
/// own. Stopped and removed on drop.
pub struct OwnedPostgres {
    instance: Instance,
    /// Directories of clusters this one replaced ([`Self::become_standby`]), removed on drop.
    replaced: Vec<PathBuf>,
}

impl OwnedPostgres {
    /// Initialises and starts a cluster on a free loopback port.
    pub fn start() -> anyhow::Result<Self> {
        let instance = Instance::create("owned-")?;
        // Dropping `owned` on a failed start removes the directory.
        let owned = OwnedPostgres {
            instance,
            replaced: Vec::new(),
        };
        owned.instance.start()?;
        Ok(owned)
    }

    /// The URL of its `postgres` database; the same before and after a stop.
    pub fn url(&self) -> String {
        format!("{}/postgres", self.instance.base_url())
    }

    /// Stops it at once (`pg_ctl -m immediate`): open connections are cut and new ones refused.
    pub fn stop(&self) -> anyhow::Result<()> {
        self.instance.stop()
    }

    /// Starts it again on the same port and data, waiting until it accepts connections.
    pub fn start_again(&self) -> anyhow::Result<()> {
        self.instance.start()
    }

    /// What a server sees when, after a failover, its database address leads to a standby: a
    /// copy of this cluster (`pg_basebackup -R`, so everything committed so far) replaces it on
    /// the same port and starts in recovery, read-only, with no primary to follow. The original
    /// is stopped at once.
    pub fn become_standby(&mut self) -> anyhow::Result<()> {
        let dir = self.instance.dir.with_extension("standby");
        std::fs::create_dir_all(&dir)?;
        let dir_text = dir.to_str().context("standby directory path")?;
        if unsafe { libc::geteuid() } == 0 {
            let status = Command::new("chown")
                .args(["postgres:postgres", dir_text])
                .status()?;
            ensure!(status.success(), "chown {dir_text} to postgres");
        }
        let source = format!("host=127.0.0.1 port={} user=postgres", self.instance.port);
        let backup = self.instance.bin.join("pg_basebackup");
        let out = as_postgres(
            &backup,
            &[
                "-D", dir_text, "-R", "-X", "stream", "-c", "fast", "-d", &source,
            ],
        )
        .output()?;
        ensure!(
            out.status.success(),
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // No upstream: the standby must stay one, not follow (or stream from) itself.
        let auto_conf = dir.join("postgresql.auto.conf");
        let kept: String = std::fs::read_to_string(&auto_conf)?
            .lines()
            .filter(|l| !l.starts_with("primary_conninfo"))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&auto_conf, kept)?;
        // The original's socket lock (its sockets live in its data directory) came along.
        for entry in std::fs::read_dir(&dir)?.flatten() {
            if entry.file_name().to_string_lossy().starts_with(".s.PGSQL") {
                std::fs::remove_file(entry.path())?;
            }
        }
        // PostgreSQL refuses a data directory others may read.
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        self.instance.stop()?;
        self.replaced
            .push(std::mem::replace(&mut self.instance.dir, dir));
        self.instance.start()
    }

    /// Promotes a standby made by [`Self::become_standby`] to primary, waiting until it is one.
    pub fn promote(&self) -> anyhow::Result<()> {
        let ctl = self.instance.bin.join("pg_ctl");
        let dir = self.instance.dir.to_str().context("data directory path")?;
        let out = as_postgres(&ctl, &["-D", dir, "-w", "promote"]).output()?;
        ensure!(
            out.status.success(),
            "pg_ctl promote failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// Runs `statement` with psql as the superuser; returns its unaligned output (one line per
    /// row, `|` between columns).
    pub fn sql(&self, statement: &str) -> anyhow::Result<String> {
        psql(&self.url(), statement)
    }

    /// Freezes every process of the cluster (SIGSTOP): open connections and new ones get no
    /// answer and no reset, as from a database behind a network that drops its packets. The
    /// kernel still completes TCP handshakes, so it is the hang after connecting that clients
    /// see, which only a client-side deadline ends.
    pub fn freeze(&self) -> anyhow::Result<()> {
        self.signal_all(libc::SIGSTOP)
    }

    /// Undoes [`Self::freeze`].
    pub fn thaw(&self) -> anyhow::Result<()> {
        self.signal_all(libc::SIGCONT)
    }

    /// Sends `signal` to the postmaster and every process it started.
    fn signal_all(&self, signal: i32) -> anyhow::Result<()> {
        let pid_file = self.instance.dir.join("postmaster.pid");
        let postmaster: i32 = std::fs::read_to_string(&pid_file)
            .with_context(|| format!("read {}", pid_file.display()))?
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .context("postmaster.pid without a pid")?;
        let mut pids = vec![postmaster];
        for entry in std::fs::read_dir("/proc")?.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            // `pid (comm) state ppid …`: the command may hold spaces, the part after ')' not.
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<i32>().ok());
            if ppid == Some(postmaster) {
                pids.push(pid);
            }
        }
        for pid in pids {
            // SAFETY: kill(2) with a pid read from this cluster's own files.
            if unsafe { libc::kill(pid, signal) } != 0 {
                bail!("kill({pid}, {signal}): {}", std::io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

impl Drop for OwnedPostgres {
    fn drop(&mut self) {
        // A frozen cluster would not stop: thaw it first (a no-op when it runs or is stopped).
        let _ = self.thaw();
        self.instance.discard();
        for dir in &self.replaced {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

pub(crate) fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(program))
        .find(|p| p.exists())
}
