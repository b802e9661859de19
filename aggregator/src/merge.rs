//! The pure merge: current policy reports + ephemeral reports (+ the live policy set) → a
//! [`Plan`] of report creates, updates and deletes, and of ephemeral reports to delete.
//!
//! No I/O happens here, so the same code serves the in-process store, a kube API backend, the
//! offline `reports-server aggregate` command and the tests.
//!
//! # Rules (Kyverno generation C, `pkg/controllers/report/aggregate`)
//!
//! 1. Only reports labelled `app.kubernetes.io/managed-by: kyverno` are read as input and
//!    only those are ever updated or deleted. A desired report whose name is taken by an
//!    unmanaged report is a [conflict](Plan::conflicts): it is not written and the ephemeral
//!    reports that fed it are kept, so nothing is lost.
//! 2. Each result is attributed to a subject UID: the report's `scope.uid` for per-resource
//!    reports, `resources[0].uid` for per-policy reports, the `audit.kyverno.io/resource.uid`
//!    label (else the first ownerReference) for ephemeral reports.
//! 3. When the policy set is known, results of deleted or report-disabled policies and of
//!    rules no longer in the autogen-expanded rule set are dropped ([`PolicySet::allows`]).
//! 4. Identity is `(source, policy, rule, subject uid)`, without `rule` for CEL and admission
//!    policy sources ([`ResultKey`]). Per identity one result survives:
//!    **the greatest `timestamp.seconds` wins** (nanos are ignored, as in Kyverno). Ties, which
//!    Kyverno resolves by "first seen" (the existing report, then ephemeral reports in the API
//!    server's LIST order), go to the result **written last**, by a total order that does not
//!    depend on input order:
//!    1. the result from the report with the greater `resourceVersion` wins (both parsed as
//!       integers; a report with one beats a report without). A rescan within the same second
//!       (`fail`, then `skip` once an exception exists) is therefore decided by the later write,
//!       not by a random name suffix. Stored and ephemeral reports compare the same way: an
//!       ephemeral report still present was written after the merge that produced the stored
//!       copy (in-process, one rewritten while a merge applied is written again after it),
//!       unless a crash interrupted the deletion of consumed inputs — then the stored report,
//!       written after them, wins, and a re-merge changes nothing. This needs final and
//!       ephemeral reports in one storage (one resourceVersion sequence), as in every supported
//!       set-up: the in-process store, or all report kinds as CRDs in one etcd;
//!    2. without resourceVersions (offline input): a result already stored in a policy report
//!       beats one from an ephemeral report;
//!    3. then the later `creationTimestamp`;
//!    4. then the report whose name sorts first (byte-wise);
//!    5. then the result whose canonical JSON sorts first (only reachable with duplicate
//!       results inside one report).
//! 5. Surviving results are normalised (Kubernetes `omitempty`), sorted exactly like Kyverno,
//!    and counted into `summary` (all five counters).
//! 6. Layout: see [`Layout`]. Existing managed reports that are not desired any more (empty
//!    per-resource reports, stale chunks, reports of another layout or kind) are deleted.
//! 7. Ephemeral reports whose subject could be determined are deleted — by the backend, in
//!    the same transaction as the writes or after them.
//!
//! # Bounded memory
//!
//! In the per-resource layout the results of different subjects never interact, so a backend can
//! feed the merge one page of subjects at a time ([`merge_page`], [`merge_subject`]) as long as
//! a page holds *all* inputs of each subject it covers. Per-policy reports hold many subjects and
//! are therefore left alone by a page merge (listed in [`Plan::skipped`]); they need one
//! namespace-wide merge ([`merge_namespace`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::str::FromStr;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use reports_server_crds::ReportResult;

use crate::error::Error;
use crate::policy::PolicySet;
use crate::report::{
    Ephemeral, FinalReport, LABEL_MANAGED_BY, MANAGED_BY_VALUE, ObjectKey, ReportKind,
    managed_labels,
};
use crate::results::{ResultKey, canonical_json, normalize_result, seconds, sort_results};

/// Default maximum number of results per per-policy report (Kyverno's `--reportsChunkSize`).
pub const DEFAULT_CHUNK_SIZE: usize = 1000;

/// How results are distributed over report objects.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Kyverno ≥ 1.11: one report per subject, named by the subject UID, with `scope` and one
    /// ownerReference to the subject (no `controller`/`blockOwnerDeletion`); metadata is never
    /// rewritten after creation; the report is deleted when it has no result left.
    #[default]
    PerResource,
    /// Kyverno ≤ 1.10: one report per policy per namespace, `cpol-<policy>` (cluster-wide
    /// policy) or `pol-<policy>` (namespaced policy, namespace part dropped), split into chunks
    /// `-1`, `-2`… of at most `chunk_size` results, sorted *before* chunking so that chunk
    /// membership is stable. Each result names its subject in `resources[0]`.
    PerPolicy,
}

impl Layout {
    pub const VALUES: &'static str = "per-resource, per-policy";

    pub fn as_str(self) -> &'static str {
        match self {
            Self::PerResource => "per-resource",
            Self::PerPolicy => "per-policy",
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Layout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "per-resource" => Ok(Self::PerResource),
            "per-policy" => Ok(Self::PerPolicy),
            _ => Err(Error::InvalidOption {
                option: "layout",
                value: s.to_owned(),
                expected: Self::VALUES,
            }),
        }
    }
}

/// Which API group the final reports are written in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OutputFormat {
    /// `wgpolicyk8s.io/v1alpha2` PolicyReport / ClusterPolicyReport.
    #[default]
    Wgpolicy,
    /// `openreports.io/v1alpha1` Report / ClusterReport (Kyverno's `--openreportsEnabled`).
    Openreports,
}

impl OutputFormat {
    pub const VALUES: &'static str = "wgpolicy, openreports";

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Wgpolicy => "wgpolicy",
            Self::Openreports => "openreports",
        }
    }

    /// The namespaced and the cluster-scoped kind of final report.
    pub fn final_kinds(self) -> [ReportKind; 2] {
        [self.kind_for("namespace"), self.kind_for("")]
    }

    /// The kind of final report for `namespace` (`""` = cluster scope).
    pub fn kind_for(self, namespace: &str) -> ReportKind {
        match (self, namespace.is_empty()) {
            (Self::Wgpolicy, false) => ReportKind::PolicyReport,
            (Self::Wgpolicy, true) => ReportKind::ClusterPolicyReport,
            (Self::Openreports, false) => ReportKind::Report,
            (Self::Openreports, true) => ReportKind::ClusterReport,
        }
    }
}

impl fmt::Display for OutputFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for OutputFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "wgpolicy" | "wgpolicyk8s.io" | "policyreport" => Ok(Self::Wgpolicy),
            "openreports" | "openreports.io" => Ok(Self::Openreports),
            _ => Err(Error::InvalidOption {
                option: "output",
                value: s.to_owned(),
                expected: Self::VALUES,
            }),
        }
    }
}

/// Knobs of the merge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MergeOptions {
    pub layout: Layout,
    /// Per-policy layout only: maximum results per report; 0 = no limit.
    pub chunk_size: usize,
    pub output: OutputFormat,
    /// Consume ephemeral reports that have no ownerReference, taking the subject from the
    /// labels and annotations Kyverno's webhook sets (uid, group/version/kind, name). Kyverno's
    /// own aggregator first "adopts" such reports by looking the resource up; with
    /// `--aggregateReports=false` nobody does, so without this they would pile up. Default true.
    pub adopt_unowned: bool,
}

impl Default for MergeOptions {
    fn default() -> Self {
        MergeOptions {
            layout: Layout::PerResource,
            chunk_size: DEFAULT_CHUNK_SIZE,
            output: OutputFormat::Wgpolicy,
            adopt_unowned: true,
        }
    }
}

/// The inputs of one merge. All objects must belong to `namespace` (`""` = cluster scope).
#[derive(Clone, Copy, Debug)]
pub struct MergeInput<'a> {
    pub namespace: &'a str,
    /// Current final reports (any final kind; unmanaged ones are only used to detect name
    /// collisions).
    pub reports: &'a [FinalReport],
    pub ephemerals: &'a [Ephemeral],
    /// The live policy set; `None` keeps every result (policy set unknown).
    pub policies: Option<&'a PolicySet>,
}

/// Counters describing one merge (for logs and metrics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MergeStats {
    /// Results read from all inputs.
    pub results_in: usize,
    /// Results in the desired reports.
    pub results_out: usize,
    /// Results dropped because their policy/rule is gone or report-disabled.
    pub dropped_by_policy: usize,
    /// Results that lost against another result with the same identity.
    pub superseded: usize,
    /// Results of a multi-subject report that name no subject (dropped).
    pub unattributed: usize,
    /// Ephemeral reports whose subject could not be determined (left untouched).
    pub ephemerals_without_subject: usize,
}

impl MergeStats {
    /// Adds another merge's counters (e.g. of the next page).
    pub fn add(&mut self, b: &MergeStats) {
        self.results_in += b.results_in;
        self.results_out += b.results_out;
        self.dropped_by_policy += b.dropped_by_policy;
        self.superseded += b.superseded;
        self.unattributed += b.unattributed;
        self.ephemerals_without_subject += b.ephemerals_without_subject;
    }
}

/// What a backend must do to reach the desired state. Applying it is expected to be atomic
/// (or at least: ephemeral deletes only after the writes succeeded).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// New reports (no uid/resourceVersion), sorted by kind and name.
    pub creates: Vec<FinalReport>,
    /// Full replacement objects; they keep the stored `resourceVersion` so that a backend can
    /// refuse a concurrent modification.
    pub updates: Vec<FinalReport>,
    /// Managed reports to delete.
    pub deletes: Vec<ObjectKey>,
    /// Consumed ephemeral reports to delete.
    pub ephemeral_deletes: Vec<ObjectKey>,
    /// Desired reports not written because an unmanaged report has the same name.
    pub conflicts: Vec<ObjectKey>,
    /// Multi-subject reports a page merge left alone (need a namespace-wide merge).
    pub skipped: Vec<ObjectKey>,
    pub stats: MergeStats,
}

impl Plan {
    /// Whether there is nothing to write or delete.
    pub fn is_empty(&self) -> bool {
        self.creates.is_empty()
            && self.updates.is_empty()
            && self.deletes.is_empty()
            && self.ephemeral_deletes.is_empty()
    }

    /// Appends another plan (e.g. of the next page).
    pub fn extend(&mut self, other: Plan) {
        self.creates.extend(other.creates);
        self.updates.extend(other.updates);
        self.deletes.extend(other.deletes);
        self.ephemeral_deletes.extend(other.ephemeral_deletes);
        self.conflicts.extend(other.conflicts);
        self.skipped.extend(other.skipped);
        self.stats.add(&other.stats);
    }

    /// Applies the plan to a set of final reports (pure; used by offline mode and the
    /// in-memory backend): deleted reports go, updated ones are replaced, created ones added.
    /// The result is sorted by (namespace, kind, name).
    pub fn apply_to(&self, reports: Vec<FinalReport>) -> Vec<FinalReport> {
        let ident = |k: &ObjectKey| (k.namespace.clone(), k.kind, k.name.clone());
        let deleted: BTreeSet<_> = self.deletes.iter().map(ident).collect();
        let mut by_id: BTreeMap<_, FinalReport> = reports
            .into_iter()
            .map(|r| (ident(&r.key()), r))
            .filter(|(id, _)| !deleted.contains(id))
            .collect();
        for r in self.updates.iter().chain(&self.creates) {
            by_id.insert(ident(&r.key()), r.clone());
        }
        by_id.into_values().collect()
    }
}

/// The resource a result is about.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct SubjectInfo {
    api_version: String,
    kind: String,
    name: String,
    uid: String,
}

impl SubjectInfo {
    fn from_reference(r: &ObjectReference) -> Self {
        SubjectInfo {
            api_version: r.api_version.clone().unwrap_or_default(),
            kind: r.kind.clone().unwrap_or_default(),
            name: r.name.clone().unwrap_or_default(),
            uid: r.uid.clone().unwrap_or_default(),
        }
    }

    fn from_owner(o: &OwnerReference, uid: &str) -> Self {
        SubjectInfo {
            api_version: o.api_version.clone(),
            kind: o.kind.clone(),
            name: o.name.clone(),
            uid: uid.to_owned(),
        }
    }

    /// `scope` of a per-resource report / `resources[0]` of a per-policy result: Kyverno
    /// writes the report's namespace, which disappears (omitempty) for cluster scope.
    fn reference(&self, namespace: &str) -> ObjectReference {
        let opt = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        ObjectReference {
            api_version: opt(&self.api_version),
            kind: opt(&self.kind),
            name: opt(&self.name),
            namespace: opt(namespace),
            uid: opt(&self.uid),
            ..Default::default()
        }
    }

    fn owner_reference(&self) -> Option<OwnerReference> {
        if self.api_version.is_empty() || self.kind.is_empty() || self.name.is_empty() {
            return None;
        }
        Some(OwnerReference {
            api_version: self.api_version.clone(),
            kind: self.kind.clone(),
            name: self.name.clone(),
            uid: self.uid.clone(),
            block_owner_deletion: None,
            controller: None,
        })
    }
}

/// Where subject information came from; the best source wins so that the choice does not
/// depend on input order: stored reports first, then ephemeral reports by name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum SubjectSource {
    Scope(String),
    ResultReference(String),
    Ephemeral(String),
}

/// Origin rank of a candidate: without resourceVersions, stored results beat ephemeral ones
/// on equal seconds.
const RANK_STORED: u8 = 0;
const RANK_EPHEMERAL: u8 = 1;

/// When the report carrying a result was written, as far as its metadata tells.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Written {
    /// `metadata.resourceVersion` as an integer (kube-apiserver's and ours are both integers
    /// that grow with every write).
    resource_version: Option<u64>,
    /// `metadata.creationTimestamp` in Unix milliseconds.
    created: Option<i64>,
}

impl Written {
    fn of(meta: &ObjectMeta) -> Self {
        Written {
            resource_version: meta
                .resource_version
                .as_deref()
                .and_then(|rv| rv.parse().ok()),
            created: meta
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.as_millisecond()),
        }
    }
}

struct Candidate<'a> {
    result: ReportResult,
    seconds: i64,
    rank: u8,
    written: Written,
    report: &'a str,
}

impl Candidate<'_> {
    /// Whether `self` should replace `current` (see the module docs for the order).
    fn beats(&self, current: &Candidate<'_>) -> bool {
        self.seconds
            .cmp(&current.seconds)
            .then_with(|| {
                self.written
                    .resource_version
                    .cmp(&current.written.resource_version)
            })
            .then_with(|| current.rank.cmp(&self.rank))
            .then_with(|| self.written.created.cmp(&current.written.created))
            .then_with(|| current.report.cmp(self.report))
            .then_with(|| canonical_json(&current.result).cmp(&canonical_json(&self.result)))
            .is_gt()
    }
}

/// Where a result comes from: the rank of its origin, when and in which report it was written.
#[derive(Clone, Copy)]
struct Origin<'a> {
    rank: u8,
    written: Written,
    report: &'a str,
}

impl<'a> Origin<'a> {
    fn stored(report: &'a FinalReport) -> Self {
        Origin {
            rank: RANK_STORED,
            written: Written::of(report.metadata()),
            report: report.name(),
        }
    }

    fn ephemeral(eph: &'a Ephemeral) -> Self {
        Origin {
            rank: RANK_EPHEMERAL,
            written: Written::of(eph.metadata()),
            report: eph.name(),
        }
    }
}

#[derive(Default)]
struct Accumulator<'a> {
    winners: HashMap<ResultKey, Candidate<'a>>,
    subjects: BTreeMap<String, (SubjectSource, SubjectInfo)>,
    stats: MergeStats,
}

impl<'a> Accumulator<'a> {
    fn subject(&mut self, uid: &str, source: SubjectSource, info: SubjectInfo) {
        match self.subjects.get_mut(uid) {
            Some(cur) if cur.0 <= source => {}
            Some(cur) => *cur = (source, info),
            None => {
                self.subjects.insert(uid.to_owned(), (source, info));
            }
        }
    }

    fn consider(
        &mut self,
        policies: Option<&PolicySet>,
        result: &ReportResult,
        uid: &str,
        origin: Origin<'a>,
    ) {
        self.stats.results_in += 1;
        if policies.is_some_and(|p| !p.allows(result)) {
            self.stats.dropped_by_policy += 1;
            return;
        }
        let mut r = result.clone();
        // The subject is carried by the key; the layout re-adds `resources` if it needs them.
        r.resources = None;
        normalize_result(&mut r);
        let candidate = Candidate {
            seconds: seconds(&r),
            result: r,
            rank: origin.rank,
            written: origin.written,
            report: origin.report,
        };
        let key = ResultKey::of(&candidate.result, uid);
        match self.winners.get_mut(&key) {
            None => {
                self.winners.insert(key, candidate);
            }
            Some(current) => {
                self.stats.superseded += 1;
                if candidate.beats(current) {
                    *current = candidate;
                }
            }
        }
    }
}

fn non_empty(s: Option<&str>) -> Option<&str> {
    s.filter(|s| !s.is_empty())
}

/// Namespace-wide merge: handles every layout and multi-subject (per-policy) reports.
pub fn merge_namespace(input: &MergeInput<'_>, options: &MergeOptions) -> Plan {
    merge_impl(input, options, false)
}

/// Merge of one page of subjects, for backends that stream a namespace. Only the per-resource
/// layout can be merged page by page; multi-subject reports are left alone
/// ([`Plan::skipped`]). The page must contain every input of each subject it covers.
pub fn merge_page(input: &MergeInput<'_>, options: &MergeOptions) -> Result<Plan, Error> {
    if options.layout != Layout::PerResource {
        return Err(Error::Unsupported(
            "only the per-resource layout can be merged page by page; use merge_namespace",
        ));
    }
    Ok(merge_impl(input, options, true))
}

/// Merge of one subject: the inputs are filtered to those about `subject_uid`, then merged like
/// a page. Useful for event-driven backends that key work by resource, as Kyverno does.
pub fn merge_subject(
    input: &MergeInput<'_>,
    subject_uid: &str,
    options: &MergeOptions,
) -> Result<Plan, Error> {
    let reports: Vec<FinalReport> = input
        .reports
        .iter()
        .filter(|r| {
            r.scope().and_then(|s| s.uid.as_deref()) == Some(subject_uid)
                || (r.name() == subject_uid && !r.is_managed())
        })
        .cloned()
        .collect();
    let ephemerals: Vec<Ephemeral> = input
        .ephemerals
        .iter()
        .filter(|e| e.subject_uid() == Some(subject_uid))
        .cloned()
        .collect();
    merge_page(
        &MergeInput {
            reports: &reports,
            ephemerals: &ephemerals,
            ..*input
        },
        options,
    )
}

struct Desired {
    results: Vec<ReportResult>,
    /// Subjects whose results feed this report (to keep their ephemerals on conflict).
    subjects: BTreeSet<String>,
    /// Per-resource: the subject for scope and ownerReference.
    subject: Option<SubjectInfo>,
    /// Per-policy: (label key, value).
    policy_label: Option<(String, String)>,
}

/// The stored reports of a namespace as the merge sees them.
#[derive(Default)]
struct Stored<'a> {
    /// Reports not managed by Kyverno: a desired report of that name is a conflict.
    unmanaged: BTreeSet<(ReportKind, &'a str)>,
    /// Managed reports, by kind and name.
    managed: BTreeMap<(ReportKind, &'a str), &'a FinalReport>,
}

/// The merge: the stored results and the ephemeral reports' results compete per (subject,
/// policy, rule) in Kyverno's order; the winners make the desired reports, and the plan is
/// the difference from what is stored.
fn merge_impl(input: &MergeInput<'_>, options: &MergeOptions, paged: bool) -> Plan {
    let ns = input.namespace;
    let output_kind = options.output.kind_for(ns);
    let mut acc = Accumulator::default();
    let mut plan = Plan::default();
    let stored = consider_stored(input, paged, &mut acc, &mut plan);
    let consumed = consider_ephemerals(input, options, &mut acc);
    let desired = match options.layout {
        Layout::PerResource => desired_per_resource(&mut acc),
        Layout::PerPolicy => desired_per_policy(&mut acc, ns, input.policies, options.chunk_size),
    };
    let blocked = plan_writes(ns, output_kind, &desired, &stored, &mut plan);
    for (uid, keys) in consumed {
        if !blocked.contains(&uid) {
            plan.ephemeral_deletes.extend(keys);
        }
    }
    plan.stats = MergeStats {
        results_out: plan.stats.results_out,
        ..acc.stats
    };
    plan.creates.sort_by_key(FinalReport::key);
    plan.updates.sort_by_key(FinalReport::key);
    plan.deletes.sort();
    plan.ephemeral_deletes.sort();
    plan.conflicts.sort();
    plan.skipped.sort();
    plan
}

/// Lets every result of the stored managed reports compete; a report without a scope is left
/// to the first page of a paged merge (`plan.skipped`).
fn consider_stored<'a>(
    input: &MergeInput<'a>,
    paged: bool,
    acc: &mut Accumulator<'a>,
    plan: &mut Plan,
) -> Stored<'a> {
    let mut stored = Stored::default();
    for report in input.reports {
        if !report.is_managed() {
            stored.unmanaged.insert((report.kind(), report.name()));
            continue;
        }
        let name = report.name();
        if let Some(scope) = report
            .scope()
            .filter(|s| non_empty(s.uid.as_deref()).is_some())
        {
            let uid = scope.uid.as_deref().unwrap_or_default();
            acc.subject(
                uid,
                SubjectSource::Scope(name.to_owned()),
                SubjectInfo::from_reference(scope),
            );
            for r in report.results() {
                acc.consider(input.policies, r, uid, Origin::stored(report));
            }
        } else {
            if paged {
                plan.skipped.push(report.key());
                continue;
            }
            for r in report.results() {
                let Some(subject) = r
                    .resources
                    .as_ref()
                    .and_then(|v| v.first())
                    .filter(|s| non_empty(s.uid.as_deref()).is_some())
                else {
                    acc.stats.results_in += 1;
                    acc.stats.unattributed += 1;
                    continue;
                };
                let uid = subject.uid.as_deref().unwrap_or_default();
                acc.subject(
                    uid,
                    SubjectSource::ResultReference(name.to_owned()),
                    SubjectInfo::from_reference(subject),
                );
                acc.consider(input.policies, r, uid, Origin::stored(report));
            }
        }
        stored.managed.insert((report.kind(), name), report);
    }
    stored
}

/// Lets every result of the ephemeral reports compete; answers the ephemeral reports consumed,
/// by subject.
fn consider_ephemerals<'a>(
    input: &MergeInput<'a>,
    options: &MergeOptions,
    acc: &mut Accumulator<'a>,
) -> BTreeMap<String, Vec<ObjectKey>> {
    let mut consumed: BTreeMap<String, Vec<ObjectKey>> = BTreeMap::new();
    for eph in input.ephemerals {
        let owner = match eph.owner() {
            Some(o) => Some(o.clone()),
            None if options.adopt_unowned => eph.owner_from_labels(),
            None => None,
        };
        let (Some(owner), Some(uid)) = (owner, eph.subject_uid()) else {
            acc.stats.ephemerals_without_subject += 1;
            continue;
        };
        let name = eph.name();
        acc.subject(
            uid,
            SubjectSource::Ephemeral(name.to_owned()),
            SubjectInfo::from_owner(&owner, uid),
        );
        for r in eph.results() {
            acc.consider(input.policies, r, uid, Origin::ephemeral(eph));
        }
        consumed.entry(uid.to_owned()).or_default().push(eph.key());
    }
    consumed
}

/// Creates, updates, deletes and conflicts that turn `stored` into `desired`; answers the
/// subjects whose report is blocked by an unmanaged one (their ephemerals stay).
fn plan_writes(
    ns: &str,
    output_kind: ReportKind,
    desired: &BTreeMap<String, Desired>,
    stored: &Stored<'_>,
    plan: &mut Plan,
) -> BTreeSet<String> {
    let mut blocked: BTreeSet<String> = BTreeSet::new();
    for (name, d) in desired {
        let key = (output_kind, name.as_str());
        if stored.unmanaged.contains(&key) {
            plan.conflicts.push(ObjectKey {
                kind: output_kind,
                namespace: ns.to_owned(),
                name: name.clone(),
                uid: None,
                resource_version: None,
            });
            blocked.extend(d.subjects.iter().cloned());
            continue;
        }
        plan.stats.results_out += d.results.len();
        match stored.managed.get(&key) {
            Some(existing) => {
                let mut updated = (*existing).clone();
                updated.set_results(d.results.clone());
                if let Some((label, value)) = &d.policy_label {
                    // Kyverno ≤ 1.10 rewrites its labels on every pass: everything containing
                    // `kyverno.io` goes, then managed-by and the policy label come back.
                    let labels = updated
                        .metadata_mut()
                        .labels
                        .get_or_insert_with(Default::default);
                    labels.retain(|k, _| !k.contains("kyverno.io"));
                    labels.insert(LABEL_MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned());
                    labels.insert(label.clone(), value.clone());
                }
                if &updated != *existing {
                    plan.updates.push(updated);
                }
            }
            None => plan.creates.push(new_report(output_kind, ns, name, d)),
        }
    }
    for ((kind, name), report) in &stored.managed {
        let superseded = !(*kind == output_kind && desired.contains_key(*name));
        // A report whose results could not be written (their new report's name is taken) is
        // the only copy of them: it stays until the conflict is resolved.
        if superseded && !subjects_of(report).any(|uid| blocked.contains(uid)) {
            plan.deletes.push(report.key());
        }
    }
    blocked
}

/// The subjects whose results a stored report holds: its scope's, or each result's first
/// resource (per-policy reports).
fn subjects_of(report: &FinalReport) -> impl Iterator<Item = &str> {
    let scope = report.scope().and_then(|s| non_empty(s.uid.as_deref()));
    let per_result = report
        .results()
        .iter()
        .filter_map(|r| r.resources.as_ref()?.first()?.uid.as_deref());
    scope.into_iter().chain(per_result)
}

fn desired_per_resource(acc: &mut Accumulator<'_>) -> BTreeMap<String, Desired> {
    let mut by_subject: BTreeMap<String, Vec<ReportResult>> = BTreeMap::new();
    for (key, c) in acc.winners.drain() {
        by_subject
            .entry(key.subject_uid)
            .or_default()
            .push(c.result);
    }
    by_subject
        .into_iter()
        .map(|(uid, mut results)| {
            sort_results(&mut results);
            let subject = acc.subjects.get(&uid).map(|(_, s)| s.clone());
            let d = Desired {
                results,
                subjects: BTreeSet::from([uid.clone()]),
                subject,
                policy_label: None,
            };
            (uid, d)
        })
        .collect()
}

fn desired_per_policy(
    acc: &mut Accumulator<'_>,
    ns: &str,
    policies: Option<&PolicySet>,
    chunk_size: usize,
) -> BTreeMap<String, Desired> {
    // Group by report base name: `cpol-<name>` for cluster-wide policies, `pol-<name>` for
    // namespaced `<ns>/<name>` ones (namespace part dropped, as Kyverno does).
    type Group = (Option<(String, String)>, Vec<(String, ReportResult)>);
    let mut groups: BTreeMap<String, Group> = BTreeMap::new();
    for (key, c) in acc.winners.drain() {
        let (base, label) = match c.result.policy.split_once('/') {
            Some((_, name)) => (format!("pol-{name}"), format!("pol.kyverno.io/{name}")),
            None => (
                format!("cpol-{}", c.result.policy),
                format!("cpol.kyverno.io/{}", c.result.policy),
            ),
        };
        let label_value = policies
            .and_then(|p| p.kyverno_policy(&c.result.policy))
            .and_then(|p| p.resource_version.clone())
            .unwrap_or_default();
        let entry = groups.entry(base).or_insert_with(|| (None, Vec::new()));
        // Several policies can share a base name (`ns/x` and cluster `x` in one namespace are
        // impossible, but a CEL policy can share a name with a ClusterPolicy); the label of the
        // lexicographically first policy is used so that the choice is stable.
        let candidate = (label, label_value);
        if entry.0.as_ref().is_none_or(|cur| candidate < *cur) {
            entry.0 = Some(candidate);
        }
        let mut r = c.result;
        let subject = acc
            .subjects
            .get(&key.subject_uid)
            .map(|(_, s)| s.clone())
            .unwrap_or_else(|| SubjectInfo {
                uid: key.subject_uid.clone(),
                ..Default::default()
            });
        r.resources = Some(vec![subject.reference(ns)]);
        entry.1.push((key.subject_uid, r));
    }
    let mut desired = BTreeMap::new();
    for (base, (label, mut items)) in groups {
        items.sort_by(|a, b| crate::results::compare_results(&a.1, &b.1));
        let size = if chunk_size == 0 {
            items.len().max(1)
        } else {
            chunk_size
        };
        for (i, chunk) in items.chunks(size).enumerate() {
            let name = if i == 0 {
                base.clone()
            } else {
                format!("{base}-{i}")
            };
            desired.insert(
                name,
                Desired {
                    results: chunk.iter().map(|(_, r)| r.clone()).collect(),
                    subjects: chunk.iter().map(|(u, _)| u.clone()).collect(),
                    subject: None,
                    policy_label: label.clone(),
                },
            );
        }
    }
    desired
}

fn new_report(kind: ReportKind, ns: &str, name: &str, d: &Desired) -> FinalReport {
    let mut labels = managed_labels();
    if let Some((k, v)) = &d.policy_label {
        labels.insert(k.clone(), v.clone());
    }
    let owner_references = d
        .subject
        .as_ref()
        .and_then(SubjectInfo::owner_reference)
        .map(|o| vec![o]);
    let mut report = FinalReport::new(
        kind,
        ObjectMeta {
            name: Some(name.to_owned()),
            namespace: (!ns.is_empty()).then(|| ns.to_owned()),
            labels: Some(labels),
            owner_references,
            ..Default::default()
        },
    );
    if let Some(subject) = &d.subject {
        report.set_scope(Some(subject.reference(ns)));
    }
    // Kyverno's PolicyReport→Report adapter writes `source: kyverno`; see docs/aggregation.md.
    report.set_source("kyverno");
    report.set_results(d.results.clone());
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use reports_server_crds::fixtures::{PSS_RULES, Subject, pss_ephemeral_report, pss_results};
    use reports_server_crds::{PolicyReport, Timestamp};

    fn pss_policies() -> PolicySet {
        let mut set = PolicySet::new();
        for (policy, rule, _) in PSS_RULES {
            let mut rules: Vec<String> = set
                .kyverno_policy(policy)
                .map(|p| p.rules.iter().cloned().collect())
                .unwrap_or_default();
            rules.push(rule.to_owned());
            set.insert_kyverno_policy(policy, rules);
        }
        set
    }

    fn eph(subject: &Subject, ts: i64, failing: &[usize]) -> Ephemeral {
        Ephemeral::Namespaced(pss_ephemeral_report(subject, ts, failing))
    }

    #[test]
    fn creates_one_report_per_subject() {
        let a = Subject::pod("ns", 1);
        let b = Subject::pod("ns", 2);
        let ephs = vec![eph(&a, 100, &[0]), eph(&b, 100, &[])];
        let policies = pss_policies();
        let plan = merge_namespace(
            &MergeInput {
                namespace: "ns",
                reports: &[],
                ephemerals: &ephs,
                policies: Some(&policies),
            },
            &MergeOptions::default(),
        );
        assert_eq!(plan.creates.len(), 2);
        assert_eq!(plan.ephemeral_deletes.len(), 2);
        let r = &plan.creates[0];
        assert_eq!(r.name(), a.uid.min(b.uid.clone()));
        assert_eq!(r.results().len(), 19);
        assert!(r.results().iter().all(|x| x.resources.is_none()));
        let owner = &r.metadata().owner_references.as_ref().unwrap()[0];
        assert_eq!(owner.controller, None);
        assert_eq!(owner.block_owner_deletion, None);
        assert_eq!(
            r.metadata().labels.as_ref().unwrap().len(),
            1,
            "only managed-by on creation"
        );
    }

    #[test]
    fn newer_seconds_win_and_ties_keep_the_stored_result() {
        let s = Subject::pod("ns", 1);
        let stored = {
            let mut r = PolicyReport {
                metadata: ObjectMeta {
                    name: Some(s.uid.clone()),
                    namespace: Some("ns".into()),
                    labels: Some(managed_labels()),
                    ..Default::default()
                },
                scope: Some(ObjectReference {
                    uid: Some(s.uid.clone()),
                    kind: Some("Pod".into()),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let mut results = pss_results(&s, 100, &[]);
            results[1].timestamp = Some(Timestamp {
                seconds: 300,
                nanos: 0,
            });
            for x in &mut results {
                x.resources = None;
            }
            r.results = Some(results);
            FinalReport::PolicyReport(r)
        };
        // Ephemeral: everything fails, rule 0 newer (200), rule 1 older (200 < 300), rule 2 tie.
        let mut e = pss_ephemeral_report(&s, 200, &[0, 1, 2]);
        let results = e.spec.results.as_mut().unwrap();
        results[2].timestamp = Some(Timestamp {
            seconds: 100,
            nanos: 0,
        });
        let ephs = vec![Ephemeral::Namespaced(e)];
        let plan = merge_namespace(
            &MergeInput {
                namespace: "ns",
                reports: std::slice::from_ref(&stored),
                ephemerals: &ephs,
                policies: None,
            },
            &MergeOptions::default(),
        );
        assert_eq!(plan.updates.len(), 1);
        let out = plan.updates[0].results();
        let find = |rule: &str| {
            out.iter()
                .find(|r| r.rule.as_deref() == Some(rule))
                .unwrap()
        };
        use reports_server_crds::PolicyResult::*;
        assert_eq!(find(PSS_RULES[0].1).result, Some(Fail));
        assert_eq!(find(PSS_RULES[1].1).result, Some(Pass));
        assert_eq!(
            find(PSS_RULES[2].1).result,
            Some(Pass),
            "tie keeps the stored one"
        );
    }

    /// Seen with a real Kyverno: two background-scan reports for one Pod within the same second,
    /// `fail` and then `skip` once a PolicyException exists. The later write must win whatever
    /// the random name suffixes say, against stored results too.
    #[test]
    fn same_second_ties_go_to_the_report_written_last() {
        use reports_server_crds::PolicyResult::*;
        let s = Subject::pod("ns", 1);
        let report = |name: &str, rv: &str, result| {
            let mut e = pss_ephemeral_report(&s, 500, &[]);
            e.metadata.name = Some(name.into());
            e.metadata.resource_version = Some(rv.into());
            for r in e.spec.results.as_mut().unwrap() {
                r.result = Some(result);
            }
            Ephemeral::Namespaced(e)
        };
        let merge = |reports: &[FinalReport], ephs: &[Ephemeral]| {
            let plan = merge_namespace(
                &MergeInput {
                    namespace: "ns",
                    reports,
                    ephemerals: ephs,
                    policies: None,
                },
                &MergeOptions::default(),
            );
            let written = plan.creates.iter().chain(&plan.updates).next().cloned();
            (plan, written)
        };
        let first_result = |r: &FinalReport| r.results()[0].result;

        // Ephemeral against ephemeral, in both input orders: the name sorting first is older.
        for ephs in [
            vec![report("a-old", "10", Fail), report("z-new", "12", Skip)],
            vec![report("z-new", "12", Skip), report("a-old", "10", Fail)],
        ] {
            let (_, created) = merge(&[], &ephs);
            assert_eq!(first_result(&created.unwrap()), Some(Skip));
        }
        // Stored against ephemeral: the stored report (rv 20) holds the merged `fail`.
        let (_, stored) = merge(&[], &[report("a-old", "10", Fail)]);
        let mut stored = stored.unwrap();
        stored.metadata_mut().uid = Some("report-uid".into());
        stored.metadata_mut().resource_version = Some("20".into());
        // A newer scan in the same second (rv 25) replaces it.
        let (_, updated) = merge(
            std::slice::from_ref(&stored),
            &[report("z-new", "25", Skip)],
        );
        assert_eq!(first_result(&updated.unwrap()), Some(Skip));
        // An input older than the stored report (its deletion was interrupted by a crash after
        // the merged report was written) changes nothing.
        let (plan, updated) = merge(
            std::slice::from_ref(&stored),
            &[report("z-older", "15", Skip)],
        );
        assert!(updated.is_none(), "{plan:?}");
        assert_eq!(plan.ephemeral_deletes.len(), 1);
    }

    #[test]
    fn unmanaged_collision_is_a_conflict_and_keeps_ephemerals() {
        let s = Subject::pod("ns", 1);
        let foreign = FinalReport::PolicyReport(PolicyReport {
            metadata: ObjectMeta {
                name: Some(s.uid.clone()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        });
        let ephs = vec![eph(&s, 1, &[])];
        let plan = merge_namespace(
            &MergeInput {
                namespace: "ns",
                reports: std::slice::from_ref(&foreign),
                ephemerals: &ephs,
                policies: None,
            },
            &MergeOptions::default(),
        );
        assert!(plan.is_empty(), "{plan:?}");
        assert_eq!(plan.conflicts.len(), 1);
    }

    /// After a switch of the output group, the old group's copy is the only place its results
    /// live while the new report's name is taken by someone else's report: it is not deleted.
    #[test]
    fn a_blocked_subject_keeps_its_other_group_copy() {
        let s = Subject::pod("ns", 1);
        let mut old_copy = FinalReport::PolicyReport(PolicyReport {
            metadata: ObjectMeta {
                name: Some(s.uid.clone()),
                namespace: Some("ns".into()),
                labels: Some(managed_labels()),
                resource_version: Some("5".into()),
                ..Default::default()
            },
            ..Default::default()
        });
        old_copy.set_scope(Some(ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(s.name.clone()),
            namespace: Some("ns".into()),
            uid: Some(s.uid.clone()),
            ..Default::default()
        }));
        old_copy.set_results(eph(&s, 1, &[]).results().to_vec());
        let foreign = FinalReport::new(
            ReportKind::Report,
            ObjectMeta {
                name: Some(s.uid.clone()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
        );
        let reports = vec![old_copy, foreign];
        let options = MergeOptions {
            output: OutputFormat::Openreports,
            ..Default::default()
        };
        let plan = merge_namespace(
            &MergeInput {
                namespace: "ns",
                reports: &reports,
                ephemerals: &[],
                policies: None,
            },
            &options,
        );
        assert_eq!(plan.conflicts.len(), 1, "{plan:?}");
        assert!(
            plan.is_empty(),
            "the only copy of the results was touched: {plan:?}"
        );

        // Without the foreign report the copy moves: created in the new group, deleted in the old.
        let plan = merge_namespace(
            &MergeInput {
                namespace: "ns",
                reports: &reports[..1],
                ephemerals: &[],
                policies: None,
            },
            &options,
        );
        assert_eq!(plan.creates.len(), 1, "{plan:?}");
        assert_eq!(plan.creates[0].kind(), ReportKind::Report);
        assert_eq!(plan.creates[0].results().len(), reports[0].results().len());
        assert_eq!(plan.deletes, vec![reports[0].key()]);
    }

    #[test]
    fn page_merge_rejects_per_policy_layout() {
        let opts = MergeOptions {
            layout: Layout::PerPolicy,
            ..Default::default()
        };
        let input = MergeInput {
            namespace: "ns",
            reports: &[],
            ephemerals: &[],
            policies: None,
        };
        assert!(merge_page(&input, &opts).is_err());
    }

    #[test]
    fn options_parse_and_display() {
        for l in [Layout::PerResource, Layout::PerPolicy] {
            assert_eq!(l.to_string().parse::<Layout>().unwrap(), l);
        }
        for o in [OutputFormat::Wgpolicy, OutputFormat::Openreports] {
            assert_eq!(o.to_string().parse::<OutputFormat>().unwrap(), o);
        }
        assert!("per-namespace".parse::<Layout>().is_err());
    }
}
