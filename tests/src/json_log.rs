//! A JSON log (`--log-format json`) read back, so a test can show that one piece of work — a
//! Kyverno merge round, an operator reconcile — is logged step by step, each step under its
//! span and the span under the work's.

use std::path::Path;

use anyhow::{Context, ensure};
use serde_json::Value;

/// The log's JSON lines (other lines, e.g. a panic message, are skipped).
pub fn read(path: &Path) -> anyhow::Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect())
}

/// The names of the spans a line was logged under, outermost first.
fn span_names(line: &Value) -> Vec<&str> {
    line["spans"]
        .as_array()
        .map(|spans| spans.iter().filter_map(|s| s["name"].as_str()).collect())
        .unwrap_or_default()
}

/// Whether a span field holds `value`, recorded as it is or `Debug`-quoted (as
/// `#[instrument]` records a `&str` argument).
fn field_is(field: &Value, value: &str) -> bool {
    field
        .as_str()
        .is_some_and(|f| f == value || f == format!("{value:?}"))
}

/// For each of `steps`, the first line logged directly in that step's span inside a span
/// `outer` whose field `key` is `value`; fails naming the steps no line shows.
pub fn steps_under<'a>(
    lines: &'a [Value],
    outer: &str,
    (key, value): (&str, &str),
    steps: &[&str],
) -> anyhow::Result<Vec<&'a Value>> {
    let mut found = Vec::new();
    let mut missing = Vec::new();
    for step in steps {
        let line = lines.iter().find(|line| {
            let names = span_names(line);
            let in_outer = line["spans"].as_array().is_some_and(|spans| {
                spans
                    .iter()
                    .any(|s| s["name"] == outer && field_is(&s[key], value))
            });
            in_outer && names.last() == Some(step)
        });
        match line {
            Some(line) => found.push(line),
            None => missing.push(*step),
        }
    }
    ensure!(
        missing.is_empty(),
        "no log line under {outer}{{{key}={value}}} > {missing:?} among {} JSON lines",
        lines.len()
    );
    Ok(found)
}
