//! Shared harness for the end-to-end and conformance tests: real server processes, real
//! PostgreSQL, real kubectl, and the Go-built control plane.
//!
//! A test that lacks a dependency fails with a message naming what to install; none skips.

pub mod controlplane;
pub mod kubectl;
pub mod postgres;
pub mod server;

use std::path::Path;

use anyhow::Context;

/// A kube-rs client from a kubeconfig file.
pub async fn kube_client(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).context("read kubeconfig")?;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .context("load kubeconfig")?;
    Ok(kube::Client::try_from(config)?)
}

/// The backends every store-level and API-level test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    pub const ALL: [Backend; 2] = [Backend::Sqlite, Backend::Postgres];

    /// A fresh database of this backend (`None` = the server's embedded SQLite file).
    pub fn database_url(self, dir: &Path) -> anyhow::Result<String> {
        match self {
            Backend::Sqlite => Ok(format!(
                "sqlite://{}?mode=rwc",
                dir.join("reports.db").display()
            )),
            Backend::Postgres => postgres::fresh_database(),
        }
    }
}
