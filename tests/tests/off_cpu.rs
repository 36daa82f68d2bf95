//! Off-CPU time (`pgscope trace`, sampled by default, and `--off-cpu=exact`): where backends
//! wait, weighted by blocked time, labelled with the wait event in force, checked against waits
//! the tests cause and time themselves.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use pgscope_tests::summary::{OffCpuQueryWait, OffCpuWait};
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace};

/// How long session A holds the row lock once B waits for it.
const HOLD: Duration = Duration::from_secs(3);

fn waits_named<'a>(waits: &'a [OffCpuWait], wait_event: &str) -> impl Iterator<Item = &'a OffCpuWait> + 'a {
    let wait_event = wait_event.to_owned();
    waits.iter().filter(move |w| w.wait_event == wait_event)
}

/// Session A updates a row and holds the lock; session B updates the same row and waits for A's
/// transaction (`Lock:transactionid`, heavyweight lock: XactLockTableWait → ProcSleep → WaitLatch) until
/// A commits, `HOLD` later: sampled (the default), 3 s measured as 3 s ± 10%.
/// On this kernel (kfuncs: Linux 6.7 or newer) the sampler's passes visit the profiled
/// processes' threads alone.
#[test]
fn a_row_lock_wait_is_measured_with_its_wait_event_and_stack() -> Result<()> {
    row_lock_wait("sampled", Passes::Targets)
}

/// The same with the task iterators that visit every thread of the host, as kernels without
/// those kfuncs sample.
#[test]
fn a_row_lock_wait_is_measured_by_the_task_iterators_too() -> Result<()> {
    row_lock_wait("sampled", Passes::Iterators)
}

/// The same with the exact context-switch tracer.
#[test]
fn a_row_lock_wait_is_timed_exactly_with_its_wait_event_and_stack() -> Result<()> {
    row_lock_wait("exact", Passes::Targets)
}

/// How the sampler's passes reach the threads, and what pgscope logs at info level when it
/// starts them that way.
#[derive(Clone, Copy)]
enum Passes {
    Targets,
    Iterators,
}

impl Passes {
    fn logged(self) -> &'static str {
        match self {
            Passes::Targets => "the off-CPU sampler visits the profiled processes' threads at each tick",
            Passes::Iterators => "the off-CPU sampler visits every thread of the host at each tick",
        }
    }
}

fn row_lock_wait(mode: &str, passes: Passes) -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.psql("CREATE TABLE held (id int PRIMARY KEY, v int); INSERT INTO held VALUES (1, 0)")?;
    let mut holder = cluster.connect()?;
    let mut trace = Trace::instance(cluster.data_dir())
        .off_cpu_mode(mode)
        .env("RUST_LOG", "pgscope::bpf=info");
    if let Passes::Iterators = passes {
        trace = trace.env("PGSCOPE_WAIT_PASSES", "iterators");
    }
    let trace = trace.spawn_summarized()?;

    holder.query("BEGIN")?;
    holder.query("UPDATE held SET v = v + 1 WHERE id = 1")?;
    let waiter = cluster.spawn_session("UPDATE held SET v = v + 10 WHERE id = 1")?;
    waiter.wait_until_waiting_on("Lock:transactionid")?;
    let blocked = Instant::now();
    std::thread::sleep(HOLD);
    holder.query("COMMIT")?;
    let held = blocked.elapsed();
    waiter.wait_until_finished()?;
    drop(waiter);
    holder.close()?;
    let (output, summary) = trace.finish()?;
    if mode == "sampled" {
        ensure!(
            output.stderr.contains(passes.logged()),
            "pgscope did not say \"{}\": {}",
            passes.logged(),
            output.stderr
        );
    }

    let waits = summary.off_cpu_by_wait()?;
    let lock_ns: u64 = waits_named(&waits, "Lock:transactionid")
        .filter(|w| w.off_cpu == "latch")
        .map(|w| w.ns)
        .sum();
    let measured = Duration::from_nanos(lock_ns);
    eprintln!(
        "{mode}: Lock:transactionid: {measured:?} off CPU in latch waits, {held:?} between the wait \
         being seen and the holder's commit"
    );
    // B blocked a little before the test saw it wait (psql polls), and wakes a little after the
    // commit: both are milliseconds against seconds.
    let ratio = measured.as_secs_f64() / held.as_secs_f64();
    ensure!(
        (0.9..=1.1).contains(&ratio),
        "Lock:transactionid off-CPU time {measured:?} is not within 10% of the {held:?} the lock was \
         held: {waits:?}"
    );
    let stacks: Vec<OffCpuQueryWait> = summary
        .off_cpu_by_query()?
        .into_iter()
        .filter(|w| w.wait_event == "Lock:transactionid" && w.off_cpu == "latch")
        .collect();
    // The summary names the waiter, not the latch wait every lock wait goes through.
    ensure!(
        stacks
            .iter()
            .any(|w| w.stack.starts_with("XactLockTableWait") && w.stack.contains("heap_update")),
        "no Lock:transactionid wait summarized by its waiter XactLockTableWait ← … heap_update: \
         {stacks:?}"
    );
    Ok(())
}

/// Small transactions with synchronous_commit = on wait for their WAL flush: the commit's
/// fdatasync shows as an I/O wait with the wait event `IO:WALSync`.
#[test]
fn wal_flushes_show_as_io_waits() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with(
        &PgInstall::distro()?,
        &[
            // The test clusters run with fsync off, for speed.
            ("fsync", "on"),
            ("synchronous_commit", "on"),
            ("wal_sync_method", "fdatasync"),
        ],
    )?;
    cluster.pgbench(&["-i", "-q", "-s", "1"])?;
    let trace = Trace::instance(cluster.data_dir()).off_cpu().spawn_summarized()?;
    cluster.pgbench(&["-n", "-N", "-c", "4", "-j", "2", "-T", "4"])?;
    let waits = trace.finish()?.1.off_cpu_by_wait()?;
    let wal_io: u64 = waits
        .iter()
        .filter(|w| w.wait_event.starts_with("IO:WAL") && w.off_cpu == "io")
        .map(|w| w.ns)
        .sum();
    eprintln!("IO:WAL* waits in I/O: {:.1} ms", wal_io as f64 / 1e6);
    ensure!(
        wal_io > 0,
        "no off-CPU time in IO:WAL* wait events under synchronous commits: {waits:?}"
    );
    Ok(())
}
