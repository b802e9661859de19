//! Extracting the indexed columns of a stored object from its JSON (pure).

use std::collections::BTreeMap;

use reports_server_crds::{ReportLayout, ResourceDescriptor};
use serde_json::Value;

/// The relational view of one object: everything the store indexes, filters or returns
/// without decoding the body.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ObjectColumns {
    pub uid: String,
    pub generation: i64,
    pub created_at: i64,
    pub deleted_at: Option<i64>,
    pub owner_uids: String,
    pub summary: [i64; 5],
    pub scope_kind: Option<String>,
    pub scope_namespace: Option<String>,
    pub scope_name: Option<String>,
    pub scope_uid: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// `metadata` serialized on its own, for metadata-only responses.
    pub metadata: String,
    /// The time more than half of the report's analytics rows carry (see [`results_time`]).
    pub results_timestamp: Option<i64>,
}

fn parse_time(v: Option<&Value>) -> Option<i64> {
    v.and_then(Value::as_str)
        .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
        .map(|t| t.timestamp())
}

fn string(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

/// `metadata.labels` as a map (empty when absent).
pub fn labels_of(object: &Value) -> BTreeMap<String, String> {
    object["metadata"]["labels"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

impl ObjectColumns {
    pub fn of(desc: &ResourceDescriptor, object: &Value) -> Self {
        let meta = &object["metadata"];
        let summary = match desc.layout {
            ReportLayout::TopLevel => &object["summary"],
            ReportLayout::Spec => &object["spec"]["summary"],
        };
        let count = |k: &str| summary.get(k).and_then(Value::as_i64).unwrap_or(0);
        let scope = &object["scope"];
        let labels = labels_of(object);
        let owner_uids = meta["ownerReferences"]
            .as_array()
            .map(|refs| {
                refs.iter()
                    .filter_map(|r| r["uid"].as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        ObjectColumns {
            uid: meta["uid"].as_str().unwrap_or_default().to_owned(),
            generation: meta["generation"].as_i64().unwrap_or(1),
            created_at: parse_time(meta.get("creationTimestamp")).unwrap_or(0),
            deleted_at: parse_time(meta.get("deletionTimestamp")),
            owner_uids,
            summary: [
                count("pass"),
                count("fail"),
                count("warn"),
                count("error"),
                count("skip"),
            ],
            scope_kind: string(scope.get("kind")),
            scope_namespace: string(scope.get("namespace")),
            scope_name: string(scope.get("name")),
            scope_uid: string(scope.get("uid")),
            labels,
            metadata: serde_json::to_string(meta).expect("JSON value serializes"),
            results_timestamp: results_time(indexed_results(desc, object)),
        }
    }
}

/// What a result shares with every other result of the same policy rule: one row of
/// `policy_rules`, which `results` rows point to instead of repeating it (a report's results
/// differ mostly in outcome and subject; the rule's names, category and severity recur in
/// every report).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RuleKey {
    pub source: Option<String>,
    pub policy: String,
    pub rule: Option<String>,
    pub category: Option<String>,
    pub severity: Option<String>,
    pub scored: Option<bool>,
}

impl RuleKey {
    /// The rule of one entry of a report's `results`.
    pub fn of(result: &Value) -> Self {
        RuleKey {
            source: string(result.get("source")),
            policy: result["policy"].as_str().unwrap_or_default().to_owned(),
            rule: string(result.get("rule")),
            category: string(result.get("category")),
            severity: string(result.get("severity")),
            scored: result.get("scored").and_then(Value::as_bool),
        }
    }
}

/// One policy result flattened for the `results` table.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ResultRow {
    pub rule: RuleKey,
    pub result: Option<String>,
    /// `apiVersion` of what the result is about (its own subject's or the scope's).
    pub subject_api_version: Option<String>,
    /// The result's own subject (its first `resources` entry) when that is not the report's
    /// scope; `None`: the scope, which the `objects` row already holds.
    pub subject: Option<ResultSubject>,
    pub timestamp: RowTime,
    pub message: Option<String>,
    pub properties: Option<String>,
}

/// When a result was produced, as its row keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowTime {
    /// The report's [`results_time`], which the `objects` row holds.
    Report,
    /// Another time (seconds), or none, held by the row itself.
    Own(Option<i64>),
}

/// The time (`timestamp.seconds`) that more than half of `results` carry; `None` when no time
/// is that common.
///
/// Kyverno stamps every result of a scan with the scan's time, so a rescan moves all of a
/// report's results to one new time: rows that leave their time to the report stay equal
/// across rescans and an update rewrites only the results whose outcome changed, not every
/// row. Only a majority is the report's, so that the report's time does not move unless most
/// results do: a report of events (falcosidekick's ring, each result at its own time, some
/// sharing a second) or of policies scanned at different times keeps its rows' own times, and
/// a rotation or a partial rescan rewrites only the rows it changes.
pub fn results_time(results: &[Value]) -> Option<i64> {
    let mut seconds: Vec<i64> = results
        .iter()
        .filter_map(|r| r["timestamp"]["seconds"].as_i64())
        .collect();
    seconds.sort_unstable();
    seconds
        .chunk_by(|a, b| a == b)
        .find(|run| run.len() * 2 > results.len())
        .map(|run| run[0])
}

/// The object a result is about, as the `results` table keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ResultSubject {
    pub kind: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub uid: Option<String>,
}

impl ResultSubject {
    fn of(reference: &Value) -> Self {
        ResultSubject {
            kind: string(reference.get("kind")),
            namespace: string(reference.get("namespace")),
            name: string(reference.get("name")),
            uid: string(reference.get("uid")),
        }
    }
}

/// Whether reports of `desc` get analytics rows (see [`result_rows`]).
pub fn has_result_rows(desc: &ResourceDescriptor) -> bool {
    matches!(desc.layout, ReportLayout::TopLevel)
}

/// The entries of a report's `results` that get analytics rows. Intermediate (ephemeral)
/// reports get none: they are short-lived inputs of the aggregator, not results anyone
/// queries.
fn indexed_results<'a>(desc: &ResourceDescriptor, object: &'a Value) -> &'a [Value] {
    match (desc.layout, object["results"].as_array()) {
        (ReportLayout::TopLevel, Some(results)) => results,
        _ => &[],
    }
}

/// The rules of a report's analytics rows, in the order of its `results` (what
/// [`result_rows`] would give as `rule`, without building the rest of each row).
pub fn result_rules<'a>(
    desc: &ResourceDescriptor,
    object: &'a Value,
) -> impl Iterator<Item = RuleKey> + 'a {
    indexed_results(desc, object).iter().map(RuleKey::of)
}

/// The rows of the analytics table for a report, in the order of its `results`. Results
/// without subjects of their own are about the report's scope.
pub fn result_rows(desc: &ResourceDescriptor, object: &Value) -> Vec<ResultRow> {
    let scope = &object["scope"];
    let scope_subject = ResultSubject::of(scope);
    let results = indexed_results(desc, object);
    let report_time = results_time(results);
    results
        .iter()
        .map(|r| {
            let seconds = r["timestamp"]["seconds"].as_i64();
            let reference = r["resources"].as_array().and_then(|a| a.first());
            let subject = reference
                .map(ResultSubject::of)
                .filter(|own| !scope.is_object() || *own != scope_subject);
            ResultRow {
                rule: RuleKey::of(r),
                result: string(r.get("result")),
                subject_api_version: string(reference.unwrap_or(scope).get("apiVersion")),
                subject,
                timestamp: match seconds {
                    Some(_) if seconds == report_time => RowTime::Report,
                    own => RowTime::Own(own),
                },
                message: string(r.get("message")),
                properties: r.get("properties").map(|p| p.to_string()),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use reports_server_crds::catalog;
    use reports_server_crds::fixtures::{Subject, pss_ephemeral_report, pss_policy_report};

    #[test]
    fn policy_report_columns() {
        let subject = Subject::pod("ns", 3);
        let mut report =
            serde_json::to_value(pss_policy_report(&subject, 1_700_000_000, &[0, 4])).unwrap();
        report["metadata"]["creationTimestamp"] = "2024-01-01T00:00:10Z".into();
        let cols = ObjectColumns::of(&catalog::POLICY_REPORT, &report);
        assert_eq!(cols.summary, [17, 2, 0, 0, 0]);
        assert_eq!(cols.scope_uid.as_deref(), Some(subject.uid.as_str()));
        assert_eq!(cols.owner_uids, subject.uid);
        assert_eq!(cols.created_at, 1_704_067_210);
        assert_eq!(cols.labels["app.kubernetes.io/managed-by"], "kyverno");
        let rows = result_rows(&catalog::POLICY_REPORT, &report);
        assert_eq!(rows.len(), 19);
        assert_eq!(
            rows.iter()
                .filter(|r| r.result.as_deref() == Some("fail"))
                .count(),
            2
        );
        // Each result names the pod the report is scoped to: the row leaves it to the scope.
        assert!(rows.iter().all(|r| r.subject.is_none()));
        assert_eq!(rows[0].subject_api_version.as_deref(), Some("v1"));
        assert_eq!(rows[0].rule.policy, "disallow-capabilities");
    }

    #[test]
    fn a_result_about_another_object_keeps_its_subject() {
        let subject = Subject::pod("ns", 3);
        let mut report =
            serde_json::to_value(pss_policy_report(&subject, 1_700_000_000, &[])).unwrap();
        let other = Subject::pod("other", 4);
        report["results"][1]["resources"] = serde_json::json!([other.reference()]);
        report["results"][2]
            .as_object_mut()
            .unwrap()
            .remove("resources");
        let rows = result_rows(&catalog::POLICY_REPORT, &report);
        let own = rows[1].subject.as_ref().expect("a subject of its own");
        assert_eq!(own.uid.as_deref(), Some(other.uid.as_str()));
        assert_eq!(own.namespace.as_deref(), Some("other"));
        assert!(rows[0].subject.is_none() && rows[2].subject.is_none());
        assert_eq!(rows[2].subject_api_version.as_deref(), Some("v1"));
    }

    #[test]
    fn the_report_time_is_the_one_most_results_carry() {
        let at = |seconds: &[Option<i64>]| -> Vec<Value> {
            seconds
                .iter()
                .map(|s| match s {
                    Some(s) => serde_json::json!({"timestamp": {"seconds": s, "nanos": 7}}),
                    None => serde_json::json!({}),
                })
                .collect()
        };
        assert_eq!(results_time(&at(&[Some(5), Some(9), Some(5)])), Some(5));
        assert_eq!(results_time(&at(&[Some(7)])), Some(7));
        assert_eq!(results_time(&at(&[None])), None);
        assert_eq!(results_time(&[]), None);
        // Results without a time count against a majority.
        assert_eq!(results_time(&at(&[None, Some(3), None, Some(3)])), None);
        assert_eq!(results_time(&at(&[None, Some(3), Some(3)])), Some(3));
        // Events, some sharing a second, and policies scanned at two times: none is the
        // report's.
        assert_eq!(
            results_time(&at(&[Some(1), Some(2), Some(2), Some(3)])),
            None
        );
        assert_eq!(
            results_time(&at(&[Some(9), Some(5), Some(9), Some(5)])),
            None
        );
    }

    #[test]
    fn rows_leave_the_common_time_to_the_report_and_keep_any_other() {
        let subject = Subject::pod("ns", 3);
        let mut report =
            serde_json::to_value(pss_policy_report(&subject, 1_700_000_000, &[])).unwrap();
        report["results"][1]["timestamp"]["seconds"] = 1_600_000_000.into();
        report["results"][2]
            .as_object_mut()
            .unwrap()
            .remove("timestamp");
        let cols = ObjectColumns::of(&catalog::POLICY_REPORT, &report);
        assert_eq!(cols.results_timestamp, Some(1_700_000_000));
        let rows = result_rows(&catalog::POLICY_REPORT, &report);
        assert_eq!(rows[0].timestamp, RowTime::Report);
        assert_eq!(rows[1].timestamp, RowTime::Own(Some(1_600_000_000)));
        assert_eq!(rows[2].timestamp, RowTime::Own(None));
        assert!(rows[3..].iter().all(|r| r.timestamp == RowTime::Report));
    }

    #[test]
    fn ephemeral_summary_lives_in_spec() {
        let eph =
            serde_json::to_value(pss_ephemeral_report(&Subject::pod("ns", 1), 1, &[2])).unwrap();
        let cols = ObjectColumns::of(&catalog::EPHEMERAL_REPORT, &eph);
        assert_eq!(cols.summary, [18, 1, 0, 0, 0]);
        assert!(result_rows(&catalog::EPHEMERAL_REPORT, &eph).is_empty());
        // Without analytics rows there is no time to hold for them.
        assert_eq!(cols.results_timestamp, None);
    }
}
