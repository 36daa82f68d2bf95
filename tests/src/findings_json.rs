//! What the findings tests share: the `findings[]` of a `pgscope trace --json` summary, read
//! back (rule, severity, statements, figures, rather than the console's wording); one cluster
//! for all the tests of a file; databases of their own for workloads, which run until their
//! backends have used the CPU time an assertion needs (`BackgroundPgbench::run_for_cpu`).

use std::ops::Deref;
use std::path::Path;
use std::sync::{Mutex, MutexGuard, Once};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::app_database::psql_in;
use crate::cluster::PgCluster;
use crate::cpu_window::SchedTime;
use crate::install::PgInstall;
use crate::pgbench::BackgroundPgbench;
use crate::pgscope::{Trace, TraceOutput};
use crate::process::wait_for;
use crate::uprobe_count::LiveCount;

/// One finding of the JSON summary.
#[derive(Debug, Clone)]
pub struct JsonFinding {
    /// The rule's stable name (`pgss_evictions`, `spin_site`, …).
    pub kind: String,
    /// `info`, `warning` or `critical`.
    pub severity: String,
    pub title: String,
    /// The statements it covers.
    pub queryids: Vec<String>,
    /// Its supporting figures, as (what, value).
    pub numbers: Vec<(String, String)>,
    /// The functions it names.
    pub functions: Vec<String>,
    /// What it advises.
    pub action: String,
}

impl JsonFinding {
    /// Warning or critical: what a DBA is asked to act on.
    pub fn is_alarm(&self) -> bool {
        matches!(self.severity.as_str(), "warning" | "critical")
    }

    /// The value of the first figure whose description starts with `what`.
    pub fn number(&self, what: &str) -> Option<&str> {
        self.numbers
            .iter()
            .find(|(w, _)| w.starts_with(what))
            .map(|(_, v)| v.as_str())
    }

    /// The leading number of [`Self::number`]'s value (`5783 (723.0/s)` → 5783, `12.5%` → 12.5).
    pub fn leading_number(&self, what: &str) -> Result<f64> {
        let value = self
            .number(what)
            .with_context(|| format!("finding `{}` has no figure `{what}…`: {self:#?}", self.kind))?;
        let head: String = value
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        head.parse().with_context(|| {
            format!(
                "figure `{what}` of finding `{}` is `{value}`, not a number",
                self.kind
            )
        })
    }

    /// Whether its title or functions name `function`.
    pub fn names_function(&self, function: &str) -> bool {
        self.title.contains(function) || self.functions.iter().any(|f| f.contains(function))
    }
}

/// `findings[]` of the summary at `path`.
pub fn read_findings(path: &Path) -> Result<Vec<JsonFinding>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read `{}`", path.display()))?;
    let summary: Value =
        serde_json::from_str(&text).with_context(|| format!("`{}` is not JSON", path.display()))?;
    let findings = summary["findings"]
        .as_array()
        .with_context(|| format!("no findings[] in `{}`", path.display()))?;
    findings.iter().map(parse).collect()
}

fn parse(finding: &Value) -> Result<JsonFinding> {
    let text = |field: &str| -> Result<String> {
        finding[field]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("finding without a string `{field}`: {finding}"))
    };
    let strings = |field: &str| -> Result<Vec<String>> {
        finding[field]
            .as_array()
            .with_context(|| format!("finding without a list `{field}`: {finding}"))?
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .with_context(|| format!("`{field}` holds `{v}`, not a string"))
            })
            .collect()
    };
    let numbers = finding["numbers"]
        .as_array()
        .with_context(|| format!("finding without numbers[]: {finding}"))?
        .iter()
        .map(|n| {
            let what = n["what"]
                .as_str()
                .with_context(|| format!("number without `what`: {n}"))?;
            let value = n["value"]
                .as_str()
                .with_context(|| format!("number without `value`: {n}"))?;
            Ok((what.to_owned(), value.to_owned()))
        })
        .collect::<Result<_>>()?;
    Ok(JsonFinding {
        kind: text("kind")?,
        severity: text("severity")?,
        title: text("title")?,
        queryids: strings("queryids")?,
        numbers,
        functions: strings("functions")?,
        action: text("action")?,
    })
}

/// What a trace run around a workload gave: its output, its findings and what the workload
/// measured meanwhile.
pub struct TracedWorkload<T> {
    pub output: TraceOutput,
    pub findings: Vec<JsonFinding>,
    pub measured: T,
}

/// Runs `trace` (with `--json` into a temporary file) while `workload` runs, then ends it.
pub fn findings_while<T>(trace: Trace, workload: impl FnOnce() -> Result<T>) -> Result<TracedWorkload<T>> {
    let dir = tempfile::tempdir().context("cannot create a directory for the summary")?;
    let json = dir.path().join("summary.json");
    let running = trace.duration_secs(600).json(&json).spawn()?;
    let measured = workload()?;
    let output = running.interrupt()?;
    Ok(TracedWorkload {
        output,
        findings: read_findings(&json)?,
        measured,
    })
}

/// One line per finding, for the test's log: severity, kind, statements and figures.
pub fn describe_findings(findings: &[JsonFinding]) -> String {
    findings
        .iter()
        .map(|f| {
            format!(
                "[{}] {} {:?}: {}\n    {:?}",
                f.severity, f.kind, f.queryids, f.title, f.numbers
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The cluster every test of one test binary shares (a cluster start costs seconds, a database
/// a fraction of one), and the settings it runs with.
struct Shared {
    cluster: PgCluster,
    /// None while being changed (a failed change leaves them unknown).
    settings: Option<Vec<(String, String)>>,
}

static SHARED: Mutex<Option<Shared>> = Mutex::new(None);

/// The distro build's cluster shared by the tests of this test binary, with pg_stat_statements
/// preloaded (created only in the databases of [`fresh_database`]) and `settings` set with
/// `ALTER SYSTEM`, every other setting at the harness' default: a test states what it needs
/// and finds it whatever the tests before it did (the server restarts when the settings
/// change). Each test keeps its tables in databases of its own. Held until the guard is
/// dropped; the cluster is stopped and removed when the test binary exits.
pub fn shared_cluster(settings: &[(&str, &str)]) -> Result<SharedCluster> {
    static STOP_AT_EXIT: Once = Once::new();
    let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if shared.is_none() {
        let cluster = PgCluster::start_with(
            &PgInstall::distro()?,
            &[("shared_preload_libraries", "pg_stat_statements")],
        )?;
        *shared = Some(Shared {
            cluster,
            settings: Some(Vec::new()),
        });
        // SAFETY: atexit with a function that takes no argument and does not unwind (it
        // catches every error of the cluster's teardown, which `PgCluster::drop` reports).
        STOP_AT_EXIT.call_once(|| unsafe {
            libc::atexit(stop_shared_cluster);
        });
    }
    let mut guard = SharedCluster { guard: shared };
    guard.configure(settings)?;
    Ok(guard)
}

/// Stops the shared cluster at exit (statics are never dropped).
extern "C" fn stop_shared_cluster() {
    let _ = std::panic::catch_unwind(|| {
        drop(SHARED.lock().unwrap_or_else(|e| e.into_inner()).take());
    });
}

/// The shared cluster, held by one test at a time.
pub struct SharedCluster {
    guard: MutexGuard<'static, Option<Shared>>,
}

impl SharedCluster {
    /// Runs the server with `settings` (in `postgresql.auto.conf`) and every other setting at
    /// the harness' default, restarting it if they differ from what it runs with.
    pub fn configure(&mut self, settings: &[(&str, &str)]) -> Result<()> {
        let wanted: Vec<(String, String)> = settings
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect();
        let Some(shared) = self.guard.as_mut() else {
            unreachable!("shared_cluster() started it before handing out the guard");
        };
        if shared.settings.as_ref() == Some(&wanted) {
            return Ok(());
        }
        shared.settings = None;
        let cluster = &shared.cluster;
        cluster.psql("ALTER SYSTEM RESET ALL")?;
        for (name, value) in &wanted {
            cluster.psql(&format!(
                "ALTER SYSTEM SET {name} = '{}'",
                value.replace('\'', "''")
            ))?;
        }
        // Some settings (pg_stat_statements.max) take a restart; one for all is simplest.
        cluster.restart()?;
        shared.settings = Some(wanted);
        Ok(())
    }
}

impl Deref for SharedCluster {
    type Target = PgCluster;

    fn deref(&self) -> &PgCluster {
        match self.guard.as_ref() {
            Some(shared) => &shared.cluster,
            None => unreachable!("shared_cluster() started it before handing out the guard"),
        }
    }
}

/// Creates database `name` in `cluster` with pg_stat_statements in it, dropping one left by an
/// earlier run of the test first (and its connections): a test's tables, database-level
/// settings and pg_class size start from `template1` whatever ran before.
pub fn fresh_database(cluster: &PgCluster, name: &str) -> Result<()> {
    cluster.psql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))?;
    cluster.psql(&format!("CREATE DATABASE {name}"))?;
    psql_in(cluster, name, "CREATE EXTENSION pg_stat_statements")?;
    Ok(())
}

/// The queryid pg_stat_statements gives the top-level statement of database `database` whose
/// normalized text starts with `text`, the most called if several do.
pub fn queryid_in(cluster: &PgCluster, database: &str, text: &str) -> Result<String> {
    let queryid = psql_in(
        cluster,
        database,
        &format!(
            "SELECT queryid FROM pg_stat_statements WHERE toplevel AND query LIKE '{}%' AND \
             dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             ORDER BY calls DESC LIMIT 1",
            text.replace('\'', "''")
        ),
    )?;
    let queryid = queryid.trim();
    if queryid.is_empty() {
        bail!("no pg_stat_statements entry in database {database} for `{text}…`");
    }
    Ok(queryid.to_string())
}

/// Empties pg_stat_statements (of every database), from database `database`, where the
/// extension is.
pub fn reset_statements(cluster: &PgCluster, database: &str) -> Result<()> {
    psql_in(cluster, database, "SELECT pg_stat_statements_reset()").map(drop)
}

/// How long a workload may take to use the CPU time asked of it: minutes, where a busy machine
/// gives its backends a fraction of a core.
pub const CPU_TIMEOUT: Duration = Duration::from_secs(180);

/// Runs `pgbench` until its backends have used `cpu` of CPU time from now on and perf's
/// `count` has seen `min_spins` spins; returns the spins and the backends' times. `what` names
/// the wait (a failure says how far it got).
pub fn run_until_spins(
    pgbench: &mut BackgroundPgbench,
    count: LiveCount,
    cpu: Duration,
    min_spins: u64,
    what: &str,
) -> Result<(u64, SchedTime)> {
    let window = pgbench.cpu_window()?;
    let mut used = SchedTime::default();
    wait_for(
        &format!("{what} to use {cpu:?} of CPU and spin {min_spins} times on the entry"),
        CPU_TIMEOUT,
        || {
            used = window.used()?;
            Ok((used.on_cpu >= cpu && count.so_far() >= min_spins).then_some(()))
        },
    )
    .with_context(|| {
        format!(
            "perf counted {} spins; the backends used {}",
            count.so_far(),
            describe_cpu(&used)
        )
    })?;
    pgbench.ensure_running()?;
    Ok((count.stop()?, used))
}

/// `used` as a log line: CPU time, run-queue time and how much of the time the processes were
/// runnable they spent waiting for a CPU (what a busy machine takes from them).
pub fn describe_cpu(used: &SchedTime) -> String {
    let runnable = (used.on_cpu + used.runnable).as_secs_f64();
    let waiting = if runnable > 0.0 {
        100.0 * used.runnable.as_secs_f64() / runnable
    } else {
        0.0
    };
    format!(
        "{:.2} s on CPU and {:.2} s waiting for one (run queue: {waiting:.0}% of their runnable time)",
        used.on_cpu.as_secs_f64(),
        used.runnable.as_secs_f64()
    )
}
