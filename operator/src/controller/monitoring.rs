//! The servers' ServiceMonitor (`spec.monitoring.serviceMonitor`; the objects are built by
//! `desired`): whether the cluster serves the Prometheus Operator's API, the removal of the
//! objects when the option is turned off, and the `Monitoring` condition. A cluster without that
//! API is told in the condition, never a failed reconcile: the reports are served either way.

use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::{Resource, ResourceExt};
use reports_server_crds::reportsserver::ReportsServer;

use crate::database_check::Observation;
use crate::desired::{self, Database};

use super::kube_io::{delete_ignoring_missing, get_opt, is_ours};
use super::{Context, Error};

/// The API group and version of the ServiceMonitor.
pub(super) const API_VERSION: &str = "monitoring.coreos.com/v1";

/// Whether the cluster serves ServiceMonitors (discovery, which every authenticated user may
/// read: no permission needed). An error other than "not served" is reported, not fatal.
pub(super) async fn serves_service_monitors(ctx: &Context) -> Result<bool, String> {
    match ctx.client.list_api_group_resources(API_VERSION).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == "servicemonitors")),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

fn observation(ok: bool, reason: &str, message: String) -> Observation {
    Observation {
        status: Some(ok),
        reason: reason.into(),
        message,
    }
}

/// The `Monitoring` condition for what was applied (`served`: what discovery said; `None` when
/// it was not asked), or `None` when monitoring is off.
pub(super) fn monitoring_observation(
    rs: &ReportsServer,
    database: &Database,
    served: Option<&Result<bool, String>>,
) -> Option<Observation> {
    if !rs.spec.monitoring.service_monitor.enabled {
        return None;
    }
    let ns = rs.namespace().unwrap_or_default();
    let docs = "docs/operator.md (\"Scraping /metrics\")";
    Some(match (database, served) {
        (Database::External, _) => observation(
            false,
            "ExternalServer",
            format!("the server runs outside the cluster: scrape it where it runs, see {docs}"),
        ),
        (_, Some(Ok(true))) => observation(
            true,
            "ServiceMonitorApplied",
            format!(
                "ServiceMonitor {ns}/{} scrapes the servers' /metrics over HTTPS as ServiceAccount \
                 {ns}/{}",
                rs.name_any(),
                desired::metrics_reader_name(rs)
            ),
        ),
        (_, Some(Err(e))) => observation(
            false,
            "MonitoringAPIUnknown",
            format!("could not tell whether {API_VERSION} is served (retried): {e}"),
        ),
        _ => observation(
            false,
            "ServiceMonitorNotServed",
            format!(
                "this cluster does not serve {API_VERSION} ServiceMonitors (no Prometheus \
                 Operator): nothing was created; scrape with a plain Prometheus, see {docs}"
            ),
        ),
    })
}

/// Whether `obj` is owned by `rs` (an ownerReference with its uid).
fn owned_by<K: Resource>(obj: &K, rs: &ReportsServer) -> bool {
    obj.meta().owner_references.as_ref().is_some_and(|refs| {
        refs.iter()
            .any(|o| o.kind == "ReportsServer" && Some(&o.uid) == rs.metadata.uid.as_ref())
    })
}

/// Deletes `name` if it exists and `ours` says it belongs to this ReportsServer.
async fn delete_if<K>(api: &Api<K>, name: &str, ours: impl Fn(&K) -> bool) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if let Some(o) = get_opt(api, name).await?
        && ours(&o)
    {
        delete_ignoring_missing(api, name).await?;
    }
    Ok(())
}

/// Unless `keep`, deletes the ServiceMonitor, its ServiceAccount, token and ClusterRoleBinding
/// (the option turned off, or the API gone), each only when it is this ReportsServer's (an
/// ownerReference to it; the owner annotation for the cluster-scoped binding): a ServiceMonitor
/// of the same name from elsewhere (a Helm chart's) is left alone. What to remove is decided from
/// the objects, not from an earlier status (which a reconcile that ended early does not carry):
/// the ServiceAccount, deleted last, tells whether anything may be left, so an installation
/// without monitoring pays one GET.
pub(super) async fn remove_turned_off_monitoring(
    rs: &ReportsServer,
    ctx: &Context,
    keep: bool,
) -> Result<(), Error> {
    if keep {
        return Ok(());
    }
    let ns = rs.namespace().unwrap_or_default();
    let accounts: Api<ServiceAccount> = Api::namespaced(ctx.client.clone(), &ns);
    let account = desired::metrics_reader_name(rs);
    if !get_opt(&accounts, &account)
        .await?
        .is_some_and(|a| owned_by(&a, rs))
    {
        return Ok(());
    }
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("monitoring.coreos.com", "v1", "ServiceMonitor"),
        "servicemonitors",
    );
    let monitors: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), &ns, &resource);
    match get_opt(&monitors, &rs.name_any()).await {
        Ok(Some(m)) if owned_by(&m, rs) => {
            delete_ignoring_missing(&monitors, &rs.name_any()).await?;
        }
        Ok(_) => {}
        // The API is not served (any more): no ServiceMonitor to remove.
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(e.into()),
    }
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    delete_if(&secrets, &desired::metrics_reader_token_name(rs), |s| {
        owned_by(s, rs)
    })
    .await?;
    let bindings: Api<ClusterRoleBinding> = Api::all(ctx.client.clone());
    delete_if(&bindings, &desired::metrics_reader_binding_name(rs), |b| {
        is_ours(b, rs)
    })
    .await?;
    delete_ignoring_missing(&accounts, &account).await?;
    Ok(())
}
