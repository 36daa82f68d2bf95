//! `pgscope agent` under test: started with a config file, watched through its own HTTP
//! endpoints, stopped with SIGTERM as a service manager does.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tempfile::TempDir;

use crate::pgscope::pgscope_command;
use crate::process::wait_for;

/// How long the agent may take to attach and become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(90);
/// How long SIGTERM may take: the agent's own flush deadline is 10 s.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

pub struct RunningAgent {
    child: Option<Child>,
    metrics_port: u16,
    dir: TempDir,
}

impl RunningAgent {
    /// Starts `pgscope agent --config <config> --metrics-addr 127.0.0.1:<free port> <args>` and
    /// waits until `/readyz` answers 200.
    pub fn start(config: &str, args: &[&str]) -> Result<Self> {
        Self::start_with_env(config, args, &[])
    }

    /// The same with `env` added to the agent's environment (`PGSCOPE_NODE_NAME`, `KUBECONFIG`).
    pub fn start_with_env(config: &str, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("pgscope-agent-").tempdir()?;
        let config_path = dir.path().join("agent.toml");
        std::fs::write(&config_path, config)?;
        let metrics_port = free_port()?;
        let log = std::fs::File::create(dir.path().join("agent.log"))?;
        let mut command = pgscope_command(["agent", "--config"])?;
        command
            .arg(&config_path)
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{metrics_port}"))
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log);
        let child = command.spawn().context("starting pgscope agent")?;
        let mut agent = Self {
            child: Some(child),
            metrics_port,
            dir,
        };
        agent.wait_ready()?;
        Ok(agent)
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!(
                    "pgscope agent exited with {status} before it was ready:\n{}",
                    self.log()
                );
            }
            if let Ok((200, _)) = self.get("/readyz") {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("pgscope agent not ready after {READY_TIMEOUT:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("agent.toml")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Everything the agent logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// `GET path` on the agent's HTTP endpoint: (status, body).
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        http_get(self.metrics_port, path)
    }

    /// The value of one metric line, `name{labels}` exactly as exposed (labels in order).
    pub fn metric(&self, series: &str) -> Result<f64> {
        let (status, body) = self.get("/metrics")?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        metric_value(&body, series).with_context(|| format!("no `{series}` in /metrics:\n{body}"))
    }

    /// Waits until what the agent measured up to this call is in Pyroscope: an upload after the
    /// call (its interval's read holds everything until then) and an empty queue. On a busy
    /// machine the sender falls behind the intervals, and a stop gives the backlog only the
    /// agent's shutdown budget (what it cannot send by then it logs as lost): a test that
    /// compares what arrived with an exact count stops the agent after this.
    pub fn await_delivered(&self, timeout: Duration) -> Result<()> {
        // Per profile kind: their sum grows at every upload that had anything to send.
        let enqueued = || -> Result<f64> {
            let (_, body) = self.get("/metrics")?;
            Ok(body
                .lines()
                .filter(|line| line.starts_with("pgscope_profiles_enqueued_total{"))
                .filter_map(|line| line.rsplit_once(' ')?.1.parse::<f64>().ok())
                .sum())
        };
        let before = enqueued()?;
        wait_for("an upload after the workload", timeout, || {
            Ok((enqueued()? > before).then_some(()))
        })
        .with_context(|| format!("agent log:\n{}", self.log()))?;
        self.wait_metric(
            "pgscope_export_queue_batches",
            "every batch delivered to Pyroscope",
            timeout,
            |v| v == 0.0,
        )?;
        Ok(())
    }

    /// Waits until `condition` holds on the metric `series`.
    pub fn wait_metric(
        &self,
        series: &str,
        what: &str,
        timeout: Duration,
        condition: impl Fn(f64) -> bool,
    ) -> Result<f64> {
        wait_for(what, timeout, || {
            Ok(self.metric(series).ok().filter(|v| condition(*v)))
        })
        .with_context(|| format!("agent log:\n{}", self.log()))
    }

    /// Waits until the agent has found at least `count` Postgres instances.
    pub fn wait_for_instances(&self, count: usize) -> Result<()> {
        self.wait_metric(
            "pgscope_instances",
            &format!("the agent to find {count} instance(s)"),
            Duration::from_secs(30),
            |n| n >= count as f64,
        )
        .map(|_| ())
    }

    /// Sends a signal to the agent.
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.pid() as libc::pid_t, signal) };
    }

    /// SIGTERM, then waits for the exit: (status, log).
    pub fn terminate(mut self) -> Result<(ExitStatus, String)> {
        self.signal(libc::SIGTERM);
        let mut child = self.child.take().context("agent already stopped")?;
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok((status, self.log()));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!(
                    "pgscope agent still running {STOP_TIMEOUT:?} after SIGTERM:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if std::thread::panicking() {
                eprintln!("--- pgscope agent log ---\n{}", self.log());
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The value of `series` (`name` or `name{k="v",…}`) in a Prometheus text exposition.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok()).flatten()
        })
}

/// A plain HTTP/1.1 GET on 127.0.0.1.
pub fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status line")?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
