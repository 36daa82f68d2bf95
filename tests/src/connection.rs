//! One client connection the test sends statements through one at a time: the same backend runs
//! all of them, and its pid is known before the first.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::cluster::PgCluster;
use crate::process::{pid_exists, wait_for, wait_timeout};

/// Longest one statement may take; the tests' statements take seconds.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(300);
const EXIT_TIMEOUT: Duration = Duration::from_secs(30);

/// An interactive `psql -XAtq` fed through its stdin. Each statement is followed by an `\echo`
/// of a marker, so its output is the lines before the marker. Dropping it ends psql.
pub struct Connection<'a> {
    cluster: &'a PgCluster,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Option<JoinHandle<String>>,
    backend_pid: u32,
    statements: u64,
}

impl PgCluster {
    /// Opens a connection and returns once its backend has told its pid.
    pub fn connect(&self) -> Result<Connection<'_>> {
        let mut child = self
            .psql_command()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot start psql for a connection")?;
        let stdin = child.stdin.take();
        let (send, lines) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if send.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        let stderr = child.stderr.take().map(|mut pipe| {
            thread::spawn(move || {
                let mut text = String::new();
                let _ = pipe.read_to_string(&mut text);
                text
            })
        });
        let mut connection = Connection {
            cluster: self,
            child,
            stdin,
            lines,
            stderr,
            backend_pid: 0,
            statements: 0,
        };
        let pid = connection.query("SELECT pg_backend_pid()")?;
        connection.backend_pid = pid
            .trim()
            .parse()
            .with_context(|| format!("pg_backend_pid() returned `{pid}`"))?;
        Ok(connection)
    }
}

impl Connection<'_> {
    /// Pid of the backend serving this connection.
    pub fn pid(&self) -> u32 {
        self.backend_pid
    }

    /// Runs one statement and returns its output (unaligned, tuples only) without the trailing
    /// newline. An error in the statement ends psql (`ON_ERROR_STOP`) and is returned.
    pub fn query(&mut self, sql: &str) -> Result<String> {
        self.run(sql, &terminated(sql))
    }

    /// Runs `sql`, which must fail (e.g. `BEGIN; SELECT 1/0`), and returns its SQLSTATE. Unlike
    /// [`Connection::query`], psql goes on: the backend stays, in an aborted transaction when
    /// the error came inside one. Fails if `sql` succeeded.
    pub fn query_expecting_error(&mut self, sql: &str) -> Result<String> {
        // psql sets ERROR and LAST_ERROR_SQLSTATE after each statement.
        let script = format!(
            "\\set ON_ERROR_STOP off\n{}\\echo {ERROR_REPORT} :ERROR :LAST_ERROR_SQLSTATE\n\\set ON_ERROR_STOP on\n",
            terminated(sql)
        );
        let output = self.run(sql, &script)?;
        let report = output.lines().last().unwrap_or_default();
        let words: Vec<&str> = report
            .strip_prefix(ERROR_REPORT)
            .map(|rest| rest.split_whitespace().collect())
            .unwrap_or_default();
        match words.as_slice() {
            ["true", sqlstate] => Ok((*sqlstate).to_owned()),
            _ => bail!("`{sql}` was expected to fail; psql printed:\n{output}"),
        }
    }

    /// Sends `script` (the statement `sql` with psql commands around it) and returns what it
    /// printed before the marker that follows it.
    fn run(&mut self, sql: &str, script: &str) -> Result<String> {
        self.statements += 1;
        let marker = format!("pgscope-statement-{}-done", self.statements);
        let sql = sql.trim_end();
        let script = format!("{script}\\echo {marker}\n");
        let stdin = self.stdin.as_mut().context("the connection is closed")?;
        if let Err(e) = stdin.write_all(script.as_bytes()).and_then(|()| stdin.flush()) {
            return Err(self.failure(sql, &format!("cannot write to psql: {e}")));
        }
        let deadline = Instant::now() + STATEMENT_TIMEOUT;
        let mut output = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line == marker => return Ok(output.join("\n")),
                Ok(line) => output.push(line),
                Err(RecvTimeoutError::Timeout) => {
                    bail!("`{sql}` did not finish within {STATEMENT_TIMEOUT:?}")
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.failure(sql, "psql exited")),
            }
        }
    }

    /// Ends psql and waits until the backend process is gone: by then it has flushed its
    /// statistics (pg_stat_* counters) to shared memory.
    pub fn close(mut self) -> Result<()> {
        self.stdin = None;
        if wait_timeout(&mut self.child, EXIT_TIMEOUT)?.is_none() {
            bail!("psql did not exit within {EXIT_TIMEOUT:?} of closing its input");
        }
        let pid = self.backend_pid;
        wait_for(&format!("backend {pid} to exit"), EXIT_TIMEOUT, || {
            Ok((!pid_exists(pid)).then_some(()))
        })
    }

    fn failure(&mut self, sql: &str, what: &str) -> anyhow::Error {
        self.stdin = None;
        let status = wait_timeout(&mut self.child, EXIT_TIMEOUT).ok().flatten();
        let stderr = self.stderr.take().and_then(|t| t.join().ok()).unwrap_or_default();
        let log = self.cluster.server_log();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        anyhow::anyhow!(
            "{what} ({status:?}) running `{sql}` on backend {}: {}\nlast lines of the server log:\n{}",
            self.backend_pid,
            stderr.trim(),
            tail.join("\n")
        )
    }
}

/// Starts the line [`Connection::query_expecting_error`] reads psql's error variables from.
const ERROR_REPORT: &str = "pgscope-error-report";

/// `sql` ending in `;` and a newline: a statement without its `;` would stay in psql's buffer
/// and the marker after it never come.
fn terminated(sql: &str) -> String {
    let sql = sql.trim_end();
    let terminator = if sql.ends_with(';') { "" } else { ";" };
    format!("{sql}{terminator}\n")
}

impl Drop for Connection<'_> {
    fn drop(&mut self) {
        self.stdin = None;
        if !matches!(wait_timeout(&mut self.child, Duration::from_secs(5)), Ok(Some(_))) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
