//! Writes. Every write runs in a group commit round (see `group_commit`) whose transaction (1)
//! takes the resourceVersion counter's row lock, (2) checks that each target is still at the
//! version its writer decided on (see `mutate`), (3) writes the object, its labels and its
//! result rows, and (4) appends to the change log. A read-modify-write request (patch, apply,
//! finalizer removal) whose object changed in between decides again on the new state, so
//! such requests never race and never surface a conflict the client did not cause.
//!
//! One copy of each body: the change-log entry of an object's current version does not repeat
//! the body the `objects` row holds (its `body` is [`BODY_IN_OBJECTS`], and the feed reads it
//! through a join). The write that supersedes that version moves the old body into the entry,
//! in the same transaction, so a watch resuming from an older resourceVersion still gets each
//! version as it was. Only versions inside the retention window are ever stored twice over.

use std::collections::HashMap;

use reports_server_crds::ResourceDescriptor;
use sea_orm::sea_query::{
    ColumnRef, CommonTableExpression, Condition, DeleteStatement, Expr, ExprTrait, Func,
    InsertStatement, IntoColumnRef, OnConflict, Query, TableRef, UpdateStatement, WithQuery,
};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, TransactionTrait};
use serde_json::Value;

use super::columns::{ObjectColumns, ResultRow};
use super::feed::{EventType, NOTIFY_CHANNEL};
use super::mutate::current_rv;
use super::policy_rules::RoundRules;
use super::prepared::{Prepared, RowParts};
use super::schema::{Changes, ObjectLabels, Objects, Results, StoreState};
use super::{Store, StoreError};

/// What a write does to one object, decided from its current state.
#[derive(Debug)]
pub enum Mutation {
    /// Create or replace with this object (its `metadata.resourceVersion` is set by the store).
    Put(Value),
    /// Remove the object.
    Delete,
    /// Leave it as it is (a no-op update does not bump the resourceVersion).
    Unchanged,
}

/// The result of a write to one object.
#[derive(Debug, Clone)]
pub struct WriteOutcome {
    /// The object as stored (for deletes: its last state).
    pub object: Option<Value>,
    /// `object` as JSON, when the write serialized it anyway (puts): the response reuses it.
    pub json: Option<bytes::Bytes>,
    pub event: Option<EventType>,
    pub resource_version: i64,
}

/// One object a batch touches.
pub struct Target<'a> {
    pub resource: &'static ResourceDescriptor,
    pub namespace: &'a str,
    pub name: &'a str,
}

/// The change-log `body` of an entry whose body is the `objects` row's (see the module docs).
/// No JSON document is empty, so it cannot be mistaken for one.
pub(super) const BODY_IN_OBJECTS: &str = "";

/// The `objects` row holding the version a `changes` entry is about: where an entry whose body
/// is [`BODY_IN_OBJECTS`] finds it (the feed's join, the one-body-copy migration).
pub(super) fn object_row_of_change() -> Condition {
    let same = |o: Objects, c: Changes| Expr::col((Objects::Table, o)).equals((Changes::Table, c));
    Condition::all()
        .add(same(Objects::ClusterId, Changes::ClusterId))
        .add(same(Objects::Resource, Changes::Resource))
        .add(same(Objects::Namespace, Changes::Namespace))
        .add(same(Objects::Name, Changes::Name))
        .add(same(Objects::ResourceVersion, Changes::Rv))
}

/// Result rows per INSERT: far below every backend's bind-parameter limit (SQLite 32766,
/// PostgreSQL 65535) at 13 columns a row.
const RESULT_ROWS_PER_STATEMENT: usize = 1000;

/// Ids or versions per `IN (…)` list of a round's deletes and retirements.
const KEYS_PER_STATEMENT: usize = 1000;

pub(super) fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Store {
    /// Writes one decided mutation of a round: the object row, its side rows and its
    /// change-log entry, with the next resourceVersion (`rv` is the round's last one so far).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn apply_one(
        &self,
        txn: &DatabaseTransaction,
        key: &str,
        target: &Target<'_>,
        current: Option<&Current>,
        decided: &mut Decided,
        rv: &mut i64,
        base_rv: i64,
        now: i64,
        rules: &RoundRules,
    ) -> Result<Applied, StoreError> {
        Ok(match version(target, current, decided, rv, base_rv) {
            Versioned::Nothing(applied) => applied,
            Versioned::Put {
                event,
                parts,
                object,
                previous,
                replaces,
            } => {
                let applied = Applied::put(event, *rv, &parts);
                let change = one_change(self.change_values(
                    key,
                    target,
                    event,
                    object,
                    previous,
                    BODY_IN_OBJECTS.to_owned(),
                    *rv,
                    now,
                ));
                match replaces {
                    Some(current) => {
                        self.retire_bodies(txn, &[current.rv]).await?;
                        self.update_row(txn, current.id, parts, *rv, rules).await?;
                        txn.execute(&change).await?;
                    }
                    None => {
                        self.insert_row(txn, key, target, parts, *rv, change, rules)
                            .await?;
                    }
                }
                applied
            }
            Versioned::Delete { current, object } => {
                self.retire_bodies(txn, &[current.rv]).await?;
                self.delete_rows(txn, &[current.id]).await?;
                let change = one_change(self.deletion_change(key, target, object, *rv, now));
                txn.execute(&change).await?;
                Applied::deleted(*rv)
            }
        })
    }

    /// Moves the counter to the round's last resourceVersion.
    pub(super) async fn advance_counter(
        &self,
        txn: &DatabaseTransaction,
        rv: i64,
    ) -> Result<(), StoreError> {
        let advance = self.counter_advance(rv);
        if self.backend() == DbBackend::Postgres {
            txn.query_one(&advance).await?;
        } else {
            txn.execute(&advance).await?;
        }
        Ok(())
    }

    /// The UPDATE that moves the counter to `rv`. On PostgreSQL the wake-up for other replicas
    /// rides on it (NOTIFY is delivered at commit, like the statement itself), so it returns
    /// a row.
    fn counter_advance(&self, rv: i64) -> UpdateStatement {
        let mut advance = Query::update();
        advance
            .table(StoreState::Table)
            .value(StoreState::Rv, rv)
            .and_where(Expr::col(StoreState::ClusterId).eq(self.cluster_id()));
        if self.backend() == DbBackend::Postgres {
            advance.returning(
                Query::returning().expr(
                    Func::cust("pg_notify")
                        .args([Expr::val(NOTIFY_CHANNEL), Expr::val(rv.to_string())]),
                ),
            );
        }
        advance
    }

    /// The versions `rvs` are being superseded: their change-log entries, which so far read the
    /// body from the `objects` rows, get the bodies themselves (entries still retained only).
    /// The bodies are copied inside the database, from the rows about to change, so they do not
    /// travel back over the connection; this must run before those rows are updated or deleted.
    async fn retire_bodies(
        &self,
        txn: &DatabaseTransaction,
        rvs: &[i64],
    ) -> Result<(), StoreError> {
        for chunk in rvs.chunks(KEYS_PER_STATEMENT) {
            txn.execute(&self.retirement(chunk)).await?;
        }
        Ok(())
    }

    /// The UPDATE of [`Store::retire_bodies`] for the versions `rvs`.
    fn retirement(&self, rvs: &[i64]) -> UpdateStatement {
        let body_of_row = Query::select()
            .column((Objects::Table, Objects::Body))
            .from(Objects::Table)
            .cond_where(object_row_of_change())
            .to_owned();
        Query::update()
            .table(Changes::Table)
            .value(
                Changes::Body,
                Expr::SubQuery(None, Box::new(body_of_row.into())),
            )
            .and_where(Expr::col((Changes::Table, Changes::ClusterId)).eq(self.cluster_id()))
            .and_where(Expr::col((Changes::Table, Changes::Rv)).is_in(rvs.iter().copied()))
            .and_where(Expr::col((Changes::Table, Changes::Body)).eq(BODY_IN_OBJECTS))
            .to_owned()
    }

    /// Inserts a new object with its labels, result rows and change-log entry (`change`), one
    /// statement each. (PostgreSQL stages even a round's only write: [`Store::write_staged`]
    /// folds it into one statement.)
    #[allow(clippy::too_many_arguments)]
    async fn insert_row(
        &self,
        txn: &DatabaseTransaction,
        key: &str,
        t: &Target<'_>,
        parts: RowParts,
        rv: i64,
        change: InsertStatement,
        rules: &RoundRules,
    ) -> Result<(), StoreError> {
        let RowParts {
            body,
            columns: cols,
            results,
            rule_ids: known,
        } = parts;
        let rule_ids = rules.ids_of(&results, &known)?;
        let mut insert = objects_head();
        insert.values_panic(self.object_values(key, t, &cols, body, rv));
        let id = if self.backend() == DbBackend::MySql {
            let res = txn.execute(&insert).await.map_err(unique_to_exists)?;
            res.last_insert_id() as i64
        } else {
            insert.returning_col(Objects::Id);
            let row = txn.query_one(&insert).await.map_err(unique_to_exists)?;
            row.ok_or_else(|| {
                StoreError::Inconsistent("INSERT … RETURNING returned no row".into())
            })?
            .try_get("", "id")?
        };
        self.write_side_rows(txn, &Expr::val(id), &cols, results, &rule_ids)
            .await?;
        txn.execute(&change).await.map_err(StoreError::from)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn update_row(
        &self,
        txn: &DatabaseTransaction,
        id: i64,
        parts: RowParts,
        rv: i64,
        rules: &RoundRules,
    ) -> Result<(), StoreError> {
        let RowParts {
            body,
            columns: cols,
            results,
            rule_ids: known,
        } = parts;
        txn.execute(
            &Query::update()
                .table(Objects::Table)
                .values([
                    (Objects::Uid, cols.uid.clone().into()),
                    (Objects::ResourceVersion, rv.into()),
                    (Objects::Generation, cols.generation.into()),
                    (Objects::CreatedAt, cols.created_at.into()),
                    (Objects::DeletedAt, cols.deleted_at.into()),
                    (Objects::OwnerUids, cols.owner_uids.clone().into()),
                    (Objects::SummaryPass, cols.summary[0].into()),
                    (Objects::SummaryFail, cols.summary[1].into()),
                    (Objects::SummaryWarn, cols.summary[2].into()),
                    (Objects::SummaryError, cols.summary[3].into()),
                    (Objects::SummarySkip, cols.summary[4].into()),
                    (Objects::ScopeKind, cols.scope_kind.clone().into()),
                    (Objects::ScopeNamespace, cols.scope_namespace.clone().into()),
                    (Objects::ScopeName, cols.scope_name.clone().into()),
                    (Objects::ScopeUid, cols.scope_uid.clone().into()),
                    (Objects::Metadata, cols.metadata.clone().into()),
                    (Objects::Body, self.bodies().encode(body).into()),
                ])
                .and_where(Expr::col(Objects::Id).eq(id))
                .to_owned(),
        )
        .await?;
        self.delete_side_rows(txn, &[id]).await?;
        let rule_ids = rules.ids_of(&results, &known)?;
        self.write_side_rows(txn, &Expr::val(id), &cols, results, &rule_ids)
            .await
    }

    /// Deletes the `objects` rows `ids` with their labels and result rows.
    async fn delete_rows(&self, txn: &DatabaseTransaction, ids: &[i64]) -> Result<(), StoreError> {
        delete_where_in(txn, Objects::Table, Objects::Id, ids).await?;
        self.delete_side_rows(txn, ids).await
    }

    /// Deletes the label and result rows of the objects `ids`.
    async fn delete_side_rows(
        &self,
        txn: &DatabaseTransaction,
        ids: &[i64],
    ) -> Result<(), StoreError> {
        delete_where_in(txn, ObjectLabels::Table, ObjectLabels::ObjectId, ids).await?;
        delete_where_in(txn, Results::Table, Results::ObjectId, ids).await
    }

    async fn write_side_rows(
        &self,
        txn: &DatabaseTransaction,
        id: &Expr,
        cols: &ObjectColumns,
        results: Vec<ResultRow>,
        rule_ids: &[i64],
    ) -> Result<(), StoreError> {
        for insert in self
            .labels_insert(id, cols)
            .into_iter()
            .chain(results_inserts(id, results, rule_ids))
        {
            txn.execute(&insert).await?;
        }
        Ok(())
    }

    /// The object's label rows; `id` is its id or an expression giving it.
    fn labels_insert(&self, id: &Expr, cols: &ObjectColumns) -> Option<InsertStatement> {
        if cols.labels.is_empty() {
            return None;
        }
        let mut insert = labels_head();
        for (k, v) in &cols.labels {
            insert.values_panic([id.clone(), k.clone().into(), v.clone().into()]);
        }
        Some(insert)
    }

    /// The values of an `objects` row, in [`objects_head`]'s column order.
    fn object_values(
        &self,
        key: &str,
        t: &Target<'_>,
        cols: &ObjectColumns,
        body: String,
        rv: i64,
    ) -> [Expr; 21] {
        [
            self.cluster_id().into(),
            key.into(),
            t.namespace.into(),
            t.name.into(),
            cols.uid.clone().into(),
            rv.into(),
            cols.generation.into(),
            cols.created_at.into(),
            cols.deleted_at.into(),
            cols.owner_uids.clone().into(),
            cols.summary[0].into(),
            cols.summary[1].into(),
            cols.summary[2].into(),
            cols.summary[3].into(),
            cols.summary[4].into(),
            cols.scope_kind.clone().into(),
            cols.scope_namespace.clone().into(),
            cols.scope_name.clone().into(),
            cols.scope_uid.clone().into(),
            cols.metadata.clone().into(),
            self.bodies().encode(body).into(),
        ]
    }

    /// The change-log row of the deletion of `object` at version `rv` (which the object
    /// already carries). The `objects` row is gone, so the entry keeps the last state itself,
    /// and its labels are the previous ones too.
    fn deletion_change(
        &self,
        key: &str,
        t: &Target<'_>,
        object: &Value,
        rv: i64,
        now: i64,
    ) -> [Expr; 10] {
        let body = object.to_string();
        self.change_values(
            key,
            t,
            EventType::Deleted,
            object,
            Some(object),
            body,
            rv,
            now,
        )
    }

    /// The values of a `changes` row, in [`changes_head`]'s column order.
    #[allow(clippy::too_many_arguments)]
    fn change_values(
        &self,
        key: &str,
        t: &Target<'_>,
        event: EventType,
        object: &Value,
        previous: Option<&Value>,
        body: String,
        rv: i64,
        now: i64,
    ) -> [Expr; 10] {
        let labels_of = |o: &Value| {
            o["metadata"]
                .get("labels")
                .cloned()
                .unwrap_or(Value::Object(Default::default()))
        };
        let labels = labels_of(object);
        // Watches with a label selector need the old labels to turn "stopped matching" into
        // DELETED and "started matching" into ADDED, as kube-apiserver does.
        let prev_labels = previous.map(labels_of).unwrap_or(Value::Null);
        [
            self.cluster_id().into(),
            rv.into(),
            key.into(),
            t.namespace.into(),
            t.name.into(),
            event.as_str().into(),
            labels.to_string().into(),
            prev_labels.to_string().into(),
            self.bodies().encode(body).into(),
            now.into(),
        ]
    }
}

/// The writes of one group commit round, applied after its other writes with multi-row
/// statements: a handful of round trips for all of them instead of several per write (creates
/// are the commonest write, Kyverno's ephemeral reports; the aggregator updates and deletes in
/// bulk). A replaced object is deleted and inserted again (a new row id, which nothing outside
/// the store's own side rows refers to); the row's key and version find the change log.
#[derive(Default)]
pub(super) struct StagedWrites {
    /// Rows to delete (deleted objects, and the old rows of replaced ones).
    removed: Vec<RemovedRow>,
    rows: Vec<[Expr; 21]>,
    sides: Vec<NewObjectSides>,
    changes: Vec<[Expr; 10]>,
}

/// A row a round deletes, with the version it holds: that version's change-log entry takes the
/// row's body ([`Store::retire_bodies`]).
struct RemovedRow {
    id: i64,
    rv: i64,
}

/// The ids and versions of `rows`.
fn ids_and_versions(rows: &[RemovedRow]) -> (Vec<i64>, Vec<i64>) {
    rows.iter().map(|r| (r.id, r.rv)).unzip()
}

/// What a new object's side rows need once its id is known.
struct NewObjectSides {
    key: String,
    namespace: String,
    name: String,
    labels: std::collections::BTreeMap<String, String>,
    results: Vec<ResultRow>,
    rule_ids: Vec<i64>,
}

impl StagedWrites {
    pub(super) fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    /// The bind parameters of a round's label, result and change-log rows and the counter's
    /// UPDATE: what PostgreSQL folds into one statement.
    fn side_parameters(&self) -> usize {
        let sides: usize = self
            .sides
            .iter()
            .map(|s| s.labels.len() * 3 + s.results.len() * 13)
            .sum();
        self.changes.len() * 10 + sides + 4
    }
}

impl NewObjectSides {
    /// The object's label and result rows, given its id.
    fn rows_into(self, id: &Expr, labels: &mut Vec<[Expr; 3]>, results: &mut Vec<[Expr; 13]>) {
        for (k, v) in self.labels {
            labels.push([id.clone(), k.into(), v.into()]);
        }
        results.extend(result_values(id, self.results, &self.rule_ids));
    }
}

/// Rows per multi-row INSERT of new objects (21 bind parameters each).
const OBJECTS_PER_STATEMENT: usize = 500;

/// The most bind parameters PostgreSQL folds into one statement (the protocol allows 65,535):
/// a round's label, result and change-log rows of about a hundred reports of the usual size
/// (19 results, ~270 parameters), so the rounds of Kyverno's and the API's writes fold and the
/// aggregator's bulk rounds are written table by table.
const PARAMETERS_PER_FOLDED_STATEMENT: usize = 30_000;

impl Store {
    /// Whether a round writes `writes` mutations through [`StagedWrites`]. PostgreSQL always
    /// does (it folds them into one or two statements); SQLite from two writes on (one write
    /// alone is no cheaper staged, and an update keeps its row); MySQL never (it has no
    /// `INSERT … RETURNING`).
    pub(super) fn stages(&self, writes: usize) -> bool {
        match self.backend() {
            DbBackend::Postgres => writes > 0,
            DbBackend::MySql => false,
            _ => writes > 1,
        }
    }

    /// [`Store::apply_one`] for a staged round: the same versions, events and JSON, with the
    /// statements left to [`Store::write_staged`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn stage(
        &self,
        staged: &mut StagedWrites,
        key: &str,
        target: &Target<'_>,
        current: Option<&Current>,
        decided: &mut Decided,
        rv: &mut i64,
        base_rv: i64,
        now: i64,
        rules: &RoundRules,
    ) -> Result<Applied, StoreError> {
        Ok(match version(target, current, decided, rv, base_rv) {
            Versioned::Nothing(applied) => applied,
            Versioned::Put {
                event,
                parts,
                object,
                previous,
                replaces,
            } => {
                let applied = Applied::put(event, *rv, &parts);
                if let Some(current) = replaces {
                    staged.removed.push(RemovedRow {
                        id: current.id,
                        rv: current.rv,
                    });
                }
                let RowParts {
                    body,
                    columns: cols,
                    results,
                    rule_ids: known,
                } = parts;
                let rule_ids = rules.ids_of(&results, &known)?;
                staged.changes.push(self.change_values(
                    key,
                    target,
                    event,
                    object,
                    previous,
                    BODY_IN_OBJECTS.to_owned(),
                    *rv,
                    now,
                ));
                staged
                    .rows
                    .push(self.object_values(key, target, &cols, body, *rv));
                staged.sides.push(NewObjectSides {
                    key: key.to_owned(),
                    namespace: target.namespace.to_owned(),
                    name: target.name.to_owned(),
                    labels: cols.labels,
                    results,
                    rule_ids,
                });
                applied
            }
            Versioned::Delete { current, object } => {
                staged.removed.push(RemovedRow {
                    id: current.id,
                    rv: current.rv,
                });
                staged
                    .changes
                    .push(self.deletion_change(key, target, object, *rv, now));
                Applied::deleted(*rv)
            }
        })
    }

    /// Writes a round's staged writes and moves the counter to the round's last version
    /// `last_rv`: retires the superseded bodies, deletes the removed rows, inserts the new ones,
    /// then their labels, result rows and change-log entries.
    ///
    /// Every statement of a round is a round trip made under the counter's lock. On PostgreSQL
    /// the removals are one statement, and the side rows and change-log entries ride with the
    /// counter's UPDATE as data-modifying CTEs when they fit in
    /// [`PARAMETERS_PER_FOLDED_STATEMENT`]: a create is BEGIN, lock, current-row read, the new
    /// rows, the rest, COMMIT. (Taking the new rows' ids from their `INSERT … RETURNING` in the
    /// same statement costs more than the round trip: PostgreSQL plans a subquery per side row.)
    pub(super) async fn write_staged(
        &self,
        txn: &DatabaseTransaction,
        staged: StagedWrites,
        last_rv: i64,
    ) -> Result<(), StoreError> {
        let postgres = self.backend() == DbBackend::Postgres;
        if postgres {
            self.remove_rows_in_one(txn, &staged.removed).await?;
        } else {
            let (ids, rvs) = ids_and_versions(&staged.removed);
            self.retire_bodies(txn, &rvs).await?;
            self.delete_rows(txn, &ids).await?;
        }
        let folds = postgres && staged.side_parameters() <= PARAMETERS_PER_FOLDED_STATEMENT;
        let mut ids: HashMap<(String, String, String), i64> = HashMap::new();
        let mut rows = staged.rows.into_iter().peekable();
        while rows.peek().is_some() {
            let mut insert = objects_head();
            for row in rows.by_ref().take(OBJECTS_PER_STATEMENT) {
                insert.values_panic(row);
            }
            insert.returning(Query::returning().columns([
                Objects::Id,
                Objects::Resource,
                Objects::Namespace,
                Objects::Name,
            ]));
            for row in txn.query_all(&insert).await.map_err(unique_to_exists)? {
                ids.insert(
                    (
                        row.try_get("", "resource")?,
                        row.try_get("", "namespace")?,
                        row.try_get("", "name")?,
                    ),
                    row.try_get("", "id")?,
                );
            }
        }
        let mut labels = Vec::new();
        let mut results = Vec::new();
        for side in staged.sides {
            let id = ids
                .get(&(side.key.clone(), side.namespace.clone(), side.name.clone()))
                .ok_or_else(|| {
                    StoreError::Inconsistent(format!(
                        "INSERT … RETURNING returned no id for {} {}/{}",
                        side.key, side.namespace, side.name
                    ))
                })?;
            side.rows_into(&Expr::val(*id), &mut labels, &mut results);
        }
        if folds {
            let inserts = multi_row_inserts(labels_head, labels)
                .into_iter()
                .chain(multi_row_inserts(results_head, results))
                .chain(multi_row_inserts(changes_head, staged.changes));
            let mut with = WithQuery::new();
            for (n, insert) in inserts.enumerate() {
                with.cte(cte(format!("side_{n}"), insert));
            }
            txn.query_one(with.query(self.counter_advance(last_rv)))
                .await?;
            return Ok(());
        }
        insert_in_chunks(txn, labels_head, labels).await?;
        insert_in_chunks(txn, results_head, results).await?;
        insert_in_chunks(txn, changes_head, staged.changes).await?;
        self.advance_counter(txn, last_rv).await
    }

    /// PostgreSQL: [`Store::retire_bodies`] and [`Store::delete_rows`] as one statement per
    /// [`KEYS_PER_STATEMENT`] rows. Its parts share one snapshot, so the retirement still reads
    /// the bodies of the rows the same statement deletes.
    async fn remove_rows_in_one(
        &self,
        txn: &DatabaseTransaction,
        removed: &[RemovedRow],
    ) -> Result<(), StoreError> {
        for chunk in removed.chunks(KEYS_PER_STATEMENT) {
            let (ids, rvs) = ids_and_versions(chunk);
            let mut with = WithQuery::new();
            with.cte(cte("retired", self.retirement(&rvs)));
            with.cte(cte(
                "removed_labels",
                delete_in(ObjectLabels::Table, ObjectLabels::ObjectId, &ids),
            ));
            with.cte(cte(
                "removed_results",
                delete_in(Results::Table, Results::ObjectId, &ids),
            ));
            txn.execute(with.query(delete_in(Objects::Table, Objects::Id, &ids)))
                .await?;
        }
        Ok(())
    }
}

/// A named common table expression of `query` (built in place: sea-query's chained builders
/// end in a clone of the whole statement, values and all).
fn cte(
    name: impl sea_orm::sea_query::IntoIden,
    query: impl Into<sea_orm::sea_query::SubQueryStatement>,
) -> CommonTableExpression {
    let mut cte = CommonTableExpression::new();
    cte.query(query).table_name(name);
    cte
}

/// Inserts `rows` with `head`, [`RESULT_ROWS_PER_STATEMENT`] rows per statement.
async fn insert_in_chunks<const N: usize>(
    txn: &DatabaseTransaction,
    head: fn() -> InsertStatement,
    rows: Vec<[Expr; N]>,
) -> Result<(), StoreError> {
    for insert in multi_row_inserts(head, rows) {
        txn.execute(&insert).await?;
    }
    Ok(())
}

/// `DELETE FROM table WHERE column IN (ids)`, [`KEYS_PER_STATEMENT`] ids per statement.
async fn delete_where_in(
    txn: &DatabaseTransaction,
    table: impl Into<TableRef>,
    column: impl IntoColumnRef,
    ids: &[i64],
) -> Result<(), StoreError> {
    let (table, column): (TableRef, ColumnRef) = (table.into(), column.into_column_ref());
    for chunk in ids.chunks(KEYS_PER_STATEMENT) {
        txn.execute(&delete_in(table.clone(), column.clone(), chunk))
            .await?;
    }
    Ok(())
}

/// `DELETE FROM table WHERE column IN (ids)`.
fn delete_in(
    table: impl Into<TableRef>,
    column: impl IntoColumnRef,
    ids: &[i64],
) -> DeleteStatement {
    Query::delete()
        .from_table(table)
        .and_where(Expr::col(column).is_in(ids.iter().copied()))
        .to_owned()
}

/// `INSERT INTO objects (…)` without values; [`Store::object_values`] gives a row.
fn objects_head() -> InsertStatement {
    Query::insert()
        .into_table(Objects::Table)
        .columns([
            Objects::ClusterId,
            Objects::Resource,
            Objects::Namespace,
            Objects::Name,
            Objects::Uid,
            Objects::ResourceVersion,
            Objects::Generation,
            Objects::CreatedAt,
            Objects::DeletedAt,
            Objects::OwnerUids,
            Objects::SummaryPass,
            Objects::SummaryFail,
            Objects::SummaryWarn,
            Objects::SummaryError,
            Objects::SummarySkip,
            Objects::ScopeKind,
            Objects::ScopeNamespace,
            Objects::ScopeName,
            Objects::ScopeUid,
            Objects::Metadata,
            Objects::Body,
        ])
        .to_owned()
}

fn labels_head() -> InsertStatement {
    Query::insert()
        .into_table(ObjectLabels::Table)
        .columns([
            ObjectLabels::ObjectId,
            ObjectLabels::Key,
            ObjectLabels::Value,
        ])
        .to_owned()
}

/// `INSERT INTO results (…)`; [`result_values`] gives the rows.
fn results_head() -> InsertStatement {
    Query::insert()
        .into_table(Results::Table)
        .columns([
            Results::ObjectId,
            Results::Ordinal,
            Results::RuleId,
            Results::Result,
            Results::OwnSubject,
            Results::SubjectApiVersion,
            Results::SubjectKind,
            Results::SubjectNamespace,
            Results::SubjectName,
            Results::SubjectUid,
            Results::Timestamp,
            Results::Message,
            Results::Properties,
        ])
        .to_owned()
}

/// The `results` rows of an object (`id`: its id or an expression giving it), in
/// [`results_head`]'s column order; `rule_ids` holds each row's rule id.
fn result_values<'a>(
    id: &'a Expr,
    rows: Vec<ResultRow>,
    rule_ids: &'a [i64],
) -> impl Iterator<Item = [Expr; 13]> + 'a {
    rows.into_iter()
        .zip(rule_ids)
        .enumerate()
        .map(move |(ordinal, (r, rule_id))| {
            let own_subject = r.subject.is_some();
            let (kind, namespace, name, uid) = match r.subject {
                Some(s) => (s.kind, s.namespace, s.name, s.uid),
                None => (None, None, None, None),
            };
            [
                id.clone(),
                (ordinal as i32).into(),
                (*rule_id).into(),
                r.result.into(),
                own_subject.into(),
                r.subject_api_version.into(),
                kind.into(),
                namespace.into(),
                name.into(),
                uid.into(),
                r.timestamp.into(),
                r.message.into(),
                r.properties.into(),
            ]
        })
}

/// The object's result rows, [`RESULT_ROWS_PER_STATEMENT`] per statement.
fn results_inserts(id: &Expr, rows: Vec<ResultRow>, rule_ids: &[i64]) -> Vec<InsertStatement> {
    multi_row_inserts(results_head, result_values(id, rows, rule_ids))
}

/// `rows` as INSERTs made by `head`, [`RESULT_ROWS_PER_STATEMENT`] rows per statement.
fn multi_row_inserts<const N: usize>(
    head: fn() -> InsertStatement,
    rows: impl IntoIterator<Item = [Expr; N]>,
) -> Vec<InsertStatement> {
    let mut rows = rows.into_iter().peekable();
    let mut inserts = Vec::new();
    while rows.peek().is_some() {
        let mut insert = head();
        for row in rows.by_ref().take(RESULT_ROWS_PER_STATEMENT) {
            insert.values_panic(row);
        }
        inserts.push(insert);
    }
    inserts
}

/// `INSERT INTO changes (…) … ON CONFLICT DO NOTHING`; [`Store::change_values`] gives a row.
/// MySQL has no `ON CONFLICT`; sea-query renders a bare `do_nothing()` there as the invalid
/// `ON DUPLICATE KEY IGNORE`, and `do_nothing_on` as its no-op `ON DUPLICATE KEY UPDATE rv = rv`
/// (PostgreSQL and SQLite get the same `ON CONFLICT DO NOTHING` either way).
fn changes_head() -> InsertStatement {
    Query::insert()
        .into_table(Changes::Table)
        .columns([
            Changes::ClusterId,
            Changes::Rv,
            Changes::Resource,
            Changes::Namespace,
            Changes::Name,
            Changes::EventType,
            Changes::Labels,
            Changes::PrevLabels,
            Changes::Body,
            Changes::CreatedAt,
        ])
        .on_conflict(OnConflict::new().do_nothing_on([Changes::Rv]).to_owned())
        .to_owned()
}

/// The INSERT of one change-log row (from [`Store::change_values`]).
fn one_change(row: [Expr; 10]) -> InsertStatement {
    let mut insert = changes_head();
    insert.values_panic(row);
    insert
}

/// The primary key already taken: the driver's unique-violation code, not its wording.
fn unique_to_exists(e: sea_orm::DbErr) -> StoreError {
    if matches!(
        e.sql_err(),
        Some(sea_orm::SqlErr::UniqueConstraintViolation(_))
    ) {
        StoreError::AlreadyExists
    } else {
        e.into()
    }
}

/// Takes the resourceVersion counter's row lock and reads `(rv, compacted_rv)` under it: one
/// round trip where the backend has `UPDATE … RETURNING`.
pub(super) async fn lock_counter(
    txn: &DatabaseTransaction,
    backend: DbBackend,
    cluster_id: &str,
) -> Result<(i64, i64), StoreError> {
    let mut lock = Query::update();
    lock.table(StoreState::Table)
        .value(StoreState::Rv, Expr::col(StoreState::Rv))
        .and_where(Expr::col(StoreState::ClusterId).eq(cluster_id));
    if backend == DbBackend::MySql {
        txn.execute(&lock).await?;
        return super::read::versions(txn, backend, cluster_id).await;
    }
    lock.returning(Query::returning().columns([StoreState::Rv, StoreState::CompactedRv]));
    let row = txn
        .query_one(&lock)
        .await?
        .ok_or_else(|| super::read::no_state_row(cluster_id, backend))?;
    Ok((row.try_get("", "rv")?, row.try_get("", "compacted_rv")?))
}

/// The stored state of the object a write targets, read under the counter's row lock.
pub(super) struct Current {
    pub(super) id: i64,
    pub(super) rv: i64,
}

/// A writer's decision on one target, with the current object it was made on.
pub(super) struct Decided {
    pub(super) mutation: Mutation,
    pub(super) current: Option<Value>,
    /// The put's row but for its version, prepared by the writer (see [`super::prepared`]);
    /// taken by the round that writes it (a retry computes it again).
    pub(super) prepared: Option<Prepared>,
}

/// A decided mutation with its resourceVersion assigned (the object stamped with it): what
/// [`Store::apply_one`] writes at once and [`Store::stage`] leaves to [`Store::write_staged`].
// One lives briefly per write and is matched at once: boxing the row would only add an
// allocation.
#[allow(clippy::large_enum_variant)]
enum Versioned<'a> {
    /// Nothing to write: the object is unchanged, or a delete found nothing.
    Nothing(Applied),
    /// A create, or the replacement of the row `replaces`.
    Put {
        event: EventType,
        parts: RowParts,
        object: &'a Value,
        previous: Option<&'a Value>,
        replaces: Option<&'a Current>,
    },
    /// The removal of `current`; `object` is its last state, with the deletion's version.
    Delete {
        current: &'a Current,
        object: &'a Value,
    },
}

/// Gives `decided` the next resourceVersion after `rv` (advancing it) when it writes
/// something; `base_rv` is the round's starting version.
fn version<'a>(
    target: &Target<'_>,
    current: Option<&'a Current>,
    decided: &'a mut Decided,
    rv: &mut i64,
    base_rv: i64,
) -> Versioned<'a> {
    let Decided {
        mutation,
        current: current_object,
        prepared,
    } = decided;
    match (mutation, current, current_object.as_mut()) {
        (Mutation::Unchanged, _, previous) => Versioned::Nothing(Applied {
            event: None,
            resource_version: previous.as_deref().and_then(current_rv).unwrap_or(0),
            json: None,
        }),
        (Mutation::Put(object), replaces, previous) => {
            *rv += 1;
            object["metadata"]["resourceVersion"] = Value::String(rv.to_string());
            Versioned::Put {
                event: match replaces {
                    Some(_) => EventType::Modified,
                    None => EventType::Added,
                },
                parts: RowParts::of(target.resource, object, *rv, prepared.take()),
                object,
                previous: previous.map(|p| &*p),
                replaces,
            }
        }
        (Mutation::Delete, Some(current), Some(object)) => {
            *rv += 1;
            object["metadata"]["resourceVersion"] = Value::String(rv.to_string());
            Versioned::Delete { current, object }
        }
        (Mutation::Delete, ..) => Versioned::Nothing(Applied {
            event: None,
            resource_version: base_rv,
            json: None,
        }),
    }
}

/// What a round did with one decision.
pub(super) struct Applied {
    pub(super) event: Option<EventType>,
    pub(super) resource_version: i64,
    /// The object as written, as JSON with its resourceVersion (puts only): serialized once
    /// for the row, then shared by the feed and the writer's response.
    pub(super) json: Option<bytes::Bytes>,
}

impl Applied {
    fn put(event: EventType, rv: i64, parts: &RowParts) -> Self {
        Applied {
            event: Some(event),
            resource_version: rv,
            json: Some(parts.json()),
        }
    }

    fn deleted(rv: i64) -> Self {
        Applied {
            event: Some(EventType::Deleted),
            resource_version: rv,
            json: None,
        }
    }
}

impl Decided {
    /// The outcome the writer sees: the object as written (a delete's last state, with the
    /// deletion's resourceVersion), or as it was when nothing changed.
    pub(super) fn into_outcome(self, applied: Applied) -> WriteOutcome {
        let object = match self.mutation {
            Mutation::Put(object) => Some(object),
            Mutation::Delete | Mutation::Unchanged => self.current,
        };
        WriteOutcome {
            object,
            json: applied.json,
            event: applied.event,
            resource_version: applied.resource_version,
        }
    }
}

/// Drops change-log entries older than the retention window and beyond the count bound,
/// and advances `compacted_rv` so watches from before it get 410 Expired.
pub(super) async fn compact(store: &Store) -> Result<i64, StoreError> {
    let (current, compacted) = store.versions().await?;
    let opts = store.options();
    let by_count = current - opts.watch_history_max_events;
    let cutoff_time = now_unix() - opts.watch_history.as_secs() as i64;
    let by_age: Option<i64> = store
        .connection()
        .query_one(
            &Query::select()
                .expr_as(
                    Expr::col(Changes::Rv).max(),
                    sea_orm::sea_query::Alias::new("m"),
                )
                .from(Changes::Table)
                .and_where(Expr::col(Changes::ClusterId).eq(store.cluster_id()))
                .and_where(Expr::col(Changes::CreatedAt).lt(cutoff_time))
                .to_owned(),
        )
        .await?
        .and_then(|r| r.try_get::<Option<i64>>("", "m").ok().flatten());
    // Both bounds apply: an entry goes when it is too old or when too many newer ones exist.
    let horizon = std::cmp::max(by_age.unwrap_or(0), by_count);
    if horizon <= compacted {
        return Ok(compacted);
    }
    let statements = [
        Query::delete()
            .from_table(Changes::Table)
            .and_where(Expr::col(Changes::ClusterId).eq(store.cluster_id()))
            .and_where(Expr::col(Changes::Rv).lte(horizon))
            .to_owned()
            .into(),
        Query::update()
            .table(StoreState::Table)
            .value(StoreState::CompactedRv, horizon)
            .and_where(Expr::col(StoreState::ClusterId).eq(store.cluster_id()))
            .and_where(Expr::col(StoreState::CompactedRv).lt(horizon))
            .to_owned()
            .into(),
    ];
    store.write_alone(|_| statements.to_vec()).await?;
    Ok(horizon)
}

/// A statement of a transaction [`Store::write_alone`] runs.
#[derive(Clone)]
pub(super) enum Statement {
    Delete(DeleteStatement),
    Update(UpdateStatement),
}

impl From<DeleteStatement> for Statement {
    fn from(s: DeleteStatement) -> Self {
        Statement::Delete(s)
    }
}

impl From<UpdateStatement> for Statement {
    fn from(s: UpdateStatement) -> Self {
        Statement::Update(s)
    }
}

impl Store {
    /// Runs the statements `plan` makes of the counter's `(current, compacted)` pair in one
    /// transaction on the writer connection (closed if the transaction fails, see
    /// [`super::Writer`]); returns the pair as read.
    pub(super) async fn write_alone(
        &self,
        plan: impl FnOnce((i64, i64)) -> Vec<Statement>,
    ) -> Result<(i64, i64), StoreError> {
        let mut writer = self.write_lock.lock().await;
        let db = writer.connection(self.options()).await?;
        let result = async {
            let txn = db.begin().await?;
            // The counter's row lock orders this against writers in other processes too.
            let versions = lock_counter(&txn, self.backend(), self.cluster_id()).await?;
            for statement in plan(versions) {
                match statement {
                    Statement::Delete(s) => txn.execute(&s).await?,
                    Statement::Update(s) => txn.execute(&s).await?,
                };
            }
            txn.commit().await?;
            Ok(versions)
        }
        .await;
        if let Err(e) = &result {
            writer.discard(e);
        }
        result
    }
}

/// Moves the resourceVersion counter and the watch horizon up to at least `floor`, in one
/// transaction under the write lock; returns the new `(current, compacted)` pair.
///
/// Taking over a group from etcd-backed storage needs it: clients still hold etcd revisions
/// (from lists, watches and bookmarks), and a revision that also names one of our versions
/// would resume a watch at the wrong place. With every version of ours above `floor` and
/// everything up to it compacted, such a revision gets 410 Gone and the client relists.
pub(super) async fn raise_version_floor(
    store: &Store,
    floor: i64,
) -> Result<(i64, i64), StoreError> {
    let raised = |(current, compacted): (i64, i64)| {
        (
            std::cmp::max(current, floor),
            std::cmp::max(compacted, floor),
        )
    };
    let versions = store
        .write_alone(|versions| {
            let (current, compacted) = raised(versions);
            vec![
                Query::delete()
                    .from_table(Changes::Table)
                    .and_where(Expr::col(Changes::ClusterId).eq(store.cluster_id()))
                    .and_where(Expr::col(Changes::Rv).lte(compacted))
                    .to_owned()
                    .into(),
                Query::update()
                    .table(StoreState::Table)
                    .value(StoreState::Rv, current)
                    .value(StoreState::CompactedRv, compacted)
                    .and_where(Expr::col(StoreState::ClusterId).eq(store.cluster_id()))
                    .to_owned()
                    .into(),
            ]
        })
        .await?;
    Ok(raised(versions))
}
