//! A real Kubernetes control plane for end-to-end tests: etcd, kube-apiserver and (optionally)
//! kube-controller-manager as plain processes on 127.0.0.1, built from the Go module proxy by
//! `tests/controlplane/build.sh` and cached outside the work tree. See `docs/e2e.md`.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use reports_server_tests::controlplane::{ControlPlane, ControlPlaneOptions};
//! let cp = ControlPlane::start(ControlPlaneOptions::with_controller_manager()).await?;
//! let client = cp.client().await?;
//! // kubectl --kubeconfig cp.kubeconfig_path() ...
//! cp.stop().await?;
//! # Ok(()) }
//! ```
//!
//! PKI is made with the `openssl` CLI (one cluster CA that signs the serving certificates and
//! the client certificates, a separate front-proxy CA for the aggregation layer, and an EC P-256
//! service-account key pair). The openssl CLI is used rather than rcgen because client
//! certificates for RBAC tests need one `O=` attribute per group, which rcgen 0.14's
//! `DistinguishedName` (one value per attribute type) cannot express.
//!
//! Environment:
//! - `REPORTS_SERVER_CONTROLPLANE_BIN`: directory with `etcd`, `kube-apiserver` and
//!   `kube-controller-manager`; skips the build script.
//! - `REPORTS_SERVER_CACHE`: cache root used by the build script (default
//!   `~/.cache/reports-server`).
//! - `REPORTS_SERVER_KEEP_E2E=1`: keep the temporary directory (PKI, kubeconfigs, logs, etcd data)
//!   after the control plane stops; its path is printed to stderr.

use std::{
    collections::VecDeque,
    fmt,
    fs::{self, File},
    hash::{BuildHasher, Hasher},
    io,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use base64::Engine as _;
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// Directory with prebuilt binaries; when set, the build script is not run.
pub const BIN_ENV: &str = "REPORTS_SERVER_CONTROLPLANE_BIN";
/// `1` keeps the temporary directory (logs, PKI, kubeconfigs) after stop/drop.
pub const KEEP_ENV: &str = "REPORTS_SERVER_KEEP_E2E";

/// The service CIDR given to kube-apiserver (`kubernetes` Service gets the first address).
pub const SERVICE_CLUSTER_IP_RANGE: &str = "10.0.0.0/24";

/// Controllers started by default when kube-controller-manager is enabled: those that matter
/// without nodes or a kubelet (garbage collection, namespace deletion, service accounts and their
/// tokens, `kube-root-ca.crt`, aggregated ClusterRoles, and the workload controllers an operator
/// test may look at). `*` would start everything (node lifecycle, PV binding, ...), which only
/// costs CPU here.
pub const DEFAULT_CONTROLLERS: &[&str] = &[
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
];

const LOG_TAIL_LINES: usize = 40;
const STOP_GRACE: Duration = Duration::from_secs(5);
const CLUSTER_NAME: &str = "reports-server-e2e";

/// What to start and how long to wait.
#[derive(Debug, Clone)]
pub struct ControlPlaneOptions {
    /// Also start kube-controller-manager (needed for garbage collection, namespace deletion,
    /// default service accounts).
    pub controller_manager: bool,
    /// Value of kube-controller-manager's `--controllers` (joined with commas).
    pub controllers: Vec<String>,
    /// Extra kube-apiserver flags, appended last (a repeated scalar flag overrides ours).
    pub apiserver_args: Vec<String>,
    /// Extra kube-controller-manager flags, appended last.
    pub controller_manager_args: Vec<String>,
    /// How long each component may take to become ready.
    pub startup_timeout: Duration,
}

impl Default for ControlPlaneOptions {
    fn default() -> Self {
        Self {
            controller_manager: false,
            controllers: DEFAULT_CONTROLLERS.iter().map(|s| s.to_string()).collect(),
            apiserver_args: Vec::new(),
            controller_manager_args: Vec::new(),
            startup_timeout: Duration::from_secs(180),
        }
    }
}

impl ControlPlaneOptions {
    /// etcd + kube-apiserver + kube-controller-manager.
    pub fn with_controller_manager() -> Self {
        Self {
            controller_manager: true,
            ..Self::default()
        }
    }
}

/// One of the processes of the control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    Etcd,
    KubeApiserver,
    KubeControllerManager,
}

impl Component {
    /// Binary (and log file) name.
    pub fn name(self) -> &'static str {
        match self {
            Component::Etcd => "etcd",
            Component::KubeApiserver => "kube-apiserver",
            Component::KubeControllerManager => "kube-controller-manager",
        }
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A PEM certificate and its PEM private key, as files and as text.
#[derive(Debug, Clone)]
pub struct CertPair {
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    pub cert_pem: String,
    pub key_pem: String,
}

impl CertPair {
    fn load(cert_path: PathBuf, key_path: PathBuf) -> Result<Self> {
        let cert_pem = fs::read_to_string(&cert_path)
            .with_context(|| format!("reading {}", cert_path.display()))?;
        let key_pem = fs::read_to_string(&key_path)
            .with_context(|| format!("reading {}", key_path.display()))?;
        Ok(Self {
            cert_path,
            key_path,
            cert_pem,
            key_pem,
        })
    }
}

/// How a kubeconfig from [`ControlPlane::kubeconfig_for_server`] authenticates.
#[derive(Debug, Clone, Copy)]
pub enum KubeconfigAuth<'a> {
    /// No client certificate, no token.
    Anonymous,
    /// `Authorization: Bearer <token>`.
    Token(&'a str),
    /// A client certificate (from [`ControlPlane::issue_client_cert`] or
    /// [`ControlPlane::issue_front_proxy_cert`]).
    ClientCert(&'a CertPair),
}

/// An APIService served by a process on this machine (see
/// [`ControlPlane::register_external_apiservice`]).
#[derive(Debug, Clone)]
pub struct ExternalApiService {
    pub group: String,
    pub version: String,
    /// Namespace of the ExternalName Service (created if missing).
    pub service_namespace: String,
    pub service_name: String,
    /// What the Service points at; the aggregator dials `https://<external_name>:<port>`.
    pub external_name: String,
    /// The port the server listens on (APIService `spec.service.port`; the ExternalName
    /// Service's own ports are not consulted).
    pub port: u16,
    /// `caBundle` that verifies the server certificate, whose SANs must include
    /// `<service_name>.<service_namespace>.svc`; `None` sets `insecureSkipTLSVerify`.
    pub ca_bundle_pem: Option<String>,
    pub group_priority_minimum: i32,
    pub version_priority: i32,
}

impl ExternalApiService {
    /// `group`/`version` served on `localhost:port` through Service `reports-system/reports-api`.
    pub fn new(group: &str, version: &str, port: u16) -> Self {
        Self {
            group: group.into(),
            version: version.into(),
            service_namespace: "reports-system".into(),
            service_name: "reports-api".into(),
            external_name: "localhost".into(),
            port,
            ca_bundle_pem: None,
            group_priority_minimum: 1000,
            version_priority: 15,
        }
    }

    /// The APIService's name, `<version>.<group>`.
    pub fn name(&self) -> String {
        format!("{}.{}", self.version, self.group)
    }

    /// The DNS name the aggregator verifies in the server certificate.
    pub fn server_name(&self) -> String {
        format!("{}.{}.svc", self.service_name, self.service_namespace)
    }
}

struct Proc {
    component: Component,
    child: Child,
}

/// A running control plane. Dropping it (or [`ControlPlane::stop`]) kills every process and
/// removes the temporary directory unless `REPORTS_SERVER_KEEP_E2E=1`.
pub struct ControlPlane {
    dir: Option<TempDir>,
    root: PathBuf,
    bin_dir: PathBuf,
    pki: Pki,
    server_url: String,
    etcd_url: String,
    controller_manager_url: Option<String>,
    kubeconfig: PathBuf,
    procs: Vec<Proc>,
}

impl fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ControlPlane")
            .field("dir", &self.root)
            .field("server_url", &self.server_url)
            .field("etcd_url", &self.etcd_url)
            .field("controller_manager_url", &self.controller_manager_url)
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// Builds (or finds) the binaries, generates PKI, starts etcd and kube-apiserver (and
    /// kube-controller-manager if asked) on free loopback ports and waits until they are ready.
    pub async fn start(opts: ControlPlaneOptions) -> Result<ControlPlane> {
        let t0 = Instant::now();
        let bin_dir = binaries_dir(opts.controller_manager).await?;
        check_openssl().await?;

        let dir = tempfile::Builder::new()
            .prefix("reports-server-cp-")
            .tempdir()
            .context("creating the control plane's temporary directory")?;
        let root = dir.path().to_path_buf();
        for sub in ["pki", "logs", "etcd", "users", "apiserver-certs"] {
            fs::create_dir_all(root.join(sub))?;
        }

        let [etcd_port, etcd_peer_port, apiserver_port, kcm_port] = free_ports::<4>()?;
        let server_url = format!("https://127.0.0.1:{apiserver_port}");
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");

        let pki = Pki::generate(&root.join("pki")).await?;
        let kubeconfig = root.join("admin.kubeconfig");
        fs::write(
            &kubeconfig,
            kubeconfig_yaml(&server_url, &pki.cas.cluster.cert_pem, "admin", &pki.admin),
        )?;

        let mut cp = ControlPlane {
            dir: Some(dir),
            root,
            bin_dir,
            pki,
            server_url,
            etcd_url,
            controller_manager_url: None,
            kubeconfig,
            procs: Vec::new(),
        };
        let pki_time = t0.elapsed();

        // etcd
        let t = Instant::now();
        let etcd_data = cp.root.join("etcd");
        let peer = format!("http://127.0.0.1:{etcd_peer_port}");
        let args = vec![
            "--name=e2e".to_string(),
            format!("--data-dir={}", etcd_data.display()),
            format!("--listen-client-urls={}", cp.etcd_url),
            format!("--advertise-client-urls={}", cp.etcd_url),
            format!("--listen-peer-urls={peer}"),
            format!("--initial-advertise-peer-urls={peer}"),
            format!("--initial-cluster=e2e={peer}"),
            "--unsafe-no-fsync=true".to_string(),
            "--auto-compaction-retention=1".to_string(),
            "--log-level=warn".to_string(),
        ];
        cp.spawn(Component::Etcd, &args)?;
        let addr = format!("127.0.0.1:{etcd_port}");
        cp.wait_ready(Component::Etcd, opts.startup_timeout, || {
            let addr = addr.clone();
            async move {
                let (status, body) = http_get_plain(&addr, "/health").await?;
                if status == 200 && body.contains("\"health\":\"true\"") {
                    Ok(())
                } else {
                    Err(anyhow!("GET /health: {status} {}", body.trim()))
                }
            }
        })
        .await?;
        let etcd_time = t.elapsed();

        // kube-apiserver
        let t = Instant::now();
        let p = &cp.pki;
        let mut args = vec![
            format!("--etcd-servers={}", cp.etcd_url),
            "--bind-address=127.0.0.1".to_string(),
            format!("--secure-port={apiserver_port}"),
            "--advertise-address=127.0.0.1".to_string(),
            "--endpoint-reconciler-type=none".to_string(),
            format!("--cert-dir={}", cp.root.join("apiserver-certs").display()),
            format!("--tls-cert-file={}", p.apiserver.cert_path.display()),
            format!("--tls-private-key-file={}", p.apiserver.key_path.display()),
            format!("--client-ca-file={}", p.cas.cluster.cert_path.display()),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_string(),
            format!("--service-account-key-file={}", p.sa_pub.display()),
            format!("--service-account-signing-key-file={}", p.sa_key.display()),
            format!("--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}"),
            "--authorization-mode=Node,RBAC".to_string(),
            "--allow-privileged=true".to_string(),
            // Aggregation layer: the aggregator authenticates to extension servers with the
            // front-proxy client certificate and passes the user in X-Remote-* headers.
            format!(
                "--requestheader-client-ca-file={}",
                p.cas.front_proxy.cert_path.display()
            ),
            "--requestheader-allowed-names=front-proxy-client".to_string(),
            "--requestheader-username-headers=X-Remote-User".to_string(),
            "--requestheader-group-headers=X-Remote-Group".to_string(),
            "--requestheader-extra-headers-prefix=X-Remote-Extra-".to_string(),
            format!(
                "--proxy-client-cert-file={}",
                p.front_proxy_client.cert_path.display()
            ),
            format!(
                "--proxy-client-key-file={}",
                p.front_proxy_client.key_path.display()
            ),
            // ClusterIP routing (the default): the only resolver that accepts ExternalName
            // Services, which is how an APIService reaches a server on localhost.
            "--enable-aggregator-routing=false".to_string(),
            "--profiling=false".to_string(),
            "--v=1".to_string(),
        ];
        args.extend(opts.apiserver_args.iter().cloned());
        cp.spawn(Component::KubeApiserver, &args)?;
        let admin = kube_client_for(&cp.kubeconfig).await?;
        cp.wait_ready(Component::KubeApiserver, opts.startup_timeout, || {
            let admin = admin.clone();
            async move { expect_ok(&admin, "/readyz").await }
        })
        .await?;
        let apiserver_time = t.elapsed();

        // kube-controller-manager
        let mut kcm_time = None;
        if opts.controller_manager {
            let t = Instant::now();
            let kc = cp.kubeconfig.display().to_string();
            let p = &cp.pki;
            let mut args = vec![
                format!("--kubeconfig={kc}"),
                format!("--authentication-kubeconfig={kc}"),
                format!("--authorization-kubeconfig={kc}"),
                "--bind-address=127.0.0.1".to_string(),
                format!("--secure-port={kcm_port}"),
                format!(
                    "--tls-cert-file={}",
                    p.controller_manager.cert_path.display()
                ),
                format!(
                    "--tls-private-key-file={}",
                    p.controller_manager.key_path.display()
                ),
                "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics".to_string(),
                "--leader-elect=false".to_string(),
                format!("--controllers={}", opts.controllers.join(",")),
                "--use-service-account-credentials=false".to_string(),
                format!("--service-account-private-key-file={}", p.sa_key.display()),
                format!("--root-ca-file={}", p.cas.cluster.cert_path.display()),
                "--kube-api-qps=100".to_string(),
                "--kube-api-burst=200".to_string(),
                "--v=1".to_string(),
            ];
            args.extend(opts.controller_manager_args.iter().cloned());
            cp.spawn(Component::KubeControllerManager, &args)?;
            let url = format!("https://127.0.0.1:{kcm_port}");
            let kcm_kubeconfig = cp.root.join("kcm-health.kubeconfig");
            fs::write(
                &kcm_kubeconfig,
                kubeconfig_yaml(&url, &cp.pki.cas.cluster.cert_pem, "admin", &cp.pki.admin),
            )?;
            let kcm = kube_client_for(&kcm_kubeconfig).await?;
            cp.wait_ready(
                Component::KubeControllerManager,
                opts.startup_timeout,
                || {
                    let kcm = kcm.clone();
                    async move { expect_ok(&kcm, "/healthz").await }
                },
            )
            .await?;
            cp.controller_manager_url = Some(url);
            kcm_time = Some(t.elapsed());
        }

        eprintln!(
            "[controlplane] ready in {:.1?} (pki {:.1?}, etcd {:.1?}, kube-apiserver {:.1?}{}) at {} — dir {}",
            t0.elapsed(),
            pki_time,
            etcd_time,
            apiserver_time,
            kcm_time
                .map(|t| format!(", kube-controller-manager {t:.1?}"))
                .unwrap_or_default(),
            cp.server_url,
            cp.root.display()
        );
        Ok(cp)
    }

    /// Admin kubeconfig (user `kubernetes-admin`, group `system:masters`, certificates embedded).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// `https://127.0.0.1:<port>` of kube-apiserver.
    pub fn server_url(&self) -> &str {
        &self.server_url
    }

    /// `http://127.0.0.1:<port>` of etcd.
    pub fn etcd_url(&self) -> &str {
        &self.etcd_url
    }

    /// `https://127.0.0.1:<port>` of kube-controller-manager, if it was started.
    pub fn controller_manager_url(&self) -> Option<&str> {
        self.controller_manager_url.as_deref()
    }

    /// PEM of the cluster CA: it signed kube-apiserver's serving certificate and every client
    /// certificate (`--client-ca-file`); use it as `caBundle` for an APIService whose server
    /// certificate comes from [`ControlPlane::issue_serving_cert`].
    pub fn ca_pem(&self) -> &str {
        &self.pki.cas.cluster.cert_pem
    }

    /// Path of the cluster CA certificate (same as [`ControlPlane::client_ca_path`]).
    pub fn ca_cert_path(&self) -> &Path {
        &self.pki.cas.cluster.cert_path
    }

    /// The cluster CA's certificate and key, to sign further certificates in-process.
    pub fn ca(&self) -> &CertPair {
        &self.pki.cas.cluster
    }

    /// `--client-ca-file` of kube-apiserver (the cluster CA).
    pub fn client_ca_path(&self) -> &Path {
        &self.pki.cas.cluster.cert_path
    }

    /// `--requestheader-client-ca-file`: the separate front-proxy CA. An extension API server
    /// must verify the aggregator's client certificate against it (and check the CN against
    /// [`ControlPlane::front_proxy_allowed_names`]).
    pub fn front_proxy_ca_path(&self) -> &Path {
        &self.pki.cas.front_proxy.cert_path
    }

    /// PEM of the front-proxy CA.
    pub fn front_proxy_ca_pem(&self) -> &str {
        &self.pki.cas.front_proxy.cert_pem
    }

    /// `--requestheader-allowed-names`.
    pub fn front_proxy_allowed_names(&self) -> &'static [&'static str] {
        &["front-proxy-client"]
    }

    /// The client certificate the aggregator presents to extension servers
    /// (`--proxy-client-cert-file`/`--proxy-client-key-file`, CN=front-proxy-client). Tests can
    /// use it to talk to an extension server directly, as the aggregator would.
    pub fn front_proxy_client(&self) -> &CertPair {
        &self.pki.front_proxy_client
    }

    /// Service-account signing key (`--service-account-signing-key-file`, PEM, EC P-256).
    pub fn service_account_key_path(&self) -> &Path {
        &self.pki.sa_key
    }

    /// The process id of a running component (for benchmarks that read its memory and CPU).
    pub fn pid(&self, component: Component) -> Result<u32> {
        self.procs
            .iter()
            .find(|p| p.component == component)
            .map(|p| p.child.id())
            .with_context(|| format!("{component} is not running in this control plane"))
    }

    /// Temporary directory holding PKI, kubeconfigs, logs and etcd data.
    pub fn dir(&self) -> &Path {
        &self.root
    }

    /// Directory the binaries were taken from.
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// Log file of a component (stdout and stderr).
    pub fn log_path(&self, component: Component) -> PathBuf {
        self.root
            .join("logs")
            .join(format!("{}.log", component.name()))
    }

    /// The last `lines` lines of a component's log.
    pub fn log_tail(&self, component: Component, lines: usize) -> String {
        tail_file(&self.log_path(component), lines)
    }

    /// A kube-rs client authenticated as the admin (`system:masters`).
    pub async fn client(&self) -> Result<kube::Client> {
        kube_client_for(&self.kubeconfig).await
    }

    /// Writes a kubeconfig for user `name` in `groups`, authenticated by a client certificate
    /// (CN=name, one O= per group) signed by the cluster CA, and returns its path. The user has
    /// no permissions until RBAC grants them (`system:authenticated` is added by the apiserver).
    pub async fn user_kubeconfig(&self, name: &str, groups: &[&str]) -> Result<PathBuf> {
        let cert = self.issue_client_cert(name, groups).await?;
        // users/<name>-<n>.kubeconfig next to users/<name>-<n>.crt: unique per call.
        let path = cert.cert_path.with_extension("kubeconfig");
        fs::write(
            &path,
            kubeconfig_yaml(
                &self.server_url,
                &self.pki.cas.cluster.cert_pem,
                name,
                &cert,
            ),
        )?;
        Ok(path)
    }

    /// A kube-rs client for user `name` in `groups` (see [`ControlPlane::user_kubeconfig`]).
    pub async fn user_client(&self, name: &str, groups: &[&str]) -> Result<kube::Client> {
        let path = self.user_kubeconfig(name, groups).await?;
        kube_client_for(&path).await
    }

    /// A client certificate (CN=`name`, one O= per group) signed by the cluster CA.
    pub async fn issue_client_cert(&self, name: &str, groups: &[&str]) -> Result<CertPair> {
        if name.is_empty() {
            bail!("a user name must not be empty");
        }
        let mut subject = String::new();
        for g in groups {
            subject.push_str("/O=");
            subject.push_str(&escape_subject(g));
        }
        subject.push_str("/CN=");
        subject.push_str(&escape_subject(name));
        let stem = unique_stem(&file_stem(name));
        self.pki
            .cas
            .leaf(
                &self.users_dir(),
                &stem,
                &subject,
                "clientAuth",
                &[],
                CaKind::Cluster,
            )
            .await
    }

    /// A serving certificate signed by the cluster CA for the given subject alternative names
    /// (entries that parse as IP addresses become IP SANs, the rest DNS SANs). For an extension
    /// server behind an APIService use e.g. `["reports-api.reports-system.svc", "localhost",
    /// "127.0.0.1"]`: the aggregator verifies `<service>.<namespace>.svc`, and
    /// [`ControlPlane::ca_pem`] is the `caBundle`.
    pub async fn issue_serving_cert(&self, name: &str, sans: &[&str]) -> Result<CertPair> {
        if sans.is_empty() {
            bail!("a serving certificate needs at least one subject alternative name");
        }
        let stem = unique_stem(&format!("serving-{}", file_stem(name)));
        let subject = format!("/CN={}", escape_subject(name));
        self.pki
            .cas
            .leaf(
                &self.users_dir(),
                &stem,
                &subject,
                "serverAuth",
                sans,
                CaKind::Cluster,
            )
            .await
    }

    /// A client certificate (CN=`name`) signed by the **front-proxy** CA, i.e. one that chains to
    /// `--requestheader-client-ca-file`. With a CN outside
    /// [`ControlPlane::front_proxy_allowed_names`] an extension server must not trust the
    /// `X-Remote-*` headers that come with it.
    pub async fn issue_front_proxy_cert(&self, name: &str) -> Result<CertPair> {
        if name.is_empty() {
            bail!("a certificate name must not be empty");
        }
        let stem = unique_stem(&format!("front-proxy-{}", file_stem(name)));
        let subject = format!("/CN={}", escape_subject(name));
        self.pki
            .cas
            .leaf(
                &self.users_dir(),
                &stem,
                &subject,
                "clientAuth",
                &[],
                CaKind::FrontProxy,
            )
            .await
    }

    /// Writes a kubeconfig for an arbitrary `server` URL (for example an extension server's own
    /// port, to talk to it without the aggregator) that trusts the cluster CA and authenticates
    /// with `auth`, and returns its path (under the control plane's directory, unique per call).
    pub fn kubeconfig_for_server(
        &self,
        name: &str,
        server: &str,
        auth: KubeconfigAuth<'_>,
    ) -> Result<PathBuf> {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
        let q = |s: &str| serde_json::to_string(s).expect("string serializes");
        let user = match auth {
            KubeconfigAuth::Anonymous => "{}".to_string(),
            KubeconfigAuth::Token(token) => format!("{{token: {}}}", q(token)),
            KubeconfigAuth::ClientCert(cert) => format!(
                "{{client-certificate-data: {}, client-key-data: {}}}",
                q(&b64(&cert.cert_pem)),
                q(&b64(&cert.key_pem))
            ),
        };
        let yaml = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: u\n  user: {user}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\n    namespace: default\ncurrent-context: c\npreferences: {{}}\n",
            server = q(server),
            ca = b64(&self.pki.cas.cluster.cert_pem),
        );
        let path = self
            .users_dir()
            .join(format!("{}.kubeconfig", unique_stem(&file_stem(name))));
        fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    /// Makes kube-apiserver's aggregator route `/apis/<group>/<version>` to a server listening on
    /// this machine: applies (server-side) the Service's namespace, an `ExternalName` Service
    /// pointing at `svc.external_name` (default `localhost`) and the APIService
    /// `<version>.<group>` with `service.port = svc.port`. Wait with
    /// [`ControlPlane::wait_apiservice_available`]; delete the APIService before stopping the
    /// server, or namespace deletion blocks on failed discovery.
    pub async fn register_external_apiservice(&self, svc: &ExternalApiService) -> Result<()> {
        use k8s_openapi::{
            api::core::v1::{Namespace, Service, ServiceSpec},
            kube_aggregator::pkg::apis::apiregistration::v1::{
                APIService, APIServiceSpec, ServiceReference,
            },
        };
        use kube::api::{ObjectMeta, Patch, PatchParams};
        let client = self.client().await?;
        let pp = PatchParams::apply("reports-server-e2e").force();
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(svc.service_namespace.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        kube::Api::<Namespace>::all(client.clone())
            .patch(&svc.service_namespace, &pp, &Patch::Apply(&ns))
            .await
            .with_context(|| format!("applying namespace {}", svc.service_namespace))?;
        let service = Service {
            metadata: ObjectMeta {
                name: Some(svc.service_name.clone()),
                namespace: Some(svc.service_namespace.clone()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                type_: Some("ExternalName".into()),
                external_name: Some(svc.external_name.clone()),
                ..Default::default()
            }),
            ..Default::default()
        };
        kube::Api::<Service>::namespaced(client.clone(), &svc.service_namespace)
            .patch(&svc.service_name, &pp, &Patch::Apply(&service))
            .await
            .with_context(|| format!("applying service {}", svc.service_name))?;
        let api_service = APIService {
            metadata: ObjectMeta {
                name: Some(svc.name()),
                ..Default::default()
            },
            spec: Some(APIServiceSpec {
                group: Some(svc.group.clone()),
                version: Some(svc.version.clone()),
                group_priority_minimum: svc.group_priority_minimum,
                version_priority: svc.version_priority,
                service: Some(ServiceReference {
                    namespace: Some(svc.service_namespace.clone()),
                    name: Some(svc.service_name.clone()),
                    port: Some(i32::from(svc.port)),
                }),
                ca_bundle: svc
                    .ca_bundle_pem
                    .as_ref()
                    .map(|pem| k8s_openapi::ByteString(pem.as_bytes().to_vec())),
                insecure_skip_tls_verify: svc.ca_bundle_pem.is_none().then_some(true),
            }),
            ..Default::default()
        };
        kube::Api::<APIService>::all(client)
            .patch(&svc.name(), &pp, &Patch::Apply(&api_service))
            .await
            .with_context(|| format!("applying APIService {}", svc.name()))?;
        Ok(())
    }

    /// Waits until APIService `name` (e.g. `v1alpha2.wgpolicyk8s.io`) has `Available=True`.
    pub async fn wait_apiservice_available(&self, name: &str, timeout: Duration) -> Result<()> {
        use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
        let api = kube::Api::<APIService>::all(self.client().await?);
        let deadline = Instant::now() + timeout;
        loop {
            let current = api.get_opt(name).await?;
            let cond = current
                .as_ref()
                .and_then(|a| a.status.as_ref())
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| c.iter().find(|c| c.type_ == "Available"))
                .cloned();
            match &cond {
                Some(c) if c.status == "True" => return Ok(()),
                _ if Instant::now() >= deadline => {
                    bail!(
                        "APIService {name} not Available after {timeout:?}: {}",
                        match (&current, cond) {
                            (None, _) => "it does not exist".to_string(),
                            (Some(_), None) => "no Available condition yet".to_string(),
                            (Some(_), Some(c)) => format!(
                                "{} {}: {}",
                                c.status,
                                c.reason.unwrap_or_default(),
                                c.message.unwrap_or_default()
                            ),
                        }
                    )
                }
                _ => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
    }

    /// Deletes APIService `name` (no error if it does not exist).
    pub async fn delete_apiservice(&self, name: &str) -> Result<()> {
        use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
        let api = kube::Api::<APIService>::all(self.client().await?);
        match api.delete(name, &Default::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Stops every process (SIGTERM to its process group, SIGKILL after a grace period), in
    /// reverse start order, and removes the temporary directory unless
    /// `REPORTS_SERVER_KEEP_E2E=1`.
    pub async fn stop(mut self) -> Result<()> {
        let t0 = Instant::now();
        let mut errors = Vec::new();
        while let Some(mut p) = self.procs.pop() {
            signal_group(&p.child, libc::SIGTERM);
            let deadline = Instant::now() + STOP_GRACE;
            loop {
                match p.child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(50)).await
                    }
                    Ok(None) => {
                        signal_group(&p.child, libc::SIGKILL);
                        if let Err(e) = p.child.wait() {
                            errors.push(format!("{}: {e}", p.component));
                        }
                        break;
                    }
                    Err(e) => {
                        errors.push(format!("{}: {e}", p.component));
                        break;
                    }
                }
            }
        }
        eprintln!("[controlplane] stopped in {:.1?}", t0.elapsed());
        self.cleanup_dir();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(anyhow!("stopping the control plane: {}", errors.join("; ")))
        }
    }

    fn users_dir(&self) -> PathBuf {
        self.root.join("users")
    }

    fn cleanup_dir(&mut self) {
        if let Some(dir) = self.dir.take() {
            if keep_requested() {
                let path = dir.keep();
                eprintln!("[controlplane] {KEEP_ENV}=1: kept {}", path.display());
            } else if let Err(e) = dir.close() {
                eprintln!(
                    "[controlplane] could not remove {}: {e}",
                    self.root.display()
                );
            }
        }
    }

    fn spawn(&mut self, component: Component, args: &[String]) -> Result<()> {
        let bin = self.bin_dir.join(component.name());
        let log = self.log_path(component);
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = Command::new(&bin);
        cmd.args(args)
            .current_dir(&self.root)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            // Own process group, so that stop/drop can signal everything the process started
            // and Ctrl-C of the test run is not what stops it.
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                // Die with the (long-lived) spawner thread, i.e. with the test process, even if
                // it is killed before Drop runs.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child =
            spawn_from_reaper_thread(cmd).with_context(|| format!("starting {}", bin.display()))?;
        self.procs.push(Proc { component, child });
        Ok(())
    }

    /// Polls `probe` until it succeeds; fails early if the process exits, and on failure or
    /// timeout reports the last probe error and the tail of the component's log.
    async fn wait_ready<F, Fut>(
        &mut self,
        component: Component,
        timeout: Duration,
        mut probe: F,
    ) -> Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<()>>,
    {
        let deadline = Instant::now() + timeout;
        let mut last_err = anyhow!("not probed yet");
        loop {
            let exited = {
                let p = self
                    .procs
                    .iter_mut()
                    .find(|p| p.component == component)
                    .ok_or_else(|| anyhow!("{component} was not started"))?;
                p.child.try_wait()?
            };
            if let Some(status) = exited {
                return Err(self.startup_error(component, exited_msg(status)));
            }
            match tokio::time::timeout(Duration::from_secs(5), probe()).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => last_err = e,
                Err(_) => last_err = anyhow!("probe timed out after 5s"),
            }
            if Instant::now() >= deadline {
                return Err(self.startup_error(
                    component,
                    format!("not ready after {timeout:?}; last probe error: {last_err:#}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    fn startup_error(&self, component: Component, what: String) -> anyhow::Error {
        let log = self.log_path(component);
        anyhow!(
            "{component} failed to start: {what}\n--- last {LOG_TAIL_LINES} lines of {} ---\n{}",
            log.display(),
            tail_file(&log, LOG_TAIL_LINES)
        )
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        while let Some(mut p) = self.procs.pop() {
            signal_group(&p.child, libc::SIGTERM);
            let deadline = Instant::now() + STOP_GRACE;
            loop {
                match p.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    Ok(None) => {
                        signal_group(&p.child, libc::SIGKILL);
                        let _ = p.child.wait();
                        break;
                    }
                }
            }
        }
        self.cleanup_dir();
    }
}

fn exited_msg(status: ExitStatus) -> String {
    format!("process exited early ({status})")
}

fn signal_group(child: &Child, signal: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        return;
    };
    // SAFETY: plain syscall; the child is its own process group leader (process_group(0)) and
    // has not been reaped yet, so the id cannot have been reused.
    unsafe {
        libc::kill(-pid, signal);
    }
}

fn keep_requested() -> bool {
    std::env::var(KEEP_ENV).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// Spawns a helper process (for example the server under test) the way the control plane's own
/// processes are spawned: with `PR_SET_PDEATHSIG=SIGKILL`, from a thread that lives as long as
/// the test process, so the child dies with the test process even if that is killed before any
/// `Drop` runs. Unlike the control plane's processes it stays in the caller's process group.
pub fn spawn_tied_to_test(mut cmd: Command) -> io::Result<Child> {
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    spawn_from_reaper_thread(cmd)
}

/// All control-plane processes are forked from one thread that lives as long as the test
/// process, so that `PR_SET_PDEATHSIG` (which fires when the forking *thread* exits) kills them
/// only when the test process goes away — not when a tokio test thread finishes.
fn spawn_from_reaper_thread(cmd: Command) -> io::Result<Child> {
    type Request = (Command, mpsc::Sender<io::Result<Child>>);
    static SPAWNER: OnceLock<mpsc::Sender<Request>> = OnceLock::new();
    let tx = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("controlplane-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawning the control plane's spawner thread");
        tx
    });
    let (reply_tx, reply_rx) = mpsc::channel();
    tx.send((cmd, reply_tx))
        .map_err(|_| io::Error::other("control plane spawner thread is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| io::Error::other("control plane spawner thread is gone"))?
}

// ---- binaries ----------------------------------------------------------------------------------

/// Workspace root (the parent of this crate's directory), read at run time: `cargo test` and
/// `cargo xtask test` set `CARGO_MANIFEST_DIR` for the binaries they run. The value compiled in
/// is only the fallback: with a target directory shared by several checkouts (CI's cache, a
/// developer's clones) cargo reuses this library when its sources are the same, and the path
/// compiled in is then another checkout's, whose manifests and fixtures may be older.
pub fn workspace_root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .parent()
        .expect("tests crate has a parent directory")
        .to_path_buf()
}

/// Directory with the control-plane binaries: `$REPORTS_SERVER_CONTROLPLANE_BIN`, or the cache
/// filled by `tests/controlplane/build.sh` (run at most once per test process; the script is a
/// no-op when the cache is complete).
pub async fn binaries_dir(need_controller_manager: bool) -> Result<PathBuf> {
    static BUILT: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    let dir = match std::env::var_os(BIN_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => BUILT.get_or_try_init(run_build_script).await?.clone(),
    };
    let mut needed = vec![Component::Etcd, Component::KubeApiserver];
    if need_controller_manager {
        needed.push(Component::KubeControllerManager);
    }
    let missing: Vec<_> = needed
        .iter()
        .filter(|c| !is_executable(&dir.join(c.name())))
        .map(|c| c.name())
        .collect();
    if !missing.is_empty() {
        bail!(
            "{} lacks {} (from {}; unset {BIN_ENV} to build them with tests/controlplane/build.sh)",
            dir.display(),
            missing.join(", "),
            if std::env::var_os(BIN_ENV).is_some() {
                BIN_ENV
            } else {
                "the build script"
            }
        );
    }
    Ok(dir)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

async fn run_build_script() -> Result<PathBuf> {
    run_cache_build_script(
        "tests/controlplane/build.sh",
        &format!(
            "the control plane (needs Go >= 1.26 and the Go module proxy; or set {BIN_ENV} to a \
             directory with etcd, kube-apiserver and kube-controller-manager)"
        ),
    )
    .await
}

/// Runs one of the repository's cached Go build scripts (`tests/controlplane/build.sh`,
/// `tests/kyverno/build.sh`): forwards its progress (a cold build takes minutes), keeps the tail
/// of its stderr for the error, and returns the directory its last stdout line names. `what`
/// says what is built and what to do when the build cannot run.
pub async fn run_cache_build_script(relative: &str, what: &str) -> Result<PathBuf> {
    let script = workspace_root().join(relative);
    let mut child = tokio::process::Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running bash {} (needs bash)", script.display()))?;
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    let err_task = tokio::spawn(async move {
        let mut tail = VecDeque::new();
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if !line.starts_with("go: downloading") && !line.starts_with("go: added") {
                eprintln!("{line}");
            }
            if tail.len() == 30 {
                tail.pop_front();
            }
            tail.push_back(line);
        }
        tail.into_iter().collect::<Vec<_>>().join("\n")
    });
    let mut out = String::new();
    BufReader::new(stdout).read_to_string(&mut out).await?;
    let status = child.wait().await?;
    let err_tail = err_task.await.unwrap_or_default();
    if !status.success() {
        bail!(
            "building {what} failed ({status}): bash {}\n--- last lines ---\n{err_tail}",
            script.display()
        );
    }
    out.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| PathBuf::from(l.trim()))
        .ok_or_else(|| anyhow!("{} printed no directory", script.display()))
}

// ---- PKI ---------------------------------------------------------------------------------------

#[derive(Clone, Copy)]
enum CaKind {
    Cluster,
    FrontProxy,
}

/// The two CAs and the openssl config, able to issue leaf certificates.
struct Cas {
    dir: PathBuf,
    cluster: CertPair,
    front_proxy: CertPair,
}

struct Pki {
    cas: Cas,
    apiserver: CertPair,
    admin: CertPair,
    front_proxy_client: CertPair,
    controller_manager: CertPair,
    sa_key: PathBuf,
    sa_pub: PathBuf,
}

const OPENSSL_CNF: &str = "\
# Minimal config so that the distribution's openssl.cnf cannot add extensions.
[req]
distinguished_name = req_dn
string_mask = utf8only
utf8 = yes
[req_dn]
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, digitalSignature, keyCertSign, cRLSign
subjectKeyIdentifier = hash
";

async fn check_openssl() -> Result<()> {
    let out = tokio::process::Command::new("openssl")
        .arg("version")
        .output()
        .await;
    match out {
        Ok(o) if o.status.success() => Ok(()),
        _ => bail!(
            "the `openssl` command-line tool is needed to generate the control plane's PKI; \
             install it (Debian/Ubuntu: apt-get install openssl)"
        ),
    }
}

impl Pki {
    async fn generate(dir: &Path) -> Result<Pki> {
        fs::write(dir.join("openssl.cnf"), OPENSSL_CNF)?;
        let (ca, front_proxy_ca, ()) = tokio::try_join!(
            Cas::ca(dir, "ca", "reports-server-e2e-ca"),
            Cas::ca(dir, "front-proxy-ca", "reports-server-e2e-front-proxy-ca"),
            async {
                openssl(
                    dir,
                    &[
                        "genpkey",
                        "-algorithm",
                        "EC",
                        "-pkeyopt",
                        "ec_paramgen_curve:P-256",
                        "-out",
                        "sa.key",
                    ],
                )
                .await?;
                openssl(dir, &["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"]).await
            },
        )?;
        let cas = Cas {
            dir: dir.to_path_buf(),
            cluster: ca,
            front_proxy: front_proxy_ca,
        };
        let (apiserver, admin, front_proxy_client, controller_manager) = tokio::try_join!(
            cas.leaf(
                dir,
                "apiserver",
                "/CN=kube-apiserver",
                "serverAuth",
                &[
                    "localhost",
                    "kubernetes",
                    "kubernetes.default",
                    "kubernetes.default.svc",
                    "kubernetes.default.svc.cluster.local",
                    "127.0.0.1",
                    "::1",
                    "10.0.0.1",
                ],
                CaKind::Cluster,
            ),
            cas.leaf(
                dir,
                "admin",
                "/O=system:masters/CN=kubernetes-admin",
                "clientAuth",
                &[],
                CaKind::Cluster,
            ),
            cas.leaf(
                dir,
                "front-proxy-client",
                "/CN=front-proxy-client",
                "clientAuth",
                &[],
                CaKind::FrontProxy,
            ),
            cas.leaf(
                dir,
                "kube-controller-manager",
                "/CN=kube-controller-manager",
                "serverAuth",
                &["localhost", "127.0.0.1"],
                CaKind::Cluster,
            ),
        )?;
        Ok(Pki {
            cas,
            apiserver,
            admin,
            front_proxy_client,
            controller_manager,
            sa_key: dir.join("sa.key"),
            sa_pub: dir.join("sa.pub"),
        })
    }
}

impl Cas {
    async fn ca(dir: &Path, stem: &str, cn: &str) -> Result<CertPair> {
        let (crt, key) = (format!("{stem}.crt"), format!("{stem}.key"));
        let serial = random_serial();
        let subj = format!("/CN={cn}");
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &crt,
                "-subj",
                &subj,
                "-days",
                "3650",
                "-set_serial",
                &serial,
                "-extensions",
                "v3_ca",
            ],
        )
        .await?;
        CertPair::load(dir.join(crt), dir.join(key))
    }

    /// Key + certificate `<out_dir>/<stem>.key/.crt` signed by one of the CAs.
    #[allow(clippy::too_many_arguments)]
    async fn leaf(
        &self,
        out_dir: &Path,
        stem: &str,
        subject: &str,
        eku: &str,
        sans: &[&str],
        ca: CaKind,
    ) -> Result<CertPair> {
        let base = out_dir;
        let ca = match ca {
            CaKind::Cluster => &self.cluster,
            CaKind::FrontProxy => &self.front_proxy,
        };
        let (crt, key, csr, ext) = (
            base.join(format!("{stem}.crt")),
            base.join(format!("{stem}.key")),
            base.join(format!("{stem}.csr")),
            base.join(format!("{stem}.ext")),
        );
        let mut ext_text = String::from(
            "[ext]\nbasicConstraints = critical, CA:FALSE\n\
             keyUsage = critical, digitalSignature\n\
             subjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid\n",
        );
        ext_text.push_str(&format!("extendedKeyUsage = {eku}\n"));
        if !sans.is_empty() {
            let names: Vec<String> = sans
                .iter()
                .map(|s| match s.parse::<std::net::IpAddr>() {
                    Ok(_) => format!("IP:{s}"),
                    Err(_) => format!("DNS:{s}"),
                })
                .collect();
            ext_text.push_str(&format!("subjectAltName = {}\n", names.join(",")));
        }
        fs::write(&ext, ext_text)?;
        let p = |p: &Path| p.display().to_string();
        openssl(
            &self.dir,
            &[
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-utf8",
                "-keyout",
                &p(&key),
                "-out",
                &p(&csr),
                "-subj",
                subject,
            ],
        )
        .await?;
        let serial = random_serial();
        openssl(
            &self.dir,
            &[
                "x509",
                "-req",
                "-in",
                &p(&csr),
                "-CA",
                &p(&ca.cert_path),
                "-CAkey",
                &p(&ca.key_path),
                "-set_serial",
                &serial,
                "-days",
                "3650",
                "-extfile",
                &p(&ext),
                "-extensions",
                "ext",
                "-out",
                &p(&crt),
            ],
        )
        .await?;
        let _ = fs::remove_file(&csr);
        CertPair::load(crt, key)
    }
}

async fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let out = tokio::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .env("OPENSSL_CONF", dir.join("openssl.cnf"))
        .stdin(Stdio::null())
        .output()
        .await
        .context("running openssl (install the openssl CLI)")?;
    if !out.status.success() {
        bail!(
            "openssl {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn random_serial() -> String {
    let a = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let b = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    // Positive 127-bit serial.
    format!("0x{:016x}{:016x}", a & 0x7fff_ffff_ffff_ffff, b)
}

/// Escapes a value for openssl's `-subj` syntax (`/type=value/...`).
fn escape_subject(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        if matches!(c, '\\' | '/' | '+' | ',') {
            s.push('\\');
        }
        s.push(c);
    }
    s
}

fn file_stem(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() { "user".to_string() } else { s }
}

fn unique_stem(stem: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{stem}-{}", N.fetch_add(1, Ordering::Relaxed))
}

fn kubeconfig_yaml(server: &str, ca_pem: &str, user: &str, cert: &CertPair) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    // JSON strings are valid YAML scalars: safe for any user name.
    let q = |s: &str| serde_json::to_string(s).expect("string serializes");
    let context = format!("{user}@{CLUSTER_NAME}");
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: {cluster}\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: {user}\n  user:\n    client-certificate-data: {crt}\n    client-key-data: {key}\ncontexts:\n- name: {context}\n  context:\n    cluster: {cluster}\n    user: {user}\n    namespace: default\ncurrent-context: {context}\npreferences: {{}}\n",
        cluster = q(CLUSTER_NAME),
        server = q(server),
        ca = b64(ca_pem),
        user = q(user),
        crt = b64(&cert.cert_pem),
        key = b64(&cert.key_pem),
        context = q(&context),
    )
}

// ---- clients and probes ------------------------------------------------------------------------

/// A kube-rs client for a kubeconfig file (its current context).
pub async fn kube_client_for(kubeconfig: &Path) -> Result<kube::Client> {
    // kube's rustls backend takes the process-wide default provider; make sure it is ring even
    // if another crate in the graph enables a second provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .with_context(|| format!("loading {}", kubeconfig.display()))?;
    kube::Client::try_from(config).context("building a kube client")
}

async fn expect_ok(client: &kube::Client, path: &str) -> Result<()> {
    let req = http::Request::get(path).body(Vec::new())?;
    let text = client.request_text(req).await?;
    if text.trim_end().ends_with("ok") {
        Ok(())
    } else {
        Err(anyhow!("GET {path}: {}", text.trim()))
    }
}

/// Minimal HTTP/1.0 GET over plain TCP (for etcd's /health).
async fn http_get_plain(addr: &str, path: &str) -> Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("malformed HTTP response from {addr}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// `N` distinct free TCP ports on 127.0.0.1 (bound together, then released).
pub fn free_ports<const N: usize>() -> Result<[u16; N]> {
    let listeners = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<io::Result<Vec<_>>>()
        .context("binding 127.0.0.1:0")?;
    let mut ports = [0u16; N];
    for (p, l) in ports.iter_mut().zip(&listeners) {
        *p = l.local_addr()?.port();
    }
    Ok(ports)
}

pub(crate) fn tail_file(path: &Path, lines: usize) -> String {
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("<cannot read {}: {e}>", path.display()),
    }
}
