//! `--probes pgss_store`: pg_stat_statements' static store function, counted per kind: one
//! `exec` store per executed statement, plus one `plan` store when
//! `pg_stat_statements.track_planning` is on. It is found by name through a debug file when
//! one is found (the no-frame-pointer source build has a build-id debug tree), else through
//! pg_stat_statements' hook functions (the distro build ships the library stripped, with no
//! debug file). A debuginfod server (DEBUGINFOD_URLS) is the last place the debug file is looked
//! for.

use std::path::Path;

use anyhow::{ensure, Context, Result};
use pgscope_tests::pgss_discovery::{
    build_id_hex, debug_file_in_tree, debug_file_of, mapped_library, offset_by_name,
    offset_found_through_hooks, FOUND_THROUGH_HOOKS,
};
use pgscope_tests::probe_workloads::{trace_backend, BackendWorkload, TracedBackend};
use pgscope_tests::{require_root_and_bpf, DebuginfodServer, PgCluster, PgInstall, Profile, Trace};

/// Statements executed while traced.
const STATEMENTS: u64 = 60;

/// Traces one backend of `cluster` with `probes` (and `--debug-dir` when given) while it runs
/// [`STATEMENTS`] statements.
fn trace_statements(cluster: &PgCluster, probes: &str, debug_dir: Option<&Path>) -> Result<TracedBackend> {
    trace_statements_with(cluster, |trace| trace.probes(probes).debug_dir(debug_dir))
}

/// Like [`trace_statements`], with the probe arguments `probe_args` adds; every probe must
/// attach.
fn trace_statements_with(
    cluster: &PgCluster,
    probe_args: impl FnOnce(Trace) -> Trace,
) -> Result<TracedBackend> {
    let workload = BackendWorkload {
        selects: STATEMENTS,
        ..BackendWorkload::default()
    };
    let traced = trace_backend(cluster, workload, probe_args)?;
    ensure!(
        traced.not_attached().is_empty(),
        "a probe did not attach:\n{}",
        traced.stderr
    );
    eprintln!(
        "{}: pgss_store(exec) {}, pgss_store(plan) {}, PortalStart {} for {STATEMENTS} statements",
        cluster.install().label,
        traced.calls("pgss_store(exec)")?,
        traced.calls("pgss_store(plan)")?,
        traced.calls("PortalStart")?
    );
    Ok(traced)
}

/// The backend's pg_stat_statements.so, as it mapped it.
fn library(traced: &TracedBackend) -> Result<&Path> {
    traced
        .library
        .as_deref()
        .context("the traced backend maps no pg_stat_statements.so")
}

/// The source build's separate debug files (a `.build-id` tree).
fn debug_tree(install: &PgInstall) -> Result<&Path> {
    install
        .debug_dir
        .as_deref()
        .context("the nofp build has a debug tree")
}

/// pg_stat_statements stores each executed statement's statistics once (`pgss_store(exec)`),
/// under the statement's queryid.
fn expect_one_exec_store_per_statement(traced: &TracedBackend, context: &str) -> Result<()> {
    let mut wrong: Vec<String> = traced.per_statement("pgss_store(exec)", 1)?.into_iter().collect();
    wrong.extend(traced.selects_disagreements()?);
    ensure!(
        wrong.is_empty(),
        "{context}{}{}",
        if context.is_empty() { "" } else { ": " },
        wrong.join("; ")
    );
    Ok(())
}

#[test]
fn one_exec_store_per_statement_and_a_plan_store_with_track_planning() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::no_frame_pointers()?;
    for (track_planning, plans) in [("off", 0), ("on", STATEMENTS)] {
        let cluster = PgCluster::start_with_pg_stat_statements(
            &install,
            &[("pg_stat_statements.track_planning", track_planning)],
        )?;
        let traced = trace_statements(&cluster, "pgss_store", install.debug_dir.as_deref())
            .with_context(|| format!("track_planning = {track_planning}"))?;
        ensure!(
            !traced.stderr.contains(FOUND_THROUGH_HOOKS),
            "with --debug-dir pgss_store must be found by name, not through the hooks:\n{}",
            traced.stderr
        );
        expect_one_exec_store_per_statement(&traced, &format!("track_planning = {track_planning}"))?;
        let planned = traced.calls("pgss_store(plan)")?;
        ensure!(
            planned == plans,
            "track_planning = {track_planning}: pgss_store(plan) counted {planned} times, expected {plans}"
        );
    }
    Ok(())
}

/// On the source build, without `--debug-dir` (its debug files lie in a tree pgscope does not
/// search by itself), pgss_store is found through the hook functions, at exactly the offset its
/// debug file names.
#[test]
fn hook_functions_lead_to_the_offset_the_debug_file_names() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::no_frame_pointers()?;
    let debug_dir = debug_tree(&install)?;
    let cluster = PgCluster::start_with_pg_stat_statements(&install, &[])?;
    let traced = trace_statements(&cluster, "pgss_store", None)?;
    let through_hooks = offset_found_through_hooks(&traced.stderr)?;
    let library = library(&traced)?;
    let by_name = offset_by_name(library, &debug_file_of(library, debug_dir)?)?;
    eprintln!("pgss_store: file offset {through_hooks:#x} through the hooks, {by_name:#x} by name");
    ensure!(
        through_hooks == by_name,
        "the hooks led to {through_hooks:#x}, the debug file names pgss_store at {by_name:#x}"
    );
    expect_one_exec_store_per_statement(&traced, "")?;
    Ok(())
}

/// `--probe pgss_store=PATH:OFFSET` attaches where it is told, before any lookup: on the source
/// build without `--debug-dir`, at the offset its debug file names, it counts like by name.
#[test]
fn an_explicit_location_is_used_as_given() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::no_frame_pointers()?;
    let debug_dir = debug_tree(&install)?;
    let cluster = PgCluster::start_with_pg_stat_statements(&install, &[])?;
    let library = mapped_library(cluster.postmaster_pid()?, "pg_stat_statements.so")?;
    let spec = format!(
        "pgss_store={}:{:#x}",
        library.display(),
        offset_by_name(&library, &debug_file_of(&library, debug_dir)?)?
    );
    let traced = trace_statements_with(&cluster, |trace| trace.explicit_probe(&spec))?;
    ensure!(
        !traced.stderr.contains(FOUND_THROUGH_HOOKS),
        "--probe {spec} was not used as given:
{}",
        traced.stderr
    );
    expect_one_exec_store_per_statement(&traced, &format!("--probe {spec}"))?;

    // A file the backend does not map: refused with the reason, the trace goes on.
    let stranger = install.bin("psql");
    let output = Trace::pid(cluster.postmaster_pid()?)
        .explicit_probe(&format!("pgss_store={}:0x10", stranger.display()))
        .duration_secs(1)
        .output()?;
    ensure!(
        output.stderr.contains("probe pgss_store not attached") && output.stderr.contains("does not map"),
        "a location in a file the process does not map was not refused clearly:
{}",
        output.stderr
    );
    Ok(())
}

/// The distro build ships pg_stat_statements.so stripped and no debug file is installed here:
/// pgss_store is found through the hook functions and counts like on the source build, next to
/// another probe.
#[test]
fn distro_build_without_debug_file_finds_pgss_store_through_the_hooks() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let traced = trace_statements(&cluster, "pgss_store,PortalStart", None)?;
    offset_found_through_hooks(&traced.stderr)?;
    expect_one_exec_store_per_statement(&traced, "")?;
    if let Some(wrong) = traced.per_statement("PortalStart", 1)? {
        anyhow::bail!("simple-protocol statements: {wrong}");
    }
    Ok(())
}

/// auto_explain, loaded after pg_stat_statements, chains its ExecutorEnd hook in front of
/// pg_stat_statements': that hook variable points elsewhere and is skipped, the other three still
/// single out pgss_store.
#[test]
fn a_hook_chained_in_front_by_another_extension_is_skipped() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(
        &PgInstall::distro()?,
        &[("shared_preload_libraries", "pg_stat_statements,auto_explain")],
    )?;
    mapped_library(cluster.postmaster_pid()?, "auto_explain.so")?;
    let traced = trace_statements(&cluster, "pgss_store", None)?;
    offset_found_through_hooks(&traced.stderr)?;
    expect_one_exec_store_per_statement(&traced, "behind auto_explain")?;
    Ok(())
}

/// Without --debug-dir, a debuginfod server serving the source build's debug tree provides
/// pg_stat_statements' debug file: pgss_store is found by name, counts one exec store per
/// statement, and the file lands in the elfutils-style cache as `<build-id>/debuginfo`.
#[test]
fn debuginfod_provides_the_debug_file_pgss_store_is_found_by_name_in() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::no_frame_pointers()?;
    let debug_dir = debug_tree(&install)?;
    let server = DebuginfodServer::serve(debug_dir)?;
    let cluster = PgCluster::start_with_pg_stat_statements(&install, &[])?;
    let library = mapped_library(cluster.postmaster_pid()?, "pg_stat_statements.so")?;
    let build_id = build_id_hex(&library)?;
    let status = server.debuginfo_status(&build_id)?;
    ensure!(
        status == 200,
        "debuginfod answers HTTP {status} for pg_stat_statements.so ({build_id}); its log:\n{}",
        server.log()
    );

    let cache = tempfile::tempdir()?;
    let traced = trace_statements_with(&cluster, |trace| {
        trace
            .probes("pgss_store")
            .env("DEBUGINFOD_URLS", server.url())
            .env("DEBUGINFOD_CACHE_PATH", cache.path())
    })?;
    ensure!(
        !traced.stderr.contains(FOUND_THROUGH_HOOKS),
        "with the debug file from debuginfod pgss_store must be found by name:\n{}",
        traced.stderr
    );
    expect_one_exec_store_per_statement(&traced, "")?;

    let entry = cache.path().join(&build_id).join("debuginfo");
    let cached = std::fs::read(&entry).with_context(|| {
        format!(
            "no cache entry `{}`; debuginfod's log:\n{}",
            entry.display(),
            server.log()
        )
    })?;
    let served = std::fs::read(debug_file_in_tree(debug_dir, &build_id))?;
    ensure!(
        cached == served,
        "`{}` differs from the debug file the server has",
        entry.display()
    );
    let leftovers: Vec<_> = std::fs::read_dir(entry.parent().context("entry has a parent")?)?
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .filter(|name| name != "debuginfo")
        .collect();
    ensure!(
        leftovers.is_empty(),
        "temporary files left in the cache: {leftovers:?}"
    );
    eprintln!(
        "cache holds {} ({} bytes); debuginfod answered {} requests",
        entry.display(),
        cached.len(),
        server.log().matches(" GET /buildid/").count()
    );
    Ok(())
}

/// A debuginfod server that is down costs nothing but a warning: the trace still finds
/// pgss_store through the hook functions, counts the same, and nothing is cached.
#[test]
fn an_unreachable_debuginfod_falls_back_to_the_hook_functions() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::no_frame_pointers()?;
    let cluster = PgCluster::start_with_pg_stat_statements(&install, &[])?;
    // A port nothing listens on: bound, then released.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let url = format!("http://{closed}");
    let cache = tempfile::tempdir()?;
    let traced = trace_statements_with(&cluster, |trace| {
        trace
            .probes("pgss_store")
            .env("DEBUGINFOD_URLS", &url)
            .env("DEBUGINFOD_CACHE_PATH", cache.path())
    })?;
    offset_found_through_hooks(&traced.stderr)?;
    expect_one_exec_store_per_statement(&traced, "")?;
    ensure!(
        !traced.stderr.contains("panicked"),
        "pgscope panicked:\n{}",
        traced.stderr
    );
    // Told once, naming the server, not once per library.
    let warnings = traced.stderr.matches("no debug file from debuginfod").count();
    let gives_up = format!("not asking `{url}` again in this run");
    ensure!(
        warnings == 1 && traced.stderr.contains(&gives_up),
        "expected one warning ending with `{gives_up}`, got {warnings}:\n{}",
        traced.stderr
    );
    let cached: Vec<_> = std::fs::read_dir(cache.path())?.collect();
    ensure!(cached.is_empty(), "the cache is not empty: {cached:?}");
    Ok(())
}

/// On the distro build (library stripped, no debug file) the function the hook functions lead
/// to is named `pgss_store` in the stacks too, not `pg_stat_statements.so+0x…`: in
/// flamegraphs and Pyroscope that name is all a DBA sees.
#[test]
fn the_function_found_through_the_hooks_is_named_in_stacks() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.pgbench(&["-i", "-q", "-s", "1"])?;
    let _load = cluster.spawn_pgbench(&["-n", "-S", "-c", "2", "-j", "2", "-T", "60"], 2)?;
    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("stacks.folded");
    let output = Trace::instance(cluster.data_dir())
        .duration_secs(5)
        .frequency(499)
        .probes("pgss_store")
        .folded(&folded)
        .output()?;
    let offset = offset_found_through_hooks(&output.stderr)?;
    let profile = Profile::read_folded(&folded)?;
    let named = profile.count_where(|s| s.any_frame(|f| f == "pgss_store"));
    let unnamed_frame = format!("pg_stat_statements.so+0x{offset:x}");
    let unnamed = profile.count_where(|s| s.any_frame(|f| f == unnamed_frame));
    eprintln!(
        "{} samples: {named} under pgss_store, {unnamed} under {unnamed_frame}",
        profile.total()
    );
    ensure!(
        unnamed == 0,
        "{unnamed} samples still show pgss_store as `{unnamed_frame}`:\n{}",
        profile.examples_where(|s| s.any_frame(|f| f == unnamed_frame), 3)
    );
    // Every select stores its statistics: a few % of a read-only pgbench's CPU.
    ensure!(
        named >= 5,
        "only {named} of {} samples are under a frame named pgss_store",
        profile.total()
    );
    Ok(())
}
