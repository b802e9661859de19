//! The server while its PostgreSQL is stopped. It stays up and ready, answers discovery and
//! metadata from memory, refuses every data call fast with 503 (a write caught in flight may be
//! 504: whether it was stored is unknown), shows the outage in `reports_server_database_up`,
//! and recovers by itself once the database is back: nothing acknowledged is lost, nothing
//! refused is stored, and a watch resumed from the last version it saw misses nothing. A
//! second test starts a server while its database is down.
//!
//! Each cluster is the test's own ([`OwnedPostgres`]): stopping the shared one would take the
//! databases of every other test in the binary down with it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use reports_server_crds::PolicyReport;
use reports_server_crds::fixtures::{Subject, pss_policy_report};
use reports_server_tests::findings::Findings;
use reports_server_tests::postgres::OwnedPostgres;
use reports_server_tests::server::ServerProcess;
use serde_json::{Value, json};

const NS: &str = "degrade";
const COLLECTION: &str = "/apis/wgpolicyk8s.io/v1alpha2/namespaces/degrade/policyreports";
const KEPT: &str = "/apis/wgpolicyk8s.io/v1alpha2/namespaces/degrade/policyreports/kept";
/// A new watch: during the outage it must be refused like any other data call.
const NEW_WATCH: &str = "/apis/wgpolicyk8s.io/v1alpha2/namespaces/degrade/policyreports?watch=true&allowWatchBookmarks=true&timeoutSeconds=1";
/// Paths served from memory, which must answer 200 throughout.
const FROM_MEMORY: [&str; 6] = [
    "/readyz",
    "/livez",
    "/apis",
    "/apis/wgpolicyk8s.io/v1alpha2",
    "/openapi/v2",
    "/version",
];
const METRIC: &str = "reports_server_database_up";
const OUTAGE: Duration = Duration::from_secs(10);
/// The server notices an outage within about 2.5 s (a missed probe deadline is asked again
/// before the circuit opens); calls started later are held to [`FAST`].
const DETECTION: Duration = Duration::from_millis(2500);
const FAST: Duration = Duration::from_secs(1);
/// From `start_again` to data calls succeeding and the gauge back at 1.
const RECOVERY: Duration = Duration::from_secs(15);
/// A call not answered within this is dropped and counted as unanswered: long enough that
/// the server's own timeouts answer first, short enough that a hang does not stall the test.
const CALL_PATIENCE: Duration = Duration::from_secs(5);
const WRITER_PERIOD: Duration = Duration::from_millis(50);
const PROBE_PERIOD: Duration = Duration::from_millis(100);

/// What a request got: the server's answer, or none.
#[derive(Clone, Debug)]
enum Got {
    Answer {
        code: u16,
        retry_after: Option<String>,
        body: Value,
    },
    /// A transport error, or no answer within [`CALL_PATIENCE`].
    Nothing(String),
}

impl std::fmt::Display for Got {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Got::Answer {
                code,
                retry_after,
                body,
            } => {
                let retry = retry_after.as_deref().unwrap_or("none");
                match body {
                    Value::String(text) => {
                        let text: String = text.chars().take(200).collect();
                        write!(f, "{code} {text:?} (Retry-After {retry})")
                    }
                    body => write!(
                        f,
                        "{code} reason {} message {} (Retry-After {retry})",
                        body["reason"], body["message"]
                    ),
                }
            }
            Got::Nothing(why) => write!(f, "no answer: {why}"),
        }
    }
}

/// One request and when it was made.
#[derive(Clone, Debug)]
struct Call {
    what: String,
    write: bool,
    /// The name a create asked for.
    created: Option<String>,
    started: Instant,
    took: Duration,
    got: Got,
}

impl Call {
    fn code(&self) -> Option<u16> {
        match self.got {
            Got::Answer { code, .. } => Some(code),
            Got::Nothing(_) => None,
        }
    }

    fn finished(&self) -> Instant {
        self.started + self.took
    }
}

async fn send(client: &kube::Client, method: &str, uri: &str, body: Option<&Value>) -> Call {
    let started = Instant::now();
    let got = match tokio::time::timeout(CALL_PATIENCE, exchange(client, method, uri, body)).await {
        Ok(Ok(got)) => got,
        Ok(Err(e)) => Got::Nothing(format!("transport error: {e}")),
        Err(_) => Got::Nothing(format!("none within {CALL_PATIENCE:?}")),
    };
    Call {
        what: format!("{method} {uri}"),
        write: method != "GET",
        created: None,
        started,
        took: started.elapsed(),
        got,
    }
}

async fn exchange(
    client: &kube::Client,
    method: &str,
    uri: &str,
    body: Option<&Value>,
) -> Result<Got, kube::Error> {
    let request = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(
            body.map(|b| serde_json::to_vec(b).unwrap())
                .unwrap_or_default(),
        )
        .unwrap();
    let response = client.send(request.map(kube::client::Body::from)).await?;
    let code = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    // An accepted watch streams until its timeout: its head is the whole answer wanted here.
    if code == 200 && uri.contains("watch=true") {
        return Ok(Got::Answer {
            code,
            retry_after,
            body: Value::Null,
        });
    }
    let bytes = http_body_util::BodyExt::collect(response.into_body())
        .await?
        .to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Ok(Got::Answer {
        code,
        retry_after,
        body,
    })
}

fn report(name: &str, n: u64) -> Value {
    let mut r = pss_policy_report(&Subject::pod(NS, n), 1_700_000_000, &[n as usize % 19]);
    r.metadata.name = Some(name.to_owned());
    serde_json::to_value(r).unwrap()
}

async fn create(client: &kube::Client, name: &str, n: u64) -> Call {
    let mut call = send(client, "POST", COLLECTION, Some(&report(name, n))).await;
    call.what = format!("create {name}");
    call.created = Some(name.to_owned());
    call
}

/// The gauge's value in a `/metrics` answer.
fn database_up(call: &Call) -> Option<f64> {
    let Got::Answer {
        code: 200,
        body: Value::String(text),
        ..
    } = &call.got
    else {
        return None;
    };
    text.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let name = fields.next()?;
        (name == METRIC || name.starts_with(&format!("{METRIC}{{")))
            .then(|| fields.next()?.parse().ok())
            .flatten()
    })
}

/// "count n, median m, max x" of some latencies.
fn figures(mut took: Vec<Duration>) -> String {
    took.sort();
    match (took.get(took.len() / 2), took.last()) {
        (Some(median), Some(max)) => {
            format!("count {}, median {median:?}, max {max:?}", took.len())
        }
        _ => "count 0".into(),
    }
}

/// When the database went away and came back.
struct Timeline {
    /// `pg_ctl stop` called: calls started before were in flight at the stop.
    stop_began: Instant,
    /// `pg_ctl stop` returned: the database is gone.
    stopped_at: Instant,
    /// `pg_ctl start` called: answers after this may come from a database that is back.
    restart_began: Instant,
}

impl Timeline {
    /// Made and answered wholly while the database was gone.
    fn during(&self, call: &Call) -> bool {
        call.started >= self.stopped_at && call.finished() <= self.restart_began
    }

    /// Started after the server has had time to notice the outage, and before the restart.
    fn after_detection(&self, call: &Call) -> bool {
        call.started >= self.stopped_at + DETECTION && call.started < self.restart_began
    }
}

/// Checks the server with the database up, creating the report `kept` the outage must not
/// change; returns it as stored. Data calls failing here are the harness's or the server's
/// basics, not the outage contract, so they stop the test at once.
async fn with_database_up(client: &kube::Client, findings: &Findings) -> Value {
    let expect = |call: &Call, code: u16| {
        assert_eq!(
            call.code(),
            Some(code),
            "with the database up, {} should answer {code}; it answered {}",
            call.what,
            call.got
        );
    };
    for path in FROM_MEMORY {
        expect(&send(client, "GET", path, None).await, 200);
    }
    expect(&create(client, "kept", 0).await, 201);
    expect(&create(client, "scratch", 1).await, 201);
    let got = send(client, "GET", KEPT, None).await;
    expect(&got, 200);
    let Got::Answer { body: mut kept, .. } = got.got else {
        unreachable!()
    };
    kept["summary"]["pass"] = json!(7);
    let updated = send(client, "PUT", KEPT, Some(&kept)).await;
    expect(&updated, 200);
    expect(&send(client, "GET", COLLECTION, None).await, 200);
    expect(
        &send(client, "DELETE", &format!("{COLLECTION}/scratch"), None).await,
        200,
    );
    // The gauge may be set by a background check after start-up: polled, not read once.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut seen = None;
    while seen != Some(1.0) && Instant::now() < deadline {
        seen = database_up(&send(client, "GET", "/metrics", None).await);
        if seen != Some(1.0) {
            tokio::time::sleep(PROBE_PERIOD).await;
        }
    }
    findings.check(
        seen == Some(1.0),
        "with the database up the gauge is 1",
        || format!("expected {METRIC} 1 within 5s; saw {seen:?} (None: no such metric)"),
    );
    let Got::Answer { body, .. } = updated.got else {
        unreachable!()
    };
    body
}

/// Creates a report every [`WRITER_PERIOD`] (unique names) until stopped, recording each.
struct Writer {
    calls: Arc<Mutex<Vec<Call>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    fn start(client: kube::Client) -> Writer {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let (calls, stop) = (calls.clone(), stop.clone());
            async move {
                let mut tick = tokio::time::interval(WRITER_PERIOD);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    tick.tick().await;
                    let call = create(&client, &format!("w-{n:05}"), 1_000 + n).await;
                    calls.lock().unwrap().push(call);
                    n += 1;
                }
            }
        });
        Writer { calls, stop, task }
    }

    /// Waits until `count` creates matching `which` were acknowledged; false at the deadline.
    async fn await_acks(
        &self,
        count: usize,
        which: impl Fn(&Call) -> bool,
        within: Duration,
    ) -> bool {
        let deadline = Instant::now() + within;
        loop {
            let acked = self
                .calls
                .lock()
                .unwrap()
                .iter()
                .filter(|c| c.code() == Some(201) && which(c))
                .count();
            if acked >= count {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(WRITER_PERIOD).await;
        }
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    async fn stop(self) -> Vec<Call> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.expect("the writer task");
        self.calls.lock().unwrap().clone()
    }
}

/// Data calls of every kind, over and over, until `until`.
async fn probe_data(client: &kube::Client, kept: &Value, until: Instant) -> Vec<Call> {
    let mut calls = Vec::new();
    let mut update = kept.clone();
    update["summary"]["pass"] = json!(99);
    let mut tick = tokio::time::interval(PROBE_PERIOD);
    let mut n = 0;
    while Instant::now() < until {
        tick.tick().await;
        calls.push(send(client, "GET", KEPT, None).await);
        calls.push(send(client, "GET", &format!("{COLLECTION}?limit=50"), None).await);
        calls.push(create(client, &format!("probe-{n:04}"), 5_000 + n).await);
        calls.push(send(client, "PUT", KEPT, Some(&update)).await);
        calls.push(send(client, "DELETE", KEPT, None).await);
        calls.push(send(client, "GET", NEW_WATCH, None).await);
        n += 1;
    }
    calls
}

/// Health, discovery, OpenAPI, version and `/metrics` until `until`, beside the data calls so
/// that a data call waiting on the database cannot hide a health check waiting behind it.
async fn probe_memory(client: &kube::Client, until: Instant) -> (Vec<Call>, Vec<Call>) {
    let (mut calls, mut metrics) = (Vec::new(), Vec::new());
    let mut tick = tokio::time::interval(PROBE_PERIOD * 2);
    while Instant::now() < until {
        tick.tick().await;
        for path in FROM_MEMORY {
            calls.push(send(client, "GET", path, None).await);
        }
        metrics.push(send(client, "GET", "/metrics", None).await);
    }
    (calls, metrics)
}

/// Why a data call answered while the database was gone breaks the contract, if it does.
/// `may_be_unknown`: a write the outage caught, which may answer 504 Timeout.
fn refusal_problem(call: &Call, may_be_unknown: bool) -> Option<String> {
    let expected = if may_be_unknown {
        "503 ServiceUnavailable (or 504 Timeout)"
    } else {
        "503 ServiceUnavailable"
    };
    let Got::Answer {
        code,
        retry_after,
        body,
    } = &call.got
    else {
        return Some(format!(
            "{}: expected {expected}, saw {}",
            call.what, call.got
        ));
    };
    let problem = match code {
        503 if body["kind"] != "Status" || body["apiVersion"] != "v1" => {
            "the body is not a v1 Status"
        }
        503 if body["reason"] != "ServiceUnavailable" => "the reason is not ServiceUnavailable",
        503 if !body["message"]
            .as_str()
            .is_some_and(|m| m.to_lowercase().contains("database")) =>
        {
            "the message does not mention the database"
        }
        503 if retry_after.as_deref().is_none_or(str::is_empty) => "there is no Retry-After",
        503 => return None,
        504 if may_be_unknown && body["reason"] == "Timeout" => return None,
        504 if may_be_unknown => "the reason is not Timeout",
        _ => "another status",
    };
    Some(format!(
        "{}: expected {expected} with a v1 Status naming the database and Retry-After; {problem}: {}",
        call.what, call.got
    ))
}

/// Judges what was asked while the database was gone, and prints the figures.
fn judge_outage(
    findings: &Findings,
    t: &Timeline,
    data: &[Call],
    memory: &[Call],
    metrics: &[Call],
) {
    let during: Vec<&Call> = data.iter().filter(|c| t.during(c)).collect();
    for call in &during {
        // Before the server has noticed the outage a write can still reach a connection the
        // stop cut mid-statement, and then the server cannot know whether it was stored either.
        let caught = call.write && call.started < t.stopped_at + DETECTION;
        if let Some(problem) = refusal_problem(call, caught) {
            findings.fail("data calls during the outage are 503", problem);
        }
    }
    findings.check(during.len() >= 20, "the outage was probed", || {
        format!(
            "expected at least 20 data calls made and answered during the outage; saw {}",
            during.len()
        )
    });
    let mut codes = BTreeMap::new();
    for call in &during {
        *codes
            .entry(call.code().map_or("none".into(), |c| c.to_string()))
            .or_insert(0) += 1;
    }
    let late: Vec<&Call> = data.iter().filter(|c| t.after_detection(c)).collect();
    for call in late.iter().filter(|c| c.took >= FAST) {
        findings.fail(
            "data calls after the detection window take < 1s",
            format!(
                "{} started {:?} after the stop took {:?} (expected < {FAST:?}) and got {}",
                call.what,
                call.started - t.stopped_at,
                call.took,
                call.got
            ),
        );
    }
    let early = data.iter().filter(|c| t.during(c) && !t.after_detection(c));
    eprintln!(
        "[degrade] data calls during the outage: {} by status {codes:?}",
        during.len()
    );
    eprintln!(
        "[degrade] data call latency after the {DETECTION:?} detection window: {}; inside it: {}",
        figures(late.iter().map(|c| c.took).collect()),
        figures(early.map(|c| c.took).collect())
    );
    for call in memory.iter().filter(|c| t.during(c)) {
        findings.check(
            call.code() == Some(200),
            "health, discovery and metadata answer 200",
            || {
                format!(
                    "{} during the outage: expected 200, saw {}",
                    call.what, call.got
                )
            },
        );
    }
    let late_memory: Vec<&Call> = memory.iter().filter(|c| t.after_detection(c)).collect();
    for call in late_memory.iter().filter(|c| c.took >= FAST) {
        findings.fail(
            "health, discovery and metadata answer within 1s",
            format!("{} took {:?} (expected < {FAST:?})", call.what, call.took),
        );
    }
    eprintln!(
        "[degrade] health/discovery/metadata latency after the detection window: {}",
        figures(late_memory.iter().map(|c| c.took).collect())
    );
    judge_gauge(findings, t, metrics);
}

/// The gauge reads 0 once the outage is detected, until the restart.
fn judge_gauge(findings: &Findings, t: &Timeline, metrics: &[Call]) {
    let first_zero = metrics
        .iter()
        .find(|c| c.started >= t.stopped_at && database_up(c) == Some(0.0))
        .map(|c| c.finished() - t.stopped_at);
    eprintln!("[degrade] {METRIC} first read 0 at {first_zero:?} after the stop");
    let late: Vec<&Call> = metrics
        .iter()
        .filter(|c| t.after_detection(c) && t.during(c))
        .collect();
    findings.check(
        !late.is_empty(),
        "the gauge was read during the outage",
        || "expected /metrics reads after the detection window; there were none".into(),
    );
    for call in late {
        findings.check(database_up(call) == Some(0.0), "the gauge is 0 during the outage", || {
            format!(
                "{:?} after the stop: expected {METRIC} 0, saw {:?} (None: no such metric; the answer was {})",
                call.started - t.stopped_at,
                database_up(call),
                call.got
            )
        });
    }
}

/// Waits for data calls to succeed again, then for the gauge to read 1; returns when data
/// calls succeeded again (`None`: not within [`RECOVERY`]).
async fn await_recovery(
    client: &kube::Client,
    findings: &Findings,
    t: &Timeline,
) -> Option<Instant> {
    let deadline = t.restart_began + RECOVERY;
    let mut recovered = None;
    while recovered.is_none() && Instant::now() < deadline {
        let call = send(client, "GET", KEPT, None).await;
        match call.code() {
            Some(200) => recovered = Some(call.finished()),
            Some(503) => tokio::time::sleep(PROBE_PERIOD).await,
            _ => findings.fail(
                "while the database comes back, data calls are 503 or succeed",
                format!("expected 200 or 503, saw {}", call.got),
            ),
        }
    }
    eprintln!(
        "[degrade] data calls succeeded again {:?} after start_again",
        recovered.map(|r| r - t.restart_began)
    );
    findings.check(
        recovered.is_some(),
        "data calls succeed again within 15s",
        || {
            format!(
                "expected GET kept to answer 200 within {RECOVERY:?} of start_again; it did not"
            )
        },
    );
    let mut gauge = None;
    while gauge != Some(1.0) && Instant::now() < deadline {
        gauge = database_up(&send(client, "GET", "/metrics", None).await);
        if gauge != Some(1.0) {
            tokio::time::sleep(PROBE_PERIOD).await;
        }
    }
    findings.check(gauge == Some(1.0), "the gauge returns to 1", || {
        format!("expected {METRIC} 1 within {RECOVERY:?} of start_again; saw {gauge:?}")
    });
    recovered
}

/// What a create's answer says about whether it was stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fate {
    Acknowledged,
    Refused,
    /// 504, a transport error or no answer: it may or may not have been stored.
    Unknown,
}

fn fate(call: &Call) -> Option<Fate> {
    match call.code() {
        Some(201) => Some(Fate::Acknowledged),
        Some(503) => Some(Fate::Refused),
        Some(504) | None => Some(Fate::Unknown),
        Some(_) => None,
    }
}

/// Every acknowledged create is stored and every refused one is not; `kept` is as it was.
async fn check_creates(
    client: &kube::Client,
    findings: &Findings,
    creates: &[&Call],
    kept: &Value,
    what: &str,
) {
    let mut counts = BTreeMap::new();
    let mut unknown_stored = 0;
    let mut unknown_answers = Vec::new();
    for call in creates {
        let name = call.created.as_deref().expect("a create");
        let Some(fate) = fate(call) else {
            findings.fail(
                "creates answer 201, 503 or 504",
                format!("{}: expected 201, 503 or 504, saw {}", call.what, call.got),
            );
            continue;
        };
        *counts.entry(fate).or_insert(0) += 1;
        let now = send(client, "GET", &format!("{COLLECTION}/{name}"), None).await;
        match (fate, now.code()) {
            (Fate::Acknowledged, Some(200)) | (Fate::Refused, Some(404)) => {}
            (Fate::Unknown, Some(200 | 404)) => {
                unknown_stored += usize::from(now.code() == Some(200));
                unknown_answers.push(format!("{name}: {}", call.got));
            }
            (Fate::Acknowledged, _) => findings.fail(
                "an acknowledged create is stored",
                format!(
                    "{name} was acknowledged; after recovery expected GET 200, saw {}",
                    now.got
                ),
            ),
            (Fate::Refused, _) => findings.fail(
                "a refused create is not stored",
                format!(
                    "{name} was refused ({}); after recovery expected GET 404, saw {}",
                    call.got, now.got
                ),
            ),
            (Fate::Unknown, _) => findings.fail(
                "after recovery a GET is 200 or 404",
                format!("GET {name}: expected 200 or 404, saw {}", now.got),
            ),
        }
    }
    let unknown = counts.get(&Fate::Unknown).copied().unwrap_or(0);
    eprintln!(
        "[degrade] {what}: acknowledged {}, refused {}, ambiguous {unknown} (of which stored {unknown_stored})",
        counts.get(&Fate::Acknowledged).copied().unwrap_or(0),
        counts.get(&Fate::Refused).copied().unwrap_or(0),
    );
    if !unknown_answers.is_empty() {
        eprintln!("[degrade] {what}: the ambiguous answers: {unknown_answers:?}");
    }
    let now = send(client, "GET", KEPT, None).await;
    let unchanged = match &now.got {
        Got::Answer {
            code: 200, body, ..
        } => body["metadata"]["resourceVersion"] == kept["metadata"]["resourceVersion"],
        _ => false,
    };
    findings.check(
        unchanged,
        "refused updates and deletes change nothing",
        || {
            format!(
                "expected kept at resourceVersion {} after recovery, saw {}",
                kept["metadata"]["resourceVersion"], now.got
            )
        },
    );
}

/// What a watch delivered, and how it ended (`None` while it runs).
#[derive(Default)]
struct Watched {
    added: Vec<String>,
    last_rv: Option<String>,
    ended: Option<Ended>,
}

enum Ended {
    /// The server closed the stream, or said why in an ERROR event before closing it.
    Cleanly(String),
    /// Not opened, or cut by a transport error.
    Broken(String),
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ended::Cleanly(how) => write!(f, "ended cleanly: {how}"),
            Ended::Broken(how) => write!(f, "broken: {how}"),
        }
    }
}

/// Follows a watch from resourceVersion `from` until it ends, recording into `log` what it
/// delivers and how it ended.
async fn follow(api: Api<PolicyReport>, from: String, log: Arc<Mutex<Watched>>) {
    // Bookmarks are on by default (allowWatchBookmarks=true).
    let params = WatchParams::default().timeout(240);
    let ended = match api.watch(&params, &from).await {
        Err(e) => Ended::Broken(format!("not opened from {from}: {e}")),
        Ok(stream) => {
            let mut stream = std::pin::pin!(stream);
            loop {
                let event = match stream.next().await {
                    None => break Ended::Cleanly("closed by the server".into()),
                    Some(Err(e)) => break Ended::Broken(format!("transport error: {e}")),
                    Some(Ok(WatchEvent::Error(s))) => {
                        break Ended::Cleanly(format!(
                            "ERROR event {} {}: {}",
                            s.code, s.reason, s.message
                        ));
                    }
                    Some(Ok(event)) => event,
                };
                let mut log = log.lock().unwrap();
                let rv = match event {
                    WatchEvent::Added(o) => {
                        log.added.push(o.metadata.name.clone().unwrap_or_default());
                        o.metadata.resource_version
                    }
                    WatchEvent::Modified(o) | WatchEvent::Deleted(o) => o.metadata.resource_version,
                    WatchEvent::Bookmark(b) => Some(b.metadata.resource_version),
                    WatchEvent::Error(_) => unreachable!("handled above"),
                };
                if rv.is_some() {
                    log.last_rv = rv;
                }
            }
        }
    };
    log.lock().unwrap().ended = Some(ended);
}

/// The watch opened before the outage stayed open or ended cleanly, and it (or its resumption
/// from the last version it saw) delivers each of `expected` exactly once.
async fn check_watch(
    api: &Api<PolicyReport>,
    log: &Arc<Mutex<Watched>>,
    from: &str,
    expected: &[String],
    findings: &Findings,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    let mut endings = Vec::new();
    let deadline = Instant::now() + RECOVERY;
    loop {
        let all_seen = {
            let mut w = log.lock().unwrap();
            if let Some(ended) = w.ended.take() {
                let rule = if endings.is_empty() {
                    "the watch opened before the outage stays open or ends cleanly"
                } else {
                    "a watch resumed after recovery opens and runs"
                };
                findings.check(matches!(ended, Ended::Cleanly(_)), rule, || {
                    format!("expected an open watch or a clean end; it {ended}")
                });
                let resume_from = w.last_rv.clone().unwrap_or_else(|| from.to_owned());
                eprintln!("[degrade] the watch {ended}; resumed from {resume_from}");
                endings.push(ended);
                tasks.push(tokio::spawn(follow(api.clone(), resume_from, log.clone())));
            }
            expected.iter().all(|n| w.added.contains(n))
        };
        if all_seen || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(PROBE_PERIOD).await;
    }
    let w = log.lock().unwrap();
    let times = |n: &String| w.added.iter().filter(|a| *a == n).count();
    let missing: Vec<&String> = expected.iter().filter(|n| times(n) == 0).collect();
    let repeated: Vec<&String> = expected.iter().filter(|n| times(n) > 1).collect();
    eprintln!(
        "[degrade] watch: {} ADDED in all, {} creates acknowledged after recovery, {} of them missing, {} repeated; ended {} time(s)",
        w.added.len(),
        expected.len(),
        missing.len(),
        repeated.len(),
        endings.len()
    );
    findings.check(
        !expected.is_empty(),
        "creates were acknowledged after recovery",
        || "expected the writer to get creates acknowledged after recovery; none were".into(),
    );
    findings.check(missing.is_empty() && repeated.is_empty(), "the watch delivers each create acknowledged after recovery exactly once", || {
        format!(
            "expected each of {} names once within {RECOVERY:?}; missing {missing:?}, repeated {repeated:?}",
            expected.len()
        )
    });
    tasks
}

/// How the database is taken away.
#[derive(Clone, Copy, Debug)]
enum Outage {
    /// Stopped: connections are cut and new ones refused at once.
    Stopped,
    /// Frozen (SIGSTOP): nothing answers and nothing is refused, as from a database behind a
    /// network that drops packets; only the server's own deadlines end its waits.
    BlackHoled,
}

impl Outage {
    fn begin(self, pg: &OwnedPostgres) {
        match self {
            Outage::Stopped => pg.stop(),
            Outage::BlackHoled => pg.freeze(),
        }
        .unwrap_or_else(|e| panic!("begin the outage ({self:?}): {e:#}"))
    }

    fn end(self, pg: &OwnedPostgres) {
        match self {
            Outage::Stopped => pg.start_again(),
            Outage::BlackHoled => pg.thaw(),
        }
        .unwrap_or_else(|e| panic!("end the outage ({self:?}): {e:#}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_is_fast_503s_and_loses_nothing_acknowledged() {
    outage_loses_nothing(Outage::Stopped).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_database_is_fast_503s_and_loses_nothing_acknowledged() {
    outage_loses_nothing(Outage::BlackHoled).await
}

async fn outage_loses_nothing(outage: Outage) {
    println!("[degrade] outage: {outage:?}");
    let pg =
        OwnedPostgres::start().unwrap_or_else(|e| panic!("no PostgreSQL for the outage: {e:#}"));
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), Some(pg.url()))
        .await
        .unwrap_or_else(|e| panic!("the server starts on a running database: {e:#}"));
    let pid = server.pid().expect("the server runs");
    // kube-rs retries 429/503/504 by default: every answer judged here must be the server's own.
    let client = server.client_without_retries().await.unwrap();
    let findings = Findings::new("[degrade]");
    let kept = with_database_up(&client, &findings).await;

    let api: Api<PolicyReport> = Api::namespaced(client.clone(), NS);
    let from = api
        .list(&ListParams::default().limit(1))
        .await
        .expect("list with the database up")
        .metadata
        .resource_version
        .expect("a list resourceVersion");
    let watched = Arc::new(Mutex::new(Watched::default()));
    let first_watch = tokio::spawn(follow(api.clone(), from.clone(), watched.clone()));
    let writer = Writer::start(client.clone());
    assert!(
        writer
            .await_acks(10, |_| true, Duration::from_secs(10))
            .await,
        "with the database up, expected 10 creates acknowledged within 10s; got {:?}",
        writer
            .calls()
            .iter()
            .map(|c| c.got.to_string())
            .collect::<Vec<_>>()
    );

    let stop_began = Instant::now();
    outage.begin(&pg);
    let stopped_at = Instant::now();
    let until = stopped_at + OUTAGE;
    let (data, (memory, metrics)) = tokio::join!(
        probe_data(&client, &kept, until),
        probe_memory(&client, until)
    );
    let restart_began = Instant::now();
    outage.end(&pg);
    let t = Timeline {
        stop_began,
        stopped_at,
        restart_began,
    };
    let mut all_data = data.clone();
    all_data.extend(writer.calls());
    judge_outage(&findings, &t, &all_data, &memory, &metrics);

    await_recovery(&client, &findings, &t).await;
    let after = |c: &Call| c.started >= t.restart_began;
    writer.await_acks(20, after, RECOVERY).await;
    let written = writer.stop().await;
    for call in written.iter().filter(|c| c.finished() < t.stop_began) {
        findings.check(
            call.code() == Some(201),
            "with the database up, creates succeed",
            || format!("{}: expected 201, saw {}", call.what, call.got),
        );
    }
    check_creates(
        &client,
        &findings,
        &written.iter().collect::<Vec<_>>(),
        &kept,
        "writer",
    )
    .await;
    let probes: Vec<&Call> = data.iter().filter(|c| c.created.is_some()).collect();
    check_creates(
        &client,
        &findings,
        &probes,
        &kept,
        "creates probing the outage",
    )
    .await;
    let acked_after: Vec<String> = written
        .iter()
        .filter(|c| after(c) && c.code() == Some(201))
        .filter_map(|c| c.created.clone())
        .collect();
    let resumed = check_watch(&api, &watched, &from, &acked_after, &findings).await;
    first_watch.abort();
    resumed.iter().for_each(|t| t.abort());
    findings.check_same_process(&server, pid, "the outage");
    findings.assert_none(&server);
}

/// Polls `path` until it answers `code`, failing with what it saw at `deadline`.
async fn await_code(client: &kube::Client, path: &str, code: u16, deadline: Instant, why: &str) {
    loop {
        let call = send(client, "GET", path, None).await;
        if call.code() == Some(code) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{why}: expected GET {path} to answer {code}; the last answer was {}",
            call.got
        );
        tokio::time::sleep(PROBE_PERIOD).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_started_while_its_database_is_down_serves_once_it_is_back() {
    let pg =
        OwnedPostgres::start().unwrap_or_else(|e| panic!("no PostgreSQL for the outage: {e:#}"));
    pg.stop().expect("stop PostgreSQL");
    let dir = tempfile::tempdir().unwrap();
    let spawned = Instant::now();
    let ready_by = spawned + Duration::from_secs(15);
    let server = match tokio::time::timeout_at(
        ready_by.into(),
        ServerProcess::start(dir.path(), Some(pg.url())),
    )
    .await
    {
        Ok(Ok(server)) => server,
        Ok(Err(e)) => panic!("expected the server to start while its database is down; {e:#}"),
        Err(_) => panic!(
            "expected the server to listen within 15s while its database is down; it did not"
        ),
    };
    let client = server.client_without_retries().await.unwrap();
    await_code(
        &client,
        "/readyz",
        200,
        ready_by,
        "within 15s of start with the database down",
    )
    .await;
    eprintln!(
        "[degrade] ready {:?} after spawn with the database down",
        spawned.elapsed()
    );
    await_code(
        &client,
        "/apis",
        200,
        Instant::now(),
        "with the database down",
    )
    .await;
    let list = send(&client, "GET", COLLECTION, None).await;
    if let Some(problem) = refusal_problem(&list, false) {
        panic!(
            "a list before the database ever answered: {problem}\n{}",
            server.log_tail()
        );
    }

    pg.start_again().expect("start PostgreSQL");
    let started = Instant::now();
    let deadline = started + Duration::from_secs(20);
    // 503 until the server has connected and applied its schema; a create whose answer was
    // lost (504, no answer) may have been stored, which a retry then finds as 409.
    loop {
        let call = create(&client, "after-start", 1).await;
        match call.code() {
            Some(201 | 409) => break,
            Some(503 | 504) | None if Instant::now() < deadline => {
                tokio::time::sleep(PROBE_PERIOD).await
            }
            _ => panic!(
                "expected a create to succeed within 20s of the database starting; the last answer was {}\n{}",
                call.got,
                server.log_tail()
            ),
        }
    }
    let got = send(&client, "GET", &format!("{COLLECTION}/after-start"), None).await;
    assert_eq!(
        got.code(),
        Some(200),
        "expected the report just created to be there; saw {}\n{}",
        got.got,
        server.log_tail()
    );
    eprintln!(
        "[degrade] serving {:?} after the database started",
        started.elapsed()
    );
}

/// The server's pooled connections to `pg`: backend pids of client connections other than
/// psql's own and the change feed's `LISTEN` connection (kept on a primary that refused writes;
/// it reconnects when the circuit opens, which a standby makes it do).
fn backends(pg: &OwnedPostgres) -> std::collections::BTreeSet<String> {
    pg.sql(
        "SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend' \
         AND pid <> pg_backend_pid() AND query NOT LIKE 'LISTEN%'",
    )
    .expect("list the server's connections")
    .lines()
    .map(str::to_owned)
    .collect()
}

fn read_only(pg: &OwnedPostgres, on: bool) {
    let set = if on {
        "ALTER SYSTEM SET default_transaction_read_only = on"
    } else {
        "ALTER SYSTEM RESET default_transaction_read_only"
    };
    pg.sql(set).expect(set);
    pg.sql("SELECT pg_reload_conf()").expect("reload");
}

/// A primary set read-only (`default_transaction_read_only`, as some managed services do when
/// their disk fills; also what writes meet on a demoted primary) refuses writes with 503 naming
/// it and keeps serving reads; once it takes writes again, no connection opened before the
/// refusal is used again (after a failover it would lead to the old primary).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_primary_refuses_writes_and_its_connections_are_replaced() {
    let pg = OwnedPostgres::start().unwrap_or_else(|e| panic!("no PostgreSQL: {e:#}"));
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), Some(pg.url()))
        .await
        .expect("start the server");
    let client = server.client_without_retries().await.unwrap();
    let first = create(&client, "before", 0).await;
    assert_eq!(first.code(), Some(201), "create before: {}", first.got);
    let lists = futures::future::join_all((0..4).map(|_| send(&client, "GET", COLLECTION, None)));
    assert!(lists.await.iter().all(|l| l.code() == Some(200)));
    let before = backends(&pg);
    assert!(!before.is_empty(), "the server holds no connection");

    read_only(&pg, true);
    let turned = Instant::now();
    let mut refused = Vec::new();
    for n in 1.. {
        let name = format!("while-read-only-{n}");
        let call = create(&client, &name, n).await;
        match call.code() {
            Some(503) if call.got.to_string().contains("read-only") => {
                refused.push(name);
                break;
            }
            Some(201) if turned.elapsed() < DETECTION => {}
            _ => panic!(
                "expected creates to answer 503 naming read-only within {DETECTION:?}; after {:?}: {}\n{}",
                turned.elapsed(),
                call.got,
                server.log_tail()
            ),
        }
    }
    let read = send(&client, "GET", &format!("{COLLECTION}/before"), None).await;
    assert_eq!(
        read.code(),
        Some(200),
        "reads go on while writes are refused: {}",
        read.got
    );
    let metrics = send(&client, "GET", "/metrics", None).await;
    assert_eq!(
        database_up(&metrics),
        Some(1.0),
        "{METRIC}: a read-only primary is no outage"
    );

    read_only(&pg, false);
    let writable = Instant::now();
    loop {
        let call = create(&client, "after", 100).await;
        match call.code() {
            Some(201) => break,
            Some(503) if writable.elapsed() < RECOVERY => tokio::time::sleep(PROBE_PERIOD).await,
            _ => panic!(
                "expected a create to succeed once writable; got {}\n{}",
                call.got,
                server.log_tail()
            ),
        }
    }
    eprintln!(
        "[degrade] read-only refused within {:?}; writable again: served {:?} later",
        turned.elapsed(),
        writable.elapsed()
    );
    for name in &refused {
        let got = send(&client, "GET", &format!("{COLLECTION}/{name}"), None).await;
        assert_eq!(
            got.code(),
            Some(404),
            "refused {name} was stored: {}",
            got.got
        );
    }
    await_replaced(&pg, &client, &before, &server).await;
}

/// Lists until no connection from `before` is open any more.
async fn await_replaced(
    pg: &OwnedPostgres,
    client: &kube::Client,
    before: &std::collections::BTreeSet<String>,
    server: &ServerProcess,
) {
    let replaced_by = Instant::now() + RECOVERY;
    loop {
        let calls =
            futures::future::join_all((0..4).map(|_| send(client, "GET", COLLECTION, None))).await;
        assert!(
            calls.iter().all(|c| c.code() == Some(200)),
            "lists after recovery"
        );
        let kept: Vec<String> = backends(pg).intersection(before).cloned().collect();
        if kept.is_empty() {
            return;
        }
        assert!(
            Instant::now() < replaced_by,
            "connections opened before the read-only refusal are still open {RECOVERY:?} after \
             the database took writes again: backend pids {kept:?}\n{}",
            server.log_tail()
        );
        tokio::time::sleep(PROBE_PERIOD).await;
    }
}

/// After a failover whose address first leads to a standby (the old primary demoted, or a
/// replica promoted late): the server treats the standby as an outage — data calls answer 503
/// naming it, fast, the gauge is 0 — and serves again, with everything acknowledged before,
/// once the standby is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_an_outage_until_it_is_promoted() {
    let mut pg = OwnedPostgres::start().unwrap_or_else(|e| panic!("no PostgreSQL: {e:#}"));
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(dir.path(), Some(pg.url()))
        .await
        .expect("start the server");
    let client = server.client_without_retries().await.unwrap();
    for n in 0..5 {
        let call = create(&client, &format!("acked-{n}"), n).await;
        assert_eq!(call.code(), Some(201), "create acked-{n}: {}", call.got);
    }
    pg.become_standby()
        .expect("replace the primary with a standby");
    let demoted = Instant::now();
    let deadline = demoted + DETECTION + Duration::from_secs(2);
    loop {
        let call = send(&client, "GET", COLLECTION, None).await;
        if call.code() == Some(503) && call.got.to_string().contains("standby") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "expected lists to answer 503 naming the standby; the last answer was {}\n{}",
            call.got,
            server.log_tail()
        );
        tokio::time::sleep(PROBE_PERIOD).await;
    }
    eprintln!(
        "[degrade] standby noticed {:?} after the switch",
        demoted.elapsed()
    );
    let refused = create(&client, "refused", 99).await;
    assert!(
        refused.code() == Some(503) && refused.took < FAST,
        "a create on a standby: expected 503 within {FAST:?}; got {} after {:?}",
        refused.got,
        refused.took
    );
    let metrics = send(&client, "GET", "/metrics", None).await;
    assert_eq!(database_up(&metrics), Some(0.0), "{METRIC} on a standby");
    await_code(
        &client,
        "/apis",
        200,
        Instant::now(),
        "discovery on a standby",
    )
    .await;

    pg.promote().expect("promote the standby");
    let promoted = Instant::now();
    loop {
        let call = create(&client, "after", 100).await;
        match call.code() {
            Some(201) => break,
            Some(503) if promoted.elapsed() < RECOVERY => tokio::time::sleep(PROBE_PERIOD).await,
            _ => panic!(
                "expected a create to succeed after the promotion; got {}\n{}",
                call.got,
                server.log_tail()
            ),
        }
    }
    eprintln!("[degrade] promoted: served {:?} later", promoted.elapsed());
    for n in 0..5 {
        let got = send(&client, "GET", &format!("{COLLECTION}/acked-{n}"), None).await;
        assert_eq!(
            got.code(),
            Some(200),
            "acknowledged acked-{n} is missing: {}",
            got.got
        );
    }
    let got = send(&client, "GET", &format!("{COLLECTION}/refused"), None).await;
    assert_eq!(
        got.code(),
        Some(404),
        "the refused create was stored: {}",
        got.got
    );
}
