//! The objects each kind of installation creates, compared with golden YAML under
//! `operator/tests/golden/`. A change to a builder shows up as a reviewable diff of these
//! files; `UPDATE_GENERATED=1 cargo test -p reports-server-operator --test golden` rewrites them.
//!
//! The in-cluster modes are rendered from the ReportsServers of `manifests/examples/`, so the
//! same golden files are what `tests/tests/e2e_operator_node.rs` compares the live objects with
//! after applying those examples on a real node.

use std::path::PathBuf;

use reports_server_crds::reportsserver::*;
use reports_server_operator::desired::{self, Database, Inputs, PodIds, Tls};

const CA: &str = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n";

fn rs(spec: ReportsServerSpec) -> ReportsServer {
    let mut rs = ReportsServer::new("reports-server", spec);
    rs.metadata.namespace = Some("reports-server".into());
    rs.metadata.uid = Some("00000000-0000-0000-0000-000000000001".into());
    rs
}

/// A managed-PostgreSQL spec with `replicas`.
fn managed(replicas: i32) -> ReportsServerSpec {
    ReportsServerSpec {
        replicas,
        database: DatabaseSpec {
            postgres: Some(PostgresSpec {
                managed: Some(ManagedPostgresSpec::default()),
                external: None,
            }),
            sqlite: None,
        },
        ..Default::default()
    }
}

fn render(rs: &ReportsServer) -> String {
    let database = desired::database_of(&rs.spec).expect("valid spec");
    let external = database == Database::External;
    let inputs = Inputs {
        rs,
        tls: (!external).then(|| Tls {
            secret_name: desired::tls_secret_name(rs),
            ca_pem: CA.into(),
        }),
        external_ca_pem: external.then(|| CA.into()),
        database,
        default_image: "reports-server:0.1.0",
        foreign_api_services: Vec::new(),
        owner_uid: Some("00000000-0000-0000-0000-0000000000c7".into()),
        pod_ids: PodIds::Fixed,
        monitoring_api: true,
    };
    desired::desired(&inputs).to_yaml()
}

fn check(name: &str, yaml: String) -> Option<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.yaml"));
    if std::env::var_os("UPDATE_GENERATED").is_some() {
        std::fs::write(&path, &yaml).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    (committed != yaml).then(|| {
        format!(
            "{} differs from what the builders produce (UPDATE_GENERATED=1 cargo test -p reports-server-operator --test golden rewrites it)",
            path.display()
        )
    })
}

/// The ReportsServer of `manifests/examples/<name>.yaml` (the file's last document).
fn example(name: &str) -> ReportsServer {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests/examples")
        .join(format!("{name}.yaml"));
    let text = std::fs::read_to_string(&path).unwrap();
    let doc = serde_yaml::Deserializer::from_str(&text)
        .map(|d| <serde_yaml::Value as serde::Deserialize>::deserialize(d).unwrap())
        .filter(|d| d["kind"] == "ReportsServer")
        .last()
        .unwrap_or_else(|| panic!("{} has no ReportsServer", path.display()));
    let example: ReportsServer = serde_yaml::from_value(doc).unwrap();
    rs(example.spec)
}

#[test]
fn golden_objects_per_mode() {
    let cases = [
        ("sqlite", example("sqlite")),
        ("postgres-managed", example("postgres-managed")),
        ("postgres-external", example("postgres-external")),
        (
            "postgres-external-verify-full",
            rs(ReportsServerSpec {
                replicas: 2,
                database: DatabaseSpec {
                    postgres: Some(PostgresSpec {
                        managed: None,
                        external: Some(ExternalPostgresSpec {
                            secret_name: "reports-db".into(),
                            ssl_mode: "verify-full".into(),
                            ca_secret: Some(SecretKeyRef {
                                name: "reports-db-ca".into(),
                                key: String::new(),
                            }),
                            ..Default::default()
                        }),
                    }),
                    sqlite: None,
                },
                aggregation: AggregationSpec {
                    layout: "per-policy".into(),
                    ..Default::default()
                },
                ..Default::default()
            }),
        ),
        (
            "postgres-managed-analytics-monitoring",
            rs(ReportsServerSpec {
                analytics: AnalyticsSpec {
                    read_only_role: ReadOnlyRoleSpec {
                        enabled: true,
                        secret_name: None,
                    },
                },
                monitoring: MonitoringSpec {
                    service_monitor: ServiceMonitorSpec {
                        enabled: true,
                        labels: [("release".to_string(), "prometheus".to_string())].into(),
                        ..Default::default()
                    },
                },
                ..managed(2)
            }),
        ),
        (
            "external",
            rs(ReportsServerSpec {
                external: Some(ExternalSpec {
                    host: "localhost".into(),
                    port: 6443,
                    ..Default::default()
                }),
                groups: GroupsSpec {
                    openreports: false,
                    ..Default::default()
                },
                ..Default::default()
            }),
        ),
    ];
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(name, rs)| check(name, render(rs)))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// No object of any mode skips TLS verification or points an APIService at no CA.
#[test]
fn no_apiservice_skips_tls_verification() {
    for spec in [ReportsServerSpec::default(), managed(1)] {
        let yaml = render(&rs(spec));
        assert!(!yaml.contains("insecureSkipTLSVerify"));
        assert_eq!(yaml.matches("caBundle:").count(), 3);
    }
}
