//! pgscope and perf (DWARF unwinding) profiling the same backend at the same time agree on where
//! its CPU time goes.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{ensure, Result};
use pgscope_tests::perf::{comparable_name, is_unnamed, PERF_UNKNOWN};
use pgscope_tests::workload::CPU_BOUND;
use pgscope_tests::{
    compare_top, disagreements, format_comparison, require_root_and_bpf, FunctionDiff, PerfRecording,
    PgCluster, PgInstall, Profile, Stack, Trace,
};

const DURATION_SECS: u64 = 10;
/// 199 Hz × 10 s ≈ 2000 samples per profiler: the difference of two independent estimates of a
/// 50% share (the distro build's merged `[unknown]` row; `ExecInterpExpr`, the largest row of
/// the build with debug files, has ~30%) then has a standard deviation of ~1.6 pp, so 5 pp is
/// ~3 sigma. At 99 Hz it would be ~2.2 pp and the test would fail by chance every few dozen runs.
const FREQUENCY: u32 = 199;
/// Largest allowed difference in self time for any top-10 function, in percentage points.
const MAX_PP: f64 = 5.0;
/// How many functions of each profiler's self-time table are compared.
const TOP: usize = 10;
/// Share of perf's stacks that must reach the process root. perf unwinds >99% of them that far
/// (see `harness.rs`); fewer means it was handed unusable unwind tables (e.g. a debug file's
/// empty `.eh_frame`) and is no reference any more.
const MIN_PERF_ROOTED: f64 = 0.95;

/// The distro build is stripped and has no debug files: perf cannot name its static functions,
/// so both sides merge them into `[unknown]` (pgscope's `postgres+0x…` frames included) and
/// only the exported functions are compared by name. pgscope names some static functions
/// without a symbol (the executor's per-node functions, from the `ExecInit*` that install
/// them); perf never prints those names, so they join `[unknown]` too.
#[test]
fn top_self_functions_agree_with_perf() -> Result<()> {
    require_root_and_bpf();
    let rows = compare_self_time(&PgInstall::distro()?, comparable_name, MergeNamesPerfLacks::Yes)?;
    ensure_agreement(&rows)
}

/// Whether pgscope's names that perf never prints count as perf's `[unknown]`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum MergeNamesPerfLacks {
    Yes,
    No,
}

/// The build without frame pointers has debug files: pgscope (`--debug-dir`) and perf (through
/// its build-id cache) both name every function, so the static ones (`ExecInterpExpr`,
/// `ExecProjectSRF`, …) are compared name for name and no row may be unnamed.
#[test]
fn top_self_functions_agree_with_perf_by_name_with_debug_files() -> Result<()> {
    require_root_and_bpf();
    let rows = compare_self_time(
        &PgInstall::no_frame_pointers()?,
        str::to_owned,
        MergeNamesPerfLacks::No,
    )?;
    let unnamed: Vec<&str> = rows
        .iter()
        .map(|r| r.name.as_str())
        .filter(|name| is_unnamed(name))
        .collect();
    ensure!(
        unnamed.is_empty(),
        "with debug files every top-{TOP} function should be named, but {unnamed:?} are not"
    );
    ensure_agreement(&rows)
}

/// Profiles one [`CPU_BOUND`] backend of `install` with pgscope and perf at the same time (both
/// given the build's debug files, if any), checks perf unwound its stacks, prints the top-[`TOP`]
/// self-time tables side by side and returns the rows. Functions are compared under the names
/// `name` gives them.
fn compare_self_time(
    install: &PgInstall,
    name: fn(&str) -> String,
    merge: MergeNamesPerfLacks,
) -> Result<Vec<FunctionDiff>> {
    let cluster = PgCluster::start(install)?;
    let session = cluster.spawn_session(CPU_BOUND)?;
    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("pgscope.folded");
    let debug_dir = install.debug_dir.as_deref();

    let perf = PerfRecording::start(
        session.pid(),
        Duration::from_secs(DURATION_SECS),
        FREQUENCY,
        dir.path(),
    )?;
    Trace::pid(session.pid())
        .duration_secs(DURATION_SECS)
        .frequency(FREQUENCY)
        .debug_dir(debug_dir)
        .folded(&folded)
        .run()?;
    let perf = perf.finish(debug_dir)?;
    ensure!(session.is_active()?, "the workload ended during the trace");
    let pgscope = Profile::read_folded(&folded)?;
    let rooted = perf.fraction_where(Stack::starts_at_process_root);
    ensure!(
        rooted >= MIN_PERF_ROOTED,
        "{}: only {:.1}% of perf's stacks reach the process root; not rooted:\n{}",
        install.label,
        rooted * 100.0,
        perf.examples_where(|s| !s.starts_at_process_root(), 5)
    );

    let perf_names: HashSet<String> = perf
        .stacks
        .iter()
        .flat_map(|s| s.frames.iter().map(|f| name(f)))
        .collect();
    let pgscope_name = |frame: &str| {
        let named = name(frame);
        if merge == MergeNamesPerfLacks::Yes && !perf_names.contains(&named) {
            PERF_UNKNOWN.to_owned()
        } else {
            named
        }
    };
    let rows = compare_top(&pgscope.self_table(pgscope_name), &perf.self_table(name), TOP);
    eprintln!(
        "{}: top-{TOP} self time, pgscope ({} samples) vs perf ({} samples, {:.1}% reach the root):\n{}",
        install.label,
        pgscope.total(),
        perf.total(),
        rooted * 100.0,
        format_comparison(&rows, "pgscope", "perf")
    );
    Ok(rows)
}

/// Fails naming every function whose shares differ by more than [`MAX_PP`].
fn ensure_agreement(rows: &[FunctionDiff]) -> Result<()> {
    let bad = disagreements(rows, MAX_PP);
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
