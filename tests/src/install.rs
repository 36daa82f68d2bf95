//! The Postgres builds the tests run against.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, ensure, Context, Result};

use crate::workspace_root;

/// Debian's `postgresql-15` package: stripped, built with frame pointers, no debug files.
pub const DISTRO_BINDIR: &str = "/usr/lib/postgresql/15/bin";

/// One installed Postgres build: where its binaries are and where its separate debug files are.
#[derive(Debug, Clone)]
pub struct PgInstall {
    /// Holds `postgres`, `initdb`, `pg_ctl`, `psql`, `pg_isready`, `pgbench`.
    pub bindir: PathBuf,
    /// Root of a `.build-id/xx/rest.debug` tree, to pass to `pgscope --debug-dir`.
    pub debug_dir: Option<PathBuf>,
    /// Short name for messages: `distro` or `nofp`.
    pub label: &'static str,
}

impl PgInstall {
    /// The distro build (`postgresql-15` from Debian): frame pointers, stripped, static functions
    /// unnamed.
    pub fn distro() -> Result<Self> {
        let install = PgInstall {
            bindir: PathBuf::from(DISTRO_BINDIR),
            debug_dir: None,
            label: "distro",
        };
        install.check()?;
        Ok(install)
    }

    /// The same source built like RHEL builds it (`-O2 -g -fomit-frame-pointer`, stripped, debug
    /// info in a build-id tree), by `scripts/build-postgres-nofp.sh`. The first call on a machine
    /// compiles Postgres (minutes); later calls return at once from its cache.
    pub fn no_frame_pointers() -> Result<Self> {
        let script = workspace_root().join("scripts/build-postgres-nofp.sh");
        let out = Command::new(&script)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .with_context(|| format!("cannot run `{}`", script.display()))?;
        if !out.status.success() {
            bail!(
                "`{}` failed ({}); see its messages above",
                script.display(),
                out.status
            );
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let prefix = stdout
            .lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .with_context(|| format!("`{}` printed no install prefix", script.display()))?;
        let prefix = Path::new(prefix);
        let install = PgInstall {
            bindir: prefix.join("bin"),
            debug_dir: Some(prefix.join("debug")),
            label: "nofp",
        };
        install.check()?;
        Ok(install)
    }

    /// Path of one of this build's programs.
    pub fn bin(&self, name: &str) -> PathBuf {
        self.bindir.join(name)
    }

    fn check(&self) -> Result<()> {
        for tool in ["postgres", "initdb", "pg_ctl", "psql", "pg_isready"] {
            let path = self.bin(tool);
            ensure!(
                path.is_file(),
                "`{}` is missing: the {} Postgres build is not installed (run `make deps`{})",
                path.display(),
                self.label,
                if self.label == "nofp" {
                    " and `make pg-nofp`"
                } else {
                    ""
                }
            );
        }
        if let Some(dir) = &self.debug_dir {
            ensure!(
                dir.join(".build-id").is_dir(),
                "`{}` has no .build-id tree: the {} build is incomplete",
                dir.display(),
                self.label
            );
        }
        Ok(())
    }
}
