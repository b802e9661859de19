//! The objects a `ReportsServer` asks for, built by pure functions.
//!
//! Why pure: every object the operator applies is decided here from the ReportsServer, the
//! resolved database and the TLS material, with no I/O. That makes the whole installation
//! reviewable as golden YAML (`operator/tests/golden/`), lets the reconciler be a thin "apply
//! these, then read status" loop, and keeps `reports-server manifests` and the operator from
//! disagreeing about names.
//!
//! Objects come as JSON values (`apiVersion`/`kind`/`metadata`/...) because they are applied
//! with server-side apply, which wants exactly the fields we own and nothing else (no `status`,
//! no defaulted fields). Namespaced objects carry an ownerReference to the ReportsServer, so the
//! garbage collector removes them; cluster-scoped objects and the RoleBinding in `kube-system`
//! cannot, so they are listed separately and the finalizer deletes them — the APIServices first.

use std::collections::BTreeMap;

use reports_server_crds::reportsserver::{ExternalPostgresSpec, ReportsServer, ReportsServerSpec};
use serde_json::{Value, json};

use crate::analytics::{MANAGED_DATABASE, MANAGED_OWNER};
use crate::{MANAGED_BY, OWNER_ANNOTATION, rbac};

mod monitoring;

use monitoring::service_monitor;
pub use monitoring::{metrics_reader_binding_name, metrics_reader_name, metrics_reader_token_name};

/// Port the server container listens on.
pub const SERVER_PORT: i32 = 6443;
/// Where the serving certificate is mounted.
const TLS_DIR: &str = "/etc/reports-server/tls";
/// Where the database CA is mounted (`verify-ca`/`verify-full`).
const DB_CA_DIR: &str = "/etc/reports-server/db-ca";
/// Data directory (SQLite file) of the server.
const DATA_DIR: &str = "/var/lib/reports-server";

/// Who chooses the user and group ids of the pods the operator creates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PodIds {
    /// The operator names them: the server image's user 65532 and PostgreSQL's 999, each also
    /// the pod's `fsGroup` so that a freshly provisioned volume is writable. What a Kubernetes
    /// without a security-context policy of its own needs.
    #[default]
    Fixed,
    /// The platform assigns them (OpenShift's restricted SCC gives every pod a user and an
    /// `fsGroup` from the namespace's range and refuses any other): no `runAsUser`,
    /// `runAsGroup` or `fsGroup` is set.
    Platform,
}

impl PodIds {
    /// The pod-level security context for an image whose user is `uid`: restricted Pod Security
    /// Standard in both forms (non-root, RuntimeDefault seccomp).
    fn pod_security_context(self, uid: i64) -> Value {
        let mut context = restricted_pod_context();
        if self == PodIds::Fixed {
            context["runAsUser"] = json!(uid);
            context["runAsGroup"] = json!(uid);
            context["fsGroup"] = json!(uid);
        }
        context
    }
}

/// The pod-level half of the restricted Pod Security Standard, naming no user (the image's
/// numeric USER applies, or the platform's): the operator's own pod, and every pod with
/// [`PodIds::Platform`].
pub(crate) fn restricted_pod_context() -> Value {
    json!({"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}})
}

/// The container-level half of the restricted Pod Security Standard.
pub(crate) fn container_security_context(read_only_root: bool) -> Value {
    json!({
        "allowPrivilegeEscalation": false,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
    })
}

/// The user of the server image (`nonroot` of distroless images; tests/node/image.sh, Dockerfile).
const SERVER_UID: i64 = 65532;
/// The user of the official `postgres` image.
const POSTGRES_UID: i64 = 999;

/// The database after the operator looked at the spec.
#[derive(Clone, Debug, PartialEq)]
pub enum Database {
    /// Embedded SQLite in a StatefulSet with a PVC.
    Sqlite {
        storage_size: String,
        storage_class: Option<String>,
    },
    /// The operator's PostgreSQL StatefulSet; its password is in `<name>-postgres`.
    ManagedPostgres(reports_server_crds::reportsserver::ManagedPostgresSpec),
    /// Someone else's PostgreSQL; credentials from a Secret whose keys were checked.
    ExternalPostgres(ExternalPostgresSpec),
    /// No database here: the server runs outside the cluster.
    External,
}

impl Database {
    /// The name shown in `status.database.type` and the `Database` printer column.
    pub fn type_name(&self) -> &'static str {
        match self {
            Database::Sqlite { .. } => "sqlite",
            Database::ManagedPostgres(_) => "postgres-managed",
            Database::ExternalPostgres(_) => "postgres-external",
            Database::External => "external",
        }
    }
}

/// A spec the operator refuses, with the reason for the condition.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidSpec {
    /// Condition reason (PascalCase).
    pub reason: &'static str,
    /// Human-readable explanation.
    pub message: String,
}

/// Decides the database from the spec, refusing combinations that cannot work instead of
/// silently changing them.
pub fn database_of(spec: &ReportsServerSpec) -> Result<Database, InvalidSpec> {
    let db = &spec.database;
    if spec.external.is_some() {
        if db.sqlite.is_some() || db.postgres.is_some() {
            return Err(InvalidSpec {
                reason: "InvalidSpec",
                message: "spec.external runs the server outside the cluster; spec.database must \
                          stay empty"
                    .into(),
            });
        }
        return Ok(Database::External);
    }
    match (&db.sqlite, &db.postgres) {
        (Some(_), Some(_)) => Err(InvalidSpec {
            reason: "InvalidSpec",
            message: "set only one of spec.database.sqlite and spec.database.postgres".into(),
        }),
        (_, Some(pg)) => match (&pg.managed, &pg.external) {
            (Some(m), None) => Ok(Database::ManagedPostgres(m.clone())),
            (None, Some(e)) if e.secret_name.is_empty() => Err(InvalidSpec {
                reason: "InvalidSpec",
                message: "spec.database.postgres.external.secretName is empty".into(),
            }),
            (None, Some(e)) => Ok(Database::ExternalPostgres(e.clone())),
            _ => Err(InvalidSpec {
                reason: "InvalidSpec",
                message: "set exactly one of spec.database.postgres.managed and \
                          spec.database.postgres.external"
                    .into(),
            }),
        },
        (sqlite, None) => {
            if spec.replicas > 1 {
                return Err(InvalidSpec {
                    reason: "SqliteSingleReplica",
                    message: format!(
                        "spec.replicas is {} but SQLite is a single file that only one pod may \
                         open; use spec.database.postgres for more than one replica",
                        spec.replicas
                    ),
                });
            }
            let sqlite = sqlite.clone().unwrap_or_default();
            Ok(Database::Sqlite {
                storage_size: sqlite.storage_size,
                storage_class: sqlite.storage_class_name,
            })
        }
    }
}

/// The repository of an image reference: `registry:5000/team/name:tag@sha256:…` →
/// `registry:5000/team/name` (a port is not a tag: only a `:` after the last `/` starts one).
pub fn image_repository(image: &str) -> &str {
    let image = image.split_once('@').map_or(image, |(repo, _)| repo);
    let name_start = image.rfind('/').map_or(0, |i| i + 1);
    match image[name_start..].find(':') {
        Some(colon) => &image[..name_start + colon],
        None => image,
    }
}

/// Whether `spec.image` may run: the server runs with cluster-wide rights (TokenReviews,
/// SubjectAccessReviews, reads of policies and workloads), so whoever may create a ReportsServer
/// must not be able to run an image of their choice with them. `allowed` holds repositories
/// (`ghcr.io/acme/reports-server` allows every tag and digest of it), prefixes ending in `/`
/// (every repository under a registry path) or `*` (anything).
pub fn check_image(spec: &ReportsServerSpec, allowed: &[String]) -> Result<(), InvalidSpec> {
    let Some(image) = spec.image.as_deref() else {
        return Ok(());
    };
    let repository = image_repository(image);
    let permitted = allowed.iter().any(|a| {
        a == "*" || a == repository || (a.ends_with('/') && repository.starts_with(a.as_str()))
    });
    if permitted {
        return Ok(());
    }
    Err(InvalidSpec {
        reason: "ImageNotAllowed",
        message: format!(
            "spec.image {image:?} is not in the operator's --allowed-server-images ({}); \
             remove spec.image to run the operator's default, or ask the operator's admin to \
             allow {repository:?}",
            allowed.join(", ")
        ),
    })
}

/// Serving TLS for an in-cluster server.
#[derive(Clone, Debug, PartialEq)]
pub struct Tls {
    /// Secret with `tls.crt`/`tls.key` mounted into the pods.
    pub secret_name: String,
    /// PEM that goes into the APIServices' `caBundle`.
    pub ca_pem: String,
}

/// Everything the builders need besides the ReportsServer.
#[derive(Clone, Debug)]
pub struct Inputs<'a> {
    pub rs: &'a ReportsServer,
    pub database: Database,
    /// `None` only for [`Database::External`].
    pub tls: Option<Tls>,
    /// CA PEM for the external server's APIServices.
    pub external_ca_pem: Option<String>,
    /// Image when the spec has none.
    pub default_image: &'a str,
    /// APIServices that exist, are not ours, and must be left alone (no takeover asked).
    pub foreign_api_services: Vec<String>,
    /// UID of the operator's ClusterRole ([`crate::manifests::NAME`]), which install.yaml and
    /// the chart ship: the owner of the objects the ReportsServer cannot own, so that the garbage
    /// collector removes them when the operator is uninstalled, even when the operator could not
    /// (its account already deleted). Not the Namespace: a namespace whose Service backs an
    /// APIService cannot finish terminating while that APIService exists (its discovery fails).
    /// `None` when there is no such ClusterRole (then only the operator removes them).
    pub owner_uid: Option<String>,
    /// Whether the pods name their user and group ids.
    pub pod_ids: PodIds,
    /// Whether the cluster serves `monitoring.coreos.com/v1` ServiceMonitors: only then does
    /// `spec.monitoring.serviceMonitor` create anything.
    pub monitoring_api: bool,
}

/// The objects of one installation, in apply order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Desired {
    /// Namespaced objects in the ReportsServer's namespace, owned by it.
    pub owned: Vec<Value>,
    /// Cluster-scoped RBAC and the RoleBinding in kube-system (deleted by the finalizer, or by
    /// the garbage collector with the operator's ClusterRole).
    pub unowned: Vec<Value>,
    /// The APIServices (deleted first by the finalizer, or with the operator's ClusterRole).
    pub api_services: Vec<Value>,
}

impl Desired {
    /// Every object, in apply order: owned, unowned, then APIServices (so a group is routed only
    /// once what serves it exists).
    pub fn all(&self) -> impl Iterator<Item = &Value> {
        self.owned
            .iter()
            .chain(self.unowned.iter())
            .chain(self.api_services.iter())
    }

    /// All objects as one YAML stream (golden files, `--dry-run` output).
    pub fn to_yaml(&self) -> String {
        let mut out = String::new();
        for o in self.all() {
            out.push_str("---\n");
            out.push_str(&serde_yaml::to_string(o).expect("objects serialize"));
        }
        out
    }
}

fn name_of(rs: &ReportsServer) -> String {
    rs.metadata.name.clone().unwrap_or_default()
}

fn ns_of(rs: &ReportsServer) -> String {
    rs.metadata.namespace.clone().unwrap_or_default()
}

/// Name used for cluster-scoped objects (unique per ReportsServer).
pub fn cluster_name(rs: &ReportsServer) -> String {
    format!("reportsserver:{}:{}", ns_of(rs), name_of(rs))
}

/// Name of the Service the APIServices point at.
pub fn service_name(rs: &ReportsServer) -> String {
    rs.spec
        .external
        .as_ref()
        .and_then(|e| e.service_name.clone())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| name_of(rs))
}

/// Labels every object of the installation carries.
pub fn labels(rs: &ReportsServer) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".into(), "reports-server".into()),
        ("app.kubernetes.io/instance".into(), name_of(rs)),
        ("app.kubernetes.io/managed-by".into(), MANAGED_BY.into()),
    ])
}

fn selector_labels(rs: &ReportsServer) -> Value {
    json!({"app.kubernetes.io/name": "reports-server", "app.kubernetes.io/instance": name_of(rs)})
}

fn owner_ref(rs: &ReportsServer) -> Value {
    json!([{
        "apiVersion": "reportsserver.io/v1alpha1",
        "kind": "ReportsServer",
        "name": name_of(rs),
        "uid": rs.metadata.uid.clone().unwrap_or_default(),
        "controller": true,
        "blockOwnerDeletion": true,
    }])
}

fn owned_meta(rs: &ReportsServer, name: &str) -> Value {
    json!({
        "name": name,
        "namespace": ns_of(rs),
        "labels": labels(rs),
        "ownerReferences": owner_ref(rs),
    })
}

/// Metadata of an object the ReportsServer cannot own (a namespaced owner cannot own what is
/// cluster-scoped or in another namespace): the annotation records the owner so the finalizer
/// (and the watch on APIServices) can find it, and the operator's ClusterRole owns it, so that
/// an uninstall the operator does not live through leaves nothing routed to nothing. No
/// `blockOwnerDeletion`: nothing waits for it.
fn unowned_meta(
    rs: &ReportsServer,
    owner_uid: Option<&str>,
    name: &str,
    namespace: Option<&str>,
) -> Value {
    let mut meta = json!({
        "name": name,
        "labels": labels(rs),
        "annotations": {OWNER_ANNOTATION: format!("{}/{}", ns_of(rs), name_of(rs))},
    });
    if let Some(ns) = namespace {
        meta["namespace"] = json!(ns);
    }
    if let Some(uid) = owner_uid {
        meta["ownerReferences"] = json!([{"apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole", "name": crate::manifests::NAME, "uid": uid}]);
    }
    meta
}

/// Name of the ServiceAccount, Role and RoleBinding through which the operator removes its
/// finalizer when it is uninstalled (`controller::release`). Nothing owns them: a foreground
/// deletion of their owner (Argo CD deletes that way) would delete them before the finalizer
/// could be removed. The finalizer deletes them, or the namespace's deletion does.
pub fn release_account_name(rs: &ReportsServer) -> String {
    format!("{}-release", name_of(rs))
}

/// The release account: no pod runs as it (no token is mounted); the operator mints short-lived
/// tokens for it.
fn release_account(rs: &ReportsServer) -> Vec<Value> {
    let name = release_account_name(rs);
    let subject = json!([{"kind": "ServiceAccount", "name": name, "namespace": ns_of(rs)}]);
    let meta = unowned_meta(rs, None, &name, Some(&ns_of(rs)));
    let mut objects = vec![json!({
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": meta,
        "automountServiceAccountToken": false,
    })];
    objects.extend(rbac::role_and_binding(
        &meta,
        &rbac::release_rules(&name_of(rs)),
        &subject,
    ));
    objects
}

/// Builds every object of the installation.
pub fn desired(inputs: &Inputs<'_>) -> Desired {
    let rs = inputs.rs;
    let mut d = Desired::default();
    let svc = service_name(rs);
    if rs.spec.migration.enabled {
        let groups: Vec<&str> = rs
            .spec
            .enabled_groups()
            .into_iter()
            .map(|(_, g)| g)
            .collect();
        d.owned.push(migration_mailbox(rs, &groups));
    }
    d.unowned.extend(release_account(rs));
    match &inputs.database {
        Database::External => {
            let ext = rs.spec.external.clone().unwrap_or_default();
            d.owned.push(json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": owned_meta(rs, &svc),
                "spec": {
                    "type": "ExternalName",
                    "externalName": ext.host,
                    "ports": [{"name": "https", "port": ext.port, "protocol": "TCP"}],
                },
            }));
            let ca = inputs.external_ca_pem.clone().unwrap_or_default();
            d.api_services = api_services(inputs, &svc, ext.port, &ca);
            return d;
        }
        Database::ManagedPostgres(pg) => d.owned.extend(managed_postgres(rs, pg, inputs.pod_ids)),
        _ => {}
    }
    let tls = inputs
        .tls
        .clone()
        .expect("in-cluster installations have TLS");
    let name = name_of(rs);
    d.owned.push(json!({
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": owned_meta(rs, &name),
    }));
    let (rbac_owned, rbac_unowned) = server_rbac(rs, inputs.owner_uid.as_deref());
    d.owned.extend(rbac_owned);
    d.owned.push(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned_meta(rs, &svc),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(rs),
            "ports": [{"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"}],
        },
    }));
    d.owned.push(workload(
        rs,
        &inputs.database,
        &tls,
        inputs.default_image,
        inputs.pod_ids,
    ));
    d.owned.push(json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": owned_meta(rs, &name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(rs)}},
    }));
    d.unowned.extend(rbac_unowned);
    if rs.spec.monitoring.service_monitor.enabled && inputs.monitoring_api {
        let (owned, unowned) = service_monitor(rs, &tls, inputs.owner_uid.as_deref());
        d.owned.extend(owned);
        d.unowned.extend(unowned);
    }
    d.api_services = api_services(inputs, &svc, 443, &tls.ca_pem);
    d
}

/// Name of the analysts' Secret (`spec.analytics.readOnlyRole.secretName`).
pub fn analytics_secret_name(rs: &ReportsServer) -> String {
    rs.spec
        .analytics
        .read_only_role
        .secret_name
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("{}-analytics", name_of(rs)))
}

/// The label that marks the analysts' Secret as written by the operator: only a Secret with this
/// label and owned by the ReportsServer is ever read, adopted or deleted as the analysts' one.
pub const ANALYTICS_SECRET_MARK: (&str, &str) = ("reportsserver.io/secret", "analytics");

/// Every other Secret the operator writes or reads for this installation (the PostgreSQL
/// password, the generated CA and serving certificate, the metrics reader's token, and the
/// user's TLS and external-database Secrets): `spec.analytics.readOnlyRole.secretName` may name
/// none of them.
pub fn reserved_secret_names(rs: &ReportsServer) -> Vec<String> {
    let mut names = vec![
        postgres_name(rs),
        tls_secret_name(rs),
        ca_secret_name(rs),
        metrics_reader_token_name(rs),
    ];
    names.extend(rs.spec.tls.secret_name.clone());
    if let Some(external) = rs
        .spec
        .database
        .postgres
        .as_ref()
        .and_then(|p| p.external.as_ref())
    {
        names.push(external.secret_name.clone());
        names.extend(external.ca_secret.as_ref().map(|c| c.name.clone()));
    }
    names.retain(|n| !n.is_empty());
    names
}

/// DNS name of the managed PostgreSQL's Service.
pub fn postgres_host(rs: &ReportsServer) -> String {
    format!("{}.{}.svc", postgres_name(rs), ns_of(rs))
}

fn api_services(inputs: &Inputs<'_>, svc: &str, port: i32, ca_pem: &str) -> Vec<Value> {
    use base64::Engine as _;
    let rs = inputs.rs;
    let bundle = base64::engine::general_purpose::STANDARD.encode(ca_pem.as_bytes());
    rs.spec
        .enabled_groups()
        .into_iter()
        .map(|(version, group)| format!("{version}.{group}"))
        .filter(|name| !inputs.foreign_api_services.contains(name))
        .map(|name| {
            let (version, group) = name.split_once('.').expect("version.group");
            let mut meta = unowned_meta(rs, inputs.owner_uid.as_deref(), &name, None);
            // kube-aggregator's autoregister controller only manages APIServices labelled
            // automanaged "true"/"onstart"; "false" keeps it from reclaiming a taken-over one.
            meta["labels"]["kube-aggregator.kubernetes.io/automanaged"] = json!("false");
            json!({
                "apiVersion": "apiregistration.k8s.io/v1",
                "kind": "APIService",
                "metadata": meta,
                "spec": {
                    "group": group,
                    "version": version,
                    "groupPriorityMinimum": rs.spec.api_services.group_priority_minimum,
                    "versionPriority": rs.spec.api_services.version_priority,
                    "service": {"namespace": ns_of(rs), "name": svc, "port": port},
                    "caBundle": bundle,
                },
            })
        })
        .collect()
}

/// The server's bindings to the shipped roles ([`crate::rbac`]): the aggregated server role,
/// the two built-in roles of delegated authentication, and while a migration may run the
/// migration's role and its mailbox's Role. The operator writes no role with rights of its own
/// choosing: it may only bind these (`bind` with `resourceNames`).
fn server_rbac(rs: &ReportsServer, owner_uid: Option<&str>) -> (Vec<Value>, Vec<Value>) {
    let cluster = cluster_name(rs);
    let subject = json!([{"kind": "ServiceAccount", "name": name_of(rs), "namespace": ns_of(rs)}]);
    let cluster_binding = |name: String, role: &str| {
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": unowned_meta(rs, owner_uid, &name, None),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": subject,
        })
    };
    let mut unowned = vec![
        cluster_binding(server_binding_name(rs), rbac::SERVER_ROLE),
        cluster_binding(
            format!("{cluster}:auth-delegator"),
            rbac::AUTH_DELEGATOR_ROLE,
        ),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": unowned_meta(rs, owner_uid, &format!("{cluster}:auth-reader"), Some("kube-system")),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": rbac::AUTH_READER_ROLE},
            "subjects": subject,
        }),
    ];
    let mut owned = Vec::new();
    if rs.spec.migration.enabled {
        unowned.push(cluster_binding(
            migration_binding_name(rs),
            rbac::MIGRATION_ROLE,
        ));
        owned.extend(rbac::role_and_binding(
            &owned_meta(rs, &migration_mailbox_role_name(rs)),
            &[rbac::migration_mailbox_rule(&migration_mailbox_name(rs))],
            &subject,
        ));
    }
    (owned, unowned)
}

/// The ClusterRoleBinding of the server to [`rbac::SERVER_ROLE`]. Not [`cluster_name`], which
/// earlier releases bound to a ClusterRole of their own: a binding's roleRef cannot change.
pub fn server_binding_name(rs: &ReportsServer) -> String {
    format!("{}:server", cluster_name(rs))
}

/// The ClusterRoleBinding of the server to [`rbac::MIGRATION_ROLE`].
pub fn migration_binding_name(rs: &ReportsServer) -> String {
    format!("{}:migration", cluster_name(rs))
}

/// The Role (and RoleBinding) that lets the server read and write its migration mailbox.
pub fn migration_mailbox_role_name(rs: &ReportsServer) -> String {
    format!("{}-mailbox", migration_mailbox_name(rs))
}

/// How long a terminating server pod keeps serving (`serve --shutdown-delay-seconds`).
pub const SHUTDOWN_DELAY_SECONDS: u32 = 5;

/// Name of the managed PostgreSQL's StatefulSet, Service and password Secret.
pub fn postgres_name(rs: &ReportsServer) -> String {
    format!("{}-postgres", name_of(rs))
}

/// Name of the generated serving-certificate Secret.
pub fn tls_secret_name(rs: &ReportsServer) -> String {
    format!("{}-tls", name_of(rs))
}

/// Name of the generated CA Secret.
pub fn ca_secret_name(rs: &ReportsServer) -> String {
    format!("{}-ca", name_of(rs))
}

fn managed_postgres(
    rs: &ReportsServer,
    pg: &reports_server_crds::reportsserver::ManagedPostgresSpec,
    pod_ids: PodIds,
) -> Vec<Value> {
    let name = postgres_name(rs);
    let sel =
        json!({"app.kubernetes.io/name": "postgres", "app.kubernetes.io/instance": name_of(rs)});
    let mut meta = owned_meta(rs, &name);
    meta["labels"]["app.kubernetes.io/name"] = json!("postgres");
    let mut claim = json!({
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": pg.storage_size}}},
    });
    if let Some(class) = &pg.storage_class_name {
        claim["spec"]["storageClassName"] = json!(class);
    }
    let mut container = json!({
        "name": "postgres",
        "image": pg.image,
        "env": [
            {"name": "POSTGRES_DB", "value": MANAGED_DATABASE},
            {"name": "POSTGRES_USER", "value": MANAGED_OWNER},
            {"name": "POSTGRES_PASSWORD", "valueFrom": {"secretKeyRef": {"name": name, "key": "password"}}},
            {"name": "PGDATA", "value": "/var/lib/postgresql/data/pgdata"},
        ],
        "ports": [{"name": "postgres", "containerPort": 5432}],
        "readinessProbe": {"exec": {"command": ["pg_isready", "-U", MANAGED_OWNER, "-d", MANAGED_DATABASE]}, "periodSeconds": 5},
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/postgresql/data"}],
        // Restricted Pod Security Standard: the entrypoint of the official image runs as the
        // pod's user when that is not root (its data directory, PGDATA, a subdirectory of the
        // volume it creates; any uid through nss_wrapper), so nothing needs root.
        "securityContext": container_security_context(false),
    });
    if let Some(r) = &pg.resources {
        container["resources"] = serde_json::to_value(r).expect("resources serialize");
    }
    // More than the selector (which a StatefulSet never changes): the chart's NetworkPolicy
    // tells this PostgreSQL from the user's own.
    let mut postgres_pod_labels = sel.clone();
    postgres_pod_labels["app.kubernetes.io/part-of"] = json!("reports-server");
    let mut pod_spec = json!({
        "securityContext": pod_ids.pod_security_context(POSTGRES_UID),
        "containers": [container],
    });
    if !rs.spec.image_pull_secrets.is_empty() {
        // Only when set: kube-apiserver drops an empty list, and the live object would differ.
        pod_spec["imagePullSecrets"] =
            serde_json::to_value(&rs.spec.image_pull_secrets).expect("serialize");
    }
    vec![
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {"selector": sel, "ports": [{"name": "postgres", "port": 5432, "targetPort": "postgres"}]},
        }),
        json!({
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": meta,
            "spec": {
                "serviceName": name,
                "replicas": 1,
                "selector": {"matchLabels": sel},
                "template": {
                    "metadata": {"labels": postgres_pod_labels},
                    "spec": pod_spec,
                },
                "volumeClaimTemplates": [claim],
            },
        }),
    ]
}

fn env_secret(name: &str, secret: &str, key: &str) -> Value {
    json!({"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
}

/// The server's database environment (never a password in plain text).
fn database_env(rs: &ReportsServer, db: &Database) -> (Vec<Value>, Vec<Value>, Vec<Value>) {
    let (mut env, mut mounts, mut volumes) = (Vec::new(), Vec::new(), Vec::new());
    match db {
        Database::Sqlite { .. } | Database::External => {}
        Database::ManagedPostgres(_) => {
            let pg = postgres_name(rs);
            env.push(json!({"name": "DB_HOST", "value": postgres_host(rs)}));
            env.push(json!({"name": "DB_PORT", "value": "5432"}));
            env.push(json!({"name": "DB_DATABASE", "value": MANAGED_DATABASE}));
            env.push(json!({"name": "DB_USER", "value": MANAGED_OWNER}));
            env.push(env_secret("DB_PASSWORD", &pg, "password"));
        }
        Database::ExternalPostgres(e) => {
            if let Some(url_key) = &e.url_key {
                env.push(env_secret(
                    "REPORTS_SERVER_DATABASE_URL",
                    &e.secret_name,
                    url_key,
                ));
            } else {
                let s = &e.secret_name;
                env.push(env_secret("DB_HOST", s, &e.host_key));
                env.push(json!({"name": "DB_PORT", "valueFrom": {"secretKeyRef": {"name": s, "key": e.port_key, "optional": true}}}));
                env.push(env_secret("DB_DATABASE", s, &e.database_key));
                env.push(env_secret("DB_USER", s, &e.user_key));
                env.push(env_secret("DB_PASSWORD", s, &e.password_key));
                let mut query = format!("sslmode={}", e.ssl_mode);
                if let Some(ca) = &e.ca_secret {
                    let key = if ca.key.is_empty() { "ca.crt" } else { &ca.key };
                    query.push_str(&format!("&sslrootcert={DB_CA_DIR}/{key}"));
                    mounts.push(json!({"name": "db-ca", "mountPath": DB_CA_DIR, "readOnly": true}));
                    volumes.push(json!({"name": "db-ca", "secret": {"secretName": ca.name}}));
                }
                // Kubernetes expands $(VAR) from the variables defined above.
                env.push(json!({
                    "name": "REPORTS_SERVER_DATABASE_URL",
                    "value": format!("postgres://$(DB_USER):$(DB_PASSWORD)@$(DB_HOST):$(DB_PORT)/$(DB_DATABASE)?{query}"),
                }));
            }
        }
    }
    (env, mounts, volumes)
}

/// `reports-server serve` arguments for the spec.
pub fn server_args(rs: &ReportsServer, db: &Database) -> Vec<String> {
    let spec = &rs.spec;
    let a = &spec.aggregation;
    let mut args: Vec<String> = vec![
        "serve".into(),
        "--auth-mode=delegated".into(),
        "--bind-address=0.0.0.0".into(),
        format!("--secure-port={SERVER_PORT}"),
        format!("--tls-cert-file={TLS_DIR}/tls.crt"),
        format!("--tls-private-key-file={TLS_DIR}/tls.key"),
        format!(
            "--data-dir={}",
            if matches!(db, Database::Sqlite { .. }) {
                DATA_DIR
            } else {
                "/tmp"
            }
        ),
        format!("--aggregation={}", a.enabled),
        // Terminating pods keep answering while their endpoint removal reaches kube-apiserver's
        // aggregator; without it a rolling update fails the requests routed in that window.
        format!("--shutdown-delay-seconds={SHUTDOWN_DELAY_SECONDS}"),
    ];
    if let Some(id) = &spec.cluster_id {
        args.push(format!("--cluster-id={id}"));
    }
    if a.enabled {
        args.push(format!("--aggregation-delay={}", a.delay));
        args.push(format!("--aggregation-layout={}", a.layout));
        args.push(format!("--chunk-size={}", a.chunk_size));
        args.push(format!("--aggregation-workers={}", a.workers));
    }
    if spec.migration.enabled {
        // The server's migration worker converges on the mailbox's `groups`; the flags say
        // where the switched APIServices point and what to do without a mailbox.
        let groups: Vec<&str> = spec.enabled_groups().into_iter().map(|(_, g)| g).collect();
        args.extend([
            "--migrate-from-crds".to_string(),
            format!(
                "--migration-mailbox={}/{}",
                ns_of(rs),
                migration_mailbox_name(rs)
            ),
            format!("--migration-groups={}", groups.join(",")),
            format!("--migration-service-namespace={}", ns_of(rs)),
            format!("--migration-service-name={}", service_name(rs)),
            format!("--migration-ca-bundle-file={TLS_DIR}/ca.crt"),
        ]);
        if spec.migration.rate > 0 {
            args.push(format!("--migration-rate={}", spec.migration.rate));
        }
    }
    args.extend(spec.extra_args.iter().cloned());
    args
}

/// Name of the ConfigMap through which the operator tells the server's migration worker which
/// groups to serve, and the worker reports progress (`migration::mailbox`).
pub fn migration_mailbox_name(rs: &ReportsServer) -> String {
    format!("{}-migration", name_of(rs))
}

/// The mailbox with the groups the server should serve (`groups`; the worker writes the rest).
pub fn migration_mailbox(rs: &ReportsServer, groups: &[&str]) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": owned_meta(rs, &migration_mailbox_name(rs)),
        "data": {"groups": groups.join(",")},
    })
}

fn workload(
    rs: &ReportsServer,
    db: &Database,
    tls: &Tls,
    default_image: &str,
    pod_ids: PodIds,
) -> Value {
    let spec = &rs.spec;
    let name = name_of(rs);
    let (mut env, mut mounts, mut volumes) = database_env(rs, db);
    env.extend(
        spec.extra_env
            .iter()
            .map(|e| serde_json::to_value(e).expect("env serializes")),
    );
    mounts.push(json!({"name": "tls", "mountPath": TLS_DIR, "readOnly": true}));
    mounts.push(json!({"name": "tmp", "mountPath": "/tmp"}));
    volumes.push(json!({"name": "tls", "secret": {"secretName": tls.secret_name}}));
    volumes.push(json!({"name": "tmp", "emptyDir": {}}));
    let probe = |path: &str, failures: i32| json!({"httpGet": {"path": path, "port": "https", "scheme": "HTTPS"}, "periodSeconds": 5, "failureThreshold": failures});
    let mut container = json!({
        "name": "reports-server",
        "image": spec.image.clone().unwrap_or_else(|| default_image.to_owned()),
        "imagePullPolicy": spec.image_pull_policy.clone().unwrap_or_else(|| "IfNotPresent".into()),
        "args": server_args(rs, db),
        "ports": [{"name": "https", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        // Neither depends on the database: a pod that cannot reach it stays in the Service and
        // answers data requests 503, so the APIServices stay Available and discovery whole
        // (docs/operations.md); the operator's DatabaseAvailable condition tells the outage.
        "livenessProbe": probe("/livez", 6),
        "readinessProbe": probe("/readyz", 3),
        "securityContext": container_security_context(true),
        "volumeMounts": mounts,
    });
    if !env.is_empty() {
        container["env"] = json!(env);
    }
    if let Some(r) = &spec.resources {
        container["resources"] = serde_json::to_value(r).expect("resources serialize");
    }
    let mut pod = json!({
        "serviceAccountName": name,
        "securityContext": pod_ids.pod_security_context(SERVER_UID),
        "containers": [container],
        "volumes": volumes,
    });
    // None by default: GKE admits `system-cluster-critical` outside kube-system only with a
    // ResourceQuota that allows it (docs/operator.md).
    if let Some(class) = &spec.priority_class_name {
        pod["priorityClassName"] = json!(class);
    }
    if !spec.node_selector.is_empty() {
        pod["nodeSelector"] = json!(spec.node_selector);
    }
    if !spec.tolerations.is_empty() {
        pod["tolerations"] = serde_json::to_value(&spec.tolerations).expect("serialize");
    }
    if let Some(a) = &spec.affinity {
        pod["affinity"] = serde_json::to_value(a).expect("serialize");
    }
    if !spec.topology_spread_constraints.is_empty() {
        pod["topologySpreadConstraints"] =
            serde_json::to_value(&spec.topology_spread_constraints).expect("serialize");
    }
    if !spec.image_pull_secrets.is_empty() {
        pod["imagePullSecrets"] =
            serde_json::to_value(&spec.image_pull_secrets).expect("serialize");
    }
    let template = json!({"metadata": {"labels": selector_labels(rs)}, "spec": pod});
    match db {
        Database::Sqlite {
            storage_size,
            storage_class,
        } => {
            let mut template = template;
            template["spec"]["containers"][0]["volumeMounts"]
                .as_array_mut()
                .expect("mounts")
                .push(json!({"name": "data", "mountPath": DATA_DIR}));
            let mut claim = json!({
                "metadata": {"name": "data"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": storage_size}}},
            });
            if let Some(class) = storage_class {
                claim["spec"]["storageClassName"] = json!(class);
            }
            json!({
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "metadata": owned_meta(rs, &name),
                "spec": {
                    "serviceName": service_name(rs),
                    "replicas": 1,
                    "selector": {"matchLabels": selector_labels(rs)},
                    "template": template,
                    "volumeClaimTemplates": [claim],
                    "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"},
                },
            })
        }
        _ => json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": owned_meta(rs, &name),
            "spec": {
                "replicas": spec.replicas,
                "selector": {"matchLabels": selector_labels(rs)},
                // Never fewer ready pods than asked for during a rollout: the APIServices keep
                // pointing at the Service, and the Service always has a ready endpoint.
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                "template": template,
            },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reports_server_crds::reportsserver::*;

    fn rs(spec: ReportsServerSpec) -> ReportsServer {
        let mut rs = ReportsServer::new("rs", spec);
        rs.metadata.namespace = Some("reports".into());
        rs
    }

    /// The pod templates of an installation with `database`, with `ids`.
    fn pod_specs(spec: ReportsServerSpec, ids: PodIds) -> Vec<Value> {
        let r = rs(spec);
        let d = desired(&Inputs {
            rs: &r,
            database: database_of(&r.spec).unwrap(),
            tls: Some(Tls {
                secret_name: "rs-tls".into(),
                ca_pem: "PEM".into(),
            }),
            external_ca_pem: None,
            default_image: "img",
            foreign_api_services: Vec::new(),
            owner_uid: None,
            pod_ids: ids,
            monitoring_api: true,
        });
        d.owned
            .iter()
            .filter(|o| o["kind"] == "StatefulSet" || o["kind"] == "Deployment")
            .map(|o| o["spec"]["template"]["spec"].clone())
            .collect()
    }

    fn managed_postgres_spec() -> ReportsServerSpec {
        ReportsServerSpec {
            database: DatabaseSpec {
                postgres: Some(PostgresSpec {
                    managed: Some(ManagedPostgresSpec::default()),
                    external: None,
                }),
                sqlite: None,
            },
            ..Default::default()
        }
    }

    /// What the restricted Pod Security Standard asks of a pod (policy version 1.30+).
    fn restricted_violations(pod: &Value) -> Vec<String> {
        let mut found = Vec::new();
        let pod_ctx = &pod["securityContext"];
        for c in pod["containers"].as_array().unwrap() {
            let ctx = &c["securityContext"];
            let name = c["name"].as_str().unwrap();
            if ctx["allowPrivilegeEscalation"] != false {
                found.push(format!("{name}: allowPrivilegeEscalation not false"));
            }
            if ctx["capabilities"]["drop"] != json!(["ALL"]) {
                found.push(format!("{name}: capabilities not dropped"));
            }
            if ctx["runAsNonRoot"] != true && pod_ctx["runAsNonRoot"] != true {
                found.push(format!("{name}: runAsNonRoot not true"));
            }
            if ctx["runAsUser"] == 0 || pod_ctx["runAsUser"] == 0 {
                found.push(format!("{name}: runs as root"));
            }
            let seccomp = if ctx["seccompProfile"].is_null() {
                &pod_ctx["seccompProfile"]
            } else {
                &ctx["seccompProfile"]
            };
            if seccomp["type"] != "RuntimeDefault" && seccomp["type"] != "Localhost" {
                found.push(format!("{name}: no RuntimeDefault seccomp profile"));
            }
        }
        found
    }

    #[test]
    fn every_pod_passes_the_restricted_pod_security_standard() {
        for ids in [PodIds::Fixed, PodIds::Platform] {
            for spec in [ReportsServerSpec::default(), managed_postgres_spec()] {
                for pod in pod_specs(spec, ids) {
                    assert_eq!(restricted_violations(&pod), Vec::<String>::new(), "{pod:#}");
                }
            }
        }
    }

    #[test]
    fn platform_assigned_ids_name_no_user_or_group() {
        for spec in [ReportsServerSpec::default(), managed_postgres_spec()] {
            for pod in pod_specs(spec.clone(), PodIds::Platform) {
                let text = pod.to_string();
                for field in ["runAsUser", "runAsGroup", "fsGroup"] {
                    assert!(!text.contains(field), "{field} in {pod:#}");
                }
            }
            // Fixed: the image's own user, and the same group on the volumes.
            for pod in pod_specs(spec, PodIds::Fixed) {
                let ctx = &pod["securityContext"];
                assert!(ctx["runAsUser"] == SERVER_UID || ctx["runAsUser"] == POSTGRES_UID);
                assert_eq!(ctx["fsGroup"], ctx["runAsUser"]);
            }
        }
    }

    #[test]
    fn no_priority_class_unless_asked() {
        let pods = pod_specs(ReportsServerSpec::default(), PodIds::Fixed);
        assert!(pods[0].get("priorityClassName").is_none(), "{:#}", pods[0]);
        let pods = pod_specs(
            ReportsServerSpec {
                priority_class_name: Some("system-cluster-critical".into()),
                ..Default::default()
            },
            PodIds::Fixed,
        );
        assert_eq!(pods[0]["priorityClassName"], "system-cluster-critical");
    }

    #[test]
    fn sqlite_with_two_replicas_is_refused_with_a_reason() {
        let err = database_of(&ReportsServerSpec {
            replicas: 2,
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(err.reason, "SqliteSingleReplica");
        assert!(err.message.contains("postgres"), "{}", err.message);
    }

    #[test]
    fn image_repository_strips_tag_and_digest_but_not_a_port() {
        for (image, repo) in [
            ("reports-server:0.1.0", "reports-server"),
            ("reports-server", "reports-server"),
            ("registry:5000/team/rs:v1", "registry:5000/team/rs"),
            ("registry:5000/team/rs", "registry:5000/team/rs"),
            ("ghcr.io/a/rs@sha256:abc", "ghcr.io/a/rs"),
            ("ghcr.io/a/rs:v1@sha256:abc", "ghcr.io/a/rs"),
        ] {
            assert_eq!(image_repository(image), repo, "{image}");
        }
    }

    #[test]
    fn only_allowed_images_run() {
        let allowed = vec![
            "ghcr.io/acme/reports-server".to_string(),
            "registry.corp/mirror/".into(),
        ];
        let with = |image: &str| ReportsServerSpec {
            image: Some(image.into()),
            ..Default::default()
        };
        assert!(check_image(&ReportsServerSpec::default(), &allowed).is_ok());
        assert!(check_image(&with("ghcr.io/acme/reports-server:v2"), &allowed).is_ok());
        assert!(check_image(&with("ghcr.io/acme/reports-server@sha256:ab"), &allowed).is_ok());
        assert!(check_image(&with("registry.corp/mirror/anything:1"), &allowed).is_ok());
        for bad in [
            "ghcr.io/acme/reports-server-evil:v2",
            "ghcr.io/evil/reports-server:v2",
            "registry.corp/mirror-evil/x:1",
        ] {
            let err = check_image(&with(bad), &allowed).unwrap_err();
            assert_eq!(err.reason, "ImageNotAllowed", "{bad}");
            assert!(
                err.message.contains("--allowed-server-images"),
                "{}",
                err.message
            );
        }
        assert!(check_image(&with("anything:1"), &["*".to_string()]).is_ok());
    }

    #[test]
    fn a_cluster_id_reaches_the_server_only_when_set() {
        let db = Database::Sqlite {
            storage_size: "1Gi".into(),
            storage_class: None,
        };
        let unset = server_args(&rs(ReportsServerSpec::default()), &db);
        assert!(!unset.iter().any(|a| a.starts_with("--cluster-id")));
        let set = server_args(
            &rs(ReportsServerSpec {
                cluster_id: Some("east".into()),
                ..Default::default()
            }),
            &db,
        );
        assert!(set.contains(&"--cluster-id=east".to_string()));
    }

    #[test]
    fn postgres_needs_exactly_one_mode() {
        let spec = ReportsServerSpec {
            database: DatabaseSpec {
                postgres: Some(PostgresSpec::default()),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(database_of(&spec).unwrap_err().reason, "InvalidSpec");
    }

    #[test]
    fn foreign_api_services_are_left_out() {
        let r = rs(ReportsServerSpec {
            external: Some(ExternalSpec {
                host: "localhost".into(),
                port: 6443,
                ..Default::default()
            }),
            ..Default::default()
        });
        let d = desired(&Inputs {
            rs: &r,
            database: Database::External,
            tls: None,
            external_ca_pem: Some("PEM".into()),
            default_image: "img",
            foreign_api_services: vec!["v1.reports.kyverno.io".into()],
            owner_uid: Some("clusterrole-uid".into()),
            pod_ids: PodIds::Fixed,
            monitoring_api: true,
        });
        let names: Vec<&str> = d
            .api_services
            .iter()
            .map(|a| a["metadata"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            ["v1alpha2.wgpolicyk8s.io", "v1alpha1.openreports.io"]
        );
        // No cluster RBAC for an external server: only the release account.
        assert!(
            d.unowned
                .iter()
                .all(|o| o["metadata"]["name"] == "rs-release"
                    && o["metadata"]["namespace"] == "reports"),
            "{:#?}",
            d.unowned
        );
    }
}
