//! Where a wait's stack says what was being done. Eight clients update three rows, each
//! holding its row lock for a moment: the others queue on `Lock:transactionid`, and the
//! per-statement off-CPU summary must name the waiter (`XactLockTableWait`, under the update)
//! rather than the wait machinery every lock wait goes through (`epoll_wait ← WaitEventSetWait
//! ← WaitLatch ← ProcSleep`). A `Lock:*` wait is classed as a latch wait, never as I/O.

use anyhow::{ensure, Context, Result};
use pgscope_tests::workload::readable_script;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace};

/// Transactions per client: each holds its row lock for a millisecond, so with 8 clients on 3
/// rows most of them queue behind another.
const TRANSACTIONS_PER_CLIENT: u32 = 150;

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
    Ok(())
}
