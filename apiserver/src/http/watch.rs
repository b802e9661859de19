//! Watches over HTTP: the registry's watch machine (`registry/watch.rs`, where the phases and
//! the start semantics are) rendered as newline-delimited JSON events in the negotiated
//! representation. A change is rendered once per representation and shared by every watcher
//! sending it. Any error ends the watch with one ERROR event, built in one place
//! ([`error_event`]); a watcher cut off for falling behind the feed is ended without one, and
//! its client resumes from the last resourceVersion it saw.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};

use super::AppState;
use super::negotiate::{Negotiated, Representation, Target};
use super::render::{accept, include_object, render_object};
use super::request::Params;
use super::status::ApiError;
use crate::registry::watch::{Event, Step, WatchOptions};
use crate::registry::{Cause, RegistryError, ResourceRef};
use reports_server_crds::ResourceDescriptor;

/// Longest a watch stays open when the client gives no `timeoutSeconds`.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({"type": kind, "object": object})).expect("events serialize");
    line.push(b'\n');
    Bytes::from(line)
}

/// `{"type":…,"object":…}` around an object already serialized (shared by the watchers).
fn object_event_line(kind: &str, object_json: &Bytes) -> Bytes {
    let mut line = Vec::with_capacity(object_json.len() + kind.len() + 24);
    line.extend_from_slice(b"{\"type\":\"");
    line.extend_from_slice(kind.as_bytes());
    line.extend_from_slice(b"\",\"object\":");
    line.extend_from_slice(object_json);
    line.extend_from_slice(b"}\n");
    Bytes::from(line)
}

/// The terminal ERROR event of a watch: the only place a watch's error becomes bytes.
fn error_event(e: RegistryError) -> Bytes {
    event_line("ERROR", &ApiError::from(e).status())
}

pub async fn watch(
    state: &AppState,
    path: &ResourceRef,
    params: &Params,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Collection)?;
    let include = include_object(params)?;
    check_watch_params(path, params)?;
    let timeout = params
        .timeout_seconds
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_TIMEOUT);
    let options = WatchOptions {
        resource_version: params.resource_version.clone(),
        send_initial_events: params.send_initial_events,
        labels: params.labels.clone(),
        fields: params.fields.clone(),
        timeout,
        bookmarks: params
            .allow_watch_bookmarks
            .then_some(state.options.bookmark_interval),
    };
    let resource = path.resource;
    let metrics = state.metrics.clone();
    let mut machine = state.registry.watch(path, options).await?;
    let render = move |event: Event| match event {
        Event::Object(kind, object) => {
            event_line(kind.as_str(), &render_object(resource, n, include, &object))
        }
        Event::Change(kind, change) => match n.representation {
            Representation::Object => object_event_line(kind.as_str(), change.object_json()),
            // Every watcher of one representation shares its rendering of a change.
            _ => {
                let rendered = change.rendered(&format!("{n:?}/{include:?}"), |object| {
                    Bytes::from(
                        serde_json::to_vec(&render_object(resource, n, include, &object))
                            .expect("rendered objects serialize"),
                    )
                });
                object_event_line(kind.as_str(), &rendered)
            }
        },
        Event::Bookmark {
            resource_version,
            initial_events_end,
        } => event_line(
            "BOOKMARK",
            &bookmark_object(resource, n, resource_version, initial_events_end),
        ),
    };
    // The first step runs before the response starts, as kube-apiserver establishes a watch
    // before its headers: a watch from the current state has taken its snapshot (a resuming one
    // has read its replay) by the time the client sees the response, so what the client writes
    // afterwards arrives as events after that state, never folded into it.
    let first = machine.step().await;
    let stream = async_stream::stream! {
        let _watcher = metrics.watcher_started();
        let mut first = Some(first);
        loop {
            let step = match first.take() {
                Some(step) => step,
                None => machine.step().await,
            };
            match step {
                Ok(Step::Events(events)) => {
                    for event in events {
                        yield Ok::<Bytes, Infallible>(render(event));
                    }
                }
                Ok(Step::End) => return,
                Ok(Step::CutOff(skipped)) => {
                    tracing::info!(skipped, "watcher fell behind the change feed and was cut off");
                    metrics.watcher_cut_off();
                    return;
                }
                Err(e) => {
                    yield Ok(error_event(e));
                    return;
                }
            }
        }
    };
    Ok(streamed_response(Body::from_stream(stream), n))
}

/// The response of a watch: its events as newline-delimited JSON, never cached.
fn streamed_response(body: Body, n: Negotiated) -> Response {
    let mut response = (StatusCode::OK, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_str(
            &Negotiated {
                encoding: super::negotiate::Encoding::Json,
                ..n
            }
            .content_type(false),
        )
        .expect("ASCII"),
    );
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    response
}

/// Checks the streaming-list parameters as kube-apiserver does.
fn check_watch_params(path: &ResourceRef, params: &Params) -> Result<(), ApiError> {
    if params.send_initial_events.is_some()
        && params.resource_version_match.as_deref() != Some("NotOlderThan")
    {
        return Err(RegistryError::invalid(
            path.resource,
            "",
            vec![Cause::new("resourceVersionMatch", "Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan", "FieldValueForbidden")],
        )
        .into());
    }
    if params.send_initial_events == Some(true) && !params.allow_watch_bookmarks {
        return Err(RegistryError::invalid_field(
            path.resource,
            "",
            "allowWatchBookmarks",
            "Forbidden: sendInitialEvents requires allowWatchBookmarks=true",
            "FieldValueForbidden",
        )
        .into());
    }
    if params.send_initial_events.is_none() && params.resource_version_match.is_some() {
        return Err(ApiError::bad_request(
            "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
        ));
    }
    Ok(())
}

/// A BOOKMARK object in the watch's representation; `initial_events_end` marks the end of a
/// streaming list (`k8s.io/initial-events-end`).
fn bookmark_object(
    resource: &ResourceDescriptor,
    n: Negotiated,
    rv: i64,
    initial_events_end: bool,
) -> Value {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    match n.representation {
        Representation::Metadata(v) => {
            json!({"kind": "PartialObjectMetadata", "apiVersion": format!("meta.k8s.io/{v}"), "metadata": metadata})
        }
        Representation::Table(v) => {
            json!({"kind": "Table", "apiVersion": format!("meta.k8s.io/{v}"), "metadata": metadata, "columnDefinitions": [], "rows": []})
        }
        _ => {
            json!({"apiVersion": resource.api_version(), "kind": resource.kind, "metadata": metadata})
        }
    }
}

#[cfg(test)]
mod encoding_tests {
    use super::*;
    use crate::registry::watch::{Change, EventType};

    /// The ADDED change of report `ns/a` at `rv`.
    fn added(rv: i64, object: Value) -> Change {
        Change::new(
            rv,
            "policyreports.wgpolicyk8s.io",
            "ns",
            "a",
            EventType::Added,
            Default::default(),
            None,
            &object,
            None,
        )
    }

    #[test]
    fn a_shared_change_is_encoded_once_as_the_object_with_its_version() {
        let change = added(
            42,
            json!({"kind": "PolicyReport", "metadata": {"name": "a", "resourceVersion": "7"}}),
        );
        let first = change.object_json().clone();
        // The same buffer for the next watcher, not a new serialization.
        assert_eq!(first.as_ptr(), change.object_json().as_ptr());
        let line = object_event_line("ADDED", &first);
        let parsed: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(
            parsed,
            json!({"type": "ADDED", "object": {"kind": "PolicyReport", "metadata": {"name": "a", "resourceVersion": "42"}}})
        );
        assert!(line.ends_with(b"}\n"));
        let per_watcher: Value =
            serde_json::from_slice(&event_line("ADDED", &change.object())).unwrap();
        assert_eq!(
            parsed, per_watcher,
            "the same event as the per-watcher path"
        );
    }

    #[test]
    fn a_representation_is_rendered_once_and_shared() {
        let change = added(
            3,
            json!({"kind": "PolicyReport", "metadata": {"name": "a"}}),
        );
        let renders = std::sync::atomic::AtomicUsize::new(0);
        let render = |object: Value| {
            renders.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Bytes::from(object["metadata"]["resourceVersion"].to_string())
        };
        let first = change.rendered("metadata", render);
        let second = change.rendered("metadata", render);
        assert_eq!(first, Bytes::from_static(b"\"3\""));
        assert_eq!(first.as_ptr(), second.as_ptr());
        assert_eq!(renders.load(std::sync::atomic::Ordering::SeqCst), 1);
        change.rendered("table", render);
        assert_eq!(renders.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
}
