//! CustomResourceDefinitions generated from the Rust types, for installing the kinds as CRDs
//! (rollback target, migration source) and for comparing our schemas with upstream.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceColumnDefinition, CustomResourceDefinition, CustomResourceDefinitionNames,
    CustomResourceDefinitionSpec, CustomResourceDefinitionVersion, CustomResourceValidation,
    JSONSchemaProps,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::catalog::{ALL, ResourceDescriptor};

/// The CRD for one served resource.
pub fn crd_for(desc: &ResourceDescriptor) -> CustomResourceDefinition {
    let schema: JSONSchemaProps =
        serde_json::from_value(desc.schema()).expect("generated schema is a valid JSONSchemaProps");
    let strings = |v: &[&str]| (!v.is_empty()).then(|| v.iter().map(|s| s.to_string()).collect());
    CustomResourceDefinition {
        metadata: ObjectMeta {
            name: Some(desc.crd_name()),
            ..Default::default()
        },
        spec: CustomResourceDefinitionSpec {
            group: desc.group.into(),
            names: CustomResourceDefinitionNames {
                kind: desc.kind.into(),
                list_kind: Some(desc.list_kind.into()),
                plural: desc.plural.into(),
                singular: Some(desc.singular.into()),
                short_names: strings(desc.short_names),
                categories: strings(desc.categories),
            },
            scope: if desc.namespaced {
                "Namespaced"
            } else {
                "Cluster"
            }
            .into(),
            versions: vec![CustomResourceDefinitionVersion {
                name: desc.version.into(),
                served: true,
                storage: true,
                additional_printer_columns: Some(
                    desc.printer_columns
                        .iter()
                        .map(|c| CustomResourceColumnDefinition {
                            name: c.name.into(),
                            type_: c.type_.into(),
                            json_path: c.json_path.into(),
                            priority: (c.priority != 0).then_some(c.priority),
                            description: (!c.description.is_empty()).then(|| c.description.into()),
                            format: None,
                        })
                        .collect(),
                ),
                schema: Some(CustomResourceValidation {
                    open_api_v3_schema: Some(schema),
                }),
                subresources: None,
                ..Default::default()
            }],
            ..Default::default()
        },
        status: None,
    }
}

/// Every CRD, in catalog order.
pub fn all_crds() -> Vec<CustomResourceDefinition> {
    ALL.iter().map(crd_for).collect()
}

/// All CRDs as one multi-document YAML stream (what `reports-server crds` prints).
pub fn all_crds_yaml() -> String {
    let mut out = String::new();
    for crd in all_crds() {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&crd).expect("CRDs serialize to YAML"));
    }
    out
}
