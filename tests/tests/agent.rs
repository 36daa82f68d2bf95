//! `pgscope agent` end to end against a real Postgres under pgbench, shipping to a push endpoint
//! that decodes every request with Pyroscope's published protobuf types: series and labels,
//! queryids as pg_stat_statements has them, on-CPU and off-CPU profiles, an outage of the
//! endpoint, a Postgres restart, connection churn, and bad configurations.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use pgscope_tests::pyroscope_capture::Series;
use pgscope_tests::{
    require_root_and_bpf, runs_under_exec_simple_query, wait_for, PgCluster, PgInstall, PyroscopeCapture,
    RunningAgent, Statics,
};

/// A config that profiles only `cluster` (other Postgres instances on the machine stay out),
/// uploads every 2 s, and sends to `url`.
fn config_for(cluster: &PgCluster, url: &str, extra: &str) -> String {
    format!(
        "[pyroscope]\nurl = \"{url}\"\n\
         [collection]\nupload_interval = \"2s\"\nfrequency = 49\n{extra}\n\
         [[discovery.include]]\ndata_dir = \"{}\"\n",
        cluster.data_dir().display()
    )
}

fn named<'a>(series: &'a [Series], name: &str) -> Vec<&'a Series> {
    series
        .iter()
        .filter(|s| s.label("__name__") == Some(name))
        .collect()
}

fn label_values(series: &[&Series], label: &str) -> BTreeSet<String> {
    series
        .iter()
        .filter_map(|s| s.label(label).map(str::to_string))
        .collect()
}

#[test]
fn profiles_reach_pyroscope_per_query_on_and_off_cpu() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    let capture = PyroscopeCapture::start()?;
    let agent = RunningAgent::start(
        &config_for(
            &cluster,
            &capture.url(),
            "off_cpu = true\n[labels]\nstatic = { env = \"test\" }",
        ),
        &[],
    )?;
    let pgbench = cluster.spawn_pgbench(&["-S", "-c", "2", "-j", "2", "-T", "60"], 2)?;
    agent.wait_metric(
        "pgscope_export_pushes_total{result=\"ok\"}",
        "three successful pushes",
        Duration::from_secs(60),
        |pushes| pushes >= 3.0,
    )?;
    ensure!(agent.metric("pgscope_instances")? == 1.0, "one instance expected");
    ensure!(agent.metric("pgscope_off_cpu_enabled")? == 1.0);
    ensure!(agent.metric("process_resident_memory_bytes")? > 0.0);
    pgbench.stop()?;
    let (status, log) = agent.terminate()?;
    ensure!(
        status.success(),
        "the agent exited with {status} on SIGTERM:\n{log}"
    );
    ensure!(log.contains("stopped"), "no clean stop in the log:\n{log}");

    let requests = capture.requests();
    ensure!(!requests.is_empty(), "nothing was pushed");
    for request in &requests {
        ensure!(request.method == "POST");
        ensure!(
            request.headers.get("content-type").map(String::as_str) == Some("application/proto"),
            "push without Content-Type application/proto: {:?}",
            request.headers
        );
    }
    let series = capture.accepted_series()?;
    let cpu = named(&series, "process_cpu");
    let off_cpu = named(&series, "offcpu");
    ensure!(!cpu.is_empty(), "no process_cpu series");
    ensure!(!off_cpu.is_empty(), "no offcpu series");

    let queryid = cluster.pgbench_select_queryid()?;
    let queryids = label_values(&cpu, "queryid");
    ensure!(
        queryids.contains(&queryid),
        "queryid {queryid} of pgbench's select is not among the queryid label values {queryids:?}"
    );
    // The one query's stacks run through the simple-query protocol (pgbench's default);
    // exec_simple_query is static, unnamed in the stripped distro build.
    let of_query: Vec<&Series> = cpu
        .iter()
        .copied()
        .filter(|s| s.label("queryid") == Some(queryid.as_str()))
        .collect();
    let through_simple_query = of_query
        .iter()
        .flat_map(|s| s.stacks())
        .filter(|(frames, _)| runs_under_exec_simple_query(frames, Statics::Unnamed))
        .count();
    ensure!(
        through_simple_query > 0,
        "no stack of queryid {queryid} runs through exec_simple_query"
    );

    for series in &cpu {
        ensure!(
            series
                .label("service_name")
                .is_some_and(|s| s.starts_with("postgres/")),
            "service_name: {:?}",
            series.labels
        );
        ensure!(
            series.label("instance").is_some(),
            "no instance label: {:?}",
            series.labels
        );
        ensure!(
            series.label("env") == Some("test"),
            "static label missing: {:?}",
            series.labels
        );
        ensure!(
            series.label("pid").is_none(),
            "pid is off by default: {:?}",
            series.labels
        );
        for profile in &series.profiles {
            let string = |i: i64| profile.string_table[i as usize].clone();
            let types: Vec<(String, String)> = profile
                .sample_type
                .iter()
                .map(|t| (string(t.r#type), string(t.unit)))
                .collect();
            ensure!(
                types.contains(&("cpu".to_string(), "nanoseconds".to_string())),
                "sample types {types:?}"
            );
            ensure!(profile.period == 1_000_000_000 / 49, "period {}", profile.period);
            ensure!(
                profile.sample.iter().all(|s| s.label.is_empty()),
                "sample labels left in the pprof"
            );
            ensure!(profile.time_nanos > 0 && profile.duration_nanos > 0);
        }
    }
    let backend_types = label_values(&cpu, "backend_type");
    ensure!(
        backend_types.contains("client backend"),
        "backend types {backend_types:?}"
    );
    for series in &off_cpu {
        for profile in &series.profiles {
            let unit = profile
                .sample_type
                .iter()
                .map(|t| profile.string_table[t.unit as usize].clone())
                .collect::<Vec<_>>();
            ensure!(unit.contains(&"nanoseconds".to_string()), "offcpu units {unit:?}");
        }
    }
    Ok(())
}

/// Pyroscope down for 60 s: sampling goes on, the queue holds the profiles and delivers them
/// once it is back; the intervals received then cover the whole run without a gap.
/// Batches queued in the Pyroscope outage: enough to show a queue, not just a retry.
const OUTAGE_BATCHES: f64 = 10.0;

/// Now, in nanoseconds since the Unix epoch: the clock of a pushed profile's `time_nanos`.
fn unix_nanos() -> Result<i64> {
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    Ok(i64::try_from(since_epoch.as_nanos())?)
}

#[test]
fn an_outage_of_pyroscope_loses_nothing_that_fits_the_queue() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    let capture = PyroscopeCapture::start()?;
    let port = capture.port();
    let agent = RunningAgent::start(&config_for(&cluster, &capture.url(), ""), &[])?;
    let pgbench = cluster.spawn_pgbench(&["-S", "-c", "2", "-j", "2", "-T", "150"], 2)?;
    agent.wait_metric(
        "pgscope_export_pushes_total{result=\"ok\"}",
        "a first successful push",
        Duration::from_secs(60),
        |pushes| pushes >= 1.0,
    )?;
    let before = capture.stop();
    let outage_start = unix_nanos()?;
    // An outage as long as OUTAGE_BATCHES take to queue, however long the machine takes.
    let queued = agent.wait_metric(
        "pgscope_export_queue_batches",
        &format!("{OUTAGE_BATCHES} batches queued during the outage"),
        Duration::from_secs(120),
        |queued| queued >= OUTAGE_BATCHES,
    )?;
    let failed = agent.metric("pgscope_export_pushes_total{result=\"retryable_error\"}")?;
    let samples_during = agent.metric("pgscope_bpf_events_total{kind=\"samples\"}")?;
    ensure!(failed >= 1.0, "no failed push counted during the outage");
    let outage_end = unix_nanos()?;
    let capture = PyroscopeCapture::start_on(port)?;
    agent.wait_metric(
        "pgscope_export_queue_batches",
        "the queue to drain after the outage",
        Duration::from_secs(120),
        |depth| depth <= 1.0,
    )?;
    ensure!(
        agent.metric("pgscope_bpf_events_total{kind=\"samples\"}")? > samples_during,
        "sampling stopped"
    );
    ensure!(
        agent.metric("pgscope_export_dropped_batches_total{reason=\"queue_full\"}")? == 0.0,
        "batches dropped although the queue had room"
    );
    pgbench.stop()?;
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "exit {status}:\n{log}");

    // Every interval's process_cpu profile, before and after the outage, in one timeline.
    let mut intervals: Vec<(i64, i64)> = Vec::new();
    for request in before
        .iter()
        .chain(capture.requests().iter())
        .filter(|r| r.status == 200)
    {
        for series in pgscope_tests::pyroscope_capture::decode_push(request)? {
            if series.label("__name__") == Some("process_cpu") {
                intervals.extend(series.profiles.iter().map(|p| (p.time_nanos, p.duration_nanos)));
            }
        }
    }
    intervals.sort();
    intervals.dedup();
    // A timeline from before the outage to after it.
    let (Some(first), Some(last)) = (intervals.first(), intervals.last()) else {
        bail!("no process_cpu interval arrived");
    };
    ensure!(
        first.0 <= outage_start && last.0 + last.1 >= outage_end,
        "the {} intervals delivered run from {} to {} ns, not across the outage from {outage_start} \
         to {outage_end} ns ({queued} batches queued in it)",
        intervals.len(),
        first.0,
        last.0 + last.1
    );
    for pair in intervals.windows(2) {
        let (start, duration) = pair[0];
        ensure!(
            pair[1].0 == start + duration,
            "gap in the delivered timeline: interval {pair:?} does not continue the previous one"
        );
    }
    Ok(())
}

/// A restarted Postgres (new postmaster, new backends) is found and profiled without touching
/// the agent.
#[test]
fn a_restarted_instance_is_profiled_again() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    let capture = PyroscopeCapture::start()?;
    let agent = RunningAgent::start(&config_for(&cluster, &capture.url(), "[labels]\npid = true"), &[])?;
    let old_postmaster = cluster.postmaster_pid()?;
    cluster.restart()?;
    let new_postmaster = cluster.postmaster_pid()?;
    ensure!(new_postmaster != old_postmaster, "the postmaster did not change");
    wait_for(
        "the agent to attach the new postmaster",
        Duration::from_secs(30),
        || {
            Ok(agent
                .log()
                .contains(&format!("postmaster={new_postmaster}"))
                .then_some(()))
        },
    )
    .with_context(|| agent.log())?;
    let pgbench = cluster.spawn_pgbench(&["-S", "-c", "2", "-j", "2", "-T", "60"], 2)?;
    let backends: BTreeSet<String> = cluster
        .process_pids()?
        .into_iter()
        .map(|pid| pid.to_string())
        .collect();
    wait_for(
        "samples of the new instance's backends",
        Duration::from_secs(60),
        || {
            let series = capture.accepted_series()?;
            let pids = label_values(&named(&series, "process_cpu"), "pid");
            Ok((pids.intersection(&backends).count() > 0).then_some(()))
        },
    )
    .with_context(|| agent.log())?;
    ensure!(
        agent.metric("pgscope_instances")? == 1.0,
        "the old instance is still tracked"
    );
    pgbench.stop()?;
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "exit {status}:\n{log}");
    Ok(())
}

/// Forks followed before the agent's memory is first read: its tables and caches warm.
const CHURN_FORKS_EARLY: f64 = 2000.0;
/// Forks followed by the end: three times as many connections as at the first reading.
const CHURN_FORKS_LATE: f64 = 6000.0;
/// Bound on each count: a machine that makes 2000 connections in two minutes is very slow.
const CHURN_TIMEOUT: Duration = Duration::from_secs(120);

/// `pgbench -C` (a new backend per transaction) until the agent has followed
/// [`CHURN_FORKS_LATE`] forks: the backends tracked follow the instance, the agent's memory
/// stays flat between [`CHURN_FORKS_EARLY`] and the end, and the kernel-side process table does
/// not fill. Counted in forks, not seconds: the churn a slow or busy machine makes in a minute
/// is a fraction of a quiet one's.
#[test]
fn connection_churn_keeps_tracking_and_memory_flat() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    let capture = PyroscopeCapture::start()?;
    let agent = RunningAgent::start(&config_for(&cluster, &capture.url(), "off_cpu = true"), &[])?;
    // Longer than the test: stopped once the forks are counted.
    let pgbench = cluster.spawn_pgbench(&["-S", "-C", "-c", "2", "-j", "2", "-T", "600"], 0)?;
    let forks_metric = "pgscope_bpf_events_total{kind=\"forks_followed\"}";
    agent.wait_metric(forks_metric, "the first forks followed", CHURN_TIMEOUT, |forks| {
        forks >= CHURN_FORKS_EARLY
    })?;
    let rss_early = agent.metric("process_resident_memory_bytes")?;
    let forks = agent.wait_metric(forks_metric, "the later forks followed", CHURN_TIMEOUT, |forks| {
        forks >= CHURN_FORKS_LATE
    })?;
    let rss_late = agent.metric("process_resident_memory_bytes")?;
    pgbench.stop()?;
    ensure!(
        agent.metric("pgscope_bpf_events_total{kind=\"lost_targets_full\"}")? == 0.0,
        "the target map filled up"
    );
    ensure!(
        agent.metric("pgscope_bpf_events_total{kind=\"lost_off_cpu_map_full\"}")? == 0.0,
        "the off-CPU maps filled up"
    );
    let processes = cluster.process_pids()?.len() as f64;
    let instance_label = wait_for("tracked processes to settle", Duration::from_secs(20), || {
        let (_, body) = agent.get("/metrics")?;
        let line = body
            .lines()
            .find(|l| l.starts_with("pgscope_instance_processes{"))
            .map(str::to_string);
        Ok(line.filter(|l| {
            l.rsplit_once(' ')
                .and_then(|(_, v)| v.parse::<f64>().ok())
                .is_some_and(|tracked| tracked == processes)
        }))
    })?;
    eprintln!(
        "churn: {forks} forks followed; RSS {:.1} MiB after {CHURN_FORKS_EARLY} forks, {:.1} MiB \
         after {forks}; {instance_label} ({processes} processes now)",
        rss_early / 1048576.0,
        rss_late / 1048576.0
    );
    ensure!(
        rss_late <= rss_early * 1.25 + 8.0 * 1048576.0,
        "agent memory grew from {rss_early} to {rss_late} bytes under churn"
    );
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "exit {status}:\n{log}");
    Ok(())
}

/// Wrong credentials: the agent says so in its log and counts the rejected pushes, and keeps
/// profiling.
#[test]
fn rejected_credentials_are_reported_and_counted() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let capture = PyroscopeCapture::start()?;
    capture.answer_with(401);
    let config = format!(
        "{}\n",
        config_for(&cluster, &capture.url(), "").replace(
            "[collection]",
            "basic_auth_user = \"u\"\nbasic_auth_password = \"wrong\"\n[collection]"
        )
    );
    let agent = RunningAgent::start(&config, &[])?;
    cluster.psql("SELECT count(*) FROM generate_series(1, 3000000)")?;
    agent.wait_metric(
        "pgscope_export_dropped_batches_total{reason=\"rejected\"}",
        "a rejected batch",
        Duration::from_secs(60),
        |n| n >= 1.0,
    )?;
    let basic = capture
        .requests()
        .first()
        .and_then(|r| r.headers.get("authorization").cloned())
        .unwrap_or_default();
    ensure!(basic.starts_with("Basic "), "no basic auth header: `{basic}`");
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "exit {status}:\n{log}");
    ensure!(
        log.to_lowercase().contains("auth"),
        "the log does not point at authentication:\n{log}"
    );
    Ok(())
}

/// Configuration mistakes stop the agent before it touches anything: exit code 2 and a
/// message naming the key; `--check-config` says whether a file is valid.
#[test]
fn bad_configurations_exit_2_naming_the_key() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cases = [
        ("[collection]\nfrequncy = 19\n", "frequncy"),
        ("[pyroscope]\nurl = \"pyroscope:4040\"\n", "pyroscope.url"),
        ("[collection]\nupload_interval = \"soon\"\n", "upload_interval"),
        (
            "[pyroscope]\nurl = \"http://p:4040\"\nbasic_auth_user = \"u\"\n",
            "basic_auth_password",
        ),
        (
            "[pyroscope]\nurl = \"http://p:4040\"\n[labels]\nstatic = { \"bad-name\" = \"x\" }\n",
            "bad-name",
        ),
        ("", "pyroscope.url is not set"),
    ];
    for (index, (text, expected)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("bad{index}.toml"));
        std::fs::write(&path, text)?;
        let output = pgscope_tests::pgscope::run_pgscope([
            "agent",
            "--check-config",
            "--config",
            path.to_str().context("path")?,
        ])?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(
            output.status.code() == Some(2),
            "{text:?}: exit {:?}, stderr {stderr}",
            output.status
        );
        ensure!(
            stderr.contains(expected),
            "{text:?}: the error does not name `{expected}`: {stderr}"
        );
    }
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "[pyroscope]\nurl = \"http://p:4040\"\nbearer_token = \"secret-token\"\n",
    )?;
    let output = pgscope_tests::pgscope::run_pgscope([
        "agent",
        "--check-config",
        "--config",
        good.to_str().context("path")?,
    ])?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "valid config refused: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(
        stdout.contains("configuration is valid") && stdout.contains("19 Hz"),
        "{stdout}"
    );
    ensure!(
        !stdout.contains("secret-token"),
        "--check-config prints the token: {stdout}"
    );
    // A missing file is named.
    let output = pgscope_tests::pgscope::run_pgscope(["agent", "--config", "/nonexistent/agent.toml"])?;
    ensure!(output.status.code() == Some(2));
    ensure!(String::from_utf8_lossy(&output.stderr).contains("/nonexistent/agent.toml"));
    Ok(())
}

/// SIGHUP reloads the configuration without a restart: series sent after it carry the new
/// static label, nothing queued is lost, and a broken file keeps the old configuration.
#[test]
fn sighup_reloads_the_configuration() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    let capture = PyroscopeCapture::start()?;
    let config = config_for(
        &cluster,
        &capture.url(),
        "[labels]\nstatic = { stage = \"before\" }",
    );
    let agent = RunningAgent::start(&config, &[])?;
    let pgbench = cluster.spawn_pgbench(&["-S", "-c", "2", "-j", "2", "-T", "60"], 2)?;
    let stage_seen = |stage: &str| -> Result<bool> {
        Ok(capture
            .accepted_series()?
            .iter()
            .any(|s| s.label("stage") == Some(stage)))
    };
    wait_for("series labelled stage=before", Duration::from_secs(30), || {
        Ok(stage_seen("before")?.then_some(()))
    })?;
    std::fs::write(
        agent.config_path(),
        "[collection]\nfrequency = \"not a number\"\n",
    )?;
    agent.signal(libc::SIGHUP);
    agent.wait_metric(
        "pgscope_config_reloads_total{result=\"failed\"}",
        "the broken file to be refused",
        Duration::from_secs(10),
        |n| n == 1.0,
    )?;
    std::fs::write(agent.config_path(), config.replace("\"before\"", "\"after\""))?;
    agent.signal(libc::SIGHUP);
    agent.wait_metric(
        "pgscope_config_reloads_total{result=\"ok\"}",
        "the reload",
        Duration::from_secs(10),
        |n| n == 1.0,
    )?;
    wait_for("series labelled stage=after", Duration::from_secs(30), || {
        Ok(stage_seen("after")?.then_some(()))
    })?;
    pgbench.stop()?;
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "exit {status}:\n{log}");
    ensure!(
        log.contains("configuration not reloaded"),
        "the refusal is not logged:\n{log}"
    );
    Ok(())
}
