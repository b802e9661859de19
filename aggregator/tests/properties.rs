//! Property tests of the merge: idempotence, independence from input order, no loss of a live
//! result, and equivalence of the paged and namespace-wide merges.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use proptest::prelude::*;
use reports_server_aggregator::merge::{MergeInput, MergeOptions, merge_namespace, merge_page};
use reports_server_aggregator::report::{Ephemeral, FinalReport};
use reports_server_aggregator::results::{ResultKey, seconds};
use reports_server_aggregator::{Layout, Plan, PolicySet};
use reports_server_crds::{
    EphemeralReport, EphemeralReportSpec, PolicyReport, PolicyResult, ReportResult, Timestamp,
};

const NS: &str = "ns";
const POLICIES: [&str; 4] = ["p0", "p1", "p2", "ns/p3"];
const RULES: [&str; 3] = ["r0", "r1", "autogen-r0"];

fn uid(n: usize) -> String {
    format!("00000000-0000-4000-8000-00000000000{n}")
}

fn arb_result() -> impl Strategy<Value = ReportResult> {
    (
        0..POLICIES.len(),
        0..RULES.len(),
        prop::bool::weighted(0.2),
        0i64..4,
        0..5usize,
        prop::option::of("[ab]{0,2}"),
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(p, r, vap, secs, outcome, message, scored)| ReportResult {
            source: Some(
                if vap {
                    "ValidatingAdmissionPolicy"
                } else {
                    "kyverno"
                }
                .into(),
            ),
            policy: POLICIES[p].into(),
            rule: Some(RULES[r].into()),
            timestamp: Some(Timestamp {
                seconds: 1_700_000_000 + secs,
                nanos: 0,
            }),
            result: Some(PolicyResult::ALL[outcome]),
            message,
            scored,
            ..Default::default()
        })
}

fn managed() -> BTreeMap<String, String> {
    BTreeMap::from([("app.kubernetes.io/managed-by".into(), "kyverno".into())])
}

fn stored_report(subject: usize, results: Vec<ReportResult>) -> FinalReport {
    FinalReport::PolicyReport(PolicyReport {
        metadata: ObjectMeta {
            name: Some(uid(subject)),
            namespace: Some(NS.into()),
            labels: Some(managed()),
            ..Default::default()
        },
        scope: Some(ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(format!("pod-{subject}")),
            namespace: Some(NS.into()),
            uid: Some(uid(subject)),
            ..Default::default()
        }),
        results: Some(results),
        ..Default::default()
    })
}

fn ephemeral(subject: usize, n: usize, results: Vec<ReportResult>) -> Ephemeral {
    let mut labels = managed();
    labels.insert("audit.kyverno.io/resource.uid".into(), uid(subject));
    Ephemeral::Namespaced(EphemeralReport {
        metadata: ObjectMeta {
            name: Some(format!("{}-{n}", uid(subject))),
            namespace: Some(NS.into()),
            labels: Some(labels),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: format!("pod-{subject}"),
                uid: uid(subject),
                ..Default::default()
            }]),
            ..Default::default()
        },
        spec: EphemeralReportSpec {
            owner: OwnerReference::default(),
            summary: None,
            results: Some(results),
        },
        ..Default::default()
    })
}

#[derive(Clone, Debug)]
struct World {
    reports: Vec<FinalReport>,
    ephemerals: Vec<Ephemeral>,
    policies: Option<PolicySet>,
}

fn arb_policies() -> impl Strategy<Value = Option<PolicySet>> {
    prop::option::of(
        (
            prop::collection::btree_set(0..POLICIES.len(), 0..=POLICIES.len()),
            prop::collection::btree_set(0..RULES.len(), 0..=RULES.len()),
            any::<bool>(),
        )
            .prop_map(|(pols, rules, vap)| {
                let mut set = PolicySet::new();
                for p in pols {
                    set.insert_kyverno_policy(POLICIES[p], rules.iter().map(|r| RULES[*r]));
                    if vap {
                        set.insert_cel_policy("ValidatingAdmissionPolicy", POLICIES[p]);
                    }
                }
                set
            }),
    )
}

fn arb_world() -> impl Strategy<Value = World> {
    let stored =
        prop::collection::btree_map(0..4usize, prop::collection::vec(arb_result(), 0..6), 0..4);
    let ephemerals =
        prop::collection::vec((0..4usize, prop::collection::vec(arb_result(), 0..6)), 0..6);
    (stored, ephemerals, arb_policies()).prop_map(|(stored, ephemerals, policies)| World {
        reports: stored
            .into_iter()
            .map(|(s, r)| stored_report(s, r))
            .collect(),
        ephemerals: ephemerals
            .into_iter()
            .enumerate()
            .map(|(i, (s, r))| ephemeral(s, i, r))
            .collect(),
        policies,
    })
}

fn arb_options() -> impl Strategy<Value = MergeOptions> {
    prop_oneof![
        Just(MergeOptions::default()),
        (0usize..4).prop_map(|chunk_size| MergeOptions {
            layout: Layout::PerPolicy,
            chunk_size,
            ..Default::default()
        }),
    ]
}

fn merge(world: &World, options: &MergeOptions) -> Plan {
    merge_namespace(
        &MergeInput {
            namespace: NS,
            reports: &world.reports,
            ephemerals: &world.ephemerals,
            policies: world.policies.as_ref(),
        },
        options,
    )
}

/// The world after a backend applied `plan`.
fn apply(world: &World, plan: &Plan) -> World {
    let deleted: BTreeSet<_> = plan.ephemeral_deletes.iter().map(|k| &k.name).collect();
    World {
        reports: plan.apply_to(world.reports.clone()),
        ephemerals: world
            .ephemerals
            .iter()
            .filter(|e| !deleted.contains(&e.name().to_owned()))
            .cloned()
            .collect(),
        policies: world.policies.clone(),
    }
}

/// Every result in the final reports, keyed by identity.
fn output_results(reports: &[FinalReport]) -> BTreeMap<ResultKey, ReportResult> {
    let mut out = BTreeMap::new();
    for r in reports {
        for res in r.results() {
            let uid = r
                .scope()
                .and_then(|s| s.uid.clone())
                .or_else(|| res.subject_uids().next().map(str::to_owned))
                .expect("every output result names its subject");
            let key = ResultKey::of(res, &uid);
            assert!(
                out.insert(key.clone(), res.clone()).is_none(),
                "duplicate result {key:?}"
            );
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn merging_is_idempotent(world in arb_world(), options in arb_options()) {
        let plan = merge(&world, &options);
        let after = apply(&world, &plan);
        prop_assert!(after.ephemerals.is_empty());
        let again = merge(&after, &options);
        prop_assert!(again.is_empty(), "second merge not empty: {again:#?}");
    }

    #[test]
    fn result_does_not_depend_on_input_order(
        (world, shuffled) in arb_world().prop_flat_map(|w| {
            let reports = Just(w.reports.clone()).prop_shuffle();
            let ephemerals = Just(w.ephemerals.clone()).prop_shuffle();
            (Just(w), reports, ephemerals)
        }).prop_map(|(w, reports, ephemerals)| {
            let s = World { reports, ephemerals, policies: w.policies.clone() };
            (w, s)
        }),
        options in arb_options(),
    ) {
        prop_assert_eq!(merge(&world, &options), merge(&shuffled, &options));
    }

    #[test]
    fn no_live_result_is_lost(world in arb_world(), options in arb_options()) {
        let plan = merge(&world, &options);
        let out = output_results(&apply(&world, &plan).reports);
        let inputs = world
            .reports
            .iter()
            .map(|r| (r.scope().and_then(|s| s.uid.clone()).unwrap(), r.results()))
            .chain(world.ephemerals.iter().map(|e| (e.subject_uid().unwrap().to_owned(), e.results())));
        for (uid, results) in inputs {
            for r in results {
                let key = ResultKey::of(r, &uid);
                let live = world.policies.as_ref().is_none_or(|p| p.allows(r));
                match out.get(&key) {
                    Some(kept) => {
                        prop_assert!(live, "dropped policy kept: {key:?}");
                        prop_assert!(seconds(kept) >= seconds(r), "older result won: {key:?}");
                    }
                    None => prop_assert!(!live, "live result lost: {key:?}"),
                }
            }
        }
        // Summaries always match the results.
        for r in apply(&world, &plan).reports {
            prop_assert_eq!(r.summary().cloned(), Some(reports_server_crds::Summary::of(r.results())));
        }
    }

    #[test]
    fn page_by_page_equals_namespace_wide(world in arb_world(), page in 1usize..4) {
        let options = MergeOptions::default();
        let whole = apply(&world, &merge(&world, &options));
        // Cut the subjects into pages as a backend would and merge each page on its own.
        let subjects: BTreeSet<String> = world
            .reports
            .iter()
            .filter_map(|r| r.scope().and_then(|s| s.uid.clone()))
            .chain(world.ephemerals.iter().filter_map(|e| e.subject_uid().map(str::to_owned)))
            .collect();
        let subjects: Vec<String> = subjects.into_iter().collect();
        let mut plan = Plan::default();
        for chunk in subjects.chunks(page) {
            let reports: Vec<_> = world
                .reports
                .iter()
                .filter(|r| chunk.iter().any(|u| Some(u) == r.scope().and_then(|s| s.uid.as_ref())))
                .cloned()
                .collect();
            let ephemerals: Vec<_> = world
                .ephemerals
                .iter()
                .filter(|e| chunk.iter().any(|u| Some(u.as_str()) == e.subject_uid()))
                .cloned()
                .collect();
            plan.extend(merge_page(
                &MergeInput { namespace: NS, reports: &reports, ephemerals: &ephemerals, policies: world.policies.as_ref() },
                &options,
            ).unwrap());
        }
        let paged = apply(&world, &plan);
        prop_assert_eq!(paged.reports, whole.reports);
        prop_assert_eq!(paged.ephemerals.len(), whole.ephemerals.len());
    }
}
