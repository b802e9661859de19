//! The six served report kinds as plain serde structs.
//!
//! PolicyReport and friends keep `scope`, `summary` and `results` at the top level (there is no
//! `spec`), so kube-derive's `CustomResource` does not fit; the structs implement
//! `k8s_openapi::Resource` by hand, which also makes them usable with `kube::Api`.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::result::{PolicyResult, ReportResult, Summary};

/// Implements the k8s-openapi traits (and therefore `kube::Resource`) for a report struct, plus a
/// `Default` that fills `apiVersion` and `kind`.
macro_rules! report_resource {
    ($ty:ident, $list:ident, group = $group:literal, version = $version:literal, kind = $kind:literal, plural = $plural:literal, scope = $scope:ty) => {
        impl k8s_openapi::Resource for $ty {
            const API_VERSION: &'static str = concat!($group, "/", $version);
            const GROUP: &'static str = $group;
            const KIND: &'static str = $kind;
            const VERSION: &'static str = $version;
            const URL_PATH_SEGMENT: &'static str = $plural;
            type Scope = $scope;
        }

        impl k8s_openapi::ListableResource for $ty {
            const LIST_KIND: &'static str = concat!($kind, "List");
        }

        impl k8s_openapi::Metadata for $ty {
            type Ty = ObjectMeta;
            fn metadata(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn metadata_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }

        impl Default for $ty {
            fn default() -> Self {
                Self {
                    api_version: Some(<Self as k8s_openapi::Resource>::API_VERSION.to_owned()),
                    kind: Some(<Self as k8s_openapi::Resource>::KIND.to_owned()),
                    metadata: ObjectMeta::default(),
                    ..$ty::EMPTY
                }
            }
        }

        #[doc = concat!("A list of ", $kind, " objects.")]
        pub type $list = k8s_openapi::List<$ty>;
    };
}

/// Declares a wgpolicyk8s.io-style report: `scope`, `scopeSelector`, `summary`, `results` at the
/// top level.
macro_rules! policy_report_struct {
    ($(#[$doc:meta])* $ty:ident { $($(#[$fdoc:meta])* $field:ident : $fty:ty,)* }) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
        #[serde(rename_all = "camelCase")]
        pub struct $ty {
            /// APIVersion defines the versioned schema of this representation of an object.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub api_version: Option<String>,
            /// Kind is a string value representing the REST resource this object represents.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub kind: Option<String>,
            #[serde(default)]
            pub metadata: ObjectMeta,
            $($(#[$fdoc])* #[serde(default, skip_serializing_if = "Option::is_none")] pub $field: $fty,)*
            /// Scope is an optional reference to the report scope (e.g. a Deployment, Namespace, or Node)
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub scope: Option<ObjectReference>,
            /// ScopeSelector is an optional selector for multiple scopes (e.g. Pods).
            /// Either one of, or none of, but not both of, Scope or ScopeSelector should be specified.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub scope_selector: Option<LabelSelector>,
            /// PolicyReportSummary provides a summary of results
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub summary: Option<Summary>,
            /// PolicyReportResult provides result details
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub results: Option<Vec<ReportResult>>,
        }

        impl $ty {
            const EMPTY: Self = Self {
                api_version: None,
                kind: None,
                metadata: ObjectMeta {
                    annotations: None, creation_timestamp: None, deletion_grace_period_seconds: None,
                    deletion_timestamp: None, finalizers: None, generate_name: None, generation: None,
                    labels: None, managed_fields: None, name: None, namespace: None,
                    owner_references: None, resource_version: None, self_link: None, uid: None,
                },
                $($field: None,)*
                scope: None,
                scope_selector: None,
                summary: None,
                results: None,
            };
        }

        impl ReportBody for $ty {
            fn results(&self) -> &[ReportResult] {
                self.results.as_deref().unwrap_or_default()
            }
            fn results_mut(&mut self) -> &mut Vec<ReportResult> {
                self.results.get_or_insert_with(Vec::new)
            }
            fn summary(&self) -> Option<&Summary> {
                self.summary.as_ref()
            }
            fn set_summary(&mut self, summary: Summary) {
                self.summary = Some(summary);
            }
            fn scope(&self) -> Option<&ObjectReference> {
                self.scope.as_ref()
            }
        }
    };
}

/// Declares a reports.kyverno.io-style intermediate report: everything under `spec`.
macro_rules! ephemeral_report_struct {
    ($(#[$doc:meta])* $ty:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
        #[serde(rename_all = "camelCase")]
        pub struct $ty {
            /// APIVersion defines the versioned schema of this representation of an object.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub api_version: Option<String>,
            /// Kind is a string value representing the REST resource this object represents.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub kind: Option<String>,
            #[serde(default)]
            pub metadata: ObjectMeta,
            pub spec: EphemeralReportSpec,
        }

        impl $ty {
            const EMPTY: Self = Self {
                api_version: None,
                kind: None,
                metadata: ObjectMeta {
                    annotations: None, creation_timestamp: None, deletion_grace_period_seconds: None,
                    deletion_timestamp: None, finalizers: None, generate_name: None, generation: None,
                    labels: None, managed_fields: None, name: None, namespace: None,
                    owner_references: None, resource_version: None, self_link: None, uid: None,
                },
                spec: EphemeralReportSpec {
                    owner: OwnerReference {
                        api_version: String::new(),
                        block_owner_deletion: None,
                        controller: None,
                        kind: String::new(),
                        name: String::new(),
                        uid: String::new(),
                    },
                    summary: None,
                    results: None,
                },
            };
        }

        impl ReportBody for $ty {
            fn results(&self) -> &[ReportResult] {
                self.spec.results.as_deref().unwrap_or_default()
            }
            fn results_mut(&mut self) -> &mut Vec<ReportResult> {
                self.spec.results.get_or_insert_with(Vec::new)
            }
            fn summary(&self) -> Option<&Summary> {
                self.spec.summary.as_ref()
            }
            fn set_summary(&mut self, summary: Summary) {
                self.spec.summary = Some(summary);
            }
            fn scope(&self) -> Option<&ObjectReference> {
                None
            }
        }
    };
}

/// Access to the parts every report kind has, whatever its layout.
pub trait ReportBody {
    fn results(&self) -> &[ReportResult];
    fn results_mut(&mut self) -> &mut Vec<ReportResult>;
    fn summary(&self) -> Option<&Summary>;
    fn set_summary(&mut self, summary: Summary);
    fn scope(&self) -> Option<&ObjectReference>;

    /// Recomputes `summary` from `results`, all five counters present.
    fn recompute_summary(&mut self) {
        let summary = Summary::of(self.results());
        self.set_summary(summary);
    }

    /// Counts results with one outcome, from the results themselves.
    fn count_results(&self, outcome: PolicyResult) -> usize {
        self.results()
            .iter()
            .filter(|r| r.result == Some(outcome))
            .count()
    }
}

/// The body of an EphemeralReport / ClusterEphemeralReport.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EphemeralReportSpec {
    /// Owner is a reference to the report owner (e.g. a Deployment, Namespace, or Node)
    pub owner: OwnerReference,
    /// PolicyReportSummary provides a summary of results
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<Summary>,
    /// PolicyReportResult provides result details
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub results: Option<Vec<ReportResult>>,
}

/// Configuration is an optional field which can be used to specify
/// a contract between Report generators and consumers
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReportConfiguration {
    pub limits: ReportLimits,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReportLimits {
    /// MaxResults is the maximum number of results contained in the report
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::plain_integer")]
    pub max_results: Option<i64>,
    /// StatusFilter indicates that the Report contains only those reports with statuses specified in this list
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_filter: Option<Vec<PolicyResult>>,
}

policy_report_struct! {
    /// PolicyReport is the Schema for the policyreports API
    PolicyReport {}
}
policy_report_struct! {
    /// ClusterPolicyReport is the Schema for the clusterpolicyreports API
    ClusterPolicyReport {}
}
policy_report_struct! {
    /// Report is the Schema for the reports API
    Report {
        /// Source is an identifier for the source e.g. a policy engine that manages this report.
        source: Option<String>,
        /// Configuration is an optional field which can be used to specify
        /// a contract between Report generators and consumers
        configuration: Option<ReportConfiguration>,
    }
}
policy_report_struct! {
    /// ClusterReport is the Schema for the clusterreports API
    ClusterReport {
        /// Source is an identifier for the source e.g. a policy engine that manages this report.
        source: Option<String>,
        /// Configuration is an optional field which can be used to specify
        /// a contract between Report generators and consumers
        configuration: Option<ReportConfiguration>,
    }
}
ephemeral_report_struct! {
    /// EphemeralReport is the Schema for the EphemeralReports API
    EphemeralReport
}
ephemeral_report_struct! {
    /// ClusterEphemeralReport is the Schema for the ClusterEphemeralReports API
    ClusterEphemeralReport
}

use k8s_openapi::{ClusterResourceScope, NamespaceResourceScope};
report_resource!(
    PolicyReport,
    PolicyReportList,
    group = "wgpolicyk8s.io",
    version = "v1alpha2",
    kind = "PolicyReport",
    plural = "policyreports",
    scope = NamespaceResourceScope
);
report_resource!(
    ClusterPolicyReport,
    ClusterPolicyReportList,
    group = "wgpolicyk8s.io",
    version = "v1alpha2",
    kind = "ClusterPolicyReport",
    plural = "clusterpolicyreports",
    scope = ClusterResourceScope
);
report_resource!(
    EphemeralReport,
    EphemeralReportList,
    group = "reports.kyverno.io",
    version = "v1",
    kind = "EphemeralReport",
    plural = "ephemeralreports",
    scope = NamespaceResourceScope
);
report_resource!(
    ClusterEphemeralReport,
    ClusterEphemeralReportList,
    group = "reports.kyverno.io",
    version = "v1",
    kind = "ClusterEphemeralReport",
    plural = "clusterephemeralreports",
    scope = ClusterResourceScope
);
report_resource!(
    Report,
    ReportList,
    group = "openreports.io",
    version = "v1alpha1",
    kind = "Report",
    plural = "reports",
    scope = NamespaceResourceScope
);
report_resource!(
    ClusterReport,
    ClusterReportList,
    group = "openreports.io",
    version = "v1alpha1",
    kind = "ClusterReport",
    plural = "clusterreports",
    scope = ClusterResourceScope
);
