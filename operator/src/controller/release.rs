//! Letting go of the ReportsServers when the operator itself is uninstalled.
//!
//! A ReportsServer carries the operator's finalizer, and only the operator removes it. When the
//! operator is uninstalled together with its installations (`kubectl delete -f install.yaml`,
//! its namespace deleted, `helm uninstall`, an Argo CD Application deleted with everything in
//! it), its pod is stopped first (a namespace deletes its pods before anything else) and its own
//! ServiceAccount and RBAC may be gone before it could act. A finalizer nobody removes keeps the
//! namespace Terminating and the CRD's deletion hanging, forever.
//!
//! So each installation has a release account, `<name>-release`: a ServiceAccount no pod runs
//! as, with a Role that may only get and patch that one ReportsServer. It belongs to the
//! ReportsServer, so nothing an uninstall deletes first takes it away. The operator keeps a
//! short-lived token of it. When the operator stops it asks whether it is being uninstalled
//! (its Deployment deleted, its namespace terminating, or its own account refused) and if so
//! removes the APIServices and bindings it can, and its finalizer from every ReportsServer it
//! reconciled, through those tokens, without a hand-back: the servers are stopping too, the
//! reports stay in their database. What the ReportsServer cannot own belongs to the operator's
//! ClusterRole (`desired::unowned_meta`), so the garbage collector removes it when an uninstall
//! deletes that role before the operator could. A stop that is not an uninstall (a rollout, a
//! scale-down, a drain) changes nothing.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use reports_server_crds::reportsserver::ReportsServer;
use serde_json::json;

use super::{Context, Error, kube_io::get_opt};
use crate::{FINALIZER, desired};

/// Lifetime asked for each token; renewed well before it ends (reconciles come at least every
/// `--ready-requeue-seconds`).
const TOKEN_SECONDS: i64 = 3600;
const RENEW_AFTER: Duration = Duration::from_secs(1200);

/// Tokens of the release accounts of the ReportsServers this replica reconciled.
pub struct ReleaseTokens {
    /// The operator's own client configuration, whose credentials are swapped for a token;
    /// `None` (tests with a mocked API server) turns the release off.
    base: Option<kube::Config>,
    minted: Mutex<HashMap<ObjectRef<ReportsServer>, (String, Instant)>>,
}

impl ReleaseTokens {
    pub fn new(base: Option<kube::Config>) -> Self {
        ReleaseTokens {
            base,
            minted: Mutex::new(HashMap::new()),
        }
    }

    fn is_fresh(&self, key: &ObjectRef<ReportsServer>) -> bool {
        self.minted
            .lock()
            .expect("not poisoned")
            .get(key)
            .is_some_and(|(_, at)| at.elapsed() < RENEW_AFTER)
    }

    /// A deleted ReportsServer needs no release.
    pub(super) fn forget(&self, key: &ObjectRef<ReportsServer>) {
        self.minted.lock().expect("not poisoned").remove(key);
    }

    fn held(&self) -> Vec<(ObjectRef<ReportsServer>, String)> {
        self.minted
            .lock()
            .expect("not poisoned")
            .iter()
            .map(|(k, (token, _))| (k.clone(), token.clone()))
            .collect()
    }

    fn client(&self, token: &str) -> Result<Client, kube::Error> {
        let mut config = self.base.clone().ok_or_else(|| {
            kube::Error::Service("no client configuration for the release account".into())
        })?;
        config.auth_info = kube::config::AuthInfo {
            token: Some(token.to_owned().into()),
            ..Default::default()
        };
        Client::try_from(config)
    }
}

/// Keeps a valid token of the installation's release account (after its objects are applied).
#[tracing::instrument(name = "release_token", level = "debug", skip_all)]
pub(super) async fn ensure_token(rs: &ReportsServer, ctx: &Context) -> Result<(), Error> {
    let key = ObjectRef::from_obj(rs);
    if ctx.release.base.is_none() || ctx.release.is_fresh(&key) {
        return Ok(());
    }
    let accounts: Api<ServiceAccount> =
        Api::namespaced(ctx.client.clone(), &rs.namespace().unwrap_or_default());
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(TOKEN_SECONDS),
            ..Default::default()
        }),
        ..Default::default()
    };
    let minted = accounts
        .create_token_request(
            &desired::release_account_name(rs),
            &PostParams::default(),
            &request,
        )
        .await?;
    let token = minted.status.and_then(|s| s.token).unwrap_or_default();
    ctx.release
        .minted
        .lock()
        .expect("not poisoned")
        .insert(key, (token, Instant::now()));
    Ok(())
}

/// Removes [`FINALIZER`] with the object's resourceVersion, so that a finalizer someone else
/// adds meanwhile is not dropped; a conflict (the object changed, e.g. its deletion began
/// between the read and the write) is read again and retried. Returns the object it changed,
/// `None` when it is gone or the finalizer already is.
async fn remove_finalizer(
    api: &Api<ReportsServer>,
    mut rs: ReportsServer,
) -> Result<Option<ReportsServer>, kube::Error> {
    let name = rs.name_any();
    for _ in 0..5 {
        if !rs.finalizers().iter().any(|f| f == FINALIZER) {
            return Ok(None);
        }
        let kept: Vec<&String> = rs.finalizers().iter().filter(|f| *f != FINALIZER).collect();
        let patch =
            json!({"metadata": {"finalizers": kept, "resourceVersion": rs.resource_version()}});
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(Some(rs)),
            Err(kube::Error::Api(s)) if s.code == 409 => match get_opt(api, &name).await? {
                Some(fresh) => rs = fresh,
                None => return Ok(None),
            },
            Err(e) => return Err(e),
        }
    }
    Err(kube::Error::Service(
        "the ReportsServer kept changing; its finalizer was not removed".into(),
    ))
}

/// Why this stop is an uninstall, if it is one: the operator's Deployment is deleted or being
/// deleted, its namespace is terminating, or kube-apiserver refuses its own account (its
/// ServiceAccount or RBAC deleted). `None` for a rollout, a scale-down or a drain.
async fn uninstalling(ctx: &Context) -> Option<String> {
    let ns = ctx.config.watch_namespace.as_deref()?;
    let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
    match get_opt(&namespaces, ns).await {
        Ok(Some(n)) if n.metadata.deletion_timestamp.is_some() => {
            return Some(format!("namespace {ns} is being deleted"));
        }
        Ok(None) => return Some(format!("namespace {ns} is gone")),
        Err(e) => {
            // `get` on its own namespace came with the uninstall detection.
            if let Some(reason) = account_gone(ctx, ns, &e, false).await {
                return Some(reason);
            }
        }
        Ok(Some(_)) => {}
    }
    let name = ctx.config.deployment_name.as_deref()?;
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    match get_opt(&deployments, name).await {
        Ok(None) => Some(format!("its Deployment {ns}/{name} was deleted")),
        Ok(Some(d)) if d.metadata.deletion_timestamp.is_some() => {
            Some(format!("its Deployment {ns}/{name} is being deleted"))
        }
        // Deployments in its namespace: the operator has always managed the servers' there.
        Err(e) => account_gone(ctx, ns, &e, true).await,
        Ok(Some(_)) => None,
    }
}

/// Whether `e` means the operator's own account was deleted: 401 (its ServiceAccount is gone),
/// or 403 where `right_always_held` (a right every release of the operator had, so its refusal
/// means the RBAC was deleted), else 403 on the ReportsServers of its namespace as well, which
/// it reads all the time (a 403 on a newer right alone may be RBAC that predates it, and must
/// not make every restart an uninstall). The namespaced Role and the ClusterRole go in either
/// order, so each check must stand on its own.
/// Short: the reason ends up in an Event, whose note has at most 1024 characters.
async fn account_gone(
    ctx: &Context,
    ns: &str,
    e: &kube::Error,
    right_always_held: bool,
) -> Option<String> {
    let code = match e {
        kube::Error::Api(s) if s.code == 401 || s.code == 403 => s.code,
        _ => return None,
    };
    if code == 403 && !right_always_held {
        let own: Api<ReportsServer> = Api::namespaced(ctx.client.clone(), ns);
        let probe = own.list_metadata(&ListParams::default().limit(1)).await;
        if !matches!(probe, Err(kube::Error::Api(s)) if s.code == 401 || s.code == 403) {
            return None;
        }
    }
    Some(format!(
        "kube-apiserver refuses the operator's own account ({code}): its ServiceAccount or RBAC was deleted"
    ))
}

/// On the way out: when this stop is an uninstall, removes the finalizer from every
/// ReportsServer this replica reconciled (a standby holds no tokens and does nothing).
pub async fn on_shutdown(ctx: &Context) {
    let held = ctx.release.held();
    if held.is_empty() {
        return;
    }
    let Some(reason) = uninstalling(ctx).await else {
        tracing::debug!("stopping without an uninstall: the finalizers stay");
        return;
    };
    tracing::info!(%reason, count = held.len(), "the operator is being uninstalled: removing its finalizer from its ReportsServers");
    for (key, token) in held {
        if let Err(e) = let_go(ctx, &key, &token, &reason).await {
            tracing::warn!(reports_server = %key, error = %e, "could not remove the finalizer; remove it by hand (docs/operator.md, Uninstall)");
        }
    }
}

async fn let_go(
    ctx: &Context,
    key: &ObjectRef<ReportsServer>,
    token: &str,
    reason: &str,
) -> Result<(), kube::Error> {
    let ns = key.namespace.clone().unwrap_or_default();
    let client = ctx.release.client(token)?;
    let api: Api<ReportsServer> = Api::namespaced(client.clone(), &ns);
    let Some(rs) = get_opt(&api, &key.name).await? else {
        return Ok(());
    };
    if !rs.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(());
    }
    // What the finalizer would have removed, while the operator's own account may still do it;
    // when it may not (its RBAC already deleted), the garbage collector removes those objects
    // with the operator's ClusterRole, which owns them.
    if let Err(e) = super::removal::remove_cluster_objects(&rs, ctx).await {
        tracing::info!(reports_server = %key, error = %e, "the APIServices and bindings are left to the garbage collector");
    }
    let Some(rs) = remove_finalizer(&api, rs).await? else {
        return Ok(());
    };
    tracing::info!(reports_server = %key, "finalizer removed: the reports stay in the database");
    // Through the release account too: the operator's own may no longer create Events.
    let reporter = Reporter {
        controller: crate::FIELD_MANAGER.into(),
        instance: ctx.config.instance.clone(),
    };
    let event = Event {
        type_: EventType::Warning,
        reason: "ReleasedOnUninstall".into(),
        note: Some(format!(
            "the operator is being uninstalled ({reason}): the report groups are no longer routed to this server and its finalizer was removed, without a hand-back; the reports stay in the database (docs/operator.md, Uninstall)"
        )),
        action: "Uninstall".into(),
        secondary: None,
    };
    if let Err(e) = Recorder::new(client, reporter)
        .publish(&event, &rs.object_ref(&()))
        .await
    {
        tracing::warn!(error = %e, "could not publish the ReleasedOnUninstall Event");
    }
    Ok(())
}
