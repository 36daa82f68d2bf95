//! pgscope and perf (DWARF unwinding) profiling the same backend at the same time agree on where
//! its CPU time goes.

use std::time::Duration;

use anyhow::{ensure, Result};
use pgscope_tests::perf::comparable_name;
use pgscope_tests::workload::CPU_BOUND;
use pgscope_tests::{
    compare_top, disagreements, format_comparison, require_root_and_bpf, PerfRecording, PgCluster, PgInstall,
    Profile, Trace,
};

const DURATION_SECS: u64 = 10;
/// 199 Hz × 10 s ≈ 2000 samples per profiler: the difference of two independent estimates of a
/// 50% share (the merged `[unknown]` row) then has a standard deviation of ~1.6 pp, so 5 pp is
/// ~3 sigma. At 99 Hz it would be ~2.2 pp and the test would fail by chance every few dozen runs.
const FREQUENCY: u32 = 199;
/// Largest allowed difference in self time for any top-10 function, in percentage points.
const MAX_PP: f64 = 5.0;

#[test]
fn top_self_functions_agree_with_perf() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    let session = cluster.spawn_session(CPU_BOUND)?;
    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("pgscope.folded");

    let perf = PerfRecording::start(
        session.pid(),
        Duration::from_secs(DURATION_SECS),
        FREQUENCY,
        dir.path(),
    )?;
    Trace::pid(session.pid())
        .duration_secs(DURATION_SECS)
        .frequency(FREQUENCY)
        .folded(&folded)
        .run()?;
    let perf = perf.finish()?;
    ensure!(session.is_active()?, "the workload ended during the trace");
    let pgscope = Profile::read_folded(&folded)?;

    // perf cannot name the stripped build's static functions; both sides merge them into
    // `[unknown]` (pgscope's `postgres+0x…` frames included).
    let rows = compare_top(
        &pgscope.self_table(comparable_name),
        &perf.self_table(comparable_name),
        10,
    );
    eprintln!(
        "top-10 self time, pgscope ({} samples) vs perf ({} samples):\n{}",
        pgscope.total(),
        perf.total(),
        format_comparison(&rows, "pgscope", "perf")
    );
    let bad = disagreements(&rows, MAX_PP);
    ensure!(
        bad.is_empty(),
        "{} functions differ by more than {MAX_PP} pp: {:?}",
        bad.len(),
        bad.iter()
            .map(|r| format!("{} {:+.1}", r.name, r.diff()))
            .collect::<Vec<_>>()
    );
    Ok(())
}
