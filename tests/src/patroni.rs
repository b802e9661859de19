//! A Patroni cluster of the test's own: three PostgreSQL members managed by Debian's Patroni
//! (3.0.2), our Go-built etcd (3.6) as its DCS through Patroni's `etcd3:` section, and HAProxy
//! in front sending connections to whichever member Patroni's REST API calls the primary
//! (`GET /primary`), as Patroni's users deploy it: sqlx takes one host and ignores
//! `target_session_attrs`, so the server under test is pointed at HAProxy.
//!
//! Replication is synchronous and strict (`synchronous_mode: true`,
//! `synchronous_mode_strict: true`, `synchronous_commit: on`): a commit returns only once the
//! synchronous standby has it, and only that standby may be promoted, so no acknowledged commit
//! can be lost by a failover. `ttl` 10 s, `loop_wait` 1 s and `retry_timeout` 4 s make a failover
//! take about ten seconds instead of thirty. `use_pg_rewind` lets a replica that is ahead of the
//! promoted standby follow it (see `member_config`).
//!
//! Each member is a *node*: Patroni runs in a PID namespace of its own (`unshare --pid
//! --mount-proc`), so killing the namespace's first process takes Patroni, the postmaster and
//! every backend down at once, as when a machine dies. (A bare `kill -9` of the postmaster is
//! just restarted in place by Patroni; the postmaster also puts itself in a session of its own,
//! so a process group does not reach it.) The namespace's first process is a root `sh` that keeps
//! `unshare --kill-child`'s parent-death signal (a `setpriv` to the postgres user in that process
//! would clear it), and `unshare` itself is spawned with [`spawn_tied_to_test`]: when the test
//! process dies, however it dies, every node goes with it. etcd and HAProxy are tied the same way.
//!
//! Needs root (PID namespaces, and PostgreSQL runs as the `postgres` user), Debian's `patroni`,
//! `python3-etcd` and `haproxy`, the PostgreSQL 15 server binaries, and `unshare`/`setpriv`
//! (util-linux). A missing one fails the test with what to install.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::controlplane::{binaries_dir, free_ports, spawn_tied_to_test};
use crate::plain_http::get as http_get;

/// How long Patroni's REST API and etcd's health endpoint may take to answer.
const HTTP_DEADLINE: Duration = Duration::from_secs(2);
use crate::postgres::which;

/// Patroni's `scope`: the cluster's name in the DCS and in `patronictl`.
const SCOPE: &str = "reports";
/// Waits for the first leader and its synchronous standby: bootstrap, then two base backups.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(120);

/// One member: a Patroni and the PostgreSQL it manages, in a PID namespace of their own.
pub struct Member {
    pub name: String,
    pub pg_port: u16,
    pub rest_port: u16,
    dir: PathBuf,
    /// `unshare`; `None` once the node was killed.
    node: Option<Child>,
}

impl Member {
    fn config(&self) -> PathBuf {
        self.dir.join("patroni.yml")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("patroni.log")
    }

    pub fn is_alive(&self) -> bool {
        self.node.is_some()
    }
}

/// What Patroni's `GET /cluster` says of a member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberState {
    pub name: String,
    /// `leader`, `sync_standby`, `replica` (`master` in older releases).
    pub role: String,
    /// `running`, `stopped`, `starting`, …
    pub state: String,
    pub timeline: Option<u64>,
}

impl std::fmt::Display for MemberState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.name, self.role, self.state)?;
        if let Some(tl) = self.timeline {
            write!(f, " TL{tl}")?;
        }
        Ok(())
    }
}

/// etcd, the members and HAProxy; everything is killed and removed on drop.
pub struct PatroniCluster {
    root: PathBuf,
    etcd: Option<Child>,
    haproxy: Option<Child>,
    haproxy_port: u16,
    members: Vec<Member>,
    patronictl: PathBuf,
    psql: PathBuf,
}

/// The tools a Patroni cluster needs, or what to install.
struct Tools {
    patroni: PathBuf,
    patronictl: PathBuf,
    haproxy: PathBuf,
    pg_bin: PathBuf,
}

fn tools() -> anyhow::Result<Tools> {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the Patroni tests run each PostgreSQL member in a PID namespace of its own and as the postgres user: run them as root"
        );
    }
    let find = |program: &str, package: &str| {
        which(program)
            .or_else(|| {
                let sbin = Path::new("/usr/sbin").join(program);
                sbin.exists().then_some(sbin)
            })
            .with_context(|| format!("{program} not found: apt-get install -y {package}"))
    };
    let patroni = find("patroni", "patroni python3-etcd")?;
    let patronictl = find("patronictl", "patroni")?;
    let haproxy = find("haproxy", "haproxy")?;
    find("unshare", "util-linux")?;
    find("setpriv", "util-linux")?;
    // Patroni's own interpreter must have the etcd client (python3-etcd) for `etcd3:`.
    let shebang = std::fs::read_to_string(&patroni).unwrap_or_default();
    let python = shebang
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("#!"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or("/usr/bin/python3")
        .to_owned();
    let import = Command::new(&python).args(["-c", "import etcd"]).output();
    if !import.is_ok_and(|o| o.status.success()) {
        bail!("Patroni's Python ({python}) cannot import etcd: apt-get install -y python3-etcd");
    }
    Ok(Tools {
        patroni,
        patronictl,
        haproxy,
        pg_bin: pg15_bin()?,
    })
}

/// PostgreSQL 15's server binaries (`PG_BIN` overrides), else the newest installed.
fn pg15_bin() -> anyhow::Result<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let fifteen = PathBuf::from("/usr/lib/postgresql/15/bin");
    if fifteen.join("postgres").exists() {
        return Ok(fifteen);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    found.sort();
    found
        .pop()
        .filter(|b| b.join("postgres").exists())
        .context("PostgreSQL server binaries not found: apt-get install -y postgresql (15)")
}

fn chown_postgres(path: &Path) -> anyhow::Result<()> {
    let status = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(path)
        .status()?;
    if !status.success() {
        bail!(
            "cannot chown {} to postgres (is the postgres user present? apt-get install -y postgresql)",
            path.display()
        );
    }
    Ok(())
}

fn log_file(path: &Path) -> anyhow::Result<Stdio> {
    Ok(std::fs::File::create(path)
        .with_context(|| format!("create {}", path.display()))?
        .into())
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

impl PatroniCluster {
    /// Starts etcd, `members` Patroni members and HAProxy, and waits until a leader with a
    /// synchronous standby serves writes through HAProxy.
    pub async fn start(members: usize) -> anyhow::Result<Self> {
        let tools = tools()?;
        let etcd_bin = binaries_dir(false).await?.join("etcd");
        anyhow::ensure!((1..=6).contains(&members), "1 to 6 members");
        let root = std::env::temp_dir().join(format!(
            "reports-server-patroni-{}-{}",
            std::process::id(),
            crate::server::free_port()
        ));
        let ports = free_ports::<16>()?;
        let (etcd_port, peer_port, haproxy_port) = (ports[0], ports[1], ports[2]);
        // From here on, a failure drops the cluster, which kills what was started.
        let mut cluster = PatroniCluster {
            root: root.clone(),
            etcd: None,
            haproxy: None,
            haproxy_port,
            members: (0..members)
                .map(|i| Member {
                    name: format!("pg{i}"),
                    pg_port: ports[3 + 2 * i],
                    rest_port: ports[4 + 2 * i],
                    dir: root.join(format!("pg{i}")),
                    node: None,
                })
                .collect(),
            patronictl: tools.patronictl.clone(),
            psql: tools.pg_bin.join("psql"),
        };
        std::fs::create_dir_all(&root)?;
        cluster.etcd = Some(spawn_etcd(&etcd_bin, &root, etcd_port, peer_port)?);
        cluster.haproxy = Some(spawn_haproxy(
            &tools.haproxy,
            &root,
            haproxy_port,
            &cluster.members,
        )?);
        await_etcd(etcd_port).await?;
        for member in &cluster.members {
            std::fs::create_dir_all(&member.dir)?;
            std::fs::write(member.config(), member_config(member, &tools, etcd_port))?;
            chown_postgres(&member.dir)?;
        }
        for i in 0..members {
            cluster.start_member(i, &tools.patroni)?;
        }
        cluster
            .await_healthy(members, BOOTSTRAP_TIMEOUT)
            .await
            .with_context(|| format!("the Patroni cluster did not form\n{}", cluster.logs()))?;
        Ok(cluster)
    }

    fn start_member(&mut self, i: usize, patroni: &Path) -> anyhow::Result<()> {
        let member = &mut self.members[i];
        let mut cmd = Command::new("unshare");
        // `sh` stays the namespace's first process (it waits), so it keeps the parent-death
        // signal of --kill-child; Patroni runs below it as postgres.
        cmd.args(["--pid", "--fork", "--mount-proc", "--kill-child", "--"])
            .args([
                "sh",
                "-c",
                "setpriv --reuid postgres --regid postgres --init-groups \"$1\" \"$2\" & wait",
                "sh",
            ])
            .arg(patroni)
            .arg(member.config())
            .env("HOME", &member.dir)
            .current_dir(&member.dir)
            .stdin(Stdio::null())
            .stdout(log_file(&member.log())?)
            .stderr(
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(member.log())?,
            );
        member.node = Some(spawn_tied_to_test(cmd).context("spawn unshare … patroni")?);
        Ok(())
    }

    /// `postgres://postgres@127.0.0.1:<haproxy>/postgres`: always the current primary.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.haproxy_port
        )
    }

    pub fn members(&self) -> &[Member] {
        &self.members
    }

    pub fn member(&self, name: &str) -> anyhow::Result<&Member> {
        self.members
            .iter()
            .find(|m| m.name == name)
            .with_context(|| format!("no member {name}"))
    }

    /// The members as Patroni's `GET /cluster` (asked of each live member in turn) lists them.
    pub async fn topology(&self) -> anyhow::Result<Vec<MemberState>> {
        let mut last = None;
        for member in self.members.iter().filter(|m| m.is_alive()) {
            match http_get(member.rest_port, "/cluster", HTTP_DEADLINE).await {
                Ok((200, body)) => return parse_topology(&body),
                Ok((code, body)) => last = Some(anyhow::anyhow!("GET /cluster: {code} {body}")),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no live member")))
    }

    /// The current leader's name.
    pub async fn leader(&self) -> anyhow::Result<String> {
        let topology = self.topology().await?;
        topology
            .iter()
            .find(|m| is_leader(&m.role) && m.state == "running")
            .map(|m| m.name.clone())
            .with_context(|| format!("no running leader in {topology:?}"))
    }

    /// Waits until `members` members run, one of them the leader with a running synchronous
    /// standby on its timeline, and HAProxy routes a new connection to that leader, which takes
    /// a write; returns the leader's name.
    pub async fn await_healthy(&self, members: usize, within: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + within;
        loop {
            match self.healthy(members).await {
                Ok(leader) => return Ok(leader),
                Err(e) if Instant::now() > deadline => {
                    bail!("not healthy within {within:?}: {e:#}")
                }
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn healthy(&self, members: usize) -> anyhow::Result<String> {
        let topology = self.topology().await?;
        let running: Vec<&MemberState> = topology.iter().filter(|m| m.state == "running").collect();
        let leader = running
            .iter()
            .find(|m| is_leader(&m.role))
            .with_context(|| format!("no running leader: {}", show(&topology)))?;
        let synced = running
            .iter()
            .any(|m| m.role == "sync_standby" && m.timeline == leader.timeline);
        if running.len() < members || !synced {
            bail!(
                "want {members} running with a synchronous standby: {}",
                show(&topology)
            );
        }
        let port = self.member(&leader.name)?.pg_port;
        let sql = "CREATE TABLE IF NOT EXISTS patroni_probe (at timestamptz); \
                   INSERT INTO patroni_probe VALUES (now()); \
                   SELECT inet_server_port()";
        let served = self.psql(sql).await?;
        if served.trim() != port.to_string() {
            bail!(
                "HAProxy routes to port {served:?}, the leader {} is on {port}",
                leader.name
            );
        }
        Ok(leader.name.clone())
    }

    /// Runs `sql` through HAProxy with psql; returns its unaligned output.
    pub async fn psql(&self, sql: &str) -> anyhow::Result<String> {
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::process::Command::new(&self.psql)
                .arg(self.url())
                .args(["-v", "ON_ERROR_STOP=1", "-Atqc", sql])
                .env("PGCONNECT_TIMEOUT", "3")
                .kill_on_drop(true)
                .output(),
        )
        .await
        .context("psql through HAProxy: no answer within 10s")??;
        if !out.status.success() {
            bail!("psql: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Takes the member's node away: SIGKILL to `unshare`, whose parent-death signal kills the
    /// namespace's first process, and with it Patroni, the postmaster and every backend at once
    /// (the kernel kills a PID namespace whole when its first process dies). Returns once its
    /// PostgreSQL port and REST port refuse connections.
    pub async fn kill_node(&mut self, name: &str) -> anyhow::Result<()> {
        let member = self
            .members
            .iter_mut()
            .find(|m| m.name == name)
            .with_context(|| format!("no member {name}"))?;
        let mut node = member.node.take().context("the node is already dead")?;
        node.kill()?;
        node.wait()?;
        let deadline = Instant::now() + Duration::from_secs(10);
        for port in [member.pg_port, member.rest_port] {
            while tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                if Instant::now() > deadline {
                    bail!("{name}'s port {port} still accepts connections 10s after the kill");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }

    /// A planned switchover with `patronictl switchover --leader … --candidate … --force`;
    /// returns patronictl's output.
    pub async fn switchover(&self, leader: &str, candidate: &str) -> anyhow::Result<String> {
        let member = self.member(leader)?;
        let out = tokio::process::Command::new(&self.patronictl)
            .arg("-c")
            .arg(member.config())
            .args([
                "switchover",
                "--leader",
                leader,
                "--candidate",
                candidate,
                "--force",
            ])
            .arg(SCOPE)
            .kill_on_drop(true)
            .output()
            .await
            .context("run patronictl")?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() || !text.contains("Successfully switched over") {
            bail!("patronictl switchover {leader} → {candidate} failed: {text}");
        }
        Ok(text)
    }

    /// The last lines of every member's Patroni and PostgreSQL log, and of HAProxy's.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for m in &self.members {
            out += &format!(
                "--- {} (patroni + postgres) ---\n{}\n",
                m.name,
                tail(&m.log(), 25)
            );
        }
        out += &format!(
            "--- haproxy ---\n{}\n",
            tail(&self.root.join("haproxy.log"), 15)
        );
        out
    }

    /// HAProxy's log (its server state changes), whole.
    pub fn haproxy_log(&self) -> String {
        std::fs::read_to_string(self.root.join("haproxy.log")).unwrap_or_default()
    }
}

impl Drop for PatroniCluster {
    fn drop(&mut self) {
        for member in &mut self.members {
            if let Some(mut node) = member.node.take() {
                let _ = node.kill();
                let _ = node.wait();
            }
        }
        for mut child in [self.haproxy.take(), self.etcd.take()]
            .into_iter()
            .flatten()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::env::var("REPORTS_SERVER_KEEP_E2E").is_ok_and(|v| v == "1") {
            eprintln!("[patroni] kept {}", self.root.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

fn is_leader(role: &str) -> bool {
    matches!(role, "leader" | "master" | "primary")
}

fn show(topology: &[MemberState]) -> String {
    topology
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn parse_topology(body: &str) -> anyhow::Result<Vec<MemberState>> {
    let v: Value = serde_json::from_str(body).context("GET /cluster: not JSON")?;
    let members = v["members"]
        .as_array()
        .context("GET /cluster: no members")?;
    Ok(members
        .iter()
        .map(|m| MemberState {
            name: m["name"].as_str().unwrap_or_default().to_owned(),
            role: m["role"].as_str().unwrap_or_default().to_owned(),
            state: m["state"].as_str().unwrap_or_default().to_owned(),
            timeline: m["timeline"].as_u64(),
        })
        .collect())
}

fn spawn_etcd(bin: &Path, root: &Path, port: u16, peer_port: u16) -> anyhow::Result<Child> {
    let peer = format!("http://127.0.0.1:{peer_port}");
    let client = format!("http://127.0.0.1:{port}");
    let mut cmd = Command::new(bin);
    cmd.arg("--name=patroni-dcs")
        .arg(format!("--data-dir={}", root.join("etcd").display()))
        .arg(format!("--listen-client-urls={client}"))
        .arg(format!("--advertise-client-urls={client}"))
        .arg(format!("--listen-peer-urls={peer}"))
        .arg(format!("--initial-advertise-peer-urls={peer}"))
        .arg(format!("--initial-cluster=patroni-dcs={peer}"))
        .args(["--unsafe-no-fsync=true", "--log-level=warn"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file(&root.join("etcd.log"))?);
    spawn_tied_to_test(cmd).context("spawn etcd")
}

async fn await_etcd(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match http_get(port, "/health", HTTP_DEADLINE).await {
            Ok((200, body)) if body.contains("\"health\":\"true\"") => return Ok(()),
            other if Instant::now() > deadline => bail!("etcd not healthy within 30s: {other:?}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// A member's `patroni.yml`. Trust authentication on loopback (a test); `fsync` off (a killed
/// process does not lose the page cache; only a machine crash would); a short
/// `wal_retrieve_retry_interval` so that a replica follows a new leader within a second.
///
/// `use_pg_rewind` is needed even though only the synchronous standby is ever promoted: the
/// asynchronous replica may have received more of the old primary's WAL than the synchronous
/// standby (commits not yet confirmed, never acknowledged), and then cannot follow the new
/// timeline without a rewind. It retries forever, strict mode has no synchronous standby to wait
/// for, and every commit hangs (seen here about one failover in four before this setting).
fn member_config(m: &Member, tools: &Tools, etcd_port: u16) -> String {
    let dir = m.dir.display();
    let bin = tools.pg_bin.display();
    format!(
        r#"scope: {SCOPE}
namespace: /reports-server-test/
name: {name}
log:
  level: INFO
restapi:
  listen: 127.0.0.1:{rest}
  connect_address: 127.0.0.1:{rest}
etcd3:
  host: 127.0.0.1:{etcd_port}
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 1
    retry_timeout: 4
    maximum_lag_on_failover: 1048576
    synchronous_mode: true
    synchronous_mode_strict: true
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        synchronous_commit: "on"
        max_connections: 200
        wal_retrieve_retry_interval: 500ms
        max_wal_size: 256MB
        min_wal_size: 64MB
  initdb:
    - encoding: UTF8
    - auth: trust
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:{pg}
  connect_address: 127.0.0.1:{pg}
  data_dir: {dir}/data
  bin_dir: {bin}
  pgpass: {dir}/pgpass
  remove_data_directory_on_rewind_failure: true
  remove_data_directory_on_diverged_timelines: true
  authentication:
    superuser:
      username: postgres
      password: postgres
    replication:
      username: replicator
      password: replicator
  parameters:
    unix_socket_directories: {dir}
    fsync: "off"
    shared_buffers: 64MB
"#,
        name = m.name,
        rest = m.rest_port,
        pg = m.pg_port,
    )
}

/// HAProxy in TCP mode: a member takes connections while its `GET /primary` answers 200
/// (checked every 500 ms, down after 2 failures, up after 1 success), and its sessions are cut
/// when it is marked down, so a demoted primary keeps no client.
fn spawn_haproxy(bin: &Path, root: &Path, port: u16, members: &[Member]) -> anyhow::Result<Child> {
    let servers: String = members
        .iter()
        .map(|m| {
            format!(
                "    server {} 127.0.0.1:{} check port {}\n",
                m.name, m.pg_port, m.rest_port
            )
        })
        .collect();
    let config = format!(
        "global
    maxconn 2000
defaults
    mode tcp
    timeout connect 2s
    timeout client 30m
    timeout server 30m
    timeout check 1s
listen primary
    bind 127.0.0.1:{port}
    option httpchk GET /primary
    http-check expect status 200
    default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
{servers}"
    );
    let path = root.join("haproxy.cfg");
    std::fs::write(&path, config)?;
    let mut cmd = Command::new(bin);
    cmd.arg("-db")
        .arg("-f")
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(log_file(&root.join("haproxy.log"))?)
        .stderr(
            std::fs::OpenOptions::new()
                .append(true)
                .open(root.join("haproxy.log"))?,
        );
    spawn_tied_to_test(cmd).context("spawn haproxy")
}
