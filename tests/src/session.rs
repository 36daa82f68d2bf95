//! A client session running one long query in the background.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::cluster::PgCluster;
use crate::process::{wait_for, wait_timeout};

const ACTIVE_TIMEOUT: Duration = Duration::from_secs(30);

/// A `psql` running a query the test does not wait for, and the pid of the backend serving it.
/// Dropping it cancels the query (`pg_cancel_backend`) and ends the `psql`.
pub struct Session<'a> {
    cluster: &'a PgCluster,
    child: Child,
    backend_pid: u32,
    tag: String,
}

impl PgCluster {
    /// Starts `sql` in a background `psql` and returns once its backend reports `state =
    /// 'active'` in `pg_stat_activity`. The backend is found by a unique `application_name`,
    /// since the query itself cannot return its pid before it finishes.
    pub fn spawn_session(&self, sql: &str) -> Result<Session<'_>> {
        self.spawn_psql(&["-c", sql], sql)
    }

    /// Runs the SQL file `script` (readable by the cluster's user) in a background `psql`, one
    /// command after the other, for commands that cannot share one query (`VACUUM`), and
    /// returns once its backend first reports `state = 'active'`. Between two commands the
    /// backend is briefly idle: ask [`Session::is_running`], not `is_active`, whether it still
    /// runs.
    pub fn spawn_script_session(&self, script: &Path) -> Result<Session<'_>> {
        let path = script.to_str().context("the script's path is not UTF-8")?;
        self.spawn_psql(&["-f", path], &format!("the commands of {path}"))
    }

    fn spawn_psql(&self, args: &[&str], what: &str) -> Result<Session<'_>> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let tag = format!(
            "pgscope-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut cmd = self.psql_command();
        cmd.env("PGAPPNAME", &tag)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let child = cmd
            .spawn()
            .context("cannot start psql for a background session")?;
        let mut session = Session {
            cluster: self,
            child,
            backend_pid: 0,
            tag,
        };
        session.backend_pid = session.wait_active(what)?;
        Ok(session)
    }
}

impl Session<'_> {
    /// Pid of the backend process running the query.
    pub fn pid(&self) -> u32 {
        self.backend_pid
    }

    /// The `application_name` that identifies this session.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// `true` while the backend still runs the query (fails if the client died).
    pub fn is_active(&self) -> Result<bool> {
        let state = self.cluster.psql(&format!(
            "SELECT state FROM pg_stat_activity WHERE pid = {}",
            self.backend_pid
        ))?;
        Ok(state == "active")
    }

    /// `true` while the session's `psql` has commands left to run (its backend may be between
    /// two of them).
    pub fn is_running(&mut self) -> Result<bool> {
        Ok(self.child.try_wait()?.is_none())
    }

    /// Fails, with psql's exit status and what it printed, once the session's `psql` has
    /// exited: `what` ended early.
    pub fn ensure_running(&mut self, what: &str) -> Result<()> {
        let Some(status) = self.child.try_wait()? else {
            return Ok(());
        };
        let mut stderr = String::new();
        if let Some(pipe) = self.child.stderr.as_mut() {
            let _ = pipe.read_to_string(&mut stderr);
        }
        bail!("{what} ended early: psql exited ({status}): {}", stderr.trim())
    }

    /// Waits until the backend has finished its query (no longer active).
    pub fn wait_until_finished(&self) -> Result<()> {
        wait_for(
            &format!("backend {} to finish its query", self.backend_pid),
            ACTIVE_TIMEOUT,
            || Ok((!self.is_active()?).then_some(())),
        )
    }

    /// Waits until pg_stat_activity shows the backend waiting on `wait_event`
    /// (`type:event`, e.g. `Lock:transactionid`).
    pub fn wait_until_waiting_on(&self, wait_event: &str) -> Result<()> {
        let query = format!(
            "SELECT coalesce(wait_event_type || ':' || wait_event, '') FROM pg_stat_activity \
             WHERE pid = {}",
            self.backend_pid
        );
        wait_for(
            &format!("backend {} to wait on {wait_event}", self.backend_pid),
            ACTIVE_TIMEOUT,
            || Ok((self.cluster.psql(&query)? == wait_event).then_some(())),
        )
    }

    fn wait_active(&mut self, sql: &str) -> Result<u32> {
        // Parallel workers show their leader's application_name: only the client backend is
        // the session's own (a worker listed first would pose as the session's backend).
        let query = format!(
            "SELECT pid FROM pg_stat_activity WHERE application_name = '{}' AND state = 'active' \
             AND backend_type = 'client backend'",
            self.tag
        );
        wait_for(
            &format!("session `{}` to become active", self.tag),
            ACTIVE_TIMEOUT,
            || {
                if let Some(status) = self.child.try_wait()? {
                    let mut stderr = String::new();
                    if let Some(pipe) = self.child.stderr.as_mut() {
                        let _ = pipe.read_to_string(&mut stderr);
                    }
                    bail!(
                        "the session's psql exited ({status}) before its query ran: {}\nquery: {sql}",
                        stderr.trim()
                    );
                }
                let out = self.cluster.psql(&query)?;
                match out.lines().next() {
                    Some(pid) => Ok(Some(
                        pid.trim().parse().with_context(|| format!("bad pid `{pid}`"))?,
                    )),
                    None => Ok(None),
                }
            },
        )
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        if self.backend_pid != 0 {
            if let Err(e) = self
                .cluster
                .psql(&format!("SELECT pg_cancel_backend({})", self.backend_pid))
            {
                eprintln!("cannot cancel backend {}: {e:#}", self.backend_pid);
            }
        }
        // After the cancel psql exits on its own; don't leave it behind if it does not.
        if !matches!(wait_timeout(&mut self.child, Duration::from_secs(5)), Ok(Some(_))) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
