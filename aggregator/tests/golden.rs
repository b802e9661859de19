//! Golden tests: each directory under `tests/golden/` holds `input.yaml` (ephemeral and policy
//! reports as Kyverno writes them), `options.yaml` (layout, chunk size, output, policy files
//! relative to the case directory) and `expected.yaml`, the output of `aggregate_offline`.
//!
//! Run with `UPDATE_GOLDEN=1` to rewrite `expected.yaml` after a deliberate change, then review
//! the diff against `docs/aggregation.md` before committing it.

use std::path::{Path, PathBuf};

use reports_server_aggregator::{Layout, OfflineOptions, OutputFormat, aggregate_offline};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CaseOptions {
    layout: String,
    #[serde(default)]
    chunk_size: Option<usize>,
    #[serde(default)]
    output: Option<String>,
    #[serde(default)]
    policies: Vec<PathBuf>,
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// Aggregates `input` with the options and policies of the case in `dir`.
fn run_case(dir: &Path, input: &Path) -> String {
    let options: CaseOptions =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("options.yaml")).unwrap()).unwrap();
    let offline = OfflineOptions {
        layout: options.layout.parse::<Layout>().unwrap(),
        chunk_size: options
            .chunk_size
            .unwrap_or(OfflineOptions::default().chunk_size),
        output: options
            .output
            .as_deref()
            .map(|o| o.parse::<OutputFormat>().unwrap())
            .unwrap_or_default(),
    };
    let policies: Vec<PathBuf> = options.policies.iter().map(|p| dir.join(p)).collect();
    aggregate_offline(&[input.to_owned()], &policies, offline)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn check(case: &str) {
    let dir = golden_dir().join(case);
    let got = run_case(&dir, &dir.join("input.yaml"));
    let expected_path = dir.join("expected.yaml");
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&expected_path, &got).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&expected_path).unwrap_or_else(|_| {
        panic!(
            "{} is missing; run with UPDATE_GOLDEN=1 and review it",
            expected_path.display()
        )
    });
    if got != expected {
        let first = got
            .lines()
            .zip(expected.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(got.lines().count().min(expected.lines().count()));
        panic!(
            "{case}: output differs from expected.yaml at line {}:\n  got:      {:?}\n  expected: {:?}\n(UPDATE_GOLDEN=1 rewrites it)",
            first + 1,
            got.lines().nth(first),
            expected.lines().nth(first)
        );
    }
    // The output is a fixed point: aggregating it again changes nothing.
    let tmp = tempfile::tempdir().unwrap();
    let again = tmp.path().join("output.yaml");
    std::fs::write(&again, &got).unwrap();
    assert_eq!(run_case(&dir, &again), got, "{case}: not idempotent");
}

macro_rules! golden {
    ($($name:ident => $dir:literal,)*) => {$(
        #[test]
        fn $name() {
            check($dir);
        }
    )*};
}

golden! {
    pss_background => "pss-background",
    admission_then_background => "admission-then-background",
    deleted_policy => "deleted-policy",
    removed_rule => "removed-rule",
    same_second_tie => "same-second-tie",
    per_policy_chunks => "per-policy-chunks",
    cluster_scoped => "cluster-scoped",
    openreports_output => "openreports-output",
}

#[test]
fn every_case_directory_is_tested() {
    let mut dirs: Vec<String> = std::fs::read_dir(golden_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    dirs.sort();
    assert_eq!(
        dirs,
        [
            "admission-then-background",
            "cluster-scoped",
            "deleted-policy",
            "openreports-output",
            "per-policy-chunks",
            "pss-background",
            "removed-rule",
            "same-second-tie",
        ]
    );
}
