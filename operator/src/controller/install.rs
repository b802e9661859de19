//! One reconcile of a live ReportsServer, as observe → decide → apply → report: prepare the
//! database and TLS facts, claim the APIServices, apply the workload and the APIServices,
//! remove what the spec turned off, then decide the outcome ([`outcome_of`], pure and
//! table-tested) and publish the status.

use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use reports_server_crds::reportsserver::{GroupStatus, ReportsServer, ReportsServerStatus};
use serde_json::{Value, json};

use crate::desired::{self, Database, Inputs};
use crate::status::{self, Outcome};
use reports_server_crds::catalog::GROUP_VERSIONS;
use reports_server_migration::mailbox::Report;

use super::certificates::prepare_tls;
use super::database::prepare_database;
use super::kube_io::{apply, get_opt, is_ours};
use super::removal::{
    hands_back, migration_progress, migration_status, release_apiservice, routes_to_us,
    worker_report,
};
use super::{Context, Error};

/// Status of an APIService's `Available` condition: (available, reason, message).
pub(super) fn available(api: &APIService) -> (bool, String, String) {
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

pub(super) fn describe_target(api: &APIService) -> String {
    match api.spec.as_ref().and_then(|s| s.service.as_ref()) {
        Some(svc) => format!(
            "Service {}/{}",
            svc.namespace.clone().unwrap_or_default(),
            svc.name.clone().unwrap_or_default()
        ),
        None => "Local (CRD storage)".into(),
    }
}

pub(super) async fn apply_installation(rs: &ReportsServer, ctx: &Context) -> Result<Action, Error> {
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
pub(super) async fn converge(
    rs: &ReportsServer,
    ctx: &Context,
    previous: &ReportsServerStatus,
    status: &mut ReportsServerStatus,
) -> Result<Outcome, Error> {
    if let Err(invalid) = desired::check_image(&rs.spec, &ctx.config.allowed_images) {
        return Ok(Outcome::degraded(invalid.reason, invalid.message));
    }
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
    let roles: Api<ClusterRole> = Api::all(ctx.client.clone());
    let owner_uid = match get_opt(&roles, crate::manifests::NAME).await {
        Ok(role) => role.and_then(|r| r.metadata.uid),
        Err(e) => {
            tracing::debug!(error = %e, "the operator's ClusterRole is unknown: cluster-scoped objects get no owner");
            None
        }
    };
    let monitoring_api =
        if rs.spec.monitoring.service_monitor.enabled && database != Database::External {
            Some(super::monitoring::serves_service_monitors(ctx).await)
        } else {
            None
        };
    let inputs = Inputs {
        rs,
        monitoring_api: matches!(monitoring_api, Some(Ok(true))),
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
        owner_uid,
        pod_ids: ctx.config.pod_ids,
    };
    let want = desired::desired(&inputs);
    let workload = apply_workload(rs, ctx, &want, &database).await?;
    // A discovery error keeps what exists: only "not served" or "not asked" removes it.
    let keep_monitoring =
        rs.spec.monitoring.service_monitor.enabled && !matches!(monitoring_api, Some(Ok(false)));
    super::monitoring::remove_turned_off_monitoring(rs, ctx, keep_monitoring).await?;
    observed_conditions(
        rs,
        previous,
        status,
        [
            super::analytics::converge_analytics(rs, ctx, &database).await?,
            super::monitoring::monitoring_observation(rs, &database, monitoring_api.as_ref()),
        ],
    );
    if let Err(e) = super::release::ensure_token(rs, ctx).await {
        tracing::warn!(error = %e, "no token of the release account: an uninstall of the operator may leave this ReportsServer's finalizer behind");
    }
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

/// Puts the conditions that report observations of optional parts (`AnalyticsAccess`,
/// `Monitoring`) into `status.conditions`, where [`publish_status`] keeps them next to the
/// outcome's.
fn observed_conditions(
    rs: &ReportsServer,
    previous: &ReportsServerStatus,
    status: &mut ReportsServerStatus,
    [analytics, monitoring]: [Option<crate::database_check::Observation>; 2],
) {
    use reports_server_crds::reportsserver::condition::{ANALYTICS_ACCESS, MONITORING};
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    for (type_, seen) in [(ANALYTICS_ACCESS, analytics), (MONITORING, monitoring)] {
        if let Some(seen) = seen {
            status.conditions.push(status::observed_condition(
                &previous.conditions,
                type_,
                &seen,
                rs.metadata.generation,
                now.clone(),
            ));
        }
    }
}

/// The enabled groups' APIServices as found before applying ours.
pub(super) struct ClaimedGroups {
    statuses: Vec<GroupStatus>,
    /// Not ours and not to be taken over: left alone, and the installation is Degraded.
    foreign: Vec<String>,
    /// Local (CRD storage) while the server's migration worker moves their reports.
    migrating: Vec<String>,
}

/// Decides, for each enabled group's existing APIService that is not ours, whether it becomes
/// ours (switched by the migration worker, or `apiServices.takeOver`), waits for the migration,
/// or is someone else's.
#[tracing::instrument(name = "claim_api_services", level = "debug", skip_all)]
pub(super) async fn claim_api_services(
    rs: &ReportsServer,
    ctx: &Context,
    previous: &ReportsServerStatus,
    apiservices: &Api<APIService>,
) -> Result<ClaimedGroups, Error> {
    tracing::debug!("the APIServices: which groups are ours to route");
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
pub(super) struct Workload {
    ready: bool,
    ready_replicas: i32,
}

/// Applies every desired object but the APIServices; reads the server workload's readiness
/// from what the API server answered.
#[tracing::instrument(name = "apply_workload", level = "debug", skip_all)]
pub(super) async fn apply_workload(
    rs: &ReportsServer,
    ctx: &Context,
    want: &desired::Desired,
    database: &Database,
) -> Result<Workload, Error> {
    tracing::debug!("the workload: RBAC, Services, the database, the Deployment");
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
#[tracing::instrument(name = "apply_api_services", level = "debug", skip_all)]
pub(super) async fn apply_api_services(
    ctx: &Context,
    want: &desired::Desired,
    groups: &mut [GroupStatus],
) -> Result<(), Error> {
    tracing::debug!("the APIServices routed to the server");
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
#[tracing::instrument(name = "remove_turned_off", level = "debug", skip_all)]
pub(super) async fn remove_turned_off(
    rs: &ReportsServer,
    ctx: &Context,
    apiservices: &Api<APIService>,
    worker_running: bool,
    migrating: &mut Vec<String>,
) -> Result<(), Error> {
    tracing::debug!("objects the spec no longer asks for");
    if rs.spec.migration.enabled {
        super::removal::remove_cluster_bindings(rs, ctx, &[]).await?;
    } else {
        super::removal::remove_migration_rights(rs, ctx).await?;
    }
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
pub(super) fn outcome_of(
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
#[tracing::instrument(name = "publish_status", level = "debug", skip_all)]
pub(super) async fn publish_status(
    rs: &ReportsServer,
    ctx: &Context,
    previous: &ReportsServerStatus,
    mut status: ReportsServerStatus,
    outcome: &Outcome,
) -> Result<(), Error> {
    tracing::debug!("the status, written when it changed");
    use reports_server_crds::reportsserver::condition::READY;
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let generation = rs.metadata.generation;
    let observed = std::mem::take(&mut status.conditions);
    status.conditions = status::conditions(&previous.conditions, outcome, generation, now.clone());
    status.conditions.push(status::database_condition(
        &previous.conditions,
        &ctx.database_of(&ObjectRef::from_obj(rs)),
        generation,
        now,
    ));
    status.conditions.extend(observed);
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
