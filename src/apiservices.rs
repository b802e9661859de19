//! `reports-server apiservices`: the objects that route a cluster's report APIs to a server
//! running outside it — an ExternalName Service (to `localhost` by default) and the three
//! APIServices with the serving CA as `caBundle` (never `insecureSkipTLSVerify`). The end-to-end
//! tests use it, and so can users who run the server next to the cluster.

use std::path::PathBuf;

use anyhow::Context;
use base64::Engine;
use clap::Args;

#[derive(Args)]
pub struct ApiservicesArgs {
    /// Port the server listens on.
    #[arg(long, default_value_t = 6443)]
    port: u16,
    /// PEM file of the CA that signed the serving certificate (goes into `caBundle`).
    #[arg(long)]
    ca_bundle_file: PathBuf,
    /// Namespace of the Service.
    #[arg(long, default_value = "reports-server")]
    service_namespace: String,
    /// Name of the Service; the serving certificate must cover `<name>.<namespace>.svc`.
    #[arg(long, default_value = "reports-server")]
    service_name: String,
    /// Host the ExternalName Service points to.
    #[arg(long, default_value = "localhost")]
    external_name: String,
}

/// (version, group, groupPriorityMinimum, versionPriority), priorities as upstream ships them.
const APISERVICES: [(&str, &str, i32, i32); 3] = [
    ("v1alpha2", "wgpolicyk8s.io", 1000, 100),
    ("v1", "reports.kyverno.io", 1000, 100),
    ("v1alpha1", "openreports.io", 1000, 100),
];

pub fn render(args: &ApiservicesArgs, ca_pem: &str) -> String {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem.as_bytes());
    let (ns, name) = (&args.service_namespace, &args.service_name);
    let mut out = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {ns}\n---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels:\n    app.kubernetes.io/name: reports-server\nspec:\n  type: ExternalName\n  externalName: {}\n  ports:\n  - name: https\n    port: {}\n    protocol: TCP\n",
        args.external_name, args.port
    );
    for (version, group, group_priority, version_priority) in APISERVICES {
        out.push_str(&format!(
            "---\napiVersion: apiregistration.k8s.io/v1\nkind: APIService\nmetadata:\n  name: {version}.{group}\n  labels:\n    app.kubernetes.io/name: reports-server\nspec:\n  group: {group}\n  version: {version}\n  groupPriorityMinimum: {group_priority}\n  versionPriority: {version_priority}\n  service:\n    namespace: {ns}\n    name: {name}\n    port: {}\n  caBundle: {ca}\n",
            args.port
        ));
    }
    out
}

pub fn run(args: ApiservicesArgs) -> anyhow::Result<()> {
    let ca = std::fs::read_to_string(&args.ca_bundle_file).with_context(|| {
        format!(
            "cannot read --ca-bundle-file {}",
            args.ca_bundle_file.display()
        )
    })?;
    anyhow::ensure!(
        ca.contains("BEGIN CERTIFICATE"),
        "{} holds no PEM certificate",
        args.ca_bundle_file.display()
    );
    print!("{}", render(&args, &ca));
    Ok(())
}
