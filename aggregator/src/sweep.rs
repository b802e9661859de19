//! Namespace sweeps: enqueue every namespace a backend says may need a merge.
//!
//! Events enqueue one namespace at a time, but some moments need all of them: a new leader
//! does not know what happened while nobody led, a change of the policy set can change every
//! managed report, and an event feed that fell behind has lost events. Both backends then list
//! the namespaces in question (each in its own way: metadata lists over the API, one `SELECT
//! DISTINCT` in SQL) and enqueue them.
//!
//! A sweep is not optional, so a failed listing is retried with a doubling backoff (0.5 s up to
//! 30 s) until it succeeds or the term ends: an outage of the API server or the database must
//! delay a sweep, never drop it. The queue de-duplicates, so a namespace that is already
//! pending keeps its earlier due time.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::queue::WorkQueue;

/// The wait after the first failed listing.
pub const FIRST_RETRY: Duration = Duration::from_millis(500);
/// The longest wait between two listings.
pub const MAX_RETRY: Duration = Duration::from_secs(30);

/// Enqueues every namespace `list` returns (`""` for cluster scope), retrying `list` with
/// backoff until it succeeds or `cancel` fires. `what` names the namespaces in log lines
/// ("with ephemeral reports").
pub async fn sweep_namespaces<F, Fut, N, E>(
    queue: &WorkQueue,
    cancel: &CancellationToken,
    what: &str,
    mut list: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<N, E>>,
    N: IntoIterator<Item = String>,
    E: Display,
{
    let mut delay = FIRST_RETRY;
    loop {
        let listed = tokio::select! {
            _ = cancel.cancelled() => return,
            listed = list() => listed,
        };
        match listed {
            Ok(namespaces) => {
                let mut count = 0usize;
                for namespace in namespaces {
                    queue.enqueue(namespace);
                    count += 1;
                }
                tracing::debug!(count, "enqueued every namespace {what}");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the namespaces {what} to enqueue them; retrying")
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(MAX_RETRY);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tokio::time::Instant;

    use super::*;
    use crate::queue::QueueConfig;

    fn queue() -> WorkQueue {
        WorkQueue::new(QueueConfig::default(), None)
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_listing_is_retried_with_doubling_capped_backoff() {
        let queue = queue();
        let start = Instant::now();
        let attempts = Mutex::new(Vec::new());
        sweep_namespaces(&queue, &CancellationToken::new(), "in the test", || {
            let mut attempts = attempts.lock().unwrap();
            attempts.push(start.elapsed());
            let failed = attempts.len() <= 8;
            async move {
                if failed {
                    Err("the store is down")
                } else {
                    Ok(vec!["a".to_owned(), String::new(), "a".to_owned()])
                }
            }
        })
        .await;
        let waits: Vec<u64> = attempts
            .lock()
            .unwrap()
            .windows(2)
            .map(|w| (w[1] - w[0]).as_millis() as u64)
            .collect();
        assert_eq!(
            waits,
            [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000],
            "0.5 s doubling, capped at 30 s"
        );
        // Both namespaces, once each.
        assert_eq!(queue.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn cancelling_ends_a_sweep_that_keeps_failing() {
        let queue = queue();
        let cancel = CancellationToken::new();
        let sweep = sweep_namespaces(&queue, &cancel, "in the test", || async {
            Err::<Vec<String>, _>("the store is down")
        });
        let stopper = async {
            tokio::time::sleep(Duration::from_secs(3)).await;
            cancel.cancel();
        };
        let started = Instant::now();
        tokio::join!(sweep, stopper);
        assert_eq!(started.elapsed(), Duration::from_secs(3));
        assert!(queue.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn cancelling_interrupts_a_listing_in_flight() {
        let queue = queue();
        let cancel = CancellationToken::new();
        cancel.cancel();
        sweep_namespaces(&queue, &cancel, "in the test", || {
            std::future::pending::<Result<Vec<String>, String>>()
        })
        .await;
        assert!(queue.is_empty());
    }
}
