//! gdb attached to a backend, for the tests that make it call a Postgres function (`s_lock`
//! with call sites of the test's choosing).
//!
//! gdb 13 (Debian 12) cannot restore a process's registers after such a call on CPUs with AMX:
//! it writes back a shorter XSAVE area than the kernel's, which refuses it ("Couldn't write
//! extended state status: Bad address"), and the call fails. Given a register description
//! without AVX, gdb saves and restores the general and SSE registers through the older
//! FXSAVE interface instead, which works everywhere. The description is assembled from
//! valgrind's copies of gdb's standard feature files (Debian's valgrind package; installed by
//! scripts/install-deps.sh). What it leaves unrestored, the upper halves of the vector
//! registers, is nothing a caller keeps across the system call an idle backend waits in: call
//! functions only in backends waiting for their client.

use std::path::Path;
use std::process::{Command, Output};

use anyhow::{Context, Result};

/// Where Debian's valgrind keeps gdb's x86-64 feature descriptions.
const FEATURES: &str = "/usr/libexec/valgrind";

/// The target: x86-64 Linux with the core, SSE and Linux (orig_rax) registers only.
const TARGET: &str = r#"<?xml version="1.0"?>
<!DOCTYPE target SYSTEM "gdb-target.dtd">
<target>
  <architecture>i386:x86-64</architecture>
  <osabi>GNU/Linux</osabi>
  <xi:include href="64bit-core.xml"/>
  <xi:include href="64bit-sse.xml"/>
  <xi:include href="64bit-linux.xml"/>
</target>
"#;

/// Runs gdb in batch mode attached to `pid`, with `commands` (each one `-ex`), and detaches.
pub fn batch(pid: u32, commands: &[String]) -> Result<Output> {
    let dir = tempfile::Builder::new().prefix("pgscope-gdb-").tempdir()?;
    for feature in ["64bit-core.xml", "64bit-sse.xml", "64bit-linux.xml"] {
        let from = Path::new(FEATURES).join(feature);
        std::fs::copy(&from, dir.path().join(feature)).with_context(|| {
            format!(
                "cannot read {} (scripts/install-deps.sh installs valgrind)",
                from.display()
            )
        })?;
    }
    let target = dir.path().join("target.xml");
    std::fs::write(&target, TARGET)?;
    let mut gdb = Command::new("gdb");
    gdb.args(["-batch", "-nx", "-ex"])
        .arg(format!("set tdesc filename {}", target.display()))
        .arg("-ex")
        .arg(format!("attach {pid}"));
    for command in commands {
        gdb.arg("-ex").arg(command);
    }
    gdb.output()
        .context("cannot run gdb (scripts/install-deps.sh installs it)")
}
