//! The analysts' read-only role in the operator's PostgreSQL (`spec.analytics.readOnlyRole`,
//! [`crate::analytics`] for the SQL and why it is run this way): its Secret, the grants, the
//! role's removal when the option is turned off, and the `AnalyticsAccess` condition. Nothing
//! here changes the reconcile's outcome: the reports are served with or without the role.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::Instant;

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use reports_server_crds::reportsserver::ReportsServer;
use reports_server_crds::reportsserver::ReportsServerStatus;
use reports_server_crds::reportsserver::condition::ANALYTICS_ACCESS;

use crate::analytics::{self, Connection, MANAGED_DATABASE, MANAGED_OWNER, MANAGED_PORT, ROLE};
use crate::database_check::Observation;
use crate::desired::{self, Database};

use super::kube_io::{delete_ignoring_missing, get_opt, owner_reference, secret_str};
use super::{Context, Error};

/// The last grants that succeeded for an installation: a fingerprint of their statements and
/// when.
#[derive(Clone, Debug)]
pub(super) struct Converged {
    fingerprint: u64,
    at: Instant,
}

fn observation(ok: bool, reason: &str, message: String) -> Observation {
    Observation {
        status: Some(ok),
        reason: reason.into(),
        message,
    }
}

/// What the spec asks of analysts' access, done as far as this database allows; `None` when it
/// asks nothing (and nothing is left to remove).
#[tracing::instrument(name = "analytics_access", level = "debug", skip_all)]
pub(super) async fn converge_analytics(
    rs: &ReportsServer,
    ctx: &Context,
    database: &Database,
    previous: &ReportsServerStatus,
) -> Result<Option<Observation>, Error> {
    let enabled = rs.spec.analytics.read_only_role.enabled;
    let docs = "docs/analytics-access.md";
    Ok(match (enabled, database) {
        (true, Database::ManagedPostgres(_)) => Some(grant(rs, ctx).await?),
        // Only an installation that showed the condition can have a role to remove: no extra
        // request for the others.
        (false, Database::ManagedPostgres(_))
            if crate::status::find(&previous.conditions, ANALYTICS_ACCESS).is_some() =>
        {
            revoke(rs, ctx).await?
        }
        (false, _) => None,
        (true, Database::ExternalPostgres(_)) => Some(observation(
            false,
            "RoleNotManaged",
            format!(
                "the operator creates the read-only role only in its own PostgreSQL \
                 (spec.database.postgres.managed); in yours, have its admin run the SQL of \
                 {docs} (\"Someone else's PostgreSQL\")"
            ),
        )),
        (true, Database::Sqlite { .. }) => Some(observation(
            false,
            "SqliteHasNoRoles",
            format!(
                "SQLite has no roles: analysts query a copy of the database file, see {docs} \
                 (\"SQLite\")"
            ),
        )),
        (true, Database::External) => Some(observation(
            false,
            "ExternalServer",
            format!(
                "the server runs outside the cluster, with a database the operator does not \
                 manage: create the read-only role there with the SQL of {docs}"
            ),
        )),
    })
}

/// The managed PostgreSQL as its superuser, whose password the operator generated.
async fn superuser(rs: &ReportsServer, ctx: &Context) -> Result<Option<Connection>, Error> {
    let secrets: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &rs.namespace().unwrap_or_default());
    let password = get_opt(&secrets, &desired::postgres_name(rs))
        .await?
        .and_then(|s| secret_str(&s, "password"))
        .filter(|p| !p.is_empty());
    Ok(password.map(|password| Connection {
        host: desired::postgres_host(rs),
        port: MANAGED_PORT,
        database: MANAGED_DATABASE.into(),
        user: MANAGED_OWNER.into(),
        password,
    }))
}

/// The analysts' Secret, created once with a generated password (never rewritten: the
/// password is what the grants set). `Err` with the condition when it is unusable.
async fn ensure_secret(
    rs: &ReportsServer,
    ctx: &Context,
) -> Result<Result<String, Observation>, Error> {
    use rand::distr::{Alphanumeric, SampleString};
    let ns = rs.namespace().unwrap_or_default();
    let name = desired::analytics_secret_name(rs);
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    if let Some(existing) = get_opt(&secrets, &name).await? {
        return Ok(secret_str(&existing, "password")
            .filter(|p| !p.is_empty())
            .ok_or_else(|| {
                observation(
                    false,
                    "AnalyticsSecretInvalid",
                    format!(
                        "Secret {ns}/{name} has no key \"password\": delete it and the operator \
                         writes a new one with a new password"
                    ),
                )
            }));
    }
    let password = Alphanumeric.sample_string(&mut rand::rng(), 32);
    let connection = Connection {
        host: desired::postgres_host(rs),
        port: MANAGED_PORT,
        database: MANAGED_DATABASE.into(),
        user: ROLE.into(),
        password: password.clone(),
    };
    let metadata = serde_json::json!({
        "name": name, "namespace": ns, "labels": desired::labels(rs),
        "ownerReferences": [owner_reference(rs)],
    });
    let secret: Secret =
        serde_json::from_value(analytics::secret(metadata, &connection)).expect("a valid Secret");
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            let note = format!(
                "created Secret {ns}/{name} with the connection details of the read-only role {ROLE}"
            );
            ctx.event(rs, EventType::Normal, "AnalyticsSecretCreated", note)
                .await;
            Ok(Ok(password))
        }
        // Created by a reconcile racing this one: its password is the one to use.
        Err(kube::Error::Api(s)) if s.code == 409 => Box::pin(ensure_secret(rs, ctx)).await,
        Err(e) => Err(e.into()),
    }
}

fn fingerprint(statements: &[String]) -> u64 {
    let mut h = DefaultHasher::new();
    statements.hash(&mut h);
    h.finish()
}

/// Runs the grants unless the same ones succeeded less than `--ready-requeue-seconds` ago.
async fn grant(rs: &ReportsServer, ctx: &Context) -> Result<Observation, Error> {
    let ns = rs.namespace().unwrap_or_default();
    let secret = desired::analytics_secret_name(rs);
    let password = match ensure_secret(rs, ctx).await? {
        Ok(password) => password,
        Err(problem) => return Ok(problem),
    };
    let ready = observation(
        true,
        "RoleReady",
        format!(
            "role {ROLE} may read every table and view of database {MANAGED_DATABASE} and write \
             nothing; connection details in Secret {ns}/{secret}"
        ),
    );
    let statements = analytics::managed_statements(&password);
    let key = ObjectRef::from_obj(rs);
    let print = fingerprint(&statements);
    if ctx
        .analytics_converged(&key)
        .is_some_and(|c| c.fingerprint == print && c.at.elapsed() < ctx.config.ready_requeue)
    {
        return Ok(ready);
    }
    let Some(admin) = superuser(rs, ctx).await? else {
        return Ok(observation(
            false,
            "RoleNotReady",
            format!(
                "the password Secret {ns}/{} of the PostgreSQL is not there yet",
                desired::postgres_name(rs)
            ),
        ));
    };
    match ctx.sql.run(&admin, &statements).await {
        Ok(()) => {
            tracing::info!(role = ROLE, "the analysts' read-only role is in place");
            ctx.record_analytics(
                key,
                Some(Converged {
                    fingerprint: print,
                    at: Instant::now(),
                }),
            );
            Ok(ready)
        }
        Err(e) => {
            tracing::info!(error = %e, "the analysts' role could not be set up yet");
            Ok(observation(
                false,
                "RoleNotReady",
                format!(
                    "setting up role {ROLE} in the operator's PostgreSQL failed (retried at the \
                     next reconcile): {e}"
                ),
            ))
        }
    }
}

/// The option turned off: drops the role and deletes the Secret the operator wrote. `None` once
/// nothing is left.
async fn revoke(rs: &ReportsServer, ctx: &Context) -> Result<Option<Observation>, Error> {
    ctx.record_analytics(ObjectRef::from_obj(rs), None);
    let ns = rs.namespace().unwrap_or_default();
    let name = desired::analytics_secret_name(rs);
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(admin) = superuser(rs, ctx).await? else {
        return Ok(None);
    };
    if let Err(e) = ctx.sql.run(&admin, &analytics::drop_statements(ROLE)).await {
        return Ok(Some(observation(
            false,
            "RoleRemovalPending",
            format!(
                "spec.analytics.readOnlyRole is off, but dropping role {ROLE} failed (retried): {e}"
            ),
        )));
    }
    let ours = get_opt(&secrets, &name).await?.is_some_and(|s| {
        s.owner_references()
            .iter()
            .any(|o| Some(&o.uid) == rs.metadata.uid.as_ref())
    });
    if ours {
        delete_ignoring_missing(&secrets, &name).await?;
    }
    let note = format!(
        "dropped role {ROLE}{}",
        if ours {
            format!(" and deleted Secret {ns}/{name}")
        } else {
            String::new()
        }
    );
    ctx.event(rs, EventType::Normal, "AnalyticsRoleRemoved", note)
        .await;
    Ok(None)
}
