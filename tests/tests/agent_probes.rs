//! `pgscope agent` with function probes, on three instances side by side: two of Debian's
//! build (one executable: one set of uprobes shared by both) and one of the build without
//! frame pointers (its own uprobes). Each instance's PortalStart calls for pgbench's select,
//! as the agent ships them in the `pg_function_calls` profile, must match pg_stat_statements'
//! own count for that queryid; a probe attached twice to one file would double them. With the
//! budget off (every call measured) the count is exact; under the default budget the duty
//! cycle leaves the probes detached most of the time and the agent estimates the rest.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::pyroscope_capture::Series;
use pgscope_tests::{
    require_root_and_bpf, runs_under_exec_simple_query, wait_for, PgCluster, PgInstall, PyroscopeCapture,
    RunningAgent, Statics,
};

/// Every call measured: the same statements pg_stat_statements counts, but a few may fall
/// between the agent's last read and pgbench's end.
const EXACT: f64 = 0.02;
/// How long the agent may take to have sent everything measured until pgbench's end: an
/// upload interval, then a queue that a busy machine let grow.
const DELIVERY_BOUND: Duration = Duration::from_secs(120);

/// Under the default budget (2% of the instances' CPU; PortalStart's probe is then attached a
/// few percent of the time here, one short window every few seconds): what is measured while
/// attached plus an estimate for the rest, at the calls per statement measured while attached.
/// All three instances measured within 1.0% here (the lone one, with fewer windows, too).
const ESTIMATED: f64 = 0.05;

fn settings(name: &str) -> Vec<(&str, &str)> {
    vec![
        ("shared_preload_libraries", "pg_stat_statements"),
        ("cluster_name", name),
    ]
}

fn start(install: &PgInstall, name: &str, first: Option<&PgCluster>) -> Result<PgCluster> {
    let cluster = match first {
        None => PgCluster::start_with(install, &settings(name))?,
        Some(first) => PgCluster::start_beside(install, &settings(name), first)?,
    };
    cluster.psql("CREATE EXTENSION pg_stat_statements")?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    Ok(cluster)
}

/// Sum of a profile's values per (instance, function frame, queryid).
fn totals(series: &[Series], name: &str) -> BTreeMap<(String, String, String), i64> {
    let mut out = BTreeMap::new();
    for s in series.iter().filter(|s| s.label("__name__") == Some(name)) {
        let instance = s.label("instance").unwrap_or_default().to_string();
        let queryid = s.label("queryid").unwrap_or_default().to_string();
        for (frames, values) in s.stacks() {
            let function = frames.last().cloned().unwrap_or_default();
            *out.entry((instance.clone(), function, queryid.clone()))
                .or_insert(0) += values.first().copied().unwrap_or(0);
        }
    }
    out
}

#[test]
fn probes_count_every_call_per_instance_with_one_uprobe_per_executable() -> Result<()> {
    probes_per_instance("budget = 0.0", "8", EXACT)
}

#[test]
fn duty_cycled_probes_estimate_the_calls_they_did_not_see() -> Result<()> {
    probes_per_instance("", "20", ESTIMATED)
}

/// Three instances, two executables, PortalStart probed with `budget` (a `[probes]` line),
/// pgbench -S on each for `seconds`: each instance's shipped calls for pgbench's select must
/// be within `tolerance` of pg_stat_statements' count.
fn probes_per_instance(budget: &str, seconds: &str, tolerance: f64) -> Result<()> {
    require_root_and_bpf();
    let distro = PgInstall::distro()?;
    let nofp = PgInstall::no_frame_pointers()?;
    let a = start(&distro, "pgscope_a", None)?;
    let b = start(&distro, "pgscope_b", Some(&a))?;
    let c = start(&nofp, "pgscope_c", Some(&a))?;
    let clusters = [("pgscope_a", &a), ("pgscope_b", &b), ("pgscope_c", &c)];

    let capture = PyroscopeCapture::start()?;
    let mut config = format!(
        "[pyroscope]\nurl = \"{}\"\n\
         [collection]\nupload_interval = \"2s\"\nfrequency = 49\ndebug_dirs = [\"{}\"]\n\
         [probes]\nfunctions = [\"PortalStart\"]\n{budget}\n",
        capture.url(),
        nofp.debug_dir
            .as_ref()
            .context("the no-frame-pointer build has debug files")?
            .display()
    );
    for (_, cluster) in &clusters {
        config.push_str(&format!(
            "[[discovery.include]]\ndata_dir = \"{}\"\n",
            cluster.data_dir().display()
        ));
    }
    let agent = RunningAgent::start(&config, &[])?;
    agent.wait_for_instances(3)?;
    wait_for("the probes of both executables", Duration::from_secs(30), || {
        let (_, text) = agent.get("/metrics")?;
        let attached = text
            .lines()
            .filter(|l| l.starts_with("pgscope_probe_attached{") && l.contains("function=\"PortalStart\""))
            .count();
        Ok((attached == 2).then_some(()))
    })?;
    let log = agent.log();
    ensure!(
        log.matches("function probes attached").count() == 2,
        "one attachment per executable expected:\n{log}"
    );
    ensure!(
        log.contains("function probes shared with the instances of the same executable"),
        "the second distro instance should share the first one's probes:\n{log}"
    );

    for (_, cluster) in &clusters {
        cluster.psql("SELECT pg_stat_statements_reset()")?;
    }
    std::thread::scope(|scope| -> Result<()> {
        let runs: Vec<_> = clusters
            .iter()
            .map(|(_, cluster)| scope.spawn(|| cluster.pgbench(&["-S", "-c", "1", "-T", seconds])))
            .collect();
        for run in runs {
            run.join()
                .map_err(|_| anyhow::anyhow!("pgbench thread panicked"))??;
        }
        Ok(())
    })?;
    let hits = agent.metric("pgscope_probe_calls_total{function=\"PortalStart\"}")?;
    ensure!(hits > 0.0, "PortalStart was never hit");
    // Beside other work the sender fell 9 batches behind, which the stop's budget then lost.
    agent.await_delivered(DELIVERY_BOUND)?;
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "the agent exited with {status}:\n{log}");

    let series = capture.accepted_series()?;
    let calls = totals(&series, "pg_function_calls");
    let time = totals(&series, "pg_function_time");
    for (name, cluster) in &clusters {
        let queryid = cluster.pgbench_select_queryid()?;
        let exact: f64 = cluster
            .psql(&format!(
                "SELECT sum(calls) FROM pg_stat_statements WHERE queryid = {queryid}"
            ))?
            .trim()
            .parse()
            .context("pg_stat_statements' calls")?;
        let key = (name.to_string(), "PortalStart".to_string(), queryid.clone());
        let estimate = calls.get(&key).copied().unwrap_or(0) as f64;
        eprintln!(
            "{name}: PortalStart for queryid {queryid}: {estimate} shipped, {exact} in pg_stat_statements"
        );
        ensure!(exact > 1000.0, "{name}: pgbench ran only {exact} selects");
        ensure!(
            (estimate - exact).abs() <= tolerance * exact,
            "{name}: {estimate} PortalStart calls shipped for queryid {queryid}, pg_stat_statements counted {exact} \
             (more than {:.0}% apart); all shipped: {calls:?}",
            tolerance * 100.0
        );
        ensure!(
            time.get(&key).copied().unwrap_or(0) > 0,
            "{name}: no time in PortalStart shipped"
        );
        // Profiled side by side: each instance has its own on-CPU stacks through the simple
        // query protocol.
        let through = series
            .iter()
            .filter(|s| s.label("__name__") == Some("process_cpu") && s.label("instance") == Some(*name))
            .flat_map(|s| s.stacks())
            .filter(|(frames, _)| {
                runs_under_exec_simple_query(frames, Statics::Unnamed)
                    || runs_under_exec_simple_query(frames, Statics::Named)
            })
            .count();
        ensure!(through > 0, "{name}: no on-CPU stack through exec_simple_query");
    }
    Ok(())
}

/// The duty cycle attaches a probe again and again, long after it located the function through
/// the process it found first. Once the instance restarts, that process and its `/proc/PID/root`
/// path are gone: attaching through them failed for good (`cannot switch probe … No such file
/// or directory`), and the restarted instance's calls were never measured again. The agent
/// holds the probed file open and attaches through it.
#[test]
fn a_duty_cycled_probe_attaches_again_after_its_instance_restarts() -> Result<()> {
    require_root_and_bpf();
    let cluster = start(&PgInstall::distro()?, "pgscope_restarted", None)?;
    let capture = PyroscopeCapture::start()?;
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n\
         [collection]\nupload_interval = \"2s\"\nfrequency = 49\n\
         [probes]\nfunctions = [\"PortalStart\"]\n\
         [[discovery.include]]\ndata_dir = \"{}\"\n",
        capture.url(),
        cluster.data_dir().display()
    );
    let agent = RunningAgent::start(&config, &[])?;
    agent.wait_for_instances(1)?;
    let calls = "pgscope_probe_calls_total{function=\"PortalStart\"}";
    let select = ["-S", "-c", "1", "-T", "300"];

    let pgbench = cluster.spawn_pgbench(&select, 1)?;
    agent.wait_metric(
        calls,
        "PortalStart calls before the restart",
        Duration::from_secs(60),
        |n| n > 0.0,
    )?;
    pgbench.stop()?;
    let old_postmaster = cluster.postmaster_pid()?;
    cluster.restart()?;
    ensure!(
        cluster.postmaster_pid()? != old_postmaster,
        "the restart left the same postmaster ({old_postmaster})"
    );
    agent.wait_for_instances(1)?;
    // The old instance's calls reach /metrics at the agent's next reads: counted from after
    // them, every call is the restarted instance's.
    std::thread::sleep(Duration::from_secs(5));
    let before = agent.metric(calls)?;

    // Under the default budget the probe is detached most of the time: measured calls of the
    // restarted instance mean the duty cycle attached it again since.
    let pgbench = cluster.spawn_pgbench(&select, 1)?;
    let after = agent.wait_metric(
        calls,
        "PortalStart calls measured in the restarted instance",
        Duration::from_secs(90),
        |n| n > before,
    )?;
    pgbench.stop()?;
    let (status, log) = agent.terminate()?;
    eprintln!("PortalStart calls measured: {before} before the restart, {after} in all");
    ensure!(status.success(), "the agent exited with {status}:\n{log}");
    ensure!(
        !log.contains("cannot switch probe"),
        "the duty cycle failed to switch a probe:\n{log}"
    );
    Ok(())
}
