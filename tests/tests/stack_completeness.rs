//! pgscope unwinds a busy backend's stacks up to the process root, with and without frame
//! pointers, and names the Postgres call chain.

use std::time::Duration;

use anyhow::{ensure, Result};
use pgscope_tests::profile::Stack;
use pgscope_tests::workload::{CPU_BOUND, CPU_BOUND_HOT_LEAVES};
use pgscope_tests::{
    ensure_samples_cover, expected_samples, require_root_and_bpf, runs_under_exec_simple_query, CpuWindow,
    PgCluster, PgInstall, Profile, Statics, Trace,
};

const FREQUENCY: u32 = 199;
/// Five CPU-seconds of the backend at 199 Hz: about 1000 samples, so that the 95% bars below
/// are met or missed by more than sampling noise (±1.4 points at 95% around 95%).
const BACKEND_CPU: Duration = Duration::from_secs(5);
/// A backend given a tenth of a core still gets there.
const CPU_TIMEOUT: Duration = Duration::from_secs(60);

/// Frame pointers in Postgres, none in glibc, no debug file: pgscope must unwind (FP or
/// `.eh_frame`) through stripped code, and static functions show as `postgres+0x…`.
#[test]
fn distro_build_stacks_reach_the_root() -> Result<()> {
    require_root_and_bpf();
    check_completeness(&PgInstall::distro()?, Statics::Unnamed)
}

/// No frame pointers anywhere, debug info only in a separate build-id tree: pgscope must unwind
/// from `.eh_frame` and name static functions (`exec_simple_query`, `ExecInterpExpr`) from
/// `--debug-dir`.
#[test]
fn no_frame_pointer_build_stacks_reach_the_root() -> Result<()> {
    require_root_and_bpf();
    check_completeness(&PgInstall::no_frame_pointers()?, Statics::Named)
}

/// A backend matching a regular expression row after row: the engine keeps its DFAs on the
/// stack (tens of KiB), and a sample whose copy of the stack stopped short of them lost every
/// frame above the engine (half of them with a 16 KiB copy).
#[test]
fn stacks_reach_the_root_through_the_regular_expression_engine() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::distro()?;
    let cluster = PgCluster::start(&install)?;
    let session = cluster.spawn_session(
        // generate_series in the select list streams its rows (in FROM it would store them all
        // first).
        "SELECT count(*) FROM (SELECT generate_series(1, 2000000000) AS g) s \
         WHERE md5(g::text) ~ '(a|b)+[0-9]{3}c'",
    )?;
    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("stacks.folded");
    let running = Trace::pid(session.pid())
        .duration_secs(600)
        .frequency(FREQUENCY)
        .folded(&folded)
        .spawn()?;
    let window = CpuWindow::start(&[session.pid()])?;
    let used = window.await_cpu(Duration::from_secs(3), CPU_TIMEOUT)?;
    running.interrupt()?;
    ensure!(session.is_active()?, "the workload ended during the trace");
    let profile = Profile::read_folded(&folded)?;
    ensure_samples_cover("regex", profile.total(), used.on_cpu, FREQUENCY, 0.5)?;
    let in_engine = |s: &Stack| s.user_frames().iter().any(|f| f == "pg_regexec");
    let engine = profile.count_where(in_engine);
    let rooted = profile.count_where(|s| in_engine(s) && s.starts_at_process_root());
    eprintln!(
        "regex: {engine} of {} samples in pg_regexec, {rooted} of them unwound to the process root",
        profile.total()
    );
    // The statement's work is hashing and matching: about half of it is the engine (45%).
    ensure!(
        engine * 4 >= profile.total(),
        "only {engine} of {} samples under pg_regexec; top stacks:\n{}",
        profile.total(),
        profile.examples_where(|_| true, 5)
    );
    ensure!(
        rooted as f64 >= 0.95 * engine as f64,
        "only {rooted} of {engine} samples in the regular-expression engine reach the process root; \
         examples:\n{}",
        profile.examples_where(|s| in_engine(s) && !s.starts_at_process_root(), 5)
    );
    Ok(())
}

fn check_completeness(install: &PgInstall, statics: Statics) -> Result<()> {
    let label = install.label;
    let cluster = PgCluster::start(install)?;
    let session = cluster.spawn_session(CPU_BOUND)?;
    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("stacks.folded");
    let running = Trace::pid(session.pid())
        .duration_secs(600)
        .frequency(FREQUENCY)
        .folded(&folded)
        .debug_dir(install.debug_dir.as_deref())
        .spawn()?;
    // Started once pgscope samples and read before it stops: the trace covers the window, and
    // the backend's CPU time in it is what the sample count is judged against.
    let window = CpuWindow::start(&[session.pid()])?;
    let used = window.await_cpu(BACKEND_CPU, CPU_TIMEOUT)?;
    running.interrupt()?;
    ensure!(
        session.is_active()?,
        "{label}: the workload ended during the trace; the profile is not of it"
    );
    let profile = Profile::read_folded(&folded)?;

    // Far fewer samples than the backend's CPU time yields means lost samples, and every
    // percentage below would be of a biased subset. cpu-clock sampling of one task misses ticks
    // that land while pgscope itself runs on that CPU: perf standing in for pgscope got 61-88% of
    // the nominal count of a busy backend sharing 2 cores with the profiler.
    eprintln!(
        "{label}: {} samples for {:?} on CPU ({:?} waiting for one), {:.0}% of CPU-seconds × {FREQUENCY} Hz",
        profile.total(),
        used.on_cpu,
        used.runnable,
        profile.total() as f64 * 100.0 / expected_samples(used.on_cpu, FREQUENCY)
    );
    ensure_samples_cover(label, profile.total(), used.on_cpu, FREQUENCY, 0.5)?;

    let rooted = profile.fraction_where(Stack::starts_at_process_root);
    let no_user = profile.count_where(|s| s.user_frames().is_empty());
    eprintln!(
        "{label}: {:.1}% of {} samples unwound to the process root ({no_user} without user frames)",
        rooted * 100.0,
        profile.total()
    );
    let mut first_frames = std::collections::BTreeMap::new();
    for s in &profile.stacks {
        let first = s.user_frames().first().map_or("(none)", String::as_str);
        *first_frames.entry(first).or_insert(0u64) += s.count;
    }
    eprintln!("{label}: first user frame → samples: {first_frames:?}");
    ensure!(
        rooted >= 0.95,
        "{label}: only {:.1}% of stacks start at the process root (_start/__libc_start_*/main); \
         most frequent incomplete ones:\n{}",
        rooted * 100.0,
        profile.examples_where(|s| !s.starts_at_process_root(), 5)
    );

    let is_hot = |s: &Stack| {
        s.user_frames()
            .last()
            .is_some_and(|f| CPU_BOUND_HOT_LEAVES.contains(&f.as_str()))
    };
    let hot = profile.count_where(is_hot);
    let hot_share = hot as f64 / profile.total() as f64;
    ensure!(
        hot_share >= 0.20,
        "{label}: {CPU_BOUND_HOT_LEAVES:?} are the leaf of only {:.1}% of samples (perf: 30-40%); top stacks:\n{}",
        hot_share * 100.0,
        profile.examples_where(|_| true, 5)
    );
    let chained =
        profile.count_where(|s| is_hot(s) && runs_under_exec_simple_query(s.user_frames(), statics));
    let chained_share = chained as f64 / hot as f64;
    eprintln!(
        "{label}: hot leaves {:.1}% of samples, {:.1}% of them under PostgresMain → exec_simple_query → PortalRun",
        hot_share * 100.0,
        chained_share * 100.0
    );
    ensure!(
        chained_share >= 0.95,
        "{label}: only {:.1}% of hot samples show PostgresMain → {} → PortalRun; examples:\n{}",
        chained_share * 100.0,
        if statics == Statics::Named {
            "exec_simple_query"
        } else {
            "postgres+0x…"
        },
        profile.examples_where(
            |s| is_hot(s) && !runs_under_exec_simple_query(s.user_frames(), statics),
            5
        )
    );

    if statics == Statics::Named {
        // The expression interpreter is static and the hottest function (~25% self in perf).
        let interp =
            profile.fraction_where(|s| s.user_frames().last().is_some_and(|f| f == "ExecInterpExpr"));
        eprintln!("{label}: ExecInterpExpr self {:.1}%", interp * 100.0);
        ensure!(
            interp >= 0.10,
            "{label}: ExecInterpExpr is the leaf of only {:.1}% of samples: static functions are not named \
             from --debug-dir",
            interp * 100.0
        );
    }
    Ok(())
}
