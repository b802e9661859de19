//! Which binary starts first. With a fixed number of slots, starting the longest jobs first
//! (LPT scheduling) keeps one long binary from starting last and running alone. How long a binary
//! takes is learned from earlier runs on this machine, kept next to the build in the target
//! directory; a binary never seen runs first, since it may be the longest.

use std::collections::BTreeMap;
use std::path::Path;

/// Wall seconds of each binary's last passing run.
#[derive(Debug, Default)]
pub struct History {
    seconds: BTreeMap<String, f64>,
}

impl History {
    /// The remembered durations; none when the file is missing or unreadable (a first run).
    pub fn load(path: &Path) -> History {
        let seconds = std::fs::read(path)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        History { seconds }
    }

    pub fn seconds(&self, name: &str) -> Option<f64> {
        self.seconds.get(name).copied()
    }

    pub fn record(&mut self, name: &str, seconds: f64) {
        self.seconds.insert(name.to_owned(), seconds);
    }

    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_vec_pretty(&self.seconds)?)
    }
}

/// Whether libtest given `args` runs every test of a binary: only then is its wall time the
/// binary's, worth remembering. A name filter, `--skip` or `--exact` picks some tests (the
/// migration's end-to-end binary, timed on one test in 217 s, was then started late in CI,
/// where all three take 20 to 40 min).
pub fn runs_every_test(args: &[String]) -> bool {
    const WITH_VALUE: [&str; 4] = ["--test-threads", "--color", "--format", "--logfile"];
    const PLAIN: [&str; 5] = [
        "--nocapture",
        "--show-output",
        "--quiet",
        "-q",
        "--report-time",
    ];
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let flag = arg.split('=').next().unwrap_or(arg);
        if WITH_VALUE.contains(&flag) {
            if !arg.contains('=') {
                args.next();
            }
        } else if !PLAIN.contains(&arg.as_str()) {
            return false;
        }
    }
    true
}

/// Unknown durations first (in the given order), then the known ones, longest first.
pub fn longest_first<T>(jobs: Vec<T>, seconds: impl Fn(&T) -> Option<f64>) -> Vec<T> {
    let mut keyed: Vec<(Option<f64>, usize, T)> = jobs
        .into_iter()
        .enumerate()
        .map(|(i, job)| (seconds(&job), i, job))
        .collect();
    keyed.sort_by(|(a, ai, _), (b, bi, _)| match (a, b) {
        (None, None) => ai.cmp(bi),
        (None, Some(_)) => std::cmp::Ordering::Less,
        (Some(_), None) => std::cmp::Ordering::Greater,
        (Some(a), Some(b)) => b.total_cmp(a).then(ai.cmp(bi)),
    });
    keyed.into_iter().map(|(_, _, job)| job).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_runs_of_every_test_are_remembered() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(runs_every_test(&[]));
        assert!(runs_every_test(&args(&[
            "--nocapture",
            "--test-threads",
            "1",
            "--color=never"
        ])));
        assert!(!runs_every_test(&args(&["operator_moves", "--nocapture"])));
        assert!(!runs_every_test(&args(&["--skip", "slow"])));
        assert!(!runs_every_test(&args(&["--exact", "a_test"])));
    }

    #[test]
    fn unknown_first_then_longest_first_ties_in_given_order() {
        let known = BTreeMap::from([("a", 10.0), ("b", 300.0), ("c", 10.0), ("d", 45.0)]);
        let jobs = vec!["a", "new1", "b", "c", "new2", "d"];
        let ordered = longest_first(jobs, |j| known.get(j).copied());
        assert_eq!(ordered, ["new1", "new2", "b", "d", "a", "c"]);
    }

    #[test]
    fn history_survives_a_round_trip_and_a_missing_file_is_empty() {
        let dir = std::env::temp_dir().join(format!("xtask-history-{}", std::process::id()));
        let path = dir.join("nested").join("durations.json");
        assert_eq!(History::load(&path).seconds("x"), None);
        let mut history = History::default();
        history.record("tests/conformance", 738.5);
        history.save(&path).unwrap();
        assert_eq!(
            History::load(&path).seconds("tests/conformance"),
            Some(738.5)
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
