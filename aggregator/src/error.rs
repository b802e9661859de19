//! Errors of the aggregator.
//!
//! The pure merge cannot fail on well-formed report objects; errors come from reading input
//! (offline mode, policy parsing), from options the merge cannot honour, and from backends.

use std::path::PathBuf;

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or directory could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A YAML document could not be parsed.
    #[error("{path}: document {document}: {source}")]
    Yaml {
        path: PathBuf,
        /// 1-based index of the document in its file.
        document: usize,
        #[source]
        source: serde_yaml::Error,
    },
    /// An object could not be decoded into the type its `kind` announces.
    #[error("{context}: invalid {kind}: {source}")]
    Decode {
        context: String,
        kind: String,
        #[source]
        source: serde_json::Error,
    },
    /// An input document is of a kind the aggregator does not consume.
    #[error(
        "{context}: unsupported kind {api_version}/{kind} (expected policy, ephemeral or openreports reports, or a List of them)"
    )]
    UnsupportedKind {
        context: String,
        api_version: String,
        kind: String,
    },
    /// A policy object is malformed.
    #[error("invalid policy {name}: {reason}")]
    InvalidPolicy { name: String, reason: String },
    /// Serialising the output failed.
    #[error("cannot serialise output: {0}")]
    Serialize(#[from] serde_yaml::Error),
    /// The requested merge cannot be done with the chosen layout.
    #[error("{0}")]
    Unsupported(&'static str),
    /// A backend failed to load or apply.
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    /// A string option could not be parsed.
    #[error("invalid value {value:?} for {option}: expected one of {expected}")]
    InvalidOption {
        option: &'static str,
        value: String,
        expected: &'static str,
    },
}
