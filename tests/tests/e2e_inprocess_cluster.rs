//! In-process aggregation behind a real kube-apiserver, where the server knows the cluster
//! through its `--kubeconfig` (`serve --auth-mode delegated`). Regressions for two bugs a real
//! Kyverno found:
//!
//! * an admission report written by Kyverno's *mutating* webhook — before the object has a UID,
//!   so with `audit.kyverno.io/resource.uid: ""` and no ownerReference — was never merged and
//!   never removed. Now it is adopted (the resource looked up, owner and UID set) and merged;
//!   one whose resource does not exist is deleted after the grace period;
//! * results of a deleted (or report-disabled) ClusterPolicy stayed in every PolicyReport. Now
//!   the server watches Kyverno's policies and re-merges when they change — also when, as with
//!   Kyverno 1.19, `kyverno.io` prefers a version (`v2`) that does not serve ClusterPolicy.
//!
//! Kyverno itself is played by the test (reports written as its webhook writes them); the
//! Kyverno end-to-end suite runs the real thing. Needs what the control plane needs (Go or
//! `REPORTS_SERVER_CONTROLPLANE_BIN`, kubectl, openssl); see docs/e2e.md.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use reports_server_crds::fixtures::{PSS_RULES, Subject};
use reports_server_crds::{EphemeralReport, PolicyReport, PolicyResult};
use reports_server_tests::controlplane::{ControlPlane, ControlPlaneOptions};
use reports_server_tests::delegated::{self, Server};
use reports_server_tests::kubectl::Kubectl;
use reports_server_tests::kyverno_fixtures::{
    CLUSTER_POLICY_CRD, admission_report, cluster_policy_api, pss_cluster_policies,
};
use serde_json::json;

const NS: &str = "apps";
const T0: i64 = 1_700_000_000;
/// `--adoption-grace-period` of the test (Kyverno's 2 minutes would make it slow).
const GRACE: Duration = Duration::from_secs(10);
const DELETED_POLICY: &str = "disallow-host-path";
const DISABLED_POLICY: &str = "disallow-privileged-containers";

/// A `kyverno.io` kind served in `v2` only, which makes `v2` the group's preferred version (as
/// Kyverno 1.19's CleanupPolicy and PolicyException do).
const V2_ONLY_KYVERNO_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: cleanuppolicies.kyverno.io
spec:
  group: kyverno.io
  names:
    kind: CleanupPolicy
    listKind: CleanupPolicyList
    plural: cleanuppolicies
    singular: cleanuppolicy
  scope: Namespaced
  versions:
  - name: v2
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        x-kubernetes-preserve-unknown-fields: true
"#;

/// Polls `check` until it returns `Ok(Some(_))`; its last error or state explains a timeout.
async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let t0 = Instant::now();
    loop {
        let last = match check().await {
            Ok(Some(v)) => {
                eprintln!("[e2e] {what}: {:.1?}", t0.elapsed());
                return Ok(v);
            }
            Ok(None) => "condition not met yet".to_owned(),
            Err(e) => format!("{e:#}"),
        };
        if t0.elapsed() > timeout {
            bail!("{what}: not within {timeout:?}; last: {last}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `(policy, rule) → result` of a report.
fn results_of(report: &PolicyReport) -> BTreeMap<(String, String), PolicyResult> {
    report
        .results
        .iter()
        .flatten()
        .map(|r| {
            (
                (r.policy.clone(), r.rule.clone().unwrap_or_default()),
                r.result.unwrap_or(PolicyResult::Error),
            )
        })
        .collect()
}

/// What the PSS fixtures give for a subject with rule `failing` failing, without the results of
/// `dropped` policies.
fn expected(failing: usize, dropped: &[&str]) -> BTreeMap<(String, String), PolicyResult> {
    PSS_RULES
        .iter()
        .enumerate()
        .filter(|(_, (policy, _, _))| !dropped.contains(policy))
        .map(|(i, (policy, rule, _))| {
            let result = if i == failing {
                PolicyResult::Fail
            } else {
                PolicyResult::Pass
            };
            (((*policy).to_owned(), (*rule).to_owned()), result)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inprocess_aggregation_adopts_mutation_reports_and_follows_policies() -> Result<()> {
    let t0 = Instant::now();
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .context("starting the e2e control plane (see docs/e2e.md)")?;
    let admin = Kubectl::new(cp.kubeconfig_path());
    let client = cp.client().await?;

    // Kyverno's policies exist before the server starts, as on a cluster that adopts us. As in
    // Kyverno 1.19, `kyverno.io` prefers `v2` (another kind) while ClusterPolicy is `v1` only:
    // the server must find it outside the preferred version.
    admin.run_with_stdin(&["apply", "-f", "-"], Some(CLUSTER_POLICY_CRD))?;
    admin.run_with_stdin(&["apply", "-f", "-"], Some(V2_ONLY_KYVERNO_CRD))?;
    admin.run(&[
        "wait",
        "--for=condition=Established",
        "crd/clusterpolicies.kyverno.io",
        "crd/cleanuppolicies.kyverno.io",
        "--timeout=60s",
    ])?;
    let preferred = admin.run(&["get", "--raw", "/apis/kyverno.io"])?;
    ensure!(
        preferred.contains(r#""preferredVersion":{"groupVersion":"kyverno.io/v2""#),
        "kyverno.io must prefer v2 for this test: {preferred}"
    );
    let cpols = cluster_policy_api(&client);
    for policy in pss_cluster_policies() {
        cpols
            .create(&PostParams::default(), &serde_json::from_value(policy)?)
            .await?;
    }

    let mut server = Server::start_with(
        &cp,
        &cp.dir().join("reports-server"),
        &[
            "--aggregation-delay",
            "1s",
            "--adoption-grace-period",
            &format!("{}s", GRACE.as_secs()),
            "--adoption-retry",
            "1s",
            // A merge round, step by step, for the check at the end.
            "--log-format",
            "json",
            "--log",
            "info,reports_server_aggregator=debug",
        ],
    )
    .await?;
    delegated::register_apiservices(&cp, &server, &admin, &client).await?;
    let diagnostics = || delegated::diagnostics(&cp, &server);

    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some(NS.into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;
    let cm = Api::<ConfigMap>::namespaced(client.clone(), NS)
        .create(
            &PostParams::default(),
            &ConfigMap {
                metadata: ObjectMeta {
                    name: Some("web-config".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;
    let cm_uid = cm.metadata.uid.clone().context("ConfigMap without uid")?;

    // ---- 1. a mutation report: no UID yet, no owner; only the name says what it is about ----
    let ephemerals = Api::<EphemeralReport>::namespaced(client.clone(), NS);
    let nameless = |name: &str| Subject {
        namespace: NS.into(),
        name: name.into(),
        uid: String::new(),
    };
    let mutation = admission_report(&nameless("web-config"), "7f3a-mutate-web", T0, &[0]);
    ensure!(
        mutation.metadata.labels.as_ref().unwrap()["audit.kyverno.io/resource.uid"].is_empty()
            && mutation.metadata.owner_references.is_none(),
        "the fixture must look like a mutating webhook's report"
    );
    ephemerals
        .create(&PostParams::default(), &mutation)
        .await
        .context("creating the mutation report through kube-apiserver")?;
    let reports = Api::<PolicyReport>::namespaced(client.clone(), NS);
    let report = eventually(
        "mutation report adopted and merged into the ConfigMap's PolicyReport",
        Duration::from_secs(60),
        || async {
            let report = reports.get_opt(&cm_uid).await?;
            let left = ephemerals.list(&ListParams::default()).await?.items.len();
            Ok(report.filter(|_| left == 0))
        },
    )
    .await
    .with_context(diagnostics)?;
    let owner = &report
        .metadata
        .owner_references
        .as_ref()
        .context("no owner")?[0];
    ensure!(
        (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str())
            == ("ConfigMap", "web-config", cm_uid.as_str()),
        "owner of the merged report: {owner:?}"
    );
    ensure!(
        results_of(&report) == expected(0, &[]),
        "results after adoption: {:?}",
        results_of(&report)
    );

    // ---- 2. a report about something that never existed is deleted after the grace period ---
    let ghost = admission_report(&nameless("no-such-config"), "9e2b-mutate-ghost", T0, &[1]);
    let created = Instant::now();
    ephemerals.create(&PostParams::default(), &ghost).await?;
    eventually(
        "report about a missing resource deleted",
        GRACE + Duration::from_secs(60),
        || async {
            Ok(ephemerals
                .get_opt("9e2b-mutate-ghost")
                .await?
                .is_none()
                .then_some(()))
        },
    )
    .await
    .with_context(diagnostics)?;
    // creationTimestamp has whole seconds: the grace period may start up to 1 s before the
    // create request was sent (and the check is against another process's clock reading).
    ensure!(
        created.elapsed() + Duration::from_secs(2) >= GRACE,
        "deleted after {:?}, before the grace period of {GRACE:?}",
        created.elapsed()
    );
    ensure!(
        reports.list(&ListParams::default()).await?.items.len() == 1,
        "no PolicyReport may appear for a missing resource"
    );

    // ---- 3. deleting a ClusterPolicy drops its results, with no new report to merge --------
    cpols
        .delete(DELETED_POLICY, &DeleteParams::default())
        .await?;
    eventually(
        "results of the deleted policy dropped",
        Duration::from_secs(60),
        || async {
            let report = reports.get(&cm_uid).await?;
            Ok((results_of(&report) == expected(0, &[DELETED_POLICY])).then_some(()))
        },
    )
    .await
    .with_context(diagnostics)?;

    // ---- 4. so does labelling one `reports.kyverno.io/disabled` ----------------------------
    cpols
        .patch(
            DISABLED_POLICY,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"reports.kyverno.io/disabled": "true"}}})),
        )
        .await?;
    eventually(
        "results of the report-disabled policy dropped",
        Duration::from_secs(60),
        || async {
            let report = reports.get(&cm_uid).await?;
            Ok(
                (results_of(&report) == expected(0, &[DELETED_POLICY, DISABLED_POLICY]))
                    .then_some(()),
            )
        },
    )
    .await
    .with_context(diagnostics)?;
    let want = expected(0, &[DELETED_POLICY, DISABLED_POLICY]);
    let count = |r: PolicyResult| want.values().filter(|v| **v == r).count() as i64;
    let summary = reports.get(&cm_uid).await?.summary.unwrap_or_default();
    ensure!(
        (summary.fail, summary.pass)
            == (
                Some(count(PolicyResult::Fail)),
                Some(count(PolicyResult::Pass))
            ),
        "summary after both policy changes: {summary:?}"
    );

    // One merge round of the namespace in the JSON log: each step under its span.
    let log = reports_server_tests::json_log::read(&server.log_path())?;
    let steps = reports_server_tests::json_log::steps_under(
        &log,
        "merge",
        ("namespace", NS),
        &["load_page", "plan", "apply_plan"],
    )
    .with_context(diagnostics)?;
    for line in steps {
        eprintln!("[e2e] merge step: {line}");
    }

    delegated::unregister_apiservices(&cp).await?;
    server.kill();
    cp.stop().await?;
    eprintln!(
        "[e2e] in-process aggregation with the cluster: {:.1?}",
        t0.elapsed()
    );
    Ok(())
}
