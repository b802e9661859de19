//! The read phases: paginated lists (typed, raw, metadata-only), `kubectl get`, and the
//! database's own floor for a full read.

use std::collections::HashSet;
use std::path::Path;

use anyhow::{Context, bail};
use kube::api::{Api, ListParams};
use reports_server_apiserver::store::Store;
use reports_server_crds::PolicyReport;
use reports_server_crds::catalog::POLICY_REPORT;

/// Lists everything page by page; fails if an object comes back twice. Returns (objects, pages).
pub(super) async fn list_all(
    api: &Api<PolicyReport>,
    page_size: u32,
) -> anyhow::Result<(usize, usize)> {
    walk_pages(page_size, |params| async move {
        Ok(KeysPage::of(api.list(&params).await?))
    })
    .await
}

/// [`list_all`] reading each page as bytes and parsing only the names and the `continue`
/// token (unknown fields are skipped by the parser, not built).
pub(super) async fn list_raw_all(client: &kube::Client, page_size: u32) -> anyhow::Result<usize> {
    #[derive(serde::Deserialize)]
    struct Page {
        metadata: ListMeta,
        items: Vec<Item>,
    }
    #[derive(serde::Deserialize)]
    struct ListMeta {
        #[serde(rename = "continue")]
        continue_: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct Item {
        metadata: ItemMeta,
    }
    #[derive(serde::Deserialize)]
    struct ItemMeta {
        namespace: Option<String>,
        name: String,
    }
    let url = format!(
        "/apis/{}/{}/{}",
        POLICY_REPORT.group, POLICY_REPORT.version, POLICY_REPORT.plural
    );
    let request = kube::core::Request::new(url);
    Ok(walk_pages(page_size, |params| {
        let (client, request) = (client.clone(), &request);
        async move {
            let bytes = client
                .request_text(request.list(&params).context("list request")?)
                .await?;
            let page: Page = serde_json::from_str(&bytes).context("list page")?;
            Ok(KeysPage {
                keys: page
                    .items
                    .into_iter()
                    .map(|i| (i.metadata.namespace.unwrap_or_default(), i.metadata.name))
                    .collect(),
                continue_: page.metadata.continue_,
            })
        }
    })
    .await?
    .0)
}

/// Every stored PolicyReport body, read through the server's own connection and dropped as it
/// arrives (so that a million bodies fit): (bodies, bytes as stored — compressed on SQLite).
pub(super) async fn read_every_body(store: &Store) -> anyhow::Result<(usize, u64)> {
    let sqlite = store.backend() == sea_orm::DbBackend::Sqlite;
    let mut bytes = 0u64;
    let rows = store
        .for_each_raw_row(
            &format!(
                "SELECT body FROM objects WHERE cluster_id = '{}' AND resource = '{}'",
                store.cluster_id(),
                Store::resource_key(&POLICY_REPORT)
            ),
            |row| {
                bytes += if sqlite {
                    row.try_get::<Vec<u8>>("", "body")?.len()
                } else {
                    row.try_get::<String>("", "body")?.len()
                } as u64;
                Ok(())
            },
        )
        .await?;
    Ok((usize::try_from(rows)?, bytes))
}

/// [`list_all`] as `PartialObjectMetadataList` pages.
pub(super) async fn list_metadata_all(
    api: &Api<PolicyReport>,
    page_size: u32,
) -> anyhow::Result<usize> {
    Ok(walk_pages(page_size, |params| async move {
        Ok(KeysPage::of(api.list_metadata(&params).await?))
    })
    .await?
    .0)
}

/// What [`walk_pages`] needs of a page: its objects' (namespace, name) and `continue` token.
pub(super) struct KeysPage {
    pub(super) keys: Vec<(String, String)>,
    pub(super) continue_: Option<String>,
}

impl KeysPage {
    pub(super) fn of<T: kube::Resource + Clone>(page: kube::core::ObjectList<T>) -> Self {
        use kube::ResourceExt as _;
        KeysPage {
            keys: page
                .items
                .iter()
                .map(|item| (item.namespace().unwrap_or_default(), item.name_any()))
                .collect(),
            continue_: page.metadata.continue_,
        }
    }
}

/// Follows `continue` tokens from the first page of `page_size` until the last, checking that
/// no object comes back twice. Returns (objects, pages).
pub(super) async fn walk_pages<F, Fut>(
    page_size: u32,
    mut fetch: F,
) -> anyhow::Result<(usize, usize)>
where
    F: FnMut(ListParams) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<KeysPage>>,
{
    let mut seen = HashSet::new();
    let mut pages = 0;
    let mut params = ListParams::default().limit(page_size);
    loop {
        let page = fetch(params.clone()).await?;
        pages += 1;
        for key in page.keys {
            if !seen.insert(key.clone()) {
                bail!("object {key:?} was listed twice");
            }
        }
        match page.continue_.filter(|c| !c.is_empty()) {
            Some(c) => params = params.continue_token(&c),
            None => return Ok((seen.len(), pages)),
        }
    }
}

/// Runs `kubectl get polr -A --no-headers` against `kubeconfig`; returns the number of rows.
pub(super) async fn kubectl_get_all(kubeconfig: &Path) -> anyhow::Result<usize> {
    let out = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["get", "polr", "-A", "--no-headers"])
        .output()
        .await
        .context(
            "running kubectl (phase kubectl-get needs kubectl on PATH: apt-get install -y kubectl)",
        )?;
    if !out.status.success() {
        bail!(
            "kubectl get polr -A failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out
        .stdout
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .count())
}
