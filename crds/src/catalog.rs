//! The static catalog of served resources: names, scope, printer columns and the functions that
//! validate and describe each kind. Discovery, routing, tables, OpenAPI and CRD generation all
//! read from here, so a kind is described exactly once.

use schemars::Schema;
use serde_json::Value;

use crate::kinds::*;
use crate::schema::{SchemaError, normalize_object, structural_schema};

/// A column of `kubectl get` output (a CRD `additionalPrinterColumn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrinterColumn {
    pub name: &'static str,
    /// OpenAPI type: `string`, `integer` or `date`.
    pub type_: &'static str,
    pub json_path: &'static str,
    pub priority: i32,
    pub description: &'static str,
}

/// Everything the server needs to know about one served resource.
#[derive(Clone, Copy)]
pub struct ResourceDescriptor {
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    pub list_kind: &'static str,
    pub plural: &'static str,
    pub singular: &'static str,
    pub short_names: &'static [&'static str],
    pub categories: &'static [&'static str],
    pub namespaced: bool,
    pub printer_columns: &'static [PrinterColumn],
    /// Where the summary counters sit in the object (`summary` or `spec.summary`).
    pub layout: ReportLayout,
    schema: fn() -> Schema,
    normalize: fn(&Value) -> Result<Value, SchemaError>,
}

/// Where a kind keeps its summary, results and scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportLayout {
    /// `scope`, `summary`, `results` at the top level.
    TopLevel,
    /// `spec.owner`, `spec.summary`, `spec.results`.
    Spec,
}

impl std::fmt::Debug for ResourceDescriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}/{}", self.plural, self.group, self.version)
    }
}

impl PartialEq for ResourceDescriptor {
    fn eq(&self, other: &Self) -> bool {
        self.group == other.group && self.version == other.version && self.plural == other.plural
    }
}
impl Eq for ResourceDescriptor {}

impl ResourceDescriptor {
    /// `group/version`, the `apiVersion` of objects of this kind.
    pub fn api_version(&self) -> String {
        format!("{}/{}", self.group, self.version)
    }

    /// The CRD name, `<plural>.<group>`.
    pub fn crd_name(&self) -> String {
        format!("{}.{}", self.plural, self.group)
    }

    /// The OpenAPI v3 schema of the kind in CRD (structural) form.
    pub fn schema(&self) -> Value {
        structural_schema((self.schema)())
    }

    /// Checks an object against the kind's types and returns it in canonical form: fields not in
    /// the schema are pruned, as CRD storage does, and everything else is kept as sent.
    pub fn normalize(&self, object: &Value) -> Result<Value, SchemaError> {
        (self.normalize)(object)
    }
}

const fn col(
    name: &'static str,
    type_: &'static str,
    json_path: &'static str,
    priority: i32,
) -> PrinterColumn {
    PrinterColumn {
        name,
        type_,
        json_path,
        priority,
        description: "",
    }
}

const SUMMARY_COLUMNS_TOP: [PrinterColumn; 5] = [
    col("Pass", "integer", ".summary.pass", 0),
    col("Fail", "integer", ".summary.fail", 0),
    col("Warn", "integer", ".summary.warn", 0),
    col("Error", "integer", ".summary.error", 0),
    col("Skip", "integer", ".summary.skip", 0),
];
const AGE: PrinterColumn = col("Age", "date", ".metadata.creationTimestamp", 0);

const POLICY_REPORT_COLUMNS: &[PrinterColumn] = &[
    col("Kind", "string", ".scope.kind", 0),
    col("Name", "string", ".scope.name", 0),
    SUMMARY_COLUMNS_TOP[0],
    SUMMARY_COLUMNS_TOP[1],
    SUMMARY_COLUMNS_TOP[2],
    SUMMARY_COLUMNS_TOP[3],
    SUMMARY_COLUMNS_TOP[4],
    AGE,
];

const OPENREPORTS_COLUMNS: &[PrinterColumn] = &[
    col("Kind", "string", ".scope.kind", 1),
    col("Name", "string", ".scope.name", 1),
    SUMMARY_COLUMNS_TOP[0],
    SUMMARY_COLUMNS_TOP[1],
    SUMMARY_COLUMNS_TOP[2],
    SUMMARY_COLUMNS_TOP[3],
    SUMMARY_COLUMNS_TOP[4],
    AGE,
];

const EPHEMERAL_COLUMNS: &[PrinterColumn] = &[
    EPHEMERAL_COLUMNS_BASE[0],
    EPHEMERAL_COLUMNS_BASE[1],
    EPHEMERAL_COLUMNS_BASE[2],
    EPHEMERAL_COLUMNS_BASE[3],
    EPHEMERAL_COLUMNS_BASE[4],
    EPHEMERAL_COLUMNS_BASE[5],
    EPHEMERAL_COLUMNS_BASE[6],
    EPHEMERAL_COLUMNS_BASE[7],
    EPHEMERAL_COLUMNS_BASE[8],
    EPHEMERAL_COLUMNS_BASE[9],
    col(
        "Uid",
        "string",
        r".metadata.labels['audit\.kyverno\.io/resource\.uid']",
        1,
    ),
    col(
        "Hash",
        "string",
        r".metadata.labels['audit\.kyverno\.io/resource\.hash']",
        1,
    ),
];

/// Upstream's ClusterEphemeralReport shows the subject UID by default (no priority), unlike the
/// namespaced kind; kept as upstream has it so `kubectl get` output is identical.
const CLUSTER_EPHEMERAL_COLUMNS: &[PrinterColumn] = &[
    EPHEMERAL_COLUMNS_BASE[0],
    EPHEMERAL_COLUMNS_BASE[1],
    EPHEMERAL_COLUMNS_BASE[2],
    EPHEMERAL_COLUMNS_BASE[3],
    EPHEMERAL_COLUMNS_BASE[4],
    EPHEMERAL_COLUMNS_BASE[5],
    EPHEMERAL_COLUMNS_BASE[6],
    EPHEMERAL_COLUMNS_BASE[7],
    EPHEMERAL_COLUMNS_BASE[8],
    EPHEMERAL_COLUMNS_BASE[9],
    col(
        "Uid",
        "string",
        r".metadata.labels['audit\.kyverno\.io/resource\.uid']",
        0,
    ),
    col(
        "Hash",
        "string",
        r".metadata.labels['audit\.kyverno\.io/resource\.hash']",
        1,
    ),
];

const EPHEMERAL_COLUMNS_BASE: [PrinterColumn; 10] = [
    col(
        "Source",
        "string",
        r".metadata.labels['audit\.kyverno\.io/source']",
        0,
    ),
    col(
        "Group",
        "string",
        r".metadata.labels['audit\.kyverno\.io/resource\.group']",
        0,
    ),
    col(
        "Kind",
        "string",
        r".metadata.labels['audit\.kyverno\.io/resource\.kind']",
        0,
    ),
    col(
        "Owner",
        "string",
        r".metadata.annotations['audit\.kyverno\.io/resource\.name']",
        0,
    ),
    col("Pass", "integer", ".spec.summary.pass", 0),
    col("Fail", "integer", ".spec.summary.fail", 0),
    col("Warn", "integer", ".spec.summary.warn", 0),
    col("Error", "integer", ".spec.summary.error", 0),
    col("Skip", "integer", ".spec.summary.skip", 0),
    AGE,
];

macro_rules! descriptor {
    ($ty:ty, singular = $singular:literal, short = [$($short:literal),*], categories = [$($cat:literal),*], namespaced = $ns:literal, columns = $cols:expr, layout = $layout:expr) => {
        ResourceDescriptor {
            group: <$ty as k8s_openapi::Resource>::GROUP,
            version: <$ty as k8s_openapi::Resource>::VERSION,
            kind: <$ty as k8s_openapi::Resource>::KIND,
            list_kind: <$ty as k8s_openapi::ListableResource>::LIST_KIND,
            plural: <$ty as k8s_openapi::Resource>::URL_PATH_SEGMENT,
            singular: $singular,
            short_names: &[$($short),*],
            categories: &[$($cat),*],
            namespaced: $ns,
            printer_columns: $cols,
            layout: $layout,
            schema: || schemars::generate::SchemaSettings::openapi3().into_generator().into_root_schema_for::<$ty>(),
            normalize: normalize_object::<$ty>,
        }
    };
}

pub const POLICY_REPORT: ResourceDescriptor = descriptor!(
    PolicyReport,
    singular = "policyreport",
    short = ["polr"],
    categories = [],
    namespaced = true,
    columns = POLICY_REPORT_COLUMNS,
    layout = ReportLayout::TopLevel
);
pub const CLUSTER_POLICY_REPORT: ResourceDescriptor = descriptor!(
    ClusterPolicyReport,
    singular = "clusterpolicyreport",
    short = ["cpolr"],
    categories = [],
    namespaced = false,
    columns = POLICY_REPORT_COLUMNS,
    layout = ReportLayout::TopLevel
);
pub const EPHEMERAL_REPORT: ResourceDescriptor = descriptor!(
    EphemeralReport,
    singular = "ephemeralreport",
    short = ["ephr"],
    categories = ["kyverno"],
    namespaced = true,
    columns = EPHEMERAL_COLUMNS,
    layout = ReportLayout::Spec
);
pub const CLUSTER_EPHEMERAL_REPORT: ResourceDescriptor = descriptor!(
    ClusterEphemeralReport,
    singular = "clusterephemeralreport",
    short = ["cephr"],
    categories = ["kyverno"],
    namespaced = false,
    columns = CLUSTER_EPHEMERAL_COLUMNS,
    layout = ReportLayout::Spec
);
pub const REPORT: ResourceDescriptor = descriptor!(
    Report,
    singular = "report",
    short = ["reps"],
    categories = [],
    namespaced = true,
    columns = OPENREPORTS_COLUMNS,
    layout = ReportLayout::TopLevel
);
pub const CLUSTER_REPORT: ResourceDescriptor = descriptor!(
    ClusterReport,
    singular = "clusterreport",
    short = ["creps"],
    categories = [],
    namespaced = false,
    columns = OPENREPORTS_COLUMNS,
    layout = ReportLayout::TopLevel
);

/// Every served resource, grouped by group-version in the order discovery lists them.
pub const ALL: [ResourceDescriptor; 6] = [
    POLICY_REPORT,
    CLUSTER_POLICY_REPORT,
    EPHEMERAL_REPORT,
    CLUSTER_EPHEMERAL_REPORT,
    REPORT,
    CLUSTER_REPORT,
];

/// The served group-versions, in discovery order, with their preferred (only) version.
pub const GROUP_VERSIONS: [(&str, &str); 3] = [
    ("wgpolicyk8s.io", "v1alpha2"),
    ("reports.kyverno.io", "v1"),
    ("openreports.io", "v1alpha1"),
];

/// Finds a resource by group, version and plural.
pub fn find(group: &str, version: &str, plural: &str) -> Option<&'static ResourceDescriptor> {
    ALL.iter()
        .find(|d| d.group == group && d.version == version && d.plural == plural)
}

/// The resources of one group-version.
pub fn resources_of(
    group: &str,
    version: &str,
) -> impl Iterator<Item = &'static ResourceDescriptor> {
    ALL.iter()
        .filter(move |d| d.group == group && d.version == version)
}
