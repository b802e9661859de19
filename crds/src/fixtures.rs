//! Realistic report objects for tests and benchmarks: the 17 Pod Security Standards policies (19
//! rules) of Kyverno's published benchmark, evaluated against one pod, as Kyverno ≥ 1.12 writes
//! them. One such PolicyReport is about 7 KB of JSON.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use crate::kinds::{EphemeralReport, EphemeralReportSpec, PolicyReport};
use crate::result::{PolicyResult, ReportResult, Severity, Summary, Timestamp};

/// (policy, rule, category) of the 19 PSS rules.
pub const PSS_RULES: [(&str, &str, &str); 19] = [
    (
        "disallow-capabilities",
        "adding-capabilities",
        "Pod Security Standards (Baseline)",
    ),
    (
        "disallow-capabilities-strict",
        "require-drop-all",
        "Pod Security Standards (Restricted)",
    ),
    (
        "disallow-capabilities-strict",
        "adding-capabilities-strict",
        "Pod Security Standards (Restricted)",
    ),
    (
        "disallow-host-namespaces",
        "host-namespaces",
        "Pod Security Standards (Baseline)",
    ),
    (
        "disallow-host-path",
        "host-path",
        "Pod Security Standards (Baseline)",
    ),
    (
        "disallow-host-ports",
        "host-ports-none",
        "Pod Security Standards (Baseline)",
    ),
    (
        "disallow-host-process",
        "host-process-containers",
        "Pod Security Standards (Baseline)",
    ),
    (
        "disallow-privilege-escalation",
        "privilege-escalation",
        "Pod Security Standards (Restricted)",
    ),
    (
        "disallow-privileged-containers",
        "privileged-containers",
        "Pod Security Standards (Baseline)",
    ),
    (
        "disallow-proc-mount",
        "check-proc-mount",
        "Pod Security Standards (Baseline)",
    ),
    (
        "disallow-selinux",
        "selinux-type",
        "Pod Security Standards (Baseline)",
    ),
    (
        "disallow-selinux",
        "selinux-user-role",
        "Pod Security Standards (Baseline)",
    ),
    (
        "require-run-as-non-root-user",
        "run-as-non-root-user",
        "Pod Security Standards (Restricted)",
    ),
    (
        "require-run-as-nonroot",
        "run-as-non-root",
        "Pod Security Standards (Restricted)",
    ),
    (
        "restrict-apparmor-profiles",
        "app-armor",
        "Pod Security Standards (Baseline)",
    ),
    (
        "restrict-seccomp",
        "check-seccomp",
        "Pod Security Standards (Baseline)",
    ),
    (
        "restrict-seccomp-strict",
        "check-seccomp-strict",
        "Pod Security Standards (Restricted)",
    ),
    (
        "restrict-sysctls",
        "check-sysctls",
        "Pod Security Standards (Baseline)",
    ),
    (
        "restrict-volume-types",
        "restricted-volumes",
        "Pod Security Standards (Restricted)",
    ),
];

/// The pod a fixture report is about.
#[derive(Clone, Debug)]
pub struct Subject {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl Subject {
    /// A deterministic pod `pod-<n>` with a UID derived from `n`.
    pub fn pod(namespace: &str, n: u64) -> Self {
        Subject {
            namespace: namespace.to_owned(),
            name: format!("pod-{n}"),
            uid: format!(
                "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
                n as u32,
                (n >> 32) as u16,
                n % 0xfff,
                (n / 7) % 0xfff,
                n
            ),
        }
    }

    pub fn reference(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(self.name.clone()),
            namespace: Some(self.namespace.clone()),
            uid: Some(self.uid.clone()),
            ..Default::default()
        }
    }
}

/// The 19 PSS results for `subject`; `failing` rules (by index) fail, the rest pass.
pub fn pss_results(subject: &Subject, timestamp: i64, failing: &[usize]) -> Vec<ReportResult> {
    PSS_RULES
        .iter()
        .enumerate()
        .map(|(i, (policy, rule, category))| {
            let fail = failing.contains(&i);
            ReportResult {
                source: Some("kyverno".into()),
                policy: (*policy).into(),
                rule: Some((*rule).into()),
                category: Some((*category).into()),
                severity: Some(Severity::Medium),
                timestamp: Some(Timestamp { seconds: timestamp, nanos: 0 }),
                result: Some(if fail { PolicyResult::Fail } else { PolicyResult::Pass }),
                scored: Some(true),
                resources: Some(vec![subject.reference()]),
                resource_selector: None,
                message: Some(if fail {
                    format!("validation error: rule {rule} failed at path /spec/containers/0/securityContext/")
                } else {
                    format!("validation rule '{rule}' passed.")
                }),
                properties: Some(BTreeMap::from([("process".to_owned(), "background scan".to_owned())])),
            }
        })
        .collect()
}

fn managed_labels(subject: &Subject) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/managed-by".to_owned(),
            "kyverno".to_owned(),
        ),
        (
            "audit.kyverno.io/resource.uid".to_owned(),
            subject.uid.clone(),
        ),
    ])
}

fn owner(subject: &Subject) -> OwnerReference {
    OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name: subject.name.clone(),
        uid: subject.uid.clone(),
        ..Default::default()
    }
}

/// A per-resource PolicyReport, named by the pod's UID, as Kyverno ≥ 1.12 writes it.
pub fn pss_policy_report(subject: &Subject, timestamp: i64, failing: &[usize]) -> PolicyReport {
    let results = pss_results(subject, timestamp, failing);
    PolicyReport {
        metadata: ObjectMeta {
            name: Some(subject.uid.clone()),
            namespace: Some(subject.namespace.clone()),
            labels: Some(managed_labels(subject)),
            owner_references: Some(vec![owner(subject)]),
            ..Default::default()
        },
        scope: Some(subject.reference()),
        summary: Some(Summary::of(&results)),
        results: Some(results),
        ..Default::default()
    }
}

/// A background-scan EphemeralReport for `subject`, as Kyverno's reports controller writes it.
pub fn pss_ephemeral_report(
    subject: &Subject,
    timestamp: i64,
    failing: &[usize],
) -> EphemeralReport {
    let results = pss_results(subject, timestamp, failing);
    let mut labels = managed_labels(subject);
    labels.extend([
        (
            "audit.kyverno.io/source".to_owned(),
            "background-scan".to_owned(),
        ),
        ("audit.kyverno.io/resource.group".to_owned(), String::new()),
        (
            "audit.kyverno.io/resource.kind".to_owned(),
            "Pod".to_owned(),
        ),
        (
            "audit.kyverno.io/resource.version".to_owned(),
            "v1".to_owned(),
        ),
    ]);
    EphemeralReport {
        metadata: ObjectMeta {
            name: Some(subject.uid.clone()),
            namespace: Some(subject.namespace.clone()),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([(
                "audit.kyverno.io/resource.name".to_owned(),
                subject.name.clone(),
            )])),
            owner_references: Some(vec![owner(subject)]),
            ..Default::default()
        },
        spec: EphemeralReportSpec {
            owner: OwnerReference::default(),
            summary: Some(Summary::of(&results)),
            results: Some(results),
        },
        ..Default::default()
    }
}
