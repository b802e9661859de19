//! Writes. Every write runs in a group commit round (see `group_commit`) whose transaction (1)
//! takes the resourceVersion counter's row lock, (2) checks that each target is still at the
//! version its writer decided on (see `mutate`), (3) writes the object, its labels and its
//! result rows, and (4) appends to the change log. A read-modify-write request (patch, apply,
//! finalizer removal) whose object changed in between decides again on the new state, so
//! such requests never race and never surface a conflict the client did not cause.
//!
//! The types a round speaks are `decision`'s, its statements `statements`', and the one-body-copy
//! rule of the change log is `change_log`'s.

use std::collections::{BTreeMap, HashMap};

use sea_orm::sea_query::{Expr, ExprTrait, Func, InsertStatement, Query, UpdateStatement};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend};
use serde_json::Value;

use super::change_log::{BODY_IN_OBJECTS, object_row_of_change};
use super::columns::{ObjectColumns, labels_of};
use super::decision::{Applied, Current, Decided, Target, Versioned, version};
use super::feed::{EventType, NOTIFY_CHANNEL};
use super::policy_rules::RoundRules;
use super::prepared::RowParts;
use super::result_diff::{ResultColumns, ResultDiff, all_new, columns_of, diff_from};
use super::schema::{Changes, ObjectLabels, Objects, Results, StoreState};
use super::statements::{
    KEYS_PER_STATEMENT, OBJECT_COLUMNS, ObjectValues, RESULT_COLUMNS, UNIQUE_KEY_COLUMNS,
    delete_slots, delete_where_in, labels_head, multi_row_inserts, objects_head, one_change,
    results_head, slot_values, unique_to_exists,
};
use super::{Store, StoreError};

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
                        let row = (key, target, current);
                        self.update_row(txn, row, previous, parts, *rv, rules)
                            .await?;
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
    pub(super) fn counter_advance(&self, rv: i64) -> UpdateStatement {
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
    pub(super) async fn retire_bodies(
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
    pub(super) fn retirement(&self, rvs: &[i64]) -> UpdateStatement {
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
        let results = all_new(columns_of(results, &rule_ids));
        self.write_side_rows(txn, &Expr::val(id), &cols.labels, results)
            .await?;
        txn.execute(&change).await.map_err(StoreError::from)?;
        Ok(())
    }

    /// Updates the object's row in place and its side rows by what changed (see
    /// [`SideChanges`]).
    async fn update_row(
        &self,
        txn: &DatabaseTransaction,
        (key, target, current): (&str, &Target<'_>, &Current),
        previous: Option<&Value>,
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
        let rule_ids = rules.ids_of(&results, &known)?;
        let values = self.object_values(key, target, &cols, body, rv);
        let mut update = Query::update();
        update
            .table(Objects::Table)
            .and_where(Expr::col(Objects::Id).eq(current.id));
        // The key columns stay as they are.
        for (column, value) in OBJECT_COLUMNS
            .into_iter()
            .zip(values)
            .skip(UNIQUE_KEY_COLUMNS)
        {
            update.value(column, value);
        }
        txn.execute(&update).await?;
        let changes = SideChanges::of(
            current,
            previous,
            cols.labels,
            columns_of(results, &rule_ids),
        );
        let id = Expr::val(current.id);
        if let Some(labels) = &changes.labels {
            delete_where_in(
                txn,
                ObjectLabels::Table,
                ObjectLabels::ObjectId,
                &[current.id],
            )
            .await?;
            if let Some(insert) = self.labels_insert(&id, labels) {
                txn.execute(&insert).await?;
            }
        }
        if changes.results.clears {
            delete_where_in(txn, Results::Table, Results::ObjectId, &[current.id]).await?;
        } else {
            let slots: Vec<(i64, i32)> = changes
                .results
                .removed
                .iter()
                .map(|s| (current.id, *s))
                .collect();
            for delete in delete_slots(&slots) {
                txn.execute(&delete).await?;
            }
        }
        for insert in multi_row_inserts(results_head, slot_values(&id, changes.results.added)) {
            txn.execute(&insert).await?;
        }
        Ok(())
    }

    /// The stored result rows of the reports `ids`, with their slots, by report.
    pub(super) async fn result_rows_of(
        &self,
        txn: &impl ConnectionTrait,
        ids: &[i64],
    ) -> Result<HashMap<i64, Vec<(i32, ResultColumns)>>, StoreError> {
        let mut by_report: HashMap<i64, Vec<(i32, ResultColumns)>> = HashMap::new();
        for chunk in ids.chunks(KEYS_PER_STATEMENT) {
            let select = Query::select()
                .columns(RESULT_COLUMNS)
                .from(Results::Table)
                .and_where(Expr::col(Results::ObjectId).is_in(chunk.iter().copied()))
                .to_owned();
            for row in txn.query_all(&select).await? {
                let (id, slot, columns) = ResultColumns::read(&row)?;
                by_report.entry(id).or_default().push((slot, columns));
            }
        }
        Ok(by_report)
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
        labels: &BTreeMap<String, String>,
        results: Vec<(i32, ResultColumns)>,
    ) -> Result<(), StoreError> {
        for insert in self
            .labels_insert(id, labels)
            .into_iter()
            .chain(multi_row_inserts(results_head, slot_values(id, results)))
        {
            txn.execute(&insert).await?;
        }
        Ok(())
    }

    /// The object's label rows; `id` is its id or an expression giving it.
    fn labels_insert(
        &self,
        id: &Expr,
        labels: &BTreeMap<String, String>,
    ) -> Option<InsertStatement> {
        if labels.is_empty() {
            return None;
        }
        let mut insert = labels_head();
        for (k, v) in labels {
            insert.values_panic([id.clone(), k.clone().into(), v.clone().into()]);
        }
        Some(insert)
    }

    /// The values of an `objects` row, in [`objects_head`]'s column order.
    pub(super) fn object_values(
        &self,
        key: &str,
        t: &Target<'_>,
        cols: &ObjectColumns,
        body: String,
        rv: i64,
    ) -> ObjectValues {
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
            cols.results_timestamp.into(),
        ]
    }

    /// The change-log row of the deletion of `object` at version `rv` (which the object
    /// already carries). The `objects` row is gone, so the entry keeps the last state itself,
    /// and its labels are the previous ones too.
    pub(super) fn deletion_change(
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
    pub(super) fn change_values(
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

/// What replacing an object changes in its side rows: its labels when they differ from the
/// stored ones (the few rows are rewritten then), and its result rows by
/// [`result_diff`](super::result_diff).
pub(super) struct SideChanges {
    pub(super) labels: Option<BTreeMap<String, String>>,
    pub(super) results: ResultDiff,
}

impl SideChanges {
    /// From the stored object `current` (whose last state is `previous`) to one with `labels`
    /// and result rows `results`.
    pub(super) fn of(
        current: &Current,
        previous: Option<&Value>,
        labels: BTreeMap<String, String>,
        results: Vec<ResultColumns>,
    ) -> Self {
        let unchanged = previous.is_some_and(|p| labels_of(p) == labels);
        SideChanges {
            labels: (!unchanged).then_some(labels),
            results: diff_from(&current.stored_results, results),
        }
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
