//! Control-plane harness (being written).
