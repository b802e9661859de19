//! Kyverno-compatible report aggregation.
//!
//! Kyverno writes *ephemeral* reports (`reports.kyverno.io/v1`) from its admission webhook and
//! background scanner and normally merges them into PolicyReports itself. With
//! `--aggregateReports=false` that job moves here, next to the data: reports-server merges in
//! the same transaction that deletes the consumed ephemeral reports, instead of through
//! thousands of API calls. The output must be what Kyverno would write (names, labels, order,
//! summaries), so every rule here follows Kyverno's own (`pkg/controllers/report/aggregate` in
//! kyverno/kyverno ≥ 1.12), as `docs/aggregation.md` lists them.
//!
//! * [`merge`]: the pure merge (no I/O), namespace-wide or page by page;
//! * [`policy`]: the live policy set and Kyverno's autogen rule naming;
//! * [`results`]: result identity, ordering and `omitempty` normalisation;
//! * [`queue`]: the delayed per-namespace work queue; [`sweep`]: enqueue every namespace a
//!   backend names, retried until it worked;
//! * [`backend`]: the storage trait the workers call; [`memory`]: an in-memory implementation;
//! * [`aggregator`]: queue + backend + merge;
//! * [`offline`]: YAML in, YAML out, for `reports-server aggregate`;
//! * [`metrics`]: Prometheus metrics;
//! * `cluster` (feature `kube`): the backend over the Kubernetes API, with a Lease, policy
//!   watches and adoption of admission reports; one active aggregator per cluster through
//!   `reports_server_election` over a Kubernetes Lease.

// Every production function fits on a screen (threshold in clippy.toml); tests may be longer.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]
#![forbid(unsafe_code)]

pub mod aggregator;
pub mod backend;
#[cfg(feature = "kube")]
pub mod cluster;
pub mod error;
pub mod memory;
pub mod merge;
pub mod metrics;
pub mod offline;
pub mod policy;
pub mod queue;
pub mod report;
pub mod results;
pub mod sweep;

pub use aggregator::{Aggregator, AggregatorConfig, ReconcileOutcome};
pub use backend::{AggregationBackend, Applied, BackendError, InputPage, PageRequest};
pub use error::Error;
pub use memory::InMemoryBackend;
pub use merge::{
    Layout, MergeInput, MergeOptions, MergeStats, OutputFormat, Plan, merge_namespace, merge_page,
    merge_subject,
};
pub use metrics::Metrics;
pub use offline::{OfflineOptions, aggregate_offline};
pub use policy::{POLICY_KINDS, PolicyKind, PolicySet};
pub use queue::{QueueConfig, WorkQueue};
pub use report::{Ephemeral, FinalReport, ObjectKey, ReportKind};
pub use tokio_util::sync::CancellationToken;
