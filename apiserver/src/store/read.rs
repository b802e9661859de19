//! Reads: get, list (label and field selectors and keyset pagination in SQL) and versions.
//!
//! A list page is read as a stream: a task owns the read transaction and hands the rows over in
//! batches as the database delivers them, so a response can go out while the page is still
//! being read, and the connection returns to the pool at the database's pace, not at a slow
//! client's — up to [`StoreOptions::list_read_ahead_bytes`](super::StoreOptions) of rows the
//! client has yet to take. Beyond that (a list without `limit` to a slow client) the task waits
//! for the client rather than hold every body in memory.

use std::sync::Arc;

use futures::{FutureExt, StreamExt};
use reports_server_crds::ResourceDescriptor;
use sea_orm::sea_query::{Alias, Cond, Expr, ExprTrait, Order, Query, SelectStatement};
use sea_orm::{
    AccessMode, ConnectionTrait, DatabaseTransaction, DbBackend, IsolationLevel, QueryResult,
    Statement, StreamTrait, TransactionTrait,
};
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tracing::Instrument;

use super::body::BodyCodec;
use super::schema::{ObjectLabels, Objects, StoreState};
use super::{Store, StoreError, parse_document};
use crate::selector::{Field, FieldSelector, LabelSelector, Requirement};

/// One object as a list returns it: the body stays a string unless the caller needs it.
///
/// A list reads either the body (object lists) or what metadata-only and Table responses
/// render (`metadata`, the summary, the scope); the fields of the other kind stay empty.
#[derive(Clone, Debug, Default)]
pub struct ListRow {
    pub id: i64,
    pub namespace: String,
    pub name: String,
    pub resource_version: i64,
    /// `metadata` as JSON text; empty unless the query asked for metadata only.
    pub metadata: String,
    /// The whole object as JSON text; empty when the query asked for metadata only.
    pub body: String,
    pub summary: [i64; 5],
    pub scope_kind: Option<String>,
    pub scope_name: Option<String>,
}

/// A list request after parsing and validation.
#[derive(Clone, Debug)]
pub struct ListQuery {
    pub resource: &'static ResourceDescriptor,
    /// `None` lists across all namespaces.
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    /// Maximum number of rows; `None` for all.
    pub limit: Option<u64>,
    /// Return rows strictly after this (namespace, name).
    pub after: Option<(String, String)>,
    /// Skip the body column (metadata-only and table responses).
    pub metadata_only: bool,
}

impl ListQuery {
    /// Every object of `resource` in all namespaces, bodies included, in one page; narrow it
    /// with struct update syntax (`ListQuery { limit: Some(10), ..ListQuery::all(r) }`).
    pub fn all(resource: &'static ResourceDescriptor) -> Self {
        ListQuery {
            resource,
            namespace: None,
            labels: LabelSelector::default(),
            fields: FieldSelector::default(),
            limit: None,
            after: None,
            metadata_only: false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct ListPage {
    pub rows: Vec<ListRow>,
    /// The resourceVersion the page is consistent with.
    pub resource_version: i64,
    /// Whether more rows follow the last one.
    pub more: bool,
}

impl ListRow {
    /// What the row holds in memory, about: what counts against a list's read-ahead.
    fn bytes(&self) -> usize {
        const FIXED: usize = std::mem::size_of::<ListRow>();
        FIXED
            + self.namespace.len()
            + self.name.len()
            + self.metadata.len()
            + self.body.len()
            + self.scope_kind.as_ref().map_or(0, String::len)
            + self.scope_name.as_ref().map_or(0, String::len)
    }
}

/// Rows go over to the reader in batches of about this many bytes: one hand-off between tasks
/// for a few rows rather than one per row.
const LIST_BATCH_BYTES: usize = 64 * 1024;

/// Rows handed over together, holding their bytes of the list's read-ahead until the reader has
/// taken the last of them.
struct Batch {
    rows: std::vec::IntoIter<ListRow>,
    _read_ahead: Option<OwnedSemaphorePermit>,
}

/// What the reading task hands over.
enum Delivery {
    /// Never empty: the reader takes an empty batch for a page that came up short.
    Rows(Batch),
    /// Every row of the page was delivered.
    End,
    Failed(StoreError),
}

/// A page's read, handed to the task that performs it.
struct Read {
    txn: DatabaseTransaction,
    statement: SelectStatement,
    bodies: Option<BodyCodec>,
    hand_over: HandOver,
}

/// How the reading task passes batches to the reader.
struct HandOver {
    /// Bytes of rows read but not yet taken by the reader, at most (the channel is unbounded:
    /// this bounds it). Closed when the reader goes away.
    read_ahead: Arc<Semaphore>,
    read_ahead_bytes: usize,
    /// How long the read waits for its reader to take rows before it ends: a waiting read holds
    /// a pooled connection and a snapshot, which a client that stopped reading must not keep.
    stall_timeout: std::time::Duration,
    deliver: mpsc::UnboundedSender<Delivery>,
}

impl HandOver {
    /// Sends `rows` (`bytes` of them) once the read-ahead has room; `false` when the reader is
    /// gone, an error when it took nothing for `stall_timeout`.
    async fn send(&self, rows: Vec<ListRow>, bytes: usize) -> Result<bool, StoreError> {
        // A batch larger than the whole read-ahead waits until nothing else is held; the clamp
        // in `Store::list_stream` keeps the budget within u32.
        let bytes = u32::try_from(bytes.min(self.read_ahead_bytes)).expect("a u32 budget");
        let wait = self.read_ahead.clone().acquire_many_owned(bytes);
        let held = match tokio::time::timeout(self.stall_timeout, wait).await {
            Ok(Ok(held)) => held,
            Ok(Err(_closed)) => return Ok(false),
            Err(_elapsed) => return Err(StoreError::ReaderStalled(self.stall_timeout)),
        };
        let batch = Batch {
            rows: rows.into_iter(),
            _read_ahead: Some(held),
        };
        Ok(self.deliver.send(Delivery::Rows(batch)).is_ok())
    }
}

/// A list page as the database delivers it (see [`Store::list_stream`]).
pub struct ListStream {
    resource_version: i64,
    compacted: i64,
    /// The read, until the first [`ListStream::next_row`] starts it: a caller that rejects
    /// the request on the snapshot's versions reads no rows.
    unstarted: Option<Read>,
    deliveries: mpsc::UnboundedReceiver<Delivery>,
    /// The batch rows are being taken from.
    batch: Option<Batch>,
    /// The read's budget, closed on drop: a read waiting for room stops at once rather than
    /// wait on a batch stranded in the closed channel.
    read_ahead: Arc<Semaphore>,
    limit: Option<u64>,
    delivered: u64,
    /// The key of the row that filled the limit: where the next page starts, if one follows.
    limit_key: Option<(String, String)>,
    more: bool,
    finished: bool,
}

impl Drop for ListStream {
    fn drop(&mut self) {
        self.read_ahead.close();
    }
}

impl ListStream {
    /// The resourceVersion the page is consistent with.
    pub fn resource_version(&self) -> i64 {
        self.resource_version
    }

    /// The watch horizon in the same snapshot.
    pub fn compacted(&self) -> i64 {
        self.compacted
    }

    /// The next row of the page; `None` once the page is complete. An error ends the page.
    pub async fn next_row(&mut self) -> Option<Result<ListRow, StoreError>> {
        if self.finished {
            return None;
        }
        if let Some(read) = self.unstarted.take() {
            tokio::spawn(read_rows(read).instrument(tracing::debug_span!("list_read")));
        }
        let (next, finished) = match self.next_delivered().await {
            // The query asks for one row past the limit to learn whether another page follows.
            Some(Ok(_)) if self.limit == Some(self.delivered) => {
                self.more = true;
                (None, true)
            }
            Some(Ok(row)) => {
                self.delivered += 1;
                if self.limit == Some(self.delivered) {
                    self.limit_key = Some((row.namespace.clone(), row.name.clone()));
                }
                (Some(Ok(row)), false)
            }
            Some(Err(e)) => (Some(Err(e)), true),
            None => (None, true),
        };
        self.finished = finished;
        if finished {
            self.batch = None;
        }
        next
    }

    /// The next row the reading task delivered, its failure, or `None` at the end.
    async fn next_delivered(&mut self) -> Option<Result<ListRow, StoreError>> {
        if self.batch.is_none() {
            self.batch = match self.deliveries.recv().await {
                Some(Delivery::Rows(batch)) => Some(batch),
                Some(Delivery::End) => return None,
                Some(Delivery::Failed(e)) => return Some(Err(e)),
                // Only a panic in the reading task closes the channel without a last word; a
                // page that silently came up short would look complete to the client.
                None => return Some(Err(stopped_short())),
            };
        }
        let batch = self.batch.as_mut()?;
        let row = batch.rows.next();
        if batch.rows.len() == 0 {
            // Its rows are taken: its bytes no longer count against the read-ahead, even while
            // the caller waits on its own client.
            self.batch = None;
        }
        Some(row.ok_or_else(stopped_short))
    }

    /// Whether another page follows; known once [`ListStream::next_row`] returned `None`.
    pub fn more(&self) -> bool {
        self.more
    }

    /// The (namespace, name) the next page starts after, when another page follows; known once
    /// [`ListStream::next_row`] returned `None`.
    pub fn next_page_after(&self) -> Option<&(String, String)> {
        self.limit_key.as_ref().filter(|_| self.more)
    }

    /// A page that delivers `rows`, then `failure` (or its end when there is none), at
    /// resourceVersion 7: for tests of what reads a page.
    #[cfg(test)]
    pub(crate) fn scripted(rows: Vec<ListRow>, failure: Option<StoreError>) -> ListStream {
        let (deliver, deliveries) = mpsc::unbounded_channel();
        if !rows.is_empty() {
            let batch = Batch {
                rows: rows.into_iter(),
                _read_ahead: None,
            };
            deliver.send(Delivery::Rows(batch)).expect("open channel");
        }
        let last = failure.map_or(Delivery::End, Delivery::Failed);
        deliver.send(last).expect("open channel");
        ListStream {
            resource_version: 7,
            compacted: 1,
            unstarted: None,
            deliveries,
            batch: None,
            read_ahead: Arc::new(Semaphore::new(1)),
            limit: None,
            delivered: 0,
            limit_key: None,
            more: false,
            finished: false,
        }
    }

    /// The whole page in memory.
    pub async fn collect(mut self) -> Result<ListPage, StoreError> {
        let mut rows = Vec::new();
        while let Some(row) = self.next_row().await {
            rows.push(row?);
        }
        Ok(ListPage {
            rows,
            resource_version: self.resource_version,
            more: self.more,
        })
    }
}

pub(super) async fn versions(
    db: &impl ConnectionTrait,
    backend: DbBackend,
    cluster_id: &str,
) -> Result<(i64, i64), StoreError> {
    let row = db
        .query_one(
            &Query::select()
                .columns([StoreState::Rv, StoreState::CompactedRv])
                .from(StoreState::Table)
                .and_where(Expr::col(StoreState::ClusterId).eq(cluster_id))
                .to_owned(),
        )
        .await?
        .ok_or_else(|| no_state_row(cluster_id, backend))?;
    Ok((row.try_get("", "rv")?, row.try_get("", "compacted_rv")?))
}

/// The resourceVersion counter's row is missing (`Store::connect` creates it).
pub(super) fn no_state_row(cluster_id: &str, backend: DbBackend) -> StoreError {
    StoreError::Inconsistent(format!(
        "store_state has no row for cluster {cluster_id} ({backend:?})"
    ))
}

/// Every list reads these.
const KEY_COLUMNS: [Objects; 4] = [
    Objects::Id,
    Objects::Namespace,
    Objects::Name,
    Objects::ResourceVersion,
];

/// What metadata-only and Table lists render instead of the body.
const METADATA_COLUMNS: [Objects; 8] = [
    Objects::Metadata,
    Objects::SummaryPass,
    Objects::SummaryFail,
    Objects::SummaryWarn,
    Objects::SummaryError,
    Objects::SummarySkip,
    Objects::ScopeKind,
    Objects::ScopeName,
];

/// A row of [`Store::select_objects`]: the body, decoded with `bodies`, when there is one;
/// the metadata columns otherwise.
fn row_of(row: &QueryResult, bodies: Option<BodyCodec>) -> Result<ListRow, StoreError> {
    let namespace: String = row.try_get("", "namespace")?;
    let name: String = row.try_get("", "name")?;
    let key = ListRow {
        id: row.try_get("", "id")?,
        resource_version: row.try_get("", "resource_version")?,
        ..ListRow::default()
    };
    Ok(match bodies {
        Some(codec) => ListRow {
            body: codec.decode_required(row, "body", || format!("{namespace}/{name}"))?,
            namespace,
            name,
            ..key
        },
        None => ListRow {
            namespace,
            name,
            metadata: row.try_get("", "metadata")?,
            summary: [
                row.try_get("", "summary_pass")?,
                row.try_get("", "summary_fail")?,
                row.try_get("", "summary_warn")?,
                row.try_get("", "summary_error")?,
                row.try_get("", "summary_skip")?,
            ],
            scope_kind: row.try_get("", "scope_kind")?,
            scope_name: row.try_get("", "scope_name")?,
            ..key
        },
    })
}

/// The reader found the channel closed, or an empty batch, before the page's last word.
fn stopped_short() -> StoreError {
    StoreError::Inconsistent("the list's read stopped before the end of the page".into())
}

/// Reads the rows into batches, then a last [`Delivery`]. Stops early when the reader is gone.
async fn read_rows(
    Read {
        txn,
        statement,
        bodies,
        hand_over,
    }: Read,
) {
    let outcome: Result<(), StoreError> = async {
        let mut rows = txn.stream(&statement).await?;
        let (mut batch, mut bytes) = (Vec::new(), 0);
        let mut ready = None;
        loop {
            let next = match ready.take() {
                Some(next) => next,
                None => rows.next().await,
            };
            let Some(row) = next else { break };
            let row = row_of(&row?, bodies)?;
            bytes += row.bytes();
            batch.push(row);
            // A batch goes when full, or when the database has no row ready: a selective
            // query's matches go out as they are found, not once 64 KiB of them are.
            if bytes < LIST_BATCH_BYTES {
                ready = rows.next().now_or_never();
                if ready.is_some() {
                    continue;
                }
            }
            let (full, size) = (std::mem::take(&mut batch), std::mem::take(&mut bytes));
            if !hand_over.send(full, size).await? {
                return Ok(());
            }
        }
        if !batch.is_empty() {
            hand_over.send(batch, bytes).await?;
        }
        Ok(())
    }
    .await;
    match outcome {
        Ok(()) => {
            let _ = hand_over.deliver.send(Delivery::End);
            // Read-only: the rows are valid whatever the commit says. PostgreSQL may have
            // ended the session meanwhile, when a slow reader left it idle in the transaction
            // after the last row went out (`--db-idle-in-transaction-timeout-seconds`).
            if let Err(e) = txn.commit().await {
                tracing::debug!(error = %e, "ending a list's read transaction failed");
            }
        }
        // The transaction rolls back on drop.
        Err(e) => {
            let _ = hand_over.deliver.send(Delivery::Failed(e));
        }
    }
}

fn label_condition(req: &Requirement) -> Cond {
    let sub = |key: &str, values: Option<&[String]>| {
        let mut q = Query::select();
        q.expr(Expr::val(1))
            .from_as(ObjectLabels::Table, Alias::new("l"))
            .and_where(
                Expr::col((Alias::new("l"), ObjectLabels::ObjectId))
                    .equals((Objects::Table, Objects::Id)),
            )
            .and_where(Expr::col((Alias::new("l"), ObjectLabels::Key)).eq(key));
        if let Some(values) = values {
            q.and_where(
                Expr::col((Alias::new("l"), ObjectLabels::Value)).is_in(values.iter().cloned()),
            );
        }
        q.to_owned()
    };
    match req {
        Requirement::Exists(k) => Cond::all().add(Expr::exists(sub(k, None))),
        Requirement::NotExists(k) => Cond::all().add(Expr::exists(sub(k, None)).not()),
        Requirement::In(k, vs) => Cond::all().add(Expr::exists(sub(k, Some(vs)))),
        Requirement::NotIn(k, vs) => Cond::all().add(Expr::exists(sub(k, Some(vs))).not()),
    }
}

impl Store {
    fn select_objects(&self, desc: &ResourceDescriptor, with_body: bool) -> SelectStatement {
        let mut q = Query::select();
        q.columns(KEY_COLUMNS.map(|c| (Objects::Table, c)))
            .from(Objects::Table)
            .and_where(Expr::col((Objects::Table, Objects::ClusterId)).eq(self.cluster_id()))
            .and_where(
                Expr::col((Objects::Table, Objects::Resource)).eq(Store::resource_key(desc)),
            );
        if with_body {
            q.column((Objects::Table, Objects::Body));
        } else {
            q.columns(METADATA_COLUMNS.map(|c| (Objects::Table, c)));
        }
        q
    }

    /// Reads one object.
    pub async fn get(
        &self,
        desc: &ResourceDescriptor,
        namespace: &str,
        name: &str,
    ) -> Result<Option<ListRow>, StoreError> {
        let q = self
            .select_objects(desc, true)
            .and_where(Expr::col((Objects::Table, Objects::Namespace)).eq(namespace))
            .and_where(Expr::col((Objects::Table, Objects::Name)).eq(name))
            .to_owned();
        self.unless_outage(async { Ok(self.connection().query_one(&q).await?) })
            .await?
            .map(|r| row_of(&r, Some(self.bodies())))
            .transpose()
    }

    /// Reads one object and decodes it.
    pub async fn get_object(
        &self,
        desc: &ResourceDescriptor,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, StoreError> {
        match self.get(desc, namespace, name).await? {
            Some(row) => Ok(Some(parse_document(
                &format!("{namespace}/{name}"),
                &row.body,
            )?)),
            None => Ok(None),
        }
    }

    fn list_statement(&self, query: &ListQuery) -> SelectStatement {
        let mut q = self.select_objects(query.resource, !query.metadata_only);
        let ns_col = Expr::col((Objects::Table, Objects::Namespace));
        let name_col = Expr::col((Objects::Table, Objects::Name));
        if let Some(ns) = &query.namespace {
            q.and_where(ns_col.clone().eq(ns.as_str()));
        }
        for req in &query.fields.0 {
            let col = match req.field {
                Field::Name => name_col.clone(),
                Field::Namespace => ns_col.clone(),
            };
            q.and_where(if req.equal {
                col.eq(req.value.as_str())
            } else {
                col.ne(req.value.as_str())
            });
        }
        for req in &query.labels.0 {
            q.cond_where(label_condition(req));
        }
        if let Some((ns, name)) = &query.after {
            // The row value is the seek PostgreSQL and SQLite start the index range at; the
            // equivalent `ns > ? OR (ns = ? AND name > ?)` made PostgreSQL walk the index from
            // the first row and filter, so page k cost k pages. `ns >= ?` is implied by it and
            // gives MySQL, which does not seek on row values, a range to start at.
            q.and_where(
                Expr::tuple([ns_col.clone(), name_col.clone()]).gt(Expr::tuple([
                    Expr::val(ns.as_str()),
                    Expr::val(name.as_str()),
                ])),
            )
            .and_where(ns_col.clone().gte(ns.as_str()));
        }
        q.order_by((Objects::Table, Objects::Namespace), Order::Asc)
            .order_by((Objects::Table, Objects::Name), Order::Asc);
        if let Some(limit) = query.limit {
            q.limit(limit + 1);
        }
        q
    }

    /// A read-only transaction whose reads all see one snapshot (SQLite's transactions always
    /// do; PostgreSQL and MySQL need REPEATABLE READ for it).
    pub(super) async fn read_snapshot(&self) -> Result<DatabaseTransaction, StoreError> {
        Ok(match self.backend() {
            DbBackend::Postgres | DbBackend::MySql => {
                self.connection()
                    .begin_with_config(
                        Some(IsolationLevel::RepeatableRead),
                        Some(AccessMode::ReadOnly),
                    )
                    .await?
            }
            _ => self.connection().begin().await?,
        })
    }

    /// Lists one page. The page and its resourceVersion come from one read snapshot. Abandoned
    /// when an outage begins meanwhile ([`Store::unless_outage`]): background workers list too.
    pub async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.unless_outage(async { self.list_stream(query).await?.collect().await })
            .await
    }

    /// [`Store::list`], row by row as the database delivers them. The snapshot's versions are
    /// read before this returns; from the first [`ListStream::next_row`] on, a task reads the
    /// rows ahead of the caller, up to [`StoreOptions::list_read_ahead_bytes`] not yet taken, so
    /// the connection of a page up to that size is back in the pool as soon as the database has
    /// sent it, however slowly the caller consumes it; a larger page waits for its caller.
    ///
    /// [`StoreOptions::list_read_ahead_bytes`]: super::StoreOptions::list_read_ahead_bytes
    pub async fn list_stream(&self, query: &ListQuery) -> Result<ListStream, StoreError> {
        let txn = self.read_snapshot().await?;
        let (resource_version, compacted) =
            versions(&txn, self.backend(), self.cluster_id()).await?;
        let statement = self.list_statement(query);
        let bodies = (!query.metadata_only).then(|| self.bodies());
        let (deliver, deliveries) = mpsc::unbounded_channel();
        // Permits are counted in u32, and tokio allows fewer on 32-bit targets (2^29 - 1): a
        // larger setting is lowered to what fits.
        let read_ahead_bytes = self
            .options
            .list_read_ahead_bytes
            .clamp(1, Semaphore::MAX_PERMITS.min(u32::MAX as usize));
        let read_ahead = Arc::new(Semaphore::new(read_ahead_bytes));
        let hand_over = HandOver {
            read_ahead: read_ahead.clone(),
            read_ahead_bytes,
            stall_timeout: self.options.idle_in_transaction_timeout,
            deliver,
        };
        Ok(ListStream {
            resource_version,
            compacted,
            unstarted: Some(Read {
                txn,
                statement,
                bodies,
                hand_over,
            }),
            deliveries,
            batch: None,
            read_ahead,
            limit: query.limit,
            delivered: 0,
            limit_key: None,
            more: false,
            finished: false,
        })
    }

    /// Counts objects of a kind (all namespaces); for metrics and benchmarks.
    pub async fn count(&self, desc: &ResourceDescriptor) -> Result<i64, StoreError> {
        let q = Query::select()
            .expr_as(Expr::col(Objects::Id).count(), Alias::new("n"))
            .from(Objects::Table)
            .and_where(Expr::col(Objects::ClusterId).eq(self.cluster_id()))
            .and_where(Expr::col(Objects::Resource).eq(Store::resource_key(desc)))
            .to_owned();
        let row = self
            .connection()
            .query_one(&q)
            .await?
            .ok_or_else(|| StoreError::Inconsistent("COUNT returned nothing".into()))?;
        Ok(row.try_get("", "n")?)
    }

    /// Runs a raw statement; for tests and the analytics examples.
    pub async fn query_raw(&self, sql: &str) -> Result<Vec<QueryResult>, StoreError> {
        Ok(self
            .connection()
            .query_all_raw(Statement::from_string(self.backend(), sql))
            .await?)
    }

    /// Runs a raw statement and hands its rows to `each` as they arrive, one at a time: for
    /// benchmarks that read more rows than [`Store::query_raw`] could hold. Returns the rows read.
    pub async fn for_each_raw_row(
        &self,
        sql: &str,
        mut each: impl FnMut(&QueryResult) -> Result<(), StoreError>,
    ) -> Result<u64, StoreError> {
        let statement = Statement::from_string(self.backend(), sql);
        let connection = self.connection();
        let mut rows = connection.stream_raw(statement).await?;
        let mut read = 0;
        while let Some(row) = rows.next().await {
            each(&row?)?;
            read += 1;
        }
        Ok(read)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use reports_server_crds::catalog::POLICY_REPORT;
    use serde_json::json;

    use super::*;
    use crate::store::StoreOptions;

    /// An SQLite store of one connection holding `names` in namespace `ns`.
    async fn one_connection_store(dir: &tempfile::TempDir, names: &[&str]) -> Store {
        store_of(dir, names, 0, StoreOptions::new(String::new())).await
    }

    /// As [`one_connection_store`], each object carrying `padding` bytes in an annotation,
    /// with `options` (its URL and pool replaced).
    async fn store_of(
        dir: &tempfile::TempDir,
        names: &[&str],
        padding: usize,
        options: StoreOptions,
    ) -> Store {
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("db").display());
        let store = Store::connect(StoreOptions {
            max_connections: 1,
            connect_timeout: Duration::from_secs(2),
            database_url: url,
            ..options
        })
        .await
        .unwrap();
        let objects = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                json!({"apiVersion": "wgpolicyk8s.io/v1alpha2", "kind": "PolicyReport",
                    "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{i}"),
                        "resourceVersion": "1", "creationTimestamp": "2026-11-26T00:00:00Z",
                        "annotations": {"padding": "x".repeat(padding)}}})
            })
            .collect();
        store.put_all(&POLICY_REPORT, objects).await.unwrap();
        store
    }

    /// A list without `limit` to a reader that lags holds no more than its read-ahead: the
    /// reading task waits, keeping its connection, instead of reading every body into memory.
    #[tokio::test]
    async fn a_list_reads_no_further_ahead_of_its_reader_than_the_read_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let names = ["a", "b", "c", "d", "e", "f"];
        // Two objects fill a batch; a read-ahead of one byte lets one batch out at a time.
        let options = StoreOptions {
            list_read_ahead_bytes: 1,
            ..StoreOptions::new(String::new())
        };
        let store = store_of(&dir, &names, LIST_BATCH_BYTES / 2, options).await;
        let mut page = store
            .list_stream(&ListQuery::all(&POLICY_REPORT))
            .await
            .unwrap();
        let first = page.next_row().await.unwrap().unwrap();
        // The next batch waits for the first to be taken, on the only connection.
        let busy = store.count(&POLICY_REPORT).await;
        assert!(
            busy.is_err(),
            "the lagging list kept its connection: {busy:?}"
        );

        let mut listed = vec![first.name];
        while let Some(row) = page.next_row().await {
            listed.push(row.unwrap().name);
        }
        assert_eq!(listed, names, "every row, in order, across batches");
        assert!(!page.more());
        let count = store.count(&POLICY_REPORT).await.unwrap();
        assert_eq!(count, 6, "the connection is back once the page is read");
    }

    /// A store of six objects whose lists read one batch ahead of their reader and wait
    /// `stall` for it, and an unlimited list of them whose first row was taken.
    async fn lagging_list(dir: &tempfile::TempDir, stall: Duration) -> (Store, ListStream) {
        let options = StoreOptions {
            list_read_ahead_bytes: 1,
            idle_in_transaction_timeout: stall,
            ..StoreOptions::new(String::new())
        };
        let names = ["a", "b", "c", "d", "e", "f"];
        let store = store_of(dir, &names, LIST_BATCH_BYTES / 2, options).await;
        let mut page = store
            .list_stream(&ListQuery::all(&POLICY_REPORT))
            .await
            .unwrap();
        page.next_row().await.unwrap().unwrap();
        (store, page)
    }

    #[tokio::test]
    async fn a_list_whose_reader_stops_taking_rows_ends_and_frees_its_connection() {
        let dir = tempfile::tempdir().unwrap();
        let (store, mut page) = lagging_list(&dir, Duration::from_millis(200)).await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        let count = store.count(&POLICY_REPORT).await;
        assert_eq!(
            count.unwrap(),
            6,
            "the stalled read gave its connection back"
        );
        let mut outcome = Vec::new();
        while let Some(row) = page.next_row().await {
            outcome.push(row.map(|r| r.name));
        }
        let last = outcome.pop().expect("an outcome");
        assert!(
            matches!(last, Err(StoreError::ReaderStalled(_))),
            "the page ends with why: {last:?}"
        );
        assert!(outcome.iter().all(Result::is_ok), "{outcome:?}");
    }

    #[tokio::test]
    async fn a_reader_that_goes_away_while_the_read_waits_for_it_ends_the_read() {
        let dir = tempfile::tempdir().unwrap();
        let (store, page) = lagging_list(&dir, Duration::from_secs(60)).await;
        drop(page);
        let count = store.count(&POLICY_REPORT).await;
        assert_eq!(
            count.unwrap(),
            6,
            "the abandoned read gave its connection back"
        );
    }

    fn first_two(after: Option<(String, String)>) -> ListQuery {
        ListQuery {
            limit: Some(2),
            after,
            ..ListQuery::all(&POLICY_REPORT)
        }
    }

    #[tokio::test]
    async fn a_page_is_read_off_the_database_before_its_reader_has_consumed_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = one_connection_store(&dir, &["a", "b", "c"]).await;
        let mut page = store.list_stream(&first_two(None)).await.unwrap();
        let first = page.next_row().await.unwrap().unwrap();
        // The only connection is free again while the page is half consumed.
        let count = tokio::time::timeout(Duration::from_secs(5), store.count(&POLICY_REPORT))
            .await
            .expect("the list released its connection")
            .unwrap();
        assert_eq!(count, 3);
        let second = page.next_row().await.unwrap().unwrap();
        assert!(page.next_row().await.is_none());
        assert!(page.more(), "a third row follows the limit of two");
        assert_eq!((first.name.as_str(), second.name.as_str()), ("a", "b"));
        assert!(first.body.contains("\"name\":\"a\""), "{}", first.body);
        assert!(first.metadata.is_empty(), "object lists read no metadata");

        let rest = store
            .list(&first_two(Some(("ns".into(), "b".into()))))
            .await
            .unwrap();
        let names: Vec<&str> = rest.rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!((names, rest.more), (vec!["c"], false));
    }

    #[tokio::test]
    async fn a_reader_that_goes_away_ends_the_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = one_connection_store(&dir, &["a", "b", "c"]).await;
        for read_first in [false, true] {
            let mut page = store
                .list_stream(&ListQuery::all(&POLICY_REPORT))
                .await
                .unwrap();
            if read_first {
                page.next_row().await.unwrap().unwrap();
            }
            drop(page);
            let count = tokio::time::timeout(Duration::from_secs(5), store.count(&POLICY_REPORT))
                .await
                .expect("the abandoned list released its connection")
                .unwrap();
            assert_eq!(count, 3);
        }
    }

    #[tokio::test]
    async fn metadata_lists_read_no_bodies() {
        let dir = tempfile::tempdir().unwrap();
        let store = one_connection_store(&dir, &["a"]).await;
        let page = store
            .list(&ListQuery {
                metadata_only: true,
                ..ListQuery::all(&POLICY_REPORT)
            })
            .await
            .unwrap();
        let row = &page.rows[0];
        assert!(row.body.is_empty());
        assert!(row.metadata.contains("\"name\":\"a\""), "{}", row.metadata);
    }

    /// The next page starts where the index says, not after a walk from the first row.
    #[tokio::test]
    async fn a_later_page_seeks_to_its_first_row_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let store = one_connection_store(&dir, &[]).await;
        let statement = store.list_statement(&first_two(Some(("ns".into(), "b".into()))));
        let plan = crate::store::sqlite_query_plan(&store, &statement).await;
        assert!(
            plan.iter().any(|step| step.starts_with("SEARCH")
                && step.contains("objects_key")
                && step.contains("(namespace,name)>(?,?)")),
            "{plan:#?}"
        );
        assert!(
            plan.iter().all(|step| !step.contains("TEMP B-TREE")),
            "rows come in index order, unsorted: {plan:#?}"
        );
    }
}
