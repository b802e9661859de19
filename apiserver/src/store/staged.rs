//! The writes of one group commit round, applied after its decisions with multi-row
//! statements: a handful of round trips for all of them instead of several per write (creates
//! are the commonest write, Kyverno's ephemeral reports; the aggregator updates and deletes in
//! bulk).
//!
//! A replaced object's row is deleted and inserted again under the same id, so its label and
//! result rows, which refer to the id, stay where they are and change only by what the update
//! changes (see `result_diff`): the row's key and version find the change log.

use std::collections::{BTreeMap, HashMap};

use sea_orm::sea_query::{Expr, Query, WithQuery};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend};

use super::change_log::BODY_IN_OBJECTS;
use super::decision::{Applied, Current, Decided, Target, Versioned, version};
use super::policy_rules::RoundRules;
use super::prepared::RowParts;
use super::result_diff::{RESULT_COLUMN_COUNT, ResultColumns, ResultValues, all_new, columns_of};
use super::schema::{ObjectLabels, Objects, Results};
use super::statements::{
    KEYS_PER_STATEMENT, ObjectValues, changes_head, cte, delete_in, delete_slots, delete_where_in,
    insert_in_chunks, labels_head, multi_row_inserts, objects_head, objects_with_id_head,
    results_head, slot_values, unique_to_exists,
};
use super::write::SideChanges;
use super::{Store, StoreError};

/// A round's staged writes.
#[derive(Default)]
pub(super) struct StagedWrites {
    /// Rows to delete: deleted objects, and the rows of replaced ones.
    removed: Vec<RemovedRow>,
    /// Result slots the round's updates free, as `(object id, ordinal)`.
    removed_slots: Vec<(i64, i32)>,
    /// New objects' rows.
    rows: Vec<ObjectValues>,
    /// Replaced objects' rows, under their ids.
    rows_with_ids: Vec<(i64, ObjectValues)>,
    sides: Vec<ObjectSides>,
    changes: Vec<[Expr; 10]>,
}

/// A row a round deletes, with the version it holds: that version's change-log entry takes the
/// row's body ([`Store::retire_bodies`]).
struct RemovedRow {
    id: i64,
    rv: i64,
    /// Whether its label rows go too (a deleted object, or a replaced one whose labels changed).
    labels: bool,
    /// Whether all its result rows go too (a deleted object, or a replaced one none of whose
    /// results stay).
    results: bool,
}

/// Which object side rows belong to.
enum Owner {
    /// A replaced object, under its id.
    Kept(i64),
    /// A new object, whose id its insert returns.
    New {
        key: String,
        namespace: String,
        name: String,
    },
}

/// The label and result rows a round inserts for one object.
struct ObjectSides {
    owner: Owner,
    labels: BTreeMap<String, String>,
    results: Vec<(i32, ResultColumns)>,
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
            .map(|s| s.labels.len() * 3 + s.results.len() * RESULT_COLUMN_COUNT)
            .sum();
        self.changes.len() * 10 + sides + 4
    }
}

impl ObjectSides {
    /// The object's label and result rows, given its id.
    fn rows_into(self, id: &Expr, labels: &mut Vec<[Expr; 3]>, results: &mut Vec<ResultValues>) {
        for (k, v) in self.labels {
            labels.push([id.clone(), k.into(), v.into()]);
        }
        results.extend(slot_values(id, self.results));
    }
}

/// Chunks of freed result slots (up to 2,000 bind parameters each) folded into one removal
/// statement of PostgreSQL, next to its up to 3,000 others: far below the protocol's 65,535.
const SLOT_DELETES_FOLDED: usize = 4;

/// Rows per multi-row INSERT of new objects
/// ([`OBJECT_COLUMN_COUNT`](super::statements::OBJECT_COLUMN_COUNT) bind parameters each).
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
                let RowParts {
                    body,
                    columns: cols,
                    results,
                    rule_ids: known,
                } = parts;
                let rule_ids = rules.ids_of(&results, &known)?;
                let results = columns_of(results, &rule_ids);
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
                let row = self.object_values(key, target, &cols, body, *rv);
                match replaces {
                    Some(current) => {
                        let changes = SideChanges::of(current, previous, cols.labels, results);
                        staged.replace(current, row, changes);
                    }
                    None => {
                        staged.rows.push(row);
                        staged.sides.push(ObjectSides {
                            owner: Owner::New {
                                key: key.to_owned(),
                                namespace: target.namespace.to_owned(),
                                name: target.name.to_owned(),
                            },
                            labels: cols.labels,
                            results: all_new(results),
                        });
                    }
                }
                applied
            }
            Versioned::Delete { current, object } => {
                staged.removed.push(RemovedRow {
                    id: current.id,
                    rv: current.rv,
                    labels: true,
                    results: true,
                });
                staged
                    .changes
                    .push(self.deletion_change(key, target, object, *rv, now));
                Applied::deleted(*rv)
            }
        })
    }

    /// Writes a round's staged writes and moves the counter to the round's last version
    /// `last_rv`: retires the superseded bodies, deletes the removed rows and freed result
    /// slots, inserts the new and replaced rows, then their labels, result rows and change-log
    /// entries.
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
            self.remove_rows_in_one(txn, &staged.removed, &staged.removed_slots)
                .await?;
        } else {
            self.remove_rows(txn, &staged.removed, &staged.removed_slots)
                .await?;
        }
        let folds = postgres && staged.side_parameters() <= PARAMETERS_PER_FOLDED_STATEMENT;
        let ids = self.insert_rows(txn, staged.rows).await?;
        for chunk in staged.rows_with_ids.chunks(OBJECTS_PER_STATEMENT) {
            let mut insert = objects_with_id_head();
            for (id, row) in chunk {
                insert.values_panic(std::iter::once(Expr::val(*id)).chain(row.iter().cloned()));
            }
            txn.execute(&insert).await.map_err(unique_to_exists)?;
        }
        let mut labels = Vec::new();
        let mut results = Vec::new();
        for side in staged.sides {
            let id = match &side.owner {
                Owner::Kept(id) => *id,
                Owner::New {
                    key,
                    namespace,
                    name,
                } => *ids
                    .get(&(key.clone(), namespace.clone(), name.clone()))
                    .ok_or_else(|| {
                        StoreError::Inconsistent(format!(
                            "INSERT … RETURNING returned no id for {key} {namespace}/{name}"
                        ))
                    })?,
            };
            side.rows_into(&Expr::val(id), &mut labels, &mut results);
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

    /// Inserts new objects' rows; their ids by resource key, namespace and name.
    async fn insert_rows(
        &self,
        txn: &DatabaseTransaction,
        rows: Vec<ObjectValues>,
    ) -> Result<HashMap<(String, String, String), i64>, StoreError> {
        let mut ids = HashMap::new();
        let mut rows = rows.into_iter().peekable();
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
        Ok(ids)
    }

    /// [`Store::retire_bodies`], then the removed rows with what goes with them, and the freed
    /// result slots, statement by statement.
    async fn remove_rows(
        &self,
        txn: &DatabaseTransaction,
        removed: &[RemovedRow],
        slots: &[(i64, i32)],
    ) -> Result<(), StoreError> {
        let (ids, rvs, label_ids, result_ids) = removals(removed);
        self.retire_bodies(txn, &rvs).await?;
        delete_where_in(txn, Objects::Table, Objects::Id, &ids).await?;
        delete_where_in(txn, ObjectLabels::Table, ObjectLabels::ObjectId, &label_ids).await?;
        delete_where_in(txn, Results::Table, Results::ObjectId, &result_ids).await?;
        for delete in delete_slots(slots) {
            txn.execute(&delete).await?;
        }
        Ok(())
    }

    /// PostgreSQL: [`Store::remove_rows`] as one statement per [`KEYS_PER_STATEMENT`] rows (the
    /// freed slots ride along, [`SLOT_DELETES_FOLDED`] chunks of them per statement, the rest in
    /// statements of their own). Its parts share one snapshot, so the retirement still reads
    /// the bodies of the rows the same statement deletes.
    async fn remove_rows_in_one(
        &self,
        txn: &DatabaseTransaction,
        removed: &[RemovedRow],
        slots: &[(i64, i32)],
    ) -> Result<(), StoreError> {
        let mut slot_deletes = delete_slots(slots).into_iter();
        for chunk in removed.chunks(KEYS_PER_STATEMENT) {
            let (ids, rvs, label_ids, result_ids) = removals(chunk);
            let mut with = WithQuery::new();
            with.cte(cte("retired", self.retirement(&rvs)));
            if !label_ids.is_empty() {
                with.cte(cte(
                    "removed_labels",
                    delete_in(ObjectLabels::Table, ObjectLabels::ObjectId, &label_ids),
                ));
            }
            if !result_ids.is_empty() {
                with.cte(cte(
                    "removed_results",
                    delete_in(Results::Table, Results::ObjectId, &result_ids),
                ));
            }
            for (n, delete) in slot_deletes.by_ref().take(SLOT_DELETES_FOLDED).enumerate() {
                with.cte(cte(format!("removed_slots_{n}"), delete));
            }
            txn.execute(with.query(delete_in(Objects::Table, Objects::Id, &ids)))
                .await?;
        }
        for delete in slot_deletes {
            txn.execute(&delete).await?;
        }
        Ok(())
    }
}

impl StagedWrites {
    /// Stages the replacement of `current` by `row`: the row goes and comes back under its id,
    /// and its side rows change by `changes`.
    fn replace(&mut self, current: &Current, row: ObjectValues, changes: SideChanges) {
        self.removed.push(RemovedRow {
            id: current.id,
            rv: current.rv,
            labels: changes.labels.is_some(),
            results: changes.results.clears,
        });
        if !changes.results.clears {
            self.removed_slots.extend(
                changes
                    .results
                    .removed
                    .iter()
                    .map(|slot| (current.id, *slot)),
            );
        }
        self.rows_with_ids.push((current.id, row));
        self.sides.push(ObjectSides {
            owner: Owner::Kept(current.id),
            labels: changes.labels.unwrap_or_default(),
            results: changes.results.added,
        });
    }
}

/// The ids and versions of `rows`, and the ids whose labels and whose results go with them.
fn removals(rows: &[RemovedRow]) -> (Vec<i64>, Vec<i64>, Vec<i64>, Vec<i64>) {
    let ids = rows.iter().map(|r| r.id).collect();
    let rvs = rows.iter().map(|r| r.rv).collect();
    let labels = rows.iter().filter(|r| r.labels).map(|r| r.id).collect();
    let results = rows.iter().filter(|r| r.results).map(|r| r.id).collect();
    (ids, rvs, labels, results)
}
