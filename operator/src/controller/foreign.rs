//! ReportsServers outside the namespace the operator manages (`--watch-namespace`).
//!
//! Why a notice and not a reconcile: the operator's rights to write Secrets, workloads and Roles
//! are a Role in its own namespace, so that creating a ReportsServer anywhere else cannot start
//! a pod with the server's cluster-wide rights. Such an object is left alone, but not silently:
//! it gets one Warning Event saying which namespace this operator manages.

use std::collections::HashSet;
use std::sync::Arc;

use futures::StreamExt;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::events::EventType;
use kube::runtime::watcher::{self, Event};
use reports_server_crds::reportsserver::ReportsServer;
use tokio_util::sync::CancellationToken;

use super::Context;

/// The Event's reason.
pub const NOT_RECONCILED: &str = "NotReconciled";

/// Watches ReportsServers in every namespace until `stop` and publishes [`NOT_RECONCILED`] once
/// per live object (by UID) outside `managed`.
pub(super) async fn run(ctx: Arc<Context>, managed: String, stop: CancellationToken) {
    let api: Api<ReportsServer> = Api::all(ctx.client.clone());
    // The managed namespace is the controller's; kube-apiserver leaves it out of this watch.
    let elsewhere = watcher::Config::default().fields(&format!("metadata.namespace!={managed}"));
    let mut events = watcher::watcher(api, elsewhere).default_backoff().boxed();
    let mut told: HashSet<String> = HashSet::new();
    loop {
        let event = tokio::select! {
            _ = stop.cancelled() => return,
            event = events.next() => event,
        };
        let rs = match event {
            None => return,
            Some(Ok(Event::Apply(rs) | Event::InitApply(rs))) => rs,
            // Forgotten once gone, so the set holds only live objects.
            Some(Ok(Event::Delete(rs))) => {
                told.remove(&rs.uid().unwrap_or_default());
                continue;
            }
            Some(Ok(_)) => continue,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "watching ReportsServers in every namespace");
                continue;
            }
        };
        let namespace = rs.namespace().unwrap_or_default();
        let uid = rs.uid().unwrap_or_default();
        if rs.metadata.deletion_timestamp.is_some() || !told.insert(uid) {
            continue;
        }
        tracing::warn!(namespace, reports_server = %rs.name_any(), managed, "a ReportsServer outside the managed namespace is not reconciled");
        let note = format!(
            "not reconciled: this operator manages ReportsServers in namespace {managed} only (its rights to install a server are a Role there); create it in {managed}, or run an operator for namespace {namespace}"
        );
        ctx.event(&rs, EventType::Warning, NOT_RECONCILED, note)
            .await;
    }
}
