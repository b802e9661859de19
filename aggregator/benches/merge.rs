//! Merge throughput on Pod Security Standards reports: `cargo bench -p reports-server-aggregator`.
//!
//! Prints figures instead of asserting them (timings belong in benchmarks, not tests). No
//! criterion: one warm-up and a few timed rounds are enough to see orders of magnitude.
//!
//! Like criterion, it measures only when cargo says so (`cargo bench` passes `--bench`). Run
//! any other way — `cargo test --benches`, the test runner's sweep of every built binary — it
//! merges the smallest input once, which shows the bench still works without spending minutes
//! of an unoptimized build on figures nobody reads.

use std::time::{Duration, Instant};

use reports_server_aggregator::merge::{MergeInput, MergeOptions, merge_namespace, merge_page};
use reports_server_aggregator::report::{Ephemeral, FinalReport};
use reports_server_aggregator::{Layout, Plan};
use reports_server_crds::fixtures::{Subject, pss_ephemeral_report, pss_policy_report};

fn inputs(pods: u64) -> (Vec<FinalReport>, Vec<Ephemeral>) {
    let mut reports = Vec::new();
    let mut ephemerals = Vec::new();
    for n in 0..pods {
        let s = Subject::pod("bench", n);
        let mut r = pss_policy_report(&s, 1000, &[]);
        for x in r.results.iter_mut().flatten() {
            x.resources = None;
        }
        reports.push(FinalReport::PolicyReport(r));
        ephemerals.push(Ephemeral::Namespaced(pss_ephemeral_report(
            &s,
            2000,
            &[1, 5],
        )));
    }
    (reports, ephemerals)
}

fn time(label: &str, results: usize, rounds: usize, mut f: impl FnMut() -> Plan) {
    let _ = f();
    let mut best = Duration::MAX;
    for _ in 0..rounds {
        let t = Instant::now();
        let plan = f();
        best = best.min(t.elapsed());
        assert!(!plan.is_empty());
    }
    println!(
        "{label:<44} {:>9.1} ms  {:>10.0} results/s",
        best.as_secs_f64() * 1e3,
        results as f64 / best.as_secs_f64()
    );
}

fn main() {
    let measuring = std::env::args().any(|a| a == "--bench");
    let (sizes, rounds): (&[u64], usize) = if measuring {
        (&[100, 1000, 5000], 3)
    } else {
        println!("test mode: one small round; `cargo bench -p reports-server-aggregator` measures");
        (&[100], 1)
    };
    for &pods in sizes {
        let (reports, ephemerals) = inputs(pods);
        let results = pods as usize * 19 * 2;
        let input = MergeInput {
            namespace: "bench",
            reports: &reports,
            ephemerals: &ephemerals,
            policies: None,
        };
        time(
            &format!("per-resource, namespace-wide, {pods} pods"),
            results,
            rounds,
            || merge_namespace(&input, &MergeOptions::default()),
        );
        time(
            &format!("per-resource, pages of 500, {pods} pods"),
            results,
            rounds,
            || {
                let mut plan = Plan::default();
                for (r, e) in reports.chunks(500).zip(ephemerals.chunks(500)) {
                    let page = MergeInput {
                        reports: r,
                        ephemerals: e,
                        ..input
                    };
                    plan.extend(merge_page(&page, &MergeOptions::default()).unwrap());
                }
                plan
            },
        );
        let per_policy = MergeOptions {
            layout: Layout::PerPolicy,
            ..MergeOptions::default()
        };
        time(
            &format!("per-policy (chunks of 1000), {pods} pods"),
            results,
            rounds,
            || merge_namespace(&input, &per_policy),
        );
    }
}
