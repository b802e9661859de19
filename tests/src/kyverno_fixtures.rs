//! Kyverno-shaped fixtures for end-to-end tests that play Kyverno's part without running it:
//! a minimal ClusterPolicy CRD, the 17 Pod Security Standards ClusterPolicies behind
//! `reports_server_crds::fixtures::PSS_RULES`, and ephemeral reports for ConfigMaps as Kyverno's
//! background scanner and admission webhook write them.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DynamicObject};
use kube::core::{ApiResource, GroupVersionKind};
use reports_server_crds::EphemeralReport;
use reports_server_crds::fixtures::{PSS_RULES, Subject, pss_ephemeral_report};
use serde_json::json;

/// A minimal ClusterPolicy CRD: the aggregator only reads names, rules and labels.
pub const CLUSTER_POLICY_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: clusterpolicies.kyverno.io
spec:
  group: kyverno.io
  names:
    kind: ClusterPolicy
    listKind: ClusterPolicyList
    plural: clusterpolicies
    singular: clusterpolicy
    shortNames: [cpol]
  scope: Cluster
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        x-kubernetes-preserve-unknown-fields: true
"#;

pub fn subject_of(cm: &ConfigMap) -> Subject {
    Subject {
        namespace: cm.metadata.namespace.clone().unwrap_or_default(),
        name: cm.metadata.name.clone().unwrap_or_default(),
        uid: cm.metadata.uid.clone().unwrap_or_default(),
    }
}

/// A background-scan report for a ConfigMap (owned, `<uid>-<suffix>`), as Kyverno ≥ 1.14
/// names them.
pub fn background_report(
    subject: &Subject,
    suffix: &str,
    ts: i64,
    failing: &[usize],
) -> EphemeralReport {
    let mut report = pss_ephemeral_report(subject, ts, failing);
    report.metadata.name = Some(format!("{}-{suffix}", subject.uid));
    for owner in report.metadata.owner_references.iter_mut().flatten() {
        owner.kind = "ConfigMap".into();
    }
    report
        .metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("audit.kyverno.io/resource.kind".into(), "ConfigMap".into());
    report
}

/// An admission report as Kyverno's webhook writes it: no ownerReference, the subject in the
/// gvr/uid labels and the name/namespace annotations.
pub fn admission_report(
    subject: &Subject,
    name: &str,
    ts: i64,
    failing: &[usize],
) -> EphemeralReport {
    let mut report = background_report(subject, "unused", ts, failing);
    report.metadata.name = Some(name.to_owned());
    report.metadata.owner_references = None;
    let labels = report.metadata.labels.get_or_insert_with(Default::default);
    labels.insert("audit.kyverno.io/source".into(), "admission".into());
    labels.insert(
        "audit.kyverno.io/resource.gvr".into(),
        "configmaps.v1".into(),
    );
    report
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(
            "audit.kyverno.io/resource.namespace".into(),
            subject.namespace.clone(),
        );
    report
}

/// The 17 PSS ClusterPolicies behind the fixture results (Pod rules, so autogen applies).
pub fn pss_cluster_policies() -> Vec<serde_json::Value> {
    let mut rules: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (policy, rule, _) in PSS_RULES {
        rules.entry(policy).or_default().push(rule);
    }
    rules
        .into_iter()
        .map(|(policy, rules)| {
            let rules: Vec<_> = rules
                .into_iter()
                .map(|r| {
                    json!({"name": r, "match": {"any": [{"resources": {"kinds": ["Pod"]}}]},
                                "validate": {"pattern": {"spec": {}}}})
                })
                .collect();
            json!({"apiVersion": "kyverno.io/v1", "kind": "ClusterPolicy",
                   "metadata": {"name": policy}, "spec": {"background": true, "rules": rules}})
        })
        .collect()
}

pub fn cluster_policy_api(client: &kube::Client) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kyverno.io", "v1", "ClusterPolicy"),
        "clusterpolicies",
    );
    Api::all_with(client.clone(), &ar)
}

/// A ClusterPolicy whose one mutate rule (`add-mutated-label`) adds `label: "true"` to Pods in
/// `namespace`, admission only (`background: false`). Kyverno's mutating webhook writes its
/// admission report before the Pod has a uid (`audit.kyverno.io/resource.uid: ""`): the report
/// reaches the Pod's PolicyReport only if the aggregator adopts it (finds the Pod, sets owner
/// and uid).
pub fn mutate_label_policy(
    name: &str,
    namespace: &str,
    label: &str,
    category: &str,
    severity: &str,
) -> serde_json::Value {
    json!({
        "apiVersion": "kyverno.io/v1",
        "kind": "ClusterPolicy",
        "metadata": {
            "name": name,
            "annotations": {
                "policies.kyverno.io/category": category,
                "policies.kyverno.io/severity": severity,
            },
        },
        "spec": {
            "background": false,
            "rules": [{
                "name": MUTATE_RULE,
                "match": {"any": [{"resources": {"kinds": ["Pod"], "namespaces": [namespace]}}]},
                "mutate": {"patchStrategicMerge": {"metadata": {"labels": {label: "true"}}}},
            }],
        },
    })
}

/// The rule of [`mutate_label_policy`].
pub const MUTATE_RULE: &str = "add-mutated-label";
