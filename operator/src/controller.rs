//! The reconciler: kube-runtime `Controller` on ReportsServer, owning what it creates.
//!
//! One reconcile is: validate the spec → look up the facts the pure builders need (database
//! Secret keys, TLS material, APIServices owned by someone else) → server-side apply every
//! desired object with one field manager → read back what kube-apiserver says (APIService
//! `Available`, ready pods) → write status only when it changed. Decisions that need a user
//! (invalid spec, missing Secret key, an APIService owned by someone else) end in
//! `Degraded`/`Stalled` with a message naming the object and field, an Event, and a slow
//! requeue; a fix is picked up by that requeue without restarting anything.
//!
//! Deletion runs through a finalizer: the APIServices go first (so no group is left routed to a
//! Service that is about to disappear), then the cluster-scoped RBAC and the RoleBinding in
//! kube-system; namespaced objects follow through their ownerReferences (garbage collector).
//! The migration/rollback work of the zero-loss migration issue hooks into the same cleanup.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use reports_server_crds::reportsserver::{
    DatabaseStatus, GroupStatus, ReportsServer, ReportsServerStatus,
};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::database_check::{self, Observation};
use crate::desired::{self, Database, Inputs, Tls};
use crate::http::Metrics;
use crate::status::{self, Outcome};
use crate::{FIELD_MANAGER, FINALIZER, MANAGED_BY, OWNER_ANNOTATION, tls};
use reports_server_crds::catalog::GROUP_VERSIONS;
use reports_server_migration::mailbox::Report;

/// Errors of one reconcile; all are retried by [`error_policy`] with backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    #[error("TLS: {0}")]
    Tls(#[from] tls::TlsError),
    #[error("{0} has no namespace")]
    NoNamespace(String),
    /// Not a failure: deletion waits for the server to hand the report groups back.
    #[error("waiting: {0}")]
    HandBackPending(String),
}

impl Error {
    /// Whether this is the hand-back wait (requeued at the progress interval, no backoff).
    fn is_hand_back_pending(&self) -> bool {
        match self {
            Error::HandBackPending(_) => true,
            Error::Finalizer(e) => matches!(
                &**e,
                kube::runtime::finalizer::Error::CleanupFailed(Error::HandBackPending(_))
            ),
            _ => false,
        }
    }
}

/// Operator settings (the binary maps flags and environment onto it).
#[derive(Clone, Debug)]
pub struct OperatorConfig {
    /// Image of the server when a ReportsServer names none.
    pub default_image: String,
    /// Watch ReportsServers in this namespace only; `None` watches all.
    pub watch_namespace: Option<String>,
    /// Requeue while converging.
    pub progress_requeue: Duration,
    /// Requeue while degraded (how soon a fixed Secret is noticed).
    pub degraded_requeue: Duration,
    /// Requeue when ready (certificate renewal checks, drift repair).
    pub ready_requeue: Duration,
    /// Longest backoff after errors.
    pub max_backoff: Duration,
    /// How often every server is asked whether it reaches its database (`DatabaseAvailable`).
    pub database_check_interval: Duration,
    /// Events' reporting instance (the pod name).
    pub instance: Option<String>,
}

impl Default for OperatorConfig {
    fn default() -> Self {
        OperatorConfig {
            default_image: crate::DEFAULT_IMAGE.into(),
            watch_namespace: None,
            progress_requeue: Duration::from_secs(3),
            degraded_requeue: Duration::from_secs(15),
            ready_requeue: Duration::from_secs(300),
            max_backoff: Duration::from_secs(300),
            database_check_interval: Duration::from_secs(10),
            instance: None,
        }
    }
}

/// Shared state of the reconciler.
pub struct Context {
    pub client: Client,
    pub config: OperatorConfig,
    pub metrics: Metrics,
    recorder: Recorder,
    failures: Mutex<HashMap<ObjectRef<ReportsServer>, u32>>,
    /// What each installation's servers last said of their database (`database_check`).
    databases: Mutex<HashMap<ObjectRef<ReportsServer>, Observation>>,
}

impl Context {
    pub fn new(client: Client, config: OperatorConfig, metrics: Metrics) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance: config.instance.clone(),
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            config,
            metrics,
            failures: Mutex::new(HashMap::new()),
            databases: Mutex::new(HashMap::new()),
        }
    }

    /// Keeps what an installation's servers said of their database.
    pub(crate) fn record_database(&self, key: ObjectRef<ReportsServer>, seen: Observation) {
        self.databases
            .lock()
            .expect("not poisoned")
            .insert(key, seen);
    }

    /// What an installation's servers last said of their database.
    fn database_of(&self, key: &ObjectRef<ReportsServer>) -> Observation {
        self.databases
            .lock()
            .expect("not poisoned")
            .get(key)
            .cloned()
            .unwrap_or_else(Observation::not_checked_yet)
    }

    async fn event(&self, rs: &ReportsServer, type_: EventType, reason: &str, note: String) {
        let ev = KubeEvent {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &rs.object_ref(&())).await {
            tracing::warn!(error = %e, reason, "could not publish an Event");
        }
    }
}

/// The API resource of a desired object's `apiVersion`/`kind`.
fn api_resource(obj: &Value) -> ApiResource {
    let api_version = obj["apiVersion"].as_str().unwrap_or_default();
    let kind = obj["kind"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let plural = match kind {
        "Service" => "services",
        "ServiceAccount" => "serviceaccounts",
        "Secret" => "secrets",
        "ConfigMap" => "configmaps",
        "Deployment" => "deployments",
        "StatefulSet" => "statefulsets",
        "PodDisruptionBudget" => "poddisruptionbudgets",
        "ClusterRole" => "clusterroles",
        "ClusterRoleBinding" => "clusterrolebindings",
        "RoleBinding" => "rolebindings",
        "APIService" => "apiservices",
        other => panic!("desired objects never have kind {other}"),
    };
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

fn dynamic_api(client: &Client, obj: &Value) -> Api<DynamicObject> {
    let ar = api_resource(obj);
    match obj["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    }
}

/// Server-side apply with the operator's field manager, taking fields over from others.
async fn apply(client: &Client, obj: &Value) -> Result<DynamicObject, kube::Error> {
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    dynamic_api(client, obj)
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(obj),
        )
        .await
}

fn owner_key(rs: &ReportsServer) -> String {
    format!("{}/{}", rs.namespace().unwrap_or_default(), rs.name_any())
}

fn is_ours<K: Resource>(obj: &K, rs: &ReportsServer) -> bool {
    obj.meta()
        .annotations
        .as_ref()
        .and_then(|a| a.get(OWNER_ANNOTATION))
        .is_some_and(|o| *o == owner_key(rs))
}

async fn get_opt<K>(api: &Api<K>, name: &str) -> Result<Option<K>, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.get_opt(name).await
}

fn secret_str(secret: &Secret, key: &str) -> Option<String> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(key).cloned())
        })
}

/// Checks a key of a Secret: `Err(outcome)` names the Secret, the key and the spec field.
async fn secret_key(
    secrets: &Api<Secret>,
    ns: &str,
    name: &str,
    key: &str,
    field: &str,
) -> Result<Result<String, Outcome>, kube::Error> {
    Ok(match get_opt(secrets, name).await? {
        None => Err(Outcome::degraded(
            "DatabaseSecretMissing",
            format!("Secret {ns}/{name} (from {field}) does not exist"),
        )),
        Some(s) => match secret_str(&s, key) {
            Some(v) if !v.is_empty() => Ok(v),
            _ => Err(Outcome::degraded(
                "DatabaseSecretKeyMissing",
                format!("Secret {ns}/{name} has no key {key:?} (from {field})"),
            )),
        },
    })
}

/// Verifies the external PostgreSQL Secret has every key the spec names.
async fn check_external_postgres(
    ctx: &Context,
    ns: &str,
    e: &reports_server_crds::reportsserver::ExternalPostgresSpec,
) -> Result<Option<Outcome>, kube::Error> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let base = "spec.database.postgres.external";
    let mut keys: Vec<(&str, String)> = Vec::new();
    if let Some(url) = &e.url_key {
        keys.push((url, format!("{base}.urlKey")));
    } else {
        keys.push((&e.host_key, format!("{base}.hostKey")));
        keys.push((&e.database_key, format!("{base}.databaseKey")));
        keys.push((&e.user_key, format!("{base}.userKey")));
        keys.push((&e.password_key, format!("{base}.passwordKey")));
    }
    for (key, field) in keys {
        if let Err(outcome) = secret_key(&secrets, ns, &e.secret_name, key, &field).await? {
            return Ok(Some(outcome));
        }
    }
    if let Some(ca) = &e.ca_secret {
        let key = if ca.key.is_empty() { "ca.crt" } else { &ca.key };
        if let Err(o) = secret_key(&secrets, ns, &ca.name, key, &format!("{base}.caSecret")).await?
        {
            return Ok(Some(o));
        }
    }
    Ok(None)
}

/// The managed PostgreSQL's password Secret: created once with a random password, never
/// rewritten (server-side apply would replace the password on every reconcile).
async fn ensure_postgres_password(ctx: &Context, rs: &ReportsServer) -> Result<(), kube::Error> {
    use rand::distr::{Alphanumeric, SampleString};
    let ns = rs.namespace().unwrap_or_default();
    let name = desired::postgres_name(rs);
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    if get_opt(&secrets, &name).await?.is_some() {
        return Ok(());
    }
    let password = Alphanumeric.sample_string(&mut rand::rng(), 32);
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {
            "name": name, "namespace": ns, "labels": desired::labels(rs),
            "ownerReferences": [owner_reference(rs)],
        },
        "stringData": {"password": password},
    }))
    .expect("a valid Secret");
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            ctx.event(
                rs,
                EventType::Normal,
                "DatabasePasswordCreated",
                format!("created Secret {ns}/{name} with a generated PostgreSQL password"),
            )
            .await;
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

fn owner_reference(rs: &ReportsServer) -> Value {
    json!({
        "apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
        "name": rs.name_any(), "uid": rs.metadata.uid.clone().unwrap_or_default(),
        "controller": true, "blockOwnerDeletion": true,
    })
}

/// TLS of an in-cluster installation: the user's Secret, or the generated CA and a serving
/// certificate renewed before expiry. Returns the TLS for the builders and the expiry.
async fn ensure_tls(
    ctx: &Context,
    rs: &ReportsServer,
) -> Result<Result<(Tls, Option<String>), Outcome>, Error> {
    let ns = rs.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    if let Some(name) = &rs.spec.tls.secret_name {
        let Some(secret) = get_opt(&secrets, name).await? else {
            return Ok(Err(Outcome::degraded(
                "TLSSecretMissing",
                format!("Secret {ns}/{name} (from spec.tls.secretName) does not exist"),
            )));
        };
        for key in ["tls.crt", "tls.key", "ca.crt"] {
            if secret_str(&secret, key).is_none_or(|v| v.is_empty()) {
                return Ok(Err(Outcome::degraded(
                    "TLSSecretKeyMissing",
                    format!("Secret {ns}/{name} has no key {key:?} (from spec.tls.secretName)"),
                )));
            }
        }
        let ca_pem = secret_str(&secret, "ca.crt").unwrap_or_default();
        let not_after = secret_str(&secret, "tls.crt")
            .and_then(|c| tls::inspect(&c).ok())
            .map(|(t, _)| rfc3339(t));
        return Ok(Ok((
            Tls {
                secret_name: name.clone(),
                ca_pem,
            },
            not_after,
        )));
    }
    let meta = |name: String| json!({"name": name, "namespace": ns, "labels": desired::labels(rs), "ownerReferences": [owner_reference(rs)]});
    let ca_name = desired::ca_secret_name(rs);
    let ca = match get_opt(&secrets, &ca_name).await?.and_then(|s| {
        Some(tls::Pair {
            cert_pem: secret_str(&s, "ca.crt")?,
            key_pem: secret_str(&s, "ca.key")?,
        })
    }) {
        Some(ca) => ca,
        None => {
            let ca = tls::new_ca(&format!("reports-server {ns}/{}", rs.name_any()))?;
            apply(
                &ctx.client,
                &json!({
                    "apiVersion": "v1", "kind": "Secret", "metadata": meta(ca_name.clone()),
                    "type": "Opaque",
                    "stringData": {"ca.crt": ca.cert_pem, "ca.key": ca.key_pem},
                }),
            )
            .await?;
            ctx.event(
                rs,
                EventType::Normal,
                "CACreated",
                format!("generated a CA in Secret {ns}/{ca_name}"),
            )
            .await;
            ca
        }
    };
    let tls_name = desired::tls_secret_name(rs);
    let names = tls::serving_names(&desired::service_name(rs), &ns);
    let now = chrono::Utc::now().timestamp();
    let current = get_opt(&secrets, &tls_name).await?;
    let cert = current
        .as_ref()
        .and_then(|s| secret_str(s, "tls.crt"))
        .filter(|c| {
            secret_str(current.as_ref().unwrap(), "ca.crt").as_deref() == Some(&ca.cert_pem)
                && !tls::needs_renewal(c, &names, now)
        });
    let cert = match cert {
        Some(c) => c,
        None => {
            let pair = tls::new_serving(&ca, &names)?;
            apply(
                &ctx.client,
                &json!({
                    "apiVersion": "v1", "kind": "Secret", "metadata": meta(tls_name.clone()),
                    "type": "kubernetes.io/tls",
                    "stringData": {"tls.crt": pair.cert_pem, "tls.key": pair.key_pem, "ca.crt": ca.cert_pem},
                }),
            )
            .await?;
            ctx.event(
                rs,
                EventType::Normal,
                if current.is_some() {
                    "CertificateRenewed"
                } else {
                    "CertificateIssued"
                },
                format!(
                    "serving certificate for {} in Secret {ns}/{tls_name}",
                    names[0]
                ),
            )
            .await;
            pair.cert_pem
        }
    };
    let not_after = tls::inspect(&cert).ok().map(|(t, _)| rfc3339(t));
    Ok(Ok((
        Tls {
            secret_name: tls_name,
            ca_pem: ca.cert_pem,
        },
        not_after,
    )))
}

fn rfc3339(secs: i64) -> String {
    chrono::DateTime::from_timestamp(secs, 0)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_default()
}

/// The external server's CA PEM from `spec.external`.
async fn external_ca(ctx: &Context, rs: &ReportsServer) -> Result<Result<String, Outcome>, Error> {
    let ext = rs.spec.external.clone().unwrap_or_default();
    if let Some(pem) = ext.ca_bundle.filter(|p| !p.is_empty()) {
        return Ok(Ok(pem));
    }
    let ns = rs.namespace().unwrap_or_default();
    let Some(ca) = ext.ca_secret else {
        return Ok(Err(Outcome::degraded(
            "InvalidSpec",
            "spec.external needs caBundle or caSecret: the APIServices must verify the server \
             (insecureSkipTLSVerify is never used)",
        )));
    };
    let key = if ca.key.is_empty() {
        "ca.crt".to_string()
    } else {
        ca.key.clone()
    };
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    Ok(
        secret_key(&secrets, &ns, &ca.name, &key, "spec.external.caSecret")
            .await?
            .map_err(|o| match o {
                Outcome::Degraded { message, .. } => Outcome::degraded("CASecretMissing", message),
                other => other,
            }),
    )
}

/// Status of an APIService's `Available` condition: (available, reason, message).
fn available(api: &APIService) -> (bool, String, String) {
    api.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Available"))
        .map(|c| {
            (
                c.status == "True",
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default(),
            )
        })
        .unwrap_or((false, "Pending".into(), "no Available condition yet".into()))
}

fn describe_target(api: &APIService) -> String {
    match api.spec.as_ref().and_then(|s| s.service.as_ref()) {
        Some(svc) => format!(
            "Service {}/{}",
            svc.namespace.clone().unwrap_or_default(),
            svc.name.clone().unwrap_or_default()
        ),
        None => "Local (CRD storage)".into(),
    }
}

/// Reconciles one ReportsServer (wrapped in the finalizer).
pub async fn reconcile(rs: Arc<ReportsServer>, ctx: Arc<Context>) -> Result<Action, Error> {
    let span = tracing::info_span!("reconcile", namespace = rs.namespace().unwrap_or_default(), name = %rs.name_any());
    reconcile_in(rs, ctx).instrument(span).await
}

async fn reconcile_in(rs: Arc<ReportsServer>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let ns = rs
        .namespace()
        .ok_or_else(|| Error::NoNamespace(rs.name_any()))?;
    let api: Api<ReportsServer> = Api::namespaced(ctx.client.clone(), &ns);
    let key = ObjectRef::from_obj(&*rs);
    let result = finalizer(&api, FINALIZER, rs, |event| async {
        match event {
            Finalizer::Apply(rs) => apply_installation(&rs, &ctx).await,
            Finalizer::Cleanup(rs) => cleanup(&rs, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)));
    let waiting = result.as_ref().is_err_and(Error::is_hand_back_pending);
    ctx.metrics
        .observe(started.elapsed(), result.is_ok() || waiting);
    if result.is_ok() {
        ctx.failures.lock().expect("not poisoned").remove(&key);
    }
    result
}

/// Backoff after a failed reconcile: 1 s, 2 s, 4 s, ... up to `max_backoff`.
pub fn error_policy(rs: Arc<ReportsServer>, error: &Error, ctx: Arc<Context>) -> Action {
    if error.is_hand_back_pending() {
        tracing::info!(name = %rs.name_any(), "{error}");
        return Action::requeue(ctx.config.progress_requeue);
    }
    let key = ObjectRef::from_obj(&*rs);
    let n = {
        let mut f = ctx.failures.lock().expect("not poisoned");
        let n = f.entry(key).or_insert(0);
        *n += 1;
        *n
    };
    let delay = Duration::from_secs(1u64 << n.min(16)).min(ctx.config.max_backoff);
    tracing::warn!(name = %rs.name_any(), error = %error, attempt = n, ?delay, "reconcile failed");
    Action::requeue(delay)
}

async fn apply_installation(rs: &ReportsServer, ctx: &Context) -> Result<Action, Error> {
    let previous = rs.status.clone().unwrap_or_default();
    let mut status = ReportsServerStatus {
        observed_generation: rs.metadata.generation,
        migration: previous.migration.clone(),
        ..Default::default()
    };
    let outcome = converge(rs, ctx, &previous, &mut status).await?;
    if status.groups.is_empty() {
        status.groups = previous.groups.clone();
    }
    publish_status(rs, ctx, &previous, status, &outcome).await?;
    Ok(match outcome {
        Outcome::Ready => Action::requeue(ctx.config.ready_requeue),
        Outcome::Progressing { .. } => Action::requeue(ctx.config.progress_requeue),
        Outcome::Degraded { .. } => Action::requeue(ctx.config.degraded_requeue),
    })
}

/// Applies everything the spec asks for, filling `status` with what is observed on the way;
/// returns what the reconcile concluded. A problem the user must fix ends it early.
async fn converge(
    rs: &ReportsServer,
    ctx: &Context,
    previous: &ReportsServerStatus,
    status: &mut ReportsServerStatus,
) -> Result<Outcome, Error> {
    let database = match prepare_database(rs, ctx, status).await? {
        Ok(database) => database,
        Err(outcome) => return Ok(outcome),
    };
    let (tls, external_ca_pem) = match prepare_tls(rs, ctx, &database, status).await? {
        Ok(tls) => tls,
        Err(outcome) => return Ok(outcome),
    };
    let apiservices: Api<APIService> = Api::all(ctx.client.clone());
    // Read once: both the hand-back of turned-off groups and status.migration use it.
    let worker = if rs.spec.migration.enabled {
        worker_report(ctx, rs).await?
    } else {
        None
    };
    let mut groups = claim_api_services(rs, ctx, previous, &apiservices).await?;
    let inputs = Inputs {
        rs,
        database: database.clone(),
        tls,
        external_ca_pem,
        default_image: &ctx.config.default_image,
        foreign_api_services: groups
            .foreign
            .iter()
            .chain(&groups.migrating)
            .cloned()
            .collect(),
    };
    let want = desired::desired(&inputs);
    let workload = apply_workload(rs, ctx, &want, &database).await?;
    apply_api_services(ctx, &want, &mut groups.statuses).await?;
    remove_turned_off(
        rs,
        ctx,
        &apiservices,
        worker.is_some(),
        &mut groups.migrating,
    )
    .await?;
    if rs.spec.migration.enabled {
        let wanted: Vec<String> = rs
            .spec
            .enabled_groups()
            .into_iter()
            .map(|(_, g)| g.to_string())
            .collect();
        status.migration =
            migration_status(rs, worker.as_ref(), previous.migration.as_ref(), &wanted);
    }
    let all_available = groups
        .statuses
        .iter()
        .filter(|g| !groups.migrating.contains(&g.api_service))
        .all(|g| g.available);
    status.ready_replicas = if database == Database::External && all_available {
        1
    } else {
        workload.ready_replicas
    };
    if let Some(db) = &mut status.database {
        db.ready = workload.ready;
    }
    status.groups = groups.statuses;
    Ok(outcome_of(
        rs,
        status,
        &groups.foreign,
        &groups.migrating,
        worker.as_ref(),
        workload.ready,
    ))
}

/// The database the spec names, checked as far as the operator can (the external Secret, the
/// managed database's password); `Err` with the outcome when the user must fix something.
async fn prepare_database(
    rs: &ReportsServer,
    ctx: &Context,
    status: &mut ReportsServerStatus,
) -> Result<Result<Database, Outcome>, Error> {
    let database = match desired::database_of(&rs.spec) {
        Ok(db) => db,
        Err(invalid) => return Ok(Err(Outcome::degraded(invalid.reason, invalid.message))),
    };
    status.database = Some(DatabaseStatus {
        type_: database.type_name().into(),
        ready: false,
        message: String::new(),
    });
    let problem = match &database {
        Database::ExternalPostgres(e) => {
            let ns = rs.namespace().unwrap_or_default();
            check_external_postgres(ctx, &ns, e).await?
        }
        Database::ManagedPostgres(_) => {
            ensure_postgres_password(ctx, rs).await?;
            None
        }
        _ => None,
    };
    Ok(match problem {
        Some(problem) => {
            if let (Some(db), Outcome::Degraded { message, .. }) = (&mut status.database, &problem)
            {
                db.message = message.clone();
            }
            Err(problem)
        }
        None => Ok(database),
    })
}

/// The serving certificate the operator issues (recording its expiry), or the external
/// server's CA.
async fn prepare_tls(
    rs: &ReportsServer,
    ctx: &Context,
    database: &Database,
    status: &mut ReportsServerStatus,
) -> Result<Result<(Option<Tls>, Option<String>), Outcome>, Error> {
    if *database == Database::External {
        return Ok(external_ca(ctx, rs).await?.map(|pem| (None, Some(pem))));
    }
    Ok(ensure_tls(ctx, rs).await?.map(|(tls, not_after)| {
        status.certificate_not_after = not_after;
        (Some(tls), None)
    }))
}

/// The enabled groups' APIServices as found before applying ours.
struct ClaimedGroups {
    statuses: Vec<GroupStatus>,
    /// Not ours and not to be taken over: left alone, and the installation is Degraded.
    foreign: Vec<String>,
    /// Local (CRD storage) while the server's migration worker moves their reports.
    migrating: Vec<String>,
}

/// Decides, for each enabled group's existing APIService that is not ours, whether it becomes
/// ours (switched by the migration worker, or `apiServices.takeOver`), waits for the migration,
/// or is someone else's.
async fn claim_api_services(
    rs: &ReportsServer,
    ctx: &Context,
    previous: &ReportsServerStatus,
    apiservices: &Api<APIService>,
) -> Result<ClaimedGroups, Error> {
    let mut claimed = ClaimedGroups {
        statuses: Vec::new(),
        foreign: Vec::new(),
        migrating: Vec::new(),
    };
    for (version, group) in rs.spec.enabled_groups() {
        let name = format!("{version}.{group}");
        let mut gs = GroupStatus {
            api_service: name.clone(),
            taken_over: previous
                .groups
                .iter()
                .any(|g| g.api_service == name && g.taken_over),
            ..Default::default()
        };
        if let Some(existing) = get_opt(apiservices, &name).await?
            && !is_ours(&existing, rs)
        {
            let target = describe_target(&existing);
            if rs.spec.migration.enabled && routes_to_us(&existing, rs) {
                // Switched by the server's migration worker: ours from now on.
                ctx.event(
                    rs,
                    EventType::Normal,
                    "APIServiceMigrated",
                    format!("APIService {name} was switched to the server after its reports were moved into the database"),
                )
                .await;
            } else if rs.spec.migration.enabled && target.starts_with("Local") {
                // Left alone until the server's migration worker has moved the reports and
                // switched it (then it routes to us and is adopted above).
                gs.reason = "Migrating".into();
                gs.message = format!(
                    "reports of {group} in CRD storage are being moved into the database; the server switches APIService {name} when they are"
                );
                claimed.migrating.push(name.clone());
            } else if rs.spec.api_services.take_over {
                gs.taken_over = true;
                let note = format!("took over APIService {name} (was routed to {target})");
                ctx.event(rs, EventType::Normal, "APIServiceTakenOver", note)
                    .await;
            } else {
                gs.reason = "OwnedByOther".into();
                gs.message = format!(
                    "APIService {name} exists and is not managed by this ReportsServer (routed to {target}); set spec.apiServices.takeOver: true to take it over"
                );
                claimed.foreign.push(name.clone());
            }
        }
        claimed.statuses.push(gs);
    }
    Ok(claimed)
}

/// What the server's workload reports after it is applied.
struct Workload {
    ready: bool,
    ready_replicas: i32,
}

/// Applies every desired object but the APIServices; reads the server workload's readiness
/// from what the API server answered.
async fn apply_workload(
    rs: &ReportsServer,
    ctx: &Context,
    want: &desired::Desired,
    database: &Database,
) -> Result<Workload, Error> {
    let mut workload = Workload {
        ready: *database == Database::External,
        ready_replicas: 0,
    };
    for obj in want.owned.iter().chain(want.unowned.iter()) {
        let applied = apply(&ctx.client, obj).await?;
        let kind = obj["kind"].as_str().unwrap_or_default();
        if (kind == "Deployment" || kind == "StatefulSet")
            && obj["metadata"]["name"] == json!(rs.name_any())
        {
            let st = &applied.data["status"];
            workload.ready_replicas = st["readyReplicas"].as_i64().unwrap_or(0) as i32;
            let updated = st["updatedReplicas"].as_i64().unwrap_or(0);
            let want_replicas = obj["spec"]["replicas"].as_i64().unwrap_or(1);
            workload.ready = st["observedGeneration"]
                == applied
                    .metadata
                    .generation
                    .map(Value::from)
                    .unwrap_or_default()
                && updated >= want_replicas
                && i64::from(workload.ready_replicas) >= want_replicas;
        }
    }
    Ok(workload)
}

/// Applies the APIServices, recording kube-apiserver's `Available` verdict in `groups`.
async fn apply_api_services(
    ctx: &Context,
    want: &desired::Desired,
    groups: &mut [GroupStatus],
) -> Result<(), Error> {
    for obj in &want.api_services {
        let applied = apply(&ctx.client, obj).await?;
        let api: APIService =
            serde_json::from_value(serde_json::to_value(&applied).unwrap_or_default())
                .unwrap_or_default();
        let (ok, reason, message) = available(&api);
        if let Some(gs) = groups
            .iter_mut()
            .find(|g| Some(&g.api_service) == api.metadata.name.as_ref())
        {
            gs.available = ok;
            gs.reason = reason;
            gs.message = message;
        }
    }
    Ok(())
}

/// Groups turned off: removes our APIService (kube-apiserver re-creates a Local one if a CRD
/// for the group exists), or, when the worker hands the group back with its reports, releases
/// it once it is Local again (until then it counts as `migrating`).
async fn remove_turned_off(
    rs: &ReportsServer,
    ctx: &Context,
    apiservices: &Api<APIService>,
    worker_running: bool,
    migrating: &mut Vec<String>,
) -> Result<(), Error> {
    for (group, version) in GROUP_VERSIONS {
        if rs.spec.enabled_groups().contains(&(version, group)) {
            continue;
        }
        let name = format!("{version}.{group}");
        let Some(existing) = get_opt(apiservices, &name).await? else {
            continue;
        };
        if !is_ours(&existing, rs) {
            continue;
        }
        if hands_back(rs) && worker_running {
            if describe_target(&existing).starts_with("Local") {
                release_apiservice(apiservices, &name).await?;
            } else {
                migrating.push(name.clone());
            }
            continue;
        }
        apiservices.delete(&name, &DeleteParams::default()).await?;
        let note = format!("group {group} turned off: deleted APIService {name}");
        ctx.event(rs, EventType::Normal, "APIServiceRemoved", note)
            .await;
    }
    Ok(())
}

/// What a reconcile that applied everything concludes, from what it observed; no I/O.
fn outcome_of(
    rs: &ReportsServer,
    status: &ReportsServerStatus,
    foreign: &[String],
    migrating: &[String],
    worker: Option<&Report>,
    workload_ready: bool,
) -> Outcome {
    if !foreign.is_empty() {
        return Outcome::degraded(
            "APIServiceOwnedByOther",
            format!(
                "APIService {} exists and is not managed by this ReportsServer; set spec.apiServices.takeOver: true to take it over",
                foreign.join(", ")
            ),
        );
    }
    let progress = status.migration.clone().unwrap_or_default();
    // The worker switches the APIServices before it reports its run Complete: until it does,
    // Ready would contradict status.migration (and a client could still meet the fence's
    // refusals).
    let worker_moving = worker.and_then(|w| w.phase).filter(|p| p.moves_in());
    if migrating.is_empty()
        && let Some(phase) = worker_moving
    {
        return Outcome::progressing(
            "Migrating",
            format!(
                "the server's migration worker has not finished its run: {}",
                migration_progress(&progress, phase.as_str())
            ),
        );
    }
    if !migrating.is_empty() {
        return Outcome::progressing(
            "Migrating",
            format!(
                "moving the reports of {} between CRD storage and the database: {}",
                migrating.join(", "),
                migration_progress(
                    &progress,
                    "waiting for the server's migration worker (serve --migrate-from-crds; spec.migration.enabled: false leaves such groups alone)"
                ),
            ),
        );
    }
    if !workload_ready {
        return Outcome::progressing(
            "WaitingForPods",
            format!(
                "{} of {} server pods ready",
                status.ready_replicas,
                rs.spec.replicas.max(1)
            ),
        );
    }
    if let Some(g) = status
        .groups
        .iter()
        .find(|g| !g.available && !migrating.contains(&g.api_service))
    {
        return Outcome::progressing(
            "WaitingForAPIService",
            format!(
                "APIService {} is not Available yet: {} {}",
                g.api_service, g.reason, g.message
            ),
        );
    }
    Outcome::Ready
}

/// Writes `status` with the conditions for `outcome` (and the servers' view of the database)
/// when it differs from `previous`, with an Event when `Ready` changes.
async fn publish_status(
    rs: &ReportsServer,
    ctx: &Context,
    previous: &ReportsServerStatus,
    mut status: ReportsServerStatus,
    outcome: &Outcome,
) -> Result<(), Error> {
    use reports_server_crds::reportsserver::condition::READY;
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let generation = rs.metadata.generation;
    status.conditions = status::conditions(&previous.conditions, outcome, generation, now.clone());
    status.conditions.push(status::database_condition(
        &previous.conditions,
        &ctx.database_of(&ObjectRef::from_obj(rs)),
        generation,
        now,
    ));
    if status == *previous {
        return Ok(());
    }
    let ready = |conditions: &[_]| {
        status::find(conditions, READY).map(|c| (c.status.clone(), c.reason.clone()))
    };
    if ready(&previous.conditions) != ready(&status.conditions) {
        let (type_, reason, note) = match outcome {
            Outcome::Ready => (
                EventType::Normal,
                "Ready".to_string(),
                "every enabled API group is served".to_string(),
            ),
            Outcome::Progressing { reason, message } => {
                (EventType::Normal, reason.clone(), message.clone())
            }
            Outcome::Degraded { reason, message } => {
                (EventType::Warning, reason.clone(), message.clone())
            }
        };
        ctx.event(rs, type_, &reason, note).await;
    }
    let api: Api<ReportsServer> =
        Api::namespaced(ctx.client.clone(), &rs.namespace().unwrap_or_default());
    api.patch_status(
        &rs.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({"status": status})),
    )
    .await?;
    Ok(())
}

/// Whether switched groups go back to CRD storage with their reports (on deletion, or when a
/// group is turned off) rather than being deleted.
fn hands_back(rs: &ReportsServer) -> bool {
    rs.spec.migration.enabled && rs.spec.migration.hand_back_on_delete
}

/// Whether an APIService routes to this installation's Service.
fn routes_to_us(api: &APIService, rs: &ReportsServer) -> bool {
    api.spec
        .as_ref()
        .and_then(|s| s.service.as_ref())
        .is_some_and(|svc| {
            svc.namespace == rs.namespace()
                && svc.name.as_deref() == Some(&desired::service_name(rs))
        })
}

/// A handed-back APIService is kube-apiserver's again: our owner annotation and labels go, so
/// neither the finalizer nor a later ReportsServer of the same name mistakes it for its own.
async fn release_apiservice(apiservices: &Api<APIService>, name: &str) -> Result<(), kube::Error> {
    let patch = json!({"metadata": {
        "annotations": {OWNER_ANNOTATION: null},
        "labels": {"app.kubernetes.io/instance": null, "app.kubernetes.io/managed-by": null},
    }});
    apiservices
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// What the server's migration worker last reported in the mailbox; `None` when no worker ever
/// reported. Only a server running one can hand back; one that never reported (an external
/// server started without `--migrate-from-crds`, a server that never came up) cannot, and
/// nothing may wait for it forever.
async fn worker_report(ctx: &Context, rs: &ReportsServer) -> Result<Option<Report>, kube::Error> {
    let configmaps: Api<ConfigMap> =
        Api::namespaced(ctx.client.clone(), &rs.namespace().unwrap_or_default());
    Ok(get_opt(&configmaps, &desired::migration_mailbox_name(rs))
        .await?
        .map(|cm| Report::from_data(&cm.data.unwrap_or_default()))
        .filter(|r| r.phase.is_some()))
}

/// `status.migration` from the worker's report (the previous one before any report).
fn migration_status(
    rs: &ReportsServer,
    report: Option<&Report>,
    previous: Option<&reports_server_crds::reportsserver::MigrationStatus>,
    wanted: &[String],
) -> Option<reports_server_crds::reportsserver::MigrationStatus> {
    let Some(report) = report else {
        return previous.cloned();
    };
    Some(status::migration_status(
        previous,
        report,
        wanted,
        rs.metadata.generation,
        Time(k8s_openapi::jiff::Timestamp::now()),
    ))
}

/// "phase, copied of total[; last error]" for the messages of a migration that is under way.
fn migration_progress(
    m: &reports_server_crds::reportsserver::MigrationStatus,
    waiting: &str,
) -> String {
    format!(
        "{}, {} of {} copied{}",
        if m.phase.is_empty() {
            waiting
        } else {
            &m.phase
        },
        m.copied,
        m.total,
        if m.message.is_empty() {
            String::new()
        } else {
            format!("; last error (retried): {}", m.message)
        }
    )
}

/// Deletion with `spec.migration.handBackOnDelete`: the mailbox asks the server to serve no
/// group, and deletion waits (status shows the progress) until the server has written every
/// report back into CRD storage and given the APIServices back.
async fn hand_back(rs: &ReportsServer, ctx: &Context) -> Result<(), Error> {
    let ns = rs.namespace().unwrap_or_default();
    let apiservices: Api<APIService> = Api::all(ctx.client.clone());
    let mut routed = Vec::new();
    for (group, version) in GROUP_VERSIONS {
        let name = format!("{version}.{group}");
        if let Some(existing) = get_opt(&apiservices, &name).await?
            && routes_to_us(&existing, rs)
        {
            routed.push(name);
        }
    }
    let report = worker_report(ctx, rs).await?;
    if report.is_none() {
        if !routed.is_empty() {
            ctx.event(
                rs,
                EventType::Warning,
                "NoHandBack",
                format!(
                    "no migration worker ever reported in ConfigMap {ns}/{}: {} deleted without handing the reports back (they stay in the database)",
                    desired::migration_mailbox_name(rs),
                    routed.join(", ")
                ),
            )
            .await;
        }
        return Ok(());
    }
    apply(&ctx.client, &desired::migration_mailbox(rs, &[])).await?;
    let previous = rs.status.clone().unwrap_or_default();
    let migration = migration_status(rs, report.as_ref(), previous.migration.as_ref(), &[]);
    let answered = migration.as_ref().is_some_and(|m| m.phase == "Complete")
        && migration
            .as_ref()
            .and_then(|m| status::find(&m.conditions, status::migration_condition::HANDED_BACK))
            .is_some_and(|c| c.status == "True");
    if migration != previous.migration {
        let api: Api<ReportsServer> = Api::namespaced(ctx.client.clone(), &ns);
        api.patch_status(
            &rs.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"migration": migration}})),
        )
        .await?;
    }
    if !routed.is_empty() || !answered {
        let m = migration.unwrap_or_default();
        return Err(Error::HandBackPending(format!(
            "the server hands {} back to CRD storage before the ReportsServer is deleted ({}); to delete without handing back, set spec.migration.handBackOnDelete: false",
            if routed.is_empty() {
                "the report groups".to_string()
            } else {
                routed.join(", ")
            },
            migration_progress(&m, "waiting for the server"),
        )));
    }
    for (group, version) in GROUP_VERSIONS {
        let name = format!("{version}.{group}");
        if let Some(existing) = get_opt(&apiservices, &name).await?
            && is_ours(&existing, rs)
            && describe_target(&existing).starts_with("Local")
        {
            release_apiservice(&apiservices, &name).await?;
        }
    }
    ctx.event(
        rs,
        EventType::Normal,
        "HandedBack",
        "every report was written back to CRD storage and the APIServices were given back to kube-apiserver".into(),
    )
    .await;
    Ok(())
}

/// Deletion: the hand-back when asked for, then APIServices, then what ownerReferences cannot
/// reach.
async fn cleanup(rs: &ReportsServer, ctx: &Context) -> Result<Action, Error> {
    if hands_back(rs) {
        hand_back(rs, ctx).await?;
    }
    let apiservices: Api<APIService> = Api::all(ctx.client.clone());
    let mut removed = Vec::new();
    for (group, version) in GROUP_VERSIONS {
        let name = format!("{version}.{group}");
        if let Some(existing) = get_opt(&apiservices, &name).await?
            && is_ours(&existing, rs)
        {
            delete_ignoring_missing(&apiservices, &name).await?;
            removed.push(name);
        }
    }
    if !removed.is_empty() {
        ctx.event(
            rs,
            EventType::Normal,
            "APIServicesRemoved",
            format!("deleted APIServices {}", removed.join(", ")),
        )
        .await;
    }
    let cluster = desired::cluster_name(rs);
    let crb: Api<k8s_openapi::api::rbac::v1::ClusterRoleBinding> = Api::all(ctx.client.clone());
    for name in [format!("{cluster}:auth-delegator"), cluster.clone()] {
        if let Some(o) = get_opt(&crb, &name).await?
            && is_ours(&o, rs)
        {
            delete_ignoring_missing(&crb, &name).await?;
        }
    }
    let cr: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(ctx.client.clone());
    if let Some(o) = get_opt(&cr, &cluster).await?
        && is_ours(&o, rs)
    {
        delete_ignoring_missing(&cr, &cluster).await?;
    }
    let rb: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
        Api::namespaced(ctx.client.clone(), "kube-system");
    let name = format!("{cluster}:auth-reader");
    if let Some(o) = get_opt(&rb, &name).await?
        && is_ours(&o, rs)
    {
        delete_ignoring_missing(&rb, &name).await?;
    }
    Ok(Action::await_change())
}

async fn delete_ignoring_missing<K>(api: &Api<K>, name: &str) -> Result<(), kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

/// Maps an APIService we manage to its ReportsServer (from the owner annotation).
fn owner_of(api: APIService) -> Option<ObjectRef<ReportsServer>> {
    let owner = api.annotations().get(OWNER_ANNOTATION)?;
    let (ns, name) = owner.split_once('/')?;
    Some(ObjectRef::new(name).within(ns))
}

/// Runs the controller until `stop` fires (shutdown, or the end of this replica's term as
/// leader), letting running reconciles finish.
pub async fn run(ctx: Arc<Context>, stop: CancellationToken) {
    let client = ctx.client.clone();
    let rs_api: Api<ReportsServer> = match &ctx.config.watch_namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let managed =
        watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={MANAGED_BY}"));
    macro_rules! owned_api {
        ($t:ty) => {
            match &ctx.config.watch_namespace {
                Some(ns) => Api::<$t>::namespaced(client.clone(), ns),
                None => Api::<$t>::all(client.clone()),
            }
        };
    }
    let controller = Controller::new(rs_api, watcher::Config::default().any_semantic());
    let (database_changed, reconcile_database) = futures::channel::mpsc::unbounded();
    tokio::spawn(
        database_check::run(
            ctx.clone(),
            controller.store(),
            database_changed,
            stop.clone(),
        )
        .instrument(tracing::info_span!("database_check")),
    );
    controller
        .reconcile_all_on(reconcile_database)
        // The generated CA, serving certificate and database password: one deleted by hand
        // is recreated at once (and a renewed certificate reaches the pods, which reload it).
        .owns(owned_api!(Secret), managed.clone())
        .owns(owned_api!(Service), managed.clone())
        .owns(owned_api!(Deployment), managed.clone())
        .owns(owned_api!(StatefulSet), managed.clone())
        .watches(Api::<APIService>::all(client.clone()), managed, owner_of)
        .graceful_shutdown_on(stop.cancelled_owned())
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => tracing::debug!(object = %obj, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "reconcile error"),
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use reports_server_crds::reportsserver::ReportsServerSpec;

    fn group(name: &str, available: bool) -> GroupStatus {
        GroupStatus {
            api_service: name.into(),
            available,
            reason: if available {
                "Passed"
            } else {
                "FailedDiscoveryCheck"
            }
            .into(),
            ..Default::default()
        }
    }

    fn reason(outcome: &Outcome) -> &str {
        match outcome {
            Outcome::Ready => "Ready",
            Outcome::Progressing { reason, .. } | Outcome::Degraded { reason, .. } => reason,
        }
    }

    #[test]
    fn the_outcome_names_the_first_thing_in_the_way() {
        let rs = ReportsServer::new(
            "reports-server",
            ReportsServerSpec {
                replicas: 2,
                ..Default::default()
            },
        );
        let mut status = ReportsServerStatus {
            ready_replicas: 1,
            groups: vec![group("v1alpha2.wgpolicyk8s.io", false)],
            ..Default::default()
        };
        let foreign = ["v1.reports.kyverno.io".to_string()];
        let degraded = outcome_of(&rs, &status, &foreign, &[], None, true);
        assert!(matches!(degraded, Outcome::Degraded { .. }));
        assert_eq!(reason(&degraded), "APIServiceOwnedByOther");
        let migrating = ["v1alpha2.wgpolicyk8s.io".to_string()];
        assert_eq!(
            reason(&outcome_of(&rs, &status, &[], &migrating, None, true)),
            "Migrating"
        );
        let pods = outcome_of(&rs, &status, &[], &[], None, false);
        assert_eq!(reason(&pods), "WaitingForPods");
        assert!(
            matches!(&pods, Outcome::Progressing { message, .. } if message == "1 of 2 server pods ready")
        );
        assert_eq!(
            reason(&outcome_of(&rs, &status, &[], &[], None, true)),
            "WaitingForAPIService"
        );
        status.groups = vec![group("v1alpha2.wgpolicyk8s.io", true)];
        assert_eq!(
            outcome_of(&rs, &status, &[], &[], None, true),
            Outcome::Ready
        );
    }
}
