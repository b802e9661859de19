//! Parsing of resource paths, query parameters and bodies into validated requests (pure).

use std::collections::HashMap;

use axum::http::Method;
use reports_server_crds::catalog;
use serde_json::Value;

use super::status::ApiError;
use crate::auth::Attributes;
use crate::registry::{ListOptions, ResourceRef, is_dns_label};
use crate::selector::{FieldSelector, LabelSelector};

/// The Kubernetes verb of a resource request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
    DeleteCollection,
}

impl Verb {
    /// The verb from the method, whether the path names an object, and `?watch`.
    fn resolve(method: &Method, has_name: bool, watch: bool) -> Option<Verb> {
        Some(match (method.as_str(), has_name) {
            ("GET", _) if watch => Verb::Watch,
            ("GET", true) => Verb::Get,
            ("GET", false) => Verb::List,
            ("POST", false) => Verb::Create,
            ("PUT", true) => Verb::Update,
            ("PATCH", true) => Verb::Patch,
            ("DELETE", true) => Verb::Delete,
            ("DELETE", false) => Verb::DeleteCollection,
            _ => return None,
        })
    }

    /// Whether the verb changes stored objects.
    pub fn is_write(self) -> bool {
        !matches!(self, Verb::Get | Verb::List | Verb::Watch)
    }

    /// The verb as authorization and metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
            Verb::DeleteCollection => "deletecollection",
        }
    }

    /// Whether the request carries a body to read.
    pub fn has_body(self) -> bool {
        matches!(
            self,
            Verb::Create | Verb::Update | Verb::Patch | Verb::Delete | Verb::DeleteCollection
        )
    }
}

/// A resource request resolved once, as kube-apiserver's `RequestInfoResolver` does:
/// `/apis/{group}/{version}[/namespaces/{ns}]/{plural}[/{name}[/{subresource}]]` plus the
/// method and `?watch`. Authorization, metrics, the request span and the handlers all read it.
#[derive(Clone, Debug)]
pub struct RequestInfo {
    pub verb: Verb,
    pub resource: ResourceRef,
    pub name: Option<String>,
    /// No served kind has subresources; a request for one is answered 404 while resolving.
    pub subresource: Option<String>,
}

impl RequestInfo {
    /// Resolves the part of the path after `/apis/`, the method and the parsed parameters.
    pub fn resolve(method: &Method, rest: &str, params: &Params) -> Result<Self, ApiError> {
        let (resource, name, subresource) = parse_path(rest)?;
        if subresource.is_some() {
            return Err(ApiError::path_not_found());
        }
        let verb = Verb::resolve(method, name.is_some(), params.watch).ok_or_else(|| {
            ApiError::method_not_allowed(format!(
                "the server does not allow this method on the requested resource ({method})"
            ))
        })?;
        Ok(RequestInfo {
            verb,
            resource,
            name,
            subresource,
        })
    }

    /// What the authorizer is asked.
    pub fn attributes(&self) -> Attributes {
        let desc = self.resource.resource;
        Attributes {
            verb: self.verb.as_str().into(),
            group: desc.group.into(),
            version: desc.version.into(),
            resource: desc.plural.into(),
            namespace: self.resource.namespace.clone(),
            name: self.name.clone(),
            path: None,
        }
    }
}

/// Splits the part of the path after `/apis/` into the collection, the object name and the
/// subresource; unknown kinds, wrong scopes and invalid namespaces are 404s.
fn parse_path(rest: &str) -> Result<(ResourceRef, Option<String>, Option<String>), ApiError> {
    let segments: Vec<&str> = rest.trim_matches('/').split('/').collect();
    let (group, version, tail) = match segments.as_slice() {
        [g, v, tail @ ..] if !tail.is_empty() => (*g, *v, tail),
        _ => return Err(ApiError::path_not_found()),
    };
    let (namespace, tail) = match tail {
        ["namespaces", ns, tail @ ..] if !tail.is_empty() => (Some((*ns).to_owned()), tail),
        _ => (None, tail),
    };
    let (plural, name, subresource) = match tail {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some((*name).to_owned()), None),
        [plural, name, sub] => (*plural, Some((*name).to_owned()), Some((*sub).to_owned())),
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
    Ok((
        ResourceRef {
            resource,
            namespace,
        },
        name,
        subresource,
    ))
}

/// The largest page a list returns; a larger `limit` is clamped to it.
pub const MAX_LIST_LIMIT: i64 = 1_000_000;

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

/// The spellings of `true` a boolean query parameter accepts.
pub(crate) fn is_true(v: &str) -> bool {
    matches!(v, "true" | "1" | "True")
}

fn boolean(name: &str, v: &str) -> Result<bool, ApiError> {
    match v {
        v if is_true(v) => Ok(true),
        "false" | "0" | "False" | "" => Ok(false),
        _ => Err(ApiError::bad_request(format!(
            "{name}: invalid boolean {v:?}"
        ))),
    }
}

impl Params {
    /// The list part of the parameters (also the selection of a deletecollection).
    pub fn list_options(&self) -> ListOptions {
        ListOptions {
            labels: self.labels.clone(),
            fields: self.fields.clone(),
            limit: self.limit,
            continue_token: self.continue_token.clone(),
            resource_version: self.resource_version.clone(),
            resource_version_match: self.resource_version_match.clone(),
        }
    }

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
                    // The server may always return fewer items than asked (with a continue
                    // token); beyond this no page is meaningful and the SQL binding overflows.
                    p.limit = (n > 0).then_some(n.min(MAX_LIST_LIMIT) as u64);
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
    decode_body_noting_duplicates(content_type, body).map(|(value, _)| value)
}

/// [`decode_body`], with the paths of the keys a JSON body repeats (for `fieldValidation`;
/// found in the same pass; YAML bodies report none).
pub fn decode_body_noting_duplicates(
    content_type: Option<&str>,
    body: &[u8],
) -> Result<(Value, Vec<String>), ApiError> {
    let media = content_type
        .unwrap_or("application/json")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match media.as_str() {
        "application/json" | "" => crate::registry::fields::parse_noting_duplicates(body)
            .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}"))),
        "application/yaml" | "application/x-yaml" | "text/yaml" => {
            crate::registry::fields::parse_yaml(body)
                .map(|value| (value, Vec::new()))
                .map_err(|e| {
                    ApiError::bad_request(format!("the request body is not valid YAML: {e}"))
                })
        }
        other => Err(ApiError::unsupported_media_type(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        let (r, name, _) =
            parse_path("wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports/x").unwrap();
        assert_eq!(
            (r.resource.kind, r.namespace.as_deref(), name.as_deref()),
            ("PolicyReport", Some("ns"), Some("x"))
        );
        let (r, name, _) = parse_path("wgpolicyk8s.io/v1alpha2/policyreports").unwrap();
        assert!(r.namespace.is_none() && name.is_none());
        let (_, name, _) = parse_path("wgpolicyk8s.io/v1alpha2/clusterpolicyreports/x").unwrap();
        assert_eq!(name.as_deref(), Some("x"));
        for bad in [
            "wgpolicyk8s.io/v1alpha2/namespaces/ns/clusterpolicyreports",
            "wgpolicyk8s.io/v1alpha2/policyreports/x",
            "wgpolicyk8s.io/v1/policyreports",
            "wgpolicyk8s.io/v1alpha2/pods",
            "wgpolicyk8s.io/v1alpha2",
        ] {
            assert!(parse_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn request_info() {
        let params = Params::default();
        let resolve = |m: Method, rest: &str| RequestInfo::resolve(&m, rest, &params);
        let collection = "wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports";
        let object = "wgpolicyk8s.io/v1alpha2/namespaces/ns/policyreports/x";
        assert_eq!(resolve(Method::GET, collection).unwrap().verb, Verb::List);
        assert_eq!(resolve(Method::GET, object).unwrap().verb, Verb::Get);
        assert_eq!(
            resolve(Method::POST, collection).unwrap().verb,
            Verb::Create
        );
        assert_eq!(
            resolve(Method::DELETE, collection).unwrap().verb,
            Verb::DeleteCollection
        );
        assert_eq!(
            resolve(Method::PUT, collection).unwrap_err().code.as_u16(),
            405
        );
        assert_eq!(
            resolve(Method::POST, object).unwrap_err().code.as_u16(),
            405
        );
        // Subresources resolve, and none is served.
        assert_eq!(
            resolve(Method::GET, &format!("{object}/status"))
                .unwrap_err()
                .code
                .as_u16(),
            404
        );
        let watch = Params {
            watch: true,
            ..Default::default()
        };
        let info = RequestInfo::resolve(&Method::GET, object, &watch).unwrap();
        assert_eq!(info.verb, Verb::Watch);
        let attributes = info.attributes();
        assert_eq!(
            (
                attributes.verb.as_str(),
                attributes.resource.as_str(),
                attributes.name.as_deref()
            ),
            ("watch", "policyreports", Some("x"))
        );
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
