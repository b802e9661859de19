//! Conditions from the outcome of one reconcile, without I/O.
//!
//! Both conventions readers use are written at once: kstatus reads `Reconciling` and `Stalled`
//! (abnormal-true) and `observedGeneration`; Argo CD's health check (`manifests/argocd/`) and
//! people read `Ready` and `Degraded`. `Degraded` always equals `Stalled`. A condition's
//! `lastTransitionTime` changes only when its status flips; a new reason or message alone keeps
//! the old time, so `kubectl wait` and dashboards see real transitions only.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use reports_server_crds::reportsserver::ReportsServer;
use reports_server_crds::reportsserver::condition::{
    DATABASE_AVAILABLE, DEGRADED, READY, RECONCILING, STALLED,
};
use reports_server_crds::reportsserver::{
    KindMigrationStatus, MigrationRunStatus, MigrationStatus,
};

use crate::database_check::Observation;
use reports_server_migration::Phase;
use reports_server_migration::mailbox::Report;

/// What one reconcile concluded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Everything asked for is served.
    Ready,
    /// Still converging (pods starting, APIServices not yet Available).
    Progressing { reason: String, message: String },
    /// Cannot make progress without a user action.
    Degraded { reason: String, message: String },
}

impl Outcome {
    pub fn progressing(reason: &str, message: impl Into<String>) -> Self {
        Outcome::Progressing {
            reason: reason.into(),
            message: message.into(),
        }
    }

    pub fn degraded(reason: &str, message: impl Into<String>) -> Self {
        Outcome::Degraded {
            reason: reason.into(),
            message: message.into(),
        }
    }
}

fn cond(
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: &Time,
) -> Condition {
    Condition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: reason.into(),
        message: message.into(),
        observed_generation: generation,
        last_transition_time: now.clone(),
    }
}

/// The four conditions for `outcome`, keeping each `lastTransitionTime` from `previous` unless
/// the status flipped.
pub fn conditions(
    previous: &[Condition],
    outcome: &Outcome,
    generation: Option<i64>,
    now: Time,
) -> Vec<Condition> {
    let (ready, reconciling, stalled) = match outcome {
        Outcome::Ready => (
            (
                true,
                "Ready",
                "every enabled API group is served".to_string(),
            ),
            (false, "Ready", String::new()),
            (false, "Ready", String::new()),
        ),
        Outcome::Progressing { reason, message } => (
            (false, reason.as_str(), message.clone()),
            (true, reason.as_str(), message.clone()),
            (false, "Progressing", String::new()),
        ),
        Outcome::Degraded { reason, message } => (
            (false, reason.as_str(), message.clone()),
            (false, reason.as_str(), String::new()),
            (true, reason.as_str(), message.clone()),
        ),
    };
    let mut out = vec![
        cond(READY, ready.0, ready.1, &ready.2, generation, &now),
        cond(
            RECONCILING,
            reconciling.0,
            reconciling.1,
            &reconciling.2,
            generation,
            &now,
        ),
        cond(STALLED, stalled.0, stalled.1, &stalled.2, generation, &now),
        cond(DEGRADED, stalled.0, stalled.1, &stalled.2, generation, &now),
    ];
    keep_transition_times(previous, &mut out);
    out
}

/// The `DatabaseAvailable` condition for what the servers last said of their database.
pub fn database_condition(
    previous: &[Condition],
    seen: &Observation,
    generation: Option<i64>,
    now: Time,
) -> Condition {
    observed_condition(previous, DATABASE_AVAILABLE, seen, generation, now)
}

/// A condition of type `type_` that reports an observation rather than the reconcile's outcome
/// (`DatabaseAvailable`, `AnalyticsAccess`, `Monitoring`), keeping its `lastTransitionTime`
/// from `previous` unless the status flipped.
pub fn observed_condition(
    previous: &[Condition],
    type_: &str,
    seen: &Observation,
    generation: Option<i64>,
    now: Time,
) -> Condition {
    let mut out = [Condition {
        type_: type_.into(),
        status: seen.status_text().into(),
        reason: seen.reason.clone(),
        message: seen.message.clone(),
        observed_generation: generation,
        last_transition_time: now,
    }];
    keep_transition_times(previous, &mut out);
    let [condition] = out;
    condition
}

/// Whether `rs`'s status already shows `seen` as its `DatabaseAvailable` condition.
pub fn shows_database(rs: &ReportsServer, seen: &Observation) -> bool {
    rs.status
        .as_ref()
        .and_then(|s| find(&s.conditions, DATABASE_AVAILABLE))
        .is_some_and(|c| {
            c.status == seen.status_text() && c.reason == seen.reason && c.message == seen.message
        })
}

/// Keeps each condition's `lastTransitionTime` from `previous` unless its status flipped.
fn keep_transition_times(previous: &[Condition], conditions: &mut [Condition]) {
    for c in conditions {
        if let Some(old) = previous.iter().find(|p| p.type_ == c.type_)
            && old.status == c.status
        {
            c.last_transition_time = old.last_transition_time.clone();
        }
    }
}

/// Condition types of `status.migration`.
pub mod migration_condition {
    pub const COPIED: &str = "Copied";
    pub const VERIFIED: &str = "Verified";
    pub const SWITCHED: &str = "Switched";
    pub const HANDED_BACK: &str = "HandedBack";
}

/// `status.migration` from the worker's report in the mailbox. `wanted` is what the mailbox
/// asks for; a report about another request counts as not yet answered.
pub fn migration_status(
    previous: Option<&MigrationStatus>,
    report: &Report,
    wanted: &[String],
    generation: Option<i64>,
    now: Time,
) -> MigrationStatus {
    use migration_condition::*;
    let answered = report.settled_for(wanted);
    let phase = match report.phase {
        Some(Phase::Complete) if !answered => Phase::Switching,
        Some(p) => p,
        None => Phase::Copying,
    };
    let before: &[Condition] = previous.map(|p| &p.conditions[..]).unwrap_or(&[]);
    let was = |t: &str| find(before, t).map(|c| c.status == "True");
    let handing_back = matches!(phase, Phase::HandingBack | Phase::WritingBack)
        || (phase == Phase::Fencing && was(HANDED_BACK).is_some());
    let mut conditions = Vec::new();
    let mk = |t: &str, ok: bool, reason: &str| cond(t, ok, reason, "", generation, &now);
    if phase == Phase::Failed {
        // The statuses stay as they were; the message says why and the worker retries.
        conditions = before.to_vec();
    } else if handing_back || wanted.is_empty() {
        conditions.push(mk(HANDED_BACK, answered && !handing_back, phase.as_str()));
    } else {
        let step = |p: Phase| match p {
            Phase::Copying => 0,
            Phase::Fencing | Phase::Verifying => 1,
            Phase::Switching => 2,
            _ => 3,
        };
        let at = if answered { 3 } else { step(phase) };
        conditions.push(mk(COPIED, at >= 1, phase.as_str()));
        conditions.push(mk(VERIFIED, at >= 2, phase.as_str()));
        conditions.push(mk(SWITCHED, at >= 3, phase.as_str()));
    }
    keep_transition_times(before, &mut conditions);
    // A step covers the groups that still needed it (a run resumed after a kill may have only
    // one left): kinds it does not report keep their last figures.
    let mut kinds: Vec<KindMigrationStatus> = previous.map(|p| p.kinds.clone()).unwrap_or_default();
    for k in &report.kinds {
        let now = KindMigrationStatus {
            kind: k.kind.clone(),
            total: k.total as i64,
            copied: k.copied as i64,
            mirrored: k.mirrored as i64,
            synced: k.synced as i64,
        };
        match kinds.iter_mut().find(|x| x.kind == k.kind) {
            Some(x) => *x = now,
            None => kinds.push(now),
        }
    }
    let last_run = report
        .last_run
        .as_ref()
        .map(|r| {
            let f = |k: &str| format!("{:.1}", r[k].as_f64().unwrap_or(0.0));
            MigrationRunStatus {
                objects_per_second: f("copyObjectsPerSecond"),
                fence_seconds: f("fenceSeconds"),
                switch_seconds: f("switchSeconds"),
            }
        })
        .or_else(|| previous.and_then(|p| p.last_run.clone()));
    MigrationStatus {
        phase: if answered {
            "Complete".into()
        } else {
            phase.as_str().into()
        },
        copied: kinds.iter().map(|k| k.copied).sum(),
        total: kinds.iter().map(|k| k.total).sum(),
        kinds,
        message: report.message.clone(),
        conditions,
        last_run,
    }
}

/// The condition of `type_` in `conditions`, if any.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn t(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).unwrap())
    }

    #[test]
    fn transition_time_moves_only_on_a_flip() {
        let first = conditions(
            &[],
            &Outcome::progressing("WaitingForAPIServices", "a"),
            Some(1),
            t(100),
        );
        assert_eq!(find(&first, READY).unwrap().status, "False");
        assert_eq!(find(&first, RECONCILING).unwrap().status, "True");
        // Same statuses, another reason and message: times stay.
        let second = conditions(
            &first,
            &Outcome::progressing("WaitingForPods", "b"),
            Some(2),
            t(200),
        );
        assert_eq!(find(&second, READY).unwrap().last_transition_time, t(100));
        assert_eq!(find(&second, READY).unwrap().reason, "WaitingForPods");
        assert_eq!(find(&second, READY).unwrap().observed_generation, Some(2));
        // Ready flips: its time moves, Stalled's does not.
        let third = conditions(&second, &Outcome::Ready, Some(2), t(300));
        assert_eq!(find(&third, READY).unwrap().last_transition_time, t(300));
        assert_eq!(
            find(&third, RECONCILING).unwrap().last_transition_time,
            t(300)
        );
        assert_eq!(find(&third, STALLED).unwrap().last_transition_time, t(100));
    }

    #[test]
    fn migration_conditions_follow_the_phases_and_keep_their_times() {
        use migration_condition::*;
        let wanted = vec!["wgpolicyk8s.io".to_string()];
        let report = |phase, observed: &[String]| Report {
            observed_groups: Some(observed.to_vec()),
            phase: Some(phase),
            ..Default::default()
        };
        let status_of =
            |s: &MigrationStatus, t: &str| find(&s.conditions, t).unwrap().status.clone();
        let copying = migration_status(
            None,
            &report(Phase::Copying, &wanted),
            &wanted,
            Some(1),
            t(10),
        );
        assert_eq!(copying.phase, "Copying");
        assert_eq!(status_of(&copying, COPIED), "False");
        let fencing = migration_status(
            Some(&copying),
            &report(Phase::Verifying, &wanted),
            &wanted,
            Some(1),
            t(20),
        );
        assert_eq!(status_of(&fencing, COPIED), "True");
        assert_eq!(status_of(&fencing, VERIFIED), "False");
        assert_eq!(
            find(&fencing.conditions, COPIED)
                .unwrap()
                .last_transition_time,
            t(20)
        );
        assert_eq!(
            find(&fencing.conditions, SWITCHED)
                .unwrap()
                .last_transition_time,
            t(10)
        );
        // A Complete answering an older request is not complete.
        let stale = migration_status(
            Some(&fencing),
            &report(Phase::Complete, &[]),
            &wanted,
            Some(1),
            t(30),
        );
        assert_eq!(stale.phase, "Switching");
        assert_eq!(status_of(&stale, SWITCHED), "False");
        let done = migration_status(
            Some(&stale),
            &report(Phase::Complete, &wanted),
            &wanted,
            Some(1),
            t(40),
        );
        assert_eq!(done.phase, "Complete");
        for c in [COPIED, VERIFIED, SWITCHED] {
            assert_eq!(status_of(&done, c), "True");
        }
        // A failure keeps the statuses and says why.
        let failed = migration_status(
            Some(&fencing),
            &Report {
                message: "boom".into(),
                ..report(Phase::Failed, &wanted)
            },
            &wanted,
            Some(1),
            t(50),
        );
        assert_eq!(failed.conditions, fencing.conditions);
        assert_eq!(failed.message, "boom");
        // Hand-back: HandedBack False while writing back, True once the worker answers "".
        let back = migration_status(
            Some(&done),
            &report(Phase::WritingBack, &[]),
            &[],
            Some(2),
            t(60),
        );
        assert_eq!(status_of(&back, HANDED_BACK), "False");
        let back_done = migration_status(
            Some(&back),
            &report(Phase::Complete, &[]),
            &[],
            Some(2),
            t(70),
        );
        assert_eq!(status_of(&back_done, HANDED_BACK), "True");
        assert_eq!(back_done.phase, "Complete");
    }

    #[test]
    fn degraded_mirrors_stalled() {
        let c = conditions(
            &[],
            &Outcome::degraded("DatabaseSecretMissing", "Secret x"),
            Some(1),
            t(1),
        );
        for ty in [STALLED, DEGRADED] {
            let c = find(&c, ty).unwrap();
            assert_eq!(
                (c.status.as_str(), c.reason.as_str(), c.message.as_str()),
                ("True", "DatabaseSecretMissing", "Secret x")
            );
        }
        assert_eq!(find(&c, RECONCILING).unwrap().status, "False");
        assert_eq!(find(&c, READY).unwrap().status, "False");
    }
}
