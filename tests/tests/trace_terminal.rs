//! What `pgscope trace` prints is for a terminal: control characters in a query's text reach it
//! escaped, never raw; a reader that went away (`| head`) ends printing but not the trace, and
//! SIGHUP (the terminal closed) finishes the trace like Ctrl-C.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::process::wait_timeout;
use pgscope_tests::workload::CPU_BOUND;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace, TraceSummary};

/// A statement whose text (outside its constants, which pg_stat_statements normalizes away)
/// holds ESC sequences (clear screen, colour), BEL, a C1 CSI (U+009B) and a right-to-left
/// override (U+202E): in a comment and in a quoted column alias.
const HOSTILE: &str = "SELECT count(*) AS \"\u{1b}[31mred\u{202e}live\u{9b}2J\" \
                       FROM generate_series(1, 300000) g /* \u{1b}[2J\u{7} */ WHERE g % 7 = 3;\n";

/// Raw characters that must never reach the terminal.
const RAW: [(&str, &str); 4] = [
    ("\u{1b}", "ESC"),
    ("\u{7}", "BEL"),
    ("\u{9b}", "C1 CSI"),
    ("\u{202e}", "RIGHT-TO-LEFT OVERRIDE"),
];

#[test]
fn control_characters_in_query_texts_are_printed_escaped() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("hostile.sql");
    std::fs::write(&script, HOSTILE)?;
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let script_arg = script.to_str().context("temp path is not UTF-8")?;
    let _load = cluster.spawn_pgbench(&["-n", "-c", "1", "-T", "60", "-f", script_arg], 1)?;
    let output = Trace::instance(cluster.data_dir()).duration_secs(4).output()?;
    let printed = format!("{}{}", output.stdout, output.stderr);
    for (raw, name) in RAW {
        ensure!(
            !printed.contains(raw),
            "{name} printed raw:\n{}",
            printed.escape_debug()
        );
    }
    // The text was printed, escaped: the check above is not passing on an empty table.
    for escaped in ["\\x1b[31mred", "\\u{202e}live\\u{9b}2J", "\\x1b[2J\\x07"] {
        ensure!(
            output.stdout.contains(escaped),
            "the query text is not in the summary as `{escaped}`:\n{}",
            output.stdout
        );
    }
    Ok(())
}

#[test]
fn a_closed_stdout_ends_printing_not_the_trace() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    let busy = cluster.spawn_session(CPU_BOUND)?;
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let mut command = Trace::pid(busy.pid()).duration_secs(3).json(&json).command()?;
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // The reader goes away before anything is printed, as `| head -0` or a closed pager would.
    drop(child.stdout.take());
    let stderr_pipe = child.stderr.take().context("stderr")?;
    let stderr_reader = std::thread::spawn(move || std::io::read_to_string(stderr_pipe).unwrap_or_default());
    let status = wait_timeout(&mut child, Duration::from_secs(120))?.context("pgscope did not exit")?;
    let stderr = stderr_reader.join().unwrap_or_default();
    ensure!(!stderr.contains("panicked"), "pgscope panicked:\n{stderr}");
    ensure!(status.success(), "pgscope exited with {status}:\n{stderr}");
    let summary = TraceSummary::read(&json).context("the JSON summary was not written whole")?;
    ensure!(summary.samples_profiled()? > 0, "the JSON summary has no samples");
    Ok(())
}

#[test]
fn sighup_finishes_the_trace_like_ctrl_c() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    let busy = cluster.spawn_session(CPU_BOUND)?;
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let running = Trace::pid(busy.pid()).duration_secs(120).json(&json).spawn()?;
    std::thread::sleep(Duration::from_secs(2));
    let output = running.stop_with(libc::SIGHUP)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        output.status.success(),
        "SIGHUP ended the trace with {}:\n{stderr}",
        output.status
    );
    ensure!(stderr.contains("stopped early"), "no `stopped early`:\n{stderr}");
    let summary = TraceSummary::read(&json).context("the JSON summary was not written")?;
    ensure!(summary.samples_profiled()? > 0, "the JSON summary has no samples");
    Ok(())
}
