//! Parsing of resource paths, query parameters and bodies into validated requests (pure).

use std::collections::HashMap;

use reports_server_crds::{ResourceDescriptor, catalog};
use serde_json::Value;

use super::status::ApiError;
use crate::selector::{FieldSelector, LabelSelector};

/// `/apis/{group}/{version}[/namespaces/{ns}]/{plural}[/{name}]`, resolved.
#[derive(Clone, Debug)]
pub struct ResourcePath {
    pub resource: &'static ResourceDescriptor,
    /// `Some` for namespaced requests; `None` for cluster-scoped kinds or all namespaces.
    pub namespace: Option<String>,
    pub name: Option<String>,
}

impl ResourcePath {
    /// The namespace column value of the addressed object (`""` for cluster scope).
    pub fn object_namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or("")
    }
}

/// Parses the part of the path after `/apis/`.
pub fn parse_path(rest: &str) -> Result<ResourcePath, ApiError> {
    let segments: Vec<&str> = rest.trim_matches('/').split('/').collect();
    let (group, version, tail) = match segments.as_slice() {
        [g, v, tail @ ..] if !tail.is_empty() => (*g, *v, tail),
        _ => return Err(ApiError::path_not_found()),
    };
    let (namespace, tail) = match tail {
        ["namespaces", ns, tail @ ..] if !tail.is_empty() => (Some((*ns).to_owned()), tail),
        _ => (None, tail),
    };
    let (plural, name) = match tail {
        [plural] => (*plural, None),
        [plural, name] => (*plural, Some((*name).to_owned())),
        _ => return Err(ApiError::path_not_found()),
    };
    let resource = catalog::find(group, version, plural).ok_or_else(ApiError::path_not_found)?;
    if namespace.is_some() && !resource.namespaced {
        return Err(ApiError::path_not_found());
    }
    if resource.namespaced && namespace.is_none() && name.is_some() {
        return Err(ApiError::path_not_found());
    }
    if let Some(ns) = &namespace
        && !is_dns_label(ns)
    {
        return Err(ApiError::path_not_found());
    }
    Ok(ResourcePath {
        resource,
        namespace,
        name,
    })
}

/// RFC 1123 label: namespaces.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// RFC 1123 subdomain: object names of these kinds.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        })
}

/// Query parameters of resource requests, validated.
#[derive(Clone, Debug, Default)]
pub struct Params {
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    pub label_selector_raw: String,
    pub field_selector_raw: String,
    pub limit: Option<u64>,
    pub continue_token: Option<String>,
    pub resource_version: Option<String>,
    pub resource_version_match: Option<String>,
    pub timeout_seconds: Option<u64>,
    pub allow_watch_bookmarks: bool,
    pub send_initial_events: Option<bool>,
    pub watch: bool,
    pub include_object: Option<String>,
    pub dry_run: bool,
    pub field_manager: Option<String>,
    pub field_validation: Option<String>,
}

fn boolean(name: &str, v: &str) -> Result<bool, ApiError> {
    match v {
        "true" | "1" | "True" => Ok(true),
        "false" | "0" | "False" | "" => Ok(false),
        _ => Err(ApiError::bad_request(format!(
            "{name}: invalid boolean {v:?}"
        ))),
    }
}

impl Params {
    pub fn parse(query: &HashMap<String, String>) -> Result<Self, ApiError> {
        let mut p = Params::default();
        for (k, v) in query {
            match k.as_str() {
                "labelSelector" => {
                    p.labels = LabelSelector::parse(v)
                        .map_err(|e| ApiError::bad_request(format!("labelSelector: {e}")))?;
                    p.label_selector_raw = v.clone();
                }
                "fieldSelector" => {
                    p.fields = FieldSelector::parse(v)
                        .map_err(|e| ApiError::bad_request(format!("fieldSelector: {e}")))?;
                    p.field_selector_raw = v.clone();
                }
                "limit" => {
                    let n: i64 = v.parse().map_err(|_| {
                        ApiError::bad_request(format!("limit: invalid integer {v:?}"))
                    })?;
                    p.limit = (n > 0).then_some(n as u64);
                }
                "continue" => p.continue_token = Some(v.clone()).filter(|s| !s.is_empty()),
                "resourceVersion" => p.resource_version = Some(v.clone()).filter(|s| !s.is_empty()),
                "resourceVersionMatch" => {
                    if !matches!(v.as_str(), "" | "Exact" | "NotOlderThan") {
                        return Err(ApiError::bad_request(format!(
                            "resourceVersionMatch: unsupported value {v:?} (supported: Exact, NotOlderThan)"
                        )));
                    }
                    p.resource_version_match = Some(v.clone()).filter(|s| !s.is_empty());
                }
                "timeoutSeconds" => {
                    p.timeout_seconds = Some(v.parse().map_err(|_| {
                        ApiError::bad_request(format!("timeoutSeconds: invalid integer {v:?}"))
                    })?)
                }
                "allowWatchBookmarks" => p.allow_watch_bookmarks = boolean(k, v)?,
                "sendInitialEvents" => p.send_initial_events = Some(boolean(k, v)?),
                "watch" => p.watch = boolean(k, v)?,
                "includeObject" => p.include_object = Some(v.clone()),
                "dryRun" => {
                    p.dry_run = match v.as_str() {
                        "All" => true,
                        "" => false,
                        other => {
                            return Err(ApiError::bad_request(format!(
                                "dryRun: unsupported value {other:?} (supported: All)"
                            )));
                        }
                    }
                }
                "fieldManager" => p.field_manager = Some(v.clone()),
                "fieldValidation" => {
                    if !matches!(v.as_str(), "" | "Ignore" | "Warn" | "Strict") {
                        return Err(ApiError::bad_request(format!(
                            "fieldValidation: invalid value {v:?} (supported: Ignore, Warn, Strict)"
                        )));
                    }
                    p.field_validation = Some(v.clone()).filter(|s| !s.is_empty());
                }
                // Accepted and meaningless for these kinds (no pods, no graceful termination).
                "pretty" | "propagationPolicy" | "gracePeriodSeconds" | "orphanDependents"
                | "force" => {}
                _ => {}
            }
        }
        Ok(p)
    }
}

/// Decodes a JSON or YAML request body.
pub fn decode_body(content_type: Option<&str>, body: &[u8]) -> Result<Value, ApiError> {
    let media = content_type
        .unwrap_or("application/json")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match media.as_str() {
        "application/json" | "" => serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}"))),
        "application/yaml" | "application/x-yaml" | "text/yaml" => serde_yaml::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("the request body is not valid YAML: {e}"))),
        other => Err(ApiError::unsupported_media_type(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        let p = parse_path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports/x").unwrap();
        assert_eq!(
            (p.resource.kind, p.namespace.as_deref(), p.name.as_deref()),
            ("PolicyReport", Some("ns"), Some("x"))
        );
        let p = parse_path("wgpolicyk8s.io/v1alpha2/policyreports").unwrap();
        assert!(p.namespace.is_none() && p.name.is_none());
        let p = parse_path("wgpolicyk8s.io/v1alpha2/clusterpolicyreports/x").unwrap();
        assert_eq!(p.name.as_deref(), Some("x"));
        for bad in [
            "wgpolicyk8s.io/v1alpha2/namespaces/ns/clusterpolicyreports",
            "wgpolicyk8s.io/v1alpha2/policyreports/x",
            "wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports/x/status",
            "wgpolicyk8s.io/v1/policyreports",
            "wgpolicyk8s.io/v1alpha2/pods",
            "wgpolicyk8s.io/v1alpha2",
        ] {
            assert!(parse_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names() {
        assert!(is_dns_subdomain("6c737f35-260c-4e4f-8516-61a125c9fb78"));
        assert!(is_dns_subdomain("cpol-disallow-host-path-1"));
        assert!(!is_dns_subdomain("Upper"));
        assert!(!is_dns_subdomain("a..b"));
        assert!(!is_dns_label("a.b"));
    }

    #[test]
    fn params_reject_bad_values() {
        let q = |k: &str, v: &str| HashMap::from([(k.to_owned(), v.to_owned())]);
        assert!(Params::parse(&q("limit", "x")).is_err());
        assert!(Params::parse(&q("dryRun", "Some")).is_err());
        assert!(Params::parse(&q("labelSelector", "a in")).is_err());
        assert!(Params::parse(&q("resourceVersionMatch", "Newest")).is_err());
        assert!(Params::parse(&q("watch", "1")).unwrap().watch);
        assert_eq!(Params::parse(&q("limit", "0")).unwrap().limit, None);
    }
}
