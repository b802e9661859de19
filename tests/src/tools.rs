//! The Go tools of `tests/tools/build.sh` (`helm`, `kstatus`, `argocd`), built from the Go module
//! proxy and cached by version outside the work tree (see docs/operator.md).

use std::path::PathBuf;

use anyhow::{Result, ensure};

use crate::controlplane::run_cache_build_script;

/// Builds (or finds cached) one of the tools of `tests/tools/build.sh` (`helm`, `kstatus`,
/// `argocd`) through the harness' runner for cached Go build scripts; a missing Go toolchain or
/// module proxy fails with what to install.
pub async fn tool(name: &str) -> Result<PathBuf> {
    let path = run_cache_build_script(&format!("tests/tools/{name}.sh"), name).await?;
    ensure!(path.is_file(), "{} was not built", path.display());
    Ok(path)
}
