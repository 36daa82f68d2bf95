//! Time before Postgres reports a statement's queryid belongs to that statement. Raw parsing
//! and parse analysis run before `pgstat_report_query_id`, so the backend's status reads
//! queryid 0 while they do; a statement that is mostly parsing (a 100000-element IN list, sent
//! as text each time) showed a third of its CPU under queryid 0. pgscope links those samples
//! to the queryid the same statement (same backend, same statement start) reports next.

use std::time::Duration;

use anyhow::{ensure, Result};
use pgscope_tests::{
    require_root_and_bpf, workload, LabeledProfile, LabeledSample, PgCluster, PgInstall, Trace,
};

#[test]
fn parsing_before_the_queryid_is_known_lands_on_its_statement() -> Result<()> {
    require_root_and_bpf();
    let run = traced_in_lists(100_000, "", None, Duration::from_secs(3))?;
    let (pprof, queryid, output) = (&run.pprof, run.queryid.as_str(), &run.output);
    let profile = LabeledProfile::read_pprof(pprof)?;
    let client = |s: &LabeledSample| s.label("backend_type") == Some("client backend");
    let all = profile.count_where(client);
    let unknown = profile.count_where(|s| client(s) && s.label("queryid") == Some("0"));
    let statement = profile.count_where(|s| client(s) && s.label("queryid") == Some(queryid));
    let parsing = profile.count_where(|s| {
        client(s)
            && s.label("queryid") == Some(queryid)
            && matches!(s.label("phase"), Some("parse" | "analyze"))
    });
    eprintln!(
        "client backend samples {all}: queryid {queryid} {statement} (parse + analysis {parsing}), \
         queryid 0 {unknown}"
    );
    eprintln!(
        "queryid 0 by phase: {:?}\n{}",
        profile.label_values("phase", |s| client(s) && s.label("queryid") == Some("0")),
        profile.examples_where(|s| client(s) && s.label("queryid") == Some("0"), 4)
    );
    ensure!(all >= 100, "{all} client backend samples:\n{}", output.stdout);
    // What stays on 0: the statement the trace ended in, and pgbench's own few statements.
    ensure!(
        unknown * 10 <= all,
        "{unknown} of {all} client backend samples kept queryid 0"
    );
    ensure!(
        parsing * 10 >= statement,
        "the statement's parsing and analysis are {parsing} of its {statement} samples"
    );
    let phases = profile.label_values("phase", |s| s.label("queryid") == Some(queryid));
    ensure!(
        phases.get(&Some("parse".to_string())).is_some_and(|&n| n > 0),
        "no parse samples carry queryid {queryid}: {phases:?}"
    );
    Ok(())
}

/// A statement too short to be sampled twice (a 5000-element IN list: a millisecond or two of
/// parsing, little else), sent by one client that waits 30 ms between statements as
/// applications do: no later sample of the statement carries its queryid, but while the backend
/// waits for its client its status still shows the statement's start and queryid, and pgscope
/// reads them there.
#[test]
fn short_statements_followed_by_a_client_wait_get_their_parsing() -> Result<()> {
    require_root_and_bpf();
    let run = traced_in_lists(5_000, "\\sleep 30 ms\n", Some(499), Duration::from_millis(500))?;
    let (pprof, queryid, output) = (&run.pprof, run.queryid.as_str(), &run.output);
    let profile = LabeledProfile::read_pprof(pprof)?;
    let client = |s: &LabeledSample| s.label("backend_type") == Some("client backend");
    let parsing = |s: &LabeledSample| matches!(s.label("phase"), Some("parse" | "analyze"));
    let unknown = profile.count_where(|s| client(s) && parsing(s) && s.label("queryid") == Some("0"));
    let linked = profile.count_where(|s| client(s) && parsing(s) && s.label("queryid") == Some(queryid));
    eprintln!("parse + analysis samples of client backends: queryid {queryid} {linked}, queryid 0 {unknown}");
    ensure!(
        linked + unknown >= 40,
        "{} parse + analysis samples:\n{}",
        linked + unknown,
        output.stdout
    );
    // What may stay on 0: a statement whose client sent the next one within 10 ms, and the
    // trace's last one.
    ensure!(
        unknown * 5 <= linked + unknown,
        "{unknown} of {} parse + analysis samples kept queryid 0",
        linked + unknown
    );
    Ok(())
}

/// pg_stat_statements' first store of a new statement, where its evictions happen, runs before
/// the statement reports its queryid. In an eviction storm (`pg_stat_statements.max` = 100,
/// 128 distinct statements, 8 clients back to back) that store is most of the backends' CPU, and
/// no later sample or client wait names its statement. With `pgss_store` probed, the probe
/// keeps its queryId argument for the call, and the samples inside it take it from there.
#[test]
fn pg_stat_statements_storing_a_new_statement_is_that_statements_work() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(
        &PgInstall::distro()?,
        &[("pg_stat_statements.max", "100")],
    )?;
    let (_scripts, mut args) = workload::pgss_eviction_scripts(&cluster)?;
    args.extend(["-n", "-c", "8", "-j", "2", "-T", "6"].map(String::from));
    let dir = tempfile::tempdir()?;
    let pprof = dir.path().join("profile.pb.gz");
    let trace = Trace::instance(cluster.data_dir())
        .pprof(&pprof)
        .probes("pgss_store")
        .probe_budget("none")
        .duration_secs(600)
        .spawn()?;
    let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
    cluster.pgbench(&arg_refs)?;
    let output = trace.interrupt()?;
    let profile = LabeledProfile::read_pprof(&pprof)?;
    // Samples in the probe's own trap at pgss_store's entry come before it noted the queryid:
    // pgscope's cost, which its analysis leaves out too.
    let in_trap = |s: &LabeledSample| {
        s.frames.iter().any(|f| {
            f.ends_with("_[k]")
                && ["int3", "uprobe", "swbp", "bpf_prog"]
                    .iter()
                    .any(|p| f.contains(p))
        })
    };
    let storing = |s: &LabeledSample| {
        s.label("backend_type") == Some("client backend")
            && s.frames.iter().any(|f| f == "pgss_store")
            && matches!(s.label("phase"), Some("parse" | "analyze"))
            && !in_trap(s)
    };
    let all = profile.count_where(storing);
    let unknown = profile.count_where(|s| storing(s) && s.label("queryid") == Some("0"));
    eprintln!("samples in pgss_store during parse analysis: {all}, on queryid 0: {unknown}");
    eprintln!(
        "{}",
        profile.examples_where(|s| storing(s) && s.label("queryid") == Some("0"), 6)
    );
    ensure!(
        all >= 30,
        "{all} samples in pgss_store during parse analysis:\n{}",
        output.stdout
    );
    ensure!(
        unknown * 10 <= all,
        "{unknown} of {all} samples of pgss_store storing a new statement kept queryid 0"
    );
    // The hook that calls it is named by the hook variable holding it, as pgss_store is.
    let unnamed_caller = profile.count_where(|s| {
        storing(s)
            && s.frames
                .iter()
                .take_while(|f| *f != "pgss_store")
                .any(|f| f.starts_with("pg_stat_statements.so+0x"))
    });
    let named_caller =
        profile.count_where(|s| storing(s) && s.frames.iter().any(|f| f == "pgss_post_parse_analyze"));
    ensure!(
        // (A stack cut short by its unwind may end at pgss_store: it names no caller at all.)
        unnamed_caller == 0 && named_caller * 10 >= all * 9,
        "pgss_store's caller: pgss_post_parse_analyze in {named_caller} of {all} samples, an \
         unnamed function of the library in {unnamed_caller}:\n{}",
        profile.examples_where(storing, 4)
    );
    Ok(())
}

/// A traced run of one pgbench client sending `SELECT count(*) FROM t WHERE x IN (…)` with
/// `elements` literals as text, each followed by `after` (pgbench script lines), sampled at
/// `hz` (pgscope's default when None) for `seconds`: the pprof profile, the statement's queryid and pgscope's output.
struct InListRun {
    _dir: tempfile::TempDir,
    pprof: std::path::PathBuf,
    queryid: String,
    output: pgscope_tests::TraceOutput,
}

/// Bound on the client's backend reaching the CPU time a trace needs (a tenth of a core gets
/// there).
const CPU_TIMEOUT: Duration = Duration::from_secs(120);

fn traced_in_lists(elements: u32, after: &str, hz: Option<u32>, backend_cpu: Duration) -> Result<InListRun> {
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.psql("CREATE TABLE t (x int); INSERT INTO t SELECT generate_series(1, 10)")?;
    let dir = tempfile::tempdir()?;
    let list: Vec<String> = (1..=elements).map(|i| i.to_string()).collect();
    let script = dir.path().join("in_list.sql");
    std::fs::write(
        &script,
        format!("SELECT count(*) FROM t WHERE x IN ({});\n{after}", list.join(",")),
    )?;
    let pprof = dir.path().join("profile.pb.gz");
    let mut trace = Trace::instance(cluster.data_dir())
        .pprof(&pprof)
        .duration_secs(600);
    if let Some(hz) = hz {
        trace = trace.frequency(hz);
    }
    let trace = trace.spawn()?;
    let script = script.display().to_string();
    // Until the backend has had the CPU the counts need, however busy the machine (a fixed 5 s
    // gave 10 samples beside two CPU hogs and other tests); longer than that, then stopped.
    let mut pgbench = cluster.spawn_pgbench(&["-n", "-c", "1", "-T", "600", "-f", &script], 1)?;
    pgbench.run_for_cpu(backend_cpu, CPU_TIMEOUT)?;
    pgbench.stop()?;
    let output = trace.interrupt()?;
    let queryid = cluster
        .psql("SELECT queryid FROM pg_stat_statements WHERE query LIKE 'SELECT count(*) FROM t WHERE x IN%'")?
        .trim()
        .to_string();
    ensure!(
        !queryid.is_empty(),
        "no pg_stat_statements entry for the statement"
    );
    Ok(InListRun {
        _dir: dir,
        pprof,
        queryid,
        output,
    })
}
