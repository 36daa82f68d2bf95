//! Where a wait's stack says what was being done. Eight clients update three rows, each
//! holding its row lock for a moment: the others queue on `Lock:transactionid`, and the
//! per-statement off-CPU summary must name the waiter (`XactLockTableWait`, under the update)
//! rather than the wait machinery every lock wait goes through (`epoll_wait ← WaitEventSetWait
//! ← WaitLatch ← ProcSleep`). A `Lock:*` wait is classed as a latch wait, never as I/O. And the
//! stacks stay whole: the waiters come and go every few hundred microseconds, and a stack the
//! sampler copies after the thread left its wait is lost with it; at most 1% of the samples
//! may be kept with part of their stack missing.

use anyhow::{ensure, Context, Result};
use pgscope_tests::workload::readable_script;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace};

/// What `samples.degraded` counts of a sample's stack: a part that could not be read, or a
/// wait's stack left out. Not the wait event guessed (`wait_sample_event_guessed`): its stack
/// is whole.
const PARTIAL_STACK_REASONS: [&str; 5] = [
    "user_stack_partial",
    "user_stack_lost",
    "kernel_stack_lost",
    "wait_sample_stack_over_budget",
    "wait_sample_ran_before_stack",
];

/// The share of the samples that may be kept with part of their stack missing, in percent.
const MOST_PARTIAL_PCT: f64 = 1.0;

/// Transactions per client: each holds its row lock for a millisecond, so with 8 clients on 3
/// rows most of them queue behind another.
const TRANSACTIONS_PER_CLIENT: u32 = 600;

const SCRIPT: &str = "\\set id random(1, 3)\n\
                      BEGIN;\n\
                      UPDATE lock_rows SET v = v + 1 WHERE id = :id;\n\
                      SELECT pg_sleep(0.001);\n\
                      END;\n";

#[test]
fn a_row_lock_storms_waits_name_the_waiter() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.psql(
        "CREATE TABLE lock_rows (id int PRIMARY KEY, v bigint NOT NULL); \
         INSERT INTO lock_rows SELECT g, 0 FROM generate_series(1, 3) g",
    )?;
    let (_dir, script) = readable_script("row_locks.sql", SCRIPT)?;

    let trace = Trace::instance(cluster.data_dir()).spawn_summarized()?;
    let transactions = TRANSACTIONS_PER_CLIENT.to_string();
    let script_arg = script.display().to_string();
    cluster.pgbench(&["-n", "-c", "8", "-j", "2", "-t", &transactions, "-f", &script_arg])?;
    let (_, summary) = trace.finish()?;
    let update =
        cluster.psql("SELECT queryid FROM pg_stat_statements WHERE query LIKE 'UPDATE lock_rows%'")?;
    let update = update.trim();
    ensure!(!update.is_empty(), "the UPDATE is not in pg_stat_statements");

    let waits = summary.off_cpu_by_query()?;
    let lock_waits: Vec<_> = waits
        .iter()
        .filter(|w| w.wait_event.starts_with("Lock:"))
        .collect();
    eprintln!("Lock:* waits by query:");
    for w in &lock_waits {
        eprintln!(
            "  {} {} {} {:.1} ms  {}",
            w.queryid,
            w.wait_event,
            w.off_cpu,
            w.ns as f64 / 1e6,
            w.stack
        );
    }
    let row_lock = lock_waits
        .iter()
        .find(|w| w.queryid == update && w.wait_event == "Lock:transactionid")
        .with_context(|| format!("no Lock:transactionid wait of the UPDATE ({update}) in the summary"))?;
    ensure!(
        row_lock.stack.starts_with("XactLockTableWait"),
        "the UPDATE's row-lock wait is summarized as `{}`, not by its waiter XactLockTableWait",
        row_lock.stack
    );
    let misclassed: Vec<_> = lock_waits.iter().filter(|w| w.off_cpu == "io").collect();
    ensure!(
        misclassed.is_empty(),
        "Lock:* waits classed as I/O: {misclassed:?}"
    );

    let degraded = summary.samples_degraded()?;
    let partial: u64 = PARTIAL_STACK_REASONS
        .iter()
        .filter_map(|reason| degraded.get(*reason))
        .sum();
    let samples = summary.samples_taken_in_kernel()? + summary.off_cpu_sought_stack()?;
    let partial_pct = 100.0 * partial as f64 / samples.max(1) as f64;
    eprintln!("kept with part of their stack missing: {partial} of {samples} samples ({partial_pct:.2}%), {degraded:?}");
    ensure!(samples > 0, "the trace took no samples of the storm");
    ensure!(
        partial_pct <= MOST_PARTIAL_PCT,
        "{partial} of {samples} samples ({partial_pct:.2}%) were kept with part of their stack missing, \
         over {MOST_PARTIAL_PCT}%: {degraded:?}"
    );
    Ok(())
}
