//! Runs the jobs in a fixed number of slots, each job's output in its own log file, and says as
//! it goes what started, what ended and what is still running, so a long CI run never looks hung.

use std::collections::VecDeque;
use std::fs::File;
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::artefacts::Job;

/// How the jobs run.
#[derive(Clone)]
pub struct Settings {
    pub jobs: usize,
    pub log_dir: PathBuf,
    pub test_args: Vec<String>,
    pub server_binary: Option<PathBuf>,
    /// How long one binary may run before it is killed and counted as failed: a hung test
    /// then costs this, not the rest of CI's time, and its log names what was still running.
    pub timeout: Duration,
    /// Test threads for binaries whose tests mostly wait (`RUST_TEST_THREADS`), unless the
    /// caller chose `--test-threads` or set `RUST_TEST_THREADS` itself.
    pub test_threads: &'static [(&'static str, usize)],
}

impl Settings {
    /// `env_chosen`: `RUST_TEST_THREADS` is set in xtask's own environment.
    fn test_threads_for(&self, job: &str, env_chosen: bool) -> Option<usize> {
        let chosen = env_chosen
            || self
                .test_args
                .iter()
                .any(|a| a.starts_with("--test-threads"));
        if chosen {
            return None;
        }
        self.test_threads
            .iter()
            .find(|(name, _)| *name == job)
            .map(|(_, threads)| *threads)
    }
}

/// How one job ended.
pub struct Outcome {
    pub name: String,
    pub wall: Duration,
    /// `None` when the process could not be started at all.
    pub status: Option<ExitStatus>,
    /// Killed at [`Settings::timeout`].
    pub timed_out: bool,
    /// User plus system CPU time of the binary and of every process it started and reaped
    /// (servers, control planes, databases): on CI's two cores the sum of these, not the wall
    /// times, is what makes the run long.
    pub cpu: Option<Duration>,
    pub spawn_error: Option<String>,
    pub counts: Counts,
    pub log: PathBuf,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        !self.timed_out && self.status.is_some_and(|s| s.success())
    }
}

/// The sums of libtest's `test result:` lines.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
}

const PROGRESS_EVERY: Duration = Duration::from_secs(60);

enum Event {
    Started(String),
    Ended(Outcome),
}

/// Runs every job; returns their outcomes in the order they ended.
pub fn run_all(jobs: Vec<Job>, settings: &Settings) -> Result<Vec<Outcome>> {
    std::fs::create_dir_all(&settings.log_dir)
        .with_context(|| format!("creating {}", settings.log_dir.display()))?;
    let total = jobs.len();
    let queue = Mutex::new(VecDeque::from(jobs));
    let (events, received) = mpsc::channel();
    let started = Instant::now();
    eprintln!(
        "xtask: running {total} test binaries, {} at a time; logs in {}",
        settings.jobs,
        settings.log_dir.display()
    );
    let outcomes = std::thread::scope(|scope| {
        for _ in 0..settings.jobs.min(total) {
            let events = events.clone();
            let queue = &queue;
            scope.spawn(move || {
                loop {
                    // Its own statement: a guard in a `while let` would be held (and every
                    // other slot kept waiting) for as long as the job runs.
                    let next = queue.lock().expect("queue lock").pop_front();
                    let Some(job) = next else { break };
                    let _ = events.send(Event::Started(job.name.clone()));
                    let _ = events.send(Event::Ended(run_one(&job, settings)));
                }
            });
        }
        drop(events);
        follow(received, total, started)
    });
    Ok(outcomes)
}

/// Prints each start and end as it happens and a line of what is running every minute.
fn follow(received: mpsc::Receiver<Event>, total: usize, started: Instant) -> Vec<Outcome> {
    let mut running: Vec<(String, Instant)> = Vec::new();
    let mut outcomes = Vec::with_capacity(total);
    let mut last_progress = Instant::now();
    loop {
        match received.recv_timeout(PROGRESS_EVERY) {
            Ok(Event::Started(name)) => running.push((name, Instant::now())),
            Ok(Event::Ended(outcome)) => {
                running.retain(|(name, _)| *name != outcome.name);
                eprintln!(
                    "xtask: [{}/{total}] {} {} in {:.0} s, {} ({}; {:.0} s since start)",
                    outcomes.len() + 1,
                    if outcome.passed() { "ok    " } else { "FAILED" },
                    outcome.name,
                    outcome.wall.as_secs_f64(),
                    cpu_text(&outcome),
                    describe(&outcome),
                    started.elapsed().as_secs_f64()
                );
                outcomes.push(outcome);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return outcomes,
        }
        if last_progress.elapsed() >= PROGRESS_EVERY && !running.is_empty() {
            let list: Vec<String> = running
                .iter()
                .map(|(name, since)| format!("{name} ({:.0} s)", since.elapsed().as_secs_f64()))
                .collect();
            eprintln!("xtask: still running: {}", list.join(", "));
            last_progress = Instant::now();
        }
    }
}

fn run_one(job: &Job, settings: &Settings) -> Outcome {
    let log = settings
        .log_dir
        .join(format!("{}.log", job.name.replace(['/', ':'], "-")));
    let started = Instant::now();
    let result = spawn_and_wait(job, settings, &log);
    let wall = started.elapsed();
    let counts = std::fs::read_to_string(&log)
        .map(|text| count_results(&text))
        .unwrap_or_default();
    let (status, timed_out, cpu, spawn_error) = match result {
        Ok((Ended::Exited(status), cpu)) => (Some(status), false, Some(cpu), None),
        Ok((Ended::Killed(status), cpu)) => (Some(status), true, Some(cpu), None),
        Err(e) => (None, false, None, Some(format!("{e:#}"))),
    };
    Outcome {
        name: job.name.clone(),
        wall,
        status,
        timed_out,
        cpu,
        spawn_error,
        counts,
        log,
    }
}

/// How a job's process ended.
enum Ended {
    Exited(ExitStatus),
    /// Killed at the timeout.
    Killed(ExitStatus),
}

fn spawn_and_wait(job: &Job, settings: &Settings, log: &PathBuf) -> Result<(Ended, Duration)> {
    let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut command = Command::new(&job.program);
    // Not even cargo test's own package variables: a test that runs cargo (to build an image)
    // must see the environment a cargo started from the shell sees, or it rebuilds everything.
    crate::artefacts::without_run_env(&mut command)
        .args(&job.args)
        .args(&settings.test_args)
        .current_dir(&job.cwd)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    if let Some(dir) = &job.manifest_dir {
        command.env("CARGO_MANIFEST_DIR", dir);
    }
    let env_chosen = std::env::var_os("RUST_TEST_THREADS").is_some();
    if let Some(threads) = settings.test_threads_for(&job.name, env_chosen) {
        command.env("RUST_TEST_THREADS", threads.to_string());
    }
    if let Some(server) = &settings.server_binary
        && std::env::var_os("REPORTS_SERVER_BIN").is_none()
    {
        command.env("REPORTS_SERVER_BIN", server);
    }
    let mut child = command
        .spawn()
        .with_context(|| format!("starting {}", job.program.display()))?;
    let started = Instant::now();
    loop {
        if let Some(ended) = reap(&child, false)? {
            return Ok((Ended::Exited(ended.0), ended.1));
        }
        if started.elapsed() >= settings.timeout {
            // The servers, control planes and databases a test starts die with it (they are
            // tied to the test process), so killing the binary frees its ports and cores.
            child.kill()?;
            let (status, cpu) = reap(&child, true)?.context("waiting for the killed binary")?;
            let unfinished = unfinished_tests(&std::fs::read_to_string(log).unwrap_or_default());
            let mut out = std::fs::OpenOptions::new().append(true).open(log)?;
            use std::io::Write as _;
            writeln!(
                out,
                "\nxtask: killed after {:.0} s (--timeout-minutes); still running: {}",
                settings.timeout.as_secs_f64(),
                if unfinished.is_empty() {
                    "(libtest had not said)".to_owned()
                } else {
                    unfinished.join(", ")
                }
            )?;
            return Ok((Ended::Killed(status), cpu));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `wait4` on the child: its exit status and the CPU time it and its reaped descendants used,
/// which `Child::wait` does not report. Once this has returned `Some`, the child is reaped and
/// must not be waited for or killed through `Child` again.
#[allow(unsafe_code)]
fn reap(child: &std::process::Child, block: bool) -> Result<Option<(ExitStatus, Duration)>> {
    use std::os::unix::process::ExitStatusExt as _;
    let pid = libc::pid_t::try_from(child.id()).context("the child's pid")?;
    let mut status = 0;
    // SAFETY: `rusage` is plain data that wait4 fills; zeroed is a valid value of it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let flags = if block { 0 } else { libc::WNOHANG };
    loop {
        // SAFETY: the pointers are to live locals; `pid` is our own unreaped child.
        let reaped = unsafe { libc::wait4(pid, &mut status, flags, &mut usage) };
        match reaped {
            0 => return Ok(None),
            r if r == pid => break,
            _ => {
                let error = std::io::Error::last_os_error();
                if error.kind() != std::io::ErrorKind::Interrupted {
                    return Err(error).context("wait4 on a test binary");
                }
            }
        }
    }
    let seconds = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    let cpu = seconds(usage.ru_utime) + seconds(usage.ru_stime);
    Ok(Some((ExitStatus::from_raw(status), cpu)))
}

/// The tests libtest said had been running for over 60 seconds and that never ended (a
/// captured test's output is only printed when it ends, so this is what a killed binary's log
/// can tell).
fn unfinished_tests(log: &str) -> Vec<String> {
    let long: Vec<&str> = log
        .lines()
        .filter_map(|l| {
            l.strip_prefix("test ")?
                .strip_suffix(" has been running for over 60 seconds")
        })
        .collect();
    long.into_iter()
        .filter(|name| {
            !log.lines().any(|l| {
                l.strip_prefix("test ")
                    .and_then(|rest| rest.strip_prefix(*name))
                    .is_some_and(|rest| rest.starts_with(" ... "))
            })
        })
        .map(str::to_owned)
        .collect()
}

fn cpu_text(outcome: &Outcome) -> String {
    outcome.cpu.map_or_else(
        || "CPU unknown".to_owned(),
        |cpu| format!("{:.1} s CPU", cpu.as_secs_f64()),
    )
}

fn describe(outcome: &Outcome) -> String {
    if let Some(e) = &outcome.spawn_error {
        return e.clone();
    }
    if outcome.timed_out {
        return format!(
            "killed at the timeout after {:.0} s; {} passed before",
            outcome.wall.as_secs_f64(),
            outcome.counts.passed
        );
    }
    let c = outcome.counts;
    let mut text = format!("{} passed", c.passed);
    if c.failed > 0 {
        text += &format!(", {} failed", c.failed);
    }
    if c.ignored > 0 {
        text += &format!(", {} ignored", c.ignored);
    }
    match outcome.status {
        Some(s) if !s.success() && c.failed == 0 => format!("{text}; exited with {s}"),
        _ => text,
    }
}

/// Sums every `test result: ok. 3 passed; 0 failed; 1 ignored; …` line of a log.
fn count_results(log: &str) -> Counts {
    let mut counts = Counts::default();
    for line in log.lines() {
        let Some(rest) = line.trim_start().strip_prefix("test result: ") else {
            continue;
        };
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(what), Some(n)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => counts.passed += n,
                "failed" => counts.failed += n,
                "ignored" => counts.ignored += n,
                _ => {}
            }
        }
    }
    counts
}

/// Prints the failed jobs' logs and a table of every job; true when all passed.
pub fn report(outcomes: &[Outcome]) -> bool {
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.passed()).collect();
    for outcome in &failed {
        eprintln!(
            "\n==== {} FAILED; its log ({}) ====",
            outcome.name,
            outcome.log.display()
        );
        match std::fs::read_to_string(&outcome.log) {
            Ok(text) => eprintln!("{text}"),
            Err(e) => eprintln!("(cannot read the log: {e})"),
        }
    }
    let mut by_time: Vec<&Outcome> = outcomes.iter().collect();
    by_time.sort_by_key(|o| std::cmp::Reverse(o.wall));
    eprintln!("\nxtask: wall and CPU time per test binary");
    for outcome in by_time {
        eprintln!(
            "  {:>7.1} s  {:>13}  {:<6}  {:<40} {}",
            outcome.wall.as_secs_f64(),
            cpu_text(outcome),
            if outcome.passed() { "ok" } else { "FAILED" },
            outcome.name,
            describe(outcome)
        );
    }
    let cpu: Duration = outcomes.iter().filter_map(|o| o.cpu).sum();
    eprintln!(
        "xtask: {:.0} s of CPU in all (user + system, with the processes the binaries reaped)",
        cpu.as_secs_f64()
    );
    let totals = outcomes.iter().fold(Counts::default(), |mut sum, o| {
        sum.passed += o.counts.passed;
        sum.failed += o.counts.failed;
        sum.ignored += o.counts.ignored;
        sum
    });
    eprintln!(
        "xtask: {} binaries, {} failed; {} tests passed, {} failed, {} ignored",
        outcomes.len(),
        failed.len(),
        totals.passed,
        totals.failed,
        totals.ignored
    );
    failed.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(dir: &str, jobs: usize, timeout: Duration) -> Settings {
        Settings {
            jobs,
            log_dir: std::env::temp_dir().join(format!("xtask-{dir}-{}", std::process::id())),
            test_args: Vec::new(),
            server_binary: None,
            timeout,
            test_threads: &[],
        }
    }

    #[test]
    fn jobs_run_at_the_same_time_up_to_the_slots() {
        let sleep = |name: &str| Job {
            name: name.to_owned(),
            program: "sleep".into(),
            args: vec!["1".into()],
            cwd: std::env::temp_dir(),
            manifest_dir: None,
        };
        let settings = settings("run", 3, Duration::from_secs(60));
        let started = Instant::now();
        let outcomes = run_all(
            vec![sleep("a"), sleep("b"), sleep("c"), sleep("d")],
            &settings,
        )
        .unwrap();
        let took = started.elapsed();
        assert!(outcomes.iter().all(Outcome::passed));
        // Three at once, then the fourth: two seconds, not four.
        assert!(
            took >= Duration::from_secs(2) && took < Duration::from_millis(3500),
            "{took:?}"
        );
        std::fs::remove_dir_all(&settings.log_dir).unwrap();
    }

    #[test]
    fn a_job_past_the_timeout_is_killed_and_fails() {
        let settings = settings("timeout", 1, Duration::from_millis(500));
        let job = Job {
            name: "hangs".to_owned(),
            program: "sleep".into(),
            args: vec!["30".into()],
            cwd: std::env::temp_dir(),
            manifest_dir: None,
        };
        let started = Instant::now();
        let outcomes = run_all(vec![job], &settings).unwrap();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(outcomes[0].timed_out && !outcomes[0].passed());
        let log = std::fs::read_to_string(&outcomes[0].log).unwrap();
        assert!(log.contains("killed after"), "{log}");
        std::fs::remove_dir_all(&settings.log_dir).unwrap();
    }

    #[test]
    fn the_cpu_of_a_binary_and_of_the_processes_it_reaped_is_counted() {
        let settings = settings("cpu", 1, Duration::from_secs(60));
        // The busy loop runs in a grandchild the shell waits for, as a test's servers do.
        let busy = |seconds: &str| Job {
            name: format!("busy {seconds}"),
            program: "sh".into(),
            args: vec![
                "-c".into(),
                format!("timeout {seconds} sh -c 'while :; do :; done'; exit 3"),
            ],
            cwd: std::env::temp_dir(),
            manifest_dir: None,
        };
        let outcomes = run_all(vec![busy("0.3"), busy("1.5")], &settings).unwrap();
        let cpu = |name: &str| {
            let outcome = outcomes.iter().find(|o| o.name == name).unwrap();
            assert_eq!(outcome.status.and_then(|s| s.code()), Some(3));
            outcome.cpu.unwrap()
        };
        assert!(cpu("busy 1.5") > cpu("busy 0.3"), "{:?}", cpu("busy 1.5"));
        assert!(cpu("busy 0.3") > Duration::ZERO);
        std::fs::remove_dir_all(&settings.log_dir).unwrap();
    }

    #[test]
    fn mostly_waiting_binaries_get_their_threads_unless_the_caller_chose() {
        let mut settings = settings("threads", 1, Duration::from_secs(60));
        settings.test_threads = &[("tests/conformance", 6)];
        assert_eq!(
            settings.test_threads_for("tests/conformance", false),
            Some(6)
        );
        assert_eq!(settings.test_threads_for("tests/other", false), None);
        assert_eq!(settings.test_threads_for("tests/conformance", true), None);
        settings.test_args = vec!["--test-threads=1".to_owned()];
        assert_eq!(settings.test_threads_for("tests/conformance", false), None);
    }

    #[test]
    fn the_tests_still_running_at_a_kill_are_named() {
        let log = "running 3 tests\n\
                   test a has been running for over 60 seconds\n\
                   test b has been running for over 60 seconds\n\
                   test a ... ok\n";
        assert_eq!(unfinished_tests(log), vec!["b".to_owned()]);
    }

    #[test]
    fn result_lines_are_summed_and_other_lines_ignored() {
        let log = "running 3 tests\n\
                   test a ... ok\n\
                   test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s\n\
                   some output mentioning 7 passed\n\
                   test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 5 filtered out\n";
        assert_eq!(
            count_results(log),
            Counts {
                passed: 5,
                failed: 1,
                ignored: 1
            }
        );
    }
}
