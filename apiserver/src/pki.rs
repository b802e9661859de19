//! Standalone-mode PKI: a CA, a serving certificate for the bind address and `localhost`, an
//! admin client certificate, and a kubeconfig that uses them. Created on first start in the
//! data directory and reused afterwards, so a kubeconfig keeps working across restarts.
//!
//! Behind kube-apiserver the same serving-certificate code issues a certificate for
//! `<service>.<namespace>.svc` whose CA goes into the APIServices' `caBundle`.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("cannot write {0}: {1}")]
    Write(PathBuf, std::io::Error),
    #[error("cannot read {0}: {1}")]
    Read(PathBuf, std::io::Error),
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("{0} is not a usable PEM file; delete it to have a new one generated")]
    Invalid(PathBuf),
}

/// PEM-encoded certificate and key.
#[derive(Clone, Debug)]
pub struct CertPair {
    pub cert_pem: String,
    pub key_pem: String,
}

/// The files of a standalone installation.
#[derive(Clone, Debug)]
pub struct StandalonePki {
    pub dir: PathBuf,
    pub ca: CertPair,
    pub serving: CertPair,
    pub admin: CertPair,
}

impl StandalonePki {
    pub fn ca_path(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
}

/// Writes through a temporary file renamed over `path`: a reader (kubectl, a script waiting
/// for the kubeconfig to appear) never sees a half-written file, and keys and the kubeconfig
/// are created 0600 instead of being readable until a later chmod.
fn write_private(path: &Path, contents: &str) -> Result<(), PkiError> {
    use std::io::Write as _;
    let fail = |e: std::io::Error| PkiError::Write(path.to_owned(), e);
    let file_name = path
        .file_name()
        .ok_or_else(|| fail(std::io::Error::other("the path has no file name")))?;
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        if path.extension().is_some_and(|e| e == "key")
            || path.file_name().is_some_and(|n| n == "kubeconfig")
        {
            options.mode(0o600);
        }
    }
    let mut file = options.open(&tmp).map_err(fail)?;
    file.write_all(contents.as_bytes()).map_err(fail)?;
    file.sync_all().map_err(fail)?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(fail)
}

fn read(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|e| PkiError::Read(path.to_owned(), e))
}

fn distinguished(common_name: &str, organization: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    if let Some(o) = organization {
        dn.push(DnType::OrganizationName, o);
    }
    dn
}

/// Creates a self-signed CA.
pub fn new_ca(common_name: &str) -> Result<CertPair, PkiError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = distinguished(common_name, None);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_after = rcgen::date_time_ymd(2036, 1, 1);
    let cert = params.self_signed(&key)?;
    Ok(CertPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

fn issuer(ca: &CertPair) -> Result<Issuer<'static, KeyPair>, PkiError> {
    let key = KeyPair::from_pem(&ca.key_pem)?;
    Ok(Issuer::from_ca_cert_pem(&ca.cert_pem, key)?)
}

/// Issues a serving certificate for the given DNS names and IP addresses.
pub fn issue_serving(ca: &CertPair, names: &[String]) -> Result<CertPair, PkiError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = distinguished(
        names
            .first()
            .map(String::as_str)
            .unwrap_or("reports-server"),
        None,
    );
    params.subject_alt_names = names
        .iter()
        .map(|n| match n.parse::<std::net::IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => Ok(SanType::DnsName(n.as_str().try_into()?)),
        })
        .collect::<Result<_, rcgen::Error>>()?;
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.not_after = rcgen::date_time_ymd(2035, 1, 1);
    let cert = params.signed_by(&key, &issuer(ca)?)?;
    Ok(CertPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Issues a client certificate: user = CN, groups = O (one per group).
pub fn issue_client(ca: &CertPair, user: &str, groups: &[&str]) -> Result<CertPair, PkiError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    let mut dn = distinguished(user, None);
    for g in groups {
        dn.push(DnType::OrganizationName, *g);
    }
    params.distinguished_name = dn;
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.not_after = rcgen::date_time_ymd(2035, 1, 1);
    let cert = params.signed_by(&key, &issuer(ca)?)?;
    Ok(CertPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

fn load_or_create(
    dir: &Path,
    stem: &str,
    create: impl FnOnce() -> Result<CertPair, PkiError>,
) -> Result<CertPair, PkiError> {
    let (crt, key) = (
        dir.join(format!("{stem}.crt")),
        dir.join(format!("{stem}.key")),
    );
    if crt.exists() && key.exists() {
        let pair = CertPair {
            cert_pem: read(&crt)?,
            key_pem: read(&key)?,
        };
        if !pair.cert_pem.contains("BEGIN CERTIFICATE") {
            return Err(PkiError::Invalid(crt));
        }
        return Ok(pair);
    }
    let pair = create()?;
    write_private(&crt, &pair.cert_pem)?;
    write_private(&key, &pair.key_pem)?;
    Ok(pair)
}

impl StandalonePki {
    /// Loads the PKI from `dir`, creating whatever is missing. The serving certificate covers
    /// `localhost`, `127.0.0.1`, `::1` and `extra_names`; it is re-issued when those change.
    pub fn load_or_create(dir: &Path, extra_names: &[String]) -> Result<Self, PkiError> {
        std::fs::create_dir_all(dir).map_err(|e| PkiError::Write(dir.to_owned(), e))?;
        let ca = load_or_create(dir, "ca", || new_ca("reports-server-ca"))?;
        let mut names = vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
        ];
        for n in extra_names {
            if !names.contains(n) && n != "0.0.0.0" && n != "::" {
                names.push(n.clone());
            }
        }
        let names_file = dir.join("serving.names");
        let wanted = names.join(",");
        if std::fs::read_to_string(&names_file).ok().as_deref() != Some(wanted.as_str()) {
            let _ = std::fs::remove_file(dir.join("serving.crt"));
        }
        let serving = load_or_create(dir, "serving", || issue_serving(&ca, &names))?;
        write_private(&names_file, &wanted)?;
        let admin = load_or_create(dir, "admin", || {
            issue_client(&ca, "admin", &["system:masters"])
        })?;
        Ok(StandalonePki {
            dir: dir.to_owned(),
            ca,
            serving,
            admin,
        })
    }

    /// A kubeconfig for `server` that authenticates with `client`.
    pub fn kubeconfig(&self, server: &str, client: &CertPair, context: &str) -> String {
        use base64::Engine;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: {context}\n  cluster:\n    server: {server}\n    certificate-authority-data: {}\nusers:\n- name: {context}\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\ncontexts:\n- name: {context}\n  context:\n    cluster: {context}\n    user: {context}\ncurrent-context: {context}\n",
            b64(&self.ca.cert_pem),
            b64(&client.cert_pem),
            b64(&client.key_pem)
        )
    }

    /// Writes the admin kubeconfig to `path` (mode 0600).
    pub fn write_kubeconfig(&self, path: &Path, server: &str) -> Result<(), PkiError> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| PkiError::Write(parent.to_owned(), e))?;
        }
        write_private(
            path,
            &self.kubeconfig(server, &self.admin, "reports-server"),
        )
    }
}
