//! The write phases: namespaces made ready, reports created and updated through the API, with
//! progress.

use std::time::Instant;

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};
use reports_server_crds::PolicyReport;
use reports_server_crds::fixtures::{Subject, pss_policy_report};

use super::{BenchArgs, Created};

/// Creates the namespaces the reports go to (kube-apiserver refuses namespaced custom
/// resources in a namespace that does not exist); one that exists already is fine, and a
/// server that serves no namespaces at all (a standalone reports-server, which needs none) is
/// left as it is.
pub(super) async fn ensure_namespaces(
    client: &kube::Client,
    names: &[String],
) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    for name in names {
        let ns = Namespace {
            metadata: kube::api::ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {
                println!(
                    "the server serves no namespaces (a standalone reports-server): none created"
                );
                return Ok(());
            }
            Err(e) => {
                return Err(e).with_context(|| format!("creating namespace {name}"));
            }
        }
    }
    Ok(())
}

pub(super) async fn create(
    args: &BenchArgs,
    client: &kube::Client,
    sample: usize,
) -> anyhow::Result<(f64, Created)> {
    println!(
        "creating {} PolicyReports of {} bytes in {} namespaces, {} concurrent requests",
        args.reports, sample, args.namespaces, args.concurrency
    );
    let started = Instant::now();
    let mut created = Vec::with_capacity(args.reports as usize);
    let mut creates = futures::stream::iter(0..args.reports)
        .map(|i| {
            let ns = format!("ns-{}", i % args.namespaces);
            let api: Api<PolicyReport> = Api::namespaced(client.clone(), &ns);
            async move {
                let report =
                    pss_policy_report(&Subject::pod(&ns, i), 1_700_000_000, &[(i % 19) as usize]);
                let stored = api.create(&PostParams::default(), &report).await?;
                Ok::<_, kube::Error>((
                    ns,
                    stored.metadata.name.unwrap_or_default(),
                    stored.metadata.resource_version.unwrap_or_default(),
                ))
            }
        })
        .buffer_unordered(args.concurrency);
    while let Some(result) = creates.next().await {
        created.push(result.context("create failed")?);
        progress("created", created.len() as u64, args.reports);
    }
    eprintln!();
    Ok((started.elapsed().as_secs_f64(), created))
}

pub(super) fn progress(what: &str, done: u64, total: u64) {
    if done.is_multiple_of(1000) || done == total {
        eprint!("\r  {what} {done}/{total}");
    }
}

/// Replaces every created report once, each with its resourceVersion and another rule failing.
pub(super) async fn update(
    args: &BenchArgs,
    client: &kube::Client,
    created: &Created,
) -> anyhow::Result<f64> {
    println!(
        "updating {} PolicyReports, {} concurrent requests",
        created.len(),
        args.concurrency
    );
    let started = Instant::now();
    let total = created.len() as u64;
    let mut done = 0u64;
    let mut updates = futures::stream::iter(created.iter().enumerate())
        .map(|(i, (ns, name, rv))| {
            let api: Api<PolicyReport> = Api::namespaced(client.clone(), ns);
            async move {
                let mut report =
                    pss_policy_report(&Subject::pod(ns, i as u64), 1_700_000_100, &[(i + 1) % 19]);
                report.metadata.name = Some(name.clone());
                report.metadata.resource_version = Some(rv.clone());
                api.replace(name, &PostParams::default(), &report).await
            }
        })
        .buffer_unordered(args.concurrency);
    while let Some(result) = updates.next().await {
        result.context("update failed")?;
        done += 1;
        progress("updated", done, total);
    }
    eprintln!();
    Ok(started.elapsed().as_secs_f64())
}
