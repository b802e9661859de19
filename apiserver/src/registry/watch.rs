//! Watches as a state machine ([`WatchMachine`]) over the store's change log and change feed;
//! the HTTP layer (`http/watch.rs`) only renders its events.
//!
//! The phases are, in order:
//!
//! * **initial pages** — without a start version, the current state as synthetic ADDED events,
//!   read page by page (each page consistent at its own, increasing, version);
//! * **catch-up** — the change log between the first and the last page's versions, so the
//!   client ends exactly at the last page's state (see [`Announced`]); then a check that no
//!   compaction removed what the catch-up needed, and the `initial-events-end` bookmark of a
//!   streaming list;
//! * **replay** — the change log between the start and what the live feed delivers;
//! * **live** — events from the feed, bookmarks on a timer, the end at the timeout.
//!
//! Each phase is a small function returning the events to send and the next phase; any error
//! is a [`RegistryError`] that ends the watch. The machine reads through [`WatchSource`], so its
//! transitions are tested without a database or a server.
//!
//! Start semantics follow kube-apiserver: without `resourceVersion` (or with `"0"`) the client
//! first gets a synthetic ADDED for every matching object, then live events; with `N` it gets
//! every event after N, replayed from the change log, or a 410 Expired when N is older than the
//! retained history. Label-selector watches turn "stopped matching" into DELETED and "started
//! matching" into ADDED. A watcher that falls more than the broadcast buffer behind is cut off;
//! its client resumes from the last resourceVersion it saw.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use reports_server_crds::ResourceDescriptor;
use serde_json::Value;
use tokio::time::{Interval, Sleep};

use super::list::watch_start;
use super::{Registry, RegistryError, ResourceRef};
use crate::selector::{FieldSelector, LabelSelector};
use crate::store::feed::{Subscription, read_changes};
use crate::store::ring::Lagged;
#[cfg(test)]
use crate::store::ring::Ring;
pub use crate::store::{Change, EventType};
use crate::store::{ListPage, ListQuery, Store, StoreError, parse_document_public};

/// What a watch asks for, from its query parameters.
#[derive(Clone, Debug, Default)]
pub struct WatchOptions {
    pub resource_version: Option<String>,
    pub send_initial_events: Option<bool>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    /// When the watch ends.
    pub timeout: Duration,
    /// How often a bookmark is sent; `None` when the client allows none.
    pub bookmarks: Option<Duration>,
}

impl Registry {
    /// A watch on the collection `path`. It has subscribed to the change feed before reading
    /// anything, so nothing committed from here on can be missed.
    pub async fn watch(
        &self,
        path: &ResourceRef,
        options: WatchOptions,
    ) -> Result<WatchMachine<Store>, RegistryError> {
        let store = self.store.clone();
        let (current, compacted) = store.versions().await?;
        let (start, initial_events_end) = watch_start(
            options.resource_version.as_deref(),
            options.send_initial_events,
            current,
        )?;
        let filter = Filter {
            resource_key: Store::resource_key(path.resource),
            namespace: path.namespace.clone(),
            labels: options.labels,
            fields: options.fields,
        };
        let bookmarks = options
            .bookmarks
            .map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every));
        let (feed, delivered) = store.feed().subscribe().await;
        let live = Live {
            feed,
            delivered,
            bookmarks,
            deadline: Box::pin(tokio::time::sleep(options.timeout)),
        };
        Ok(WatchMachine::new(
            store,
            filter,
            path.resource,
            start,
            compacted,
            initial_events_end,
            live,
        ))
    }
}

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

/// Which changes a watch sends.
struct Filter {
    resource_key: String,
    namespace: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
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
        if !self.fields.matches(&change.namespace, &change.name) {
            return None;
        }
        let labels = &self.labels;
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

/// What a watch reads: pages of the current state, the change log, and the compaction horizon.
pub trait WatchSource: Send + Sync + 'static {
    fn page(&self, query: &ListQuery) -> impl Future<Output = Result<ListPage, StoreError>> + Send;
    /// Changes after `after`, up to and including `up_to`, oldest first, at most `limit`.
    fn changes(
        &self,
        after: i64,
        up_to: i64,
        limit: u64,
    ) -> impl Future<Output = Result<Vec<Change>, StoreError>> + Send;
    /// The oldest resourceVersion the change log no longer holds.
    fn compacted(&self) -> impl Future<Output = Result<i64, StoreError>> + Send;
}

impl WatchSource for Store {
    async fn page(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.list(query).await
    }

    async fn changes(&self, after: i64, up_to: i64, limit: u64) -> Result<Vec<Change>, StoreError> {
        read_changes(self, after, Some(up_to), limit).await
    }

    async fn compacted(&self) -> Result<i64, StoreError> {
        Ok(self.versions().await?.1)
    }
}

/// Changes read per query in catch-up and replay.
const CHANGE_BATCH: u64 = 1000;

/// One event for the client, before rendering.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// An object read from the table (the initial state).
    Object(EventType, Value),
    /// A change from the log or the live feed, shared with every other watcher sending it.
    Change(EventType, Arc<Change>),
    Bookmark {
        resource_version: i64,
        initial_events_end: bool,
    },
}

/// What one step of the machine produced.
#[derive(Debug, PartialEq)]
pub enum Step {
    Events(Vec<Event>),
    /// The watch ended normally (timeout, server shutdown).
    End,
    /// The watcher fell this many changes behind the feed; the client resumes from its last
    /// event.
    CutOff(u64),
}

enum Phase {
    /// The start version is older than the change log: the watch ends with 410.
    Expired {
        start: i64,
        compacted: i64,
    },
    InitialPages {
        after: Option<(String, String)>,
        snapshot: Option<i64>,
        newest: i64,
        announced: Announced,
    },
    CatchUp {
        at: i64,
        snapshot: i64,
        newest: i64,
        announced: Announced,
    },
    /// The catch-up is done: check it was not raced by a compaction, then announce the end of
    /// the initial events if asked.
    InitialEnd {
        snapshot: i64,
        newest: i64,
    },
    Replay {
        from: i64,
    },
    Live {
        from: i64,
    },
    Done,
}

/// Where the live phase gets its changes and its timing.
pub struct Live {
    pub feed: Subscription,
    /// Highest version the feed had delivered when the watch subscribed: the replay ends here.
    pub delivered: i64,
    /// `Some` when the client allows bookmarks.
    pub bookmarks: Option<Interval>,
    pub deadline: Pin<Box<Sleep>>,
}

/// The state of one watch; see the module docs for the phases.
pub struct WatchMachine<S> {
    source: S,
    filter: Filter,
    resource: &'static ResourceDescriptor,
    initial_events_end: bool,
    live: Live,
    phase: Phase,
}

impl<S: WatchSource> WatchMachine<S> {
    /// A watch starting after `start` (`None`: with the current state), the change log kept
    /// from `compacted` on.
    fn new(
        source: S,
        filter: Filter,
        resource: &'static ResourceDescriptor,
        start: Option<i64>,
        compacted: i64,
        initial_events_end: bool,
        live: Live,
    ) -> Self {
        let phase = match start {
            Some(start) if start < compacted => Phase::Expired { start, compacted },
            Some(from) => Phase::Replay { from },
            None => Phase::InitialPages {
                after: None,
                snapshot: None,
                newest: 0,
                announced: Announced::default(),
            },
        };
        WatchMachine {
            source,
            filter,
            resource,
            initial_events_end,
            live,
            phase,
        }
    }

    /// Runs the current phase once.
    pub async fn step(&mut self) -> Result<Step, RegistryError> {
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        let (events, next) = match phase {
            Phase::Expired { start, compacted } => {
                return Err(RegistryError::gone(format!(
                    "too old resource version: {start} ({})",
                    compacted + 1
                )));
            }
            Phase::InitialPages {
                after,
                snapshot,
                newest,
                announced,
            } => {
                self.initial_page(after, snapshot, newest, announced)
                    .await?
            }
            Phase::CatchUp {
                at,
                snapshot,
                newest,
                announced,
            } => self.catch_up(at, snapshot, newest, announced).await?,
            Phase::InitialEnd { snapshot, newest } => self.initial_end(snapshot, newest).await?,
            Phase::Replay { from } => self.replay(from).await?,
            Phase::Live { from } => match self.live(from).await {
                LiveStep::Events(events, from) => (events, Phase::Live { from }),
                LiveStep::End(events) => (events, Phase::Done),
                LiveStep::CutOff(skipped) => return Ok(Step::CutOff(skipped)),
            },
            Phase::Done => return Ok(Step::End),
        };
        self.phase = next;
        Ok(Step::Events(events))
    }

    /// One page of the current state as ADDED events.
    async fn initial_page(
        &self,
        after: Option<(String, String)>,
        snapshot: Option<i64>,
        _newest: i64,
        mut announced: Announced,
    ) -> Result<(Vec<Event>, Phase), RegistryError> {
        let query = ListQuery {
            resource: self.resource,
            namespace: self.filter.namespace.clone(),
            labels: self.filter.labels.clone(),
            fields: self.filter.fields.clone(),
            limit: Some(INITIAL_PAGE_SIZE),
            after,
            metadata_only: false,
        };
        let page = self.source.page(&query).await?;
        let snapshot = snapshot.unwrap_or(page.resource_version);
        let newest = page.resource_version;
        let mut events = Vec::with_capacity(page.rows.len());
        for row in &page.rows {
            let object = parse_document_public(&row.name, &row.body)?;
            announced.record(&row.namespace, &row.name, row.resource_version);
            events.push(Event::Object(EventType::Added, object));
        }
        let next = if page.more {
            Phase::InitialPages {
                after: page
                    .rows
                    .last()
                    .map(|r| (r.namespace.clone(), r.name.clone())),
                snapshot: Some(snapshot),
                newest,
                announced,
            }
        } else {
            Phase::CatchUp {
                at: snapshot,
                snapshot,
                newest,
                announced,
            }
        };
        Ok((events, next))
    }

    /// One batch of the changes between the first and the last page's versions.
    async fn catch_up(
        &self,
        at: i64,
        snapshot: i64,
        newest: i64,
        mut announced: Announced,
    ) -> Result<(Vec<Event>, Phase), RegistryError> {
        let batch = if at < newest {
            self.source.changes(at, newest, CHANGE_BATCH).await?
        } else {
            Vec::new()
        };
        if batch.is_empty() {
            return Ok((Vec::new(), Phase::InitialEnd { snapshot, newest }));
        }
        let mut at = at;
        let mut events = Vec::new();
        for change in batch {
            at = change.resource_version;
            let event = self.filter.event_for(&change).and_then(|event| {
                announced.reconcile(
                    &change.namespace,
                    &change.name,
                    change.resource_version,
                    event,
                )
            });
            if let Some(event) = event {
                events.push(Event::Change(event, Arc::new(change)));
            }
        }
        Ok((
            events,
            Phase::CatchUp {
                at,
                snapshot,
                newest,
                announced,
            },
        ))
    }

    /// A compaction racing the catch-up could have removed changes it needed.
    async fn initial_end(
        &self,
        snapshot: i64,
        newest: i64,
    ) -> Result<(Vec<Event>, Phase), RegistryError> {
        if self.source.compacted().await? > snapshot {
            return Err(RegistryError::gone(format!(
                "the change log was compacted past {snapshot} while the initial events were sent; watch again"
            )));
        }
        let events = if self.initial_events_end {
            vec![Event::Bookmark {
                resource_version: newest,
                initial_events_end: true,
            }]
        } else {
            Vec::new()
        };
        Ok((events, Phase::Replay { from: newest }))
    }

    /// One batch of the change log between `from` and what the live feed will deliver.
    async fn replay(&self, from: i64) -> Result<(Vec<Event>, Phase), RegistryError> {
        let delivered = self.live.delivered;
        let batch = if from < delivered {
            self.source.changes(from, delivered, CHANGE_BATCH).await?
        } else {
            Vec::new()
        };
        if batch.is_empty() {
            return Ok((
                Vec::new(),
                Phase::Live {
                    from: from.max(delivered),
                },
            ));
        }
        let mut from = from;
        let mut events = Vec::new();
        for change in batch {
            from = change.resource_version;
            if let Some(event) = self.filter.event_for(&change) {
                events.push(Event::Change(event, Arc::new(change)));
            }
        }
        Ok((events, Phase::Replay { from }))
    }

    /// Waits for the next live change, bookmark tick or the deadline.
    async fn live(&mut self, from: i64) -> LiveStep {
        let bookmark = |from| Event::Bookmark {
            resource_version: from,
            initial_events_end: false,
        };
        let live = &mut self.live;
        tokio::select! {
            _ = &mut live.deadline => {
                LiveStep::End(if live.bookmarks.is_some() { vec![bookmark(from)] } else { Vec::new() })
            }
            _ = tick(&mut live.bookmarks) => LiveStep::Events(vec![bookmark(from)], from),
            received = live.feed.recv() => match received {
                Ok(change) if change.resource_version <= from => LiveStep::Events(Vec::new(), from),
                Ok(change) => {
                    let events = self
                        .filter
                        .event_for(&change)
                        .map(|event| Event::Change(event, change.clone()))
                        .into_iter()
                        .collect();
                    LiveStep::Events(events, change.resource_version)
                }
                Err(Lagged(skipped)) => LiveStep::CutOff(skipped),
            },
        }
    }
}

enum LiveStep {
    Events(Vec<Event>, i64),
    End(Vec<Event>),
    CutOff(u64),
}

/// The next bookmark tick, or never when bookmarks are off.
async fn tick(bookmarks: &mut Option<Interval>) {
    match bookmarks {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use reports_server_crds::catalog::POLICY_REPORT;
    use serde_json::json;

    use crate::selector::LabelSelector;
    use crate::store::ListRow;

    /// A change log and a table in memory; `compact_during_initial_events` moves the horizon
    /// as soon as a page is read, as a compaction racing the initial events would.
    #[derive(Default)]
    struct FakeSource {
        rows: Vec<ListRow>,
        page_version: i64,
        changes: Vec<Change>,
        compacted: Mutex<i64>,
        compact_during_initial_events: Option<i64>,
    }

    impl WatchSource for Arc<FakeSource> {
        async fn page(&self, _query: &ListQuery) -> Result<ListPage, StoreError> {
            if let Some(horizon) = self.compact_during_initial_events {
                *self.compacted.lock().unwrap() = horizon;
            }
            Ok(ListPage {
                rows: self.rows.clone(),
                resource_version: self.page_version,
                more: false,
            })
        }

        async fn changes(
            &self,
            after: i64,
            up_to: i64,
            limit: u64,
        ) -> Result<Vec<Change>, StoreError> {
            Ok(self
                .changes
                .iter()
                .filter(|c| c.resource_version > after && c.resource_version <= up_to)
                .take(limit as usize)
                .cloned()
                .collect())
        }

        async fn compacted(&self) -> Result<i64, StoreError> {
            Ok(*self.compacted.lock().unwrap())
        }
    }

    fn object(name: &str, rv: i64) -> Value {
        json!({"apiVersion": "wgpolicyk8s.io/v1alpha2", "kind": "PolicyReport",
            "metadata": {"name": name, "namespace": "ns", "resourceVersion": rv.to_string()}})
    }

    fn row(name: &str, rv: i64) -> ListRow {
        ListRow {
            id: rv,
            namespace: "ns".into(),
            name: name.into(),
            resource_version: rv,
            metadata: object(name, rv)["metadata"].to_string(),
            body: object(name, rv).to_string(),
            summary: [0; 5],
            scope_kind: None,
            scope_name: None,
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn change(
        name: &str,
        rv: i64,
        event: EventType,
        now: &[(&str, &str)],
        before: Option<&[(&str, &str)]>,
    ) -> Change {
        Change::new(
            rv,
            &Store::resource_key(&POLICY_REPORT),
            "ns",
            name,
            event,
            labels(now),
            before.map(labels),
            &object(name, rv),
            None,
        )
    }

    fn filter(selector: &str) -> Filter {
        Filter {
            resource_key: Store::resource_key(&POLICY_REPORT),
            namespace: Some("ns".into()),
            labels: LabelSelector::parse(selector).unwrap(),
            fields: FieldSelector::default(),
        }
    }

    /// A live phase on a feed buffer of 16 one-byte entries.
    fn live(delivered: i64, bookmarks: Option<Duration>) -> (Live, Arc<Ring<Change>>) {
        let sender = Ring::new(16);
        let feed = sender.subscribe();
        let live = Live {
            feed,
            delivered,
            bookmarks: bookmarks
                .map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every)),
            deadline: Box::pin(tokio::time::sleep(Duration::from_secs(3600))),
        };
        (live, sender)
    }

    fn names(events: &[Event]) -> Vec<(String, String)> {
        events
            .iter()
            .map(|e| match e {
                Event::Object(t, o) => (
                    t.as_str().to_owned(),
                    o["metadata"]["name"].as_str().unwrap().to_owned(),
                ),
                Event::Change(t, c) => (t.as_str().to_owned(), c.name.clone()),
                Event::Bookmark {
                    resource_version, ..
                } => ("BOOKMARK".to_owned(), resource_version.to_string()),
            })
            .collect()
    }

    /// Steps until the machine reaches the live phase (or ends), collecting every event.
    async fn until_live<S: WatchSource>(
        machine: &mut WatchMachine<S>,
    ) -> Result<Vec<Event>, RegistryError> {
        let mut all = Vec::new();
        while !matches!(machine.phase, Phase::Live { .. } | Phase::Done) {
            match machine.step().await? {
                Step::Events(events) => all.extend(events),
                other => panic!("unexpected {other:?}"),
            }
        }
        Ok(all)
    }

    #[tokio::test]
    async fn initial_pages_then_catch_up_then_replay_then_live() {
        let source = Arc::new(FakeSource {
            rows: vec![row("a", 3), row("b", 4)],
            page_version: 5,
            changes: vec![
                change("b", 6, EventType::Modified, &[], Some(&[])),
                change("c", 7, EventType::Added, &[], None),
            ],
            ..Default::default()
        });
        let (live, sender) = live(7, None);
        let mut machine =
            WatchMachine::new(source, filter(""), &POLICY_REPORT, None, 0, true, live);
        let events = until_live(&mut machine).await.unwrap();
        assert_eq!(
            names(&events),
            [
                ("ADDED".to_owned(), "a".to_owned()),
                ("ADDED".into(), "b".into()),
                ("BOOKMARK".into(), "5".into()),
                ("MODIFIED".into(), "b".into()),
                ("ADDED".into(), "c".into()),
            ]
        );
        // Live: an already-replayed version is skipped, a new one is sent.
        sender.push(
            Arc::new(change("c", 7, EventType::Modified, &[], Some(&[]))),
            1,
        );
        sender.push(
            Arc::new(change("c", 8, EventType::Modified, &[], Some(&[]))),
            1,
        );
        assert_eq!(machine.step().await.unwrap(), Step::Events(Vec::new()));
        let Step::Events(events) = machine.step().await.unwrap() else {
            panic!()
        };
        assert_eq!(names(&events), [("MODIFIED".to_owned(), "c".to_owned())]);
    }

    #[tokio::test]
    async fn a_compaction_racing_the_initial_events_ends_the_watch_with_410() {
        let source = Arc::new(FakeSource {
            rows: vec![row("a", 3)],
            page_version: 5,
            changes: vec![change("a", 6, EventType::Modified, &[], Some(&[]))],
            compact_during_initial_events: Some(6),
            ..Default::default()
        });
        let (live, _sender) = live(6, None);
        let mut machine =
            WatchMachine::new(source, filter(""), &POLICY_REPORT, None, 0, false, live);
        let e = until_live(&mut machine).await.unwrap_err();
        assert_eq!(e.reason(), "Expired");
        assert!(e.to_string().contains("compacted past 5"), "{e}");
    }

    #[tokio::test]
    async fn a_start_older_than_the_change_log_is_410() {
        let (live, _sender) = live(9, None);
        let mut machine = WatchMachine::new(
            Arc::new(FakeSource::default()),
            filter(""),
            &POLICY_REPORT,
            Some(3),
            5,
            false,
            live,
        );
        assert_eq!(machine.step().await.unwrap_err().reason(), "Expired");
    }

    #[tokio::test]
    async fn label_transitions_become_added_and_deleted() {
        let source = Arc::new(FakeSource {
            changes: vec![
                // Starts matching: ADDED; keeps matching: MODIFIED; stops: DELETED.
                change("x", 4, EventType::Modified, &[("team", "a")], Some(&[])),
                change(
                    "x",
                    5,
                    EventType::Modified,
                    &[("team", "a")],
                    Some(&[("team", "a")]),
                ),
                change(
                    "x",
                    6,
                    EventType::Modified,
                    &[("team", "b")],
                    Some(&[("team", "a")]),
                ),
                // Never matched: nothing.
                change("y", 7, EventType::Modified, &[("team", "b")], Some(&[])),
            ],
            ..Default::default()
        });
        let (live, _sender) = live(7, None);
        let mut machine = WatchMachine::new(
            source,
            filter("team=a"),
            &POLICY_REPORT,
            Some(3),
            0,
            false,
            live,
        );
        let events = until_live(&mut machine).await.unwrap();
        assert_eq!(
            names(&events),
            [
                ("ADDED".to_owned(), "x".to_owned()),
                ("MODIFIED".into(), "x".into()),
                ("DELETED".into(), "x".into()),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn bookmarks_come_on_the_interval_and_at_the_deadline() {
        let (mut live, _sender) = live(3, Some(Duration::from_secs(60)));
        live.deadline = Box::pin(tokio::time::sleep(Duration::from_secs(150)));
        let started = tokio::time::Instant::now();
        let mut machine = WatchMachine::new(
            Arc::new(FakeSource::default()),
            filter(""),
            &POLICY_REPORT,
            Some(3),
            0,
            false,
            live,
        );
        assert_eq!(until_live(&mut machine).await.unwrap(), []);
        let bookmark = Event::Bookmark {
            resource_version: 3,
            initial_events_end: false,
        };
        for expected in [60, 120] {
            assert_eq!(
                machine.step().await.unwrap(),
                Step::Events(vec![bookmark.clone()])
            );
            assert_eq!(started.elapsed(), Duration::from_secs(expected));
        }
        // The deadline: a last bookmark, then the end.
        assert_eq!(machine.step().await.unwrap(), Step::Events(vec![bookmark]));
        assert_eq!(started.elapsed(), Duration::from_secs(150));
        assert_eq!(machine.step().await.unwrap(), Step::End);
    }

    #[tokio::test]
    async fn a_watcher_that_falls_behind_is_cut_off() {
        let (live, sender) = live(3, None);
        let mut machine = WatchMachine::new(
            Arc::new(FakeSource::default()),
            filter(""),
            &POLICY_REPORT,
            Some(3),
            0,
            false,
            live,
        );
        until_live(&mut machine).await.unwrap();
        for rv in 4..30 {
            sender.push(
                Arc::new(change("x", rv, EventType::Modified, &[], Some(&[]))),
                1,
            );
        }
        assert!(matches!(machine.step().await.unwrap(), Step::CutOff(_)));
    }

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
