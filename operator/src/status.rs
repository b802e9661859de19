//! Conditions from the outcome of one reconcile, without I/O.
//!
//! Both conventions readers use are written at once: kstatus reads `Reconciling` and `Stalled`
//! (abnormal-true) and `observedGeneration`; Argo CD's health check (`manifests/argocd/`) and
//! people read `Ready` and `Degraded`. `Degraded` always equals `Stalled`. A condition's
//! `lastTransitionTime` changes only when its status flips; a new reason or message alone keeps
//! the old time, so `kubectl wait` and dashboards see real transitions only.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use reports_server_crds::reportsserver::condition::{DEGRADED, READY, RECONCILING, STALLED};

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
    for c in &mut out {
        if let Some(old) = previous.iter().find(|p| p.type_ == c.type_)
            && old.status == c.status
        {
            c.last_transition_time = old.last_transition_time.clone();
        }
    }
    out
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
