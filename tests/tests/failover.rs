//! A PostgreSQL failover under load, on Patroni (issue 31, "Degrade, don't disappear"): three
//! PostgreSQL 15 members with synchronous, strict replication, etcd as the DCS and HAProxy in
//! front ([`PatroniCluster`]); one server on HAProxy; writers creating reports at a steady rate
//! (200/s by default) and ten watchers on the collection. Then the primary goes away: its node is
//! killed (Patroni, the postmaster and every backend at once), or a planned `patronictl
//! switchover` demotes it. The load runs on through it.
//!
//! What must hold: every acknowledged create (201) is stored, at the resourceVersion it was
//! acknowledged with; no refused one (503) is; a create whose outcome the server could not know
//! (504, no answer) may be either, and is counted. Every watcher, resuming from the last
//! resourceVersion it saw whenever its stream ends, delivers each stored create exactly once, in
//! strictly increasing resourceVersion order, and nothing that was not stored. The server is the
//! same process throughout. The write-unavailability window (the longest time without an
//! acknowledged write around the disruption) and the rates are printed.
//!
//! `REPORTS_SERVER_FAILOVER_WRITES_PER_S` sets the offered write rate (default 200).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use reports_server_crds::PolicyReport;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use reports_server_tests::findings::Findings;
use reports_server_tests::patroni::PatroniCluster;
use reports_server_tests::server::ServerProcess;

const NS: &str = "failover";
const WATCHERS: usize = 10;
/// How long the first create may take to be acknowledged: on a busy CI machine the new
/// cluster's first synchronous commits took over 5 s.
const FIRST_ACK: Duration = Duration::from_secs(60);
/// Load before the disruption (after the first acknowledgement), and after it.
const BEFORE: Duration = Duration::from_secs(5);
const AFTER: Duration = Duration::from_secs(20);
/// Load at least this long after the cluster is whole again, when it must be acknowledged.
const RECOVERED_LOAD: Duration = Duration::from_secs(5);
/// A create not answered within this is counted as unanswered (its outcome unknown).
const CALL_PATIENCE: Duration = Duration::from_secs(30);
/// Creates in flight at most: below the server's 200 mutating requests, so none gets 429.
const MAX_IN_FLIGHT: usize = 150;
/// How long the watchers get, after the load, to deliver the last stored create.
const CATCH_UP: Duration = Duration::from_secs(30);
/// Until the cluster has a leader with a synchronous standby behind HAProxy again.
const CLUSTER_RECOVERY: Duration = Duration::from_secs(60);

/// The two tests each run three PostgreSQL members and a server at 200 writes/s: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn writes_per_second() -> u32 {
    std::env::var("REPORTS_SERVER_FAILOVER_WRITES_PER_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&r| r > 0)
        .unwrap_or(200)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Disruption {
    /// The primary's node killed: Patroni, the postmaster and its backends, at once.
    NodeKilled,
    /// `patronictl switchover` to the synchronous standby.
    Switchover,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_node_killed_under_load_loses_no_acknowledged_write() {
    let _one_at_a_time = SERIAL.lock().await;
    under_load(Disruption::NodeKilled).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switchover_under_load_loses_no_acknowledged_write() {
    let _one_at_a_time = SERIAL.lock().await;
    under_load(Disruption::Switchover).await
}

async fn under_load(disruption: Disruption) {
    let began = Instant::now();
    let mut cluster = PatroniCluster::start(3)
        .await
        .unwrap_or_else(|e| panic!("a Patroni cluster for the failover test: {e:#}"));
    let first_leader = cluster.leader().await.expect("a leader");
    println!(
        "[failover] {disruption:?}: Patroni cluster up in {:?}, leader {first_leader}",
        began.elapsed()
    );
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), Some(cluster.url()))
        .await
        .unwrap_or_else(|e| panic!("the server starts on the Patroni cluster: {e:#}"));
    let pid = server.pid().expect("the server runs");
    // kube-rs retries 429/503/504 by default: every answer judged here must be the server's own.
    let client = server.client_without_retries().await.unwrap();
    let api: Api<PolicyReport> = Api::namespaced(client.clone(), NS);
    let from = api
        .list(&ListParams::default().limit(1))
        .await
        .expect("a list before the load")
        .metadata
        .resource_version
        .expect("a list resourceVersion");
    let watchers = Watchers::start(&api, &from).await;
    let rate = writes_per_second();
    let load = Load::start(api.clone(), rate);
    let first_ack = tokio::time::timeout(FIRST_ACK, async {
        while load.acknowledged() == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let findings = Findings::new("[failover]");
    findings.check(
        first_ack.is_ok(),
        "writes succeed before the disruption",
        || format!("no create acknowledged within {FIRST_ACK:?}"),
    );
    tokio::time::sleep(BEFORE).await;

    let at = disrupt(&mut cluster, disruption, &first_leader).await;
    let expected_members = if disruption == Disruption::NodeKilled {
        2
    } else {
        3
    };
    let ((healthy, recovered), ()) = tokio::join!(
        async {
            let healthy = cluster
                .await_healthy(expected_members, CLUSTER_RECOVERY)
                .await;
            (healthy, at.elapsed())
        },
        tokio::time::sleep(AFTER)
    );
    let new_leader = healthy.unwrap_or_else(|e| {
        findings.fail("the Patroni cluster recovers", format!("{e:#}"));
        "(none)".to_owned()
    });
    println!(
        "[failover] leader {first_leader} → {new_leader}: the cluster whole again ({expected_members} members running, a synchronous standby, HAProxy on the leader) {} ms after the disruption",
        ms(recovered)
    );
    // A slow recovery (a loaded machine) still gets [`RECOVERED_LOAD`] of load after it.
    tokio::time::sleep_until((at + recovered + RECOVERED_LOAD).into()).await;
    findings.check(new_leader != first_leader, "the leader changed", || {
        format!("expected a leader other than {first_leader}")
    });
    let offered = load.stop().await;

    let end = offered.began + offered.took;
    findings.check(
        offered
            .writes
            .iter()
            .any(|w| w.fate() == Fate::Acknowledged && w.started + RECOVERED_LOAD > end),
        "writes are acknowledged again after the disruption",
        || format!("no create sent in the load's last {RECOVERED_LOAD:?} was acknowledged"),
    );
    let stored = list_all(&api).await;
    check_writes(&offered.writes, &stored, &findings);
    print_figures(&offered, at, rate, &stored);
    let caught_up = watchers.catch_up(&stored).await;
    check_watchers(&watchers, &offered.writes, &stored, &findings, caught_up);
    watchers.stop();
    check_server(&server, pid, &findings);
    if !findings.is_empty() {
        eprintln!("{}", cluster.logs());
    }
    findings.assert_none(&server);
    println!("[failover] {disruption:?}: done in {:?}", began.elapsed());
}

/// Takes the primary away; returns when.
async fn disrupt(cluster: &mut PatroniCluster, disruption: Disruption, leader: &str) -> Instant {
    match disruption {
        Disruption::NodeKilled => {
            let at = Instant::now();
            cluster
                .kill_node(leader)
                .await
                .unwrap_or_else(|e| panic!("kill {leader}'s node: {e:#}"));
            println!("[failover] killed {leader}'s node (Patroni, postmaster, backends)");
            at
        }
        Disruption::Switchover => {
            let topology = cluster.topology().await.expect("the topology");
            let candidate = topology
                .iter()
                .find(|m| m.role == "sync_standby")
                .map(|m| m.name.clone())
                .unwrap_or_else(|| panic!("no synchronous standby in {topology:?}"));
            let at = Instant::now();
            let out = cluster
                .switchover(leader, &candidate)
                .await
                .unwrap_or_else(|e| panic!("{e:#}\n{}", cluster.logs()));
            println!(
                "[failover] patronictl switchover {leader} → {candidate} took {:?}: {}",
                at.elapsed(),
                out.lines()
                    .find(|l| l.contains("Successfully"))
                    .unwrap_or_default()
                    .trim()
            );
            at
        }
    }
}

// ---- the writers -------------------------------------------------------------------------------

/// A create and its answer.
#[derive(Clone, Debug)]
struct Write {
    name: String,
    started: Instant,
    finished: Instant,
    answer: Answer,
}

#[derive(Clone, Debug)]
enum Answer {
    Created {
        rv: i64,
    },
    Status {
        code: u16,
        reason: String,
        message: String,
    },
    /// A transport error, or no answer within [`CALL_PATIENCE`].
    Nothing(String),
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Answer::Created { rv } => write!(f, "201 at resourceVersion {rv}"),
            Answer::Status {
                code,
                reason,
                message,
            } => write!(f, "{code} {reason}: {message}"),
            Answer::Nothing(why) => write!(f, "no answer: {why}"),
        }
    }
}

/// What an answer says about whether the create was stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fate {
    Acknowledged,
    /// 503 (or 429): not stored.
    Refused,
    /// 504, a transport error or no answer: it may or may not have been stored.
    Ambiguous,
    /// Any other answer: a finding.
    Unexpected,
}

impl Write {
    fn fate(&self) -> Fate {
        match self.answer {
            Answer::Created { .. } => Fate::Acknowledged,
            Answer::Status {
                code: 503 | 429, ..
            } => Fate::Refused,
            Answer::Status { code: 504, .. } | Answer::Nothing(_) => Fate::Ambiguous,
            Answer::Status { .. } => Fate::Unexpected,
        }
    }

    fn rv(&self) -> Option<i64> {
        match self.answer {
            Answer::Created { rv } => Some(rv),
            _ => None,
        }
    }

    fn status(&self) -> String {
        match &self.answer {
            Answer::Created { .. } => "201".into(),
            Answer::Status { code, .. } => code.to_string(),
            Answer::Nothing(_) => "none".into(),
        }
    }
}

fn report(name: &str, n: u64) -> PolicyReport {
    let mut r = pss_policy_report(&Subject::pod(NS, n), 1_700_000_000, &[n as usize % 19]);
    r.metadata.name = Some(name.to_owned());
    r
}

async fn create(api: &Api<PolicyReport>, n: u64) -> Write {
    let name = format!("w-{n:06}");
    let started = Instant::now();
    let answer = match tokio::time::timeout(
        CALL_PATIENCE,
        api.create(&PostParams::default(), &report(&name, n)),
    )
    .await
    {
        Ok(Ok(created)) => match created.metadata.resource_version.as_deref().map(str::parse) {
            Some(Ok(rv)) => Answer::Created { rv },
            other => Answer::Status {
                code: 201,
                reason: "no resourceVersion".into(),
                message: format!("{other:?}"),
            },
        },
        Ok(Err(kube::Error::Api(s))) => Answer::Status {
            code: s.code,
            reason: s.reason.clone(),
            message: s.message.clone(),
        },
        Ok(Err(e)) => Answer::Nothing(format!("transport error: {e}")),
        Err(_) => Answer::Nothing(format!("none within {CALL_PATIENCE:?}")),
    };
    Write {
        name,
        started,
        finished: Instant::now(),
        answer,
    }
}

/// Creates at a steady rate, each in a task of its own, until stopped: an outage does not slow
/// the rate while fewer than [`MAX_IN_FLIGHT`] wait.
struct Load {
    writes: Arc<Mutex<Vec<Write>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
    began: Instant,
}

/// What the load offered.
struct Offered {
    writes: Vec<Write>,
    began: Instant,
    took: Duration,
    /// Creates due but never sent: more than a tenth of a second behind the schedule, because
    /// [`MAX_IN_FLIGHT`] were waiting or the test's runtime fell behind.
    not_sent: u64,
}

impl Load {
    fn start(api: Api<PolicyReport>, rate: u32) -> Load {
        let writes = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let began = Instant::now();
        let task = tokio::spawn({
            let (writes, stop) = (writes.clone(), stop.clone());
            async move {
                let slack = u64::from(rate / 10).max(1);
                let mut tick = tokio::time::interval(Duration::from_millis(5));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let permits = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
                let mut tasks = tokio::task::JoinSet::new();
                let (mut sent, mut scheduled, mut not_sent) = (0u64, 0u64, 0u64);
                while !stop.load(Ordering::SeqCst) {
                    tick.tick().await;
                    let due = (began.elapsed().as_secs_f64() * f64::from(rate)) as u64;
                    if due > scheduled + slack {
                        not_sent += due - scheduled - slack;
                        scheduled = due - slack;
                    }
                    while scheduled < due {
                        let Ok(permit) = permits.clone().try_acquire_owned() else {
                            break;
                        };
                        let (api, writes, n) = (api.clone(), writes.clone(), sent);
                        tasks.spawn(async move {
                            let write = create(&api, n).await;
                            writes.lock().unwrap().push(write);
                            drop(permit);
                        });
                        sent += 1;
                        scheduled += 1;
                    }
                    while tasks.try_join_next().is_some() {}
                }
                while tasks.join_next().await.is_some() {}
                not_sent
            }
        });
        Load {
            writes,
            stop,
            task,
            began,
        }
    }

    fn acknowledged(&self) -> usize {
        let writes = self.writes.lock().unwrap();
        writes
            .iter()
            .filter(|w| w.fate() == Fate::Acknowledged)
            .count()
    }

    /// Stops offering creates and waits for those in flight.
    async fn stop(self) -> Offered {
        self.stop.store(true, Ordering::SeqCst);
        let took = self.began.elapsed();
        let not_sent = self.task.await.expect("the load task");
        let mut writes = self.writes.lock().unwrap().clone();
        writes.sort_by_key(|w| w.started);
        Offered {
            writes,
            began: self.began,
            took,
            not_sent,
        }
    }
}

/// Every report in the namespace: name → resourceVersion. Retried while the server refuses.
async fn list_all(api: &Api<PolicyReport>) -> BTreeMap<String, i64> {
    let deadline = Instant::now() + CLUSTER_RECOVERY;
    'again: loop {
        let mut stored = BTreeMap::new();
        let mut params = ListParams::default().limit(500);
        loop {
            match api.list(&params).await {
                Ok(page) => {
                    for r in page.items {
                        let rv = r.metadata.resource_version.as_deref().map(str::parse);
                        let Some(Ok(rv)) = rv else {
                            panic!("{:?} listed without a resourceVersion", r.metadata.name)
                        };
                        stored.insert(r.metadata.name.unwrap_or_default(), rv);
                    }
                    match page.metadata.continue_ {
                        Some(token) if !token.is_empty() => params = params.continue_token(&token),
                        _ => return stored,
                    }
                }
                Err(e) if Instant::now() < deadline => {
                    eprintln!("[failover] the final list failed ({e}); again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue 'again;
                }
                Err(e) => panic!("the final list within {CLUSTER_RECOVERY:?}: {e}"),
            }
        }
    }
}

/// Every acknowledged create is stored at the version acknowledged, no refused one is, and
/// nothing else is.
fn check_writes(writes: &[Write], stored: &BTreeMap<String, i64>, findings: &Findings) {
    let mut by_rv: HashMap<i64, &str> = HashMap::new();
    for w in writes {
        let now = stored.get(&w.name);
        match (w.fate(), now) {
            (Fate::Acknowledged, Some(&rv)) if Some(rv) == w.rv() => {}
            (Fate::Acknowledged, _) => findings.fail(
                "an acknowledged create is stored at the version acknowledged",
                format!("{} answered {}; stored: {now:?}", w.name, w.answer),
            ),
            (Fate::Refused, Some(rv)) => findings.fail(
                "a refused create is not stored",
                format!("{} answered {}; stored at {rv}", w.name, w.answer),
            ),
            (Fate::Unexpected, _) => findings.fail(
                "creates answer 201, 503 or 504",
                format!("{}: {}", w.name, w.answer),
            ),
            (Fate::Refused | Fate::Ambiguous, _) => {}
        }
        if let Some(rv) = w.rv()
            && let Some(other) = by_rv.insert(rv, &w.name)
        {
            findings.fail(
                "each acknowledged create has a resourceVersion of its own",
                format!("{other} and {} were both acknowledged at {rv}", w.name),
            );
        }
    }
    let written: std::collections::HashSet<&str> = writes.iter().map(|w| w.name.as_str()).collect();
    for (name, rv) in stored {
        findings.check(
            written.contains(name.as_str()),
            "only the writers' creates are stored",
            || format!("{name} at {rv}, never written"),
        );
    }
}

// ---- the figures -------------------------------------------------------------------------------

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// Milliseconds from `at` to `t`, negative when `t` is earlier.
fn since(at: Instant, t: Instant) -> i128 {
    if t >= at {
        (t - at).as_millis() as i128
    } else {
        -((at - t).as_millis() as i128)
    }
}

/// Rates, outcomes, latencies and the write-unavailability window.
fn print_figures(offered: &Offered, at: Instant, rate: u32, stored: &BTreeMap<String, i64>) {
    let writes = &offered.writes;
    let mut fates: BTreeMap<Fate, usize> = BTreeMap::new();
    let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
    for w in writes {
        *fates.entry(w.fate()).or_default() += 1;
        *statuses.entry(w.status()).or_default() += 1;
    }
    let ambiguous_stored = writes
        .iter()
        .filter(|w| w.fate() == Fate::Ambiguous && stored.contains_key(&w.name))
        .count();
    let secs = offered.took.as_secs_f64();
    let acked: Vec<&Write> = writes
        .iter()
        .filter(|w| w.fate() == Fate::Acknowledged)
        .collect();
    let before = (at - offered.began).as_secs_f64();
    println!(
        "[failover] load: {} creates in {secs:.1}s: {:.0}/s sent of {rate}/s asked ({} due but not sent: {MAX_IN_FLIGHT} in flight or the test's runtime behind); {:.0}/s acknowledged overall, {:.0}/s before the disruption",
        writes.len(),
        writes.len() as f64 / secs,
        offered.not_sent,
        acked.len() as f64 / secs,
        acked.iter().filter(|w| w.finished < at).count() as f64 / before,
    );
    println!(
        "[failover] outcomes {fates:?} (ambiguous and stored: {ambiguous_stored}); statuses {statuses:?}"
    );
    let mut took: Vec<Duration> = acked.iter().map(|w| w.finished - w.started).collect();
    took.sort();
    let pick =
        |q: f64| took.get(((took.len() as f64 * q) as usize).min(took.len().saturating_sub(1)));
    println!(
        "[failover] acknowledged create latency: p50 {:?}, p99 {:?}, max {:?}",
        pick(0.5),
        pick(0.99),
        took.last()
    );
    for w in writes
        .iter()
        .filter(|w| w.fate() != Fate::Acknowledged)
        .take(3)
    {
        println!(
            "[failover] e.g. {} started {} ms after the disruption: {}",
            w.name,
            since(at, w.started),
            w.answer
        );
    }
    print_window(&acked, at);
}

/// The longest stretch without an acknowledgement that ends after the disruption.
fn print_window(acked: &[&Write], at: Instant) {
    let mut done: Vec<Instant> = acked.iter().map(|w| w.finished).collect();
    done.sort();
    let window = done
        .windows(2)
        .filter(|p| p[1] > at)
        .max_by_key(|p| p[1] - p[0]);
    match window {
        Some(p) => println!(
            "[failover] write-unavailability window: {} ms (from an acknowledgement {} ms after the disruption to the next, {} ms after it)",
            ms(p[1] - p[0]),
            since(at, p[0]),
            since(at, p[1])
        ),
        None => println!(
            "[failover] write-unavailability window: no acknowledgement after the disruption"
        ),
    }
    let first_new = acked
        .iter()
        .filter(|w| w.started >= at)
        .map(|w| w.finished)
        .min();
    println!(
        "[failover] the first create sent after the disruption and acknowledged: {:?} ms after it",
        first_new.map(|t| since(at, t))
    );
}

// ---- the watchers ------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Added,
    Modified,
    Deleted,
    Bookmark,
}

/// What one watcher saw, across all the streams it opened.
#[derive(Default)]
struct Seen {
    events: Vec<(Kind, String, i64)>,
    /// Streams opened.
    opened: usize,
    /// Opens refused, by answer.
    refused: BTreeMap<String, usize>,
    /// How streams ended, by cause.
    ended: BTreeMap<String, usize>,
    /// 410 Gone: the watcher had to list again (and may have missed events).
    expired: usize,
}

impl Seen {
    fn last_rv(&self) -> Option<i64> {
        self.events.last().map(|e| e.2)
    }
}

struct Watchers {
    seen: Vec<Arc<Mutex<Seen>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Watchers {
    /// Starts [`WATCHERS`] watchers from `from` and waits until each has a stream open.
    async fn start(api: &Api<PolicyReport>, from: &str) -> Watchers {
        let seen: Vec<Arc<Mutex<Seen>>> = (0..WATCHERS).map(|_| Arc::default()).collect();
        let tasks = seen
            .iter()
            .map(|s| tokio::spawn(watch(api.clone(), from.to_owned(), s.clone())))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        while seen.iter().any(|s| s.lock().unwrap().opened == 0) {
            assert!(Instant::now() < deadline, "the watchers open within 10s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Watchers { seen, tasks }
    }

    /// Waits until every watcher has delivered the newest stored version; returns how long that
    /// took, `None` if not within [`CATCH_UP`].
    async fn catch_up(&self, stored: &BTreeMap<String, i64>) -> Option<Duration> {
        let newest = stored.values().max().copied().unwrap_or(0);
        let began = Instant::now();
        while began.elapsed() < CATCH_UP {
            if self
                .seen
                .iter()
                .all(|s| s.lock().unwrap().last_rv().unwrap_or(0) >= newest)
            {
                return Some(began.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    fn stop(&self) {
        self.tasks.iter().for_each(|t| t.abort());
    }
}

/// Watches from `from`; whenever a stream ends or cannot be opened, opens another from the last
/// version seen, as a client-go reflector does. A 410 makes it list again (a finding).
async fn watch(api: Api<PolicyReport>, from: String, seen: Arc<Mutex<Seen>>) {
    let mut rv = from;
    loop {
        let params = WatchParams::default().timeout(290);
        let stream = match api.watch(&params, &rv).await {
            Ok(stream) => stream,
            Err(e) => {
                let why = match e {
                    kube::Error::Api(s) => format!("{} {}", s.code, s.reason),
                    e => format!("transport error: {e}"),
                };
                *seen.lock().unwrap().refused.entry(why).or_default() += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        seen.lock().unwrap().opened += 1;
        let mut stream = std::pin::pin!(stream);
        let ended = loop {
            let event = match stream.next().await {
                None => break "closed by the server".to_owned(),
                Some(Err(e)) => break format!("transport error: {e}"),
                Some(Ok(WatchEvent::Error(s))) => break format!("ERROR {} {}", s.code, s.reason),
                Some(Ok(event)) => event,
            };
            let (kind, name, version) = match event {
                WatchEvent::Added(o) => (Kind::Added, o.metadata.name, o.metadata.resource_version),
                WatchEvent::Modified(o) => {
                    (Kind::Modified, o.metadata.name, o.metadata.resource_version)
                }
                WatchEvent::Deleted(o) => {
                    (Kind::Deleted, o.metadata.name, o.metadata.resource_version)
                }
                WatchEvent::Bookmark(b) => {
                    (Kind::Bookmark, None, Some(b.metadata.resource_version))
                }
                WatchEvent::Error(_) => unreachable!("handled above"),
            };
            let version = version.unwrap_or_default();
            let parsed = version.parse().unwrap_or(-1);
            seen.lock()
                .unwrap()
                .events
                .push((kind, name.unwrap_or_default(), parsed));
            rv = version;
        };
        let expired = ended.starts_with("ERROR 410");
        {
            let mut s = seen.lock().unwrap();
            *s.ended.entry(ended).or_default() += 1;
            s.expired += usize::from(expired);
        }
        if expired {
            rv = relist(&api).await;
        }
    }
}

/// A list's resourceVersion, retried until the server answers.
async fn relist(api: &Api<PolicyReport>) -> String {
    loop {
        match api.list(&ListParams::default().limit(1)).await {
            Ok(list) => return list.metadata.resource_version.unwrap_or_default(),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Each watcher delivered each stored create once (at the version stored, which for an
/// acknowledged create is the one acknowledged), nothing unstored and no update or delete, in
/// strictly increasing resourceVersion order.
fn check_watchers(
    watchers: &Watchers,
    writes: &[Write],
    stored: &BTreeMap<String, i64>,
    findings: &Findings,
    caught_up: Option<Duration>,
) {
    findings.check(caught_up.is_some(), "the watchers catch up", || {
        format!("not every watcher delivered the newest stored version within {CATCH_UP:?}")
    });
    let acked: HashMap<&str, i64> = writes
        .iter()
        .filter_map(|w| Some((w.name.as_str(), w.rv()?)))
        .collect();
    let (mut opened, mut refused, mut ended) = (0, BTreeMap::new(), BTreeMap::new());
    for (i, seen) in watchers.seen.iter().enumerate() {
        let seen = seen.lock().unwrap();
        opened += seen.opened;
        seen.refused
            .iter()
            .for_each(|(k, v)| *refused.entry(k.clone()).or_insert(0) += v);
        seen.ended
            .iter()
            .for_each(|(k, v)| *ended.entry(k.clone()).or_insert(0) += v);
        findings.check(
            seen.expired == 0,
            "no watcher has to list again (410)",
            || format!("watcher {i} got 410 Gone {} time(s)", seen.expired),
        );
        let mut previous: Option<&(Kind, String, i64)> = None;
        let mut added: HashMap<&str, usize> = HashMap::new();
        for event in &seen.events {
            let (kind, name, rv) = event;
            if let Some(p) = previous {
                let ordered = if *kind == Kind::Bookmark {
                    *rv >= p.2
                } else {
                    *rv > p.2
                };
                findings.check(
                    ordered,
                    "resourceVersions only go up on every watcher",
                    || {
                        format!(
                            "watcher {i}: {:?} {} at {} after {:?} {} at {}",
                            kind, name, rv, p.0, p.1, p.2
                        )
                    },
                );
            }
            previous = Some(event);
            match kind {
                Kind::Added => {
                    *added.entry(name).or_default() += 1;
                    let want = stored.get(name).or(acked.get(name.as_str()));
                    findings.check(want == Some(rv), "a watcher delivers a create at the version stored", || {
                        format!("watcher {i}: ADDED {name} at {rv}; stored at {:?}, acknowledged at {:?}", stored.get(name), acked.get(name.as_str()))
                    });
                }
                Kind::Bookmark => {}
                _ => findings.fail(
                    "watchers see only creates",
                    format!("watcher {i}: {kind:?} {name} at {rv}"),
                ),
            }
        }
        for name in stored.keys() {
            let times = added.get(name.as_str()).copied().unwrap_or(0);
            findings.check(
                times == 1,
                "each watcher delivers each stored create exactly once",
                || format!("watcher {i} delivered {name} {times} times"),
            );
        }
        for name in added.keys().filter(|n| !stored.contains_key(**n)) {
            findings.fail(
                "watchers deliver only what was stored",
                format!("watcher {i} delivered {name}, which is not stored"),
            );
        }
    }
    let events: usize = watchers
        .seen
        .iter()
        .map(|s| s.lock().unwrap().events.len())
        .sum();
    println!(
        "[failover] watchers: {WATCHERS}, {events} events in all for {} stored creates; caught up {caught_up:?} after the final list; streams opened {opened}, opens refused {refused:?}, streams ended {ended:?}",
        stored.len()
    );
}

// ---- the rules ---------------------------------------------------------------------------------

/// The server never panicked and is the process started, alive; prints its outage transitions.
fn check_server(server: &ServerProcess, pid: u32, findings: &Findings) {
    let log = std::fs::read_to_string(server.log_path()).unwrap_or_default();
    for line in log.lines().filter(|l| {
        l.contains("the database stopped answering") || l.contains("the database answers again")
    }) {
        println!(
            "[failover] server: {}",
            line.chars().take(300).collect::<String>()
        );
    }
    let panicked = log.lines().find(|l| l.contains("panicked"));
    findings.check(panicked.is_none(), "the server never panics", || {
        panicked.unwrap_or_default().to_owned()
    });
    findings.check_same_process(server, pid, "the failover");
}
