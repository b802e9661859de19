//! The operator's own install objects (`manifests/`): Namespace, the ReportsServer CRD, the
//! operator's ServiceAccount, least-privilege RBAC and Deployment; the kustomization, the Helm
//! chart and the examples.
//!
//! Why generated: the RBAC must be exactly what [`crate::controller`] calls, and the server's
//! roles, which ship here because the operator binds them without holding their rights (see
//! [`crate::rbac`]); the CRD must be the Rust types', and the Helm chart must not drift from
//! install.yaml. One function renders
//! every file; `operator/tests/manifests.rs` fails when a committed file differs
//! (`UPDATE_GENERATED=1` rewrites them).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::{desired, rbac};

/// Namespace of the operator in install.yaml.
pub const NAMESPACE: &str = "reports-server";
/// Name of the operator's ServiceAccount, ClusterRole, Deployment and Lease.
pub const NAME: &str = "reports-server-operator";
/// The image of the operator (and, by default, of the servers).
pub const IMAGE: &str = crate::DEFAULT_IMAGE;
/// Metrics and health port.
pub const METRICS_PORT: i32 = 8080;

/// Placeholders replaced by Helm template expressions in the chart.
const NS_MARK: &str = "__RS_NAMESPACE__";
const IMAGE_MARK: &str = "__RS_IMAGE__";

fn labels() -> Value {
    json!({"app.kubernetes.io/name": NAME, "app.kubernetes.io/part-of": "reports-server"})
}

fn cluster_role(name: &str, labels: Value, rules: &[rbac::Rule]) -> Value {
    json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
           "metadata": {"name": name, "labels": labels}, "rules": rbac::to_json(rules)})
}

/// The server's shipped ClusterRoles: the aggregated one every server is bound to, its two
/// parts, and the migration's.
fn server_roles() -> Vec<Value> {
    let part = || {
        let mut l = server_labels();
        l[rbac::AGGREGATE_TO_SERVER] = json!("true");
        l
    };
    vec![
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
               "metadata": {"name": rbac::SERVER_ROLE, "labels": server_labels()},
               "aggregationRule": {"clusterRoleSelectors": [{"matchLabels": {rbac::AGGREGATE_TO_SERVER: "true"}}]},
               "rules": []}),
        cluster_role(rbac::SERVER_CORE_ROLE, part(), &rbac::server_core_rules()),
        cluster_role(
            rbac::SERVER_ADOPTION_ROLE,
            part(),
            &rbac::server_adoption_rules(),
        ),
        cluster_role(
            rbac::MIGRATION_ROLE,
            server_labels(),
            &rbac::migration_rules(),
        ),
        cluster_role(
            rbac::METRICS_READER_ROLE,
            server_labels(),
            &rbac::metrics_reader_rules(),
        ),
    ]
}

fn server_labels() -> Value {
    json!({"app.kubernetes.io/name": "reports-server", "app.kubernetes.io/part-of": "reports-server"})
}

fn role_and_binding(name: &str, ns: &str, rules: &[rbac::Rule], sa: &Value) -> [Value; 2] {
    rbac::role_and_binding(
        &json!({"name": name, "namespace": ns, "labels": labels()}),
        rules,
        sa,
    )
}

fn with_ns(mut obj: Value, ns: &str) -> Value {
    obj["metadata"]["namespace"] = json!(ns);
    obj
}

/// What differs between install.yaml and the chart's templates (there, markers that become Helm
/// expressions).
struct Install<'a> {
    namespace: &'a str,
    image: &'a str,
    replicas: Value,
    resources: Value,
    /// `--pod-ids` of the operator.
    pod_ids: Value,
}

/// The objects of install.yaml.
fn install_objects(install: Install<'_>) -> Vec<Value> {
    let Install {
        namespace: ns,
        image,
        replicas,
        resources,
        pod_ids,
    } = install;
    let sa = json!([{"kind": "ServiceAccount", "name": NAME, "namespace": ns}]);
    let mut objects = server_roles();
    objects.extend([
        cluster_role(NAME, labels(), &rbac::operator_cluster_rules(ns)),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": NAME, "labels": labels()},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
               "subjects": sa}),
        with_ns(
            json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME, "labels": labels()}}),
            ns,
        ),
    ]);
    objects.extend(role_and_binding(
        NAME,
        ns,
        &rbac::operator_namespace_rules(),
        &sa,
    ));
    objects.extend(role_and_binding(
        NAME,
        "kube-system",
        &rbac::operator_kube_system_rules(),
        &sa,
    ));
    objects.extend([
        with_ns(
            json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": NAME, "labels": labels()},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app.kubernetes.io/name": NAME}},
                "template": {
                    "metadata": {"labels": labels()},
                    "spec": {
                        "serviceAccountName": NAME,
                        // No fixed UID: the image's numeric USER applies, and platforms that
                        // assign one (OpenShift's restricted SCC) may.
                        "securityContext": desired::restricted_pod_context(),
                        "containers": [{
                            "name": "operator",
                            "image": image,
                            "args": ["operator"],
                            "env": [
                                {"name": "REPORTS_SERVER_OPERATOR_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                                {"name": "REPORTS_SERVER_OPERATOR_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                                // Its namespaced rights are a Role in its own namespace.
                                {"name": "REPORTS_SERVER_OPERATOR_WATCH_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                                // Deleted, it means an uninstall: the finalizers are released.
                                {"name": "REPORTS_SERVER_OPERATOR_DEPLOYMENT_NAME", "value": NAME},
                                {"name": "REPORTS_SERVER_OPERATOR_SERVER_IMAGE", "value": image},
                                {"name": "REPORTS_SERVER_OPERATOR_POD_IDS", "value": pod_ids},
                            ],
                            "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
                            "livenessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 10},
                            "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 5},
                            "resources": resources,
                            "securityContext": desired::container_security_context(true),
                        }],
                    },
                },
            }}),
            ns,
        ),
    ]);
    objects
}

fn yaml_stream(objects: &[Value]) -> String {
    let mut out = String::new();
    for o in objects {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(o).expect("objects serialize"));
    }
    out
}

fn default_resources() -> Value {
    json!({"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}})
}

/// `manifests/install.yaml`.
pub fn install_yaml() -> String {
    // Every pod of ours passes the restricted Pod Security Standard: say so, and let
    // kube-apiserver refuse what does not (a sidecar injected by someone else, a spec.image
    // that needs root).
    let mut namespace_labels = labels();
    namespace_labels["pod-security.kubernetes.io/enforce"] = json!("restricted");
    let mut out = yaml_stream(&[json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": NAMESPACE, "labels": namespace_labels}})]);
    out.push_str(&reports_server_crds::reportsserver::crd_yaml());
    out.push_str(&yaml_stream(&install_objects(Install {
        namespace: NAMESPACE,
        image: IMAGE,
        replicas: json!(1),
        resources: default_resources(),
        pod_ids: json!("auto"),
    })));
    out
}

/// The four examples, by file name.
pub fn examples() -> BTreeMap<&'static str, String> {
    let header = |what: &str| {
        format!(
            "# {what}\n# Apply after manifests/install.yaml; watch with `kubectl get rsrv -n reports-server -w`.\n"
        )
    };
    let rs = |name: &str, spec: Value| {
        serde_yaml::to_string(&json!({
            "apiVersion": "reportsserver.io/v1alpha1", "kind": "ReportsServer",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec,
        }))
        .expect("serializes")
    };
    BTreeMap::from([
        ("sqlite.yaml", format!("{}{}", header("One replica with embedded SQLite on a 1Gi PersistentVolumeClaim (the defaults: `spec: {}` is the same)."),
            rs("reports-server", json!({"database": {"sqlite": {"storageSize": "1Gi"}}})))),
        ("postgres-managed.yaml", format!("{}{}", header("Two replicas on a PostgreSQL StatefulSet the operator runs (password generated into Secret reports-server-postgres)."),
            rs("reports-server", json!({"replicas": 2, "database": {"postgres": {"managed": {"storageSize": "8Gi"}}}})))),
        ("postgres-external.yaml", format!("{}{}---\n{}", header("Two replicas on your PostgreSQL; credentials from Secret reports-db (edit it first)."),
            serde_yaml::to_string(&json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "reports-db", "namespace": NAMESPACE},
                "stringData": {"host": "postgres.example.com", "port": "5432", "database": "reports", "username": "reports", "password": "change-me"}})).expect("serializes"),
            rs("reports-server", json!({"replicas": 2, "database": {"postgres": {"external": {"secretName": "reports-db", "sslMode": "require"}}}})))),
        ("external-server.yaml", format!("{}{}", header("A server running outside the cluster (e.g. `reports-server serve --auth-mode delegated` next to the control plane): \
             no pods, the APIServices point at an ExternalName Service. Replace host, port and caBundle; the server certificate must name reports-server.reports-server.svc."),
            rs("reports-server", json!({"external": {"host": "localhost", "port": 6443,
                "caBundle": "-----BEGIN CERTIFICATE-----\nREPLACE WITH THE PEM OF THE CA THAT SIGNED THE SERVER CERTIFICATE\n-----END CERTIFICATE-----\n"}})))),
    ])
}

/// `manifests/kustomization.yaml`.
pub fn kustomization_yaml() -> String {
    "# kubectl apply -k manifests (or reference this directory from your own kustomization)\n\
     apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- install.yaml\n"
        .to_string()
}

/// The chart's `values.yaml`: every value with its default and what it does.
fn helm_values() -> String {
    let indent = |v: &Value| {
        serde_yaml::to_string(v)
            .expect("serializes")
            .lines()
            .map(|l| format!("  {l}\n"))
            .collect::<String>()
    };
    format!(
        "# Image of the operator (the servers default to the same image; ReportsServers may name
# another only if the operator allows it: extraArgs --allowed-server-images).
image:
  repository: reports-server
  # Default: the chart's appVersion.
  tag: \"\"
  pullPolicy: IfNotPresent
# Secrets with registry credentials for the operator's image (a ReportsServer names its own in
# spec.imagePullSecrets).
imagePullSecrets: []
# Operator replicas (one leads through a Lease; the others stand by).
replicas: 1
resources:
{}# Scheduling of the operator's pods.
nodeSelector: {{}}
tolerations: []
affinity: {{}}
topologySpreadConstraints: []
# Empty: none. system-cluster-critical is admitted outside kube-system only where a
# ResourceQuota allows it (not on GKE by default).
priorityClassName: \"\"
# Pod and container security contexts. No fixed UID: the image runs as 65532, and platforms that
# assign UIDs (OpenShift's restricted SCC) may.
podSecurityContext:
{}securityContext:
{}# Who chooses the user and group ids of the server and PostgreSQL pods the operator creates:
# fixed (the images' users, also as fsGroup), platform (none: OpenShift's restricted SCC assigns
# them), auto (platform when the release namespace carries OpenShift's
# openshift.io/sa.scc.uid-range annotation).
podIds: auto
# NetworkPolicies (ingress only) for the pods of this release's namespace: servers accept their
# HTTPS port only (kube-apiserver, the operator's checks, Prometheus), the operator's PostgreSQL
# accepts the servers and the operator (which sets up the analysts' read-only role) plus
# networkPolicy.postgresFrom, the operator its metrics port only. Enforced only by a network
# plugin that implements NetworkPolicy.
networkPolicy:
  enabled: false
  # Who may reach the servers' port (NetworkPolicyPeers). Empty: any source, because
  # kube-apiserver's address depends on the platform; e.g. [{{ipBlock: {{cidr: 10.0.0.0/24}}}}].
  # Keep kube-apiserver, the operator (its database checks) and Prometheus among them.
  serverFrom: []
  # Who may scrape the operator's metrics (NetworkPolicyPeers). Empty: any source.
  metricsFrom: []
  # Who else may reach the operator's PostgreSQL besides the servers and the operator
  # (NetworkPolicyPeers), e.g. the analysts' pods of docs/analytics-access.md. Empty: nobody.
  postgresFrom: []
# Prometheus Operator objects for the servers' and the operator's metrics (docs/operator.md
# \"Scraping /metrics\"). The servers authorize /metrics (get on the non-resource URL): the
# scraping account needs the shipped ClusterRole reports-server:metrics-reader (scraper below).
metrics:
  # A ServiceMonitor for every server Service of this namespace (HTTPS port https, /metrics).
  # Not together with a ReportsServer's spec.monitoring.serviceMonitor (scraped twice).
  serviceMonitor:
    enabled: false
    interval: 30s
    scrapeTimeout: 10s
    # Extra labels, e.g. the release label your Prometheus' serviceMonitorSelector matches.
    labels: {{}}
    # The token the Prometheus sends: its own ServiceAccount's (bind it: scraper below).
    bearerTokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
    # TLS of the scrape; required when enabled, since Prometheus sends its own token: give the
    # CA of the installation (each ReportsServer has its own, the chart cannot know it), e.g.
    # {{ca: {{secret: {{name: reports-server-tls, key: ca.crt}}}}, serverName: reports-server.<namespace>.svc}},
    # or, knowingly, {{insecureSkipVerify: true}} (the token goes to an unverified server).
    tlsConfig: {{}}
  # A PodMonitor for the operator's own pods (plain HTTP, port metrics).
  podMonitor:
    enabled: false
    interval: 30s
    labels: {{}}
  # The ServiceAccount your Prometheus scrapes with: bound to reports-server:metrics-reader
  # (get /metrics, nothing else) by a ClusterRoleBinding. Empty name: no binding.
  scraper:
    serviceAccountName: \"\"
    # Default: the release namespace.
    namespace: \"\"
# Extra operator flags, e.g. [\"--ready-requeue-seconds=600\"] (see `reports-server operator --help`).
extraArgs: []
",
        indent(&default_resources()),
        indent(&desired::restricted_pod_context()),
        indent(&desired::container_security_context(true)),
    )
}

/// `values.schema.json`: Helm refuses values of the wrong shape before rendering anything.
fn helm_values_schema() -> String {
    let object = json!({"type": "object"});
    let array = json!({"type": "array"});
    // Prometheus durations, as the Prometheus Operator's CRDs validate them.
    let duration = json!({"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"});
    let labels = json!({"type": "object", "additionalProperties": {"type": "string"}});
    let schema = json!({
        "$schema": "https://json-schema.org/draft-07/schema#",
        "type": "object",
        "additionalProperties": false,
        "properties": {
            "image": {"type": "object", "additionalProperties": false, "properties": {
                "repository": {"type": "string", "minLength": 1},
                "tag": {"type": "string"},
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            }},
            "imagePullSecrets": {"type": "array", "items": {"type": "object", "required": ["name"],
                "properties": {"name": {"type": "string", "minLength": 1}}}},
            "replicas": {"type": "integer", "minimum": 0},
            "resources": object,
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": array,
            "affinity": object,
            "topologySpreadConstraints": array,
            "priorityClassName": {"type": "string"},
            "podSecurityContext": object,
            "securityContext": object,
            "podIds": {"enum": ["auto", "fixed", "platform"]},
            "networkPolicy": {"type": "object", "additionalProperties": false, "properties": {
                "enabled": {"type": "boolean"},
                "serverFrom": array,
                "metricsFrom": array,
                "postgresFrom": array,
            }},
            "metrics": {"type": "object", "additionalProperties": false, "properties": {
                "serviceMonitor": {"type": "object", "additionalProperties": false, "properties": {
                    "enabled": {"type": "boolean"},
                    "interval": duration.clone(),
                    "scrapeTimeout": duration.clone(),
                    "labels": labels.clone(),
                    "bearerTokenFile": {"type": "string"},
                    "tlsConfig": object,
                }},
                "podMonitor": {"type": "object", "additionalProperties": false, "properties": {
                    "enabled": {"type": "boolean"},
                    "interval": duration,
                    "labels": labels,
                }},
                "scraper": {"type": "object", "additionalProperties": false, "properties": {
                    "serviceAccountName": {"type": "string"},
                    "namespace": {"type": "string"},
                }},
            }},
            "extraArgs": {"type": "array", "items": {"type": "string"}},
        },
    });
    format!(
        "{}\n",
        serde_json::to_string_pretty(&schema).expect("serializes")
    )
}

/// The ReportsServer CRD as a template, so that `helm upgrade` updates it (Helm never touches
/// `crds/` after the first install), kept on `helm uninstall`: deleting it would delete every
/// ReportsServer.
fn helm_crd() -> String {
    use kube::CustomResourceExt;
    let mut crd = serde_json::to_value(reports_server_crds::reportsserver::ReportsServer::crd())
        .expect("the CRD serializes");
    crd["metadata"]["annotations"] = json!({"helm.sh/resource-policy": "keep"});
    yaml_stream(&[crd])
}

/// The operator Deployment's pod spec in the chart: scheduling, pull secrets and security
/// contexts from values.
fn helm_pod_values(templates: String) -> String {
    let pod_security = "      securityContext:\n        runAsNonRoot: true\n        seccompProfile:\n          type: RuntimeDefault\n";
    assert!(
        templates.contains(pod_security),
        "the operator's pod securityContext"
    );
    let mut with = String::new();
    for (key, value) in [
        ("imagePullSecrets", true),
        ("nodeSelector", true),
        ("tolerations", true),
        ("affinity", true),
        ("topologySpreadConstraints", true),
        ("priorityClassName", false),
    ] {
        if value {
            with.push_str(&format!(
                "      {{{{- with .Values.{key} }}}}\n      {key}:\n        {{{{- toYaml . | nindent 8 }}}}\n      {{{{- end }}}}\n"
            ));
        } else {
            with.push_str(&format!(
                "      {{{{- with .Values.{key} }}}}\n      {key}: {{{{ . | quote }}}}\n      {{{{- end }}}}\n"
            ));
        }
    }
    with.push_str(
        "      securityContext:\n        {{- toYaml .Values.podSecurityContext | nindent 8 }}\n",
    );
    let container_security = "        securityContext:\n          allowPrivilegeEscalation: false\n          readOnlyRootFilesystem: true\n          capabilities:\n            drop:\n            - ALL\n";
    assert!(
        templates.contains(container_security),
        "the operator's container securityContext"
    );
    templates.replace(pod_security, &with).replace(
        container_security,
        "        securityContext:\n          {{- toYaml .Values.securityContext | nindent 10 }}\n",
    )
}

/// The Helm chart's files, by path under `manifests/helm/reports-server/`.
pub fn helm_chart() -> BTreeMap<&'static str, String> {
    let version = env!("CARGO_PKG_VERSION");
    let objects = install_objects(Install {
        namespace: NS_MARK,
        image: IMAGE_MARK,
        replicas: json!("__RS_REPLICAS__"),
        resources: json!("__RS_RESOURCES__"),
        pod_ids: json!("__RS_POD_IDS__"),
    });
    let mut templates = yaml_stream(&objects);
    templates = templates
        .replace(NS_MARK, "{{ .Release.Namespace }}")
        .replace(
            IMAGE_MARK,
            "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}",
        )
        .replace(
            "replicas: __RS_REPLICAS__",
            "replicas: {{ .Values.replicas }}",
        )
        .replace(
            "value: __RS_POD_IDS__",
            "value: {{ .Values.podIds | quote }}",
        )
        .replace(
            "resources: __RS_RESOURCES__",
            "resources:\n          {{- toYaml .Values.resources | nindent 10 }}",
        );
    // Operator flags from values: appended to args.
    templates = templates.replace(
        "        - operator\n",
        "        - operator\n        {{- range .Values.extraArgs }}\n        - {{ . | quote }}\n        {{- end }}\n",
    );
    templates = templates.replace(
        "        image: {{ .Values.image.repository }}",
        "        imagePullPolicy: {{ .Values.image.pullPolicy }}\n        image: {{ .Values.image.repository }}",
    );
    templates = helm_pod_values(templates);
    BTreeMap::from([
        (
            "Chart.yaml",
            format!(
                "apiVersion: v2\nname: reports-server\ndescription: The reports-server operator (ReportsServer CRD, RBAC, Deployment). Apply a ReportsServer to install a server.\ntype: application\nversion: {version}\nappVersion: \"{version}\"\nkubeVersion: \">=1.30.0-0\"\n"
            ),
        ),
        ("values.yaml", helm_values()),
        ("values.schema.json", helm_values_schema()),
        ("templates/crd.yaml", helm_crd()),
        (
            "templates/networkpolicy.yaml",
            HELM_NETWORK_POLICY.to_string(),
        ),
        ("templates/monitoring.yaml", HELM_MONITORING.to_string()),
        ("templates/operator.yaml", templates),
        ("templates/NOTES.txt", HELM_NOTES.to_string()),
        ("README.md", HELM_README.to_string()),
    ])
}

/// The chart's optional NetworkPolicies. Ingress only: the servers' egress goes to
/// kube-apiserver (delegated authentication, discovery), DNS and the database, and
/// kube-apiserver's addresses depend on the platform, so a default egress rule would either
/// allow everything or break clusters. The selectors are the labels the operator gives its pods
/// (`operator/tests/manifests.rs` checks them against the golden objects).
const HELM_NETWORK_POLICY: &str = r#"{{- if .Values.networkPolicy.enabled }}
# The servers accept their HTTPS port only: kube-apiserver (the aggregation layer), the
# operator's database checks, Prometheus.
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: reports-server
  namespace: {{ .Release.Namespace }}
  labels:
    app.kubernetes.io/part-of: reports-server
spec:
  podSelector:
    matchLabels:
      app.kubernetes.io/name: reports-server
  policyTypes: [Ingress]
  ingress:
  - ports:
    - protocol: TCP
      port: 6443
    {{- with .Values.networkPolicy.serverFrom }}
    from:
      {{- toYaml . | nindent 6 }}
    {{- end }}
---
# The operator's PostgreSQL (spec.database.postgres.managed) accepts the servers, the operator
# (the analysts' read-only role, docs/analytics-access.md) and networkPolicy.postgresFrom.
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: reports-server-postgres
  namespace: {{ .Release.Namespace }}
  labels:
    app.kubernetes.io/part-of: reports-server
spec:
  podSelector:
    matchLabels:
      app.kubernetes.io/name: postgres
      app.kubernetes.io/part-of: reports-server
  policyTypes: [Ingress]
  ingress:
  - from:
    - podSelector:
        matchLabels:
          app.kubernetes.io/name: reports-server
    - podSelector:
        matchLabels:
          app.kubernetes.io/name: reports-server-operator
    {{- with .Values.networkPolicy.postgresFrom }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    ports:
    - protocol: TCP
      port: 5432
---
# The operator accepts its metrics port only (it serves nothing else).
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: reports-server-operator
  namespace: {{ .Release.Namespace }}
  labels:
    app.kubernetes.io/part-of: reports-server
spec:
  podSelector:
    matchLabels:
      app.kubernetes.io/name: reports-server-operator
  policyTypes: [Ingress]
  ingress:
  - ports:
    - protocol: TCP
      port: 8080
    {{- with .Values.networkPolicy.metricsFrom }}
    from:
      {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end }}
"#;

/// The chart's optional Prometheus Operator objects and the scraper's binding. The servers'
/// ServiceMonitor selects every server Service of the namespace by the labels the operator
/// gives them (`operator/tests/manifests.rs` checks them against the golden objects); it
/// scrapes with the Prometheus' own token, since a chart-wide one cannot name each
/// installation's identity (`spec.monitoring` does that per ReportsServer).
const HELM_MONITORING: &str = r#"{{- with .Values.metrics.serviceMonitor }}
{{- if .enabled }}
# The servers' authorized /metrics (docs/operator.md "Scraping /metrics").
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ $.Release.Name }}-chart
  namespace: {{ $.Release.Namespace }}
  labels:
    app.kubernetes.io/part-of: reports-server
    {{- with .labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      app.kubernetes.io/name: reports-server
      app.kubernetes.io/managed-by: reports-server-operator
  namespaceSelector:
    matchNames:
    - {{ $.Release.Namespace }}
  endpoints:
  - port: https
    scheme: https
    path: /metrics
    interval: {{ .interval }}
    scrapeTimeout: {{ .scrapeTimeout }}
    bearerTokenFile: {{ .bearerTokenFile }}
    tlsConfig:
      {{- $tls := .tlsConfig | default dict }}
      {{- if or $tls.ca $tls.caFile $tls.insecureSkipVerify }}
      {{- toYaml $tls | nindent 6 }}
      {{- else }}
      {{- fail "metrics.serviceMonitor.tlsConfig is required: Prometheus sends its own token to the servers, so give the installation's CA (tlsConfig.ca.secret: name <name>-tls, key ca.crt; tlsConfig.serverName: <name>.<namespace>.svc) or set tlsConfig.insecureSkipVerify: true knowingly" }}
      {{- end }}
{{- end }}
{{- end }}
{{- with .Values.metrics.podMonitor }}
{{- if .enabled }}
---
# The operator's own /metrics (plain HTTP).
apiVersion: monitoring.coreos.com/v1
kind: PodMonitor
metadata:
  name: {{ $.Release.Name }}-operator
  namespace: {{ $.Release.Namespace }}
  labels:
    app.kubernetes.io/part-of: reports-server
    {{- with .labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      app.kubernetes.io/name: reports-server-operator
  namespaceSelector:
    matchNames:
    - {{ $.Release.Namespace }}
  podMetricsEndpoints:
  - port: metrics
    path: /metrics
    interval: {{ .interval }}
{{- end }}
{{- end }}
{{- with .Values.metrics.scraper }}
{{- if .serviceAccountName }}
---
# The Prometheus' account may get /metrics (and nothing else).
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: reports-server:metrics-reader:{{ $.Release.Namespace }}:{{ $.Release.Name }}
  labels:
    app.kubernetes.io/part-of: reports-server
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: reports-server:metrics-reader
subjects:
- kind: ServiceAccount
  name: {{ .serviceAccountName }}
  namespace: {{ .namespace | default $.Release.Namespace }}
{{- end }}
{{- end }}
"#;

/// What `helm install` prints.
const HELM_NOTES: &str = r#"The reports-server operator is installed in namespace {{ .Release.Namespace }}.

Install a server (the operator reconciles ReportsServers in this namespace only; spec: {} is one
replica on SQLite, manifests/examples/ has PostgreSQL setups):

  kubectl apply -n {{ .Release.Namespace }} -f - <<EOF
  apiVersion: reportsserver.io/v1alpha1
  kind: ReportsServer
  metadata:
    name: reports-server
  spec: {}
  EOF
  kubectl get rsrv -n {{ .Release.Namespace }} -w     # READY True when every report group is served

Uninstall: delete the ReportsServers first (they hand the reports back to CRD storage), then
helm uninstall {{ .Release.Name }} -n {{ .Release.Namespace }}. The ReportsServer CRD is kept
(helm.sh/resource-policy: keep); delete it by hand once no ReportsServer is left.
"#;

/// The chart's README.
const HELM_README: &str = r#"# reports-server Helm chart

Installs the reports-server operator: the `ReportsServer` CRD, the server's and the operator's
roles (least privilege, see docs/operator.md "Permissions") and the operator's Deployment. A
server is then one `ReportsServer` object in the release namespace (manifests/examples/).

```sh
helm install reports-server manifests/helm/reports-server -n reports-server --create-namespace
kubectl apply -n reports-server -f manifests/examples/sqlite.yaml
```

This chart is generated (`operator/src/manifests.rs`) from the same code as
`manifests/install.yaml`; do not edit it by hand.

## Values

| value | default | meaning |
|---|---|---|
| `image.repository`, `image.tag`, `image.pullPolicy` | `reports-server`, the appVersion, `IfNotPresent` | the operator's image, and the servers' default |
| `imagePullSecrets` | `[]` | registry credentials of the operator's pod (servers: `spec.imagePullSecrets`) |
| `replicas` | `1` | operator replicas; one leads through a Lease |
| `resources` | 50m CPU / 64Mi requested, 256Mi limit | of the operator container |
| `nodeSelector`, `tolerations`, `affinity`, `topologySpreadConstraints` | none | of the operator's pods (servers: the same fields of the ReportsServer spec) |
| `priorityClassName` | none | `system-cluster-critical` is admitted outside kube-system only with a ResourceQuota allowing it |
| `podSecurityContext`, `securityContext` | non-root, RuntimeDefault seccomp, read-only root, no capabilities, no fixed UID | of the operator pod and container |
| `podIds` | `auto` | user and group ids of the server and PostgreSQL pods: `fixed` (65532 / 999, also as `fsGroup`), `platform` (none set; OpenShift's restricted SCC assigns them), `auto` (`platform` where the release namespace carries OpenShift's `openshift.io/sa.scc.uid-range` annotation) |
| `networkPolicy.enabled` | `false` | ingress NetworkPolicies: servers accept their HTTPS port only, the operator's PostgreSQL the servers, the operator and `networkPolicy.postgresFrom`, the operator its metrics port only |
| `networkPolicy.serverFrom`, `networkPolicy.metricsFrom` | `[]` (any source) | NetworkPolicyPeers allowed to the servers' port and the operator's metrics; the servers' must keep kube-apiserver (the aggregation layer), the operator (its database checks call the servers) and Prometheus if it scrapes them |
| `networkPolicy.postgresFrom` | `[]` (nobody) | NetworkPolicyPeers allowed to the operator's PostgreSQL besides the servers and the operator, e.g. the analysts' pods (docs/analytics-access.md) |
| `metrics.serviceMonitor.enabled` | `false` | a ServiceMonitor `<release>-chart` (`monitoring.coreos.com/v1`; not `<name>`, the name of a ReportsServer's own) for every server Service of the release namespace: port `https`, scheme `https`, `/metrics` |
| `metrics.serviceMonitor.interval`, `.scrapeTimeout` | `30s`, `10s` | of its endpoint |
| `metrics.serviceMonitor.labels` | `{}` | extra labels, e.g. the `release` label your Prometheus' `serviceMonitorSelector` matches |
| `metrics.serviceMonitor.bearerTokenFile` | `/var/run/secrets/kubernetes.io/serviceaccount/token` | the token Prometheus sends: its own ServiceAccount's, which `metrics.scraper` binds |
| `metrics.serviceMonitor.tlsConfig` | `{}`: the render fails | required with `enabled`, since Prometheus sends its own token: the installation's CA, `{ca: {secret: {name: <name>-tls, key: ca.crt}}, serverName: <name>.<namespace>.svc}` (each ReportsServer has its own CA, which the chart cannot know), or, knowingly, `{insecureSkipVerify: true}` (the token then goes to a server whose certificate is not checked) |
| `metrics.podMonitor.enabled`, `.interval`, `.labels` | `false`, `30s`, `{}` | a PodMonitor `<release>-operator` for the operator's own metrics (plain HTTP, port `metrics`) |
| `metrics.scraper.serviceAccountName`, `.namespace` | `""` (no binding), the release namespace | the Prometheus' ServiceAccount, bound to the shipped ClusterRole `reports-server:metrics-reader` (`get` on `/metrics` only) |
| `extraArgs` | `[]` | operator flags, e.g. `--allowed-server-images=ghcr.io/acme/reports-server` |

`values.schema.json` refuses values of the wrong shape.

## Scraping /metrics

The servers authorize `/metrics` like kube-apiserver does (a SubjectAccessReview for `get` on
the non-resource URL), over HTTPS. With the Prometheus Operator:

```yaml
metrics:
  serviceMonitor:
    enabled: true
    labels: {release: kube-prometheus-stack}
  podMonitor:
    enabled: true
  scraper:
    serviceAccountName: kube-prometheus-stack-prometheus
    namespace: monitoring
```

Or per ReportsServer, `spec.monitoring.serviceMonitor` (its own identity and CA, no
`insecureSkipVerify`); not both. A plain Prometheus `scrape_config` and the details are in
docs/operator.md "Scraping /metrics".

## Upgrading from chart versions with the CRD in `crds/`

The CRD is now a template, so `helm upgrade` updates it. Helm refuses to adopt the CRD an older
chart installed from `crds/` ("invalid ownership metadata"); the first upgrade takes it over:

```sh
helm upgrade reports-server manifests/helm/reports-server -n reports-server --take-ownership
```

## Uninstall

Delete the ReportsServers first, while the operator runs (they hand the reports back to CRD
storage, see docs/operator.md "Uninstall"), then `helm uninstall`. The CRD stays
(`helm.sh/resource-policy: keep`): deleting it would delete every ReportsServer.
"#;

/// Argo CD health check for `reportsserver.io/ReportsServer` (Lua), shared by the
/// `argocd-cm` snippet and the Lua test runner.
pub const ARGOCD_HEALTH_LUA: &str = r#"-- Argo CD health check for reportsserver.io/ReportsServer.
-- Progressing until the operator has observed the current generation; then Degraded when
-- Degraded (or Stalled) is True, Healthy when Ready is True, Progressing otherwise.
local hs = { status = "Progressing", message = "Waiting for the operator" }
if obj.status == nil then
  return hs
end
if obj.status.observedGeneration == nil or obj.metadata.generation == nil
    or obj.status.observedGeneration < obj.metadata.generation then
  hs.message = "Waiting for the operator to observe generation " .. tostring(obj.metadata.generation)
  return hs
end
local ready, degraded
for _, c in ipairs(obj.status.conditions or {}) do
  if c.type == "Ready" then ready = c end
  if (c.type == "Degraded" or c.type == "Stalled") and c.status == "True" then degraded = c end
end
if degraded ~= nil then
  hs.status = "Degraded"
  hs.message = (degraded.reason or "") .. ": " .. (degraded.message or "")
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or "Ready"
  return hs
end
if ready ~= nil then
  hs.message = (ready.reason or "") .. ": " .. (ready.message or "")
end
return hs
"#;

/// `manifests/argocd/argocd-cm-patch.yaml`: the health check as an `argocd-cm` patch.
pub fn argocd_cm_patch() -> String {
    let mut lua = String::new();
    for line in ARGOCD_HEALTH_LUA.lines() {
        lua.push_str("    ");
        lua.push_str(line);
        lua.push('\n');
    }
    format!(
        "# Merge into Argo CD's argocd-cm ConfigMap, e.g.\n#   kubectl -n argocd patch configmap argocd-cm --patch-file manifests/argocd/argocd-cm-patch.yaml\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: argocd-cm\n  namespace: argocd\ndata:\n  resource.customizations.health.reportsserver.io_ReportsServer: |\n{lua}"
    )
}

/// Every generated file, by path relative to `manifests/`.
pub fn all_files() -> BTreeMap<String, String> {
    let mut files = BTreeMap::new();
    files.insert("install.yaml".into(), install_yaml());
    files.insert("kustomization.yaml".into(), kustomization_yaml());
    for (name, text) in examples() {
        files.insert(format!("examples/{name}"), text);
    }
    for (name, text) in helm_chart() {
        files.insert(format!("helm/reports-server/{name}"), text);
    }
    files.insert("argocd/health.lua".into(), ARGOCD_HEALTH_LUA.into());
    files.insert("argocd/argocd-cm-patch.yaml".into(), argocd_cm_patch());
    files
}
