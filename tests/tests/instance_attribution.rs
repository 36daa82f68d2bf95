//! `--instance` profiles every process of one cluster and attributes each sample to the right
//! backend.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use pgscope_tests::workload::{is_md5_frame, is_numeric_frame, MD5_BOUND, NUMERIC_BOUND};
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Profile, Trace};

const FREQUENCY: u32 = 99;

/// Two backends with disjoint hot code; the instance is named by its data directory.
#[test]
fn samples_are_attributed_to_their_backend() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    let md5 = cluster.spawn_session(MD5_BOUND)?;
    let numeric = cluster.spawn_session(NUMERIC_BOUND)?;
    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("instance.folded");
    let pprof = dir.path().join("instance.pb.gz");

    let watch = cluster.watch_processes()?;
    Trace::instance(cluster.data_dir())
        .duration_secs(6)
        .frequency(FREQUENCY)
        .folded(&folded)
        .pprof(&pprof)
        .run()?;
    let cluster_pids = watch.stop()?;
    ensure!(
        md5.is_active()? && numeric.is_active()?,
        "a workload ended during the trace"
    );

    let profile = Profile::read_folded(&folded)?;
    check_all_attributed(&profile, &cluster_pids)?;

    let by_pid = profile.samples_by_pid();
    eprintln!(
        "samples per pid: {by_pid:?} (md5 {}, numeric {})",
        md5.pid(),
        numeric.pid()
    );
    for (name, pid) in [("md5", md5.pid()), ("numeric", numeric.pid())] {
        let n = by_pid.get(&pid).copied().unwrap_or(0);
        // Each busy backend has most of a core: ~6 s × 99 Hz ≈ 600 samples.
        ensure!(
            n >= 100,
            "the {name} backend {pid} has {n} samples; per pid: {by_pid:?}"
        );
    }

    for (name, pid, is_marker) in [
        ("md5", md5.pid(), is_md5_frame as fn(&str) -> bool),
        ("numeric", numeric.pid(), is_numeric_frame as fn(&str) -> bool),
    ] {
        let marked = |s: &pgscope_tests::Stack| s.any_frame(is_marker);
        let elsewhere = profile.count_where(|s| marked(s) && s.process_pid() != Some(pid));
        ensure!(
            elsewhere == 0,
            "{elsewhere} samples with {name} functions are attributed to another pid than {pid}:\n{}",
            profile.examples_where(|s| marked(s) && s.process_pid() != Some(pid), 5)
        );
        // Otherwise the check above would pass with a profile that never names these functions.
        let own = profile.count_where(|s| s.process_pid() == Some(pid));
        let own_marked = profile.count_where(|s| marked(s) && s.process_pid() == Some(pid));
        eprintln!("{name}: {own_marked} of {own} samples of pid {pid} have {name} functions");
        ensure!(
            own_marked * 10 >= own * 3,
            "only {own_marked} of {own} samples of the {name} backend {pid} have {name} functions (perf: ~75%):\n{}",
            profile.examples_where(|s| s.process_pid() == Some(pid), 5)
        );
    }

    check_pprof(&pprof)?;
    Ok(())
}

/// The instance named by its postmaster pid instead of its data directory.
#[test]
fn instance_by_postmaster_pid() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    let md5 = cluster.spawn_session(MD5_BOUND)?;
    let dir = tempfile::tempdir()?;
    let folded = dir.path().join("instance.folded");

    let watch = cluster.watch_processes()?;
    Trace::instance(cluster.postmaster_pid()?.to_string())
        .duration_secs(3)
        .frequency(FREQUENCY)
        .folded(&folded)
        .run()?;
    let cluster_pids = watch.stop()?;

    let profile = Profile::read_folded(&folded)?;
    check_all_attributed(&profile, &cluster_pids)?;
    let n = profile.count_where(|s| s.process_pid() == Some(md5.pid()) && s.any_frame(is_md5_frame));
    ensure!(
        n >= 50,
        "only {n} md5 samples for backend {}; per pid: {:?}",
        md5.pid(),
        profile.samples_by_pid()
    );
    Ok(())
}

/// Every stack starts with `postgres-<pid>` for a process of this cluster.
fn check_all_attributed(profile: &Profile, cluster_pids: &BTreeSet<u32>) -> Result<()> {
    ensure!(profile.total() > 0, "the profile is empty");
    let unrooted = profile.count_where(|s| s.process_pid().is_none());
    ensure!(
        unrooted == 0,
        "{unrooted} samples do not start with a `postgres-<pid>` frame:\n{}",
        profile.examples_where(|s| s.process_pid().is_none(), 5)
    );
    let foreign: BTreeSet<u32> = profile
        .samples_by_pid()
        .into_keys()
        .filter(|pid| !cluster_pids.contains(pid))
        .collect();
    ensure!(
        foreign.is_empty(),
        "samples from pids {foreign:?}, which are not processes of this cluster {cluster_pids:?}; \
         their stacks (what the process was doing tells which it was):\n{}",
        profile.examples_where(|s| s.process_pid().is_some_and(|pid| foreign.contains(&pid)), 5)
    );
    Ok(())
}

/// The pprof file is gzip-compressed and names the backend's functions.
fn check_pprof(path: &Path) -> Result<()> {
    let compressed = std::fs::read(path).with_context(|| format!("cannot read `{}`", path.display()))?;
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(compressed.as_slice())
        .read_to_end(&mut raw)
        .with_context(|| format!("`{}` is not gzip", path.display()))?;
    // Function names live in the profile's string table as plain UTF-8.
    for name in ["PostgresMain", "pg_md5_hash"] {
        ensure!(
            raw.windows(name.len()).any(|w| w == name.as_bytes()),
            "`{}` ({} bytes decompressed) does not mention `{name}`",
            path.display(),
            raw.len()
        );
    }
    Ok(())
}
