//! The layers of `apiserver` depend only downward (see `docs/architecture.md`):
//! HTTP → registry → store, and the in-process report merger → registry → store. A
//! `use` that points the other way fails here, with the file and line.

use std::path::{Path, PathBuf};

fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    if dir.is_file() {
        files.push(dir.to_owned());
        return files;
    }
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            files.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// Lines of the files under `layer` (relative to `apiserver/src`) that mention any of
/// `forbidden` outside comments.
fn violations(layer: &str, forbidden: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    violations_in(&root, &root.join(layer), forbidden, None)
}

/// Lines of the files under `dir` (except under `except`) that mention any of `forbidden`
/// outside comments; paths shown relative to `root`.
fn violations_in(
    root: &Path,
    dir: &Path,
    forbidden: &[&str],
    except: Option<&Path>,
) -> Vec<String> {
    let mut found = Vec::new();
    for file in sources(dir) {
        if except.is_some_and(|e| file.starts_with(e)) {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("readable source");
        for (number, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for pattern in forbidden {
                if code.contains(pattern) {
                    found.push(format!(
                        "{}:{}: {} (uses {pattern})",
                        file.strip_prefix(root).unwrap_or(&file).display(),
                        number + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    found
}

#[test]
fn http_reaches_neither_the_report_merger_nor_the_store() {
    let found = violations(
        "http",
        &[
            "crate::report_merge",
            "reports_server_aggregator",
            // Watches, lists and health go through the registry (registry/watch.rs, bulk.rs).
            "crate::store",
        ],
    );
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_report_merger_and_the_registry_know_nothing_of_http() {
    for layer in ["report_merge", "registry"] {
        let found = violations(layer, &["crate::http", "axum", "ApiError", "StatusCode"]);
        assert!(found.is_empty(), "{}", found.join("\n"));
    }
}

#[test]
fn the_store_knows_nothing_above_it() {
    let found = violations(
        "store",
        &[
            "crate::http",
            "crate::registry",
            "crate::report_merge",
            "axum",
        ],
    );
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn only_the_store_speaks_sql() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = violations_in(
        &root,
        &root,
        &["sea_orm", "sqlx"],
        Some(&root.join("store")),
    );
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The migration engine (its own crate, above this one) writes through the registry, as every
/// background worker does; what it needs of the whole store is `registry/bulk.rs`.
#[test]
fn the_migration_engine_holds_only_the_registry() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    let found = violations_in(
        workspace,
        &workspace.join("migration/src"),
        &[
            "reports_server_apiserver::store",
            "reports_server_apiserver::http",
            "sea_orm",
            "sqlx",
        ],
        None,
    );
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The modules of `store/` that `file` names (`super::x`, `crate::store::x`), outside its tests.
fn store_siblings_used(file: &Path, siblings: &[String]) -> Vec<String> {
    let text = std::fs::read_to_string(file).expect("readable source");
    let code: String = text
        .split("\n#[cfg(test)]\nmod ")
        .next()
        .unwrap_or("")
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut used: Vec<String> = siblings
        .iter()
        .filter(|s| {
            [
                format!("super::{s}::"),
                format!("super::{s}}}"),
                format!("crate::store::{s}::"),
            ]
            .iter()
            .any(|p| code.contains(p.as_str()))
                || code.contains(&format!("super::{{{s}"))
        })
        .cloned()
        .collect();
    used.sort();
    used
}

/// The modules of `store/` depend on each other without a circle (write ↔ feed, write ↔
/// mutate and mutate ↔ group_commit once did): each job can be read, and changed, from the
/// bottom up. `mod.rs`, which declares them and holds `Store`, is the root and not counted.
#[test]
fn the_store_modules_form_no_circle() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/store");
    let siblings: Vec<String> = std::fs::read_dir(&dir)
        .expect("store/")
        .filter_map(|e| {
            let path = e.expect("entry").path();
            let stem = path.file_stem()?.to_str()?.to_owned();
            (stem != "mod" && (path.extension().is_some_and(|x| x == "rs") || path.is_dir()))
                .then_some(stem)
        })
        .collect();
    let mut edges = std::collections::BTreeMap::new();
    for s in &siblings {
        let file = [dir.join(format!("{s}.rs")), dir.join(s).join("mod.rs")]
            .into_iter()
            .find(|p| p.is_file())
            .expect("module file");
        let used: Vec<String> = store_siblings_used(&file, &siblings)
            .into_iter()
            .filter(|u| u != s)
            .collect();
        edges.insert(s.clone(), used);
    }
    // Depth-first search; a module met again while on the path closes a circle.
    fn visit(
        m: &str,
        edges: &std::collections::BTreeMap<String, Vec<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut circle = path[at..].to_vec();
            circle.push(m.to_owned());
            return Some(circle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_owned());
        for next in &edges[m] {
            if let Some(circle) = visit(next, edges, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        done.insert(m.to_owned());
        None
    }
    let mut done = std::collections::BTreeSet::new();
    for m in edges.keys() {
        if let Some(circle) = visit(m, &edges, &mut Vec::new(), &mut done) {
            panic!("store/ modules form a circle: {}", circle.join(" → "));
        }
    }
    assert!(
        edges.values().any(|used| !used.is_empty()),
        "no use between store/ modules was found: the scan is broken"
    );
}
