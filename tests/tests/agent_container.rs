//! A Postgres in its own mount and PID namespaces, from a root the host does not share, in a
//! containerd-named cgroup: the agent on the "node" profiles it through /proc/PID/root and
//! labels it with its container ID and its PID inside the namespace.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::container_pg::{NamespacedPostgres, CONTAINER_ID};
use pgscope_tests::{require_root_and_bpf, wait_for, PgInstall, PyroscopeCapture, RunningAgent};

#[test]
fn a_postgres_in_its_own_namespaces_is_profiled_and_labelled_with_its_container() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::no_frame_pointers()?;
    let debug_dir = install.debug_dir.clone().context("debug files")?;
    let postgres = NamespacedPostgres::start(&install)?;
    let port = postgres.port().to_string();
    let pgbench = |args: &[&str]| postgres.pgbench(&install, args);
    ensure!(
        pgbench(&["-i", "-s", "1", "-q"]).output()?.status.success(),
        "pgbench -i failed"
    );
    // The binary the postmaster runs exists only inside its root.
    ensure!(
        !std::path::Path::new("/opt/pg/bin/postgres").exists(),
        "the host has /opt/pg: the test proves nothing"
    );

    let capture = PyroscopeCapture::start()?;
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nupload_interval = \"2s\"\nfrequency = 49\ndebug_dirs = [\"{}\"]\n\
         [labels]\npid = true\n[[discovery.include]]\nport = {port}\n",
        capture.url(),
        debug_dir.display()
    );
    let agent = RunningAgent::start(&config, &[])?;
    let mut load = pgbench(&["-S", "-c", "2", "-j", "2", "-T", "60"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let series = wait_for(
        "samples labelled with the container",
        Duration::from_secs(60),
        || {
            let series = capture.accepted_series()?;
            let mine: Vec<_> = series
                .into_iter()
                .filter(|s| {
                    s.label("__name__") == Some("process_cpu")
                        && s.label("container_id") == Some(CONTAINER_ID)
                })
                .collect();
            let with_queries = mine.iter().any(|s| s.label("queryid").is_some_and(|q| q != "0"));
            Ok((with_queries).then_some(mine))
        },
    )
    .with_context(|| format!("agent log:\n{}\npostgres log:\n{}", agent.log(), postgres.log()))?;
    let _ = load.kill();
    let _ = load.wait();
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "agent exit {status}:\n{log}");

    let first = &series[0];
    ensure!(
        first.label("container_pid") == Some("1"),
        "labels {:?}",
        first.labels
    );
    ensure!(
        first.label("instance") == Some(&format!("{}:{port}", &CONTAINER_ID[..12])),
        "instance label {:?}",
        first.label("instance")
    );
    let host_pids: Vec<&str> = series.iter().filter_map(|s| s.label("pid")).collect();
    ensure!(
        !host_pids.contains(&"1"),
        "pid labels are host PIDs (postmaster {}), not namespace ones: {host_pids:?}",
        postgres.postmaster_pid()
    );
    // Named through /proc/PID/root and the debug file found by build-id.
    let stacks: Vec<Vec<String>> = series
        .iter()
        .flat_map(|s| s.stacks())
        .map(|(frames, _)| frames)
        .collect();
    ensure!(
        stacks
            .iter()
            .any(|frames| frames.iter().any(|f| f == "exec_simple_query")
                && frames.iter().any(|f| f == "PortalRun")),
        "no stack through exec_simple_query in {} stacks",
        stacks.len()
    );
    eprintln!(
        "container labels: container_id={CONTAINER_ID} container_pid=1 instance={} (host postmaster PID {})",
        first.label("instance").unwrap_or_default(),
        postgres.postmaster_pid()
    );
    Ok(())
}
