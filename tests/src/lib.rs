//! Shared harness for the end-to-end and conformance tests: real server processes, real
//! PostgreSQL, real kubectl, and the Go-built control plane.

pub mod controlplane;
