//! The serving certificate and the CA the APIServices trust: generated and renewed by the
//! operator (`crate::tls` decides), or taken from the user's Secret in external mode.

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::events::EventType;
use reports_server_crds::reportsserver::{ReportsServer, ReportsServerStatus};
use serde_json::json;

use crate::desired::{self, Database, Tls};
use crate::status::Outcome;
use crate::tls;

use super::database::secret_key;
use super::kube_io::{apply, get_opt, owner_reference, secret_str};
use super::{Context, Error};

/// TLS of an in-cluster installation: the user's Secret, or the generated CA and a serving
/// certificate renewed before expiry. Returns the TLS for the builders and the expiry.
pub(super) async fn ensure_tls(
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

pub(super) fn rfc3339(secs: i64) -> String {
    chrono::DateTime::from_timestamp(secs, 0)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_default()
}

/// The external server's CA PEM from `spec.external`.
pub(super) async fn external_ca(
    ctx: &Context,
    rs: &ReportsServer,
) -> Result<Result<String, Outcome>, Error> {
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

/// The TLS material of a reconcile: what the operator issues (`None` in external mode) and
/// the CA the APIServices trust.
pub(super) type TlsFacts = (Option<Tls>, Option<String>);

/// The serving certificate the operator issues (recording its expiry), or the external
/// server's CA.
#[tracing::instrument(name = "prepare_tls", level = "debug", skip_all)]
pub(super) async fn prepare_tls(
    rs: &ReportsServer,
    ctx: &Context,
    database: &Database,
    status: &mut ReportsServerStatus,
) -> Result<Result<TlsFacts, Outcome>, Error> {
    tracing::debug!("the serving certificate and the CA the APIServices trust");
    if *database == Database::External {
        return Ok(external_ca(ctx, rs).await?.map(|pem| (None, Some(pem))));
    }
    Ok(ensure_tls(ctx, rs).await?.map(|(tls, not_after)| {
        status.certificate_not_after = not_after;
        (Some(tls), None)
    }))
}
