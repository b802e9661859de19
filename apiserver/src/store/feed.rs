//! The change feed: one task per process reads new change-log entries in resourceVersion order
//! and fans them out to watchers through a buffer of recent changes bounded by bytes
//! ([`super::ring`]).
//!
//! The database is the only source of truth. Local writes wake the feed directly; on PostgreSQL
//! writes from other processes wake it through `LISTEN reports_server_changes`; a poll interval
//! covers everything else (and lost notifications). A watcher that falls behind the buffer
//! (`--watch-buffer-bytes`) is cut off (its stream ends and the client resumes from its last resourceVersion):
//! a slow watcher never slows writers or other watchers.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use tracing::Instrument;

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Order, Query};
use sea_orm::{ConnectionTrait, DbBackend};
use serde_json::Value;
use tokio::sync::Notify;

use super::change_log::{BODY_IN_OBJECTS, object_row_of_change};
use super::columns::labels_of;
use super::ring::{Cursor, Ring};
use super::schema::{Changes, Objects};
use super::{Store, StoreError, parse_document};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "ADDED" => Some(EventType::Added),
            "MODIFIED" => Some(EventType::Modified),
            "DELETED" => Some(EventType::Deleted),
            _ => None,
        }
    }
}

/// One change-log entry, as the feed buffers it and watchers send it.
#[derive(Debug)]
pub struct Change {
    pub resource_version: i64,
    /// `<plural>.<group>`.
    pub resource: String,
    pub namespace: String,
    pub name: String,
    pub event: EventType,
    pub labels: std::collections::BTreeMap<String, String>,
    /// Labels before this change (`None` for creations).
    pub prev_labels: Option<std::collections::BTreeMap<String, String>>,
    /// The object with this change's resourceVersion, as JSON: serialized once and shared by
    /// every watcher that receives the whole object. The feed buffers these bytes, not a parsed
    /// object (a parsed 9 KB report takes several times its JSON in memory).
    json: bytes::Bytes,
    /// Other representations (Table rows, metadata only), each rendered by the first watcher
    /// that asks for it, under a key that names the representation.
    renderings: std::sync::Mutex<Vec<(String, bytes::Bytes)>>,
}

impl PartialEq for Change {
    fn eq(&self, other: &Self) -> bool {
        self.resource_version == other.resource_version
            && self.resource == other.resource
            && self.namespace == other.namespace
            && self.name == other.name
            && self.event == other.event
            && self.labels == other.labels
            && self.prev_labels == other.prev_labels
            && self.json == other.json
    }
}

impl Clone for Change {
    /// A copy sharing the JSON bytes; renderings are made again on demand.
    fn clone(&self) -> Self {
        Change {
            resource_version: self.resource_version,
            resource: self.resource.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            event: self.event,
            labels: self.labels.clone(),
            prev_labels: self.prev_labels.clone(),
            json: self.json.clone(),
            renderings: Default::default(),
        }
    }
}

/// Bytes a buffered change holds besides its JSON (names, labels, bookkeeping), for the
/// buffer's bound: an estimate, the JSON dominates.
const CHANGE_OVERHEAD_BYTES: usize = 256;

impl Change {
    /// An entry from its parts; `object` is the object as written, `json` the same object
    /// already serialized with `resource_version` (serialized here when `None`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        resource_version: i64,
        resource: &str,
        namespace: &str,
        name: &str,
        event: EventType,
        labels: std::collections::BTreeMap<String, String>,
        prev_labels: Option<std::collections::BTreeMap<String, String>>,
        object: &Value,
        json: Option<bytes::Bytes>,
    ) -> Change {
        Change {
            resource_version,
            resource: resource.to_owned(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            event,
            labels,
            prev_labels,
            json: json.unwrap_or_else(|| json_with_version(object, resource_version)),
            renderings: Default::default(),
        }
    }

    /// The entry of a write this process has just committed, built from what it wrote (the
    /// same fields `Store::change_values` stores). `previous` is the object before the write,
    /// `None` for a creation; `json` as in [`Change::new`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn committed(
        resource_version: i64,
        resource: &str,
        namespace: &str,
        name: &str,
        event: EventType,
        object: &Value,
        previous: Option<&Value>,
        json: Option<bytes::Bytes>,
    ) -> Change {
        Change::new(
            resource_version,
            resource,
            namespace,
            name,
            event,
            labels_of(object),
            previous.map(labels_of),
            object,
            json,
        )
    }

    /// The object as it is sent, parsed again from [`Change::object_json`].
    pub fn object(&self) -> Value {
        serde_json::from_slice(&self.json).expect("the feed's own JSON parses")
    }

    /// The object with this change's resourceVersion, as JSON.
    pub fn object_json(&self) -> &bytes::Bytes {
        &self.json
    }

    /// The representation named `key` (the same key must always mean the same rendering),
    /// made by `render` from the object the first time and shared afterwards, so that many
    /// watchers of one representation cost one rendering per change.
    pub fn rendered(&self, key: &str, render: impl FnOnce(Value) -> bytes::Bytes) -> bytes::Bytes {
        if let Some((_, done)) = self
            .renderings
            .lock()
            .expect("renderings lock")
            .iter()
            .find(|(k, _)| k == key)
        {
            return done.clone();
        }
        // Rendered outside the lock; two watchers racing both render and the first one stays.
        let made = render(self.object());
        let mut renderings = self.renderings.lock().expect("renderings lock");
        if let Some((_, done)) = renderings.iter().find(|(k, _)| k == key) {
            return done.clone();
        }
        renderings.push((key.to_owned(), made.clone()));
        made
    }

    /// What the feed's buffer counts for this entry.
    fn buffered_bytes(&self) -> usize {
        self.json.len() + CHANGE_OVERHEAD_BYTES
    }
}

/// `object` as JSON with `metadata.resourceVersion` = `rv`.
fn json_with_version(object: &Value, rv: i64) -> bytes::Bytes {
    let rv = rv.to_string();
    if object["metadata"]["resourceVersion"].as_str() == Some(rv.as_str()) {
        return bytes::Bytes::from(serde_json::to_vec(object).expect("objects serialize"));
    }
    let mut object = object.clone();
    object["metadata"]["resourceVersion"] = Value::String(rv);
    bytes::Bytes::from(serde_json::to_vec(&object).expect("objects serialize"))
}

/// A stored body as the JSON of the change `rv`: the stored text itself when it already carries
/// that resourceVersion (every body this server writes does), else re-serialized with it.
fn stored_json(what: &str, body: String, rv: i64) -> Result<bytes::Bytes, StoreError> {
    #[derive(serde::Deserialize)]
    struct Versioned {
        metadata: VersionedMeta,
    }
    #[derive(serde::Deserialize)]
    struct VersionedMeta {
        #[serde(rename = "resourceVersion")]
        resource_version: Option<String>,
    }
    // Reads only the one field (the rest is skipped without building values).
    let carried = serde_json::from_str::<Versioned>(&body)
        .ok()
        .and_then(|v| v.metadata.resource_version);
    if carried.is_some_and(|v| v == rv.to_string()) {
        return Ok(bytes::Bytes::from(body));
    }
    Ok(json_with_version(&parse_document(what, &body)?, rv))
}

/// Default bound of the change feed's buffer ([`StoreOptions::watch_buffer_bytes`]).
pub const DEFAULT_WATCH_BUFFER_BYTES: usize = 64 * 1024 * 1024;
/// Entries read per query while catching up.
const BATCH: u64 = 1_000;

#[derive(Clone)]
pub struct ChangeFeed {
    inner: Arc<FeedInner>,
}

struct FeedInner {
    buffer: Arc<Ring<Change>>,
    /// What the buffer holds, for `/metrics` (set by the buffer after every change).
    buffered_bytes: Gauge,
    buffered_changes: Gauge,
    wake: Notify,
    /// Highest resourceVersion broadcast so far.
    delivered: AtomicI64,
    /// Highest resourceVersion this process has committed or is committing in a group commit
    /// round, whose leader publishes it (or wakes the feed when it cannot).
    committing: AtomicI64,
    /// Held while broadcasting and while a watcher subscribes, so a watcher knows exactly which
    /// entries it will receive live and which it must read from the log.
    gate: tokio::sync::Mutex<()>,
}

impl Default for ChangeFeed {
    fn default() -> Self {
        Self::new(DEFAULT_WATCH_BUFFER_BYTES)
    }
}

/// A subscriber's view of the feed: the changes after its subscription, in order.
pub type Subscription = Cursor<Change>;

impl ChangeFeed {
    /// A feed whose buffer of recent changes holds at most `buffer_bytes` of their JSON; a
    /// watcher further behind is cut off and resumes from the change log.
    pub fn new(buffer_bytes: usize) -> Self {
        let (buffered_bytes, buffered_changes) = (Gauge::default(), Gauge::default());
        let buffer = {
            let (bytes, changes) = (buffered_bytes.clone(), buffered_changes.clone());
            Ring::observed(buffer_bytes, move |held| {
                bytes.set(held.bytes as i64);
                changes.set(held.entries as i64);
            })
        };
        ChangeFeed {
            inner: Arc::new(FeedInner {
                buffer,
                buffered_bytes,
                buffered_changes,
                wake: Notify::new(),
                delivered: AtomicI64::new(0),
                committing: AtomicI64::new(0),
                gate: Default::default(),
            }),
        }
    }

    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "reports_server_watch_buffer_bytes",
            "Bytes of recent changes the change feed buffers for live watchers (bounded by --watch-buffer-bytes)",
            self.inner.buffered_bytes.clone(),
        );
        registry.register(
            "reports_server_watch_buffer_changes",
            "Changes the change feed buffers for live watchers",
            self.inner.buffered_changes.clone(),
        );
    }

    /// Asks the feed to look for new entries now.
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// Subscribes to live changes. Returns the receiver and the highest resourceVersion already
    /// broadcast: everything after it arrives on the receiver, everything up to it must be read
    /// from the change log.
    pub async fn subscribe(&self) -> (Subscription, i64) {
        let _gate = self.inner.gate.lock().await;
        (
            self.inner.buffer.subscribe(),
            self.inner.delivered.load(Ordering::SeqCst),
        )
    }

    /// Broadcasts entries this process has just committed without reading them back, when
    /// they directly follow what was delivered (`after` is the version before the first one);
    /// otherwise another process's entries come first and the poller delivers them all in
    /// order. Returns whether it broadcast them. This is how a local write's event reaches the
    /// watchers before its writer's response is sent.
    pub(super) async fn publish_committed(&self, after: i64, changes: Vec<Change>) -> bool {
        let _gate = self.inner.gate.lock().await;
        if self.delivered() != after {
            return false;
        }
        for change in changes {
            self.push(change);
        }
        true
    }

    /// Buffers one change for the subscribers; called under the gate, in resourceVersion order.
    fn push(&self, change: Change) {
        self.inner
            .delivered
            .store(change.resource_version, Ordering::SeqCst);
        let bytes = change.buffered_bytes();
        self.inner.buffer.push(Arc::new(change), bytes);
    }

    /// A group commit round of this process is about to commit up to `rv`; its leader
    /// publishes the changes after the commit, or wakes the feed when it cannot.
    pub(super) fn committing(&self, rv: i64) {
        self.inner.committing.fetch_max(rv, Ordering::SeqCst);
    }

    /// Whether a commit notification (its payload is the committed round's last
    /// resourceVersion) may announce changes nobody here will publish. This process's own
    /// rounds are published by their leaders, often just after their notification arrives;
    /// reading the change log for each of them cost PostgreSQL an empty `SELECT` per round.
    /// A payload that is not a version wakes the feed, as does any version past both marks.
    /// A skipped notification from another replica loses nothing: a round of ours publishes
    /// only right after what is delivered, and wakes the feed otherwise.
    fn announces_news(&self, payload: &str) -> bool {
        let known = std::cmp::max(
            self.delivered(),
            self.inner.committing.load(Ordering::SeqCst),
        );
        payload.parse::<i64>().map_or(true, |rv| rv > known)
    }

    /// Highest resourceVersion broadcast so far.
    pub fn delivered(&self) -> i64 {
        self.inner.delivered.load(Ordering::SeqCst)
    }

    pub(super) async fn start(&self, store: Store) -> Result<(), StoreError> {
        let (current, _) = store.versions().await?;
        self.inner.delivered.store(current, Ordering::SeqCst);
        if store.backend() == DbBackend::Postgres {
            spawn_pg_listener(store.clone(), self.clone());
        }
        let feed = self.clone();
        tokio::spawn(
            async move { feed.run(store).await }.instrument(tracing::info_span!("change_feed")),
        );
        Ok(())
    }

    async fn run(self, store: Store) {
        let poll = store.options().poll_interval;
        let mut last_compaction = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = self.inner.wake.notified() => {}
                _ = tokio::time::sleep(poll) => {}
            }
            // During an outage the health probe logs it once; the feed retries quietly and
            // its watchers stay open (bookmarks keep flowing) until the log can be read again.
            // A read caught by an outage on a half-open connection would stall every watch of
            // this process until TCP gives up; it is abandoned and read again.
            if let Err(e) = store.unless_outage(self.catch_up(&store)).await {
                if store.health().is_up() {
                    tracing::warn!(error = %e, "change feed could not read the change log; retrying");
                }
                tokio::time::sleep(poll).await;
            }
            if last_compaction.elapsed() >= store.options().compaction_interval
                && store.health().is_up()
            {
                last_compaction = tokio::time::Instant::now();
                if let Err(e) = store
                    .compact()
                    .instrument(tracing::info_span!("compaction"))
                    .await
                {
                    tracing::warn!(error = %e, "change-log compaction failed");
                }
            }
        }
    }

    async fn catch_up(&self, store: &Store) -> Result<(), StoreError> {
        loop {
            let from = self.delivered();
            let changes = read_changes(store, from, None, BATCH).await?;
            if changes.is_empty() {
                return Ok(());
            }
            let full = changes.len() as u64 == BATCH;
            let _gate = self.inner.gate.lock().await;
            for change in changes {
                // Published by the writer while this read ran.
                if change.resource_version <= self.delivered() {
                    continue;
                }
                self.push(change);
            }
            if !full {
                return Ok(());
            }
        }
    }
}

/// The PostgreSQL channel on which a write transaction announces its commit to other replicas.
pub(super) const NOTIFY_CHANNEL: &str = "reports_server_changes";

/// Reads change-log entries with `after < rv <= up_to`, in order.
pub async fn read_changes(
    store: &Store,
    after: i64,
    up_to: Option<i64>,
    limit: u64,
) -> Result<Vec<Change>, StoreError> {
    // The entry of an object's current version keeps its body in the `objects` row (see
    // `write`): the join finds that row at exactly this version.
    let mut q = Query::select();
    q.columns(
        [
            Changes::Rv,
            Changes::Resource,
            Changes::Namespace,
            Changes::Name,
            Changes::EventType,
            Changes::Labels,
            Changes::PrevLabels,
        ]
        .map(|c| (Changes::Table, c)),
    )
    .expr_as(
        Expr::case(
            Expr::col((Changes::Table, Changes::Body)).eq(BODY_IN_OBJECTS),
            Expr::col((Objects::Table, Objects::Body)),
        )
        .finally(Expr::col((Changes::Table, Changes::Body))),
        Alias::new("body"),
    )
    .from(Changes::Table)
    .left_join(Objects::Table, object_row_of_change())
    .and_where(Expr::col((Changes::Table, Changes::ClusterId)).eq(store.cluster_id()))
    .and_where(Expr::col((Changes::Table, Changes::Rv)).gt(after))
    .order_by((Changes::Table, Changes::Rv), Order::Asc)
    .limit(limit);
    if let Some(up_to) = up_to {
        q.and_where(Expr::col((Changes::Table, Changes::Rv)).lte(up_to));
    }
    let rows = store.connection().query_all(&q).await?;
    rows.iter()
        .map(|r| {
            let rv: i64 = r.try_get("", "rv")?;
            let event: String = r.try_get("", "event_type")?;
            let labels: String = r.try_get("", "labels")?;
            // Both copies gone would be a broken invariant of `write`, not a race: the entry
            // and the row change in one transaction and this is one statement.
            let body = store
                .bodies()
                .decode_column(r, "body", || format!("change {rv}"))?;
            let body = body.ok_or_else(|| {
                StoreError::Corrupt(
                    format!("change {rv}"),
                    "its body is neither in the change log nor in the object's row".into(),
                )
            })?;
            let prev_labels: String = r.try_get("", "prev_labels")?;
            Ok(Change {
                resource_version: rv,
                resource: r.try_get("", "resource")?,
                namespace: r.try_get("", "namespace")?,
                name: r.try_get("", "name")?,
                event: EventType::parse(&event)
                    .ok_or_else(|| StoreError::Corrupt(format!("change {rv}"), event.clone()))?,
                labels: serde_json::from_str(&labels).map_err(|e| {
                    StoreError::Corrupt(format!("change {rv} labels"), e.to_string())
                })?,
                prev_labels: serde_json::from_str(&prev_labels).map_err(|e| {
                    StoreError::Corrupt(format!("change {rv} previous labels"), e.to_string())
                })?,
                json: stored_json(&format!("change {rv}"), body, rv)?,
                renderings: Default::default(),
            })
        })
        .collect()
}

fn spawn_pg_listener(store: Store, feed: ChangeFeed) {
    let span = tracing::info_span!("pg_listener");
    tokio::spawn(async move {
        loop {
            // A LISTEN connection opened to a database that then went away or turned read-only
            // (a demoted primary) would wait for notifications that never come: it is dropped
            // when the circuit opens and opened again once the database is writable.
            store.health().came_up().await;
            let pool = store.connection().get_postgres_connection_pool().clone();
            match sqlx::postgres::PgListener::connect_with(&pool).await {
                Ok(mut listener) => {
                    if let Err(e) = listener.listen(NOTIFY_CHANNEL).await {
                        tracing::warn!(error = %e, "LISTEN failed; relying on polling");
                    } else {
                        // Anything committed while we were not listening is picked up here.
                        feed.wake();
                        loop {
                            let note = tokio::select! {
                                note = listener.recv() => note,
                                () = store.health().went_down() => break,
                            };
                            match note {
                                Ok(note) if !feed.announces_news(note.payload()) => {}
                                Ok(_) => feed.wake(),
                                Err(e) => {
                                    tracing::warn!(error = %e, "LISTEN connection lost; reconnecting");
                                    break;
                                }
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open a LISTEN connection; relying on polling")
                }
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    }
    .instrument(span));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_notification_ahead_of_the_feed_wakes_it() {
        let feed = ChangeFeed::default();
        feed.inner.delivered.store(10, Ordering::SeqCst);
        assert!(!feed.announces_news("9"));
        assert!(
            !feed.announces_news("10"),
            "this process published it already"
        );
        assert!(feed.announces_news("11"), "another replica's commit");
        assert!(feed.announces_news(""), "not a version: look anyway");
        feed.committing(12);
        assert!(
            !feed.announces_news("12"),
            "this process's round publishes it"
        );
        assert!(feed.announces_news("13"));
    }
}
