//! The files `pgscope trace` and `pgscope report` write: owner-only (0600) whatever the umask,
//! an existing file included, unless `--output-mode` says otherwise; every path checked before
//! anything is profiled; and a file that cannot be written at the end costs only itself.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::pgscope::pgscope_command;
use pgscope_tests::process::output_with_timeout;
use pgscope_tests::workload::CPU_BOUND;
use pgscope_tests::{require_root_and_bpf, run_pgscope, PgCluster, PgInstall, Trace, TraceSummary};

/// A refused path must end pgscope at once; a regression profiles for its whole duration.
const REFUSE_TIMEOUT: Duration = Duration::from_secs(30);
/// What pgscope prints on stderr once sampling runs.
const PROFILING: &str = "pgscope: profiling ";

fn mode_of(path: &Path) -> Result<u32> {
    let metadata =
        std::fs::metadata(path).with_context(|| format!("`{}` was not written", path.display()))?;
    Ok(metadata.permissions().mode() & 0o7777)
}

/// The umask most shells run with: without pgscope's care, files would be 0644.
fn usual_umask() {
    // SAFETY: umask(2) only sets this process's mask, inherited by the pgscope it starts.
    unsafe { libc::umask(0o022) };
}

#[test]
fn every_output_is_readable_by_its_owner_only_unless_asked() -> Result<()> {
    require_root_and_bpf();
    usual_umask();
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    let busy = cluster.spawn_session(CPU_BOUND)?;
    let dir = tempfile::tempdir()?;
    let file = |name: &str| dir.path().join(name);
    // An old flamegraph left world-readable: replacing it must not keep its mode.
    std::fs::write(file("out.svg"), "old")?;
    std::fs::set_permissions(file("out.svg"), std::fs::Permissions::from_mode(0o644))?;
    Trace::pid(busy.pid())
        .duration_secs(3)
        .off_cpu()
        .svg(&file("out.svg"))
        .folded(&file("out.folded"))
        .pprof(&file("out.pb.gz"))
        .json(&file("out.json"))
        .record(&file("out.rec"))
        .report(&file("out.html"))
        .output()?;
    let written = [
        "out.svg",
        "out.offcpu.svg",
        "out.folded",
        "out.offcpu.folded",
        "out.pb.gz",
        "out.offcpu.pb.gz",
        "out.json",
        "out.rec",
        "out.html",
    ];
    let mut wrong = Vec::new();
    for name in written {
        let mode = mode_of(&file(name))?;
        if mode != 0o600 {
            wrong.push(format!("{name}: {mode:o}"));
        }
    }
    ensure!(wrong.is_empty(), "files not 0600 under umask 022: {wrong:?}");

    // The report of the recording, in both modes; and a trace asked for group-readable files.
    let rec = file("out.rec");
    for (mode_arg, expected, name) in [(None, 0o600, "report.html"), (Some("0640"), 0o640, "shared.html")] {
        let out = file(name);
        let mut args = vec![
            "report".into(),
            "--from".into(),
            path_arg(&rec)?,
            "--out".into(),
            path_arg(&out)?,
        ];
        if let Some(mode) = mode_arg {
            args.extend(["--output-mode".to_string(), mode.to_string()]);
        }
        let result = run_pgscope(&args)?;
        ensure!(
            result.status.success(),
            "pgscope report failed: {}",
            String::from_utf8_lossy(&result.stderr)
        );
        let mode = mode_of(&out)?;
        ensure!(
            mode == expected,
            "report --out {name} is {mode:o}, not {expected:o}"
        );
    }
    let shared = file("shared.json");
    let mut trace = pgscope_command([
        "trace",
        "--pid",
        &busy.pid().to_string(),
        "--duration",
        "2s",
        "--json",
        &path_arg(&shared)?,
        "--output-mode",
        "0640",
    ])?;
    let result = output_with_timeout(&mut trace, Duration::from_secs(120))?;
    ensure!(
        result.status.success(),
        "trace --output-mode 0640 failed: {}",
        String::from_utf8_lossy(&result.stderr)
    );
    ensure!(
        mode_of(&shared)? == 0o640,
        "--output-mode 0640 gave {:o}",
        mode_of(&shared)?
    );

    for bad in ["999", "abc"] {
        let result = run_pgscope(["trace", "--pid", &busy.pid().to_string(), "--output-mode", bad])?;
        let stderr = String::from_utf8_lossy(&result.stderr);
        ensure!(
            !result.status.success() && stderr.contains("invalid value") && stderr.contains("--output-mode"),
            "--output-mode {bad} was not refused as an invalid mode: {stderr}"
        );
    }
    Ok(())
}

fn path_arg(path: &Path) -> Result<String> {
    Ok(path.to_str().context("temp path is not UTF-8")?.to_string())
}

#[test]
fn bad_output_paths_are_refused_before_profiling() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    let busy = cluster.spawn_session(CPU_BOUND)?;
    let dir = tempfile::tempdir()?;
    let same = path_arg(&dir.path().join("same.out"))?;
    let cases: [(&str, Vec<String>, &str); 3] = [
        (
            "a directory that does not exist",
            vec!["--svg".into(), "/nonexistent-pgscope-dir/out.svg".into()],
            "--svg `/nonexistent-pgscope-dir/out.svg`",
        ),
        (
            "a path that is a directory",
            vec!["--json".into(), path_arg(dir.path())?],
            "is a directory",
        ),
        (
            "one file for two outputs",
            vec!["--svg".into(), same.clone(), "--json".into(), same],
            "is the same file as",
        ),
    ];
    for (what, outputs, expected) in cases {
        let mut args = vec![
            "trace".to_string(),
            "--pid".into(),
            busy.pid().to_string(),
            "--duration".into(),
            "60s".into(),
        ];
        args.extend(outputs);
        let mut command = pgscope_command(&args)?;
        let result = output_with_timeout(&mut command, REFUSE_TIMEOUT)
            .with_context(|| format!("{what}: pgscope did not refuse it before profiling"))?;
        let stderr = String::from_utf8_lossy(&result.stderr);
        ensure!(!result.status.success(), "{what}: accepted:\n{stderr}");
        ensure!(
            !stderr.contains(PROFILING),
            "{what}: pgscope profiled before refusing:\n{stderr}"
        );
        ensure!(
            stderr.contains(expected),
            "{what}: the error does not say `{expected}`:\n{stderr}"
        );
        ensure!(
            !stderr.contains("panicked"),
            "{what}: pgscope panicked:\n{stderr}"
        );
    }
    ensure!(
        !dir.path().join("same.out").exists(),
        "checking the paths created a file"
    );
    Ok(())
}

#[test]
fn an_output_that_cannot_be_written_at_the_end_costs_only_itself() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    let busy = cluster.spawn_session(CPU_BOUND)?;
    let doomed = tempfile::tempdir()?;
    let kept = tempfile::tempdir()?;
    let svg = doomed.path().join("out.svg");
    let in_kept = |name: &str| -> PathBuf { kept.path().join(name) };
    let running = Trace::pid(busy.pid())
        .duration_secs(120)
        .svg(&svg)
        .folded(&in_kept("out.folded"))
        .json(&in_kept("out.json"))
        .record(&in_kept("out.rec"))
        .spawn()?;
    // The directory goes away while the trace runs: the check at the start passed.
    std::thread::sleep(Duration::from_secs(2));
    std::fs::remove_dir_all(doomed.path())?;
    let result = running.stop_with(libc::SIGINT)?;
    let stderr = String::from_utf8_lossy(&result.stderr);
    ensure!(
        !result.status.success(),
        "pgscope exited 0 though the flamegraph was not written:\n{stderr}"
    );
    ensure!(!stderr.contains("panicked"), "pgscope panicked:\n{stderr}");
    ensure!(
        stderr.contains(&svg.display().to_string()),
        "the error does not name the file not written:\n{stderr}"
    );
    for name in ["out.folded", "out.json", "out.rec"] {
        let size = std::fs::metadata(in_kept(name))
            .with_context(|| format!("{name} was lost with the flamegraph:\n{stderr}"))?
            .len();
        ensure!(size > 0, "{name} is empty");
    }
    let summary = TraceSummary::read(&in_kept("out.json")).context("the JSON summary does not parse")?;
    ensure!(summary.samples_profiled()? > 0, "the JSON summary has no samples");
    Ok(())
}
