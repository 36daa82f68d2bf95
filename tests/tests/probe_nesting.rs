//! Nested probe traps: a probed function's time runs from its entry to its return, so the traps
//! of the probed functions it calls land inside it. `GetCachedPlan` under a generic plan over a
//! partitioned table calls `LockRelationOid` for every partition; with both probed, its raw
//! time is mostly traps. pgscope counts the traps taken inside each call and takes their
//! calibrated cost out. Checked: the traps counted per call, the arithmetic of what was taken
//! out, and the calibrated cost of a trap against what traps cost in the same run by the
//! on-CPU samples taken inside them, an independent measurement.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::cpu_window::stolen_time;
use pgscope_tests::probe_workloads::{GENERIC_PLAN_SETTINGS, PGBENCH_SELECT};
use pgscope_tests::profile::{is_kernel_frame, Profile, Stack};
use pgscope_tests::{
    ensure_samples_cover, expected_samples, require_root_and_bpf, wait_for, CpuWindow, PgCluster, PgInstall,
    SchedTime, Trace, TraceSummary,
};
use serde_json::Value;

/// Partitions of pgbench_accounts. Per execution of the select, GetCachedPlan locks the parent
/// twice (AcquirePlannerLocks, then AcquireExecutorLocks with every partition) and the executor
/// locks one index outside it (see `probe_matrix::expected`): N + 2 of N + 3 LockRelationOid
/// calls are nested in GetCachedPlan.
const PARTITIONS: u32 = 64;
const SAMPLE_HZ: u32 = 499;

/// One `probes[]` row of the JSON summary, with the fields this check reads.
#[derive(Debug)]
struct ProbeFigures {
    calls: u64,
    total_ns: u64,
    raw_ns: u64,
    nested_traps: u64,
    nested_trap_ns: u64,
}

fn number(row: &Value, key: &str) -> Result<u64> {
    row.get(key)
        .and_then(Value::as_u64)
        .with_context(|| format!("no number `{key}` in {row}"))
}

fn probe_figures(summary: &Value, function: &str) -> Result<ProbeFigures> {
    let row = summary
        .get("probes")
        .and_then(Value::as_array)
        .and_then(|rows| {
            rows.iter()
                .find(|r| r.get("function").and_then(Value::as_str) == Some(function))
        })
        .with_context(|| format!("no probes[] row of {function}"))?;
    Ok(ProbeFigures {
        calls: number(row, "calls")?,
        total_ns: number(row, "total_ns")?,
        raw_ns: number(row, "total_ns_with_nested_traps")?,
        nested_traps: number(row, "nested_traps")?,
        nested_trap_ns: number(row, "nested_trap_ns")?,
    })
}

/// Whether a sample was taken while the CPU handled a probe: in the breakpoint's exception,
/// the uprobe's return trampoline, or the BPF program.
fn in_probe_trap(stack: &Stack) -> bool {
    stack.frames.iter().any(|frame| {
        let name = frame.as_str();
        (is_kernel_frame(name)
            && ["uprobe", "uretprobe", "int3", "swbp", "bpf_prog"]
                .iter()
                .any(|part| name.contains(part)))
            || name == "[uprobes]"
    })
}

fn under_get_cached_plan(stack: &Stack) -> bool {
    stack.user_frames().iter().any(|f| f == "GetCachedPlan")
}

/// CPU time the traced backend gets under the trace: ~1500 samples at [`SAMPLE_HZ`], of which
/// the ~10% with GetCachedPlan on the stack outside probe traps are ~150, three times the
/// [`MIN_OWN_SAMPLES`] the share comparison needs (the shortest trace that gives it).
const NESTING_CPU: Duration = Duration::from_secs(3);
/// Executions of pgbench's select pg_stat_statements must count during the trace: the
/// per-call ratios below rest on at least this many GetCachedPlan calls. The backend makes them
/// within the first second of [`NESTING_CPU`]; awaited all the same.
const MIN_EXECUTIONS: u64 = 500;
/// Bounds the wait for both: the backend got [`NESTING_CPU`] in 4–5 s, quiet or beside two CPU
/// hogs (as a real-time task, see below).
const NESTING_TIMEOUT: Duration = Duration::from_secs(90);
/// The backend's samples per CPU-second × [`SAMPLE_HZ`], at least. The CPU window lies inside
/// the sampling window (opened once pgscope says it profiles, closed before SIGINT), so a
/// sampler that loses nothing gives 1.0 or a little more: 0.97 to 1.12 in this test's runs,
/// quiet or beside two CPU hogs, with the backend a real-time task (see below). 0.7 fails a
/// sampler that drops a third of them.
const MIN_SAMPLES_PER_CPU_PERIOD: f64 = 0.7;
/// Samples with GetCachedPlan on the stack outside probe traps: enough to show that the own
/// time was sampled at all. The trace lasts until the backend had [`NESTING_CPU`], so the count
/// does not depend on the machine's speed.
const MIN_OWN_SAMPLES: u64 = 50;
/// Samples in probe traps the cost comparison rests on (~800 in a run): a sampling error of
/// ~7% at most (1/√200).
const MIN_TRAP_SAMPLES: u64 = 200;
/// How far pgscope's calibrated trap cost may be from the one sampled in the run. On this VM a
/// trap costs one of two levels ~40% apart (1.1 and 1.6 µs per probed call), switching every
/// 10 ms to a second; the calibration averages pairs spread over half a second, the run
/// averages its own seconds, and the samples count a trap's time in the kernel but not the
/// cache misses it leaves the user code. Measured: 0.8–1.2 in this test's runs. The old
/// uncorrected time would fail the arithmetic checks, not this one.
const MIN_CALIBRATION_RATIO: f64 = 0.67;
const MAX_CALIBRATION_RATIO: f64 = 1.5;

/// pg_stat_statements' executions of pgbench's select so far (0 before its first).
fn select_executions(cluster: &PgCluster) -> Result<u64> {
    let calls = cluster.psql(&format!(
        "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements \
         WHERE toplevel AND query LIKE '{PGBENCH_SELECT}%'"
    ))?;
    calls
        .parse()
        .with_context(|| format!("pg_stat_statements counts `{calls}` calls"))
}

#[test]
fn nested_probe_traps_are_taken_out_of_the_enclosing_function() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, GENERIC_PLAN_SETTINGS)?;
    cluster.pgbench(&["-i", "-q", "-s", "1", &format!("--partitions={PARTITIONS}")])?;
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let folded = dir.path().join("stacks.folded");
    // One client: the backend has a core to itself, so that the time between a call's entry and
    // return (what the probe measures) is time on CPU (what the samples measure).
    let mut pgbench = cluster.spawn_pgbench(&["-n", "-S", "-M", "prepared", "-c", "1", "-T", "600"], 1)?;
    let backends = pgbench.backend_pids()?;
    let [backend] = backends[..] else {
        anyhow::bail!("pgbench's one client has backends {backends:?}");
    };
    // On a busy machine the backend would also wait for a CPU in the middle of calls, time the
    // probe counts and the samples do not: the probe's share came out 3 times the samples' with
    // the backend runnable 0.7 s per CPU-second. Renicing it does not help (the cluster is an
    // autogroup of its own, which competes with every other session as one task). As a
    // real-time task the scheduler runs it whenever it is runnable, ahead of every other
    // session; it sleeps at each transaction waiting for pgbench, so it leaves the rest of the
    // machine its CPUs. Its run-queue time is measured and reported below.
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: sched_setscheduler(2) on a pid with a valid sched_param.
    if unsafe { libc::sched_setscheduler(backend as libc::pid_t, libc::SCHED_FIFO, &param) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("cannot make backend {backend} a real-time task"));
    }
    // Executions counted before the probes are attached, once they are, before they are
    // detached, and after: GetCachedPlan calls counted by the probe lie between the inner and
    // the outer difference (one call per execution of a prepared statement).
    let before_trace = select_executions(&cluster)?;
    let running = Trace::instance(cluster.data_dir())
        .probes("GetCachedPlan,LockRelationOid")
        .probe_budget("none")
        .frequency(SAMPLE_HZ)
        .duration_secs(600)
        .json(&json)
        .folded(&folded)
        .spawn()?;
    let window = CpuWindow::start(&[backend])?;
    let stolen = stolen_time()?;
    let at_start = select_executions(&cluster)?;
    let mut reached = (SchedTime::default(), 0);
    wait_for(
        &format!(
            "backend {backend} to use {NESTING_CPU:?} of CPU and run pgbench's select \
             {MIN_EXECUTIONS} times"
        ),
        NESTING_TIMEOUT,
        || {
            reached = (
                window.used()?,
                select_executions(&cluster)?.saturating_sub(at_start),
            );
            Ok((reached.0.on_cpu >= NESTING_CPU && reached.1 >= MIN_EXECUTIONS).then_some(()))
        },
    )
    .with_context(|| {
        format!(
            "it used {:?} on CPU, waited {:?} for one, and ran it {} times",
            reached.0.on_cpu, reached.0.runnable, reached.1
        )
    })?;
    let (used, executions) = reached;
    let stolen = stolen_time()?.saturating_sub(stolen);
    let output = running.interrupt()?;
    let after_trace = select_executions(&cluster)?;
    ensure!(pgbench.is_running()?, "pgbench ended during the trace");
    let queryid = cluster.pgbench_select_queryid()?;
    pgbench.stop()?;

    let summary: Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
    let ns_per_hit = summary
        .get("probe_ns_per_hit")
        .and_then(Value::as_f64)
        .context("no number `probe_ns_per_hit` in the summary")?;
    let plan = probe_figures(&summary, "GetCachedPlan")?;
    let locks = probe_figures(&summary, "LockRelationOid")?;
    eprintln!("GetCachedPlan {plan:?}\nLockRelationOid {locks:?}\n{ns_per_hit:.0} ns per probed call");
    // Every execution pg_stat_statements counted while the probes were surely attached called
    // GetCachedPlan once, and none counted outside the trace's reach did.
    let of_select = TraceSummary::read(&json)?
        .probe_of_query(&queryid, "GetCachedPlan")?
        .map_or(0, |s| s.calls);
    let most = after_trace.saturating_sub(before_trace);
    eprintln!(
        "pgbench's select (queryid {queryid}): {of_select} GetCachedPlan calls; \
         pg_stat_statements counted {executions} executions while the probes were attached, \
         {most} from before they were to after they were detached"
    );
    ensure!(
        (executions..=most).contains(&of_select),
        "{of_select} GetCachedPlan calls of pgbench's select (queryid {queryid}), but \
         pg_stat_statements counted {executions} executions of it while the probes were \
         attached and {most} from before they were to after"
    );
    ensure!(
        locks.nested_traps == 0,
        "LockRelationOid calls no probed function, yet {} nested traps were counted",
        locks.nested_traps
    );

    // Every LockRelationOid call nested in GetCachedPlan is two traps (entry and return).
    let per_call = plan.nested_traps as f64 / plan.calls as f64;
    let expected_per_call = 2.0 * f64::from(PARTITIONS + 2);
    ensure!(
        (per_call - expected_per_call).abs() <= 0.05 * expected_per_call,
        "{per_call:.1} nested traps per GetCachedPlan call, expected {expected_per_call} (two per \
         LockRelationOid call it makes)"
    );
    let nested_locks = locks.calls as f64 * f64::from(PARTITIONS + 2) / f64::from(PARTITIONS + 3);
    let ratio = plan.nested_traps as f64 / (2.0 * nested_locks);
    ensure!(
        (0.95..=1.05).contains(&ratio),
        "{} nested traps against {} LockRelationOid calls, {:.0} of them in GetCachedPlan: {ratio:.3} of two per call",
        plan.nested_traps,
        locks.calls,
        nested_locks
    );

    // The correction is the traps at the calibrated cost, and nothing else.
    let expected_trap_ns = plan.nested_traps as f64 * ns_per_hit / 2.0;
    ensure!(
        plan.total_ns < plan.raw_ns && plan.raw_ns - plan.total_ns == plan.nested_trap_ns,
        "own time {} ns, raw {} ns, {} ns of traps taken out",
        plan.total_ns,
        plan.raw_ns,
        plan.nested_trap_ns
    );
    ensure!(
        (plan.nested_trap_ns as f64 - expected_trap_ns.min(plan.raw_ns as f64)).abs()
            <= 0.01 * expected_trap_ns + 1000.0,
        "{} ns taken out for {} traps at {ns_per_hit:.0} ns per probed call (expected {expected_trap_ns:.0})",
        plan.nested_trap_ns,
        plan.nested_traps
    );

    // Independent: the samples with GetCachedPlan on the stack outside any probe trap, as a
    // share of all samples, against the probe's own time as a share of the same samples' time.
    let profile = Profile::read_folded(&folded)?;
    let total = profile.total();
    let of_backend = profile.samples_by_pid().get(&backend).copied().unwrap_or(0);
    eprintln!(
        "backend {backend}: {:?} on CPU, {:?} waiting for one, {stolen:?} stolen from the VM; \
         {of_backend} of its samples ({:.0} expected), {total} in all",
        used.on_cpu,
        used.runnable,
        expected_samples(used.on_cpu, SAMPLE_HZ)
    );
    ensure_samples_cover(
        &format!("backend {backend} ({stolen:?} stolen from the VM meanwhile)"),
        of_backend,
        used.on_cpu,
        SAMPLE_HZ,
        MIN_SAMPLES_PER_CPU_PERIOD,
    )?;
    let own_samples = profile.count_where(|s| under_get_cached_plan(s) && !in_probe_trap(s));
    let trap_samples = profile.count_where(|s| under_get_cached_plan(s) && in_probe_trap(s));
    eprintln!(
        "samples with GetCachedPlan on the stack: {own_samples} outside probe traps, {trap_samples} \
         in them, of {total}; examples in traps:\n{}",
        profile.examples_where(|s| under_get_cached_plan(s) && in_probe_trap(s), 3)
    );
    let period_ns = 1e9 / f64::from(SAMPLE_HZ);
    let sampled_ns = total as f64 * period_ns;
    eprintln!(
        "GetCachedPlan's share of the sampled time: {:.1}% by samples outside probe traps, {:.1}% \
         by the probe with nested traps taken out, {:.1}% raw",
        100.0 * own_samples as f64 / total as f64,
        100.0 * plan.total_ns as f64 / sampled_ns,
        100.0 * plan.raw_ns as f64 / sampled_ns
    );
    ensure!(
        own_samples >= MIN_OWN_SAMPLES,
        "only {own_samples} of {total} samples in GetCachedPlan outside probe traps"
    );
    // Independent: what a trap cost in this run, from the samples taken inside traps (any
    // process, any probe) against the traps every probe took, beside the calibrated cost that
    // was taken out. The own times above are the difference of two large figures (the traps are
    // 3 times GetCachedPlan's own work), so they would amplify a calibration error threefold;
    // this compares the calibration itself. The arithmetic (own = raw - traps x cost) is checked
    // exactly above, so an uncorrected or miscounted time fails there.
    let traps = 2 * (plan.calls + locks.calls);
    let all_trap_samples = profile.count_where(in_probe_trap);
    let sampled_per_trap = all_trap_samples as f64 * period_ns / traps as f64;
    let calibrated_per_trap = ns_per_hit / 2.0;
    eprintln!(
        "a trap cost {sampled_per_trap:.0} ns by the samples ({all_trap_samples} in traps, {traps} \
         traps), {calibrated_per_trap:.0} ns by pgscope's calibration"
    );
    ensure!(
        all_trap_samples >= MIN_TRAP_SAMPLES,
        "only {all_trap_samples} of {total} samples in probe traps"
    );
    let ratio = calibrated_per_trap / sampled_per_trap;
    ensure!(
        (MIN_CALIBRATION_RATIO..=MAX_CALIBRATION_RATIO).contains(&ratio),
        "pgscope took a trap to cost {calibrated_per_trap:.0} ns, but in this run a trap cost \
         {sampled_per_trap:.0} ns by the samples ({all_trap_samples} taken in traps, {traps} traps): \
         {ratio:.2} times; the backend waited {:?} for a CPU against {:?} on it",
        used.runnable,
        used.on_cpu
    );
    // The console says which time it shows and what the counts rest on.
    ensure!(
        output.stdout.contains("nested ms") && output.stdout.contains("measured"),
        "the probe table shows neither the nested traps taken out nor the measured calls:\n{}",
        output.stdout
    );
    Ok(())
}
