//! Workloads whose calls of the probed functions are known from Postgres' source, run under a
//! `pgscope trace --probes` that measures every call: prepared selects of a partitioned table
//! under a generic plan (pgbench), and one backend running a known list of statements.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

use crate::connection::Connection;
use crate::pgss_discovery::{mapped_library, LIBRARY};
use crate::process::wait_for;
use crate::spin_calls::{call_s_lock_in, expected_once, sites_in_file, CallSite, SiteCalls};
use crate::summary::{CallStats, RelationLock};
use crate::{PgCluster, Trace, TraceSummary};

/// pgbench's `-S` statement as pg_stat_statements shows it under `-M prepared`.
pub const PGBENCH_SELECT: &str = "SELECT abalance FROM pgbench_accounts WHERE aid = $1";

/// Settings [`GenericPlan::measure`] needs: every execution of a prepared statement uses the
/// generic plan, so nothing is pruned at plan time.
pub const GENERIC_PLAN_SETTINGS: &[(&str, &str)] = &[("plan_cache_mode", "force_generic_plan")];

/// Rows of `small`, the inner side of [`NESTED_LOOP`] and what the workload vacuums.
pub const SMALL_ROWS: u64 = 20;
/// Outer rows of [`NESTED_LOOP`]: one index descent into `small` each.
pub const OUTER_ROWS: u64 = 50_000;
/// How long the statistics of an exited backend may take to be readable (Postgres 14's
/// collector on a busy machine).
const STATS_TIMEOUT: Duration = Duration::from_secs(30);
/// Every outer row matches one row of `small` (ids 0..19), found by its own index descent.
pub const NESTED_LOOP: &str =
    "SELECT count(*) FROM generate_series(1, 50000) g JOIN small s ON s.id = g % 20";
/// The settings that make [`NESTED_LOOP`] a nested loop rescanning `small_pkey` per outer row.
const NESTED_LOOP_SETTINGS: [&str; 4] = [
    "SET enable_hashjoin = off",
    "SET enable_mergejoin = off",
    "SET enable_material = off",
    // Otherwise a Memoize node caches the 20 distinct inner results: 20 descents, not one per
    // outer row.
    "SET enable_memoize = off",
];

/// What `pgbench -S -M prepared` did to a table of `partitions` partitions while traced.
#[derive(Debug, Clone)]
pub struct GenericPlan {
    pub partitions: u32,
    /// pg_stat_statements' queryid of the select.
    pub queryid: String,
    /// Its `PortalStart` calls: one per execution.
    pub executions: u64,
    /// Its `GetCachedPlan` calls.
    pub cached_plans: u64,
    /// Its `LockRelationOid` calls.
    pub locks: u64,
    /// Its `relation_locks[]` rows.
    pub relation_locks: Vec<RelationLock>,
    /// The partitions of `pgbench_accounts`.
    pub partition_oids: BTreeSet<u32>,
    /// pgscope's lines about probes it did not attach.
    pub not_attached: Vec<String>,
}

impl GenericPlan {
    /// Splits `pgbench_accounts` into `partitions` on `cluster` (started with
    /// [`GENERIC_PLAN_SETTINGS`] and pg_stat_statements) and traces `pgbench -S -M prepared` for
    /// 4 s with `LockRelationOid,GetCachedPlan,PortalStart`, every call measured.
    pub fn measure(cluster: &PgCluster, partitions: u32) -> Result<Self> {
        cluster.pgbench(&["-i", "-q", "-s", "1", &format!("--partitions={partitions}")])?;
        let partition_oids: BTreeSet<u32> = cluster
            .psql("SELECT inhrelid FROM pg_inherits WHERE inhparent = 'pgbench_accounts'::regclass")?
            .lines()
            .map(|oid| oid.parse().with_context(|| format!("bad oid `{oid}`")))
            .collect::<Result<_>>()?;
        ensure!(
            partition_oids.len() == partitions as usize,
            "pgbench made {} partitions, not {partitions}",
            partition_oids.len()
        );
        let dir = tempfile::tempdir()?;
        let json = dir.path().join("summary.json");
        // -n: `pgbench -i` vacuumed already; pgbench's vacuum connection would otherwise count
        // as one of the clients spawn_pgbench waits for.
        let mut pgbench =
            cluster.spawn_pgbench(&["-n", "-S", "-M", "prepared", "-c", "1", "-T", "600"], 1)?;
        let output = Trace::instance(cluster.data_dir())
            .probes("LockRelationOid,GetCachedPlan,PortalStart")
            .probe_budget("none")
            .duration_secs(4)
            .json(&json)
            .output()?;
        ensure!(pgbench.is_running()?, "pgbench ended during the trace");
        pgbench.stop()?;

        let (queryid, _) = pgss_entry(cluster, &format!("{PGBENCH_SELECT}%"))?;
        let summary = TraceSummary::read(&json)?;
        check_consistent(&summary)?;
        let calls = |function| -> Result<u64> {
            Ok(summary.probe_of_query(&queryid, function)?.map_or(0, |s| s.calls))
        };
        let measured = GenericPlan {
            partitions,
            executions: calls("PortalStart")?,
            cached_plans: calls("GetCachedPlan")?,
            locks: calls("LockRelationOid")?,
            relation_locks: summary.relation_locks(&queryid)?,
            queryid,
            partition_oids,
            not_attached: not_attached(&output.stderr)
                .into_iter()
                .map(str::to_owned)
                .collect(),
        };
        eprintln!(
            "{partitions} partitions: queryid {}: {} executions (PortalStart), {} GetCachedPlan, \
             {} LockRelationOid = {:.2} per execution",
            measured.queryid,
            measured.executions,
            measured.cached_plans,
            measured.locks,
            measured.locks_per_execution()
        );
        Ok(measured)
    }

    pub fn locks_per_execution(&self) -> f64 {
        self.locks as f64 / self.executions.max(1) as f64
    }

    /// What disagrees with `expected_locks` LockRelationOid calls per execution and with one
    /// GetCachedPlan per PortalStart; empty when all agree.
    pub fn disagreements(&self, expected_locks: u32) -> Vec<String> {
        let (n, q) = (self.partitions, &self.queryid);
        let mut wrong = self.not_attached.clone();
        // pgbench -S runs thousands of selects per second even with every lock trapped.
        if self.executions < 1000 {
            wrong.push(format!(
                "{n} partitions: only {} PortalStart calls of queryid {q} in 4 s",
                self.executions
            ));
        }
        // The three probes are attached one after the other and their counts read one after
        // the other while pgbench runs: an execution or so at each end is counted by some of
        // them only, hence 1% between counts that are equal per execution.
        if self.cached_plans.abs_diff(self.executions) * 100 > self.executions {
            wrong.push(format!(
                "{n} partitions: {} GetCachedPlan calls for {} PortalStart calls of queryid {q}, \
                 expected equal within 1%",
                self.cached_plans, self.executions
            ));
        }
        let per_execution = self.locks_per_execution();
        let expected = f64::from(expected_locks);
        if (per_execution - expected).abs() * 100.0 > expected {
            wrong.push(format!(
                "{n} partitions: {per_execution:.2} LockRelationOid calls per execution of queryid \
                 {q} ({} / {}), expected {expected_locks} within 1%",
                self.locks, self.executions
            ));
        }
        let shared: BTreeSet<u32> = self
            .relation_locks
            .iter()
            .filter(|l| l.lockmode == "AccessShareLock")
            .map(|l| l.relid)
            .collect();
        let unlocked: Vec<u32> = self.partition_oids.difference(&shared).copied().collect();
        if !unlocked.is_empty() {
            wrong.push(format!(
                "{n} partitions: queryid {q} never locked partitions {unlocked:?}; locks: {:?}",
                self.relation_locks
            ));
        }
        // relation_locks[] is counted on entry, probes_by_query[] on return, and the two are
        // read one after the other while the probes still fire: equal within 1%, not exactly.
        let by_relation: u64 = self.relation_locks.iter().map(|l| l.calls).sum();
        if by_relation.abs_diff(self.locks) * 100 > self.locks {
            wrong.push(format!(
                "{n} partitions: relation_locks[] of queryid {q} add up to {by_relation} \
                 LockRelationOid calls, probes_by_query[] says {}",
                self.locks
            ));
        }
        wrong
    }
}

/// What one backend runs while traced, in this order.
#[derive(Debug, Clone, Copy, Default)]
pub struct BackendWorkload {
    /// `SELECT i + 1` statements, i = 0, 1, …: one pg_stat_statements entry.
    pub selects: u64,
    /// Runs of [`NESTED_LOOP`].
    pub nested_loops: u64,
    /// `VACUUM small` commands.
    pub vacuums: u64,
    /// `s_lock` calls made from gdb, one per site.
    pub spin_sites: &'static [CallSite],
}

impl BackendWorkload {
    /// The top-level statements the backend executes while traced.
    pub fn statements(&self) -> u64 {
        self.selects + self.nested_loops + self.vacuums
    }
}

/// What a [`BackendWorkload`] did under one trace of its backend.
pub struct TracedBackend {
    pub workload: BackendWorkload,
    pub summary: TraceSummary,
    /// What pgscope printed on stderr (found/not attached).
    pub stderr: String,
    /// The backend's pg_stat_statements.so as it maps it; `None` when not loaded.
    pub library: Option<PathBuf>,
    /// Scans of `small_pkey` Postgres counted during the nested loops.
    pub index_scans: u64,
    /// pg_stat_statements' queryid and calls of [`NESTED_LOOP`], when it ran.
    pub nested_loop: Option<(String, u64)>,
    /// pg_stat_statements' queryid and calls of the selects (`SELECT $1 + $2`), when they ran.
    pub selects: Option<(String, u64)>,
}

impl TracedBackend {
    /// All calls of `function` (`pgss_store(exec)` for a kind) in the trace; 0 when none.
    pub fn calls(&self, function: &str) -> Result<u64> {
        Ok(self.summary.probe(function)?.map_or(0, |s| s.calls))
    }

    /// Calls of `function` under the nested loop's queryid.
    pub fn nested_loop_calls(&self, function: &str) -> Result<u64> {
        let (queryid, _) = self
            .nested_loop
            .as_ref()
            .context("the workload ran no nested loop")?;
        Ok(self
            .summary
            .probe_of_query(queryid, function)?
            .map_or(0, |s| s.calls))
    }

    /// pgscope's lines about probes it did not attach.
    pub fn not_attached(&self) -> Vec<&str> {
        not_attached(&self.stderr)
    }

    /// `function` must have been called `per_statement` times per statement executed.
    pub fn per_statement(&self, function: &str, per_statement: u64) -> Result<Option<String>> {
        let statements = self.workload.statements();
        Ok(differs(
            &format!("{function} calls for {statements} statements executed"),
            self.calls(function)?,
            statements * per_statement,
        ))
    }

    /// pgss_store(exec) calls under the selects' queryid: pgscope takes a pgss_store call's
    /// queryid from its `queryId` argument, so this checks where the major's signature puts it.
    pub fn exec_stores_of_selects(&self) -> Result<u64> {
        let (queryid, _) = self.selects.as_ref().context("the workload ran no selects")?;
        Ok(self
            .summary
            .probe_of_query(queryid, "pgss_store(exec)")?
            .map_or(0, |s| s.calls))
    }

    /// The selects' pgss_store(exec) calls must equal the calls pg_stat_statements counted
    /// for their queryid, and the selects run.
    pub fn selects_disagreements(&self) -> Result<Vec<String>> {
        let (queryid, calls) = self.selects.as_ref().context("the workload ran no selects")?;
        let stores = self.exec_stores_of_selects()?;
        Ok([
            differs(
                &format!("pg_stat_statements calls of the selects (queryid {queryid})"),
                *calls,
                self.workload.selects,
            ),
            differs(
                &format!("pgss_store(exec) calls under the selects' queryid {queryid}"),
                stores,
                *calls,
            ),
        ]
        .into_iter()
        .flatten()
        .collect())
    }

    /// vac_update_datfrozenxid must have been called `per_vacuum` times per VACUUM.
    pub fn per_vacuum(&self, per_vacuum: u64) -> Result<Option<String>> {
        let vacuums = self.workload.vacuums;
        Ok(differs(
            &format!("vac_update_datfrozenxid calls for {vacuums} VACUUMs"),
            self.calls("vac_update_datfrozenxid")?,
            vacuums * per_vacuum,
        ))
    }

    /// The nested loop must be what it was meant to be (one scan of small_pkey per outer row,
    /// as Postgres counts them), and its `_bt_getroot` calls equal those scans: Postgres counts
    /// a scan in `_bt_first` (15.18 nbtsearch.c:883; 18.6 nbtsearch.c:957, right before the
    /// `_bt_search` that calls `_bt_getroot`), which for one equality key descends once.
    pub fn btree_disagreements(&self) -> Result<Vec<String>> {
        let (queryid, runs) = self
            .nested_loop
            .as_ref()
            .context("the workload ran no nested loop")?;
        let roots = self.nested_loop_calls("_bt_getroot")?;
        let scans = self.index_scans;
        let mut wrong: Vec<String> = [
            differs(
                &format!("pg_stat_statements calls of the nested loop (queryid {queryid})"),
                *runs,
                self.workload.nested_loops,
            ),
            differs(
                "index scans of small_pkey Postgres counted in the nested loops",
                scans,
                self.workload.nested_loops * OUTER_ROWS,
            ),
        ]
        .into_iter()
        .flatten()
        .collect();
        // The backend is traced alone and its catalog caches are warm; 1% leaves room for a
        // catalog descent under the query's id that a cache invalidation may cause.
        if roots.abs_diff(scans) * 100 > scans {
            wrong.push(format!(
                "{roots} _bt_getroot calls of the nested loop (queryid {queryid}), Postgres counted \
                 {scans} index scans of small_pkey (expected equal within 1%)"
            ));
        }
        Ok(wrong)
    }

    /// The workload's s_lock call sites as read back, (line, function, calls) sorted, and
    /// whether they are exactly the sites called, once each.
    pub fn spin_sites(&self) -> Result<(Vec<SiteCalls>, Option<String>)> {
        let Some(site) = self.workload.spin_sites.first() else {
            return Ok((Vec::new(), None));
        };
        let read = sites_in_file(&self.summary.spin_sites()?, site.file);
        let expected = expected_once(self.workload.spin_sites);
        let wrong = (read != expected)
            .then(|| format!("s_lock call sites read back as {read:?}, expected {expected:?}"));
        Ok((read, wrong))
    }
}

/// `what: measured, expected wanted` when they differ.
pub fn differs(what: &str, measured: u64, wanted: u64) -> Option<String> {
    (measured != wanted).then(|| format!("{what}: {measured}, expected {wanted}"))
}

/// Runs `workload` in one new backend of `cluster`, traced with the probe arguments `probe_args`
/// adds (every call measured), and reads back what the trace and Postgres counted. The nested
/// loop and VACUUM need pg_stat_statements created in `cluster`.
pub fn trace_backend(
    cluster: &PgCluster,
    workload: BackendWorkload,
    probe_args: impl FnOnce(Trace) -> Trace,
) -> Result<TracedBackend> {
    if workload.nested_loops > 0 || workload.vacuums > 0 {
        create_small(cluster)?;
    }
    let mut connection = cluster.connect()?;
    // Warm this backend's catalog caches outside the trace.
    connection.query("SELECT 1")?;
    let library = mapped_library(connection.pid(), LIBRARY).ok();
    if workload.nested_loops > 0 {
        for setting in NESTED_LOOP_SETTINGS {
            connection.query(setting)?;
        }
        // Planning it here also fills this backend's caches, so that the traced runs do not
        // descend catalog indexes under the same queryid.
        check_nested_loop(&connection.query(&format!("EXPLAIN (COSTS OFF) {NESTED_LOOP}"))?)?;
    }
    let scans_before = small_pkey_scans(cluster)?;

    let trace = probe_args(Trace::pid(connection.pid()))
        .probe_budget("none")
        .spawn_summarized()?;
    run_workload(&mut connection, &workload)?;
    let (output, summary) = trace.finish()?;
    // The backend goes on serving its client, then flushes its statistics when it exits. Not
    // a sum: that would be one more call of the selects' pg_stat_statements entry.
    ensure!(
        connection.query("SELECT 6 * 7")? == "42",
        "the backend misbehaved after the traced workload"
    );
    connection.close()?;
    check_consistent(&summary)?;

    // Up to Postgres 14 a backend's statistics reach the collector over UDP as it exits, and a
    // reader sees them once the collector has taken them in, which may be after this reads:
    // wait (bounded) for the scans the workload made, and leave a shortfall to the checks.
    let expected_scans = workload.nested_loops * OUTER_ROWS;
    let scans = || Ok(small_pkey_scans(cluster)?.saturating_sub(scans_before));
    let index_scans = match wait_for(
        "idx_scan of small_pkey to count the workload's scans",
        STATS_TIMEOUT,
        || scans().map(|n| (n >= expected_scans).then_some(n)),
    ) {
        Ok(n) => n,
        Err(_) => scans()?,
    };
    let nested_loop = match workload.nested_loops {
        0 => None,
        _ => Some(pgss_entry(
            cluster,
            "SELECT count(*) FROM generate_series(%JOIN small%",
        )?),
    };
    let selects = match (workload.selects, &library) {
        (0, _) | (_, None) => None,
        _ => Some(pgss_entry(cluster, "SELECT $1 + $2")?),
    };
    Ok(TracedBackend {
        workload,
        summary,
        stderr: output.stderr,
        library,
        index_scans,
        nested_loop,
        selects,
    })
}

fn run_workload(connection: &mut Connection<'_>, workload: &BackendWorkload) -> Result<()> {
    for i in 0..workload.selects {
        let answer = connection.query(&format!("SELECT {i} + 1"))?;
        ensure!(answer == (i + 1).to_string(), "statement {i} answered {answer}");
    }
    for run in 1..=workload.nested_loops {
        let count = connection.query(NESTED_LOOP)?;
        ensure!(
            count == OUTER_ROWS.to_string(),
            "run {run} of the nested loop returned {count}, expected {OUTER_ROWS}"
        );
    }
    for _ in 0..workload.vacuums {
        connection.query("VACUUM small")?;
    }
    if !workload.spin_sites.is_empty() {
        call_s_lock_in(connection.pid(), workload.spin_sites)?;
    }
    Ok(())
}

/// `small(id int PRIMARY KEY)` with ids 0..[`SMALL_ROWS`], analyzed.
fn create_small(cluster: &PgCluster) -> Result<()> {
    cluster.psql("CREATE TABLE small(id int PRIMARY KEY)")?;
    cluster.psql(&format!(
        "INSERT INTO small SELECT generate_series(0, {})",
        SMALL_ROWS - 1
    ))?;
    cluster.psql("ANALYZE small")?;
    Ok(())
}

/// The plan is a nested loop whose inner side is a scan of `small_pkey`, not cached in between.
fn check_nested_loop(plan: &str) -> Result<()> {
    let nodes: Vec<&str> = plan
        .lines()
        .map(|l| l.trim_start().trim_start_matches("->").trim_start())
        .collect();
    let position = |prefix: &str| nodes.iter().position(|n| n.starts_with(prefix));
    let join = position("Nested Loop");
    let outer = position("Function Scan on generate_series");
    let inner = position("Index Scan using small_pkey").or(position("Index Only Scan using small_pkey"));
    ensure!(
        matches!((join, outer, inner), (Some(j), Some(o), Some(i)) if j < o && o < i)
            && !plan.contains("Memoize")
            && !plan.contains("Materialize"),
        "expected a Nested Loop over generate_series with an inner index scan of small_pkey:\n{plan}"
    );
    Ok(())
}

/// `idx_scan` of `small_pkey`; 0 before the table exists.
fn small_pkey_scans(cluster: &PgCluster) -> Result<u64> {
    let n = cluster.psql(
        "SELECT coalesce(sum(idx_scan), 0) FROM pg_stat_user_indexes WHERE indexrelname = 'small_pkey'",
    )?;
    n.parse()
        .with_context(|| format!("idx_scan of small_pkey is `{n}`"))
}

/// The one pg_stat_statements entry whose text is `LIKE pattern`: (queryid, calls).
pub fn pgss_entry(cluster: &PgCluster, pattern: &str) -> Result<(String, u64)> {
    let out = cluster.psql(&format!(
        "SELECT queryid, calls FROM pg_stat_statements WHERE toplevel AND query LIKE '{}'",
        pattern.replace('\'', "''")
    ))?;
    let rows: Vec<&str> = out.lines().collect();
    let [row] = rows[..] else {
        bail!(
            "{} pg_stat_statements entries are LIKE `{pattern}`: {rows:?}",
            rows.len()
        );
    };
    let (queryid, calls) = row
        .split_once('|')
        .with_context(|| format!("unexpected pg_stat_statements row `{row}`"))?;
    Ok((
        queryid.to_owned(),
        calls.parse().with_context(|| format!("bad calls `{calls}`"))?,
    ))
}

/// pgscope's lines about probes it did not attach.
pub fn not_attached(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.contains("not attached")).collect()
}

/// The summary agrees with itself: each histogram counts every call, and the per-query rows of
/// a function add up to its total.
pub fn check_consistent(summary: &TraceSummary) -> Result<()> {
    let by_query = summary.probes_by_query()?;
    for (function, stats) in summary.probes()? {
        check_histogram(&function, &stats)?;
        let per_query: u64 = by_query
            .iter()
            .filter(|(_, f, _)| *f == function)
            .map(|(_, _, s)| s.calls)
            .sum();
        ensure!(
            per_query == stats.calls,
            "{function}: {} calls in probes[], {per_query} summed over probes_by_query[]",
            stats.calls
        );
    }
    for (queryid, function, stats) in &by_query {
        check_histogram(&format!("{function} of queryid {queryid}"), stats)?;
    }
    Ok(())
}

fn check_histogram(what: &str, stats: &CallStats) -> Result<()> {
    let bucketed: u64 = stats.histogram_log2_ns.iter().sum();
    ensure!(
        bucketed == stats.calls,
        "{what}: {} calls but {bucketed} in the histogram {:?}",
        stats.calls,
        stats.histogram_log2_ns
    );
    // The longest call is measured with the traps of the probed calls it made, like the total
    // before they are taken out; the own time is never more than that.
    ensure!(
        stats.calls == 0 || stats.max_ns <= stats.total_ns_with_nested_traps,
        "{what}: max {} ns exceeds the total {} ns",
        stats.max_ns,
        stats.total_ns_with_nested_traps
    );
    ensure!(
        stats.total_ns <= stats.total_ns_with_nested_traps,
        "{what}: own time {} ns exceeds the time from entry to return {} ns",
        stats.total_ns,
        stats.total_ns_with_nested_traps
    );
    Ok(())
}
