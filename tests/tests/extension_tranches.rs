//! A wait on an LWLock whose tranche an extension requested by name is labelled with that name,
//! as `pg_stat_activity` shows it (`LWLock:pg_stat_statements`), not `LWLock:extension`: pgscope
//! reads the names the postmaster copied into shared memory (`NamedLWLockTrancheArray`).

use anyhow::{ensure, Result};
use pgscope_tests::activity::{label_sets, Activity};
use pgscope_tests::workload::CPU_BOUND;
use pgscope_tests::{require_root_and_bpf, LabeledProfile, PgCluster, PgInstall, Trace};

const FREQUENCY: u32 = 99;
const PGSS_WAIT: &str = "LWLock:pg_stat_statements";

/// Makes backend `pid`, busy on CPU, report a wait on pg_stat_statements' LWLock tranche, and
/// returns the tranche id. Postgres names the id in shared memory: `NamedLWLockTrancheArray`
/// holds one `{int trancheId; char *trancheName;}` per tranche requested by name, and with
/// pg_stat_statements the only library preloaded, its tranche is the only one. The backend's
/// `*my_wait_event_info` (its `MyProc->wait_event_info`) is then set to `PG_WAIT_LWLOCK | id`,
/// as `LWLockReportWaitStart` does. A real wait sleeps off CPU, where an on-CPU profiler takes
/// no samples; this one lasts as long as the query runs, on CPU. gdb only reads and writes
/// memory: it calls no function in a backend that is running a query ([`pgscope_tests::gdb`]).
fn report_pgss_tranche_wait(pid: u32) -> Result<u32> {
    let commands = [
        "set $tranches = *(char **) &NamedLWLockTrancheArray",
        "set $id = *(int *) $tranches",
        "print $id",
        "print *(int *) &NamedLWLockTrancheRequests",
        "print *(char **) ($tranches + 8)",
        "set var **(unsigned int **) &my_wait_event_info = 0x01000000 | $id",
    ]
    .map(String::from);
    let output = pgscope_tests::gdb::batch(pid, &commands)?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let value = |n: u32| {
        stdout
            .lines()
            .find_map(|line| line.strip_prefix(&format!("${n} = ")))
            .map(str::trim)
    };
    let id = value(1).and_then(|id| id.parse().ok());
    let requests = value(2);
    let name = value(3);
    match id {
        Some(id)
            if output.status.success()
                && requests == Some("1")
                && name.is_some_and(|n| n.ends_with("\"pg_stat_statements\"")) =>
        {
            Ok(id)
        }
        _ => anyhow::bail!(
            "gdb could not set a pg_stat_statements wait in backend {pid} (tranche {id:?}, \
             named tranches {requests:?}, the first named {name:?}):\n{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}

/// The tranche is named whether the names are read from the postmaster (`--instance`) or from
/// the backend itself (`--pid`).
#[test]
fn pg_stat_statements_lwlock_waits_carry_the_tranche_name() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let session = cluster.spawn_session(CPU_BOUND)?;
    let pid = session.pid();
    let tranche = report_pgss_tranche_wait(pid)?;
    let shown = |when: &str| -> Result<()> {
        let rows = Activity::read(&cluster, &format!("pid = {pid}"))?;
        ensure!(
            rows.len() == 1 && rows[0].wait_event.as_deref() == Some(PGSS_WAIT),
            "{when}, pg_stat_activity does not show backend {pid} waiting on {PGSS_WAIT} (tranche {tranche}): {rows:?}"
        );
        Ok(())
    };
    shown("after gdb set the wait")?;
    eprintln!(
        "backend {pid} reports a wait on tranche {tranche}, which pg_stat_activity shows as {PGSS_WAIT}"
    );

    let dir = tempfile::tempdir()?;
    for (name, trace) in [
        ("instance", Trace::instance(cluster.data_dir())),
        ("pid", Trace::pid(pid)),
    ] {
        let pprof = dir.path().join(format!("{name}.pb.gz"));
        trace.duration_secs(3).frequency(FREQUENCY).pprof(&pprof).run()?;
        shown(&format!("after the {name} trace"))?;
        let profile = LabeledProfile::read_pprof(&pprof)?;
        let own = |s: &pgscope_tests::LabeledSample| s.pid() == Some(pid);
        let n = profile.count_where(own);
        let named = profile.count_where(|s| own(s) && s.label("wait_event") == Some(PGSS_WAIT));
        eprintln!(
            "{name}: {named} of {n} samples of backend {pid} carry wait_event={PGSS_WAIT}; by wait_event: {}",
            label_sets(&profile, pid, &["wait_event"])
        );
        ensure!(n >= 150, "{name}: only {n} samples of the busy backend {pid}");
        ensure!(
            named == n,
            "{name}: {} of {n} samples of backend {pid} do not carry wait_event={PGSS_WAIT}:\n{}",
            n - named,
            profile.examples_where(|s| own(s) && s.label("wait_event") != Some(PGSS_WAIT), 5)
        );
    }
    Ok(())
}
