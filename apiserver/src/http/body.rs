//! Request bodies: each one bounded (`--max-request-bytes`), all of them together bounded
//! (`--max-inflight-request-bytes`), and the big ones processed off the runtime's workers.
//!
//! kube-apiserver's aggregation proxy passes request bodies of any size (measured: 256 MiB went
//! through unchanged), so these bounds are the only ones a big write meets. Handling a body costs
//! a multiple of its size at its peak (parsing, validation, managedFields, the stored and the
//! returned copy: 12–18× measured on the release build for a create, up to 55× on the debug
//! build for a create and an update), so a per-request cap alone lets a few hundred concurrent maximal writes
//! take gigabytes. The budget counts the bytes of the bodies being handled, held from the moment
//! a body is accepted until its response is built, and a body that does not fit is refused at
//! once with 429 and `Retry-After` (as the in-flight caps do, and client-go retries): waiting
//! instead would leave its bytes unread in the HTTP/2 connection's flow-control window, which
//! kube-apiserver shares between every request it proxies, and stall them all.
//!
//! Decoding and writing a body of several MiB is seconds of CPU without an `.await` in between.
//! On a runtime worker that starves the tasks queued behind it (tokio cannot steal a worker's
//! next-to-run task while it is busy), among them kube-apiserver's 5-second availability probe,
//! which then takes our groups out of discovery: measured with a 128 MiB create before this
//! module. [`offload`] runs such a request on the blocking pool instead.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicI64;

use axum::body::Body;
use axum::http::HeaderMap;
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
    /// budget: a declared `Content-Length` is refused (413 over the limit, 429 over the budget)
    /// before any of the body is awaited; a chunked body is counted as it arrives.
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
        let declared = declared.map_or(0, |n| n as usize);
        self.grow(&mut reservation, declared)?;
        let mut body = body;
        let mut bytes = BytesMut::with_capacity(declared);
        while let Some(frame) = body.frame().await {
            let frame = frame
                .map_err(|e| ApiError::bad_request(format!("cannot read the request body: {e}")))?;
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            if bytes.len() + data.len() > limit {
                return Err(ApiError::too_large(limit));
            }
            let beyond_reserved = (bytes.len() + data.len()).saturating_sub(reservation.bytes);
            self.grow(&mut reservation, beyond_reserved)?;
            bytes.extend_from_slice(&data);
        }
        Ok((bytes.freeze(), reservation))
    }
}

/// Runs `work` (the whole handling of a request) on the blocking pool when its body is at least
/// [`OFFLOAD_FROM_BYTES`], inline otherwise; see the module doc. A request cut off by its
/// deadline meanwhile lets its work finish there (like a write whose 504 came after its commit,
/// the outcome is then unknown to the client).
pub async fn offload<F, T>(body_len: usize, work: F) -> T
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let handle = tokio::runtime::Handle::current();
    if body_len < OFFLOAD_FROM_BYTES
        || handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread
    {
        return work.await;
    }
    let span = tracing::Span::current();
    match tokio::task::spawn_blocking(move || span.in_scope(|| handle.block_on(work))).await {
        Ok(output) => output,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
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
    async fn a_declared_body_is_reserved_whole_and_given_back_when_dropped() {
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

    #[tokio::test]
    async fn a_chunked_body_is_counted_as_it_arrives() {
        let b = budget(100);
        let _held = b
            .read(&HeaderMap::new(), Body::from(vec![b'x'; 70]), 1000)
            .await
            .unwrap();
        assert_eq!(b.in_flight.get(), 70);
        let refused = b
            .read(&HeaderMap::new(), Body::from(vec![b'x'; 40]), 1000)
            .await
            .err()
            .expect("over the budget");
        assert_eq!(refused.code.as_u16(), 429);
        assert_eq!(
            b.in_flight.get(),
            70,
            "the refused body's share is given back"
        );
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
