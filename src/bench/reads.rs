//! The read phases: paginated lists (typed, raw, metadata-only), `kubectl get`, and the
//! database's own floor for a full read.

use std::collections::HashSet;
use std::path::Path;

use anyhow::{Context, bail};
use http_body_util::BodyExt as _;
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
    let request = policy_reports();
    Ok(walk_pages(page_size, |params| {
        let (client, request) = (client.clone(), &request);
        async move {
            let bytes = page_bytes(&client, request, &params)
                .await?
                .collect_bytes()
                .await?;
            let page: Page = serde_json::from_slice(&bytes).context("list page")?;
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

/// Requests on every PolicyReport, across namespaces.
fn policy_reports() -> kube::core::Request {
    kube::core::Request::new(format!(
        "/apis/{}/{}/{}",
        POLICY_REPORT.group, POLICY_REPORT.version, POLICY_REPORT.plural
    ))
}

/// One page of `request` with `params`, its body not yet read; an error status is an error.
async fn page_bytes(
    client: &kube::Client,
    request: &kube::core::Request,
    params: &ListParams,
) -> anyhow::Result<kube::client::Body> {
    let request = request.list(params).context("list request")?;
    let response = client.send(request.map(kube::client::Body::from)).await?;
    let status = response.status();
    if !status.is_success() {
        let body = response
            .into_body()
            .collect_bytes()
            .await
            .unwrap_or_default();
        bail!("list page: {status}: {}", String::from_utf8_lossy(&body));
    }
    Ok(response.into_body())
}

/// The pages of [`list_raw_all`] taken as bytes as they arrive, and dropped: nothing is parsed
/// but the list's own `metadata` for the `continue` token, found at either end of the page
/// (after the items as this server and kube-apiserver write it, before them as Go structs
/// such as the peer's encode it). What a list costs the server and the wire, next to the
/// database's floor, which hands the bodies over and parses none. Returns (pages, bytes).
pub(super) async fn list_bytes_all(
    client: &kube::Client,
    page_size: u32,
) -> anyhow::Result<(usize, u64)> {
    let request = policy_reports();
    let (mut pages, mut bytes) = (0, 0u64);
    let mut params = ListParams::default().limit(page_size);
    loop {
        let mut body = page_bytes(client, &request, &params).await?;
        let mut ends = PageEnds::default();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                bytes += data.len() as u64;
                ends.push(&data);
            }
        }
        pages += 1;
        match ends.continue_token()?.filter(|c| !c.is_empty()) {
            Some(c) if params.continue_token.as_ref() == Some(&c) => {
                bail!("page {pages} gave the continue token it was asked with: {c}")
            }
            Some(c) => params = params.continue_token(&c),
            None => return Ok((pages, bytes)),
        }
    }
}

/// The first and last [`PageEnds::KEPT`] bytes of a list page: where its own `metadata` is.
#[derive(Default)]
struct PageEnds {
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
}

impl PageEnds {
    const KEPT: usize = 4096;

    fn push(&mut self, data: &[u8]) {
        let room = Self::KEPT.saturating_sub(self.head.len());
        self.head.extend_from_slice(&data[..room.min(data.len())]);
        let recent = &data[data.len().saturating_sub(Self::KEPT)..];
        self.tail.extend(recent);
        let excess = self.tail.len().saturating_sub(Self::KEPT);
        self.tail.drain(..excess);
    }

    /// The list's `metadata.continue`: in the head when `metadata` precedes `items`, else the
    /// last `metadata` of the tail (every item's own `metadata` comes before it).
    fn continue_token(&self) -> anyhow::Result<Option<String>> {
        #[derive(serde::Deserialize)]
        struct ListMeta {
            #[serde(rename = "continue")]
            continue_: Option<String>,
        }
        const KEY: &[u8] = b"\"metadata\":";
        let tail = self.tail.iter().copied().collect::<Vec<u8>>();
        let before_items = find(&self.head, b"\"items\":").map_or(&[][..], |i| &self.head[..i]);
        let (meta, last) = match find(before_items, KEY) {
            Some(at) => (&before_items[at + KEY.len()..], false),
            None => {
                let at = rfind(&tail, KEY).context("no list metadata at either end of a page")?;
                (&tail[at + KEY.len()..], true)
            }
        };
        let mut values = serde_json::Deserializer::from_slice(meta).into_iter::<ListMeta>();
        let list_meta = values
            .next()
            .context("list metadata")?
            .context("list metadata")?;
        // After the items, the list's `metadata` closes the page; an item's would not.
        let rest = &meta[values.byte_offset()..];
        if last && rest.iter().filter(|b| !b.is_ascii_whitespace()).ne(b"}") {
            bail!("the last metadata of a page is not the list's: a page cut short?");
        }
        Ok(list_meta.continue_)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn rfind(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

/// Every stored PolicyReport body, read through the server's own connection, decoded as a
/// list decodes it (decompressed on SQLite, as PostgreSQL decompresses inside the database) and
/// dropped as it arrives (so that a million bodies fit): (bodies, bytes of JSON).
pub(super) async fn read_every_body(store: &Store) -> anyhow::Result<(usize, u64)> {
    let mut bytes = 0u64;
    let rows = store
        .for_each_raw_row(
            &format!(
                "SELECT body FROM objects WHERE cluster_id = '{}' AND resource = '{}'",
                store.cluster_id(),
                Store::resource_key(&POLICY_REPORT)
            ),
            |row| {
                bytes += store.body_of_row(row, || "a stored body".into())?.len() as u64;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `page` cut into frames of `size` bytes, as they would arrive.
    fn ends_of(page: &str, size: usize) -> PageEnds {
        let mut ends = PageEnds::default();
        for frame in page.as_bytes().chunks(size) {
            ends.push(frame);
        }
        ends
    }

    fn items(n: usize) -> String {
        let item = r#"{"metadata":{"name":"r","continue":"not this one"},"results":[]}"#;
        vec![item; n].join(",")
    }

    #[test]
    fn the_continue_token_is_found_after_the_items_as_this_server_writes_it() {
        let page = format!(
            r#"{{"apiVersion":"v1","items":[{}],"kind":"L","metadata":{{"continue":"abc","resourceVersion":"7"}}}}"#,
            items(200)
        );
        for size in [1, 7, 4096, page.len()] {
            let token = ends_of(&page, size).continue_token().unwrap();
            assert_eq!(token.as_deref(), Some("abc"), "frames of {size}");
        }
    }

    #[test]
    fn the_continue_token_is_found_before_the_items_as_go_servers_write_it() {
        let page = format!(
            r#"{{"kind":"L","apiVersion":"v1","metadata":{{"resourceVersion":"7","continue":"xyz"}},"items":[{}]}}"#,
            items(200)
        );
        for size in [3, 4096, page.len()] {
            let token = ends_of(&page, size).continue_token().unwrap();
            assert_eq!(token.as_deref(), Some("xyz"), "frames of {size}");
        }
    }

    #[test]
    fn the_last_page_has_no_token_and_a_page_without_metadata_is_an_error() {
        let last = format!(
            r#"{{"apiVersion":"v1","items":[{}],"kind":"L","metadata":{{"resourceVersion":"7"}}}}"#,
            items(3)
        );
        assert_eq!(ends_of(&last, 64).continue_token().unwrap(), None);
        assert!(ends_of(r#"{"items":[]}"#, 64).continue_token().is_err());
        let cut_short = r#"{"apiVersion":"v1","items":[{"metadata":{"name":"r"},"spec":{}}"#;
        assert!(ends_of(cut_short, 64).continue_token().is_err());
    }
}
