//! Every permission of the server's and the operator's ServiceAccounts, each with its reason.
//!
//! Why the roles ship with the operator instead of being written per ReportsServer: Kubernetes
//! lets nobody grant a right they do not hold unless they have `escalate`, which is as good as
//! cluster-admin. So the server's ClusterRoles are installed once (install.yaml, the Helm
//! chart) and the operator only binds them, with `bind` restricted by `resourceNames` to these
//! roles. The server's read rights are an aggregated ClusterRole, as Kyverno's controllers have
//! them: a platform team grants the server `get` on more kinds with a ClusterRole of its own
//! labelled [`AGGREGATE_TO_SERVER`], without editing ours.
//!
//! The reasons are the table in docs/operator.md ([`permissions_table`]), and
//! `operator/tests/rbac.rs` checks the rendered roles against what no role of ours may hold.

use reports_server_crds::catalog::{ALL, GROUP_VERSIONS};
use reports_server_migration::plan::{FENCE_NAME, PROBE_GROUP, PROBE_PLURAL};
use serde_json::{Value, json};

/// The server's ClusterRole: the aggregation of every ClusterRole labelled
/// [`AGGREGATE_TO_SERVER`]` = "true"`. Every ReportsServer's ServiceAccount is bound to it.
pub const SERVER_ROLE: &str = "reports-server";
/// The label that adds a ClusterRole's rules to [`SERVER_ROLE`].
pub const AGGREGATE_TO_SERVER: &str = "reportsserver.io/aggregate-to-server";
/// What every server needs: delegated authentication and authorization, namespaces, policies.
pub const SERVER_CORE_ROLE: &str = "reports-server:core";
/// `get` on the kinds Kyverno reports on, for adopting admission reports.
pub const SERVER_ADOPTION_ROLE: &str = "reports-server:adoption";
/// The migration's rights, bound only while `spec.migration.enabled`.
pub const MIGRATION_ROLE: &str = "reports-server:migration";
/// `get` on the non-resource URL `/metrics`: what the servers' delegated authorization asks of
/// whoever scrapes them. Bound to the ServiceAccount of `spec.monitoring.serviceMonitor`, or by
/// the chart to the Prometheus' own (`metrics.scraper`).
pub const METRICS_READER_ROLE: &str = "reports-server:metrics-reader";
/// The built-in role of delegated authentication and authorization.
pub const AUTH_DELEGATOR_ROLE: &str = "system:auth-delegator";
/// The built-in Role in kube-system that reads the client-CA ConfigMap of the front proxy.
pub const AUTH_READER_ROLE: &str = "extension-apiserver-authentication-reader";

/// One rule of a role and why we hold it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub api_groups: Vec<String>,
    pub resources: Vec<String>,
    pub verbs: Vec<String>,
    /// Empty: every object of these resources.
    pub resource_names: Vec<String>,
    /// Non-resource URLs (then `api_groups` and `resources` are empty).
    pub non_resource_urls: Vec<String>,
    pub why: &'static str,
}

fn strings<S: AsRef<str>>(items: &[S]) -> Vec<String> {
    items.iter().map(|s| s.as_ref().to_owned()).collect()
}

fn rule(groups: &[&str], resources: &[&str], verbs: &[&str], why: &'static str) -> Rule {
    Rule {
        api_groups: strings(groups),
        resources: strings(resources),
        verbs: strings(verbs),
        resource_names: Vec::new(),
        non_resource_urls: Vec::new(),
        why,
    }
}

fn named<S: AsRef<str>>(mut rule: Rule, names: &[S]) -> Rule {
    rule.resource_names = strings(names);
    rule
}

impl Rule {
    /// The rule as RBAC's `PolicyRule` JSON.
    pub fn to_json(&self) -> Value {
        if !self.non_resource_urls.is_empty() {
            return json!({"nonResourceURLs": self.non_resource_urls, "verbs": self.verbs});
        }
        let mut rule = json!({
            "apiGroups": self.api_groups,
            "resources": self.resources,
            "verbs": self.verbs,
        });
        if !self.resource_names.is_empty() {
            rule["resourceNames"] = json!(self.resource_names);
        }
        rule
    }
}

const WRITE: [&str; 7] = [
    "get", "list", "watch", "create", "update", "patch", "delete",
];
const READ: [&str; 3] = ["get", "list", "watch"];

/// The Kyverno and Kubernetes policy kinds whose deletion drops their results from reports
/// (the aggregator's `POLICY_KINDS`; `operator/tests/rbac.rs` checks they match).
pub const POLICY_RESOURCES: [(&str, &str); 12] = [
    ("kyverno.io", "clusterpolicies"),
    ("kyverno.io", "policies"),
    (
        "admissionregistration.k8s.io",
        "validatingadmissionpolicies",
    ),
    ("admissionregistration.k8s.io", "mutatingadmissionpolicies"),
    ("policies.kyverno.io", "validatingpolicies"),
    ("policies.kyverno.io", "namespacedvalidatingpolicies"),
    ("policies.kyverno.io", "imagevalidatingpolicies"),
    ("policies.kyverno.io", "namespacedimagevalidatingpolicies"),
    ("policies.kyverno.io", "generatingpolicies"),
    ("policies.kyverno.io", "namespacedgeneratingpolicies"),
    ("policies.kyverno.io", "mutatingpolicies"),
    ("policies.kyverno.io", "namespacedmutatingpolicies"),
];

/// [`SERVER_CORE_ROLE`].
pub fn server_core_rules() -> Vec<Rule> {
    let mut rules = vec![
        rule(
            &["authentication.k8s.io"],
            &["tokenreviews"],
            &["create"],
            "delegated authentication: kube-apiserver's front proxy forwards callers, bearer tokens are checked with TokenReviews",
        ),
        rule(
            &["authorization.k8s.io"],
            &["subjectaccessreviews"],
            &["create"],
            "delegated authorization: every request is authorized by kube-apiserver with a SubjectAccessReview",
        ),
        rule(
            &[""],
            &["namespaces"],
            &READ,
            "creates in a terminating or missing namespace are refused, and a deleted namespace's reports are removed",
        ),
    ];
    for group in [
        "kyverno.io",
        "admissionregistration.k8s.io",
        "policies.kyverno.io",
    ] {
        let resources: Vec<&str> = POLICY_RESOURCES
            .iter()
            .filter(|(g, _)| *g == group)
            .map(|(_, r)| *r)
            .collect();
        rules.push(rule(&[group], &resources, &READ,
            "the Kyverno merge drops the results of deleted policies, so it watches every policy kind"));
    }
    rules
}

/// [`SERVER_ADOPTION_ROLE`]: the kinds Kyverno policies usually match. Secrets are left out on
/// purpose; an admission report about a kind the server may not read is deleted, as Kyverno
/// deletes it (docs/operator.md says how to add kinds).
pub fn server_adoption_rules() -> Vec<Rule> {
    const WHY: &str = "adopting admission reports written before their object had a UID: the object is looked up by name (metadata only) and becomes the report's owner";
    vec![
        rule(
            &[""],
            &[
                "pods",
                "services",
                "configmaps",
                "serviceaccounts",
                "persistentvolumeclaims",
                "replicationcontrollers",
                "limitranges",
                "resourcequotas",
                "nodes",
                "persistentvolumes",
            ],
            &["get"],
            WHY,
        ),
        rule(
            &["apps"],
            &["deployments", "statefulsets", "daemonsets", "replicasets"],
            &["get"],
            WHY,
        ),
        rule(&["batch"], &["jobs", "cronjobs"], &["get"], WHY),
        rule(
            &["networking.k8s.io"],
            &["ingresses", "networkpolicies"],
            &["get"],
            WHY,
        ),
        rule(&["policy"], &["poddisruptionbudgets"], &["get"], WHY),
        rule(
            &["autoscaling"],
            &["horizontalpodautoscalers"],
            &["get"],
            WHY,
        ),
        rule(
            &["rbac.authorization.k8s.io"],
            &[
                "roles",
                "rolebindings",
                "clusterroles",
                "clusterrolebindings",
            ],
            &["get"],
            WHY,
        ),
    ]
}

/// Names of the report CRDs the migration installs, plus its probe CRD.
fn migration_crd_names() -> Vec<String> {
    ALL.iter()
        .map(|r| r.crd_name())
        .chain([format!("{PROBE_PLURAL}.{PROBE_GROUP}")])
        .collect()
}

/// The three APIServices of the served groups.
pub fn api_service_names() -> Vec<String> {
    GROUP_VERSIONS
        .iter()
        .map(|(group, version)| format!("{version}.{group}"))
        .collect()
}

/// [`MIGRATION_ROLE`]. Every write to another kind names its objects: the migration creates CRDs
/// and the fence with server-side apply, whose create check carries the object's name, so
/// `resourceNames` bounds `create` too.
pub fn migration_rules() -> Vec<Rule> {
    let report_groups: Vec<&str> = GROUP_VERSIONS.iter().map(|(g, _)| *g).collect();
    let report_resources: Vec<&str> = ALL.iter().map(|r| r.plural).collect();
    vec![
        rule(
            &report_groups,
            &report_resources,
            &WRITE,
            "copies the reports out of CRD storage and writes them back on a hand-back",
        ),
        named(
            rule(
                &["apiextensions.k8s.io"],
                &["customresourcedefinitions"],
                &["get", "create", "update", "patch", "delete"],
                "installs the report CRDs for a hand-back, ends CRD watches at the switch, removes its probe CRD",
            ),
            &migration_crd_names(),
        ),
        rule(
            &[PROBE_GROUP],
            &[PROBE_PLURAL],
            &["create"],
            "dry-run creates that check the fence holds (nothing is stored)",
        ),
        named(
            rule(
                &["apiregistration.k8s.io"],
                &["apiservices"],
                &["get", "update", "patch"],
                "switches the groups between CRD storage and the server",
            ),
            &api_service_names(),
        ),
        named(
            rule(
                &["admissionregistration.k8s.io"],
                &[
                    "validatingadmissionpolicies",
                    "validatingadmissionpolicybindings",
                ],
                &["get", "create", "update", "patch", "delete"],
                "the fence that refuses writes to CRD storage while the reports move",
            ),
            &[FENCE_NAME],
        ),
        rule(
            &["authentication.k8s.io"],
            &["selfsubjectreviews"],
            &["create"],
            "learns its own user name, which the fence lets through",
        ),
    ]
}

/// [`METRICS_READER_ROLE`].
pub fn metrics_reader_rules() -> Vec<Rule> {
    vec![Rule {
        non_resource_urls: strings(&["/metrics"]),
        ..rule(
            &[],
            &[],
            &["get"],
            "scrapes the servers' /metrics, which they authorize with a SubjectAccessReview for this non-resource URL (it reads kube-apiserver's own /metrics too: the URL names no server)",
        )
    }]
}

/// The release account's rule (`<name>-release`, a Role of the ReportsServer's namespace): the
/// operator removes its finalizer through it when the operator itself is being uninstalled and
/// its own ServiceAccount or RBAC may already be gone.
pub fn release_rules(reports_server: &str) -> Vec<Rule> {
    vec![
        named(
            rule(
                &["reportsserver.io"],
                &["reportsservers"],
                &["get", "patch"],
                "lets the operator remove its finalizer while it is uninstalled, when its own account may already be deleted",
            ),
            &[reports_server],
        ),
        rule(
            &["", "events.k8s.io"],
            &["events"],
            &["create", "patch"],
            "the Event on the ReportsServer that says so (ReleasedOnUninstall)",
        ),
    ]
}

/// The mailbox ConfigMap's rule, in a Role of the ReportsServer's namespace.
pub fn migration_mailbox_rule(mailbox: &str) -> Rule {
    named(
        rule(
            &[""],
            &["configmaps"],
            &["get", "patch"],
            "reads what the operator asks of the migration and reports its progress there",
        ),
        &[mailbox],
    )
}

/// The operator's ClusterRole: only what is cluster-scoped. `namespace` is the one it manages.
pub fn operator_cluster_rules(namespace: &str) -> Vec<Rule> {
    vec![
        named(
            rule(
                &[""],
                &["namespaces"],
                &["get"],
                "a terminating namespace means it is being uninstalled",
            ),
            &[namespace],
        ),
        rule(
            &["apiregistration.k8s.io"],
            &["apiservices"],
            &["list", "watch"],
            "sees the APIServices of the served groups change (a takeover, a deletion by hand)",
        ),
        named(
            rule(
                &["apiregistration.k8s.io"],
                &["apiservices"],
                &["get", "create", "update", "patch", "delete"],
                "routes the served groups to the servers (server-side apply names the object, so create is bounded too)",
            ),
            &api_service_names(),
        ),
        rule(
            &["reportsserver.io"],
            &["reportsservers"],
            &["get", "list", "watch"],
            "sees ReportsServers outside the namespace it manages, to tell them in an Event that they are not reconciled",
        ),
        rule(
            &["", "events.k8s.io"],
            &["events"],
            &["create", "patch"],
            "Events on the ReportsServers, including those outside the namespace it manages",
        ),
        rule(
            &["rbac.authorization.k8s.io"],
            &["clusterrolebindings"],
            &["get", "create", "update", "patch", "delete"],
            "binds each ReportsServer's ServiceAccount to the shipped server roles",
        ),
        named(
            rule(
                &["rbac.authorization.k8s.io"],
                &["clusterroles"],
                &["bind"],
                "may bind only these roles, without holding their rights (no escalate)",
            ),
            &[
                SERVER_ROLE,
                MIGRATION_ROLE,
                AUTH_DELEGATOR_ROLE,
                METRICS_READER_ROLE,
            ],
        ),
        rule(
            &["rbac.authorization.k8s.io"],
            &["clusterroles"],
            &["get", "delete"],
            "reads the UID of its own ClusterRole, which owns each installation's cluster-scoped objects (the garbage collector removes them when the operator is uninstalled), and removes the per-installation ClusterRole that earlier releases wrote",
        ),
    ]
}

/// The operator's Role in the namespace it manages (`--watch-namespace`).
pub fn operator_namespace_rules() -> Vec<Rule> {
    vec![
        rule(
            &["reportsserver.io"],
            &["reportsservers"],
            &["get", "list", "watch", "patch", "update"],
            "the ReportsServers it reconciles (patch: its finalizer)",
        ),
        rule(
            &[""],
            &["serviceaccounts/token"],
            &["create"],
            "mints short-lived tokens of each installation's release account, which outlives the operator's own ServiceAccount when the operator is uninstalled",
        ),
        rule(
            &["reportsserver.io"],
            &["reportsservers/status"],
            &["get", "patch", "update"],
            "publishes conditions and status",
        ),
        rule(
            &["reportsserver.io"],
            &["reportsservers/finalizers"],
            &["update"],
            "the installation's objects block their owner's deletion (blockOwnerDeletion), which the OwnerReferencesPermissionEnforcement admission plugin allows only to who may update the owner's finalizers",
        ),
        rule(
            &[""],
            &["services", "serviceaccounts", "secrets", "configmaps"],
            &WRITE,
            "the installation's Service, ServiceAccount, generated CA and certificate Secrets, database password Secret and the migration mailbox",
        ),
        rule(
            &["apps"],
            &["deployments", "statefulsets"],
            &WRITE,
            "the servers and the managed PostgreSQL",
        ),
        rule(
            &["policy"],
            &["poddisruptionbudgets"],
            &WRITE,
            "keeps one server replica up during node drains",
        ),
        rule(
            &["rbac.authorization.k8s.io"],
            &["roles", "rolebindings"],
            &WRITE,
            "the Role and RoleBinding of the migration mailbox (rights the operator holds itself)",
        ),
        rule(
            &["monitoring.coreos.com"],
            &["servicemonitors"],
            &["get", "create", "update", "patch", "delete"],
            "the servers' ServiceMonitor (spec.monitoring.serviceMonitor), where the Prometheus Operator's API exists",
        ),
        rule(
            &["discovery.k8s.io"],
            &["endpointslices"],
            &["get", "list"],
            "asks each server endpoint whether it reaches its database (DatabaseAvailable)",
        ),
        rule(
            &["coordination.k8s.io"],
            &["leases"],
            &["get", "create", "update"],
            "leader election between operator replicas",
        ),
    ]
}

/// The operator's Role in kube-system.
pub fn operator_kube_system_rules() -> Vec<Rule> {
    vec![
        rule(
            &["rbac.authorization.k8s.io"],
            &["rolebindings"],
            &["get", "create", "update", "patch", "delete"],
            "binds each server to the front proxy's client-CA reader role (delegated authentication)",
        ),
        named(
            rule(
                &["rbac.authorization.k8s.io"],
                &["roles"],
                &["bind"],
                "may bind only that built-in role",
            ),
            &[AUTH_READER_ROLE],
        ),
    ]
}

/// A Role with `rules` and the RoleBinding of `subjects` to it, both with `metadata` (which
/// names them and says where they live).
pub fn role_and_binding(metadata: &Value, rules: &[Rule], subjects: &Value) -> [Value; 2] {
    let name = &metadata["name"];
    [
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": metadata, "rules": to_json(rules)}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": metadata,
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": subjects}),
    ]
}

/// The rules as a `rules:` list.
pub fn to_json(rules: &[Rule]) -> Value {
    Value::Array(rules.iter().map(Rule::to_json).collect())
}

/// One role of ours, as the permissions table lists it.
pub struct Role {
    /// Whose role it is (and when it is bound).
    pub account: &'static str,
    /// `ClusterRole` or `Role`.
    pub kind: &'static str,
    pub name: String,
    /// `None` for a ClusterRole.
    pub namespace: Option<String>,
    pub rules: Vec<Rule>,
}

/// Every role of ours; `operator_namespace` names where the operator's Role lives.
pub fn all_roles(operator_namespace: &str) -> Vec<Role> {
    let role = |account, kind, name: &str, namespace: Option<&str>, rules| Role {
        account,
        kind,
        name: name.to_owned(),
        namespace: namespace.map(str::to_owned),
        rules,
    };
    let migration = "server (while migration.enabled)";
    let operator = crate::manifests::NAME;
    vec![
        role(
            "server",
            "ClusterRole",
            SERVER_CORE_ROLE,
            None,
            server_core_rules(),
        ),
        role(
            "server",
            "ClusterRole",
            SERVER_ADOPTION_ROLE,
            None,
            server_adoption_rules(),
        ),
        role(
            "Prometheus (spec.monitoring's ServiceAccount, the chart's metrics.scraper)",
            "ClusterRole",
            METRICS_READER_ROLE,
            None,
            metrics_reader_rules(),
        ),
        role(
            migration,
            "ClusterRole",
            MIGRATION_ROLE,
            None,
            migration_rules(),
        ),
        role(
            migration,
            "Role",
            "<name>-migration-mailbox",
            Some("<ReportsServer namespace>"),
            vec![migration_mailbox_rule("<name>-migration")],
        ),
        role(
            "operator (its release account, one per ReportsServer)",
            "Role",
            "<name>-release",
            Some("<ReportsServer namespace>"),
            release_rules("<name>"),
        ),
        role(
            "operator",
            "ClusterRole",
            operator,
            None,
            operator_cluster_rules(operator_namespace),
        ),
        role(
            "operator",
            "Role",
            operator,
            Some(operator_namespace),
            operator_namespace_rules(),
        ),
        role(
            "operator",
            "Role",
            operator,
            Some("kube-system"),
            operator_kube_system_rules(),
        ),
    ]
}

/// The permissions table of docs/operator.md, between its markers.
pub fn permissions_table() -> String {
    let mut out = String::from(
        "| account | role | API group | resources | verbs | only these names | why |\n|---|---|---|---|---|---|---|\n",
    );
    for Role {
        account,
        kind,
        name,
        namespace,
        rules,
    } in all_roles("<operator namespace>")
    {
        let role = match namespace {
            Some(ns) => format!("{kind} `{name}` in {ns}"),
            None => format!("{kind} `{name}`"),
        };
        for r in rules {
            let groups: Vec<String> = r
                .api_groups
                .iter()
                .map(|g| {
                    if g.is_empty() {
                        "core".to_owned()
                    } else {
                        g.clone()
                    }
                })
                .collect();
            let resources = if r.non_resource_urls.is_empty() {
                r.resources.join(", ")
            } else {
                format!("non-resource URL {}", r.non_resource_urls.join(", "))
            };
            out.push_str(&format!(
                "| {account} | {role} | {} | {resources} | {} | {} | {} |\n",
                if groups.is_empty() {
                    "—".to_owned()
                } else {
                    groups.join(", ")
                },
                r.verbs.join(", "),
                if r.resource_names.is_empty() {
                    "—".to_owned()
                } else {
                    r.resource_names.join(", ")
                },
                r.why
            ));
        }
    }
    out
}
