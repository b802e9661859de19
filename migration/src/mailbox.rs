//! The ConfigMap through which the operator and the server's migration worker talk.
//!
//! Why a ConfigMap: the migration needs the database, so it runs in the server (which has it,
//! whatever the backend, embedded SQLite included), while the decisions — which groups the
//! installation serves, whether it is being deleted — are the operator's. The operator writes one
//! key, `groups` (the API groups the server should serve); the worker, the only writer of every
//! other key, converges the cluster on it and reports back, naming the `groups` value its report
//! is about (`observedGroups`), so the operator can tell an old report from an answer. Each side
//! writes only its own keys (a merge patch), so neither overwrites the other.
//!
//! Everything here but [`Mailbox::read`] and [`Mailbox::publish`] is pure.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::plan::KindProgress;
use super::{MigrationError, Phase};

/// Key the operator writes: comma-separated API groups to serve (`""` hands every group back).
pub const GROUPS: &str = "groups";
/// Keys the worker writes.
pub const OBSERVED_GROUPS: &str = "observedGroups";
pub const PHASE: &str = "phase";
pub const PROGRESS: &str = "progress";
pub const MESSAGE: &str = "message";
pub const LAST_RUN: &str = "lastRun";
pub const UPDATED: &str = "updated";

/// Field manager of the worker's writes.
const WORKER_MANAGER: &str = "reports-server-migration";

/// The groups a mailbox asks for: `None` when the key is absent (the worker's own default).
pub fn wanted_groups(data: &BTreeMap<String, String>) -> Option<Vec<String>> {
    data.get(GROUPS).map(|v| parse_groups(v))
}

/// `"a, b,,c"` → `["a", "b", "c"]`, sorted, without duplicates.
pub fn parse_groups(value: &str) -> Vec<String> {
    let mut out: Vec<String> = value
        .split(',')
        .map(str::trim)
        .filter(|g| !g.is_empty())
        .map(str::to_owned)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The canonical text of a group list (what `observedGroups` holds).
pub fn format_groups(groups: &[String]) -> String {
    let mut sorted = groups.to_vec();
    sorted.sort();
    sorted.dedup();
    sorted.join(",")
}

/// What the worker last reported.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// The `groups` value this report is about.
    pub observed_groups: Option<Vec<String>>,
    pub phase: Option<Phase>,
    pub kinds: Vec<KindProgress>,
    pub message: String,
    /// The figures of the last finished run (JSON of a `MigrationReport`).
    pub last_run: Option<serde_json::Value>,
}

impl Report {
    /// Reads the worker's keys; unknown or malformed values are treated as absent.
    pub fn from_data(data: &BTreeMap<String, String>) -> Self {
        Report {
            observed_groups: data.get(OBSERVED_GROUPS).map(|v| parse_groups(v)),
            phase: data.get(PHASE).and_then(|p| parse_phase(p)),
            kinds: data
                .get(PROGRESS)
                .and_then(|p| serde_json::from_str(p).ok())
                .unwrap_or_default(),
            message: data.get(MESSAGE).cloned().unwrap_or_default(),
            last_run: data
                .get(LAST_RUN)
                .and_then(|p| serde_json::from_str(p).ok()),
        }
    }

    /// Whether this report answers a request for `groups` and nothing is moving any more.
    pub fn settled_for(&self, groups: &[String]) -> bool {
        self.phase == Some(Phase::Complete)
            && self.observed_groups.as_deref() == Some(&parse_groups(&groups.join(","))[..])
    }
}

pub fn parse_phase(s: &str) -> Option<Phase> {
    [
        Phase::Complete,
        Phase::Copying,
        Phase::Fencing,
        Phase::Verifying,
        Phase::Switching,
        Phase::HandingBack,
        Phase::WritingBack,
        Phase::Failed,
    ]
    .into_iter()
    .find(|p| p.as_str() == s)
}

/// The merge patch of the worker's keys.
pub fn report_patch(
    observed: &[String],
    phase: Phase,
    kinds: &[KindProgress],
    message: &str,
    last_run: Option<&serde_json::Value>,
    now: &str,
) -> serde_json::Value {
    let mut data = json!({
        OBSERVED_GROUPS: format_groups(observed),
        PHASE: phase.as_str(),
        PROGRESS: serde_json::to_string(kinds).expect("progress serializes"),
        MESSAGE: message,
        UPDATED: now,
    });
    if let Some(run) = last_run {
        data[LAST_RUN] = json!(run.to_string());
    }
    json!({"data": data})
}

/// A mailbox ConfigMap, as the worker uses it.
#[derive(Clone)]
pub struct Mailbox {
    api: Api<ConfigMap>,
    name: String,
}

impl Mailbox {
    /// `reference` is `namespace/name`.
    pub fn new(client: kube::Client, reference: &str) -> Result<Self, MigrationError> {
        let (ns, name) = reference
            .split_once('/')
            .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
            .ok_or_else(|| {
                MigrationError::Refused(format!(
                    "the migration mailbox {reference:?} is not namespace/name"
                ))
            })?;
        Ok(Mailbox {
            api: Api::namespaced(client, ns),
            name: name.to_owned(),
        })
    }

    /// The ConfigMap's data; `None` when it does not exist (yet).
    pub async fn read(&self) -> Result<Option<BTreeMap<String, String>>, MigrationError> {
        match self.api.get_opt(&self.name).await {
            Ok(cm) => Ok(cm.map(|cm| cm.data.unwrap_or_default())),
            Err(e) => Err(MigrationError::kube(
                format!("reading the migration mailbox ConfigMap {}", self.name),
                e,
            )),
        }
    }

    /// Writes the worker's keys. A missing ConfigMap is not created: the operator owns it.
    pub async fn publish(&self, patch: &serde_json::Value) -> Result<(), MigrationError> {
        match self
            .api
            .patch(
                &self.name,
                &PatchParams {
                    field_manager: Some(WORKER_MANAGER.into()),
                    ..Default::default()
                },
                &Patch::Merge(patch),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(MigrationError::kube(
                format!("writing the migration mailbox ConfigMap {}", self.name),
                e,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn groups_are_canonical() {
        assert_eq!(
            parse_groups(" wgpolicyk8s.io,,openreports.io, wgpolicyk8s.io"),
            ["openreports.io", "wgpolicyk8s.io"]
        );
        assert!(parse_groups("").is_empty());
        assert_eq!(wanted_groups(&data(&[])), None);
        assert_eq!(wanted_groups(&data(&[(GROUPS, "")])), Some(vec![]));
        assert_eq!(format_groups(&["b".into(), "a".into(), "b".into()]), "a,b");
    }

    #[test]
    fn a_report_round_trips_and_answers_only_its_request() {
        let kinds = vec![KindProgress {
            kind: "PolicyReport".into(),
            total: 10,
            copied: 7,
            mirrored: 2,
            synced: 0,
        }];
        let run = json!({"copyObjectsPerSecond": 300.0});
        let patch = report_patch(
            &["wgpolicyk8s.io".into()],
            Phase::Copying,
            &kinds,
            "copying",
            Some(&run),
            "2026-11-24T00:00:00Z",
        );
        let d: BTreeMap<String, String> = serde_json::from_value(patch["data"].clone()).unwrap();
        let report = Report::from_data(&d);
        assert_eq!(report.phase, Some(Phase::Copying));
        assert_eq!(report.kinds, kinds);
        assert_eq!(report.last_run, Some(run));
        assert!(
            !report.settled_for(&["wgpolicyk8s.io".into()]),
            "still copying"
        );
        let done = Report {
            phase: Some(Phase::Complete),
            ..report
        };
        assert!(done.settled_for(&["wgpolicyk8s.io".into()]));
        assert!(!done.settled_for(&[]), "an answer to another request");
        // Garbage is absent, not an error.
        let junk = Report::from_data(&data(&[(PHASE, "Dancing"), (PROGRESS, "{")]));
        assert_eq!(junk, Report::default());
    }
}
