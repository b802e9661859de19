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
//! When the operator is uninstalled with its installations, `release` removes the finalizer on
//! its way out and the garbage collector removes the rest with the namespace.
//! The migration/rollback work of the zero-loss migration issue hooks into the same cleanup.
//!
//! The parts: `install` (one reconcile of a live ReportsServer, observe → decide → apply →
//! report), `removal` (the finalizer's cleanup and hand-back), `database` and `certificates`
//! (the facts the pure builders need), `kube_io` (small API helpers). This file holds the
//! loop: `Context`, `reconcile`, `error_policy` and `run`.

mod analytics;
mod certificates;
mod database;
mod foreign;
mod install;
mod kube_io;
mod monitoring;
pub mod release;
mod removal;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use reports_server_crds::reportsserver::ReportsServer;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::database_check::{self, Observation};
use crate::http::Metrics;
use crate::{FIELD_MANAGER, FINALIZER, MANAGED_BY, OWNER_ANNOTATION, tls};
use install::apply_installation;
use removal::cleanup;

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
    /// What `spec.image` may name (`desired::check_image`); the default image is always allowed.
    pub allowed_images: Vec<String>,
    /// Watch ReportsServers in this namespace only; `None` watches all.
    pub watch_namespace: Option<String>,
    /// The operator's own Deployment in `watch_namespace`: deleted, it means an uninstall
    /// (`release`). `None`: only a terminating namespace or a refused account mean one.
    pub deployment_name: Option<String>,
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
    /// Whether the pods name their user and group ids or the platform assigns them.
    pub pod_ids: crate::desired::PodIds,
}

impl Default for OperatorConfig {
    fn default() -> Self {
        OperatorConfig {
            default_image: crate::DEFAULT_IMAGE.into(),
            allowed_images: vec![crate::desired::image_repository(crate::DEFAULT_IMAGE).into()],
            watch_namespace: None,
            deployment_name: None,
            progress_requeue: Duration::from_secs(3),
            degraded_requeue: Duration::from_secs(15),
            ready_requeue: Duration::from_secs(300),
            max_backoff: Duration::from_secs(300),
            database_check_interval: Duration::from_secs(10),
            instance: None,
            pod_ids: crate::desired::PodIds::Fixed,
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
    /// Tokens of the installations' release accounts (`release`).
    release: release::ReleaseTokens,
    /// Runs the analysts' grants on the operator's PostgreSQL (`crate::analytics`).
    sql: Arc<dyn crate::analytics::SqlRunner>,
    /// The last analysts' grants that succeeded, per installation (`analytics`).
    analytics: Mutex<HashMap<ObjectRef<ReportsServer>, analytics::Converged>>,
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
            release: release::ReleaseTokens::new(None),
            sql: Arc::new(crate::analytics::PostgresRunner),
            analytics: Mutex::new(HashMap::new()),
        }
    }

    /// Runs the analysts' grants with `runner` instead of connecting to PostgreSQL (tests).
    pub fn with_sql_runner(mut self, runner: Arc<dyn crate::analytics::SqlRunner>) -> Self {
        self.sql = runner;
        self
    }

    /// Remembers (or, `None`, forgets) the last analysts' grants that succeeded.
    fn record_analytics(
        &self,
        key: ObjectRef<ReportsServer>,
        converged: Option<analytics::Converged>,
    ) {
        let mut all = self.analytics.lock().expect("not poisoned");
        match converged {
            Some(c) => all.insert(key, c),
            None => all.remove(&key),
        };
    }

    fn analytics_converged(&self, key: &ObjectRef<ReportsServer>) -> Option<analytics::Converged> {
        self.analytics
            .lock()
            .expect("not poisoned")
            .get(key)
            .cloned()
    }

    /// The client configuration the operator runs with, from which the release accounts'
    /// clients are made (without it, no finalizer is released on an uninstall).
    pub fn with_client_config(mut self, config: kube::Config) -> Self {
        self.release = release::ReleaseTokens::new(Some(config));
        self
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

/// Reconciles one ReportsServer (wrapped in the finalizer).
pub async fn reconcile(rs: Arc<ReportsServer>, ctx: Arc<Context>) -> Result<Action, Error> {
    // Not `name`: the JSON log writes a span's own name under that key too, and a reader keeps
    // only one of the two.
    let span = tracing::info_span!(
        "reconcile",
        namespace = rs.namespace().unwrap_or_default(),
        reports_server = %rs.name_any()
    );
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
    if let Some(managed) = ctx.config.watch_namespace.clone() {
        tokio::spawn(
            foreign::run(ctx.clone(), managed, stop.clone())
                .instrument(tracing::info_span!("foreign_reports_servers")),
        );
    }
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
