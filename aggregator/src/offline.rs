//! Offline aggregation: report YAML in, merged report YAML out (`reports-server aggregate`).
//!
//! Useful to preview what the aggregator would write from a dump (`kubectl get ephr,polr -A -o
//! yaml`), to migrate between layouts, and as the harness of the golden tests. The output is the
//! resulting state of the final reports: every final report of the input after the merge
//! (unmanaged ones unchanged), plus the reports created. Consumed ephemeral reports are not
//! printed. Output order and content are deterministic: documents sorted by namespace, kind and
//! name; results sorted as Kyverno sorts them.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::Error;
use crate::merge::{
    DEFAULT_CHUNK_SIZE, Layout, MergeInput, MergeOptions, OutputFormat, merge_namespace,
};
use crate::policy::PolicySet;
use crate::report::{Ephemeral, FinalReport, ReportKind, type_of};

/// Options of [`aggregate_offline`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OfflineOptions {
    pub layout: Layout,
    /// Per-policy layout: maximum results per report (0 = unlimited). Default 1000.
    pub chunk_size: usize,
    pub output: OutputFormat,
}

impl Default for OfflineOptions {
    fn default() -> Self {
        OfflineOptions {
            layout: Layout::PerResource,
            chunk_size: DEFAULT_CHUNK_SIZE,
            output: OutputFormat::Wgpolicy,
        }
    }
}

/// Reads report YAML from `inputs` (files or directories, searched recursively for `*.yaml` /
/// `*.yml` in sorted order; `-` reads standard input), optionally the live policies from
/// `policies` (same rules; non-policy documents ignored; no path = policy set unknown, nothing
/// is dropped), merges each namespace and returns the resulting reports as multi-document YAML.
///
/// Input documents may be PolicyReport, ClusterPolicyReport, Report, ClusterReport,
/// EphemeralReport, ClusterEphemeralReport, or any `…List` of them; anything else is an error.
/// A namespaced report without `metadata.namespace` is taken to be in `default`, as `kubectl
/// apply` would. When the same object appears twice, the later one wins.
pub fn aggregate_offline(
    inputs: &[PathBuf],
    policies: &[PathBuf],
    options: OfflineOptions,
) -> Result<String, Error> {
    let policy_set = if policies.is_empty() {
        None
    } else {
        let mut set = PolicySet::new();
        for file in collect_files(policies)? {
            let text = read(&file)?;
            set.extend_from_yaml_str(&text, &file.display().to_string())?;
        }
        Some(set)
    };

    type Id = (String, ReportKind, String);
    let mut reports: BTreeMap<Id, FinalReport> = BTreeMap::new();
    let mut ephemerals: BTreeMap<Id, Ephemeral> = BTreeMap::new();
    for file in collect_files(inputs)? {
        let text = read(&file)?;
        for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            let value: Value = serde::Deserialize::deserialize(doc).map_err(|e| Error::Yaml {
                path: file.clone(),
                document: i + 1,
                source: e,
            })?;
            let context = format!("{}: document {}", file.display(), i + 1);
            for object in flatten(value) {
                let (api_version, kind) = type_of(&object);
                let with_context = |e: Error| match e {
                    Error::Decode { kind, source, .. } => Error::Decode {
                        context: context.clone(),
                        kind,
                        source,
                    },
                    Error::UnsupportedKind {
                        api_version, kind, ..
                    } => Error::UnsupportedKind {
                        context: context.clone(),
                        api_version,
                        kind,
                    },
                    other => other,
                };
                match ReportKind::from_type(&api_version, &kind) {
                    Some(ReportKind::EphemeralReport | ReportKind::ClusterEphemeralReport) => {
                        let mut e = Ephemeral::from_value(object).map_err(with_context)?;
                        if let Ephemeral::Namespaced(r) = &mut e {
                            default_namespace(&mut r.metadata);
                        }
                        ephemerals.insert(id(e.namespace(), e.kind(), e.name()), e);
                    }
                    Some(_) => {
                        let mut r = FinalReport::from_value(object).map_err(with_context)?;
                        if !r.kind().is_cluster_scoped() {
                            default_namespace(r.metadata_mut());
                        }
                        reports.insert(id(r.namespace(), r.kind(), r.name()), r);
                    }
                    None => {
                        return Err(Error::UnsupportedKind {
                            context,
                            api_version,
                            kind,
                        });
                    }
                }
            }
        }
    }

    // Group by namespace ("" = cluster scope) and merge each one on its own.
    let mut namespaces: BTreeMap<String, (Vec<FinalReport>, Vec<Ephemeral>)> = BTreeMap::new();
    for ((ns, _, _), r) in reports {
        namespaces.entry(ns).or_default().0.push(r);
    }
    for ((ns, _, _), e) in ephemerals {
        namespaces.entry(ns).or_default().1.push(e);
    }
    let merge_options = MergeOptions {
        layout: options.layout,
        chunk_size: options.chunk_size,
        output: options.output,
        ..MergeOptions::default()
    };
    let mut out = String::new();
    for (ns, (reports, ephemerals)) in namespaces {
        let plan = merge_namespace(
            &MergeInput {
                namespace: &ns,
                reports: &reports,
                ephemerals: &ephemerals,
                policies: policy_set.as_ref(),
            },
            &merge_options,
        );
        for report in plan.apply_to(reports) {
            out.push_str("---\n");
            out.push_str(&serde_yaml::to_string(&report)?);
        }
    }
    Ok(out)
}

fn id(ns: &str, kind: ReportKind, name: &str) -> (String, ReportKind, String) {
    (ns.to_owned(), kind, name.to_owned())
}

fn default_namespace(meta: &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) {
    if meta.namespace.as_deref().is_none_or(str::is_empty) {
        meta.namespace = Some("default".to_owned());
    }
}

/// Expands `List` documents (`kind: List` or typed `…List`); typed lists may omit the items'
/// `apiVersion`/`kind`, which are then inferred from the list.
fn flatten(value: Value) -> Vec<Value> {
    if value.is_null() {
        return vec![];
    }
    let (api_version, kind) = type_of(&value);
    let Some(item_kind) = kind.strip_suffix("List") else {
        return vec![value];
    };
    let Some(Value::Array(items)) = value.get("items").cloned() else {
        return vec![value];
    };
    items
        .into_iter()
        .flat_map(|mut item| {
            if let Value::Object(map) = &mut item
                && !item_kind.is_empty()
            {
                map.entry("apiVersion")
                    .or_insert_with(|| Value::String(api_version.clone()));
                map.entry("kind")
                    .or_insert_with(|| Value::String(item_kind.to_owned()));
            }
            flatten(item)
        })
        .collect()
}

fn read(path: &Path) -> Result<String, Error> {
    let io = |source| Error::Io {
        path: path.to_owned(),
        source,
    };
    if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).map_err(io)?;
        return Ok(s);
    }
    std::fs::read_to_string(path).map_err(io)
}

/// Files named by `paths`: files as given, directories walked recursively for `*.yaml` and
/// `*.yml`, each directory's files in sorted order.
fn collect_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>, Error> {
    let mut out = Vec::new();
    for path in paths {
        if path.as_os_str() != "-" && path.is_dir() {
            let mut found = Vec::new();
            walk(path, &mut found)?;
            found.sort();
            out.extend(found);
        } else {
            out.push(path.clone());
        }
    }
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), Error> {
    let io = |source| Error::Io {
        path: dir.to_owned(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.is_dir() {
            walk(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(path);
        }
    }
    Ok(())
}
