//! The monitoring objects of `spec.monitoring.serviceMonitor`: a ServiceMonitor and the identity
//! Prometheus scrapes with. Kept apart from the workload because it is optional and depends on the
//! Prometheus Operator's API being served.

use reports_server_crds::reportsserver::ReportsServer;
use serde_json::{Value, json};

use super::{
    Tls, cluster_name, labels, name_of, ns_of, owned_meta, selector_labels, service_name,
    unowned_meta,
};
use crate::rbac;

/// The ServiceAccount Prometheus scrapes the servers as (`spec.monitoring.serviceMonitor`); no
/// pod runs as it.
pub fn metrics_reader_name(rs: &ReportsServer) -> String {
    format!("{}-metrics-reader", name_of(rs))
}

/// The Secret holding the token of [`metrics_reader_name`].
pub fn metrics_reader_token_name(rs: &ReportsServer) -> String {
    format!("{}-token", metrics_reader_name(rs))
}

/// The ClusterRoleBinding of [`metrics_reader_name`] to [`rbac::METRICS_READER_ROLE`].
pub fn metrics_reader_binding_name(rs: &ReportsServer) -> String {
    format!("{}:metrics-reader", cluster_name(rs))
}

/// The ServiceMonitor of the servers and the identity it scrapes with. The servers authorize
/// `/metrics` with a SubjectAccessReview (`get` on the non-resource URL), so Prometheus needs a
/// bearer token of an account bound to [`rbac::METRICS_READER_ROLE`]: a ServiceAccount of this
/// installation with a token Secret the ServiceMonitor names, which works whatever account the
/// Prometheus runs as (the Prometheus Operator reads Secrets in the ServiceMonitor's namespace).
/// TLS is verified against the serving CA, under the Service's DNS name the certificate carries.
pub(super) fn service_monitor(
    rs: &ReportsServer,
    tls: &Tls,
    owner_uid: Option<&str>,
) -> (Vec<Value>, Vec<Value>) {
    let spec = &rs.spec.monitoring.service_monitor;
    let reader = metrics_reader_name(rs);
    let token = metrics_reader_token_name(rs);
    let mut token_meta = owned_meta(rs, &token);
    token_meta["annotations"] = json!({"kubernetes.io/service-account.name": reader});
    let mut monitor_meta = owned_meta(rs, &name_of(rs));
    let mut monitor_labels = spec.labels.clone();
    // Ours last: the managed-by label is how the operator's watches find its objects.
    monitor_labels.extend(labels(rs));
    monitor_meta["labels"] = json!(monitor_labels);
    let owned = vec![
        json!({
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": owned_meta(rs, &reader),
            "automountServiceAccountToken": false,
        }),
        json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": token_meta,
            "type": "kubernetes.io/service-account-token",
        }),
        json!({
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": monitor_meta,
            "spec": {
                "selector": {"matchLabels": selector_labels(rs)},
                "namespaceSelector": {"matchNames": [ns_of(rs)]},
                "endpoints": [{
                    "port": "https",
                    "scheme": "https",
                    "path": "/metrics",
                    "interval": spec.interval,
                    "scrapeTimeout": spec.scrape_timeout,
                    "authorization": {"type": "Bearer", "credentials": {"name": token, "key": "token"}},
                    "tlsConfig": {
                        "ca": {"secret": {"name": tls.secret_name, "key": "ca.crt"}},
                        "serverName": format!("{}.{}.svc", service_name(rs), ns_of(rs)),
                    },
                }],
            },
        }),
    ];
    let unowned = vec![json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": unowned_meta(rs, owner_uid, &metrics_reader_binding_name(rs), None),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": rbac::METRICS_READER_ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": reader, "namespace": ns_of(rs)}],
    })];
    (owned, unowned)
}
