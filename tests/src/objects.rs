//! Small accessors the API-level tests share: what they read off objects, lists and errors.

use kube::api::{Api, DynamicObject, ListParams};

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
