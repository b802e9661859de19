//! Helpers of the end-to-end tests that install through the operator (`e2e_operator`, the node
//! tests): the repository's manifests as files and documents, the ReportsServer they install,
//! and the volumes its StatefulSets claim on the node.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize as _;
use serde_json::Value;

use crate::{
    controlplane::workspace_root,
    kubectl::Kubectl,
    node::{Node, REPORTS_SERVER_IMAGE, RunDir},
};

/// The namespace `manifests/install.yaml` and the examples use.
pub const NS: &str = "reports-server";

/// A file under `manifests/`.
pub fn manifest(path: &str) -> Result<String> {
    let p = workspace_root().join("manifests").join(path);
    std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
}

/// The documents of a YAML stream, empty ones dropped.
pub fn yaml_docs(text: &str) -> Result<Vec<Value>> {
    Ok(serde_yaml::Deserializer::from_str(text)
        .map(Value::deserialize)
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter(|d| !d.is_null())
        .collect())
}

/// Runs `helm` (the binary of `tests/tools/helm.sh`) against `kubeconfig`; its stdout, or an
/// error with the command and its stderr.
pub fn helm(bin: &std::path::Path, kubeconfig: &std::path::Path, args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(bin)
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .context("running helm")?;
    anyhow::ensure!(
        out.status.success(),
        "helm {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The image reference install.yaml (and the chart, by default) runs.
pub fn install_image() -> Result<String> {
    yaml_docs(&manifest("install.yaml")?)?
        .into_iter()
        .find(|d| d["kind"] == "Deployment")
        .and_then(|d| {
            d["spec"]["template"]["spec"]["containers"][0]["image"]
                .as_str()
                .map(String::from)
        })
        .ok_or_else(|| anyhow!("install.yaml has no operator Deployment with an image"))
}

/// Installs the operator on the node as a user does (`kubectl apply --server-side -f
/// manifests/install.yaml`), with the locally built image tagged as the reference install.yaml
/// names; returns that reference. Does not wait for the Deployment.
pub fn install_on_node(node: &Node, kubectl: &Kubectl) -> Result<String> {
    let install = manifest("install.yaml")?;
    let image = install_image()?;
    node.tag_image(REPORTS_SERVER_IMAGE, &image)?;
    kubectl.run_with_stdin(&["apply", "--server-side", "-f", "-"], Some(&install))?;
    Ok(image)
}

/// The ReportsServer `reports-server` of [`NS`] as JSON.
pub fn rs_json(kubectl: &Kubectl) -> Result<Value> {
    let text = kubectl.run(&["get", "rsrv", "-n", NS, "reports-server", "-o", "json"])?;
    Ok(serde_json::from_str(&text)?)
}

/// A status condition of a ReportsServer by type.
pub fn condition<'a>(rs: &'a Value, type_: &str) -> Option<&'a Value> {
    rs["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// Ready at the current generation: the operator has acted on the latest spec.
pub fn is_ready(rs: &Value) -> bool {
    condition(rs, "Ready").is_some_and(|c| c["status"] == "True")
        && rs["status"]["observedGeneration"] == rs["metadata"]["generation"]
}

/// Waits until the ReportsServer's condition `type_` is True (for Ready: at the current
/// generation) and returns the object.
pub async fn wait_condition(kubectl: &Kubectl, type_: &str, timeout: Duration) -> Result<Value> {
    let deadline = Instant::now() + timeout;
    loop {
        let rs = rs_json(kubectl).unwrap_or(Value::Null);
        let met = condition(&rs, type_).is_some_and(|c| c["status"] == "True")
            && (type_ != "Ready" || is_ready(&rs));
        if met {
            return Ok(rs);
        }
        if Instant::now() > deadline {
            bail!(
                "the ReportsServer is not {type_} after {timeout:?}: {}",
                rs["status"]
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Host-path PersistentVolumes for the StatefulSets' claims (the node has no provisioner).
pub fn create_volumes(kubectl: &Kubectl, run: &RunDir, n: usize) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let mut yaml = String::new();
    for i in 0..n {
        let dir = run.path().join(format!("node/pv/pv-{i}"));
        std::fs::create_dir_all(&dir)?;
        // Any pod user may write: the server runs as 65532, PostgreSQL's entrypoint as root.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777))?;
        yaml.push_str(&format!(
            "---\napiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: e2e-pv-{i}}}\nspec:\n  \
             capacity: {{storage: 10Gi}}\n  accessModes: [ReadWriteOnce]\n  \
             persistentVolumeReclaimPolicy: Retain\n  hostPath: {{path: \"{}\", type: Directory}}\n",
            dir.display()
        ));
    }
    kubectl.run_with_stdin(&["apply", "-f", "-"], Some(&yaml))?;
    Ok(())
}
