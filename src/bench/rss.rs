//! The `rss` phase: reports loaded in bulk through the store, then the process's resident
//! memory idle and after a full paginated list.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kube::api::Api;
use reports_server_apiserver::registry::stamp_new;
use reports_server_apiserver::store::Store;
use reports_server_crds::PolicyReport;
use reports_server_crds::catalog::POLICY_REPORT;
use reports_server_crds::fixtures::{Subject, pss_policy_report};

use super::BenchArgs;
use super::figures::{Figures, MIB, memory};
use super::reads::list_all;

/// Loads `--rss-reports` in bulk ([`bulk_load`]), then reads the process's memory idle and
/// after a full paginated list.
pub(super) async fn rss(
    args: &BenchArgs,
    store: &Store,
    client: &kube::Client,
    baseline: (u64, u64),
    figures: &mut Figures,
) -> anyhow::Result<()> {
    let total = args.rss_reports;
    println!("rss: loading {total} reports through the store");
    let load_secs = bulk_load(store, total, args.namespaces, "rss").await?;
    // Let the change feed broadcast what was loaded and settle before reading memory.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = memory()?;

    let api: Api<PolicyReport> = Api::all(client.clone());
    let started = Instant::now();
    let (n, pages) = list_all(&api, args.page_size).await?;
    let list_secs = started.elapsed().as_secs_f64();
    if (n as u64) < total {
        bail!("listed {n} objects, loaded {total}");
    }
    let after_list = memory()?;
    figures.add(
        "rss_bulk_load_per_s",
        format!("bulk load of {total} reports through the store (rss phase)"),
        "reports/s",
        &[total as f64 / load_secs],
        &format!("{load_secs:.0} s"),
    );
    figures.add(
        "rss_before_start_mib",
        "RSS before the server started",
        "MiB",
        &[baseline.0 as f64 / MIB],
        &format!("VmHWM {:.0} MiB", baseline.1 as f64 / MIB),
    );
    figures.add(
        "rss_idle_mib",
        format!("RSS idle with {total} stored reports"),
        "MiB",
        &[idle.0 as f64 / MIB],
        &format!("VmHWM {:.0} MiB", idle.1 as f64 / MIB),
    );
    figures.add(
        "rss_after_list_mib",
        format!("RSS after a full paginated list (limit={})", args.page_size),
        "MiB",
        &[after_list.0 as f64 / MIB],
        &format!(
            "VmHWM {:.0} MiB; {n} objects in {pages} pages, {list_secs:.1} s",
            after_list.1 as f64 / MIB
        ),
    );
    Ok(())
}

/// Loads `total` reports in bulk through the store, one transaction per 1,000 (the same rows
/// the API writes), into namespaces `<prefix>-0` … `<prefix>-<namespaces - 1>`, with progress;
/// the seconds it took.
pub(super) async fn bulk_load(
    store: &Store,
    total: u64,
    namespaces: u64,
    prefix: &str,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let step = (total / 10).max(1);
    let mut loaded = 0u64;
    while loaded < total {
        let n = (total - loaded).min(1000);
        let objects: Vec<serde_json::Value> = (loaded..loaded + n)
            .map(|i| {
                let subject = Subject::pod(&format!("{prefix}-{}", i % namespaces.max(1)), i);
                let mut v = serde_json::to_value(pss_policy_report(
                    &subject,
                    1_700_000_000,
                    &[(i % 19) as usize],
                ))?;
                stamp_new(
                    v["metadata"]
                        .as_object_mut()
                        .context("report without metadata")?,
                    &subject.uid,
                );
                Ok(v)
            })
            .collect::<anyhow::Result<_>>()?;
        store
            .put_all(&POLICY_REPORT, objects)
            .await
            .context("bulk load")?;
        let before = loaded;
        loaded += n;
        if loaded / step != before / step || loaded == total {
            eprintln!(
                "  loaded {loaded}/{total} ({:.0}%, {:.0} s)",
                loaded as f64 * 100.0 / total as f64,
                started.elapsed().as_secs_f64()
            );
        }
    }
    Ok(started.elapsed().as_secs_f64())
}
