//! A fleet in one database: two clusters (two real control planes), one server each, one
//! PostgreSQL. Each cluster sees only its own reports under the same names, its
//! resourceVersions move only with its own writes, a server of one cluster refuses to start on
//! the other's cluster id instead of mixing their reports, and `reports-server query compliance
//! --by cluster` gives the fleet view.
//!
//! The store-level part (`store::cluster_identity`) runs on every backend without control
//! planes, on the default id `default`: the first cluster records itself on it, another cluster is refused with a message
//! naming both UIDs and the fix, and `--reclaim-cluster-id` hands the id over.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, PostParams, WatchEvent, WatchParams,
};
use reports_server_apiserver::store::{Store, StoreError, StoreOptions};
use reports_server_crds::catalog::POLICY_REPORT;
use reports_server_tests::{
    Backend,
    controlplane::{ControlPlane, ControlPlaneOptions},
    delegated::{Server, register_apiservices},
    kube_client_with_retries,
    kubectl::Kubectl,
    objects::{api_resource, list_rv, rv_of},
    server,
};
use serde_json::json;

const NS: &str = "fleet";

/// One cluster of the fleet: its control plane, its server and an admin client through its
/// kube-apiserver.
struct Member {
    cp: ControlPlane,
    server: Server,
    client: kube::Client,
}

impl Member {
    async fn start(database_url: &str, cluster_id: &str) -> Result<Member> {
        let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
        let server = Server::start_on(
            &cp,
            &cp.dir().join("reports-server"),
            database_url,
            &["--cluster-id", cluster_id, "--aggregation=false"],
        )
        .await?;
        let client = kube_client_with_retries(cp.kubeconfig_path(), true).await?;
        register_apiservices(&cp, &server, &Kubectl::new(cp.kubeconfig_path()), &client).await?;
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": NS}}))?,
            )
            .await?;
        Ok(Member { cp, server, client })
    }

    fn reports(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), NS, &api_resource(&POLICY_REPORT))
    }

    /// The UID the servers record for this cluster, read as they read it.
    async fn kube_system_uid(&self) -> Result<String> {
        Ok(reports_server_apiserver::delegated::cluster_uid(&self.client).await?)
    }
}

/// A report with one result: `pass` in east, `fail` in west, so the fleet view tells them
/// apart.
fn report(name: &str, owner: &str) -> Result<DynamicObject> {
    let result = if owner == "east" { "pass" } else { "fail" };
    Ok(serde_json::from_value(json!({
        "apiVersion": "wgpolicyk8s.io/v1alpha2",
        "kind": "PolicyReport",
        "metadata": {"name": name, "labels": {"cluster": owner}},
        "summary": {"pass": 1, "fail": 0, "warn": 0, "error": 0, "skip": 0},
        "results": [{"policy": "fleet", "rule": "one", "result": result, "source": "e2e"}],
    }))?)
}

fn owner_of(r: &DynamicObject) -> Option<&str> {
    r.metadata
        .labels
        .as_ref()?
        .get("cluster")
        .map(String::as_str)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clusters_share_one_postgres_database() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let url = Backend::Postgres.database_url(dir.path())?;
    let east = Member::start(&url, "east").await?;
    let west = Member::start(&url, "west").await?;

    // The same names in both clusters, each with its own content.
    for name in ["shared-a", "shared-b"] {
        east.reports()
            .create(&PostParams::default(), &report(name, "east")?)
            .await?;
        west.reports()
            .create(&PostParams::default(), &report(name, "west")?)
            .await?;
    }
    east.reports()
        .create(&PostParams::default(), &report("only-east", "east")?)
        .await?;
    for (member, own, count) in [(&east, "east", 3), (&west, "west", 2)] {
        let list = member.reports().list(&ListParams::default()).await?;
        ensure!(
            list.items.len() == count && list.items.iter().all(|r| owner_of(r) == Some(own)),
            "{own} lists {:?}",
            list.items
                .iter()
                .map(|r| (r.metadata.name.clone(), owner_of(r).map(str::to_owned)))
                .collect::<Vec<_>>()
        );
        let got = member.reports().get("shared-a").await?;
        ensure!(
            owner_of(&got) == Some(own),
            "{own} gets another cluster's shared-a"
        );
    }
    ensure!(
        west.reports().get_opt("only-east").await?.is_none(),
        "west sees east's only-east"
    );

    // West's resourceVersions and watch do not move with east's writes.
    let west_rv = list_rv(&west.reports()).await;
    let mut west_watch = west
        .reports()
        .watch(&WatchParams::default().timeout(10), &west_rv.to_string())
        .await?
        .boxed();
    for i in 0..5 {
        east.reports()
            .create(
                &PostParams::default(),
                &report(&format!("east-{i}"), "east")?,
            )
            .await?;
    }
    east.reports()
        .delete("shared-b", &DeleteParams::default())
        .await?;
    ensure!(
        list_rv(&west.reports()).await == west_rv,
        "east's writes moved west's list resourceVersion"
    );
    let created = west
        .reports()
        .create(&PostParams::default(), &report("west-late", "west")?)
        .await?;
    let first = tokio::time::timeout(Duration::from_secs(10), west_watch.next())
        .await
        .context("west's watch saw nothing of west's own write")?
        .context("west's watch ended")??;
    match first {
        WatchEvent::Added(o) => ensure!(
            o.metadata.name.as_deref() == Some("west-late") && rv_of(&o) == rv_of(&created),
            "west's watch first saw {:?} (east's writes leaked?)",
            o.metadata.name
        ),
        other => anyhow::bail!("west's watch first saw {other:?}"),
    }
    ensure!(
        west.reports().get("shared-b").await.is_ok(),
        "east's delete of shared-b removed west's"
    );

    refused_on_a_taken_id(&west, &url, "east").await?;
    fleet_view(&url, &[(&east, "east", "pass"), (&west, "west", "fail")]).await?;
    eprintln!(
        "[fleet] east ({}) and west ({}) share one database, each with its own reports",
        east.kube_system_uid().await?,
        west.kube_system_uid().await?
    );
    drop((east.server, west.server));
    drop((east.cp, west.cp));
    Ok(())
}

/// A second server of `member`'s cluster started with another cluster's id exits at once with
/// the message that names the fix.
async fn refused_on_a_taken_id(member: &Member, url: &str, taken: &str) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out = tokio::task::spawn_blocking({
        let kubeconfig = member.cp.kubeconfig_path().to_owned();
        let url = url.to_owned();
        let data = dir.path().to_owned();
        let taken = taken.to_owned();
        move || serve_once(&kubeconfig, &url, &data, &taken)
    })
    .await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && stderr.contains("holds the reports of another cluster"),
        "a server of another cluster on cluster id {taken}: exit {}, stderr:\n{stderr}",
        out.status
    );
    ensure!(
        stderr.contains("--reclaim-cluster-id")
            && stderr.contains(&member.kube_system_uid().await?),
        "the refusal does not name this cluster's UID and the fix:\n{stderr}"
    );
    Ok(())
}

/// `reports-server query compliance --by cluster` on the shared database: one row per cluster
/// whose counts are the results of the reports that cluster lists.
async fn fleet_view(url: &str, members: &[(&Member, &str, &str)]) -> Result<()> {
    let out = Command::new(server::binary()?)
        .args(["query", "compliance", "--by", "cluster", "-o", "json"])
        .args(["--database-url", url])
        .output()?;
    ensure!(
        out.status.success(),
        "query compliance --by cluster: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)?;
    for (member, id, outcome) in members {
        let listed = member
            .reports()
            .list(&ListParams::default())
            .await?
            .items
            .len();
        let row = rows
            .iter()
            .find(|r| r["cluster_id"] == *id)
            .with_context(|| format!("no row for cluster {id} in {rows:?}"))?;
        ensure!(
            row[*outcome] == listed && row["total"] == listed,
            "cluster {id} lists {listed} reports of one {outcome} result each, the fleet view says {row}"
        );
    }
    ensure!(rows.len() == members.len(), "fleet view rows: {rows:?}");
    Ok(())
}

/// Runs `serve`, which must exit on its own: one still running after a minute is killed and
/// reported (a server that accepted the id would serve forever).
fn serve_once(
    kubeconfig: &Path,
    url: &str,
    data: &Path,
    cluster_id: &str,
) -> Result<std::process::Output> {
    let mut cmd = Command::new(server::binary()?);
    cmd.args(["serve", "--auth-mode", "delegated", "--kubeconfig"])
        .arg(kubeconfig)
        .args(["--database-url", url, "--cluster-id", cluster_id])
        .args(["--bind-address", "127.0.0.1", "--secure-port"])
        .arg(server::free_port().to_string())
        .arg("--data-dir")
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            child.kill()?;
            let out = child.wait_with_output()?;
            anyhow::bail!(
                "serve on another cluster's id still runs after 60 s; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(child.wait_with_output()?)
}

/// The identity rules on every backend, through the store alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_id_belongs_to_the_first_cluster_on_every_backend() -> Result<()> {
    for backend in Backend::ALL {
        let dir = tempfile::tempdir()?;
        let url = backend.database_url(dir.path())?;
        let open = |uid: &str, reclaim: bool| {
            let mut options = StoreOptions::new(url.clone());
            options.cluster_uid = Some(uid.to_owned());
            options.reclaim_cluster_id = reclaim;
            Store::connect(options)
        };
        open("uid-a", false)
            .await
            .with_context(|| format!("{backend:?}: the first cluster"))?;
        open("uid-a", false)
            .await
            .with_context(|| format!("{backend:?}: the same cluster again"))?;
        match open("uid-b", false).await {
            Err(StoreError::ClusterIdTaken { recorded, ours, .. }) => ensure!(
                recorded == "uid-a" && ours == "uid-b",
                "{backend:?}: refusal names {recorded} and {ours}"
            ),
            Err(e) => anyhow::bail!("{backend:?}: another cluster got {e}"),
            Ok(_) => anyhow::bail!("{backend:?}: another cluster started on the same id"),
        }
        // Unknown clusters (standalone mode) are not checked; another id is another partition.
        Store::connect(StoreOptions::new(url.clone())).await?;
        let mut other = StoreOptions::new(url.clone());
        other.cluster_id = "second".into();
        other.cluster_uid = Some("uid-b".into());
        Store::connect(other).await?;
        open("uid-b", true)
            .await
            .with_context(|| format!("{backend:?}: reclaiming"))?;
        ensure!(
            matches!(
                open("uid-a", false).await,
                Err(StoreError::ClusterIdTaken { .. })
            ),
            "{backend:?}: the old cluster still starts after the id was reclaimed"
        );
    }
    Ok(())
}
