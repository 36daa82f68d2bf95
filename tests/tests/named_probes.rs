//! `--probes NAME` for a function pgscope has no rule for: any function the executable
//! exports is probed by name, with the seven's probe-point check, and its calls and latency
//! are counted per statement. Checked with `pg_sleep` on the stripped distro build: every
//! execution of the statement calls it a known number of times, and no call can return before
//! the time it was asked to sleep.

use anyhow::{ensure, Context, Result};
use pgscope_tests::workload::readable_script;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace};

/// `pg_sleep` calls per execution of [`SCRIPT`].
const SLEEPS_PER_EXECUTION: u64 = 20;
const CLIENTS: u64 = 2;
const TRANSACTIONS_PER_CLIENT: u64 = 50;
const SCRIPT: &str = "SELECT pg_sleep(0.0005) FROM generate_series(1, 20);\n";
/// What each call asks for: pg_sleep waits on its latch until that much has passed.
const SLEEP_NS: u64 = 500_000;
/// `histogram_log2_ns[i]` counts calls of [2^i, 2^(i+1)) ns: buckets below this one end under
/// [`SLEEP_NS`] (2^18 = 262144 ns; bucket 18 reaches 524287 and may hold a 0.5 ms call).
const FIRST_POSSIBLE_BUCKET: usize = 18;
/// Not a function of the executable: refused in one line, the rest traced.
const UNKNOWN: &str = "NoSuchFunctionX";

#[test]
fn a_function_probed_by_name_counts_every_call_of_its_statement() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let (_dir, script) = readable_script("sleeps.sql", SCRIPT)?;

    // No budget: every call is measured, so the count is exact rather than an estimate.
    let trace = Trace::instance(cluster.data_dir())
        .probes(&format!("pg_sleep,{UNKNOWN}"))
        .probe_budget("none")
        .spawn_summarized()?;
    let script_arg = script.display().to_string();
    let clients = CLIENTS.to_string();
    let transactions = TRANSACTIONS_PER_CLIENT.to_string();
    cluster.pgbench(&["-n", "-c", &clients, "-t", &transactions, "-f", &script_arg])?;
    let (output, summary) = trace.finish()?;

    ensure!(
        output.stderr.contains(&format!(
            "probe {UNKNOWN} not attached: `{UNKNOWN}` names no function"
        )),
        "pgscope did not say why {UNKNOWN} is not probed:\n{}",
        output.stderr
    );
    let row =
        cluster.psql("SELECT queryid, calls FROM pg_stat_statements WHERE query LIKE 'SELECT pg_sleep%'")?;
    let (queryid, executions) = row
        .trim()
        .split_once('|')
        .with_context(|| format!("the statement is not in pg_stat_statements: `{row}`"))?;
    let executions: u64 = executions.parse().context("pg_stat_statements' calls")?;
    ensure!(
        executions == CLIENTS * TRANSACTIONS_PER_CLIENT,
        "pg_stat_statements counted {executions} executions, pgbench ran {}",
        CLIENTS * TRANSACTIONS_PER_CLIENT
    );
    ensure!(
        !summary.extrapolated("pg_sleep")?,
        "pg_sleep's count was extrapolated without a probe budget"
    );
    let stats = summary
        .probe_of_query(queryid, "pg_sleep")?
        .with_context(|| format!("no pg_sleep row for the statement's queryid {queryid}"))?;
    eprintln!(
        "pg_sleep: {} calls under queryid {queryid} ({executions} executions), {:.1} µs each",
        stats.calls,
        stats.total_ns as f64 / stats.calls.max(1) as f64 / 1e3
    );
    ensure!(
        stats.calls == executions * SLEEPS_PER_EXECUTION,
        "pg_sleep counted {} calls under the statement, {executions} executions make {}",
        stats.calls,
        executions * SLEEPS_PER_EXECUTION
    );
    let too_short: u64 = stats.histogram_log2_ns[..FIRST_POSSIBLE_BUCKET].iter().sum();
    ensure!(
        too_short == 0 && stats.total_ns_with_nested_traps >= stats.calls * SLEEP_NS,
        "{too_short} pg_sleep calls returned before the {SLEEP_NS} ns they sleep, or their total \
         ({} ns) is under {} ns: {stats:?}",
        stats.total_ns_with_nested_traps,
        stats.calls * SLEEP_NS
    );
    Ok(())
}
