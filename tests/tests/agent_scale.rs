//! The agent at scale, for correctness (bench/scale.sh measures the cost): five instances on one
//! host, each with its own series in a real Pyroscope, one stopped and gone after its last
//! push; and a thousand connections opened and closed in waves, after which the agent's
//! process table is back at the baseline, its memory flat and no BPF map has filled.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::pyroscope_server::{now_ms, PyroscopeServer};
use pgscope_tests::{require_root_and_bpf, wait_for, PgCluster, PgInstall, RunningAgent};
use serde_json::json;

const INSTANCES: usize = 5;
const UPLOAD_SECS: i64 = 3;

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
    let args = ["-n", "-c", "1", "-f", &script_path, "-T", "300"];
    let mut workloads = Vec::new();
    for cluster in &staying {
        workloads.push(cluster.spawn_pgbench(&args, 1)?);
    }
    let last_workload = last.spawn_pgbench(&args, 1)?;
    agent.wait_for_instances(INSTANCES)?;
    agent.wait_metric(
        "pgscope_export_pushes_total{result=\"ok\"}",
        "pushes of every instance",
        Duration::from_secs(60),
        |pushes| pushes >= 4.0 * INSTANCES as f64,
    )?;

    // Each instance is its own service, with its own `instance` label and CPU.
    let end = now_ms() + 1000;
    for i in 0..INSTANCES {
        let service = format!("{run}/{}", name(i));
        let total = wait_for(
            &format!("CPU of {service} in Pyroscope"),
            Duration::from_secs(30),
            || Ok(Some(cpu_total(&pyroscope, &service, start, end)?).filter(|t| *t > 0)),
        )?;
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
        Duration::from_secs(30),
        |n| n == (INSTANCES - 1) as f64,
    )?;
    let after_last_push = now_ms() + 2 * UPLOAD_SECS * 1000;
    let pushes = agent.metric("pgscope_export_pushes_total{result=\"ok\"}")?;
    agent.wait_metric(
        "pgscope_export_pushes_total{result=\"ok\"}",
        "pushes after the instance stopped",
        Duration::from_secs(60),
        |n| n >= pushes + 4.0 * (INSTANCES - 1) as f64 && now_ms() > after_last_push + 2 * UPLOAD_SECS * 1000,
    )?;
    let (_, metrics) = agent.get("/metrics")?;
    ensure!(
        !metrics.contains(&format!("instance=\"{}\"", name(INSTANCES - 1))),
        "the stopped instance is still in /metrics:\n{metrics}"
    );
    // The others' profiles since then are there (queried until Pyroscope shows them), and
    // none of the stopped one's.
    for i in 0..INSTANCES - 1 {
        let service = format!("{run}/{}", name(i));
        wait_for(
            &format!("{service}'s profiles since the other stopped"),
            Duration::from_secs(30),
            || {
                let total = cpu_total(&pyroscope, &service, after_last_push, now_ms() + 1000)?;
                Ok((total > 0).then_some(()))
            },
        )?;
    }
    let since = cpu_total(&pyroscope, &stopped, after_last_push, now_ms() + 1000)?;
    ensure!(since == 0, "{stopped} has {since} ns of CPU after its last push");
    drop(workloads);
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "agent exit {status}:\n{log}");
    Ok(())
}

const CONNECTIONS: usize = 1000;
const WAVES: usize = 3;
const WAVE_SECS: u32 = 15;

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
    wait_for(
        "the agent to track the instance's processes",
        Duration::from_secs(30),
        || {
            let processes = cluster.process_pids()?.len() as f64;
            Ok((tracked(agent)? == processes).then_some(processes))
        },
    )
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
    agent.wait_metric(
        "pgscope_export_pushes_total{result=\"ok\"}",
        "a first push",
        Duration::from_secs(60),
        |n| n >= 1.0,
    )?;
    let baseline = settled(&agent, &cluster)?;
    let script = tempfile::NamedTempFile::new()?;
    std::fs::write(script.path(), "SELECT 1;\n")?;
    let script_path = script.path().display().to_string();
    let clients = CONNECTIONS.to_string();
    let secs = WAVE_SECS.to_string();
    let mut rss = Vec::new();
    let mut peak_tracked = 0.0_f64;
    for wave in 1..=WAVES {
        // A thousand connections at once, each running a statement now and then (200 a second
        // over all of them), for the wave's length; then all closed.
        let args = [
            "-n",
            "-c",
            &clients,
            "-j",
            "2",
            "-R",
            "200",
            "-f",
            &script_path,
            "-T",
            &secs,
        ];
        let mut pgbench = cluster.spawn_pgbench(&args, CONNECTIONS)?;
        peak_tracked = peak_tracked.max(wait_for(
            "the connections tracked",
            Duration::from_secs(30),
            || {
                let now = tracked(&agent)?;
                Ok((now >= baseline + CONNECTIONS as f64).then_some(now))
            },
        )?);
        wait_for(
            "the wave to end",
            Duration::from_secs(WAVE_SECS as u64 + 60),
            || Ok((!pgbench.is_running()?).then_some(())),
        )?;
        pgbench.stop()?;
        let now = settled(&agent, &cluster)?;
        // An autovacuum worker may come and go meanwhile.
        ensure!(
            now <= baseline + 2.0,
            "{now} processes tracked after the wave, {baseline} before"
        );
        rss.push(agent.metric("process_resident_memory_bytes")?);
        eprintln!(
            "wave {wave}: {CONNECTIONS} connections came and went; agent RSS {:.1} MiB",
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
