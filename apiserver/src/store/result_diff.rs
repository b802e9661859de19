//! What an update changes in a report's `results` rows (pure).
//!
//! Producers rewrite big reports to change little: falcosidekick keeps the newest thousand
//! events of a namespace in one report and rewrites it on every event, dropping the oldest;
//! a scanner re-reports a namespace with one finding changed. Rewriting every row of such a
//! report made each update cost its size in rows, index entries and log. Instead an update
//! compares the rows stored with the rows of the new version, as a multiset: a row equal to a
//! stored one keeps its slot, whatever its position in the report now; only rows that are gone
//! are deleted and only rows that are new are inserted (a changed result is both). So an
//! update touches rows in proportion to the results that changed, and a report whose results
//! moved (one dropped at the front, one appended) is two rows of work, not a thousand.
//!
//! `ordinal` is therefore a slot in the report, unique per report, not the result's position:
//! new rows take the slots freed by removed ones first, then slots after the highest.

use std::collections::{HashMap, HashSet};

use sea_orm::QueryResult;
use sea_orm::sea_query::Expr;

use super::StoreError;
use super::columns::{ResultRow, RowTime};

/// What a round knows of a report's stored `results` rows before it replaces the report.
#[derive(Debug)]
pub(super) enum StoredRows {
    /// The rows with their slots, as read (empty: none, or not read because not replaced).
    Read(Vec<(i32, ResultColumns)>),
    /// None of them can stay (see [`none_can_stay`]): they go by report, unread.
    NoneStay,
}

impl Default for StoredRows {
    fn default() -> Self {
        StoredRows::Read(Vec::new())
    }
}

/// Whether no row of a report's new version can equal a row stored for its previous version
/// `old` (the rows cut from the body the writer read): then the diff clears, and the stored
/// rows need not be read (a report whose every result changed). Comparing rows by rule key
/// rather than rule id loses nothing: an id has one key, so rows whose keys differ have
/// different ids too. And should the stored
/// rows differ from `old`'s (cut by a release that cut them differently), clearing is still a
/// correct diff, only not the smallest.
pub(super) fn none_can_stay(old: &[ResultRow], new: &[ResultRow]) -> bool {
    let old: HashSet<&ResultRow> = old.iter().collect();
    !new.iter().any(|row| old.contains(row))
}

/// How many columns a `results` row has.
pub(super) const RESULT_COLUMN_COUNT: usize = 14;

/// The values of a `results` row, in `statements::RESULT_COLUMNS`' order.
pub(super) type ResultValues = [Expr; RESULT_COLUMN_COUNT];

/// A `results` row but for its report and slot: what the diff compares.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct ResultColumns {
    pub rule_id: i64,
    pub result: Option<String>,
    pub own_subject: bool,
    pub subject_api_version: Option<String>,
    pub subject_kind: Option<String>,
    pub subject_namespace: Option<String>,
    pub subject_name: Option<String>,
    pub subject_uid: Option<String>,
    pub timestamp: Option<i64>,
    pub message: Option<String>,
    pub properties: Option<String>,
    /// `false`: the row has its report's time and `timestamp` is `None`.
    pub own_timestamp: bool,
}

impl ResultColumns {
    /// The row of `row`, whose rule is `rule_id`.
    pub(super) fn of(row: ResultRow, rule_id: i64) -> Self {
        let own_subject = row.subject.is_some();
        let subject = row.subject.unwrap_or(super::columns::ResultSubject {
            kind: None,
            namespace: None,
            name: None,
            uid: None,
        });
        let (own_timestamp, timestamp) = match row.timestamp {
            RowTime::Report => (false, None),
            RowTime::Own(seconds) => (true, seconds),
        };
        ResultColumns {
            rule_id,
            result: row.result,
            own_subject,
            subject_api_version: row.subject_api_version,
            subject_kind: subject.kind,
            subject_namespace: subject.namespace,
            subject_name: subject.name,
            subject_uid: subject.uid,
            timestamp,
            message: row.message,
            properties: row.properties,
            own_timestamp,
        }
    }

    /// A stored row read with every column: its report, slot and columns.
    pub(super) fn read(row: &QueryResult) -> Result<(i64, i32, Self), StoreError> {
        Ok((
            row.try_get("", "object_id")?,
            row.try_get("", "ordinal")?,
            ResultColumns {
                rule_id: row.try_get("", "rule_id")?,
                result: row.try_get("", "result")?,
                own_subject: row.try_get("", "own_subject")?,
                subject_api_version: row.try_get("", "subject_api_version")?,
                subject_kind: row.try_get("", "subject_kind")?,
                subject_namespace: row.try_get("", "subject_namespace")?,
                subject_name: row.try_get("", "subject_name")?,
                subject_uid: row.try_get("", "subject_uid")?,
                timestamp: row.try_get("", "timestamp")?,
                message: row.try_get("", "message")?,
                properties: row.try_get("", "properties")?,
                own_timestamp: row.try_get("", "own_timestamp")?,
            },
        ))
    }

    /// The row's values in `RESULT_COLUMNS`' order, for report `id` at slot `ordinal`.
    pub(super) fn values(self, id: &Expr, ordinal: i32) -> ResultValues {
        [
            id.clone(),
            ordinal.into(),
            self.rule_id.into(),
            self.result.into(),
            self.own_subject.into(),
            self.subject_api_version.into(),
            self.subject_kind.into(),
            self.subject_namespace.into(),
            self.subject_name.into(),
            self.subject_uid.into(),
            self.timestamp.into(),
            self.message.into(),
            self.properties.into(),
            self.own_timestamp.into(),
        ]
    }
}

/// The rows of `rows`, whose rules are `rule_ids`.
pub(super) fn columns_of(rows: Vec<ResultRow>, rule_ids: &[i64]) -> Vec<ResultColumns> {
    rows.into_iter()
        .zip(rule_ids)
        .map(|(row, rule_id)| ResultColumns::of(row, *rule_id))
        .collect()
}

/// The rows of a new report, at slots 0, 1, …
pub(super) fn all_new(rows: Vec<ResultColumns>) -> Vec<(i32, ResultColumns)> {
    rows.into_iter()
        .enumerate()
        .map(|(slot, row)| (slot as i32, row))
        .collect()
}

/// What turns a report's stored rows into the rows of its new version.
#[derive(Debug, Default, PartialEq)]
pub(super) struct ResultDiff {
    /// Slots whose rows go.
    pub removed: Vec<i32>,
    /// Rows to insert, with their slots.
    pub added: Vec<(i32, ResultColumns)>,
    /// No stored row stays: the rows can go by report, one index range, rather than slot by
    /// slot.
    pub clears: bool,
}

/// The diff from what is known of the `stored` rows to `new` (the new version's rows, in
/// order).
pub(super) fn diff_from(stored: &StoredRows, new: Vec<ResultColumns>) -> ResultDiff {
    match stored {
        StoredRows::Read(rows) => diff(rows, new),
        StoredRows::NoneStay => ResultDiff {
            removed: Vec::new(),
            added: all_new(new),
            clears: true,
        },
    }
}

/// The diff from `stored` (slot, row) to `new` (the new version's rows, in order).
fn diff(stored: &[(i32, ResultColumns)], new: Vec<ResultColumns>) -> ResultDiff {
    let next_free = stored.iter().map(|(slot, _)| slot + 1).max().unwrap_or(0);
    let mut slots_of: HashMap<&ResultColumns, Vec<i32>> = HashMap::with_capacity(stored.len());
    for (slot, row) in stored {
        slots_of.entry(row).or_default().push(*slot);
    }
    // Equal rows pair up in slot order, so a diff of equal multisets removes nothing.
    for slots in slots_of.values_mut() {
        slots.sort_unstable_by(|a, b| b.cmp(a));
    }
    let mut added_rows = Vec::new();
    for row in new {
        match slots_of.get_mut(&row).and_then(Vec::pop) {
            Some(_kept) => {}
            None => added_rows.push(row),
        }
    }
    let mut removed: Vec<i32> = slots_of.into_values().flatten().collect();
    removed.sort_unstable();
    let clears = !stored.is_empty() && removed.len() == stored.len();
    let added = if clears {
        // Nothing stays: the rows are numbered afresh, as a create numbers them.
        all_new(added_rows)
    } else {
        let free = removed.iter().copied().chain(next_free..);
        free.zip(added_rows).collect()
    };
    ResultDiff {
        removed,
        added,
        clears,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn row(rule_id: i64, result: &str, message: &str) -> ResultColumns {
        ResultColumns {
            rule_id,
            result: Some(result.to_owned()),
            own_subject: false,
            subject_api_version: Some("v1".to_owned()),
            subject_kind: None,
            subject_namespace: None,
            subject_name: None,
            subject_uid: None,
            timestamp: Some(1_700_000_000),
            message: Some(message.to_owned()),
            properties: None,
            own_timestamp: true,
        }
    }

    /// Applies `diff` to `stored` as the database would: the slots' rows after it.
    fn apply(stored: &[(i32, ResultColumns)], diff: &ResultDiff) -> BTreeMap<i32, ResultColumns> {
        let mut slots: BTreeMap<i32, ResultColumns> = stored.iter().cloned().collect();
        for slot in &diff.removed {
            assert!(slots.remove(slot).is_some(), "removes a stored slot");
        }
        for (slot, row) in &diff.added {
            assert!(
                slots.insert(*slot, row.clone()).is_none(),
                "slot {slot} is free"
            );
        }
        slots
    }

    fn sorted(mut rows: Vec<ResultColumns>) -> Vec<ResultColumns> {
        rows.sort_by_key(|r| format!("{r:?}"));
        rows
    }

    #[test]
    fn one_changed_result_is_one_row_removed_and_one_added_in_its_slot() {
        let stored: Vec<_> = all_new((0..1000).map(|i| row(i, "pass", "ok")).collect());
        let mut new: Vec<_> = (0..1000).map(|i| row(i, "pass", "ok")).collect();
        new[417] = row(417, "fail", "fired");
        let d = diff(&stored, new);
        assert_eq!(d.removed, vec![417]);
        assert_eq!(d.added, vec![(417, row(417, "fail", "fired"))]);
    }

    #[test]
    fn a_rotation_drops_the_oldest_and_appends_the_newest_without_moving_the_rest() {
        let stored = all_new((0..1000).map(|i| row(i, "pass", "ok")).collect());
        let new: Vec<_> = (1..1001).map(|i| row(i, "pass", "ok")).collect();
        let d = diff(&stored, new);
        assert_eq!(d.removed, vec![0]);
        assert_eq!(d.added, vec![(0, row(1000, "pass", "ok"))]);
    }

    #[test]
    fn equal_rows_keep_their_slots_and_extra_copies_go() {
        let stored = all_new(vec![row(1, "pass", "a"); 3]);
        let d = diff(&stored, vec![row(1, "pass", "a"); 2]);
        assert_eq!(d.removed, vec![2]);
        assert!(d.added.is_empty());
        assert_eq!(
            diff(&stored, vec![row(1, "pass", "a"); 3]),
            ResultDiff::default()
        );
    }

    #[test]
    fn new_rows_fill_freed_slots_first_then_follow_the_highest() {
        // Row 3 stays, so the rest are not numbered afresh.
        let stored = vec![
            (0, row(0, "pass", "a")),
            (3, row(3, "pass", "a")),
            (5, row(5, "pass", "a")),
        ];
        let d = diff(
            &stored,
            vec![
                row(3, "pass", "a"),
                row(7, "pass", "a"),
                row(8, "pass", "a"),
                row(9, "pass", "a"),
            ],
        );
        assert_eq!(d.removed, vec![0, 5]);
        let slots: Vec<i32> = d.added.iter().map(|(s, _)| *s).collect();
        assert_eq!(slots, vec![0, 5, 6]);
    }

    #[test]
    fn when_nothing_stays_the_rows_go_by_report_and_are_numbered_afresh() {
        let stored = vec![(4, row(0, "pass", "a")), (9, row(1, "pass", "a"))];
        let d = diff(&stored, vec![row(0, "fail", "b"), row(1, "fail", "b")]);
        assert!(d.clears);
        assert_eq!(d.removed, vec![4, 9]);
        let slots: Vec<i32> = d.added.iter().map(|(s, _)| *s).collect();
        assert_eq!(slots, vec![0, 1]);
        assert!(!diff(&[], vec![row(0, "pass", "a")]).clears);
    }

    #[test]
    fn a_rescan_keeps_the_rows_of_unchanged_outcomes_and_only_a_full_change_skips_the_read() {
        use reports_server_crds::catalog::POLICY_REPORT;
        use serde_json::json;

        use crate::store::columns::result_rows;

        let report = |seconds: i64, outcomes: &[(&str, &str)]| {
            let results: Vec<_> = outcomes
                .iter()
                .map(|(rule, result)| {
                    json!({"policy": "p", "rule": rule, "result": result, "source": "kyverno",
                        "timestamp": {"seconds": seconds, "nanos": 0}})
                })
                .collect();
            result_rows(&POLICY_REPORT, &json!({"results": results}))
        };
        // Every result moves to the rescan's time, which the report holds: rows stay equal.
        let old = report(1, &[("a", "pass"), ("b", "pass")]);
        let rescan = report(2, &[("a", "pass"), ("b", "fail")]);
        assert_eq!(old[0], rescan[0]);
        assert!(!none_can_stay(&old, &rescan));
        assert!(none_can_stay(
            &old,
            &report(2, &[("a", "fail"), ("b", "fail")])
        ));
        assert!(none_can_stay(&[], &report(2, &[("a", "pass")])));
        let d = diff_from(
            &StoredRows::NoneStay,
            vec![row(0, "pass", "a"), row(1, "fail", "b")],
        );
        assert!(d.clears);
        assert!(d.removed.is_empty());
        assert_eq!(
            d.added.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            vec![0, 1]
        );
    }

    fn any_row() -> impl Strategy<Value = ResultColumns> {
        (0i64..4, prop::sample::select(vec!["pass", "fail"]), 0u8..3)
            .prop_map(|(rule, result, m)| row(rule, result, &format!("m{m}")))
    }

    proptest! {
        /// After any sequence of versions, the stored rows are exactly the latest version's
        /// (as a multiset) in unique slots, and only rows not in the new version were removed.
        #[test]
        fn any_sequence_of_updates_stores_exactly_the_latest_rows(
            versions in prop::collection::vec(prop::collection::vec(any_row(), 0..12), 1..8)
        ) {
            let mut stored: Vec<(i32, ResultColumns)> = Vec::new();
            for version in versions {
                let d = diff(&stored, version.clone());
                let mut unmatched: Vec<ResultColumns> = stored.iter().map(|(_, r)| r.clone()).collect();
                for row in &version {
                    if let Some(i) = unmatched.iter().position(|r| r == row) {
                        unmatched.swap_remove(i);
                    }
                }
                prop_assert_eq!(d.removed.len(), unmatched.len());
                prop_assert_eq!(stored.len() - d.removed.len() + d.added.len(), version.len());
                let after = apply(&stored, &d);
                prop_assert_eq!(
                    sorted(after.values().cloned().collect()),
                    sorted(version)
                );
                stored = after.into_iter().collect();
            }
        }
    }
}
