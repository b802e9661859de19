//! Rules a long test checks along the way. An outage or failover test is a run of phases whose
//! figures are all worth seeing, so a broken rule is recorded (and printed once) and the test
//! fails at its end with every broken rule, its count and its first example.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::server::ServerProcess;

pub struct Findings {
    /// The prefix of the test's printed lines, e.g. `[degrade]`.
    tag: &'static str,
    broken: Mutex<BTreeMap<&'static str, (usize, String)>>,
}

impl Findings {
    pub fn new(tag: &'static str) -> Self {
        Findings {
            tag,
            broken: Mutex::default(),
        }
    }

    pub fn check(&self, ok: bool, rule: &'static str, example: impl FnOnce() -> String) {
        if !ok {
            self.fail(rule, example());
        }
    }

    pub fn fail(&self, rule: &'static str, example: String) {
        let mut broken = self.broken.lock().unwrap();
        broken
            .entry(rule)
            .or_insert_with(|| {
                eprintln!("{} FAILED {rule}: {example}", self.tag);
                (0, example)
            })
            .0 += 1;
    }

    pub fn is_empty(&self) -> bool {
        self.broken.lock().unwrap().is_empty()
    }

    /// Fails the test with every broken rule and the server's log tail.
    pub fn assert_none(&self, server: &ServerProcess) {
        let broken = self.broken.lock().unwrap();
        let list: Vec<String> = broken
            .iter()
            .map(|(rule, (n, example))| format!("- {rule} ({n}×), e.g. {example}"))
            .collect();
        assert!(
            list.is_empty(),
            "{} rule(s) broken:\n{}\nserver log:\n{}",
            list.len(),
            list.join("\n"),
            server.log_tail()
        );
    }

    /// The server is still the process `pid` the test started, alive and not a zombie, through
    /// `what` (an outage, a failover).
    pub fn check_same_process(&self, server: &ServerProcess, pid: u32, what: &str) {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // "pid (comm) STATE …": a zombie has exited.
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .chars()
            .next();
        self.check(
            server.pid() == Some(pid) && state.is_some_and(|s| s != 'Z'),
            "the server process lives on",
            || {
                format!(
                    "expected process {pid} running through {what}, saw pid {:?} in state {state:?}",
                    server.pid()
                )
            },
        );
    }
}
