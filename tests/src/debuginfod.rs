//! A real debuginfod server (elfutils' `debuginfod`, Debian package `debuginfod`) serving a
//! directory of debug files on a port of 127.0.0.1, stopped on drop.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tempfile::TempDir;

use crate::process::{describe, wait_for};

/// Indexing the no-frame-pointer build's debug tree (~50 MB, 70 files) takes a few seconds.
const INDEX_TIMEOUT: Duration = Duration::from_secs(120);

/// A running `debuginfod -F <dir>` with its own database and log in a temp dir.
pub struct DebuginfodServer {
    child: Child,
    port: u16,
    dir: TempDir,
}

impl DebuginfodServer {
    /// Starts a server indexing the ELF/DWARF files under `debug_dir` and returns once it has
    /// indexed all of them.
    pub fn serve(debug_dir: &Path) -> Result<Self> {
        let dir = tempfile::tempdir().context("cannot create a temp dir for debuginfod")?;
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .context("cannot bind 127.0.0.1:0 to pick a port")?
            .port();
        let log = std::fs::File::create(dir.path().join("debuginfod.log"))
            .context("cannot create the debuginfod log")?;
        let mut cmd = Command::new("debuginfod");
        // -F: scan plain ELF/DWARF files; -t 0 / -g 0: one scan and one groom, no periodic
        // rescans; -c 1: one scanner thread on this shared machine; no source files to serve.
        cmd.arg("-F")
            .args(["-p", &port.to_string()])
            .arg("-d")
            .arg(dir.path().join("index.sqlite"))
            .args(["-t", "0", "-g", "0", "-c", "1", "--disable-source-scan"])
            .arg(debug_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let line = describe(&cmd);
        let child = cmd.spawn().with_context(|| {
            format!("cannot start `{line}`: install the `debuginfod` package (`make deps`)")
        })?;
        let mut server = DebuginfodServer { child, port, dir };
        server
            .wait_indexed()
            .with_context(|| format!("`{line}` did not finish indexing; its log:\n{}", server.log()))?;
        Ok(server)
    }

    /// The base URL, as DEBUGINFOD_URLS takes it.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The HTTP status of `GET /buildid/<build_id>/debuginfo`.
    pub fn debuginfo_status(&self, build_id: &str) -> Result<u16> {
        Ok(self.get(&format!("/buildid/{build_id}/debuginfo"))?.0)
    }

    /// What the server wrote to stderr so far (one line per request).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("debuginfod.log")).unwrap_or_default()
    }

    /// Polls `/metrics` until the traversal of the directory is done and no file waits to be
    /// scanned or is being scanned.
    fn wait_indexed(&mut self) -> Result<()> {
        wait_for("debuginfod to index its directory", INDEX_TIMEOUT, || {
            if let Some(status) = self.child.try_wait()? {
                bail!("debuginfod exited ({status})");
            }
            // Not listening yet: try again.
            let Ok((200, body)) = self.get("/metrics") else {
                return Ok(None);
            };
            let metrics = String::from_utf8_lossy(&body);
            let value = |name: &str| -> Option<u64> {
                metrics
                    .lines()
                    .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
            };
            let traversed = value("thread_work_total{role=\"traverse\"}").unwrap_or(0) >= 1;
            let idle = [
                "thread_busy{role=\"traverse\"}",
                "thread_busy{role=\"scan\"}",
                "thread_work_pending{role=\"scan\"}",
            ]
            .iter()
            .all(|name| value(name) == Some(0));
            Ok((traversed && idle).then_some(()))
        })
    }

    /// A bare HTTP/1.0 GET: the status and the body.
    fn get(&self, path: &str) -> Result<(u16, Vec<u8>)> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response)?;
        let head_end = response
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .context("no end of headers in debuginfod's answer")?;
        let status_line = String::from_utf8_lossy(&response[..head_end]);
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .with_context(|| format!("no status in `{status_line}`"))?;
        Ok((status, response[head_end + 4..].to_vec()))
    }
}

impl Drop for DebuginfodServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
