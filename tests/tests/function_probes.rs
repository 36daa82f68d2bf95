//! `--probes`: uprobe + uretprobe pairs on Postgres functions count every call, per function and
//! per query, and the counts agree with what Postgres itself does and reports.

use std::collections::BTreeSet;

use anyhow::{ensure, Context, Result};
use pgscope_tests::summary::CallStats;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace, TraceSummary};

/// pgbench's `-S` statement as pg_stat_statements shows it under `-M prepared`.
const PGBENCH_SELECT: &str = "SELECT abalance FROM pgbench_accounts WHERE aid = $1";

/// With a generic plan nothing is pruned at plan time, so every execution locks every partition
/// of `pgbench_accounts` before run-time pruning picks the one partition that holds `aid`.
#[test]
fn generic_plan_locks_every_partition() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::distro()?;
    let mut per_execution = Vec::new();
    for partitions in [8, 32] {
        per_execution.push((partitions, locks_per_execution(&install, partitions)?));
    }
    let [(few, at_few), (many, at_many)] = per_execution[..] else {
        unreachable!("two partition counts")
    };
    // Everything but the partitions is locked the same number of times whatever their count, so
    // each extra partition adds exactly one lock per execution.
    let growth = at_many - at_few;
    let expected = f64::from(many - few);
    eprintln!(
        "LockRelationOid calls per execution: {at_few:.2} with {few} partitions, {at_many:.2} with {many}"
    );
    ensure!(
        (growth - expected).abs() <= 3.0,
        "LockRelationOid calls per execution grew by {growth:.2} from {few} to {many} partitions \
         ({at_few:.2} → {at_many:.2}), expected {expected} ± 3"
    );
    Ok(())
}

/// One cluster with `pgbench_accounts` split into `partitions`, traced while `pgbench -S -M
/// prepared` runs; returns LockRelationOid calls per execution of the select.
fn locks_per_execution(install: &PgInstall, partitions: u32) -> Result<f64> {
    let cluster =
        PgCluster::start_with_pg_stat_statements(install, &[("plan_cache_mode", "force_generic_plan")])?;
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

    // -n: `pgbench -i` vacuumed already; pgbench's vacuum connection would otherwise count as
    // one of the clients spawn_pgbench waits for.
    let mut pgbench = cluster.spawn_pgbench(&["-n", "-S", "-M", "prepared", "-c", "1", "-T", "600"], 1)?;
    Trace::instance(cluster.data_dir())
        .probes("LockRelationOid,GetCachedPlan,PortalStart")
        .probe_budget("none")
        .duration_secs(4)
        .json(&json)
        .output()?;
    ensure!(pgbench.is_running()?, "pgbench ended during the trace");
    pgbench.stop()?;

    let (queryid, _) = pgss_entry(&cluster, &format!("{PGBENCH_SELECT}%"))?;
    let summary = TraceSummary::read(&json)?;
    check_consistent(&summary)?;
    let calls =
        |function| -> Result<u64> { Ok(summary.probe_of_query(&queryid, function)?.map_or(0, |s| s.calls)) };
    let executions = calls("PortalStart")?;
    let plans = calls("GetCachedPlan")?;
    let lock_calls = calls("LockRelationOid")?;
    let per_execution = lock_calls as f64 / executions.max(1) as f64;
    eprintln!(
        "{partitions} partitions: queryid {queryid}: {executions} executions (PortalStart), \
         {plans} GetCachedPlan, {lock_calls} LockRelationOid = {per_execution:.2} per execution"
    );
    // pgbench -S runs thousands of selects per second even with every lock trapped.
    ensure!(
        executions >= 1000,
        "{partitions} partitions: only {executions} PortalStart calls of queryid {queryid} in 4 s"
    );
    // Each Bind of the prepared statement fetches its plan once, then starts one portal.
    ensure!(
        plans.abs_diff(executions) * 100 <= executions,
        "{partitions} partitions: {plans} GetCachedPlan calls for {executions} PortalStart calls \
         of queryid {queryid}, expected equal within 1%"
    );
    // Per execution of the generic plan (PG 15): RevalidateCachedQuery locks the query's one
    // relation (`pgbench_accounts`), AcquireExecutorLocks every relation of the plan's range
    // table (`pgbench_accounts` and its N partitions), and ExecInitIndexScan the index of the
    // one partition left after run-time pruning: N + 3. Measured on 15.20: 11.00 for 8 and
    // 35.01 for 32 partitions, relation_locks[] showing the parent twice, each partition once
    // and their indexes once in all. The bound leaves room for a few more locks per execution
    // in another minor, never for one fewer than a lock per partition.
    let (low, high) = (f64::from(partitions), f64::from(partitions) + 6.0);
    ensure!(
        (low..=high).contains(&per_execution),
        "{partitions} partitions: {per_execution:.2} LockRelationOid calls per execution of \
         queryid {queryid} ({lock_calls} / {executions}), expected between {low} and {high}"
    );

    let locks = summary.relation_locks(&queryid)?;
    let shared: BTreeSet<u32> = locks
        .iter()
        .filter(|l| l.lockmode == "AccessShareLock")
        .map(|l| l.relid)
        .collect();
    ensure!(
        shared.len() >= partitions as usize,
        "{partitions} partitions: queryid {queryid} took AccessShareLock on only {} relations: {locks:?}",
        shared.len()
    );
    // relation_locks[] is counted on entry, probes_by_query[] on return, and the two are read one
    // after the other while the probes still fire: equal within 1%, not exactly.
    let by_relation: u64 = locks.iter().map(|l| l.calls).sum();
    eprintln!("{partitions} partitions: relation_locks[] of queryid {queryid} add up to {by_relation}");
    ensure!(
        by_relation.abs_diff(lock_calls) * 100 <= lock_calls,
        "{partitions} partitions: relation_locks[] of queryid {queryid} add up to {by_relation} \
         LockRelationOid calls, probes_by_query[] says {lock_calls}"
    );
    let unlocked: Vec<u32> = partition_oids.difference(&shared).copied().collect();
    ensure!(
        unlocked.is_empty(),
        "{partitions} partitions: queryid {queryid} never locked partitions {unlocked:?}; locks: {locks:?}"
    );
    Ok(per_execution)
}

const SMALL_ROWS: u64 = 20;
const OUTER_ROWS: u64 = 100_000;
/// Every outer row matches one row of `small` (ids 0..19), found by its own index descent.
const NESTED_LOOP: &str = "SELECT count(*) FROM generate_series(1, 100000) g JOIN small s ON s.id = g % 20";
const RUNS: u64 = 4;

/// A nested loop rescans the inner index once per outer row; each rescan descends the btree from
/// its root. `_bt_getroot` calls of the query must equal the index scans Postgres counted.
#[test]
fn btree_root_descents_in_a_nested_loop() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(
        &PgInstall::distro()?,
        &[
            ("enable_hashjoin", "off"),
            ("enable_mergejoin", "off"),
            ("enable_material", "off"),
            // Otherwise a Memoize node caches the 20 distinct inner results: 20 descents, not
            // one per outer row.
            ("enable_memoize", "off"),
        ],
    )?;
    cluster.psql("CREATE TABLE small(id int PRIMARY KEY)")?;
    cluster.psql(&format!(
        "INSERT INTO small SELECT generate_series(0, {})",
        SMALL_ROWS - 1
    ))?;
    cluster.psql("ANALYZE small")?;

    let mut connection = cluster.connect()?;
    // Planning it here also fills this backend's caches, so that the traced runs do not descend
    // catalog indexes under the same queryid.
    let plan = connection.query(&format!("EXPLAIN (COSTS OFF) {NESTED_LOOP}"))?;
    check_nested_loop(&plan)?;
    let before = small_pkey_scans(&cluster)?;

    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    // Ended by SIGINT once the runs are done; the duration is only an upper bound.
    let trace = Trace::pid(connection.pid())
        .probes("_bt_getroot")
        .probe_budget("none")
        .duration_secs(600)
        .json(&json)
        .spawn()?;
    for run in 1..=RUNS {
        let count = connection.query(NESTED_LOOP)?;
        ensure!(
            count == OUTER_ROWS.to_string(),
            "run {run} of the nested loop returned {count}, expected {OUTER_ROWS}"
        );
    }
    let output = trace.interrupt()?;
    ensure!(
        output.stderr.contains("pgscope: stopped early"),
        "pgscope did not say it stopped early on SIGINT:\n{}",
        output.stderr
    );
    // The backend flushes its statistics when it exits.
    connection.close()?;
    let descents = small_pkey_scans(&cluster)? - before;
    ensure!(
        descents == RUNS * OUTER_ROWS,
        "pg_stat_user_indexes counts {descents} scans of small_pkey over {RUNS} runs, expected one \
         per outer row ({}): the plan is not the nested loop checked above",
        RUNS * OUTER_ROWS
    );

    let (queryid, runs) = pgss_entry(&cluster, "SELECT count(*) FROM generate_series(%JOIN small%")?;
    ensure!(
        runs == RUNS,
        "pg_stat_statements counts {runs} runs of queryid {queryid}, expected {RUNS}"
    );
    let summary = TraceSummary::read(&json)?;
    check_consistent(&summary)?;
    let roots = summary
        .probe_of_query(&queryid, "_bt_getroot")?
        .map_or(0, |s| s.calls);
    eprintln!("queryid {queryid}: {roots} _bt_getroot calls, {descents} index scans of small_pkey");
    ensure!(
        roots.abs_diff(descents) * 100 <= descents,
        "{roots} _bt_getroot calls for queryid {queryid}, but Postgres counted {descents} index \
         descents of small_pkey (expected equal within 1%); per query: {:?}",
        summary.probes_by_query()?
    );
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

fn small_pkey_scans(cluster: &PgCluster) -> Result<u64> {
    let n = cluster.psql("SELECT idx_scan FROM pg_stat_user_indexes WHERE indexrelname = 'small_pkey'")?;
    n.parse()
        .with_context(|| format!("idx_scan of small_pkey is `{n}`"))
}

/// Probed functions every `pgbench -S -M prepared` transaction calls.
const PROBES_PGBENCH_CALLS: [&str; 4] = ["LockRelationOid", "PortalStart", "GetCachedPlan", "_bt_getroot"];

/// A uretprobe replaces the return address of each probed call with the `[uprobes]` trampoline;
/// stacks sampled inside a probed call unwind only if pgscope puts the real address back. A probe
/// that cannot be attached is reported and the others go on.
#[test]
fn stacks_stay_complete_while_probes_fire() -> Result<()> {
    require_root_and_bpf();
    // No pg_stat_statements: pgss_store cannot be attached whatever pgscope can resolve, so
    // `all` always includes one probe that fails.
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    cluster.pgbench(&["-i", "-q", "-s", "1"])?;
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");

    // -M prepared: the simple protocol plans every statement afresh and never calls GetCachedPlan.
    let mut pgbench = cluster.spawn_pgbench(&["-n", "-S", "-M", "prepared", "-c", "2", "-T", "600"], 2)?;
    let output = Trace::instance(cluster.data_dir())
        .probes("all")
        .probe_budget("none")
        .duration_secs(5)
        .json(&json)
        .output()?;
    ensure!(pgbench.is_running()?, "pgbench ended during the trace");
    pgbench.stop()?;

    ensure!(
        output.stderr.contains("pgscope: probe pgss_store not attached"),
        "pgscope did not say that pgss_store is not attached:\n{}",
        output.stderr
    );
    let summary = TraceSummary::read(&json)?;
    check_consistent(&summary)?;
    let probes = summary.probes()?;
    ensure!(
        !probes
            .iter()
            .any(|(function, _)| function.starts_with("pgss_store")),
        "probes[] has a pgss_store row although it was not attached: {probes:?}"
    );
    for function in PROBES_PGBENCH_CALLS {
        let calls = summary.probe(function)?.map_or(0, |s| s.calls);
        ensure!(calls > 0, "{function} has no calls under pgbench -S: {probes:?}");
    }
    let profiled = summary.samples_profiled()?;
    let complete = summary.user_stacks_complete_pct()?;
    eprintln!("{profiled} samples, {complete:.1}% of user stacks complete");
    // Two busy backends on two cores for 5 s at 99 Hz: up to ~990 samples, shared with pgbench.
    ensure!(
        profiled >= 200,
        "only {profiled} samples in 5 s of pgbench -S -c 2"
    );
    ensure!(
        complete >= 95.0,
        "only {complete:.1}% of user stacks are complete with uretprobes in place"
    );
    Ok(())
}

/// The one pg_stat_statements entry whose text is `LIKE pattern`: (queryid, calls).
fn pgss_entry(cluster: &PgCluster, pattern: &str) -> Result<(String, u64)> {
    let out = cluster.psql(&format!(
        "SELECT queryid, calls FROM pg_stat_statements WHERE toplevel AND query LIKE '{}'",
        pattern.replace('\'', "''")
    ))?;
    let rows: Vec<&str> = out.lines().collect();
    let [row] = rows[..] else {
        anyhow::bail!(
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

/// The summary agrees with itself: each histogram counts every call, and the per-query rows of a
/// function add up to its total.
fn check_consistent(summary: &TraceSummary) -> Result<()> {
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
    ensure!(
        stats.calls == 0 || stats.max_ns <= stats.total_ns,
        "{what}: max {} ns exceeds the total {} ns",
        stats.max_ns,
        stats.total_ns
    );
    Ok(())
}
