//! `pgbench` running in the background while a trace records it.

use std::io::Read;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::cluster::PgCluster;
use crate::cpu_window::{CpuWindow, SchedTime};
use crate::process::{describe, wait_for};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// The end of pgbench's stderr kept for error messages.
const STDERR_KEPT: usize = 16 << 10;

/// pgbench's stderr, read as it comes: a script whose statements raise notices ("relation …
/// already exists, skipping") fills a pipe nobody reads within a few hundred transactions,
/// and pgbench then blocks with its backends idle in their transactions.
struct StderrTail {
    kept: Arc<Mutex<Vec<u8>>>,
    reader: Option<JoinHandle<()>>,
}

impl StderrTail {
    fn start<R: Read + Send + 'static>(pipe: Option<R>) -> Self {
        let kept = Arc::new(Mutex::new(Vec::new()));
        let shared = Arc::clone(&kept);
        let reader = pipe.map(|mut pipe| {
            thread::spawn(move || {
                let mut chunk = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    let mut kept = shared.lock().unwrap_or_else(PoisonError::into_inner);
                    kept.extend_from_slice(&chunk[..n]);
                    let excess = kept.len().saturating_sub(STDERR_KEPT);
                    kept.drain(..excess);
                }
            })
        });
        Self { kept, reader }
    }

    /// What was kept, once pgbench has exited and its pipe is read to its end.
    fn after_exit(&mut self) -> String {
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        String::from_utf8_lossy(&kept).trim().to_string()
    }
}

/// A `pgbench` run the test does not wait for. Dropping it kills pgbench and waits until its
/// connections are gone from `pg_stat_activity`.
pub struct BackgroundPgbench<'a> {
    cluster: &'a PgCluster,
    child: Child,
    tag: String,
    line: String,
    stderr: StderrTail,
}

impl PgCluster {
    /// Starts `pgbench <args> postgres` and returns once `clients` of its connections are in
    /// `pg_stat_activity` (pgbench starts its script as soon as all are connected). Its
    /// connections are told apart by a unique `application_name`. `args` should make pgbench
    /// outlive whatever the test does meanwhile (a long `-T`).
    pub fn spawn_pgbench(&self, args: &[&str], clients: usize) -> Result<BackgroundPgbench<'_>> {
        self.spawn_pgbench_in("postgres", args, clients)
    }

    /// [`PgCluster::spawn_pgbench`] in `database`.
    pub fn spawn_pgbench_in(
        &self,
        database: &str,
        args: &[&str],
        clients: usize,
    ) -> Result<BackgroundPgbench<'_>> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let tag = format!(
            "pgscope-pgbench-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut cmd = self.client("pgbench");
        cmd.args(args)
            .arg(database)
            .env("PGAPPNAME", &tag)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let line = describe(&cmd);
        let mut child = cmd.spawn().with_context(|| format!("cannot start `{line}`"))?;
        let stderr = StderrTail::start(child.stderr.take());
        let mut pgbench = BackgroundPgbench {
            cluster: self,
            child,
            tag,
            line: line.clone(),
            stderr,
        };
        wait_for(
            &format!("{clients} connections of `{line}`"),
            CONNECT_TIMEOUT,
            || {
                if let Some(status) = pgbench.child.try_wait()? {
                    bail!(
                        "`{line}` exited ({status}) before it ran: {}",
                        pgbench.stderr.after_exit()
                    );
                }
                Ok((pgbench.connections()? >= clients).then_some(()))
            },
        )?;
        Ok(pgbench)
    }
}

impl BackgroundPgbench<'_> {
    /// The `application_name` of its connections.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// `true` while pgbench has not exited.
    pub fn is_running(&mut self) -> Result<bool> {
        Ok(self.child.try_wait()?.is_none())
    }

    /// Fails if pgbench exited (an error, or a `-T` shorter than the test's wait).
    pub fn ensure_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "`{}` exited ({status}) while the test measured it: {}",
                self.line,
                self.stderr.after_exit()
            );
        }
        Ok(())
    }

    /// Starts measuring its backends' CPU time from now on.
    pub fn cpu_window(&self) -> Result<CpuWindow> {
        CpuWindow::start(&self.backend_pids()?)
    }

    /// Returns once its backends together have used `cpu` of CPU time from now on, with the
    /// time they spent on CPU and waiting for one meanwhile; fails after `timeout` saying how
    /// far they got, or if pgbench exited.
    pub fn run_for_cpu(&mut self, cpu: Duration, timeout: Duration) -> Result<SchedTime> {
        let used = self
            .cpu_window()?
            .await_cpu(cpu, timeout)
            .with_context(|| format!("`{}` did not get {cpu:?} of CPU", self.line))?;
        self.ensure_running()?;
        Ok(used)
    }

    /// Kills pgbench and waits until its backends have ended, so that no statement of this run
    /// is recorded after this returns.
    pub fn stop(mut self) -> Result<()> {
        self.kill_and_wait()
    }

    /// The PIDs of its backends (its client connections), for measuring their CPU time.
    pub fn backend_pids(&self) -> Result<Vec<u32>> {
        crate::cpu_window::client_backends(self.cluster, &self.tag)
    }

    fn connections(&self) -> Result<usize> {
        let n = self.cluster.psql(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{}'",
            self.tag
        ))?;
        n.parse().with_context(|| format!("bad count `{n}`"))
    }

    fn kill_and_wait(&mut self) -> Result<()> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A backend notices its client is gone only when it next talks to it: after the
        // statement it is running.
        wait_for(
            &format!("the backends of `{}` to exit", self.tag),
            CONNECT_TIMEOUT,
            || Ok((self.connections()? == 0).then_some(())),
        )
    }
}

impl Drop for BackgroundPgbench<'_> {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            if let Err(e) = self.kill_and_wait() {
                eprintln!("cannot stop pgbench `{}`: {e:#}", self.tag);
            }
        }
    }
}
