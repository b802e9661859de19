//! The test binaries of the workspace, built once by one cargo command whose JSON messages name
//! every executable, so nothing guesses at paths or hashes in `target/`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

/// Removes what `cargo run` set for xtask itself (`CARGO_PKG_NAME=xtask`, `CARGO_MANIFEST_DIR`,
/// …) from a child's environment. Build scripts declare some of these with
/// `rerun-if-env-changed` (ring does), so a cargo started with them — this build, or a test
/// that builds an image — would see them changed and rebuild every crate above ring.
pub fn without_run_env(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_MANIFEST_")
            || matches!(
                name,
                "CARGO_CRATE_NAME" | "CARGO_BIN_NAME" | "CARGO_PRIMARY_PACKAGE"
            )
        {
            command.env_remove(name);
        }
    }
    command
}

/// One thing to run: a libtest binary, or cargo running the doc tests.
#[derive(Debug, Clone)]
pub struct Job {
    /// `<crate>/<target>`: `tests/conformance`, `apiserver/lib`, `reports-server/bin`.
    pub name: String,
    pub program: PathBuf,
    /// Arguments before the user's test arguments.
    pub args: Vec<String>,
    /// The package's directory, where `cargo test` would run the binary.
    pub cwd: PathBuf,
    /// `CARGO_MANIFEST_DIR` for a test binary, as `cargo test` sets it: tests find their
    /// fixtures from it at run time, since a binary reused from another checkout's build carries
    /// that checkout's path. `None` for cargo itself (the doc tests): crates whose build tracks
    /// the variable (sqlx's macros) would rebuild.
    pub manifest_dir: Option<PathBuf>,
}

/// What one build produced.
pub struct Built {
    pub jobs: Vec<Job>,
    /// The `reports-server` executable, handed to the tests as `REPORTS_SERVER_BIN` so that no
    /// test process runs cargo again (several at once would queue on cargo's lock).
    pub server_binary: Option<PathBuf>,
}

#[derive(Deserialize)]
struct Message {
    reason: String,
    #[serde(default)]
    package_id: String,
    manifest_path: Option<PathBuf>,
    target: Option<Target>,
    profile: Option<Profile>,
    executable: Option<PathBuf>,
    success: Option<bool>,
}

#[derive(Deserialize)]
struct Target {
    name: String,
    kind: Vec<String>,
}

#[derive(Deserialize)]
struct Profile {
    test: bool,
}

/// Builds every target of the workspace (the full tier) or the crates' unit tests (`fast`).
///
/// The full tier builds with `cargo build --workspace --all-targets`: the same package selection
/// as the tests' own fallback build (`tests/src/server.rs`), so features unify identically and
/// neither build invalidates the other.
pub fn build(workspace: &Path, fast: bool) -> Result<Built> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    let args: &[&str] = if fast {
        &["test", "--workspace", "--lib", "--bins", "--no-run"]
    } else {
        &["build", "--workspace", "--all-targets"]
    };
    eprintln!(
        "xtask: building the test binaries: cargo {}",
        args.join(" ")
    );
    without_run_env(&mut command)
        .args(args)
        .args(["--message-format", "json-render-diagnostics"])
        .current_dir(workspace)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = command.spawn().context("cannot run cargo")?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut built = Built {
        jobs: Vec::new(),
        server_binary: None,
    };
    let mut build_succeeded = false;
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cargo's messages")?;
        // Build scripts may print non-JSON lines; cargo's own messages are all JSON.
        let Ok(message) = serde_json::from_str::<Message>(&line) else {
            continue;
        };
        if message.reason == "build-finished" {
            build_succeeded = message.success == Some(true);
        }
        collect(message, &mut built);
    }
    let status = child.wait().context("waiting for cargo")?;
    if !status.success() || !build_succeeded {
        bail!("the build failed (cargo's errors are above)");
    }
    built.jobs.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(built)
}

fn collect(message: Message, built: &mut Built) {
    let (Some(target), Some(profile), Some(executable), Some(manifest)) = (
        message.target,
        message.profile,
        message.executable,
        message.manifest_path,
    ) else {
        return;
    };
    if message.reason != "compiler-artifact" {
        return;
    }
    let package = package_name(&message.package_id);
    if !profile.test {
        if target.kind.iter().any(|k| k == "bin") && target.name == "reports-server" {
            built.server_binary = Some(executable);
        }
        return;
    }
    let kind = target.kind.first().map(String::as_str).unwrap_or("test");
    let short_package = package
        .strip_prefix("reports-server-")
        .unwrap_or(&package)
        .to_owned();
    let name = match kind {
        "lib" => format!("{short_package}/lib"),
        "bin" => format!("{short_package}/bin:{}", target.name),
        _ => format!("{short_package}/{}", target.name),
    };
    let cwd = manifest.parent().map(Path::to_path_buf).unwrap_or_default();
    built.jobs.push(Job {
        name,
        program: executable,
        args: Vec::new(),
        manifest_dir: Some(cwd.clone()),
        cwd,
    });
}

/// The doc tests, which only cargo (through rustdoc) can build and run.
pub fn doc_tests(workspace: &Path) -> Job {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    Job {
        name: "workspace/doc-tests".into(),
        program: cargo.into(),
        args: ["test", "--workspace", "--doc", "--"]
            .map(String::from)
            .to_vec(),
        cwd: workspace.to_path_buf(),
        manifest_dir: None,
    }
}

/// The package name in a package id: `path+file:///…/tests#reports-server-tests@0.1.0` (cargo
/// ≥ 1.77) or the older `reports-server-tests 0.1.0 (path+file:///…)`.
fn package_name(package_id: &str) -> String {
    if let Some((_, fragment)) = package_id.rsplit_once('#') {
        let name_at_version = fragment.split('@').next().unwrap_or(fragment);
        // A fragment without a name (`…/tests#0.1.0`) means the name is the directory's.
        if name_at_version
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_digit())
        {
            let path = package_id.split('#').next().unwrap_or_default();
            return path.rsplit('/').next().unwrap_or_default().to_owned();
        }
        return name_at_version.to_owned();
    }
    package_id.split(' ').next().unwrap_or_default().to_owned()
}

#[cfg(test)]
mod tests {
    use super::package_name;

    #[test]
    fn package_names_in_every_id_form() {
        assert_eq!(
            package_name("path+file:///w/main/tests#reports-server-tests@0.1.0"),
            "reports-server-tests"
        );
        assert_eq!(package_name("path+file:///w/main/xtask#0.1.0"), "xtask");
        assert_eq!(
            package_name("reports-server-tests 0.1.0 (path+file:///w/main/tests)"),
            "reports-server-tests"
        );
    }
}
