//! The servers' ServiceMonitor (`spec.monitoring.serviceMonitor`; the objects are built by
//! `desired`): whether the cluster serves the Prometheus Operator's API, the removal of the
//! objects when the option is turned off, and the `Monitoring` condition. A cluster without that
//! API is told in the condition, never a failed reconcile: the reports are served either way.

use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use reports_server_crds::reportsserver::condition::MONITORING;
use reports_server_crds::reportsserver::{ReportsServer, ReportsServerStatus};

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

/// Unless `keep`, deletes the ServiceMonitor, its ServiceAccount, token and ClusterRoleBinding
/// (the option turned off, or the API gone). Only for an installation that showed the
/// condition, so that the others pay no request.
pub(super) async fn remove_turned_off_monitoring(
    rs: &ReportsServer,
    ctx: &Context,
    previous: &ReportsServerStatus,
    keep: bool,
) -> Result<(), Error> {
    let showed = crate::status::find(&previous.conditions, MONITORING).is_some();
    if keep || !showed {
        return Ok(());
    }
    let ns = rs.namespace().unwrap_or_default();
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("monitoring.coreos.com", "v1", "ServiceMonitor"),
        "servicemonitors",
    );
    let monitors: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), &ns, &resource);
    delete_ignoring_missing(&monitors, &rs.name_any()).await?;
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    delete_ignoring_missing(&secrets, &desired::metrics_reader_token_name(rs)).await?;
    let accounts: Api<ServiceAccount> = Api::namespaced(ctx.client.clone(), &ns);
    delete_ignoring_missing(&accounts, &desired::metrics_reader_name(rs)).await?;
    let bindings: Api<ClusterRoleBinding> = Api::all(ctx.client.clone());
    let binding = desired::metrics_reader_binding_name(rs);
    if let Some(o) = get_opt(&bindings, &binding).await?
        && is_ours(&o, rs)
    {
        delete_ignoring_missing(&bindings, &binding).await?;
    }
    Ok(())
}
