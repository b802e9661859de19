//! The summary of a side-by-side run: `summary.csv` with every figure of every run in the
//! output directory, and per size a Markdown table of medians with the ratios of ours against
//! the peer and the CRDs.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

use super::TARGETS;

/// The figures the summary table compares, with whether a larger value is better.
const COMPARED: [(&str, &str, bool); 19] = [
    ("create_per_s", "create (reports/s)", true),
    ("update_per_s", "update (reports/s)", true),
    ("list_seconds", "paged list, limit=500 (s)", false),
    (
        "raw_list_seconds",
        "paged list read as bytes, limit=500 (s)",
        false,
    ),
    (
        "bytes_list_seconds",
        "paged list taken as bytes, nothing parsed, limit=500 (s)",
        false,
    ),
    (
        "metadata_list_seconds",
        "metadata-only paged list (s)",
        false,
    ),
    (
        "database_read_seconds",
        "database floor: one SELECT of every body (s)",
        false,
    ),
    (
        "raw_list_over_floor",
        "paged list read as bytes / the floor",
        false,
    ),
    (
        "bytes_list_over_floor",
        "paged list taken as bytes / the floor",
        false,
    ),
    ("kubectl_get_seconds", "kubectl get polr -A (s)", false),
    ("watch_p50_ms.10", "watch p50, 10 watchers (ms)", false),
    ("watch_p99_ms.10", "watch p99, 10 watchers (ms)", false),
    ("watch_p50_ms.100", "watch p50, 100 watchers (ms)", false),
    ("watch_p99_ms.100", "watch p99, 100 watchers (ms)", false),
    (
        "serving_peak_rss_mib",
        "peak RSS of the serving process (MiB)",
        false,
    ),
    (
        "serving_cpu_seconds",
        "CPU of the serving process, whole run (s)",
        false,
    ),
    (
        "kube_apiserver_peak_rss_mib",
        "peak RSS of kube-apiserver (MiB)",
        false,
    ),
    ("disk_mib", "on disk (MiB)", false),
    ("disk_bytes_per_report", "on disk per report (bytes)", false),
];

/// The process that serves the reports in each target.
pub fn serving_process(target: &str) -> &'static str {
    match target {
        "crds" => "kube-apiserver",
        "peer" => "peer",
        t if t.ends_with("-direct") => "bench",
        _ => "reports-server",
    }
}

/// Medians by key of one run's JSON, with the summary's derived figures.
fn medians(target: &str, doc: &Value) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    for f in doc["figures"].as_array().into_iter().flatten() {
        if let (Some(k), Some(v)) = (f["key"].as_str(), f["median"].as_f64()) {
            m.insert(k.to_owned(), v);
        }
    }
    let serving = serving_process(target);
    if let Some(v) = m.get(&format!("peak_rss_mib.{serving}")).copied() {
        m.insert("serving_peak_rss_mib".into(), v);
    }
    if let Some(v) = m.get("peak_rss_mib.kube-apiserver").copied() {
        m.insert("kube_apiserver_peak_rss_mib".into(), v);
    }
    let cpu: f64 = m
        .iter()
        .filter(|(k, _)| k.starts_with("cpu_seconds.") && k.ends_with(&format!(".{serving}")))
        .map(|(_, v)| v)
        .sum();
    if cpu > 0.0 {
        m.insert("serving_cpu_seconds".into(), cpu);
    }
    if let Some(&floor) = m.get("database_read_seconds").filter(|f| **f > 0.0) {
        for (list, ratio) in [
            ("raw_list_seconds", "raw_list_over_floor"),
            ("bytes_list_seconds", "bytes_list_over_floor"),
        ] {
            if let Some(list) = m.get(list) {
                m.insert(ratio.into(), list / floor);
            }
        }
    }
    m
}

/// `summary.csv` (every figure of every run in `out`) and a Markdown table per size with the
/// ratios "how many times better" of ours against the peer and the CRDs.
pub fn summarize(out: &Path) -> Result<()> {
    let mut csv = String::from("target,reports,key,unit,median,min,max,load_before,load_after\n");
    let mut runs: BTreeMap<u64, BTreeMap<String, BTreeMap<String, f64>>> = BTreeMap::new();
    let mut entries: Vec<PathBuf> = fs::read_dir(out)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    entries.sort();
    for path in entries {
        let doc: Value = serde_json::from_slice(&fs::read(&path)?)
            .with_context(|| format!("parsing {}", path.display()))?;
        let (Some(target), Some(reports)) = (doc["target"].as_str(), doc["reports"].as_u64())
        else {
            continue;
        };
        for f in doc["figures"].as_array().into_iter().flatten() {
            csv.push_str(&format!(
                "{target},{reports},{},{},{},{},{},{},{}\n",
                f["key"].as_str().unwrap_or(""),
                f["unit"].as_str().unwrap_or(""),
                f["median"],
                f["min"],
                f["max"],
                doc["load_average_before"],
                doc["load_average_after"],
            ));
        }
        runs.entry(reports)
            .or_default()
            .insert(target.to_owned(), medians(target, &doc));
    }
    fs::write(out.join("summary.csv"), csv)?;

    for (reports, targets) in &runs {
        let names: Vec<&String> = TARGETS
            .iter()
            .filter_map(|t| targets.get_key_value(*t).map(|(k, _)| k))
            .collect();
        let comparisons: Vec<(&str, &str)> = [
            ("postgres", "peer"),
            ("sqlite", "peer"),
            ("postgres", "crds"),
            ("sqlite", "crds"),
        ]
        .into_iter()
        .filter(|(a, b)| targets.contains_key(*a) && targets.contains_key(*b))
        .collect();
        println!("\n### {reports} reports\n");
        let mut header = String::from("| figure |");
        let mut rule = String::from("|---|");
        for n in &names {
            header.push_str(&format!(" {n} |"));
            rule.push_str("---|");
        }
        for (a, b) in &comparisons {
            header.push_str(&format!(" {a} vs {b} |"));
            rule.push_str("---|");
        }
        println!("{header}\n{rule}");
        for (key, label, higher_is_better) in COMPARED {
            if !names.iter().any(|n| targets[*n].contains_key(key)) {
                continue;
            }
            let mut line = format!("| {label} |");
            for n in &names {
                match targets[*n].get(key) {
                    Some(v) => line.push_str(&format!(" {} |", short(*v))),
                    None => line.push_str(" – |"),
                }
            }
            for (a, b) in &comparisons {
                match (targets[*a].get(key), targets[*b].get(key)) {
                    (Some(x), Some(y)) if *x > 0.0 && *y > 0.0 => {
                        let better = if higher_is_better { x / y } else { y / x };
                        line.push_str(&format!(" {better:.2}× |"));
                    }
                    _ => line.push_str(" – |"),
                }
            }
            println!("{line}");
        }
    }
    println!(
        "\n(ratios: how many times better the first is — faster, smaller or more per second; \
         below 1 it is worse)"
    );
    Ok(())
}

fn short(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}
