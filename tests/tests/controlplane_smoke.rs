//! Smoke test of the e2e control plane: etcd + kube-apiserver + kube-controller-manager built
//! from the Go module proxy (tests/controlplane/build.sh), real kubectl, kube-rs, and the
//! controllers that tests rely on (namespace deletion, garbage collection, service accounts).
//!
//! Needs Go >= 1.26 with the Go module proxy (or REPORTS_SERVER_CONTROLPLANE_BIN), kubectl and
//! openssl. It fails, never skips, when one of them is missing. See docs/e2e.md.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use kube::{
    Api,
    api::{DeleteParams, ObjectMeta, PostParams, PropagationPolicy},
};
use reports_server_tests::controlplane::{
    Component, ControlPlane, ControlPlaneOptions, ExternalApiService, free_ports,
};

fn require_kubectl() {
    let ok = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "`kubectl` is required by the e2e tests but was not found or does not run; install a \
         recent kubectl (https://kubernetes.io/docs/tasks/tools/; Debian bookworm's \
         `kubernetes-client` is 1.20, too old) and make sure it is on PATH"
    );
}

fn kubectl(kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("kubectl")
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args(args)
        .output()
        .context("running kubectl")?;
    if !out.status.success() {
        bail!(
            "kubectl {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// Polls `check` every 250 ms until it returns true or `timeout` passes.
async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let start = Instant::now();
    loop {
        if check().await? {
            eprintln!("[smoke] {what}: after {:.1?}", start.elapsed());
            return Ok(());
        }
        if start.elapsed() > timeout {
            bail!("{what}: not true after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_smoke() -> Result<()> {
    require_kubectl();
    let cp = ControlPlane::start(ControlPlaneOptions::with_controller_manager())
        .await
        .context("starting the e2e control plane (see docs/e2e.md)")?;
    let kc = cp.kubeconfig_path();

    // Real kubectl against the real apiserver.
    let ns = kubectl(kc, &["get", "ns", "-o", "name"])?;
    for want in ["namespace/default", "namespace/kube-system"] {
        assert!(ns.contains(want), "kubectl get ns lacks {want}:\n{ns}");
    }
    let resources = kubectl(kc, &["api-resources", "-o", "name"])?;
    for want in [
        "namespaces",
        "apiservices.apiregistration.k8s.io",
        "clusterroles.rbac.authorization.k8s.io",
    ] {
        assert!(
            resources.lines().any(|l| l == want),
            "kubectl api-resources lacks {want}:\n{resources}"
        );
    }
    // A certificate user with several groups (one O= each), as RBAC tests use them.
    let alice = cp.user_kubeconfig("alice", &["team-a", "team-b"]).await?;
    let whoami = kubectl(&alice, &["auth", "whoami", "-o", "json"])?;
    let review: serde_json::Value = serde_json::from_str(&whoami)?;
    assert_eq!(
        review["status"]["userInfo"]["username"], "alice",
        "{whoami}"
    );
    for g in ["team-a", "team-b", "system:authenticated"] {
        assert!(
            review["status"]["userInfo"]["groups"]
                .as_array()
                .is_some_and(|gs| gs.iter().any(|x| x == g)),
            "alice lacks group {g}: {whoami}"
        );
    }
    let forbidden = cp.user_client("alice", &["team-a"]).await?;
    let err = Api::<Namespace>::all(forbidden)
        .list(&Default::default())
        .await
        .expect_err("alice has no RBAC permissions");
    assert!(
        matches!(&err, kube::Error::Api(e) if e.code == 403),
        "expected 403 Forbidden for alice, got {err}"
    );

    let version = kubectl(kc, &["version", "-o", "json"])?;
    assert!(version.contains("\"gitVersion\": \"v1.36"), "{version}");

    // kube-rs: create a namespace with content.
    let client = cp.client().await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let name = format!("smoke-{}", std::process::id());
    namespaces
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;

    // serviceaccount-controller creates `default` in every namespace.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
    eventually(
        "serviceaccount-controller created default SA",
        Duration::from_secs(60),
        || async { Ok(sas.get_opt("default").await?.is_some()) },
    )
    .await?;

    // garbage-collector-controller: a dependent goes away with its owner.
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &name);
    let owner = cms
        .create(
            &PostParams::default(),
            &ConfigMap {
                metadata: ObjectMeta {
                    name: Some("owner".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;
    cms.create(
        &PostParams::default(),
        &ConfigMap {
            metadata: ObjectMeta {
                name: Some("dependent".into()),
                owner_references: Some(vec![
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                        api_version: "v1".into(),
                        kind: "ConfigMap".into(),
                        name: "owner".into(),
                        uid: owner.metadata.uid.clone().expect("uid"),
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .await?;
    cms.delete(
        "owner",
        &DeleteParams {
            propagation_policy: Some(PropagationPolicy::Background),
            ..Default::default()
        },
    )
    .await?;
    eventually(
        "garbage collector deleted the dependent ConfigMap",
        Duration::from_secs(120),
        || async { Ok(cms.get_opt("dependent").await?.is_none()) },
    )
    .await?;

    // namespace-controller: deleting the namespace empties it and removes it.
    namespaces.delete(&name, &DeleteParams::default()).await?;
    eventually(
        "namespace controller removed the namespace",
        Duration::from_secs(120),
        || async { Ok(namespaces.get_opt(&name).await?.is_none()) },
    )
    .await
    .with_context(|| {
        format!(
            "kube-controller-manager log tail:\n{}",
            cp.log_tail(Component::KubeControllerManager, 30)
        )
    })?;
    let ns = kubectl(kc, &["get", "ns", "-o", "name"])?;
    assert!(!ns.contains(&format!("namespace/{name}")), "{ns}");

    aggregation_through_external_name(&cp).await?;

    cp.stop().await?;
    Ok(())
}

/// The aggregation wiring the project's e2e tests rely on: an APIService whose Service is an
/// ExternalName to `localhost`, a server on a loopback port with a certificate for
/// `<svc>.<ns>.svc` signed by the cluster CA (caBundle), that requires a client certificate from
/// the front-proxy CA. `openssl s_server -WWW` plays the extension server.
async fn aggregation_through_external_name(cp: &ControlPlane) -> Result<()> {
    let [port] = free_ports::<1>()?;
    let mut svc = ExternalApiService::new("smoke.e2e.example.com", "v1", port);
    svc.service_namespace = "smoke-aggregation".into();
    svc.service_name = "smoke-api".into();
    svc.ca_bundle_pem = Some(cp.ca_pem().to_string());
    let cert = cp
        .issue_serving_cert(
            "smoke-api",
            &[&svc.server_name(), "localhost", "127.0.0.1", "::1"],
        )
        .await?;

    let www = cp.dir().join("smoke-www");
    let gv_dir = www.join("apis").join(&svc.group);
    std::fs::create_dir_all(&gv_dir)?;
    let body = format!(
        r#"{{"kind":"APIResourceList","apiVersion":"v1","groupVersion":"{}/{}","resources":[]}}"#,
        svc.group, svc.version
    );
    std::fs::write(gv_dir.join(&svc.version), &body)?;
    let log = cp.dir().join("logs/smoke-s_server.log");
    let mut server = tokio::process::Command::new("openssl")
        .args(["s_server", "-accept"])
        .arg(port.to_string())
        .arg("-cert")
        .arg(&cert.cert_path)
        .arg("-key")
        .arg(&cert.key_path)
        // Require a client certificate signed by the front-proxy CA.
        .args(["-Verify", "1", "-verify_return_error", "-CAfile"])
        .arg(cp.front_proxy_ca_path())
        .args(["-WWW", "-quiet"])
        .current_dir(&www)
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&log)?)
        .stderr(std::fs::File::create(&log)?)
        .kill_on_drop(true)
        .spawn()
        .context("starting openssl s_server")?;

    cp.register_external_apiservice(&svc).await?;
    let available = cp
        .wait_apiservice_available(&svc.name(), Duration::from_secs(60))
        .await;
    let proxied = kubectl(
        cp.kubeconfig_path(),
        &[
            "get",
            "--raw",
            &format!("/apis/{}/{}", svc.group, svc.version),
        ],
    );
    cp.delete_apiservice(&svc.name()).await?;
    server.kill().await?;
    let server_log = std::fs::read_to_string(&log).unwrap_or_default();
    available.with_context(|| format!("s_server log:\n{server_log}"))?;
    let proxied = proxied?;
    assert!(
        proxied.contains(&format!(
            "\"groupVersion\":\"{}/{}\"",
            svc.group, svc.version
        )),
        "unexpected body through the aggregator: {proxied}"
    );
    eprintln!("[smoke] aggregator -> ExternalName localhost:{port} -> s_server: ok");
    Ok(())
}
