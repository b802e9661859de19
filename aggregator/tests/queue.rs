//! Work queue behaviour under tokio's paused clock.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reports_server_aggregator::{CancellationToken, Metrics, QueueConfig, WorkQueue};
use tokio::time::Instant;

fn config(workers: usize) -> QueueConfig {
    QueueConfig {
        delay: Duration::from_secs(30),
        workers,
        base_backoff: Duration::from_secs(1),
        max_backoff: Duration::from_secs(8),
    }
}

/// Records, per call, (key, start offset in seconds) and tracks concurrency.
#[derive(Clone, Default)]
struct Recorder {
    calls: Arc<Mutex<Vec<(String, u64)>>>,
    running: Arc<AtomicUsize>,
    max_running: Arc<AtomicUsize>,
    running_per_key: Arc<Mutex<std::collections::HashMap<String, usize>>>,
    overlap_same_key: Arc<AtomicUsize>,
}

impl Recorder {
    async fn call(&self, key: String, start: Instant, work: Duration) {
        self.calls
            .lock()
            .unwrap()
            .push((key.clone(), start.elapsed().as_secs()));
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_running.fetch_max(now, Ordering::SeqCst);
        {
            let mut per_key = self.running_per_key.lock().unwrap();
            let n = per_key.entry(key.clone()).or_insert(0);
            *n += 1;
            if *n > 1 {
                self.overlap_same_key.fetch_add(1, Ordering::SeqCst);
            }
        }
        tokio::time::sleep(work).await;
        *self.running_per_key.lock().unwrap().get_mut(&key).unwrap() -= 1;
        self.running.fetch_sub(1, Ordering::SeqCst);
    }

    fn calls(&self) -> Vec<(String, u64)> {
        self.calls.lock().unwrap().clone()
    }
}

fn spawn_run(
    queue: &WorkQueue,
    rec: &Recorder,
    work: Duration,
    fail_first: usize,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let cancel = CancellationToken::new();
    let start = Instant::now();
    let failures = Arc::new(AtomicUsize::new(fail_first));
    let handle = tokio::spawn({
        let queue = queue.clone();
        let rec = rec.clone();
        let cancel = cancel.clone();
        async move {
            queue
                .run(
                    move |key: String| {
                        let rec = rec.clone();
                        let failures = failures.clone();
                        async move {
                            rec.call(key, start, work).await;
                            let left = failures.load(Ordering::SeqCst);
                            if left > 0 {
                                failures.store(left - 1, Ordering::SeqCst);
                                return Err("boom");
                            }
                            Ok(())
                        }
                    },
                    cancel,
                )
                .await
        }
    });
    (cancel, handle)
}

#[tokio::test(start_paused = true)]
async fn delayed_and_not_postponed_by_re_enqueue() {
    let q = WorkQueue::new(config(1), None);
    let rec = Recorder::default();
    let (cancel, handle) = spawn_run(&q, &rec, Duration::ZERO, 0);
    q.enqueue("ns");
    tokio::time::sleep(Duration::from_secs(20)).await;
    q.enqueue("ns");
    q.enqueue("ns");
    tokio::time::sleep(Duration::from_secs(100)).await;
    assert_eq!(rec.calls(), [("ns".to_owned(), 30)]);
    cancel.cancel();
    handle.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_key_is_never_processed_twice_at_once_and_reruns_after() {
    let q = WorkQueue::new(config(4), None);
    let rec = Recorder::default();
    let (cancel, handle) = spawn_run(&q, &rec, Duration::from_secs(10), 0);
    q.enqueue("ns");
    // Processing runs from t=30 to t=40; enqueue in the middle with a short delay.
    tokio::time::sleep(Duration::from_secs(35)).await;
    assert!(q.is_processing("ns"));
    q.enqueue_after("ns", Duration::from_secs(1));
    tokio::time::sleep(Duration::from_secs(60)).await;
    // Not at t=36 (would overlap) but right after the first run ended.
    assert_eq!(rec.calls(), [("ns".to_owned(), 30), ("ns".to_owned(), 40)]);
    assert_eq!(rec.overlap_same_key.load(Ordering::SeqCst), 0);
    cancel.cancel();
    handle.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn workers_run_different_keys_in_parallel() {
    let q = WorkQueue::new(config(3), None);
    let rec = Recorder::default();
    let (cancel, handle) = spawn_run(&q, &rec, Duration::from_secs(10), 0);
    for k in ["a", "b", "c", "d"] {
        q.enqueue(k);
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
    let calls = rec.calls();
    assert_eq!(calls.len(), 4);
    assert_eq!(rec.max_running.load(Ordering::SeqCst), 3);
    // Three start together, the fourth when a worker frees up.
    let starts: Vec<u64> = calls.iter().map(|c| c.1).collect();
    assert_eq!(starts, [30, 30, 30, 40]);
    cancel.cancel();
    handle.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn failures_are_retried_with_capped_exponential_backoff() {
    let q = WorkQueue::new(config(1), None);
    let rec = Recorder::default();
    let (cancel, handle) = spawn_run(&q, &rec, Duration::ZERO, 5);
    q.enqueue("ns");
    tokio::time::sleep(Duration::from_secs(120)).await;
    let starts: Vec<u64> = rec.calls().iter().map(|c| c.1).collect();
    // 30, then +1, +2, +4, +8, +8 (cap), then success.
    assert_eq!(starts, [30, 31, 33, 37, 45, 53]);
    assert_eq!(q.failures("ns"), 0, "success resets the backoff");
    assert!(q.is_empty());
    cancel.cancel();
    handle.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn cancellation_stops_idle_and_busy_workers() {
    let q = WorkQueue::new(config(2), None);
    let rec = Recorder::default();
    let (cancel, handle) = spawn_run(&q, &rec, Duration::from_secs(3600), 0);
    q.enqueue_after("busy", Duration::ZERO);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(q.is_processing("busy"));
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(1), handle)
        .await
        .expect("run returns promptly")
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn queue_depth_is_exported() {
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::register(&mut registry);
    let q = WorkQueue::new(config(1), Some(metrics.clone()));
    q.enqueue("a");
    q.enqueue("b");
    q.enqueue("a");
    assert_eq!(metrics.queue_depth.get(), 2);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("reports_server_aggregation_queue_depth 2"),
        "{text}"
    );
}
