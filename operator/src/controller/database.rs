//! The database facts a reconcile needs: keys of the user's Secret checked before anything
//! is applied, and the generated password of the operator-managed PostgreSQL.

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::events::EventType;
use reports_server_crds::reportsserver::{DatabaseStatus, ReportsServer, ReportsServerStatus};
use serde_json::json;

use crate::desired::{self, Database};
use crate::status::Outcome;

use super::kube_io::{get_opt, owner_reference, secret_str};
use super::{Context, Error};

/// Checks a key of a Secret: `Err(outcome)` names the Secret, the key and the spec field.
pub(super) async fn secret_key(
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
pub(super) async fn check_external_postgres(
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
pub(super) async fn ensure_postgres_password(
    ctx: &Context,
    rs: &ReportsServer,
) -> Result<(), kube::Error> {
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

/// The database the spec names, checked as far as the operator can (the external Secret, the
/// managed database's password); `Err` with the outcome when the user must fix something.
#[tracing::instrument(name = "prepare_database", level = "debug", skip_all)]
pub(super) async fn prepare_database(
    rs: &ReportsServer,
    ctx: &Context,
    status: &mut ReportsServerStatus,
) -> Result<Result<Database, Outcome>, Error> {
    tracing::debug!("the database facts: Secret keys checked, the managed password ensured");
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
