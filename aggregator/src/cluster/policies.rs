//! The live policy set, from watches on every policy kind the cluster serves.
//!
//! Discovery (repeated every minute, so that a CRD installed or removed later is noticed) says
//! which of [`POLICY_KINDS`] exist; each one gets a watcher on dynamic objects. A kind counts as
//! *known* only once its watcher delivered a complete initial list. Until then — and for kinds
//! whose CRD is missing or whose watch is refused — the kind is marked unknown in the
//! [`PolicySet`], so no result of that kind is dropped: a partial view must never delete
//! results. The set is rebuilt with [`PolicySet::insert_value`], the same parser offline mode
//! uses (rule names, autogen expansion, the `reports.kyverno.io/disabled` label).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::Instrument;

use futures::StreamExt;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::discovery::{ApiGroup, Discovery};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::metrics::ClusterMetrics;
use super::resources::to_value;
use crate::policy::{POLICY_KINDS, PolicyKind, PolicySet};

/// How often discovery is repeated.
pub const DEFAULT_REDISCOVERY: Duration = Duration::from_secs(60);

type Objects = BTreeMap<(String, String), Value>;

/// What is known about one policy kind.
#[derive(Clone, Debug, Default)]
pub enum KindState {
    /// Not discovered yet, or discovered and its initial list not complete (or failing).
    #[default]
    Pending,
    /// The cluster does not serve the kind.
    Absent,
    /// The complete set of its objects.
    Synced(Objects),
}

/// Builds the policy set from the state of every kind. Returns the set and the number of kinds
/// marked unknown.
pub fn build(kinds: &BTreeMap<PolicyKind, KindState>) -> (PolicySet, usize) {
    let mut set = PolicySet::new();
    let mut unknown = 0;
    for kind in &POLICY_KINDS {
        match kinds.get(kind) {
            Some(KindState::Synced(objects)) => {
                for ((ns, name), object) in objects {
                    if let Err(e) = set.insert_value(object) {
                        // Kyverno's webhook rejects such policies; if one exists anyway, its
                        // results are dropped like those of a policy that does not exist.
                        tracing::warn!(kind = kind.kind, namespace = ns, name, error = %e, "ignoring malformed policy");
                    }
                }
            }
            Some(KindState::Absent | KindState::Pending) | None => {
                set.mark_unknown(kind);
                unknown += 1;
            }
        }
    }
    (set, unknown)
}

#[derive(Default)]
struct State {
    discovered: bool,
    kinds: BTreeMap<PolicyKind, KindState>,
    watchers: BTreeMap<PolicyKind, CancellationToken>,
}

/// Watches the policies of a cluster and publishes the [`PolicySet`].
pub struct PolicyWatcher {
    state: Mutex<State>,
    policies: watch::Sender<Option<PolicySet>>,
    /// Bumped on every state change (sync progress included), to wake `wait_synced`.
    progress: watch::Sender<u64>,
    metrics: ClusterMetrics,
}

fn object_key(object: &DynamicObject) -> (String, String) {
    (
        object.metadata.namespace.clone().unwrap_or_default(),
        object.metadata.name.clone().unwrap_or_default(),
    )
}

/// How long a burst of policy events (an install of many policies) may last and still count as
/// one change.
pub const CHANGE_SETTLE: Duration = Duration::from_secs(1);

/// Waits for the next change of a published policy set, then for the burst it starts to settle
/// ([`CHANGE_SETTLE`]), and returns the set as it is then; `None` once `cancel` fires or the
/// publisher is gone. Every consumer of [`PolicyWatcher::policies`] that re-merges on a change
/// loops on this.
pub async fn next_change(
    policies: &mut watch::Receiver<Option<PolicySet>>,
    cancel: &CancellationToken,
) -> Option<Option<PolicySet>> {
    tokio::select! {
        _ = cancel.cancelled() => return None,
        changed = policies.changed() => changed.ok()?,
    }
    tokio::select! {
        _ = cancel.cancelled() => return None,
        _ = tokio::time::sleep(CHANGE_SETTLE) => {}
    }
    Some(policies.borrow_and_update().clone())
}

/// Where `kind` is served in its group: the group's preferred version if it has the kind, else
/// the most stable version that does. Looking only at the preferred version misses Kyverno's
/// own policies: from Kyverno 1.19 `kyverno.io` prefers `v2` (PolicyException, cleanup
/// policies, …) while ClusterPolicy and Policy are served in `v1` only.
fn served_kind(group: &ApiGroup, kind: &str) -> Option<ApiResource> {
    group
        .recommended_kind(kind)
        .or_else(|| {
            group
                .resources_by_stability()
                .into_iter()
                .find(|(ar, _)| ar.kind == kind)
        })
        .map(|(ar, _)| ar)
}

impl PolicyWatcher {
    pub fn new(metrics: ClusterMetrics) -> Arc<Self> {
        Arc::new(PolicyWatcher {
            state: Mutex::new(State::default()),
            policies: watch::channel(None).0,
            progress: watch::channel(0).0,
            metrics,
        })
    }

    /// The published policy set: `None` until the first discovery, then a set in which every
    /// kind not (yet) observed is marked unknown.
    pub fn policies(&self) -> watch::Receiver<Option<PolicySet>> {
        self.policies.subscribe()
    }

    /// Changes on every state change, sync progress included (to learn that the *set*
    /// changed, watch [`Self::policies`]).
    pub fn progress(&self) -> watch::Receiver<u64> {
        self.progress.subscribe()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether discovery ran and every served kind delivered its initial list.
    pub fn synced(&self) -> bool {
        let state = self.state();
        state.discovered
            && state
                .kinds
                .values()
                .all(|k| !matches!(k, KindState::Pending))
    }

    /// Kinds still pending (for log messages).
    pub fn pending_kinds(&self) -> Vec<&'static str> {
        self.state()
            .kinds
            .iter()
            .filter(|(_, s)| matches!(s, KindState::Pending))
            .map(|(k, _)| k.kind)
            .collect()
    }

    /// Waits until [`Self::synced`] or `timeout`; returns whether it synced.
    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        let mut changes = self.progress();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.synced() {
                return true;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return self.synced(),
                changed = changes.changed() => if changed.is_err() { return self.synced() },
            }
        }
    }

    fn publish(&self) {
        let (set, unknown, discovered) = {
            let state = self.state();
            let (set, unknown) = build(&state.kinds);
            (set, unknown, state.discovered)
        };
        if !discovered {
            return;
        }
        self.metrics.policies.set(set.len() as i64);
        self.metrics.policy_kinds_unknown.set(unknown as i64);
        self.policies.send_if_modified(|current| {
            if current.as_ref() == Some(&set) {
                false
            } else {
                *current = Some(set);
                true
            }
        });
        self.progress.send_modify(|g| *g += 1);
    }

    fn set_kind(&self, kind: PolicyKind, state: KindState) {
        self.state().kinds.insert(kind, state);
        self.publish();
    }

    fn update_kind(&self, kind: PolicyKind, f: impl FnOnce(&mut Objects)) {
        {
            let mut state = self.state();
            let Some(KindState::Synced(objects)) = state.kinds.get_mut(&kind) else {
                return;
            };
            f(objects);
        }
        self.publish();
    }

    /// Runs discovery and the watchers until `cancel` fires.
    pub async fn run(
        self: Arc<Self>,
        client: Client,
        cancel: CancellationToken,
        rediscovery: Duration,
    ) {
        let mut groups: Vec<&str> = POLICY_KINDS.iter().map(|k| k.group).collect();
        groups.sort_unstable();
        groups.dedup();
        let mut failing = false;
        loop {
            match Discovery::new(client.clone()).filter(&groups).run().await {
                Ok(discovery) => {
                    failing = false;
                    for kind in POLICY_KINDS {
                        let served = discovery
                            .get(kind.group)
                            .and_then(|g| served_kind(g, kind.kind));
                        self.reconcile_kind(&client, kind, served, &cancel);
                    }
                    self.state().discovered = true;
                    self.publish();
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "policy discovery failed; policies of kinds not yet watched are unknown (none of their results is dropped); retrying");
                    }
                    failing = true;
                }
            }
            let wait = if failing {
                Duration::from_secs(5).min(rediscovery)
            } else {
                rediscovery
            };
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(wait) => {}
            }
        }
        for (_, token) in std::mem::take(&mut self.state().watchers) {
            token.cancel();
        }
    }

    fn reconcile_kind(
        self: &Arc<Self>,
        client: &Client,
        kind: PolicyKind,
        served: Option<ApiResource>,
        cancel: &CancellationToken,
    ) {
        let mut state = self.state();
        let running = state.watchers.contains_key(&kind);
        match (served, running) {
            (Some(ar), false) => {
                tracing::info!(kind = kind.kind, api_version = %ar.api_version, "watching policies");
                let token = cancel.child_token();
                state.watchers.insert(kind, token.clone());
                state.kinds.insert(kind, KindState::Pending);
                tokio::spawn(
                    self.clone()
                        .watch_kind(client.clone(), kind, ar, token)
                        .instrument(tracing::info_span!("policy_kind_watch", kind = kind.kind)),
                );
            }
            (None, true) => {
                tracing::info!(
                    kind = kind.kind,
                    "policy kind no longer served; its results are no longer filtered"
                );
                if let Some(token) = state.watchers.remove(&kind) {
                    token.cancel();
                }
                state.kinds.insert(kind, KindState::Absent);
            }
            (None, false) => {
                state.kinds.insert(kind, KindState::Absent);
            }
            (Some(_), true) => {}
        }
    }

    async fn watch_kind(
        self: Arc<Self>,
        client: Client,
        kind: PolicyKind,
        ar: ApiResource,
        cancel: CancellationToken,
    ) {
        let api: Api<DynamicObject> = Api::all_with(client, &ar);
        let mut events = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        let mut buffer = Objects::new();
        let mut failing = false;
        loop {
            let event = tokio::select! {
                _ = cancel.cancelled() => return,
                event = events.next() => event,
            };
            match event {
                None => return,
                Some(Ok(event)) => {
                    failing = false;
                    match event {
                        Event::Init => buffer.clear(),
                        Event::InitApply(o) => {
                            buffer.insert(object_key(&o), to_value(o, &ar));
                        }
                        Event::InitDone => {
                            let objects = std::mem::take(&mut buffer);
                            tracing::debug!(
                                kind = kind.kind,
                                count = objects.len(),
                                "policies listed"
                            );
                            self.set_kind(kind, KindState::Synced(objects));
                        }
                        Event::Apply(o) => {
                            let key = object_key(&o);
                            let value = to_value(o, &ar);
                            self.update_kind(kind, |objects| {
                                objects.insert(key, value);
                            });
                        }
                        Event::Delete(o) => {
                            let key = object_key(&o);
                            self.update_kind(kind, |objects| {
                                objects.remove(&key);
                            });
                        }
                    }
                }
                Some(Err(e)) => {
                    if !failing {
                        tracing::warn!(kind = kind.kind, error = %e, "cannot watch policies; until it works, policies of this kind are known as of the last complete list (or unknown: none of their results dropped)");
                    }
                    failing = true;
                }
            }
        }
    }

    /// Replaces the whole state (for tests and for callers that feed policies themselves).
    pub fn set_states(&self, kinds: BTreeMap<PolicyKind, KindState>) {
        {
            let mut state = self.state();
            state.kinds = kinds;
            state.discovered = true;
        }
        self.publish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reports_server_crds::ReportResult;
    use serde_json::json;

    fn kind(k: &str) -> PolicyKind {
        *POLICY_KINDS.iter().find(|p| p.kind == k).unwrap()
    }

    fn result(source: &str, policy: &str, rule: &str) -> ReportResult {
        ReportResult {
            source: Some(source.into()),
            policy: policy.into(),
            rule: Some(rule.into()),
            ..Default::default()
        }
    }

    fn cpol(name: &str, rule: &str) -> ((String, String), Value) {
        (
            (String::new(), name.to_owned()),
            json!({"apiVersion": "kyverno.io/v1", "kind": "ClusterPolicy", "metadata": {"name": name},
                   "spec": {"rules": [{"name": rule, "match": {"any": [{"resources": {"kinds": ["Pod"]}}]},
                                       "validate": {"pattern": {"spec": {}}}}]}}),
        )
    }

    #[test]
    fn only_synced_kinds_filter_results() {
        let mut kinds = BTreeMap::new();
        kinds.insert(
            kind("ClusterPolicy"),
            KindState::Synced([cpol("p", "r")].into_iter().collect()),
        );
        kinds.insert(kind("Policy"), KindState::Absent);
        kinds.insert(
            kind("ValidatingAdmissionPolicy"),
            KindState::Synced(Objects::new()),
        );
        kinds.insert(kind("ValidatingPolicy"), KindState::Pending);
        let (set, unknown) = build(&kinds);
        // Everything but the two synced kinds is unknown.
        assert_eq!(unknown, POLICY_KINDS.len() - 2);
        assert!(set.allows(&result("kyverno", "p", "r")));
        assert!(set.allows(&result("kyverno", "p", "autogen-r")));
        assert!(!set.allows(&result("kyverno", "p", "other")));
        assert!(!set.allows(&result("kyverno", "deleted", "r")));
        // Policy CRD absent: namespaced Kyverno policies are unknown.
        assert!(set.allows(&result("kyverno", "ns/anything", "r")));
        // VAPs synced and none exists: their results go.
        assert!(!set.allows(&result("ValidatingAdmissionPolicy", "vap", "")));
        // ValidatingPolicy not synced yet: kept.
        assert!(set.allows(&result("KyvernoValidatingPolicy", "vpol", "")));
    }

    #[tokio::test]
    async fn published_set_follows_the_state_and_signals_changes() {
        let watcher = PolicyWatcher::new(ClusterMetrics::unregistered());
        let mut policies = watcher.policies();
        assert!(policies.borrow().is_none());
        assert!(!watcher.synced());
        let mut kinds: BTreeMap<PolicyKind, KindState> = POLICY_KINDS
            .iter()
            .map(|k| (*k, KindState::Absent))
            .collect();
        kinds.insert(
            kind("ClusterPolicy"),
            KindState::Synced([cpol("p", "r")].into_iter().collect()),
        );
        watcher.set_states(kinds.clone());
        assert!(watcher.synced());
        assert!(policies.has_changed().unwrap());
        let set = policies.borrow_and_update().clone().unwrap();
        assert!(set.kyverno_policy("p").is_some());
        // A policy deleted: the set changes and says so.
        watcher.update_kind(kind("ClusterPolicy"), |o| {
            o.clear();
        });
        assert!(policies.has_changed().unwrap());
        assert!(
            policies
                .borrow_and_update()
                .as_ref()
                .unwrap()
                .kyverno_policy("p")
                .is_none()
        );
        // An identical state is not a change.
        watcher.update_kind(kind("ClusterPolicy"), |_| {});
        assert!(!policies.has_changed().unwrap());
        assert!(watcher.wait_synced(Duration::from_millis(10)).await);
    }
}
