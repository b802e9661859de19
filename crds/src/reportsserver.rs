//! `ReportsServer` (`reportsserver.io/v1alpha1`): one object declares one installation of
//! reports-server, and the operator (`reports-server operator`) turns it into running objects.
//!
//! Why these shapes:
//! * Every field has a default, so `spec: {}` is a working single-replica SQLite installation.
//!   Defaults live in serde (`#[serde(default)]`), so the operator and the generated schema
//!   agree without a defaulting webhook.
//! * Choices that exclude each other (`database.sqlite` / `database.postgres.managed` /
//!   `database.postgres.external`) are optional sub-objects rather than a tagged enum: the API
//!   server keeps a structural schema, and a spec that sets two of them is refused by the
//!   operator with a condition that says which, instead of being silently reinterpreted.
//! * Status follows both conventions Argo CD and kstatus read: `observedGeneration`, `Ready`
//!   (normal-true), `Reconciling` and `Stalled` (kstatus' abnormal-true pair) and `Degraded`
//!   (true whenever `Stalled` is, with the same reason, for readers that expect it). The
//!   migration issue fills `status.migration`; the field exists now so that no status schema
//!   change is needed then.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, LocalObjectReference, ResourceRequirements, Toleration,
    TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of the operator's own kind.
pub const GROUP: &str = "reportsserver.io";
/// Version of the operator's own kind.
pub const VERSION: &str = "v1alpha1";

/// Condition types the operator writes.
pub mod condition {
    /// Every enabled group is served (APIService Available) and the workload is ready.
    pub const READY: &str = "Ready";
    /// The operator is still converging towards the spec (kstatus: InProgress).
    pub const RECONCILING: &str = "Reconciling";
    /// Progress needs a user action (kstatus: Failed); same reason as `Degraded`.
    pub const STALLED: &str = "Stalled";
    /// Same as `Stalled`, for readers that expect Degraded (Argo CD style).
    pub const DEGRADED: &str = "Degraded";
    /// Whether the servers reach their database (`Unknown` when none answered). Not part of
    /// `Ready`: a server whose database is down still serves discovery and answers data
    /// requests 503, and an outage usually ends without the user.
    pub const DATABASE_AVAILABLE: &str = "DatabaseAvailable";
    /// Whether analysts' read-only access (`spec.analytics.readOnlyRole`) is in place; only
    /// while it is asked for. Not part of `Ready`: the reports are served either way.
    pub const ANALYTICS_ACCESS: &str = "AnalyticsAccess";
    /// Whether the ServiceMonitor (`spec.monitoring.serviceMonitor`) is in place; only while
    /// it is asked for. Not part of `Ready`.
    pub const MONITORING: &str = "Monitoring";
}

/// One reports-server installation: database, replicas, TLS, served groups, aggregation, or a
/// server outside the cluster (`external`).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "reportsserver.io",
    version = "v1alpha1",
    kind = "ReportsServer",
    plural = "reportsservers",
    singular = "reportsserver",
    shortname = "rsrv",
    namespaced,
    status = "ReportsServerStatus",
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Database","type":"string","jsonPath":".status.database.type"}"#,
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    // The operator refuses the same combinations (`Stalled`, reason `InvalidSpec`), for objects
    // stored before these rules existed; here a mistake is refused at apply time.
    validation = Rule::new(
        "!has(self.spec.database) || !has(self.spec.database.sqlite) || !has(self.spec.database.postgres)"
    ).message("set only one of spec.database.sqlite and spec.database.postgres").field_path(".spec.database"),
    validation = Rule::new(
        "!has(self.spec.database) || !has(self.spec.database.postgres) || has(self.spec.database.postgres.managed) != has(self.spec.database.postgres.external)"
    ).message("set exactly one of spec.database.postgres.managed and spec.database.postgres.external").field_path(".spec.database.postgres"),
    validation = Rule::new(
        "!has(self.spec.database) || !has(self.spec.database.postgres) || !has(self.spec.database.postgres.external) || (has(self.spec.database.postgres.external.secretName) && self.spec.database.postgres.external.secretName != '')"
    ).message("spec.database.postgres.external.secretName must name the Secret with the database credentials").field_path(".spec.database.postgres.external.secretName"),
    validation = Rule::new(
        "!has(self.spec.external) || !has(self.spec.database) || (!has(self.spec.database.sqlite) && !has(self.spec.database.postgres))"
    ).message("spec.external runs the server outside the cluster: leave spec.database empty").field_path(".spec.database"),
    validation = Rule::new(
        "has(self.spec.external) || (has(self.spec.database) && has(self.spec.database.postgres)) || !has(self.spec.replicas) || self.spec.replicas <= 1"
    ).message("SQLite (the default database) is one file only one pod may open: set spec.replicas to 1, or use spec.database.postgres for more replicas").field_path(".spec.replicas"),
    validation = Rule::new(
        "!has(self.spec.clusterId) || self.spec.clusterId != 'all'"
    ).message("spec.clusterId 'all' is reserved (reports-server query --cluster-id all means every cluster; serve refuses it): choose another id").field_path(".spec.clusterId")
)]
#[serde(rename_all = "camelCase", default)]
pub struct ReportsServerSpec {
    /// Where reports are stored. Empty means embedded SQLite on a PersistentVolumeClaim.
    pub database: DatabaseSpec,
    /// Number of server pods. SQLite allows exactly 1; PostgreSQL allows any number.
    #[schemars(range(min = 0))]
    pub replicas: i32,
    /// Server image. Empty means `reports-server:<operator version>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// `Always`, `IfNotPresent` or `Never`. Empty means `IfNotPresent`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["Always", "IfNotPresent", "Never"]))]
    pub image_pull_policy: Option<String>,
    /// Resources of the server container.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Node selector of the server pods.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations of the server pods.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Affinity of the server pods.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Topology spread constraints of the server pods (e.g. one replica per zone).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// Secrets (in the ReportsServer's namespace) with credentials for pulling the server's and
    /// the managed PostgreSQL's images from a private registry.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// PriorityClass of the server pods [default: none]. The report APIs sit on the path of
    /// namespace deletion and garbage collection: `system-cluster-critical` fits where it is
    /// admitted (on GKE, outside kube-system, only with a ResourceQuota scoped to it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// This cluster's partition of a database several clusters share (`--cluster-id`)
    /// [default: `default`]. Give each cluster writing to one database its own: the first
    /// server of a cluster records the cluster (its kube-system namespace UID) on the id, and a
    /// server of another cluster refuses to start on it. `all` is reserved (`reports-server
    /// query --cluster-id all` means every cluster).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 64),
        pattern(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
    )]
    pub cluster_id: Option<String>,
    /// Extra arguments appended to `reports-server serve`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub extra_args: Vec<String>,
    /// Extra environment variables of the server container.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub extra_env: Vec<EnvVar>,
    /// Which API groups to serve (each on by default).
    pub groups: GroupsSpec,
    /// In-process merge of ephemeral reports into policy reports (`serve --aggregation*`).
    pub aggregation: AggregationSpec,
    /// Serving certificate of the server and the `caBundle` of the APIServices.
    pub tls: TlsSpec,
    /// APIService settings, including the explicit takeover of APIServices someone else owns.
    pub api_services: ApiServicesSpec,
    /// Serve from a server running outside the cluster: no Deployment, the APIServices point at
    /// an ExternalName Service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub external: Option<ExternalSpec>,
    /// Moving reports that are in etcd-backed CRDs into the database, and back.
    pub migration: MigrationSpec,
    /// Read-only SQL access for analysts (docs/analytics-access.md). Off by default.
    pub analytics: AnalyticsSpec,
    /// Prometheus Operator objects for scraping the servers' `/metrics`. Off by default.
    pub monitoring: MonitoringSpec,
}

/// Read-only SQL access to the reports for analysts (docs/analytics-access.md).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct AnalyticsSpec {
    /// A PostgreSQL role that may only read, with its connection details in a Secret.
    pub read_only_role: ReadOnlyRoleSpec,
}

/// The analysts' read-only PostgreSQL role.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct ReadOnlyRoleSpec {
    /// With `database.postgres.managed`, the operator keeps a LOGIN role `reports_analytics`
    /// that may read every table and view (also those later releases add) and nothing else,
    /// and writes its connection details into a Secret [default: false]. Other databases: the
    /// `AnalyticsAccess` condition says what to do instead (docs/analytics-access.md). Turned
    /// off, the role is dropped and the Secret deleted.
    pub enabled: bool,
    /// The Secret with `host`, `port`, `database`, `username`, `password`, `uri` and
    /// `REPORTS_SERVER_DATABASE_URL` [default: `<name>-analytics`]. Not the name of another
    /// Secret: the operator only uses one it wrote (label `reportsserver.io/secret: analytics`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub secret_name: Option<String>,
}

/// Monitoring of the servers by a Prometheus Operator.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct MonitoringSpec {
    /// A `monitoring.coreos.com/v1` ServiceMonitor for the servers' authorized `/metrics`.
    pub service_monitor: ServiceMonitorSpec,
}

/// The servers' ServiceMonitor.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct ServiceMonitorSpec {
    /// Create a ServiceMonitor `<name>` (HTTPS with the serving CA, a bearer token of the
    /// ServiceAccount `<name>-metrics-reader`, which may only `get /metrics`) [default: false].
    /// Only where the `monitoring.coreos.com` API exists; elsewhere the `Monitoring` condition
    /// says so and nothing else changes.
    pub enabled: bool,
    /// Scrape interval [default: `30s`].
    #[schemars(pattern(r"^([0-9]+(ms|s|m|h))+$"))]
    pub interval: String,
    /// Scrape timeout, at most the interval [default: `10s`].
    #[schemars(pattern(r"^([0-9]+(ms|s|m|h))+$"))]
    pub scrape_timeout: String,
    /// Extra labels of the ServiceMonitor, e.g. the `release` your Prometheus'
    /// `serviceMonitorSelector` matches [default: none].
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

impl Default for ServiceMonitorSpec {
    fn default() -> Self {
        ServiceMonitorSpec {
            enabled: false,
            interval: "30s".into(),
            scrape_timeout: "10s".into(),
            labels: BTreeMap::new(),
        }
    }
}

/// Migration of reports between etcd-backed CRDs and the server (docs/migration.md).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct MigrationSpec {
    /// A group whose APIService is still Local (served from CRDs, e.g. by a running Kyverno) is
    /// copied into the database, verified and then switched to the server, with no report lost
    /// (writes during the switch are refused for a few seconds and retried by their clients).
    /// Off: such a group is left alone unless `apiServices.takeOver` is set (which drops the
    /// reports in etcd from view).
    pub enabled: bool,
    /// Objects per second the copy writes at most; 0 for no limit.
    #[schemars(range(min = 0))]
    pub rate: i32,
    /// On deletion of the ReportsServer (and when a group is turned off), hand the groups back
    /// to CRD storage with every report written back first. Off: the APIServices are deleted
    /// and the reports stay only in the database.
    pub hand_back_on_delete: bool,
}

impl Default for MigrationSpec {
    fn default() -> Self {
        MigrationSpec {
            enabled: true,
            rate: 0,
            hand_back_on_delete: true,
        }
    }
}

/// Database choice. At most one of `sqlite` and `postgres` may be set; none means `sqlite`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct DatabaseSpec {
    /// Embedded SQLite on a PersistentVolumeClaim (one replica only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sqlite: Option<SqliteSpec>,
    /// PostgreSQL: `managed` (run by the operator) or `external` (a Secret reference).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub postgres: Option<PostgresSpec>,
}

/// Embedded SQLite.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct SqliteSpec {
    /// Size of the PersistentVolumeClaim holding the database file.
    pub storage_size: String,
    /// StorageClass of the claim. Empty means the cluster default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
}

impl Default for SqliteSpec {
    fn default() -> Self {
        SqliteSpec {
            storage_size: "1Gi".into(),
            storage_class_name: None,
        }
    }
}

/// PostgreSQL. Exactly one of `managed` and `external` must be set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct PostgresSpec {
    /// A PostgreSQL StatefulSet run by the operator, with a generated password Secret.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub managed: Option<ManagedPostgresSpec>,
    /// A PostgreSQL server run by someone else, reached with credentials from a Secret.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub external: Option<ExternalPostgresSpec>,
}

/// The operator's own PostgreSQL.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct ManagedPostgresSpec {
    /// PostgreSQL image.
    pub image: String,
    /// Size of the data PersistentVolumeClaim.
    pub storage_size: String,
    /// StorageClass of the claim. Empty means the cluster default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
    /// Resources of the PostgreSQL container.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

impl Default for ManagedPostgresSpec {
    fn default() -> Self {
        ManagedPostgresSpec {
            image: "docker.io/library/postgres:17".into(),
            storage_size: "8Gi".into(),
            storage_class_name: None,
            resources: None,
        }
    }
}

/// Credentials of an external PostgreSQL, read from a Secret in the ReportsServer's namespace.
/// Either `urlKey` names a key holding a full `postgres://` URL, or the host/port/database/
/// user/password keys are used.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct ExternalPostgresSpec {
    /// Name of the Secret.
    pub secret_name: String,
    /// Key holding a complete URL. When set, the other keys are ignored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url_key: Option<String>,
    /// Key holding the host name.
    pub host_key: String,
    /// Key holding the port (optional in the Secret; 5432 when absent).
    pub port_key: String,
    /// Key holding the database name.
    pub database_key: String,
    /// Key holding the user name.
    pub user_key: String,
    /// Key holding the password.
    pub password_key: String,
    /// libpq `sslmode`: `disable`, `prefer`, `require`, `verify-ca` or `verify-full`.
    #[schemars(extend("enum" = ["disable", "prefer", "require", "verify-ca", "verify-full"]))]
    pub ssl_mode: String,
    /// Secret holding the CA that signed the database server's certificate (for `verify-ca`
    /// and `verify-full`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_secret: Option<SecretKeyRef>,
}

impl Default for ExternalPostgresSpec {
    fn default() -> Self {
        ExternalPostgresSpec {
            secret_name: String::new(),
            url_key: None,
            host_key: "host".into(),
            port_key: "port".into(),
            database_key: "database".into(),
            user_key: "username".into(),
            password_key: "password".into(),
            ssl_mode: "prefer".into(),
            ca_secret: None,
        }
    }
}

/// A key of a Secret in the ReportsServer's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret.
    pub name: String,
    /// Key in the Secret. Empty means `ca.crt`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub key: String,
}

/// The three served API groups; each is served and gets its APIService unless turned off.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct GroupsSpec {
    /// `wgpolicyk8s.io/v1alpha2`: PolicyReport, ClusterPolicyReport.
    pub wgpolicyk8s: bool,
    /// `reports.kyverno.io/v1`: EphemeralReport, ClusterEphemeralReport.
    pub kyverno: bool,
    /// `openreports.io/v1alpha1`: Report, ClusterReport.
    pub openreports: bool,
}

impl Default for GroupsSpec {
    fn default() -> Self {
        GroupsSpec {
            wgpolicyk8s: true,
            kyverno: true,
            openreports: true,
        }
    }
}

/// Aggregation settings, mapped one to one on `serve` flags.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct AggregationSpec {
    /// `--aggregation`.
    pub enabled: bool,
    /// `--aggregation-delay` (`30s`, `500ms`, `2m`).
    #[schemars(pattern(r"^[0-9]+(\.[0-9]+)?(ms|s|m)?$"))]
    pub delay: String,
    /// `--aggregation-layout`: `per-resource` or `per-policy`.
    #[schemars(extend("enum" = ["per-resource", "per-policy"]))]
    pub layout: String,
    /// `--chunk-size` (results per report in the per-policy layout).
    #[schemars(range(min = 1))]
    pub chunk_size: i32,
    /// `--aggregation-workers`.
    #[schemars(range(min = 1))]
    pub workers: i32,
}

impl Default for AggregationSpec {
    fn default() -> Self {
        AggregationSpec {
            enabled: true,
            delay: "30s".into(),
            layout: "per-resource".into(),
            chunk_size: 1000,
            workers: 4,
        }
    }
}

/// TLS of the server.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct TlsSpec {
    /// A Secret of type `kubernetes.io/tls` with `tls.crt`, `tls.key` and `ca.crt` (for example
    /// one cert-manager writes). Empty means the operator generates a CA and a serving
    /// certificate, injects the CA into the APIServices and renews the certificate before it
    /// expires (the CA stays, so no request fails during renewal).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret_name: Option<String>,
}

/// APIService settings.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct ApiServicesSpec {
    /// Take over APIServices that exist and are not ours (for example the automanaged ones
    /// kube-apiserver creates for report CRDs). Off by default: such a group is reported in
    /// status and left alone.
    pub take_over: bool,
    /// `groupPriorityMinimum` of the APIServices (1000, as CRD-backed groups get).
    #[schemars(range(min = 1, max = 20000))]
    pub group_priority_minimum: i32,
    /// `versionPriority` of the APIServices.
    #[schemars(range(min = 1, max = 1000))]
    pub version_priority: i32,
}

impl Default for ApiServicesSpec {
    fn default() -> Self {
        ApiServicesSpec {
            take_over: false,
            group_priority_minimum: 1000,
            version_priority: 100,
        }
    }
}

/// A server outside the cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalSpec {
    /// DNS name the ExternalName Service resolves to (e.g. `localhost` or `reports.example.com`).
    pub host: String,
    /// Port the server listens on.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// PEM of the CA that signed the server's certificate (goes into `caBundle`). The
    /// certificate must name `<service>.<namespace>.svc`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle: Option<String>,
    /// Or a Secret key holding that PEM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret: Option<SecretKeyRef>,
    /// Name of the ExternalName Service. Empty means the ReportsServer's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
}

impl Default for ReportsServerSpec {
    fn default() -> Self {
        ReportsServerSpec {
            database: DatabaseSpec::default(),
            replicas: 1,
            image: None,
            image_pull_policy: None,
            resources: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            affinity: None,
            topology_spread_constraints: Vec::new(),
            image_pull_secrets: Vec::new(),
            priority_class_name: None,
            cluster_id: None,
            extra_args: Vec::new(),
            extra_env: Vec::new(),
            groups: GroupsSpec::default(),
            aggregation: AggregationSpec::default(),
            tls: TlsSpec::default(),
            api_services: ApiServicesSpec::default(),
            external: None,
            migration: MigrationSpec::default(),
            analytics: AnalyticsSpec::default(),
            monitoring: MonitoringSpec::default(),
        }
    }
}

/// Observed state.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct ReportsServerStatus {
    /// The `metadata.generation` this status describes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Reconciling`, `Stalled`, `Degraded`, `DatabaseAvailable`, and while their
    /// options are on `AnalyticsAccess` and `Monitoring`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The database in use.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub database: Option<DatabaseStatus>,
    /// Ready server pods (the external server counts as 1 when all its groups are Available).
    pub ready_replicas: i32,
    /// One entry per enabled group.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<GroupStatus>,
    /// Expiry (RFC 3339) of the generated serving certificate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub certificate_not_after: Option<String>,
    /// Migration of etcd-backed reports (filled by the migration controller).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub migration: Option<MigrationStatus>,
}

/// The database in use.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct DatabaseStatus {
    /// `sqlite`, `postgres-managed`, `postgres-external` or `external`.
    #[serde(rename = "type")]
    pub type_: String,
    /// Whether the database is usable as far as the operator can tell.
    pub ready: bool,
    /// Why not.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// Serving state of one group.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct GroupStatus {
    /// APIService name, e.g. `v1alpha2.wgpolicyk8s.io`.
    pub api_service: String,
    /// Whether kube-apiserver reports the APIService Available.
    pub available: bool,
    /// The APIService's Available reason, or why the operator does not manage it.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// The matching message.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The APIService existed, was not ours, and was taken over (`apiServices.takeOver`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub taken_over: bool,
}

/// Progress of a migration of etcd-backed reports, as the server's migration worker reports
/// it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct MigrationStatus {
    /// `Complete`, `Copying`, `Fencing`, `Verifying`, `Switching`, `HandingBack`,
    /// `WritingBack` or `Failed` (retried).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub phase: String,
    /// Reports copied (or written back) so far, all kinds.
    pub copied: i64,
    /// Reports to copy (or write back), all kinds.
    pub total: i64,
    /// Per kind.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kinds: Vec<KindMigrationStatus>,
    /// Why the last step failed (it is retried).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// `Copied`, `Verified`, `Switched` while moving into the database; `HandedBack` while
    /// handing back. `lastTransitionTime` moves only when a status flips.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Figures of the last finished step: objects per second, seconds writes were refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_run: Option<MigrationRunStatus>,
}

/// Progress of one kind.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct KindMigrationStatus {
    /// `PolicyReport`, `EphemeralReport`, `Report` … (one entry per kind of a migrated group).
    pub kind: String,
    /// Objects in the source when it was listed.
    pub total: i64,
    /// Objects copied (or written back).
    pub copied: i64,
    /// Changes mirrored from the source after its list.
    pub mirrored: i64,
    /// Objects fixed by the final sync behind the fence.
    pub synced: i64,
}

/// Figures of a finished migration step.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct MigrationRunStatus {
    /// Objects copied per second (string: a decimal).
    pub objects_per_second: String,
    /// Seconds writes to the report groups were refused.
    pub fence_seconds: String,
    /// Seconds from the first APIService patch to the routing confirmed.
    pub switch_seconds: String,
}

impl ReportsServerSpec {
    /// The APIServices the spec asks for, as (version, group).
    pub fn enabled_groups(&self) -> Vec<(&'static str, &'static str)> {
        let mut out = Vec::new();
        if self.groups.wgpolicyk8s {
            out.push(("v1alpha2", "wgpolicyk8s.io"));
        }
        if self.groups.kyverno {
            out.push(("v1", "reports.kyverno.io"));
        }
        if self.groups.openreports {
            out.push(("v1alpha1", "openreports.io"));
        }
        out
    }
}

/// The ReportsServer CRD as YAML (one document, with a leading `---`).
pub fn crd_yaml() -> String {
    use kube::CustomResourceExt;
    format!(
        "---\n{}",
        serde_yaml::to_string(&ReportsServer::crd()).expect("the CRD serializes to YAML")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_spec_is_single_replica_sqlite_with_all_groups() {
        let spec: ReportsServerSpec = serde_json::from_str("{}").unwrap();
        assert_eq!(spec, ReportsServerSpec::default());
        assert_eq!(spec.replicas, 1);
        assert!(spec.database.sqlite.is_none() && spec.database.postgres.is_none());
        assert_eq!(spec.enabled_groups().len(), 3);
        assert!(spec.aggregation.enabled);
    }

    #[test]
    fn partial_sub_objects_keep_their_defaults() {
        let spec: ReportsServerSpec = serde_json::from_value(serde_json::json!({
            "groups": {"kyverno": false},
            "database": {"postgres": {"external": {"secretName": "db"}}},
        }))
        .unwrap();
        assert_eq!(
            spec.enabled_groups(),
            vec![
                ("v1alpha2", "wgpolicyk8s.io"),
                ("v1alpha1", "openreports.io")
            ]
        );
        let ext = spec.database.postgres.unwrap().external.unwrap();
        assert_eq!(ext.password_key, "password");
        assert_eq!(ext.ssl_mode, "prefer");
    }

    #[test]
    fn crd_has_names_scope_status_and_columns() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(ReportsServer::crd()).unwrap();
        assert_eq!(crd["metadata"]["name"], "reportsservers.reportsserver.io");
        assert_eq!(crd["spec"]["scope"], "Namespaced");
        assert_eq!(crd["spec"]["names"]["shortNames"][0], "rsrv");
        let v = &crd["spec"]["versions"][0];
        assert!(v["subresources"]["status"].is_object());
        let cols: Vec<&str> = v["additionalPrinterColumns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(cols, ["Ready", "Reason", "Database", "Replicas", "Age"]);
    }

    /// Every property of our own types explains itself in `kubectl explain`; embedded
    /// Kubernetes types (their descriptions are upstream's) are checked as far as they go.
    #[test]
    fn every_field_has_a_description() {
        use kube::CustomResourceExt;
        fn walk(schema: &serde_json::Value, path: &str, missing: &mut Vec<String>) {
            let props = schema["properties"]
                .as_object()
                .or_else(|| schema["items"]["properties"].as_object());
            for (name, prop) in props.into_iter().flatten() {
                let here = format!("{path}.{name}");
                if prop["description"].as_str().is_none_or(str::is_empty) {
                    missing.push(here.clone());
                }
                walk(prop, &here, missing);
            }
        }
        let crd = serde_json::to_value(ReportsServer::crd()).unwrap();
        let root = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"];
        let mut missing = Vec::new();
        walk(&root["spec"], "spec", &mut missing);
        walk(&root["status"], "status", &mut missing);
        assert!(
            missing.is_empty(),
            "fields without a description: {missing:?}"
        );
    }

    /// The rules kube-apiserver evaluates at apply time (e2e_operator applies objects that break
    /// each one); here: each has a message and points at the field it is about.
    #[test]
    fn crd_carries_cel_rules_with_messages() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(ReportsServer::crd()).unwrap();
        let rules =
            crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
                .as_array()
                .expect("root rules")
                .clone();
        assert_eq!(rules.len(), 6, "{rules:#?}");
        assert!(
            rules
                .iter()
                .any(|r| r["rule"] == "!has(self.spec.clusterId) || self.spec.clusterId != 'all'"),
            "{rules:#?}"
        );
        for r in &rules {
            assert!(r["message"].as_str().is_some_and(|m| !m.is_empty()), "{r}");
            assert!(
                r["fieldPath"]
                    .as_str()
                    .is_some_and(|p| p.starts_with(".spec")),
                "{r}"
            );
        }
    }
}
