//! `cargo xtask`: the project's automation, written in Rust so it runs wherever cargo does.
//!
//! `cargo xtask test` is the README's test command and what CI runs. `cargo test --workspace`
//! runs its test binaries one after another, and most of their time is spent waiting: on a
//! kube-apiserver to start, a garbage collector to rediscover resources, Kyverno to scan. So this
//! builds every test binary once, then runs several at a time, longest first (durations
//! remembered from earlier runs), each with its output in its own log, and prints one line per
//! binary and a summary with every binary's wall and CPU time. `--fast` is the contributors' tier: the
//! unit and property tests of every crate, no servers.

// One unsafe call, `wait4` in run.rs (the CPU time of a test binary), allowed where it is.
#![deny(unsafe_code)]

mod artefacts;
mod run;
mod schedule;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::Parser;

/// Binaries that run alone, before the others. Each brings up a real node (containerd, a
/// kubelet, pods) next to a control plane and asserts that not one request fails while pods
/// roll; with other end-to-end binaries beside it on two cores, a request now and then waited
/// past its 5 s bound.
const ALONE: &[&str] = &[
    "tests/e2e_node",
    "tests/e2e_kyverno_node",
    "tests/e2e_operator_node",
    "tests/e2e_outage_node",
];

/// Binaries whose tests mostly wait (on watch timeouts, bookmarks, servers starting) and get
/// more test threads than libtest's default of one per core. In a CI run on two cores the two
/// conformance binaries took 441 s and 438 s of wall time for 47 s and 33 s of CPU.
const MOSTLY_WAITING: &[(&str, usize)] =
    &[("tests/conformance", 6), ("tests/conformance_mariadb", 6)];

#[derive(Parser)]
#[command(name = "cargo xtask", about = "reports-server's project automation")]
enum Command {
    /// Build the workspace's test binaries once and run them concurrently.
    Test(TestArgs),
}

#[derive(clap::Args)]
struct TestArgs {
    /// How many test binaries run at once. Each binary still runs its own tests on as many
    /// threads as libtest gives it; end-to-end binaries mostly wait, so more jobs than cores pay.
    #[arg(long, short, env = "REPORTS_SERVER_TEST_JOBS", default_value_t = 3)]
    jobs: usize,
    /// The fast tier: the unit and property tests of every crate (`--lib --bins`), no real
    /// servers, control planes or databases.
    #[arg(long)]
    fast: bool,
    /// Also run these binaries alone, before the others (exact names, repeatable); the node
    /// tests always do.
    #[arg(long = "alone", value_name = "NAME")]
    alone: Vec<String>,
    /// Run only the binaries whose name (as printed, e.g. `tests/conformance`) contains one of
    /// these; repeatable.
    #[arg(long = "only", value_name = "NAME")]
    only: Vec<String>,
    /// How long one test binary may run before it is killed and counted as failed (its log
    /// then names the tests still running). The slowest binary (the migration's end-to-end
    /// tests) took up to 30 min on a busy 2-core CI machine; a hang should not take the rest of
    /// CI's 90 minutes with it.
    #[arg(
        long,
        env = "REPORTS_SERVER_TEST_TIMEOUT_MINUTES",
        default_value_t = 45
    )]
    timeout_minutes: u64,
    /// Arguments given to every test binary, after `--`: a test-name filter, `--nocapture`,
    /// `--test-threads 1`.
    #[arg(last = true)]
    test_args: Vec<String>,
}

fn main() -> ExitCode {
    match Command::parse() {
        Command::Test(args) => match test(args) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("xtask: {e:#}");
                ExitCode::from(2)
            }
        },
    }
}

/// Builds, plans and runs; `Ok(false)` when some binary failed.
fn test(args: TestArgs) -> Result<bool> {
    let workspace = workspace_root();
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|d| {
            if d.is_relative() {
                workspace.join(d)
            } else {
                d
            }
        })
        .unwrap_or_else(|| workspace.join("target"));
    let built = artefacts::build(&workspace, args.fast)?;
    let mut jobs = built.jobs;
    if !args.fast && args.only.is_empty() {
        jobs.push(artefacts::doc_tests(&workspace));
    }
    jobs.retain(|job| args.only.is_empty() || args.only.iter().any(|o| job.name.contains(o)));
    if jobs.is_empty() {
        anyhow::bail!("no test binary matches --only {:?}", args.only);
    }
    let remember = schedule::runs_every_test(&args.test_args);
    let history_path = target_dir.join("xtask").join("test-durations.json");
    let history = schedule::History::load(&history_path);
    let jobs = schedule::longest_first(jobs, |job| history.seconds(&job.name));
    let settings = run::Settings {
        jobs: args.jobs.max(1),
        log_dir: target_dir.join("xtask").join("logs"),
        test_args: args.test_args,
        server_binary: built.server_binary,
        timeout: Duration::from_secs(args.timeout_minutes * 60),
        test_threads: MOSTLY_WAITING,
    };
    let (alone, together): (Vec<_>, Vec<_>) = jobs
        .into_iter()
        .partition(|job| ALONE.contains(&job.name.as_str()) || args.alone.contains(&job.name));
    let mut outcomes = Vec::new();
    if !alone.is_empty() {
        let names: Vec<&str> = alone.iter().map(|job| job.name.as_str()).collect();
        eprintln!(
            "xtask: first, one at a time with nothing beside them: {}",
            names.join(", ")
        );
        let one_at_a_time = run::Settings {
            jobs: 1,
            ..settings.clone()
        };
        outcomes.extend(run::run_all(alone, &one_at_a_time)?);
    }
    if !together.is_empty() {
        outcomes.extend(run::run_all(together, &settings)?);
    }
    let mut history = history;
    for outcome in outcomes.iter().filter(|_| remember) {
        let wall = outcome.wall.as_secs_f64();
        // A failed or killed run's time is a lower bound: a binary that got slower (and timed
        // out) must still be started early next time.
        if outcome.passed() || history.seconds(&outcome.name).is_none_or(|s| wall > s) {
            history.record(&outcome.name, wall);
        }
    }
    if let Err(e) = history.save(&history_path) {
        eprintln!(
            "xtask: cannot remember durations in {}: {e}",
            history_path.display()
        );
    }
    Ok(run::report(&outcomes))
}

/// The workspace root: the parent of the xtask directory `cargo run` was started for. Read at
/// run time: with a target directory shared by several checkouts (CI's cache, a developer's
/// clones) the binary cargo runs may have been built from another one.
fn workspace_root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .parent()
        .expect("xtask lives inside the workspace")
        .to_path_buf()
}
