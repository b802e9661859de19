//! Request bodies: each one bounded (`--max-request-bytes`), all of them together bounded
//! (`--max-inflight-request-bytes`), and the big ones processed off the runtime's workers.
//!
//! kube-apiserver's aggregation proxy passes request bodies of any size (measured: 256 MiB went
//! through unchanged), so these bounds are the only ones a big write meets. Handling a body costs
//! a multiple of its size at its peak (parsing, validation, managedFields, the stored and the
//! returned copy: 18–25× for a create, measured on the debug build in docs/benchmarks.md "Scale",
//! and up to 55× for a create and an update in a row), so a per-request cap alone lets a few hundred concurrent maximal writes
//! take gigabytes. The budget counts the bytes of the bodies being handled, as they arrive (a declared
//! `Content-Length` reserves nothing until its bytes come, so clients that declare much and send
//! little cannot take the budget from the others), held until the response is built, and a body
//! that does not fit is refused at once with 429 and `Retry-After` (as the in-flight caps do, and
//! client-go retries): waiting instead would leave its bytes unread in the HTTP/2 connection's
//! flow-control window, which kube-apiserver shares between every request it proxies, and stall
//! them all. A patch is counted by its body only, not by the object it loads and rewrites.
//!
//! Decoding and writing a body of several MiB is seconds of CPU without an `.await` in between.
//! On a runtime worker that starves the tasks queued behind it (tokio cannot steal a worker's
//! next-to-run task while it is busy), among them kube-apiserver's 5-second availability probe,
//! which then takes our groups out of discovery: measured with a 128 MiB create before this
//! module. [`offload`] runs such a request on the blocking pool instead, and every patch, whose
//! small body may rewrite an object of any size.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicI64;

use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt as _;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::status::ApiError;
use crate::metrics::Metrics;

/// Bodies from this size on are handled on the blocking pool ([`offload`]): below it, decoding
/// takes well under a millisecond per 10 KB and a thread hand-off would cost more than it saves.
pub const OFFLOAD_FROM_BYTES: usize = 1024 * 1024;

/// The bytes of request bodies being handled at once, shared by every connection.
#[derive(Clone)]
pub struct BodyBudget {
    bytes: Arc<Semaphore>,
    max_bytes: usize,
    in_flight: Gauge<i64, AtomicI64>,
    refused: Counter,
}

/// A body's share of the [`BodyBudget`], given back when dropped (after the response is built).
pub struct Reservation {
    _permits: Option<OwnedSemaphorePermit>,
    bytes: usize,
    in_flight: Gauge<i64, AtomicI64>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.in_flight.dec_by(self.bytes as i64);
    }
}

impl BodyBudget {
    /// A budget of `max_bytes` (at least one byte), with its gauge and counter registered in
    /// `metrics`.
    pub fn new(max_bytes: usize, metrics: &Metrics) -> Self {
        let max_bytes = max_bytes.clamp(1, Semaphore::MAX_PERMITS.min(u32::MAX as usize));
        let budget = BodyBudget {
            bytes: Arc::new(Semaphore::new(max_bytes)),
            max_bytes,
            in_flight: Gauge::default(),
            refused: Counter::default(),
        };
        metrics.register(|registry| {
            registry.register(
                "reports_server_apiserver_request_body_bytes_in_flight",
                "Bytes of request bodies being handled (bounded by --max-inflight-request-bytes)",
                budget.in_flight.clone(),
            );
            registry.register(
                "reports_server_apiserver_request_body_budget_refusals",
                "Requests answered 429 because their body did not fit in --max-inflight-request-bytes",
                budget.refused.clone(),
            );
        });
        budget
    }

    /// Takes `more` bytes into `reservation`, or refuses with 429.
    fn grow(&self, reservation: &mut Reservation, more: usize) -> Result<(), ApiError> {
        if more == 0 {
            return Ok(());
        }
        let permits = u32::try_from(more)
            .ok()
            .and_then(|n| self.bytes.clone().try_acquire_many_owned(n).ok());
        let Some(permits) = permits else {
            self.refused.inc();
            return Err(ApiError::too_many_requests(format!(
                "Too many requests: the bodies of the requests in flight take the server's budget \
                 of {} bytes (--max-inflight-request-bytes), please try again later",
                self.max_bytes
            )));
        };
        match &mut reservation._permits {
            Some(held) => held.merge(permits),
            none => *none = Some(permits),
        }
        reservation.bytes += more;
        self.in_flight.inc_by(more as i64);
        Ok(())
    }

    fn empty_reservation(&self) -> Reservation {
        Reservation {
            _permits: None,
            bytes: 0,
            in_flight: self.in_flight.clone(),
        }
    }

    /// Reads a request body of at most `limit` bytes into memory, holding its bytes of the
    /// budget as they arrive: a declared `Content-Length` over the limit is refused (413) before
    /// any of the body is awaited, a body that does not fit in the budget when its bytes come
    /// (429).
    pub async fn read(
        &self,
        headers: &HeaderMap,
        body: Body,
        limit: usize,
    ) -> Result<(Bytes, Reservation), ApiError> {
        let declared = headers
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(ApiError::too_large(limit));
        }
        let mut reservation = self.empty_reservation();
        let mut body = body;
        let mut bytes = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame
                .map_err(|e| ApiError::bad_request(format!("cannot read the request body: {e}")))?;
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            if bytes.len() + data.len() > limit {
                return Err(ApiError::too_large(limit));
            }
            self.grow(&mut reservation, data.len())?;
            bytes.extend_from_slice(&data);
        }
        Ok((bytes.freeze(), reservation))
    }
}

/// Whether a request is handled on the blocking pool ([`offload`]): a body of at least
/// [`OFFLOAD_FROM_BYTES`], or a patch (its small body may rewrite an object of any size).
pub fn is_heavy(body_len: usize, is_patch: bool) -> bool {
    is_patch || body_len >= OFFLOAD_FROM_BYTES
}

/// Runs `work` (the whole handling of a request) on the blocking pool; see the module doc. The
/// work stays tied to the caller: when the caller is dropped (the request's deadline, the client
/// gone), the work is dropped at its next `.await`, as it would be inline, so a write cut off by
/// its deadline does not go on to commit after its 504 and the budget it held is not given back
/// while it still runs. On a current-thread runtime (tests) the work runs inline.
pub async fn offload<F>(work: F) -> Result<Response, ApiError>
where
    F: Future<Output = Result<Response, ApiError>> + Send + 'static,
{
    let handle = tokio::runtime::Handle::current();
    if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread {
        return work.await;
    }
    let (_caller_alive, caller_gone) = tokio::sync::oneshot::channel::<()>();
    let span = tracing::Span::current();
    let task = tokio::task::spawn_blocking(move || {
        span.in_scope(|| {
            handle.block_on(async move {
                tokio::select! {
                    biased;
                    _ = caller_gone => None,
                    answer = work => Some(answer),
                }
            })
        })
    });
    match task.await {
        Ok(Some(answer)) => answer,
        // The sender lives in this future, which is still running.
        Ok(None) => unreachable!("the caller is gone but still awaits"),
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(_) => Err(ApiError::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "the server is shutting down; retry against another replica",
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(bytes: usize) -> BodyBudget {
        BodyBudget::new(bytes, &Metrics::new())
    }

    fn with_length(n: usize) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(axum::http::header::CONTENT_LENGTH, n.into());
        headers
    }

    #[tokio::test]
    async fn a_body_holds_its_bytes_until_dropped() {
        let b = budget(100);
        let (bytes, held) = b
            .read(&with_length(60), Body::from(vec![b'x'; 60]), 1000)
            .await
            .unwrap();
        assert_eq!(bytes.len(), 60);
        assert_eq!(b.in_flight.get(), 60);
        let refused = b
            .read(&with_length(60), Body::from(vec![b'x'; 60]), 1000)
            .await
            .err()
            .expect("no room for a second body");
        assert_eq!(refused.code.as_u16(), 429);
        assert_eq!(b.refused.get(), 1);
        drop(held);
        assert_eq!(b.in_flight.get(), 0);
        b.read(&with_length(60), Body::from(vec![b'x'; 60]), 1000)
            .await
            .expect("room again");
    }

    fn chunked(frames: &[usize]) -> Body {
        let frames: Vec<Result<Bytes, std::convert::Infallible>> = frames
            .iter()
            .map(|n| Ok(Bytes::from(vec![b'x'; *n])))
            .collect();
        Body::from_stream(futures::stream::iter(frames))
    }

    #[tokio::test]
    async fn a_body_is_counted_as_it_arrives_and_a_refused_one_gives_its_share_back() {
        let b = budget(100);
        let _held = b
            .read(&HeaderMap::new(), chunked(&[30]), 1000)
            .await
            .unwrap();
        assert_eq!(b.in_flight.get(), 30);
        // Declaring more than the budget takes nothing until the bytes come: the first 40 fit,
        // the next 40 do not.
        let refused = b
            .read(&with_length(80), chunked(&[40, 40]), 1000)
            .await
            .err()
            .expect("over the budget");
        assert_eq!(refused.code.as_u16(), 429);
        assert_eq!(
            b.in_flight.get(),
            30,
            "the refused body's 40 bytes are given back"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn offloaded_work_leaves_the_worker_free() {
        let other_ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = other_ran.clone();
        let work = async move {
            // Blocks its thread, as seconds of decoding would.
            std::thread::sleep(std::time::Duration::from_millis(500));
            if flag.load(std::sync::atomic::Ordering::SeqCst) {
                Ok(Response::default())
            } else {
                Err(ApiError::internal("the only worker was blocked"))
            }
        };
        let other = other_ran.clone();
        tokio::spawn(async move { other.store(true, std::sync::atomic::Ordering::SeqCst) });
        offload(work).await.expect("the other task ran meanwhile");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn offloaded_work_is_dropped_with_its_caller_and_panics_reach_it() {
        struct Dropped(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let guard = Dropped(dropped.clone());
        let work = async move {
            let _guard = guard;
            tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
            Ok(Response::default())
        };
        let cut = tokio::time::timeout(std::time::Duration::from_millis(50), offload(work)).await;
        assert!(cut.is_err(), "cut off by the deadline");
        for _ in 0..200 {
            if dropped.load(std::sync::atomic::Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(
            dropped.load(std::sync::atomic::Ordering::SeqCst),
            "the work was dropped"
        );

        let panicked = tokio::spawn(offload(async { panic!("in the handler") })).await;
        assert!(panicked.err().is_some_and(|e| e.is_panic()));
    }

    #[tokio::test]
    async fn the_per_request_limit_is_413_declared_or_not() {
        let b = budget(1000);
        for headers in [with_length(11), HeaderMap::new()] {
            let e = b
                .read(&headers, Body::from(vec![b'x'; 11]), 10)
                .await
                .err()
                .expect("over the limit");
            assert_eq!(e.code.as_u16(), 413);
        }
        assert_eq!(b.in_flight.get(), 0);
        assert_eq!(b.refused.get(), 0);
    }
}
