//! What background workers need of the whole store, beside the per-object verbs: the
//! resourceVersion counter, the version floor a migration raises, scans of every stored object
//! in key order, and an election lease in the database.
//!
//! Why here and not on the store: a worker holds a [`Registry`] and nothing below it, so the
//! layering test can forbid `store::` outside the server's own crate, and every such operation
//! is one place to read when the store changes.

use futures::FutureExt;
use reports_server_crds::ResourceDescriptor;

use super::{DatabaseHealth, Registry, RegistryError};
use crate::store::ListQuery;
use crate::store::lease::StoreLease;

/// One stored object as a scan visits it.
pub struct Scanned<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    /// The stored JSON (only `metadata` when the scan asked for metadata only).
    pub body: &'a str,
}

/// Objects a scan reads per query: large enough that a scan of a million objects is a
/// thousand queries, small enough that one page's bodies stay a few megabytes.
const SCAN_PAGE: u64 = 1000;

// The store's futures are type-erased (`boxed`) here: the migration worker's future would
// otherwise nest sqlx's futures deeper than the compiler's `Send` check follows.
impl Registry {
    /// The database's health as the store's probe sees it (the circuit the HTTP layer
    /// consults before each data request).
    pub fn health(&self) -> &DatabaseHealth {
        self.store.health()
    }

    /// `(current resourceVersion, oldest resourceVersion a watch may resume from)`.
    pub async fn versions(&self) -> Result<(i64, i64), RegistryError> {
        Ok(FutureExt::boxed(self.store.versions()).await?)
    }

    /// Raises the resourceVersion counter and the watch horizon to at least `floor`; answers
    /// the new `versions()`.
    pub async fn raise_version_floor(&self, floor: i64) -> Result<(i64, i64), RegistryError> {
        Ok(FutureExt::boxed(self.store.raise_version_floor(floor)).await?)
    }

    /// Visits every stored object of `resource` in key order (namespace, name), one page at a
    /// time; stops at the first error `visit` returns.
    pub async fn scan<E: From<RegistryError>>(
        &self,
        resource: &'static ResourceDescriptor,
        metadata_only: bool,
        mut visit: impl FnMut(Scanned<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut after = None;
        loop {
            let query = ListQuery {
                resource,
                namespace: None,
                labels: Default::default(),
                fields: Default::default(),
                limit: Some(SCAN_PAGE),
                after: after.take(),
                metadata_only,
            };
            let page = FutureExt::boxed(self.store.list(&query))
                .await
                .map_err(RegistryError::from)?;
            for row in &page.rows {
                visit(Scanned {
                    namespace: &row.namespace,
                    name: &row.name,
                    body: &row.body,
                })?;
            }
            match page.rows.last() {
                Some(last) if page.more => {
                    after = Some((last.namespace.clone(), last.name.clone()));
                }
                _ => return Ok(()),
            }
        }
    }

    /// The database row that elects one holder of `purpose` among the processes sharing this
    /// database (the lease name carries the cluster id, so two clusters on one database do not
    /// share it).
    pub fn lease(&self, purpose: &str, holder: String) -> StoreLease {
        StoreLease::new(
            self.store.clone(),
            format!("{purpose}/{}", self.store.cluster_id()),
            holder,
        )
    }
}
