//! Table and column identifiers of the store, in one place for the queries and the migrations.
//!
//! Migrations create and alter tables through these names; queries read and write through
//! them. Renaming a table or column therefore takes a new migration that renames it, and the
//! older migrations must keep creating the old name (give them a local identifier then).

use sea_orm_migration::prelude::*;

#[derive(DeriveIden)]
pub enum Objects {
    Table,
    Id,
    ClusterId,
    Resource,
    Namespace,
    Name,
    Uid,
    ResourceVersion,
    Generation,
    CreatedAt,
    DeletedAt,
    OwnerUids,
    SummaryPass,
    SummaryFail,
    SummaryWarn,
    SummaryError,
    SummarySkip,
    ScopeKind,
    ScopeNamespace,
    ScopeName,
    ScopeUid,
    Metadata,
    Body,
    /// The timestamp (seconds) most of the report's results carry, which its `results` rows
    /// without `own_timestamp` stand for (since `m20261129_000012_report_result_timestamp`).
    ResultsTimestamp,
}

#[derive(DeriveIden)]
pub enum ObjectLabels {
    Table,
    ObjectId,
    Key,
    Value,
}

#[derive(DeriveIden)]
pub enum Changes {
    Table,
    ClusterId,
    Rv,
    Resource,
    Namespace,
    Name,
    EventType,
    Labels,
    PrevLabels,
    Body,
    CreatedAt,
}

#[derive(DeriveIden)]
pub enum StoreState {
    Table,
    ClusterId,
    Rv,
    CompactedRv,
    /// The cluster the id belongs to (since `m20261128_000010_cluster_identity`).
    ClusterUid,
}

/// One row per policy result of a stored report (since `m20261125_000005_lean_results`; the
/// initial migration's wider table has an identifier of its own there).
#[derive(DeriveIden)]
pub enum Results {
    Table,
    /// The report's `objects.id`: cluster, resource, namespace and name come from there.
    ObjectId,
    /// The row's slot in its report: its position in `results` when the report was created;
    /// an update keeps the slots of unchanged results (see `store::result_diff`).
    Ordinal,
    /// `policy_rules.id`: source, policy, rule, category, severity and scored.
    RuleId,
    Result,
    /// Whether the result names a subject other than the report's scope; when false the
    /// subject columns other than `subject_api_version` are NULL and the scope is the subject.
    OwnSubject,
    SubjectApiVersion,
    SubjectKind,
    SubjectNamespace,
    SubjectName,
    SubjectUid,
    /// The result's own timestamp (seconds), or NULL: see `OwnTimestamp`.
    Timestamp,
    Message,
    Properties,
    /// Whether `timestamp` is the result's own; when false the result has its report's
    /// `objects.results_timestamp` (since `m20261129_000012_report_result_timestamp`).
    OwnTimestamp,
}

/// What every result of one policy rule shares, stored once (see `store::rules`).
#[derive(DeriveIden)]
pub enum PolicyRules {
    Table,
    Id,
    Source,
    Policy,
    Rule,
    Category,
    Severity,
    Scored,
}

#[derive(DeriveIden)]
pub enum Leases {
    Table,
    /// Lease name, e.g. `aggregator/<cluster id>`.
    Name,
    /// Identity of the current holder; `""` when released.
    Holder,
    /// Holder's wall clock at the last acquire or renew, in Unix milliseconds. Strictly
    /// increases while a holder renews, so observers can tell a live lease from a dead one.
    RenewedAt,
    /// `renewed_at` + lease duration (informational: takeover is decided on the observer's own
    /// clock, see `store::lease`).
    ExpiresAt,
}

/// One row per compliance snapshot a cluster took (since
/// `m20261128_000011_compliance_history`): a snapshot of a cluster without any result is still
/// a point of its history.
#[derive(DeriveIden)]
pub enum ComplianceSnapshots {
    Table,
    ClusterId,
    /// Unix seconds (UTC) when the snapshot was taken.
    TakenAt,
}

/// The counts of one snapshot per namespace, source and policy.
#[derive(DeriveIden)]
pub enum ComplianceHistory {
    Table,
    ClusterId,
    TakenAt,
    /// `""` for cluster-scoped reports.
    Namespace,
    /// `""` when results name no source.
    Source,
    Policy,
    Pass,
    Fail,
    Warn,
    Error,
    Skip,
}
