//! The Kubernetes API surface of reports-server and the SQL store behind it.
//!
//! * [`store`]: SeaORM store with a commit-ordered resourceVersion and a change log.
//! * [`selector`], [`continuation`]: pure parsing of selectors and continue tokens.
//! * [`fieldmanager`]: pure server-side apply and managedFields bookkeeping.
//! * `http`: the axum router that speaks the Kubernetes API for the report kinds.
//! * `tls`, `server`: certificates and the HTTPS accept loop.

pub mod aggregation;
pub mod auth;
pub mod continuation;
pub mod delegated;
pub mod fieldmanager;
pub mod http;
pub mod metrics;
pub mod pki;
pub mod selector;
pub mod server;
pub mod standalone;
pub mod store;
