//! A real node for the end-to-end tests: containerd + runc (Debian packages) and a Go-built
//! kubelet and kube-scheduler (v1.36.3, `tests/node/build.sh`), next to the Go-built control
//! plane, so Deployments and StatefulSets really run, roll and restart. See `docs/e2e.md`
//! ("A real node") for the environment facts.
//!
//! # Isolation
//!
//! A kubelet and containerd change a machine in many ways (mounts, network links, cgroups,
//! kernel sysctls, files under `/var/lib`, `/var/log` and `/run`). None of that may leak into
//! the shared build machine, so [`run_isolated`] re-executes the test binary (only the one test)
//! inside new **PID, network and mount namespaces** (`unshare --pid --fork --mount-proc --net
//! --mount --propagation private`), and everything — etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler, containerd, kubelet, the pods and the test's own
//! clients — runs in there:
//!
//! * **Network**: the namespace has only `lo` and the pod bridge `cni0` (10.88.0.1/16, created
//!   before the kubelet so the node IP exists from the start). The control plane keeps using
//!   127.0.0.1, which is the namespace's own loopback. Host networking is never touched.
//! * **Mounts**: `/run`, `/var/lib` and `/var/log` are bind-mounted from the test's directory
//!   (containerd 1.6 hard-codes shim sockets under `/run/containerd`, network namespaces under
//!   `/run/netns`, and libcni caches results in `/var/lib/cni`; the kubelet writes symlinks to
//!   `/var/log/containers`). The kernel sysctls the kubelet insists on (`kernel.panic`,
//!   `vm.overcommit_memory`, …) are machine-wide, so read-only scratch files with the values it
//!   wants are bind-mounted over those `/proc/sys` entries and the kubelet runs with
//!   `protectKernelDefaults: true`: it checks them and never writes. All these mounts die with the
//!   namespace.
//! * **Processes**: the test binary's parent in there is PID 1 of the new PID namespace (a
//!   `bash` that reaps re-parented containerd shims). When it exits — normally, after a panic,
//!   or killed — the kernel kills every process left in the namespace, including containerd's
//!   shims and the containers, which `PR_SET_PDEATHSIG` alone would miss (shims re-parent).
//! * **Cgroups** (v1 here, shared with the machine): the kubelet gets its own `cgroupRoot`
//!   (`/reports-server-e2e-<pid>`), created in every hierarchy before it starts and removed by
//!   the outer test process afterwards, in every case.
//!
//! The outer process checks afterwards that the machine's sysctls, mounts, network links,
//! cgroups and processes are as they were.
//!
//! # Reaching pods and the API
//!
//! There is no kube-proxy and no CoreDNS. kube-apiserver runs with
//! `--enable-aggregator-routing=true`, so the aggregator sends APIService traffic straight to a
//! ready endpoint (pod IP) of the Service, which it can reach through `cni0`. `kubernetes.default`
//! (10.0.0.1:443, for in-cluster clients) is forwarded in-process to kube-apiserver's port
//! (kube-apiserver's certificate already names 10.0.0.1, so in-cluster TLS verification works
//! unchanged). Every other Service gets the user-space Service network of
//! [`crate::service_net`]: its ClusterIP on the namespace's `lo`, forwarded to a ready endpoint,
//! and its name answered by a DNS server on the node IP, which the kubelet writes into pods'
//! resolv.conf as `clusterDNS`.

use std::{
    collections::BTreeSet,
    fs::{self, File},
    future::Future,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use k8s_openapi::api::core::v1::Node as NodeObject;
use kube::Api;

use crate::controlplane::{
    ControlPlane, ControlPlaneOptions, DEFAULT_CONTROLLERS, KubeconfigAuth, free_ports,
    kube_client_for, run_cache_build_script, spawn_tied_to_test, tail_file, workspace_root,
};
use crate::postgres::which;
use crate::service_net::{OwnRuntime, ServiceNet, spawn_on_own_runtime};

/// The node's name (and the kubelet's client certificate CN `system:node:<name>`).
pub const NODE_NAME: &str = "e2e-node";
/// The node's IP: the pod bridge's address inside the test's network namespace.
pub const NODE_IP: &str = "10.88.0.1";
/// The pod network (bridge CNI with host-local IPAM).
pub const POD_SUBNET: &str = "10.88.0.0/16";
/// ClusterIP of `default/kubernetes` (first address of the control plane's service range).
pub const KUBERNETES_SERVICE_IP: &str = "10.0.0.1";
/// Image reference of the reports-server image (`tests/node/image.sh ref reports-server`).
pub const REPORTS_SERVER_IMAGE: &str = "localhost/reports-server:e2e";
/// The kubelet's cluster domain (Service names are `<svc>.<ns>.svc.cluster.local`).
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// The sandbox image containerd is configured with.
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10";
/// Image reference of the PostgreSQL image.
pub const POSTGRES_IMAGE: &str = "localhost/postgres:e2e";

/// Set (to the run directory) in the re-executed test process that runs inside the namespaces.
const INNER_ENV: &str = "REPORTS_SERVER_E2E_NODE_DIR";
/// Keep the run directory after the test (as `REPORTS_SERVER_KEEP_E2E` does for the control
/// plane).
const KEEP_ENV: &str = "REPORTS_SERVER_KEEP_E2E";
/// A test binary built elsewhere can point at kubelet + kube-scheduler directly.
const NODE_BIN_ENV: &str = "REPORTS_SERVER_NODE_BIN";
/// How long the whole isolated test may run before the outer process kills it.
const INNER_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// The kubelet writes these machine-wide sysctls unless they already have these values
/// (pkg/kubelet/cm/container_manager_linux.go, setupKernelTunables). Paths under /proc/sys.
const KUBELET_SYSCTLS: &[(&str, &str)] = &[
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];
/// The images every node test loads (built by the outer process, imported by the inner one).
const IMAGES: &[&str] = &["pause", "reports-server", "postgres"];

// ---- outer process: isolation, images, leak checks --------------------------------------------

/// Runs `body` in private PID, network and mount namespaces (see the module docs) and checks
/// afterwards that nothing was left on the machine. `test_name` must be the exact libtest name
/// of the calling test: the test binary is re-executed with `<test_name> --exact`.
///
/// In the outer process this builds the images and the node binaries, starts the inner process,
/// waits for it, cleans up and asserts. In the inner process (recognised by an environment
/// variable) it runs `body` on a multi-threaded tokio runtime.
pub fn run_isolated<F, Fut>(test_name: &str, body: F)
where
    F: FnOnce(RunDir) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    if let Some(dir) = std::env::var_os(INNER_ENV) {
        let dir = RunDir(PathBuf::from(dir));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        if let Err(e) = rt.block_on(async move {
            inner_setup().await?;
            body(dir).await
        }) {
            panic!("{e:?}");
        }
        return;
    }
    if let Err(e) = outer(test_name) {
        panic!("{e:?}");
    }
}

/// The directory of one isolated run: images, node state and the control plane's temporary
/// directory (`TMPDIR` points here in the inner process).
#[derive(Debug, Clone)]
pub struct RunDir(pub PathBuf);

impl RunDir {
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The docker-archive of one of the images (`pause`, `reports-server`, `postgres`).
    pub fn image(&self, name: &str) -> PathBuf {
        self.0.join("images").join(format!("{name}.tar"))
    }

    /// The directory with kubelet and kube-scheduler.
    pub fn node_bin(&self) -> PathBuf {
        fs::read_to_string(self.0.join("node-bin"))
            .map(|s| PathBuf::from(s.trim()))
            .unwrap_or_default()
    }
}

fn outer(test_name: &str) -> Result<()> {
    check_prerequisites()?;
    let t0 = Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Build first, outside the namespaces: the Go build needs the module proxy (the network) and
    // cargo the host's files.
    let node_bin = match std::env::var_os(NODE_BIN_ENV) {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => rt.block_on(run_cache_build_script(
            "tests/node/build.sh",
            &format!(
                "kubelet and kube-scheduler (needs Go >= 1.26 and the Go module proxy; or set \
                 {NODE_BIN_ENV} to a directory with both)"
            ),
        ))?,
    };
    // The control plane's binaries too, so the inner process (no network) finds them cached.
    rt.block_on(crate::controlplane::binaries_dir(true))?;
    for b in ["kubelet", "kube-scheduler"] {
        ensure!(
            node_bin.join(b).is_file(),
            "{} has no {b} (run bash tests/node/build.sh)",
            node_bin.display()
        );
    }

    let run = tempfile::Builder::new()
        .prefix("reports-server-node-")
        .tempdir()
        .context("creating the node test's directory")?;
    // Mode 0755: pods' processes (non-root) traverse paths under it only through their own
    // mounts, but containerd's overlay layers live under it and need no special mode.
    fs::set_permissions(run.path(), fs::Permissions::from_mode(0o755))?;
    fs::write(run.path().join("node-bin"), node_bin.display().to_string())?;
    let t_images = Instant::now();
    build_images(&run.path().join("images"))?;
    eprintln!(
        "[node] images built in {:.1?} (binaries ready after {:.1?})",
        t_images.elapsed(),
        t_images.duration_since(t0)
    );

    let before = HostState::capture()?;
    let cgroup_root = format!("reports-server-e2e-{}", std::process::id());
    fs::write(run.path().join("cgroup-root"), &cgroup_root)?;

    let exe = std::env::current_exe()?;
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--net",
        "--mount",
        "--propagation",
        "private",
        "--",
        "bash",
        "-c",
        // bash as PID 1 of the namespace: it waits for the test and reaps every process that
        // is re-parented to it (containerd shims). `; exit` keeps bash from exec'ing the test.
        "\"$@\"; exit $?",
        "node-init",
    ])
    .arg(&exe)
    .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
    .env(INNER_ENV, run.path())
    .env("TMPDIR", run.path())
    .stdin(Stdio::null());
    let t_inner = Instant::now();
    let mut child = spawn_tied_to_test(cmd).context("running unshare (util-linux)")?;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break Some(s);
        }
        if t_inner.elapsed() > INNER_TIMEOUT {
            // The inner process's namespace dies with its PID 1, which dies with unshare
            // (--kill-child), which is our child: killing it by pid ends everything in there.
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let inner_time = t_inner.elapsed();

    let cleanup = remove_cgroups(&cgroup_root);
    let after = HostState::capture()?;
    let leaks = before.compare(&after, run.path(), &cgroup_root);
    if keep_requested() {
        let kept = run.keep();
        eprintln!("[node] {KEEP_ENV}=1: kept {}", kept.display());
    } else if let Err(e) = run.close() {
        eprintln!("[node] could not remove the run directory: {e}");
    }
    eprintln!(
        "[node] inner test ran {inner_time:.1?}; whole test {:.1?}",
        t0.elapsed()
    );
    let leak_note = if leaks.is_empty() {
        String::from("nothing was left on the machine")
    } else {
        format!("traces left on the machine:\n{}", leaks.join("\n"))
    };
    match status {
        Some(s) if s.success() => {}
        Some(s) => {
            bail!("the isolated test {test_name} failed ({s}); see its output above; {leak_note}")
        }
        None => {
            bail!("the isolated test {test_name} did not finish in {INNER_TIMEOUT:?}; {leak_note}")
        }
    }
    cleanup?;
    ensure!(
        leaks.is_empty(),
        "the node test left traces on the machine:\n{}",
        leaks.join("\n")
    );
    eprintln!("[node] host unchanged: sysctls, mounts, links, cgroups, processes");
    Ok(())
}

fn keep_requested() -> bool {
    std::env::var(KEEP_ENV).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// Everything a node needs from the machine; fails naming the packages to install.
fn check_prerequisites() -> Result<()> {
    // SAFETY: plain syscall without arguments.
    let uid = unsafe { libc::geteuid() };
    ensure!(
        uid == 0,
        "the node tests need root (containerd, runc and the kubelet manage mounts, cgroups and \
         network namespaces); run them as root"
    );
    let mut missing = BTreeSet::new();
    for (cmd, pkg) in [
        ("containerd", "containerd"),
        ("containerd-shim-runc-v2", "containerd"),
        ("ctr", "containerd"),
        ("runc", "runc"),
        ("unshare", "util-linux"),
        ("mount", "mount"),
        ("ip", "iproute2"),
        ("gcc", "gcc"),
        ("objcopy", "binutils"),
        ("tar", "tar"),
    ] {
        if which(cmd).is_none() {
            missing.insert(pkg);
        }
    }
    for plugin in ["bridge", "host-local", "loopback"] {
        if !Path::new(CNI_BIN_DIR).join(plugin).is_file() {
            missing.insert("containernetworking-plugins");
        }
    }
    if !Path::new("/etc/ssl/certs/ca-certificates.crt").is_file() {
        missing.insert("ca-certificates");
    }
    if !Path::new("/bin/busybox").is_file() {
        missing.insert("busybox-static");
    }
    if fs::read_dir("/usr/lib/postgresql").is_err() {
        missing.insert("postgresql");
    }
    ensure!(
        missing.is_empty(),
        "the node tests need: apt-get install -y {} (see docs/e2e.md, \"A real node\")",
        missing.into_iter().collect::<Vec<_>>().join(" ")
    );
    Ok(())
}

const CNI_BIN_DIR: &str = "/usr/lib/cni";

/// Builds the three images with `tests/node/image.sh` (the static reports-server with cargo).
fn build_images(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir)?;
    let script = workspace_root().join("tests/node/image.sh");
    let bin = std::env::var("REPORTS_SERVER_IMAGE_BIN").ok();
    for name in IMAGES {
        let mut cmd = Command::new("bash");
        cmd.arg(&script)
            .arg("build")
            .arg(name)
            .arg(dir.join(format!("{name}.tar")));
        if *name == "reports-server"
            && let Some(bin) = &bin
        {
            cmd.arg(bin);
        }
        let t = Instant::now();
        let status = cmd
            .stdin(Stdio::null())
            .status()
            .with_context(|| format!("running bash {}", script.display()))?;
        ensure!(
            status.success(),
            "bash {} build {name} failed ({status})",
            script.display()
        );
        eprintln!("[node] image {name} in {:.1?}", t.elapsed());
    }
    Ok(())
}

/// What the node tests must not change on the machine.
struct HostState {
    sysctls: Vec<(String, String)>,
    mounts: BTreeSet<String>,
    links: BTreeSet<String>,
    cgroups: BTreeSet<String>,
}

impl HostState {
    fn capture() -> Result<Self> {
        let sysctls = KUBELET_SYSCTLS
            .iter()
            .map(|(k, _)| {
                let v = fs::read_to_string(Path::new("/proc/sys").join(k)).unwrap_or_default();
                (k.replace('/', "."), v.trim().to_string())
            })
            .collect();
        let mounts = fs::read_to_string("/proc/self/mountinfo")?
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
            .collect();
        let links = fs::read_dir("/sys/class/net")?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        let cgroups = cgroup_hierarchies()
            .iter()
            .flat_map(|h| fs::read_dir(h).into_iter().flatten())
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .map(|e| e.path().display().to_string())
            .collect();
        Ok(Self {
            sysctls,
            mounts,
            links,
            cgroups,
        })
    }

    /// What this run changed. Other engineers share the machine, so only traces that can come
    /// from a node are counted: mounts under the run directory or the paths a kubelet and
    /// containerd use, the pod bridge and veth links, this run's cgroup root, and processes whose
    /// command line names the run directory.
    fn compare(&self, after: &Self, run_dir: &Path, cgroup_root: &str) -> Vec<String> {
        let mut out = Vec::new();
        for ((k, a), (_, b)) in self.sysctls.iter().zip(&after.sysctls) {
            if a != b {
                out.push(format!("sysctl {k}: {a} -> {b}"));
            } else {
                eprintln!("[node] sysctl {k} = {b} (unchanged)");
            }
        }
        let run = run_dir.display().to_string();
        const NODE_PATHS: &[&str] = &[
            "/run/containerd",
            "/run/netns",
            "/run/runc",
            "/var/lib/kubelet",
            "/var/lib/containerd",
            "/var/lib/cni",
            "/var/log/pods",
            "/proc/sys",
        ];
        for m in after.mounts.difference(&self.mounts) {
            if m.starts_with(&run) || NODE_PATHS.iter().any(|p| m.starts_with(p)) {
                out.push(format!("new mount: {m}"));
            }
        }
        for l in after.links.difference(&self.links) {
            if l == "cni0" || l.starts_with("veth") {
                out.push(format!("new network link: {l}"));
            }
        }
        for c in after.cgroups.difference(&self.cgroups) {
            if c.contains(cgroup_root) {
                out.push(format!("new cgroup: {c}"));
            }
        }
        for p in processes_mentioning(&run) {
            out.push(format!("process left: {p}"));
        }
        out
    }
}

fn processes_mentioning(marker: &str) -> Vec<String> {
    let me = std::process::id().to_string();
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .chars()
                .all(|c| c.is_ascii_digit())
        })
        .filter(|e| e.file_name().to_string_lossy() != me)
        .filter_map(|e| {
            let cmdline = fs::read(e.path().join("cmdline")).ok()?;
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            text.contains(marker)
                .then(|| format!("{} {}", e.file_name().to_string_lossy(), text.trim()))
        })
        .collect()
}

/// The mounted cgroup hierarchies (v1 controllers, the named `systemd` one, and `unified`).
fn cgroup_hierarchies() -> Vec<PathBuf> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let fstype = post.split(' ').next()?;
            let mount_point = pre.split(' ').nth(4)?;
            (fstype == "cgroup" || fstype == "cgroup2")
                .then(|| PathBuf::from(mount_point))
                .filter(|p| p.starts_with("/sys/fs/cgroup"))
        })
        .collect()
}

/// Removes `<hierarchy>/<root>` and everything below it in every hierarchy, deepest first;
/// retries for a while because killed processes leave their cgroups a moment later.
fn remove_cgroups(root: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut left = Vec::new();
        for h in cgroup_hierarchies() {
            let top = h.join(root);
            if !top.exists() {
                continue;
            }
            let mut dirs = Vec::new();
            collect_dirs(&top, &mut dirs);
            // Deepest first: a cgroup can only be removed once it has no children.
            dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
            for d in dirs {
                if let Err(e) = fs::remove_dir(&d) {
                    left.push(format!("{}: {e}", d.display()));
                }
            }
        }
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("could not remove the node's cgroups: {}", left.join("; "));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            collect_dirs(&e.path(), out);
        }
    }
}

// ---- inner process: the namespaces' setup ------------------------------------------------------

/// Brings up the network namespace's loopback (a new namespace starts with `lo` down).
async fn inner_setup() -> Result<()> {
    run_cmd("ip", &["link", "set", "lo", "up"])?;
    Ok(())
}

fn run_cmd(cmd: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd}"))?;
    ensure!(
        out.status.success(),
        "{cmd} {} failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ensure_isolated() -> Result<()> {
    ensure!(
        std::env::var_os(INNER_ENV).is_some(),
        "Node::start only runs inside node::run_isolated (it changes mounts and network settings \
         that must stay inside private namespaces)"
    );
    Ok(())
}

// ---- the node ----------------------------------------------------------------------------------

/// What a node test gets: the control plane, containerd, kubelet and kube-scheduler.
pub struct Node {
    /// Dropped after the node's own processes (fields drop after `Drop::drop`); `None` only
    /// once `stop` has taken it.
    cp: Option<ControlPlane>,
    dir: PathBuf,
    procs: Vec<(&'static str, Child)>,
    forwarder: Option<OwnRuntime>,
    service_net: Option<ServiceNet>,
    containerd_socket: PathBuf,
}

impl Node {
    /// Starts the control plane (with kube-controller-manager, aggregator routing to endpoints),
    /// containerd with the images loaded, kube-scheduler and the kubelet, and waits until the node
    /// is Ready and schedulable.
    pub async fn start(run: &RunDir) -> Result<Node> {
        ensure_isolated()?;
        let t0 = Instant::now();
        let dir = run.path().join("node");
        for sub in [
            "run",
            "var-lib",
            "var-log",
            "sysctl",
            "containerd/root",
            "containerd/state",
            "containerd/opt",
            "cni/net.d",
            "cni/ipam",
            "kubelet",
            "pod-logs",
            "volume-plugins",
            "logs",
        ] {
            fs::create_dir_all(dir.join(sub))?;
        }
        mount_private_dirs(&dir)?;
        let cgroup_root = fs::read_to_string(run.path().join("cgroup-root"))?;
        create_cgroup_root(cgroup_root.trim())?;
        setup_network()?;

        let mut controllers: Vec<String> =
            DEFAULT_CONTROLLERS.iter().map(|s| s.to_string()).collect();
        controllers.extend(
            [
                // EndpointSlices/Endpoints of Services: what the aggregator routes to.
                "endpoints-controller",
                "endpointslice-controller",
                // PodDisruptionBudget status.
                "disruption-controller",
                // Removes the node's not-ready taint once the kubelet reports Ready.
                "node-lifecycle-controller",
                // Binds the StatefulSet's claims to pre-created PersistentVolumes.
                "persistentvolume-binder-controller",
                // Remove the claims' and volumes' protection finalizers once no pod uses them:
                // without them no namespace with a claim finishes terminating.
                "persistentvolumeclaim-protection-controller",
                "persistentvolume-protection-controller",
                "pod-garbage-collector-controller",
            ]
            .map(String::from),
        );
        let cp = ControlPlane::start(ControlPlaneOptions {
            controller_manager: true,
            controllers,
            apiserver_args: vec![
                // No kube-proxy: send APIService traffic to the endpoints (pod IPs) directly.
                "--enable-aggregator-routing=true".into(),
            ],
            ..ControlPlaneOptions::default()
        })
        .await?;
        let mut node = Node {
            cp: Some(cp),
            containerd_socket: dir.join("containerd/containerd.sock"),
            dir,
            procs: Vec::new(),
            forwarder: None,
            service_net: None,
        };
        node.forwarder = Some(forward_kubernetes_service(node.cp()).await?);
        node.service_net = Some(ServiceNet::start(
            node.cp().kubeconfig_path(),
            NODE_IP.parse()?,
            CLUSTER_DOMAIN,
            &[(KUBERNETES_SERVICE_IP.parse()?, 443)],
        )?);
        node.start_containerd().await?;
        for name in IMAGES {
            node.import_image(&run.image(name))?;
        }
        let bin = run.node_bin();
        node.start_scheduler(&bin).await?;
        node.start_kubelet(&bin, cgroup_root.trim()).await?;
        node.wait_node_ready(Duration::from_secs(120)).await?;
        eprintln!(
            "[node] node {NODE_NAME} Ready in {:.1?} (containerd, kubelet, kube-scheduler, control plane)",
            t0.elapsed()
        );
        Ok(node)
    }

    /// The control plane the node is registered with.
    pub fn cp(&self) -> &ControlPlane {
        self.cp
            .as_ref()
            .expect("the control plane lives as long as the node")
    }

    /// The node's directory (containerd, kubelet, pod logs, component logs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A component's log (`containerd`, `kubelet`, `kube-scheduler`).
    pub fn log_path(&self, component: &str) -> PathBuf {
        self.dir.join("logs").join(format!("{component}.log"))
    }

    /// The last lines of a component's log.
    pub fn log_tail(&self, component: &str, lines: usize) -> String {
        tail_file(&self.log_path(component), lines)
    }

    /// The logs of every container of a pod (from the kubelet's pod log directory).
    pub fn pod_logs(&self, namespace: &str, pod: &str, lines: usize) -> String {
        let mut out = String::new();
        let prefix = format!("{namespace}_{pod}_");
        for e in fs::read_dir(self.dir.join("pod-logs"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if !e.file_name().to_string_lossy().starts_with(&prefix) {
                continue;
            }
            let mut files = Vec::new();
            collect_files(&e.path(), &mut files);
            files.sort();
            for f in files {
                out.push_str(&format!(
                    "--- {} ---\n{}\n",
                    f.display(),
                    tail_file(&f, lines)
                ));
            }
        }
        out
    }

    /// Diagnostics for a failure: the node components' log tails.
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        for c in ["kubelet", "containerd", "kube-scheduler"] {
            out.push_str(&format!("--- {c} ---\n{}\n", self.log_tail(c, 25)));
        }
        out
    }

    fn spawn(&mut self, name: &'static str, mut cmd: Command) -> Result<()> {
        let log = File::create(self.log_path(name))?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .current_dir(&self.dir);
        let child = spawn_tied_to_test(cmd).with_context(|| format!("starting {name}"))?;
        self.procs.push((name, child));
        Ok(())
    }

    fn check_alive(&mut self, name: &str) -> Result<()> {
        if let Some((_, child)) = self.procs.iter_mut().find(|(n, _)| *n == name)
            && let Some(status) = child.try_wait()?
        {
            bail!(
                "{name} exited ({status})\n--- last lines of {} ---\n{}",
                self.log_path(name).display(),
                self.log_tail(name, 40)
            );
        }
        Ok(())
    }

    async fn start_containerd(&mut self) -> Result<()> {
        let d = &self.dir;
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
oom_score = 0
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  # Default /opt/containerd: would be created on the machine.
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # No CAP_SYS_RESOURCE here: containerd may not lower a sandbox's oom_score_adj below its own.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # No systemd on the build machines: the kubelet uses the cgroupfs driver too.
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
"#,
            root = d.join("containerd/root").display(),
            state = d.join("containerd/state").display(),
            sock = self.containerd_socket.display(),
            opt = d.join("containerd/opt").display(),
            cni_conf = d.join("cni/net.d").display(),
        );
        let config_path = d.join("containerd/config.toml");
        fs::write(&config_path, config)?;
        fs::write(
            d.join("cni/net.d/10-e2e.conflist"),
            serde_json::json!({
                "cniVersion": "1.0.0",
                "name": "e2e",
                "plugins": [{
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": true,
                    // Pods only talk to the namespace itself (kube-apiserver, the kubelet's
                    // probes): no NAT, so no iptables rules are needed.
                    "ipMasq": false,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": d.join("cni/ipam"),
                    },
                }],
            })
            .to_string(),
        )?;
        let mut cmd = Command::new("containerd");
        cmd.arg("--config").arg(&config_path);
        self.spawn("containerd", cmd)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.check_alive("containerd")?;
            if self.ctr(&["version"]).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "containerd did not answer on {} in 60s\n{}",
                    self.containerd_socket.display(),
                    self.log_tail("containerd", 40)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Gives an imported image a second reference, so that manifests naming a published image
    /// (`reports-server:0.1.0`, `docker.io/library/postgres:17`) run the locally built one: with
    /// a tag other than `latest` the kubelet's default pull policy is IfNotPresent and nothing is
    /// pulled.
    pub fn tag_image(&self, image: &str, as_ref: &str) -> Result<()> {
        let full = if as_ref
            .split('/')
            .next()
            .is_some_and(|h| h.contains('.') || h.contains(':'))
            && as_ref.contains('/')
        {
            as_ref.to_string()
        } else if as_ref.contains('/') {
            format!("docker.io/{as_ref}")
        } else {
            format!("docker.io/library/{as_ref}")
        };
        let _ = self.ctr(&["images", "rm", &full]);
        self.ctr(&["images", "tag", image, &full])?;
        Ok(())
    }

    /// `ctr` against this node's containerd, in the `k8s.io` namespace (the one CRI uses).
    pub fn ctr(&self, args: &[&str]) -> Result<String> {
        let sock = self.containerd_socket.display().to_string();
        let mut all = vec!["-a", sock.as_str(), "-n", "k8s.io"];
        all.extend_from_slice(args);
        run_cmd("ctr", &all)
    }

    fn import_image(&self, tar: &Path) -> Result<()> {
        let t = Instant::now();
        let tar_s = tar.display().to_string();
        self.ctr(&["images", "import", "--no-unpack", &tar_s])
            .or_else(|_| self.ctr(&["images", "import", &tar_s]))
            .with_context(|| format!("importing {}", tar.display()))?;
        eprintln!(
            "[node] imported {} in {:.1?}",
            tar.file_name().unwrap_or_default().to_string_lossy(),
            t.elapsed()
        );
        Ok(())
    }

    async fn start_scheduler(&mut self, bin: &Path) -> Result<()> {
        let [port] = free_ports::<1>()?;
        let cert = self
            .cp()
            .issue_serving_cert("kube-scheduler", &["localhost", "127.0.0.1"])
            .await?;
        let kc = self.cp().kubeconfig_path().display().to_string();
        let mut cmd = Command::new(bin.join("kube-scheduler"));
        cmd.args([
            format!("--kubeconfig={kc}"),
            format!("--authentication-kubeconfig={kc}"),
            format!("--authorization-kubeconfig={kc}"),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            format!("--tls-cert-file={}", cert.cert_path.display()),
            format!("--tls-private-key-file={}", cert.key_path.display()),
            "--leader-elect=false".into(),
            "--v=1".into(),
        ]);
        self.spawn("kube-scheduler", cmd)?;
        let url = format!("https://127.0.0.1:{port}");
        let probe = kube_client_for(&self.cp().kubeconfig_for_server(
            "scheduler-probe",
            &url,
            KubeconfigAuth::Anonymous,
        )?)
        .await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.check_alive("kube-scheduler")?;
            let req = http::Request::get("/healthz").body(Vec::new())?;
            match probe.request_text(req).await {
                Ok(t) if t.trim() == "ok" => return Ok(()),
                _ if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(250)).await
                }
                other => bail!(
                    "kube-scheduler not healthy in 60s ({other:?})\n{}",
                    self.log_tail("kube-scheduler", 40)
                ),
            }
        }
    }

    async fn start_kubelet(&mut self, bin: &Path, cgroup_root: &str) -> Result<()> {
        let cert = self
            .cp()
            .issue_client_cert(&format!("system:node:{NODE_NAME}"), &["system:nodes"])
            .await?;
        let kubeconfig = self.cp().kubeconfig_for_server(
            "kubelet",
            self.cp().server_url(),
            KubeconfigAuth::ClientCert(&cert),
        )?;
        let d = &self.dir;
        let config = serde_json::json!({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": NODE_IP,
            "readOnlyPort": 0,
            "authentication": {
                "anonymous": {"enabled": false},
                "webhook": {"enabled": false},
                "x509": {"clientCAFile": self.cp().ca_cert_path()},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            // The build machines run cgroup v1, which kubelet 1.36 refuses by default.
            "failCgroupV1": false,
            // The kubelet's cgroups under a name of this run, removed afterwards.
            "cgroupRoot": format!("/{cgroup_root}"),
            "containerRuntimeEndpoint": format!("unix://{}", self.containerd_socket.display()),
            // Only check the kernel settings: the scratch files over /proc/sys hold the values.
            "protectKernelDefaults": true,
            "podLogsDir": d.join("pod-logs"),
            "volumePluginDir": d.join("volume-plugins"),
            "resolvConf": "",
            "clusterDomain": CLUSTER_DOMAIN,
            // The harness' DNS server (service_net.rs) on the node IP.
            "clusterDNS": [NODE_IP],
            "hairpinMode": "none",
            "failSwapOn": false,
            // The images cannot be pulled again (no registry): never garbage-collect them, and
            // do not evict pods because the shared machine's disk is fuller than a node's.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "50Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
            "serializeImagePulls": false,
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
            "shutdownGracePeriod": "0s",
            "rotateCertificates": false,
            "serverTLSBootstrap": false,
            "healthzBindAddress": "127.0.0.1",
        });
        let config_path = d.join("kubelet/config.yaml");
        fs::write(&config_path, serde_json::to_string_pretty(&config)?)?;
        let mut cmd = Command::new(bin.join("kubelet"));
        cmd.args([
            format!("--config={}", config_path.display()),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--root-dir={}", d.join("kubelet/root").display()),
            format!("--cert-dir={}", d.join("kubelet/pki").display()),
            format!("--hostname-override={NODE_NAME}"),
            format!("--node-ip={NODE_IP}"),
            "--v=2".into(),
        ]);
        self.spawn("kubelet", cmd)
    }

    async fn wait_node_ready(&mut self, timeout: Duration) -> Result<()> {
        let client = self.cp().client().await?;
        let nodes: Api<NodeObject> = Api::all(client);
        let deadline = Instant::now() + timeout;
        let mut last = String::from("not registered yet");
        loop {
            self.check_alive("kubelet")?;
            if let Ok(Some(n)) = nodes.get_opt(NODE_NAME).await {
                let ready = n
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                    .map(|c| (c.status.clone(), c.message.clone().unwrap_or_default()));
                let taints: Vec<String> = n
                    .spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .map(|t| t.iter().map(|t| t.key.clone()).collect())
                    .unwrap_or_default();
                match ready {
                    Some((s, _)) if s == "True" && taints.is_empty() => return Ok(()),
                    Some((s, m)) => last = format!("Ready={s} ({m}), taints {taints:?}"),
                    None => last = "no Ready condition".into(),
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "node {NODE_NAME} not Ready and untainted after {timeout:?}: {last}\n{}",
                    self.diagnostics()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Stops the node in order: kubelet and kube-scheduler, the containers, containerd, then the
    /// control plane. Whatever is left dies with the PID namespace anyway.
    pub async fn stop(mut self) -> Result<()> {
        self.shutdown();
        match self.cp.take() {
            Some(cp) => cp.stop().await,
            None => Ok(()),
        }
    }

    fn shutdown(&mut self) {
        self.forwarder = None;
        self.service_net = None;
        // Reverse start order: kubelet, kube-scheduler, containerd.
        while let Some((name, mut child)) = self.procs.pop() {
            if name == "containerd" {
                kill_containers();
            }
            // SAFETY: plain syscall on our own unreaped child.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// SIGKILLs the containers' processes and containerd's shims. Every process of this PID
/// namespace was started by this test; the ones to stop here are the shims (re-parented to the
/// namespace's PID 1) and their descendants, found by their command lines.
fn kill_containers() {
    let me = std::process::id();
    for _ in 0..3 {
        let mut killed = 0;
        for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if pid == 1 || pid == me {
                continue;
            }
            let Ok(cmdline) = fs::read(e.path().join("cmdline")) else {
                continue;
            };
            if String::from_utf8_lossy(&cmdline).contains("containerd-shim") {
                // SAFETY: plain syscall; the pid belongs to this test's own PID namespace.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGKILL);
                }
                killed += 1;
            }
        }
        if killed == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Bind-mounts the run's own directories over `/run`, `/var/lib` and `/var/log`, and read-only
/// scratch files over the kubelet's machine-wide sysctls. Only inside the private mount
/// namespace (checked by the caller).
fn mount_private_dirs(dir: &Path) -> Result<()> {
    for (src, dst) in [
        ("run", "/run"),
        ("var-lib", "/var/lib"),
        ("var-log", "/var/log"),
    ] {
        let src = dir.join(src).display().to_string();
        run_cmd("mount", &["--bind", &src, dst])?;
    }
    for (key, value) in KUBELET_SYSCTLS {
        let file = dir.join("sysctl").join(key.replace('/', "."));
        fs::write(&file, format!("{value}\n"))?;
        let f = file.display().to_string();
        let target = format!("/proc/sys/{key}");
        run_cmd("mount", &["--bind", &f, &target])?;
        run_cmd("mount", &["-o", "remount,bind,ro", &f, &target])?;
    }
    Ok(())
}

/// Creates the kubelet's cgroup root in every hierarchy (the kubelet requires it to exist). A new
/// cpuset cgroup starts with no CPUs and memory nodes, so it inherits the root's.
fn create_cgroup_root(root: &str) -> Result<()> {
    for h in cgroup_hierarchies() {
        let d = h.join(root);
        fs::create_dir_all(&d).with_context(|| format!("creating cgroup {}", d.display()))?;
        for f in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(v) = fs::read_to_string(h.join(f)) {
                fs::write(d.join(f), v.trim())
                    .with_context(|| format!("writing {}", d.join(f).display()))?;
            }
        }
    }
    Ok(())
}

/// The pod bridge with the node IP (the bridge plugin adopts an existing bridge), and the
/// `kubernetes` Service's ClusterIP on `lo`.
fn setup_network() -> Result<()> {
    run_cmd("ip", &["link", "add", "cni0", "type", "bridge"])?;
    run_cmd(
        "ip",
        &["addr", "add", &format!("{NODE_IP}/16"), "dev", "cni0"],
    )?;
    run_cmd("ip", &["link", "set", "cni0", "up"])?;
    run_cmd(
        "ip",
        &[
            "addr",
            "add",
            &format!("{KUBERNETES_SERVICE_IP}/32"),
            "dev",
            "lo",
        ],
    )?;
    Ok(())
}

/// Forwards `10.0.0.1:443` (the `kubernetes` Service) to kube-apiserver's loopback port, so that
/// in-cluster clients in pods work without kube-proxy. It runs on a runtime of its own thread
/// ([`spawn_on_own_runtime`]): pods whose API calls stalled behind the test's blocking `kubectl`
/// calls failed their readiness (seen as a hung rollout).
async fn forward_kubernetes_service(cp: &ControlPlane) -> Result<OwnRuntime> {
    let target = cp
        .server_url()
        .strip_prefix("https://")
        .ok_or_else(|| anyhow!("unexpected server URL {}", cp.server_url()))?
        .to_string();
    let listener = std::net::TcpListener::bind((KUBERNETES_SERVICE_IP, 443))
        .context("binding 10.0.0.1:443 for the kubernetes Service")?;
    listener.set_nonblocking(true)?;
    spawn_on_own_runtime("kubernetes-service-forwarder", move || async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("forwarder listener");
        while let Ok((mut inbound, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    })
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            collect_files(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// A client that sends `GET <path>` through kube-apiserver every `every` and records each
/// failure, for "no request fails during a rolling update" checks. Each request has 5 s.
pub struct ApiPoller {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ok: std::sync::Arc<std::sync::atomic::AtomicU64>,
    errors: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ApiPoller {
    pub fn start(client: kube::Client, path: &'static str, every: Duration) -> ApiPoller {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ok = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let errors = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let task = {
            let (stop, ok, errors) = (stop.clone(), ok.clone(), errors.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let started = Instant::now();
                    let failure = match tokio::time::timeout(
                        Duration::from_secs(5),
                        crate::delegated::raw(&client, "GET", path),
                    )
                    .await
                    {
                        Ok(Ok((200, _))) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        Ok(Ok((s, b))) => format!(
                            "{s} after {:.0?}: {}",
                            started.elapsed(),
                            b.chars().take(200).collect::<String>()
                        ),
                        Ok(Err(e)) => format!("{e:#}"),
                        Err(_) => "no answer in 5s".into(),
                    };
                    errors.lock().unwrap().push(failure);
                }
            })
        };
        ApiPoller {
            stop,
            ok,
            errors,
            task,
        }
    }

    /// Stops polling: (successful requests, failures).
    pub async fn finish(self) -> Result<(u64, Vec<String>)> {
        use std::sync::atomic::Ordering;
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?;
        let errors = self.errors.lock().unwrap().clone();
        Ok((self.ok.load(Ordering::Relaxed), errors))
    }
}
