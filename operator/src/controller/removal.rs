//! A ReportsServer being deleted: the reports handed back to CRD storage when the spec asks
//! for it, the APIServices released before anything they route to disappears, then the
//! cluster-scoped objects that ownerReferences cannot reach.

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use reports_server_crds::reportsserver::ReportsServer;
use serde_json::json;

use crate::OWNER_ANNOTATION;
use crate::desired::{self};
use crate::status::{self};
use reports_server_crds::catalog::GROUP_VERSIONS;
use reports_server_migration::mailbox::Report;

use super::install::describe_target;
use super::kube_io::{apply, delete_ignoring_missing, get_opt, is_ours};
use super::{Context, Error};

/// Whether switched groups go back to CRD storage with their reports (on deletion, or when a
/// group is turned off) rather than being deleted.
pub(super) fn hands_back(rs: &ReportsServer) -> bool {
    rs.spec.migration.enabled && rs.spec.migration.hand_back_on_delete
}

/// Whether an APIService routes to this installation's Service.
pub(super) fn routes_to_us(api: &APIService, rs: &ReportsServer) -> bool {
    api.spec
        .as_ref()
        .and_then(|s| s.service.as_ref())
        .is_some_and(|svc| {
            svc.namespace == rs.namespace()
                && svc.name.as_deref() == Some(&desired::service_name(rs))
        })
}

/// A handed-back APIService is kube-apiserver's again: our owner annotation and labels go, so
/// neither the finalizer nor a later ReportsServer of the same name mistakes it for its own, and
/// so does the Namespace's ownerReference, so that the garbage collector does not delete it
/// with our namespace.
pub(super) async fn release_apiservice(
    apiservices: &Api<APIService>,
    name: &str,
) -> Result<(), kube::Error> {
    let patch = json!({"metadata": {
        "ownerReferences": null,
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
pub(super) async fn worker_report(
    ctx: &Context,
    rs: &ReportsServer,
) -> Result<Option<Report>, kube::Error> {
    let configmaps: Api<ConfigMap> =
        Api::namespaced(ctx.client.clone(), &rs.namespace().unwrap_or_default());
    Ok(get_opt(&configmaps, &desired::migration_mailbox_name(rs))
        .await?
        .map(|cm| Report::from_data(&cm.data.unwrap_or_default()))
        .filter(|r| r.phase.is_some()))
}

/// `status.migration` from the worker's report (the previous one before any report).
pub(super) fn migration_status(
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
pub(super) fn migration_progress(
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
#[tracing::instrument(name = "hand_back", level = "debug", skip_all)]
pub(super) async fn hand_back(rs: &ReportsServer, ctx: &Context) -> Result<(), Error> {
    tracing::debug!("the reports handed back to CRD storage");
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
#[tracing::instrument(name = "cleanup", level = "debug", skip_all)]
pub(super) async fn cleanup(rs: &ReportsServer, ctx: &Context) -> Result<Action, Error> {
    tracing::debug!("the finalizer: APIServices first, then cluster-scoped objects");
    if hands_back(rs) {
        hand_back(rs, ctx).await?;
    }
    remove_cluster_objects(rs, ctx).await?;
    remove_release_account(rs, ctx).await?;
    ctx.release
        .forget(&kube::runtime::reflector::ObjectRef::from_obj(rs));
    Ok(Action::await_change())
}

/// What ownerReferences of the ReportsServer cannot reach: its APIServices first (no group is
/// left routed to a Service about to go), then its ClusterRoleBindings and the RoleBinding in
/// kube-system.
pub(super) async fn remove_cluster_objects(rs: &ReportsServer, ctx: &Context) -> Result<(), Error> {
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
    remove_cluster_bindings(
        rs,
        ctx,
        &[
            desired::server_binding_name(rs),
            desired::migration_binding_name(rs),
            format!("{cluster}:auth-delegator"),
            desired::metrics_reader_binding_name(rs),
        ],
    )
    .await?;
    let rb: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
        Api::namespaced(ctx.client.clone(), "kube-system");
    let name = format!("{cluster}:auth-reader");
    if let Some(o) = get_opt(&rb, &name).await?
        && is_ours(&o, rs)
    {
        delete_ignoring_missing(&rb, &name).await?;
    }
    Ok(())
}

/// Deletes those of `bindings` (ClusterRoleBindings) that belong to this installation, then what
/// earlier releases wrote per installation instead of binding the shipped roles: a ClusterRole
/// named [`desired::cluster_name`] and its binding of the same name.
pub(super) async fn remove_cluster_bindings(
    rs: &ReportsServer,
    ctx: &Context,
    bindings: &[String],
) -> Result<(), Error> {
    let legacy = desired::cluster_name(rs);
    let crb: Api<k8s_openapi::api::rbac::v1::ClusterRoleBinding> = Api::all(ctx.client.clone());
    for name in bindings.iter().chain([&legacy]) {
        if let Some(o) = get_opt(&crb, name).await?
            && is_ours(&o, rs)
        {
            delete_ignoring_missing(&crb, name).await?;
        }
    }
    let cr: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(ctx.client.clone());
    if let Some(o) = get_opt(&cr, &legacy).await?
        && is_ours(&o, rs)
    {
        delete_ignoring_missing(&cr, &legacy).await?;
    }
    Ok(())
}

/// Deletes the RoleBinding and the Role `name` of the ReportsServer's namespace (the pair
/// `rbac::role_and_binding` writes). One request each, present or not: a DELETE that finds
/// nothing costs what a GET would.
async fn remove_role_and_binding(
    rs: &ReportsServer,
    ctx: &Context,
    name: &str,
) -> Result<(), Error> {
    let ns = rs.namespace().unwrap_or_default();
    let rb: Api<k8s_openapi::api::rbac::v1::RoleBinding> = Api::namespaced(ctx.client.clone(), &ns);
    delete_ignoring_missing(&rb, name).await?;
    let role: Api<k8s_openapi::api::rbac::v1::Role> = Api::namespaced(ctx.client.clone(), &ns);
    delete_ignoring_missing(&role, name).await?;
    Ok(())
}

/// The release account (`desired::release_account_name`), which nothing owns.
async fn remove_release_account(rs: &ReportsServer, ctx: &Context) -> Result<(), Error> {
    let name = desired::release_account_name(rs);
    remove_role_and_binding(rs, ctx, &name).await?;
    let sa: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(ctx.client.clone(), &rs.namespace().unwrap_or_default());
    delete_ignoring_missing(&sa, &name).await?;
    Ok(())
}

/// Removes the migration's rights once `spec.migration.enabled` is off: its ClusterRoleBinding
/// and the Role and RoleBinding of its mailbox.
pub(super) async fn remove_migration_rights(
    rs: &ReportsServer,
    ctx: &Context,
) -> Result<(), Error> {
    remove_cluster_bindings(rs, ctx, &[desired::migration_binding_name(rs)]).await?;
    remove_role_and_binding(rs, ctx, &desired::migration_mailbox_role_name(rs)).await
}
