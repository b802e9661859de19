//! The real `kubectl` binary, pointed at a kubeconfig.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{Context, bail};

pub fn kubectl_path() -> anyhow::Result<PathBuf> {
    let path = std::env::var("KUBECTL")
        .map(PathBuf::from)
        .ok()
        .or_else(|| {
            std::env::var_os("PATH")?
                .to_str()?
                .split(':')
                .map(|d| Path::new(d).join("kubectl"))
                .find(|p| p.exists())
        });
    path.context("kubectl not found: install it (Debian: apt-get install -y kubectl, or download the release binary) or set KUBECTL=/path/to/kubectl")
}

pub struct Kubectl {
    kubeconfig: PathBuf,
}

impl Kubectl {
    pub fn new(kubeconfig: &Path) -> Self {
        Kubectl {
            kubeconfig: kubeconfig.to_owned(),
        }
    }

    fn command(&self, args: &[&str]) -> anyhow::Result<Command> {
        let mut c = Command::new(kubectl_path()?);
        c.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .env("KUBECACHEDIR", self.kubeconfig.with_extension("cache"));
        Ok(c)
    }

    /// Runs kubectl; returns its output whatever the exit status.
    /// The kubeconfig it uses (for other tools: helm).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    pub fn output(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<Output> {
        let mut c = self.command(args)?;
        c.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = c.spawn()?;
        if let Some(input) = stdin {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(input.as_bytes())?;
        }
        Ok(child.wait_with_output()?)
    }

    /// Runs kubectl and fails with its stderr unless it succeeds; returns stdout.
    pub fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        self.run_with_stdin(args, None)
    }

    pub fn run_with_stdin(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
        let out = self.output(args, stdin)?;
        if !out.status.success() {
            bail!(
                "kubectl {} failed ({}):\n{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// Starts a long-running kubectl (e.g. `get -w`) whose stdout the caller reads.
    pub fn spawn(&self, args: &[&str]) -> anyhow::Result<std::process::Child> {
        Ok(self
            .command(args)?
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?)
    }
}
