//! `reports-server bench`: create and list throughput of a fresh standalone server, driven by
//! the kube-rs client over HTTPS exactly as a real client would. Prints figures; asserts only
//! correctness (every object listed exactly once), never speed.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, ListParams, PostParams};
use reports_server_apiserver::http::ApiOptions;
use reports_server_apiserver::standalone::{self, StandaloneConfig};
use reports_server_apiserver::store::StoreOptions;
use reports_server_crds::PolicyReport;
use reports_server_crds::fixtures::{Subject, pss_policy_report};

#[derive(Args)]
pub struct BenchArgs {
    /// Number of ~7 KB Pod Security Standards reports to create.
    #[arg(long, env = "REPORTS_SERVER_BENCH_REPORTS", default_value_t = 10_000)]
    reports: u64,
    /// Namespaces to spread them over.
    #[arg(long, default_value_t = 10)]
    namespaces: u64,
    /// Concurrent create requests.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Page size of the paginated list.
    #[arg(long, default_value_t = 500)]
    page_size: u32,
    /// Database to benchmark [default: a fresh SQLite file in a temporary directory].
    #[arg(long, env = "REPORTS_SERVER_BENCH_DATABASE_URL")]
    database_url: Option<String>,
}

/// Builds a kube client from a kubeconfig file.
pub async fn client_for(kubeconfig: &std::path::Path) -> anyhow::Result<kube::Client> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).context("read kubeconfig")?;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .context("load kubeconfig")?;
    Ok(kube::Client::try_from(config)?)
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let url = args.database_url.clone().unwrap_or_else(|| {
        format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("bench.db").display()
        )
    });
    let server = standalone::start(StandaloneConfig {
        data_dir: dir.path().to_owned(),
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        store: StoreOptions::new(url.clone()),
        api: ApiOptions::default(),
        kubeconfig: dir.path().join("kubeconfig"),
        auth: Default::default(),
        serving: None,
        serving_names: Vec::new(),
    })
    .await?;
    let client = client_for(&server.kubeconfig).await?;
    println!(
        "backend: {:?} ({})",
        server.store.backend(),
        if args.database_url.is_some() {
            "given URL"
        } else {
            "temporary SQLite file"
        }
    );
    let sample = serde_json::to_vec(&pss_policy_report(
        &Subject::pod("ns-0", 0),
        1_700_000_000,
        &[1, 7],
    ))?
    .len();
    println!(
        "creating {} PolicyReports of {} bytes in {} namespaces, {} concurrent requests",
        args.reports, sample, args.namespaces, args.concurrency
    );

    let started = Instant::now();
    let mut done = 0u64;
    let mut creates = futures::stream::iter(0..args.reports)
        .map(|i| {
            let ns = format!("ns-{}", i % args.namespaces);
            let api: Api<PolicyReport> = Api::namespaced(client.clone(), &ns);
            async move {
                let report =
                    pss_policy_report(&Subject::pod(&ns, i), 1_700_000_000, &[(i % 19) as usize]);
                api.create(&PostParams::default(), &report).await
            }
        })
        .buffer_unordered(args.concurrency);
    while let Some(result) = creates.next().await {
        result.context("create failed")?;
        done += 1;
        if done.is_multiple_of(1000) || done == args.reports {
            eprint!("\r  created {done}/{}", args.reports);
        }
    }
    eprintln!();
    let create_secs = started.elapsed().as_secs_f64();

    let api: Api<PolicyReport> = Api::all(client.clone());
    let started = Instant::now();
    let mut seen = HashSet::new();
    let mut pages = 0;
    let mut params = ListParams::default().limit(args.page_size);
    loop {
        let page = api.list(&params).await?;
        pages += 1;
        for item in &page.items {
            let key = (
                item.metadata.namespace.clone().unwrap_or_default(),
                item.metadata.name.clone().unwrap_or_default(),
            );
            if !seen.insert(key.clone()) {
                bail!("object {key:?} was listed twice");
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => params = params.continue_token(&c),
            None => break,
        }
    }
    let list_secs = started.elapsed().as_secs_f64();
    if seen.len() as u64 != args.reports {
        bail!("listed {} objects, created {}", seen.len(), args.reports);
    }

    // A metadata-only watchlist-style pass: how fast a full relist through a reflector runs.
    let started = Instant::now();
    let relisted = kube::runtime::watcher(api.clone(), Default::default())
        .take_while(|e| {
            futures::future::ready(!matches!(e, Ok(kube::runtime::watcher::Event::InitDone)))
        })
        .try_fold(0usize, |n, e| async move {
            Ok(n + matches!(e, kube::runtime::watcher::Event::InitApply(_)) as usize)
        });
    let relisted = tokio::time::timeout(Duration::from_secs(600), relisted)
        .await
        .context("watcher initial list timed out")??;
    let watcher_secs = started.elapsed().as_secs_f64();

    println!("| measurement | value |");
    println!("|---|---|");
    println!(
        "| create ({} concurrent) | {:.0} reports/s ({:.1} s for {}) |",
        args.concurrency,
        args.reports as f64 / create_secs,
        create_secs,
        args.reports
    );
    println!(
        "| paginated list (limit={}) | {:.0} reports/s, {:.1} MB/s ({pages} pages, {:.2} s) |",
        args.page_size,
        seen.len() as f64 / list_secs,
        (seen.len() * sample) as f64 / list_secs / 1e6,
        list_secs
    );
    println!(
        "| kube-rs watcher initial sync | {:.0} reports/s ({relisted} objects, {:.2} s) |",
        relisted as f64 / watcher_secs,
        watcher_secs
    );
    println!(
        "every object listed exactly once: yes ({} of {})",
        seen.len(),
        args.reports
    );
    server.shutdown().await;
    Ok(())
}
