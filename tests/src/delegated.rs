//! The real `reports-server serve --auth-mode delegated` behind a real kube-apiserver, the way it
//! runs in a cluster: a serving certificate from the cluster CA, an ExternalName Service to
//! `localhost`, the three APIServices with the CA as `caBundle`, and a wait until kube-apiserver
//! routes every group to the server. Shared by the end-to-end suites (`e2e_aggregated`,
//! `e2e_kyverno`).

use std::{
    fs::{self, OpenOptions},
    io::Write as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use base64::Engine as _;
use http_body_util::BodyExt;
use serde::Deserialize as _;
use serde_json::{Value, json};

use crate::{
    Backend,
    controlplane::{Component, ControlPlane, KubeconfigAuth, kube_client_for, spawn_tied_to_test},
    kubectl::Kubectl,
    server,
};

/// Namespace of the ExternalName Service the APIServices point at.
pub const SERVICE_NAMESPACE: &str = "reports-server";
/// Name of that Service (the serving certificate names `<name>.<namespace>.svc`).
pub const SERVICE_NAME: &str = "reports-server";
/// The APIServices `reports-server apiservices` prints.
pub const API_SERVICES: [&str; 3] = [
    "v1alpha2.wgpolicyk8s.io",
    "v1.reports.kyverno.io",
    "v1alpha1.openreports.io",
];
/// How long an APIService may take to become Available (first start and after a restart).
pub const AVAILABLE_TIMEOUT: Duration = Duration::from_secs(120);

/// `reports-server serve --auth-mode delegated` on a free loopback port, with a serving
/// certificate from the cluster CA for `reports-server.reports-server.svc`. Readiness is an
/// anonymous `GET /readyz` (no kubeconfig is written in delegated mode).
///
/// The database is the server's SQLite file in `dir`, or PostgreSQL with
/// `REPORTS_SERVER_E2E_BACKEND=postgres` (see [`crate::postgres`]).
pub struct Server {
    /// The `reports-server` binary.
    pub bin: PathBuf,
    /// The full argument list of `serve`.
    pub args: Vec<String>,
    /// The listening port on 127.0.0.1.
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
    starts: u32,
    probe: kube::Client,
}

impl Server {
    /// Starts the server with the default aggregation settings.
    pub async fn start(cp: &ControlPlane, dir: &Path) -> Result<Server> {
        Self::start_with(cp, dir, &[]).await
    }

    /// Starts the server with `extra` appended to the `serve` arguments (for example
    /// `--aggregation=false` or `--aggregation-delay 2s`).
    pub async fn start_with(cp: &ControlPlane, dir: &Path, extra: &[&str]) -> Result<Server> {
        let database_url = match std::env::var("REPORTS_SERVER_E2E_BACKEND").as_deref() {
            Ok("postgres") => Backend::Postgres.database_url(dir)?,
            Ok("sqlite") | Err(_) => Backend::Sqlite.database_url(dir)?,
            Ok(other) => bail!("REPORTS_SERVER_E2E_BACKEND={other}: use sqlite or postgres"),
        };
        Self::start_on(cp, dir, &database_url, extra).await
    }

    /// Starts the server on the database `database_url`, with `extra` appended to the `serve`
    /// arguments.
    pub async fn start_on(
        cp: &ControlPlane,
        dir: &Path,
        database_url: &str,
        extra: &[&str],
    ) -> Result<Server> {
        let bin = server::binary().context("building reports-server")?;
        fs::create_dir_all(dir)?;
        let cert = cp
            .issue_serving_cert(
                SERVICE_NAME,
                &[
                    &format!("{SERVICE_NAME}.{SERVICE_NAMESPACE}.svc"),
                    "localhost",
                    "127.0.0.1",
                ],
            )
            .await?;
        let port = server::free_port();
        let path = |p: &Path| p.display().to_string();
        let mut args = vec![
            "serve".to_string(),
            "--auth-mode".into(),
            "delegated".into(),
            "--kubeconfig".into(),
            path(cp.kubeconfig_path()),
            "--tls-cert-file".into(),
            path(&cert.cert_path),
            "--tls-private-key-file".into(),
            path(&cert.key_path),
            "--secure-port".into(),
            port.to_string(),
            "--bind-address".into(),
            "127.0.0.1".into(),
            "--data-dir".into(),
            path(dir),
            "--database-url".into(),
            database_url.to_owned(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        let url = format!("https://127.0.0.1:{port}");
        let probe =
            kube_client_for(&cp.kubeconfig_for_server("probe", &url, KubeconfigAuth::Anonymous)?)
                .await?;
        let mut server = Server {
            bin,
            args,
            port,
            dir: dir.to_path_buf(),
            child: None,
            starts: 0,
            probe,
        };
        server.spawn().await?;
        Ok(server)
    }

    /// `https://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The process id while the server runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's log, appended across restarts.
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = fs::read_to_string(self.log_path()).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    async fn spawn(&mut self) -> Result<()> {
        self.starts += 1;
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        writeln!(log, "===== e2e: start #{} =====", self.starts)?;
        let mut cmd = Command::new(&self.bin);
        cmd.args(&self.args)
            .env("REPORTS_SERVER_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = spawn_tied_to_test(cmd).context("starting reports-server serve")?;
        self.child = Some(child);
        self.wait_ready().await
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(60);
        let mut last = anyhow!("not probed yet");
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                bail!(
                    "reports-server serve exited with {status} during start-up (this suite needs \
                     `serve --auth-mode delegated --kubeconfig … --tls-cert-file … \
                     --tls-private-key-file …`); args: {:?}\n--- last lines of {} ---\n{}",
                    self.args,
                    self.log_path().display(),
                    self.log_tail(40)
                );
            }
            match tokio::time::timeout(Duration::from_secs(5), raw(&self.probe, "GET", "/readyz"))
                .await
            {
                Ok(Ok((200, body))) if body.trim() == "ok" => {
                    eprintln!(
                        "[e2e] reports-server (start #{}) ready in {:.1?} on {}",
                        self.starts,
                        t0.elapsed(),
                        self.url()
                    );
                    return Ok(());
                }
                Ok(Ok((status, body))) => last = anyhow!("GET /readyz: {status} {}", body.trim()),
                Ok(Err(e)) => last = e,
                Err(_) => last = anyhow!("GET /readyz timed out after 5s"),
            }
            if t0.elapsed() > timeout {
                bail!(
                    "reports-server not ready after {timeout:?}; last probe: {last:#}\n--- last \
                     lines of {} ---\n{}",
                    self.log_path().display(),
                    self.log_tail(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGKILL, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGKILL and start again with the same port, database and certificate.
    pub async fn restart(&mut self) -> Result<()> {
        self.kill();
        self.spawn().await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `reports-server apiservices …` → checked ([`check_apiservices_yaml`]) → `kubectl apply -f -`
/// → all Available and routed ([`wait_apiservices_routed`]).
pub async fn register_apiservices(
    cp: &ControlPlane,
    server: &Server,
    admin: &Kubectl,
    client: &kube::Client,
) -> Result<()> {
    let t = Instant::now();
    let out = Command::new(&server.bin)
        .args(["apiservices", "--port", &server.port.to_string()])
        .arg("--ca-bundle-file")
        .arg(cp.ca_cert_path())
        .args(["--service-namespace", SERVICE_NAMESPACE])
        .args(["--service-name", SERVICE_NAME])
        .args(["--external-name", "localhost"])
        .output()
        .context("running reports-server apiservices")?;
    ensure!(
        out.status.success(),
        "reports-server apiservices failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let yaml = String::from_utf8(out.stdout)?;
    check_apiservices_yaml(&yaml, server.port, cp.ca_pem())
        .with_context(|| format!("reports-server apiservices printed:\n{yaml}"))?;
    let applied = admin.run_with_stdin(&["apply", "-f", "-"], Some(&yaml))?;
    for name in API_SERVICES {
        ensure!(
            applied.contains(&format!("apiservice.apiregistration.k8s.io/{name}")),
            "kubectl apply did not create APIService {name}:\n{applied}"
        );
    }
    wait_apiservices_routed(cp, server, client).await?;
    eprintln!(
        "[e2e] APIServices applied and Available in {:.1?}",
        t.elapsed()
    );
    Ok(())
}

/// Waits until every APIService is `Available` and kube-apiserver routes its group.
pub async fn wait_apiservices_routed(
    cp: &ControlPlane,
    server: &Server,
    client: &kube::Client,
) -> Result<()> {
    for name in API_SERVICES {
        cp.wait_apiservice_available(name, AVAILABLE_TIMEOUT)
            .await
            .with_context(|| diagnostics(cp, server))?;
    }
    // `Available` comes from kube-aggregator's availability controller, the proxy route from
    // another controller: for a moment after `Available` the group can still be a plain
    // "404 page not found" (seen in CI). Wait until kube-apiserver routes every group.
    let deadline = Instant::now() + AVAILABLE_TIMEOUT;
    for name in API_SERVICES {
        let (version, group) = name
            .split_once('.')
            .expect("APIService names are <version>.<group>");
        let path = format!("/apis/{group}/{version}");
        loop {
            let request = http::Request::get(&path).body(Vec::new())?;
            match client.request_text(request).await {
                Ok(_) => break,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!(
                            "GET {path} through kube-apiserver after {name} became Available\n{}",
                            diagnostics(cp, server)
                        )
                    });
                }
            }
        }
    }
    Ok(())
}

/// Deletes the APIServices, so that nothing (namespace deletion, garbage collection) blocks on
/// discovery once the server is stopped.
pub async fn unregister_apiservices(cp: &ControlPlane) -> Result<()> {
    for api in API_SERVICES {
        cp.delete_apiservice(api).await?;
    }
    Ok(())
}

/// The tails of our server's and kube-apiserver's logs, for failure messages.
pub fn diagnostics(cp: &ControlPlane, server: &Server) -> String {
    format!(
        "--- reports-server log ({}) ---\n{}\n--- kube-apiserver log ---\n{}",
        server.log_path().display(),
        server.log_tail(40),
        cp.log_tail(Component::KubeApiserver, 20)
    )
}

/// The YAML of `reports-server apiservices`: a Namespace, an ExternalName Service and the three
/// APIServices pointing at it with the CA as `caBundle`.
pub fn check_apiservices_yaml(yaml: &str, port: u16, ca_pem: &str) -> Result<()> {
    let docs: Vec<Value> = serde_yaml::Deserializer::from_str(yaml)
        .map(Value::deserialize)
        .collect::<Result<Vec<_>, _>>()
        .context("the output is not YAML")?
        .into_iter()
        .filter(|d| !d.is_null())
        .collect();
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .ok_or_else(|| anyhow!("no {kind} {name}"))
    };
    let ns = find("Namespace", SERVICE_NAMESPACE)?;
    ensure!(ns["apiVersion"] == "v1", "Namespace apiVersion: {ns}");
    let svc = find("Service", SERVICE_NAME)?;
    ensure!(
        svc["apiVersion"] == "v1"
            && svc["metadata"]["namespace"] == SERVICE_NAMESPACE
            && svc["spec"]["type"] == "ExternalName"
            && svc["spec"]["externalName"] == "localhost",
        "Service: {svc}"
    );
    for name in API_SERVICES {
        let api = find("APIService", name)?;
        let (version, group) = name.split_once('.').unwrap();
        let spec = &api["spec"];
        ensure!(
            api["apiVersion"] == "apiregistration.k8s.io/v1"
                && spec["group"] == group
                && spec["version"] == version,
            "APIService {name}: {api}"
        );
        ensure!(
            spec["service"]
                == json!({"namespace": SERVICE_NAMESPACE, "name": SERVICE_NAME, "port": port}),
            "APIService {name}: service should be {SERVICE_NAMESPACE}/{SERVICE_NAME}:{port}, got {}",
            spec["service"]
        );
        let bundle = spec["caBundle"]
            .as_str()
            .ok_or_else(|| anyhow!("APIService {name} has no caBundle"))?;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(bundle)
            .context("caBundle is not base64")?;
        ensure!(
            String::from_utf8_lossy(&decoded).trim() == ca_pem.trim(),
            "APIService {name}: caBundle is not the CA file"
        );
        ensure!(
            spec["insecureSkipTLSVerify"] != true,
            "APIService {name} skips TLS verification"
        );
        ensure!(
            spec["groupPriorityMinimum"].as_i64().is_some_and(|p| p > 0)
                && spec["versionPriority"].as_i64().is_some_and(|p| p > 0),
            "APIService {name}: priorities {} / {}",
            spec["groupPriorityMinimum"],
            spec["versionPriority"]
        );
    }
    Ok(())
}

/// A raw request; returns status and body whatever the status.
pub async fn raw(client: &kube::Client, method: &str, path: &str) -> Result<(u16, String)> {
    raw_with(client, method, path, &[], None).await
}

/// A raw request with extra headers and an optional JSON body; returns status and body whatever
/// the status.
pub async fn raw_with(
    client: &kube::Client,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> Result<(u16, String)> {
    let mut req = http::Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if body.is_some() {
        req = req.header("Content-Type", "application/json");
    }
    let req = req.body(body.map(|b| b.to_string().into_bytes()).unwrap_or_default())?;
    let res = client
        .send(req.map(kube::client::Body::from))
        .await
        .with_context(|| format!("{method} {path}"))?;
    let status = res.status().as_u16();
    let bytes = res.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}
