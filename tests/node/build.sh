#!/usr/bin/env bash
# Builds kubelet and kube-scheduler (the end-to-end node, tests/src/node.rs) with the control
# plane's build script, so they come from the same pinned Kubernetes version and wrapper-module
# recipe. They are cached in their own directory, ${REPORTS_SERVER_CACHE:-~/.cache/reports-server}/node/k8s-<version>/,
# so the control plane's cache stays valid. Prints the bin directory as the last stdout line.
exec bash "$(dirname "$0")/../controlplane/build.sh" node "$@"
