//! The election's transitions, over an in-memory lease store with fault injection and paused
//! time (so every instant below is exact).

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::task::JoinHandle;

use super::*;

/// A stored record: who holds it, which write it is, and the duration its writer declared.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    holder: String,
    write: u64,
    duration: Option<Duration>,
}

impl LeaseSnapshot for Record {
    fn holder(&self) -> &str {
        &self.holder
    }

    fn declared_duration(&self) -> Option<Duration> {
        self.duration
    }

    fn same_write(&self, other: &Self) -> bool {
        self.write == other.write
    }
}

/// The one record every candidate of a test shares.
#[derive(Clone, Default)]
struct SharedRecord(Arc<Mutex<Option<Record>>>);

impl SharedRecord {
    fn get(&self) -> Option<Record> {
        self.0.lock().unwrap().clone()
    }

    /// Writes `holder` as the next write of the record (what any writer, a crashed holder or
    /// an intruder, leaves behind).
    fn write(&self, holder: &str, duration: Option<Duration>) -> Record {
        let mut slot = self.0.lock().unwrap();
        let record = Record {
            holder: holder.to_owned(),
            write: slot.as_ref().map_or(1, |r| r.write + 1),
            duration,
        };
        *slot = Some(record.clone());
        record
    }
}

/// What goes wrong between one candidate and the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Fault {
    None = 0,
    /// Every call fails at once.
    CutOff = 1,
    /// Every call takes a minute, then fails.
    Slow = 2,
    /// Every call takes 12 s (longer than the renew deadline), then does its work.
    Late = 3,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot reach the lease store")]
struct Unreachable;

/// One candidate's view of the shared record.
struct MemoryLease {
    record: SharedRecord,
    identity: String,
    fault: Arc<AtomicU8>,
}

impl MemoryLease {
    async fn reach(&self) -> Result<(), Unreachable> {
        match self.fault.load(Ordering::SeqCst) {
            0 => Ok(()),
            1 => Err(Unreachable),
            2 => {
                tokio::time::sleep(Duration::from_secs(60)).await;
                Err(Unreachable)
            }
            _ => {
                tokio::time::sleep(Duration::from_secs(12)).await;
                Ok(())
            }
        }
    }

    fn holds(&self, record: Option<&Record>) -> bool {
        record.is_some_and(|r| r.holder == self.identity)
    }
}

impl LeaseStore for MemoryLease {
    type Snapshot = Record;
    type Error = Unreachable;

    fn identity(&self) -> &str {
        &self.identity
    }

    fn lease_name(&self) -> &str {
        "memory"
    }

    async fn read(&self) -> Result<Option<Record>, Unreachable> {
        self.reach().await?;
        Ok(self.record.get())
    }

    async fn acquire(
        &self,
        observed: Option<&Record>,
        duration: Duration,
    ) -> Result<Option<Record>, Unreachable> {
        self.reach().await?;
        let unchanged = self.record.get().as_ref() == observed;
        Ok(unchanged.then(|| self.record.write(&self.identity, Some(duration))))
    }

    async fn renew(&self, _: &Record, duration: Duration) -> Result<Option<Record>, Unreachable> {
        self.reach().await?;
        let mine = self.holds(self.record.get().as_ref());
        Ok(mine.then(|| self.record.write(&self.identity, Some(duration))))
    }

    async fn release(&self, _: &Record) -> Result<(), Unreachable> {
        self.reach().await?;
        if self.holds(self.record.get().as_ref()) {
            self.record.write("", Some(Duration::from_secs(1)));
        }
        Ok(())
    }
}

/// When each candidate started and stopped working, from the test's start.
#[derive(Clone, Default)]
struct Timeline {
    start: Arc<Mutex<Option<Instant>>>,
    events: Arc<Mutex<Vec<(Duration, String, bool)>>>,
    leaders: Arc<AtomicUsize>,
    most_leaders: Arc<AtomicUsize>,
}

impl Timeline {
    fn new() -> Self {
        let timeline = Timeline::default();
        *timeline.start.lock().unwrap() = Some(Instant::now());
        timeline
    }

    fn record(&self, who: &str, leading: bool) {
        let at = self.start.lock().unwrap().expect("started").elapsed();
        self.events
            .lock()
            .unwrap()
            .push((at, who.to_owned(), leading));
        if leading {
            let now = self.leaders.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_leaders.fetch_max(now, Ordering::SeqCst);
        } else {
            self.leaders.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// `(seconds, leading)` of one candidate.
    fn of(&self, who: &str) -> Vec<(f64, bool)> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, w, _)| w == who)
            .map(|(at, _, leading)| (at.as_secs_f64(), *leading))
            .collect()
    }
}

/// A running candidate and its handles.
struct Candidate {
    fault: Arc<AtomicU8>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl Candidate {
    fn set_fault(&self, fault: Fault) {
        self.fault.store(fault as u8, Ordering::SeqCst);
    }

    async fn stop(self) {
        self.cancel.cancel();
        self.task.await.expect("the elector does not panic");
    }
}

/// Starts a candidate whose work runs until its term ends.
fn candidate(record: &SharedRecord, who: &str, timeline: &Timeline) -> Candidate {
    candidate_with(
        record,
        who,
        timeline,
        |term: CancellationToken| async move { term.cancelled().await },
    )
}

fn candidate_with<F, Fut>(
    record: &SharedRecord,
    who: &str,
    timeline: &Timeline,
    work: F,
) -> Candidate
where
    F: Fn(CancellationToken) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let fault = Arc::new(AtomicU8::new(Fault::None as u8));
    let cancel = CancellationToken::new();
    let elector = Elector::new(
        MemoryLease {
            record: record.clone(),
            identity: who.to_owned(),
            fault: fault.clone(),
        },
        ElectionTiming::default(),
    );
    let (who, timeline, token) = (who.to_owned(), timeline.clone(), cancel.clone());
    let task = tokio::spawn(async move {
        elector
            .run(token, work, |leading| timeline.record(&who, leading))
            .await
    });
    Candidate {
        fault,
        cancel,
        task,
    }
}

async fn sleep_secs(seconds: u64) {
    tokio::time::sleep(Duration::from_secs(seconds)).await;
}

#[test]
fn takeover_rules() {
    let record = |holder: &str, duration: Option<u64>| Record {
        holder: holder.into(),
        write: 1,
        duration: duration.map(Duration::from_secs),
    };
    let own = Duration::from_secs(15);
    let secs = Duration::from_secs;
    // Released or our own: take it at once.
    assert!(takeable(&record("", Some(15)), "me", Duration::ZERO, own));
    assert!(takeable(&record("me", Some(15)), "me", Duration::ZERO, own));
    // Someone else's: only once unchanged for the duration the record declares…
    assert!(!takeable(&record("other", Some(15)), "me", secs(14), own));
    assert!(takeable(&record("other", Some(15)), "me", secs(15), own));
    assert!(takeable(&record("other", Some(3)), "me", secs(3), own));
    // …or our own when it declares none.
    assert!(!takeable(&record("other", None), "me", secs(14), own));
    assert!(takeable(&record("other", None), "me", secs(15), own));
}

#[test]
fn observer_measures_one_write_on_its_own_clock() {
    let mut observer = Observer::default();
    let t0 = Instant::now();
    let first = Record {
        holder: "a".into(),
        write: 7,
        duration: None,
    };
    assert_eq!(observer.unchanged_for(&first, t0), Duration::ZERO);
    let later = t0 + Duration::from_secs(9);
    assert_eq!(
        observer.unchanged_for(&first, later),
        Duration::from_secs(9)
    );
    // A new write restarts the count, whatever it holds.
    let renewed = Record { write: 8, ..first };
    assert_eq!(observer.unchanged_for(&renewed, later), Duration::ZERO);
    assert_eq!(
        observer.unchanged_for(&renewed, later + Duration::from_secs(1)),
        Duration::from_secs(1)
    );
}

#[test]
fn default_timing_stops_before_anyone_may_take_over() {
    let t = ElectionTiming::default();
    assert!(t.renew_interval < t.renew_deadline);
    assert!(t.renew_deadline < t.duration);
}

#[tokio::test(start_paused = true)]
async fn a_free_lease_is_taken_at_once_and_kept_by_renewing() {
    let (record, timeline) = (SharedRecord::default(), Timeline::new());
    let a = candidate(&record, "a", &timeline);
    sleep_secs(61).await;
    assert_eq!(timeline.of("a"), [(0.0, true)]);
    let held = record.get().unwrap();
    assert_eq!(held.holder, "a");
    // Acquired at 0, renewed every 5 s.
    assert_eq!(held.write, 1 + 12);
    assert_eq!(held.duration, Some(Duration::from_secs(15)));
    a.stop().await;
    assert_eq!(timeline.of("a"), [(0.0, true), (61.0, false)]);
    assert_eq!(record.get().unwrap().holder, "", "released on a clean stop");
}

#[tokio::test(start_paused = true)]
async fn an_expired_lease_is_taken_over_after_its_duration_on_the_candidates_clock() {
    let (record, timeline) = (SharedRecord::default(), Timeline::new());
    record.write("crashed", Some(Duration::from_secs(15)));
    let b = candidate(&record, "b", &timeline);
    // b first sees the record at 0 and looks every 2 s: unchanged for 14 s at 14, 16 at 16.
    sleep_secs(15).await;
    assert!(timeline.of("b").is_empty());
    sleep_secs(2).await;
    assert_eq!(timeline.of("b"), [(16.0, true)]);
    b.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_record_that_keeps_changing_is_never_taken_over() {
    let (record, timeline) = (SharedRecord::default(), Timeline::new());
    let a = candidate(&record, "a", &timeline);
    sleep_secs(1).await;
    let b = candidate(&record, "b", &timeline);
    sleep_secs(300).await;
    assert_eq!(timeline.of("a"), [(0.0, true)]);
    assert!(timeline.of("b").is_empty());
    b.stop().await;
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_clean_stop_hands_the_lease_over_within_a_retry_interval() {
    let (record, timeline) = (SharedRecord::default(), Timeline::new());
    let a = candidate(&record, "a", &timeline);
    sleep_secs(1).await;
    let b = candidate(&record, "b", &timeline);
    sleep_secs(29).await;
    a.stop().await;
    assert_eq!(timeline.of("a"), [(0.0, true), (30.0, false)]);
    // b looks at 1, 3, …, 29, 31: it finds the lease released at 31, not after 15 s.
    sleep_secs(2).await;
    assert_eq!(timeline.of("b"), [(31.0, true)]);
    b.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_holder_cut_off_from_the_store_stops_before_anyone_else_may_start() {
    let (record, timeline) = (SharedRecord::default(), Timeline::new());
    let a = candidate(&record, "a", &timeline);
    sleep_secs(1).await;
    let b = candidate(&record, "b", &timeline);
    // a renews at 5, 10, 15, 20, then cannot reach the store any more.
    sleep_secs(20).await;
    a.set_fault(Fault::CutOff);
    sleep_secs(60).await;
    // a stops at its deadline (20 + 10), although its retries fall at 25, 27, 29, 31;
    // b first sees a's last write at 21 and takes it over when it has been unchanged for 15 s.
    assert_eq!(timeline.of("a"), [(0.0, true), (30.0, false)]);
    assert_eq!(timeline.of("b"), [(37.0, true)]);
    assert_eq!(record.get().unwrap().holder, "b");
    b.stop().await;
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_renewal_that_hangs_is_abandoned_at_the_deadline() {
    let (record, timeline) = (SharedRecord::default(), Timeline::new());
    let a = candidate(&record, "a", &timeline);
    sleep_secs(21).await;
    a.set_fault(Fault::Slow);
    sleep_secs(20).await;
    // The renewal started at 25 is abandoned at 30 = last renewal (20) + deadline.
    assert_eq!(timeline.of("a"), [(0.0, true), (30.0, false)]);
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_acquisition_answered_after_the_deadline_is_not_worked_on() {
    let (record, timeline) = (SharedRecord::default(), Timeline::new());
    let a = candidate(&record, "a", &timeline);
    a.set_fault(Fault::Late);
    sleep_secs(100).await;
    // Each attempt (a read, then a write, 12 s each) takes longer than the deadline: the lease
    // is a's, but a never works on it, since a candidate may already count it as expired.
    assert_eq!(record.get().unwrap().holder, "a");
    assert!(timeline.of("a").is_empty());
    // Once the store answers promptly again, the next attempt takes it (a's own) at once.
    a.set_fault(Fault::None);
    sleep_secs(40).await;
    let events = timeline.of("a");
    assert!(
        matches!(events[..], [(at, true)] if at > 100.0),
        "{events:?}"
    );
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_lease_taken_over_stops_the_work_and_is_not_released() {
    let (record, timeline) = (SharedRecord::default(), Timeline::new());
    let a = candidate(&record, "a", &timeline);
    sleep_secs(7).await;
    record.write("intruder", Some(Duration::from_secs(15)));
    sleep_secs(5).await;
    // a's renewal at 10 finds the lease someone else's.
    assert_eq!(timeline.of("a"), [(0.0, true), (10.0, false)]);
    assert_eq!(record.get().unwrap().holder, "intruder");
    a.stop().await;
    assert_eq!(record.get().unwrap().holder, "intruder");
}

#[tokio::test(start_paused = true)]
async fn work_that_returns_gives_the_lease_back_and_seeks_it_again() {
    let (record, timeline) = (SharedRecord::default(), Timeline::new());
    let terms = Arc::new(AtomicUsize::new(0));
    let counted = terms.clone();
    let a = candidate_with(&record, "a", &timeline, move |term: CancellationToken| {
        let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            if first {
                sleep_secs(1).await;
            } else {
                term.cancelled().await;
            }
        }
    });
    sleep_secs(2).await;
    assert_eq!(timeline.of("a"), [(0.0, true), (1.0, false)]);
    assert_eq!(record.get().unwrap().holder, "", "released");
    // Sought again one retry interval later, not in a spin.
    sleep_secs(2).await;
    assert_eq!(timeline.of("a"), [(0.0, true), (1.0, false), (3.0, true)]);
    assert_eq!(terms.load(Ordering::SeqCst), 2);
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_candidate_that_waited_keeps_leading_past_its_first_renewal() {
    // The renew deadline counts from the acquiring write, not from when the candidate began
    // to wait: a takeover after 16 s of waiting must not end at the first renewal.
    let (record, timeline) = (SharedRecord::default(), Timeline::new());
    record.write("crashed", Some(Duration::from_secs(15)));
    let b = candidate(&record, "b", &timeline);
    sleep_secs(120).await;
    assert_eq!(timeline.of("b"), [(16.0, true)]);
    b.stop().await;
}

#[tokio::test(start_paused = true)]
async fn candidates_never_lead_at_once_whatever_fails() {
    let (record, timeline) = (SharedRecord::default(), Timeline::new());
    let candidates: Vec<Candidate> = ["a", "b", "c"]
        .iter()
        .map(|who| candidate(&record, who, &timeline))
        .collect();
    // A fixed pseudo-random schedule of faults: cut-offs, failing and late stores, recoveries.
    let mut seed: u64 = 0x5eed;
    let mut next = |bound: u64| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % bound
    };
    for _ in 0..200 {
        sleep_secs(1 + next(20)).await;
        let fault = match next(5) {
            0 => Fault::CutOff,
            1 => Fault::Slow,
            2 => Fault::Late,
            _ => Fault::None,
        };
        candidates[next(3) as usize].set_fault(fault);
    }
    for c in &candidates {
        c.set_fault(Fault::None);
    }
    sleep_secs(120).await;
    assert_eq!(timeline.most_leaders.load(Ordering::SeqCst), 1);
    assert_eq!(
        timeline.leaders.load(Ordering::SeqCst),
        1,
        "someone leads in the end"
    );
    let terms = timeline.events.lock().unwrap().len();
    assert!(
        terms > 4,
        "the schedule moved the lease around ({terms} events)"
    );
    for c in candidates {
        c.stop().await;
    }
    assert_eq!(timeline.leaders.load(Ordering::SeqCst), 0);
}
