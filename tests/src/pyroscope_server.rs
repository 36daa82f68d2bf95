//! A real Grafana Pyroscope for end-to-end tests, queried back through its own querier API
//! (Connect JSON) as Grafana does: the one `PGSCOPE_TEST_PYROSCOPE_URL` points at, else one
//! built from the Go module proxy by `scripts/pyroscope-server.sh` (cached) and started for the
//! test, killed when dropped.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

use crate::{workspace_root, PgCluster, RunningAgent};

pub struct PyroscopeServer {
    url: String,
    /// The server started for this test (killed at the end) and its data directory.
    owned: Option<(u32, tempfile::TempDir)>,
}

/// Starts tried before giving up, each on ports found free just before.
const START_ATTEMPTS: u32 = 5;

/// A loopback port whose next two are free too, as the server needs them.
fn three_free_ports() -> Result<u16> {
    use std::net::TcpListener;
    for _ in 0..100 {
        let base = TcpListener::bind("127.0.0.1:0")?;
        let port = base.local_addr()?.port();
        let Some(last) = port.checked_add(2) else {
            continue;
        };
        let next: Vec<_> = (port + 1..=last)
            .filter_map(|p| TcpListener::bind(("127.0.0.1", p)).ok())
            .collect();
        if next.len() == 2 {
            return Ok(port);
        }
    }
    bail!("no three consecutive free loopback ports after 100 tries")
}

impl PyroscopeServer {
    /// The server of `PGSCOPE_TEST_PYROSCOPE_URL`, else a new one on a free loopback port,
    /// its data in a temp dir; returns once it is ready.
    pub fn get() -> Result<Self> {
        if let Ok(url) = std::env::var("PGSCOPE_TEST_PYROSCOPE_URL") {
            return Ok(Self {
                url: url.trim_end_matches('/').to_string(),
                owned: None,
            });
        }
        let dir = tempfile::Builder::new().prefix("pgscope-pyroscope-").tempdir()?;
        let script = workspace_root().join("scripts/pyroscope-server.sh");
        // The server listens on PORT, PORT+1 and PORT+2: all three are checked free, and a
        // start that lost one of them to another process meanwhile (a cluster's or a client's
        // port) is tried again on others.
        let mut attempt = 0;
        let (port, output) = loop {
            attempt += 1;
            let port = three_free_ports()?;
            let output = Command::new(&script)
                .arg("start")
                .arg(port.to_string())
                .arg(dir.path())
                .output()
                .with_context(|| format!("running {}", script.display()))?;
            let stderr = String::from_utf8_lossy(&output.stderr);
            if output.status.success() {
                break (port, output);
            }
            if attempt < START_ATTEMPTS && stderr.contains("address already in use") {
                continue;
            }
            bail!("cannot start Pyroscope ({}): {stderr}", output.status);
        };
        let pid: u32 = String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .context("scripts/pyroscope-server.sh printed no pid")?;
        Ok(Self {
            url: format!("http://127.0.0.1:{port}"),
            owned: Some((pid, dir)),
        })
    }

    /// Where to push (the agent's `[pyroscope] url`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// One Connect unary call of `querier.v1.QuerierService` with a JSON body.
    pub fn call(&self, method: &str, body: Value) -> Result<Value> {
        let url = format!("{}/querier.v1.QuerierService/{method}", self.url);
        let mut response = ureq::post(&url)
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .with_context(|| format!("POST {url}"))?;
        let text = response.body_mut().read_to_string()?;
        serde_json::from_str(&text).with_context(|| format!("{method} answered `{text}`"))
    }

    /// The values of label `name` over the series `selector` (`{k="v",…}`) matches between
    /// `start` and `end` (unix ms).
    pub fn label_values(&self, name: &str, selector: &str, start: i64, end: i64) -> Result<BTreeSet<String>> {
        let answer = self.call(
            "LabelValues",
            json!({"name": name, "matchers": [selector], "start": start, "end": end}),
        )?;
        Ok(answer["names"]
            .as_array()
            .map(|v| v.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
            .unwrap_or_default())
    }
}

impl Drop for PyroscopeServer {
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

/// `pgscope agent` on `cluster` (debug files in `debug_dir`) pushing to `pyroscope` as service
/// `service` every 3 s, under `pgbench -S` (2 clients), until four pushes are accepted; then
/// both are stopped and the agent must exit cleanly. `collection` adds lines to the agent's
/// `[collection]`. Returns when the agent started, in unix milliseconds.
pub fn push_pgbench_run(
    pyroscope: &PyroscopeServer,
    cluster: &PgCluster,
    debug_dir: &Path,
    service: &str,
    collection: &str,
) -> Result<i64> {
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nupload_interval = \"3s\"\n{collection}\ndebug_dirs = [\"{}\"]\n\
         [labels]\nservice_name = \"{service}\"\n[[discovery.include]]\ndata_dir = \"{}\"\n",
        pyroscope.url(),
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
    Ok(start)
}

/// Now as unix milliseconds, the unit of the querier API's `start` and `end`.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
