//! The analysts' read-only role in the operator's PostgreSQL (`spec.analytics.readOnlyRole`,
//! [`crate::analytics`] for the SQL and why it is run this way): its Secret, the grants, the
//! role's removal when the option is turned off, and the `AnalyticsAccess` condition. Nothing
//! here changes the reconcile's outcome: the reports are served with or without the role.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::Instant;

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use reports_server_crds::reportsserver::ReportsServer;
use sha2::{Digest, Sha256};

use crate::analytics::{
    self, Connection, MANAGED_DATABASE, MANAGED_OWNER, MANAGED_PORT, ROLE, ROLE_MISSING,
};
use crate::database_check::Observation;
use crate::desired::{self, ANALYTICS_SECRET_MARK, Database};

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

/// The annotation of the analysts' Secret with the SHA-256 of the password last set on the role.
pub const PASSWORD_APPLIED: &str = "reportsserver.io/password-sha256";

/// Whether `secret` is the analysts' Secret the operator wrote for `rs`: marked with
/// [`ANALYTICS_SECRET_MARK`] and owned by `rs`. No other Secret is ever read, adopted or deleted
/// as the analysts' one.
fn is_analytics_secret(secret: &Secret, rs: &ReportsServer) -> bool {
    let (key, value) = ANALYTICS_SECRET_MARK;
    let marked = secret.labels().get(key).is_some_and(|v| v == value);
    let owned = secret
        .owner_references()
        .iter()
        .any(|o| o.kind == "ReportsServer" && Some(&o.uid) == rs.metadata.uid.as_ref());
    marked && owned
}

fn password_sha256(password: &str) -> String {
    format!("{:x}", Sha256::digest(password.as_bytes()))
}

/// What the spec asks of analysts' access, done as far as this database allows; `None` when it
/// asks nothing and nothing is left to remove. Whether a role may be left to remove is decided
/// from the objects (an analysts' Secret of this ReportsServer exists), never from the previous
/// status, which a reconcile that ended early does not carry.
#[tracing::instrument(name = "analytics_access", level = "debug", skip_all)]
pub(super) async fn converge_analytics(
    rs: &ReportsServer,
    ctx: &Context,
    database: &Database,
) -> Result<Option<Observation>, Error> {
    let enabled = rs.spec.analytics.read_only_role.enabled;
    let docs = "docs/analytics-access.md";
    let name = desired::analytics_secret_name(rs);
    Ok(match (enabled, database) {
        (true, Database::ManagedPostgres(_))
            if desired::reserved_secret_names(rs).contains(&name) =>
        {
            Some(observation(
                false,
                "AnalyticsSecretNameReserved",
                format!(
                    "spec.analytics.readOnlyRole.secretName {name} is a Secret the operator \
                     manages for something else (the database password, TLS or the metrics \
                     token): nothing was done; choose another name or leave it empty for \
                     <name>-analytics"
                ),
            ))
        }
        (true, Database::ManagedPostgres(_)) => Some(grant(rs, ctx).await?),
        (false, Database::ManagedPostgres(_)) => revoke(rs, ctx).await?,
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
/// `Ok` with the password and the annotation [`PASSWORD_APPLIED`].
async fn ensure_secret(
    rs: &ReportsServer,
    ctx: &Context,
) -> Result<Result<(String, Option<String>), Observation>, Error> {
    use rand::distr::{Alphanumeric, SampleString};
    let ns = rs.namespace().unwrap_or_default();
    let name = desired::analytics_secret_name(rs);
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    if let Some(existing) = get_opt(&secrets, &name).await? {
        if !is_analytics_secret(&existing, rs) {
            return Ok(Err(observation(
                false,
                "AnalyticsSecretNotOurs",
                format!(
                    "Secret {ns}/{name} exists but is not the analysts' Secret the operator \
                     wrote for this ReportsServer (label {}={} and owner): it is neither read \
                     nor changed; choose another spec.analytics.readOnlyRole.secretName, or \
                     delete that Secret if it is not needed",
                    ANALYTICS_SECRET_MARK.0, ANALYTICS_SECRET_MARK.1
                ),
            )));
        }
        let applied = existing.annotations().get(PASSWORD_APPLIED).cloned();
        return Ok(secret_str(&existing, "password")
            .map(|p| (p, applied))
            .filter(|(p, _)| !p.is_empty())
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
    let mut labels = desired::labels(rs);
    labels.insert(
        ANALYTICS_SECRET_MARK.0.into(),
        ANALYTICS_SECRET_MARK.1.into(),
    );
    let metadata = serde_json::json!({
        "name": name, "namespace": ns, "labels": labels,
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
            Ok(Ok((password, None)))
        }
        // Created by a reconcile racing this one: its password is the one to use.
        Err(kube::Error::Api(s)) if s.code == 409 => Box::pin(ensure_secret(rs, ctx)).await,
        Err(e) => Err(e.into()),
    }
}

fn fingerprint(statements: &[String], password_sha256: &str) -> u64 {
    let mut h = DefaultHasher::new();
    statements.hash(&mut h);
    password_sha256.hash(&mut h);
    h.finish()
}

/// Runs the grants unless the same ones succeeded less than `--ready-requeue-seconds` ago. The
/// password is sent only when the Secret's annotation [`PASSWORD_APPLIED`] does not match it
/// (a new Secret, a password changed) or the role is missing; then the annotation is written.
async fn grant(rs: &ReportsServer, ctx: &Context) -> Result<Observation, Error> {
    let ns = rs.namespace().unwrap_or_default();
    let secret = desired::analytics_secret_name(rs);
    let (password, applied) = match ensure_secret(rs, ctx).await? {
        Ok(found) => found,
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
    let sha = password_sha256(&password);
    let password_set = applied.as_deref() == Some(sha.as_str());
    let key = ObjectRef::from_obj(rs);
    let print = fingerprint(&analytics::managed_statements(None), &sha);
    if password_set
        && ctx
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
    let mut result = if password_set {
        ctx.sql
            .run(&admin, &analytics::managed_statements(None))
            .await
            .map(|()| false)
    } else {
        Err(ROLE_MISSING.to_string())
    };
    if result.as_ref().is_err_and(|e| e.contains(ROLE_MISSING)) {
        result = ctx
            .sql
            .run(&admin, &analytics::managed_statements(Some(&password)))
            .await
            .map(|()| true);
    }
    match result {
        Ok(sent_password) => {
            tracing::info!(role = ROLE, "the analysts' read-only role is in place");
            if sent_password {
                let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
                let patch =
                    serde_json::json!({"metadata": {"annotations": {PASSWORD_APPLIED: sha}}});
                if let Err(e) = secrets
                    .patch(&secret, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    // The password is sent again at the next reconcile: no harm but a log line.
                    tracing::warn!(error = %e, "could not note the password set on the analysts' Secret");
                    return Ok(ready);
                }
            }
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

/// The option turned off, or never on: when the analysts' Secret of this ReportsServer exists
/// (so the role may), drops the role, then deletes the Secret. The Secret, and the condition
/// `RoleRemovalPending`, stay until the role is dropped. `None` once nothing is left.
async fn revoke(rs: &ReportsServer, ctx: &Context) -> Result<Option<Observation>, Error> {
    ctx.record_analytics(ObjectRef::from_obj(rs), None);
    let ns = rs.namespace().unwrap_or_default();
    let name = desired::analytics_secret_name(rs);
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(_ours) = get_opt(&secrets, &name)
        .await?
        .filter(|s| is_analytics_secret(s, rs))
    else {
        return Ok(None);
    };
    let pending = |why: String| {
        Some(observation(
            false,
            "RoleRemovalPending",
            format!(
                "spec.analytics.readOnlyRole is off, but role {ROLE} is not dropped yet \
                 (retried; Secret {ns}/{name} is kept until it is): {why}"
            ),
        ))
    };
    let Some(admin) = superuser(rs, ctx).await? else {
        return Ok(pending(format!(
            "the password Secret {ns}/{} of the PostgreSQL is missing",
            desired::postgres_name(rs)
        )));
    };
    if let Err(e) = ctx.sql.run(&admin, &analytics::drop_statements(ROLE)).await {
        return Ok(pending(e));
    }
    delete_ignoring_missing(&secrets, &name).await?;
    let note = format!("dropped role {ROLE} and deleted Secret {ns}/{name}");
    ctx.event(rs, EventType::Normal, "AnalyticsRoleRemoved", note)
        .await;
    Ok(None)
}
