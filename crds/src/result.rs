//! The pieces every report kind shares: one policy result, the summary counters and the
//! result/severity enums.
//!
//! Field order follows the upstream Go structs so that objects we serialize read the same as the
//! ones Kyverno writes. Every optional field is an `Option` so that an object read from a client
//! is written back exactly as it came (lossless round trip); the CRDs' `required` lists are the
//! only fields that are not optional.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The outcome of evaluating one policy rule against one subject.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum PolicyResult {
    Pass,
    Fail,
    Warn,
    Error,
    Skip,
}

impl PolicyResult {
    pub const ALL: [PolicyResult; 5] =
        [Self::Pass, Self::Fail, Self::Warn, Self::Error, Self::Skip];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pass => "pass",
            Self::Fail => "fail",
            Self::Warn => "warn",
            Self::Error => "error",
            Self::Skip => "skip",
        }
    }
}

/// How critical a failing result is. The order of variants is the upstream enum order.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Critical,
    High,
    Low,
    Medium,
    Info,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Critical => "critical",
            Self::High => "high",
            Self::Low => "low",
            Self::Medium => "medium",
            Self::Info => "info",
        }
    }
}

/// A protobuf-style timestamp, as the report CRDs carry it.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    JsonSchema,
)]
pub struct Timestamp {
    /// Represents seconds of UTC time since Unix epoch 1970-01-01T00:00:00Z.
    pub seconds: i64,
    /// Non-negative fractions of a second at nanosecond resolution.
    pub nanos: i32,
}

/// PolicyReportResult provides the result for an individual policy
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReportResult {
    /// Source is an identifier for the policy engine that manages this report
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Policy is the name or identifier of the policy
    pub policy: String,
    /// Rule is the name or identifier of the rule within the policy
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// Category indicates policy category
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub category: Option<String>,
    /// Severity indicates policy check result criticality
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub severity: Option<Severity>,
    /// Timestamp indicates the time the result was found
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<Timestamp>,
    /// Result indicates the outcome of the policy rule execution
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<PolicyResult>,
    /// Scored indicates if this result is scored
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scored: Option<bool>,
    /// Subjects is an optional reference to the checked Kubernetes resources
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Vec<ObjectReference>>,
    /// SubjectSelector is an optional label selector for checked Kubernetes resources.
    /// For example, a policy result may apply to all pods that match a label.
    /// Either a Subject or a SubjectSelector can be specified.
    /// If neither are provided, the result is assumed to be for the policy report scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_selector: Option<LabelSelector>,
    /// Description is a short user friendly message for the policy rule
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Properties provides additional information for the policy rule
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub properties: Option<BTreeMap<String, String>>,
}

impl ReportResult {
    /// The UIDs of the subjects this result is about, in order.
    pub fn subject_uids(&self) -> impl Iterator<Item = &str> {
        self.resources
            .iter()
            .flatten()
            .filter_map(|r| r.uid.as_deref())
    }
}

/// PolicyReportSummary provides a summary of results
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Summary {
    /// Pass provides the count of policies whose requirements were met
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::plain_integer")]
    pub pass: Option<i64>,
    /// Fail provides the count of policies whose requirements were not met
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::plain_integer")]
    pub fail: Option<i64>,
    /// Warn provides the count of non-scored policies whose requirements were not met
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::plain_integer")]
    pub warn: Option<i64>,
    /// Error provides the count of policies that could not be evaluated
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::plain_integer")]
    pub error: Option<i64>,
    /// Skip indicates the count of policies that were not selected for evaluation
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::plain_integer")]
    pub skip: Option<i64>,
}

impl Summary {
    /// Counts results the way Kyverno does: all five counters present, zeros included.
    pub fn of<'a>(results: impl IntoIterator<Item = &'a ReportResult>) -> Self {
        let mut counts = [0i64; 5];
        for r in results {
            if let Some(outcome) = r.result {
                counts[outcome as usize] += 1;
            }
        }
        Summary {
            pass: Some(counts[0]),
            fail: Some(counts[1]),
            warn: Some(counts[2]),
            error: Some(counts[3]),
            skip: Some(counts[4]),
        }
    }

    /// The counter for one outcome, zero when absent.
    pub fn count(&self, outcome: PolicyResult) -> i64 {
        match outcome {
            PolicyResult::Pass => self.pass,
            PolicyResult::Fail => self.fail,
            PolicyResult::Warn => self.warn,
            PolicyResult::Error => self.error,
            PolicyResult::Skip => self.skip,
        }
        .unwrap_or(0)
    }
}
