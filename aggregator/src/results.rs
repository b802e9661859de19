//! Result-level rules shared by every layout: identity, ordering, normalisation.
//!
//! These mirror Kyverno exactly (see `docs/aggregation.md`), because consumers such as Policy
//! Reporter diff reports and a different order or an extra `scored: false` key would show up as
//! churn:
//!
//! * **Identity** ([`ResultKey`]): `(source, policy, rule, subject uid)`; for the CEL / admission
//!   policy sources in [`CEL_SOURCES`] the rule is not part of the identity.
//! * **Order** ([`compare_results`], [`sort_results`]): `policy`, `rule`, `source`, number of
//!   `resources`, pairwise `resources[i].uid`, then the Go string form of the timestamp
//!   (`&Timestamp{Seconds:…,Nanos:…,}`) compared as a string, exactly like Kyverno's
//!   `SortReportResults`. Kyverno stops there; results equal on all those keys are then ordered
//!   by their canonical JSON so that our output never depends on input order.
//! * **Normalisation** ([`normalize_result`]): Kubernetes `omitempty` rules of the Go structs.

use std::cmp::Ordering;

use reports_server_crds::{ReportResult, Timestamp};

/// Result sources whose identity ignores the rule name (Kyverno's CEL policies and the
/// Kubernetes admission policies): their results are keyed `source/policy/uid`.
pub const CEL_SOURCES: [&str; 6] = [
    "KyvernoValidatingPolicy",
    "KyvernoImageValidatingPolicy",
    "KyvernoGeneratingPolicy",
    "KyvernoMutatingPolicy",
    "ValidatingAdmissionPolicy",
    "MutatingAdmissionPolicy",
];

/// Whether results of `source` are keyed without the rule name.
pub fn is_cel_source(source: &str) -> bool {
    CEL_SOURCES.contains(&source)
}

/// The identity of a result within a namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResultKey {
    pub source: String,
    pub policy: String,
    /// `None` for [`CEL_SOURCES`].
    pub rule: Option<String>,
    pub subject_uid: String,
}

impl ResultKey {
    pub fn of(result: &ReportResult, subject_uid: &str) -> Self {
        let source = result.source.clone().unwrap_or_default();
        let rule = if is_cel_source(&source) {
            None
        } else {
            Some(result.rule.clone().unwrap_or_default())
        };
        ResultKey {
            source,
            policy: result.policy.clone(),
            rule,
            subject_uid: subject_uid.to_owned(),
        }
    }
}

/// Go's `(*metav1.Timestamp).String()` for the timestamp (a missing one is the zero value), the
/// last key of Kyverno's sort.
pub fn go_timestamp_string(ts: Option<&Timestamp>) -> String {
    let ts = ts.copied().unwrap_or_default();
    format!("&Timestamp{{Seconds:{},Nanos:{},}}", ts.seconds, ts.nanos)
}

/// Kyverno's result order (`SortReportResults`, v1.15+), without our final tie-break.
pub fn compare_results_kyverno(a: &ReportResult, b: &ReportResult) -> Ordering {
    let s = |o: &Option<String>| o.as_deref().unwrap_or_default().to_owned();
    a.policy
        .cmp(&b.policy)
        .then_with(|| s(&a.rule).cmp(&s(&b.rule)))
        .then_with(|| s(&a.source).cmp(&s(&b.source)))
        .then_with(|| {
            let (ra, rb) = (
                a.resources.as_deref().unwrap_or_default(),
                b.resources.as_deref().unwrap_or_default(),
            );
            ra.len().cmp(&rb.len()).then_with(|| {
                ra.iter()
                    .zip(rb)
                    .map(|(x, y)| {
                        x.uid
                            .as_deref()
                            .unwrap_or_default()
                            .cmp(y.uid.as_deref().unwrap_or_default())
                    })
                    .find(|o| o.is_ne())
                    .unwrap_or(Ordering::Equal)
            })
        })
        .then_with(|| {
            go_timestamp_string(a.timestamp.as_ref())
                .cmp(&go_timestamp_string(b.timestamp.as_ref()))
        })
}

/// The canonical JSON of a result: a total order of last resort.
pub(crate) fn canonical_json(result: &ReportResult) -> String {
    serde_json::to_string(result).expect("results always serialise")
}

/// Kyverno's order, then canonical JSON so that the order is total.
pub fn compare_results(a: &ReportResult, b: &ReportResult) -> Ordering {
    compare_results_kyverno(a, b).then_with(|| canonical_json(a).cmp(&canonical_json(b)))
}

/// Sorts results the way they are stored in every report.
pub fn sort_results(results: &mut [ReportResult]) {
    // The Go timestamp string and the canonical JSON are only built when all cheaper keys tie,
    // which is rare: results of one report differ in policy, rule, source or subject.
    results.sort_by(compare_results);
}

/// Applies the Go structs' `omitempty` rules so that what we store reads exactly like what
/// Kyverno stores: empty strings, `scored: false`, empty maps and lists vanish; `source` is
/// always present (no `omitempty` in Go); `timestamp` is a struct value in Go and therefore
/// always present (`{seconds: 0, nanos: 0}` when unset).
pub fn normalize_result(result: &mut ReportResult) {
    fn drop_empty(s: &mut Option<String>) {
        if s.as_deref() == Some("") {
            *s = None;
        }
    }
    if result.source.is_none() {
        result.source = Some(String::new());
    }
    drop_empty(&mut result.rule);
    drop_empty(&mut result.category);
    drop_empty(&mut result.message);
    if result.scored == Some(false) {
        result.scored = None;
    }
    if result.timestamp.is_none() {
        result.timestamp = Some(Timestamp::default());
    }
    if result.resources.as_ref().is_some_and(Vec::is_empty) {
        result.resources = None;
    }
    if result.properties.as_ref().is_some_and(|p| p.is_empty()) {
        result.properties = None;
    }
}

/// The `timestamp.seconds` of a result, the only part of the timestamp Kyverno compares.
pub fn seconds(result: &ReportResult) -> i64 {
    result.timestamp.map_or(0, |t| t.seconds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ObjectReference;
    use reports_server_crds::{PolicyResult, Summary};

    fn r(policy: &str, rule: &str, source: &str, secs: i64) -> ReportResult {
        ReportResult {
            source: Some(source.into()),
            policy: policy.into(),
            rule: Some(rule.into()),
            timestamp: Some(Timestamp {
                seconds: secs,
                nanos: 0,
            }),
            result: Some(PolicyResult::Pass),
            ..Default::default()
        }
    }

    fn with_uids(mut res: ReportResult, uids: &[&str]) -> ReportResult {
        res.resources = Some(
            uids.iter()
                .map(|u| ObjectReference {
                    uid: Some((*u).into()),
                    ..Default::default()
                })
                .collect(),
        );
        res
    }

    #[test]
    fn sorts_by_policy_then_rule_then_source() {
        let mut v = vec![
            r("b", "a", "kyverno", 1),
            r("a", "z", "kyverno", 1),
            r("a", "b", "kyverno", 1),
            r("a", "b", "ValidatingAdmissionPolicy", 1),
        ];
        sort_results(&mut v);
        let got: Vec<_> = v
            .iter()
            .map(|x| {
                format!(
                    "{}/{}/{}",
                    x.policy,
                    x.rule.as_deref().unwrap(),
                    x.source.as_deref().unwrap()
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                "a/b/ValidatingAdmissionPolicy",
                "a/b/kyverno",
                "a/z/kyverno",
                "b/a/kyverno"
            ]
        );
    }

    #[test]
    fn byte_order_not_locale_order() {
        // Go compares strings byte-wise: uppercase before lowercase, '-' before letters.
        let mut v = vec![r("a", "b", "", 1), r("B", "x", "", 1), r("a-b", "x", "", 1)];
        sort_results(&mut v);
        let got: Vec<_> = v.iter().map(|x| x.policy.as_str()).collect();
        assert_eq!(got, ["B", "a", "a-b"]);
    }

    #[test]
    fn fewer_resources_first_then_pairwise_uid() {
        let mut v = vec![
            with_uids(r("p", "r", "kyverno", 1), &["b", "a"]),
            with_uids(r("p", "r", "kyverno", 1), &["z"]),
            with_uids(r("p", "r", "kyverno", 1), &["a", "z"]),
            r("p", "r", "kyverno", 1),
        ];
        sort_results(&mut v);
        let got: Vec<Vec<_>> = v.iter().map(|x| x.subject_uids().collect()).collect();
        assert_eq!(got, vec![vec![], vec!["z"], vec!["a", "z"], vec!["b", "a"]]);
    }

    #[test]
    fn timestamp_compared_as_go_string() {
        // "&Timestamp{Seconds:10,..." < "&Timestamp{Seconds:9,..." as strings, as in Kyverno.
        let mut v = vec![r("p", "r", "kyverno", 9), r("p", "r", "kyverno", 10)];
        sort_results(&mut v);
        assert_eq!(seconds(&v[0]), 10);
        assert_eq!(
            go_timestamp_string(v[1].timestamp.as_ref()),
            "&Timestamp{Seconds:9,Nanos:0,}"
        );
    }

    #[test]
    fn missing_rule_and_source_sort_as_empty() {
        let mut a = r("p", "", "", 1);
        a.rule = None;
        a.source = None;
        let mut v = vec![r("p", "a", "kyverno", 1), a];
        sort_results(&mut v);
        assert_eq!(v[0].rule, None);
    }

    #[test]
    fn exact_duplicates_ordered_by_content() {
        let mut a = r("p", "r", "kyverno", 1);
        a.message = Some("b".into());
        let mut b = r("p", "r", "kyverno", 1);
        b.message = Some("a".into());
        let mut v1 = vec![a.clone(), b.clone()];
        let mut v2 = vec![b, a];
        sort_results(&mut v1);
        sort_results(&mut v2);
        assert_eq!(v1, v2);
        assert_eq!(v1[0].message.as_deref(), Some("a"));
    }

    #[test]
    fn cel_sources_drop_the_rule_from_the_key() {
        let a = r("vap", "x", "ValidatingAdmissionPolicy", 1);
        let b = r("vap", "y", "ValidatingAdmissionPolicy", 1);
        assert_eq!(ResultKey::of(&a, "u"), ResultKey::of(&b, "u"));
        let a = r("pol", "x", "kyverno", 1);
        let b = r("pol", "y", "kyverno", 1);
        assert_ne!(ResultKey::of(&a, "u"), ResultKey::of(&b, "u"));
        assert_ne!(ResultKey::of(&a, "u"), ResultKey::of(&a, "v"));
    }

    #[test]
    fn normalisation_follows_omitempty() {
        let mut x = ReportResult {
            policy: "p".into(),
            rule: Some(String::new()),
            category: Some(String::new()),
            message: Some(String::new()),
            scored: Some(false),
            properties: Some(Default::default()),
            resources: Some(vec![]),
            ..Default::default()
        };
        normalize_result(&mut x);
        let json = serde_json::to_value(&x).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"source": "", "policy": "p", "timestamp": {"seconds": 0, "nanos": 0}})
        );
        let mut y = r("p", "r", "kyverno", 5);
        y.scored = Some(true);
        normalize_result(&mut y);
        assert_eq!(y.scored, Some(true));
    }

    #[test]
    fn summary_counts_like_kyverno() {
        let mut v = vec![r("p", "a", "kyverno", 1); 3];
        v[1].result = Some(PolicyResult::Fail);
        v[2].result = Some(PolicyResult::Warn);
        let mut none = r("p", "b", "kyverno", 1);
        none.result = None;
        v.push(none);
        let s = Summary::of(&v);
        assert_eq!(
            serde_json::to_value(&s).unwrap(),
            serde_json::json!({"pass": 1, "fail": 1, "warn": 1, "error": 0, "skip": 0})
        );
        assert_eq!(
            serde_json::to_value(Summary::of(&[])).unwrap(),
            serde_json::json!({"pass": 0, "fail": 0, "warn": 0, "error": 0, "skip": 0})
        );
    }
}
