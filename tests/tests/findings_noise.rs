//! What is not a database's trouble stays out of the way of what is. Twice as many backends as
//! cores burn CPU (each waits for a CPU about half the time), one sleeps in `pg_sleep`, and the
//! instance's background processes idle in their main loops. The host's CPU contention must be
//! one `cpu_contention` finding for the whole trace, its figure where the backends' own
//! scheduler statistics (`/proc/PID/schedstat`: time runnable on a run queue) put it; the
//! sleep must not be called blocked (no `top_wait` names it); and the printed off-CPU table
//! must show the idle processes as one `(idle)` line, not a row each.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::findings_json::{describe_findings, read_findings};
use pgscope_tests::{require_root_and_bpf, CpuWindow, PgCluster, PgInstall, Trace};

/// CPU-bound backends: twice this machine's cores, so that each waits for a CPU about half
/// the time whatever the machine.
fn burners() -> Result<usize> {
    Ok(2 * std::thread::available_parallelism()?.get())
}
/// A statement that keeps a backend on CPU for minutes (ended by the test).
const BURN: &str = "SELECT count(*) FROM (SELECT md5(g::text) FROM generate_series(1, 2000000000) g) s";
/// The CPU time the burners use in the trace: enough ticks for the run-queue share to settle.
const BURNED: Duration = Duration::from_secs(12);

#[test]
fn host_cpu_contention_is_one_finding_and_sleeps_and_idle_processes_stay_out_of_the_way() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let trace = Trace::instance(cluster.data_dir())
        .duration_secs(600)
        .json(&json)
        .spawn()?;
    let sleeper = cluster.spawn_session("SELECT pg_sleep(600)")?;
    let burners = (0..burners()?)
        .map(|_| cluster.spawn_session(BURN))
        .collect::<Result<Vec<_>>>()?;
    let pids: Vec<u32> = burners.iter().map(|b| b.pid()).collect();
    let window = CpuWindow::start(&pids)?;
    let used = window.await_cpu(BURNED, Duration::from_secs(300))?;
    let output = trace.interrupt()?;
    let stdout = output.stdout.clone();
    drop(burners);
    drop(sleeper);

    let findings = read_findings(&json)?;
    eprintln!("{}", describe_findings(&findings));
    let contention: Vec<_> = findings.iter().filter(|f| f.kind == "cpu_contention").collect();
    ensure!(
        contention.len() == 1,
        "expected one cpu_contention finding, found {}:\n{}",
        contention.len(),
        describe_findings(&findings)
    );
    let contention = contention[0];
    ensure!(
        !contention.is_alarm(),
        "host contention is information: {contention:#?}"
    );

    // The independent figure: the burners' own run-queue time over a window inside the trace's,
    // against pgscope's preempted time over the whole trace (which also holds the sleeper's,
    // the idle processes' and the moments around the window: a little more).
    let runnable_ms = used.runnable.as_secs_f64() * 1e3;
    let sampled_ms = contention.leading_number("ms runnable without a CPU")?;
    eprintln!(
        "run-queue time: schedstat {runnable_ms:.0} ms over {:.1} s of CPU, pgscope {sampled_ms:.0} ms",
        used.on_cpu.as_secs_f64()
    );
    ensure!(
        runnable_ms > 0.2 * used.on_cpu.as_secs_f64() * 1e3,
        "the burners barely waited for a CPU ({runnable_ms:.0} ms runnable for {:?} on CPU): the \
         machine has more free cores than the test assumes",
        used.on_cpu
    );
    let ratio = sampled_ms / runnable_ms;
    ensure!(
        (0.7..=1.5).contains(&ratio),
        "pgscope put {sampled_ms:.0} ms runnable without a CPU, the burners' schedstat \
         {runnable_ms:.0} ms ({ratio:.2} of it; 0.7-1.5 allowed: the sampler reads preemption \
         at its ticks, and the trace is a little longer than the window)"
    );

    // The sleep is not blocked time: no top_wait names the sleeper's statement.
    let sleep_queryid = cluster
        .psql("SELECT queryid FROM pg_stat_statements WHERE query LIKE 'SELECT pg_sleep%'")?
        .trim()
        .to_string();
    let named: BTreeSet<&str> = findings
        .iter()
        .filter(|f| f.kind == "top_wait")
        .flat_map(|f| f.queryids.iter().map(String::as_str))
        .collect();
    ensure!(
        !named.contains(sleep_queryid.as_str()),
        "pg_sleep's statement {sleep_queryid} is named as a statement that waited: {named:?}"
    );

    // One `(idle)` line in the printed table, none of the background processes' rows.
    let table = stdout
        .split("off-CPU: ")
        .nth(1)
        .and_then(|rest| rest.split("\n\n").next())
        .context("no off-CPU table in the output")?;
    eprintln!("off-CPU table:\n{table}");
    ensure!(
        table.lines().filter(|l| l.starts_with("(idle)")).count() == 1,
        "the idle processes are not one `(idle)` line:\n{table}"
    );
    for main_loop in [
        "Activity:CheckpointerMain",
        "Activity:WalWriterMain",
        "Activity:BgWriterMain",
    ] {
        ensure!(
            !table.contains(main_loop),
            "the off-CPU table lists the idle {main_loop}:\n{table}"
        );
    }
    Ok(())
}
