//! End to end with a real Grafana Pyroscope: Postgres (the no-frame-pointer build, with its
//! debug files) under pgbench, `pgscope agent`, and Pyroscope queried back through its own
//! querier API (Connect JSON), as Grafana does. The server is the one
//! `PGSCOPE_TEST_PYROSCOPE_URL` points at, else one built from the Go module proxy by
//! `scripts/pyroscope-server.sh` and started for the test.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context, Result};
use pgscope_tests::{require_root_and_bpf, wait_for, workspace_root, PgCluster, PgInstall, RunningAgent};
use serde_json::{json, Value};

/// A Pyroscope to send to and query.
struct Pyroscope {
    url: String,
    /// The server started for this test (killed at the end) and its data directory.
    owned: Option<(u32, tempfile::TempDir)>,
}

impl Pyroscope {
    fn get() -> Result<Self> {
        if let Ok(url) = std::env::var("PGSCOPE_TEST_PYROSCOPE_URL") {
            return Ok(Self {
                url: url.trim_end_matches('/').to_string(),
                owned: None,
            });
        }
        let dir = tempfile::Builder::new().prefix("pgscope-pyroscope-").tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let script = workspace_root().join("scripts/pyroscope-server.sh");
        let output = Command::new(&script)
            .arg("start")
            .arg(port.to_string())
            .arg(dir.path())
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        if !output.status.success() {
            bail!(
                "cannot start Pyroscope ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let pid: u32 = String::from_utf8_lossy(&output.stdout).trim().parse()?;
        Ok(Self {
            url: format!("http://127.0.0.1:{port}"),
            owned: Some((pid, dir)),
        })
    }

    /// One Connect unary call with a JSON body.
    fn call(&self, method: &str, body: Value) -> Result<Value> {
        let url = format!("{}/querier.v1.QuerierService/{method}", self.url);
        let mut response = ureq::post(&url)
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .with_context(|| format!("POST {url}"))?;
        let text = response.body_mut().read_to_string()?;
        serde_json::from_str(&text).with_context(|| format!("{method} answered `{text}`"))
    }
}

impl Drop for Pyroscope {
    fn drop(&mut self) {
        if let Some((pid, dir)) = &self.owned {
            if std::thread::panicking() {
                let log = std::fs::read_to_string(dir.path().join("pyroscope.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                eprintln!(
                    "--- Pyroscope log tail ---\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            // SAFETY: kill(2) on the server this test started.
            unsafe { libc::kill(*pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The function names of a merged flamegraph.
fn flamegraph_names(answer: &Value) -> BTreeSet<String> {
    answer["flamegraph"]["names"]
        .as_array()
        .map(|names| {
            names
                .iter()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn pyroscope_answers_per_query_flamegraphs_on_and_off_cpu() -> Result<()> {
    require_root_and_bpf();
    let pyroscope = Pyroscope::get()?;
    let install = PgInstall::no_frame_pointers()?;
    let debug_dir = install
        .debug_dir
        .clone()
        .context("the nofp build has debug files")?;
    let cluster = PgCluster::start_with_pg_stat_statements(&install, &[])?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    // A service name of this run only: a shared server may hold earlier runs' data.
    let service = format!("pgscope-e2e-{}-{}", std::process::id(), now_ms());
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nupload_interval = \"3s\"\noff_cpu = true\ndebug_dirs = [\"{}\"]\n\
         [labels]\nservice_name = \"{service}\"\n[[discovery.include]]\ndata_dir = \"{}\"\n",
        pyroscope.url,
        debug_dir.display(),
        cluster.data_dir().display()
    );
    let start = now_ms();
    let agent = RunningAgent::start(&config, &[])?;
    let pgbench = cluster.spawn_pgbench(&["-S", "-c", "2", "-j", "2", "-T", "60"], 2)?;
    agent.wait_metric(
        "pgscope_export_pushes_total{result=\"ok\"}",
        "four pushes accepted by Pyroscope",
        Duration::from_secs(90),
        |pushes| pushes >= 4.0,
    )?;
    pgbench.stop()?;
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "agent exit {status}:\n{log}");
    let queryid = cluster.pgbench_select_queryid()?;
    let end = now_ms() + 1000;
    let selector = format!("{{service_name=\"{service}\"}}");

    // Both profile types exist.
    let types = wait_for("both profile types in Pyroscope", Duration::from_secs(60), || {
        let answer = pyroscope.call("ProfileTypes", json!({"start": start, "end": end}))?;
        let ids: BTreeSet<String> = answer["profileTypes"]
            .as_array()
            .map(|t| {
                t.iter()
                    .filter_map(|t| t["ID"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let cpu = ids
            .iter()
            .find(|id| id.starts_with("process_cpu:cpu:nanoseconds:cpu:nanoseconds"))
            .cloned();
        let off = ids.iter().find(|id| id.starts_with("offcpu:")).cloned();
        Ok(cpu.zip(off))
    })?;
    eprintln!("profile types: {types:?}");

    // The queryid values are pg_stat_statements'.
    let values = pyroscope.call(
        "LabelValues",
        json!({"name": "queryid", "matchers": [selector], "start": start, "end": end}),
    )?;
    let values: BTreeSet<String> = values["names"]
        .as_array()
        .map(|v| v.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    ensure!(
        values.contains(&queryid),
        "queryid {queryid} not among LabelValues {values:?}"
    );

    // A filter on that queryid returns stacks through exec_simple_query.
    let by_query = format!("{{service_name=\"{service}\",queryid=\"{queryid}\"}}");
    let cpu = pyroscope.call(
        "SelectMergeStacktraces",
        json!({"profileTypeID": types.0, "labelSelector": by_query, "start": start, "end": end}),
    )?;
    let names = flamegraph_names(&cpu);
    for expected in ["PostgresMain", "exec_simple_query", "PortalRun"] {
        ensure!(
            names.contains(expected),
            "no {expected} in the queryid's flamegraph: {names:?}"
        );
    }
    let total: u64 = cpu["flamegraph"]["total"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    ensure!(total > 0, "empty flamegraph for queryid {queryid}: {cpu}");
    eprintln!(
        "Pyroscope, process_cpu for queryid {queryid}: {:.2} s of CPU, {} distinct frames",
        total as f64 / 1e9,
        names.len()
    );

    // Off-CPU profiles are queryable too.
    let off = pyroscope.call(
        "SelectMergeStacktraces",
        json!({"profileTypeID": types.1, "labelSelector": selector, "start": start, "end": end}),
    )?;
    let off_total: u64 = off["flamegraph"]["total"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    ensure!(off_total > 0, "empty off-CPU flamegraph: {off}");
    Ok(())
}
