//! The Kubernetes API surface of reports-server and the SQL store behind it.
//!
//! * [`store`]: SeaORM store with a commit-ordered resourceVersion and a change log.
//! * [`selector`], [`continuation`]: pure parsing of selectors and continue tokens.
//! * [`fieldmanager`]: pure server-side apply and managedFields bookkeeping.
//! * [`registry`]: Kubernetes object rules for the report kinds (create/update/patch/apply/
//!   delete decisions, validation, managedFields) and typed errors, between HTTP and the store.
//! * `http`: the axum router that speaks the Kubernetes API for the report kinds.
//! * [`report_merge`]: the in-process Kyverno report merger (an aggregator backend over the
//!   store, writing through the registry).
//! * [`statistics`]: the lease holder's gauges of stored objects and results, and the
//!   compliance history snapshots.
//! * [`startup`]: starting the server in standalone or delegated mode; `pki`, `server`:
//!   certificates and the HTTPS accept loop.
//!
//! `docs/architecture.md` has the picture and the path of a request and of a watch event.

// Every production function fits on a screen (threshold in clippy.toml); tests may be longer.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]
#![forbid(unsafe_code)]

pub mod auth;
pub mod continuation;
pub mod delegated;
pub mod fieldmanager;
pub mod http;
pub mod metrics;
pub mod pki;
pub mod registry;
pub mod report_merge;
pub mod selector;
pub mod server;
pub mod startup;
pub mod statistics;
pub mod store;
