//! Every production file fits in 800 lines of code (comments, blank lines and `#[cfg(test)]`
//! modules not counted), so a file holds one job a reader can take in; the pure Kyverno merge
//! (`aggregator/src/merge.rs`) is the one exception, kept whole to be read against Kyverno's.
//! Functions are held to 120 lines by clippy (`clippy.toml`, `too_many_lines`).

use std::path::{Path, PathBuf};

const MAX_CODE_LINES: usize = 800;
const EXEMPT: &[&str] = &["aggregator/src/merge.rs"];
/// Crates whose `src/` is production code (the test harness and this tool are not).
const PRODUCTION: &[&str] = &[
    "src",
    "crds/src",
    "election/src",
    "aggregator/src",
    "apiserver/src",
    "migration/src",
    "operator/src",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Lines of code before the file's `#[cfg(test)] mod …`, without blank and comment lines.
fn code_lines(text: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    let mut count = 0;
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim();
        if trimmed == "#[cfg(test)]"
            && lines
                .get(i + 1)
                .is_some_and(|next| next.trim_start().starts_with("mod "))
        {
            break;
        }
        if !trimmed.is_empty() && !trimmed.starts_with("//") {
            count += 1;
        }
    }
    count
}

#[test]
fn production_files_fit_in_800_lines_of_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    let mut files = Vec::new();
    for dir in PRODUCTION {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(
        files.len() > 50,
        "found only {} files: the scan is broken",
        files.len()
    );
    let mut too_long: Vec<String> = files
        .iter()
        .filter_map(|file| {
            let relative = file.strip_prefix(root).expect("under the root");
            let name = relative.to_string_lossy().replace('\\', "/");
            // `tests.rs` files are `#[cfg(test)] mod tests;` of their parent.
            if EXEMPT.contains(&name.as_str()) || name.ends_with("/tests.rs") {
                return None;
            }
            let n = code_lines(&std::fs::read_to_string(file).expect("readable"));
            (n > MAX_CODE_LINES).then(|| format!("{name}: {n} lines of code"))
        })
        .collect();
    too_long.sort();
    assert!(
        too_long.is_empty(),
        "over {MAX_CODE_LINES} lines of code; split by job:\n{}",
        too_long.join("\n")
    );
}
