//! Load one client may put on the server: requests in flight and how long one may run.
//!
//! kube-apiserver's `--max-requests-inflight` / `--max-mutating-requests-inflight` and
//! `--request-timeout`, with the same exemption: long-running requests (watches) are neither
//! counted nor timed, since an informer holds one open for as long as it runs. A request over
//! the cap is answered 429 at once with `Retry-After`, before authorization or any database
//! work, so a burst cannot queue work without bound; one past its deadline is answered 504 and
//! its work dropped.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::Semaphore;

use super::request::is_true;
use super::status::ApiError;

/// The caps, shared by every connection.
#[derive(Clone)]
pub struct RequestLimits {
    read_only: Arc<Semaphore>,
    mutating: Arc<Semaphore>,
    timeout: Duration,
}

impl RequestLimits {
    pub fn new(read_only: usize, mutating: usize, timeout: Duration) -> Self {
        RequestLimits {
            read_only: Arc::new(Semaphore::new(read_only.max(1))),
            mutating: Arc::new(Semaphore::new(mutating.max(1))),
            timeout,
        }
    }
}

/// A watch (`?watch=true`, or `watch=1`): long-running, exempt from both limits.
fn is_long_running(request: &Request) -> bool {
    request.method() == Method::GET
        && request.uri().query().is_some_and(|query| {
            query.split('&').any(|pair| {
                pair.split_once('=')
                    .is_some_and(|(k, v)| k == "watch" && is_true(v))
            })
        })
}

fn is_mutating(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

pub async fn limit_request(
    State(limits): State<RequestLimits>,
    request: Request,
    next: Next,
) -> Response {
    if is_long_running(&request) {
        return next.run(request).await;
    }
    let (slots, kind) = if is_mutating(request.method()) {
        (&limits.mutating, "mutating")
    } else {
        (&limits.read_only, "read-only")
    };
    let Ok(_slot) = slots.clone().try_acquire_owned() else {
        return too_many_requests(kind);
    };
    match tokio::time::timeout(limits.timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "Timeout",
            format!(
                "Timeout: request did not complete within the allowed duration of {}s (--request-timeout-seconds)",
                limits.timeout.as_secs()
            ),
        )
        .into_response(),
    }
}

fn too_many_requests(kind: &str) -> Response {
    ApiError::too_many_requests(format!(
        "Too many requests: the server has too many {kind} requests in flight, please try again later"
    ))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: Method, uri: &str) -> Request {
        Request::builder()
            .method(method)
            .uri(uri)
            .body(axum::body::Body::empty())
            .unwrap()
    }

    #[test]
    fn watches_are_long_running_and_nothing_else_is() {
        let path = "/apis/wgpolicyk8s.io/v1alpha2/policyreports";
        assert!(is_long_running(&request(
            Method::GET,
            &format!("{path}?watch=true")
        )));
        assert!(is_long_running(&request(
            Method::GET,
            &format!("{path}?limit=1&watch=1")
        )));
        assert!(!is_long_running(&request(
            Method::GET,
            &format!("{path}?watch=false")
        )));
        assert!(!is_long_running(&request(
            Method::GET,
            &format!("{path}?watchx=true")
        )));
        assert!(!is_long_running(&request(Method::GET, path)));
        assert!(!is_long_running(&request(
            Method::POST,
            &format!("{path}?watch=true")
        )));
        assert!(is_mutating(&Method::PATCH) && !is_mutating(&Method::GET));
    }
}
