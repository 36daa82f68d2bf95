//! The majors matrix: every supported PostgreSQL major on its own real server binaries (14, 16,
//! 17 and 18 upstream builds cached by `scripts/pg-majors.sh`; 15 the distro's and a source
//! build without frame pointers), and 13, end-of-life, which pgscope must refuse to decode in
//! one line while still profiling its stacks. One cluster per build, with pg_stat_statements
//! loaded, serves every check:
//! - stacks: a CPU-bound backend profiled by `pgscope trace --pid` reaches the process root and
//!   its call chain is named where the build can name it;
//! - attribution: pgscope decodes this major (no refusal), the backend's samples carry what
//!   `pg_stat_activity` shows for it, and queryid labels equal `pg_stat_statements.queryid`
//!   under the simple and the extended protocol;
//! - phases: parse, plan, run and commit each hold samples of pgbench's TPC-B-like script;
//! - probes: the seven function probes count what that major's source says they must
//!   (`pgscope_tests::probe_matrix`, on a cluster of its own whose pg_stat_statements.so has no
//!   symbols, so that `pgss_store` is found through the hook functions, started while the
//!   first cluster's busy backend is traced).
//!
//! Each test prints one `major=NN build=… complete_pct=… queryid_agree_pct=… probes=ok|FAIL
//! phases=ok|FAIL stacks=ok|FAIL` line before it asserts; `make test-majors` runs this file alone
//! and repeats those lines last.

use std::collections::BTreeMap;
use std::thread;
use std::time::Duration;

use anyhow::{anyhow, ensure, Context, Result};
use pgscope_tests::agreement::{
    check_busy_backend, reading_activity, BackendAgreement, QueryidAgreement, QueryidRun,
};
use pgscope_tests::probe_matrix::{ProbeCluster, ProbeCounts};
use pgscope_tests::profile::Stack;
use pgscope_tests::workload::CPU_BOUND;
use pgscope_tests::{
    ensure_samples_cover, require_root_and_bpf, runs_under_exec_simple_query, CpuWindow, LabeledProfile,
    PgCluster, PgInstall, Profile, Statics, Trace, TraceOutput, TraceSummary,
};

const FREQUENCY: u32 = 199;
/// CPU time of the busy backend its stack trace runs until: ~400 samples at 199 Hz. A share
/// near the 95% bars (complete, rooted, under exec_simple_query; 90% of labels agreeing) is
/// then known within ±2.1 pp at 95% confidence (±1 pp near 99%, where every build measures
/// 100%), and `check_busy_backend`'s floor of 200 samples is met twice over.
const STACKS_CPU: Duration = Duration::from_secs(2);
/// Share of `CPU seconds × FREQUENCY` the busy backend's trace must hold. The CPU clock's
/// timer fires 199 times per second of each CPU, so a backend is sampled in proportion to its
/// own CPU time whatever else runs: ~1.0 of it, less by what pgscope loses. The window is the
/// backend's CPU time from pgscope saying it profiles to just before it is told to stop, and
/// pgscope samples a little on either side of it (it samples before it says so; it stops a
/// moment after the signal, later on a busier machine). Over 35 traces here at load 12-34 it
/// came out 0.99-1.40, once 0.72 (the nofp build, the whole test run at nice -10, no sample
/// lost): 0.6 leaves room below that, and is still above what the old bar asked of a quiet
/// machine (half of 8 s × 199 Hz from a backend with a whole CPU).
const MIN_SAMPLES_OF_CPU: f64 = 0.6;
/// CPU time of TPC-B's client backends its phase trace runs until: ~400 samples at 199 Hz, so
/// a phase holding 2.5% of them (the least commit held on any build here: 2.6-7.2%) expects 10
/// and has none with probability e^-10 ≈ 5·10^-5.
const PHASES_CPU: Duration = Duration::from_secs(2);
/// What every CPU-awaited trace may take at most: backends given a thirtieth of a CPU by a busy
/// machine still get there. Its expiry names the CPU time reached.
const CPU_TIMEOUT: Duration = Duration::from_secs(60);
/// Issue 18's bar for every major.
const MIN_COMPLETE_PCT: f64 = 95.0;
/// Each protocol's pgbench run of the shared script, a fixed trace (`QueryidRun` is shared with
/// the PG 15 attribution test). 3 s at 199 Hz holds 1.2 times the samples of that test's 5 s
/// at 99 Hz at any CPU share the two clients get (597 against 495 per CPU second of theirs):
/// 308-506 client-backend samples per run on this 2-core VM busy with other work (load ~19),
/// 241-398 with two CPU hogs added, against `check_queryids`' floor of 200 (each statement
/// needs 20).
const QUERYID_RUN: QueryidRun = QueryidRun {
    trace_secs: 3,
    frequency: 199,
};
/// pgbench 15 (the client every build is driven with) speaks both to every major; `extended`
/// sends each statement as Parse/Bind/Execute with parameters, whose queryid differs from the
/// simple protocol's literal one.
const PROTOCOLS: [&str; 2] = ["simple", "extended"];
/// The phases every statement of the TPC-B-like script goes through.
const PHASES: [&str; 4] = ["parse", "plan", "run", "commit"];

/// End-of-life and without `st_query_id`: no table, so pgscope must say in one line that it
/// decodes nothing of this major and why, and still profile complete, named stacks.
#[test]
fn major_13_upstream_refused() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::upstream(13)?;
    let cluster = start_checked(&install)?;
    let (stacks, refusal) = measure_backend(&cluster, Statics::Named, Expect::Refused)?;
    print_line(
        &install,
        &Line {
            complete_pct: stacks.as_ref().ok().map(|s| s.complete_pct),
            stacks_ok: stacks.as_ref().is_ok_and(|s| stacks_ok(s, Statics::Named)),
            ..Line::default()
        },
    );
    stacks.and_then(|s| check_stacks(install.label, &s, Statics::Named))?;
    refusal.map(|_| ())
}

#[test]
fn major_14_upstream() -> Result<()> {
    require_root_and_bpf();
    check_major(&PgInstall::upstream(14)?, Statics::Named)
}

/// Stripped, so `exec_simple_query` (static) is unnamed: its frame must be there, unnamed.
#[test]
fn major_15_distro() -> Result<()> {
    require_root_and_bpf();
    check_major(&PgInstall::distro()?, Statics::Unnamed)
}

/// Built from the same source without frame pointers (`make pg-nofp`), its debug file beside
/// it: unwound from `.eh_frame` alone, static functions named.
#[test]
fn major_15_no_frame_pointers() -> Result<()> {
    require_root_and_bpf();
    check_major(&PgInstall::no_frame_pointers()?, Statics::Named)
}

#[test]
fn major_16_upstream() -> Result<()> {
    require_root_and_bpf();
    check_major(&PgInstall::upstream(16)?, Statics::Named)
}

#[test]
fn major_17_upstream() -> Result<()> {
    require_root_and_bpf();
    check_major(&PgInstall::upstream(17)?, Statics::Named)
}

#[test]
fn major_18_upstream() -> Result<()> {
    require_root_and_bpf();
    check_major(&PgInstall::upstream(18)?, Statics::Named)
}

/// What the stack trace of one major showed.
struct Stacks {
    /// `samples.user_stacks_complete_pct` of the JSON summary.
    complete_pct: f64,
    /// Share of the folded stacks that start at the process root: the same property, counted
    /// from the profile pgscope wrote rather than taken from its own summary.
    rooted_share: f64,
    /// Share of samples whose user stack names `exec_simple_query`.
    exec_simple_query_share: f64,
    /// Share of samples under `PostgresMain` → `exec_simple_query` (or its unnamed frame in a
    /// stripped build) → `PortalRun`.
    chain_share: f64,
}

/// Everything measured on one major's cluster; each part fails on its own, so that the
/// `major=` line reports all of them.
struct Measured {
    stacks: Result<Stacks>,
    /// pgscope's statement about attribution for this major, and the traced backend's labels
    /// against pg_stat_activity.
    activity: Result<Option<BackendAgreement>>,
    queryids: QueryidAgreement,
    queryids_checked: Result<()>,
    /// Samples per phase of the TPC-B-like run.
    phases: Result<BTreeMap<String, u64>>,
}

fn check_major(install: &PgInstall, statics: Statics) -> Result<()> {
    let cluster = start_checked(install);
    let (measured, probes) = match &cluster {
        Ok(cluster) => measure_with_probes(cluster, statics),
        // The probes run all the same, on a cluster of their own, so that the line has them.
        Err(_) => (
            Err(anyhow!("no cluster to measure")),
            ProbeCluster::start(install).and_then(|probes| probes.check()),
        ),
    };
    let measured = match (cluster, measured) {
        (Ok(_), Ok(m)) => m,
        (Err(e), _) | (_, Err(e)) => {
            // The line is still printed, so that `make test-majors` lists every major.
            print_line(
                install,
                &Line {
                    probes_ok: Some(probes.as_ref().is_ok_and(ProbeCounts::ok)),
                    ..Line::default()
                },
            );
            return Err(e);
        }
    };
    print_line(
        install,
        &Line {
            complete_pct: measured.stacks.as_ref().ok().map(|s| s.complete_pct),
            queryid_agree_pct: measured.queryids.pct(),
            probes_ok: Some(probes.as_ref().is_ok_and(ProbeCounts::ok)),
            phases_ok: Some(measured.phases.as_ref().is_ok_and(phases_ok)),
            stacks_ok: measured.stacks.as_ref().is_ok_and(|s| stacks_ok(s, statics)),
        },
    );
    if let Ok(counts) = &probes {
        // Not at the start of the line: `make test-majors` repeats the lines that start with
        // `major=`, one per build.
        eprintln!("probe counts: {}", counts.summary());
    }
    let label = install.label;
    // Every failure is shown; the first one fails the test.
    let failures: Vec<anyhow::Error> = [
        measured
            .stacks
            .and_then(|s| check_stacks(label, &s, statics))
            .context("stacks"),
        measured
            .activity
            .map(|_| ())
            .context("labels against pg_stat_activity"),
        measured
            .queryids_checked
            .context("queryid labels against pg_stat_statements"),
        measured.phases.and_then(check_phases).context("phases"),
        probes
            .and_then(|counts| match counts.ok() {
                true => Ok(()),
                false => Err(anyhow!("{}", counts.failures.join("\n"))),
            })
            .context("function probe counts"),
    ]
    .into_iter()
    .filter_map(Result::err)
    .collect();
    for failure in &failures {
        eprintln!("{label}: {failure:#}");
    }
    match failures.into_iter().next() {
        Some(first) => Err(first),
        None => Ok(()),
    }
}

/// Measures everything on `cluster`, and the function probes on a cluster of their own
/// (`ProbeCluster`: a copy of the build whose pg_stat_statements.so has no symbols, so that
/// pgss_store is found through its hooks).
///
/// The probes' cluster starts (a copy of the build, `initdb`, start: seconds) while the busy
/// backend's stacks are traced: that trace runs until the backend has had its CPU time and its
/// sample count is judged against that time, so the CPU the start takes from it costs the
/// trace time, not truth. It is ready before the queryid runs, whose traces last a fixed time,
/// and the probes run alone after everything else: they count every call, and their generic
/// plan workload must run thousands of selects.
fn measure_with_probes(cluster: &PgCluster, statics: Statics) -> (Result<Measured>, Result<ProbeCounts>) {
    thread::scope(|scope| {
        let starting = scope.spawn(|| ProbeCluster::start_beside(cluster.install(), cluster));
        let backend = measure_backend(cluster, statics, Expect::Decoded);
        let probe_cluster = starting
            .join()
            .unwrap_or_else(|_| Err(anyhow!("starting the probes' cluster panicked")));
        let measured = backend.map(|(stacks, activity)| {
            let (queryids, queryids_checked) = QUERYID_RUN.measure(cluster, &PROTOCOLS);
            let phases = measure_phases(cluster);
            Measured {
                stacks,
                activity,
                queryids,
                queryids_checked,
                phases,
            }
        });
        // Dropped (stopped) here, before `cluster`, whose lock covers it.
        let probes = probe_cluster.and_then(|probes| probes.check());
        (measured, probes)
    })
}

/// What one major's line says; `None` prints `-` (not measured: 13 has no queryids, probes or
/// phases to check).
#[derive(Default)]
struct Line {
    complete_pct: Option<f64>,
    queryid_agree_pct: Option<f64>,
    probes_ok: Option<bool>,
    phases_ok: Option<bool>,
    stacks_ok: bool,
}

/// The one line per major that `make test-majors` repeats.
fn print_line(install: &PgInstall, line: &Line) {
    let pct = |value: Option<f64>| value.map_or("-".to_owned(), |v| format!("{v:.1}"));
    let ok = |ok: bool| if ok { "ok" } else { "FAIL" };
    let measured_ok = |value: Option<bool>| value.map_or("-", ok);
    println!(
        "\nmajor={} build={} complete_pct={} queryid_agree_pct={} probes={} phases={} stacks={}",
        install.major,
        install.label,
        pct(line.complete_pct),
        pct(line.queryid_agree_pct),
        measured_ok(line.probes_ok),
        measured_ok(line.phases_ok),
        ok(line.stacks_ok)
    );
}

/// A cluster of `install` with pg_stat_statements loaded, checked to run that major.
fn start_checked(install: &PgInstall) -> Result<PgCluster> {
    let label = install.label;
    let major = install.major;
    let cluster = PgCluster::start_with_pg_stat_statements(install, &[])?;
    // The cluster must be the major under test, not a distro binary found by mistake.
    let version_num: u32 = cluster
        .psql("SHOW server_version_num")?
        .trim()
        .parse()
        .context("server_version_num is not a number")?;
    ensure!(
        version_num / 10000 == major,
        "{label}: the server runs version {version_num}, not PostgreSQL {major}"
    );
    Ok(cluster)
}

/// What pgscope must do with a major's backends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A table: labels decoded, agreeing with pg_stat_activity.
    Decoded,
    /// No table (13): one line saying so and why, no labels.
    Refused,
}

/// Traces one backend running [`CPU_BOUND`] while reading its pg_stat_activity row: its
/// stacks, and its labels against that row and pgscope's statement about this major (for a
/// refused major, the statement alone: the agreement is then `None`).
fn measure_backend(
    cluster: &PgCluster,
    statics: Statics,
    expect: Expect,
) -> Result<(Result<Stacks>, Result<Option<BackendAgreement>>)> {
    let install = cluster.install();
    let label = install.label;
    let session = cluster.spawn_session(CPU_BOUND)?;
    let pid = session.pid();
    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("stacks.folded");
    let json = dir.path().join("summary.json");
    let pprof = dir.path().join("stacks.pb.gz");
    let trace = Trace::pid(pid)
        .frequency(FREQUENCY)
        // The no-frame-pointer build keeps its symbols in a build-id tree, as distros ship them.
        .debug_dir(install.debug_dir.as_deref())
        .folded(&folded)
        .json(&json)
        .pprof(&pprof);
    let traced = || trace_until_cpu(&trace, &[pid], STACKS_CPU);
    // 13's pg_stat_activity has no query_id column to read, and nothing is compared with it.
    let ((output, cpu), seen) = match expect {
        Expect::Decoded => reading_activity(cluster, &format!("pid = {pid}"), traced)?,
        Expect::Refused => (traced()?, Default::default()),
    };
    ensure!(
        session.is_active()?,
        "{label}: the workload ended during the trace; the profile is not of it"
    );
    let summary = TraceSummary::read(&json)?;
    let profile = Profile::read_folded(&folded)?;

    eprintln!(
        "{label}: {} samples of backend {pid} for {cpu:?} of its CPU time at {FREQUENCY} Hz ({:.2} of \
         CPU seconds × Hz)",
        profile.total(),
        profile.total() as f64 / (cpu.as_secs_f64() * f64::from(FREQUENCY))
    );
    // Far fewer, and every share below would be of a subset that losses chose.
    ensure_samples_cover(
        &format!("{label}: busy backend {pid}"),
        profile.total(),
        cpu,
        FREQUENCY,
        MIN_SAMPLES_OF_CPU,
    )?;
    let stacks = summary.user_stacks_complete_pct().map(|complete_pct| Stacks {
        complete_pct,
        rooted_share: profile.fraction_where(Stack::starts_at_process_root),
        exec_simple_query_share: profile
            .fraction_where(|s| s.user_frames().iter().any(|f| f == "exec_simple_query")),
        chain_share: profile.fraction_where(|s| runs_under_exec_simple_query(s.user_frames(), statics)),
    });
    let printed = format!("{}{}", output.stderr, output.stdout);
    let activity = match expect {
        Expect::Decoded => check_attributed(install, &summary, &printed).and_then(|()| {
            let labelled = LabeledProfile::read_pprof(&pprof)?;
            check_busy_backend(&labelled, pid, &seen).map(Some)
        }),
        Expect::Refused => check_refused(install, &summary, &printed).map(|()| None),
    };
    Ok((stacks, activity))
}

/// Every major from 14 on has a table: pgscope decodes attribution for it, records the major in
/// the summary, and does not print its refusal.
fn check_attributed(install: &PgInstall, summary: &TraceSummary, printed: &str) -> Result<()> {
    let major = install.major;
    ensure!(
        summary.postgres_major()? == Some(major),
        "the summary's postgres_major is {:?}, expected {major}; pgscope printed:\n{printed}",
        summary.postgres_major()?
    );
    let refusal = format!("PostgreSQL {major} is not supported for query and wait-event attribution");
    ensure!(
        !printed.contains(&refusal),
        "pgscope refused attribution on a supported major:\n{printed}"
    );
    Ok(())
}

/// 13 and older: pgscope says, once, that it decodes nothing of this major because it is
/// end-of-life and has no `st_query_id`, records no major in the summary, and still profiles.
fn check_refused(install: &PgInstall, summary: &TraceSummary, printed: &str) -> Result<()> {
    let major = install.major;
    ensure!(
        summary.postgres_major()?.is_none(),
        "the summary claims attribution for PostgreSQL {major}, which has no table:\n{printed}"
    );
    let refusal = format!("PostgreSQL {major} is not supported for query and wait-event attribution");
    let lines: Vec<&str> = printed
        .lines()
        .filter(|l| l.contains("no query or wait-event labels"))
        .collect();
    ensure!(
        lines.len() == 1 && lines[0].contains(&refusal),
        "expected one line refusing attribution on PostgreSQL {major}, got {lines:?}:\n{printed}"
    );
    for reason in [
        "end-of-life",
        "`st_query_id` came in 14",
        "stacks are still profiled",
    ] {
        ensure!(
            lines[0].contains(reason),
            "the refusal does not say `{reason}`: {}",
            lines[0]
        );
    }
    Ok(())
}

fn stacks_ok(s: &Stacks, statics: Statics) -> bool {
    s.complete_pct >= MIN_COMPLETE_PCT
        && s.rooted_share * 100.0 >= MIN_COMPLETE_PCT
        && s.chain_share >= 0.95
        && (statics == Statics::Unnamed || s.exec_simple_query_share > 0.0)
}

fn check_stacks(label: &str, s: &Stacks, statics: Statics) -> Result<()> {
    eprintln!(
        "{label}: folded stacks from the process root {:.1}%, exec_simple_query in {:.1}% of samples, \
         PostgresMain → exec_simple_query → PortalRun in {:.1}%",
        s.rooted_share * 100.0,
        s.exec_simple_query_share * 100.0,
        s.chain_share * 100.0
    );
    ensure!(
        s.complete_pct >= MIN_COMPLETE_PCT,
        "user stacks {:.1}% complete, expected at least {MIN_COMPLETE_PCT}%",
        s.complete_pct
    );
    ensure!(
        s.rooted_share * 100.0 >= MIN_COMPLETE_PCT,
        "the summary says {:.1}% complete, but only {:.1}% of the folded stacks start at the process root",
        s.complete_pct,
        s.rooted_share * 100.0
    );
    if statics == Statics::Named {
        ensure!(
            s.exec_simple_query_share > 0.0,
            "`exec_simple_query` appears in no stack, though the build's .symtab names it"
        );
    }
    ensure!(
        s.chain_share >= 0.95,
        "only {:.1}% of samples run under PostgresMain → exec_simple_query → PortalRun",
        s.chain_share * 100.0
    );
    Ok(())
}

/// Initialises pgbench's tables and traces the instance while two clients run the TPC-B-like
/// script (simple protocol), until their backends have used [`PHASES_CPU`]; returns the
/// summary's samples per phase.
fn measure_phases(cluster: &PgCluster) -> Result<BTreeMap<String, u64>> {
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("tpcb.json");
    // -n: `-i` has just vacuumed the tables. Longer than the trace: stopped after it.
    let mut pgbench = cluster.spawn_pgbench(&["-n", "-c", "2", "-T", "600"], 2)?;
    let backends: Vec<u32> = cluster
        .psql(&format!(
            "SELECT pid FROM pg_stat_activity WHERE application_name = '{}'",
            pgbench.tag()
        ))?
        .lines()
        .map(|pid| pid.trim().parse().with_context(|| format!("bad pid `{pid}`")))
        .collect::<Result<_>>()?;
    let trace = Trace::instance(cluster.data_dir())
        .frequency(FREQUENCY)
        .debug_dir(cluster.install().debug_dir.as_deref())
        .json(&json);
    trace_until_cpu(&trace, &backends, PHASES_CPU)?;
    ensure!(pgbench.is_running()?, "pgbench ended during the trace");
    pgbench.stop()?;
    TraceSummary::read(&json)?.phase_samples()
}

/// Runs `trace` until `pids` together have used `cpu` of CPU since it started profiling, then
/// ends it (SIGINT: pgscope stops sampling and writes every output). Returns its output and the
/// CPU time `pids` used from its start of profiling until just before the signal: the window
/// its samples cover.
fn trace_until_cpu(trace: &Trace, pids: &[u32], cpu: Duration) -> Result<(TraceOutput, Duration)> {
    // Only a bound for a test that died meanwhile: the CPU wait ends the trace first.
    let running = trace.clone().duration_secs(2 * CPU_TIMEOUT.as_secs()).spawn()?;
    let window = CpuWindow::start(pids)?;
    let used = window.await_cpu(cpu, CPU_TIMEOUT)?;
    let output = running.interrupt()?;
    Ok((output, used.on_cpu))
}

fn phases_ok(phases: &BTreeMap<String, u64>) -> bool {
    PHASES
        .iter()
        .all(|phase| phases.get(*phase).is_some_and(|&n| n > 0))
}

fn check_phases(phases: BTreeMap<String, u64>) -> Result<()> {
    let total: u64 = phases.values().sum();
    let shares: Vec<String> = phases
        .iter()
        .map(|(phase, &n)| format!("{phase} {:.1}%", 100.0 * n as f64 / total.max(1) as f64))
        .collect();
    eprintln!(
        "TPC-B-like script, {total} attributed samples: {}",
        shares.join(", ")
    );
    ensure!(
        phases_ok(&phases),
        "phases {PHASES:?} must each hold samples of the TPC-B-like script; samples per phase: {phases:?}"
    );
    Ok(())
}
