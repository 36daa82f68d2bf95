//! Locating and running the `pgscope` binary under test.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{bail, Result};

use crate::process::{describe, output_with_timeout};
use crate::workspace_root;

/// Longest a `pgscope trace` may run in a test, startup and symbolization included; traces in
/// these tests last at most 10 s.
pub(crate) const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// The binary under test: `$PGSCOPE_BIN`, else `target/release/pgscope`, else
/// `target/debug/pgscope` in the workspace.
pub fn pgscope_bin() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("PGSCOPE_BIN") {
        let bin = PathBuf::from(bin);
        if !bin.is_file() {
            bail!("PGSCOPE_BIN is `{}`, which does not exist", bin.display());
        }
        return Ok(bin);
    }
    let target = workspace_root().join("target");
    for profile in ["release", "debug"] {
        let bin = target.join(profile).join("pgscope");
        if bin.is_file() {
            return Ok(bin);
        }
    }
    bail!(
        "no pgscope binary in `{}/{{release,debug}}` and PGSCOPE_BIN is not set: \
         run `cargo build -p pgscope-agent` first",
        target.display()
    )
}

/// A `pgscope <args>` command.
pub fn pgscope_command<I, S>(args: I) -> Result<Command>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(pgscope_bin()?);
    cmd.args(args);
    // A developer's DEBUGINFOD_URLS (distros' elfutils profile scripts set one) would let pgscope
    // fetch debug files the tests expect it not to have; tests that want one use `Trace::env`.
    cmd.env_remove("DEBUGINFOD_URLS");
    Ok(cmd)
}

/// Runs `pgscope <args>` to completion (killed after 3 minutes) and returns its exit status and
/// output, whatever the status.
pub fn run_pgscope<I, S>(args: I) -> Result<Output>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    output_with_timeout(&mut pgscope_command(args)?, RUN_TIMEOUT)
}

/// Like [`run_pgscope`], but a non-zero exit is an error quoting stderr. Returns stdout (the
/// top-functions table), which it also echoes to the test's stderr.
pub fn run_pgscope_ok<I, S>(args: I) -> Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    run_ok(pgscope_command(args)?)
}

fn run_ok(mut cmd: Command) -> Result<String> {
    let line = describe(&cmd);
    let out = output_with_timeout(&mut cmd, RUN_TIMEOUT)?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!(
            "`{line}` failed ({}):\n{}\nstdout:\n{stdout}",
            out.status,
            stderr.trim()
        );
    }
    eprintln!("$ {line}\n{stdout}");
    Ok(stdout)
}

/// Arguments of one `pgscope trace` invocation, built per the CLI contract.
#[derive(Debug, Clone)]
pub struct Trace {
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
}

impl Trace {
    /// `trace --pid <pid>`: one backend.
    pub fn pid(pid: u32) -> Self {
        Trace {
            args: vec!["trace".into(), "--pid".into(), pid.to_string().into()],
            envs: Vec::new(),
        }
    }

    /// `trace --instance <target>`: a postmaster pid or a data directory.
    pub fn instance(target: impl AsRef<OsStr>) -> Self {
        Trace {
            args: vec!["trace".into(), "--instance".into(), target.as_ref().to_owned()],
            envs: Vec::new(),
        }
    }

    /// `--conninfo <info>`: where pgscope reads query texts.
    pub fn conninfo(mut self, info: &str) -> Self {
        self.args.extend(["--conninfo".into(), info.into()]);
        self
    }

    /// `--duration <secs>s`.
    pub fn duration_secs(self, secs: u64) -> Self {
        self.arg("--duration", format!("{secs}s"))
    }

    /// `--frequency <hz>`.
    pub fn frequency(self, hz: u32) -> Self {
        self.arg("--frequency", hz.to_string())
    }

    /// `--folded <path>`.
    pub fn folded(self, path: &Path) -> Self {
        self.arg("--folded", path)
    }

    /// `--pprof <path>`.
    pub fn pprof(self, path: &Path) -> Self {
        self.arg("--pprof", path)
    }

    /// `--svg <path>`.
    pub fn svg(self, path: &Path) -> Self {
        self.arg("--svg", path)
    }

    /// `--json <path>`: the summary in schema `pgscope.trace.summary/v1`.
    pub fn json(self, path: &Path) -> Self {
        self.arg("--json", path)
    }

    /// `--record <path>`: the trace saved for `pgscope report --from`.
    pub fn record(self, path: &Path) -> Self {
        self.arg("--record", path)
    }

    /// `--report <path>`: the HTML report.
    pub fn report(self, path: &Path) -> Self {
        self.arg("--report", path)
    }

    /// `--probes <functions>`: a comma-separated list of function names, or `all`.
    pub fn probes(self, functions: &str) -> Self {
        self.arg("--probes", functions)
    }

    /// `--off-cpu`: measure time off CPU too.
    pub fn off_cpu(self) -> Self {
        self.flag("--off-cpu")
    }

    /// `--off-cpu=<mode>`: `sampled` (the default), `exact` (the context-switch tracer), `both`
    /// (the tracer's tables go to the JSON's `off_cpu_exact`) or `none`.
    pub fn off_cpu_mode(self, mode: &str) -> Self {
        self.flag(&format!("--off-cpu={mode}"))
    }

    /// `--probe FUNCTION=PATH:OFFSET`: probe a function at a location given by hand.
    pub fn explicit_probe(self, spec: &str) -> Self {
        self.arg("--probe", spec)
    }

    /// `--probe-budget <percent|none>`: `none` measures every call (exact counts); the
    /// default budget duty-cycles hot probes and estimates their counts.
    pub fn probe_budget(self, budget: &str) -> Self {
        self.arg("--probe-budget", budget)
    }

    /// `--queryid <queryid>`: keep only samples of that query.
    pub fn queryid(self, query_id: i64) -> Self {
        self.arg("--queryid", query_id.to_string())
    }

    /// `--debug-dir <dir>` when the build has one.
    pub fn debug_dir(self, dir: Option<&Path>) -> Self {
        match dir {
            Some(dir) => self.arg("--debug-dir", dir),
            None => self,
        }
    }

    /// Sets an environment variable of the pgscope process (e.g. `DEBUGINFOD_URLS`).
    pub fn env(mut self, name: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.envs
            .push((name.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Runs it; fails on a non-zero exit. Returns stdout and stderr (where pgscope says what it
    /// could not do, e.g. a probe it did not attach), echoing both to the test's stderr.
    pub fn output(&self) -> Result<TraceOutput> {
        let mut cmd = self.command()?;
        let line = describe(&cmd);
        TraceOutput::checked(&line, output_with_timeout(&mut cmd, RUN_TIMEOUT)?)
    }

    /// The full argument list after the binary name.
    pub fn args(&self) -> &[OsString] {
        &self.args
    }

    /// The `pgscope` command with these arguments and environment variables.
    pub fn command(&self) -> Result<Command> {
        let mut cmd = pgscope_command(&self.args)?;
        cmd.envs(self.envs.iter().map(|(name, value)| (name, value)));
        Ok(cmd)
    }

    /// Runs it; fails on a non-zero exit. Returns stdout.
    pub fn run(&self) -> Result<String> {
        run_ok(self.command()?)
    }

    fn arg(mut self, flag: &str, value: impl AsRef<OsStr>) -> Self {
        self.args.push(flag.into());
        self.args.push(value.as_ref().to_owned());
        self
    }

    fn flag(mut self, flag: &str) -> Self {
        self.args.push(flag.into());
        self
    }
}

/// What a `pgscope trace` that exited successfully printed.
#[derive(Debug, Clone)]
pub struct TraceOutput {
    /// The summary tables.
    pub stdout: String,
    /// Progress, warnings and what could not be done.
    pub stderr: String,
}

impl TraceOutput {
    /// Fails on a non-zero exit, quoting stderr; echoes both streams to the test's stderr.
    pub(crate) fn checked(line: &str, out: Output) -> Result<Self> {
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() {
            bail!(
                "`{line}` failed ({}):\n{}\nstdout:\n{stdout}",
                out.status,
                stderr.trim()
            );
        }
        eprintln!("$ {line}\n{stderr}{stdout}");
        Ok(Self { stdout, stderr })
    }
}
