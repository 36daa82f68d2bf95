//! `--probes`: uprobe + uretprobe pairs on Postgres functions count every call, per function and
//! per query, and the counts agree with what Postgres itself does and reports.

use anyhow::{ensure, Result};
use pgscope_tests::probe_matrix::expected;
use pgscope_tests::probe_workloads::{
    check_consistent, trace_backend, BackendWorkload, GenericPlan, GENERIC_PLAN_SETTINGS,
};
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace, TraceSummary};

/// With a generic plan nothing is pruned at plan time, so every execution locks every partition
/// of `pgbench_accounts` before run-time pruning picks the one partition that holds `aid`: N + 3
/// LockRelationOid calls per execution (see `probe_matrix::expected` for why), at two partition
/// counts.
#[test]
fn generic_plan_locks_every_partition() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::distro()?;
    let expected = expected(install.major)?;
    let mut wrong = Vec::new();
    for partitions in [8, 32] {
        let cluster = PgCluster::start_with_pg_stat_statements(&install, GENERIC_PLAN_SETTINGS)?;
        let plan = GenericPlan::measure(&cluster, partitions)?;
        wrong.extend(plan.disagreements((expected.locks_per_execution)(partitions)));
    }
    ensure!(wrong.is_empty(), "{}", wrong.join("\n"));
    Ok(())
}

/// A nested loop rescans the inner index once per outer row; each rescan descends the btree from
/// its root. `_bt_getroot` calls of the query must equal the index scans Postgres counted.
#[test]
fn btree_root_descents_in_a_nested_loop() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let workload = BackendWorkload {
        nested_loops: 4,
        ..BackendWorkload::default()
    };
    let traced = trace_backend(&cluster, workload, |trace| trace.probes("_bt_getroot"))?;
    eprintln!(
        "{} _bt_getroot calls of the nested loop, {} index scans of small_pkey",
        traced.nested_loop_calls("_bt_getroot")?,
        traced.index_scans
    );
    let wrong = traced.btree_disagreements()?;
    ensure!(wrong.is_empty(), "{}", wrong.join("\n"));
    Ok(())
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
