//! The generated CA and serving certificate of an in-cluster installation.
//!
//! Why this shape: the CA lives ten years and is what the APIServices trust (`caBundle`); the
//! serving certificate lives one year and is renewed when less than a third of its life is
//! left. Renewal keeps the CA, so the `caBundle` does not change and kube-apiserver trusts both
//! the old and the new serving certificate while the pods pick up the new Secret: no request
//! fails during rotation. Pure functions; the reconciler stores the results in Secrets.

use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// Lifetime of the generated CA.
pub const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Lifetime of a serving certificate.
pub const SERVING_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);

/// TLS errors.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("the certificate is not valid PEM/X.509: {0}")]
    Parse(String),
}

/// A certificate and its key, PEM.
#[derive(Clone, Debug, PartialEq)]
pub struct Pair {
    pub cert_pem: String,
    pub key_pem: String,
}

fn validity(params: &mut CertificateParams, lifetime: Duration) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + lifetime;
}

/// A new CA named after the installation.
pub fn new_ca(common_name: &str) -> Result<Pair, TlsError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut params, CA_LIFETIME);
    let cert = params.self_signed(&key)?;
    Ok(Pair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A serving certificate for `names`, signed by `ca`.
pub fn new_serving(ca: &Pair, names: &[String]) -> Result<Pair, TlsError> {
    let ca_key = KeyPair::from_pem(&ca.key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        names.first().cloned().unwrap_or_default(),
    );
    params.distinguished_name = dn;
    params.subject_alt_names = names
        .iter()
        .map(|n| Ok(SanType::DnsName(n.clone().try_into()?)))
        .collect::<Result<_, rcgen::Error>>()?;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    validity(&mut params, SERVING_LIFETIME);
    let cert = params.signed_by(&key, &issuer)?;
    Ok(Pair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Expiry (seconds since the epoch) and DNS names of a PEM certificate.
pub fn inspect(cert_pem: &str) -> Result<(i64, Vec<String>), TlsError> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .map_err(|e| TlsError::Parse(e.to_string()))?;
    let cert = pem
        .parse_x509()
        .map_err(|e| TlsError::Parse(e.to_string()))?;
    let names = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    x509_parser::extensions::GeneralName::DNSName(d) => Some(d.to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    Ok((cert.validity().not_after.timestamp(), names))
}

/// Whether a serving certificate must be replaced: unreadable, missing a name, or with less
/// than a third of [`SERVING_LIFETIME`] left at `now` (seconds since the epoch).
pub fn needs_renewal(cert_pem: &str, names: &[String], now: i64) -> bool {
    match inspect(cert_pem) {
        Ok((not_after, have)) => {
            let margin = (SERVING_LIFETIME.as_secs() / 3) as i64;
            not_after - now < margin || names.iter().any(|n| !have.contains(n))
        }
        Err(_) => true,
    }
}

/// The DNS names of the serving certificate for Service `svc` in `ns`.
pub fn serving_names(svc: &str, ns: &str) -> Vec<String> {
    vec![
        format!("{svc}.{ns}.svc"),
        format!("{svc}.{ns}.svc.cluster.local"),
        format!("{svc}.{ns}"),
        svc.to_string(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_certificate_is_renewed_a_third_before_expiry_or_when_names_change() {
        let ca = new_ca("test-ca").unwrap();
        let names = serving_names("rs", "reports");
        let serving = new_serving(&ca, &names).unwrap();
        let (not_after, have) = inspect(&serving.cert_pem).unwrap();
        assert_eq!(have, names);
        let now = chrono::Utc::now().timestamp();
        assert!(!needs_renewal(&serving.cert_pem, &names, now));
        let late = not_after - (SERVING_LIFETIME.as_secs() / 3) as i64 + 60;
        assert!(needs_renewal(&serving.cert_pem, &names, late));
        assert!(needs_renewal(
            &serving.cert_pem,
            &serving_names("other", "reports"),
            now
        ));
        assert!(needs_renewal("garbage", &names, now));
    }
}
