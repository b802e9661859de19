//! Small accessors the API-level tests share: what they read off objects, lists and errors.

use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use reports_server_crds::catalog::ResourceDescriptor;

/// A served kind as kube-rs's dynamic API wants it.
pub fn api_resource(kind: &ResourceDescriptor) -> ApiResource {
    ApiResource {
        group: kind.group.into(),
        version: kind.version.into(),
        api_version: kind.api_version(),
        kind: kind.kind.into(),
        plural: kind.plural.into(),
    }
}

/// An object's resourceVersion as the number the server promises it is.
pub fn rv_of(o: &DynamicObject) -> u64 {
    o.metadata
        .resource_version
        .as_deref()
        .expect("resourceVersion")
        .parse()
        .expect("numeric resourceVersion")
}

/// An object's name (empty when it has none).
pub fn name_of(o: &DynamicObject) -> String {
    o.metadata.name.clone().unwrap_or_default()
}

/// The list resourceVersion of a kind: what a client treats as "now".
pub async fn list_rv(api: &Api<DynamicObject>) -> u64 {
    api.list(&ListParams::default().limit(1))
        .await
        .expect("list")
        .metadata
        .resource_version
        .expect("list resourceVersion")
        .parse()
        .expect("numeric list resourceVersion")
}

/// The (code, reason) of an API error; panics on any other error.
pub fn api_error(e: kube::Error) -> (u16, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.reason),
        other => panic!("expected an API error, got {other}"),
    }
}
