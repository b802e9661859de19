//! An in-memory [`AggregationBackend`], the reference implementation of the paging and
//! atomicity contract, used by the tests and usable as a model by the real backends.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use crate::backend::{AggregationBackend, Applied, BackendError, InputPage, PageRequest};
use crate::merge::Plan;
use crate::policy::PolicySet;
use crate::report::{Ephemeral, FinalReport, ObjectKey, ReportKind};

type Id = (String, ReportKind, String);

#[derive(Default)]
struct State {
    reports: BTreeMap<Id, FinalReport>,
    ephemerals: BTreeMap<Id, Ephemeral>,
    policies: Option<PolicySet>,
    next_rv: u64,
    failures_to_inject: usize,
    applies: usize,
    pages_loaded: usize,
}

impl State {
    fn next_rv(&mut self) -> String {
        self.next_rv += 1;
        self.next_rv.to_string()
    }
}

/// Reports kept in maps under one mutex. Every write assigns a new `resourceVersion` from one
/// counter; creates get a `uid`.
#[derive(Default)]
pub struct InMemoryBackend {
    state: Mutex<State>,
}

fn id_of(key: &ObjectKey) -> Id {
    (key.namespace.clone(), key.kind, key.name.clone())
}

impl InMemoryBackend {
    pub fn new(policies: Option<PolicySet>) -> Self {
        InMemoryBackend {
            state: Mutex::new(State {
                policies,
                ..Default::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic in a test thread must not hide the state from the assertions that follow.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_policies(&self, policies: Option<PolicySet>) {
        self.lock().policies = policies;
    }

    /// Stores (or replaces) a final report, assigning uid and resourceVersion.
    pub fn put_report(&self, mut report: FinalReport) {
        let mut s = self.lock();
        let rv = s.next_rv();
        let meta = report.metadata_mut();
        meta.resource_version = Some(rv.clone());
        meta.uid.get_or_insert_with(|| format!("report-uid-{rv}"));
        s.reports.insert(id_of(&report.key()), report);
    }

    /// Stores (or replaces) an ephemeral report, assigning a resourceVersion.
    pub fn put_ephemeral(&self, mut report: Ephemeral) {
        let mut s = self.lock();
        let rv = s.next_rv();
        match &mut report {
            Ephemeral::Namespaced(r) => r.metadata.resource_version = Some(rv),
            Ephemeral::Cluster(r) => r.metadata.resource_version = Some(rv),
        }
        s.ephemerals.insert(id_of(&report.key()), report);
    }

    /// All final reports, sorted by (namespace, kind, name).
    pub fn reports(&self) -> Vec<FinalReport> {
        self.lock().reports.values().cloned().collect()
    }

    /// All ephemeral reports, sorted by (namespace, kind, name).
    pub fn ephemerals(&self) -> Vec<Ephemeral> {
        self.lock().ephemerals.values().cloned().collect()
    }

    /// Makes the next `n` calls to `apply` fail with `Unavailable` (failure injection).
    pub fn fail_next_applies(&self, n: usize) {
        self.lock().failures_to_inject = n;
    }

    /// Number of successful `apply` calls.
    pub fn applies(&self) -> usize {
        self.lock().applies
    }

    /// Number of `load_page` calls.
    pub fn pages_loaded(&self) -> usize {
        self.lock().pages_loaded
    }

    fn page(&self, req: PageRequest<'_>) -> InputPage {
        let mut s = self.lock();
        s.pages_loaded += 1;
        // Paging key of each input: the subject UID; "" (first page) for multi-subject reports.
        let mut keyed: BTreeMap<String, (Vec<FinalReport>, Vec<Ephemeral>)> = BTreeMap::new();
        for ((ns, kind, _), r) in &s.reports {
            if ns != req.namespace || *kind != req.report_kind {
                continue;
            }
            let key = match r.scope().and_then(|s| s.uid.clone()) {
                Some(uid) if !uid.is_empty() => uid,
                _ if !r.is_managed() => r.name().to_owned(),
                _ => String::new(),
            };
            keyed.entry(key).or_default().0.push(r.clone());
        }
        for ((ns, _, _), e) in &s.ephemerals {
            if ns != req.namespace {
                continue;
            }
            let key = e.subject_uid().unwrap_or_default().to_owned();
            keyed.entry(key).or_default().1.push(e.clone());
        }
        let mut page = InputPage::default();
        let mut last = None;
        let mut remaining = keyed
            .into_iter()
            .filter(|(k, _)| req.continue_token.is_none_or(|c| k.as_str() > c))
            .peekable();
        for (key, (reports, ephemerals)) in remaining.by_ref().take(req.limit.max(1)) {
            page.reports.extend(reports);
            page.ephemerals.extend(ephemerals);
            last = Some(key);
        }
        if remaining.peek().is_some() {
            page.next = last;
        }
        page
    }

    fn apply_plan(&self, plan: &Plan) -> Result<Applied, BackendError> {
        let mut s = self.lock();
        if s.failures_to_inject > 0 {
            s.failures_to_inject -= 1;
            return Err(BackendError::Unavailable("injected failure".into()));
        }
        // Validate everything first so that the plan applies all-or-nothing.
        let check_rv =
            |key: &ObjectKey, current: Option<&str>| match (&key.resource_version, current) {
                (Some(want), Some(have)) if want != have => Err(BackendError::Conflict(format!(
                    "{} {}/{}: resourceVersion {have} != {want}",
                    key.kind, key.namespace, key.name
                ))),
                _ => Ok(()),
            };
        let mut creates = BTreeSet::new();
        for r in &plan.creates {
            let id = id_of(&r.key());
            if s.reports.contains_key(&id) || !creates.insert(id) {
                return Err(BackendError::Conflict(format!(
                    "{} {}/{} already exists",
                    r.kind(),
                    r.namespace(),
                    r.name()
                )));
            }
        }
        for r in &plan.updates {
            let key = r.key();
            let Some(current) = s.reports.get(&id_of(&key)) else {
                return Err(BackendError::Conflict(format!(
                    "{} {}/{} is gone",
                    key.kind, key.namespace, key.name
                )));
            };
            check_rv(&key, current.metadata().resource_version.as_deref())?;
        }
        for key in &plan.deletes {
            if let Some(current) = s.reports.get(&id_of(key)) {
                check_rv(key, current.metadata().resource_version.as_deref())?;
            }
        }
        // Rewritten since loaded: kept for the next pass (see `Applied`).
        let rewritten: BTreeSet<_> = plan
            .ephemeral_deletes
            .iter()
            .filter(|key| {
                s.ephemerals.get(&id_of(key)).is_some_and(|current| {
                    check_rv(key, current.metadata().resource_version.as_deref()).is_err()
                })
            })
            .map(id_of)
            .collect();
        for r in plan.creates.iter().chain(&plan.updates) {
            let mut r = r.clone();
            let rv = s.next_rv();
            let meta = r.metadata_mut();
            meta.resource_version = Some(rv.clone());
            meta.uid.get_or_insert_with(|| format!("report-uid-{rv}"));
            s.reports.insert(id_of(&r.key()), r);
        }
        for key in &plan.deletes {
            s.reports.remove(&id_of(key));
        }
        for key in &plan.ephemeral_deletes {
            let id = id_of(key);
            if !rewritten.contains(&id) {
                s.ephemerals.remove(&id);
            }
        }
        // Written again after the plan's reports, as the store backend does (see `Applied`).
        for id in &rewritten {
            let rv = s.next_rv();
            if let Some(e) = s.ephemerals.get_mut(id) {
                e.metadata_mut().resource_version = Some(rv);
            }
        }
        s.applies += 1;
        Ok(Applied {
            ephemerals_rewritten: rewritten.len(),
        })
    }
}

impl AggregationBackend for InMemoryBackend {
    async fn policies(&self) -> Result<Option<PolicySet>, BackendError> {
        Ok(self.lock().policies.clone())
    }

    async fn load_page(&self, request: PageRequest<'_>) -> Result<InputPage, BackendError> {
        Ok(self.page(request))
    }

    async fn apply(&self, plan: &Plan) -> Result<Applied, BackendError> {
        self.apply_plan(plan)
    }
}
