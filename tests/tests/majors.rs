//! The majors matrix: every supported PostgreSQL major on its own real server binaries (14, 16,
//! 17 and 18 upstream builds cached by `scripts/pg-majors.sh`; 15 the distro's and a source
//! build without frame pointers), a CPU-bound backend profiled by `pgscope trace`. Stacks must reach the process root, the query's call
//! chain must be named where the build can name it, and a major pgscope has no table for must be
//! told apart in so many words: attribution refused, stacks still profiled.
//!
//! Each test prints one `major=NN build=… complete_pct=… exec_simple_query=yes|no stacks=ok|FAIL`
//! line before it asserts; `make test-majors` runs this file alone and repeats those lines last.

use anyhow::{ensure, Context, Result};
use pgscope_tests::profile::Stack;
use pgscope_tests::workload::CPU_BOUND;
use pgscope_tests::{
    require_root_and_bpf, runs_under_exec_simple_query, PgCluster, PgInstall, Profile, Statics, Trace,
    TraceSummary,
};

const DURATION_SECS: u64 = 8;
const FREQUENCY: u32 = 199;
/// Issue 18's bar for every major.
const MIN_COMPLETE_PCT: f64 = 95.0;
/// Majors pgscope decodes attribution for today; the others must be refused by name.
const ATTRIBUTED_MAJORS: &[u32] = &[15];

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

/// What one trace of one major showed.
struct Measured {
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
    /// What was wrong with pgscope's statement about attribution for this major; checked after
    /// the stacks, so that the `major=` line reports them either way.
    attribution: Result<()>,
}

fn check_major(install: &PgInstall, statics: Statics) -> Result<()> {
    let major = install.major;
    let measured = measure(install, statics);
    let Ok(m) = &measured else {
        // The line is still printed, so that `make test-majors` lists every major.
        println!("\nmajor={major} build={} stacks=FAIL", install.label);
        return measured.map(|_| ());
    };
    let named = m.exec_simple_query_share > 0.0;
    let stacks_ok = m.complete_pct >= MIN_COMPLETE_PCT
        && m.rooted_share * 100.0 >= MIN_COMPLETE_PCT
        && m.chain_share >= 0.95
        && (statics == Statics::Unnamed || named);
    println!(
        "\nmajor={major} build={} complete_pct={:.1} exec_simple_query={} stacks={}",
        install.label,
        m.complete_pct,
        if named { "yes" } else { "no" },
        if stacks_ok { "ok" } else { "FAIL" }
    );
    eprintln!(
        "{}: folded stacks from the process root {:.1}%, exec_simple_query in {:.1}% of samples, \
         PostgresMain → exec_simple_query → PortalRun in {:.1}%",
        install.label,
        m.rooted_share * 100.0,
        m.exec_simple_query_share * 100.0,
        m.chain_share * 100.0
    );
    ensure!(
        m.complete_pct >= MIN_COMPLETE_PCT,
        "{}: user stacks {:.1}% complete, expected at least {MIN_COMPLETE_PCT}%",
        install.label,
        m.complete_pct
    );
    ensure!(
        m.rooted_share * 100.0 >= MIN_COMPLETE_PCT,
        "{}: the summary says {:.1}% complete, but only {:.1}% of the folded stacks start at the process root",
        install.label,
        m.complete_pct,
        m.rooted_share * 100.0
    );
    if statics == Statics::Named {
        ensure!(
            named,
            "{}: `exec_simple_query` appears in no stack, though the build's .symtab names it",
            install.label
        );
    }
    ensure!(
        m.chain_share >= 0.95,
        "{}: only {:.1}% of samples run under PostgresMain → exec_simple_query → PortalRun",
        install.label,
        m.chain_share * 100.0
    );
    measured?.attribution
}

/// Starts a cluster of `install`, traces one backend running [`CPU_BOUND`] and checks what
/// pgscope said about attribution for this major.
fn measure(install: &PgInstall, statics: Statics) -> Result<Measured> {
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
    let session = cluster.spawn_session(CPU_BOUND)?;
    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("stacks.folded");
    let json = dir.path().join("summary.json");
    let output = Trace::pid(session.pid())
        .duration_secs(DURATION_SECS)
        .frequency(FREQUENCY)
        // The no-frame-pointer build keeps its symbols in a build-id tree, as distros ship them.
        .debug_dir(install.debug_dir.as_deref())
        .folded(&folded)
        .json(&json)
        .output()?;
    ensure!(
        session.is_active()?,
        "{label}: the workload ended during the trace; the profile is not of it"
    );
    let summary = TraceSummary::read(&json)?;
    let profile = Profile::read_folded(&folded)?;

    // A busy backend on 2 shared cores gives well over half the nominal count (see
    // stack_completeness.rs); far fewer and every share below is of a biased subset.
    let expected = DURATION_SECS * u64::from(FREQUENCY);
    ensure!(
        profile.total() * 2 >= expected,
        "{label}: {} samples, expected about {expected} from a busy backend at {FREQUENCY} Hz for {DURATION_SECS} s",
        profile.total()
    );

    let attribution =
        check_attribution_statement(install, &summary, &format!("{}{}", output.stderr, output.stdout));
    Ok(Measured {
        complete_pct: summary.user_stacks_complete_pct()?,
        rooted_share: profile.fraction_where(Stack::starts_at_process_root),
        exec_simple_query_share: profile
            .fraction_where(|s| s.user_frames().iter().any(|f| f == "exec_simple_query")),
        chain_share: profile.fraction_where(|s| runs_under_exec_simple_query(s.user_frames(), statics)),
        attribution,
    })
}

/// On a major with a table, attribution is decoded; on any other, pgscope says it is not
/// supported for that major and that stacks are still profiled, and the summary records no major.
fn check_attribution_statement(install: &PgInstall, summary: &TraceSummary, printed: &str) -> Result<()> {
    let label = install.label;
    let major = install.major;
    let refusal = format!("PostgreSQL {major} is not supported for query and wait-event attribution");
    if ATTRIBUTED_MAJORS.contains(&major) {
        ensure!(
            summary.postgres_major()? == Some(major),
            "{label}: the summary's postgres_major is {:?}, expected {major}",
            summary.postgres_major()?
        );
        ensure!(
            !printed.contains(&refusal),
            "{label}: pgscope refused attribution on a supported major:\n{printed}"
        );
    } else {
        ensure!(
            summary.postgres_major()?.is_none(),
            "{label}: the summary claims attribution for major {:?}, which has no table",
            summary.postgres_major()?
        );
        ensure!(
            printed.contains(&refusal) && printed.contains("stacks are still profiled"),
            "{label}: pgscope did not say `{refusal}` (and that stacks are still profiled); it printed:\n{printed}"
        );
    }
    Ok(())
}
