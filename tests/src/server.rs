//! The real `reports-server` binary as a child process: start, wait for readiness, kill,
//! restart on the same data. Used by the HTTP, kubectl and restart tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// Builds (once per test process) and returns the `reports-server` binary.
pub fn binary() -> anyhow::Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| {
        // A prebuilt binary (e.g. `cargo build --bin reports-server` once in CI): the tests then
        // run even while some unrelated test target of the workspace does not compile.
        if let Some(path) = std::env::var_os("REPORTS_SERVER_BIN") {
            let path = PathBuf::from(path);
            return if path.exists() {
                Ok(path)
            } else {
                Err(format!(
                    "REPORTS_SERVER_BIN={} does not exist; build it with `cargo build --bin reports-server`",
                    path.display()
                ))
            };
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let root = crate::controlplane::workspace_root();
        // Same package selection and targets as `cargo test --workspace`, so features unify the
        // same way and this is a no-op after the test build instead of a second dependency build.
        let out = Command::new(cargo)
            .args([
                "build",
                "--quiet",
                "--workspace",
                "--all-targets",
                "--message-format",
                "short",
            ])
            .current_dir(&root)
            .output()
            .map_err(|e| format!("cannot run cargo to build reports-server: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "cargo build --bin reports-server failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        // The test binary lives in <target>/debug/deps; the server next to deps.
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let bin = exe
            .parent()
            .and_then(Path::parent)
            .map(|d| d.join("reports-server"))
            .ok_or("no target dir")?;
        if !bin.exists() {
            return Err(format!("{} missing after build", bin.display()));
        }
        Ok(bin)
    })
    .clone()
    .map_err(|e| anyhow::anyhow!(e))
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running server process.
pub struct ServerProcess {
    pub data_dir: PathBuf,
    pub database_url: String,
    pub port: u16,
    pub kubeconfig: PathBuf,
    pub extra_args: Vec<String>,
    /// A command the server is started through (its arguments follow), e.g. `unshare … sh -c`
    /// to give it a mount of its own; empty: started directly.
    pub launcher: Vec<String>,
    child: Option<Child>,
    log: PathBuf,
}

impl ServerProcess {
    /// Starts a server on a free port with its own data directory; `database_url` `None` means the
    /// embedded SQLite file.
    pub async fn start(data_dir: &Path, database_url: Option<String>) -> anyhow::Result<Self> {
        Self::start_with(data_dir, database_url, &[]).await
    }

    pub async fn start_with(
        data_dir: &Path,
        database_url: Option<String>,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        Self::start_launched(data_dir, database_url, extra, &[]).await
    }

    /// As [`Self::start_with`], through `launcher` (see [`Self::launcher`]); the process id is
    /// the server's when the launcher execs it.
    pub async fn start_launched(
        data_dir: &Path,
        database_url: Option<String>,
        extra: &[&str],
        launcher: &[&str],
    ) -> anyhow::Result<Self> {
        let database_url = database_url.unwrap_or_else(|| {
            format!(
                "sqlite://{}?mode=rwc",
                data_dir.join("reports.db").display()
            )
        });
        let mut server = ServerProcess {
            data_dir: data_dir.to_owned(),
            database_url,
            port: free_port(),
            kubeconfig: data_dir.join("kubeconfig"),
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
            launcher: launcher.iter().map(|s| s.to_string()).collect(),
            child: None,
            log: data_dir.join(format!("server-{}.log", free_port())),
        };
        server.spawn().await?;
        Ok(server)
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        std::fs::create_dir_all(&self.data_dir)?;
        let log = std::fs::File::create(&self.log)?;
        let mut command = match self.launcher.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(binary()?);
                c
            }
            None => Command::new(binary()?),
        };
        let child = command
            .arg("serve")
            .args(["--data-dir", self.data_dir.to_str().unwrap()])
            .args(["--database-url", &self.database_url])
            .args(["--secure-port", &self.port.to_string()])
            .args(&self.extra_args)
            .env("REPORTS_SERVER_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("spawn reports-server")?;
        self.child = Some(child);
        self.wait_ready().await
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "reports-server exited with {status} during start-up:\n{}",
                    self.log_tail()
                );
            }
            if self.kubeconfig.exists()
                && tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                    .await
                    .is_ok()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "reports-server did not start within 60s:\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The server's log file (stderr), for tests that need more than the tail.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The process id while it runs (for `/proc/<pid>` readings: memory, threads).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// SIGKILL: no graceful shutdown, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills the process and starts it again on the same port, data and database.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let _ = std::fs::remove_file(&self.kubeconfig);
        self.spawn().await
    }

    /// A kube-rs client authenticated as the admin.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        crate::kube_client(&self.kubeconfig).await
    }

    /// A client that does not retry 429/503/504, for tests of those responses.
    pub async fn client_without_retries(&self) -> anyhow::Result<kube::Client> {
        crate::kube_client_with_retries(&self.kubeconfig, false).await
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
