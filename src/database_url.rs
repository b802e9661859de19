//! The database URL from the peer's environment variables (`DB_HOST`, `DB_PORT`, `DB_DATABASE`,
//! `DB_USER`, `DB_PASSWORD`, as kyverno/reports-server's chart sets them), so a user switching
//! from the peer keeps their Secret. Each part is percent-encoded: a password with `@`, `/`, `:`
//! or `#` would otherwise change which host or database the URL names.

use std::path::Path;

/// The database a command names: its `--database-url`, else the peer's variables; `None` means
/// the embedded SQLite file ([`embedded_sqlite`]), as `serve` uses without either.
pub fn named(flag: Option<&str>, var: impl Fn(&str) -> Option<String>) -> Option<String> {
    flag.map(str::to_owned).or_else(|| from_peer_variables(var))
}

/// The file `reports.db` in `data_dir`: `serve`'s database without flags (created if absent).
pub fn embedded_sqlite(data_dir: &Path) -> String {
    format!(
        "sqlite://{}?mode=rwc",
        data_dir.join("reports.db").display()
    )
}

/// `postgres://user:password@host:port/database`, or `None` when `DB_HOST` is unset.
pub fn from_peer_variables(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    let host = var("DB_HOST")?;
    let or = |name: &str, default: &str| var(name).unwrap_or_else(|| default.to_owned());
    // An IPv6 address is written in brackets in a URL.
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host
    };
    Some(format!(
        "postgres://{}:{}@{host}:{}/{}",
        encode(&or("DB_USER", "postgres")),
        encode(&or("DB_PASSWORD", "")),
        encode(&or("DB_PORT", "5432")),
        encode(&or("DB_DATABASE", "reportsdb"))
    ))
}

/// RFC 3986 percent-encoding of everything but the unreserved characters.
fn encode(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for byte in part.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn every_part_is_encoded_so_the_url_names_the_intended_host() {
        let url = from_peer_variables(vars(&[
            ("DB_HOST", "db.example"),
            ("DB_USER", "report user"),
            ("DB_PASSWORD", "p@ss:w/rd#?%"),
            ("DB_DATABASE", "reports"),
        ]))
        .unwrap();
        assert_eq!(
            url,
            "postgres://report%20user:p%40ss%3Aw%2Frd%23%3F%25@db.example:5432/reports"
        );
    }

    #[test]
    fn defaults_ipv6_and_no_host() {
        assert_eq!(from_peer_variables(vars(&[])), None);
        assert_eq!(
            from_peer_variables(vars(&[("DB_HOST", "::1")])).unwrap(),
            "postgres://postgres:@[::1]:5432/reportsdb"
        );
    }
}
