//! A small discovery cache: which resources a group/version serves, refreshed after a while so
//! that CRDs installed or removed later are noticed, without one discovery request per lookup.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use kube::Client;
use kube::api::ApiResource;
use kube::discovery::{ApiCapabilities, Scope};
use tokio::time::Instant;

use super::resources::is_not_found;

/// How long a group/version's resource list is trusted.
pub const DEFAULT_TTL: Duration = Duration::from_secs(60);

/// A served resource.
#[derive(Clone, Debug)]
pub struct Served {
    pub resource: ApiResource,
    pub namespaced: bool,
}

/// What to look up in a group/version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// By plural resource name (`pods`), as the `audit.kyverno.io/resource.gvr` label says.
    Resource(String),
    /// By kind (`Pod`), as the `audit.kyverno.io/resource.kind` label says.
    Kind(String),
}

type Entry = (Instant, Option<Vec<Served>>);

/// Resources per group/version, each entry kept for a TTL. `None` entries record a group/version
/// the server does not serve.
pub struct DiscoveryCache {
    client: Client,
    ttl: Duration,
    entries: Mutex<HashMap<(String, String), Entry>>,
}

impl DiscoveryCache {
    pub fn new(client: Client, ttl: Duration) -> Self {
        DiscoveryCache {
            client,
            ttl,
            entries: Mutex::new(HashMap::new()),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn group_version(
        &self,
        group: &str,
        version: &str,
    ) -> Result<Option<Vec<Served>>, kube::Error> {
        let key = (group.to_owned(), version.to_owned());
        if let Some((at, served)) = self.entries().get(&key)
            && at.elapsed() < self.ttl
        {
            return Ok(served.clone());
        }
        let gv = kube::core::GroupVersion::gv(group, version);
        let served = match kube::discovery::pinned_group(&self.client, &gv).await {
            Ok(g) => Some(
                g.versioned_resources(version)
                    .into_iter()
                    .map(|(resource, caps): (ApiResource, ApiCapabilities)| Served {
                        resource,
                        namespaced: caps.scope == Scope::Namespaced,
                    })
                    .collect(),
            ),
            Err(e) if is_not_found(&e) => None,
            Err(e) => return Err(e),
        };
        self.entries().insert(key, (Instant::now(), served.clone()));
        Ok(served)
    }

    /// The resource `target` in `group`/`version`; `None` when the server does not serve it.
    pub async fn resolve(
        &self,
        group: &str,
        version: &str,
        target: &Target,
    ) -> Result<Option<Served>, kube::Error> {
        let Some(served) = self.group_version(group, version).await? else {
            return Ok(None);
        };
        Ok(served.into_iter().find(|s| match target {
            Target::Resource(plural) => s.resource.plural == *plural,
            Target::Kind(kind) => s.resource.kind == *kind,
        }))
    }
}
