//! The live policy set: which results are still meaningful.
//!
//! Kyverno drops a result during aggregation when its policy no longer exists, when the rule is
//! no longer in the policy's *autogen-expanded* rule set, or when the policy carries the label
//! `reports.kyverno.io/disabled` (any value). [`PolicySet`] holds exactly the information needed
//! for that decision, built from Kyverno `ClusterPolicy`/`Policy` objects (and the CEL and
//! admission-policy kinds, which are matched by name only), so that it can be filled from a
//! kube informer, from the store, or from YAML files in offline mode.
//!
//! Autogen expansion re-implements the *naming* part of Kyverno's `pkg/autogen/v1`
//! (`ComputeRules`): a Pod rule `r` also yields `autogen-r` (Deployments, DaemonSets, Jobs,
//! StatefulSets, ReplicaSets, ReplicationControllers) and `autogen-cronjob-r` (CronJobs), names
//! truncated to 63 bytes, subject to the same eligibility checks (no names/selectors/annotations
//! in match or exclude, no Pod mixed with other kinds, no `generate` or JSON6902 mutation in any
//! rule, rule matches Pod, rule of a type autogen supports) and the
//! `pod-policies.kyverno.io/autogen-controllers` annotation.

use std::collections::{BTreeMap, BTreeSet};

use reports_server_crds::ReportResult;
use serde_json::Value;

use crate::error::Error;
use crate::report::type_of;
use crate::results::is_cel_source;

/// Label that removes a policy from reporting (Kyverno ≥ 1.16).
pub const LABEL_REPORTS_DISABLED: &str = "reports.kyverno.io/disabled";
/// Annotation selecting the pod controllers autogen generates rules for.
pub const ANNOTATION_AUTOGEN_CONTROLLERS: &str = "pod-policies.kyverno.io/autogen-controllers";

const POD_CONTROLLERS: [&str; 7] = [
    "DaemonSet",
    "Deployment",
    "Job",
    "StatefulSet",
    "ReplicaSet",
    "ReplicationController",
    "CronJob",
];

/// One Kyverno `ClusterPolicy` or `Policy` as the aggregator sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyEntry {
    /// Rule names after autogen expansion.
    pub rules: BTreeSet<String>,
    /// `metadata.resourceVersion`, stamped on per-policy reports as `cpol.kyverno.io/<name>`.
    pub resource_version: Option<String>,
}

/// The set of live policies, keyed the way results name them: `<name>` for cluster-wide
/// policies, `<namespace>/<name>` for namespaced ones.
///
/// A set can be *partly* known: when the policies of one kind cannot be observed (its CRD is
/// not installed, the watch is forbidden or not synced yet), that kind is marked unknown with
/// [`PolicySet::mark_unknown`] and no result it could have produced is dropped, while results of
/// the kinds that are known are still filtered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicySet {
    kyverno: BTreeMap<String, PolicyEntry>,
    /// Result source (e.g. `ValidatingAdmissionPolicy`) → policy keys.
    by_source: BTreeMap<&'static str, BTreeSet<String>>,
    /// `(source key, namespaced)` of the kinds whose policies are unknown; the source key of
    /// Kyverno's ClusterPolicy/Policy is [`KYVERNO_SOURCE`].
    unknown: BTreeSet<(&'static str, bool)>,
}

/// Source key of results of Kyverno `ClusterPolicy`/`Policy` objects (every result whose
/// `source` is not one of the CEL/admission sources).
pub const KYVERNO_SOURCE: &str = "kyverno";

/// A kind of policy whose results can appear in reports, as the cluster serves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKind {
    pub group: &'static str,
    pub kind: &'static str,
    /// The `source` of the results it produces ([`KYVERNO_SOURCE`] for Kyverno policies).
    pub source: &'static str,
    /// Namespaced kinds name their results `<namespace>/<name>`.
    pub namespaced: bool,
}

/// Every policy kind whose results the aggregator filters, in the groups Kyverno and Kubernetes
/// serve them (the version is whatever the cluster prefers).
pub const POLICY_KINDS: [PolicyKind; 12] = [
    PolicyKind {
        group: "kyverno.io",
        kind: "ClusterPolicy",
        source: KYVERNO_SOURCE,
        namespaced: false,
    },
    PolicyKind {
        group: "kyverno.io",
        kind: "Policy",
        source: KYVERNO_SOURCE,
        namespaced: true,
    },
    PolicyKind {
        group: "admissionregistration.k8s.io",
        kind: "ValidatingAdmissionPolicy",
        source: "ValidatingAdmissionPolicy",
        namespaced: false,
    },
    PolicyKind {
        group: "admissionregistration.k8s.io",
        kind: "MutatingAdmissionPolicy",
        source: "MutatingAdmissionPolicy",
        namespaced: false,
    },
    PolicyKind {
        group: "policies.kyverno.io",
        kind: "ValidatingPolicy",
        source: "KyvernoValidatingPolicy",
        namespaced: false,
    },
    PolicyKind {
        group: "policies.kyverno.io",
        kind: "NamespacedValidatingPolicy",
        source: "KyvernoValidatingPolicy",
        namespaced: true,
    },
    PolicyKind {
        group: "policies.kyverno.io",
        kind: "ImageValidatingPolicy",
        source: "KyvernoImageValidatingPolicy",
        namespaced: false,
    },
    PolicyKind {
        group: "policies.kyverno.io",
        kind: "NamespacedImageValidatingPolicy",
        source: "KyvernoImageValidatingPolicy",
        namespaced: true,
    },
    PolicyKind {
        group: "policies.kyverno.io",
        kind: "GeneratingPolicy",
        source: "KyvernoGeneratingPolicy",
        namespaced: false,
    },
    PolicyKind {
        group: "policies.kyverno.io",
        kind: "NamespacedGeneratingPolicy",
        source: "KyvernoGeneratingPolicy",
        namespaced: true,
    },
    PolicyKind {
        group: "policies.kyverno.io",
        kind: "MutatingPolicy",
        source: "KyvernoMutatingPolicy",
        namespaced: false,
    },
    PolicyKind {
        group: "policies.kyverno.io",
        kind: "NamespacedMutatingPolicy",
        source: "KyvernoMutatingPolicy",
        namespaced: true,
    },
];

impl PolicySet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses every document of a (multi-document) YAML string. Documents that are not policies
    /// (and `List`s of them) are ignored, so a directory of mixed manifests can be passed.
    pub fn from_yaml_str(yaml: &str) -> Result<Self, Error> {
        let mut set = Self::new();
        set.extend_from_yaml_str(yaml, "policies")?;
        Ok(set)
    }

    pub(crate) fn extend_from_yaml_str(&mut self, yaml: &str, context: &str) -> Result<(), Error> {
        for (i, doc) in serde_yaml::Deserializer::from_str(yaml).enumerate() {
            let value: Value = serde::Deserialize::deserialize(doc).map_err(|e| Error::Yaml {
                path: context.into(),
                document: i + 1,
                source: e,
            })?;
            self.insert_value(&value)?;
        }
        Ok(())
    }

    /// Adds one object (or a `List` of objects). Returns how many policies were recognised;
    /// objects of other kinds are ignored. Policies labelled `reports.kyverno.io/disabled` are
    /// recognised but left out, as Kyverno does.
    pub fn insert_value(&mut self, value: &Value) -> Result<usize, Error> {
        if value.is_null() {
            return Ok(0);
        }
        let (api_version, kind) = type_of(value);
        if let Some(items) = value.get("items").and_then(Value::as_array)
            && kind.ends_with("List")
        {
            let mut n = 0;
            for item in items {
                n += self.insert_value(item)?;
            }
            return Ok(n);
        }
        let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
        let kyverno = matches!(
            (group, kind.as_str()),
            ("kyverno.io", "ClusterPolicy" | "Policy")
        );
        let source = source_of_kind(group, &kind);
        if !kyverno && source.is_none() {
            return Ok(0);
        }
        let meta = value.get("metadata");
        let name = meta
            .and_then(|m| m.get("name"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        if name.is_empty() {
            return Err(Error::InvalidPolicy {
                name: format!("<unnamed {kind}>"),
                reason: "metadata.name is missing".into(),
            });
        }
        let namespace = meta
            .and_then(|m| m.get("namespace"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        // Cluster-wide kinds are keyed by bare name even if a namespace slipped into the YAML.
        let namespaced = matches!(kind.as_str(), "Policy") || kind.starts_with("Namespaced");
        let key = if namespaced && !namespace.is_empty() {
            format!("{namespace}/{name}")
        } else {
            name.to_owned()
        };
        let disabled = meta
            .and_then(|m| m.get("labels"))
            .and_then(|l| l.get(LABEL_REPORTS_DISABLED))
            .is_some();
        if disabled {
            return Ok(1);
        }
        if kyverno {
            let rules = autogen_rule_names(value).map_err(|reason| Error::InvalidPolicy {
                name: key.clone(),
                reason,
            })?;
            let resource_version = meta
                .and_then(|m| m.get("resourceVersion"))
                .and_then(Value::as_str)
                .map(str::to_owned);
            self.kyverno.insert(
                key,
                PolicyEntry {
                    rules,
                    resource_version,
                },
            );
        } else if let Some(source) = source {
            self.by_source.entry(source).or_default().insert(key);
        }
        Ok(1)
    }

    /// Adds a Kyverno policy by hand (key `<name>` or `<ns>/<name>`, already-expanded rules).
    pub fn insert_kyverno_policy(
        &mut self,
        key: impl Into<String>,
        rules: impl IntoIterator<Item = impl Into<String>>,
    ) {
        self.kyverno.insert(
            key.into(),
            PolicyEntry {
                rules: rules.into_iter().map(Into::into).collect(),
                resource_version: None,
            },
        );
    }

    /// Adds a policy of a CEL/admission source (e.g. `ValidatingAdmissionPolicy`) by key.
    /// Unknown sources are ignored: their results are filtered as Kyverno results.
    pub fn insert_cel_policy(&mut self, source: &str, key: impl Into<String>) {
        if let Some(s) = crate::results::CEL_SOURCES.iter().find(|s| **s == source) {
            self.by_source.entry(s).or_default().insert(key.into());
        }
    }

    /// Marks the policies of `kind` as unknown: no result of that kind is dropped any more,
    /// whatever policies of that kind the set holds.
    pub fn mark_unknown(&mut self, kind: &PolicyKind) {
        self.unknown.insert((kind.source, kind.namespaced));
    }

    /// Whether the policies of `kind` are known (not marked unknown).
    pub fn is_known(&self, kind: &PolicyKind) -> bool {
        !self.unknown.contains(&(kind.source, kind.namespaced))
    }

    /// The Kyverno policy with this key, if live.
    pub fn kyverno_policy(&self, key: &str) -> Option<&PolicyEntry> {
        self.kyverno.get(key)
    }

    /// Number of live policies of every kind.
    pub fn len(&self) -> usize {
        self.kyverno.len() + self.by_source.values().map(BTreeSet::len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a result should be kept: Kyverno's `mergeReports` filter.
    pub fn allows(&self, result: &ReportResult) -> bool {
        let source = result.source.as_deref().unwrap_or_default();
        // Results of namespaced kinds name their policy `<namespace>/<name>`.
        let namespaced = result.policy.contains('/');
        if is_cel_source(source) {
            if self.unknown.contains(&(source, namespaced)) {
                return true;
            }
            return self
                .by_source
                .get(source)
                .is_some_and(|s| s.contains(&result.policy));
        }
        if self.unknown.contains(&(KYVERNO_SOURCE, namespaced)) {
            return true;
        }
        self.kyverno
            .get(&result.policy)
            .is_some_and(|p| p.rules.contains(result.rule.as_deref().unwrap_or_default()))
    }
}

/// The policy kind of `apiVersion`/`kind`, if it is one whose results the aggregator filters.
pub fn policy_kind(api_version: &str, kind: &str) -> Option<&'static PolicyKind> {
    let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
    POLICY_KINDS
        .iter()
        .find(|k| k.group == group && k.kind == kind)
}

/// The result `source` written for policies of a CEL / admission kind.
fn source_of_kind(group: &str, kind: &str) -> Option<&'static str> {
    Some(match (group, kind) {
        ("policies.kyverno.io", "ValidatingPolicy" | "NamespacedValidatingPolicy") => {
            "KyvernoValidatingPolicy"
        }
        ("policies.kyverno.io", "ImageValidatingPolicy" | "NamespacedImageValidatingPolicy") => {
            "KyvernoImageValidatingPolicy"
        }
        ("policies.kyverno.io", "GeneratingPolicy" | "NamespacedGeneratingPolicy") => {
            "KyvernoGeneratingPolicy"
        }
        ("policies.kyverno.io", "MutatingPolicy" | "NamespacedMutatingPolicy") => {
            "KyvernoMutatingPolicy"
        }
        ("admissionregistration.k8s.io", "ValidatingAdmissionPolicy") => {
            "ValidatingAdmissionPolicy"
        }
        ("admissionregistration.k8s.io", "MutatingAdmissionPolicy") => "MutatingAdmissionPolicy",
        _ => return None,
    })
}

/// The kind named by a Kyverno kind string (`Pod`, `v1/Pod`, `apps/v1/Deployment`,
/// `Pod/status`, `Pod.status`…), subresource removed, as Kyverno's `ContainsKind` sees it.
fn kind_name(s: &str) -> &str {
    let parts: Vec<&str> = s.split('/').collect();
    let looks_like_version = |p: &str| {
        p == "*"
            || p.as_bytes()
                .windows(2)
                .any(|w| w[0] == b'v' && w[1].is_ascii_digit())
    };
    let kind = match parts.len() {
        2 if looks_like_version(parts[0]) => parts[1],
        2 => parts[0],
        3 if looks_like_version(parts[0]) => parts[1],
        3 | 4 => parts[2],
        _ => parts[0],
    };
    kind.split('.').next().unwrap_or(kind)
}

fn contains_kind(kinds: &[&str], kind: &str) -> bool {
    kinds.iter().any(|k| kind_name(k) == kind)
}

fn str_list(v: Option<&Value>) -> Vec<&str> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn present(v: Option<&Value>) -> bool {
    v.is_some_and(|v| !v.is_null())
}

/// The resource descriptions of a `match`/`exclude` block: the direct `resources`, and those of
/// each `any[]`/`all[]` entry.
fn resource_descriptions(block: Option<&Value>) -> Vec<&Value> {
    let Some(block) = block else {
        return vec![];
    };
    let mut out = vec![];
    if let Some(r) = block.get("resources").filter(|r| !r.is_null()) {
        out.push(r);
    }
    for list in ["any", "all"] {
        for entry in block
            .get(list)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(r) = entry.get("resources").filter(|r| !r.is_null()) {
                out.push(r);
            }
        }
    }
    out
}

fn block_kinds(block: Option<&Value>) -> Vec<&str> {
    resource_descriptions(block)
        .into_iter()
        .flat_map(|r| str_list(r.get("kinds")))
        .collect()
}

/// Kyverno's policy-level `CanAutoGen`: whether any autogen rule can be generated at all.
fn can_autogen(rules: &[Value]) -> bool {
    let mut needed = false;
    for rule in rules {
        let mutate = rule.get("mutate");
        let json6902 = |m: Option<&Value>| {
            m.and_then(|m| m.get("patchesJson6902"))
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty())
        };
        if json6902(mutate) || present(rule.get("generate")) {
            return false;
        }
        let foreach = mutate
            .and_then(|m| m.get("foreach"))
            .and_then(Value::as_array);
        if foreach.into_iter().flatten().any(|f| json6902(Some(f))) {
            return false;
        }
        for block in [rule.get("match"), rule.get("exclude")] {
            for rd in resource_descriptions(block) {
                let kinds = str_list(rd.get("kinds"));
                let name = rd.get("name").and_then(Value::as_str).unwrap_or_default();
                let names = str_list(rd.get("names"));
                if !name.is_empty()
                    || !names.is_empty()
                    || present(rd.get("selector"))
                    || present(rd.get("annotations"))
                    || (kinds.len() > 1 && contains_kind(&kinds, "Pod"))
                {
                    return false;
                }
                // Kyverno compares the raw strings here, not the parsed kinds.
                needed |= kinds
                    .iter()
                    .any(|k| *k == "Pod" || POD_CONTROLLERS.contains(k));
            }
        }
    }
    needed
}

/// Whether Kyverno's `generateRule` produces a rule for this rule's type.
fn has_autogen_type(rule: &Value) -> bool {
    if let Some(m) = rule.get("mutate").filter(|m| !m.is_null())
        && (present(m.get("patchStrategicMerge"))
            || m.get("foreach")
                .and_then(Value::as_array)
                .is_some_and(|f| !f.is_empty()))
    {
        return true;
    }
    if let Some(v) = rule.get("validate").filter(|v| !v.is_null())
        && (present(v.get("pattern"))
            || present(v.get("deny"))
            || present(v.get("podSecurity"))
            || present(v.get("anyPattern"))
            || v.get("foreach")
                .and_then(Value::as_array)
                .is_some_and(|f| !f.is_empty())
            || present(v.get("cel"))
            || present(v.get("assert")))
    {
        return true;
    }
    present(rule.get("verifyImages"))
}

/// Kyverno truncates generated rule names to 63 bytes.
fn autogen_name(prefix: &str, rule: &str) -> String {
    let mut name = format!("{prefix}-{rule}");
    if name.len() > 63 {
        let mut cut = 63;
        // Kyverno cuts bytes; we cut at a char boundary at or below 63 to stay valid UTF-8
        // (rule names are ASCII in practice, where both agree).
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name.truncate(cut);
    }
    name
}

/// The rule names of a Kyverno policy after autogen expansion (Kyverno's
/// `autogen.ComputeRules(policy, "")`).
pub fn autogen_rule_names(policy: &Value) -> Result<BTreeSet<String>, String> {
    let rules = match policy.get("spec").and_then(|s| s.get("rules")) {
        None | Some(Value::Null) => &[][..],
        Some(Value::Array(a)) => a.as_slice(),
        Some(_) => return Err("spec.rules is not a list".into()),
    };
    let mut names = Vec::with_capacity(rules.len());
    for rule in rules {
        match rule.get("name").and_then(Value::as_str) {
            Some(n) => names.push(n),
            None => return Err("a rule has no name".into()),
        }
    }
    let plain: BTreeSet<String> = names.iter().map(|n| (*n).to_owned()).collect();

    let apply = can_autogen(rules);
    let annotation = policy
        .get("metadata")
        .and_then(|m| m.get("annotations"))
        .and_then(|a| a.get(ANNOTATION_AUTOGEN_CONTROLLERS))
        .and_then(Value::as_str);
    if !apply {
        return Ok(plain);
    }
    let controllers: BTreeSet<&str> = match annotation {
        Some(a) => a.split(',').collect(),
        None => POD_CONTROLLERS.into_iter().collect(),
    };
    let joined = controllers.iter().copied().collect::<Vec<_>>().join(",");
    if joined == "none" {
        return Ok(plain);
    }
    // Kyverno strips `CronJob` from the list for the `autogen-` rule and generates nothing
    // when the remainder is empty (an empty annotation value included).
    let non_cronjob = !controllers
        .iter()
        .filter(|c| **c != "CronJob")
        .copied()
        .collect::<Vec<_>>()
        .join(",")
        .is_empty();
    let cronjob = joined.contains("CronJob") || joined.contains("all");

    let mut generated = BTreeSet::new();
    for (rule, name) in rules.iter().zip(&names) {
        if name.starts_with("autogen-") {
            continue;
        }
        let match_kinds = block_kinds(rule.get("match"));
        let exclude_kinds = block_kinds(rule.get("exclude"));
        let eligible = contains_kind(&match_kinds, "Pod")
            && (exclude_kinds.is_empty() || contains_kind(&exclude_kinds, "Pod"))
            && has_autogen_type(rule);
        if !eligible {
            continue;
        }
        if non_cronjob {
            generated.insert(autogen_name("autogen", name));
        }
        if cronjob {
            generated.insert(autogen_name("autogen-cronjob", name));
        }
    }
    if generated.is_empty() {
        return Ok(plain);
    }
    Ok(plain
        .into_iter()
        .filter(|n| !n.starts_with("autogen-"))
        .chain(generated)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy(rules: Value) -> Value {
        json!({"apiVersion": "kyverno.io/v1", "kind": "ClusterPolicy",
               "metadata": {"name": "p"}, "spec": {"rules": rules}})
    }

    fn pod_rule(name: &str) -> Value {
        json!({"name": name, "match": {"any": [{"resources": {"kinds": ["Pod"]}}]},
               "validate": {"pattern": {"spec": {}}}})
    }

    fn names(v: &Value) -> Vec<String> {
        autogen_rule_names(v).unwrap().into_iter().collect()
    }

    #[test]
    fn pod_rule_expands_to_controllers_and_cronjobs() {
        assert_eq!(
            names(&policy(json!([pod_rule("r")]))),
            ["autogen-cronjob-r", "autogen-r", "r"]
        );
    }

    #[test]
    fn non_pod_rules_are_not_expanded() {
        let p = policy(
            json!([{"name": "ns", "match": {"resources": {"kinds": ["Namespace"]}},
                               "validate": {"pattern": {}}}]),
        );
        assert_eq!(names(&p), ["ns"]);
    }

    #[test]
    fn mixed_kinds_or_selectors_disable_autogen_for_the_whole_policy() {
        let mixed = json!({"name": "m", "match": {"any": [{"resources": {"kinds": ["Pod", "Service"]}}]},
                           "validate": {"pattern": {}}});
        assert_eq!(names(&policy(json!([pod_rule("r"), mixed]))), ["m", "r"]);
        let sel = json!({"name": "s", "match": {"any": [{"resources": {"kinds": ["Pod"], "selector": {"matchLabels": {"a": "b"}}}}]},
                         "validate": {"pattern": {}}});
        assert_eq!(names(&policy(json!([pod_rule("r"), sel]))), ["r", "s"]);
    }

    #[test]
    fn generate_rules_disable_autogen() {
        let g = json!({"name": "g", "match": {"any": [{"resources": {"kinds": ["Pod"]}}]}, "generate": {"kind": "ConfigMap"}});
        assert_eq!(names(&policy(json!([pod_rule("r"), g]))), ["g", "r"]);
    }

    #[test]
    fn annotation_selects_controllers() {
        let mut p = policy(json!([pod_rule("r")]));
        p["metadata"]["annotations"] = json!({ANNOTATION_AUTOGEN_CONTROLLERS: "none"});
        assert_eq!(names(&p), ["r"]);
        p["metadata"]["annotations"] = json!({ANNOTATION_AUTOGEN_CONTROLLERS: "Deployment"});
        assert_eq!(names(&p), ["autogen-r", "r"]);
        p["metadata"]["annotations"] = json!({ANNOTATION_AUTOGEN_CONTROLLERS: "CronJob"});
        assert_eq!(names(&p), ["autogen-cronjob-r", "r"]);
        p["metadata"]["annotations"] =
            json!({ANNOTATION_AUTOGEN_CONTROLLERS: "Deployment,CronJob"});
        assert_eq!(names(&p), ["autogen-cronjob-r", "autogen-r", "r"]);
    }

    #[test]
    fn autogen_names_are_truncated_to_63_bytes() {
        let long = "x".repeat(60);
        let n = names(&policy(json!([pod_rule(&long)])));
        assert!(n.iter().all(|n| n.len() <= 63));
        assert!(n.contains(&format!("autogen-{}", &long[..55])));
    }

    #[test]
    fn versioned_and_subresource_kinds() {
        assert_eq!(kind_name("v1/Pod"), "Pod");
        assert_eq!(kind_name("apps/v1/Deployment"), "Deployment");
        assert_eq!(kind_name("Pod/status"), "Pod");
        assert_eq!(kind_name("Pod.status"), "Pod");
        assert_eq!(kind_name("*/Pod"), "Pod");
    }

    #[test]
    fn disabled_policies_are_left_out() {
        let mut p = policy(json!([pod_rule("r")]));
        p["metadata"]["labels"] = json!({LABEL_REPORTS_DISABLED: ""});
        let mut set = PolicySet::new();
        assert_eq!(set.insert_value(&p).unwrap(), 1);
        assert!(set.is_empty());
    }

    #[test]
    fn namespaced_policies_are_keyed_with_namespace() {
        let mut p = policy(json!([pod_rule("r")]));
        p["kind"] = json!("Policy");
        p["metadata"]["namespace"] = json!("team");
        let mut set = PolicySet::new();
        set.insert_value(&p).unwrap();
        assert!(set.kyverno_policy("team/p").is_some());
        assert!(set.kyverno_policy("p").is_none());
    }

    #[test]
    fn unknown_kinds_keep_their_results_and_only_theirs() {
        let mut set = PolicySet::new();
        set.insert_kyverno_policy("p", ["r"]);
        let r = |source: &str, policy: &str, rule: &str| ReportResult {
            source: Some(source.into()),
            policy: policy.into(),
            rule: Some(rule.into()),
            ..Default::default()
        };
        assert!(!set.allows(&r("kyverno", "team/q", "r")));
        assert!(!set.allows(&r("KyvernoValidatingPolicy", "team/v", "")));
        let policy = policy_kind("kyverno.io/v1", "Policy").unwrap();
        set.mark_unknown(policy);
        assert!(!set.is_known(policy));
        // Namespaced Kyverno policies are unknown now; cluster policies are still filtered.
        assert!(set.allows(&r("kyverno", "team/q", "anything")));
        assert!(set.allows(&r("kyverno", "p", "r")));
        assert!(!set.allows(&r("kyverno", "gone", "r")));
        assert!(!set.allows(&r("kyverno", "p", "gone")));
        set.mark_unknown(
            policy_kind("policies.kyverno.io/v1", "NamespacedValidatingPolicy").unwrap(),
        );
        assert!(set.allows(&r("KyvernoValidatingPolicy", "team/v", "")));
        assert!(!set.allows(&r("KyvernoValidatingPolicy", "v", "")));
        assert!(policy_kind("kyverno.io/v1", "PolicyException").is_none());
    }

    #[test]
    fn every_policy_kind_is_recognised_when_parsed() {
        for k in POLICY_KINDS {
            let mut set = PolicySet::new();
            let mut obj = json!({"apiVersion": format!("{}/v1", k.group), "kind": k.kind,
                "metadata": {"name": "x"}, "spec": {"rules": []}});
            if k.namespaced {
                obj["metadata"]["namespace"] = json!("ns");
            }
            assert_eq!(set.insert_value(&obj).unwrap(), 1, "{k:?}");
            if k.source != KYVERNO_SOURCE {
                assert_eq!(source_of_kind(k.group, k.kind), Some(k.source), "{k:?}");
            }
        }
    }

    #[test]
    fn cel_policies_match_by_name_and_source() {
        let mut set = PolicySet::new();
        set.insert_value(&json!({"apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy", "metadata": {"name": "vap"}}))
            .unwrap();
        let r = |source: &str, policy: &str| ReportResult {
            source: Some(source.into()),
            policy: policy.into(),
            ..Default::default()
        };
        assert!(set.allows(&r("ValidatingAdmissionPolicy", "vap")));
        assert!(!set.allows(&r("ValidatingAdmissionPolicy", "other")));
        assert!(!set.allows(&r("KyvernoValidatingPolicy", "vap")));
        assert!(!set.allows(&r("kyverno", "vap")));
    }
}
