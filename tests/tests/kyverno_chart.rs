//! Kyverno's own Helm chart (kyverno/kyverno 3.9.1, Kyverno v1.19.1) rendered with the values
//! files docs/kyverno.md gives for running Kyverno against reports-server
//! (`manifests/kyverno/values-mode-{a,b}.yaml`, `values-openreports.yaml`), so the documented
//! values and what the chart makes of them cannot drift apart. Pure rendering (`helm template`),
//! no cluster.
//!
//! The chart comes from the Kyverno module source in the Go module cache (downloaded by
//! `tests/kyverno/build.sh`); its dependencies that are not vendored (`kyverno-api`,
//! `openreports`, `reports-server`) are replaced by stub charts that render one marker ConfigMap
//! each, so the output shows which subcharts a values file turns on.
//!
//! Checked per rendering: the reports controller's `--aggregateReports` and
//! `--reportsCRDsSanityChecks=false`, `--openreportsEnabled` on the reports controller and the
//! admission controller's init container, no CRD of a group reports-server serves, and no peer
//! subchart. Three control renderings, each with one documented key undone, show that the checks
//! can fail and that each of the two keys behind `--reportsCRDsSanityChecks=false` suffices
//! alone. The YAML block docs/kyverno.md shows is compared with the files.
//!
//! Needs Go (for `go env GOMODCACHE` and the module download) and the helm of
//! `tests/tools/build.sh`; a missing one fails with what to run.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use reports_server_tests::{
    controlplane::workspace_root,
    kyverno::KYVERNO_VERSION,
    operator::{helm, yaml_docs},
    tools::tool,
};
use serde_json::Value;

/// The chart version released with [`KYVERNO_VERSION`].
const CHART_VERSION: &str = "3.9.1";
/// Where the documented values files live (docs/kyverno.md links them).
const VALUES_DIR: &str = "manifests/kyverno";
/// The page and section that document them.
const DOC: &str = "docs/kyverno.md";
const DOC_SECTION: &str = "## Kyverno's Helm chart pointed at reports-server";
/// The dependencies of the chart's Chart.yaml that it does not vendor under `charts/`.
const STUBBED: [&str; 3] = ["kyverno-api", "openreports", "reports-server"];
/// The label of the stub charts' marker ConfigMaps; its value is the stubbed chart's name.
const STUB_LABEL: &str = "reports-server.test/stub-chart";
/// The report CRDs the chart's `crds` subchart renders unless `crds.reportsServer.enabled`.
const REPORT_CRDS: [&str; 4] = [
    "policyreports.wgpolicyk8s.io",
    "clusterpolicyreports.wgpolicyk8s.io",
    "ephemeralreports.reports.kyverno.io",
    "clusterephemeralreports.reports.kyverno.io",
];
/// A CRD that every rendering has: proves the CRD checks look at real CRDs.
const KYVERNO_CRD: &str = "clusterpolicies.kyverno.io";

/// One `helm template` run and what its output must show.
struct Rendering {
    name: &'static str,
    /// Values files of [`VALUES_DIR`], in order.
    files: &'static [&'static str],
    /// `--set` overrides on top: the control renderings undo one documented key each.
    sets: &'static [&'static str],
    aggregate_reports: bool,
    openreports: bool,
    /// Whether the four [`REPORT_CRDS`] are rendered.
    report_crds: bool,
    /// The stubbed subcharts rendered.
    stubs: &'static [&'static str],
}

const A: &str = "values-mode-a.yaml";
const B: &str = "values-mode-b.yaml";
const OPENREPORTS: &str = "values-openreports.yaml";

const RENDERINGS: [Rendering; 7] = [
    Rendering {
        name: "mode A",
        files: &[A],
        sets: &[],
        aggregate_reports: true,
        openreports: false,
        report_crds: false,
        stubs: &["kyverno-api"],
    },
    Rendering {
        name: "mode B",
        files: &[B],
        sets: &[],
        aggregate_reports: false,
        openreports: false,
        report_crds: false,
        stubs: &["kyverno-api"],
    },
    Rendering {
        name: "mode A + openreports",
        files: &[A, OPENREPORTS],
        sets: &[],
        aggregate_reports: true,
        openreports: true,
        report_crds: false,
        stubs: &["kyverno-api"],
    },
    Rendering {
        name: "mode B + openreports",
        files: &[B, OPENREPORTS],
        sets: &[],
        aggregate_reports: false,
        openreports: true,
        report_crds: false,
        stubs: &["kyverno-api"],
    },
    // Without crds.reportsServer.enabled the report CRDs come back (so their absence above is
    // that key's doing), and reportsController.sanityChecks=false alone still renders the flag.
    Rendering {
        name: "control: mode A, crds.reportsServer.enabled=false",
        files: &[A],
        sets: &["crds.reportsServer.enabled=false"],
        aggregate_reports: true,
        openreports: false,
        report_crds: true,
        stubs: &["kyverno-api"],
    },
    // crds.reportsServer.enabled alone renders the flag (and keeps validate.yaml quiet).
    Rendering {
        name: "control: mode B, reportsController.sanityChecks=true",
        files: &[B],
        sets: &["reportsController.sanityChecks=true"],
        aggregate_reports: false,
        openreports: false,
        report_crds: false,
        stubs: &["kyverno-api"],
    },
    // The peer's subchart and the upstream openreports CRDs, had the values asked for them.
    Rendering {
        name: "control: mode B, reportsServer.enabled=true, openreports.installCrds=true",
        files: &[B, OPENREPORTS],
        sets: &["reportsServer.enabled=true", "openreports.installCrds=true"],
        aggregate_reports: false,
        openreports: true,
        report_crds: false,
        stubs: &["kyverno-api", "openreports", "reports-server"],
    },
];

#[tokio::test]
async fn kyverno_chart_with_documented_values() -> Result<()> {
    docs_match_values_files()?;
    let helm_bin = tool("helm").await?;
    let source = chart_source()?;
    let tmp = tempfile::tempdir()?;
    let chart = tmp.path().join("kyverno");
    copy_dir(&source, &chart)?;
    stub_dependencies(&chart)?;
    // Under `helm template` the chart's `lookup` (validate.yaml) answers empty without a
    // cluster; a kubeconfig that does not exist keeps the user's out of it all the same.
    let no_kubeconfig = tmp.path().join("no-kubeconfig");
    for r in &RENDERINGS {
        let mut args = vec![
            "template".to_owned(),
            "kyverno".to_owned(),
            chart.display().to_string(),
            "--namespace".to_owned(),
            "kyverno".to_owned(),
        ];
        for f in r.files {
            let path = workspace_root().join(VALUES_DIR).join(f);
            ensure!(path.is_file(), "{} is missing", path.display());
            args.extend(["--values".to_owned(), path.display().to_string()]);
        }
        for s in r.sets {
            args.extend(["--set".to_owned(), (*s).to_owned()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let docs = yaml_docs(&helm(&helm_bin, &no_kubeconfig, &args)?)
            .with_context(|| format!("parsing the rendering of {}", r.name))?;
        let summary = check(r, &docs).with_context(|| format!("rendering {}", r.name))?;
        println!("{}: {summary}", r.name);
    }
    Ok(())
}

/// docs/kyverno.md shows mode B's values inline and says mode A differs in one key: both
/// statements are checked against the files the renderings use.
fn docs_match_values_files() -> Result<()> {
    let root = workspace_root();
    let doc = fs::read_to_string(root.join(DOC))?;
    let section = doc
        .split_once(DOC_SECTION)
        .with_context(|| format!("{DOC} has no section {DOC_SECTION:?}"))?
        .1;
    for f in [A, B, OPENREPORTS] {
        ensure!(
            section.contains(&format!("(../{VALUES_DIR}/{f})")),
            "{DOC}'s section {DOC_SECTION:?} does not link {VALUES_DIR}/{f}"
        );
    }
    let shown = section
        .split_once("```yaml\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .with_context(|| format!("{DOC}'s section {DOC_SECTION:?} has no YAML block"))?
        .0;
    let shown: Value = serde_yaml::from_str(shown)?;
    let read = |f: &str| -> Result<Value> {
        Ok(serde_yaml::from_str(&fs::read_to_string(
            root.join(VALUES_DIR).join(f),
        )?)?)
    };
    let b = read(B)?;
    ensure!(
        shown == b,
        "{DOC} shows mode B's values as {shown}, but {VALUES_DIR}/{B} is {b}"
    );
    let mut a = read(A)?;
    ensure!(
        a["features"]["aggregateReports"]["enabled"] == true,
        "{VALUES_DIR}/{A} does not enable features.aggregateReports"
    );
    a["features"]["aggregateReports"]["enabled"] = false.into();
    ensure!(
        a == b,
        "{VALUES_DIR}/{A} differs from {B} in more than features.aggregateReports.enabled"
    );
    Ok(())
}

/// The chart directory in the Kyverno module source of the Go module cache.
fn chart_source() -> Result<PathBuf> {
    let how = format!(
        "run `bash tests/kyverno/build.sh`, which downloads github.com/kyverno/kyverno into the Go \
         module cache (with its binaries already cached it downloads nothing: then `cd /tmp && go \
         mod download github.com/kyverno/kyverno@{KYVERNO_VERSION}`)"
    );
    // GOTOOLCHAIN=local: `go env` must not download a toolchain to answer.
    let out = Command::new("go")
        .args(["env", "GOMODCACHE"])
        .env("GOTOOLCHAIN", "local")
        .output()
        .with_context(|| format!("running `go env GOMODCACHE` (install Go, then {how})"))?;
    ensure!(
        out.status.success(),
        "go env GOMODCACHE failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cache = PathBuf::from(String::from_utf8(out.stdout)?.trim());
    let dir = cache
        .join(format!("github.com/kyverno/kyverno@{KYVERNO_VERSION}"))
        .join("charts/kyverno");
    let chart_yaml = dir.join("Chart.yaml");
    if !chart_yaml.is_file() {
        bail!("Kyverno's Helm chart is not at {}: {how}", dir.display());
    }
    let meta: Value = serde_yaml::from_str(&fs::read_to_string(&chart_yaml)?)?;
    ensure!(
        meta["version"] == CHART_VERSION && meta["appVersion"] == KYVERNO_VERSION,
        "{} is chart {} of Kyverno {}, expected {CHART_VERSION} of {KYVERNO_VERSION}",
        chart_yaml.display(),
        meta["version"],
        meta["appVersion"]
    );
    Ok(dir)
}

/// Copies a directory tree; the module cache's files are read-only, the copies' directories
/// are writable so that the stubs can be added.
fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            fs::copy(entry.path(), &target)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// Adds a stub chart under `charts/<name>/` for every dependency of Chart.yaml that the chart
/// does not vendor. `helm template` refuses a chart with a dependency missing from `charts/`,
/// whatever its condition, but it checks only that each one is present there: it neither
/// fetches (no `--dependency-update`) nor compares Chart.lock, which therefore stays as it is.
fn stub_dependencies(chart: &Path) -> Result<()> {
    let meta: Value = serde_yaml::from_str(&fs::read_to_string(chart.join("Chart.yaml"))?)?;
    let deps = meta["dependencies"]
        .as_array()
        .context("Chart.yaml has no dependencies")?;
    let mut stubbed = BTreeSet::new();
    for dep in deps {
        let name = dep["name"].as_str().context("a dependency without name")?;
        let version = dep["version"]
            .as_str()
            .context("a dependency without version")?;
        let dir = chart.join("charts").join(name);
        if dir.is_dir() {
            continue;
        }
        fs::create_dir_all(dir.join("templates"))?;
        fs::write(
            dir.join("Chart.yaml"),
            format!("apiVersion: v2\nname: {name}\nversion: {version}\n"),
        )?;
        fs::write(
            dir.join("templates/marker.yaml"),
            format!(
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: stub-{name}\n  labels:\n    \
                 {STUB_LABEL}: {name}\n"
            ),
        )?;
        stubbed.insert(name);
    }
    ensure!(
        stubbed == BTreeSet::from(STUBBED),
        "the chart's dependencies not vendored under charts/ are {stubbed:?}, expected {STUBBED:?} \
         (docs/kyverno.md describes them)"
    );
    Ok(())
}

/// Checks one rendering against its expectations; a one-line summary.
fn check(r: &Rendering, docs: &[Value]) -> Result<String> {
    let reports = container_args(docs, "reports-controller", "containers", "controller")?;
    // The admission controller's binary has no --openreportsEnabled; its init container
    // (kyverno-init) has, and the chart gives it the flag there.
    let admission = container_args(
        docs,
        "admission-controller",
        "initContainers",
        "kyverno-pre",
    )?;
    let aggregate = format!("--aggregateReports={}", r.aggregate_reports);
    let openreports = format!("--openreportsEnabled={}", r.openreports);
    let sanity = "--reportsCRDsSanityChecks=false";
    ensure!(
        reports
            .iter()
            .filter(|a| a.starts_with("--aggregateReports="))
            .count()
            == 1
            && reports.contains(&aggregate),
        "the reports controller's args lack {aggregate} (or have it twice): {reports:?}"
    );
    ensure!(
        reports.iter().any(|a| a == sanity),
        "the reports controller's args lack {sanity}: {reports:?}"
    );
    for (who, args) in [
        ("reports controller", &reports),
        ("admission controller's kyverno-pre", &admission),
    ] {
        ensure!(
            args.contains(&openreports),
            "the {who} args lack {openreports}: {args:?}"
        );
    }

    let crds: BTreeSet<&str> = of_kind(docs, "CustomResourceDefinition")
        .filter_map(|d| d["metadata"]["name"].as_str())
        .collect();
    ensure!(
        crds.contains(KYVERNO_CRD),
        "no {KYVERNO_CRD} among the rendered CRDs {crds:?}"
    );
    let report_crds: Vec<&str> = REPORT_CRDS
        .into_iter()
        .filter(|c| crds.contains(c))
        .collect();
    let want: Vec<&str> = if r.report_crds {
        REPORT_CRDS.to_vec()
    } else {
        Vec::new()
    };
    ensure!(
        report_crds == want,
        "report CRDs rendered: {report_crds:?}, expected {want:?}"
    );
    let openreports_crds: Vec<&Value> = of_kind(docs, "CustomResourceDefinition")
        .filter(|d| {
            d["spec"]["group"] == "openreports.io"
                || d["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with(".openreports.io"))
        })
        .collect();
    ensure!(
        openreports_crds.is_empty(),
        "openreports.io CRDs rendered: {openreports_crds:?}"
    );

    let stubs: BTreeSet<&str> = of_kind(docs, "ConfigMap")
        .filter_map(|d| d["metadata"]["labels"][STUB_LABEL].as_str())
        .collect();
    ensure!(
        stubs == r.stubs.iter().copied().collect(),
        "subcharts rendered: {stubs:?}, expected {:?}",
        r.stubs
    );

    Ok(format!(
        "{} objects; reports-controller {aggregate} {sanity} {openreports}, kyverno-pre \
         {openreports}; {} CRDs, {} of 4 report CRDs; subcharts {stubs:?}",
        docs.len(),
        crds.len(),
        report_crds.len()
    ))
}

fn of_kind<'a>(docs: &'a [Value], kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    docs.iter().filter(move |d| d["kind"] == kind)
}

/// The args of one container of the one Deployment of a component
/// (`app.kubernetes.io/component`); `field` is `containers` or `initContainers`.
fn container_args(docs: &[Value], component: &str, field: &str, name: &str) -> Result<Vec<String>> {
    let deployments: Vec<&Value> = of_kind(docs, "Deployment")
        .filter(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == component)
        .collect();
    let [deployment] = deployments[..] else {
        bail!("{} Deployments of {component}", deployments.len());
    };
    let container = deployment["spec"]["template"]["spec"][field]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["name"] == name)
        .with_context(|| format!("the {component} Deployment has no {field} entry {name}"))?;
    Ok(container["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect())
}
