//! The JSON work of a put, done by its writer before the group commit round (pure).
//!
//! A round's statements run one after the other on one connection while the next round's
//! writers wait, so whatever the round computes is paid serially by every write. All that a
//! stored object needs apart from its resourceVersion — the body and `metadata` texts, the
//! indexed columns, the result rows — is computed by each writer in its own task, concurrently
//! with the other writers and with the previous round's statements; the round only splices the
//! version it assigns into two texts.

use std::sync::LazyLock;

use reports_server_crds::ResourceDescriptor;
use serde_json::Value;

use super::columns::{ObjectColumns, ResultRow, result_rows};

/// Stands where the resourceVersion goes in prepared texts. Random per process, so no object
/// a client sends can contain it.
static SLOT: LazyLock<String> =
    LazyLock::new(|| format!("rv-slot-{}", uuid::Uuid::new_v4().simple()));

/// JSON text without the value of one resourceVersion: it goes at byte `at`, inside the
/// quotes that are already there.
#[derive(Clone, Debug)]
pub(super) struct VersionSlot {
    text: String,
    at: usize,
}

impl VersionSlot {
    /// `text` with [`SLOT`] where the version goes; `None` if it is not there.
    fn of(mut text: String) -> Option<Self> {
        let at = text.find(SLOT.as_str())?;
        text.replace_range(at..at + SLOT.len(), "");
        Some(VersionSlot { text, at })
    }

    /// The text with resourceVersion `rv`.
    pub(super) fn with(&self, rv: i64) -> String {
        let rv = rv.to_string();
        let mut out = String::with_capacity(self.text.len() + rv.len());
        out.push_str(&self.text[..self.at]);
        out.push_str(&rv);
        out.push_str(&self.text[self.at..]);
        out
    }
}

/// What a put writes, but for its resourceVersion.
#[derive(Clone, Debug)]
pub(super) struct Prepared {
    /// The `body` column.
    pub body: VersionSlot,
    /// The `metadata` column (`columns.metadata` is left empty).
    pub metadata: VersionSlot,
    pub columns: ObjectColumns,
    pub results: Vec<ResultRow>,
    /// The rule id of each result that the writer found committed (see [`super::rules`]);
    /// the round resolves the others.
    pub rule_ids: Vec<Option<i64>>,
}

impl Prepared {
    /// Prepares the put of `object`. Its `metadata.resourceVersion` is left holding the slot
    /// (at the position the version will have): the round sets the version before anything
    /// reads the object. `None` for an object without a `metadata` object.
    pub(super) fn of(resource: &ResourceDescriptor, object: &mut Value) -> Option<Prepared> {
        object
            .get_mut("metadata")?
            .as_object_mut()?
            .insert("resourceVersion".into(), Value::String(SLOT.clone()));
        let body = VersionSlot::of(object.to_string())?;
        let mut columns = ObjectColumns::of(resource, object);
        let metadata = VersionSlot::of(std::mem::take(&mut columns.metadata))?;
        Some(Prepared {
            body,
            metadata,
            columns,
            results: result_rows(resource, object),
            rule_ids: Vec::new(),
        })
    }
}

/// The row of a put with its resourceVersion: from the writer's [`Prepared`] when there is
/// one, else computed here from the object (retries, writes the round makes itself).
pub(super) struct RowParts {
    pub body: String,
    pub columns: ObjectColumns,
    pub results: Vec<ResultRow>,
    /// Rule ids known before the round, by result (shorter than `results`, or empty, when
    /// some are not).
    pub rule_ids: Vec<Option<i64>>,
}

impl RowParts {
    /// The body as the feed and the writer's response share it.
    pub(super) fn json(&self) -> bytes::Bytes {
        bytes::Bytes::from(self.body.clone())
    }

    /// `object` already carries `rv` as its resourceVersion.
    pub(super) fn of(
        resource: &ResourceDescriptor,
        object: &Value,
        rv: i64,
        prepared: Option<Prepared>,
    ) -> RowParts {
        match prepared {
            Some(p) => {
                let mut columns = p.columns;
                columns.metadata = p.metadata.with(rv);
                let parts = RowParts {
                    body: p.body.with(rv),
                    columns,
                    results: p.results,
                    rule_ids: p.rule_ids,
                };
                debug_assert_eq!(parts.body, object.to_string(), "prepared body");
                debug_assert_eq!(
                    parts.columns,
                    ObjectColumns::of(resource, object),
                    "prepared columns"
                );
                parts
            }
            None => RowParts {
                body: object.to_string(),
                columns: ObjectColumns::of(resource, object),
                results: result_rows(resource, object),
                rule_ids: Vec::new(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reports_server_crds::catalog;
    use reports_server_crds::fixtures::{Subject, pss_policy_report};

    fn prepared_then_versioned(mut object: Value, rv: i64) -> (RowParts, RowParts) {
        let resource = &catalog::POLICY_REPORT;
        let prepared = Prepared::of(resource, &mut object).expect("has metadata");
        object["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        (
            RowParts::of(resource, &object, rv, Some(prepared)),
            RowParts::of(resource, &object, rv, None),
        )
    }

    #[test]
    fn a_prepared_row_is_the_row_computed_after_the_version_is_set() {
        let subject = Subject::pod("ns", 3);
        let report =
            serde_json::to_value(pss_policy_report(&subject, 1_700_000_000, &[1])).unwrap();
        for (object, rv) in [
            // No resourceVersion yet (a create): the version is appended to `metadata`.
            (report.clone(), 7),
            // A version already there (an update): replaced in place.
            (
                {
                    let mut o = report.clone();
                    o["metadata"]["resourceVersion"] = "41".into();
                    o["metadata"]["labels"] = serde_json::json!({"a": "b"});
                    o
                },
                1_000_000_000_042,
            ),
        ] {
            let (prepared, computed) = prepared_then_versioned(object, rv);
            assert_eq!(prepared.body, computed.body);
            assert_eq!(prepared.columns, computed.columns);
            assert_eq!(prepared.results, computed.results);
            assert!(
                prepared
                    .body
                    .contains(&format!("\"resourceVersion\":\"{rv}\""))
            );
        }
    }

    #[test]
    fn objects_without_metadata_are_not_prepared() {
        let mut object = serde_json::json!({"kind": "PolicyReport", "metadata": "x"});
        assert!(Prepared::of(&catalog::POLICY_REPORT, &mut object).is_none());
    }
}
