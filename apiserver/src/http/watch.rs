//! Watches: newline-delimited JSON events streamed from the change log.
//!
//! Start semantics follow kube-apiserver: without `resourceVersion` (or with `"0"`) the client
//! first gets a synthetic ADDED for every matching object, then live events; with `N` it gets
//! every event after N, replayed from the change log, or a 410 Expired ERROR event when N is
//! older than the retained history. Label-selector watches turn "stopped matching" into DELETED
//! and "started matching" into ADDED. A watcher that falls more than the broadcast buffer behind
//! is cut off; its client resumes from the last resourceVersion it saw.

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;

use super::AppState;
use super::negotiate::{Negotiated, Representation, Target};
use super::request::{Params, ResourcePath};
use super::resources::{accept, include_object, render_object};
use super::status::ApiError;
use crate::store::feed::read_changes;
use crate::store::{Change, EventType, ListQuery, Store};

/// Longest a watch stays open when the client gives no `timeoutSeconds`.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

/// Objects read per query while a watch sends the current state.
const INITIAL_PAGE_SIZE: u64 = 500;

/// What a watch that starts with the current state has told its client, while the pages of that
/// state are read one after another at increasing resourceVersions.
///
/// A page read at version R already shows every change up to R to the objects in its key range,
/// so replaying the change log from the first page's version would repeat those changes, and
/// would announce the deletion of objects that were gone before their page was read. The
/// catch-up therefore skips changes a page already showed and turns the first change of an
/// object the client has not seen into ADDED (or nothing, for a deletion). Memory is one entry
/// per object sent, and only until the catch-up ends.
#[derive(Default)]
struct Announced {
    objects: HashMap<(String, String), i64>,
}

impl Announced {
    fn record(&mut self, namespace: &str, name: &str, resource_version: i64) {
        self.objects
            .insert((namespace.to_owned(), name.to_owned()), resource_version);
    }

    /// The event to send for a change (already filtered for this watch), if any.
    fn reconcile(
        &mut self,
        namespace: &str,
        name: &str,
        resource_version: i64,
        event: EventType,
    ) -> Option<EventType> {
        let key = (namespace.to_owned(), name.to_owned());
        match (self.objects.get(&key).copied(), event) {
            (Some(shown), _) if resource_version <= shown => None,
            (Some(_), EventType::Deleted) => {
                self.objects.remove(&key);
                Some(EventType::Deleted)
            }
            (Some(_), _) => {
                self.objects.insert(key, resource_version);
                Some(EventType::Modified)
            }
            (None, EventType::Deleted) => None,
            (None, _) => {
                self.objects.insert(key, resource_version);
                Some(EventType::Added)
            }
        }
    }
}

struct Filter {
    resource_key: String,
    namespace: Option<String>,
    params: Params,
}

impl Filter {
    /// The event type this watcher should see for `change`, if any.
    fn event_for(&self, change: &Change) -> Option<EventType> {
        if change.resource != self.resource_key {
            return None;
        }
        if self
            .namespace
            .as_deref()
            .is_some_and(|ns| ns != change.namespace)
        {
            return None;
        }
        if !self.params.fields.matches(&change.namespace, &change.name) {
            return None;
        }
        let labels = &self.params.labels;
        if labels.is_empty() {
            return Some(change.event);
        }
        let now = labels.matches(&change.labels);
        let before = change
            .prev_labels
            .as_ref()
            .is_some_and(|l| labels.matches(l));
        match (change.event, before, now) {
            (EventType::Deleted, _, _) => now.then_some(EventType::Deleted),
            (EventType::Added, _, true) => Some(EventType::Added),
            (EventType::Modified, true, true) => Some(EventType::Modified),
            (EventType::Modified, false, true) => Some(EventType::Added),
            (EventType::Modified, true, false) => Some(EventType::Deleted),
            _ => None,
        }
    }
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({"type": kind, "object": object})).expect("events serialize");
    line.push(b'\n');
    Bytes::from(line)
}

fn error_event(e: &ApiError) -> Bytes {
    event_line("ERROR", &e.status())
}

pub async fn watch(
    state: &AppState,
    path: &ResourcePath,
    params: &Params,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let n = accept(headers, Target::Collection)?;
    let include = include_object(params)?;
    if params.send_initial_events.is_some()
        && params.resource_version_match.as_deref() != Some("NotOlderThan")
    {
        return Err(ApiError::invalid(
            path.resource,
            "",
            vec![("resourceVersionMatch".into(), "Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan".into(), "FieldValueForbidden")],
        ));
    }
    if params.send_initial_events == Some(true) && !params.allow_watch_bookmarks {
        return Err(ApiError::invalid(
            path.resource,
            "",
            vec![(
                "allowWatchBookmarks".into(),
                "Forbidden: sendInitialEvents requires allowWatchBookmarks=true".into(),
                "FieldValueForbidden",
            )],
        ));
    }
    if params.send_initial_events.is_none() && params.resource_version_match.is_some() {
        return Err(ApiError::bad_request(
            "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
        ));
    }
    let store = state.store.clone();
    let (current, compacted) = store.versions().await?;
    let requested: Option<i64> = match params.resource_version.as_deref() {
        None | Some("0") => None,
        Some(rv) => Some(rv.parse().map_err(|_| {
            ApiError::bad_request(format!("resourceVersion: invalid value {rv:?}"))
        })?),
    };
    // `None`: begin with the current state as synthetic ADDED events.
    let (start, initial_events_end) = match params.send_initial_events {
        // Streaming list: the state at least as new as `requested`, then the end bookmark.
        Some(true) => (None, true),
        Some(false) => (Some(requested.unwrap_or(current)), false),
        None => (requested, false),
    };
    let filter = Filter {
        resource_key: Store::resource_key(path.resource),
        namespace: path.namespace.clone(),
        params: params.clone(),
    };
    let timeout = params
        .timeout_seconds
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_TIMEOUT);
    let bookmarks = params.allow_watch_bookmarks;
    let bookmark_interval = state.options.bookmark_interval;
    let path = path.clone();
    let metrics = state.metrics.clone();

    // Subscribe before reading anything so nothing committed from here on can be missed.
    let (mut live, delivered) = store.feed().subscribe().await;
    let expired = start.is_some_and(|rv| rv < compacted);
    let stream = async_stream::stream! {
        let _watcher = metrics.watcher_started();
        if expired {
            let e = ApiError::gone(format!("too old resource version: {} ({})", start.unwrap_or_default(), compacted + 1));
            yield Ok::<Bytes, Infallible>(error_event(&e));
            return;
        }
        let render = |object: &Value| render_object(&path, n, include, object);
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        // Everything after `from` is to be delivered.
        let mut from = match start {
            Some(rv) => rv,
            None => {
                // Synthetic ADDED events for the current state. Each page is a consistent read,
                // but later pages are read at later versions than earlier ones; the catch-up
                // below brings every page to the last page's version, so the client's state at
                // the end is exactly the state at `newest`.
                let mut announced = Announced::default();
                let mut after = None;
                let mut snapshot = None;
                let mut newest;
                loop {
                    let query = ListQuery {
                        resource: path.resource,
                        namespace: path.namespace.clone(),
                        labels: filter.params.labels.clone(),
                        fields: filter.params.fields.clone(),
                        limit: Some(INITIAL_PAGE_SIZE),
                        after: after.clone(),
                        metadata_only: false,
                    };
                    let page = match store.list(&query).await {
                        Ok(p) => p,
                        Err(e) => { yield Ok(error_event(&ApiError::from(e))); return; }
                    };
                    snapshot.get_or_insert(page.resource_version);
                    newest = page.resource_version;
                    for row in &page.rows {
                        match crate::store::parse_document_public(&row.name, &row.body) {
                            Ok(object) => {
                                announced.record(&row.namespace, &row.name, row.resource_version);
                                yield Ok(event_line("ADDED", &render(&object)));
                            }
                            Err(e) => { yield Ok(error_event(&ApiError::from(e))); return; }
                        }
                    }
                    if !page.more { break; }
                    after = page.rows.last().map(|r| (r.namespace.clone(), r.name.clone()));
                }
                let snapshot = snapshot.unwrap_or(current);
                let mut at = snapshot;
                while at < newest {
                    let batch = match read_changes(&store, at, Some(newest), 1000).await {
                        Ok(b) => b,
                        Err(e) => { yield Ok(error_event(&ApiError::from(e))); return; }
                    };
                    if batch.is_empty() { break; }
                    for change in batch {
                        at = change.resource_version;
                        let event = filter.event_for(&change).and_then(|event| {
                            announced.reconcile(&change.namespace, &change.name, change.resource_version, event)
                        });
                        if let Some(event) = event {
                            yield Ok(event_line(event.as_str(), &render(&with_rv(&change))));
                        }
                    }
                }
                drop(announced);
                // A compaction racing the catch-up could have removed changes it needed.
                match store.versions().await {
                    Ok((_, compacted)) if compacted > snapshot => {
                        let e = ApiError::gone(format!("the change log was compacted past {snapshot} while the initial events were sent; watch again"));
                        yield Ok(error_event(&e));
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => { yield Ok(error_event(&ApiError::from(e))); return; }
                }
                if initial_events_end {
                    yield Ok(event_line("BOOKMARK", &bookmark_object(&path, n, newest, true)));
                }
                newest
            }
        };
        // Replay the change log between `from` and what the live feed will deliver.
        while from < delivered {
            let batch = match read_changes(&store, from, Some(delivered), 1000).await {
                Ok(b) => b,
                Err(e) => { yield Ok(error_event(&ApiError::from(e))); return; }
            };
            if batch.is_empty() { break; }
            for change in batch {
                from = change.resource_version;
                if let Some(event) = filter.event_for(&change) {
                    yield Ok(event_line(event.as_str(), &render(&with_rv(&change))));
                }
            }
        }
        from = from.max(delivered);
        let mut ticker = tokio::time::interval(bookmark_interval);
        ticker.tick().await;
        loop {
            tokio::select! {
                _ = &mut deadline => {
                    if bookmarks { yield Ok(event_line("BOOKMARK", &bookmark_object(&path, n, from, false))); }
                    return;
                }
                _ = ticker.tick(), if bookmarks => {
                    yield Ok(event_line("BOOKMARK", &bookmark_object(&path, n, from, false)));
                }
                received = live.recv() => match received {
                    Ok(change) => {
                        if change.resource_version <= from { continue; }
                        from = change.resource_version;
                        if let Some(event) = filter.event_for(&change) {
                            yield Ok(event_line(event.as_str(), &render(&with_rv(&change))));
                        }
                    }
                    Err(RecvError::Lagged(skipped)) => {
                        // Too slow: end the stream; the client resumes from its last event.
                        tracing::info!(skipped, "watcher fell behind the change feed and was cut off");
                        metrics.watcher_cut_off();
                        return;
                    }
                    Err(RecvError::Closed) => return,
                },
            }
        }
    };
    let mut response = (StatusCode::OK, Body::from_stream(stream)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_str(
            &super::negotiate::Negotiated {
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
    Ok(response)
}

fn with_rv(change: &Change) -> Value {
    let mut object = (*change.object).clone();
    object["metadata"]["resourceVersion"] = json!(change.resource_version.to_string());
    object
}

/// A BOOKMARK object in the watch's representation; `initial_events_end` marks the end of a
/// streaming list (`k8s.io/initial-events-end`).
fn bookmark_object(path: &ResourcePath, n: Negotiated, rv: i64, initial_events_end: bool) -> Value {
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
            json!({"apiVersion": path.resource.api_version(), "kind": path.resource.kind, "metadata": metadata})
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn announced(objects: &[(&str, i64)]) -> Announced {
        let mut a = Announced::default();
        for (name, rv) in objects {
            a.record("ns", name, *rv);
        }
        a
    }

    #[test]
    fn changes_a_page_already_showed_are_skipped() {
        // `b` sat on a page read at 12 and was modified at 11: the page showed that version.
        let mut a = announced(&[("a", 5), ("b", 11)]);
        assert_eq!(a.reconcile("ns", "b", 11, EventType::Modified), None);
        assert_eq!(a.reconcile("ns", "b", 9, EventType::Modified), None);
        assert_eq!(
            a.reconcile("ns", "b", 13, EventType::Modified),
            Some(EventType::Modified)
        );
    }

    #[test]
    fn later_changes_of_shown_objects_are_sent() {
        let mut a = announced(&[("a", 5)]);
        assert_eq!(
            a.reconcile("ns", "a", 7, EventType::Modified),
            Some(EventType::Modified)
        );
        assert_eq!(
            a.reconcile("ns", "a", 8, EventType::Deleted),
            Some(EventType::Deleted)
        );
        // Gone for the client now: a later deletion or modification starts from nothing.
        assert_eq!(a.reconcile("ns", "a", 9, EventType::Deleted), None);
        assert_eq!(
            a.reconcile("ns", "a", 10, EventType::Added),
            Some(EventType::Added)
        );
    }

    #[test]
    fn objects_gone_before_their_page_was_read_are_never_announced() {
        // Created and deleted after the first page, both before its own page was read.
        let mut a = announced(&[("a", 5)]);
        assert_eq!(
            a.reconcile("ns", "z", 6, EventType::Added),
            Some(EventType::Added)
        );
        assert_eq!(
            a.reconcile("ns", "z", 7, EventType::Deleted),
            Some(EventType::Deleted)
        );
        // Existed at the first page's version, deleted before its page was read.
        assert_eq!(a.reconcile("ns", "y", 8, EventType::Deleted), None);
    }

    #[test]
    fn first_change_of_an_unseen_object_is_added() {
        // Modified after the first page and again after its own page was read at 9.
        let mut a = announced(&[("a", 5), ("m", 8)]);
        assert_eq!(a.reconcile("ns", "m", 8, EventType::Modified), None);
        assert_eq!(
            a.reconcile("ns", "n", 10, EventType::Modified),
            Some(EventType::Added)
        );
        assert_eq!(
            a.reconcile("ns", "n", 11, EventType::Modified),
            Some(EventType::Modified)
        );
    }

    #[test]
    fn namespaces_are_part_of_the_identity() {
        let mut a = announced(&[("a", 5)]);
        assert_eq!(
            a.reconcile("other", "a", 6, EventType::Modified),
            Some(EventType::Added)
        );
    }
}
