//! `--probe FUNCTION=PATH:OFFSET` attaches only at an offset proven to start an instruction of a
//! function: a uprobe in the middle of an instruction corrupts it in every process mapping the
//! file, and the backend that runs it crashes the whole instance into recovery.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use object::{Object, ObjectSegment, ObjectSymbol};
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace};

const FUNCTION: &str = "LockRelationOid";

/// File offset of an exported function of `binary`.
fn function_offset(binary: &Path, name: &str) -> Result<u64> {
    let bytes = std::fs::read(binary)?;
    let file = object::File::parse(&*bytes)?;
    let address = file
        .dynamic_symbols()
        .find(|s| s.name() == Ok(name))
        .with_context(|| format!("`{}` exports no `{name}`", binary.display()))?
        .address();
    file.segments()
        .find_map(|segment| {
            let (offset, size) = segment.file_range();
            let start = segment.address();
            (address >= start && address - start < size).then(|| offset + (address - start))
        })
        .with_context(|| format!("`{name}` is in no segment of `{}`", binary.display()))
}

/// What shows that the server stayed up: its postmaster and the time it started.
fn server_identity(cluster: &PgCluster) -> Result<(u32, String)> {
    Ok((
        cluster.postmaster_pid()?,
        cluster
            .psql("SELECT pg_postmaster_start_time()")?
            .trim()
            .to_owned(),
    ))
}

#[test]
fn offsets_inside_instructions_are_refused_and_postgres_never_crashes() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::distro()?;
    let cluster = PgCluster::start(&install)?;
    let binary: PathBuf = std::fs::canonicalize(install.bin("postgres"))?;
    let start = function_offset(&binary, FUNCTION)?;
    cluster.pgbench(&["-i", "-q", "-s", "1"])?;
    let before = server_identity(&cluster)?;
    // Every statement locks its relations: the probed function runs all through the trace.
    let _load = cluster.spawn_pgbench(&["-n", "-S", "-c", "1", "-T", "600"], 1)?;

    // Inside its second and third instructions (Debian: `mov %rsp,%rbp`, `push %r12`), and the
    // ELF header.
    for (what, offset) in [
        ("one byte into the second instruction", start + 2),
        ("inside the function's third instruction", start + 5),
        ("the ELF header", 0x10),
    ] {
        let spec = format!("{FUNCTION}={}:{offset:#x}", binary.display());
        let output = Trace::instance(cluster.data_dir())
            .explicit_probe(&spec)
            .probe_budget("none")
            .duration_secs(2)
            .output()?;
        ensure!(
            output.stderr.contains(&format!("probe {FUNCTION} not attached")),
            "--probe at {what} ({offset:#x}) was not refused:\n{}",
            output.stderr
        );
        ensure!(
            !output.stderr.contains("panicked"),
            "pgscope panicked:\n{}",
            output.stderr
        );
        eprintln!("{what}: {}", refusal_line(&output.stderr));
    }

    // The function's first instruction is accepted and counts calls.
    let spec = format!("{FUNCTION}={}:{start:#x}", binary.display());
    let output = Trace::instance(cluster.data_dir())
        .explicit_probe(&spec)
        .probe_budget("none")
        .duration_secs(2)
        .output()?;
    ensure!(
        !output.stderr.contains("not attached") && output.stdout.contains(FUNCTION),
        "--probe at the function's start was not used:\n{}\n{}",
        output.stderr,
        output.stdout
    );

    let after = server_identity(&cluster)?;
    let log = cluster.server_log();
    ensure!(
        before == after,
        "the server restarted: postmaster and start time {before:?} became {after:?}\n{log}"
    );
    for crash in [
        "terminated by signal",
        "was terminated",
        "all server processes terminated",
    ] {
        ensure!(
            !log.contains(crash),
            "the server log shows a crash (`{crash}`):\n{log}"
        );
    }
    Ok(())
}

fn refusal_line(stderr: &str) -> &str {
    stderr
        .lines()
        .find(|line| line.contains("not attached"))
        .unwrap_or_default()
}
