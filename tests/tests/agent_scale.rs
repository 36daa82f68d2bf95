//! The agent at scale, for correctness (bench/scale.sh measures the cost): five instances on one
//! host, each with its own series in a real Pyroscope, one stopped and gone after its last
//! push; and a thousand connections opened and closed in waves, after which the agent's
//! process table is back at the baseline, its memory flat and no BPF map has filled.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use pgscope_tests::pyroscope_server::{now_ms, PyroscopeServer};
use pgscope_tests::{require_root_and_bpf, wait_for, BackgroundPgbench, PgCluster, PgInstall, RunningAgent};
use serde_json::json;

const INSTANCES: usize = 5;
const UPLOAD_SECS: i64 = 3;
/// How long any one awaited step may take: Pyroscope to show an instance's profiles, the
/// agent to let a stopped instance go. A bound, not a duration: each step ends when it holds.
const STEP_BOUND: Duration = Duration::from_secs(90);
const OK_PUSHES: &str = "pgscope_export_pushes_total{result=\"ok\"}";
/// pgbench's `-T`: a bound on the workloads, which the test stops once it has what it needs.
const WORKLOAD_BOUND: &str = "600";

/// A CPU-bound statement for pgbench `-f`, with no table to initialise.
const BUSY_SCRIPT: &str = "SELECT count(*) FROM generate_series(1, 20000) g WHERE g % 3 = 1;\n";

fn discovery(clusters: &[&PgCluster]) -> String {
    clusters
        .iter()
        .map(|c| {
            format!(
                "[[discovery.include]]\ndata_dir = \"{}\"\n",
                c.data_dir().display()
            )
        })
        .collect()
}

/// The merged process_cpu total (ns) of `service` between `start` and `end` (unix ms).
fn cpu_total(pyroscope: &PyroscopeServer, service: &str, start: i64, end: i64) -> Result<u64> {
    let answer = pyroscope.call(
        "SelectMergeStacktraces",
        json!({
            "profileTypeID": "process_cpu:cpu:nanoseconds:cpu:nanoseconds",
            "labelSelector": format!("{{service_name=\"{service}\"}}"),
            "start": start,
            "end": end,
        }),
    )?;
    Ok(answer["flamegraph"]["total"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0))
}

/// Series Pyroscope holds for `service` between `start` and `end`.
fn series_count(pyroscope: &PyroscopeServer, service: &str, start: i64, end: i64) -> Result<usize> {
    let answer = pyroscope.call(
        "Series",
        json!({"matchers": [format!("{{service_name=\"{service}\"}}")], "start": start, "end": end}),
    )?;
    Ok(answer["labelsSet"].as_array().map_or(0, Vec::len))
}

#[test]
fn five_instances_have_their_own_series_and_a_stopped_one_is_gone() -> Result<()> {
    require_root_and_bpf();
    let pyroscope = PyroscopeServer::get()?;
    let install = PgInstall::distro()?;
    let name = |i: usize| format!("five_{i}");
    let first = PgCluster::start_with(&install, &[("cluster_name", &name(0))])?;
    let mut others = Vec::new();
    for i in 1..INSTANCES - 1 {
        others.push(PgCluster::start_beside(
            &install,
            &[("cluster_name", &name(i))],
            &first,
        )?);
    }
    // The one stopped halfway.
    let last = PgCluster::start_beside(&install, &[("cluster_name", &name(INSTANCES - 1))], &first)?;
    let script = tempfile::NamedTempFile::new()?;
    std::fs::write(script.path(), BUSY_SCRIPT)?;
    let script_path = script.path().display().to_string();
    let run = format!("pgscope-five-{}-{}", std::process::id(), now_ms());
    let staying: Vec<&PgCluster> = std::iter::once(&first).chain(&others).collect();
    let all: Vec<&PgCluster> = staying.iter().copied().chain([&last]).collect();
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nfrequency = 49\nupload_interval = \"{UPLOAD_SECS}s\"\n\
         [labels]\nservice_name = \"{run}/{{instance}}\"\n{}",
        pyroscope.url(),
        discovery(&all)
    );
    let start = now_ms();
    let agent = RunningAgent::start(&config, &[])?;
    let args = ["-n", "-c", "1", "-f", &script_path, "-T", WORKLOAD_BOUND];
    let mut workloads = Vec::new();
    for cluster in &staying {
        workloads.push(cluster.spawn_pgbench(&args, 1)?);
    }
    let last_workload = last.spawn_pgbench(&args, 1)?;
    agent.wait_for_instances(INSTANCES)?;

    // Each instance is its own service, with its own `instance` label and CPU: awaited in
    // Pyroscope itself, which shows an instance once one of its pushes is stored.
    for i in 0..INSTANCES {
        let service = format!("{run}/{}", name(i));
        let mut end = now_ms() + 1000;
        let total = wait_for(&format!("CPU of {service} in Pyroscope"), STEP_BOUND, || {
            end = now_ms() + 1000;
            Ok(Some(cpu_total(&pyroscope, &service, start, end)?).filter(|t| *t > 0))
        })?;
        let instances =
            pyroscope.label_values("instance", &format!("{{service_name=\"{service}\"}}"), start, end)?;
        ensure!(
            instances == BTreeSet::from([name(i)]),
            "{service} is labelled with instances {instances:?}"
        );
        eprintln!(
            "{service}: {:.2} s of CPU, {} series",
            total as f64 / 1e9,
            series_count(&pyroscope, &service, start, end)?
        );
    }

    // The last instance stops: it leaves the agent's instances, and after its last push no
    // profile of it arrives while the others go on.
    let stopped = format!("{run}/{}", name(INSTANCES - 1));
    last_workload.stop()?;
    drop(last);
    agent.wait_metric(
        "pgscope_instances",
        "the agent to let the stopped instance go",
        STEP_BOUND,
        |n| n == (INSTANCES - 1) as f64,
    )?;
    // Its last profile ends when the agent let it go, before now. Profiles are stamped with
    // their interval, and the agent queues one interval's profiles of every instance together
    // and sends them in order: once the others' profiles of an interval that began two
    // intervals after `after_last_push` are stored, whatever the agent would have sent of the
    // stopped instance from then on (three intervals or more) is stored too.
    let after_last_push = now_ms() + 2 * UPLOAD_SECS * 1000;
    let checked_until = after_last_push + 2 * UPLOAD_SECS * 1000;
    for i in 0..INSTANCES - 1 {
        let service = format!("{run}/{}", name(i));
        wait_for(
            &format!("{service}'s profiles of intervals after {checked_until} (unix ms) in Pyroscope"),
            STEP_BOUND,
            || {
                let total = cpu_total(&pyroscope, &service, checked_until, now_ms() + 1000)?;
                Ok((total > 0).then_some(()))
            },
        )?;
    }
    let (_, metrics) = agent.get("/metrics")?;
    ensure!(
        !metrics.contains(&format!("instance=\"{}\"", name(INSTANCES - 1))),
        "the stopped instance is still in /metrics:\n{metrics}"
    );
    let since = cpu_total(&pyroscope, &stopped, after_last_push, now_ms() + 1000)?;
    ensure!(since == 0, "{stopped} has {since} ns of CPU after its last push");
    drop(workloads);
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "agent exit {status}:\n{log}");
    Ok(())
}

const CONNECTIONS: usize = 1000;
const WAVES: usize = 3;
/// Each connection runs its statement, then sleeps this long and runs it again: 200 statements
/// a second over the thousand, as long as the wave lasts.
const WAVE_SCRIPT: &str = "SELECT 1;\n\\sleep 5 s\n";
/// A wave ends once its connections are all open, tracked, have each run a statement and the
/// agent has pushed since. This bounds how long opening them may take; pgbench's `-T` is
/// twice as long, to outlast the steps after (its `-T` counts from before it connects).
const WAVE_BOUND: Duration = Duration::from_secs(300);
/// Connections open one after the other, a few milliseconds of CPU each: none opening for this
/// long means the wave is stuck, however busy the machine.
const STALL: Duration = Duration::from_secs(30);

/// Lets this process and its children (pgbench) open a thousand sockets and more.
fn raise_open_files() -> Result<()> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    ensure!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0,
        "getrlimit: {}",
        std::io::Error::last_os_error()
    );
    let wanted = 4 * CONNECTIONS as libc::rlim_t;
    limit.rlim_cur = limit.rlim_cur.max(wanted);
    limit.rlim_max = limit.rlim_max.max(limit.rlim_cur);
    // SAFETY: as above.
    ensure!(
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } == 0,
        "setrlimit: {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// The processes the agent tracks for its one instance.
fn tracked(agent: &RunningAgent) -> Result<f64> {
    let (_, body) = agent.get("/metrics")?;
    body.lines()
        .find(|l| l.starts_with("pgscope_instance_processes{"))
        .and_then(|l| l.rsplit_once(' '))
        .and_then(|(_, v)| v.parse().ok())
        .context("no pgscope_instance_processes in /metrics")
}

/// Waits until the agent tracks as many processes as the instance has, and returns the count.
fn settled(agent: &RunningAgent, cluster: &PgCluster) -> Result<f64> {
    let mut last = (0.0, 0.0);
    wait_for(
        "the agent to track the instance's processes",
        Duration::from_secs(60),
        || {
            last = (tracked(agent)?, cluster.process_pids()?.len() as f64);
            Ok((last.0 == last.1).then_some(last.1))
        },
    )
    .with_context(|| {
        format!(
            "the agent tracks {} processes, the instance has {}",
            last.0, last.1
        )
    })
}

/// The wave's connections in `pg_stat_activity`: (open, having run a statement).
fn wave_connections(cluster: &PgCluster, pgbench: &BackgroundPgbench) -> Result<(usize, usize)> {
    let row = cluster.psql(&format!(
        "SELECT count(*) || ' ' || count(*) FILTER (WHERE query <> '') FROM pg_stat_activity \
         WHERE application_name = '{}'",
        pgbench.tag()
    ))?;
    let parse = |n: Option<&str>| -> Result<usize> {
        n.and_then(|n| n.parse().ok())
            .with_context(|| format!("bad counts `{row}`"))
    };
    let mut fields = row.split_whitespace();
    Ok((parse(fields.next())?, parse(fields.next())?))
}

/// Waits until all the wave's connections are open, for as long as they keep opening: fails
/// when pgbench ended, when none opened for [`STALL`], or after [`WAVE_BOUND`], saying how
/// many were open.
fn await_all_open(cluster: &PgCluster, pgbench: &mut BackgroundPgbench) -> Result<()> {
    let begun = Instant::now();
    let (mut open, mut rose) = (0, Instant::now());
    loop {
        let (now_open, _) = wave_connections(cluster, pgbench)?;
        if now_open >= CONNECTIONS {
            return Ok(());
        }
        if now_open > open {
            (open, rose) = (now_open, Instant::now());
        }
        ensure!(
            pgbench.is_running()?,
            "pgbench ended with {now_open} of its {CONNECTIONS} connections open"
        );
        ensure!(
            rose.elapsed() < STALL,
            "{open} of {CONNECTIONS} connections open, and none opened for {STALL:?}"
        );
        ensure!(
            begun.elapsed() < WAVE_BOUND,
            "{open} of {CONNECTIONS} connections open after {WAVE_BOUND:?}, still opening"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn a_thousand_connections_come_and_go_and_the_agent_returns_to_its_baseline() -> Result<()> {
    require_root_and_bpf();
    raise_open_files()?;
    let pyroscope = PyroscopeServer::get()?;
    let cluster =
        PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[("max_connections", "1100")])?;
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nupload_interval = \"3s\"\n\
         [labels]\nservice_name = \"pgscope-thousand-{}-{}\"\n{}",
        pyroscope.url(),
        std::process::id(),
        now_ms(),
        discovery(&[&cluster])
    );
    let agent = RunningAgent::start(&config, &[])?;
    // After a push: the agent's own connection (pg_stat_statements' counters, query texts)
    // is among the processes then. An interval without samples sends nothing, so the idle
    // instance gets a statement to sample first.
    cluster.psql("SELECT count(*) FROM generate_series(1, 5000000)")?;
    agent.wait_metric(OK_PUSHES, "a first push", STEP_BOUND, |n| n >= 1.0)?;
    let baseline = settled(&agent, &cluster)?;
    let script = tempfile::NamedTempFile::new()?;
    std::fs::write(script.path(), WAVE_SCRIPT)?;
    let script_path = script.path().display().to_string();
    let clients = CONNECTIONS.to_string();
    let bound = (2 * WAVE_BOUND.as_secs()).to_string();
    let mut rss = Vec::new();
    let mut peak_tracked = 0.0_f64;
    for wave in 1..=WAVES {
        // A thousand connections at once, each running its statement now and then until the
        // wave has what it needs; then all closed.
        let args = ["-n", "-c", &clients, "-j", "2", "-f", &script_path, "-T", &bound];
        let begun = Instant::now();
        let mut pgbench = cluster.spawn_pgbench(&args, 1)?;
        await_all_open(&cluster, &mut pgbench)?;
        let opened = begun.elapsed();
        let mut now = 0.0;
        peak_tracked = peak_tracked.max(
            wait_for("the connections tracked", STEP_BOUND, || {
                now = tracked(&agent)?;
                Ok((now >= baseline + CONNECTIONS as f64).then_some(now))
            })
            .with_context(|| {
                format!("the agent tracks {now} processes, {baseline} before the wave's {CONNECTIONS}")
            })?,
        );
        // Every connection runs a statement (a backend's first loads its caches: the CPU the
        // agent samples), and the agent pushes after that: the state it keeps for a thousand
        // backends has been through an upload before they go.
        let mut ran = 0;
        wait_for("every connection to run a statement", STEP_BOUND, || {
            ensure!(pgbench.is_running()?, "pgbench ended during the wave");
            ran = wave_connections(&cluster, &pgbench)?.1;
            Ok((ran >= CONNECTIONS).then_some(()))
        })
        .with_context(|| format!("{ran} of {CONNECTIONS} connections ran a statement"))?;
        let pushes = agent.metric(OK_PUSHES)?;
        agent.wait_metric(
            OK_PUSHES,
            "a push with the wave's connections open",
            STEP_BOUND,
            |n| n > pushes,
        )?;
        ensure!(pgbench.is_running()?, "pgbench ended during the wave");
        pgbench.stop()?;
        let now = settled(&agent, &cluster)?;
        // An autovacuum worker may come and go meanwhile.
        ensure!(
            now <= baseline + 2.0,
            "{now} processes tracked after the wave, {baseline} before"
        );
        rss.push(agent.metric("process_resident_memory_bytes")?);
        eprintln!(
            "wave {wave}: {CONNECTIONS} connections came and went ({opened:.1?} to open them all, \
             {:.1?} the whole wave); agent RSS {:.1} MiB",
            begun.elapsed(),
            rss[wave - 1] / 1048576.0
        );
    }
    let (_, metrics) = agent.get("/metrics")?;
    let mut losses = Vec::new();
    for line in metrics
        .lines()
        .filter(|l| l.starts_with("pgscope_bpf_events_total{kind=\"lost_"))
    {
        if let Some((series, value)) = line.rsplit_once(' ') {
            if value.parse::<f64>().unwrap_or(0.0) > 0.0 {
                losses.push(format!("{series} {value}"));
            }
        }
    }
    ensure!(
        losses.is_empty(),
        "BPF losses with {CONNECTIONS} connections: {losses:?}"
    );
    let (early, late) = (rss[0], rss[WAVES - 1]);
    ensure!(
        late <= early * 1.25 + 8.0 * 1048576.0,
        "agent memory grew from {early} to {late} bytes over {WAVES} waves"
    );
    eprintln!(
        "tracked {baseline} processes at rest, {peak_tracked} at the peak, {baseline} after each wave; \
         RSS {:.1} MiB after the first wave, {:.1} MiB after the last",
        early / 1048576.0,
        late / 1048576.0
    );
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "agent exit {status}:\n{log}");
    Ok(())
}
