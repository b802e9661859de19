//! Types and descriptions of the report kinds reports-server serves.
//!
//! * [`kinds`]: PolicyReport, ClusterPolicyReport (`wgpolicyk8s.io/v1alpha2`), EphemeralReport,
//!   ClusterEphemeralReport (`reports.kyverno.io/v1`), Report, ClusterReport
//!   (`openreports.io/v1alpha1`) as serde structs that round-trip upstream objects losslessly.
//! * [`catalog`]: one [`catalog::ResourceDescriptor`] per served resource — the single source for
//!   discovery, routing, printer columns, validation and schemas.
//! * [`crd`]: CustomResourceDefinition generation from the Rust types (`reports-server crds`).
//! * [`reportsserver`]: the operator's own kind, `ReportsServer` (`reportsserver.io/v1alpha1`).
//!
//! This crate does no I/O.

// Every production function fits on a screen (threshold in clippy.toml); tests may be longer.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]
#![forbid(unsafe_code)]

pub mod catalog;
pub mod crd;
pub mod fixtures;
pub mod kinds;
pub mod reportsserver;
pub mod result;
pub mod schema;

pub use catalog::{ReportLayout, ResourceDescriptor};
pub use kinds::*;
pub use result::{PolicyResult, ReportResult, Severity, Summary, Timestamp};
